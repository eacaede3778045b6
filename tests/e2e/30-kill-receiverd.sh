#!/bin/bash
# receiverd killed in the middle of a refit: the coordinator aborts it, the committed version
# does not advance, the engines are told; receiverd restarts, the engines register again and
# the next refit commits with every byte right.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
M="--model qwen3-0.6b --shrink 2"
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 $M --layout tp=4 --versions 3
start_trainer tr 0 $M --layout tp=2 --versions 3 --retries 50
wait_for "$E2E_DIR/pub0.log" "refit 1 committed" 60
wait_kill "$E2E_DIR/pub0.log" "starting the refit of version 2" "$RECV0_PID"
wait_for "$E2E_DIR/pub0.log" "aborting the refit of version 2" 30
grep -q "refit 2 committed" "$E2E_DIR/pub0.log" && fail "version 2 committed without its receiver"
ctl --socket "$E2E_DIR/pub0.sock" status --json > "$E2E_DIR/st.json"
python3 -c 'import json,sys; st=json.load(open(sys.argv[1])); assert st["cluster"]["committed"]==1, st["cluster"]' "$E2E_DIR/st.json" \
    || fail "committed version moved during the abort"
start_receiver 0 4
wait_ok tr eng
grep -q "version 3 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
grep -q "aborted\|lost receiverd" "$E2E_DIR/eng.log" || fail "engine was not told about the abort"
echo "ok: receiverd killed mid-refit: aborted, restarted, next refits verified"
