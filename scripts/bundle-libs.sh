#!/bin/sh
# Copies the shared libraries our binaries need, other than glibc, the C++ runtime and the
# CUDA/NCCL libraries, into $BUILD/lib, so that a build made here runs on a machine that has
# none of our Debian packages (the GPU machines): run there with LD_LIBRARY_PATH=$BUILD/lib.
set -e
BUILD=${BUILD:-build}
mkdir -p "$BUILD/lib"
for f in "$BUILD"/refit-* "$BUILD"/refitctl "$BUILD"/librefit.so "$BUILD"/tests/* "$BUILD"/bench/*; do
    [ -f "$f" ] && [ -x "$f" ] || continue
    ldd "$f" 2>/dev/null | awk '/=> \// { print $3 }'
done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*|\
    libcuda.so*|libcudart*|libnccl*|libresolv*) ;;
    *) cp -L "$lib" "$BUILD/lib/" ;;
    esac
done
echo "bundled $(ls "$BUILD/lib" | wc -l) libraries into $BUILD/lib"
