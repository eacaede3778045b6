/* bench/bench_gpu.c - GPU refit speed on two GPUs: (a) the NCCL p2p ceiling GPU0 -> GPU1 at
 * 1 GiB messages, (b) full refits of real-size models through the nccl transport driven with a
 * plan (trainer ranks' memory all on GPU 0, engine ranks' all on GPU 1), cold and warm, every
 * destination byte checked, (c) the conventional refit (each full tensor broadcast, then sliced
 * into the engine buffers with the copy kernels) on the same data, as a time ratio.
 * Usage: bench_gpu [staging MiB per endpoint, comma list; default 2048] [models: all | 4b]
 *                  [sweep | one] [smallest direct transfer MiB, comma list; default 4]
 * "sweep" runs each case under several tunings of the transport (copy kernel blocks, rounds
 * enqueued at once) and two diagnostics (the wire without the copies, the copies without the
 * wire), then checks the bytes of the best tuning once.
 * Same-host refits through the local transport (issue #12):
 *   bench_gpu local [GPUs: 1 | 2; default 1] [models: all | 4b | 30b]
 *     trainer shards and engine buffers in one process (engine on GPU 0, trainer on GPU 0, or
 *     on GPU 1 with 2: peer copies), against the same-GPU cudaMemcpy ceiling of the same bytes
 *     and a per-box copy baseline; first the kernel/copy-engine threshold. With
 *     BENCH_LOCAL_MEM=carve each endpoint's regions lie in one allocation, as a trainer's or
 *     an engine's do; with BENCH_LOCAL_MEM=ipc that allocation is made by a child process and
 *     opened here by CUDA IPC, as a receiverd sees cudaMalloc memory (1 GPU only).
 *     BENCH_LOG=debug prints the local transport's per-batch account. Each model runs plain and
 *     again with trainer weights held transposed ("model T:o_proj"; 30b: every expert weight).
 *   bench_gpu local-host [threads, comma list; default 1,0 (0: auto)]
 *     a qwen3-0.6b refit in host memory against one thread's memcpy of the same bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- same-host refits through the local transport: what the host and GPU cases share -------- */

#include <sys/mman.h>
#include <uv.h>

#include "copy.h"
#include "layout.h"
#include "model.h"
#include "plan.h"
#include "slice.h"
#include "xfer.h"
#include "xfer_local_int.h"

static double lnow(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void ldie(const char *what, const rf_err *e)
{
    fprintf(stderr, "bench_gpu: %s: %s\n", what, e->msg);
    exit(1);
}

/* The receiving daemon's local messages of a plan, one per plan message, transfers tiled in
 * plan order (what the planner's RF_PLAN_LOCAL messages become in the engines' daemon). */
static void lbench_job(const rf_plan *pl, uint8_t *const *bases, rf_xfer_job *job)
{
    rf_err err = {0};

    memset(job, 0, sizeof(*job));
    if (rf_slice_local_job_from_plan(pl, bases, job, &err) < 0)
        ldie("local job", &err);
    job->timeout_s = 300;
}

static void lbench_job_free(rf_xfer_job *j)
{
    rf_slice_local_job_free(j);
}

typedef struct lrun {
    uv_loop_t loop;
    rf_xfer_transport *t;
    rf_xfer_result res;
} lrun;

static void lrun_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    lrun *w = arg;

    (void)t;
    w->res = *res;
    uv_stop(&w->loop);
}

static void lrun_open(lrun *w, bool gpu)
{
    const char *addrs[2] = {NULL, NULL};
    rf_err err = {0};

    memset(w, 0, sizeof(*w));
    uv_loop_init(&w->loop);
    if (rf_xfer_local_new(&w->loop, gpu, &w->t, &err) < 0 ||
        rf_xfer_set_peers(w->t, 1, 2, addrs, &err) < 0)
        ldie("local transport", &err);
}

static double lrun_once(lrun *w, rf_xfer_job *job, uint64_t version)
{
    rf_err err = {0};
    double t0 = lnow();

    job->version = version;
    if (rf_xfer_run(w->t, job, lrun_done, w, &err) < 0)
        ldie("run", &err);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    t0 = lnow() - t0;
    if (w->res.code < 0) {
        fprintf(stderr, "bench_gpu: local job: %s\n", w->res.error);
        exit(1);
    }
    return t0;
}

static void lrun_closed(void *arg)
{
    (void)arg;
}

static void lrun_close(lrun *w)
{
    rf_xfer_close(w->t, lrun_closed, NULL);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    uv_loop_close(&w->loop);
}

static bool digests_agree(const rf_xfer_result *r)
{
    static const uint8_t zero[RF_XFER_DIGEST_BYTES];

    return memcmp(r->digest_sent, zero, sizeof(zero)) != 0 &&
           memcmp(r->digest_sent, r->digest_recv, sizeof(zero)) == 0;
}

/* A qwen3-0.6b refit (trainer tp=2, engine tp=4, 1.2 GB) in host memory mapped like a
 * daemon's: one thread's memcpy of the same bytes, then the transport with each thread count. */
static int local_host(const char *threads)
{
    rf_model *m = NULL;
    rf_inv *inv = rf_inv_new();
    rf_par ps, pd;
    rf_plan *pl = NULL;
    rf_xfer_job job;
    rf_err err = {0};
    uint8_t **bases;
    uint64_t bytes = 0, srcb = 0, dstb = 0;
    uint32_t nr;
    double ceil = 1e30;
    char list[128], *save = NULL;
    lrun w;

    if (rf_model_load("qwen3-0.6b", &m, &err) < 0 || rf_par_parse("tp=2", RF_SRC, m, &ps, &err) < 0 ||
        rf_par_parse("tp=4", RF_DST, m, &pd, &err) < 0 ||
        rf_model_build_inv(m, &ps, &pd, 8, inv, &err) < 0 || rf_plan_build(inv, NULL, &pl, &err) < 0)
        ldie("qwen3-0.6b", &err);
    nr = rf_inv_nregions(inv);
    bases = calloc(nr, sizeof(*bases));
    for (uint32_t r = 0; r < nr; r++) {
        uint64_t sz = rf_inv_region(inv, r)->size, x = 88172645463325252ull + r;

        bases[r] = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (bases[r] == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        for (uint64_t i = 0; i + 8 <= sz; i += 8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            memcpy(bases[r] + i, &x, 8);
        }
        if (rf_inv_endpoint(inv, rf_inv_region(inv, r)->endpoint)->side == RF_SRC)
            srcb += sz;
        else
            dstb += sz;
    }
    for (uint32_t i = 0; i < rf_plan_nmsgs(pl); i++)
        bytes += rf_plan_msg_at(pl, i)->bytes;
    /* The ceiling: one thread's memcpy of the same byte count, source regions to destination
     * regions, 64 MiB at a time. */
    for (int it = 0; it < 3; it++) {
        uint64_t left = bytes, so = 0, dof = 0;
        uint32_t sr = 0, dr = 0;
        double t0 = lnow();

        while (left > 0) {
            uint64_t n = 64ull << 20;

            while (rf_inv_endpoint(inv, rf_inv_region(inv, sr)->endpoint)->side != RF_SRC ||
                   so >= rf_inv_region(inv, sr)->size)
                sr = (sr + 1) % nr, so = 0;
            while (rf_inv_endpoint(inv, rf_inv_region(inv, dr)->endpoint)->side != RF_DST ||
                   dof >= rf_inv_region(inv, dr)->size)
                dr = (dr + 1) % nr, dof = 0;
            n = n < left ? n : left;
            n = n < rf_inv_region(inv, sr)->size - so ? n : rf_inv_region(inv, sr)->size - so;
            n = n < rf_inv_region(inv, dr)->size - dof ? n : rf_inv_region(inv, dr)->size - dof;
            memcpy(bases[dr] + dof, bases[sr] + so, n);
            so += n;
            dof += n;
            left -= n;
        }
        t0 = lnow() - t0;
        ceil = t0 < ceil ? t0 : ceil;
    }
    printf("local-host: qwen3-0.6b tp=2 -> tp=4, %.3f GB moved (%u messages), %ld CPUs\n",
           (double)bytes / 1e9, rf_plan_nmsgs(pl), sysconf(_SC_NPROCESSORS_ONLN));
    printf("%-28s %9s %9s %9s %8s %s\n", "case", "cold_s", "best_s", "GB/s", "x1thr",
           "check");
    printf("%-28s %9s %9.4f %9.2f %8.2f %s\n", "memcpy, one thread (ceiling)", "-", ceil,
           (double)bytes / 1e9 / ceil, 1.0, "-");
    lbench_job(pl, bases, &job);
    job.plan_key = 1;
    snprintf(list, sizeof(list), "%s", threads);
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        unsigned n = (unsigned)strtoul(tok, NULL, 10);
        double cold, best = 1e30;
        char label[64];

        lrun_open(&w, false);
        if (rf_xfer_local_set_threads(w.t, n, &err) < 0)
            ldie("threads", &err);
        job.verify = RF_VERIFY_OFF;
        job.plan_key = 1;
        cold = lrun_once(&w, &job, 1);
        for (int it = 0; it < 5; it++) {
            double s = lrun_once(&w, &job, 2 + (uint64_t)it);

            best = s < best ? s : best;
        }
        job.verify = RF_VERIFY_FULL;
        job.plan_key = 2;
        lrun_once(&w, &job, 9);
        snprintf(label, sizeof(label), "local transport, %s thr", n ? tok : "auto");
        printf("%-28s %9.4f %9.4f %9.2f %8.2f %s\n", label, cold, best,
               (double)bytes / 1e9 / best, ceil / best,
               digests_agree(&w.res) ? "full digests agree" : "DIGESTS DIFFER");
        lrun_close(&w);
    }
    lbench_job_free(&job);
    for (uint32_t r = 0; r < nr; r++)
        munmap(bases[r], rf_inv_region(inv, r)->size);
    free(bases);
    rf_plan_free(pl);
    rf_inv_free(inv);
    rf_model_free(m);
    (void)srcb;
    (void)dstb;
    return 0;
}

