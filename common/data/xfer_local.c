/* common/data/xfer_local.c - the local transport: RF_PLAN_LOCAL messages copied straight from the
 * memory of a trainer on this host (mapped here) into its engines' memory, no staging, no
 * network. This file holds the backend both memories share and the host part: memcpy of runs
 * split into units that a pool of threads, kept between jobs, takes in message order. The GPU
 * part is xfer_local_cuda.c. */
#define RF_LOG_MODULE "xfer_local"
#include "xfer_local_int.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "copy.h"
#include "macros.h"
#include "qcopy.h"

#ifdef RF_HAVE_CUDA
#include "drv_cuda.h"
#endif

/* Bytes per unit of work. An abort or the deadline waits for at most one unit per thread
 * (about a millisecond at a few GB/s per thread), and the units of a 1 GB refit are enough to
 * keep every thread busy to the end. */
#define CHUNK (4u << 20)
/* Jobs smaller than this run on the worker alone: waking the pool costs tens of microseconds,
 * which a copy of a few megabytes does not repay. */
#define PAR_MIN (32u << 20)
/* Threads by default, the worker included: memcpy saturates a socket's memory bandwidth with a
 * handful of threads, and more only compete with the engines and trainers on this host. */
#define AUTO_THREADS 8
/* A progress step copies this long before it reaps finished messages and returns, so that
 * rf_xfer_progress moves and the core sees an abort. */
#define STEP_S 0.005
/* How long the worker naps while the pool finishes the last units. */
#define POLL_NS 20000L

/* One unit: bytes [lo, hi) of message msg's packed payload. A head unit is the digested part
 * of a verified message, [0, digest bytes): one thread digests its source, copies it and
 * digests its destination, in order. */
typedef struct unit {
    uint32_t msg;
    bool head;
    uint64_t lo, hi;
} unit;

/* The host part's state: what a job's messages reduce to, kept for the next job with the same
 * plan_key and verify setting, and the pool. */
typedef struct rf_xfer_lhost {
    /* ---- kept per plan_key ---- */
    uint64_t key;
    int verify;
    bool valid;
    uint32_t nmsgs;
    rf_copy_pair_flat *flat; /* every item, message by message, each message's by msg_off */
    uint64_t *foff;          /* msg_off of each */
    uint32_t *mfirst;        /* nmsgs + 1: each message's items in flat */
    unit *units;
    uint32_t nunits;
    /* Messages with FP8 items (issue 15) go item by item (an FP8 item is quantized whole
     * into a buffer and installed from it): imode per message, and each flat's item index. */
    bool *imode;
    uint32_t *fk;
    _Atomic int qerr;        /* this job: -ENOMEM from an FP8 item's buffer */
    _Atomic uint64_t *left;  /* per message: bytes not yet copied in this job */
    uint64_t total;

    /* ---- this job (worker; the pool reads) ---- */
    const rf_xfer_job *job;
    uint32_t reaped;         /* messages counted done, in order */
    _Atomic uint32_t next;   /* next unit to take */
    _Atomic bool stop;       /* the pool takes no more units */
    uint8_t acc[RF_XFER_LOCAL_MAX_THREADS][2][RF_XFER_DIGEST_BYTES]; /* per thread: sent, recv */

    /* ---- the pool ---- */
    bool pool_ready;
    pthread_mutex_t mu;
    pthread_cond_t cv, idle;
    uint64_t gen;            /* bumped for each job the pool joins */
    bool quit;
    unsigned busy;           /* helpers inside a job */
    unsigned active;         /* helpers this job uses */
    unsigned nth;            /* helpers started */
    pthread_t th[RF_XFER_LOCAL_MAX_THREADS - 1];
    struct helper_arg {
        rf_xfer_local *t;
        unsigned idx;        /* 1..: its digest slot */
    } args[RF_XFER_LOCAL_MAX_THREADS - 1];
} lhost;

#define fail(t, ...) rf_xfer__fail(&(t)->base, __VA_ARGS__)

