#!/bin/bash
# tests/gpu/31-torch-colocated.sh - real PyTorch processes colocated on ONE GPU (issue #12):
# tests/gpu/torch_check.py's trainer and engine both on cuda:0, daemons with transport = nccl and
# local_copy = auto, so every byte is a same-host copy from the trainer's tensors into the
# engine's; torch.equal after every commit, with the caching allocator's cudaMalloc blocks (CUDA
# IPC handles). PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is not covered yet: its tensors
# may span several 2 MiB VMM allocations, and a region is one allocation today (librefit says
# so at registration).
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
    st_port rp "$E2E_DIR/recv0.log" 10
    st_wait "$rp" 10 "$name: every byte on the local path" \
        's["last_refit"]["paths"]["network"]["bytes"] == 0 and s["last_refit"]["paths"]["local"]["bytes"] > 0'
    e2e_stop $PUB0_PID $RECV0_PID
    mv "$E2E_DIR/pub0.log" "$E2E_DIR/$name-pub0.log"
    mv "$E2E_DIR/recv0.log" "$E2E_DIR/$name-recv0.log"
    echo "ok: $name: PyTorch trainer and engine on one GPU, torch.equal on every version"
}

run_case caching
