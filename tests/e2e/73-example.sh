#!/bin/bash
# examples/ end to end (issue #13 item 3): examples/run.sh on the real daemons, a trainer
# (plain-torch Qwen3, HF names, AdamW) publishing 3 versions to a vLLM-style engine (fused
# buffers, tp=2): every version's logits equal the trainer's bit for bit, the loss falls, the
# receiverd copies locally. Then the failures run.sh reports: an engine whose row-parallel
# layers all-reduce partial sums (logits unequal in the last bits), no torch, no build.
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/torch-lib.sh"
RUN="$(cd "$(dirname "$0")/../.." && pwd)/examples/run.sh"
export TMPDIR=$E2E_DIR PYTHON=$TORCH_PY BUILD=$BIN
t0=$(date +%s)
"$RUN" 3 > "$E2E_DIR/run.log" 2>&1 ||
    fail "examples/run.sh failed: $(tail -n 30 "$E2E_DIR/run.log")"
cat "$E2E_DIR/run.log"
for v in 1 2 3; do
    grep -q "^version $v: .*logits equal (torch.equal): True" "$E2E_DIR/run.log" ||
        fail "no 'version $v: ... logits equal (torch.equal): True' in examples/run.sh's output"
    grep -q "^receiverd: version $v: moved 18657280 bytes .*local copies included" \
        "$E2E_DIR/run.log" || fail "the receiverd did not copy version $v locally (local_copy auto)"
done
first=$(sed -n 's/^version 1: trainer loss \([0-9.]*\) .*/\1/p' "$E2E_DIR/run.log")
last=$(sed -n 's/^version 3: trainer loss \([0-9.]*\) .*/\1/p' "$E2E_DIR/run.log")
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' ||
    fail "the trainer's loss did not fall from version 1 ($first) to 3 ($last)"
echo "examples/run.sh 3: $(($(date +%s) - t0)) s"

ENGINE_ARGS="--row-parallel allreduce" "$RUN" 1 > "$E2E_DIR/allreduce.log" 2>&1 &&
    fail "an engine that all-reduces row-parallel partial sums matched the trainer bit for bit"
grep -q "the engine failed (exit 1)" "$E2E_DIR/allreduce.log" &&
    grep -q "logits differ from the trainer's by up to .* (row-parallel layers by allreduce)" \
        "$E2E_DIR/allreduce.log" ||
    fail "allreduce engine: no failure naming the logits: $(tail -n 30 "$E2E_DIR/allreduce.log")"
grep -o "logits differ .*" "$E2E_DIR/allreduce.log"

PYTHON=/bin/false "$RUN" 1 > "$E2E_DIR/notorch.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "cannot import torch; install python3-torch" "$E2E_DIR/notorch.log" ||
    fail "PYTHON without torch: exit $rc, $(cat "$E2E_DIR/notorch.log")"
BUILD=$E2E_DIR/nobuild "$RUN" 1 > "$E2E_DIR/nobuild.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "no refit-publisherd or librefit.so in $E2E_DIR/nobuild" \
    "$E2E_DIR/nobuild.log" ||
    fail "BUILD without binaries: exit $rc, $(cat "$E2E_DIR/nobuild.log")"
echo "ok: examples/run.sh: 3 versions hf -> vllm tp=2, logits equal bit for bit;" \
     "its failures reported"