void rf_xfer__local_alloc(rf_xfer_local *t, int64_t dev_bytes)
{
    if (dev_bytes >= 0)
        atomic_fetch_add(&t->allocs, 1);
    if (dev_bytes != 0) {
        uint64_t now = atomic_fetch_add(&t->mem_now, (uint64_t)dev_bytes) + (uint64_t)dev_bytes;
        uint64_t peak = atomic_load(&t->mem_peak);

        while (now > peak && !atomic_compare_exchange_weak(&t->mem_peak, &peak, now))
            ;
    }
}

static void *counted_malloc(rf_xfer_local *t, size_t n)
{
    rf_xfer__local_alloc(t, 0);
    return malloc(n ? n : 1);
}

/* ---- the kept plan ---- */

static void plan_free(lhost *h)
{
    free(h->flat);
    free(h->foff);
    free(h->mfirst);
    free(h->units);
    free(h->left);
    free(h->imode);
    free(h->fk);
    h->imode = NULL;
    h->fk = NULL;
    h->flat = NULL;
    h->foff = NULL;
    h->mfirst = NULL;
    h->units = NULL;
    h->left = NULL;
    h->nunits = h->nmsgs = 0;
    h->valid = false;
    h->key = 0;
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

/* The units of item-mode message i (its flats in place): whole items, the head the items
 * that hold the digested part [0, d). */
static void item_units(lhost *h, uint32_t i, uint64_t d, uint32_t last)
{
    uint32_t e = h->mfirst[i], end = e;
    uint64_t hi = 0;

    while (end < last && h->foff[end] < d) {
        hi = h->foff[end] + h->flat[end].bytes;
        end++;
    }
    if (end > e)
        h->units[h->nunits++] = (unit){.msg = i, .head = true, .lo = 0, .hi = hi};
    for (; end < last; end++)
        h->units[h->nunits++] = (unit){.msg = i, .lo = h->foff[end],
                                       .hi = h->foff[end] + h->flat[end].bytes};
}

/* Reduces every item pair once (rf_copy_pair_flatten) in packed order, and cuts the messages
 * into units. The job may have been checked long ago (a cached slice): the pairs are checked
 * again here, as the tcp transport checks its items when it reduces them. */
static int plan_build(rf_xfer_local *t, const rf_xfer_job *job)
{
    lhost *h = t->host;
    uint64_t nitems = 0, nunits = 0, n = 0;
    ord *o = NULL;
    uint32_t maxn = 1, i, k;
    rf_copy_pair p;
    rf_err err;
    int rc = 0;

    plan_free(h);
    for (i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        uint64_t d = rf_xfer_msg_verified(job, m) ? rf_xfer_msg_digest_bytes(job, m) : 0;

        nitems += m->nitems;
        maxn = m->nitems > maxn ? m->nitems : maxn;
        nunits += (d > 0) + (m->bytes - d + CHUNK - 1) / CHUNK + m->nitems;
    }
    if (nunits > UINT32_MAX || nitems > UINT32_MAX)
        return fail(t, -E2BIG, "a local job of %llu items in %llu units of %u MiB; split the "
                    "plan", (unsigned long long)nitems, (unsigned long long)nunits, CHUNK >> 20);
    h->flat = counted_malloc(t, nitems * sizeof(*h->flat));
    h->foff = counted_malloc(t, nitems * sizeof(*h->foff));
    h->mfirst = counted_malloc(t, ((size_t)job->nmsgs + 1) * sizeof(*h->mfirst));
    h->units = counted_malloc(t, nunits * sizeof(*h->units));
    h->left = counted_malloc(t, job->nmsgs * sizeof(*h->left));
    h->imode = counted_malloc(t, job->nmsgs * sizeof(*h->imode));
    h->fk = counted_malloc(t, nitems * sizeof(*h->fk));
    o = malloc(maxn * sizeof(*o));
    if (!h->flat || !h->foff || !h->mfirst || !h->units || !h->left || !h->imode || !h->fk ||
        !o) {
        rc = fail(t, -ENOMEM, "out of memory reducing a local job of %llu items",
                  (unsigned long long)nitems);
        goto out;
    }
    h->total = 0;
    for (i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        uint64_t d = rf_xfer_msg_verified(job, m) ? rf_xfer_msg_digest_bytes(job, m) : 0;

        h->mfirst[i] = (uint32_t)n;
        h->imode[i] = false;
        for (k = 0; k < m->nitems; k++) {
            o[k] = (ord){m->items[k].msg_off, k};
            h->imode[i] |= m->items[k].quant.q.kind != 0;
        }
        qsort(o, m->nitems, sizeof(*o), ord_cmp);
        for (k = 0; k < m->nitems; k++) {
            const rf_xfer_item *s = &m->src_items[o[k].k], *dd = &m->items[o[k].k];

            h->fk[n] = o[k].k;
            if (dd->quant.q.kind != 0) {
                rf_err_clear(&err);
                if ((rc = rf_qcopy_check(s, false, &err)) < 0 ||
                    (rc = rf_qcopy_check(dd, true, &err)) < 0) {
                    rc = fail(t, rc, "local message seq %u item %u: %s", m->seq, o[k].k,
                              err.msg);
                    goto out;
                }
                h->flat[n] = (rf_copy_pair_flat){.bytes = dd->bytes};
                h->foff[n++] = dd->msg_off;
                continue;
            }
            rf_copy_desc_set(&p.src, s->base, &s->piece, s->ndim, s->esize, &s->box, 0);
            rf_copy_desc_set(&p.dst, dd->base, &dd->piece, dd->ndim, dd->esize, &dd->box, 0);
            rf_err_clear(&err);
            if ((rc = rf_copy_pair_check(&p, o[k].k, &err)) < 0) {
                rc = fail(t, rc, "local message seq %u: %s", m->seq, err.msg);
                goto out;
            }
            rf_copy_pair_flatten(&p, &h->flat[n]);
            h->foff[n++] = dd->msg_off;
        }
        if (h->imode[i]) {
            item_units(h, i, d, (uint32_t)n);
            h->total += m->bytes;
            continue;
        }
        if (d > 0)
            h->units[h->nunits++] = (unit){.msg = i, .head = true, .lo = 0, .hi = d};
        for (uint64_t lo = d; lo < m->bytes; lo += CHUNK)
            h->units[h->nunits++] = (unit){.msg = i, .lo = lo,
                                           .hi = m->bytes - lo < CHUNK ? m->bytes : lo + CHUNK};
        h->total += m->bytes;
    }
    h->mfirst[job->nmsgs] = (uint32_t)n;
    h->nmsgs = job->nmsgs;
    h->key = job->plan_key;
    h->verify = job->verify;
    h->valid = true;
out:
    free(o);
    if (rc < 0)
        plan_free(h);
    return rc;
}

/* ---- copying and digesting a message's bytes ---- */

static void digest_fn(void *ctx, const uint8_t *p, uint64_t n)
{
    rf_xfer__digest_add(ctx, p, n);
}

/* Bytes [lo, hi) of message i's packing: copied (d NULL), or one side handed to digest d. */
static void msg_range(const lhost *h, uint32_t i, uint64_t lo, uint64_t hi, rf_xfer_digest *d,
                      bool dst_side)
{
    uint32_t a = h->mfirst[i], b = h->mfirst[i + 1];

    /* The first item that ends after lo. */
    while (a < b) {
        uint32_t mid = a + (b - a) / 2;

        if (h->foff[mid] + h->flat[mid].bytes <= lo)
            a = mid + 1;
        else
            b = mid;
    }
    for (uint32_t e = a; e < h->mfirst[i + 1] && h->foff[e] < hi; e++) {
        const rf_copy_pair_flat *f = &h->flat[e];
        uint64_t l = lo > h->foff[e] ? lo - h->foff[e] : 0;
        uint64_t r = hi - h->foff[e] < f->bytes ? hi - h->foff[e] : f->bytes;

        if (d)
            rf_copy_pair_visit(f, dst_side, l, r, digest_fn, d);
        else
            rf_copy_pair_range(f, l, r);
    }
}

static bool stopping(rf_xfer_local *t)
{
    return atomic_load_explicit(&t->host->stop, memory_order_relaxed) ||
           rf_xfer__stop(&t->base) != 0;
}

/* A unit of an item-mode message: its items whole, in payload order; an FP8 item quantized
 * into a buffer, installed from it and, digested, read back. */
static void item_unit(rf_xfer_local *t, const unit *u, unsigned slot)
{
    lhost *h = t->host;
    const rf_xfer_msg *m = &h->job->msgs[u->msg];
    rf_xfer_digest ds, dd;
    bool dig = u->head;

    if (dig) {
        if (!rf_xfer__digest_begin(&t->base, m, &ds) || !rf_xfer__digest_begin(&t->base, m, &dd))
            assert(!"a head unit belongs to a verified message");
        ds.acc = h->acc[slot][0];
        dd.acc = h->acc[slot][1];
    }
    for (uint32_t e = h->mfirst[u->msg]; e < h->mfirst[u->msg + 1]; e++) {
        const rf_copy_pair_flat *f = &h->flat[e];
        const rf_xfer_item *s = &m->src_items[h->fk[e]], *d = &m->items[h->fk[e]];
        uint8_t *buf;

        if (h->foff[e] < u->lo || h->foff[e] >= u->hi)
            continue;
        if (stopping(t))
            return;
        if (d->quant.q.kind == 0) {
            if (dig)
                rf_copy_pair_visit(f, false, 0, f->bytes, digest_fn, &ds);
            rf_copy_pair_range(f, 0, f->bytes);
            if (dig)
                rf_copy_pair_visit(f, true, 0, f->bytes, digest_fn, &dd);
            continue;
        }
        if ((buf = malloc(d->bytes ? d->bytes : 1)) == NULL) {
            atomic_store(&h->qerr, -ENOMEM);
            atomic_store(&h->stop, true);
            return;
        }
        rf_qcopy_pack(s, buf);
        if (dig)
            rf_xfer__digest_add(&ds, buf, d->bytes);
        rf_qcopy_unpack(d, buf);
        if (dig) {
            rf_qcopy_read(d, buf);
            rf_xfer__digest_add(&dd, buf, d->bytes);
        }
        free(buf);
    }
    if (dig) {
        rf_xfer__digest_end(&ds);
        rf_xfer__digest_end(&dd);
    }
    atomic_fetch_sub_explicit(&h->left[u->msg], u->hi - u->lo, memory_order_release);
}

/* Runs unit u on the calling thread (slot: its digest accumulators). */
static void do_unit(rf_xfer_local *t, const unit *u, unsigned slot)
{
    lhost *h = t->host;
    const rf_xfer_msg *m = &h->job->msgs[u->msg];
    rf_xfer_digest ds, dd;

    if (h->imode[u->msg]) {
        item_unit(t, u, slot);
        return;
    }
    if (!u->head) {
        msg_range(h, u->msg, u->lo, u->hi, NULL, false);
    } else {
        /* The source's bytes are digested before they are copied and the destination's
         * after, a chunk at a time so that an abort is not held up by a long message. */
        if (!rf_xfer__digest_begin(&t->base, m, &ds) || !rf_xfer__digest_begin(&t->base, m, &dd))
            assert(!"a head unit belongs to a verified message");
        ds.acc = h->acc[slot][0];
        dd.acc = h->acc[slot][1];
        for (uint64_t lo = u->lo; lo < u->hi; lo += CHUNK) {
            uint64_t hi = u->hi - lo < CHUNK ? u->hi : lo + CHUNK;

            if (lo > u->lo && stopping(t))
                return;
            msg_range(h, u->msg, lo, hi, &ds, false);
            msg_range(h, u->msg, lo, hi, NULL, false);
            msg_range(h, u->msg, lo, hi, &dd, true);
        }
        rf_xfer__digest_end(&ds);
        rf_xfer__digest_end(&dd);
    }
    atomic_fetch_sub_explicit(&h->left[u->msg], u->hi - u->lo, memory_order_release);
}

/* Takes units until none is left or the job stops. */
static void work(rf_xfer_local *t, unsigned slot)
{
    lhost *h = t->host;

    while (!stopping(t)) {
        uint32_t u = atomic_fetch_add(&h->next, 1);

        if (u >= h->nunits)
            return;
        do_unit(t, &h->units[u], slot);
    }
}

/* ---- the pool ---- */

static void *helper_main(void *arg)
{
    struct helper_arg *a = arg;
    lhost *h = a->t->host;
    uint64_t seen = 0;

    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->quit && h->gen == seen)
            pthread_cond_wait(&h->cv, &h->mu);
        if (h->quit)
            break;
        seen = h->gen;
        if (a->idx > h->active)
            continue;
        h->busy++;
        pthread_mutex_unlock(&h->mu);
        work(a->t, a->idx);
        pthread_mutex_lock(&h->mu);
        if (--h->busy == 0)
            pthread_cond_broadcast(&h->idle);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* Starts helpers up to want; fewer when the system refuses threads (the job still runs). */
static void pool_grow(rf_xfer_local *t, unsigned want)
{
    lhost *h = t->host;

    while (h->nth < want) {
        h->args[h->nth] = (struct helper_arg){t, h->nth + 1};
        if (pthread_create(&h->th[h->nth], NULL, helper_main, &h->args[h->nth]) != 0)
            break;
        h->nth++;
    }
}

/* No helper touches the job after this returns. */
static void quiesce(lhost *h)
{
    atomic_store(&h->stop, true);
    if (!h->pool_ready)
        return;
    pthread_mutex_lock(&h->mu);
    while (h->busy > 0)
        pthread_cond_wait(&h->idle, &h->mu);
    pthread_mutex_unlock(&h->mu);
}

static unsigned threads_for(const rf_xfer_local *t, uint64_t bytes)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned n = t->threads;

    if (n == 0) {
        if (bytes < PAR_MIN)
            return 1;
        n = ncpu > AUTO_THREADS ? AUTO_THREADS : ncpu > 1 ? (unsigned)ncpu : 1;
    }
    return n > RF_XFER_LOCAL_MAX_THREADS ? RF_XFER_LOCAL_MAX_THREADS : n;
}

