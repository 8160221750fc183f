"""Readers and writers of ordinary hypervisor save files (QEMU, Xen)."""
