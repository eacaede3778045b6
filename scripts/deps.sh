#!/bin/sh
# Installs the Debian packages refit builds and tests with, if any is missing.
set -e
PKGS="build-essential pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler libcriterion-dev
libinih-dev libjansson-dev libsodium-dev libmicrohttpd-dev python3 systemd"
missing=""
for p in $PKGS; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "deps: installing$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
