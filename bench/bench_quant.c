/* bench/bench_quant.c - host FP8 quantization benchmark (issue 15): rf_quant_host on a
 * qwen3-30b-a3b-shaped set of bf16 (or fp16/fp32) matrices for each format, in GB/s of input,
 * beside single-thread memcpy of the same input bytes and of the bytes written (fp8 + scales),
 * every output byte and scale checked against a kept copy of the original scalar code
 * (common/data/quant_ref.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant.h"
#include "quant_ref.h"

static int isa = -1;

typedef struct mat {
    uint64_t rows, cols;
    size_t src_off, q_off, s_off, s_bytes;
} mat;

/* One layer's worth of qwen3-30b-a3b's weights, scaled down in expert count: q/o projections
 * ([4096, 2048], [2048, 4096]), k/v ([512, 2048]), experts' gate/up ([768, 2048]) and down
 * ([2048, 768]); repeated to a few hundred MB of bf16. */
static const struct {
    uint64_t rows, cols;
    int n;
} shapes[] = {
    {4096, 2048, 1}, {2048, 4096, 1}, {512, 2048, 2}, {768, 2048, 16}, {2048, 768, 8},
};
#define REPEAT 2

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rs = 0x9E3779B97F4A7C15u;

static uint64_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

/* Weight-like values: uniform in (-1, 1) times 2^-4..2^-9, a zero now and then. */
static float weight(void)
{
    uint64_t r = rnd();

    if (r % 1024 == 0)
        return 0.0f;
    return ((float)((r >> 11) % 1000000) / 500000.0f - 1.0f) * rf_quant_u2f((uint32_t)(123 - (r >> 40) % 6)
                                                                     << 23);
}

static void put(rf_dtype dt, void *p, uint64_t i, float v)
{
    if (dt == RF_DT_FP32) {
        ((float *)p)[i] = v;
    } else if (dt == RF_DT_BF16) {
        ((uint16_t *)p)[i] = (uint16_t)(rf_quant_f2u(v) >> 16);
    } else {
        /* fp16 by truncation (subnormal results flush to zero; a benchmark input only). */
        uint32_t u = rf_quant_f2u(v), s = (u >> 16) & 0x8000;
        int e = (int)((u >> 23) & 0xFF) - 127 + 15;
        ((uint16_t *)p)[i] = (uint16_t)(e <= 0 ? s : s | (uint32_t)e << 10 | (u >> 13 & 0x3FF));
    }
}

typedef int (*run_fn)(const rf_quant_fmt *f, rf_dtype dt, const mat *m, int nm, const char *src,
                      uint8_t *q, char *sc);

static int run_host(const rf_quant_fmt *f, rf_dtype dt, const mat *m, int nm, const char *src,
                    uint8_t *q, char *sc)
{
    rf_err err;

    for (int k = 0; k < nm; k++) {
        uint64_t sr, scols;

        rf_quant_scale_shape(f, m[k].rows, m[k].cols, &sr, &scols, NULL);
        if (rf_quant__host_isa(isa, f, dt, src + m[k].src_off, (int64_t)m[k].cols, m[k].rows, m[k].cols,
                          q + m[k].q_off, (int64_t)m[k].cols, sc + m[k].s_off, (int64_t)scols,
                          &err) < 0) {
            fprintf(stderr, "bench_quant: %s\n", err.msg);
            return -1;
        }
    }
    return 0;
}

static int run_ref(const rf_quant_fmt *f, rf_dtype dt, const mat *m, int nm, const char *src,
                   uint8_t *q, char *sc)
{
    for (int k = 0; k < nm; k++) {
        uint64_t sr, scols;

        rf_quant_scale_shape(f, m[k].rows, m[k].cols, &sr, &scols, NULL);
        rf_quant_ref(f, dt, src + m[k].src_off, (int64_t)m[k].cols, m[k].rows, m[k].cols,
                  q + m[k].q_off, (int64_t)m[k].cols, sc + m[k].s_off, (int64_t)scols);
    }
    return 0;
}

/* Best seconds of iters timed runs after one warm-up (-1 on failure). */
static double best_of(run_fn fn, int iters, const rf_quant_fmt *f, rf_dtype dt, const mat *m,
                      int nm, const char *src, uint8_t *q, char *sc)
{
    double best = 1e30;

    for (int i = -1; i < iters; i++) {
        double t0 = now();

        if (fn(f, dt, m, nm, src, q, sc) < 0)
            return -1;
        t0 = now() - t0;
        /* With iters 0 the warm-up is the one run (the reference, too slow to repeat). */
        if ((i >= 0 || iters == 0) && t0 < best)
            best = t0;
    }
    return best;
}

static double best_memcpy(int iters, void *dst, const void *src, size_t n)
{
    double best = 1e30;

    for (int i = -1; i < iters; i++) {
        double t0 = now();

        memcpy(dst, src, n);
        __asm__ volatile("" : : "r"(dst) : "memory");
        t0 = now() - t0;
        if (i >= 0 && t0 < best)
            best = t0;
    }
    return best;
}

