/* client/lib/refit_install.c - librefit's installer: for an engine with in-process regions
 * (memory its receiverd cannot map), a thread of its own with a second connection to the
 * receiverd runs the engine's part of each plan, copying straight from the trainers' memory
 * on this host into the engine's memory with the daemons' own local transport (host threads,
 * or the GPU pair kernels on a stream of its own), and answers InstallDone with the same
 * digests the daemon would have computed. Protocol: proto/rpc.proto, "In-process install". */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <sodium.h>
#include <uv.h>

#include "export.h"
#ifdef RF_HAVE_CUDA
#include "mem_cuda.h"
#endif
#include "refit_int.h"
#include "slice.h"
#include "srcmap.h"
#include "xfer.h"

/* How long the installer waits for the daemon's answers and for the fds of an export. */
#define CALL_MS 30000
#define EXPORT_TIMEOUT_S 30.0

struct refit_installer {
    refit_client *c;           /* the installer's own connection */
    pthread_t thread;
    bool started;
    volatile int stop;
    void **ptrs;               /* per engine region id: its memory, NULL when the daemon's */
    size_t nptrs;

    uv_loop_t loop;
    uv_poll_t poll;            /* the connection, while a job runs (aborts arrive on it) */
    rf_xfer_transport *lx;
    rf_srcmap *srcs;
    rf_inv *inv;               /* the receiverd's local inventory of the plan */
    uint8_t **bases;           /* per inventory region: the engine's memory, or NULL */
    uint32_t nbases;
    rf_slice_job sj;
    char plan_err[512];        /* a plan that could not be taken: reported at the next run */
    uint64_t keys;
    bool done;
    rf_xfer_result res;
};

/* ---- the trainers' memory, handed over by the receiverd ---- */

/* The receiverd holds the key and the plan: it fetches from the publisherd exactly the regions
 * this engine's part of the plan reads and passes them on a back channel (memfds read-only).
 * What the installer would ask for (socket, pieces) is the receiverd's to decide. */
static int fetch(void *ctx, uint64_t daemon_id, uint64_t generation, const char *sock,
                 const uint32_t *pieces, size_t npieces, rf_export **out, rf_err *err)
{
    refit_installer *in = ctx;
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__InstallSources m = REFIT__RPC__INSTALL_SOURCES__INIT;
    Refit__Rpc__Response *r = NULL;
    int sv[2] = {-1, -1};
    int rc;

    (void)sock;
    (void)pieces;
    (void)npieces;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
        return rf_err_set(err, -errno, "socketpair for the trainers' memory: %s",
                          strerror(errno));
    m.daemon_id = daemon_id;
    m.generation = generation;
    q.body_case = REFIT__RPC__REQUEST__BODY_INSTALL_SOURCES;
    q.install_sources = &m;
    rc = refit__call_fd(in->c, &q, sv[1], CALL_MS, &r);
    close(sv[1]);
    if (rc < 0)
        rc = rf_err_set(err, rc, "the receiverd gave no memory of publisher %016llx: %s",
                        (unsigned long long)daemon_id, refit_last_error(in->c));
    else
        rc = rf_export_take("refit-receiverd", r, sv[0], EXPORT_TIMEOUT_S, out, err);
    if (r)
        refit__rpc__response__free_unpacked(r, NULL);
    close(sv[0]);
    return rc;
}

/* ---- the plan ---- */

static void plan_reset(refit_installer *in)
{
    rf_slice_job_reset(&in->sj);
    rf_inv_free(in->inv);
    in->inv = NULL;
    free(in->bases);
    in->bases = NULL;
    in->nbases = 0;
    in->plan_err[0] = '\0';
}

