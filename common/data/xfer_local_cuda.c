/* common/data/xfer_local_cuda.c - the local transport's GPU part (built with CUDA only): local
 * messages copied from trainer GPU memory mapped here into engine GPU memory on one stream per
 * destination device, strided and small boxes through the pair kernel from descriptors kept on
 * the device, large contiguous ones by the copy engines (cudaMemcpyAsync / cudaMemcpy2DAsync),
 * in batches polled against the deadline; verification by the wdigest kernel over the boxes of
 * both sides, on the device (messages quantized to FP8 here: through a small device scratch to
 * the host, where their source is quantized to compare). */
#define RF_LOG_MODULE "xfer_local"
#include "xfer_local_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "copy.h"
#include "copy_cuda.h"
#include "drv_cuda.h"
#include "log.h"
#include "macros.h"
#include "qcopy.h"
#include "quant.h"
#include "quant_cuda.h"
#include "wdigest_cuda.h"

/* A pair contiguous on both sides and at least this large goes by cudaMemcpyAsync (a pair of
 * rows, one strided dim, of at least this many bytes with rows of an eighth of it by
 * cudaMemcpy2DAsync): from there the copy engines match the kernel; below it the kernel's one
 * launch for many boxes wins over a call per box (on an H200, copies of 8 MiB: kernel 1850 GB/s,
 * cudaMemcpyAsync 1200; of 64 MiB: 1904 and 1932; bench_gpu local, bench/RESULTS.md). */
#define MEMCPY_MIN (64ull << 20)
/* Bytes per batch: the unit of progress and of an abort's wait (about 2 ms each at 2 TB/s on
 * one GPU; between GPUs over PCIe, tens). 4 GiB measured best on an H200 for qwen3-30b-a3b
 * (45.0 ms against 47.6 with 1 GiB: fewer kernel tails); bench/RESULTS.md. */
#define BATCH (4ull << 30)
/* Batches enqueued at once: the events of each device form a ring of this size. */
#define SLOTS 3
/* Copy streams per device: consecutive batches alternate between them, and a batch's FP8
 * quantization runs on the stream its copies do not, so one launch's last blocks overlap the
 * next launch's first instead of idling the GPU (the batches write disjoint bytes). On an H200,
 * qwen3-30b-a3b through the daemons: Start -> Commit 0.036 s with one stream, 0.033 with two. */
#define NSTREAMS 2
/* Verification scratch per device: the digested bytes are gathered here and copied down. */
#define VSCRATCH (16u << 20)
/* Room before and after each gathered segment for elements that straddle its ends. */
#define PAD 16u
/* How long the worker sleeps between completion polls. */
#define POLL_NS 20000L

typedef struct gdev {
    int dev;
    bool ready;
    cudaStream_t s[NSTREAMS], vs; /* copies; verification gathers */
    cudaEvent_t ev[SLOTS][NSTREAMS];
    uint8_t *scratch;   /* VSCRATCH, when a job verifies */
    uint8_t *bounce;    /* pinned host, VSCRATCH */
    uint8_t *uscratch;  /* ucap: the source rows of FP8 units (verification), and */
    uint8_t *ubounce;   /* their pinned host copy */
    uint64_t ucap;
    rf_copy_cuda_buf *vbuf;
    /* GPU digests: their stream (the sources digested beside the copies, the destinations
     * after them) and the event that ends each batch's. */
    bool dready;
    cudaStream_t ds;
    cudaEvent_t evd[SLOTS];
} gdev;

/* A copy by the copy engines: height rows of width bytes, pitches apart (height 1: 1D). */
typedef struct ceop {
    const uint8_t *src;
    uint8_t *dst;
    uint64_t width, height;
    uint64_t spitch, dpitch;
} ceop;

/* A part of a verified message's digested bytes, [lo, hi), gathered to scratch + off + PAD. */
typedef struct vseg {
    uint32_t msg;
    uint64_t lo, hi, off;
} vseg;

/* The source side of a verified FP8 item's digested bytes comes from its bf16 source,
 * quantized on the host (rf_quant_host, the arithmetic the GPU kernels are held to): unit u
 * of the item (its row of blocks i of matrix l, u = l * srows + i) gathered into the device's
 * uscratch at uoff, quantized after the copy down, and its bytes that lie in segment seg put
 * where the payload has them. */
typedef struct qunit {
    uint32_t seg, item;
    uint64_t u, uoff;
} qunit;

/* One gather of segments into a device's scratch: segments [sfirst, +scount); descriptors
 * [sdfirst, +sdcount) of vsrc and [ddfirst, +ddcount) of vdst; span bytes of scratch; FP8
 * units [qfirst, +qcount), their gathers [udfirst, +udcount) of vunit, uspan bytes of
 * uscratch. */
typedef struct vwin {
    uint32_t dev;
    uint32_t sfirst, scount;
    uint64_t sdfirst, sdcount, ddfirst, ddcount;
    uint64_t span;
    uint64_t qfirst, qcount, udfirst, udcount, uspan;
} vwin;

enum { BS_CE = 5, BS_QUANT, BS_PAIRS, BS_MINRUN, BS_DONE_NS, BS_N };

/* A base pointer's device, found once per pointer. */
typedef struct pdev {
    uintptr_t p;
    int dev; /* -1: empty slot */
} pdev;

/* The plan of execution, kept for the next job with the same plan_key and verify. */
typedef struct gplan {
    uint64_t key;
    int verify;
    uint64_t batch, memcpy_min; /* the tuning it was cut with */
    bool valid;
    uint32_t nmsgs, ndev, nbatches;
    uint32_t *mdev;             /* per message: device slot */
    uint32_t *bmsg;             /* nbatches + 1: messages of each batch */
    rf_copy_cuda_plan **kplan;  /* per device: kernel pairs in batch order */
    uint64_t *kfirst, *kcount;  /* [b * ndev + d] */
    ceop **ops;                 /* per device */
    uint64_t *ofirst, *ocount;  /* [b * ndev + d] */
    rf_quant_cuda_plan **qplan; /* per device: FP8 matrices in batch order */
    uint64_t *qfirst, *qcount;  /* [b * ndev + d] */
    rf_copy_desc *vsrc, *vdst;  /* verification gathers */
    rf_copy_desc *vunit;        /* FP8 units' source gathers */
    qunit *units;
    uint64_t *uneed;            /* per device: the largest uspan */
    uint8_t *utmp;              /* host: one unit quantized */
    vseg *segs;
    vwin *wins;
    uint32_t *bwin;             /* nbatches + 1: windows of each batch */
    uint64_t bytes;
    /* For the debug log, per batch: bytes through the kernel by access width (1, 2, 4, 8, 16
     * bytes: [0..4]), through the copy engines, quantized to FP8 (payload bytes), the kernel's
     * pairs, its shortest run, and in the running job the ns since its start at which the
     * batch was seen done. */
    uint64_t (*bstat)[BS_N];
    /* Message digests on the GPU (verify on; a message with items quantized here goes through
     * the windows above): per device a plan of segments, for batch b on device d the source
     * sides [dsrc, +nsrc) then the destination sides [ddst, +ndst); a device's j-th such
     * message adds into accumulators 2j (source) and 2j + 1 (destination), those of the batch
     * [dacc, +nacc). */
    rf_wdigest_cuda_plan **dplan;
    uint64_t *dsrc, *nsrc, *ddst, *ndst; /* [b * ndev + d] */
    uint32_t *dacc, *nacc;               /* [b * ndev + d] */
    uint32_t *macc;                      /* per message: its j, or UINT32_MAX */
    uint8_t seed[RF_XFER_DIGEST_SEED_BYTES];
} gplan;

struct rf_xfer_lgpu {
    gdev *devs;
    uint32_t ndevs;
    pdev *ptab;
    uint32_t pcap, pcount;
    gplan pl;
    const rf_xfer_job *job;
    uint32_t lo, hi; /* batches [lo, hi) enqueued and not retired */
    bool dst_digests; /* the destinations' digests are enqueued (after the last batch) */
    /* Where a job's time went, for the debug log: since its start, the plan's build, the
     * launches, the digests (both sides) and the end of the last batch. */
    double t0, t_plan, t_launch, t_verify, t_copied;
};

#define fail(t, ...) rf_xfer__fail(&(t)->base, __VA_ARGS__)

static void nap(void)
{
    struct timespec ts = {0, POLL_NS};

    nanosleep(&ts, NULL);
}

/* ---- devices ---- */

static int dev_slot(rf_xfer_local *t, int dev, uint32_t *slot)
{
    rf_xfer_lgpu *g = t->g;
    gdev *nd;
    rf_err err = {0};
    int rc = 0;

    for (uint32_t i = 0; i < g->ndevs; i++) {
        if (g->devs[i].dev == dev) {
            *slot = i;
            return 0;
        }
    }
    nd = realloc(g->devs, (g->ndevs + 1) * sizeof(*nd));
    if (!nd)
        return fail(t, -ENOMEM, "out of memory for GPU %d", dev);
    rf_xfer__local_alloc(t, 0);
    g->devs = nd;
    memset(&nd[g->ndevs], 0, sizeof(nd[0]));
    nd[g->ndevs].dev = dev;
    *slot = g->ndevs++;
    {
        gdev *G = &nd[*slot];

        CUDA_TRY(&err, cudaSetDevice(dev));
        for (int k = 0; k < NSTREAMS; k++)
            CUDA_TRY(&err, cudaStreamCreateWithFlags(&G->s[k], cudaStreamNonBlocking));
        CUDA_TRY(&err, cudaStreamCreateWithFlags(&G->vs, cudaStreamNonBlocking));
        for (int h = 0; h < SLOTS; h++)
            for (int k = 0; k < NSTREAMS; k++)
                CUDA_TRY(&err, cudaEventCreateWithFlags(&G->ev[h][k], cudaEventDisableTiming));
        G->ready = true;
    }
out:
    if (rc < 0)
        fail(t, rc, "preparing GPU %d for local copies: %s", dev, err.msg);
    return rc;
}

