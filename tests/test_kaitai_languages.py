"""The parsers generated from ksy/leanimg.ksy for Python, JavaScript and Java agree with
leanimg's reader.

Each language parses every valid test vector and two real converted images (the bundled
QEMU sample converted with its disk, and an incremental image of a changed copy with deltas);
each parse, turned into the dict shape of ``dump_structure()``, must equal our reader's
field by field (``kaitai_support.assert_agrees_with_reader``: one comparison for the three).
JavaScript and Java run under the drivers of spec/guides/examples/kaitai, once per language
for all images (one node and one JVM start per test run).

Needs node and npm, and for Java javac, java and mvn: without them the tests are skipped,
or fail when CI=true.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zstandard
from click.testing import CliRunner

import kaitai_support as ks
from leanimg.cli import main
from leanimg.format import PageClass
from leanimg.inspect import class_counts
from leanimg.reader import LeanImage
from test_chain import _changed_save

pytestmark = pytest.mark.kaitai

LANGUAGES = ("python", "javascript", "java")
VALID_VECTORS = sorted((ks.TESTS_DIR / "vectors" / "valid").glob("*.lean"))
SAMPLE_DIR = ks.REPO_DIR / "lean-image" / "sample"
REAL_IMAGES = ("sample-with-disk.lean", "sample-incremental.lean")
BAD_IMAGE = "wrong-magic.lean"


def _unzstd(source: Path, target: Path) -> Path:
    with open(source, "rb") as fin, open(target, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)
    return target


def _convert(*args) -> None:
    result = CliRunner().invoke(main, ["convert", *map(str, args)])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="session")
def real_images(tmp_path_factory) -> dict[str, Path]:
    """The bundled sample converted with its disk (DISK references), and an image of a changed
    copy converted against it (PARENT and DELTA pages, format 1.1); a copy with a wrong magic."""
    tmp = tmp_path_factory.mktemp("kaitai-real")
    save = _unzstd(SAMPLE_DIR / "vm.save.zst", tmp / "vm.save")
    disk = _unzstd(SAMPLE_DIR / "disk.img.zst", tmp / "disk.img")
    changed = tmp / "changed.save"
    _changed_save(save, changed)
    first, second = tmp / REAL_IMAGES[0], tmp / REAL_IMAGES[1]
    _convert(save, "-o", first, "--disk", f"vda={disk}")
    _convert(changed, "-o", second, "--parent", first)
    for path, classes in (
        (first, {PageClass.STORED, PageClass.ZERO, PageClass.DISK}),
        (second, {PageClass.PARENT, PageClass.DELTA}),
    ):
        with LeanImage.open_link(path) as image:
            counts = class_counts(image)
        assert all(counts[c] > 0 for c in classes), (path.name, counts)
    bad = tmp / BAD_IMAGE
    bad.write_bytes(b"\x89LEANIMX" + first.read_bytes()[8:])
    save.unlink()
    changed.unlink()
    return {path.name: path for path in (first, second, bad)}


@pytest.fixture(scope="session")
def images(real_images) -> dict[str, Path]:
    return {**{p.name: p for p in VALID_VECTORS}, **real_images}


class Parses:
    """Each language's parse of every image, made on first use (one driver run per language)."""

    def __init__(self, images: dict[str, Path], tmp_path_factory):
        self.images, self.tmp_path_factory, self.by_language = images, tmp_path_factory, {}

    def get(self, language: str, name: str):
        if language not in self.by_language:
            try:
                self.by_language[language] = self._parse_all(language)
            except BaseException as exc:  # a skip or a build failure: once, not per image
                self.by_language[language] = exc
        parsed = self.by_language[language]
        if isinstance(parsed, BaseException):
            raise parsed
        return parsed[self.images[name]]

    def _parse_all(self, language: str) -> dict:
        out_dir = self.tmp_path_factory.mktemp(f"kaitai-{language}")
        paths = list(self.images.values())
        if language == "python":
            Leanimg = ks.generated_parser_for_tests(out_dir).Leanimg
            return {path: _python_parse(Leanimg, path) for path in paths}
        return ks.driver_parser_for_tests(language, out_dir).parse(paths)


def _python_parse(Leanimg, path: Path):
    try:
        return Leanimg.from_file(os.fspath(path))
    except Exception as exc:  # the generated parser's errors share no base class but Exception
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="session")
def parses(images, tmp_path_factory) -> Parses:
    return Parses(images, tmp_path_factory)


def test_vectors_and_real_images_present():
    assert len(VALID_VECTORS) >= 20, "tests/vectors/valid/*.lean: vectors missing"
    names = {p.name for p in VALID_VECTORS}
    assert {"optional-record.lean", "source-state-private.lean", "v11-child-delta.lean"} <= names


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("name", [p.name for p in VALID_VECTORS] + list(REAL_IMAGES))
def test_parser_agrees_with_reader(parses, images, language, name):
    parsed = parses.get(language, name)
    assert not isinstance(parsed, str), f"the {language} parser refused {name}: {parsed}"
    ks.assert_agrees_with_reader(parsed, images[name], doubles=language == "javascript")


@pytest.mark.parametrize("language", LANGUAGES)
def test_parser_refuses_wrong_magic(parses, language):
    parsed = parses.get(language, BAD_IMAGE)
    assert isinstance(parsed, str) and "ValidationNotEqualError" in parsed, parsed


def test_javascript_u8_fields_are_doubles(parses, images):
    """What the guide warns of: a checksum above 2^53 comes out of the JavaScript parser rounded
    to a double; the Java parser has it exactly."""
    name = REAL_IMAGES[0]
    exact = [rec.record_checksum for rec in parses.get("python", name).records]
    big = [k for k, value in enumerate(exact) if value > 2**53 and value != int(float(value))]
    assert big, "no record checksum of the sample is inexact as a double"
    js = [rec.record_checksum for rec in parses.get("javascript", name).records]
    java = [rec.record_checksum for rec in parses.get("java", name).records]
    assert java == exact
    assert js == [int(float(value)) for value in exact] and js != exact
