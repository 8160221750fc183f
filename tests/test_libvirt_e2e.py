"""End to end with a real libvirtd (Debian 12's libvirt 9.0), a TCG domain and `virsh`.

The whole module runs twice: the domain's ``<emulator>`` is QEMU 7.2 (Debian 12's) and then
QEMU 10.0 (the wrapper .ci/install writes beside it, tests/guest/qemus.py), machine ``pc``.
The module starts virtlogd and libvirtd itself when they are not running (no systemd here:
../shared/ENVIRONMENT.md) after appending the settings they need to /etc/libvirt/qemu.conf,
and stops what it started at the end. One persistent 128 MiB domain built from the test guest
(tests/guest/build.py) boots once and runs the ``idle`` workload, whose heartbeat ``HB idle n``
on the serial console (a unix socket: the console takes the workload's command, a file console
could not) proves that a restored guest runs. Then, one after another on that domain:

* ``virsh save`` with a raw payload, and with an xz payload (``save_image_format = "xz"``,
  libvirtd restarted: libvirt 9.0's virsh has no ``--image-format``);
* ``virsh managedsave`` (/var/lib/libvirt/qemu/save/DOM.save, resumed by ``virsh start``);
* an external memory snapshot (``snapshot-create-as --memspec ... --diskspec vda,snapshot=no``).

Before each the domain is suspended and ``pmemsave`` (through ``qemu-monitor-command``) takes
the ground truth. Each file is converted with and without ``--disk vda=DISK``, validated,
restored with ``--to libvirt`` (byte-identical to the file for a raw payload), the restored
file is given to ``virsh restore`` (``virsh start`` for managedsave), the guest's memory is
pmemsaved again while it is still paused and compared byte for byte, and after resuming it
its heartbeat goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from guest.build import READY_MARKER, build_guest
from guest.qemus import qemu_params
from guest.scenarios import heartbeats
from guest.vm import NUDGE_AFTER, GuestError, Serial, copy_disk
from helpers import first_difference
from leanimg.cli import command_line
from leanimg.fileutil import sha256_file

pytestmark = pytest.mark.qemu

QEMU_CONF = Path("/etc/libvirt/qemu.conf")
# ENVIRONMENT.md: what libvirt 9.0 needs to run domains as root without systemd and cgroups
SETTINGS = {
    "security_driver": '"none"',
    "cgroup_controllers": "[ ]",
    "user": '"root"',
    "group": '"root"',
    "remember_owner": "0",
}
MEM_MIB = 128
URI = "qemu:///system"
CLI_TIMEOUT = 300
LEANIMG = command_line()


def virsh(*args, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(["virsh", "-c", URI, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"virsh {' '.join(map(str, args))} exited {proc.returncode}: {proc.stderr}")
    return proc


def cli(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, text=True, timeout=CLI_TIMEOUT)
    assert proc.returncode == 0, f"leanimg {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc


def _pids(name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _set_config(settings: dict[str, str]) -> None:
    """Append ``key = value`` lines to qemu.conf where the key is not set to that value yet;
    a key set to another value by an earlier append of ours is changed in place."""
    lines = QEMU_CONF.read_text().splitlines()
    for key, value in settings.items():
        wanted = f"{key} = {value}"
        found = [i for i, line in enumerate(lines) if line.split("=")[0].strip() == key]
        if found:
            lines[found[-1]] = wanted
        else:
            lines.append(wanted)
    QEMU_CONF.write_text("\n".join(lines) + "\n")


class Daemons:
    """virtlogd and libvirtd, started here when they are not running, stopped at the end."""

    def __init__(self):
        self.started: list[str] = []

    def start(self) -> None:
        Path("/run/libvirt").mkdir(parents=True, exist_ok=True)
        for name, path in (("virtlogd", "/usr/sbin/virtlogd"), ("libvirtd", "/usr/sbin/libvirtd")):
            if not _pids(name):
                subprocess.run([path, "-d"], check=True, timeout=60)
                if name not in self.started:
                    self.started.append(name)
        self.wait()

    def restart_libvirtd(self) -> None:
        """A config change needs the daemon restarted (running domains survive)."""
        for pid in _pids("libvirtd"):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _pids("libvirtd") and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run(["/usr/sbin/libvirtd", "-d"], check=True, timeout=60)
        if "libvirtd" not in self.started:
            self.started.append("libvirtd")
        self.wait()

    @staticmethod
    def wait(timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if virsh("version", check=False, timeout=30).returncode == 0:
                return
            time.sleep(0.5)
        raise GuestError("libvirtd does not answer `virsh version`")

    def stop(self) -> None:
        for name in reversed(self.started):
            for pid in _pids(name):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(_pids(name) for name in self.started) and time.monotonic() < deadline:
            time.sleep(0.2)


def domain_xml(name: str, dom_uuid: str, build, disk: Path, serial: Path, emulator: str) -> str:
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <uuid>{dom_uuid}</uuid>
  <memory unit='MiB'>{MEM_MIB}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{build.kernel}</kernel>
    <initrd>{build.initrd}</initrd>
    <cmdline>{build.cmdline}</cmdline>
  </os>
  <features><acpi/></features>
  <cpu mode='custom' match='exact' check='none'><model fallback='allow'>qemu64</model></cpu>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{emulator}</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='writeback'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <controller type='usb' model='none'/>
    <serial type='unix'>
      <source mode='bind' path='{serial}'/>
      <target port='0'/>
    </serial>
    <memballoon model='none'/>
  </devices>
</domain>
"""


