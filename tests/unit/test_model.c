/* tests/unit/test_model.c - synthetic models and the rank layouts of both sides: coverage of
 * every tensor, validation and dst overlap through a real inventory, the exact offsets of fused
 * buffers (interleaved linear_qkv, qkv_proj, w13/w2), JSON specs and bad layouts. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model.h"

/* ---- collecting a rank's output ---------------------------------------------------------- */

typedef struct got {
    uint64_t *regions;
    uint32_t nreg, capreg;
    rf_piece *pieces;
    uint32_t npieces, cappieces;
    int fail_after; /* return -E2BIG on the n-th piece when > 0 */
} got;

static int got_region(void *ctx, uint32_t local, uint64_t size)
{
    got *g = ctx;

    cr_assert_eq(local, g->nreg, "regions are numbered in order");
    if (g->nreg == g->capreg) {
        g->capreg = g->capreg ? g->capreg * 2 : 64;
        g->regions = realloc(g->regions, g->capreg * sizeof(*g->regions));
    }
    g->regions[g->nreg++] = size;
    return 0;
}

static int got_piece(void *ctx, const rf_piece *p)
{
    got *g = ctx;

    cr_assert_lt(p->region, g->nreg, "a piece's region is emitted before it");
    if (g->fail_after > 0 && (int)g->npieces + 1 == g->fail_after)
        return -E2BIG;
    if (g->npieces == g->cappieces) {
        g->cappieces = g->cappieces ? g->cappieces * 2 : 256;
        g->pieces = realloc(g->pieces, g->cappieces * sizeof(*g->pieces));
    }
    g->pieces[g->npieces++] = *p;
    return 0;
}

static void got_free(got *g)
{
    free(g->regions);
    free(g->pieces);
    memset(g, 0, sizeof(*g));
}

static void rank_of(const rf_model *m, const rf_par *p, rf_side side, int rank, got *g)
{
    rf_rank_sink sink = {.ctx = g, .region = got_region, .piece = got_piece};
    rf_err err = {0};

    memset(g, 0, sizeof(*g));
    cr_assert_eq(rf_model_rank(m, p, side, rank, &sink, &err), 0, "%s", err.msg);
}

static rf_model *load(const char *name)
{
    rf_model *m = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_model_load(name, &m, &err), 0, "%s", err.msg);
    return m;
}

static rf_par par(const rf_model *m, const char *s, rf_side side)
{
    rf_par p;
    rf_err err = {0};

    cr_assert_eq(rf_par_parse(s, side, m, &p, &err), 0, "%s", err.msg);
    return p;
}

static const rf_piece *find_piece(const got *g, const rf_model *m, const char *name)
{
    uint32_t id;

    cr_assert_eq(rf_model_find(m, name, &id), 0, "no tensor %s", name);
    for (uint32_t i = 0; i < g->npieces; i++)
        if (g->pieces[i].tensor == id)
            return &g->pieces[i];
    cr_assert_fail("rank holds no piece of %s", name);
    return NULL;
}

/* ---- coverage: the union of the boxes of each tensor is the whole tensor ----------------- */

typedef struct cov {
    uint32_t nt;
    uint32_t *n, *cap;
    rf_box **boxes;
} cov;

static void cov_add(cov *c, const got *g)
{
    for (uint32_t i = 0; i < g->npieces; i++) {
        uint32_t t = g->pieces[i].tensor;

        cr_assert_lt(t, c->nt);
        if (c->n[t] == c->cap[t]) {
            c->cap[t] = c->cap[t] ? c->cap[t] * 2 : 8;
            c->boxes[t] = realloc(c->boxes[t], c->cap[t] * sizeof(rf_box));
        }
        c->boxes[t][c->n[t]++] = g->pieces[i].box;
    }
}

static int cmp64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

    return x < y ? -1 : x > y;
}

/* Cuts the tensor into a grid along every box boundary and checks each cell is covered. */
static void cov_check(const cov *c, const rf_model *m, const char *what)
{
    for (uint32_t t = 0; t < c->nt; t++) {
        const rf_tensor *ten = rf_model_tensor(m, t);
        uint32_t n = c->n[t];
        int64_t *cut[2];
        int nc[2];
        bool *cell;

        cr_assert_gt(n, 0, "%s: nobody holds %s", what, ten->name);
        cr_assert_leq(ten->ndim, 2);
        for (int d = 0; d < 2; d++) {
            cut[d] = malloc((2 * n + 2) * sizeof(int64_t));
            nc[d] = 0;
            cut[d][nc[d]++] = 0;
            cut[d][nc[d]++] = ten->shape[d];
            for (uint32_t i = 0; i < n; i++) {
                cut[d][nc[d]++] = c->boxes[t][i].start[d];
                cut[d][nc[d]++] = c->boxes[t][i].start[d] + c->boxes[t][i].extent[d];
            }
            qsort(cut[d], (size_t)nc[d], sizeof(int64_t), cmp64);
            {
                int u = 1;

                for (int i = 1; i < nc[d]; i++)
                    if (cut[d][i] != cut[d][u - 1])
                        cut[d][u++] = cut[d][i];
                nc[d] = u;
            }
            cr_assert_eq(cut[d][nc[d] - 1], ten->shape[d], "%s: a box of %s is out of shape",
                         what, ten->name);
        }
        cell = calloc((size_t)nc[0] * nc[1], 1);
        for (uint32_t i = 0; i < n; i++) {
            const rf_box *b = &c->boxes[t][i];

            for (int a = 0; a + 1 < nc[0]; a++) {
                if (cut[0][a] < b->start[0] || cut[0][a] >= b->start[0] + b->extent[0])
                    continue;
                for (int k = 0; k + 1 < nc[1]; k++)
                    if (cut[1][k] >= b->start[1] && cut[1][k] < b->start[1] + b->extent[1])
                        cell[a * nc[1] + k] = true;
            }
        }
        for (int a = 0; a + 1 < nc[0]; a++)
            for (int k = 0; k + 1 < nc[1]; k++)
                cr_assert(cell[a * nc[1] + k], "%s: %s rows %ld:%ld cols %ld:%ld not covered",
                          what, ten->name, (long)cut[0][a], (long)cut[0][a + 1],
                          (long)cut[1][k], (long)cut[1][k + 1]);
        free(cell);
        free(cut[0]);
        free(cut[1]);
    }
}

static void check_side(const rf_model *m, const char *layout, rf_side side)
{
    rf_par p = par(m, layout, side);
    uint32_t nt = rf_model_ntensors(m);
    cov c = {.nt = nt};
    int world = rf_par_world(&p, side);
    /* vLLM expert parallelism (ep = tp*dp, dp > 1) spreads experts over every rank, so the
     * replicas differ and all ranks together cover the model. */
    bool ep_all = side == RF_DST && p.dp > 1 && p.ep == p.tp * p.dp && !p.attn_dp;
    /* SGLang's DP attention: the world is tp ranks, which together hold the model once; the
     * DP groups differ only in their attention copy (exact counts: Test sglang_dp_attention). */
    ep_all = ep_all || p.attn_dp;
    /* Otherwise one engine DP replica must cover the model; the others are checked identical. */
    int ranks = side == RF_DST && !ep_all ? p.tp : world;
    char what[128];

    snprintf(what, sizeof(what), "%s %s %s", rf_model_name(m), side ? "engine" : "trainer",
             layout);
    c.n = calloc(nt, sizeof(uint32_t));
    c.cap = calloc(nt, sizeof(uint32_t));
    c.boxes = calloc(nt, sizeof(rf_box *));
    for (int r = 0; r < ranks; r++) {
        got g;

        rank_of(m, &p, side, r, &g);
        cov_add(&c, &g);
        if (side == RF_DST && p.dp > 1 && !ep_all) {
            got h;

            rank_of(m, &p, side, r + p.tp * (p.dp - 1), &h);
            cr_assert_eq(h.nreg, g.nreg);
            cr_assert_eq(h.npieces, g.npieces);
            cr_assert_eq(memcmp(h.regions, g.regions, g.nreg * sizeof(uint64_t)), 0);
            cr_assert_eq(memcmp(h.pieces, g.pieces, g.npieces * sizeof(rf_piece)), 0);
            got_free(&h);
        }
        got_free(&g);
    }
    cov_check(&c, m, what);
    for (uint32_t t = 0; t < nt; t++)
        free(c.boxes[t]);
    free(c.boxes);
    free(c.n);
    free(c.cap);
}

