#!/bin/bash
# tests/gpu/20-torch.sh - real PyTorch tensors on both sides (tests/gpu/torch_check.py):
# caching-allocator sub-allocations registered through the Python binding, NCCL between the
# daemons, torch.equal on the engine after every commit.
. "$(dirname "$0")/../e2e/lib.sh"
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)' 2>/dev/null; then
    echo "skipped: no CUDA device (needs PyTorch and 2 GPUs)"
    exit 0
fi
export NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD/client/python" REFIT_LIB="$BIN/librefit.so"
E2E_COMMON="$E2E_COMMON --transport nccl --verify full"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 1
start_receiver 0 2
python3 tests/gpu/torch_check.py engine "$E2E_DIR/recv0.sock" 3 > "$E2E_DIR/torch-engine.log" 2>&1 &
ENG=$!; E2E_PIDS="$E2E_PIDS $ENG"
python3 tests/gpu/torch_check.py trainer "$E2E_DIR/pub0.sock" 3 > "$E2E_DIR/torch-trainer.log" 2>&1 \
    || fail "torch trainer failed"
wait $ENG || fail "torch engine failed"
cat "$E2E_DIR/torch-trainer.log" "$E2E_DIR/torch-engine.log"
[ "$(grep -c 'torch.equal True' "$E2E_DIR/torch-engine.log")" = 6 ] || fail "not every tensor equal"
echo "ok: PyTorch tensors refit over NCCL, torch.equal on every version"
