/* bench/bench_wdigest_gpu.c - the wdigest kernel alone (wdigest_cuda.h) on three layouts: one
 * dense 4 GiB segment, 4 GiB as strided boxes of 8 KiB runs (a tp column slice: half of each
 * 16 KiB row), and 256 MiB as 2-byte runs (bf16 matrices held transposed), each timed over many
 * launches against cudaMemcpy D2D of the same payload bytes in the same run; a part of each
 * layout (its first 64 MiB of payload) checked against the host reference (#wrong: accumulators
 * that differ).
 * Usage: bench_wdigest_gpu [iterations, default 20] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef RF_HAVE_CUDA
int main(void)
{
    printf("bench_wdigest_gpu: this build has no CUDA\n");
    return 0;
}
#else
#include <cuda_runtime.h>

#include "drv_cuda.h"
#include "wdigest.h"
#include "wdigest_cuda.h"

#define MIB (1ull << 20)
#define GIB (1ull << 30)
#define CHECK_BYTES (64 * MIB)

#define CK(call)                                                                           \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "bench_wdigest_gpu: %s: %s\n", #call, cudaGetErrorString(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static void die_err(const char *what, const rf_err *e)
{
    fprintf(stderr, "bench_wdigest_gpu: %s: %s\n", what, e->msg);
    exit(1);
}

/* bytes of pseudo-random data at dst (64 MiB made on the host, repeated on the device). */
static void fill(uint8_t *dst, uint64_t bytes)
{
    const uint64_t tile = 64 * MIB;
    uint64_t *h = malloc(tile), x = 0x9E3779B97F4A7C15ull;

    if (!h)
        exit(1);
    for (uint64_t i = 0; i < tile / 8; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        h[i] = x;
    }
    CK(cudaMemcpy(dst, h, bytes < tile ? bytes : tile, cudaMemcpyHostToDevice));
    for (uint64_t o = tile; o < bytes; o += tile)
        CK(cudaMemcpy(dst + o, dst, bytes - o < tile ? bytes - o : tile,
                      cudaMemcpyDeviceToDevice));
    CK(cudaDeviceSynchronize());
    free(h);
}

/* The first CHECK_BYTES of payload of segs (whole segments, the last one cut to a prefix)
 * digested by the kernel and by rf_wdigest_add_seg on a host copy of the span bytes at dev;
 * returns the number of accumulators that differ. */
static int check(const rf_wdigest_key *k, const rf_wdigest_seg *segs, size_t n, uint8_t *dev,
                 uint64_t span)
{
    size_t m = 0;
    uint64_t payload = 0;
    uint32_t nacc;
    rf_wdigest_seg *ds = calloc(n, sizeof(*ds)), *hs = calloc(n, sizeof(*hs));
    rf_wdigest_acc *want;
    rf_wdigest_cuda_plan *pl = NULL;
    uint8_t *h = malloc(span);
    rf_err err = {0};
    int wrong = 0;

    if (!h || !ds || !hs)
        exit(1);
    while (m < n && payload < CHECK_BYTES) {
        ds[m] = segs[m];
        if (ds[m].bytes > CHECK_BYTES - payload)
            ds[m].bytes = CHECK_BYTES - payload;
        payload += ds[m++].bytes;
    }
    nacc = ds[m - 1].acc + 1;
    if (!(want = calloc(nacc, sizeof(*want))))
        exit(1);
    CK(cudaMemcpy(h, dev, span, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < m; i++) {
        hs[i] = ds[i];
        hs[i].base = h + (ds[i].base - dev);
        rf_wdigest_add_seg(k, &hs[i], &want[hs[i].acc]);
    }
    if (rf_wdigest_cuda_plan_new(k, ds, m, nacc, &pl, &err) < 0 ||
        rf_wdigest_cuda_zero(pl, 0, nacc, 0, &err) < 0 ||
        rf_wdigest_cuda_run(pl, 0, m, 0, &err) < 0 ||
        rf_wdigest_cuda_fetch(pl, 0, nacc, 0, &err) < 0)
        die_err("check plan", &err);
    CK(cudaStreamSynchronize(0));
    for (uint32_t a = 0; a < nacc; a++) {
        rf_wdigest_acc got;

        rf_wdigest_cuda_result(pl, a, &got);
        wrong += got.lane[0] != want[a].lane[0] || got.lane[1] != want[a].lane[1];
    }
    rf_wdigest_cuda_plan_free(pl);
    free(want);
    free(hs);
    free(ds);
    free(h);
    return wrong;
}

/* Times iters launches of the whole plan (zero + run) and iters cudaMemcpy D2D of its payload
 * bytes, after a warm-up; prints one row. */
static void bench(const char *name, const rf_wdigest_key *k, const rf_wdigest_seg *segs, size_t n,
                  uint8_t *dev, uint64_t span, uint8_t *scratch, int iters)
{
    rf_wdigest_cuda_plan *pl = NULL;
    uint64_t payload = 0;
    uint32_t nacc = segs[n - 1].acc + 1;
    cudaEvent_t e0, e1;
    float ms_d = 0, ms_c = 0;
    rf_err err = {0};
    int wrong;

    for (size_t i = 0; i < n; i++)
        payload += segs[i].bytes;
    if (rf_wdigest_cuda_plan_new(k, segs, n, nacc, &pl, &err) < 0)
        die_err("plan", &err);
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int pass = 0; pass < 2; pass++) {
        int it = pass ? iters : 2;

        CK(cudaEventRecord(e0, 0));
        for (int i = 0; i < it; i++)
            if (rf_wdigest_cuda_zero(pl, 0, nacc, 0, &err) < 0 ||
                rf_wdigest_cuda_run(pl, 0, n, 0, &err) < 0)
                die_err("run", &err);
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms_d, e0, e1));
        CK(cudaEventRecord(e0, 0));
        for (int i = 0; i < it; i++)
            CK(cudaMemcpyAsync(scratch, dev, payload, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms_c, e0, e1));
    }
    ms_d /= (float)iters;
    ms_c /= (float)iters;
    wrong = check(k, segs, n, dev, span);
    printf("%-28s %9.1f %6zu %9.3f %9.1f %9.3f %11.1f %6.2f %6d\n", name,
           (double)payload / MIB, n, (double)ms_d, (double)payload / (ms_d * 1e6),
           (double)ms_c, 2.0 * (double)payload / (ms_c * 1e6),
           (double)ms_c / (2.0 * (double)ms_d), wrong);
    rf_wdigest_cuda_plan_free(pl);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
}

