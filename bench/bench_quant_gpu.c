/* bench/bench_quant_gpu.c - the GPU FP8 quantizer alone (issue 15): qwen3-30b-a3b's expert
 * weights (48 layers x 128 experts, w13 1536x2048 and w2 2048x768 bf16, 57.98 GB) quantized to
 * FP8 block 128x128 by one rf_quant_cuda_plan, against cudaMemcpy moving the same bytes of
 * memory traffic (bf16 read + FP8 and scales written) in the same run; a matrix of each shape
 * checked byte for byte against rf_quant_host.
 * Usage: bench_quant_gpu [own | vmm] [batch GiB, 0: one launch; default 4] [finite | edges]
 *   own: cudaMalloc; vmm: cuMemCreate'd memory mapped by this process (as a receiverd maps
 *   the trainers' and engines' VMM memory). With a batch size, the matrices are launched in
 *   batches of about that many bf16 bytes alternating between two streams, as the local
 *   transport does. finite (the default): weights of finite values; edges: one element in 4096
 *   is Inf, NaN, 0 or a subnormal, as in refit-sim-trainer's weights (most blocks hold one). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef RF_HAVE_CUDA
int main(void)
{
    printf("bench_quant_gpu: this build has no CUDA\n");
    return 0;
}
#else
#include <cuda_runtime.h>

#include "drv_cuda.h"
#include "quant.h"
#include "quant_cuda.h"

#define LAYERS 48
#define EXPERTS 128
#define NMAT (LAYERS * EXPERTS * 2)
#define GIB (1ull << 30)

#define CK(call)                                                                           \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "bench_quant_gpu: %s: %s\n", #call, cudaGetErrorString(e_));   \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die_err(const char *what, const rf_err *e)
{
    fprintf(stderr, "bench_quant_gpu: %s: %s\n", what, e->msg);
    exit(1);
}

/* bytes of GPU 0's memory, from cudaMalloc or mapped from one cuMemCreate'd allocation. */
static uint8_t *galloc(uint64_t bytes, int vmm)
{
    const rf_cu_api *cu;
    CUmemAllocationProp prop;
    CUmemGenericAllocationHandle h;
    CUmemAccessDesc acc;
    CUdeviceptr va;
    size_t gran;
    rf_err err = {0};
    void *p;

    if (!vmm) {
        CK(cudaMalloc(&p, bytes));
        return p;
    }
    if (rf_cu_load(&cu, &err) < 0)
        die_err("driver", &err);
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    if (cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) ||
        cu->cuMemCreate(&h, (bytes + gran - 1) / gran * gran, &prop, 0) ||
        cu->cuMemAddressReserve(&va, (bytes + gran - 1) / gran * gran, 0, 0, 0) ||
        cu->cuMemMap(va, (bytes + gran - 1) / gran * gran, 0, h, 0)) {
        fprintf(stderr, "bench_quant_gpu: VMM allocation of %llu bytes failed\n",
                (unsigned long long)bytes);
        exit(1);
    }
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (cu->cuMemSetAccess(va, (bytes + gran - 1) / gran * gran, &acc, 1)) {
        fprintf(stderr, "bench_quant_gpu: cuMemSetAccess failed\n");
        exit(1);
    }
    return (uint8_t *)(uintptr_t)va;
}

/* Finite bf16 of magnitudes 2^-27 .. 2^13 and both signs, from a fixed seed; with edges one in
 * 4096 is +-Inf, a NaN, +-0 or a subnormal instead. */
static void fill(uint8_t *dst, uint64_t bytes, int edges)
{
    static const uint16_t edge[4] = {0x7F80, 0x7FC1, 0x0000, 0x0003};
    const uint64_t tile = 64ull << 20;
    uint16_t *h = malloc(tile);
    uint64_t x = 0x9E3779B97F4A7C15ull;

    if (!h)
        exit(1);
    for (uint64_t i = 0; i < tile / 2; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        h[i] = (uint16_t)((x & 0x807F) | (uint16_t)((100 + (x >> 20) % 40) << 7));
        if (edges && (x >> 40) % 4096 == 0)
            h[i] = (uint16_t)((x & 0x8000) | edge[(x >> 30) & 3]);
    }
    CK(cudaMemcpy(dst, h, tile, cudaMemcpyHostToDevice));
    for (uint64_t o = tile; o < bytes; o += tile)
        CK(cudaMemcpy(dst + o, dst, bytes - o < tile ? bytes - o : tile,
                      cudaMemcpyDeviceToDevice));
    CK(cudaDeviceSynchronize());
    free(h);
}

