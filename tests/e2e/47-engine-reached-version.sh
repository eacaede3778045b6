#!/bin/bash
# The simulated engine checks its memory against the version the daemon says it committed,
# not the one it waited for: the trainers publish versions 1 and 2 and then hold the weights
# of version 5 unpublished; the engine waits for 1, 2 and 3; an operator refits version 5.
# The engine, waiting for 3, is told 5 was committed and must find every byte of version 5
# (checking against 3 would count every element wrong).
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 8"
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 $M --layout tp=4 --versions 3
start_trainer tr 0 $M --layout tp=2 --versions 2 --hold 5
wait_for "$E2E_DIR/tr.log" "holding weights of version 5" 60
st_wait "$E2E_DIR/pub0.sock" 30 "version 2 committed and consumed by the engine" \
    'cl["committed"] == 2 and cl["state"] == "idle" and m("receiver", 0)["ready_to_install"]'
ctl --socket "$E2E_DIR/pub0.sock" refit --version 5 --wait --timeout 30 > "$E2E_DIR/refit.log" \
    2>&1 || fail "refitctl refit --version 5 failed: $(cat "$E2E_DIR/refit.log")"
wait_ok eng
LOG=$E2E_DIR/eng.log
grep -q "version 2 committed.*, 0 wrong" "$LOG" || fail "engine did not verify version 2"
grep -q "waited for version 3, the daemon committed version 5: checking that one" "$LOG" ||
    fail "the engine did not say it reached version 5: $(cat "$LOG")"
grep -q "version 5 committed after .*, 0 wrong elements" "$LOG" ||
    fail "engine did not verify version 5: $(cat "$LOG")"
grep -q "version 3 committed" "$LOG" && fail "the engine reported version 3, never committed"
st_committed 10 5 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: the engine verified version 5, the version the daemon committed, while waiting for 3"
