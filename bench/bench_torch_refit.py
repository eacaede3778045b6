"""bench/bench_torch_refit.py - refits between real PyTorch processes on one GPU, through the
daemons, as an RL user runs them: a Megatron-style trainer process (its ranks' parameters
allocated one nn.Parameter at a time by PyTorch's allocator, Megatron names and layouts from
refit.torch.layout; GroupedMLP-style transposed experts with --grouped-transposed) and a
vLLM-style engine process (vLLM names and shapes), each rank a refit.Client that registers its
tensors through refit.torch. bench/bench_torch_refit.sh starts the daemons and runs these:

  geom     --geom G [--layers N] --workdir D   shell assignments for the driver: MODEL (a
           builtin name, or a JSON spec in D with N layers), SRC, DST, TRAINERS, ENGINES, BYTES
  dry-run  --geom G [--layers N] [--grouped-transposed] [--list]   tensors and bytes of each
           process and the GPU memory they take together (no GPU, no daemon)
  trainer  --geom G ... --socket S --out F     publish, time Start->Commit of every refit
  engine   --geom G ... --socket S --out F     receive; check every byte of the last version
  ceiling  --bytes N --out F                   the same-GPU d2d copy ceiling (CUDA events)
  table    RESULTS-DIR                         the table of a run

Weights are a deterministic pattern of (tensor, version, global index) both processes compute
on the GPU: element x[i0, i1, ...] of HF tensor t at version v holds the bits
XOR_d T_d[i_d + o_d(t, v)], T_d a table of random words (SHAKE-256) and o_d an offset from a
BLAKE2b of (t, v): rows, columns, tensors and versions all differ, so a refit that moves wrong
bytes, the wrong box or an old version fails the engine's check of every element."""

import argparse
import glob
import hashlib
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
os.environ.setdefault("REFIT_LIB", os.path.join(ROOT, os.environ.get("BUILD", "build"),
                                                "librefit.so"))

import torch  # noqa: E402

import refit  # noqa: E402
import refit.torch as rt  # noqa: E402

# Geometries: model, trainer (Megatron) layout, engine (vLLM) layout.
GEOMS = {
    "q4b": ("qwen3-4b", "tp=2", "tp=4"),
    "q30b": ("qwen3-30b-a3b", "tp=2,ep=2", "tp=4"),
}
GIB = 1 << 30
# What one H200 gives a process to allocate (torch.cuda.mem_get_info's total is 139.8 GiB), and
# what the CUDA contexts of the four processes on it take (trainer, engine, publisherd,
# receiverd; about 0.5 GiB each on an H200 with CUDA 12/13).
H200_GIB = 139.8
CONTEXTS_GIB = 4 * 0.6
INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SHIFT = 1 << 20  # range of the pattern's per-(tensor, version) offsets


# ---- geometry ------------------------------------------------------------------------------

def world(model, conv, parallel, shrink):
    """Every rank's layout (a list of lists of rt.Param): ranks are asked for until librefit
    says the rank lies outside the world."""
    ranks = []
    while True:
        try:
            ranks.append(rt.layout(model, conv, parallel, len(ranks), shrink))
        except refit.Error as e:
            if ranks and "outside" in str(e):
                return ranks
            raise


def spec_for(model, layers, workdir):
    """model itself when layers is 0 or all of them, else a JSON spec (HF config keys) of the
    builtin with its first `layers` layers, its sizes read from the builtin's HF layout (the
    project's model table, not numbers of this file); checked against that layout."""
    hf = rt.layout(model, "hf", "", 0)
    shapes = {p.name: p.shape for p in hf}
    nlayers = len({int(m.group(1)) for m in (re.match(r"model\.layers\.(\d+)\.", n)
                                             for n in shapes) if m})
    if layers <= 0 or layers == nlayers:
        return model
    if layers > nlayers:
        raise SystemExit(f"{model} has {nlayers} layers; --layers {layers} is more")
    hidden = shapes["model.embed_tokens.weight"][1]
    head_dim = shapes["model.layers.0.self_attn.q_norm.weight"][0]
    spec = {
        "name": f"{model}-{layers}l",
        "torch_dtype": "bfloat16",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": shapes["model.layers.0.self_attn.q_proj.weight"][0] // head_dim,
        "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // head_dim,
        "head_dim": head_dim,
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "tie_word_embeddings": "lm_head.weight" not in shapes,
    }
    experts = [n for n in shapes if re.match(r"model\.layers\.0\.mlp\.experts\.\d+\.gate_proj", n)]
    if experts:
        spec.update(model_type="qwen3_moe", num_experts=len(experts),
                    moe_intermediate_size=shapes["model.layers.0.mlp.experts.0.gate_proj.weight"][0])
    else:
        spec.update(model_type="qwen3",
                    intermediate_size=shapes["model.layers.0.mlp.gate_proj.weight"][0])
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"{spec['name']}.json")
    with open(path, "w") as f:
        json.dump(spec, f, indent=1)
    want = {n: s for n, s in shapes.items()
            if not re.match(r"model\.layers\.(\d+)\.", n) or
            int(re.match(r"model\.layers\.(\d+)\.", n).group(1)) < layers}
    got = {p.name: p.shape for p in rt.layout(path, "hf", "", 0)}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:4]
        raise SystemExit(f"the spec {path} does not give {model}'s first {layers} layers: "
                         f"tensors differ, e.g. {diff}")
    return path


