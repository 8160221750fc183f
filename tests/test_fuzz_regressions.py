"""Inputs the fuzzer once crashed the reader or validator with: now clean errors only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from leanimg.errors import LeanImageError

ROOT = Path(__file__).resolve().parents[1]
REGRESSIONS = sorted((ROOT / "fuzz" / "regressions").glob("*.lean"))


def _harness():
    spec = importlib.util.spec_from_file_location("fuzz_reader", ROOT / "fuzz" / "fuzz_reader.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regression_inputs_exist():
    assert len(REGRESSIONS) >= 10


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: p.name)
def test_regression_input_gives_only_lean_image_errors(path, tmp_path):
    harness = _harness()
    target = tmp_path / "input.lean"
    for data in (path.read_bytes(), harness.fix_checksums(path.read_bytes())):
        target.write_bytes(data)
        try:
            harness.exercise(str(target))
        except LeanImageError:
            pass
