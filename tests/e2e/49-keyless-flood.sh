#!/bin/bash
# tests/e2e/49-keyless-flood.sh - clients without the cluster key flood a coordinator's control
# port and its /status from 127.0.0.1, the address its own daemons come from. /status: 64
# half-open requests (a request line, never the end of the headers) are held when a GET from
# the same address is answered. Control port: a flooder keeps 96 connections open (each sends a
# Hello and a Challenge, never a proof) and re-opens every one the coordinator closes, at up to
# 5000 connects a second, for at most 40 s. While it runs and the coordinator's table of 64
# connections in their handshake is full, receiverd 0 is killed and started again: it must join
# within 500 ms of its first connect, not when the flood ends, and then refits commit with every
# byte right.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 16"
JOIN_S=5        # a handshake takes milliseconds; the rest is the receiverd's own start

start_publisher 0 1
start_receiver 0 2
P=$E2E_DIR/pub0.sock
st_wait "$P" 20 "both daemons joined the coordinator" \
    'len(cl["members"]) == 2 and all(x["connected"] for x in cl["members"])'
st_port SP "$E2E_DIR/pub0.log" 10

problems=""
# ---- /status beside 64 half-open requests from the same address ----
python3 - "$SP" "$PUB0_PID" > "$E2E_DIR/half-open.txt" 2>&1 <<'PY' || problems="$(cat "$E2E_DIR/half-open.txt")"
import json, os, socket, sys, time

port, pid = int(sys.argv[1]), int(sys.argv[2])
HALF = b"GET /status HTTP/1.1\r\nHost: refit\r\n"   # no blank line: the headers never end


def daemon_sockets():
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            n += os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:")
        except OSError:
            pass
    return n


def is_open(s):
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


base = daemon_sockets()
held = []
for _ in range(64):
    s = socket.create_connection(("127.0.0.1", port), timeout=3, source_address=("127.0.0.1", 0))
    s.sendall(HALF)
    s.setblocking(False)
    held.append(s)
t = time.time() + 4
while daemon_sockets() < base + 64 and time.time() < t:
    time.sleep(0.01)
if daemon_sockets() < base + 64:
    raise SystemExit("the daemon holds %d of 64 half-open connections from 127.0.0.1 "
                     "(%d still open at the client)" % (daemon_sockets() - base,
                                                        sum(map(is_open, held))))
t0 = time.monotonic()
try:
    g = socket.create_connection(("127.0.0.1", port), timeout=3, source_address=("127.0.0.1", 0))
    g.sendall(b"GET /status HTTP/1.1\r\nHost: refit\r\nConnection: close\r\n\r\n")
    data = b""
    while True:
        b = g.recv(65536)
        if not b:
            break
        data += b
    g.close()
except OSError as e:
    raise SystemExit("GET /status from 127.0.0.1 beside 64 half-open requests from the "
                     "same address: %s" % e)
head, _, body = data.partition(b"\r\n\r\n")
if not head.startswith(b"HTTP/1.1 200"):
    raise SystemExit("GET /status from 127.0.0.1 beside 64 half-open requests from the "
                     "same address answered %r" % head[:60])
json.loads(body)
still = sum(map(is_open, held))
if still != 64:
    raise SystemExit("only %d of 64 half-open connections were open when /status was "
                     "answered" % still)
print("GET /status answered in %.3f s beside 64 half-open requests from 127.0.0.1"
      % (time.monotonic() - t0))
for s in held:
    s.close()
PY
cat "$E2E_DIR/half-open.txt"

# ---- the control port: a flooder without the key ----
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
cat > "$E2E_DIR/flood.py" <<'EOF'
"""Keeps COUNT connections to the coordinator open, each sending a Hello and a Challenge and
never a proof, and opens a new one for every one the coordinator closes (at most RATE connects a
second). Writes what it sees to STATE every 50 ms; stops when STOP exists or after SECS."""
import json, os, selectors, socket, struct, sys, time

from pbwire import PEER_PROTOCOL, field, frame

port, count, secs, state, stop = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                   sys.argv[4], sys.argv[5])
RATE = float(os.environ.get("FLOOD_RATE", "5000"))
HELLO = frame(field(1, field(1, PEER_PROTOCOL) + field(2, 2) + field(3, b"keyless")))
sel = selectors.DefaultSelector()
conns = {}   # socket -> {"data": bytes, "frames": int}
opened = closed_by_daemon = served_now = connect_errors = 0
t0 = time.monotonic()
budget, last_budget = 0.0, t0


def open_one():
    global opened, connect_errors
    s = socket.socket()
    # No TIME_WAIT on our side for the thousands of connections this makes.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.setblocking(False)
    if s.connect_ex(("127.0.0.1", port)) not in (0, 115):   # 115: EINPROGRESS
        connect_errors += 1
        s.close()
        return
    opened += 1
    conns[s] = {"data": b"", "frames": 0, "sent": False}
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)


def drop(s):
    global closed_by_daemon
    closed_by_daemon += 1
    sel.unregister(s)
    del conns[s]
    s.close()


def write_state(done=False):
    with open(state + ".tmp", "w") as f:
        json.dump({"t": time.monotonic() - t0, "open": len(conns),
                   "served": sum(1 for c in conns.values() if c["frames"] >= 2),
                   "opened": opened, "closed_by_daemon": closed_by_daemon,
                   "connect_errors": connect_errors, "done": done}, f)
    os.replace(state + ".tmp", state)


