#!/bin/bash
# Same-host refits under kills (issue #12, item 5): a trainer, an engine or the receiverd itself
# killed (-9) while the receiverd copies trainer memory into engine memory. The kill must land
# mid-copy, and the test proves it did: the receiverd's status showed the version's copy under
# way (0 < bytes done < total) just before the kill, and the receiverd's log says the copy ended
# failed, not moved (a kill that missed the copy is retried with the next version). Then: the
# version never commits, and the next refit with the victim back commits with every byte
# verified. qwen3-0.6b at full size (1.2 GB a side) with verify = full, whose digests of both
# sides make a copy last seconds (a plain copy takes ~0.06 s here), long enough to catch.
. "$(dirname "$0")/lib.sh"
E2E_LOCAL_COPY=auto
E2E_COMMON="$E2E_COMMON --verify full"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b"

# mid_copy V: waits until the receiverd copies version V (0 < done < total); 1 when V committed
# or failed first (the copy was missed).
mid_copy() {
    st_check "$E2E_DIR/recv0.sock" 60 "version $1 being copied" \
        '(s["refit_in_flight"] == '"$1"' and 0 < s["progress"]["bytes_done"] < s["progress"]["bytes_total"]) or
s["last_refit"]["version"] >= '"$1" > /dev/null && 
        st_check "$E2E_DIR/recv0.sock" 0 "copy in flight" 's["refit_in_flight"] == '"$1" > /dev/null
}

# gone SOCKET: waits until the daemon on SOCKET has no client left (a killed one's ranks are
# free to register again).
gone() {
    st_wait "$1" 30 "the killed clients of $1 gone" 's["clients"]["connected_clients"] == 0'
}

scenario() {
    local victim=$1 v caught="" pid
    e2e_new_cluster "$victim"
    start_publisher 0 2
    start_receiver 0 4
    echo 1 > "$E2E_DIR/go"
    start_engine eng 0 $M --layout tp=4 --versions 100
    start_trainer tr 0 $M --layout tp=2 --versions 100 --publish-when "$E2E_DIR/go"
    st_committed 120 1 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    for v in 2 3 4 5 6; do
        echo "$v" > "$E2E_DIR/go"
        mid_copy "$v" || { st_committed 60 "$v" "$E2E_DIR/pub0.sock"; continue; }
        case $victim in
            trainer) pid=$tr_PID ;; engine) pid=$eng_PID ;; receiverd) pid=$RECV0_PID ;;
        esac
        kill -9 "$pid"
        if [ "$victim" = receiverd ]; then
            # Mid-copy unless the copy ended between the last status and the kill (its log
            # would say so).
            wait_for "$E2E_DIR/pub0.log" "aborting the refit of version $v" 60
            grep -q "version $v failed\|version $v: moved" "$E2E_DIR/recv0.log" || caught=$v
        else
            wait_for "$E2E_DIR/recv0.log" "version $v failed\|version $v: moved" 60
            grep -q "version $v failed" "$E2E_DIR/recv0.log" && caught=$v
        fi
        break
    done
    [ -n "$caught" ] || fail "$victim: no kill landed mid-copy in 5 versions"
    v=$caught
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
