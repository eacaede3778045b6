/* common/data/copy_cuda.cu - the gather/scatter kernels and the pair kernel (piece memory to piece
 * memory): descriptors reduced on the host with the host copy's own merging (rf_copy_flatten,
 * rf_copy_pair_flatten), split into chunks of packed bytes, one block per chunk, each thread
 * moving 16, 8, 4, 2 or 1 bytes at a time as alignment allows; and the tile kernel, which
 * transposes through shared memory the copies rf_copy_tile_choose picks (a box held transposed
 * on one side). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "copy_cuda.h"
#include "copy_tile.h"
#include "drv_cuda.h"

#define CHUNK (64u << 10)   /* staging bytes per block iteration: a multiple of 16 */
#define THREADS 256
#define MAX_DEV 64
#define NDIM (RF_MAX_DIMS + 1) /* outer dims plus a strided innermost one */

/* One descriptor as the kernel walks it: runs of `run` bytes, contiguous in both memories,
 * at mem + sum(idx[k] * str[k]) for idx over ext (row-major), packed in staging. */
typedef struct dev_desc {
    uint64_t mem;
    uint64_t stage;   /* staging offset */
    uint64_t bytes;
    uint64_t chunk0;  /* index of this descriptor's first chunk in the batch */
    uint64_t run;
    int64_t ext[NDIM];
    int64_t str[NDIM];
    uint32_t n;
    uint32_t vec;
} dev_desc;

/* One pair as the kernel walks it: runs of `run` bytes at src/dst + sum(idx[k] * str[k]) for
 * idx over ext (row-major), contiguous in both memories. A tile job (a pair, or a gather or
 * scatter descriptor as a pair with staging) is one too: chunk0 counts tiles, vec is the unit
 * (the run) and ta, tb the tiled dims (rf_copy_tile). */
typedef struct dev_pair {
    uint64_t src, dst;
    uint64_t bytes;
    uint64_t chunk0;  /* index of this pair's first chunk among all pairs of its array */
    uint64_t run;
    int64_t ext[RF_MAX_DIMS];
    int64_t sstr[RF_MAX_DIMS];
    int64_t dstr[RF_MAX_DIMS];
    uint32_t n;
    uint32_t vec;
    uint32_t ta, tb;
    uint32_t tk;      /* a tile job's units a thread moves at once (tile_vec); walks: 0 */
    uint32_t spare;
} dev_pair;

struct rf_copy_cuda_buf {
    int dev;
    int sms;
    unsigned max_blocks; /* 0: every SM, 16 blocks each */
    void *host;       /* pinned; descriptors of either kind */
    void *devp;
    size_t cap;       /* bytes */
    cudaEvent_t done; /* recorded after the last batch's launch */
    bool pending;
};

/* Quotient of a by b, in 32 bits when both fit: row and index arithmetic here nearly always
 * does, and the 64-bit division is several times longer. */
__device__ __forceinline__ uint64_t udiv(uint64_t a, uint64_t b)
{
    if (((a | b) >> 32) == 0)
        return (uint32_t)a / (uint32_t)b;
    return a / b;
}

