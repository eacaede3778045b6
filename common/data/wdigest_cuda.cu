/* common/data/wdigest_cuda.cu - the linear payload digest's kernel: each warp takes a run of
 * consecutive tiles (one segment's part of one 1 KiB payload block), each lane 2 x 16 bytes of a
 * tile whose word keys it keeps in registers, 16-byte loads where the memory and the payload
 * agree mod 16, byte loads elsewhere; a warp's lanes fold into the message's accumulator (two
 * 64-bit words per lane, a carry counted in the second) once per message it touched. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "drv_cuda.h"
#include "wdigest_cuda.h"

#define THREADS 256
#define WARPS_PER_SM 64

/* Per accumulator: lo of lanes 0 and 1, then their carries (hi). */
#define ACC_WORDS 4

struct rf_wdigest_cuda_plan {
    int dev, sms;
    rf_wdigest_key *dkey;
    rf_wdigest_seg *dseg;
    uint64_t *dtile; /* nseg + 1: the first tile of each segment, prefix over all */
    uint64_t *htile;
    size_t nseg;
    uint32_t nacc;
    unsigned long long *dacc, *hacc;
    uint64_t bytes;
};

static uint64_t seg_tiles(const rf_wdigest_seg *s)
{
    if (s->bytes == 0)
        return 0;
    return (s->off + s->bytes - 1) / RF_WDIGEST_BLOCK - s->off / RF_WDIGEST_BLOCK + 1;
}

/* Where run r of segment s starts. */
__device__ __forceinline__ const uint8_t *run_at(const rf_wdigest_seg *s, uint64_t r)
{
    const uint8_t *q = s->base;

    for (int d = s->n - 1; d >= 0; d--) {
        uint64_t e = (uint64_t)s->ext[d];

        q += (int64_t)(r % e) * s->str[d];
        r /= e;
    }
    return q;
}

/* Adds lanes v0, v1 of the warp into accumulator a (lane 0 does the atomics). */
__device__ __forceinline__ void flush(unsigned long long *a, uint64_t v0, uint64_t v1,
                                      unsigned lane)
{
    for (int o = 16; o > 0; o >>= 1) {
        v0 = rf_wd_add(v0, __shfl_down_sync(0xffffffffu, v0, o));
        v1 = rf_wd_add(v1, __shfl_down_sync(0xffffffffu, v1, o));
    }
    if (lane == 0) {
        uint64_t v[2] = {rf_wd_canon(v0), rf_wd_canon(v1)};

        for (int L = 0; L < 2; L++) {
            unsigned long long old = atomicAdd(&a[L], (unsigned long long)v[L]);

            if (old + v[L] < old)
                atomicAdd(&a[2 + L], 1ull);
        }
    }
}

/* The bytes [qa, qb) of segment s (payload offsets, inside one 16-byte chunk at q0) into w. */
__device__ __forceinline__ void bytes_in(const rf_wdigest_seg *s, uint64_t q0, uint64_t qa,
                                         uint64_t qb, uint32_t w[4])
{
    for (uint64_t k = qa; k < qb;) {
        uint64_t rel = k - s->off, r = rel / s->run, within = rel % s->run;
        const uint8_t *p = run_at(s, r) + within;
        uint64_t m = s->run - within < qb - k ? s->run - within : qb - k;

        for (uint64_t j = 0; j < m; j++, k++)
            w[(k - q0) >> 2] |= (uint32_t)p[j] << (8 * ((k - q0) & 3));
    }
}

