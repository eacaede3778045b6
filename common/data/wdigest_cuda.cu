/* common/data/wdigest_cuda.cu - the linear payload digest's kernel: each warp walks a range of
 * tiles (one segment's part of one 1 KiB payload block; a lane takes 2 x 16 bytes of each) with a
 * cursor that steps without dividing, and folds into each message's accumulator once. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "drv_cuda.h"
#include "wdigest_cuda.h"

#define THREADS 256
/* Tiles a lane loads before it computes, where they lie back to back in one aligned run. */
#define UNROLL 4
/* A launch gives each warp at least this many tiles, where it has fewer warps than resident. */
#define MIN_TILES_PER_WARP 4

/* Per accumulator: lo of lanes 0 and 1, then their carries (hi). */
#define ACC_WORDS 4

struct rf_wdigest_cuda_plan {
    int dev, sms, blocks_per_sm;
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

/* Where run r of segment s starts (the host reference's run_at). */
__device__ __noinline__ const uint8_t *run_at(const rf_wdigest_seg *s, uint64_t r)
{
    const uint8_t *q = s->base;

    for (int d = s->n - 1; d >= 0; d--) {
        uint64_t e = (uint64_t)s->ext[d];

        q += (int64_t)(r % e) * s->str[d];
        r /= e;
    }
    return q;
}

/* A warp's place in one segment's walk: the payload byte `lo` of the current tile lies
 * `within` bytes into run r, which starts at p and is index cin of the innermost dim. A
 * segment of no dims repeats its one run (as run_at does): its innermost dim has stride 0 and
 * never ends. Invariant: within < run. */
struct cursor {
    const rf_wdigest_seg *S;
    uint64_t run, ext_in, r, within, cin;
    int64_t str_in;
    const uint8_t *p;
};

__device__ __forceinline__ void cursor_init(cursor &c, const rf_wdigest_seg *S, uint64_t rel)
{
    c.S = S;
    c.run = S->run;
    if (S->n > 0) {
        c.ext_in = (uint64_t)S->ext[S->n - 1];
        c.str_in = S->str[S->n - 1];
    } else {
        c.ext_in = UINT64_MAX;
        c.str_in = 0;
    }
    c.r = rel / c.run;
    c.within = rel - c.r * c.run;
    c.cin = S->n > 0 ? c.r % c.ext_in : 0;
    c.p = run_at(S, c.r);
}

/* How many runs on from the cursor's run lies the byte pos bytes past that run's start, for
 * pos < run + 1 KiB (within < run, plus at most a tile): one at most where run >= 1 KiB, and a
 * 32-bit division otherwise (pos < 2 KiB). */
__device__ __forceinline__ uint64_t runs_in(uint64_t pos, uint64_t run)
{
    if (pos < run)
        return 0;
    if (run >= RF_WDIGEST_BLOCK)
        return 1;
    return (uint32_t)pos / (uint32_t)run;
}

/* Where run r + k starts. */
__device__ __forceinline__ const uint8_t *cursor_run(const cursor &c, uint64_t k)
{
    if (c.cin + k < c.ext_in)
        return c.p + (int64_t)k * c.str_in;
    return run_at(c.S, c.r + k);
}

/* Moves the cursor delta payload bytes on; delta <= UNROLL * 1 KiB with within + delta <= run
 * when delta > 1 KiB. */
__device__ __forceinline__ void cursor_step(cursor &c, uint64_t delta)
{
    uint64_t k;

    c.within += delta;
    if (c.within < c.run)
        return;
    k = runs_in(c.within, c.run);
    c.within -= k * c.run;
    c.r += k;
    c.cin += k;
    if (c.cin < c.ext_in) {
        c.p += (int64_t)k * c.str_in;
    } else {
        c.cin = c.r % c.ext_in;
        c.p = run_at(c.S, c.r);
    }
}

/* Payload bytes [qa, qb) of the current tile (whose first byte is lo), inside the 16-byte
 * chunk at payload offset q0, as four little-endian words (the others 0). */
__device__ __forceinline__ void chunk_in(const cursor &c, uint64_t lo, uint64_t q0, uint64_t qa,
                                         uint64_t qb, uint32_t w[4])
{
    uint64_t pos, k, x, avail;
    const uint8_t *q;
    uint32_t o, oe, by[16];

    w[0] = w[1] = w[2] = w[3] = 0;
    if (qa >= qb)
        return;
    /* qa - lo < 1 KiB and within < run: pos < run + 1 KiB. */
    pos = c.within + (qa - lo);
    k = runs_in(pos, c.run);
    x = pos - k * c.run;
    q = cursor_run(c, k) + x;
    avail = c.run - x;
    if (qb - qa == 16 && avail >= 16) {
        if (((uintptr_t)q & 15) == 0) {
            uint4 v = __ldg((const uint4 *)q);

            w[0] = v.x;
            w[1] = v.y;
            w[2] = v.z;
            w[3] = v.w;
            return;
        }
        if (((uintptr_t)q & 3) == 0) {
            for (int j = 0; j < 4; j++)
                w[j] = __ldg((const uint32_t *)q + j);
            return;
        }
    }
    o = (uint32_t)(qa - q0);
    oe = (uint32_t)(qb - q0);
    /* Byte by byte across runs, every load issued before any is used (a chunk waits one memory
     * latency, not sixteen). */
#pragma unroll
    for (uint32_t j = 0; j < 16; j++) {
        by[j] = 0;
        if (j >= o && j < oe) {
            by[j] = __ldg(q);
            q++;
            if (--avail == 0 && j + 1 < oe) {
                k++;
                q = cursor_run(c, k);
                avail = c.run;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        w[j] = by[4 * j] | by[4 * j + 1] << 8 | by[4 * j + 2] << 16 | by[4 * j + 3] << 24;
}

/* One tile's terms of this lane: its 8 words v against its word keys, times the block keys.
 * The inner sums (< 2^67) are three 32-bit words each, a 32 x 32-bit multiply-add carried
 * through them per word (a 64-bit product of widened words can cost several multiplies). */
__device__ __forceinline__ void terms(const uint32_t ka[2][8], const uint32_t v[8], uint64_t c0,
                                      uint64_t c1, uint64_t &s0, uint64_t &s1)
{
    uint32_t in[2][3] = {{0, 0, 0}, {0, 0, 0}};
    uint64_t x[2];

#pragma unroll
    for (int L = 0; L < 2; L++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
#if defined(__CUDA_ARCH__)
            asm("mad.lo.cc.u32 %0, %3, %4, %0;\n\t"
                "madc.hi.cc.u32 %1, %3, %4, %1;\n\t"
                "addc.u32 %2, %2, 0;"
                : "+r"(in[L][0]), "+r"(in[L][1]), "+r"(in[L][2])
                : "r"(ka[L][j]), "r"(v[j]));
#else
            uint64_t pr = (uint64_t)ka[L][j] * v[j];
            uint64_t lo = ((uint64_t)in[L][1] << 32 | in[L][0]) + pr;

            in[L][2] += lo < pr;
            in[L][0] = (uint32_t)lo;
            in[L][1] = (uint32_t)(lo >> 32);
#endif
        }
        /* The folds are < 2^62, as rf_wd_mul needs; the lanes are taken mod p in the end, so
         * a value congruent to the reference's is the same lane. */
        x[L] = rf_wd_fold128((uint64_t)in[L][1] << 32 | in[L][0], in[L][2]);
    }
    s0 = rf_wd_add(s0, rf_wd_mul(x[0], c0));
    s1 = rf_wd_add(s1, rf_wd_mul(x[1], c1));
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

/* Warp w digests tiles [ta, tb) of the launch, an equal share. Where UNROLL whole blocks lie in
 * one run at a 16-byte aligned address, a lane issues all their loads before it multiplies;
 * elsewhere each chunk is read as its memory allows (chunk_in). Lane l makes the block keys of
 * block cbase + l, shuffled to the tiles that need them: one splitmix per lane per 32 blocks. */
__global__ void __launch_bounds__(THREADS)
wd_kernel(const rf_wdigest_key *key, const rf_wdigest_seg *seg, const uint64_t *tile,
          size_t first, size_t count, unsigned long long *acc, uint64_t nwarps)
{
    const unsigned lane = threadIdx.x & 31;
    const uint64_t warp = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    uint64_t t0 = tile[first], T = tile[first + count] - t0, ta, tb, t;
    uint64_t bs0 = key->bseed[0], bs1 = key->bseed[1];
    /* Lane l holds the block keys of block cbase + l; b - cbase >= 32 for every block b
     * (< 2^54) before the first are made. */
    uint64_t cbase = 1ull << 63, cl0 = 0, cl1 = 0;
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
    /* Everything below is warp-uniform but the chunk loads. */
    for (t = ta; t < tb; i++) {
        const rf_wdigest_seg *S = &seg[i];
        uint64_t te = tile[i + 1] < tb ? tile[i + 1] : tb;
        uint64_t off, segend, b, lo;
        cursor c;

        if (t >= te)
            continue;
        if (S->acc != cur) {
            flush(acc + (size_t)cur * ACC_WORDS, s0, s1, lane);
            s0 = s1 = 0;
            cur = S->acc;
        }
        off = S->off;
        segend = off + S->bytes;
        b = off / RF_WDIGEST_BLOCK + (t - tile[i]);
        lo = b * RF_WDIGEST_BLOCK > off ? b * RF_WDIGEST_BLOCK : off;
        cursor_init(c, S, lo - off);
        while (t < te) {
            uint64_t end;

            /* UNROLL whole blocks in one run, 16-byte aligned: all loads first. */
            if (te - t >= UNROLL && lo == b * RF_WDIGEST_BLOCK &&
                (b + UNROLL) * RF_WDIGEST_BLOCK <= segend &&
                c.within + UNROLL * RF_WDIGEST_BLOCK <= c.run &&
                ((uintptr_t)(c.p + c.within) & 15) == 0) {
                const uint4 *A = (const uint4 *)(c.p + c.within) + lane;
                uint4 x[UNROLL][2];

                /* Blocks b .. b + UNROLL - 1 among the 32 the lanes hold (b < cbase wraps). */
                if (b - cbase > 32 - UNROLL) {
                    cbase = b;
                    cl0 = rf_wd_mix(bs0, b + lane);
                    cl1 = rf_wd_mix(bs1, b + lane);
                }
#pragma unroll
                for (int u = 0; u < UNROLL; u++) {
                    x[u][0] = __ldg(A + u * 64);
                    x[u][1] = __ldg(A + u * 64 + 32);
                }
#pragma unroll
                for (int u = 0; u < UNROLL; u++) {
                    uint32_t v[8] = {x[u][0].x, x[u][0].y, x[u][0].z, x[u][0].w,
                                     x[u][1].x, x[u][1].y, x[u][1].z, x[u][1].w};
                    int at = (int)(b + u - cbase);

                    terms(ka, v, __shfl_sync(0xffffffffu, cl0, at),
                          __shfl_sync(0xffffffffu, cl1, at), s0, s1);
                }
                t += UNROLL;
                b += UNROLL;
                lo = b * RF_WDIGEST_BLOCK;
                if (t < te)
                    cursor_step(c, UNROLL * RF_WDIGEST_BLOCK);
                continue;
            }
            /* One tile, each chunk as its memory allows. */
            end = (b + 1) * RF_WDIGEST_BLOCK < segend ? (b + 1) * RF_WDIGEST_BLOCK : segend;
            if (b - cbase >= 32) {
                cbase = b;
                cl0 = rf_wd_mix(bs0, b + lane);
                cl1 = rf_wd_mix(bs1, b + lane);
            }
            {
                uint32_t v[8];
                int at = (int)(b - cbase);

#pragma unroll
                for (int h = 0; h < 2; h++) {
                    uint64_t q0 = b * RF_WDIGEST_BLOCK + (uint64_t)(h * 32 + lane) * 16;
                    uint64_t qa = q0 > lo ? q0 : lo, qb = q0 + 16 < end ? q0 + 16 : end;

                    chunk_in(c, lo, q0, qa, qb, v + 4 * h);
                }
                terms(ka, v, __shfl_sync(0xffffffffu, cl0, at),
                      __shfl_sync(0xffffffffu, cl1, at), s0, s1);
            }
            t++;
            b++;
            if (t < te)
                cursor_step(c, end - lo);
            lo = end;
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
    CUDA_TRY(err, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pl->blocks_per_sm, wd_kernel,
                                                                THREADS, 0));
    if (pl->blocks_per_sm < 1)
        pl->blocks_per_sm = 1;
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
    uint64_t tiles, warps, blocks, resident;
    int rc;

    if ((rc = range_check(pl, first, count, pl->nseg, "segments", err)) < 0 || count == 0)
        return rc;
    tiles = pl->htile[first + count] - pl->htile[first];
    if (tiles == 0)
        return 0;
    /* One wave of resident warps: each takes an equal share of the tiles. */
    resident = (uint64_t)pl->sms * (uint64_t)pl->blocks_per_sm * (THREADS / 32);
    warps = (tiles + MIN_TILES_PER_WARP - 1) / MIN_TILES_PER_WARP;
    if (warps > resident)
        warps = resident;
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
