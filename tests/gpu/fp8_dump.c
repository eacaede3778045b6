/* tests/gpu/fp8_dump.c - bf16 matrices of qwen3-30b-a3b's shapes quantized on the GPU
 * (rf_quant_cuda_quantize) in every FP8 format, written with their sources to a directory for
 * tests/gpu/fp8_torch.py to recompute in PyTorch; each result is also checked against
 * rf_quant_host here. Usage: fp8_dump DIR. Exits 0 when everything was written and equal. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "drv_cuda.h"
#include "quant.h"
#include "quant_cuda.h"

/* The formats the torch script knows; block:1x128 is the per-token-group grid. */
static const char *const formats[] = {"block", "block:1x128", "channel", "tensor", "mxfp8"};
#define NFMT (sizeof(formats) / sizeof(formats[0]))

/* qwen3-30b-a3b: hidden 2048, 32 query heads and 4 KV heads of 128, experts of 768. down_proj
 * is read through a row stride of 1024 (a view into a wider buffer); odd is no multiple of
 * 128 or 32 either way. */
static const struct shape {
    const char *name;
    uint64_t rows, cols;
    int64_t stride;
    int planted;
} shapes[] = {
    {"q_proj", 4096, 2048, 2048, 1},
    {"k_proj", 512, 2048, 2048, 0},
    {"o_proj", 2048, 4096, 4096, 0},
    {"experts.0.gate_proj", 768, 2048, 2048, 1},
    {"experts.0.up_proj", 768, 2048, 2048, 0},
    {"experts.0.down_proj", 2048, 768, 1024, 0},
    {"odd", 300, 1000, 1000, 1},
};

static uint64_t rng = 0x2545F4914F6CDD1DULL;

static uint64_t rnd(uint64_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return n ? rng % n : 0;
}

/* A bf16 with biased exponent base - (0..spread), random sign and mantissa, sometimes 0. */
static uint16_t rand_bf16(int base, int spread)
{
    int e = base - (int)rnd((uint64_t)spread + 1);
    uint16_t s = rnd(2) ? 0x8000 : 0;

    if (rnd(97) == 0)
        return s;
    e = e < 0 ? 0 : e > 254 ? 254 : e;
    return (uint16_t)(s | (e << 7) | rnd(128));
}

/* Weight-like values block by block (128 x 128): mostly around 2^-4, some blocks far beyond
 * 448, some in bf16's subnormal range, some spread over 2^40. */
static void fill_random(uint16_t *x, uint64_t rows, uint64_t cols)
{
    for (uint64_t r0 = 0; r0 < rows; r0 += 128)
        for (uint64_t c0 = 0; c0 < cols; c0 += 128) {
            uint64_t k = rnd(10);
            int base = k < 7 ? 123 : k == 7 ? 127 + 9 + (int)rnd(6) : k == 8 ? 4 : 100 + (int)rnd(60);
            int spread = k == 9 ? 40 : 10;

            for (uint64_t r = r0; r < r0 + 128 && r < rows; r++)
                for (uint64_t c = c0; c < c0 + 128 && c < cols; c++)
                    x[r * cols + c] = rand_bf16(base, spread);
        }
}

/* The first row of 128 x 128 blocks, each one edge case (and so every 1 x 32 block in it):
 * zeros; subnormals only; beyond 448 with NaN and +-Inf; all NaN; all +-Inf; +-0; the largest
 * finite values; one NaN among normal values; one Inf among normal values. */
static void plant(uint16_t *x, uint64_t rows, uint64_t cols)
{
    for (uint64_t r = 0; r < 128 && r < rows; r++)
        for (uint64_t c = 0; c < 9 * 128 && c < cols; c++) {
            uint16_t s = rnd(2) ? 0x8000 : 0, v;

            switch (c / 128) {
            case 0: v = 0; break;
            case 1: v = s | (uint16_t)rnd(0x80); break;
            case 2: v = rnd(9) == 0 ? (uint16_t)(s | (rnd(2) ? 0x7FC0 : 0x7F80))
                                    : rand_bf16(127 + 12, 8); break;
            case 3: v = s | 0x7FC1; break;
            case 4: v = s | 0x7F80; break;
            case 5: v = s; break;
            case 6: v = s | 0x7F7F; break;
            case 7: v = (r % 32 == 3 && c % 32 == 5) ? 0x7FC0 : rand_bf16(127, 6); break;
            default: v = (r % 32 == 7 && c % 32 == 9) ? (uint16_t)(s | 0x7F80) : rand_bf16(127, 6);
                break;
            }
            x[r * cols + c] = v;
        }
}

static int write_file(const char *dir, const char *name, const char *suffix, const void *p,
                      size_t n)
{
    char path[4096];
    FILE *f;
    int ok;

    snprintf(path, sizeof(path), "%s/%s%s", dir, name, suffix);
    if ((f = fopen(path, "wb")) == NULL) {
        fprintf(stderr, "fp8_dump: cannot create %s: %s\n", path, strerror(errno));
        return -1;
    }
    ok = fwrite(p, 1, n, f) == n;
    ok = fclose(f) == 0 && ok;
    if (!ok)
        fprintf(stderr, "fp8_dump: cannot write %zu bytes to %s: %s\n", n, path, strerror(errno));
    return ok ? 0 : -1;
}

/* Quantizes one matrix in every format on the GPU and the host, writes the GPU's results and
 * one manifest line per format; 0, or -1 after saying what failed. */
