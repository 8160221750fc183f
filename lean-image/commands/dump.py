"""``leanimg dump``: every structure of an image as JSON, as ``crit decode`` gives them
(lean-image/structure_dump.py)."""

from __future__ import annotations

import sys

import click

from ..output import json_option, verbosity_options
from .common import IMAGE


@click.command("dump")
@click.argument("image", type=IMAGE)
@click.option(
    "--payloads",
    is_flag=True,
    help="Give every byte string in full (default: those over 64 "
    "bytes, such as compressed frames, as their length and first 16 bytes).",
)
@json_option
@verbosity_options
def dump_command(image, payloads, as_json):
    """Every structure of IMAGE as JSON: header, records in file order with their fields, footer
    (lean-image/schemas/dump.schema.json)."""
    from ..structure_dump import write_dump

    write_dump(image, sys.stdout, payloads)
