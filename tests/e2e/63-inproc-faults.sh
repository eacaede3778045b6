#!/bin/bash
# In-process installs under faults (issue #12, items 4 and 5): engines whose memory no daemon
# can map (refit-sim-engine --inproc) install with their own librefit installer, and
#  - a trainer, an engine or the receiverd killed (-9) while a version's installs run: the
#    engine is stopped before the version is published, so the receiverd's status shows its
#    installs running with no installer answered when the victim is killed (the engine, if it
#    survives, continues once the coordinator aborted); the receiverd's log says the version
#    failed, not moved; nothing commits, and the next refit with the victim back commits with
#    every byte verified;
#  - an engine stopped (SIGSTOP) while its installers hold a version's install, which is then
#    aborted (its trainer killed): its installers cannot answer the abort, the receiverd gives
#    them up after RF_INSTALL_ABORT_WAIT_S and the version ends aborted; once continued, the
#    same engine takes the next refit (its plan sent again) with every byte verified;
#  - trainers on another host (another host_id): the plan would send bytes over the network
#    into in-process memory, which the receiverd refuses, naming the engine; nothing commits.
# The engine stopped (SIGSTOP) before a version is published holds its installs in flight, so
# no scenario needs an install to be slow: qwen3-0.6b shrunk, verify as the suite's default.
. "$(dirname "$0")/lib.sh"
E2E_LOCAL_COPY=auto
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 4"

# hold_install V: stops the engine once it consumed version V - 1 (its gate open) and publishes
# V: the status then shows V's installs running, none answered and not aborting.
hold_install() {
    st_wait "$E2E_DIR/recv0.sock" 60 "the engines consumed version $(($1 - 1))" \
        'all(c.get("consumed", 0) >= '"$(($1 - 1))"' for c in s["clients"]["clients"]
    if c["kind"] == "engine")'
    kill -STOP "$eng_PID"
    echo "$1" > "$E2E_DIR/go"
    st_wait "$E2E_DIR/recv0.sock" 60 "version $1's installers running, none answered" \
        's["installing"] and s["installing"]["version"] == '"$1"' and
s["installing"]["unanswered"] == s["installing"]["installers"] > 0 and
not s["installing"]["aborting"]'
}

# gone SOCKET: waits until the daemon on SOCKET has no client left.
gone() {
    st_wait "$1" 30 "the killed clients of $1 gone" 's["clients"]["connected_clients"] == 0'
}

aborted() {
    st_wait "$E2E_DIR/pub0.sock" 60 "$2: version $1 aborted, $(($1 - 1)) stays" \
        'cl["committed"] == '"$(($1 - 1))"' and cl["last_refit"]["version"] == '"$1"' and
cl["last_refit"]["result"] == "aborted"'
}

start_pair() {
    start_publisher 0 2
    start_receiver 0 4
    echo 1 > "$E2E_DIR/go"
    start_engine eng 0 $M --layout tp=4 --versions 100 --inproc
    start_trainer tr 0 $M --layout tp=2 --versions 100 --publish-when "$E2E_DIR/go"
    st_committed 120 1 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    grep -q "in-process installs: 4 engines" "$E2E_DIR/recv0.log" ||
        fail "the engines did not install in their own process"
}

