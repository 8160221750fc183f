"""`leanimg demo`: convert → inspect → validate → restore → verify on the bundled sample.

The sample is a real QEMU 7.2 save of a small Linux guest (tests/guest builds it), shipped
zstd-compressed as package data, so the demo runs without QEMU installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from importlib import resources

import click
import zstandard

from .fileutil import sha256_file, write_atomically
from .inspect import render_text, summarize
from .plugins import source, target
from .reader import LeanImage
from .validate import validate

SAMPLE_PACKAGE = "leanimg.sample"
SAMPLE_SAVE = "vm.save.zst"


def sample_path(name: str) -> str:
    return str(resources.files(SAMPLE_PACKAGE).joinpath(name))


def _decompress(src: str, dest: str) -> None:
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)


def _step(title: str):
    click.secho(f"\n== {title}", bold=True)
    return time.perf_counter()


def _done(start: float, note: str = "") -> None:
    click.echo(f"   ({time.perf_counter() - start:.2f} s){' ' + note if note else ''}")


def run_demo(workdir: str | None = None, keep: bool = False) -> bool:
    owned = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="leanimg-demo-")
    os.makedirs(workdir, exist_ok=True)
    save, lean = os.path.join(workdir, "vm.save"), os.path.join(workdir, "vm.lean")
    rebuilt, raw = os.path.join(workdir, "rebuilt.save"), os.path.join(workdir, "memory.raw")
    try:
        t = _step("the bundled sample: a real QEMU 7.2 save (`migrate exec:cat > vm.save`)")
        _decompress(sample_path(SAMPLE_SAVE), save)
        _done(t, f"{save}: {os.path.getsize(save) / 2**20:.1f} MiB")

        t = _step(f"leanimg convert {save} -o {lean}")
        source("qemu").convert(save, lean)
        _done(t)

        t = _step(f"leanimg inspect {lean}")
        with LeanImage.open(lean) as image:
            click.echo(render_text(summarize(image)))
        _done(t)

        t = _step(f"leanimg validate {lean}")
        report = validate(lean)
        for finding in report.findings:
            click.echo(f"   {finding}")
        click.echo(f"   {'valid' if report.valid else 'INVALID'}: "
                   + ", ".join(f"{v} {k}" for k, v in sorted(report.checked.items())))
        _done(t)

        t = _step(f"leanimg restore {lean} --to qemu -o {rebuilt}")
        with LeanImage.open(lean) as image:
            write_atomically(rebuilt, lambda out: target("qemu").restore(image, out))
        _done(t, "(feed it to `qemu-system-x86_64 ... -incoming \"exec:cat rebuilt.save\"`)")

        t = _step(f"leanimg restore {lean} --to raw -o {raw}")
        with LeanImage.open(lean) as image:
            write_atomically(raw, lambda out: target("raw").restore(image, out))
        _done(t, "every page checked against its xxh3-128 digest")

        t = _step("verify: the rebuilt stream is the original, byte for byte")
        same = sha256_file(save) == sha256_file(rebuilt)
        click.echo(f"   sha256 original {sha256_file(save)[:16]}…  rebuilt {sha256_file(rebuilt)[:16]}…  "
                   f"{'IDENTICAL' if same else 'DIFFERENT'}")
        _done(t)
        ok = report.valid and same
        sizes = (os.path.getsize(save), os.path.getsize(lean))
        click.secho(f"\n{'OK' if ok else 'FAILED'}: {sizes[0] / 2**20:.1f} MiB save → {sizes[1] / 2**20:.1f} MiB "
                    f"lean image ({sizes[0] / sizes[1]:.2f}x), restored bit-exact.", bold=True,
                    fg="green" if ok else "red")
        return ok
    finally:
        if owned and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif keep or not owned:
            click.echo(f"files kept in {workdir}")
