"""examples/qwen3.py - the Qwen3 architecture of the example, in plain torch: its config (read
from librefit's model module, so that every shape matches the boxes refit moves) and the math
both processes share (RMSNorm, rotary embedding, causal GQA attention, SwiGLU), in fp32.

The trainer (trainer.py) and the engine (engine.py) hold the weights differently, HF's split
q/k/v and gate/up against vLLM's fused qkv_proj and gate_up_proj sharded over tp ranks, and
supply only the projections; everything else runs through the functions here, so that both do
the same float operations in the same order and their logits can be compared bit for bit."""

import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
os.environ.setdefault("REFIT_LIB", os.path.join(ROOT, os.environ.get("BUILD", "build"),
                                                "librefit.so"))

import refit.torch as rt  # noqa: E402

# Qwen3's constants that are not visible in the tensor shapes (its config.json).
ROPE_THETA = 1000000.0
EPS = 1e-6


class Config:
    """Sizes of model (a builtin of the C model module) shrunk by shrink, read off its HF
    layout: the example builds its modules from these, register_module checks them."""

    def __init__(self, model, shrink):
        shapes = {p.name: p.shape for p in rt.layout(model, "hf", "", 0, shrink)}
        self.model, self.shrink = model, shrink
        self.vocab, self.hidden = shapes["model.embed_tokens.weight"]
        self.layers = sum(1 for n in shapes if n.endswith(".input_layernorm.weight"))
        self.head_dim = shapes["model.layers.0.self_attn.q_norm.weight"][0]
        self.heads = shapes["model.layers.0.self_attn.q_proj.weight"][0] // self.head_dim
        self.kv_heads = shapes["model.layers.0.self_attn.k_proj.weight"][0] // self.head_dim
        self.intermediate = shapes["model.layers.0.mlp.gate_proj.weight"][0]
        self.tied = "lm_head.weight" not in shapes

    def __str__(self):
        return (f"{self.model} shrunk {self.shrink}x: {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads ({self.kv_heads} kv) of {self.head_dim}, mlp "
                f"{self.intermediate}, vocab {self.vocab}, lm_head "
                f"{'tied to embed_tokens' if self.tied else 'own'}")


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def rope(x):
    """Rotary embedding (HF's rotate_half form) of x [T, heads, head_dim] at positions 0..T-1."""
    t, _, d = x.shape
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(cfg, q, k, v, q_norm, k_norm):
    """Causal GQA attention of one sequence: q [T, heads*head_dim], k and v [T, kv*head_dim]
    (projections, before Qwen3's per-head q/k norms); returns [T, heads*head_dim]."""
    t = q.shape[0]
    q = rope(rms_norm(q.view(t, cfg.heads, cfg.head_dim), q_norm))
    k = rope(rms_norm(k.view(t, cfg.kv_heads, cfg.head_dim), k_norm))
    v = v.view(t, cfg.kv_heads, cfg.head_dim)
    rep = cfg.heads // cfg.kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / (cfg.head_dim ** 0.5)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(t, cfg.heads * cfg.head_dim)


def forward(cfg, w, tokens):
    """fp32 logits [T, vocab] of tokens [T]. w supplies the weights: embed(tokens), norm(name,
    x) for the per-layer norms by HF name, qkv(i, x) -> (q, k, v), o(i, a), gate_up(i, x) ->
    (gate, up), down(i, a), lm_head(x)."""
    x = w.embed(tokens)
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        h = w.norm(pre + "input_layernorm.weight", x)
        q, k, v = w.qkv(i, h)
        a = attention(cfg, q, k, v, w.weight(pre + "self_attn.q_norm.weight"),
                      w.weight(pre + "self_attn.k_norm.weight"))
        x = x + w.o(i, a)
        h = w.norm(pre + "post_attention_layernorm.weight", x)
        gate, up = w.gate_up(i, h)
        x = x + w.down(i, F.silu(gate) * up)
    return w.lm_head(w.norm("model.norm.weight", x))


def sequence(cfg, start, n):
    """Tokens start..start+n-1 of a cycle of five (7, 14, 21, 28, 35, 7, ...): what the
    trainer trains on."""
    return (torch.arange(start, start + n) % 5 + 1) * 7 % cfg.vocab


def prompt(cfg):
    """The fixed prompt both processes compute logits of."""
    return sequence(cfg, 0, 12)