/* The last of the descriptors d[0..n) (either kind) whose first chunk is at or before c. */
template <typename D>
__device__ __forceinline__ uint32_t chunk_find(const D *d, uint32_t n, uint64_t c)
{
    uint32_t lo = 0, hi = n - 1;

    while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2;

        if (d[mid].chunk0 <= c)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ __forceinline__ void move(const dev_desc &x, uint64_t lo, uint64_t hi,
                                     uint8_t *staging, bool gather)
{
    const uint64_t v = sizeof(T);

    for (uint64_t o = lo + threadIdx.x * v; o < hi; o += (uint64_t)blockDim.x * v) {
        uint64_t r = udiv(o, x.run);
        uint64_t addr = x.mem + (o - r * x.run);

        for (int k = (int)x.n - 1; k >= 0; k--) {
            uint64_t e = (uint64_t)x.ext[k];
            uint64_t q = udiv(r, e);

            addr += (r - q * e) * (uint64_t)x.str[k];
            r = q;
        }
        T *m = reinterpret_cast<T *>(addr);
        T *s = reinterpret_cast<T *>(staging + x.stage + o);
        if (gather)
            *s = *m;
        else
            *m = *s;
    }
}

__global__ void copy_kernel(const dev_desc *d, uint32_t n, uint64_t chunks, uint8_t *staging,
                            bool gather)
{
    __shared__ dev_desc x;

    for (uint64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
        if (threadIdx.x == 0)
            x = d[chunk_find(d, n, c)];
        __syncthreads();
        uint64_t lo = (c - x.chunk0) * CHUNK;
        uint64_t hi = lo + CHUNK < x.bytes ? lo + CHUNK : x.bytes;
        switch (x.vec) {
        case 16: move<uint4>(x, lo, hi, staging, gather); break;
        case 8: move<uint2>(x, lo, hi, staging, gather); break;
        case 4: move<uint32_t>(x, lo, hi, staging, gather); break;
        case 2: move<uint16_t>(x, lo, hi, staging, gather); break;
        default: move<uint8_t>(x, lo, hi, staging, gather); break;
        }
        __syncthreads();
    }
}

/* Where byte o of a pair's row-major packing lies in its source and its destination. */
__device__ __forceinline__ void pair_addr(const dev_pair &x, uint64_t o, uint64_t *sa,
                                          uint64_t *da)
{
    uint64_t r = udiv(o, x.run);
    uint64_t within = o - r * x.run;
    uint64_t s = x.src + within, d = x.dst + within;

    for (int k = (int)x.n - 1; k >= 0; k--) {
        uint64_t e = (uint64_t)x.ext[k];
        uint64_t q = udiv(r, e);
        uint64_t i = r - q * e;

        s += i * (uint64_t)x.sstr[k];
        d += i * (uint64_t)x.dstr[k];
        r = q;
    }
    *sa = s;
    *da = d;
}

/* Loads each thread keeps in flight before it stores them: a pair's two sides never overlap (a
 * local copy goes from trainer memory into engine memory), so its loads may run ahead of its
 * stores, and a thread that waited for each load before the next moved 1.5-1.7 TB/s on an H200
 * where 4 in flight come nearer the ceiling (bench_gpu local). */
#define PAIR_ILP 4

template <typename T>
__device__ __forceinline__ void move_pair(const dev_pair &x, uint64_t lo, uint64_t hi)
{
    const uint64_t v = sizeof(T), step = (uint64_t)blockDim.x * v;
    uint64_t o = lo + threadIdx.x * v;

    for (; o + (PAIR_ILP - 1) * step < hi; o += PAIR_ILP * step) {
        T val[PAIR_ILP];
        uint64_t da[PAIR_ILP];

#pragma unroll
        for (int u = 0; u < PAIR_ILP; u++) {
            uint64_t sa;

            pair_addr(x, o + u * step, &sa, &da[u]);
            val[u] = *reinterpret_cast<const T *>(sa);
        }
#pragma unroll
        for (int u = 0; u < PAIR_ILP; u++)
            *reinterpret_cast<T *>(da[u]) = val[u];
    }
    for (; o < hi; o += step) {
        uint64_t sa, da;

        pair_addr(x, o, &sa, &da);
        *reinterpret_cast<T *>(da) = *reinterpret_cast<const T *>(sa);
    }
}

/* Chunk c's bytes of pair x (c counted like x.chunk0). */
__device__ __forceinline__ void pair_chunk(const dev_pair &x, uint64_t c)
{
    uint64_t lo = (c - x.chunk0) * CHUNK;
    uint64_t hi = lo + CHUNK < x.bytes ? lo + CHUNK : x.bytes;

    switch (x.vec) {
    case 16: move_pair<uint4>(x, lo, hi); break;
    case 8: move_pair<uint2>(x, lo, hi); break;
    case 4: move_pair<uint32_t>(x, lo, hi); break;
    case 2: move_pair<uint16_t>(x, lo, hi); break;
    default: move_pair<uint8_t>(x, lo, hi); break;
    }
}



/* Chunks [chunk_lo, chunk_lo + chunks) of the pairs d[0..n), whose chunk0 count from the start
 * of the array they were cut from (a launch may take any run of a kept array). Block b copies
 * the b-th of gridDim.x equal runs of them: one search for its first pair, then the next pair
 * whenever a pair's chunks end. The grid is one wave (pair_grid). Against chunks grid-strided
 * over 16 blocks an SM with a search each, on an H200: contiguous 64 KiB copies 1720 -> 1894
 * GB/s, qwen3-30b-a3b through the daemons with verify = sample 0.038 -> 0.033 s (VMM memory);
 * over CUDA IPC mappings of cudaMalloc memory it is slower, 0.102 -> 0.122 s
 * (bench/RESULTS.md). */
__global__ void pair_kernel(const dev_pair *d, uint32_t n, uint64_t chunk_lo, uint64_t chunks)
{
    __shared__ dev_pair x;
    __shared__ uint64_t next0; /* the next pair's first chunk */
    __shared__ uint32_t a;
    uint64_t per = (chunks + gridDim.x - 1) / gridDim.x, c = chunk_lo + blockIdx.x * per, end;

    if (blockIdx.x * per >= chunks)
        return;
    end = c + per < chunk_lo + chunks ? c + per : chunk_lo + chunks;
    if (threadIdx.x == 0) {
        a = chunk_find(d, n, c);
        x = d[a];
        next0 = a + 1 < n ? d[a + 1].chunk0 : UINT64_MAX;
    }
    __syncthreads();
    for (; c < end; c++) {
        if (c >= next0) {
            /* Every thread is done with x: next0 changes only after this barrier. */
            __syncthreads();
            if (threadIdx.x == 0) {
                do
                    a++;
                while (a + 1 < n && d[a + 1].chunk0 <= c);
                x = d[a];
                next0 = a + 1 < n ? d[a + 1].chunk0 : UINT64_MAX;
            }
            __syncthreads();
        }
        pair_chunk(x, c);
    }
}

/* ---- tiles: copies held transposed on one side ---- */

/* Threads of a tile block, and blocks resident per SM at least: a transpose keeps its bandwidth
 * only with many loads in flight, and a block has a tile's loads in flight only between its
 * barriers, so several small blocks an SM keep more of them going than two large ones (each
 * thread holds TILE_LOADS loads in registers; 64 registers, a few spilled on sm_90). */
#define TILE_THREADS 256
#define TILE_BLOCKS_SM 4

/* Shared memory of one tile: SIDE rows of SIDE units, each row padded by a word (or a unit, when
 * wider) so that a warp reading a column touches 32 distinct banks. */
#define TILE_ROW(u) (RF_COPY_TILE_SIDE(u) * (u) + ((u) > 4 ? (u) : 4))
#define TILE_SMEM (RF_COPY_TILE_SIDE(16) * TILE_ROW(16))
static_assert(RF_COPY_TILE_SIDE(1) * TILE_ROW(1) <= TILE_SMEM &&
                  RF_COPY_TILE_SIDE(4) * TILE_ROW(4) <= TILE_SMEM &&
                  RF_COPY_TILE_SIDE(8) * TILE_ROW(8) <= TILE_SMEM,
              "every unit's tile fits the shared array");

/* Bytes a thread moves at once when a tile job of units below that goes in vectors (tile_vec):
 * a warp then reads and writes 128 bytes of a row per instruction instead of 32 or 64. */
#define TILE_VEC 4
/* Loads a thread keeps in flight before it stores them (registers: each is a unit or a word). */
#define TILE_LOADS 8

/* One tile of a job: its first unit in the source and in the destination, the units it holds
 * along a and b, and the row strides of each side (source along b, destination along a). */
typedef struct tile_at {
    uint64_t s, d;
    uint32_t la, lb, sb, da;
} tile_at;

/* Loop hints for the device compiler; the tile helpers are host code too (tests emulate a block
 * with them), where the host compiler knows no such pragma. */
#ifdef __CUDA_ARCH__
#define TILE_PRAGMA(x) _Pragma(#x)
#else
#define TILE_PRAGMA(x)
#endif

/* What a thread of a tile block moves at once: K units of T along the side's contiguous dim, as
 * one word (K > 1) or one unit; gather packs K units lying rs bytes apart in shared memory. */
template <typename T, uint32_t K>
struct tile_word {
    typedef uint32_t V;
    static_assert(sizeof(T) * K == TILE_VEC, "K units make one word");
    __host__ __device__ static V gather(const uint8_t *p, uint32_t rs)
    {
        V v = 0;

TILE_PRAGMA(unroll)
        for (uint32_t m = 0; m < K; m++)
            v |= (V) * reinterpret_cast<const T *>(p + m * rs) << (8 * sizeof(T) * m);
        return v;
    }
};

template <typename T>
struct tile_word<T, 1> {
    typedef T V;
    __host__ __device__ static V gather(const uint8_t *p, uint32_t)
    {
        return *reinterpret_cast<const T *>(p);
    }
};

/* Tile t of tile job x (t counted from the job's first): SIDE x SIDE units at (a0, b0) of dims
 * ta, tb and at one index of the other dims. */
template <typename T>
__host__ __device__ __forceinline__ tile_at tile_find(const dev_pair *x, uint32_t t)
{
    constexpr uint32_t U = sizeof(T), TS = RF_COPY_TILE_SIDE(sizeof(T));
    const uint32_t ta = x->ta, tb = x->tb;
    /* Tile counts, extents and offsets inside a tile fit 32 bits (rf_copy_tile_choose). */
    const uint32_t ea = (uint32_t)x->ext[ta], eb = (uint32_t)x->ext[tb];
    const uint32_t na = (ea + TS - 1) / TS, nb = (eb + TS - 1) / TS;
    uint32_t ia, ib;
    tile_at g;

    g.s = x->src;
    g.d = x->dst;
    g.sb = (uint32_t)x->sstr[tb];
    g.da = (uint32_t)x->dstr[ta];
    ia = t % na;
    t /= na;
    ib = t % nb;
    t /= nb;
    for (int k = (int)x->n - 1; k >= 0; k--) {
        uint32_t e, i;

        if (k == (int)ta || k == (int)tb)
            continue;
        e = (uint32_t)x->ext[k];
        i = t % e;
        t /= e;
        g.s += (uint64_t)i * (uint64_t)x->sstr[k];
        g.d += (uint64_t)i * (uint64_t)x->dstr[k];
    }
    g.la = ea - ia * TS < TS ? ea - ia * TS : TS;
    g.lb = eb - ib * TS < TS ? eb - ib * TS : TS;
    g.s += (uint64_t)ia * TS * U + (uint64_t)ib * TS * g.sb;
    g.d += (uint64_t)ib * TS * U + (uint64_t)ia * TS * g.da;
    return g;
}

/* Thread tid's share of reading tile g into shared memory: rows along b, each read along the
 * source's contiguous dim a, K units a load, TILE_LOADS loads in flight before their stores.
 * With K > 1 the job's extents along a and b are multiples of K and every address a word's
 * (tile_vec), so a thread's K units all lie inside the tile. */
template <typename T, uint32_t K>
__host__ __device__ __forceinline__ void tile_in(const tile_at &g, uint32_t tid, uint8_t *sm)
{
    typedef typename tile_word<T, K>::V V;
    constexpr uint32_t U = sizeof(T), TS = RF_COPY_TILE_SIDE(sizeof(T)), VR = TS / K;
    constexpr uint32_t R = TILE_THREADS / VR, PER = TS / R, RS = TILE_ROW(sizeof(T));
    constexpr uint32_t B = PER < TILE_LOADS ? PER : TILE_LOADS;
    static_assert(TILE_THREADS % VR == 0 && TS % R == 0 && PER % B == 0 &&
                      RS % sizeof(V) == 0,
                  "the block covers a tile in whole rows; shared rows keep words aligned");
    const uint32_t tx = tid % VR, ty = tid / VR;
    const uint32_t rows = tx * K < g.la && ty < g.lb ? (g.lb - ty + R - 1) / R : 0;
    uint64_t s = g.s + (uint64_t)tx * K * U + (uint64_t)ty * g.sb;

TILE_PRAGMA(unroll 1)
    for (uint32_t r0 = 0; r0 < rows; r0 += B) {
        V v[B];

TILE_PRAGMA(unroll)
        for (uint32_t r = 0; r < B; r++)
            if (r0 + r < rows)
                v[r] = *reinterpret_cast<const V *>(s + (uint64_t)(r0 + r) * R * g.sb);
TILE_PRAGMA(unroll)
        for (uint32_t r = 0; r < B; r++)
            if (r0 + r < rows)
                *reinterpret_cast<V *>(sm + (ty + (r0 + r) * R) * RS + tx * K * U) = v[r];
    }
}

/* Thread tid's share of writing tile g from shared memory: rows along a, each written along the
 * destination's contiguous dim b, K units (from K shared rows) a store. */
template <typename T, uint32_t K>
__host__ __device__ __forceinline__ void tile_out(const tile_at &g, uint32_t tid,
                                                  const uint8_t *sm)
{
    typedef typename tile_word<T, K>::V V;
    constexpr uint32_t U = sizeof(T), TS = RF_COPY_TILE_SIDE(sizeof(T)), VR = TS / K;
    constexpr uint32_t R = TILE_THREADS / VR, PER = TS / R, RS = TILE_ROW(sizeof(T));
    constexpr uint32_t B = PER < TILE_LOADS ? PER : TILE_LOADS;
    const uint32_t tx = tid % VR, ty = tid / VR;
    const uint32_t rows = tx * K < g.lb && ty < g.la ? (g.la - ty + R - 1) / R : 0;
    uint64_t d = g.d + (uint64_t)tx * K * U + (uint64_t)ty * g.da;

TILE_PRAGMA(unroll 1)
    for (uint32_t r0 = 0; r0 < rows; r0 += B) {
        V v[B];

TILE_PRAGMA(unroll)
        for (uint32_t r = 0; r < B; r++)
            if (r0 + r < rows)
                v[r] = tile_word<T, K>::gather(sm + tx * K * RS + (ty + (r0 + r) * R) * U, RS);
TILE_PRAGMA(unroll)
        for (uint32_t r = 0; r < B; r++)
            if (r0 + r < rows)
                *reinterpret_cast<V *>(d + (uint64_t)(r0 + r) * R * g.da) = v[r];
    }
}

/* Tiles [c, end) of job x, all of its unit, K units a load and a store: each read along the
 * source's contiguous dim a into shared memory and written along the destination's contiguous
 * dim b, so both memories see whole rows. */
template <typename T, uint32_t K>
__device__ __forceinline__ void tile_run(const dev_pair *x, uint64_t c, uint64_t end, uint8_t *sm)
{
    for (uint32_t t = (uint32_t)(c - x->chunk0), e = (uint32_t)(end - x->chunk0); t < e; t++) {
        tile_at g = tile_find<T>(x, t);

        tile_in<T, K>(g, threadIdx.x, sm);
        __syncthreads();
        tile_out<T, K>(g, threadIdx.x, sm);
        /* The next tile overwrites the shared rows. */
        __syncthreads();
    }
}

/* Tiles [tile_lo, tile_lo + tiles) of the tile jobs d[0..n), whose chunk0 count tiles from the
 * start of the array they were cut from; block b moves the b-th of gridDim.x equal runs of them,
 * as the pair kernel does its chunks. Every thread tracks the job itself (the same loads, from
 * cache), so a new job costs no barrier. */
__global__ void __launch_bounds__(TILE_THREADS, TILE_BLOCKS_SM)
tile_kernel(const dev_pair *d, uint32_t n, uint64_t tile_lo, uint64_t tiles)
{
    __shared__ __align__(16) uint8_t sm[TILE_SMEM];
    uint64_t per = (tiles + gridDim.x - 1) / gridDim.x, c = tile_lo + blockIdx.x * per, end;
    uint32_t a;

    if (blockIdx.x * per >= tiles)
        return;
    end = c + per < tile_lo + tiles ? c + per : tile_lo + tiles;
    /* Job by job: the unit and the vector width are fixed over a job's tiles. */
    for (a = chunk_find(d, n, c); c < end; a++) {
        const dev_pair *x = &d[a];
        uint64_t stop = a + 1 < n && d[a + 1].chunk0 < end ? d[a + 1].chunk0 : end;

        switch (x->vec) {
        case 16: tile_run<uint4, 1>(x, c, stop, sm); break;
        case 8: tile_run<uint2, 1>(x, c, stop, sm); break;
        case 4: tile_run<uint32_t, 1>(x, c, stop, sm); break;
        case 2:
            if (x->tk == 2)
                tile_run<uint16_t, 2>(x, c, stop, sm);
            else
                tile_run<uint16_t, 1>(x, c, stop, sm);
            break;
        default:
            if (x->tk == 4)
                tile_run<uint8_t, 4>(x, c, stop, sm);
            else
                tile_run<uint8_t, 1>(x, c, stop, sm);
            break;
        }
        c = stop;
    }
}

/* The widest access that every address of the descriptor allows. */
static uint32_t vec_of(const dev_desc *x, uint64_t staging)
{
    uint64_t a = x->run | x->mem | (staging + x->stage);

    for (uint32_t k = 0; k < x->n; k++)
        a |= (uint64_t)x->str[k];
    for (uint32_t v = 16; v > 1; v >>= 1)
        if ((a & (v - 1)) == 0)
            return v;
    return 1;
}

/* Units of a tiled copy that a thread moves as one TILE_VEC-byte word: TILE_VEC / unit for units
 * below it when every word lies whole inside the copy and aligned, on both sides: source and
 * destination addresses and every stride but the unit's own a multiple of TILE_VEC, the
 * extents along a and b multiples of the word's units (each tile's then are too); else 1. */
static uint32_t tile_vec(const rf_copy_pair_flat *f, const rf_copy_tile *t)
{
    uint64_t k = TILE_VEC / t->unit;
    uint64_t align = (uint64_t)(uintptr_t)f->src | (uint64_t)(uintptr_t)f->dst;

    if (t->unit >= TILE_VEC)
        return 1;
    for (int i = 0; i < f->n; i++) {
        if (i != t->a)
            align |= (uint64_t)f->sstr[i];
        if (i != t->b)
            align |= (uint64_t)f->dstr[i];
    }
    if ((align & (TILE_VEC - 1)) != 0 || (uint64_t)f->ext[t->a] % k != 0 ||
        (uint64_t)f->ext[t->b] % k != 0)
        return 1;
    return (uint32_t)k;
}

/* A copy the tile kernel takes: chunk0 holds its tile count until tiles_settle. */
static void tile_to_dev(const rf_copy_pair_flat *f, const rf_copy_tile *t, dev_pair *x)
{
    memset(x, 0, sizeof(*x));
    x->src = (uint64_t)(uintptr_t)f->src;
    x->dst = (uint64_t)(uintptr_t)f->dst;
    x->bytes = f->bytes;
    x->chunk0 = t->tiles;
    x->run = t->unit;
    x->vec = t->unit;
    x->n = (uint32_t)f->n;
    x->ta = (uint32_t)t->a;
    x->tb = (uint32_t)t->b;
    x->tk = tile_vec(f, t);
    for (int k = 0; k < f->n; k++) {
        x->ext[k] = f->ext[k];
        x->sstr[k] = f->sstr[k];
        x->dstr[k] = f->dstr[k];
    }
}

/* Tile jobs t[0..nt) were put down last first: back in their order, each chunk0 turned from its
 * tile count into the tiles before it; returns the tiles of all. */
static uint64_t tiles_settle(dev_pair *t, size_t nt)
{
    uint64_t sum = 0;

    for (size_t i = 0; i < nt / 2; i++) {
        dev_pair x = t[i];

        t[i] = t[nt - 1 - i];
        t[nt - 1 - i] = x;
    }
    for (size_t i = 0; i < nt; i++) {
        uint64_t c = t[i].chunk0;

        t[i].chunk0 = sum;
        sum += c;
    }
    return sum;
}

/* A checked descriptor of a batch on staging: a tile job in *t (returns true) or a walk of the
 * copy kernel in *x. */
static bool to_dev(const rf_copy_desc *d, uint8_t *staging, bool gather, uint64_t chunk0,
                   dev_desc *x, dev_pair *t)
{
    rf_copy_flat f;

    rf_copy_flatten(d, &f);
    /* Only a strided innermost dim leaves a run of one element with another dim contiguous in
     * piece memory (staging is contiguous along the innermost). */
    if (f.inner_str != 0 && f.run <= RF_COPY_TILE_UNIT_MAX) {
        rf_copy_pair_flat pf;
        rf_copy_tile tl;

        rf_copy_tile_desc_flat(d, &f, staging, gather, &pf);
        if (rf_copy_tile_choose(&pf, &tl)) {
            tile_to_dev(&pf, &tl, t);
            return true;
        }
    }
    memset(x, 0, sizeof(*x));
    x->mem = (uint64_t)(uintptr_t)d->base + f.first;
    x->stage = d->staging_off;
    x->bytes = rf_copy_desc_bytes(d);
    x->chunk0 = chunk0;
    x->n = (uint32_t)f.n;
    for (int k = 0; k < f.n; k++) {
        x->ext[k] = f.ext[k];
        x->str[k] = f.str[k];
    }
    if (f.inner_str != 0) {
        x->ext[x->n] = f.inner_ext;
        x->str[x->n] = f.inner_str;
        x->n++;
    }
    x->run = f.run;
    x->vec = vec_of(x, (uint64_t)(uintptr_t)staging);
    return false;
}

/* A checked pair: a tile job in *t (returns true) or a walk of the pair kernel in *x, whose
 * vector width is the widest access both memories allow at every address. Dims both sides hold
 * contiguous join the run first (the pair kernel packs nothing, so its walk order is free). */
static bool pair_to_dev(const rf_copy_pair *p, uint64_t chunk0, dev_pair *x, dev_pair *t)
{
    rf_copy_pair_flat f;
    rf_copy_tile tl;
    uint64_t a;

    rf_copy_pair_flatten(p, &f);
    rf_copy_tile_reorder(&f);
    if (rf_copy_tile_choose(&f, &tl)) {
        tile_to_dev(&f, &tl, t);
        return true;
    }
    memset(x, 0, sizeof(*x));
    x->src = (uint64_t)(uintptr_t)f.src;
    x->dst = (uint64_t)(uintptr_t)f.dst;
    x->bytes = f.bytes;
    x->chunk0 = chunk0;
    x->run = f.run;
    x->n = (uint32_t)f.n;
    a = f.run | x->src | x->dst;
    for (int k = 0; k < f.n; k++) {
        x->ext[k] = f.ext[k];
        x->sstr[k] = f.sstr[k];
        x->dstr[k] = f.dstr[k];
        a |= (uint64_t)f.sstr[k] | (uint64_t)f.dstr[k];
    }
    x->vec = 1;
    for (uint32_t v = 16; v > 1; v >>= 1) {
        if ((a & (v - 1)) == 0) {
            x->vec = v;
            break;
        }
    }
    return false;
}

int rf_copy_cuda_buf_new(rf_copy_cuda_buf **out, rf_err *err)
{
    rf_copy_cuda_buf *b = (rf_copy_cuda_buf *)calloc(1, sizeof(*b));
    int rc = 0;

    *out = NULL;
    if (b == NULL)
        return rf_err_set(err, -ENOMEM, "copy_cuda: out of memory for a descriptor buffer");
    CUDA_TRY(err, cudaGetDevice(&b->dev));
    CUDA_TRY(err, cudaDeviceGetAttribute(&b->sms, cudaDevAttrMultiProcessorCount, b->dev));
    CUDA_TRY(err, cudaEventCreateWithFlags(&b->done, cudaEventDisableTiming));
    *out = b;
    b = NULL;
out:
    free(b);
    return rc;
}

void rf_copy_cuda_buf_set_blocks(rf_copy_cuda_buf *b, unsigned max_blocks)
{
    b->max_blocks = max_blocks;
}

void rf_copy_cuda_buf_free(rf_copy_cuda_buf *b)
{
    int cur = -1;

    if (b == NULL)
        return;
    cudaGetDevice(&cur);
    cudaSetDevice(b->dev);
    if (b->pending)
        cudaEventSynchronize(b->done);
    cudaEventDestroy(b->done);
    cudaFreeHost(b->host);
    cudaFree(b->devp);
    if (cur >= 0)
        cudaSetDevice(cur);
    free(b);
}

/* The buffer's arrays hold at least bytes (they only grow; the caller waited for the last
 * batch that read them). */
static int buf_reserve(rf_copy_cuda_buf *b, size_t bytes, rf_err *err)
{
    size_t cap = b->cap ? b->cap : 64 * sizeof(dev_pair);
    int rc = 0;

    if (bytes <= b->cap)
        return 0;
    while (cap < bytes)
        cap *= 2;
    cudaFreeHost(b->host);
    cudaFree(b->devp);
    b->host = NULL;
    b->devp = NULL;
    b->cap = 0;
    CUDA_TRY(err, cudaMallocHost(&b->host, cap));
    CUDA_TRY(err, cudaMalloc(&b->devp, cap));
    b->cap = cap;
out:
    return rc;
}

static unsigned grid_of(int sms, unsigned max_blocks, uint64_t chunks)
{
    unsigned grid = max_blocks ? max_blocks : (unsigned)sms * 16;

    return chunks < grid ? (unsigned)chunks : grid;
}

/* A grid of one wave of kernel k, every block resident at once (max_blocks, when set, caps it
 * instead); *occ caches k's blocks per SM. */
template <typename K>
static unsigned wave_grid(K k, int threads, int *occ, int sms, unsigned max_blocks,
                          uint64_t work)
{
    if (max_blocks == 0) {
        if (*occ == 0 &&
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, k, threads, 0) != cudaSuccess) {
            cudaGetLastError();
            *occ = 8;
        }
        max_blocks = (unsigned)sms * (unsigned)(*occ > 0 ? *occ : 1);
    }
    return grid_of(sms, max_blocks, work);
}

