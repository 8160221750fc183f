"""Where one restore's time goes, phase by phase and thread by thread: a diagnostic, not a
benchmark (the wrappers cost a little; compare versions with bench_chain.py or bench_ab.py).

    python benchmarks/restore_timeline.py CHAIN_DIR/d1000-0999.lean [--first-range]

Runs `leanimg restore IMAGE --to raw -o /dev/null` in this process with the main functions of
a restore wrapped, then prints for the caller's thread and the read-ahead workers the calls
and seconds of each, and when the caller's top-level phases ran. ``--first-range`` also lists
every call of 2 ms or more during the first `pieces` call: in a chain restore the first range
waits for every DELTA_FRAME batch, and this shows on what. A restore runs nearly on one core
(its CPU time is about its wall time), so the caller's phases are its critical path.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import sys
import threading
import time

# (module, attribute, label): what is timed; an attribute the code no longer has is skipped
WRAPPED = [
    ("leanimg.reader", "LeanImage.open", "open the chain"),
    ("leanimg.chain", "resolve", "resolve"),
    ("leanimg.chain.deltas", "ChainPatches.__init__", "delta batches: plan"),
    ("leanimg.chain.deltas", "ChainPatches._ready", "delta batches: wait"),
    ("leanimg.chain.deltas", "ChainPatches.apply", "deltas: apply"),
    ("leanimg.chain.deltas", "_fold_delta_batch", "delta batch: read, parse, fold"),
    ("leanimg.chain.deltas", "_quick_delta_frame", "delta batch: read a frame"),
    ("leanimg.chain.deltas", "_read_delta_batch_native", "delta batch: read its frames"),
    ("leanimg.chain", "pieces", "pieces (one range)"),
    ("leanimg.chain.region_pieces", "_decompress_direct_frames", "direct frames"),
    ("leanimg.chain.forward", "StoredPages.copy", "copy built pages"),
    ("leanimg.chain.region_pieces", "check_built", "digest built pages"),
    ("leanimg.digests", "DigestStore._inherited_table", "inherited digests"),
    ("leanimg.frames", "FrameStore._load", "decompress a PAGE_FRAME"),
    ("concurrent.futures._base", "Future.result", "wait for a worker"),
]
TOP_LEVEL = {"open the chain", "resolve", "delta batches: plan", "inherited digests", "pieces (one range)"}


def wrap_all(log: list) -> None:
    for module_name, attribute, label in WRAPPED:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        function = getattr(owner, name, None) if owner is not None else None
        if function is None:
            print(f"(not timed: {module_name}.{attribute} is gone)", file=sys.stderr)
            continue
        setattr(owner, name, _timed(function, label, log))


def _timed(function, label: str, log: list):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            log.append((label, threading.current_thread() is threading.main_thread(), start, time.perf_counter()))

    return timed


def report(log: list, t0: float, first_range: bool) -> None:
    totals = collections.defaultdict(lambda: [0, 0.0])
    for label, main, start, end in log:
        totals[(main, label)][0] += 1
        totals[(main, label)][1] += end - start
    for (main, label), (calls, seconds) in sorted(totals.items(), key=lambda kv: (not kv[0][0], -kv[1][1])):
        print(f"  {'caller' if main else 'workers':8} {label:32} {calls:6} calls {seconds:8.3f} s")
    print("caller's phases (seconds from the start of the command):")
    for label, main, start, end in sorted(log, key=lambda e: e[2]):
        if main and label in TOP_LEVEL:
            print(f"  {label:32} {start - t0:7.3f} -> {end - t0:7.3f}")
    ranges = sorted((start, end) for label, main, start, end in log if label == "pieces (one range)")
    if first_range and ranges:
        lo, hi = ranges[0]
        print(f"the first range, {(hi - lo) * 1000:.0f} ms: calls of 2 ms or more")
        for label, main, start, end in sorted(log, key=lambda e: e[2]):
            if lo <= start <= hi and end - start >= 0.002 and label != "pieces (one range)":
                print(
                    f"  {'caller' if main else 'worker':7} {label:32} {(start - lo) * 1000:+7.1f} ms "
                    f"{(end - start) * 1000:7.1f} ms"
                )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image")
    parser.add_argument("--first-range", action="store_true", help="also list the first range's calls")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    from leanimg import cli

    imported = time.perf_counter()
    log: list = []
    wrap_all(log)
    try:
        cli.main(["restore", args.image, "--to", "raw", "-o", "/dev/null", "-f"], standalone_mode=False)
    except SystemExit:
        pass
    end = time.perf_counter()
    print(f"restore of {args.image}: {end - t0:.3f} s, of which importing leanimg.cli {imported - t0:.3f} s")
    report(log, t0, args.first_range)
    return 0


if __name__ == "__main__":
    sys.exit(main())
