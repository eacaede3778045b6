"""Tests of refit.torch's layouts (librefit's refit_layout_*, from common/model) without daemons:
for every built-in model (shrunk) and a few layouts of each convention, the pieces of all ranks
cover every HF tensor exactly once per replica, every piece lies inside its parameter and the
pieces of one parameter never overlap; a few parameters are checked against the Megatron and
vLLM layouts computed here by hand. Skips without torch (scripts/deps.sh installs
python3-torch) or librefit."""

import os
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
os.environ.setdefault("REFIT_LIB", os.path.join(BUILD, "librefit.so"))

try:
    import torch
    import refit.torch as rt
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

HAVE_LIB = os.path.exists(os.environ["REFIT_LIB"])

# model, shrink, convention, layout, world, replicas (how often every byte of every tensor is
# held; 0: as often as each tensor's own replication says)
CASES = [
    ("qwen3-0.6b", 8, "hf", "", 1, 1),
    ("qwen3-0.6b", 8, "megatron", "tp=2,pp=2", 4, 0),
    ("qwen3-0.6b", 8, "vllm", "tp=16", 16, 0),
    ("qwen3-4b", 16, "megatron", "tp=4,dp=2", 8, 0),
    ("qwen3-4b", 16, "vllm", "tp=2", 2, 0),
    ("qwen3-30b-a3b", 32, "megatron", "tp=2,ep=4,pp=2", 8, 0),
    ("qwen3-30b-a3b", 32, "megatron", "ep=2,etp=2,tp=2", 4, 0),
    ("qwen3-30b-a3b", 32, "vllm", "tp=2,ep=2", 2, 0),
    ("qwen3-30b-a3b", 32, "vllm", "tp=2,dp=2,ep=4", 4, 0),
    ("deepseek-v3", 64, "megatron", "tp=2,pp=4,ep=4", 16, 0),
    ("deepseek-v3", 64, "vllm", "tp=4,ep=2", 4, 0),
    ("deepseek-v3", 64, "hf", "", 1, 1),
    # SGLang, plain TP and --enable-dp-attention (attn=dp: tp ranks in all, attention per DP
    # group, the embedding whole on every rank)
    ("qwen3-0.6b", 8, "sglang", "tp=4", 4, 0),
    ("qwen3-0.6b", 8, "sglang", "tp=4,dp=4,attn=dp", 4, 0),
    ("qwen3-30b-a3b", 32, "sglang", "tp=8,dp=2,ep=4,attn=dp", 8, 0),
    ("deepseek-v3", 64, "sglang", "tp=8,dp=8,ep=8,attn=dp", 8, 0),
]


