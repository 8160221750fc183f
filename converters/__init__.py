"""Readers and writers of ordinary hypervisor save files (QEMU, Xen), registered as
``leanimg.sources`` plugins in formats.py; diskrefs.py finds guest pages on the VM's disks."""
