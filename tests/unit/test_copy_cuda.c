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

#else

Test(copy_cuda, skipped)
{
    cr_skip_test("no CUDA device (built without CUDA)");
}

#endif
