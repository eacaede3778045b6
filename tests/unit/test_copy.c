/* tests/unit/test_copy.c - host gather/scatter against a naive element loop on random boxes,
 * strides and dtypes, their descriptor checks, and the plan executor's missing-region error. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "copy_ref.h"
#include "layout.h"
#include "plan.h"

static uint64_t rs = 12345;

static uint64_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

static int64_t rndi(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

/* A random piece (box, strides: row-major, permuted and/or padded) and a sub-box inside. */
static uint64_t random_geom(int ndim, rf_piece *p, rf_box *sub)
{
    int order[RF_MAX_DIMS];
    int64_t acc = 1, foot = 0;

    memset(p, 0, sizeof(*p));
    rf_box_full(&p->box, ndim, (int64_t[RF_MAX_DIMS]){1, 1, 1, 1, 1, 1, 1, 1});
    for (int d = 0; d < ndim; d++) {
        p->box.start[d] = rndi(0, 5);
        p->box.extent[d] = rndi(1, ndim > 3 ? 4 : 9);
        order[d] = d;
    }
    for (int d = ndim - 1; d > 0 && rndi(0, 1); d--) {
        int j = (int)rndi(0, d), t = order[d];
        order[d] = order[j];
        order[j] = t;
    }
    for (int d = 0; d < RF_MAX_DIMS; d++)
        p->strides[d] = 1;
    for (int k = ndim - 1; k >= 0; k--) {
        p->strides[order[k]] = acc;
        acc *= p->box.extent[order[k]] + (rndi(0, 3) == 0 ? rndi(1, 3) : 0);
    }
    for (int d = 0; d < ndim; d++)
        foot += (p->box.extent[d] - 1) * p->strides[d];
    *sub = p->box;
    for (int d = 0; d < ndim; d++) {
        int64_t s = rndi(0, p->box.extent[d] - 1);
        sub->start[d] = p->box.start[d] + s;
        sub->extent[d] = rndi(1, p->box.extent[d] - s);
    }
    p->offset = (uint64_t)rndi(0, 3) * 8;
    return (uint64_t)foot + 1;
}

static int next_idx(const rf_box *b, int ndim, int64_t *idx)
{
    for (int d = ndim - 1; d >= 0; d--) {
        if (++idx[d] < b->start[d] + b->extent[d])
            return 1;
        idx[d] = b->start[d];
    }
    return 0;
}

