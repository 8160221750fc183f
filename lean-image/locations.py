"""Where images live: a local path or an object in S3-compatible storage (``s3://BUCKET/KEY``,
leanimg.s3). The reader, the validator and the writer see only what this module hands them:
a file with ``pread`` to read, an ``Output`` to write and then commit or discard.
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

from . import s3
from .fileutil import commit_temporary, create_temporary, discard_temporary, is_special_file

is_remote = s3.is_s3


class LocalFile(io.FileIO):
    """A local file, unbuffered (every read is a pread or a large read)."""

    def pread(self, length: int, offset: int) -> bytes:
        return os.pread(self.fileno(), length, offset)


def open_image(name) -> io.RawIOBase:
    """``name`` opened for reading: a LocalFile or an s3.S3Object (OSError or StoreError)."""
    if is_remote(name):
        return s3.S3Object(name)
    return LocalFile(os.fspath(name), "r")


def display(name) -> str:
    """``name`` as errors and reports show it: an object as given, a path as given."""
    return name if is_remote(name) else os.fspath(name)


def exists(name) -> bool:
    return s3.exists(name) if is_remote(name) else os.path.exists(name)


def same_location(a, b) -> bool:
    """Whether names ``a`` and ``b`` are the same image (an object by bucket and key, a local
    file by device and inode)."""
    if is_remote(a) or is_remote(b):
        return is_remote(a) and is_remote(b) and s3.split(a) == s3.split(b)
    try:
        x, y = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


class Output:
    """An output that becomes visible under its name only when complete: a local temporary
    file beside it, fsynced and renamed into place (a device or FIFO is written in place), or
    a multipart upload completed. ``discard`` leaves the name untouched."""

    def __init__(self, name, buffering: int = 1 << 20):
        self.name = display(name)
        self._temp: str | None = None
        self._done = False
        self.file: s3.S3Upload | BinaryIO
        if is_remote(self.name):
            self.file = s3.S3Upload(self.name)
        elif is_special_file(self.name):
            self.file = open(self.name, "wb", buffering=buffering)
        else:
            self._temp, self.file = create_temporary(self.name, buffering=buffering)

    def sync(self) -> None:
        """What is written so far made durable (a local file's fsync; an upload's parts are
        durable once sent, and the object exists only at ``commit``)."""
        if not isinstance(self.file, s3.S3Upload):
            self.file.flush()
            if self._temp is not None:
                os.fsync(self.file.fileno())

    def commit(self) -> None:
        if isinstance(self.file, s3.S3Upload):
            self.file.commit()
        else:
            self.sync()
            self.file.close()
            if self._temp is not None:
                commit_temporary(self._temp, self.name)
        self._done = True

    def discard(self) -> None:
        if self._done:
            return
        self._done = True
        if isinstance(self.file, s3.S3Upload):
            self.file.discard()
            return
        self.file.close()
        if self._temp is not None:
            discard_temporary(self._temp)


def check_object_output(output: str, inputs, *, force: bool = False) -> None:
    """check_output for an object: refuse one of ``inputs`` (same bucket and key) even with
    ``force``, and an existing object unless ``force``."""
    from .fileutil import OutputRefused

    s3.check_bucket(output)
    for name in inputs:
        if same_location(name, output):
            raise OutputRefused(f"{output} is an input of this command: it is never written over")
    if not force and s3.exists(output):
        raise OutputRefused(f"{output} exists; use -f/--force to replace it")
