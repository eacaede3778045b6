/* publisherd/coordinator.c - membership, plan, quorum, Start/Done/Commit/Abort. The only
 * writer of cluster state; every other daemon follows it. */
#define RF_LOG_MODULE "coordinator"
#include "coordinator.h"

#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "addr.h"
#include "closer.h"
#include "log.h"
#include "macros.h"
#include "plan.h"
#include "slice.h"
#include "version.h"
#include "xfer.h"

/* Abort waits this long for every member's Done of the aborted version before the next refit
 * may start (a member that never answers is also handled by its heartbeat timeout). */
#define ABORT_SETTLE_MS 5000
/* At most one log line per this many ms about connections that never joined. */
#define STRANGER_LOG_MS 10000
/* Plan slices are cut into frames of at most this many transfers (well under max_frame). */
#define SLICE_FRAME_XFERS 100000

typedef enum { ST_IDLE, ST_RUNNING, ST_ABORTING } coord_state;

typedef struct member {
    void *peer;        /* an rf_peer, or a test's fake (rf_coord__set_send); NULL: not up */
    uint64_t daemon_id;
    char node[64];
    char data_addr[128];
    char host_id[RF_PEER_HELLO_STR_MAX + 1]; /* Hello.host_id: "" never local */
    char local_sock[RF_PEER_HELLO_STR_MAX + 1];
    uint8_t *inv;      /* the member's Inventory, packed */
    size_t inv_len;
    bool inv_complete;
    uint64_t inv_gen;
    uint64_t ready;    /* publishers: the version all its trainers offer now, as its last Ready
                          said (0: none); forgotten at every abort and inventory */
    bool idle;         /* receivers: their gated engines consumed the last commit (receive
                          quorum); false until told after every commit */
    bool done, done_ok;
    uint64_t done_bytes;
    double done_transfer_s;
    uint8_t digest[RF_XFER_DIGEST_BYTES];
    bool has_digest;
    /* The member's own cluster-wide keys, as its last Inventory said (has_config false: an
     * older build that sends none; nothing is compared). */
    bool has_config;
    struct member_config {
        int transport, verify, refit_timeout_s, staging_mib, heartbeat_ms, peer_timeout_ms;
        char file[256];
    } config;
    bool config_logged;  /* its differences were logged for this daemon_id */
    char refused[512];   /* why the coordinator refuses it ("" : it is not refused) */
} member;

/* A plan build on the worker pool: inputs copied in, slices out. */
typedef struct build_job {
    uv_work_t work;
    rf_coord *c;
    uint64_t plan_gen;
    uint32_t nmembers;
    uint8_t **invs;
    size_t *inv_lens;
    uint64_t *gens;
    rf_slice_peer *peers;
    rf_side *sides;
    uint32_t *hosts;   /* per member: index of the first member on its host, or RF_HOST_NONE */
    rf_plan_opts opts;
    bool nccl;
    uint8_t nccl_id[RF_XFER_NCCL_ID_BYTES];
    /* results */
    int rc;
    rf_err err;
    uint8_t plan_id[RF_PLAN_ID_BYTES];
    rf_plan_stats stats;
    double seconds;
    Refit__PlanSlice ***slices;
    size_t *nslices;
} build_job;

struct rf_coord {
    uv_loop_t *loop;
    const rf_daemon_cfg *cfg;
    rf_peer_listener *listener;
    /* Every envelope to a member goes through send: rf_peer_send, or a test's recorder. */
    rf_coord__send_fn send;
    void *send_arg;
    uint32_t npub, nmembers;
    member *m;
    uv_timer_t deadline;
    /* Active from the first Done of a refit to its end (at most busy_poll_ms): the loop then
     * polls without sleeping. */
    uv_idle_t spin;
    uint64_t spin_until; /* uv_now() */
    rf_closer closer; /* c is freed when the last of its closes (and a build) finished */
    void (*on_change)(void *arg); /* rf_coord_set_on_change */
    void *on_change_arg;
    uint64_t strangers;           /* connections closed before joining, not logged yet */
    uint64_t strangers_logged_at; /* uv_now() of the last line about them */

    uint64_t plan_gen;     /* bumps at every inventory change */
    build_job *building;   /* a build in flight */
    bool plan_ready;
    uint8_t plan_id[RF_PLAN_ID_BYTES];
    rf_plan_stats stats;
    double plan_seconds;

    coord_state state;
    uint64_t version;      /* running or aborting */
    uint64_t committed;
    uint64_t trigger;      /* operator-requested version */
    double t_first_ready, t_start;
    char last_error[512];
    /* Why the last plan build failed ("": none since the last inventory change), and the
     * reason members were last told nothing can be refitted ("": they were told it cleared). */
    char plan_error[512];
    char blocked[768];
    struct {
        uint64_t version;
        char result[16];
        uint64_t bytes;
        double quorum_s, transfer_s, commit_s, total_s;
    } last;

    rf_metric *m_refits, *m_stage, *m_members, *m_tensors, *m_transfers, *m_committed;
};

static double now_s(void)
{
    return (double)uv_hrtime() / 1e9;
}

static const char *member_name(const rf_coord *c, uint32_t i, char *buf, size_t len)
{
    snprintf(buf, len, "%s %u (%s)", i < c->npub ? "publisher" : "receiver",
             i < c->npub ? i : i - c->npub, c->m[i].node[0] ? c->m[i].node : "never seen");
    return buf;
}

static int peer_send(void *peer, const Refit__Envelope *env, void *arg)
{
    (void)arg;
    return rf_peer_send(peer, env);
}

static void send_to(rf_coord *c, uint32_t i, const Refit__Envelope *env)
{
    char name[128];
    int rc;

    if (!c->m[i].peer)
        return;
    rc = c->send(c->m[i].peer, env, c->send_arg);
    if (rc < 0)
        RF_WARN("sending to %s failed: %s", member_name(c, i, name, sizeof(name)),
                uv_strerror(rc));
}

static void broadcast(rf_coord *c, const Refit__Envelope *env)
{
    uint32_t i;

    for (i = 0; i < c->nmembers; i++)
        send_to(c, i, env);
}

/* Why no version can be refitted until something changes ("": nothing blocks): a plan that
 * failed, or a member refused for its configuration (it holds the plan back until it comes
 * back with another). Incomplete inventories and quorums are waits, not blocks. */
static const char *block_reason(const rf_coord *c)
{
    uint32_t i;

    if (c->plan_error[0])
        return c->plan_error;
    for (i = 0; i < c->nmembers; i++)
        if (c->m[i].peer && c->m[i].refused[0])
            return c->m[i].refused;
    return "";
}

static void send_blocked(rf_coord *c, int member)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Blocked b = REFIT__BLOCKED__INIT;

    b.committed = c->committed;
    b.reason = c->blocked;
    env.body_case = REFIT__ENVELOPE__BODY_BLOCKED;
    env.blocked = &b;
    if (member < 0)
        broadcast(c, &env);
    else
        send_to(c, (uint32_t)member, &env);
}

/* Tells every member when the reason appears, changes or goes: their clients' waits end with
 * it. Returns whether they were told. */
static bool update_blocked(rf_coord *c)
{
    const char *why = block_reason(c);

    if (strcmp(why, c->blocked) == 0)
        return false;
    snprintf(c->blocked, sizeof(c->blocked), "%s", why);
    send_blocked(c, -1);
    return true;
}

/* The cluster view changed: members learn whether it blocks refits, and whoever renders status
 * (the node's snapshot) is told. */
static void changed(rf_coord *c)
{
    update_blocked(c);
    if (c->on_change)
        c->on_change(c->on_change_arg);
}

