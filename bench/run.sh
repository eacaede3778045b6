#!/bin/sh
# Runs every benchmark: the binaries built under $BUILD/bench (bench_*) and the scripts
# bench/bench_*.sh (which start daemons and clients from $BUILD), printing their tables.
set -e
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.."
status=0
found=0
for b in "$BUILD"/bench/bench_* bench/bench_*.sh; do
    [ -x "$b" ] && [ ! -d "$b" ] || continue
    case "$b" in *.o|*.d) continue ;; esac
    found=1
    echo "== $b"
    BUILD="$BUILD" "$b" || status=1
    echo
done
if [ "$found" -eq 0 ]; then
    echo "bench/run.sh: no benchmarks under $BUILD/bench; run 'make BUILD=$BUILD all' first" >&2
    exit 1
fi
exit $status
