#!/bin/bash
# tests/e2e/66-fp8-sources.sh - trainers that hold their weights in FP8 (issue 15: FP8 -> FP8
# with the same grid): refit-sim-trainer --fp8 FORMAT registers every on-grid piece of qwen3-0.6b
# (tp=2) as float8_e4m3fn with scales, each version's values quantized by the reference
# (rf_quant_ref); engines (tp=4) of the same format receive those bytes and scales as they are,
# resharded, and check every FP8 byte and scale against the reference of the same values. Over
# TCP (local_copy off: the publisherd gathers the FP8 payload) and as same-host copies
# (local_copy auto), two refits each; the coordinator counts them as FP8 copies (tensors the
# trainers keep in bf16, the embedding, are quantized into engines that hold them in FP8). Bad input: engines of another format, and bf16 engines, are refused when the plan
# is built, naming the tensor and both sides; the clients give up and exit.
. "$(dirname "$0")/lib.sh"
WAIT="--timeout-ms 60000"
M="--model qwen3-0.6b --shrink 4"

# src_cluster NAME LOCAL_COPY: a publisherd (2 trainer ranks) and a receiverd (4 engine ranks).
src_cluster() {
    e2e_new_cluster "$1"
    E2E_LOCAL_COPY=$2
    E2E_PUBLISHERS=1 E2E_RECEIVERS=1
    start_publisher 0 2
    start_receiver 0 4
}

# src_case NAME LOCAL_COPY FORMAT [engine flags]: FP8 trainers into FP8 engines, two refits
# verified.
src_case() {
    local name=$1 lc=$2 fmt=$3 n copies quant
    shift 3
    src_cluster "$name" "$lc"
    start_engine eng 0 $M --layout tp=4 --fp8 "$fmt" --versions 2 $WAIT "$@"
    start_trainer tr 0 $M --layout tp=2 --fp8 "$fmt" --versions 2 --retries 1 $WAIT
    wait_ok eng tr
    n=$(sed -n 's/.*: fp8 .*: \([0-9]*\) pieces FP8 .*/\1/p' "$E2E_DIR/tr.log" | head -n 1)
    [ "${n:-0}" -gt 0 ] || fail "$name: the trainer registered no FP8 piece: $(grep fp8 "$E2E_DIR/tr.log")"
    for v in 1 2; do
        grep -q "version $v committed after .*, 0 wrong elements$" "$E2E_DIR/eng.log" ||
            fail "$name: version $v not verified with 0 wrong elements: $(tail -n 4 "$E2E_DIR/eng.log" | tr '\n' ' ')"
    done
    copies=$(grep -o "copies [0-9]* transfers from trainers' FP8 pieces into FP8 engines" "$E2E_DIR/pub0.log" | head -n 1)
    [ -n "$copies" ] || fail "$name: the plan copies no FP8 transfer: $(grep plan "$E2E_DIR/pub0.log" | tail -n 3)"
    quant=$(grep -o "quantizes [0-9]* transfers into FP8 engines" "$E2E_DIR/pub0.log" | head -n 1)
    st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    if [ "$lc" = auto ]; then last_refit_path local "$name"; else last_refit_path network "$name"; fi
    echo "ok: $name: $fmt trainers ($n FP8 pieces) into $fmt engines, $([ "$lc" = auto ] && echo same-host copies || echo TCP): plan ${copies#copies }${quant:+ (and ${quant#quantizes } from bf16 tensors of the trainers)}, 2 refits, every byte and scale verified"
}

# refused NAME ENGINE_FLAGS WANT: FP8 trainers (block:64x64) and engines that cannot take their
# bytes: the coordinator refuses the plan with WANT; both clients give up.
refused() {
    local name=$1 eflags=$2 want=$3
    src_cluster "$name" off
    start_engine eng 0 $M --layout tp=4 $eflags --versions 1 --timeout-ms 15000
    start_trainer tr 0 $M --layout tp=2 --fp8 block:64x64 --versions 1 --retries 0 \
        --timeout-ms 15000
    wait_for "$E2E_DIR/pub0.log" "the plan failed: .*$want" 30
    wait "$tr_PID" && fail "$name: the trainer exited 0 without a plan"
    wait "$eng_PID" && fail "$name: the engine exited 0 without a plan"
    echo "ok: $name refused: $(grep -m1 -o "the plan failed: .*" "$E2E_DIR/pub0.log" | cut -c1-200)"
}

T0=$(now_ms)
src_case block64-tcp off block:64x64
src_case channel-local auto channel
src_case mxfp8-tcp off mxfp8
# An engine that installs in its own process: its installer copies the trainers' FP8 bytes.
src_case block64-inproc auto block:64x64 --inproc
refused other-format "--fp8 block:32x64" "a trainer holds it in FP8 block:64x64 and an engine's FP8 piece is block:32x64"
refused bf16-engine "" "a trainer holds it in FP8 and an engine in bf16"
echo "ok: FP8 trainers, $(( ($(now_ms) - T0) / 1000 )) s"
