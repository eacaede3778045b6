"""tests/gpu/torch_dtensor.py - DTensor trainers and a plain-tensor engine for
tests/gpu/40-torch-dtensor.sh (needs torch >= 2.2: DTensor and init_device_mesh).

  torch_dtensor.py trainer --socket S --rank R --world 4 --port P --versions V
  torch_dtensor.py engine  --socket S --versions V [--model-only]
  torch_dtensor.py fsdp2   --socket S --rank R --world 2|4 --port P --versions V  (CUDA, NCCL)

The trainers are 4 torch.distributed ranks (gloo, CPU tensors in refit.torch's memfd arenas)
holding DTensors on a 1-D mesh of 4 (Shard(0), Shard(1), Replicate, uneven dims, an empty last
shard) and on a 2-D dp x tp mesh of 2 x 2 ([Shard(0), Shard(0)], [Shard(0), Shard(1)],
[Replicate(), Shard(1)], FSDP2-over-TP's [_StridedShard(0), Shard(0)] where torch has it), and
a module with HF names (qwen3-0.6b shrunk 16) whose parameters are DTensors laid out as FSDP2 +
TP lay them (column-parallel weights [_StridedShard(0), Shard(0)], row-parallel [Shard(0),
Shard(1)], norms and embeddings [Shard(0), Replicate()]), registered with register_module(...,
"hf"). Each local shard is cut by this file (torch.chunk, in the order torch shards), not by
refit.torch, and DTensor.full_tensor() must give back the full weights before a version is
published. The engine (one process, tp=2 clients) holds every tensor split differently: the
vllm layout of the model, the other tensors halved on their last dim; after each version every
engine tensor is compared with torch.equal against the full weights, computed here from a seed.
Rank 0 also checks refit.torch's refusals of DTensors (Partial, a box, a non-hf convention, a
local tensor that disagrees with its placements). With 2 or more GPUs, fsdp2 is the real thing:
the model's nn.Linear / nn.Embedding layers under parallelize_module (4 GPUs) and fully_shard,
their DTensor parameters in CUDA memory, registered by register_module "hf"."""

import argparse
import errno
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))

import torch  # noqa: E402

import torch_refit as tr  # noqa: E402  (sets sys.path and REFIT_LIB for refit)
import refit  # noqa: E402
import refit.torch as rt  # noqa: E402

MODEL, SHRINK = "qwen3-0.6b", 16

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, Partial
    from torch.distributed.tensor import placement_types as _pt
except ImportError:
    from torch.distributed._tensor import DTensor, Replicate, Shard
    from torch.distributed._tensor import placement_types as _pt
    Partial = getattr(_pt, "Partial", None) or _pt._Partial
StridedShard = getattr(_pt, "_StridedShard", None)

# name -> (global shape, mesh "1d" or "2d", placements as (kind, dim) per mesh dim)
TENSORS = {
    "d1.rows": ((10, 6), "1d", [("S", 0)]),        # 3, 3, 3, 1 rows
    "d1.cols": ((5, 7), "1d", [("S", 1)]),         # 2, 2, 2, 1 columns
    "d1.empty": ((5, 3), "1d", [("S", 0)]),        # 2, 2, 1, 0: rank 3 holds nothing
    "d1.rep": ((4, 5), "1d", [("R", None)]),
    "d2.s0s0": ((9, 8), "2d", [("S", 0), ("S", 0)]),
    "d2.s0s1": ((7, 10), "2d", [("S", 0), ("S", 1)]),
    "d2.rs1": ((6, 5), "2d", [("R", None), ("S", 1)]),
    "d2.strided": ((10, 4), "2d", [("SS", 0), ("S", 0)]),  # FSDP2 (3 | 2) over TP (5 | 5)
}


def placement(kind, dim, mesh):
    if kind == "R":
        return Replicate()
    if kind == "S":
        return Shard(dim)
    # FSDP2 over TP: the dp mesh dim's shard of each of the tp mesh dim's shards.
    return StridedShard(dim, split_factor=mesh.size(1))


def shard_order(spec):
    """(mesh dim, kind, tensor dim) in the order torch cuts the tensor: mesh dims in order,
    except that a _StridedShard's mesh dim comes after the Shard of the same tensor dim
    (FSDP2 shards the TP shard)."""
    order = [(i, k, d) for i, (k, d) in enumerate(spec) if k != "SS"]
    for i, (k, d) in enumerate(spec):
        if k == "SS":
            order.append((i, k, d))
    return order


