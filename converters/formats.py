"""The save-file formats the converters read, as ``leanimg.sources`` plugins (leanimg.plugins).

Recognising a format from a file's first bytes is done here and nowhere else: by the
command line's hint for a save file given where a lean image was expected, and by
``convert`` when no ``--from`` names the format. Converting is converters/convert.py,
imported only when a conversion starts, so recognising a file stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

QEMU_MAGIC = b"QEVM"
XEN_XL_MAGIC = b"Xen saved domain"
XEN_LIBXL_IDENT = b"LibxlFmt"
XEN_LIBXC_MARKER = b"\xff" * 8
LIBVIRT_MAGIC = b"LibvirtQemudSave"  # converters/libvirt.py; not imported here: detection stays cheap
LIBVIRT_PARTIAL_MAGIC = b"LibvirtQemudPart"  # an interrupted save: recognised, so its reader says so


@dataclass(frozen=True)
class SaveFormat:
    """A source plugin: a save-file format known by its magics, converted by convert_file."""

    name: str
    description: str
    signature: str
    magics: tuple[bytes, ...]
    cut_inside_magic: bool = False  # a file shorter than its magic counts (its reader says truncated)

    def detect(self, head: bytes) -> bool:
        if head.startswith(self.magics):
            return True
        return self.cut_inside_magic and bool(head) and any(magic.startswith(head) for magic in self.magics)

    def convert(
        self,
        save,
        output: str,
        *,
        disks: dict | None = None,
        all_phases: bool = False,
        disk_progress=None,
        hints=None,
        trust_dirty_log: bool = False,
        disk_scan: bool | None = None,
        hint_report: dict | None = None,
        **options,
    ):
        """Convert ``save`` into the lean image ``output`` (``options``: convert_file's). With
        ``disks`` (open disk sources by name; the caller closes them), pages found on them
        become DISK references and the scan's DiskSummary is returned. ``hints`` (a path, bytes,
        a stream or a read leanimg.hints.Hints) are applied as spec/hints.md says; with DISK hints
        the disks are scanned only when ``disk_scan`` says so; what the hints did is put in the
        dict ``hint_report``."""
        from .convert import DiskOptions, convert_file
        from .hinting import HintOptions

        hinted = HintOptions(hints, trust_dirty_log) if hints is not None else None
        scan = None
        if disks:
            wanted = disk_scan if disk_scan is not None else not (hinted and hinted.has_disk_hints)
            scan = DiskOptions(dict(disks), all_phases, disk_progress, scan=wanted)
        convert_file(save, output, source_format=self.name, disks=scan, hints=hinted, **options)
        if hinted is not None and hint_report is not None:
            hint_report.update(hinted.report or {})
        return scan.summary if scan and scan.scan else None

    def disk_paths(self, save) -> dict[str, str]:
        """The files of the VM's disks by device name, as the save itself names them (libvirt's
        domain XML: <disk><source file=...><target dev=...>); {} when the format names none."""
        if self.name != "libvirt":
            return {}
        from .libvirt import disk_paths

        return disk_paths(save)

    def guest(self, save):
        """What hints for ``save`` are checked against (leanimg.hints.Guest)."""
        from .hinting import guest_of_save

        return guest_of_save(self.name, save)


QEMU = SaveFormat("qemu", "a QEMU migration stream", f"magic {QEMU_MAGIC.hex(' ')}", (QEMU_MAGIC,))
XEN = SaveFormat(
    "xen",
    "a Xen save file",
    'xl magic, "LibxlFmt" or libxc marker ff..ff',
    (XEN_XL_MAGIC, XEN_LIBXL_IDENT, XEN_LIBXC_MARKER),
    cut_inside_magic=True,
)
LIBVIRT = SaveFormat(
    "libvirt",
    "a libvirt QEMU save image (virsh save, managedsave, snapshot memory)",
    f'magic "{LIBVIRT_MAGIC.decode()}"',
    (LIBVIRT_MAGIC, LIBVIRT_PARTIAL_MAGIC),
)