static int dev_verify_ready(rf_xfer_local *t, gdev *G, uint64_t uneed)
{
    rf_err err = {0};
    int rc = 0;

    if (uneed > G->ucap) {
        CUDA_TRY(&err, cudaSetDevice(G->dev));
        if (G->uscratch) {
            cudaFree(G->uscratch);
            cudaFreeHost(G->ubounce);
            rf_xfer__local_alloc(t, -(int64_t)G->ucap);
            G->uscratch = G->ubounce = NULL;
            G->ucap = 0;
        }
        CUDA_TRY(&err, cudaMalloc((void **)&G->uscratch, uneed));
        rf_xfer__local_alloc(t, (int64_t)uneed);
        G->ucap = uneed;
        CUDA_TRY(&err, cudaMallocHost((void **)&G->ubounce, uneed));
        rf_xfer__local_alloc(t, 0);
    }
    if (G->scratch)
        return 0;
    CUDA_TRY(&err, cudaSetDevice(G->dev));
    CUDA_TRY(&err, cudaMalloc((void **)&G->scratch, VSCRATCH));
    rf_xfer__local_alloc(t, VSCRATCH);
    CUDA_TRY(&err, cudaMallocHost((void **)&G->bounce, VSCRATCH));
    rf_xfer__local_alloc(t, 0);
    if ((rc = rf_copy_cuda_buf_new(&G->vbuf, &err)) < 0)
        goto out;
    rf_xfer__local_alloc(t, 0);
out:
    if (rc < 0)
        fail(t, rc, "preparing verification on GPU %d: %s", G->dev, err.msg);
    return rc;
}

/* The GPU digests' stream and events on G. */
static int dev_digest_ready(rf_xfer_local *t, gdev *G)
{
    rf_err err = {0};
    int rc = 0;

    if (G->dready)
        return 0;
    CUDA_TRY(&err, cudaSetDevice(G->dev));
    CUDA_TRY(&err, cudaStreamCreateWithFlags(&G->ds, cudaStreamNonBlocking));
    for (int h = 0; h < SLOTS; h++)
        CUDA_TRY(&err, cudaEventCreateWithFlags(&G->evd[h], cudaEventDisableTiming));
    rf_xfer__local_alloc(t, 0);
    G->dready = true;
out:
    if (rc < 0)
        fail(t, rc, "preparing digests on GPU %d: %s", G->dev, err.msg);
    return rc;
}

static void dev_release(rf_xfer_local *t, gdev *G)
{
    if (!G->ready)
        return;
    cudaSetDevice(G->dev);
    if (G->dready) {
        cudaStreamSynchronize(G->ds);
        for (int h = 0; h < SLOTS; h++)
            cudaEventDestroy(G->evd[h]);
        cudaStreamDestroy(G->ds);
    }
    for (int k = 0; k < NSTREAMS; k++)
        cudaStreamSynchronize(G->s[k]);
    cudaStreamSynchronize(G->vs);
    rf_copy_cuda_buf_free(G->vbuf);
    if (G->scratch) {
        cudaFree(G->scratch);
        rf_xfer__local_alloc(t, -(int64_t)VSCRATCH);
    }
    cudaFreeHost(G->bounce);
    if (G->uscratch) {
        cudaFree(G->uscratch);
        rf_xfer__local_alloc(t, -(int64_t)G->ucap);
    }
    cudaFreeHost(G->ubounce);
    for (int h = 0; h < SLOTS; h++)
        for (int k = 0; k < NSTREAMS; k++)
            cudaEventDestroy(G->ev[h][k]);
    for (int k = 0; k < NSTREAMS; k++)
        cudaStreamDestroy(G->s[k]);
    cudaStreamDestroy(G->vs);
    memset(G, 0, sizeof(*G));
}

/* The CUDA device a base pointer lies on, asked once per pointer (the items of a job share a
 * few hundred bases at most: one per mapped region). */
static int device_of(rf_xfer_local *t, const void *p, const char *side, uint32_t seq, int *dev)
{
    rf_xfer_lgpu *g = t->g;
    struct cudaPointerAttributes a;
    uintptr_t key = (uintptr_t)p;
    uint32_t h;
    cudaError_t e;

    if (g->pcount * 2 >= g->pcap) {
        uint32_t ncap = g->pcap ? g->pcap * 2 : 64;
        pdev *nt = malloc(ncap * sizeof(*nt));

        if (!nt)
            return fail(t, -ENOMEM, "out of memory for the device table");
        rf_xfer__local_alloc(t, 0);
        for (uint32_t i = 0; i < ncap; i++)
            nt[i].dev = -1;
        for (uint32_t i = 0; i < g->pcap; i++) {
            if (g->ptab[i].dev < 0)
                continue;
            for (h = (uint32_t)((g->ptab[i].p >> 8) * 0x9e3779b1u) & (ncap - 1); nt[h].dev >= 0;
                 h = (h + 1) & (ncap - 1))
                ;
            nt[h] = g->ptab[i];
        }
        free(g->ptab);
        g->ptab = nt;
        g->pcap = ncap;
    }
    for (h = (uint32_t)((key >> 8) * 0x9e3779b1u) & (g->pcap - 1); g->ptab[h].dev >= 0;
         h = (h + 1) & (g->pcap - 1)) {
        if (g->ptab[h].p == key) {
            *dev = g->ptab[h].dev;
            return 0;
        }
    }
    e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess || (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)) {
        cudaGetLastError();
        return fail(t, -EINVAL, "local message seq %u: the %s memory at %p is not GPU memory "
                    "(%s); the GPU local transport copies device memory only, host memory "
                    "goes to the host local transport", seq, side, p,
                    e != cudaSuccess ? cudaGetErrorString(e) : "host or unregistered");
    }
    g->ptab[h] = (pdev){key, a.device};
    g->pcount++;
    *dev = a.device;
    return 0;
}

/* The pair kernel on dst's device reads src's memory: a peer GPU's needs access enabled. */
static int peer_access(rf_xfer_local *t, int dst, int src)
{
    rf_err err = {0};
    int can = 0, rc = 0;
    cudaError_t e;

    if (dst == src)
        return 0;
    CUDA_TRY(&err, cudaDeviceCanAccessPeer(&can, dst, src));
    if (!can)
        return fail(t, -ENOTSUP, "GPU %d cannot read GPU %d's memory directly (no peer access "
                    "between them); local copies between these GPUs are not possible, run the "
                    "pair over nccl", dst, src);
    CUDA_TRY(&err, cudaSetDevice(dst));
    e = cudaDeviceEnablePeerAccess(src, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled)
        cudaGetLastError();
    else
        CUDA_TRY(&err, e);
out:
    if (rc < 0)
        fail(t, rc, "enabling GPU %d's access to GPU %d: %s", dst, src, err.msg);
    return rc;
}

/* ---- the plan of execution ---- */

static void plan_free(rf_xfer_local *t)
{
    gplan *pl = &t->g->pl;

    for (uint32_t d = 0; pl->kplan && d < pl->ndev; d++)
        rf_copy_cuda_plan_free(pl->kplan[d]);
    for (uint32_t d = 0; pl->ops && d < pl->ndev; d++)
        free(pl->ops[d]);
    for (uint32_t d = 0; pl->qplan && d < pl->ndev; d++)
        rf_quant_cuda_plan_free(pl->qplan[d]);
    for (uint32_t d = 0; pl->dplan && d < pl->ndev; d++)
        rf_wdigest_cuda_plan_free(pl->dplan[d]);
    free(pl->dplan);
    free(pl->dsrc);
    free(pl->nsrc);
    free(pl->ddst);
    free(pl->ndst);
    free(pl->dacc);
    free(pl->nacc);
    free(pl->macc);
    if (pl->valid || pl->kplan)
        atomic_fetch_sub(&t->mem_now, pl->bytes);
    free(pl->mdev);
    free(pl->bmsg);
    free(pl->kplan);
    free(pl->kfirst);
    free(pl->kcount);
    free(pl->ops);
    free(pl->ofirst);
    free(pl->ocount);
    free(pl->qplan);
    free(pl->qfirst);
    free(pl->qcount);
    free(pl->vsrc);
    free(pl->vdst);
    free(pl->vunit);
    free(pl->units);
    free(pl->uneed);
    free(pl->utmp);
    free(pl->segs);
    free(pl->wins);
    free(pl->bwin);
    free(pl->bstat);
    memset(pl, 0, sizeof(*pl));
}

/* A growable array, counted as allocations (the warm job must make none). */
static int grow(rf_xfer_local *t, void **p, uint64_t *cap, uint64_t need, size_t esz)
{
    uint64_t c = *cap ? *cap : 64;
    void *np;

    if (need <= *cap)
        return 0;
    while (c < need)
        c *= 2;
    np = realloc(*p, c * esz);
    if (!np)
        return fail(t, -ENOMEM, "out of memory planning local copies");
    rf_xfer__local_alloc(t, 0);
    *p = np;
    *cap = c;
    return 0;
}