static void try_start(rf_coord *c);
static void schedule_build(rf_coord *c);
static int plan_staging_mib(const rf_coord *c);
static void on_deadline(uv_timer_t *t);
static void coord_release(rf_coord *c);
static void deadline_closed(uv_handle_t *h);
static void spin_closed(uv_handle_t *h);

/* ---- commit and abort --------------------------------------------------------------------- */

static void on_spin(uv_idle_t *h)
{
    rf_coord *c = container_of(h, rf_coord, spin);

    if (uv_now(c->loop) >= c->spin_until)
        uv_idle_stop(h);
}

static void spin_start(rf_coord *c)
{
    if (c->cfg->busy_poll_ms <= 0 || uv_is_active((uv_handle_t *)&c->spin))
        return;
    uv_update_time(c->loop);
    c->spin_until = uv_now(c->loop) + (uint64_t)c->cfg->busy_poll_ms;
    uv_idle_start(&c->spin, on_spin);
}

/* Every connected member's Done of the version in flight is in. */
static bool all_done(const rf_coord *c)
{
    uint32_t i;

    for (i = 0; i < c->nmembers; i++)
        if (c->m[i].peer && !c->m[i].done)
            return false;
    return true;
}

static void finish_abort(rf_coord *c)
{
    c->state = ST_IDLE;
    uv_timer_stop(&c->deadline);
    /* NCCL communicators that saw a failure are aborted on every daemon: the next refit needs
     * a new world, which comes with a new plan. */
    if (c->cfg->transport == RF_TRANSPORT_NCCL && c->plan_ready) {
        c->plan_gen++;
        c->plan_ready = false;
        schedule_build(c);
        return;
    }
    try_start(c);
}

static void abort_refit(rf_coord *c, const char *reason)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Abort ab = REFIT__ABORT__INIT;
    uint32_t i;

    if (c->state != ST_RUNNING)
        return;
    RF_WARN("aborting the refit of version %llu: %s", (unsigned long long)c->version, reason);
    snprintf(c->last_error, sizeof(c->last_error), "version %llu aborted: %s",
             (unsigned long long)c->version, reason);
    ab.version = c->version;
    ab.reason = (char *)reason;
    env.body_case = REFIT__ENVELOPE__BODY_ABORT;
    env.abort = &ab;
    broadcast(c, &env);
    c->last.version = c->version;
    snprintf(c->last.result, sizeof(c->last.result), "aborted");
    c->last.total_s = now_s() - c->t_start;
    rf_metric_add(c->m_refits, 1, "aborted");
    /* Trainers must publish again (their publish of this version failed, and each publisher
     * says anew what its trainers offer after it handled the Abort), and an operator trigger
     * is consumed: a persistent failure must not loop. */
    for (i = 0; i < c->npub; i++)
        c->m[i].ready = 0;
    c->trigger = c->committed;
    c->state = ST_ABORTING;
    uv_idle_stop(&c->spin);
    uv_timer_stop(&c->deadline);
    /* Nothing to settle when every Done is in already (the digests disagreed). */
    if (all_done(c)) {
        finish_abort(c);
        return;
    }
    uv_timer_start(&c->deadline, on_deadline, ABORT_SETTLE_MS, 0);
}

static void commit_refit(rf_coord *c)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Commit cm = REFIT__COMMIT__INIT;
    double end = now_s();
    uint8_t x[RF_XFER_DIGEST_BYTES] = {0};
    uint64_t bytes = 0;
    double transfer = 0;
    uint32_t i, k;

    for (i = 0; i < c->nmembers; i++) {
        if (c->m[i].has_digest)
            for (k = 0; k < RF_XFER_DIGEST_BYTES; k++)
                x[k] ^= c->m[i].digest[k];
        /* What the receivers installed: received over the network or copied on their host
         * (a publisher whose bytes all went by local copy sent nothing). */
        if (i >= c->npub)
            bytes += c->m[i].done_bytes;
        if (c->m[i].done_transfer_s > transfer)
            transfer = c->m[i].done_transfer_s;
    }
    /* A receiver's Done counts the bytes it relayed as well: installed once, sent again. */
    bytes = bytes > c->stats.relay_bytes ? bytes - c->stats.relay_bytes : 0;
    if (c->cfg->verify != RF_VERIFY_OFF) {
        for (k = 0; k < RF_XFER_DIGEST_BYTES && x[k] == 0; k++)
            ;
        if (k < RF_XFER_DIGEST_BYTES) {
            abort_refit(c, "verification failed: the digests of the bytes sent and the bytes "
                        "received differ");
            return;
        }
    }
    cm.version = c->version;
    env.body_case = REFIT__ENVELOPE__BODY_COMMIT;
    env.commit = &cm;
    broadcast(c, &env);
    uv_timer_stop(&c->deadline);
    uv_idle_stop(&c->spin);
    c->committed = c->version;
    c->state = ST_IDLE;
    /* Each receiver says again when its engines are done with this version. */
    for (i = c->npub; i < c->nmembers; i++)
        c->m[i].idle = false;
    c->last.version = c->version;
    snprintf(c->last.result, sizeof(c->last.result), "committed");
    c->last.bytes = bytes;
    c->last.quorum_s = c->t_first_ready > 0 ? c->t_start - c->t_first_ready : 0;
    c->last.transfer_s = transfer;
    c->last.commit_s = end - c->t_start;
    c->last.total_s = c->last.quorum_s + c->last.commit_s;
    rf_metric_add(c->m_refits, 1, "committed");
    rf_metric_set(c->m_committed, (double)c->committed);
    rf_metric_observe(c->m_stage, c->last.quorum_s, "publish_quorum");
    rf_metric_observe(c->m_stage, c->last.transfer_s, "transfer");
    rf_metric_observe(c->m_stage, c->last.commit_s, "start_to_commit");
    RF_INFO("refit %llu committed: %llu bytes, quorum %.3f s, transfer %.3f s, start->commit "
            "%.3f s (%.2f GB/s)", (unsigned long long)c->version, (unsigned long long)bytes,
            c->last.quorum_s, transfer, c->last.commit_s,
            c->last.commit_s > 0 ? (double)bytes / c->last.commit_s / 1e9 : 0.0);
    c->t_first_ready = 0;
    try_start(c);
}

static void on_deadline(uv_timer_t *t)
{
    rf_coord *c = container_of(t, rf_coord, deadline);
    char reason[512], name[128];
    size_t off;
    uint32_t i;

    if (c->state == ST_ABORTING) {
        finish_abort(c);
        changed(c);
        return;
    }
    off = (size_t)snprintf(reason, sizeof(reason), "no Done within %d s from:",
                           c->cfg->refit_timeout_s);
    for (i = 0; i < c->nmembers && off < sizeof(reason); i++)
        if (!c->m[i].done)
            off += (size_t)snprintf(reason + off, sizeof(reason) - off, " %s",
                                    member_name(c, i, name, sizeof(name)));
    abort_refit(c, reason);
    changed(c);
}

/* ---- starting a refit --------------------------------------------------------------------- */

