#!/bin/bash
# A cluster of nodes on this machine (issue #14 part 3, scripts/netns.sh): each daemon and its
# clients in a network namespace of their own, one veth each to a bridge, a token bucket of
# NC_TEST_RATE on both ends of every veth, transport tcp over host memory. One publisher ->
# four receivers, qwen3-0.6b (shrunk) tp=1 -> tp=1,dp=4 (a replica per receiver), two refits,
# every installed byte checked by the engines. Then the bytes must have crossed the
# rate-limited veths: each receiver's port on the bridge passed at least what its receiverd took
# in (and not far more), the publisher's link at least the sum, and no refit ran faster than the
# publisher's link allows. Before that, the clean-up: a run stopped by SIGTERM removes its
# namespaces and processes itself, and what a run killed by SIGKILL left is removed by the next.
# Skipped (exit 0) without root or where network namespaces cannot be made.
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/../../scripts/netns.sh"
REPO=$(cd "$(dirname "$0")/../.." && pwd)

if ! nc_available; then
    echo "skipped: $NC_WHY"
    exit 0
fi
# Root here; the two reasons to skip that other machines hit are checked for their message: not
# root, and root without the capability (a user namespace, as unprivileged containers give).
if command -v setpriv > /dev/null; then
    # The library comes on stdin: uid 65534 may not be allowed to read the checkout.
    why=$({ cat "$REPO/scripts/netns.sh"; echo 'nc_available || echo "$NC_WHY"'; } |
          setpriv --reuid=65534 --regid=65534 --clear-groups bash -s 2>&1)
    case $why in *"need root"*) ;; *) fail "nc_available as uid 65534 did not say it needs root: '$why'" ;; esac
fi
if unshare -r true 2>/dev/null; then
    why=$({ cat "$REPO/scripts/netns.sh"; echo 'nc_available || echo "$NC_WHY"'; } |
          unshare -r bash -s 2>&1)
    case $why in *"ip netns add"*" failed"*) ;;
        *) fail "nc_available in a user namespace did not say 'ip netns add' failed: '$why'" ;; esac
fi

# ---- clean-up of runs that were stopped ------------------------------------------------------
# alive PID: the process exists and is not a zombie (one killed in a namespace may wait a moment
# for its new parent to reap it).
alive() {
    [ -r "/proc/$1/stat" ] && ! grep -q ') Z ' "/proc/$1/stat" 2>/dev/null
}

# A child run makes a 1+1 cluster and starts a process in the receiver's namespace that lib.sh
# does not know of (only the namespace tells it is the run's), then says so in a file.
child_run() {
    BUILD=$BUILD bash -c ". '$REPO/tests/e2e/lib.sh'; . '$REPO/scripts/netns.sh'
        nc_setup 1 1 100mbit
        ip netns exec \$(nc_ns recv 0) sleep 1000 &
        echo \"\$NC_RUN \$! \$E2E_ROOT\" > '$1.tmp'; mv '$1.tmp' '$1'
        wait" > "$1.log" 2>&1 &
    CHILD_PID=$!
    wait_for "$1" . 10
    read -r CHILD_RUN CHILD_SLEEP CHILD_ROOT < "$1"
    [ "$(ip netns list | grep -c "^$CHILD_RUN-")" = 3 ] ||
        fail "the child run made $(ip netns list | grep -c "^$CHILD_RUN-") namespaces, not 3: \
$(ip netns list | tr '\n' ' ')"
}

child_run "$E2E_DIR/child-term"
kill -TERM "$CHILD_PID"
wait "$CHILD_PID"
rm -rf "$CHILD_ROOT"
[ -z "$(ip netns list | grep "^$CHILD_RUN-")" ] ||
    fail "a run stopped by SIGTERM left its namespaces: $(ip netns list | grep "^$CHILD_RUN-" | tr '\n' ' ')"
alive "$CHILD_SLEEP" &&
    fail "a run stopped by SIGTERM left process $CHILD_SLEEP running in its namespace"
echo "ok: a run stopped by SIGTERM removed its 3 namespaces and the process in one"

child_run "$E2E_DIR/child-kill"
# (bash reports the killed job on its own stderr)
{ kill -KILL "$CHILD_PID"; wait "$CHILD_PID"; } 2>/dev/null
rm -rf "$CHILD_ROOT"
[ "$(ip netns list | grep -c "^$CHILD_RUN-")" = 3 ] ||
    fail "the namespaces of a run killed by SIGKILL were gone before any clean-up ran"
alive "$CHILD_SLEEP" || fail "the process in the killed run's namespace died with it"

# ---- the cluster ------------------------------------------------------------------------------
RATE=${NC_TEST_RATE:-400mbit}
RECEIVERS=4
M="--model qwen3-0.6b --shrink 8"
# nc_setup reaps too; called alone first, its report can be kept apart from nc_setup's failures.
nc_reap > "$E2E_DIR/setup.txt"
cat "$E2E_DIR/setup.txt"
nc_setup 1 $RECEIVERS "$RATE"
grep -q "removed the namespaces of an earlier run (process $CHILD_PID)" "$E2E_DIR/setup.txt" ||
    fail "nc_setup did not say it removed the killed run's namespaces ($CHILD_RUN)"