next_state = t0
while time.monotonic() - t0 < secs and not os.path.exists(stop):
    now = time.monotonic()
    budget = min(budget + (now - last_budget) * RATE, 50.0)
    last_budget = now
    while len(conns) < count and budget >= 1:
        budget -= 1
        open_one()
    for key, ev in sel.select(timeout=0.005):
        s, c = key.fileobj, conns[key.fileobj]
        if ev & selectors.EVENT_WRITE and not c["sent"]:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                drop(s)
                continue
            c["sent"] = True
            sel.modify(s, selectors.EVENT_READ)
            try:
                s.send(HELLO + frame(field(2, field(1, os.urandom(32)))))
            except OSError:
                drop(s)
                continue
        if ev & selectors.EVENT_READ:
            try:
                b = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                b = b""
            if not b:
                drop(s)
                continue
            c["data"] += b
            while len(c["data"]) >= 4 and len(c["data"]) >= 4 + struct.unpack(">I", c["data"][:4])[0]:
                n = struct.unpack(">I", c["data"][:4])[0]
                c["data"] = c["data"][4 + n:]
                c["frames"] += 1
    if now >= next_state:
        write_state()
        next_state = now + 0.05
write_state(done=True)
print("flooder: %d connections opened in %.1f s, %d closed by the coordinator, %d connects "
      "failed" % (opened, time.monotonic() - t0, closed_by_daemon, connect_errors))
EOF
python3 "$E2E_DIR/flood.py" "$E2E_COORD_PORT" 96 40 "$E2E_DIR/flood.json" "$E2E_DIR/flood.stop" \
    > "$E2E_DIR/flood.log" 2>&1 &
FLOOD_PID=$!
E2E_PIDS="$E2E_PIDS $FLOOD_PID"

# flood_check SECONDS WHAT EXPR: waits until the flooder's state (f) satisfies EXPR.
flood_check() {
    python3 - "$E2E_DIR/flood.json" "$@" <<'PY'
import json, sys, time
path, secs, what, expr = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
deadline, f = time.time() + secs, None
while True:
    try:
        with open(path) as fh:
            f = json.load(fh)
        if eval(expr):
            sys.exit(0)
    except (OSError, ValueError):
        pass
    if time.time() > deadline:
        print("%s: not within %g s; flooder: %s" % (what, secs, f))
        sys.exit(1)
    time.sleep(0.02)
PY
}
msg=$(flood_check 10 "the flooder holding the coordinator's 64 handshake places, and more \
connections being closed" 'f["served"] >= 60 and f["closed_by_daemon"] >= 20 and not f["done"]') ||
    fail "$msg"
before=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["opened"])' "$E2E_DIR/flood.json")

kill -9 "$RECV0_PID"
st_wait "$P" 10 "the coordinator lost the killed receiverd 0" 'not m("receiver", 0)["connected"]'
t0=$(now_ms)
start_receiver 0 2
st_check "$P" "$JOIN_S" "the restarted receiverd 0 joining through the flood" \
    'm("receiver", 0)["connected"]' > "$E2E_DIR/join.txt" ||
    fail "$(cat "$E2E_DIR/join.txt"); receiverd 0: $(grep -i "coordinator\|retry" \
"$E2E_DIR/recv0.log" | tail -n 2 | tr '\n' ' ')${problems:+; and }$problems"
joined=$(( $(now_ms) - t0 ))
msg=$(flood_check 2 "the flood still running when receiverd 0 joined" \
    "f['opened'] > $before + 50 and not f['done']") || fail "$msg"
# From the receiverd's first connect to its place in the cluster: a handshake takes a few
# milliseconds here; the bound leaves room for a loaded machine, not for refusals (retries
# come after 100, 200, 400 ms...).
hs=$(python3 - "$E2E_DIR/recv0.log" <<'PY'
import datetime, sys
t = {}
for line in open(sys.argv[1]):
    for key, what in (("start", " local socket "), ("up", "connected to coordinator")):
        if what in line:
            t[key] = datetime.datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f")
print(int((t["up"] - t["start"]).total_seconds() * 1000))
PY
)
[ "$hs" -lt 500 ] || fail "the restarted receiverd 0 came up $hs ms after it started to \
connect, not within 500 ms (refused before?)"
echo "receiverd 0 joined $joined ms after its start, $hs ms after it started to connect, through the flood"

start_engine eng 0 $M --layout tp=2 --versions 2
start_trainer tr 0 $M --layout tp=1 --versions 2
wait_ok tr eng
grep -q "version 2 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 2"
msg=$(flood_check 2 "the flood still running when version 2 was committed" \
    "f['opened'] > $before + 100 and not f['done']") || fail "$msg"
touch "$E2E_DIR/flood.stop"
wait "$FLOOD_PID" || fail "the flooder failed: $(tail -n 3 "$E2E_DIR/flood.log")"
cat "$E2E_DIR/flood.log"
st_committed 10 2 "$P"
if grep -q "lost publisher" "$E2E_DIR/pub0.log"; then
    fail "a member was lost during the flood: $(grep "lost " "$E2E_DIR/pub0.log" | head -2)"
fi
n=$(grep -c "closed before it joined" "$E2E_DIR/pub0.log")
[ "$n" -ge 1 ] || fail "the coordinator did not log the connections it closed"
[ "$n" -le 6 ] || fail "the coordinator logged $n lines for keyless connections (rate limit: one per 10 s)"
[ -z "$problems" ] || fail "$problems"
echo "ok: /status answered beside 64 half-open requests; receiverd joined $hs ms after it started to connect, through a keyless flood; 2 refits verified"
