"""libvirt's QEMU save image: `virsh save`, `virsh managedsave` and external memory snapshots.

Written from libvirt's src/qemu/qemu_saveimage.c/.h (v9.0.0, and the newest release, which
adds compression codes 5 zstd and 6 sparse and keeps version 2). The file is::

    offset 0     92-byte header, little-endian (the host's byte order: libvirt on a
                 big-endian host writes it big-endian)
                   0  b[16] magic       "LibvirtQemudSave"; "LibvirtQemudPart" while the
                                        save runs (libvirt rewrites it when QEMU is done)
                  16  u4    version     2 (1: before compression existed)
                  20  u4    data_len    bytes of XML, cookie and padding after the header
                  24  u4    was_running 1: libvirt resumes the guest after restoring it
                  28  u4    format      payload compression: 0 raw, 1 gzip, 2 bzip2, 3 xz,
                                        4 lzop, 5 zstd, 6 sparse (QEMU mapped-ram)
                  32  u4    cookie_offset  where the cookie starts in the data; 0: no cookie
                  36  u4[14] unused
    offset 92    the domain XML, NUL-terminated (cookie_offset bytes, or all of data_len)
                 the cookie (XML, NUL-terminated), then zero padding (libvirt leaves 64 KiB
                 so that the XML can be edited in place: `virsh save-image-define`)
    92+data_len  the QEMU migration stream, raw or piped through `PROG -c` (`xz -c -3`)

libvirt restores by reading the header, decompressing the payload with `PROG -dc` and
handing it to `qemu -incoming`. ``read_save_header`` checks what libvirt checks and a little
more (the XML's NUL, the cookie offset, a payload to follow); ``open_payload`` gives the QEMU
stream, decompressed as it is read (gzip, bzip2, xz, zstd by Python's modules, lzop by the
``lzop`` program, as libvirt does). The header, XML, cookie and padding are kept verbatim as
SOURCE_STATE tag 3 of source_format 1 (spec §5.4.3); restore/libvirt.py writes them back in
front of the rebuilt stream.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import shutil
import struct
import subprocess
import threading
from typing import BinaryIO

from leanimg.errors import LimitError, SourceFormatError, UnsupportedError

MAGIC = b"LibvirtQemudSave"
PARTIAL_MAGIC = b"LibvirtQemudPart"
VERSION = 2
HEADER = struct.Struct("<16s5I56s")  # magic, version, data_len, was_running, format, cookie_offset, unused
HEADER_SIZE = HEADER.size  # 92
FIELD_OFFSETS = {
    "magic": 0,
    "version": 16,
    "data_len": 20,
    "was_running": 24,
    "format": 28,
    "cookie_offset": 32,
    "unused": 36,
}
DATA_LIMIT = 16 << 20  # XML + cookie + padding accepted (a limit of this tool)
QEMU_MAGIC = b"QEVM"


class Compression(enum.IntEnum):
    """virQEMUSaveFormat: values are on disk and never reused."""

    RAW = 0
    GZIP = 1
    BZIP2 = 2
    XZ = 3
    LZOP = 4
    ZSTD = 5
    SPARSE = 6

    @property
    def label(self) -> str:
        return self.name.lower()


# what libvirt runs to compress (qemuSaveImageGetCompressionProgram: PROG -c, xz also -3)
COMPRESSORS = {
    Compression.GZIP: ["gzip", "-c"],
    Compression.BZIP2: ["bzip2", "-c"],
    Compression.XZ: ["xz", "-c", "-3"],
    Compression.LZOP: ["lzop", "-c"],
    Compression.ZSTD: ["zstd", "-c"],
}
# how leanimg decompresses: compressed_input's decoder kinds, or a program (PROG -dc, as libvirt)
PYTHON_DECODERS = {Compression.GZIP: "gzip", Compression.BZIP2: "bzip2", Compression.XZ: "xz", Compression.ZSTD: "zstd"}
PROGRAM_DECODERS = {Compression.LZOP: ["lzop", "-dc", "--ignore-warn"]}


@dataclasses.dataclass(frozen=True)
class SaveHeader:
    """libvirt's header with its data (XML, cookie, padding), as read from the file."""

    version: int
    data_len: int
    was_running: bool
    compression: Compression
    cookie_offset: int
    raw: bytes  # the file's first HEADER_SIZE + data_len bytes, verbatim
    xml: bytes  # the domain XML without its NUL
    cookie: bytes | None  # the cookie without its NUL, or None

    @property
    def payload_offset(self) -> int:
        return HEADER_SIZE + self.data_len


