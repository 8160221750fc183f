"""Compile ksy/leanimg.ksy with the Kaitai Struct compiler to Python, JavaScript and Java,
and run the generated parsers.

The compiler and the JavaScript runtime come from npm (kaitai-struct-compiler and
kaitai-struct, run by node). They are looked for in ``$LEANIMG_KSC_DIR`` (an npm prefix
holding ``node_modules``), by default ``~/.cache/leanimg/ksc``, and installed there with npm
when missing; the Java runtime jar (Maven Central) is copied by Maven into its ``java/``.

The Python parser is imported; the JavaScript and Java ones run under the drivers of
spec/guides/examples/kaitai, which print every field as JSON (one process for many files),
read back here as attribute objects shaped like the Python parser's (``from_json``).
``to_dump()`` turns either into the dict shape of ``leanimg.reader.dump_structure()``, and
``assert_same_structure()`` compares the two, for all three languages alike.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from leanimg import format as fmt
from leanimg.structures import dump_structure

KSC_VERSION = "0.11.0"
JS_RUNTIME_VERSION = "0.11.0"  # npm kaitai-struct
JAVA_RUNTIME = "io.kaitai:kaitai-struct-runtime:0.11"  # Maven Central
NPM_PACKAGES = (f"kaitai-struct-compiler@{KSC_VERSION}", "js-yaml", f"kaitai-struct@{JS_RUNTIME_VERSION}")
TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
KSY_PATH = REPO_DIR / "ksy" / "leanimg.ksy"
COMPILE_SCRIPT = TESTS_DIR / "kaitai_compile.js"
DRIVERS_DIR = REPO_DIR / "spec" / "guides" / "examples" / "kaitai"
# what the compiler writes for each target language
GENERATED_FILE = {"python": "leanimg.py", "javascript": "Leanimg.js", "java": "Leanimg.java"}
# The generated module is named after meta/id, "leanimg", like our package:
# it is imported under this name so that it never shadows the real one.
GENERATED_MODULE_NAME = "leanimg_kaitai_generated"


class KaitaiUnavailable(RuntimeError):
    """A tool is not installed (node, npm; for Java javac, java, mvn), so a parser cannot run."""


class KaitaiCompileError(RuntimeError):
    """The compiler (or npm installing it) failed; the message carries its output."""


def ksc_dir() -> Path:
    configured = os.environ.get("LEANIMG_KSC_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "leanimg" / "ksc"


def _npm_version(modules: Path, package: str) -> str | None:
    try:
        return json.loads((modules / package / "package.json").read_text()).get("version")
    except (OSError, ValueError):
        return None


def _installed(prefix: Path) -> bool:
    """The prefix holds js-yaml and exactly the compiler and runtime versions this project uses."""
    modules = prefix / "node_modules"
    return (
        _npm_version(modules, "kaitai-struct-compiler") == KSC_VERSION
        and _npm_version(modules, "kaitai-struct") == JS_RUNTIME_VERSION
        and (modules / "js-yaml" / "package.json").is_file()
    )


def _run(argv: list[str], what: str, timeout: int) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise KaitaiCompileError(f"{what} timed out after {timeout} s: {' '.join(argv)}") from exc
    if proc.returncode != 0:
        raise KaitaiCompileError(
            f"{what} failed with exit status {proc.returncode}: {' '.join(argv)}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
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
    _run(
        [npm, "install", "--no-audit", "--no-fund", "--save-exact", "--prefix", str(prefix), *NPM_PACKAGES],
        f"npm install into {prefix}",
        timeout=600,
    )
    if not _installed(prefix):
        raise KaitaiCompileError(
            f"npm install reported success but {prefix}/node_modules lacks "
            f"kaitai-struct-compiler {KSC_VERSION}, kaitai-struct {JS_RUNTIME_VERSION} "
            "or js-yaml"
        )
    return prefix


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise KaitaiUnavailable(f"{name} is not on PATH: cannot build and run the Java parser")
    return path


def ensure_java_runtime() -> Path:
    """The runtime jar, copied by Maven from Maven Central into the compiler's prefix if missing."""
    _, artifact, version = JAVA_RUNTIME.split(":")
    directory = ksc_dir() / "java"
    jar = directory / f"{artifact}-{version}.jar"
    if not jar.is_file():
        _run(
            [
                _tool("mvn"),
                "-q",
                "-B",
                "-Dstyle.color=never",
                "dependency:copy",
                f"-Dartifact={JAVA_RUNTIME}",
                f"-DoutputDirectory={directory}",
            ],
            f"mvn copying {JAVA_RUNTIME}",
            timeout=600,
        )
        if not jar.is_file():
            raise KaitaiCompileError(f"mvn dependency:copy reported success but {jar} is missing")
    return jar


