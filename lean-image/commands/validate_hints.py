"""``leanimg validate-hints``: a hint file checked against spec/hints.md (and a save or an image)."""

from __future__ import annotations

import sys

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import validate_status, verdict_of


@click.command("validate-hints")
@click.argument("hints_file", metavar="FILE", type=click.Path(exists=True, dir_okay=False))
@click.option("--save", type=click.Path(exists=True, dir_okay=False), help="The save the hints are for.")
@click.option("--image", type=click.Path(exists=True, dir_okay=False), help="An image converted from that save.")
@json_option
@verbosity_options
def validate_hints(hints_file, save, image, as_json):
    """Check a hint file against spec/hints.md. Exit 0 valid, 1 invalid, 4 no violation found but
    some rules not checked (no --save or --image)."""
    from ..rules import describe
    from ..validate_hints import validate_hints as run

    if save and image:
        raise click.UsageError("give --save or --image, not both")
    report = run(hints_file, save=save, image=image)
    if as_json:
        ui.emit_json(report.to_json())
    else:
        for finding in report.findings:
            where = f"offset {finding.offset:#x}" if finding.offset is not None else "offset -"
            click.echo(f"{finding.rule} {where} {finding.structure}: {finding.message}")
            click.echo(f"    rule: {describe(finding.rule)}")
        for rule, count in report.suppressed.items():
            click.echo(f"{rule}: {count} more findings not shown")
        for note in report.not_checked_reasons:
            click.echo(f"not checked: {note}")
        verdict = verdict_of(report)
        ui.summary(f"{hints_file}: {verdict}; {report.records} hint records")
    sys.exit(validate_status([report]))
