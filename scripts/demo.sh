#!/bin/bash
# make demo: a real refit between the daemons on this machine. A coordinator publisherd and a
# receiverd on loopback, simulated trainers (qwen3-0.6b, tp=2) and engines (tp=4) with the
# model's real tensor names and shapes, three refits with changing weights, every installed
# byte verified by the engines; then refitctl status and a clean shutdown. The daemons are on
# one host, so the receiverd copies straight from the trainers' memory (local_copy = auto): on
# a machine with a GPU (and a CUDA build) trainers and engines are colocated on GPU 0, as in
# colocated RL; elsewhere they use host memory. DEMO_DEVICE=host forces host memory.
set -u
BUILD=${BUILD:-build}
BIN=$(cd "$BUILD" && pwd)
MODEL=${DEMO_MODEL:-qwen3-0.6b}
SRC=${DEMO_SRC:-tp=2}
DST=${DEMO_DST:-tp=4}
VERSIONS=${DEMO_VERSIONS:-3}
DIR=$(mktemp -d /tmp/refit-demo.XXXXXX)
PIDS=""

cleanup() {
    for p in $PIDS; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
}
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/cluster.key"
chmod 600 "$DIR/cluster.key"
COORD=127.0.0.1:$(port)
COMMON="--cluster-key-file $DIR/cluster.key --coordinator-addr $COORD --publishers 1
 --receivers 1 --status-listen 127.0.0.1:0"
DEVICE=${DEMO_DEVICE:-}
if [ -z "$DEVICE" ]; then
    DEVICE=host
    if nvidia-smi -L >/dev/null 2>&1 && ldd "$BIN/refit-publisherd" 2>/dev/null | grep -q libnccl; then
        DEVICE=cuda:0
    fi
fi
if [ "$DEVICE" != host ]; then
    COMMON="$COMMON --transport nccl"
    export NCCL_NVLS_ENABLE=0
fi
ntr=$(echo "$SRC" | sed -n 's/.*tp=\([0-9]*\).*/\1/p'); ntr=${ntr:-1}
nen=$(echo "$DST" | sed -n 's/.*tp=\([0-9]*\).*/\1/p'); nen=${nen:-1}

if [ "$DEVICE" = host ]; then
    echo "refit demo: $MODEL, trainers $SRC -> engines $DST, $VERSIONS refits in host memory"
else
    echo "refit demo: $MODEL, trainers $SRC -> engines $DST, $VERSIONS refits, trainers and engines"
    echo "colocated on $DEVICE ($(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null))"
fi
echo "work directory: $DIR"
"$BIN/refit-publisherd" $COMMON --coordinator --index 0 --clients "$ntr" \
    --socket "$DIR/publisherd.sock" > "$DIR/publisherd.log" 2>&1 &
PIDS="$PIDS $!"
"$BIN/refit-receiverd" $COMMON --index 0 --clients "$nen" \
    --socket "$DIR/receiverd.sock" > "$DIR/receiverd.log" 2>&1 &
PIDS="$PIDS $!"
"$BIN/refit-sim-engine" --socket "$DIR/receiverd.sock" --model "$MODEL" --layout "$DST" \
    --device "$DEVICE" --versions "$VERSIONS" > "$DIR/engines.log" 2>&1 &
ENG=$!
"$BIN/refit-sim-trainer" --socket "$DIR/publisherd.sock" --model "$MODEL" --layout "$SRC" \
    --device "$DEVICE" --versions "$VERSIONS" --report --hold $((VERSIONS + 1)) > "$DIR/trainers.log" 2>&1 &
TRP=$!
PIDS="$PIDS $TRP"
# The engines verify every version; the trainers stay registered (holding the next version's
# weights, unpublished) so that the status below shows the whole cluster.
wait $ENG
EN=$?
TR=0
grep -q "holding weights" "$DIR/trainers.log" || TR=1
echo
echo "== trainers"
grep -v "holding weights" "$DIR/trainers.log"
echo "== engines"
cat "$DIR/engines.log"
echo
echo "== refitctl status (coordinator)"
"$BIN/refitctl" --socket "$DIR/publisherd.sock" status
echo
echo "== the receiverd's last refit, by path"
"$BIN/refitctl" --socket "$DIR/receiverd.sock" status --json | python3 -c '
import json, sys
s = json.load(sys.stdin)
for name, p in s["last_refit"]["paths"].items():
    gbs = p["bytes"] / p["seconds"] / 1e9 if p["seconds"] > 0 else 0
    what = "same-host copies" if name == "local" else "transport"
    print("  %-8s %-18s %12d bytes in %.4f s (%.2f GB/s)" % (name, what, p["bytes"], p["seconds"], gbs))'
echo
if [ $TR -ne 0 ] || [ $EN -ne 0 ]; then
    echo "demo FAILED (trainers $TR, engines $EN); daemon logs in $DIR"
    exit 1
fi
echo "demo OK: $VERSIONS refits committed, every installed byte verified"
