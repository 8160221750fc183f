"""Finding an image's parent chain (spec §10): each parent is looked up by its UUID among
the candidates the caller names and the *.lean files beside the child, opened, and then
verified by digest and page size, link after link (chains may be 4096 deep).
"""

from __future__ import annotations

import os
import uuid

from .errors import ChainError, LeanImageError
from .format import CHAIN_DEPTH_MAX, HEADER
from .rules import implements

SIBLINGS_MAX = 100_000


CHECK_BATCH = 64          # links whose tables check_links checks together


@implements("LI-CHN-001", "LI-CHN-005")
def attach_chain(image, parents: list, open_link, check_links=None, open_links=None) -> None:
    """Set ``parent`` on ``image`` and every link below it; ``open_link(path)`` opens one link.
    ``parents`` are candidate paths or open images (an open image brings its own chain).
    With ``check_links``, ``open_link`` reads a link's header, footer and INDEX only, and
    ``check_links(links)`` checks the rest of CHECK_BATCH links at a time, in chain order:
    before any finding of the walk is raised, the links opened before it are checked, so the
    first link with a finding is reported, as when each link was checked when opened.
    ``open_links(paths)`` (path -> link, for those it opens as ``open_link`` would, nothing
    raised) opens the links the walk expects next CHECK_BATCH at a time; the walk takes a
    link from there only when it finds that very path, and opens any other with ``open_link``."""
    pending: list = []
    index: dict = {}                     # what the walk read of the candidates (_find_candidate)
    ahead = _Ahead(open_links)
    try:
        _walk(image, parents, open_link, pending, check_links, ahead, index)
    except LeanImageError:
        if pending:
            check_links(pending)
        raise
    finally:
        ahead.close_unused()
        _close_kept(index)
    if pending:
        check_links(pending)
    # links are joined by UUID first, so that a cycle is reported as one; then verified by digest
    for link in image.chain():
        if link.parent is not None:
            first = next(parent_problems(link, link.parent), None)
            if first is not None:
                raise first


def _walk(image, parents: list, open_link, pending: list, check_links, ahead: "_Ahead", index: dict) -> None:
    seen = {image.header.image_uuid}
    link = image
    while link.header.has_parent:
        wanted = link.header.parent_uuid
        where = dict(offset=HEADER.offset("parent_uuid"), structure="header.parent_uuid", path=link.path)
        if wanted in seen:
            raise ChainError(f"parent {_uuid(wanted)} is already in the chain (cycle)", rule="LI-CHN-005", **where)
        if len(seen) >= CHAIN_DEPTH_MAX:
            raise ChainError(f"chain deeper than {CHAIN_DEPTH_MAX}", rule="LI-CHN-005", **where)
        candidate = _find_candidate(wanted, parents, index) or \
            _find_candidate(wanted, _siblings(link.path, index), index)
        if candidate is None:
            raise ChainError(f"parent image {_uuid(wanted)} not found among {len(parents)} candidate(s) "
                             "and the files beside the image; pass it with --parent", rule="LI-CHN-001", **where)
        if not isinstance(candidate, str):
            link.parent = candidate                  # an open image brings its own chain
            break
        link.parent = ahead.take(candidate, index) or open_link(candidate)
        seen.add(link.parent.header.image_uuid)
        link = link.parent
        if check_links is not None:
            pending.append(link)
            if len(pending) >= CHECK_BATCH:
                batch = pending[:]
                pending.clear()
                check_links(batch)


@implements("LI-CHN-002", "LI-CHN-003")
def parent_problems(child, parent):
    """The parent is the image the child was made against: its digest and page size."""
    if parent.footer.image_digest != child.header.parent_digest:
        yield ChainError(f"parent {parent.path} has image_digest {parent.footer.image_digest.hex()}, "
                         f"expected {child.header.parent_digest.hex()} (parent modified or replaced)",
                         offset=HEADER.offset("parent_digest"), structure="header.parent_digest",
                         rule="LI-CHN-002", path=child.path)
    if parent.page_size != child.page_size:
        yield ChainError(f"parent page_size {parent.page_size}, expected {child.page_size}",
                         offset=HEADER.offset("page_size"), structure="header.page_size", rule="LI-CHN-003",
                         path=child.path)


class _Ahead:
    """Links opened before the walk reaches them (``open_links``), by path; each path is
    tried once. The run tried from a path follows the parent UUIDs read from the files beside
    the image (_image_uuids): a guess, which the walk's own lookup confirms link by link."""

    def __init__(self, open_links):
        self.open_links, self.opened, self.tried = open_links, {}, set()

    def take(self, path: str, index: dict):
        """The link opened ahead for ``path`` (None: open it with open_link)."""
        if self.open_links is not None and path not in self.tried:
            run = [p for p in _expected_links(path, index, CHECK_BATCH) if p not in self.tried]
            self.tried.update(run)
            self.opened.update(self.open_links(run, index.get(("kept",), {})))
        return self.opened.pop(path, None)

    def close_unused(self) -> None:
        for link in self.opened.values():
            link.close()
        self.opened.clear()


