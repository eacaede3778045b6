/* common/data/quant_cuda.cu - the FP8 quantization kernels (the contract is in quant.h): one
 * batch kernel for BLOCK, CHANNEL and MXFP8 over any number of matrices (a thread block per
 * quantization block or row, a warp per 1 x 32 block; rows read 16 bytes at a time where their
 * alignment allows), and for TENSOR an amax pass, a one-thread scale, then a quantizing pass.
 * Every element is read from DRAM once; the quantizing pass of a block re-reads it from cache. */
#include <inttypes.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#include "drv_cuda.h"
#include "quant_cuda.h"

#define THREADS 256
#define WARPS (THREADS / 32)
#define FULL_MASK 0xFFFFFFFFu
/* Blocks of one launch at most; each walks its share of the tiles (grid-stride). */
#define MAX_GRID 65536u
/* TENSOR's tiles hold about this many elements (fewer columns when the matrix is narrower). */
#define TENSOR_TILE 8192u

/* The two floating-point operations of the contract, division and the addition in the e4m3
 * denormal path, are written in PTX without .ftz: nvcc's `/`, __fdiv_rn and __fadd_rn all turn
 * into their .ftz forms under -ftz=true or --use_fast_math, which would flush subnormal
 * quotients, scales and e4m3 subnormals to zero. The rest of the arithmetic is on integer bits
 * (comparisons included, since a .ftz comparison sees a subnormal as 0). Every helper also
 * builds for the host, where it is C's IEEE arithmetic, so the port can be checked against
 * quant.c without a GPU. */
static __host__ __device__ __forceinline__ float div_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    float r;

    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a / b;
#endif
}

static __host__ __device__ __forceinline__ float add_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    float r;

    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a + b;
#endif
}

static __host__ __device__ __forceinline__ uint32_t f2u(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;

    memcpy(&u, &f, sizeof(u));
    return u;
#endif
}

static __host__ __device__ __forceinline__ float u2f(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;

    memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

static __host__ __device__ __forceinline__ int clz32(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __clz(u);
#else
    return __builtin_clz(u);
#endif
}

/* quant.c's e4m3_from_float (the host's; on sm_89 and later e4m3_of_clamped uses the conversion
 * instruction), the algorithm of c10's fp8e4m3fn_from_fp32_value, line for line:
 * both paths computed and one selected. */
static __host__ __device__ __forceinline__ __attribute__((unused)) uint8_t e4m3_from_float(float f)
{
    const uint32_t fp8_max = UINT32_C(1087) << 20;       /* 480.0f */
    const uint32_t denorm_mask = UINT32_C(141) << 23;    /* 2^14 */
    uint32_t bits = f2u(f);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    uint32_t denorm, normal, mant_odd, result;

    bits ^= sign;
    denorm = f2u(add_rn(u2f(bits), u2f(denorm_mask))) - denorm_mask;
    mant_odd = (bits >> 20) & 1;
    normal = (bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFF + mant_odd) >> 20;
    result = bits >= fp8_max ? 0x7F : bits < (UINT32_C(121) << 23) ? denorm : normal;
    return (uint8_t)(result | (sign >> 24));
}

/* An fp32 of magnitude <= 448 to E4M3, round to nearest even: the conversion instruction of
 * sm_89 and later (.satfinite never binds here: the value was clamped), else c10's algorithm.
 * Both give the same byte for every such value; the tests check every 16-bit pattern. */
static __host__ __device__ __forceinline__ uint8_t e4m3_of_clamped(float v)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;

    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
    return (uint8_t)(r & 0xFF);
#else
    return e4m3_from_float(v);
#endif
}

/* quant.c's quant_one: v = x / s, clamped to +-448 on the bits of |v| (NaN kept), NaN -> 0x7F. */
static __host__ __device__ __forceinline__ uint8_t quant_one(float x, float s)
{
    uint32_t b = f2u(div_rn(x, s)), sign = b & UINT32_C(0x80000000), a = b ^ sign;
    uint32_t nan = a > UINT32_C(0x7F800000);
    uint8_t r;

    a = a > UINT32_C(0x43E00000) ? UINT32_C(0x43E00000) : a;
    r = e4m3_of_clamped(u2f(a | sign));
    return nan ? 0x7F : r;
}

/* rf_quant_scale_of, from amax's bits: amax / 448, and 1 where that is (+)0. */
static __host__ __device__ __forceinline__ float scale_of(uint32_t amax_bits)
{
    float s = div_rn(u2f(amax_bits), 448.0f);

    return (f2u(s) & UINT32_C(0x7FFFFFFF)) == 0 ? 1.0f : s;
}

/* rf_quant_e8m0_of, from amax's bits (finite, non-negative). */
static __host__ __device__ __forceinline__ uint8_t e8m0_of(uint32_t u)
{
    int fl, e;

    u &= UINT32_C(0x7FFFFFFF);
    if (u == 0)
        return 127;
    fl = (u >> 23) ? (int)(u >> 23) - 127 : -149 + (31 - clz32(u));
    e = fl - 8;
    e = e < -127 ? -127 : e > 127 ? 127 : e;
    return (uint8_t)(e + 127);
}

/* rf_quant_e8m0_to_float for the bytes e8m0_of gives (never 255). */
static __host__ __device__ __forceinline__ float e8m0_to_float(uint8_t e)
{
    return u2f(e == 0 ? UINT32_C(0x00400000) : (uint32_t)e << 23);
}

/* The exact fp32 bits of a source element (quant.c's bf16_f and fp16_f). fp16 subnormals
 * (m * 2^-24) are normalised with integer operations: fp32 holds them all as normals. */
static __host__ __device__ __forceinline__ uint32_t bf16_bits(uint16_t h)
{
    return (uint32_t)h << 16;
}

static __host__ __device__ __forceinline__ uint32_t fp16_bits(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;

    if (e == 0x1F)
        return s | UINT32_C(0x7F800000) | (m << 13);
    if (e != 0)
        return s | ((e + 127 - 15) << 23) | (m << 13);
    if (m == 0)
        return s;
    /* m * 2^-24 with m's highest bit p (0..9): exponent p - 24, the bits below p the mantissa. */
    uint32_t p = (uint32_t)(31 - clz32(m));

    return s | ((p + 127 - 24) << 23) | ((m << (23 - p)) & UINT32_C(0x7FFFFF));
}

