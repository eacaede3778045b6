#!/bin/bash
# Fault matrix (issue #10), phase "before the plan": version 1 committed, the next trainers
# published version 5 and one engine registered, the other not, so the coordinator's /status
# shows no plan; then kill -9 of the coordinator publisherd, publisherd 1, receiverd 0, a
# trainer or an engine. A fresh set of clients (the dead daemon restarted) publishes 10 and 11:
# both must commit with every byte verified by the engines, and nothing else may commit (version
# 5's publishers are dead). lib.sh (fm_scenario) has the details. Arguments pick roles.
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] && FM_ONLY=$(echo "$*" | tr ' ' ',')

# --publish-when, which the matrix uses to time each publish, gives up when never allowed.
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 1
start_trainer gate 0 $FM_MODEL --layout tp=1 --publish-when "$E2E_DIR/never" --timeout-ms 300
wait "$gate_PID" && fail "a trainer never allowed to publish exited 0"
grep -q "version 1 was not allowed within 300 ms: .*never holds 0" "$E2E_DIR/gate.log" ||
    fail "the trainer did not say why it gave up: $(cat "$E2E_DIR/gate.log")"
kill "$PUB0_PID"
wait "$PUB0_PID" 2>/dev/null

fm_run plan:coord plan:pub1 plan:recv plan:trainer plan:engine
echo "ok: kill -9 of every role before the plan: every scenario recovered"
