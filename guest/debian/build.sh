#!/bin/sh
# Build the Debian 12 (bookworm) benchmark guest of benchmarks/bench_distro.py (issue 34 §4):
# a root file system made by mmdebstrap from Debian's packages (systemd, PostgreSQL 15,
# gcc/make, Debian's kernel) on a raw ext4 disk, plus that kernel and its initrd to boot with
# QEMU's -kernel/-initrd (root=/dev/vda). The sources the workload compiles (lua 5.4 and zlib,
# Debian's source packages' upstream tarballs) are under /opt/src; the files under overlay/
# add the workload (leanimg-workload), the control channel on ttyS1 (leanimg-agent) and the
# guest free-list helper (guest/leanimg-guest-free.c, built static here) as systemd units.
#
#   sh guest/debian/build.sh            # prints the folder that holds disk.img, vmlinuz, initrd.img
#
# Run as root (mmdebstrap's root mode, mkfs.ext4 -d keeps owners). Needs mmdebstrap, gcc with
# the static libc, e2fsprogs and Debian's mirror. The result is cached in
# ${LEANIMG_DEBIAN_CACHE:-/var/tmp/leanimg-debian-guest}/KEY (KEY: a hash of this script, the
# overlay and the helper's source), about 1.2 GiB of allocated disk; a second run prints
# the folder at once.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
helper="$here/../leanimg-guest-free.c"
cache=${LEANIMG_DEBIAN_CACHE:-/var/tmp/leanimg-debian-guest}
disk_size=${LEANIMG_DEBIAN_DISK:-4G}
mirror=${LEANIMG_DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=systemd-sysv,udev,dbus,kmod,procps,linux-image-amd64,postgresql,gcc,make,libc6-dev,xz-utils,bzip2
sources="lua5.4 zlib"

key=$(cd "$here" && { cat build.sh "$helper"; find overlay -type f | sort | xargs cat; \
    echo "$disk_size $mirror $packages $sources"; } | sha256sum | cut -c1-16)
out="$cache/$key"
if [ -e "$out/done" ]; then
    echo "$out"
    exit 0
fi
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/build-XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# the root file system: apt's sources include deb-src so that the hook can fetch sources
mmdebstrap --variant=minbase --include="$packages" \
    --aptopt='APT::Install-Recommends "false"' --aptopt='Acquire::Languages "none"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='mkdir -p "$1/opt/src" && chroot "$1" sh -c "cd /opt/src && apt-get -q source --download-only '"$sources"' >/dev/null && rm -f *.dsc *.debian.tar.* *.diff.gz *.asc"' \
    --customize-hook='chroot "$1" apt-get clean' \
    bookworm "$tmp/root" \
    "deb $mirror bookworm main" "deb-src $mirror bookworm main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" >&2

root="$tmp/root"
cp -a "$here/overlay/." "$root/"
gcc -static -O2 -o "$root/usr/local/sbin/leanimg-guest-free" "$helper"
echo leanimg-debian >"$root/etc/hostname"
printf '/dev/vda / ext4 defaults,errors=remount-ro 0 1\n' >"$root/etc/fstab"
chroot "$root" systemctl enable leanimg-agent.service leanimg-guest-free.service >&2
# a benchmark guest must not start apt, man-db or fstrim runs of its own while it is measured
chroot "$root" systemctl mask apt-daily.timer apt-daily-upgrade.timer man-db.timer \
    e2scrub_all.timer fstrim.timer >&2 2>/dev/null || true
chroot "$root" passwd -d root >&2

cp "$root"/boot/vmlinuz-* "$tmp/vmlinuz"
cp "$root"/boot/initrd.img-* "$tmp/initrd.img"
ls "$root/boot" | sed -n 's/^vmlinuz-//p' >"$tmp/kernel-version"
mkfs.ext4 -q -F -b 4096 -L debian -d "$root" "$tmp/disk.img" "$disk_size"
rm -rf "$root"
date -u +%FT%TZ >"$tmp/done"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "$out"
