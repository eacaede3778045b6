/* common/control/install.c - in-process install, the receiverd's side (see install.h). */
#define RF_LOG_MODULE "install"
#include "install.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#include "export.h"
#include "log.h"
#include "plan.h"
#include "slice.h"

/* What an engine's part of the plan reads from one publisherd on this host: all its installer
 * may be given of that publisher's memory. */
typedef struct install_grant {
    uint64_t daemon_id, generation;
    char *sock;
    uint32_t *pieces; /* the publisher's local source piece ids, sorted and unique once the
                         owner's last frame is in */
    uint32_t npieces, cap;
} install_grant;

struct rf_install_owner {
    uint64_t uid;
    uint8_t **frames; /* packed refit.PlanSlice */
    size_t *lens;
    uint32_t nframes, cap;
    bool closed;      /* its last frame is in */
    install_grant *grants;
    uint32_t ngrants;
};

/* ---- the engines' part of a plan ---- */

static rf_install_owner *owner_of(rf_install_plan *p, uint64_t uid)
{
    rf_install_owner *o;

    for (uint32_t i = 0; i < p->nowners; i++)
        if (p->owners[i].uid == uid)
            return &p->owners[i];
    o = realloc(p->owners, (p->nowners + 1) * sizeof(*o));
    if (o == NULL)
        return NULL;
    p->owners = o;
    o = &p->owners[p->nowners++];
    memset(o, 0, sizeof(*o));
    o->uid = uid;
    return o;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

    return x < y ? -1 : x > y;
}

/* Records the source pieces that msgs (of frame ps) read, per publisher. */
static int owner_grants(rf_install_owner *o, const Refit__PlanSlice *ps, Refit__SliceMsg **msgs,
                        size_t n, rf_err *err)
{
    for (size_t i = 0; i < n; i++) {
        const Refit__SliceMsg *sm = msgs[i];
        const Refit__PeerAddr *pa;
        install_grant *g = NULL;

        if (sm->peer >= ps->n_peers)
            return rf_err_set(err, -EPROTO, "plan slice message %u names peer %u of %zu",
                              sm->seq, sm->peer, ps->n_peers);
        pa = ps->peers[sm->peer];
        for (uint32_t k = 0; k < o->ngrants && !g; k++)
            if (o->grants[k].daemon_id == pa->daemon_id)
                g = &o->grants[k];
        if (g == NULL) {
            install_grant *ng = realloc(o->grants, (o->ngrants + 1) * sizeof(*ng));

            if (ng == NULL)
                return rf_err_set(err, -ENOMEM, "out of memory holding an engine's plan");
            o->grants = ng;
            g = &o->grants[o->ngrants];
            memset(g, 0, sizeof(*g));
            if ((g->sock = strdup(pa->local_sock ? pa->local_sock : "")) == NULL)
                return rf_err_set(err, -ENOMEM, "out of memory holding an engine's plan");
            o->ngrants++;
            g->daemon_id = pa->daemon_id;
            g->generation = pa->generation;
        }
        for (size_t t = 0; t < sm->n_xfers; t++) {
            if (g->npieces == g->cap) {
                uint32_t cap = g->cap ? 2 * g->cap : 64;
                uint32_t *np = realloc(g->pieces, cap * sizeof(*np));

                if (np == NULL)
                    return rf_err_set(err, -ENOMEM, "out of memory holding an engine's plan");
                g->pieces = np;
                g->cap = cap;
            }
            g->pieces[g->npieces++] = sm->xfers[t]->src_piece;
        }
    }
    if (ps->last)
        for (uint32_t k = 0; k < o->ngrants; k++) {
            install_grant *g = &o->grants[k];
            uint32_t w = 0;

            qsort(g->pieces, g->npieces, sizeof(*g->pieces), cmp_u32);
            for (uint32_t r = 0; r < g->npieces; r++)
                if (w == 0 || g->pieces[w - 1] != g->pieces[r])
                    g->pieces[w++] = g->pieces[r];
            g->npieces = w;
        }
    return 0;
}

