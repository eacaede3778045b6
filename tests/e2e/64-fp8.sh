#!/bin/bash
# tests/e2e/64-fp8.sh - FP8 engines (issue 15): bf16 trainers of qwen3-0.6b (tp=2) refit
# engines that serve FP8 (refit-sim-engine --fp8), every FP8 byte and scale compared with the
# scalar reference (rf_quant_ref) quantizing the trainers' values, the other pieces (norms,
# boxes off the grid) bf16 as usual. Engines tp=4 in block (128x128), block:64x64, channel and
# mxfp8, over the network (local_copy off: the TCP transport, the sender quantizes) and as
# same-host copies (local_copy auto: the receiverd quantizes while it copies), two refits each;
# then engines tp=1 in tensor and block:96x96, whose blocks the trainers' shards cut: those
# are quantized on the receiver (TCP, local copies, an in-process installer). The check is
# proven to catch one flipped FP8 bit and one flipped scale bit. Bad input: pieces whose box
# cuts the format's grid are refused at registration naming the tensor, and the same daemons
# then refit an engine that keeps those pieces bf16.
. "$(dirname "$0")/lib.sh"
# Clients give up within a bound (a failed registration must not leave the trainer waiting out
# its retries); FP8_ONLY=NAME,... runs some of the parts only (block-tcp, corrupt, bad-grid...).
FP8_WAIT="--timeout-ms 60000"
fp8_only() {
    [ -z "${FP8_ONLY:-}" ] && return 0
    case ",$FP8_ONLY," in *",$1,"*) return 0 ;; esac
    return 1
}

# fp8_cluster NAME LOCAL_COPY ENGINE_RANKS: a publisherd and a receiverd of their own.
fp8_cluster() {
    e2e_new_cluster "$1"
    E2E_LOCAL_COPY=$2
    E2E_PUBLISHERS=1 E2E_RECEIVERS=1
    start_publisher 0 2
    start_receiver 0 "$3"
}

# fp8_verified NAME VERSIONS: the engine log NAME checked every version 1..VERSIONS with 0 wrong.
fp8_verified() {
    local v
    for v in $(seq 1 "$2"); do
        grep -q "version $v committed after .*, 0 wrong elements$" "$E2E_DIR/$1.log" ||
            fail "$E2E_DIR/$1.log: version $v not verified with 0 wrong elements: $(grep -v '^engine.*registered' "$E2E_DIR/$1.log" | tail -n 4 | tr '\n' ' ')"
    done
}

# fp8_pieces NAME: the number of FP8 pieces the engine log NAME registered (its summary line).
fp8_pieces() {
    sed -n 's/.*: fp8 .*: \([0-9]*\) pieces FP8 .*/\1/p' "$E2E_DIR/$1.log" | head -n 1
}

# fp8_pattern NAME MIN_PAIRS_PCT: the expected content could catch misplaced scales and
# elements: at least MIN_PAIRS_PCT % of neighbouring blocks differ in scale, and at least half
# the elements quantize to nonzero values.
fp8_pattern() {
    local line
    line=$(grep -m1 "fp8 check: " "$E2E_DIR/$1.log") || fail "$1: no 'fp8 check' line"
    python3 -S - "$line" "$2" <<'PY' || fail "$1: the pattern is degenerate for FP8: $line"
import re, sys
m = re.search(r"differ in (\d+) of (\d+) pairs, (\d+) of (\d+) elements", sys.argv[1])
d, p, nz, n = map(int, m.groups())
sys.exit(0 if n > 0 and 2 * nz >= n and (p == 0 or 100 * d >= float(sys.argv[2]) * p) else 1)
PY
}

# fp8_case NAME LOCAL_COPY MODEL FORMAT ENGINE_TP MIN_PAIRS_PCT [engine flags...]: two refits
# of version 1 and 2 into FP8 engines, every byte verified (TR_FLAGS: the trainer's own).
fp8_case() {
    local name=$1 lc=$2 model=$3 fmt=$4 etp=$5 pct=$6 n
    shift 6
    local m="--model $model $FP8_WAIT"
    fp8_only "$name" || return 0
    fp8_cluster "$name" "$lc" "$etp"
    start_engine eng 0 $m --layout tp=$etp --fp8 "$fmt" --versions 2 "$@"
    start_trainer tr 0 $m --layout tp=2 --versions 2 --retries 1 ${TR_FLAGS:-}
    wait_ok eng tr
    n=$(fp8_pieces eng)
    [ "${n:-0}" -gt 0 ] || fail "$name: no FP8 piece registered: $(grep 'fp8' "$E2E_DIR/eng.log")"
    fp8_verified eng 2
    fp8_pattern eng "$pct"
    st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    if [ "$lc" = auto ]; then last_refit_path local "$name"; else last_refit_path network "$name"; fi
    echo "ok: $name: $fmt engines tp=$etp ($n FP8 pieces, $([ "$lc" = auto ] && echo same-host copies || echo TCP)), 2 refits, every byte and scale verified; $(grep -m1 -o 'scales of neighbouring.*' "$E2E_DIR/eng.log")"
}

