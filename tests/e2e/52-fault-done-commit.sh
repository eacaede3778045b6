#!/bin/bash
# Fault matrix (issue #10), phase "between Done and Commit": receiverd 1 is stopped (SIGSTOP)
# before version 2 is published; once the coordinator's /status shows the Done of publisherd 0,
# publisherd 1 and receiverd 0 in (the held one's not), kill -9 of the coordinator publisherd,
# publisherd 1, receiverd 0, a trainer or receiverd 0's engine, then SIGCONT. Fresh clients
# publish 10 and 11: both must commit with every byte verified, nothing else may. lib.sh
# (fm_scenario) has the details.
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] && FM_ONLY=$(echo "$*" | tr ' ' ',')
fm_run done:coord done:pub1 done:recv done:trainer done:engine
echo "ok: kill -9 of every role between Done and Commit: every scenario recovered"
