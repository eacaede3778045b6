#!/bin/bash
# A daemon that cannot start says why and exits non-zero, without hanging or crashing: a status
# port already taken, a local socket it cannot create, a key file others can read, an unknown
# config key (start-up and --check-config), a key file that does not exist, a coordinator
# address already in use, addresses outside the one grammar; --check-config refuses what
# start-up refuses and takes ":0" for all interfaces.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 1
st_port TAKEN "$E2E_DIR/pub0.log" 20

# expect_exit CODE TEXT LOG -- command...: runs the daemon, checks its exit status and message.
expect_exit() {
    local code=$1 text=$2 log=$3 rc
    shift 4
    timeout 20 "$@" > "$log" 2>&1
    rc=$?
    [ $rc = "$code" ] || fail "exit $rc, not $code: $* ($(tail -n 3 "$log"))"
    grep -q -- "$text" "$log" || fail "no '$text' in the output of $*: $(tail -n 3 "$log")"
}

R="$BIN/refit-receiverd $E2E_COMMON --index 0 --clients 1 --publishers 1 --receivers 1"
expect_exit 1 "127.0.0.1:$TAKEN" "$E2E_DIR/port.log" -- \
    $R --socket "$E2E_DIR/r1.sock" --status-listen "127.0.0.1:$TAKEN"
expect_exit 1 "/proc/nope" "$E2E_DIR/sock.log" -- $R --socket /proc/nope/r.sock
cp "$E2E_DIR/cluster.key" "$E2E_DIR/open.key"
chmod 644 "$E2E_DIR/open.key"
expect_exit 78 "chmod 600" "$E2E_DIR/key.log" -- $R --socket "$E2E_DIR/r2.sock" \
    --cluster-key-file "$E2E_DIR/open.key"
expect_exit 78 "no/such.key" "$E2E_DIR/nokey.log" -- $R --socket "$E2E_DIR/r3.sock" \
    --cluster-key-file "$E2E_DIR/no/such.key"
printf 'stagin_mib = 4\n' > "$E2E_DIR/bad.conf"
expect_exit 78 "did you mean 'staging_mib'" "$E2E_DIR/conf.log" -- $R --config "$E2E_DIR/bad.conf"
expect_exit 1 "bad.conf:1: unknown key 'stagin_mib'" "$E2E_DIR/check.log" -- \
    "$BIN/refit-receiverd" --config "$E2E_DIR/bad.conf" --check-config
# --check-config refuses what start-up refuses (one check serves both), and start-up refuses
# it before it binds anything: the key file (missing, mode 0644), the socket path (longer than
# a Unix socket address takes, a file that is not a socket, under a file), and listen
# addresses that are not this machine's or do not resolve. A config error exits 78 at
# start-up; an address, which a network coming up may fix, exits 1 (systemd retries it).
C="$BIN/refit-receiverd $E2E_COMMON --index 0 --clients 1 --publishers 1 --receivers 1"
C="$C --check-config"
LONG="$E2E_DIR/$(printf 'l%.0s' $(seq 1 120)).sock"
touch "$E2E_DIR/plain"
# check_both TEXT START-CODE -- flags...: --check-config exits 1, start-up START-CODE, both
# with TEXT.
check_both() {
    local text=$1 code=$2
    shift 3
    expect_exit 1 "$text" "$E2E_DIR/check.log" -- $C "$@"
    grep -q "configuration is valid" "$E2E_DIR/check.log" && fail "--check-config said valid: $*"
    expect_exit "$code" "$text" "$E2E_DIR/start.log" -- $R "$@"
}
check_both "no/such.key" 78 -- --socket "$E2E_DIR/c1.sock" --cluster-key-file "$E2E_DIR/no/such.key"
check_both "has mode 0644" 78 -- --socket "$E2E_DIR/c2.sock" --cluster-key-file "$E2E_DIR/open.key"
check_both "Unix sockets allow at most 107" 78 -- --socket "$LONG"
check_both "exists and is not a socket" 78 -- --socket "$E2E_DIR/plain"
check_both "is not a directory" 78 -- --socket "$E2E_DIR/plain/r.sock"
check_both "'status_listen' 192.0.2.1:0: cannot listen on 192.0.2.1" 1 -- \
    --socket "$E2E_DIR/c3.sock" --status-listen 192.0.2.1:0