static void try_start(rf_coord *c)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Start st = REFIT__START__INIT;
    Refit__ClusterConfig cc = REFIT__CLUSTER_CONFIG__INIT;
    uint64_t target = 0;
    bool ready = true;
    uint32_t i;

    if (c->closer.closing || c->state != ST_IDLE || !c->plan_ready)
        return;
    for (i = 0; i < c->nmembers; i++)
        if (!c->m[i].peer)
            return;
    /* Receive quorum: every receiver's gated engines are done with what it committed. */
    for (i = c->npub; i < c->nmembers; i++)
        if (!c->m[i].idle)
            return;
    /* A version starts only when every publisher's trainers offer exactly it: a publisher whose
     * trainers hold another version (one moved on, or its trainers were replaced) holds it
     * back, so no version is ever read from memory that was not published as it. */
    for (i = 0; i < c->npub; i++) {
        if (c->m[i].ready <= c->committed || (i > 0 && c->m[i].ready != target))
            ready = false;
        target = c->m[i].ready;
    }
    /* An operator's trigger reads what the trainers hold now, published or not. */
    if (c->trigger > c->committed && (!ready || c->trigger > target)) {
        target = c->trigger;
        ready = true;
    }
    if (!ready || c->npub == 0)
        return;

    c->state = ST_RUNNING;
    c->version = target;
    c->t_start = now_s();
    for (i = 0; i < c->nmembers; i++) {
        c->m[i].done = c->m[i].done_ok = c->m[i].has_digest = false;
        c->m[i].done_bytes = 0;
        c->m[i].done_transfer_s = 0;
    }
    st.version = target;
    st.plan_id.data = c->plan_id;
    st.plan_id.len = RF_PLAN_ID_BYTES;
    /* The refit's cluster-wide settings: every member runs it with the coordinator's. */
    st.config = &cc;
    cc.transport = (uint32_t)c->cfg->transport;
    cc.verify = (uint32_t)c->cfg->verify;
    cc.refit_timeout_s = (uint32_t)c->cfg->refit_timeout_s;
    cc.staging_mib = (uint32_t)plan_staging_mib(c);
    cc.heartbeat_ms = (uint32_t)c->cfg->heartbeat_ms;
    cc.peer_timeout_ms = (uint32_t)c->cfg->peer_timeout_ms;
    env.body_case = REFIT__ENVELOPE__BODY_START;
    env.start = &st;
    /* Receivers first: they are ready to take bytes before any sender starts gathering, and
     * their Start is not queued behind a co-located sender's CPU-bound packing. The log line
     * after: the daemons wait for Start, nobody waits for the line. */
    for (i = c->nmembers; i-- > c->npub;)
        send_to(c, i, &env);
    for (i = 0; i < c->npub; i++)
        send_to(c, i, &env);
    RF_INFO("starting the refit of version %llu", (unsigned long long)target);
    uv_timer_start(&c->deadline, on_deadline, (uint64_t)c->cfg->refit_timeout_s * 1000 + 1000,
                   0);
}

/* ---- the plan ------------------------------------------------------------------------------- */

static void build_free(build_job *b)
{
    uint32_t i;
    size_t k;

    for (i = 0; i < b->nmembers; i++) {
        free(b->invs[i]);
        free((char *)b->peers[i].data_addr);
        free((char *)b->peers[i].local_sock);
        if (b->slices && b->slices[i]) {
            for (k = 0; k < b->nslices[i]; k++)
                rf_slice_msg_free(b->slices[i][k]);
            free(b->slices[i]);
        }
    }
    free(b->invs);
    free(b->inv_lens);
    free(b->gens);
    free(b->peers);
    free(b->sides);
    free(b->hosts);
    free(b->slices);
    free(b->nslices);
    free(b);
}

static void build_work(uv_work_t *w)
{
    build_job *b = container_of(w, build_job, work);
    Refit__Inventory **invs = calloc(b->nmembers, sizeof(*invs));
    rf_slice_map map = {0};
    rf_inv *inv = NULL;
    rf_plan *plan = NULL;
    double t0 = now_s();
    uint32_t i;

    b->slices = calloc(b->nmembers, sizeof(*b->slices));
    b->nslices = calloc(b->nmembers, sizeof(*b->nslices));
    if (!invs || !b->slices || !b->nslices) {
        b->rc = rf_err_set(&b->err, -ENOMEM, "out of memory building the plan");
        goto out;
    }
    for (i = 0; i < b->nmembers; i++) {
        invs[i] = refit__inventory__unpack(NULL, b->inv_lens[i], b->invs[i]);
        if (!invs[i]) {
            b->rc = rf_err_set(&b->err, -EPROTO, "inventory of member %u does not unpack", i);
            goto out;
        }
    }
    b->rc = rf_slice_merge(invs, b->sides, b->nmembers, &inv, &map, &b->err);
    if (b->rc < 0)
        goto out;
    /* Same-host copies: every endpoint of a member on a known host gets that host. */
    for (i = 0; i < rf_inv_nendpoints(inv); i++)
        rf_inv_set_endpoint_host(inv, i, b->hosts[map.ep_member[i]], NULL);
    b->rc = rf_plan_build(inv, &b->opts, &plan, &b->err);
    if (b->rc < 0)
        goto out;
    memcpy(b->plan_id, rf_plan_id(plan), RF_PLAN_ID_BYTES);
    b->stats = *rf_plan_stats_get(plan);
    if (b->nccl) {
        /* A fresh world for every plan: a world that lost a rank cannot be rejoined. */
        b->rc = rf_xfer_nccl_unique_id(b->nccl_id, &b->err);
        if (b->rc < 0)
            goto out;
    }
    for (i = 0; i < b->nmembers; i++) {
        b->rc = rf_slice_build(plan, &map, i, b->peers, b->gens[i], SLICE_FRAME_XFERS,
                               b->nccl ? b->nccl_id : NULL, &b->slices[i], &b->nslices[i]);
        if (b->rc < 0) {
            rf_err_set(&b->err, b->rc, "building the plan slice of member %u failed", i);
            goto out;
        }
    }
    b->seconds = now_s() - t0;
out:
    for (i = 0; invs && i < b->nmembers; i++)
        if (invs[i])
            refit__inventory__free_unpacked(invs[i], NULL);
    free(invs);
    rf_plan_free(plan);
    rf_inv_free(inv);
    rf_slice_map_free(&map);
}

static void build_after(uv_work_t *w, int status)
{
    build_job *b = container_of(w, build_job, work);
    rf_coord *c = b->c;
    char id[RF_PLAN_ID_HEX];
    uint32_t i, k;

    c->building = NULL;
    if (c->closer.closing) {
        build_free(b);
        coord_release(c);
        return;
    }
    if (status < 0 || b->plan_gen != c->plan_gen) {
        build_free(b);
        schedule_build(c);
        return;
    }
    if (b->rc < 0) {
        RF_ERROR("the plan failed: %s", b->err.msg);
        snprintf(c->last_error, sizeof(c->last_error), "plan failed: %s", b->err.msg);
        snprintf(c->plan_error, sizeof(c->plan_error), "the coordinator cannot plan: %s",
                 b->err.msg);
        for (i = 0; i < c->nmembers; i++) {
            Refit__Envelope env = REFIT__ENVELOPE__INIT;
            Refit__Error e = REFIT__ERROR__INIT;

            e.code = b->rc;
            e.message = c->last_error;
            env.body_case = REFIT__ENVELOPE__BODY_ERROR;
            env.error = &e;
            send_to(c, i, &env);
        }
        build_free(b);
        changed(c);
        return;
    }
    memcpy(c->plan_id, b->plan_id, RF_PLAN_ID_BYTES);
    c->stats = b->stats;
    c->plan_seconds = b->seconds;
    for (i = 0; i < c->nmembers; i++) {
        for (k = 0; k < b->nslices[i]; k++) {
            Refit__Envelope env = REFIT__ENVELOPE__INIT;

            env.body_case = REFIT__ENVELOPE__BODY_PLAN_SLICE;
            env.plan_slice = b->slices[i][k];
            send_to(c, i, &env);
        }
    }
    rf_plan_id_to_hex(c->plan_id, id);
    RF_INFO("plan %.16s built in %.3f s: %u tensors, %llu transfers, %llu messages, %llu "
            "rounds, %llu bytes", id, c->plan_seconds, c->stats.tensors,
            (unsigned long long)c->stats.transfers, (unsigned long long)c->stats.messages,
            (unsigned long long)c->stats.rounds, (unsigned long long)c->stats.dst_bytes);
    if (c->stats.relay_messages > 0)
        RF_INFO("plan %.16s relays %llu bytes in %llu messages (depth %u, fanout %u): "
                "trainers send %llu of %llu bytes", id,
                (unsigned long long)c->stats.relay_bytes,
                (unsigned long long)c->stats.relay_messages, c->stats.relay_depth,
                c->stats.relay_fanout, (unsigned long long)c->stats.source_bytes,
                (unsigned long long)c->stats.dst_bytes);
    if (c->stats.quant_transfers > 0)
        RF_INFO("plan %.16s quantizes %llu transfers into FP8 engines on their senders: %llu "
                "bytes of FP8 elements and scales", id,
                (unsigned long long)c->stats.quant_transfers,
                (unsigned long long)c->stats.quant_bytes);
    if (c->stats.fp8_copy_transfers > 0)
        RF_INFO("plan %.16s copies %llu transfers from trainers' FP8 pieces into FP8 engines of "
                "the same format: %llu bytes of FP8 elements and scales", id,
                (unsigned long long)c->stats.fp8_copy_transfers,
                (unsigned long long)c->stats.fp8_copy_bytes);
    if (c->stats.recv_quant_transfers > 0)
        RF_INFO("plan %.16s moves %llu transfers into FP8 engines off their grid (trainer shards "
                "cut their blocks): %llu bytes in the tensors' dtype, quantized by the receivers",
                id, (unsigned long long)c->stats.recv_quant_transfers,
                (unsigned long long)c->stats.recv_quant_bytes);
    rf_metric_set(c->m_tensors, c->stats.tensors);
    rf_metric_set(c->m_transfers, (double)c->stats.transfers);
    c->plan_ready = true;
    build_free(b);
    try_start(c);
    changed(c);
}

