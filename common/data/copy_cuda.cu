/* common/data/copy_cuda.cu - the gather/scatter kernels and the pair kernel (piece memory to piece
 * memory): descriptors reduced on the host with the host copy's own merging (rf_copy_flatten,
 * rf_copy_pair_flatten), split into chunks of packed bytes, one block per chunk, each thread
 * moving 16, 8, 4, 2 or 1 bytes at a time as alignment allows. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "copy_cuda.h"
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
 * idx over ext (row-major), contiguous in both memories. */
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

static void to_dev(const rf_copy_desc *d, uint64_t staging, uint64_t chunk0, dev_desc *x)
{
    rf_copy_flat f;

    rf_copy_flatten(d, &f);
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
    x->vec = vec_of(x, staging);
}

/* A checked pair as the kernel walks it; the vector width is the widest access both memories
 * allow at every address. */
static void pair_to_dev(const rf_copy_pair *p, uint64_t chunk0, dev_pair *x)
{
    rf_copy_pair_flat f;
    uint64_t a;

    rf_copy_pair_flatten(p, &f);
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

/* The pair kernel's grid: one wave, every block resident at once (max_blocks, when set, caps
 * it instead). */
static unsigned pair_grid(int sms, unsigned max_blocks, uint64_t chunks)
{
    static int occ;

    if (max_blocks == 0) {
        if (occ == 0 &&
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, pair_kernel, THREADS, 0) !=
                cudaSuccess) {
            cudaGetLastError();
            occ = 8;
        }
        max_blocks = (unsigned)sms * (unsigned)(occ > 0 ? occ : 1);
    }
    return grid_of(sms, max_blocks, chunks);
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

static int run(rf_copy_cuda_buf *b, const rf_copy_desc *d, size_t n, uint8_t *staging,
               cudaStream_t s, bool gather, rf_err *err)
{
    uint64_t chunks = 0;
    int cur = -1, rc = 0;

    for (size_t i = 0; i < n; i++)
        if ((rc = rf_copy_check(&d[i], i, err)) != 0)
            return rc;
    if (n == 0)
        return 0;
    if (n > UINT32_MAX)
        return rf_err_set(err, -E2BIG, "copy_cuda: %zu descriptors in one batch; split it "
                          "below 2^32", n);
    if ((rc = batch_begin(b, n * sizeof(dev_desc), &cur, err)) < 0)
        goto out;
    for (size_t i = 0; i < n; i++) {
        dev_desc *x = (dev_desc *)b->host + i;

        to_dev(&d[i], (uint64_t)(uintptr_t)staging, chunks, x);
        chunks += (x->bytes + CHUNK - 1) / CHUNK;
    }
    CUDA_TRY(err, cudaMemcpyAsync(b->devp, b->host, n * sizeof(dev_desc),
                                  cudaMemcpyHostToDevice, s));
    copy_kernel<<<grid_of(b->sms, b->max_blocks, chunks), THREADS, 0, s>>>(
        (const dev_desc *)b->devp, (uint32_t)n, chunks, staging, gather);
    CUDA_TRY(err, cudaGetLastError());
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
    uint64_t chunks = 0;
    int cur = -1, rc = 0;

    for (size_t i = 0; i < n; i++)
        if ((rc = rf_copy_pair_check(&p[i], i, err)) != 0)
            return rc;
    if (n == 0)
        return 0;
    if (n > UINT32_MAX)
        return rf_err_set(err, -E2BIG, "copy_cuda: %zu pairs in one batch; split it below "
                          "2^32", n);
    if ((rc = batch_begin(b, n * sizeof(dev_pair), &cur, err)) < 0)
        goto out;
    for (size_t i = 0; i < n; i++) {
        dev_pair *x = (dev_pair *)b->host + i;

        pair_to_dev(&p[i], chunks, x);
        chunks += (x->bytes + CHUNK - 1) / CHUNK;
    }
    CUDA_TRY(err, cudaMemcpyAsync(b->devp, b->host, n * sizeof(dev_pair),
                                  cudaMemcpyHostToDevice, s));
    pair_kernel<<<pair_grid(b->sms, b->max_blocks, chunks), THREADS, 0, s>>>(
        (const dev_pair *)b->devp, (uint32_t)n, 0, chunks);
    CUDA_TRY(err, cudaGetLastError());
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

struct rf_copy_cuda_plan {
    int dev;
    int sms;
    size_t n;
    dev_pair *devp;
    uint64_t *chunk0; /* host: n + 1 prefix sums of chunks */
};

int rf_copy_cuda_plan_new(const rf_copy_pair *p, size_t n, rf_copy_cuda_plan **out,
                          rf_err *err)
{
    rf_copy_cuda_plan *pl = NULL;
    dev_pair *host = NULL;
    uint64_t chunks = 0;
    int rc = 0;

    *out = NULL;
    for (size_t i = 0; i < n; i++)
        if ((rc = rf_copy_pair_check(&p[i], i, err)) != 0)
            return rc;
    if (n > UINT32_MAX)
        return rf_err_set(err, -E2BIG, "copy_cuda: %zu pairs in one plan; at most 2^32 - 1", n);
    pl = (rf_copy_cuda_plan *)calloc(1, sizeof(*pl));
    host = (dev_pair *)malloc((n ? n : 1) * sizeof(*host));
    if (pl)
        pl->chunk0 = (uint64_t *)malloc((n + 1) * sizeof(uint64_t));
    if (!pl || !host || !pl->chunk0) {
        rc = rf_err_set(err, -ENOMEM, "copy_cuda: out of memory for a plan of %zu pairs", n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        pair_to_dev(&p[i], chunks, &host[i]);
        pl->chunk0[i] = chunks;
        chunks += (host[i].bytes + CHUNK - 1) / CHUNK;
    }
    pl->chunk0[n] = chunks;
    pl->n = n;
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
    uint64_t lo, chunks;
    int rc = 0;

    if (first > pl->n || count > pl->n - first)
        return rf_err_set(err, -EINVAL, "copy_cuda: pairs [%zu, %zu) of a plan of %zu", first,
                          first + count, pl->n);
    if (count == 0)
        return 0;
    lo = pl->chunk0[first];
    chunks = pl->chunk0[first + count] - lo;
    if (chunks == 0)
        return 0;
    pair_kernel<<<pair_grid(pl->sms, max_blocks, chunks), THREADS, 0, s>>>(
        pl->devp + first, (uint32_t)count, lo, chunks);
    CUDA_TRY(err, cudaGetLastError());
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
    free(pl);
}
