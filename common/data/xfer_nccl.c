/* common/data/xfer_nccl.c - the nccl transport: moves a job's messages between the cluster's GPU
 * endpoints with NCCL send/recv, one group per round over every local GPU, packed messages
 * gathered into device staging and scattered with the copy kernels; up to SLOTS rounds
 * enqueued at once (two when relays' end-to-end terms are read on the host), over two staging
 * halves; verified messages digested by the wdigest kernel on their GPU. FP8: the sender
 * quantizes bf16/fp16/fp32 boxes into staging with the batch quantizer (rf_quant_cuda, the
 * payload laid out as rf_qcopy_pack lays it), so half the bytes go on the wire; FP8 pieces
 * (a trainer's, an engine's) are gathered and scattered as two copies, elements and scales. */
#define RF_LOG_MODULE "xfer_nccl"
#include "xfer_core.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "copy.h"
#include "copy_cuda.h"
#include "drv_cuda.h"
#include "log.h"
#include "macros.h"
#include "mem_cuda.h"
#include "qcopy.h"
#include "quant_cuda.h"
#include "wdigest_cuda.h"

/* NCCL's error domain, wrapped once: the call, where, NCCL's code and its last message. */
static int nccl_fail(rf_err *err, ncclResult_t r, ncclComm_t comm, const char *call,
                     const char *file, int line)
{
    const char *last = ncclGetLastError(comm);

    RF_ERROR("%s:%d: %s: %s (%s)", file, line, call, ncclGetErrorString(r),
             last && last[0] ? last : "no detail");
    return rf_err_set(err, r == ncclSystemError || r == ncclRemoteError ? -EIO :
                           r == ncclInvalidArgument || r == ncclInvalidUsage ? -EINVAL : -EPROTO,
                      "%s failed: %s (%s)", call, ncclGetErrorString(r),
                      last && last[0] ? last : "no detail");
}

/* Sets rc and jumps to out: on failure; ncclInProgress is the normal answer of a
 * non-blocking communicator and is waited for by the caller. */