int main(int argc, char **argv)
{
    const char *fmts[] = {"block", "block:1x128", "channel", "tensor", "mxfp8"};
    const char *only = NULL;
    rf_dtype dt = RF_DT_BF16;
    int iters = 5, nm = 0, status = 0, ref_iters = 1;
    mat m[8 * 28];
    size_t es, src_bytes = 0, q_bytes = 0, s_max = 0;
    char *src = NULL, *sc = NULL, *sc_ref = NULL, *mc = NULL;
    uint8_t *q = NULL, *q_ref = NULL;
    double t_mc_in;

    for (int a = 1; a < argc; a++) {
        if (strcmp(argv[a], "-n") == 0 && a + 1 < argc)
            iters = atoi(argv[++a]);
        else if (strcmp(argv[a], "-r") == 0 && a + 1 < argc)
            ref_iters = atoi(argv[++a]);
        else if (strcmp(argv[a], "-i") == 0 && a + 1 < argc)
            isa = atoi(argv[++a]);
        else if (strcmp(argv[a], "-f") == 0 && a + 1 < argc)
            only = argv[++a];
        else if (strcmp(argv[a], "-t") == 0 && a + 1 < argc && rf_dtype_parse(argv[a + 1], &dt) == 0)
            a++;
        else {
            fprintf(stderr, "usage: bench_quant [-n ITERS] [-r REF_ITERS] [-t bf16|fp16|fp32] "
                            "[-f FORMAT] [-i 0|1|2 (plain C, AVX2, AVX-512)]\n");
            return 2;
        }
    }
    if (dt != RF_DT_BF16 && dt != RF_DT_FP16 && dt != RF_DT_FP32) {
        fprintf(stderr, "bench_quant: -t must be bf16, fp16 or fp32\n");
        return 2;
    }
    iters = iters < 1 ? 1 : iters;
    es = rf_dtype_size(dt);
    for (int rep = 0; rep < REPEAT; rep++)
        for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
            for (int k = 0; k < shapes[i].n; k++) {
                m[nm] = (mat){shapes[i].rows, shapes[i].cols, src_bytes, q_bytes, 0, 0};
                src_bytes += shapes[i].rows * shapes[i].cols * es;
                q_bytes += shapes[i].rows * shapes[i].cols;
                nm++;
            }
    src = malloc(src_bytes);
    mc = malloc(src_bytes);
    q = malloc(q_bytes);
    q_ref = malloc(q_bytes);
    /* Scales are at most one fp32 per 32 elements (mxfp8: one byte) or per row. */
    s_max = q_bytes / 8 + 4096 * (size_t)nm * 4;
    sc = malloc(s_max);
    sc_ref = malloc(s_max);
    if (!src || !mc || !q || !q_ref || !sc || !sc_ref) {
        fprintf(stderr, "bench_quant: out of memory (%zu bytes of input)\n", src_bytes);
        status = 1;
        goto out;
    }
    for (uint64_t i = 0; i < src_bytes / es; i++)
        put(dt, src, i, weight());
    memset(mc, 0, src_bytes);
    t_mc_in = best_memcpy(iters, mc, src, src_bytes);

    printf("%d %s matrices (qwen3-30b-a3b shapes), %.1f MB in, best of %d after a warm-up, "
           "one thread\n", nm, rf_dtype_name(dt), (double)src_bytes / 1e6, iters);
    printf("memcpy of the input: %.2f GB/s (%.4f s)\n", (double)src_bytes / t_mc_in / 1e9, t_mc_in);
    printf("%-12s %9s %9s %9s %9s %11s %11s %8s %7s\n", "format", "in MB", "out MB", "ref GB/s",
           "GB/s", "memcpy(out)", "time/memcpy", "vs ref", "#wrong");
    for (size_t fi = 0; fi < sizeof(fmts) / sizeof(fmts[0]); fi++) {
        rf_quant_fmt f;
        rf_err err;
        size_t s_off = 0, se, out_bytes;
        double t_ref, t, t_mc_out;
        uint64_t wrong = 0;

        if (only != NULL && strcmp(only, fmts[fi]) != 0)
            continue;
        if (rf_quant_fmt_parse(fmts[fi], &f, &err) < 0) {
            fprintf(stderr, "bench_quant: %s\n", err.msg);
            status = 1;
            goto out;
        }
        se = f.kind == RF_QUANT_MXFP8 ? 1 : 4;
        for (int k = 0; k < nm; k++) {
            uint64_t sr, scols;

            rf_quant_scale_shape(&f, m[k].rows, m[k].cols, &sr, &scols, NULL);
            m[k].s_off = s_off;
            m[k].s_bytes = sr * scols * se;
            s_off += (m[k].s_bytes + 63) & ~(size_t)63;
        }
        memset(q, 0xAA, q_bytes);
        memset(sc, 0xAA, s_off);
        memset(q_ref, 0x55, q_bytes);
        memset(sc_ref, 0x55, s_off);
        t_ref = best_of(run_ref, ref_iters, &f, dt, m, nm, src, q_ref, sc_ref);
        t = best_of(run_host, iters, &f, dt, m, nm, src, q, sc);
        if (t < 0) {
            status = 1;
            goto out;
        }
        for (size_t i = 0; i < q_bytes; i++)
            wrong += q[i] != q_ref[i];
        for (int k = 0; k < nm; k++)
            for (size_t i = 0; i < m[k].s_bytes; i++)
                wrong += sc[m[k].s_off + i] != sc_ref[m[k].s_off + i];
        out_bytes = q_bytes;
        for (int k = 0; k < nm; k++)
            out_bytes += m[k].s_bytes;
        t_mc_out = best_memcpy(iters, mc, src, out_bytes);
        printf("%-12s %9.1f %9.1f %9.2f %9.2f %11.2f %11.2f %7.1fx %7llu\n", fmts[fi],
               (double)src_bytes / 1e6, (double)out_bytes / 1e6, (double)src_bytes / t_ref / 1e9,
               (double)src_bytes / t / 1e9, (double)out_bytes / t_mc_out / 1e9, t / t_mc_in,
               t_ref / t, (unsigned long long)wrong);
        if (wrong)
            status = 1;
    }
out:
    free(src);
    free(mc);
    free(q);
    free(q_ref);
    free(sc);
    free(sc_ref);
    return status;
}