#ifdef RF_HAVE_CUDA
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <uv.h>

#include "copy.h"
#include "copy_cuda.h"
#include "drv_cuda.h"
#include "layout.h"
#include "log.h"
#include "model.h"
#include "plan.h"
#include "xfer.h"

#define CK(call)                                                                        \
    do {                                                                                \
        cudaError_t e_ = (call);                                                        \
        if (e_ != cudaSuccess) {                                                        \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,               \
                    cudaGetErrorString(e_));                                            \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)
#define NK(call)                                                                        \
    do {                                                                                \
        ncclResult_t r_ = (call);                                                       \
        if (r_ != ncclSuccess) {                                                        \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,               \
                    ncclGetErrorString(r_));                                            \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)
#define TILE ((64u << 20) + 4099u) /* pattern period: odd, so shifts never realign */
#define GIB (1ull << 30)

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "bench_gpu: %s\n", what);
    exit(1);
}

static void die_err(const char *what, const rf_err *e)
{
    fprintf(stderr, "bench_gpu: %s: %s\n", what, e->msg);
    exit(1);
}

/* ---- (a) the ceiling ------------------------------------------------------------------------ */

typedef struct p2p {
    ncclComm_t comm[2];
    cudaStream_t s[2];
} p2p;

static double p2p_ceiling(p2p *p, uint64_t bytes, int iters)
{
    void *buf[2];
    double t0 = 0;

    for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaMalloc(&buf[g], bytes));
        CK(cudaMemset(buf[g], g, bytes));
    }
    for (int it = -5; it < iters; it++) {
        if (it == 0) {
            for (int g = 0; g < 2; g++) {
                CK(cudaSetDevice(g));
                CK(cudaStreamSynchronize(p->s[g]));
            }
            t0 = now_s();
        }
        NK(ncclGroupStart());
        NK(ncclSend(buf[0], bytes, ncclUint8, 1, p->comm[0], p->s[0]));
        NK(ncclRecv(buf[1], bytes, ncclUint8, 0, p->comm[1], p->s[1]));
        NK(ncclGroupEnd());
    }
    for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaStreamSynchronize(p->s[g]));
    }
    t0 = now_s() - t0;
    for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaFree(buf[g]));
    }
    return (double)bytes * iters / t0 / 1e9;
}

/* ---- the data: every tensor's canonical bytes come from a random tile ------------------------ */

typedef struct setup {
    const char *name;
    rf_model *m;
    rf_inv *full, *inv;
    uint32_t ntensors;
    uint64_t *toff, *tbytes; /* canonical tensor store offsets on GPU 0 */
    uint64_t store_bytes;
    uint8_t *store;          /* GPU 0: every full tensor, row-major */
    uint8_t *tile[2];        /* the pattern tile on each GPU */
    uint8_t **bases;         /* per region: device memory */
    uint32_t nregions;
    uint64_t src_bytes, dst_bytes;
    uint32_t **tpieces[2];   /* per side, per tensor: piece ids */
    uint32_t *tnp[2];
    uint64_t tmp_bytes;      /* largest per-tensor sum of piece bytes */
    /* BENCH_LOCAL_MEM=carve|ipc: the regions of each endpoint carved from one allocation (as
     * trainers and engines hold them), made here or by a child process that exports it over
     * CUDA IPC (as the daemons see them); blocks[] is what to free or close. */
    uint8_t *blocks[256];
    uint32_t nblocks;
    FILE *ipc_child;         /* the child's stdin: it exits when this closes */
    pid_t ipc_pid;
} setup;

/* Folds every source endpoint into endpoint 0 (GPU 0), every destination one into endpoint 1
 * (GPU 1), keeping tensor, region and piece ids: NCCL takes one rank per GPU. */
static rf_inv *two_endpoints(const rf_inv *in)
{
    rf_inv *out = NULL;
    rf_err err = {0};

    if (rf_inv_fold_sides(in, &out, &err) < 0)
        die_err("folding the inventory", &err);
    return out;
}

static uint64_t tensor_bytes(const rf_tensor *t)
{
    uint64_t n = rf_dtype_size(t->dtype);

    for (int d = 0; d < t->ndim; d++)
        n *= (uint64_t)t->shape[d];
    return n;
}

/* The canonical bytes of tensor t into dst (device memory of GPU g), from that GPU's tile. */
static void canonical(setup *S, int g, uint32_t t, uint8_t *dst, cudaStream_t s)
{
    uint64_t n = S->tbytes[t], pos = ((uint64_t)t * 2654435761u) % TILE, done = 0;

    while (done < n) {
        uint64_t k = TILE - pos < n - done ? TILE - pos : n - done;

        CK(cudaMemcpyAsync(dst + done, S->tile[g] + pos, k, cudaMemcpyDeviceToDevice, s));
        done += k;
        pos = 0;
    }
}

static void full_piece(const setup *S, uint32_t t, rf_piece *p)
{
    const rf_tensor *T = rf_inv_tensor(S->inv, t);
    int64_t stride = 1;

    memset(p, 0, sizeof(*p));
    p->tensor = t;
    rf_box_full(&p->box, T->ndim, T->shape);
    for (int d = T->ndim - 1; d >= 0; d--) {
        p->strides[d] = stride;
        stride *= T->shape[d];
    }
}

/* Descriptors of tensor t's pieces of a side: from the full tensor at full (gather = true
 * reads the pieces' boxes out of it into staging) or from the pieces' own memory. */
static size_t piece_descs(const setup *S, rf_side side, uint32_t t, const uint8_t *full,
                          rf_copy_desc *d)
{
    const rf_tensor *T = rf_inv_tensor(S->inv, t);
    size_t es = rf_dtype_size(T->dtype);
    uint64_t off = 0;
    rf_piece fp, p;

    full_piece(S, t, &fp);
    for (uint32_t k = 0; k < S->tnp[side][t]; k++) {
        rf_inv_piece(S->inv, side, S->tpieces[side][t][k], &p);
        if (full)
            rf_copy_desc_set(&d[k], (void *)full, &fp, T->ndim, es, &p.box, off);
        else
            rf_copy_desc_set(&d[k], S->bases[p.region], &p, T->ndim, es, &p.box, off);
        off += (uint64_t)rf_box_numel(&p.box, T->ndim) * es;
        off = (off + 255) & ~255ull;
    }
    return S->tnp[side][t];
}

