#!/bin/bash
# The status endpoint follows state changes within milliseconds, not only at the daemon's 1 s
# tick: five refits 1.2 s apart (trainer --step-ms), the receiverd's /status polled every 5 ms;
# for every version, /status shows it committed within 0.25 s of the daemon's "version N
# committed" log line. (Were the snapshot refreshed only by the tick, each version would make
# it in time with odds of 1 in 4, all five with 1 in 1,000.)
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 16"
VERSIONS=5

start_publisher 0 1
start_receiver 0 1
st_port port "$E2E_DIR/recv0.log" 10

python3 - "$port" "$VERSIONS" "$E2E_DIR/poller.ready" > "$E2E_DIR/polls.txt" <<'PY' &
import json, sys, time, urllib.request

port, versions, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
seen = 0
deadline = time.time() + 60
while seen < versions and time.time() < deadline:
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/status" % port, timeout=2) as r:
            committed = json.load(r).get("committed", 0)
    except OSError:
        committed = seen
    else:
        if ready:
            open(ready, "w").write("polling\n")
            ready = None
    if committed > seen:
        for v in range(seen + 1, committed + 1):
            print(v, "%.3f" % time.time(), flush=True)
        seen = committed
    time.sleep(0.005)
PY
POLL_PID=$!
E2E_PIDS="$E2E_PIDS $POLL_PID"
wait_for "$E2E_DIR/poller.ready" polling 10

start_engine eng 0 $M --layout tp=1 --versions $VERSIONS
start_trainer tr 0 $M --layout tp=1 --versions $VERSIONS --step-ms 1200
wait_ok tr eng
wait "$POLL_PID" || fail "the status poller failed"

python3 - "$E2E_DIR/recv0.log" "$E2E_DIR/polls.txt" "$VERSIONS" <<'PY' || fail "stale /status"
import calendar, re, sys, time

log, polls, versions = sys.argv[1], sys.argv[2], int(sys.argv[3])
logged = {}
for line in open(log):
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3})Z .*version (\d+) committed$",
                 line.rstrip())
    if m:
        t = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
        logged[int(m.group(3))] = t + int(m.group(2)) / 1000
shown = {int(v): float(t) for v, t in (l.split() for l in open(polls))}
bad = []
for v in range(1, versions + 1):
    if v not in logged or v not in shown:
        bad.append("version %d: logged %s, shown %s" % (v, v in logged, v in shown))
    elif shown[v] - logged[v] > 0.25:
        bad.append("version %d shown %.3f s after its commit" % (v, shown[v] - logged[v]))
    else:
        print("version %d: /status %.3f s after the log line" % (v, shown[v] - logged[v]))
if bad:
    print("FAIL: " + "; ".join(bad))
    sys.exit(1)
PY
echo "ok: /status follows every commit within 0.25 s"
