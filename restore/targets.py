"""The restore targets, as ``leanimg.targets`` plugins (leanimg.plugins).

Each imports its restorer only when it restores or describes, so `leanimg restore --to raw`
imports the raw restorer alone and `inspect` none but the Xen one.
"""

from __future__ import annotations


class RawTarget:
    name = "raw"
    description = "flat guest memory: the regions in file order, concatenated"

    def restore(self, image, out, progress=None) -> int:
        from .raw import restore_raw
        return restore_raw(image, out, progress)

    def describe(self, image) -> None:
        return None


class QemuTarget:
    name = "qemu"
    description = "the QEMU migration stream the image was converted from, for `qemu -incoming`"

    def restore(self, image, out, progress=None) -> int:
        from .qemu import restore_qemu
        return restore_qemu(image, out, progress)

    def describe(self, image) -> None:
        return None


class XenTarget:
    name = "xen"
    description = "the Xen save file (xl, libxl or libxc stream) the image was converted from"

    def restore(self, image, out, progress=None) -> int:
        from .xen import restore_xen
        return restore_xen(image, out, progress)

    def describe(self, image) -> str | None:
        """'Xen xl save file, libxl v2, libxc v3, x86 HVM' for an image converted from Xen."""
        from .xen import describe_image
        return describe_image(image)


RAW, QEMU, XEN = RawTarget(), QemuTarget(), XenTarget()
