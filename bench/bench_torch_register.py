"""bench/bench_torch_register.py - what refit.torch costs a PyTorch rank at start-up: the layout
from librefit (refit_layout_*), the module's parameters allocated in one memfd arena (pages
untouched: a full-size model costs no memory here), register_module (one region, every piece
through librefit to the daemon) and seal. Run by bench/torch-register.sh, which starts the
daemon.

  bench_torch_register.py --socket S --kind trainer|engine --model M --shrink N --conv C
                          --layout L --rank R --repeat K"""

import argparse
import os
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
os.environ.setdefault("REFIT_LIB", os.path.join(ROOT, os.environ.get("BUILD", "build"),
                                                "librefit.so"))

import torch  # noqa: E402

import refit  # noqa: E402
import refit.torch as rt  # noqa: E402


def build(params):
    """The module of the layout, its parameters carved from one arena without writing them."""
    total = sum((p.dtype.itemsize if hasattr(p.dtype, "itemsize") else
                 torch.empty((), dtype=p.dtype).element_size()) *
                int(torch.Size(p.shape).numel()) + 256 for p in params)
    arena = rt.Arena(total)
    root = torch.nn.Module()
    for p in params:
        *path, leaf = p.name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(arena.empty(p.shape, p.dtype),
                                                      requires_grad=False))
    return root, arena


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--kind", choices=["trainer", "engine"], required=True)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--shrink", type=int, default=1)
    ap.add_argument("--conv", required=True)
    ap.add_argument("--layout", default="")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    kind = refit.TRAINER if a.kind == "trainer" else refit.ENGINE
    rows = []
    for it in range(a.repeat + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        params = rt.layout(a.model, a.conv, a.layout, a.rank, a.shrink)
        t1 = time.perf_counter()
        module, arena = build(params)
        t2 = time.perf_counter()
        c = refit.Client(kind, name="bench-torch", rank=a.rank, socket=a.socket)
        info = rt.register_module(c, module, a.conv, a.layout, a.rank, a.model, a.shrink)
        t3 = time.perf_counter()
        c.seal()
        t4 = time.perf_counter()
        c.close()
        if it > 0:
            rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
        del module, arena
    best = [min(r[i] for r in rows) for i in range(5)]
    print(f"| {a.model}{'/' + str(a.shrink) if a.shrink > 1 else ''} | {a.kind} {a.conv} "
          f"{a.layout or '-'} rank {a.rank} | {info['params']} | {info['pieces']} | "
          f"{info['regions']} | {arena_gib(params):.2f} | {best[0]:.3f} | {best[1]:.3f} | "
          f"{best[2]:.3f} | {best[3]:.3f} | **{best[4]:.3f}** |", flush=True)


def arena_gib(params):
    return sum(torch.empty((), dtype=p.dtype).element_size() * int(torch.Size(p.shape).numel())
               for p in params) / 2**30


if __name__ == "__main__":
    main()