static void setup_open(setup *S, const char *model, const char *src, const char *dst)
{
    rf_par ps, pd;
    rf_err err = {0};
    uint64_t maxp = 1;

    memset(S, 0, sizeof(*S));
    S->name = model;
    S->full = rf_inv_new();
    if (rf_model_load(model, &S->m, &err) < 0 || rf_par_parse(src, RF_SRC, S->m, &ps, &err) < 0 ||
        rf_par_parse(dst, RF_DST, S->m, &pd, &err) < 0 ||
        rf_model_build_inv(S->m, &ps, &pd, 8, S->full, &err) < 0)
        die_err(model, &err);
    S->inv = two_endpoints(S->full);
    S->ntensors = rf_inv_ntensors(S->inv);
    S->nregions = rf_inv_nregions(S->inv);
    S->toff = calloc(S->ntensors, sizeof(uint64_t));
    S->tbytes = calloc(S->ntensors, sizeof(uint64_t));
    for (uint32_t t = 0; t < S->ntensors; t++) {
        S->tbytes[t] = tensor_bytes(rf_inv_tensor(S->inv, t));
        S->toff[t] = S->store_bytes;
        S->store_bytes += (S->tbytes[t] + 255) & ~255ull;
    }
    for (int side = 0; side < 2; side++) {
        uint64_t *sum = calloc(S->ntensors, sizeof(uint64_t));

        S->tnp[side] = calloc(S->ntensors, sizeof(uint32_t));
        S->tpieces[side] = calloc(S->ntensors, sizeof(uint32_t *));
        for (uint32_t i = 0; i < rf_inv_npieces(S->inv, (rf_side)side); i++)
            S->tnp[side][rf_inv_piece_tensor(S->inv, (rf_side)side, i)]++;
        for (uint32_t t = 0; t < S->ntensors; t++) {
            S->tpieces[side][t] = calloc(S->tnp[side][t] + 1, sizeof(uint32_t));
            S->tnp[side][t] = 0;
        }
        for (uint32_t i = 0; i < rf_inv_npieces(S->inv, (rf_side)side); i++) {
            uint32_t t = rf_inv_piece_tensor(S->inv, (rf_side)side, i);
            rf_piece p;
            const rf_tensor *T = rf_inv_tensor(S->inv, t);

            rf_inv_piece(S->inv, (rf_side)side, i, &p);
            S->tpieces[side][t][S->tnp[side][t]++] = i;
            sum[t] += (((uint64_t)rf_box_numel(&p.box, T->ndim) * rf_dtype_size(T->dtype)) +
                       255) & ~255ull;
        }
        for (uint32_t t = 0; t < S->ntensors; t++)
            if (sum[t] > maxp)
                maxp = sum[t];
        free(sum);
    }
    S->tmp_bytes = maxp;
}

static void setup_alloc(setup *S)
{
    uint8_t *host;

    S->bases = calloc(S->nregions, sizeof(*S->bases));
    for (uint32_t r = 0; r < S->nregions; r++) {
        const rf_region *rg = rf_inv_region(S->inv, r);
        int g = rf_inv_endpoint(S->inv, rg->endpoint)->side == RF_SRC ? 0 : 1;

        CK(cudaSetDevice(g));
        CK(cudaMalloc((void **)&S->bases[r], rg->size));
        if (g == 0)
            S->src_bytes += rg->size;
        else
            S->dst_bytes += rg->size;
    }
    host = malloc(TILE);
    srand(12345);
    for (uint32_t i = 0; i < TILE; i++)
        host[i] = (uint8_t)(rand() >> 7);
    for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaMalloc((void **)&S->tile[g], TILE));
        CK(cudaMemcpy(S->tile[g], host, TILE, cudaMemcpyHostToDevice));
    }
    free(host);
    CK(cudaSetDevice(0));
    CK(cudaMalloc((void **)&S->store, S->store_bytes));
}

static void setup_free(setup *S)
{
    for (uint32_t r = 0; S->nblocks == 0 && r < S->nregions; r++)
        cudaFree(S->bases[r]);
    for (uint32_t b = 0; b < S->nblocks; b++) {
        if (S->ipc_child)
            cudaIpcCloseMemHandle(S->blocks[b]);
        else
            cudaFree(S->blocks[b]);
    }
    if (S->ipc_child) {
        fclose(S->ipc_child);
        waitpid(S->ipc_pid, NULL, 0);
    }
    for (int g = 0; g < 2; g++)
        cudaFree(S->tile[g]);
    cudaFree(S->store);
    for (int side = 0; side < 2; side++) {
        for (uint32_t t = 0; t < S->ntensors; t++)
            free(S->tpieces[side][t]);
        free(S->tpieces[side]);
        free(S->tnp[side]);
    }
    free(S->bases);
    free(S->toff);
    free(S->tbytes);
    rf_inv_free(S->inv);
    rf_inv_free(S->full);
    rf_model_free(S->m);
}

/* Every full tensor into the store on GPU 0 and every source piece from it. */
static void fill_sources(setup *S)
{
    rf_copy_desc *d = NULL;
    size_t cap = 0;
    uint8_t *tmp;
    cudaStream_t s;
    rf_copy_cuda_buf *b[2];
    rf_err err = {0};

    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc((void **)&tmp, S->tmp_bytes));
    for (int i = 0; i < 2; i++)
        if (rf_copy_cuda_buf_new(&b[i], &err) < 0)
            die_err("descriptor buffer", &err);
    for (uint32_t t = 0; t < S->ntensors; t++) {
        size_t n = S->tnp[RF_SRC][t];

        canonical(S, 0, t, S->store + S->toff[t], s);
        if (n == 0)
            continue;
        if (n > cap) {
            cap = n * 2;
            d = realloc(d, cap * sizeof(*d));
        }
        piece_descs(S, RF_SRC, t, S->store + S->toff[t], d);
        if (rf_copy_cuda_gather_buf(b[0], d, n, tmp, s, &err) < 0)
            die_err("fill gather", &err);
        piece_descs(S, RF_SRC, t, NULL, d);
        if (rf_copy_cuda_scatter_buf(b[1], d, n, tmp, s, &err) < 0)
            die_err("fill scatter", &err);
    }
    CK(cudaStreamSynchronize(s));
    for (int i = 0; i < 2; i++)
        rf_copy_cuda_buf_free(b[i]);
    CK(cudaFree(tmp));
    CK(cudaStreamDestroy(s));
    free(d);
}

static void clear_dst(setup *S)
{
    for (uint32_t r = 0; r < S->nregions; r++) {
        const rf_region *rg = rf_inv_region(S->inv, r);

        if (rf_inv_endpoint(S->inv, rg->endpoint)->side == RF_DST) {
            CK(cudaSetDevice(1));
            CK(cudaMemset(S->bases[r], 0, rg->size));
        }
    }
    CK(cudaSetDevice(1));
    CK(cudaDeviceSynchronize());
}

/* Bytes of destination pieces that differ from the canonical tensors (rebuilt on GPU dev, where
 * the destination pieces are: 1 for the NCCL pair, 0 for the colocated local case). */
static uint64_t count_wrong(setup *S, int dev)
{
    rf_copy_desc *d = NULL;
    size_t cap = 0;
    uint8_t *full, *ta, *tb, *ha, *hb;
    uint64_t maxt = 0, wrong = 0;
    cudaStream_t s;
    rf_copy_cuda_buf *b[2];
    rf_err err = {0};

    for (uint32_t t = 0; t < S->ntensors; t++)
        if (S->tbytes[t] > maxt)
            maxt = S->tbytes[t];
    CK(cudaSetDevice(dev));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc((void **)&full, maxt));
    CK(cudaMalloc((void **)&ta, S->tmp_bytes));
    CK(cudaMalloc((void **)&tb, S->tmp_bytes));
    CK(cudaMallocHost((void **)&ha, S->tmp_bytes));
    CK(cudaMallocHost((void **)&hb, S->tmp_bytes));
    for (int i = 0; i < 2; i++)
        if (rf_copy_cuda_buf_new(&b[i], &err) < 0)
            die_err("descriptor buffer", &err);
    for (uint32_t t = 0; t < S->ntensors; t++) {
        size_t n = S->tnp[RF_DST][t];
        uint64_t bytes;

        if (n == 0)
            continue;
        if (n > cap) {
            cap = n * 2;
            d = realloc(d, cap * sizeof(*d));
        }
        canonical(S, dev, t, full, s);
        piece_descs(S, RF_DST, t, full, d);
        bytes = d[n - 1].staging_off + rf_copy_desc_bytes(&d[n - 1]);
        if (rf_copy_cuda_gather_buf(b[0], d, n, ta, s, &err) < 0)
            die_err("check gather", &err);
        piece_descs(S, RF_DST, t, NULL, d);
        if (rf_copy_cuda_gather_buf(b[1], d, n, tb, s, &err) < 0)
            die_err("check gather", &err);
        CK(cudaMemcpyAsync(ha, ta, bytes, cudaMemcpyDeviceToHost, s));
        CK(cudaMemcpyAsync(hb, tb, bytes, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        if (memcmp(ha, hb, bytes) != 0)
            for (uint64_t i = 0; i < bytes; i++)
                wrong += ha[i] != hb[i];
    }
    for (int i = 0; i < 2; i++)
        rf_copy_cuda_buf_free(b[i]);
    cudaFree(full);
    cudaFree(ta);
    cudaFree(tb);
    cudaFreeHost(ha);
    cudaFreeHost(hb);
    cudaStreamDestroy(s);
    free(d);
    return wrong;
}

/* ---- (b) the refit through the transport ------------------------------------------------------ */

typedef struct run2 {
    uv_loop_t loop;
    rf_xfer_transport *t[2];
    rf_xfer_result res[2];
    int pending;
} run2;

static void on_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    run2 *w = arg;

    for (int i = 0; i < 2; i++)
        if (w->t[i] == t)
            w->res[i] = *res;
    if (--w->pending == 0)
        uv_stop(&w->loop);
}