T0=$(now_ms)
# 128x128 blocks need qwen3-0.6b's own head_dim (128: a KV head of the trainers' interleaved
# linear_qkv is one block of rows, and the sender must hold whole blocks), which --shrink
# divides: its shapes, with 4 of its 28 layers and a quarter of its vocabulary (whose tp=4
# shards, 9496 rows, are off the grid and stay bf16). Every layer matrix of a tp=4 shard is
# on the grid.
cat > "$E2E_ROOT/qwen3-0.6b-4l.json" <<'EOF'
{"model_type": "qwen3", "name": "qwen3-0.6b-4l", "torch_dtype": "bfloat16",
 "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 37984,
 "tie_word_embeddings": true}
EOF
fp8_case block-tcp off "$E2E_ROOT/qwen3-0.6b-4l.json" block 4 90
# head_dim 64 at shrink 2: 64-row blocks hold one KV head.
fp8_case block64-local auto "qwen3-0.6b --shrink 2" block:64x64 4 90
fp8_case channel-local auto "qwen3-0.6b --shrink 4" channel 4 90
# Scale rows padded to 4 E8M0 bytes: the padding must stay untouched.
fp8_case mxfp8-tcp off "qwen3-0.6b --shrink 4" mxfp8 4 40 --fp8-scale-pad 4
# Weights without Inf, NaN, 0 or subnormal elements (--finite-weights, as the GPU benchmarks
# run): the same bytes checked; an engine that expects the default weights then finds them
# wrong, so the option changes the weights both sides compute.
TR_FLAGS=--finite-weights fp8_case finite-local auto "qwen3-0.6b --shrink 4" block:64x64 4 90 \
    --finite-weights
if fp8_only finite-mismatch; then
    fp8_cluster finite-mismatch auto 4
    start_engine eng 0 --model qwen3-0.6b --shrink 4 --layout tp=4 --fp8 block:64x64 \
        --versions 1 $FP8_WAIT
    start_trainer tr 0 --model qwen3-0.6b --shrink 4 --layout tp=2 --versions 1 --retries 1 \
        --finite-weights
    wait_ok tr
    wait "$eng_PID" && fail "finite-mismatch: the engine exited 0 on weights it did not expect"
    grep -q "version 1 committed after .*, [1-9][0-9]* wrong elements" "$E2E_DIR/eng.log" ||
        fail "finite-mismatch: the engine expecting edge values did not find them missing: $(tail -n 3 "$E2E_DIR/eng.log" | tr '\n' ' ')"
    echo "ok: finite-mismatch: an engine expecting the default weights counts $(grep -o '[0-9]* wrong elements' "$E2E_DIR/eng.log" | head -n 1) against --finite-weights trainers"
fi

# ---- quantized on the receiver ---------------------------------------------------------------
# qr_case NAME LOCAL_COPY FORMAT [engine flags]: an engine tp=1, whose pieces are whole tensors,
# from trainers tp=2, whose shard boundaries cut the format's blocks: those transfers carry
# bf16 into the receiver's shadow of the piece, which quantizes the blocks once every transfer
# landed; transfers on the grid are still quantized by their senders. Two refits verified.
qr_case() {
    local name=$1 lc=$2 fmt=$3
    shift 3
    fp8_only "$name" || return 0
    fp8_cluster "$name" "$lc" 1
    M="--model qwen3-0.6b --shrink 4 $FP8_WAIT"
    start_engine eng 0 $M --layout tp=1 --fp8 "$fmt" --versions 2 "$@"
    start_trainer tr 0 $M --layout tp=2 --versions 2 --retries 1
    wait_ok eng tr
    fp8_verified eng 2
    fp8_pattern eng 0
    grep -q "off their grid (trainer shards cut their blocks): [1-9][0-9]* bytes in the tensors' dtype, quantized by the receivers" "$E2E_DIR/pub0.log" ||
        fail "$name: the plan has no transfer quantized by the receiver"
    st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    local recv send
    recv=$(grep -o "moves [0-9]* transfers into FP8 engines off their grid" "$E2E_DIR/pub0.log" | head -n 1)
    send=$(grep -o "quantizes [0-9]* transfers into FP8 engines on their senders" "$E2E_DIR/pub0.log" | head -n 1)
    echo "ok: $name: $fmt quantized on the receiver (plan ${recv#moves }${send:+, and ${send#quantizes }}), 2 refits verified"
}
# tensor: one scale over both trainer ranks' halves, over TCP.
qr_case tensor-tp1 off tensor
# block:96x96: trainer halves of 1024 and 512 rows cut blocks of 96, the rest stays on the grid;
# as local copies, and by an in-process engine's own installer.
qr_case block96-local auto block:96x96
qr_case block96-inproc auto block:96x96 --inproc