def local_box(gshape, mesh_shape, coord, spec):
    """This coordinate's box of gshape: torch.chunk of the current range into mesh_shape[i]
    pieces, a missing last chunk empty (DTensor's Shard semantics), in shard_order."""
    box = [[0, n] for n in gshape]
    for i, kind, d in shard_order(spec):
        if kind == "R":
            continue
        lo, hi = box[d]
        n, k = hi - lo, mesh_shape[i]
        c = -(-n // k)
        box[d] = [lo + min(coord[i] * c, n), lo + min((coord[i] + 1) * c, n)]
    return [tuple(b) for b in box]


def module_spec(name, shape):
    """The FSDP2 + TP placements of an HF parameter on the dp x tp mesh."""
    if len(shape) == 1 or "embed_tokens" in name or "lm_head" in name:
        return [("S", 0), ("R", None)]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return [("S", 0), ("S", 1)]  # row-parallel: TP Shard(1), FSDP Shard(0)
    return [("SS", 0), ("S", 0)]     # column-parallel: TP Shard(0), FSDP its dim 0


def full(v, name, shape, dtype=torch.float32):
    return tr.expected(v, name, shape, dtype)


def run_trainer(args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    mesh1 = init_device_mesh("cpu", (args.world,), mesh_dim_names=("w",))
    mesh2 = init_device_mesh("cpu", (2, args.world // 2), mesh_dim_names=("dp", "tp"))
    meshes = {"1d": mesh1, "2d": mesh2}
    spec = dict((n, (s, m, p)) for n, (s, m, p) in TENSORS.items())
    if StridedShard is None:
        print("trainer: this torch has no _StridedShard: the FSDP2-over-TP layout is "
              "replaced by [Shard(0), Shard(0)]", flush=True)
    params = rt.layout(MODEL, "hf", "", 0, SHRINK)
    for p in params:
        spec["model:" + p.name] = (p.shape, "2d", module_spec(p.name, p.shape))

    def placements_of(sp, mesh):
        out = []
        for k, d in sp:
            if k == "SS" and StridedShard is None:
                k = "S"
            out.append(placement(k, d, mesh))
        return out

    # Every local shard lives in one arena; each DTensor wraps it without a copy.
    arena = rt.Arena(64 << 20)
    dts, boxes = {}, {}
    dtypes = {"model:" + p.name: p.dtype for p in params}
    for name, (shape, m, sp) in spec.items():
        mesh = meshes[m]
        eff = [("S" if k == "SS" and StridedShard is None else k, d) for k, d in sp]
        box = local_box(shape, tuple(mesh.shape), mesh.get_coordinate(), eff)
        loc = arena.empty([b - a for a, b in box], dtypes.get(name, torch.float32))
        strides = torch.empty(shape).stride()
        dt = DTensor.from_local(loc, mesh, placements_of(sp, mesh), run_check=False,
                                shape=torch.Size(shape), stride=strides)
        if dt.to_local().data_ptr() != loc.data_ptr() and loc.numel():
            sys.exit(f"trainer rank {args.rank}: DTensor.from_local copied {name}")
        dts[name], boxes[name] = dt, box
    module = torch.nn.Module()
    for p in params:
        *path, leaf = p.name.split(".")
        mod = module
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(dts["model:" + p.name],
                                                        requires_grad=False))

    if args.rank == 0:
        refusals(dts, mesh1, arena)
    c = refit.Client(refit.TRAINER, name="dtensor-trainer", rank=args.rank, socket=args.socket)
    n = 0
    for name, dt in dts.items():
        if not name.startswith("model:"):
            n += rt.register(c, name, dt)
    info = rt.register_module(c, module, "hf", "", 0, MODEL, SHRINK)
    c.seal()
    print(f"trainer rank {args.rank}: coordinate {mesh2.get_coordinate()}: {n} tensors and "
          f"{info['pieces']} of {info['params']} module parameters registered in "
          f"{info['regions']} regions", flush=True)

    for v in range(1, args.versions + 1):
        with torch.no_grad():
            for name, dt in dts.items():
                shape = spec[name][0]
                want = full(v, name.removeprefix("model:"), shape, dt.dtype)
                dt.to_local().copy_(tr.box_of(want, [a for a, _ in boxes[name]],
                                              [b - a for a, b in boxes[name]]))
        # torch's own gather must give back the full weights: the shards this file cut are
        # where torch's placements say they are. bfloat16 is gathered as float32 (exact; gloo
        # may not gather bfloat16).
        wrong = [name for name, dt in dts.items() if not torch.equal(
            gathered(dt), full(v, name.removeprefix("model:"), spec[name][0],
                               dt.dtype).float())]
        if wrong:
            sys.exit(f"trainer rank {args.rank}: version {v}: full_tensor() differs from the "
                     f"weights for {wrong[:3]}")
        c.publish(v)
        c.wait_released(v, 60000)
        print(f"trainer rank {args.rank}: version {v} released, full_tensor() equal for "
              f"{len(dts)} DTensors", flush=True)
    dist.destroy_process_group()


class Norm(torch.nn.Module):
    """An RMSNorm's parameter (HF names it <module>.weight)."""

    def __init__(self, shape):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape))


def hf_model(params):
    """A module with HF names built of the layers FSDP2 and parallelize_module take: nn.Linear
    for *_proj, nn.Embedding, a Norm for every vector."""
    root = torch.nn.Module()
    for p in params:
        *path, kind, leaf = p.name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        if len(p.shape) == 1:
            layer = Norm(p.shape)
        elif kind == "embed_tokens":
            layer = torch.nn.Embedding(*p.shape)
        else:
            layer = torch.nn.Linear(p.shape[1], p.shape[0], bias=False)
        m.add_module(kind, layer.to(p.dtype))
    return root


def run_fsdp2(args):
    """A real FSDP2 trainer on GPU args.rank (NCCL): parallelize_module over tp (4 GPUs: dp x
    tp = 2 x 2; 2 GPUs: dp only), fully_shard per layer and at the root, then register_module
    "hf"; the shards are filled as torch.chunk cuts them and full_tensor() must agree."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.cuda.set_device(args.rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    tp = 2 if args.world >= 4 else 1
    mesh = init_device_mesh("cuda", (args.world // tp, tp), mesh_dim_names=("dp", "tp"))
    params = rt.layout(MODEL, "hf", "", 0, SHRINK)
    model = hf_model(params).cuda()
    if tp > 1:
        plan = {}
        for p in params:
            mod = p.name.rsplit(".", 1)[0]
            if mod.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                plan[mod] = ColwiseParallel()
            elif mod.endswith(("o_proj", "down_proj")):
                plan[mod] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
    for layer in model.model.layers.children():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    named = dict(model.named_parameters())
    with torch.no_grad():
        for v in range(1, args.versions + 1):
            for p in params:
                dt = named[p.name]
                sp = [("SS", pl.dim) if type(pl).__name__ == "_StridedShard" else
                      ("S", pl.dim) if pl.is_shard() else ("R", None) for pl in dt.placements]
                box = local_box(p.shape, tuple(dt.device_mesh.shape),
                                dt.device_mesh.get_coordinate(), sp)
                want = full(v, p.name, p.shape, p.dtype).cuda()
                dt.to_local().copy_(tr.box_of(want, [a for a, _ in box],
                                              [b - a for a, b in box]))
            wrong = [p.name for p in params if not torch.equal(
                gathered(named[p.name]), full(v, p.name, p.shape, p.dtype).float().cuda())]
            if wrong:
                sys.exit(f"fsdp2 rank {args.rank}: full_tensor() of shards cut by torch.chunk "
                         f"differs for {wrong[:3]}, placements "
                         f"{[tuple(named[n].placements) for n in wrong[:3]]}")
            if v == 1:
                pls = {str(tuple(named[p.name].placements)) for p in params}
                c = refit.Client(refit.TRAINER, name="fsdp2-trainer", rank=args.rank,
                                 socket=args.socket)
                info = rt.register_module(c, model, "hf", "", 0, MODEL, SHRINK)
                c.seal()
                print(f"fsdp2 rank {args.rank}: mesh {tuple(mesh.shape)}, placements "
                      f"{sorted(pls)}: {info['pieces']} of {info['params']} parameters "
                      f"registered in {info['regions']} regions", flush=True)
            c.publish(v)
            c.wait_released(v, 60000)
            print(f"fsdp2 rank {args.rank}: version {v} released", flush=True)
    dist.destroy_process_group()


def gathered(dt):
    """dt.full_tensor() in float32."""
    return DTensor.from_local(dt.to_local().float(), dt.device_mesh, dt.placements,
                              run_check=False, shape=dt.shape, stride=dt.stride()).full_tensor()


def refused(what, fn, code, *words):
    try:
        fn()
    except refit.Error as e:
        if e.code != code or not all(w in e.message for w in words):
            sys.exit(f"refusal '{what}': got ({e.code}) {e.message}; expected {code} naming "
                     f"{words}")
        print(f"refused as expected: {what}: {e.message}", flush=True)
        return
    sys.exit(f"refusal '{what}': nothing was raised")


def refusals(dts, mesh1, arena):
    """refit.torch's refusals of DTensors; each raises before the client is used."""
    E = -errno.EINVAL
    loc = arena.empty((4, 5), torch.float32)
    partial = DTensor.from_local(loc, mesh1, [Partial()], run_check=False)
    refused("Partial", lambda: rt.register(None, "d1.partial", partial), E, "d1.partial",
            "Partial", "mesh dim 0", "'w'")
    refused("box of a DTensor", lambda: rt.register(None, "d1.rows", dts["d1.rows"],
                                                    box=[(0, 3), (0, 6)]), E, "d1.rows", "box")
    # rank 0's shard of Shard(0) over 4 of 10 rows is 3 rows; a 2-row local tensor is not it.
    bad = DTensor.from_local(arena.empty((2, 6), torch.float32), mesh1, [Shard(0)],
                             run_check=False, shape=torch.Size((10, 6)), stride=(6, 1))
    refused("local shape", lambda: rt.register(None, "d1.bad", bad), E, "d1.bad", "[3, 6]",
            "[2, 6]")
    # register_module with a DTensor under a convention that places by layout, not by mesh.
    params = rt.layout(MODEL, "vllm", "tp=2", 0, SHRINK)
    first = params[0]
    rep = DTensor.from_local(arena.empty(first.shape, first.dtype), mesh1, [Replicate()],
                             run_check=False)
    named = {first.name: rep}
    named.update({p.name: arena.empty(p.shape, p.dtype) for p in params[1:]})
    refused("DTensor under vllm", lambda: rt.register_module(None, named, "vllm", "tp=2", 0,
                                                             MODEL, SHRINK),
            E, first.name, "Replicate", "hf", "vllm")


def run_engine(args):
    """One process, two engine clients (tp=2): the vllm layout of the model, and every other
    tensor halved on its last dim, in plain arena tensors."""
    ranks = []
    for r in range(2):
        params = rt.layout(MODEL, "vllm", "tp=2", r, SHRINK)
        module = tr.build_module(params)
        rt.share_module(module)
        c = refit.Client(refit.ENGINE, name="dtensor-engine", rank=r, socket=args.socket)
        info = rt.register_module(c, module, "vllm", "tp=2", r, MODEL, SHRINK)
        mine = {}
        for name, (shape, _, _) in ({} if args.model_only else TENSORS).items():
            n = shape[-1]
            lo, hi = (0, (n + 1) // 2) if r == 0 else ((n + 1) // 2, n)
            box = [(0, s) for s in shape[:-1]] + [(lo, hi)]
            t = rt.empty([b - a for a, b in box])
            rt.register(c, name, t, box=box, global_shape=shape)
            mine[name] = (t, box)
        c.gate()
        c.seal()
        print(f"engine rank {r}: {info['pieces']} model pieces and {len(mine)} tensors "
              "registered", flush=True)
        ranks.append((c, module, params, mine))
    for v in range(1, args.versions + 1):
        for c, *_ in ranks:
            got = c.wait_version(v, 60000)
            if got != v:
                sys.exit(f"engine: waited for version {v}, the daemon committed {got}")
        wrong, n = [], 0
        for c, module, params, mine in ranks:
            wrong += tr.check([(c, module, params)], v, None)
            n += sum(len(p.pieces) for p in params)
            for name, (t, box) in mine.items():
                want = tr.box_of(full(v, name, TENSORS[name][0]), [a for a, _ in box],
                                 [b - a for a, b in box])
                n += 1
                if not torch.equal(t, want):
                    wrong.append(f"{name} {box}")
        print(f"engine: version {v} committed, {n} tensors compared with torch.equal, "
              f"{len(wrong)} wrong", flush=True)
        if wrong:
            sys.exit(f"engine: version {v}: {len(wrong)} differ, e.g. {wrong[:3]}")
        for c, *_ in ranks:
            c.consumed(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["trainer", "engine", "fsdp2"])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--model-only", action="store_true", help="engine: the model's tensors only")
    args = ap.parse_args()
    try:
        {"trainer": run_trainer, "engine": run_engine, "fsdp2": run_fsdp2}[args.mode](args)
    except refit.Error as e:
        sys.exit(f"{args.mode} rank {args.rank}: refit error {e.code}: {e.message}")


if __name__ == "__main__":
    main()