def esize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def nelem(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def param_bytes(p):
    return nelem(p.shape) * esize(p.dtype)


EXPERT = re.compile(r"^(decoder\.layers\.(\d+)\.mlp\.experts\.)local_experts\.(\d+)\."
                    r"(linear_fc[12])\.weight$")


def grouped_pieces(experts):
    """The pieces of each expert's [a, b] parameter where GroupedMLP holds it: expert e's block
    of a*b elements, transposed (element (i, j) at e*a*b + j*a + i)."""
    out = []
    for e, p in enumerate(experts):
        a, b = p.shape
        for hf, gs, st, ex, strides, off in p.pieces:
            i0, j0 = divmod(off, b)
            out.append((hf, gs, st, ex, tuple(s // b + (s % b) * a for s in strides),
                        e * a * b + j0 * a + i0))
    return out


def trainer_tensors(params, grouped):
    """The tensors a Megatron rank allocates, in the order a module does: a list of
    (name, dtype, shape, pieces) with pieces as rt.Param's (hf, gshape, start, extent, strides,
    offset in elements of that tensor). grouped: each layer's local experts as GroupedMLP holds
    them, weight1 [H, E*2I] (expert e's [gate; up] transposed: element (k, h) of its fc1 at
    e*H*2I + h*2I + k) and weight2 [E*I, H] (its fc2 transposed: (h, i) at e*I*H + i*H + h)."""
    out = []
    if not grouped:
        return [(p.name, p.dtype, p.shape, p.pieces) for p in params]
    layers = {}
    for p in params:
        m = EXPERT.match(p.name)
        if m is None:
            out.append((p.name, p.dtype, p.shape, p.pieces))
            continue
        key = m.group(1)
        if key not in layers:
            layers[key] = {"linear_fc1": [], "linear_fc2": []}
            out.append(key)  # the layer's grouped weights go where its first expert was
        layers[key][m.group(4)].append(p)
    result = []
    for item in out:
        if not isinstance(item, str):
            result.append(item)
            continue
        fc1, fc2 = layers[item]["linear_fc1"], layers[item]["linear_fc2"]
        e_local = len(fc1)
        r1, h = fc1[0].shape     # [2I, H]
        h2, i2 = fc2[0].shape    # [H, I]
        assert len(fc2) == e_local and h2 == h and all(p.shape == (r1, h) for p in fc1) and \
            all(p.shape == (h, i2) for p in fc2), f"{item}: experts of unequal shapes"
        w1, w2 = grouped_pieces(fc1), grouped_pieces(fc2)
        result.append((item + "weight1", fc1[0].dtype, (h, e_local * r1), w1))
        result.append((item + "weight2", fc2[0].dtype, (e_local * i2, h), w2))
    return result


def caching_estimate(sizes):
    """Bytes PyTorch's caching allocator reserves for tensors of these sizes allocated in
    turn (its rules: up to 1 MiB from 2 MiB segments, below 10 MiB from 20 MiB segments,
    larger ones rounded up to 2 MiB; blocks of 512 bytes; a segment's rest is used by the next
    tensors that fit)."""
    mib = 1 << 20
    total, left = 0, {2 * mib: 0, 20 * mib: 0}
    for n in sizes:
        n = (max(n, 1) + 511) // 512 * 512
        seg = 2 * mib if n <= mib else 20 * mib if n < 10 * mib else None
        if seg is None:
            total += (n + 2 * mib - 1) // (2 * mib) * 2 * mib
            continue
        if left[seg] < n:
            total += seg
            left[seg] = seg
        left[seg] -= n
    return total


# ---- the pattern ---------------------------------------------------------------------------

class Pattern:
    """The weights of every version, computed where the tensors are (see the module's doc)."""

    def __init__(self, device, maxdim):
        self.device, self.n = device, SHIFT + maxdim
        self.tables = {}

    def table(self, es, d):
        t = self.tables.get((es, d))
        if t is None:
            raw = hashlib.shake_256(b"refit bench table %d %d" % (es, d)).digest(self.n * es)
            t = torch.frombuffer(bytearray(raw), dtype=INT[es]).to(self.device)
            self.tables[(es, d)] = t
        return t

    @staticmethod
    def offsets(name, version, ndim):
        h = hashlib.blake2b(f"{name}\0{version}".encode(), digest_size=8 * ndim).digest()
        return [int.from_bytes(h[8 * d:8 * d + 8], "little") % SHIFT for d in range(ndim)]

    def write(self, out, name, version, start):
        """Writes version's values of the box of tensor name at start into out (an integer
        view of the box, any strides)."""
        es, nd = out.element_size(), out.dim()
        offs = self.offsets(name, version, nd)
        vec = [self.table(es, d)[s + o:s + o + n]
               for d, (s, o, n) in enumerate(zip(start, offs, out.shape))]
        if nd == 1:
            out.copy_(vec[0])
        elif nd == 2:
            torch.bitwise_xor(vec[0][:, None], vec[1][None, :], out=out)
        else:
            acc = vec[0].view([-1] + [1] * (nd - 1))
            for d in range(1, nd):
                acc = torch.bitwise_xor(acc, vec[d].view([1] * d + [-1] + [1] * (nd - d - 1)))
            out.copy_(acc)


def as_int(t):
    return t.view(INT[t.element_size()])


def box_view(tensor, piece):
    """The view of tensor (contiguous, its own storage offset) holding piece."""
    return rt.piece_view(tensor, piece)


# ---- the processes -------------------------------------------------------------------------

def setup(a):
    model = a.model or spec_for(GEOMS[a.geom][0], a.layers, a.workdir)
    _, src, dst = GEOMS[a.geom]
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return model, src, dst, dev


def allocator(dev):
    if dev.type != "cuda":
        return "host (refit.torch arenas)"
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return "expandable" if "expandable_segments:True" in conf else "caching"


def new_tensor(shape, dtype, dev):
    """A parameter's memory as a module makes it: one torch.empty per parameter on the GPU
    (host memory comes from refit.torch's shared arenas, which refit can move)."""
    if dev.type == "cuda":
        return torch.empty(shape, dtype=dtype, device=dev)
    return rt.empty(shape, dtype)


def build_module(tensors, dev):
    """An nn.Module tree with one nn.Parameter per tensor (name, dtype, shape, pieces)."""
    root = torch.nn.Module()
    for name, dtype, shape, _ in tensors:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, torch.nn.Parameter(new_tensor(shape, dtype, dev),
                                                      requires_grad=False))
    return root


def status_last(client, version, key, timeout_s=5.0):
    """The daemon's status after version's commit: its last_refit (key 'cluster' for the
    coordinator's view, '' for the daemon's own) once it names version."""
    deadline = time.time() + timeout_s
    while True:
        s = json.loads(client.status())
        where = s[key] if key else s
        if where["last_refit"]["version"] == version or time.time() > deadline:
            return s, where["last_refit"]
        time.sleep(0.002)


def wait_set_up(sock, timeout_s):
    """Seconds until the receiverd on sock holds a complete plan whose data path is set up
    (status plan_id and preparing): a state the benchmark waits for, not a guess."""
    t0 = time.perf_counter()
    with refit.Client(refit.CTL, "bench-ready", 0, sock) as c:
        while True:
            s = json.loads(c.status())
            node = s.get("node_status", s)
            if node.get("plan_id") and not node.get("preparing", False):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise SystemExit(f"trainer: the receiverd at {sock} set up no plan within "
                                 f"{timeout_s:.0f} s: {json.dumps(node)[:400]}")
            time.sleep(0.005)


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def oom_hint(what, dev, need):
    free, total = torch.cuda.mem_get_info(dev) if dev.type == "cuda" else (0, 0)
    return (f"{what}: out of GPU memory allocating {need / GIB:.2f} GiB ({free / GIB:.2f} of "
            f"{total / GIB:.2f} GiB free now): run the q30b geometry with fewer layers "
            f"(LAYERS=24 bench/bench_torch_refit.sh, or --layers 24)")


def trainer(a):
    model, src, _, dev = setup(a)
    t0 = time.perf_counter()
    ranks = world(model, "megatron", src, a.shrink)
    per_rank = [trainer_tensors(params, a.grouped_transposed) for params in ranks]
    need = sum(nelem(s) * esize(d) for ts in per_rank for _, d, s, _ in ts)
    try:
        modules = [build_module(ts, dev) for ts in per_rank]
    except torch.cuda.OutOfMemoryError:
        raise SystemExit(oom_hint("trainer", dev, need))
    named = [dict(m.named_parameters()) for m in modules]
    t_alloc = time.perf_counter()
    clients, regions, npieces = [], 0, 0
    for r, (m, ts) in enumerate(zip(modules, per_rank)):
        c = refit.Client(refit.TRAINER, f"megatron-rank{r}", r, a.socket)
        if not a.grouped_transposed:
            info = rt.register_module(c, m, "megatron", src, r, model, a.shrink)
            npieces += info["pieces"]
        else:
            # GroupedMLP's transposed experts are no parameter of the layout's: every piece is
            # registered as a view of the tensor that holds it.
            for name, _, _, pieces in ts:
                for pc in pieces:
                    hf, gs, st, ex = pc[:4]
                    npieces += rt.register(c, hf, box_view(named[r][name], pc),
                                           [(s, s + e) for s, e in zip(st, ex)], gs)
        regions += rt.region_count(c)
        c.seal()
        clients.append(c)
    t_reg = time.perf_counter()
    # What each version writes: (integer view of the box, HF name, start) per piece.
    boxes = [(as_int(box_view(named[r][name], pc)), pc[0], pc[2])
             for r, ts in enumerate(per_rank) for name, _, _, pieces in ts for pc in pieces]
    pat = Pattern(dev, max(max(pc[1]) for ts in per_rank for _, _, _, ps in ts for pc in ps))
    print(f"trainer: {len(ranks)} Megatron ranks of {model} {src}"
          f"{' (GroupedMLP experts, transposed)' if a.grouped_transposed else ''}, "
          f"{sum(len(ts) for ts in per_rank)} tensors, {npieces} pieces, {regions} regions, "
          f"{need / GIB:.2f} GiB on {dev} ({allocator(dev)}); allocated in "
          f"{t_alloc - t0:.2f} s, registered in {t_reg - t_alloc:.2f} s", flush=True)
    # The data path's setup (the receiverd maps the trainer's memory and derives its copy plan
    # once the inventory is complete) is timed on its own: the cold refit starts after it.
    setup_s = wait_set_up(a.ready_socket, a.timeout_s) if a.ready_socket else None
    if setup_s is not None:
        print(f"trainer: the receiverd's data path was set up {setup_s:.3f} s after the seal",
              flush=True)
    refits, fills = [], []
    timeout_ms = int(a.timeout_s * 1000)
    v, warm_sum = 1, 0.0
    while True:
        last = v == 1 + a.warm or (v >= 2 and warm_sum + refits[-1]["start_to_commit_s"] >
                                   a.budget_s)
        tf = time.perf_counter()
        if v == 1 or last:
            # Only the version the engine checks, and the first, are written: the refits between
            # move the same bytes as new versions (a refit does not look at what it copies), and
            # a last refit that moved nothing leaves version 1's values, which the check finds.
            with torch.no_grad():
                for view, hf, start in boxes:
                    pat.write(view, hf, v, start)
            # The fill ends before the publish: while the refit runs this process only waits.
            sync(dev)
        fills.append(time.perf_counter() - tf)
        if last:
            write_json(a.last_file, {"version": v})
        for c in clients:
            c.publish(v)
        for c in clients:
            c.wait_released(v, timeout_ms)
        s, lr = status_last(clients[0], v, "cluster")
        if lr["version"] != v or lr["result"] != "committed":
            raise SystemExit(f"trainer: version {v} was released, but the coordinator's last "
                             f"refit is {lr['version']} {lr['result']}")
        lr = dict(lr, fill_s=fills[-1])
        refits.append(lr)
        if v >= 2:
            warm_sum += lr["start_to_commit_s"]
        fill = f"  (written before publish in {fills[-1]:.3f} s)" if v == 1 or last else ""
        print(f"refit {v:3d} {'cold' if v == 1 else 'warm'}  {lr['bytes']} bytes  start->commit "
              f"{lr['start_to_commit_s']:.4f} s  transfer {lr['transfer_s']:.4f} s{fill}",
              flush=True)
        if last:
            break
        v += 1
    write_json(a.out, {"role": "trainer", "geom": a.geom, "model": model, "src": src,
                       "grouped": a.grouped_transposed, "allocator": allocator(dev),
                       "verify": s["cluster"]["config"]["verify"], "ranks": len(ranks),
                       "tensors": sum(len(ts) for ts in per_rank), "pieces": npieces,
                       "regions": regions, "bytes_held": need, "alloc_s": t_alloc - t0,
                       "register_s": t_reg - t_alloc, "setup_s": setup_s, "refits": refits})
    for c in clients:
        c.close()


def check(named, params_by_rank, pat, version):
    """(wrong elements, checked elements, their bytes) of every engine piece against version's values: per
    parameter, the expected values written into a copy of it (bytes outside its pieces stay
    as they are) and compared element by element as integers, i.e. bit for bit."""
    wrong, n, nbytes = None, 0, 0
    with torch.no_grad():
        for r, params in enumerate(params_by_rank):
            for p in params:
                have = as_int(named[r][p.name].data)
                want = have.clone()
                for pc in p.pieces:
                    pat.write(box_view(want, pc), pc[0], version, pc[2])
                    n += nelem(pc[3])
                    nbytes += nelem(pc[3]) * have.element_size()
                w = torch.ne(have, want).sum()
                wrong = w if wrong is None else wrong + w
    return int(wrong), n, nbytes


def engine(a):
    model, _, dst, dev = setup(a)
    t0 = time.perf_counter()
    ranks = world(model, "vllm", dst, a.shrink)
    need = sum(param_bytes(p) for ps in ranks for p in ps)
    try:
        modules = [build_module([(p.name, p.dtype, p.shape, p.pieces) for p in ps], dev)
                   for ps in ranks]
        for m in modules:
            for t in m.parameters():
                t.data.zero_()
    except torch.cuda.OutOfMemoryError:
        raise SystemExit(oom_hint("engine", dev, need))
    named = [dict(m.named_parameters()) for m in modules]
    pat = Pattern(dev, max(max(pc[1]) for ps in ranks for p in ps for pc in p.pieces))
    pre = ""
    pre_wrong = None
    if a.precheck:
        # The check must be able to fail: before any refit (zeros) nearly every element is
        # wrong.
        tc = time.perf_counter()
        pre_wrong, pre_n, _ = check(named, ranks, pat, 1)
        sync(dev)
        if pre_wrong < 0.99 * pre_n:
            raise SystemExit(f"engine: the check found only {pre_wrong} of {pre_n} elements "
                             "wrong before any refit; it cannot tell right from wrong bytes")
        pre = (f"; check before any refit: {pre_wrong} of {pre_n} elements wrong "
               f"({time.perf_counter() - tc:.2f} s), as it must")
    t_alloc = time.perf_counter()
    clients, regions, npieces = [], 0, 0
    for r, m in enumerate(modules):
        c = refit.Client(refit.ENGINE, f"vllm-rank{r}", r, a.socket)
        info = rt.register_module(c, m, "vllm", dst, r, model, a.shrink)
        npieces += info["pieces"]
        regions += rt.region_count(c)
        c.gate()
        c.seal()
        clients.append(c)
    t_reg = time.perf_counter()
    print(f"engine: {len(ranks)} vLLM ranks of {model} {dst}, "
          f"{sum(len(ps) for ps in ranks)} parameters, {npieces} pieces, {regions} regions, "
          f"{need / GIB:.2f} GiB on {dev} ({allocator(dev)}){pre}", flush=True)
    timeout_ms = int(a.timeout_s * 1000)
    v = 1
    while True:
        # Between refits this process only waits: no GPU work while one runs.
        for c in clients:
            got = c.wait_version(v, timeout_ms)
            if got != v:
                raise SystemExit(f"engine: waited for version {v}, the daemon committed {got}")
        last = None
        if os.path.exists(a.last_file):
            with open(a.last_file) as f:
                last = json.load(f)["version"]
        if last == v:
            break
        for c in clients:
            c.consumed(v)
        v += 1
    s, lr = status_last(clients[0], v, "")
    tc = time.perf_counter()
    wrong, n, nbytes = check(named, ranks, pat, v)
    sync(dev)
    check_s = time.perf_counter() - tc
    print(f"engine: version {v}: {wrong} wrong of {n} elements ({nbytes / 1e9:.2f} GB checked in "
          f"{check_s:.2f} s); receiverd's last refit: {lr['paths']['local']['bytes']} bytes "
          f"local, {lr['paths']['network']['bytes']} over the network", flush=True)
    for c in clients:
        c.consumed(v)
    write_json(a.out, {"role": "engine", "geom": a.geom, "model": model, "dst": dst,
                       "allocator": allocator(dev), "ranks": len(ranks), "pieces": npieces,
                       "regions": regions, "bytes_held": need, "version": v,
                       "wrong": wrong, "checked": n, "checked_bytes": nbytes,
                       "check_s": check_s,
                       "precheck_wrong": pre_wrong, "register_s": t_reg - t_alloc,
                       "local_bytes": lr["paths"]["local"]["bytes"],
                       "network_bytes": lr["paths"]["network"]["bytes"]})
    for c in clients:
        c.close()
    if wrong:
        sys.exit(1)


def ceiling(a):
    """bench_gpu's same-GPU ceiling in torch: one 1 GiB buffer copied into another again and
    again to the refit's byte count, timed with CUDA events; best of 3 after a warm-up."""
    dev = torch.device(a.device)
    torch.cuda.set_device(dev)
    chunk = min(GIB, a.bytes)
    src = torch.empty(chunk, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty(chunk, dtype=torch.uint8, device=dev)
    best = None
    for it in range(4):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        e0.record()
        left = a.bytes
        while left > 0:
            n = min(chunk, left)
            dst[:n].copy_(src[:n])
            left -= n
        e1.record()
        e1.synchronize()
        s = e0.elapsed_time(e1) / 1e3
        if it > 0:
            best = s if best is None else min(best, s)
    print(f"ceiling: {a.bytes} bytes copied on {dev} through one {chunk >> 20} MiB buffer in "
          f"{best:.4f} s ({a.bytes / best / 1e9:.1f} GB/s), best of 3", flush=True)
    write_json(a.out, {"role": "ceiling", "geom": a.geom, "bytes": a.bytes, "seconds": best})


# ---- the driver's helpers ------------------------------------------------------------------

def geom(a):
    model_name, src, dst = GEOMS[a.geom]
    model = spec_for(model_name, a.layers, a.workdir)
    tr = world(model, "megatron", src, a.shrink)
    en = world(model, "vllm", dst, a.shrink)
    moved = sum(nelem(pc[3]) * esize(p.dtype) for ps in en for p in ps for pc in p.pieces)
    print(f"MODEL={model} SRC={src} DST={dst} TRAINERS={len(tr)} ENGINES={len(en)} BYTES={moved}")


def dry_run(a):
    model_name, src, dst = GEOMS[a.geom]
    model = spec_for(model_name, a.layers, a.workdir)
    tr = [trainer_tensors(ps, a.grouped_transposed) for ps in world(model, "megatron", src,
                                                                    a.shrink)]
    en = [[(p.name, p.dtype, p.shape, p.pieces) for p in ps]
          for ps in world(model, "vllm", dst, a.shrink)]
    moved = sum(nelem(pc[3]) * esize(d) for ts in en for _, d, _, ps in ts for pc in ps)
    print(f"{a.geom}: {model} (trainer Megatron {src}"
          f"{', GroupedMLP experts transposed' if a.grouped_transposed else ''} -> engine vLLM "
          f"{dst}); each refit moves {moved} bytes ({moved / 1e9:.2f} GB)")
    print(f"{'process':8} {'rank':>4} {'tensors':>8} {'pieces':>7} {'GiB':>8} "
          f"{'caching GiB':>11}  largest tensor")
    total = {}
    for who, ranks in (("trainer", tr), ("engine", en)):
        for r, ts in enumerate(ranks):
            sizes = [nelem(s) * esize(d) for _, d, s, _ in ts]
            big = max(ts, key=lambda t: nelem(t[2]) * esize(t[1]))
            est = caching_estimate(sizes)
            total[who] = [x + y for x, y in zip(total.get(who, [0, 0]), [sum(sizes), est])]
            print(f"{who:8} {r:4d} {len(ts):8d} {sum(len(t[3]) for t in ts):7d} "
                  f"{sum(sizes) / GIB:8.2f} {est / GIB:11.2f}  {big[0]} {list(big[2])}")
            if a.list:
                for name, d, s, ps in ts:
                    print(f"    {name} {list(s)} {str(d).replace('torch.', '')} "
                          f"{nelem(s) * esize(d)} bytes, {len(ps)} pieces")
    both = [total["trainer"][i] + total["engine"][i] for i in (0, 1)]
    print(f"trainer {total['trainer'][0] / GIB:.2f} GiB + engine {total['engine'][0] / GIB:.2f} "
          f"GiB = {both[0] / GIB:.2f} GiB of tensors; the caching allocator's segments "
          f"(estimate) {both[1] / GIB:.2f} GiB; with {CONTEXTS_GIB:.1f} GiB of CUDA contexts "
          f"{both[1] / GIB + CONTEXTS_GIB:.2f} GiB of one H200's {H200_GIB} GiB, "
          f"{H200_GIB - both[1] / GIB - CONTEXTS_GIB:.2f} GiB left (no reference copies: the "
          "engine's check computes each parameter's expected values in turn)")


# ---- the table -----------------------------------------------------------------------------

def table(a):
    """The table of a run: RESULTS-DIR holds NN-NAME-config.json (what the driver ran, and why
    it failed if it did), NN-NAME-trainer.json, NN-NAME-engine.json, ceiling-*.json, sim-*.json
    and note-*.json."""
    runs, ceil, sims, notes = {}, {}, {}, []
    for path in sorted(glob.glob(os.path.join(a.dir, "*.json"))):
        with open(path) as f:
            r = json.load(f)
        if not isinstance(r, dict) or "role" not in r:
            continue
        if r["role"] == "ceiling":
            ceil[r["geom"]] = r
        elif r["role"] == "sim":
            sims[(r["geom"], r["verify"])] = r
        elif r["role"] == "note":
            notes.append(r["text"])
        else:
            runs.setdefault(os.path.basename(path).rsplit("-", 1)[0], {})[r["role"]] = r
    print(f"{'geometry':20} {'allocator':10} {'verify':6} {'GB':>6} {'setup s':>8} {'cold s':>8} "
          f"{'warm s':>8} {'n':>2} {'ceil s':>8} {'ceil/warm':>9} {'sim s':>8} "
          f"{'warm/sim':>8} {'#wrong':>7}")
    status, fails = 0, []
    for key in sorted(runs):
        r = runs[key]
        cfg, t, e = r.get("config", {}), r.get("trainer"), r.get("engine")
        label = cfg.get("label", key)
        if t is None or e is None or cfg.get("why"):
            status = 1
            print(f"{label:20} {cfg.get('allocator', '?'):10} {cfg.get('verify', '?'):6} "
                  f"FAILED: {cfg.get('why') or 'no result from the trainer or the engine'}")
            continue
        cold = t["refits"][0]["start_to_commit_s"]
        warm = [x["start_to_commit_s"] for x in t["refits"][1:]]
        med = statistics.median(warm) if warm else float("nan")
        nbytes = t["refits"][-1]["bytes"]
        c = ceil.get(t["geom"])
        cs = c["seconds"] * nbytes / c["bytes"] if c else None
        sim = sims.get((t["geom"], t["verify"]))
        sim_s = sim["warm_s"] if sim else None
        col = [f"{cs:8.4f}" if cs else f"{'-':>8}", f"{cs / med:9.2f}" if cs else f"{'-':>9}",
               f"{sim_s:8.4f}" if sim_s else f"{'-':>8}",
               f"{med / sim_s:8.2f}" if sim_s else f"{'-':>8}"]
        print(f"{label:20} {cfg.get('allocator', '?'):10} {t['verify']:6} {nbytes / 1e9:6.2f} "
              f"{t.get('setup_s') or float('nan'):8.3f} {cold:8.4f} "
              f"{med:8.4f} {len(warm):2d} {' '.join(col)} {e['wrong']:7d}")
        if e["wrong"]:
            fails.append(f"{label} {cfg.get('allocator')} verify {t['verify']}: the engine found "
                         f"{e['wrong']} of {e['checked']} elements wrong")
        if e["network_bytes"] or not e["local_bytes"]:
            fails.append(f"{label} {cfg.get('allocator')} verify {t['verify']}: {e['network_bytes']} "
                         f"bytes over the network and {e['local_bytes']} as same-host copies; "
                         "every byte should be a same-host copy")
        if t["verify"] != cfg.get("verify"):
            fails.append(f"{label} {cfg.get('allocator')}: verify {cfg.get('verify')} was asked "
                         f"for, the coordinator ran {t['verify']}")
        if nbytes != e["checked_bytes"]:
            fails.append(f"{label} {cfg.get('allocator')} verify {t['verify']}: the refit moved "
                         f"{nbytes} bytes, the engine's pieces hold {e['checked_bytes']}")
    print()
    print("setup: from the trainer's seal until the receiverd's data path for the plan was set up "
          "(trainer memory mapped, copy plan derived: status plan_id and preparing); the trainer "
          "publishes version 1 after it.")
    print("cold: refit 1's Start->Commit, after that setup; warm: median Start->Commit of the n refits after it (the coordinator's "
          "status). ceil s: torch copy_ of the same bytes through one 1 GiB buffer on the same "
          "GPU (CUDA events, best of 3); ceil/warm: the fraction of that speed reached. sim s: "
          "refit-sim-trainer/engine on VMM memory, same model, layouts and verify "
          "(bench/bench_fp8.sh), warm median; warm/sim: this refit's time over the simulator's "
          "(grouped-T rows: against the untransposed simulator). #wrong: elements of the last "
          "version the engine found wrong (every element of every piece, bit for bit).")
    print("While a refit runs, the trainer and engine processes only wait (no GPU work of their "
          "own): the trainer writes a version's weights (the first and the last version) and "
          "synchronizes before it publishes; the engine checks only the last version, after its "
          "commit, with no refit after it.")
    for n in notes:
        print("note: " + n)
    for f in fails:
        print("FAIL: " + f)
    sys.exit(1 if status or fails else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--geom", choices=sorted(GEOMS), required=True)
        p.add_argument("--layers", type=int, default=0,
                       help="the model's first N layers (0: all); a JSON spec in --workdir")
        p.add_argument("--shrink", type=int, default=1, help="divide the large dims (tests)")
        p.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp"))
        p.add_argument("--grouped-transposed", action="store_true",
                       help="trainer experts as Megatron's GroupedMLP holds them: weight1 "
                       "[H, E*2I], weight2 [E*I, H], each expert's weights transposed")

    for name in ("trainer", "engine"):
        p = sub.add_parser(name)
        common(p)
        p.add_argument("--model", help="the model as `geom` printed it (default: from --geom)")
        p.add_argument("--socket", required=True)
        p.add_argument("--device", default="cuda:0")
        p.add_argument("--out", required=True, help="the result, JSON")
        p.add_argument("--last-file", required=True,
                       help="the trainer writes the last version here before publishing it")
        p.add_argument("--warm", type=int, default=5, help="warm refits after the cold one")
        p.add_argument("--budget-s", type=float, default=30.0,
                       help="fewer warm refits once their Start->Commit sum would pass this "
                       "(at least one)")
        p.add_argument("--timeout-s", type=float, default=600.0)
        if name == "trainer":
            p.add_argument("--ready-socket",
                           help="the receiverd's socket: publish version 1 once its data path "
                           "is set up, and report how long that took after the seal")
        if name == "engine":
            p.add_argument("--precheck", action="store_true",
                           help="first show that the check finds the zeros it starts with wrong")
    p = sub.add_parser("ceiling")
    p.add_argument("--geom", required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", required=True)
    for name in ("geom", "dry-run"):
        p = sub.add_parser(name)
        common(p)
        if name == "dry-run":
            p.add_argument("--list", action="store_true", help="every tensor of every rank")
    p = sub.add_parser("table")
    p.add_argument("dir")
    a = ap.parse_args()
    {"trainer": trainer, "engine": engine, "ceiling": ceiling, "geom": geom,
     "dry-run": dry_run, "table": table}[a.cmd](a)


if __name__ == "__main__":
    main()
