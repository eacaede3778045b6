#!/bin/bash
# refit-sim-trainer --step-ms: the simulated training step between a release and the next
# version (the control-plane benchmark's refit cadence). Three versions with a 400 ms step take
# at least 0.8 s and all verify; a negative or malformed step is refused before anything is
# registered.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 16"
NOSOCK="$E2E_DIR/none.sock"

out=$("$BIN/refit-sim-trainer" --socket "$NOSOCK" $M --layout tp=1 --step-ms -5 2>&1)
rc=$?
[ "$rc" = 2 ] || fail "a negative --step-ms exited $rc, not 2: $out"
echo "$out" | grep -q -- "--step-ms must be 0 or more, up to 3600000, not -5" ||
    fail "no clear error: $out"
out=$("$BIN/refit-sim-trainer" --socket "$NOSOCK" $M --layout tp=1 --step-ms 1s 2>&1)
rc=$?
[ "$rc" = 2 ] || fail "--step-ms 1s exited $rc, not 2: $out"

start_publisher 0 1
start_receiver 0 1
start_engine eng 0 $M --layout tp=1 --versions 3
t0=$(date +%s.%N)
start_trainer tr 0 $M --layout tp=1 --versions 3 --step-ms 400
wait_ok tr eng
t1=$(date +%s.%N)
took=$(python3 -c "print(round($t1 - $t0, 3))")
python3 -c "import sys; sys.exit(0 if $took >= 0.8 else 1)" ||
    fail "3 versions with a 400 ms step took $took s, under 0.8 s"
n=$(grep -c "committed after.*, 0 wrong" "$E2E_DIR/eng.log")
[ "$n" = 3 ] || fail "engine verified $n versions, not 3"
st_committed 10 3 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: training step between versions; negative and malformed steps refused"
