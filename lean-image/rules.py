"""Every conformance rule of format v1.1, by id, as spec/format.md states it, and the one
function that implements each.

`leanimg validate` reports findings by these ids; spec/conformance.md lists them with how
each is checked; tests/vectors has an invalid vector for each. A rule is checked by exactly
one function, registered here with ``@implements``: the reader raises that function's first
finding, the validator reports them all (tests/test_rules.py checks that no other code
raises the rule).
"""

from __future__ import annotations

RULES = {
    # header (spec §3)
    "LI-HDR-001": "the file starts with the header magic 89 4C 45 41 4E 49 4D 47",
    "LI-HDR-002": "major_version is 1",
    "LI-HDR-003": "header_length is a multiple of 8, at least 104 and at most 4096",
    "LI-HDR-004": "header_checksum is the xxh3-64 of the header with the checksum field zeroed",
    "LI-HDR-005": "no incompatible feature bit unknown to the reader is set",
    "LI-HDR-006": "page_size is a power of two between 4096 and 65536",
    "LI-HDR-007": "the reserved header field is zero, and so are header bytes past offset 104 "
    "when minor_version is 0 or 1 (later minors append fields a 1.1 reader ignores)",
    "LI-HDR-008": "parent_uuid and parent_digest are both zero or both non-zero, "
    "and the PARENT incompatible bit is set exactly when they are non-zero",
    "LI-HDR-009": "the DISK (DELTA) incompatible bit is set when any DISK (DELTA) page exists; "
    "a writer MAY set it without such pages (the header is written first)",
    "LI-HDR-010": "the INHERITED_DIGESTS incompatible bit is set only with the PARENT bit",
    # records (spec §4)
    "LI-REC-001": "records follow each other from header_length to the footer without gap",
    "LI-REC-002": "a record lies wholly before the footer",
    "LI-REC-003": "record_checksum is the xxh3-64 of the record header, body and padding",
    "LI-REC-004": "padding bytes are zero",
    "LI-REC-005": "record flags are zero",
    "LI-REC-006": "a mandatory record type is one the reader knows",
    "LI-REC-007": "body_length matches the structure of the record type",
    "LI-REC-008": "reserved fields in record bodies are zero",
    "LI-REC-009": "a REGION or DISK record precedes every record that refers to it",
    # regions and disks (spec §5)
    "LI-REG-001": "region ids and region names are unique; names are 1-255 bytes of UTF-8",
    "LI-REG-002": "size_bytes is a non-zero multiple of page_size, at most 2^48",
    "LI-REG-003": "region flags use only defined bits; guest_phys_base is zero without HAS_GPA",
    "LI-DSK-001": "disk ids and names are unique; names are 1-255 bytes of UTF-8",
    "LI-DSK-002": "sector_size is 512, fingerprint_method is 1, size_bytes is non-zero",
    "LI-DSK-003": "a disk reference names a disk of the disk table and lies within it",
    "LI-DSK-004": "a supplied disk has the size and fingerprint the disk table records",
    "LI-DSK-005": "the page-sized run of a disk at a referenced sector has the page's digest",
    # page maps (spec §6)
    "LI-MAP-001": "each region is covered by its extents exactly once: sorted, contiguous, no gap",
    "LI-MAP-002": "page_class is 1-6 and num_pages is non-zero",
    "LI-MAP-003": "first_slot is zero for classes without slots",
    "LI-MAP-004": "every STORED ordinal, DISK reference and DELTA entry is used by exactly one page",
    "LI-MAP-005": "PARENT and DELTA pages appear only in an image with a parent",
    # frames (spec §6)
    "LI-FRM-001": "frames are numbered contiguously from 0 in file order",
    "LI-FRM-002": "a frame body is exactly one zstd frame that decompresses without error",
    "LI-FRM-003": "the zstd frame declares its content size, equal to the declared page count times page_size",
    "LI-FRM-004": "a frame holds 1 page or more and at most 16 MiB decompressed",
    # delta entries (spec §7)
    "LI-DLT-001": "delta entry offsets start at 0, never decrease and end at the decompressed size",
    "LI-DLT-002": "a delta entry uses encoding 1, 2 or 3 and its length matches its word count",
    "LI-DLT-003": "changed word indexes are strictly ascending, below page_size/8, runs non-empty",
    "LI-DLT-004": "a delta entry is smaller than page_size",
    # digests (spec §6)
    "LI-DIG-001": "each region's digests are given exactly once, in page order",
    "LI-DIG-002": "a page's content has the xxh3-128 digest its table gives "
    "(a ZERO page's digest is that of page_size zero bytes)",
    "LI-DIG-003": "num_digests equals the number of digest-bearing pages in the range: STORED, DISK, "
    "DELTA, and PARENT unless INHERITED_DIGESTS is set",
    # index and footer (spec §8)
    "LI-IDX-001": "the INDEX is the last record and lists every other record, in file order, "
    "with matching offset, type, key, first and count",
    "LI-FTR-001": "the file ends with a footer starting with 89 4C 45 41 4E 45 4E 44",
    "LI-FTR-002": "footer_checksum is the xxh3-64 of the footer's first 40 bytes",
    "LI-FTR-003": "file_length equals the file size",
    "LI-FTR-004": "image_digest is the xxh3-128 of every byte before the footer",
    "LI-FTR-005": "index_offset points at the INDEX record",
    # chains (spec §10)
    "LI-CHN-001": "the parent's image_uuid equals the child's parent_uuid",
    "LI-CHN-002": "the parent's image_digest equals the child's parent_digest",
    "LI-CHN-003": "parent and child have the same page_size",
    "LI-CHN-004": "a PARENT or DELTA page lies within a parent region of the same name",
    "LI-CHN-005": "a chain has no cycle and is at most 4096 links deep",
    "LI-CHN-006": "in an image with INHERITED_DIGESTS, a PARENT page's page in the parent, followed down "
    "the chain through inherited PARENT pages, is not FREE",
    # source state (spec §5)
    "LI-SRC-001": "SOURCE_STATE sequence numbers count up from 0 without gaps",
    "LI-SRC-002": "source_format is 1 (QEMU), 2 (Xen) or private use (0x80000000 and above)",
}


