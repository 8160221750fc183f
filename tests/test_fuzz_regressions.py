"""Inputs the fuzzer once crashed the reader or validator with: now clean errors only."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
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


# Stream inputs: fuzz/regressions/*.qemu replayed by fuzz/fuzz_qemu.py, *.xen by fuzz/fuzz_xen.py,
# *.libvirt by fuzz/fuzz_libvirt.py
# (the whole harness check: readers, conversion, restore round trip), in a subprocess under
# the 512 MiB address-space cap of issue 16 §5, so an unbounded allocation fails the test.
STREAM_HARNESSES = {"qemu": "fuzz_qemu.py", "xen": "fuzz_xen.py", "libvirt": "fuzz_libvirt.py"}
REPLAY_MEM_MB = 512


def _stream_regressions():
    return [
        (kind, path) for kind in STREAM_HARNESSES for path in sorted((ROOT / "fuzz" / "regressions").glob(f"*.{kind}"))
    ]


@pytest.mark.parametrize("kind,path", _stream_regressions(), ids=lambda v: getattr(v, "name", v))
def test_stream_regression_input_gives_only_lean_image_errors(kind, path, tmp_path):
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (the harness imports it)")
    env = dict(os.environ, LEANIMG_FUZZ_MEM_MB=str(REPLAY_MEM_MB))
    env.pop("LEANIMG_FUZZ_CRASH_DIR", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "fuzz" / STREAM_HARNESSES[kind]), "--replay", str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "1 inputs, 0 raised" in result.stderr
