/* common/data/quant.c - host implementation of FP8 quantization (the contract is in quant.h):
 * one pass per block for amax, one to quantize, blocks walked one at a time so the second
 * pass reads from cache; the passes vectorized, with AVX2 or AVX-512 where the CPU has them. */
#include "quant.h"

#include <inttypes.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <stdio.h>
#include <string.h>

/* The same algorithm as PyTorch's c10::detail::fp8e4m3fn_from_fp32_value
 * (c10/util/Float8_e4m3fn.h), with its constants, written without branches: both of its
 * paths are computed and one is selected, which gives the same byte for every fp32 (checked
 * over all 2^32 of them against a transcription of c10's branchy code) and keeps the
 * per-element loop free of unpredictable branches. */
static inline __attribute__((always_inline)) uint8_t e4m3_from_float(float f)
{
    /* 480.0f, the first value above E4M3's range: 0 10000111 11100000000000000000000. */
    const uint32_t fp8_max = UINT32_C(1087) << 20;
    /* 2^14: adding it to |f| < 2^-6 leaves the E4M3 subnormal, rounded to nearest even, in
     * the low mantissa bits ((127 - 7) + (23 - 3) + 1 = 141). */
    const uint32_t denorm_mask = UINT32_C(141) << 23;
    uint32_t bits = rf_quant_f2u(f);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    uint32_t denorm, normal, mant_odd;

    bits ^= sign;
    /* |f| < 2^-6, the smallest E4M3 normal: the denormal path. */
    denorm = rf_quant_f2u(rf_quant_u2f(bits) + rf_quant_u2f(denorm_mask)) - denorm_mask;
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
        return rf_quant_u2f(sign | UINT32_C(0x7FC00000));
    if (exp == 0) {
        v = (float)mant * 0x1p-9f;
        return sign ? -v : v;
    }
    return rf_quant_u2f(sign | ((exp - 7 + 127) << 23) | (mant << 20));
}

float rf_quant_scale_of(float amax)
{
    float s = amax / RF_QUANT_E4M3_MAX;

    return s == 0.0f ? 1.0f : s;
}

uint8_t rf_quant_e8m0_of(float amax)
{
    uint32_t u = rf_quant_f2u(amax) & UINT32_C(0x7FFFFFFF);
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
        return rf_quant_u2f(UINT32_C(0x7FC00000));
    if (e == 0)
        return rf_quant_u2f(UINT32_C(0x00400000)); /* 2^-127, an fp32 subnormal */
    return rf_quant_u2f((uint32_t)e << 23);
}

/* The loops below are written once and compiled several times: as plain C (SSE2 on x86-64),
 * and on x86-64 also for AVX2 and AVX-512, picked at run time. Everything a loop calls is
 * inlined into it (AI), so that each compilation vectorizes all of it. The arithmetic is the
 * same in each (integer operations, and the fp32 division and addition of the contract, which
 * every ISA rounds the same: IEEE, nearest-even, no flush-to-zero, as MXCSR is by default);
 * test_quant checks every compilation this CPU can run against the scalar original. */
#define AI inline __attribute__((always_inline))

/* Elements per step of the inner loops: a trip count gcc -O2 (whose cheap vectorizer wants
 * no remainder) vectorizes for every vector width. */
#define CHUNK 32

static AI float bf16_f(uint16_t h)
{
    return rf_quant_u2f((uint32_t)h << 16);
}

static AI float fp16_f(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    /* Normal, Inf/NaN, and subnormal (m * 2^-24, exact in fp32), selected by masks (which the
     * vectorizer takes, where it refuses ternaries as control flow). */
    uint32_t normal = s | ((e + 127 - 15) << 23) | (m << 13);
    uint32_t special = s | UINT32_C(0x7F800000) | (m << 13);
    uint32_t sub = s | rf_quant_f2u((float)(int32_t)m * 0x1p-24f);
    uint32_t is_special = 0u - (uint32_t)(e == 0x1F), is_sub = 0u - (uint32_t)(e == 0);

    return rf_quant_u2f((special & is_special) | (sub & is_sub) | (normal & ~(is_special | is_sub)));
}

