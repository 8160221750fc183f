"""The files a chain's parents are looked for in (spec §10): the candidates the caller names and
the *.lean files beside each link, their image_uuid and parent_uuid read once (Search). Small
files are handed to the kernel's read-ahead together and kept open for links_batch.open_links
to read whole; from SCAN_THREAD_MIN files on, they are read on a thread of their own
(leanimg._native.scan_files), which the walk (parents.py) takes in as it goes; objects in a
store are listed and read through s3.py.
"""

from __future__ import annotations

import bisect
import os
import threading
import time

import numpy as np

from . import s3
from .format import HEADER
from .locations import is_remote
from .structures import WHOLE_READ_BELOW

from .native import backend as _native  # the files beside an image read on a thread of their own

SIBLINGS_MAX = 100_000

Uuids = tuple[bytes, bytes | None]  # a file's image_uuid and parent_uuid (None: none, or too short)


class Search:
    """What the walk read of the candidates: each path's image_uuid (None: unreadable), the
    first path read with each UUID, each path's parent_uuid, the small files kept open (path
    -> (fd, size), for links_batch.open_links), the directories listed, and the scan of a
    directory still under way on its own thread (_Scan), taken in as the walk asks."""

    def __init__(self) -> None:
        self.uuid_of: dict[str, bytes | None] = {}
        self.by_uuid: dict[bytes, str] = {}  # UUID -> first path read with it: O(1) per link
        self.parent_of: dict[str, bytes | None] = {}  # path -> its header's parent_uuid
        self.kept: dict[str, tuple[int, int]] = {}  # path -> (fd, size) of the small files kept open
        self.listed: set[str] = set()
        self.scan: _Scan | None = None

    def note(self, path: str, found: Uuids | None, fd_size: tuple[int, int] | None = None) -> None:
        """``found``: (image_uuid, parent_uuid) of ``path`` (None: unreadable); ``fd_size``: it is kept open."""
        self.uuid_of[path] = found and found[0]
        if found is not None:
            self.by_uuid.setdefault(found[0], path)
            self.parent_of[path] = found[1]
        if fd_size is not None:
            self.kept[path] = fd_size

    def path_of(self, wanted: bytes) -> str | None:
        """The first path read with image_uuid ``wanted``; a scan under way is waited for until
        it has read that path, or every file."""
        while wanted not in self.by_uuid and self.scan is not None:
            self._take_in(self.scan, wait=True)
        return self.by_uuid.get(wanted)

    def finish(self) -> None:
        """Every file of a scan under way read and taken in."""
        while self.scan is not None:
            self._take_in(self.scan, wait=True)

    def close(self) -> None:
        """Close the files kept open that no link took (a scan under way finished first)."""
        self.finish()
        for fd, _ in self.kept.values():
            os.close(fd)
        self.kept.clear()

    def _take_in(self, scan: _Scan, wait: bool) -> None:
        for path, found, fd_size in scan.read(wait):
            self.note(path, found, fd_size)
        if scan.done():
            self.scan = None


def find_candidate(wanted: bytes, candidates, search: Search):
    """The candidate (open image or path) whose image_uuid is ``wanted``, or a path read
    before with it."""
    for candidate in candidates:
        if not isinstance(candidate, (str, os.PathLike)) and candidate.header.image_uuid == wanted:
            return candidate
    paths = [_absolute(c) for c in candidates if isinstance(c, (str, os.PathLike))]
    _read_uuids([path for path in dict.fromkeys(paths) if path not in search.uuid_of], search)
    return search.by_uuid.get(wanted)


def _absolute(name) -> str:
    return name if is_remote(name) else os.path.abspath(os.fspath(name))


def find_sibling(wanted: bytes, link_path: str, search: Search):
    """The *.lean file beside ``link_path`` (or read before) whose image_uuid is ``wanted``."""
    siblings = _siblings(link_path, search)
    _read_uuids([path for path in siblings if path not in search.uuid_of], search)
    return search.path_of(wanted)


