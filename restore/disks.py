"""Disk sources for DISK pages: a raw file, checked against the disk table's identity."""

from __future__ import annotations

import os

from leanimg.errors import DiskError


class RawDisk:
    """A raw disk image (or block device) read with pread."""

    def __init__(self, path: str, name: str):
        self.path = path
        self.name = name
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DiskError(f"disk {name!r}: cannot open {path}: {exc.strerror}") from None
        self.size = os.lseek(self.fd, 0, os.SEEK_END)

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.size:
            raise DiskError(f"disk {self.name!r} ({self.path}): {length} bytes at {offset:#x} lie beyond "
                            f"its end {self.size:#x} (truncated disk?)", rule="LI-DSK-003")
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise DiskError(f"disk {self.name!r} ({self.path}): expected {length} bytes at {offset:#x}, "
                            f"disk ends at {self.size:#x} (truncated disk?)", rule="LI-DSK-003")
        return data

    def close(self) -> None:
        os.close(self.fd)


def fingerprint_of(source) -> bytes:
    from leanimg.writer import disk_fingerprint
    return disk_fingerprint(source.read, source.size)


def open_disk_source(source, info=None, *, check_identity: bool = True):
    """Open ``source`` (a path or an object with read/size/close) for disk ``info``."""
    disk = RawDisk(os.fspath(source), info.name if info else os.fspath(source)) \
        if isinstance(source, (str, os.PathLike)) else source
    if info is not None and check_identity:
        if disk.size != info.size_bytes:
            disk.close()
            raise DiskError(f"disk {info.name!r}: {disk.path} has {disk.size} bytes, the image recorded "
                            f"{info.size_bytes}", rule="LI-DSK-004")
        if fingerprint_of(disk) != info.fingerprint:
            disk.close()
            raise DiskError(f"disk {info.name!r}: {disk.path} has another identity (fingerprint differs "
                            "from the disk table): not the disk of this checkpoint", rule="LI-DSK-004")
    return disk
