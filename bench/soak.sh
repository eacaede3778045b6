#!/bin/bash
# bench/soak.sh - soak test of the host path (`make soak`, issue #10): REFITS refits with
# verify = full between one coordinator refit-publisherd and one refit-receiverd on loopback
# (transport tcp), trainer tp=2 -> engine tp=4 (qwen3-0.6b shrunk, every byte of every version
# checked by the engine), sampling the resident memory (/proc/PID/status VmRSS) and the open
# descriptors (/proc/PID/fd) of both daemons after WARMUP refits and every tenth of the run.
# Each sample is taken with the cluster quiet: the trainer's next publish is held
# (refit-sim-trainer --publish-when) until the coordinator's status shows the last version
# committed and the receiver's engines done with it.
#
# Fails (exit 1) if a daemon's RSS at the end exceeds the one after warm-up by more than
# RSS_TOL_KIB (default 4096 KiB: a leak of 4 bytes a refit would take 1M refits to show, one
# of 4 KiB a refit shows after 1,000), if its descriptor count grew by more than FD_TOL (default
# 0), if any refit aborted, or if the engine found a wrong byte.
#
# Environment: BUILD (default build), REFITS (1000), WARMUP (50), MODEL ("qwen3-0.6b"), SHRINK
# (16), KEEP=1 keeps the work directory (kept anyway on failure).
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.."
BIN=$(cd "$BUILD" 2>/dev/null && pwd) || { echo "soak: no build directory $BUILD" >&2; exit 1; }
for b in refit-publisherd refit-receiverd refit-sim-trainer refit-sim-engine refitctl; do
    [ -x "$BIN/$b" ] || { echo "soak: $BIN/$b is missing; run 'make BUILD=$BUILD all'" >&2; exit 1; }
done
export BIN REFITS=${REFITS:-1000} WARMUP=${WARMUP:-50} MODEL=${MODEL:-qwen3-0.6b}
export SHRINK=${SHRINK:-16} RSS_TOL_KIB=${RSS_TOL_KIB:-4096} FD_TOL=${FD_TOL:-0} KEEP=${KEEP:-}
exec python3 -u - <<'PY'
import json, os, shutil, socket, subprocess, sys, tempfile, time

BIN = os.environ["BIN"]
REFITS, WARMUP = int(os.environ["REFITS"]), int(os.environ["WARMUP"])
RSS_TOL, FD_TOL = int(os.environ["RSS_TOL_KIB"]), int(os.environ["FD_TOL"])
MODEL = ["--model", os.environ["MODEL"], "--shrink", os.environ["SHRINK"]]
if REFITS < 10 or WARMUP < 1:
    sys.exit("soak: REFITS must be 10 or more and WARMUP 1 or more")
work = tempfile.mkdtemp(prefix="refit-soak.")
procs = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def spawn(name, argv):
    log = open(os.path.join(work, name + ".log"), "w")
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p


def status(sock):
    p = subprocess.run([BIN + "/refitctl", "status", "--socket", sock, "--json"],
                       capture_output=True, text=True, timeout=10)
    if p.returncode != 0:
        raise OSError(p.stderr.strip())
    return json.loads(p.stdout)


def wait(what, pred, secs, sock):
    deadline, last = time.time() + secs, None
    while time.time() < deadline:
        try:
            last = status(sock)
            if pred(last):
                return last
        except (OSError, ValueError, KeyError):
            pass
        for p in procs:
            if p.poll() not in (None, 0):
                die("%s: %s exited with status %d while waiting" % (what, p.args[0], p.returncode))
        time.sleep(0.005)
    die("%s: not within %d s; last status: %s" % (what, secs,
        json.dumps((last or {}).get("cluster", last))[:600]))


def die(msg):
    print("soak: FAIL: " + msg)
    print("soak: logs kept in " + work)
    for p in procs:
        if p.poll() is None:
            p.kill()
    sys.exit(1)


def sample(pid):
    """RSS (KiB) and open descriptors; the least of 10 readings 10 ms apart, since the status
    request that found the cluster quiet may still hold a descriptor of the coordinator."""
    best = None
    for _ in range(10):
        with open("/proc/%d/status" % pid) as f:
            rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        now = (rss, len(os.listdir("/proc/%d/fd" % pid)))
        best = now if best is None else (min(best[0], now[0]), min(best[1], now[1]))
        time.sleep(0.01)
    return best


key = os.path.join(work, "cluster.key")
with open(key, "w") as f:
    f.write(os.urandom(32).hex())
os.chmod(key, 0o600)
common = ["--cluster-key-file", key, "--coordinator-addr", "127.0.0.1:%d" % free_port(),
          "--status-listen", "", "--heartbeat-ms", "200", "--peer-timeout-ms", "2000",
          "--refit-timeout-s", "30", "--verify", "full", "--log-level", "warn",
          "--publishers", "1", "--receivers", "1"]
