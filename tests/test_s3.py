"""Images in S3-compatible object storage (lean-image/s3.py, lean-image/locations.py) against a
real store: SeaweedFS on loopback (tests/s3store.py; the session fixture ``s3store``, and a
store of their own for the tests that kill it).

Reads (every command that reads an image), writes (convert, flatten, merge: a multipart
upload completed only at the end), chains whose links are objects, outputs refused, uploads
interrupted, an object replaced while it is read, the store gone while it is read, and the
clear errors of wrong credentials, missing buckets and keys and malformed URLs.

Each test keeps its objects under a prefix of its own (``prefix``), removed afterwards. The
images are small and synthetic but where a test needs an object larger than what the reader
fetches ahead (tens of MiB of random pages, which do not compress).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from helpers import qemu_save, run_leanimg, write_two_link_chain

TIMEOUT = 120
PS = 4096
MIB = 1 << 20


# -- helpers ---------------------------------------------------------------------------
def random_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def write_random_image(path, size: int, seed: int) -> bytes:
    """A flat lean image of one region "ram" of ``size`` bytes of random pages (stored
    incompressible: the object is about as large as the memory); returns the memory."""
    from leanimg.writer import LeanImageWriter

    data = random_bytes(size, seed)
    with LeanImageWriter(path, threads=2) as w:
        region = w.add_region("ram", size)
        step = 16 * MIB
        for at in range(0, size, step):
            w.put_pages(region, at // PS, data[at : at + step])
    return data


def cli(env, *args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return run_leanimg(*args, timeout=timeout, env=env)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def assert_error(proc, *fragments: str, status: int = 1) -> str:
    """Exit ``status``, no traceback; exit 1: exactly one stderr line 'leanimg: error: ...';
    exit 2: click's usage error. Every fragment in stderr. Returns stderr."""
    err = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\nstderr: {err}"
    assert "Traceback" not in err and "internal error" not in err, err
    if status == 1:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("leanimg: error: "), f"expected one error line, got:\n{err}"
    elif status == 2:
        assert "Error:" in err, err
    for fragment in fragments:
        assert fragment in err, f"expected {fragment!r} in:\n{err}"
    return err


def etag(client, bucket: str, key: str) -> str:
    return client.head_object(Bucket=bucket, Key=key)["ETag"]