/* Appends ps with msgs (n of them) as one packed frame of o. */
static int owner_frame(rf_install_owner *o, const Refit__PlanSlice *ps, Refit__SliceMsg **msgs,
                       size_t n, rf_err *err)
{
    Refit__PlanSlice f = *ps;
    uint8_t *buf;
    size_t len;

    if (o->nframes == o->cap) {
        uint32_t cap = o->cap ? 2 * o->cap : 4;
        uint8_t **fr;
        size_t *ln;

        if ((fr = realloc(o->frames, cap * sizeof(*fr))) != NULL)
            o->frames = fr;
        if (fr == NULL || (ln = realloc(o->lens, cap * sizeof(*ln))) == NULL)
            return rf_err_set(err, -ENOMEM, "out of memory holding an engine's plan");
        o->lens = ln;
        o->cap = cap;
    }
    f.msgs = msgs;
    f.n_msgs = n;
    /* The installer joins no NCCL world (ranks stay: they count the local endpoints). */
    f.nccl_id.len = 0;
    f.nccl_id.data = NULL;
    len = refit__plan_slice__get_packed_size(&f);
    if ((buf = malloc(len ? len : 1)) == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory holding an engine's plan");
    refit__plan_slice__pack(&f, buf);
    o->frames[o->nframes] = buf;
    o->lens[o->nframes++] = len;
    o->closed = ps->last;
    return owner_grants(o, ps, msgs, n, err);
}

int rf_install_plan_add(rf_install_plan *p, const rf_registry *reg, const Refit__PlanSlice *ps,
                        Refit__PlanSlice *rest, rf_err *err)
{
    Refit__SliceMsg **mine = NULL;
    uint64_t *uids = NULL;
    size_t nrest = 0, i, j;
    int rc = 0;

    *rest = *ps;
    rest->msgs = calloc(ps->n_msgs ? ps->n_msgs : 1, sizeof(*rest->msgs));
    mine = calloc(ps->n_msgs ? ps->n_msgs : 1, sizeof(*mine));
    uids = calloc(ps->n_msgs ? ps->n_msgs : 1, sizeof(*uids));
    if (rest->msgs == NULL || mine == NULL || uids == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory splitting the plan slice");
        goto out;
    }
    for (i = 0; i < ps->n_msgs; i++) {
        const Refit__SliceMsg *sm = ps->msgs[i];

        uids[i] = rf_registry_endpoint_owner(reg, sm->local_ep);
        /* A relay out of an engine's memory stays in the daemon's part, which refuses it
         * naming the endpoint (slice.c: the daemon cannot read that memory). */
        if (sm->send)
            uids[i] = 0;
        if (uids[i] == 0) {
            rest->msgs[nrest++] = ps->msgs[i];
        } else if (sm->kind != RF_PLAN_LOCAL) {
            rc = rf_err_set(err, -EOPNOTSUPP, "the plan sends %llu bytes (message %u) over the "
                            "network into the in-process memory of engine '%s': only copies "
                            "from trainers on this host reach memory the daemon cannot map; "
                            "run the trainers that hold it here, or register shareable memory",
                            (unsigned long long)sm->bytes, sm->seq,
                            rf_registry_client_name(reg, uids[i]));
            goto out;
        }
    }
    /* One frame per owner that has messages here, in frame order; an owner's messages are
     * taken (and their uids cleared) at its first. */
    for (i = 0; i < ps->n_msgs; i++) {
        uint64_t uid = uids[i];
        rf_install_owner *o;
        size_t n = 0;

        if (uid == 0)
            continue;
        for (j = i; j < ps->n_msgs; j++)
            if (uids[j] == uid) {
                mine[n++] = ps->msgs[j];
                p->bytes += ps->msgs[j]->bytes;
                p->nmsgs++;
                uids[j] = 0;
            }
        if ((o = owner_of(p, uid)) == NULL) {
            rc = rf_err_set(err, -ENOMEM, "out of memory splitting the plan slice");
            goto out;
        }
        if ((rc = owner_frame(o, ps, mine, n, err)) < 0)
            goto out;
    }
    /* Owners of earlier frames get the end of the slice even when this frame has nothing
     * of theirs. */
    if (ps->last)
        for (uint32_t k = 0; k < p->nowners; k++)
            if (!p->owners[k].closed && (rc = owner_frame(&p->owners[k], ps, NULL, 0, err)) < 0)
                goto out;
    rest->n_msgs = nrest;
out:
    free(mine);
    free(uids);
    if (rc < 0) {
        free(rest->msgs);
        rest->msgs = NULL;
        rest->n_msgs = 0;
    }
    return rc;
}

void rf_install_plan_reset(rf_install_plan *p)
{
    for (uint32_t i = 0; i < p->nowners; i++) {
        for (uint32_t k = 0; k < p->owners[i].nframes; k++)
            free(p->owners[i].frames[k]);
        free(p->owners[i].frames);
        free(p->owners[i].lens);
        for (uint32_t k = 0; k < p->owners[i].ngrants; k++) {
            free(p->owners[i].grants[k].sock);
            free(p->owners[i].grants[k].pieces);
        }
        free(p->owners[i].grants);
    }
    free(p->owners);
    memset(p, 0, sizeof(*p));
}

/* ---- runs ---- */

typedef struct inst_state {
    uint64_t uid;
    uint64_t sent_serial; /* the plan this installer holds, 0 for none */
    bool running;
} inst_state;

struct rf_install {
    uv_loop_t *loop;
    rf_registry *reg;
    uint8_t *key;         /* the cluster key: proves this daemon to the local publisherds */
    size_t key_len;
    uint8_t digest_seed[RF_XFER_DIGEST_SEED_BYTES]; /* the runs' (rf_xfer_digest_seed) */
    double fetch_timeout_s;
    const rf_install_plan *plan; /* the plan of the run in flight (valid while running) */
    uint64_t abort_at;    /* loop time (ms) after which unanswered aborts are given up */
    inst_state *st;
    uint32_t nst;
    uint32_t left;        /* installers of the run not answered yet */
    uint32_t total;       /* installers of the run */
    uint64_t version;
    bool running, aborting;
    rf_install_done_cb cb;
    void *arg;
    rf_xfer_result res;
};

static inst_state *state_of(rf_install *in, uint64_t uid, bool add)
{
    inst_state *s;

    for (uint32_t i = 0; i < in->nst; i++)
        if (in->st[i].uid == uid)
            return &in->st[i];
    if (!add || (s = realloc(in->st, (in->nst + 1) * sizeof(*s))) == NULL)
        return NULL;
    in->st = s;
    s = &in->st[in->nst++];
    memset(s, 0, sizeof(*s));
    s->uid = uid;
    return s;
}

int rf_install_new(uv_loop_t *loop, rf_registry *reg, const uint8_t *key, size_t key_len,
                   double fetch_timeout_s, rf_install **out, rf_err *err)
{
    rf_install *in = calloc(1, sizeof(*in));

    if (in == NULL || (in->key = malloc(key_len ? key_len : 1)) == NULL) {
        free(in);
        return rf_err_set(err, -ENOMEM, "out of memory for in-process installs");
    }
    memcpy(in->key, key, key_len);
    in->key_len = key_len;
    rf_xfer_digest_seed(key, key_len, in->digest_seed);
    in->fetch_timeout_s = fetch_timeout_s;
    in->loop = loop;
    in->reg = reg;
    *out = in;
    return 0;
}

void rf_install_free(rf_install *in)
{
    if (in == NULL)
        return;
    sodium_memzero(in->key, in->key_len);
    free(in->key);
    free(in->st);
    free(in);
}


/* One installer's answer (or its loss) goes into the run's result; the last ends it. */
static void settle(rf_install *in, inst_state *s, int code, const char *error, uint64_t bytes,
                   double seconds, const uint8_t *dsent, const uint8_t *drecv)
{
    rf_xfer_result *r = &in->res;

    if (!s->running)
        return;
    s->running = false;
    if (code < 0 && r->code == 0) {
        r->code = code;
        snprintf(r->error, sizeof(r->error), "engine '%s' installing in its process: %s",
                 rf_registry_client_name(in->reg, s->uid), error);
    }
    r->bytes_recv += bytes;
    if (seconds > r->seconds)
        r->seconds = seconds;
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++) {
        r->digest_sent[i] ^= dsent ? dsent[i] : 0;
        r->digest_recv[i] ^= drecv ? drecv[i] : 0;
    }
    if (--in->left > 0) {
        /* One failed: the others need not finish what the refit cannot commit. */
        if (code < 0)
            rf_install_abort(in);
        return;
    }
    in->running = in->aborting = false;
    in->plan = NULL;
    in->cb(&in->res, in->arg);
}

