/* common/data/quant.c - host implementation of FP8 quantization (the contract is in quant.h):
 * one pass per block for amax, one to quantize, blocks walked one at a time so the second
 * pass reads from cache. */
#include "quant.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#define BLOCK_MAX (UINT32_C(1) << 31)

static inline uint32_t f2u(float f)
{
    uint32_t u;

    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float u2f(uint32_t u)
{
    float f;

    memcpy(&f, &u, sizeof(f));
    return f;
}

/* The same algorithm as PyTorch's c10::detail::fp8e4m3fn_from_fp32_value
 * (c10/util/Float8_e4m3fn.h), with its constants, written without branches: both of its
 * paths are computed and one is selected, which gives the same byte for every fp32 (checked
 * over all 2^32 of them against a transcription of c10's branchy code) and keeps the
 * per-element loop free of unpredictable branches. */
static inline uint8_t e4m3_from_float(float f)
{
    /* 480.0f, the first value above E4M3's range: 0 10000111 11100000000000000000000. */
    const uint32_t fp8_max = UINT32_C(1087) << 20;
    /* 2^14: adding it to |f| < 2^-6 leaves the E4M3 subnormal, rounded to nearest even, in
     * the low mantissa bits ((127 - 7) + (23 - 3) + 1 = 141). */
    const uint32_t denorm_mask = UINT32_C(141) << 23;
    uint32_t bits = f2u(f);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    uint32_t denorm, normal, mant_odd;

    bits ^= sign;
    /* |f| < 2^-6, the smallest E4M3 normal: the denormal path. */
    denorm = f2u(u2f(bits) + u2f(denorm_mask)) - denorm_mask;
    /* Otherwise rebias the exponent and add the rounding bias (0x7FFFF, plus one when the
     * kept mantissa is odd: ties go to even). */
    mant_odd = (bits >> 20) & 1;
    normal = (bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFF + mant_odd) >> 20;
    /* |f| >= 480, Inf and NaN: 0x7F (NaN). */
    uint32_t result = bits >= fp8_max ? 0x7F : bits < (UINT32_C(121) << 23) ? denorm : normal;
    return (uint8_t)(result | (sign >> 24));
}

uint8_t rf_quant_e4m3_from_float(float v)
{
    return e4m3_from_float(v);
}

float rf_quant_e4m3_to_float(uint8_t q)
{
    uint32_t sign = (uint32_t)(q & 0x80) << 24, exp = (q >> 3) & 0xF, mant = q & 0x7;
    float v;

    if (exp == 0xF && mant == 0x7)
        return u2f(sign | UINT32_C(0x7FC00000));
    if (exp == 0) {
        v = (float)mant * 0x1p-9f;
        return sign ? -v : v;
    }
    return u2f(sign | ((exp - 7 + 127) << 23) | (mant << 20));
}

float rf_quant_scale_of(float amax)
{
    float s = amax / RF_QUANT_E4M3_MAX;

    return s == 0.0f ? 1.0f : s;
}

uint8_t rf_quant_e8m0_of(float amax)
{
    uint32_t u = f2u(amax) & UINT32_C(0x7FFFFFFF);
    int fl, e;

    if (u == 0)
        return 127;
    /* floor(log2(amax)): the unbiased exponent, or for a subnormal -149 plus the index of
     * its highest set bit. */
    if (u >> 23)
        fl = (int)(u >> 23) - 127;
    else
        fl = -149 + (31 - __builtin_clz(u));
    e = fl - 8;
    if (e < -127)
        e = -127;
    if (e > 127)
        e = 127;
    return (uint8_t)(e + 127);
}

float rf_quant_e8m0_to_float(uint8_t e)
{
    if (e == 0xFF)
        return u2f(UINT32_C(0x7FC00000));
    if (e == 0)
        return u2f(UINT32_C(0x00400000)); /* 2^-127, an fp32 subnormal */
    return u2f((uint32_t)e << 23);
}

static inline float bf16_f(uint16_t h)
{
    return u2f((uint32_t)h << 16);
}

static inline float fp16_f(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    /* Normal, Inf/NaN, and subnormal (m * 2^-24, exact in fp32), selected without branches. */
    uint32_t normal = s | ((e + 127 - 15) << 23) | (m << 13);
    uint32_t special = s | UINT32_C(0x7F800000) | (m << 13);
    uint32_t sub = s | f2u((float)m * 0x1p-24f);

    return u2f(e == 0x1F ? special : e == 0 ? sub : normal);
}

/* The largest |x| of n finite elements from p, as the bits of |x| in the source's own
 * format: for non-negative floats the integer order is the numeric order, and a non-finite
 * element counts as 0. */
static uint32_t amax_bits(rf_dtype dt, const void *p, uint64_t n)
{
    const uint16_t *h = p;
    const uint32_t *w = p;
    uint32_t m = 0;

    switch (dt) {
    case RF_DT_BF16:
        for (uint64_t i = 0; i < n; i++) {
            uint32_t a = h[i] & 0x7FFFu;
            a = a < 0x7F80u ? a : 0;
            m = a > m ? a : m;
        }
        break;
    case RF_DT_FP16:
        for (uint64_t i = 0; i < n; i++) {
            uint32_t a = h[i] & 0x7FFFu;
            a = a < 0x7C00u ? a : 0;
            m = a > m ? a : m;
        }
        break;
    default:
        for (uint64_t i = 0; i < n; i++) {
            uint32_t a = w[i] & UINT32_C(0x7FFFFFFF);
            a = a < UINT32_C(0x7F800000) ? a : 0;
            m = a > m ? a : m;
        }
        break;
    }
    return m;
}

static float bits_to_f(rf_dtype dt, uint32_t b)
{
    switch (dt) {
    case RF_DT_BF16:
        return bf16_f((uint16_t)b);
    case RF_DT_FP16:
        return fp16_f((uint16_t)b);
    default:
        return u2f(b);
    }
}

/* One element: v = x / s, clamped to [-448, 448] with NaN kept, then NaN -> 0x7F and the
 * rest through e4m3_from_float. The clamp is done on the bits of |v|, whose integer order is
 * the numeric order (0x43E00000 = 448, 0x7F800000 = Inf, above it NaN): the same result as
 * the float comparisons, and no branch. */
static inline uint8_t quant_one(float x, float s)
{
    uint32_t b = f2u(x / s), sign = b & UINT32_C(0x80000000), a = b ^ sign;
    uint32_t nan = a > UINT32_C(0x7F800000);
    uint8_t r;

    a = a > UINT32_C(0x43E00000) ? UINT32_C(0x43E00000) : a;
    r = e4m3_from_float(u2f(a | sign));
    return nan ? 0x7F : r;
}

static void quant_run(rf_dtype dt, const void *p, uint64_t n, float s, uint8_t *q)
{
    const uint16_t *h = p;
    const float *w = p;

    switch (dt) {
    case RF_DT_BF16:
        for (uint64_t i = 0; i < n; i++)
            q[i] = quant_one(bf16_f(h[i]), s);
        break;
    case RF_DT_FP16:
        for (uint64_t i = 0; i < n; i++)
            q[i] = quant_one(fp16_f(h[i]), s);
        break;
    default:
        for (uint64_t i = 0; i < n; i++)
            q[i] = quant_one(w[i], s);
        break;
    }
}

static int check_fmt(const rf_quant_fmt *f, rf_err *err)
{
    if (f == NULL)
        return rf_err_set(err, -EINVAL, "quantization format is missing (NULL)");
    if (f->kind < RF_QUANT_BLOCK || f->kind > RF_QUANT_MXFP8 ||
        (f->kind == RF_QUANT_BLOCK && (f->br == 0 || f->bc == 0 || f->br > BLOCK_MAX ||
                                       f->bc > BLOCK_MAX)))
        return rf_err_set(err, -EINVAL, "malformed quantization format (kind %d, block %" PRIu32
                          "x%" PRIu32 "): build it with rf_quant_fmt_parse", f->kind, f->br, f->bc);
    return 0;
}

/* The block of format f on a rows x cols matrix (channel: a row; tensor: the matrix). */
static void grid(const rf_quant_fmt *f, uint64_t rows, uint64_t cols, uint64_t *br, uint64_t *bc)
{
    switch (f->kind) {
    case RF_QUANT_BLOCK:
        *br = f->br;
        *bc = f->bc;
        break;
    case RF_QUANT_CHANNEL:
        *br = 1;
        *bc = cols;
        break;
    case RF_QUANT_TENSOR:
        *br = rows;
        *bc = cols;
        break;
    default:
        *br = 1;
        *bc = RF_QUANT_MX_BLOCK;
        break;
    }
}

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return b == 0 ? 0 : a / b + (a % b != 0);
}

