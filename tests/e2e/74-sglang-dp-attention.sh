#!/bin/bash
# SGLang's DP attention (`attn=dp`: attention sharded over tp/dp ranks per DP group, experts over
# ep, embedding whole): simulated Megatron-like trainers into simulated attn=dp engines, three
# refits with verify = full and every byte checked; then refit.torch with the "sglang"
# convention (HF-named trainer into an SGLang-named engine module), two versions verified.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-30b-a3b --shrink 32"
start_publisher 0 4 --verify full
start_receiver 0 8 --verify full
start_engine eng 0 $M --layout tp=8,dp=2,ep=4,attn=dp --versions 3
start_trainer tr 0 $M --layout tp=2,ep=4,dp=2 --versions 3
wait_ok tr eng
n=$(grep -c "committed after.*, 0 wrong" "$E2E_DIR/eng.log")
[ "$n" = 3 ] || fail "engines verified $n versions, not 3"
echo "ok: 3 refits into tp=8,dp=2,ep=4,attn=dp verified"

. "$(dirname "$0")/torch-lib.sh"
e2e_new_cluster torch
start_publisher 0 1
start_receiver 0 4
M="--model qwen3-30b-a3b --shrink 16 --versions 2"
start_torch teng engine --socket "$E2E_DIR/recv0.sock" $M --ranks 4 --conv sglang \
    --layout tp=4,dp=2,ep=2,attn=dp
start_torch ttr trainer --socket "$E2E_DIR/pub0.sock" $M --ranks 1 --conv hf
wait_ok ttr teng
grep -q "version 2 committed, .* 0 wrong" "$E2E_DIR/teng.log" || fail "torch engine did not verify version 2"
echo "ok: hf -> sglang tp=4,dp=2,ep=2,attn=dp through refit.torch, 2 versions verified"
