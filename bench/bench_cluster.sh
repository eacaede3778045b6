#!/bin/bash
# bench/bench_cluster.sh - what a multi-node refit costs on a cluster of network namespaces on
# this machine (issue #14 part 3; scripts/netns.sh): each daemon and its simulated clients on a
# "node" of its own, one veth per node to a bridge, a token bucket of RATE on both ends of every
# veth (so each node has RATE up and RATE down), transport tcp over host memory. Needs root.
#
# Case "transfer": PUBLISHERS publisherds and RECEIVERS receiverds, trainers SRC and engines
# DST of MODEL, trainer ranks spread evenly over the publishers and engine ranks over the
# receivers. REFITS refits, each published only once the last one was committed and every
# engine verified it (so no refit shares the CPUs with the clients' fill and check). Per refit:
#   measured  Start -> Commit at the coordinator (its status, last_refit.start_to_commit_s)
#   floor     the network's ingress floor: the most bytes any receiver took in (what its
#             /metrics count as received in the refit: refit_bytes_total{direction="received"};
#             a relaying receiver's forwarded bytes leave it, they are not ingress) / RATE
#   predicted refitctl plan --explain with the same model, layouts, staging and direct size, at
#             RATE per GPU with one GPU per node (RATE divided among a node's GPUs otherwise),
#             printed above the table
# and the ratio measured/floor; "pub Gbit/s" is what the busiest publisher's link passed during
# the refit (tc's byte counter, headers included) over the measured time. #wrong: elements the
# engines found wrong (every installed byte is checked).
#
# Case "control": CTL_PUBLISHERS + CTL_RECEIVERS daemons (10+), a tiny model (CTL_MODEL; by
# default a dense qwen3 of 28 layers and 311 tensors as qwen3-0.6b, in 147 KiB, so that moving
# the bytes costs little beside the control messages; src tp=CTL_PUBLISHERS, one trainer rank per publisher; dst tp=1,dp=CTL_RECEIVERS, one engine per
# receiver), CTL_REFITS refits of which the first CTL_WARMUP are dropped: median, p90 and max
# of Start -> Commit and of the control part (Start -> Commit minus the slowest data path).
#
# Not run by `make bench` (it takes minutes and root): run it as
#   BENCH_CLUSTER=1 BUILD=build bench/bench_cluster.sh
# Environment (defaults): CASES ("transfer control"), PUBLISHERS (1), RECEIVERS (4), RATE (2gbit,
# tc's units), MODEL (qwen3-0.6b, or a JSON spec), SHRINK (none; refitctl plan cannot shrink,
# so there is no prediction then), SRC (tp=1), DST (tp=1,dp=RECEIVERS), REFITS (3), CTL_PUBLISHERS
# (2), CTL_RECEIVERS (8), CTL_MODEL (that spec; a name or file, then sim flags such as
# --shrink), CTL_RATE (RATE), CTL_REFITS (30),
# CTL_WARMUP (5), DAEMON_CONF (extra "key = value" lines for every daemon's config file, e.g.
# DAEMON_CONF='relay = on'), PLAN_FLAGS (extra flags for the prediction's refitctl plan, e.g.
# --relay with relaying daemons), KEEP=1 keeps the logs (E2E_KEEP).
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.." || exit 1
if [ -z "${BENCH_CLUSTER:-}" ]; then
    echo "bench_cluster: skipped (it needs root and takes minutes): run BENCH_CLUSTER=1 BUILD=$BUILD bench/bench_cluster.sh, or make bench BENCH_CLUSTER=1"
    exit 0
fi
for b in refit-publisherd refit-receiverd refit-sim-trainer refit-sim-engine refitctl; do
    [ -x "$BUILD/$b" ] || { echo "bench_cluster: $BUILD/$b is missing; run 'make BUILD=$BUILD all'" >&2; exit 1; }
done
CASES=${CASES:-"transfer control"}
PUBLISHERS=${PUBLISHERS:-1} RECEIVERS=${RECEIVERS:-4} RATE=${RATE:-2gbit}
MODEL=${MODEL:-qwen3-0.6b} SHRINK=${SHRINK:-} SRC=${SRC:-tp=1} DST=${DST:-tp=1,dp=$RECEIVERS}
REFITS=${REFITS:-3}
CTL_PUBLISHERS=${CTL_PUBLISHERS:-2} CTL_RECEIVERS=${CTL_RECEIVERS:-8}
CTL_MODEL=${CTL_MODEL:-} CTL_RATE=${CTL_RATE:-$RATE}
CTL_REFITS=${CTL_REFITS:-30} CTL_WARMUP=${CTL_WARMUP:-5}
export DAEMON_CONF=${DAEMON_CONF:-}
[ -n "${KEEP:-}" ] && export E2E_KEEP=1
. tests/e2e/lib.sh
. scripts/netns.sh
if ! nc_available; then
    echo "bench_cluster: cannot build the cluster: $NC_WHY" >&2
    exit 1
