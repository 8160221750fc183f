"""``leanimg convert``: a hypervisor save file into a lean image, by the source plugin that
recognises it (or ``--from``), with disk references, hints and a parent."""

from __future__ import annotations

import os
import sys

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import (
    disk_sources,
    file_option,
    force_option,
    guard_output,
    incremental_options,
    installed_plugin,
    lean_output_option,
    level_option,
    parse_disks,
    prev_chain,
)


@click.command("convert")
@click.argument("save", metavar="SAVE|-")
@lean_output_option
@json_option
@verbosity_options
@click.option(
    "--from",
    "source_format",
    metavar="qemu|libvirt|xen|PLUGIN",
    callback=lambda ctx, param, value: installed_plugin("leanimg.sources", param, value),
    help="Force the source format (an installed source plugin's name: leanimg plugins).",
)
@click.option(
    "--spool/--no-spool",
    default=None,
    help="Assemble RAM in scratch files first, as a live save read from a pipe needs (default: only "
    "where needed, e.g. with --disk; a live save in a file is re-read instead).",
)
@level_option("zstd level of stored pages (1-22).")
@click.option(
    "--frame-pages",
    type=click.IntRange(1, 4096),
    help="Pages per zstd frame, at most 16 MiB of them (default: 2 MiB worth).",
)
@incremental_options(
    "Write an incremental image against PREV (the first --parent); "
    "more --parent options name PREV's ancestors (also found beside PREV).",
    "Encode changed pages as 8-byte-word deltas when smaller (with --parent).",
)
@click.option(
    "--disk",
    "disks",
    multiple=True,
    metavar="[NAME=]PATH|NAME",
    help="A disk of the VM (raw or qcow2; repeatable): pages found on it become verified disk "
    "references. NAME (the guest's device name, e.g. vda) defaults to the file name's stem. NAME "
    "alone: the file the save names for it (a libvirt save's domain XML).",
)
@click.option(
    "--all-phases", is_flag=True, help="Scan every 512-byte phase of each disk, not only the partitions' own."
)
@file_option(
    "--hints",
    "hints_path",
    exists=True,
    help="Hints to apply (spec/hints.md): FREE by the stream-offset rule, DISK verified against "
    "--disk, UNCHANGED against --parent.",
)
@click.option(
    "--trust-dirty-log",
    is_flag=True,
    help="With --hints: pages hinted UNCHANGED that the stream never sends are taken from the parent.",
)
@click.option(
    "--disk-scan/--no-disk-scan",
    default=None,
    help="Scan the --disk disks for pages (default: yes, unless the hints have DISK hints).",
)
@force_option
def convert(
    save,
    output,
    as_json,
    source_format,
    spool,
    level,
    frame_pages,
    parents,
    delta,
    disks,
    all_phases,
    hints_path,
    trust_dirty_log,
    disk_scan,
    force,
):
    """Convert a hypervisor save file (QEMU migration stream, libvirt save image, Xen xl/libxl/libxc stream) into a lean image."""  # noqa: E501 (one line: its help)
    import time

    from ..disks.partitions import scan_bytes
    from ..results import convert_line, convert_result, written_image

    started, save_name = time.monotonic(), save
    chain = prev_chain(parents, output)
    disk_paths = _disks_named_by_save(save, source_format, parse_disks(disks))
    guard_output(
        output, [save, *parents, *chain, *disk_paths.values(), *filter(None, [hints_path])], force, object_ok=True
    )
    hinting = _hint_options(hints_path, trust_dirty_log, disk_scan)
    with disk_sources(disk_paths, name_from_file=True) as sources:
        if sources:  # the bar follows the disk scan, the part whose length depends on the disk
            total = sum(scan_bytes(d, 4096, all_phases) for d in sources.values())
            label = "scan disks"
        else:
            total, label = (os.path.getsize(save) if _plain_file(save) else 0), "convert"
        with ui.progress(total, label) as advance:
            source, save = _save_source(save, source_format)
            ui.detail(
                f"converting {'standard input' if save_name == '-' else save_name} as {source.name}"
                f"{' against ' + parents[0] if parents else ''} into {output}"
            )
            summary = source.convert(
                save,
                output,
                spool=spool,
                writer_options=dict(level=level, frame_pages=frame_pages),
                progress=None if sources else advance,
                parents=parents,
                allow_delta=delta,
                disks=sources,
                all_phases=all_phases,
                disk_progress=advance,
                **hinting,
            )
    if summary:
        _report_disk_pages(sources, summary)
    _report_hints(hinting)
    result = convert_result(
        save_name,
        written_image(output, parents),
        source.name,
        summary,
        hinting.get("hint_report"),
        time.monotonic() - started,
    )
    if as_json:
        ui.emit_json(result)
    ui.summary(convert_line(result))


