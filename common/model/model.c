/* common/model/model.c - synthetic models from architecture configs (builtins or HF-style JSON)
 * and the per-rank layouts of a Megatron-like trainer and a vLLM- or SGLang-like engine, emitted
 * as regions and pieces so that whole-cluster inventories can be built without real weights. */
#include "model.h"

#include <ctype.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef enum arch { ARCH_QWEN3, ARCH_QWEN3_MOE, ARCH_DSV3 } arch;

typedef struct cfg {
    char name[128];
    arch arch;
    rf_dtype dtype;
    int64_t hidden, layers, heads, kv_heads, head_dim, inter, moe_inter, experts, shared;
    int64_t first_dense, q_lora, kv_lora, qk_nope, qk_rope, v_head, vocab;
    bool tied;
} cfg;

/* Per-layer roles; a layer's tensor index per role, -1 when the layer has none. Experts are
 * indexed separately: expert e of layer l has gate, up, down at expert0[l] + 3e + 0/1/2. */
enum role {
    R_IN_NORM, R_POST_NORM, R_Q, R_K, R_V, R_O, R_QNORM, R_KNORM, R_QA, R_QA_NORM, R_QB, R_KVA,
    R_KVA_NORM, R_KVB, R_GATE, R_UP, R_DOWN, R_ROUTER, R_ROUTER_BIAS, R_SH_GATE, R_SH_UP,
    R_SH_DOWN, R__COUNT
};

struct rf_model {
    cfg c;
    rf_tensor *t;
    uint32_t nt, cap;
    int32_t *lidx;    /* layers * R__COUNT */
    int32_t *expert0; /* per layer; -1 for a dense layer */
    int32_t embed, norm, lm_head;
    uint64_t bytes;
};

static const cfg builtins[] = {
    {.name = "qwen3-0.6b", .arch = ARCH_QWEN3, .dtype = RF_DT_BF16, .hidden = 1024, .layers = 28,
     .heads = 16, .kv_heads = 8, .head_dim = 128, .inter = 3072, .vocab = 151936, .tied = true},
    {.name = "qwen3-4b", .arch = ARCH_QWEN3, .dtype = RF_DT_BF16, .hidden = 2560, .layers = 36,
     .heads = 32, .kv_heads = 8, .head_dim = 128, .inter = 9728, .vocab = 151936, .tied = true},
    {.name = "qwen3-30b-a3b", .arch = ARCH_QWEN3_MOE, .dtype = RF_DT_BF16, .hidden = 2048,
     .layers = 48, .heads = 32, .kv_heads = 4, .head_dim = 128, .inter = 6144, .moe_inter = 768,
     .experts = 128, .vocab = 151936, .tied = false},
    {.name = "deepseek-v3", .arch = ARCH_DSV3, .dtype = RF_DT_BF16, .hidden = 7168, .layers = 61,
     .heads = 128, .kv_heads = 128, .head_dim = 192, .inter = 18432, .moe_inter = 2048,
     .experts = 256, .shared = 1, .first_dense = 3, .q_lora = 1536, .kv_lora = 512,
     .qk_nope = 128, .qk_rope = 64, .v_head = 128, .vocab = 129280, .tied = false},
};
#define NBUILTINS (sizeof(builtins) / sizeof(builtins[0]))

static bool is_moe_layer(const cfg *c, int64_t l)
{
    return c->experts > 0 && l >= c->first_dense;
}

static bool has_dense_layer(const cfg *c)
{
    return c->experts == 0 || c->first_dense > 0;
}

/* ---- tensor list ------------------------------------------------------------------------- */

static int add_tensor(rf_model *m, rf_dtype dt, int ndim, int64_t d0, int64_t d1, const char *fmt,
                      ...) __attribute__((format(printf, 6, 7)));

static int add_tensor(rf_model *m, rf_dtype dt, int ndim, int64_t d0, int64_t d1, const char *fmt,
                      ...)
{
    char name[RF_NAME_MAX];
    rf_tensor *t;
    va_list ap;
    int64_t numel;

    if (m->nt == m->cap) {
        uint32_t ncap = m->cap ? m->cap * 2 : 256;
        rf_tensor *p = realloc(m->t, ncap * sizeof(*p));

        if (p == NULL)
            return -ENOMEM;
        m->t = p;
        m->cap = ncap;
    }
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    t = &m->t[m->nt];
    memset(t, 0, sizeof(*t));
    t->name = strdup(name);
    if (t->name == NULL)
        return -ENOMEM;
    t->dtype = dt;
    t->ndim = ndim;
    for (int d = 0; d < RF_MAX_DIMS; d++)
        t->shape[d] = 1;
    t->shape[0] = d0;
    if (ndim > 1)
        t->shape[1] = d1;
    numel = d0 * (ndim > 1 ? d1 : 1);
    m->bytes += (uint64_t)numel * rf_dtype_size(dt);
    return (int)m->nt++;
}

void rf_model_free(rf_model *m)
{
    if (m == NULL)
        return;
    for (uint32_t i = 0; i < m->nt; i++)
        free((char *)m->t[i].name);
    free(m->t);
    free(m->lidx);
    free(m->expert0);
    free(m);
}

