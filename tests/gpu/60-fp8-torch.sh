#!/bin/sh
# tests/gpu/60-fp8-torch.sh - FP8 exactness against PyTorch (issue 15): tests/gpu/fp8_dump
# quantizes qwen3-30b-a3b-shaped bf16 matrices (planted edge blocks: zeros, subnormals, beyond
# 448, NaN, +-Inf) on the GPU in every format and checks them against rf_quant_host;
# tests/gpu/fp8_torch.py recomputes them in torch on cuda and on cpu and fails on any byte or
# scale that differs. Needs a CUDA device and torch with float8_e4m3fn (>= 2.1).
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1 ||
    ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)' 2>/dev/null; then
    echo "skipped: no CUDA device (needs a GPU and PyTorch with CUDA)"
    exit 0
fi
if [ ! -x "$BUILD/tests/fp8_dump" ]; then
    echo "FAIL: $BUILD/tests/fp8_dump is missing: build with a CUDA toolkit (make BUILD=$BUILD all)"
    exit 1
fi
dir=$(mktemp -d /tmp/refit-fp8.XXXXXX)
trap 'rm -rf "$dir"' EXIT
echo "== fp8_dump (GPU quantizer against rf_quant_host)"
"$BUILD/tests/fp8_dump" "$dir" || { echo "FAIL: fp8_dump"; exit 1; }
echo "== fp8_torch ($(python3 -c 'import torch; print(torch.__version__)'))"
python3 tests/gpu/fp8_torch.py "$dir" || { echo "FAIL: fp8_torch: refit's FP8 bytes or scales differ from torch's"; exit 1; }
echo "ok: every FP8 byte and scale equal to torch's"
