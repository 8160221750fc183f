"""``leanimg merge``: an image folded into its parent, one link fewer in the chain."""

from __future__ import annotations

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import IMAGE, disk_option, force_option, guard_output, inputs_of, open_image, parent_option, report_rebase


@click.command("merge")
@click.argument("image", type=IMAGE)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The image to write.")
@json_option
@verbosity_options
@click.option("--delta/--no-delta", default=True, show_default=True, help="Re-encode changed pages as deltas.")
@parent_option
@disk_option
@force_option
def merge(image, output, as_json, delta, parents, disks, force):
    """Fold IMAGE into its parent: OUTPUT has IMAGE's memory and IMAGE's grandparent as parent.

    Use it to keep chains short: merging link k into link k-1 removes one level.
    """
    from ..errors import ChainError
    from ..incremental import rebase

    with open_image(image, parents, disks) as img:
        if img.parent is None:
            raise ChainError("the image has no parent to merge into; use flatten")
        guard_output(output, inputs_of(img, disks), force, object_ok=True)
        ancestors = [link.path for link in img.parent.chain()[1:]]
        ui.detail(f"merging {image} into its parent {img.parent.path}: {output}")
        with ui.progress(sum(r.size_bytes for r in img.regions), "merge") as advance:
            rebase(img, output, img.parent.parent, allow_delta=delta, progress=advance)
        report_rebase(output, as_json, ancestors)