@dataclasses.dataclass(frozen=True)
class Domain:
    """What the domain XML says, as far as it could be read (None where it says nothing)."""

    name: str | None = None
    uuid: str | None = None
    memory_bytes: int | None = None
    machine: str | None = None
    arch: str | None = None
    emulator: str | None = None
    disks: tuple[tuple[str, str], ...] = ()  # (target dev, source file) of file-backed disks
    problem: str | None = None  # why the XML could not be read


def is_libvirt_save(head: bytes) -> bool:
    return head.startswith((MAGIC, PARTIAL_MAGIC))


def read_save_header(stream: BinaryIO, size: int | None = None) -> SaveHeader:
    """Read and check the header and its data from the start of ``stream`` (left at the
    payload, not a byte further: a pipe goes on with the QEMU stream); ``size``: the file's
    length when known (a pipe: None)."""
    head = _read_exact(stream, HEADER_SIZE, 0, "libvirt header", "libvirt's save header")
    header = parse_header(head, size)
    data = _read_exact(
        stream, header.data_len, HEADER_SIZE, "libvirt header data", "the domain XML, cookie and padding (data_len)"
    )
    return parse_data(head + data, header)


def _read_exact(stream: BinaryIO, n: int, offset: int, structure: str, what: str) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            raise SourceFormatError(
                f"truncated: expected {n} bytes of {what}, got {got}", offset=offset + got, structure=structure
            )
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def parse_header(head: bytes, size: int | None = None) -> SaveHeader:
    """The 92 header bytes checked (XML and cookie not yet read: ``parse_data``)."""
    if len(head) < HEADER_SIZE:
        raise SourceFormatError(
            f"truncated: expected {HEADER_SIZE} bytes of libvirt's save header, got {len(head)}",
            offset=len(head),
            structure="libvirt header",
        )
    magic, version, data_len, was_running, fmt, cookie_offset, _unused = HEADER.unpack_from(head)
    if magic == PARTIAL_MAGIC:
        raise SourceFormatError(
            f"incomplete save: magic {PARTIAL_MAGIC.decode()!r} (libvirt writes "
            f"{MAGIC.decode()!r} only once QEMU has written the whole stream; this save was "
            "interrupted or is still being written)",
            offset=0,
            structure="libvirt header.magic",
        )
    if magic != MAGIC:
        raise SourceFormatError(
            f"expected magic {MAGIC.hex(' ')} ({MAGIC.decode()!r}), got {magic.hex(' ')}",
            offset=0,
            structure="libvirt header.magic",
        )
    if version != VERSION:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if 0 < swapped <= VERSION:
            raise UnsupportedError(
                f"version field {version:#010x} is {swapped} in big-endian: a header written "
                "on a big-endian host; leanimg reads libvirt's little-endian (x86) saves only",
                offset=FIELD_OFFSETS["version"],
                structure="libvirt header.version",
            )
        raise UnsupportedError(
            f"expected save image version {VERSION}, got {version} (libvirt 0.9.x wrote 1; "
            f"libvirt up to the newest release writes {VERSION})",
            offset=FIELD_OFFSETS["version"],
            structure="libvirt header.version",
        )
    if data_len == 0:
        raise SourceFormatError(
            "data_len 0: the domain XML must follow the header (libvirt refuses such a save)",
            offset=FIELD_OFFSETS["data_len"],
            structure="libvirt header.data_len",
        )
    if size is not None and HEADER_SIZE + data_len > size:
        raise SourceFormatError(
            f"data_len {data_len} goes beyond the file: the header and its data need "
            f"{HEADER_SIZE + data_len} bytes, the file has {size}",
            offset=FIELD_OFFSETS["data_len"],
            structure="libvirt header.data_len",
        )
    if data_len > DATA_LIMIT:
        raise LimitError(
            f"data_len {data_len} exceeds {DATA_LIMIT} bytes of domain XML and cookie "
            "(a limit of leanimg, not of libvirt)",
            offset=FIELD_OFFSETS["data_len"],
            structure="libvirt header.data_len",
        )
    if cookie_offset > data_len:
        raise SourceFormatError(
            f"cookie_offset {cookie_offset} lies beyond data_len {data_len}",
            offset=FIELD_OFFSETS["cookie_offset"],
            structure="libvirt header.cookie_offset",
        )
    try:
        compression = Compression(fmt)
    except ValueError:
        known = ", ".join(f"{c.value} {c.label}" for c in Compression)
        raise UnsupportedError(
            f"unknown payload compression code {fmt} (libvirt's are {known})",
            offset=FIELD_OFFSETS["format"],
            structure="libvirt header.format",
        ) from None
    if compression == Compression.SPARSE:
        raise UnsupportedError(
            "payload format 6 'sparse' (QEMU's mapped-ram file, newer libvirt's "
            'save_image_format = "sparse") is not supported',
            offset=FIELD_OFFSETS["format"],
            structure="libvirt header.format",
        )
    return SaveHeader(
        version, data_len, bool(was_running), compression, cookie_offset, bytes(head[:HEADER_SIZE]), b"", None
    )


