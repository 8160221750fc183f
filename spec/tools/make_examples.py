#!/usr/bin/env python3
"""Print the worked examples of spec/format.md, Appendix A, as hex dumps.

Self-contained on purpose: it uses only struct, xxhash and zstandard and
restates every constant it needs, so a third-party writer can check its bytes
against these dumps without the leanimg package.

    python3 spec/tools/make_examples.py              # print Appendix A
    python3 spec/tools/make_examples.py -o ex.lean   # also write the example image (A.5)

The zstd frames of the examples are built by hand from RLE and Raw blocks
(RFC 8878 section 3.1.1.2), so the bytes do not depend on the zstd library
version; zstandard is used only to check that they decompress.
"""

from __future__ import annotations

import argparse
import struct
import sys
import uuid

import xxhash
import zstandard

# --- constants, as spec/format.md gives them ----------------------------------
HEADER_MAGIC = b"\x89LEANIMG"
FOOTER_MAGIC = b"\x89LEANEND"
HEADER = struct.Struct("<8sHHIQQQ16s16s16sIIQ")  # 104 bytes
RECORD_HEADER = struct.Struct("<IIQ")  # type, flags, body_length
RECORD_TRAILER = struct.Struct("<Q")  # record_checksum
REGION = struct.Struct("<IIQQII")
DISK = struct.Struct("<IIQII16sII")
PAGE_FRAME = struct.Struct("<QII")
DELTA_FRAME = struct.Struct("<QII")
PAGE_MAP = struct.Struct("<II")
EXTENT = struct.Struct("<QIHHQ")
DIGESTS = struct.Struct("<IIQQ")  # region_id, num_digests, first_page, num_pages
INDEX = struct.Struct("<II")
INDEX_ENTRY = struct.Struct("<QIIQQ")
FOOTER = struct.Struct("<8sQQ16sQ")  # 48 bytes
DELTA_ENTRY = struct.Struct("<BBH")

T_REGION, T_DISK, T_PAGE_FRAME, T_DELTA_FRAME = 0x1, 0x2, 0x10, 0x11
T_PAGE_MAP, T_DIGESTS, T_INDEX = 0x20, 0x21, 0xFF
NO_KEY = 0xFFFF_FFFF
STORED, ZERO = 1, 2
HAS_GPA = 1
PAGE_SIZE = 4096
MiB = 1 << 20


def hexdump(data: bytes, base: int = 0, elide: tuple[int, int] | None = None) -> str:
    """xxd-style dump; offsets are relative to `base`. `elide` = (start, end) to skip."""
    lines = []
    for off in range(0, len(data), 16):
        if elide and elide[0] <= off < elide[1]:
            if off == elide[0]:
                lines.append(f"  ...       ({elide[1] - elide[0]} bytes elided)")
            continue
        chunk = data[off : off + 16]
        hx = " ".join(chunk[i : i + 2].hex() for i in range(0, len(chunk), 2))
        asc = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{base + off:08x}: {hx:<39}  {asc}")
    return "\n".join(lines)


def align8(n: int) -> int:
    return (n + 7) & ~7


def record(rtype: int, body: bytes, flags: int = 0) -> bytes:
    head = RECORD_HEADER.pack(rtype, flags, len(body))
    padded = head + body + bytes(align8(len(body)) - len(body))
    return padded + RECORD_TRAILER.pack(xxhash.xxh3_64_intdigest(padded))


def header(
    image_uuid: bytes,
    page_size: int = PAGE_SIZE,
    incompat: int = 0,
    compat: int = 0,
    parent_uuid: bytes = bytes(16),
    parent_digest: bytes = bytes(16),
) -> bytes:
    fields = [
        HEADER_MAGIC,
        1,
        0,
        HEADER.size,
        incompat,
        compat,
        0,
        image_uuid,
        parent_uuid,
        parent_digest,
        page_size,
        0,
        0,
    ]
    unchecked = HEADER.pack(*fields)
    fields[-1] = xxhash.xxh3_64_intdigest(unchecked)
    return HEADER.pack(*fields)


def zstd_frame(content: bytes, *, rle: bool) -> bytes:
    """One single-segment zstd frame of one block (RLE or Raw), content size declared."""
    n = len(content)
    assert 256 <= n <= 65791 or n < 256
    if n < 256:
        fhd, fcs = 0x20, struct.pack("<B", n)  # Single_Segment, FCS 1 byte
    else:
        fhd, fcs = 0x60, struct.pack("<H", n - 256)  # Single_Segment, FCS 2 bytes
    if rle:
        assert content == content[:1] * n
        block = struct.pack("<I", 1 | (1 << 1) | (n << 3))[:3] + content[:1]
    else:
        block = struct.pack("<I", 1 | (0 << 1) | (n << 3))[:3] + content
    frame = b"\x28\xb5\x2f\xfd" + bytes([fhd]) + fcs + block
    assert zstandard.ZstdDecompressor().decompress(frame) == content
    assert zstandard.get_frame_parameters(frame).content_size == n
    return frame


