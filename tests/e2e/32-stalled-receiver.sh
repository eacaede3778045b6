#!/bin/bash
# A receiverd that stops answering in the middle of a refit (SIGSTOP) while its connection
# stays open: the refit deadline aborts the version, the coordinator waits out the settle time
# for the silent member, and once the daemon runs again (SIGCONT) the retried version commits
# with every byte right.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
E2E_COMMON="$E2E_COMMON --refit-timeout-s 2 --peer-timeout-ms 60000"
M="--model qwen3-0.6b --shrink 2"
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 $M --layout tp=4 --versions 3
start_trainer tr 0 $M --layout tp=2 --versions 3 --retries 100
wait_for "$E2E_DIR/pub0.log" "refit 1 committed" 60
wait_for "$E2E_DIR/pub0.log" "starting the refit of version 2" 60
kill -STOP "$RECV0_PID"
# Resume the daemon whatever happens, so that cleanup can stop it.
trap 'kill -CONT $RECV0_PID 2>/dev/null; e2e_cleanup' EXIT
# The publisher's own data-path deadline (or the coordinator's) ends the refit.
wait_for "$E2E_DIR/pub0.log" "aborting the refit of version 2: .*deadline" 20
grep -q "refit 2 committed" "$E2E_DIR/pub0.log" && fail "version 2 committed while its receiver was stopped"
sleep 6
kill -CONT "$RECV0_PID"
wait_ok tr eng
grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
grep -q "refit 2 committed" "$E2E_DIR/pub0.log" || fail "version 2 was never retried"
echo "ok: a stalled receiver: deadline abort, settle, retry committed"
