"""examples/hf_qwen3.py - the GPU mode of the example (trainer.py / engine.py --device cuda:N):
the model is HF transformers' Qwen3ForCausalLM, built from a Qwen3Config of the same sizes as
qwen3.Config (nothing downloaded), run with attn_implementation="eager", dropout 0 and torch's
deterministic algorithms in both processes.

Both processes run this same HF forward pass in bf16 on one GPU, the trainer on the bf16 copy it
publishes, the engine on its vLLM-style fused buffers: the engine's HF module has its
parameters replaced by views into qkv_proj (q, k, v rows) and gate_up_proj (gate, up rows),
which are contiguous row slices, so the same kernels see the same shapes and bytes and the
logits are equal bit for bit. With tp=2 a parameter spread over two ranks' buffers (q_proj's
rows, o_proj's columns, the vocabulary) cannot be one view: it is gathered into a tensor of
its own after each version (a copy, still exact).

transformers, FSDP2 and CUDA are needed only here: trainer.py and engine.py import this module
only with --device cuda:N, so the CPU example needs none of them."""

import os

# cuBLAS is deterministic only with a fixed workspace (read when its first handle is made).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import qwen3  # noqa: E402
import refit.torch as rt  # noqa: E402

# The timeout of the GPU mode's waits: importing transformers, CUDA, NCCL and FSDP2 take
# longer than the CPU example's 60 s allow on a cold machine.
TIMEOUT_MS = 300000


def setup_cuda(device, who):
    """The torch.device of device (cuda:N), current, with the settings both processes share:
    deterministic algorithms, no TF32."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise SystemExit(f"{who}: --device {device}: the GPU mode takes cuda:N (leave --device "
                         "out for the CPU example)")
    if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"{who}: --device {device}: torch {torch.__version__} sees "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA "
                         "device(s)")
    torch.cuda.set_device(dev)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return dev


def transformers_module(who):
    try:
        import transformers
        transformers.Qwen3Config, transformers.Qwen3ForCausalLM  # lazy: imports them
    except Exception as e:  # ImportError, AttributeError, transformers' RuntimeError
        raise SystemExit(f"{who}: the GPU mode needs HF transformers with Qwen3 (>= 4.51): "
                         f"{type(e).__name__}: {e}; install it, or run the CPU example (no "
                         "--device)")
    return transformers


def fsdp2_api(who):
    """(torch.distributed, init_device_mesh, fully_shard, DTensor) of the installed torch."""
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:
            from torch.distributed._tensor import DTensor
    except ImportError as e:
        raise SystemExit(f"{who}: the GPU trainer needs FSDP2 (torch.distributed.fsdp."
                         f"fully_shard, torch >= 2.4) and DTensor; torch {torch.__version__}: {e}")
    if not dist.is_available() or not dist.is_nccl_available():
        raise SystemExit(f"{who}: torch {torch.__version__} was built without torch.distributed "
                         "or NCCL; the GPU trainer's FSDP2 needs both")
    return dist, init_device_mesh, fully_shard, DTensor


def hf_config(cfg, who):
    """transformers.Qwen3Config of qwen3.Config cfg: its sizes, Qwen3's rope theta and eps,
    eager attention, no dropout, no sliding window, no KV cache."""
    tf = transformers_module(who)
    kw = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
              num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
              num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
              max_position_embeddings=256, rms_norm_eps=qwen3.EPS,
              tie_word_embeddings=bool(cfg.tied), attention_bias=False, attention_dropout=0.0,
              use_sliding_window=False, use_cache=False, attn_implementation="eager")
    if "rope_parameters" in getattr(tf.Qwen3Config, "__dataclass_fields__", {}):
        # transformers 5: RoPE settings live in rope_parameters.
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": qwen3.ROPE_THETA}
    else:
        kw["rope_theta"] = qwen3.ROPE_THETA
    hc = tf.Qwen3Config(**kw)
    hc._attn_implementation = "eager"
    rp = getattr(hc, "rope_parameters", None)
    theta = rp.get("rope_theta") if isinstance(rp, dict) else getattr(hc, "rope_theta", None)
    if theta is not None and float(theta) != qwen3.ROPE_THETA:
        raise SystemExit(f"{who}: transformers {tf.__version__}'s Qwen3Config took rope theta "
                         f"{theta}, not {qwen3.ROPE_THETA}")
    return hc


def describe(model):
    import transformers
    return (f"transformers {transformers.__version__} {type(model).__name__} (attention "
            f"{model.config._attn_implementation})")


def build(cfg, device, dtype, who):
    """A Qwen3ForCausalLM of cfg on device with parameters of dtype. Built on the CPU first and
    then moved, so that its rotary inv_freq buffer (fp32, computed on the CPU) is the same in
    every process; HF's own init is seeded (the example overwrites it). Its parameter names
    must be those of the model's HF layout in librefit."""
    tf = transformers_module(who)
    hc = hf_config(cfg, who)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(hc)
    if cfg.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    want = {p.name for p in rt.layout(cfg.model, "hf", "", 0, cfg.shrink)}
    have = {n for n, _ in model.named_parameters()}
    if have != want:
        raise SystemExit(f"{who}: transformers {tf.__version__}'s Qwen3ForCausalLM has parameters "
                         f"{sorted(have - want)[:4]} that the hf layout of {cfg.model} lacks and "
                         f"lacks {sorted(want - have)[:4]}")
    if getattr(model.config, "_attn_implementation", None) != "eager":
        raise SystemExit(f"{who}: the model runs attention "
                         f"'{model.config._attn_implementation}', not eager")
    return model