static rf_xfer_msg plan_side(const rf_plan *pl, uint32_t mi, rf_side side, uint8_t **bases)
{
    rf_xfer_msg m;
    rf_err err = {0};

    if (rf_slice_msg_from_plan(pl, mi, side, bases, side == RF_SRC ? 1 : 0, &m, &err) < 0)
        die_err("plan message", &err);
    return m;
}

static void jobs_from_plan(const rf_plan *pl, uint64_t staging, uint8_t **bases,
                           rf_xfer_job *jobs)
{
    uint32_t n = rf_plan_nmsgs(pl);

    for (int d = 0; d < 2; d++) {
        memset(&jobs[d], 0, sizeof(jobs[d]));
        jobs[d].nrounds = rf_plan_nrounds(pl);
        jobs[d].timeout_s = 120;
        jobs[d].staging_bytes = staging;
        jobs[d].nmsgs = n;
        jobs[d].msgs = calloc(n ? n : 1, sizeof(rf_xfer_msg));
    }
    for (uint32_t mi = 0; mi < n; mi++) {
        jobs[0].msgs[mi] = plan_side(pl, mi, RF_SRC, bases);
        jobs[1].msgs[mi] = plan_side(pl, mi, RF_DST, bases);
    }
    /* As a daemon does with its slice: checked once, and keyed so that the transport keeps
     * its plan of execution from refit to refit. */
    for (int d = 0; d < 2; d++) {
        rf_err err = {0};

        if (rf_xfer_job_check(&jobs[d], 2, &err) < 0)
            die_err("job check", &err);
        jobs[d].checked = true;
        jobs[d].plan_key = 1;
    }
}

static void job_free(rf_xfer_job *j)
{
    for (uint32_t i = 0; i < j->nmsgs; i++)
        free(j->msgs[i].items);
    free(j->msgs);
}

static double run_once(run2 *w, rf_xfer_job *jobs, uint64_t version)
{
    rf_err err = {0};
    double t0 = now_s();

    w->pending = 2;
    for (int i = 0; i < 2; i++) {
        jobs[i].version = version;
        if (rf_xfer_run(w->t[i], &jobs[i], on_done, w, &err) < 0)
            die_err("run", &err);
    }
    uv_run(&w->loop, UV_RUN_DEFAULT);
    t0 = now_s() - t0;
    for (int i = 0; i < 2; i++)
        if (w->res[i].code < 0) {
            fprintf(stderr, "bench_gpu: rank %d: %s\n", i, w->res[i].error);
            exit(1);
        }
    return t0;
}

static void on_closed(void *arg)
{
    (*(int *)arg)--;
}

static uint64_t used_bytes(int g)
{
    size_t fr = 0, tot = 0;

    CK(cudaSetDevice(g));
    CK(cudaMemGetInfo(&fr, &tot));
    return (uint64_t)(tot - fr);
}

typedef struct tuning {
    const char *label;
    rf_xfer_nccl_tuning tu;
} tuning;

/* How the plan splits the bytes: direct messages (count, GB, sizes) and packed ones. */
static void plan_mix(const rf_plan *pl, uint64_t direct_mib)
{
    uint64_t nd = 0, np = 0, bd = 0, bp = 0, dmin = UINT64_MAX, dmax = 0;

    for (uint32_t i = 0; i < rf_plan_nmsgs(pl); i++) {
        const rf_plan_msg *m = rf_plan_msg_at(pl, i);

        if (m->kind == RF_PLAN_DIRECT) {
            nd++;
            bd += m->bytes;
            dmin = m->bytes < dmin ? m->bytes : dmin;
            dmax = m->bytes > dmax ? m->bytes : dmax;
        } else {
            np++;
            bp += m->bytes;
        }
    }
    printf("# plan, direct from %llu MiB: %llu direct messages (%.2f GB, %.1f-%.1f MiB), %llu "
           "packed (%.2f GB, mean %.1f MiB)\n", (unsigned long long)direct_mib,
           (unsigned long long)nd, (double)bd / 1e9, nd ? (double)dmin / (1 << 20) : 0.0,
           (double)dmax / (1 << 20), (unsigned long long)np, (double)bp / 1e9,
           np ? (double)bp / (double)np / (1 << 20) : 0.0);
}

static double refit_bench(setup *S, uint64_t staging_mib, uint64_t direct_mib, double ceiling,
                          int warm_iters, const tuning *tunes, int ntunes)
{
    rf_plan_opts o;
    rf_plan *pl = NULL;
    rf_xfer_job jobs[2];
    run2 w;
    rf_err err = {0};
    uint8_t uid[RF_XFER_NCCL_ID_BYTES];
    char what[32];
    const char *addrs[2] = {"trainer-gpu0", "engine-gpu1"};
    uint64_t base0 = used_bytes(0), base1 = used_bytes(1), peak_extra = 0, mem_peak[2];
    double cold, best = 1e30, sum = 0, best_all = 1e30;
    const rf_plan_stats *st;
    int closing = 2, best_tune = 0;

    rf_plan_opts_default(&o);
    o.staging_bytes = staging_mib << 20;
    o.direct_min_bytes = direct_mib << 20;
    if (rf_plan_build(S->inv, &o, &pl, &err) < 0)
        die_err("plan", &err);
    plan_mix(pl, direct_mib);
    st = rf_plan_stats_get(pl);
    jobs_from_plan(pl, o.staging_bytes, S->bases, jobs);
    memset(&w, 0, sizeof(w));
    uv_loop_init(&w.loop);
    if (rf_xfer_nccl_unique_id(uid, &err) < 0)
        die_err("unique id", &err);
    for (int i = 0; i < 2; i++) {
        uint32_t rank = (uint32_t)i;
        int dev = i;
        rf_xfer_world wd = {.nranks = 2, .nlocal = 1, .local_ranks = &rank,
                            .local_devices = &dev};

        memcpy(wd.unique_id, uid, sizeof(uid));
        if (rf_xfer_nccl_new(&w.loop, &w.t[i], &err) < 0 ||
            rf_xfer_set_peers(w.t[i], (uint32_t)i, 2, addrs, &err) < 0 ||
            rf_xfer_set_world(w.t[i], &wd, &err) < 0)
            die_err("transport", &err);
    }
    clear_dst(S);
    cold = run_once(&w, jobs, 1);
    for (int k = 0; k <= ntunes; k++) {
        /* k == ntunes: the best tuning again, and its bytes checked. */
        const tuning *tn = &tunes[k < ntunes ? k : best_tune];
        bool check = k == ntunes || ntunes == 1;
        uint64_t wrong = 0;
        double gb = (double)st->dst_bytes / 1e9;

        if (k == ntunes && ntunes == 1)
            break;
        for (int i = 0; i < 2; i++)
            if (rf_xfer_nccl_tune(w.t[i], &tn->tu, &err) < 0)
                die_err("tune", &err);
        best = 1e30;
        sum = 0;
        for (int it = 0; it < warm_iters; it++) {
            double s;

            clear_dst(S);
            s = run_once(&w, jobs, 2 + (uint64_t)(k * warm_iters + it));
            sum += s;
            if (s < best)
                best = s;
        }
        if (tn->tu.diag == 0 && best < best_all) {
            best_all = best;
            best_tune = k < ntunes ? k : best_tune;
        }
        {
            uint64_t e0 = used_bytes(0) - base0, e1 = used_bytes(1) - base1;

            if ((e0 > e1 ? e0 : e1) > peak_extra)
                peak_extra = e0 > e1 ? e0 : e1;
        }
        for (int i = 0; i < 2; i++)
            rf_xfer_nccl_memory(w.t[i], NULL, &mem_peak[i]);
        if (check)
            wrong = count_wrong(S, 1);
        printf("%-14s %6llu %6u %8u %9.2f %8.3f %8.3f %8.3f %7.1f %6.1f%% %9.2f %9.2f %9.2f "
               "%8s %s\n",
               S->name, (unsigned long long)staging_mib, rf_plan_nrounds(pl), rf_plan_nmsgs(pl),
               gb, cold, sum / warm_iters, best, gb / best, 100.0 * gb / best / ceiling,
               (double)st->packed_bytes / 1e9, (double)(mem_peak[0] > mem_peak[1] ?
                                                         mem_peak[0] : mem_peak[1]) / GIB,
               (double)peak_extra / GIB,
               check ? (snprintf(what, sizeof(what), "%llu", (unsigned long long)wrong), what)
                     : "-",
               k == ntunes ? "(best again, checked)" : tn->label);
        fflush(stdout);
    }
    best = best_all;
    for (int i = 0; i < 2; i++)
        rf_xfer_close(w.t[i], on_closed, &closing);
    uv_run(&w.loop, UV_RUN_DEFAULT);
    uv_loop_close(&w.loop);
    job_free(&jobs[0]);
    job_free(&jobs[1]);
    rf_plan_free(pl);
    return best;
}

