/* client/lib/refit_model.c - a rank's parameters as a framework names them (refit_layout_*):
 * the regions and pieces of common/model's layouts (rf_model_rank, the one source of truth for
 * the Megatron, vLLM and SGLang conventions), each region named as that framework's parameter,
 * so that bindings (client/python/refit/torch.py) map a module's named parameters onto HF
 * tensors. */
#include "refit.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "model.h"
#include "refit_int.h"

enum conv { CONV_HF, CONV_MEGATRON, CONV_VLLM, CONV_SGLANG };

typedef struct lay_piece {
    uint32_t tensor;
    uint64_t offset; /* elements from the parameter's start */
    rf_box box;
    int64_t strides[RF_MAX_DIMS];
} lay_piece;

typedef struct lay_param {
    char *name;
    int dtype;
    int ndim;
    int64_t shape[RF_MAX_DIMS];
    uint64_t bytes;
    uint32_t first, npieces; /* into refit_layout.pieces */
} lay_param;

struct refit_layout {
    rf_model *m;
    lay_param *params;
    uint32_t nparams, cap_params;
    lay_piece *pieces;
    uint32_t npieces, cap_pieces;
};

static int sink_region(void *ctx, uint32_t local, uint64_t size)
{
    refit_layout *l = ctx;

    if (local != l->nparams)
        return -EINVAL;
    if (l->nparams == l->cap_params) {
        uint32_t cap = l->cap_params ? 2 * l->cap_params : 64;
        lay_param *n = realloc(l->params, cap * sizeof(*n));

        if (!n)
            return -ENOMEM;
        l->params = n;
        l->cap_params = cap;
    }
    memset(&l->params[l->nparams], 0, sizeof(lay_param));
    l->params[l->nparams].bytes = size;
    l->params[l->nparams].first = l->npieces;
    l->nparams++;
    return 0;
}

static int add_piece(refit_layout *l, const rf_piece *p, size_t esize)
{
    lay_piece *q;

    if (l->npieces == l->cap_pieces) {
        uint32_t cap = l->cap_pieces ? 2 * l->cap_pieces : 256;
        lay_piece *n = realloc(l->pieces, cap * sizeof(*n));

        if (!n)
            return -ENOMEM;
        l->pieces = n;
        l->cap_pieces = cap;
    }
    q = &l->pieces[l->npieces++];
    q->tensor = p->tensor;
    q->offset = p->offset / esize;
    q->box = p->box;
    memcpy(q->strides, p->strides, sizeof(q->strides));
    return 0;
}

static int sink_piece(void *ctx, const rf_piece *p)
{
    refit_layout *l = ctx;
    const rf_tensor *t = rf_model_tensor(l->m, p->tensor);

    if (p->region + 1 != l->nparams)
        return -EINVAL; /* model.h: a region's pieces follow it */
    l->params[p->region].npieces++;
    return add_piece(l, p, rf_dtype_size(t->dtype));
}

/* "model.layers.12.mlp.up_proj.weight": layer 12 and the rest after it; -1 for names outside
 * the layers. */
static long split_layer(const char *name, const char **rest)
{
    static const char pre[] = "model.layers.";
    char *end;
    long l;

    if (strncmp(name, pre, sizeof(pre) - 1) != 0)
        return -1;
    l = strtol(name + sizeof(pre) - 1, &end, 10);
    if (*end != '.')
        return -1;
    *rest = end + 1;
    return l;
}

/* An HF suffix and what the convention calls the parameter that begins with it; fused: only
 * when the region holds more than one tensor (qkv, gate and up). */
typedef struct name_map {
    const char *hf;
    int fused; /* 1: only fused, 0: only alone, -1: either */
    const char *to;
} name_map;