def bind(model, name, tensor):
    """Makes tensor (a view, not a copy) the parameter name of model."""
    path, leaf = name.rsplit(".", 1)
    p = torch.nn.Parameter(tensor, requires_grad=False)
    if p.data_ptr() != tensor.data_ptr():
        raise SystemExit(f"parameter {name}: torch.nn.Parameter copied the tensor it was given")
    setattr(model.get_submodule(path), leaf, p)


def bind_all(model, cfg, tensors):
    """Binds tensors {HF name: tensor} (every parameter of model) and ties lm_head."""
    for name, t in tensors.items():
        bind(model, name, t)
    if cfg.tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def logits(model, tokens, device):
    """fp32 logits [T, vocab] on the CPU of tokens [T] (a CPU tensor), no KV cache."""
    with torch.no_grad():
        out = model(input_ids=tokens[None].to(device), use_cache=False).logits[0]
    return out.float().cpu()


class EngineModel:
    """The engine's HF Qwen3ForCausalLM whose parameters are the tp ranks' fused buffers
    (engine.py's VllmRank modules): views where one rank's buffer holds a whole HF tensor as
    contiguous rows (every one with tp=1), tensors gathered by refresh() from the ranks' slices
    otherwise."""

    def __init__(self, cfg, ranks, device, who="engine"):
        if not cfg.tied:
            raise SystemExit(f"{who}: {cfg.model} has its own lm_head; engine.py's vLLM ranks "
                             "hold only a tied one")
        self.device = device
        self.model = build(cfg, device, torch.bfloat16, who).eval()
        ps = [dict(m.named_parameters()) for m in ranks]
        self.gathers = []  # (full tensor, dim, [sources]) copied by refresh()
        tensors = {}
        for name in [n for n, _ in self.model.named_parameters()]:
            dim, srcs = self._sources(cfg, ranks, ps, name)
            if len(srcs) == 1:
                tensors[name] = srcs[0]
            else:
                shape = list(srcs[0].shape)
                shape[dim] = sum(s.shape[dim] for s in srcs)
                full = torch.empty(shape, dtype=srcs[0].dtype, device=device)
                self.gathers.append((full, dim, srcs))
                tensors[name] = full
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise SystemExit(f"{who}: {name}: the view into the fused buffer is not "
                                 "contiguous")
        bind_all(self.model, cfg, tensors)
        self.views = len(tensors) - len(self.gathers)
        self.refresh()

    @staticmethod
    def _sources(cfg, ranks, ps, name):
        """(dim, slices of the ranks' buffers that, concatenated along dim, are HF's name)."""
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            out = []
            for n, (r, p) in enumerate(zip(ranks, ps)):
                rows = max(0, min(r.vocab_rows, cfg.vocab - n * r.vocab_rows))
                if rows:
                    out.append(p[name][:rows])
            return 0, out
        if len(parts) == 6 and parts[1] == "layers" and parts[4].endswith("_proj"):
            pre, kind = ".".join(parts[:4]), parts[4]
            r = ranks[0]
            q, kv, mlp = r.q_rows, r.kv_rows, r.mlp_rows
            fused = {"q_proj": ("self_attn.qkv_proj", 0, q), "k_proj": ("self_attn.qkv_proj", q,
                                                                          q + kv),
                     "v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
                     "gate_proj": ("mlp.gate_up_proj", 0, mlp),
                     "up_proj": ("mlp.gate_up_proj", mlp, 2 * mlp)}
            if kind in fused:
                buf, a, b = fused[kind]
                buf = f"{pre.rsplit('.', 1)[0]}.{buf}.weight"
                return 0, [p[buf][a:b] for p in ps]
            if kind in ("o_proj", "down_proj"):  # row-parallel: the ranks' input columns
                return 1, [p[name] for p in ps]
            raise SystemExit(f"engine: HF parameter {name}: no vLLM buffer holds it")
        if name in ps[0]:  # the norms: whole on every rank
            return 0, [ps[0][name]]
        raise SystemExit(f"engine: HF parameter {name}: no vLLM buffer holds it")

    def refresh(self):
        """Gathers the parameters that span ranks (none with tp=1) from the buffers refit
        wrote."""
        with torch.no_grad():
            for full, dim, srcs in self.gathers:
                torch.cat(srcs, dim, out=full)

    def logits(self, tokens):
        return logits(self.model, tokens, self.device)
