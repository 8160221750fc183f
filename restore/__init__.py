"""Restore targets: a lean image back to raw memory, a QEMU migration stream or a Xen save file.

Registered as ``leanimg.targets`` plugins in targets.py. The chain a restore reads through
is resolved by the core (lean-image/chain/), disks are read through leanimg.disks.
"""
