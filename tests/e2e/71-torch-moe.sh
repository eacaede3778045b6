#!/bin/bash
# refit.torch with a MoE model (qwen3-30b-a3b shrunk): two PyTorch trainers, one holding the HF
# checkpoint's tensors whole (convention hf) and one with Megatron-Core's Transformer Engine
# names and grouped-GEMM experts (ep=2: experts.linear_fc1.weight<i>, two ranks), replicas the
# planner chooses between; a PyTorch engine with vLLM names and fused experts
# (w13_weight/w2_weight, tp=2,ep=2): two refits, every piece compared with torch.equal.
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/torch-lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 3
start_receiver 0 2
M="--model qwen3-30b-a3b --shrink 16 --versions 2"
start_torch eng engine --socket "$E2E_DIR/recv0.sock" $M --ranks 2 --conv vllm --layout tp=2,ep=2
start_torch tr trainer --socket "$E2E_DIR/pub0.sock" $M --ranks 1 --conv hf
start_torch mtr trainer --socket "$E2E_DIR/pub0.sock" $M --ranks 2 --conv megatron --layout ep=2 \
    --te --client-rank 1
wait_ok tr mtr eng
grep -q "version 2 committed, .* 0 wrong" "$E2E_DIR/eng.log" ||
    fail "engine did not verify version 2"
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
cat "$E2E_DIR/tr.log" "$E2E_DIR/mtr.log" "$E2E_DIR/eng.log"
echo "ok: hf + megatron ep=2 -> vllm tp=2,ep=2 (qwen3-30b-a3b/16) through refit.torch, 2 versions"
