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

from leanimg import format as fmt

KSC_VERSION = "0.11.0"
NPM_PACKAGES = (f"kaitai-struct-compiler@{KSC_VERSION}", "js-yaml")
TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
KSY_PATH = REPO_DIR / "ksy" / "leanimg.ksy"
COMPILE_SCRIPT = TESTS_DIR / "kaitai_compile.js"
# The generated module is named after meta/id, "leanimg", like our package:
# it is imported under this name so that it never shadows the real one.
GENERATED_MODULE_NAME = "leanimg_kaitai_generated"


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
# Generic over the declarations of leanimg.format: the .ksy names every field as they do
# (tests/test_format.py checks that), so no field is renamed or listed here.

def _int(value) -> int:
    """An enum field as its number (an unknown value is already a plain int)."""
    return value.value if isinstance(value, enum.Enum) else int(value)


def _field_value(obj, field):
    raw = getattr(obj, "_raw_" + field.name, None)      # a sized field parsed as a type: its bytes
    value = raw if raw is not None else getattr(obj, field.name)
    element = field.element
    if element in fmt.STRUCTURES:
        return [structure_dump(item, fmt.STRUCTURES[element]) for item in value]
    if field.type in ("b[]", "b[8]") and isinstance(value, list):
        return bytes(value)                             # a u1 repeat (padding, extension)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def structure_dump(obj, structure) -> dict:
    """Every field ``structure`` declares, read from the Kaitai object ``obj``."""
    return {f.name: _field_value(obj, f) for f in structure.fields}


def _record_dump(record, offset: int) -> dict:
    dump = {"offset": offset}
    for field in fmt.RECORD.fields:
        if field.name != "body":
            dump[field.name] = _field_value(record, field)
    dump["record_type"] = _int(record.record_type)
    body = fmt.BODY_OF.get(dump["record_type"])
    if body is None:
        assert isinstance(record.body, bytes), f"record type {dump['record_type']:#x} parsed into " \
            f"{type(record.body).__name__}, expected raw bytes"
    dump["body"] = structure_dump(record.body, body) if body else record.body
    return dump


def to_dump(image) -> dict:
    """The ``dump_structure()`` dict of a parsed ``Leanimg`` object.

    Kaitai does not keep positions, so record offsets are computed from the
    lengths the parser read: the first record starts at header_length.
    """
    records = []
    offset = image.header.header_length
    for rec in image.records:
        records.append(_record_dump(rec, offset))
        offset += fmt.record_size(rec.body_length)
    return {"header": structure_dump(image.header, fmt.HEADER), "records": records,
            "footer": structure_dump(image.footer, fmt.FOOTER)}


def normalize(value):
    """Plain Python values: lists for sequences, ints for enums and numpy scalars."""
    if isinstance(value, dict):
        return {key: normalize(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [normalize(item) for item in value]
    if isinstance(value, (bytearray, memoryview, np.void)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")                    # names: str in Kaitai, UTF-8 in the file
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, np.integer):
        return int(value)
    return value