__global__ void __launch_bounds__(THREADS)
wd_kernel(const rf_wdigest_key *key, const rf_wdigest_seg *seg, const uint64_t *tile,
          size_t first, size_t count, unsigned long long *acc, uint64_t nwarps)
{
    const unsigned lane = threadIdx.x & 31;
    const uint64_t warp = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    uint64_t t0 = tile[first], T = tile[first + count] - t0, ta, tb;
    uint32_t ka[2][8];
    uint64_t s0 = 0, s1 = 0;
    size_t i, hi;
    uint32_t cur;

    if (warp >= nwarps)
        return;
    ta = t0 + T * warp / nwarps;
    tb = t0 + T * (warp + 1) / nwarps;
    if (ta >= tb)
        return;
    /* Lane l holds the 16-byte chunks l and 32 + l of every block: words 4l.. and 128 + 4l... */
    for (int L = 0; L < 2; L++)
        for (int j = 0; j < 8; j++)
            ka[L][j] = key->a[L][(j >> 2) * 128 + lane * 4 + (j & 3)];
    /* The last segment whose first tile is at or before ta (empty ones share their successor's
     * first tile, and the later one wins). */
    i = first;
    hi = first + count - 1;
    while (i < hi) {
        size_t mid = i + (hi - i + 1) / 2;

        if (tile[mid] <= ta)
            i = mid;
        else
            hi = mid - 1;
    }
    cur = seg[i].acc;
    for (uint64_t t = ta; t < tb; t++) {
        const rf_wdigest_seg *S;
        uint64_t b, lo, end, rel, r, within;
        const uint8_t *A;
        bool single;
        uint32_t v[8];

        while (tile[i + 1] <= t)
            i++;
        S = &seg[i];
        if (S->acc != cur) {
            flush(acc + (size_t)cur * ACC_WORDS, s0, s1, lane);
            s0 = s1 = 0;
            cur = S->acc;
        }
        b = S->off / RF_WDIGEST_BLOCK + (t - tile[i]);
        lo = b * RF_WDIGEST_BLOCK > S->off ? b * RF_WDIGEST_BLOCK : S->off;
        end = (b + 1) * RF_WDIGEST_BLOCK < S->off + S->bytes ? (b + 1) * RF_WDIGEST_BLOCK
                                                              : S->off + S->bytes;
        /* The run that holds the tile's first byte (the whole tile, usually). */
        rel = lo - S->off;
        if (S->n == 0) {
            r = 0;
            within = rel;
        } else {
            r = rel / S->run;
            within = rel % S->run;
        }
        A = run_at(S, r) + within;
        single = end - lo <= S->run - within;
        for (int h = 0; h < 2; h++) {
            uint64_t q0 = b * RF_WDIGEST_BLOCK + (uint64_t)(h * 32 + lane) * 16;
            uint64_t qa = q0 > lo ? q0 : lo, qb = q0 + 16 < end ? q0 + 16 : end;
            uint32_t w[4] = {0, 0, 0, 0};

            if (qa < qb && single) {
                const uint8_t *p = A + (qa - lo);

                if (qb - qa == 16 && ((uintptr_t)p & 15) == 0) {
                    uint4 x = __ldg((const uint4 *)p);

                    w[0] = x.x;
                    w[1] = x.y;
                    w[2] = x.z;
                    w[3] = x.w;
                } else {
                    for (uint64_t k = qa; k < qb; k++)
                        w[(k - q0) >> 2] |= (uint32_t)p[k - qa] << (8 * ((k - q0) & 3));
                }
            } else if (qa < qb) {
                bytes_in(S, q0, qa, qb, w);
            }
            for (int j = 0; j < 4; j++)
                v[h * 4 + j] = w[j];
        }
        {
            unsigned __int128 in0 = 0, in1 = 0;

            for (int j = 0; j < 8; j++) {
                in0 += (uint64_t)ka[0][j] * v[j];
                in1 += (uint64_t)ka[1][j] * v[j];
            }
            s0 = rf_wd_add(s0, rf_wd_mul(rf_wd_canon(rf_wd_fold128((uint64_t)in0,
                                                                   (uint64_t)(in0 >> 64))),
                                         rf_wd_mix(key->bseed[0], b)));
            s1 = rf_wd_add(s1, rf_wd_mul(rf_wd_canon(rf_wd_fold128((uint64_t)in1,
                                                                   (uint64_t)(in1 >> 64))),
                                         rf_wd_mix(key->bseed[1], b)));
        }
    }
    flush(acc + (size_t)cur * ACC_WORDS, s0, s1, lane);
}

