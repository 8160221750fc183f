"""A third-party plugin, installed for real: tests/plugins/leanimg-toyvm is its own
distribution (an invented hypervisor's save format, a source and a target plugin), built and
installed by pip into a directory of its own, and used through the real `leanimg` command with
that directory on PYTHONPATH. A second distribution, made here, holds broken plugins.

The toyvm saves are written here from the format's description (tests/plugins/leanimg-toyvm/
leanimg_toyvm/format.py), not with the plugin's code, so the plugin is checked against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import qemu_save
from leanimg.cli import command_line

TOYVM_SOURCE = Path(__file__).resolve().parent / "plugins" / "leanimg-toyvm"
PS = 4096

BROKEN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "leanimg-broken"
version = "2.0"

[project.entry-points."leanimg.sources"]
gone = "leanimg_broken_missing_module:SOURCE"
exploding = "leanimg_broken:EXPLODING"

[project.entry-points."leanimg.targets"]
halfdone = "leanimg_broken:HALFDONE"
qemu = "leanimg_broken:HALFDONE"

[tool.setuptools]
packages = ["leanimg_broken"]
"""

BROKEN_MODULE = """\
class HalfDone:                     # a target without restore and describe
    name = "halfdone"
    description = "a target somebody did not finish"


HALFDONE = HalfDone()


def __getattr__(name):
    if name == "EXPLODING":
        raise RuntimeError("the plugin's own bug")
    raise AttributeError(name)
"""


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """leanimg-toyvm and leanimg-broken installed by pip (offline) into a directory of their own."""
    root = tmp_path_factory.mktemp("plugins")
    toyvm = shutil.copytree(TOYVM_SOURCE, root / "src" / "leanimg-toyvm")  # builds leave no files in tests/
    broken = root / "src" / "leanimg-broken"
    (broken / "leanimg_broken").mkdir(parents=True)
    (broken / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (broken / "leanimg_broken" / "__init__.py").write_text(BROKEN_MODULE)
    target = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(toyvm),
            str(broken),
        ],
        check=True,
        capture_output=True,
    )
    return target