static AI float load_f(rf_dtype dt, const void *p, uint64_t i)
{
    if (dt == RF_DT_BF16)
        return bf16_f(((const uint16_t *)p)[i]);
    if (dt == RF_DT_FP16)
        return fp16_f(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static float bits_to_f(rf_dtype dt, uint32_t b)
{
    switch (dt) {
    case RF_DT_BF16:
        return bf16_f((uint16_t)b);
    case RF_DT_FP16:
        return fp16_f((uint16_t)b);
    default:
        return rf_quant_u2f(b);
    }
}

/* The largest |x| over the finite elements of a block is found on the bits of |x| in the
 * source's own format: for non-negative floats the integer order is the numeric order, and a
 * non-finite element counts as 0. 16-bit sources keep their maxima in int16 lanes (|x| <=
 * 0x7FFF, so signed comparisons are right and SSE2 has them), CHUNK of them side by side
 * until the block ends. */
static AI void amax16_chunk(const uint16_t *h, int16_t inf, int16_t *acc)
{
    for (int k = 0; k < CHUNK; k++) {
        int16_t a = (int16_t)(h[k] & 0x7FFF);

        a = a < inf ? a : 0;
        acc[k] = a > acc[k] ? a : acc[k];
    }
}

static AI void amax32_chunk(const uint32_t *w, int32_t *acc)
{
    for (int k = 0; k < CHUNK; k++) {
        int32_t a = (int32_t)(w[k] & UINT32_C(0x7FFFFFFF));

        a = a < INT32_C(0x7F800000) ? a : 0;
        acc[k] = a > acc[k] ? a : acc[k];
    }
}

/* The amax bits of the nr x nc block at p (row stride ss bytes). */
static AI uint32_t block_amax(rf_dtype dt, const char *p, int64_t ss, uint64_t nr, uint64_t nc)
{
    uint64_t nfull = nc - nc % CHUNK;
    uint32_t m = 0;

    if (dt == RF_DT_FP32) {
        int32_t acc[CHUNK] = {0};

        for (uint64_t r = 0; r < nr; r++) {
            const uint32_t *w = (const uint32_t *)(p + (int64_t)r * ss);

            for (uint64_t c = 0; c < nfull; c += CHUNK)
                amax32_chunk(w + c, acc);
            for (uint64_t c = nfull; c < nc; c++) {
                uint32_t a = w[c] & UINT32_C(0x7FFFFFFF);

                a = a < UINT32_C(0x7F800000) ? a : 0;
                m = a > m ? a : m;
            }
        }
        for (int k = 0; k < CHUNK; k++)
            m = (uint32_t)acc[k] > m ? (uint32_t)acc[k] : m;
    } else {
        const int16_t inf = dt == RF_DT_BF16 ? 0x7F80 : 0x7C00;
        int16_t acc[CHUNK] = {0};

        for (uint64_t r = 0; r < nr; r++) {
            const uint16_t *h = (const uint16_t *)(p + (int64_t)r * ss);

            for (uint64_t c = 0; c < nfull; c += CHUNK)
                amax16_chunk(h + c, inf, acc);
            for (uint64_t c = nfull; c < nc; c++) {
                int16_t a = (int16_t)(h[c] & 0x7FFF);

                a = a < inf ? a : 0;
                m = (uint32_t)a > m ? (uint32_t)a : m;
            }
        }
        for (int k = 0; k < CHUNK; k++)
            m = (uint32_t)acc[k] > m ? (uint32_t)acc[k] : m;
    }
    return m;
}

/* One element: v = x / s, clamped to [-448, 448] with NaN kept, then NaN -> 0x7F and the
 * rest through e4m3_from_float. The clamp is done on the bits of |v|, whose integer order is
 * the numeric order (0x43E00000 = 448, 0x7F800000 = Inf, above it NaN): the same result as
 * the float comparisons. e4m3_from_float is written out here with its selections as masks,
 * which gcc vectorizes (its ternaries are "control flow" to the vectorizer); its |v| >= 480
 * case cannot occur after the clamp. */
static AI uint8_t quant_one(float x, float s)
{
    const uint32_t denorm_mask = UINT32_C(141) << 23;
    uint32_t b = rf_quant_f2u(x / s), sign = b & UINT32_C(0x80000000), a = b ^ sign;
    uint32_t nan = 0u - (uint32_t)(a > UINT32_C(0x7F800000));
    uint32_t denorm, normal, sub, r;

    a = a > UINT32_C(0x43E00000) ? UINT32_C(0x43E00000) : a;
    denorm = rf_quant_f2u(rf_quant_u2f(a) + rf_quant_u2f(denorm_mask)) - denorm_mask;
    normal = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20;
    sub = 0u - (uint32_t)(a < (UINT32_C(121) << 23));
    r = ((denorm & sub) | (normal & ~sub)) | (sign >> 24);
    return (uint8_t)((r & ~nan) | (0x7F & nan));
}

/* restrict: the vectorizer would otherwise want a run-time check that q and p do not overlap. */
static AI void quant_chunk(rf_dtype dt, const void *restrict p, float s, uint8_t *restrict q)
{
    for (int k = 0; k < CHUNK; k++)
        q[k] = quant_one(load_f(dt, p, (uint64_t)k), s);
}

static AI void quant_row(rf_dtype dt, const char *p, uint64_t n, float s, uint8_t *q)
{
    size_t es = dt == RF_DT_FP32 ? 4 : 2;
    uint64_t nfull = n - n % CHUNK;

    for (uint64_t c = 0; c < nfull; c += CHUNK)
        quant_chunk(dt, p + c * es, s, q + c);
    for (uint64_t c = nfull; c < n; c++)
        q[c] = quant_one(load_f(dt, p, c), s);
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

/* One call's work, the strides in bytes. */
typedef struct job {
    rf_dtype dt;
    int mx;
    const char *src;
    int64_t ss, qs, scs;
    uint64_t rows, cols, br, bc, srows, scols;
    uint8_t *q;
    void *scales;
} job;

/* Each block in turn: its amax, its scale, then its rows quantized while they are in cache. */
static AI void run_blocks(rf_dtype dt, const job *jb)
{
    size_t es = dt == RF_DT_FP32 ? 4 : 2;

    for (uint64_t i = 0; i < jb->srows; i++) {
        uint64_t r0 = i * jb->br, nr = jb->rows - r0 < jb->br ? jb->rows - r0 : jb->br;

        for (uint64_t j = 0; j < jb->scols; j++) {
            uint64_t c0 = j * jb->bc, nc = jb->cols - c0 < jb->bc ? jb->cols - c0 : jb->bc;
            const char *base = jb->src + (int64_t)r0 * jb->ss + (int64_t)(c0 * es);
            uint8_t *qb = jb->q + (int64_t)r0 * jb->qs + (int64_t)c0;
            float amax = bits_to_f(dt, block_amax(dt, base, jb->ss, nr, nc)), s;

            if (jb->mx) {
                uint8_t e = rf_quant_e8m0_of(amax);

                ((uint8_t *)jb->scales)[(int64_t)i * jb->scs + (int64_t)j] = e;
                s = rf_quant_e8m0_to_float(e);
            } else {
                s = rf_quant_scale_of(amax);
                ((float *)jb->scales)[(int64_t)i * jb->scs + (int64_t)j] = s;
            }
            for (uint64_t r = 0; r < nr; r++)
                quant_row(dt, base + (int64_t)r * jb->ss, nc, s, qb + (int64_t)r * jb->qs);
        }
    }
}

/* What to prefetch while the g blocks from [i, j] are quantized, row r of it along with
 * their row r: the next g blocks, so that their amax pass finds them in cache (the hardware
 * prefetchers stop at page ends, and a block's row is often a page or a fraction of one); or,
 * for blocks too big to stay in cache (tensor, long channels), their own next row. */
typedef struct prefetch {
    const char *p;
    int64_t ss;
    uint64_t nr, len;
    int big;
} prefetch;

#define CACHE_KEEP (256u << 10)

static AI prefetch next_panel(const job *jb, uint64_t i, uint64_t j, uint64_t g, size_t es)
{
    uint64_t r0 = i * jb->br, nr = jb->rows - r0 < jb->br ? jb->rows - r0 : jb->br;
    uint64_t c0 = j * jb->bc, w = jb->cols - c0 < g * jb->bc ? jb->cols - c0 : g * jb->bc;
    prefetch pf = {NULL, jb->ss, 0, 0, 0};

    if (nr * w * es > CACHE_KEEP) {
        pf.big = 1;
        pf.p = jb->src + (int64_t)(r0 + 1) * jb->ss + (int64_t)(c0 * es);
        pf.nr = nr - 1;
        pf.len = w * es;
        return pf;
    }
    j += g;
    if (j >= jb->scols) {
        j = 0;
        if (++i == jb->srows)
            return pf;
    }
    r0 = i * jb->br;
    c0 = j * jb->bc;
    pf.p = jb->src + (int64_t)r0 * jb->ss + (int64_t)(c0 * es);
    pf.nr = jb->rows - r0 < jb->br ? jb->rows - r0 : jb->br;
    pf.len = (jb->cols - c0 < g * jb->bc ? jb->cols - c0 : g * jb->bc) * es;
    return pf;
}

/* The dtype made a constant, so each compilation has one loop nest per source dtype. */
static AI void run_job(const job *jb)
{
    switch (jb->dt) {
    case RF_DT_BF16:
        run_blocks(RF_DT_BF16, jb);
        break;
    case RF_DT_FP16:
        run_blocks(RF_DT_FP16, jb);
        break;
    default:
        run_blocks(RF_DT_FP32, jb);
        break;
    }
}

static void run_base(const job *jb)
{
    run_job(jb);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86_ISAS 1
__attribute__((target("avx2"))) static void run_avx2(const job *jb)
{
    run_job(jb);
}

/* On AVX-512 the loops are written out with intrinsics: gcc's own vectorization of quant_one
 * spends most of its time narrowing and widening lanes, and cannot prefetch. They are
 * block_amax and quant_one step for step; masked loads and stores do the partial vectors (the
 * lanes left out load as 0, which changes no amax, and are not stored). fp16 is widened by
 * vcvtph2ps, exact like fp16_f (subnormals included; a NaN stays a NaN, which is all that
 * quant_one looks at). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define AVX512_AI __attribute__((target("avx512f,avx512bw,avx512vl,f16c"), always_inline)) inline

/* 16 elements as fp32, the first n of them (k's lanes). */
static AVX512_AI __m512 load16(rf_dtype dt, const void *p, __mmask16 k)
{
    if (dt == RF_DT_FP32)
        return _mm512_maskz_loadu_ps(k, p);
    if (dt == RF_DT_FP16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/* quant_one on 16 fp32 values: the 16 bytes, one per 32-bit lane. In fewer instructions
 * than it reads: a NaN lane clamps to 480 instead of 448 (to which the normal path gives
 * 0x7F) and drops its sign; the rounding's odd bit is a masked add; the subnormal result is
 * the low byte of the sum (141 << 23 plus 0..8). */
static AVX512_AI __m512i quant16_f(__m512 x, __m512 vs)
{
    __m512i b = _mm512_castps_si512(_mm512_div_ps(x, vs));
    __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), sum, nor, sgn;
    __mmask16 num = _mm512_cmple_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), sub, odd;

    a = _mm512_mask_min_epu32(_mm512_set1_epi32(0x43F00000), num, a,
                              _mm512_set1_epi32(0x43E00000));
    sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a),
                                            _mm512_castsi512_ps(_mm512_set1_epi32(141 << 23))));
    odd = _mm512_test_epi32_mask(a, _mm512_set1_epi32(1 << 20));
    nor = _mm512_add_epi32(a, _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFF)));
    nor = _mm512_srli_epi32(_mm512_mask_add_epi32(nor, odd, nor, _mm512_set1_epi32(1)), 20);
    sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23));
    nor = _mm512_mask_and_epi32(nor, sub, sum, _mm512_set1_epi32(0xFF));
    sgn = _mm512_maskz_srli_epi32(num, b, 24);
    /* nor | (sgn & 0x80) */
    return _mm512_ternarylogic_epi32(nor, sgn, _mm512_set1_epi32(0x80), 0xF8);
}