/* Source element types: the stored type and its widening to fp32 bits. */
struct src_bf16 {
    typedef uint16_t T;
    static __device__ __forceinline__ uint32_t bits(T v) { return bf16_bits(v); }
};
struct src_fp16 {
    typedef uint16_t T;
    static __device__ __forceinline__ uint32_t bits(T v) { return fp16_bits(v); }
};
struct src_fp32 {
    typedef uint32_t T;
    static __device__ __forceinline__ uint32_t bits(T v) { return v; }
};

/* |x| as fp32 bits when x is finite, else 0: for non-negative floats the integer order is the
 * numeric order, so the amax is an unsigned max. */
static __device__ __forceinline__ uint32_t finite_abs(uint32_t b)
{
    b &= UINT32_C(0x7FFFFFFF);
    return b < UINT32_C(0x7F800000) ? b : 0;
}

static __device__ __forceinline__ uint32_t warp_max(uint32_t m)
{
    for (int o = 16; o > 0; o >>= 1) {
        uint32_t v = __shfl_xor_sync(FULL_MASK, m, o);

        m = v > m ? v : m;
    }
    return m;
}

/* The max of every thread's m, returned to all of them; red is WARPS words of shared memory,
 * free again when this returns. Every thread of the block calls it. */
static __device__ __forceinline__ uint32_t block_max(uint32_t m, uint32_t *red)
{
    uint32_t r = 0;

    m = warp_max(m);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = m;
    __syncthreads();
    for (int w = 0; w < WARPS; w++)
        r = red[w] > r ? red[w] : r;
    __syncthreads();
    return r;
}

/* block_max of two 16-bit maxima at once, the halves of m. */
static __device__ __forceinline__ uint32_t block_vmax2(uint32_t m, uint32_t *red)
{
    uint32_t r = 0;

    for (int o = 16; o > 0; o >>= 1)
        m = __vmaxu2(m, __shfl_xor_sync(FULL_MASK, m, o));
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = m;
    __syncthreads();
    for (int w = 0; w < WARPS; w++)
        r = __vmaxu2(r, red[w]);
    __syncthreads();
    return r;
}

/* A tile [r0, r0 + nr) x [c0, c0 + nc) as the block's threads walk it: wx threads along a row
 * (the smallest power of two at least nc, at most THREADS), THREADS / wx rows at a time, so a
 * narrow tile keeps every thread busy and a row is read by consecutive threads. */
struct tile {
    uint64_t r0, c0, nr, nc;
    uint32_t tx, ty, wx, wy;
};

static __device__ __forceinline__ tile tile_at(uint64_t r0, uint64_t c0, uint64_t nr,
                                               uint64_t nc)
{
    uint32_t wx = 1;
    tile t;

    while (wx < THREADS && wx < nc)
        wx <<= 1;
    t.r0 = r0;
    t.c0 = c0;
    t.nr = nr;
    t.nc = nc;
    t.tx = threadIdx.x & (wx - 1);
    t.ty = threadIdx.x / wx;
    t.wx = wx;
    t.wy = THREADS / wx;
    return t;
}

/* This thread's max of finite |x| over its elements of the tile, as fp32 bits. */
template <typename S>
static __device__ __forceinline__ uint32_t tile_amax(const tile &t, const typename S::T *src,
                                                     int64_t sstride, uint32_t m)
{
    for (uint64_t r = t.ty; r < t.nr; r += t.wy) {
        const typename S::T *row = src + (int64_t)(t.r0 + r) * sstride + (int64_t)t.c0;

        for (uint64_t c = t.tx; c < t.nc; c += t.wx) {
            uint32_t a = finite_abs(S::bits(row[c]));

            m = a > m ? a : m;
        }
    }
    return m;
}

template <typename S>
static __device__ __forceinline__ void tile_quant(const tile &t, const typename S::T *src,
                                                  int64_t sstride, float s, uint8_t *q,
                                                  int64_t qstride)
{
    for (uint64_t r = t.ty; r < t.nr; r += t.wy) {
        const typename S::T *row = src + (int64_t)(t.r0 + r) * sstride + (int64_t)t.c0;
        uint8_t *qrow = q + (int64_t)(t.r0 + r) * qstride + (int64_t)t.c0;

        for (uint64_t c = t.tx; c < t.nc; c += t.wx)
            qrow[c] = quant_one(u2f(S::bits(row[c])), s);
    }
}

/* One matrix to quantize in BLOCK, CHANNEL or MXFP8 (TENSOR has its own passes), as the batch
 * kernel reads it: the grid's blocks are br x bc (CHANNEL: 1 x cols, MXFP8: 1 x 32), scols of
 * them per row of blocks. vec: every tile's rows can be read 16 bytes at a time and written
 * 16 / esize bytes at a time (aligned bases and strides, column counts a multiple of that). */
struct qdesc {
    const void *src;
    uint8_t *q;
    void *scales;
    int64_t sstride, qstride, scstride;
    uint64_t rows, cols, br, bc, scols, nblocks, ntiles;
    uint32_t kind, dt, vec;
};

/* A source vector: 16 bytes, V elements of S. */
template <typename S> struct vec16 {
    static const int V = 16 / (int)sizeof(typename S::T);
    union {
        uint4 u;
        typename S::T e[16 / sizeof(typename S::T)];
    };
};

/* Its V FP8 bytes, stored in one access. */
template <int V> struct qvec;
template <> struct qvec<8> {
    union {
        uint2 u;
        uint8_t b[8];
    };
    __device__ __forceinline__ void store(uint8_t *p) const { *(uint2 *)p = u; }
};
template <> struct qvec<4> {
    union {
        uint32_t u;
        uint8_t b[4];
    };
    __device__ __forceinline__ void store(uint8_t *p) const { *(uint32_t *)p = u; }
};