typedef struct ord {
    uint64_t off;
    uint32_t k;
} ord;

static int ord_cmp(const void *a, const void *b)
{
    const ord *x = a, *y = b;

    return x->off < y->off ? -1 : x->off > y->off;
}

/* The verification gathers, built message by message: segments of the digested bytes cut at
 * the scratch's end, and for each the boxes of its items (source and destination side alike)
 * gathered into scratch + off + PAD in payload order; an FP8 item's source side as units. */
typedef struct vbuild {
    uint64_t nseg, capseg, nsrc, capsrc, ndst, capdst, nwin, capwin;
    uint64_t nunit, capunit, nud, capud;
    uint64_t used;  /* scratch bytes of the open window */
    uint64_t uused; /* uscratch bytes of the open window */
    uint64_t utmp;  /* the largest unit quantized: its FP8 bytes and scales */
    bool open;
    ord *o;
    uint32_t capo;
} vbuild;

static int open_win(rf_xfer_local *t, gplan *pl, vbuild *vb, uint32_t dev)
{
    int rc;

    if ((rc = grow(t, (void **)&pl->wins, &vb->capwin, vb->nwin + 1, sizeof(vwin))) < 0)
        return rc;
    pl->wins[vb->nwin++] = (vwin){.dev = dev, .sfirst = (uint32_t)vb->nseg,
                                  .sdfirst = vb->nsrc, .ddfirst = vb->ndst,
                                  .qfirst = vb->nunit, .udfirst = vb->nud};
    vb->used = vb->uused = 0;
    vb->open = true;
    return 0;
}

/* The shape of FP8 item d's payload: its box's matrices (rows x cols each, nm of them), FP8
 * bytes (fp8), scale grid of a matrix (srows x scols, ses bytes each) and rows per unit (bh:
 * a block's rows, 1 for CHANNEL and MXFP8, the matrix for TENSOR). */
typedef struct qshape {
    rf_quant_fmt f;
    uint64_t rows, cols, nm, fp8, srows, scols, ses, bh;
} qshape;

static qshape qshape_of(const rf_xfer_item *d)
{
    const rf_xfer_quant *x = &d->quant;
    int L = d->ndim - 2;
    qshape q = {.f = {x->q.kind, x->q.br, x->q.bc}};

    q.rows = (uint64_t)d->box.extent[L];
    q.cols = (uint64_t)d->box.extent[L + 1];
    q.nm = rf_qcopy_nmatrices(&d->box, d->ndim);
    rf_qcopy_bytes(&x->q, d->ndim, x->rows, x->cols, &d->box, &q.fp8);
    rf_quant_scale_shape(&q.f, q.rows, q.cols, &q.srows, &q.scols, NULL);
    q.ses = rf_dtype_size(rf_quant_scale_dtype(&q.f));
    q.bh = q.f.kind == RF_QUANT_BLOCK ? q.f.br : q.f.kind == RF_QUANT_TENSOR ? q.rows : 1;
    return q;
}

/* Bytes [a, b) of FP8 item it's payload (its elements row-major, then its scales) gathered
 * to scratch offset off + (payload offset): descriptors appended to *arr (*n of *cap). */
static int fp8_span(rf_xfer_local *t, const rf_xfer_item *it, const qshape *q, uint64_t a,
                    uint64_t b, uint64_t off, rf_copy_desc **arr, uint64_t *n, uint64_t *cap)
{
    const rf_xfer_quant *x = &it->quant;
    int nd = it->ndim, L = nd - 2, nb;
    rf_box bx[RF_COPY_SPAN_MAX], sb;
    int64_t shape[RF_MAX_DIMS] = {0};
    int rc;

    shape[L] = x->rows;
    shape[L + 1] = x->cols;
    rf_inv_scale_box(&x->q, nd, shape, &it->box, &sb);
    if (a < q->fp8) {
        uint64_t ea = a, eb = b < q->fp8 ? b : q->fp8;

        nb = rf_copy_box_span(&it->box, nd, ea, eb, bx);
        if ((rc = grow(t, (void **)arr, cap, *n + (uint64_t)nb, sizeof(rf_copy_desc))) < 0)
            return rc;
        for (int j = 0; j < nb; j++) {
            rf_copy_desc_set(&(*arr)[(*n)++], it->base, &it->piece, nd, 1, &bx[j], off + ea);
            ea += (uint64_t)rf_box_numel(&bx[j], nd);
        }
    }
    if (b > q->fp8) {
        uint64_t ea = (a > q->fp8 ? a - q->fp8 : 0) / q->ses;
        uint64_t eb = (b - q->fp8 + q->ses - 1) / q->ses;

        nb = rf_copy_box_span(&sb, nd, ea, eb, bx);
        if ((rc = grow(t, (void **)arr, cap, *n + (uint64_t)nb, sizeof(rf_copy_desc))) < 0)
            return rc;
        for (int j = 0; j < nb; j++) {
            /* A scale that straddles the segment's start lands in the PAD before it. */
            rf_copy_desc_set(&(*arr)[(*n)++], x->scale_base, &x->scale, nd, q->ses, &bx[j],
                             off + q->fp8 + ea * q->ses);
            ea += (uint64_t)rf_box_numel(&bx[j], nd);
        }
    }
    return 0;
}

/* Item k's bytes [a, b) (of its payload) in segment sg of a verified message: the destination
 * side gathers its FP8 elements and scales; the source side gathers the same of an FP8 source,
 * else its units [ua, ub), the rows of blocks those bytes come from, each gathered from the
 * bf16 source whole (quantized on the host when digested). */
static int verify_quant_item(rf_xfer_local *t, gplan *pl, vbuild *vb, const vseg *sg,
                             uint32_t k, uint64_t a, uint64_t b)
{
    const rf_xfer_msg *m = &t->base.job->msgs[sg->msg];
    const rf_xfer_item *d = &m->items[k], *s = &m->src_items[k];
    qshape q = qshape_of(d);
    int nd = d->ndim, L = nd - 2;
    uint64_t mat = q.rows * q.cols, ua = UINT64_MAX, ub = 0;
    uint64_t off = sg->off + PAD + d->msg_off - sg->lo;
    int rc;

    if ((rc = fp8_span(t, d, &q, a, b, off, &pl->vdst, &vb->ndst, &vb->capdst)) < 0)
        return rc;
    if (s->piece.quant != 0)
        return fp8_span(t, s, &q, a, b, off, &pl->vsrc, &vb->nsrc, &vb->capsrc);
    if (a < q.fp8) {
        uint64_t eb = b < q.fp8 ? b : q.fp8;

        ua = (a / mat) * q.srows + (a % mat) / q.cols / q.bh;
        ub = ((eb - 1) / mat) * q.srows + ((eb - 1) % mat) / q.cols / q.bh + 1;
    }
    if (b > q.fp8) {
        uint64_t ea = (a > q.fp8 ? a - q.fp8 : 0) / q.ses;
        uint64_t eb = (b - q.fp8 + q.ses - 1) / q.ses;

        ua = ua < ea / q.scols ? ua : ea / q.scols;
        ub = ub > (eb - 1) / q.scols + 1 ? ub : (eb - 1) / q.scols + 1;
    }
    /* The units between the two parts' are gathered too when both parts lie in the segment:
     * a few rows of blocks at most, since a segment is a scratch long. */
    for (uint64_t u = ua; u < ub; u++) {
        uint64_t l = u / q.srows, r0 = (u % q.srows) * q.bh;
        uint64_t nr = q.rows - r0 < q.bh ? q.rows - r0 : q.bh;
        rf_box ubox = d->box;
        int64_t idx[RF_MAX_DIMS];

        rf_qcopy_matrix_start(&d->box, nd, l, idx);
        for (int dd = 0; dd < L; dd++) {
            ubox.start[dd] = idx[dd];
            ubox.extent[dd] = 1;
        }
        ubox.start[L] += (int64_t)r0;
        ubox.extent[L] = (int64_t)nr;
        if ((rc = grow(t, (void **)&pl->vunit, &vb->capud, vb->nud + 1,
                       sizeof(rf_copy_desc))) < 0 ||
            (rc = grow(t, (void **)&pl->units, &vb->capunit, vb->nunit + 1, sizeof(qunit))) < 0)
            return rc;
        rf_copy_desc_set(&pl->vunit[vb->nud++], s->base, &s->piece, nd, s->esize, &ubox,
                         vb->uused);
        pl->units[vb->nunit++] = (qunit){(uint32_t)(sg - pl->segs), k, u, vb->uused};
        vb->uused += (nr * q.cols * s->esize + 15) & ~15ull;
        if (nr * q.cols + q.scols * q.ses > vb->utmp)
            vb->utmp = nr * q.cols + q.scols * q.ses;
    }
    return 0;
}

