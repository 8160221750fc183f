"""``leanimg validate``: every finding of every rule, for one image or each link of its chain."""

from __future__ import annotations

import sys

import click

from .. import output as ui
from ..output import json_option, verbosity_options
from .common import (
    IMAGE,
    chain_paths,
    disk_option,
    disk_sources,
    parent_option,
    parse_disks,
    validate_status,
    verdict_of,
)


@click.command("validate")
@click.argument("image", type=IMAGE)
@json_option
@verbosity_options
@click.option(
    "--chain", "whole_chain", is_flag=True, help="Validate every link of IMAGE's chain, each against its own parent."
)
@parent_option
@disk_option
def validate(image, as_json, whole_chain, parents, disks):
    """Strict conformance check of IMAGE. Exit 0 valid, 1 invalid, 4 no violation found but some rules
    not checked (a parent or disk not given)."""
    from ..validate import validate as run
    from ..validate import work_bytes

    links = chain_paths(image, parents) if whole_chain else [image]
    paths = parse_disks(disks)
    from ..s3 import take_fetched

    reports = []
    take_fetched()
    for link in links:
        ui.detail(f"validating {link}")
        with disk_sources(paths) as sources:
            chain = list(parents) + links
            with ui.progress(work_bytes(link, disks=sources, parents=chain), "validate") as advance:
                reports.append(run(link, disks=sources, parents=chain, progress=advance))
        reports[-1].fetched = take_fetched()
    if as_json:
        body = [r.to_json() for r in reports]
        ui.emit_json(body if whole_chain else body[0])
    else:
        for report in reports:
            _print_report(report)
    sys.exit(validate_status(reports))


def _print_report(report) -> None:
    from ..rules import describe

    for finding in report.findings:
        click.echo(str(finding))
        click.echo(f"    rule: {describe(finding.rule)}")
    for rule, count in report.suppressed.items():
        click.echo(f"{rule}: {count} more findings not shown")
    for note in report.not_checked_reasons:
        click.echo(f"not checked: {note}")
    if report.fetched:
        from ..s3 import fetched_lines

        ui.note("\n".join(line.strip() for line in fetched_lines(report.fetched)))
    checked = ", ".join(f"{v} {k}" for k, v in sorted(report.checked.items()))
    verdict = verdict_of(report)
    ui.summary(f"{report.path}: {verdict}; checked {checked}")
