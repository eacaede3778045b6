#!/bin/bash
# bench/bench_control.sh - control-plane benchmark: refits of models made of tiny tensors
# (~1k, ~10k, ~100k of them, 128 bytes or less each), so that moving bytes costs next to
# nothing and what is left is the per-refit control overhead. Once the plan is cached, that
# overhead must not grow with the tensor count (DESIGN.md: "a refit with an unchanged plan costs
# O(1) control messages per daemon, whatever the tensor count").
#
# Per size: one coordinator refit-publisherd and one refit-receiverd on loopback (transport tcp,
# or nccl with TRANSPORT=nccl: trainer on GPU 0, engine on GPU 1; verify off), one
# refit-sim-trainer (tp=1) and one refit-sim-engine (tp=1, checks every byte of every
# version), REFITS refits of which the first WARMUP are discarded (plan build, connection
# set-up, first mappings); LAUNCHES such runs, each with fresh processes, pooled (where the
# scheduler places the processes differs between launches and moved the 1k median between 0.15
# and 0.25 ms on the 2-core VM). After each release the driver reads the coordinator's status
# over its local socket (the same call as `refit-sim-trainer --report`, full precision) and
# the receiverd's; a refit whose successor committed before that read is not measured (the
# table says how many were; at least 80% must be).
#
#   control overhead = cluster.last_refit.start_to_commit_s - cluster.last_refit.transfer_s
#     (Start broadcast to Commit at the coordinator, minus the slowest daemon's data path)
#   trainer overhead = publish -> release seen by the trainer - transfer_s
#     (the trainer prints it with ms resolution only)
#
# Refit cadence. Each size runs for each entry of STEPS, a training step in ms that the
# trainer waits after each release before it writes and publishes the next version, as an RL
# loop does. With a step, every size sees the daemons asleep for the same time before Start,
# so the tensor count is the only thing that changes between sizes. Back to back (step 0) the
# refit cycle itself grows with the tensor count (quorum and transfer: ~1 ms at 1k, ~75 ms at
# 100k on the 2-core VM, mostly the simulators' CPU fill and check, then the host data path),
# and so does the cost of waking a daemon that slept that long (on the 2-core VM a socket
# round trip took 16-22 us between busy processes and 60-80 us after the reader slept 5-50 ms;
# bench/RESULTS.md). That table is printed for comparison; its ratio is not judged.
#
# Targets (issue "control-plane benchmark"): median control overhead <= 5 ms at every size and
# cadence; with a training step, median(100k) / median(1k) <= 1.5; #wrong (elements the engine
# found wrong) must be 0.
#
# Environment: BUILD (default build), TRANSPORT (tcp), STEPS ("100 0"), LAUNCHES (3), REFITS
# (20 per launch), WARMUP (5 per launch), SIZES ("1k 10k 100k"), PIN (1: each daemon on cores
# of its own, see below), PUB_FLAGS (added to the coordinator's flags), NICE (prefix of the
# simulated clients, "nice -n 19"), KEEP=1 keeps the work directory with the daemons' logs
# (kept anyway on failure), WRAP is a command prefix for both daemons, {out} standing for the
# log's path without .log (to profile:
# WRAP='perf record -g -o {out}.perf --' KEEP=1 SIZES=100k).
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.."
BIN=$(cd "$BUILD" 2>/dev/null && pwd) || { echo "bench_control: no build directory $BUILD" >&2; exit 1; }
for b in refit-publisherd refit-receiverd refit-sim-trainer refit-sim-engine refitctl librefit.so; do
    [ -e "$BIN/$b" ] || { echo "bench_control: $BIN/$b is missing; run 'make BUILD=$BUILD all'" >&2; exit 1; }
done
export BIN TRANSPORT=${TRANSPORT:-tcp} STEPS=${STEPS:-"100 0"} LAUNCHES=${LAUNCHES:-3}
export REFITS=${REFITS:-20} WARMUP=${WARMUP:-5} SIZES=${SIZES:-"1k 10k 100k"} KEEP=${KEEP:-}
export WRAP=${WRAP:-}
export REFIT_LIB="$BIN/librefit.so" PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -u - <<'PY'
import json, os, re, shutil, signal, socket, statistics, subprocess, sys, tempfile, time

import refit

