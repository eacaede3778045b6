# tests/e2e/lib.sh - starts real daemons and simulated clients on loopback for the end-to-end
# tests. Source it; every test gets its own directory, ports and cluster key, and everything
# it started is killed on exit.
set -u
BUILD=${BUILD:-build}
BIN=$(cd "$BUILD" && pwd)
E2E_DIR=$(mktemp -d /tmp/refit-e2e.XXXXXX)
E2E_PIDS=""
E2E_FAILED=0
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$E2E_DIR/cluster.key"
chmod 600 "$E2E_DIR/cluster.key"

e2e_cleanup() {
    for p in $E2E_PIDS; do kill "$p" 2>/dev/null; done
    sleep 0.2
    for p in $E2E_PIDS; do kill -9 "$p" 2>/dev/null; done
    if [ "$E2E_FAILED" = 0 ] && [ -z "${E2E_KEEP:-}" ]; then
        rm -rf "$E2E_DIR"
    else
        echo "logs kept in $E2E_DIR"
        for f in "$E2E_DIR"/*.log; do echo "--- $f"; tail -n 30 "$f"; done
    fi
}
trap e2e_cleanup EXIT

fail() {
    echo "FAIL: $*"
    E2E_FAILED=1
    exit 1
}

# A free TCP port on loopback.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

E2E_COORD_PORT=$(free_port)
E2E_COMMON="--cluster-key-file $E2E_DIR/cluster.key --coordinator-addr 127.0.0.1:$E2E_COORD_PORT
 --status-listen 127.0.0.1:0 --heartbeat-ms 200 --peer-timeout-ms 2000 --refit-timeout-s 30
 --log-level info"

# start_publisher INDEX CLIENTS [extra flags...]: index 0 is the coordinator.
start_publisher() {
    local idx=$1 clients=$2; shift 2
    local coord=""
    [ "$idx" = 0 ] && coord="--coordinator"
    ${E2E_WRAP_PUB:-} "$BIN/refit-publisherd" $E2E_COMMON $coord --index "$idx" --clients "$clients" \
        --publishers "$E2E_PUBLISHERS" --receivers "$E2E_RECEIVERS" \
        --socket "$E2E_DIR/pub$idx.sock" "$@" >> "$E2E_DIR/pub$idx.log" 2>&1 &
    E2E_PIDS="$E2E_PIDS $!"
    eval "PUB${idx}_PID=$!"
}

start_receiver() {
    local idx=$1 clients=$2; shift 2
    "$BIN/refit-receiverd" $E2E_COMMON --index "$idx" --clients "$clients" \
        --publishers "$E2E_PUBLISHERS" --receivers "$E2E_RECEIVERS" \
        --socket "$E2E_DIR/recv$idx.sock" "$@" >> "$E2E_DIR/recv$idx.log" 2>&1 &
    E2E_PIDS="$E2E_PIDS $!"
    eval "RECV${idx}_PID=$!"
}

# start_trainer NAME PUBLISHER-INDEX args...: a refit-sim-trainer in the background.
start_trainer() {
    local name=$1 idx=$2; shift 2
    "$BIN/refit-sim-trainer" --socket "$E2E_DIR/pub$idx.sock" "$@" > "$E2E_DIR/$name.log" 2>&1 &
    E2E_PIDS="$E2E_PIDS $!"
    eval "${name}_PID=$!"
}

start_engine() {
    local name=$1 idx=$2; shift 2
    "$BIN/refit-sim-engine" --socket "$E2E_DIR/recv$idx.sock" "$@" > "$E2E_DIR/$name.log" 2>&1 &
    E2E_PIDS="$E2E_PIDS $!"
    eval "${name}_PID=$!"
}

# wait_ok NAME...: waits for the named clients and fails unless each exited 0.
wait_ok() {
    local n pid
    for n in "$@"; do
        eval "pid=\$${n}_PID"
        wait "$pid" || fail "$n exited with status $? (see $E2E_DIR/$n.log)"
    done
}

# wait_for FILE PATTERN SECONDS: waits until a log line matches.
wait_for() {
    local i=0
    while ! grep -q -- "$2" "$1" 2>/dev/null; do
        i=$((i + 1))
        [ $i -gt $(($3 * 10)) ] && fail "no '$2' in $1 within $3 s"
        sleep 0.1
    done
}

ctl() {
    "$BIN/refitctl" "$@"
}

# wait_kill FILE PATTERN PID: kills PID (SIGKILL) the moment FILE shows PATTERN.
wait_kill() {
    local i=0
    while ! grep -q -- "$2" "$1" 2>/dev/null; do
        i=$((i + 1))
        [ $i -gt 6000 ] && fail "no '$2' in $1 within 60 s"
        sleep 0.01
    done
    kill -9 "$3"
}
