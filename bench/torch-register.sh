#!/bin/bash
# bench/torch-register.sh - refit.torch registration of one qwen3-30b-a3b trainer rank
# (Megatron tp=4,ep=8) and one engine rank (vLLM tp=8) on a real publisherd and receiverd:
# layout, arena, register_module and seal times (best of REPEAT after a warm-up) and the region
# count. SHRINK=N divides the model's large dims (CI); full size by default, which costs no
# memory (the arena's pages are never written).
#   BUILD=build-x SHRINK=1 REPEAT=3 bench/torch-register.sh
. "$(dirname "$0")/../tests/e2e/lib.sh"
. "$(dirname "$0")/../tests/e2e/torch-lib.sh"
SHRINK=${SHRINK:-1} REPEAT=${REPEAT:-3}
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
# The ranks of the rest of the cluster never come: the daemons only register and seal.
start_publisher 0 8
start_receiver 0 8
wait_for "$E2E_DIR/pub0.log" "status endpoint" 10
wait_for "$E2E_DIR/recv0.log" "status endpoint" 10
B="$TORCH_PY $(dirname "$0")/bench_torch_register.py --model qwen3-30b-a3b --shrink $SHRINK --repeat $REPEAT"
echo "| model | rank | params | pieces | regions | GiB | layout s | arena s | register s | seal s | total s |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
$B --socket "$E2E_DIR/pub0.sock" --kind trainer --conv megatron --layout tp=4,ep=8 \
    --rank 0 ||
    fail "trainer rank registration failed"
$B --socket "$E2E_DIR/recv0.sock" --kind engine --conv vllm --layout tp=8 \
    --rank 0 ||
    fail "engine rank registration failed"
