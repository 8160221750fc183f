"""``leanimg serve``: lazy restore, the source side of a QEMU post-copy migration
(restore/postcopy.py, spec/guides/lazy-restore.md)."""

from __future__ import annotations

import sys

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import (
    IMAGE,
    disk_option,
    file_option,
    force_option,
    guard_output,
    inputs_of,
    open_image,
    parent_option,
)


@click.command("serve")
@click.argument("image", type=IMAGE)
@click.option(
    "--postcopy",
    is_flag=True,
    required=True,
    help="Speak the source side of QEMU 7.2's post-copy migration: the stream on stdout, "
    'QEMU\'s return path on stdin (for -incoming "exec:leanimg serve IMG --postcopy").',
)
@click.option(
    "--prepage",
    type=click.Choice(["none", "sequential", "bubble", "disk-sorted"]),
    default="sequential",
    show_default=True,
    help="The order pages are pushed in while the guest runs (none: only on demand).",
)
@file_option("--stats", "stats_path", help="Also write the counts (pages on demand, pushed, ...) to FILE as JSON.")
@file_option(
    "--working-set",
    exists=True,
    help="Send the pages of this working-set file (e.g. from --record-faults) before the guest "
    "runs, in its order (at most 8192; every page still checked).",
)
@file_option("--record-faults", help="Write the pages the destination asked for, in order, to FILE as a working set.")
@click.option(
    "--precopy-seconds",
    type=click.FloatRange(0, 60),
    default=0.15,
    show_default=True,
    help="Send pages in the --prepage order for this long before the guest runs (after the "
    "working set); 0: only after.",
)
@json_option
@verbosity_options
@parent_option
@disk_option
@click.option("--any-disk-identity", is_flag=True, help="As for restore: every block is still checked.")
@force_option
def serve(
    image,
    postcopy,
    prepage,
    stats_path,
    working_set,
    record_faults,
    precopy_seconds,
    as_json,
    parents,
    disks,
    any_disk_identity,
    force,
):
    """Serve IMAGE to a QEMU destination that runs the guest before its memory has arrived.

    qemu-system-x86_64 ... -global migration.x-postcopy-ram=on
    -incoming "exec:leanimg serve IMG --postcopy"

    The summary (with --json: the counts as JSON) goes to standard error: standard output is the stream.
    """
    from dataclasses import asdict

    from ..plugins import target as restore_target

    ui.stdout_is_data()
    if not postcopy:
        raise click.UsageError("serve needs --postcopy (the only protocol it speaks)")
    if sys.stdout.isatty():
        raise click.UsageError("serve writes a migration stream to stdout: run it as QEMU's -incoming exec:")
    with open_image(image, parents, disks, check_disk_identity=not any_disk_identity) as img:
        for path in (stats_path, record_faults):
            if path:
                guard_output(path, inputs_of(img, disks) + ([working_set] if working_set else []), force)
        from ..format import PageClass
        from ..inspect import class_counts

        counts = class_counts(img)
        travelling = sum(counts.values()) - counts[PageClass.ZERO] - counts[PageClass.FREE]
        with ui.progress(travelling, "serve (pages)") as advance:
            stats = restore_target("qemu").serve(
                img,
                sys.stdout.buffer,
                sys.stdin.buffer,
                strategy=prepage,
                stats_path=stats_path,
                log=_serve_log,
                progress=advance,
                working_set=working_set,
                record_faults=record_faults,
                precopy_seconds=precopy_seconds,
            )
    if as_json:
        ui.emit_json(dict(asdict(stats), image=image))


def _serve_log(message: str) -> None:
    """serve's warnings and summary line: on standard error, not with --quiet; --json replaces them."""
    if not ui.wants_json():
        ui.note(f"leanimg: {message}")
