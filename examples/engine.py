"""examples/engine.py - the engine of the example: the same Qwen3 held the way vLLM holds it,
fused qkv_proj and gate_up_proj, sharded over tp ranks (two refit clients in one process, one
per rank), each rank's weights in a memfd-backed arena registered with refit.torch ("vllm"
convention). After each committed version it runs its forward pass against the fused buffers,
compares the prompt's logits with the trainer's (torch.equal) and generates a few tokens
greedily, then lets the next version in.

With --device cuda:N (the GPU mode) the ranks' buffers are CUDA tensors on that GPU and the
forward pass is HF transformers' Qwen3ForCausalLM, the trainer's own, with its parameters
replaced by views into the fused buffers (hf_qwen3.EngineModel; tp=2 gathers what spans ranks).

  engine.py --socket RECEIVERD.sock --dir DIR [--versions N] [--tp T] [--model M --shrink S]
            [--device cuda:N]"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import qwen3  # first: it puts client/python on the path and points REFIT_LIB at the build
import refit
import refit.torch as rt


def param(shape):
    return torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)


class VllmRank(torch.nn.Module):
    """One tensor-parallel rank of vLLM's Qwen3ForCausalLM: qkv_proj rows [q | k | v] and
    gate_up_proj rows [gate | up] of this rank's heads and columns, o_proj and down_proj its
    input columns, embed_tokens its slice of the vocabulary; the norms whole."""

    def __init__(self, cfg, tp):
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.q_rows = cfg.heads * hd // tp
        self.kv_rows = cfg.kv_heads * hd // tp
        self.mlp_rows = cfg.intermediate // tp
        self.vocab_rows = -(-cfg.vocab // tp)
        m = self.model = torch.nn.Module()
        m.embed_tokens = torch.nn.Module()
        m.embed_tokens.weight = param((self.vocab_rows, h))
        m.layers = torch.nn.ModuleList()
        for _ in range(cfg.layers):
            layer = torch.nn.Module()
            layer.input_layernorm = torch.nn.Module()
            layer.input_layernorm.weight = param((h,))
            a = layer.self_attn = torch.nn.Module()
            for name, shape in (("qkv_proj", (self.q_rows + 2 * self.kv_rows, h)),
                                ("o_proj", (h, self.q_rows)), ("q_norm", (hd,)),
                                ("k_norm", (hd,))):
                setattr(a, name, torch.nn.Module())
                getattr(a, name).weight = param(shape)
            layer.post_attention_layernorm = torch.nn.Module()
            layer.post_attention_layernorm.weight = param((h,))
            p = layer.mlp = torch.nn.Module()
            p.gate_up_proj = torch.nn.Module()
            p.gate_up_proj.weight = param((2 * self.mlp_rows, h))
            p.down_proj = torch.nn.Module()
            p.down_proj.weight = param((h, self.mlp_rows))
            m.layers.append(layer)
        m.norm = torch.nn.Module()
        m.norm.weight = param((h,))


class VllmWeights:
    """The weights of the tp ranks for qwen3.forward. Column-parallel layers (qkv_proj,
    gate_up_proj, the tied lm_head) run one GEMM per rank on its fused buffer and split or
    gather the outputs: bitwise the same as HF's separate GEMMs on CPU. Row-parallel layers
    (o_proj, down_proj) gather the ranks' input columns into one GEMM when allreduce is False:
    vLLM's all-reduce of per-rank partial sums adds in another order, which differs from one
    GEMM in the last bits (engine.py --row-parallel allreduce shows by how much)."""

    def __init__(self, cfg, ranks, allreduce=False):
        self.vocab = cfg.vocab
        self.ranks = ranks
        self.p = [dict(m.named_parameters()) for m in ranks]
        self.allreduce = allreduce

    def weight(self, name):
        return self.p[0][name]

    def embed(self, tokens):
        out = None
        for n, (r, p) in enumerate(zip(self.ranks, self.p)):
            lo = r.vocab_rows * n
            mine = (tokens >= lo) & (tokens < lo + r.vocab_rows)
            e = F.embedding((tokens - lo).clamp(0, r.vocab_rows - 1),
                            p["model.embed_tokens.weight"]).float()
            out = e if out is None else torch.where(mine[:, None], e, out)
        return out

    def norm(self, name, x):
        return qwen3.rms_norm(x, self.p[0][name])

    def qkv(self, i, x):
        q, k, v = [], [], []
        for r, p in zip(self.ranks, self.p):
            out = F.linear(x, p[f"model.layers.{i}.self_attn.qkv_proj.weight"].float())
            a, b, c = out.split([r.q_rows, r.kv_rows, r.kv_rows], -1)
            q.append(a), k.append(b), v.append(c)
        return torch.cat(q, -1), torch.cat(k, -1), torch.cat(v, -1)

    def gate_up(self, i, x):
        g, u = [], []
        for r, p in zip(self.ranks, self.p):
            out = F.linear(x, p[f"model.layers.{i}.mlp.gate_up_proj.weight"].float())
            a, b = out.split([r.mlp_rows, r.mlp_rows], -1)
            g.append(a), u.append(b)
        return torch.cat(g, -1), torch.cat(u, -1)

    def row_parallel(self, a, name):
        ws = [p[name].float() for p in self.p]
        if self.allreduce:
            parts = a.split([w.shape[1] for w in ws], -1)
            return sum(F.linear(x, w) for x, w in zip(parts, ws))
        return F.linear(a, torch.cat(ws, 1))

    def o(self, i, a):
        return self.row_parallel(a, f"model.layers.{i}.self_attn.o_proj.weight")

    def down(self, i, a):
        return self.row_parallel(a, f"model.layers.{i}.mlp.down_proj.weight")

    def lm_head(self, x):
        out = torch.cat([F.linear(x, p["model.embed_tokens.weight"].float()) for p in self.p],
                        -1)
        return out[:, :self.vocab]  # a last shard's padding rows, were there any


def generate(forward, tokens, n):
    """n tokens, greedily (the whole sequence again each step: no KV cache in this example);
    forward(tokens) gives the logits."""
    out = []
    for _ in range(n):
        logits = forward(torch.cat([tokens, torch.tensor(out, dtype=tokens.dtype)]))
        out.append(int(logits[-1].argmax()))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--dir", required=True, help="where the trainer writes vN.pt")
    ap.add_argument("--versions", type=int, default=3)
    # qwen3-0.6b's 8 KV heads split over either without vLLM's KV replication (which this
    # example's gather of k and v would have to undo).
    ap.add_argument("--tp", type=int, default=2, choices=[1, 2])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--shrink", type=int, default=8)
    ap.add_argument("--generate", type=int, default=4, help="tokens to generate per version")
    ap.add_argument("--row-parallel", choices=["gather", "allreduce"], default="gather",
                    help="o_proj/down_proj as one GEMM over the gathered shards (bitwise "
                    "equal to the trainer's) or as vLLM's all-reduce of partial sums (not)")
    ap.add_argument("--device", default="cpu", help="cpu (memfd arenas, qwen3.py's forward) or "
                    "cuda:N (CUDA buffers, transformers' forward on views of them)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as the trainer: the same GEMM work split
    cfg = qwen3.Config(args.model, args.shrink)
    print(f"engine: {cfg}, vllm tp={args.tp}", flush=True)
    gpu = args.device != "cpu"
    timeout_ms = 60000
    if gpu:
        import hf_qwen3 as hq  # transformers and CUDA: only here
        if args.row_parallel != "gather":
            sys.exit("engine: --row-parallel allreduce is the CPU example's; the GPU mode runs "
                     "HF's forward pass (o_proj/down_proj whole)")
        dev = hq.setup_cuda(args.device, "engine")
        timeout_ms = hq.TIMEOUT_MS
    layout = f"tp={args.tp}"
    ranks = []
    for r in range(args.tp):
        module = VllmRank(cfg, args.tp)
        if gpu:
            module.to(dev)
        else:
            rt.share_module(module)
        c = refit.Client(refit.ENGINE, name=f"example-engine-tp{r}", rank=r, socket=args.socket)
        info = rt.register_module(c, module, "vllm", layout, r, args.model, args.shrink)
        # Gated: the daemon installs the next version only after consumed(), so the weights
        # do not change under a forward pass.
        c.gate()
        c.seal()
        print(f"engine rank {r}: registered {info['params']} parameters, {info['pieces']} "
              f"pieces in {info['regions']} region(s)", flush=True)
        ranks.append((module, c))
    if gpu:
        hf = hq.EngineModel(cfg, [m for m, _ in ranks], dev)
        forward, refresh = hf.logits, hf.refresh
        how = "HF forward on views of the fused buffers"
        print(f"engine: {hq.describe(hf.model)} on {dev}: {hf.views} parameters are views into "
              f"the ranks' buffers, {len(hf.gathers)} gathered from {args.tp} ranks per version",
              flush=True)
    else:
        w = VllmWeights(cfg, [m for m, _ in ranks], allreduce=args.row_parallel == "allreduce")
        forward, refresh = (lambda t: qwen3.forward(cfg, w, t)), (lambda: None)
        how = f"row-parallel layers by {args.row_parallel}"
    prompt = qwen3.prompt(cfg)
    bad = v = 0
    while v < args.versions:
        # The version the daemon committed, which these buffers hold: the next one, since the
        # engine is gated and the trainer publishes each; a later one were it to skip some.
        v = max(c.wait_version(v + 1, timeout_ms) for _, c in ranks)
        t0 = time.monotonic()
        with torch.no_grad():
            refresh()
            logits = forward(prompt)
            ref = torch.load(os.path.join(args.dir, f"v{v}.pt"))
            equal = torch.equal(logits, ref["logits"])
            tokens = generate(forward, prompt, args.generate)
            if gpu:
                torch.cuda.synchronize(dev)  # done reading before the next version may land
        print(f"version {v}: trainer loss {ref['loss']:.4f} | engine generated {tokens} | "
              f"logits equal (torch.equal): {equal} | {time.monotonic() - t0:.2f} s", flush=True)
        if not equal:
            diff = (logits - ref["logits"]).abs().max().item()
            print(f"engine: version {v}: logits differ from the trainer's by up to {diff:.3g} "
                  f"({how}); either refit moved wrong "
                  "bytes or the two forward passes do different float math", flush=True)
            bad += 1
        for _, c in ranks:
            c.consumed(v)
    for _, c in ranks:
        c.close()
    if bad:
        sys.exit(f"engine: {bad} of {args.versions} versions had logits unequal to the trainer's")


if __name__ == "__main__":
    main()