#define NCCL_TRY(err, comm, call)                                                     \
    do {                                                                              \
        ncclResult_t r_ = (call);                                                     \
        if (r_ != ncclSuccess && r_ != ncclInProgress) {                              \
            rc = nccl_fail((err), r_, (comm), #call, __FILE__, __LINE__);             \
            goto out;                                                                 \
        }                                                                             \
    } while (0)

/* Staging offsets are aligned so that the copy kernels' wide accesses and NCCL's own stay
 * aligned whatever the sizes of the messages before. */
#define STAGE_ALIGN 256u
/* Relays' end-to-end terms copy GPU payloads to the host in pieces of this size. */
#define VERIFY_CHUNK (16u << 20)
/* How long the worker sleeps between completion polls. */
#define POLL_NS 20000L
/* Rounds that may be enqueued at once: their events and descriptor buffers form a ring. Two
 * staging halves are shared by them; the streams wait on events for a half to be free, so the
 * host is never between one round's end and the next's start. */
#define SLOTS 4

/* One local GPU endpoint: its communicator, streams (gather, wire, scatter), the events of
 * the round slots and its staging. */
typedef struct gpu {
    uint32_t rank;
    int dev;
    ncclComm_t comm;
    bool res_ready; /* streams and events made */
    cudaStream_t s_pack, s_net, s_unpack;
    cudaEvent_t ev_packed[SLOTS], ev_net[SLOTS], ev_done[SLOTS];
    /* Descriptor buffers per direction and round slot: a buffer waits for its previous
     * batch, which for these is a round already retired, never the one on the wire. */
    rf_copy_cuda_buf *gbuf[SLOTS], *sbuf[SLOTS];
    uint8_t *arena;
    uint64_t arena_cap;
    uint64_t need; /* this job's staging on this GPU */
} gpu;

/* One job's plan of execution, owned by the worker. It outlives the job when the job has a
 * plan_key: the next job with the same key, budget and world reuses it (a 30b-class job has
 * ~10^5 items, whose descriptors take tens of milliseconds to build). */
typedef struct jstate {
    const rf_xfer_job *job;
    uint64_t key, staging_bytes, world_gen;
    uint32_t nl;            /* local GPUs */
    uint32_t *mgpu;         /* per message: local GPU index */
    uint64_t *moff;         /* per message: staging offset (packed) */
    uint32_t *round_first;  /* nrounds + 1 */
    uint64_t *rbytes;       /* [round * nl + g]: padded packed bytes */
    bool *pair_ok;          /* round r and r + 1 may be in flight together */
    rf_copy_desc *desc;     /* every packed item, gathers and scatters */
    uint64_t *gfirst, *sfirst; /* [round * nl + g]: ranges into desc, */
    uint64_t *gn, *sn;         /* of these many */
    /* FP8 quantized on this side, per GPU: one matrix per op in round order, uploaded once
     * the GPU's staging is known (the ops write into it) and again if it moves. */
    uint64_t *qfirst, *qcount; /* [round * nl + g]: ranges into the GPU's plan */
    uint64_t *qn;              /* per GPU: matrices */
    rf_quant_cuda_plan **qplan;
    uint8_t **qarena;          /* per GPU: the staging its plan writes into */
    struct qfix **qfix;        /* per GPU: scales that go through qscratch, */
    uint64_t *nqfix;           /* so many */
    uint8_t **qscratch;        /* per GPU: device memory, or NULL */
    uint8_t *bounce;        /* host memory for relays' end-to-end terms */
    /* Message digests on the GPUs (verify on): per GPU a plan whose segment and accumulator j
     * is its j-th verified message in round order, sends before receives in each round, over
     * the staging it was built for; dverify and dseed are what it was built under. */
    rf_wdigest_cuda_plan **dplan;
    uint8_t **darena;
    uint32_t *dacc;            /* per message: its accumulator on its GPU */
    uint32_t *dfirst, *dsn, *drn; /* [round * nl + g]: sends' range, then receives' */
    bool dbuilt;
    int dverify;
    uint8_t dseed[RF_XFER_DIGEST_SEED_BYTES];
} jstate;

/* An FP8 item whose scales lie where the payload cannot take the quantizer's aligned scale
 * writes (fp32 scales after an item of an odd number of 16-bit elements): the quantizer
 * writes them into the GPU's scratch and a copy puts them in the payload, in their round. */
typedef struct qfix {
    uint32_t round;
    uint8_t *from, *to;
    uint64_t bytes;
} qfix;

typedef struct nccl {
    rf_xfer_core base;

    /* The world set last, and whether the communicators in g belong to it. */
    bool have_world, comms_up, stale;
    uint32_t nranks, nlocal;
    gpu *g;
    uint8_t uid[RF_XFER_NCCL_ID_BYTES];
    uint8_t dead_uid[RF_XFER_NCCL_ID_BYTES]; /* the id of the last world torn down: never
                                                reused */
    bool have_dead_uid;
    /* A new world was set while communicators of the old one live: the worker replaces them. */
    bool rebuild;
    gpu *old_g;
    uint32_t old_nlocal;

    jstate js;
    /* The running job's rounds: [lo, hi) enqueued and not retired, at most window of them. */
    uint32_t lo, hi, window;
    /* The job both sends and receives (a relay, plan.h's ordering rule): a GPU's sends of
     * round r wait on the GPU for its round r - 1 to end, scatter included. */
    bool relay_order;
    /* Relays' end-to-end terms are read from a retired round's staging on the host. */
    bool host_e2e;
    /* The running job digests its messages (js.dplan may be kept from a job that did). */
    bool digesting;
    _Atomic uint64_t mem_now, mem_peak;
    rf_xfer_nccl_tuning tune; /* read by the worker; changed only while none runs */
    uint64_t world_gen;       /* bumped by set_world: a kept jstate of another world is void */
} nccl;

/* A backend's failures are the core's: the first one is the job's. */
#define fail(t, ...) rf_xfer__fail(&(t)->base, __VA_ARGS__)

static void nap(void)
{
    struct timespec ts = {0, POLL_NS};

    nanosleep(&ts, NULL);
}

static void mem_add(nccl *t, int64_t delta)
{
    uint64_t now = atomic_fetch_add(&t->mem_now, (uint64_t)delta) + (uint64_t)delta;
    uint64_t peak = atomic_load(&t->mem_peak);

    while (now > peak && !atomic_compare_exchange_weak(&t->mem_peak, &peak, now))
        ;
}

/* ---- communicators and per-GPU resources (worker thread) ---- */

/* Communicators are aborted rather than finalized: a peer may be gone, and aborting is
 * local and bounded. */
static void gpu_release(nccl *t, gpu *g)
{
    if (g->comm) {
        cudaSetDevice(g->dev);
        ncclCommAbort(g->comm);
        g->comm = NULL;
    }
    if (g->res_ready) {
        cudaSetDevice(g->dev);
        cudaStreamSynchronize(g->s_pack);
        cudaStreamSynchronize(g->s_net);
        cudaStreamSynchronize(g->s_unpack);
        for (int h = 0; h < SLOTS; h++) {
            cudaEventDestroy(g->ev_packed[h]);
            cudaEventDestroy(g->ev_net[h]);
            cudaEventDestroy(g->ev_done[h]);
        }
        cudaStreamDestroy(g->s_pack);
        cudaStreamDestroy(g->s_net);
        cudaStreamDestroy(g->s_unpack);
        for (int h = 0; h < SLOTS; h++) {
            rf_copy_cuda_buf_free(g->gbuf[h]);
            rf_copy_cuda_buf_free(g->sbuf[h]);
            g->gbuf[h] = g->sbuf[h] = NULL;
        }
        g->res_ready = false;
    }
    if (g->arena) {
        cudaSetDevice(g->dev);
        cudaFree(g->arena);
        mem_add(t, -(int64_t)g->arena_cap);
        g->arena = NULL;
        g->arena_cap = 0;
    }
}

/* Tears the communicators down after a failure: aborting stops kernels stuck on a peer that
 * will never answer; the unique id of that world is spent. */
static void world_abort(nccl *t)
{
    for (uint32_t i = 0; i < t->nlocal; i++) {
        gpu *g = &t->g[i];

        if (g->comm) {
            cudaSetDevice(g->dev);
            ncclCommAbort(g->comm);
            g->comm = NULL;
        }
        if (g->res_ready) {
            cudaStreamSynchronize(g->s_pack);
            cudaStreamSynchronize(g->s_net);
            cudaStreamSynchronize(g->s_unpack);
        }
    }
    if (t->comms_up || t->have_world) {
        memcpy(t->dead_uid, t->uid, sizeof(t->uid));
        t->have_dead_uid = true;
    }
    t->comms_up = false;
    t->stale = true;
}

static int gpu_resources(nccl *t, gpu *g)
{
    rf_err err = {0};
    int rc = 0, lowest = 0, highest = 0;

    if (g->res_ready)
        return 0;
    CUDA_TRY(&err, cudaSetDevice(g->dev));
    CUDA_TRY(&err, cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    /* The wire first: NCCL's blocks are scheduled ahead of the copy kernels' waiting ones,
     * so packing the next round does not hold the current one off the SMs. */
    CUDA_TRY(&err, cudaStreamCreateWithPriority(&g->s_pack, cudaStreamNonBlocking, lowest));
    CUDA_TRY(&err, cudaStreamCreateWithPriority(&g->s_net, cudaStreamNonBlocking, highest));
    CUDA_TRY(&err, cudaStreamCreateWithPriority(&g->s_unpack, cudaStreamNonBlocking, lowest));
    for (int h = 0; h < SLOTS; h++) {
        CUDA_TRY(&err, cudaEventCreateWithFlags(&g->ev_packed[h], cudaEventDisableTiming));
        CUDA_TRY(&err, cudaEventCreateWithFlags(&g->ev_net[h], cudaEventDisableTiming));
        CUDA_TRY(&err, cudaEventCreateWithFlags(&g->ev_done[h], cudaEventDisableTiming));
        if ((rc = rf_copy_cuda_buf_new(&g->gbuf[h], &err)) < 0 ||
            (rc = rf_copy_cuda_buf_new(&g->sbuf[h], &err)) < 0)
            goto out;
    }
    g->res_ready = true;
out:
    if (rc < 0)
        fail(t, rc, "preparing GPU %d (rank %u): %s", g->dev, g->rank, err.msg);
    return rc;
}

/* Creates the communicators of every local GPU in one group and waits, against the job's
 * deadline and aborts, until NCCL says they are up (all ranks of the world must join). */
static int world_up(nccl *t)
{
    ncclUniqueId id;
    rf_err err = {0};
    int rc = 0, ndev = 0;
    uint32_t i;

    if (t->rebuild) {
        for (i = 0; i < t->old_nlocal; i++)
            gpu_release(t, &t->old_g[i]);
        free(t->old_g);
        t->old_g = NULL;
        t->old_nlocal = 0;
        t->rebuild = false;
    }
    if (t->comms_up)
        return 0;
    CUDA_TRY(&err, cudaGetDeviceCount(&ndev));
    for (i = 0; i < t->nlocal; i++) {
        if (t->g[i].dev < 0 || t->g[i].dev >= ndev)
            return fail(t, -ENODEV, "the world puts rank %u on CUDA device %d, this machine "
                        "has %d; fix the daemon's GPU list", t->g[i].rank, t->g[i].dev, ndev);
        if ((rc = gpu_resources(t, &t->g[i])) < 0)
            return rc;
    }
    memcpy(id.internal, t->uid, sizeof(id.internal));
    NCCL_TRY(&err, NULL, ncclGroupStart());
    for (i = 0; i < t->nlocal; i++) {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;

        cfg.blocking = 0;
        CUDA_TRY(&err, cudaSetDevice(t->g[i].dev));
        NCCL_TRY(&err, NULL, ncclCommInitRankConfig(&t->g[i].comm, (int)t->nranks, id,
                                                    (int)t->g[i].rank, &cfg));
    }
    NCCL_TRY(&err, NULL, ncclGroupEnd());
    for (;;) {
        bool pending = false;

        for (i = 0; i < t->nlocal; i++) {
            ncclResult_t st = ncclSuccess;

            if (!t->g[i].comm)
                continue;
            NCCL_TRY(&err, t->g[i].comm, ncclCommGetAsyncError(t->g[i].comm, &st));
            if (st == ncclInProgress) {
                pending = true;
            } else if (st != ncclSuccess) {
                rc = nccl_fail(&err, st, t->g[i].comm, "ncclCommInitRankConfig", __FILE__,
                               __LINE__);
                goto out;
            }
        }
        if (!pending)
            break;
        rc = rf_xfer__stop(&t->base);
        if (rc == -ECANCELED) {
            rf_err_set(&err, rc, "aborted while the %u ranks were joining", t->nranks);
            goto out;
        }
        if (rc == -ETIMEDOUT) {
            rf_err_set(&err, rc, "the deadline passed before all %u ranks joined; a daemon of "
                       "the world is missing or got another id", t->nranks);
            goto out;
        }
        nap();
    }
    t->comms_up = true;
out:
    if (rc < 0)
        fail(t, rc, "setting up the NCCL world (%u ranks, local rank %u): %s", t->nranks,
             t->nlocal ? t->g[0].rank : 0, err.msg);
    return rc;
}

/* ---- the job's plan of execution ---- */

static void js_free(jstate *s)
{
    for (uint32_t g = 0; s->dplan && g < s->nl; g++)
        rf_wdigest_cuda_plan_free(s->dplan[g]);
    free(s->dplan);
    free(s->darena);
    free(s->dacc);
    free(s->dfirst);
    free(s->dsn);
    free(s->drn);
    for (uint32_t g = 0; s->qplan && g < s->nl; g++)
        rf_quant_cuda_plan_free(s->qplan[g]);
    free(s->qplan);
    free(s->qarena);
    for (uint32_t g = 0; s->qscratch && g < s->nl; g++)
        cudaFree(s->qscratch[g]);
    for (uint32_t g = 0; s->qfix && g < s->nl; g++)
        free(s->qfix[g]);
    free(s->qscratch);
    free(s->qfix);
    free(s->nqfix);
    free(s->qfirst);
    free(s->qcount);
    free(s->qn);
    free(s->gn);
    free(s->sn);
    free(s->mgpu);
    free(s->moff);
    free(s->round_first);
    free(s->rbytes);
    free(s->pair_ok);
    free(s->desc);
    free(s->gfirst);
    free(s->sfirst);
    free(s->bounce);
    memset(s, 0, sizeof(*s));
}

static uint64_t align_up(uint64_t v)
{
    return (v + STAGE_ALIGN - 1) & ~(uint64_t)(STAGE_ALIGN - 1);
}

static int local_index(const nccl *t, uint32_t rank)
{
    for (uint32_t i = 0; i < t->nlocal; i++)
        if (t->g[i].rank == rank)
            return (int)i;
    return -1;
}

/* The matrices the sender quantizes of item it into staging (0: none): an FP8 transfer
 * whose source is not itself an FP8 piece. */
static uint64_t quant_matrices(const rf_xfer_item *it, bool send)
{
    return send && it->quant.q.kind != 0 && it->piece.quant == 0
               ? rf_qcopy_nmatrices(&it->box, (int)it->ndim) : 0;
}

/* Item it of a packed message at staging offset moff, as copies between its memory and
 * staging: one descriptor, or an FP8 piece's two (elements, then scales: the receiver's, or
 * a sender's FP8 source), or none where the sender quantizes it (quant_plans, in
 * rf_qcopy_pack's layout). Returns how many; d may be NULL. */
static uint32_t descs_of(rf_copy_desc *d, const rf_xfer_item *it, bool send, uint64_t moff)
{
    uint64_t fp8;

    if (it->quant.q.kind == 0) {
        if (d)
            rf_copy_desc_set(d, it->base, &it->piece, it->ndim, it->esize, &it->box,
                             moff + it->msg_off);
        return 1;
    }
    if (quant_matrices(it, send) > 0)
        return 0;
    if (d) {
        rf_qcopy_bytes(&it->quant.q, it->ndim, it->quant.rows, it->quant.cols, &it->box, &fp8);
        rf_qcopy_descs(it, &d[0], &d[1]);
        d[0].staging_off = moff + it->msg_off;
        d[1].staging_off = moff + it->msg_off + fp8;
    }
    return 2;
}

/* Where each message runs and lies in staging, the staging each GPU needs (the largest
 * round, or two neighbours that fit together in the budget), and every descriptor. */
static int js_init(nccl *t, const rf_xfer_job *job)
{
    jstate *s = &t->js;
    uint32_t nr = job->nrounds, nl = t->nlocal, n = job->nmsgs, i, r, g;
    uint64_t budget = job->staging_bytes / (nl ? nl : 1), nitems = 0, *cur = NULL;
    int rc = 0;

    memset(s, 0, sizeof(*s));
    s->job = job;
    s->key = job->plan_key;
    s->staging_bytes = job->staging_bytes;
    s->world_gen = t->world_gen;
    s->nl = nl;
    s->mgpu = calloc(n ? n : 1, sizeof(*s->mgpu));
    s->moff = calloc(n ? n : 1, sizeof(*s->moff));
    s->round_first = calloc(nr + 1, sizeof(*s->round_first));
    s->rbytes = calloc((size_t)(nr ? nr : 1) * nl, sizeof(*s->rbytes));
    s->pair_ok = calloc(nr ? nr : 1, sizeof(*s->pair_ok));
    s->gfirst = calloc((size_t)(nr ? nr : 1) * nl + 1, sizeof(*s->gfirst));
    s->sfirst = calloc((size_t)(nr ? nr : 1) * nl + 1, sizeof(*s->sfirst));
    s->gn = calloc((size_t)(nr ? nr : 1) * nl + 1, sizeof(*s->gn));
    s->sn = calloc((size_t)(nr ? nr : 1) * nl + 1, sizeof(*s->sn));
    s->qfirst = calloc((size_t)(nr ? nr : 1) * nl + 1, sizeof(*s->qfirst));
    s->qcount = calloc((size_t)(nr ? nr : 1) * nl + 1, sizeof(*s->qcount));
    s->qn = calloc(nl ? nl : 1, sizeof(*s->qn));
    s->qplan = calloc(nl ? nl : 1, sizeof(*s->qplan));
    s->qarena = calloc(nl ? nl : 1, sizeof(*s->qarena));
    s->qfix = calloc(nl ? nl : 1, sizeof(*s->qfix));
    s->nqfix = calloc(nl ? nl : 1, sizeof(*s->nqfix));
    s->qscratch = calloc(nl ? nl : 1, sizeof(*s->qscratch));
    cur = calloc(nl ? nl : 1, sizeof(*cur));
    if (!s->mgpu || !s->moff || !s->round_first || !s->rbytes || !s->pair_ok || !s->gfirst ||
        !s->sfirst || !s->gn || !s->sn || !s->qfirst || !s->qcount || !s->qn || !s->qplan ||
        !s->qarena || !s->qfix || !s->nqfix || !s->qscratch || !cur) {
        rc = fail(t, -ENOMEM, "out of memory for a job of %u messages", n);
        goto out;
    }
    for (i = 0; i < n; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        int li = local_index(t, m->ep);

        if (li < 0 || m->peer_ep >= t->nranks) {
            rc = fail(t, -EINVAL, "message seq %u goes from GPU rank %u to rank %u, but this "
                      "daemon drives no rank %u or the world has only %u ranks; the world and "
                      "the plan disagree", m->seq, m->ep, m->peer_ep,
                      li < 0 ? m->ep : m->peer_ep, t->nranks);
            goto out;
        }
        s->mgpu[i] = (uint32_t)li;
        s->round_first[m->round + 1] = i + 1;
        if (m->kind == RF_PLAN_PACKED) {
            s->rbytes[(size_t)m->round * nl + (uint32_t)li] += align_up(m->bytes);
            for (uint32_t k = 0; k < m->nitems; k++)
                nitems += descs_of(NULL, &m->items[k], m->send, 0);
        }
    }
    for (r = 1; r <= nr; r++)
        if (s->round_first[r] < s->round_first[r - 1])
            s->round_first[r] = s->round_first[r - 1];
    for (r = 0; r < nr; r++) {
        s->pair_ok[r] = r + 1 < nr;
        for (g = 0; g < nl && s->pair_ok[r]; g++)
            if (budget && s->rbytes[(size_t)r * nl + g] + s->rbytes[(size_t)(r + 1) * nl + g] >
                              budget)
                s->pair_ok[r] = false;
    }
    for (g = 0; g < nl; g++) {
        uint64_t need = 0;

        for (r = 0; r < nr; r++) {
            uint64_t b = s->rbytes[(size_t)r * nl + g] +
                         (s->pair_ok[r] ? s->rbytes[(size_t)(r + 1) * nl + g] : 0);

            if (b > need)
                need = b;
        }
        t->g[g].need = need;
    }
    /* Even rounds at the start of a GPU's staging, odd ones at its end: two rounds in flight
     * never overlap. */
    for (r = 0; r < nr; r++) {
        for (g = 0; g < nl; g++)
            cur[g] = r & 1 ? t->g[g].need - s->rbytes[(size_t)r * nl + g] : 0;
        for (i = s->round_first[r]; i < s->round_first[r + 1]; i++) {
            const rf_xfer_msg *m = &job->msgs[i];

            if (m->kind != RF_PLAN_PACKED)
                continue;
            s->moff[i] = cur[s->mgpu[i]];
            cur[s->mgpu[i]] += align_up(m->bytes);
        }
    }
    s->desc = malloc((nitems ? nitems : 1) * sizeof(*s->desc));
    if (!s->desc) {
        rc = fail(t, -ENOMEM, "out of memory for %llu copy descriptors",
                  (unsigned long long)nitems);
        goto out;
    }
    nitems = 0;
    for (r = 0; r < nr; r++) {
        for (g = 0; g < nl; g++) {
            size_t x = (size_t)r * nl + g;

            s->qfirst[x] = s->qn[g];
            for (int dir = 1; dir >= 0; dir--) {
                uint64_t *first = dir ? s->gfirst : s->sfirst, *cnt = dir ? s->gn : s->sn;

                first[x] = nitems;
                for (i = s->round_first[r]; i < s->round_first[r + 1]; i++) {
                    const rf_xfer_msg *m = &job->msgs[i];

                    if (m->kind != RF_PLAN_PACKED || s->mgpu[i] != g || m->send != (dir == 1))
                        continue;
                    for (uint32_t k = 0; k < m->nitems; k++) {
                        nitems += descs_of(&s->desc[nitems], &m->items[k], m->send,
                                           s->moff[i]);
                        s->qn[g] += quant_matrices(&m->items[k], m->send);
                    }
                }
                cnt[x] = nitems - first[x];
            }
            s->qcount[x] = s->qn[g] - s->qfirst[x];
        }
    }
out:
    free(cur);
    return rc;
}

/* The kept plan of execution when it fits this job, else a new one; and the verification
 * buffer when the job verifies. */
static int js_prepare(nccl *t, const rf_xfer_job *job)
{
    jstate *s = &t->js;
    int rc;

    if (s->key != 0 && s->key == job->plan_key && s->staging_bytes == job->staging_bytes &&
        s->world_gen == t->world_gen && s->nl == t->nlocal) {
        s->job = job;
    } else {
        js_free(s);
        if ((rc = js_init(t, job)) < 0)
            return rc;
    }
    if (t->host_e2e && !s->bounce && !(s->bounce = malloc(VERIFY_CHUNK)))
        return fail(t, -ENOMEM, "out of memory for the verification buffer");
    return 0;
}

/* The descriptors of one round's gathers or scatters on one GPU. */
static void range_of(const jstate *s, bool gather, uint32_t r, uint32_t g, uint64_t *a,
                     uint64_t *n)
{
    size_t x = (size_t)r * s->nl + g;

    *a = gather ? s->gfirst[x] : s->sfirst[x];
    *n = gather ? s->gn[x] : s->sn[x];
}

/* Where the scales of FP8 send item it of message i lie in GPU g's staging (*to), their bytes
 * (*bytes), and whether the quantizer can write them there (aligned to a scale). */
static bool scales_at(const nccl *t, uint32_t g, uint32_t i, const rf_xfer_item *it, uint8_t **to,
                      uint64_t *bytes)
{
    const rf_xfer_quant *x = &it->quant;
    rf_quant_fmt f = {x->q.kind, x->q.br, x->q.bc};
    uint64_t fp8;

    rf_qcopy_bytes(&x->q, it->ndim, x->rows, x->cols, &it->box, &fp8);
    *to = t->g[g].arena + t->js.moff[i] + it->msg_off + fp8;
    *bytes = it->bytes - fp8;
    return (uintptr_t)*to % rf_dtype_size(rf_quant_scale_dtype(&f)) == 0;
}

/* The FP8 matrices each GPU quantizes into its staging, uploaded as one plan per GPU in
 * js_init's order (round by round), where none is or its staging moved; scales the payload
 * cannot take in place go through the GPU's scratch (qfix). */
static int quant_plans(nccl *t)
{
    jstate *s = &t->js;
    const rf_xfer_job *job = s->job;
    rf_quant_cuda_op *ops = NULL;
    rf_err err = {0};
    int rc = 0;

    for (uint32_t g = 0; g < s->nl; g++) {
        gpu *G = &t->g[g];
        uint64_t n = 0, need = 0, nfix = 0;

        if (s->qn[g] == 0 || (s->qplan[g] && s->qarena[g] == G->arena))
            continue;
        CUDA_TRY(&err, cudaSetDevice(G->dev));
        rf_quant_cuda_plan_free(s->qplan[g]);
        s->qplan[g] = NULL;
        cudaFree(s->qscratch[g]);
        s->qscratch[g] = NULL;
        free(s->qfix[g]);
        s->qfix[g] = NULL;
        s->nqfix[g] = 0;
        /* The scratch: every misplaced item's scales, 16-byte aligned each. */
        for (uint32_t i = 0; i < job->nmsgs; i++) {
            const rf_xfer_msg *m = &job->msgs[i];

            if (m->kind != RF_PLAN_PACKED || s->mgpu[i] != g || !m->send)
                continue;
            for (uint32_t k = 0; k < m->nitems; k++) {
                uint8_t *to;
                uint64_t bytes;

                if (quant_matrices(&m->items[k], true) > 0 &&
                    !scales_at(t, g, i, &m->items[k], &to, &bytes)) {
                    need += (bytes + 15) & ~(uint64_t)15;
                    nfix++;
                }
            }
        }
        ops = malloc(s->qn[g] * sizeof(*ops));
        s->qfix[g] = malloc((nfix ? nfix : 1) * sizeof(qfix));
        if (!ops || !s->qfix[g]) {
            rc = rf_err_set(&err, -ENOMEM, "out of memory for %llu FP8 matrices",
                            (unsigned long long)s->qn[g]);
            goto out;
        }
        if (need > 0)
            CUDA_TRY(&err, cudaMalloc((void **)&s->qscratch[g], need));
        need = 0;
        for (uint32_t i = 0; i < job->nmsgs; i++) {
            const rf_xfer_msg *m = &job->msgs[i];

            if (m->kind != RF_PLAN_PACKED || s->mgpu[i] != g || !m->send)
                continue;
            for (uint32_t k = 0; k < m->nitems; k++) {
                const rf_xfer_item *it = &m->items[k];
                uint64_t nm = quant_matrices(it, true), bytes;
                int nd = (int)it->ndim;
                uint8_t *to, *from = NULL;

                if (nm == 0)
                    continue;
                if (!scales_at(t, g, i, it, &to, &bytes)) {
                    from = s->qscratch[g] + need;
                    s->qfix[g][s->nqfix[g]++] = (qfix){m->round, from, to, bytes};
                    need += (bytes + 15) & ~(uint64_t)15;
                }
                for (uint64_t l = 0; l < nm; l++) {
                    rf_qcopy_matrix mx;

                    rf_qcopy_pack_matrix(it, l, G->arena + s->moff[i] + it->msg_off, &mx);
                    ops[n++] = (rf_quant_cuda_op){
                        .fmt = {it->quant.q.kind, it->quant.q.br, it->quant.q.bc},
                        .dt = it->quant.dt, .src = mx.src, .src_row_stride = mx.src_row_stride,
                        .rows = (uint64_t)it->box.extent[nd - 2],
                        .cols = (uint64_t)it->box.extent[nd - 1], .q = mx.q,
                        .q_row_stride = mx.q_row_stride,
                        .scales = from ? from + (mx.scales - to) : mx.scales,
                        .scale_row_stride = mx.scale_row_stride};
                }
            }
        }
        assert(n == s->qn[g] && s->nqfix[g] == nfix);
        if ((rc = rf_quant_cuda_plan_new(ops, n, &s->qplan[g], &err)) < 0)
            goto out;
        s->qarena[g] = G->arena;
        free(ops);
        ops = NULL;
    }
out:
    free(ops);
    if (rc < 0)
        fail(t, rc, "planning the FP8 quantization into staging: %s", err.msg);
    return rc;
}

/* The message digests' plans (verify on): one segment per verified message, its payload in
 * staging or, direct, in client memory; made again when the verify setting, the seed or a GPU's
 * staging changed. */
static int digest_plans(nccl *t)
{
    jstate *s = &t->js;
    const rf_xfer_job *job = s->job;
    uint32_t nr = job->nrounds, nl = s->nl, n = job->nmsgs;
    rf_wdigest_seg *segs = NULL;
    rf_wdigest_key key;
    rf_err err = {0};
    int rc = 0;

    if (job->verify == RF_VERIFY_OFF)
        return 0;
    if (s->dbuilt && s->dverify == job->verify &&
        memcmp(s->dseed, job->digest_seed, sizeof(s->dseed)) == 0) {
        bool moved = false;

        for (uint32_t g = 0; g < nl; g++)
            moved |= s->darena[g] != t->g[g].arena;
        if (!moved)
            return 0;
    }
    for (uint32_t g = 0; s->dplan && g < nl; g++) {
        cudaSetDevice(t->g[g].dev);
        rf_wdigest_cuda_plan_free(s->dplan[g]);
        s->dplan[g] = NULL;
    }
    s->dbuilt = false;
    if (!s->dplan) {
        s->dplan = calloc(nl ? nl : 1, sizeof(*s->dplan));
        s->darena = calloc(nl ? nl : 1, sizeof(*s->darena));
        s->dacc = calloc(n ? n : 1, sizeof(*s->dacc));
        s->dfirst = calloc((size_t)(nr ? nr : 1) * nl, sizeof(*s->dfirst));
        s->dsn = calloc((size_t)(nr ? nr : 1) * nl, sizeof(*s->dsn));
        s->drn = calloc((size_t)(nr ? nr : 1) * nl, sizeof(*s->drn));
    }
    segs = malloc((n ? n : 1) * sizeof(*segs));
    if (!s->dplan || !s->darena || !s->dacc || !s->dfirst || !s->dsn || !s->drn || !segs) {
        rc = rf_err_set(&err, -ENOMEM, "out of memory for the digests of %u messages", n);
        goto out;
    }
    rf_wdigest_key_derive(job->digest_seed, &key);
    for (uint32_t g = 0; g < nl; g++) {
        gpu *G = &t->g[g];
        uint32_t j = 0;

        for (uint32_t r = 0; r < nr; r++) {
            size_t x = (size_t)r * nl + g;

            s->dfirst[x] = j;
            for (int dir = 1; dir >= 0; dir--) {
                for (uint32_t i = s->round_first[r]; i < s->round_first[r + 1]; i++) {
                    const rf_xfer_msg *m = &job->msgs[i];
                    uint64_t db = rf_xfer_msg_digest_bytes(job, m);

                    if (s->mgpu[i] != g || m->send != (dir == 1) ||
                        !rf_xfer_msg_verified(job, m))
                        continue;
                    rf_wdigest_seg_walk(&segs[j], m->kind == RF_PLAN_PACKED
                                                      ? G->arena + s->moff[i]
                                                      : rf_xfer_direct_ptr(m),
                                        0, db, db ? db : 1, 0, NULL, NULL, j);
                    s->dacc[i] = j++;
                }
                if (dir == 1)
                    s->dsn[x] = j - s->dfirst[x];
                else
                    s->drn[x] = j - s->dfirst[x] - s->dsn[x];
            }
        }
        s->darena[g] = G->arena;
        if (j == 0)
            continue;
        CUDA_TRY(&err, cudaSetDevice(G->dev));
        if ((rc = rf_wdigest_cuda_plan_new(&key, segs, j, j, &s->dplan[g], &err)) < 0)
            goto out;
    }
    s->dbuilt = true;
    s->dverify = job->verify;
    memcpy(s->dseed, job->digest_seed, sizeof(s->dseed));
out:
    sodium_memzero(&key, sizeof(key));
    free(segs);
    if (rc < 0)
        fail(t, rc, "planning the digests of verified messages on the GPUs: %s", err.msg);
    return rc;
}

/* Enqueues on stream st the digests of accumulators [a, a + n) of GPU g's plan: zeroed,
 * digested, copied to the host for retire_round. */
static int digest_range(nccl *t, uint32_t g, uint32_t a, uint32_t n, cudaStream_t st,
                        rf_err *err)
{
    rf_wdigest_cuda_plan *pl = t->js.dplan ? t->js.dplan[g] : NULL;
    int rc;

    if (!pl || n == 0)
        return 0;
    if ((rc = rf_wdigest_cuda_zero(pl, a, n, st, err)) < 0 ||
        (rc = rf_wdigest_cuda_run(pl, a, n, st, err)) < 0 ||
        (rc = rf_wdigest_cuda_fetch(pl, a, n, st, err)) < 0)
        return rc;
    return 0;
}

static int arenas_reserve(nccl *t)
{
    rf_err err = {0};
    int rc = 0;

    for (uint32_t g = 0; g < t->nlocal; g++) {
        gpu *G = &t->g[g];

        if (G->arena_cap >= G->need)
            continue;
        CUDA_TRY(&err, cudaSetDevice(G->dev));
        if (G->arena) {
            cudaFree(G->arena);
            mem_add(t, -(int64_t)G->arena_cap);
            G->arena = NULL;
            G->arena_cap = 0;
        }
        CUDA_TRY(&err, cudaMalloc((void **)&G->arena, G->need));
        G->arena_cap = G->need;
        mem_add(t, (int64_t)G->need);
    }
out:
    if (rc < 0)
        fail(t, rc, "allocating staging on the local GPUs: %s; lower the staging budget",
             err.msg);
    return rc;
}

/* ---- rounds ---- */

static void describe_round(nccl *t, uint32_t r, char *buf, size_t len)
{
    const jstate *s = &t->js;
    const rf_xfer_job *job = s->job;
    uint32_t a = s->round_first[r], b = s->round_first[r + 1];

    if (a == b) {
        snprintf(buf, len, "round %u of %u (empty)", r, job->nrounds);
        return;
    }
    const rf_xfer_msg *m = &job->msgs[a];
    snprintf(buf, len, "round %u of %u unfinished (%u messages; first: seq %u, %llu bytes, "
             "%s peer %u (%s), GPU rank %u %s rank %u)", r, job->nrounds, b - a, m->seq,
             (unsigned long long)m->bytes, m->send ? "to" : "from", m->peer,
             rf_xfer__peer_addr(&t->base, m->peer), m->ep, m->send ? "->" : "<-", m->peer_ep);
}

/* Waits for a non-blocking communicator call to be enqueued. */
static int wait_enqueued(nccl *t, uint32_t r)
{
    rf_err err = {0};
    char what[300];
    int rc = 0;

    for (;;) {
        bool pending = false;

        for (uint32_t g = 0; g < t->nlocal; g++) {
            ncclResult_t st = ncclSuccess;

            NCCL_TRY(&err, t->g[g].comm, ncclCommGetAsyncError(t->g[g].comm, &st));
            if (st == ncclInProgress) {
                pending = true;
            } else if (st != ncclSuccess) {
                rc = nccl_fail(&err, st, t->g[g].comm, "ncclGroupEnd", __FILE__, __LINE__);
                goto out;
            }
        }
        if (!pending)
            return 0;
        if ((rc = rf_xfer__stop(&t->base)) < 0) {
            describe_round(t, r, what, sizeof(what));
            return fail(t, rc, "%s while NCCL enqueued %s",
                        rc == -ECANCELED ? "aborted" : "deadline passed", what);
        }
        nap();
    }
out:
    describe_round(t, r, what, sizeof(what));
    return fail(t, rc, "%s: %s", what, err.msg);
}

/* Whether local GPU g sends anything in round r. */
static bool round_sends(const nccl *t, uint32_t r, uint32_t g)
{
    const jstate *s = &t->js;

    for (uint32_t i = s->round_first[r]; i < s->round_first[r + 1]; i++)
        if (s->job->msgs[i].send && s->mgpu[i] == g)
            return true;
    return false;
}

/* Enqueues round r on every local GPU: gather, the group of sends and receives, scatter.
 * Its staging half was last used by round r - 2 (and by round r - 1 when the two do not fit
 * side by side): the gather stream waits for those rounds' last event on this GPU, which
 * follows their wire and scatter on it. */
static int enqueue_round(nccl *t, uint32_t r)
{
    jstate *s = &t->js;
    const rf_xfer_job *job = s->job;
    int h = (int)(r % SLOTS), rc = 0;
    rf_err err = {0};
    uint64_t a, n;
    uint32_t g, i;
    bool grouped = false;
    bool skip_copy = t->tune.diag & RF_XFER_NCCL_DIAG_NO_COPY;
    bool skip_net = t->tune.diag & RF_XFER_NCCL_DIAG_NO_WIRE;

    for (g = 0; g < t->nlocal; g++) {
        gpu *G = &t->g[g];

        CUDA_TRY(&err, cudaSetDevice(G->dev));
        if (r >= 2)
            CUDA_TRY(&err, cudaStreamWaitEvent(G->s_pack, G->ev_done[(r - 2) % SLOTS], 0));
        /* A relay sends in round r what this GPU received in earlier rounds: its gather and
         * wire (which waits for the gather's event) start once round r - 1's scatter, the
         * last of those writes (the streams run in order), has ended. */
        if (r >= 1 && (!s->pair_ok[r - 1] || (t->relay_order && round_sends(t, r, g))))
            CUDA_TRY(&err, cudaStreamWaitEvent(G->s_pack, G->ev_done[(r - 1) % SLOTS], 0));
        range_of(s, true, r, g, &a, &n);
        rf_copy_cuda_buf_set_blocks(G->gbuf[h], t->tune.copy_blocks);
        if (n > 0 && !skip_copy &&
            (rc = rf_copy_cuda_gather_buf(G->gbuf[h], &s->desc[a], n, G->arena, G->s_pack,
                                          &err)) < 0)
            goto out;
        n = s->qcount[(size_t)r * s->nl + g];
        if (n > 0 && !skip_copy &&
            (rc = rf_quant_cuda_plan_launch(s->qplan[g], s->qfirst[(size_t)r * s->nl + g], n,
                                            G->s_pack, &err)) < 0)
            goto out;
        for (uint64_t k = 0; n > 0 && !skip_copy && k < s->nqfix[g]; k++)
            if (s->qfix[g][k].round == r)
                CUDA_TRY(&err, cudaMemcpyAsync(s->qfix[g][k].to, s->qfix[g][k].from,
                                               s->qfix[g][k].bytes, cudaMemcpyDeviceToDevice,
                                               G->s_pack));
        /* The payloads sent are digested once gathered, before the wire: the round's end
         * (ev_done) then follows their digests too. */
        if (t->digesting && (rc = digest_range(t, g, s->dfirst[(size_t)r * s->nl + g],
                                           s->dsn[(size_t)r * s->nl + g], G->s_pack, &err)) < 0)
            goto out;
        CUDA_TRY(&err, cudaEventRecord(G->ev_packed[h], G->s_pack));
        CUDA_TRY(&err, cudaStreamWaitEvent(G->s_net, G->ev_packed[h], 0));
    }
    if (skip_net)
        goto scatter;
    NCCL_TRY(&err, NULL, ncclGroupStart());
    grouped = true;
    for (i = s->round_first[r]; i < s->round_first[r + 1]; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        gpu *G = &t->g[s->mgpu[i]];
        uint8_t *p = m->kind == RF_PLAN_PACKED ? G->arena + s->moff[i] : rf_xfer_direct_ptr(m);

        if (m->bytes == 0)
            continue;
        if (m->send)
            NCCL_TRY(&err, G->comm, ncclSend(p, m->bytes, ncclUint8, (int)m->peer_ep, G->comm,
                                             G->s_net));
        else
            NCCL_TRY(&err, G->comm, ncclRecv(p, m->bytes, ncclUint8, (int)m->peer_ep, G->comm,
                                             G->s_net));
    }
    grouped = false;
    NCCL_TRY(&err, NULL, ncclGroupEnd());
    if ((rc = wait_enqueued(t, r)) < 0)
        return rc;
scatter:
    for (g = 0; g < t->nlocal; g++) {
        gpu *G = &t->g[g];

        CUDA_TRY(&err, cudaSetDevice(G->dev));
        CUDA_TRY(&err, cudaEventRecord(G->ev_net[h], G->s_net));
        CUDA_TRY(&err, cudaStreamWaitEvent(G->s_unpack, G->ev_net[h], 0));
        range_of(s, false, r, g, &a, &n);
        rf_copy_cuda_buf_set_blocks(G->sbuf[h], t->tune.copy_blocks);
        if (n > 0 && !skip_copy &&
            (rc = rf_copy_cuda_scatter_buf(G->sbuf[h], &s->desc[a], n, G->arena, G->s_unpack,
                                           &err)) < 0)
            goto out;
        /* The payloads received, in staging or client memory, digested before the round ends. */
        if (t->digesting) {
            size_t x = (size_t)r * s->nl + g;

            if ((rc = digest_range(t, g, s->dfirst[x] + s->dsn[x], s->drn[x], G->s_unpack,
                                   &err)) < 0)
                goto out;
        }
        CUDA_TRY(&err, cudaEventRecord(G->ev_done[h], G->s_unpack));
    }
    /* While this round packs, the one before it may still be on the wire beside it. */
    {
        uint64_t held = 0;

        for (g = 0; g < t->nlocal; g++)
            held += s->rbytes[(size_t)r * t->nlocal + g] +
                    (r >= 1 && s->pair_ok[r - 1] ? s->rbytes[(size_t)(r - 1) * t->nlocal + g]
                                                 : 0);
        rf_xfer__staging(&t->base, held);
    }
    return 0;
out:
    if (grouped)
        ncclGroupEnd();
    {
        char what[300];

        describe_round(t, r, what, sizeof(what));
        return fail(t, rc, "starting %s: %s", what, err.msg);
    }
}

/* 1: the round finished on every local GPU, 0: not yet, < 0: failed. */
static int round_finished(nccl *t, uint32_t r)
{
    int h = (int)(r % SLOTS), rc = 0;
    rf_err err = {0};
    char what[300];

    for (uint32_t g = 0; g < t->nlocal; g++) {
        cudaError_t e = cudaEventQuery(t->g[g].ev_done[h]);
        ncclResult_t st = ncclSuccess;

        NCCL_TRY(&err, t->g[g].comm, ncclCommGetAsyncError(t->g[g].comm, &st));
        if (st != ncclSuccess && st != ncclInProgress) {
            rc = nccl_fail(&err, st, t->g[g].comm, "NCCL send/recv", __FILE__, __LINE__);
            goto out;
        }
        if (e == cudaErrorNotReady)
            return 0;
        CUDA_TRY(&err, e);
    }
    return 1;
out:
    describe_round(t, r, what, sizeof(what));
    return fail(t, rc, "%s: %s", what, err.msg);
}

/* The end-to-end terms of m's items that are ends of relay trees (xfer.h, rf_xfer_origin), its
 * payload p in device memory: the bytes each item's terms read are copied to the host first. */
static int e2e_dev(nccl *t, const rf_xfer_msg *m, const uint8_t *p)
{
    uint8_t *big = NULL;
    rf_err err = {0};
    int rc = 0;

    for (uint32_t k = 0; k < m->nitems; k++) {
        const rf_xfer_item *it = &m->items[k];
        uint64_t n = rf_xfer__e2e_bytes(t->base.job, m, it);
        uint8_t *h = t->js.bounce;

        if (n == 0)
            continue;
        if (n > VERIFY_CHUNK) {
            free(big);
            if (!(big = malloc(n))) {
                rc = rf_err_set(&err, -ENOMEM, "out of memory for %llu bytes",
                                (unsigned long long)n);
                goto out;
            }
            h = big;
        }
        CUDA_TRY(&err, cudaMemcpy(h, p + it->msg_off, n, cudaMemcpyDeviceToHost));
        rf_xfer__e2e_item(&t->base, it, h);
    }
out:
    free(big);
    if (rc < 0)
        fail(t, rc, "copying message seq %u to the host to verify its relays end to end: %s",
             m->seq, err.msg);
    return rc;
}

/* A round is done: account its bytes, fold the digests its GPUs computed, and the relays'
 * end-to-end terms of its payloads (staging still holds them: with such terms, the round that
 * reuses this half is not started yet). */
static int retire_round(nccl *t, uint32_t r)
{
    jstate *s = &t->js;
    const rf_xfer_job *job = s->job;
    int rc;

    for (uint32_t i = s->round_first[r]; i < s->round_first[r + 1]; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        const uint8_t *p = m->kind == RF_PLAN_PACKED ? t->g[s->mgpu[i]].arena + s->moff[i]
                                                     : rf_xfer_direct_ptr(m);

        if (t->digesting && rf_xfer_msg_verified(job, m)) {
            rf_wdigest_acc acc;

            rf_wdigest_cuda_result(s->dplan[s->mgpu[i]], s->dacc[i], &acc);
            rf_xfer__wdigest_fold(&t->base, m, m->send, &acc);
        }
        if (t->host_e2e && (rc = e2e_dev(t, m, p)) < 0)
            return rc;
        rf_xfer__moved(&t->base, m);
    }
    return 0;
}

/* ---- the job (worker thread) ---- */

static int nccl_start(rf_xfer_core *base)
{
    nccl *t = (nccl *)base;
    const rf_xfer_job *job = base->job;
    int rc;

    if ((rc = world_up(t)) < 0)
        return rc;
    t->host_e2e = false;
    t->digesting = job->verify != RF_VERIFY_OFF;
    for (uint32_t i = 0; job->verify != RF_VERIFY_OFF && i < job->nmsgs && !t->host_e2e; i++)
        for (uint32_t k = 0; k < job->msgs[i].nitems && !t->host_e2e; k++)
            t->host_e2e = rf_xfer__e2e_bytes(job, &job->msgs[i], &job->msgs[i].items[k]) > 0;
    if ((rc = js_prepare(t, job)) < 0 || (rc = arenas_reserve(t)) < 0 ||
        (rc = quant_plans(t)) < 0 || (rc = digest_plans(t)) < 0)
        return rc;
    t->lo = t->hi = 0;
    {
        bool sends = false, recvs = false;

        for (uint32_t i = 0; i < job->nmsgs; i++) {
            sends |= job->msgs[i].send;
            recvs |= !job->msgs[i].send;
        }
        t->relay_order = sends && recvs;
    }
    /* Relays' end-to-end terms read a retired round's staging on the host, so nothing may be
     * enqueued over it before then: two rounds at most, and only neighbours that fit side by
     * side. Message digests are made on the GPU in stream order and need no such care. */
    t->window = t->host_e2e ? 2 : t->tune.window ? t->tune.window : SLOTS;
    return 0;
}

/* Enqueues what the window allows, then retires the oldest round if it finished. A check
 * costs next to nothing, so the step naps POLL_NS rather than waiting the core's wait_s. */
static int nccl_progress(rf_xfer_core *base, double wait_s)
{
    nccl *t = (nccl *)base;
    jstate *s = &t->js;
    const rf_xfer_job *job = s->job;
    uint32_t nr = job->nrounds;
    int rc;

    (void)wait_s;
    if (t->lo == nr)
        return 1;
    while (t->hi < nr && t->hi < t->lo + t->window &&
           (t->hi == t->lo || !t->host_e2e || s->pair_ok[t->lo])) {
        if ((rc = enqueue_round(t, t->hi)) < 0)
            return rc;
        t->hi++;
    }
    /* Rounds retire in order, and a round's slot is reused only after it retired. */
    assert(t->lo < t->hi && t->hi - t->lo <= SLOTS);
    rc = round_finished(t, t->lo);
    if (rc <= 0) {
        if (rc == 0)
            nap();
        return rc;
    }
    if ((rc = retire_round(t, t->lo)) < 0)
        return rc;
    t->lo++;
    return t->lo == nr;
}

static void nccl_describe(rf_xfer_core *base, char *buf, size_t len)
{
    nccl *t = (nccl *)base;

    if (t->lo < base->job->nrounds)
        describe_round(t, t->lo, buf, len);
    else
        snprintf(buf, len, "nothing");
}

static void nccl_finish(rf_xfer_core *base, int rc)
{
    nccl *t = (nccl *)base;

    if (rc < 0 || base->job->plan_key == 0)
        js_free(&t->js);
    if (rc < 0) {
        /* Kernels may be stuck on a peer that failed: abort, and the next job needs a new
         * world with a fresh id. */
        world_abort(t);
        RF_WARN("job of version %llu failed: %s; the NCCL world is torn down",
                (unsigned long long)base->job->version, base->result.error);
    }
}

/* Releasing communicators and device memory is slow: the core runs this on a worker. */
static void nccl_teardown(rf_xfer_core *base)
{
    nccl *t = (nccl *)base;

    for (uint32_t i = 0; i < t->nlocal; i++)
        gpu_release(t, &t->g[i]);
    for (uint32_t i = 0; i < t->old_nlocal; i++)
        gpu_release(t, &t->old_g[i]);
}

/* ---- the loop thread ---- */

static void nccl_release(rf_xfer_core *base)
{
    nccl *t = (nccl *)base;

    free(t->g);
    free(t->old_g);
    js_free(&t->js);
    free(t);
}

static bool same_world(const nccl *t, const rf_xfer_world *w)
{
    if (!t->have_world || w->nranks != t->nranks || w->nlocal != t->nlocal ||
        memcmp(w->unique_id, t->uid, sizeof(t->uid)) != 0)
        return false;
    for (uint32_t i = 0; i < w->nlocal; i++)
        if (w->local_ranks[i] != t->g[i].rank || w->local_devices[i] != t->g[i].dev)
            return false;
    return true;
}

static int set_world_devices(rf_xfer_core *base, const rf_xfer_world *w, rf_err *err)
{
    nccl *t = (nccl *)base;
    gpu *ng = NULL;

    if (base->running || base->closing)
        return rf_err_set(err, -EBUSY, "xfer nccl: cannot change the world while a job runs");
    if (w->nranks == 0 || w->nlocal == 0 || !w->local_ranks || !w->local_devices)
        return rf_err_set(err, -EINVAL, "xfer nccl: a world of %u ranks with %u local GPUs; "
                          "a daemon drives at least one GPU endpoint", w->nranks, w->nlocal);
    for (uint32_t i = 0; i < w->nlocal; i++) {
        if (w->local_ranks[i] >= w->nranks)
            return rf_err_set(err, -EINVAL, "xfer nccl: local rank %u is outside a world of "
                              "%u ranks", w->local_ranks[i], w->nranks);
        for (uint32_t j = 0; j < i; j++)
            if (w->local_ranks[j] == w->local_ranks[i] ||
                w->local_devices[j] == w->local_devices[i])
                return rf_err_set(err, -EINVAL, "xfer nccl: local rank %u (CUDA device %d) "
                                  "and rank %u (device %d) repeat a rank or a device; NCCL "
                                  "takes one rank per GPU", w->local_ranks[j],
                                  w->local_devices[j], w->local_ranks[i], w->local_devices[i]);
    }
    if (same_world(t, w) && !t->stale)
        return 0;
    if (t->have_dead_uid && memcmp(w->unique_id, t->dead_uid, sizeof(t->uid)) == 0)
        return rf_err_set(err, -EINVAL, "xfer nccl: this unique id belongs to a world that "
                          "was torn down after a failure; the coordinator must hand out a "
                          "fresh one (rf_xfer_nccl_unique_id)");
    ng = calloc(w->nlocal, sizeof(*ng));
    if (!ng)
        return rf_err_set(err, -ENOMEM, "xfer nccl: out of memory for %u GPUs", w->nlocal);
    for (uint32_t i = 0; i < w->nlocal; i++) {
        ng[i].rank = w->local_ranks[i];
        ng[i].dev = w->local_devices[i];
        /* Streams, events and staging of a device stay with the device; only its
         * communicator belongs to the old world. */
        for (uint32_t j = 0; j < t->nlocal; j++) {
            gpu *o = &t->g[j];

            if (o->dev != ng[i].dev || (!o->res_ready && !o->arena))
                continue;
            ng[i].res_ready = o->res_ready;
            ng[i].s_pack = o->s_pack;
            ng[i].s_net = o->s_net;
            ng[i].s_unpack = o->s_unpack;
            memcpy(ng[i].ev_packed, o->ev_packed, sizeof(o->ev_packed));
            memcpy(ng[i].ev_net, o->ev_net, sizeof(o->ev_net));
            memcpy(ng[i].ev_done, o->ev_done, sizeof(o->ev_done));
            memcpy(ng[i].gbuf, o->gbuf, sizeof(o->gbuf));
            memcpy(ng[i].sbuf, o->sbuf, sizeof(o->sbuf));
            ng[i].arena = o->arena;
            ng[i].arena_cap = o->arena_cap;
            o->res_ready = false;
            o->arena = NULL;
            o->arena_cap = 0;
        }
    }
    /* The old GPUs' communicators, streams and staging are released by the worker of the next
     * job (or by close), never on the loop thread. Two rebuilds without a job in between
     * would lose the first set: keep the oldest in old_g and fold the newer into it. */
    if (t->nlocal > 0) {
        if (t->rebuild) {
            gpu *merged = realloc(t->old_g, (t->old_nlocal + t->nlocal) * sizeof(*merged));

            if (!merged) {
                free(ng);
                return rf_err_set(err, -ENOMEM, "xfer nccl: out of memory for %u GPUs",
                                  w->nlocal);
            }
            memcpy(merged + t->old_nlocal, t->g, t->nlocal * sizeof(*merged));
            t->old_g = merged;
            t->old_nlocal += t->nlocal;
            free(t->g);
        } else {
            t->old_g = t->g;
            t->old_nlocal = t->nlocal;
        }
        t->rebuild = true;
    }
    t->g = ng;
    t->nlocal = w->nlocal;
    t->nranks = w->nranks;
    memcpy(t->uid, w->unique_id, sizeof(t->uid));
    t->have_world = true;
    t->world_gen++;
    t->comms_up = false;
    t->stale = false;
    return 0;
}

/* A daemon knows its GPUs by the CUDA UUIDs its clients registered memory under; the ordinals
 * are this process's numbering of them. */
static int nccl_set_world(rf_xfer_core *base, const rf_xfer_world *w, rf_err *err)
{
    rf_xfer_world wd;
    int *devs = NULL, rc = 0;

    if (w->local_devices || !w->local_uuids || w->nlocal == 0)
        return set_world_devices(base, w, err);
    devs = calloc(w->nlocal, sizeof(*devs));
    if (!devs)
        return rf_err_set(err, -ENOMEM, "xfer nccl: out of memory for %u GPUs", w->nlocal);
    for (uint32_t i = 0; i < w->nlocal; i++) {
        rc = rf_cuda_device_of_uuid(w->local_uuids[i], &devs[i], err);
        if (rc < 0) {
            rf_err_wrap(err, "transport nccl needs GPU memory (endpoint %u is '%s'): ", i,
                        w->local_uuids[i]);
            goto out;
        }
    }
    wd = *w;
    wd.local_devices = devs;
    rc = set_world_devices(base, &wd, err);
out:
    free(devs);
    return rc;
}

int rf_xfer_nccl_tune(rf_xfer_transport *base, const rf_xfer_nccl_tuning *tu, rf_err *err)
{
    nccl *t = (nccl *)base;

    if (t->base.running)
        return rf_err_set(err, -EBUSY, "xfer nccl: tuning changes while a job runs");
    if (tu->window > SLOTS)
        return rf_err_set(err, -EINVAL, "xfer nccl: a window of %u rounds; at most %d",
                          tu->window, SLOTS);
    if (tu->diag & ~(unsigned)(RF_XFER_NCCL_DIAG_NO_COPY | RF_XFER_NCCL_DIAG_NO_WIRE))
        return rf_err_set(err, -EINVAL, "xfer nccl: unknown diagnostic flags 0x%x", tu->diag);
    t->tune = *tu;
    return 0;
}

static bool nccl_needs_world(const rf_xfer_core *base)
{
    const nccl *t = (const nccl *)base;

    return !t->have_world || t->stale;
}

/* What the core cannot check: a world to run in, and every message between ranks of it. */
static int nccl_check(rf_xfer_core *base, const rf_xfer_job *job, rf_err *err)
{
    nccl *t = (nccl *)base;

    if (!t->have_world)
        return rf_err_set(err, -ESTALE, "xfer nccl: no NCCL world; the daemon must get a "
                          "unique id from the coordinator and call set_world first");
    if (t->stale)
        return rf_err_set(err, -ESTALE, "xfer nccl: the NCCL world was torn down after a "
                          "failed job; the daemon must get a fresh unique id from the "
                          "coordinator and call set_world");
    for (uint32_t i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];

        if (local_index(t, m->ep) < 0 || m->peer_ep >= t->nranks)
            return rf_err_set(err, -EINVAL, "xfer nccl: message seq %u goes between GPU rank "
                              "%u and rank %u, but this daemon drives no rank %u or the world "
                              "has only %u ranks; the world and the plan disagree", m->seq,
                              m->ep, m->peer_ep, local_index(t, m->ep) < 0 ? m->ep : m->peer_ep,
                              t->nranks);
    }
    return 0;
}

static const rf_xfer_backend nccl_backend = {
    .name = "nccl",
    .prepares = true,
    .check = nccl_check,
    .release = nccl_release,
    .start = nccl_start,
    .progress = nccl_progress,
    .describe = nccl_describe,
    .finish = nccl_finish,
    .teardown = nccl_teardown,
    .set_world = nccl_set_world,
    .needs_world = nccl_needs_world,
};

int rf_xfer_nccl_new(uv_loop_t *loop, rf_xfer_transport **out, rf_err *err)
{
    rf_xfer_core *core = NULL;
    int rc;

    *out = NULL;
    if ((rc = rf_xfer__new(sizeof(nccl), &nccl_backend, loop, &core, err)) < 0)
        return rc;
    atomic_init(&((nccl *)core)->mem_now, 0);
    atomic_init(&((nccl *)core)->mem_peak, 0);
    *out = &core->pub;
    return 0;
}

_Static_assert(sizeof(((ncclUniqueId *)0)->internal) == RF_XFER_NCCL_ID_BYTES,
               "RF_XFER_NCCL_ID_BYTES is the size of NCCL's unique id");

int rf_xfer_nccl_unique_id(uint8_t out[RF_XFER_NCCL_ID_BYTES], rf_err *err)
{
    ncclUniqueId id;
    int rc = 0;

    NCCL_TRY(err, NULL, ncclGetUniqueId(&id));
    memcpy(out, id.internal, RF_XFER_NCCL_ID_BYTES);
out:
    return rc;
}

void rf_xfer_nccl_memory(const rf_xfer_transport *base, uint64_t *now, uint64_t *peak)
{
    nccl *t = (nccl *)base;

    if (now)
        *now = atomic_load(&t->mem_now);
    if (peak)
        *peak = atomic_load(&t->mem_peak);
}