/* ---- builtins: coverage, validation and no dst overlap for several layouts --------------- */

/* Parameters reach the test worker by value (a fresh process): strings are held inline. */
typedef struct layout_case {
    char model[32], src[48], dst[48];
} layout_case;

ParameterizedTestParameters(model, layouts)
{
    static layout_case cases[] = {
        {"qwen3-0.6b", "tp=2,pp=2,dp=2", "tp=4,dp=2"},
        {"qwen3-0.6b", "tp=16", "tp=16"},
        {"qwen3-0.6b", "pp=8", "tp=1"},
        {"qwen3-0.6b", "tp=4,pp=3,dp=3", "tp=8,dp=3"},
        {"qwen3-4b", "tp=2,dp=8", "tp=4,dp=4"},
        {"qwen3-30b-a3b", "tp=2,ep=4,dp=2", "tp=4,dp=4"},
        {"qwen3-30b-a3b", "tp=8,ep=8", "tp=8,ep=8"},
        {"qwen3-30b-a3b", "tp=2,pp=2,ep=4,etp=2,dp=4", "tp=8,ep=2"},
        {"deepseek-v3", "tp=8,pp=4,ep=8", "tp=8"},
        {"deepseek-v3", "tp=4,pp=8,ep=16,dp=4", "tp=16,ep=16"},
        /* vLLM expert parallelism: experts over tp*dp ranks, attention per DP rank. */
        {"qwen3-30b-a3b", "tp=2,ep=4,dp=2", "tp=1,dp=8,ep=8"},
        {"qwen3-30b-a3b", "tp=2,ep=4,dp=2", "tp=2,dp=8,ep=16"},
        {"deepseek-v3", "tp=8,pp=4,ep=8", "tp=8,dp=4,ep=32"},
        /* SGLang DP attention: tp ranks in all, attention over tp/dp ranks per DP group. */
        {"qwen3-30b-a3b", "tp=2,ep=4,dp=2", "tp=8,dp=8,attn=dp"},
        {"qwen3-30b-a3b", "tp=2,ep=4,dp=2", "tp=8,dp=2,ep=8,attn=dp"},
        {"qwen3-0.6b", "tp=2,pp=2,dp=2", "tp=8,dp=4,attn=dp"},
        {"deepseek-v3", "tp=8,pp=4,ep=8", "tp=16,dp=16,ep=16,attn=dp"},
        {"deepseek-v3", "tp=8,pp=4,ep=8", "tp=8,dp=2,attn=dp"},
    };
    return cr_make_param_array(layout_case, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(layout_case *lc, model, layouts, .timeout = 60)
{
    rf_model *m = load(lc->model);
    rf_par s = par(m, lc->src, RF_SRC), d = par(m, lc->dst, RF_DST);
    rf_inv *inv = rf_inv_new();
    rf_err err = {0};

    check_side(m, lc->src, RF_SRC);
    check_side(m, lc->dst, RF_DST);
    /* Every piece validates against its region and shape, and no dst bytes are shared. */
    cr_assert_eq(rf_model_build_inv(m, &s, &d, 8, inv, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_ntensors(inv), rf_model_ntensors(m));
    cr_assert_eq(rf_inv_nendpoints(inv),
                 (uint32_t)(rf_par_world(&s, RF_SRC) + rf_par_world(&d, RF_DST)));
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
    rf_inv_free(inv);
    rf_model_free(m);
}

Test(model, builtins)
{
    struct {
        const char *name;
        uint32_t ntensors;
        double gb_lo, gb_hi;
    } want[] = {
        /* 28 layers x 11 + embed + norm */
        {"qwen3-0.6b", 28 * 11 + 2, 1.1, 1.3},
        {"qwen3-4b", 36 * 11 + 2, 7.5, 8.3},
        /* 48 x (8 + router + 128 x 3) + embed + norm + lm_head */
        {"qwen3-30b-a3b", 48 * (8 + 1 + 384) + 3, 60.0, 62.0},
        /* 3 dense x 12 + 58 x (9 + router + bias + 768 + 3 shared) + 3 */
        {"deepseek-v3", 3 * 12 + 58 * (9 + 2 + 768 + 3) + 3, 1300, 1380},
    };

    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        rf_model *m = load(want[i].name);
        double gb = (double)rf_model_bytes(m) / 1e9;

        cr_assert_str_eq(rf_model_name(m), want[i].name);
        cr_assert_eq(rf_model_ntensors(m), want[i].ntensors, "%s: %u tensors", want[i].name,
                     rf_model_ntensors(m));
        cr_assert(gb > want[i].gb_lo && gb < want[i].gb_hi, "%s: %.2f GB", want[i].name, gb);
        rf_model_free(m);
    }
}

static void expect_shape(const rf_model *m, const char *name, rf_dtype dt, int64_t a, int64_t b)
{
    uint32_t id;
    const rf_tensor *t;

    cr_assert_eq(rf_model_find(m, name, &id), 0, "no tensor %s", name);
    t = rf_model_tensor(m, id);
    cr_assert_eq(t->dtype, dt, "%s dtype", name);
    cr_assert_eq(t->shape[0], a, "%s dim 0 %ld", name, (long)t->shape[0]);
    if (b) {
        cr_assert_eq(t->ndim, 2, "%s ndim", name);
        cr_assert_eq(t->shape[1], b, "%s dim 1 %ld", name, (long)t->shape[1]);
    } else {
        cr_assert_eq(t->ndim, 1, "%s ndim", name);
    }
}

Test(model, hf_names_and_shapes)
{
    rf_model *q = load("qwen3-0.6b"), *moe = load("qwen3-30b-a3b"), *ds = load("deepseek-v3");
    uint32_t id;

    expect_shape(q, "model.embed_tokens.weight", RF_DT_BF16, 151936, 1024);
    expect_shape(q, "model.layers.27.self_attn.q_proj.weight", RF_DT_BF16, 2048, 1024);
    expect_shape(q, "model.layers.0.self_attn.k_proj.weight", RF_DT_BF16, 1024, 1024);
    expect_shape(q, "model.layers.0.self_attn.o_proj.weight", RF_DT_BF16, 1024, 2048);
    expect_shape(q, "model.layers.0.self_attn.q_norm.weight", RF_DT_BF16, 128, 0);
    expect_shape(q, "model.layers.0.mlp.down_proj.weight", RF_DT_BF16, 1024, 3072);
    expect_shape(q, "model.norm.weight", RF_DT_BF16, 1024, 0);
    cr_assert_eq(rf_model_find(q, "lm_head.weight", &id), -ENOENT, "tied: no lm_head");
    expect_shape(moe, "model.layers.47.mlp.gate.weight", RF_DT_BF16, 128, 2048);
    expect_shape(moe, "model.layers.3.mlp.experts.127.down_proj.weight", RF_DT_BF16, 2048, 768);
    expect_shape(moe, "lm_head.weight", RF_DT_BF16, 151936, 2048);
    cr_assert_eq(rf_model_find(moe, "model.layers.0.mlp.gate_proj.weight", &id), -ENOENT);
    expect_shape(ds, "model.layers.0.mlp.gate_proj.weight", RF_DT_BF16, 18432, 7168);
    expect_shape(ds, "model.layers.3.mlp.gate.weight", RF_DT_BF16, 256, 7168);
    expect_shape(ds, "model.layers.3.mlp.gate.e_score_correction_bias", RF_DT_FP32, 256, 0);
    expect_shape(ds, "model.layers.60.mlp.experts.255.up_proj.weight", RF_DT_BF16, 2048, 7168);
    expect_shape(ds, "model.layers.60.mlp.shared_experts.down_proj.weight", RF_DT_BF16, 7168,
                 2048);
    expect_shape(ds, "model.layers.5.self_attn.q_a_proj.weight", RF_DT_BF16, 1536, 7168);
    expect_shape(ds, "model.layers.5.self_attn.q_a_layernorm.weight", RF_DT_BF16, 1536, 0);
    expect_shape(ds, "model.layers.5.self_attn.q_b_proj.weight", RF_DT_BF16, 128 * 192, 1536);
    expect_shape(ds, "model.layers.5.self_attn.kv_a_proj_with_mqa.weight", RF_DT_BF16, 576, 7168);
    expect_shape(ds, "model.layers.5.self_attn.kv_a_layernorm.weight", RF_DT_BF16, 512, 0);
    expect_shape(ds, "model.layers.5.self_attn.kv_b_proj.weight", RF_DT_BF16, 128 * 256, 512);
    expect_shape(ds, "model.layers.5.self_attn.o_proj.weight", RF_DT_BF16, 7168, 128 * 128);
    expect_shape(ds, "lm_head.weight", RF_DT_BF16, 129280, 7168);
    cr_assert_eq(rf_model_find(ds, "model.layers.2.mlp.gate.weight", &id), -ENOENT);
    rf_model_free(q);
    rf_model_free(moe);
    rf_model_free(ds);
}

/* ---- exact offsets of fused buffers ------------------------------------------------------ */

#define H30 2048
static void expect_rows(const rf_piece *p, int64_t r0, int64_t nr, uint64_t off, int64_t ld)
{
    cr_assert_eq(p->box.start[0], r0, "rows start %ld, want %ld", (long)p->box.start[0],
                 (long)r0);
    cr_assert_eq(p->box.extent[0], nr, "rows %ld, want %ld", (long)p->box.extent[0], (long)nr);
    cr_assert_eq(p->offset, off, "offset %lu, want %lu", (unsigned long)p->offset,
                 (unsigned long)off);
    cr_assert_eq(p->strides[0], ld);
    cr_assert_eq(p->strides[1], 1);
}

/* Qwen3-30B-A3B: 32 q heads, 4 KV heads of 128, hidden 2048. At TP8 each KV group spans two
 * ranks: rank 3 holds q heads 12..15 (the second half of group 1) and all of group 1's k, v. */
Test(model, qkv_kv_heads_below_tp)
{
    rf_model *m = load("qwen3-30b-a3b");
    rf_par s = par(m, "tp=8,ep=8", RF_SRC), d = par(m, "tp=8", RF_DST);
    got g;
    const rf_piece *q, *k, *v;

    rank_of(m, &s, RF_SRC, 3, &g);
    q = find_piece(&g, m, "model.layers.0.self_attn.q_proj.weight");
    k = find_piece(&g, m, "model.layers.0.self_attn.k_proj.weight");
    v = find_piece(&g, m, "model.layers.0.self_attn.v_proj.weight");
    /* regions: embedding, input_layernorm, linear_qkv, ... */
    cr_assert_eq(q->region, 2);
    cr_assert_eq(k->region, 2);
    cr_assert_eq(v->region, 2);
    cr_assert_eq(g.regions[2], (uint64_t)(512 + 128 + 128) * H30 * 2);
    expect_rows(q, 1536, 512, 0, H30);
    expect_rows(k, 128, 128, 512 * H30 * 2, H30);
    expect_rows(v, 128, 128, 640 * H30 * 2, H30);
    got_free(&g);
    /* Rank 2 shares group 1 with rank 3: first half of its q heads, the same k and v. */
    rank_of(m, &s, RF_SRC, 2, &g);
    expect_rows(find_piece(&g, m, "model.layers.0.self_attn.q_proj.weight"), 1024, 512, 0, H30);
    expect_rows(find_piece(&g, m, "model.layers.0.self_attn.k_proj.weight"), 128, 128,
                512 * H30 * 2, H30);
    got_free(&g);
    /* vLLM TP8: [q_local; k_local; v_local] with KV head 3 / (8/4) = 1 replicated. */
    rank_of(m, &d, RF_DST, 3, &g);
    cr_assert_eq(g.regions[2], (uint64_t)(512 + 128 + 128) * H30 * 2);
    expect_rows(find_piece(&g, m, "model.layers.0.self_attn.q_proj.weight"), 1536, 512, 0, H30);
    expect_rows(find_piece(&g, m, "model.layers.0.self_attn.k_proj.weight"), 128, 128,
                512 * H30 * 2, H30);
    expect_rows(find_piece(&g, m, "model.layers.0.self_attn.v_proj.weight"), 128, 128,
                640 * H30 * 2, H30);
    got_free(&g);
    rf_model_free(m);
}

/* Qwen3-0.6B at trainer TP2: 8 KV groups, 4 per rank, each [2 q heads; k; v] = 512 rows. The
 * pieces of rank 1 (groups 4..7) interleave as q4 k4 v4 q5 k5 v5 ... */
Test(model, qkv_interleaved_groups)
{
    rf_model *m = load("qwen3-0.6b");
    rf_par s = par(m, "tp=2", RF_SRC);
    uint32_t qid, kid, vid;
    int seen = 0;
    got g;

    cr_assert_eq(rf_model_find(m, "model.layers.0.self_attn.q_proj.weight", &qid), 0);
    kid = qid + 1;
    vid = qid + 2;
    rank_of(m, &s, RF_SRC, 1, &g);
    cr_assert_eq(g.regions[2], (uint64_t)4 * 512 * 1024 * 2);
    for (uint32_t i = 0; i < g.npieces; i++) {
        const rf_piece *p = &g.pieces[i];
        int64_t grp;

        if (p->tensor != qid && p->tensor != kid && p->tensor != vid)
            continue;
        grp = seen / 3;
        if (p->tensor == qid)
            expect_rows(p, (4 + grp) * 256, 256, (uint64_t)grp * 512 * 1024 * 2, 1024);
        else if (p->tensor == kid)
            expect_rows(p, (4 + grp) * 128, 128, (uint64_t)(grp * 512 + 256) * 1024 * 2, 1024);
        else
            expect_rows(p, (4 + grp) * 128, 128, (uint64_t)(grp * 512 + 384) * 1024 * 2, 1024);
        cr_assert_eq(p->tensor, seen % 3 == 0 ? qid : seen % 3 == 1 ? kid : vid);
        seen++;
    }
    cr_assert_eq(seen, 12);
    got_free(&g);
    rf_model_free(m);
}

Test(model, w13_w2_offsets)
{
    rf_model *m = load("qwen3-30b-a3b");
    rf_par d = par(m, "tp=4", RF_DST), e = par(m, "tp=8,ep=8", RF_DST);
    const rf_piece *p;
    got g;

    /* No EP: all 128 experts, I sharded 768/4 = 192 per rank. */
    rank_of(m, &d, RF_DST, 1, &g);
    p = find_piece(&g, m, "model.layers.0.mlp.experts.5.gate_proj.weight");
    expect_rows(p, 192, 192, (uint64_t)5 * 384 * H30 * 2, H30);
    cr_assert_eq(g.regions[p->region], (uint64_t)128 * 384 * H30 * 2);
    p = find_piece(&g, m, "model.layers.0.mlp.experts.5.up_proj.weight");
    expect_rows(p, 192, 192, (uint64_t)(5 * 384 + 192) * H30 * 2, H30);
    p = find_piece(&g, m, "model.layers.0.mlp.experts.5.down_proj.weight");
    cr_assert_eq(p->box.start[0], 0);
    cr_assert_eq(p->box.extent[0], H30);
    cr_assert_eq(p->box.start[1], 192);
    cr_assert_eq(p->box.extent[1], 192);
    cr_assert_eq(p->strides[0], 192);
    cr_assert_eq(p->offset, (uint64_t)5 * H30 * 192 * 2);
    cr_assert_eq(g.regions[p->region], (uint64_t)128 * H30 * 192 * 2);
    got_free(&g);
    /* EP8 over TP8: rank 3 holds experts 48..63 whole. */
    rank_of(m, &e, RF_DST, 3, &g);
    p = find_piece(&g, m, "model.layers.7.mlp.experts.50.up_proj.weight");
    expect_rows(p, 0, 768, (uint64_t)(2 * 1536 + 768) * H30 * 2, H30);
    cr_assert_eq(g.regions[p->region], (uint64_t)16 * 1536 * H30 * 2);
    for (uint32_t i = 0; i < g.npieces; i++) {
        const char *name = rf_model_tensor(m, g.pieces[i].tensor)->name;
        const char *x = strstr(name, ".experts.");

        if (x) {
            int ex = atoi(x + 9);

            cr_assert(ex >= 48 && ex < 64, "rank 3 holds %s", name);
        }
    }
    got_free(&g);
    rf_model_free(m);
}

/* vLLM --enable-expert-parallel, tp=2 dp=4 ep=8: rank 5 is DP rank 2, TP rank 1. Its experts
 * are 80..95, whole; its attention is TP rank 1's shard, the same bytes as rank 1's. */
Test(model, vllm_ep_over_tp_dp)
{
    rf_model *m = load("qwen3-30b-a3b");
    rf_par d = par(m, "tp=2,dp=4,ep=8", RF_DST);
    const rf_piece *p, *q;
    got g, h;

    cr_assert_eq(rf_par_world(&d, RF_DST), 8);
    rank_of(m, &d, RF_DST, 5, &g);
    p = find_piece(&g, m, "model.layers.7.mlp.experts.81.gate_proj.weight");
    expect_rows(p, 0, 768, (uint64_t)1 * 1536 * H30 * 2, H30);
    cr_assert_eq(g.regions[p->region], (uint64_t)16 * 1536 * H30 * 2);
    p = find_piece(&g, m, "model.layers.7.mlp.experts.81.up_proj.weight");
    expect_rows(p, 0, 768, (uint64_t)(1536 + 768) * H30 * 2, H30);
    p = find_piece(&g, m, "model.layers.7.mlp.experts.81.down_proj.weight");
    cr_assert_eq(p->box.start[0], 0);
    cr_assert_eq(p->box.extent[0], H30);
    cr_assert_eq(p->box.start[1], 0);
    cr_assert_eq(p->box.extent[1], 768);
    cr_assert_eq(p->strides[0], 768);
    cr_assert_eq(p->offset, (uint64_t)1 * H30 * 768 * 2);
    cr_assert_eq(g.regions[p->region], (uint64_t)16 * H30 * 768 * 2);
    for (uint32_t i = 0; i < g.npieces; i++) {
        const char *name = rf_model_tensor(m, g.pieces[i].tensor)->name;
        const char *x = strstr(name, ".experts.");

        if (x) {
            int ex = atoi(x + 9);

            cr_assert(ex >= 80 && ex < 96, "rank 5 holds %s", name);
        }
    }
    /* Attention: q rows 2048..4095 of 4096, k rows 256..511 of 512 (KV heads 2..3). */
    p = find_piece(&g, m, "model.layers.7.self_attn.q_proj.weight");
    expect_rows(p, 2048, 2048, 0, H30);
    p = find_piece(&g, m, "model.layers.7.self_attn.k_proj.weight");
    expect_rows(p, 256, 256, (uint64_t)2048 * H30 * 2, H30);
    rank_of(m, &d, RF_DST, 1, &h);
    q = find_piece(&h, m, "model.layers.7.self_attn.q_proj.weight");
    cr_assert_eq(memcmp(&q->box, &find_piece(&g, m, "model.layers.7.self_attn.q_proj.weight")->box,
                        sizeof(rf_box)), 0, "DP ranks hold the same attention shard");
    q = find_piece(&h, m, "model.layers.7.self_attn.o_proj.weight");
    p = find_piece(&g, m, "model.layers.7.self_attn.o_proj.weight");
    cr_assert_eq(memcmp(&q->box, &p->box, sizeof(rf_box)), 0);
    cr_assert_eq(p->box.start[1], 2048);
    cr_assert_eq(p->box.extent[1], 2048);
    got_free(&h);
    got_free(&g);
    /* tp=1: every rank holds attention whole and its 16 experts. */
    d = par(m, "tp=1,dp=8,ep=8", RF_DST);
    rank_of(m, &d, RF_DST, 7, &g);
    p = find_piece(&g, m, "model.layers.0.self_attn.q_proj.weight");
    expect_rows(p, 0, 4096, 0, H30);
    p = find_piece(&g, m, "model.layers.0.mlp.experts.112.gate_proj.weight");
    expect_rows(p, 0, 768, 0, H30);
    got_free(&g);
    rf_model_free(m);
}

/* SGLang --enable-dp-attention (attn=dp), Qwen3-30B-A3B tp=8,dp=4,ep=2: 8 ranks in all,
 * attention-TP 2. Rank 5 is attention rank 1 of DP group 2: q heads 16..31, KV heads 2..3,
 * o_proj columns 2048..4095; the embedding whole; lm_head rows of full TP rank 5; experts of
 * group 5/4 = 1 (64..127), intermediate rows 192..383 (tp/ep = 4 ranks share a group). */
Test(model, sglang_dp_attention)
{
    rf_model *m = load("qwen3-30b-a3b");
    rf_par d = par(m, "tp=8,dp=4,ep=2,attn=dp", RF_DST);
    const rf_piece *p;
    got g, h;

    cr_assert_eq(d.attn_dp, 1);
    cr_assert_eq(rf_par_world(&d, RF_DST), 8);
    rank_of(m, &d, RF_DST, 5, &g);
    p = find_piece(&g, m, "model.embed_tokens.weight");
    expect_rows(p, 0, 151936, 0, H30);
    cr_assert_eq(g.regions[p->region], (uint64_t)151936 * H30 * 2);
    p = find_piece(&g, m, "model.layers.7.self_attn.q_proj.weight");
    expect_rows(p, 2048, 2048, 0, H30);
    cr_assert_eq(g.regions[p->region], (uint64_t)(2048 + 2 * 256) * H30 * 2);
    p = find_piece(&g, m, "model.layers.7.self_attn.k_proj.weight");
    expect_rows(p, 256, 256, (uint64_t)2048 * H30 * 2, H30);
    p = find_piece(&g, m, "model.layers.7.self_attn.v_proj.weight");
    expect_rows(p, 256, 256, (uint64_t)(2048 + 256) * H30 * 2, H30);
    p = find_piece(&g, m, "model.layers.7.self_attn.o_proj.weight");
    cr_assert_eq(p->box.start[1], 2048);
    cr_assert_eq(p->box.extent[1], 2048);
    cr_assert_eq(p->strides[0], 2048);
    p = find_piece(&g, m, "lm_head.weight");
    expect_rows(p, 5 * 18992, 18992, 0, H30);
    p = find_piece(&g, m, "model.layers.7.mlp.experts.64.gate_proj.weight");
    expect_rows(p, 192, 192, 0, H30);
    cr_assert_eq(g.regions[p->region], (uint64_t)64 * 2 * 192 * H30 * 2);
    p = find_piece(&g, m, "model.layers.7.mlp.experts.127.up_proj.weight");
    expect_rows(p, 192, 192, (uint64_t)(63 * 2 * 192 + 192) * H30 * 2, H30);
    for (uint32_t i = 0; i < g.npieces; i++) {
        const char *name = rf_model_tensor(m, g.pieces[i].tensor)->name;
        const char *x = strstr(name, ".experts.");

        cr_assert(x == NULL || atoi(x + 9) >= 64, "rank 5 holds %s", name);
    }
    /* Rank 1 (DP group 0, attention rank 1) holds the same attention shard as rank 5, and the
     * other expert group. */
    rank_of(m, &d, RF_DST, 1, &h);
    cr_assert_eq(memcmp(&find_piece(&h, m, "model.layers.7.self_attn.q_proj.weight")->box,
                        &find_piece(&g, m, "model.layers.7.self_attn.q_proj.weight")->box,
                        sizeof(rf_box)), 0, "DP groups hold the same attention shards");
    p = find_piece(&h, m, "model.layers.7.mlp.experts.0.gate_proj.weight");
    expect_rows(p, 192, 192, 0, H30);
    got_free(&h);
    got_free(&g);
    /* dp = tp: attention whole on every rank. */
    d = par(m, "tp=8,dp=8,attn=dp", RF_DST);
    cr_assert_eq(rf_par_world(&d, RF_DST), 8);
    rank_of(m, &d, RF_DST, 3, &g);
    expect_rows(find_piece(&g, m, "model.layers.0.self_attn.q_proj.weight"), 0, 4096, 0, H30);
    expect_rows(find_piece(&g, m, "model.layers.0.self_attn.k_proj.weight"), 0, 512,
                (uint64_t)4096 * H30 * 2, H30);
    p = find_piece(&g, m, "model.layers.0.self_attn.o_proj.weight");
    cr_assert_eq(p->box.extent[1], 4096);
    /* ...while the experts stay sharded over all 8 ranks: 768 / 8 rows each. */
    expect_rows(find_piece(&g, m, "model.layers.0.mlp.experts.5.down_proj.weight"), 0, H30,
                (uint64_t)5 * H30 * 96 * 2, 96);
    got_free(&g);
    /* attn=dp lifts tp's head limit: 64 ranks, attention over 8 per group; plain tp=64 is
     * refused (32 heads). attn=tp is the default spelled out. */
    d = par(m, "tp=64,dp=8,attn=dp", RF_DST);
    cr_assert_eq(rf_par_world(&d, RF_DST), 64);
    d = par(m, "tp=4,dp=2,attn=tp", RF_DST);
    cr_assert_eq(d.attn_dp, 0);
    cr_assert_eq(rf_par_world(&d, RF_DST), 8);
    rf_model_free(m);
}

/* DeepSeek-V3 (MLA) under attn=dp, tp=8,dp=4: attention-TP 2. SGLang's DeepseekV2AttentionMLA
 * shards q_b_proj, kv_b_proj and o_proj by attention-TP and replicates fused_qkv_a_proj_with_mqa;
 * dense and shared-expert MLPs stay on full TP. Rank 5 = attention rank 1: heads 64..127. */
Test(model, sglang_dp_attention_mla)
{
    rf_model *m = load("deepseek-v3");
    rf_par d = par(m, "tp=8,dp=4,attn=dp", RF_DST);
    const rf_piece *p;
    got g;

    rank_of(m, &d, RF_DST, 5, &g);
    p = find_piece(&g, m, "model.layers.3.self_attn.q_a_proj.weight");
    expect_rows(p, 0, 1536, 0, 7168);
    cr_assert_eq(g.regions[p->region], (uint64_t)(1536 + 576) * 7168 * 2);
    expect_rows(find_piece(&g, m, "model.layers.3.self_attn.q_b_proj.weight"), 64 * 192,
                64 * 192, 0, 1536);
    expect_rows(find_piece(&g, m, "model.layers.3.self_attn.kv_b_proj.weight"), 64 * 256,
                64 * 256, 0, 512);
    p = find_piece(&g, m, "model.layers.3.self_attn.o_proj.weight");
    cr_assert_eq(p->box.start[1], 64 * 128);
    cr_assert_eq(p->box.extent[1], 64 * 128);
    expect_rows(find_piece(&g, m, "model.layers.0.mlp.gate_proj.weight"), 5 * 2304, 2304, 0,
                7168);
    expect_rows(find_piece(&g, m, "model.layers.3.mlp.shared_experts.up_proj.weight"), 5 * 256,
                256, (uint64_t)256 * 7168 * 2, 7168);
    expect_rows(find_piece(&g, m, "model.embed_tokens.weight"), 0, 129280, 0, 7168);
    got_free(&g);
    rf_model_free(m);
}

/* How often each element of tensor t is held over all ranks of an attn=dp engine: the
 * embedding, norms, routers and replicated projections by every rank; attention shards once
 * per DP group (k and v once more per attention rank sharing a KV head); everything on full
 * TP or in experts once. */
static int dpattn_want(const rf_model *m, const rf_par *p, uint32_t t)
{
    const char *n = rf_model_tensor(m, t)->name;
    int at = p->tp / p->dp;
    int kv = 0;

    if (strstr(n, "self_attn.q_proj") || strstr(n, "self_attn.o_proj") ||
        strstr(n, "self_attn.q_b_proj") || strstr(n, "self_attn.kv_b_proj"))
        return p->dp;
    if (strstr(n, "self_attn.k_proj") || strstr(n, "self_attn.v_proj")) {
        uint32_t k = 0;

        /* KV heads = k_proj rows / q_norm's head_dim */
        cr_assert_eq(rf_model_find(m, "model.layers.0.self_attn.q_norm.weight", &k), 0);
        kv = (int)(rf_model_tensor(m, t)->shape[0] / rf_model_tensor(m, k)->shape[0]);
        return p->dp * (at > kv ? at / kv : 1);
    }
    if (strstr(n, "embed_tokens") || strstr(n, "norm") || strstr(n, "layernorm") ||
        strstr(n, "mlp.gate.") || strstr(n, "q_a_proj") || strstr(n, "kv_a_proj"))
        return p->tp;
    return 1;
}

/* Every element of every tensor, counted over all ranks of shrunk models, is held exactly as
 * often as dpattn_want says: each DP group holds attention once, the world holds the rest once
 * (no gap, no double shard). */
typedef struct dpattn_case {
    const char *model, *layout;
    int shrink;
} dpattn_case;

Test(model, sglang_dp_attention_exact_counts, .timeout = 60)
{
    static const dpattn_case cases[] = {
        {"qwen3-30b-a3b", "tp=8,dp=4,ep=2,attn=dp", 64},
        {"qwen3-30b-a3b", "tp=16,dp=2,attn=dp", 64}, /* attention-TP 8 > 4 KV heads */
        {"qwen3-0.6b", "tp=4,dp=4,attn=dp", 8},      /* tied embedding */
        {"deepseek-v3", "tp=8,dp=2,ep=8,attn=dp", 128},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        rf_model *full = load(cases[i].model), *m = NULL;
        rf_err err = {0};
        rf_par p;
        uint8_t **cnt;
        uint32_t nt;

        cr_assert_eq(rf_model_shrink(full, cases[i].shrink, &m, &err), 0, "%s", err.msg);
        p = par(m, cases[i].layout, RF_DST);
        nt = rf_model_ntensors(m);
        cnt = calloc(nt, sizeof(*cnt));
        for (uint32_t t = 0; t < nt; t++) {
            const rf_tensor *ten = rf_model_tensor(m, t);

            cnt[t] = calloc((size_t)(ten->shape[0] * ten->shape[1]), 1);
            cr_assert_not_null(cnt[t]);
        }
        for (int r = 0; r < rf_par_world(&p, RF_DST); r++) {
            got g;

            rank_of(m, &p, RF_DST, r, &g);
            for (uint32_t k = 0; k < g.npieces; k++) {
                const rf_piece *pc = &g.pieces[k];
                int64_t cols = rf_model_tensor(m, pc->tensor)->shape[1];

                for (int64_t a = 0; a < pc->box.extent[0]; a++)
                    for (int64_t b = 0; b < pc->box.extent[1]; b++)
                        cnt[pc->tensor][(pc->box.start[0] + a) * cols + pc->box.start[1] + b]++;
            }
            got_free(&g);
        }
        for (uint32_t t = 0; t < nt; t++) {
            const rf_tensor *ten = rf_model_tensor(m, t);
            int want = dpattn_want(m, &p, t);

            for (int64_t x = 0; x < ten->shape[0] * ten->shape[1]; x++)
                cr_assert_eq(cnt[t][x], want, "%s %s: element %ld of %s held %d times, not %d",
                             rf_model_name(m), cases[i].layout, (long)x, ten->name, cnt[t][x],
                             want);
            free(cnt[t]);
        }
        free(cnt);
        rf_model_free(m);
        rf_model_free(full);
    }
}

Test(model, row_parallel_and_vocab)
{
    rf_model *m = load("qwen3-0.6b"), *small = NULL;
    rf_par s = par(m, "tp=4,pp=2", RF_SRC), d;
    const rf_piece *p;
    got g;

    rank_of(m, &s, RF_SRC, 2, &g);
    p = find_piece(&g, m, "model.layers.0.self_attn.o_proj.weight");
    cr_assert_eq(p->box.start[1], 1024);
    cr_assert_eq(p->box.extent[1], 512);
    cr_assert_eq(p->box.extent[0], 1024);
    cr_assert_eq(p->strides[0], 512);
    cr_assert_eq(p->strides[1], 1);
    cr_assert_eq(g.regions[p->region], (uint64_t)1024 * 512 * 2);
    p = find_piece(&g, m, "model.layers.0.mlp.down_proj.weight");
    cr_assert_eq(p->box.start[1], 1536);
    cr_assert_eq(p->strides[0], 768);
    /* fc1 = [gate_local; up_local] */
    p = find_piece(&g, m, "model.layers.0.mlp.up_proj.weight");
    expect_rows(p, 1536, 768, (uint64_t)768 * 1024 * 2, 1024);
    /* Megatron pads 151936 to a multiple of 128*4: 152064, 38016 rows a rank. */
    p = find_piece(&g, m, "model.embed_tokens.weight");
    expect_rows(p, 2 * 38016, 38016, 0, 1024);
    cr_assert_eq(g.regions[0], (uint64_t)38016 * 1024 * 2);
    got_free(&g);
    /* Stage 1 (ranks 4..7) holds layers 14..27, the final norm and, tied, its embedding copy. */
    rank_of(m, &s, RF_SRC, 7, &g);
    find_piece(&g, m, "model.layers.14.input_layernorm.weight");
    find_piece(&g, m, "model.norm.weight");
    p = find_piece(&g, m, "model.embed_tokens.weight");
    expect_rows(p, 3 * 38016, 151936 - 3 * 38016, 0, 1024);
    got_free(&g);
    /* vLLM vocab-parallel with torch.chunk: the shrunk vocabulary 2374 over 4 ranks is
     * 594, 594, 594, 592; every region holds 594 rows. */
    cr_assert_eq(rf_model_shrink(m, 64, &small, NULL), 0);
    expect_shape(small, "model.embed_tokens.weight", RF_DT_BF16, 2374, 16);
    d = par(small, "tp=4", RF_DST);
    rank_of(small, &d, RF_DST, 3, &g);
    p = find_piece(&g, small, "model.embed_tokens.weight");
    expect_rows(p, 1782, 592, 0, 16);
    cr_assert_eq(g.regions[p->region], (uint64_t)594 * 16 * 2);
    got_free(&g);
    /* Megatron at TP8 pads 2374 to 3072: rank 7's share (2688..3072) lies wholly in the padding,
     * so it has the region and no piece. */
    s = par(small, "tp=8", RF_SRC);
    rank_of(small, &s, RF_SRC, 7, &g);
    cr_assert_eq(g.regions[0], (uint64_t)384 * 16 * 2);
    cr_assert_neq(g.pieces[0].region, 0);
    got_free(&g);
    rf_model_free(small);
    rf_model_free(m);
}

Test(model, mla_layouts)
{
    rf_model *m = load("deepseek-v3");
    rf_par s = par(m, "tp=8,pp=4,ep=8", RF_SRC), d = par(m, "tp=8", RF_DST);
    const rf_piece *p;
    got g;

    rank_of(m, &d, RF_DST, 5, &g);
    /* fused_qkv_a_proj = [q_a_proj (1536 rows); kv_a_proj_with_mqa (576 rows)] replicated */
    p = find_piece(&g, m, "model.layers.3.self_attn.q_a_proj.weight");
    expect_rows(p, 0, 1536, 0, 7168);
    cr_assert_eq(g.regions[p->region], (uint64_t)(1536 + 576) * 7168 * 2);
    p = find_piece(&g, m, "model.layers.3.self_attn.kv_a_proj_with_mqa.weight");
    expect_rows(p, 0, 576, (uint64_t)1536 * 7168 * 2, 7168);
    p = find_piece(&g, m, "model.layers.3.self_attn.q_b_proj.weight");
    expect_rows(p, 5 * 16 * 192, 16 * 192, 0, 1536);
    p = find_piece(&g, m, "model.layers.3.self_attn.kv_b_proj.weight");
    expect_rows(p, 5 * 16 * 256, 16 * 256, 0, 512);
    p = find_piece(&g, m, "model.layers.3.self_attn.o_proj.weight");
    cr_assert_eq(p->box.start[1], 5 * 2048);
    cr_assert_eq(p->strides[0], 2048);
    p = find_piece(&g, m, "model.layers.3.mlp.shared_experts.up_proj.weight");
    expect_rows(p, 5 * 256, 256, (uint64_t)256 * 7168 * 2, 7168);
    p = find_piece(&g, m, "model.layers.3.mlp.gate.e_score_correction_bias");
    cr_assert_eq(p->box.extent[0], 256);
    cr_assert_eq(g.regions[p->region], 256 * 4);
    got_free(&g);
    /* Trainer: stage 0 (layers 0..15) on ranks 0..7; expert mesh ep8: rank 6 -> experts
     * 192..223; q_a_proj replicated, kv_b_proj column-parallel. */
    rank_of(m, &s, RF_SRC, 6, &g);
    expect_rows(find_piece(&g, m, "model.layers.4.self_attn.q_a_proj.weight"), 0, 1536, 0, 7168);
    expect_rows(find_piece(&g, m, "model.layers.4.self_attn.kv_b_proj.weight"), 6 * 4096, 4096,
                0, 512);
    p = find_piece(&g, m, "model.layers.4.mlp.experts.200.up_proj.weight");
    expect_rows(p, 0, 2048, (uint64_t)2048 * 7168 * 2, 7168);
    cr_assert_eq(g.regions[p->region], (uint64_t)2 * 2048 * 7168 * 2);
    got_free(&g);
    rf_model_free(m);
}

/* Trainer expert mesh with ETP: tp=2, dp=4, ep=4, etp=2 -> within a stage, mesh index
 * m = tp_r + 2*dp_r, etp_r = m % 2, ep_r = (m / 2) % 4. Rank 5 (tp_r 1, dp_r 2): m = 5,
 * etp_r 1, ep_r 2 -> experts 64..95, second half of I. */
Test(model, trainer_expert_mesh_etp)
{
    rf_model *m = load("qwen3-30b-a3b");
    rf_par s = par(m, "tp=2,ep=4,etp=2,dp=4", RF_SRC);
    const rf_piece *p;
    got g;

    rank_of(m, &s, RF_SRC, 5, &g);
    p = find_piece(&g, m, "model.layers.0.mlp.experts.64.gate_proj.weight");
    expect_rows(p, 384, 384, 0, H30);
    p = find_piece(&g, m, "model.layers.0.mlp.experts.95.down_proj.weight");
    cr_assert_eq(p->box.start[1], 384);
    cr_assert_eq(p->strides[0], 384);
    got_free(&g);
    rf_model_free(m);
}

/* ---- layouts: parsing and bad input ------------------------------------------------------ */

Test(model, par_defaults)
{
    rf_model *m = load("deepseek-v3");
    rf_par p = par(m, "pp=16,ep=16", RF_SRC);

    cr_assert_eq(p.tp, 1);
    cr_assert_eq(p.dp, 16);
    cr_assert_eq(rf_par_world(&p, RF_SRC), 256);
    p = par(m, "tp=32,dp=8", RF_DST);
    cr_assert_eq(rf_par_world(&p, RF_DST), 256);
    p = par(m, "", RF_DST);
    cr_assert_eq(p.tp + p.pp + p.ep + p.etp + p.dp, 5);
    rf_model_free(m);
}

typedef struct bad_case {
    char model[32], layout[48];
    int side;
    char msg[128];
} bad_case;

ParameterizedTestParameters(model, bad_layouts)
{
    static bad_case cases[] = {
        {"qwen3-0.6b", "tp=3", RF_DST, "tp=3 does not divide num_attention_heads=16"},
        {"qwen3-0.6b", "tp=3", RF_SRC, "tp=3 does not divide num_attention_heads=16"},
        {"qwen3-30b-a3b", "ep=3", RF_SRC, "ep=3 does not divide the 128 experts"},
        {"qwen3-30b-a3b", "tp=6,ep=3", RF_DST, "does not divide"},
        {"qwen3-0.6b", "foo=2", RF_SRC, "unknown key 'foo' in layout 'foo=2' (known: tp, pp, ep, "
                                        "etp, dp, attn)"},
        {"qwen3-0.6b", "tp=x", RF_SRC, "tp='x' is not a positive integer"},
        {"qwen3-0.6b", "tp=2x", RF_SRC, "is not a positive integer"},
        {"qwen3-0.6b", "tp=0", RF_SRC, "tp='0' is not a positive integer"},
        {"qwen3-0.6b", "tp=-2", RF_SRC, "is not a positive integer"},
        {"qwen3-0.6b", "tp=", RF_SRC, "is not a positive integer"},
        {"qwen3-0.6b", "tp=99999999999999", RF_SRC, "is not a positive integer"},
        {"qwen3-0.6b", "tp=2,tp=4", RF_SRC, "key 'tp' given twice"},
        {"qwen3-0.6b", "tp=2,", RF_SRC, "ends with a comma"},
        {"qwen3-0.6b", "tp=2,,pp=2", RF_SRC, "is not key=value"},
        {"qwen3-0.6b", "tp2", RF_SRC, "is not key=value"},
        {"qwen3-0.6b", "ep=2", RF_SRC, "has no experts"},
        {"qwen3-0.6b", "ep=2", RF_DST, "has no experts"},
        {"qwen3-0.6b", "pp=29", RF_SRC, "pp=29 exceeds the 28 layers"},
        {"qwen3-0.6b", "pp=2", RF_DST, "pp=2 is not supported on the engine side"},
        {"qwen3-30b-a3b", "etp=2", RF_DST, "etp is a trainer key"},
        {"qwen3-30b-a3b", "tp=4,ep=8", RF_DST, "ep=8 must divide tp=4"},
        {"qwen3-30b-a3b", "tp=2,dp=4,ep=4", RF_DST, "ep=4 must divide tp=2 (experts over each "
                                                     "replica's TP group) or equal tp*dp=8"},
        {"qwen3-30b-a3b", "tp=1,dp=8,ep=16", RF_DST, "or equal tp*dp=8 (vLLM expert"},
        {"qwen3-30b-a3b", "tp=2,dp=3,ep=6", RF_DST, "ep=6 does not divide the 128 experts"},
        {"qwen3-30b-a3b", "tp=2,ep=4,dp=1", RF_SRC, "ep*etp=4 must divide tp*dp=2"},
        {"qwen3-30b-a3b", "etp=5", RF_SRC, "does not divide"},
        {"qwen3-4b", "tp=64", RF_SRC, "tp=64 does not divide num_attention_heads=32"},
        {"qwen3-0.6b", "tp=16,dp=100000", RF_DST, "ranks is more than"},
        /* SGLang DP attention (attn=dp) */
        {"qwen3-0.6b", "tp=4,dp=4,attn=dp", RF_SRC, "attn is an engine key"},
        {"qwen3-0.6b", "tp=4,dp=2,attn=xp", RF_DST, "attn='xp' is not tp or dp"},
        {"qwen3-0.6b", "tp=4,attn=", RF_DST, "attn='' is not tp or dp"},
        {"qwen3-0.6b", "tp=4,attn=dp,attn=tp", RF_DST, "key 'attn' given twice"},
        {"qwen3-0.6b", "tp=4,attn=dp,", RF_DST, "ends with a comma"},
        {"qwen3-0.6b", "tp=4,dp=3,attn=dp", RF_DST, "attn=dp needs dp=3 to divide tp=4"},
        {"qwen3-4b", "tp=64,dp=1,attn=dp", RF_DST, "attention-TP tp/dp=64 does not divide "
                                                    "num_attention_heads=32"},
        {"qwen3-30b-a3b", "tp=24,dp=8,attn=dp", RF_DST, "attention-TP tp/dp=3 does not divide "
                                                         "num_attention_heads=32"},
        {"qwen3-30b-a3b", "tp=8,dp=2,ep=16,attn=dp", RF_DST, "ep=16 must divide tp=8 (under "
                                                              "attn=dp"},
    };
    return cr_make_param_array(bad_case, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(bad_case *bc, model, bad_layouts)
{
    rf_model *m = load(bc->model);
    rf_par p;
    rf_err err = {0};

    cr_assert_eq(rf_par_parse(bc->layout, (rf_side)bc->side, m, &p, &err), -EINVAL,
                 "'%s' accepted", bc->layout);
    cr_assert(strstr(err.msg, bc->msg), "'%s': got \"%s\", want \"%s\"", bc->layout, err.msg,
              bc->msg);
    cr_assert_null(strchr(err.msg, '\n'));
    rf_model_free(m);
}

/* ---- JSON specs -------------------------------------------------------------------------- */

static char *write_spec(const char *text)
{
    char *path = strdup("/tmp/rf_model_spec_XXXXXX.json");
    int fd = mkstemps(path, 5);
    FILE *f;

    cr_assert_geq(fd, 0);
    f = fdopen(fd, "w");
    fputs(text, f);
    fclose(f);
    return path;
}

Test(model, json_specs)
{
    static const char *dense = "{\"model_type\": \"qwen3\", \"name\": \"tiny-qwen3\", "
        "\"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 8, "
        "\"num_key_value_heads\": 2, \"head_dim\": 16, \"intermediate_size\": 128, "
        "\"vocab_size\": 1000, \"tie_word_embeddings\": false, \"torch_dtype\": \"float16\"}";
    static const char *moe = "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, "
        "\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 4, "
        "\"moe_intermediate_size\": 32, \"num_experts\": 8, \"vocab_size\": 500}";
    static const char *ds = "{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64, "
        "\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"intermediate_size\": 96, "
        "\"moe_intermediate_size\": 16, \"n_routed_experts\": 8, \"n_shared_experts\": 2, "
        "\"first_k_dense_replace\": 1, \"q_lora_rank\": null, \"kv_lora_rank\": 32, "
        "\"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 8, \"v_head_dim\": 16, "
        "\"vocab_size\": 300, \"torch_dtype\": \"bfloat16\"}";
    char *p1 = write_spec(dense), *p2 = write_spec(moe), *p3 = write_spec(ds);
    rf_model *m;
    rf_err err = {0};
    rf_inv *inv;
    rf_par s, d;

    m = load(p1);
    cr_assert_str_eq(rf_model_name(m), "tiny-qwen3");
    expect_shape(m, "model.layers.1.self_attn.k_proj.weight", RF_DT_FP16, 32, 64);
    expect_shape(m, "lm_head.weight", RF_DT_FP16, 1000, 64);
    rf_model_free(m);

    m = load(p2);
    cr_assert(strncmp(rf_model_name(m), "rf_model_spec_", 14) == 0, "%s", rf_model_name(m));
    expect_shape(m, "model.layers.2.mlp.experts.7.down_proj.weight", RF_DT_BF16, 64, 32);
    expect_shape(m, "model.layers.0.self_attn.q_proj.weight", RF_DT_BF16, 64, 64);
    rf_model_free(m);

    /* DeepSeek without q_lora: q_proj instead of q_a/q_b; shared experts of 2 x 16. */
    m = load(p3);
    expect_shape(m, "model.layers.0.mlp.gate_proj.weight", RF_DT_BF16, 96, 64);
    expect_shape(m, "model.layers.1.self_attn.q_proj.weight", RF_DT_BF16, 4 * 24, 64);
    expect_shape(m, "model.layers.1.mlp.shared_experts.gate_proj.weight", RF_DT_BF16, 32, 64);
    cr_assert_eq(rf_model_find(m, "model.layers.1.self_attn.q_a_proj.weight", &(uint32_t){0}),
                 -ENOENT);
    check_side(m, "tp=2,ep=4,dp=2", RF_SRC);
    check_side(m, "tp=4,ep=2,dp=2", RF_DST);
    s = par(m, "tp=2,ep=4,dp=2", RF_SRC);
    d = par(m, "tp=4,ep=2,dp=2", RF_DST);
    inv = rf_inv_new();
    cr_assert_eq(rf_model_build_inv(m, &s, &d, 4, inv, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
    rf_inv_free(inv);
    rf_model_free(m);
    unlink(p1);
    unlink(p2);
    unlink(p3);
    free(p1);
    free(p2);
    free(p3);
}

typedef struct bad_spec {
    char text[512], msg[96];
} bad_spec;

ParameterizedTestParameters(model, bad_specs)
{
    static bad_spec cases[] = {
        {"{\"model_type\": \"qwen3\", \"hidden_size\": 64", "line 1"},
        {"[1, 2]", "must be a JSON object"},
        {"{\"hidden_size\": 64}", "key 'model_type' is missing"},
        {"{\"model_type\": \"llama\"}", "model_type 'llama' is not supported"},
        {"{\"model_type\": \"qwen3\", \"num_hidden_layers\": 2, \"num_attention_heads\": 8, "
         "\"intermediate_size\": 8, \"vocab_size\": 9}", "key 'hidden_size' is missing"},
        {"{\"model_type\": \"qwen3\", \"hidden_size\": \"64\", \"num_hidden_layers\": 2}",
         "key 'hidden_size' must be an integer"},
        {"{\"model_type\": \"qwen3\", \"hidden_size\": 0}", "key 'hidden_size' must be an integer"},
        {"{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 8, \"num_key_value_heads\": 3, \"intermediate_size\": 8, "
         "\"vocab_size\": 9}", "not a multiple of num_key_value_heads=3"},
        {"{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 8, \"moe_intermediate_size\": 8, \"vocab_size\": 9}",
         "key 'num_experts' is missing"},
        {"{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 8, \"intermediate_size\": 8, \"moe_intermediate_size\": 8, "
         "\"n_routed_experts\": 4, \"kv_lora_rank\": 8, \"qk_nope_head_dim\": 8, "
         "\"qk_rope_head_dim\": 8, \"v_head_dim\": 8, \"vocab_size\": 9, "
         "\"first_k_dense_replace\": 5}", "first_k_dense_replace=5 exceeds"},
        {"{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 8, \"intermediate_size\": 8, \"moe_intermediate_size\": 8, "
         "\"n_routed_experts\": 4, \"qk_nope_head_dim\": 8, \"qk_rope_head_dim\": 8, "
         "\"v_head_dim\": 8, \"vocab_size\": 9}", "key 'kv_lora_rank' is missing"},
        {"{\"model_type\": \"qwen3\", \"torch_dtype\": \"complex32\"}", "key 'torch_dtype'"},
        {"{\"model_type\": \"qwen3\", \"tie_word_embeddings\": 1}", "'tie_word_embeddings' must"},
        {"{\"model_type\": \"qwen3\", \"name\": 5}", "key 'name' must be a string"},
    };
    return cr_make_param_array(bad_spec, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(bad_spec *bs, model, bad_specs)
{
    char *path = write_spec(bs->text);
    rf_model *m = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_model_load(path, &m, &err), -EINVAL, "%s accepted", bs->text);
    cr_assert_null(m);
    cr_assert(strstr(err.msg, bs->msg), "got \"%s\", want \"%s\"", err.msg, bs->msg);
    cr_assert(strstr(err.msg, path), "the message names the file: %s", err.msg);
    unlink(path);
    free(path);
}

Test(model, unknown_model)
{
    rf_model *m = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_model_load("qwen9-1t", &m, &err), -ENOENT);
    cr_assert(strstr(err.msg, "unknown model 'qwen9-1t'"), "%s", err.msg);
}

/* ---- shrink ------------------------------------------------------------------------------ */

Test(model, shrink_keeps_structure)
{
    const char *names[] = {"qwen3-0.6b", "qwen3-30b-a3b", "deepseek-v3"};

    for (size_t i = 0; i < 3; i++) {
        rf_model *m = load(names[i]), *s = NULL;
        rf_err err = {0};

        cr_assert_eq(rf_model_shrink(m, 0, &s, &err), -EINVAL);
        cr_assert_eq(rf_model_shrink(m, 64, &s, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_model_ntensors(s), rf_model_ntensors(m));
        cr_assert_lt(rf_model_bytes(s) * 200, rf_model_bytes(m), "%s/64: %lu bytes", names[i],
                     (unsigned long)rf_model_bytes(s));
        for (uint32_t t = 0; t < rf_model_ntensors(m); t++) {
            const rf_tensor *a = rf_model_tensor(m, t), *b = rf_model_tensor(s, t);

            cr_assert_str_eq(a->name, b->name);
            cr_assert_eq(a->ndim, b->ndim);
            cr_assert_eq(a->dtype, b->dtype);
            for (int d = 0; d < a->ndim; d++)
                cr_assert_leq(b->shape[d], a->shape[d]);
        }
        rf_model_free(m);
        m = s;
        /* Layouts that suit the full model still suit the shrunk one. */
        if (i == 0) {
            check_side(m, "tp=16", RF_SRC);
            check_side(m, "tp=8,dp=2", RF_DST);
        } else if (i == 1) {
            check_side(m, "tp=2,ep=8,etp=2,dp=8", RF_SRC);
            check_side(m, "tp=16,ep=4", RF_DST);
        } else {
            check_side(m, "tp=4,pp=4,ep=16,dp=4", RF_SRC);
            check_side(m, "tp=16", RF_DST);
        }
        rf_model_free(m);
    }
}

/* ---- sinks and inventories --------------------------------------------------------------- */

Test(model, sink_error_stops_generation)
{
    rf_model *m = load("qwen3-0.6b");
    rf_par p = par(m, "tp=2", RF_DST);
    got g = {.fail_after = 10};
    rf_rank_sink sink = {.ctx = &g, .region = got_region, .piece = got_piece};
    rf_err err = {0};

    cr_assert_eq(rf_model_rank(m, &p, RF_DST, 1, &sink, &err), -E2BIG);
    cr_assert(strstr(err.msg, "engine rank 1"), "%s", err.msg);
    cr_assert_eq(g.npieces, 9);
    got_free(&g);
    cr_assert_eq(rf_model_rank(m, &p, RF_DST, 2, &sink, &err), -EINVAL);
    cr_assert(strstr(err.msg, "rank 2 is outside the engine world of 2"), "%s", err.msg);
    rf_model_free(m);
}

Test(model, build_inv_endpoints)
{
    rf_model *m = load("qwen3-0.6b");
    rf_par s = par(m, "tp=2,dp=3", RF_SRC), d = par(m, "tp=4", RF_DST);
    rf_inv *inv = rf_inv_new();
    rf_err err = {0};

    cr_assert_eq(rf_model_build_inv(m, &s, &d, 0, inv, &err), -EINVAL);
    cr_assert(strstr(err.msg, "gpus_per_node"), "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(m, &s, &d, 4, inv, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_nendpoints(inv), 10);
    /* 6 trainer ranks on nodes 0, 1; 4 engine ranks on node 2. */
    cr_assert_eq(rf_inv_endpoint(inv, 0)->node, 0);
    cr_assert_eq(rf_inv_endpoint(inv, 5)->node, 1);
    cr_assert_eq(rf_inv_endpoint(inv, 5)->side, RF_SRC);
    cr_assert_eq(rf_inv_endpoint(inv, 6)->node, 2);
    cr_assert_eq(rf_inv_endpoint(inv, 9)->node, 2);
    cr_assert_eq(rf_inv_endpoint(inv, 9)->side, RF_DST);
    rf_inv_free(inv);
    /* A model whose tensor conflicts with one already in the inventory fails with its name. */
    {
        rf_inv *v = rf_inv_new();
        int64_t shape[1] = {7};

        cr_assert_eq(rf_inv_add_tensor(v, "model.norm.weight", RF_DT_BF16, 1, shape, NULL, NULL),
                     0);
        cr_assert_eq(rf_model_build_inv(m, &s, &d, 4, v, &err), -EINVAL);
        cr_assert(strstr(err.msg, "model.norm.weight"), "%s", err.msg);
        rf_inv_free(v);
    }
    rf_model_free(m);
}
