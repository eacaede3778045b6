#!/bin/bash
# tests/e2e/67-fp8-relay.sh - relays of FP8 pieces (issue 15): engine replicas that serve FP8
# (qwen3-0.6b, engines tp=1,dp=3, one receiverd each, relay = on, verify = full) forward the
# FP8 bytes and scales they received to the next replica, in whole blocks. From bf16 trainers
# (tp=1: the publisherd quantizes for the first replica of each chunk) and from trainers that
# hold the same FP8 format; two refits each, every FP8 byte and scale of every replica checked
# against the reference, and the receiverds' sent bytes are the plan's relay bytes. Bad input:
# trainers tp=2 whose shards cut the engines' 96x96 blocks (quantized on the receiver, which
# happens only once the refit landed) cannot feed a relay: the plan is refused naming the
# tensor, and the clients give up.
. "$(dirname "$0")/lib.sh"
NR=3
M="--model qwen3-0.6b --shrink 8"
FLAGS="--relay on --verify full"

# relay_cluster NAME: a publisherd and NR receiverds, relays on.
relay_cluster() {
    e2e_new_cluster "$1"
    E2E_PUBLISHERS=1 E2E_RECEIVERS=$NR
    start_publisher 0 "${2:-1}" $FLAGS
    for r in $(seq 0 $((NR - 1))); do start_receiver $r 1 $FLAGS; done
}

# relay_case NAME SHRINK FORMAT [trainer flags]: FP8 replicas of FORMAT fed through relays.
relay_case() {
    local name=$1 m="--model qwen3-0.6b --shrink $2" fmt=$3 r ports="" out
    shift 3
    relay_cluster "$name"
    for r in $(seq 0 $((NR - 1))); do
        start_engine e$r $r $m --layout tp=1,dp=$NR --ranks $r --fp8 "$fmt" --versions 2 \
            --timeout-ms 60000
    done
    start_trainer tr 0 $m --layout tp=1 --versions 2 --retries 1 --timeout-ms 60000 "$@"
    wait_ok tr $(for r in $(seq 0 $((NR - 1))); do echo e$r; done)
    for r in $(seq 0 $((NR - 1))); do
        for v in 1 2; do
            grep -q "version $v committed after .*, 0 wrong elements$" "$E2E_DIR/e$r.log" ||
                fail "$name: engine e$r: version $v not verified with 0 wrong elements: $(tail -n 3 "$E2E_DIR/e$r.log" | tr '\n' ' ')"
        done
        ports="$ports $(status_port "$E2E_DIR/recv$r.log")"
    done
    # The receiverds sent, in two refits, twice the plan's relay bytes; some of them FP8.
    out=$(REFITCTL="$BIN/refitctl" python3 - "$E2E_DIR/pub0.sock" $ports <<'PY'
import json, os, re, subprocess, sys, urllib.request

st = json.loads(subprocess.run([os.environ["REFITCTL"], "status", "--socket", sys.argv[1],
                                "--json"], capture_output=True, text=True, check=True).stdout)
plan = st["cluster"]["plan"]
sent = 0
for port in sys.argv[2:]:
    text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=5).read().decode()
    for line in text.splitlines():
        mt = re.match(r'refit_bytes_total\{(.*)\} ([0-9.e+]+)$', line)
        if mt and dict(re.findall(r'(\w+)="([^"]*)"', mt.group(1))).get("direction") == "sent":
            sent += int(float(mt.group(2)))
if plan.get("relay_bytes", 0) <= 0 or sent != 2 * plan["relay_bytes"]:
    sys.exit("the receiverds sent %d bytes in 2 refits, the plan relays %s a refit" %
             (sent, plan.get("relay_bytes")))
print(plan["relay_messages"], plan["relay_bytes"], plan["dst_bytes"])
PY
) || fail "$name: $out"
    grep -q "fp8 $fmt: [1-9][0-9]* pieces FP8" "$E2E_DIR/e0.log" ||
        fail "$name: the engines registered no FP8 piece: $(grep fp8 "$E2E_DIR/e0.log")"
    read -r rmsgs rbytes dbytes <<< "$out"
    echo "ok: $name: $fmt replicas (dp=$NR) fed through relays ($rmsgs relay messages, $rbytes of $dbytes bytes a refit), 2 refits, every byte and scale of every replica verified"
}

T0=$(now_ms)
# 64-row blocks need shrink 2 (head_dim 64): a KV group of the trainers' interleaved linear_qkv
# is then whole blocks of rows (at shrink 8 its 16-row heads cut them: see the refusal below).
relay_case bf16-trainer 2 block:64x64
relay_case fp8-trainer 2 block:64x64 --fp8 block:64x64
relay_case mxfp8 8 mxfp8

# Trainers tp=2 cut the 96-row blocks of the engines' whole tensors: refused with relays on.
relay_cluster cut-blocks 2
for r in $(seq 0 $((NR - 1))); do
    start_engine e$r $r $M --layout tp=1,dp=$NR --ranks $r --fp8 block:96x96 --versions 1 \
        --timeout-ms 15000
done
start_trainer tr 0 $M --layout tp=2 --versions 1 --retries 0 --timeout-ms 15000
wait_for "$E2E_DIR/pub0.log" "the plan failed: plan: relays cannot forward FP8 tensor model\." 30
wait "$tr_PID" && fail "cut-blocks: the trainer exited 0 without a plan"
for r in $(seq 0 $((NR - 1))); do
    wait "$(eval echo "\$e${r}_PID")" && fail "cut-blocks: engine e$r exited 0 without a plan"
done
echo "ok: cut-blocks refused: $(grep -m1 -o "the plan failed: .*" "$E2E_DIR/pub0.log" | cut -c1-160)"
echo "ok: FP8 relays, $(( ($(now_ms) - T0) / 1000 )) s"