/* The first frame: the daemon's inventory and where the engine's regions are in it. */
static int plan_begin(refit_installer *in, const Refit__Rpc__InstallPlan *p, rf_err *err)
{
    const rf_side sides[1] = {RF_DST};
    Refit__Inventory *msg;
    rf_slice_map map;
    int rc;

    plan_reset(in);
    msg = refit__inventory__unpack(NULL, p->inventory.len, p->inventory.data);
    if (msg == NULL)
        return rf_err_set(err, -EBADMSG, "the receiverd's inventory does not parse");
    /* One member merged alone keeps its ids, which the slice frames name. */
    rc = rf_slice_merge(&msg, sides, 1, &in->inv, &map, err);
    refit__inventory__free_unpacked(msg, NULL);
    if (rc < 0)
        return rc;
    rf_slice_map_free(&map);
    in->nbases = rf_inv_nregions(in->inv);
    if ((in->bases = calloc(in->nbases ? in->nbases : 1, sizeof(*in->bases))) == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory");
    if (p->n_regions != in->nptrs)
        return rf_err_set(err, -EPROTO, "the receiverd names %zu regions of this engine, it "
                          "registered %zu", p->n_regions, in->nptrs);
    for (size_t k = 0; k < p->n_regions; k++) {
        if (p->regions[k] >= in->nbases)
            return rf_err_set(err, -EPROTO, "region %zu is inventory region %u of %u", k,
                              p->regions[k], in->nbases);
        in->bases[p->regions[k]] = in->ptrs[k];
    }
    return 0;
}

/* A slice frame: its local messages' sources mapped (handed over once per publisher
 * generation), then added to the job. */
static int plan_frame(refit_installer *in, const Refit__Rpc__InstallPlan *p, rf_err *err)
{
    Refit__PlanSlice *ps = refit__plan_slice__unpack(NULL, p->slice.len, p->slice.data);
    rf_slice_src *srcs = NULL;
    int rc = 0;

    if (ps == NULL)
        return rf_err_set(err, -EBADMSG, "a plan slice frame does not parse");
    if (in->inv == NULL) {
        rc = rf_err_set(err, -EPROTO, "a plan slice frame before the plan's first");
        goto out;
    }
    for (size_t i = 0; i < ps->n_msgs; i++) {
        const Refit__SliceMsg *sm = ps->msgs[i];

        if (sm->kind != RF_PLAN_LOCAL || sm->peer >= ps->n_peers) {
            rc = rf_err_set(err, -EPROTO, "message %u is not a local copy from a listed peer",
                            sm->seq);
            goto out;
        }
    }
    if ((rc = rf_srcmap_frame(in->srcs, ps, &srcs, err)) < 0)
        goto out;
    rc = rf_slice_job_add(&in->sj, ps, in->inv, RF_DST, in->bases, srcs, err);
    if (rc == 0 && in->sj.complete) {
        const char **addrs = calloc(in->sj.npeers ? in->sj.npeers : 1, sizeof(*addrs));

        if (addrs == NULL) {
            rc = rf_err_set(err, -ENOMEM, "out of memory");
            goto out;
        }
        /* Local copies name their source daemon as the peer and need no address; the index
         * of this side matters to no local copy. */
        rc = rf_xfer_set_peers(in->lx, 0, in->sj.npeers, addrs, err);
        free(addrs);
        if (rc == 0)
            rc = rf_xfer_job_check(&in->sj.ljob, in->sj.npeers, err);
        if (rc == 0) {
            in->sj.ljob.checked = true;
            in->sj.ljob.plan_key = ++in->keys;
            rf_srcmap_prune(in->srcs, &in->sj);
        }
    }
out:
    free(srcs);
    refit__plan_slice__free_unpacked(ps, NULL);
    return rc;
}

/* ---- a run ---- */

static void on_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    refit_installer *in = arg;

    (void)t;
    in->res = *res;
    if (in->res.code == 0 && in->sj.nqruns > 0) {
        /* Blocks that trainers' shards cut reached their shadows whole (issue 15). */
        rf_err qe = {0};

        if (rf_slice_job_quantize(&in->sj, &qe) < 0) {
            in->res.code = qe.code;
            snprintf(in->res.error, sizeof(in->res.error), "quantizing on the receiver: %s",
                     qe.msg);
        }
    }
    in->done = true;
}

