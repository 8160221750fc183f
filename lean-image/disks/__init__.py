"""Disk I/O shared by convert, restore, validate and inspect.

``sources`` (re-exported here): the DiskSource interface every disk is read through, its raw
and qcow2 backends, ``open_disk`` and the identity check against a disk table.
``partitions``: MBR and GPT partition tables and the stretches a disk scan reads at each
partition's phase. ``files``: which files of a disk's ext2/3/4 filesystems DISK pages came
from (``inspect --files``). Those two are imported where used, keeping a restore's start short.
"""

from .sources import DiskSource, ImageDisk, RawDisk, check_identity, open_disk

__all__ = ["DiskSource", "ImageDisk", "RawDisk", "check_identity", "open_disk"]
