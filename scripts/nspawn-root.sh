#!/bin/sh
# A minimal Debian bookworm root with systemd, for the booted-systemd package test.
# Built once into a cache folder outside the repo and reused (about 40 s, 300 MB).
# Usage: scripts/nspawn-root.sh [DIR]   (prints the root's path)
set -eu
# The folder is named for its package list: a list that changes makes a new root.
root=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/forged/bookworm-root-2}
if [ -f "$root/.complete" ]; then echo "$root"; exit 0; fi
rm -rf "$root"
mkdir -p "$(dirname "$root")"
# Everything forged's packages depend on is included, so dpkg -i works offline.
debootstrap --variant=minbase \
    --include=systemd,systemd-sysv,dbus,adduser,python3,python3.11,procps,curl,libgomp1,libssl3,openssl \
    bookworm "$root" http://deb.debian.org/debian >&2
# Boot quietly and fast: no getty on the console, no network configuration to wait for.
ln -sf /dev/null "$root/etc/systemd/system/console-getty.service"
ln -sf /dev/null "$root/etc/systemd/system/getty@.service"
echo forged-test > "$root/etc/hostname"
rm -rf "$root/var/cache/apt/archives/"*.deb
touch "$root/.complete"
echo "$root"
