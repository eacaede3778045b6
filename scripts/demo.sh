#!/bin/bash
# make demo: a real refit between the daemons on this machine. A coordinator publisherd and a
# receiverd on loopback, simulated trainers (qwen3-0.6b, tp=2) and engines (tp=4) with the
# model's real tensor names and shapes, three refits with changing weights, every installed
# byte verified by the engines; then refitctl status and a clean shutdown.
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
 --receivers 1 --status-listen 127.0.0.1:0 --verify full"
ntr=$(echo "$SRC" | sed -n 's/.*tp=\([0-9]*\).*/\1/p'); ntr=${ntr:-1}
nen=$(echo "$DST" | sed -n 's/.*tp=\([0-9]*\).*/\1/p'); nen=${nen:-1}

echo "refit demo: $MODEL, trainers $SRC -> engines $DST, $VERSIONS refits over the host path"
echo "(no GPU data path yet on this build: bytes move over TCP on loopback)"
echo "work directory: $DIR"
"$BIN/refit-publisherd" $COMMON --coordinator --index 0 --clients "$ntr" \
    --socket "$DIR/publisherd.sock" > "$DIR/publisherd.log" 2>&1 &
PIDS="$PIDS $!"
"$BIN/refit-receiverd" $COMMON --index 0 --clients "$nen" \
    --socket "$DIR/receiverd.sock" > "$DIR/receiverd.log" 2>&1 &
PIDS="$PIDS $!"
"$BIN/refit-sim-engine" --socket "$DIR/receiverd.sock" --model "$MODEL" --layout "$DST" \
    --versions "$VERSIONS" > "$DIR/engines.log" 2>&1 &
ENG=$!
"$BIN/refit-sim-trainer" --socket "$DIR/publisherd.sock" --model "$MODEL" --layout "$SRC" \
    --versions "$VERSIONS" --report --hold $((VERSIONS + 1)) > "$DIR/trainers.log" 2>&1 &
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
if [ $TR -ne 0 ] || [ $EN -ne 0 ]; then
    echo "demo FAILED (trainers $TR, engines $EN); daemon logs in $DIR"
    exit 1
fi
echo "demo OK: $VERSIONS refits committed, every installed byte verified"
