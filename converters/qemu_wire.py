"""The wire encoding of QEMU's migration stream (migration/savevm.c, migration/ram.c; the same
from QEMU 7.2 to 11.0): the constants and the small pieces every writer of a stream puts
together. ``converters/qemu.py`` reads and rebuilds saved streams with them, and
``restore/postcopy.py`` writes the stream of a post-copy migration (``leanimg serve``).

Stream layout::

    be32 'QEVM'  be32 3
    0x07 CONFIGURATION   be32 len, machine type, [0x05 SUBSECTION]...
    0x01 START  be32 id, u8 len, idstr, be32 instance, be32 version   'ram': MEM_SIZE, EOS
    0x02 PART   be32 id                                               'ram': pages..., EOS
    0x03 END    be32 id                                               'ram': pages..., EOS
    0x04 FULL   be32 id, u8 len, idstr, be32 instance, be32 version   device state (opaque)
    0x7e FOOTER be32 id            after every section (when the machine type has footers)
    0x08 COMMAND be16 cmd, be16 len, data   SWITCHOVER_START (QEMU >= 10.0 machine types) before END
    0x00 EOF
    0x06 VMDESCRIPTION be32 len, JSON

A RAM entry is ``be64 offset|flags`` (flags ``F_*`` in the low page bits); without
``F_CONTINUE`` it is followed by the block's name (``name_bytes``); ``F_PAGE`` carries page_size
bytes, ``F_ZERO`` one fill byte, ``F_EOS`` ends a RAM section. The START section of 'ram' holds
``be64 total|F_MEM_SIZE`` and one ``ram_block_bytes`` per RAM block.

Everything here is big-endian, as QEMU's ``qemu_put_be*`` writes it.
"""

from __future__ import annotations

import dataclasses
import struct

QEVM_MAGIC = 0x5145564D
QEVM_VERSION = 3
QEVM_VERSION_COMPAT = 2

# section types (QEMU_VM_*)
EOF, START, PART, END, FULL, SUBSECTION, VMDESCRIPTION, CONFIGURATION, COMMAND = range(9)
FOOTER = 0x7E
SECTION_NAMES = {
    EOF: "EOF",
    START: "START",
    PART: "PART",
    END: "END",
    FULL: "FULL",
    SUBSECTION: "SUBSECTION",
    VMDESCRIPTION: "VMDESCRIPTION",
    CONFIGURATION: "CONFIGURATION",
    COMMAND: "COMMAND",
    FOOTER: "FOOTER",
}

# RAM_SAVE_FLAG_* (migration/ram.c)
F_FULL, F_ZERO, F_MEM_SIZE, F_PAGE, F_EOS = 0x01, 0x02, 0x04, 0x08, 0x10
F_CONTINUE, F_XBZRLE, F_HOOK, F_COMPRESS, F_MULTIFD_FLUSH = 0x20, 0x40, 0x80, 0x100, 0x200

# QEMU_VM_COMMAND sub-commands (savevm.c enum qemu_vm_cmd: the same numbers from 7.2 to 11.0).
# A saved precopy stream carries SWITCHOVER_START alone (QEMU >= 10.0 machine types, property
# send-switchover-start: sent before the final RAM section); the others need a live peer
# (restore/postcopy.py sends the post-copy ones).
CMD_OPEN_RETURN_PATH, CMD_PING, CMD_POSTCOPY_ADVISE, CMD_POSTCOPY_LISTEN, CMD_POSTCOPY_RUN = 1, 2, 3, 4, 5
CMD_POSTCOPY_RAM_DISCARD, CMD_PACKAGED = 6, 7
CMD_SWITCHOVER_START = 11
MIG_COMMANDS = {
    CMD_OPEN_RETURN_PATH: "OPEN_RETURN_PATH",
    CMD_PING: "PING",
    CMD_POSTCOPY_ADVISE: "POSTCOPY_ADVISE",
    CMD_POSTCOPY_LISTEN: "POSTCOPY_LISTEN",
    CMD_POSTCOPY_RUN: "POSTCOPY_RUN",
    CMD_POSTCOPY_RAM_DISCARD: "POSTCOPY_RAM_DISCARD",
    CMD_PACKAGED: "PACKAGED",
    8: "ENABLE_COLO",
    9: "POSTCOPY_RESUME",
    10: "RECV_BITMAP",
    CMD_SWITCHOVER_START: "SWITCHOVER_START",
}

BE16 = struct.Struct(">H")
BE32 = struct.Struct(">I")
BE64 = struct.Struct(">Q")


@dataclasses.dataclass(frozen=True)
class SectionHeader:
    """What a START or FULL section header names: its id in the stream and the device's
    idstr, instance and version (savevm.c save_section_header)."""

    section_id: int
    idstr: str
    instance_id: int
    version_id: int


def name_bytes(name: str) -> bytes:
    """A name as the stream carries it (qemu_put_counted_string): u8 length, then the bytes."""
    raw = name.encode()
    return bytes([len(raw)]) + raw


def section_header_bytes(kind: int, header: SectionHeader) -> bytes:
    """The header of a START or FULL section: type, be32 id, idstr, be32 instance, be32 version."""
    return (
        bytes([kind])
        + BE32.pack(header.section_id)
        + name_bytes(header.idstr)
        + struct.pack(">II", header.instance_id, header.version_id)
    )


def part_header_bytes(kind: int, section_id: int) -> bytes:
    """The header of a PART or END section: type, be32 id (the section's START named it)."""
    return bytes([kind]) + BE32.pack(section_id)


def footer_bytes(section_id: int) -> bytes:
    """The footer after a section (machine types with section footers): 0x7e, be32 id."""
    return bytes([FOOTER]) + BE32.pack(section_id)


def ram_section_end(section_id: int, footers: bool) -> bytes:
    """The end of a RAM section's data: an EOS entry, then the footer where the stream has them."""
    return BE64.pack(F_EOS) + (footer_bytes(section_id) if footers else b"")


def ram_block_bytes(name: str, length: int, addr: int | None = None) -> bytes:
    """One RAM block of the MEM_SIZE list: its name, be64 length and, with the capability
    x-ignore-shared (``addr`` given), be64 address."""
    entry = name_bytes(name) + BE64.pack(length)
    return entry if addr is None else entry + BE64.pack(addr)


def command_bytes(cmd: int, data: bytes = b"") -> bytes:
    """A QEMU_VM_COMMAND: type, be16 command (``CMD_*``), be16 data length, the data."""
    return bytes([COMMAND]) + BE16.pack(cmd) + BE16.pack(len(data)) + data
