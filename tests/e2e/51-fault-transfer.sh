#!/bin/bash
# Fault matrix (issue #10), phase "during the transfer": receiverd 1 is stopped (SIGSTOP) before
# version 2 is published, so the refit starts and cannot finish; once the coordinator's /status
# shows it running, kill -9 of the coordinator publisherd, publisherd 1, the held receiverd, a
# trainer or the held receiverd's engine, then SIGCONT. Fresh clients publish 10 and 11: both
# must commit with every byte verified, nothing else may. lib.sh (fm_scenario) has the details.
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] && FM_ONLY=$(echo "$*" | tr ' ' ',')
fm_run transfer:coord transfer:pub1 transfer:recv transfer:trainer transfer:engine
echo "ok: kill -9 of every role during the transfer: every scenario recovered"
