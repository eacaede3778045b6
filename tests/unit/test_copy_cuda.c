/* tests/unit/test_copy_cuda.c - the GPU gather/scatter kernels and the pair kernel against the
 * host copy on random boxes, strides, element sizes and unaligned offsets, and the tile kernel on
 * boxes held transposed. Skipped without a CUDA device. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy.h"
#include "copy_cuda.h"
#include "copy_tile.h"
#include "drv_cuda.h"
#include "tile_shapes.h"

#define REGION (4u << 20)
#define NDESC 48

static void need_gpu(void)
{
    if (!rf_cuda_available())
        cr_skip_test("no CUDA device");
}

static uint64_t rng = 88172645463325252ULL;

static uint64_t rnd(uint64_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return n ? rng % n : 0;
}

/* A random piece inside a region of REGION bytes and a sub-box of it: padded strides over
 * a random order of the dims, so elements never overlap (scatter is well defined). */
static void random_desc(rf_copy_desc *d, uint8_t *base, uint64_t *stage_off, int ndim,
                        uint32_t es, bool big)
{
    int order[RF_MAX_DIMS];
    int64_t s = 1, span = 0;

    memset(d, 0, sizeof(*d));
    d->base = base;
    d->esize = es;
    d->ndim = (uint32_t)ndim;
    for (int k = 0; k < RF_MAX_DIMS; k++) {
        d->piece.extent[k] = 1;
        d->sub.extent[k] = 1;
    }
    for (int k = 0; k < ndim; k++) {
        int64_t cap = big ? (ndim == 1 ? 200000 : 400) : (ndim <= 2 ? 40 : ndim <= 4 ? 7 : 3);

        d->piece.start[k] = (int64_t)rnd(100);
        d->piece.extent[k] = 1 + (int64_t)rnd((uint64_t)cap);
        d->sub.extent[k] = 1 + (int64_t)rnd((uint64_t)d->piece.extent[k]);
        d->sub.start[k] = d->piece.start[k] +
                          (int64_t)rnd((uint64_t)(d->piece.extent[k] - d->sub.extent[k] + 1));
        order[k] = k;
    }
    /* Mostly row-major (merging applies), sometimes permuted. */
    if (rnd(3) == 0)
        for (int k = ndim - 1; k > 0; k--) {
            int j = (int)rnd((uint64_t)k + 1), t = order[k];
            order[k] = order[j];
            order[j] = t;
        }
    for (int k = ndim - 1; k >= 0; k--) {
        int dim = order[k];

        d->strides[dim] = s;
        s *= d->piece.extent[dim] + (rnd(3) == 0 ? (int64_t)rnd(3) : 0);
    }
    span = s * es;
    d->offset = rnd((uint64_t)(REGION - span > 0 ? REGION - span : 1));
    d->staging_off = *stage_off + rnd(9);
    *stage_off = d->staging_off + rf_copy_desc_bytes(d);
}