static int verify_msg(rf_xfer_local *t, gplan *pl, vbuild *vb, uint32_t i, uint64_t digest)
{
    const rf_xfer_msg *m = &t->base.job->msgs[i];
    uint32_t dev = pl->mdev[i];
    uint64_t lo = 0;
    int rc;

    if (m->nitems > vb->capo) {
        free(vb->o);
        vb->capo = m->nitems;
        if (!(vb->o = malloc(m->nitems * sizeof(*vb->o))))
            return fail(t, -ENOMEM, "out of memory planning verification");
        rf_xfer__local_alloc(t, 0);
    }
    for (uint32_t k = 0; k < m->nitems; k++)
        vb->o[k] = (ord){m->items[k].msg_off, k};
    qsort(vb->o, m->nitems, sizeof(*vb->o), ord_cmp);
    while (lo < digest) {
        uint64_t hi;
        vseg *sg;
        vwin *w;

        if (!vb->open || pl->wins[vb->nwin - 1].dev != dev ||
            vb->used + 2 * PAD + 16 > VSCRATCH)
            if ((rc = open_win(t, pl, vb, dev)) < 0)
                return rc;
        hi = digest - lo < VSCRATCH - vb->used - 2 * PAD ? digest
                                                         : lo + (VSCRATCH - vb->used - 2 * PAD);
        if ((rc = grow(t, (void **)&pl->segs, &vb->capseg, vb->nseg + 1, sizeof(vseg))) < 0)
            return rc;
        sg = &pl->segs[vb->nseg++];
        *sg = (vseg){.msg = i, .lo = lo, .hi = hi, .off = vb->used};
        for (uint32_t k = 0; k < m->nitems; k++) {
            const rf_xfer_item *d = &m->items[vb->o[k].k], *s = &m->src_items[vb->o[k].k];
            rf_box bx[RF_COPY_SPAN_MAX];
            uint64_t a, b, ea, eb;
            int nb;

            if (d->msg_off >= hi || d->msg_off + d->bytes <= lo)
                continue;
            a = lo > d->msg_off ? lo - d->msg_off : 0;
            b = hi - d->msg_off < d->bytes ? hi - d->msg_off : d->bytes;
            if (d->quant.q.kind != 0) {
                if ((rc = verify_quant_item(t, pl, vb, sg, vb->o[k].k, a, b)) < 0)
                    return rc;
                sg = &pl->segs[vb->nseg - 1];
                continue;
            }
            ea = a / d->esize;
            eb = (b + d->esize - 1) / d->esize;
            nb = rf_copy_box_span(&d->box, d->ndim, ea, eb, bx);
            if ((rc = grow(t, (void **)&pl->vsrc, &vb->capsrc, vb->nsrc + (uint64_t)nb,
                           sizeof(rf_copy_desc))) < 0 ||
                (rc = grow(t, (void **)&pl->vdst, &vb->capdst, vb->ndst + (uint64_t)nb,
                           sizeof(rf_copy_desc))) < 0)
                return rc;
            for (int j = 0; j < nb; j++) {
                /* Whole elements: one that straddles the segment's start lands in the PAD
                 * before it, one that straddles its end in the PAD after. */
                uint64_t soff = sg->off + PAD + d->msg_off + ea * d->esize - lo;

                rf_copy_desc_set(&pl->vsrc[vb->nsrc++], s->base, &s->piece, s->ndim, s->esize,
                                 &bx[j], soff);
                rf_copy_desc_set(&pl->vdst[vb->ndst++], d->base, &d->piece, d->ndim, d->esize,
                                 &bx[j], soff);
                ea += (uint64_t)rf_box_numel(&bx[j], d->ndim);
            }
        }
        vb->used += (hi - lo + 2 * PAD + 15) & ~15ull;
        w = &pl->wins[vb->nwin - 1];
        w->scount = (uint32_t)(vb->nseg - w->sfirst);
        w->sdcount = vb->nsrc - w->sdfirst;
        w->ddcount = vb->ndst - w->ddfirst;
        w->span = vb->used;
        w->qcount = vb->nunit - w->qfirst;
        w->udcount = vb->nud - w->udfirst;
        w->uspan = vb->uused;
        if (vb->uused > pl->uneed[dev])
            pl->uneed[dev] = vb->uused;
        lo = hi;
    }
    return 0;
}

/* A kernel pair in a batch's debug counts: its bytes under the widest access its addresses
 * allow (as the kernel chooses it), one more pair, the shortest run. */
static void stat_pair(uint64_t st[BS_N], const rf_copy_pair_flat *f)
{
    uint64_t a = f->run | (uintptr_t)f->src | (uintptr_t)f->dst;
    int w = 0;

    for (int k = 0; k < f->n; k++)
        a |= (uint64_t)f->sstr[k] | (uint64_t)f->dstr[k];
    while (w < 4 && (a & ((2ull << w) - 1)) == 0)
        w++;
    st[w] += f->bytes;
    st[BS_PAIRS]++;
    if (st[BS_MINRUN] == 0 || f->run < st[BS_MINRUN])
        st[BS_MINRUN] = f->run;
}

/* The FP8 matrices of the transfer from source item s into FP8 item dd (checked), appended to
 * ops: each matrix of the box quantized from the source's rows straight into the piece and
 * its scales. */
static int add_qops(rf_xfer_local *t, const rf_xfer_msg *m, const rf_xfer_item *s,
                    const rf_xfer_item *dd, rf_quant_cuda_op **ops, uint64_t *n, uint64_t *cap)
{
    const rf_xfer_quant *x = &dd->quant;
    qshape q = qshape_of(dd);
    int rc;

    if (x->scale.strides[dd->ndim - 1] != 1)
        return fail(t, -ENOTSUP, "local message seq %u: the scales of an FP8 piece lie %lld "
                    "apart in a row; the GPU quantizer writes each row of scales contiguous",
                    m->seq, (long long)x->scale.strides[dd->ndim - 1]);
    if ((rc = grow(t, (void **)ops, cap, *n + q.nm, sizeof(**ops))) < 0)
        return rc;
    for (uint64_t l = 0; l < q.nm; l++) {
        rf_qcopy_matrix mx;

        rf_qcopy_matrix_at(s, dd, l, &mx);
        (*ops)[(*n)++] = (rf_quant_cuda_op){
            .fmt = q.f, .dt = x->dt, .src = mx.src, .src_row_stride = mx.src_row_stride,
            .rows = q.rows, .cols = q.cols, .q = mx.q, .q_row_stride = mx.q_row_stride,
            .scales = mx.scales, .scale_row_stride = mx.scale_row_stride};
    }
    return 0;
}

/* What plan_build gathers per device: the pair kernel's pairs (kp, kn of kcap) and the copy
 * engines' ops (in pl->ops, on of ocap); pairs of mmin bytes or more in one run, or rows of
 * such runs, go to the copy engines. */
typedef struct pbuild {
    rf_copy_pair **kp;
    uint64_t *kn, *kcap, *on, *ocap;
    uint64_t mmin;
} pbuild;

/* Pair p of item k of local message m, in batch b on device slot d: checked, then to the copy
 * engines or the pair kernel. */
static int add_pair(rf_xfer_local *t, pbuild *pb, uint32_t b, uint32_t d, const rf_xfer_msg *m,
                    uint32_t k, const rf_copy_pair *p)
{
    gplan *pl = &t->g->pl;
    rf_copy_pair_flat f;
    rf_err err = {0};
    int rc;

    if ((rc = rf_copy_pair_check(p, k, &err)) < 0)
        return fail(t, rc, "local message seq %u: %s", m->seq, err.msg);
    rf_copy_pair_flatten(p, &f);
    if ((f.n == 0 && f.bytes >= pb->mmin) ||
        (f.n == 1 && f.run >= pb->mmin / 8 && f.bytes >= pb->mmin &&
         f.sstr[0] >= (int64_t)f.run && f.dstr[0] >= (int64_t)f.run)) {
        if ((rc = grow(t, (void **)&pl->ops[d], &pb->ocap[d], pb->on[d] + 1, sizeof(ceop))) < 0)
            return rc;
        pl->bstat[b][BS_CE] += f.bytes;
        pl->ops[d][pb->on[d]++] = (ceop){
            .src = f.src, .dst = f.dst, .width = f.run,
            .height = f.n == 0 ? 1 : (uint64_t)f.ext[0],
            .spitch = f.n == 0 ? f.run : (uint64_t)f.sstr[0],
            .dpitch = f.n == 0 ? f.run : (uint64_t)f.dstr[0]};
        return 0;
    }
    if ((rc = grow(t, (void **)&pb->kp[d], &pb->kcap[d], pb->kn[d] + 1, sizeof(*p))) < 0)
        return rc;
    pb->kp[d][pb->kn[d]++] = *p;
    stat_pair(pl->bstat[b], &f);
    return 0;
}

/* Whether message m has an item this transport quantizes to FP8: its source side is then
 * quantized on the host to check it (verify_msg's windows). */
static bool quantized_here(const rf_xfer_msg *m)
{
    for (uint32_t k = 0; k < m->nitems; k++)
        if (m->items[k].quant.q.kind != 0 && m->src_items[k].piece.quant == 0)
            return true;
    return false;
}

/* One side of checked pair p as a segment of `bytes` payload bytes from offset off on (0: none),
 * appended to *segs (*n of *cap). */
static int add_seg(rf_xfer_local *t, rf_wdigest_seg **segs, uint64_t *n, uint64_t *cap,
                   const rf_copy_pair *p, bool dst_side, uint64_t off, uint64_t bytes,
                   uint32_t acc)
{
    rf_copy_pair_flat f;
    int rc;

    if (bytes == 0)
        return 0;
    if ((rc = grow(t, (void **)segs, cap, *n + 1, sizeof(**segs))) < 0)
        return rc;
    rf_copy_pair_flatten(p, &f);
    rf_wdigest_seg_walk(&(*segs)[(*n)++], dst_side ? f.dst : f.src, off, bytes, f.run, f.n,
                        f.ext, dst_side ? f.dstr : f.sstr, acc);
    return 0;
}

