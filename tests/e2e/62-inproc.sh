#!/bin/bash
# In-process install (issue #12 item 4): an engine whose memory no daemon can map (registered
# with refit_region_inproc) gets its bytes from its own librefit installer, which maps the
# trainers' memory itself (the receiverd signs its export proof) and copies on the same host;
# three refits of qwen3-0.6b (shrunk) tp=2 -> tp=4, every installed byte checked by the engine.
. "$(dirname "$0")/lib.sh"
E2E_LOCAL_COPY=auto
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 3 --inproc
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 3
wait_ok tr eng
grep -q "version 3 committed.*0 wrong" "$E2E_DIR/eng.log" || fail "engine did not verify version 3"
grep -q "in-process installs: 4 engines" "$E2E_DIR/recv0.log" ||
    fail "the receiverd did not hand the copies to the engines' installers"
echo "ok: 3 refits installed by the engines' own installers, every byte verified"
