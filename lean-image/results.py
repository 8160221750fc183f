"""What the commands that write an image or guest memory report when they finish: the JSON of
``convert``, ``flatten``, ``merge`` and ``restore`` (schemas/*.schema.json) and their summary line."""

from __future__ import annotations

import os

from .inspect import class_counts, class_dict
from .reader import LeanImage

MIB = 2**20


def written_image(path: str, parents=()) -> dict:
    """The image just written at ``path``: its size, its memory and its pages by class (nulls for
    an output that is a device or FIFO: what went there cannot be read back)."""
    if not os.path.isfile(path):
        return dict(
            output=path, file_bytes=None, logical_bytes=None, ratio=None, page_size=None, classes={}, parent=None
        )
    with LeanImage.open(path, parents=parents) as image:
        logical = sum(r.size_bytes for r in image.regions)
        stored = image.footer.file_length
        return dict(
            output=path,
            file_bytes=stored,
            logical_bytes=logical,
            ratio=logical / stored,
            page_size=image.page_size,
            classes=class_dict(class_counts(image)),
            parent=image.parent.path if image.parent is not None else None,
        )


def image_line(result: dict) -> str:
    """``vm.lean: written, 12.3 MiB for 128.0 MiB of guest memory (10.41x); pages: 9 STORED, 1 ZERO``"""
    if result["file_bytes"] is None:
        return f"{result['output']}: written"
    pages = ", ".join(f"{n} {name}" for name, n in result["classes"].items())
    parent = f"; parent {result['parent']}" if result.get("parent") else ""
    return (
        f"{result['output']}: written, {result['file_bytes'] / MIB:.1f} MiB for "
        f"{result['logical_bytes'] / MIB:.1f} MiB of guest memory ({result['ratio']:.2f}x); "
        f"pages: {pages}{parent}"
    )


def convert_result(save: str, written: dict, source_name: str, disk_summary, hint_report: dict, seconds: float) -> dict:
    save_bytes = os.path.getsize(save) if save != "-" and os.path.isfile(save) else None
    disks = None
    if disk_summary is not None:
        disks = dict(
            pages={name: int(n) for name, n in disk_summary.pages.items()},
            scanned_bytes=disk_summary.scanned_bytes,
            indexed_pages=disk_summary.indexed_pages,
        )
    return dict(
        written,
        save=save,
        source=source_name,
        save_bytes=save_bytes,
        disk_scan=disks,
        hints={kind: dict(counts) for kind, counts in (hint_report or {}).items()},
        seconds=round(seconds, 3),
    )


def convert_line(result: dict) -> str:
    against = (
        f", {result['save_bytes'] / result['file_bytes']:.2f}x smaller than the save"
        if result["save_bytes"] and result["file_bytes"]
        else ""
    )
    return image_line(result) + f"; converted in {result['seconds']:.1f} s{against}"


def restore_result(image: LeanImage, output: str, target: str, seconds: float) -> dict:
    counts = class_counts(image)
    return dict(
        image=image.path,
        target=target,
        output=output,
        output_bytes=os.path.getsize(output) if output != "-" and os.path.isfile(output) else None,
        logical_bytes=sum(r.size_bytes for r in image.regions),
        page_size=image.page_size,
        classes=class_dict(counts),
        links=len(image.chain()),
        seconds=round(seconds, 3),
    )


def restore_line(result: dict) -> str:
    where = "standard output" if result["output"] == "-" else result["output"]
    return (
        f"{where}: restored {result['logical_bytes'] / MIB:.1f} MiB of guest memory as {result['target']} "
        f"from {result['links']} link(s) in {result['seconds']:.1f} s"
    )
