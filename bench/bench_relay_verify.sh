#!/bin/bash
# bench/bench_relay_verify.sh - what verification costs a refit with relays on the host path:
# one publisherd and RECEIVERS receiverds on loopback (relay = on), a trainer tp=1 and engine
# replicas tp=1,dp=RECEIVERS of MODEL, REFITS refits for each build in BUILDS, each path in
# PATHS and each verify in VERIFY. Paths: tcp (local_copy off: the replicas relay over tcp) and
# local (local_copy auto: every replica copies from the trainer's memory, nothing is relayed,
# as the planner never relays on a trainer's host). Per case: the median Start->Commit of refits
# 2..REFITS (the trainer's report; the first one plans and connects), the median data path of
# the slowest receiverd ("version N: moved B bytes in T s"), and the CPU seconds the daemons
# spent over all refits (utime + stime of the publisherd and of the receiverds, from /proc). The
# engines check every byte after each refit, outside the timed part (#wrong).
#
# Environment: BUILDS (build), PATHS ("tcp local"), VERIFY ("off sample full"), REFITS (6),
# RECEIVERS (4), MODEL (qwen3-0.6b), SIM_FLAGS for both simulated clients.
BUILDS=${BUILDS:-build}
BUILD=${BUILDS%% *}
. "$(dirname "$0")/../tests/e2e/lib.sh"
REFITS=${REFITS:-6} RECEIVERS=${RECEIVERS:-4} MODEL=${MODEL:-qwen3-0.6b}
VERIFY=${VERIFY:-off sample full} SIM_FLAGS=${SIM_FLAGS:-} PATHS=${PATHS:-tcp local}
E2E_PUBLISHERS=1 E2E_RECEIVERS=$RECEIVERS

# CPU seconds of the processes PID...: utime + stime, in clock ticks, over the ticks a second.
cpu_s() {
    local p t=0 hz
    hz=$(getconf CLK_TCK)
    for p in "$@"; do
        t=$((t + $(awk '{ print $14 + $15 }' "/proc/$p/stat")))
    done
    python3 -c "print('%.2f' % ($t / $hz))"
}

printf '%-16s %-6s %-7s %12s %10s %10s %8s %8s %8s\n' build path verify bytes commit_s path_s \
    pub_cpu recv_cpu wrong
for b in $BUILDS; do
    BIN=$(cd "$b" && pwd)
    for path in $PATHS; do
    for v in $VERIFY; do
        e2e_new_cluster "$(basename "$b")-$path-$v"
        [ "$path" = local ] && E2E_LOCAL_COPY=auto || E2E_LOCAL_COPY=off
        start_publisher 0 1 --relay on --verify "$v"
        for r in $(seq 0 $((RECEIVERS - 1))); do start_receiver $r 1 --relay on --verify "$v"; done
        for r in $(seq 0 $((RECEIVERS - 1))); do
            start_engine e$r $r --model "$MODEL" --layout "tp=1,dp=$RECEIVERS" --ranks $r \
                --versions "$REFITS" --timeout-ms 300000 $SIM_FLAGS
        done
        start_trainer tr 0 --model "$MODEL" --layout tp=1 --versions "$REFITS" \
            --timeout-ms 300000 --report $SIM_FLAGS
        wait_ok tr $(for r in $(seq 0 $((RECEIVERS - 1))); do echo e$r; done)
        pub=$(cpu_s "$PUB0_PID")
        recv=$(cpu_s $(for r in $(seq 0 $((RECEIVERS - 1))); do eval echo "\$RECV${r}_PID"; done))
        python3 - "$E2E_DIR" "$RECEIVERS" "$(basename "$b")" "$path" "$v" "$pub" "$recv" <<'PY'
import re, statistics, sys
d, n, build, path, verify, pub, recv = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
paths = {}
for r in range(n):
    for v, b, s in re.findall(r"version (\d+): moved (\d+) bytes in ([0-9.]+) s",
                              open("%s/recv%d.log" % (d, r)).read()):
        if int(v) >= 2:
            paths[int(v)] = max(paths.get(int(v), 0.0), float(s))
commit = [float(s) for v, s in re.findall(r"^refit (\d+) .* start->commit +([0-9.]+) s",
                                          open(d + "/tr.log").read(), re.M) if int(v) >= 2]
nbytes = re.findall(r"^refit 2 +(\d+) bytes", open(d + "/tr.log").read(), re.M)
wrong = 0
for r in range(n):
    wrong += sum(int(w) for w in re.findall(r"(\d+) wrong elements", open("%s/e%d.log" % (d, r)).read()))
if not commit or not paths:
    sys.exit("no warm refit in %s" % d)
print("%-16s %-6s %-7s %12s %10.4f %10.4f %8s %8s %8d" % (build, path, verify,
      nbytes[0] if nbytes else "?", statistics.median(commit), statistics.median(paths.values()),
      pub, recv, wrong))
PY
    done
    done
done
