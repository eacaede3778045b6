#!/bin/bash
# tests/gpu/32-fp8-colocated.sh - FP8 engines colocated on ONE GPU (issue 15): bf16 trainers'
# weights and FP8 engines' buffers both on GPU 0, the receiverd quantizing while it copies
# (the GPU local copies' batch kernel). After every commit the engines copy their memory to
# the host and check every FP8 byte, every scale and the padding of scale rows against the
# scalar reference (rf_quant_ref) of the trainers' values; bf16 pieces on the GPU as ever.
#   block (128x128) with verify = full: the receiverd digests every installed FP8 byte and
#   scale against the bf16 source quantized on the host; channel, mxfp8 and block:64x64 with
#   padded scale rows on VMM memory; a flipped FP8 element is caught by the engines' check.
#   Quantized on the receiver: engines tp=1 in block:96x96 from trainers tp=2, whose halves
#   cut the blocks: those transfers land in a shadow on the GPU beside the piece, which the
#   GPU quantizes once the refit's copies landed (the receiverd's, and an in-process engine's
#   own installer's). FP8 trainers: trainers that hold their decoder layers in block FP8 on the
#   GPU, copied as they are into engines of the same format (block:64x64 with verify full:
#   both ends' FP8 bytes digested; mxfp8).
. "$(dirname "$0")/../e2e/lib.sh"
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no CUDA device"
    exit 0
fi
export NCCL_NVLS_ENABLE=0
E2E_LOCAL_COPY=auto
BASE_COMMON="$E2E_COMMON --transport nccl --refit-timeout-s 120"

# run_case NAME VERIFY N FORMAT [sim flags]: qwen3-0.6b tp=2 -> tp=4 (ENG_LAYOUT), N versions;
# ENG_FLAGS for the engine alone (ENG_RANKS its ranks), TR_FLAGS for the trainer alone; QR=1:
# the receiverd must have quantized shadows; FP8SRC=1: the plan must copy FP8 sources.
run_case() {
    local name=$1 verify=$2 n=$3 fmt=$4
    shift 4
    E2E_COMMON="$BASE_COMMON --verify $verify"
    E2E_PUBLISHERS=1 E2E_RECEIVERS=1
    start_publisher 0 2
    start_receiver 0 "${ENG_RANKS:-4}"
    start_engine "${name}_eng" 0 --model qwen3-0.6b --layout "${ENG_LAYOUT:-tp=4}" \
        --versions "$n" --device cuda:0 --fp8 "$fmt" --timeout-ms 300000 ${ENG_FLAGS:-} "$@"
    start_trainer "${name}_tr" 0 --model qwen3-0.6b --layout tp=2 --versions "$n" \
        --device cuda:0 --timeout-ms 300000 ${TR_FLAGS:-} "$@"
    wait_ok "${name}_tr" "${name}_eng"
    local ok=$(grep -c "committed after.*, 0 wrong" "$E2E_DIR/${name}_eng.log")
    [ "$ok" = "$n" ] || fail "$name: $ok of $n versions verified"
    grep -q "fp8 $fmt: [1-9][0-9]* pieces FP8" "$E2E_DIR/${name}_eng.log" ||
        fail "$name: the engines hold no FP8 piece"
    grep -q "version $n: moved" "$E2E_DIR/recv0.log" || fail "$name: no local copy of version $n"
    if [ "${FP8SRC:-0}" = 1 ]; then
        grep -q "copies [1-9][0-9]* transfers from trainers' FP8 pieces" "$E2E_DIR/pub0.log" ||
            fail "$name: the plan copies no trainer FP8 piece"
        grep -o "copies [0-9]* transfers from trainers' FP8 pieces.*" "$E2E_DIR/pub0.log" | head -n 1
    fi
    if [ "${QR:-0}" = 1 ]; then
        grep -q "version $n: quantized on the receiver: [1-9][0-9]* runs" "$E2E_DIR/recv0.log" ||
            fail "$name: the receiverd quantized no shadow"
        grep "version $n: quantized on the receiver" "$E2E_DIR/recv0.log" | tail -n 1
    fi
    grep "fp8 $fmt:" "$E2E_DIR/${name}_eng.log" | head -n 1
    grep "version $n: moved" "$E2E_DIR/recv0.log" | tail -n 1
    echo "ok: $name: $n FP8 refits on one GPU ($fmt, verify $verify), every FP8 byte and scale checked"
    e2e_stop $PUB0_PID $RECV0_PID
    mv "$E2E_DIR/pub0.log" "$E2E_DIR/${name}_pub0.log"
    mv "$E2E_DIR/recv0.log" "$E2E_DIR/${name}_recv0.log"
}

want() { case " ${GPU_CASES:-block channel mxfp8 block64 shadow shadowinproc fp8src fp8srcmx corrupt} " in *" $1 "*) return 0 ;; esac; return 1; }
want block && run_case block full 2 block
want channel && run_case channel sample 2 channel --cuda-vmm
want mxfp8 && run_case mxfp8 full 2 mxfp8 --cuda-vmm
want block64 && ENG_FLAGS="--fp8-scale-pad 4" run_case block64 sample 3 block:64x64
want shadow && ENG_LAYOUT=tp=1 ENG_RANKS=1 QR=1 run_case shadow full 2 block:96x96 --shrink 4 \
    --cuda-vmm
want fp8src && TR_FLAGS="--fp8 block:64x64" FP8SRC=1 run_case fp8src full 2 block:64x64 \
    --shrink 4 --cuda-vmm
want fp8srcmx && TR_FLAGS="--fp8 mxfp8" FP8SRC=1 run_case fp8srcmx sample 2 mxfp8 --shrink 4
want shadowinproc && ENG_LAYOUT=tp=1 ENG_RANKS=1 ENG_FLAGS=--inproc run_case shadowinproc sample 2 \
    block:96x96 --shrink 4
want corrupt || exit 0

# The engines' check catches one flipped FP8 element in GPU memory (flipped after version 1
# was installed): 1 wrong element, the engine exits 1; version 2 installs over it (0 wrong).
E2E_COMMON="$BASE_COMMON --verify sample"
start_publisher 0 2
start_receiver 0 4
REFIT_SIM_FP8_CORRUPT=element start_engine ceng 0 --model qwen3-0.6b --layout tp=4 \
    --versions 2 --device cuda:0 --fp8 block --timeout-ms 300000
start_trainer ctr 0 --model qwen3-0.6b --layout tp=2 --versions 2 --device cuda:0 \
    --timeout-ms 300000
wait "$ctr_PID" || fail "corrupt: the trainer failed"
wait "$ceng_PID" && fail "corrupt: the engine exited 0 with a flipped FP8 element"
grep -q "version 1 committed after .*, 1 wrong elements$" "$E2E_DIR/ceng.log" ||
    fail "corrupt: version 1 not reported with 1 wrong element: $(tail -n 5 "$E2E_DIR/ceng.log" | tr '\n' ' ')"
grep -q "version 2 committed after .*, 0 wrong elements$" "$E2E_DIR/ceng.log" ||
    fail "corrupt: version 2 not verified: $(tail -n 3 "$E2E_DIR/ceng.log" | tr '\n' ' ')"
grep "FP8 element" "$E2E_DIR/ceng.log" | head -n 1
echo "ok: corrupt: a flipped FP8 element in GPU memory is caught (1 wrong), version 2 installs over it"
