#!/bin/bash
# One cluster configuration: daemons whose files disagree on a cluster-wide key.
# 1. verify: the coordinator says full, publisherd 1 sample, the receiverd off. The coordinator
#    decides: every daemon runs each refit with verify = full (sent with Start), the refits
#    commit with every byte checked, the receiverd logs and shows what it adopted, and the
#    coordinator's /status shows each member's differing keys.
# 2. transport: a receiverd with transport = nccl beside a tcp coordinator cannot switch: the
#    coordinator refuses it naming the key, both values and the fix, in its /status and in the
#    receiverd's log and /status; no plan is built.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=2 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 16"

e2e_new_cluster verify
start_publisher 0 1 --verify full
start_publisher 1 1 --verify sample
start_receiver 0 2 --verify off
start_engine eng 0 $M --layout tp=2 --versions 2
start_trainer t0 0 $M --layout tp=2 --ranks 0 --versions 2
start_trainer t1 1 $M --layout tp=2 --ranks 1 --versions 2
# The first refit either commits or aborts on the digests (what a cluster whose daemons verify
# differently did): whichever the coordinator logs first.
wait_for "$E2E_DIR/pub0.log" "refit 1 committed\|aborting the refit" 30
if grep -q "aborting the refit" "$E2E_DIR/pub0.log"; then
    fail "the refit aborted instead of running with the coordinator's verify: $(grep -m1 \
        'aborting the refit' "$E2E_DIR/pub0.log")"
fi
wait_ok t0 t1 eng
grep -q "version 2 committed.*0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 2"
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/pub1.sock" "$E2E_DIR/recv0.sock"
grep -q "WARN .*verify: this daemon's config .* says off, the coordinator's says full: refits run with verify = full" \
    "$E2E_DIR/recv0.log" || fail "the receiverd did not log that it adopted verify = full"
grep -q "WARN .*verify: this daemon's config .* says sample, the coordinator's says full" \
    "$E2E_DIR/pub1.log" || fail "publisherd 1 did not log that it adopted verify = full"
st_wait "$E2E_DIR/recv0.sock" 5 "the receiverd shows the verify it runs with and its own" \
    's["verify"] == "full" and s["adopted"]["verify"] == {"config": "off", "cluster": "full"}'
st_wait "$E2E_DIR/pub0.sock" 5 "the coordinator shows the cluster's verify and each member's own" \
    'cl["config"]["verify"] == "full" and m("receiver", 0)["refused"] is None and
     [(d["key"], d["member"], d["cluster"]) for d in m("receiver", 0)["config_differs"]]
       == [("verify", "off", "full")] and
     [d["key"] for d in m("publisher", 1)["config_differs"]] == ["verify"] and
     m("publisher", 0)["config_differs"] == []'

e2e_new_cluster transport
start_publisher 0 1
start_publisher 1 1
start_receiver 0 2 --transport nccl
st_wait "$E2E_DIR/pub0.sock" 15 "the coordinator refuses the nccl receiverd, naming the key" \
    'm("receiver", 0)["refused"] is not None and
     "is refused: it runs transport = nccl, the coordinator transport = tcp" in m("receiver", 0)["refused"]
     and "set transport = tcp in /etc/refit/receiverd.conf on " in m("receiver", 0)["refused"]
     and m("receiver", 0)["refused"].endswith("and restart it, or run every daemon with transport = nccl")
     and cl["last_error"] == m("receiver", 0)["refused"] and not cl["plan"]["ready"]'
wait_for "$E2E_DIR/recv0.log" "ERROR .*coordinator reports: receiver 0 (.*) is refused: it runs transport = nccl, the coordinator transport = tcp" 10
wait_for "$E2E_DIR/pub0.log" "WARN .*receiver 0 (.*) is refused: it runs transport = nccl" 5
st_wait "$E2E_DIR/recv0.sock" 5 "the receiverd shows the refusal" \
    '"is refused: it runs transport = nccl" in s["last_error"] and s["last_error"].endswith("transport = nccl")'
echo "ok: verify taken from the coordinator (3 daemons, 3 values, 2 refits verified); a transport mismatch refused by name"
