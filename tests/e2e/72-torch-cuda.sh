#!/bin/bash
# refit.torch on a GPU (skipped without one): the Megatron tp=2 trainer and vLLM tp=2 engine of
# 70-torch-refit.sh with their modules on cuda:0 (PyTorch's caching allocator), daemons with
# transport = nccl and local_copy = auto (one GPU: every byte a same-host copy). register_module
# registers each caching-allocator segment once, however many parameters it holds; two
# versions, every piece compared with torch.equal on the GPU.
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/torch-lib.sh"
if ! "$TORCH_PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)'; then
    echo "skip: no CUDA device for PyTorch"
    exit 0
fi
export NCCL_NVLS_ENABLE=0
E2E_LOCAL_COPY=auto
E2E_COMMON="$E2E_COMMON --transport nccl --verify full"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
start_receiver 0 2
M="--model qwen3-0.6b --shrink 8 --versions 2 --ranks 2 --device cuda:0"
start_torch eng engine --socket "$E2E_DIR/recv0.sock" $M --conv vllm --layout tp=2
start_torch tr trainer --socket "$E2E_DIR/pub0.sock" $M --conv megatron --layout tp=2
wait_ok tr eng
grep -q "version 2 committed, .* 0 wrong" "$E2E_DIR/eng.log" ||
    fail "engine did not verify version 2"
st_committed 20 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
cat "$E2E_DIR/tr.log" "$E2E_DIR/eng.log"
echo "ok: megatron tp=2 -> vllm tp=2 on cuda:0 through refit.torch, 2 versions verified"