def parse_data(raw: bytes, header: SaveHeader) -> SaveHeader:
    """``header`` with its data: ``raw`` is the header followed by data_len bytes."""
    data = memoryview(raw)[HEADER_SIZE : HEADER_SIZE + header.data_len]
    if len(data) != header.data_len:
        raise SourceFormatError(
            f"truncated: expected {header.data_len} bytes of header data, got {len(data)}",
            offset=HEADER_SIZE + len(data),
            structure="libvirt header data",
        )
    xml_len = header.cookie_offset or header.data_len
    xml = _nul_terminated(
        data[:xml_len], HEADER_SIZE, "domain XML", "its xml_len bytes (cookie_offset, or data_len without a cookie)"
    )
    cookie = None
    if header.cookie_offset and header.cookie_offset < header.data_len:
        cookie = _nul_terminated(data[xml_len:], HEADER_SIZE + xml_len, "cookie", "data_len")
    return dataclasses.replace(header, raw=bytes(raw[: HEADER_SIZE + header.data_len]), xml=xml, cookie=cookie)


def _nul_terminated(area: memoryview, offset: int, what: str, bound: str) -> bytes:
    end = bytes(area).find(b"\0")
    if end < 0:
        raise SourceFormatError(
            f"the {what} has no terminating NUL within {bound}: {len(area)} bytes",
            offset=offset,
            structure=f"libvirt header data.{what.split()[-1].lower()}",
        )
    return bytes(area[:end])


