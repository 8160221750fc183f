"""Seed corpora for fuzz/fuzz_qemu.py and fuzz/fuzz_xen.py: small real and generated saves.

    python fuzz/make_stream_corpus.py qemu /tmp/leanimg-qemu-corpus
    python fuzz/make_stream_corpus.py xen /tmp/leanimg-xen-corpus

QEMU seeds: the bundled real save (lean-image/sample/vm.save.zst) cut down to a few pages per
RAM block but keeping QEMU's own configuration, device sections and VMDESCRIPTION (all of
them, and a short variant with four devices), the real save's first 64 KiB, synthetic saves
from our writer, a live save re-sending pages over several PART sections, ZERO pages with a
non-zero fill byte, the x-ignore-shared capability (block addresses in MEM_SIZE), a 16 KiB
target page size, no VMDESCRIPTION, and an XBZRLE entry (refused as unsupported); and mapped-ram
files (QEMU >= 9.0, converters/mapped_ram.py) from our writer: several blocks with set and clear
bitmap bits, x-ignore-shared with a block whose header is empty, 16 KiB pages, PART sections and
a SWITCHOVER_START command after the START section.

Mapped-ram seeds are compact: each block's pages start at the first page boundary after its
bitmap, not at the next 1 MiB boundary QEMU's writer uses (MAPPED_RAM_FILE_OFFSET_ALIGNMENT).
QEMU's loader (parse_ramblock_mapped_ram) and ours ask for page alignment only, so the files are
valid, and each stays under 64 KiB: a 1 MiB-aligned seed would be over 1 MiB of zeros, past
libFuzzer's default -max_len cap (1 MiB, so it would be cut short and refused), and would make
every mutation copy and parse a megabyte. The harness's restore --to mapped-ram writes the
1 MiB-aligned form and reads it back, so the reader sees that form on every accepted input.

Xen seeds: tests/xen_streams.py guests (small) laid out as xl/libxl, xl/libxc, libxl and
libxc streams, PV and HVM, libxc v2 and v3, with checkpoint rounds re-sending pages.
Everything is deterministic; binary corpora are not committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import zstandard

from leanimg.converters import mapped_ram
from leanimg.converters import qemu as q

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_SAVE = ROOT / "lean-image" / "sample" / "vm.save.zst"
PS = 4096
REAL_PREFIX = 64 << 10
MINI_BLOCK_PAGES = 4
MAPPED_SEED_MAX = 64 << 10


# ---------------------------------------------------------------------------- QEMU


def _pages(seed: int, count: int, page_size: int = PS) -> bytes:
    """Pages of mixed content: zeros, small integers (compressible), random bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        kind = k % 3
        if kind == 0:
            out.append(bytes(page_size))
        elif kind == 1:
            out.append(rng.integers(0, 8, page_size, dtype=np.uint8).tobytes())
        else:
            out.append(rng.bytes(page_size))
    return b"".join(out)


def _prologue(machine: bytes = b"pc-i440fx-7.2", subsections: bytes = b"") -> bytes:
    return (
        struct.pack(">II", q.QEVM_MAGIC, q.QEVM_VERSION)
        + bytes([q.CONFIGURATION])
        + struct.pack(">I", len(machine))
        + machine
        + subsections
    )


def _subsection(name: str, version: int, body: bytes) -> bytes:
    return bytes([q.SUBSECTION, len(name)]) + name.encode() + struct.pack(">I", version) + body


def _synthetic_state(blocks, *, prologue=None, page_size=PS, vmdesc=True, capabilities=()):
    devices = [
        q.DeviceSection(q.FULL, q.SectionHeader(3, "timer", 0, 2), b"\x01" * 24),
        q.DeviceSection(q.FULL, q.SectionHeader(4, "cpu", 0, 5), bytes(range(64)) + b"\x7e\0\0\0\x04"),
    ]
    desc = {"page_size": page_size, "devices": [{"name": d.header.idstr, "instance_id": 0} for d in devices]}
    return q.StreamState(
        prologue=prologue or _prologue(),
        machine="pc-i440fx-7.2",
        page_size=page_size,
        capabilities=capabilities,
        ram=q.SectionHeader(2, "ram", 0, 4),
        ram_blocks=tuple(blocks),
        ram_plan=[],
        footers=True,
        devices=devices,
        vmdesc=json.dumps(desc).encode() if vmdesc else None,
    )


