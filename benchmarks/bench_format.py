"""Lean image write / restore / validate against `cat` and `zstd -T0 -3` on the same bytes.

A synthetic guest memory (default 1 GiB) with a realistic page mix is generated
in chunks with numpy (deterministic seed), then, N times each (medians reported):

  cat        cold read of the raw file to /dev/null (I/O floor)
  zstd       `zstd -T0 -3` raw -> .zst (+ fsync, as the lean writer fsyncs)
  zstd -d    cold `zstd -d -c` .zst -> /dev/null
  zstd -t    cold `zstd -t` .zst (integrity check, the baseline for validate)
  lean write cold raw -> lean image via LeanImageWriter.put_pages in 4 MiB chunks
  lean restore  cold restore_raw(LeanImage.open(lean)) -> /dev/null (every page digest-checked)
  lean validate cold leanimg.validate.validate(lean)

"cold" means the input file is evicted from the page cache first with
posix_fadvise(DONTNEED) (/proc/sys/vm/drop_caches is not writable here).

    python benchmarks/bench_format.py                     # 1 GiB, 3 repeats
    python benchmarks/bench_format.py --size 64MiB --repeat 1 --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from common import require_null_device, size_parser
from leanimg.fileutil import evict_from_page_cache, fsync_path
from leanimg.reader import LeanImage
from leanimg.restore.raw import restore_raw
from leanimg.validate import validate
from leanimg.writer import LeanImageWriter

PAGE = 4096
CHUNK = 4 << 20  # 4 MiB: generation and put_pages unit
CHUNK_PAGES = CHUNK // PAGE
RUN_MEAN_PAGES = 16  # classes come in runs, as in real guests
MIX = {"zero": 0.45, "text": 0.35, "random": 0.20}
parse_size = size_parser(CHUNK)


# --- synthetic memory ---------------------------------------------------------------------
def _text_pool(rng: np.random.Generator, size: int = 1 << 20) -> np.ndarray:
    """1 MiB of 'compressible' memory: Zipf-distributed words and kernel-ish structs."""
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", np.uint8)
    vocab = [bytes(letters[rng.zipf(1.6, rng.integers(2, 11)) % 26]) for _ in range(2000)]
    words = rng.zipf(1.3, size // 4) % len(vocab)
    text = np.frombuffer(b" ".join(vocab[w] for w in words)[: size // 2], np.uint8)
    # structs: 64-byte records of pointers, small counters, flags and padding
    n = size // 2 // 64
    rec = np.zeros((n, 8), np.uint64)
    rec[:, 0] = 0xFFFF_8880_0000_0000 + (rng.integers(0, 1 << 20, n, dtype=np.uint64) << np.uint64(6))
    rec[:, 1] = rec[:, 0] + np.uint64(64)
    rec[:, 2] = rng.integers(0, 16, n, dtype=np.uint64)
    rec[:, 3] = rng.choice(np.array([0, 1, 0x100, 0x8000_0000], np.uint64), n)
    rec[:, 5] = rng.integers(0, 1 << 32, n, dtype=np.uint64)
    pool = np.concatenate([text, rec.view(np.uint8).ravel()])
    return pool[:size]


def memory_chunks(rng: np.random.Generator, count: int, counts: dict[str, int] | None = None):
    """Yield ``count`` CHUNK-sized (CHUNK_PAGES, PAGE) uint8 arrays of synthetic guest memory
    with the page mix MIX; add the pages per kind to ``counts``."""
    pool = _text_pool(rng)
    windows = np.lib.stride_tricks.sliding_window_view(pool, PAGE)[::8]  # 8-aligned page-sized views
    kinds = np.array(list(MIX))
    probs = np.array(list(MIX.values()))
    for _ in range(count):
        # class runs of geometric length, cut to one chunk
        lengths = rng.geometric(1 / RUN_MEAN_PAGES, CHUNK_PAGES)
        run_kind = rng.choice(len(kinds), len(lengths), p=probs)
        per_page = np.repeat(run_kind, lengths)[:CHUNK_PAGES]
        chunk = np.zeros((CHUNK_PAGES, PAGE), np.uint8)
        text = np.flatnonzero(per_page == 1)
        chunk[text] = windows[rng.integers(0, len(windows), len(text))]
        # a few changed words per text page so pages are similar but not identical
        words = chunk.view(np.uint64)
        hits = rng.integers(0, PAGE // 8, (len(text), 8))
        words[text[:, None], hits] = rng.integers(0, 1 << 63, hits.shape, dtype=np.uint64)
        rand = np.flatnonzero(per_page == 2)
        chunk[rand] = np.frombuffer(rng.bytes(len(rand) * PAGE), np.uint8).reshape(-1, PAGE)
        if counts is not None:
            for k, name in enumerate(kinds):
                counts[name] += int((per_page == k).sum())
        yield chunk


def generate(path: str, size: int, seed: int) -> dict[str, int]:
    """Write ``size`` bytes of synthetic guest memory; return pages per kind."""
    counts = dict.fromkeys(MIX, 0)
    with open(path, "wb") as out:
        for chunk in memory_chunks(np.random.default_rng(seed), size // CHUNK, counts):
            out.write(chunk.data)
    return counts


# --- measurement helpers --------------------------------------------------------------------
def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(cmd: list[str], stdout=subprocess.DEVNULL) -> None:
    subprocess.run(cmd, check=True, stdout=stdout)


def lean_write(raw: str, lean: str) -> None:
    size = os.path.getsize(raw)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(raw, "rb", buffering=0) as src, LeanImageWriter(lean) as writer:
        region = writer.add_region("pc.ram", size, guest_phys_base=0)
        page = 0
        while True:
            n = src.readinto(buf)
            if not n:
                break
            writer.put_pages(region, page, view[:n])
            page += n // PAGE


def lean_restore(lean: str) -> None:
    with LeanImage.open(lean) as image, open(os.devnull, "wb") as out:
        restore_raw(image, out)


def lean_validate(lean: str) -> None:
    report = validate(lean)
    if not report.valid:
        raise SystemExit(f"benchmark image is invalid: {report.findings[:3]}")


def measure(args) -> dict:
    work = tempfile.mkdtemp(prefix="leanimg-bench-", dir=args.workdir)
    raw, lean, zst = (os.path.join(work, n) for n in ("mem.raw", "mem.lean", "mem.raw.zst"))
    results: dict = dict(
        size=args.size,
        repeat=args.repeat,
        seed=args.seed,
        mix=MIX,
        python=platform.python_version(),
        cpus=os.cpu_count(),
        zstd=subprocess.run(["zstd", "-V"], capture_output=True, text=True).stdout.strip(),
    )
    times: dict[str, list[float]] = {}
    try:
        t = time.perf_counter()
        results["pages"] = generate(raw, args.size, args.seed)
        results["generate_seconds"] = time.perf_counter() - t
        steps = [
            ("cat", raw, lambda: run(["cat", raw])),
            ("zstd_compress", raw, lambda: (run(["zstd", "-T0", "-3", "-q", "-f", raw, "-o", zst]), fsync_path(zst))),
            ("zstd_decompress", zst, lambda: run(["zstd", "-d", "-q", "-c", zst])),
            ("zstd_test", zst, lambda: run(["zstd", "-t", "-q", zst])),
            ("lean_write", raw, lambda: lean_write(raw, lean)),
            ("lean_restore", lean, lambda: lean_restore(lean)),
            ("lean_validate", lean, lambda: lean_validate(lean)),
        ]
        for rep in range(args.repeat):
            for name, cold_input, fn in steps:
                evict_from_page_cache(cold_input)
                elapsed = timed(fn)
                times.setdefault(name, []).append(elapsed)
                print(f"  [{rep + 1}/{args.repeat}] {name:<16} {elapsed:8.3f} s", file=sys.stderr)
        results["sizes"] = dict(raw=os.path.getsize(raw), lean=os.path.getsize(lean), zstd=os.path.getsize(zst))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            results["workdir"] = work
    med = {k: statistics.median(v) for k, v in times.items()}
    results["seconds"] = times
    results["median_seconds"] = med
    results["mib_per_second"] = {k: args.size / (1 << 20) / v for k, v in med.items()}
    sizes = results["sizes"]
    results["ratios"] = dict(
        lean_write_vs_zstd_compress=med["lean_write"] / med["zstd_compress"],
        lean_restore_vs_zstd_decompress=med["lean_restore"] / med["zstd_decompress"],
        lean_validate_vs_zstd_test=med["lean_validate"] / med["zstd_test"],
        lean_restore_vs_cat=med["lean_restore"] / med["cat"],
        lean_size_vs_zstd_size=sizes["lean"] / sizes["zstd"],
        raw_vs_lean_size=sizes["raw"] / sizes["lean"],
    )
    return results


def render(r: dict) -> str:
    mib = 1 << 20
    med, rate = r["median_seconds"], r["mib_per_second"]
    pages = r["pages"]
    total = sum(pages.values())
    lines = [
        f"leanimg benchmark: {r['size'] / mib:.0f} MiB, median of {r['repeat']}, seed {r['seed']}, "
        f"{r['cpus']} CPUs, {r['zstd']}",
        "page mix: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in pages.items()),
        "",
        f"{'operation':<18}{'median s':>10}{'MiB/s':>10}   runs (s)",
    ]
    for name in med:
        runs = " ".join(f"{t:.3f}" for t in r["seconds"][name])
        lines.append(f"{name:<18}{med[name]:>10.3f}{rate[name]:>10.0f}   {runs}")
    s = r["sizes"]
    lines += ["", f"{'file':<18}{'MiB':>10}{'% of raw':>10}"]
    for name in ("raw", "lean", "zstd"):
        lines.append(f"{name:<18}{s[name] / mib:>10.1f}{100 * s[name] / s['raw']:>10.1f}")
    lines += ["", "ratios (lean / baseline; < 1 means lean is faster or smaller):"]
    for name, value in r["ratios"].items():
        lines.append(f"  {name:<34}{value:>8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="guest memory size (default 1GiB)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (default 3)")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--workdir", default=None, help="parent of the temporary directory (default /tmp)")
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the temporary files")
    args = parser.parse_args(argv)
    require_null_device()
    if shutil.which("zstd") is None:
        parser.error("the zstd command is needed for the baseline")
    results = measure(args)
    print(render(results))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