def domain_of(xml: bytes) -> Domain:
    """Name, UUID, memory, machine type and file-backed disks from the domain XML. Never
    raises: an XML that does not parse gives a Domain with ``problem`` set."""
    import xml.etree.ElementTree as ElementTree

    if b"<!DOCTYPE" in xml or b"<!ENTITY" in xml:
        return Domain(problem="the XML declares a DOCTYPE or entities (libvirt's never does): not read")
    try:
        root = ElementTree.fromstring(xml)
    except ElementTree.ParseError as exc:
        return Domain(problem=f"the domain XML does not parse: {exc}")
    if root.tag != "domain":
        return Domain(problem=f"the XML's root element is <{root.tag[:64]}>, not <domain>")
    os_type = root.find("os/type")
    disks = []
    for disk in root.findall("devices/disk"):
        source, target = disk.find("source"), disk.find("target")
        if (
            disk.get("device", "disk") == "disk"
            and source is not None
            and target is not None
            and source.get("file")
            and target.get("dev")
        ):
            disks.append((target.get("dev"), source.get("file")))
    return Domain(
        name=_text(root, "name"),
        uuid=_text(root, "uuid"),
        memory_bytes=_memory(root.find("memory")),
        machine=os_type.get("machine") if os_type is not None else None,
        arch=os_type.get("arch") if os_type is not None else None,
        emulator=_text(root, "devices/emulator"),
        disks=tuple(disks),
    )


def disk_paths(path) -> dict[str, str]:
    """The file-backed disks the domain XML of the save image ``path`` names, by target dev."""
    with open(path, "rb") as f:
        header = read_save_header(f, file_size(f))
    return dict(domain_of(header.xml).disks)


def _text(root, path: str) -> str | None:
    element = root.find(path)
    return element.text.strip() if element is not None and element.text else None


UNITS = {
    "b": 1,
    "bytes": 1,
    "kb": 10**3,
    "k": 2**10,
    "kib": 2**10,
    "mb": 10**6,
    "m": 2**20,
    "mib": 2**20,
    "gb": 10**9,
    "g": 2**30,
    "gib": 2**30,
    "tb": 10**12,
    "t": 2**40,
    "tib": 2**40,
}


def _memory(element) -> int | None:
    """<memory unit='KiB'>N</memory> in bytes (libvirt's default unit is KiB)."""
    if element is None or not element.text or not element.text.strip().isdigit():
        return None
    factor = UNITS.get(element.get("unit", "KiB").lower())
    return int(element.text.strip()) * factor if factor else None


def describe(header: SaveHeader, domain: Domain | None = None) -> str:
    """One line: 'libvirt save of domain web1 (uuid …, 256 MiB, pc-i440fx-7.2, was running), xz payload'."""
    domain = domain or domain_of(header.xml)
    facts = [
        f"uuid {domain.uuid}" if domain.uuid else None,
        f"{domain.memory_bytes / 2**20:g} MiB" if domain.memory_bytes is not None else None,
        domain.machine,
        "was running" if header.was_running else "was paused",
    ]
    name = domain.name if domain.name is not None else "(unnamed)"
    return one_line(
        f"libvirt save of domain {name} ({', '.join(f for f in facts if f)}), "
        f"{header.compression.label} payload: restore --to libvirt"
    )


def one_line(text: str, limit: int = 400) -> str:
    """``text`` with control characters (an XML value may hold newlines) escaped, at most ``limit`` long."""
    clean = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def details(header: SaveHeader) -> dict:
    """The header and domain as `inspect --json` gives them (source_details, spec/guides/json.md)."""
    domain = domain_of(header.xml)
    return dict(
        target="libvirt",
        domain_name=domain.name,
        domain_uuid=domain.uuid,
        memory_bytes=domain.memory_bytes,
        machine=domain.machine,
        arch=domain.arch,
        emulator=domain.emulator,
        was_running=header.was_running,
        compression=header.compression.label,
        version=header.version,
        data_len=header.data_len,
        xml_bytes=len(header.xml),
        cookie_bytes=len(header.cookie) if header.cookie is not None else None,
        disks=[dict(target=t, file=f) for t, f in domain.disks],
        xml_problem=domain.problem,
    )


# -- the payload ----------------------------------------------------------------------------


