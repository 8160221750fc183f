"""``leanimg demo``: the bundled real QEMU save taken through the other commands."""

from __future__ import annotations

import sys

import click

from .common import EXIT_INVALID


@click.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the files here.")
def demo(workdir):
    """Convert, inspect, validate, restore and verify the bundled real QEMU save."""
    from ..demo import run_demo

    sys.exit(0 if run_demo(workdir) else EXIT_INVALID)