def section(title: str) -> None:
    print()
    print(f"### {title}")
    print()


def kv(name: str, value) -> None:
    print(f"    {name:<22} {value}")


def code(text: str) -> None:
    print("```")
    print(text)
    print("```")


# --- A.1 header -----------------------------------------------------------------
def example_header(image_uuid: bytes) -> bytes:
    hdr = header(image_uuid)
    section("A.1 Header of a parentless image")
    print("page_size 4096, image_uuid 00112233-4455-6677-8899-aabbccddeeff, no feature bits,")
    print("header_length 104, no parent.")
    print()
    code(hexdump(hdr))
    chk = struct.unpack_from("<Q", hdr, 96)[0]
    print()
    print(f"header_checksum = xxh3-64(bytes 0..103 with bytes 96..103 zeroed) = 0x{chk:016x}")
    return hdr


# --- A.2 REGION -----------------------------------------------------------------
def example_region() -> bytes:
    name = b"pc.ram"
    body = REGION.pack(0, HAS_GPA, 0, 1 * MiB, len(name), 0) + name
    rec = record(T_REGION, body)
    section("A.2 REGION record")
    print("region_id 0, flags HAS_GPA, guest_phys_base 0, size_bytes 1 MiB (256 pages),")
    print(f'name "pc.ram"; body_length {len(body)}, 2 bytes of padding, record size {len(rec)}.')
    print()
    code(hexdump(rec))
    print()
    print(
        f"record_checksum = xxh3-64(bytes 0..{len(rec) - 9}) = 0x{struct.unpack_from('<Q', rec, len(rec) - 8)[0]:016x}"
    )
    return rec


# --- A.3 PAGE_MAP ---------------------------------------------------------------
def example_page_map() -> bytes:
    body = PAGE_MAP.pack(0, 2)
    body += EXTENT.pack(0, 2, STORED, 0, 0)  # pages 0..1 STORED, ordinals 0..1
    body += EXTENT.pack(2, 254, ZERO, 0, 0)  # pages 2..255 ZERO
    rec = record(T_PAGE_MAP, body)
    section("A.3 PAGE_MAP record with two extents")
    print("region_id 0; extent 0: pages 0-1 STORED, first_slot 0 (stored ordinals 0 and 1);")
    print(f"extent 1: pages 2-255 ZERO, first_slot 0. body_length {len(body)} (8 + 2 x 24), record size {len(rec)}.")
    print()
    print("Body:")
    print()
    code(hexdump(body))
    print()
    print("Whole record:")
    print()
    code(hexdump(rec))
    print()
    print(f"record_checksum = 0x{struct.unpack_from('<Q', rec, len(rec) - 8)[0]:016x}")
    return rec


# --- A.4 delta entries ----------------------------------------------------------
CHANGED = {3: 0x00000000DEADBEEF, 4: 0x0000000000000001, 5: 0xFFFFFFFFFFFFFFFF, 100: 0x0123456789ABCDEF}