BIN = os.environ["BIN"]
REFITS = int(os.environ["REFITS"])
LAUNCHES = int(os.environ["LAUNCHES"])
WARMUP = int(os.environ["WARMUP"])
KEEP = bool(os.environ["KEEP"])
WRAP = os.environ.get("WRAP", "")
# qwen3_moe with tiny dims: per layer q/k/v/o, q/k norms, 2 layer norms, the router and 3 tensors
# per expert (9 + 3 * 30 = 99), plus embed, final norm and lm_head. Dense qwen3 has 11 tensors a
# layer and at most 4096 layers (45,059 tensors), short of 100k; the experts get there with the
# same tensor mix at every size, only the layer count changes.
SIZES = {"1k": 10, "10k": 100, "100k": 1000}
EXPERTS = 30
# The simulated clients fill and check every tensor on the CPU (100k tensors: ~50 ms each way),
# work that real trainers and engines do on their GPUs; at nice 19 it does not hold the daemons'
# threads off the cores of a small machine. NICE="" runs them at the daemons' priority.
NICE = os.environ.get("NICE", "nice -n 19").split()
# The two daemons stand for two nodes. With PIN=1 (the default) each daemon gets cores of its
# own (taskset), so that the publisher's packing does not sit on the cores the receiver wakes
# on: on 2-3 CPUs one core each, the simulated clients left to the scheduler; on 4 or more a
# quarter of the CPUs each (threads of one daemon then spread as on a real node, its data-path
# worker beside its loop thread), the simulated clients on the other half. PIN=0 leaves all
# placement to the scheduler.
_cpus = sorted(os.sched_getaffinity(0))


def _taskset(cpus):
    return ["taskset", "-c", ",".join(map(str, cpus))]


if os.environ.get("PIN", "1") != "1" or len(_cpus) < 2:
    PIN, SIM_PIN, PLACEMENT = [[], []], [], "scheduler"
elif len(_cpus) < 4:
    PIN, SIM_PIN = [_taskset(_cpus[:1]), _taskset(_cpus[1:2])], []
    PLACEMENT = f"publisherd cpu {_cpus[0]}, receiverd cpu {_cpus[1]}, simulators anywhere"
else:
    _q = len(_cpus) // 4
    PIN = [_taskset(_cpus[:_q]), _taskset(_cpus[_q:2 * _q])]
    SIM_PIN = _taskset(_cpus[2 * _q:])
    PLACEMENT = (f"publisherd cpus {PIN[0][2]}, receiverd cpus {PIN[1][2]}, simulators cpus "
                 f"{SIM_PIN[2]}")
# Extra flags for the coordinator publisherd, e.g. PUB_FLAGS="--busy-poll-ms 0".
PUB_FLAGS = os.environ.get("PUB_FLAGS", "").split()
# Training steps between refits, in ms, one table each (see the header).
try:
    STEPS = [int(x) for x in os.environ["STEPS"].split()]
except ValueError:
    sys.exit(f"bench_control: STEPS must be whole milliseconds, not '{os.environ['STEPS']}'")
if not STEPS or min(STEPS) < 0:
    sys.exit("bench_control: STEPS needs at least one value, none negative: "
             f"'{os.environ['STEPS']}'")
TRANSPORT = os.environ.get("TRANSPORT", "tcp")
if TRANSPORT not in ("tcp", "nccl"):
    sys.exit(f"bench_control: TRANSPORT is tcp or nccl, not '{TRANSPORT}'")
TARGET_MS = 5.0
TARGET_RATIO = 1.5

work = tempfile.mkdtemp(prefix="refit-bench-control.")
procs = []
failed = False


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def spawn(name, args, stdout=None, wrap=False):
    log = open(os.path.join(work, name + ".log"), "w")
    if wrap and WRAP:
        # e.g. WRAP='perf record -g -o {out}.perf --' to profile the daemons
        args = WRAP.replace("{out}", os.path.join(work, name)).split() + args
    # Each in its own session, so that stopping a wrapped daemon stops the daemon too.
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=stdout or log,
                         stderr=subprocess.STDOUT if stdout is None else log,
                         start_new_session=True)
    procs.append(p)
    return p


def stop_all():
    def signal_group(p, sig):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    for p in procs:
        signal_group(p, signal.SIGTERM)
    deadline = time.time() + 2
    for p in procs:
        try:
            p.wait(max(0.05, deadline - time.time()))
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait()
    procs.clear()