/* Builds the tensor list of config c, in HF checkpoint order within each layer. */
static int model_from_cfg(const cfg *c, rf_model **out, rf_err *err)
{
    rf_model *m = calloc(1, sizeof(*m));
    const char *pre = "model.layers";
    rf_dtype dt = c->dtype;
    int64_t H = c->hidden;
    int rc = -ENOMEM;

    if (m == NULL)
        goto out;
    m->c = *c;
    m->lidx = malloc((size_t)c->layers * R__COUNT * sizeof(*m->lidx));
    m->expert0 = malloc((size_t)c->layers * sizeof(*m->expert0));
    if (m->lidx == NULL || m->expert0 == NULL)
        goto out;
    for (int64_t i = 0; i < c->layers * R__COUNT; i++)
        m->lidx[i] = -1;
    m->lm_head = -1;
#define ADD(slot, nd, a, b, ...)                                                                \
    do {                                                                                        \
        int id_ = add_tensor(m, dt, nd, a, b, __VA_ARGS__);                                     \
        if (id_ < 0)                                                                            \
            goto out;                                                                           \
        slot = id_;                                                                             \
    } while (0)
    ADD(m->embed, 2, c->vocab, H, "model.embed_tokens.weight");
    for (int64_t l = 0; l < c->layers; l++) {
        int32_t *li = &m->lidx[l * R__COUNT];

        m->expert0[l] = -1;
        ADD(li[R_IN_NORM], 1, H, 0, "%s.%" PRId64 ".input_layernorm.weight", pre, l);
        if (c->arch == ARCH_DSV3) {
            int64_t qk = c->qk_nope + c->qk_rope;

            if (c->q_lora > 0) {
                ADD(li[R_QA], 2, c->q_lora, H, "%s.%" PRId64 ".self_attn.q_a_proj.weight", pre, l);
                ADD(li[R_QA_NORM], 1, c->q_lora, 0, "%s.%" PRId64
                    ".self_attn.q_a_layernorm.weight", pre, l);
                ADD(li[R_QB], 2, c->heads * qk, c->q_lora, "%s.%" PRId64
                    ".self_attn.q_b_proj.weight", pre, l);
            } else {
                ADD(li[R_Q], 2, c->heads * qk, H, "%s.%" PRId64 ".self_attn.q_proj.weight", pre,
                    l);
            }
            ADD(li[R_KVA], 2, c->kv_lora + c->qk_rope, H, "%s.%" PRId64
                ".self_attn.kv_a_proj_with_mqa.weight", pre, l);
            ADD(li[R_KVA_NORM], 1, c->kv_lora, 0, "%s.%" PRId64
                ".self_attn.kv_a_layernorm.weight", pre, l);
            ADD(li[R_KVB], 2, c->heads * (c->qk_nope + c->v_head), c->kv_lora, "%s.%" PRId64
                ".self_attn.kv_b_proj.weight", pre, l);
            ADD(li[R_O], 2, H, c->heads * c->v_head, "%s.%" PRId64 ".self_attn.o_proj.weight",
                pre, l);
        } else {
            ADD(li[R_Q], 2, c->heads * c->head_dim, H, "%s.%" PRId64 ".self_attn.q_proj.weight",
                pre, l);
            ADD(li[R_K], 2, c->kv_heads * c->head_dim, H, "%s.%" PRId64
                ".self_attn.k_proj.weight", pre, l);
            ADD(li[R_V], 2, c->kv_heads * c->head_dim, H, "%s.%" PRId64
                ".self_attn.v_proj.weight", pre, l);
            ADD(li[R_O], 2, H, c->heads * c->head_dim, "%s.%" PRId64 ".self_attn.o_proj.weight",
                pre, l);
            ADD(li[R_QNORM], 1, c->head_dim, 0, "%s.%" PRId64 ".self_attn.q_norm.weight", pre, l);
            ADD(li[R_KNORM], 1, c->head_dim, 0, "%s.%" PRId64 ".self_attn.k_norm.weight", pre, l);
        }
        ADD(li[R_POST_NORM], 1, H, 0, "%s.%" PRId64 ".post_attention_layernorm.weight", pre, l);
        if (!is_moe_layer(c, l)) {
            ADD(li[R_GATE], 2, c->inter, H, "%s.%" PRId64 ".mlp.gate_proj.weight", pre, l);
            ADD(li[R_UP], 2, c->inter, H, "%s.%" PRId64 ".mlp.up_proj.weight", pre, l);
            ADD(li[R_DOWN], 2, H, c->inter, "%s.%" PRId64 ".mlp.down_proj.weight", pre, l);
            continue;
        }
        ADD(li[R_ROUTER], 2, c->experts, H, "%s.%" PRId64 ".mlp.gate.weight", pre, l);
        if (c->arch == ARCH_DSV3) {
            int id = add_tensor(m, RF_DT_FP32, 1, c->experts, 0,
                                "%s.%" PRId64 ".mlp.gate.e_score_correction_bias", pre, l);
            if (id < 0)
                goto out;
            li[R_ROUTER_BIAS] = id;
        }
        m->expert0[l] = (int32_t)m->nt;
        for (int64_t e = 0; e < c->experts; e++) {
            int dummy;

            ADD(dummy, 2, c->moe_inter, H, "%s.%" PRId64 ".mlp.experts.%" PRId64
                ".gate_proj.weight", pre, l, e);
            ADD(dummy, 2, c->moe_inter, H, "%s.%" PRId64 ".mlp.experts.%" PRId64
                ".up_proj.weight", pre, l, e);
            ADD(dummy, 2, H, c->moe_inter, "%s.%" PRId64 ".mlp.experts.%" PRId64
                ".down_proj.weight", pre, l, e);
            (void)dummy;
        }
        if (c->shared > 0) {
            int64_t is = c->moe_inter * c->shared;

            ADD(li[R_SH_GATE], 2, is, H, "%s.%" PRId64 ".mlp.shared_experts.gate_proj.weight",
                pre, l);
            ADD(li[R_SH_UP], 2, is, H, "%s.%" PRId64 ".mlp.shared_experts.up_proj.weight", pre,
                l);
            ADD(li[R_SH_DOWN], 2, H, is, "%s.%" PRId64 ".mlp.shared_experts.down_proj.weight",
                pre, l);
        }
    }
    ADD(m->norm, 1, H, 0, "model.norm.weight");
    if (!c->tied)
        ADD(m->lm_head, 2, c->vocab, H, "lm_head.weight");
#undef ADD
    *out = m;
    m = NULL;
    rc = 0;
out:
    if (rc < 0)
        rf_err_set(err, rc, "out of memory building the tensor list of model %s", c->name);
    rf_model_free(m);
    return rc;
}

/* ---- loading ----------------------------------------------------------------------------- */

/* Reads integer key k of a JSON config into *v. A missing key takes def when def >= 0 and is an
 * error otherwise; null reads as 0 where allow_null. Values must lie in [lo, 2^24]. */
static int json_int(json_t *o, const char *k, int64_t def, bool allow_null, int64_t lo,
                    const char *path, int64_t *v, rf_err *err)
{
    json_t *j = json_object_get(o, k);

    if (j == NULL) {
        if (def < 0)
            return rf_err_set(err, -EINVAL, "model spec %s: key '%s' is missing", path, k);
        *v = def;
        return 0;
    }
    if (json_is_null(j) && allow_null) {
        *v = 0;
        return 0;
    }
    if (!json_is_integer(j) || json_integer_value(j) < lo || json_integer_value(j) > (1 << 24))
        return rf_err_set(err, -EINVAL, "model spec %s: key '%s' must be an integer from %" PRId64
                          " to %d", path, k, lo, 1 << 24);
    *v = json_integer_value(j);
    return 0;
}

