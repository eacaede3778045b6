#!/bin/bash
# Trust boundary of in-process install: an engine process holds no cluster key, yet its
# installer copies from trainer memory. A keyless process that registers as an engine with one
# in-process region (model.w) and attaches its own installer tries every way to more:
# InstallSign (the signing oracle, removed) is an unknown request; an Export to the publisherd
# with a guessed MAC is refused and passes no fd; InstallSources of a publisher or generation
# its plan does not read is refused; of its own plan's publisher it gets model.w's region alone,
# as a read-only memfd, never model.secret's (the trainer's other region).
. "$(dirname "$0")/lib.sh"
E2E_LOCAL_COPY=auto
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 1
start_receiver 0 1
wait_for "$E2E_DIR/pub0.log" "status endpoint on" 20
wait_for "$E2E_DIR/recv0.log" "status endpoint on" 20
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkfifo "$E2E_DIR/trainer.stop"
# A trainer with two tensors in two memfds, published as version 1; it waits until told to go.
REFIT_LIB=$BIN/librefit.so PYTHONPATH=$ROOT/client/python python3 - "$E2E_DIR/pub0.sock" \
    "$E2E_DIR/trainer.stop" > "$E2E_DIR/tr.log" 2>&1 <<'PY' &
import sys
import refit
c = refit.Client(refit.TRAINER, "tr", 0, socket=sys.argv[1])
w, s = c.alloc_host(4096), c.alloc_host(4096)
w.mmap[:] = b"\x11" * 4096
s.mmap[:] = b"\x5e" * 4096
c.add_piece("model.w", "fp32", [1024], w.region, 0, [0], [1024])
c.add_piece("model.secret", "fp32", [1024], s.region, 0, [0], [1024])
c.seal()
c.publish(1)
print("published 1", flush=True)
open(sys.argv[2]).read()
PY
E2E_PIDS="$E2E_PIDS $!"
wait_for "$E2E_DIR/tr.log" "published 1" 20
timeout 60 python3 "$(dirname "$0")/68-installer-boundary.py" "$E2E_DIR/recv0.sock" \
    "$E2E_DIR/pub0.sock" > "$E2E_DIR/attacker.log" 2>&1
rc=$?
echo > "$E2E_DIR/trainer.stop"
cat "$E2E_DIR/attacker.log"
[ "$rc" = 0 ] && grep -q "^ok$" "$E2E_DIR/attacker.log" || fail "the keyless engine got more (rc $rc)"
grep -q "its installer was given 1 of the 2 regions of publisher" "$E2E_DIR/recv0.log" ||
    fail "the receiverd did not log what it handed the installer"
grep -q "exported 1 of 2 regions (1 fds) holding 1 asked-for pieces" "$E2E_DIR/pub0.log" ||
    fail "the publisherd exported more than the one region"
kill -0 "$PUB0_PID" && kill -0 "$RECV0_PID" || fail "a daemon died"
echo "ok: a keyless engine process reached model.w's region alone, read-only"
