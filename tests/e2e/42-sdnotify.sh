#!/bin/bash
# tests/e2e/42-sdnotify.sh - systemd notification without systemd: each daemon runs with
# NOTIFY_SOCKET naming a Unix datagram socket a python3 helper reads. Checks that READY=1
# comes once, and only when the daemon's RPC socket, coordinator port (coordinator), data
# port and status port accept connections (the helper connects to each the moment READY
# arrives); that STATUS= lines arrive; that WATCHDOG=1 comes every ~1 s with WATCHDOG_USEC=2 s
# (WATCHDOG_PID = the daemon); and that SIGTERM brings STOPPING=1, then exit status 0.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1

cat > "$E2E_DIR/notify.py" <<'EOF'
import atexit, json, os, re, signal, socket, subprocess, sys, time, urllib.request

# notify.py NAME WATCHDOG_USEC COORD_PORT|- STATUS_PORT -- daemon args...
name, wd_usec, coord, status_port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
argv = sys.argv[sys.argv.index("--") + 1:]
edir = os.environ["E2E_DIR"]
sock_path = os.path.join(edir, name + ".notify")
log_path = os.path.join(edir, name + ".log")
rpc_path = argv[argv.index("--socket") + 1]
errors = []


def fail(msg):
    print("FAIL: %s: %s" % (name, msg))
    sys.exit(1)


ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
ns.bind(sock_path)
env = dict(os.environ, NOTIFY_SOCKET=sock_path)
env.pop("WATCHDOG_USEC", None)
env.pop("WATCHDOG_PID", None)
if wd_usec:
    env["WATCHDOG_USEC"] = str(wd_usec)
    # WATCHDOG_PID must be the daemon's own pid: the shell's, which exec keeps.
    argv = ["/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$0" "$@"'] + argv
log = open(log_path, "ab")
t_start = time.monotonic()
proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def reap():
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# Whatever way this helper ends (a failed check, the test's cleanup), the daemon goes too.
atexit.register(reap)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))
msgs = []  # (time since start, {key: value})


def recv(timeout):
    ns.settimeout(max(timeout, 0.001))
    try:
        data = ns.recv(65536)
    except socket.timeout:
        return None
    t = time.monotonic() - t_start
    fields = {}
    for line in data.decode().split("\n"):
        if line == "":
            continue
        if "=" not in line:
            fail("notification line without '=': %r" % line)
        k, v = line.split("=", 1)
        fields[k] = v
    msgs.append((t, fields))
    return fields


def probe():
    """Connects to everything the daemon listens on; returns what refused."""
    bad = []
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        u.connect(rpc_path)
    except OSError as e:
        bad.append("RPC socket %s: %s" % (rpc_path, e))
    finally:
        u.close()
    ports = {"status port": status_port}
    if coord != "-":
        ports["coordinator port"] = int(coord)
    with open(log_path, errors="replace") as f:
        m = re.search(r"transport tcp on [0-9.]+:([0-9]+)", f.read())
    if not m:
        bad.append("no data port in the log before READY=1")
    else:
        ports["data port"] = int(m.group(1))
    for what, port in ports.items():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError as e:
            bad.append("%s %d: %s" % (what, port, e))
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/status" % status_port, timeout=5) as r:
            json.loads(r.read().decode())
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        bad.append("GET /status: %s" % e)
    return bad


# READY=1, and before it nothing but STATUS.
deadline = time.monotonic() + 10
while True:
    if proc.poll() is not None:
        fail("daemon exited with status %d before READY=1 (see %s)" % (proc.returncode, log_path))
    f = recv(deadline - time.monotonic())
    if f is None:
        fail("no READY=1 within 10 s")
    if "READY" in f:
        bad = probe()
        if bad:
            fail("READY=1 came before the daemon listened: " + "; ".join(bad))
        if f["READY"] != "1":
            fail("READY=%s" % f["READY"])
        break
    if "WATCHDOG" in f or "STOPPING" in f:
        fail("%s before READY=1" % list(f))
t_ready = msgs[-1][0]

# Let it run: STATUS= lines, and WATCHDOG=1 at about half of WATCHDOG_USEC.
run_for = 3.6 if wd_usec else 1.0
end = time.monotonic() + run_for
while time.monotonic() < end:
    recv(end - time.monotonic())
if proc.poll() is not None:
    fail("daemon exited with status %d while running" % proc.returncode)
