"""tests/e2e/torch_refit.py - PyTorch trainer and engine processes for tests/e2e/7x-torch-*.sh:
real torch modules named by a convention (megatron, vllm, hf), their weights in memfd-backed
arenas, registered with refit.torch.register_module on the real daemons; the trainer writes
versions, the engine checks every piece of every version with torch.equal.

  torch_refit.py trainer|engine --socket S --model M --shrink N --conv C --layout L
                 --ranks K --versions V [--device cuda:N]
  torch_refit.py refusals --socket S      every refusal of refit.torch, against a publisherd"""

import argparse
import errno
import os
import re
import sys
import zlib

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
os.environ.setdefault("REFIT_LIB", os.path.join(ROOT, os.environ.get("BUILD", "build"),
                                                "librefit.so"))

import torch  # noqa: E402

import refit  # noqa: E402
import refit.torch as rt  # noqa: E402


def te_name(name, names):
    """Megatron-Core's Transformer Engine name of a local-spec parameter: the norm before a
    linear layer is that layer's layer_norm_weight (pre_mlp_layernorm only in dense layers);
    grouped-GEMM experts are experts.linear_fc1.weight<i>."""
    m = re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$", name)
    if m:
        return f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"
    if name.endswith(".input_layernorm.weight"):
        return name.replace(".input_layernorm.weight", ".self_attention.linear_qkv."
                            "layer_norm_weight")
    fc1 = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.weight")
    if name.endswith(".pre_mlp_layernorm.weight") and fc1 in names:
        return fc1.replace(".weight", ".layer_norm_weight")
    return name


def module_name(args, name, names):
    """The module's name of a layout's parameter: --te and --prefix as a real trainer has."""
    return (args.prefix if args else "") + (te_name(name, names) if args and args.te else name)


def build_module(params, args=None):
    """A plain torch module whose named_parameters() are the layout's names and shapes (or
    their Transformer Engine names under a prefix, see module_name), built as nested
    submodules the way a framework's model class nests them."""
    root = torch.nn.Module()
    names = {p.name for p in params}
    for p in params:
        *path, leaf = module_name(args, p.name, names).split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype),
                                                      requires_grad=False))
    return root


_cache = {}


def expected(version, hf, shape, dtype):
    """Version version's HF tensor hf: random values seeded by both, the same in every
    process."""
    key = (version, hf)
    if key not in _cache:
        g = torch.Generator().manual_seed(version * 1000003 + zlib.crc32(hf.encode()))
        if len(_cache) > 64:
            _cache.clear()
        _cache[key] = torch.randn(shape, generator=g).to(dtype)
    return _cache[key]


def box_of(full, start, extent):
    return full[tuple(slice(s, s + e) for s, e in zip(start, extent))]


def pieces_of(module, params, args):
    named = dict(module.named_parameters())
    names = {p.name for p in params}
    for p in params:
        for pc in p.pieces:
            yield named[module_name(args, p.name, names)], pc


def setup(args, kind):
    """Every rank of the layout in this process: (client, module, params) each."""
    ranks = []
    for r in range(args.ranks):
        params = rt.layout(args.model, args.conv, args.layout, r, args.shrink)
        module = build_module(params, args)
        if args.device == "cpu":
            rt.share_module(module)
        else:
            module.to(args.device)
        c = refit.Client(kind, name=f"torch-{args.mode}", rank=args.client_rank + r,
                         socket=args.socket)
        info = rt.register_module(c, module, args.conv, args.layout, r, args.model,
                                  args.shrink, prefix=args.prefix)
        if kind == refit.ENGINE:
            c.gate()
        c.seal()
        print(f"{args.mode} rank {r}: registered {info['params']} parameters, "
              f"{info['pieces']} pieces in {info['regions']} regions", flush=True)
        # One arena on the host; on a GPU one region per caching-allocator segment, far fewer
        # than the parameters.
        if info["regions"] != 1 if args.device == "cpu" else \
                info["regions"] * 4 > info["params"]:
            sys.exit(f"{args.mode} rank {r}: {info['regions']} regions for "
                     f"{info['params']} parameters on {args.device}")
        ranks.append((c, module, params))
    return ranks


def fill(ranks, v, args):
    with torch.no_grad():
        for _, module, params in ranks:
            for t, pc in pieces_of(module, params, args):
                hf, gshape, start, extent = pc[:4]
                rt.piece_view(t, pc)[...] = box_of(expected(v, hf, gshape, t.dtype), start,
                                                   extent)


