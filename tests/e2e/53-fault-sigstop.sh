#!/bin/bash
# Fault matrix (issue #10), SIGSTOP past the peer timeout (2000 ms) during a refit: receiverd 1
# (the coordinator drops it and aborts), publisherd 1 (stopped after it said version 2 is ready,
# so the refit waits on it) and the coordinator publisherd (the other daemons drop it); each
# then resumed (SIGCONT). Fresh clients publish 10 and 11: both must commit with every byte
# verified, nothing else may. lib.sh (fm_scenario) has the details.
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] && FM_ONLY=$(echo "$*" | tr ' ' ',')
fm_run stop:recv stop:pub1 stop:coord
echo "ok: SIGSTOP past the peer timeout of every daemon role: every scenario recovered"
