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
P=$E2E_DIR/pub0.sock
st_wait "$P" 60 "version 1 committed" 'cl["committed"] == 1'
st_wait "$P" 60 "the refit of version 2 running" \
    'cl["state"] == "running" and cl["version_in_flight"] == 2'
kill -9 "$t1_PID"
st_wait "$P" 30 "the refit of version 2 aborted" \
    'cl["last_refit"]["version"] == 2 and cl["last_refit"]["result"] == "aborted" and
cl["last_error"].startswith("version 2 aborted: ")'
st_wait "$P" 0 "the committed version stays 1 through the abort (2 lacks its trainer)" \
    'cl["committed"] == 1 and s["committed"] == 1'
# The receiverd ended its side of version 2 without a commit, version 1 still committed: its
# status says "aborted" with the abort's reason, also when its data path, cut by the abort,
# ended after the Abort came.
st_wait "$E2E_DIR/recv0.sock" 10 "receiverd 0 ended version 2 aborted, with the reason" \
    's["committed"] == 1 and s["refit_in_flight"] is None and
s["last_refit"]["version"] == 2 and s["last_refit"]["result"] == "aborted" and
s["last_error"].startswith("refit of version 2 aborted: ")'
start_trainer t1b 0 $M --layout tp=2 --ranks 1 --start 2 --versions 2 --retries 100
wait_ok t0 t1b eng
grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
st_committed 10 3 "$P" "$E2E_DIR/recv0.sock"
echo "ok: trainer killed mid-refit: aborted, replaced, next refits verified"
