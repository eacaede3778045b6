#!/bin/bash
# A trainer process killed in the middle of a refit: its memory goes away, the refit aborts,
# the committed version does not advance; a new trainer takes its ranks and the refit of the
# same version then commits with every byte right.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 2"
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 $M --layout tp=4 --versions 3
start_trainer t0 0 $M --layout tp=2 --ranks 0 --versions 3 --retries 100
start_trainer t1 0 $M --layout tp=2 --ranks 1 --versions 3 --retries 100
wait_for "$E2E_DIR/pub0.log" "refit 1 committed" 60
wait_kill "$E2E_DIR/pub0.log" "starting the refit of version 2" "$t1_PID"
wait_for "$E2E_DIR/pub0.log" "aborting the refit of version 2" 30
grep -q "refit 2 committed" "$E2E_DIR/pub0.log" && fail "version 2 committed without its trainer"
start_trainer t1b 0 $M --layout tp=2 --ranks 1 --start 2 --versions 2 --retries 100
wait_ok t0 t1b eng
grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
echo "ok: trainer killed mid-refit: aborted, replaced, next refits verified"