/* tile_amax and tile_quant over a tile whose columns t.c0, t.nc count vectors of V. */
template <typename S>
static __device__ __forceinline__ uint32_t tile_amax_v(const tile &t, const typename S::T *src,
                                                       int64_t sstride, uint32_t m)
{
    const int V = vec16<S>::V;

    for (uint64_t r = t.ty; r < t.nr; r += t.wy) {
        const uint4 *row = (const uint4 *)(src + (int64_t)(t.r0 + r) * sstride +
                                           (int64_t)t.c0 * V);

        for (uint64_t c = t.tx; c < t.nc; c += t.wx) {
            vec16<S> v;

            v.u = row[c];
#pragma unroll
            for (int u = 0; u < V; u++) {
                uint32_t a = finite_abs(S::bits(v.e[u]));

                m = a > m ? a : m;
            }
        }
    }
    return m;
}

template <typename S>
static __device__ __forceinline__ void tile_quant_v(const tile &t, const typename S::T *src,
                                                    int64_t sstride, float s, uint8_t *q,
                                                    int64_t qstride)
{
    const int V = vec16<S>::V;

    for (uint64_t r = t.ty; r < t.nr; r += t.wy) {
        const uint4 *row = (const uint4 *)(src + (int64_t)(t.r0 + r) * sstride +
                                           (int64_t)t.c0 * V);
        uint8_t *qrow = q + (int64_t)(t.r0 + r) * qstride + (int64_t)t.c0 * V;

        for (uint64_t c = t.tx; c < t.nc; c += t.wx) {
            vec16<S> v;
            qvec<vec16<S>::V> o;

            v.u = row[c];
#pragma unroll
            for (int u = 0; u < V; u++)
                o.b[u] = quant_one(u2f(S::bits(v.e[u])), s);
            o.store(qrow + c * V);
        }
    }
}

/* The bf16 blocks of the vector path, where most weights go: the same bytes as tile_amax_v and
 * tile_quant_v, with fewer instructions an element (the kernel is bound by them, not by memory).
 *  - amax: the max of |x|'s 16 bits, two at a time; only when it is Inf or NaN (the block holds
 *    a non-finite element) is it taken again over the finite ones (Inf and NaN masked to 0).
 *  - x / s: where s lies in [2^-60, 2^60], from rc = 1 / s correctly rounded: q0 = x * rc,
 *    r = x - q0 * s (exact, one fma), q = q0 + r * rc. Markstein's theorem makes q the correctly
 *    rounded quotient of a finite x when rc is within half an ulp of 1 / s and q0 within one
 *    ulp; nothing overflows, and where r underflows the quotient is below 2^-40, whose E4M3 byte
 *    is +-0 either way. Other blocks divide (div.rn), element by element.
 *  - E4M3: two values per cvt.rn.satfinite.e4m3x2 (|q| <= 448 (1 + 2^-23): saturating is the
 *    contract's clamp), each byte's sign bit ORed from its bf16 (x = -0 gives q = +0 above).
 *  - Inf and NaN, in a block that holds them: each word of two bf16 is checked (one SIMD
 *    compare) and the bytes of its Inf and NaN set afterwards as quant_one gives them, +-448
 *    (0x7E with the sign) and 0x7F.
 * Blocks of finite weights take none of the checks; a block of the register path with Inf or
 * NaN elements is read once and reduced once too (it was read three times before, then
 * reduced twice: the sim's weights put one in most 128x128 blocks, bench/RESULTS.md). The
 * tests hold these to rf_quant_host on every 16-bit pattern, edge blocks and torch. */
static __device__ __forceinline__ uint32_t e4m3x2(float hi, float lo)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;

    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (uint32_t)e4m3_of_clamped(hi) << 8 | e4m3_of_clamped(lo);
#endif
}

static __device__ __forceinline__ float mark_div(float x, float s, float rc)
{
    float q0 = __fmul_rn(x, rc);

    return __fmaf_rn(__fmaf_rn(-q0, s, x), rc, q0);
}

#define BF16_EXP2 0x7F807F80u

/* Bytes k of r (k = 0..3, element k of words w0, w1 low half first) whose bf16 is Inf or NaN,
 * set to quant_one's. */
static __device__ __forceinline__ uint32_t fix_nonfinite(uint32_t r, uint32_t w0, uint32_t w1)
{
    const uint32_t e[4] = {w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16};

#pragma unroll
    for (int k = 0; k < 4; k++) {
        if ((e[k] & 0x7F80) == 0x7F80) {
            uint32_t q = (e[k] & 0x7F) ? 0x7F : ((e[k] >> 8) & 0x80) | 0x7E;

            r = (r & ~(0xFFu << (8 * k))) | q << (8 * k);
        }
    }
    return r;
}

/* Four bf16 (two words) to four E4M3 bytes by mark_div; with fix, Inf and NaN set apart. */
static __device__ __forceinline__ uint32_t quant4_bf16(uint32_t w0, uint32_t w1, float s,
                                                       float rc, bool fix)
{
    uint32_t a = e4m3x2(mark_div(u2f(w0 & 0xFFFF0000u), s, rc), mark_div(u2f(w0 << 16), s, rc));
    uint32_t b = e4m3x2(mark_div(u2f(w1 & 0xFFFF0000u), s, rc), mark_div(u2f(w1 << 16), s, rc));
    uint32_t r = (a | b << 16) | (__byte_perm(w0, w1, 0x7531) & 0x80808080u);

    if (fix && (__vcmpeq2(w0 & BF16_EXP2, BF16_EXP2) | __vcmpeq2(w1 & BF16_EXP2, BF16_EXP2)))
        r = fix_nonfinite(r, w0, w1);
    return r;
}

/* How a block's elements are divided: by mark_div (finite elements only, or checked for Inf
 * and NaN), or by quant_one (the scale outside mark_div's range). */
enum { Q_FAST, Q_FIX, Q_DIV };

