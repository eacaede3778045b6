#!/bin/bash
# 20 consecutive refits with verification: qwen3-0.6b (shrunk) trainers tp=2,dp=2 (two
# replicas: each byte read once) -> engines tp=4,dp=2, checked every time; then refitctl
# status reports committed version 20.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 16"
start_publisher 0 4 --verify full
start_receiver 0 8 --verify full
start_engine eng 0 $M --layout tp=4,dp=2 --versions 20
start_trainer tr 0 $M --layout tp=2,dp=2 --versions 20
wait_ok tr eng
n=$(grep -c "committed after.*, 0 wrong" "$E2E_DIR/eng.log")
[ "$n" = 20 ] || fail "engines verified $n versions, not 20"
st_committed 10 20 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: 20 refits verified"
