#!/bin/sh
# Installs the Debian packages refit builds and tests with, if any is missing.
# `deps.sh fuzz`: what `make fuzz` needs instead: clang and the libFuzzer runtime that matches
# its version (libclang_rt.fuzzer is in libclang-rt-N-dev, which clang only recommends).
set -e
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo

install_missing() {
    missing=""
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
    done
    [ -z "$missing" ] && return 0
    echo "deps: installing$missing"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
}

if [ "${1:-}" = fuzz ]; then
    install_missing clang
    major=$(clang -dumpversion | cut -d. -f1)
    install_missing "libclang-rt-$major-dev"
    rt=$(clang -print-resource-dir)/lib/linux/libclang_rt.fuzzer-x86_64.a
    [ "$(uname -m)" != x86_64 ] || [ -f "$rt" ] || {
        echo "deps: clang $major has no libFuzzer runtime ($rt is missing after installing" \
             "libclang-rt-$major-dev): install the package that holds it (dpkg -S" \
             "libclang_rt.fuzzer-x86_64.a on a machine that has it) or set FUZZ_CC" >&2
        exit 1
    }
    exit 0
fi

install_missing build-essential pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler \
    libcriterion-dev libinih-dev libjansson-dev libsodium-dev libmicrohttpd-dev python3 systemd \
    strace python3-torch
