#!/bin/bash
# Same-host refits over host memory (issue #12): daemons on one host with local_copy = auto copy
# straight from the trainers' memfds into the engines' (no TCP). Part 1: one publisher and one
# receiver, qwen3-0.6b (shrunk) tp=2 -> tp=4, three refits, every installed byte checked by the
# engines, every byte on the local path (status and /metrics). Part 2, mixed: receiverd 1 says
# it is on another host (host_id), so its engines get their bytes over TCP while receiverd 0's
# are local copies, in the same refits. Part 3, replicas: trainers tp=2,dp=2 with one DP
# replica on each of two hosts, an engine replica on each: each receiverd copies everything from
# the replica on its own host and nothing crosses the network. Part 4, set up ahead: the local
# copies' plan is derived when the slice arrives, before any Start; a Start that arrives while
# that is still under way (held there by a test hook) waits for it and then commits.
. "$(dirname "$0")/lib.sh"
E2E_LOCAL_COPY=auto

E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 3
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 3
wait_ok tr eng
grep -q "version 3 committed.*0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
st_committed 10 3 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
st_port RP "$E2E_DIR/recv0.log" 10
st_wait "$RP" 10 "every byte of the last refit on the local path" \
    's["last_refit"]["paths"]["local"]["bytes"] == s["last_refit"]["bytes"] > 0 and
s["last_refit"]["paths"]["network"]["bytes"] == 0'
curl -s "http://127.0.0.1:$RP/metrics" > "$E2E_DIR/metrics.txt"
grep -Eq '^refit_path_bytes_total\{path="local"\} [1-9]' "$E2E_DIR/metrics.txt" ||
    fail "no local bytes in /metrics: $(grep path_bytes "$E2E_DIR/metrics.txt")"
grep -q '^refit_path_bytes_total{path="network"} 0$' "$E2E_DIR/metrics.txt" ||
    fail "network bytes in /metrics: $(grep path_bytes "$E2E_DIR/metrics.txt")"
grep -q "mapped [0-9]* of the [0-9]* trainer regions" "$E2E_DIR/recv0.log" ||
    fail "the receiverd did not map the trainers' memory"
[ "$(grep -c "mapped .* trainer regions" "$E2E_DIR/recv0.log")" = 1 ] ||
    fail "the trainers' memory was fetched more than once for one plan"
# Least privilege: the trainers are tp=2, so each replicated tensor (norms) is read from one
# rank only, and the regions of the other rank's copies are never handed out.
read -r GOT ALL < <(sed -n 's/.*exported \([0-9]*\) of \([0-9]*\) regions.*/\1 \2/p' \
    "$E2E_DIR/pub0.log" | head -1)
[ -n "$GOT" ] && [ "$GOT" -gt 0 ] && [ "$GOT" -lt "$ALL" ] ||
    fail "the publisherd exported ${GOT:-?} of ${ALL:-?} regions: not only those the plan reads"
grep -q "mapped $GOT of the $ALL trainer regions" "$E2E_DIR/recv0.log" ||
    fail "the receiverd mapped other regions than the $GOT it was given"
# The copy plan was set up when the slice arrived, before the first refit moved a byte.
awk '/local copies data path set up ahead of Start/ { up = 1 }
     /version 1: moved/ { exit !up }' "$E2E_DIR/recv0.log" ||
    fail "the receiverd did not set its local copies up ahead of the first Start"
echo "ok: 3 refits as same-host copies, every byte verified"

# ---- part 2: one refit over both paths --------------------------------------------------------
e2e_new_cluster mixed
E2E_PUBLISHERS=1 E2E_RECEIVERS=2
start_publisher 0 2
start_receiver 0 4
start_receiver 1 4 --host-id elsewhere
start_engine eng0 0 --model qwen3-0.6b --shrink 8 --layout tp=4,dp=2 --ranks 0-3 --versions 2
start_engine eng1 1 --model qwen3-0.6b --shrink 8 --layout tp=4,dp=2 --ranks 4-7 --versions 2
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 2
wait_ok tr eng0 eng1
for e in eng0 eng1; do
    grep -q "version 2 committed.*0 wrong" "$E2E_DIR/$e.log" || fail "$e did not verify version 2"
done
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock" "$E2E_DIR/recv1.sock"
st_port R0 "$E2E_DIR/recv0.log" 10
st_port R1 "$E2E_DIR/recv1.log" 10
st_wait "$R0" 10 "receiverd 0 (the trainers' host): local copies only" \
    's["last_refit"]["paths"]["local"]["bytes"] > 0 and s["last_refit"]["paths"]["network"]["bytes"] == 0'
st_wait "$R1" 10 "receiverd 1 (another host): the network only" \
    's["last_refit"]["paths"]["network"]["bytes"] > 0 and s["last_refit"]["paths"]["local"]["bytes"] == 0'
echo "ok: a mixed refit: local copies on the trainers' host, TCP to the other, every byte verified"

# ---- part 3: the same-host replica is chosen ---------------------------------------------------
e2e_new_cluster replicas
E2E_PUBLISHERS=2 E2E_RECEIVERS=2
M="--model qwen3-0.6b --shrink 8"
start_publisher 0 2
start_publisher 1 2 --host-id elsewhere
start_receiver 0 4
start_receiver 1 4 --host-id elsewhere
start_engine eng0 0 $M --layout tp=4,dp=2 --ranks 0-3 --versions 2
start_engine eng1 1 $M --layout tp=4,dp=2 --ranks 4-7 --versions 2
start_trainer tr0 0 $M --layout tp=2,dp=2 --ranks 0-1 --versions 2
start_trainer tr1 1 $M --layout tp=2,dp=2 --ranks 2-3 --versions 2
wait_ok tr0 tr1 eng0 eng1
for e in eng0 eng1; do
    grep -q "version 2 committed.*0 wrong" "$E2E_DIR/$e.log" || fail "$e did not verify version 2"
done
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/pub1.sock" "$E2E_DIR/recv0.sock" \
    "$E2E_DIR/recv1.sock"
for r in 0 1; do
    st_port RP "$E2E_DIR/recv$r.log" 10
    st_wait "$RP" 10 "receiverd $r: every byte from the replica on its own host" \
        's["last_refit"]["paths"]["network"]["bytes"] == 0 and s["last_refit"]["paths"]["local"]["bytes"] > 0'
done
echo "ok: two hosts, a trainer replica on each: every byte a same-host copy"

# ---- part 4: a Start that arrives while the data path is being set up ---------------------------
e2e_new_cluster held
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
REFIT_TEST_PREPARE_GATE="$E2E_DIR/gate" start_receiver 0 4
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 2
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 2
wait_for "$E2E_DIR/recv0.log" "Start(1) held until the data path is set up" 60
st_port RP "$E2E_DIR/recv0.log" 10
st_wait "$RP" 10 "the setup holds Start" 's["preparing"] == True'
grep -q "version 1 committed" "$E2E_DIR/eng.log" && fail "version 1 committed while Start was held"
touch "$E2E_DIR/gate"
wait_ok tr eng
grep -q "version 2 committed.*0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 2"
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
st_wait "$RP" 10 "nothing left being set up" 's["preparing"] == False'
echo "ok: a Start held while the copies were set up ran once they were, every byte verified"
