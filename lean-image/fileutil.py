"""File helpers shared by the writer, the restorer, the page map and the tools."""

from __future__ import annotations

import atexit
import fcntl
import os
import stat
import sys
from typing import BinaryIO, cast

from .compressed_input import PrefixedInput, decompressing
from .errors import SourceFormatError


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


def read_ahead(fileobj, length: int) -> None:
    """Ask the kernel to read the next ``length`` bytes of ``fileobj`` into the page cache in
    the background (posix_fadvise WILLNEED), where it is a regular file; else nothing."""
    try:
        fd, at = fileobj.fileno(), fileobj.tell()
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.posix_fadvise(fd, at, length, os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both)
        pass


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocate ``length`` bytes at ``offset`` of a file, keeping its size (Linux fallocate
    PUNCH_HOLE, which os does not offer): the page cache drops them unwritten. False where the
    file system or system cannot."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) == 0


def _iov_max() -> int:
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (AttributeError, ValueError, OSError):
        return 1024


IOV_MAX = _iov_max()


def writev_all(fd: int, buffers: list) -> int:
    """Write ``buffers`` to ``fd`` in order, IOV_MAX at a time, resuming partial writes
    (a pipe, a signal); return the number of bytes written.  Gathers from the buffers in
    place: no joined copy."""
    written, i = 0, 0
    while i < len(buffers):
        batch = buffers[i : i + IOV_MAX]
        done = os.writev(fd, batch)
        written += done
        if done == sum(map(len, batch)):
            i += len(batch)
            continue
        k = 0
        while k < len(batch) and done >= len(batch[k]):
            done -= len(batch[k])
            k += 1
        i += k
        if done:  # the k-th buffer went out in part
            buffers[i] = memoryview(buffers[i]).cast("B")[done:]
    return written


class GatherWriter:
    """Writes lists of buffers to a binary file object in order: with writev straight from
    the buffers when it has a file descriptor (flushed first, so nothing buffered is
    overtaken), else one write() per buffer (BytesIO)."""

    def __init__(self, out):
        self.out, self.written = out, 0
        try:
            self.fd = out.fileno()
        except (AttributeError, OSError, ValueError):
            self.fd = None
        else:
            out.flush()
            widen_pipe(self.fd)

    def write_all(self, parts: list) -> None:
        if self.fd is None:
            for part in parts:
                self.out.write(part)
            self.written += sum(map(len, parts))
        else:
            self.written += writev_all(self.fd, parts)


# Linux F_SETPIPE_SZ; 1 MiB is /proc/sys/fs/pipe-max-size's default, allowed to anyone
F_SETPIPE_SZ = 1031
PIPE_BUFFER_BYTES = 1 << 20


def widen_pipe(fd: int) -> None:
    """Give a pipe on ``fd`` a 1 MiB buffer instead of 64 KiB: a restore piped into
    ``qemu -incoming exec:`` then wakes its reader 16x less often.  Not a pipe, or not
    allowed: left as it is."""
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BUFFER_BYTES)
    except OSError:
        pass