/* Staging is each member's own memory: the plan's budget per GPU is the smallest that the
 * coordinator and any member allow. */
static int plan_staging_mib(const rf_coord *c)
{
    int mib = c->cfg->staging_mib;
    uint32_t i;

    for (i = 0; i < c->nmembers; i++)
        if (c->m[i].has_config && c->m[i].config.staging_mib < mib)
            mib = c->m[i].config.staging_mib;
    return mib;
}

static void schedule_build(rf_coord *c)
{
    build_job *b;
    uint32_t i, k;

    if (c->building || c->closer.closing)
        return;
    for (i = 0; i < c->nmembers; i++)
        if (!c->m[i].peer || !c->m[i].inv_complete || c->m[i].refused[0])
            return;
    b = calloc(1, sizeof(*b));
    if (!b)
        goto nomem;
    b->c = c;
    b->plan_gen = c->plan_gen;
    b->nmembers = c->nmembers;
    b->invs = calloc(c->nmembers, sizeof(*b->invs));
    b->inv_lens = calloc(c->nmembers, sizeof(*b->inv_lens));
    b->gens = calloc(c->nmembers, sizeof(*b->gens));
    b->peers = calloc(c->nmembers, sizeof(*b->peers));
    b->sides = calloc(c->nmembers, sizeof(*b->sides));
    b->hosts = calloc(c->nmembers, sizeof(*b->hosts));
    if (!b->invs || !b->inv_lens || !b->gens || !b->peers || !b->sides || !b->hosts)
        goto nomem;
    for (i = 0; i < c->nmembers; i++) {
        b->invs[i] = malloc(c->m[i].inv_len ? c->m[i].inv_len : 1);
        b->peers[i].data_addr = strdup(c->m[i].data_addr);
        b->peers[i].local_sock = strdup(c->m[i].local_sock);
        if (!b->invs[i] || !b->peers[i].data_addr || !b->peers[i].local_sock)
            goto nomem;
        b->peers[i].generation = c->m[i].inv_gen;
        b->hosts[i] = RF_HOST_NONE;
        for (k = 0; c->m[i].host_id[0] && k <= i; k++)
            if (strcmp(c->m[k].host_id, c->m[i].host_id) == 0) {
                b->hosts[i] = k;
                break;
            }
        memcpy(b->invs[i], c->m[i].inv, c->m[i].inv_len);
        b->inv_lens[i] = c->m[i].inv_len;
        b->gens[i] = c->m[i].inv_gen;
        b->peers[i].daemon_id = c->m[i].daemon_id;
        b->peers[i].role = i < c->npub ? REFIT__ROLE__ROLE_PUBLISHER : REFIT__ROLE__ROLE_RECEIVER;
        b->sides[i] = i < c->npub ? RF_SRC : RF_DST;
    }
    b->nccl = c->cfg->transport == RF_TRANSPORT_NCCL;
    rf_plan_opts_default(&b->opts);
    b->opts.staging_bytes = (uint64_t)plan_staging_mib(c) << 20;
    b->opts.direct_min_bytes = (uint64_t)c->cfg->direct_min_kib << 10;
    b->opts.relay = c->cfg->relay == RF_RELAY_ON;
    c->building = b;
    if (uv_queue_work(c->loop, &b->work, build_work, build_after) < 0) {
        c->building = NULL;
        goto nomem;
    }
    RF_INFO("all %u daemons registered: building the plan", c->nmembers);
    return;
nomem:
    RF_ERROR("out of memory starting the plan build");
    if (b)
        build_free(b);
}

static void invalidate_plan(rf_coord *c, const char *why)
{
    c->plan_gen++;
    c->plan_ready = false;
    /* New inputs: whether they plan is known once the next build ends. */
    c->plan_error[0] = '\0';
    if (c->state == ST_RUNNING)
        abort_refit(c, why);
}

/* ---- member connections -------------------------------------------------------------------- */

static int member_of(rf_coord *c, const void *p)
{
    uint32_t i;

    for (i = 0; i < c->nmembers; i++)
        if (c->m[i].peer == p)
            return (int)i;
    return -1;
}

/* A daemon whose data listener takes all interfaces (data_listen = ":7471", "*:7471",
 * "0.0.0.0:7471" or "[::]:7471") cannot name one address its peers reach; the address it
 * reached the coordinator from, with the listener's port, is the one they are told. */
static void member_data_addr(member *m, const char *data_addr, const char *from)
{
    rf_addr d, f;

    if (rf_addr_parse(data_addr, RF_ADDR_LISTEN, &d, NULL) == 0 &&
        (d.host[0] == '\0' || strcmp(d.host, "0.0.0.0") == 0 || strcmp(d.host, "::") == 0) &&
        rf_addr_parse(from, RF_ADDR_CONNECT, &f, NULL) == 0) {
        snprintf(m->data_addr, sizeof(m->data_addr), "%s%s%s:%s", strchr(f.host, ':') ? "[" : "",
                 f.host, strchr(f.host, ':') ? "]" : "", d.port);
        return;
    }
    snprintf(m->data_addr, sizeof(m->data_addr), "%s", data_addr);
}