/* Eight bf16 to their E4M3 bytes, as mode says (uniform over the thread block). */
static __device__ __forceinline__ uint2 quant8_bf16(uint4 v, float s, float rc, int mode)
{
    vec16<src_bf16> x;
    qvec<8> o;

    if (mode != Q_DIV)
        return make_uint2(quant4_bf16(v.x, v.y, s, rc, mode == Q_FIX),
                          quant4_bf16(v.z, v.w, s, rc, mode == Q_FIX));
    x.u = v;
#pragma unroll
    for (int u = 0; u < 8; u++)
        o.b[u] = quant_one(u2f(bf16_bits(x.e[u])), s);
    return o.u;
}

/* The max of |x|'s 16 bits over the eight bf16 of v, folded into m two at a time;
 * vmax_finite_bf16 the same over the finite ones only (Inf and NaN masked to 0). */
static __device__ __forceinline__ uint32_t vmax_bf16(uint32_t m, uint4 v)
{
    return __vmaxu2(m, __vmaxu2(__vmaxu2(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu),
                                __vmaxu2(v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu)));
}

static __device__ __forceinline__ uint32_t vmax_finite_bf16(uint32_t m, uint4 v)
{
    uint32_t a = v.x & 0x7FFF7FFFu, b = v.y & 0x7FFF7FFFu;
    uint32_t c = v.z & 0x7FFF7FFFu, d = v.w & 0x7FFF7FFFu;

    a &= __vcmpltu2(a, BF16_EXP2);
    b &= __vcmpltu2(b, BF16_EXP2);
    c &= __vcmpltu2(c, BF16_EXP2);
    d &= __vcmpltu2(d, BF16_EXP2);
    return __vmaxu2(m, __vmaxu2(__vmaxu2(a, b), __vmaxu2(c, d)));
}

/* The block's max of every thread's 16-bit maxima (two in m), as fp32 bits. */
static __device__ __forceinline__ uint32_t block_max16(uint32_t m, uint32_t *red)
{
    m = (m & 0xFFFF) > (m >> 16) ? (m & 0xFFFF) : (m >> 16);
    return block_max(m << 16, red);
}

/* The block's scale from its finite amax (fp32 bits), written once; the block's mode. */
static __device__ __forceinline__ float scale_bf16(const qdesc &o, uint64_t i, uint64_t j,
                                                   uint32_t raw, bool nonfinite, int *mode)
{
    float sf = scale_of(raw);

    if (threadIdx.x == 0)
        ((float *)o.scales)[(int64_t)i * o.scstride + (int64_t)j] = sf;
    *mode = f2u(sf) < (UINT32_C(127 - 60) << 23) || f2u(sf) > (UINT32_C(127 + 60) << 23)
                ? Q_DIV : nonfinite ? Q_FIX : Q_FAST;
    return sf;
}

/* Rows a thread of reg_load holds: a 128x128 block is 16 rows of 16 vectors at a time, 8 rows
 * a thread. */
#define QREG 8

/* block_bf16 for a tile whose threads each hold at most one vector of each of at most QREG
 * rows (reg_fits): the tile is read once, every load of a thread in flight together, and
 * quantized from registers, where the two-pass version waited for each load in turn and read
 * the tile twice (bench/RESULTS.md): reg_load reads a thread's vectors, reg_quant takes the
 * block's scale from them and writes their bytes. (Loading the next tile while this one is
 * quantized, into registers or by cp.async into shared memory, was measured slower through
 * the daemons.) */
static __device__ __forceinline__ bool reg_fits(const tile &t)
{
    return t.nc <= t.wx && t.nr <= (uint64_t)QREG * t.wy;
}

static __device__ __forceinline__ void reg_load(const qdesc &o, const tile &t, uint4 *v)
{
    const uint16_t *src = (const uint16_t *)o.src;
    const bool col = t.tx < t.nc;

#pragma unroll
    for (int k = 0; k < QREG; k++) {
        uint64_t r = t.ty + (uint64_t)k * t.wy;

        v[k] = make_uint4(0, 0, 0, 0);
        if (col && r < t.nr)
            v[k] = ((const uint4 *)(src + (int64_t)(t.r0 + r) * o.sstride +
                                    (int64_t)t.c0 * 8))[t.tx];
    }
}

static __device__ __forceinline__ void reg_quant(const qdesc &o, const tile &t, uint64_t i,
                                                 uint64_t j, const uint4 *v, uint32_t *red)
{
    const bool col = t.tx < t.nc;
    uint32_t m = 0, a, f;
    float sf, rc;
    int mode;

#pragma unroll
    for (int k = 0; k < QREG; k++)
        m = vmax_bf16(m, v[k]);
    /* A thread that holds an Inf or NaN (|x|'s bits >= 0x7F80) takes its max again over its
     * finite elements; one reduction gives the block both maxima, the finite one in the high
     * half (the scale) and the other in the low half (whether the block holds Inf or NaN, so
     * that its threads check their words). Blocks of finite weights run as before but for the
     * halves' max; blocks with Inf or NaN are no longer reduced twice. */
    a = (m & 0xFFFF) > (m >> 16) ? (m & 0xFFFF) : (m >> 16);
    f = a;
    if (a >= 0x7F80u) {
        m = 0;
#pragma unroll
        for (int k = 0; k < QREG; k++)
            m = vmax_finite_bf16(m, v[k]);
        f = (m & 0xFFFF) > (m >> 16) ? (m & 0xFFFF) : (m >> 16);
    }
    m = block_vmax2(f << 16 | a, red);
    sf = scale_bf16(o, i, j, m & 0xFFFF0000u, (m & 0xFFFF) >= 0x7F80u, &mode);
    rc = __frcp_rn(sf);
#pragma unroll
    for (int k = 0; k < QREG; k++) {
        uint64_t r = t.ty + (uint64_t)k * t.wy;

        if (col && r < t.nr)
            ((uint2 *)(o.q + (int64_t)(t.r0 + r) * o.qstride + (int64_t)t.c0 * 8))[t.tx] =
                quant8_bf16(v[k], sf, rc, mode);
    }
}

