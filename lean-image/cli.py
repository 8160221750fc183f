"""The `leanimg` command line. Exit codes: 0 ok, 1 bad input, 2 usage, 3 internal error, 4 (validate) not every rule checked."""

from __future__ import annotations

import os
import signal
import stat
import sys
import traceback
from contextlib import contextmanager

# numpy's OpenBLAS starts a thread per core when imported (~0.1 s of CPU per command);
# leanimg does no linear algebra.  Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402

from . import output as ui
from .errors import LeanImageError
from .output import json_option, verbosity_options

EXIT_INVALID = 1
EXIT_INTERNAL = 3
EXIT_NOT_CHECKED = 4


class LeanGroup(click.Group):
    """Turns library errors into one clear line and exit 1, bugs into exit 3."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LeanImageError as exc:
            click.echo(f"leanimg: error: {exc}", err=True)
            hint = _hint(exc)
            if hint:
                click.echo(f"leanimg: hint: {hint}", err=True)
            ui.error(
                exc.message,
                EXIT_INVALID,
                kind="invalid",
                offset=exc.offset,
                structure=exc.structure,
                rule=exc.rule,
                path=exc.path,
                hint=hint,
            )
            ctx.exit(EXIT_INVALID)
        except click.ClickException as exc:  # usage errors: click prints them
            ui.error(exc.format_message(), exc.exit_code, kind="usage")
            raise
        except (click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            ctx.exit(EXIT_INVALID)
        except MemoryError as exc:  # the environment too: an input larger than this process may hold
            message = (
                f"out of memory{': ' + str(exc) if str(exc) else ''} "
                "(the input needs more memory than this process may use)"
            )
            click.echo(f"leanimg: error: {message}", err=True)
            ui.error(message, EXIT_INVALID, kind="environment")
            ctx.exit(EXIT_INVALID)
        except OSError as exc:  # the environment (a full disk, a permission), not a bug
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"leanimg: error: {where}{exc.strerror or exc}", err=True)
            ui.error(
                str(exc.strerror or exc),
                EXIT_INVALID,
                kind="environment",
                path=os.fspath(exc.filename) if exc.filename else None,
            )
            ctx.exit(EXIT_INVALID)
        except Exception as exc:  # a bug in leanimg, not bad input
            click.echo(f"leanimg: internal error: {type(exc).__name__}: {exc}", err=True)
            if os.environ.get("LEANIMG_DEBUG"):
                traceback.print_exc()
            else:
                click.echo("leanimg: set LEANIMG_DEBUG=1 for a traceback and please report it", err=True)
            ui.error(f"{type(exc).__name__}: {exc}", EXIT_INTERNAL, kind="internal")
            ctx.exit(EXIT_INTERNAL)


def _hint(exc: LeanImageError) -> str | None:
    if exc.rule == "LI-HDR-001" and exc.path and os.path.exists(exc.path):
        from .plugins import HEAD_BYTES, find_source

        with open(exc.path, "rb") as f:
            source = find_source(f.read(HEAD_BYTES))
        if source is not None:
            return f"this looks like {source.description}: convert it with `leanimg convert`"
    if exc.rule == "LI-FTR-001":
        return "an image without a valid footer is incomplete (was the writer interrupted?)"
    return None


def _parse_disks(values) -> dict:
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


def _open_disks(paths: dict, *, name_from_file: bool = False) -> dict:
    """The parsed --disk values opened as disk sources by NAME; where it was left out, under
    None (the image's only disk) or, with ``name_from_file``, the file name's stem."""
    from .disks import open_disk

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
        _close_disks(sources)
        raise
    return sources


def _close_disks(sources: dict) -> None:
    for source in sources.values():
        source.close()


@contextmanager
def _disk_sources(paths: dict, **options):
    """The parsed --disk values opened for the block (an image they are attached to closes them too)."""
    sources = _open_disks(paths, **options)
    try:
        yield sources
    finally:
        _close_disks(sources)


@contextmanager
def _open_image(image, parents, disks, check_disk_identity: bool = True):
    """IMAGE with its chain and the --disk sources attached."""
    from .reader import LeanImage

    paths = _parse_disks(disks)
    with LeanImage.open(image, parents=parents) as img, _disk_sources(paths) as sources:
        img.attach_disks(sources, check_identity=check_disk_identity)
        yield img


class _ImageLocation(click.ParamType):
    """An image: an existing file, or an object in S3-compatible storage (s3://BUCKET/KEY),
    looked up when opened."""

    name = "image"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.startswith("s3://"):
            from .s3 import StoreError, split

            try:
                split(value)
            except StoreError as exc:
                self.fail(exc.message, param, ctx)
            return value
        return click.Path(exists=True, dir_okay=False).convert(value, param, ctx)


IMAGE = _ImageLocation()

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


def _guard_output(output, inputs, force: bool, object_ok: bool = False) -> None:
    """Refuse an output that is one of the command's inputs (by path, hard or symbolic link;
    an object by bucket and key), an existing file or object without --force, or binary output
    to a terminal without --force. An object (s3://) only where ``object_ok``."""
    from .fileutil import OutputRefused, check_output

    if output.startswith("s3://"):
        if not object_ok:
            raise click.UsageError(
                f"cannot write {output}: this command writes a local file or - (only "
                "images are written to object storage)"
            )
        from .locations import check_object_output

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


def _exists(name) -> bool:
    from .locations import exists

    return exists(name)


def _inputs_of(img, disks=()) -> list:
    """The files a command on the open image ``img`` reads: every link of its chain, its disks."""
    return [link.path for link in img.chain()] + list(_parse_disks(disks).values())


def command_line() -> list[str]:
    """The command that runs this CLI in the current environment (for tests and benchmarks)."""
    script = os.path.join(os.path.dirname(sys.executable), "leanimg")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "leanimg.cli"]


def _exit_on_sigterm(signum, frame):
    """Unwind like SIGINT does, so writers remove their temporary files."""
    sys.exit(128 + signum)


@click.group(cls=LeanGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="leanimg")
@verbosity_options
def main():
    """Lean VM memory images: convert, inspect, validate, restore.

    Exit status: 0 ok, 1 bad input, 2 usage error, 3 internal error, 4 (validate,
    validate-hints) no violation found but not every rule checked. -q/-v may be given
    before the command or after it.
    """
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _raise_open_file_limit()
    try:
        from . import native  # noqa: F401  (LEANIMG_NATIVE checked here, not by the first page read)
    except ImportError as exc:
        raise click.UsageError(str(exc)) from None


def _raise_open_file_limit() -> None:
    """Each link of a chain keeps its file open; chains may be 4096 deep (spec §9.1)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@main.command()
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
    from .inspect import render_text, summarize

    with _open_image(image, parents, disks) as img:
        if map_path:
            _guard_output(map_path, _inputs_of(img, disks), force)
        summary = summarize(img)
        if with_files:
            from .inspect import disk_files

            summary["disk_files"] = disk_files(img)
        if map_path:
            from .memory_picture import render_map

            render_map(img, map_path)
            summary["map"] = map_path
    from .s3 import take_fetched

    if fetched := take_fetched():
        summary["fetched"] = fetched
    if as_json:
        ui.emit_json(summary)
    else:
        ui.report(render_text(summary))


@main.command()
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
    from .validate import validate as run
    from .validate import work_bytes

    links = _chain_paths(image, parents) if whole_chain else [image]
    paths = _parse_disks(disks)
    from .s3 import take_fetched

    reports = []
    take_fetched()
    for link in links:
        ui.detail(f"validating {link}")
        with _disk_sources(paths) as sources:
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
    sys.exit(_validate_status(reports))


def _verdict(report) -> str:
    if not report.valid:
        return f"INVALID ({len(report.findings)} findings)"
    return "valid" if report.complete else "no violation found, but not every rule checked (see above)"


def _validate_status(reports) -> int:
    """0 valid and every rule checked, 1 invalid, 4 no finding but some rules not checked (a
    parent or disk not given): like qemu-img check, "could not check" is not "valid"."""
    if not all(r.valid for r in reports):
        return EXIT_INVALID
    return 0 if all(r.complete for r in reports) else EXIT_NOT_CHECKED


def _chain_paths(image, parents) -> list[str]:
    """IMAGE and the paths of its ancestors, child first."""
    from .reader import LeanImage

    with LeanImage.open(image, parents=parents) as img:
        return [link.path for link in img.chain()]


def _print_report(report) -> None:
    from .rules import describe

    for finding in report.findings:
        click.echo(str(finding))
        click.echo(f"    rule: {describe(finding.rule)}")
    for rule, count in report.suppressed.items():
        click.echo(f"{rule}: {count} more findings not shown")
    for note in report.not_checked_reasons:
        click.echo(f"not checked: {note}")
    if report.fetched:
        from .s3 import fetched_lines

        ui.note("\n".join(line.strip() for line in fetched_lines(report.fetched)))
    checked = ", ".join(f"{v} {k}" for k, v in sorted(report.checked.items()))
    verdict = _verdict(report)
    ui.summary(f"{report.path}: {verdict}; checked {checked}")


@main.command()
@click.argument("image", type=IMAGE)
@click.option(
    "--to",
    "target",
    default="raw",
    show_default=True,
    metavar="raw|qemu|qemu-mapped-ram|libvirt|xen|PLUGIN",
    callback=lambda ctx, param, value: _installed_plugin("leanimg.targets", param, value),
    help="raw: flat guest memory; qemu: a migration stream for `qemu -incoming`; "
    "qemu-mapped-ram: a QEMU mapped-ram file (QEMU >= 9.0, needs -o FILE); "
    "libvirt: libvirt's save image the image came from (virsh restore / virsh start); "
    "xen: the Xen save file (xl, libxl or libxc stream) the image came from; "
    "or an installed target plugin's name (leanimg plugins).",
)
@click.option("-o", "--output", required=True, metavar="FILE|-", help="Output file, or - for stdout.")
@json_option
@verbosity_options
@parent_option
@disk_option
@click.option(
    "--sort-blocks/--no-sort-blocks",
    default=True,
    show_default=True,
    help="Read disk blocks in ascending physical order, coalesced (off: one read per page).",
)
@click.option(
    "--any-disk-identity",
    is_flag=True,
    help="Accept a disk whose size or fingerprint differs from the disk table (a copy made "
    "another way, a disk known to have changed elsewhere); every block is still checked.",
)
@force_option
def restore(image, target, output, as_json, parents, disks, sort_blocks, any_disk_identity, force):
    """Rebuild guest memory from IMAGE, every page checked against its digest.

    --to raw writes the regions in file order, concatenated (spec §11).
    --to qemu rebuilds the QEMU migration stream the image was converted from:
    qemu-system-x86_64 ... -incoming "exec:leanimg restore IMG --to qemu -o -"
    --to qemu-mapped-ram writes a sparse QEMU mapped-ram file (QEMU >= 9.0:
    migrate-incoming file:FILE with the capability mapped-ram set).
    --to libvirt rebuilds libvirt's save image (`virsh restore FILE`, or managedsave's
    file and `virsh start DOM`): header and domain XML verbatim, then the stream.
    --to xen rebuilds the Xen save file (`xl restore FILE`) in the form it had.
    """
    import time

    from .fileutil import write_atomically
    from .plugins import target as restore_target
    from .results import restore_line, restore_result

    if output == "-":
        ui.stdout_is_data()
    produce = restore_target(target).restore
    started = time.monotonic()
    with _open_image(image, parents, disks, check_disk_identity=not any_disk_identity) as img:
        _guard_output(output, _inputs_of(img, disks), force)
        for link in img.chain():
            link.sort_blocks = sort_blocks
        total = sum(r.size_bytes for r in img.regions)
        ui.detail(f"restoring {total / 2**20:.1f} MiB of {image} ({len(img.chain())} link(s)) as {target}")
        with ui.progress(total, "restore") as advance:
            if output == "-":
                produce(img, sys.stdout.buffer, advance)
            else:
                write_atomically(output, lambda out: produce(img, out, advance))
        result = restore_result(img, output, target, time.monotonic() - started)
    if as_json:
        ui.emit_json(result)
    ui.summary(restore_line(result))


@main.command()
@click.argument("save", metavar="SAVE|-")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The lean image to write.")
@json_option
@verbosity_options
@click.option(
    "--from",
    "source_format",
    metavar="qemu|libvirt|xen|PLUGIN",
    callback=lambda ctx, param, value: _installed_plugin("leanimg.sources", param, value),
    help="Force the source format (an installed source plugin's name: leanimg plugins).",
)
@click.option(
    "--spool/--no-spool",
    default=None,
    help="Assemble RAM in scratch files first, as a live save read from a pipe needs (default: only "
    "where needed, e.g. with --disk; a live save in a file is re-read instead).",
)
@click.option(
    "--level", default=3, show_default=True, type=click.IntRange(1, 22), help="zstd level of stored pages (1-22)."
)
@click.option(
    "--frame-pages",
    type=click.IntRange(1, 4096),
    help="Pages per zstd frame, at most 16 MiB of them (default: 2 MiB worth).",
)
@click.option(
    "--parent",
    "parents",
    multiple=True,
    type=IMAGE,
    metavar="PREV.lean",
    help="Write an incremental image against PREV (the first --parent); "
    "more --parent options name PREV's ancestors (also found beside PREV).",
)
@click.option(
    "--delta/--no-delta",
    default=True,
    show_default=True,
    help="Encode changed pages as 8-byte-word deltas when smaller (with --parent).",
)
@click.option(
    "--disk",
    "disks",
    multiple=True,
    metavar="[NAME=]PATH|NAME",
    help="A disk of the VM (raw or qcow2; repeatable): pages found on it become verified disk "
    "references. NAME (the guest's device name, e.g. vda) defaults to the file name's stem. NAME "
    "alone: the file the save names for it (a libvirt save's domain XML).",
)
@click.option(
    "--all-phases", is_flag=True, help="Scan every 512-byte phase of each disk, not only the partitions' own."
)
@click.option(
    "--hints",
    "hints_path",
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="Hints to apply (spec/hints.md): FREE by the stream-offset rule, DISK verified against "
    "--disk, UNCHANGED against --parent.",
)
@click.option(
    "--trust-dirty-log",
    is_flag=True,
    help="With --hints: pages hinted UNCHANGED that the stream never sends are taken from the parent.",
)
@click.option(
    "--disk-scan/--no-disk-scan",
    default=None,
    help="Scan the --disk disks for pages (default: yes, unless the hints have DISK hints).",
)
@force_option
def convert(
    save,
    output,
    as_json,
    source_format,
    spool,
    level,
    frame_pages,
    parents,
    delta,
    disks,
    all_phases,
    hints_path,
    trust_dirty_log,
    disk_scan,
    force,
):
    """Convert a hypervisor save file (QEMU migration stream, libvirt save image, Xen xl/libxl/libxc stream) into a lean image."""
    import time

    from .disks.partitions import scan_bytes
    from .results import convert_line, convert_result, written_image

    started, save_name = time.monotonic(), save
    # the parent's chain is opened to name its links only when OUTPUT exists: it could be one
    chain = _chain_paths(parents[0], parents) if parents and _exists(output) else []
    disk_paths = _disks_named_by_save(save, source_format, _parse_disks(disks))
    _guard_output(
        output, [save, *parents, *chain, *disk_paths.values(), *filter(None, [hints_path])], force, object_ok=True
    )
    hinting = _hint_options(hints_path, trust_dirty_log, disk_scan)
    with _disk_sources(disk_paths, name_from_file=True) as sources:
        if sources:  # the bar follows the disk scan, the part whose length depends on the disk
            total = sum(scan_bytes(d, 4096, all_phases) for d in sources.values())
            label = "scan disks"
        else:
            total, label = (os.path.getsize(save) if _plain_file(save) else 0), "convert"
        with ui.progress(total, label) as advance:
            source, save = _save_source(save, source_format)
            ui.detail(
                f"converting {'standard input' if save_name == '-' else save_name} as {source.name}"
                f"{' against ' + parents[0] if parents else ''} into {output}"
            )
            summary = source.convert(
                save,
                output,
                spool=spool,
                writer_options=dict(level=level, frame_pages=frame_pages),
                progress=None if sources else advance,
                parents=parents,
                allow_delta=delta,
                disks=sources,
                all_phases=all_phases,
                disk_progress=advance,
                **hinting,
            )
    if summary:
        _report_disk_pages(sources, summary)
    _report_hints(hinting)
    result = convert_result(
        save_name,
        written_image(output, parents),
        source.name,
        summary,
        hinting.get("hint_report"),
        time.monotonic() - started,
    )
    if as_json:
        ui.emit_json(result)
    ui.summary(convert_line(result))


def _disks_named_by_save(save: str, source_format: str | None, paths: dict) -> dict:
    """``--disk NAME`` alone (no such file): the file the save names for that device (libvirt's
    domain XML names each disk's file; a source plugin tells through ``disk_paths``)."""
    bare = [path for name, path in paths.items() if name is None and "/" not in path and not os.path.exists(path)]
    if not bare:
        return paths
    from . import plugins

    source = None
    if source_format:
        source = plugins.source(source_format)
    elif save != "-" and os.path.isfile(save):
        with open(save, "rb") as f:
            source = plugins.find_source(f.read(plugins.HEAD_BYTES))
    named = getattr(source, "disk_paths", None)
    found = named(save) if named and save != "-" else {}
    resolved = {}
    for name, path in paths.items():
        if name is not None or path not in bare:
            resolved[name] = path
            continue
        if path not in found:
            known = ", ".join(f"{k}={v}" for k, v in found.items()) or "none"
            raise click.BadParameter(
                f"{path} is not a file, and the save names no disk {path} (it names: {known})", param_hint="--disk"
            )
        if path in paths:
            raise click.BadParameter(f"disk {path} given twice", param_hint="--disk")
        resolved[path] = found[path]
    return resolved


def _plain_file(save: str) -> bool:
    """A regular file that is not compressed: its size is what the progress bar counts."""
    if save == "-" or not os.path.isfile(save):
        return False
    from .compressed_input import MAGIC_BYTES, compression_of

    with open(save, "rb") as f:
        return compression_of(f.read(MAGIC_BYTES)) is None


# -- hints (spec/hints.md) ------------------------------------------------------------------
def _hint_options(path, trust_dirty_log: bool, disk_scan) -> dict:
    """The convert options of --hints: the hints read and checked before the save is."""
    if path is None:
        if trust_dirty_log:
            raise click.UsageError("--trust-dirty-log needs --hints")
        return {"disk_scan": disk_scan} if disk_scan is not None else {}
    from .hints import read_hints

    return dict(hints=read_hints(path), trust_dirty_log=trust_dirty_log, disk_scan=disk_scan, hint_report={})


def _report_hints(hinting: dict) -> None:
    for kind, counts in hinting.get("hint_report", {}).items():
        ui.note(f"hints {kind}: " + ", ".join(f"{n} {what}" for what, n in counts.items()) + " (pages)")


@main.command("validate-hints")
@click.argument("hints_file", metavar="FILE", type=click.Path(exists=True, dir_okay=False))
@click.option("--save", type=click.Path(exists=True, dir_okay=False), help="The save the hints are for.")
@click.option("--image", type=click.Path(exists=True, dir_okay=False), help="An image converted from that save.")
@json_option
@verbosity_options
def validate_hints(hints_file, save, image, as_json):
    """Check a hint file against spec/hints.md. Exit 0 valid, 1 invalid, 4 no violation found but
    some rules not checked (no --save or --image)."""
    from .rules import describe
    from .validate_hints import validate_hints as run

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
        verdict = _verdict(report)
        ui.summary(f"{hints_file}: {verdict}; {report.records} hint records")
    sys.exit(_validate_status([report]))


def _save_source(save: str, source_format: str | None):
    """The source plugin --from names, or the one that recognises SAVE's first bytes, and SAVE
    to convert (opened when it had to be read for that)."""
    from . import plugins
    from .fileutil import peek_input

    if source_format:
        return plugins.source(source_format), save
    head, opened = peek_input(save, plugins.HEAD_BYTES)
    try:
        return plugins.detect_source(head), opened
    except BaseException:
        if opened is not sys.stdin.buffer:
            opened.close()
        raise


def _report_disk_pages(sources: dict, summary) -> None:
    for name in sources:
        pages = summary.pages.get(name, 0)
        ui.note(f"disk {name}: {pages} pages ({pages * summary.page_size / 2**20:.1f} MiB) are disk references")
    ui.note(
        f"disks scanned: {summary.scanned_bytes / 2**20:.1f} MiB of data; "
        f"{summary.indexed_pages} non-zero guest pages looked up"
    )


@main.command()
@click.argument("image", type=IMAGE)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The image to write.")
@json_option
@verbosity_options
@parent_option
@disk_option
@force_option
def flatten(image, output, as_json, parents, disks, force):
    """Write IMAGE as a self-contained image: no parent, same memory, same source state."""
    from .incremental import rebase

    with _open_image(image, parents, disks) as img:
        _guard_output(output, _inputs_of(img, disks), force, object_ok=True)
        ui.detail(f"flattening the {len(img.chain())} link(s) of {image} into {output}")
        with ui.progress(sum(r.size_bytes for r in img.regions), "flatten") as advance:
            rebase(img, output, None, progress=advance)
    _report_rebase(output, as_json)


@main.command()
@click.argument("image", type=IMAGE)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The image to write.")
@json_option
@verbosity_options
@click.option("--delta/--no-delta", default=True, show_default=True, help="Re-encode changed pages as deltas.")
@parent_option
@disk_option
@force_option
def merge(image, output, as_json, delta, parents, disks, force):
    """Fold IMAGE into its parent: OUTPUT has IMAGE's memory and IMAGE's grandparent as parent.

    Use it to keep chains short: merging link k into link k-1 removes one level.
    """
    from .errors import ChainError
    from .incremental import rebase

    with _open_image(image, parents, disks) as img:
        if img.parent is None:
            raise ChainError("the image has no parent to merge into; use flatten")
        _guard_output(output, _inputs_of(img, disks), force, object_ok=True)
        ancestors = [link.path for link in img.parent.chain()[1:]]
        ui.detail(f"merging {image} into its parent {img.parent.path}: {output}")
        with ui.progress(sum(r.size_bytes for r in img.regions), "merge") as advance:
            rebase(img, output, img.parent.parent, allow_delta=delta, progress=advance)
        _report_rebase(output, as_json, ancestors)


def _report_rebase(output, as_json: bool, parents=()) -> None:
    from .results import image_line, written_image

    result = written_image(output, parents)
    if as_json:
        ui.emit_json(result)
    ui.summary(image_line(result))


# -- plugins (lean-image/plugins.py) ------------------------------------------------------------
def _installed_plugin(group: str, param, value):
    """A --to/--from value that names an installed plugin of ``group`` (a usage error otherwise)."""
    from .plugins import is_installed, names

    if value is not None and not is_installed(group, value):
        raise click.BadParameter(
            f"{value!r} is not an installed plugin (installed: {', '.join(names(group))})", param=param
        )
    return value


@main.command("plugins")
@json_option
@verbosity_options
def plugins_command(as_json):
    """List the installed source formats, restore targets and checkpoint writers, with the distribution that
    provides each; a plugin that cannot be loaded is listed as BROKEN with the reason."""
    from .plugin_list import render_text
    from .plugins import installed

    found = installed()
    if as_json:
        ui.emit_json([p.to_json() for p in found])
    else:
        ui.report(render_text(found))


# -- serve: lazy restore (restore/postcopy.py, spec/guides/lazy-restore.md) -----------------
@main.command()
@click.argument("image", type=IMAGE)
@click.option(
    "--postcopy",
    is_flag=True,
    required=True,
    help="Speak the source side of QEMU 7.2's post-copy migration: the stream on stdout, "
    'QEMU\'s return path on stdin (for -incoming "exec:leanimg serve IMG --postcopy").',
)
@click.option(
    "--prepage",
    type=click.Choice(["none", "sequential", "bubble", "disk-sorted"]),
    default="sequential",
    show_default=True,
    help="The order pages are pushed in while the guest runs (none: only on demand).",
)
@click.option(
    "--stats",
    "stats_path",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Also write the counts (pages on demand, pushed, ...) to FILE as JSON.",
)
@click.option(
    "--working-set",
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="Send the pages of this working-set file (e.g. from --record-faults) before the guest "
    "runs, in its order (at most 8192; every page still checked).",
)
@click.option(
    "--record-faults",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Write the pages the destination asked for, in order, to FILE as a working set.",
)
@click.option(
    "--precopy-seconds",
    type=click.FloatRange(0, 60),
    default=0.15,
    show_default=True,
    help="Send pages in the --prepage order for this long before the guest runs (after the "
    "working set); 0: only after.",
)
@json_option
@verbosity_options
@parent_option
@disk_option
@click.option("--any-disk-identity", is_flag=True, help="As for restore: every block is still checked.")
@force_option
def serve(
    image,
    postcopy,
    prepage,
    stats_path,
    working_set,
    record_faults,
    precopy_seconds,
    as_json,
    parents,
    disks,
    any_disk_identity,
    force,
):
    """Serve IMAGE to a QEMU destination that runs the guest before its memory has arrived.

    qemu-system-x86_64 ... -global migration.x-postcopy-ram=on
    -incoming "exec:leanimg serve IMG --postcopy"

    The summary (with --json: the counts as JSON) goes to standard error: standard output is the stream.
    """
    from dataclasses import asdict

    from .plugins import target as restore_target

    ui.stdout_is_data()
    if not postcopy:
        raise click.UsageError("serve needs --postcopy (the only protocol it speaks)")
    if sys.stdout.isatty():
        raise click.UsageError("serve writes a migration stream to stdout: run it as QEMU's -incoming exec:")
    with _open_image(image, parents, disks, check_disk_identity=not any_disk_identity) as img:
        for path in (stats_path, record_faults):
            if path:
                _guard_output(path, _inputs_of(img, disks) + ([working_set] if working_set else []), force)
        from .format import PageClass
        from .inspect import class_counts

        counts = class_counts(img)
        travelling = sum(counts.values()) - counts[PageClass.ZERO] - counts[PageClass.FREE]
        with ui.progress(travelling, "serve (pages)") as advance:
            stats = restore_target("qemu").serve(
                img,
                sys.stdout.buffer,
                sys.stdin.buffer,
                strategy=prepage,
                stats_path=stats_path,
                log=_serve_log,
                progress=advance,
                working_set=working_set,
                record_faults=record_faults,
                precopy_seconds=precopy_seconds,
            )
    if as_json:
        ui.emit_json(dict(asdict(stats), image=image))


def _serve_log(message: str) -> None:
    """serve's warnings and summary line: on standard error, not with --quiet; --json replaces them."""
    if not ui.wants_json():
        ui.note(f"leanimg: {message}")


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the files here.")
def demo(workdir):
    """Convert, inspect, validate, restore and verify the bundled real QEMU save."""
    from .demo import run_demo

    sys.exit(0 if run_demo(workdir) else EXIT_INVALID)


# -- map and dump: extents and structures as qemu-img map and crit decode give them -----------
@main.command("map")
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
    from .extent_map import write_human, write_json

    paths = _parse_disks(disks)
    with _open_image(image, parents, ()) as img:
        if None in paths and len(img.disks) == 1:
            paths[img.disks[0].name] = paths.pop(None)
        (write_json if as_json or output_format == "json" else write_human)(img, sys.stdout, paths)


@main.command("dump")
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
    from .structure_dump import write_dump

    write_dump(image, sys.stdout, payloads)


# -- checkpoint (converters/checkpoint.py, reached as a plugin) -----------------------------
@main.command()
@click.option(
    "--qmp",
    "qmp_socket",
    required=True,
    metavar="SOCKET",
    help="QEMU's QMP unix socket (-qmp unix:SOCKET,server=on,wait=off); QEMU serves one "
    "client per socket, so give leanimg its own.",
)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The lean image to write.")
@json_option
@verbosity_options
@click.option(
    "--live",
    "mode",
    flag_value="live",
    help="Precopy while the guest runs; the migration's final pause is the checkpoint instant.",
)
@click.option(
    "--background",
    "mode",
    flag_value="background",
    help="QEMU's background-snapshot: the guest "
    "runs on, every page is sent once as of the instant the snapshot starts.",
)
@click.option(
    "--then",
    "then",
    type=click.Choice(["continue", "stop", "quit"]),
    default="continue",
    show_default=True,
    help="Afterwards: the guest runs on (if it ran), stays paused, or QEMU quits.",
)
@click.option(
    "--disk",
    "disks",
    multiple=True,
    metavar="NAME=PATH",
    help="A file of the guest's disk (repeatable): pages found on it become disk references. "
    "With --then continue the disk is frozen at the checkpoint instant (the guest writes to a new "
    "qcow2 overlay beside it from then on).",
)
@click.option(
    "--parent",
    "parents",
    multiple=True,
    type=IMAGE,
    metavar="PREV.lean",
    help="Write an incremental image against PREV (more: PREV's ancestors).",
)
@click.option("--delta/--no-delta", default=True, show_default=True, help="8-byte-word deltas (with --parent).")
@click.option("--level", default=3, show_default=True, type=click.IntRange(1, 22), help="zstd level.")
@click.option(
    "--max-bandwidth",
    type=click.IntRange(1),
    metavar="MIB/S",
    help="Limit the migration (default: as fast as leanimg reads).",
)
@click.option(
    "--balloon-inflate",
    type=click.IntRange(1),
    metavar="MIB",
    help="Inflate the guest's virtio-balloon by MIB first (its pages save as zeros) and deflate it "
    "afterwards; the image records the size before (restored guests: QMP balloon value=BEFORE).",
)
@click.option(
    "--keep-stream",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Also write QEMU's raw migration stream to FILE (for debugging: a full-size file).",
)
@click.option(
    "--guest-free",
    metavar="SOCKET",
    help="With --live: ask the guest's free-list helper "
    "(leanimg-guest-free, on the virtio-serial port org.leanimg.free.0 that QEMU connects to SOCKET) for "
    "its free pages while the precopy runs; pages not sent again after its answer become FREE.",
)
@click.option(
    "--keep-hints",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="With --guest-free: also write the FREE hints taken from the guest to FILE (spec/hints.md).",
)
@force_option
def checkpoint(
    qmp_socket,
    output,
    as_json,
    mode,
    then,
    disks,
    parents,
    delta,
    level,
    max_bandwidth,
    balloon_inflate,
    keep_stream,
    guest_free,
    keep_hints,
    force,
):
    """Checkpoint a running QEMU 7.2 over QMP straight into a lean image (no save file)."""
    from .errors import CheckpointInterrupted
    from .plugins import checkpointer

    paths = {name or os.path.splitext(os.path.basename(path))[0]: path for name, path in _parse_disks(disks).items()}
    for path in paths.values():
        if not os.path.isfile(path):
            raise click.BadParameter(f"{path} is not a file", param_hint="--disk")
    chain = _chain_paths(parents[0], parents) if parents and _exists(output) else []
    inputs = [*parents, *chain, *paths.values()]
    _guard_output(output, inputs, force, object_ok=True)
    if keep_stream:
        _guard_output(keep_stream, [*inputs, output], force)
    if guest_free and mode != "live":
        raise click.UsageError(
            "--guest-free needs --live: in a stop-and-save or a background snapshot a page the "
            "guest writes after its answer is not sent again (spec/hints.md §3.1)"
        )
    if keep_hints and not guest_free:
        raise click.UsageError("--keep-hints needs --guest-free")
    if keep_hints:
        _guard_output(keep_hints, [*inputs, output], force)
    writer = checkpointer("qemu")
    request = writer.Request(
        qmp=qmp_socket,
        output=output,
        mode=mode or "stop",
        then=then,
        disks=paths,
        parents=parents,
        allow_delta=delta,
        writer_options=dict(level=level),
        max_bandwidth=max_bandwidth and max_bandwidth << 20,
        keep_stream=keep_stream,
        balloon_inflate=(balloon_inflate or 0) << 20,
        guest_free=guest_free,
        keep_hints=keep_hints,
        progress=ui.show_progress(),
    )
    try:
        result = writer.checkpoint(request)
    except CheckpointInterrupted as exc:
        click.echo(f"leanimg: error: {exc}", err=True)
        ui.error(exc.message, 128 + exc.signum, kind="interrupted")
        sys.exit(128 + exc.signum)
    for line in result.timeline_lines():
        ui.detail(f"checkpoint {line}")
    if as_json:
        ui.emit_json(result.to_json())
    ui.summary(result.summary())


# -- object storage ----------------------------------------------------------------------
@main.command()
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
    from . import s3

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


def run() -> None:
    """The console script: the command, then a quick exit (_exit_quickly)."""
    try:
        main()  # click's standalone mode ends with SystemExit
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    if code not in (0, None):
        _fail_a_waiting_destination(sys.argv[1:])
    _exit_quickly(code)


# What a failing restore or serve writes to a pipe on its standard output: not a migration stream
STREAM_FAILED = b"leanimg failed: see its standard error\n"


def _fail_a_waiting_destination(argv: list[str]) -> None:
    """A QEMU started with -incoming "exec:leanimg restore IMG --to qemu -o -" (or serve) whose
    source exits before writing anything stays in migration state setup forever (QEMU 7.2 and
    10.0 do not notice the end of input). A failing restore or serve that writes its stream to a
    pipe on standard output therefore gives it a few bytes that are no migration stream: QEMU
    refuses them at once and exits. A stream cut short after its first bytes fails QEMU alike."""
    if not _streams_to_stdout(argv):
        return
    try:
        if stat.S_ISFIFO(os.fstat(1).st_mode) or stat.S_ISSOCK(os.fstat(1).st_mode):
            os.write(1, STREAM_FAILED)
    except OSError:  # the reader has gone: nobody waits
        pass


def _streams_to_stdout(argv: list[str]) -> bool:
    """Whether the command line is serve, or restore --to qemu -o - (what `-incoming exec:` runs;
    other targets' output on a pipe is left as it is)."""
    words = [w for w in argv if not w.startswith("-")]
    if not words or words[0] not in ("serve", "restore"):
        return False
    if words[0] == "serve":
        return True
    return _option(argv, "-o", "--output") == "-" and _option(argv, None, "--to") == "qemu"


def _option(argv: list[str], short: str | None, long: str) -> str | None:
    """The last value given to an option, as ``-o V``, ``-oV``, ``--output V`` or ``--output=V``."""
    value = None
    for a, b in zip(argv, [*argv[1:], None]):
        if a in (short, long):
            value = b
        elif a.startswith(long + "="):
            value = a[len(long) + 1 :]
        elif short and a.startswith(short) and len(a) > len(short) and not a.startswith("--"):
            value = a[len(short) :]
    return value


def _exit_quickly(code) -> None:
    """End the process without tearing the interpreter's objects down one by one: after a
    restore of a deep chain that teardown (10^5 objects, 200 MB of buffers freed piecemeal)
    took 35-70 ms, as long as the restore's last quarter; the kernel frees the memory at
    once. What a normal exit does that matters is done first, in its order: the worker
    threads joined, atexit handlers run (temporary outputs removed), stdout and stderr
    flushed (a failed flush exits 120, as Python does)."""
    import atexit
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit_handlers is None:  # not CPython 3.x as we know it: exit as usual
        sys.exit(code)
    shutdown()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    os._exit(code)


if __name__ == "__main__":
    run()