/* Pushes that come while a job runs: an abort of it stops it. */
static void on_readable(uv_poll_t *h, int status, int events)
{
    refit_installer *in = h->data;
    Refit__Rpc__Response *r = NULL;
    int rc;

    (void)events;
    rc = status < 0 ? status : refit__next_install(in->c, 0, &r);
    if (rc < 0 && rc != -ETIMEDOUT) {
        /* The daemon went away (or stop shut the connection): nobody waits for this one. */
        uv_poll_stop(h);
        rf_xfer_abort(in->lx);
        return;
    }
    while (r != NULL) {
        if (r->install->body_case == REFIT__RPC__INSTALL__BODY_ABORT)
            rf_xfer_abort(in->lx);
        refit__rpc__response__free_unpacked(r, NULL);
        r = NULL;
        if (refit__next_install(in->c, 0, &r) < 0)
            break;
    }
}

static void answer(refit_installer *in, uint64_t version, int code, const char *error)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__InstallDone d = REFIT__RPC__INSTALL_DONE__INIT;

    d.version = version;
    d.code = code < 0 ? code : in->res.code;
    d.error = (char *)(code < 0 ? error : in->res.error);
    if (code == 0 && in->res.code == 0) {
        d.bytes = in->res.bytes_recv + in->res.bytes_sent;
        d.seconds = in->res.seconds;
        d.digest_sent.data = in->res.digest_sent;
        d.digest_sent.len = RF_XFER_DIGEST_BYTES;
        d.digest_recv.data = in->res.digest_recv;
        d.digest_recv.len = RF_XFER_DIGEST_BYTES;
    }
    q.body_case = REFIT__RPC__REQUEST__BODY_INSTALL_DONE;
    q.install_done = &d;
    (void)refit__call(in->c, &q, CALL_MS, NULL);
}

static void run(refit_installer *in, const Refit__Rpc__InstallRun *m)
{
    rf_err err = {0};
    int rc;

    if (in->plan_err[0]) {
        answer(in, m->version, -EPROTO, in->plan_err);
        return;
    }
    if (!in->sj.complete) {
        answer(in, m->version, -EPROTO, "InstallRun before the plan was complete");
        return;
    }
    in->sj.ljob.version = m->version;
    in->sj.ljob.verify = (int)m->verify;
    in->sj.ljob.timeout_s = m->timeout_s > 0 ? m->timeout_s : 60.0;
    /* Both sides of every copy here are digested in this process, so any seed makes them
     * agree; a daemon that sends none (an older build) leaves it zero. */
    memset(in->sj.ljob.digest_seed, 0, sizeof(in->sj.ljob.digest_seed));
    if (m->digest_seed.len == sizeof(in->sj.ljob.digest_seed))
        memcpy(in->sj.ljob.digest_seed, m->digest_seed.data, m->digest_seed.len);
    in->done = false;
    memset(&in->res, 0, sizeof(in->res));
    if ((rc = rf_xfer_run(in->lx, &in->sj.ljob, on_done, in, &err)) < 0) {
        answer(in, m->version, rc, err.msg);
        return;
    }
    uv_poll_start(&in->poll, UV_READABLE, on_readable);
    while (!in->done) {
        if (in->stop)
            rf_xfer_abort(in->lx);
        uv_run(&in->loop, UV_RUN_ONCE);
    }
    uv_poll_stop(&in->poll);
    answer(in, m->version, 0, NULL);
}

static void *installer_main(void *arg)
{
    refit_installer *in = arg;

    while (!in->stop) {
        Refit__Rpc__Response *r = NULL;
        rf_err err = {0};
        int rc = refit__next_install(in->c, 200, &r);

        if (rc == -ETIMEDOUT)
            continue;
        if (rc < 0)
            break; /* the daemon closed the connection, or stop shut it down */
        switch (r->install->body_case) {
        case REFIT__RPC__INSTALL__BODY_PLAN:
            if (r->install->plan->first)
                rc = plan_begin(in, r->install->plan, &err);
            if (rc == 0 && !in->plan_err[0])
                rc = plan_frame(in, r->install->plan, &err);
            if (rc < 0 && !in->plan_err[0])
                snprintf(in->plan_err, sizeof(in->plan_err), "the engine's installer could "
                         "not take the plan: %s", err.msg);
            break;
        case REFIT__RPC__INSTALL__BODY_RUN:
            run(in, r->install->run);
            break;
        default:
            break; /* an abort of nothing running */
        }
        refit__rpc__response__free_unpacked(r, NULL);
    }
    return NULL;
}