[ -z "$(ip netns list | grep "^$CHILD_RUN-")" ] ||
    fail "the next run left the killed run's namespaces: $(ip netns list | grep "^$CHILD_RUN-" | tr '\n' ' ')"
alive "$CHILD_SLEEP" &&
    fail "the next run left process $CHILD_SLEEP running in the killed run's namespace"
echo "ok: the next run removed a SIGKILLed run's namespaces and the process in one"

# DAEMON_CONF reaches every daemon's config file: an unknown key stops the config check.
conf=$(DAEMON_CONF="no_such_key = 1" nc_conf recv 0)
out=$(ip netns exec "$(nc_ns recv 0)" "$BIN/refit-receiverd" --config "$conf" $E2E_COMMON --check-config 2>&1) &&
    fail "refit-receiverd accepted a config with DAEMON_CONF's unknown key: $out"
case $out in *"unknown key 'no_such_key'"*) ;; *) fail "the config check did not name DAEMON_CONF's key: $out" ;; esac

# Every byte also checked by digest (verify = full), through the same lines.
export DAEMON_CONF="verify = full"
nc_start_daemon pub 0 1
for ((r = 0; r < RECEIVERS; r++)); do
    nc_start_daemon recv $r 1
done
for ((r = 0; r < RECEIVERS; r++)); do
    nc_start_client engine e$r $r $M --layout tp=1,dp=$RECEIVERS --ranks $r-$r --versions 2
done
nc_start_client trainer t0 0 $M --layout tp=1 --versions 2 --report
wait_ok t0 e0 e1 e2 e3
for ((r = 0; r < RECEIVERS; r++)); do
    for v in 1 2; do
        grep -q "version $v committed.*, 0 wrong" "$E2E_DIR/e$r.log" ||
            fail "engine e$r did not verify version $v: $(tail -n 3 "$E2E_DIR/e$r.log")"
    done
done
st_committed 10 2 clean "$E2E_DIR/pub0.sock" "$E2E_DIR"/recv[0-3].sock
# The control connections came over the bridge, from each node's own address.
for ((r = 0; r < RECEIVERS; r++)); do
    grep -q "receiver $r (recv$r) joined from $(nc_addr recv $r):" "$E2E_DIR/pub0.log" ||
        fail "receiver $r did not join the coordinator from $(nc_addr recv $r): \
$(grep "receiver $r" "$E2E_DIR/pub0.log" | head -n 2)"
done

# The data went through the rate-limited veths. tc counts frames (headers included) and the
# control traffic too, so each link passed at least the payload its daemon counted, and at most
# a quarter more (headers are ~4.5% of 1500-byte frames; a retransmission now and then).
rate_bits=$(nc_rate_bits "$RATE")
total=0
for ((r = 0; r < RECEIVERS; r++)); do
    got=$(nc_metric recv $r 'refit_path_bytes_total\{path="network"\}')
    link=$(nc_tc_bytes recv $r down)
    [ -n "$got" ] && [ "$got" -gt 0 ] || fail "receiverd $r counted no network bytes ('$got')"
    [ -n "$link" ] && [ "$link" -ge "$got" ] ||
        fail "receiver $r's link passed $link bytes, less than the $got its receiverd took in: \
the data did not come through the rate-limited veth"
    [ "$link" -le $((got + got / 4 + 1048576)) ] ||
        fail "receiver $r's link passed $link bytes, far more than the $got its receiverd took in"
    echo "receiver $r: took in $got bytes, its link passed $link"
    total=$((total + got))
done
link=$(nc_tc_bytes pub 0 up)
[ -n "$link" ] && [ "$link" -ge "$total" ] ||
    fail "the publisher's link passed $link bytes, less than the $total the receivers took in"
echo "publisher 0: its link passed $link bytes for the receivers' $total"
# Each refit sent its bytes through the publisher's link: none may beat the rate (10% for the
# bucket's start and the clock's grain).
grep '^refit ' "$E2E_DIR/t0.log" > "$E2E_DIR/refits.txt"
[ "$(wc -l < "$E2E_DIR/refits.txt")" = 2 ] || fail "the trainer reported $(wc -l < "$E2E_DIR/refits.txt") refits, not 2"
while read -r _ v bytes _ _ _ _ _ xfer _; do
    awk -v b="$bytes" -v t="$xfer" -v r="$rate_bits" 'BEGIN { exit !(b * 8 / t <= r * 1.1) }' ||
        fail "refit $v moved $bytes bytes in $xfer s, faster than the publisher's $RATE link"
    echo "refit $v: $bytes bytes in $xfer s ($(awk -v b="$bytes" -v t="$xfer" 'BEGIN { printf "%.0f", b * 8 / t / 1e6 }') Mbit/s through a $RATE link)"
done < "$E2E_DIR/refits.txt"
echo "ok: 1 publisher -> $RECEIVERS receivers in network namespaces at $RATE, 2 refits verified"