/* ---- the host part's job ---- */

static int host_start(rf_xfer_local *t)
{
    const rf_xfer_job *job = t->base.job;
    lhost *h = t->host;
    unsigned nthreads;
    int rc;

    if (!h->valid || job->plan_key == 0 || h->key != job->plan_key || h->verify != job->verify ||
        h->nmsgs != job->nmsgs) {
        if ((rc = plan_build(t, job)) < 0)
            return rc;
    }
    if (t->base.prepare)
        return 0; /* the pool starts copying at once: it waits for the job itself */
    h->job = job;
    h->reaped = 0;
    for (uint32_t i = 0; i < job->nmsgs; i++)
        atomic_store_explicit(&h->left[i], job->msgs[i].bytes, memory_order_relaxed);
    memset(h->acc, 0, sizeof(h->acc));
    atomic_store(&h->qerr, 0);
    atomic_store(&h->next, 0);
    atomic_store(&h->stop, false);
    nthreads = threads_for(t, h->total);
    if (nthreads > 1) {
        if (!h->pool_ready) {
            pthread_mutex_init(&h->mu, NULL);
            pthread_cond_init(&h->cv, NULL);
            pthread_cond_init(&h->idle, NULL);
            h->pool_ready = true;
        }
        pool_grow(t, nthreads - 1);
        pthread_mutex_lock(&h->mu);
        h->active = nthreads - 1 < h->nth ? nthreads - 1 : h->nth;
        h->gen++;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
    }
    return 0;
}