/* ---- (c) the conventional refit ---------------------------------------------------------------- */

/* Each full tensor (already whole on the trainer GPU) broadcast to the engine GPU, then sliced
 * into the engine pieces: gathered out of the full tensor and scattered into the pieces. */
static double conventional(setup *S, p2p *p)
{
    rf_copy_desc *d = NULL;
    size_t cap = 0;
    uint8_t *full1, *tmp;
    uint64_t maxt = 0;
    rf_copy_cuda_buf *b[4];
    rf_err err = {0};
    double t0;

    for (uint32_t t = 0; t < S->ntensors; t++)
        if (S->tbytes[t] > maxt)
            maxt = S->tbytes[t];
    CK(cudaSetDevice(1));
    CK(cudaMalloc((void **)&full1, maxt));
    CK(cudaMalloc((void **)&tmp, S->tmp_bytes));
    for (int i = 0; i < 4; i++)
        if (rf_copy_cuda_buf_new(&b[i], &err) < 0)
            die_err("descriptor buffer", &err);
    clear_dst(S);
    t0 = now_s();
    for (uint32_t t = 0; t < S->ntensors; t++) {
        size_t n = S->tnp[RF_DST][t];

        NK(ncclGroupStart());
        NK(ncclBroadcast(S->store + S->toff[t], S->store + S->toff[t], S->tbytes[t], ncclUint8,
                         0, p->comm[0], p->s[0]));
        NK(ncclBroadcast(full1, full1, S->tbytes[t], ncclUint8, 0, p->comm[1], p->s[1]));
        NK(ncclGroupEnd());
        if (n == 0)
            continue;
        if (n > cap) {
            cap = n * 2;
            d = realloc(d, cap * sizeof(*d));
        }
        piece_descs(S, RF_DST, t, full1, d);
        if (rf_copy_cuda_gather_buf(b[(t & 1) * 2], d, n, tmp, p->s[1], &err) < 0)
            die_err("slice gather", &err);
        piece_descs(S, RF_DST, t, NULL, d);
        if (rf_copy_cuda_scatter_buf(b[(t & 1) * 2 + 1], d, n, tmp, p->s[1], &err) < 0)
            die_err("slice scatter", &err);
    }
    for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaStreamSynchronize(p->s[g]));
    }
    t0 = now_s() - t0;
    for (int i = 0; i < 4; i++)
        rf_copy_cuda_buf_free(b[i]);
    cudaFree(full1);
    cudaFree(tmp);
    free(d);
    return t0;
}

/* ---- (d) same-host refits through the local transport ----------------------------------------- */

/* The child of BENCH_LOCAL_MEM=ipc: allocations of the sizes in argv on GPU 0, their IPC handles
 * in hex on stdout, then it waits for stdin to close. */
static int ipc_alloc_main(int argc, char **argv)
{
    for (int i = 2; i < argc; i++) {
        cudaIpcMemHandle_t h;
        void *p;

        CK(cudaSetDevice(0));
        CK(cudaMalloc(&p, strtoull(argv[i], NULL, 10)));
        CK(cudaIpcGetMemHandle(&h, p));
        for (size_t k = 0; k < sizeof(h); k++)
            printf("%02x", ((unsigned char *)&h)[k]);
        printf("\n");
    }
    fflush(stdout);
    while (getchar() != EOF)
        ;
    return 0;
}

/* Regions carved per endpoint from one allocation each (see setup.blocks). */
static void local_alloc_carved(setup *S, bool ipc)
{
    uint32_t nep = rf_inv_nendpoints(S->inv);
    uint64_t *size = calloc(nep, sizeof(*size)), *off = calloc(S->nregions, sizeof(*off));
    uint8_t **base = calloc(nep, sizeof(*base));
    char path[4096];
    int pin[2];

    if (!size || !off || !base || nep > 256)
        die("out of memory, or more than 256 endpoints, carving regions");
    for (uint32_t r = 0; r < S->nregions; r++) {
        const rf_region *rg = rf_inv_region(S->inv, r);

        off[r] = size[rg->endpoint];
        size[rg->endpoint] += (rg->size + 255) & ~255ull;
        if (rf_inv_endpoint(S->inv, rg->endpoint)->side == RF_SRC)
            S->src_bytes += rg->size;
        else
            S->dst_bytes += rg->size;
    }
    if (ipc) {
        ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
        int pout[2];
        pid_t pid;
        FILE *out;

        if (n < 0 || pipe(pin) < 0 || pipe(pout) < 0)
            die("readlink or pipe failed");
        path[n] = 0;
        pid = fork();
        if (pid < 0)
            die("fork failed");
        if (pid == 0) {
            /* Straight to exec: nothing of this process's CUDA state is touched here. */
            char **av = calloc(nep + 3, sizeof(*av));

            av[0] = path;
            av[1] = (char *)"ipc-alloc";
            for (uint32_t e = 0; e < nep; e++) {
                av[2 + e] = malloc(24);
                snprintf(av[2 + e], 24, "%llu", (unsigned long long)(size[e] ? size[e] : 256));
            }
            dup2(pin[0], 0);
            dup2(pout[1], 1);
            close(pin[1]);
            close(pout[0]);
            execv(path, av);
            _exit(127);
        }
        close(pin[0]);
        close(pout[1]);
        S->ipc_pid = pid;
        S->ipc_child = fdopen(pin[1], "w");
        out = fdopen(pout[0], "r");
        for (uint32_t e = 0; e < nep; e++) {
            char hex[2 * sizeof(cudaIpcMemHandle_t) + 2];
            cudaIpcMemHandle_t h;

            if (!fgets(hex, sizeof(hex), out))
                die("the IPC allocator said nothing");
            for (size_t k = 0; k < sizeof(h); k++) {
                unsigned v;

                if (sscanf(hex + 2 * k, "%2x", &v) != 1)
                    die("the IPC allocator's handle is not hex");
                ((unsigned char *)&h)[k] = (unsigned char)v;
            }
            CK(cudaIpcOpenMemHandle((void **)&base[e], h, cudaIpcMemLazyEnablePeerAccess));
            S->blocks[S->nblocks++] = base[e];
        }
        fclose(out);
    } else {
        for (uint32_t e = 0; e < nep; e++) {
            CK(cudaMalloc((void **)&base[e], size[e] ? size[e] : 256));
            S->blocks[S->nblocks++] = base[e];
        }
    }
    for (uint32_t r = 0; r < S->nregions; r++)
        S->bases[r] = base[rf_inv_region(S->inv, r)->endpoint] + off[r];
    printf("#   regions carved from %u allocations (%s)\n", nep, ipc ? "made by a child process, "
           "opened here by CUDA IPC" : "made here");
    free(size);
    free(off);
    free(base);
}

/* Regions: destinations on GPU 0, sources on src_gpu; the pattern tile on every GPU used. */
static void local_alloc(setup *S, int src_gpu)
{
    uint8_t *host = malloc(TILE);
    const char *how = getenv("BENCH_LOCAL_MEM");

    S->bases = calloc(S->nregions, sizeof(*S->bases));
    if (how && src_gpu == 0)
        local_alloc_carved(S, strcmp(how, "ipc") == 0);
    for (uint32_t r = 0; S->nblocks == 0 && r < S->nregions; r++) {
        const rf_region *rg = rf_inv_region(S->inv, r);
        bool src = rf_inv_endpoint(S->inv, rg->endpoint)->side == RF_SRC;

        CK(cudaSetDevice(src ? src_gpu : 0));
        CK(cudaMalloc((void **)&S->bases[r], rg->size));
        if (src)
            S->src_bytes += rg->size;
        else
            S->dst_bytes += rg->size;
    }
    srand(12345);
    for (uint32_t i = 0; i < TILE; i++)
        host[i] = (uint8_t)(rand() >> 7);
    for (int g = 0; g <= src_gpu; g++) {
        CK(cudaSetDevice(g));
        CK(cudaMalloc((void **)&S->tile[g], TILE));
        CK(cudaMemcpy(S->tile[g], host, TILE, cudaMemcpyHostToDevice));
    }
    free(host);
}

