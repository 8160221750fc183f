"""Finding an image's parent chain (spec §10): each parent is looked up by its UUID among
the candidates the caller names and the *.lean files beside the child, opened, and then
verified by digest and page size, link after link (chains may be 4096 deep).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
import uuid

import numpy as np

from .errors import ChainError, LeanImageError
from . import s3
from .format import CHAIN_DEPTH_MAX, HEADER
from .locations import is_remote
from .rules import implements

from .native import backend as _native  # the files beside an image read on a thread of their own

SIBLINGS_MAX = 100_000


CHECK_BATCH = 64  # links whose tables check_links checks together: the first batch,
CHECK_BATCH_LATER = 128  # and each one after it (the first small: a cold chain's checks start early;
CHECK_BATCH_BYTES = 64 << 20  # the later large: a batch costs ~0.7 ms however small), of at most these bytes


@implements("LI-CHN-001", "LI-CHN-005")
def attach_chain(image, parents: list, open_link, check_links=None, open_links=None) -> None:
    """Set ``parent`` on ``image`` and every link below it; ``open_link(path)`` opens one link.
    ``parents`` are candidate paths or open images (an open image brings its own chain).
    With ``check_links``, ``open_link`` reads a link's header, footer and INDEX only, and
    ``check_links(links)`` checks the rest of CHECK_BATCH links at a time, in chain order:
    before any finding of the walk is raised, the links opened before it are checked, so the
    first link with a finding is reported, as when each link was checked when opened.
    ``open_links(paths)`` (path -> link, for those it opens as ``open_link`` would, nothing
    raised) opens the links the walk expects next a batch at a time; the walk takes a link
    from there only when it finds that very path, and opens any other with ``open_link``.
    A batch is CHECK_BATCH links, then CHECK_BATCH_LATER, each of CHECK_BATCH_BYTES at most
    (of files read whole)."""
    pending: list = []
    search = _Search()
    ahead = _Ahead(open_links)
    try:
        _walk(image, parents, open_link, pending, check_links, ahead, search)
    except LeanImageError:
        if pending:
            check_links(pending)
        raise
    finally:
        ahead.close_unused()
        search.close()
    if pending:
        check_links(pending)
    # links are joined by UUID first, so that a cycle is reported as one; then verified by digest
    for link in image.chain():
        if link.parent is not None:
            first = next(parent_problems(link, link.parent), None)
            if first is not None:
                raise first


def _walk(image, parents: list, open_link, pending: list, check_links, ahead: "_Ahead", search: "_Search") -> None:
    seen = {image.header.image_uuid}
    link = image
    batches, held = 0, 0  # checked so far; bytes of the pending links' files read whole
    while link.header.has_parent:
        wanted = link.header.parent_uuid
        where = dict(offset=HEADER.offset("parent_uuid"), structure="header.parent_uuid", path=link.path)
        if wanted in seen:
            raise ChainError(f"parent {_uuid(wanted)} is already in the chain (cycle)", rule="LI-CHN-005", **where)
        if len(seen) >= CHAIN_DEPTH_MAX:
            raise ChainError(f"chain deeper than {CHAIN_DEPTH_MAX}", rule="LI-CHN-005", **where)
        candidate = _find_candidate(wanted, parents, search) or _find_sibling(wanted, link.path, search)
        if candidate is None:
            raise ChainError(
                f"parent image {_uuid(wanted)} not found among {len(parents)} candidate(s) "
                "and the files beside the image; pass it with --parent",
                rule="LI-CHN-001",
                **where,
            )
        if not isinstance(candidate, str):
            link.parent = candidate  # an open image brings its own chain
            break
        link.parent = ahead.take(candidate, search) or open_link(candidate)
        seen.add(link.parent.header.image_uuid)
        link = link.parent
        if check_links is not None:
            pending.append(link)
            held += link.tables.file.size if link.tables.file.holds_whole else 0
            if len(pending) >= (CHECK_BATCH_LATER if batches else CHECK_BATCH) or held >= CHECK_BATCH_BYTES:
                batch = pending[:]
                pending.clear()
                batches, held = batches + 1, 0
                check_links(batch)


@implements("LI-CHN-002", "LI-CHN-003")
def parent_problems(child, parent):
    """The parent is the image the child was made against: its digest and page size."""
    if parent.footer.image_digest != child.header.parent_digest:
        yield ChainError(
            f"parent {parent.path} has image_digest {parent.footer.image_digest.hex()}, "
            f"expected {child.header.parent_digest.hex()} (parent modified or replaced)",
            offset=HEADER.offset("parent_digest"),
            structure="header.parent_digest",
            rule="LI-CHN-002",
            path=child.path,
        )
    if parent.page_size != child.page_size:
        yield ChainError(
            f"parent page_size {parent.page_size}, expected {child.page_size}",
            offset=HEADER.offset("page_size"),
            structure="header.page_size",
            rule="LI-CHN-003",
            path=child.path,
        )


class _Ahead:
    """Links opened before the walk reaches them (``open_links``), by path; each path is
    tried once. The run tried from a path follows the parent UUIDs read from the files beside
    the image (_image_uuids): a guess, which the walk's own lookup confirms link by link."""

    def __init__(self, open_links):
        self.open_links, self.opened, self.tried, self.runs = open_links, {}, set(), 0

    def take(self, path: str, search: "_Search"):
        """The link opened ahead for ``path`` (None: open it with open_link)."""
        if self.open_links is not None and path not in self.tried:
            most = CHECK_BATCH_LATER if self.runs else CHECK_BATCH
            self.runs += 1
            run = [p for p in _expected_links(path, search, most) if p not in self.tried]
            self.tried.update(run)
            self.opened.update(self.open_links(run, search.kept))
        return self.opened.pop(path, None)

    def close_unused(self) -> None:
        for link in self.opened.values():
            link.close()
        self.opened.clear()