extern "C" {

void rf_wdigest_cuda_plan_free(rf_wdigest_cuda_plan *pl)
{
    if (!pl)
        return;
    cudaFree(pl->dkey);
    cudaFree(pl->dseg);
    cudaFree(pl->dtile);
    cudaFree(pl->dacc);
    cudaFreeHost(pl->hacc);
    free(pl->htile);
    free(pl);
}

int rf_wdigest_cuda_plan_new(const rf_wdigest_key *key, const rf_wdigest_seg *segs, size_t n,
                             uint32_t nacc, rf_wdigest_cuda_plan **out, rf_err *err)
{
    rf_wdigest_cuda_plan *pl = NULL;
    size_t accb = (size_t)(nacc ? nacc : 1) * ACC_WORDS * sizeof(unsigned long long);
    int rc = 0;

    *out = NULL;
    for (size_t i = 0; i < n; i++) {
        const rf_wdigest_seg *s = &segs[i];
        bool bad = s->acc >= nacc || s->run == 0 || s->n < 0 || s->n > RF_MAX_DIMS;

        for (int d = 0; !bad && d < s->n; d++)
            bad = s->ext[d] < 1;
        if (bad)
            return rf_err_set(err, -EINVAL, "wdigest: segment %zu (accumulator %u of %u, run "
                              "%llu, %d dims) is malformed", i, s->acc, nacc,
                              (unsigned long long)s->run, s->n);
    }
    if (!(pl = (rf_wdigest_cuda_plan *)calloc(1, sizeof(*pl))) ||
        !(pl->htile = (uint64_t *)malloc((n + 1) * sizeof(uint64_t)))) {
        rc = rf_err_set(err, -ENOMEM, "wdigest: out of memory for %zu segments", n);
        goto out;
    }
    pl->nseg = n;
    pl->nacc = nacc;
    pl->htile[0] = 0;
    for (size_t i = 0; i < n; i++)
        pl->htile[i + 1] = pl->htile[i] + seg_tiles(&segs[i]);
    CUDA_TRY(err, cudaGetDevice(&pl->dev));
    CUDA_TRY(err, cudaDeviceGetAttribute(&pl->sms, cudaDevAttrMultiProcessorCount, pl->dev));
    CUDA_TRY(err, cudaMalloc((void **)&pl->dkey, sizeof(*key)));
    CUDA_TRY(err, cudaMalloc((void **)&pl->dseg, (n ? n : 1) * sizeof(*segs)));
    CUDA_TRY(err, cudaMalloc((void **)&pl->dtile, (n + 1) * sizeof(uint64_t)));
    CUDA_TRY(err, cudaMalloc((void **)&pl->dacc, accb));
    CUDA_TRY(err, cudaMallocHost((void **)&pl->hacc, accb));
    memset(pl->hacc, 0, accb);
    CUDA_TRY(err, cudaMemcpy(pl->dkey, key, sizeof(*key), cudaMemcpyHostToDevice));
    if (n > 0)
        CUDA_TRY(err, cudaMemcpy(pl->dseg, segs, n * sizeof(*segs), cudaMemcpyHostToDevice));
    CUDA_TRY(err, cudaMemcpy(pl->dtile, pl->htile, (n + 1) * sizeof(uint64_t),
                             cudaMemcpyHostToDevice));
    CUDA_TRY(err, cudaMemset(pl->dacc, 0, accb));
    pl->bytes = sizeof(*key) + (n ? n : 1) * sizeof(*segs) + (n + 1) * sizeof(uint64_t) + accb;
    *out = pl;
    pl = NULL;
out:
    rf_wdigest_cuda_plan_free(pl);
    return rc;
}

static int range_check(const rf_wdigest_cuda_plan *pl, uint64_t first, uint64_t count,
                       uint64_t n, const char *what, rf_err *err)
{
    if (first > n || count > n - first)
        return rf_err_set(err, -EINVAL, "wdigest: %s [%llu, +%llu) outside the plan's %llu",
                          what, (unsigned long long)first, (unsigned long long)count,
                          (unsigned long long)n);
    (void)pl;
    return 0;
}

int rf_wdigest_cuda_zero(rf_wdigest_cuda_plan *pl, uint32_t first, uint32_t count,
                         cudaStream_t s, rf_err *err)
{
    int rc;

    if ((rc = range_check(pl, first, count, pl->nacc, "accumulators", err)) < 0 || count == 0)
        return rc;
    CUDA_TRY(err, cudaMemsetAsync(pl->dacc + (size_t)first * ACC_WORDS, 0,
                                  (size_t)count * ACC_WORDS * sizeof(unsigned long long), s));
out:
    return rc;
}

int rf_wdigest_cuda_run(rf_wdigest_cuda_plan *pl, size_t first, size_t count, cudaStream_t s,
                        rf_err *err)
{
    uint64_t tiles, warps, blocks;
    int rc;

    if ((rc = range_check(pl, first, count, pl->nseg, "segments", err)) < 0 || count == 0)
        return rc;
    tiles = pl->htile[first + count] - pl->htile[first];
    if (tiles == 0)
        return 0;
    warps = tiles < (uint64_t)pl->sms * WARPS_PER_SM ? tiles : (uint64_t)pl->sms * WARPS_PER_SM;
    blocks = (warps * 32 + THREADS - 1) / THREADS;
    wd_kernel<<<(unsigned)blocks, THREADS, 0, s>>>(pl->dkey, pl->dseg, pl->dtile, first, count,
                                                  pl->dacc, warps);
    CUDA_TRY(err, cudaGetLastError());
out:
    return rc;
}

int rf_wdigest_cuda_fetch(rf_wdigest_cuda_plan *pl, uint32_t first, uint32_t count,
                          cudaStream_t s, rf_err *err)
{
    size_t at = (size_t)first * ACC_WORDS;
    int rc;

    if ((rc = range_check(pl, first, count, pl->nacc, "accumulators", err)) < 0 || count == 0)
        return rc;
    CUDA_TRY(err, cudaMemcpyAsync(pl->hacc + at, pl->dacc + at,
                                  (size_t)count * ACC_WORDS * sizeof(unsigned long long),
                                  cudaMemcpyDeviceToHost, s));
out:
    return rc;
}

void rf_wdigest_cuda_result(const rf_wdigest_cuda_plan *pl, uint32_t acc, rf_wdigest_acc *out)
{
    const unsigned long long *a = pl->hacc + (size_t)acc * ACC_WORDS;
    uint64_t lo[2] = {a[0], a[1]}, hi[2] = {a[2], a[3]};

    rf_wdigest_acc_from128(lo, hi, out);
}

uint64_t rf_wdigest_cuda_plan_bytes(const rf_wdigest_cuda_plan *pl)
{
    return pl ? pl->bytes : 0;
}

} /* extern "C" */
