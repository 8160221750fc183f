"""``leanimg plugins``: the installed source, target and checkpoint plugins (lean-image/plugins.py)."""

from __future__ import annotations

import click

from .. import output as ui
from ..output import json_option, verbosity_options


@click.command("plugins")
@json_option
@verbosity_options
def plugins_command(as_json):
    """List the installed source formats, restore targets and checkpoint writers, with the distribution that
    provides each; a plugin that cannot be loaded is listed as BROKEN with the reason."""
    from ..plugin_list import render_text
    from ..plugins import installed

    found = installed()
    if as_json:
        ui.emit_json([p.to_json() for p in found])
    else:
        ui.report(render_text(found))