int rf_coord__member_up(rf_coord *c, const Refit__Hello *h, void *peer, const char *from,
                        rf_err *err)
{
    const char *what = h->role == REFIT__ROLE__ROLE_PUBLISHER ? "publisher" : "receiver";
    uint32_t slot;
    member *m;

    if (h->role == REFIT__ROLE__ROLE_PUBLISHER) {
        if (h->index >= c->npub)
            return rf_err_set(err, -EINVAL, "publisher index %u is outside the configured "
                              "publishers", h->index);
        slot = h->index;
    } else if (h->role == REFIT__ROLE__ROLE_RECEIVER) {
        if (h->index >= c->nmembers - c->npub)
            return rf_err_set(err, -EINVAL, "receiver index %u is outside the configured "
                              "receivers", h->index);
        slot = c->npub + h->index;
    } else {
        return rf_err_set(err, -EINVAL, "role %u cannot join as a member", (uint32_t)h->role);
    }
    m = &c->m[slot];
    if (m->peer)
        return rf_err_set(err, -EEXIST, "%s index %u is already connected (two daemons share "
                          "an index?)", what, h->index);
    m->peer = peer;
    if (m->daemon_id != h->daemon_id) {
        /* A new process: whatever its predecessor said no longer holds. */
        free(m->inv);
        m->inv = NULL;
        m->inv_len = 0;
        m->inv_complete = false;
        m->ready = 0;
        m->idle = false;
        m->has_config = false;
        m->config_logged = false;
    }
    /* Its next inventory says again whether it can follow the cluster's configuration. */
    m->refused[0] = '\0';
    m->daemon_id = h->daemon_id;
    snprintf(m->node, sizeof(m->node), "%s", h->node);
    snprintf(m->host_id, sizeof(m->host_id), "%s", h->host_id);
    snprintf(m->local_sock, sizeof(m->local_sock), "%s", h->local_sock);
    member_data_addr(m, h->data_addr, from);
    RF_INFO("%s %u (%s) joined from %s", what, h->index, h->node, from);
    rf_metric_add(c->m_members, 1);
    invalidate_plan(c, "a daemon joined");
    schedule_build(c);
    /* A member that joins learns what blocks refits now, as the others did when it began. */
    if (!update_blocked(c) && c->blocked[0])
        send_blocked(c, (int)slot);
    changed(c);
    return 0;
}

static void peer_up(rf_peer *p, const Refit__Hello *h)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Error e = REFIT__ERROR__INIT;
    rf_coord *c = rf_peer_data(p);
    rf_err err = {0};
    int rc = rf_coord__member_up(c, h, p, rf_peer_remote(p), &err);

    if (rc == 0)
        return;
    RF_WARN("refusing %s: %s", rf_peer_remote(p), err.msg);
    e.code = rc;
    e.message = err.msg;
    env.body_case = REFIT__ENVELOPE__BODY_ERROR;
    env.error = &e;
    rf_peer_send(p, &env);
    rf_peer_close(p, err.msg);
}

static const char *transport_str(int t, char *buf, size_t len)
{
    if (t == RF_TRANSPORT_TCP || t == RF_TRANSPORT_NCCL)
        return rf_transport_name(t);
    snprintf(buf, len, "unknown (%d)", t);
    return buf;
}

static const char *verify_str(int v, char *buf, size_t len)
{
    if (v >= RF_VERIFY_OFF && v <= RF_VERIFY_FULL)
        return rf_verify_name(v);
    snprintf(buf, len, "unknown (%d)", v);
    return buf;
}

/* Member i's own cluster-wide keys against the coordinator's. A member cannot take its
 * transport or its heartbeat timing from the coordinator (its clients registered memory for
 * its transport; the timers run from its start): a mismatch there refuses it, -EINVAL with err
 * naming the member, the key, both values and the fix. verify and refit_timeout_s it takes
 * from every Start, and the plan's staging budget is the smallest of all: those only show. */
static int check_config(rf_coord *c, uint32_t i, rf_err *err)
{
    const member *mb = &c->m[i];
    const struct member_config *mc = &mb->config;
    const rf_daemon_cfg *cfg = c->cfg;
    char name[128], where[300], b1[32], b2[32];

    member_name(c, i, name, sizeof(name));
    snprintf(where, sizeof(where), "%s on %s", mc->file[0] ? mc->file : "its config file",
             mb->node);
    if (mc->transport != cfg->transport)
        return rf_err_set(err, -EINVAL, "%s is refused: it runs transport = %s, the "
                          "coordinator transport = %s: transport is cluster-wide and a daemon cannot switch it while "
                          "it runs (its clients registered memory for its own); set transport "
                          "= %s in %s and restart it, or run every daemon with transport = %s",
                          name, transport_str(mc->transport, b1, sizeof(b1)),
                          rf_transport_name(cfg->transport), rf_transport_name(cfg->transport),
                          where, transport_str(mc->transport, b2, sizeof(b2)));
    if (mc->heartbeat_ms >= cfg->peer_timeout_ms)
        return rf_err_set(err, -EINVAL, "%s is refused: it sends a heartbeat every %d ms "
                          "(heartbeat_ms), but the coordinator declares a member dead after %d ms without a frame "
                          "(peer_timeout_ms): set heartbeat_ms below %d in %s, or "
                          "peer_timeout_ms above %d in %s on the coordinator", name,
                          mc->heartbeat_ms, cfg->peer_timeout_ms, cfg->peer_timeout_ms, where,
                          mc->heartbeat_ms, cfg->config_path);
    if (cfg->heartbeat_ms >= mc->peer_timeout_ms)
        return rf_err_set(err, -EINVAL, "%s is refused: the coordinator sends a heartbeat "
                          "every %d ms (heartbeat_ms), but it declares the coordinator dead after "
                          "%d ms without a frame (peer_timeout_ms): set peer_timeout_ms above %d "
                          "in %s, or heartbeat_ms below %d in %s on the coordinator", name,
                          cfg->heartbeat_ms, mc->peer_timeout_ms, cfg->heartbeat_ms, where,
                          mc->peer_timeout_ms, cfg->config_path);
    return 0;
}

/* Where member i's config says otherwise than the coordinator's and the coordinator's value
 * holds: one object per key (key, member, cluster, what happens). */
static json_t *config_differs(const rf_coord *c, uint32_t i)
{
    const struct member_config *mc = &c->m[i].config;
    json_t *a = json_array();
    char b1[32];

    if (!c->m[i].has_config)
        return a;
    if (mc->verify != c->cfg->verify)
        json_array_append_new(a, json_pack("{s:s, s:s, s:s, s:s}", "key", "verify", "member",
                              verify_str(mc->verify, b1, sizeof(b1)), "cluster",
                              rf_verify_name(c->cfg->verify), "resolution",
                              "adopted: the member runs every refit with the coordinator's "
                              "value, sent with Start"));
    if (mc->refit_timeout_s != c->cfg->refit_timeout_s)
        json_array_append_new(a, json_pack("{s:s, s:i, s:i, s:s}", "key", "refit_timeout_s",
                              "member", mc->refit_timeout_s, "cluster",
                              c->cfg->refit_timeout_s, "resolution",
                              "adopted: the member runs every refit with the coordinator's "
                              "value, sent with Start"));
    if (mc->staging_mib != c->cfg->staging_mib)
        json_array_append_new(a, json_pack("{s:s, s:i, s:i, s:s}", "key", "staging_mib",
                              "member", mc->staging_mib, "cluster", c->cfg->staging_mib,
                              "resolution", "the plan's staging budget is the smallest of "
                              "all daemons' (cluster.config.staging_mib)"));
    return a;
}

/* The member's cluster-wide keys from its inventory: a member that cannot follow the
 * coordinator's is refused (it holds the plan back until it comes back with another config),
 * differences the coordinator's values resolve are logged once per daemon. */
