"""The restore targets, as ``leanimg.targets`` plugins (leanimg.plugins).

Each imports its restorer only when it restores or describes, so `leanimg restore --to raw`
imports the raw restorer alone and `inspect` none but the Xen one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RestoreTarget:
    name: str
    description: str
    module: str  # the restorer's module in this package
    restorer: str  # its function (image, out, progress) -> bytes written
    describer: str | None = None  # its function (image) -> what the image rebuilds, or None
    server: str | None = None  # "module:function" (image, out, inp, **options) serving it lazily
    details_of: str | None = None  # its function (image) -> a dict for `inspect --json`, or None
    source_states: tuple = ()  # (source_format, tag) of the SOURCE_STATE records it rebuilds from

    def restore(self, image, out, progress=None) -> int:
        return getattr(self._module(), self.restorer)(image, out, progress)

    def describe(self, image) -> str | None:
        return getattr(self._module(), self.describer)(image) if self.describer else None

    def details(self, image) -> dict | None:
        """What the image's SOURCE_STATE records say of the save, as a dict (inspect --json)."""
        return getattr(self._module(), self.details_of)(image) if self.details_of else None

    def serve(self, image, out, inp, **options):
        """Serve ``image`` to a hypervisor that loads it lazily (QEMU post-copy): the stream on
        ``out``, the hypervisor's requests on ``inp``."""
        if self.server is None:
            from leanimg.errors import UnsupportedError

            raise UnsupportedError(f"restore target {self.name!r} cannot be served lazily")
        module, function = self.server.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)(image, out, inp, **options)

    def _module(self):
        return importlib.import_module(f"{__package__}.{self.module}")


def fitting_targets(image) -> str:
    """The --to options that fit an image, for messages: its source format's, and raw."""
    from leanimg.plugins import source_targets

    return " or ".join(f"--to {name}" for name in [*source_targets(image), "raw"])


RAW = RestoreTarget("raw", "flat guest memory: the regions in file order, concatenated", "raw", "restore_raw")
QEMU = RestoreTarget(
    "qemu",
    "the QEMU migration stream the image was converted from, for `qemu -incoming`",
    "qemu",
    "restore_qemu",
    server="postcopy:serve_postcopy",
)
LIBVIRT = RestoreTarget(
    "libvirt",
    "libvirt's save image the image was converted from (virsh save, managedsave, "
    "snapshot memory), for `virsh restore` / `virsh start`",
    "libvirt",
    "restore_libvirt",
    "describe_image",
    details_of="image_details",
    source_states=((1, 3),),
)
QEMU_MAPPED_RAM = RestoreTarget(
    "qemu-mapped-ram",
    "a QEMU mapped-ram file (QEMU >= 9.0) for `migrate-incoming "
    "file:FILE` with the capability mapped-ram set; needs -o FILE (it seeks)",
    "qemu",
    "restore_qemu_mapped_ram",
)
XEN = RestoreTarget(
    "xen",
    "the Xen save file (xl, libxl or libxc stream) the image was converted from",
    "xen",
    "restore_xen",
    "describe_image",
)