/* Sends the plan of owner o to its installer: the first frame carries the daemon's local inventory
 * and the inventory ids of the engine's regions. */
static int send_plan(rf_install *in, const rf_install_owner *o, rf_err *err)
{
    Refit__Rpc__Install m = REFIT__RPC__INSTALL__INIT;
    Refit__Rpc__InstallPlan ip = REFIT__RPC__INSTALL_PLAN__INIT;
    Refit__Inventory inv = REFIT__INVENTORY__INIT;
    uint8_t *ibuf = NULL;
    uint32_t *ids = NULL;
    size_t nids = 0;
    int rc;

    if ((rc = rf_registry_client_regions(in->reg, o->uid, &ids, &nids, err)) < 0)
        return rc;
    if ((rc = rf_slice_inv_pack(rf_registry_inv(in->reg), RF_DST,
                                rf_registry_generation(in->reg), &inv)) < 0) {
        rc = rf_err_set(err, rc, "out of memory packing the inventory for an installer");
        goto out;
    }
    ip.inventory.len = refit__inventory__get_packed_size(&inv);
    if ((ibuf = malloc(ip.inventory.len ? ip.inventory.len : 1)) == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory packing the inventory for an installer");
        goto out;
    }
    refit__inventory__pack(&inv, ibuf);
    ip.inventory.data = ibuf;
    ip.regions = ids;
    ip.n_regions = nids;
    ip.first = true;
    m.body_case = REFIT__RPC__INSTALL__BODY_PLAN;
    m.plan = &ip;
    for (uint32_t k = 0; k < o->nframes; k++) {
        ip.slice.data = o->frames[k];
        ip.slice.len = o->lens[k];
        if ((rc = rf_registry_install_push(in->reg, o->uid, &m, err)) < 0)
            goto out;
        /* The inventory and region map go once, with the first frame. */
        ip.first = false;
        ip.inventory.len = 0;
        ip.inventory.data = NULL;
        ip.n_regions = 0;
        ip.regions = NULL;
    }
out:
    free(ibuf);
    free(ids);
    rf_slice_inv_msg_free(&inv);
    return rc;
}

