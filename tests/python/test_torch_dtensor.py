"""Tests of refit.torch's DTensor boxes (register() of a DTensor: global shape and this rank's
box from its device_mesh and placements) without daemons: 4 real torch.distributed processes
(gloo, CPU) hold DTensors on a 1-D mesh of 4 and a 2-D 2 x 2 mesh with uneven dims (a last
shard smaller, one empty), FSDP2-over-TP's _StridedShard where torch has it; every rank's box
must be the one torch.chunk cuts (computed here) and the local tensor must equal that box of
full_tensor() (torch's own gather). Partial and an unknown placement are refused naming the
tensor and the placement. Skips unless torch has DTensor (torch >= 2.2; Debian's 1.13 has
none, so CI skips it)."""

import os
import socket
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

try:
    import torch
    try:
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        from torch.distributed._tensor import DTensor  # noqa: F401
    HAVE_DTENSOR = True
except ImportError:
    HAVE_DTENSOR = False

WORLD = 4

# name, global shape, mesh ("1d": 4, "2d": 2 x 2), placements as (kind, tensor dim) per mesh
# dim: S Shard, R Replicate, SS _StridedShard(split_factor = the tp size) as FSDP2 puts it
# over a TP Shard of the same dim.
CASES = [
    ("rows_uneven", (10, 6), "1d", [("S", 0)]),        # 3, 3, 3, 1
    ("cols_uneven", (5, 7), "1d", [("S", 1)]),         # 2, 2, 2, 1
    ("empty_last", (5, 3), "1d", [("S", 0)]),          # 2, 2, 1, 0
    ("fewer_rows", (2, 3), "1d", [("S", 0)]),          # 1, 1, 0, 0
    ("replicate", (4, 5), "1d", [("R", None)]),
    ("s0_s0", (9, 8), "2d", [("S", 0), ("S", 0)]),     # dp 5 | 4, then tp 3 | 2, 2 | 2
    ("s0_s1", (7, 9), "2d", [("S", 0), ("S", 1)]),
    ("r_s1", (6, 5), "2d", [("R", None), ("S", 1)]),
    ("s1_r", (3, 5), "2d", [("S", 1), ("R", None)]),
    ("strided", (10, 4), "2d", [("SS", 0), ("S", 0)]),  # tp 5 | 5, then dp 3 | 2
    ("strided_uneven_tp", (11, 4), "2d", [("SS", 0), ("S", 0)]),
    ("vector", (7,), "2d", [("S", 0), ("S", 0)]),
]