static int dump_one(const char *dir, FILE *man, const struct shape *sh)
{
    const size_t n = sh->rows * sh->cols;
    uint16_t *x = malloc(n * 2), *dx = NULL;
    uint8_t *hq = malloc(n), *gq = malloc(n), *dq = NULL;
    uint8_t *hs = NULL, *gs = NULL, *ds = NULL;
    int rc = -1;

    if (x == NULL || hq == NULL || gq == NULL) {
        fprintf(stderr, "fp8_dump: out of memory for %s\n", sh->name);
        goto out;
    }
    fill_random(x, sh->rows, sh->cols);
    if (sh->planted)
        plant(x, sh->rows, sh->cols);
    if (write_file(dir, sh->name, ".src", x, n * 2) < 0)
        goto out;
    if (cudaMalloc((void **)&dx, sh->rows * (size_t)sh->stride * 2) != cudaSuccess ||
        cudaMalloc((void **)&dq, n) != cudaSuccess ||
        cudaMalloc((void **)&ds, (sh->rows * ((sh->cols + 31) / 32) + 1) * 4) != cudaSuccess ||
        cudaMemcpy2D(dx, (size_t)sh->stride * 2, x, sh->cols * 2, sh->cols * 2, sh->rows,
                     cudaMemcpyHostToDevice) != cudaSuccess) {
        fprintf(stderr, "fp8_dump: %s: device memory: %s\n", sh->name,
                cudaGetErrorString(cudaGetLastError()));
        goto out;
    }
    for (size_t k = 0; k < NFMT; k++) {
        rf_quant_fmt f;
        rf_err err = {0};
        uint64_t srows, scols;
        size_t sbytes;
        char tag[64], suffix[96];

        if (rf_quant_fmt_parse(formats[k], &f, &err) < 0 ||
            rf_quant_scale_shape(&f, sh->rows, sh->cols, &srows, &scols, &err) < 0) {
            fprintf(stderr, "fp8_dump: %s: %s\n", formats[k], err.msg);
            goto out;
        }
        sbytes = srows * scols * rf_dtype_size(rf_quant_scale_dtype(&f));
        free(hs);
        free(gs);
        hs = malloc(sbytes);
        gs = malloc(sbytes);
        if (hs == NULL || gs == NULL) {
            fprintf(stderr, "fp8_dump: out of memory for the scales of %s\n", sh->name);
            goto out;
        }
        if (rf_quant_cuda_quantize(&f, RF_DT_BF16, dx, sh->stride, sh->rows, sh->cols, dq,
                                   (int64_t)sh->cols, ds, (int64_t)scols, 0, &err) < 0 ||
            rf_quant_host(&f, RF_DT_BF16, x, (int64_t)sh->cols, sh->rows, sh->cols, hq,
                          (int64_t)sh->cols, hs, (int64_t)scols, &err) < 0) {
            fprintf(stderr, "fp8_dump: %s %s: %s\n", sh->name, formats[k], err.msg);
            goto out;
        }
        if (cudaDeviceSynchronize() != cudaSuccess ||
            cudaMemcpy(gq, dq, n, cudaMemcpyDeviceToHost) != cudaSuccess ||
            cudaMemcpy(gs, ds, sbytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
            fprintf(stderr, "fp8_dump: %s %s: the kernel or its copy back failed: %s\n",
                    sh->name, formats[k], cudaGetErrorString(cudaGetLastError()));
            goto out;
        }
        snprintf(tag, sizeof(tag), "%s", formats[k]);
        for (char *p = tag; *p; p++)
            if (*p == ':')
                *p = '_';
        snprintf(suffix, sizeof(suffix), ".%s.q", tag);
        if (write_file(dir, sh->name, suffix, gq, n) < 0)
            goto out;
        snprintf(suffix, sizeof(suffix), ".%s.scale", tag);
        if (write_file(dir, sh->name, suffix, gs, sbytes) < 0)
            goto out;
        fprintf(man, "%s %" PRIu64 " %" PRIu64 " %s %s %" PRIu64 " %" PRIu64 "\n", sh->name,
                sh->rows, sh->cols, formats[k], tag, srows, scols);
        if (memcmp(hq, gq, n) != 0 || memcmp(hs, gs, sbytes) != 0) {
            fprintf(stderr, "fp8_dump: %s %s: the GPU's result differs from rf_quant_host's\n",
                    sh->name, formats[k]);
            goto out;
        }
        printf("%-22s %-12s %9zu bytes, %7" PRIu64 " scales: GPU == rf_quant_host\n", sh->name,
               formats[k], n, srows * scols);
    }
    rc = 0;
out:
    cudaFree(dx);
    cudaFree(dq);
    cudaFree(ds);
    free(x);
    free(hq);
    free(gq);
    free(hs);
    free(gs);
    return rc;
}

int main(int argc, char **argv)
{
    char path[4096];
    FILE *man;
    int rc = 0;

    if (argc != 2) {
        fprintf(stderr, "usage: fp8_dump DIR (an existing directory; writes manifest.txt and "
                "one file per matrix and format)\n");
        return 2;
    }
    if (!rf_cuda_available()) {
        printf("skipped: no CUDA device\n");
        return 0;
    }
    snprintf(path, sizeof(path), "%s/manifest.txt", argv[1]);
    if ((man = fopen(path, "w")) == NULL) {
        fprintf(stderr, "fp8_dump: cannot create %s: %s\n", path, strerror(errno));
        return 1;
    }
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]) && rc == 0; i++)
        rc = dump_one(argv[1], man, &shapes[i]);
    if (fclose(man) != 0 && rc == 0) {
        fprintf(stderr, "fp8_dump: cannot write %s: %s\n", path, strerror(errno));
        rc = -1;
    }
    return rc == 0 ? 0 : 1;
}
