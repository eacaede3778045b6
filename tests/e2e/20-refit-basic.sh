#!/bin/bash
# One publisher, one receiver, qwen3-0.6b (shrunk) tp=2 -> tp=4: three refits, every installed
# byte checked by the engines.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 3
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 3
wait_ok tr eng
grep -q "version 3 committed.*0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
st_committed 10 3 clean "$E2E_DIR/pub0.sock" "$E2E_DIR/recv0.sock"
echo "ok: 3 refits verified"
