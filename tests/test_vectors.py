"""The conformance vectors of tests/vectors (made by tests/vectors/make_vectors.py).

Valid vectors validate clean and restore to their recorded sha256; each invalid
vector is reported with its rule (and nothing but the rules it may also trigger);
every rule has a vector, every rule is in the spec; the generator is deterministic.
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import importlib.util
import io
import json
import re
import struct
import sys

import pytest

from helpers import VECTORS_DIR, make_vectors, restore_bytes, validate_with_disks
from leanimg.format import DIGESTS_BODY, PageClass, RecordType, page_digest
from leanimg.rules import RULES
from leanimg.validate import validate

SPEC_DIR = VECTORS_DIR.parent.parent / "spec"
META = json.loads((VECTORS_DIR / "vectors.json").read_text())["vectors"]
VALID = sorted(k for k, m in META.items() if m["kind"] == "valid")
INVALID = sorted(k for k, m in META.items() if m["kind"] == "invalid")


def _args(meta: dict) -> dict:
    return dict(
        disks={name: str(VECTORS_DIR / p) for name, p in meta["disks"].items()},
        parents=[str(VECTORS_DIR / p) for p in meta["parents"]],
    )


def _findings(rel: str):
    return validate_with_disks(VECTORS_DIR / rel, **_args(META[rel])).findings


def test_vector_files_match_json():
    on_disk = {str(p.relative_to(VECTORS_DIR)) for sub in ("valid", "invalid") for p in (VECTORS_DIR / sub).iterdir()}
    assert on_disk == set(META)


@pytest.mark.parametrize("rel", VALID)
def test_valid_vector_validates_clean(rel):
    findings = _findings(rel)
    assert findings == [], [str(f) for f in findings]


@pytest.mark.parametrize("rel", VALID)
def test_valid_vector_restores(rel):
    meta = META[rel]
    raw = restore_bytes(VECTORS_DIR / rel, **_args(meta))
    assert len(raw) == meta["raw_size"]
    assert hashlib.sha256(raw).hexdigest() == meta["raw_sha256"]


@pytest.mark.parametrize("rel", INVALID)
def test_invalid_vector_reports_its_rule(rel):
    meta = META[rel]
    findings = _findings(rel)
    assert meta["rule"] in {f.rule for f in findings}, (
        f"{rel}: {meta['description']}; expected {meta['rule']}, got " + "; ".join(map(str, findings))
    )


@pytest.mark.parametrize("rel", INVALID)
def test_invalid_vector_reports_nothing_else(rel):
    """Each vector breaks one rule; only known follow-on rules may appear besides it."""
    meta = META[rel]
    allowed = {meta["rule"], *meta["also_reported"]}
    findings = _findings(rel)
    extra = [str(f) for f in findings if f.rule not in allowed]
    assert not extra, f"{rel}: unexpected findings {extra}"


@pytest.mark.parametrize("rel", INVALID)
def test_invalid_vector_findings_located(rel):
    """The tagged finding carries a structure path and a message."""
    meta = META[rel]
    for f in _findings(rel):
        if f.rule == meta["rule"]:
            assert f.message
            assert f.rule in RULES or f.rule == "LI-IO"


def test_every_rule_has_an_invalid_vector():
    covered = {META[k]["rule"] for k in INVALID}
    assert set(RULES) - covered == set()
    assert covered - set(RULES) == set(), "vectors tagged with unknown rule ids"


@pytest.mark.parametrize("doc", ["format.md", "conformance.md"])
def test_every_rule_is_in_the_spec(doc):
    path = SPEC_DIR / doc
    assert path.exists(), f"{path} missing"
    text = path.read_text()
    missing = [rule for rule in RULES if not re.search(re.escape(rule) + r"(?!\d)", text)]
    assert not missing, f"rules not mentioned in spec/{doc}: {missing}"


def test_generator_is_deterministic(tmp_path):
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS_DIR / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    module.generate(tmp_path)
    for rel in sorted(META) + ["vectors.json"]:
        assert filecmp.cmp(VECTORS_DIR / rel, tmp_path / rel, shallow=False), f"{rel} differs when regenerated"
    regenerated = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert regenerated == set(META) | {"vectors.json"}


def test_vectors_are_small():
    total = sum((VECTORS_DIR / rel).stat().st_size for rel in META) + (VECTORS_DIR / "vectors.json").stat().st_size
    assert total < 500 * 1024


@pytest.mark.parametrize("rel", VALID)
def test_valid_vector_digests_only_for_digest_bearing_pages(rel):
    """Independently of the validator: each DIGESTS record holds, in page order, the digests of
    exactly the STORED, DISK, PARENT and DELTA pages of its range (spec §6.5; no PARENT pages in
    a 1.1 image with INHERITED_DIGESTS), and they are the digests of the restored content."""
    mv = make_vectors()
    data = (VECTORS_DIR / rel).read_bytes()
    lean = mv.Lean.parse(data)
    page_size = struct.unpack_from("<I", data, 88)[0]
    inherited = struct.unpack_from("<Q", data, 16)[0] & mv.INHERITED_DIGESTS  # 1.1: PARENT digests inherited
    digest_bearing = mv.DIGEST_BEARING - ({PageClass.PARENT} if inherited else set())
    raw = restore_bytes(VECTORS_DIR / rel, **_args(META[rel]))
    base = 0
    for region in [r for r in lean.records if r.type == RecordType.REGION]:
        region_id, size = struct.unpack_from("<I", region.body)[0], struct.unpack_from("<Q", region.body, 16)[0]
        classes = mv.page_classes(lean, region_id)
        assert len(classes) == size // page_size
        covered = 0
        for rec in lean.records:
            if rec.type != RecordType.DIGESTS or DIGESTS_BODY.struct.unpack_from(rec.body)[0] != region_id:
                continue
            _, num_digests, first, num_pages = DIGESTS_BODY.struct.unpack_from(rec.body)
            assert first == covered and num_pages >= 1
            bearing = [p for p in range(first, first + num_pages) if classes[p] in digest_bearing]
            assert num_digests == len(bearing)
            assert len(rec.body) == DIGESTS_BODY.struct.size + 16 * num_digests
            for k, p in enumerate(bearing):
                content = raw[base + p * page_size : base + (p + 1) * page_size]
                assert rec.body[24 + 16 * k : 40 + 16 * k] == page_digest(content), (region_id, p)
            covered += num_pages
        assert covered == len(classes)
        base += size


# --- spec/format.md Appendix A ------------------------------------------------------------------


def _run_make_examples(*argv) -> str:
    spec = importlib.util.spec_from_file_location("make_examples", SPEC_DIR / "tools" / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(list(argv)) == 0
    return out.getvalue()


def test_spec_appendix_is_what_make_examples_prints():
    text = (SPEC_DIR / "format.md").read_text()
    generated = _run_make_examples().strip("\n")
    assert generated in text, "spec/format.md Appendix A differs from spec/tools/make_examples.py's output"


def test_spec_example_image_is_valid(tmp_path):
    """The complete image of Appendix A.5 validates clean and restores to its two 0xAB pages."""
    path = tmp_path / "example.lean"
    _run_make_examples("-o", str(path))
    findings = validate(path).findings
    assert findings == [], [str(f) for f in findings]
    assert restore_bytes(path) == b"\xab" * 8192 + bytes(254 * 4096)