static int load_json(const char *path, cfg *c, rf_err *err)
{
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr), *j;
    const char *type, *base;
    int rc = -EINVAL;

    memset(c, 0, sizeof(*c));
    if (root == NULL) {
        rc = rf_err_set(err, -EINVAL, "model spec %s: line %d: %s", path, jerr.line, jerr.text);
        goto out;
    }
    if (!json_is_object(root)) {
        rc = rf_err_set(err, -EINVAL, "model spec %s: the top level must be a JSON object", path);
        goto out;
    }
    j = json_object_get(root, "model_type");
    type = json_string_value(j);
    if (type == NULL) {
        rc = rf_err_set(err, -EINVAL, "model spec %s: key 'model_type' is missing or not a string "
                        "(one of qwen3, qwen3_moe, deepseek_v3)", path);
        goto out;
    }
    if (strcmp(type, "qwen3") == 0)
        c->arch = ARCH_QWEN3;
    else if (strcmp(type, "qwen3_moe") == 0)
        c->arch = ARCH_QWEN3_MOE;
    else if (strcmp(type, "deepseek_v3") == 0)
        c->arch = ARCH_DSV3;
    else {
        rc = rf_err_set(err, -EINVAL, "model spec %s: model_type '%s' is not supported (one of "
                        "qwen3, qwen3_moe, deepseek_v3)", path, type);
        goto out;
    }
    j = json_object_get(root, "name");
    if (j != NULL && (!json_is_string(j) || json_string_length(j) == 0 ||
                      json_string_length(j) >= sizeof(c->name))) {
        rc = rf_err_set(err, -EINVAL, "model spec %s: key 'name' must be a string of 1 to %zu "
                        "characters", path, sizeof(c->name) - 1);
        goto out;
    }
    if (j != NULL) {
        snprintf(c->name, sizeof(c->name), "%s", json_string_value(j));
    } else {
        base = strrchr(path, '/');
        snprintf(c->name, sizeof(c->name), "%s", base ? base + 1 : path);
        if (strlen(c->name) > 5 && strcmp(c->name + strlen(c->name) - 5, ".json") == 0)
            c->name[strlen(c->name) - 5] = '\0';
    }
    c->dtype = RF_DT_BF16;
    j = json_object_get(root, "torch_dtype");
    if (j == NULL)
        j = json_object_get(root, "dtype");
    if (j != NULL && (!json_is_string(j) || rf_dtype_parse(json_string_value(j), &c->dtype) < 0)) {
        rc = rf_err_set(err, -EINVAL, "model spec %s: key 'torch_dtype' must name a dtype such as "
                        "\"bfloat16\"", path);
        goto out;
    }
    j = json_object_get(root, "tie_word_embeddings");
    if (j != NULL && !json_is_boolean(j)) {
        rc = rf_err_set(err, -EINVAL, "model spec %s: key 'tie_word_embeddings' must be true or "
                        "false", path);
        goto out;
    }
    c->tied = j != NULL && json_is_true(j);

#define INT(key, def, nul, lo, dst)                                                             \
    do {                                                                                        \
        rc = json_int(root, key, def, nul, lo, path, dst, err);                                 \
        if (rc < 0)                                                                             \
            goto out;                                                                           \
    } while (0)
    INT("hidden_size", -1, false, 1, &c->hidden);
    INT("num_hidden_layers", -1, false, 1, &c->layers);
    INT("num_attention_heads", -1, false, 1, &c->heads);
    INT("vocab_size", -1, false, 1, &c->vocab);
    if (c->arch == ARCH_DSV3) {
        INT("intermediate_size", -1, false, 1, &c->inter);
        INT("moe_intermediate_size", -1, false, 1, &c->moe_inter);
        INT("n_routed_experts", -1, false, 1, &c->experts);
        INT("n_shared_experts", 0, true, 0, &c->shared);
        INT("first_k_dense_replace", 0, false, 0, &c->first_dense);
        INT("q_lora_rank", 0, true, 0, &c->q_lora);
        INT("kv_lora_rank", -1, false, 1, &c->kv_lora);
        INT("qk_nope_head_dim", -1, false, 1, &c->qk_nope);
        INT("qk_rope_head_dim", -1, false, 1, &c->qk_rope);
        INT("v_head_dim", -1, false, 1, &c->v_head);
        c->kv_heads = c->heads;
        c->head_dim = c->qk_nope + c->qk_rope;
        if (c->first_dense > c->layers) {
            rc = rf_err_set(err, -EINVAL, "model spec %s: first_k_dense_replace=%" PRId64
                            " exceeds num_hidden_layers=%" PRId64, path, c->first_dense,
                            c->layers);
            goto out;
        }
    } else {
        INT("num_key_value_heads", c->heads, false, 1, &c->kv_heads);
        INT("head_dim", c->hidden / c->heads > 0 ? c->hidden / c->heads : 1, false, 1,
            &c->head_dim);
        if (c->arch == ARCH_QWEN3) {
            INT("intermediate_size", -1, false, 1, &c->inter);
        } else {
            INT("moe_intermediate_size", -1, false, 1, &c->moe_inter);
            INT("num_experts", -1, false, 1, &c->experts);
        }
        if (c->heads % c->kv_heads != 0) {
            rc = rf_err_set(err, -EINVAL, "model spec %s: num_attention_heads=%" PRId64 " is not "
                            "a multiple of num_key_value_heads=%" PRId64, path, c->heads,
                            c->kv_heads);
            goto out;
        }
    }
#undef INT
    if (c->layers > 4096 || c->experts > 4096) {
        rc = rf_err_set(err, -EINVAL, "model spec %s: %" PRId64 " layers and %" PRId64 " experts "
                        "exceed the limits of 4096 each", path, c->layers, c->experts);
        goto out;
    }
    rc = 0;
out:
    json_decref(root);
    return rc;
}

int rf_model_load(const char *name_or_path, rf_model **out, rf_err *err)
{
    cfg c;
    int rc;

    *out = NULL;
    for (size_t i = 0; i < NBUILTINS; i++)
        if (strcmp(name_or_path, builtins[i].name) == 0)
            return model_from_cfg(&builtins[i], out, err);
    if (access(name_or_path, F_OK) != 0)
        return rf_err_set(err, -ENOENT, "unknown model '%s': not a builtin (qwen3-0.6b, qwen3-4b, "
                          "qwen3-30b-a3b, deepseek-v3) and no JSON spec file of that name",
                          name_or_path);
    rc = load_json(name_or_path, &c, err);
    if (rc < 0)
        return rc;
    return model_from_cfg(&c, out, err);
}