pub_sock, recv_sock, gate = (os.path.join(work, n) for n in ("pub.sock", "recv.sock", "gate"))
pub = spawn("pub", [BIN + "/refit-publisherd", "--coordinator", "--index", "0", "--clients",
                    "2", "--socket", pub_sock] + common)
recv = spawn("recv", [BIN + "/refit-receiverd", "--index", "0", "--clients", "4", "--socket",
                      recv_sock] + common)
total = WARMUP + REFITS
with open(gate, "w") as f:
    f.write("%d\n" % WARMUP)
# One more version than sampled: the trainer and the engine stay registered (their memory
# mapped by the daemons) at the last sample, as at the first.
spawn("engine", [BIN + "/refit-sim-engine", "--socket", recv_sock, "--layout", "tp=4",
                 "--versions", str(total + 1), "--timeout-ms", "60000"] + MODEL)
trainer = spawn("trainer", [BIN + "/refit-sim-trainer", "--socket", pub_sock, "--layout",
                            "tp=2", "--versions", str(total + 1), "--publish-when", gate,
                            "--timeout-ms", "60000", "--retries", "0"] + MODEL)

marks = [WARMUP + REFITS * k // 10 for k in range(11)]
rows, t0 = [], None
for mark in marks:
    with open(gate + ".tmp", "w") as f:
        f.write("%d\n" % mark)
    os.rename(gate + ".tmp", gate)
    st = wait("version %d committed and consumed" % mark,
              lambda s: s["cluster"]["committed"] == mark and s["cluster"]["state"] == "idle"
              and all(m.get("ready_to_install", True) for m in s["cluster"]["members"]),
              max(60, (mark - (rows[-1][0] if rows else 0)) // 5), pub_sock)
    now = time.time()
    if t0 is None:
        t0 = now
    rows.append((mark, now - t0) + sample(pub.pid) + sample(recv.pid))
with open(gate + ".tmp", "w") as f:
    f.write("%d\n" % (total + 1))
os.rename(gate + ".tmp", gate)
for p in procs[2:]:
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        die("%s did not finish the last version within 60 s" % p.args[0])
    if p.returncode != 0:
        die("%s exited with status %d (see %s)" % (p.args[0], p.returncode, work))
with open(os.path.join(work, "pub.log")) as f:
    aborted = [l.strip() for l in f if "aborting the refit" in l]
with open(os.path.join(work, "engine.log")) as f:
    verified = sum(1 for l in f if ", 0 wrong elements" in l)

print("soak: %d refits after %d of warm-up, verify = full, transport tcp, %s/%s trainer tp=2 "
      "-> engine tp=4, %s" % (REFITS, WARMUP, os.environ["MODEL"], os.environ["SHRINK"],
                              time.strftime("%Y-%m-%d")))
print("%8s %9s %8s | %12s %8s | %12s %8s" % ("refits", "seconds", "refits/s", "pub RSS KiB",
                                              "pub fds", "recv RSS KiB", "recv fds"))
prev = None
for r in rows:
    rate = (r[0] - prev[0]) / (r[1] - prev[1]) if prev and r[1] > prev[1] else 0
    print("%8d %9.1f %8.1f | %12d %8d | %12d %8d" % (r[0] - WARMUP, r[1], rate, r[2], r[3],
                                                      r[4], r[5]))
    prev = r
first, last = rows[0], rows[-1]
problems = []
for name, i in (("refit-publisherd", 2), ("refit-receiverd", 4)):
    if last[i] - first[i] > RSS_TOL:
        problems.append("%s RSS grew %d KiB over %d refits (%d -> %d KiB), more than the %d KiB "
                        "allowed" % (name, last[i] - first[i], REFITS, first[i], last[i], RSS_TOL))
    if last[i + 1] - first[i + 1] > FD_TOL:
        problems.append("%s holds %d more descriptors after %d refits (%d -> %d), more than the "
                        "%d allowed" % (name, last[i + 1] - first[i + 1], REFITS, first[i + 1],
                                        last[i + 1], FD_TOL))
if aborted:
    problems.append("%d refits aborted, the first: %s" % (len(aborted), aborted[0]))
if verified != total + 1:
    problems.append("the engine verified %d versions, not %d" % (verified, total + 1))
print("RSS growth: publisherd %+d KiB, receiverd %+d KiB (allowed %d); descriptors: %+d, %+d "
      "(allowed %d); %d versions verified byte for byte, %d aborted" % (
          last[2] - first[2], last[4] - first[4], RSS_TOL, last[3] - first[3],
          last[5] - first[5], FD_TOL, verified, len(aborted)))
for p in procs[:2]:
    p.terminate()
    p.wait(timeout=10)
if problems:
    die("; ".join(problems))
if not os.environ.get("KEEP"):
    shutil.rmtree(work)
print("soak: ok")
PY
