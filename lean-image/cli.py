"""The `leanimg` command line. Exit codes: 0 ok, 1 bad input, 2 usage, 3 internal error, 4 (validate)
not every rule checked."""

from __future__ import annotations

import os
import signal
import stat
import sys
from importlib import import_module

# numpy's OpenBLAS starts a thread per core when imported (~0.1 s of CPU per command);
# leanimg does no linear algebra.  Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402

from . import output as ui
from .commands.common import EXIT_INTERNAL, EXIT_INVALID
from .errors import LeanImageError
from .output import verbosity_options

# The commands: name -> module of leanimg.commands and the click command in it. A module is
# imported when its command runs or a help lists it, so a command loads only its own options
# and helpers, and these only what they use (imports inside the command functions).
COMMANDS = {
    "inspect": "inspect:inspect",
    "validate": "validate:validate",
    "restore": "restore:restore",
    "convert": "convert:convert",
    "validate-hints": "validate_hints:validate_hints",
    "flatten": "flatten:flatten",
    "merge": "merge:merge",
    "plugins": "plugins:plugins_command",
    "serve": "serve:serve",
    "demo": "demo:demo",
    "map": "map:map_command",
    "dump": "dump:dump_command",
    "checkpoint": "checkpoint:checkpoint",
    "uploads": "uploads:uploads",
}


class LeanGroup(click.Group):
    """Loads each command from its module on demand (click's lazy group); turns library errors
    into one clear line and exit 1, bugs into exit 3."""

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *COMMANDS])

    def get_command(self, ctx, cmd_name):
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        module, _, name = COMMANDS[cmd_name].partition(":")
        return getattr(import_module(f"{__package__}.commands.{module}"), name)

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
                import traceback

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
        # LEANIMG_NATIVE and LEANIMG_CROSS_CHECK checked here, not by the first page read
        from . import fast_paths, native  # noqa: F401
    except ImportError as exc:
        raise click.UsageError(str(exc)) from None


def _raise_open_file_limit() -> None:
    """Each link of a chain keeps its file open; chains may be 4096 deep (spec §9.1)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


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