int rf_quant_fmt_parse(const char *s, rf_quant_fmt *out, rf_err *err)
{
    uint64_t dim[2] = {0, 0};
    const char *p;

    if (s == NULL)
        s = "";
    memset(out, 0, sizeof(*out));
    if (strcmp(s, "block") == 0) {
        *out = (rf_quant_fmt){RF_QUANT_BLOCK, 128, 128};
        return 0;
    }
    if (strcmp(s, "channel") == 0) {
        out->kind = RF_QUANT_CHANNEL;
        return 0;
    }
    if (strcmp(s, "tensor") == 0) {
        out->kind = RF_QUANT_TENSOR;
        return 0;
    }
    if (strcmp(s, "mxfp8") == 0) {
        *out = (rf_quant_fmt){RF_QUANT_MXFP8, 1, RF_QUANT_MX_BLOCK};
        return 0;
    }
    if (strncmp(s, "block:", 6) != 0)
        return rf_err_set(err, -EINVAL, "unknown quantization format \"%s\": expected block, "
                          "block:<rows>x<cols>, channel, tensor or mxfp8", s);
    p = s + 6;
    for (int k = 0; k < 2; k++) {
        const char *d = p;

        while (*p >= '0' && *p <= '9' && dim[k] <= BLOCK_MAX)
            dim[k] = dim[k] * 10 + (uint64_t)(*p++ - '0');
        if (p == d || dim[k] == 0 || dim[k] > BLOCK_MAX || *p != (k == 0 ? 'x' : '\0'))
            return rf_err_set(err, -EINVAL, "quantization format \"%s\": the block must be "
                              "<rows>x<cols>, each a number 1..%" PRIu32 " (block:128x128)", s,
                              BLOCK_MAX);
        p++;
    }
    *out = (rf_quant_fmt){RF_QUANT_BLOCK, (uint32_t)dim[0], (uint32_t)dim[1]};
    return 0;
}

