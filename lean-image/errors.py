"""The error hierarchy. The library raises nothing else on bad input."""

from __future__ import annotations

import contextlib


class LeanImageError(Exception):
    """Root of every error leanimg reports about its input.

    ``offset`` is the byte offset in the file the error is about (or None),
    ``structure`` a path such as ``record[12].page_frame``, ``rule`` the spec
    rule id (e.g. ``LI-REC-003``) when the error is a conformance violation.
    """

    def __init__(
        self,
        message: str,
        *,
        offset: int | None = None,
        structure: str | None = None,
        rule: str | None = None,
        path: str | None = None,
    ):
        self.message = message
        self.offset = offset
        self.structure = structure
        self.rule = rule
        self.path = path
        super().__init__(self.__str__())

    def __str__(self) -> str:
        parts = []
        if self.path:
            parts.append(str(self.path))
        if self.offset is not None:
            parts.append(f"offset {self.offset:#x}")
        if self.structure:
            parts.append(self.structure)
        prefix = ": ".join([", ".join(parts)]) if parts else ""
        rule = f"[{self.rule}] " if self.rule else ""
        return f"{prefix}: {rule}{self.message}" if prefix else f"{rule}{self.message}"


class FormatError(LeanImageError):
    """The lean image violates the format (a rule of spec/format.md)."""


class TruncatedError(FormatError):
    """The input ended before a structure it declares."""


class LimitError(FormatError):
    """A declared size exceeds a resource limit the reader enforces."""


@contextlib.contextmanager
def fits_in_memory(what: str, structure: str):
    """A MemoryError while allocating ``what`` (tables sized by what the input declares)
    becomes a LimitError naming it: a clear error, never a traceback."""
    try:
        yield
    except MemoryError:
        raise LimitError(f"{what} does not fit in this process's memory", structure=structure) from None


class UnsupportedError(LeanImageError):
    """Valid input using something this version does not handle."""


class ChainError(LeanImageError):
    """A parent image is missing, replaced, modified or forms a cycle."""


class DiskError(LeanImageError):
    """A referenced disk is missing, of another identity, or changed."""


class InputMissing(LeanImageError):
    """An input the work needs besides the image (a parent, a disk) was not given or not found:
    no fault of the image. `validate` reports what it therefore could not check (exit 4)."""


class DiskNotGiven(DiskError, InputMissing):
    """A page's bytes are on a disk that was not supplied (--disk)."""


class SourceFormatError(LeanImageError):
    """A hypervisor save file (QEMU or Xen stream) is malformed."""


class CheckpointError(LeanImageError):
    """A running VM could not be checkpointed: its monitor is unreachable or refused a command,
    the migration failed or was cancelled. The guest is left as it was."""


class CheckpointInterrupted(CheckpointError):
    """A signal (Ctrl-C, SIGTERM) cancelled a checkpoint; ``signum`` names it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
