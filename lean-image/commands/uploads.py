"""``leanimg uploads``: the multipart uploads an interrupted writer left in object storage."""

from __future__ import annotations

import click

from .. import output as ui
from ..output import json_option, verbosity_options


@click.command("uploads")
@click.argument("location", metavar="s3://BUCKET[/PREFIX]")
@click.option("--abort", "abort", is_flag=True, help="Abort every upload listed (its parts are deleted).")
@json_option
@verbosity_options
def uploads(location, abort, as_json):
    """List the multipart uploads under s3://BUCKET[/PREFIX] never completed nor aborted.

    A writer killed with SIGKILL (or a host that died) leaves its upload behind: never an
    object under the image's key, but parts the store keeps (and bills) until aborted. Any
    other interruption aborts the upload itself. A lifecycle rule
    (AbortIncompleteMultipartUpload) does the same in stores that support one.
    """
    from .. import s3

    if not location.startswith(s3.SCHEME) or not location[len(s3.SCHEME) :].partition("/")[0]:
        raise click.BadParameter(f"expected s3://BUCKET[/PREFIX], got {location!r}", param_hint="LOCATION")
    found = s3.incomplete_uploads(location)
    if abort:
        for upload in found:
            s3.abort_upload(upload["location"], upload["upload_id"])
    if as_json:
        ui.emit_json({"uploads": found, "aborted": abort})
    for upload in [] if as_json else found:
        click.echo(
            f"{upload['initiated']}  {upload['location']}  {upload['upload_id']}" + ("  aborted" if abort else "")
        )
    ui.summary(f"{len(found)} incomplete upload(s) under {location}" + (", aborted" if abort and found else ""))