static __device__ __forceinline__ void block_bf16(const qdesc &o, const tile &t, uint64_t i,
                                                  uint64_t j, uint32_t *red)
{
    const uint16_t *src = (const uint16_t *)o.src;
    uint32_t m = 0, raw;
    bool nonfinite = false;
    float sf, rc;
    int mode;

    if (reg_fits(t)) {
        uint4 v[QREG];

        reg_load(o, t, v);
        reg_quant(o, t, i, j, v, red);
        return;
    }
    for (int pass = 0; pass < 2; pass++) {
        /* The second pass, over the finite elements, where the first found Inf or NaN. */
        for (uint64_t r = t.ty; r < t.nr; r += t.wy) {
            const uint4 *row = (const uint4 *)(src + (int64_t)(t.r0 + r) * o.sstride +
                                               (int64_t)t.c0 * 8);

            for (uint64_t c = t.tx; c < t.nc; c += t.wx)
                m = pass ? vmax_finite_bf16(m, row[c]) : vmax_bf16(m, row[c]);
        }
        raw = block_max16(m, red);
        if (raw < UINT32_C(0x7F800000))
            break;
        nonfinite = true;
        m = 0;
    }
    sf = scale_bf16(o, i, j, raw, nonfinite, &mode);
    rc = __frcp_rn(sf);
    for (uint64_t r = t.ty; r < t.nr; r += t.wy) {
        const uint4 *row = (const uint4 *)(src + (int64_t)(t.r0 + r) * o.sstride +
                                           (int64_t)t.c0 * 8);
        uint2 *qrow = (uint2 *)(o.q + (int64_t)(t.r0 + r) * o.qstride + (int64_t)t.c0 * 8);

        for (uint64_t c = t.tx; c < t.nc; c += t.wx)
            qrow[c] = quant8_bf16(row[c], sf, rc, mode);
    }
}

/* BLOCK and CHANNEL: block k of the grid, (k / scols, k % scols), by the whole thread block. */
template <typename S>
static __device__ __forceinline__ void do_block(const qdesc &o, uint64_t k, uint32_t *red)
{
    const typename S::T *src = (const typename S::T *)o.src;
    const int V = vec16<S>::V;
    uint64_t i = k / o.scols, j = k - i * o.scols, r0 = i * o.br, c0 = j * o.bc;
    uint64_t nr = o.rows - r0 < o.br ? o.rows - r0 : o.br;
    uint64_t nc = o.cols - c0 < o.bc ? o.cols - c0 : o.bc;
    float s;

    if (o.vec && o.dt == RF_DT_BF16) {
        block_bf16(o, tile_at(r0, c0 / V, nr, nc / V), i, j, red);
    } else if (o.vec) {
        tile t = tile_at(r0, c0 / V, nr, nc / V);

        s = scale_of(block_max(tile_amax_v<S>(t, src, o.sstride, 0), red));
        if (threadIdx.x == 0)
            ((float *)o.scales)[(int64_t)i * o.scstride + (int64_t)j] = s;
        tile_quant_v<S>(t, src, o.sstride, s, o.q, o.qstride);
    } else {
        tile t = tile_at(r0, c0, nr, nc);

        s = scale_of(block_max(tile_amax<S>(t, src, o.sstride, 0), red));
        if (threadIdx.x == 0)
            ((float *)o.scales)[(int64_t)i * o.scstride + (int64_t)j] = s;
        tile_quant<S>(t, src, o.sstride, s, o.q, o.qstride);
    }
}

/* MXFP8: tile k is 1 x 32 blocks [k * WARPS, k * WARPS + WARPS), one warp each, one element
 * per lane (lanes past the row's end hold 0). */
template <typename S>
static __device__ __forceinline__ void do_mx(const qdesc &o, uint64_t k)
{
    const typename S::T *src = (const typename S::T *)o.src;
    const uint32_t lane = threadIdx.x & 31;
    uint64_t b = k * WARPS + (threadIdx.x >> 5), i, j, c;
    uint32_t x;
    uint8_t e;

    if (b >= o.nblocks)
        return;
    i = b / o.scols;
    j = b - i * o.scols;
    c = j * RF_QUANT_MX_BLOCK + lane;
    x = c < o.cols ? S::bits(src[(int64_t)i * o.sstride + (int64_t)c]) : 0;
    e = e8m0_of(warp_max(finite_abs(x)));
    if (lane == 0)
        ((uint8_t *)o.scales)[(int64_t)i * o.scstride + (int64_t)j] = e;
    if (c < o.cols)
        o.q[(int64_t)i * o.qstride + (int64_t)c] = quant_one(u2f(x), e8m0_to_float(e));
}

template <typename S>
static __device__ __forceinline__ void do_tile(const qdesc &o, uint64_t k, uint32_t *red)
{
    if (o.kind == RF_QUANT_MXFP8)
        do_mx<S>(o, k);
    else
        do_block<S>(o, k, red);
}

/* Tile k of o, whatever its format and source type. Not inlined: the other paths' registers
 * stay out of the batch kernel's loop. */
static __device__ __noinline__ void any_tile(const qdesc &o, uint64_t tk, uint32_t *red)
{
    switch (o.dt) {
    case RF_DT_BF16:
        do_tile<src_bf16>(o, tk, red);
        break;
    case RF_DT_FP16:
        do_tile<src_fp16>(o, tk, red);
        break;
    default:
        do_tile<src_fp32>(o, tk, red);
        break;
    }
}

/* Resident blocks per SM the batch kernel's registers must allow: unbounded it takes 120
 * registers a thread, 2 blocks an SM; held to 3 (a few bytes spilled, in the rare paths) the
 * FP8 refit of qwen3-30b-a3b ran 0.0502 s against 0.0582 (2) on an H200, bench/RESULTS.md. */
#define MIN_BLOCKS 3