def open_payload(stream: BinaryIO, header: SaveHeader) -> BinaryIO:
    """The QEMU stream after the header of ``stream`` (positioned at the payload): seekable
    when ``stream`` is and the payload is raw, else read forward only."""
    base = header.payload_offset
    if stream.seekable():
        raw = _Window(stream, base)
    else:
        raw = stream
    if header.compression == Compression.RAW:
        return raw  # the stream reader reads in large chunks itself
    if header.compression in PYTHON_DECODERS:
        from leanimg.compressed_input import Decompressing

        return io.BufferedReader(Decompressing(raw, PYTHON_DECODERS[header.compression], close_raw=False), 1 << 20)
    return io.BufferedReader(ProgramDecompressing(raw, PROGRAM_DECODERS[header.compression], base), 1 << 20)


def payload_error(exc, header: SaveHeader):
    """An error the QEMU reader raised about the payload, its offset made one in the save file
    (raw payload) or said to be one in the decompressed payload."""
    kind = type(exc)
    if header.compression == Compression.RAW:
        offset = None if exc.offset is None else exc.offset + header.payload_offset
        where = "libvirt payload"
    else:
        offset = exc.offset
        where = f"libvirt payload ({header.compression.label}-compressed; offset in the decompressed QEMU stream)"
    structure = f"{where}: {exc.structure}" if exc.structure else where
    return kind(exc.message, offset=offset, structure=structure, rule=exc.rule, path=exc.path)


class _Window(io.RawIOBase):
    """The bytes of seekable ``f`` from ``base`` on, as a seekable file of their own."""

    def __init__(self, f: BinaryIO, base: int):
        self.f, self.base = f, base
        f.seek(base)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self.f.readinto(buffer)  # no copy: straight into the reader's buffer

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            return self.f.seek(self.base + max(offset, 0)) - self.base
        return max(self.f.seek(offset, whence), self.base) - self.base

    def tell(self) -> int:
        return self.f.tell() - self.base

    def close(self) -> None:  # the file is the caller's
        super().close()


class ProgramDecompressing(io.RawIOBase):
    """The output of a decompressing program (``lzop -dc``) fed ``raw`` by a thread."""

    def __init__(self, raw: BinaryIO, argv: list[str], base: int = 0):
        if shutil.which(argv[0]) is None:
            raise UnsupportedError(
                f"the payload is {argv[0]}-compressed and the {argv[0]} program is not "
                f"installed (Debian package {argv[0]})",
                offset=base,
                structure="libvirt payload",
            )
        self.raw, self.argv, self.base = raw, argv, base
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.fed, self.feed_error, self.delivered = 0, None, 0
        self.stderr = b""
        self._feeder = threading.Thread(target=self._feed, daemon=True)
        self._errs = threading.Thread(target=self._read_stderr, daemon=True)
        self._feeder.start()
        self._errs.start()

    def _feed(self) -> None:
        try:
            while chunk := self.raw.read(1 << 20):
                self.proc.stdin.write(chunk)
                self.fed += len(chunk)
        except (BrokenPipeError, ValueError):
            pass  # the program stopped reading (an error it reports, or close)
        except OSError as exc:
            self.feed_error = exc
        finally:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def _read_stderr(self) -> None:
        self.stderr = self.proc.stderr.read(1 << 16)
        self.proc.stderr.read()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.proc.stdout.readinto(buffer)
        if n:
            self.delivered += n
            return n
        status = self.proc.wait()
        self._errs.join()
        if status != 0 or self.feed_error:
            why = self.stderr.decode(errors="replace").strip() or str(self.feed_error or f"exit status {status}")
            raise SourceFormatError(
                f"{' '.join(self.argv)} failed: {why} (after {self.delivered} decompressed bytes)",
                offset=self.base + self.fed,
                structure=f"{self.argv[0]} stream",
            )
        return 0

    def close(self) -> None:
        if not self.closed:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdout, self.proc.stderr):
                pipe.close()
            self._feeder.join(timeout=5)
        super().close()


def file_size(stream: BinaryIO) -> int | None:
    """The length of a seekable ``stream`` (its position kept), or None."""
    if not stream.seekable():
        return None
    here = stream.tell()
    end = stream.seek(0, os.SEEK_END)
    stream.seek(here)
    return end