static void nap(void)
{
    struct timespec ts = {0, POLL_NS};

    nanosleep(&ts, NULL);
}

/* Counts the messages finished, in order: rf_xfer_progress follows the copy closely. */
static void reap(rf_xfer_local *t)
{
    lhost *h = t->host;

    while (h->reaped < h->job->nmsgs &&
           atomic_load_explicit(&h->left[h->reaped], memory_order_acquire) == 0)
        rf_xfer__moved(&t->base, &h->job->msgs[h->reaped++]);
}

/* Copies for a while alongside the pool, counting the messages finished as it goes. */
static int host_progress(rf_xfer_local *t, double wait_s)
{
    lhost *h = t->host;
    const rf_xfer_job *job = h->job;
    double t0 = rf_xfer__now();

    (void)wait_s;
    while (!stopping(t)) {
        uint32_t u = atomic_fetch_add(&h->next, 1);

        if (u >= h->nunits)
            break;
        do_unit(t, &h->units[u], 0);
        reap(t);
        if (rf_xfer__now() - t0 > STEP_S)
            break;
    }
    reap(t);
    if (atomic_load(&h->qerr) < 0) {
        quiesce(h);
        return fail(t, atomic_load(&h->qerr), "out of memory for the buffer of an FP8 "
                    "quantization (the local copy of message seq %u)",
                    job->msgs[h->reaped < job->nmsgs ? h->reaped : 0].seq);
    }
    if (h->reaped == job->nmsgs) {
        quiesce(h);
        for (unsigned s = 0; s < RF_XFER_LOCAL_MAX_THREADS; s++) {
            for (int b = 0; b < RF_XFER_DIGEST_BYTES; b++) {
                t->base.result.digest_sent[b] ^= h->acc[s][0][b];
                t->base.result.digest_recv[b] ^= h->acc[s][1][b];
            }
        }
        return 1;
    }
    /* The pool holds the last units: wait for them, a little at a time. */
    if (atomic_load(&h->next) >= h->nunits && !stopping(t))
        nap();
    return 0;
}