static int pair_occ, tile_occ;

static unsigned pair_grid(int sms, unsigned max_blocks, uint64_t chunks)
{
    return wave_grid(pair_kernel, THREADS, &pair_occ, sms, max_blocks, chunks);
}

static unsigned tile_grid(int sms, unsigned max_blocks, uint64_t tiles)
{
    return wave_grid(tile_kernel, TILE_THREADS, &tile_occ, sms, max_blocks, tiles);
}

/* What a batch on b starts with: b's device made current (the caller's left in *cur, for the
 * batch to give back), the previous batch's launch done with the pinned array, and room for
 * bytes of descriptors. */
static int batch_begin(rf_copy_cuda_buf *b, size_t bytes, int *cur, rf_err *err)
{
    int rc = 0;

    CUDA_TRY(err, cudaGetDevice(cur));
    if (*cur != b->dev)
        CUDA_TRY(err, cudaSetDevice(b->dev));
    if (b->pending) {
        CUDA_TRY(err, cudaEventSynchronize(b->done));
        b->pending = false;
    }
    rc = buf_reserve(b, bytes, err);
out:
    return rc;
}

/* A batch's arrays in b's pinned memory: the copy kernel's walks (wsize bytes each) from the
 * front, the tile jobs from the back while they are made (a batch of n needs at most n *
 * sizeof(dev_pair) + 16 bytes), then moved up behind the walks, 16-byte aligned, in order.
 * Returns the bytes to upload; *toff is where the tile jobs start. */