int rf_quant_fmt_format(const rf_quant_fmt *f, char *buf, size_t len)
{
    if (check_fmt(f, NULL) < 0)
        return snprintf(buf, len, "?");
    switch (f->kind) {
    case RF_QUANT_BLOCK:
        return snprintf(buf, len, "block:%" PRIu32 "x%" PRIu32, f->br, f->bc);
    case RF_QUANT_CHANNEL:
        return snprintf(buf, len, "channel");
    case RF_QUANT_TENSOR:
        return snprintf(buf, len, "tensor");
    default:
        return snprintf(buf, len, "mxfp8");
    }
}

int rf_quant_scale_shape(const rf_quant_fmt *f, uint64_t rows, uint64_t cols, uint64_t *srows,
                         uint64_t *scols, rf_err *err)
{
    uint64_t br, bc;
    int rc = check_fmt(f, err);

    if (rc < 0)
        return rc;
    if (f->kind == RF_QUANT_TENSOR) {
        *srows = *scols = 1;
        return 0;
    }
    if (f->kind == RF_QUANT_CHANNEL) {
        *srows = rows;
        *scols = 1;
        return 0;
    }
    grid(f, rows, cols, &br, &bc);
    *srows = ceil_div(rows, br);
    *scols = ceil_div(cols, bc);
    return 0;
}

