"""Plugins: the save-file formats that convert into lean images, and the restore targets.

A plugin is an object registered as an entry point, in group ``leanimg.sources`` (see
``Source``) or ``leanimg.targets`` (see ``Target``), by the distribution that provides it;
leanimg's own (converters/formats.py, restore/targets.py) are declared in its pyproject.toml,
a third party's in its own (spec/guides/writing-a-writer.md; tests/plugins/leanimg-toyvm is
a complete example). ``Source`` and ``Target`` below are the contract.

The core (the command line, ``inspect``, the demo) reaches converters and restorers only
through here. An entry point is loaded when its name is asked for, or when its whole group
is, so a restore imports only the restorer of its target. leanimg's own plugins are looked
up first, so an installed plugin never replaces one of them. A plugin that cannot be loaded
(its import fails, or it lacks part of its protocol) is *broken*: ``leanimg plugins`` lists
it with the reason, format detection passes over it, and asking for it by name is a clear
UnsupportedError.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from functools import cache
from typing import BinaryIO, Protocol

from .errors import SourceFormatError, UnsupportedError

SOURCES = "leanimg.sources"
TARGETS = "leanimg.targets"
CHECKPOINTS = "leanimg.checkpoints"  # writers on a running hypervisor: `leanimg checkpoint`
HEAD_BYTES = 16  # how much of a file Source.detect is shown


class Source(Protocol):
    """A save-file format that converts into lean images (entry point group leanimg.sources).

    The entry point's name is the plugin's ``name``; it names an object (a module-level
    instance, not a class) with these attributes.
    """

    name: str  # as `convert --from` names it
    description: str  # what a file of the format is: "a QEMU migration stream"
    signature: str  # how such a file starts, for messages: "magic 51 45 56 4d"

    def detect(self, head: bytes) -> bool:
        """Whether a file starting with ``head`` (its first HEAD_BYTES bytes, fewer when the
        file is shorter) is in this format. Cheap and side-effect free: it is asked of every
        installed source (leanimg's own first) for each `convert` without ``--from``, and it
        must not claim another format's files."""

    def convert(self, save, output: str, **options):
        """Convert ``save`` into the lean image ``output``; return the disk scan's summary, or
        None (always None for a plugin that does not take ``disks``).

        ``save`` is a path, ``-`` for stdin, or a readable binary file positioned at the
        file's first byte (detection read the head: a seekable file is rewound, a pipe is
        wrapped so its head is given again); it may not be seekable, and a read from it may
        return fewer bytes than asked before its end (read until you have them, or wrap it in
        io.BufferedReader). ``output`` is a path.

        ``options``, as `leanimg convert` gives them (accept unknown ones with ``**options``
        and ignore them; later versions add options):
          writer_options: dict(level=, frame_pages=) for LeanImageWriter(output, **those);
          progress: None or a callable taking a number of save-file bytes read;
          spool: None (decide), True or False: assemble pages in scratch files first;
          parents: tuple of paths, the first the parent of an incremental image, empty for a
            full image; allow_delta: bool;
          disks: dict name -> open DiskSource (the caller closes them), possibly empty;
            all_phases, disk_progress: the disk scan's options.
          hints: given only with `convert --hints`: FREE/DISK/UNCHANGED hints (spec/hints.md),
            a path, bytes, stream, leanimg.hints.Hints or a callable returning one (called
            when the plugin needs them); with it trust_dirty_log, disk_scan, and hint_report
            (a dict the plugin fills with what the hints did). leanimg.converters.hinting's
            HintPlan applies them for a plugin that tells it where each page's last copy ends.
        A plugin that cannot honour an option that is set (parents, disks) raises
        UnsupportedError naming it, before it writes anything.

        The plugin must guarantee:
          - every page of every region it declares is given to the writer exactly once
            (put_pages / put_zero / put_free / put_disks / put_parent / put_delta); a page the
            save sends twice is resolved by the plugin (last copy wins) before it is given;
          - output appears only complete: write through ``with LeanImageWriter(output, ...)``,
            which writes a temporary file and renames it on a clean exit and removes it when
            an exception leaves the block;
          - bad input raises SourceFormatError (leanimg.errors; for a malformed save and for one
            that ends early) with offset= (in the save file) and structure= (what was being
            read), UnsupportedError for a valid save using what the plugin does not handle;
            never an unbounded allocation driven by a size field it has not checked. Any
            other exception is reported as an internal error (exit 3).
        The writer API it may use is leanimg.writer.LeanImageWriter: add_region, put_pages,
        put_zero, put_free, put_disks, put_parent, put_changed, declare_source_state,
        add_source_state (source_format: its own private-use value, spec §5.4), finish.
        """


class Target(Protocol):
    """A form a lean image restores to (entry point group leanimg.targets)."""

    name: str  # as `restore --to` names it
    description: str

    def restore(self, image, out: BinaryIO, progress=None) -> int:
        """Write the open LeanImage ``image`` to ``out`` (a binary file, possibly a pipe);
        return the bytes written. Read pages with ``image.region_bytes(region, first, count)``
        (every page checked against its digest; ``image.classes`` gives their classes).
        ``progress``: None or a callable taking a number of memory bytes done. An image this
        target cannot rebuild (no SOURCE_STATE of its format) raises UnsupportedError naming
        the ``--to`` that fits, before writing."""

    def describe(self, image) -> str | None:
        """What the image's SOURCE_STATE records rebuild in this target's form, if they are its."""


REQUIRED = {
    SOURCES: ("name", "description", "signature", "detect", "convert"),
    TARGETS: ("name", "description", "restore", "describe"),
    CHECKPOINTS: ("name", "description", "Request", "checkpoint"),
}
METHODS = {"detect", "convert", "restore", "describe", "checkpoint"}


KINDS = {SOURCES: "source format", TARGETS: "restore target", CHECKPOINTS: "checkpoint writer"}


def source(name: str) -> Source:
    return _load(SOURCES, name)


def target(name: str) -> Target:
    return _load(TARGETS, name)


def checkpointer(name: str):
    """The checkpoint writer for hypervisor ``name`` (``qemu``: converters/checkpoint.py): an
    object with ``Request`` (the request dataclass) and ``checkpoint(request)`` (the result,
    whose ``summary()`` is one line)."""
    return _load(CHECKPOINTS, name)


def sources() -> list[Source]:
    """The installed source formats that load, leanimg's own first."""
    return [plugin for _, plugin, problem in _loaded(SOURCES) if problem is None]


def targets() -> list[Target]:
    """The installed restore targets that load, leanimg's own first."""
    return [plugin for _, plugin, problem in _loaded(TARGETS) if problem is None]


def names(group: str) -> list[str]:
    """The names of the installed plugins of ``group``, without loading any."""
    return sorted({entry.name for entry in _entry_points(group)})


def is_installed(group: str, name: str) -> bool:
    """Whether a plugin of ``group`` is named ``name`` (leanimg's own are found without
    importing importlib.metadata)."""
    return any(entry.name == name for entry in _candidates(group))


@dataclass(frozen=True)
class Installed:
    """An installed plugin as `leanimg plugins` lists it; ``problem`` says why it is broken."""

    kind: str  # "source" or "target"
    name: str
    entry_point: str  # module:attribute
    distribution: str | None
    version: str | None
    description: str | None
    problem: str | None = None

    def to_json(self) -> dict:
        return dict(
            kind=self.kind,
            name=self.name,
            status="broken" if self.problem else "ok",
            description=self.description,
            distribution=self.distribution,
            version=self.version,
            entry_point=self.entry_point,
            problem=self.problem,
        )


def installed() -> list[Installed]:
    """Every installed plugin of every group, each loaded and checked against its protocol."""
    found = []
    for group, kind in ((SOURCES, "source"), (TARGETS, "target"), (CHECKPOINTS, "checkpoint")):
        own = {entry.name for entry in _entry_points(group) if _is_own(entry)}
        for entry in sorted(_entry_points(group), key=lambda entry: (entry.name, not _is_own(entry))):
            plugin, problem = _check(group, entry)
            if entry.name in own and not _is_own(entry):
                problem = f"leanimg's own {kind} {entry.name!r} takes precedence: this one is never used"
            dist = getattr(entry, "dist", None)
            description = getattr(plugin, "description", None) if problem is None else None
            found.append(
                Installed(
                    kind,
                    entry.name,
                    entry.value,
                    dist.name if dist else None,
                    dist.version if dist else None,
                    description,
                    problem,
                )
            )
    return found


def source_targets(image) -> list[str]:
    """The restore targets that can rebuild the save an image came from: first those whose
    optional ``source_states`` attribute names a (source_format, tag) of its SOURCE_STATE records
    (`--to libvirt`: QEMU tag 3), then those named after
    the formats of its SOURCE_STATE records, in source_format order, then, for a private-use
    format (a plugin's, spec §5.4), every other installed target whose ``describe`` claims it."""
    from .format import PRIVATE_SOURCE_FORMATS, SourceFormat

    formats = {s.source_format for s in image.source_states}
    names = [SourceFormat(f).name.lower() for f in sorted(formats & {int(f) for f in SourceFormat})]
    states = {(s.source_format, s.tag) for s in image.source_states}
    if states - {(f, 1) for f in formats}:  # a record beyond each format's first tag: a target for it?
        names = [
            t.name for t in targets() if t.name not in names and states & set(getattr(t, "source_states", ()))
        ] + names
    if max(formats, default=0) >= PRIVATE_SOURCE_FORMATS:
        names += [t.name for t in targets() if t.name not in names and _describes(t, image)]
    return names


def _describes(plugin: Target, image) -> bool:
    try:
        return bool(plugin.describe(image))
    except Exception:  # noqa: BLE001 - a third party's bug must not break another command
        return False


def find_source(head: bytes) -> Source | None:
    """The source format of a file starting with ``head``, or None (broken plugins are passed over).
    leanimg's own are asked first, as ``sources()`` lists them: when one claims the file, no other
    distribution's plugins are looked up (nor importlib.metadata imported)."""
    for entry in _own_entry_points(SOURCES):
        plugin, problem = _check(SOURCES, entry)
        if problem is None and plugin.detect(head):
            return plugin
    return next((candidate for candidate in sources() if candidate.detect(head)), None)


def detect_source(head: bytes) -> Source:
    """The source format of a file starting with ``head``; SourceFormatError when none is."""
    found = find_source(head)
    if found is None:
        expected = " or ".join(f"{s.description} ({s.signature})" for s in sources())
        broken = [f"{entry.name} ({problem})" for entry, _, problem in _loaded(SOURCES) if problem]
        unloaded = f"; source plugins that could not be loaded: {', '.join(broken)}" if broken else ""
        raise SourceFormatError(
            f"expected {expected}, got {head[:8].hex(' ')}{_compressed_hint(head)}{unloaded}",
            offset=0,
            structure="magic",
        )
    return found


def _compressed_hint(head: bytes) -> str:
    """convert decompresses what it is given (leanimg.compressed_input); anyone handing
    detect_source a file's raw head learns what the file is."""
    from .compressed_input import COMPRESSED

    for magic, (name, command) in COMPRESSED.items():
        if head.startswith(magic):
            return (
                f": this is a {name}-compressed file (`leanimg convert` reads it as it is; elsewhere: {command} FILE)"
            )
    return ""


@cache
def _entry_points(group: str) -> list:
    from importlib.metadata import entry_points

    return sorted(entry_points(group=group), key=lambda entry: entry.name)


@cache
def _own_entry_points(group: str) -> list:
    """leanimg's own plugins of ``group``, read from the entry_points.txt of its installed
    metadata directly: importing importlib.metadata costs ~20 ms, a tenth of a short command.
    Any other plugin is found through importlib.metadata (``_entry_points``), also one whose
    distribution's name starts with leanimg (leanimg_toyvm-0.1.0.dist-info is not leanimg's)."""
    import configparser

    for directory in sys.path:
        try:
            entries = os.listdir(directory or ".")
        except OSError:
            continue
        for name in entries:
            if name.endswith(".dist-info") and name[: -len(".dist-info")].rpartition("-")[0].lower() == "leanimg":
                parser = configparser.ConfigParser(delimiters=("=",))
                parser.read(os.path.join(directory or ".", name, "entry_points.txt"))
                return (
                    [_EntryPoint(key, value) for key, value in parser.items(group)] if parser.has_section(group) else []
                )
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


def _load(group: str, name: str):
    for entry in _candidates(group):
        if entry.name == name:
            plugin, problem = _check(group, entry)
            if problem:
                dist = getattr(entry, "dist", None)
                provider = f" of distribution {dist.name} {dist.version}" if dist else ""
                raise UnsupportedError(
                    f"the {KINDS[group]} plugin {name!r} ({entry.value}{provider}) cannot be used: {problem}",
                    structure=group,
                )
            return plugin
    known = ", ".join(names(group)) or "none"
    raise UnsupportedError(f"no {KINDS[group]} {name!r} is installed (installed: {known})", structure=group)


def _loaded(group: str) -> list[tuple]:
    """(entry point, plugin or None, problem or None) of every installed plugin of ``group``,
    leanimg's own first; a name already served by leanimg's own is not loaded again."""
    own = list(_own_entry_points(group)) or [e for e in _entry_points(group) if _is_own(e)]
    taken = {entry.name for entry in own}
    others = [entry for entry in _entry_points(group) if entry.name not in taken]
    return [(entry, *_check(group, entry)) for entry in [*own, *others]]


def _is_own(entry) -> bool:
    dist = getattr(entry, "dist", None)
    return dist is not None and dist.name.lower() == "leanimg"


def _check(group: str, entry) -> tuple:
    """(the plugin, None) when ``entry`` loads and has its protocol's attributes, else
    (None, why not) — a plugin's import may fail in any way, so any exception counts."""
    try:
        plugin = entry.load()
    except BaseException as exc:  # noqa: BLE001 - SystemExit or worse from a plugin's import
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, f"cannot be loaded: {type(exc).__name__}: {exc}"
    missing = [
        attribute
        for attribute in REQUIRED[group]
        if not hasattr(plugin, attribute) or (attribute in METHODS and not callable(getattr(plugin, attribute)))
    ]
    if missing:
        return None, f"{entry.value} lacks {', '.join(missing)} of the {KINDS[group]} protocol (leanimg.plugins)"
    if plugin.name != entry.name:
        return None, f"its name is {plugin.name!r} but its entry point is named {entry.name!r}"
    return plugin, None