Test(copy, gather_scatter_match_naive_loop)
{
    static const size_t sizes[] = {1, 2, 4, 8};

    for (int iter = 0; iter < 300; iter++) {
        enum { N = 5 };
        rf_piece p[N];
        rf_box sub[N];
        rf_copy_desc d[N];
        uint8_t *mem[N], *back[N], *stage, *naive;
        uint64_t foot[N], off = 0;
        size_t es = sizes[rndi(0, 3)];
        int ndim = (int)rndi(1, RF_MAX_DIMS);
        rf_err err;

        for (int i = 0; i < N; i++) {
            foot[i] = random_geom(ndim, &p[i], &sub[i]) * es + p[i].offset;
            mem[i] = malloc(foot[i]);
            back[i] = calloc(foot[i], 1);
            for (uint64_t b = 0; b < foot[i]; b++)
                mem[i][b] = (uint8_t)rnd();
            rf_copy_desc_set(&d[i], mem[i], &p[i], ndim, es, &sub[i], off);
            off += rf_copy_desc_bytes(&d[i]) + (uint64_t)rndi(0, 2) * es;
        }
        stage = calloc(off, 1);
        naive = calloc(off, 1);
        for (int i = 0; i < N; i++) {
            int64_t idx[RF_MAX_DIMS];
            uint64_t o = d[i].staging_off;
            memcpy(idx, sub[i].start, sizeof(idx));
            do {
                memcpy(naive + o, mem[i] + rf_piece_byte_offset(&p[i], ndim, es, idx), es);
                o += es;
            } while (next_idx(&sub[i], ndim, idx));
            cr_assert_eq(o - d[i].staging_off, rf_copy_desc_bytes(&d[i]));
        }
        cr_assert_eq(rf_copy_gather(d, N, stage, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(stage, naive, off), 0, "gather differs at iteration %d", iter);

        /* Scatter into zeroed memory: exactly the sub-box elements come back, nothing else
         * is touched. */
        for (int i = 0; i < N; i++)
            d[i].base = back[i];
        cr_assert_eq(rf_copy_scatter(d, N, stage, &err), 0, "%s", err.msg);
        for (int i = 0; i < N; i++) {
            uint8_t *expect = calloc(foot[i], 1);
            int64_t idx[RF_MAX_DIMS];
            memcpy(idx, sub[i].start, sizeof(idx));
            do {
                uint64_t b = rf_piece_byte_offset(&p[i], ndim, es, idx);
                memcpy(expect + b, mem[i] + b, es);
            } while (next_idx(&sub[i], ndim, idx));
            cr_assert_eq(memcmp(expect, back[i], foot[i]), 0, "scatter differs at iteration %d",
                         iter);
            free(expect);
            free(mem[i]);
            free(back[i]);
        }
        free(stage);
        free(naive);
    }
}

static void one_desc(rf_copy_desc *d, uint8_t *mem)
{
    rf_piece p;
    rf_box sub;
    int64_t shape[2] = {4, 4};

    memset(&p, 0, sizeof(p));
    rf_box_full(&p.box, 2, shape);
    p.strides[0] = 4;
    p.strides[1] = 1;
    sub = p.box;
    sub.extent[0] = 2;
    rf_copy_desc_set(d, mem, &p, 2, 4, &sub, 0);
}

Test(copy, malformed_descriptors_are_refused)
{
    uint8_t mem[64], stage[64];
    rf_copy_desc d[2];
    rf_err err;

    one_desc(&d[0], mem);
    one_desc(&d[1], mem);
    cr_assert_eq(rf_copy_gather(d, 2, stage, &err), 0);
    cr_assert_eq(rf_copy_desc_bytes(&d[0]), 32);

    d[1].ndim = 0;
    cr_assert_eq(rf_copy_gather(d, 2, stage, &err), -EINVAL);
    cr_assert(strstr(err.msg, "descriptor 1") != NULL, "%s", err.msg);
    one_desc(&d[1], mem);
    d[1].esize = 0;
    cr_assert_eq(rf_copy_scatter(d, 2, stage, &err), -EINVAL);
    one_desc(&d[1], mem);
    d[1].strides[1] = -1;
    cr_assert_eq(rf_copy_gather(d, 2, stage, &err), -EINVAL);
    cr_assert(strstr(err.msg, "negative stride") != NULL, "%s", err.msg);
    one_desc(&d[1], mem);
    d[1].sub.start[0] = 3; /* rows 3..4 of a 4-row piece */
    memset(stage, 0xab, sizeof(stage));
    cr_assert_eq(rf_copy_scatter(d, 2, stage, &err), -EINVAL);
    cr_assert(strstr(err.msg, "[3:5, 0:4]") != NULL, "%s", err.msg);
    cr_assert(strstr(err.msg, "[0:4, 0:4]") != NULL, "%s", err.msg);
    one_desc(&d[1], mem);
    d[1].sub.extent[1] = 0;
    cr_assert_eq(rf_copy_gather(d, 2, stage, &err), -EINVAL);
}

Test(copy, exec_plan_needs_every_region)
{
    rf_inv *inv = rf_inv_new();
    int64_t shape[1] = {16};
    uint32_t t, s, d, rsrc, rdst;
    rf_piece p;
    rf_plan *pl = NULL;
    rf_err err;
    uint8_t src[64], dst[64];
    void *bases[2] = {NULL, NULL};

    cr_assert_eq(rf_inv_add_tensor(inv, "model.norm.weight", RF_DT_FP32, 1, shape, &t, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_SRC, 0, &s, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 1, &d, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, s, 64, &rsrc, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, d, 64, &rdst, &err), 0);
    memset(&p, 0, sizeof(p));
    p.tensor = t;
    p.region = rsrc;
    rf_box_full(&p.box, 1, shape);
    p.strides[0] = 1;
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    p.region = rdst;
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s", err.msg);

    bases[rsrc] = src;
    cr_assert_eq(rf_copy_exec_plan_host(pl, bases, bases, &err), -EINVAL);
    cr_assert(strstr(err.msg, "destination region") != NULL, "%s", err.msg);
    cr_assert(strstr(err.msg, "model.norm.weight") != NULL, "%s", err.msg);
    cr_assert_eq(rf_copy_exec_plan_host(pl, NULL, bases, &err), -EINVAL);
    cr_assert(strstr(err.msg, "source region") != NULL, "%s", err.msg);

    for (int i = 0; i < 64; i++)
        src[i] = (uint8_t)(i * 7 + 1);
    memset(dst, 0, sizeof(dst));
    bases[rdst] = dst;
    cr_assert_eq(rf_copy_exec_plan_host(pl, bases, bases, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(src, dst, 64), 0);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* The direct path: a contiguous transfer above direct_min goes by one memcpy. */
Test(copy, exec_plan_direct)
{
    rf_inv *inv = rf_inv_new();
    int64_t shape[2] = {64, 32};
    uint32_t t, s, d, rsrc, rdst;
    rf_piece p;
    rf_plan *pl = NULL;
    rf_plan_opts o = {.staging_bytes = 1 << 20, .direct_min_bytes = 1024};
    rf_err err;
    static uint8_t src[64 * 32 * 2 + 64], dst[64 * 32 * 2];
    void *bases[2];

    cr_assert_eq(rf_inv_add_tensor(inv, "lm_head.weight", RF_DT_BF16, 2, shape, &t, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_SRC, 0, &s, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 1, &d, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, s, sizeof(src), &rsrc, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, d, sizeof(dst), &rdst, &err), 0);
    memset(&p, 0, sizeof(p));
    p.tensor = t;
    p.region = rsrc;
    p.offset = 64;
    rf_box_full(&p.box, 2, shape);
    p.strides[0] = 32;
    p.strides[1] = 1;
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    p.region = rdst;
    p.offset = 0;
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_nmsgs(pl), 1);
    cr_assert_eq(rf_plan_msg_at(pl, 0)->kind, RF_PLAN_DIRECT);
    for (size_t i = 0; i < sizeof(src); i++)
        src[i] = (uint8_t)(i * 13 + 5);
    bases[rsrc] = src;
    bases[rdst] = dst;
    cr_assert_eq(rf_copy_exec_plan_host(pl, bases, bases, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(src + 64, dst, sizeof(dst)), 0);
    rf_plan_free(pl);
    rf_inv_free(inv);
}