/* quant16_f's magnitude part for |x| (x / s and |x| / s differ only in sign): the byte of
 * min(|x| / s, 448), which a NaN makes 0x7E; the caller ORs in the sign and NaN's low bit. */
static AVX512_AI __m512i quant16_abs(__m512 ax, __m512 vs)
{
    __m512i a = _mm512_castps_si512(_mm512_div_ps(ax, vs)), sum, nor;
    __mmask16 sub, odd;

    a = _mm512_min_epu32(a, _mm512_set1_epi32(0x43E00000));
    sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a),
                                            _mm512_castsi512_ps(_mm512_set1_epi32(141 << 23))));
    odd = _mm512_test_epi32_mask(a, _mm512_set1_epi32(1 << 20));
    nor = _mm512_add_epi32(a, _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFF)));
    nor = _mm512_srli_epi32(_mm512_mask_add_epi32(nor, odd, nor, _mm512_set1_epi32(1)), 20);
    sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23));
    return _mm512_mask_and_epi32(nor, sub, sum, _mm512_set1_epi32(0xFF));
}

static AVX512_AI __m512i quant16(rf_dtype dt, const void *p, __mmask16 k, __m512 vs)
{
    return quant16_f(load16(dt, p, k), vs);
}

/* The bytes of four quant16 results in order, as one 64-byte store: the packs work within
 * 128-bit lanes, the permutation puts their 4-byte groups back in order. */
