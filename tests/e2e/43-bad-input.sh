#!/bin/bash
# tests/e2e/43-bad-input.sh - bad input against live daemons. While refits run (qwen3-0.6b
# shrunk, tp=2 -> tp=4): garbage, an oversized length prefix, truncated frames, an empty
# frame, a frame before Hello, a Hello of another protocol version and a wrong MAC to the
# coordinator's TCP port; a malformed frame, an oversized frame, a frame one byte over the
# 64 KiB request limit and a request before Hello to both daemons' RPC sockets; garbage to
# the receiver's data port. Each must get an Error that names the problem (or be dropped),
# and none may disturb the refits in flight. Then, between
# two runs (every client slot is taken while the simulators run), pieces registered through
# the Python package with an unknown region, a box outside its shape, strides running out of
# the region, and a memfd smaller than claimed: each must fail naming the problem, with
# nothing half-registered. Finally the same daemons must run more refits, every byte verified.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$BIN/librefit.so" ] || fail "$BIN/librefit.so not built"

start_publisher 0 2
start_receiver 0 4
st_wait "$E2E_DIR/pub0.sock" 10 "the coordinator up" 'cl["state"] == "idle"'
# The data port it picked (:0) is in the log only.
wait_for "$E2E_DIR/recv0.log" "status endpoint" 10
DATA_PORT=$(sed -n 's/.*transport tcp on 127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$E2E_DIR/recv0.log" | head -n 1)
[ -n "$DATA_PORT" ] || fail "no data port in $E2E_DIR/recv0.log"

# The hand-made frames below come from tests/e2e/pbwire.py.
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
cat > "$E2E_DIR/frames.py" <<'EOF'
import os, socket, struct, sys, threading, time

from pbwire import PEER_PROTOCOL, field, frame, parse_fields, read_varint, varint

port, rpc_socks, data_port = int(sys.argv[1]), sys.argv[2:4], int(sys.argv[4])
results, lock = [], threading.Lock()


def read_frames(s, timeout, stop):
    """Frames from s until stop(frames) is true, the peer closes, or timeout passes.
    Returns (frames, closed, seconds)."""
    t0 = time.monotonic()
    s.settimeout(0.1)
    data, frames, closed = b"", [], False
    while time.monotonic() - t0 < timeout and not stop(frames):
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            closed = True
            break
        if not chunk:
            closed = True
            break
        data += chunk
        while len(data) >= 4 and len(data) >= 4 + struct.unpack(">I", data[:4])[0]:
            n = struct.unpack(">I", data[:4])[0]
            frames.append(data[4:4 + n])
            data = data[4 + n:]
    return frames, closed, time.monotonic() - t0


def envelope_error(frames):
    """(code, message) of the first Error envelope (field 13), or None."""
    for f in frames:
        env = parse_fields(f)
        if 13 in env:
            e = parse_fields(env[13])
            code = e.get(1, 0)
            if code >= 1 << 63:
                code -= 1 << 64
            return code, e.get(2, b"").decode(errors="replace")
    return None


def report(case, ok, detail):
    with lock:
        results.append((case, ok, detail))


def tcp_case(case, payload, expect, shut=False, timeout=5):
    """Sends payload on a fresh connection to the coordinator; expect: a phrase the Error
    must contain, or None for 'the daemon closes the connection without one'."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if callable(payload):
            payload = payload(s)
        s.sendall(payload)
        if shut:
            s.shutdown(socket.SHUT_WR)
        frames, closed, secs = read_frames(s, timeout, lambda fr: False)
        s.close()
    except OSError as e:
        return report(case, False, "socket error %s" % e)
    err = envelope_error(frames)
    if expect is None:
        ok = closed and err is None
        return report(case, ok, "closed after %.1f s, error %s" % (secs, err) if closed else
                      "connection still open after %.0f s" % secs)
    if err is None:
        return report(case, False, "no Error frame (closed %s, %d frames)" % (closed, len(frames)))
    ok = expect in err[1] and err[0] < 0 and closed
    report(case, ok, "Error %d %r%s" % (err[0], err[1], "" if closed else ", connection left open"))


def rpc_case(case, path, payload, expect, want_close):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(payload)
        frames, closed, secs = read_frames(s, 5, lambda fr: len(fr) > 0 and not want_close)
        s.close()
    except OSError as e:
        return report(case, False, "socket error %s" % e)
    if not frames:
        return report(case, False, "no Response (closed %s)" % closed)
    r = parse_fields(frames[0])
    code = r.get(2, 0)
    code = (code >> 1) ^ -(code & 1)  # sint32
    msg = r.get(3, b"").decode(errors="replace")
    ok = code < 0 and expect in msg and (closed or not want_close)
    report(case, ok, "Response code %d %r%s" % (code, msg, ", closed" if closed else ""))


def data_case(case, payload):
    try:
        s = socket.create_connection(("127.0.0.1", data_port), timeout=5)
        s.sendall(payload)
        frames, closed, secs = read_frames(s, 5, lambda fr: False)
        s.close()
    except OSError as e:
        return report(case, False, "socket error %s" % e)
    report(case, closed, "closed after %.1f s" % secs if closed else "still open after 5 s")


def wrong_mac(s):
    """Reads the daemon's Hello and Challenge, answers as a publisher with a zero MAC."""
    frames, closed, _ = read_frames(s, 5, lambda fr: len(fr) >= 2)
    if len(frames) < 2 or 2 not in parse_fields(frames[1]):
        raise OSError("the daemon sent no Hello and Challenge")
    hello = field(1, PEER_PROTOCOL) + field(2, 1) + field(3, b"e2e-intruder") + field(4, 4242) + field(6, 0)
    return (frame(field(1, hello)) + frame(field(2, field(1, os.urandom(32)))) +
            frame(field(3, field(1, bytes(32)))))


commit_before_hello = frame(field(11, field(1, 5)))
hello_v99 = frame(field(1, field(1, 99) + field(2, 1) + field(3, b"e2e-old")))
cases = [
    ("tcp: garbage bytes", b"\x00\x00\x00\x10" + b"\xff" * 16, "do not decode"),
    ("tcp: text garbage (huge length)", b"GET / HTTP/1.0\r\n\r\n", "exceeds the maximum"),
    ("tcp: oversized length prefix", b"\x7f\xff\xff\xff", "exceeds the maximum"),
    ("tcp: empty frame", b"\x00\x00\x00\x00", "without a message body"),
    ("tcp: Commit before Hello", commit_before_hello, "before authentication"),
    ("tcp: Hello of protocol 99", hello_v99, "protocol version mismatch"),
    ("tcp: wrong MAC", wrong_mac, "authentication failed"),
]
threads = [threading.Thread(target=tcp_case, args=c) for c in cases]
# A truncated frame: cut by the peer's close, and left hanging (the handshake timeout,
# peer_timeout_ms = 2 s here, must end it).
threads.append(threading.Thread(target=tcp_case, args=(
    "tcp: truncated frame, then close", b"\x00\x00\x01\x00" + b"\x0a" * 10, None, True)))
threads.append(threading.Thread(target=tcp_case, args=(
    "tcp: truncated frame, left open", b"\x00\x00\x01\x00" + b"\x0a" * 10, None, False, 8)))
for path in rpc_socks:
    who = os.path.basename(path)
    threads += [
        threading.Thread(target=rpc_case, args=("rpc %s: malformed frame" % who, path,
                         b"\x00\x00\x00\x08" + b"\xff" * 8, "malformed request frame", True)),
        threading.Thread(target=rpc_case, args=("rpc %s: oversized frame" % who, path,
                         b"\x7f\xff\xff\xff" + b"\x00" * 64,
                         "larger than the maximum of 65536 bytes", True)),
        # One byte over the request limit: refused on the length, though the daemons take
        # frames of max_frame_mib (64 MiB) from their peers.
        threading.Thread(target=rpc_case, args=("rpc %s: frame of 64 KiB + 1" % who, path,
                         b"\x00\x01\x00\x01" + b"\x00" * 64,
                         "request frame of 65537 bytes is larger than the maximum of 65536 bytes",
                         True)),
        threading.Thread(target=rpc_case, args=("rpc %s: request before Hello" % who, path,
                         frame(field(1, 1) + field(5, b"")), "Hello", False)),
    ]
threads.append(threading.Thread(target=data_case, args=("data port: garbage", b"\xde\xad" * 40)))
for t in threads:
    t.start()
for t in threads:
    t.join()
bad = [r for r in results if not r[1]]
for case, ok, detail in sorted(results):
    print("%s %s: %s" % ("ok  " if ok else "FAIL", case, detail))
sys.exit(1 if bad else 0)
EOF

cat > "$E2E_DIR/register.py" <<'EOF'
import json, os, sys
import refit

checks = []


def expect_error(what, phrase, fn):
    try:
        fn()
    except refit.Error as e:
        ok = e.code < 0 and all(p in e.message for p in phrase)
        checks.append((ok, "%s: %s" % (what, e.message)))
        return
    checks.append((False, "%s: accepted" % what))


for sock, kind in ((sys.argv[1], refit.TRAINER), (sys.argv[2], refit.ENGINE)):
    who = os.path.basename(sock)
    with refit.Client(kind, "e2e-bad", rank=0, socket=sock) as c:
        buf = c.alloc_host(64)  # 4 x 4 fp32 fits exactly
        expect_error(who + " unknown region", ["bad.region", "unknown region 7"], lambda:
                     c.add_piece("bad.region", "fp32", [4, 4], 7, 0, [0, 0], [4, 4]))
        expect_error(who + " box outside the shape", ["bad.box", "outside its shape"], lambda:
                     c.add_piece("bad.box", "fp32", [4, 4], buf.region, 0, [2, 0], [4, 4]))
        expect_error(who + " strides outside the region", ["bad.strides", "outside its registered region"],
                     lambda: c.add_piece("bad.strides", "fp32", [4, 4], buf.region, 0, [0, 0],
                                         [4, 4], strides=[8, 1]))
        fd = os.memfd_create("e2e-small", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
        expect_error(who + " memfd smaller than claimed", ["memfd is 4096 bytes", "smaller"],
                     lambda: c.register_memfd(fd, 1 << 20))
        os.close(fd)
        # Nothing half-registered: one region, no pieces; a valid piece still goes in.
        c.add_piece("ok.tensor", "fp32", [4, 4], buf.region, 0, [0, 0], [4, 4])
        st = json.loads(c.status())
        mine = [x for x in st["clients"]["clients"] if x.get("name") == "e2e-bad"]
        if len(mine) != 1 or mine[0].get("regions") != 1 or mine[0].get("pieces") != 1:
            checks.append((False, "%s: after the failures the client holds %s, expected 1 "
                           "region and 1 piece" % (who, mine)))
        else:
            checks.append((True, "%s: 1 region and 1 piece registered after the failures" % who))
for ok, msg in checks:
    print("%s %s" % ("ok  " if ok else "FAIL", msg))
sys.exit(0 if all(ok for ok, _ in checks) else 1)
EOF

# Run 1: 20 refits; the bad frames go in while they run.
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 20
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 20
st_wait "$E2E_DIR/pub0.sock" 30 "version 2 committed (refits running)" 'cl["committed"] >= 2'
# A client joining while every slot is taken is refused, and says why.
out=$(PYTHONPATH=$ROOT/client/python REFIT_LIB=$BIN/librefit.so python3 -c '
import sys, refit
try:
    refit.Client(refit.TRAINER, "e2e-extra", rank=5, socket=sys.argv[1]).close()
    print("admitted")
except refit.Error as e:
    print(e.message)' "$E2E_DIR/pub0.sock" 2>&1)
# The trainers hold both slots until version 20 is committed.
run1_running() { st_check "$E2E_DIR/pub0.sock" 0 x 'cl["committed"] < 20' > /dev/null; }
if run1_running; then
    echo "$out" | grep -q "all are connected" ||
        fail "a third trainer on a daemon expecting 2, mid-run: $out"
fi
python3 "$E2E_DIR/frames.py" "$E2E_COORD_PORT" "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock" \
    "$DATA_PORT" || fail "bad frames (above)"
run1_running || echo "note: the refits ended before the last bad frame went in"
wait_ok tr eng
grep -q "version 20 committed.*0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 20"
if grep -qi "abort" "$E2E_DIR/eng.log" "$E2E_DIR/tr.log"; then
    fail "bad input disturbed the refits in flight: $(grep -i abort "$E2E_DIR/eng.log" "$E2E_DIR/tr.log" | head -3)"
fi
# Nor did any daemon see an error: no abort, no failed data path, no plan refused.
st_committed 10 20 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"

# Between runs, on the same live daemons: bad registrations through the Python package.
PYTHONPATH=$ROOT/client/python REFIT_LIB=$BIN/librefit.so \
    python3 "$E2E_DIR/register.py" "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock" ||
    fail "bad registrations (above)"

# Both daemons are still up and the bad registrations left no error behind; the cluster still
# refits, every byte verified.
for d in pub0 recv0; do
    ctl --socket "$E2E_DIR/$d.sock" status > /dev/null 2>&1 || fail "$d no longer answers refitctl status"
done
st_committed 0 20 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
start_engine eng2 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --start 21 --versions 3
start_trainer tr2 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --start 21 --versions 3
wait_ok tr2 eng2
grep -q "version 23 committed.*0 wrong" "$E2E_DIR/eng2.log" ||
    fail "engine did not verify version 23 after the bad input"
st_committed 10 23 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: bad frames, RPC requests and registrations refused with their reasons; refits 1-23 verified"

# The forged data hello of protocol 1 (peer 0 to peer 1, no proof of the cluster key), sent to
# the receiver's data port again and again while 20 more refits run: each must be dropped and
# logged, and no refit may abort (it used to replace the publisher's data connection).
cat > "$E2E_DIR/forge.py" <<'EOF2'
import socket, struct, sys, time

data_port, eng_log, last = int(sys.argv[1]), sys.argv[2], sys.argv[3]


def run_over():
    with open(eng_log) as f:
        return last in f.read()


sent = closed = late = 0
t0 = time.monotonic()
while time.monotonic() - t0 < 60 and not run_over():
    s = socket.create_connection(("127.0.0.1", data_port), timeout=5)
    s.sendall(struct.pack("<IIII", 0x48584652, 1, 0, 1))
    sent += 1
    # Dropped: the daemon closes it (after its 32-byte nonce). The data port accepts while a
    # refit runs, so one sent as the last refit ends may wait in the backlog: not counted.
    s.settimeout(5)
    try:
        while s.recv(4096):
            pass
        closed += 1
    except socket.timeout:
        late += run_over()
    except ConnectionResetError:
        closed += 1
    s.close()
    time.sleep(0.02)
print("forged hellos: %d sent during the run, %d dropped, %d left waiting after the last "
      "refit" % (sent, closed, late))
sys.exit(0 if sent - late >= 3 and closed + late == sent else 1)
EOF2
start_engine eng3 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --start 24 --versions 20
start_trainer tr3 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --start 24 --versions 20
st_wait "$E2E_DIR/pub0.sock" 30 "version 24 committed" 'cl["committed"] >= 24'
python3 "$E2E_DIR/forge.py" "$DATA_PORT" "$E2E_DIR/eng3.log" "version 43 committed" ||
    fail "forged data hellos were not all dropped mid-run (above)"
wait_ok tr3 eng3
grep -q "version 43 committed.*0 wrong" "$E2E_DIR/eng3.log" ||
    fail "engine did not verify version 43 with forged data hellos coming in"
[ "$(grep -c "committed.*0 wrong" "$E2E_DIR/eng3.log")" = 20 ] ||
    fail "not every refit of versions 24-43 was committed and verified"
if grep -qi "abort" "$E2E_DIR/eng3.log" "$E2E_DIR/tr3.log"; then
    fail "a forged data hello disturbed a refit: $(grep -i abort "$E2E_DIR/eng3.log" "$E2E_DIR/tr3.log" | head -3)"
fi
st_committed 10 43 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
grep -q "dropped the data connection from 127.0.0.1:.*protocol 1" "$E2E_DIR/recv0.log" ||
    fail "the receiver did not log the forged data hellos it dropped"
echo "ok: forged data hellos dropped and logged; refits 24-43 verified"
