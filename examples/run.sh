#!/bin/bash
# examples/run.sh - the example end to end on this machine: a publisherd and a receiverd on
# loopback (host memory; both on one host, so the receiverd copies straight from the trainer's
# arena: local_copy = auto, the default), a trainer (trainer.py: AdamW steps, HF names, bf16
# weights published) and an engine (engine.py: vLLM's fused buffers, tp ranks), N versions.
# Prints per version the trainer's loss, the engine's greedy tokens and whether the logits are
# equal bit for bit; exits 0 only when every version's are (the engine exits 1 otherwise).
#   examples/run.sh [VERSIONS]      env: BUILD (build dir, default build), PYTHON, TP (2),
#                                   SHRINK (8), ENGINE_ARGS (more engine.py flags), KEEP=1
#                                   keeps the work directory (kept on failure), TMPDIR,
#                                   DEVICE (cpu; cuda:N: the GPU mode, below)
# DEVICE=cuda:N: both processes on that GPU (colocated), the trainer HF transformers'
# Qwen3ForCausalLM under FSDP2, the engine's buffers CUDA tensors that transformers' forward
# pass reads through views; the daemons move bytes with transport = nccl (every byte a
# same-GPU copy, local_copy = auto).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
BUILD=${BUILD:-build}
case $BUILD in /*) BIN=$BUILD ;; *) BIN=$ROOT/$BUILD ;; esac
VERSIONS=${1:-3}
PY=${PYTHON:-python3}
if [ ! -x "$BIN/refit-publisherd" ] || [ ! -f "$BIN/librefit.so" ]; then
    echo "examples/run.sh: no refit-publisherd or librefit.so in $BIN; build with" \
         "\`make BUILD=$BUILD all\` or set BUILD to your build directory" >&2
    exit 2
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "examples/run.sh: $PY cannot import torch; install python3-torch (scripts/deps.sh)" \
         "or set PYTHON to a python3 that has it" >&2
    exit 2
fi
DEVICE=${DEVICE:-cpu}
if [ "$DEVICE" != cpu ]; then
    if ! "$PY" -c '
import sys, torch, transformers
from transformers import Qwen3ForCausalLM
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard
sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "examples/run.sh: DEVICE=$DEVICE needs a $PY with CUDA torch (FSDP2's fully_shard)" \
             "and HF transformers (Qwen3ForCausalLM); unset DEVICE for the CPU example" >&2
        exit 2
    fi
    export NCCL_NVLS_ENABLE=0
fi
export REFIT_LIB=$BIN/librefit.so
DIR=$(mktemp -d "${TMPDIR:-/tmp}/refit-example.XXXXXX")
PIDS=""
cleanup() {
    for p in $PIDS; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    if [ -n "${KEEP:-}" ]; then echo "work directory kept: $DIR"; else rm -rf "$DIR"; fi
}
trap cleanup EXIT
die() {
    KEEP=1
    echo "examples/run.sh: $*" >&2
    for f in "$DIR"/*.log; do echo "--- $f" >&2; tail -n 20 "$f" >&2; done
    exit 1
}

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/cluster.key"
chmod 600 "$DIR/cluster.key"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
COMMON="--cluster-key-file $DIR/cluster.key --coordinator-addr 127.0.0.1:$PORT
 --publishers 1 --receivers 1 --status-listen 127.0.0.1:0"
[ "$DEVICE" != cpu ] && COMMON="$COMMON --transport nccl"
"$BIN/refit-publisherd" $COMMON --coordinator --index 0 --clients 1 \
    --socket "$DIR/publisherd.sock" > "$DIR/publisherd.log" 2>&1 &
PIDS="$PIDS $!"
"$BIN/refit-receiverd" $COMMON --index 0 --clients "${TP:-2}" \
    --socket "$DIR/receiverd.sock" > "$DIR/receiverd.log" 2>&1 &
PIDS="$PIDS $!"
ARGS="--dir $DIR --versions $VERSIONS --shrink ${SHRINK:-8}"
WHERE=""
if [ "$DEVICE" != cpu ]; then
    ARGS="$ARGS --device $DEVICE"
    WHERE=" (on $DEVICE: transformers + FSDP2 trainer, HF forward on the engine's buffers)"
fi
"$PY" "$HERE/engine.py" --socket "$DIR/receiverd.sock" --tp "${TP:-2}" $ARGS \
    ${ENGINE_ARGS:-} > "$DIR/engine.log" 2>&1 &
ENG=$!
PIDS="$PIDS $ENG"
"$PY" "$HERE/trainer.py" --socket "$DIR/publisherd.sock" $ARGS > "$DIR/trainer.log" 2>&1 &
TRN=$!
PIDS="$PIDS $TRN"
# The engine exits after the last version, the trainer once that version is released; when
# either fails the other would wait for it until its timeout, so whichever ends first is
# checked at once.
name_of() { [ "$1" = $ENG ] && echo engine || echo trainer; }
check_exit() {
    [ "$2" = 0 ] || die "the $(name_of "$1") failed (exit $2); the ends of its log and the" \
        "others' follow, all are kept in $DIR"
}
wait -n -p first $ENG $TRN
check_exit "$first" $?
second=$ENG; [ "$first" = $ENG ] && second=$TRN
wait "$second"
check_exit "$second" $?
grep -h "registered\|: qwen\|: transformers" "$DIR/trainer.log" "$DIR/engine.log"
grep "^version" "$DIR/engine.log"
grep -o "version [0-9]*: moved .*" "$DIR/receiverd.log" | sed 's/^/receiverd: /'
echo "ok: $VERSIONS versions refit from the trainer (hf) to the engine (vllm tp=${TP:-2});" \
     "logits equal bit for bit after each$WHERE"