def delta_entries() -> tuple[bytes, bytes, list[bytes]]:
    parent = bytes(j & 0xFF for j in range(PAGE_SIZE))
    child = bytearray(parent)
    for w, v in CHANGED.items():
        struct.pack_into("<Q", child, 8 * w, v)
    words = sorted(CHANGED)
    values = b"".join(struct.pack("<Q", CHANGED[w]) for w in words)
    n = len(words)
    index_list = DELTA_ENTRY.pack(1, 0, n) + b"".join(struct.pack("<H", w) for w in words) + values
    bitmap = bytearray(PAGE_SIZE // 64)
    for w in words:
        bitmap[w // 8] |= 1 << (w % 8)
    bitmap_e = DELTA_ENTRY.pack(2, 0, n) + bytes(bitmap) + values
    runs = [(3, 3), (100, 1)]
    runs_e = (
        DELTA_ENTRY.pack(3, 0, n)
        + struct.pack("<H", len(runs))
        + b"".join(struct.pack("<HH", s, ln) for s, ln in runs)
        + values
    )
    assert len(index_list) == 4 + 10 * n
    assert len(bitmap_e) == 4 + PAGE_SIZE // 64 + 8 * n
    assert len(runs_e) == 4 + 2 + 4 * len(runs) + 8 * n
    return parent, bytes(child), [index_list, bitmap_e, runs_e]


def example_deltas() -> list[bytes]:
    parent, child, (il, bm, rn) = delta_entries()
    section("A.4 Delta entries in the three encodings")
    print("page_size 4096. Parent page: byte j = j mod 256. The child changes words 3, 4, 5")
    print("and 100 (bytes 24..47 and 800..807) to these new values (u8, little-endian):")
    print()
    for w, v in CHANGED.items():
        kv(f"word {w}", f"0x{v:016x}")
    print()
    kv("parent digest", xxhash.xxh3_128_digest(parent).hex())
    kv("child digest", xxhash.xxh3_128_digest(child).hex())
    print()
    print(f"INDEX_LIST (encoding 1), {len(il)} bytes = 4 + 4 x 2 + 4 x 8:")
    print()
    code(hexdump(il))
    print()
    print(f"BITMAP (encoding 2), {len(bm)} bytes = 4 + 4096/64 + 4 x 8; bitmap byte 0 = 0x38")
    print("(bits 3, 4, 5), byte 12 = 0x10 (bit 100 = byte 12, bit 4):")
    print()
    code(hexdump(bm))
    print()
    print(f"RUNS (encoding 3), {len(rn)} bytes = 4 + 2 + 2 x 4 + 4 x 8; runs (3, 3) and (100, 1):")
    print()
    code(hexdump(rn))
    return [il, bm, rn]


# --- A.5 a complete image and its footer -----------------------------------------
def example_image(hdr: bytes, region_rec: bytes, map_rec: bytes) -> bytes:
    page_a = b"\xab" * PAGE_SIZE
    content = page_a * 2
    frame = zstd_frame(content, rle=True)
    frame_rec = record(T_PAGE_FRAME, PAGE_FRAME.pack(0, 2, 0) + frame)
    d_a = xxhash.xxh3_128_digest(page_a)
    d_0 = xxhash.xxh3_128_digest(bytes(PAGE_SIZE))
    # digests of the STORED pages 0 and 1 only; the 254 ZERO pages have an implied digest (d_0)
    dig_body = DIGESTS.pack(0, 2, 0, 256) + d_a * 2
    dig_rec = record(T_DIGESTS, dig_body)

    records = [
        (T_REGION, region_rec, 0, 0, 256),
        (T_PAGE_FRAME, frame_rec, NO_KEY, 0, 2),
        (T_PAGE_MAP, map_rec, 0, 0, 256),
        (T_DIGESTS, dig_rec, 0, 0, 256),
    ]
    offset = len(hdr)
    entries = b""
    offsets = []
    for rtype, rec, key, first, count in records:
        entries += INDEX_ENTRY.pack(offset, rtype, key, first, count)
        offsets.append(offset)
        offset += len(rec)
    index_offset = offset
    index_rec = record(T_INDEX, INDEX.pack(len(records), 0) + entries)
    before = hdr + b"".join(r[1] for r in records) + index_rec
    file_length = len(before) + FOOTER.size
    digest = xxhash.xxh3_128_digest(before)
    unchecked = FOOTER.pack(FOOTER_MAGIC, index_offset, file_length, digest, 0)
    footer = FOOTER.pack(FOOTER_MAGIC, index_offset, file_length, digest, xxhash.xxh3_64_intdigest(unchecked[:40]))
    image = before + footer

    section("A.5 A complete image and its footer")
    print("The header of A.1, the REGION of A.2, one PAGE_FRAME holding stored ordinals 0 and 1")
    print("(two pages of 0xAB bytes), the PAGE_MAP of A.3, one DIGESTS record covering the 256 pages,")
    print(f"the INDEX and the footer: {file_length} bytes in all. The file in order:")
    print()
    kv("offset 0x0000", f"header, {len(hdr)} bytes (A.1)")
    names = ["REGION (A.2)", "PAGE_FRAME", "PAGE_MAP (A.3)", "DIGESTS"]
    for off, name, (_, rec, *_r) in zip(offsets, names, records):
        kv(f"offset 0x{off:04x}", f"{name}, {len(rec)} bytes")
    kv(f"offset 0x{index_offset:04x}", f"INDEX, {len(index_rec)} bytes")
    kv(f"offset 0x{len(before):04x}", f"footer, {FOOTER.size} bytes")
    print()
    print(f"PAGE_FRAME record at 0x{offsets[1]:04x}; its body is first_ordinal 0, num_pages 2,")
    print("then an 11-byte zstd frame: magic 28 b5 2f fd, Frame_Header_Descriptor 0x60")
    print("(Single_Segment, 2-byte Frame_Content_Size), FCS 0x1f00 + 256 = 8192, one last RLE")
    print("block of 8192 bytes (block header 03 00 01), byte 0xab:")
    print()
    code(hexdump(frame_rec, offsets[1]))
    print()
    print(f"DIGESTS record at 0x{offsets[3]:04x}: region 0, num_digests 2, first_page 0, num_pages 256,")
    print(f"body_length {len(dig_body)} = 24 + 2 x 16. The STORED pages 0 and 1 are the only")
    print("digest-bearing pages of the range, so the record holds their two digests,")
    print("xxh3-128(4096 x 0xab) twice. Pages 2-255 are ZERO: they have no stored digest;")
    print("their digest is implied, xxh3-128(4096 x 0x00).")
    print()
    kv("xxh3-128(4096 x 0xab)", d_a.hex())
    kv("xxh3-128(4096 x 0x00)", d_0.hex() + " (implied, not stored)")
    print()
    code(hexdump(dig_rec, offsets[3]))
    print()
    print(f"INDEX record at 0x{index_offset:04x} (4 entries):")
    print()
    code(hexdump(index_rec, index_offset))
    print()
    print(f"Footer at 0x{len(before):04x}:")
    print()
    code(hexdump(footer, len(before)))
    print()
    kv("index_offset", f"0x{index_offset:x}")
    kv("file_length", f"{file_length} (0x{file_length:x})")
    kv("image_digest", f"{digest.hex()} = xxh3-128(bytes 0..0x{len(before) - 1:x})")
    kv("footer_checksum", f"0x{struct.unpack_from('<Q', footer, 40)[0]:016x} = xxh3-64(footer bytes 0..39)")
    kv("xxh3-64 of the file", f"0x{xxhash.xxh3_64_intdigest(image):016x}")
    return image


# --- A.6 a DELTA_FRAME record ----------------------------------------------------
def example_delta_frame(entries: list[bytes]) -> bytes:
    # a fourth entry: INDEX_LIST changing only the last word (511) of another page
    last = DELTA_ENTRY.pack(1, 0, 1) + struct.pack("<H", 511) + struct.pack("<Q", 1 << 63)
    entries = entries + [last]
    content = b"".join(entries)
    offs = [0]
    for e in entries:
        offs.append(offs[-1] + len(e))
    head = DELTA_FRAME.pack(0, len(entries), 0) + b"".join(struct.pack("<I", o) for o in offs)
    head += bytes(align8(len(head)) - len(head))
    frame = zstd_frame(content, rle=False)
    rec = record(T_DELTA_FRAME, head + frame)
    section("A.6 DELTA_FRAME record")
    print("One DELTA_FRAME with first_delta 0 and four entries: delta entries 0, 1 and 2 are the")
    print("three entries of A.4 (in an image, three different pages would use them), entry 3 is an")
    print("INDEX_LIST entry setting word 511 to 0x8000000000000000. entry_offsets")
    print(
        f"{offs} take {4 * len(offs)} bytes; {len(head) - 16 - 4 * len(offs)} bytes of zero padding "
        f"bring the zstd frame to body offset {len(head)}."
    )
    print("The frame is one last Raw block (Frame_Header_Descriptor 0x20: Single_Segment, 1-byte")
    print(f"Frame_Content_Size = {len(content)} = entry_offsets[4]).")
    print()
    code(hexdump(rec))
    return rec


# --- A.7 disk fingerprint -------------------------------------------------------
def fingerprint_method1(disk: bytes) -> bytes:
    size = len(disk)
    h = xxhash.xxh3_128()
    h.update(struct.pack("<Q", size))
    for k in range(64):
        o = (size * k // 64) // 512 * 512
        h.update(disk[o : min(o + 4096, size)])
    return h.digest()


def example_disk() -> bytes:
    size = 3 * MiB + 512
    disk = bytes(((j // 512) * 7 + j) & 0xFF for j in range(size))
    fp = fingerprint_method1(disk)
    name = b"vda"
    body = DISK.pack(0, 0, size, 512, 1, fp, len(name), 0) + name
    rec = record(T_DISK, body)
    section("A.7 Disk fingerprint (method 1) and DISK record")
    print(f"A disk of {size} bytes (3 MiB + 512) whose byte j is ((j div 512) x 7 + j) mod 256.")
    print("Sample offsets o_k = floor(floor(size x k / 64) / 512) x 512, first ones:")
    offs = [(size * k // 64) // 512 * 512 for k in range(64)]
    print()
    kv("o_0 .. o_3", ", ".join(str(o) for o in offs[:4]))
    kv("o_63", f"{offs[63]} (sample {min(offs[63] + 4096, size) - offs[63]} bytes)")
    kv("fingerprint", fp.hex())
    print()
    print('DISK record: disk_id 0, size_bytes 3146240, sector_size 512, fingerprint_method 1, name "vda":')
    print()
    code(hexdump(rec))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", help="also write the complete example image (A.5) here")
    args = ap.parse_args(argv)
    image_uuid = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff").bytes
    print("<!-- generated by spec/tools/make_examples.py; do not edit by hand -->")
    hdr = example_header(image_uuid)
    region_rec = example_region()
    map_rec = example_page_map()
    entries = example_deltas()
    image = example_image(hdr, region_rec, map_rec)
    example_delta_frame(entries)
    example_disk()
    if args.output:
        with open(args.output, "wb") as f:
            f.write(image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
