/* tests/unit/test_quant_cuda.c - the GPU FP8 quantizer (quant_cuda.h) against rf_quant_host, byte
 * for byte, values and scales and the padding around them: random matrices of every source
 * dtype in every format (partial edge blocks, padded strides), planted edge blocks, every
 * 16-bit pattern, rounding ties; every argument check, which needs no GPU; and the memory of
 * the receiver's GPU shadows (qshadow.h), which this quantizer quantizes. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "drv_cuda.h"
#include "qshadow.h"
#include "quant.h"
#include "quant_cuda.h"

#define FILL 0xA5 /* what every output buffer holds before: bytes left alone stay FILL */

static void need_gpu(void)
{
    if (!rf_cuda_available())
        cr_skip_test("no CUDA device");
}

static uint64_t rng = 0x9E3779B97F4A7C15ULL;

static uint64_t rnd(uint64_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return n ? rng % n : 0;
}

static rf_quant_fmt fmt(const char *s)
{
    rf_quant_fmt f;
    rf_err err = {0};

    cr_assert_eq(rf_quant_fmt_parse(s, &f, &err), 0, "%s: %s", s, err.msg);
    return f;
}

/* A host matrix: rows x cols elements of dt, row r at r * stride elements. */
typedef struct mat {
    rf_dtype dt;
    uint64_t rows, cols;
    int64_t stride;
    uint8_t *h;
} mat;

static size_t mat_bytes(const mat *m)
{
    return ((size_t)(m->rows - 1) * (size_t)m->stride + m->cols) * rf_dtype_size(m->dt);
}

static mat mat_new(rf_dtype dt, uint64_t rows, uint64_t cols, int64_t pad)
{
    mat m = {dt, rows, cols, (int64_t)cols + pad, NULL};

    m.h = malloc(mat_bytes(&m));
    cr_assert(m.h);
    /* Padding holds values that would change every scale if they were read. */
    for (size_t i = 0; i < mat_bytes(&m); i++)
        m.h[i] = 0x7B;
    return m;
}

static void mat_set(mat *m, uint64_t r, uint64_t c, uint32_t bits)
{
    size_t i = (size_t)r * (size_t)m->stride + c;

    if (m->dt == RF_DT_FP32)
        memcpy(m->h + 4 * i, &bits, 4);
    else {
        uint16_t h = (uint16_t)bits;

        memcpy(m->h + 2 * i, &h, 2);
    }
}

/* A random element of dt around 2^base (biased exponent of dt), spread 2^-spread below, now
 * and then +-0, a subnormal, +-Inf or NaN. */
static uint32_t rand_elem(rf_dtype dt, int base, int spread)
{
    const int ebits = dt == RF_DT_FP16 ? 5 : 8, mbits = dt == RF_DT_FP16 ? 10 : dt == RF_DT_BF16 ? 7 : 23;
    const uint32_t emax = (1u << ebits) - 1;
    uint32_t sign = (uint32_t)rnd(2) << (ebits + mbits), k = (uint32_t)rnd(64);
    uint32_t mant = (uint32_t)rnd(1ull << mbits);
    int e;

    if (k == 0)
        return sign;
    if (k == 1)
        return sign | mant;
    if (k == 2)
        return sign | (emax << mbits);
    if (k == 3)
        return sign | (emax << mbits) | (mant | 1);
    e = base - (int)rnd((uint64_t)spread + 1);
    e = e < 1 ? 1 : e > (int)emax - 1 ? (int)emax - 1 : e;
    return sign | ((uint32_t)e << mbits) | mant;
}

/* Fills m at random, each row around a magnitude of its own (some rows far beyond 448, some
 * in the subnormal range), the quotients spread over E4M3's whole range. */
static void mat_random(mat *m)
{
    const int emax = m->dt == RF_DT_FP16 ? 31 : 255;

    for (uint64_t r = 0; r < m->rows; r++) {
        int base = 1 + (int)rnd((uint64_t)emax - 1);

        for (uint64_t c = 0; c < m->cols; c++)
            mat_set(m, r, c, rand_elem(m->dt, base, m->dt == RF_DT_FP16 ? 12 : 24));
    }
}

