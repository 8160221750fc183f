"""Restore to the Xen save stream an image was converted from (xl, libxl or libxc form)."""

from __future__ import annotations

from typing import BinaryIO

from leanimg.converters import xen
from leanimg.converters.source_state import XEN_TAG_SKELETON, unpack_skeleton
from leanimg.errors import UnsupportedError
from leanimg.format import SourceFormat
from leanimg.reader import LeanImage

from .targets import fitting_targets


def _skeleton_state(image: LeanImage):
    """The SOURCE_STATE record (Xen tag 1) holding the stream's skeleton, or None."""
    return next(
        (
            state
            for state in image.source_states
            if state.source_format == SourceFormat.XEN and state.tag == XEN_TAG_SKELETON
        ),
        None,
    )


def skeleton_items(image: LeanImage):
    """The skeleton items of the image's Xen stream (SOURCE_STATE Xen tag 1)."""
    state = _skeleton_state(image)
    if state is not None:
        return unpack_skeleton(state.data, state.offset)
    raise UnsupportedError(
        "the image has no Xen stream skeleton (SOURCE_STATE Xen tag 1): it was "
        f"not converted from a Xen save; use {fitting_targets(image)}",
        structure="source_state",
    )


def restore_xen(image: LeanImage, out: BinaryIO, progress=None) -> int:
    """Write the rebuilt stream to ``out``; return its length."""
    items = skeleton_items(image)
    region = image.region(xen.REGION_NAME)
    image.enable_read_ahead()

    def read_pages(first: int, count: int):
        data = image.region_bytes(region, first, count)
        if progress:
            progress(len(data))
        return data

    written = xen.write_stream(out, items, read_pages, region.num_pages)
    out.flush()
    return written


def describe_image(image: LeanImage) -> str | None:
    """'Xen xl save file, libxl v2, libxc v3, x86 HVM' for an image converted from Xen."""
    state = _skeleton_state(image)
    return None if state is None else xen.describe(unpack_skeleton(state.data, state.offset))