check_both "'data_listen' 192.0.2.1:0: cannot listen on 192.0.2.1" 1 -- \
    --socket "$E2E_DIR/c4.sock" --data-listen 192.0.2.1:0
check_both "'data_listen' nosuch.invalid:0: cannot resolve 'nosuch.invalid'" 1 -- \
    --socket "$E2E_DIR/c5.sock" --data-listen nosuch.invalid:0
# One address grammar (common/service/addr.c) for the config check and the sockets: ":0" and "*:0"
# listen on all interfaces; an IPv6 address needs brackets (the message shows them); a
# receiver connects to coordinator_addr, so it needs a host there and a real port.
expect_exit 0 "configuration is valid" "$E2E_DIR/check.log" -- $C --socket "$E2E_DIR/c7.sock" \
    --data-listen :0 --status-listen '*:0'
check_both "'data_listen': address '::1:7470' has an IPv6 address without brackets; \
write \[::1\]:7470" 78 -- --socket "$E2E_DIR/c8.sock" --data-listen ::1:7470
check_both "'status_listen': address '\[::1\]' has no port; write \[::1\]:PORT" 78 -- \
    --socket "$E2E_DIR/c9.sock" --status-listen '[::1]'
check_both "'coordinator_addr': address ':7470' names no host" 78 -- \
    --socket "$E2E_DIR/c10.sock" --coordinator-addr :7470
expect_exit 1 "'coordinator_addr' (connected to, as coordinator = false): \
address '127.0.0.1:0' has port 0" "$E2E_DIR/check.log" -- "$BIN/refit-publisherd" \
    $E2E_COMMON --index 1 --clients 1 --publishers 2 --receivers 1 \
    --socket "$E2E_DIR/c11.sock" --coordinator-addr 127.0.0.1:0 --check-config
expect_exit 1 "'coordinator_addr' 192.0.2.1:7470: cannot listen on 192.0.2.1" \
    "$E2E_DIR/check.log" -- "$BIN/refit-publisherd" $E2E_COMMON --coordinator --index 0 \
    --clients 1 --publishers 1 --receivers 1 --socket "$E2E_DIR/c6.sock" \
    --coordinator-addr 192.0.2.1:7470 --check-config
[ -e "$E2E_DIR/c1.sock" ] || [ -e "$E2E_DIR/c3.sock" ] && fail "a refused start left a socket"
# The running publisherd's own config is valid while it runs (its socket answers, its ports
# are taken), and checking it changes nothing: no directory made for a socket path.
expect_exit 0 "configuration is valid" "$E2E_DIR/check.log" -- "$BIN/refit-publisherd" \
    $E2E_COMMON --coordinator --index 0 --clients 1 --publishers 1 --receivers 1 \
    --socket "$E2E_DIR/pub0.sock" --status-listen "127.0.0.1:$TAKEN" --check-config
expect_exit 0 "configuration is valid" "$E2E_DIR/check.log" -- $C --socket "$E2E_DIR/new/dir/r.sock"
[ -e "$E2E_DIR/new" ] && fail "--check-config created the socket's directory"
# A second coordinator on the address the first one listens on: its listener fails after its
# handles were made; they are closed before the loop is (no "open handles" at exit).
COORD_ADDR=$(echo $E2E_COMMON | sed -n 's/.*--coordinator-addr \([^ ]*\).*/\1/p')
expect_exit 1 "$COORD_ADDR" "$E2E_DIR/coord.log" -- "$BIN/refit-publisherd" $E2E_COMMON \
    --coordinator --index 0 --clients 1 --publishers 1 --receivers 1 --socket "$E2E_DIR/p2.sock"
grep -q "open handles" "$E2E_DIR/coord.log" && fail "handles left open: $(cat "$E2E_DIR/coord.log")"
kill -0 "$PUB0_PID" || fail "the running publisherd died"
st_wait "$TAKEN" 5 "the running publisherd still serves /status, as coordinator, idle" \
    's["role"] == "coordinator" and cl["state"] == "idle"'
# A simulated trainer given a VMM allocation size that is no size.
expect_exit 2 "give the size of each VMM allocation in bytes" "$E2E_DIR/vmmchunk.log" -- \
    "$BIN/refit-sim-trainer" --model qwen3-0.6b --layout tp=1 --cuda-vmm-chunk abc
echo "ok: start-up errors named, exit codes 1 and 78; --check-config refuses the same"