def oracle_box(gshape, mesh_shape, coord, spec):
    """torch.chunk's piece of each current range, mesh dims in order except that a strided
    shard's mesh dim cuts after the plain Shard of its dim (the TP shard is FSDP's input)."""
    order = [(i, k, d) for i, (k, d) in enumerate(spec) if k != "SS"] + \
        [(i, k, d) for i, (k, d) in enumerate(spec) if k == "SS"]
    box = [[0, n] for n in gshape]
    for i, kind, d in order:
        if kind == "R":
            continue
        lo, hi = box[d]
        n, k = hi - lo, mesh_shape[i]
        c = -(-n // k)
        box[d] = [lo + min(coord[i] * c, n), lo + min((coord[i] + 1) * c, n)]
    return [tuple(b) for b in box]


def _worker(rank, port, errors):
    import errno
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, Partial
        from torch.distributed.tensor import placement_types as pt
    except ImportError:
        from torch.distributed._tensor import DTensor, Replicate, Shard
        from torch.distributed._tensor import placement_types as pt
        Partial = getattr(pt, "Partial", None) or pt._Partial
    strided = getattr(pt, "_StridedShard", None)
    import refit
    import refit.torch as rt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    meshes = {"1d": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("w",)),
              "2d": init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))}
    bad = []
    for name, gshape, m, spec in CASES:
        mesh = meshes[m]
        if strided is None:
            spec = [("S" if k == "SS" else k, d) for k, d in spec]
        pls = [Replicate() if k == "R" else Shard(d) if k == "S" else
               strided(d, split_factor=mesh.size(1)) for k, d in spec]
        box = oracle_box(gshape, tuple(mesh.shape), mesh.get_coordinate(), spec)
        g = torch.Generator().manual_seed(len(name))
        full = torch.randn(gshape, generator=g)
        local = full[tuple(slice(a, b) for a, b in box)].contiguous()
        stride = torch.empty(gshape).stride()
        dt = DTensor.from_local(local, mesh, pls, run_check=False, shape=torch.Size(gshape),
                                stride=stride)
        # torch's gather certifies that the oracle's boxes are what the placements mean.
        gathered = dt.full_tensor()
        if not torch.equal(gathered, full):
            bad.append(f"{name} rank {rank}: full_tensor() of torch.chunk's shards is not the "
                       "tensor: this torch's placements mean other boxes")
        loc, gs, got = rt._dtensor_box(f"tensor {name}", dt)
        # What refit registers must be that box of what torch gathers, whatever the oracle.
        if loc.numel() and not torch.equal(loc, gathered[tuple(slice(a, b) for a, b in got)]):
            bad.append(f"{name} rank {rank}: the local tensor is not box {got} of full_tensor()")
        # An empty shard's offset is torch's business (it registers nothing): only its
        # emptiness is compared.
        same = got == box if loc.numel() else any(a == b for a, b in box)
        if gs != list(gshape) or not same:
            bad.append(f"{name} rank {rank}: refit.torch's box {got} of {gs}, torch.chunk's "
                       f"{box} of {list(gshape)}")
        if loc.data_ptr() != local.data_ptr() and local.numel():
            bad.append(f"{name}: the registered tensor is not the local tensor")
    # Refusals: each names the tensor and the placement.
    t = torch.zeros(4, 5)
    checks = [("Partial", DTensor.from_local(t, meshes["1d"], [Partial()], run_check=False),
               ["t.partial", "Partial", "mesh dim 0", "'w'"]),
              ("Partial over tp", DTensor.from_local(t, meshes["2d"], [Shard(0), Partial()],
                                                     run_check=False),
               ["t.partial", "Partial", "mesh dim 1", "'tp'"])]
    # A placement that is neither Shard, Replicate nor Partial (a user's own): where this
    # torch lets one be made, it is refused naming it.
    try:
        class Diagonal(pt.Placement):
            def __repr__(self):
                return "Diagonal()"

            __str__ = __repr__
        odd = DTensor.from_local(t, meshes["1d"], [Diagonal()], run_check=False,
                                 shape=torch.Size((4, 5)), stride=(5, 1))
    except Exception as e:  # torch's own refusal to build it: nothing to register
        print(f"rank {rank}: this torch makes no DTensor of a Placement subclass ({e})")
    else:
        checks.append(("unknown placement", odd, ["t.partial", "Diagonal()", "mesh dim 0"]))
    for what, dt, words in checks:
        try:
            rt.register(None, "t.partial", dt)
            bad.append(f"{what}: not refused")
        except refit.Error as e:
            if e.code != -errno.EINVAL or not all(w in e.message for w in words):
                bad.append(f"{what}: ({e.code}) {e.message}")
    try:
        rt.register(None, "t.box", DTensor.from_local(t, meshes["1d"], [Replicate()],
                                                      run_check=False), global_shape=(4, 5))
        bad.append("a DTensor with global_shape: not refused")
    except refit.Error as e:
        if "t.box" not in e.message or "global_shape" not in e.message:
            bad.append(f"a DTensor with global_shape: {e.message}")
    dist.destroy_process_group()
    if bad:
        errors.put((rank, bad))


@unittest.skipUnless(HAVE_DTENSOR, "needs torch with DTensor (torch >= 2.2)")
class TestDTensorBoxes(unittest.TestCase):
    def test_boxes_of_4_ranks(self):
        import torch.multiprocessing as mp
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(port, errors), nprocs=WORLD, join=True,
                           start_method="spawn")
        found = []
        while not errors.empty():
            found.append(errors.get())
        self.assertEqual(found, [], "\n".join(f"rank {r}: {m}" for r, ms in found for m in ms))


if __name__ == "__main__":
    unittest.main()