/* Every source piece from its tensor's canonical bytes, one tensor at a time on the sources'
 * GPU (no store of the whole model: both sides of a 30B model fill most of one GPU). */
static void local_fill(setup *S, int g)
{
    rf_copy_desc *d = NULL;
    size_t cap = 0;
    uint8_t *full, *tmp;
    uint64_t maxt = 0;
    cudaStream_t s;
    rf_copy_cuda_buf *b[2];
    rf_err err = {0};

    for (uint32_t t = 0; t < S->ntensors; t++)
        maxt = S->tbytes[t] > maxt ? S->tbytes[t] : maxt;
    CK(cudaSetDevice(g));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc((void **)&full, maxt));
    CK(cudaMalloc((void **)&tmp, S->tmp_bytes));
    for (int i = 0; i < 2; i++)
        if (rf_copy_cuda_buf_new(&b[i], &err) < 0)
            die_err("descriptor buffer", &err);
    for (uint32_t t = 0; t < S->ntensors; t++) {
        size_t n = S->tnp[RF_SRC][t];

        if (n == 0)
            continue;
        if (n > cap) {
            cap = n * 2;
            d = realloc(d, cap * sizeof(*d));
        }
        canonical(S, g, t, full, s);
        piece_descs(S, RF_SRC, t, full, d);
        if (rf_copy_cuda_gather_buf(b[0], d, n, tmp, s, &err) < 0)
            die_err("fill gather", &err);
        piece_descs(S, RF_SRC, t, NULL, d);
        if (rf_copy_cuda_scatter_buf(b[1], d, n, tmp, s, &err) < 0)
            die_err("fill scatter", &err);
        CK(cudaStreamSynchronize(s));
    }
    for (int i = 0; i < 2; i++)
        rf_copy_cuda_buf_free(b[i]);
    cudaFree(full);
    cudaFree(tmp);
    cudaStreamDestroy(s);
    free(d);
}

static void local_clear(setup *S)
{
    for (uint32_t r = 0; r < S->nregions; r++) {
        const rf_region *rg = rf_inv_region(S->inv, r);

        if (rf_inv_endpoint(S->inv, rg->endpoint)->side == RF_DST) {
            CK(cudaSetDevice(0));
            CK(cudaMemset(S->bases[r], 0, rg->size));
        }
    }
    CK(cudaDeviceSynchronize());
}


/* The same-GPU ceiling: cudaMemcpyAsync of `bytes` from source regions into destination
 * regions, 1 GiB at a time (what the bytes are does not matter: the refit overwrites them). */
static double local_ceiling(setup *S, uint64_t bytes, cudaStream_t s)
{
    double best = 1e30;

    for (int it = -1; it < 3; it++) {
        uint64_t left = bytes, so = 0, dof = 0;
        uint32_t sr = 0, dr = 0, nr = S->nregions;
        double t0;

        CK(cudaStreamSynchronize(s));
        t0 = now_s();
        while (left > 0) {
            uint64_t n = GIB;

            while (rf_inv_endpoint(S->inv, rf_inv_region(S->inv, sr)->endpoint)->side != RF_SRC ||
                   so >= rf_inv_region(S->inv, sr)->size)
                sr = (sr + 1) % nr, so = 0;
            while (rf_inv_endpoint(S->inv, rf_inv_region(S->inv, dr)->endpoint)->side != RF_DST ||
                   dof >= rf_inv_region(S->inv, dr)->size)
                dr = (dr + 1) % nr, dof = 0;
            n = n < left ? n : left;
            n = n < rf_inv_region(S->inv, sr)->size - so ? n : rf_inv_region(S->inv, sr)->size - so;
            n = n < rf_inv_region(S->inv, dr)->size - dof ? n : rf_inv_region(S->inv, dr)->size - dof;
            CK(cudaMemcpyAsync(S->bases[dr] + dof, S->bases[sr] + so, n,
                               cudaMemcpyDeviceToDevice, s));
            so += n;
            dof += n;
            left -= n;
        }
        CK(cudaStreamSynchronize(s));
        t0 = now_s() - t0;
        if (it >= 0 && t0 < best)
            best = t0;
    }
    return best;
}

/* The per-box baseline: one cudaMemcpyAsync (or cudaMemcpy2DAsync for rows, one per outer
 * index beyond) per transfer, as colocated frameworks copy_ tensor by tensor once their IPC
 * handles are open. Returns seconds; *calls the copies issued. */
static double local_per_box(setup *S, const rf_plan *pl, cudaStream_t s, uint64_t *calls)
{
    const rf_inv *inv = rf_plan_inv(pl);
    double t0;

    *calls = 0;
    CK(cudaStreamSynchronize(s));
    t0 = now_s();
    for (uint64_t i = 0; i < rf_plan_nxfers(pl); i++) {
        const rf_plan_xfer *x = rf_plan_xfer_at(pl, i);
        const rf_tensor *T;
        rf_copy_pair p;
        rf_copy_pair_flat f;
        rf_piece sp, dp;
        int64_t idx[RF_MAX_DIMS] = {0};
        size_t es;

        rf_inv_piece(inv, RF_SRC, x->src, &sp);
        rf_inv_piece(inv, RF_DST, x->dst, &dp);
        T = rf_inv_tensor(inv, sp.tensor);
        es = rf_dtype_size(T->dtype);
        rf_copy_desc_set(&p.src, S->bases[sp.region], &sp, T->ndim, es, rf_plan_box(pl, x->box), 0);
        rf_copy_desc_set(&p.dst, S->bases[dp.region], &dp, T->ndim, es, rf_plan_box(pl, x->box), 0);
        rf_copy_pair_flatten(&p, &f);
        for (;;) {
            const uint8_t *sa = f.src;
            uint8_t *da = f.dst;
            int k;

            for (k = 0; k < f.n - 1; k++) {
                sa += idx[k] * f.sstr[k];
                da += idx[k] * f.dstr[k];
            }
            if (f.n == 0)
                CK(cudaMemcpyAsync(da, sa, f.run, cudaMemcpyDeviceToDevice, s));
            else
                CK(cudaMemcpy2DAsync(da, (size_t)f.dstr[f.n - 1], sa, (size_t)f.sstr[f.n - 1],
                                     f.run, (size_t)f.ext[f.n - 1], cudaMemcpyDeviceToDevice, s));
            (*calls)++;
            for (k = f.n - 2; k >= 0; k--) {
                if (++idx[k] < f.ext[k])
                    break;
                idx[k] = 0;
            }
            if (k < 0)
                break;
        }
    }
    CK(cudaStreamSynchronize(s));
    return now_s() - t0;
}

/* Contiguous copies of one size, as the pair kernel (one launch) and as cudaMemcpyAsync (one
 * call each): where the copy engines start to win. */