static const name_map megatron_names[] = {
    {"input_layernorm.weight", -1, "input_layernorm.weight"},
    {"self_attn.q_proj.weight", 1, "self_attention.linear_qkv.weight"},
    {"self_attn.q_proj.weight", 0, "self_attention.linear_q_proj.weight"},
    {"self_attn.o_proj.weight", -1, "self_attention.linear_proj.weight"},
    {"self_attn.q_norm.weight", -1, "self_attention.q_layernorm.weight"},
    {"self_attn.k_norm.weight", -1, "self_attention.k_layernorm.weight"},
    {"self_attn.q_a_proj.weight", 0, "self_attention.linear_q_down_proj.weight"},
    {"self_attn.q_a_layernorm.weight", -1, "self_attention.q_layernorm.weight"},
    {"self_attn.q_b_proj.weight", -1, "self_attention.linear_q_up_proj.weight"},
    {"self_attn.kv_a_proj_with_mqa.weight", 0, "self_attention.linear_kv_down_proj.weight"},
    {"self_attn.kv_a_layernorm.weight", -1, "self_attention.kv_layernorm.weight"},
    {"self_attn.kv_b_proj.weight", -1, "self_attention.linear_kv_up_proj.weight"},
    {"post_attention_layernorm.weight", -1, "pre_mlp_layernorm.weight"},
    {"mlp.gate_proj.weight", 1, "mlp.linear_fc1.weight"},
    {"mlp.down_proj.weight", 0, "mlp.linear_fc2.weight"},
    {"mlp.gate.weight", -1, "mlp.router.weight"},
    {"mlp.gate.e_score_correction_bias", -1, "mlp.router.expert_bias"},
    {"mlp.shared_experts.gate_proj.weight", 1, "mlp.shared_experts.linear_fc1.weight"},
    {"mlp.shared_experts.down_proj.weight", 0, "mlp.shared_experts.linear_fc2.weight"},
};

static const name_map vllm_names[] = {
    {"self_attn.q_proj.weight", 1, "self_attn.qkv_proj.weight"},
    {"self_attn.q_a_proj.weight", 1, "self_attn.fused_qkv_a_proj.weight"},
    {"mlp.gate_proj.weight", 1, "mlp.gate_up_proj.weight"},
    {"mlp.shared_experts.gate_proj.weight", 1, "mlp.shared_experts.gate_up_proj.weight"},
};

/* SGLang's model classes (models/qwen3_moe.py, qwen2_moe.py, deepseek_v2.py) name parameters
 * as vLLM's do (qkv_proj, gate_up_proj, FusedMoE's w13_weight/w2_weight, MoEGate's weight and
 * e_score_correction_bias), except DeepSeek's fused [q_a_proj; kv_a_proj_with_mqa], which
 * DeepseekV2AttentionMLA calls fused_qkv_a_proj_with_mqa. */
static const name_map sglang_names[] = {
    {"self_attn.q_proj.weight", 1, "self_attn.qkv_proj.weight"},
    {"self_attn.q_a_proj.weight", 1, "self_attn.fused_qkv_a_proj_with_mqa.weight"},
    {"mlp.gate_proj.weight", 1, "mlp.gate_up_proj.weight"},
    {"mlp.shared_experts.gate_proj.weight", 1, "mlp.shared_experts.gate_up_proj.weight"},
};

static const char *conv_name(enum conv c)
{
    return c == CONV_MEGATRON ? "megatron" : c == CONV_SGLANG ? "sglang" : "vllm";
}

static const char *find_rename(const name_map *t, size_t n, const char *rest, bool fused)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(t[i].hf, rest) == 0 && (t[i].fused < 0 || t[i].fused == (int)fused))
            return t[i].to;
    return NULL;
}

/* What the naming of one rank's parameters carries from one region to the next. */
typedef struct namer {
    enum conv conv;
    long first_layer;  /* the rank's first layer: Megatron numbers a stage's layers from 0 */
    long expert_layer; /* the layer of expert0 */
    long expert0;      /* the first expert of this rank in that layer */
    bool after_norm;   /* the final norm was named: an embedding now is the output layer */
} namer;

