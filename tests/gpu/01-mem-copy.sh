#!/bin/sh
# tests/gpu/01-mem-copy.sh - the GPU memory path on a machine with GPUs: the copy-kernel and
# memory-import unit tests, then simulated trainers with weights on the GPUs (cudaMalloc, so
# CUDA IPC handles; then VMM allocations shared as fds) registering with a registry that
# imports their memory in another process and reads every byte back. Logs go to $OUT (or
# /tmp); exits non-zero on any failure, 0 with "skipped" lines without a CUDA device.
set -u
BUILD=${BUILD:-build}
LOGS=${OUT:-/tmp}/gpu-01
mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0
status=0

for t in test_copy_cuda test_mem_cuda; do
    echo "== $t"
    "$BUILD/tests/$t" --jobs=2 --verbose --short-filename > "$LOGS/$t.log" 2>&1 || status=1
    grep -E "SKIP|FAIL|CRASH|Synthesis" "$LOGS/$t.log"
done

dir=$(mktemp -d /tmp/refit-gpu.XXXXXX)
# cross_process NAME IMPORT-LOG-LINE trainer-args...: a registry importing CUDA memory in its
# own process and one trainer process playing two ranks (rank r on GPU r mod count).
cross_process() {
    name=$1
    want=$2
    shift 2
    echo "== cudacheck $name"
    "$BUILD/refit-sim-cudacheck" --socket "$dir/$name.sock" --clients 2 --versions 2 \
        > "$LOGS/$name-check.log" 2>&1 &
    check=$!
    timeout 120 "$BUILD/refit-sim-trainer" --socket "$dir/$name.sock" --model qwen3-0.6b \
        --shrink 4 --layout tp=2 --versions 2 --timeout-ms 60000 --device cuda "$@" \
        > "$LOGS/$name-trainer.log" 2>&1
    trc=$?
    # A trainer that failed leaves the registry waiting for it.
    [ $trc = 0 ] || kill $check 2>/dev/null
    wait $check
    crc=$?
    cat "$LOGS/$name-trainer.log" "$LOGS/$name-check.log"
    if [ $crc = 77 ]; then
        return
    fi
    if [ $trc != 0 ] || [ $crc != 0 ]; then
        echo "FAIL: $name: trainer exit $trc, cudacheck exit $crc"
        status=1
    elif ! grep -q "$want" "$LOGS/$name-check.log"; then
        echo "FAIL: $name: the registry's log shows no import ($want)"
        status=1
    fi
}

cross_process ipc "opened CUDA IPC allocation"
cross_process vmm "mapped CUDA VMM allocation" --cuda-vmm
rm -rf "$dir"
[ $status = 0 ] && echo "tests/gpu/01-mem-copy.sh: passed"
exit $status
