#!/bin/bash
# Before a receiver connects, the coordinator's status says it waits for it. An engine that
# holds a tensor in another dtype than the trainer: the plan fails, and every
# wait (the trainer's, the engine's, refitctl wait and refit --wait) ends within seconds with
# that reason, which refitctl status shows on every daemon. An engine that registers a tensor
# no trainer holds: the plan fails closed with the tensor and the uncovered box named
# (coordinator log, refitctl status on every daemon), nothing starts; once that engine is
# replaced by a correct one the plan builds, the trainer's wait succeeds and refits commit.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 16"
start_publisher 0 1
start_trainer tr 0 $M --layout tp=1 --versions 2 --retries 100
# Before the receiver starts, the status says what the cluster waits for.
st_wait "$E2E_DIR/pub0.sock" 10 "the coordinator says it waits for the receiver" \
    "cl['waiting_for'] is not None and cl['waiting_for'].startswith('inventories: ') and
cl['waiting_for'].endswith('receiver 0 never connected') and s['waiting_for'] is not None"
ctl --socket "$E2E_DIR/pub0.sock" status > "$E2E_DIR/st.txt"
grep -q "^cluster       idle, committed version 0; waiting for inventories: .*receiver 0 never connected$" "$E2E_DIR/st.txt" ||
    fail "refitctl status does not say what the cluster waits for: $(cat "$E2E_DIR/st.txt")"
start_receiver 0 1
# The trainer holds down_proj [64, 192] in bf16; this engine registers it in fp16, then waits.
REFIT_LIB="$BIN/librefit.so" PYTHONPATH="$(dirname "$0")/../../client/python" python3 - "$E2E_DIR/recv0.sock" > "$E2E_DIR/fp16.log" 2>&1 <<'PY' &
import errno, sys, time, refit
c = refit.Client(refit.ENGINE, "fp16", 0, sys.argv[1])
buf = c.alloc_host(64 * 192 * 2)
c.add_piece("model.layers.0.mlp.down_proj.weight", "fp16", [64, 192], buf.region, 0, [0, 0], [64, 192])
c.seal()
t0 = time.monotonic()
try:
    c.wait_version(1, timeout_ms=60000)
    print("wait_version returned", flush=True)
except refit.Error as e:
    print("wait_version failed after %.1f s, code %s: %s" % (time.monotonic() - t0,
          "EAGAIN" if e.code == -errno.EAGAIN else e.code, e.message), flush=True)
time.sleep(600)
PY
FP16=$!; E2E_PIDS="$E2E_PIDS $FP16"
WHY16="the coordinator cannot plan: inventory of daemon 1: tensor model.layers.0.mlp.down_proj.weight registered as bf16 [64, 192] and again as fp16 [64, 192]: both sides must agree on dtype and global shape"
wait_for "$E2E_DIR/fp16.log" "wait_version failed" 30
grep -qF "code EAGAIN: version 1 cannot be refitted now: $WHY16" "$E2E_DIR/fp16.log" ||
    fail "the engine's wait did not end with the reason: $(cat "$E2E_DIR/fp16.log")"
python3 - "$E2E_DIR/fp16.log" <<'PY' || fail "the engine's wait did not end within seconds: $(cat "$E2E_DIR/fp16.log")"
import re, sys
s = float(re.search(r"failed after ([0-9.]+) s", open(sys.argv[1]).read()).group(1))
sys.exit(0 if s < 10 else 1)
PY
wait_for "$E2E_DIR/tr.log" "version 1 not released (attempt [0-9]*): version 1 cannot be refitted now: the coordinator cannot plan: .*tensor model.layers.0.mlp.down_proj.weight registered as bf16" 10
st_wait "$E2E_DIR/recv0.sock" 10 "the receiver's status says why nothing can be refitted" \
    "s['blocked'] == '$WHY16'"
st_wait "$E2E_DIR/pub0.sock" 10 "the coordinator's status says why nothing can be refitted" \
    "s['blocked'] == '$WHY16' and cl['blocked'] == '$WHY16'"
ctl --socket "$E2E_DIR/pub0.sock" status > "$E2E_DIR/st.txt"
grep -qF "blocked       $WHY16" "$E2E_DIR/st.txt" || fail "refitctl status does not say blocked: $(cat "$E2E_DIR/st.txt")"
# refitctl's waits end at once with the same reason (exit 1), not at their timeout.
T0=$(now_ms)
ctl --socket "$E2E_DIR/recv0.sock" wait 1 --timeout 60 > "$E2E_DIR/ctl.out" 2>&1 && fail "refitctl wait succeeded"
grep -qF "refitctl: version 1 cannot be refitted now: $WHY16" "$E2E_DIR/ctl.out" || fail "refitctl wait: $(cat "$E2E_DIR/ctl.out")"
ctl --socket "$E2E_DIR/pub0.sock" refit --version 1 --wait --timeout 60 > "$E2E_DIR/ctl.out" 2>&1 && fail "refitctl refit --wait succeeded"
grep -qF "refitctl: version 1 cannot be refitted now: $WHY16" "$E2E_DIR/ctl.out" || fail "refitctl refit --wait: $(cat "$E2E_DIR/ctl.out")"
[ $(($(now_ms) - T0)) -lt 10000 ] || fail "refitctl's waits took $(($(now_ms) - T0)) ms"
kill "$FP16"
st_wait "$E2E_DIR/recv0.sock" 10 "the block clears when the engine leaves" "s['blocked'] is None"
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
st_wait "$E2E_DIR/pub0.sock" 0 "nothing blocks once the plan builds" \
    "s['blocked'] is None and cl['blocked'] is None"
echo "ok: a dtype disagreement ends every wait at once with its reason; unknown tensor fails the plan with its name and box; a correct engine then refits"
