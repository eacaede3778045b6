#!/bin/bash
# A receiverd that stops answering in the middle of a refit (SIGSTOP) while its connection
# stays open: the refit deadline aborts the version, the coordinator waits out the settle time
# for the silent member, and once the daemon runs again (SIGCONT) the retried version commits
# with every byte right. Every phase is proven by the coordinator's status: the receiverd is
# stopped before version 2 is even published (the trainer publishes it only when told), so the
# refit cannot finish before the stop lands.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
E2E_COMMON="$E2E_COMMON --refit-timeout-s 2 --peer-timeout-ms 60000"
M="--model qwen3-0.6b --shrink 2"
GO=$E2E_DIR/go
echo 1 > "$GO"
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 $M --layout tp=4 --versions 3
start_trainer tr 0 $M --layout tp=2 --versions 3 --retries 100 --publish-when "$GO"
CP=$E2E_DIR/pub0.sock
st_wait "$CP" 60 "version 1 committed, the receiver ready for the next" \
    'cl["committed"] == 1 and cl["state"] == "idle" and m("receiver", 0)["ready_to_install"]'

kill -STOP "$RECV0_PID"
# Resume the daemon whatever happens, so that cleanup can stop it.
trap 'kill -CONT $RECV0_PID 2>/dev/null; e2e_cleanup' EXIT
echo 2 > "$GO"
st_wait "$CP" 30 "refit 2 running while receiverd 0 is stopped" \
    'cl["state"] == "running" and cl["version_in_flight"] == 2 and not m("receiver", 0)["done"]'
# The publisher's own data-path deadline (or the coordinator's) ends the refit; the coordinator
# then waits for the stopped daemon's Done.
st_wait "$CP" 20 "refit 2 aborted at the deadline, settling while receiverd 0 is silent" \
    'cl["state"] == "aborting" and cl["committed"] == 1 and
cl["last_refit"]["version"] == 2 and cl["last_refit"]["result"] == "aborted" and
("deadline" in cl["last_error"] or "no Done within" in cl["last_error"]) and
not m("receiver", 0)["done"] and m("receiver", 0)["connected"]'
# Receiverd 0 is still stopped and connected (peer timeout 60 s): only the settle timer can end
# the wait for its Done.
st_wait "$CP" 15 "the settle ended without receiverd 0's Done" \
    'cl["state"] != "aborting" and cl["committed"] == 1 and m("receiver", 0)["connected"]'
kill -CONT "$RECV0_PID"
echo 3 > "$GO"
wait_ok tr eng
grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
grep -q "refit 2 committed" "$E2E_DIR/pub0.log" || fail "version 2 was never retried"
echo "ok: a stalled receiver: deadline abort, settle, retry committed"