static void host_describe(rf_xfer_local *t, char *buf, size_t len)
{
    lhost *h = t->host;
    const rf_xfer_job *job = h->job;

    if (!job || h->reaped >= job->nmsgs) {
        snprintf(buf, len, "nothing");
        return;
    }
    const rf_xfer_msg *m = &job->msgs[h->reaped];
    snprintf(buf, len, "local copy of message seq %u (%llu bytes in %u items from the trainers "
             "of peer %u) unfinished, %u of %u messages and %llu of %llu bytes copied", m->seq,
             (unsigned long long)m->bytes, m->nitems, m->peer, h->reaped, job->nmsgs,
             (unsigned long long)t->base.result.bytes_recv, (unsigned long long)h->total);
}

static void host_finish(rf_xfer_local *t, int rc)
{
    lhost *h = t->host;

    quiesce(h);
    if (rc < 0 || t->base.job->plan_key == 0)
        plan_free(h);
    h->job = NULL;
}

static void host_teardown(rf_xfer_local *t)
{
    lhost *h = t->host;

    if (!h->pool_ready)
        return;
    pthread_mutex_lock(&h->mu);
    h->quit = true;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    for (unsigned i = 0; i < h->nth; i++)
        pthread_join(h->th[i], NULL);
    h->nth = 0;
}

