#!/bin/bash
# tests/gpu/70-torch-bench.sh - the PyTorch-client benchmark (bench/bench_torch_refit.sh): a
# Megatron-style trainer process and a vLLM-style engine process on one GPU, refits through the
# daemons for qwen3-4b and qwen3-30b-a3b, both PyTorch allocators, verify off/sample/full,
# beside the same-GPU copy ceiling and the simulator; fails if the engine finds a wrong element
# or a byte did not go as a same-host copy. TORCH_BENCH_QUICK=1 runs its quick mode; the
# bench's other variables (LAYERS, VERIFY, ALLOCS, ...) pass through.
cd "$(dirname "$0")/../.." || exit 1
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)' 2>/dev/null; then
    echo "skipped: no CUDA device (needs PyTorch and a GPU)"
    exit 0
fi
[ "${TORCH_BENCH_QUICK:-0}" = 1 ] && export QUICK=1
exec bash bench/bench_torch_refit.sh
