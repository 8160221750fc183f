"""A short run of the reader fuzz harness (fuzz/fuzz_reader.py): it must find nothing.

Long runs: LEANIMG_FUZZ_RUNS=N python fuzz/fuzz_reader.py CORPUS_DIR (see the harness).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_reader.py"
SMOKE_RUNS = 2000


def test_fuzz_reader_smoke(tmp_path):
    if importlib.util.find_spec("atheris") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("atheris is not installed; the fuzz smoke test must run in CI")
        pytest.skip("atheris is not installed")
    env = dict(os.environ, LEANIMG_FUZZ_RUNS=str(SMOKE_RUNS))
    env.pop("LEANIMG_FUZZ_CRASH_DIR", None)  # stop at the first bug
    result = subprocess.run(
        [sys.executable, str(HARNESS), "-seed=1", f"-artifact_prefix={tmp_path}/"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    stderr = result.stderr or ""
    start = stderr.find("=== Uncaught Python exception")
    tail = stderr[start:] if start >= 0 else stderr[-4000:]
    assert result.returncode == 0, f"fuzz harness exited {result.returncode}:\n{tail}"
    assert f"Done {SMOKE_RUNS} " in result.stderr, tail


STREAM_SMOKE_RUNS = 300


@pytest.mark.parametrize("harness", ["fuzz_qemu.py", "fuzz_xen.py", "fuzz_hints.py", "fuzz_libvirt.py"])
def test_fuzz_stream_harness_smoke(harness, tmp_path):
    """The QEMU and Xen stream harnesses (readers, conversion, restore round trip) and the hint
    harness on their seeds (fuzz/make_stream_corpus.py, the hint vectors) and a few hundred
    mutations: nothing found."""
    if importlib.util.find_spec("atheris") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("atheris is not installed; the fuzz smoke test must run in CI")
        pytest.skip("atheris is not installed")
    env = dict(os.environ, LEANIMG_FUZZ_RUNS=str(STREAM_SMOKE_RUNS))
    env.pop("LEANIMG_FUZZ_CRASH_DIR", None)  # stop at the first bug
    result = subprocess.run(
        [sys.executable, str(HARNESS.parent / harness), "-seed=1", f"-artifact_prefix={tmp_path}/"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    stderr = result.stderr or ""
    start = stderr.find("=== Uncaught Python exception")
    tail = stderr[start:] if start >= 0 else stderr[-4000:]
    assert result.returncode == 0, f"fuzz harness exited {result.returncode}:\n{tail}"
    assert f"Done {STREAM_SMOKE_RUNS} " in result.stderr, tail
    assert "cov: " in result.stderr, tail