/* The name of parameter i from the HF names of its pieces; its local shape too, where the
 * convention gives it more dims than its pieces' rows and columns (vLLM's fused experts). */
static int name_param(refit_layout *l, namer *nm, uint32_t i)
{
    lay_param *p = &l->params[i];
    const lay_piece *pc = &l->pieces[p->first];
    const char *hf, *rest = NULL, *to = NULL;
    char buf[RF_NAME_MAX], expert_rest[RF_NAME_MAX];
    bool fused = p->npieces > 1 && pc[0].tensor != pc[1].tensor;
    long layer, e = -1;
    int n = 0;

    if (p->npieces == 0) {
        /* A vocabulary share past the vocabulary's end holds no rows but is still a parameter. */
        hf = i == 0 ? "model.embed_tokens.weight" : "lm_head.weight";
    } else {
        hf = rf_model_tensor(l->m, pc[0].tensor)->name;
    }
    layer = split_layer(hf, &rest);
    if (layer >= 0 && nm->first_layer < 0)
        nm->first_layer = layer;
    if (layer >= 0 && sscanf(rest, "mlp.experts.%ld.%255s", &e, expert_rest) == 2) {
        if (nm->expert_layer != layer) {
            nm->expert_layer = layer;
            nm->expert0 = e;
        }
    }
    if (nm->conv == CONV_MEGATRON) {
        if (layer < 0) {
            if (strcmp(hf, "model.norm.weight") == 0) {
                to = "decoder.final_layernorm.weight";
                nm->after_norm = true;
            } else if (strcmp(hf, "model.embed_tokens.weight") == 0) {
                to = nm->after_norm ? "output_layer.weight" : "embedding.word_embeddings.weight";
            } else if (strcmp(hf, "lm_head.weight") == 0) {
                to = "output_layer.weight";
            }
            if (to)
                n = snprintf(buf, sizeof(buf), "%s", to);
        } else if (e >= 0) {
            const char *what = strcmp(expert_rest, "gate_proj.weight") == 0 ? "linear_fc1"
                               : strcmp(expert_rest, "down_proj.weight") == 0 ? "linear_fc2"
                                                                              : NULL;
            if (what)
                n = snprintf(buf, sizeof(buf),
                             "decoder.layers.%ld.mlp.experts.local_experts.%ld.%s.weight",
                             layer - nm->first_layer, e - nm->expert0, what);
            to = what;
        } else {
            to = find_rename(megatron_names, sizeof(megatron_names) / sizeof(megatron_names[0]),
                             rest, fused);
            if (to)
                n = snprintf(buf, sizeof(buf), "decoder.layers.%ld.%s", layer - nm->first_layer,
                             to);
        }
    } else if (layer >= 0 && e >= 0) {
        const char *what = strcmp(expert_rest, "gate_proj.weight") == 0 ? "w13_weight"
                           : strcmp(expert_rest, "down_proj.weight") == 0 ? "w2_weight"
                                                                          : NULL;
        /* w13 holds a gate and an up piece per expert, w2 one down piece. */
        int64_t experts = what && what[1] == '1' ? p->npieces / 2 : p->npieces;

        if (what) {
            n = snprintf(buf, sizeof(buf), "model.layers.%ld.mlp.experts.%s", layer, what);
            /* [experts, rows, cols]: one expert's columns are its first piece's row stride. */
            p->ndim = 3;
            p->shape[0] = experts;
            p->shape[2] = pc[0].strides[0];
            p->shape[1] = (int64_t)(p->bytes / rf_dtype_size((rf_dtype)p->dtype)) / experts /
                          p->shape[2];
        }
        to = what;
    } else {
        if (layer < 0)
            to = NULL;
        else if (nm->conv == CONV_SGLANG)
            to = find_rename(sglang_names, sizeof(sglang_names) / sizeof(sglang_names[0]), rest,
                             fused);
        else
            to = find_rename(vllm_names, sizeof(vllm_names) / sizeof(vllm_names[0]), rest, fused);
        n = to ? snprintf(buf, sizeof(buf), "model.layers.%ld.%s", layer, to)
               : snprintf(buf, sizeof(buf), "%s", hf);
        to = buf;
    }
    if (to == NULL || n <= 0 || (size_t)n >= sizeof(buf))
        return refit__fail(NULL, -EINVAL, "parameter %u of this rank begins with HF tensor %s, "
                           "which the %s convention has no name for; name it in "
                           "client/lib/refit_model.c", i, hf, conv_name(nm->conv));
    p->name = strdup(buf);
    return p->name ? 0 : -ENOMEM;
}