/* x / div rounded up to a multiple of gcd(x, 16). */
static int64_t shrink_dim(int64_t x, int64_t div)
{
    int64_t g = 16, a = x, b, y;

    while (a) {
        b = g % a;
        g = a;
        a = b;
    }
    y = (x + div - 1) / div;
    return (y + g - 1) / g * g;
}

int rf_model_shrink(const rf_model *m, int div, rf_model **out, rf_err *err)
{
    cfg c = m->c;

    *out = NULL;
    if (div < 1)
        return rf_err_set(err, -EINVAL, "cannot shrink model %s by %d: the divisor must be >= 1",
                          m->c.name, div);
    c.hidden = shrink_dim(c.hidden, div);
    c.inter = shrink_dim(c.inter, div);
    c.moe_inter = c.moe_inter ? shrink_dim(c.moe_inter, div) : 0;
    c.q_lora = c.q_lora ? shrink_dim(c.q_lora, div) : 0;
    c.kv_lora = c.kv_lora ? shrink_dim(c.kv_lora, div) : 0;
    if (c.arch == ARCH_DSV3) {
        c.qk_nope = shrink_dim(c.qk_nope, div);
        c.qk_rope = shrink_dim(c.qk_rope, div);
        c.v_head = shrink_dim(c.v_head, div);
        c.head_dim = c.qk_nope + c.qk_rope;
    } else {
        c.head_dim = shrink_dim(c.head_dim, div);
    }
    c.vocab = (c.vocab + div - 1) / div;
    snprintf(c.name, sizeof(c.name), "%.100s/%d", m->c.name, div);
    return model_from_cfg(&c, out, err);
}

const char *rf_model_name(const rf_model *m) { return m->c.name; }
uint32_t rf_model_ntensors(const rf_model *m) { return m->nt; }
const rf_tensor *rf_model_tensor(const rf_model *m, uint32_t i) { return &m->t[i]; }
uint64_t rf_model_bytes(const rf_model *m) { return m->bytes; }

int rf_model_find(const rf_model *m, const char *name, uint32_t *id)
{
    for (uint32_t i = 0; i < m->nt; i++) {
        if (strcmp(m->t[i].name, name) == 0) {
            *id = i;
            return 0;
        }
    }
    return -ENOENT;
}

/* ---- layouts ----------------------------------------------------------------------------- */

int rf_par_world(const rf_par *p, rf_side side)
{
    if (side == RF_SRC)
        return p->tp * p->pp * p->dp;
    return p->attn_dp ? p->tp : p->tp * p->dp;
}

static int check_par(const rf_model *m, rf_side side, const char *s, rf_par *p, rf_err *err)
{
    const cfg *c = &m->c;
    const char *who = side == RF_SRC ? "trainer" : "engine";

#define BAD(...) rf_err_set(err, -EINVAL, __VA_ARGS__)
    if (p->attn_dp && side == RF_SRC)
        return BAD("trainer layout '%s': attn is an engine key (SGLang's DP attention); a "
                   "trainer shards attention by its tp", s);
    if (p->attn_dp && p->tp % p->dp != 0)
        return BAD("engine layout '%s': attn=dp needs dp=%d to divide tp=%d (SGLang "
                   "--enable-dp-attention: tp counts every rank, attention-TP is tp/dp)", s,
                   p->dp, p->tp);
    /* Attention is sharded over attention-TP: tp/dp under DP attention, tp otherwise. */
    int at = p->attn_dp ? p->tp / p->dp : p->tp;
    const char *atn = p->attn_dp ? "attention-TP tp/dp" : "tp";

    if (c->heads % at != 0)
        return BAD("%s layout '%s' for %s: %s=%d does not divide num_attention_heads=%" PRId64,
                   who, s, c->name, atn, at, c->heads);
    if (c->arch != ARCH_DSV3 && c->kv_heads % at != 0 && at % c->kv_heads != 0)
        return BAD("%s layout '%s' for %s: %s=%d and num_key_value_heads=%" PRId64 " must divide "
                   "one another", who, s, c->name, atn, at, c->kv_heads);
    if (has_dense_layer(c) && c->inter % p->tp != 0)
        return BAD("%s layout '%s' for %s: tp=%d does not divide intermediate_size=%" PRId64, who,
                   s, c->name, p->tp, c->inter);
    if (c->shared > 0 && (c->moe_inter * c->shared) % p->tp != 0)
        return BAD("%s layout '%s' for %s: tp=%d does not divide the shared experts' "
                   "intermediate size %" PRId64, who, s, c->name, p->tp,
                   c->moe_inter * c->shared);
    if (c->experts == 0 && (p->ep > 1 || p->etp > 1))
        return BAD("%s layout '%s': %s has no experts, so ep and etp must be 1", who, s, c->name);
    if (c->experts > 0 && c->experts % p->ep != 0)
        return BAD("%s layout '%s': ep=%d does not divide the %" PRId64 " experts of %s", who, s,
                   p->ep, c->experts, c->name);
    if (side == RF_SRC) {
        if (p->pp > c->layers)
            return BAD("trainer layout '%s': pp=%d exceeds the %" PRId64 " layers of %s", s, p->pp,
                       c->layers, c->name);
        if (c->experts > 0 && c->moe_inter % p->etp != 0)
            return BAD("trainer layout '%s': etp=%d does not divide moe_intermediate_size=%" PRId64
                       " of %s", s, p->etp, c->moe_inter, c->name);
        if ((p->tp * p->dp) % (p->ep * p->etp) != 0)
            return BAD("trainer layout '%s': ep*etp=%d must divide tp*dp=%d (the expert mesh of a "
                       "pipeline stage)", s, p->ep * p->etp, p->tp * p->dp);
    } else {
        if (p->pp != 1)
            return BAD("engine layout '%s': pp=%d is not supported on the engine side (it runs "
                       "tp, ep and dp only)", s, p->pp);
        if (p->etp != 1)
            return BAD("engine layout '%s': etp is a trainer key; the engine shards each expert "
                       "group over tp/ep ranks", s);
        if (p->attn_dp && p->tp % p->ep != 0)
            return BAD("engine layout '%s': ep=%d must divide tp=%d (under attn=dp tp counts "
                       "every rank and experts spread over ep groups of tp/ep ranks, as SGLang's "
                       "--ep)", s, p->ep, p->tp);
        if (p->tp % p->ep != 0 && p->ep != p->tp * p->dp)
            return BAD("engine layout '%s': ep=%d must divide tp=%d (experts over each replica's "
                       "TP group) or equal tp*dp=%d (vLLM expert parallelism: experts over all "
                       "ranks, attention per DP rank)", s, p->ep, p->tp, p->tp * p->dp);
        if (c->experts > 0 && p->tp % p->ep == 0 && c->moe_inter % (p->tp / p->ep) != 0)
            return BAD("engine layout '%s': tp/ep=%d does not divide moe_intermediate_size=%"
                       PRId64 " of %s", s, p->tp / p->ep, c->moe_inter, c->name);
    }
    if ((int64_t)p->tp * p->pp * p->dp > (1 << 20))
        return BAD("%s layout '%s': %lld ranks is more than the supported %d", who, s,
                   (long long)p->tp * p->pp * p->dp, 1 << 20);
#undef BAD
    return 0;
}

