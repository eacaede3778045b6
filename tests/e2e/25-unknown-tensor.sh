#!/bin/bash
# An engine that registers a tensor no trainer holds: the plan fails closed with the tensor and
# the uncovered box named (coordinator log, refitctl status on every daemon), nothing starts;
# once that engine is replaced by a correct one the plan builds and refits commit.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 16"
start_publisher 0 1
start_receiver 0 1
start_trainer tr 0 $M --layout tp=1 --versions 2 --retries 100
REFIT_LIB="$BIN/librefit.so" PYTHONPATH="$(dirname "$0")/../../client/python" python3 - "$E2E_DIR/recv0.sock" > "$E2E_DIR/bogus.log" 2>&1 <<'PY' &
import sys, time, refit
c = refit.Client(refit.ENGINE, "bogus", 0, sys.argv[1])
buf = c.alloc_host(64 * 32 * 2)
c.add_piece("model.layers.0.mlp.bogus_proj.weight", "bf16", [64, 32], buf.region, 0, [0, 0], [64, 32])
c.seal()
print("sealed", flush=True)
time.sleep(600)
PY
BOGUS=$!; E2E_PIDS="$E2E_PIDS $BOGUS"
WHY="no source holds model.layers.0.mlp.bogus_proj.weight [0:64, 0:32]"
st_wait "$E2E_DIR/pub0.sock" 30 "the plan failed, naming the tensor and box" \
    "cl['last_error'].startswith('plan failed: ') and '$WHY' in cl['last_error'] and
not cl['plan']['ready']"
# The coordinator sent its reason to every member.
st_wait "$E2E_DIR/recv0.sock" 10 "the receiver's status shows the plan failure" \
    "'$WHY' in s['last_error']"
ctl --socket "$E2E_DIR/recv0.sock" status > "$E2E_DIR/st.txt"
grep -q "bogus_proj" "$E2E_DIR/st.txt" || fail "refitctl status on the receiver does not show the plan failure"
st_wait "$E2E_DIR/pub0.sock" 0 "no refit without a plan" \
    "cl['state'] == 'idle' and cl['last_refit']['result'] == 'none' and cl['committed'] == 0"
kill "$BOGUS"
start_engine eng 0 $M --layout tp=1 --versions 2
wait_ok tr eng
grep -q "version 2 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 2"
st_committed 10 2 "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: unknown tensor fails the plan with its name and box; a correct engine then refits"
