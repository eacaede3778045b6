#!/bin/bash
# tests/gpu/31-torch-colocated.sh - real PyTorch processes colocated on ONE GPU (issue #12):
# tests/gpu/torch_check.py's trainer and engine both on cuda:0, daemons with transport = nccl and
# local_copy = auto, so every byte is a same-host copy from the trainer's tensors into the
# engine's; torch.equal after every commit, twice: with the caching allocator's cudaMalloc blocks
# (CUDA IPC handles), and with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, whose segments
# are VMM allocations (2 MiB for small blocks, 20 MiB for large) mapped back to back, so a
# tensor may span several: librefit registers such a range as one region with one fd per
# allocation, and the daemons map them back to back ("mapped CUDA VMM range ... several
# allocations" in their logs, which the expandable case requires at least once).
. "$(dirname "$0")/../e2e/lib.sh"
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)' 2>/dev/null; then
    echo "skipped: no CUDA device (needs PyTorch and a GPU)"
    exit 0
fi
export NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD/client/python" REFIT_LIB="$BIN/librefit.so"
export REFIT_TRAINER_GPU=cuda:0 REFIT_ENGINE_GPU=cuda:0
E2E_LOCAL_COPY=auto
E2E_COMMON="$E2E_COMMON --transport nccl --verify full"

run_case() { # NAME [PYTORCH_CUDA_ALLOC_CONF]
    local name=$1 rp
    E2E_PUBLISHERS=1 E2E_RECEIVERS=1
    start_publisher 0 1
    start_receiver 0 2
    PYTORCH_CUDA_ALLOC_CONF=${2:-} python3 tests/gpu/torch_check.py engine "$E2E_DIR/recv0.sock" 3 \
        > "$E2E_DIR/$name-engine.log" 2>&1 &
    local eng=$!
    E2E_PIDS="$E2E_PIDS $eng"
    PYTORCH_CUDA_ALLOC_CONF=${2:-} python3 tests/gpu/torch_check.py trainer "$E2E_DIR/pub0.sock" 3 \
        > "$E2E_DIR/$name-trainer.log" 2>&1 || fail "$name: torch trainer failed"
    wait $eng || fail "$name: torch engine failed"
    cat "$E2E_DIR/$name-trainer.log" "$E2E_DIR/$name-engine.log"
    [ "$(grep -c 'torch.equal True' "$E2E_DIR/$name-engine.log")" = 6 ] || fail "$name: not every tensor equal"
    if [ "$name" = expandable ] && ! grep -q 'mapped CUDA VMM range .*several allocations' \
            "$E2E_DIR/pub0.log" "$E2E_DIR/recv0.log"; then
        fail "$name: no registered tensor spanned several VMM allocations (every one fit in one expandable-segment chunk), so the multi-allocation path was not exercised: make a tensor in tests/gpu/torch_check.py cross a 2 MiB boundary"
    fi
    st_port rp "$E2E_DIR/recv0.log" 10
    st_wait "$rp" 10 "$name: every byte on the local path" \
        's["last_refit"]["paths"]["network"]["bytes"] == 0 and s["last_refit"]["paths"]["local"]["bytes"] > 0'
    e2e_stop $PUB0_PID $RECV0_PID
    mv "$E2E_DIR/pub0.log" "$E2E_DIR/$name-pub0.log"
    mv "$E2E_DIR/recv0.log" "$E2E_DIR/$name-recv0.log"
    echo "ok: $name: PyTorch trainer and engine on one GPU, torch.equal on every version"
}

run_case caching
run_case expandable expandable_segments:True