/* ---- the backend ---- */

static int local_start(rf_xfer_core *base)
{
    rf_xfer_local *t = (rf_xfer_local *)base;

#ifdef RF_HAVE_CUDA
    if (t->gpu)
        return rf_xfer__lgpu_start(t);
#endif
    return host_start(t);
}

static int local_progress(rf_xfer_core *base, double wait_s)
{
    rf_xfer_local *t = (rf_xfer_local *)base;

#ifdef RF_HAVE_CUDA
    if (t->gpu)
        return rf_xfer__lgpu_progress(t, wait_s);
#endif
    return host_progress(t, wait_s);
}

static void local_describe(rf_xfer_core *base, char *buf, size_t len)
{
    rf_xfer_local *t = (rf_xfer_local *)base;

#ifdef RF_HAVE_CUDA
    if (t->gpu) {
        rf_xfer__lgpu_describe(t, buf, len);
        return;
    }
#endif
    host_describe(t, buf, len);
}

static void local_finish(rf_xfer_core *base, int rc)
{
    rf_xfer_local *t = (rf_xfer_local *)base;

#ifdef RF_HAVE_CUDA
    if (t->gpu) {
        rf_xfer__lgpu_finish(t, rc);
        return;
    }
#endif
    host_finish(t, rc);
}

static void local_teardown(rf_xfer_core *base)
{
    rf_xfer_local *t = (rf_xfer_local *)base;

#ifdef RF_HAVE_CUDA
    if (t->gpu)
        rf_xfer__lgpu_teardown(t);
#endif
    host_teardown(t);
}

static void local_release(rf_xfer_core *base)
{
    rf_xfer_local *t = (rf_xfer_local *)base;

#ifdef RF_HAVE_CUDA
    if (t->gpu)
        rf_xfer__lgpu_release(t);
#endif
    plan_free(t->host);
    if (t->host->pool_ready) {
        pthread_mutex_destroy(&t->host->mu);
        pthread_cond_destroy(&t->host->cv);
        pthread_cond_destroy(&t->host->idle);
    }
    free(t->host);
    free(t);
}

