#!/bin/bash
# receiverd killed in the middle of a refit: the coordinator aborts it, the committed version
# does not advance, the engines are told; receiverd restarts, the engines register again and
# the next refit commits with every byte right.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 2"
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 $M --layout tp=4 --versions 3
start_trainer tr 0 $M --layout tp=2 --versions 3 --retries 50
P=$E2E_DIR/pub0.sock
st_wait "$P" 60 "version 1 committed" 'cl["committed"] == 1'
st_wait "$P" 60 "the refit of version 2 running" \
    'cl["state"] == "running" and cl["version_in_flight"] == 2'
kill -9 "$RECV0_PID"
st_wait "$P" 30 "the refit of version 2 aborted on the loss of receiverd 0" \
    'cl["last_refit"]["version"] == 2 and cl["last_refit"]["result"] == "aborted" and
cl["last_error"].startswith("version 2 aborted: ") and not m("receiver", 0)["connected"]'
st_wait "$P" 0 "the committed version stays 1 through the abort (2 lacks its receiver)" \
    'cl["committed"] == 1 and s["committed"] == 1'
start_receiver 0 4
wait_ok tr eng
grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
st_committed 10 3 "$P"
# The restarted receiverd committed version 3 with no error of its own.
st_committed 10 3 clean "$E2E_DIR/recv0.sock"
grep -q "aborted\|lost receiverd" "$E2E_DIR/eng.log" || fail "engine was not told about the abort"
echo "ok: receiverd killed mid-refit: aborted, restarted, next refits verified"