def leanimg(plugin_dir: Path, *args, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(plugin_dir))
    proc = subprocess.run([*command_line(), *map(str, args)], capture_output=True, text=True, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def toyvm_save(pages: list[tuple[int, bytes | None]], ram_pages: int, devices: bytes) -> bytes:
    """A toyvm save sending ``pages`` in order: (page, its bytes) or (page, None) for a ZERO record."""
    out = [b"TOYVMSAV", struct.pack("<IIQII", 1, PS, ram_pages * PS, len(devices), 0), devices]
    for page, data in pages:
        out += [struct.pack("<Q", page << 8 | 1), data] if data is not None else [struct.pack("<Q", page << 8 | 2)]
    return b"".join(out + [struct.pack("<Q", 255)])


def page_of(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PS, dtype=np.uint8).tobytes()


RAM_PAGES = 24
DEVICES = b"toyvm-cpu0:rip=ffffffff81000000;uart:lcr=03" * 3
# pages 0-9 stored, 10-13 zero, 14-15 never sent (FREE), 16-23 stored; 3 and 17 sent twice,
# 11 sent with data first and zeroed later, 20 zeroed first and given data later
FINAL = {p: page_of(p) for p in [*range(10), *range(16, 24)]} | {p: None for p in range(10, 14)}


def memory_of(final: dict) -> bytes:
    return b"".join(final.get(p) or bytes(PS) for p in range(RAM_PAGES))


def canonical_save() -> bytes:
    return toyvm_save(sorted(FINAL.items()), RAM_PAGES, DEVICES)


def messy_save() -> bytes:
    """FINAL's memory, sent out of order with pages sent twice."""
    sends = [
        (3, page_of(99)),
        (11, page_of(98)),
        (20, None),
        *sorted(FINAL.items(), reverse=True),
        (17, page_of(97)),
        (17, FINAL[17]),
    ]
    return toyvm_save(sends, RAM_PAGES, DEVICES)


def test_plugins_lists_the_installed_third_party_plugins(plugin_dir):
    listed = json.loads(leanimg(plugin_dir, "plugins", "--json").stdout)
    by_key = {(p["kind"], p["name"], p["distribution"]): p for p in listed}
    for kind in ("source", "target"):
        toyvm = by_key[(kind, "toyvm", "leanimg-toyvm")]
        assert toyvm["status"] == "ok" and toyvm["problem"] is None
        assert toyvm["version"] == "0.3.1"
        assert toyvm["entry_point"] == f"leanimg_toyvm.plugin:{kind.upper()}"
        assert toyvm["description"].startswith(("a toyvm save", "the canonical toyvm save"))
    assert by_key[("source", "qemu", "leanimg")]["status"] == "ok"


def test_broken_plugins_are_listed_with_the_reason(plugin_dir):
    listed = json.loads(leanimg(plugin_dir, "plugins", "--json").stdout)
    broken = {
        (p["kind"], p["name"]): p["problem"]
        for p in listed
        if p["distribution"] == "leanimg-broken" and p["status"] == "broken"
    }
    assert set(broken) == {("source", "gone"), ("source", "exploding"), ("target", "halfdone"), ("target", "qemu")}
    assert "ModuleNotFoundError: No module named 'leanimg_broken_missing_module'" in broken[("source", "gone")]
    assert "RuntimeError: the plugin's own bug" in broken[("source", "exploding")]
    assert "lacks restore, describe of the restore target protocol" in broken[("target", "halfdone")]
    assert "leanimg's own target 'qemu' takes precedence" in broken[("target", "qemu")]
    text = leanimg(plugin_dir, "plugins").stdout
    assert re.search(r"^source +gone +BROKEN: cannot be loaded: ModuleNotFoundError", text, re.M), text
    assert "from leanimg-broken 2.0: leanimg_broken_missing_module:SOURCE" in text


def test_a_toyvm_save_converts_validates_and_restores(plugin_dir, tmp_path):
    save, image, raw, back = (tmp_path / n for n in ("vm.toy", "vm.lean", "vm.raw", "back.toy"))
    save.write_bytes(messy_save())
    leanimg(plugin_dir, "convert", save, "-o", image)  # found by its magic: no --from
    report = leanimg(plugin_dir, "validate", image).stdout
    assert report.strip().endswith(f"checked {RAM_PAGES} pages, 6 records, 18 stored_pages"), report
    assert report.startswith(f"{image}: valid")
    summary = json.loads(leanimg(plugin_dir, "inspect", "--json", image).stdout)
    counts = summary["classes"]
    assert counts == {"STORED": 18, "ZERO": 4, "FREE": 2}
    assert summary["source"] == f"a toyvm save ({len(DEVICES) + 32} bytes of header and device state)"
    leanimg(plugin_dir, "restore", image, "--to", "raw", "-o", raw)
    assert raw.read_bytes() == memory_of(FINAL)
    wrong = leanimg(plugin_dir, "restore", image, "--to", "qemu", "-o", tmp_path / "q.save", check=False)
    assert wrong.returncode == 1 and "use --to toyvm or --to raw" in wrong.stderr, wrong.stderr
    leanimg(plugin_dir, "restore", image, "--to", "toyvm", "-o", back)
    assert back.read_bytes() == canonical_save()  # each page once, in order, the last copy sent


def test_a_toyvm_save_converts_from_a_pipe(plugin_dir, tmp_path):
    image, raw = tmp_path / "piped.lean", tmp_path / "piped.raw"
    env = dict(os.environ, PYTHONPATH=str(plugin_dir))
    proc = subprocess.run(
        [*command_line(), "convert", "-", "-o", str(image)], input=messy_save(), env=env, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode()
    leanimg(plugin_dir, "restore", image, "--to", "raw", "-o", raw)
    assert raw.read_bytes() == memory_of(FINAL)


def test_a_canonical_toyvm_save_round_trips_byte_identical(plugin_dir, tmp_path):
    save, image, back = tmp_path / "vm.toy", tmp_path / "vm.lean", tmp_path / "back.toy"
    save.write_bytes(canonical_save())
    leanimg(plugin_dir, "convert", save, "-o", image, "--from", "toyvm")
    leanimg(plugin_dir, "restore", image, "--to", "toyvm", "-o", back)
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(save.read_bytes()).digest()
    env = dict(os.environ, PYTHONPATH=str(plugin_dir))  # and to a pipe
    piped = subprocess.run(
        [*command_line(), "restore", str(image), "--to", "toyvm", "-o", "-"], env=env, capture_output=True, check=True
    )
    assert piped.stdout == save.read_bytes()


def test_a_bad_toyvm_save_is_a_clear_error_and_no_image(plugin_dir, tmp_path):
    save, image = tmp_path / "vm.toy", tmp_path / "vm.lean"
    save.write_bytes(canonical_save()[:-PS])  # ends inside page 23
    proc = leanimg(plugin_dir, "convert", save, "-o", image, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("leanimg: error: offset 0x") and "toyvm.page" in proc.stderr, proc.stderr
    assert not image.exists() and list(tmp_path.iterdir()) == [save]
    save.write_bytes(toyvm_save([(RAM_PAGES, page_of(1))], RAM_PAGES, b""))
    proc = leanimg(plugin_dir, "convert", save, "-o", image, check=False)
    assert proc.returncode == 1 and "offset 0x20, toyvm.record: expected a PAGE or ZERO record" in proc.stderr
    assert not image.exists()


def test_toyvm_refuses_what_it_cannot_do(plugin_dir, tmp_path):
    save, image = tmp_path / "vm.toy", tmp_path / "vm.lean"
    save.write_bytes(canonical_save())
    leanimg(plugin_dir, "convert", save, "-o", image)
    proc = leanimg(plugin_dir, "convert", save, "-o", tmp_path / "child.lean", "--parent", image, check=False)
    assert proc.returncode == 1 and "--parent is not supported" in proc.stderr
    qemu_image = tmp_path / "q.lean"
    (tmp_path / "q.save").write_bytes(qemu_save(bytes(range(256)) * 64))
    leanimg(plugin_dir, "convert", tmp_path / "q.save", "-o", qemu_image)
    proc = leanimg(plugin_dir, "restore", qemu_image, "--to", "toyvm", "-o", tmp_path / "x.toy", check=False)
    assert proc.returncode == 1 and "not converted from a toyvm save" in proc.stderr
    assert not (tmp_path / "x.toy").exists()


def test_broken_plugins_do_not_break_other_commands(plugin_dir, tmp_path):
    save, image, raw = tmp_path / "q.save", tmp_path / "q.lean", tmp_path / "q.raw"
    memory = bytes(range(256)) * 64
    save.write_bytes(qemu_save(memory))
    leanimg(plugin_dir, "convert", save, "-o", image)  # detection passes over broken sources
    leanimg(plugin_dir, "restore", image, "--to", "raw", "-o", raw)
    assert raw.read_bytes() == memory
    qemu_stream = tmp_path / "q.again"
    leanimg(plugin_dir, "restore", image, "--to", "qemu", "-o", qemu_stream)  # leanimg's own qemu, not the broken one
    assert qemu_stream.read_bytes() == save.read_bytes()


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["convert", "{save}", "-o", "{out}", "--from", "gone"],
            "the source format plugin 'gone' (leanimg_broken_missing_module:SOURCE of distribution leanimg-broken 2.0) "
            "cannot be used: cannot be loaded: ModuleNotFoundError",
        ),
        (
            ["convert", "{save}", "-o", "{out}", "--from", "exploding"],
            "cannot be loaded: RuntimeError: the plugin's own bug",
        ),
        (
            ["restore", "{image}", "--to", "halfdone", "-o", "{out}"],
            "lacks restore, describe of the restore target protocol",
        ),
        (
            ["convert", "{unknown}", "-o", "{out}"],
            "source plugins that could not be loaded: exploding "
            "(cannot be loaded: RuntimeError: the plugin's own bug), "
            "gone (cannot be loaded: ModuleNotFoundError",
        ),
    ],
)
def test_a_broken_plugin_that_is_needed_is_a_clear_error(plugin_dir, tmp_path, args, message):
    paths = dict(save=tmp_path / "q.save", image=tmp_path / "q.lean", out=tmp_path / "out", unknown=tmp_path / "u")
    paths["save"].write_bytes(qemu_save(bytes(4096)))
    paths["unknown"].write_bytes(bytes(range(64)))
    if "{image}" in args:
        leanimg(plugin_dir, "convert", paths["save"], "-o", paths["image"])
    proc = leanimg(plugin_dir, *[a.format(**paths) for a in args], check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("leanimg: error: ") and message in lines[0], proc.stderr
    assert not paths["out"].exists()
