#!/bin/bash
# tests/gpu/30-colocated.sh - colocated refits on ONE GPU (issue #12): trainers' weights and
# engines' buffers both on GPU 0, daemons with transport = nccl and local_copy = auto. NCCL
# cannot put two ranks on one GPU ("Duplicate GPU detected"); the receiverd copies straight from
# trainer memory (CUDA IPC / VMM fds fetched from the publisherd) into engine memory. Every
# installed byte verified after every commit:
#   qwen3-4b tp=2 -> tp=4 (cudaMalloc), qwen3-30b-a3b tp=2,ep=2 -> tp=4 (full size, cudaMalloc
#   and VMM), qwen3-4b with VMM allocations on both sides, and with 2 MiB VMM allocations mapped
#   back to back (tensors spanning several, as with expandable segments); then a trainer killed
#   mid-copy (verify = full, so a copy lasts seconds): aborted, the next refit commits.
. "$(dirname "$0")/../e2e/lib.sh"
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no CUDA device"
    exit 0
fi
export NCCL_NVLS_ENABLE=0
E2E_LOCAL_COPY=auto
E2E_COMMON="$E2E_COMMON --transport nccl --verify sample --refit-timeout-s 120"

# run_case NAME MODEL SRC DST VERSIONS TRAINERS ENGINES [sim flags]
run_case() {
    local name=$1 model=$2 src=$3 dst=$4 n=$5 ntr=$6 nen=$7
    shift 7
    local t0=$(date +%s.%N) rp
    E2E_PUBLISHERS=1 E2E_RECEIVERS=1
    start_publisher 0 "$ntr"
    start_receiver 0 "$nen"
    start_engine "${name}_eng" 0 --model "$model" --layout "$dst" --versions "$n" --device cuda:0 \
        --timeout-ms 300000 ${ENG_FLAGS:-} "$@"
    start_trainer "${name}_tr" 0 --model "$model" --layout "$src" --versions "$n" --device cuda:0 \
        --timeout-ms 300000 --report "$@"
    wait_ok "${name}_tr" "${name}_eng"
    local ok=$(grep -c "committed after.*, 0 wrong" "$E2E_DIR/${name}_eng.log")
    [ "$ok" = "$n" ] || fail "$name: $ok of $n versions verified"
    st_port rp "$E2E_DIR/recv0.log" 10
    st_wait "$rp" 10 "$name: every byte on the local path" \
        's["last_refit"]["paths"]["network"]["bytes"] == 0 and
s["last_refit"]["paths"]["local"]["bytes"] == s["last_refit"]["bytes"] > 0'
    grep "^refit" "$E2E_DIR/${name}_tr.log" | tail -n 3
    grep "moved" "$E2E_DIR/recv0.log" | tail -n 2
    echo "ok: $name: $n colocated refits on one GPU, every byte verified ($(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s)"
    e2e_stop $PUB0_PID $RECV0_PID
    mv "$E2E_DIR/pub0.log" "$E2E_DIR/${name}_pub0.log"
    mv "$E2E_DIR/recv0.log" "$E2E_DIR/${name}_recv0.log"
}

want() { case " ${GPU_CASES:-q4b q30b q30vmm vmm vmmchunk inproc kill} " in *" $1 "*) return 0 ;; esac; return 1; }
want q4b && run_case q4b qwen3-4b tp=2 tp=4 5 2 4
want q30b && run_case q30b qwen3-30b-a3b tp=2,ep=2 tp=4 3 2 4
# The same on VMM allocations (cuMemCreate with POSIX fds, as PyTorch's expandable segments):
# thousands of regions per allocation, each allocation mapped once per client; the daemons'
# copies then run at in-process speed (CUDA IPC mappings of cudaMalloc memory run the copy
# kernel at about a third of it: bench/RESULTS.md).
want q30vmm && run_case q30vmm qwen3-30b-a3b tp=2,ep=2 tp=4 3 2 4 --cuda-vmm
want vmm && run_case vmm qwen3-4b tp=2 tp=4 3 2 4 --cuda-vmm
# Engines whose memory cannot be exported (VMM allocations without a handle type, as sleep-mode
# allocators make them): librefit installs in the engine's process (issue #12 item 4).
if want inproc; then
    ENG_FLAGS=--inproc run_case inproc qwen3-4b tp=2 tp=4 3 2 4
    grep -q "in-process installs: 4 engines" "$E2E_DIR/inproc_recv0.log" ||
        fail "inproc: the receiverd did not hand the copies to the engines' installers"
    ENG_FLAGS=--inproc run_case inproc30 qwen3-30b-a3b tp=2,ep=2 tp=4 3 2 4
fi
# Tensors spanning VMM allocations mapped back to back (as PyTorch's expandable segments map).
want vmmchunk && run_case vmmchunk qwen3-4b tp=2 tp=4 3 2 4 --cuda-vmm-chunk 2097152
want kill || exit 0

# A trainer killed during the copy of version 3: the receiverd holds a job in flight while the
# hold file exists (REFIT_TEST_JOB_HOLD), so the kill lands while version 3's data path runs;
# its log proves it (the copy of version 3 failed rather than moved).
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
REFIT_TEST_JOB_HOLD="$E2E_DIR/hold" start_receiver 0 4
start_engine keng 0 --model qwen3-4b --layout tp=4 --versions 4 --device cuda:0 --timeout-ms 300000
wait_for "$E2E_DIR/recv0.log" "status endpoint" 30
echo 2 > "$E2E_DIR/go"
start_trainer ktr 0 --model qwen3-4b --layout tp=2 --versions 3 --device cuda:0 --timeout-ms 300000 \
    --publish-when "$E2E_DIR/go"
wait_for "$E2E_DIR/keng.log" "version 2 committed" 120
touch "$E2E_DIR/hold"
echo 3 > "$E2E_DIR/go"
wait_kill "$E2E_DIR/recv0.log" "version 3 held in flight" "$ktr_PID"
wait_for "$E2E_DIR/recv0.log" "version 3 failed\|version 3: moved" 120
grep -q "version 3 failed" "$E2E_DIR/recv0.log" ||
    fail "the trainer was killed after the copy of version 3 ended: the mid-copy case did not happen"
rm "$E2E_DIR/hold"
grep "version 3 failed" "$E2E_DIR/recv0.log"
wait_for "$E2E_DIR/pub0.log" "aborting the refit of version 3" 60
start_trainer ktr2 0 --model qwen3-4b --layout tp=2 --start 4 --versions 1 --device cuda:0 \
    --timeout-ms 300000
wait_ok ktr2 keng
grep -q "refit 3 committed" "$E2E_DIR/pub0.log" && fail "version 3 committed without its trainer"
grep -q "version 4 committed.*, 0 wrong" "$E2E_DIR/keng.log" || fail "engine did not verify version 4"
echo "ok: trainer killed mid-copy on one GPU: version 3 aborted, version 4 committed and verified"
