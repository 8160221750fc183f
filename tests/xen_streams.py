"""Xen save streams for tests, built from Xen's specs, and Xen's own verifier to check them.

Written from docs/specs/libxc-migration-stream.pandoc (revision 3),
docs/specs/libxl-migration-stream.pandoc (revision 2) and tools/xl/xl.h; no Xen code.
``make_guest`` draws a guest (pfn space with holes, page types, contents, checkpoint
rounds re-sending pages), ``build_stream`` lays it out as a libxc, libxl or xl stream and
``verify_stream`` runs Xen's verify-stream-v2 on it: ``VERIFIERS`` are Xen 4.17's (Debian 12's
xen-utils-4.17, unpacked by .ci/install under ``$LEANIMG_XEN_DIR``, default
~/.cache/leanimg/xen) and Xen 4.20's (Debian 13's xen-utils-4.20, under
``$LEANIMG_XEN420_DIR``, default ~/.cache/leanimg/xen420), each run by the system's
/usr/bin/python3 with its own library on PYTHONPATH. A test checks a stream with each of them.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PAGE = 4096
XEN_DIR = Path(os.environ.get("LEANIMG_XEN_DIR", os.path.expanduser("~/.cache/leanimg/xen")))
XEN420_DIR = Path(os.environ.get("LEANIMG_XEN420_DIR", os.path.expanduser("~/.cache/leanimg/xen420")))

XL_MAGIC = b"Xen saved domain, xl format\n \0 \r"
LIBXL_IDENT = 0x4C6962786C466D74
LIBXC_MARKER, LIBXC_IDENT = 0xFFFFFFFFFFFFFFFF, 0x58454E46
PV, HVM = 1, 2

# libxc record types
(
    END,
    PAGE_DATA,
    X86_PV_INFO,
    X86_PV_P2M_FRAMES,
    X86_PV_VCPU_BASIC,
    X86_PV_VCPU_EXTENDED,
    X86_PV_VCPU_XSAVE,
    SHARED_INFO,
    X86_TSC_INFO,
    HVM_CONTEXT,
    HVM_PARAMS,
    TOOLSTACK,
    X86_PV_VCPU_MSRS,
    VERIFY,
    CHECKPOINT,
    CHECKPOINT_DIRTY_PFN_LIST,
    STATIC_DATA_END,
    X86_CPUID_POLICY,
    X86_MSR_POLICY,
) = range(0x13)
# libxl record types
LIBXL_END, LIBXC_CONTEXT, EMULATOR_XENSTORE_DATA, EMULATOR_CONTEXT, CHECKPOINT_END = range(5)
QEMU_UPSTREAM = 2

# XEN_DOMCTL_PFINFO_* types
NOTAB, L1TAB, L2TAB, L3TAB, L4TAB = range(5)
L1TAB_PIN, L2TAB_PIN, L3TAB_PIN, L4TAB_PIN, BROKEN, XALLOC, XTAB = range(9, 16)
DATA_TYPES = (NOTAB, L1TAB, L2TAB, L3TAB, L4TAB, L1TAB_PIN, L2TAB_PIN, L3TAB_PIN, L4TAB_PIN)


def record(rtype: int, body: bytes = b"") -> bytes:
    return struct.pack("<II", rtype, len(body)) + body + bytes(-len(body) % 8)


def libxc_headers(domain_type: int, version: int = 3) -> bytes:
    image = struct.pack(">QIIHHI", LIBXC_MARKER, LIBXC_IDENT, version, 0, 0, 0)
    return image + struct.pack("<IHHII", domain_type, 12, 0, 4, 17)


def page_data(entries: list[tuple[int, int, bytes | None]]) -> bytes:
    """A PAGE_DATA record: (pfn, type, content) per entry, content None for types without data."""
    pfns = struct.pack(f"<{len(entries)}Q", *[pfn | t << 60 for pfn, t, _ in entries])
    pages = b"".join(content for _, t, content in entries if t in DATA_TYPES)
    return record(PAGE_DATA, struct.pack("<II", len(entries), 0) + pfns + pages)


# ---------------------------------------------------------------------------- guests


@dataclass
class Guest:
    domain_type: int
    num_pfns: int
    rounds: list[list[list[tuple[int, int, bytes | None]]]]  # round -> PAGE_DATA batches
    disk: bytes = b""  # blocks some pages duplicate
    version: int = 3

    def final_memory(self) -> bytes:
        """Guest memory after the stream: each pfn's last entry, zeros where it has no data."""
        memory = bytearray(self.num_pfns * PAGE)
        for batches in self.rounds:
            for batch in batches:
                for pfn, t, content in batch:
                    memory[pfn * PAGE : (pfn + 1) * PAGE] = content if t in DATA_TYPES else bytes(PAGE)
        return bytes(memory)

    def sends_each_page_once(self) -> bool:
        pfns = [pfn for batches in self.rounds for batch in batches for pfn, _, _ in batch]
        return len(pfns) == len(set(pfns))