/* The local transport takes local messages only; the core refuses them on the others. */
static int local_check(rf_xfer_core *base, const rf_xfer_job *job, rf_err *err)
{
    (void)base;
    for (uint32_t i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];

        if (m->kind != RF_PLAN_LOCAL)
            return rf_err_set(err, -EINVAL, "xfer local: message seq %u is %s, not a local "
                              "copy; only RF_PLAN_LOCAL messages run on the local transport, "
                              "the others go to tcp or nccl", m->seq,
                              m->kind == RF_PLAN_DIRECT ? "direct" : "packed");
    }
    return 0;
}

const rf_xfer_backend rf_xfer__local_backend = {
    .name = "local",
    .prepares = true,
    .local = true,
    .check = local_check,
    .release = local_release,
    .start = local_start,
    .progress = local_progress,
    .describe = local_describe,
    .finish = local_finish,
    .teardown = local_teardown,
};

int rf_xfer_local_new(uv_loop_t *loop, bool gpu, rf_xfer_transport **out, rf_err *err)
{
    rf_xfer_core *core = NULL;
    lhost *h = NULL;
    int rc;

    *out = NULL;
    if (gpu) {
#ifdef RF_HAVE_CUDA
        if (!rf_cuda_available())
            return rf_err_set(err, -ENODEV, "transport local with GPU memory needs a CUDA "
                              "device, and none is usable by this process; check the driver "
                              "and CUDA_VISIBLE_DEVICES");
#else
        return rf_err_set(err, -ENOTSUP, "local copies of GPU memory need CUDA, and this build "
                          "of refit has none: rebuild with CUDA_HOME pointing at a toolkit");
#endif
    }
    h = calloc(1, sizeof(*h));
    if (!h)
        return rf_err_set(err, -ENOMEM, "xfer local: out of memory");
    if ((rc = rf_xfer__new(sizeof(rf_xfer_local), &rf_xfer__local_backend, loop, &core,
                           err)) < 0) {
        free(h);
        return rc;
    }
    ((rf_xfer_local *)core)->gpu = gpu;
    ((rf_xfer_local *)core)->host = h;
    *out = &core->pub;
    return 0;
}

int rf_xfer_local_set_threads(rf_xfer_transport *pub, unsigned threads, rf_err *err)
{
    rf_xfer_local *t = container_of(pub, rf_xfer_local, base.pub);

    if (pub->ops != &rf_xfer__local_backend)
        return rf_err_set(err, -EINVAL, "xfer %s: not the local transport", pub->ops->name);
    if (t->base.running)
        return rf_err_set(err, -EBUSY, "xfer local: threads change while a job runs");
    if (threads > RF_XFER_LOCAL_MAX_THREADS)
        return rf_err_set(err, -EINVAL, "xfer local: %u threads; at most %d", threads,
                          RF_XFER_LOCAL_MAX_THREADS);
    t->threads = threads;
    return 0;
}

int rf_xfer_local_tune_gpu(rf_xfer_transport *pub, uint64_t batch, uint64_t memcpy_min,
                           rf_err *err)
{
    rf_xfer_local *t = container_of(pub, rf_xfer_local, base.pub);

    if (pub->ops != &rf_xfer__local_backend)
        return rf_err_set(err, -EINVAL, "xfer %s: not the local transport", pub->ops->name);
    if (t->base.running)
        return rf_err_set(err, -EBUSY, "xfer local: tuning changes while a job runs");
    t->gpu_batch = batch;
    t->gpu_memcpy_min = memcpy_min;
    return 0;
}

void rf_xfer_local_stats(const rf_xfer_transport *pub, uint64_t *allocs, uint64_t *dev_now,
                         uint64_t *dev_peak)
{
    const rf_xfer_local *t = container_of(pub, const rf_xfer_local, base.pub);

    if (allocs)
        *allocs = atomic_load(&t->allocs);
    if (dev_now)
        *dev_now = atomic_load(&t->mem_now);
    if (dev_peak)
        *dev_peak = atomic_load(&t->mem_peak);
}
