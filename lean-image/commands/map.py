"""``leanimg map``: an image's contiguous extents and where their bytes are, as ``qemu-img map``
gives them (lean-image/extent_map.py)."""

from __future__ import annotations

import sys

import click

from ..output import json_option, verbosity_options
from .common import IMAGE, disk_option, open_image, parent_option, parse_disks


@click.command("map")
@click.argument("image", type=IMAGE)
@click.option(
    "--output",
    "output_format",
    type=click.Choice(["human", "json"]),
    default="human",
    show_default=True,
    help="human: one line per extent; json: as lean-image/schemas/map.schema.json.",
)
@json_option
@verbosity_options
@parent_option
@disk_option
def map_command(image, output_format, as_json, parents, disks):
    """List IMAGE's contiguous extents: region, start (byte offset in the region; guest-physical
    address where the region has one), pages, class and where the bytes are (a frame of this
    file, the parent image, a disk sector, a delta frame)."""
    from ..extent_map import write_human, write_json

    paths = parse_disks(disks)
    with open_image(image, parents, ()) as img:
        if None in paths and len(img.disks) == 1:
            paths[img.disks[0].name] = paths.pop(None)
        (write_json if as_json or output_format == "json" else write_human)(img, sys.stdout, paths)
