"""Compile ksy/leanimg.ksy with the Kaitai Struct compiler and load the parser.

The compiler comes from npm (kaitai-struct-compiler, run by node). It is looked
for in ``$LEANIMG_KSC_DIR`` (an npm prefix holding ``node_modules``), by default
``~/.cache/leanimg/ksc``, and installed there with npm when missing.

``to_dump()`` turns a parsed ``Leanimg`` object into the dict shape of
``leanimg.reader.dump_structure()`` so the two parsers can be compared.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

KSC_VERSION = "0.11.0"
NPM_PACKAGES = (f"kaitai-struct-compiler@{KSC_VERSION}", "js-yaml")
TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
KSY_PATH = REPO_DIR / "ksy" / "leanimg.ksy"
COMPILE_SCRIPT = TESTS_DIR / "kaitai_compile.js"
# The generated module is named after meta/id, "leanimg", like our package:
# it is imported under this name so that it never shadows the real one.
GENERATED_MODULE_NAME = "leanimg_kaitai_generated"
FOOTER_SIZE = 48
RECORD_HEADER_SIZE = 16
RECORD_TRAILER_SIZE = 8


class KaitaiUnavailable(RuntimeError):
    """node or npm is not installed, so the compiler cannot run."""


class KaitaiCompileError(RuntimeError):
    """The compiler (or npm installing it) failed; the message carries its output."""


def ksc_dir() -> Path:
    configured = os.environ.get("LEANIMG_KSC_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "leanimg" / "ksc"


def _installed(prefix: Path) -> bool:
    """The prefix holds js-yaml and exactly the compiler version this project uses."""
    modules = prefix / "node_modules"
    try:
        ksc = json.loads((modules / "kaitai-struct-compiler" / "package.json").read_text())
    except (OSError, ValueError):
        return False
    return ksc.get("version") == KSC_VERSION and (modules / "js-yaml" / "package.json").is_file()


def _run(argv: list[str], what: str, timeout: int) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise KaitaiCompileError(f"{what} timed out after {timeout} s: {' '.join(argv)}") from exc
    if proc.returncode != 0:
        raise KaitaiCompileError(
            f"{what} failed with exit status {proc.returncode}: {' '.join(argv)}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc


def ensure_compiler() -> Path:
    """Return the npm prefix holding the compiler, installing it there if missing."""
    node = shutil.which("node")
    if node is None:
        raise KaitaiUnavailable("node is not on PATH: cannot run kaitai-struct-compiler")
    prefix = ksc_dir()
    if _installed(prefix):
        return prefix
    npm = shutil.which("npm")
    if npm is None:
        raise KaitaiUnavailable(f"npm is not on PATH: cannot install {NPM_PACKAGES[0]} into {prefix}")
    prefix.mkdir(parents=True, exist_ok=True)
    _run([npm, "install", "--no-audit", "--no-fund", "--save-exact", "--prefix", str(prefix), *NPM_PACKAGES],
         f"npm install into {prefix}", timeout=600)
    if not _installed(prefix):
        raise KaitaiCompileError(f"npm install reported success but {prefix}/node_modules lacks "
                                 f"kaitai-struct-compiler {KSC_VERSION} or js-yaml")
    return prefix


def compile_ksy(out_dir: Path, ksy: Path = KSY_PATH) -> Path:
    """Compile ``ksy`` to Python into ``out_dir``; return the generated file."""
    prefix = ensure_compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = _run([shutil.which("node") or "node", str(COMPILE_SCRIPT), str(prefix), str(ksy), str(out_dir)],
                f"kaitai-struct-compiler on {ksy}", timeout=300)
    names = proc.stdout.split()
    if names != ["leanimg.py"]:
        raise KaitaiCompileError(f"expected the compiler to write leanimg.py, it wrote {names!r}\n"
                                 f"--- stderr ---\n{proc.stderr}")
    return out_dir / names[0]


def load_generated(path: Path):
    """Import a generated parser module from ``path`` under a private name."""
    spec = importlib.util.spec_from_file_location(GENERATED_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[GENERATED_MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module


def generated_parser_for_tests(out_dir: Path):
    """The generated parser module, compiled into ``out_dir``; the test is skipped when the
    compiler cannot run, except in CI (CI=true), where that is a failure."""
    import pytest
    try:
        path = compile_ksy(out_dir)
    except KaitaiUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but the Kaitai compiler cannot run: {exc}")
        pytest.skip(str(exc))
    return load_generated(path)


# --- Kaitai object -> dump_structure() dict -----------------------------------

def _int(value) -> int:
    """An enum field as its number (an unknown value is already a plain int)."""
    return value.value if isinstance(value, enum.Enum) else int(value)


def _zstd_length(frame) -> int:
    return frame._io.size()


def _body(rtype, body) -> dict:
    name = rtype.name if isinstance(rtype, enum.Enum) else None
    if name == "region":
        return {"region_id": body.region_id, "flags": body.flags, "guest_phys_base": body.guest_phys_base,
                "size_bytes": body.size_bytes, "name": body.name}
    if name == "disk":
        return {"disk_id": body.disk_id, "flags": body.flags, "size_bytes": body.size_bytes,
                "sector_size": body.sector_size, "fingerprint_method": body.fingerprint_method,
                "fingerprint": body.fingerprint, "name": body.name}
    if name == "source_state":
        return {"source_format": _int(body.source_format), "tag": body.tag, "sequence": body.sequence,
                "len_data": len(body.data)}
    if name == "page_frame":
        return {"first_ordinal": body.first_ordinal, "num_pages": body.num_pages,
                "len_zstd": _zstd_length(body.zstd_frame)}
    if name == "delta_frame":
        return {"first_delta": body.first_delta, "num_deltas": body.num_deltas,
                "entry_offsets": list(body.entry_offsets), "len_zstd": _zstd_length(body.zstd_frame)}
    if name == "disk_refs":
        return {"first_ref": body.first_ref, "num_refs": body.num_refs,
                "refs": [{"disk_id": r.disk_id, "sector": r.sector} for r in body.refs]}
    if name == "page_map":
        return {"region_id": body.region_id, "num_extents": body.num_extents,
                "extents": [{"first_page": e.first_page, "num_pages": e.num_pages,
                             "page_class": _int(e.page_class), "first_slot": e.first_slot}
                            for e in body.extents]}
    if name == "digests":
        return {"region_id": body.region_id, "num_digests": body.num_digests, "first_page": body.first_page,
                "num_pages": body.num_pages, "digests": list(body.digests)}
    if name == "index":
        return {"num_entries": body.num_entries,
                "entries": [{"record_offset": e.ofs_record, "record_type": _int(e.record_type), "key": e.key,
                             "first": e.first, "count": e.count} for e in body.entries]}
    assert isinstance(body, bytes), f"record type {rtype!r} parsed into {type(body).__name__}, expected raw bytes"
    return {}


def header_dump(h) -> dict:
    return {"magic": h.magic, "major_version": h.major_version, "minor_version": h.minor_version,
            "header_length": h.len_header, "incompatible_features": h.incompatible_features,
            "compatible_features": h.compatible_features, "autoclear_features": h.autoclear_features,
            "image_uuid": h.image_uuid, "parent_uuid": h.parent_uuid, "parent_digest": h.parent_digest,
            "page_size": h.page_size, "header_checksum": h.header_checksum}


def footer_dump(f) -> dict:
    return {"magic": f.magic, "index_offset": f.ofs_index, "file_length": f.len_file,
            "image_digest": f.image_digest, "footer_checksum": f.footer_checksum}


def record_size(len_body: int) -> int:
    return RECORD_HEADER_SIZE + (len_body + 7) // 8 * 8 + RECORD_TRAILER_SIZE


def to_dump(image) -> dict:
    """The ``dump_structure()`` dict of a parsed ``Leanimg`` object.

    Kaitai does not keep positions, so record offsets are computed from the
    lengths the parser read: the first record starts at len_header.
    """
    records = []
    offset = image.header.len_header
    for rec in image.records:
        records.append({"offset": offset, "record_type": _int(rec.record_type), "flags": rec.flags,
                        "body_length": rec.len_body, "record_checksum": rec.record_checksum,
                        "body": _body(rec.record_type, rec.body)})
        offset += record_size(rec.len_body)
    return {"header": header_dump(image.header), "records": records, "footer": footer_dump(image.footer)}


def normalize(value):
    """Plain Python values: lists for sequences, ints for enums and numpy scalars."""
    if isinstance(value, dict):
        return {key: normalize(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [normalize(item) for item in value]
    if isinstance(value, (bytearray, memoryview, np.void)):
        return bytes(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, np.integer):
        return int(value)
    return value