static void take_config(rf_coord *c, uint32_t i, const Refit__ClusterConfig *cc)
{
    member *mb = &c->m[i];
    struct member_config *mc = &mb->config;
    rf_err err = {0};
    char name[128], line[512];
    json_t *d;
    size_t k;

    mb->refused[0] = '\0';
    if (!cc) {
        mb->has_config = false;
        return;
    }
    mb->has_config = true;
    mc->transport = (int)(cc->transport > INT_MAX ? INT_MAX : cc->transport);
    mc->verify = (int)(cc->verify > INT_MAX ? INT_MAX : cc->verify);
    mc->refit_timeout_s = (int)(cc->refit_timeout_s > INT_MAX ? INT_MAX : cc->refit_timeout_s);
    /* A budget of 0 would plan nothing; the key's own bounds start at 1. */
    mc->staging_mib = cc->staging_mib < 1 ? 1 : cc->staging_mib > INT_MAX ? INT_MAX
                                                                          : (int)cc->staging_mib;
    mc->heartbeat_ms = (int)(cc->heartbeat_ms > INT_MAX ? INT_MAX : cc->heartbeat_ms);
    mc->peer_timeout_ms = (int)(cc->peer_timeout_ms > INT_MAX ? INT_MAX : cc->peer_timeout_ms);
    snprintf(mc->file, sizeof(mc->file), "%s", cc->config_file);
    if (check_config(c, i, &err) < 0) {
        Refit__Envelope env = REFIT__ENVELOPE__INIT;
        Refit__Error e = REFIT__ERROR__INIT;

        RF_WARN("%s", err.msg);
        snprintf(mb->refused, sizeof(mb->refused), "%s", err.msg);
        snprintf(c->last_error, sizeof(c->last_error), "%s", err.msg);
        /* The member's log and status show it (it stays connected: nothing changes until it
         * is restarted with another config). */
        e.code = err.code;
        e.message = err.msg;
        env.body_case = REFIT__ENVELOPE__BODY_ERROR;
        env.error = &e;
        send_to(c, i, &env);
        return;
    }
    if (mb->config_logged)
        return;
    mb->config_logged = true;
    d = config_differs(c, i);
    for (k = 0; k < json_array_size(d); k++) {
        json_t *o = json_array_get(d, k), *mv = json_object_get(o, "member"),
               *cv = json_object_get(o, "cluster");

        if (json_is_string(mv))
            snprintf(line, sizeof(line), "%s = %s in %s, the coordinator's %s",
                     json_string_value(json_object_get(o, "key")), json_string_value(mv),
                     mc->file[0] ? mc->file : "its config", json_string_value(cv));
        else
            snprintf(line, sizeof(line), "%s = %lld in %s, the coordinator's %lld",
                     json_string_value(json_object_get(o, "key")),
                     (long long)json_integer_value(mv), mc->file[0] ? mc->file : "its config",
                     (long long)json_integer_value(cv));
        RF_INFO("%s has %s: %s", member_name(c, i, name, sizeof(name)), line,
                json_string_value(json_object_get(o, "resolution")));
    }
    json_decref(d);
}

static void on_inventory(rf_coord *c, uint32_t i, const Refit__Inventory *inv)
{
    member *mb = &c->m[i];
    size_t len = refit__inventory__get_packed_size(inv);
    uint8_t *buf = malloc(len ? len : 1);
    char name[128];

    if (!buf) {
        RF_ERROR("out of memory storing an inventory");
        return;
    }
    refit__inventory__pack(inv, buf);
    free(mb->inv);
    mb->inv = buf;
    mb->inv_len = len;
    mb->inv_complete = inv->complete;
    mb->inv_gen = inv->generation;
    take_config(c, i, inv->config);
    /* A new inventory means new clients: their readiness comes in the Ready that follows. */
    mb->ready = 0;
    RF_INFO("inventory of %s: %s, %zu pieces", member_name(c, i, name, sizeof(name)),
            inv->complete ? "complete" : "incomplete", inv->n_pieces);
    /* A restarted coordinator continues from the version the cluster committed last: no plan
     * is built (so nothing starts) before every member's inventory brought its own. */
    if (inv->committed > c->committed) {
        RF_INFO("%s reports version %llu committed: the cluster continues from it",
                member_name(c, i, name, sizeof(name)), (unsigned long long)inv->committed);
        c->committed = inv->committed;
        if (c->trigger < c->committed)
            c->trigger = c->committed;
        rf_metric_set(c->m_committed, (double)c->committed);
    }
    invalidate_plan(c, "an inventory changed (a client left or re-registered)");
    schedule_build(c);
}

static void on_done(rf_coord *c, uint32_t i, const Refit__Done *d)
{
    member *mb = &c->m[i];
    char name[128], reason[512];
    uint32_t k;

    if ((c->state != ST_RUNNING && c->state != ST_ABORTING) || d->version != c->version)
        return;
    mb->done = true;
    mb->done_ok = d->ok;
    mb->done_bytes = d->bytes;
    mb->done_transfer_s = d->times ? d->times->transfer_s : 0;
    mb->has_digest = d->digest.len == RF_XFER_DIGEST_BYTES;
    if (mb->has_digest)
        memcpy(mb->digest, d->digest.data, RF_XFER_DIGEST_BYTES);
    if (c->state == ST_ABORTING) {
        if (all_done(c))
            finish_abort(c);
        return;
    }
    if (!d->ok) {
        snprintf(reason, sizeof(reason), "%s: %s", member_name(c, i, name, sizeof(name)),
                 d->error);
        abort_refit(c, reason);
        return;
    }
    for (k = 0; k < c->nmembers; k++) {
        if (!c->m[k].done) {
            spin_start(c);
            return;
        }
    }
    commit_refit(c);
}

/* Tells member i why what it sent was refused (its log and status show the message). */
static void refuse(rf_coord *c, uint32_t i, const rf_err *err)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Error e = REFIT__ERROR__INIT;
    char name[128];

    RF_WARN("%s: %s", member_name(c, i, name, sizeof(name)), err->msg);
    e.code = err->code;
    e.message = (char *)err->msg;
    env.body_case = REFIT__ENVELOPE__BODY_ERROR;
    env.error = &e;
    send_to(c, i, &env);
}

static void on_ready(rf_coord *c, uint32_t i, uint64_t version)
{
    rf_err err = {0};

    if (version != 0 && rf_version_check(version, c->committed, "Ready", &err) < 0) {
        rf_err_wrap(&err, "the trainers of this publisher must publish a newer version: ");
        refuse(c, i, &err);
        version = 0;
    }
    c->m[i].ready = version;
    if (version != 0 && c->t_first_ready == 0)
        c->t_first_ready = now_s();
    try_start(c);
}

static void on_trigger(rf_coord *c, uint32_t i, uint64_t version)
{
    rf_err err = {0};

    if (rf_version_check(version, c->committed, "Trigger", &err) < 0) {
        refuse(c, i, &err);
        return;
    }
    if (version > c->trigger) {
        RF_INFO("operator trigger of version %llu", (unsigned long long)version);
        c->trigger = version;
        if (c->t_first_ready == 0)
            c->t_first_ready = now_s();
    }
    try_start(c);
}

static void coord_envelope(rf_coord *c, int i, const Refit__Envelope *env)
{
    switch (env->body_case) {
    case REFIT__ENVELOPE__BODY_INVENTORY:
        on_inventory(c, (uint32_t)i, env->inventory);
        break;
    case REFIT__ENVELOPE__BODY_READY:
        if ((uint32_t)i >= c->npub)
            break;
        on_ready(c, (uint32_t)i, env->ready->version);
        break;
    case REFIT__ENVELOPE__BODY_IDLE:
        if ((uint32_t)i < c->npub)
            break;
        c->m[i].idle = env->idle->ready;
        try_start(c);
        break;
    case REFIT__ENVELOPE__BODY_TRIGGER:
        on_trigger(c, (uint32_t)i, env->trigger->version);
        break;
    case REFIT__ENVELOPE__BODY_DONE:
        on_done(c, (uint32_t)i, env->done);
        break;
    case REFIT__ENVELOPE__BODY_ERROR:
        RF_WARN("member %d reports: %s", i, env->error->message);
        break;
    default:
        RF_WARN("unexpected message %d from member %d", env->body_case, i);
        break;
    }
    changed(c);
}

static void peer_envelope(rf_peer *p, const Refit__Envelope *env)
{
    rf_coord *c = rf_peer_data(p);
    int i = member_of(c, p);

    if (i >= 0)
        coord_envelope(c, i, env);
}

void rf_coord__envelope(rf_coord *c, uint32_t member, const Refit__Envelope *env)
{
    if (member < c->nmembers)
        coord_envelope(c, (int)member, env);
}

