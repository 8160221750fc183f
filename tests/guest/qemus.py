"""The QEMUs the real-QEMU tests run on, each with its default machine types.

* QEMU 7.2, Debian 12's ``qemu-system-x86_64`` on PATH;
* QEMU 10.0, Debian's bookworm-backports package unpacked beside it by ``.ci/install`` (not
  installed over 7.2), run through the wrapper there (``LEANIMG_QEMU10`` names another).

``-machine pc`` and ``q35`` are each version's newest i440fx and q35 types (pc-i440fx-10.0
and pc-q35-10.0 on QEMU 10: their streams carry MIG_CMD_SWITCHOVER_START). A test family
parametrises its module fixture with ``qemu_params()``; where a QEMU is missing the family
is skipped, but in CI (``CI`` set) that is a failure: CI proves both versions.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

QEMU10_WRAPPER = Path.home() / ".cache" / "leanimg" / "qemu10" / "bin" / "qemu-system-x86_64"


@dataclasses.dataclass(frozen=True)
class Qemu:
    version: str  # major.minor, as `qemu-system-x86_64 --version` says
    binary: str
    machine: str = "pc"

    @property
    def id(self) -> str:
        return f"qemu{self.version}-{'q35' if self.machine == 'q35' else 'i440fx'}"

    def on(self, machine: str) -> "Qemu":
        return dataclasses.replace(self, machine=machine)

    def missing(self) -> str | None:
        """Why this QEMU cannot run here, or None."""
        if shutil.which(self.binary) is None:
            return f"{self.binary} is not installed"
        found = version_of(self.binary)
        if not found.startswith(self.version + "."):
            return f"{self.binary} is QEMU {found}, not {self.version}"
        if not list(Path("/boot").glob("vmlinuz-*")):
            return "no /boot/vmlinuz-* kernel for the test guest"
        return None

    def require(self) -> None:
        """Skip the caller where this QEMU is missing; in CI fail instead."""
        why = self.missing()
        if why is None:
            return
        if os.environ.get("CI"):
            pytest.fail(f"{self.id}: {why} (CI tests every QEMU; .ci/install provides them)")
        pytest.skip(f"{self.id}: {why}")


@cache
def version_of(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout
    words = out.split()
    return words[words.index("version") + 1] if "version" in words else "unknown"


QEMU_7_2 = Qemu("7.2", "qemu-system-x86_64")
QEMU_10_0 = Qemu("10.0", os.environ.get("LEANIMG_QEMU10", str(QEMU10_WRAPPER)))
VERSIONS = (QEMU_7_2, QEMU_10_0)


def qemu_params(machines: tuple[str, ...] = ("pc",)) -> list:
    """pytest params: every version on each of ``machines``."""
    return [pytest.param(q.on(m), id=q.on(m).id) for m in machines for q in VERSIONS]
