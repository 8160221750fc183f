"""Disk sources: the interface DISK pages are read through, and its raw and qcow2 backends.

The reader, the validator, ``inspect --files`` and the converters' disk scan see a disk only
through ``DiskSource``; ``open_disk`` opens a path as the right backend. A backend reads the
bytes the guest sees (``read``), lists where data may be (``data_ranges``: holes and
unallocated clusters are skipped by scans) and reads many page-sized runs at once in
ascending physical order, coalesced (``read_runs``): for a raw file the physical offset is the
offset, for qcow2 (or any qemu-img format) the host-file offset of the data cluster that
``qemu-img map --output=json`` reports, per file of the backing chain. Clusters without a
host offset (compressed, encrypted) are read through qemu's own block layer: qemu-nbd, spoken
to with libnbd.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from typing import TYPE_CHECKING

import numpy as np

from leanimg.errors import DiskError
from leanimg.rules import implements

if TYPE_CHECKING:
    import nbd  # libnbd's (python3-libnbd), imported when first needed

QCOW2_MAGIC = b"QFI\xfb"
COALESCE_GAP = 64 << 10  # read through holes up to this size between referenced blocks
MAX_READ = 8 << 20  # one coalesced read at most
IOV_MAX = 1024  # buffers per preadv call (Linux's UIO_MAXIOV)


class DiskSource:
    """A disk by guest-visible offset: what the reader and the converters use of a disk.

    ``name``: the disk's name in messages (a source attached to an image under no name takes
    the name of the image's only disk); ``path``: where it is, for messages; ``size``: bytes.
    ``read``, ``read_runs``, ``data_ranges``, ``fingerprint`` and ``close`` below; ``close``
    may be called more than once: by the image the source is attached to (once per link of
    its chain that has the disk) and by whoever opened it.
    A backend implements ``read``, ``close`` and, for ``read_runs``' coalesced reads,
    ``_locate`` and ``_file_fd``.
    """

    name: str
    path: str
    size: int

    def read(self, offset: int, length: int) -> bytes:
        """The ``length`` bytes at ``offset``; DiskError (LI-DSK-003) beyond the end."""
        raise NotImplementedError

    def data_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) ranges that may hold non-zero data, ascending."""
        return [(0, self.size)]

    def fingerprint(self) -> bytes:
        """The identity fingerprint of the disk table (spec §5.3), from 64 sampled blocks."""
        from leanimg.writer import disk_fingerprint

        return disk_fingerprint(self.read, self.size)

    def _check_span(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.size:
            raise DiskError(
                f"disk {self.name!r} ({self.path}): {length} bytes at {offset:#x} lie beyond "
                f"its end {self.size:#x} (truncated disk?)"
            )

    def _locate(self, offsets: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(file index, physical offset) of runs readable with one pread; file -1 = not so."""
        raise NotImplementedError

    def _file_fd(self, index: int) -> int:
        raise NotImplementedError

    def read_runs(
        self, offsets, length: int, *, sort: bool = True, out: np.ndarray | None = None, rows: np.ndarray | None = None
    ) -> np.ndarray:
        """The ``length`` bytes at each of ``offsets``, into row ``rows[k]`` of ``out`` (a 2-D
        uint8 array of rows of ``length`` bytes; by default a new one, row k for offset k).

        Sorted: runs are read in ascending physical order, neighbours coalesced into reads of
        at most MAX_READ bytes scattered straight into their rows (preadv). Unsorted: one read
        per run, in the order given.
        """
        offsets = np.asarray(offsets, np.int64)
        if out is None:
            out, rows = np.empty((len(offsets), length), np.uint8), np.arange(len(offsets))
        assert rows is not None  # (given with out)
        if not sort:
            for row, o in zip(rows.tolist(), offsets.tolist()):
                out[row] = np.frombuffer(self.read(o, length), np.uint8)
            return out
        for o in (offsets.min(), offsets.max()) if len(offsets) else ():
            self._check_span(int(o), length)
        files, physical = self._locate(offsets, length)
        for k in np.flatnonzero(files < 0).tolist():
            out[rows[k]] = np.frombuffer(self.read(int(offsets[k]), length), np.uint8)
        direct = np.flatnonzero(files >= 0)
        order = direct[np.lexsort((physical[direct], files[direct]))]
        for group in _coalesced(files[order], physical[order], length):
            ks = order[group]
            self._scatter(int(files[ks[0]]), physical[ks], [out[r] for r in rows[ks].tolist()], length)
        return out

    def _scatter(self, file_index: int, physical: np.ndarray, targets: list, length: int) -> None:
        """One coalesced read: ascending ``physical`` offsets into ``targets``, gaps skipped.
        Runs that overlap (blocks less than a page apart) are copied out of a plain read."""
        fd, start = self._file_fd(file_index), int(physical[0])
        total = int(physical[-1]) + length - start
        if (np.diff(physical) < length).any():
            data = os.pread(fd, total, start)
            if len(data) != total:
                raise DiskError(f"disk {self.name!r} ({self.path}): short read at {start:#x} (file truncated?)")
            for target, at in zip(targets, (physical - start).tolist()):
                target[:] = np.frombuffer(data, np.uint8, length, at)
            return
        buffers, pos = [], start
        for target, at in zip(targets, physical.tolist()):
            if at > pos:
                buffers.append(bytearray(at - pos))
            buffers.append(target)
            pos = at + length
        got = 0
        for i in range(0, len(buffers), IOV_MAX):
            got += os.preadv(fd, buffers[i : i + IOV_MAX], start + got)
        if got != total:
            raise DiskError(f"disk {self.name!r} ({self.path}): short read at {start:#x} (file truncated?)")

    def close(self) -> None:
        """Release what the source holds open."""


def _coalesced(files: np.ndarray, physical: np.ndarray, length: int):
    """Index groups of sorted runs that one pread covers (same file, small gaps, bounded size)."""
    if not len(files):
        return
    breaks = (files[1:] != files[:-1]) | (physical[1:] - (physical[:-1] + length) > COALESCE_GAP)
    starts = [0, *(np.flatnonzero(breaks) + 1).tolist(), len(files)]
    for a, b in zip(starts, starts[1:]):
        while a < b:
            limit = np.searchsorted(physical[a:b], physical[a] + MAX_READ - length, side="right")
            stop = a + max(1, int(limit))
            yield np.arange(a, stop)
            a = stop


class RawDisk(DiskSource):
    """A raw disk image (or block device) read with pread; holes found with SEEK_DATA."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name
        self.fd: int | None = _open(path, name)  # None once closed
        self.size = os.lseek(self.fd, 0, os.SEEK_END)

    def read(self, offset: int, length: int) -> bytes:
        self._check_span(offset, length)
        assert self.fd is not None  # (not closed)
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise DiskError(
                f"disk {self.name!r} ({self.path}): expected {length} bytes at {offset:#x}, "
                f"disk ends at {self.size:#x} (truncated disk?)"
            )
        return data

    def data_ranges(self) -> list[tuple[int, int]]:
        assert self.fd is not None  # (not closed)
        ranges, pos = [], 0
        while pos < self.size:
            try:
                start = os.lseek(self.fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but hole after pos
                    break
                return [(0, self.size)]  # no hole support here: scan everything
            if start >= self.size:
                break
            end = min(os.lseek(self.fd, start, os.SEEK_HOLE), self.size)
            ranges.append((start, end - start))
            pos = end
        return ranges

    def _locate(self, offsets, length):
        return np.zeros(len(offsets), np.int64), offsets

    def _file_fd(self, index: int) -> int:
        assert self.fd is not None  # (not closed)
        return self.fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ImageDisk(DiskSource):
    """A qcow2 (or other qemu-img format) disk, backing chain included, by guest-visible offset."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name
        chain = _qemu_img(["info", "--force-share", "--backing-chain", "--output=json", path], name, path)
        self.size = int(chain[0]["virtual-size"])
        self._files = [_open(c["filename"], name) if c.get("format") in ("qcow2", "raw") else None for c in chain]
        self._opened = np.array([fd is not None for fd in self._files])
        extents = _qemu_img(["map", "--force-share", "--output=json", path], name, path)
        self._starts = np.array([e["start"] for e in extents], np.int64)
        self._lengths = np.array([e["length"] for e in extents], np.int64)
        self._data = np.array([bool(e.get("data")) for e in extents])
        self._depth = np.array([int(e.get("depth", 0)) for e in extents], np.int64)
        self._host = np.array([int(e.get("offset", -1)) for e in extents], np.int64)
        self._nbd: nbd.NBD | None = None

    def data_ranges(self) -> list[tuple[int, int]]:
        return [(int(s), int(n)) for s, n, d in zip(self._starts, self._lengths, self._data) if d]

    def _locate(self, offsets, length):
        i = np.searchsorted(self._starts, offsets, side="right") - 1
        inside = offsets + length <= self._starts[i] + self._lengths[i]
        readable = inside & self._data[i] & (self._host[i] >= 0) & self._opened[self._depth[i]]
        files = np.where(readable, self._depth[i], -1)
        return files, np.where(readable, self._host[i] + offsets - self._starts[i], 0)

    def _file_fd(self, index: int) -> int:
        fd = self._files[index]
        assert fd is not None  # (_locate gives only the files opened)
        return fd

    def read(self, offset: int, length: int) -> bytes:
        self._check_span(offset, length)
        parts, pos, end = [], offset, offset + length
        i = int(np.searchsorted(self._starts, offset, side="right")) - 1
        while pos < end:
            stop = min(end, int(self._starts[i] + self._lengths[i]))
            if not self._data[i]:
                parts.append(bytes(stop - pos))
            elif self._host[i] >= 0 and self._files[self._depth[i]] is not None:
                host = int(self._host[i] + pos - self._starts[i])
                parts.append(os.pread(self._files[self._depth[i]], stop - pos, host))
            else:
                parts.append(self._read_through_qemu(pos, stop - pos))
            pos, i = stop, i + 1
        data = b"".join(parts)
        if len(data) != length:
            raise DiskError(f"disk {self.name!r} ({self.path}): short read at {offset:#x} (file truncated?)")
        return data

    def _read_through_qemu(self, offset: int, length: int) -> bytes:
        """Compressed or encrypted clusters: qemu-nbd (qemu's block layer) via libnbd."""
        if self._nbd is None:
            try:
                import nbd
            except ImportError:
                raise DiskError(
                    f"disk {self.name!r} ({self.path}) has compressed or encrypted clusters; "
                    "reading them needs libnbd's Python module (Debian: python3-libnbd)"
                ) from None
            handle = nbd.NBD()
            try:
                handle.connect_systemd_socket_activation(
                    [
                        "qemu-nbd",
                        "--read-only",
                        "--persistent",
                        "--image-opts",
                        # locking off: the destination QEMU may hold the image open while we read it
                        f"driver={_qemu_format(self.path)},file.driver=file,"
                        f"file.filename={self.path.replace(',', ',,')},file.locking=off",
                    ]
                )
            except nbd.Error as exc:
                raise DiskError(f"disk {self.name!r}: qemu-nbd cannot serve {self.path}: {exc}") from None
            self._nbd = handle
        parts = []
        for at in range(offset, offset + length, 32 << 20):
            parts.append(self._nbd.pread(min(32 << 20, offset + length - at), at))
        return b"".join(parts)

    def close(self) -> None:
        for fd in self._files:
            if fd is not None:
                os.close(fd)
        self._files = [None] * len(self._files)
        if self._nbd is not None:
            self._nbd.shutdown()
            self._nbd = None


def _open(path: str, name: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise DiskError(f"disk {name!r}: cannot open {path}: {exc.strerror}") from None


def _qemu_format(path: str) -> str:
    info = _qemu_img(["info", "--force-share", "--output=json", path], path, path)
    return info["format"]


def _qemu_img(args: list[str], name: str, path: str):
    try:
        proc = subprocess.run(["qemu-img", *args], capture_output=True, timeout=300)
    except FileNotFoundError:
        raise DiskError(
            f"disk {name!r} ({path}) is not a raw file; reading it needs qemu-img (Debian: qemu-utils)"
        ) from None
    if proc.returncode != 0:
        reason = proc.stderr.decode(errors="replace").strip().splitlines()
        raise DiskError(f"disk {name!r}: qemu-img cannot read {path}: {reason[-1] if reason else 'failed'}")
    return json.loads(proc.stdout)


def open_disk(path: str, name: str) -> DiskSource:
    """A raw disk, or a qcow2 one (recognised by its magic) read through qemu-img's map."""
    fd = _open(path, name)
    try:
        head = os.pread(fd, len(QCOW2_MAGIC), 0)
    finally:
        os.close(fd)
    if head == QCOW2_MAGIC:
        return ImageDisk(path, name)
    return RawDisk(path, name)


@implements("LI-DSK-004")
def check_identity(disk: DiskSource, info) -> None:
    """Refuse (LI-DSK-004, closing it) a source that is not the disk ``info`` of a disk table
    (its name, size_bytes and fingerprint): another size or another fingerprint."""
    if disk.size != info.size_bytes:
        disk.close()
        raise DiskError(
            f"disk {info.name!r}: {disk.path} has {disk.size} bytes, the image recorded {info.size_bytes}",
            rule="LI-DSK-004",
        )
    if disk.fingerprint() != info.fingerprint:
        disk.close()
        raise DiskError(
            f"disk {info.name!r}: {disk.path} has another identity (fingerprint differs "
            "from the disk table): not the disk of this checkpoint",
            rule="LI-DSK-004",
        )