class _Pages:
    """Realistic page contents: zeros, text, random, page tables, disk blocks."""

    def __init__(self, rng: np.random.Generator, disk_pages: int = 32):
        self.rng = rng
        text = b"leanimg xen test page: the quick brown fox jumps over the lazy dog. "
        self.text = (text * (PAGE // len(text) + 1))[:PAGE]
        self.disk = rng.integers(0, 256, disk_pages * PAGE, dtype=np.uint8).tobytes()

    def content(self, kind: str) -> bytes:
        if kind == "zero":
            return bytes(PAGE)
        if kind == "text":
            shift = int(self.rng.integers(0, PAGE))
            return self.text[shift:] + self.text[:shift]
        if kind == "disk":
            block = int(self.rng.integers(0, len(self.disk) // PAGE))
            return self.disk[block * PAGE : (block + 1) * PAGE]
        if kind == "table":
            n = int(self.rng.integers(1, 512))
            frames = self.rng.integers(0x100, 0x100000, n, dtype=np.uint64)
            entries = np.zeros(512, np.uint64)
            entries[:n] = (frames << np.uint64(12)) | np.uint64(0x67)
            return entries.tobytes()
        return self.rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes()

    def any_content(self) -> bytes:
        return self.content(str(self.rng.choice(["zero", "text", "disk", "random", "random"])))


def make_guest(
    domain_type: int = HVM,
    num_pfns: int = 96,
    *,
    seed: int = 0,
    holes=((40, 48),),
    checkpoints: int = 0,
    batch: int = 16,
    version: int = 3,
) -> Guest:
    """A guest whose first round sends every pfn outside ``holes``; each further round
    (after a CHECKPOINT) re-sends about a quarter of them with new contents."""
    rng = np.random.default_rng(seed)
    pages = _Pages(rng)
    hole = np.zeros(num_pfns, bool)
    for lo, hi in holes:
        hole[lo:hi] = True
    sent = [pfn for pfn in range(num_pfns) if not hole[pfn]]
    types = _page_types(domain_type, sent, rng)
    first = [(pfn, types[pfn], _content_for(types[pfn], pages)) for pfn in sent]
    rounds = [_batches(first, batch)]
    for _ in range(checkpoints):
        chosen = sorted(rng.choice(sent, size=max(1, len(sent) // 4), replace=False).tolist())
        again = [(pfn, types[pfn], _content_for(types[pfn], pages)) for pfn in chosen]
        rounds.append(_batches(again, batch))
    if checkpoints:
        ballooned = sent[len(sent) // 2]  # data first, then XTAB: its page is gone
        rounds[-1].append([(ballooned, XTAB, None)])
    return Guest(domain_type, num_pfns, rounds, pages.disk, version)


def _page_types(domain_type: int, sent: list[int], rng) -> dict[int, int]:
    """NOTAB mostly; every other type on a few pfns (page tables only in PV guests)."""
    types = {pfn: NOTAB for pfn in sent}
    special = [XTAB, XALLOC, BROKEN]
    if domain_type == PV:
        special += [L1TAB, L2TAB, L3TAB, L4TAB, L1TAB_PIN, L2TAB_PIN, L3TAB_PIN, L4TAB_PIN]
    for pfn, t in zip(rng.choice(sent, size=len(special), replace=False).tolist(), special):
        types[pfn] = t
    return types


def _content_for(t: int, pages: _Pages) -> bytes | None:
    if t not in DATA_TYPES:
        return None
    return pages.content("table") if t != NOTAB else pages.any_content()


def _batches(entries: list, size: int) -> list[list]:
    return [entries[i : i + size] for i in range(0, len(entries), size)]


# ---------------------------------------------------------------------------- streams


@dataclass
class StreamOptions:
    form: str = "xl"  # "xl", "xl-libxc", "libxl", "libxc"
    xenstore: dict = field(default_factory=lambda: {"physmap/1/start_addr": "f0000000", "physmap/1/size": "800000"})
    verifier_copy: bool = False  # EMULATOR_XENSTORE_DATA emptied (verify-stream-v2's bug)


def build_stream(guest: Guest, options: StreamOptions | None = None) -> bytes:
    options = options or StreamOptions()
    embedded = options.form in ("xl", "libxl")
    rounds = _libxc_rounds(guest)
    if not embedded:
        body = libxc_headers(guest.domain_type, guest.version) + b"".join(rounds)
    else:
        body = struct.pack(">QII", LIBXL_IDENT, 2, 0) + record(LIBXC_CONTEXT)
        body += libxc_headers(guest.domain_type, guest.version)
        for i, part in enumerate(rounds):
            last = i == len(rounds) - 1
            body += part + _emulator_records(guest, options) + record(LIBXL_END if last else CHECKPOINT_END)
    if options.form.startswith("xl"):
        body = xl_header(guest, libxl=embedded) + body
    return body


def xl_header(guest: Guest, libxl: bool = True) -> bytes:
    config = (
        json.dumps(
            {
                "c_info": {"type": "hvm" if guest.domain_type == HVM else "pv", "name": "leanimg-test"},
                "b_info": {"max_memkb": guest.num_pfns * 4},
            }
        ).encode()
        + b"\0"
    )
    optdata = struct.pack("<I", len(config)) + config
    flags = 1 | (2 if libxl else 0)  # JSON config, STREAMv2
    return XL_MAGIC + struct.pack("<IIII", 0x01020304, flags, 0, len(optdata)) + optdata


def _libxc_rounds(guest: Guest) -> list[bytes]:
    """The libxc records of each round; rounds end in CHECKPOINT, the last in END."""
    parts = []
    for i, batches in enumerate(guest.rounds):
        out = _static_records(guest) if i == 0 else b""
        out += b"".join(page_data(batch) for batch in batches)
        out += _tail_records(guest)
        out += record(END if i == len(guest.rounds) - 1 else CHECKPOINT)
        parts.append(out)
    return parts


def _static_records(guest: Guest) -> bytes:
    out = b""
    if guest.domain_type == PV:
        out += record(X86_PV_INFO, struct.pack("<BBHI", 8, 4, 0, 0))
    if guest.version >= 3:
        out += record(X86_CPUID_POLICY, struct.pack("<6I", 0, 0xFFFFFFFF, 0xD, 0x756E6547, 0x6C65746E, 0x49656E69))
        out += record(X86_MSR_POLICY, struct.pack("<QII", 0xCE, 0, 0))
        out += record(STATIC_DATA_END)
    if guest.domain_type == PV:
        frames = (guest.num_pfns + 511) // 512
        out += record(
            X86_PV_P2M_FRAMES,
            struct.pack("<II", 0, guest.num_pfns - 1) + struct.pack(f"<{frames}Q", *range(0x80, 0x80 + frames)),
        )
    return out


def _tail_records(guest: Guest) -> bytes:
    out = record(X86_TSC_INFO, struct.pack("<IIQII", 0, 2_400_000, 123_456_789, 1, 0))
    if guest.domain_type == PV:
        out += record(SHARED_INFO, bytes(range(256)) * 16)
        for vcpu in range(2):
            for rtype in (X86_PV_VCPU_BASIC, X86_PV_VCPU_EXTENDED, X86_PV_VCPU_XSAVE, X86_PV_VCPU_MSRS):
                out += record(rtype, struct.pack("<II", vcpu, 0) + bytes([rtype]) * (13 + 40 * vcpu))
    else:
        params = [(2, 0xFEFFF), (5, 1), (19, 0xFEFFE)]
        out += record(
            HVM_PARAMS, struct.pack("<II", len(params), 0) + b"".join(struct.pack("<QQ", i, v) for i, v in params)
        )
        out += record(HVM_CONTEXT, b"HVMCTX" + bytes(range(200)) + b"\x01\x02\x03")
    return out


def _emulator_records(guest: Guest, options: StreamOptions) -> bytes:
    header = struct.pack("<II", QEMU_UPSTREAM, 0)
    pairs = b"" if options.verifier_copy else xenstore_data(options.xenstore)
    out = record(EMULATOR_XENSTORE_DATA, header + pairs)
    if guest.domain_type == HVM:
        # the device model's state as QEMU saves it: opaque to libxl, kept verbatim
        out += record(EMULATOR_CONTEXT, header + b"QEVM\0\0\0\3" + bytes(range(251)) * 3)
    return out


def xenstore_data(pairs: dict) -> bytes:
    return b"".join(k.encode() + b"\0" + v.encode() + b"\0" for k, v in pairs.items())


def verifier_format(form: str) -> str:
    return "xl" if form.startswith("xl") else form


# ---------------------------------------------------------------------------- verifiers


@dataclass(frozen=True)
class Verifier:
    """One Xen release's verify-stream-v2, unpacked (not installed) by .ci/install."""

    version: str
    lib: Path  # .../usr/lib/xen-VERSION

    @property
    def script(self) -> Path:
        return self.lib / "bin" / "verify-stream-v2"

    @property
    def id(self) -> str:
        return f"xen{self.version}"

    def missing(self) -> str | None:
        """Why this verifier cannot run here, or None."""
        if not self.script.is_file():
            return f"Xen {self.version}'s verify-stream-v2 is not at {self.script} (run .ci/install)"
        if not os.access("/usr/bin/python3", os.X_OK):
            return "/usr/bin/python3 (which runs Xen's verify-stream-v2) is missing"
        return None

    def require(self) -> None:
        """Skip the calling test where this verifier is missing; in CI (env CI set) fail instead."""
        _skip_or_fail([why] if (why := self.missing()) else [])

    def run(self, path, form: str) -> subprocess.CompletedProcess:
        """verify-stream-v2 on ``path`` (format xl, libxl or libxc)."""
        why = self.missing()
        if why is not None:
            raise AssertionError(why)
        env = dict(os.environ, PYTHONPATH=str(self.lib / "lib" / "python"))
        return subprocess.run(
            ["/usr/bin/python3", str(self.script), "-v", "-f", verifier_format(form), "-i", str(path)],
            env=env,
            capture_output=True,
            timeout=120,
        )


XEN_4_17 = Verifier("4.17", XEN_DIR / "usr" / "lib" / "xen-4.17")
XEN_4_20 = Verifier("4.20", XEN420_DIR / "usr" / "lib" / "xen-4.20")
VERIFIERS = (XEN_4_17, XEN_4_20)


def verify_stream(path, form: str, verifier: Verifier) -> subprocess.CompletedProcess:
    """Run ``verifier``'s verify-stream-v2 on ``path`` (format xl, libxl or libxc)."""
    return verifier.run(path, form)


def require_verifiers() -> None:
    """Every verifier present: else skip the calling test (naming the missing ones), in CI fail."""
    _skip_or_fail([why for v in VERIFIERS if (why := v.missing())])


def _skip_or_fail(reasons: list[str]) -> None:
    if not reasons:
        return
    import pytest  # imported here: fuzz/make_stream_corpus.py uses this module too

    if os.environ.get("CI"):
        pytest.fail("; ".join(reasons) + " (CI checks every stream with each Xen verifier)")
    pytest.skip("; ".join(reasons))


def verify_with_every_verifier(path, form: str) -> None:
    """``path`` accepted by each of VERIFIERS (missing ones: skip, in CI fail; see Verifier.require)."""
    require_verifiers()
    for verifier in VERIFIERS:
        proc = verifier.run(path, form)
        assert proc.returncode == 0, (
            f"Xen {verifier.version}'s verify-stream-v2 refused {path}:\n" + proc.stderr.decode()[-2000:]
        )


# ---------------------------------------------------------------------------- reference reader


def memory_after(stream: bytes, form: str, num_pfns: int) -> bytes:
    """Guest memory a restore of ``stream`` ends with: PAGE_DATA entries applied in order
    (pages without data become zeros). Independent of leanimg's reader, for comparisons."""
    memory = bytearray(num_pfns * PAGE)
    pos = 0
    if form.startswith("xl"):
        pos = 48 + struct.unpack_from("<I", stream, 44)[0]
    embedded = form in ("xl", "libxl")
    if embedded:
        pos += 16 + 8  # libxl header, LIBXC_CONTEXT
    pos += 24 + 16  # libxc image and domain headers
    while True:
        rtype, length = struct.unpack_from("<II", stream, pos)
        body = stream[pos + 8 : pos + 8 + length]
        pos += 8 + length + (-length % 8)
        if rtype == PAGE_DATA:
            _apply_page_data(memory, body)
        elif rtype == END:
            return bytes(memory)
        elif rtype == CHECKPOINT and embedded:
            pos = _skip_libxl_until_checkpoint_end(stream, pos)


def _apply_page_data(memory: bytearray, body: bytes) -> None:
    count = struct.unpack_from("<I", body)[0]
    entries = struct.unpack_from(f"<{count}Q", body, 8)
    data = 8 + 8 * count
    for entry in entries:
        pfn, t = entry & ((1 << 52) - 1), entry >> 60
        if t in DATA_TYPES:
            memory[pfn * PAGE : (pfn + 1) * PAGE] = body[data : data + PAGE]
            data += PAGE
        else:
            memory[pfn * PAGE : (pfn + 1) * PAGE] = bytes(PAGE)


def _skip_libxl_until_checkpoint_end(stream: bytes, pos: int) -> int:
    while True:
        rtype, length = struct.unpack_from("<II", stream, pos)
        pos += 8 + length + (-length % 8)
        if rtype == CHECKPOINT_END:
            return pos