/* One batch both ways on both implementations, compared byte for byte. */
static void round_trip(rf_copy_cuda_buf *buf, int ndim_max, uint32_t es_fixed, bool big)
{
    uint8_t *hreg = malloc(REGION), *hstage, *gstage, *hreg2 = malloc(REGION);
    uint8_t *dreg = NULL, *dstage = NULL;
    rf_copy_desc hd[NDESC], dd[NDESC];
    uint64_t stage = rnd(16);
    size_t n = big ? 2 : NDESC;
    rf_err err = {0};

    cr_assert(hreg && hreg2);
    for (size_t i = 0; i < REGION; i++)
        hreg[i] = (uint8_t)rnd(256);
    cr_assert_eq(cudaMalloc((void **)&dreg, REGION), cudaSuccess);
    cr_assert_eq(cudaMemcpy(dreg, hreg, REGION, cudaMemcpyHostToDevice), cudaSuccess);
    /* Descriptors of one batch write disjoint memory only when scattering: give each its own
     * region slice by keeping batches of one descriptor per check below. */
    for (size_t i = 0; i < n; i++) {
        static const uint32_t sizes[] = {1, 2, 4, 8};
        int ndim = 1 + (int)rnd((uint64_t)ndim_max);

        random_desc(&hd[i], hreg, &stage, ndim, es_fixed ? es_fixed : sizes[rnd(4)], big);
        dd[i] = hd[i];
        dd[i].base = dreg;
    }
    hstage = malloc(stage + 1);
    gstage = malloc(stage + 1);
    cr_assert(hstage && gstage);
    memset(hstage, 0, stage + 1);
    cr_assert_eq(cudaMalloc((void **)&dstage, stage + 1), cudaSuccess);
    cr_assert_eq(cudaMemset(dstage, 0, stage + 1), cudaSuccess);
    cr_assert_eq(rf_copy_gather(hd, n, hstage, &err), 0, "%s", err.msg);
    if (buf)
        cr_assert_eq(rf_copy_cuda_gather_buf(buf, dd, n, dstage, 0, &err), 0, "%s", err.msg);
    else
        cr_assert_eq(rf_copy_cuda_gather(dd, n, dstage, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(cudaMemcpy(gstage, dstage, stage + 1, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert(memcmp(hstage, gstage, stage + 1) == 0, "gather differs from the host copy");

    /* Scatter, one descriptor at a time (pieces of a batch may overlap in this region). */
    for (size_t i = 0; i < stage + 1; i++)
        hstage[i] = (uint8_t)rnd(256);
    cr_assert_eq(cudaMemcpy(dstage, hstage, stage + 1, cudaMemcpyHostToDevice), cudaSuccess);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(rf_copy_scatter(&hd[i], 1, hstage, &err), 0, "%s", err.msg);
        if (buf)
            cr_assert_eq(rf_copy_cuda_scatter_buf(buf, &dd[i], 1, dstage, 0, &err), 0, "%s",
                         err.msg);
        else
            cr_assert_eq(rf_copy_cuda_scatter(&dd[i], 1, dstage, 0, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(cudaMemcpy(hreg2, dreg, REGION, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert(memcmp(hreg, hreg2, REGION) == 0, "scatter differs from the host copy");
    cudaFree(dreg);
    cudaFree(dstage);
    free(hreg);
    free(hreg2);
    free(hstage);
    free(gstage);
}

Test(copy_cuda, random_boxes_all_dims_and_sizes, .init = need_gpu)
{
    rf_copy_cuda_buf *buf = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_copy_cuda_buf_new(&buf, &err), 0, "%s", err.msg);
    for (int ndim = 1; ndim <= RF_MAX_DIMS; ndim++)
        for (uint32_t es = 1; es <= 8; es *= 2)
            round_trip(buf, ndim, es, false);
    for (int i = 0; i < 6; i++)
        round_trip(buf, RF_MAX_DIMS, 0, false);
    rf_copy_cuda_buf_free(buf);
}

Test(copy_cuda, large_runs_and_thread_buffer, .init = need_gpu)
{
    for (int i = 0; i < 4; i++)
        round_trip(NULL, 1 + i % 2, 0, true);
    for (int i = 0; i < 4; i++)
        round_trip(NULL, 3, 0, false);
    rf_copy_cuda_thread_release();
}

Test(copy_cuda, malformed_descriptor_enqueues_nothing, .init = need_gpu)
{
    uint8_t *dreg = NULL;
    rf_copy_desc d[2];
    uint64_t stage = 0;
    rf_err err = {0};

    cr_assert_eq(cudaMalloc((void **)&dreg, REGION), cudaSuccess);
    random_desc(&d[0], dreg, &stage, 2, 4, false);
    d[1] = d[0];
    d[1].sub.start[0] = d[1].piece.start[0] + d[1].piece.extent[0];
    cr_assert_eq(rf_copy_cuda_gather(d, 2, dreg, 0, &err), -EINVAL);
    cr_assert(strstr(err.msg, "descriptor 1 box"), "%s", err.msg);
    d[1] = d[0];
    d[1].strides[1] = -1;
    cr_assert_eq(rf_copy_cuda_scatter(d, 2, dreg, 0, &err), -EINVAL);
    cr_assert(strstr(err.msg, "negative stride"), "%s", err.msg);
    d[1].esize = 0;
    cr_assert_eq(rf_copy_cuda_gather(d, 2, dreg, 0, &err), -EINVAL);
    cr_assert_eq(rf_copy_cuda_gather(d, 0, dreg, 0, &err), 0, "an empty batch is no error");
    cudaFree(dreg);
    rf_copy_cuda_thread_release();
}

/* ---- pairs ---------------------------------------------------------------------------------- */

/* A destination descriptor for the box of s: a piece of its own around a box of the same
 * extents, padded and permuted strides, anywhere in a region of REGION bytes. */
static void random_dst(const rf_copy_desc *s, uint8_t *base, rf_copy_desc *d)
{
    int order[RF_MAX_DIMS];
    int64_t st = 1;

    *d = *s;
    d->base = base;
    for (uint32_t k = 0; k < s->ndim; k++) {
        int64_t margin = (int64_t)rnd(3);

        d->piece.start[k] = (int64_t)rnd(50);
        d->piece.extent[k] = s->sub.extent[k] + margin;
        d->sub.start[k] = d->piece.start[k] + (int64_t)rnd((uint64_t)margin + 1);
        order[k] = (int)k;
    }
    if (rnd(3) == 0)
        for (int k = (int)s->ndim - 1; k > 0; k--) {
            int j = (int)rnd((uint64_t)k + 1), t = order[k];
            order[k] = order[j];
            order[j] = t;
        }
    for (int k = (int)s->ndim - 1; k >= 0; k--) {
        d->strides[order[k]] = st;
        st *= d->piece.extent[order[k]] + (rnd(3) == 0 ? (int64_t)rnd(3) : 0);
    }
    d->offset = rnd((uint64_t)(REGION - st * s->esize > 0 ? REGION - st * s->esize : 1));
}

/* The pair kernel against the host pair copy: random boxes of 1..8 dims, element sizes of 1 to
 * 16 bytes, unaligned offsets, strides differing between the two sides; one-shot launches and a
 * kept plan launched one pair at a time (a run of a kept array), each compared over the whole
 * destination region. */
Test(copy_cuda, pairs_match_the_host_copy, .init = need_gpu)
{
    static const uint32_t sizes[] = {1, 2, 3, 4, 6, 8, 16};
    uint8_t *hs = malloc(REGION), *hd = malloc(REGION), *back = malloc(REGION);
    uint8_t *ds = NULL, *dd = NULL;
    rf_copy_pair hp[NDESC], dp[NDESC];
    rf_copy_cuda_plan *pl = NULL;
    rf_err err = {0};

    cr_assert(hs && hd && back);
    for (size_t i = 0; i < REGION; i++) {
        hs[i] = (uint8_t)rnd(256);
        hd[i] = (uint8_t)rnd(256);
    }
    cr_assert_eq(cudaMalloc((void **)&ds, REGION), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&dd, REGION), cudaSuccess);
    cr_assert_eq(cudaMemcpy(ds, hs, REGION, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(cudaMemcpy(dd, hd, REGION, cudaMemcpyHostToDevice), cudaSuccess);
    for (size_t i = 0; i < NDESC; i++) {
        uint64_t stage = 0;
        int ndim = 1 + (int)rnd(RF_MAX_DIMS);

        random_desc(&hp[i].src, hs, &stage, ndim, sizes[rnd(7)], ndim <= 2 && i % 4 == 0);
        random_dst(&hp[i].src, hd, &hp[i].dst);
        dp[i] = hp[i];
        dp[i].src.base = ds;
        dp[i].dst.base = dd;
    }
    /* One pair per launch: pairs of this batch may write overlapping bytes. */
    for (size_t i = 0; i < NDESC / 2; i++) {
        cr_assert_eq(rf_copy_pairs(&hp[i], 1, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_copy_cuda_pairs(&dp[i], 1, 0, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(rf_copy_cuda_plan_new(dp, NDESC, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_plan_bytes(pl) > 0, true);
    for (size_t i = NDESC / 2; i < NDESC; i++) {
        cr_assert_eq(rf_copy_pairs(&hp[i], 1, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_copy_cuda_plan_launch(pl, i, 1, 0, 0, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(cudaMemcpy(back, dd, REGION, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert(memcmp(back, hd, REGION) == 0, "pair kernel differs from the host pair copy");
    cr_assert_eq(rf_copy_cuda_plan_launch(pl, NDESC, 1, 0, 0, &err), -EINVAL);
    cr_assert_eq(rf_copy_cuda_plan_launch(pl, 3, 0, 0, 0, &err), 0, "an empty run is no error");
    rf_copy_cuda_plan_free(pl);
    /* A malformed pair: nothing enqueued, the pair named. */
    dp[1].dst.sub.extent[0] += 1;
    cr_assert_eq(rf_copy_cuda_pairs(dp, 2, 0, &err), -EINVAL);
    cr_assert(strstr(err.msg, "pair 1") != NULL, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_plan_new(dp, 2, &pl, &err), -EINVAL);
    cr_assert_null(pl);
    cudaFree(ds);
    cudaFree(dd);
    free(hs);
    free(hd);
    free(back);
    rf_copy_cuda_thread_release();
}

/* ---- tiles: boxes held transposed on one side ---------------------------------------------- */

/* Layouts of one box on both sides (dims outermost first, the last contiguous): transposed on
 * either side or both, per-expert, units of 1 to 16 bytes, extents that are no multiple of a
 * tile, boxes off their piece's origin (margin), padded rows; a few that stay element-wise. */
typedef struct tshape {
    uint32_t es;
    int ndim;
    int64_t ext[4];
    int src_ord[4], dst_ord[4];
    int64_t margin, pad;
} tshape;

static const tshape tshapes[] = {
    {2, 2, {67, 131}, {1, 0}, {0, 1}, 1, 0},
    {2, 2, {131, 67}, {0, 1}, {1, 0}, 2, 3},
    {4, 2, {64, 64}, {1, 0}, {0, 1}, 0, 0},
    {4, 2, {65, 129}, {1, 0}, {1, 0}, 1, 1},          /* transposed alike: the run reordered */
    {1, 2, {130, 70}, {1, 0}, {0, 1}, 1, 5},
    {1, 2, {70, 200}, {0, 1}, {1, 0}, 0, 0},
    {8, 2, {40, 33}, {1, 0}, {0, 1}, 1, 0},
    {16, 2, {33, 70}, {1, 0}, {0, 1}, 1, 0},
    {2, 3, {5, 70, 33}, {0, 2, 1}, {0, 1, 2}, 1, 0},  /* experts each transposed */
    {4, 3, {12, 40, 90}, {2, 1, 0}, {0, 1, 2}, 1, 1},
    {2, 3, {9, 100, 17}, {1, 2, 0}, {0, 2, 1}, 0, 0}, /* transposed differently on each side */
    {2, 3, {50, 60, 2}, {1, 0, 2}, {0, 1, 2}, 0, 0},  /* a unit of two elements */
    {2, 4, {1, 70, 1, 90}, {0, 3, 2, 1}, {0, 1, 2, 3}, 1, 0},
    {2, 2, {1000, 300}, {1, 0}, {0, 1}, 3, 7},        /* many tiles */
    {2, 2, {50, 70}, {0, 1}, {0, 1}, 1, 0},           /* row-major: element-wise */
    {3, 2, {40, 50}, {1, 0}, {0, 1}, 1, 0},           /* 3-byte units: element-wise */
};
#define NTS (sizeof(tshapes) / sizeof(tshapes[0]))

/* Where the k-th box of a batch starts in its region: 256-aligned, then shifted by a few
 * elements; box 4's source side (transposed) by one byte more, off its elements' alignment:
 * element-wise. */
static uint64_t tshift(size_t k, const tshape *t, bool src)
{
    return (k % 4) * t->es + (src && k == 4);
}

static uint8_t *dev_copy(const uint8_t *h, size_t n)
{
    uint8_t *d = NULL;

    cr_assert_eq(cudaMalloc((void **)&d, n), cudaSuccess);
    cr_assert_eq(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

static void expect_same(const uint8_t *host, const uint8_t *dev, size_t n, const char *what)
{
    uint8_t *back = malloc(n);
    size_t i;

    cr_assert(back);
    cr_assert_eq(cudaMemcpy(back, dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
    for (i = 0; i < n && back[i] == host[i]; i++)
        ;
    cr_assert_eq(i, n, "%s: byte %zu of %zu is %u on the GPU, %u on the host", what, i, n,
                 back[i], host[i]);
    free(back);
}

/* Every shape in both of its layouts as gather and scatter descriptors of one batch (each its
 * own memory), on the GPU and on the host, compared byte for byte; max_blocks 3 makes each block
 * walk many descriptors. */
static void tiled_gather_scatter(unsigned max_blocks)
{
    enum { N = 2 * NTS };
    rf_copy_desc hd[N], dd[N];
    uint64_t reg = 0, stage = 0;
    uint8_t *hreg, *hst, *dreg, *dst;
    rf_copy_cuda_buf *buf = NULL;
    int tiled = 0;
    rf_err err = {0};

    for (size_t i = 0; i < N; i++) {
        const tshape *t = &tshapes[i / 2];
        rf_copy_flat fl;
        rf_copy_pair_flat pf;
        rf_copy_tile tl;

        reg += tshift(i, t, true);
        reg += tile_side(&hd[i], NULL, reg, t->es, t->ndim, t->ext,
                         i % 2 ? t->dst_ord : t->src_ord, t->margin, t->pad);
        reg = (reg + 255) & ~255ull;
        hd[i].staging_off = stage + (i == 3 ? 2 : 0);
        stage = (hd[i].staging_off + rf_copy_desc_bytes(&hd[i]) + 15) & ~15ull;
        rf_copy_flatten(&hd[i], &fl);
        rf_copy_tile_desc_flat(&hd[i], &fl, NULL, true, &pf);
        tiled += rf_copy_tile_choose(&pf, &tl);
    }
    cr_assert(tiled >= 14 && tiled <= N - 4, "%d of %d descriptors tiled", tiled, (int)N);
    hreg = malloc(reg);
    hst = malloc(stage);
    cr_assert(hreg && hst);
    for (size_t i = 0; i < reg; i++)
        hreg[i] = (uint8_t)rnd(256);
    memset(hst, 0, stage);
    dreg = dev_copy(hreg, reg);
    dst = dev_copy(hst, stage);
    for (size_t i = 0; i < N; i++) {
        hd[i].base = hreg;
        dd[i] = hd[i];
        dd[i].base = dreg;
    }
    cr_assert_eq(rf_copy_cuda_buf_new(&buf, &err), 0, "%s", err.msg);
    rf_copy_cuda_buf_set_blocks(buf, max_blocks);
    cr_assert_eq(rf_copy_gather(hd, N, hst, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_gather_buf(buf, dd, N, dst, 0, &err), 0, "%s", err.msg);
    expect_same(hst, dst, stage, "tiled gather");
    for (size_t i = 0; i < stage; i++)
        hst[i] = (uint8_t)rnd(256);
    cr_assert_eq(cudaMemcpy(dst, hst, stage, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(rf_copy_scatter(hd, N, hst, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_scatter_buf(buf, dd, N, dst, 0, &err), 0, "%s", err.msg);
    expect_same(hreg, dreg, reg, "tiled scatter");
    rf_copy_cuda_buf_free(buf);
    cudaFree(dreg);
    cudaFree(dst);
    free(hreg);
    free(hst);
}

Test(copy_cuda, tiled_gathers_and_scatters_match_the_host_copy, .init = need_gpu)
{
    tiled_gather_scatter(0);
    tiled_gather_scatter(3);
}

/* Every shape as a pair (source layout -> destination layout) and reversed, in one batch and
 * through a kept plan launched in parts (max_blocks 0 and 3 in turn), against the host pair
 * copy over the whole destination region. */
Test(copy_cuda, tiled_pairs_and_plans_match_the_host_copy, .init = need_gpu)
{
    enum { N = 2 * NTS };
    static const size_t cuts[] = {0, 1, 7, N - 2, N};
    rf_copy_pair hp[N], dp[N];
    uint64_t sreg = 0, dreg = 0;
    uint8_t *hs, *hd, *ds, *dd;
    rf_copy_cuda_buf *buf = NULL;
    rf_copy_cuda_plan *pl = NULL;
    int tiled = 0;
    rf_err err = {0};

    for (size_t i = 0; i < N; i++) {
        const tshape *t = &tshapes[i / 2];
        const int *so = i % 2 ? t->dst_ord : t->src_ord, *dso = i % 2 ? t->src_ord : t->dst_ord;
        rf_copy_pair_flat f;
        rf_copy_tile tl;

        sreg += tshift(i, t, true);
        sreg += tile_side(&hp[i].src, NULL, sreg, t->es, t->ndim, t->ext, so, t->margin, t->pad);
        sreg = (sreg + 255) & ~255ull;
        dreg += tshift(i + 1, t, false);
        dreg += tile_side(&hp[i].dst, NULL, dreg, t->es, t->ndim, t->ext, dso, 2 - t->margin % 3,
                          0);
        dreg = (dreg + 255) & ~255ull;
        rf_copy_pair_flatten(&hp[i], &f);
        rf_copy_tile_reorder(&f);
        tiled += rf_copy_tile_choose(&f, &tl);
    }
    cr_assert(tiled >= 14 && tiled <= N - 4, "%d of %d pairs tiled", tiled, (int)N);
    hs = malloc(sreg);
    hd = malloc(dreg);
    cr_assert(hs && hd);
    for (size_t i = 0; i < sreg; i++)
        hs[i] = (uint8_t)rnd(256);
    for (size_t i = 0; i < dreg; i++)
        hd[i] = (uint8_t)rnd(256);
    ds = dev_copy(hs, sreg);
    dd = dev_copy(hd, dreg);
    for (size_t i = 0; i < N; i++) {
        hp[i].src.base = hs;
        hp[i].dst.base = hd;
        dp[i] = hp[i];
        dp[i].src.base = ds;
        dp[i].dst.base = dd;
    }
    cr_assert_eq(rf_copy_pairs(hp, N, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_buf_new(&buf, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_pairs_buf(buf, dp, N, 0, &err), 0, "%s", err.msg);
    expect_same(hd, dd, dreg, "tiled pairs in one batch");
    rf_copy_cuda_buf_free(buf);

    /* The plan, over destination bytes made new on both. */
    for (size_t i = 0; i < dreg; i++)
        hd[i] = (uint8_t)rnd(256);
    cr_assert_eq(cudaMemcpy(dd, hd, dreg, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(rf_copy_pairs(hp, N, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_plan_new(dp, N, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_copy_cuda_plan_bytes(pl) > 0, true);
    for (size_t c = 0; c + 1 < sizeof(cuts) / sizeof(cuts[0]); c++)
        cr_assert_eq(rf_copy_cuda_plan_launch(pl, cuts[c], cuts[c + 1] - cuts[c], 0,
                                              c % 2 ? 3 : 0, &err), 0, "%s", err.msg);
    expect_same(hd, dd, dreg, "tiled pairs of a plan launched in parts");
    rf_copy_cuda_plan_free(pl);
    cudaFree(ds);
    cudaFree(dd);
    free(hs);
    free(hd);
}

#else

Test(copy_cuda, skipped)
{
    cr_skip_test("no CUDA device (built without CUDA)");
}

#endif