def _read_uuids(paths: list[str], search: Search) -> None:
    """Read the UUIDs of ``paths`` into ``search``: many on a thread of their own (_Scan),
    which the walk takes in as it goes; else here."""
    remote = [path for path in paths if is_remote(path)]
    if remote:
        for path, head in zip(remote, s3.read_heads(remote, _UUIDS_END)):
            search.note(path, _uuids_of(head) if head is not None else None)
        paths = [path for path in paths if not is_remote(path)]
    if len(paths) >= SCAN_THREAD_MIN and _native is not None:
        search.finish()  # paths are taken in in the order they are named
        search.scan = _Scan(paths, _kept_most() - len(search.kept))
    elif paths:
        for path, found in zip(paths, _image_uuids(paths, search.kept)):
            search.note(path, found)


def _siblings(path: str, search: Search) -> list[str]:
    """The other *.lean files beside ``path`` (where the links of a chain usually live), listed
    once: nearest first, those sorting before ``path``'s name descending, then those after
    it (a chain's links are usually named in the order they were made). A UUID two of them
    share is taken from the first in this order. An object's are those of its prefix."""
    if is_remote(path):
        directory, own = path.rpartition("/")[::2]
        names = (
            [name.rpartition("/")[2] for name in s3.list_beside(path, ".lean", SIBLINGS_MAX)]
            if directory not in search.listed
            else []
        )
    else:
        directory, own = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        try:
            names = (
                []
                if directory in search.listed
                else sorted(n for n in os.listdir(directory) if n.endswith(".lean"))[:SIBLINGS_MAX]
            )
        except OSError:
            names = []
    search.listed.add(directory)
    at = bisect.bisect_left(names, own)
    after = at + 1 if at < len(names) and names[at] == own else at  # the image itself is open already
    join = (lambda name: f"{directory}/{name}") if is_remote(path) else (lambda name: os.path.join(directory, name))
    return [join(n) for n in names[:at][::-1] + names[after:]]


READ_AHEAD_FILES = 256  # files open at once while their UUIDs are read
READ_AHEAD_BYTES = 256 << 20  # small files handed to the kernel's read-ahead, at most
KEPT_FILES_MAX = 4096  # small files kept open for open_links (and a quarter of the open-file limit)
SCAN_THREAD_MIN = 16  # files from which their UUIDs are read on a thread of their own,
SCAN_GROUP = 64  # this many opened and asked for at once (a walk waits for the first
# group: 1000 warm files take 5.7 ms in groups of 64, 10 ms of 256)
_UUIDS_AT, _UUIDS_END = HEADER.offset("image_uuid"), HEADER.offset("parent_uuid") + 16


def _image_uuids(paths: list[str], kept: dict[str, tuple[int, int]]) -> list[Uuids | None]:
    """The image_uuid and parent_uuid of each of ``paths`` (None: unreadable or too short; such
    candidates simply do not match). Files small enough to be read whole when opened as links
    (structures.WHOLE_READ_BELOW) are first handed to the kernel's read-ahead, READ_AHEAD_FILES at
    a time (posix_fadvise WILLNEED): the reads of a deep chain's links are then queued together,
    not one after another (cold, 1000 small links: 310 -> 130 ms). Those stay open, path ->
    (fd, size) in ``kept`` (KEPT_FILES_MAX at most), for links_batch.open_links to read whole."""
    budget = [READ_AHEAD_BYTES]
    most = _kept_most()
    found: list[Uuids | None] = []
    for lo in range(0, len(paths), READ_AHEAD_FILES):
        batch = paths[lo : lo + READ_AHEAD_FILES]
        for path, (fd, small) in zip(batch, [_open_ahead(path, WHOLE_READ_BELOW, budget) for path in batch]):
            if fd is None:
                found.append(None)
                continue
            try:
                found.append(_uuids_of(os.pread(fd, _UUIDS_END, 0)))
            except OSError:
                found.append(None)
                small = 0
            if small and len(kept) < most:
                kept[path] = (fd, small)
            else:
                os.close(fd)
    return found