/* Tiles [lo, lo + n) of the descriptors d[0..nd) (tile0[i]: d[i]'s first tile, ascending), or
 * of the one descriptor `one` (d NULL, its tiles from 0). Each thread block takes a run of
 * consecutive tiles, whole: it finds its first descriptor once (a binary search), keeps the
 * descriptor in shared memory and steps to the next one when a matrix's tiles end. */
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
batch_kernel(const qdesc *d, const uint64_t *tile0, uint32_t nd, qdesc one, uint64_t lo,
             uint64_t n)
{
    __shared__ uint32_t red[WARPS];
    __shared__ qdesc o;
    const uint64_t per = (n + gridDim.x - 1) / gridDim.x;
    uint64_t k = lo + blockIdx.x * per, end, tk = k;
    uint32_t a = 0;

    end = lo + (blockIdx.x + 1) * per < lo + n ? lo + (blockIdx.x + 1) * per : lo + n;
    if (k >= end)
        return;
    if (d) {
        uint32_t b = nd;

        /* The last descriptor whose first tile is at or before k. */
        while (b - a > 1) {
            uint32_t mid = a + (b - a) / 2;

            if (tile0[mid] <= k)
                a = mid;
            else
                b = mid;
        }
        tk = k - tile0[a];
    }
    if (threadIdx.x == 0)
        o = d ? d[a] : one;
    __syncthreads();
    for (; k < end; k++, tk++) {
        while (tk >= o.ntiles) {
            /* Every thread has read o for its last tile (block_max ends in a barrier; MXFP8
             * tiles have none, hence this one). */
            tk -= o.ntiles;
            __syncthreads();
            if (threadIdx.x == 0)
                o = d[++a];
            __syncthreads();
        }
        any_tile(o, tk, red);
    }
}

/* TENSOR, pass 1: each block's amax over its tiles (tr x tc, a tcols-wide grid), folded into
 * *acc (zeroed before) with one atomicMax of fp32 bits per block: max is exact in any order. */
template <typename S>
__global__ void tensor_amax_kernel(const typename S::T *src, int64_t sstride, uint64_t rows,
                                   uint64_t cols, uint64_t tr, uint64_t tc, uint64_t tcols,
                                   uint64_t tiles, uint32_t *acc)
{
    __shared__ uint32_t red[WARPS];
    uint32_t m = 0;

    for (uint64_t k = blockIdx.x; k < tiles; k += gridDim.x) {
        uint64_t i = k / tcols, j = k - i * tcols, r0 = i * tr, c0 = j * tc;
        tile t = tile_at(r0, c0, rows - r0 < tr ? rows - r0 : tr, cols - c0 < tc ? cols - c0 : tc);

        m = tile_amax<S>(t, src, sstride, m);
    }
    m = block_max(m, red);
    if (threadIdx.x == 0 && m != 0)
        atomicMax(acc, m);
}

/* TENSOR, between the passes: the accumulated amax bits become the scale, in place. */
__global__ void tensor_scale_kernel(float *slot)
{
    *slot = scale_of(*(uint32_t *)slot);
}

/* TENSOR, pass 2: every element with the one scale. */
template <typename S>
__global__ void tensor_quant_kernel(const typename S::T *src, int64_t sstride, uint64_t rows,
                                    uint64_t cols, uint64_t tr, uint64_t tc, uint64_t tcols,
                                    uint64_t tiles, uint8_t *q, int64_t qstride,
                                    const float *slot)
{
    const float s = *slot;

    for (uint64_t k = blockIdx.x; k < tiles; k += gridDim.x) {
        uint64_t i = k / tcols, j = k - i * tcols, r0 = i * tr, c0 = j * tc;
        tile t = tile_at(r0, c0, rows - r0 < tr ? rows - r0 : tr, cols - c0 < tc ? cols - c0 : tc);

        tile_quant<S>(t, src, sstride, s, q, qstride);
    }
}

static unsigned grid_of(uint64_t tiles)
{
    return tiles < MAX_GRID ? (unsigned)tiles : MAX_GRID;
}

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return a / b + (a % b != 0);
}

/* Tiles each block of the batch kernel takes at least: its search for its first matrix and the
 * load of that descriptor are paid once per run, not per tile (a 4 GiB batch of 128x128 blocks
 * gave each of 65536 blocks 2 tiles). */
#define RUN_TILES 16

static unsigned batch_grid(uint64_t tiles)
{
    return grid_of(ceil_div(tiles, RUN_TILES));
}

/* The batch kernel over tiles [lo, lo + n) (see batch_kernel). */
static int launch_batch(const qdesc *d, const uint64_t *tile0, uint32_t nd, const qdesc &one,
                        uint64_t lo, uint64_t n, cudaStream_t s, rf_err *err)
{
    int rc = 0;

    batch_kernel<<<batch_grid(n), THREADS, 0, s>>>(d, tile0, nd, one, lo, n);
    CUDA_TRY(err, cudaGetLastError());
out:
    return rc;
}

/* TENSOR's three passes for source type S; the arguments were checked. */
template <typename S>
static int launch_tensor(const void *src_v, int64_t sstride, uint64_t rows, uint64_t cols,
                         uint8_t *q, int64_t qstride, void *scales, cudaStream_t s, rf_err *err)
{
    const typename S::T *src = (const typename S::T *)src_v;
    uint64_t tc = cols < TENSOR_TILE ? cols : TENSOR_TILE, tr = TENSOR_TILE / tc;
    uint64_t tcols = ceil_div(cols, tc), ttiles = ceil_div(rows, tr) * tcols;
    int rc = 0;

    CUDA_TRY(err, cudaMemsetAsync(scales, 0, sizeof(float), s));
    tensor_amax_kernel<S><<<grid_of(ttiles), THREADS, 0, s>>>(
        src, sstride, rows, cols, tr, tc, tcols, ttiles, (uint32_t *)scales);
    CUDA_TRY(err, cudaGetLastError());
    tensor_scale_kernel<<<1, 1, 0, s>>>((float *)scales);
    CUDA_TRY(err, cudaGetLastError());
    tensor_quant_kernel<S><<<grid_of(ttiles), THREADS, 0, s>>>(
        src, sstride, rows, cols, tr, tc, tcols, ttiles, q, qstride, (const float *)scales);
    CUDA_TRY(err, cudaGetLastError());
out:
    return rc;
}

