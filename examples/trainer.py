"""examples/trainer.py - the trainer of the example: a Qwen3 module in plain torch with HF's
parameter names, one rank. It trains fp32 master weights with AdamW (causal LM loss on a small
fixed batch) and publishes their bf16 copy, which lives in one memfd-backed arena registered
with refit.torch ("hf" convention), as versions 1..N. Before each publish it writes the loss
and the fp32 logits of the fixed prompt under the published weights to DIR/vN.pt, which the
engine compares with its own.

  trainer.py --socket PUBLISHERD.sock --dir DIR [--versions N] [--model M --shrink S]"""

import argparse
import os
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
    ap.add_argument("--versions", type=int, default=3e-3)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--shrink", type=int, default=3e-3)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per version")
    args = ap.parse_args()
    # One thread: the engine's GEMMs must split their work as these do (and two cores are
    # shared by both processes and the daemons).
    torch.set_num_threads(1)
    cfg = qwen3.Config(args.model, args.shrink)
    print(f"trainer: {cfg}", flush=True)

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


if __name__ == "__main__":
    main()