static size_t batch_pack(rf_copy_cuda_buf *b, size_t nw, size_t wsize, size_t nt, size_t cap,
                         size_t *toff, uint64_t *tiles)
{
    dev_pair *t = (dev_pair *)((uint8_t *)b->host + cap - nt * sizeof(dev_pair));

    *tiles = tiles_settle(t, nt);
    *toff = (nw * wsize + 15) & ~(size_t)15;
    memmove((uint8_t *)b->host + *toff, t, nt * sizeof(dev_pair));
    return *toff + nt * sizeof(dev_pair);
}

static int run(rf_copy_cuda_buf *b, const rf_copy_desc *d, size_t n, uint8_t *staging,
               cudaStream_t s, bool gather, rf_err *err)
{
    uint64_t chunks = 0, tiles = 0;
    size_t nw = 0, nt = 0, cap = n * sizeof(dev_pair) + 16, toff = 0, up;
    uint8_t *h;
    int cur = -1, rc = 0;

    for (size_t i = 0; i < n; i++)
        if ((rc = rf_copy_check(&d[i], i, err)) != 0)
            return rc;
    if (n == 0)
        return 0;
    if (n > UINT32_MAX)
        return rf_err_set(err, -E2BIG, "copy_cuda: %zu descriptors in one batch; split it "
                          "below 2^32", n);
    static_assert(sizeof(dev_desc) <= sizeof(dev_pair) && sizeof(dev_pair) % 8 == 0,
                  "a batch's walks and tile jobs share n * sizeof(dev_pair) bytes");
    if ((rc = batch_begin(b, cap, &cur, err)) < 0)
        goto out;
    h = (uint8_t *)b->host;
    for (size_t i = 0; i < n; i++) {
        dev_desc x;
        dev_pair t;

        if (to_dev(&d[i], staging, gather, chunks, &x, &t)) {
            memcpy(h + cap - ++nt * sizeof(dev_pair), &t, sizeof(t));
        } else {
            memcpy(h + nw++ * sizeof(dev_desc), &x, sizeof(x));
            chunks += (x.bytes + CHUNK - 1) / CHUNK;
        }
    }
    up = batch_pack(b, nw, sizeof(dev_desc), nt, cap, &toff, &tiles);
    CUDA_TRY(err, cudaMemcpyAsync(b->devp, b->host, up, cudaMemcpyHostToDevice, s));
    if (nw > 0) {
        copy_kernel<<<grid_of(b->sms, b->max_blocks, chunks), THREADS, 0, s>>>(
            (const dev_desc *)b->devp, (uint32_t)nw, chunks, staging, gather);
        CUDA_TRY(err, cudaGetLastError());
    }
    if (nt > 0) {
        tile_kernel<<<tile_grid(b->sms, b->max_blocks, tiles), TILE_THREADS, 0, s>>>(
            (const dev_pair *)((uint8_t *)b->devp + toff), (uint32_t)nt, 0, tiles);
        CUDA_TRY(err, cudaGetLastError());
    }
    CUDA_TRY(err, cudaEventRecord(b->done, s));
    b->pending = true;
out:
    if (cur >= 0 && cur != b->dev)
        cudaSetDevice(cur);
    return rc;
}

