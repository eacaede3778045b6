#!/bin/bash
# In-process install (issue #12 item 4): an engine whose memory no daemon can map (registered
# with refit_region_inproc) gets its bytes from its own librefit installer, which maps the
# trainers' memory itself (the receiverd signs its export proof) and copies on the same host;
# three refits of qwen3-0.6b (shrunk) tp=2 -> tp=4, every installed byte checked by the engine.
# Then FP8 engines (issue 15) in in-process memory: the installer quantizes while it copies
# (mxfp8 with padded scale rows), every FP8 byte, scale and padding byte checked.
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
e2e_new_cluster fp8
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 2 --inproc \
    --fp8 mxfp8 --fp8-scale-pad 4
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 2
wait_ok tr eng
grep -q "fp8 mxfp8: [1-9][0-9]* pieces FP8" "$E2E_DIR/eng.log" || fail "fp8: the engine holds no FP8 piece"
grep -q "version 2 committed.*, 0 wrong" "$E2E_DIR/eng.log" || fail "fp8: engine did not verify version 2"
grep -q "in-process installs: 4 engines" "$E2E_DIR/recv0.log" ||
    fail "fp8: the receiverd did not hand the copies to the engines' installers"
echo "ok: 2 FP8 refits quantized by the engines' own installers, every FP8 byte and scale verified"