fi
# Each refit-sim client waits this long for one version; a refit of a large model at a low
# rate takes minutes.
CLIENT_TIMEOUT_MS=1800000

# bc_world LAYOUT-SIDE: the world size of the trainer (src) or engine (dst) layout, as refitctl
# plan reads it.
bc_worlds() {
    "$BIN/refitctl" plan --model "$1" --src "$2" --dst "$3" 2>&1 |
        sed -n 's/^layouts .*(\([0-9]*\) GPUs) -> .*(\([0-9]*\) GPUs).*/\1 \2/p'
}

# bc_status V NP SOCKETS...: one line for refit V from the daemons' status (the first NP sockets
# are the publishers', the coordinator's first, then the receivers'): bytes transfer_s
# start_to_commit_s max_receiver_bytes max_publisher_bytes (what the busiest receiverd and
# publisherd moved over the network; a relaying receiverd's count holds what it sent too, so
# bc_cluster replaces the receivers' figure with what they received); fails unless the coordinator's last refit is V, committed.
bc_status() {
    REFITCTL="$BIN/refitctl" python3 -S - "$@" <<'PY'
import json, os, subprocess, sys

v, np, socks = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]


def status(sock):
    p = subprocess.run([os.environ["REFITCTL"], "status", "--socket", sock, "--json"],
                       capture_output=True, text=True, timeout=10)
    if p.returncode != 0:
        sys.exit("bench_cluster: refitctl status --socket %s: %s" % (sock, p.stderr.strip()))
    return json.loads(p.stdout)


cl = status(socks[0])["cluster"]["last_refit"]
if (cl["version"], cl["result"]) != (v, "committed"):
    sys.exit("bench_cluster: the coordinator's last refit is %s %s, not %d committed"
             % (cl["version"], cl["result"], v))
rx = tx = 0
for i, s in enumerate(socks):
    lr = status(s)["last_refit"]
    if lr["version"] != v:
        sys.exit("bench_cluster: %s's last refit is %s, not %d" % (s, lr["version"], v))
    if i < np:
        tx = max(tx, lr["paths"]["network"]["bytes"])
    else:
        rx = max(rx, lr["paths"]["network"]["bytes"])
print(cl["bytes"], repr(cl["transfer_s"]), repr(cl["start_to_commit_s"]), rx, tx)
PY
}

# bc_wrong NAME V: elements engine NAME found wrong in version V (or "?" without its line).
bc_wrong() {
    sed -n "s/.*version $2 committed after .*, \([0-9]*\) wrong elements.*/\1/p" "$E2E_DIR/$1.log" |
        head -n 1 | grep . || echo "?"
}

