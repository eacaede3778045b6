#!/bin/bash
# A client the daemon does not allow (SO_PEERCRED) is told why: refitctl prints the daemon's
# "uid ... is not allowed" and exits 1, never "Broken pipe". The daemon writes its refusal and
# closes; when the client's Hello goes out after that close, its write fails (EPIPE) and
# librefit must still read and show the refusal. strace delays that write so that this order
# is certain; without strace the run is repeated and the order left to chance.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
SOCK=$E2E_DIR/recv0.sock
if [ "$(id -u)" = 0 ]; then
    # root is always allowed: the client runs as nobody, who needs the way to the socket.
    start_receiver 0 1
    AS="setpriv --reuid=65534 --regid=65534 --clear-groups"
    STRACE_AS="-u nobody"
    WHO="uid 65534 gid 65534"
else
    # Only uid 4242 (and root) allowed: we are refused as ourselves.
    start_receiver 0 1 --socket-uids 4242
    AS=""
    STRACE_AS=""
    WHO="uid $(id -u) gid $(id -g)"
fi
wait_for "$E2E_DIR/recv0.log" "status endpoint on" 20
chmod 755 "$E2E_DIR"
chmod 666 "$SOCK"

# refused OUT: checks one refused run's output and exit status (in $rc).
refused() {
    [ "$rc" = 1 ] || fail "refused refitctl exited $rc, not 1: $(cat "$1")"
    grep -q "did not take us: .*$WHO (pid [0-9]*) is not allowed on $SOCK" "$1" ||
        fail "refitctl did not show the daemon's refusal: $(cat "$1")"
    grep -qi "broken pipe" "$1" && fail "refitctl said Broken pipe: $(cat "$1")"
    return 0
}

for i in $(seq 1 20); do
    $AS "$BIN/refitctl" --socket "$SOCK" status > "$E2E_DIR/ctl.out" 2>&1
    rc=$?
    refused "$E2E_DIR/ctl.out"
done
if command -v strace > /dev/null; then
    strace $STRACE_AS -f -o "$E2E_DIR/strace.out" -e trace=sendmsg \
        -e inject=sendmsg:delay_enter=300000 "$BIN/refitctl" --socket "$SOCK" status \
        > "$E2E_DIR/ctl.out" 2>&1
    rc=$?
    grep -q "EPIPE" "$E2E_DIR/strace.out" ||
        fail "the delayed Hello did not fail with EPIPE: $(cat "$E2E_DIR/strace.out")"
    refused "$E2E_DIR/ctl.out"
    echo "the Hello written after the daemon's close failed with EPIPE; the refusal was shown"
else
    echo "note: strace is not installed: the EPIPE order was left to chance (20 runs)"
fi
# The refusals cost the daemon nothing: it still serves allowed clients.
if [ "$(id -u)" = 0 ]; then
    ctl --socket "$SOCK" status > /dev/null || fail "the daemon no longer serves refitctl"
fi
kill -0 "$RECV0_PID" || fail "the receiverd died"
echo "ok: a refused client shows the daemon's reason, also when its write failed first"
