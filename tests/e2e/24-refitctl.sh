#!/bin/bash
# The operator's side: `refitctl refit --version N --wait` triggers a refit from the weights the
# trainers hold (unpublished), `refitctl watch --until N` follows it, `refitctl wait` returns;
# refusals and exit codes: an old version or one far ahead (1), bad usage (2), no daemon (3).
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 4"
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 $M --layout tp=4 --versions 3
start_trainer tr 0 $M --layout tp=2 --versions 2 --hold 3
wait_for "$E2E_DIR/tr.log" "holding weights of version 3" 60
# The top of the version space is refused with the reason (it once stopped every later refit).
ctl --socket "$E2E_DIR/pub0.sock" refit --version 18446744073709551615 > "$E2E_DIR/max.log" 2>&1
[ $? = 1 ] || fail "refit of version 2^64-1 did not exit 1: $(cat "$E2E_DIR/max.log")"
grep -q "at most 4294967296 ahead" "$E2E_DIR/max.log" || fail "no reason for the refusal: $(cat "$E2E_DIR/max.log")"
ctl --socket "$E2E_DIR/recv0.sock" watch --until 3 --interval 0.05 > "$E2E_DIR/watch.log" 2>&1 &
WATCH=$!
ctl --socket "$E2E_DIR/recv0.sock" refit --version 3 --wait --timeout 30 > "$E2E_DIR/refit.log" 2>&1 \
    || fail "refitctl refit --version 3 --wait failed: $(cat "$E2E_DIR/refit.log")"
grep -q "version 3 committed" "$E2E_DIR/refit.log" || fail "refitctl refit did not report the commit"
wait $WATCH || fail "refitctl watch --until 3 failed"
grep -q "committed version 3" "$E2E_DIR/watch.log" || fail "watch never showed version 3: $(cat "$E2E_DIR/watch.log")"
wait_ok eng
grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify the triggered version 3"
ctl --socket "$E2E_DIR/pub0.sock" wait 3 --timeout 5 > /dev/null || fail "refitctl wait 3 failed"
ctl --socket "$E2E_DIR/pub0.sock" refit --version 2 > "$E2E_DIR/old.log" 2>&1
[ $? = 1 ] || fail "refit of an old version did not exit 1"
grep -q "must be newer than the committed version 3" "$E2E_DIR/old.log" || fail "no reason for the refusal: $(cat "$E2E_DIR/old.log")"
ctl --socket "$E2E_DIR/pub0.sock" refit > /dev/null 2>&1
[ $? = 2 ] || fail "refit without --version did not exit 2"
for bad in "wait 5x" "refit --version 5x" "status extra" "wait 3 --timeout abc" \
           "refit --version 4 --timeout -1" "watch --until 0"; do
    ctl --socket "$E2E_DIR/pub0.sock" $bad > "$E2E_DIR/bad.log" 2>&1
    [ $? = 2 ] || fail "refitctl $bad did not exit 2 (bad usage): $(cat "$E2E_DIR/bad.log")"
done
ctl --socket "$E2E_DIR/pub0.sock" wait 9 --timeout 0.3 > "$E2E_DIR/wait.log" 2>&1
[ $? = 1 ] || fail "a wait that times out did not exit 1"
grep -q "version 9 was not committed within 300 ms" "$E2E_DIR/wait.log" || fail "timeout message: $(cat "$E2E_DIR/wait.log")"
# The refusals and bad usage changed nothing on the daemons.
st_committed 0 3 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
ctl --socket "$E2E_DIR/nothing.sock" status > "$E2E_DIR/nod.log" 2>&1
[ $? = 3 ] || fail "status without a daemon did not exit 3"
grep -q "no daemon at" "$E2E_DIR/nod.log" || fail "no clear message without a daemon"
echo "ok: operator trigger, watch, wait and exit codes"
