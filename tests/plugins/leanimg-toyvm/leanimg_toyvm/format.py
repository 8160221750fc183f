"""The toyvm save format, an invented tiny hypervisor's (all integers little-endian).

    offset  size  field
    0       8     magic "TOYVMSAV"
    8       4     version, 1
    12      4     page_size: a power of two, 4096..65536
    16      8     ram_size: a non-zero multiple of page_size, at most RAM_SIZE_MAX
    24      4     device_length: at most DEVICE_LENGTH_MAX
    28      4     reserved, 0
    32      device_length   the devices' state, opaque
    then page records, each a u8 word: bits 0-7 the kind, bits 8-63 the page number:
      kind 1 PAGE: page_size bytes of the page follow
      kind 2 ZERO: the page is all zero bytes
      kind 255 END: the last record (page number 0)

A page may be sent more than once: the last record for it wins. A page never sent was
freed by the guest (toyvm's balloon): its content is undefined. A canonical save sends
every page at most once, in page order, all-zero pages as ZERO records.
"""

from __future__ import annotations

import struct

MAGIC = b"TOYVMSAV"
VERSION = 1
HEADER = struct.Struct("<8sIIQII")
RECORD = struct.Struct("<Q")
PAGE, ZERO, END = 1, 2, 255
RAM_SIZE_MAX = 1 << 30  # a limit of this toy: its converter holds RAM in memory
DEVICE_LENGTH_MAX = 1 << 20


def header(page_size: int, ram_size: int, devices: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, page_size, ram_size, len(devices), 0) + devices


def record(kind: int, page: int = 0) -> bytes:
    return RECORD.pack(page << 8 | kind)