class Domain:
    """The test domain: its console (reconnected after each restore), pmemsave, heartbeats."""

    def __init__(self, name: str, workdir: Path, disk: Path, serial: Path):
        self.name, self.workdir, self.disk, self.serial_path = name, workdir, disk, serial
        self.serial: Serial | None = None
        self.text = ""  # console output of earlier QEMU processes
        self.consoles = 0

    def connect(self, timeout: float = 60) -> None:
        self.disconnect()
        self.consoles += 1
        self.serial = Serial(
            self.serial_path, self.workdir / f"console-{self.consoles}.log", timeout=timeout, nudge_after=NUDGE_AFTER
        )

    def disconnect(self) -> None:
        if self.serial is not None:
            self.text += self.serial.text
            self.serial.close()
            self.serial = None

    def state(self) -> str:
        return virsh("domstate", self.name).stdout.strip()

    def pmemsave(self, path: Path) -> None:
        command = {"execute": "pmemsave", "arguments": {"val": 0, "size": MEM_MIB << 20, "filename": str(path)}}
        reply = json.loads(virsh("qemu-monitor-command", self.name, json.dumps(command)).stdout)
        assert "error" not in reply, reply
        assert path.stat().st_size == MEM_MIB << 20

    def heartbeat(self) -> int:
        beats = heartbeats(self.serial.text if self.serial else "", "idle")
        return beats[-1] if beats else -1

    def wait_heartbeat_after(self, n: int, timeout: float = 90) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.heartbeat() > n:
                return self.heartbeat()
            time.sleep(0.2)
        raise GuestError(
            f"no 'HB idle n' with n > {n} within {timeout} s; console:\n"
            f"{(self.serial.text if self.serial else '')[-1500:]}"
        )


@pytest.fixture(scope="module")
def libvirtd():
    if shutil.which("virsh") is None or not os.path.exists("/usr/sbin/libvirtd"):
        pytest.skip("libvirt is not installed (libvirt-daemon-system, libvirt-clients)")
    if os.geteuid() != 0:
        pytest.skip("the libvirt test configures and starts libvirtd: it needs root")
    _set_config(dict(SETTINGS, save_image_format='"raw"', snapshot_image_format='"raw"'))
    daemons = Daemons()
    try:
        daemons.start()
        yield daemons
    finally:
        daemons.stop()


@pytest.fixture(scope="module", params=qemu_params())
def domain(request, libvirtd, module_dirs):
    """A persistent domain on the QEMU of the param, booted, the idle workload beating;
    undefined at the end."""
    qemu = request.param
    qemu.require()
    build = build_guest()
    workdir = module_dirs("libvirt")
    name = f"leanimg-test-{os.getpid()}-{qemu.version}"
    disk = copy_disk(build.disk, workdir / "disk.img")
    serial = workdir / "serial.sock"
    xml = workdir / "domain.xml"
    xml.write_text(domain_xml(name, str(uuid.uuid4()), build, disk, serial, shutil.which(qemu.binary)))
    virsh("define", xml)
    dom = Domain(name, workdir, disk, serial)
    try:
        virsh("start", name)
        dom.connect()
        dom.serial.wait_for(READY_MARKER, timeout=300)
        dom.serial.send("run idle")
        dom.wait_heartbeat_after(0)
        yield dom
    finally:
        dom.disconnect()
        virsh("destroy", name, check=False)
        virsh("managedsave-remove", name, check=False)
        for snap in virsh("snapshot-list", name, "--name", check=False).stdout.split():
            virsh("snapshot-delete", name, snap, "--metadata", check=False)
        virsh("undefine", name, "--managed-save", "--snapshots-metadata", check=False)
        shutil.rmtree(workdir, ignore_errors=True)