int rf_copy_cuda_gather_buf(rf_copy_cuda_buf *b, const rf_copy_desc *d, size_t n,
                            void *staging_dev, cudaStream_t s, rf_err *err)
{
    return run(b, d, n, (uint8_t *)staging_dev, s, true, err);
}

int rf_copy_cuda_scatter_buf(rf_copy_cuda_buf *b, const rf_copy_desc *d, size_t n,
                             const void *staging_dev, cudaStream_t s, rf_err *err)
{
    return run(b, d, n, (uint8_t *)(uintptr_t)staging_dev, s, false, err);
}

static __thread rf_copy_cuda_buf *tls_buf[MAX_DEV];

static int thread_buf(rf_copy_cuda_buf **out, rf_err *err)
{
    int dev = 0, rc = 0;

    CUDA_TRY(err, cudaGetDevice(&dev));
    if (dev < 0 || dev >= MAX_DEV)
        return rf_err_set(err, -ENODEV, "copy_cuda: device %d beyond the %d this build "
                          "supports per thread; use rf_copy_cuda_buf_new", dev, MAX_DEV);
    if (tls_buf[dev] == NULL && (rc = rf_copy_cuda_buf_new(&tls_buf[dev], err)) < 0)
        return rc;
    *out = tls_buf[dev];
out:
    return rc;
}