# bc_cluster NAME P R RATE MODEL-ARGS SRC DST REFITS: a fresh cluster (namespaces, daemons,
# clients), REFITS refits one at a time; appends per refit "v bytes transfer_s commit_s rx_max
# pub_link_bytes wrong" to $E2E_DIR/rows.txt.
bc_cluster() {
    local name=$1 np=$2 nr=$3 rate=$4 margs=$5 src=$6 dst=$7 refits=$8
    local model=${margs%% *} worlds ws wd sp rp i a b v link0 link1 lmax row wrong w n socks
    local rx0 rx1 rxmax n0
    worlds=$(bc_worlds "$model" "$src" "$dst")
    ws=${worlds% *} wd=${worlds#* }
    [ -n "$worlds" ] || fail "refitctl plan does not take model $model, src $src, dst $dst"
    [ $((ws % np)) = 0 ] && [ $((wd % nr)) = 0 ] ||
        fail "$ws trainer ranks over $np publishers or $wd engine ranks over $nr receivers do not divide evenly"
    sp=$((ws / np)) rp=$((wd / nr))
    e2e_stop $E2E_PIDS
    E2E_PIDS=""
    nc_cleanup
    E2E_DIR=$E2E_ROOT/$name
    mkdir -p "$E2E_DIR"
    nc_setup "$np" "$nr" "$rate"
    for ((i = 0; i < np; i++)); do nc_start_daemon pub $i $sp; done
    for ((i = 0; i < nr; i++)); do nc_start_daemon recv $i $rp; done
    echo 0 > "$E2E_DIR/gate"
    for ((i = 0; i < nr; i++)); do
        a=$((i * rp)) b=$((i * rp + rp - 1))
        nc_start_client engine e$i $i --model $margs --layout "$dst" --ranks $a-$b --versions "$refits" \
            --timeout-ms $CLIENT_TIMEOUT_MS
    done
    for ((i = 0; i < np; i++)); do
        a=$((i * sp)) b=$((i * sp + sp - 1))
        nc_start_client trainer t$i $i --model $margs --layout "$src" --ranks $a-$b --versions "$refits" \
            --timeout-ms $CLIENT_TIMEOUT_MS --publish-when "$E2E_DIR/gate"
    done
    socks=""
    for ((i = 0; i < np; i++)); do socks="$socks $E2E_DIR/pub$i.sock"; done
    for ((i = 0; i < nr; i++)); do socks="$socks $E2E_DIR/recv$i.sock"; done
    st_wait "$E2E_DIR/pub0.sock" 60 "every member joined with its clients and the plan built" \
        "len(cl['members']) == $((np + nr)) and all(x['connected'] and x['inventory_complete']
for x in cl['members']) and cl['plan']['ready']"
    : > "$E2E_DIR/rows.txt"
    for ((v = 1; v <= refits; v++)); do
        link0=$(bc_pub_link_max "$np")
        rx0=$(bc_recv_bytes "$nr")
        echo $v > "$E2E_DIR/gate"
        wait_for "$E2E_DIR/pub0.log" "refit $v committed" $((CLIENT_TIMEOUT_MS / 1000))
        link1=$(bc_pub_link_max "$np")
        row=$(bc_status $v $np $socks 2>&1) || fail "$row"
        wrong=0
        for ((i = 0; i < nr; i++)); do
            wait_for "$E2E_DIR/e$i.log" "version $v committed after" 600
            w=$(bc_wrong e$i $v)
            [ "$w" = "?" ] && w=1
            wrong=$((wrong + w))
        done
        # The floor's bytes: the most one receiverd took in during this refit (read once its
        # engines saw the commit, so its counters are in).
        rx1=$(bc_recv_bytes "$nr")
        rxmax=0
        for n in $rx1; do
            a=${n%:*} b=${n#*:}
            for n0 in $rx0; do [ "${n0%:*}" = "$a" ] && b=$((b - ${n0#*:})); done
            [ $b -gt $rxmax ] && rxmax=$b
        done
        [ $rxmax -gt 0 ] || fail "no receiverd counted bytes received in refit $v (its /metrics)"
        row=$(echo "$row" | awk -v rx=$rxmax '{$4 = rx; print}')
        lmax=0
        for n in $link1; do
            a=${n%:*} b=${n#*:}
            for n0 in $link0; do [ "${n0%:*}" = "$a" ] && b=$((b - ${n0#*:})); done
            [ $b -gt $lmax ] && lmax=$b
        done
        echo "$v $row $lmax $wrong" >> "$E2E_DIR/rows.txt"
    done
    wait_ok $(for ((i = 0; i < np; i++)); do echo t$i; done) $(for ((i = 0; i < nr; i++)); do echo e$i; done)
}

# bc_recv_bytes NR: "index:bytes" of the payload bytes each receiverd received so far (its
# /metrics, summed over peers).
bc_recv_bytes() {
    local i
    for ((i = 0; i < $1; i++)); do
        echo "$i:$(nc_metric recv $i 'refit_bytes_total\{.*direction="received".*\}' |
            python3 -S -c 'import sys; print(int(sum(float(x) for x in sys.stdin.read().split())))')"
    done
}

# bc_pub_link_max NP: "index:bytes" of each publisher's uplink counter.
bc_pub_link_max() {
    local i
    for ((i = 0; i < $1; i++)); do echo "$i:$(nc_tc_bytes pub $i up)"; done
}

bc_transfer() {
    local margs=$MODEL plan_args rate_bits gpn pj pred="" gbps
    [ -n "$SHRINK" ] && margs="$MODEL --shrink $SHRINK"
    rate_bits=$(nc_rate_bits "$RATE") || exit 1
    echo "== transfer: $PUBLISHERS publisher(s) -> $RECEIVERS receivers, $RATE each way per node, \
$margs $SRC -> $DST, transport tcp, host memory, $REFITS refits${DAEMON_CONF:+, config: $DAEMON_CONF}"
    bc_cluster transfer "$PUBLISHERS" "$RECEIVERS" "$RATE" "$margs" "$SRC" "$DST" "$REFITS"
    if [ -z "$SHRINK" ]; then
        # The planner's links are per GPU; a node's link is shared by its engine GPUs.
        gpn=$(( $(bc_worlds "$MODEL" "$SRC" "$DST" | cut -d' ' -f2) / RECEIVERS ))
        gbps=$(python3 -S -c "print($rate_bits / 1e9 / $gpn)")
        plan_args="--model $MODEL --src $SRC --dst $DST --link-gbps $gbps --gpus-per-node $gpn \
--staging-mib 256 --direct-min-mib 1${PLAN_FLAGS:+ $PLAN_FLAGS}"
        echo "planner: refitctl plan $plan_args --explain"
        if pj=$("$BIN/refitctl" plan $plan_args --json 2>&1); then
            # The summary, with the floor and relay lines of a planner that has them.
            "$BIN/refitctl" plan $plan_args --explain | sed -n '/^per sender/,/^plan id/p' |
                grep -v '^plan id' | sed 's/^/  /'
            pred=$(echo "$pj" | python3 -S -c 'import json,sys; print(json.load(sys.stdin)["predicted_seconds"])')
        else
            echo "  no prediction: refitctl plan failed: $pj"
        fi
    else
        echo "planner: no prediction (refitctl plan has no --shrink; give MODEL as a JSON spec instead)"
    fi
    python3 -S - "$E2E_DIR/rows.txt" "$rate_bits" "${pred:-}" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
rate = float(sys.argv[2]) / 8
pred = float(sys.argv[3]) if sys.argv[3] else None
print("%5s %14s %14s %10s %10s %9s %13s %15s %13s %11s %6s" % (
    "refit", "bytes", "max rx bytes", "transfer", "measured", "floor", "measured/floor",
    "measured/predicted", "measured/egress", "pub Gbit/s", "#wrong"))
egress = 0
for v, b, xfer, commit, rx, tx, link, wrong in rows:
    commit, floor = float(commit), int(rx) / rate
    egress = int(tx) / rate
    print("%5s %14s %14s %9.3fs %9.3fs %8.3fs %13.2fx %15s %12.2fx %11.3f %6s" % (
        v, b, rx, float(xfer), commit, floor, commit / floor,
        "%.2fx" % (commit / pred) if pred else "-", commit / egress,
        int(link) * 8 / commit / 1e9, wrong))
print("egress bound %.3f s: the most bytes one publisher sends / the rate (measured/egress: how "
      "close the refit came to it)" % egress)
if pred:
    print("predicted %.3f s (the planner's, at %g Gbit/s per node)" % (pred, float(sys.argv[2]) / 1e9))
PY
    if grep -q ' [1-9][0-9]*$' "$E2E_DIR/rows.txt"; then fail "engines found wrong bytes (see #wrong)"; fi
}

bc_control() {
    local label=$CTL_MODEL
    if [ -z "$CTL_MODEL" ]; then
        CTL_MODEL=$E2E_ROOT/tiny-qwen3.json
        label="tiny-qwen3 (a qwen3 spec of 28 layers, 311 tensors, 147 KiB)"
        echo '{"model_type": "qwen3", "name": "tiny-qwen3", "hidden_size": 16,
"num_hidden_layers": 28, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
"intermediate_size": 32, "vocab_size": 64, "tie_word_embeddings": false,
"torch_dtype": "bfloat16"}' > "$CTL_MODEL"
    fi
    echo "== control: $CTL_PUBLISHERS publishers + $CTL_RECEIVERS receivers ($((CTL_PUBLISHERS + \
CTL_RECEIVERS)) daemons), $label tp=$CTL_PUBLISHERS -> tp=1,dp=$CTL_RECEIVERS, $CTL_RATE each \
way per node, $CTL_REFITS refits (first $CTL_WARMUP dropped)${DAEMON_CONF:+, config: $DAEMON_CONF}"
    bc_cluster control "$CTL_PUBLISHERS" "$CTL_RECEIVERS" "$CTL_RATE" "$CTL_MODEL" \
        "tp=$CTL_PUBLISHERS" "tp=1,dp=$CTL_RECEIVERS" "$CTL_REFITS"
    python3 -S - "$E2E_DIR/rows.txt" "$CTL_WARMUP" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])][int(sys.argv[2]):]


def q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


commit = [float(r[3]) * 1e3 for r in rows]
ctl = [(float(r[3]) - float(r[2])) * 1e3 for r in rows]
xfer = [float(r[2]) * 1e3 for r in rows]
print("%-26s %9s %9s %9s   (%d refits, %s bytes each)" % ("ms", "median", "p90", "max",
                                                         len(rows), rows[0][1]))
for name, xs in (("Start -> Commit", commit), ("data path (slowest)", xfer),
                 ("control (difference)", ctl)):
    print("%-26s %9.3f %9.3f %9.3f" % (name, q(xs, 0.5), q(xs, 0.9), max(xs)))
print("#wrong %d" % sum(int(r[-1]) for r in rows))
PY
    if grep -q ' [1-9][0-9]*$' "$E2E_DIR/rows.txt"; then fail "engines found wrong bytes"; fi
}

echo "bench_cluster: $(nproc) CPUs, $(uname -r), $(date -u +%Y-%m-%dT%H:%MZ)"
for c in $CASES; do
    case $c in
        transfer) bc_transfer ;;
        control) bc_control ;;
        *) fail "unknown case '$c' in CASES (transfer, control)" ;;
    esac
done
