#!/bin/bash
# tests/e2e/82-relay-launder.sh - a relay that forwards wrong bytes never commits: one trainer
# (tp=1) feeds three engine replicas (tp=1,dp=3, a receiverd each) with relay = on and
# verify = full, and every receiverd runs the tcp transport's test hook
# REFIT_TEST_CORRUPT_RELAY=1, which flips the first byte of each packed message it forwards
# before digesting it. Each hop's digests then agree (the relay digests what it sent), so only
# the end-to-end check (every replica fed by a relay checks the trainer's own bytes) can stop
# the refit: version 1 must abort with the digests differing, nothing may commit, and no
# engine may see a version. Then the same with MXFP8 replicas (FP8 payloads relayed as they
# are). A clean cluster of the same shape commits (tests/e2e/81, 67).
. "$(dirname "$0")/lib.sh"
NR=3
M="--model qwen3-0.6b --shrink 8"
FLAGS="--relay on --verify full"

# launder NAME [engine flags]: the cluster with the hook on every receiverd; version 1 must
# abort on the digests and nothing commit.
launder() {
    local name=$1 r out
    shift
    e2e_new_cluster "$name"
    E2E_PUBLISHERS=1 E2E_RECEIVERS=$NR
    start_publisher 0 1 $FLAGS
    export REFIT_TEST_CORRUPT_RELAY=1
    for r in $(seq 0 $((NR - 1))); do start_receiver $r 1 $FLAGS; done
    unset REFIT_TEST_CORRUPT_RELAY
    for r in $(seq 0 $((NR - 1))); do
        start_engine e$r $r $M --layout tp=1,dp=$NR --ranks $r --versions 1 "$@"
    done
    start_trainer tr 0 $M --layout tp=1 --versions 1 --retries 0
    st_wait "$E2E_DIR/pub0.sock" 60 "$name: version 1 decided" \
        "cl['last_refit'].get('version') == 1 and cl['last_refit'].get('result') != 'none'"
    st_wait "$E2E_DIR/pub0.sock" 0 "$name: version 1 aborted on the digests, not committed" \
        "cl['last_refit']['result'] == 'aborted' and cl['committed'] == 0 and
'verification failed: the digests of the bytes sent and the bytes received differ' in
cl['last_error'] and cl['plan'].get('relay_messages', 0) > 0"
    for r in $(seq 0 $((NR - 1))); do
        grep -q "REFIT_TEST_CORRUPT_RELAY is set" "$E2E_DIR/recv$r.log" ||
            fail "$name: receiverd $r did not run the test hook"
        st_wait "$E2E_DIR/recv$r.sock" 0 "$name: receiverd $r committed nothing" \
            's["committed"] == 0'
    done
    wait "$tr_PID" && fail "$name: the trainer's version 1 was released"
    grep -q "version 1 not released.*digests of the bytes sent and the bytes received differ" \
        "$E2E_DIR/tr.log" || fail "$name: the trainer was not told why: $(tail -n 2 "$E2E_DIR/tr.log")"
    for r in $(seq 0 $((NR - 1))); do
        grep -q "version 1 committed" "$E2E_DIR/e$r.log" && fail "$name: engine e$r saw version 1"
    done
    out=$(grep -o "relays [0-9]* bytes in [0-9]* messages" "$E2E_DIR/pub0.log" | tail -n 1)
    echo "ok: $name: relays corrupting what they forward ($out): version 1 aborted on the digests, nothing committed"
}

launder bf16
launder mxfp8 --fp8 mxfp8
echo "ok: a relay that forwards wrong bytes never commits, bf16 and MXFP8"