# ---- the check catches one wrong byte --------------------------------------------------------
# REFIT_SIM_FP8_CORRUPT flips one bit of the engine's first FP8 piece (an element, a scale, or
# the padding after a row of scales, which nothing may write) after version 1 was installed:
# that check must count exactly 1 wrong element and name it, and the engine exit 1. Version 2
# is installed over an element or a scale (0 wrong then), never over padding (1 wrong again).
for what in element scale padding; do
    fp8_only corrupt || break
    fp8_cluster "corrupt-$what" auto 4
    REFIT_SIM_FP8_CORRUPT=$what start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 \
        --fp8 mxfp8 --fp8-scale-pad 4 --versions 2 $FP8_WAIT
    start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 2 --retries 1 \
        $FP8_WAIT
    wait "$eng_PID" && fail "corrupt-$what: the engine exited 0 with a flipped FP8 $what"
    grep -q "registered" "$E2E_DIR/eng.log" ||
        fail "corrupt-$what: the engine did not register: $(tail -n 3 "$E2E_DIR/eng.log" | tr '\n' ' ')"
    grep -q "version 1 committed after .*, 1 wrong elements$" "$E2E_DIR/eng.log" ||
        fail "corrupt-$what: version 1 not reported with 1 wrong element: $(tail -n 5 "$E2E_DIR/eng.log" | tr '\n' ' ')"
    n2=0
    [ $what = padding ] && n2=1
    grep -q "version 2 committed after .*, $n2 wrong elements$" "$E2E_DIR/eng.log" ||
        fail "corrupt-$what: version 2 not verified with $n2 wrong elements: $(tail -n 3 "$E2E_DIR/eng.log" | tr '\n' ' ')"
    case $what in
        element) want="FP8 element \[0, 0\] holds" ;;
        scale) want="FP8 scale of block \[0, 0\] holds" ;;
        padding) want="byte 0 of the padding after FP8 scale row 0 was written" ;;
    esac
    grep -q "$want" "$E2E_DIR/eng.log" ||
        fail "corrupt-$what: no report of the flipped $what ('$want'): $(grep rank "$E2E_DIR/eng.log" | head -n 3)"
    wait_ok tr
    echo "ok: a flipped FP8 $what is caught: $(grep -m1 "$want" "$E2E_DIR/eng.log")"
done

# ---- bad input: a piece whose box cuts the grid ----------------------------------------------
# tensor on tp=4 shards: every shard of a 2-D tensor cuts it. The sim keeps such pieces bf16;
# --fp8-off-grid registers them FP8 anyway, and the daemon must refuse the first at registration,
# naming its tensor. The same daemons then refit the fallback engine (bf16 for every sharded
# piece).
if fp8_only bad-grid; then
fp8_cluster bad-grid auto 4
start_engine bad 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --fp8 tensor --fp8-off-grid \
    $FP8_WAIT
wait "$bad_PID" && fail "bad-grid: an engine registering FP8 pieces off the tensor grid was accepted"
# Rank 0 registers the embedding first: its vocab-parallel shard is the first refused.
FIRST=model.embed_tokens.weight
grep -q "rank 0: .*FP8 piece of $FIRST" "$E2E_DIR/bad.log" ||
    fail "bad-grid: the refusal does not name the tensor ($FIRST): $(grep -v registered "$E2E_DIR/bad.log" | head -n 3)"
echo "ok: refused at registration: $(grep -m1 "rank 0: " "$E2E_DIR/bad.log")"
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --fp8 tensor --versions 2 \
    $FP8_WAIT
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 2 --retries 1 $FP8_WAIT
wait_ok eng tr
[ "$(fp8_pieces eng)" = 0 ] || fail "bad-grid: format tensor on tp=4 shards left FP8 pieces: $(grep fp8 "$E2E_DIR/eng.log")"
fp8_verified eng 2
st_committed 10 2 "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: the same daemons then refit the bf16 fallback (tensor on sharded pieces), every byte verified"
fi
echo "ok: FP8 engines, $(( ($(now_ms) - T0) / 1000 )) s"