/* One side of verified message m, its first db payload bytes, as segments into accumulator
 * acc: each item's box (an FP8 source copied as it is: its elements, then its scales). */
static int msg_segs(rf_xfer_local *t, const rf_xfer_msg *m, uint64_t db, bool dst_side,
                    uint32_t acc, rf_wdigest_seg **segs, uint64_t *n, uint64_t *cap)
{
    int rc;

    for (uint32_t k = 0; k < m->nitems; k++) {
        const rf_xfer_item *s = &m->src_items[k], *dd = &m->items[k];
        rf_copy_pair p, sp;
        uint64_t lim, fp8;

        if (dd->msg_off >= db)
            continue;
        lim = dd->bytes < db - dd->msg_off ? dd->bytes : db - dd->msg_off;
        if (dd->quant.q.kind == 0) {
            rf_copy_desc_set(&p.src, s->base, &s->piece, s->ndim, s->esize, &s->box, 0);
            rf_copy_desc_set(&p.dst, dd->base, &dd->piece, dd->ndim, dd->esize, &dd->box, 0);
            if ((rc = add_seg(t, segs, n, cap, &p, dst_side, dd->msg_off, lim, acc)) < 0)
                return rc;
            continue;
        }
        rf_qcopy_bytes(&dd->quant.q, dd->ndim, dd->quant.rows, dd->quant.cols, &dd->box, &fp8);
        rf_qcopy_descs(s, &p.src, &sp.src);
        rf_qcopy_descs(dd, &p.dst, &sp.dst);
        if ((rc = add_seg(t, segs, n, cap, &p, dst_side, dd->msg_off, lim < fp8 ? lim : fp8,
                          acc)) < 0 ||
            (lim > fp8 && (rc = add_seg(t, segs, n, cap, &sp, dst_side, dd->msg_off + fp8,
                                        lim - fp8, acc)) < 0))
            return rc;
    }
    return 0;
}

/* The GPU digests of the running job's verified messages (but those quantized here): per
 * device the segments of each batch's sources, then of its destinations, uploaded once. */
static int digest_plan(rf_xfer_local *t)
{
    const rf_xfer_job *job = t->base.job;
    gplan *pl = &t->g->pl;
    size_t nx = (size_t)pl->nbatches * pl->ndev + 1;
    rf_wdigest_seg **segs = NULL;
    uint64_t *n = NULL, *cap = NULL;
    uint32_t *nj = NULL;
    rf_wdigest_key key;
    rf_err err = {0};
    uint32_t d = 0;
    int rc = 0;

    rf_wdigest_key_derive(job->digest_seed, &key);
    pl->dplan = calloc(pl->ndev, sizeof(*pl->dplan));
    pl->dsrc = calloc(nx, sizeof(*pl->dsrc));
    pl->nsrc = calloc(nx, sizeof(*pl->nsrc));
    pl->ddst = calloc(nx, sizeof(*pl->ddst));
    pl->ndst = calloc(nx, sizeof(*pl->ndst));
    pl->dacc = calloc(nx, sizeof(*pl->dacc));
    pl->nacc = calloc(nx, sizeof(*pl->nacc));
    pl->macc = malloc((job->nmsgs ? job->nmsgs : 1) * sizeof(*pl->macc));
    segs = calloc(pl->ndev, sizeof(*segs));
    n = calloc(pl->ndev, sizeof(*n));
    cap = calloc(pl->ndev, sizeof(*cap));
    nj = calloc(pl->ndev, sizeof(*nj));
    for (int j = 0; j < 12; j++)
        rf_xfer__local_alloc(t, 0);
    if (!pl->dplan || !pl->dsrc || !pl->nsrc || !pl->ddst || !pl->ndst || !pl->dacc ||
        !pl->nacc || !pl->macc || !segs || !n || !cap || !nj) {
        rc = fail(t, -ENOMEM, "out of memory planning the digests of %u local messages",
                  job->nmsgs);
        goto out;
    }
    for (uint32_t i = 0; i < job->nmsgs; i++)
        pl->macc[i] = UINT32_MAX;
    for (uint32_t b = 0; b < pl->nbatches; b++) {
        for (d = 0; d < pl->ndev; d++) {
            size_t x = (size_t)b * pl->ndev + d;
            uint32_t j0 = nj[d];

            pl->dacc[x] = 2 * j0;
            for (int side = 0; side < 2; side++) {
                uint32_t j = j0;

                (side ? pl->ddst : pl->dsrc)[x] = n[d];
                for (uint32_t i = pl->bmsg[b]; i < pl->bmsg[b + 1]; i++) {
                    const rf_xfer_msg *m = &job->msgs[i];

                    if (pl->mdev[i] != d || !rf_xfer_msg_verified(job, m) || m->bytes == 0 ||
                        quantized_here(m))
                        continue;
                    pl->macc[i] = j;
                    if ((rc = msg_segs(t, m, rf_xfer_msg_digest_bytes(job, m), side == 1,
                                       2 * j + (uint32_t)side, &segs[d], &n[d], &cap[d])) < 0)
                        goto out;
                    j++;
                }
                (side ? pl->ndst : pl->nsrc)[x] = n[d] - (side ? pl->ddst : pl->dsrc)[x];
                nj[d] = j;
            }
            pl->nacc[x] = 2 * nj[d] - pl->dacc[x];
        }
    }
    for (d = 0; d < pl->ndev; d++) {
        gdev *G = &t->g->devs[d];

        if (nj[d] == 0)
            continue;
        if ((rc = dev_digest_ready(t, G)) < 0)
            goto out;
        if (cudaSetDevice(G->dev) != cudaSuccess ||
            (rc = rf_wdigest_cuda_plan_new(&key, segs[d], n[d], 2 * nj[d], &pl->dplan[d],
                                           &err)) < 0) {
            rc = fail(t, rc < 0 ? rc : -EIO, "uploading %llu digest segments to GPU %d: %s",
                      (unsigned long long)n[d], G->dev, err.msg);
            goto out;
        }
        rf_xfer__local_alloc(t, (int64_t)rf_wdigest_cuda_plan_bytes(pl->dplan[d]));
        pl->bytes += rf_wdigest_cuda_plan_bytes(pl->dplan[d]);
    }
    memcpy(pl->seed, job->digest_seed, sizeof(pl->seed));
out:
    sodium_memzero(&key, sizeof(key));
    for (d = 0; segs && d < pl->ndev; d++)
        free(segs[d]);
    free(segs);
    free(n);
    free(cap);
    free(nj);
    return rc;
}

