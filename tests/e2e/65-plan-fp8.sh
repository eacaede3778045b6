#!/bin/bash
# refitctl plan --fp8 (issue 15): the offline plan of FP8 engines. qwen3-30b-a3b into vLLM-style
# engines with expert parallelism (experts whole): every 2-dim weight on the 128x128 grid is
# FP8 and the plan's FP8 bytes (elements and scales) are about half the bf16 bytes they
# replace; with tp=4 the experts' 192-row shards are off the grid and stay bf16. A bad format
# exits 2 naming it.
. "$(dirname "$0")/lib.sh"

plan_json() {
    "$BIN/refitctl" plan --model qwen3-30b-a3b --src tp=2,ep=2 "$@" --json > "$E2E_DIR/plan.json" ||
        fail "refitctl plan $* failed"
}

plan_json --dst tp=4,ep=4
BF16=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["dst_bytes"])' "$E2E_DIR/plan.json")
plan_json --dst tp=4,ep=4 --fp8 block
python3 - "$E2E_DIR/plan.json" "$BF16" <<'PY' || fail "FP8 plan of qwen3-30b-a3b with ep=4"
import json, sys
p, bf16 = json.load(open(sys.argv[1])), int(sys.argv[2])
assert p["fp8_pieces"] > 18000 and p["quant_transfers"] >= p["fp8_pieces"], p
# FP8 halves the quantized bytes: the plan moves well under 60% of the bf16 plan's.
assert p["dst_bytes"] < 0.6 * bf16, (p["dst_bytes"], bf16)
assert p["quant_bytes"] > 0.9 * p["dst_bytes"], p
assert p["direct_bytes"] < p["dst_bytes"] - p["quant_bytes"] + 1, "FP8 transfers are never direct"
print("ep=4: %d FP8 pieces, %.2f GB of %.2f GB bf16" % (p["fp8_pieces"], p["dst_bytes"] / 1e9,
                                                         bf16 / 1e9))
PY
plan_json --dst tp=4 --fp8 block
python3 - "$E2E_DIR/plan.json" <<'PY' || fail "FP8 plan of qwen3-30b-a3b with tp=4"
import json, sys
p = json.load(open(sys.argv[1]))
# Attention weights only: 48 layers x 4 ranks x q, k, v, o and the router gate, + embeddings.
assert 0 < p["fp8_pieces"] < 1200, p
print("tp=4: %d FP8 pieces (experts' 192-row shards off the 128-row grid stay bf16)" %
      p["fp8_pieces"])
PY
"$BIN/refitctl" plan --model qwen3-0.6b --src tp=2 --dst tp=1 --fp8 block:0x4 \
    > /dev/null 2> "$E2E_DIR/err"
rc=$?
[ $rc -eq 2 ] || fail "a bad --fp8 format exited $rc, not 2"
grep -q 'fp8: quantization format "block:0x4"' "$E2E_DIR/err" || fail "$(cat "$E2E_DIR/err")"
echo "ok: refitctl plan --fp8: FP8 engines halve the bytes; off-grid shards stay bf16; bad format refused"
