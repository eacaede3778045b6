/* common/data/quant_cuda.cu - the FP8 quantization kernels (the contract is in quant.h): one
 * thread block per quantization block (BLOCK), per row (CHANNEL), one warp per 1 x 32 block
 * (MXFP8), and for TENSOR an amax pass, a one-thread scale, then a quantizing pass. Every
 * element is read from DRAM once; the quantizing pass of a block re-reads it from cache. */
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

/* quant.c's e4m3_from_float, the algorithm of c10's fp8e4m3fn_from_fp32_value, line for line:
 * both paths computed and one selected. */
static __host__ __device__ __forceinline__ uint8_t e4m3_from_float(float f)
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

/* quant.c's quant_one: v = x / s, clamped to +-448 on the bits of |v| (NaN kept), NaN -> 0x7F. */
static __host__ __device__ __forceinline__ uint8_t quant_one(float x, float s)
{
    uint32_t b = f2u(div_rn(x, s)), sign = b & UINT32_C(0x80000000), a = b ^ sign;
    uint32_t nan = a > UINT32_C(0x7F800000);
    uint8_t r;

    a = a > UINT32_C(0x43E00000) ? UINT32_C(0x43E00000) : a;
    r = e4m3_from_float(u2f(a | sign));
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

/* BLOCK (br x bc) and CHANNEL (1 x cols): tile k of the scols-wide grid of blocks is the block
 * at (k / scols, k % scols). */
template <typename S>
__global__ void block_kernel(const typename S::T *src, int64_t sstride, uint64_t rows,
                             uint64_t cols, uint64_t br, uint64_t bc, uint64_t scols,
                             uint64_t tiles, uint8_t *q, int64_t qstride, float *scales,
                             int64_t scstride)
{
    __shared__ uint32_t red[WARPS];

    for (uint64_t k = blockIdx.x; k < tiles; k += gridDim.x) {
        uint64_t i = k / scols, j = k - i * scols, r0 = i * br, c0 = j * bc;
        tile t = tile_at(r0, c0, rows - r0 < br ? rows - r0 : br, cols - c0 < bc ? cols - c0 : bc);
        float s = scale_of(block_max(tile_amax<S>(t, src, sstride, 0), red));

        if (threadIdx.x == 0)
            scales[(int64_t)i * scstride + (int64_t)j] = s;
        tile_quant<S>(t, src, sstride, s, q, qstride);
    }
}

/* MXFP8: one warp per 1 x 32 block, one element per lane (lanes past the row's end hold 0). */
template <typename S>
__global__ void mx_kernel(const typename S::T *src, int64_t sstride, uint64_t cols,
                          uint64_t scols, uint64_t tiles, uint8_t *q, int64_t qstride,
                          uint8_t *scales, int64_t scstride)
{
    const uint32_t lane = threadIdx.x & 31;
    const uint64_t warps = (uint64_t)gridDim.x * WARPS;

    for (uint64_t k = (uint64_t)blockIdx.x * WARPS + (threadIdx.x >> 5); k < tiles; k += warps) {
        uint64_t i = k / scols, j = k - i * scols, c = j * RF_QUANT_MX_BLOCK + lane;
        uint32_t x = c < cols ? S::bits(src[(int64_t)i * sstride + (int64_t)c]) : 0;
        uint8_t e = e8m0_of(warp_max(finite_abs(x)));

        if (lane == 0)
            scales[(int64_t)i * scstride + (int64_t)j] = e;
        if (c < cols)
            q[(int64_t)i * qstride + (int64_t)c] = quant_one(u2f(x), e8m0_to_float(e));
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

/* Enqueues the kernels of format f for source type S; the arguments were checked. */
template <typename S>
static int launch(const rf_quant_fmt *f, const void *src_v, int64_t sstride, uint64_t rows,
                  uint64_t cols, uint8_t *q, int64_t qstride, void *scales, int64_t scstride,
                  uint64_t srows, uint64_t scols, cudaStream_t s, rf_err *err)
{
    const typename S::T *src = (const typename S::T *)src_v;
    uint64_t tiles = srows * scols;
    int rc = 0;

    switch (f->kind) {
    case RF_QUANT_BLOCK:
    case RF_QUANT_CHANNEL: {
        uint64_t br = f->kind == RF_QUANT_BLOCK ? f->br : 1;
        uint64_t bc = f->kind == RF_QUANT_BLOCK ? f->bc : cols;

        block_kernel<S><<<grid_of(tiles), THREADS, 0, s>>>(src, sstride, rows, cols, br, bc,
                                                           scols, tiles, q, qstride,
                                                           (float *)scales, scstride);
        CUDA_TRY(err, cudaGetLastError());
        break;
    }
    case RF_QUANT_MXFP8:
        mx_kernel<S><<<grid_of(ceil_div(tiles, WARPS)), THREADS, 0, s>>>(
            src, sstride, cols, scols, tiles, q, qstride, (uint8_t *)scales, scstride);
        CUDA_TRY(err, cudaGetLastError());
        break;
    default: {
        uint64_t tc = cols < TENSOR_TILE ? cols : TENSOR_TILE, tr = TENSOR_TILE / tc;
        uint64_t tcols = ceil_div(cols, tc), ttiles = ceil_div(rows, tr) * tcols;

        CUDA_TRY(err, cudaMemsetAsync(scales, 0, sizeof(float), s));
        tensor_amax_kernel<S><<<grid_of(ttiles), THREADS, 0, s>>>(
            src, sstride, rows, cols, tr, tc, tcols, ttiles, (uint32_t *)scales);
        CUDA_TRY(err, cudaGetLastError());
        tensor_scale_kernel<<<1, 1, 0, s>>>((float *)scales);
        CUDA_TRY(err, cudaGetLastError());
        tensor_quant_kernel<S><<<grid_of(ttiles), THREADS, 0, s>>>(
            src, sstride, rows, cols, tr, tc, tcols, ttiles, q, qstride, (const float *)scales);
        CUDA_TRY(err, cudaGetLastError());
        break;
    }
    }
out:
    return rc;
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
    uint64_t srows = 0, scols = 0;
    int rc = check(f, src_dt, src, src_row_stride, rows, cols, q, q_row_stride, scales,
                   scale_row_stride, &srows, &scols, err);

    if (rc < 0 || rows == 0 || cols == 0)
        return rc;
    switch (src_dt) {
    case RF_DT_BF16:
        return launch<src_bf16>(f, src, src_row_stride, rows, cols, q, q_row_stride, scales,
                                scale_row_stride, srows, scols, s, err);
    case RF_DT_FP16:
        return launch<src_fp16>(f, src, src_row_stride, rows, cols, q, q_row_stride, scales,
                                scale_row_stride, srows, scols, s, err);
    default:
        return launch<src_fp32>(f, src, src_row_stride, rows, cols, q, q_row_stride, scales,
                                scale_row_stride, srows, scols, s, err);
    }
}
