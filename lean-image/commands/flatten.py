"""``leanimg flatten``: an image and its chain written as one self-contained image."""

from __future__ import annotations

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import IMAGE, disk_option, force_option, guard_output, inputs_of, open_image, parent_option, report_rebase


@click.command("flatten")
@click.argument("image", type=IMAGE)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The image to write.")
@json_option
@verbosity_options
@parent_option
@disk_option
@force_option
def flatten(image, output, as_json, parents, disks, force):
    """Write IMAGE as a self-contained image: no parent, same memory, same source state."""
    from ..incremental import rebase

    with open_image(image, parents, disks) as img:
        guard_output(output, inputs_of(img, disks), force, object_ok=True)
        ui.detail(f"flattening the {len(img.chain())} link(s) of {image} into {output}")
        with ui.progress(sum(r.size_bytes for r in img.regions), "flatten") as advance:
            rebase(img, output, None, progress=advance)
    report_rebase(output, as_json)