static AVX512_AI __m512i pack64(__m512i r0, __m512i r1, __m512i r2, __m512i r3)
{
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(r0, r1), _mm512_packus_epi32(r2, r3));

    return _mm512_permutexvar_epi32(order, b);
}

/* 64 elements quantized, the scales by 16-element vector. bf16 widens by interleaving with
 * zeros, which works within 128-bit lanes: the vectors then hold elements 0-3, 8-11, 16-19,
 * 24-27 (and 4-7, 12-15, ...; then the same from 32), which the packs put back in 8-byte
 * groups, reordered at the end. That mixes elements 0-31, so it needs v0 == v1 and v2 == v3
 * (pairs: blocks of a multiple of 32 columns, or one block). */
static AVX512_AI __m512i quant64(rf_dtype dt, int pairs, const void *p, __m512 v0, __m512 v1,
                                 __m512 v2, __m512 v3)
{
    const size_t es = dt == RF_DT_FP32 ? 4 : 2;

    if (dt == RF_DT_BF16 && pairs) {
        const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
        const __m512i abs = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80);
        __m512i x = _mm512_loadu_si512(p), y = _mm512_loadu_si512((const char *)p + 64);
        __m512i z = _mm512_setzero_si512(), ax = _mm512_and_si512(x, abs);
        __m512i ay = _mm512_and_si512(y, abs), sx, sy;
        __m512i r0 = quant16_abs(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, ax)), v0);
        __m512i r1 = quant16_abs(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, ax)), v0);
        __m512i r2 = quant16_abs(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, ay)), v2);
        __m512i r3 = quant16_abs(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, ay)), v2);
        __mmask32 nx = _mm512_cmpgt_epu16_mask(ax, inf), ny = _mm512_cmpgt_epu16_mask(ay, inf);

        /* What each byte gets ORed in, in the packs' order: 0x80 for a negative number, 0x01
         * for a NaN (whose |x| / s clamped to 448, 0x7E, and whose sign is dropped). */
        sx = _mm512_mask_mov_epi16(
            _mm512_maskz_mov_epi16(_mm512_movepi16_mask(x) & ~nx, _mm512_set1_epi16(0x80)), nx,
            _mm512_set1_epi16(0x01));
        sy = _mm512_mask_mov_epi16(
            _mm512_maskz_mov_epi16(_mm512_movepi16_mask(y) & ~ny, _mm512_set1_epi16(0x80)), ny,
            _mm512_set1_epi16(0x01));
        return _mm512_permutexvar_epi64(
            order, _mm512_or_si512(_mm512_packus_epi16(_mm512_packus_epi32(r0, r1),
                                                       _mm512_packus_epi32(r2, r3)),
                                   _mm512_packus_epi16(sx, sy)));
    }
    return pack64(quant16(dt, p, 0xFFFF, v0), quant16(dt, (const char *)p + 16 * es, 0xFFFF, v1),
                  quant16(dt, (const char *)p + 32 * es, 0xFFFF, v2),
                  quant16(dt, (const char *)p + 48 * es, 0xFFFF, v3));
}