def check(ranks, v, args):
    """Pieces of version v that differ from it (torch.equal on each)."""
    wrong = []
    for _, module, params in ranks:
        for t, pc in pieces_of(module, params, args):
            hf, gshape, start, extent = pc[:4]
            want = box_of(expected(v, hf, gshape, t.dtype), start, extent).to(t.device)
            if not torch.equal(rt.piece_view(t, pc), want):
                wrong.append(f"{hf} {start}+{extent}")
    return wrong


def run_trainer(args):
    ranks = setup(args, refit.TRAINER)
    for v in range(1, args.versions + 1):
        fill(ranks, v, args)
        for c, _, _ in ranks:
            c.publish(v)
        for c, _, _ in ranks:
            c.wait_released(v, 60000)
        print(f"trainer: version {v} released", flush=True)


def run_engine(args):
    ranks = setup(args, refit.ENGINE)
    for v in range(1, args.versions + 1):
        for c, _, _ in ranks:
            got = c.wait_version(v, 60000)
            if got != v:
                sys.exit(f"engine: waited for version {v}, the daemon committed {got}")
        wrong = check(ranks, v, args)
        npieces = sum(len(p.pieces) for _, _, ps in ranks for p in ps)
        print(f"engine: version {v} committed, {npieces} pieces checked, {len(wrong)} wrong",
              flush=True)
        if wrong:
            sys.exit(f"engine: version {v}: {len(wrong)} pieces differ, e.g. {wrong[:3]}")
        for c, _, _ in ranks:
            c.consumed(v)


def refused(what, fn, code, *words):
    """fn() must raise refit.Error with code, its message naming each of words."""
    try:
        fn()
    except refit.Error as e:
        if e.code != code or not all(w in e.message for w in words):
            sys.exit(f"refusal '{what}': got ({e.code}) {e.message}; expected {code} naming "
                     f"{words}")
        print(f"refused as expected: {what}: {e.message}", flush=True)
        return
    sys.exit(f"refusal '{what}': nothing was raised")


