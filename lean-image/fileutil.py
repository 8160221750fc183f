"""File helpers shared by the writer, the restorer, the page map and the tools."""

from __future__ import annotations

import hashlib
import os


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict_from_page_cache(path) -> None:
    """Drop a file from the page cache (flushed first so dirty pages go too), for cold-read
    measurements: /proc/sys/vm/drop_caches is not writable on these machines."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_atomically(path: str, produce) -> int:
    """Run ``produce(fileobj)`` into a temporary file that becomes ``path`` only when complete.

    The result has the permissions open() would give it; on any failure (or a signal
    turned into SystemExit) the temporary file is removed and ``path`` is untouched.
    """
    temp = f"{path}.partial-{os.getpid()}"
    try:
        with open(temp, "wb") as out:
            written = produce(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
        fsync_path(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return written


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