/* rf_quant_host and rf_quant_cuda_quantize on m in format fs, q and scales with row pads
 * qpad and spad, compared byte for byte with what lies between their rows. */
static void compare(const char *fs, const mat *m, int64_t qpad, int64_t spad, const char *what)
{
    rf_quant_fmt f = fmt(fs);
    uint64_t srows, scols;
    size_t es = rf_dtype_size(m->dt), ss = rf_dtype_size(rf_quant_scale_dtype(&f));
    int64_t qstride = (int64_t)m->cols + qpad, sstride;
    size_t qbytes, sbytes, srcbytes = mat_bytes(m);
    uint8_t *hq, *hs, *gq, *gs, *dsrc = NULL, *dq = NULL, *ds = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_quant_scale_shape(&f, m->rows, m->cols, &srows, &scols, &err), 0);
    sstride = (int64_t)scols + spad;
    qbytes = (size_t)(m->rows - 1) * (size_t)qstride + m->cols;
    sbytes = ((size_t)(srows - 1) * (size_t)sstride + scols) * ss;
    hq = malloc(qbytes);
    gq = malloc(qbytes);
    hs = malloc(sbytes);
    gs = malloc(sbytes);
    cr_assert(hq && gq && hs && gs);
    memset(hq, FILL, qbytes);
    memset(hs, FILL, sbytes);
    cr_assert_eq(cudaMalloc((void **)&dsrc, srcbytes), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&dq, qbytes), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&ds, sbytes), cudaSuccess);
    cr_assert_eq(cudaMemcpy(dsrc, m->h, srcbytes, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(cudaMemset(dq, FILL, qbytes), cudaSuccess);
    cr_assert_eq(cudaMemset(ds, FILL, sbytes), cudaSuccess);

    cr_assert_eq(rf_quant_host(&f, m->dt, m->h, m->stride, m->rows, m->cols, hq, qstride, hs,
                               sstride, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_quant_cuda_quantize(&f, m->dt, dsrc, m->stride, m->rows, m->cols, dq,
                                        qstride, ds, sstride, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    cr_assert_eq(cudaMemcpy(gq, dq, qbytes, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(cudaMemcpy(gs, ds, sbytes, cudaMemcpyDeviceToHost), cudaSuccess);

    for (size_t i = 0; i < sbytes; i++) {
        if (hs[i] != gs[i]) {
            size_t e = i / ss;

            cr_assert_fail("%s: %s %s %" PRIu64 "x%" PRIu64 " (stride %" PRId64 "): scale [%zu, "
                           "%zu] (byte %zu) differs: host byte 0x%02x, GPU 0x%02x", what, fs,
                           rf_dtype_name(m->dt), m->rows, m->cols, m->stride,
                           e / (size_t)sstride, e % (size_t)sstride, i % ss, hs[i], gs[i]);
        }
    }
    for (size_t i = 0; i < qbytes; i++) {
        if (hq[i] != gq[i]) {
            size_t r = i / (size_t)qstride, c = i % (size_t)qstride;
            uint32_t x = 0;

            if (c < m->cols)
                memcpy(&x, m->h + (r * (size_t)m->stride + c) * es, es);
            cr_assert_fail("%s: %s %s %" PRIu64 "x%" PRIu64 " (stride %" PRId64 "): q [%zu, %zu] "
                           "differs: host 0x%02x, GPU 0x%02x (source bits 0x%0*x)", what, fs,
                           rf_dtype_name(m->dt), m->rows, m->cols, m->stride, r, c, hq[i],
                           gq[i], (int)(2 * es), x);
        }
    }
    cudaFree(dsrc);
    cudaFree(dq);
    cudaFree(ds);
    free(hq);
    free(gq);
    free(hs);
    free(gs);
}

static const char *const formats[] = {
    "block", "block:1x1", "block:3x7", "block:128x1", "block:1x128", "block:64x64",
    "block:200x300", "channel", "tensor", "mxfp8",
};
#define NFMT (sizeof(formats) / sizeof(formats[0]))

static void random_matrices(rf_dtype dt)
{
    static const uint64_t shapes[][2] = {
        {1, 1}, {1, 33}, {5, 3}, {31, 64}, {128, 256}, {130, 257}, {257, 130}, {300, 1000},
        {1024, 2048},
    };

    need_gpu();
    for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++) {
        uint64_t rows = shapes[k][0], cols = shapes[k][1];
        int64_t pad = k % 2 ? (int64_t)rnd(6) : 0;
        mat m = mat_new(dt, rows, cols, pad);

        mat_random(&m);
        for (size_t i = 0; i < NFMT; i++)
            compare(formats[i], &m, (int64_t)rnd(3) * (int64_t)(k % 2), (int64_t)rnd(3),
                    "random");
        free(m.h);
    }
}

Test(quant_cuda, random_bf16, .timeout = 600)
{
    random_matrices(RF_DT_BF16);
}

Test(quant_cuda, random_fp16, .timeout = 600)
{
    random_matrices(RF_DT_FP16);
}

Test(quant_cuda, random_fp32, .timeout = 600)
{
    random_matrices(RF_DT_FP32);
}

/* The bits of an edge value of dt: what is +-0, the largest subnormal pattern, +Inf, a NaN. */
typedef struct edges {
    uint32_t sign, sub_max, inf, nan, max_finite;
} edges;

static edges edges_of(rf_dtype dt)
{
    switch (dt) {
    case RF_DT_FP16:
        return (edges){0x8000, 0x3FF, 0x7C00, 0x7E00, 0x7BFF};
    case RF_DT_BF16:
        return (edges){0x8000, 0x7F, 0x7F80, 0x7FC0, 0x7F7F};
    default:
        return (edges){0x80000000u, 0x7FFFFF, 0x7F800000u, 0x7FC00000u, 0x7F7FFFFFu};
    }
}

/* A 384 x 320 matrix whose 128 x 128 blocks (and every 1 x 32 block inside them) are each one
 * kind of edge, the right column of blocks partial (64 wide): zeros (both signs); subnormals of
 * the source type only; beyond 448 with NaN and +-Inf among them; all NaN (both signs); all
 * +-Inf; random values; only the largest finite values; moderate values with a NaN or an Inf
 * now and then; subnormals with a few small normals. */
static void planted(rf_dtype dt, mat *m)
{
    edges e = edges_of(dt);
    /* 448 * 8 and up to the largest finite: beyond 448 for every source type. */
    uint32_t big = dt == RF_DT_FP16 ? 0x7000 : dt == RF_DT_BF16 ? 0x4560 : 0x45600000u;
    int mid = dt == RF_DT_FP16 ? 15 : 127; /* the biased exponent of 1.0 */

    for (uint64_t r = 0; r < m->rows; r++) {
        for (uint64_t c = 0; c < m->cols; c++) {
            uint32_t s = rnd(2) ? e.sign : 0, x;

            switch ((r / 128) * 3 + c / 128) {
            case 0:
                x = s;
                break;
            case 1:
                x = s | (uint32_t)rnd(e.sub_max + 1);
                break;
            case 2:
                x = rnd(7) == 0 ? s | (rnd(2) ? e.nan : e.inf)
                                : s | (big + (uint32_t)rnd(e.max_finite - big + 1));
                break;
            case 3:
                x = s | e.nan | (uint32_t)rnd(2);
                break;
            case 4:
                x = s | e.inf;
                break;
            case 5:
                x = rand_elem(dt, mid + 3, 24);
                break;
            case 6:
                x = s | (e.max_finite - (uint32_t)rnd(2));
                break;
            case 7:
                x = rnd(50) == 0 ? s | (rnd(2) ? e.nan : e.inf) : rand_elem(dt, mid, 6);
                break;
            default:
                x = rnd(20) == 0 ? rand_elem(dt, 2, 1) : s | (uint32_t)rnd(e.sub_max + 1);
                break;
            }
            mat_set(m, r, c, x);
        }
    }
}

static void edge_blocks(rf_dtype dt)
{
    need_gpu();
    for (int pad = 0; pad <= 3; pad += 3) {
        mat m = mat_new(dt, 384, 320, pad);

        planted(dt, &m);
        for (size_t i = 0; i < NFMT; i++)
            compare(formats[i], &m, pad, pad ? 1 : 0, "planted edge blocks");
        free(m.h);
    }
}

Test(quant_cuda, edge_blocks_bf16)
{
    edge_blocks(RF_DT_BF16);
}

Test(quant_cuda, edge_blocks_fp16)
{
    edge_blocks(RF_DT_FP16);
}

Test(quant_cuda, edge_blocks_fp32)
{
    edge_blocks(RF_DT_FP32);
}

/* Whole matrices of one edge each, where CHANNEL and TENSOR see nothing else: all zero, all
 * NaN, all Inf, subnormal only, and fp32 values so small that amax / 448 underflows to 0. */
Test(quant_cuda, uniform_edge_matrices)
{
    static const rf_dtype dts[] = {RF_DT_BF16, RF_DT_FP16, RF_DT_FP32};

    need_gpu();
    for (size_t d = 0; d < 3; d++) {
        edges e = edges_of(dts[d]);

        for (int kind = 0; kind < 5; kind++) {
            mat m = mat_new(dts[d], 37, 70, 2);

            if (kind == 4 && dts[d] != RF_DT_FP32) {
                free(m.h);
                continue;
            }
            for (uint64_t r = 0; r < m.rows; r++)
                for (uint64_t c = 0; c < m.cols; c++) {
                    uint32_t s = rnd(2) ? e.sign : 0;
                    uint32_t v[] = {s, s | e.nan, s | e.inf, s | (uint32_t)rnd(e.sub_max + 1),
                                    s | (uint32_t)rnd(0x100)};

                    mat_set(&m, r, c, v[kind]);
                }
            for (size_t i = 0; i < NFMT; i++)
                compare(formats[i], &m, 1, 1, "uniform edge matrix");
            free(m.h);
        }
    }
}

/* Every bf16 and every fp16 pattern, in one 256 x 256 matrix each (row = high byte). */
Test(quant_cuda, every_16bit_pattern)
{
    static const rf_dtype dts[] = {RF_DT_BF16, RF_DT_FP16};

    need_gpu();
    for (size_t d = 0; d < 2; d++) {
        mat m = mat_new(dts[d], 256, 256, 0);

        for (uint32_t u = 0; u < 65536; u++)
            mat_set(&m, u >> 8, u & 0xFF, u);
        for (size_t i = 0; i < NFMT; i++)
            compare(formats[i], &m, 0, 0, "every 16-bit pattern");
        free(m.h);
    }
}

/* fp32 rows of 1 x 64 blocks whose amax is 448, so the scale is exactly 1 and the quotient is
 * the element: every E4M3 rounding tie (the midpoint of two neighbours) and the fp32 values
 * one ulp either side, both signs, through the e4m3 conversion itself. */
Test(quant_cuda, rounding_ties_at_scale_one)
{
    mat m;

    need_gpu();
    m = mat_new(RF_DT_FP32, 126, 64, 0);
    for (uint32_t k = 0; k < 126; k++) {
        float lo = rf_quant_e4m3_to_float((uint8_t)k), hi = rf_quant_e4m3_to_float((uint8_t)(k + 1));
        float mid = (lo + hi) / 2; /* exact: neighbours differ in their last mantissa bit */
        uint32_t b;

        memcpy(&b, &mid, 4);
        mat_set(&m, k, 0, 0x43E00000u); /* 448 */
        for (uint64_t c = 1; c < m.cols; c++) {
            uint32_t x = b + (uint32_t)((int)rnd(3) - 1);

            mat_set(&m, k, c, (rnd(2) ? 0x80000000u : 0) | x);
        }
    }
    compare("block:1x64", &m, 0, 0, "rounding ties");
    compare("channel", &m, 0, 0, "rounding ties");
    compare("tensor", &m, 0, 0, "rounding ties");
    free(m.h);
}

/* TENSOR's amax over many thread blocks, and BLOCK's and MXFP8's grid-stride loops past one
 * launch's 65536 blocks. */
Test(quant_cuda, large_matrices, .timeout = 600)
{
    mat m;

    need_gpu();
    m = mat_new(RF_DT_BF16, 4096, 2048 + 64, 0);
    mat_random(&m);
    m.cols = 2048; /* a strided view of the wider matrix */
    compare("tensor", &m, 0, 0, "large");
    compare("mxfp8", &m, 0, 0, "large");
    compare("block:1x64", &m, 0, 0, "large");
    compare("block", &m, 0, 0, "large");
    free(m.h);
}

/* A plan of many matrices (every format and source dtype, strided and misaligned views of one
 * source buffer, so that both the 16-byte and the element path run) launched in three runs,
 * against rf_quant_host matrix by matrix; the bytes between the outputs stay FILL. */
Test(quant_cuda, plan_of_many_matrices, .timeout = 600)
{
    static const char *const fs[] = {"block", "block:64x64", "block:3x7", "channel", "mxfp8",
                                     "tensor", "block:1x128", "block:128x1"};
    static const rf_dtype dts[] = {RF_DT_BF16, RF_DT_FP16, RF_DT_FP32};
    enum { N = 48, SRC_BYTES = 8 << 20, OUT_BYTES = 4 << 20 };
    rf_quant_cuda_op ops[N];
    size_t qoff[N], soff[N], qlen[N], slen[N], at_q = 0, at_s = 0, src_at = 0;
    uint8_t *hsrc = malloc(SRC_BYTES), *hq = malloc(OUT_BYTES), *hs = malloc(OUT_BYTES);
    uint8_t *gq = malloc(OUT_BYTES), *gs = malloc(OUT_BYTES), *dsrc, *dq, *ds;
    rf_quant_cuda_plan *pl = NULL;
    rf_err err = {0};

    need_gpu();
    cr_assert(hsrc && hq && hs && gq && gs);
    for (size_t i = 0; i < SRC_BYTES; i += 2) {
        uint16_t h = (uint16_t)rand_elem(RF_DT_BF16, 100 + (int)rnd(60), 20);

        memcpy(hsrc + i, &h, 2);
    }
    cr_assert_eq(cudaMalloc((void **)&dsrc, SRC_BYTES), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&dq, OUT_BYTES), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&ds, OUT_BYTES), cudaSuccess);
    cr_assert_eq(cudaMemcpy(dsrc, hsrc, SRC_BYTES, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(cudaMemset(dq, FILL, OUT_BYTES), cudaSuccess);
    cr_assert_eq(cudaMemset(ds, FILL, OUT_BYTES), cudaSuccess);
    memset(hq, FILL, OUT_BYTES);
    memset(hs, FILL, OUT_BYTES);
    for (size_t i = 0; i < N; i++) {
        rf_quant_cuda_op *o = &ops[i];
        rf_dtype dt = dts[i % 3];
        size_t es = rf_dtype_size(dt), ss;
        /* Every fourth matrix misaligned by one element, its stride padded by one. */
        int odd = i % 4 == 3;
        uint64_t rows = 1 + rnd(300), cols = 8 * (1 + rnd(48)) + (odd ? 1 : 0), srows, scols;

        o->fmt = fmt(fs[i % (sizeof(fs) / sizeof(fs[0]))]);
        o->dt = dt;
        o->rows = rows;
        o->cols = cols;
        o->src_row_stride = (int64_t)cols + (odd ? 1 : (int64_t)(8 * rnd(2)));
        src_at = (src_at + 255) & ~(size_t)255;
        src_at += odd ? es : 0;
        o->src = dsrc + src_at;
        cr_assert_eq(rf_quant_scale_shape(&o->fmt, rows, cols, &srows, &scols, &err), 0);
        ss = rf_dtype_size(rf_quant_scale_dtype(&o->fmt));
        o->q_row_stride = (int64_t)cols + (int64_t)(8 * rnd(2));
        o->scale_row_stride = (int64_t)scols + (int64_t)rnd(2);
        qoff[i] = at_q;
        qlen[i] = (size_t)(rows - 1) * (size_t)o->q_row_stride + cols;
        soff[i] = (at_s + 3) & ~(size_t)3;
        slen[i] = ((size_t)(srows - 1) * (size_t)o->scale_row_stride + scols) * ss;
        o->q = dq + qoff[i];
        o->scales = ds + soff[i];
        at_q = (qoff[i] + qlen[i] + 64 + 15) & ~(size_t)15;
        at_s = soff[i] + slen[i] + 16;
        cr_assert(src_at + ((size_t)(rows - 1) * (size_t)o->src_row_stride + cols) * es <
                  SRC_BYTES && at_q < OUT_BYTES && at_s < OUT_BYTES, "test buffers too small");
        cr_assert_eq(rf_quant_host(&o->fmt, dt, hsrc + src_at, o->src_row_stride, rows, cols,
                                   hq + qoff[i], o->q_row_stride, hs + soff[i],
                                   o->scale_row_stride, &err), 0, "%s", err.msg);
        src_at += ((size_t)(rows - 1) * (size_t)o->src_row_stride + cols) * es;
    }
    cr_assert_eq(rf_quant_cuda_plan_new(ops, N, &pl, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_quant_cuda_plan_bytes(pl), 0);
    cr_assert_eq(rf_quant_cuda_plan_launch(pl, 0, 5, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_quant_cuda_plan_launch(pl, 5, 30, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_quant_cuda_plan_launch(pl, 35, N - 35, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_quant_cuda_plan_launch(pl, N, 0, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_quant_cuda_plan_launch(pl, 40, N, 0, &err), -EINVAL);
    cr_assert(strstr(err.msg, "matrices [40, 88) of a plan of 48") != NULL, "%s", err.msg);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    cr_assert_eq(cudaMemcpy(gq, dq, OUT_BYTES, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(cudaMemcpy(gs, ds, OUT_BYTES, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < N; i++) {
        for (size_t b = 0; b < qlen[i]; b++)
            cr_assert_eq(gq[qoff[i] + b], hq[qoff[i] + b], "matrix %zu (%s %s %" PRIu64 "x%"
                         PRIu64 "): q byte %zu: GPU 0x%02x, host 0x%02x", i,
                         fs[i % (sizeof(fs) / sizeof(fs[0]))], rf_dtype_name(ops[i].dt),
                         ops[i].rows, ops[i].cols, b, gq[qoff[i] + b], hq[qoff[i] + b]);
        for (size_t b = 0; b < slen[i]; b++)
            cr_assert_eq(gs[soff[i] + b], hs[soff[i] + b], "matrix %zu (%s): scale byte %zu", i,
                         fs[i % (sizeof(fs) / sizeof(fs[0]))], b);
    }
    cr_assert_eq(memcmp(gq, hq, OUT_BYTES), 0, "bytes outside the matrices' rows were written");
    cr_assert_eq(memcmp(gs, hs, OUT_BYTES), 0, "bytes outside the scale rows were written");
    rf_quant_cuda_plan_free(pl);
    cudaFree(dsrc);
    cudaFree(dq);
    cudaFree(ds);
    free(hsrc);
    free(hq);
    free(hs);
    free(gq);
    free(gs);
}

/* ---- argument checks: no GPU needed, nothing touches the (fake) pointers ---- */

#define FAKE(a) ((void *)(uintptr_t)(a))

struct bad_case {
    const char *what;
    int fmt_kind; /* 0: "block"; -1: NULL format; -2: kind 0; -3: block 0 x 128 */
    rf_dtype dt;
    uintptr_t src, q, scales;
    int64_t sstride, qstride, scstride;
    uint64_t rows, cols;
    const char *msg;
    int host_too; /* rf_quant_host refuses it the same way */
};

Test(quant_cuda, argument_errors)
{
    const struct bad_case cs[] = {
        {"int8 source", 0, RF_DT_INT8, 0x1000, 0x2000, 0x3000, 4, 4, 1, 4, 4, "dtype int8", 1},
        {"fp8 source", 0, RF_DT_FP8_E4M3, 0x1000, 0x2000, 0x3000, 4, 4, 1, 4, 4, "bf16, fp16", 1},
        {"NULL format", -1, RF_DT_BF16, 0x1000, 0x2000, 0x3000, 4, 4, 1, 4, 4, "NULL", 1},
        {"kind 0", -2, RF_DT_BF16, 0x1000, 0x2000, 0x3000, 4, 4, 1, 4, 4, "malformed", 1},
        {"block 0 x 128", -3, RF_DT_BF16, 0x1000, 0x2000, 0x3000, 4, 4, 1, 4, 4, "malformed", 1},
        {"NULL source", 0, RF_DT_BF16, 0, 0x2000, 0x3000, 4, 4, 1, 4, 4, "is NULL", 1},
        {"NULL q", 0, RF_DT_BF16, 0x1000, 0, 0x3000, 4, 4, 1, 4, 4, "is NULL", 1},
        {"NULL scales", 0, RF_DT_BF16, 0x1000, 0x2000, 0, 4, 4, 1, 4, 4, "is NULL", 1},
        {"short source stride", 0, RF_DT_BF16, 0x1000, 0x2000, 0x3000, 3, 4, 1, 2, 4,
         "row strides 3 (input)", 1},
        {"short q stride", 0, RF_DT_FP32, 0x1000, 0x2000, 0x3000, 4, 3, 1, 2, 4,
         "and 3 (output)", 1},
        {"negative stride", 0, RF_DT_FP16, 0x1000, 0x2000, 0x3000, -4, 4, 1, 2, 4,
         "row strides -4", 1},
        {"short scale stride", 0, RF_DT_BF16, 0x1000, 0x2000, 0x3000, 300, 300, 2, 200, 300,
         "row stride 2 must be at least their 3", 1},
        {"misaligned bf16 source", 0, RF_DT_BF16, 0x1001, 0x2000, 0x3000, 4, 4, 1, 4, 4,
         "aligned", 0},
        {"misaligned fp32 source", 0, RF_DT_FP32, 0x1002, 0x2000, 0x3000, 4, 4, 1, 4, 4,
         "aligned", 0},
        {"misaligned fp32 scales", 0, RF_DT_BF16, 0x1000, 0x2000, 0x3001, 4, 4, 1, 4, 4,
         "aligned", 0},
    };

    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
        rf_quant_fmt f = fmt("block"), *fp = &f;
        rf_err err = {0}, herr = {0};
        int rc, hrc;

        if (cs[i].fmt_kind == -1)
            fp = NULL;
        else if (cs[i].fmt_kind == -2)
            f.kind = 0;
        else if (cs[i].fmt_kind == -3)
            f.br = 0;
        rc = rf_quant_cuda_quantize(fp, cs[i].dt, FAKE(cs[i].src), cs[i].sstride, cs[i].rows,
                                    cs[i].cols, FAKE(cs[i].q), cs[i].qstride,
                                    FAKE(cs[i].scales), cs[i].scstride, 0, &err);
        cr_assert_eq(rc, -EINVAL, "%s: %d", cs[i].what, rc);
        cr_assert_eq(err.code, -EINVAL, "%s", cs[i].what);
        cr_assert(strstr(err.msg, cs[i].msg) != NULL, "%s: \"%s\" lacks \"%s\"", cs[i].what,
                  err.msg, cs[i].msg);
        if (!cs[i].host_too)
            continue;
        hrc = rf_quant_host(fp, cs[i].dt, FAKE(cs[i].src), cs[i].sstride, cs[i].rows,
                            cs[i].cols, FAKE(cs[i].q), cs[i].qstride, FAKE(cs[i].scales),
                            cs[i].scstride, &herr);
        cr_assert_eq(hrc, rc, "%s: host %d, GPU %d", cs[i].what, hrc, rc);
    }
}

/* A plan refuses a bad matrix by its index, before it touches the device. */
Test(quant_cuda, plan_refuses_bad_matrix)
{
    rf_quant_cuda_op ops[2] = {
        {fmt("block"), RF_DT_BF16, FAKE(0x1000), 4, 4, 4, FAKE(0x2000), 4, FAKE(0x3000), 1},
        {fmt("block"), RF_DT_INT8, FAKE(0x1000), 4, 4, 4, FAKE(0x2000), 4, FAKE(0x3000), 1},
    };
    rf_quant_cuda_plan *pl = FAKE(1);
    rf_err err = {0};

    cr_assert_eq(rf_quant_cuda_plan_new(ops, 2, &pl, &err), -EINVAL);
    cr_assert_null(pl);
    cr_assert(strstr(err.msg, "matrix 1 of the plan") && strstr(err.msg, "dtype int8"), "%s",
              err.msg);
}

/* An empty matrix enqueues nothing and reads no pointer; a bad format or dtype is still one. */
Test(quant_cuda, empty_matrix)
{
    rf_quant_fmt f = fmt("mxfp8"), bad = {0, 0, 0};
    rf_err err = {0};

    cr_assert_eq(rf_quant_cuda_quantize(&f, RF_DT_BF16, NULL, 0, 0, 128, NULL, 0, NULL, 0, 0,
                                        &err), 0, "%s", err.msg);
    cr_assert_eq(rf_quant_cuda_quantize(&f, RF_DT_FP32, NULL, 0, 64, 0, NULL, 0, NULL, 0, 0,
                                        &err), 0, "%s", err.msg);
    cr_assert_eq(rf_quant_cuda_quantize(&bad, RF_DT_BF16, NULL, 0, 0, 0, NULL, 0, NULL, 0, 0,
                                        &err), -EINVAL);
    cr_assert_eq(rf_quant_cuda_quantize(&f, RF_DT_INT32, NULL, 0, 0, 0, NULL, 0, NULL, 0, 0,
                                        &err), -EINVAL);
}

/* A CUDA failure comes back as a negative errno with CUDA's message: TENSOR's first call (the
 * memset of its scale) on an address that is no device memory. Where the runtime takes the
 * address and the kernel faults instead, the stream reports it. */
Test(quant_cuda, cuda_error_reported)
{
    rf_quant_fmt f = fmt("tensor");
    uint16_t *src = NULL;
    uint8_t *q = NULL;
    rf_err err = {0};
    int rc;

    need_gpu();
    cr_assert_eq(cudaMalloc((void **)&src, 64 * 64 * 2), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&q, 64 * 64), cudaSuccess);
    cr_assert_eq(cudaMemset(src, 0, 64 * 64 * 2), cudaSuccess);
    rc = rf_quant_cuda_quantize(&f, RF_DT_BF16, src, 64, 64, 64, q, 64, FAKE(0x10000), 1, 0,
                                &err);
    if (rc < 0) {
        cr_assert(strstr(err.msg, "cudaMemsetAsync") != NULL, "%s", err.msg);
    } else {
        cr_assert_neq(cudaDeviceSynchronize(), cudaSuccess,
                      "a kernel wrote to address 0x10000 and nothing failed");
    }
}

/* A shadow goes beside its piece, on its GPU; one larger than the GPU's memory is refused,
 * naming its size and the GPU (the receiver then refuses the plan slice, naming the tensor). */
Test(quant_cuda, shadow_on_the_pieces_gpu_and_refused_past_its_memory)
{
    uint8_t *piece = NULL;
    rf_qshadow sh;
    rf_err err = {0};
    char want[96];

    need_gpu();
    cr_assert_eq(cudaSetDevice(0), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&piece, 4096), cudaSuccess);
    cr_assert_eq(rf_qshadow_alloc(&sh, piece + 100, 4096, &err), 0, "%s", err.msg);
    cr_assert_eq(sh.dev, 0);
    cr_assert_eq(cudaMemset(sh.buf, 1, 4096), cudaSuccess);
    rf_qshadow_free(&sh);
    cr_assert_null(sh.buf);
    cr_assert_eq(rf_qshadow_alloc(&sh, piece, 1ull << 50, &err), -ENOMEM);
    cr_assert_null(sh.buf);
    snprintf(want, sizeof(want), "cannot allocate a %llu-byte shadow on GPU 0",
             (unsigned long long)(1ull << 50));
    cr_assert(strstr(err.msg, want) != NULL, "%s", err.msg);
    /* The failure is not left for the next CUDA call to report. */
    cr_assert_eq(cudaGetLastError(), cudaSuccess);
    cudaFree(piece);
}

#else

Test(quant_cuda, skipped)
{
    cr_skip_test("no CUDA device (built without CUDA)");
}

#endif
