"""What the commands share: exit codes, the IMAGE argument type, the --disk, --parent, -o and -f
options and factories of the options several commands take alike, opening an image with its
chain and disks, and refusing an output that would overwrite an input (JSON output, -q/-v and
the summary line: ``leanimg.output``)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import click

from .. import output as ui

EXIT_INVALID = 1
EXIT_INTERNAL = 3
EXIT_NOT_CHECKED = 4


def parse_disks(values) -> dict:
    """``[NAME=]PATH`` values by name; a value without NAME is filed under None."""
    disks = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or "/" in name:
            name, path = None, value
        if not path or name == "":
            raise click.BadParameter(f"expected [NAME=]PATH, got {value!r}", param_hint="--disk")
        if name in disks:
            raise click.BadParameter(f"disk {name or 'without a name'} given twice", param_hint="--disk")
        disks[name] = path
    return disks


def open_disks(paths: dict, *, name_from_file: bool = False) -> dict:
    """The parsed --disk values opened as disk sources by NAME; where it was left out, under
    None (the image's only disk) or, with ``name_from_file``, the file name's stem."""
    if not paths:  # leanimg.disks (numpy, subprocess) imported only when there are disks
        return {}
    from ..disks import open_disk

    sources = {}
    try:
        for name, path in paths.items():
            stem = os.path.splitext(os.path.basename(path))[0]
            if name_from_file:
                name = name or stem
                if name in sources:
                    raise click.BadParameter(f"two disks named {name!r}: give NAME=PATH", param_hint="--disk")
            sources[name] = open_disk(path, name or stem)
    except BaseException:
        close_disks(sources)
        raise
    return sources


def close_disks(sources: dict) -> None:
    for source in sources.values():
        source.close()


@contextmanager
def disk_sources(paths: dict, **options):
    """The parsed --disk values opened for the block (an image they are attached to closes them too)."""
    sources = open_disks(paths, **options)
    try:
        yield sources
    finally:
        close_disks(sources)


@contextmanager
def open_image(image, parents, disks, check_disk_identity: bool = True):
    """IMAGE with its chain and the --disk sources attached."""
    from ..reader import LeanImage

    paths = parse_disks(disks)
    with LeanImage.open(image, parents=parents) as img, disk_sources(paths) as sources:
        img.attach_disks(sources, check_identity=check_disk_identity)
        yield img


class ImageLocation(click.ParamType):
    """An image: an existing file, or an object in S3-compatible storage (s3://BUCKET/KEY),
    looked up when opened."""

    name = "image"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.startswith("s3://"):
            from ..s3 import StoreError, split

            try:
                split(value)
            except StoreError as exc:
                self.fail(exc.message, param, ctx)
            return value
        return click.Path(exists=True, dir_okay=False).convert(value, param, ctx)


IMAGE = ImageLocation()

disk_option = click.option(
    "--disk",
    "disks",
    multiple=True,
    metavar="[NAME=]PATH",
    help="A disk of the image's disk table, raw or qcow2 (repeatable; NAME may be "
    "left out when the image has one disk).",
)
parent_option = click.option(
    "--parent",
    "parents",
    multiple=True,
    type=IMAGE,
    metavar="IMG",
    help="An image of the parent chain (repeatable; matched by UUID; images beside IMAGE are found without it).",
)


force_option = click.option(
    "-f", "--force", is_flag=True, help="Replace an existing output file (an input of the command never is)."
)
lean_output_option = click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="The lean image to write."
)


def file_option(*decls: str, help: str, exists: bool = False):
    """An option naming a FILE: one the command writes, or with ``exists`` one it reads."""
    return click.option(*decls, type=click.Path(exists=exists, dir_okay=False), metavar="FILE", help=help)


def switch_option(flags: str, help: str):
    """A ``--X/--no-X`` switch that is on unless turned off."""
    return click.option(flags, default=True, show_default=True, help=help)


def incremental_options(parent_help: str, delta_help: str):
    """--parent PREV.lean (repeatable: PREV's ancestors) and --delta/--no-delta: write an
    incremental image against PREV, its changed pages as deltas where smaller (checkpoint, convert)."""
    parent = click.option("--parent", "parents", multiple=True, type=IMAGE, metavar="PREV.lean", help=parent_help)
    delta = switch_option("--delta/--no-delta", delta_help)
    return lambda function: parent(delta(function))


def level_option(help: str):
    """--level: the zstd level of the pages written (1-22, default 3)."""
    return click.option("--level", default=3, show_default=True, type=click.IntRange(1, 22), help=help)


def guard_output(output, inputs, force: bool, object_ok: bool = False) -> None:
    """Refuse an output that is one of the command's inputs (by path, hard or symbolic link;
    an object by bucket and key), an existing file or object without --force, or binary output
    to a terminal without --force. An object (s3://) only where ``object_ok``."""
    from ..fileutil import OutputRefused, check_output

    if output.startswith("s3://"):
        if not object_ok:
            raise click.UsageError(
                f"cannot write {output}: this command writes a local file or - (only "
                "images are written to object storage)"
            )
        from ..locations import check_object_output

        try:
            check_object_output(output, [os.fspath(p) for p in inputs], force=force)
        except OutputRefused as exc:
            raise click.UsageError(str(exc)) from None
        return
    if output == "-":
        if sys.stdout.isatty() and not force:
            raise click.UsageError("refusing to write binary output to a terminal: redirect it, or use -f")
        return
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise click.UsageError(f"cannot write {output}: directory {directory} does not exist")
    try:
        check_output(output, [os.fspath(p) for p in inputs], force=force)
    except OutputRefused as exc:
        raise click.UsageError(str(exc)) from None


def output_exists(name) -> bool:
    from ..locations import exists

    return exists(name)


def inputs_of(img, disks=()) -> list:
    """The files a command on the open image ``img`` reads: every link of its chain, its disks."""
    return [link.path for link in img.chain()] + list(parse_disks(disks).values())


def chain_paths(image, parents) -> list[str]:
    """IMAGE and the paths of its ancestors, child first."""
    from ..reader import LeanImage

    with LeanImage.open(image, parents=parents) as img:
        return [link.path for link in img.chain()]


def prev_chain(parents, output) -> list[str]:
    """The links of PREV's chain (the first --parent's), which an incremental OUTPUT must not
    overwrite; opened to name them only when OUTPUT exists (it could be one of them)."""
    return chain_paths(parents[0], parents) if parents and output_exists(output) else []


def verdict_of(report) -> str:
    if not report.valid:
        return f"INVALID ({len(report.findings)} findings)"
    return "valid" if report.complete else "no violation found, but not every rule checked (see above)"


def validate_status(reports) -> int:
    """0 valid and every rule checked, 1 invalid, 4 no finding but some rules not checked (a
    parent or disk not given): like qemu-img check, "could not check" is not "valid"."""
    if not all(r.valid for r in reports):
        return EXIT_INVALID
    return 0 if all(r.complete for r in reports) else EXIT_NOT_CHECKED


def report_rebase(output, as_json: bool, parents=()) -> None:
    from ..results import image_line, written_image

    result = written_image(output, parents)
    if as_json:
        ui.emit_json(result)
    ui.summary(image_line(result))


def installed_plugin(group: str, param, value):
    """A --to/--from value that names an installed plugin of ``group`` (a usage error otherwise)."""
    from ..plugins import is_installed, names

    if value is not None and not is_installed(group, value):
        raise click.BadParameter(
            f"{value!r} is not an installed plugin (installed: {', '.join(names(group))})", param=param
        )
    return value
