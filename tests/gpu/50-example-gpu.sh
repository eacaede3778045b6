#!/bin/bash
# tests/gpu/50-example-gpu.sh - examples/ in its GPU mode (issue #13 item 3) on ONE GPU:
# DEVICE=cuda:0 examples/run.sh 3, the trainer HF transformers' Qwen3ForCausalLM (qwen3-0.6b
# shrunk 8x, weights made with a fixed seed) sharded by FSDP2 (fully_shard, a 1-rank mesh,
# NCCL) and trained with AdamW, publishing a bf16 DTensor copy; the engine colocated on cuda:0
# with vLLM-style fused buffers (qkv_proj, gate_up_proj) that the same HF forward pass reads
# through views; daemons with transport = nccl and local_copy = auto (same-GPU copies). Runs
# tp=1 (every HF parameter a view of a fused buffer) and tp=2 (two ranks in one process, what
# spans them gathered); prints each version's lines and fails unless every version's logits
# are equal to the trainer's (torch.equal), every version was copied locally and the loss fell.
# Skips without a CUDA device, or without transformers / FSDP2 in the python3 that has one.
. "$(dirname "$0")/../e2e/lib.sh"
PY=""
for py in ${PYTHON:-python3} /usr/bin/python3; do
    if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)' 2>/dev/null; then
        PY=$py
        break
    fi
done
if [ -z "$PY" ]; then
    echo "skipped: no CUDA device (needs PyTorch and a GPU)"
    exit 0
fi
if ! "$PY" -c '
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard' 2>"$E2E_DIR/deps.err"; then
    echo "skipped: $PY has a GPU but no HF transformers with Qwen3 or no FSDP2 (fully_shard):" \
         "$(tail -n 1 "$E2E_DIR/deps.err")"
    exit 0
fi
"$PY" -c 'import torch, transformers; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}),",
      f"transformers {transformers.__version__}, {torch.cuda.get_device_name(0)}")'
RUN="$(cd "$(dirname "$0")/../.." && pwd)/examples/run.sh"
export TMPDIR=$E2E_DIR PYTHON=$PY BUILD=$BIN DEVICE=cuda:0
for tp in 1 2; do
    t0=$(date +%s)
    log=$E2E_DIR/tp$tp.log
    TP=$tp "$RUN" 3 > "$log" 2>&1 ||
        fail "tp=$tp: examples/run.sh failed (exit $?): $(tail -n 40 "$log")"
    cat "$log"
    for v in 1 2 3; do
        grep -q "^version $v: .*logits equal (torch.equal): True" "$log" ||
            fail "tp=$tp: no 'version $v: ... logits equal (torch.equal): True' in examples/run.sh's output"
        grep -q "^receiverd: version $v: moved [0-9]* bytes .*local copies included" "$log" ||
            fail "tp=$tp: the receiverd did not copy version $v locally (same GPU, local_copy auto)"
    done
    ! grep -q "logits equal (torch.equal): False" "$log" ||
        fail "tp=$tp: a version's logits differ from the trainer's"
    grep -q "^trainer: transformers .*FSDP2 fully_shard" "$log" ||
        fail "tp=$tp: the trainer did not say it ran transformers under FSDP2"
    grep -q "^engine: transformers .* parameters are views into the ranks' buffers" "$log" ||
        fail "tp=$tp: the engine did not say it ran transformers on views of its buffers"
    if [ $tp = 1 ]; then
        grep -q "^engine: .*, 0 gathered from 1 ranks" "$log" ||
            fail "tp=1: the engine copied parameters instead of viewing its fused buffers"
    fi
    first=$(sed -n 's/^version 1: trainer loss \([0-9.]*\) .*/\1/p' "$log")
    last=$(sed -n 's/^version 3: trainer loss \([0-9.]*\) .*/\1/p' "$log")
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' ||
        fail "tp=$tp: the trainer's loss did not fall from version 1 ($first) to 3 ($last)"
    echo "ok: tp=$tp: 3 versions, logits equal bit for bit on GPU ($(($(date +%s) - t0)) s)"
done
echo "ok: examples/ on one GPU: transformers + FSDP2 trainer -> vLLM-style engine (tp=1 views," \
     "tp=2 gathered), every version's logits equal (torch.equal)"
