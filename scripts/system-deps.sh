#!/bin/sh
# Debian packages the build and the tests need. Installs only what is missing.
set -eu
# haproxy: the multi-node test runs the shipped configuration in front of three nodes;
# chromium: the status page's test; prometheus: the shipped rules (promtool) and a real
# scrape of a running daemon.
needed="build-essential cmake git python3-venv python3-dev curl systemd procps haproxy chromium prometheus"
if [ "${1:-}" = deb ]; then
    # Building the .deb, booting it in a container, and running it on an emulated older
    # CPU (qemu-user).
    needed="$needed debhelper dh-virtualenv python3.11-venv python3.11-dev dpkg-dev fakeroot lintian debootstrap systemd-container qemu-user"
fi
missing=""
for p in $needed; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages:$missing (run: sudo apt-get install$missing)" >&2
    exit 1
fi
echo "installing Debian packages:$missing"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
