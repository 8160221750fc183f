"""atheris harness: arbitrary bytes as a hint file or stream (spec/hints.md).

    LEANIMG_FUZZ_RUNS=100000 nice -n 19 python fuzz/fuzz_hints.py [CORPUS_DIR]
    python fuzz/fuzz_hints.py --replay FILE...

(run length, memory cap, keep-going mode: see fuzz/harness.py; the seeds are the valid and
invalid vectors of tests/vectors/hints). Mutations rarely keep the xxh3 checksums right, so on
half the inputs (by their last byte) the harness first recomputes every checksum it can locate:
the checks behind them are reached. Per input:

1. ``check_hints`` (every structural finding) and ``read_hints`` (the first) agree: it raises
   exactly when there are findings, with the first finding's rule and offset;
2. ``HintReader`` over a pipe that hands out 1-7 bytes a read gives the same records, or
   the same first error;
3. valid hints are checked against a QEMU ``pc`` guest and a Xen guest (rules 017-021) and,
   when they fit, resolved to pages.

Bad input must raise HintError and nothing else; any other exception, a failed check
(AssertionError), a hang or a MemoryError under the address-space cap is a bug.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import zlib

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

with atheris.instrument_imports(include=["leanimg"]):
    from leanimg.hints import (
        CHECKSUM,
        HEADER,
        MAGIC,
        RECORD_HEAD,
        Guest,
        HintError,
        HintReader,
        check_against,
        check_hints,
        read_hints,
        resolve,
    )

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

import harness  # noqa: E402  (not instrumented: fuzzing machinery)

VECTORS = os.path.join(os.path.dirname(HERE), "tests", "vectors", "hints")
GUESTS = [
    Guest(
        page_size=4096,
        source="qemu",
        regions={"pc.ram": 32768},
        stream_length=1 << 20,
        disks={"vda": 64 << 20},
        parent_uuid=b"\x11" * 16,
    ),
    Guest(page_size=4096, source="xen", regions={"xen-pfn": 4096}, stream_length=None, disks=None, parent_known=False),
]


class TrickleInput(io.RawIOBase):
    """A pipe that gives 1-7 bytes a read (chosen from the input), like a socket under load."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0
        self.step = zlib.crc32(data) % 7 + 1

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.step, len(self.data) - self.pos)
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def _first(error: HintError) -> tuple:
    return error.rule, error.offset


def with_checksums(data: bytes) -> bytes:
    """``data`` with the header checksum and every locatable record checksum recomputed."""
    if not data.startswith(MAGIC) or len(data) < HEADER.size:
        return data
    out = bytearray(data)
    out[24:32] = CHECKSUM.pack(xxhash.xxh3_64_intdigest(bytes(out[:24])))
    at = HEADER.size
    while at + RECORD_HEAD.size <= len(out):
        _, _, length = RECORD_HEAD.unpack_from(out, at)
        end = at + RECORD_HEAD.size + length
        if end + CHECKSUM.size > len(out):
            break
        out[end : end + CHECKSUM.size] = CHECKSUM.pack(xxhash.xxh3_64_intdigest(bytes(out[at:end])))
        at = end + CHECKSUM.size
    return bytes(out)


def check(data: bytes) -> None:
    if data and data[-1] & 1:
        data = with_checksums(data)
    hints, findings = check_hints(data)
    try:
        read = read_hints(data)
    except HintError as exc:
        assert findings and _first(exc) == _first(findings[0]), (exc, findings[:1])
        _check_stream(data, exc)
        return
    assert not findings, f"read_hints accepted what check_hints refused: {findings[:1]}"
    _check_stream(data, None, len(read.records))
    for guest in GUESTS:
        if next(check_against(read, guest), None) is None:
            for resolved in resolve(read, guest):
                assert (resolved.first >= 0).all() and (resolved.count > 0).all()
                assert (resolved.first + resolved.count <= guest.regions[resolved.region]).all()


def _check_stream(data: bytes, error: HintError | None, count: int | None = None) -> None:
    reader, seen = HintReader(io.BufferedReader(TrickleInput(data), 8)), 0
    try:
        for _ in reader.records():
            seen += 1
    except HintError as exc:
        assert error is not None and _first(exc) == _first(error), (exc, error)
        return
    assert error is None, f"the stream reader accepted what read_hints refused: {error}"
    assert seen == count, (seen, count)


def make_seeds(directory: str) -> list:
    os.makedirs(directory, exist_ok=True)
    seeds = []
    for kind in ("valid", "invalid"):
        folder = os.path.join(VECTORS, kind)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".hnt") and os.path.getsize(os.path.join(folder, name)) <= 64 << 10:
                shutil.copy(os.path.join(folder, name), os.path.join(directory, f"{kind}-{name}"))
                seeds.append(name)
    return seeds


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(harness.Fuzzer("hints", check, make_seeds).main(sys.argv, harness.work_dir("hints")))