/* block_amax's lanes over n elements of a row: 32 16-bit lanes, or 16 32-bit ones. */
static AVX512_AI __m512i amax_row(rf_dtype dt, const void *p, uint64_t n, __m512i acc)
{
    if (dt == RF_DT_FP32) {
        const uint32_t *w = p;

        for (uint64_t c = 0; c < n; c += 16) {
            __mmask16 k = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
            __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi32(k, w + c),
                                         _mm512_set1_epi32(0x7FFFFFFF));

            acc = _mm512_mask_max_epu32(
                acc, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), acc, a);
        }
    } else {
        const uint16_t *h = p;
        const __m512i inf = _mm512_set1_epi16(dt == RF_DT_BF16 ? 0x7F80 : 0x7C00);

        for (uint64_t c = 0; c < n; c += 32) {
            __mmask32 k = n - c >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (n - c)) - 1;
            __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi16(k, h + c),
                                         _mm512_set1_epi16(0x7FFF));

            acc = _mm512_mask_max_epu16(acc, _mm512_cmplt_epu16_mask(a, inf), acc, a);
        }
    }
    return acc;
}

static AVX512_AI uint32_t reduce_max(rf_dtype dt, __m512i acc)
{
    __m256i m8;
    __m128i m4;

    if (dt == RF_DT_FP32)
        return (uint32_t)_mm512_reduce_max_epu32(acc);
    m8 = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    m4 = _mm_max_epu16(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
    /* The largest of 8 lanes as the smallest of their complements (phminposuw). */
    m4 = _mm_minpos_epu16(_mm_xor_si128(m4, _mm_set1_epi16(-1)));
    return ~(uint32_t)_mm_cvtsi128_si32(m4) & 0xFFFF;
}

/* Blocks go in panels: a band's blocks side by side, PANEL_BYTES of each row, so that a
 * panel of 1 x 32 blocks (mxfp8) is one run of 2 KB, not 32 loops of 64 bytes, and a panel of
 * 128 x 128 blocks (256 KB of bf16) stays in cache between its two passes. */
#define PANEL_BYTES 2048u
#define PANEL_MAX 64u

/* The scales of n blocks from their amax bits ab, 16 at a time: s as fp32 values, stored at
 * out as fp32 or (mx) E8M0 bytes. The same as rf_quant_scale_of (an IEEE division) and
 * rf_quant_e8m0_of, whose byte for a finite amax >= 0 with fp32 exponent field E is 127 for
 * amax 0, else max(E - 8, 0) (E - 8 <= 246; a subnormal amax has E = 0 and gives 0). */
static AVX512_AI void panel_scales(rf_dtype dt, int mx, const uint32_t *ab, uint64_t n, float *s,
                                   char *out)
{
    for (uint64_t b = 0; b < n; b += 16) {
        __mmask16 k = n - b >= 16 ? 0xFFFF : (__mmask16)((1u << (n - b)) - 1);
        __m512i u = _mm512_maskz_loadu_epi32(k, ab + b);
        __m512 amax = dt == RF_DT_FP32   ? _mm512_castsi512_ps(u)
                      : dt == RF_DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))
                                         : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(u));
        __m512i a = _mm512_castps_si512(amax);
        __m512 v;

        if (mx) {
            __m512i e = _mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32(a, 23),
                                                          _mm512_set1_epi32(8)),
                                         _mm512_setzero_si512());

            e = _mm512_mask_mov_epi32(e, _mm512_cmpeq_epi32_mask(a, _mm512_setzero_si512()),
                                      _mm512_set1_epi32(127));
            v = _mm512_castsi512_ps(_mm512_mask_mov_epi32(
                _mm512_slli_epi32(e, 23), _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                _mm512_set1_epi32(0x00400000)));
            _mm_mask_storeu_epi8(out + b, k, _mm512_cvtepi32_epi8(e));
        } else {
            v = _mm512_div_ps(amax, _mm512_set1_ps(RF_QUANT_E4M3_MAX));
            v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_EQ_OQ),
                                   _mm512_set1_ps(1.0f));
            _mm512_mask_storeu_ps((float *)out + b, k, v);
        }
        _mm512_mask_storeu_ps(s + b, k, v);
    }
}

