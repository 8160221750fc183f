"""A lean image writer in another language: spec/guides/examples/minimal_writer.c, compiled
with gcc against libzstd and libxxhash (Debian: libzstd-dev, libxxhash-dev; .ci/install),
writes images that `leanimg validate` finds clean, that restore to the memory it was given,
and that the parser generated from ksy/leanimg.ksy reads exactly as leanimg's reader does."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from leanimg.cli import command_line

SOURCE = Path(__file__).resolve().parent.parent / "spec" / "guides" / "examples" / "minimal_writer.c"
PS = 4096
FRAME_PAGES = 512  # the C writer's frame size


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    """The C writer, built as the guide says (with warnings as errors)."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is not installed (.ci/install installs it)")
    binary = tmp_path_factory.mktemp("c-writer") / "minimal_writer"
    proc = subprocess.run(
        ["gcc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(SOURCE), "-lzstd", "-lxxhash"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"gcc failed (are libzstd-dev and libxxhash-dev installed?):\n{proc.stderr}"
    return binary


def guest_memory(num_pages: int, seed: int) -> np.ndarray:
    """Pages of random bytes, every third page all zero, page 7 (if any) one repeated byte."""
    rng = np.random.default_rng(seed)
    pages = rng.integers(0, 256, (num_pages, PS), dtype=np.uint8)
    pages[::3] = 0
    pages[7:8] = 0xAB
    return pages


def leanimg(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([*command_line(), *map(str, args)], capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc


# more pages than one frame holds, so stored ordinals continue across PAGE_FRAME records;
# free ranges inside a stored run, at the start, and over the end of the memory
@pytest.mark.parametrize(
    "num_pages,free",
    [
        (FRAME_PAGES + 90, [(5, 2), (300, 40)]),
        (3, []),
        (40, [(0, 1), (38, 2)]),
    ],
)
def test_the_c_writer_writes_valid_images(writer, tmp_path, num_pages, free):
    pages = guest_memory(num_pages, seed=num_pages)
    memory, image, raw = tmp_path / "mem.raw", tmp_path / "vm.lean", tmp_path / "vm.raw"
    memory.write_bytes(pages.tobytes())
    subprocess.run([str(writer), str(memory), str(image), *(f"{a}+{n}" for a, n in free)], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.raw", "vm.lean"]  # no .partial left

    report = json.loads(leanimg("validate", "--json", image).stdout)
    assert report["valid"] and report["findings"] == [], report

    classes = np.where(pages.any(axis=1), 1, 2)  # STORED, ZERO
    for first, count in free:
        classes[first : first + count] = 3  # FREE
    summary = json.loads(leanimg("inspect", "--json", image).stdout)
    counts = Counter(summary["classes"])
    assert (counts["STORED"], counts["ZERO"], counts["FREE"]) == tuple(int((classes == k).sum()) for k in (1, 2, 3))

    leanimg("restore", image, "--to", "raw", "-o", raw)
    expected = pages.copy()
    expected[classes == 3] = 0  # FREE pages restore as zero bytes
    assert raw.read_bytes() == expected.tobytes()


def test_the_c_writer_streams_to_stdout(writer, tmp_path):
    memory, image = tmp_path / "mem.raw", tmp_path / "piped.lean"
    pages = guest_memory(20, seed=1)
    memory.write_bytes(pages.tobytes())
    with open(image, "wb") as out:
        subprocess.run([str(writer), str(memory), "-", "2+3"], stdout=out, check=True)
    assert json.loads(leanimg("validate", "--json", image).stdout)["valid"]
    restored = leanimg("restore", image, "--to", "raw", "-o", "-").stdout
    pages[2:5] = 0
    assert restored == pages.tobytes()


def test_the_c_writer_refuses_bad_input_without_output(writer, tmp_path):
    memory, image = tmp_path / "mem.raw", tmp_path / "vm.lean"
    memory.write_bytes(bytes(PS + 1))
    proc = subprocess.run([str(writer), str(memory), str(image)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == f"minimal_writer: error: {memory}: {PS + 1} bytes is not a non-zero multiple of {PS}\n"
    assert not image.exists() and not (tmp_path / "vm.lean.partial").exists()


@pytest.mark.kaitai
def test_the_kaitai_parser_reads_the_c_writers_image_as_leanimg_does(writer, tmp_path_factory):
    import kaitai_support as ks
    from test_kaitai import check_image

    parser = ks.generated_parser_for_tests(tmp_path_factory.mktemp("kaitai"))
    tmp_path = tmp_path_factory.mktemp("c-kaitai")
    memory, image = tmp_path / "mem.raw", tmp_path / "vm.lean"
    memory.write_bytes(guest_memory(FRAME_PAGES + 10, seed=2).tobytes())
    subprocess.run([str(writer), str(memory), str(image), "1+4"], check=True)
    check_image(parser.Leanimg, image)