static void local_threshold(void)
{
    static const uint64_t sizes[] = {64ull << 10, 256ull << 10, 1ull << 20, 4ull << 20,
                                     8ull << 20, 16ull << 20, 64ull << 20, 256ull << 20};
    const uint64_t total = 4 * GIB;
    uint8_t *a, *b;
    cudaStream_t s;
    rf_err err = {0};

    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc((void **)&a, total));
    CK(cudaMalloc((void **)&b, total));
    CK(cudaMemset(a, 1, total));
    printf("(d0) contiguous copies on GPU 0, 4 GiB in copies of one size: pair kernel (one launch) "
           "vs cudaMemcpyAsync (one call each), GB/s\n%10s %10s %10s %10s\n", "size", "kernel",
           "memcpy", "copies");
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint64_t n = total / sizes[z];
        rf_copy_pair *p = calloc(n, sizeof(*p));
        rf_copy_cuda_plan *pl = NULL;
        double tk = 1e30, tm = 1e30;
        int64_t shape[1] = {(int64_t)total};
        rf_piece pc;

        memset(&pc, 0, sizeof(pc));
        rf_box_full(&pc.box, 1, shape);
        pc.strides[0] = 1;
        for (uint64_t i = 0; i < n; i++) {
            rf_box bx = pc.box;

            bx.start[0] = (int64_t)(i * sizes[z]);
            bx.extent[0] = (int64_t)sizes[z];
            rf_copy_desc_set(&p[i].src, a, &pc, 1, 1, &bx, 0);
            rf_copy_desc_set(&p[i].dst, b, &pc, 1, 1, &bx, 0);
        }
        if (rf_copy_cuda_plan_new(p, n, &pl, &err) < 0)
            die_err("threshold plan", &err);
        for (int it = -1; it < 5; it++) {
            double t0;

            CK(cudaStreamSynchronize(s));
            t0 = now_s();
            if (rf_copy_cuda_plan_launch(pl, 0, n, s, 0, &err) < 0)
                die_err("threshold launch", &err);
            CK(cudaStreamSynchronize(s));
            t0 = now_s() - t0;
            tk = it >= 0 && t0 < tk ? t0 : tk;
            t0 = now_s();
            for (uint64_t i = 0; i < n; i++)
                CK(cudaMemcpyAsync(b + i * sizes[z], a + i * sizes[z], sizes[z],
                                   cudaMemcpyDeviceToDevice, s));
            CK(cudaStreamSynchronize(s));
            t0 = now_s() - t0;
            tm = it >= 0 && t0 < tm ? t0 : tm;
        }
        printf("%9lluK %10.1f %10.1f %10llu\n", (unsigned long long)(sizes[z] >> 10),
               (double)total / tk / 1e9, (double)total / tm / 1e9, (unsigned long long)n);
        rf_copy_cuda_plan_free(pl);
        free(p);
    }
    cudaFree(a);
    cudaFree(b);
    cudaStreamDestroy(s);
}

/* The inventory again with the 2-D source pieces of tensors whose name holds `match` kept
 * transposed (dense row-major [r, c] becomes strides (1, r): the same bytes, column-major), as
 * a trainer holds weights it multiplies transposed (Megatron's GroupedMLP experts). Piece,
 * region and tensor ids stay. Returns the pieces changed. */
static uint32_t transpose_sources(setup *S, const char *match)
{
    rf_inv *in = S->inv, *f = rf_inv_new();
    uint32_t id, changed = 0;
    rf_err err = {0};
    int rc = f ? 0 : -ENOMEM;

    for (uint32_t i = 0; i < rf_inv_ntensors(in) && rc == 0; i++) {
        const rf_tensor *t = rf_inv_tensor(in, i);

        rc = rf_inv_add_tensor(f, t->name, t->dtype, t->ndim, t->shape, &id, &err);
    }
    for (uint32_t e = 0; e < rf_inv_nendpoints(in) && rc == 0; e++) {
        const rf_endpoint *ep = rf_inv_endpoint(in, e);

        rc = rf_inv_add_endpoint(f, ep->side, ep->node, &id, &err);
        if (rc == 0)
            rc = rf_inv_set_endpoint_host(f, id, ep->host, &err);
    }
    for (uint32_t r = 0; r < rf_inv_nregions(in) && rc == 0; r++)
        rc = rf_inv_add_region(f, rf_inv_region(in, r)->endpoint, rf_inv_region(in, r)->size,
                               &id, &err);
    for (uint32_t q = 1; q <= rf_inv_nquants(in) && rc == 0; q++)
        rc = rf_inv_add_quant(f, rf_inv_quant(in, q), &id, &err);
    for (int side = 0; side < 2 && rc == 0; side++) {
        for (uint32_t i = 0; i < rf_inv_npieces(in, (rf_side)side) && rc == 0; i++) {
            rf_piece p;
            const rf_tensor *t;

            rf_inv_piece(in, (rf_side)side, i, &p);
            t = rf_inv_tensor(in, p.tensor);
            if (side == RF_SRC && t->ndim == 2 && strstr(t->name, match) && p.quant == 0 &&
                p.strides[1] == 1 && p.strides[0] == p.box.extent[1]) {
                p.strides[0] = 1;
                p.strides[1] = p.box.extent[0];
                changed++;
            }
            rc = rf_inv_add_piece(f, &p, &id, &err);
        }
    }
    if (rc < 0)
        die_err("transposing the sources", &err);
    rf_inv_free(in);
    S->inv = f;
    return changed;
}

static void local_case(const char *model, const char *src, const char *dst, int src_gpu,
                       const char *transpose)
{
    setup S;
    rf_plan_opts o;
    rf_plan *pl = NULL;
    rf_xfer_job job;
    rf_err err = {0};
    cudaStream_t s;
    lrun w;
    uint64_t bytes = 0, calls = 0, a0, a1, dev_now, dev_peak, base_used, extra = 0, wrong;
    double ceil, cold, best = 1e30, sum = 0, pbox, ver;
    const int iters = 5;

    char label[64];

    setup_open(&S, model, src, dst);
    if (transpose) {
        uint32_t n = transpose_sources(&S, transpose);

        snprintf(label, sizeof(label), "%s T:%s", model, transpose);
        S.name = label;
        printf("#   %s: %u trainer pieces of tensors named *%s* held transposed\n", S.name, n,
               transpose);
    }
    local_alloc(&S, src_gpu);
    local_fill(&S, src_gpu);
    rf_plan_opts_default(&o);
    if (rf_plan_build(S.inv, &o, &pl, &err) < 0)
        die_err("plan", &err);
    for (uint32_t i = 0; i < rf_plan_nmsgs(pl); i++)
        bytes += rf_plan_msg_at(pl, i)->bytes;
    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ceil = local_ceiling(&S, bytes, s);
    /* The ceiling the issue quotes: one 1 GiB buffer copied again and again to the same byte
     * count (hot in the GPU's TLB, unlike two 61 GB sides). */
    {
        uint8_t *a, *b;
        double hot = 1e30;

        CK(cudaMalloc((void **)&a, GIB));
        CK(cudaMalloc((void **)&b, GIB));
        for (int it = -1; it < 3; it++) {
            double t0;

            CK(cudaStreamSynchronize(s));
            t0 = now_s();
            for (uint64_t left = bytes; left > 0; left -= left < GIB ? left : GIB)
                CK(cudaMemcpyAsync(b, a, left < GIB ? left : GIB, cudaMemcpyDeviceToDevice, s));
            CK(cudaStreamSynchronize(s));
            t0 = now_s() - t0;
            hot = it >= 0 && t0 < hot ? t0 : hot;
        }
        cudaFree(a);
        cudaFree(b);
        printf("#   %s: cudaMemcpy of %.2f GB on GPU 0: %.4f s (%.0f GB/s) across the real "
               "regions, %.4f s (%.0f GB/s) through one 1 GiB buffer\n", S.name,
               (double)bytes / 1e9, ceil, (double)bytes / 1e9 / ceil, hot,
               (double)bytes / 1e9 / hot);
    }
    lbench_job(pl, S.bases, &job);
    job.plan_key = 1;
    job.verify = RF_VERIFY_OFF;
    base_used = used_bytes(0);
    lrun_open(&w, true);
    local_clear(&S);
    cold = lrun_once(&w, &job, 1);
    /* The daemons check a slice's job once, when it is installed (rf_xfer_job.checked); so do
     * the warm runs here, which otherwise spent ~10 ms of a 30B refit re-checking 75k items. */
    job.checked = true;
    rf_xfer_local_stats(w.t, &a0, NULL, NULL);
    for (int it = 0; it < iters; it++) {
        double t = lrun_once(&w, &job, 2 + (uint64_t)it);
        uint64_t e = used_bytes(0) - base_used;

        sum += t;
        best = t < best ? t : best;
        extra = e > extra ? e : extra;
    }
    rf_xfer_local_stats(w.t, &a1, &dev_now, &dev_peak);
    wrong = count_wrong(&S, 0);
    /* Tunings of the GPU part: batch size and where the copy engines take over. */
    {
        static const uint64_t batches[] = {1ull << 30, 4ull << 30, 16ull << 30};
        static const uint64_t mins[] = {8ull << 20, 64ull << 20, UINT64_MAX};

        for (size_t bi = 0; bi < 3; bi++) {
            for (size_t mi = 0; mi < 3; mi++) {
                double tb = 1e30;

                if (rf_xfer_local_tune_gpu(w.t, batches[bi], mins[mi], &err) < 0)
                    die_err("tune", &err);
                lrun_once(&w, &job, 60);
                for (int it = 0; it < 3; it++) {
                    double t = lrun_once(&w, &job, 61 + (uint64_t)it);

                    tb = t < tb ? t : tb;
                }
                printf("#   %s tuning batch %2llu GiB, copy engines from %s: best %.4f s, "
                       "%.0f GB/s\n", S.name, (unsigned long long)(batches[bi] >> 30),
                       mins[mi] == UINT64_MAX ? "never" : mi == 0 ? "8 MiB" : "64 MiB", tb,
                       (double)bytes / 1e9 / tb);
            }
        }
        rf_xfer_local_tune_gpu(w.t, 0, 0, &err);
    }
    job.verify = RF_VERIFY_SAMPLE;
    job.plan_key = 2;
    lrun_once(&w, &job, 50);
    ver = lrun_once(&w, &job, 51);
    printf("%-14s %-10s %-5s %4s %9.2f %8u %7.4f %8.4f %8.4f %8.4f %7.0f %6.2f %8.4f %9.4f "
           "%8.1f %6llu %7s %llu\n", S.name, src, dst, src_gpu ? "peer" : "same",
           (double)bytes / 1e9, rf_plan_nmsgs(pl), ceil, cold, sum / iters, best,
           (double)bytes / 1e9 / best, ceil / best, ver,
           (double)dev_peak / (1 << 20) + 0.0 * (double)dev_now, (double)extra / (1 << 20),
           (unsigned long long)(a1 - a0), digests_agree(&w.res) ? "agree" : "DIFFER",
           (unsigned long long)wrong);
    lrun_close(&w);
    /* Transposed boxes would be one cudaMemcpy2D per element row: millions for the 30b. */
    if (!transpose) {
        local_clear(&S);
        pbox = local_per_box(&S, pl, s, &calls);
        printf("%-14s per-box baseline: %llu copies in %.4f s, %.1f GB/s, %.2f of the ceiling, "
               "%.1fx the local transport's best; #wrong %llu\n", S.name,
               (unsigned long long)calls, pbox, (double)bytes / 1e9 / pbox, ceil / pbox,
               pbox / best, (unsigned long long)count_wrong(&S, 0));
    }
    fflush(stdout);
    lbench_job_free(&job);
    cudaStreamDestroy(s);
    rf_plan_free(pl);
    setup_free(&S);
}