def _expected_links(first: str, index: dict, most: int) -> list[str]:
    """``first`` and up to ``most - 1`` paths the chain is expected to go on with: each file's
    parent_uuid, as _image_uuids read it, looked up among the files read."""
    by_uuid, parent_of = index.get(("by-uuid",), {}), index.get(("parent-of",), {})
    run, seen = [first], {first}
    while len(run) < most:
        parent = parent_of.get(run[-1])
        path = by_uuid.get(parent) if parent is not None else None
        if path is None or path in seen:
            break
        run.append(path)
        seen.add(path)
    return run


def _uuid(raw: bytes) -> str:
    return str(uuid.UUID(bytes=bytes(raw)))


def _find_candidate(wanted: bytes, candidates, index: dict):
    """The candidate (open image or path) whose image_uuid is ``wanted``; ``index`` caches reads."""
    by_uuid = index.setdefault(("by-uuid",), {})        # UUID -> first path read with it: O(1) per link
    parent_of = index.setdefault(("parent-of",), {})    # path -> its header's parent_uuid
    for candidate in candidates:
        if not isinstance(candidate, (str, os.PathLike)) and candidate.header.image_uuid == wanted:
            return candidate
    paths = [os.path.abspath(os.fspath(c)) for c in candidates if isinstance(c, (str, os.PathLike))]
    paths = list(dict.fromkeys(paths))
    unread = [key for key in paths if key not in index]
    for key, found in zip(unread, _image_uuids(unread, index.setdefault(("kept",), {}))):
        index[key] = found and found[0]
        if found is not None:
            by_uuid.setdefault(found[0], key)
            parent_of[key] = found[1]
    return by_uuid.get(wanted)


def _siblings(path: str, index: dict) -> list[str]:
    """The *.lean files beside ``path`` (where the links of a chain usually live), listed once."""
    directory = os.path.dirname(os.path.abspath(path))
    marker = ("scanned", directory)
    if marker in index:
        return []
    index[marker] = True
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".lean"))[:SIBLINGS_MAX]
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names]


READ_AHEAD_FILES = 256              # files open at once while their UUIDs are read
READ_AHEAD_BYTES = 256 << 20        # small files handed to the kernel's read-ahead, at most
KEPT_FILES_MAX = 4096               # small files kept open for open_links (and a quarter of the open-file limit)


def _image_uuids(paths: list[str], kept: dict) -> list[tuple[bytes, bytes] | None]:
    """The image_uuid and parent_uuid of each of ``paths`` (None: unreadable or too short; such
    candidates simply do not match). Files small enough to be read whole when opened as links
    (reader.WHOLE_READ_BELOW) are first handed to the kernel's read-ahead, READ_AHEAD_FILES at
    a time (posix_fadvise WILLNEED): the reads of a deep chain's links are then queued together,
    not one after another (cold, 1000 small links: 310 -> 130 ms). Those stay open, path ->
    (fd, size) in ``kept`` (KEPT_FILES_MAX at most), for links_batch.open_links to read whole."""
    from .reader import WHOLE_READ_BELOW
    at, end = HEADER.offset("image_uuid"), HEADER.offset("parent_uuid") + 16
    budget = [READ_AHEAD_BYTES]
    most = _kept_most()
    found = []
    for lo in range(0, len(paths), READ_AHEAD_FILES):
        batch = paths[lo:lo + READ_AHEAD_FILES]
        for path, (fd, small) in zip(batch, [_open_ahead(path, WHOLE_READ_BELOW, budget) for path in batch]):
            if fd is None:
                found.append(None)
                continue
            try:
                raw = os.pread(fd, end, 0)
                found.append(None if len(raw) < at + 16 else   # a short file's parent_uuid: None
                             (raw[at:at + 16], raw[end - 16:] if len(raw) == end else None))
            except OSError:
                found.append(None)
                small = 0
            if small and len(kept) < most:
                kept[path] = (fd, small)
            else:
                os.close(fd)
    return found


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
            except (OSError, AttributeError):        # no fadvise here: the reads simply come later
                pass
            return fd, size
    except OSError:
        pass
    return fd, 0


def _close_kept(index: dict) -> None:
    """Close the files _image_uuids kept open that no link took."""
    for fd, _ in index.pop(("kept",), {}).values():
        os.close(fd)