kill_scenario() {
    local victim=$1 v=2 pid
    e2e_new_cluster "$victim"
    start_pair
    # Deterministic: the engine is stopped once it consumed version 1 and before version 2 is
    # published, so version 2's installs run and none can answer (the status shows it) when the
    # victim is killed; a surviving engine continues only once the coordinator aborted.
    hold_install "$v"
    case $victim in
        trainer) pid=$tr_PID ;; engine) pid=$eng_PID ;; receiverd) pid=$RECV0_PID ;;
    esac
    kill -9 "$pid"
    wait_for "$E2E_DIR/pub0.log" "aborting the refit of version $v" 60
    [ "$victim" = engine ] || kill -CONT "$eng_PID"
    case $victim in
        engine)
            wait_for "$E2E_DIR/recv0.log" "version $v failed" 60
            grep -q "version $v: moved" "$E2E_DIR/recv0.log" && fail "engine: version $v moved" ;;
        trainer)
            # The continued installers may copy on from the killed trainer's memory, which they
            # keep mapped, before they read the abort: the version settles, it never commits.
            wait_for "$E2E_DIR/recv0.log" "version $v failed\|version $v: moved" 60 ;;
    esac
    aborted "$v" "$victim killed mid-install"
    kill -9 "$eng_PID" "$tr_PID" 2>/dev/null
    gone "$E2E_DIR/pub0.sock"
    if [ "$victim" = receiverd ]; then
        start_receiver 0 4
    else
        gone "$E2E_DIR/recv0.sock"
    fi
    start_engine eng2 0 $M --layout tp=4 --start "$((v + 1))" --versions 1 --inproc
    start_trainer tr2 0 $M --layout tp=2 --start "$((v + 1))" --versions 1
    wait_ok tr2 eng2
    grep -q "version $((v + 1)) committed.*0 wrong" "$E2E_DIR/eng2.log" || fail "$victim: not verified"
    st_committed 30 "$((v + 1))" "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    echo "ok: $victim killed mid-install of version $v: aborted, version $((v + 1)) committed after it"
}

# An installer that cannot answer the abort (its engine stopped) is given up; continued, the
# same engine takes the next refit. The engine is stopped once it consumed version 1 (its gate
# open, so version 2's install starts) and before version 2 is published: its installers then
# hold version 2's plan and run and cannot answer, which the status shows before the trainer is
# killed (no race with the copies' end).
stopped_scenario() {
    local v=2
    e2e_new_cluster stopped
    start_pair
    hold_install "$v"
    kill -9 "$tr_PID"
    wait_for "$E2E_DIR/recv0.log" "no answer to the abort of version $v" 60
    aborted "$v" "engine stopped mid-install, its installer given up"
    grep -q "version $v: moved" "$E2E_DIR/recv0.log" && fail "stopped: version $v moved"
    kill -CONT "$eng_PID"
    # The engine still waits for version v (never committed); a new trainer publishes v + 1.
    gone "$E2E_DIR/pub0.sock"
    start_trainer tr2 0 $M --layout tp=2 --start "$((v + 1))" --versions 1
    wait_ok tr2
    st_committed 60 "$((v + 1))" "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
    wait_for "$E2E_DIR/eng.log" "version $((v + 1)) committed.*0 wrong" 60
    echo "ok: engine stopped with version $v's install running: given up, aborted; continued, it took version $((v + 1))"
}

# Trainers on another host: bytes into in-process memory would cross the network.
remote_scenario() {
    local rc
    e2e_new_cluster remote
    start_publisher 0 2 --host-id trainers-host
    start_receiver 0 4 --host-id engines-host
    start_engine eng 0 $M --shrink 8 --layout tp=4 --versions 1 --inproc
    # No retry: the trainer gives up after the refusal and exits by itself (its exit path runs
    # under the sanitizers' leak check too), rather than being killed mid-run.
    start_trainer tr 0 $M --shrink 8 --layout tp=2 --versions 1 --retries 0
    wait_for "$E2E_DIR/recv0.log" "plan slice refused: .*over the network into the in-process memory of engine" 60
    st_wait "$E2E_DIR/recv0.sock" 30 "the refusal in the receiverd's status" \
        '"in-process memory of engine" in s["last_error"] and s["committed"] == 0'
    st_wait "$E2E_DIR/pub0.sock" 60 "remote: nothing committed" \
        'cl["committed"] == 0 and cl["last_refit"]["version"] == 1 and
cl["last_refit"]["result"] == "aborted"'
    # The trainer is told why its version did not go out.
    wait_for "$E2E_DIR/tr.log" "refused the plan: .*in-process memory of engine" 30
    wait "$tr_PID"
    rc=$?
    [ $rc -eq 1 ] || fail "remote: the trainer exited $rc after the refusal, not 1"
    grep -q "giving up on version 1" "$E2E_DIR/tr.log" || fail "remote: the trainer did not give up"
    kill -9 "$eng_PID" 2>/dev/null
    echo "ok: network bytes into in-process memory refused, naming the engine; nothing committed"
}

for s in ${*:-trainer engine receiverd stopped remote}; do
    case $s in
        stopped) stopped_scenario ;; remote) remote_scenario ;; *) kill_scenario "$s" ;;
    esac
done
