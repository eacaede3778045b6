#!/bin/bash
# The coordinator busy-polls only while a refit waits for its last Done: with a cap of 60 s,
# after the refits committed it must be idle again (a spin left running would burn a core).
# Also a cap of 0 (off) refits as well.
. "$(dirname "$0")/lib.sh"
cpu_ticks() { # utime + stime of a process, in clock ticks
    awk '{ print $14 + $15 }' "/proc/$1/stat"
}
for cap in 60000 0; do
    E2E_PUBLISHERS=1 E2E_RECEIVERS=1
    start_publisher 0 2 --busy-poll-ms "$cap"
    start_receiver 0 4
    start_engine "eng$cap" 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 3
    start_trainer "tr$cap" 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 3
    wait_ok "tr$cap" "eng$cap"
    grep -q "version 3 committed.*0 wrong" "$E2E_DIR/eng$cap.log" ||
        fail "busy_poll_ms=$cap: engine did not verify version 3"
    st_committed 10 3 clean "$E2E_DIR/pub0.sock"
    a=$(cpu_ticks "$PUB0_PID")
    sleep 2
    b=$(cpu_ticks "$PUB0_PID")
    hz=$(getconf CLK_TCK)
    # Idle: heartbeats and the status refresh only; a spinning loop would show ~2 s.
    [ $((b - a)) -le $((hz / 4)) ] ||
        fail "busy_poll_ms=$cap: the coordinator used $((b - a))/$hz s of CPU in 2 s after the last commit"
    echo "ok: busy_poll_ms=$cap: 3 refits verified, $((b - a))/$hz s of CPU in the 2 s after"
    kill "$PUB0_PID" "$RECV0_PID"
    wait "$PUB0_PID" "$RECV0_PID" 2>/dev/null
done