void rf_coord_set_on_change(rf_coord *c, void (*fn)(void *arg), void *arg)
{
    c->on_change = fn;
    c->on_change_arg = arg;
}

void rf_coord__set_send(rf_coord *c, rf_coord__send_fn fn, void *arg)
{
    c->send = fn ? fn : peer_send;
    c->send_arg = fn ? arg : NULL;
}

bool rf_coord__expire(rf_coord *c)
{
    if (!uv_is_active((uv_handle_t *)&c->deadline))
        return false;
    uv_timer_stop(&c->deadline);
    on_deadline(&c->deadline);
    return true;
}

static void member_lost(rf_coord *c, uint32_t i, const char *reason)
{
    char name[128], why[384];

    RF_WARN("lost %s: %s", member_name(c, i, name, sizeof(name)), reason);
    c->m[i].peer = NULL;
    c->m[i].inv_complete = false;
    rf_metric_add(c->m_members, -1);
    snprintf(why, sizeof(why), "lost %s: %s", name, reason);
    if (c->state == ST_ABORTING && !c->m[i].done) {
        c->m[i].done = true;
        if (all_done(c))
            finish_abort(c);
    }
    invalidate_plan(c, why);
    changed(c);
}

void rf_coord__member_down(rf_coord *c, void *peer, const char *reason)
{
    int i = member_of(c, peer);

    if (peer && i >= 0)
        member_lost(c, (uint32_t)i, reason);
}

static void peer_down(rf_peer *p, const char *reason)
{
    rf_coord *c = rf_peer_data(p);
    int i;

    if (!c)
        return;
    i = member_of(c, p);
    if (i < 0) {
        /* Never a member: a refused or unauthenticated connection. Strangers can make many;
         * one line per STRANGER_LOG_MS says how many went since the last. */
        uint64_t now = uv_now(c->loop);

        c->strangers++;
        if (c->strangers_logged_at == 0 || now - c->strangers_logged_at >= STRANGER_LOG_MS) {
            RF_WARN("connection from %s closed before it joined: %s (%llu such connections "
                    "since the last line)", rf_peer_remote(p), reason,
                    (unsigned long long)c->strangers);
            c->strangers = 0;
            c->strangers_logged_at = now ? now : 1;
        }
        return;
    }
    member_lost(c, (uint32_t)i, reason);
}

/* ---- status and life cycle --------------------------------------------------------------- */

static void append(char *buf, size_t len, size_t *off, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t len, size_t *off, const char *fmt, ...)
{
    va_list ap;
    int n;

    if (*off >= len)
        return;
    va_start(ap, fmt);
    n = vsnprintf(buf + *off, len - *off, fmt, ap);
    va_end(ap);
    *off = n < 0 ? len : *off + (size_t)n;
}

/* What the cluster waits for before it can start the next refit (or end the one in flight),
 * the first hold in the order try_start and schedule_build check them ("" : nothing; a Start
 * goes out as soon as a version is offered or triggered is not a wait). */
static void waiting_for(const rf_coord *c, char *buf, size_t len)
{
    char name[128];
    size_t off = 0;
    uint32_t i;
    int n = 0;

    buf[0] = '\0';
    if (c->state != ST_IDLE) {
        append(buf, len, &off, "%s of version %llu from:", c->state == ST_RUNNING ? "Done"
               : "the aborted refit's Done", (unsigned long long)c->version);
        for (i = 0; i < c->nmembers; i++)
            if (c->m[i].peer && !c->m[i].done)
                append(buf, len, &off, " %s", member_name(c, i, name, sizeof(name)));
        return;
    }
    if (c->blocked[0]) {
        append(buf, len, &off, "blocked: %s", c->blocked);
        return;
    }
    for (i = 0; i < c->nmembers; i++) {
        const member *m = &c->m[i];

        if (m->peer && m->inv_complete)
            continue;
        if (!m->peer && !m->node[0])
            snprintf(name, sizeof(name), "%s %u never connected", i < c->npub ? "publisher"
                     : "receiver", i < c->npub ? i : i - c->npub);
        else
            member_name(c, i, name, sizeof(name));
        append(buf, len, &off, "%s%s%s", n++ ? "; " : "inventories: ", name,
               !m->peer ? (m->node[0] ? " disconnected" : "")
               : m->inv ? " incomplete (its clients have not all registered and sealed)"
                        : " sent no inventory yet");
    }
    if (n)
        return;
    if (!c->plan_ready) {
        append(buf, len, &off, "the plan, being built");
        return;
    }
    for (i = c->npub; i < c->nmembers; i++)
        if (!c->m[i].idle)
            append(buf, len, &off, "%s%s: its gated engines have not consumed version %llu",
                   n++ ? "; " : "receive quorum: ", member_name(c, i, name, sizeof(name)),
                   (unsigned long long)c->committed);
    if (n)
        return;
    for (i = 0; i < c->npub; i++) {
        if (c->m[i].ready > c->committed)
            append(buf, len, &off, "%s%s offers version %llu", n++ ? "; " : "publish quorum: ",
                   member_name(c, i, name, sizeof(name)), (unsigned long long)c->m[i].ready);
        else
            append(buf, len, &off, "%s%s: its trainers have published no version after %llu",
                   n++ ? "; " : "publish quorum: ", member_name(c, i, name, sizeof(name)),
                   (unsigned long long)c->committed);
    }
}