rf_dtype rf_quant_scale_dtype(const rf_quant_fmt *f)
{
    return f->kind == RF_QUANT_MXFP8 ? RF_DT_UINT8 : RF_DT_FP32;
}

/* The checks rf_quant_host and rf_quant_dequant_host share; fills the scale shape. */
static int check_args(const rf_quant_fmt *f, const char *fn, const void *in, int64_t in_stride,
                      uint64_t rows, uint64_t cols, const void *out, int64_t out_stride,
                      const void *scales, int64_t scale_stride, uint64_t *srows,
                      uint64_t *scols, rf_err *err)
{
    int rc = rf_quant_scale_shape(f, rows, cols, srows, scols, err);

    if (rc < 0)
        return rc;
    if (rows == 0 || cols == 0)
        return 0;
    if (in == NULL || out == NULL || scales == NULL)
        return rf_err_set(err, -EINVAL, "%s: a buffer of the %" PRIu64 "x%" PRIu64 " matrix is "
                          "NULL (input %p, output %p, scales %p)", fn, rows, cols, in, out, scales);
    if (rows > 1 && (in_stride < 0 || (uint64_t)in_stride < cols || out_stride < 0 ||
                     (uint64_t)out_stride < cols))
        return rf_err_set(err, -EINVAL, "%s: row strides %" PRId64 " (input) and %" PRId64
                          " (output) of the %" PRIu64 "x%" PRIu64 " matrix must be at least its "
                          "%" PRIu64 " columns", fn, in_stride, out_stride, rows, cols, cols);
    if (*srows > 1 && (scale_stride < 0 || (uint64_t)scale_stride < *scols))
        return rf_err_set(err, -EINVAL, "%s: the scales' row stride %" PRId64 " must be at least "
                          "their %" PRIu64 " columns (%" PRIu64 "x%" PRIu64 " scales)", fn,
                          scale_stride, *scols, *srows, *scols);
    return 0;
}

int rf_quant_host(const rf_quant_fmt *f, rf_dtype src_dt, const void *src, int64_t src_row_stride,
                  uint64_t rows, uint64_t cols, uint8_t *q, int64_t q_row_stride, void *scales,
                  int64_t scale_row_stride, rf_err *err)
{
    uint64_t srows, scols, br, bc;
    size_t es = rf_dtype_size(src_dt);
    int rc;

    if (src_dt != RF_DT_BF16 && src_dt != RF_DT_FP16 && src_dt != RF_DT_FP32)
        return rf_err_set(err, -EINVAL, "quantize: source dtype %s cannot be quantized; it must "
                          "be bf16, fp16 or fp32", rf_dtype_name(src_dt));
    rc = check_args(f, "quantize", src, src_row_stride, rows, cols, q, q_row_stride, scales,
                    scale_row_stride, &srows, &scols, err);
    if (rc < 0 || rows == 0 || cols == 0)
        return rc;
    grid(f, rows, cols, &br, &bc);
    for (uint64_t i = 0; i < srows; i++) {
        uint64_t r0 = i * br, nr = rows - r0 < br ? rows - r0 : br;

        for (uint64_t j = 0; j < scols; j++) {
            uint64_t c0 = j * bc, nc = cols - c0 < bc ? cols - c0 : bc;
            const char *base = (const char *)src + (int64_t)c0 * (int64_t)es;
            uint8_t *qb = q + c0;
            float amax = 0.0f, s;

            for (uint64_t r = r0; r < r0 + nr; r++) {
                float a = bits_to_f(src_dt, amax_bits(src_dt, base + (int64_t)r * src_row_stride *
                                                      (int64_t)es, nc));
                amax = a > amax ? a : amax;
            }
            if (f->kind == RF_QUANT_MXFP8) {
                uint8_t e = rf_quant_e8m0_of(amax);

                ((uint8_t *)scales)[(int64_t)i * scale_row_stride + (int64_t)j] = e;
                s = rf_quant_e8m0_to_float(e);
            } else {
                s = rf_quant_scale_of(amax);
                ((float *)scales)[(int64_t)i * scale_row_stride + (int64_t)j] = s;
            }
            for (uint64_t r = r0; r < r0 + nr; r++)
                quant_run(src_dt, base + (int64_t)r * src_row_stride * (int64_t)es, nc, s,
                          qb + (int64_t)r * q_row_stride);
        }
    }
    return 0;
}

