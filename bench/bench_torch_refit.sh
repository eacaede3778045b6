#!/bin/bash
# bench/bench_torch_refit.sh - refits between real PyTorch processes on one GPU through the
# daemons (transport nccl, local_copy auto: the receiverd copies the trainer's tensors into the
# engine's), beside the same-GPU copy ceiling and the simulator in the same run, one table at
# the end. Per configuration (geometry x allocator x verify): a fresh publisherd (coordinator)
# and receiverd with that `verify`, bench_torch_refit.py's engine process (vLLM ranks) and
# trainer process (Megatron ranks) on the GPU, a cold refit and WARM warm ones (fewer once their
# Start->Commit would sum past WARM_BUDGET_S), every element of the last version checked by the
# engine. Per geometry: the ceiling (torch copy_ of the refit's bytes through 1 GiB buffers) and
# bench/bench_fp8.sh's simulated trainers and engines on VMM memory for each of SIM_VERIFY.
#
#   BUILD=build bench/bench_torch_refit.sh            # the full run (estimate: 4-5 min on an H200)
#   QUICK=1 BUILD=build bench/bench_torch_refit.sh    # a first run (estimate: 1.5-2 min)
#
# Environment (defaults; QUICK=1 changes those marked *): GEOMS ("q4b q30b": qwen3-4b tp=2 ->
# tp=4, qwen3-30b-a3b tp=2,ep=2 -> tp=4), LAYERS* (48, all: how many of qwen3-30b-a3b's layers;
# 12 with QUICK), ALLOCS ("caching expandable": PyTorch's caching allocator, and
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), VERIFY* ("off sample full"; QUICK "off
# sample"), GROUPED* ("off": the verify modes for which q30b runs again with GroupedMLP's
# transposed experts; QUICK none), WARM* (5; QUICK 2), WARM_BUDGET_S (10), SIM_VERIFY* ("off
# sample"; QUICK "off"), MAX_REFIT_S (20: a q30b configuration with verify full is skipped, with
# a note, when q4b's full refits predict more than this per refit), TIMEOUT_S (120, the daemons'
# refit_timeout_s), DEVICE (cuda:0; "cpu" runs the same on host memory over tcp with SHRINK, a
# smoke test of this script where there is no GPU), SHRINK (1; 16 with DEVICE=cpu), KEEP=1
# keeps the logs.
. "$(dirname "$0")/../tests/e2e/lib.sh"
. "$(dirname "$0")/../tests/e2e/torch-lib.sh"
HERE=$(cd "$(dirname "$0")" && pwd)
DEVICE=${DEVICE:-cuda:0}
if [ "$DEVICE" != cpu ] && ! "$TORCH_PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)' 2>/dev/null; then
    echo "skipped: no CUDA device (needs PyTorch with CUDA and a GPU; DEVICE=cpu runs a smoke test on host memory)"
    exit 0
fi
[ -n "${KEEP:-}" ] && export E2E_KEEP=1
if [ "${QUICK:-0}" = 1 ]; then
    LAYERS=${LAYERS:-12} VERIFY=${VERIFY:-off sample} GROUPED=${GROUPED-} WARM=${WARM:-2}
    SIM_VERIFY=${SIM_VERIFY-off}
else
    LAYERS=${LAYERS:-48} VERIFY=${VERIFY:-off sample full} GROUPED=${GROUPED-off}
    WARM=${WARM:-5} SIM_VERIFY=${SIM_VERIFY-off sample}
fi
GEOMS=${GEOMS:-q4b q30b} WARM_BUDGET_S=${WARM_BUDGET_S:-10} MAX_REFIT_S=${MAX_REFIT_S:-20}
TIMEOUT_S=${TIMEOUT_S:-120}
if [ "$DEVICE" = cpu ]; then
    ALLOCS=host SHRINK=${SHRINK:-16} TRANSPORT="--transport tcp"
    SIM_FLAGS="--shrink $SHRINK --finite-weights" SIM_CHECK=1
else
    ALLOCS=${ALLOCS:-caching expandable} SHRINK=${SHRINK:-1} TRANSPORT="--transport nccl"
    SIM_FLAGS="--device $DEVICE --cuda-vmm --finite-weights" SIM_CHECK=0
    export NCCL_NVLS_ENABLE=0
fi
RES=$E2E_ROOT/results
mkdir -p "$RES"
BASE_COMMON=$E2E_COMMON
T_RUN=$(now_ms)

py() {
    "$TORCH_PY" "$HERE/bench_torch_refit.py" "$@"
}

# json FILE KEY=VALUE...: one JSON object of strings (numbers where they parse) into FILE.
json() {
    python3 - "$@" <<'PY'
import json, sys
out = {}
for kv in sys.argv[2:]:
    k, v = kv.split("=", 1)
    try:
        v = float(v) if "." in v else int(v)
    except ValueError:
        pass
    out[k] = v
json.dump(out, open(sys.argv[1], "w"))
PY
}

NOTES=0
note() {
    NOTES=$((NOTES + 1))
    echo "note: $1"
    json "$RES/note-$NOTES.json" role=note "text=$1"
}

# full_rate GEOM: bytes a second of GEOM's verify = full refits so far (warm median), or nothing.
full_rate() {
    python3 - "$RES" "$1" <<'PY'
import glob, json, statistics, sys
rates = []
for p in glob.glob(sys.argv[1] + "/*-trainer.json"):
    t = json.load(open(p))
    if t["geom"] == sys.argv[2] and t["verify"] == "full" and len(t["refits"]) > 1:
        rates.append(t["refits"][-1]["bytes"] / statistics.median(
            r["start_to_commit_s"] for r in t["refits"][1:]))
if rates:
    print(int(max(rates)))
PY
}

N=0
# run_cfg GEOM ALLOC VERIFY GROUPED(0|1): one configuration on fresh daemons.
run_cfg() {
    local g=$1 alloc=$2 verify=$3 grouped=$4 key label conf="" gflag="" t0 tr eng rct rce why=""
    N=$((N + 1))
    key=$(printf '%02d-%s-%s-%s' $N "$g" "$alloc" "$verify")
    label=$g
    [ "$g" = q30b ] && [ "$LAYERS" != 48 ] && label="$g ${LAYERS}L"
    if [ "$grouped" = 1 ]; then
        key=$key-grouped gflag=--grouped-transposed label="$label grouped-T"
    fi
    echo "== $label, $alloc allocator, verify $verify"
    e2e_new_cluster "$key"
    E2E_LOCAL_COPY=auto E2E_PUBLISHERS=1 E2E_RECEIVERS=1
    E2E_COMMON="$BASE_COMMON $TRANSPORT --verify $verify --refit-timeout-s $TIMEOUT_S"
    E2E_COMMON=${E2E_COMMON/127.0.0.1:$BASE_PORT/127.0.0.1:$E2E_COORD_PORT}
    start_publisher 0 "$TRAINERS"
    start_receiver 0 "$ENGINES"
    [ "$alloc" = expandable ] && conf=expandable_segments:True
    local args="--geom $g --model $MODEL --shrink $SHRINK --device $DEVICE $gflag
        --warm $WARM --budget-s $WARM_BUDGET_S --timeout-s $((TIMEOUT_S + 60))
        --last-file $E2E_DIR/last.json"
    t0=$(now_ms)
    PYTORCH_CUDA_ALLOC_CONF=$conf py engine $args --socket "$E2E_DIR/recv0.sock" \
        --out "$RES/$key-engine.json" $PRECHECK > "$E2E_DIR/engine.log" 2>&1 &
    eng=$!
    PYTORCH_CUDA_ALLOC_CONF=$conf py trainer $args --socket "$E2E_DIR/pub0.sock" \
        --ready-socket "$E2E_DIR/recv0.sock" \
        --out "$RES/$key-trainer.json" > "$E2E_DIR/trainer.log" 2>&1 &
    tr=$!
    E2E_PIDS="$E2E_PIDS $eng $tr"
    # Whichever ends first: a failed one leaves the other waiting for a refit that never comes.
    while kill -0 $tr 2>/dev/null && kill -0 $eng 2>/dev/null; do sleep 0.2; done
    if ! kill -0 $tr 2>/dev/null; then
        wait $tr; rct=$?
        [ $rct = 0 ] || e2e_stop $eng
        wait $eng; rce=$?
    else
        wait $eng; rce=$?
        [ $rce = 0 ] || e2e_stop $tr
        wait $tr; rct=$?
    fi
    sed 's/^/  /' "$E2E_DIR/trainer.log" "$E2E_DIR/engine.log"
    if [ $rct != 0 ]; then
        why="the trainer exited with status $rct: $(tail -n 1 "$E2E_DIR/trainer.log")"
    elif [ $rce != 0 ]; then
        why="the engine exited with status $rce: $(tail -n 1 "$E2E_DIR/engine.log")"
    fi
    if [ -n "$why" ]; then
        E2E_FAILED=1
        echo "  FAILED: $why (logs: $E2E_DIR)"
    fi
    PRECHECK=""
    json "$RES/$key-config.json" role=config "label=$label" "allocator=$alloc" \
        "verify=$verify" "why=$why"
    e2e_stop $PUB0_PID $RECV0_PID
    echo "  ($(( ($(now_ms) - t0) / 1000 )) s)"
}

# run_sim GEOM VERIFY: bench/bench_fp8.sh's simulated clients, same model, layouts and verify.
run_sim() {
    local g=$1 verify=$2 out row
    echo "== $g simulator (refit-sim-trainer/engine $SIM_FLAGS), verify $verify"
    out=$RES/sim-$g-$verify.log
    MODEL=$MODEL SRC=$SRC DST=$DST TRAINERS=$TRAINERS ENGINES=$ENGINES REFITS=$((WARM + 1)) \
        SIM_FLAGS=$SIM_FLAGS CHECK=$SIM_CHECK PATHS=auto FORMATS=none BUILD=$BUILD \
        DAEMON_FLAGS="$TRANSPORT --verify $verify --refit-timeout-s $TIMEOUT_S" \
        bash "$HERE/bench_fp8.sh" > "$out" 2>&1
    sed 's/^/  /' "$out" | tail -n 3
    row=$(awk '$1 == "local" && $2 == "none" { print $3, $NF, $6 }' "$out")
    if [ -z "$row" ]; then
        E2E_FAILED=1
        note "the simulator's $g run with verify $verify gave no result (log: $out)"
        return
    fi
    set -- $row
    json "$RES/sim-$g-$verify.json" role=sim "geom=$g" "verify=$verify" "bytes=$1" "warm_s=$2" \
        "wrong=$3"
}

BASE_PORT=$E2E_COORD_PORT
for g in $GEOMS; do
    layers=0
    [ "$g" = q30b ] && layers=$LAYERS
    geo=$(py geom --geom "$g" --layers "$layers" --shrink "$SHRINK" --workdir "$E2E_ROOT/specs") ||
        fail "$g: no geometry: $geo"
    eval "$geo"
    echo "== $g: $MODEL, trainer $SRC ($TRAINERS ranks) -> engine $DST ($ENGINES ranks), $BYTES bytes a refit"
    if [ "$DEVICE" != cpu ]; then
        py ceiling --geom "$g" --bytes "$BYTES" --device "$DEVICE" \
            --out "$RES/ceiling-$g.json" || fail "$g: the ceiling's copy failed"
    fi
    PRECHECK=--precheck
    for grouped in 0 1; do
        for verify in $VERIFY; do
            if [ $grouped = 1 ]; then
                [ "$g" = q30b ] || continue
                case " $GROUPED " in *" $verify "*) ;; *) continue ;; esac
            fi
            for alloc in $ALLOCS; do
                if [ "$verify" = full ] && [ "$g" = q30b ]; then
                    rate=$(full_rate q4b)
                    if [ -n "$rate" ] && [ $((BYTES / rate)) -gt "$MAX_REFIT_S" ]; then
                        note "$g verify full ($alloc) skipped: q4b's full refits moved $rate bytes/s, so one refit of $BYTES bytes would take about $((BYTES / rate)) s (over MAX_REFIT_S=$MAX_REFIT_S s; raise it to run)"
                        continue
                    fi
                fi
                run_cfg "$g" "$alloc" "$verify" $grouped
            done
        done
    done
    for verify in $SIM_VERIFY; do
        run_sim "$g" "$verify"
    done
done
echo
echo "== qwen3 refits between PyTorch processes on $DEVICE through the daemons ($(( ($(now_ms) - T_RUN) / 1000 )) s in all)"
py table "$RES"
rc=$?
[ $rc = 0 ] || E2E_FAILED=1
exit $rc
