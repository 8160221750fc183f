"""``leanimg checkpoint``: a running QEMU checkpointed over QMP straight into a lean image
(converters/checkpoint.py, reached as a plugin)."""

from __future__ import annotations

import os
import sys

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import (
    file_option,
    force_option,
    guard_output,
    incremental_options,
    lean_output_option,
    level_option,
    parse_disks,
    prev_chain,
)


@click.command("checkpoint")
@click.option(
    "--qmp",
    "qmp_socket",
    required=True,
    metavar="SOCKET",
    help="QEMU's QMP unix socket (-qmp unix:SOCKET,server=on,wait=off); QEMU serves one "
    "client per socket, so give leanimg its own.",
)
@lean_output_option
@json_option
@verbosity_options
@click.option(
    "--live",
    "mode",
    flag_value="live",
    help="Precopy while the guest runs; the migration's final pause is the checkpoint instant.",
)
@click.option(
    "--background",
    "mode",
    flag_value="background",
    help="QEMU's background-snapshot: the guest "
    "runs on, every page is sent once as of the instant the snapshot starts.",
)
@click.option(
    "--then",
    "then",
    type=click.Choice(["continue", "stop", "quit"]),
    default="continue",
    show_default=True,
    help="Afterwards: the guest runs on (if it ran), stays paused, or QEMU quits.",
)
@click.option(
    "--disk",
    "disks",
    multiple=True,
    metavar="NAME=PATH",
    help="A file of the guest's disk (repeatable): pages found on it become disk references. "
    "With --then continue the disk is frozen at the checkpoint instant (the guest writes to a new "
    "qcow2 overlay beside it from then on).",
)
@incremental_options(
    "Write an incremental image against PREV (more: PREV's ancestors).", "8-byte-word deltas (with --parent)."
)
@level_option("zstd level.")
@click.option(
    "--max-bandwidth",
    type=click.IntRange(1),
    metavar="MIB/S",
    help="Limit the migration (default: as fast as leanimg reads).",
)
@click.option(
    "--balloon-inflate",
    type=click.IntRange(1),
    metavar="MIB",
    help="Inflate the guest's virtio-balloon by MIB first (its pages save as zeros) and deflate it "
    "afterwards; the image records the size before (restored guests: QMP balloon value=BEFORE).",
)
@file_option("--keep-stream", help="Also write QEMU's raw migration stream to FILE (for debugging: a full-size file).")
@click.option(
    "--guest-free",
    metavar="SOCKET",
    help="With --live: ask the guest's free-list helper "
    "(leanimg-guest-free, on the virtio-serial port org.leanimg.free.0 that QEMU connects to SOCKET) for "
    "its free pages while the precopy runs; pages not sent again after its answer become FREE.",
)
@file_option(
    "--keep-hints", help="With --guest-free: also write the FREE hints taken from the guest to FILE (spec/hints.md)."
)
@force_option
def checkpoint(
    qmp_socket,
    output,
    as_json,
    mode,
    then,
    disks,
    parents,
    delta,
    level,
    max_bandwidth,
    balloon_inflate,
    keep_stream,
    guest_free,
    keep_hints,
    force,
):
    """Checkpoint a running QEMU 7.2 over QMP straight into a lean image (no save file)."""
    from ..errors import CheckpointInterrupted
    from ..plugins import checkpointer

    paths = {name or os.path.splitext(os.path.basename(path))[0]: path for name, path in parse_disks(disks).items()}
    for path in paths.values():
        if not os.path.isfile(path):
            raise click.BadParameter(f"{path} is not a file", param_hint="--disk")
    chain = prev_chain(parents, output)
    inputs = [*parents, *chain, *paths.values()]
    guard_output(output, inputs, force, object_ok=True)
    if keep_stream:
        guard_output(keep_stream, [*inputs, output], force)
    if guest_free and mode != "live":
        raise click.UsageError(
            "--guest-free needs --live: in a stop-and-save or a background snapshot a page the "
            "guest writes after its answer is not sent again (spec/hints.md §3.1)"
        )
    if keep_hints and not guest_free:
        raise click.UsageError("--keep-hints needs --guest-free")
    if keep_hints:
        guard_output(keep_hints, [*inputs, output], force)
    writer = checkpointer("qemu")
    request = writer.Request(
        qmp=qmp_socket,
        output=output,
        mode=mode or "stop",
        then=then,
        disks=paths,
        parents=parents,
        allow_delta=delta,
        writer_options=dict(level=level),
        max_bandwidth=max_bandwidth and max_bandwidth << 20,
        keep_stream=keep_stream,
        balloon_inflate=(balloon_inflate or 0) << 20,
        guest_free=guest_free,
        keep_hints=keep_hints,
        progress=ui.show_progress(),
    )
    try:
        result = writer.checkpoint(request)
    except CheckpointInterrupted as exc:
        click.echo(f"leanimg: error: {exc}", err=True)
        ui.error(exc.message, 128 + exc.signum, kind="interrupted")
        sys.exit(128 + exc.signum)
    for line in result.timeline_lines():
        ui.detail(f"checkpoint {line}")
    if as_json:
        ui.emit_json(result.to_json())
    ui.summary(result.summary())
