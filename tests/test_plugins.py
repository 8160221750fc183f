"""The plugin registry (leanimg.plugins) and the layering it allows: lean-image/ imports
neither converters/ nor restore/, and a restore imports the restorer of its target alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import VECTORS_DIR
from leanimg import plugins
from leanimg.errors import SourceFormatError, UnsupportedError

CORE = Path(__file__).resolve().parent.parent / "lean-image"


def test_the_built_in_plugins_are_registered():
    assert [s.name for s in plugins.sources()] == ["libvirt", "qemu", "xen"]
    assert [t.name for t in plugins.targets()] == ["libvirt", "qemu", "qemu-mapped-ram", "raw", "xen"]
    assert plugins.target("raw").name == "raw"
    assert plugins.checkpointer("qemu").name == "qemu"
    with pytest.raises(UnsupportedError, match="no restore target 'vmware'"):
        plugins.target("vmware")
    with pytest.raises(UnsupportedError, match="no checkpoint writer 'xen'"):
        plugins.checkpointer("xen")


@pytest.mark.parametrize(
    "head,name",
    [
        (b"QEVM\x00\x00\x00\x03" + bytes(8), "qemu"),
        (b"Xen saved domain, xl format\n", "xen"),
        (b"LibxlFmt\x00\x00\x00\x02", "xen"),
        (b"\xff" * 8 + b"\x00\x00\x00\x00", "xen"),
        (b"Xen sav", "xen"),  # cut inside the magic: the Xen reader says truncated
        (b"QEV", None),
        (b"", None),
        (b"\x89LEANIMG", None),
    ],
)
def test_source_detection(head, name):
    found = plugins.find_source(head)
    assert (found.name if found else None) == name


def test_an_unknown_save_file_names_every_format():
    with pytest.raises(
        SourceFormatError,
        match=r"expected a libvirt QEMU save image .*\(magic \"LibvirtQemudSave\"\) "
        r"or a QEMU migration stream \(magic 51 45 56 4d\) or a Xen save file .*, got 00 01 02",
    ):
        plugins.detect_source(bytes(range(16)))


def imported_modules(path: Path):
    """The absolute names of the modules the core file ``path`` imports, lazy imports included."""
    package = ["leanimg", *path.relative_to(CORE).parent.parts]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            yield ".".join([*base, *([node.module] if node.module else [])])


def test_core_imports_neither_converters_nor_restore():
    offenders = [
        f"{path.relative_to(CORE)}: {module}"
        for path in CORE.rglob("*.py")
        for module in imported_modules(path)
        if module.startswith(("leanimg.converters", "leanimg.restore"))
    ]
    assert offenders == []


def test_a_restore_imports_only_its_own_restorer(tmp_path):
    script = (
        "import sys\nfrom leanimg.cli import main\n"
        f'try:\n    main(["restore", "-q", {str(VECTORS_DIR / "valid" / "basic.lean")!r}, "--to", "raw", '
        f'"-o", {str(tmp_path / "out.raw")!r}])\nexcept SystemExit:\n    pass\n'
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('leanimg.converters', "
        "'leanimg.restore')))))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["leanimg.restore", "leanimg.restore.raw", "leanimg.restore.targets"]


@pytest.mark.parametrize("group", [plugins.SOURCES, plugins.TARGETS, plugins.CHECKPOINTS])
def test_the_fast_lookup_of_leanimgs_own_plugins_agrees_with_importlib_metadata(group):
    from importlib.metadata import distribution

    declared = {(e.name, e.value) for e in distribution("leanimg").entry_points if e.group == group}
    assert declared  # the built-ins are declared in pyproject.toml
    assert {(e.name, e.value) for e in plugins._own_entry_points(group)} == declared
    for entry in plugins._own_entry_points(group):
        assert (
            entry.load()
            is next(e for e in distribution("leanimg").entry_points if e.group == group and e.name == entry.name).load()
        )


@pytest.mark.parametrize(
    "head,name",
    [
        (b"\x28\xb5\x2f\xfd\x04\x00", "zstd"),
        (b"\x1f\x8b\x08\x00", "gzip"),
        (b"\xfd7zXZ\x00\x00", "xz"),
        (b"BZh91AY", "bzip2"),
    ],
)
def test_a_compressed_save_is_named_with_the_way_to_convert_it(head, name):
    with pytest.raises(SourceFormatError) as info:
        plugins.detect_source(head)
    assert f"this is a {name}-compressed file" in str(info.value)
    assert "`leanimg convert` reads it as it is" in str(info.value)


def test_an_unknown_save_gets_no_compression_hint():
    with pytest.raises(SourceFormatError) as info:
        plugins.detect_source(b"\x00" * 16)
    assert "compressed" not in str(info.value)


def test_restore_to_the_wrong_target_names_the_one_that_fits(tmp_path):
    from helpers import qemu_save
    from leanimg.cli import command_line

    save, image, out = tmp_path / "vm.save", tmp_path / "vm.lean", tmp_path / "out.save"
    save.write_bytes(qemu_save(bytes(range(256)) * 64))
    subprocess.run([*command_line(), "convert", str(save), "-o", str(image)], check=True, capture_output=True)
    proc = subprocess.run([*command_line(), "restore", str(image), "--to", "xen", "-o", str(out)], capture_output=True)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert "not converted from a Xen save; use --to qemu or --to raw" in err
    assert not out.exists()


def test_another_distribution_named_leanimg_something_is_not_taken_for_leanimg(tmp_path, monkeypatch):
    """The fast lookup reads leanimg's own dist-info; one of a distribution whose name merely
    starts with leanimg (legacy spelling leanimg-toyvm-1.0.dist-info), earlier on sys.path, is not it."""
    other = tmp_path / "leanimg-toyvm-1.0.dist-info"
    other.mkdir()
    (other / "entry_points.txt").write_text("[leanimg.sources]\ntoyvm = leanimg_toyvm.plugin:SOURCE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins._own_entry_points.cache_clear()
    try:
        assert [e.name for e in plugins._own_entry_points(plugins.SOURCES)] == ["libvirt", "qemu", "xen"]
    finally:
        plugins._own_entry_points.cache_clear()


def test_every_plugin_of_leanimg_keeps_its_protocol():
    found = plugins.installed()
    assert {(p.kind, p.name) for p in found} >= {
        ("source", "qemu"),
        ("source", "xen"),
        ("target", "qemu"),
        ("target", "raw"),
        ("target", "xen"),
    }
    assert all(p.problem is None and p.distribution == "leanimg" for p in found if p.distribution == "leanimg")
