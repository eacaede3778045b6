#!/bin/bash
# refit.torch (issue #13): a PyTorch trainer with Megatron names (qwen3-0.6b shrunk, tp=2, two
# ranks in one process; Transformer Engine's fused norm names under a DDP wrapper's "module.")
# and a PyTorch engine with vLLM names (tp=2), their weights in memfd-backed arenas, registered
# by register_module on the real daemons: two refits, every piece compared with torch.equal;
# then every refusal of refit.torch against the publisherd.
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/torch-lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
start_receiver 0 2
M="--model qwen3-0.6b --shrink 8 --versions 2 --ranks 2"
start_torch eng engine --socket "$E2E_DIR/recv0.sock" $M --conv vllm --layout tp=2
start_torch tr trainer --socket "$E2E_DIR/pub0.sock" $M --conv megatron --layout tp=2 \
    --te --prefix module.
wait_ok tr eng
grep -q "version 2 committed, .* 0 wrong" "$E2E_DIR/eng.log" ||
    fail "engine did not verify version 2"
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
cat "$E2E_DIR/tr.log" "$E2E_DIR/eng.log"
"$TORCH_PY" "$TORCH_REFIT" refusals --socket "$E2E_DIR/pub0.sock" > "$E2E_DIR/refusals.log" 2>&1 ||
    fail "refit.torch refusals: $(tail -n 3 "$E2E_DIR/refusals.log")"
grep -c "refused as expected" "$E2E_DIR/refusals.log"
echo "ok: megatron tp=2 -> vllm tp=2 through refit.torch, 2 versions verified; refusals refused"
