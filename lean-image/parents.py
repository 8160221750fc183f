"""Finding an image's parent chain (spec §10): each parent is looked up by its UUID among
the candidates the caller names and the *.lean files beside the child, opened, and then
verified by digest and page size, link after link (chains may be 4096 deep). The files
looked in, and what is read of them ahead, are parent_files.py's.
"""

from __future__ import annotations

import uuid

from .errors import ChainError, LeanImageError
from .format import CHAIN_DEPTH_MAX, HEADER
from .parent_files import Search, find_candidate, find_sibling
from .rules import implements
from .structures import WHOLE_READ_BELOW


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
    search = Search()
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


def _walk(image, parents: list, open_link, pending: list, check_links, ahead: "_Ahead", search: "Search") -> None:
    seen = {image.header.image_uuid}
    link = image
    batches, whole_bytes = 0, 0  # checked so far; bytes of the pending links' files read whole
    while link.header.has_parent:
        wanted = link.header.parent_uuid
        where = dict(offset=HEADER.offset("parent_uuid"), structure="header.parent_uuid", path=link.path)
        if wanted in seen:
            raise ChainError(f"parent {_uuid(wanted)} is already in the chain (cycle)", rule="LI-CHN-005", **where)
        if len(seen) >= CHAIN_DEPTH_MAX:
            raise ChainError(f"chain deeper than {CHAIN_DEPTH_MAX}", rule="LI-CHN-005", **where)
        candidate = find_candidate(wanted, parents, search) or find_sibling(wanted, link.path, search)
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
            whole_bytes += link.tables.file.size if link.tables.file.holds_whole else 0
            if len(pending) >= (CHECK_BATCH_LATER if batches else CHECK_BATCH) or whole_bytes >= CHECK_BATCH_BYTES:
                batch = pending[:]
                pending.clear()
                batches, whole_bytes = batches + 1, 0
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
    the image (parent_files.Search): a guess, which the walk's own lookup confirms link by link."""

    def __init__(self, open_links):
        self.open_links, self.opened, self.tried, self.runs = open_links, {}, set(), 0

    def take(self, path: str, search: "Search"):
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


def _expected_links(first: str, search: "Search", most: int) -> list[str]:
    """``first`` and up to ``most - 1`` paths the chain is expected to go on with, up to the
    one whose size makes CHECK_BATCH_BYTES (a file not kept open counted as the largest read
    whole), as the walk's batches end: each file's parent_uuid, as the search read it,
    looked up among the files read."""
    run, seen = [first], {first}
    run_bytes = search.kept.get(first, (None, WHOLE_READ_BELOW))[1]
    while len(run) < most and run_bytes < CHECK_BATCH_BYTES:
        parent = search.parent_of.get(run[-1])
        path = search.path_of(parent) if parent is not None else None
        if path is None or path in seen:
            break
        run_bytes += search.kept.get(path, (None, WHOLE_READ_BELOW))[1]
        run.append(path)
        seen.add(path)
    return run


def _uuid(raw: bytes) -> str:
    return str(uuid.UUID(bytes=bytes(raw)))