def _truth(dom: Domain, tag: str) -> tuple[Path, int]:
    """Suspend the running domain and pmemsave its memory: (the file, the last heartbeat)."""
    virsh("suspend", dom.name)
    truth = dom.workdir / f"{tag}.truth"
    dom.pmemsave(truth)
    return truth, dom.heartbeat()


def _convert_and_restore(dom: Domain, save: Path, tag: str, restored: Path) -> None:
    """convert (also with --disk), validate, restore --to libvirt into ``restored``."""
    image, with_disk = dom.workdir / f"{tag}.lean", dom.workdir / f"{tag}-disk.lean"
    cli("convert", save, "-o", image)
    cli("convert", save, "-o", with_disk, "--disk", f"vda={dom.disk}")
    cli("validate", image)
    cli("validate", with_disk, "--disk", f"vda={dom.disk}")
    shown = json.loads(cli("inspect", image, "--json").stdout)["source_details"]
    assert shown["domain_name"] == dom.name and shown["memory_bytes"] == MEM_MIB << 20
    cli("restore", with_disk, "--to", "libvirt", "--disk", f"vda={dom.disk}", "-o", restored, "-f")


def _check_resumed(dom: Domain, truth: Path, heartbeat: int, tag: str, paused: bool = True) -> None:
    """The restored domain, paused: memory equal to ``truth``; resumed: heartbeats go on."""
    dom.connect()
    assert dom.state() == "paused", dom.state()
    back = dom.workdir / f"{tag}.back"
    dom.pmemsave(back)
    assert sha256_file(back) == sha256_file(truth), first_difference(back, truth)
    back.unlink()
    truth.unlink()
    virsh("resume", dom.name)
    assert dom.wait_heartbeat_after(heartbeat) > heartbeat
    assert dom.state() == "running"


def _save_kind(dom: Domain, tag: str) -> None:
    truth, beat = _truth(dom, tag)
    save = dom.workdir / f"{tag}.save"
    virsh("save", dom.name, save, "--paused")
    dom.disconnect()
    restored = dom.workdir / f"{tag}.restored"
    _convert_and_restore(dom, save, tag, restored)
    return save, restored, truth, beat


def test_virsh_save_raw(domain):
    save, restored, truth, beat = _save_kind(domain, "save-raw")
    with open(save, "rb") as f:
        assert f.read(16) == b"LibvirtQemudSave"
    assert sha256_file(restored) == sha256_file(save), first_difference(restored, save)
    virsh("restore", restored)
    _check_resumed(domain, truth, beat, "save-raw")


def test_virsh_save_xz(domain, libvirtd):
    _set_config({"save_image_format": '"xz"'})
    try:
        libvirtd.restart_libvirtd()
        save, restored, truth, beat = _save_kind(domain, "save-xz")
    finally:
        _set_config({"save_image_format": '"raw"'})
        libvirtd.restart_libvirtd()
    with open(save, "rb") as f:
        head = f.read(92)
    assert int.from_bytes(head[28:32], "little") == 3  # xz
    with open(restored, "rb") as f:
        assert f.read(92) == head
    virsh("restore", restored)
    _check_resumed(domain, truth, beat, "save-xz")


def test_managedsave(domain):
    truth, beat = _truth(domain, "managed")
    virsh("managedsave", domain.name, "--paused")
    domain.disconnect()
    save = Path(f"/var/lib/libvirt/qemu/save/{domain.name}.save")
    assert save.is_file()
    kept = domain.workdir / "managed.orig"
    shutil.copyfile(save, kept)
    image = domain.workdir / "managed.lean"
    cli("convert", save, "-o", image)  # libvirt's defaults: the plain commands
    cli("convert", save, "-o", domain.workdir / "managed-disk.lean", "--disk", f"vda={domain.disk}")
    cli("validate", image)
    cli("restore", image, "--to", "libvirt", "-o", save, "-f")
    assert sha256_file(save) == sha256_file(kept), first_difference(save, kept)
    kept.unlink()
    virsh("start", domain.name)
    _check_resumed(domain, truth, beat, "managed")


def test_external_memory_snapshot(domain):
    truth, beat = _truth(domain, "snapshot")
    memory = domain.workdir / "snapshot.mem"
    virsh(
        "snapshot-create-as",
        domain.name,
        "s1",
        "--memspec",
        f"file={memory},snapshot=external",
        "--diskspec",
        "vda,snapshot=no",
    )
    virsh("destroy", domain.name)
    domain.disconnect()
    restored = domain.workdir / "snapshot.restored"
    _convert_and_restore(domain, memory, "snapshot", restored)
    assert sha256_file(restored) == sha256_file(memory), first_difference(restored, memory)
    virsh("restore", restored, "--paused")
    _check_resumed(domain, truth, beat, "snapshot")
    virsh("snapshot-delete", domain.name, "s1", "--metadata")