int rf_install_run(rf_install *in, const rf_install_plan *p, uint64_t version, int verify,
                   double timeout_s, rf_install_done_cb cb, void *arg, rf_err *err)
{
    Refit__Rpc__Install m = REFIT__RPC__INSTALL__INIT;
    Refit__Rpc__InstallRun run = REFIT__RPC__INSTALL_RUN__INIT;
    uint32_t i;
    int rc;

    if (in->running)
        return rf_err_set(err, -EBUSY, "in-process installs of version %llu still run",
                          (unsigned long long)in->version);
    if (p->nowners == 0)
        return 0;
    run.version = version;
    run.verify = (uint32_t)verify;
    run.timeout_s = timeout_s;
    run.digest_seed.data = in->digest_seed;
    run.digest_seed.len = sizeof(in->digest_seed);
    m.body_case = REFIT__RPC__INSTALL__BODY_RUN;
    m.run = &run;
    /* Everything is sent before anything counts as running: a refusal starts nothing. */
    for (i = 0; i < p->nowners; i++) {
        const rf_install_owner *o = &p->owners[i];
        inst_state *s = state_of(in, o->uid, true);

        if (s == NULL)
            return rf_err_set(err, -ENOMEM, "out of memory starting in-process installs");
        if (s->sent_serial != p->serial) {
            s->sent_serial = 0;
            if ((rc = send_plan(in, o, err)) < 0)
                return rc;
            s->sent_serial = p->serial;
        }
    }
    /* Run to each; one that cannot be told fails the run once the others answered. */
    memset(&in->res, 0, sizeof(in->res));
    in->left = 0;
    for (i = 0; i < p->nowners; i++) {
        rf_err e = {0};

        if ((rc = rf_registry_install_push(in->reg, p->owners[i].uid, &m, &e)) < 0) {
            if (in->res.code == 0) {
                in->res.code = rc;
                snprintf(in->res.error, sizeof(in->res.error), "%s", e.msg);
            }
            continue;
        }
        state_of(in, p->owners[i].uid, false)->running = true;
        in->left++;
    }
    if (in->left == 0)
        return rf_err_set(err, in->res.code, "%s", in->res.error);
    in->version = version;
    in->total = in->left;
    in->plan = p;
    in->running = true;
    in->aborting = false;
    in->cb = cb;
    in->arg = arg;
    if (in->res.code < 0)
        rf_install_abort(in);
    return 1;
}

