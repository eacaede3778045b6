#!/bin/bash
# KV heads below TP on both sides and uneven pipeline stages: qwen3-30b-a3b (4 KV heads,
# shrunk) trainers tp=8,pp=3 (48 layers over 3 stages) -> engines tp=8,ep=2 (KV heads
# replicated on the engine side). Every byte checked.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-30b-a3b --shrink 64"
start_publisher 0 24
start_receiver 0 8
start_engine eng 0 $M --layout tp=8,ep=2 --versions 2
start_trainer tr 0 $M --layout tp=8,pp=3 --versions 2
wait_ok tr eng
grep -q "version 2 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 2"
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: KV heads below TP, uneven PP, engine EP: 2 refits verified"