/* Derives the plan of execution of the running job. */
static int plan_build(rf_xfer_local *t)
{
    const rf_xfer_job *job = t->base.job;
    gplan *pl = &t->g->pl;
    pbuild pb = {.mmin = t->gpu_memcpy_min ? t->gpu_memcpy_min : MEMCPY_MIN};
    rf_copy_pair p;
    rf_quant_cuda_op **qp = NULL;
    uint64_t *qn = NULL, *qcap = NULL;
    uint64_t batch_bytes = 0;
    uint64_t batch = t->gpu_batch ? t->gpu_batch : BATCH;
    vbuild vb = {0};
    rf_err err;
    uint32_t i, k, d, b;
    int rc = 0;

    plan_free(t);
    pl->nmsgs = job->nmsgs;
    pl->mdev = malloc((job->nmsgs ? job->nmsgs : 1) * sizeof(*pl->mdev));
    pl->bmsg = malloc(((size_t)job->nmsgs + 2) * sizeof(*pl->bmsg));
    rf_xfer__local_alloc(t, 0);
    rf_xfer__local_alloc(t, 0);
    if (!pl->mdev || !pl->bmsg) {
        rc = fail(t, -ENOMEM, "out of memory planning %u local messages", job->nmsgs);
        goto out;
    }
    /* Devices: every item's destination on its message's device, sources readable from it. */
    for (i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        int md = -1;

        for (k = 0; k < m->nitems; k++) {
            int dd, sd;

            if ((rc = device_of(t, m->items[k].base, "destination", m->seq, &dd)) < 0 ||
                (rc = device_of(t, m->src_items[k].base, "source", m->seq, &sd)) < 0)
                goto out;
            if (md >= 0 && dd != md) {
                rc = fail(t, -EINVAL, "local message seq %u writes to GPU %d and GPU %d; a "
                          "message has one destination GPU: the job was built wrong", m->seq,
                          md, dd);
                goto out;
            }
            md = dd;
            if ((rc = peer_access(t, dd, sd)) < 0)
                goto out;
        }
        if (md < 0 && (rc = cudaGetDevice(&md)) != cudaSuccess) {
            rc = fail(t, -EIO, "cudaGetDevice failed");
            goto out;
        }
        if ((rc = dev_slot(t, md, &pl->mdev[i])) < 0)
            goto out;
    }
    pl->ndev = t->g->ndevs;
    /* Batches: messages in job order, cut after BATCH bytes. */
    pl->nbatches = 0;
    pl->bmsg[0] = 0;
    for (i = 0; i < job->nmsgs; i++) {
        batch_bytes += job->msgs[i].bytes;
        if (batch_bytes >= batch || i + 1 == job->nmsgs) {
            pl->bmsg[++pl->nbatches] = i + 1;
            batch_bytes = 0;
        }
    }
    pl->kplan = calloc(pl->ndev, sizeof(*pl->kplan));
    pl->ops = calloc(pl->ndev, sizeof(*pl->ops));
    pl->kfirst = calloc((size_t)pl->nbatches * pl->ndev + 1, sizeof(uint64_t));
    pl->kcount = calloc((size_t)pl->nbatches * pl->ndev + 1, sizeof(uint64_t));
    pl->ofirst = calloc((size_t)pl->nbatches * pl->ndev + 1, sizeof(uint64_t));
    pl->ocount = calloc((size_t)pl->nbatches * pl->ndev + 1, sizeof(uint64_t));
    pl->qplan = calloc(pl->ndev, sizeof(*pl->qplan));
    pl->qfirst = calloc((size_t)pl->nbatches * pl->ndev + 1, sizeof(uint64_t));
    pl->qcount = calloc((size_t)pl->nbatches * pl->ndev + 1, sizeof(uint64_t));
    pl->uneed = calloc(pl->ndev, sizeof(uint64_t));
    pl->bwin = calloc((size_t)pl->nbatches + 1, sizeof(uint32_t));
    pl->bstat = calloc((size_t)pl->nbatches + 1, sizeof(*pl->bstat));
    pb.kp = calloc(pl->ndev, sizeof(*pb.kp));
    pb.kn = calloc(pl->ndev, sizeof(*pb.kn));
    pb.kcap = calloc(pl->ndev, sizeof(*pb.kcap));
    pb.on = calloc(pl->ndev, sizeof(*pb.on));
    pb.ocap = calloc(pl->ndev, sizeof(*pb.ocap));
    qp = calloc(pl->ndev, sizeof(*qp));
    qn = calloc(pl->ndev, sizeof(*qn));
    qcap = calloc(pl->ndev, sizeof(*qcap));
    for (int j = 0; j < 12; j++)
        rf_xfer__local_alloc(t, 0);
    if (!pl->kplan || !pl->ops || !pl->kfirst || !pl->kcount || !pl->ofirst || !pl->ocount ||
        !pl->qplan || !pl->qfirst || !pl->qcount || !pl->uneed || !pl->bwin || !pl->bstat ||
        !pb.kp || !pb.kn || !pb.kcap || !pb.on || !pb.ocap || !qp || !qn || !qcap) {
        rc = fail(t, -ENOMEM, "out of memory planning %u local messages", job->nmsgs);
        goto out;
    }
    /* Each pair to the kernel or the copy engines, in batch order per device. */
    for (b = 0; b < pl->nbatches; b++) {
        for (d = 0; d < pl->ndev; d++) {
            pl->kfirst[(size_t)b * pl->ndev + d] = pb.kn[d];
            pl->ofirst[(size_t)b * pl->ndev + d] = pb.on[d];
            pl->qfirst[(size_t)b * pl->ndev + d] = qn[d];
        }
        for (i = pl->bmsg[b]; i < pl->bmsg[b + 1]; i++) {
            const rf_xfer_msg *m = &job->msgs[i];

            d = pl->mdev[i];
            for (k = 0; k < m->nitems; k++) {
                const rf_xfer_item *s = &m->src_items[k], *dd = &m->items[k];

                if (dd->quant.q.kind != 0) {
                    /* FP8 (issue 15): quantized from the source's rows into the piece. */
                    rf_err_clear(&err);
                    if ((rc = rf_qcopy_check(s, false, &err)) < 0 ||
                        (rc = rf_qcopy_check(dd, true, &err)) < 0) {
                        rc = fail(t, rc, "local message seq %u: FP8 item %u %s", m->seq, k,
                                  err.msg);
                        goto out;
                    }
                    if (s->piece.quant != 0) {
                        /* An FP8 source of the same format (the slice checked both ends
                         * against the transfer's): its elements and its blocks' scales
                         * copied as they are, two pairs. */
                        rf_copy_pair sp;

                        rf_qcopy_descs(s, &p.src, &sp.src);
                        rf_qcopy_descs(dd, &p.dst, &sp.dst);
                        if ((rc = add_pair(t, &pb, b, d, m, k, &p)) < 0 ||
                            (rc = add_pair(t, &pb, b, d, m, k, &sp)) < 0)
                            goto out;
                        continue;
                    }
                    if ((rc = add_qops(t, m, s, dd, &qp[d], &qn[d], &qcap[d])) < 0)
                        goto out;
                    pl->bstat[b][BS_QUANT] += dd->bytes;
                    continue;
                }
                rf_copy_desc_set(&p.src, s->base, &s->piece, s->ndim, s->esize, &s->box, 0);
                rf_copy_desc_set(&p.dst, dd->base, &dd->piece, dd->ndim, dd->esize, &dd->box, 0);
                if ((rc = add_pair(t, &pb, b, d, m, k, &p)) < 0)
                    goto out;
            }
        }
        for (d = 0; d < pl->ndev; d++) {
            pl->kcount[(size_t)b * pl->ndev + d] = pb.kn[d] - pl->kfirst[(size_t)b * pl->ndev + d];
            pl->ocount[(size_t)b * pl->ndev + d] = pb.on[d] - pl->ofirst[(size_t)b * pl->ndev + d];
            pl->qcount[(size_t)b * pl->ndev + d] = qn[d] - pl->qfirst[(size_t)b * pl->ndev + d];
        }
    }
    /* The kernel's descriptors go to their devices once. */
    for (d = 0; d < pl->ndev; d++) {
        rf_err_clear(&err);
        if (cudaSetDevice(t->g->devs[d].dev) != cudaSuccess ||
            (rc = rf_copy_cuda_plan_new(pb.kp[d], pb.kn[d], &pl->kplan[d], &err)) < 0) {
            rc = fail(t, rc < 0 ? rc : -EIO, "uploading %llu copy descriptors to GPU %d: %s",
                      (unsigned long long)pb.kn[d], t->g->devs[d].dev, err.msg);
            goto out;
        }
        rf_xfer__local_alloc(t, (int64_t)rf_copy_cuda_plan_bytes(pl->kplan[d]));
        pl->bytes += rf_copy_cuda_plan_bytes(pl->kplan[d]);
        if (qn[d] == 0)
            continue;
        if ((rc = rf_quant_cuda_plan_new(qp[d], qn[d], &pl->qplan[d], &err)) < 0) {
            rc = fail(t, rc, "uploading %llu FP8 matrices to GPU %d: %s",
                      (unsigned long long)qn[d], t->g->devs[d].dev, err.msg);
            goto out;
        }
        rf_xfer__local_alloc(t, (int64_t)rf_quant_cuda_plan_bytes(pl->qplan[d]));
        pl->bytes += rf_quant_cuda_plan_bytes(pl->qplan[d]);
        if (rf_log_get_level() >= RF_LOG_DEBUG) {
            uint64_t scalar, tiles = rf_quant_cuda_plan_tiles(pl->qplan[d], &scalar);

            RF_DEBUG("local GPU plan: %llu FP8 matrices on GPU %d, %llu tiles, %llu of them "
                     "read element by element", (unsigned long long)qn[d], t->g->devs[d].dev,
                     (unsigned long long)tiles, (unsigned long long)scalar);
        }
    }
    /* Verification: on the GPU, but messages quantized here, whose bytes are gathered to the
     * host window by window per batch. */
    if (job->verify != RF_VERIFY_OFF) {
        if ((rc = digest_plan(t)) < 0)
            goto out;
        for (b = 0; b < pl->nbatches; b++) {
            pl->bwin[b] = (uint32_t)vb.nwin;
            for (i = pl->bmsg[b]; i < pl->bmsg[b + 1]; i++) {
                const rf_xfer_msg *m = &job->msgs[i];

                if (rf_xfer_msg_verified(job, m) && m->bytes > 0 && quantized_here(m) &&
                    (rc = verify_msg(t, pl, &vb, i, rf_xfer_msg_digest_bytes(job, m))) < 0)
                    goto out;
            }
            /* A batch's windows are its own: they are digested when it is enqueued (source)
             * and when it retires (destination). */
            vb.open = false;
        }
        pl->bwin[pl->nbatches] = (uint32_t)vb.nwin;
        if (vb.utmp > 0) {
            if (!(pl->utmp = malloc(vb.utmp))) {
                rc = fail(t, -ENOMEM, "out of memory planning FP8 verification");
                goto out;
            }
            rf_xfer__local_alloc(t, 0);
        }
    }
    pl->key = job->plan_key;
    pl->verify = job->verify;
    pl->batch = batch;
    pl->memcpy_min = pb.mmin;
    pl->valid = true;
out:
    for (d = 0; pb.kp && d < pl->ndev; d++)
        free(pb.kp[d]);
    free(pb.kp);
    free(pb.kn);
    free(pb.kcap);
    free(pb.on);
    free(pb.ocap);
    for (d = 0; qp && d < pl->ndev; d++)
        free(qp[d]);
    free(qp);
    free(qn);
    free(qcap);
    free(vb.o);
    if (rc < 0)
        plan_free(t);
    return rc;
}

/* ---- the job ---- */

/* The source side of FP8 unit qu (its bf16 rows copied down into G's ubounce): quantized on
 * the host, and its bytes that lie in its segment put into the bounce where the payload has
 * them. */