bool rf_install_running(const rf_install *in, uint64_t *version, uint32_t *installers,
                        uint32_t *unanswered, bool *aborting)
{
    if (in == NULL || !in->running)
        return false;
    *version = in->version;
    *installers = in->total;
    *unanswered = in->left;
    *aborting = in->aborting;
    return true;
}

void rf_install_tick(rf_install *in)
{
    if (in == NULL || !in->aborting || uv_now(in->loop) < in->abort_at)
        return;
    for (uint32_t i = 0; i < in->nst && in->running; i++)
        if (in->st[i].running) {
            char msg[128];

            snprintf(msg, sizeof(msg), "no answer to the abort of version %llu within %.0f s",
                     (unsigned long long)in->version, RF_INSTALL_ABORT_WAIT_S);
            /* Its plan is not trusted any more: a later answer is ignored, the plan resent. */
            in->st[i].sent_serial = 0;
            settle(in, &in->st[i], -ETIMEDOUT, msg, 0, 0, NULL, NULL);
        }
}

void rf_install_abort(rf_install *in)
{
    Refit__Rpc__Install m = REFIT__RPC__INSTALL__INIT;
    Refit__Rpc__InstallAbort ab = REFIT__RPC__INSTALL_ABORT__INIT;
    rf_err err = {0};

    if (in == NULL || !in->running || in->aborting)
        return;
    in->aborting = true;
    ab.version = in->version;
    m.body_case = REFIT__RPC__INSTALL__BODY_ABORT;
    m.abort = &ab;
    for (uint32_t i = 0; i < in->nst; i++)
        if (in->st[i].running && rf_registry_install_push(in->reg, in->st[i].uid, &m, &err) < 0)
            RF_WARN("aborting version %llu: %s", (unsigned long long)in->version, err.msg);
    in->abort_at = uv_now(in->loop) + (uint64_t)(RF_INSTALL_ABORT_WAIT_S * 1000);
}

void rf_install_on_done(rf_install *in, uint64_t uid, const Refit__Rpc__InstallDone *m)
{
    inst_state *s = state_of(in, uid, false);

    if (s == NULL || !s->running || m->version != in->version) {
        RF_WARN("an installer answered for version %llu, which is not running: ignored",
                (unsigned long long)m->version);
        return;
    }
    if (m->code >= 0 && ((m->digest_sent.len != 0 && m->digest_sent.len != RF_XFER_DIGEST_BYTES) ||
                         (m->digest_recv.len != 0 && m->digest_recv.len != RF_XFER_DIGEST_BYTES))) {
        settle(in, s, -EBADMSG, "its InstallDone carries digests of the wrong size", 0, 0,
               NULL, NULL);
        return;
    }
    settle(in, s, m->code < 0 ? m->code : 0, m->error && m->error[0] ? m->error : "failed",
           m->bytes, m->seconds, m->digest_sent.len ? m->digest_sent.data : NULL,
           m->digest_recv.len ? m->digest_recv.data : NULL);
}