def run_refusals(args):
    import ctypes

    E = -errno.EINVAL
    c = refit.Client(refit.TRAINER, name="torch-refusals", rank=0, socket=args.socket)
    arena = rt.Arena(1 << 20)
    ok = arena.empty((4, 8), torch.bfloat16)

    # register(): the tensor itself.
    refused("not a tensor", lambda: rt.register(c, "w", [1, 2]), E, "w", "list")
    refused("dtype", lambda: rt.register(c, "w.c64", arena.empty((2,), torch.complex64)), E,
            "w.c64", "complex64")
    sparse = torch.eye(3).to_sparse()
    refused("sparse", lambda: rt.register(c, "w.sparse", sparse), E, "w.sparse", "sparse")
    # Negative strides are not tried: torch refuses to make them by throwing a C++ exception,
    # which aborts the process under `make asan` (ASan's __cxa_throw interceptor finds no
    # libstdc++ when python, not the program, loads it).
    refused("box shape", lambda: rt.register(c, "w.box", ok, box=[(0, 4), (0, 4)],
                                             global_shape=(8, 8)), E, "w.box", "[4, 4]")
    refused("box without global shape", lambda: rt.register(c, "w.box", ok,
                                                            box=[(0, 4), (0, 8)]), E,
            "w.box", "global_shape")
    refused("box outside", lambda: rt.register(c, "w.box", ok, box=[(6, 10), (0, 8)],
                                               global_shape=(8, 8)), E, "w.box", "outside")
    refused("private host memory", lambda: rt.register(c, "w.private", torch.zeros(4)), E,
            "w.private", "share_module")
    meta = torch.empty(4, device="meta")
    refused("meta device", lambda: rt.register(c, "w.meta", meta), E, "w.meta", "meta")
    rt.register(c, "w.ok", ok)
    rt.register(c, "w.half", ok[2:], box=[(2, 4), (0, 8)], global_shape=(4, 8))
    if rt.region_count(c) != 1:
        sys.exit(f"two tensors of one arena made {rt.region_count(c)} regions, not 1")

    # Arenas.
    refused("arena size", lambda: rt.Arena(0), E, "arena size is 0")
    refused("arena full", lambda: arena.empty((1 << 20,), torch.float32), -errno.ENOMEM,
            "arena", "full")

    # register_module(): the convention and the module.
    model, layout = "qwen3-0.6b", "tp=2"
    params = rt.layout(model, "megatron", layout, 1, 16)
    mod = build_module(params)
    rt.share_module(mod)
    refused("no model", lambda: rt.register_module(c, mod, "megatron", layout, 1), E, "model")
    refused("unknown convention", lambda: rt.layout(model, "deepspeed"), E, "deepspeed",
            "megatron")
    refused("hf with a layout", lambda: rt.layout(model, "hf", "tp=2"), E, "hf", "tp=2")
    refused("bad layout", lambda: rt.layout(model, "megatron", "tp=3", 0, 16), E, "tp")
    refused("unknown model", lambda: rt.layout("qwen9-1t", "vllm"), -errno.ENOENT, "qwen9-1t")
    refused("rank outside", lambda: rt.layout(model, "vllm", "tp=2", 2, 16), E, "rank 2")
    extra = dict(mod.named_parameters())
    extra["decoder.layers.0.self_attention.linear_qkv.bias"] = rt.empty((4,), torch.bfloat16)
    refused("unknown parameter", lambda: rt.register_module(c, extra.items(), "megatron",
                                                            layout, 1, model, 16),
            -errno.ENOENT, "linear_qkv.bias")
    name = "decoder.layers.3.mlp.linear_fc1.weight"
    missing = {k: v for k, v in mod.named_parameters() if k != name}
    refused("missing parameter", lambda: rt.register_module(c, missing, "megatron", layout, 1,
                                                            model, 16), -errno.ENOENT, name,
            "missing")
    p = dict(mod.named_parameters())[name]
    for what, t, words in (
            ("dtype", rt.empty(p.shape, torch.float32), ("float32", "bfloat16")),
            ("shape", rt.empty((p.shape[0] + 1, p.shape[1]), p.dtype), ("shape",)),
            ("not contiguous", rt.empty((p.shape[1], p.shape[0]), p.dtype).t(),
             ("row-major",))):
        bad = dict(mod.named_parameters())
        bad[name] = t
        refused(f"parameter {what}", lambda: rt.register_module(c, bad, "megatron", layout, 1,
                                                                model, 16), E, name, *words)
    refused("prefix", lambda: rt.register_module(c, mod, "megatron", layout, 1, model, 16,
                                                 prefix="module."), -errno.ENOENT,
            "embedding.word_embeddings.weight", "module.")
    plain = build_module(params)
    refused("module in private memory", lambda: rt.register_module(c, plain, "megatron",
                                                                   layout, 1, model, 16), E,
            "share_module")

    # librefit's layout calls themselves.
    lib = refit._load()
    h = ctypes.c_void_p()
    rc = lib.refit_layout_open(None, 1, b"hf", b"", 0, ctypes.byref(h))
    if rc != E or b"required" not in lib.refit_last_error(None):
        sys.exit(f"refit_layout_open(NULL model) returned {rc}")
    if lib.refit_layout_open(b"qwen3-0.6b", 16, b"hf", b"", 0, ctypes.byref(h)) != 0:
        sys.exit("refit_layout_open(qwen3-0.6b, hf) failed")
    n = lib.refit_layout_nparams(h)
    nm, dt, nd, npc = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int(), ctypes.c_uint32()
    a = [(ctypes.c_int64 * 8)() for _ in range(5)]
    off = ctypes.c_uint64()
    rc1 = lib.refit_layout_param(h, n, ctypes.byref(nm), ctypes.byref(dt), ctypes.byref(nd),
                                 a[0], ctypes.byref(npc))
    rc2 = lib.refit_layout_piece(h, 0, 1, ctypes.byref(nm), ctypes.byref(nd), a[1], a[2], a[3],
                                 a[4], ctypes.byref(off))
    lib.refit_layout_free(h)
    if rc1 != E or rc2 != E:
        sys.exit(f"out-of-range parameter/piece returned {rc1}/{rc2}, not -EINVAL")
    c.close()
    print("refusals: all refused", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["trainer", "engine", "refusals"])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--shrink", type=int, default=8)
    ap.add_argument("--conv", default="megatron")
    ap.add_argument("--layout", default="")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (memfd arenas) or cuda:N")
    ap.add_argument("--client-rank", type=int, default=0,
                    help="the daemon's rank of layout rank 0 (unique among its clients)")
    ap.add_argument("--te", action="store_true", help="Megatron Transformer Engine names")
    ap.add_argument("--prefix", default="", help="module names begin with it (\"module.\")")
    args = ap.parse_args()
    {"trainer": run_trainer, "engine": run_engine, "refusals": run_refusals}[args.mode](args)


if __name__ == "__main__":
    main()