int rf_par_parse(const char *s, rf_side side, const rf_model *m, rf_par *out, rf_err *err)
{
    static const char *keys[] = {"tp", "pp", "ep", "etp", "dp", "attn"};
    int vals[6] = {0, 0, 0, 0, 0, 0};
    const char *who = side == RF_SRC ? "trainer" : "engine";
    const char *p = s;

    while (*p) {
        const char *item = p, *eq, *end = strchr(p, ',');
        size_t klen, ilen;
        char num[32], *e;
        long v;
        int k;

        if (end == NULL)
            end = p + strlen(p);
        ilen = (size_t)(end - item);
        eq = memchr(item, '=', ilen);
        if (ilen == 0 || eq == NULL)
            return rf_err_set(err, -EINVAL, "%s layout '%s': item '%.*s' is not key=value (e.g. "
                              "\"tp=2,pp=2\")", who, s, (int)ilen, item);
        klen = (size_t)(eq - item);
        for (k = 0; k < 6; k++)
            if (strlen(keys[k]) == klen && strncmp(item, keys[k], klen) == 0)
                break;
        if (k == 6)
            return rf_err_set(err, -EINVAL, "unknown key '%.*s' in layout '%s' (known: tp, pp, "
                              "ep, etp, dp, attn)", (int)klen, item, s);
        if (vals[k] != 0)
            return rf_err_set(err, -EINVAL, "%s layout '%s': key '%s' given twice", who, s,
                              keys[k]);
        if (k == 5) {
            /* attn=tp (attention over tp, the default) or attn=dp (SGLang's DP attention);
             * stored as 1 or 2 so that "given twice" sees it. */
            size_t vlen = (size_t)(end - eq - 1);

            if (vlen == 2 && strncmp(eq + 1, "tp", 2) == 0)
                vals[k] = 1;
            else if (vlen == 2 && strncmp(eq + 1, "dp", 2) == 0)
                vals[k] = 2;
            else
                return rf_err_set(err, -EINVAL, "%s layout '%s': attn='%.*s' is not tp or dp "
                                  "(attn=dp: SGLang's --enable-dp-attention, attention over "
                                  "tp/dp ranks per DP group)", who, s, (int)vlen, eq + 1);
            p = *end ? end + 1 : end;
            if (*end && *p == '\0')
                return rf_err_set(err, -EINVAL, "%s layout '%s' ends with a comma", who, s);
            continue;
        }
        snprintf(num, sizeof(num), "%.*s", (int)(end - eq - 1), eq + 1);
        errno = 0;
        v = strtol(num, &e, 10);
        if (num[0] == '\0' || !isdigit((unsigned char)num[0]) || *e != '\0' || errno != 0 ||
            (size_t)(end - eq - 1) >= sizeof(num) || v < 1 || v > (1 << 20))
            return rf_err_set(err, -EINVAL, "%s layout '%s': %s='%.*s' is not a positive integer",
                              who, s, keys[k], (int)(end - eq - 1), eq + 1);
        vals[k] = (int)v;
        p = *end ? end + 1 : end;
        if (*end && *p == '\0')
            return rf_err_set(err, -EINVAL, "%s layout '%s' ends with a comma", who, s);
    }
    out->tp = vals[0] ? vals[0] : 1;
    out->pp = vals[1] ? vals[1] : 1;
    out->ep = vals[2] ? vals[2] : 1;
    out->etp = vals[3] ? vals[3] : 1;
    out->attn_dp = vals[5] == 2;
    if (vals[4])
        out->dp = vals[4];
    else if (side == RF_SRC && out->ep * out->etp > out->tp)
        out->dp = out->ep * out->etp / out->tp;
    else
        out->dp = 1;
    return check_par(m, side, s, out, err);
}

/* Emission of one rank's regions and pieces. Offsets are counted in elements of the piece's
 * tensor and converted to bytes here; every region holds one dtype. */
typedef struct emit {
    const rf_model *m;
    const rf_rank_sink *sink;
    uint32_t nreg;
    rf_piece p; /* reused: dims past the second stay canonical (start 0, extent 1, stride 0) */
} emit;

static int em_region(emit *e, int32_t tensor, uint64_t numel, uint32_t *id)
{
    int rc = e->sink->region(e->sink->ctx, e->nreg,
                             numel * rf_dtype_size(e->m->t[tensor].dtype));

    if (rc < 0)
        return rc;
    *id = e->nreg++;
    return 0;
}

/* A 2-D piece of tensor: rows [r0, r0+nr) x cols [c0, c0+nc), stored row-major with row
 * stride ld elements, its origin at element off of the region. */
static int em_piece2(emit *e, int32_t tensor, uint32_t region, uint64_t off, int64_t r0,
                     int64_t nr, int64_t c0, int64_t nc, int64_t ld)
{
    const rf_tensor *t = &e->m->t[tensor];
    rf_piece *p = &e->p;

    p->tensor = (uint32_t)tensor;
    p->region = region;
    p->offset = off * rf_dtype_size(t->dtype);
    p->box.start[0] = r0;
    p->box.extent[0] = nr;
    if (t->ndim == 2) {
        p->box.start[1] = c0;
        p->box.extent[1] = nc;
        p->strides[0] = ld;
        p->strides[1] = 1;
    } else {
        p->box.start[1] = 0;
        p->box.extent[1] = 1;
        p->strides[0] = 1;
        p->strides[1] = 0;
    }
    return e->sink->piece(e->sink->ctx, p);
}

