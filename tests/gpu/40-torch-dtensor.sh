#!/bin/bash
# tests/gpu/40-torch-dtensor.sh - refit.torch with DTensors (issue #13): 4 trainer ranks of
# torch.distributed (gloo, CPU tensors in memfd arenas: no GPU needed) hold DTensors on a 1-D
# mesh (Shard(0), Shard(1), Replicate, uneven and empty last shards) and a 2-D dp x tp mesh
# (FSDP2 + TP placements, a module with HF names registered by register_module "hf"); an
# engine of 2 clients holds the same weights split differently in plain tensors. 2 versions,
# every engine tensor compared with torch.equal against the full weights; rank 0 checks the
# refusals (Partial first). With 2+ GPUs a second phase runs real FSDP2 (fully_shard, and
# parallelize_module's TP with 4) trainers on CUDA into the same kind of engine. Skips without a
# torch that has DTensor (torch >= 2.2).
. "$(dirname "$0")/../e2e/lib.sh"
PY=""
for py in ${PYTHON:-python3} /usr/bin/python3; do
    # DTensor (torch.distributed.tensor, or ._tensor before 2.5) and init_device_mesh (2.2).
    if "$py" -c '
try:
    from torch.distributed.tensor import DTensor
except ImportError:
    from torch.distributed._tensor import DTensor
from torch.distributed.device_mesh import init_device_mesh' 2>/dev/null; then PY=$py; break; fi
done
if [ -z "$PY" ]; then
    echo "skipped: no python3 with torch's DTensor (torch >= 2.2; Debian's python3-torch 1.13 has none)"
    exit 0
fi
export PYTHONPATH="$PWD/client/python" REFIT_LIB="$BIN/librefit.so"
SCRIPT="$(dirname "$0")/torch_dtensor.py"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 4
start_receiver 0 2
"$PY" "$SCRIPT" engine --socket "$E2E_DIR/recv0.sock" > "$E2E_DIR/engine.log" 2>&1 &
ENG=$!; E2E_PIDS="$E2E_PIDS $ENG"
PORT=$(free_port)
TR=""
for r in 0 1 2 3; do
    "$PY" "$SCRIPT" trainer --socket "$E2E_DIR/pub0.sock" --rank $r --world 4 --port "$PORT" \
        > "$E2E_DIR/trainer$r.log" 2>&1 &
    TR="$TR $!"; E2E_PIDS="$E2E_PIDS $!"
done
for p in $TR; do wait "$p" || fail "a DTensor trainer failed: $(tail -n 3 "$E2E_DIR"/trainer*.log)"; done
wait $ENG || fail "the engine failed: $(tail -n 3 "$E2E_DIR/engine.log")"
cat "$E2E_DIR"/trainer*.log "$E2E_DIR/engine.log"
grep -q "version 2 committed, .* 0 wrong" "$E2E_DIR/engine.log" || fail "engine did not verify version 2"
[ "$(grep -c "refused as expected" "$E2E_DIR/trainer0.log")" = 4 ] || fail "not every DTensor refusal was hit"
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: CPU DTensor phase"

# The real thing on GPUs: FSDP2 (fully_shard) over parallelize_module's TP on 4 GPUs (dp x tp =
# 2 x 2), FSDP2 alone on 2 or 3; NCCL between the trainer ranks, CUDA memory registered.
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
    W=2; [ "$NGPU" -ge 4 ] && W=4
    e2e_new_cluster fsdp2
    start_publisher 0 $W
    start_receiver 0 2
    "$PY" "$SCRIPT" engine --model-only --socket "$E2E_DIR/recv0.sock" > "$E2E_DIR/engine.log" 2>&1 &
    ENG=$!; E2E_PIDS="$E2E_PIDS $ENG"
    PORT=$(free_port)
    TR=""
    for r in $(seq 0 $((W - 1))); do
        NCCL_NVLS_ENABLE=0 "$PY" "$SCRIPT" fsdp2 --socket "$E2E_DIR/pub0.sock" --rank $r --world $W \
            --port "$PORT" > "$E2E_DIR/fsdp2-$r.log" 2>&1 &
        TR="$TR $!"; E2E_PIDS="$E2E_PIDS $!"
    done
    for p in $TR; do wait "$p" || fail "an FSDP2 trainer failed: $(tail -n 3 "$E2E_DIR"/fsdp2-*.log)"; done
    wait $ENG || fail "the FSDP2 phase's engine failed: $(tail -n 3 "$E2E_DIR/engine.log")"
    cat "$E2E_DIR"/fsdp2-*.log "$E2E_DIR/engine.log"
    grep -q "version 2 committed, .* 0 wrong" "$E2E_DIR/engine.log" || fail "engine did not verify FSDP2's version 2"
    st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    echo "ok: FSDP2 phase, $W GPUs"
else
    echo "FSDP2 phase skipped: $NGPU CUDA devices (needs 2; 4 for FSDP2 + TP)"
fi
echo "ok: DTensor trainers (1-D and dp x tp meshes, uneven shards, FSDP2 + TP module) -> plain tp=2 engine, 2 versions equal; Partial and 3 more refused"
