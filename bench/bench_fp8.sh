#!/bin/bash
# bench/bench_fp8.sh - FP8 engines on the host path (issue 15) against bf16 engines of the same
# run: qwen3-0.6b (1.19 GB bf16), trainer tp=2 -> engine tp=4 on one host, one publisherd and
# one receiverd, verify off, the data path's time per refit as the receiverd logs it ("version
# N: moved B bytes in T s", plus "quantized on the receiver ... in T s" where trainer shards
# cut FP8 blocks), refits 2..REFITS (the first builds the plan and maps memory).
# Paths: local copies (local_copy auto: the receiverd quantizes while it copies) and TCP over
# loopback (local_copy off: the publisherd quantizes while it packs). Formats: bf16 (none),
# block (128x128). The engines check every byte after each refit, outside the timed part.
#
# Environment: BUILD (build), REFITS (6), FORMATS ("none block"), PATHS ("auto off"); MODEL
# (qwen3-0.6b), SRC (tp=2) and DST (tp=4) layouts with TRAINERS (2) and ENGINES (4) ranks;
# SIM_FLAGS for both simulated clients (GPU memory: "--device cuda:0 --cuda-vmm"; weights
# without the simulator's Inf/NaN/0/subnormal edge values: "--finite-weights"); CHECK=0
# passes --no-check to the engines (models too large to check on the host between refits);
# DAEMON_FLAGS for both daemons (on GPUs: "--transport nccl --refit-timeout-s 120"); SRC_FP8=1
# has the trainers hold their decoder layers in the same FP8 format (copied, not quantized).
. "$(dirname "$0")/../tests/e2e/lib.sh"
REFITS=${REFITS:-6}
MODEL=${MODEL:-qwen3-0.6b} SRC=${SRC:-tp=2} DST=${DST:-tp=4}
TRAINERS=${TRAINERS:-2} ENGINES=${ENGINES:-4} SIM_FLAGS=${SIM_FLAGS:-}
check=""
[ "${CHECK:-1}" = 0 ] && check=--no-check
FORMATS=${FORMATS:-none block}
PATHS=${PATHS:-auto off}
E2E_COMMON="${E2E_COMMON/--log-level info/--log-level info} --verify off ${DAEMON_FLAGS:-}"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1

printf '%-6s %-12s %12s %10s %10s %8s %10s\n' path format bytes median_s GB/s wrong commit_s
for path in $PATHS; do
    for fmt in $FORMATS; do
        e2e_new_cluster "$path-$fmt"
        E2E_LOCAL_COPY=$path
        start_publisher 0 "$TRAINERS"
        start_receiver 0 "$ENGINES"
        fp8=""
        [ "$fmt" != none ] && fp8="--fp8 $fmt"
        start_engine eng 0 --model "$MODEL" --layout "$DST" --versions "$REFITS" $fp8 $check \
            --timeout-ms 300000 $SIM_FLAGS
        src_fp8=""
        [ "$fmt" != none ] && [ "${SRC_FP8:-0}" = 1 ] && src_fp8="--fp8 $fmt"
        start_trainer tr 0 --model "$MODEL" --layout "$SRC" --versions "$REFITS" \
            --timeout-ms 300000 --report $src_fp8 $SIM_FLAGS
        wait_ok tr eng
        python3 - "$E2E_DIR/recv0.log" "$E2E_DIR/eng.log" "$path" "$fmt" "$E2E_DIR/tr.log" <<'PY'
import re, statistics, sys
log, eng, path, fmt, tr = sys.argv[1:6]
text = open(log).read()
post = {int(v): float(s) for v, s in
        re.findall(r"version (\d+): quantized on the receiver: .* in ([0-9.]+) s", text)}
runs = [(int(v), int(b), float(s) + post.get(int(v), 0.0)) for v, b, s in
        re.findall(r"version (\d+): moved (\d+) bytes in ([0-9.]+) s", text)]
warm = [r for r in runs if r[0] >= 2]
if not warm:
    sys.exit("no warm refit in %s" % log)
wrong = sum(int(w) for w in re.findall(r"(\d+) wrong elements", open(eng).read()))
med = statistics.median(r[2] for r in warm)
commit = [float(s) for v, s in re.findall(r"^refit (\d+) .* start->commit +([0-9.]+) s",
                                            open(tr).read(), re.M) if int(v) >= 2]
print("%-6s %-12s %12d %10.4f %10.2f %8d %10.4f" % ({"auto": "local", "off": "tcp"}[path], fmt,
                                                  warm[0][1], med, warm[0][1] / med / 1e9, wrong,
                                                  statistics.median(commit) if commit else 0))
PY
    done
done