/* A region holding the whole tensor (norms, replicated projections, routers). */
static int em_whole(emit *e, int32_t tensor)
{
    const rf_tensor *t = &e->m->t[tensor];
    int64_t cols = t->ndim == 2 ? t->shape[1] : 1;
    uint32_t r;
    int rc = em_region(e, tensor, (uint64_t)(t->shape[0] * cols), &r);

    return rc < 0 ? rc : em_piece2(e, tensor, r, 0, 0, t->shape[0], 0, cols, cols);
}

/* Column-parallel: a region of rows/tp full rows holding rows chunk tp_r. */
static int em_colpar(emit *e, int32_t tensor, int tp, int tp_r)
{
    const rf_tensor *t = &e->m->t[tensor];
    int64_t n = t->shape[0] / tp, H = t->shape[1];
    uint32_t r;
    int rc = em_region(e, tensor, (uint64_t)(n * H), &r);

    return rc < 0 ? rc : em_piece2(e, tensor, r, 0, tp_r * n, n, 0, H, H);
}

/* Row-parallel: a local [out, in/tp] row-major buffer holding cols chunk tp_r. */
static int em_rowpar(emit *e, int32_t tensor, int tp, int tp_r)
{
    const rf_tensor *t = &e->m->t[tensor];
    int64_t out = t->shape[0], n = t->shape[1] / tp;
    uint32_t r;
    int rc = em_region(e, tensor, (uint64_t)(out * n), &r);

    return rc < 0 ? rc : em_piece2(e, tensor, r, 0, 0, out, tp_r * n, n, n);
}

/* Fused [gate_local; up_local] of two [I, H] tensors, I sharded in parts, this rank part j. */
static int em_fc1(emit *e, int32_t gate, int32_t up, int parts, int j)
{
    const rf_tensor *t = &e->m->t[gate];
    int64_t n = t->shape[0] / parts, H = t->shape[1];
    uint32_t r;
    int rc = em_region(e, gate, (uint64_t)(2 * n * H), &r);

    if (rc == 0)
        rc = em_piece2(e, gate, r, 0, j * n, n, 0, H, H);
    if (rc == 0)
        rc = em_piece2(e, up, r, (uint64_t)(n * H), j * n, n, 0, H, H);
    return rc;
}

/* Vocab-parallel rows: a region of rows_local rows holding rows [r0, r0+n) (n may be 0 for a
 * rank whose share lies past the vocabulary). */
static int em_vocab(emit *e, int32_t tensor, int64_t rows_local, int64_t r0, int64_t n)
{
    int64_t H = e->m->t[tensor].shape[1];
    uint32_t r;
    int rc = em_region(e, tensor, (uint64_t)(rows_local * H), &r);

    if (rc < 0 || n <= 0)
        return rc;
    return em_piece2(e, tensor, r, 0, r0, n, 0, H, H);
}

/* Megatron pads the vocabulary to a multiple of 128 * tp and gives each TP rank an equal share. */
static int em_megatron_vocab(emit *e, int32_t tensor, int tp, int tp_r)
{
    int64_t V = e->m->c.vocab, pad = 128LL * tp;
    int64_t per = (V + pad - 1) / pad * pad / tp, r0 = tp_r * per;
    int64_t n = r0 >= V ? 0 : (V - r0 < per ? V - r0 : per);

    return em_vocab(e, tensor, per, r0, n);
}

#define TRY(x)                                                                                  \
    do {                                                                                        \
        rc = (x);                                                                               \
        if (rc < 0)                                                                             \
            return rc;                                                                          \
    } while (0)

/* Megatron linear_qkv: per local query group, its q rows, then its k rows, then its v rows.
 * With fewer KV heads than TP ranks, tp/kv ranks share a group: each holds its part of the
 * group's q heads and a full copy of k and v. */
static int trainer_qkv(emit *e, const int32_t *li, int tp, int tp_r)
{
    const cfg *c = &e->m->c;
    int64_t hd = c->head_dim, H = c->hidden, qpg = c->heads / c->kv_heads;
    int64_t ng, g0, share, j, qr, grp;
    uint32_t r;
    int rc;

    if (c->kv_heads >= tp) {
        ng = c->kv_heads / tp;
        g0 = tp_r * ng;
        share = 1;
        j = 0;
    } else {
        share = tp / c->kv_heads;
        ng = 1;
        g0 = tp_r / share;
        j = tp_r % share;
    }
    qr = qpg / share * hd;
    grp = qr + 2 * hd;
    TRY(em_region(e, li[R_Q], (uint64_t)(ng * grp * H), &r));
    for (int64_t g = 0; g < ng; g++) {
        int64_t G = g0 + g;
        uint64_t base = (uint64_t)(g * grp * H);

        TRY(em_piece2(e, li[R_Q], r, base, G * qpg * hd + j * qr, qr, 0, H, H));
        TRY(em_piece2(e, li[R_K], r, base + (uint64_t)(qr * H), G * hd, hd, 0, H, H));
        TRY(em_piece2(e, li[R_V], r, base + (uint64_t)((qr + hd) * H), G * hd, hd, 0, H, H));
    }
    return 0;
}