def body(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def put(client, bucket: str, path, key: str) -> None:
    client.upload_file(str(path), bucket, key)


def keys(client, bucket: str, prefix: str = "") -> list[str]:
    return sorted(item["Key"] for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def uploads(client, bucket: str, prefix: str = "") -> list[dict]:
    return client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def kill_store(store) -> None:
    """The store gone at once (SIGKILL: no graceful end of the requests in flight)."""
    os.killpg(store.process.pid, signal.SIGKILL)
    store.process.wait(timeout=30)


def read_every_page(img) -> None:
    for region in img.regions:
        pages = region.size_bytes // img.page_size
        for first in range(0, pages, 256):
            img.region_bytes(region, first, min(256, pages - first))


_FETCHED_LINE = re.compile(r"^\s*fetched [\d.]+ MiB of [\d.]+ MiB in \d+ ranged GETs")


def _without_fetched(text: str) -> str:
    """``text`` without what inspect and validate add about an object's cost (the bytes and
    requests it took: "object storage:" and its "fetched ..." lines): a local file has none."""
    lines = text.splitlines()
    kept = []
    for i, line in enumerate(lines):
        if _FETCHED_LINE.match(line) or line.strip() == "object storage:":
            continue
        if not line.strip() and i + 1 < len(lines) and lines[i + 1].strip() == "object storage:":
            continue
        kept.append(line)
    return "\n".join(kept)


def _without_fetched_json(text: str, url: str, size: int):
    """The JSON document ``text`` without its "fetched" (checked first: the object, its size)."""
    doc = json.loads(text)
    if isinstance(doc, dict) and "fetched" in doc:
        fetched = doc.pop("fetched")
        assert [f["location"] for f in fetched] == [url], fetched
        assert fetched[0]["object_bytes"] == size, fetched
        assert 0 < fetched[0]["fetched_bytes"] and fetched[0]["requests"] > 0, fetched
    return doc


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env(s3store):
    return dict(os.environ, **s3store.env)


@pytest.fixture(scope="module")
def client(s3store):
    return s3store.client()


@pytest.fixture
def prefix(request, s3store, client):
    """A prefix of the test's own ("test-name/"); its objects and uploads removed afterwards."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-") + "/"
    assert keys(client, s3store.bucket, name) == [], f"objects left under {name}"
    yield name
    for key in keys(client, s3store.bucket, name):
        client.delete_object(Bucket=s3store.bucket, Key=key)
    for upload in uploads(client, s3store.bucket, name):
        client.abort_multipart_upload(Bucket=s3store.bucket, Key=upload["Key"], UploadId=upload["UploadId"])


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Two small synthetic QEMU saves (the second an update of the first) and their local
    conversions (next.lean against base.lean) and raw restores."""
    import types

    d = tmp_path_factory.mktemp("s3-saves")
    ram = bytearray(random_bytes(MIB, 1) + bytes(MIB) + bytes(range(256)) * (MIB // 256) + random_bytes(MIB, 2))
    base = d / "base.save"
    base.write_bytes(qemu_save(bytes(ram)))
    ram[5 * PS : 9 * PS] = random_bytes(4 * PS, 3)  # changed pages
    ram[MIB + PS : MIB + 3 * PS] = random_bytes(2 * PS, 4)  # zero pages now stored
    ram[3 * MIB + 7] ^= 0xFF  # a one-byte change (a delta)
    nxt = d / "next.save"
    nxt.write_bytes(qemu_save(bytes(ram)))
    local = d / "local"
    local.mkdir()
    ok(run_leanimg("convert", base, "-o", local / "base.lean", timeout=TIMEOUT))
    ok(run_leanimg("convert", nxt, "--parent", local / "base.lean", "-o", local / "next.lean", timeout=TIMEOUT))
    ok(run_leanimg("restore", local / "base.lean", "--to", "raw", "-o", d / "base.raw", timeout=TIMEOUT))
    ok(run_leanimg("restore", local / "base.lean", "--to", "qemu", "-o", d / "base.qemu", timeout=TIMEOUT))
    return types.SimpleNamespace(
        dir=d,
        base=base,
        next=nxt,
        base_lean=local / "base.lean",
        next_lean=local / "next.lean",
        base_raw=d / "base.raw",
        base_qemu=d / "base.qemu",
    )


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """write_two_link_chain (parent.lean, child.lean and the child's disk0.raw) and the raw
    restore of the child from the local files."""
    d = tmp_path_factory.mktemp("s3-chain")
    c = write_two_link_chain(d)
    c.raw = d / "child.raw"
    ok(run_leanimg("restore", c.child, "--disk", c.disk, "--to", "raw", "-o", c.raw, timeout=TIMEOUT))
    return c


@pytest.fixture(scope="module")
def big_save():
    """A QEMU save of 48 MiB of random pages: its image needs six PART_SIZE parts."""
    from leanimg import s3

    save = qemu_save(random_bytes(48 * MIB, 5))
    assert len(save) > 5 * s3.PART_SIZE
    return save


@pytest.fixture(scope="module")
def big_save_file(big_save, tmp_path_factory):
    path = tmp_path_factory.mktemp("s3-big") / "big.save"
    path.write_bytes(big_save)
    return path


@pytest.fixture
def in_process(monkeypatch):
    """Point this process's leanimg.s3 at a store: its environment, a new client (the module
    keeps one), and no read-ahead so that a block is fetched only when read."""
    from leanimg import s3

    def use(store, **extra):
        for key, value in {**store.env, **extra}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(s3, "_client", None)
        monkeypatch.setattr(s3, "AHEAD_BLOCKS", 0)

    return use


@pytest.fixture
def own_store(tmp_path):
    """A SeaweedFS of the test's own, to stop or kill (not the session's)."""
    from s3store import SeaweedFS, require_weed

    require_weed()
    store = SeaweedFS.start(tmp_path / "own-store")
    yield store
    store.stop()


# -- 1. round trip ---------------------------------------------------------------------------
def test_convert_to_an_object_and_restore_it_like_the_local_image(s3store, env, client, saves, prefix, tmp_path):
    url = s3store.url(prefix + "base.lean")
    ok(cli(env, "convert", saves.base, "-o", url))
    assert keys(client, s3store.bucket, prefix) == [prefix + "base.lean"]
    assert uploads(client, s3store.bucket, prefix) == []
    assert body(client, s3store.bucket, prefix + "base.lean")[:8] == saves.base_lean.read_bytes()[:8]

    ok(cli(env, "restore", url, "--to", "qemu", "-o", tmp_path / "back.qemu"))
    assert (tmp_path / "back.qemu").read_bytes() == saves.base_qemu.read_bytes()
    assert (tmp_path / "back.qemu").read_bytes() == saves.base.read_bytes()
    ok(cli(env, "restore", url, "--to", "raw", "-o", tmp_path / "back.raw"))
    assert (tmp_path / "back.raw").read_bytes() == saves.base_raw.read_bytes()


@pytest.fixture(scope="module")
def uploaded_base(s3store, client, saves):
    """saves.base_lean uploaded as it is (same bytes, same UUID as the local file)."""
    key = "same-output/base.lean"
    put(client, s3store.bucket, saves.base_lean, key)
    yield s3store.url(key)
    client.delete_object(Bucket=s3store.bucket, Key=key)


@pytest.mark.parametrize(
    "command",
    [
        ("inspect",),
        ("inspect", "--json"),
        ("validate",),
        ("validate", "--json"),
        ("map",),
        ("map", "--output", "json"),
        ("dump",),
    ],
    ids=" ".join,
)
def test_reading_commands_give_the_same_output_for_the_object_as_for_the_file(env, saves, uploaded_base, command):
    local = str(saves.base_lean)
    size = saves.base_lean.stat().st_size
    from_file = ok(cli(env, *command, local))
    from_object = ok(cli(env, *command, uploaded_base))
    assert uploaded_base in from_object.stdout + from_object.stderr or command[0] == "map"
    stdout = from_object.stdout.replace(uploaded_base, local)
    stderr = from_object.stderr.replace(uploaded_base, local)
    if "--json" in command or "json" in command or command == ("dump",):
        _without_fetched_json(from_object.stdout, uploaded_base, size)  # checks "fetched" where given
        assert _without_fetched_json(stdout, local, size) == json.loads(from_file.stdout)
    else:
        assert _without_fetched(stdout) == _without_fetched(from_file.stdout)
    assert _without_fetched(stderr) == _without_fetched(from_file.stderr)


# -- 2. chains whose links are objects ----------------------------------------------------------
def test_child_object_finds_its_parent_beside_it(s3store, env, client, chain, prefix, tmp_path):
    put(client, s3store.bucket, chain.parent, prefix + "parent.lean")
    put(client, s3store.bucket, chain.child, prefix + "child.lean")
    out = tmp_path / "child.raw"
    proc = ok(cli(env, "restore", s3store.url(prefix + "child.lean"), "--disk", chain.disk, "-o", out))
    assert "from 2 link(s)" in proc.stdout + proc.stderr
    assert out.read_bytes() == chain.raw.read_bytes()
    # and validate follows it the same way: every rule checked with the parent and the disk
    ok(cli(env, "validate", s3store.url(prefix + "child.lean"), "--disk", f"disk0={chain.disk}"))


def test_keys_with_spaces_and_non_ascii_characters(s3store, env, client, chain, prefix, tmp_path):
    folder = prefix + "a folder/ü+%20 "
    put(client, s3store.bucket, chain.parent, folder + "/pärent 1.lean")
    put(client, s3store.bucket, chain.child, folder + "/child +1.lean")
    out = tmp_path / "child.raw"
    ok(cli(env, "restore", s3store.url(folder + "/child +1.lean"), "--disk", chain.disk, "-o", out))
    assert out.read_bytes() == chain.raw.read_bytes()
    ok(
        cli(
            env,
            "flatten",
            s3store.url(folder + "/child +1.lean"),
            "--disk",
            chain.disk,
            "-o",
            s3store.url(folder + "/flat é.lean"),
        )
    )
    assert folder + "/flat é.lean" in keys(client, s3store.bucket, prefix)
    ok(cli(env, "restore", s3store.url(folder + "/flat é.lean"), "--disk", chain.disk, "-o", out, "-f"))
    assert out.read_bytes() == chain.raw.read_bytes()


@pytest.mark.parametrize("where", ["object", "local file"])
def test_parent_given_with_parent_from_another_prefix(s3store, env, client, chain, prefix, tmp_path, where):
    put(client, s3store.bucket, chain.child, prefix + "children/child.lean")
    if where == "object":
        put(client, s3store.bucket, chain.parent, prefix + "parents/parent.lean")
        parent = s3store.url(prefix + "parents/parent.lean")
    else:
        parent = str(chain.parent)
    child = s3store.url(prefix + "children/child.lean")
    out = tmp_path / "out" / "child.raw"
    out.parent.mkdir()
    assert_error(cli(env, "restore", child, "--disk", chain.disk, "-o", out), "not found")
    assert os.listdir(out.parent) == []
    ok(cli(env, "restore", child, "--parent", parent, "--disk", chain.disk, "-o", out))
    assert out.read_bytes() == chain.raw.read_bytes()


def test_local_child_with_its_parent_an_object(s3store, env, client, chain, prefix, tmp_path):
    put(client, s3store.bucket, chain.parent, prefix + "parent.lean")
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "child.lean").write_bytes(chain.child.read_bytes())
    out = tmp_path / "child.raw"
    ok(
        cli(
            env,
            "restore",
            alone / "child.lean",
            "--parent",
            s3store.url(prefix + "parent.lean"),
            "--disk",
            chain.disk,
            "-o",
            out,
        )
    )
    assert out.read_bytes() == chain.raw.read_bytes()


def test_child_object_whose_parent_is_missing_fails_clearly(s3store, env, client, chain, prefix, tmp_path):
    put(client, s3store.bucket, chain.child, prefix + "child.lean")
    put(client, s3store.bucket, chain.disk, prefix + "other.lean")  # a sibling that is no image
    out = tmp_path / "out"
    out.mkdir()
    err = assert_error(
        cli(env, "restore", s3store.url(prefix + "child.lean"), "--disk", chain.disk, "-o", out / "child.raw"),
        "not found",
    )
    assert "11111111-1111-1111-1111-111111111111" in err and s3store.url(prefix + "child.lean") in err
    assert os.listdir(out) == []


@pytest.mark.parametrize("operation", ["flatten", "merge"])
@pytest.mark.parametrize("to", ["object", "local file"])
def test_flatten_and_merge_an_object_chain(s3store, env, client, chain, prefix, tmp_path, operation, to):
    put(client, s3store.bucket, chain.parent, prefix + "chain/parent.lean")
    put(client, s3store.bucket, chain.child, prefix + "chain/child.lean")
    local = tmp_path / f"local-{operation}.lean"
    ok(cli(env, operation, chain.child, "--disk", chain.disk, "-o", local))
    if to == "object":  # under a prefix of its own: found without the parent only if self-contained
        output = s3store.url(prefix + f"out/{operation}.lean")
    else:
        output = str(tmp_path / f"{operation}.lean")
    ok(cli(env, operation, s3store.url(prefix + "chain/child.lean"), "--disk", chain.disk, "-o", output))
    if to == "object":
        assert keys(client, s3store.bucket, prefix + "out/") == [prefix + f"out/{operation}.lean"]
        assert uploads(client, s3store.bucket, prefix) == []
    out, expected = tmp_path / "out.raw", tmp_path / "expected.raw"
    proc = ok(cli(env, "restore", output, "--disk", chain.disk, "-o", out))
    assert "from 1 link(s)" in proc.stdout + proc.stderr
    ok(cli(env, "restore", local, "--disk", chain.disk, "-o", expected))
    assert out.read_bytes() == expected.read_bytes() == chain.raw.read_bytes()


def test_convert_against_a_parent_object(s3store, env, client, saves, prefix, tmp_path):
    put(client, s3store.bucket, saves.base_lean, prefix + "base.lean")
    url = s3store.url(prefix + "next.lean")
    ok(cli(env, "convert", saves.next, "--parent", s3store.url(prefix + "base.lean"), "-o", url))
    inspected = json.loads(ok(cli(env, "inspect", "--json", url)).stdout)
    base_uuid = json.loads(ok(cli(env, "inspect", "--json", saves.base_lean)).stdout)["image_uuid"]
    assert inspected["parent_uuid"] == base_uuid
    assert len(inspected["chain"]) == 2
    ok(cli(env, "restore", url, "--to", "qemu", "-o", tmp_path / "next.qemu"))
    assert (tmp_path / "next.qemu").read_bytes() == saves.next.read_bytes()
    ok(cli(env, "restore", saves.next_lean, "--to", "raw", "-o", tmp_path / "local.raw"))
    ok(cli(env, "restore", url, "--to", "raw", "-o", tmp_path / "object.raw"))
    assert (tmp_path / "object.raw").read_bytes() == (tmp_path / "local.raw").read_bytes()


# -- 3. outputs ----------------------------------------------------------------------------------
def test_existing_object_replaced_only_with_force(s3store, env, client, saves, prefix, tmp_path):
    key = prefix + "image.lean"
    url = s3store.url(key)
    ok(cli(env, "convert", saves.base, "-o", url))
    before, content = etag(client, s3store.bucket, key), body(client, s3store.bucket, key)
    assert_error(cli(env, "convert", saves.next, "-o", url), "exists", "-f", status=2)
    assert etag(client, s3store.bucket, key) == before and body(client, s3store.bucket, key) == content
    assert_error(cli(env, "flatten", saves.base_lean, "-o", url), "exists", status=2)
    assert body(client, s3store.bucket, key) == content
    ok(cli(env, "convert", saves.next, "-o", url, "-f"))
    assert etag(client, s3store.bucket, key) != before
    assert keys(client, s3store.bucket, prefix) == [key] and uploads(client, s3store.bucket, prefix) == []
    ok(cli(env, "restore", url, "--to", "qemu", "-o", tmp_path / "back.qemu"))
    assert (tmp_path / "back.qemu").read_bytes() == saves.next.read_bytes()


def test_an_input_object_is_never_the_output(s3store, env, client, saves, chain, prefix):
    put(client, s3store.bucket, saves.base_lean, prefix + "base.lean")
    put(client, s3store.bucket, chain.parent, prefix + "chain/parent.lean")
    put(client, s3store.bucket, chain.child, prefix + "chain/child.lean")
    base, parent, child = (s3store.url(prefix + k) for k in ("base.lean", "chain/parent.lean", "chain/child.lean"))
    before = {k: etag(client, s3store.bucket, k) for k in keys(client, s3store.bucket, prefix)}
    for args in [
        ("flatten", base, "-o", base, "-f"),
        ("merge", child, "--disk", chain.disk, "-o", child, "-f"),
        # a link found beside the image is an input too
        ("merge", child, "--disk", chain.disk, "-o", parent, "-f"),
        ("flatten", child, "--disk", chain.disk, "-o", parent, "-f"),
        ("convert", saves.next, "--parent", base, "-o", base, "-f"),
    ]:
        assert_error(cli(env, *args), "is an input", status=2)
    assert {k: etag(client, s3store.bucket, k) for k in keys(client, s3store.bucket, prefix)} == before
    assert uploads(client, s3store.bucket, prefix) == []


@pytest.mark.parametrize(
    "command",
    [("restore", "--to", "raw", "-o"), ("restore", "--to", "qemu", "-f", "-o"), ("inspect", "--map")],
    ids=" ".join,
)
def test_only_images_are_written_to_the_store(s3store, env, client, saves, prefix, command):
    put(client, s3store.bucket, saves.base_lean, prefix + "base.lean")
    target = s3store.url(prefix + "memory.out")
    args = (command[0], s3store.url(prefix + "base.lean"), *command[1:], target)
    assert_error(cli(env, *args), "cannot write " + target, "only images are written to object storage", status=2)
    assert keys(client, s3store.bucket, prefix) == [prefix + "base.lean"]


# -- 4. interrupted uploads -------------------------------------------------------------------------
def _convert_from_a_pipe(env, url: str, save: bytes, fed: int) -> subprocess.Popen:
    """`convert - -o URL` fed the first ``fed`` bytes of ``save`` and then left waiting for the
    rest: part-way through its upload, deterministically."""
    from leanimg.cli import command_line

    proc = subprocess.Popen(
        [*command_line(), "convert", "-", "-o", url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdin.write(save[:fed])  # returns once the converter has read it all
    proc.stdin.flush()
    return proc


def _wait_for_upload(s3store, client, proc, prefix: str, key: str) -> dict:
    """The upload of ``key``, once it exists and has a part."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        found = [u for u in uploads(client, s3store.bucket, prefix) if u["Key"] == key]
        if found:
            parts = client.list_parts(Bucket=s3store.bucket, Key=key, UploadId=found[0]["UploadId"]).get("Parts", [])
            if parts:
                return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no upload of {key} with a part within 60 s")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_convert_interrupted_part_way_leaves_neither_object_nor_upload(s3store, env, client, big_save, prefix, signum):
    key = prefix + "big.lean"
    proc = _convert_from_a_pipe(env, s3store.url(key), big_save, 40 * MIB)
    try:
        _wait_for_upload(s3store, client, proc, prefix, key)
        assert keys(client, s3store.bucket, prefix) == []  # the object appears only when complete
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert b"Traceback" not in err, err.decode()
    assert keys(client, s3store.bucket, prefix) == []
    assert uploads(client, s3store.bucket, prefix) == []


def test_convert_failing_part_way_aborts_its_upload(s3store, env, client, big_save, prefix):
    key = prefix + "big.lean"
    proc = _convert_from_a_pipe(env, s3store.url(key), big_save, 40 * MIB)
    try:
        _wait_for_upload(s3store, client, proc, prefix, key)
        proc.stdin.close()  # the save ends 8 MiB early: a truncated stream
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_error(subprocess.CompletedProcess(proc.args, proc.returncode, b"", err))
    assert keys(client, s3store.bucket, prefix) == []
    assert uploads(client, s3store.bucket, prefix) == []


def test_convert_killed_leaves_no_object_and_its_upload_is_found_and_aborted(s3store, env, client, big_save, prefix):
    key = prefix + "big.lean"
    proc = _convert_from_a_pipe(env, s3store.url(key), big_save, 40 * MIB)
    try:
        upload = _wait_for_upload(s3store, client, proc, prefix, key)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert keys(client, s3store.bucket, prefix) == []
    assert [u["UploadId"] for u in uploads(client, s3store.bucket, prefix)] == [upload["UploadId"]]
    location = s3store.url(prefix.rstrip("/"))
    listed = ok(cli(env, "uploads", location))
    assert s3store.url(key) in listed.stdout and upload["UploadId"] in listed.stdout
    assert uploads(client, s3store.bucket, prefix) != []  # listing aborts nothing
    ok(cli(env, "uploads", location, "--abort"))
    assert uploads(client, s3store.bucket, prefix) == []
    assert keys(client, s3store.bucket, prefix) == []
    assert upload["UploadId"] not in ok(cli(env, "uploads", location)).stdout


def test_uploads_json_is_one_json_document(s3store, env, client, prefix):
    key = prefix + "left.lean"
    upload_id = client.create_multipart_upload(Bucket=s3store.bucket, Key=key)["UploadId"]
    proc = ok(cli(env, "uploads", s3store.url(prefix.rstrip("/")), "--json"))
    doc = json.loads(proc.stdout)  # stdout is the JSON document and nothing else
    assert [(u["location"], u["upload_id"]) for u in doc["uploads"]] == [(s3store.url(key), upload_id)]
    assert doc["aborted"] is False
    assert [u["UploadId"] for u in uploads(client, s3store.bucket, prefix)] == [upload_id]


@pytest.mark.parametrize("location", ["s3://leanimg-no-such-bucket-u/some/prefix", "s3://leanimg-no-such-bucket-u"])
def test_uploads_of_a_missing_bucket_says_so(env, location):
    assert_error(cli(env, "uploads", location), "bucket 'leanimg-no-such-bucket-u' does not exist", location)


# -- 5. an object replaced while it is read ----------------------------------------------------
@pytest.fixture(scope="module")
def eight_mib_image(tmp_path_factory):
    """An image of 8 MiB of random pages (larger than what opening reads whole)."""
    from leanimg.reader import WHOLE_READ_BELOW

    path = tmp_path_factory.mktemp("s3-eight") / "eight.lean"
    memory = write_random_image(path, 8 * MIB, 6)
    assert path.stat().st_size > 4 * WHOLE_READ_BELOW
    return path, memory


@pytest.mark.parametrize("replacement", ["other bytes", "shorter object", "deleted"])
def test_object_replaced_after_it_was_opened_is_refused(
    s3store, client, eight_mib_image, prefix, in_process, replacement
):
    from leanimg.reader import LeanImage
    from leanimg.s3 import StoreError

    path, memory = eight_mib_image
    key = prefix + "image.lean"
    url = s3store.url(key)
    put(client, s3store.bucket, path, key)
    in_process(s3store)
    with LeanImage.open(url) as img:
        region = img.regions[0]
        assert bytes(img.region_bytes(region, 0, 1)) == memory[:PS]  # readable as opened
        if replacement == "other bytes":
            client.put_object(Bucket=s3store.bucket, Key=key, Body=random_bytes(path.stat().st_size, 7))
        elif replacement == "shorter object":
            client.put_object(Bucket=s3store.bucket, Key=key, Body=b"not the image it was")
        else:
            client.delete_object(Bucket=s3store.bucket, Key=key)
        with pytest.raises(StoreError) as caught:
            read_every_page(img)
    message = str(caught.value)
    assert url in message
    if replacement == "deleted":
        assert "deleted since it was opened" in message
    else:
        assert "replaced since it was opened" in message


@pytest.fixture(scope="module")
def large_object(s3store, client, tmp_path_factory):
    """112 MiB of random pages as an object: more than a restore fetches ahead of its output
    (two 32 MiB chunks and the 32 MiB read ahead of them)."""
    path = tmp_path_factory.mktemp("s3-large") / "large.lean"
    write_random_image(path, 112 * MIB, 8)
    key = "large/large.lean"
    put(client, s3store.bucket, path, key)
    path.unlink()
    yield s3store.url(key)
    client.delete_object(Bucket=s3store.bucket, Key=key)


def test_restore_refuses_an_object_replaced_mid_read(s3store, env, client, large_object):
    from leanimg.cli import command_line

    key = large_object[len(f"s3://{s3store.bucket}/") :]
    before = etag(client, s3store.bucket, key)
    proc = subprocess.Popen(
        [*command_line(), "restore", large_object, "--to", "raw", "-o", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        first = proc.stdout.read(PS)  # it is writing: the rest waits until the pipe is read
        assert len(first) == PS
        # replaced by other content (a server-side copy of another object, of another size)
        client.put_object(Bucket=s3store.bucket, Key=key + ".other", Body=b"other content" * 1000)
        client.copy_object(Bucket=s3store.bucket, Key=key, CopySource={"Bucket": s3store.bucket, "Key": key + ".other"})
        assert etag(client, s3store.bucket, key) != before
        rest, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.delete_object(Bucket=s3store.bucket, Key=key + ".other")
    assert_error(
        subprocess.CompletedProcess(proc.args, proc.returncode, b"", err),
        large_object,
        "the object was replaced since it was opened",
    )
    out = first + rest
    assert 0 < len(out) < 112 * MIB  # cut short: never bytes of the new object
    assert out == random_bytes(112 * MIB, 8)[: len(out)]


# -- 6. the store gone while it is read ---------------------------------------------------------
def test_store_gone_after_open_fails_the_read(own_store, eight_mib_image, in_process):
    from leanimg.reader import LeanImage
    from leanimg.s3 import StoreError

    path, memory = eight_mib_image
    put(own_store.client(), own_store.bucket, path, "gone/image.lean")
    in_process(own_store, AWS_MAX_ATTEMPTS="2")
    with LeanImage.open(own_store.url("gone/image.lean")) as img:
        assert bytes(img.region_bytes(img.regions[0], 0, 1)) == memory[:PS]
        kill_store(own_store)
        started = time.monotonic()
        with pytest.raises(StoreError, match="cannot reach the store"):
            read_every_page(img)
        assert time.monotonic() - started < 60


def test_restore_with_the_store_gone_mid_read_leaves_no_output(own_store, tmp_path):
    from leanimg.cli import command_line

    write_random_image(tmp_path / "image.lean", 64 * MIB, 9)
    put(own_store.client(), own_store.bucket, tmp_path / "image.lean", "gone/image.lean")
    url = own_store.url("gone/image.lean")
    env = dict(os.environ, **dict(own_store.env, AWS_MAX_ATTEMPTS="2"))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [*command_line(), "-q", "restore", url, "-o", out / "out.raw"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not os.listdir(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)  # its temporary output appears once the image is open
        proc.send_signal(signal.SIGSTOP)
        assert proc.poll() is None, "the restore ended before the store was stopped"
        kill_store(own_store)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert_error(
        subprocess.CompletedProcess(proc.args, proc.returncode, b"", err),
        url,
        "reading bytes",
        "cannot reach the store",
    )
    assert os.listdir(out) == []  # no partial file, no temporary one


@pytest.fixture(scope="module")
def nowhere():
    """An endpoint nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "command",
    [
        ("inspect", "s3://leanimg/x.lean"),
        ("restore", "s3://leanimg/x.lean", "-o", "{out}/x.raw"),
        ("convert", "{save}", "-o", "s3://leanimg/x.lean"),
        ("convert", "{save}", "-o", "s3://leanimg/x.lean", "-f"),
    ],
    ids=["inspect", "restore", "convert", "convert -f"],
)
def test_no_store_at_the_endpoint(env, saves, nowhere, tmp_path, command):
    args = [a.format(out=tmp_path, save=saves.base) for a in command]
    started = time.monotonic()
    assert_error(cli(dict(env, AWS_ENDPOINT_URL=nowhere, AWS_MAX_ATTEMPTS="2"), *args), "cannot reach the store")
    assert time.monotonic() - started < 60
    assert os.listdir(tmp_path) == []


# -- 7. credentials, buckets, keys ------------------------------------------------------------
READ_CASES = {
    "wrong secret": ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, None, "credentials"),
    "unknown access key": ({"AWS_ACCESS_KEY_ID": "nobody"}, None, "credentials"),
    "missing bucket": ({}, "s3://leanimg-no-such-bucket-r/x.lean", "does not exist"),
    "missing key": ({}, "s3://leanimg/errors/no-such-key.lean", "no such object"),
}


@pytest.mark.parametrize("case", list(READ_CASES))
@pytest.mark.parametrize("command", ["inspect", "restore"])
def test_reading_fails_clearly(env, uploaded_base, tmp_path, case, command):
    changes, url, message = READ_CASES[case]
    url = url or uploaded_base
    args = ("restore", url, "-o", tmp_path / "out.raw") if command == "restore" else (command, url)
    err = assert_error(cli(dict(env, **changes), *args), message, url)
    if "credentials" in message:
        assert "no such object" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("how", ["checked first", "single PUT (-f)", "multipart (-f)"])
def test_writing_with_wrong_credentials_fails_clearly(s3store, env, client, saves, big_save_file, prefix, how):
    url = s3store.url(prefix + "out.lean")
    save = big_save_file if how == "multipart (-f)" else saves.base
    force = ("-f",) if how != "checked first" else ()
    assert_error(
        cli(dict(env, AWS_SECRET_ACCESS_KEY="not-the-secret"), "convert", save, "-o", url, *force), "credentials", url
    )
    assert keys(client, s3store.bucket, prefix) == [] and uploads(client, s3store.bucket, prefix) == []


def test_no_credentials_at_all(env, uploaded_base, tmp_path):
    bare = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    bare.update(
        AWS_ENDPOINT_URL=env["AWS_ENDPOINT_URL"],
        AWS_DEFAULT_REGION="us-east-1",
        AWS_MAX_ATTEMPTS="2",
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    assert_error(cli(bare, "inspect", uploaded_base), "no credentials", uploaded_base)


@pytest.mark.parametrize("size", ["single PUT", "multipart"])
def test_writing_to_a_missing_bucket_fails_clearly(env, client, saves, big_save_file, size):
    bucket = "leanimg-no-such-bucket-" + ("s" if size == "single PUT" else "m")
    url = f"s3://{bucket}/x.lean"
    try:
        proc = cli(env, "convert", big_save_file if size == "multipart" else saves.base, "-o", url)
        created = bucket in [b["Name"] for b in client.list_buckets()["Buckets"]]
        assert_error(proc, "does not exist", bucket)
        assert not created
    finally:
        _remove_bucket(client, bucket)


def _remove_bucket(client, bucket: str) -> None:
    from botocore.exceptions import ClientError

    try:
        for item in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=item["Key"])
        for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        client.delete_bucket(Bucket=bucket)
    except ClientError:
        pass  # it never was


# -- 8. malformed URLs ----------------------------------------------------------------------
MALFORMED = ["s3://leanimg", "s3://leanimg/", "s3:///key.lean", "s3://", "s3://leanimg/folder/"]


@pytest.mark.parametrize(
    "command, url",
    [("inspect", url) for url in MALFORMED]
    + [("convert -o", url) for url in ("s3://leanimg", "s3:///key.lean", "s3://leanimg/folder/")],
)
def test_malformed_url_fails_clearly(s3store, env, client, saves, command, url):
    before = keys(client, s3store.bucket)
    args = ("inspect", url) if command == "inspect" else ("convert", saves.base, "-o", url)
    proc = cli(env, *args)
    assert proc.returncode in (1, 2), proc.stderr
    assert_error(proc, "expected s3://BUCKET/KEY", repr(url), status=proc.returncode)
    assert keys(client, s3store.bucket) == before
    assert [b["Name"] for b in client.list_buckets()["Buckets"]] == [s3store.bucket]