int rf_quant_dequant_host(const rf_quant_fmt *f, const uint8_t *q, int64_t q_row_stride,
                          const void *scales, int64_t scale_row_stride, uint64_t rows,
                          uint64_t cols, float *out, int64_t out_row_stride, rf_err *err)
{
    uint64_t srows, scols, br, bc;
    int rc = check_args(f, "dequantize", q, q_row_stride, rows, cols, out, out_row_stride,
                        scales, scale_row_stride, &srows, &scols, err);

    if (rc < 0 || rows == 0 || cols == 0)
        return rc;
    grid(f, rows, cols, &br, &bc);
    for (uint64_t r = 0; r < rows; r++) {
        for (uint64_t c = 0; c < cols; c++) {
            int64_t si = (int64_t)(r / br) * scale_row_stride + (int64_t)(c / bc);
            float s = f->kind == RF_QUANT_MXFP8
                          ? rf_quant_e8m0_to_float(((const uint8_t *)scales)[si])
                          : ((const float *)scales)[si];

            out[(int64_t)r * out_row_stride + (int64_t)c] =
                rf_quant_e4m3_to_float(q[(int64_t)r * q_row_stride + (int64_t)c]) * s;
        }
    }
    return 0;
}

int rf_quant_box_ok(const rf_quant_fmt *f, uint64_t grows, uint64_t gcols, uint64_t row0,
                    uint64_t col0, uint64_t rows, uint64_t cols, rf_err *err)
{
    char fs[64];
    uint64_t br, bc, r1 = row0 + rows, c1 = col0 + cols;
    int rc = check_fmt(f, err);

    if (rc < 0)
        return rc;
    rf_quant_fmt_format(f, fs, sizeof(fs));
    if (rows == 0 || cols == 0 || row0 > grows || rows > grows - row0 || col0 > gcols ||
        cols > gcols - col0)
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] is empty or outside the %" PRIu64 "x%" PRIu64 " matrix",
                          row0, r1, col0, c1, grows, gcols);
    grid(f, grows, gcols, &br, &bc);
    if (f->kind == RF_QUANT_TENSOR && (rows != grows || cols != gcols))
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] is part of the %" PRIu64 "x%" PRIu64 " matrix, whose format "
                          "tensor has one scale for the whole matrix: only the whole matrix can be "
                          "quantized", row0, r1, col0, c1, grows, gcols);
    if (f->kind == RF_QUANT_CHANNEL && cols != gcols)
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] of the %" PRIu64 "x%" PRIu64 " matrix splits its rows; format "
                          "channel has one scale per row: the box must span all %" PRIu64
                          " columns", row0, r1, col0, c1, grows, gcols, gcols);
    if (row0 % br != 0 || (r1 % br != 0 && r1 != grows))
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] of the %" PRIu64 "x%" PRIu64 " matrix cuts the %" PRIu64 "x%"
                          PRIu64 " blocks of format %s: its row edges must fall on multiples of %"
                          PRIu64 " or on the matrix's end (%" PRIu64 ")", row0, r1, col0, c1,
                          grows, gcols, br, bc, fs, br, grows);
    if (col0 % bc != 0 || (c1 % bc != 0 && c1 != gcols))
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] of the %" PRIu64 "x%" PRIu64 " matrix cuts the %" PRIu64 "x%"
                          PRIu64 " blocks of format %s: its column edges must fall on multiples "
                          "of %" PRIu64 " or on the matrix's end (%" PRIu64 ")", row0, r1, col0,
                          c1, grows, gcols, br, bc, fs, bc, gcols);
    return 0;
}
