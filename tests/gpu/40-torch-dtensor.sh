#!/bin/bash
# tests/gpu/40-torch-dtensor.sh - refit.torch with DTensors (issue #13): 4 trainer ranks of
# torch.distributed (gloo, CPU tensors in memfd arenas: no GPU needed) hold DTensors on a 1-D
# mesh (Shard(0), Shard(1), Replicate, uneven and empty last shards) and a 2-D dp x tp mesh
# (FSDP2 + TP placements, a module with HF names registered by register_module "hf"); an
# engine of 2 clients holds the same weights split differently in plain tensors. 2 versions,
# every engine tensor compared with torch.equal against the full weights; rank 0 checks the
# refusals (Partial first). Skips without a torch that has DTensor (torch >= 2.2).
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
echo "ok: DTensor trainers (1-D and dp x tp meshes, uneven shards, FSDP2 + TP module) -> plain tp=2 engine, 2 versions equal; Partial and 3 more refused"