void rf_coord_status(json_t *status, void *arg)
{
    rf_coord *c = arg;
    json_t *cl = json_object(), *members = json_array(), *plan, *last;
    static const char *states[] = {"idle", "running", "aborting"};
    char id[RF_PLAN_ID_HEX] = "", wait[1024];
    uint32_t i;

    for (i = 0; i < c->nmembers; i++) {
        const member *m = &c->m[i];

        /* done: this member's Done of the version in flight is in (tests hold a refit
         * between the others' Done and the commit by it). */
        json_t *o = json_pack("{s:s, s:i, s:s, s:b, s:b, s:b}", "role",
                              i < c->npub ? "publisher" : "receiver", "index",
                              (int)(i < c->npub ? i : i - c->npub), "node", m->node,
                              "connected", m->peer != NULL, "inventory_complete",
                              m->inv_complete, "done", c->state != ST_IDLE && m->done);

        if (i < c->npub)
            json_object_set_new(o, "ready", json_integer((json_int_t)m->ready));
        else
            json_object_set_new(o, "ready_to_install", json_boolean(m->idle));
        /* Its cluster-wide keys: why it is refused, or where the coordinator's values hold
         * over its own (null: it sent none, an older build). */
        json_object_set_new(o, "refused", m->refused[0] ? json_string(m->refused)
                                                        : json_null());
        json_object_set_new(o, "config_differs", m->has_config ? config_differs(c, i)
                                                               : json_null());
        json_array_append_new(members, o);
    }
    if (c->plan_ready)
        rf_plan_id_to_hex(c->plan_id, id);
    plan = json_pack("{s:s, s:b, s:i, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:I, s:I, s:i}",
                     "id", id, "ready",
                     c->plan_ready, "tensors", (int)c->stats.tensors, "transfers",
                     (json_int_t)c->stats.transfers, "messages", (json_int_t)c->stats.messages,
                     "rounds", (json_int_t)c->stats.rounds, "dst_bytes",
                     (json_int_t)c->stats.dst_bytes, "direct_bytes",
                     (json_int_t)c->stats.direct_bytes, "max_sender_bytes",
                     (json_int_t)c->stats.max_sender_bytes, "build_s", c->plan_seconds,
                     "relay_bytes", (json_int_t)c->stats.relay_bytes, "relay_messages",
                     (json_int_t)c->stats.relay_messages, "relay_depth",
                     (int)c->stats.relay_depth);
    /* FP8 engines: transfers their senders quantize, and their bytes (elements and scales). */
    json_object_set_new(plan, "quant_transfers",
                        json_integer((json_int_t)c->stats.quant_transfers));
    json_object_set_new(plan, "quant_bytes", json_integer((json_int_t)c->stats.quant_bytes));
    json_object_set_new(plan, "fp8_copy_transfers",
                        json_integer((json_int_t)c->stats.fp8_copy_transfers));
    json_object_set_new(plan, "fp8_copy_bytes", json_integer((json_int_t)c->stats.fp8_copy_bytes));
    json_object_set_new(plan, "recv_quant_transfers",
                        json_integer((json_int_t)c->stats.recv_quant_transfers));
    json_object_set_new(plan, "recv_quant_bytes",
                        json_integer((json_int_t)c->stats.recv_quant_bytes));
    last = json_pack("{s:I, s:s, s:I, s:f, s:f, s:f, s:f}", "version",
                     (json_int_t)c->last.version, "result", c->last.result[0] ? c->last.result
                     : "none", "bytes", (json_int_t)c->last.bytes, "publish_quorum_s",
                     c->last.quorum_s, "transfer_s", c->last.transfer_s, "start_to_commit_s",
                     c->last.commit_s, "total_s", c->last.total_s);
    json_object_set_new(cl, "state", json_string(states[c->state]));
    json_object_set_new(cl, "version_in_flight", c->state == ST_IDLE ? json_null()
                        : json_integer((json_int_t)c->version));
    json_object_set_new(cl, "committed", json_integer((json_int_t)c->committed));
    json_object_set_new(cl, "members", members);
    /* The cluster-wide keys every member runs with (README, "Cluster-wide keys"). */
    json_object_set_new(cl, "config", json_pack("{s:s, s:s, s:i, s:i, s:s, s:i, s:i, s:i}",
                        "transport", rf_transport_name(c->cfg->transport), "verify",
                        rf_verify_name(c->cfg->verify), "refit_timeout_s",
                        c->cfg->refit_timeout_s, "staging_mib", plan_staging_mib(c), "relay",
                        c->cfg->relay == RF_RELAY_ON ? "on" : "off", "direct_min_kib",
                        c->cfg->direct_min_kib, "heartbeat_ms", c->cfg->heartbeat_ms,
                        "peer_timeout_ms", c->cfg->peer_timeout_ms));
    json_object_set_new(cl, "plan", plan);
    json_object_set_new(cl, "last_refit", last);
    json_object_set_new(cl, "last_error", json_string(c->last_error));
    /* Why no version can be refitted until something changes (null: nothing blocks). */
    json_object_set_new(cl, "blocked", c->blocked[0] ? json_string(c->blocked) : json_null());
    waiting_for(c, wait, sizeof(wait));
    json_object_set_new(cl, "waiting_for", wait[0] ? json_string(wait) : json_null());
    json_object_set_new(status, "cluster", cl);
}

int rf_coord_start(uv_loop_t *loop, const rf_daemon_cfg *cfg, const rf_peer_key *key,
                   uint64_t daemon_id, rf_metrics *metrics, rf_coord **out, rf_err *err)
{
    rf_peer_config pc = {0};
    rf_coord *c = calloc(1, sizeof(*c));
    int rc = 0;

    if (!c)
        return rf_err_set(err, -ENOMEM, "out of memory");
    c->loop = loop;
    c->cfg = cfg;
    c->send = peer_send;
    c->npub = (uint32_t)cfg->publishers;
    c->nmembers = (uint32_t)(cfg->publishers + cfg->receivers);
    c->m = calloc(c->nmembers, sizeof(*c->m));
    if (!c->m) {
        free(c);
        return rf_err_set(err, -ENOMEM, "out of memory");
    }
    rc |= rf_metrics_counter(metrics, &c->m_refits, "refit_cluster_refits_total",
                             "Refits decided by the coordinator, by result", "result");
    rc |= rf_metrics_histogram(metrics, &c->m_stage, "refit_cluster_stage_seconds",
                               "Cluster refit stages as the coordinator saw them", "stage",
                               rf_metrics_seconds_buckets, rf_metrics_seconds_nbuckets);
    rc |= rf_metrics_gauge(metrics, &c->m_members, "refit_members_connected",
                           "Daemons connected to the coordinator", NULL);
    rc |= rf_metrics_gauge(metrics, &c->m_tensors, "refit_plan_tensors",
                           "Tensors in the current plan", NULL);
    rc |= rf_metrics_gauge(metrics, &c->m_transfers, "refit_plan_transfers",
                           "Transfers in the current plan", NULL);
    rc |= rf_metrics_gauge(metrics, &c->m_committed, "refit_cluster_committed_version",
                           "Version the cluster committed last", NULL);
    if (rc < 0) {
        free(c->m);
        free(c);
        return rf_err_set(err, -EINVAL, "registering the coordinator's metrics failed");
    }
    uv_timer_init(loop, &c->deadline);
    uv_idle_init(loop, &c->spin);
    pc.key = key;
    pc.role = REFIT__ROLE__ROLE_COORDINATOR;
    pc.node = cfg->node;
    pc.daemon_id = daemon_id;
    pc.index = 0;
    pc.max_frame = (uint32_t)cfg->max_frame_mib << 20;
    pc.heartbeat_ms = (uint64_t)cfg->heartbeat_ms;
    pc.timeout_ms = (uint64_t)cfg->peer_timeout_ms;
    pc.cb.on_up = peer_up;
    pc.cb.on_envelope = peer_envelope;
    pc.cb.on_down = peer_down;
    pc.data = c;
    rc = rf_peer_listen(loop, cfg->coordinator_addr, &pc, &c->listener, err);
    if (rc < 0) {
        /* Closed handles are forgotten by the loop at its next turn; c must outlive that. */
        rf_closer_begin(&c->closer);
        rf_closer_add(&c->closer);
        uv_close((uv_handle_t *)&c->deadline, deadline_closed);
        rf_closer_add(&c->closer);
        uv_close((uv_handle_t *)&c->spin, spin_closed);
        coord_release(c);
        *out = NULL;
        return rc;
    }
    RF_INFO("coordinator listening on %s for %u publishers and %u receivers",
            cfg->coordinator_addr, c->npub, c->nmembers - c->npub);
    *out = c;
    return 0;
}

static void coord_release(rf_coord *c)
{
    uint32_t i;

    if (!rf_closer_done(&c->closer))
        return;
    for (i = 0; i < c->nmembers; i++)
        free(c->m[i].inv);
    free(c->m);
    free(c);
}

static void deadline_closed(uv_handle_t *h)
{
    coord_release(container_of((uv_timer_t *)h, rf_coord, deadline));
}

static void spin_closed(uv_handle_t *h)
{
    coord_release(container_of((uv_idle_t *)h, rf_coord, spin));
}

void rf_coord_close(rf_coord *c)
{
    uint32_t i;

    /* The node it reports to is closed right after: nothing is told from here on. */
    c->on_change = NULL;
    /* Peers still closing must not call back into c (a test's fake peers are its own). */
    for (i = 0; i < c->nmembers && c->send == peer_send; i++)
        if (c->m[i].peer)
            rf_peer_set_data(c->m[i].peer, NULL);
    rf_closer_begin(&c->closer);
    /* A plan build in flight finishes on the thread pool; build_after gives it back. */
    if (c->building)
        rf_closer_add(&c->closer);
    rf_peer_listener_close(c->listener);
    rf_closer_add(&c->closer);
    uv_close((uv_handle_t *)&c->deadline, deadline_closed);
    rf_closer_add(&c->closer);
    uv_close((uv_handle_t *)&c->spin, spin_closed);
    coord_release(c);
}
