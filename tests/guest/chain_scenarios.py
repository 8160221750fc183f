"""A running guest checkpointed again and again: the input of incremental chains (issue 6).

    from guest.chain_scenarios import CHAIN_PHASES, run_chain_scenario
    checkpoints = run_chain_scenario(workdir)         # [SavePoint cp1, cp2, ...]

One guest boots once and runs two workloads in turn (tests/guest/workload.c):

* ``words 24 ...`` — 24 MiB of random data, then every round 1–4 random 8-byte words in
  each of 256 random pages (what FITDOC's 8-byte deltas are for);
* ``pages 24 ...`` — 24 MiB of random data, then every round 5 % of its pages rewritten
  whole with fresh random data (no delta helps).

Each phase takes ``saves`` checkpoints ``rounds`` workload rounds apart (a round happens
before every heartbeat, so ``HB words n`` says rounds 0..n are in memory).  The ``words``
phase is given a round limit so it goes quiet once its last checkpoint is taken: the
``pages`` checkpoints then show (nearly) only whole-page rewrites, plus whatever the
kernel changes by itself.

A checkpoint is scenarios.save_point: ``stop``, migrate to ``cpN.save``, ``pmemsave``
to ``cpN.mem``, copy the disk to ``cpN.disk.img``, ``cont``.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import warnings
from pathlib import Path

from .build import GuestBuild, build_guest
from .qemus import QEMU_7_2, Qemu
from .scenarios import SavePoint, save_point, wait_heartbeat
from .vm import ConsoleSilent, ConsoleStall, GuestVM, copy_disk

# The legacy VGA window: pmemsave reads the VGA device's MMIO here, not pc.ram, so a raw
# restore of pc.ram and a pmemsave differ in these bytes by design.
VGA_WINDOW = (0xA0000, 0xC0000)


@dataclasses.dataclass(frozen=True)
class Phase:
    mode: str  # "words" or "pages"
    mib: int
    saves: int  # checkpoints taken during this phase
    rounds: int  # workload rounds between two checkpoints of the phase
    amount: int  # words: pages touched per round; pages: permille rewritten per round
    first: int = 1  # the first checkpoint waits for heartbeat ``first``

    @property
    def last_round(self) -> int:
        """Heartbeat of the phase's last checkpoint (the phase writes no more after it)."""
        return self.first + (self.saves - 1) * self.rounds

    def workload(self, limit: bool) -> tuple[str, ...]:
        rounds = self.last_round + 1 if limit else 0
        return (self.mode, str(self.mib), str(rounds), str(self.amount))


CHAIN_PHASES: tuple[Phase, ...] = (
    Phase("words", 24, saves=3, rounds=4, amount=256),
    Phase("pages", 24, saves=3, rounds=4, amount=50),
)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    index: int  # 1-based position in the chain
    phase: str  # the workload mode of the phase it was taken in
    point: SavePoint  # save, mem, disk, heartbeat of ``phase``'s mode

    @property
    def name(self) -> str:
        return self.point.name


def run_chain_scenario(
    workdir: Path,
    phases=CHAIN_PHASES,
    mem_mib: int = 128,
    build: GuestBuild | None = None,
    log=None,
    limit_rounds: bool = True,
    qemu: Qemu = QEMU_7_2,
    attempts: int = 2,
) -> list[Checkpoint]:
    """Boot once, run ``phases`` in turn, checkpoint as they say; QEMU is gone afterwards.

    With ``limit_rounds`` every phase but the last stops writing after its last checkpoint
    (the last phase keeps going, so a guest resumed from the last checkpoint visibly works).

    A guest whose console goes silent for good (ConsoleSilent, see guest.vm.Serial) is given
    up and the scenario run again on a fresh guest, up to ``attempts`` times in all: this
    makes the tests' input (QEMU's saves; no leanimg runs here), so a stalled serial port of
    QEMU must not fail every test that reads it. Any other failure is raised at once."""
    build = build or build_guest()
    say = log or (lambda msg: None)
    for attempt in range(1, attempts):
        try:
            return _run_chain_scenario_once(workdir, phases, mem_mib, build, say, limit_rounds, qemu)
        except ConsoleSilent as exc:
            say(f"attempt {attempt} given up, its console silent: {str(exc).splitlines()[0]}")
            warnings.warn(f"chain scenario run again: {str(exc).splitlines()[0]}", ConsoleStall)
            shutil.rmtree(workdir, ignore_errors=True)
    return _run_chain_scenario_once(workdir, phases, mem_mib, build, say, limit_rounds, qemu)


def _run_chain_scenario_once(workdir, phases, mem_mib, build, say, limit_rounds, qemu) -> list[Checkpoint]:
    workdir.mkdir(parents=True, exist_ok=True)
    disk = copy_disk(build.disk, workdir / "disk.img")
    vm_dir = workdir / "source"
    vm_dir.mkdir(exist_ok=True)
    checkpoints: list[Checkpoint] = []
    with GuestVM(build, disk, mem_mib=mem_mib, workdir=vm_dir, qemu=qemu) as vm:
        t0 = time.monotonic()
        vm.wait_ready(timeout=300)
        say(f"booted in {time.monotonic() - t0:.1f} s")
        for i, phase in enumerate(phases):
            workload = phase.workload(limit_rounds and i < len(phases) - 1)
            t0 = time.monotonic()
            vm.run_workload(*workload, timeout=300)
            say(f"workload {' '.join(workload)}: filled in {time.monotonic() - t0:.1f} s")
            target = phase.first
            for _ in range(phase.saves):
                # wait_heartbeat wants n > after: wait for HB >= target
                wait_heartbeat(vm, phase.mode, target - 1, timeout=120)
                name = f"cp{len(checkpoints) + 1}"
                t0 = time.monotonic()
                point = save_point(vm, workdir, name, workload)
                checkpoints.append(Checkpoint(len(checkpoints) + 1, phase.mode, point))
                say(
                    f"{name} ({phase.mode}, HB {point.heartbeat}): save "
                    f"{point.save.stat().st_size / 2**20:.1f} MiB, checkpoint took "
                    f"{time.monotonic() - t0:.1f} s"
                )
                target = max(target, point.heartbeat) + phase.rounds
    return checkpoints