int main(int argc, char **argv)
{
    int iters = argc > 1 ? atoi(argv[1]) : 20;
    const uint64_t span = 8 * GIB; /* the strided boxes' rows are twice their runs */
    uint8_t seed[RF_WDIGEST_SEED_BYTES], *dev = NULL, *scratch = NULL;
    rf_wdigest_seg segs[64];
    rf_wdigest_key k;
    struct cudaDeviceProp prop;

    if (!rf_cuda_available()) {
        printf("bench_wdigest_gpu: no CUDA device\n");
        return 0;
    }
    if (iters < 1)
        iters = 1;
    for (int i = 0; i < RF_WDIGEST_SEED_BYTES; i++)
        seed[i] = (uint8_t)(i * 37 + 11);
    rf_wdigest_key_derive(seed, &k);
    CK(cudaGetDeviceProperties(&prop, 0));
    CK(cudaMalloc((void **)&dev, span));
    CK(cudaMalloc((void **)&scratch, 4 * GIB));
    fill(dev, span);
    printf("bench_wdigest_gpu on %s, %d iterations. GB/s: payload bytes the digest reads per "
           "second; memcpy GB/s: bytes read + written per second by cudaMemcpy D2D of the same "
           "payload; ratio: the first over the second (1.00: the digest streams as fast as a "
           "copy moves memory)\n", prop.name, iters);
    printf("%-28s %9s %6s %9s %9s %9s %11s %6s %6s\n", "layout", "MiB", "segs", "ms", "GB/s",
           "memcpy ms", "memcpy GB/s", "ratio", "#wrong");
    /* (a) One dense segment. */
    {
        int64_t ext[1] = {1}, str[1] = {0};

        rf_wdigest_seg_walk(&segs[0], dev, 0, 4 * GIB, 4 * GIB, 0, ext, str, 0);
        bench("dense 4 GiB", &k, segs, 1, dev, CHECK_BYTES, scratch, iters);
    }
    /* (b) 64 boxes of 8192 rows: 8 KiB of each 16 KiB row, one message per 8 boxes, payload
     * offsets continuing across the boxes of a message. */
    {
        int64_t ext[1] = {8192}, str[1] = {16384};
        uint64_t box = 8192ull * 8192;

        for (int i = 0; i < 64; i++)
            rf_wdigest_seg_walk(&segs[i], dev + (uint64_t)i * 2 * box, (uint64_t)(i % 8) * box,
                                box, 8192, 1, ext, str, (uint32_t)(i / 8));
        bench("strided 8 KiB runs 4 GiB", &k, segs, 64, dev, 2 * CHECK_BYTES, scratch, iters);
    }
    /* (c) 8 bf16 matrices 4096 x 4096 held transposed: payload row-major, element (i, j) at
     * (j * 4096 + i) * 2: runs of 2 bytes, strides 2 (rows) and 8192 (columns). */
    {
        int64_t ext[2] = {4096, 4096}, str[2] = {2, 8192};
        uint64_t mat = 4096ull * 4096 * 2;

        for (int i = 0; i < 8; i++)
            rf_wdigest_seg_walk(&segs[i], dev + (uint64_t)i * mat, 0, mat, 2, 2, ext, str,
                                (uint32_t)i);
        bench("transposed 2 B runs 256 MiB", &k, segs, 8, dev, 2 * CHECK_BYTES, scratch,
              iters);
    }
    CK(cudaFree(dev));
    CK(cudaFree(scratch));
    return 0;
}
#endif