/* Matrix m against rf_quant_host of the same bf16 bytes: the FP8 bytes and scales that differ. */
static uint64_t check(const rf_quant_cuda_op *o)
{
    uint64_t n = o->rows * o->cols, sn = (o->rows + 127) / 128 * ((o->cols + 127) / 128), bad = 0;
    uint16_t *src = malloc(n * 2);
    uint8_t *q = malloc(n), *qr = malloc(n);
    float *s = malloc(sn * 4), *sr = malloc(sn * 4);
    rf_err err = {0};

    CK(cudaMemcpy(src, o->src, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(q, o->q, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(s, o->scales, sn * 4, cudaMemcpyDeviceToHost));
    if (rf_quant_host(&o->fmt, RF_DT_BF16, src, (int64_t)o->cols, o->rows, o->cols, qr,
                      (int64_t)o->cols, sr, (int64_t)((o->cols + 127) / 128), &err) < 0)
        die_err("host reference", &err);
    for (uint64_t i = 0; i < n; i++)
        bad += q[i] != qr[i];
    for (uint64_t i = 0; i < sn; i++)
        bad += memcmp(&s[i], &sr[i], 4) != 0;
    free(src), free(q), free(qr), free(s), free(sr);
    return bad;
}

int main(int argc, char **argv)
{
    int vmm = argc > 1 && strcmp(argv[1], "vmm") == 0;
    int edges = argc > 3 && strcmp(argv[3], "edges") == 0;
    uint64_t batch = (argc > 2 ? strtoull(argv[2], NULL, 10) : 4) * GIB;
    rf_quant_cuda_op *ops = calloc(NMAT, sizeof(*ops));
    size_t *first = calloc(NMAT + 1, sizeof(*first)), nb = 0;
    uint64_t sb = 0, qb = 0, scb = 0, so = 0, qo = 0, sco = 0, acc = 0, bad = 0;
    double best = 1e30, ceil_best = 1e30;
    uint8_t *src, *q, *sc;
    cudaStream_t st[2];
    rf_quant_cuda_plan *pl;
    rf_err err = {0};

    int ndev = 0;

    if (!ops || !first)
        return 1;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("skipped: no CUDA device\n");
        return 0;
    }
    CK(cudaSetDevice(0));
    for (int m = 0; m < NMAT; m++) {
        uint64_t r = m % 2 ? 2048 : 1536, c = m % 2 ? 768 : 2048;

        sb += r * c * 2;
        qb += r * c;
        scb += (r / 128) * (c / 128) * 4;
    }
    src = galloc(sb, vmm);
    q = galloc(qb, vmm);
    sc = galloc(scb, vmm);
    fill(src, sb, edges);
    first[nb++] = 0;
    for (int m = 0; m < NMAT; m++) {
        uint64_t r = m % 2 ? 2048 : 1536, c = m % 2 ? 768 : 2048;

        ops[m] = (rf_quant_cuda_op){
            .fmt = {.kind = RF_QUANT_BLOCK, .br = 128, .bc = 128}, .dt = RF_DT_BF16,
            .src = src + so, .src_row_stride = (int64_t)c, .rows = r, .cols = c, .q = q + qo,
            .q_row_stride = (int64_t)c, .scales = sc + sco,
            .scale_row_stride = (int64_t)(c / 128)};
        so += r * c * 2;
        qo += r * c;
        sco += (r / 128) * (c / 128) * 4;
        acc += r * c * 2;
        if (batch > 0 && acc >= batch && m + 1 < NMAT) {
            first[nb++] = (size_t)m + 1;
            acc = 0;
        }
    }
    first[nb] = NMAT;
    if (rf_quant_cuda_plan_new(ops, NMAT, &pl, &err) < 0)
        die_err("plan", &err);
    CK(cudaStreamCreateWithFlags(&st[0], cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&st[1], cudaStreamNonBlocking));
    for (int it = 0; it < 6; it++) {
        double t0;

        CK(cudaDeviceSynchronize());
        t0 = now_s();
        for (size_t b = 0; b < nb; b++)
            if (rf_quant_cuda_plan_launch(pl, first[b], first[b + 1] - first[b], st[b % 2],
                                          &err) < 0)
                die_err("launch", &err);
        CK(cudaDeviceSynchronize());
        t0 = now_s() - t0;
        best = it > 0 && t0 < best ? t0 : best;
    }
    /* The ceiling: cudaMemcpy of (read + written) / 2 bytes, 1 GiB at a time, src into q and
     * back (the memory traffic of the quantization). */
    for (int it = 0; it < 4; it++) {
        uint64_t left = (sb + qb + scb) / 2, o = 0;
        double t0;

        CK(cudaDeviceSynchronize());
        t0 = now_s();
        while (left > 0) {
            uint64_t n = left < GIB ? left : GIB;

            if (o + n > qb)
                o = 0;
            CK(cudaMemcpyAsync(q + o, src + o, n, cudaMemcpyDeviceToDevice, st[0]));
            o += n;
            left -= n;
        }
        CK(cudaDeviceSynchronize());
        t0 = now_s() - t0;
        ceil_best = it > 0 && t0 < ceil_best ? t0 : ceil_best;
    }
    /* The ceiling overwrote q: quantize once more, then check a matrix of each shape at the
     * start, middle and end. */
    if (rf_quant_cuda_plan_launch(pl, 0, NMAT, st[0], &err) < 0)
        die_err("launch", &err);
    CK(cudaDeviceSynchronize());
    for (int m = 0; m < 2; m++) {
        bad += check(&ops[m]);
        bad += check(&ops[NMAT / 2 + m]);
        bad += check(&ops[NMAT - 2 + m]);
    }
    printf("memory %s, %zu launch(es), %d matrices, %.2f GB bf16 (%s) -> %.2f GB FP8 + %.1f MB "
           "scales\n", vmm ? "vmm" : "own", nb, NMAT, sb / 1e9, edges ? "1 in 4096 Inf, NaN, 0 "
           "or subnormal" : "finite", qb / 1e9, scb / 1e6);
    printf("quantize  %.2f ms  %.0f GB/s bf16 read, %.0f GB/s read+written\n", best * 1e3,
           sb / best / 1e9, (sb + qb + scb) / best / 1e9);
    printf("cudaMemcpy of the same traffic  %.2f ms  (quantize / ceiling %.2fx)\n",
           ceil_best * 1e3, best / ceil_best);
    printf("checked 6 matrices against rf_quant_host: %llu wrong\n", (unsigned long long)bad);
    rf_quant_cuda_plan_free(pl);
    return bad != 0;
}
#endif