int rf_copy_cuda_gather(const rf_copy_desc *d, size_t n, void *staging_dev, cudaStream_t s,
                        rf_err *err)
{
    rf_copy_cuda_buf *b = NULL;
    int rc = thread_buf(&b, err);

    return rc < 0 ? rc : rf_copy_cuda_gather_buf(b, d, n, staging_dev, s, err);
}

int rf_copy_cuda_scatter(const rf_copy_desc *d, size_t n, const void *staging_dev,
                         cudaStream_t s, rf_err *err)
{
    rf_copy_cuda_buf *b = NULL;
    int rc = thread_buf(&b, err);

    return rc < 0 ? rc : rf_copy_cuda_scatter_buf(b, d, n, staging_dev, s, err);
}

void rf_copy_cuda_thread_release(void)
{
    for (int i = 0; i < MAX_DEV; i++) {
        rf_copy_cuda_buf_free(tls_buf[i]);
        tls_buf[i] = NULL;
    }
}

/* ---- pairs ---- */

int rf_copy_cuda_pairs_buf(rf_copy_cuda_buf *b, const rf_copy_pair *p, size_t n,
                           cudaStream_t s, rf_err *err)
{
    uint64_t chunks = 0, tiles = 0;
    size_t nw = 0, nt = 0, cap = n * sizeof(dev_pair) + 16, toff = 0, up;
    uint8_t *h;
    int cur = -1, rc = 0;

    for (size_t i = 0; i < n; i++)
        if ((rc = rf_copy_pair_check(&p[i], i, err)) != 0)
            return rc;
    if (n == 0)
        return 0;
    if (n > UINT32_MAX)
        return rf_err_set(err, -E2BIG, "copy_cuda: %zu pairs in one batch; split it below "
                          "2^32", n);
    if ((rc = batch_begin(b, cap, &cur, err)) < 0)
        goto out;
    h = (uint8_t *)b->host;
    for (size_t i = 0; i < n; i++) {
        dev_pair x, t;

        if (pair_to_dev(&p[i], chunks, &x, &t)) {
            memcpy(h + cap - ++nt * sizeof(dev_pair), &t, sizeof(t));
        } else {
            memcpy(h + nw++ * sizeof(dev_pair), &x, sizeof(x));
            chunks += (x.bytes + CHUNK - 1) / CHUNK;
        }
    }
    up = batch_pack(b, nw, sizeof(dev_pair), nt, cap, &toff, &tiles);
    CUDA_TRY(err, cudaMemcpyAsync(b->devp, b->host, up, cudaMemcpyHostToDevice, s));
    if (nw > 0) {
        pair_kernel<<<pair_grid(b->sms, b->max_blocks, chunks), THREADS, 0, s>>>(
            (const dev_pair *)b->devp, (uint32_t)nw, 0, chunks);
        CUDA_TRY(err, cudaGetLastError());
    }
    if (nt > 0) {
        tile_kernel<<<tile_grid(b->sms, b->max_blocks, tiles), TILE_THREADS, 0, s>>>(
            (const dev_pair *)((uint8_t *)b->devp + toff), (uint32_t)nt, 0, tiles);
        CUDA_TRY(err, cudaGetLastError());
    }
    CUDA_TRY(err, cudaEventRecord(b->done, s));
    b->pending = true;
out:
    if (cur >= 0 && cur != b->dev)
        cudaSetDevice(cur);
    return rc;
}