@unittest.skipUnless(HAVE_TORCH and HAVE_LIB, "needs torch (python3-torch) and librefit")
class TestLayouts(unittest.TestCase):
    def test_cover_every_tensor(self):
        for model, shrink, conv, lay, world, replicas in CASES:
            with self.subTest(model=model, conv=conv, layout=lay):
                self._cover(model, shrink, conv, lay, world, replicas)

    def _cover(self, model, shrink, conv, lay, world, replicas):
        hits, shapes = {}, {}
        for r in range(world):
            params = rt.layout(model, conv, lay, r, shrink)
            self.assertEqual(len({p.name for p in params}), len(params),
                             f"rank {r}: two parameters share a name")
            for p in params:
                numel = 1
                for s in p.shape:
                    numel *= s
                spans = []
                for hf, gshape, start, extent, strides, off in p.pieces:
                    last = off + sum((e - 1) * s for e, s in zip(extent, strides))
                    self.assertLess(last, numel, f"{p.name}: piece of {hf} past its end")
                    spans.append((off, last))
                    shapes[hf] = gshape
                    h = hits.setdefault(hf, torch.zeros(gshape, dtype=torch.int16))
                    h[tuple(slice(s, s + e) for s, e in zip(start, extent))] += 1
                # Pieces of one parameter are row blocks: their byte spans never overlap.
                spans.sort()
                for a, b in zip(spans, spans[1:]):
                    self.assertLess(a[1], b[0], f"{p.name}: pieces overlap")
        names = set(shapes)
        hf = {p.name for p in rt.layout(model, "hf", "", 0, shrink)}
        self.assertEqual(names, hf, "tensors held differ from the model's")
        # Replicas (norms over TP, KV heads below TP, dense weights over the DP of expert
        # parallelism) hold a tensor's every element equally often; a gap or a double shard
        # would not.
        for name, h in hits.items():
            lo, hi = int(h.min()), int(h.max())
            self.assertTrue(lo >= 1 and lo == hi, f"{name}: held {lo}..{hi} times")
            if replicas:
                self.assertEqual(lo, replicas, f"{name}: held {lo} times, not {replicas}")

    def test_megatron_qkv_by_hand(self):
        # qwen3-0.6b: 16 heads, 8 KV heads, head_dim 128 (shrink 8: 16), hidden 128. TP=2:
        # rank 1 holds query groups 4..7, each [2 q heads, k, v] rows, interleaved.
        params = {p.name: p for p in rt.layout("qwen3-0.6b", "megatron", "tp=2", 1, 8)}
        p = params["decoder.layers.5.self_attention.linear_qkv.weight"]
        hd, H = 16, 128
        self.assertEqual(p.shape, (4 * 4 * hd, H))
        want = []
        for g in range(4):
            G, base = 4 + g, g * 4 * hd * H
            want += [("model.layers.5.self_attn.q_proj.weight", (G * 2 * hd, 0), base),
                     ("model.layers.5.self_attn.k_proj.weight", (G * hd, 0), base + 2 * hd * H),
                     ("model.layers.5.self_attn.v_proj.weight", (G * hd, 0), base + 3 * hd * H)]
        self.assertEqual([(x[0], x[2], x[5]) for x in p.pieces], want)
        self.assertIn("embedding.word_embeddings.weight", params)
        self.assertNotIn("output_layer.weight", params)  # tied, one stage

    def test_vllm_kv_replicated_below_tp(self):
        # 8 KV heads over tp=16: ranks 2k and 2k+1 both hold KV head k.
        for r in (6, 7):
            p = {q.name: q for q in rt.layout("qwen3-0.6b", "vllm", "tp=16", r, 8)}[
                "model.layers.0.self_attn.qkv_proj.weight"]
            k = [x for x in p.pieces if x[0].endswith("k_proj.weight")][0]
            self.assertEqual((k[2], k[3]), ((3 * 16, 0), (16, 128)))

    def test_megatron_moe_names(self):
        # qwen3-30b-a3b: 128 experts; ep=4 rank 1 (dp rank 1 of the mesh) holds experts 32..63
        # as local_experts 0..31; pp=2 rank of stage 1 numbers its layers from 0.
        params = rt.layout("qwen3-30b-a3b", "megatron", "ep=4,pp=2", 5, 32)
        names = {p.name: p for p in params}
        p = names["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
        self.assertEqual(p.pieces[0][0], "model.layers.24.mlp.experts.32.gate_proj.weight")
        self.assertIn("decoder.layers.23.mlp.experts.local_experts.31.linear_fc2.weight", names)
        self.assertIn("output_layer.weight", names)
        self.assertIn("decoder.final_layernorm.weight", names)


@unittest.skipUnless(HAVE_TORCH and HAVE_LIB, "needs torch (python3-torch) and librefit")
class TestSglang(unittest.TestCase):
    def test_dp_attention_names_and_shapes(self):
        # qwen3-30b-a3b shrunk 32: hidden 64, 32 heads x head_dim 16, 4 KV heads, 128 experts of
        # moe_inter 32, vocab 4748. tp=8,dp=2,ep=4,attn=dp: attention-TP 4, experts in 4 groups
        # of 2 ranks. Rank 5: attention rank 1 of DP group 1 (q heads 8..15, KV head 1), expert
        # group 2 (64..95), intermediate half 1.
        names = {p.name: p for p in rt.layout("qwen3-30b-a3b", "sglang",
                                              "tp=8,dp=2,ep=4,attn=dp", 5, 32)}
        qkv = names["model.layers.3.self_attn.qkv_proj.weight"]
        self.assertEqual(qkv.shape, (8 * 16 + 2 * 16, 64))
        self.assertEqual([(x[0], x[2]) for x in qkv.pieces],
                         [("model.layers.3.self_attn.q_proj.weight", (128, 0)),
                          ("model.layers.3.self_attn.k_proj.weight", (16, 0)),
                          ("model.layers.3.self_attn.v_proj.weight", (16, 0))])
        self.assertEqual(names["model.embed_tokens.weight"].shape, (4748, 64))
        w13 = names["model.layers.3.mlp.experts.w13_weight"]
        self.assertEqual(w13.shape, (32, 2 * 16, 64))
        self.assertEqual(w13.pieces[0][0], "model.layers.3.mlp.experts.64.gate_proj.weight")
        self.assertEqual(w13.pieces[0][2], (16, 0))
        self.assertEqual(names["model.layers.3.mlp.experts.w2_weight"].shape, (32, 64, 16))
        self.assertIn("model.layers.3.mlp.gate.weight", names)
        self.assertIn("lm_head.weight", names)

    def test_deepseek_fused_qkv_a_proj_with_mqa(self):
        # SGLang's DeepseekV2AttentionMLA names the replicated [q_a_proj; kv_a_proj_with_mqa]
        # fused_qkv_a_proj_with_mqa (vLLM: fused_qkv_a_proj).
        names = {p.name for p in rt.layout("deepseek-v3", "sglang", "tp=8,dp=8,attn=dp", 3, 64)}
        self.assertIn("model.layers.3.self_attn.fused_qkv_a_proj_with_mqa.weight", names)
        self.assertNotIn("model.layers.3.self_attn.fused_qkv_a_proj.weight", names)
        self.assertIn("model.layers.3.mlp.shared_experts.gate_up_proj.weight", names)
        self.assertIn("model.layers.3.mlp.gate.e_score_correction_bias", names)
        self.assertIn("model.layers.0.mlp.gate_up_proj.weight", names)

    def test_refusals(self):
        with self.assertRaises(rt.Error) as cm:
            rt.layout("qwen3-0.6b", "sglang", "tp=4,dp=3,attn=dp", 0, 8)
        self.assertIn("attn=dp needs dp=3 to divide tp=4", str(cm.exception))
        with self.assertRaises(rt.Error) as cm:
            rt.layout("qwen3-0.6b", "megatron", "tp=2,attn=dp", 0, 8)
        self.assertIn("attn is an engine key", str(cm.exception))
        with self.assertRaises(rt.Error) as cm:
            rt.layout("qwen3-0.6b", "sgl", "tp=2", 0, 8)
        self.assertIn("vllm or sglang", str(cm.exception))
