"""`leanimg demo`: what makes an image lean, on the bundled sample, each step with its size.

The sample is a real QEMU 7.2 save of a small Linux guest and the guest's virtio disk
(tests/guest builds them), shipped zstd-compressed as package data, so the demo runs without
QEMU. It converts the save with the pages inline, then with disk references (`--disk`) and
FREE hints (`--hints`), makes a second save from the first (a few 8-byte words changed, the
stream rebuilt by leanimg's own QEMU stream writer) and converts it as an incremental link
(PARENT pages and DELTAs), validates both, restores both and checks them bit-exact against
their saves. Every size is set against the save and against `zstd -3` of the save (zstandard,
in the same run).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from importlib import resources
from typing import IO, Callable, ParamSpec, TypeVar, cast

import click
import numpy as np
import zstandard

from .errors import LeanImageError
from .fileutil import sha256_file, write_atomically
from .format import PageClass
from .hints import FreeSource, HintWriter
from .inspect import class_counts, disk_files
from .plugins import source, target
from .reader import LeanImage
from .validate import validate
from .writer import LeanImageWriter

SAMPLE_PACKAGE = "leanimg.sample"
SAMPLE_SAVE = "vm.save.zst"
SAMPLE_DISK = "disk.img.zst"
DISK_NAME = "vda"
FREE_BLOCK = 2 << 20  # FREE hints name whole free 2 MiB blocks (what free-page reporting reports)
SEED = 17  # the second save's changes are the same in every run
TICKED_PAGES, TICKED_WORDS, REWRITTEN_PAGES = 220, 4, 20
MIB = 1 << 20
_P = ParamSpec("_P")
_R = TypeVar("_R")


def sample_path(name: str) -> str:
    return str(resources.files(SAMPLE_PACKAGE).joinpath(name))


def _decompress(src: str, dest: str) -> None:
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)


def zstd_size(path: str, level: int = 3) -> int:
    """Bytes of ``path`` compressed by zstd at ``level`` (what `zstd -3` writes, without a file)."""
    with open(path, "rb") as fin:
        # (copy_stream only writes to its output: counting what it is given is all it needs)
        return zstandard.ZstdCompressor(level=level).copy_stream(fin, cast(IO[bytes], _Counter()))[1]


class _Counter:
    def write(self, data) -> int:
        return len(data)


def _step(title: str):
    click.secho(f"\n== {title}", bold=True)
    return time.perf_counter()


def _done(start: float, note: str = "") -> None:
    click.echo(f"   ({time.perf_counter() - start:.2f} s){' ' + note if note else ''}")


def _timed(title: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A step of the demo: ``title`` shown before it runs (_step), the seconds it took after (_done)."""

    def decorate(step: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(step)
        def timed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            start = _step(title)
            result = step(*args, **kwargs)
            _done(start)
            return result

        return timed

    return decorate


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def _classes_line(image: LeanImage) -> str:
    counts = class_counts(image)
    return ", ".join(
        f"{cls.name} {counts[cls]} ({_mib(counts[cls] * image.page_size)})" for cls in PageClass if counts[cls]
    )


def _disks(path: str) -> dict:
    from .disks import open_disk

    return {DISK_NAME: open_disk(path, DISK_NAME)}


@contextmanager
def _open_disks(path: str):
    """_disks for the block, closed after it (an image they are attached to closes them itself)."""
    disks = _disks(path)
    try:
        yield disks
    finally:
        for disk in disks.values():
            disk.close()


class Demo:
    """The files of one run, in ``workdir``, and the sizes measured on the way."""

    def __init__(self, workdir: str):
        self.dir = workdir
        self.sizes: list[tuple[str, int, str]] = []  # (label, bytes, the save it stands for)
        self.zstd: dict[str, int] = {}
        self.ok = True

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def measure(self, label: str, path: str, save: str) -> None:
        self.sizes.append((label, os.path.getsize(path), save))
        save_size, zstd = os.path.getsize(self.path(save)), self.zstd[save]
        size = os.path.getsize(path)
        click.echo(
            f"   {os.path.basename(path)}: {_mib(size)}: {save_size / size:.2f}x smaller than {save}, "
            f"{size / zstd:.0%} of zstd -3 of {save} ({_mib(zstd)})"
        )

    # -- the steps ----------------------------------------------------------------------------
    @_timed("the bundled sample: a real QEMU 7.2 save of a 96 MiB Linux guest, and its disk")
    def unpack(self) -> None:
        _decompress(sample_path(SAMPLE_SAVE), self.path("vm.save"))
        _decompress(sample_path(SAMPLE_DISK), self.path("disk.img"))
        self.zstd["vm.save"] = zstd_size(self.path("vm.save"))
        click.echo(
            f"   vm.save: {_mib(os.path.getsize(self.path('vm.save')))} (`migrate exec:cat > vm.save`); "
            f"disk.img: {_mib(os.path.getsize(self.path('disk.img')))}, the guest's ext4 virtio disk"
        )
        click.echo(
            f"   zstd -3 of vm.save: {_mib(self.zstd['vm.save'])} (the baseline every size below is set against)"
        )

    @_timed("leanimg convert vm.save -o plain.lean        # every non-zero page stored inline")
    def convert_inline(self) -> None:
        source("qemu").convert(self.path("vm.save"), self.path("plain.lean"))
        with LeanImage.open(self.path("plain.lean")) as image:
            click.echo(f"   {_classes_line(image)}")
        self.measure("plain.lean: pages inline", self.path("plain.lean"), "vm.save")

    @_timed("FREE hints: vm.hnt (spec/hints.md), written with leanimg.hints.HintWriter")
    def write_free_hints(self) -> int:
        with LeanImage.open(self.path("plain.lean")) as image:
            region = image.region("pc.ram")
            per_block = FREE_BLOCK // image.page_size
            classes = image.classes(region)
            whole = len(classes) // per_block * per_block
            blocks = np.flatnonzero((classes[:whole].reshape(-1, per_block) == PageClass.ZERO).all(axis=1))
        with open(self.path("vm.hnt"), "wb") as out, HintWriter(out, page_size=image.page_size) as hints:
            hints.free(
                [(int(b) * per_block, per_block) for b in blocks],
                region="pc.ram",
                stream_offset=os.path.getsize(self.path("vm.save")),
                source=FreeSource.UNSPECIFIED,
            )
        click.echo(
            f"   FREE: the {len(blocks)} whole 2 MiB blocks of pc.ram ({len(blocks) * per_block} pages) that "
            "the save holds as zero pages.\n"
            "   This guest zeroes the memory it frees (init_on_free=1), and whole free 2 MiB blocks are what\n"
            "   virtio-balloon free-page reporting hands to the host, so these blocks are very probably free;\n"
            "   the demo cannot read the guest's free lists, which is where a real producer takes FREE hints\n"
            "   from (or from the balloon). The hints are taken as a host would with the guest paused after\n"
            "   the last byte of the stream (stream_offset = its length), so the offset rule admits them all."
        )
        return len(blocks) * per_block

    @_timed("leanimg convert vm.save -o vm.lean --disk vda=disk.img --hints vm.hnt")
    def convert_lean(self, free_pages: int) -> None:
        report: dict = {}
        with _open_disks(self.path("disk.img")) as disks:
            summary = source("qemu").convert(
                self.path("vm.save"),
                self.path("vm.lean"),
                disks=disks,
                hints=self.path("vm.hnt"),
                hint_report=report,
                disk_scan=True,
            )
        with LeanImage.open(self.path("vm.lean")) as image:
            click.echo(f"   {_classes_line(image)}")
            counts = class_counts(image)
        click.echo(
            f"   DISK: {counts[PageClass.DISK]} pages equal a 4 KiB block of disk.img (found by scanning "
            f"{summary.scanned_bytes / MIB:.1f} MiB of its data, each matched by its digest): the image keeps "
            "the sector and a digest, restore reads the block and checks it"
        )
        applied = report.get("FREE", {}).get("applied", 0)
        click.echo(
            f"   FREE: {applied} of the {free_pages} hinted pages applied; ZERO: the other zero pages. Neither "
            "costs bytes in the image; FREE pages need not be restored at all (serve --postcopy never sends "
            "them), a ZERO page must read as zeros"
        )
        self.measure("vm.lean: +DISK +FREE", self.path("vm.lean"), "vm.save")

    @_timed("leanimg inspect vm.lean --files --disk vda=disk.img   # the files the DISK pages came from")
    def show_files(self) -> None:
        try:
            with LeanImage.open(self.path("vm.lean"), disks=_disks(self.path("disk.img"))) as image:
                files = disk_files(image)
            for name, rows in files.items():
                for row in rows[:8]:
                    click.echo(f"   {name}: {row['mib']:6.2f} MiB {row['pages']:6d} pages  {row['path']}")
                if len(rows) > 8:
                    click.echo(f"   {name}: ... {len(rows) - 8} more")
        except LeanImageError as exc:  # debugfs (e2fsprogs) is not installed
            click.echo(f"   skipped: {exc}")

    @_timed("a second save, vm2.save: the guest a moment later")
    def make_second_save(self) -> None:
        with LeanImage.open(self.path("plain.lean")) as image:
            changed = _write_changed_copy(image, self.path("changed.lean"))
        with LeanImage.open(self.path("changed.lean")) as image:
            write_atomically(self.path("vm2.save"), lambda out: target("qemu").restore(image, out))
        os.remove(self.path("changed.lean"))
        self.zstd["vm2.save"] = zstd_size(self.path("vm2.save"))
        click.echo(
            f"   {changed}: 1 to {TICKED_WORDS} 8-byte words of {TICKED_PAGES} pages each incremented (counters, "
            f"timestamps) and {REWRITTEN_PAGES} pages rewritten entirely, pages picked with seed {SEED} among the "
            "non-zero pages of pc.ram.\n   The stream is rebuilt by leanimg's QEMU stream writer around vm.save's "
            "device state: the same layout, other page contents (a QEMU 7.2 stream)."
        )
        click.echo(f"   zstd -3 of vm2.save: {_mib(self.zstd['vm2.save'])}")

    @_timed("leanimg convert vm2.save -o vm2.lean --parent vm.lean --disk vda=disk.img")
    def convert_incremental(self) -> None:
        with _open_disks(self.path("disk.img")) as disks:
            source("qemu").convert(
                self.path("vm2.save"), self.path("vm2.lean"), parents=[self.path("vm.lean")], disks=disks
            )
        with LeanImage.open(self.path("vm2.lean"), parents=[self.path("vm.lean")]) as image:
            click.echo(f"   {_classes_line(image)}")
        click.echo(
            "   PARENT: unchanged pages, found in vm.lean by digest; DELTA: changed pages as their changed "
            "words; STORED: the rewritten ones"
        )
        self.measure("vm2.lean: incremental", self.path("vm2.lean"), "vm2.save")

    @_timed("leanimg map vm2.lean   # where the bytes of each extent are (first extents of each class)")
    def show_map(self) -> None:
        from .extent_map import describe_place, extent_entries

        with LeanImage.open(self.path("vm2.lean"), parents=[self.path("vm.lean")]) as image:
            shown: dict[str, int] = {}
            for e in extent_entries(image, image.region("pc.ram")):
                if shown.get(e["page_class"], 0) < 2:
                    shown[e["page_class"]] = shown.get(e["page_class"], 0) + 1
                    click.echo(
                        f"   pc.ram {e['start']:#10x} {e['pages']:5d} pages {e['page_class']:<6} "
                        f"{describe_place(e['page_class'], e['where'])}"
                    )
            picture = self.path("memory.png")
            try:
                from .memory_picture import render_map

                render_map(image, picture)
            except LeanImageError:  # no Pillow: the SVG needs nothing
                picture = self.path("memory.svg")
                render_map(image, picture)
        click.echo(f"   the picture: {picture} (leanimg inspect vm2.lean --map {os.path.basename(picture)})")

    @_timed("leanimg validate --chain vm2.lean --disk vda=disk.img")
    def validate_both(self) -> None:
        for name, parents in (("vm.lean", []), ("vm2.lean", [self.path("vm.lean")])):
            with _open_disks(self.path("disk.img")) as disks:
                report = validate(self.path(name), disks=disks, parents=parents)
            for finding in report.findings:
                click.echo(f"   {finding}")
            verdict = (
                "valid"
                if report.valid and report.complete
                else "INVALID"
                if not report.valid
                else "not every rule checked"
            )
            click.echo(f"   {name}: {verdict}: " + ", ".join(f"{v} {k}" for k, v in sorted(report.checked.items())))
            self.ok &= report.valid and report.complete

    def restore_both(self) -> None:
        for name, save, rebuilt, parents in (
            ("vm.lean", "vm.save", "rebuilt.save", []),
            ("vm2.lean", "vm2.save", "rebuilt2.save", [self.path("vm.lean")]),
        ):
            t = _step(f"leanimg restore {name} --to qemu --disk vda=disk.img -o {rebuilt}")
            with LeanImage.open(self.path(name), parents=parents, disks=_disks(self.path("disk.img"))) as image:
                write_atomically(self.path(rebuilt), lambda out: target("qemu").restore(image, out))
            original, again = sha256_file(self.path(save)), sha256_file(self.path(rebuilt))
            same = original == again
            self.ok &= same
            click.echo(
                f"   sha256 {save} {original[:16]}…  {rebuilt} {again[:16]}…  "
                f"{'IDENTICAL' if same else 'DIFFERENT'}: every page checked against its xxh3-128 digest, "
                "DISK pages read from disk.img"
            )
            _done(t, f'(qemu-system-x86_64 <the sample\'s machine> -incoming "exec:cat {rebuilt}")')

    def summary(self) -> None:
        click.secho(
            "\nsizes (each against the save it was converted from, and zstd -3 of that save, this run):", bold=True
        )
        click.echo(f"   {'':<28} {'bytes':>12} {'MiB':>9} {'vs save':>10} {'vs zstd -3':>11}")
        for save in ("vm.save", "vm2.save"):
            size = os.path.getsize(self.path(save))
            click.echo(f"   {save + ' (QEMU 7.2 stream)':<28} {size:>12,} {size / MIB:>9.2f} {'1.00x':>10}")
            click.echo(
                f"   {'zstd -3 of ' + save:<28} {self.zstd[save]:>12,} {self.zstd[save] / MIB:>9.2f} "
                f"{size / self.zstd[save]:>9.2f}x {'100%':>11}"
            )
            for label, nbytes, of in self.sizes:
                if of == save:
                    click.echo(
                        f"   {label:<28} {nbytes:>12,} {nbytes / MIB:>9.2f} "
                        f"{size / nbytes:>9.2f}x {nbytes / self.zstd[save]:>11.1%}"
                    )


def _write_changed_copy(image: LeanImage, path: str) -> str:
    """``image``'s memory with words changed in some pages of pc.ram, as a lean image with the
    same regions and source state (restored --to qemu it is a save of the changed guest)."""
    rng = np.random.default_rng(SEED)
    with LeanImageWriter(path, page_size=image.page_size) as writer:
        writer.declare_source_state()
        ids = [writer.add_region(r.name, r.size_bytes, r.guest_phys_base) for r in image.regions]
        for state in image.source_states:
            writer.add_source_state(state.source_format, state.tag, state.data)
        for region, region_id in zip(image.regions, ids):
            words = np.frombuffer(bytes(image.region_bytes(region, 0, region.num_pages)), np.uint64)
            words = words.reshape(region.num_pages, -1).copy()
            if region.name == "pc.ram":
                stored = np.flatnonzero(image.classes(region) == PageClass.STORED)
                pages = rng.choice(stored, TICKED_PAGES + REWRITTEN_PAGES, replace=False)
                for page in pages[:TICKED_PAGES].tolist():
                    which = rng.choice(words.shape[1], int(rng.integers(1, TICKED_WORDS + 1)), replace=False)
                    words[page, which] += np.uint64(1)
                rewritten = pages[TICKED_PAGES:]
                words[rewritten] = rng.integers(1, 1 << 63, (len(rewritten), words.shape[1]), dtype=np.uint64)
            writer.put_pages(region_id, 0, words.tobytes())
    return f"{TICKED_PAGES + REWRITTEN_PAGES} pages changed"


def run_demo(workdir: str | None = None, keep: bool = False) -> bool:
    owned = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="leanimg-demo-")
    os.makedirs(workdir, exist_ok=True)
    start = time.perf_counter()
    demo = Demo(workdir)
    try:
        demo.unpack()
        demo.convert_inline()
        free_pages = demo.write_free_hints()
        demo.convert_lean(free_pages)
        demo.show_files()
        demo.make_second_save()
        demo.convert_incremental()
        demo.show_map()
        demo.validate_both()
        demo.restore_both()
        demo.summary()
        verdict = (
            "OK: both images valid, both restored bit-exact"
            if demo.ok
            else "FAILED: an image is not valid or a restore differs from its save (see above)"
        )
        click.secho(
            f"\n{verdict} ({time.perf_counter() - start:.1f} s in all).", bold=True, fg="green" if demo.ok else "red"
        )
        return demo.ok
    finally:
        if owned and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            click.echo(f"files kept in {workdir}")