def _expected_links(first: str, search: "_Search", most: int) -> list[str]:
    """``first`` and up to ``most - 1`` paths the chain is expected to go on with, up to the
    one whose size makes CHECK_BATCH_BYTES (a file not kept open counted as the largest read
    whole), as the walk's batches end: each file's parent_uuid, as _image_uuids read it,
    looked up among the files read."""
    from .reader import WHOLE_READ_BELOW

    run, seen = [first], {first}
    held = search.kept.get(first, (None, WHOLE_READ_BELOW))[1]
    while len(run) < most and held < CHECK_BATCH_BYTES:
        parent = search.parent_of.get(run[-1])
        path = search.path_of(parent) if parent is not None else None
        if path is None or path in seen:
            break
        held += search.kept.get(path, (None, WHOLE_READ_BELOW))[1]
        run.append(path)
        seen.add(path)
    return run


def _uuid(raw: bytes) -> str:
    return str(uuid.UUID(bytes=bytes(raw)))


class _Search:
    """What the walk read of the candidates: each path's image_uuid (None: unreadable), the
    first path read with each UUID, each path's parent_uuid, the small files kept open (path
    -> (fd, size), for links_batch.open_links), the directories listed, and the scan of a
    directory still under way on its own thread (_Scan), taken in as the walk asks."""

    def __init__(self):
        self.uuid_of: dict = {}
        self.by_uuid: dict = {}  # UUID -> first path read with it: O(1) per link
        self.parent_of: dict = {}  # path -> its header's parent_uuid
        self.kept: dict = {}
        self.listed: set = set()
        self.scan: _Scan | None = None

    def note(self, path: str, found, fd_size=None) -> None:
        """``found``: (image_uuid, parent_uuid) of ``path`` (None: unreadable); ``fd_size``: it is kept open."""
        self.uuid_of[path] = found and found[0]
        if found is not None:
            self.by_uuid.setdefault(found[0], path)
            self.parent_of[path] = found[1]
        if fd_size is not None:
            self.kept[path] = fd_size

    def path_of(self, wanted: bytes):
        """The first path read with image_uuid ``wanted``; a scan under way is waited for until
        it has read that path, or every file."""
        while wanted not in self.by_uuid and self.scan is not None:
            self._take_in(wait=True)
        return self.by_uuid.get(wanted)

    def finish(self) -> None:
        """Every file of a scan under way read and taken in."""
        while self.scan is not None:
            self._take_in(wait=True)

    def close(self) -> None:
        """Close the files kept open that no link took (a scan under way finished first)."""
        self.finish()
        for fd, _ in self.kept.values():
            os.close(fd)
        self.kept.clear()

    def _take_in(self, wait: bool) -> None:
        for path, found, fd_size in self.scan.read(wait):
            self.note(path, found, fd_size)
        if self.scan.done():
            self.scan = None


def _find_candidate(wanted: bytes, candidates, search: _Search):
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


def _find_sibling(wanted: bytes, link_path: str, search: _Search):
    """The *.lean file beside ``link_path`` (or read before) whose image_uuid is ``wanted``."""
    siblings = _siblings(link_path, search)
    _read_uuids([path for path in siblings if path not in search.uuid_of], search)
    return search.path_of(wanted)


def _read_uuids(paths: list[str], search: _Search) -> None:
    """Read the UUIDs of ``paths`` into ``search``: many on a thread of their own (_Scan),
    which the walk takes in as it goes; else here."""
    remote = [path for path in paths if is_remote(path)]
    if remote:
        for path, head in zip(remote, s3.read_heads(remote, _UUIDS_END)):
            search.note(path, head and _uuids_of(head))
        paths = [path for path in paths if not is_remote(path)]
    if len(paths) >= SCAN_THREAD_MIN and _native is not None:
        search.finish()  # paths are taken in in the order they are named
        search.scan = _Scan(paths, _kept_most() - len(search.kept))
    elif paths:
        for path, found in zip(paths, _image_uuids(paths, search.kept)):
            search.note(path, found)


def _siblings(path: str, search: _Search) -> list[str]:
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


def _image_uuids(paths: list[str], kept: dict) -> list[tuple[bytes, bytes] | None]:
    """The image_uuid and parent_uuid of each of ``paths`` (None: unreadable or too short; such
    candidates simply do not match). Files small enough to be read whole when opened as links
    (reader.WHOLE_READ_BELOW) are first handed to the kernel's read-ahead, READ_AHEAD_FILES at
    a time (posix_fadvise WILLNEED): the reads of a deep chain's links are then queued together,
    not one after another (cold, 1000 small links: 310 -> 130 ms). Those stay open, path ->
    (fd, size) in ``kept`` (KEPT_FILES_MAX at most), for links_batch.open_links to read whole."""
    from .reader import WHOLE_READ_BELOW

    budget = [READ_AHEAD_BYTES]
    most = _kept_most()
    found = []
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


def _uuids_of(raw: bytes) -> tuple[bytes, bytes | None] | None:
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
        from .reader import WHOLE_READ_BELOW

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

    def read(self, wait: bool) -> list[tuple]:
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

    def _read_here(self) -> list[tuple]:
        rest, kept = self.paths[self.taken :], {}
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