after = [(t, f) for t, f in msgs if t > t_ready]
statuses = [f["STATUS"] for t, f in msgs if "STATUS" in f]
if not statuses or not all(s.strip() for s in statuses):
    errors.append("STATUS= lines: %r" % statuses)
if not any("STATUS" in f for t, f in after):
    errors.append("no STATUS= after READY=1")
if sum("READY" in f for t, f in msgs) != 1:
    errors.append("READY=1 sent %d times" % sum("READY" in f for t, f in msgs))
wd = [t for t, f in msgs if f.get("WATCHDOG") == "1"]
if wd_usec:
    want = wd_usec / 2e6
    gaps = [b - a for a, b in zip(wd, wd[1:])]
    if len(wd) < 3:
        errors.append("%d WATCHDOG=1 in %.1f s with WATCHDOG_USEC=%d" % (len(wd), run_for, wd_usec))
    elif not all(0.5 * want <= g <= 1.5 * want for g in gaps):
        errors.append("WATCHDOG=1 intervals %s s, expected about %.1f s" % (
            [round(g, 2) for g in gaps], want))
    if wd and wd[0] - t_ready > wd_usec / 1e6:
        errors.append("first WATCHDOG=1 %.2f s after READY=1" % (wd[0] - t_ready))
    if any("WATCHDOG" in f and "STATUS" not in f for t, f in msgs):
        errors.append("WATCHDOG=1 without a STATUS= line")

# SIGTERM: STOPPING=1, then a clean exit.
proc.send_signal(signal.SIGTERM)
t_term = time.monotonic() - t_start
stopping = None
end = time.monotonic() + 10
while time.monotonic() < end and stopping is None:
    f = recv(end - time.monotonic())
    if f and "STOPPING" in f:
        stopping = f["STOPPING"]
if stopping != "1":
    errors.append("no STOPPING=1 within 10 s of SIGTERM")
try:
    rc = proc.wait(timeout=10)
except subprocess.TimeoutExpired:
    proc.kill()
    fail("daemon still running 10 s after SIGTERM")
if rc != 0:
    errors.append("exit status %d after SIGTERM" % rc)
late = [list(f) for t, f in msgs if t > t_term and ("READY" in f or "WATCHDOG" in f)]
if late:
    errors.append("after SIGTERM: %s" % late)
if errors:
    print("FAIL: %s:\n  %s" % (name, "\n  ".join(errors)))
    sys.exit(1)
print("%s: READY=1 after %.2f s with every listener up; %d STATUS= (last %r); %d WATCHDOG=1; "
      "STOPPING=1; exit 0" % (name, t_ready, len(statuses), statuses[-1], len(wd)))
EOF

export E2E_DIR
PUB_HTTP=$(free_port)
RECV_HTTP=$(free_port)
python3 "$E2E_DIR/notify.py" pub0 2000000 "$E2E_COORD_PORT" "$PUB_HTTP" -- \
    "$BIN/refit-publisherd" $E2E_COMMON --status-listen "127.0.0.1:$PUB_HTTP" --coordinator \
    --index 0 --clients 1 --publishers 1 --receivers 1 --socket "$E2E_DIR/pub0.sock" \
    > "$E2E_DIR/notify-pub.out" 2>&1 &
PUB_HELPER=$!
E2E_PIDS="$E2E_PIDS $PUB_HELPER"
python3 "$E2E_DIR/notify.py" recv0 0 - "$RECV_HTTP" -- \
    "$BIN/refit-receiverd" $E2E_COMMON --status-listen "127.0.0.1:$RECV_HTTP" \
    --index 0 --clients 1 --publishers 1 --receivers 1 --socket "$E2E_DIR/recv0.sock" \
    > "$E2E_DIR/notify-recv.out" 2>&1 &
RECV_HELPER=$!
E2E_PIDS="$E2E_PIDS $RECV_HELPER"
ok=1
wait $PUB_HELPER || ok=0
wait $RECV_HELPER || ok=0
cat "$E2E_DIR/notify-pub.out" "$E2E_DIR/notify-recv.out"
[ $ok = 1 ] || fail "sd_notify protocol (above)"
echo "ok: READY=1 after the listeners, STATUS=, WATCHDOG=1 at WATCHDOG_USEC/2, STOPPING=1 on SIGTERM"
