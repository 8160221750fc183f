"""`leanimg dump`: every structure of an image as JSON (like CRIU's ``crit decode``).

The header, each record in file order (its framing, and its body with every field its
declaration in format.py names: the names of spec/format.md's tables and ksy/leanimg.ksy),
and the footer, from ``structures.dump_record``. Records are read and written one at a time,
so memory follows the largest record, not the image. Byte strings are hex; a payload longer
than PAYLOAD_INLINE bytes (a compressed frame, source state) is given as its length and first
bytes unless ``payloads`` is set.
"""

from __future__ import annotations

import json

from .errors import LeanImageError
from .format import HEADER, RecordType
from .locations import display, open_image
from .structures import ImageFile, dump_record, parse_body, read_footer, read_header, scan_records

DUMP_FORMAT = 1  # version of the JSON layout (lean-image/schemas/dump.schema.json)
PAYLOAD_INLINE = 64
PAYLOAD_HEAD = 16


def plain(value, payloads: bool = False):
    """A dumped value as JSON: bytes as hex (long ones summarised unless ``payloads``)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if payloads or len(data) <= PAYLOAD_INLINE:
            return data.hex()
        return {"length": len(data), "head": data[:PAYLOAD_HEAD].hex()}
    if isinstance(value, dict):
        return {key: plain(item, payloads) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, payloads) for item in value]
    return value


def record_type_label(record_type: int) -> str:
    try:
        return RecordType(record_type).name
    except ValueError:
        return f"UNKNOWN_{record_type:#010x}"


def write_dump(path, out, payloads: bool = False) -> int:
    """Write the dump of the image at ``path`` to the text stream ``out``; the record count.
    Every record is read once before the first byte is written, so an image with a record that
    cannot be read raises its LeanImageError and leaves ``out`` untouched (no truncated JSON)."""
    with open_image(path) as fileobj:
        image = ImageFile(fileobj, display(path))
        try:
            header = read_header(image)
            footer = read_footer(image, header.header_length)
        except LeanImageError as exc:
            exc.path = exc.path or display(path)
            raise
        for _ in _records(image, header, footer, path):
            pass
        head = dict(
            dump_format=DUMP_FORMAT,
            image=display(path),
            header=plain(dict(header.fields(), extension=bytes(header.raw[HEADER.size :])), payloads),
        )
        text = json.dumps(head, indent=2)
        out.write(text[:-2] + ',\n  "records": [')
        count = 0
        for dumped in _records(image, header, footer, path):
            out.write(("," if count else "") + "\n    " + json.dumps(plain(dumped, payloads)))
            count += 1
        out.write('\n  ],\n  "footer": ' + json.dumps(plain(footer.fields(), payloads)) + "\n}\n")
    return count


def _records(image, header, footer, path):
    """Each record's dump in file order; raises the error of the first that cannot be read."""
    for count, item in enumerate(scan_records(image, header.header_length, footer.offset)):
        if isinstance(item, LeanImageError):
            item.path = item.path or display(path)
            raise item
        yield dict(dump_record(item, parse_body(item, count)), type=record_type_label(item.record_type))