static int trainer_rank(emit *e, const rf_par *p, int rank)
{
    const rf_model *m = e->m;
    const cfg *c = &m->c;
    int tp = p->tp, tp_r = rank % tp, dp_r = (rank / tp) % p->dp, pp_r = rank / (tp * p->dp);
    int mesh = tp_r + tp * dp_r, etp_r = mesh % p->etp, ep_r = (mesh / p->etp) % p->ep;
    int64_t l0, nl;
    int rc;

    rf_chunk(c->layers, p->pp, pp_r, &l0, &nl);
    if (pp_r == 0)
        TRY(em_megatron_vocab(e, m->embed, tp, tp_r));
    for (int64_t l = l0; l < l0 + nl; l++) {
        const int32_t *li = &m->lidx[l * R__COUNT];

        TRY(em_whole(e, li[R_IN_NORM]));
        if (c->arch == ARCH_DSV3) {
            if (c->q_lora > 0) {
                TRY(em_whole(e, li[R_QA]));
                TRY(em_whole(e, li[R_QA_NORM]));
                TRY(em_colpar(e, li[R_QB], tp, tp_r));
            } else {
                TRY(em_colpar(e, li[R_Q], tp, tp_r));
            }
            TRY(em_whole(e, li[R_KVA]));
            TRY(em_whole(e, li[R_KVA_NORM]));
            TRY(em_colpar(e, li[R_KVB], tp, tp_r));
            TRY(em_rowpar(e, li[R_O], tp, tp_r));
        } else {
            TRY(trainer_qkv(e, li, tp, tp_r));
            TRY(em_whole(e, li[R_QNORM]));
            TRY(em_whole(e, li[R_KNORM]));
            TRY(em_rowpar(e, li[R_O], tp, tp_r));
        }
        TRY(em_whole(e, li[R_POST_NORM]));
        if (!is_moe_layer(c, l)) {
            TRY(em_fc1(e, li[R_GATE], li[R_UP], tp, tp_r));
            TRY(em_rowpar(e, li[R_DOWN], tp, tp_r));
            continue;
        }
        TRY(em_whole(e, li[R_ROUTER]));
        if (li[R_ROUTER_BIAS] >= 0)
            TRY(em_whole(e, li[R_ROUTER_BIAS]));
        for (int64_t le = 0; le < c->experts / p->ep; le++) {
            int32_t x = m->expert0[l] + (int32_t)(3 * (ep_r * (c->experts / p->ep) + le));

            TRY(em_fc1(e, x, x + 1, p->etp, etp_r));
            TRY(em_rowpar(e, x + 2, p->etp, etp_r));
        }
        if (c->shared > 0) {
            TRY(em_fc1(e, li[R_SH_GATE], li[R_SH_UP], tp, tp_r));
            TRY(em_rowpar(e, li[R_SH_DOWN], tp, tp_r));
        }
    }
    if (pp_r == p->pp - 1) {
        TRY(em_whole(e, m->norm));
        if (m->lm_head >= 0)
            TRY(em_megatron_vocab(e, m->lm_head, tp, tp_r));
        else if (p->pp > 1)
            /* Tied embeddings: the last stage keeps its own copy for the output layer. */
            TRY(em_megatron_vocab(e, m->embed, tp, tp_r));
    }
    return 0;
}

/* vLLM qkv_proj: [q_local; k_local; v_local], KV heads replicated when kv_heads < tp. */
static int engine_qkv(emit *e, const int32_t *li, int tp, int tp_r)
{
    const cfg *c = &e->m->c;
    int64_t hd = c->head_dim, H = c->hidden, qr = c->heads / tp * hd;
    int64_t kvl = c->kv_heads >= tp ? c->kv_heads / tp : 1;
    int64_t kv0 = c->kv_heads >= tp ? tp_r * kvl : tp_r / (tp / c->kv_heads);
    uint32_t r;
    int rc;

    TRY(em_region(e, li[R_Q], (uint64_t)((qr + 2 * kvl * hd) * H), &r));
    TRY(em_piece2(e, li[R_Q], r, 0, tp_r * qr, qr, 0, H, H));
    TRY(em_piece2(e, li[R_K], r, (uint64_t)(qr * H), kv0 * hd, kvl * hd, 0, H, H));
    TRY(em_piece2(e, li[R_V], r, (uint64_t)((qr + kvl * hd) * H), kv0 * hd, kvl * hd, 0, H, H));
    return 0;
}

/* Whether the engine spreads experts over all tp*dp ranks, as vLLM does with
 * --enable-expert-parallel and dp > 1; then DP replicas differ in their experts. With dp = 1 the
 * two meanings of ep = tp coincide, so that case stays on the TP-group path. */
static bool engine_ep_all(const rf_par *p)
{
    return !p->attn_dp && p->dp > 1 && p->ep > 1 && p->ep == p->tp * p->dp;
}

/* vLLM fused MoE: w13_weight [E_local, 2*I_local, H] and w2_weight [E_local, H, I_local]. With
 * ep dividing tp, each replica's TP group holds all experts, ep groups of tp/ep ranks splitting
 * the intermediate dim; with ep = tp*dp, rank r holds experts [r*E/ep, (r+1)*E/ep) whole. */
static int engine_experts(emit *e, int64_t l, const rf_par *p, int rank)
{
    const rf_model *m = e->m;
    const cfg *c = &m->c;
    bool all = engine_ep_all(p);
    int tp_r = rank % p->tp, gs = all ? 1 : p->tp / p->ep;
    int grp = all ? rank : tp_r / gs, j = all ? 0 : tp_r % gs;
    int64_t El = c->experts / p->ep, Il = c->moe_inter / gs, H = c->hidden;
    int32_t x0 = m->expert0[l] + (int32_t)(3 * grp * El);
    uint32_t r13, r2;
    int rc;

    TRY(em_region(e, x0, (uint64_t)(El * 2 * Il * H), &r13));
    for (int64_t le = 0; le < El; le++) {
        int32_t x = x0 + (int32_t)(3 * le);
        uint64_t base = (uint64_t)(le * 2 * Il * H);

        TRY(em_piece2(e, x, r13, base, j * Il, Il, 0, H, H));
        TRY(em_piece2(e, x + 1, r13, base + (uint64_t)(Il * H), j * Il, Il, 0, H, H));
    }
    TRY(em_region(e, x0 + 2, (uint64_t)(El * H * Il), &r2));
    for (int64_t le = 0; le < El; le++)
        TRY(em_piece2(e, x0 + (int32_t)(3 * le) + 2, r2, (uint64_t)(le * H * Il), 0, H, j * Il,
                      Il, Il));
    return 0;
}

