"""examples/trainer.py - the trainer of the example: a Qwen3 module in plain torch with HF's
parameter names, one rank. It trains fp32 master weights with AdamW (causal LM loss on a small
fixed batch) and publishes their bf16 copy, which lives in one memfd-backed arena registered
with refit.torch ("hf" convention), as versions 1..N. Before each publish it writes the loss
and the fp32 logits of the fixed prompt under the published weights to DIR/vN.pt, which the
engine compares with its own.

With --device cuda:N (the GPU mode, train_hf below) the model is HF transformers'
Qwen3ForCausalLM instead, its fp32 master sharded by FSDP2 (fully_shard on a 1-rank device
mesh, NCCL) and trained with AdamW on that GPU; the bf16 copy it publishes is a DTensor per
parameter with the master's placements, registered through refit.torch's DTensor support, and
the logits of vN.pt come from the same HF forward pass (hf_qwen3.py) on views of that copy.

  trainer.py --socket PUBLISHERD.sock --dir DIR [--versions N] [--model M --shrink S]
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


class RMSNorm(torch.nn.Module):
    def __init__(self, n, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, dtype=dtype))


def linear(rows, cols, dtype):
    m = torch.nn.Linear(cols, rows, bias=False)
    m.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype))
    return m


class Layer(torch.nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.input_layernorm = RMSNorm(h, dtype)
        self.self_attn = torch.nn.Module()
        a = self.self_attn
        a.q_proj = linear(cfg.heads * hd, h, dtype)
        a.k_proj = linear(cfg.kv_heads * hd, h, dtype)
        a.v_proj = linear(cfg.kv_heads * hd, h, dtype)
        a.o_proj = linear(h, cfg.heads * hd, dtype)
        a.q_norm = RMSNorm(hd, dtype)
        a.k_norm = RMSNorm(hd, dtype)
        self.post_attention_layernorm = RMSNorm(h, dtype)
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj = linear(cfg.intermediate, h, dtype)
        self.mlp.up_proj = linear(cfg.intermediate, h, dtype)
        self.mlp.down_proj = linear(h, cfg.intermediate, dtype)


class Qwen3ForCausalLM(torch.nn.Module):
    """HF's module tree and parameter names (model.embed_tokens, model.layers.N.self_attn.
    q_proj, ...); lm_head only when the config does not tie it to embed_tokens."""

    def __init__(self, cfg, dtype):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(cfg.vocab, cfg.hidden, _weight=torch.empty(
            cfg.vocab, cfg.hidden, dtype=dtype))
        self.model.layers = torch.nn.ModuleList(Layer(cfg, dtype) for _ in range(cfg.layers))
        self.model.norm = RMSNorm(cfg.hidden, dtype)
        if not cfg.tied:
            self.lm_head = linear(cfg.vocab, cfg.hidden, dtype)


class HFWeights:
    """The weights of a Qwen3ForCausalLM for qwen3.forward: HF's split projections, upcast to
    fp32 (a no-op for the fp32 master, so autograd reaches it)."""

    def __init__(self, module):
        self.p = dict(module.named_parameters())

    def weight(self, name):
        return self.p[name]

    def lin(self, x, name):
        return F.linear(x, self.p[name].float())

    def embed(self, tokens):
        return F.embedding(tokens, self.p["model.embed_tokens.weight"]).float()

    def norm(self, name, x):
        return qwen3.rms_norm(x, self.p[name])

    def qkv(self, i, x):
        a = f"model.layers.{i}.self_attn."
        return (self.lin(x, a + "q_proj.weight"), self.lin(x, a + "k_proj.weight"),
                self.lin(x, a + "v_proj.weight"))

    def o(self, i, a):
        return self.lin(a, f"model.layers.{i}.self_attn.o_proj.weight")

    def gate_up(self, i, x):
        m = f"model.layers.{i}.mlp."
        return self.lin(x, m + "gate_proj.weight"), self.lin(x, m + "up_proj.weight")

    def down(self, i, a):
        return self.lin(a, f"model.layers.{i}.mlp.down_proj.weight")

    def lm_head(self, x):
        return self.lin(x, "lm_head.weight" if "lm_head.weight" in self.p
                        else "model.embed_tokens.weight")


def init_(module, seed):
    """Deterministic init: N(0, 0.02) for matrices, ones for the norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0)