/* dtype and local shape of a parameter from its pieces: rows of the first piece's row stride
 * (2-D tensors), or a flat vector. */
static void shape_param(refit_layout *l, lay_param *p, const rf_model *m)
{
    const lay_piece *pc = &l->pieces[p->first];
    const rf_tensor *t;
    int64_t numel, ld;

    if (p->npieces == 0) {
        uint32_t id = 0;

        rf_model_find(m, "model.embed_tokens.weight", &id);
        t = rf_model_tensor(m, id);
        ld = t->shape[1];
    } else {
        t = rf_model_tensor(m, pc[0].tensor);
        ld = t->ndim == 2 ? pc[0].strides[0] : 0;
    }
    p->dtype = t->dtype;
    numel = (int64_t)(p->bytes / rf_dtype_size(t->dtype));
    if (ld > 0) {
        p->ndim = 2;
        p->shape[0] = numel / ld;
        p->shape[1] = ld;
    } else {
        p->ndim = 1;
        p->shape[0] = numel;
    }
}

static int layout_hf(refit_layout *l)
{
    for (uint32_t t = 0; t < rf_model_ntensors(l->m); t++) {
        const rf_tensor *ten = rf_model_tensor(l->m, t);
        lay_param *p;
        rf_piece pc = {.tensor = t, .region = t, .offset = 0};
        int64_t s = 1;
        int rc;

        rc = sink_region(l, t, 0);
        if (rc < 0)
            return rc;
        p = &l->params[t];
        p->name = strdup(ten->name);
        if (!p->name)
            return -ENOMEM;
        p->dtype = ten->dtype;
        p->ndim = ten->ndim;
        rf_box_full(&pc.box, ten->ndim, ten->shape);
        for (int d = ten->ndim - 1; d >= 0; d--) {
            pc.strides[d] = s;
            p->shape[d] = ten->shape[d];
            s *= ten->shape[d];
        }
        p->bytes = (uint64_t)s * rf_dtype_size(ten->dtype);
        p->npieces = 1;
        rc = add_piece(l, &pc, 1);
        if (rc < 0)
            return rc;
    }
    return 0;
}

