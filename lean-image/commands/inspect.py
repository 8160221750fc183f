"""``leanimg inspect``: what is in an image, as text, JSON or a picture of guest memory."""

from __future__ import annotations

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import IMAGE, disk_option, force_option, guard_output, inputs_of, open_image, parent_option


@click.command("inspect")
@click.argument("image", type=IMAGE)
@json_option
@verbosity_options
@click.option(
    "--map",
    "map_path",
    type=click.Path(dir_okay=False),
    metavar="FILE.png|FILE.svg",
    help="Draw guest memory coloured by page class: PNG (needs Pillow: pip install 'leanimg[map]') "
    "or, for a name ending in .svg, SVG.",
)
@click.option(
    "--files",
    "with_files",
    is_flag=True,
    help="Name the files (ext2/3/4, via debugfs) the DISK pages came from; needs --disk.",
)
@parent_option
@disk_option
@force_option
def inspect(image, as_json, map_path, with_files, parents, disks, force):
    """Header, regions, disks, chain and a per-class breakdown of IMAGE."""
    from ..inspect import render_text, summarize

    with open_image(image, parents, disks) as img:
        if map_path:
            guard_output(map_path, inputs_of(img, disks), force)
        summary = summarize(img)
        if with_files:
            from ..inspect import disk_files

            summary["disk_files"] = disk_files(img)
        if map_path:
            from ..memory_picture import render_map

            render_map(img, map_path)
            summary["map"] = map_path
    from ..s3 import take_fetched

    if fetched := take_fetched():
        summary["fetched"] = fetched
    if as_json:
        ui.emit_json(summary)
    else:
        ui.report(render_text(summary))
