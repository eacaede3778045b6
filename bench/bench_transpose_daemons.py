#!/usr/bin/env python3
"""bench/bench_transpose_daemons.py - four bf16 [4096 x 8192] weights (64 MiB each) in host
memory refitted through the real daemons on loopback (one publisherd, one receiverd, a trainer
and an engine client through the Python binding), the trainer holding them row-major (plain) or
transposed (strides (1, 4096)), over the same-host copy (local_copy = auto) and over tcp
(local_copy = off), verify off and full. Prints publish -> engine commit per case (best of
REFITS warm refits after a first one) beside memcpy of the same bytes in this process, and
the elements found wrong in the engine's memory after each refit (every element checked:
refits alternate between a value per column and a value per row, so an element in another
place shows in one of them). BUILD=build python3 bench/bench_transpose_daemons.py"""
import os
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
import refit  # noqa: E402

BUILD = os.environ.get("BUILD", "build")
NW, ROWS, COLS = 4, 4096, 8192
WB = ROWS * COLS * 2
REFITS = int(os.environ.get("REFITS", "3"))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(d, verify, local_copy):
    key = os.path.join(d, "cluster.key")
    with open(key, "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(key, 0o600)
    socks = [os.path.join(d, "pub.sock"), os.path.join(d, "recv.sock")]
    common = ["--cluster-key-file", key, "--coordinator-addr", f"127.0.0.1:{free_port()}",
              "--publishers", "1", "--receivers", "1", "--status-listen", "127.0.0.1:0",
              "--verify", verify, "--local-copy", local_copy, "--index", "0", "--clients",
              "1"]
    logs = [open(os.path.join(d, n), "w") for n in ("pub.log", "recv.log")]
    procs = [subprocess.Popen([os.path.join(BUILD, "refit-publisherd")] + common +
                              ["--coordinator", "--socket", socks[0]],
                              stdout=logs[0], stderr=subprocess.STDOUT),
             subprocess.Popen([os.path.join(BUILD, "refit-receiverd")] + common +
                              ["--socket", socks[1]], stdout=logs[1], stderr=subprocess.STDOUT)]
    deadline = time.time() + 20
    while not all(os.path.exists(s) for s in socks):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            stop(procs, logs)
            sys.exit(f"bench_transpose_daemons: the daemons did not start; logs in {d}")
        time.sleep(0.05)
    return socks, procs, logs


def stop(procs, logs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)
    for f in logs:
        f.close()


def src_bytes(w, by_col, transposed):
    """Weight w's memory in the trainer: element (i, j) is j + w (by_col) or i + w."""
    if by_col:
        if transposed:  # column j: ROWS copies of its value
            return b"".join(struct.pack("<H", (j + w) & 0xffff) * ROWS for j in range(COLS))
        return struct.pack(f"<{COLS}H", *((j + w) & 0xffff for j in range(COLS))) * ROWS
    if transposed:
        return struct.pack(f"<{ROWS}H", *((i + w) & 0xffff for i in range(ROWS))) * COLS
    return b"".join(struct.pack("<H", (i + w) & 0xffff) * COLS for i in range(ROWS))


def wrong(mem, base, w, by_col):
    """Elements of the engine's row-major weight w at base that differ from the pattern."""
    bad = 0
    row = struct.pack(f"<{COLS}H", *((j + w) & 0xffff for j in range(COLS))) if by_col else None
    for i in range(ROWS):
        want = row if by_col else struct.pack("<H", (i + w) & 0xffff) * COLS
        got = mem[base + i * 2 * COLS:base + (i + 1) * 2 * COLS]
        if got != want:
            bad += sum(1 for k in range(COLS) if got[2 * k:2 * k + 2] != want[2 * k:2 * k + 2])
    return bad


def case(transposed, verify, local_copy):
    patterns = {(w, c): src_bytes(w, c, transposed) for w in range(NW) for c in (False, True)}
    with tempfile.TemporaryDirectory(prefix="refit-bt-") as d:
        socks, procs, logs = start(d, verify, local_copy)
        try:
            with refit.Client(refit.TRAINER, "bt-trainer", 0, socket=socks[0]) as tr, \
                    refit.Client(refit.ENGINE, "bt-engine", 0, socket=socks[1]) as en:
                src = tr.alloc_host(NW * WB)
                dst = en.alloc_host(NW * WB)
                for w in range(NW):
                    name = f"model.layers.{w}.mlp.down_proj.weight"
                    tr.add_piece(name, "bf16", [ROWS, COLS], src.region, w * WB, [0, 0],
                                 [ROWS, COLS], [1, ROWS] if transposed else None)
                    en.add_piece(name, "bf16", [ROWS, COLS], dst.region, w * WB, [0, 0],
                                 [ROWS, COLS])
                tr.seal()
                en.seal()
                times, bad = [], 0
                for v in range(1, REFITS + 2):
                    by_col = v % 2 == 1
                    for w in range(NW):
                        src.mmap[w * WB:(w + 1) * WB] = patterns[(w, by_col)]
                    t0 = time.perf_counter()
                    tr.publish(v)
                    en.wait_version(v, 600000)
                    times.append(time.perf_counter() - t0)
                    tr.wait_released(v, 600000)
                    bad += sum(wrong(dst.mmap, w * WB, w, by_col) for w in range(NW))
                return min(times[1:]), times[0], bad
        finally:
            stop(procs, logs)


def main():
    a, b = bytearray(NW * WB), bytearray(os.urandom(1 << 20) * (NW * WB >> 20))
    mc = 1e30
    for _ in range(5):
        t0 = time.perf_counter()
        a[:] = b
        mc = min(mc, time.perf_counter() - t0)
    del a, b
    print(f"bench_transpose_daemons: {NW} bf16 [{ROWS} x {COLS}] ({NW * WB / 1e9:.3f} GB) "
          f"through the daemons on loopback, {os.cpu_count()} CPUs, best of {REFITS} warm "
          "refits (publish -> engine commit)")
    print(f"{'case':<40} {'first_s':>8} {'best_s':>8} {'GB/s':>7} {'xmemcpy':>8} "
          f"{'xplain':>7} {'#wrong':>7}")
    print(f"{'memcpy in Python, one thread (ceiling)':<40} {'-':>8} {mc:8.4f} "
          f"{NW * WB / 1e9 / mc:7.2f} {1.0:8.2f} {'-':>7} {0:7d}")
    status = 0
    for local_copy in ("auto", "off"):
        for verify in ("off", "full"):
            plain = None
            for transposed in (False, True):
                best, first, bad = case(transposed, verify, local_copy)
                path = "same-host copy" if local_copy == "auto" else "tcp"
                name = f"{path}, verify {verify}, {'transposed' if transposed else 'plain'}"
                xp = f"{best / plain:7.2f}" if plain else f"{'-':>7}"
                print(f"{name:<40} {first:8.4f} {best:8.4f} {NW * WB / 1e9 / best:7.2f} "
                      f"{mc / best:8.2f} {xp} {bad:7d}")
                plain = plain or best
                status |= bad != 0
    return status


if __name__ == "__main__":
    sys.exit(main())