int refit_layout_open(const char *model, int shrink, const char *convention,
                      const char *parallel, int rank, refit_layout **out)
{
    rf_rank_sink sink;
    refit_layout *l = NULL;
    rf_model *small = NULL;
    rf_err err = {0};
    rf_par par;
    namer nm = {.first_layer = -1, .expert_layer = -1};
    int rc;

    *out = NULL;
    if (!model || !convention)
        return refit__fail(NULL, -EINVAL, "refit_layout_open: model and convention are "
                           "required");
    if (strcmp(convention, "hf") == 0)
        nm.conv = CONV_HF;
    else if (strcmp(convention, "megatron") == 0)
        nm.conv = CONV_MEGATRON;
    else if (strcmp(convention, "vllm") == 0)
        nm.conv = CONV_VLLM;
    else if (strcmp(convention, "sglang") == 0)
        nm.conv = CONV_SGLANG;
    else
        return refit__fail(NULL, -EINVAL, "convention '%s' is not known: use hf (every HF "
                           "tensor whole), megatron (trainer ranks), vllm or sglang (engine "
                           "ranks; sglang with attn=dp for --enable-dp-attention)", convention);
    if (nm.conv == CONV_HF && ((parallel && *parallel) || rank != 0))
        return refit__fail(NULL, -EINVAL, "convention hf holds every tensor whole in one rank: "
                           "leave the layout empty and the rank 0, not '%s' and rank %d "
                           "(megatron, vllm or sglang shard tensors)", parallel ? parallel : "",
                           rank);
    l = calloc(1, sizeof(*l));
    if (!l)
        return refit__fail(NULL, -ENOMEM, "out of memory opening the layout of %s", model);
    rc = rf_model_load(model, &l->m, &err);
    if (rc == 0 && shrink > 1) {
        rc = rf_model_shrink(l->m, shrink, &small, &err);
        if (rc == 0) {
            rf_model_free(l->m);
            l->m = small;
        }
    }
    if (rc < 0) {
        rc = refit__fail(NULL, rc, "%s", err.msg);
        goto out;
    }
    if (nm.conv == CONV_HF) {
        rc = layout_hf(l);
        if (rc < 0)
            rc = refit__fail(NULL, rc, "out of memory listing the tensors of %s", model);
        goto out;
    }
    rf_side side = nm.conv == CONV_MEGATRON ? RF_SRC : RF_DST;
    rc = rf_par_parse(parallel ? parallel : "", side, l->m, &par, &err);
    if (rc == 0) {
        sink = (rf_rank_sink){.ctx = l, .region = sink_region, .piece = sink_piece};
        rc = rf_model_rank(l->m, &par, side, rank, &sink, &err);
    }
    if (rc < 0) {
        rc = refit__fail(NULL, rc, "%s", err.msg);
        goto out;
    }
    for (uint32_t i = 0; i < l->nparams && rc == 0; i++) {
        shape_param(l, &l->params[i], l->m);
        rc = name_param(l, &nm, i);
    }
out:
    if (rc < 0)
        refit_layout_free(l);
    else
        *out = l;
    return rc;
}

uint32_t refit_layout_nparams(const refit_layout *l)
{
    return l->nparams;
}

int refit_layout_param(const refit_layout *l, uint32_t i, const char **name, int *dtype,
                       int *ndim, int64_t *shape, uint32_t *npieces)
{
    const lay_param *p;

    if (i >= l->nparams)
        return refit__fail(NULL, -EINVAL, "parameter %u: the layout has %u", i, l->nparams);
    p = &l->params[i];
    *name = p->name;
    *dtype = p->dtype;
    *ndim = p->ndim;
    memcpy(shape, p->shape, sizeof(int64_t) * RF_MAX_DIMS);
    *npieces = p->npieces;
    return 0;
}

int refit_layout_piece(const refit_layout *l, uint32_t i, uint32_t j, const char **tensor,
                       int *ndim, int64_t *shape, int64_t *start, int64_t *extent,
                       int64_t *strides, uint64_t *offset)
{
    const lay_piece *pc;
    const rf_tensor *t;

    if (i >= l->nparams || j >= l->params[i].npieces)
        return refit__fail(NULL, -EINVAL, "piece %u of parameter %u does not exist", j, i);
    pc = &l->pieces[l->params[i].first + j];
    t = rf_model_tensor(l->m, pc->tensor);
    *tensor = t->name;
    *ndim = t->ndim;
    memcpy(shape, t->shape, sizeof(int64_t) * RF_MAX_DIMS);
    memcpy(start, pc->box.start, sizeof(int64_t) * RF_MAX_DIMS);
    memcpy(extent, pc->box.extent, sizeof(int64_t) * RF_MAX_DIMS);
    memcpy(strides, pc->strides, sizeof(int64_t) * RF_MAX_DIMS);
    *offset = pc->offset;
    return 0;
}

void refit_layout_free(refit_layout *l)
{
    if (!l)
        return;
    for (uint32_t i = 0; i < l->nparams; i++)
        free(l->params[i].name);
    free(l->params);
    free(l->pieces);
    rf_model_free(l->m);
    free(l);
}