static AVX512_AI void run_avx512_dt(rf_dtype dt, const job *jb)
{
    const size_t es = dt == RF_DT_FP32 ? 4 : 2;
    uint64_t g = jb->bc * es >= PANEL_BYTES ? 1 : PANEL_BYTES / (jb->bc * es);

    g = g < PANEL_MAX ? g : PANEL_MAX;
    for (uint64_t i = 0; i < jb->srows; i++) {
        uint64_t r0 = i * jb->br, nr = jb->rows - r0 < jb->br ? jb->rows - r0 : jb->br;

        for (uint64_t j0 = 0; j0 < jb->scols; j0 += g) {
            uint64_t ng = jb->scols - j0 < g ? jb->scols - j0 : g, c0 = j0 * jb->bc;
            uint64_t width = jb->cols - c0 < ng * jb->bc ? jb->cols - c0 : ng * jb->bc;
            const char *base = jb->src + (int64_t)r0 * jb->ss + (int64_t)(c0 * es);
            uint8_t *qb = jb->q + (int64_t)r0 * jb->qs + (int64_t)c0;
            prefetch pf = next_panel(jb, i, j0, g, es);
            __m512i acc[PANEL_MAX];
            uint32_t ab[PANEL_MAX];
            float s[PANEL_MAX], s16[PANEL_MAX];
            /* Whole vectors of 16 in one block each, so that a step of 64 needs no mask: by
             * vector, their scales s16. */
            int vec = ng == 1 || (jb->bc % 16 == 0 && width <= 16 * PANEL_MAX);
            int pairs = ng == 1 || jb->bc % 32 == 0;

            /* The first row sets the lanes, the others raise them (no zeroing of acc). */
            for (uint64_t r = 0; r < nr; r++) {
                const char *h = base + (int64_t)r * jb->ss;

                /* A panel too big for the cache brings its next row along (next_panel). */
                if (pf.big && r < pf.nr)
                    for (uint64_t c = 0; c < pf.len; c += 64)
                        _mm_prefetch(pf.p + (int64_t)r * pf.ss + c, _MM_HINT_T0);
                for (uint64_t b = 0, cb = 0; b < ng; b++, cb += jb->bc)
                    acc[b] = amax_row(dt, h + cb * es, width - cb < jb->bc ? width - cb : jb->bc,
                                      r == 0 ? _mm512_setzero_si512() : acc[b]);
            }
            for (uint64_t b = 0; b < ng; b++)
                ab[b] = reduce_max(dt, acc[b]);
            panel_scales(dt, jb->mx, ab, ng, s,
                         (char *)jb->scales + ((int64_t)i * jb->scs + (int64_t)j0) *
                                                  (jb->mx ? 1 : 4));
            if (vec && ng > 1)
                for (uint64_t b = 0, v = 0; b < ng; b++)
                    for (uint64_t e = 0; e < jb->bc && v < width / 16; e += 16)
                        s16[v++] = s[b];
            for (uint64_t r = 0; r < nr; r++) {
                const char *h = base + (int64_t)r * jb->ss;
                const char *pr = pf.p + (int64_t)r * pf.ss;
                uint8_t *qr = qb + (int64_t)r * jb->qs;
                uint64_t c = 0;

                if (vec) {
                    __m512 v0 = _mm512_set1_ps(s[0]), v1 = v0, v2 = v0, v3 = v0;

                    for (; c + 64 <= width; c += 64) {
                        if (r < pf.nr && c * es < pf.len)
                            for (size_t l = 0; l < 2 * es; l += 2)
                                _mm_prefetch(pr + c * es + l * 32, _MM_HINT_T0);
                        if (ng > 1) {
                            v0 = _mm512_set1_ps(s16[c / 16]);
                            v1 = _mm512_set1_ps(s16[c / 16 + 1]);
                            v2 = _mm512_set1_ps(s16[c / 16 + 2]);
                            v3 = _mm512_set1_ps(s16[c / 16 + 3]);
                        }
                        _mm512_storeu_si512(qr + c, quant64(dt, pairs, h + c * es, v0, v1, v2, v3));
                    }
                }
                /* The rest 16 at a time, each vector within one block, the last ones masked. */
                while (c < width) {
                    uint64_t b = c / jb->bc, end = (b + 1) * jb->bc < width ? (b + 1) * jb->bc : width;
                    uint64_t n = end - c < 16 ? end - c : 16;
                    __mmask16 k = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);

                    if (r < pf.nr && c * es < pf.len)
                        _mm_prefetch(pr + c * es, _MM_HINT_T0);
                    _mm_mask_storeu_epi8(qr + c, k, _mm512_cvtepi32_epi8(
                                                        quant16(dt, h + c * es, k, _mm512_set1_ps(s[b]))));
                    c += n;
                }
            }
        }
    }
}

