"""Restore to libvirt's save image: `virsh restore FILE`, or managedsave's file and `virsh start`.

The header, domain XML, cookie and padding come back verbatim from SOURCE_STATE tag 3
(converters/libvirt.py, spec §5.4.3), the QEMU stream after them as `restore --to qemu`
writes it. A raw payload gives the original file byte for byte. A compressed payload is
compressed again with the program libvirt uses (`PROG -c`, xz with -3): the same program
version gives the same bytes, another may not, and libvirt only needs to decompress it.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from typing import BinaryIO

from leanimg.converters import libvirt
from leanimg.converters.source_state import QEMU_TAG_LIBVIRT_HEADER, unpack_libvirt_header
from leanimg.errors import UnsupportedError
from leanimg.format import SourceFormat
from leanimg.reader import LeanImage

from .qemu import restore_qemu, stream_state
from .targets import fitting_targets


def saved_header(image: LeanImage, required: bool = True) -> libvirt.SaveHeader | None:
    """libvirt's header kept when the image was converted (None, or UnsupportedError when
    ``required``, for an image that was not converted from libvirt's save image)."""
    for state in image.source_states:
        if state.source_format == SourceFormat.QEMU and state.tag == QEMU_TAG_LIBVIRT_HEADER:
            return unpack_libvirt_header(state.data, state.offset)
    if required:
        raise UnsupportedError(
            "the image has no libvirt save header (SOURCE_STATE tag 3): it was not converted "
            f"from libvirt's save image; use {fitting_targets(image)}",
            structure="source_state",
        )
    return None


def restore_libvirt(image: LeanImage, out: BinaryIO, progress=None) -> int:
    """Write the header and data, then the QEMU stream (compressed as the original was)."""
    header = saved_header(image)
    stream_state(image)  # an image without the stream state fails before writing
    argv = libvirt.COMPRESSORS.get(header.compression)
    if argv and shutil.which(argv[0]) is None:
        raise UnsupportedError(
            f"the save's payload was {header.compression.label}-compressed and the {argv[0]} "
            f"program is not installed (Debian package {argv[0]})",
            structure="--to libvirt",
        )
    out.write(header.raw)
    if argv is None:
        return len(header.raw) + restore_qemu(image, out, progress)
    out.flush()
    return len(header.raw) + _compressed(image, out, progress, argv)


def _compressed(image: LeanImage, out: BinaryIO, progress, argv: list[str]) -> int:
    """restore_qemu through ``argv`` (compressing stdin to stdout) into ``out``."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    written, errors = [0], []

    def drain():
        try:
            while chunk := proc.stdout.read(1 << 20):
                out.write(chunk)
                written[0] += len(chunk)
        except OSError as exc:  # the output's own failure, raised below
            errors.append(exc)
            proc.kill()

    def stderr():
        errors.append(proc.stderr.read())

    threads = [threading.Thread(target=drain, daemon=True), threading.Thread(target=stderr, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        restore_qemu(image, proc.stdin, progress)
        proc.stdin.close()
    except BaseException:
        proc.kill()
        raise
    finally:
        status = proc.wait()
        for thread in threads:
            thread.join()
        proc.stdout.close()
        proc.stderr.close()
    failures = [e for e in errors if isinstance(e, OSError)]
    if failures:
        raise failures[0]
    if status != 0:
        message = b"".join(e for e in errors if isinstance(e, bytes)).decode(errors="replace").strip()
        raise OSError(f"{' '.join(argv)} exited with status {status}: {message}")
    out.flush()
    return written[0]


def describe_image(image: LeanImage) -> str | None:
    header = saved_header(image, required=False)
    return None if header is None else libvirt.describe(header)


def image_details(image: LeanImage) -> dict | None:
    header = saved_header(image, required=False)
    return None if header is None else libvirt.details(header)