static int quant_unit(rf_xfer_local *t, const gdev *G, const qunit *qu)
{
    const gplan *pl = &t->g->pl;
    const vseg *sg = &pl->segs[qu->seg];
    const rf_xfer_msg *m = &t->g->job->msgs[sg->msg];
    const rf_xfer_item *d = &m->items[qu->item];
    qshape q = qshape_of(d);
    uint64_t l = qu->u / q.srows, i = qu->u % q.srows, r0 = i * q.bh;
    uint64_t nr = q.rows - r0 < q.bh ? q.rows - r0 : q.bh;
    /* The unit's two runs of payload bytes (item-relative) and where they are in utmp. */
    uint64_t at[2] = {l * q.rows * q.cols + r0 * q.cols,
                      q.fp8 + (l * q.srows + i) * q.scols * q.ses};
    uint64_t len[2] = {nr * q.cols, q.scols * q.ses}, from[2] = {0, nr * q.cols};
    rf_err err = {0};
    int rc;

    if ((rc = rf_quant_host(&q.f, d->quant.dt, G->ubounce + qu->uoff, (int64_t)q.cols, nr,
                            q.cols, pl->utmp, (int64_t)q.cols, pl->utmp + nr * q.cols,
                            (int64_t)q.scols, &err)) < 0)
        return fail(t, rc, "verifying local message seq %u: quantizing FP8 item %u on the host: "
                    "%s", m->seq, qu->item, err.msg);
    for (int k = 0; k < 2; k++) {
        uint64_t a = d->msg_off + at[k], b = a + len[k];

        a = a > sg->lo ? a : sg->lo;
        b = b < sg->hi ? b : sg->hi;
        if (a < b)
            memcpy(G->bounce + sg->off + PAD + (a - sg->lo),
                   pl->utmp + from[k] + (a - d->msg_off - at[k]), b - a);
    }
    return 0;
}

/* Digests the segments of windows [wa, wb): each gathered into its device's scratch, copied
 * down and handed to the message's digest, in payload order (a message's segments follow one
 * another, so its digest stays open from its first to its last). */
static int digest_wins(rf_xfer_local *t, uint32_t wa, uint32_t wb, bool dst_side)
{
    rf_xfer_lgpu *g = t->g;
    gplan *pl = &g->pl;
    const rf_xfer_job *job = g->job;
    rf_xfer_digest d = {0};
    rf_err err = {0};
    uint32_t w = wa;
    int rc = 0;

    for (; w < wb; w++) {
        const vwin *W = &pl->wins[w];
        gdev *G = &g->devs[W->dev];

        CUDA_TRY(&err, cudaSetDevice(G->dev));
        if ((rc = rf_copy_cuda_gather_buf(G->vbuf, dst_side ? pl->vdst + W->ddfirst
                                                            : pl->vsrc + W->sdfirst,
                                          dst_side ? W->ddcount : W->sdcount, G->scratch, G->vs,
                                          &err)) < 0)
            goto out;
        CUDA_TRY(&err, cudaMemcpyAsync(G->bounce, G->scratch, W->span, cudaMemcpyDeviceToHost,
                                       G->vs));
        if (!dst_side && W->udcount > 0) {
            /* The gathers share the buffer's descriptors: the first is waited for. */
            CUDA_TRY(&err, cudaStreamSynchronize(G->vs));
            if ((rc = rf_copy_cuda_gather_buf(G->vbuf, pl->vunit + W->udfirst, W->udcount,
                                              G->uscratch, G->vs, &err)) < 0)
                goto out;
            CUDA_TRY(&err, cudaMemcpyAsync(G->ubounce, G->uscratch, W->uspan,
                                           cudaMemcpyDeviceToHost, G->vs));
        }
        CUDA_TRY(&err, cudaStreamSynchronize(G->vs));
        for (uint64_t u = W->qfirst; !dst_side && u < W->qfirst + W->qcount; u++)
            if ((rc = quant_unit(t, G, &pl->units[u])) < 0)
                return rc;
        for (uint32_t s = W->sfirst; s < W->sfirst + W->scount; s++) {
            const vseg *sg = &pl->segs[s];

            if (sg->lo == 0) {
                if (!rf_xfer__digest_begin(&t->base, &job->msgs[sg->msg], &d))
                    continue;
                d.acc = dst_side ? t->base.result.digest_recv : t->base.result.digest_sent;
            }
            rf_xfer__digest_add(&d, G->bounce + sg->off + PAD, sg->hi - sg->lo);
            if (d.left == 0)
                rf_xfer__digest_end(&d);
        }
    }
out:
    if (rc < 0) {
        const vwin *W = &pl->wins[w];

        fail(t, rc, "verifying local message seq %u (%s side) on GPU %d: %s",
             job->msgs[pl->segs[W->sfirst].msg].seq, dst_side ? "destination" : "source",
             g->devs[W->dev].dev, err.msg);
    }
    return rc;
}

/* Enqueues batch b on every device: the sources it reads are digested first. */
static int enqueue(rf_xfer_local *t, uint32_t b)
{
    rf_xfer_lgpu *g = t->g;
    gplan *pl = &g->pl;
    rf_err err = {0};
    uint32_t d = 0;
    double t0 = rf_xfer__now();
    int rc = 0;

    if (pl->verify != RF_VERIFY_OFF &&
        (rc = digest_wins(t, pl->bwin[b], pl->bwin[b + 1], false)) < 0)
        return rc;
    g->t_verify += rf_xfer__now() - t0;
    t0 = rf_xfer__now();
    for (d = 0; d < pl->ndev; d++) {
        gdev *G = &g->devs[d];
        size_t x = (size_t)b * pl->ndev + d;
        cudaStream_t cs = G->s[b % NSTREAMS], qs = G->s[(b + 1) % NSTREAMS];

        CUDA_TRY(&err, cudaSetDevice(G->dev));
        /* The sources are digested beside the copies that read them (they are never written). */
        if (pl->dplan && pl->dplan[d] &&
            ((rc = rf_wdigest_cuda_zero(pl->dplan[d], pl->dacc[x], pl->nacc[x], G->ds,
                                        &err)) < 0 ||
             (rc = rf_wdigest_cuda_run(pl->dplan[d], pl->dsrc[x], pl->nsrc[x], G->ds,
                                       &err)) < 0))
            goto out;
        if ((rc = rf_copy_cuda_plan_launch(pl->kplan[d], pl->kfirst[x], pl->kcount[x], cs, 0,
                                           &err)) < 0)
            goto out;
        if (pl->qcount[x] > 0 &&
            (rc = rf_quant_cuda_plan_launch(pl->qplan[d], pl->qfirst[x], pl->qcount[x], qs,
                                            &err)) < 0)
            goto out;
        for (uint64_t o = pl->ofirst[x]; o < pl->ofirst[x] + pl->ocount[x]; o++) {
            const ceop *op = &pl->ops[d][o];

            if (op->height == 1)
                CUDA_TRY(&err, cudaMemcpyAsync(op->dst, op->src, op->width,
                                               cudaMemcpyDeviceToDevice, cs));
            else
                CUDA_TRY(&err, cudaMemcpy2DAsync(op->dst, op->dpitch, op->src, op->spitch,
                                                 op->width, op->height,
                                                 cudaMemcpyDeviceToDevice, cs));
        }
        for (int k = 0; k < NSTREAMS; k++)
            CUDA_TRY(&err, cudaEventRecord(G->ev[b % SLOTS][k], G->s[k]));
    }
    g->t_launch += rf_xfer__now() - t0;
out:
    if (rc < 0)
        fail(t, rc, "enqueuing local copies of messages seq %u to %u on GPU %d: %s",
             g->job->msgs[pl->bmsg[b]].seq, g->job->msgs[pl->bmsg[b + 1] - 1].seq,
             g->devs[d < pl->ndev ? d : 0].dev, err.msg);
    return rc;
}

/* 1 when batch b finished on every device, 0 when not yet, or the error. */
static int batch_done(rf_xfer_local *t, uint32_t b)
{
    rf_xfer_lgpu *g = t->g;
    rf_err err = {0};
    uint32_t d;
    int rc = 0;

    for (d = 0; d < g->pl.ndev; d++) {
        for (int k = 0; k < NSTREAMS; k++) {
            cudaError_t e = cudaEventQuery(g->devs[d].ev[b % SLOTS][k]);

            if (e == cudaErrorNotReady)
                return 0;
            CUDA_TRY(&err, e);
        }
    }
    return 1;
out:
    return fail(t, rc, "local copies of messages seq %u to %u on GPU %d: %s",
                g->job->msgs[g->pl.bmsg[b]].seq, g->job->msgs[g->pl.bmsg[b + 1] - 1].seq,
                g->devs[d].dev, err.msg);
}

