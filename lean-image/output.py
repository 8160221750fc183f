"""What every command shares about its output (spec/guides/cli.md, "Output conventions").

``--json`` prints one JSON document (its JSON Schema: ``lean-image/schemas/COMMAND.schema.json``,
fields in spec/guides/json.md); ``-q/--quiet`` leaves only errors and the JSON; ``-v/--verbose``
adds details on standard error; a progress bar is drawn on standard error only when it is a
terminal; a command that finishes prints one summary line. Reports and JSON go to standard
output, unless it carries the command's data (``restore -o -``, ``serve``): then to standard error.
"""

from __future__ import annotations

import sys

import click

SCHEMA_DIR = "schemas"
_QUIET = "leanimg.quiet"
_VERBOSE = "leanimg.verbose"
_JSON = "leanimg.json"
_STDOUT_IS_DATA = "leanimg.stdout_is_data"


def _meta() -> dict:
    """State of this invocation: click shares one ``meta`` dict between a command and its group."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta if ctx is not None else {}


def _remembered_option(key: str, *decls: str, **attrs):
    """An option whose value (when given) is also kept in ``meta`` under ``key``, for the
    functions below."""

    def callback(ctx, param, value):
        if value:
            ctx.meta[key] = value
        return value

    return click.option(*decls, callback=callback, **attrs)


def verbosity_options(function):
    """-q/--quiet and -v/--verbose, taken by the group and by every command (either place works)."""
    verbose = _remembered_option(
        _VERBOSE,
        "-v",
        "--verbose",
        count=True,
        expose_value=False,
        help="Say more on standard error: what is being read and written.",
    )
    quiet = _remembered_option(
        _QUIET,
        "-q",
        "--quiet",
        is_flag=True,
        expose_value=False,
        help="Print only errors and results (a report, --json output): no summary line, notes or progress bar.",
    )
    return quiet(verbose(function))


def json_option(function):
    """``--json``, passed to the command as ``as_json`` and remembered for the error report."""
    return _remembered_option(
        _JSON,
        "--json",
        "as_json",
        is_flag=True,
        help="Print the result as one JSON document (schema: leanimg/schemas/; fields: "
        "spec/guides/json.md); errors too.",
    )(function)


def quiet() -> bool:
    return bool(_meta().get(_QUIET))


def verbose() -> bool:
    return not quiet() and _meta().get(_VERBOSE, 0) > 0


def wants_json() -> bool:
    return bool(_meta().get(_JSON))


def stdout_is_data() -> None:
    """The command writes its data to standard output: reports, JSON and summary go to standard error."""
    _meta()[_STDOUT_IS_DATA] = True


def _report_to_stderr() -> bool:
    return bool(_meta().get(_STDOUT_IS_DATA))


def emit_json(document) -> None:
    import json  # (imported where used: `leanimg --help` and a command without --json do not)

    click.echo(json.dumps(document, indent=2), err=_report_to_stderr())


def report(text: str) -> None:
    """A report that is the command's result (inspect, validate): printed even with --quiet."""
    click.echo(text, err=_report_to_stderr())


def summary(line: str) -> None:
    """The one line a command prints when it finishes (not with --quiet, nor with --json, which replaces it)."""
    if not quiet() and not wants_json():
        click.echo(line, err=_report_to_stderr())


def note(line: str) -> None:
    """Something worth knowing on standard error (not with --quiet)."""
    if not quiet():
        click.echo(line, err=True)


def detail(line: str) -> None:
    """Said only with --verbose, on standard error."""
    if verbose():
        click.echo(f"leanimg: {line}", err=True)


def show_progress() -> bool:
    """Progress bars and status lines: on a terminal and without --quiet."""
    return sys.stderr.isatty() and not quiet()


class progress:
    """A progress bar on standard error when it is a terminal (and not --quiet), silent otherwise.
    Used as ``with progress(total, label) as advance:``; ``advance`` is None when silent."""

    def __init__(self, total: int, label: str):
        self.bar = click.progressbar(length=total, label=label, file=sys.stderr) if show_progress() and total else None

    def __enter__(self):
        if self.bar is None:
            return None
        self.bar.__enter__()
        return self.bar.update

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False


def error(
    message: str,
    exit_code: int,
    *,
    kind: str,
    offset: int | None = None,
    structure: str | None = None,
    rule: str | None = None,
    path: str | None = None,
    hint: str | None = None,
) -> None:
    """An error as JSON (``--json`` given), in the shape of schemas/error.schema.json."""
    if wants_json():
        where = dict(path=path, offset=offset, structure=structure, rule=rule, hint=hint)
        emit_json({"error": dict(kind=kind, message=message, **where, exit_code=exit_code)})


def schema_names() -> list[str]:
    """The commands (and ``error``) that have a JSON Schema shipped with the package."""
    from importlib import resources

    folder = resources.files("leanimg").joinpath(SCHEMA_DIR)
    return sorted(
        entry.name[: -len(".schema.json")] for entry in folder.iterdir() if entry.name.endswith(".schema.json")
    )


def schema(name: str) -> dict:
    """The JSON Schema (draft 2020-12) of ``leanimg NAME --json``'s output, or of ``error``."""
    import json
    from importlib import resources

    return json.loads(resources.files("leanimg").joinpath(SCHEMA_DIR).joinpath(f"{name}.schema.json").read_text())