int rf_copy_cuda_pairs(const rf_copy_pair *p, size_t n, cudaStream_t s, rf_err *err)
{
    rf_copy_cuda_buf *b = NULL;
    int rc = thread_buf(&b, err);

    return rc < 0 ? rc : rf_copy_cuda_pairs_buf(b, p, n, s, err);
}

/* A kept plan: the pair kernel's walks and the tile jobs, each in the order of the pairs, and
 * per pair index i what comes before it in each, so that a run of pairs is a run of both. */
struct rf_copy_cuda_plan {
    int dev;
    int sms;
    size_t n;
    size_t nw;        /* walks; devp + nw: the tile jobs */
    dev_pair *devp;
    uint64_t *chunk0; /* host: n + 1 prefix sums of the walks' chunks */
    uint64_t *tile0;  /* host: n + 1 prefix sums of the tile jobs' tiles */
    uint32_t *walks;  /* host: n + 1 counts of walks before pair i (i - walks[i] tile jobs) */
};

int rf_copy_cuda_plan_new(const rf_copy_pair *p, size_t n, rf_copy_cuda_plan **out,
                          rf_err *err)
{
    rf_copy_cuda_plan *pl = NULL;
    dev_pair *host = NULL;
    uint64_t chunks = 0, tiles = 0;
    size_t nw = 0, nt = 0;
    int rc = 0;

    *out = NULL;
    for (size_t i = 0; i < n; i++)
        if ((rc = rf_copy_pair_check(&p[i], i, err)) != 0)
            return rc;
    if (n > UINT32_MAX)
        return rf_err_set(err, -E2BIG, "copy_cuda: %zu pairs in one plan; at most 2^32 - 1", n);
    pl = (rf_copy_cuda_plan *)calloc(1, sizeof(*pl));
    host = (dev_pair *)malloc((n ? n : 1) * sizeof(*host));
    if (pl) {
        pl->chunk0 = (uint64_t *)malloc((n + 1) * sizeof(uint64_t));
        pl->tile0 = (uint64_t *)malloc((n + 1) * sizeof(uint64_t));
        pl->walks = (uint32_t *)malloc((n + 1) * sizeof(uint32_t));
    }
    if (!pl || !host || !pl->chunk0 || !pl->tile0 || !pl->walks) {
        rc = rf_err_set(err, -ENOMEM, "copy_cuda: out of memory for a plan of %zu pairs", n);
        goto out;
    }
    /* Walks from the front of host, tile jobs from its back, then turned around behind them. */
    for (size_t i = 0; i < n; i++) {
        dev_pair x, t;

        pl->chunk0[i] = chunks;
        pl->tile0[i] = tiles;
        pl->walks[i] = (uint32_t)nw;
        if (pair_to_dev(&p[i], chunks, &x, &t)) {
            tiles += t.chunk0;
            host[n - ++nt] = t;
        } else {
            chunks += (x.bytes + CHUNK - 1) / CHUNK;
            host[nw++] = x;
        }
    }
    pl->chunk0[n] = chunks;
    pl->tile0[n] = tiles;
    pl->walks[n] = (uint32_t)nw;
    tiles_settle(host + nw, nt);
    pl->n = n;
    pl->nw = nw;
    CUDA_TRY(err, cudaGetDevice(&pl->dev));
    CUDA_TRY(err, cudaDeviceGetAttribute(&pl->sms, cudaDevAttrMultiProcessorCount, pl->dev));
    if (n > 0) {
        CUDA_TRY(err, cudaMalloc((void **)&pl->devp, n * sizeof(dev_pair)));
        CUDA_TRY(err, cudaMemcpy(pl->devp, host, n * sizeof(dev_pair), cudaMemcpyHostToDevice));
    }
    *out = pl;
    pl = NULL;
out:
    free(host);
    rf_copy_cuda_plan_free(pl);
    return rc;
}