int rf_xfer__lgpu_start(rf_xfer_local *t)
{
    const rf_xfer_job *job = t->base.job;
    rf_xfer_lgpu *g = t->g;
    int rc;

    if (!g) {
        if (!(g = t->g = calloc(1, sizeof(*g))))
            return fail(t, -ENOMEM, "out of memory for the GPU local transport");
        rf_xfer__local_alloc(t, 0);
    }
    g->job = job;
    if (!g->pl.valid || job->plan_key == 0 || g->pl.key != job->plan_key ||
        g->pl.verify != job->verify || g->pl.nmsgs != job->nmsgs ||
        g->pl.batch != (t->gpu_batch ? t->gpu_batch : BATCH) ||
        g->pl.memcpy_min != (t->gpu_memcpy_min ? t->gpu_memcpy_min : MEMCPY_MIN) ||
        (job->verify != RF_VERIFY_OFF &&
         memcmp(g->pl.seed, job->digest_seed, sizeof(g->pl.seed)) != 0)) {
        /* Pointers may have been unmapped and mapped again elsewhere since the last plan. */
        for (uint32_t i = 0; i < g->pcap; i++)
            g->ptab[i].dev = -1;
        g->pcount = 0;
        g->t0 = rf_xfer__now();
        if ((rc = plan_build(t)) < 0)
            return rc;
        g->t_plan = rf_xfer__now() - g->t0;
    } else {
        g->t_plan = 0;
    }
    g->t0 = rf_xfer__now() - g->t_plan;
    g->t_launch = g->t_verify = g->t_copied = 0;
    /* The host path's scratch only where a message quantized here is verified. */
    if (job->verify != RF_VERIFY_OFF && g->pl.bwin[g->pl.nbatches] > 0)
        for (uint32_t d = 0; d < g->pl.ndev; d++)
            if ((rc = dev_verify_ready(t, &g->devs[d], g->pl.uneed[d])) < 0)
                return rc;
    g->lo = g->hi = 0;
    g->dst_digests = false;
    return 0;
}

/* Once every batch retired: the destinations are digested as the whole job left them (a
 * destination another message overwrote, in this batch or a later one, no longer matches its
 * source's digest), then every message's two accumulators are folded. 1 when done, 0 while
 * the digests run, or the error. */
static int dst_digests(rf_xfer_local *t)
{
    rf_xfer_lgpu *g = t->g;
    gplan *pl = &g->pl;
    uint32_t last = pl->nbatches - 1, d = 0;
    rf_err err = {0};
    int rc = 0;

    if (!pl->dplan || pl->nbatches == 0)
        return 1;
    if (!g->dst_digests) {
        for (d = 0; d < pl->ndev; d++) {
            gdev *G = &g->devs[d];

            if (!pl->dplan[d])
                continue;
            CUDA_TRY(&err, cudaSetDevice(G->dev));
            /* The last batch's events follow every copy of the job on both streams. */
            for (int k = 0; k < NSTREAMS; k++)
                CUDA_TRY(&err, cudaStreamWaitEvent(G->ds, G->ev[last % SLOTS][k], 0));
            for (uint32_t b = 0; b < pl->nbatches; b++) {
                size_t x = (size_t)b * pl->ndev + d;

                if ((rc = rf_wdigest_cuda_run(pl->dplan[d], pl->ddst[x], pl->ndst[x], G->ds,
                                              &err)) < 0 ||
                    (rc = rf_wdigest_cuda_fetch(pl->dplan[d], pl->dacc[x], pl->nacc[x],
                                                G->ds, &err)) < 0)
                    goto out;
            }
            CUDA_TRY(&err, cudaEventRecord(G->evd[0], G->ds));
        }
        g->dst_digests = true;
    }
    for (d = 0; d < pl->ndev; d++) {
        cudaError_t e;

        if (!pl->dplan[d])
            continue;
        e = cudaEventQuery(g->devs[d].evd[0]);
        if (e == cudaErrorNotReady) {
            nap();
            return 0;
        }
        CUDA_TRY(&err, e);
    }
    for (uint32_t i = 0; i < pl->nmsgs; i++) {
        rf_wdigest_acc acc;

        if (pl->macc[i] == UINT32_MAX)
            continue;
        rf_wdigest_cuda_result(pl->dplan[pl->mdev[i]], 2 * pl->macc[i], &acc);
        rf_xfer__wdigest_fold(&t->base, &g->job->msgs[i], true, &acc);
        rf_wdigest_cuda_result(pl->dplan[pl->mdev[i]], 2 * pl->macc[i] + 1, &acc);
        rf_xfer__wdigest_fold(&t->base, &g->job->msgs[i], false, &acc);
    }
    return 1;
out:
    return fail(t, rc, "digesting the destinations of local copies on GPU %d: %s",
                g->devs[d < pl->ndev ? d : 0].dev, err.msg);
}

/* Enqueues what the window of batches allows, then retires the oldest if it finished. */
int rf_xfer__lgpu_progress(rf_xfer_local *t, double wait_s)
{
    rf_xfer_lgpu *g = t->g;
    gplan *pl = &g->pl;
    double tv;
    int rc;

    (void)wait_s;
    while (g->hi < pl->nbatches && g->hi < g->lo + SLOTS) {
        if (rf_xfer__stop(&t->base) != 0)
            return 0;
        if ((rc = enqueue(t, g->hi)) < 0)
            return rc;
        g->hi++;
    }
    if (g->lo == pl->nbatches)
        return dst_digests(t);
    if ((rc = batch_done(t, g->lo)) <= 0) {
        if (rc == 0)
            nap();
        return rc;
    }
    g->t_copied = rf_xfer__now() - g->t0;
    pl->bstat[g->lo][BS_DONE_NS] = (uint64_t)(g->t_copied * 1e9);
    tv = rf_xfer__now();
    if (pl->verify != RF_VERIFY_OFF &&
        (rc = digest_wins(t, pl->bwin[g->lo], pl->bwin[g->lo + 1], true)) < 0)
        return rc;
    g->t_verify += rf_xfer__now() - tv;
    for (uint32_t i = pl->bmsg[g->lo]; i < pl->bmsg[g->lo + 1]; i++)
        rf_xfer__moved(&t->base, &g->job->msgs[i]);
    g->lo++;
    return g->lo == pl->nbatches ? dst_digests(t) : 0;
}

void rf_xfer__lgpu_describe(rf_xfer_local *t, char *buf, size_t len)
{
    rf_xfer_lgpu *g = t->g;
    const gplan *pl = g ? &g->pl : NULL;

    if (!pl || !pl->valid || g->lo >= pl->nbatches) {
        snprintf(buf, len, "nothing");
        return;
    }
    const rf_xfer_msg *m = &g->job->msgs[pl->bmsg[g->lo]];
    snprintf(buf, len, "batch %u of %u of local GPU copies unfinished (messages seq %u to %u, "
             "the first from the trainers of peer %u), %llu bytes copied", g->lo, pl->nbatches,
             m->seq, g->job->msgs[pl->bmsg[g->lo + 1] - 1].seq, m->peer,
             (unsigned long long)t->base.result.bytes_recv);
}

/* Nothing of the job may still run once its done is called: a failed job waits for what was
 * enqueued (copies cannot be recalled; a few batches at most). */
void rf_xfer__lgpu_finish(rf_xfer_local *t, int rc)
{
    rf_xfer_lgpu *g = t->g;

    if (!g)
        return;
    if (rc < 0) {
        for (uint32_t d = 0; d < g->ndevs; d++) {
            if (!g->devs[d].ready)
                continue;
            cudaSetDevice(g->devs[d].dev);
            for (int k = 0; k < NSTREAMS; k++)
                cudaStreamSynchronize(g->devs[d].s[k]);
            cudaStreamSynchronize(g->devs[d].vs);
            if (g->devs[d].dready)
                cudaStreamSynchronize(g->devs[d].ds);
        }
        /* A failed CUDA call leaves its error for the next call to report. */
        cudaGetLastError();
        RF_WARN("local job of version %llu failed: %s",
                (unsigned long long)t->base.job->version, t->base.result.error);
    }
    else
        RF_DEBUG("local GPU job of version %llu: %llu bytes in %u batches on %u GPUs, %.2f ms: "
                 "plan %.2f ms%s, launches %.2f ms, digests %.2f ms, last batch ended at "
                 "%.2f ms", (unsigned long long)t->base.job->version,
                 (unsigned long long)t->base.result.bytes_recv, g->pl.nbatches, g->pl.ndev,
                 (rf_xfer__now() - g->t0) * 1e3, g->t_plan * 1e3,
                 g->t_plan > 0 ? " (built)" : " (kept)", g->t_launch * 1e3,
                 g->t_verify * 1e3, g->t_copied * 1e3);
    for (uint32_t b = 0; rc == 0 && rf_log_get_level() >= RF_LOG_DEBUG && b < g->pl.nbatches;
         b++) {
        const uint64_t *st = g->pl.bstat[b];

        RF_DEBUG("  batch %u: done at %.2f ms; kernel %llu pairs (shortest run %llu B), MB by "
                 "access width 1/2/4/8/16 B: %.1f/%.1f/%.1f/%.1f/%.1f; copy engines %.1f MB; "
                 "quantized to FP8 %.1f MB", b, (double)st[BS_DONE_NS] / 1e6,
                 (unsigned long long)st[BS_PAIRS], (unsigned long long)st[BS_MINRUN],
                 st[0] / 1e6, st[1] / 1e6, st[2] / 1e6, st[3] / 1e6, st[4] / 1e6,
                 st[BS_CE] / 1e6, st[BS_QUANT] / 1e6);
    }
    if (rc < 0 || t->base.job->plan_key == 0)
        plan_free(t);
    g->job = NULL;
}

void rf_xfer__lgpu_teardown(rf_xfer_local *t)
{
    rf_xfer_lgpu *g = t->g;

    if (!g)
        return;
    plan_free(t);
    for (uint32_t d = 0; d < g->ndevs; d++)
        dev_release(t, &g->devs[d]);
}

void rf_xfer__lgpu_release(rf_xfer_local *t)
{
    rf_xfer_lgpu *g = t->g;

    if (!g)
        return;
    plan_free(t);
    free(g->devs);
    free(g->ptab);
    free(g);
    t->g = NULL;
}