/* ---- life cycle ---- */

static void on_lx_closed(void *arg)
{
    refit_installer *in = arg;

    in->lx = NULL;
}

static void installer_free(refit_installer *in)
{
    if (in->lx) {
        rf_xfer_close(in->lx, on_lx_closed, in);
        while (in->lx)
            uv_run(&in->loop, UV_RUN_ONCE);
    }
    if (in->poll.data) {
        uv_close((uv_handle_t *)&in->poll, NULL);
        uv_run(&in->loop, UV_RUN_DEFAULT);
    }
    if (in->loop.data)
        uv_loop_close(&in->loop);
    plan_reset(in);
    rf_srcmap_free(in->srcs);
    if (in->c)
        refit_close(in->c);
    free(in->ptrs);
    free(in);
}

int refit__installer_start(refit_client *engine, const char *path, const char *name, int rank,
                           const uint8_t *token, size_t token_len, void *const *ptrs,
                           size_t nptrs, bool gpu, refit_installer **out)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__InstallerAttach m = REFIT__RPC__INSTALLER_ATTACH__INIT;
    refit_installer *in;
    rf_err err = {0};
    int rc;

    *out = NULL;
    if ((in = calloc(1, sizeof(*in))) == NULL ||
        (in->ptrs = calloc(nptrs ? nptrs : 1, sizeof(*in->ptrs))) == NULL) {
        free(in);
        return refit__fail(engine, -ENOMEM, "out of memory starting the installer");
    }
    memcpy(in->ptrs, ptrs, nptrs * sizeof(*ptrs));
    in->nptrs = nptrs;
    rf_slice_job_init(&in->sj);
    if ((rc = uv_loop_init(&in->loop)) < 0) {
        rc = refit__fail(engine, rc, "starting the installer: %s", uv_strerror(rc));
        goto fail;
    }
    in->loop.data = in;
    if ((rc = refit__connect(path, name, rank, REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER,
                             &in->c)) < 0) {
        rc = refit__fail(engine, rc, "the installer could not connect: %s",
                         refit_last_error(NULL));
        goto fail;
    }
    m.token.data = (uint8_t *)token;
    m.token.len = token_len;
    q.body_case = REFIT__RPC__REQUEST__BODY_INSTALLER_ATTACH;
    q.installer_attach = &m;
    if ((rc = refit__call(in->c, &q, CALL_MS, NULL)) < 0) {
        rc = refit__fail(engine, rc, "the installer could not attach: %s",
                         refit_last_error(in->c));
        goto fail;
    }
#ifdef RF_HAVE_CUDA
    /* GPU engines map the trainers' CUDA IPC handles and VMM fds here. */
    if (gpu && (rc = rf_mem_cuda_init(&err)) < 0) {
        rc = refit__fail(engine, rc, "starting the installer: %s", err.msg);
        goto fail;
    }
#endif
    if ((rc = rf_srcmap_new_fetcher(fetch, in, &in->srcs, &err)) < 0 ||
        (rc = rf_xfer_local_new(&in->loop, gpu, &in->lx, &err)) < 0) {
        rc = refit__fail(engine, rc, "starting the installer: %s", err.msg);
        goto fail;
    }
    if ((rc = uv_poll_init(&in->loop, &in->poll, refit__fd(in->c))) < 0) {
        rc = refit__fail(engine, rc, "starting the installer: %s", uv_strerror(rc));
        goto fail;
    }
    in->poll.data = in;
    if ((rc = pthread_create(&in->thread, NULL, installer_main, in)) != 0) {
        rc = refit__fail(engine, -rc, "starting the installer thread: %s", strerror(rc));
        goto fail;
    }
    in->started = true;
    *out = in;
    return 0;
fail:
    installer_free(in);
    return rc;
}

void refit__installer_stop(refit_installer *in)
{
    if (in == NULL)
        return;
    in->stop = 1;
    /* Wakes a wait for the daemon; a running job sees stop and aborts. */
    shutdown(refit__fd(in->c), SHUT_RDWR);
    if (in->started)
        pthread_join(in->thread, NULL);
    installer_free(in);
}
