"""A command's start stays short (issue 34 §5; benchmarks/bench_startup.py measures it): what
`leanimg --help`, `leanimg CMD --help` and the commands on a small image import, checked by
name (no timing). A help imports the command line alone; a command imports numpy and the
reader when it opens an image, never what it does not use (object storage clients, plugin
metadata, the writer, the converters)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import qemu_save
from leanimg.cli import COMMANDS, command_line

# Runs the command line in-process, then lists the modules it imported (those the interpreter's
# own start-up imported, e.g. by a site .pth file, are not counted).
PROBE = """
import sys
before = set(sys.modules)
from leanimg.cli import main
try:
    main(sys.argv[2:], prog_name="leanimg")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open(sys.argv[1], "w") as f:
    f.write(f"{code}\\n" + "\\n".join(sorted(set(sys.modules) - before)))
"""

# What a help leaves alone: modules that cost milliseconds each to import (numpy ~35 ms)
HEAVY = (
    "numpy",
    "zstandard",
    "xxhash",
    "boto3",
    "botocore",
    "obstore",
    "qemu",
    "asyncio",
    "concurrent.futures",
    "importlib.metadata",
    "hashlib",
    "subprocess",
    "json",
)
# the leanimg modules a help may import: the command line, and what the group checks at start
# (LEANIMG_NATIVE, LEANIMG_CROSS_CHECK)
COMMAND_LINE = {"leanimg", "leanimg.cli", "leanimg.output", "leanimg.errors", "leanimg.commands"}
CHECKED_AT_START = {"leanimg.fast_paths", "leanimg.rules", "leanimg.native", "leanimg._native"}
# never imported by a command on a local image (numpy.ma: np.unique and np.setdiff1d import it, ~8 ms)
NEVER_FOR_A_LOCAL_IMAGE = (
    "boto3",
    "botocore",
    "obstore",
    "qemu",
    "asyncio",
    "importlib.metadata",
    "hashlib",
    "numpy.ma",
)
# nor by one that only reads it (nor the disk sources, unless --disk is given)
WRITERS = ("leanimg.writer", "leanimg.converters", "leanimg.disks")


def imported(tmp_path, *args) -> set[str]:
    """The modules `leanimg ARGS` imports (it must exit 0)."""
    listing = tmp_path / "modules.txt"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, listing, *map(str, args)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )
    code, *modules = listing.read_text().splitlines()
    assert code in ("0", "None"), proc.stderr.decode(errors="replace")
    return set(modules)


def within(modules: set[str], names) -> set[str]:
    """The modules of ``modules`` that are one of ``names`` or inside one of them."""
    return {m for m in modules if any(m == n or m.startswith(n + ".") for n in names)}


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_imports_the_command_line_alone(command, tmp_path):
    args = ["--help"] if command is None else [command, "--help"]
    modules = imported(tmp_path, *args)
    assert not within(modules, HEAVY), f"leanimg {' '.join(args)} imports them"
    own = {m for m in modules if m == "leanimg" or m.startswith("leanimg.")}
    allowed = COMMAND_LINE | CHECKED_AT_START
    assert {m for m in own if m not in allowed and not m.startswith("leanimg.commands.")} == set()


@pytest.fixture(scope="module")
def small_image(tmp_path_factory):
    """A QEMU stream of 64 pages and the image converted from it (with a QEMU SOURCE_STATE)."""
    directory = tmp_path_factory.mktemp("startup")
    save, image = directory / "vm.save", directory / "vm.lean"
    save.write_bytes(qemu_save(bytes(4096 * 16) + bytes(range(256)) * 16 * 48))
    subprocess.run([*command_line(), "-q", "convert", save, "-o", image], check=True, timeout=120)
    return image


READING = WRITERS + ("concurrent.futures",)


@pytest.mark.parametrize(
    "args, forbidden",
    [
        pytest.param(args, forbidden, id=" ".join(args))
        for args, forbidden in [
            (("inspect",), READING),
            (("inspect", "--json"), READING),
            (("validate",), READING),
            (("map",), READING),
            (("dump",), READING),
            (("restore", "--to", "raw", "-o", "/dev/null"), WRITERS),  # (frames read ahead on a thread)
            (("restore", "--to", "qemu", "-o", "/dev/null", "-f"), ("leanimg.writer",)),
            (("serve", "--postcopy"), ("leanimg.writer",)),  # stdin at its end: the pages pushed, then done
        ]
    ],
)
def test_a_command_on_a_small_image_imports_what_it_uses(args, forbidden, small_image, tmp_path):
    modules = imported(tmp_path, args[0], small_image, *args[1:])
    assert "numpy" in modules and (args[0] == "dump" or "leanimg.reader" in modules)
    assert not within(modules, NEVER_FOR_A_LOCAL_IMAGE + forbidden)


def test_convert_imports_what_it_uses(small_image, tmp_path):
    """leanimg's own source formats are asked first: a QEMU save is recognised without looking
    up other distributions' plugins (importlib.metadata)."""
    modules = imported(tmp_path, "convert", small_image.with_name("vm.save"), "-o", tmp_path / "out.lean")
    assert not within(modules, NEVER_FOR_A_LOCAL_IMAGE)