# The hint protocol (spec/hints.md): a separate registry, so the image vectors of
# tests/vectors keep covering exactly RULES. ``implements`` registers either kind.
HINT_RULES = {
    "LI-HNT-001": "the hints start with the magic 89 4C 45 41 4E 48 4E 54",
    "LI-HNT-002": "major_version is 1",
    "LI-HNT-003": "header_checksum is the xxh3-64 of the header's first 24 bytes",
    "LI-HNT-004": "page_size is a power of two 4096-65536, address_map 0-2 (2 only with 4096), flags and reserved zero",
    "LI-HNT-005": "a record lies wholly within the input",
    "LI-HNT-006": "payload_length is at most 1 MiB",
    "LI-HNT-007": "record_checksum is the xxh3-64 of the record's header and payload",
    "LI-HNT-008": "a record type without the OPTIONAL bit is known; record flags are zero",
    "LI-HNT-009": "payload_length matches the record's structure",
    "LI-HNT-010": "reserved fields are zero",
    "LI-HNT-011": "the hints end with END, its record_count equals the records before it, nothing follows",
    "LI-HNT-012": "name ids unique and below 256, names unique and 1-255 bytes of UTF-8, declared before use",
    "LI-HNT-013": "ranges non-empty, without overflow, page-aligned (guest-physical, with an address map), "
    "sorted and disjoint within a record",
    "LI-HNT-014": "at most 65536 records and 2^22 ranges in all",
    "LI-HNT-015": "at most one PARENT record, before every UNCHANGED record, which need it",
    "LI-HNT-016": "addressing is 1 or 2; a FREE source is 0-3",
    "LI-HNT-017": "page_size equals the save's; address_map fits the save",
    "LI-HNT-018": "every range lies within guest memory (one piece of the map, or its region)",
    "LI-HNT-019": "stream_offset does not exceed the save stream's length",
    "LI-HNT-020": "each disk a DISK hint names is supplied, and the hinted block lies within it",
    "LI-HNT-021": "the PARENT image_uuid is the writer's parent; UNCHANGED hints need a parent",
    "LI-HNT-022": "a page hinted UNCHANGED that the stream never sends is PARENT only with --trust-dirty-log",
    "LI-HNT-023": "a FREE hint makes a page FREE only if every copy of it ended at or before stream_offset",
    "LI-HNT-024": "a DISK hint makes a DISK reference only if the page equals the disk block byte for byte",
    "LI-HNT-025": "a page hinted UNCHANGED and sent becomes PARENT only if its digest equals the parent's",
    "LI-HNT-026": "FREE hints from a guest's snapshot come only from a precopy save, from a snapshot taken after "
    "their stream_offset and before the checkpoint instant",
}

# Working-set files of `serve --postcopy` (spec/guides/lazy-restore.md, "Working sets"): they
# change only the order pages travel in; a file breaking a rule is refused whole.
WORKING_SET_RULES = {
    "LI-WKS-001": "the file starts with the magic 89 4C 45 41 4E 57 4B 53",
    "LI-WKS-002": "the header is whole, major_version is 1, page_size is the image's, block_count 1-255, "
    "entry_count at most 2^22",
    "LI-WKS-003": "each block name is 1-255 bytes of UTF-8, names a RAM block of the image, and appears once",
    "LI-WKS-004": "the entries are exactly entry_count times 8 bytes, and nothing follows them",
    "LI-WKS-005": "each entry's block is below block_count and its page within that block",
}

# The function that implements each rule, by ``implements``: one registry to each table.
IMPLEMENTATIONS: dict = {}
HINT_IMPLEMENTATIONS: dict = {}
WORKING_SET_IMPLEMENTATIONS: dict = {}
_REGISTRIES = (
    (RULES, IMPLEMENTATIONS),
    (HINT_RULES, HINT_IMPLEMENTATIONS),
    (WORKING_SET_RULES, WORKING_SET_IMPLEMENTATIONS),
)


def describe(rule: str) -> str:
    return next((table[rule] for table, _ in _REGISTRIES if rule in table), "")


def implements(*rules: str):
    """Register the decorated function as the one implementation of ``rules``."""

    def register(function):
        for rule in rules:
            registry = next((found for table, found in _REGISTRIES if rule in table), None)
            if registry is None:
                raise ValueError(f"{function.__qualname__}: unknown rule {rule}")
            if rule in registry:
                raise ValueError(f"{rule} is implemented by {registry[rule].__qualname__} already")
            registry[rule] = function
        return function

    return register
