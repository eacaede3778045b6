/* tests/unit/test_copy_cuda.c - the GPU gather/scatter kernels against the host copy on
 * random boxes, strides, element sizes and unaligned offsets. Skipped without a CUDA device. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy.h"
#include "copy_cuda.h"
#include "drv_cuda.h"

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

#else

Test(copy_cuda, skipped)
{
    cr_skip_test("no CUDA device (built without CUDA)");
}

#endif
