"""Plugins: the save-file formats that convert into lean images, and the restore targets.

A plugin is an object registered as an entry point, in group ``leanimg.sources`` (see
``Source``) or ``leanimg.targets`` (see ``Target``), by the distribution that provides it;
leanimg's own (converters/formats.py, restore/targets.py) are declared in its pyproject.toml.

The core (the command line, ``inspect``, the demo) reaches converters and restorers only
through here. An entry point is loaded when its name is asked for, or when its whole group
is, so a restore imports only the restorer of its target.
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import cache
from typing import BinaryIO, Protocol

from .errors import SourceFormatError, UnsupportedError

SOURCES = "leanimg.sources"
TARGETS = "leanimg.targets"
CHECKPOINTS = "leanimg.checkpoints"      # writers on a running hypervisor: `leanimg checkpoint`
HEAD_BYTES = 16                 # how much of a file Source.detect is shown


class Source(Protocol):
    """A save-file format that converts into lean images (entry point group leanimg.sources)."""

    name: str                   # as `convert --from` names it
    description: str            # what a file of the format is: "a QEMU migration stream"
    signature: str              # how such a file starts, for messages: "magic 51 45 56 4d"

    def detect(self, head: bytes) -> bool:
        """Whether a file starting with ``head`` (its first HEAD_BYTES bytes, fewer when the
        file is shorter) is in this format."""

    def convert(self, save, output: str, **options):
        """Convert ``save`` (a path, - for stdin, or a binary file) into the lean image
        ``output``. ``options`` as `leanimg convert` gives them: spool, writer_options,
        progress, parents, allow_delta, and disks (open DiskSources by name; the caller closes
        them), all_phases, disk_progress; returns the disk scan's summary (None without disks)."""


class Target(Protocol):
    """A form a lean image restores to (entry point group leanimg.targets)."""

    name: str                   # as `restore --to` names it
    description: str

    def restore(self, image, out: BinaryIO, progress=None) -> int:
        """Write the open LeanImage ``image`` to ``out``; return the bytes written."""

    def describe(self, image) -> str | None:
        """What the image's SOURCE_STATE records rebuild in this target's form, if they are its."""


def source(name: str) -> Source:
    return _load(SOURCES, name, "source format")


def target(name: str) -> Target:
    return _load(TARGETS, name, "restore target")


def checkpointer(name: str):
    """The checkpoint writer for hypervisor ``name`` (``qemu``: converters/checkpoint.py): an
    object with ``Request`` (the request dataclass) and ``checkpoint(request)`` (the result,
    whose ``summary()`` is one line)."""
    return _load(CHECKPOINTS, name, "checkpoint writer")


def sources() -> list[Source]:
    return [entry.load() for entry in _entry_points(SOURCES)]


def targets() -> list[Target]:
    return [entry.load() for entry in _entry_points(TARGETS)]


def source_targets(image) -> list[str]:
    """The restore targets named after the formats of an image's SOURCE_STATE records (those
    that can rebuild the save it came from), in source_format order."""
    from .format import SourceFormat
    known = {int(f) for f in SourceFormat}
    return [SourceFormat(f).name.lower() for f in sorted({s.source_format for s in image.source_states} & known)]


def find_source(head: bytes) -> Source | None:
    """The source format of a file starting with ``head``, or None."""
    return next((candidate for candidate in sources() if candidate.detect(head)), None)


def detect_source(head: bytes) -> Source:
    """The source format of a file starting with ``head``; SourceFormatError when none is."""
    found = find_source(head)
    if found is None:
        expected = " or ".join(f"{s.description} ({s.signature})" for s in sources())
        raise SourceFormatError(f"expected {expected}, got {head[:8].hex(' ')}{_compressed_hint(head)}",
                                offset=0, structure="magic")
    return found


# how compressed files start (RFC 8878, RFC 1952, the xz and bzip2 file formats)
COMPRESSED = {b"\x28\xb5\x2f\xfd": ("zstd", "zstd -dc"), b"\x1f\x8b": ("gzip", "gzip -dc"),
              b"\xfd7zXZ\x00": ("xz", "xz -dc"), b"BZh": ("bzip2", "bzip2 -dc")}


def _compressed_hint(head: bytes) -> str:
    for magic, (name, command) in COMPRESSED.items():
        if head.startswith(magic):
            return f": this is a {name}-compressed file; decompress it on the way in: {command} FILE | " \
                   "leanimg convert - -o IMAGE"
    return ""


@cache
def _entry_points(group: str) -> list:
    from importlib.metadata import entry_points
    return sorted(entry_points(group=group), key=lambda entry: entry.name)


@cache
def _own_entry_points(group: str) -> list:
    """leanimg's own plugins of ``group``, read from the entry_points.txt of its installed
    metadata directly: importing importlib.metadata costs ~20 ms, a tenth of a short command.
    Any other plugin is found through importlib.metadata (``_entry_points``)."""
    import configparser
    for directory in sys.path:
        try:
            names = os.listdir(directory or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("leanimg-") and name.endswith(".dist-info"):
                parser = configparser.ConfigParser(delimiters=("=",))
                parser.read(os.path.join(directory or ".", name, "entry_points.txt"))
                return [_EntryPoint(key, value) for key, value in parser.items(group)] \
                    if parser.has_section(group) else []
    return []


class _EntryPoint:
    """``name = module:attribute``, loaded like importlib.metadata.EntryPoint.load."""

    def __init__(self, name: str, value: str):
        self.name, self.value = name, value.strip()

    def load(self):
        module, _, attribute = self.value.partition(":")
        target = importlib.import_module(module.strip())
        for part in attribute.strip().split(".") if attribute else ():
            target = getattr(target, part)
        return target


def _candidates(group: str):
    """leanimg's own entry points first; every installed one only when those do not serve."""
    yield from _own_entry_points(group)
    yield from _entry_points(group)


def _load(group: str, name: str, kind: str):
    for entry in _candidates(group):
        if entry.name == name:
            return entry.load()
    known = ", ".join(entry.name for entry in _entry_points(group)) or "none"
    raise UnsupportedError(f"no {kind} {name!r} is installed (installed: {known})", structure=group)