def _disks_named_by_save(save: str, source_format: str | None, paths: dict) -> dict:
    """``--disk NAME`` alone (no such file): the file the save names for that device (libvirt's
    domain XML names each disk's file; a source plugin tells through ``disk_paths``)."""
    bare = [path for name, path in paths.items() if name is None and "/" not in path and not os.path.exists(path)]
    if not bare:
        return paths
    from .. import plugins

    source = None
    if source_format:
        source = plugins.source(source_format)
    elif save != "-" and os.path.isfile(save):
        with open(save, "rb") as f:
            source = plugins.find_source(f.read(plugins.HEAD_BYTES))
    named = getattr(source, "disk_paths", None)
    found = named(save) if named and save != "-" else {}
    resolved = {}
    for name, path in paths.items():
        if name is not None or path not in bare:
            resolved[name] = path
            continue
        if path not in found:
            known = ", ".join(f"{k}={v}" for k, v in found.items()) or "none"
            raise click.BadParameter(
                f"{path} is not a file, and the save names no disk {path} (it names: {known})", param_hint="--disk"
            )
        if path in paths:
            raise click.BadParameter(f"disk {path} given twice", param_hint="--disk")
        resolved[path] = found[path]
    return resolved


def _plain_file(save: str) -> bool:
    """A regular file that is not compressed: its size is what the progress bar counts."""
    if save == "-" or not os.path.isfile(save):
        return False
    from ..compressed_input import MAGIC_BYTES, compression_of

    with open(save, "rb") as f:
        return compression_of(f.read(MAGIC_BYTES)) is None


# -- hints (spec/hints.md) ------------------------------------------------------------------
def _hint_options(path, trust_dirty_log: bool, disk_scan) -> dict:
    """The convert options of --hints: the hints read and checked before the save is."""
    if path is None:
        if trust_dirty_log:
            raise click.UsageError("--trust-dirty-log needs --hints")
        return {"disk_scan": disk_scan} if disk_scan is not None else {}
    from ..hints import read_hints

    return dict(hints=read_hints(path), trust_dirty_log=trust_dirty_log, disk_scan=disk_scan, hint_report={})


def _report_hints(hinting: dict) -> None:
    for kind, counts in hinting.get("hint_report", {}).items():
        ui.note(f"hints {kind}: " + ", ".join(f"{n} {what}" for what, n in counts.items()) + " (pages)")


def _save_source(save: str, source_format: str | None):
    """The source plugin --from names, or the one that recognises SAVE's first bytes, and SAVE
    to convert (opened when it had to be read for that)."""
    from .. import plugins
    from ..fileutil import peek_input

    if source_format:
        return plugins.source(source_format), save
    head, opened = peek_input(save, plugins.HEAD_BYTES)
    try:
        return plugins.detect_source(head), opened
    except BaseException:
        if opened is not sys.stdin.buffer:
            opened.close()
        raise


def _report_disk_pages(sources: dict, summary) -> None:
    for name in sources:
        pages = summary.pages.get(name, 0)
        ui.note(f"disk {name}: {pages} pages ({pages * summary.page_size / 2**20:.1f} MiB) are disk references")
    ui.note(
        f"disks scanned: {summary.scanned_bytes / 2**20:.1f} MiB of data; "
        f"{summary.indexed_pages} non-zero guest pages looked up"
    )