static int tensor_quantize(rf_dtype dt, const void *src, int64_t sstride, uint64_t rows,
                           uint64_t cols, uint8_t *q, int64_t qstride, void *scales,
                           cudaStream_t s, rf_err *err)
{
    switch (dt) {
    case RF_DT_BF16:
        return launch_tensor<src_bf16>(src, sstride, rows, cols, q, qstride, scales, s, err);
    case RF_DT_FP16:
        return launch_tensor<src_fp16>(src, sstride, rows, cols, q, qstride, scales, s, err);
    default:
        return launch_tensor<src_fp32>(src, sstride, rows, cols, q, qstride, scales, s, err);
    }
}

/* The batch kernel's descriptor of a checked BLOCK, CHANNEL or MXFP8 matrix, and its tiles. */
static qdesc desc_of(const rf_quant_fmt *f, rf_dtype dt, const void *src, int64_t sstride,
                     uint64_t rows, uint64_t cols, uint8_t *q, int64_t qstride, void *scales,
                     int64_t scstride, uint64_t srows, uint64_t scols, uint64_t *tiles)
{
    qdesc o;
    uint64_t es = rf_dtype_size(dt), V = 16 / es;

    memset(&o, 0, sizeof(o));
    o.src = src;
    o.q = q;
    o.scales = scales;
    o.sstride = rows > 1 ? sstride : 0;
    o.qstride = rows > 1 ? qstride : 0;
    o.scstride = srows > 1 ? scstride : 0;
    o.rows = rows;
    o.cols = cols;
    o.br = f->kind == RF_QUANT_BLOCK ? f->br : 1;
    o.bc = f->kind == RF_QUANT_BLOCK ? f->bc : f->kind == RF_QUANT_CHANNEL ? cols
                                                                         : RF_QUANT_MX_BLOCK;
    o.scols = scols;
    o.nblocks = srows * scols;
    o.kind = (uint32_t)f->kind;
    o.dt = (uint32_t)dt;
    /* Whole vectors in every tile, each at an aligned address. */
    o.vec = f->kind != RF_QUANT_MXFP8 && (uintptr_t)src % 16 == 0 && (uintptr_t)q % V == 0 &&
            cols % V == 0 && o.bc % V == 0 && (uint64_t)o.sstride * es % 16 == 0 &&
            (uint64_t)o.qstride % V == 0;
    *tiles = o.ntiles = f->kind == RF_QUANT_MXFP8 ? ceil_div(o.nblocks, WARPS) : o.nblocks;
    return o;
}

/* rf_quant_host's checks (quant.c keeps its own static), worded for this function, and the
 * alignment a GPU needs. */
static int check(const rf_quant_fmt *f, rf_dtype dt, const void *src, int64_t sstride,
                 uint64_t rows, uint64_t cols, const void *q, int64_t qstride,
                 const void *scales, int64_t scstride, uint64_t *srows, uint64_t *scols,
                 rf_err *err)
{
    size_t es = rf_dtype_size(dt), ss;
    int rc;

    if (dt != RF_DT_BF16 && dt != RF_DT_FP16 && dt != RF_DT_FP32)
        return rf_err_set(err, -EINVAL, "quantize_cuda: source dtype %s cannot be quantized; it "
                          "must be bf16, fp16 or fp32", rf_dtype_name(dt));
    if ((rc = rf_quant_scale_shape(f, rows, cols, srows, scols, err)) < 0)
        return rc;
    if (rows == 0 || cols == 0)
        return 0;
    ss = rf_dtype_size(rf_quant_scale_dtype(f));
    if (src == NULL || q == NULL || scales == NULL)
        return rf_err_set(err, -EINVAL, "quantize_cuda: a buffer of the %" PRIu64 "x%" PRIu64
                          " matrix is NULL (input %p, output %p, scales %p)", rows, cols, src, q,
                          scales);
    if (rows > 1 && (sstride < 0 || (uint64_t)sstride < cols || qstride < 0 ||
                     (uint64_t)qstride < cols))
        return rf_err_set(err, -EINVAL, "quantize_cuda: row strides %" PRId64 " (input) and %"
                          PRId64 " (output) of the %" PRIu64 "x%" PRIu64 " matrix must be at "
                          "least its %" PRIu64 " columns", sstride, qstride, rows, cols, cols);
    if (*srows > 1 && (scstride < 0 || (uint64_t)scstride < *scols))
        return rf_err_set(err, -EINVAL, "quantize_cuda: the scales' row stride %" PRId64 " must "
                          "be at least their %" PRIu64 " columns (%" PRIu64 "x%" PRIu64
                          " scales)", scstride, *scols, *srows, *scols);
    if ((uintptr_t)src % es != 0 || (uintptr_t)scales % ss != 0)
        return rf_err_set(err, -EINVAL, "quantize_cuda: the source %p must be aligned to its "
                          "%zu-byte %s elements and the scales %p to their %zu bytes", src, es,
                          rf_dtype_name(dt), scales, ss);
    return 0;
}

int rf_quant_cuda_quantize(const rf_quant_fmt *f, rf_dtype src_dt, const void *src,
                           int64_t src_row_stride, uint64_t rows, uint64_t cols, uint8_t *q,
                           int64_t q_row_stride, void *scales, int64_t scale_row_stride,
                           cudaStream_t s, rf_err *err)
{
    uint64_t srows = 0, scols = 0, tiles;
    int rc = check(f, src_dt, src, src_row_stride, rows, cols, q, q_row_stride, scales,
                   scale_row_stride, &srows, &scols, err);
    qdesc o;

    if (rc < 0 || rows == 0 || cols == 0)
        return rc;
    if (f->kind == RF_QUANT_TENSOR)
        return tensor_quantize(src_dt, src, src_row_stride, rows, cols, q, q_row_stride, scales,
                               s, err);
    o = desc_of(f, src_dt, src, src_row_stride, rows, cols, q, q_row_stride, scales,
                scale_row_stride, srows, scols, &tiles);
    return launch_batch(NULL, NULL, 0, o, 0, tiles, s, err);
}

/* ---- plans: many matrices, their descriptors on the device ---- */