static int engine_rank(emit *e, const rf_par *p, int rank)
{
    const rf_model *m = e->m;
    const cfg *c = &m->c;
    int tp = p->tp, tp_r = rank % tp;
    /* Attention-TP: tp/dp ranks per DP group under SGLang's DP attention (attn=dp). */
    int at = p->attn_dp ? tp / p->dp : tp, at_r = tp_r % at;
    int64_t V = c->vocab, s, n;
    int rc;

    rf_chunk(V, tp, tp_r, &s, &n);
    if (p->attn_dp)
        TRY(em_whole(e, m->embed)); /* VocabParallelEmbedding(enable_tp=False) */
    else
        TRY(em_vocab(e, m->embed, (V + tp - 1) / tp, s, n));
    for (int64_t l = 0; l < c->layers; l++) {
        const int32_t *li = &m->lidx[l * R__COUNT];

        TRY(em_whole(e, li[R_IN_NORM]));
        if (c->arch == ARCH_DSV3) {
            if (c->q_lora > 0) {
                const rf_tensor *qa = &m->t[li[R_QA]], *kva = &m->t[li[R_KVA]];
                int64_t H = c->hidden;
                uint32_t r;

                /* fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa], replicated. */
                TRY(em_region(e, li[R_QA], (uint64_t)((qa->shape[0] + kva->shape[0]) * H), &r));
                TRY(em_piece2(e, li[R_QA], r, 0, 0, qa->shape[0], 0, H, H));
                TRY(em_piece2(e, li[R_KVA], r, (uint64_t)(qa->shape[0] * H), 0, kva->shape[0], 0,
                              H, H));
                TRY(em_whole(e, li[R_QA_NORM]));
                TRY(em_colpar(e, li[R_QB], at, at_r));
            } else {
                TRY(em_colpar(e, li[R_Q], at, at_r));
                TRY(em_whole(e, li[R_KVA]));
            }
            TRY(em_whole(e, li[R_KVA_NORM]));
            TRY(em_colpar(e, li[R_KVB], at, at_r));
            TRY(em_rowpar(e, li[R_O], at, at_r));
        } else {
            TRY(engine_qkv(e, li, at, at_r));
            TRY(em_rowpar(e, li[R_O], at, at_r));
            TRY(em_whole(e, li[R_QNORM]));
            TRY(em_whole(e, li[R_KNORM]));
        }
        TRY(em_whole(e, li[R_POST_NORM]));
        if (!is_moe_layer(c, l)) {
            TRY(em_fc1(e, li[R_GATE], li[R_UP], tp, tp_r));
            TRY(em_rowpar(e, li[R_DOWN], tp, tp_r));
            continue;
        }
        TRY(em_whole(e, li[R_ROUTER]));
        if (li[R_ROUTER_BIAS] >= 0)
            TRY(em_whole(e, li[R_ROUTER_BIAS]));
        TRY(engine_experts(e, l, p, rank));
        if (c->shared > 0) {
            TRY(em_fc1(e, li[R_SH_GATE], li[R_SH_UP], tp, tp_r));
            TRY(em_rowpar(e, li[R_SH_DOWN], tp, tp_r));
        }
    }
    TRY(em_whole(e, m->norm));
    if (m->lm_head >= 0)
        TRY(em_vocab(e, m->lm_head, (V + tp - 1) / tp, s, n));
    return 0;
}

int rf_model_rank(const rf_model *m, const rf_par *p, rf_side side, int rank,
                  const rf_rank_sink *sink, rf_err *err)
{
    emit e = {.m = m, .sink = sink, .nreg = 0};
    int rc;

    rf_box_full(&e.p.box, 0, NULL);
    memset(e.p.strides, 0, sizeof(e.p.strides));

    rf_err_clear(err);
    if (rank < 0 || rank >= rf_par_world(p, side))
        return rf_err_set(err, -EINVAL, "rank %d is outside the %s world of %d ranks", rank,
                          side == RF_SRC ? "trainer" : "engine", rf_par_world(p, side));
    rc = side == RF_SRC ? trainer_rank(&e, p, rank) : engine_rank(&e, p, rank);
    if (rc < 0 && err && err->code == 0)
        rf_err_set(err, rc, "generating %s rank %d of %s: the sink refused a region or piece "
                   "(%s)", side == RF_SRC ? "trainer" : "engine", rank, m->c.name,
                   strerror(-rc));
    return rc;
}

/* ---- whole inventories ------------------------------------------------------------------- */

typedef struct inv_ctx {
    rf_inv *inv;
    rf_err *err;
    uint32_t endpoint;
    const uint32_t *tmap;
    uint32_t *regmap;
    uint32_t cap;
} inv_ctx;

static int inv_region(void *ctx, uint32_t local, uint64_t size)
{
    inv_ctx *x = ctx;

    if (local >= x->cap) {
        uint32_t ncap = x->cap ? x->cap * 2 : 1024;
        uint32_t *p = realloc(x->regmap, ncap * sizeof(*p));

        if (p == NULL)
            return rf_err_set(x->err, -ENOMEM, "out of memory mapping regions");
        x->regmap = p;
        x->cap = ncap;
    }
    return rf_inv_add_region(x->inv, x->endpoint, size, &x->regmap[local], x->err);
}

static int inv_piece(void *ctx, const rf_piece *p)
{
    inv_ctx *x = ctx;
    rf_piece q = *p;

    q.tensor = x->tmap[p->tensor];
    q.region = x->regmap[p->region];
    return rf_inv_add_piece(x->inv, &q, NULL, x->err);
}

int rf_model_build_inv(const rf_model *m, const rf_par *src, const rf_par *dst,
                       int gpus_per_node, rf_inv *inv, rf_err *err)
{
    inv_ctx x = {.inv = inv, .err = err};
    rf_rank_sink sink = {.ctx = &x, .region = inv_region, .piece = inv_piece};
    uint32_t *tmap = NULL;
    int rc = 0, nsrc_nodes;

    if (gpus_per_node < 1)
        return rf_err_set(err, -EINVAL, "gpus_per_node=%d: must be >= 1", gpus_per_node);
    tmap = malloc((size_t)m->nt * sizeof(*tmap));
    if (tmap == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory building the inventory of %s", m->c.name);
        goto out;
    }
    for (uint32_t i = 0; i < m->nt; i++) {
        const rf_tensor *t = &m->t[i];

        rc = rf_inv_add_tensor(inv, t->name, t->dtype, t->ndim, t->shape, &tmap[i], err);
        if (rc < 0)
            goto out;
    }
    x.tmap = tmap;
    nsrc_nodes = (rf_par_world(src, RF_SRC) + gpus_per_node - 1) / gpus_per_node;
    for (int s = 0; s < 2; s++) {
        rf_side side = s ? RF_DST : RF_SRC;
        const rf_par *p = s ? dst : src;

        for (int r = 0; r < rf_par_world(p, side); r++) {
            uint32_t node = (uint32_t)(r / gpus_per_node + (s ? nsrc_nodes : 0));

            rc = rf_inv_add_endpoint(inv, side, node, &x.endpoint, err);
            if (rc == 0)
                rc = rf_model_rank(m, p, side, r, &sink, err);
            if (rc < 0) {
                rf_err_wrap(err, "%s rank %d of %s: ", s ? "engine" : "trainer", r, m->c.name);
                goto out;
            }
        }
    }
out:
    free(tmap);
    free(x.regmap);
    return rc;
}