def batch(cfg, n=4, t=24):
    """A small fixed batch: windows of the cycle the prompt repeats, so that the training shows
    in what the engine generates after the prompt within a few versions."""
    return torch.stack([qwen3.sequence(cfg, s, t) for s in range(n)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--dir", required=True, help="where vN.pt (loss and logits) are written")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--shrink", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per version")
    ap.add_argument("--device", default="cpu", help="cpu (plain torch, memfd arena) or cuda:N "
                    "(transformers + FSDP2 on that GPU)")
    args = ap.parse_args()
    # One thread: the engine's GEMMs must split their work as these do (and two cores are
    # shared by both processes and the daemons).
    torch.set_num_threads(1)
    cfg = qwen3.Config(args.model, args.shrink)
    print(f"trainer: {cfg}", flush=True)
    if args.device != "cpu":
        return train_hf(args, cfg)

    master = Qwen3ForCausalLM(cfg, torch.float32)
    init_(master, 1234)
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr, weight_decay=0.0)
    published = Qwen3ForCausalLM(cfg, torch.bfloat16).requires_grad_(False)
    rt.share_module(published)  # all of its parameters in one memfd arena
    data = batch(cfg)
    mw, pw = HFWeights(master), HFWeights(published)

    with refit.Client(refit.TRAINER, name="example-trainer", rank=0, socket=args.socket) as c:
        info = rt.register_module(c, published, "hf", "", 0, args.model, args.shrink)
        c.seal()
        print(f"trainer: registered {info['params']} parameters, {info['pieces']} pieces in "
              f"{info['regions']} region(s)", flush=True)
        for v in range(1, args.versions + 1):
            t0 = time.monotonic()
            for _ in range(args.steps):
                opt.zero_grad()
                loss = sum(F.cross_entropy(qwen3.forward(cfg, mw, seq[:-1]), seq[1:])
                           for seq in data) / len(data)
                loss.backward()
                opt.step()
            with torch.no_grad():
                for name, p in published.named_parameters():
                    p.copy_(mw.p[name])
                logits = qwen3.forward(cfg, pw, qwen3.prompt(cfg))
            tmp = os.path.join(args.dir, f".v{v}.pt")
            torch.save({"version": v, "loss": loss.item(), "logits": logits}, tmp)
            os.rename(tmp, os.path.join(args.dir, f"v{v}.pt"))
            c.publish(v)
            c.wait_released(v, 60000)
            print(f"trainer: version {v}: loss {loss.item():.4f}, published and released "
                  f"({time.monotonic() - t0:.2f} s)", flush=True)


def train_hf(args, cfg):
    """The GPU mode: transformers' Qwen3ForCausalLM (fp32 master, the CPU example's init) on
    args.device, FSDP2 over a 1-rank mesh, AdamW; publishes a bf16 DTensor copy of its shards."""
    import hf_qwen3 as hq  # transformers, FSDP2 and CUDA: only here
    who = "trainer"
    dev = hq.setup_cuda(args.device, who)
    dist, init_device_mesh, fully_shard, DTensor = hq.fsdp2_api(who)
    store = os.path.join(os.path.abspath(args.dir), "trainer-pg.store")
    try:
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                device_id=dev)
    except TypeError:  # torch < 2.3: no device_id
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))

    master = hq.build(cfg, "cpu", torch.float32, who)
    init_(master, 1234)  # the CPU example's initial weights (HF names there too)
    master.to(dev)
    for layer in master.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(master, mesh=mesh)
    master.train()
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr, weight_decay=0.0)

    def shards():
        named = dict(master.named_parameters())
        for name, p in named.items():
            if not isinstance(p, DTensor):
                sys.exit(f"trainer: FSDP2 left parameter {name} a {type(p).__name__}, not a "
                         "DTensor (not sharded?)")
        return named

    # What a trainer of FSDP2 ranks publishes: a bf16 shard beside each fp32 master shard,
    # with the same placements, so every rank registers (and refit reads) only its own box.
    published = {}
    for name, p in shards().items():
        local = torch.empty_like(p.to_local(), dtype=torch.bfloat16)
        published[name] = DTensor.from_local(local, p.device_mesh, p.placements,
                                             run_check=False, shape=p.shape, stride=p.stride())
    # The published bytes in an HF module (views, no copy: on one rank a shard is the whole
    # tensor), for the logits of vN.pt through the same forward pass as the engine's.
    ref = hq.build(cfg, dev, torch.bfloat16, who).eval()
    locals_ = {}
    for name, t in published.items():
        if tuple(t.to_local().shape) != tuple(t.shape):
            sys.exit(f"trainer: {name}: this rank's shard {tuple(t.to_local().shape)} is not the "
                     f"whole {tuple(t.shape)}; the example's trainer runs one rank")
        locals_[name] = t.to_local()
    hq.bind_all(ref, cfg, locals_)
    placements = sorted({str(tuple(t.placements)) for t in published.values()})
    print(f"trainer: {hq.describe(master)} on {dev}, FSDP2 fully_shard over mesh "
          f"{tuple(mesh.shape)}, placements {', '.join(placements)}", flush=True)
    data = batch(cfg).to(dev)
    prompt = qwen3.prompt(cfg)

    with refit.Client(refit.TRAINER, name="example-trainer", rank=0, socket=args.socket) as c:
        info = rt.register_module(c, published, "hf", "", 0, args.model, args.shrink)
        c.seal()
        print(f"trainer: registered {info['params']} parameters (bf16 DTensors), "
              f"{info['pieces']} pieces in {info['regions']} region(s)", flush=True)
        for v in range(1, args.versions + 1):
            t0 = time.monotonic()
            for _ in range(args.steps):
                opt.zero_grad()
                out = master(input_ids=data[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(),
                                       data[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
            with torch.no_grad():
                for name, p in shards().items():
                    published[name].to_local().copy_(p.to_local())
                torch.cuda.synchronize(dev)  # the bytes refit reads are written
                logits = hq.logits(ref, prompt, dev)
            tmp = os.path.join(args.dir, f".v{v}.pt")
            torch.save({"version": v, "loss": loss.item(), "logits": logits}, tmp)
            os.rename(tmp, os.path.join(args.dir, f"v{v}.pt"))
            c.publish(v)
            c.wait_released(v, hq.TIMEOUT_MS)
            print(f"trainer: version {v}: loss {loss.item():.4f}, published and released "
                  f"({time.monotonic() - t0:.2f} s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