struct rf_quant_cuda_plan {
    size_t n;          /* ops */
    uint32_t nd;       /* of them in the batch kernel's descriptors */
    qdesc *devd;       /* nd, on the device */
    uint64_t *devt0;   /* nd + 1 first tiles, on the device */
    uint64_t *t0;      /* the same on the host */
    uint32_t *didx;    /* n + 1: op i's descriptors start at didx[i] */
    rf_quant_cuda_op *tens; /* TENSOR ops, launched one by one */
    size_t *tidx;      /* n + 1: op i's TENSOR ops start at tidx[i] */
    uint64_t bytes;
    uint64_t tiles, scalar_tiles; /* of the batch kernel; of them read element by element */
};

int rf_quant_cuda_plan_new(const rf_quant_cuda_op *ops, size_t n, rf_quant_cuda_plan **out,
                           rf_err *err)
{
    rf_quant_cuda_plan *pl = NULL;
    qdesc *host = NULL;
    uint64_t tiles = 0;
    size_t nt = 0;
    uint32_t nd = 0;
    int rc = 0;

    *out = NULL;
    if (n >= UINT32_MAX)
        return rf_err_set(err, -E2BIG, "quantize_cuda: %zu matrices in one plan; at most 2^32 - "
                          "2", n);
    pl = (rf_quant_cuda_plan *)calloc(1, sizeof(*pl));
    host = (qdesc *)malloc((n ? n : 1) * sizeof(*host));
    if (pl) {
        pl->t0 = (uint64_t *)malloc((n + 1) * sizeof(uint64_t));
        pl->didx = (uint32_t *)malloc((n + 1) * sizeof(uint32_t));
        pl->tidx = (size_t *)malloc((n + 1) * sizeof(size_t));
        pl->tens = (rf_quant_cuda_op *)malloc((n ? n : 1) * sizeof(rf_quant_cuda_op));
    }
    if (!pl || !host || !pl->t0 || !pl->didx || !pl->tidx || !pl->tens) {
        rc = rf_err_set(err, -ENOMEM, "quantize_cuda: out of memory for a plan of %zu matrices",
                        n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const rf_quant_cuda_op *o = &ops[i];
        uint64_t srows = 0, scols = 0, t;
        rf_err e = {0};

        pl->didx[i] = nd;
        pl->tidx[i] = nt;
        if ((rc = check(&o->fmt, o->dt, o->src, o->src_row_stride, o->rows, o->cols, o->q,
                        o->q_row_stride, o->scales, o->scale_row_stride, &srows, &scols,
                        &e)) < 0) {
            rf_err_set(err, rc, "matrix %zu of the plan: %s", i, e.msg);
            goto out;
        }
        if (o->rows == 0 || o->cols == 0)
            continue;
        if (o->fmt.kind == RF_QUANT_TENSOR) {
            pl->tens[nt++] = *o;
            continue;
        }
        host[nd] = desc_of(&o->fmt, o->dt, o->src, o->src_row_stride, o->rows, o->cols, o->q,
                           o->q_row_stride, o->scales, o->scale_row_stride, srows, scols, &t);
        pl->t0[nd++] = tiles;
        tiles += t;
        if (!host[nd - 1].vec)
            pl->scalar_tiles += t;
    }
    pl->didx[n] = nd;
    pl->tidx[n] = nt;
    pl->t0[nd] = tiles;
    pl->tiles = tiles;
    pl->n = n;
    pl->nd = nd;
    if (nd > 0) {
        CUDA_TRY(err, cudaMalloc((void **)&pl->devd, nd * sizeof(qdesc)));
        CUDA_TRY(err, cudaMalloc((void **)&pl->devt0, (nd + 1) * sizeof(uint64_t)));
        CUDA_TRY(err, cudaMemcpy(pl->devd, host, nd * sizeof(qdesc), cudaMemcpyHostToDevice));
        CUDA_TRY(err, cudaMemcpy(pl->devt0, pl->t0, (nd + 1) * sizeof(uint64_t),
                                 cudaMemcpyHostToDevice));
        pl->bytes = nd * sizeof(qdesc) + (nd + 1) * sizeof(uint64_t);
    }
    *out = pl;
    pl = NULL;
out:
    free(host);
    rf_quant_cuda_plan_free(pl);
    return rc;
}

int rf_quant_cuda_plan_launch(const rf_quant_cuda_plan *pl, size_t first, size_t count,
                              cudaStream_t s, rf_err *err)
{
    uint32_t a, b;
    uint64_t tiles;
    int rc = 0;

    if (first > pl->n || count > pl->n - first)
        return rf_err_set(err, -EINVAL, "quantize_cuda: matrices [%zu, %zu) of a plan of %zu",
                          first, first + count, pl->n);
    a = pl->didx[first];
    b = pl->didx[first + count];
    tiles = pl->t0[b] - pl->t0[a];
    if (tiles > 0) {
        qdesc none;

        memset(&none, 0, sizeof(none));
        if ((rc = launch_batch(pl->devd + a, pl->devt0 + a, b - a, none, pl->t0[a], tiles, s,
                               err)) < 0)
            return rc;
    }
    for (size_t i = pl->tidx[first]; i < pl->tidx[first + count]; i++) {
        const rf_quant_cuda_op *o = &pl->tens[i];

        if ((rc = tensor_quantize(o->dt, o->src, o->src_row_stride, o->rows, o->cols, o->q,
                                  o->q_row_stride, o->scales, s, err)) < 0)
            return rc;
    }
    return rc;
}

uint64_t rf_quant_cuda_plan_bytes(const rf_quant_cuda_plan *pl)
{
    return pl ? pl->bytes : 0;
}

uint64_t rf_quant_cuda_plan_tiles(const rf_quant_cuda_plan *pl, uint64_t *scalar)
{
    *scalar = pl ? pl->scalar_tiles : 0;
    return pl ? pl->tiles : 0;
}

void rf_quant_cuda_plan_free(rf_quant_cuda_plan *pl)
{
    if (!pl)
        return;
    cudaFree(pl->devd);
    cudaFree(pl->devt0);
    free(pl->t0);
    free(pl->didx);
    free(pl->tidx);
    free(pl->tens);
    free(pl);
}