AVX512 static void run_avx512(const job *jb)
{
    switch (jb->dt) {
    case RF_DT_BF16:
        run_avx512_dt(RF_DT_BF16, jb);
        break;
    case RF_DT_FP16:
        run_avx512_dt(RF_DT_FP16, jb);
        break;
    default:
        run_avx512_dt(RF_DT_FP32, jb);
        break;
    }
}
#endif

/* The widest compilation this CPU runs: 0 plain C, 1 AVX2, 2 AVX-512 (F, BW, VL). */
static int isa_best(void)
{
#ifdef HAVE_X86_ISAS
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return 2;
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

/* rf_quant_host with the compilation of its loops chosen (isa as isa_best's; -1 the best):
 * test_quant runs each against the scalar original. -ENOTSUP for one this CPU lacks. */
int rf_quant__host_isa(int isa, const rf_quant_fmt *f, rf_dtype src_dt, const void *src,
                       int64_t src_row_stride, uint64_t rows, uint64_t cols, uint8_t *q,
                       int64_t q_row_stride, void *scales, int64_t scale_row_stride, rf_err *err)
{
    uint64_t srows, scols, br, bc;
    size_t es = rf_dtype_size(src_dt);
    int rc, best = isa_best();
    job jb;

    if (isa < 0)
        isa = best;
    if (isa > best)
        return rf_err_set(err, -ENOTSUP, "quantize: this CPU lacks instruction set %d (it has "
                          "up to %d)", isa, best);
    if (src_dt != RF_DT_BF16 && src_dt != RF_DT_FP16 && src_dt != RF_DT_FP32)
        return rf_err_set(err, -EINVAL, "quantize: source dtype %s cannot be quantized; it must "
                          "be bf16, fp16 or fp32", rf_dtype_name(src_dt));
    rc = check_args(f, "quantize", src, src_row_stride, rows, cols, q, q_row_stride, scales,
                    scale_row_stride, &srows, &scols, err);
    if (rc < 0 || rows == 0 || cols == 0)
        return rc;
    rf_quant_fmt_block(f, rows, cols, &br, &bc);
    jb = (job){.dt = src_dt, .mx = f->kind == RF_QUANT_MXFP8, .src = src,
               .ss = src_row_stride * (int64_t)es, .qs = q_row_stride, .scs = scale_row_stride,
               .rows = rows, .cols = cols, .br = br, .bc = bc, .srows = srows, .scols = scols,
               .q = q, .scales = scales};
    switch (isa) {
#ifdef HAVE_X86_ISAS
    case 2:
        run_avx512(&jb);
        break;
    case 1:
        run_avx2(&jb);
        break;
#endif
    default:
        run_base(&jb);
        break;
    }
    return 0;
}

int rf_quant_host(const rf_quant_fmt *f, rf_dtype src_dt, const void *src, int64_t src_row_stride,
                  uint64_t rows, uint64_t cols, uint8_t *q, int64_t q_row_stride, void *scales,
                  int64_t scale_row_stride, rf_err *err)
{
    return rf_quant__host_isa(-1, f, src_dt, src, src_row_stride, rows, cols, q, q_row_stride,
                              scales, scale_row_stride, err);
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
    rf_quant_fmt_block(f, rows, cols, &br, &bc);
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
