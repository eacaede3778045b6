#!/bin/bash
# refit.torch on a GPU (skipped without one): the Megatron tp=2 trainer and vLLM tp=2 engine of
# 70-torch-refit.sh with their modules on cuda:0, daemons with transport = nccl and local_copy =
# auto (one GPU: every byte a same-host copy); two versions, every piece compared with
# torch.equal on the GPU. Case "caching": PyTorch's caching allocator, each segment (one
# cudaMalloc) registered once however many parameters it holds. Case "expandable":
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (PyTorch 2.1 and later), parameters in 2 MiB
# VMM allocations mapped back to back, a run of them registered as one region.
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
M="--model qwen3-0.6b --shrink 8 --versions 2 --ranks 2 --device cuda:0"

run_case() { # NAME [PYTORCH_CUDA_ALLOC_CONF]
    local name=$1
    export PYTORCH_CUDA_ALLOC_CONF=${2:-}
    start_publisher 0 2
    start_receiver 0 2
    start_torch eng engine --socket "$E2E_DIR/recv0.sock" $M --conv vllm --layout tp=2
    start_torch tr trainer --socket "$E2E_DIR/pub0.sock" $M --conv megatron --layout tp=2
    wait_ok tr eng
    grep -q "version 2 committed, .* 0 wrong" "$E2E_DIR/eng.log" ||
        fail "$name: engine did not verify version 2"
    st_committed 20 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    cat "$E2E_DIR/tr.log" "$E2E_DIR/eng.log"
    e2e_stop $PUB0_PID $RECV0_PID
    for f in pub0 recv0 tr eng; do mv "$E2E_DIR/$f.log" "$E2E_DIR/$name-$f.log"; done
    echo "ok: $name: megatron tp=2 -> vllm tp=2 on cuda:0 through refit.torch, 2 versions verified"
}

run_case caching
TORCH_VERSION=$("$TORCH_PY" -c 'import torch; print(torch.__version__)')
case "$TORCH_VERSION" in
    0.* | 1.* | 2.0.*) echo "skip: expandable: PyTorch $TORCH_VERSION has no expandable segments" ;;
    *) run_case expandable expandable_segments:True ;;
esac