def _write(state: q.StreamState, contents: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    q.write_qemu_stream(out, state, None, lambda block: [contents[block.name]])
    return out.getvalue()


def synthetic_save(ram: bytes, *, vmdesc=True, page_size=PS, extra_blocks=()) -> bytes:
    """Our writer's save of ``ram`` in "pc.ram" plus ``extra_blocks`` ((name, bytes), ...)."""
    contents = {"pc.ram": ram, **dict(extra_blocks)}
    blocks = [q.RamBlock(name, len(data)) for name, data in contents.items()]
    prologue = _prologue(
        subsections=_subsection("configuration/target-page-bits", 1, struct.pack(">I", page_size.bit_length() - 1))
        if page_size != PS
        else b""
    )
    return _write(_synthetic_state(blocks, prologue=prologue, page_size=page_size, vmdesc=vmdesc), contents)


def ignore_shared_save() -> bytes:
    caps = _subsection(
        "configuration/capabilities", 1, struct.pack(">I", 1) + bytes([len("x-ignore-shared")]) + b"x-ignore-shared"
    )
    contents = {"pc.ram": _pages(5, 6), "vga.vram": _pages(6, 2)}
    blocks = [q.RamBlock("pc.ram", 6 * PS, 0x7F0000000000), q.RamBlock("vga.vram", 2 * PS, 0x7F1000000000)]
    state = _synthetic_state(blocks, prologue=_prologue(subsections=caps), capabilities=("x-ignore-shared",))
    return _write(state, contents)


def _entry(offset: int, flags: int, block: str | None, payload: bytes) -> bytes:
    name = b"" if block is None else bytes([len(block)]) + block.encode()
    return struct.pack(">Q", offset | flags | (0 if block else q.F_CONTINUE)) + name + payload


def live_save(*, xbzrle: bool = False) -> bytes:
    """A live save: MEM_SIZE, then PART sections sending pages, re-sending some (the last
    copy wins), ZERO entries with fill bytes 0 and 0x5a, then END and the device state."""
    pages = _pages(9, 8)
    blocks = {"pc.ram": 8 * PS, "pc.bios": 2 * PS}
    mem = sum(blocks.values())
    out = bytearray(_prologue())
    out += bytes([q.START]) + struct.pack(">I", 2) + bytes([3]) + b"ram" + struct.pack(">II", 0, 4)
    out += struct.pack(">Q", mem | q.F_MEM_SIZE)
    for name, length in blocks.items():
        out += bytes([len(name)]) + name.encode() + struct.pack(">Q", length)
    out += struct.pack(">Q", q.F_EOS) + bytes([q.FOOTER]) + struct.pack(">I", 2)

    def part(entries: bytes) -> bytes:
        return (
            bytes([q.PART])
            + struct.pack(">I", 2)
            + entries
            + struct.pack(">Q", q.F_EOS)
            + bytes([q.FOOTER])
            + struct.pack(">I", 2)
        )

    first = _entry(0, q.F_PAGE, "pc.ram", pages[:PS])
    first += b"".join(_entry(k * PS, q.F_PAGE, None, pages[k * PS : (k + 1) * PS]) for k in range(1, 6))
    first += _entry(0, q.F_ZERO, "pc.bios", b"\x5a") + _entry(PS, q.F_ZERO, None, b"\0")
    again = _entry(2 * PS, q.F_PAGE, "pc.ram", _pages(10, 1)) + _entry(3 * PS, q.F_ZERO, None, b"\0")
    if xbzrle:
        again += _entry(4 * PS, q.F_XBZRLE, None, b"\x00\x00\x04" + b"\x01\x02\x03\x04")
    else:
        again += _entry(4 * PS, q.F_PAGE, None, _pages(11, 1))
    out += part(first) + part(again)
    out += (
        bytes([q.END])
        + struct.pack(">I", 2)
        + _entry(7 * PS, q.F_PAGE, "pc.ram", pages[7 * PS :])
        + struct.pack(">Q", q.F_EOS)
        + bytes([q.FOOTER])
        + struct.pack(">I", 2)
    )
    state = _synthetic_state([])
    for device in state.devices:
        out += device.to_bytes(True)
    out += bytes([q.EOF, q.VMDESCRIPTION]) + struct.pack(">I", len(state.vmdesc)) + state.vmdesc
    return bytes(out)


@contextlib.contextmanager
def _compact_slots(page_size: int):
    """Our mapped-ram writer laying each block's pages out at the first page boundary after its
    bitmap instead of the next 1 MiB one (see the module docstring)."""
    saved = mapped_ram.ALIGNMENT
    mapped_ram.ALIGNMENT = page_size
    try:
        yield
    finally:
        mapped_ram.ALIGNMENT = saved


def mapped_ram_save(
    contents: dict[str, bytes],
    *,
    page_size: int = PS,
    addrs: dict[str, int] | None = None,
    plan=None,
    empty_last: bool = False,
) -> bytes:
    """A mapped-ram file of ``contents`` (block name -> bytes) written by our writer
    (write_qemu_stream(mapped=True)), compact. ``addrs``: the blocks' addresses, with the
    capability x-ignore-shared; ``plan``: the RAM sections and commands after START (EOS only);
    ``empty_last``: the last block as x-ignore-shared skips it (header with bitmap_offset =
    pages_offset = 0, no bitmap, no pages: its RAM is the shared memory's, so zeros here)."""
    blocks = [q.RamBlock(name, len(data), (addrs or {}).get(name)) for name, data in contents.items()]
    subsections = b""
    if page_size != PS:
        subsections += _subsection("configuration/target-page-bits", 1, struct.pack(">I", page_size.bit_length() - 1))
    caps = ("x-ignore-shared",) if addrs else ()
    if caps:
        subsections += _subsection("configuration/capabilities", 1, struct.pack(">I", 1) + _name(caps[0]))
    state = _synthetic_state(
        blocks, prologue=_prologue(subsections=subsections), page_size=page_size, capabilities=caps
    )
    if plan is not None:
        state = dataclasses.replace(state, ram_plan=[(q.START, 0), *plan])
    out = io.BytesIO()
    with _compact_slots(page_size):
        q.write_qemu_stream(out, state, None, lambda block: [contents[block.name]], mapped=True)
        data = out.getvalue()
        if empty_last:
            last = blocks[-1]
            entry = (
                _name(last.name)
                + struct.pack(">Q", last.length)
                + (struct.pack(">Q", last.addr or 0) if addrs else b"")
            )
            header_at = data.index(entry) + len(entry)
            layout = mapped_ram.layout_at(last.name, last.length, page_size, header_at)
            data = data[:header_at] + mapped_ram.HEADER.pack(mapped_ram.VERSION, page_size, 0, 0) + data[layout.end :]
    if len(data) >= MAPPED_SEED_MAX:
        raise AssertionError(
            f"a mapped-ram seed of {len(data)} bytes: did the writer stop using "
            "mapped_ram.ALIGNMENT? (seeds are to stay compact)"
        )
    return data


def _name(name: str) -> bytes:
    return bytes([len(name)]) + name.encode()


def mapped_ram_seeds() -> dict[str, bytes]:
    ram = _pages(21, 4)  # zero, small integers, random, zero
    ram = ram[: 3 * PS] + bytes(PS)
    return {
        "mapped_ram": mapped_ram_save({"pc.ram": ram, "vga.vram": _pages(22, 2)[::-1], "pc.bios": bytes(PS)}),
        "mapped_ram_ignore_shared": mapped_ram_save(
            {"pc.ram": _pages(23, 3), "vga.vram": bytes(2 * PS)},
            addrs={"pc.ram": 0x7F0000000000, "vga.vram": 0x7F1000000000},
            empty_last=True,
        ),
        "mapped_ram_16k_pages": mapped_ram_save(
            {"pc.ram": _pages(24, 2, 16384)[16384:] + bytes(16384)}, page_size=16384
        ),
        "mapped_ram_sections": mapped_ram_save(
            {"pc.ram": _pages(25, 3)}, plan=[(q.PART, 0), (q.COMMAND, q.CMD_SWITCHOVER_START), (q.END, 0)]
        ),
    }


def real_save_bytes() -> bytes:
    return zstandard.ZstdDecompressor().decompress(SAMPLE_SAVE.read_bytes(), max_output_size=1 << 30)


def real_state(save: bytes) -> tuple[q.StreamState, dict[str, bytes]]:
    """The real save's stream state and the first pages of each RAM block."""
    first: dict[str, dict[int, bytes]] = {}
    keep = MINI_BLOCK_PAGES * PS
    for event in q.read_qemu_stream(io.BytesIO(save)):
        if isinstance(event, q.Page) and event.offset < keep:
            first.setdefault(event.block, {})[event.offset] = event.content(PS)
        elif isinstance(event, q.StreamEnd):
            state = event.state
    contents = {}
    for block in state.ram_blocks:
        length = min(block.length, keep)
        pages = first.get(block.name, {})
        contents[block.name] = b"".join(pages.get(off, bytes(PS)) for off in range(0, length, PS))
    return state, contents


def real_mini(state: q.StreamState, contents: dict[str, bytes], devices: int | None = None) -> bytes:
    """QEMU's own save with a few pages per block; ``devices``: keep only that many device
    sections (and their VMDESCRIPTION entries)."""
    blocks = tuple(q.RamBlock(b.name, len(contents[b.name]), b.addr) for b in state.ram_blocks)
    small = dataclasses.replace(state, ram_blocks=blocks, ram_plan=[])
    if devices is not None:
        desc = json.loads(state.vmdesc)
        desc["devices"] = desc["devices"][:devices]
        small = dataclasses.replace(small, devices=state.devices[:devices], vmdesc=json.dumps(desc).encode())
    return _write(small, contents)


def qemu_seeds(real: bool = True) -> dict[str, bytes]:
    seeds = {
        "synthetic": synthetic_save(_pages(1, 6)),
        "synthetic_no_vmdesc": synthetic_save(_pages(2, 3), vmdesc=False),
        "synthetic_blocks": synthetic_save(
            _pages(3, 5), extra_blocks=(("vga.vram", _pages(4, 3)), ("pc.bios", bytes(PS)))
        ),
        "synthetic_16k_pages": synthetic_save(_pages(12, 2, 16384), page_size=16384),
        "ignore_shared": ignore_shared_save(),
        "live_resend": live_save(),
        "live_xbzrle": live_save(xbzrle=True),
        **mapped_ram_seeds(),
    }
    if real:
        save = real_save_bytes()
        state, contents = real_state(save)
        seeds["real_prefix_64k"] = save[:REAL_PREFIX]
        seeds["real_mini"] = real_mini(state, contents)
        seeds["real_mini_4_devices"] = real_mini(state, contents, devices=4)
    return seeds


# ---------------------------------------------------------------------------- Xen


def _xen_streams_module():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import xen_streams
    finally:
        sys.path.pop(0)
    return xen_streams


def xen_seeds() -> dict[str, bytes]:
    xs = _xen_streams_module()
    seeds = {}
    for domain, dname in ((xs.HVM, "hvm"), (xs.PV, "pv")):
        for version in (2, 3):
            for checkpoints in (0, 2):
                guest = xs.make_guest(
                    domain,
                    num_pfns=16,
                    seed=version * 10 + checkpoints,
                    holes=((6, 8),),
                    checkpoints=checkpoints,
                    batch=4,
                    version=version,
                )
                for form in ("xl", "xl-libxc", "libxl", "libxc"):
                    name = f"{form}_{dname}_v{version}" + (f"_ckpt{checkpoints}" if checkpoints else "")
                    seeds[name] = xs.build_stream(guest, xs.StreamOptions(form=form))
    return seeds


def write_seeds(seeds: dict[str, bytes], directory: str, suffix: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, data in seeds.items():
        path = os.path.join(directory, f"{name}.{suffix}")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


def make_corpus(kind: str, directory: str) -> list[str]:
    seeds = qemu_seeds() if kind == "qemu" else xen_seeds()
    return write_seeds(seeds, directory, kind)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("qemu", "xen"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for path in make_corpus(*argv):
        print(f"{path}  {os.path.getsize(path)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