def compile_ksy(out_dir: Path, ksy: Path = KSY_PATH, target: str = "python") -> Path:
    """Compile ``ksy`` to ``target`` (python, javascript, java) into ``out_dir``; return the
    generated file."""
    prefix = ensure_compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = _run(
        [shutil.which("node") or "node", str(COMPILE_SCRIPT), str(prefix), str(ksy), str(out_dir), target],
        f"kaitai-struct-compiler -t {target} on {ksy}",
        timeout=300,
    )
    names = proc.stdout.split()
    if names != [GENERATED_FILE[target]]:
        raise KaitaiCompileError(
            f"expected the compiler to write {GENERATED_FILE[target]}, it wrote {names!r}\n"
            f"--- stderr ---\n{proc.stderr}"
        )
    return out_dir / names[0]


def load_generated(path: Path):
    """Import a generated parser module from ``path`` under a private name."""
    spec = importlib.util.spec_from_file_location(GENERATED_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[GENERATED_MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module


def _skip_or_fail(exc: KaitaiUnavailable):
    """Skip the test when a tool is missing, except in CI (CI=true), where that is a failure."""
    import pytest

    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true but a generated Kaitai parser cannot run: {exc}")
    pytest.skip(str(exc))


def generated_parser_for_tests(out_dir: Path):
    """The generated parser module, compiled into ``out_dir``; the test is skipped when the
    compiler cannot run, except in CI (CI=true), where that is a failure."""
    try:
        path = compile_ksy(out_dir)
    except KaitaiUnavailable as exc:
        _skip_or_fail(exc)
    return load_generated(path)


# --- the JavaScript and Java parsers, run by their drivers ---------------------------


class DriverParser:
    """A generated parser in another language, run by its driver over many images at once
    (one node or JVM start per call); ``parse()`` returns, per image, the parsed object
    (from_json) or the error text the driver printed."""

    language = ""

    def command(self, images: list[Path]) -> tuple[list[str], dict]:
        raise NotImplementedError

    def parse(self, images: list[Path]) -> dict[Path, object]:
        argv, env = self.command(images)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
        except subprocess.TimeoutExpired as exc:
            raise KaitaiCompileError(f"the {self.language} driver timed out: {' '.join(argv)}") from exc
        lines = [json.loads(line) for line in proc.stdout.splitlines()]
        if [line["file"] for line in lines] != [os.fspath(p) for p in images]:
            raise KaitaiCompileError(
                f"the {self.language} driver (exit status {proc.returncode}) printed "
                f"{len(lines)} lines for {len(images)} images\n--- stderr ---\n{proc.stderr}"
            )
        if (proc.returncode != 0) != any("error" in line for line in lines):
            raise KaitaiCompileError(
                f"the {self.language} driver's exit status {proc.returncode} disagrees "
                f"with its lines\n--- stderr ---\n{proc.stderr}"
            )
        return {
            path: line["error"] if "error" in line else from_json(line["leanimg"]) for path, line in zip(images, lines)
        }


class JavaScriptParser(DriverParser):
    language = "javascript"

    def __init__(self, out_dir: Path):
        self.prefix = ensure_compiler()
        self.generated = compile_ksy(out_dir, target="javascript")

    def command(self, images):
        return (
            [
                shutil.which("node") or "node",
                str(DRIVERS_DIR / "dump.js"),
                str(self.generated.parent),
                *map(str, images),
            ],
            {"NODE_PATH": str(self.prefix / "node_modules")},
        )


class JavaParser(DriverParser):
    language = "java"

    def __init__(self, out_dir: Path):
        javac, self.java = _tool("javac"), _tool("java")
        self.jar = ensure_java_runtime()
        generated = compile_ksy(out_dir, target="java")
        self.classes = out_dir / "classes"
        _run(
            [
                javac,
                "-nowarn",
                "-cp",
                str(self.jar),
                "-d",
                str(self.classes),
                str(generated),
                str(DRIVERS_DIR / "LeanimgDump.java"),
            ],
            "javac on the generated Java parser",
            timeout=600,
        )

    def command(self, images):
        classpath = os.pathsep.join([str(self.classes), str(self.jar)])
        return [self.java, "-cp", classpath, "LeanimgDump", *map(str, images)], {}


DRIVER_PARSERS = {"javascript": JavaScriptParser, "java": JavaParser}


def driver_parser_for_tests(language: str, out_dir: Path) -> DriverParser:
    """The ``language`` parser, compiled and built into ``out_dir``; skipped when a tool is
    missing, except in CI (CI=true), where that is a failure."""
    try:
        return DRIVER_PARSERS[language](out_dir)
    except KaitaiUnavailable as exc:
        _skip_or_fail(exc)


@dataclass(frozen=True)
class LongBytes:
    """A byte string longer than SHORT_BYTES, as the drivers print it: its size and SHA-256."""

    size: int
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> "LongBytes":
        return cls(len(data), hashlib.sha256(data).hexdigest())


SHORT_BYTES = 64


def from_json(value):
    """A driver's JSON as the Python parser's objects: a struct (``_type``) as an object with an
    attribute per field, bytes ({"hex"} or {"size", "sha256"}) as bytes or LongBytes."""
    if isinstance(value, list):
        return [from_json(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "_type" in value:
        return SimpleNamespace(**{key: from_json(item) for key, item in value.items()})
    if "hex" in value:
        return bytes.fromhex(value["hex"])
    return LongBytes(value["size"], value["sha256"])


# --- Kaitai object -> dump_structure() dict -----------------------------------
# Generic over the declarations of leanimg.format: the .ksy names every field as they do
# (tests/test_format.py checks that), so no field is renamed or listed here.


def _int(value) -> int:
    """An enum field as its number (an unknown value is already a plain int)."""
    return value.value if isinstance(value, enum.Enum) else int(value)


def _field_value(obj, field):
    raw = getattr(obj, "_raw_" + field.name, None)  # a sized field parsed as a type: its bytes
    value = raw if raw is not None else getattr(obj, field.name)
    element = field.element
    if element in fmt.STRUCTURES:
        return [structure_dump(item, fmt.STRUCTURES[element]) for item in value]
    if field.type in ("b[]", "b[8]") and isinstance(value, list):
        return bytes(value)  # a u1 repeat (padding, extension)
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
        assert isinstance(record.body, (bytes, LongBytes)), (
            f"record type {dump['record_type']:#x} parsed into {type(record.body).__name__}, expected raw bytes"
        )
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
    return {
        "header": structure_dump(image.header, fmt.HEADER),
        "records": records,
        "footer": structure_dump(image.footer, fmt.FOOTER),
    }


def comparable(value, doubles: bool = False):
    """``normalize(value)`` with byte strings longer than SHORT_BYTES as LongBytes (as the drivers
    print them) and, with ``doubles``, every integer as the nearest double holds it: the
    JavaScript runtime reads a u8 into a double, exact only up to 2^53."""
    value = normalize(value)
    if isinstance(value, dict):
        return {key: comparable(item, doubles) for key, item in value.items()}
    if isinstance(value, list):
        return [comparable(item, doubles) for item in value]
    if isinstance(value, bytes) and len(value) > SHORT_BYTES:
        return LongBytes.of(value)
    if doubles and isinstance(value, int) and not isinstance(value, bool):
        return int(float(value))
    return value


def assert_same_structure(got: dict, want: dict, doubles: bool = False) -> None:
    """Field-by-field equality of two dump_structure() dicts (``got`` from a generated parser,
    ``want`` from our reader), failing on the first differing part with its path."""
    got, want = comparable(got), comparable(want, doubles)
    assert got.keys() == want.keys()
    assert got["header"] == want["header"], "header differs"
    assert len(got["records"]) == len(want["records"]), "number of records differs"
    for i, (mine, ours) in enumerate(zip(got["records"], want["records"])):
        assert mine == ours, f"record {i} at offset {ours.get('offset')} differs"
    assert got["footer"] == want["footer"], "footer differs"


def assert_agrees_with_reader(image, path, doubles: bool = False) -> None:
    """``image``, a generated parser's parse of ``path``, holds every field our reader reads, with
    the same values; the footer read from the end of the file is the footer."""
    assert_same_structure(to_dump(image), dump_structure(path), doubles)
    assert structure_dump(image.footer_at_end, fmt.FOOTER) == structure_dump(image.footer, fmt.FOOTER)


def normalize(value):
    """Plain Python values: lists for sequences, ints for enums and numpy scalars."""
    if isinstance(value, dict):
        return {key: normalize(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [normalize(item) for item in value]
    if isinstance(value, (bytearray, memoryview, np.void)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")  # names: str in Kaitai, UTF-8 in the file
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, np.integer):
        return int(value)
    return value
