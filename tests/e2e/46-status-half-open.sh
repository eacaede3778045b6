#!/bin/bash
# /status stays answerable while many half-open requests (a request line and never the end of
# the headers) hold connections: 200 of them from ten addresses are held by the daemon when a
# fresh GET /status is answered at once; one address has no limit of its own below the server's
# (40 more from one address are all held, and its GET is answered); idle connections are closed
# after 5 s. tests/e2e/49-keyless-flood.sh and test_httpd close the oldest for newer ones.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 1
st_port PORT "$E2E_DIR/pub0.log" 20

python3 - "$PORT" "$PUB0_PID" <<'PY' || fail "status under half-open connections (see above)"
import json, os, socket, sys, time

port, pid = int(sys.argv[1]), int(sys.argv[2])
HALF = b"GET /status HTTP/1.1\r\nHost: refit\r\n"   # no blank line: the headers never end


def daemon_sockets():
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            if os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def half_open(src, count):
    out = []
    for _ in range(count):
        s = socket.socket()
        s.bind((src, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(HALF)
        s.setblocking(False)
        out.append(s)
    return out


def state(s):
    """'open' while the server holds the connection, 'closed' once it closed it."""
    try:
        return "closed" if s.recv(1, socket.MSG_PEEK) == b"" else "data"
    except BlockingIOError:
        return "open"
    except OSError:
        return "closed"


def wait(what, pred, limit):
    t = time.time() + limit
    while not pred():
        if time.time() > t:
            raise SystemExit("FAIL: %s within %.1f s" % (what, limit))
        time.sleep(0.02)


def get_status(src):
    t0 = time.monotonic()
    g = socket.create_connection(("127.0.0.1", port), timeout=3, source_address=(src, 0))
    g.sendall(b"GET /status HTTP/1.1\r\nHost: refit\r\nConnection: close\r\n\r\n")
    data = b""
    while True:
        b = g.recv(65536)
        if not b:
            break
        data += b
    g.close()
    took = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit("FAIL: GET /status answered %r" % head[:60])
    json.loads(body)
    return took


base = daemon_sockets()
opened = time.monotonic()
held = []
for i in range(10):
    held += half_open("127.0.0.%d" % (i + 2), 20)
# The daemon accepted every one of them (its own descriptors, not the kernel's backlog).
wait("the daemon holding 200 half-open connections",
     lambda: daemon_sockets() >= base + 200, 4)
took = get_status("127.0.0.1")
still = sum(state(s) == "open" for s in held)
server_side = daemon_sockets() - base
if still != 200 or server_side < 200:
    raise SystemExit("FAIL: when /status was answered only %d of 200 half-open connections "
                     "were connected (%d held by the daemon)" % (still, server_side))
if took > 1.0:
    raise SystemExit("FAIL: GET /status took %.2f s beside 200 half-open connections" % took)
print("GET /status answered in %.3f s while the daemon held %d half-open connections"
      % (took, server_side))

# One address: 40 more connections are all held, and a GET from that address is answered.
flood = half_open("127.0.0.12", 40)
wait("the daemon holding 40 more half-open connections from one address",
     lambda: daemon_sockets() >= base + 240, 4)
took = get_status("127.0.0.12")
nopen = sum(state(s) == "open" for s in flood)
if nopen != 40:
    raise SystemExit("FAIL: %d of 40 connections from one address stayed open" % nopen)
print("one address: 40 held, its /status answered in %.3f s" % took)

# Idle connections are closed by the daemon after its 5 s timeout, not before.
wait("the daemon closing idle connections", lambda: all(state(s) == "closed" for s in held),
     10)
idle = time.monotonic() - opened
if idle < 4.5:
    raise SystemExit("FAIL: half-open connections were closed after %.2f s, before the 5 s "
                     "idle timeout" % idle)
print("idle half-open connections closed after %.1f s" % idle)
for s in held + flood:
    s.close()
PY
kill -0 "$PUB0_PID" || fail "the publisherd died"
echo "ok: /status answered beside 200 half-open connections and 40 more from one address; idle timeout"
