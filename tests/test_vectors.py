"""The conformance vectors of tests/vectors (made by tests/vectors/make_vectors.py).

Valid vectors validate clean and restore to their recorded sha256; each invalid
vector is reported with its rule (and nothing but the rules it may also trigger);
every rule has a vector, every rule is in the spec; the generator is deterministic.
"""

from __future__ import annotations

import filecmp
import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from helpers import VECTORS_DIR, restore_bytes
from leanimg.rules import RULES
from leanimg.validate import validate

SPEC_DIR = VECTORS_DIR.parent.parent / "spec"
META = json.loads((VECTORS_DIR / "vectors.json").read_text())["vectors"]
VALID = sorted(k for k, m in META.items() if m["kind"] == "valid")
INVALID = sorted(k for k, m in META.items() if m["kind"] == "invalid")


def _args(meta: dict) -> dict:
    return dict(disks={name: str(VECTORS_DIR / p) for name, p in meta["disks"].items()},
                parents=[str(VECTORS_DIR / p) for p in meta["parents"]])


def _findings(rel: str):
    return validate(VECTORS_DIR / rel, **_args(META[rel])).findings


def test_vector_files_match_json():
    on_disk = {str(p.relative_to(VECTORS_DIR)) for sub in ("valid", "invalid")
               for p in (VECTORS_DIR / sub).iterdir()}
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
    assert meta["rule"] in {f.rule for f in findings}, \
        f"{rel}: {meta['description']}; expected {meta['rule']}, got " + "; ".join(map(str, findings))


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
    sys.modules[spec.name] = module          # dataclasses look their module up
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
