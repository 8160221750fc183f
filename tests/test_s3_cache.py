"""The local read-through cache of object blocks (LEANIMG_S3_CACHE, s3.DiskCache), against a
real store (SeaweedFS): a second read fetches nothing, a damaged cache file is fetched again,
the cache keeps to its limit, a replaced object is never served from the old one's blocks."""

import json
import os

import pytest

from helpers import qemu_save, run_leanimg

MIB = 1 << 20


@pytest.fixture(scope="module")
def stored(s3store, tmp_path_factory):
    """A ~6 MiB image of random pages (little compression: several blocks) in the store."""
    folder = tmp_path_factory.mktemp("s3-cache")
    ram = os.urandom(6 * MIB) + bytes(2 * MIB)
    (folder / "vm.save").write_bytes(qemu_save(ram))
    assert run_leanimg("convert", folder / "vm.save", "-o", folder / "vm.lean", timeout=120).returncode == 0
    s3store.client().upload_file(str(folder / "vm.lean"), s3store.bucket, "cache/vm.lean")
    return folder, s3store.url("cache/vm.lean")


def fetched(proc) -> int:
    assert proc.returncode in (0, 4), proc.stderr
    return sum(f["fetched_bytes"] for f in json.loads(proc.stdout)["fetched"])


def cache_bytes(directory) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_a_second_read_fetches_nothing_and_a_damaged_block_is_fetched_again(s3store, stored, tmp_path):
    folder, url = stored
    env = dict(os.environ, **s3store.env, LEANIMG_S3_CACHE=str(tmp_path / "cache"))
    size = (folder / "vm.lean").stat().st_size
    assert fetched(run_leanimg("validate", url, "--json", env=env, timeout=120)) == size
    assert fetched(run_leanimg("validate", url, "--json", env=env, timeout=120)) == 0
    victim = sorted(p for p in (tmp_path / "cache").rglob("*") if p.is_file())[0]
    damaged = bytearray(victim.read_bytes())
    damaged[100] ^= 1
    victim.write_bytes(bytes(damaged))
    again = fetched(run_leanimg("validate", url, "--json", env=env, timeout=120))
    assert 0 < again < size  # the damaged block's run only
    out, local = tmp_path / "vm.raw", tmp_path / "local.raw"
    assert run_leanimg("restore", url, "--to", "raw", "-o", out, env=env, timeout=120).returncode == 0
    assert run_leanimg("restore", folder / "vm.lean", "--to", "raw", "-o", local, timeout=120).returncode == 0
    assert out.read_bytes() == local.read_bytes()


def test_the_cache_keeps_to_its_limit(s3store, stored, tmp_path):
    _, url = stored
    env = dict(os.environ, **s3store.env, LEANIMG_S3_CACHE=str(tmp_path / "cache"), LEANIMG_S3_CACHE_MB="2")
    assert run_leanimg("validate", url, env=env, timeout=120).returncode == 0
    assert 0 < cache_bytes(tmp_path / "cache") <= 2 * MIB


def test_a_replaced_object_is_not_served_from_the_old_blocks(s3store, stored, tmp_path):
    folder, _ = stored
    env = dict(os.environ, **s3store.env, LEANIMG_S3_CACHE=str(tmp_path / "cache"))
    url = s3store.url("cache/replaced.lean")
    client = s3store.client()
    client.upload_file(str(folder / "vm.lean"), s3store.bucket, "cache/replaced.lean")
    assert run_leanimg("validate", url, env=env, timeout=120).returncode == 0
    other = tmp_path / "other.save"
    other.write_bytes(qemu_save(os.urandom(4 * MIB)))
    assert run_leanimg("convert", other, "-o", tmp_path / "other.lean", timeout=120).returncode == 0
    client.upload_file(str(tmp_path / "other.lean"), s3store.bucket, "cache/replaced.lean")
    proc = run_leanimg("validate", url, "--json", env=env, timeout=120)
    assert json.loads(proc.stdout)["valid"] is True and fetched(proc) == (tmp_path / "other.lean").stat().st_size


def test_reads_of_an_object_match_its_bytes_and_memory_stays_bounded(s3store, monkeypatch):
    """S3Object.pread at random offsets and lengths (across blocks, past the end) gives the
    object's bytes, with blocks evicted and read again (a cache of 6 blocks, 4 ahead); the
    blocks held never pass the limit, and none stays asked for once every GET has ended."""
    import random
    import time
    from leanimg import s3

    for name, value in s3store.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LEANIMG_S3_CACHE", raising=False)
    monkeypatch.setattr(s3, "_client", None)
    monkeypatch.setattr(s3, "_disk_cache", [])
    monkeypatch.setattr(s3, "_BLOCKS", s3._Blocks())
    monkeypatch.setattr(s3, "FETCHED", {})
    monkeypatch.setattr(s3, "CACHE_BLOCKS", 6)
    monkeypatch.setattr(s3, "AHEAD_BLOCKS", 4)
    data = os.urandom(20 * MIB + 12345)
    s3store.client().put_object(Bucket=s3store.bucket, Key="cache/blob", Body=data)
    rng = random.Random(7)
    with s3.S3Object(s3store.url("cache/blob")) as blob:
        assert blob.size == len(data)
        for _ in range(300):
            offset = rng.randrange(len(data) + 10)
            length = rng.choice([1, 4096, MIB - 1, MIB + 1, 3 * MIB, rng.randrange(1, 9 * MIB)])
            assert blob.pread(length, offset) == data[offset : offset + length]
            assert len(s3._BLOCKS.held) <= 6
        blob.seek(5 * MIB)
        assert blob.read(2 * MIB) == data[5 * MIB : 7 * MIB]
    deadline = time.monotonic() + 30
    while s3._BLOCKS.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not s3._BLOCKS.pending and len(s3._BLOCKS.held) <= 6
