"""``leanimg restore``: guest memory rebuilt from an image by a target plugin (raw, qemu, libvirt, xen, ...)."""

from __future__ import annotations

import sys

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import (
    IMAGE,
    disk_option,
    force_option,
    guard_output,
    inputs_of,
    installed_plugin,
    open_image,
    parent_option,
    switch_option,
)


@click.command("restore")
@click.argument("image", type=IMAGE)
@click.option(
    "--to",
    "target",
    default="raw",
    show_default=True,
    metavar="raw|qemu|qemu-mapped-ram|libvirt|xen|PLUGIN",
    callback=lambda ctx, param, value: installed_plugin("leanimg.targets", param, value),
    help="raw: flat guest memory; qemu: a migration stream for `qemu -incoming`; "
    "qemu-mapped-ram: a QEMU mapped-ram file (QEMU >= 9.0, needs -o FILE); "
    "libvirt: libvirt's save image the image came from (virsh restore / virsh start); "
    "xen: the Xen save file (xl, libxl or libxc stream) the image came from; "
    "or an installed target plugin's name (leanimg plugins).",
)
@click.option("-o", "--output", required=True, metavar="FILE|-", help="Output file, or - for stdout.")
@json_option
@verbosity_options
@parent_option
@disk_option
@switch_option(
    "--sort-blocks/--no-sort-blocks",
    "Read disk blocks in ascending physical order, coalesced (off: one read per page).",
)
@click.option(
    "--any-disk-identity",
    is_flag=True,
    help="Accept a disk whose size or fingerprint differs from the disk table (a copy made "
    "another way, a disk known to have changed elsewhere); every block is still checked.",
)
@force_option
def restore(image, target, output, as_json, parents, disks, sort_blocks, any_disk_identity, force):
    """Rebuild guest memory from IMAGE, every page checked against its digest.

    --to raw writes the regions in file order, concatenated (spec §11).
    --to qemu rebuilds the QEMU migration stream the image was converted from:
    qemu-system-x86_64 ... -incoming "exec:leanimg restore IMG --to qemu -o -"
    --to qemu-mapped-ram writes a sparse QEMU mapped-ram file (QEMU >= 9.0:
    migrate-incoming file:FILE with the capability mapped-ram set).
    --to libvirt rebuilds libvirt's save image (`virsh restore FILE`, or managedsave's
    file and `virsh start DOM`): header and domain XML verbatim, then the stream.
    --to xen rebuilds the Xen save file (`xl restore FILE`) in the form it had.
    """
    import time

    from ..fileutil import write_atomically
    from ..plugins import target as restore_target
    from ..results import restore_line, restore_result

    if output == "-":
        ui.stdout_is_data()
    produce = restore_target(target).restore
    started = time.monotonic()
    with open_image(image, parents, disks, check_disk_identity=not any_disk_identity) as img:
        guard_output(output, inputs_of(img, disks), force)
        for link in img.chain():
            link.sort_blocks = sort_blocks
        total = sum(r.size_bytes for r in img.regions)
        ui.detail(f"restoring {total / 2**20:.1f} MiB of {image} ({len(img.chain())} link(s)) as {target}")
        with ui.progress(total, "restore") as advance:
            if output == "-":
                produce(img, sys.stdout.buffer, advance)
            else:
                write_atomically(output, lambda out: produce(img, out, advance))
        result = restore_result(img, output, target, time.monotonic() - started)
    if as_json:
        ui.emit_json(result)
    ui.summary(restore_line(result))