static int local_main(int argc, char **argv)
{
    int want = argc > 2 ? atoi(argv[2]) : 1, ndev = 0;
    const char *which = argc > 3 ? argv[3] : "all";
    /* Each model plain, then with weights the trainer holds transposed (o_proj as the issue
     * measured; every expert weight, as GroupedMLP keeps them). */
    static const struct {
        const char *model, *src, *dst, *transpose;
    } cases[] = {
        {"qwen3-30b-a3b", "tp=2,ep=2", "tp=4", NULL},
        {"qwen3-30b-a3b", "tp=2,ep=2", "tp=4", "mlp.experts."},
        {"qwen3-4b", "tp=2", "tp=4", NULL},
        {"qwen3-4b", "tp=2", "tp=4", "o_proj"},
    };

    if (!rf_cuda_available() || cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < want ||
        want < 1 || want > 2) {
        printf("skipped: bench_gpu local %d needs %d CUDA device(s)\n", want, want);
        return 0;
    }
    local_threshold();
    printf("\n(d) same-host refit through the local transport (engine buffers on GPU 0, trainer "
           "shards on GPU %d); ceiling = cudaMemcpy of the same bytes on GPU 0; warm = mean/best "
           "of 5, verify off; ver_s = a warm refit with verify = sample\n", want - 1);
    printf("%-14s %-10s %-5s %4s %9s %8s %7s %8s %8s %8s %7s %6s %8s %9s %8s %6s %7s %s\n",
           "model", "trainer", "engine", "gpus", "GB", "msgs", "ceil_s", "cold_s", "warm_s",
           "best_s", "GB/s", "xceil", "ver_s", "devMiB", "usedMiB", "allocs", "digests",
           "#wrong");
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        if (strcmp(which, "all") != 0 && strstr(cases[c].model, which) == NULL)
            continue;
        local_case(cases[c].model, cases[c].src, cases[c].dst, want - 1, cases[c].transpose);
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *stag = argc > 1 ? argv[1] : "2048";
    const char *which = argc > 2 ? argv[2] : "all";
    bool sweep = argc > 3 && strcmp(argv[3], "sweep") == 0;
    const char *directs = argc > 4 ? argv[4] : "4";
    static const tuning defaults[] = {{"default", {0, 0, 0}}};
    static const tuning sweeps[] = {
        {"default", {0, 0, 0}},
        {"window=2", {0, 2, 0}},
        {"blocks=264", {264, 0, 0}},
        {"blocks=528", {528, 0, 0}},
        {"wire only (diag)", {0, 0, RF_XFER_NCCL_DIAG_NO_COPY}},
        {"copies only (diag)", {0, 0, RF_XFER_NCCL_DIAG_NO_WIRE}},
    };
#define NSWEEP ((int)(sizeof(sweeps) / sizeof(sweeps[0])))
    static const struct {
        const char *model, *src, *dst;
    } cases[] = {
        {"qwen3-30b-a3b", "tp=2,ep=4", "tp=4"},
        {"qwen3-4b", "tp=2,dp=2", "tp=4"},
    };
    int ndev = 0, devs[2] = {0, 1}, lvl;
    p2p p;
    double ceiling;

    /* BENCH_LOG=debug shows the transports' own accounts (the local GPU job's batches). */
    if (getenv("BENCH_LOG") && rf_log_level_parse(getenv("BENCH_LOG"), &lvl) == 0)
        rf_log_set_level(lvl);
    if (argc > 1 && strcmp(argv[1], "local") == 0)
        return local_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "ipc-alloc") == 0)
        return ipc_alloc_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "local-host") == 0)
        return local_host(argc > 2 ? argv[2] : "1,0");
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    if (!rf_cuda_available() || cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 2) {
        printf("skipped: no CUDA device (bench_gpu needs 2 GPUs)\n");
        return 0;
    }
    NK(ncclCommInitAll(p.comm, 2, devs));
    for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaStreamCreateWithFlags(&p.s[g], cudaStreamNonBlocking));
    }
    ceiling = p2p_ceiling(&p, GIB, 20);
    printf("(a) NCCL p2p GPU0->GPU1, 1 GiB messages, 20 iterations after 5 warm-up: %.1f GB/s\n\n",
           ceiling);
    printf("(b) refit through the nccl transport (trainer ranks on GPU 0, engine ranks on GPU 1; "
           "warm = mean/best of 3)\n");
    printf("%-14s %6s %6s %8s %9s %8s %8s %8s %7s %7s %9s %9s %9s %8s %s\n", "model",
           "stgMiB", "rounds", "msgs", "GB", "cold_s", "warm_s", "best_s", "GB/s", "%p2p",
           "packedGB", "stageGiB", "extraGiB", "#wrong", "tuning");
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        setup S;
        char list[256], *save = NULL;
        double conv, best = 0;

        if (strcmp(which, "all") != 0 && strstr(cases[c].model, which) == NULL)
            continue;
        setup_open(&S, cases[c].model, cases[c].src, cases[c].dst);
        setup_alloc(&S);
        fill_sources(&S);
        snprintf(list, sizeof(list), "%s", stag);
        for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        {
            char dl[256], *dsave = NULL;

            snprintf(dl, sizeof(dl), "%s", directs);
            for (char *dt = strtok_r(dl, ",", &dsave); dt; dt = strtok_r(NULL, ",", &dsave)) {
                uint64_t sm = strtoull(tok, NULL, 10), dm = strtoull(dt, NULL, 10);
                double b = sweep ? refit_bench(&S, sm, dm, ceiling, 3, sweeps, NSWEEP)
                                 : refit_bench(&S, sm, dm, ceiling, 3, defaults, 1);

                if (best == 0 || b < best)
                    best = b;
            }
        }
        conv = conventional(&S, &p);
        printf("(c) %s conventional (per-tensor broadcast of %u tensors + slicing): %.3f s, "
               "%.2f GB/s of engine bytes, %.1fx the best refit above, #wrong %llu\n", S.name,
               S.ntensors, conv, (double)S.dst_bytes / 1e9 / conv, conv / best,
               (unsigned long long)count_wrong(&S, 1));
        fflush(stdout);
        setup_free(&S);
    }
    for (int g = 0; g < 2; g++)
        ncclCommDestroy(p.comm[g]);
    return 0;
}

#else
int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "local-host") == 0)
        return local_host(argc > 2 ? argv[2] : "1,0");
    printf("skipped: no CUDA device (built without CUDA)\n");
    return 0;
}
#endif
