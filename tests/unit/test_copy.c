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

/* ---- pair copies: piece memory -> piece memory, both strided ---------------------------- */

/* A random piece holding a box of extents ext somewhere inside it (sub), with row-major,
 * permuted and/or padded strides. Returns the bytes its memory needs. */
static uint64_t random_piece_around(int ndim, const int64_t *ext, size_t es, rf_piece *p,
                                    rf_box *sub)
{
    int order[RF_MAX_DIMS];
    int64_t acc = 1, foot = 0;

    memset(p, 0, sizeof(*p));
    rf_box_full(&p->box, ndim, (int64_t[RF_MAX_DIMS]){1, 1, 1, 1, 1, 1, 1, 1});
    *sub = p->box;
    for (int d = 0; d < ndim; d++) {
        int64_t margin = rndi(0, 2);

        p->box.start[d] = rndi(0, 7);
        p->box.extent[d] = ext[d] + margin;
        sub->start[d] = p->box.start[d] + rndi(0, margin);
        sub->extent[d] = ext[d];
        order[d] = d;
    }
    for (int d = ndim - 1; d > 0 && rndi(0, 2) == 0; d--) {
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
    p->offset = (uint64_t)rndi(0, 5) * es + (uint64_t)rndi(0, 1);
    return ((uint64_t)foot + 1) * es + p->offset;
}

static void pack_cb(void *ctx, const uint8_t *p, uint64_t n)
{
    uint8_t **w = ctx;

    memcpy(*w, p, n);
    *w += n;
}

/* Against an element loop: random shapes of 1..8 dims, odd element sizes, padded and permuted
 * strides on each side independently, unaligned offsets; every byte of the destination checked
 * (the box's and the others, which must keep their fill); the same copy cut into random
 * ranges, and each side's packing read through the visitor. */
Test(copy, pairs_match_element_loop)
{
    static const size_t sizes[] = {1, 2, 3, 4, 6, 8, 12, 16};

    for (int iter = 0; iter < 400; iter++) {
        int ndim = (int)rndi(1, RF_MAX_DIMS);
        size_t es = sizes[rndi(0, 7)];
        int64_t ext[RF_MAX_DIMS];
        rf_piece ps, pd;
        rf_box ss, ds;
        rf_copy_pair pr;
        rf_copy_pair_flat f;
        uint64_t fs, fd, bytes;
        uint8_t *src, *dst, *want, *pieces, *pack, *vis, *w;
        int64_t idx[RF_MAX_DIMS];
        rf_err err;

        for (int d = 0; d < ndim; d++)
            ext[d] = rndi(1, ndim > 4 ? 3 : ndim > 2 ? 6 : 40);
        fs = random_piece_around(ndim, ext, es, &ps, &ss);
        fd = random_piece_around(ndim, ext, es, &pd, &ds);
        src = malloc(fs);
        dst = malloc(fd);
        want = malloc(fd);
        pieces = malloc(fd);
        for (uint64_t b = 0; b < fs; b++)
            src[b] = (uint8_t)rnd();
        memset(dst, 0x5a, fd);
        memset(want, 0x5a, fd);
        memset(pieces, 0x5a, fd);
        bytes = (uint64_t)rf_box_numel(&ss, ndim) * es;
        pack = malloc(bytes);
        vis = malloc(bytes);
        memcpy(idx, ss.start, sizeof(idx));
        w = pack;
        do {
            int64_t di[RF_MAX_DIMS];

            for (int d = 0; d < ndim; d++)
                di[d] = ds.start[d] + (idx[d] - ss.start[d]);
            memcpy(want + rf_piece_byte_offset(&pd, ndim, es, di),
                   src + rf_piece_byte_offset(&ps, ndim, es, idx), es);
            memcpy(w, src + rf_piece_byte_offset(&ps, ndim, es, idx), es);
            w += es;
        } while (next_idx(&ss, ndim, idx));

        rf_copy_desc_set(&pr.src, src, &ps, ndim, es, &ss, 0);
        rf_copy_desc_set(&pr.dst, dst, &pd, ndim, es, &ds, 0);
        cr_assert_eq(rf_copy_pairs(&pr, 1, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(dst, want, fd), 0, "pair copy differs at iteration %d (%d dims, "
                     "%zu-byte elements)", iter, ndim, es);

        rf_copy_pair_flatten(&pr, &f);
        cr_assert_eq(f.bytes, bytes);
        cr_assert_eq(f.bytes % f.run, 0);
        pr.dst.base = pieces;
        rf_copy_pair_flatten(&pr, &f);
        for (uint64_t lo = 0; lo < bytes;) {
            uint64_t hi = lo + (uint64_t)rndi(1, (int64_t)bytes / 3 + 1);

            rf_copy_pair_range(&f, lo, hi);
            lo = hi;
        }
        cr_assert_eq(memcmp(pieces, want, fd), 0, "ranged pair copy differs at iteration %d",
                     iter);
        w = vis;
        rf_copy_pair_visit(&f, false, 0, bytes, pack_cb, &w);
        cr_assert_eq(memcmp(vis, pack, bytes), 0, "source packing differs at iteration %d", iter);
        w = vis;
        rf_copy_pair_visit(&f, true, 0, bytes / 2, pack_cb, &w);
        rf_copy_pair_visit(&f, true, bytes / 2, bytes, pack_cb, &w);
        cr_assert_eq(w - vis, (ptrdiff_t)bytes);
        cr_assert_eq(memcmp(vis, pack, bytes), 0, "destination packing differs at iteration %d",
                     iter);
        free(src);
        free(dst);
        free(want);
        free(pieces);
        free(pack);
        free(vis);
    }
}

/* Dims merge only when contiguous on both sides: a box dense in the source but row-padded in
 * the destination keeps its rows as runs. */
Test(copy, pair_merges_only_dims_dense_on_both_sides)
{
    rf_piece ps, pd;
    rf_box b;
    rf_copy_pair pr;
    rf_copy_pair_flat f;
    uint8_t s[4096], d[8192];
    int64_t shape[3] = {4, 8, 16};

    memset(&ps, 0, sizeof(ps));
    rf_box_full(&ps.box, 3, shape);
    ps.strides[0] = 128;
    ps.strides[1] = 16;
    ps.strides[2] = 1;
    pd = ps;
    pd.strides[0] = 256;
    pd.strides[1] = 32; /* each row padded to 32 elements */
    b = ps.box;
    rf_copy_desc_set(&pr.src, s, &ps, 3, 2, &b, 0);
    rf_copy_desc_set(&pr.dst, d, &pd, 3, 2, &b, 0);
    rf_copy_pair_flatten(&pr, &f);
    cr_assert_eq(f.run, 32, "a run is one row of 16 bf16");
    cr_assert_eq(f.n, 1, "rows and planes merge on both sides");
    cr_assert_eq(f.ext[0], 32);
    cr_assert_eq(f.sstr[0], 32);
    cr_assert_eq(f.dstr[0], 64);
    pd = ps;
    rf_copy_desc_set(&pr.dst, d, &pd, 3, 2, &b, 0);
    rf_copy_pair_flatten(&pr, &f);
    cr_assert_eq(f.n, 0);
    cr_assert_eq(f.run, 4 * 8 * 16 * 2, "dense on both sides: one run");
}

Test(copy, malformed_pairs_are_refused)
{
    uint8_t a[64], b[64];
    rf_copy_pair p[2];
    rf_err err;

    for (int i = 0; i < 2; i++) {
        one_desc(&p[i].src, a);
        one_desc(&p[i].dst, b);
    }
    memset(b, 0, sizeof(b));
    cr_assert_eq(rf_copy_pairs(p, 2, &err), 0, "%s", err.msg);
    p[1].src.sub.start[0] = 3;
    memset(b, 0x11, sizeof(b));
    cr_assert_eq(rf_copy_pairs(p, 2, &err), -EINVAL);
    cr_assert(strstr(err.msg, "source side of pair 1") != NULL, "%s", err.msg);
    for (size_t i = 0; i < sizeof(b); i++)
        cr_assert_eq(b[i], 0x11, "nothing is copied when a pair is refused");
    one_desc(&p[1].src, a);
    p[1].dst.strides[0] = -4;
    cr_assert_eq(rf_copy_pairs(p, 2, &err), -EINVAL);
    cr_assert(strstr(err.msg, "destination side of pair 1") != NULL, "%s", err.msg);
    one_desc(&p[1].dst, b);
    p[1].dst.esize = 2;
    cr_assert_eq(rf_copy_pairs(p, 2, &err), -EINVAL);
    cr_assert(strstr(err.msg, "4-byte elements into 2 dims of 2-byte") != NULL, "%s", err.msg);
    one_desc(&p[1].dst, b);
    p[1].dst.sub.extent[0] = 1;
    cr_assert_eq(rf_copy_pairs(p, 2, &err), -EINVAL);
    cr_assert(strstr(err.msg, "another shape (dim 0)") != NULL, "%s", err.msg);
}

/* A range of a box's elements as boxes: in row-major order, exactly the range, few boxes. */
Test(copy, box_span_covers_exactly_the_range)
{
    for (int iter = 0; iter < 2000; iter++) {
        int ndim = (int)rndi(1, RF_MAX_DIMS);
        rf_box b, out[RF_COPY_SPAN_MAX];
        uint64_t numel, lo, hi, next;
        int n;

        rf_box_full(&b, ndim, (int64_t[RF_MAX_DIMS]){1, 1, 1, 1, 1, 1, 1, 1});
        for (int d = 0; d < ndim; d++) {
            b.start[d] = rndi(0, 9);
            b.extent[d] = rndi(1, ndim > 4 ? 3 : 7);
        }
        numel = (uint64_t)rf_box_numel(&b, ndim);
        lo = (uint64_t)rndi(0, (int64_t)numel);
        hi = (uint64_t)rndi((int64_t)lo, (int64_t)numel);
        n = rf_copy_box_span(&b, ndim, lo, hi, out);
        cr_assert_leq(n, 2 * ndim, "%d boxes for %d dims", n, ndim);
        next = lo;
        for (int i = 0; i < n; i++) {
            int64_t idx[RF_MAX_DIMS];

            cr_assert(rf_box_contains(&b, &out[i], ndim));
            memcpy(idx, out[i].start, sizeof(idx));
            do {
                uint64_t lin = 0;

                for (int d = 0; d < ndim; d++)
                    lin = lin * (uint64_t)b.extent[d] + (uint64_t)(idx[d] - b.start[d]);
                cr_assert_eq(lin, next, "iteration %d: element %llu where %llu comes", iter,
                             (unsigned long long)lin, (unsigned long long)next);
                next++;
            } while (next_idx(&out[i], ndim, idx));
        }
        cr_assert_eq(next, hi, "iteration %d: the boxes end at %llu, the range at %llu", iter,
                     (unsigned long long)next, (unsigned long long)hi);
    }
}

/* ---- tiled transposes: every byte where the element walk puts it ------------------------ */

/* A piece of ndim dims holding a box of extents ext at an offset inside it (margins on every
 * dim), its dims laid out in the order ord (outermost first: {0, 1} row-major, {1, 0} the
 * transpose, strides (1, rows)), each dim's span padded by pad[d] elements. */
static uint64_t ordered_piece(int ndim, const int64_t *ext, size_t es, const int *ord,
                              const int64_t *pad, rf_piece *p, rf_box *sub)
{
    int64_t acc = 1, foot = 0;

    memset(p, 0, sizeof(*p));
    rf_box_full(&p->box, ndim, (int64_t[RF_MAX_DIMS]){1, 1, 1, 1, 1, 1, 1, 1});
    *sub = p->box;
    for (int d = 0; d < ndim; d++) {
        int64_t margin = rndi(0, 3);

        p->box.start[d] = rndi(0, 9);
        p->box.extent[d] = ext[d] + margin;
        sub->start[d] = p->box.start[d] + rndi(0, margin);
        sub->extent[d] = ext[d];
    }
    for (int d = 0; d < RF_MAX_DIMS; d++)
        p->strides[d] = 1;
    for (int k = ndim - 1; k >= 0; k--) {
        p->strides[ord[k]] = acc;
        acc *= p->box.extent[ord[k]] + pad[ord[k]];
    }
    for (int d = 0; d < ndim; d++)
        foot += (p->box.extent[d] - 1) * p->strides[d];
    p->offset = (uint64_t)rndi(0, 3) * es + (uint64_t)rndi(0, 1);
    return ((uint64_t)foot + 1) * es + p->offset;
}

/* A random layout of a transposing kind: 2 or 3 dims (a leading batch dim, as experts), the
 * last two swapped on one side or both, sometimes a trailing dim of 2..3 elements held
 * contiguous on both sides (runs of a few elements), sometimes padded rows. */
static void transposing_orders(int ndim, bool trail, int *os, int *od, int64_t *ps, int64_t *pd)
{
    int kind = (int)rndi(0, 3), r = ndim - 1 - (int)trail; /* r: the column dim */

    for (int d = 0; d < ndim; d++) {
        os[d] = od[d] = d;
        ps[d] = rndi(0, 4) == 0 ? rndi(1, 5) : 0;
        pd[d] = rndi(0, 4) == 0 ? rndi(1, 5) : 0;
    }
    /* 0: source transposed, 1: destination, 2: both, 3: the source's batch dim innermost. */
    if (kind == 0 || kind == 2) {
        os[r - 1] = r;
        os[r] = r - 1;
    }
    if (kind == 1 || kind == 2) {
        od[r - 1] = r;
        od[r] = r - 1;
    }
    if (kind == 3) {
        for (int d = 0; d < r; d++)
            os[d] = d + 1;
        os[r] = 0;
        if (rndi(0, 1)) {
            od[r - 1] = r;
            od[r] = r - 1;
        }
    }
}

/* The element walk's result: want gets src's box elements at the destination's places, in
 * row-major order (a later write of a byte wins, as in the walk); pack gets them packed. */
static void element_walk(int ndim, size_t es, const rf_piece *ps, const rf_box *ss,
                         const uint8_t *src, const rf_piece *pd, const rf_box *ds, uint8_t *want,
                         uint8_t *pack)
{
    int64_t idx[RF_MAX_DIMS];

    memcpy(idx, ss->start, sizeof(idx));
    do {
        int64_t di[RF_MAX_DIMS];
        const uint8_t *s = src + rf_piece_byte_offset(ps, ndim, es, idx);

        for (int d = 0; d < ndim; d++)
            di[d] = ds->start[d] + (idx[d] - ss->start[d]);
        if (want)
            memcpy(want + rf_piece_byte_offset(pd, ndim, es, di), s, es);
        if (pack) {
            memcpy(pack, s, es);
            pack += es;
        }
    } while (next_idx(ss, ndim, idx));
}

/* Transposed pairs of 2 and 3 dims, element sizes 1..16 (and 3 and 6, runs with no register
 * transpose), extents that are and are not multiples of a tile, boxes inside larger padded
 * pieces: the pair copy whole and in random ranges, each side read through the visitor in
 * random ranges with buffers from 1 byte up, and the gather and scatter of each side, every
 * byte against the element walk. */
Test(copy, tiled_transposes_match_element_loop)
{
    static const size_t sizes[] = {1, 2, 4, 8, 2, 2, 4, 16, 3, 6};
    int ntiled = 0, iters = 160;

    for (int iter = 0; iter < iters; iter++) {
        bool trail = rndi(0, 4) == 0;
        int ndim = (int)rndi(2, 3) + (int)trail, os[RF_MAX_DIMS], od[RF_MAX_DIMS];
        size_t es = sizes[rndi(0, 9)];
        int64_t ext[RF_MAX_DIMS], pads[RF_MAX_DIMS], padd[RF_MAX_DIMS];
        rf_piece ps, pd;
        rf_box ss, ds;
        rf_copy_pair pr;
        rf_copy_pair_flat f;
        rf_copy_desc gd;
        uint64_t fs, fd, bytes;
        uint8_t *src, *dst, *want, *pack, *vis, *w;
        rf_err err;

        transposing_orders(ndim, trail, os, od, pads, padd);
        for (int d = 0; d < ndim; d++) {
            static const int64_t edges[] = {1, 7, 8, 15, 16, 17, 63, 64, 65, 100, 129, 150};

            ext[d] = rndi(0, 2) ? edges[rndi(0, 11)] : rndi(2, 140);
        }
        if (ndim - (int)trail == 3)
            ext[0] = rndi(1, 3);
        if (trail)
            ext[ndim - 1] = rndi(2, 3);
        fs = ordered_piece(ndim, ext, es, os, pads, &ps, &ss);
        fd = ordered_piece(ndim, ext, es, od, padd, &pd, &ds);
        src = malloc(fs);
        dst = malloc(fd);
        want = malloc(fd);
        for (uint64_t b = 0; b < fs; b++)
            src[b] = (uint8_t)rnd();
        memset(dst, 0x5a, fd);
        memset(want, 0x5a, fd);
        bytes = (uint64_t)rf_box_numel(&ss, ndim) * es;
        pack = malloc(bytes);
        vis = malloc(bytes);
        element_walk(ndim, es, &ps, &ss, src, &pd, &ds, want, pack);

        rf_copy_desc_set(&pr.src, src, &ps, ndim, es, &ss, 0);
        rf_copy_desc_set(&pr.dst, dst, &pd, ndim, es, &ds, 0);
        rf_copy_pair_flatten(&pr, &f);
        ntiled += rf_copy__pair_tiled(&f);
        cr_assert_eq(rf_copy_pairs(&pr, 1, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(dst, want, fd), 0, "iteration %d: the pair copy differs (%d dims, "
                     "%zu-byte elements, tiled %d)", iter, ndim, es, rf_copy__pair_tiled(&f));

        /* Random ranges, some cut inside an element, some rows long, in a random order of
         * ranges: each range copies exactly its bytes. */
        memset(dst, 0x5a, fd);
        for (uint64_t lo = 0; lo < bytes;) {
            uint64_t hi = lo + (uint64_t)(rndi(0, 1) ? rndi(1, 3 * (int64_t)es)
                                                      : rndi(1, (int64_t)bytes / 2 + 1));

            rf_copy_pair_range(&f, lo, hi);
            lo = hi;
        }
        cr_assert_eq(memcmp(dst, want, fd), 0, "iteration %d: the ranged pair copy differs",
                     iter);
        for (int side = 0; side < 2; side++) {
            uint64_t cap = rndi(0, 1) ? (uint64_t)rndi(1, 4 * (int64_t)es)
                                      : (uint64_t)rndi(1, (int64_t)bytes);
            uint8_t *buf = malloc(cap);

            w = vis;
            rf_copy_pair_visit(&f, side, 0, bytes, pack_cb, &w);
            cr_assert_eq(memcmp(vis, pack, bytes), 0, "iteration %d: side %d read differs",
                         iter, side);
            w = vis;
            for (uint64_t lo = 0; lo < bytes;) {
                uint64_t hi = lo + (uint64_t)rndi(1, (int64_t)bytes / 3 + 1);

                rf_copy__pair_visit_buf(&f, side, lo, hi, pack_cb, &w, buf, cap);
                lo = hi;
            }
            cr_assert_eq(w - vis, (ptrdiff_t)bytes);
            cr_assert_eq(memcmp(vis, pack, bytes), 0, "iteration %d: side %d read through a "
                         "%llu-byte buffer differs", iter, side, (unsigned long long)cap);
            free(buf);
        }

        /* Gather each side into staging and scatter it back into a cleared copy. */
        for (int side = 0; side < 2; side++) {
            const rf_piece *p = side ? &pd : &ps;
            const rf_box *b = side ? &ds : &ss;
            uint8_t *mem = side ? want : src, *back;
            uint64_t foot = side ? fd : fs;

            rf_copy_desc_set(&gd, mem, p, ndim, es, b, 0);
            memset(vis, 0, bytes);
            cr_assert_eq(rf_copy_gather(&gd, 1, vis, &err), 0, "%s", err.msg);
            cr_assert_eq(memcmp(vis, pack, bytes), 0, "iteration %d: gather of side %d "
                         "differs", iter, side);
            back = malloc(foot);
            memset(back, 0x33, foot);
            gd.base = back;
            cr_assert_eq(rf_copy_scatter(&gd, 1, vis, &err), 0, "%s", err.msg);
            /* The box's bytes are the memory's, every other keeps its fill. */
            {
                uint8_t *exp = malloc(foot);
                int64_t idx[RF_MAX_DIMS];

                memset(exp, 0x33, foot);
                memcpy(idx, b->start, sizeof(idx));
                do {
                    uint64_t o = rf_piece_byte_offset(p, ndim, es, idx);

                    memcpy(exp + o, mem + o, es);
                } while (next_idx(b, ndim, idx));
                cr_assert_eq(memcmp(back, exp, foot), 0, "iteration %d: scatter of side %d "
                             "differs", iter, side);
                free(exp);
            }
            free(back);
        }
        free(src);
        free(dst);
        free(want);
        free(pack);
        free(vis);
    }
    cr_assert_gt(ntiled, iters / 2, "only %d of %d layouts went through tiles", ntiled, iters);
}

/* A destination whose elements share bytes (strides (1, 2) on 9 x 12): tiles would change
 * which write lands last, so the copy keeps the element walk's order. */
Test(copy, aliased_destination_keeps_the_walk_order)
{
    enum { R = 9, C = 12, ES = 2 };
    uint8_t src[R * C * ES], dst[(R + 2 * C) * ES], want[(R + 2 * C) * ES];
    int64_t shape[2] = {R, C};
    rf_piece ps, pd;
    rf_box b;
    rf_copy_pair pr;
    rf_copy_pair_flat f;
    rf_err err;

    memset(&ps, 0, sizeof(ps));
    rf_box_full(&ps.box, 2, shape);
    ps.strides[0] = C;
    ps.strides[1] = 1;
    pd = ps;
    pd.strides[0] = 1;
    pd.strides[1] = 2;
    b = ps.box;
    for (size_t i = 0; i < sizeof(src); i++)
        src[i] = (uint8_t)rnd();
    memset(dst, 0, sizeof(dst));
    memset(want, 0, sizeof(want));
    element_walk(2, ES, &ps, &b, src, &pd, &b, want, NULL);
    rf_copy_desc_set(&pr.src, src, &ps, 2, ES, &b, 0);
    rf_copy_desc_set(&pr.dst, dst, &pd, 2, ES, &b, 0);
    rf_copy_pair_flatten(&pr, &f);
    cr_assert(!rf_copy__pair_tiled(&f));
    cr_assert_eq(rf_copy_pairs(&pr, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(dst, want, sizeof(dst)), 0);
    pd.strides[1] = R; /* the same layout without sharing: tiled */
    rf_copy_desc_set(&pr.dst, dst, &pd, 2, ES, &b, 0);
    rf_copy_pair_flatten(&pr, &f);
    cr_assert(rf_copy__pair_tiled(&f));
}