def model_spec(tag, layers):
    path = os.path.join(work, f"tiny-{tag}.json")
    with open(path, "w") as f:
        json.dump({"model_type": "qwen3_moe", "name": f"tiny-{tag}", "hidden_size": 8,
                   "num_hidden_layers": layers, "num_attention_heads": 1,
                   "num_key_value_heads": 1, "head_dim": 8, "moe_intermediate_size": 8,
                   "num_experts": EXPERTS, "vocab_size": 8, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16"}, f)
    return path


def connect_ctl(path, deadline):
    while True:
        try:
            return refit.Client(refit.CTL, name="bench_control", socket=path)
        except refit.Error:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_size(tag, spec, plan, step_ms, launch):
    tag = f"{tag}-step{step_ms}-{launch}"
    d = os.path.join(work, tag)
    os.makedirs(d)
    key = os.path.join(d, "cluster.key")
    with open(key, "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(key, 0o600)
    common = ["--cluster-key-file", key, "--coordinator-addr", f"127.0.0.1:{free_port()}",
              "--status-listen", "127.0.0.1:0", "--transport", TRANSPORT, "--verify", "off",
              "--publishers", "1", "--receivers", "1", "--clients", "1",
              "--heartbeat-ms", "1000", "--peer-timeout-ms", "10000", "--refit-timeout-s", "60",
              "--log-level", "info", "--index", "0"]
    pub_sock, recv_sock = os.path.join(d, "pub0.sock"), os.path.join(d, "recv0.sock")
    spawn(f"{tag}/pub0", [*PIN[0], f"{BIN}/refit-publisherd", *common, "--coordinator",
                          "--node", "bench-pub0", "--socket", pub_sock, *PUB_FLAGS], wrap=True)
    spawn(f"{tag}/recv0", [*PIN[1], f"{BIN}/refit-receiverd", *common, "--node", "bench-recv0",
                           "--socket", recv_sock], wrap=True)
    sim = ["--model", spec, "--layout", "tp=1", "--versions", str(REFITS), "--timeout-ms", "60000"]
    dev = [["--device", "cuda:0"], ["--device", "cuda:1"]] if TRANSPORT == "nccl" else [[], []]
    t0 = time.time()
    deadline = t0 + 30
    pub = connect_ctl(pub_sock, deadline)
    recv = connect_ctl(recv_sock, deadline)
    eng = spawn(f"{tag}/engine", [*SIM_PIN, *NICE, f"{BIN}/refit-sim-engine", "--socket",
                                  recv_sock, *sim, *dev[1]])
    tr = spawn(f"{tag}/trainer", [*SIM_PIN, *NICE, f"{BIN}/refit-sim-trainer", "--socket",
                                  pub_sock, *sim, *dev[0], "--step-ms", str(step_ms)],
               stdout=subprocess.PIPE)
    rows, released = {}, {}
    trlog = open(os.path.join(d, "trainer.out"), "w")
    rel = re.compile(r"version (\d+) released after ([0-9.]+) s")
    for line in iter(tr.stdout.readline, b""):
        line = line.decode(errors="replace")
        trlog.write(line)
        m = rel.search(line)
        if not m:
            continue
        released[int(m.group(1))] = float(m.group(2))
        # Usually the refit just released; when the next one already committed, that one.
        cst = json.loads(pub.status())
        rst = json.loads(recv.status())
        last = cst["cluster"]["last_refit"]
        if last["result"] == "committed" and last["version"] not in rows:
            rows[last["version"]] = {"cluster": last, "plan": cst["cluster"]["plan"],
                                     "pub": cst["last_refit"], "recv": rst["last_refit"]}
    trlog.close()
    rc_tr = tr.wait()
    try:
        rc_eng = eng.wait(60)
    except subprocess.TimeoutExpired:
        rc_eng = -1
    pub.close()
    recv.close()
    wall = time.time() - t0
    stop_all()
    wrong = 0
    committed = 0
    with open(os.path.join(work, f"{tag}/engine.log")) as f:
        for line in f:
            m = re.search(r"version (\d+) committed after .* (\d+) wrong elements", line)
            if m:
                committed += 1
                wrong += int(m.group(2))
    # The worker thread's own time of each refit ("version N: moved B bytes in X s", ms
    # resolution): a daemon's transfer_s minus it is the time its loop thread spent around the
    # worker (checking the job before starting it, picking up the result).
    worker = {}
    for who in ("pub0", "recv0"):
        with open(os.path.join(d, who + ".log")) as f:
            for line in f:
                m = re.search(r"version (\d+): moved \d+ bytes in ([0-9.]+) s", line)
                if m:
                    worker[(who, int(m.group(1)))] = float(m.group(2))
    for v, r in rows.items():
        r["released_s"] = released.get(v)
        for who, key in (("pub0", "pub"), ("recv0", "recv")):
            if (who, v) in worker and r[key]["version"] == v:
                r[key]["worker_s"] = worker[(who, v)]
    with open(os.path.join(d, "samples.json"), "w") as f:
        json.dump(rows, f, indent=1)
    ok_rows = [rows[v] for v in sorted(rows) if v > WARMUP]
    ovh = [r["cluster"]["start_to_commit_s"] - r["cluster"]["transfer_s"] for r in ok_rows]
    xfer = [r["cluster"]["transfer_s"] for r in ok_rows]
    s2c = [r["cluster"]["start_to_commit_s"] for r in ok_rows]
    quorum = [r["cluster"]["publish_quorum_s"] for r in ok_rows]
    trn = [r["released_s"] - r["cluster"]["transfer_s"] for r in ok_rows
           if r["released_s"] is not None]
    rwait = [r["recv"]["wait_s"] for r in ok_rows if r["recv"]["version"] == r["cluster"]["version"]]
    pwait = [r["pub"]["wait_s"] for r in ok_rows if r["pub"]["version"] == r["cluster"]["version"]]
    around = [r[k]["transfer_s"] - r[k]["worker_s"] for r in ok_rows for k in ("pub", "recv")
              if "worker_s" in r[k]]
    build_s = rows[max(rows)]["plan"]["build_s"] if rows else float("nan")
    return {"tag": tag, "tensors": plan["tensors"], "bytes": plan["dst_bytes"],
            "status_tensors": rows[max(rows)]["plan"]["tensors"] if rows else 0,
            "build_s": build_s, "n": len(ok_rows), "expected": REFITS - WARMUP,
            "ovh": ovh, "xfer": xfer, "s2c": s2c, "trn": trn, "quorum": quorum,
            "rwait": rwait, "pwait": pwait, "around": around, "wrong": wrong, "committed": committed,
            "rc": (rc_tr, rc_eng), "wall": wall}


def pooled(tag, layers, step_ms):
    """LAUNCHES runs of one size at one cadence, each with fresh daemons and clients, pooled:
    where the scheduler puts processes differs between launches and moves a small size's
    median by tens of microseconds; pooling keeps one launch from deciding the ratio."""
    spec = model_spec(tag, layers)
    plan = json.loads(subprocess.run([f"{BIN}/refitctl", "plan", "--model", spec, "--src", "tp=1",
                                      "--dst", "tp=1", "--json"], check=True,
                                     capture_output=True, text=True).stdout)
    runs = [run_size(tag, spec, plan, step_ms, k) for k in range(LAUNCHES)]
    p = dict(runs[0])
    p["tag"] = f"{tag}-step{step_ms}"
    for key in ("ovh", "xfer", "s2c", "trn", "quorum", "rwait", "pwait", "around"):
        p[key] = [x for r in runs for x in r[key]]
    for key in ("n", "expected", "wrong", "committed", "wall"):
        p[key] = sum(r[key] for r in runs)
    p["rc"] = next((r["rc"] for r in runs if r["rc"] != (0, 0)), (0, 0))
    p["build_s"] = max(r["build_s"] for r in runs)
    return p


def ms(x):
    return x * 1e3


results = {}
t_begin = time.time()
try:
    for tag in os.environ["SIZES"].split():
        if tag not in SIZES:
            print(f"bench_control: unknown size '{tag}' (one of {' '.join(SIZES)})", file=sys.stderr)
            failed = True
    for step in STEPS:
        results[step] = [pooled(tag, SIZES[tag], step) for tag in os.environ["SIZES"].split()
                         if tag in SIZES]
finally:
    stop_all()

print(f"# refit control-plane benchmark: 1 coordinator publisherd + 1 receiverd on loopback, "
      f"transport {TRANSPORT}, verify off, trainer tp=1 -> engine tp=1, tiny tensors")
print(f"# {len(_cpus)} CPUs; placement: {PLACEMENT}")
print(f"# {LAUNCHES} launches of {REFITS} refits per size and cadence (fresh daemons and "
      f"clients each), the first {WARMUP} of each discarded, the rest pooled; times in ms, "
      "medians unless marked p90")
print("#   ovh       start->commit - transfer: the coordinator's Start .. last Done, minus the "
      "slowest daemon's transfer_s")
print("#   xfer      transfer_s of the slowest daemon (its Start handled .. its Done sent)")
print("#   loop      transfer_s - the data-path worker's own time, both daemons: loop-thread "
      "work around the worker (ms resolution)")
print("#   quorum    first Ready .. Start (includes the engine sim checking every byte of the "
      "last version)")
print("#   trn-xfer  publish -> release seen by the trainer, minus xfer (trainer prints ms "
      "resolution)")
print(f"# targets: ovh median <= {TARGET_MS:g} ms at every size; with a training step, ovh "
      f"median of the largest / the smallest size <= {TARGET_RATIO:g}; #wrong = 0")
hdr = ("tensors", "bytes", "build(s)", "refits", "ovh", "ovh_p90", "ovh_min", "s2c", "xfer",
       "loop", "quorum", "trn-xfer", "#wrong", "result")
fmt = "%8s %9s %9s %6s %7s %7s %7s %8s %8s %7s %7s %8s %6s %6s"


def med(xs):
    return ms(statistics.median(xs)) if xs else float("nan")


for step in STEPS:
    rows = results[step]
    print("#")
    if step:
        print(f"# training step {step} ms: the trainer waits {step} ms after each release "
              "before writing the next version")
    else:
        print("# back to back: the next version is written as soon as the last one is released "
              "(the refit cycle, and with it how long the daemons sleep before Start, grows "
              "with the tensor count; the ratio is shown, not judged)")
    print(fmt % hdr)
    for r in rows:
        complete = (r["rc"] == (0, 0) and r["committed"] == REFITS * LAUNCHES and r["wrong"] == 0
                    and r["n"] >= 0.8 * r["expected"])
        good = complete and bool(r["ovh"]) and statistics.median(r["ovh"]) <= TARGET_MS / 1e3
        failed |= not good
        print(fmt % (r["tensors"], r["bytes"], "%.3f" % r["build_s"],
                     "%d/%d" % (r["n"], r["expected"]), "%.3f" % med(r["ovh"]),
                     "%.3f" % ms(pct(r["ovh"], 0.9)),
                     "%.3f" % (ms(min(r["ovh"])) if r["ovh"] else float("nan")),
                     "%.2f" % med(r["s2c"]), "%.2f" % med(r["xfer"]), "%.1f" % med(r["around"]),
                     "%.2f" % med(r["quorum"]), "%.2f" % med(r["trn"]), r["wrong"],
                     "PASS" if good else "FAIL"))
        if not complete:
            print(f"#   {r['tag']}: trainer/engine exit {r['rc']}, "
                  f"{r['committed']}/{REFITS * LAUNCHES} "
                  f"versions checked by the engine, {r['n']}/{r['expected']} refits measured")
    if len(rows) >= 2 and rows[0]["ovh"] and rows[-1]["ovh"]:
        ratio = statistics.median(rows[-1]["ovh"]) / statistics.median(rows[0]["ovh"])
        if step:
            rgood = ratio <= TARGET_RATIO
            failed |= not rgood
            verdict = "(target <= %g) %s" % (TARGET_RATIO, "PASS" if rgood else "FAIL")
        else:
            verdict = "(not judged)"
        print("# ovh ratio %s/%s: %.2f %s" % (rows[-1]["tag"], rows[0]["tag"], ratio, verdict))
    print("# wall: " + ", ".join("%s %.1f s" % (r["tag"], r["wall"]) for r in rows))
print("# total %.1f s" % (time.time() - t_begin))
print("# Result: %s" % ("FAIL" if failed else "PASS"))
if failed or KEEP:
    print(f"# logs kept in {work}")
else:
    shutil.rmtree(work, ignore_errors=True)
sys.exit(1 if failed else 0)
PY