def is_special_file(path) -> bool:
    """True if ``path`` exists and is a device (/dev/null) or a FIFO: such a destination is
    written in place, because renaming a finished temporary file over it would replace the
    device node or the pipe itself (as root: /dev/null becomes a regular file)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode)


class OutputRefused(Exception):
    """An output path the command must not write (an input, or an existing file without --force)."""


def check_output(output, inputs, *, force: bool = False) -> None:
    """Refuse ``output`` when it is one of ``inputs`` (the same file by path, hard link or
    symbolic link: the same device and inode), even with ``force``; refuse an existing file
    that is not a device or FIFO unless ``force`` (zstd's convention). A device (/dev/null)
    or FIFO is written in place and is never 'existing output'."""
    try:
        target = os.stat(output)
    except OSError:
        return  # nothing there yet: nothing to lose
    for path in inputs:
        try:
            source = os.stat(path)
        except OSError:
            continue
        if (source.st_dev, source.st_ino) == (target.st_dev, target.st_ino):
            same = "" if os.path.abspath(path) == os.path.abspath(output) else f" (the same file as {path})"
            raise OutputRefused(f"{output} is an input of this command{same}: it is never written over")
    if not force and not is_special_file(output):
        raise OutputRefused(f"{output} exists; use -f/--force to replace it")


# temporary outputs not yet renamed or removed: whatever ends the process (an exception, a
# SIGINT/SIGTERM turned into SystemExit, even between creating the file and the code that would
# clean it up), the atexit hook below removes them
_TEMPORARIES: set[str] = set()


def temporary_beside(path: str) -> str:
    """A fresh name in ``path``'s directory for the temporary file of an output that becomes
    ``path`` by rename once complete. Every command names them alike,
    ``.leanimg-<output name>-<random>.partial``, so a file a SIGKILL left behind says what it
    was; it is never the complete output."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".leanimg-{name[:100]}-{os.urandom(4).hex()}.partial")


def create_temporary(path: str, buffering: int = -1) -> tuple[str, BinaryIO]:
    """A new temporary file for the output ``path``: (its name, open for writing)."""
    temp = temporary_beside(path)
    _TEMPORARIES.add(temp)  # before it exists: no moment when it is not tracked
    try:
        return temp, open(temp, "xb", buffering=buffering)
    except OSError:
        _TEMPORARIES.discard(temp)
        raise


def commit_temporary(temp: str, path: str) -> None:
    """Make the complete temporary file ``temp`` the output ``path`` (permissions as open()
    would give, data and name durable)."""
    os.chmod(temp, 0o666 & ~umask())
    os.replace(temp, path)
    _TEMPORARIES.discard(temp)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def discard_temporary(temp: str) -> None:
    _TEMPORARIES.discard(temp)
    try:
        os.unlink(temp)
    except FileNotFoundError:
        pass


@atexit.register
def _discard_leftover_temporaries() -> None:
    for temp in list(_TEMPORARIES):
        discard_temporary(temp)


def write_atomically(path: str, produce) -> int:
    """Run ``produce(fileobj)`` into a temporary file that becomes ``path`` only when complete.

    The result has the permissions open() would give it; on any failure (or a signal
    turned into SystemExit) the temporary file is removed and ``path`` is untouched.
    A device or FIFO (is_special_file) is written directly: there is no file to leave
    behind, and what reads it sees the stream end early if ``produce`` fails.
    """
    if is_special_file(path):
        with open(path, "wb") as device:
            return produce(device)
    temp, out = create_temporary(path)
    try:
        with out:
            written = produce(out)
            out.flush()
            os.fsync(out.fileno())
        commit_temporary(temp, path)
    except BaseException:
        discard_temporary(temp)
        raise
    return written


def sha256_file(path) -> str:
    import hashlib  # (with OpenSSL: not imported by every command)

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_input(src) -> BinaryIO:
    """The save file ``src`` opened for reading: a path, - for stdin, or an open binary file;
    one compressed with zstd, gzip, xz or bzip2 is decompressed as it is read, and then cannot
    seek (leanimg.compressed_input)."""
    if src == "-":
        return decompressing(sys.stdin.buffer, close_stream=False)
    if not isinstance(src, (str, os.PathLike)):
        return decompressing(src)
    try:
        stream = open(src, "rb", buffering=1 << 20)
    except OSError as exc:
        raise SourceFormatError(f"cannot open {src}: {exc.strerror}", structure="input") from None
    try:
        return decompressing(stream)
    except BaseException:
        stream.close()
        raise


def peek_input(src, size: int) -> tuple[bytes, BinaryIO]:
    """The first ``size`` bytes of the save file ``src`` (fewer when it is shorter) and the
    file to read from the start: ``src`` opened and rewound, or, when it cannot seek (a pipe),
    a reader that gives those bytes again first."""
    stream = open_input(src)
    head = stream.read(size)
    if stream.seekable():
        stream.seek(0)
        return head, stream
    # (a raw binary input: read, readinto and close are what readers of a save use of BinaryIO)
    return head, cast(BinaryIO, PrefixedInput(head, stream, close_rest=stream is not sys.stdin.buffer))
