#!/bin/bash
# Two publishers and two receivers: qwen3-30b-a3b (shrunk: same 128 experts and heads)
# trainers tp=2,ep=4,dp=2 (4 ranks, DP replicas) -> engines tp=4,dp=4 (16 ranks), then
# KV heads below TP: trainers tp=4 -> engines tp=8 (4 KV heads). Every byte checked.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=2 E2E_RECEIVERS=2
M="--model qwen3-30b-a3b --shrink 64"
start_publisher 0 2
start_publisher 1 2
start_receiver 0 8
start_receiver 1 8
start_engine e0 0 $M --layout tp=4,dp=4 --ranks 0-7 --versions 3
start_engine e1 1 $M --layout tp=4,dp=4 --ranks 8-15 --versions 3
start_trainer t0 0 $M --layout tp=2,ep=4,dp=2 --ranks 0-1 --versions 3
start_trainer t1 1 $M --layout tp=2,ep=4,dp=2 --ranks 2-3 --versions 3
wait_ok t0 t1 e0 e1
for e in e0 e1; do
    grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/$e.log" || fail "$e did not verify version 3"
done
st_committed 10 3 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/pub1.sock" "$E2E_DIR/recv0.sock" \
    "$E2E_DIR/recv1.sock"
echo "ok: tp=2,ep=4,dp=2 -> tp=4,dp=4 over 2+2 daemons, 3 refits verified"
