"""Incremental link size against what changed, with a real QEMU guest (issue 15 §2).

A real Debian guest (tests/guest, QEMU under TCG) writes sparse 8-byte words into its memory
(workload ``words``: 1-4 random words in each of ``--pages`` random pages per round) and is
checkpointed ``--saves`` times while it runs (tests/guest/chain_scenarios.py).  Each save is
converted with the real CLI into two chains: PARENT+DELTA (``convert --parent``) and
PARENT-only (``convert --parent --no-delta``), each link against the previous link of its
chain (format 1.1 children: no digests for PARENT pages).

The baseline, per link, is what a page-level incremental would store: the pages that
changed since the previous save (found by comparing the raw restores of the two links),
concatenated and compressed with zstd level 3 (``zstd -3``).  Target: every PARENT+DELTA
link <= 0.25 x that baseline.

    python benchmarks/bench_link_size.py                      # 6 saves, 128 MiB guest
    python benchmarks/bench_link_size.py --saves 5 --json /tmp/links.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

from leanimg.cli import command_line

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from guest.chain_scenarios import Phase, run_chain_scenario  # noqa: E402

PAGE = 4096
TARGET = 0.25
LEANIMG = command_line()


def run_cli(*args) -> None:
    proc = subprocess.run([*LEANIMG, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode:
        raise SystemExit(
            f"leanimg {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')}"
        )


def raw_pages(link: Path, work: Path) -> np.ndarray:
    """The raw restore of ``link`` (ancestors beside it) as (pages, 4096) uint8."""
    out = work / "restore.raw"
    run_cli("restore", link, "--to", "raw", "-o", out, "-f")
    pages = np.fromfile(out, np.uint8).reshape(-1, PAGE)
    out.unlink()
    return pages


def changed_pages_zstd3(before: np.ndarray, after: np.ndarray) -> tuple[int, int]:
    """(number of pages that differ, bytes of zstd -3 of those pages of ``after``)."""
    n = min(len(before), len(after))
    changed = np.flatnonzero((before[:n] != after[:n]).any(axis=1))
    changed = np.concatenate([changed, np.arange(n, len(after))])
    data = after[changed].tobytes()
    return len(changed), len(zstandard.ZstdCompressor(level=3).compress(data))


def convert_chains(saves: list[Path], work: Path, log) -> dict[str, list[Path]]:
    """Both chains, one directory each (a link's ancestors are found beside it)."""
    chains = {}
    for kind, flags in (("delta", ()), ("parent-only", ("--no-delta",))):
        directory = work / kind
        directory.mkdir()
        links = []
        for i, save in enumerate(saves):
            link = directory / f"cp{i + 1}.lean"
            parent = ("--parent", links[-1]) if links else ()
            t0 = time.monotonic()
            run_cli("convert", save, "-o", link, *parent, *(flags if links else ()), "-f")
            log(f"  {kind} cp{i + 1}: {link.stat().st_size} bytes ({time.monotonic() - t0:.1f} s)")
            links.append(link)
        chains[kind] = links
    return chains


def measure(chains: dict[str, list[Path]], work: Path) -> list[dict]:
    rows = []
    previous = raw_pages(chains["delta"][0], work)
    for i in range(1, len(chains["delta"])):
        current = raw_pages(chains["delta"][i], work)
        if not np.array_equal(current, raw_pages(chains["parent-only"][i], work)):
            raise SystemExit(f"cp{i + 1}: the two chains restore to different memory")
        pages, baseline = changed_pages_zstd3(previous, current)
        delta, parent_only = (chains[k][i].stat().st_size for k in ("delta", "parent-only"))
        rows.append(
            dict(
                link=f"cp{i + 1}",
                changed_pages=pages,
                zstd3_changed_bytes=baseline,
                delta_link_bytes=delta,
                parent_only_link_bytes=parent_only,
                delta_ratio=delta / baseline,
                parent_only_ratio=parent_only / baseline,
                meets_target=delta / baseline <= TARGET,
            )
        )
        previous = current
    return rows


def render(rows: list[dict], args) -> str:
    lines = [
        f"links of a {args.mem} MiB guest writing 1-4 words into {args.pages} pages per round, "
        f"{args.saves} saves {args.rounds} rounds apart; baseline = zstd -3 of the pages changed since "
        f"the previous save",
        f"  {'link':>5} {'changed':>8} {'zstd3 B':>9} {'PARENT+DELTA B':>15} {'ratio':>6} "
        f"{'PARENT-only B':>14} {'ratio':>6}  target <= {TARGET}",
    ]
    for r in rows:
        lines.append(
            f"  {r['link']:>5} {r['changed_pages']:>8} {r['zstd3_changed_bytes']:>9} "
            f"{r['delta_link_bytes']:>15} {r['delta_ratio']:>6.3f} {r['parent_only_link_bytes']:>14} "
            f"{r['parent_only_ratio']:>6.3f}  {'met' if r['meets_target'] else 'NOT met'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=6, help="checkpoints (>= 5; default 6)")
    parser.add_argument("--rounds", type=int, default=2, help="workload rounds between saves (default 2)")
    parser.add_argument("--pages", type=int, default=256, help="pages written per round (default 256)")
    parser.add_argument("--mem", type=int, default=128, help="guest memory in MiB (default 128)")
    parser.add_argument("--workdir", default=None, help="parent of the temporary directory (default /tmp)")
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="bench-links-", dir=args.workdir))
    try:
        phase = Phase("words", 24, saves=args.saves, rounds=args.rounds, amount=args.pages)
        checkpoints = run_chain_scenario(work / "guest", phases=(phase,), mem_mib=args.mem, log=log, limit_rounds=False)
        chains = convert_chains([c.point.save for c in checkpoints], work, log)
        rows = measure(chains, work)
        print(render(rows, args))
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(dict(command=[sys.executable, *sys.argv], target=TARGET, links=rows), f, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
