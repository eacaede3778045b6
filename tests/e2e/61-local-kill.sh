#!/bin/bash
# Same-host refits under kills (issue #12, item 5): a trainer, an engine or the receiverd itself
# killed (-9) while the receiverd copies trainer memory into engine memory. The kill must land
# while the version's data path is in flight: the receiverd runs with REFIT_TEST_JOB_HOLD, so a
# job that has moved bytes holds while the hold file exists, and the test kills once the log
# says the version is held. Then: the version never commits, and the next refit with the victim
# back commits with every byte verified.
. "$(dirname "$0")/lib.sh"
E2E_LOCAL_COPY=auto
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 4"

# gone SOCKET: waits until the daemon on SOCKET has no client left (a killed one's ranks are
# free to register again).
gone() {
    st_wait "$1" 30 "the killed clients of $1 gone" 's["clients"]["connected_clients"] == 0'
}

scenario() {
    local victim=$1 v=2 pid
    e2e_new_cluster "$victim"
    start_publisher 0 2
    REFIT_TEST_JOB_HOLD="$E2E_DIR/hold" start_receiver 0 4
    echo 1 > "$E2E_DIR/go"
    start_engine eng 0 $M --layout tp=4 --versions 100
    start_trainer tr 0 $M --layout tp=2 --versions 100 --publish-when "$E2E_DIR/go"
    st_committed 120 1 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    touch "$E2E_DIR/hold"
    echo "$v" > "$E2E_DIR/go"
    wait_for "$E2E_DIR/recv0.log" "version $v held in flight" 60
    case $victim in
        trainer) pid=$tr_PID ;; engine) pid=$eng_PID ;; receiverd) pid=$RECV0_PID ;;
    esac
    kill -9 "$pid"
    if [ "$victim" = receiverd ]; then
        wait_for "$E2E_DIR/pub0.log" "aborting the refit of version $v" 60
    else
        wait_for "$E2E_DIR/recv0.log" "version $v failed" 60
    fi
    grep -q "version $v: moved" "$E2E_DIR/recv0.log" && fail "$victim: version $v moved"
    rm "$E2E_DIR/hold"
    st_wait "$E2E_DIR/pub0.sock" 60 "$victim killed mid-copy of version $v: aborted, $((v - 1)) stays" \
        'cl["committed"] == '"$((v - 1))"' and cl["last_refit"]["version"] == '"$v"' and
cl["last_refit"]["result"] == "aborted"'
    # The victim comes back (with fresh clients: the survivors still wait for version v); the
    # next refit commits with every byte verified.
    kill -9 "$eng_PID" "$tr_PID" 2>/dev/null
    gone "$E2E_DIR/pub0.sock"
    if [ "$victim" = receiverd ]; then
        start_receiver 0 4
    else
        gone "$E2E_DIR/recv0.sock"
    fi
    start_engine eng2 0 $M --layout tp=4 --start "$((v + 1))" --versions 1
    start_trainer tr2 0 $M --layout tp=2 --start "$((v + 1))" --versions 1
    wait_ok tr2 eng2
    grep -q "version $((v + 1)) committed.*0 wrong" "$E2E_DIR/eng2.log" || fail "$victim: not verified"
    st_committed 30 "$((v + 1))" "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    echo "ok: $victim killed mid-copy of version $v: aborted, version $((v + 1)) committed after it"
}

for victim in ${*:-trainer engine receiverd}; do scenario "$victim"; done
