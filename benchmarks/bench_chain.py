"""Restore time against chain depth, with the same final memory (issue 6 §3, issue 15 §3).

Synthetic guest memory (default one 256 MiB region: zero, text-like and random pages) is
evolved through ``depth_max - 1`` steps; each step changes 1–4 8-byte words in some pages
(default 1 %) and rewrites some whole pages (default 0.5 %) — the ``rewrite`` workload, whose
chains pile up superseded pages (a restore must decompress several times the final memory).
``--workload sparse`` models what CRIU users report instead (time growing with the number of
small links): each step writes 1–4 words into ``--sparse-pages`` pages (default 300), as issue
15 §2's guest does, and rewrites none.  Three chains are written with
``LeanImageWriter`` directly (PARENT for pages equal to the parent's, ``put_changed`` — DELTA
or STORED — for changed ones), each in its own directory, all ending at the same memory:

  depth 1000  one link per step (``--depths``, default 1,10,100,1000)
  depth 100   a link every ~10 steps
  depth 10    a link every ~111 steps (each link covers that many steps of changes)
  depth 1     the final memory written plainly (what ``leanimg flatten`` gives)

Children are written in format 1.1 (the writer's default: PARENT pages carry no digest).
Issue 15 §3's targets, all from medians of one run, side by side:

  depth100 / depth10 <= 1.2,  depth1000 / depth10 <= 1.5,
  each chain's restore <= 1.3 x (cold read of its files + restore of its flattened image,
  the depth-1 chain).

Each last link is then restored with the real CLI, ``leanimg restore LAST --to raw -o
/dev/null`` (ancestors found beside it), ``--repeat`` times with every file of the chain
evicted from the page cache first (posix_fadvise DONTNEED; /proc/sys/vm/drop_caches is
not writable here); medians are reported with the ratios below (and, beside each wall-time
median, the median CPU time of the restore process, user + system: the work done, apart from
waiting, so a change that only moves work onto idle cores shows as the same CPU time and less
wall time), beside the cold read of the chain's files alone (the I/O floor: a chain holds the
pages its links superseded) and the MiB of frames the restore must decompress
(the CPU floor: a zstd frame is decompressed whole, and the frames holding final pages also hold
superseded ones).  The three restores are checked to give
identical bytes (sha256 of a restore to a file).  The depth-1 / depth-10 / depth-100 runs
are interleaved so drift hits all of them alike.

Optionally (``--deep-depth N``) a depth-N chain (default 8 MiB region) opens, validates (`validate
--chain` is not run: 1000 full validations are the slow path, the last link is validated
with its chain resolved) and restores to the same bytes as its plain final memory; timed.

    python benchmarks/bench_chain.py                            # 256 MiB, 3 repeats
    python benchmarks/bench_chain.py --size 32MiB --repeat 3 --json /tmp/chain.json
    python benchmarks/bench_chain.py --keep ...; python benchmarks/bench_chain.py --reuse DIR ...

``--link-frame-pages N`` writes the links after the first with N-page PAGE_FRAMEs (the writer's
default is 2 MiB): smaller frames hold fewer superseded pages, so less is decompressed, but each
costs a read and a decompression call of its own (16 pages, rewrite workload: 25-30 % less
decompressed, depth ratios 1.25/1.56 instead of 1.68/2.18, each restore 2-3x slower).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import compile_checkout, require_null_device, size_parser
from leanimg.cli import command_line
from leanimg.fileutil import evict_from_page_cache
from leanimg.format import page_digest
from leanimg.writer import LeanImageWriter, ParentLink

PAGE = 4096
WORDS = PAGE // 8
REGION = "pc.ram"
parse_size = size_parser(1 << 20)


LEANIMG = command_line()


# ------------------------------------------------------------------ synthetic memory


def initial_memory(num_pages: int, rng: np.random.Generator) -> np.ndarray:
    """(num_pages, 512) uint64: 30 % zero, 40 % text-like (compressible), 30 % random pages."""
    mem = np.zeros((num_pages, WORDS), np.uint64)
    kind = rng.choice(3, size=num_pages, p=[0.3, 0.4, 0.3])
    text = np.flatnonzero(kind == 1)
    rand = np.flatnonzero(kind == 2)
    vocab = np.frombuffer(b"the quick brown fox jumps over a lazy dog lean image chain delta ", np.uint8)
    for rows in np.array_split(text, max(1, len(text) // 4096)):
        starts = rng.integers(0, len(vocab), size=(len(rows), 1))
        idx = (starts + np.arange(PAGE)) % len(vocab)
        mem[rows] = vocab[idx].view(np.uint64).reshape(len(rows), WORDS)
    mem[rand] = rng.integers(0, 2**64, size=(len(rand), WORDS), dtype=np.uint64)
    return mem


def mutate(mem: np.ndarray, rng: np.random.Generator, word_frac: float, page_frac: float) -> np.ndarray:
    """One step: 1–4 words in ``word_frac`` of the pages, ``page_frac`` of pages rewritten.
    Returns the indices of the pages touched."""
    n = len(mem)
    word_pages = rng.choice(n, size=max(1, int(n * word_frac)), replace=False)
    counts = rng.integers(1, 5, size=len(word_pages))
    rows = np.repeat(word_pages, counts)
    cols = rng.integers(0, WORDS, size=len(rows))
    mem[rows, cols] = rng.integers(0, 2**64, size=len(rows), dtype=np.uint64)
    whole = rng.choice(n, size=max(1, int(n * page_frac)), replace=False)
    mem[whole] = rng.integers(0, 2**64, size=(len(whole), WORDS), dtype=np.uint64)
    return np.union1d(word_pages, whole)


def mutate_sparse(mem: np.ndarray, rng: np.random.Generator, pages: int) -> np.ndarray:
    """One step of the sparse workload: 1-4 random 8-byte words in each of ``pages`` pages,
    no page rewritten (issue 15 §2's guest). Returns the indices of the pages touched."""
    touched = np.sort(rng.choice(len(mem), size=min(pages, len(mem)), replace=False))
    counts = rng.integers(1, 5, size=len(touched))
    rows = np.repeat(touched, counts)
    mem[rows, rng.integers(0, WORDS, size=len(rows))] = rng.integers(0, 2**64, size=len(rows), dtype=np.uint64)
    return touched


def digests_of(mem: np.ndarray, pages) -> np.ndarray:
    out = np.empty((len(pages), 16), np.uint8)
    for i, p in enumerate(np.asarray(pages).tolist()):
        out[i] = np.frombuffer(page_digest(mem[p].tobytes()), np.uint8)
    return out


class ChainBuilder:
    """Writes one chain link by link into ``directory``; keeps the parent's memory."""

    def __init__(self, directory: Path, name: str, link_frame_pages: int | None = None):
        self.dir, self.name = directory, name
        self.link_frame_pages = link_frame_pages  # PAGE_FRAME size of the links after the first
        directory.mkdir(parents=True, exist_ok=True)
        self.links: list[Path] = []
        self.parent: ParentLink | None = None
        self.snap: np.ndarray | None = None  # memory of the last link
        self.dirty: np.ndarray | None = None  # pages touched since the last link
        self.classes: dict[str, int] = {}

    def touch(self, pages) -> None:
        if self.dirty is not None:
            self.dirty[pages] = True

    def write(self, mem: np.ndarray, digests: np.ndarray) -> Path:
        path = self.dir / f"{self.name}-{len(self.links):04d}.lean"
        num_pages = len(mem)
        w = LeanImageWriter(
            path, parent=self.parent, frame_pages=self.link_frame_pages if self.parent is not None else None
        )
        try:
            rid = w.add_region(REGION, num_pages * PAGE, guest_phys_base=0)
            if self.parent is None:
                w.put_pages(rid, 0, memoryview(mem).cast("B"))
            else:
                cand = np.flatnonzero(self.dirty)
                changed = cand[(mem[cand] != self.snap[cand]).any(axis=1)]
                start = 0
                for p in changed.tolist() + [num_pages]:
                    if p > start:
                        w.put_parent(rid, start, digests[start:p].tobytes())
                    if p < num_pages:
                        cls = w.put_changed(rid, p, self.snap[p].tobytes(), mem[p].tobytes())
                        self.classes[cls.name] = self.classes.get(cls.name, 0) + 1
                    start = p + 1
                self.classes["PARENT"] = self.classes.get("PARENT", 0) + num_pages - len(changed)
            digest = w.finish()
        except BaseException:
            w.abort()
            raise
        self.parent = ParentLink(w.image_uuid, digest)
        self.snap = mem.copy()
        self.dirty = np.zeros(num_pages, bool)
        self.links.append(path)
        return path


def build_chains(
    directory: Path,
    size: int,
    depths: list[int],
    seed: int,
    word_frac: float,
    page_frac: float,
    log,
    sparse_pages: int = 0,
    link_frame_pages: int | None = None,
) -> dict[int, ChainBuilder]:
    """Chains of the given depths over the same evolution; all end at the same memory. With
    ``sparse_pages`` each step is mutate_sparse's (the sparse workload), else mutate's."""
    rng = np.random.default_rng(seed)
    num_pages = size // PAGE
    steps = max(depths) - 1
    mem = initial_memory(num_pages, rng)
    digests = digests_of(mem, range(num_pages))
    chains = {d: ChainBuilder(directory / f"depth{d}", f"d{d}", link_frame_pages) for d in depths}
    # a chain of depth d takes a link at steps round(k * steps / (d-1)), k = 0..d-1
    marks = {d: ({0} if d == 1 else {round(k * steps / (d - 1)) for k in range(d)}) for d in depths}
    for d in depths:
        assert len(marks[d]) == d, (d, marks[d])
    t0 = time.monotonic()
    for step in range(steps + 1):
        if step:
            touched = mutate_sparse(mem, rng, sparse_pages) if sparse_pages else mutate(mem, rng, word_frac, page_frac)
            digests[touched] = digests_of(mem, touched)
            for c in chains.values():
                c.touch(touched)
        for d, c in chains.items():
            if d == 1:
                continue
            if step in marks[d]:
                c.write(mem, digests)
        if step and step % max(10, steps // 10) == 0:
            log(f"  step {step}/{steps} ({time.monotonic() - t0:.0f} s)")
    if 1 in chains:
        chains[1].write(mem, digests)
    return chains


# ------------------------------------------------------------------ timing


def evict(paths) -> None:
    for p in paths:
        evict_from_page_cache(p)


def run_cli(*args, stdout=subprocess.DEVNULL, cli=LEANIMG) -> None:
    proc = subprocess.run([*cli, *map(str, args)], stdout=stdout, stderr=subprocess.PIPE)
    if proc.returncode:
        raise SystemExit(
            f"leanimg {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')}"
        )


def timed_restore(chain: ChainBuilder, out: str = "/dev/null", cli=LEANIMG) -> float:
    return timed_restore_cpu(chain, out, cli)[0]


def timed_restore_cpu(chain: ChainBuilder, out: str = "/dev/null", cli=LEANIMG) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system of the restore process and its threads)."""
    evict(chain.links)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    run_cli("restore", chain.links[-1], "--to", "raw", "-o", out, "-f", cli=cli)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed_read(chain: ChainBuilder) -> float:
    """Cold read of every file of the chain, nothing else: the I/O floor of its restore."""
    evict(chain.links)
    t0 = time.perf_counter()
    for path in chain.links:
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 22):
                pass
    return time.perf_counter() - t0


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def chain_bytes(chain: ChainBuilder) -> int:
    return sum(p.stat().st_size for p in chain.links)


def frames_to_decompress(chain: ChainBuilder) -> int:
    """Bytes of PAGE_FRAMEs (decompressed) a restore of the last link must decompress: every
    frame holding the base of some final page. A zstd frame is decompressed whole, so this,
    not the final memory, is a chain's CPU floor."""
    from leanimg.format import PageClass
    from leanimg.reader import LeanImage

    total = 0
    with LeanImage.open(chain.links[-1]) as image:
        for region in image.regions:
            r = image.resolution(region)
            stored = r.base_class == PageClass.STORED
            for link_index in np.unique(r.base_link[stored]).tolist():
                frames = r.links[link_index].frames.page_frames
                mine = stored & (r.base_link == link_index)
                used = np.unique(frames.frame_of(r.base_slot[mine]))
                total += int(frames.counts[used].astype(np.int64).sum()) * image.page_size
    return total


TARGETS = {"depth100/depth10": 1.2, "depth1000/depth10": 1.5, "chain/(read+flat)": 1.3}


def bench_depths(work: Path, args, log) -> dict:
    depths = sorted(set(args.depths) | {1})
    t0 = time.monotonic()
    if args.reuse:
        chains = kept_chains(work, depths)
        log(f"timing the chains kept in {work}")
    else:
        chains = build_chains(
            work,
            args.size,
            depths,
            args.seed,
            args.word_frac,
            args.page_frac,
            log,
            sparse_pages=args.sparse_pages if args.workload == "sparse" else 0,
            link_frame_pages=args.link_frame_pages,
        )
    build_s = time.monotonic() - t0
    log(f"built chains of depth {depths} over {args.size >> 20} MiB in {build_s:.1f} s")
    # same final memory: restore each last link to a file once and compare
    digests = {}
    for d, c in chains.items():
        out = work / f"restored-{d}.raw"
        run_cli("restore", c.links[-1], "--to", "raw", "-o", out, "-f")
        digests[d] = sha256(out)
        out.unlink()
    if len(set(digests.values())) != 1:
        raise SystemExit(f"restores of the last links differ: {digests}")
    versions = {"new": LEANIMG}
    if args.baseline:
        versions["baseline"] = [str(args.baseline / ".venv" / "bin" / "leanimg")]
    for cli in versions.values():
        compile_checkout(cli[-1])
    times = {tag: {d: [] for d in depths} for tag in versions}
    cpu = {tag: {d: [] for d in depths} for tag in versions}
    reads = {d: [] for d in depths}
    for repeat in range(args.repeat):  # interleaved: drift hits every depth and version alike
        for d in depths:  # and each version goes first as often as the other
            for tag, cli in list(versions.items()) if repeat % 2 == 0 else list(versions.items())[::-1]:
                wall, used = timed_restore_cpu(chains[d], cli=cli)
                times[tag][d].append(wall)
                cpu[tag][d].append(used)
            reads[d].append(timed_read(chains[d]))
    read_med = {d: statistics.median(t) for d, t in reads.items()}
    result = dict(
        size_bytes=args.size,
        workload=args.workload,
        word_frac=args.word_frac,
        page_frac=args.page_frac,
        sparse_pages=args.sparse_pages,
        targets=TARGETS,
        build_seconds=build_s,
        final_sha256=digests[1],
        chains={
            str(d): dict(
                depth=d,
                links=len(c.links),
                bytes=chain_bytes(c),
                decompressed_bytes=frames_to_decompress(c),
                last_link_bytes=c.links[-1].stat().st_size,
                classes_written=c.classes,
                restore_seconds=times["new"][d],
                restore_median=statistics.median(times["new"][d]),
                restore_cpu_seconds=cpu["new"][d],
                restore_cpu_median=statistics.median(cpu["new"][d]),
                cold_read_seconds=reads[d],
                cold_read_median=read_med[d],
            )
            for d, c in chains.items()
        },
        **verdict(times["new"], read_med, depths),
    )
    if args.baseline:
        result["baseline"] = dict(
            checkout=str(args.baseline),
            restore_seconds={str(d): t for d, t in times["baseline"].items()},
            restore_cpu_medians={str(d): statistics.median(t) for d, t in cpu["baseline"].items()},
            paired_ratio_medians={
                str(d): statistics.median([n / b for n, b in zip(times["new"][d], t)])
                for d, t in times["baseline"].items()
            },
            **verdict(times["baseline"], read_med, depths),
        )
    return result


def verdict(times: dict, read_med: dict, depths: list[int]) -> dict:
    """Issue 15 §3's ratios from one version's restore times (per depth) and the cold reads."""
    med = {d: statistics.median(t) for d, t in times.items()}
    ratios = {}
    for d in (100, 1000):
        if d in med and 10 in med:
            ratios[f"depth{d}/depth10"] = med[d] / med[10]
    over_flat = {str(d): med[d] / (read_med[d] + med[1]) for d in depths if d > 1}
    ratios["chain/(read+flat)"] = max(over_flat.values())
    verdicts = {name: value <= TARGETS[name] for name, value in ratios.items()}
    return dict(
        restore_medians={str(d): m for d, m in med.items()},
        ratios=ratios,
        meets_targets=verdicts,
        chain_over_read_plus_flat=over_flat,
        meets_target=all(verdicts.values()),
    )


def kept_chains(work: Path, depths: list[int]) -> dict[int, ChainBuilder]:
    """The chains an earlier ``--keep`` run left in ``work`` (depth{d}/d{d}-NNNN.lean)."""
    chains = {}
    for d in depths:
        chain = ChainBuilder(work / f"depth{d}", f"d{d}")
        chain.links = sorted(chain.dir.glob(f"d{d}-*.lean"))
        if len(chain.links) != d:
            raise SystemExit(f"{chain.dir}: expected {d} links, found {len(chain.links)}")
        chains[d] = chain
    return chains


def bench_depth1000(work: Path, args, log) -> dict:
    t0 = time.monotonic()
    chains = build_chains(
        work / "deep", args.deep_size, [1, args.deep_depth], args.seed + 1, args.word_frac, args.page_frac, log
    )
    build_s = time.monotonic() - t0
    deep, flat = chains[args.deep_depth], chains[1]
    log(f"built a depth-{args.deep_depth} chain over {args.deep_size >> 20} MiB in {build_s:.1f} s")
    evict(deep.links)
    t0 = time.perf_counter()
    run_cli("inspect", "--json", deep.links[-1])
    inspect_s = time.perf_counter() - t0
    evict(deep.links)
    t0 = time.perf_counter()
    run_cli("validate", deep.links[-1])
    validate_s = time.perf_counter() - t0
    out = work / "deep.raw"
    evict(deep.links)
    t0 = time.perf_counter()
    run_cli("restore", deep.links[-1], "--to", "raw", "-o", out, "-f")
    restore_s = time.perf_counter() - t0
    same = sha256(out) == sha256_restore(flat, work / "flat.raw")
    if not same:
        raise SystemExit(f"depth-{args.deep_depth} restore differs from the plain final memory")
    flat_times = [timed_restore(flat) for _ in range(args.repeat)]
    deep_times = [timed_restore(deep) for _ in range(args.repeat)]
    return dict(
        depth=args.deep_depth,
        size_bytes=args.deep_size,
        build_seconds=build_s,
        chain_bytes=chain_bytes(deep),
        inspect_seconds=inspect_s,
        validate_seconds=validate_s,
        first_restore_seconds=restore_s,
        restore_seconds=deep_times,
        restore_median=statistics.median(deep_times),
        depth1_restore_seconds=flat_times,
        depth1_restore_median=statistics.median(flat_times),
        identical_to_depth1=same,
    )


def sha256_restore(chain: ChainBuilder, out: Path) -> str:
    run_cli("restore", chain.links[-1], "--to", "raw", "-o", out, "-f")
    digest = sha256(out)
    out.unlink()
    return digest


def render_verdict(v: dict, targets: dict) -> list[str]:
    lines = [
        f"  depth {depth}: restore / (cold read of its files + depth-1 restore) = {ratio:.3f}"
        for depth, ratio in v["chain_over_read_plus_flat"].items()
    ]
    lines += [
        f"  {name:<20} {ratio:.3f}  (target <= {targets[name]}: {'met' if v['meets_targets'][name] else 'NOT met'})"
        for name, ratio in v["ratios"].items()
    ]
    return lines


def render(results: dict) -> str:
    d = results["depths"]
    workload = (
        "sparse: {} pages of 1-4 words a step".format(d["sparse_pages"])
        if d["workload"] == "sparse"
        else "rewrite: {:g} of pages 1-4 words, {:g} rewritten a step".format(d["word_frac"], d["page_frac"])
    )
    lines = [
        f"workload {workload}",
        f"restore --to raw of the last link, {d['size_bytes'] >> 20} MiB, median of "
        f"{results['repeat']} cold runs (same final memory, sha256 {d['final_sha256'][:16]}…)",
        f"  {'depth':>6} {'chain MiB':>10} {'last link MiB':>14} {'decompress MiB':>15} {'cold read s':>12} "
        f"{'restore s':>10} {'CPU s':>6}  runs",
    ]
    for c in d["chains"].values():
        lines.append(
            f"  {c['depth']:>6} {c['bytes'] / 2**20:10.2f} {c['last_link_bytes'] / 2**20:14.2f} "
            f"{c['decompressed_bytes'] / 2**20:15.1f} "
            f"{c['cold_read_median']:12.3f} {c['restore_median']:10.3f} {c['restore_cpu_median']:6.3f}  "
            f"{' '.join(f'{t:.3f}' for t in c['restore_seconds'])}"
        )
    lines += render_verdict(d, d["targets"])
    if "baseline" in d:
        b = d["baseline"]
        lines.append(
            f"baseline {b['checkout']}, interleaved with the runs above: restore medians "
            + ", ".join(f"depth {depth} {m:.3f} s" for depth, m in b["restore_medians"].items())
            + "; CPU medians "
            + ", ".join(f"depth {depth} {m:.3f} s" for depth, m in b["restore_cpu_medians"].items())
        )
        lines.append(
            "  new / baseline, median of the runs' ratios (each pair ran back to back, so drift "
            "cancels): " + ", ".join(f"depth {depth} {m:.3f}" for depth, m in b["paired_ratio_medians"].items())
        )
        lines += render_verdict(b, d["targets"])
    if "deep" in results:
        k = results["deep"]
        lines.append(
            f"depth {k['depth']} over {k['size_bytes'] >> 20} MiB: built in {k['build_seconds']:.1f} s "
            f"({k['chain_bytes'] / 2**20:.1f} MiB), inspect {k['inspect_seconds']:.2f} s, validate "
            f"{k['validate_seconds']:.2f} s, restore {k['restore_median']:.2f} s median "
            f"(depth 1: {k['depth1_restore_median']:.2f} s), bytes identical: {k['identical_to_depth1']}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20, help="region size (default 256MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="cold restores per chain (default 3)")
    parser.add_argument("--seed", type=int, default=20261122)
    parser.add_argument(
        "--word-frac", type=float, default=0.01, help="fraction of pages with 1-4 changed words per step (default 0.01)"
    )
    parser.add_argument(
        "--page-frac", type=float, default=0.005, help="fraction of pages rewritten whole per step (default 0.005)"
    )
    parser.add_argument(
        "--workload",
        choices=["rewrite", "sparse"],
        default="rewrite",
        help="rewrite (default): --word-frac and --page-frac a step, so superseded pages pile "
        "up in the chain; sparse: --sparse-pages pages get 1-4 new words a step, none "
        "rewritten (small links, as a guest between checkpoints)",
    )
    parser.add_argument(
        "--sparse-pages", type=int, default=300, help="pages changed a step by the sparse workload (default 300)"
    )
    parser.add_argument(
        "--link-frame-pages",
        type=int,
        default=None,
        help="pages per PAGE_FRAME in the links after the first (default: the writer's, 2 MiB); "
        "smaller frames decompress fewer superseded pages",
    )
    parser.add_argument(
        "--depths",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 10, 100, 1000],
        help="chain depths compared in one run (default 1,10,100,1000)",
    )
    parser.add_argument(
        "--deep-depth",
        type=int,
        default=0,
        help="also time inspect/validate/restore of a chain this deep over --deep-size (0: skip)",
    )
    parser.add_argument(
        "--deep-size", type=parse_size, default=8 << 20, help="region size of the deep chain (default 8MiB)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also time another checkout of leanimg (DIR, with its .venv), interleaved with "
        "this one: the A/B of a change in one run",
    )
    parser.add_argument("--workdir", default=None, help="parent of the temporary directory (default /tmp)")
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the chains")
    parser.add_argument(
        "--reuse",
        metavar="DIR",
        help="time the chains an earlier --keep run left in DIR (give it the same --size, --workload "
        "and --depths) instead of building them; DIR is kept",
    )
    args = parser.parse_args(argv)
    require_null_device()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    args.keep = args.keep or bool(args.reuse)
    work = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="bench-chain-", dir=args.workdir))
    try:
        results = dict(
            repeat=args.repeat,
            command=[sys.executable, *sys.argv],
            machine=dict(python=platform.python_version(), cpus=os.cpu_count()),
        )
        results["depths"] = bench_depths(work, args, log)
        if args.deep_depth:
            results["deep"] = bench_depth1000(work, args, log)
        print(render(results))
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if results["depths"]["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