def _uuids_of(raw: bytes) -> Uuids | None:
    """(image_uuid, parent_uuid) from a file's first bytes; None: too short for its image_uuid
    (a file too short for its parent_uuid, or with none (zero), has None there)."""
    if len(raw) < _UUIDS_AT + 16:
        return None
    parent = bytes(raw[_UUIDS_END - 16 :]) if len(raw) == _UUIDS_END else None
    return bytes(raw[_UUIDS_AT : _UUIDS_AT + 16]), parent if parent is None or any(parent) else None


class _Scan:
    """_image_uuids of many paths on a thread of its own (leanimg._native.scan_files: the
    opens, WILLNEEDs and header reads of a directory of links without the GIL), while the
    walk checks the links found so far: cold, the reads of depth 1000's headers take ~35 ms
    the walk no longer waits for. The same files are kept open, the same read ahead."""

    POLL = 50e-6  # seconds between looks at the progress while waiting for it

    def __init__(self, paths: list[str], keep_most: int):
        assert _native is not None  # a scan runs only with the backend (_read_uuids)
        names = [os.fsencode(path) + b"\0" for path in paths]
        starts = np.zeros(len(names) + 1, np.int64)
        np.cumsum([len(name) for name in names], out=starts[1:])
        self.paths, self.taken = paths, 0
        self.fds, self.sizes = np.full(len(paths), -2, np.int32), np.zeros(len(paths), np.int64)
        self.got, self.heads = np.full(len(paths), -1, np.int64), np.zeros((len(paths), _UUIDS_END), np.uint8)
        self.progress = np.zeros(1, np.int64)
        args = (
            b"".join(names),
            starts,
            WHOLE_READ_BELOW,
            READ_AHEAD_BYTES,
            max(keep_most, 0),
            SCAN_GROUP,
            self.fds,
            self.sizes,
            self.got,
            self.heads,
            self.progress,
        )
        self.thread = threading.Thread(target=_native.scan_files, args=args, name="leanimg-scan", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.taken == len(self.paths)

    def read(self, wait: bool) -> list[tuple[str, Uuids | None, tuple[int, int] | None]]:
        """(path, (image_uuid, parent_uuid) or None, (fd, size) kept or None) of the files read
        since the last call; with ``wait``, at least one (the thread is waited for). If the
        thread ended early (it cannot start), the rest are read here."""
        ready = self._ready()
        while wait and ready == self.taken and self.thread.is_alive():
            time.sleep(self.POLL)
            ready = self._ready()
        if ready == self.taken and not self.thread.is_alive():
            ready = self._ready()
            if ready < len(self.paths) and ready == self.taken:
                return self._read_here()
        lo, self.taken = self.taken, ready
        return [
            (
                self.paths[k],
                None if got < 0 else _uuids_of(self.heads[k, :got].tobytes()),
                (fd, size) if fd >= 0 else None,
            )
            for k, got, fd, size in zip(
                range(lo, ready),
                self.got[lo:ready].tolist(),
                self.fds[lo:ready].tolist(),
                self.sizes[lo:ready].tolist(),
            )
        ]

    def _ready(self) -> int:
        return int(self.progress[0])

    def _read_here(self) -> list[tuple[str, Uuids | None, tuple[int, int] | None]]:
        rest = self.paths[self.taken :]
        kept: dict[str, tuple[int, int]] = {}
        self.taken = len(self.paths)
        return [(path, found, kept.get(path)) for path, found in zip(rest, _image_uuids(rest, kept))]


def _kept_most() -> int:
    """How many files _image_uuids keeps open: KEPT_FILES_MAX, and no more than a quarter of
    this process's open-file limit (the chain's links keep theirs open too)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 0
    return KEPT_FILES_MAX if soft == resource.RLIM_INFINITY else min(KEPT_FILES_MAX, soft // 4)


def _open_ahead(path: str, small: int, budget: list) -> tuple[int | None, int]:
    """(``path`` opened, its size if it is under ``small`` bytes and ``budget[0]`` (bytes)
    allows, else 0); the file's content is then asked of the kernel ahead of use. (None, 0):
    it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None, 0
    try:
        size = os.fstat(fd).st_size
        if 0 < size < small and size <= budget[0]:
            budget[0] -= size
            try:
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):  # no fadvise here: the reads simply come later
                pass
            return fd, size
    except OSError:
        pass
    return fd, 0