int rf_copy_cuda_plan_launch(const rf_copy_cuda_plan *pl, size_t first, size_t count,
                             cudaStream_t s, unsigned max_blocks, rf_err *err)
{
    uint64_t lo, chunks, tlo, tiles;
    uint32_t w0, wn, t0, tn;
    int rc = 0;

    if (first > pl->n || count > pl->n - first)
        return rf_err_set(err, -EINVAL, "copy_cuda: pairs [%zu, %zu) of a plan of %zu", first,
                          first + count, pl->n);
    if (count == 0)
        return 0;
    lo = pl->chunk0[first];
    chunks = pl->chunk0[first + count] - lo;
    w0 = pl->walks[first];
    wn = pl->walks[first + count] - w0;
    tlo = pl->tile0[first];
    tiles = pl->tile0[first + count] - tlo;
    t0 = (uint32_t)first - w0;
    tn = (uint32_t)count - wn;
    if (chunks > 0) {
        pair_kernel<<<pair_grid(pl->sms, max_blocks, chunks), THREADS, 0, s>>>(
            pl->devp + w0, wn, lo, chunks);
        CUDA_TRY(err, cudaGetLastError());
    }
    if (tiles > 0) {
        tile_kernel<<<tile_grid(pl->sms, max_blocks, tiles), TILE_THREADS, 0, s>>>(
            pl->devp + pl->nw + t0, tn, tlo, tiles);
        CUDA_TRY(err, cudaGetLastError());
    }
out:
    return rc;
}

uint64_t rf_copy_cuda_plan_bytes(const rf_copy_cuda_plan *pl)
{
    return pl ? (uint64_t)pl->n * sizeof(dev_pair) : 0;
}

void rf_copy_cuda_plan_free(rf_copy_cuda_plan *pl)
{
    int cur = -1;

    if (pl == NULL)
        return;
    if (pl->devp) {
        cudaGetDevice(&cur);
        cudaSetDevice(pl->dev);
        cudaFree(pl->devp);
        if (cur >= 0)
            cudaSetDevice(cur);
    }
    free(pl->chunk0);
    free(pl->tile0);
    free(pl->walks);
    free(pl);
}