void rf_install_on_lost(rf_install *in, uint64_t uid, const char *why)
{
    inst_state *s = state_of(in, uid, false);

    if (s == NULL)
        return;
    s->sent_serial = 0; /* a new installer gets the plan again */
    settle(in, s, -EPIPE, why, 0, 0, NULL, NULL);
}

/* A memfd reopened read-only: what the installer maps of it cannot write the trainer's
 * memory through that descriptor. */
static int reopen_ro(int fd, rf_err *err)
{
    char path[64];
    int ro;

    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    if ((ro = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return rf_err_set(err, -errno, "cannot reopen a trainer memfd read-only through %s: %s",
                          path, strerror(errno));
    return ro;
}

int rf_install_sources(rf_install *in, uint64_t uid, const Refit__Rpc__InstallSources *m,
                       int chan, Refit__Rpc__Response **out, rf_err *err)
{
    const char *name = rf_registry_client_name(in->reg, uid);
    const rf_install_owner *o = NULL;
    const install_grant *g = NULL;
    rf_export_answer a = {0};
    uint32_t k = 0, nro = 0, ngranted = 0;
    int rc;

    *out = NULL;
    if (!in->running || in->plan == NULL)
        return rf_err_set(err, -ESTALE, "no refit is in flight: the trainers' memory is handed "
                          "out only for the plan being run");
    for (uint32_t i = 0; i < in->plan->nowners && !o; i++)
        if (in->plan->owners[i].uid == uid)
            o = &in->plan->owners[i];
    for (uint32_t i = 0; o && i < o->ngrants && !g; i++)
        if (o->grants[i].daemon_id == m->daemon_id)
            g = &o->grants[i];
    if (g == NULL)
        return rf_err_set(err, -EACCES, "engine '%s' copies nothing from publisher %016llx in "
                          "the plan in flight: its installer gets none of that memory", name,
                          (unsigned long long)m->daemon_id);
    if (g->generation != m->generation)
        return rf_err_set(err, -ESTALE, "the plan in flight reads publisher %016llx at "
                          "generation %llu, not %llu", (unsigned long long)m->daemon_id,
                          (unsigned long long)g->generation,
                          (unsigned long long)m->generation);
    rc = rf_export_fetch_answer(g->sock, in->key, in->key_len, g->pieces, g->npieces,
                                in->fetch_timeout_s, &a, err);
    if (rc < 0)
        return rc;
    /* The fds are in region order, a region's chunks together (rf_export_fetch's order). */
    for (size_t i = 0; i < a.resp->n_regions; i++) {
        const Refit__Rpc__ExportRegion *er = a.resp->regions[i];

        ngranted += er->kind != REFIT__RPC__MEM_KIND__MEM_UNKNOWN;
        if (!er->has_fd)
            continue;
        if (er->kind == REFIT__RPC__MEM_KIND__MEM_MEMFD) {
            int ro = reopen_ro(a.fds[k], err);

            if (ro < 0) {
                rc = ro;
                goto out;
            }
            close(a.fds[k]);
            a.fds[k] = ro;
            nro++;
        }
        k += er->n_chunks ? (uint32_t)er->n_chunks : 1;
    }
    if ((rc = rf_export_pass_fds(chan, a.fds, a.nfds, err)) < 0)
        goto out;
    RF_INFO("engine '%s': its installer was given %u of the %zu regions of publisher %016llx "
            "(%u pieces its plan reads; %u memfds read-only)", name, ngranted,
            a.resp->n_regions, (unsigned long long)m->daemon_id, g->npieces, nro);
    *out = a.resp;
    a.resp = NULL;
out:
    rf_export_answer_free(&a);
    return rc;
}
