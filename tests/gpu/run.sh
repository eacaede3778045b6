#!/bin/sh
# Runs every GPU test and benchmark in one call on a GPU machine: the unit tests (their GPU
# cases skip elsewhere), bench_gpu, and every other tests/gpu/*.sh; logs under $OUT (or
# $BUILD/gpu-logs), a summary table at the end. Without a CUDA device it only says so.
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no CUDA device"
    exit 0
fi
LOGS=${OUT:-$BUILD/gpu-logs}
mkdir -p "$LOGS"
[ -d "$BUILD/lib" ] && export LD_LIBRARY_PATH="$PWD/$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
summary=$(mktemp)
status=0
run() { # name, command...
    name=$1
    shift
    t0=$(date +%s.%N)
    "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    t=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ $rc -eq 0 ]; then
        if grep -q "skipped: no CUDA device" "$LOGS/$name.log"; then res=skipped; else res=pass; fi
    else
        res="FAIL($rc)"
        status=1
    fi
    printf "%-32s %-10s %8s\n" "$name" "$res" "$t" >>"$summary"
    echo "== $name: $res"
}
nvidia-smi -L
for t in ${GPU_UNIT:-$BUILD/tests/test_*cuda* $BUILD/tests/test_*nccl*}; do
    [ -x "$t" ] || continue
    run "$(basename "$t")" "$t" --jobs=1 --short-filename
done
for s in tests/gpu/*.sh; do
    [ "$s" = tests/gpu/run.sh ] && continue
    [ -f "$s" ] || continue
    run "$(basename "$s" .sh)" env BUILD="$BUILD" bash "$s"
done
if [ -x "$BUILD/bench/bench_gpu" ]; then
    run bench_gpu "$BUILD/bench/bench_gpu" ${BENCH_GPU_ARGS:-}
    cat "$LOGS/bench_gpu.log"
fi
echo
printf "%-32s %-10s %8s\n" "what" "result" "seconds"
cat "$summary"
rm -f "$summary"
exit $status
