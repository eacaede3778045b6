/* common/control/node.c - a daemon's side of the cluster protocol: inventory, readiness, plan slice,
 * Start -> data path -> Done, Commit and Abort applied to the local clients. */
#define RF_LOG_MODULE "node"
#include "node.h"

#include <assert.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "closer.h"
#include "log.h"
#include "macros.h"
#include "registry.h"
#include "slice.h"
#include "install.h"
#include "srcmap.h"
#include "version.h"
#include "xfer.h"

enum { PATH_NET = 0, PATH_LOCAL = 1 };
static const char *const path_names[] = { "network", "local" };

/* How late the status endpoint's snapshot may be after a change (snapshot_soon). */
#define SNAPSHOT_DELAY_MS 2

struct rf_node {
    uv_loop_t *loop;
    const rf_daemon_cfg *cfg;
    rf_side side;
    uint64_t daemon_id;
    rf_registry *reg;
    rf_xfer_transport *xfer;  /* the network: tcp or nccl */
    rf_xfer_transport *lxfer; /* same-host copies (receivers with local_copy = auto), or NULL */
    rf_srcmap *srcs;          /* the local trainers' memory lxfer copies from */
    rf_install *inst;         /* engines that install in their own process (receivers) */
    unsigned xfers_open;      /* transports not closed yet (rf_node_close) */
    rf_peer_connector *conn;
    void *coord;            /* the coordinator's rf_peer while up, or a test's fake */
    rf_node__send_fn send; /* rf_peer_send, or a test's recorder (rf_node__set_send) */
    void *send_arg;
    uv_timer_t tick;
    uv_timer_t snap_timer; /* a pending refresh of the status snapshot (snapshot_soon) */

    rf_slice_job slice; /* what Start runs */
    rf_slice_job next;  /* a slice still arriving, or complete while a refit ran */
    rf_install_plan islice, inext; /* the engines' in-process part of each (held out of it) */
    bool slice_stale;   /* slice must go once the running data path ends */
    /* Transports setting slice up ahead of Start (rf_xfer_prepare); a Start that arrives
     * meanwhile is held, packed, and runs when they end (Start arrived at held_t). */
    unsigned preparing;
    uint8_t *held_start;
    size_t held_len;
    uint64_t held_version;
    double held_t;
    uint64_t slice_keys; /* plan_key of the last slice made runnable: one per slice */

    /* The refit in flight (running) and the last one that ended. */
    bool running;
    unsigned pending;   /* transports of the running refit still moving */
    rf_xfer_result res; /* their results merged */
    struct path_stat { uint64_t bytes; double seconds; } run_path[2];
    uint64_t version;
    /* The cluster-wide settings the coordinator's last Start carried (this daemon's own
     * config's until a Start brings them): the running refit's verify and deadline. */
    int verify;
    int timeout_s;
    /* The seed of the GPU paths' digests, from the cluster key (rf_xfer_digest_seed). */
    uint8_t digest_seed[RF_XFER_DIGEST_SEED_BYTES];
    uint64_t aborted; /* the last version the coordinator aborted: its Done, sent after, keeps
                         "aborted" and the abort's reason in the status */
    double t_start, t_begin;
    uint64_t committed;
    struct {
        uint64_t version;
        char result[16];
        uint64_t bytes;
        double wait_s, transfer_s, total_s;
        uint64_t peak_staging;
        struct path_stat path[2]; /* PATH_NET, PATH_LOCAL */
    } last;
    char last_error[512];
    /* Why the coordinator says no version can be refitted now ("": nothing blocks); the
     * registry ends its clients' waits with it. */
    char blocked[768];
    char slice_error[256];    /* why the slice of plan refused_plan was refused */
    uint8_t refused_plan[RF_PLAN_ID_BYTES];

    rf_node_status_hook status_hook;
    void *status_arg;

    rf_metrics *metrics;
    rf_metric *m_refits, *m_stage, *m_bytes, *m_committed, *m_peers, *m_clients, *m_error;
    rf_metric *m_slice_msgs, *m_path_bytes, *m_path_seconds;

    pthread_mutex_t snap_lock;
    char *snapshot;
    rf_closer closer; /* n is freed when the last of its closes finished */
};

static double now_s(void)
{
    return (double)uv_hrtime() / 1e9;
}

static const char *role_name(const rf_node *n)
{
    if (n->side == RF_DST)
        return "receiver";
    return n->cfg->coordinator ? "coordinator" : "publisher";
}

static int peer_send(void *peer, const Refit__Envelope *env, void *arg)
{
    (void)arg;
    return rf_peer_send(peer, env);
}

static void send_env(rf_node *n, Refit__Envelope *env)
{
    int rc;

    if (!n->coord)
        return;
    rc = n->send(n->coord, env, n->send_arg);
    if (rc < 0)
        RF_WARN("sending to the coordinator failed: %s", uv_strerror(rc));
}

static void set_error(rf_node *n, const char *msg)
{
    snprintf(n->last_error, sizeof(n->last_error), "%s", msg);
    rf_metric_info_set(n->m_error, msg);
}

static void refresh_snapshot(rf_node *n)
{
    json_t *st = rf_node_status(n);
    char *s = json_dumps(st, JSON_COMPACT);

    json_decref(st);
    pthread_mutex_lock(&n->snap_lock);
    free(n->snapshot);
    n->snapshot = s;
    pthread_mutex_unlock(&n->snap_lock);
}

static void on_snap_timer(uv_timer_t *t)
{
    refresh_snapshot(container_of(t, rf_node, snap_timer));
}

/* The status endpoint's snapshot after a state change, at most SNAPSHOT_DELAY_MS late: building
 * it (status JSON, ~70 us on the 2-core dev VM) then happens once for a burst of changes, and
 * not right after a node's Done, when the coordinator on the same loop is about to read the
 * other daemons' Done. */
static void snapshot_soon(rf_node *n)
{
    if (!n->closer.closing && !uv_is_active((uv_handle_t *)&n->snap_timer))
        uv_timer_start(&n->snap_timer, on_snap_timer, SNAPSHOT_DELAY_MS, 0);
}

static void install_slice(rf_node *n);
static void drop_slice(rf_node *n);
static void prepare_paths(rf_node *n);
static void run_start(rf_node *n, const Refit__Start *s, double t_arrived);

/* ---- inventory and readiness ------------------------------------------------------------ */

/* This daemon's own cluster-wide keys, which the coordinator compares with its own. */
static void own_config(const rf_node *n, Refit__ClusterConfig *cc)
{
    refit__cluster_config__init(cc);
    cc->transport = (uint32_t)n->cfg->transport;
    cc->verify = (uint32_t)n->cfg->verify;
    cc->refit_timeout_s = (uint32_t)n->cfg->refit_timeout_s;
    cc->staging_mib = (uint32_t)n->cfg->staging_mib;
    cc->heartbeat_ms = (uint32_t)n->cfg->heartbeat_ms;
    cc->peer_timeout_ms = (uint32_t)n->cfg->peer_timeout_ms;
    cc->config_file = n->cfg->config_path ? n->cfg->config_path : (char *)"";
}

static void send_inventory(rf_node *n)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Inventory inv = REFIT__INVENTORY__INIT;
    Refit__ClusterConfig ccfg;
    bool complete = rf_registry_complete(n->reg);

    if (!n->coord)
        return;
    if (complete) {
        if (rf_slice_inv_pack(rf_registry_inv(n->reg), n->side, rf_registry_generation(n->reg),
                              &inv) < 0) {
            RF_ERROR("out of memory packing the inventory");
            return;
        }
    } else {
        inv.generation = rf_registry_generation(n->reg);
        inv.complete = false;
    }
    inv.committed = n->committed;
    own_config(n, &ccfg);
    inv.config = &ccfg;
    env.body_case = REFIT__ENVELOPE__BODY_INVENTORY;
    env.inventory = &inv;
    send_env(n, &env);
    RF_INFO("sent %s inventory (generation %llu, %zu pieces)",
            complete ? "complete" : "incomplete", (unsigned long long)inv.generation,
            inv.n_pieces);
    if (complete)
        rf_slice_inv_msg_free(&inv);
}

/* Publishers: what the registry says now, also when it is "not ready" (0). The coordinator
 * takes each Ready as the whole truth, so it is sent at every change, after every inventory
 * and after every Abort. */
static void send_ready(rf_node *n)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Ready ready = REFIT__READY__INIT;
    uint64_t v = rf_registry_ready(n->reg);

    if (n->side != RF_SRC)
        return;
    ready.version = v > n->committed ? v : 0;
    env.body_case = REFIT__ENVELOPE__BODY_READY;
    env.ready = &ready;
    send_env(n, &env);
}

static void on_inventory(rf_registry *r, void *ud)
{
    rf_node *n = ud;

    (void)r;
    drop_slice(n);
    send_inventory(n);
    send_ready(n);
    snapshot_soon(n);
}

static void on_change(rf_registry *r, void *ud)
{
    rf_node *n = ud;

    (void)r;
    if (n->running)
        RF_WARN("a local client left during the refit of version %llu: aborting it",
                (unsigned long long)n->version);
    drop_slice(n);
    send_inventory(n);
    send_ready(n);
    snapshot_soon(n);
}

/* Receive quorum: ready once every gated engine consumed what this daemon committed last
 * (always, with no gated engine). Sent at connect, after every
 * commit and whenever the engines consume. */
static void send_idle(rf_node *n)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Idle idle = REFIT__IDLE__INIT;
    uint64_t consumed;

    if (n->side != RF_DST)
        return;
    consumed = rf_registry_consumed(n->reg);
    idle.ready = consumed >= n->committed;
    idle.version = consumed == UINT64_MAX ? n->committed : consumed;
    env.body_case = REFIT__ENVELOPE__BODY_IDLE;
    env.idle = &idle;
    send_env(n, &env);
}

static void on_install_done(rf_registry *r, uint64_t uid, const Refit__Rpc__InstallDone *m,
                            void *ud)
{
    rf_node *n = ud;

    (void)r;
    if (n->inst)
        rf_install_on_done(n->inst, uid, m);
}

static void on_install_lost(rf_registry *r, uint64_t uid, const char *why, void *ud)
{
    rf_node *n = ud;

    (void)r;
    if (n->inst)
        rf_install_on_lost(n->inst, uid, why);
}

static int on_install_sources(rf_registry *r, uint64_t uid, const Refit__Rpc__InstallSources *m,
                              int chan, Refit__Rpc__Response **out, rf_err *err, void *ud)
{
    rf_node *n = ud;

    (void)r;
    return rf_install_sources(n->inst, uid, m, chan, out, err);
}

static void on_consumed(rf_registry *r, uint64_t consumed, void *ud)
{
    (void)r;
    (void)consumed;
    send_idle(ud);
}

static void on_ready(rf_registry *r, uint64_t version, void *ud)
{
    rf_node *n = ud;

    (void)r;
    if (version)
        RF_INFO("local trainers published version %llu", (unsigned long long)version);
    else
        RF_INFO("local trainers hold no published version now");
    send_ready(n);
    snapshot_soon(n);
}

static int on_status(rf_registry *r, char **json, rf_err *err, void *ud)
{
    rf_node *n = ud;
    json_t *st = rf_node_status(n);

    (void)r;
    *json = json_dumps(st, JSON_INDENT(2));
    json_decref(st);
    if (!*json)
        return rf_err_set(err, -ENOMEM, "out of memory building the status");
    return 0;
}

static int on_refit(rf_registry *r, uint64_t version, rf_err *err, void *ud)
{
    rf_node *n = ud;
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Trigger trig = REFIT__TRIGGER__INIT;

    (void)r;
    if (rf_version_check(version, n->committed, "Refit", err) < 0)
        return err->code;
    if (!n->coord)
        return rf_err_set(err, -ENOTCONN, "this daemon is not connected to the coordinator at "
                          "%s; see refitctl status", n->cfg->coordinator_addr);
    trig.version = version;
    env.body_case = REFIT__ENVELOPE__BODY_TRIGGER;
    env.trigger = &trig;
    send_env(n, &env);
    return 0;
}

/* ---- the refit ------------------------------------------------------------------------------ */

static void send_done(rf_node *n, uint64_t version, const rf_xfer_result *res, const char *error)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Done done = REFIT__DONE__INIT;
    Refit__StageTimes times = REFIT__STAGE_TIMES__INIT;
    uint8_t digest[RF_XFER_DIGEST_BYTES];
    double end = now_s();

    done.version = version;
    done.ok = error == NULL;
    done.error = (char *)(error ? error : "");
    if (res) {
        size_t i;

        done.bytes = res->bytes_sent + res->bytes_recv;
        for (i = 0; i < RF_XFER_DIGEST_BYTES; i++)
            digest[i] = res->digest_sent[i] ^ res->digest_recv[i];
        if (n->verify != RF_VERIFY_OFF) {
            done.digest.data = digest;
            done.digest.len = RF_XFER_DIGEST_BYTES;
        }
    }
    times.wait_s = n->t_begin > 0 ? n->t_begin - n->t_start : 0;
    times.transfer_s = n->t_begin > 0 ? end - n->t_begin : 0;
    times.total_s = end - n->t_start;
    done.times = &times;
    env.body_case = REFIT__ENVELOPE__BODY_DONE;
    env.done = &done;
    send_env(n, &env);

    n->last.version = version;
    n->last.bytes = done.bytes;
    n->last.wait_s = times.wait_s;
    n->last.transfer_s = times.transfer_s;
    n->last.total_s = times.total_s;
    n->last.peak_staging = res ? res->peak_staging : 0;
    if (version == n->aborted) {
        /* The data path's own failure follows from the abort: the status says why it ended. */
        snprintf(n->last.result, sizeof(n->last.result), "aborted");
        if (error)
            RF_INFO("after the abort of version %llu: %s", (unsigned long long)version, error);
        return;
    }
    snprintf(n->last.result, sizeof(n->last.result), "%s", error ? "failed" : "moved");
    if (error)
        set_error(n, error);
}

static void account_bytes(rf_node *n, const rf_xfer_job *job)
{
    uint32_t i;

    for (i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        char peer[32];

        snprintf(peer, sizeof(peer), "%u", m->peer);
        rf_metric_add(n->m_bytes, (double)m->bytes, peer, m->send ? "sent" : "received");
    }
}

/* Stops every path of the running refit (a transport not running ignores it). */
static void abort_paths(rf_node *n)
{
    rf_xfer_abort(n->xfer);
    if (n->lxfer)
        rf_xfer_abort(n->lxfer);
    rf_install_abort(n->inst);
}

/* The refit's result over both paths: the first error, bytes and digests summed. */
static void merge_result(rf_node *n, int path, const rf_xfer_result *r)
{
    size_t i;

    if (r->code < 0 && n->res.code == 0) {
        n->res.code = r->code;
        snprintf(n->res.error, sizeof(n->res.error), "%s%s", path == PATH_LOCAL ?
                 "local copy: " : "", r->error);
    }
    n->res.bytes_sent += r->bytes_sent;
    n->res.bytes_recv += r->bytes_recv;
    if (r->seconds > n->res.seconds)
        n->res.seconds = r->seconds;
    for (i = 0; i < RF_XFER_DIGEST_BYTES; i++) {
        n->res.digest_sent[i] ^= r->digest_sent[i];
        n->res.digest_recv[i] ^= r->digest_recv[i];
    }
    n->res.peak_staging += r->peak_staging;
    /* Local copies may end in two parts: the daemon's and the engines' own. */
    n->run_path[path].bytes += r->bytes_sent + r->bytes_recv;
    if (r->seconds > n->run_path[path].seconds)
        n->run_path[path].seconds = r->seconds;
}

/* The slice a data path read while it went stale goes once that data path ended. */
static void drop_stale_slice(rf_node *n)
{
    if (!n->slice_stale)
        return;
    n->slice_stale = false;
    rf_slice_job_reset(&n->slice);
    rf_install_plan_reset(&n->islice);
}

/* Every path of the running refit ended (or none had anything to move). */
static void refit_ended(rf_node *n)
{
    const rf_xfer_result *res = &n->res;
    char msg[320];
    int p;

    n->running = false;
    if (res->code == 0 && n->slice.nqruns > 0) {
        /* Blocks that trainers' shards cut reached their shadows whole: quantize them into
         * the engines' FP8 pieces before the engines are told (issue 15). */
        rf_err qe = {0};
        double t0 = now_s();

        if (rf_slice_job_quantize(&n->slice, &qe) < 0) {
            n->res.code = qe.code;
            snprintf(n->res.error, sizeof(n->res.error), "quantizing on the receiver: %s",
                     qe.msg);
        } else {
            RF_INFO("version %llu: quantized on the receiver: %llu runs of FP8 blocks from "
                    "%llu bytes of shadows in %.3f s", (unsigned long long)n->version,
                     (unsigned long long)n->slice.nqruns,
                     (unsigned long long)n->slice.shadow_bytes, now_s() - t0);
        }
    }
    rf_registry_hold(n->reg, false);
    if (res->code < 0) {
        snprintf(msg, sizeof(msg), "data path of version %llu failed: %s",
                 (unsigned long long)n->version, res->error);
        RF_ERROR("%s", msg);
        send_done(n, n->version, res, msg);
    } else {
        /* Done first: the coordinator waits for it; the bookkeeping does not. */
        send_done(n, n->version, res, NULL);
        account_bytes(n, &n->slice.job);
        account_bytes(n, &n->slice.ljob);
        for (p = PATH_NET; p <= PATH_LOCAL; p++) {
            rf_metric_add(n->m_path_bytes, (double)n->run_path[p].bytes, path_names[p]);
            rf_metric_add(n->m_path_seconds, n->run_path[p].seconds, path_names[p]);
        }
        RF_INFO("version %llu: moved %llu bytes in %.3f s (%.2f GB/s)%s",
                (unsigned long long)n->version,
                (unsigned long long)(res->bytes_sent + res->bytes_recv), res->seconds,
                res->seconds > 0 ? (double)(res->bytes_sent + res->bytes_recv) / res->seconds / 1e9
                                 : 0.0, n->run_path[PATH_LOCAL].bytes ? ", local copies "
                                                                        "included" : "");
    }
    memcpy(n->last.path, n->run_path, sizeof(n->last.path));
    rf_metric_observe(n->m_stage, n->last.transfer_s, "transfer");
    drop_stale_slice(n);
    if (n->next.complete)
        install_slice(n);
    snapshot_soon(n);
}

/* One part of the running refit ended: the network job, the local one, or the engines'
 * in-process installs. */
static void path_done(rf_node *n, int path, const rf_xfer_result *res)
{
    merge_result(n, path, res);
    assert(n->pending > 0);
    if (--n->pending > 0) {
        /* One path failed: the other need not finish what the refit cannot commit. */
        if (res->code < 0)
            abort_paths(n);
        return;
    }
    if (n->closer.closing) {
        n->running = false;
        return;
    }
    refit_ended(n);
}

static void on_xfer_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    rf_node *n = arg;

    path_done(n, t == n->lxfer ? PATH_LOCAL : PATH_NET, res);
}

static void on_installed(const rf_xfer_result *res, void *arg)
{
    path_done(arg, PATH_LOCAL, res);
}

/* A path that could not start while the other runs: the refit fails when that one ends. */
static void fail_path(rf_node *n, int path, int code, const char *msg)
{
    rf_xfer_result r;

    memset(&r, 0, sizeof(r));
    r.code = code;
    snprintf(r.error, sizeof(r.error), "%s", msg);
    merge_result(n, path, &r);
}

/* Starts the refit's jobs: the network one and the local copies, each when it has messages. */
static int run_paths(rf_node *n, rf_err *err)
{
    int rc;

    memset(&n->res, 0, sizeof(n->res));
    memset(n->run_path, 0, sizeof(n->run_path));
    n->pending = 0;
    n->slice.ljob.version = n->version;
    if (n->slice.job.nmsgs > 0) {
        rc = rf_xfer_run(n->xfer, &n->slice.job, on_xfer_done, n, err);
        if (rc < 0)
            return rc;
        n->pending++;
    }
    if (n->slice.ljob.nmsgs > 0) {
        rc = n->lxfer ? rf_xfer_run(n->lxfer, &n->slice.ljob, on_xfer_done, n, err)
                      : rf_err_set(err, -EPROTO, "the plan has local copies for this daemon, "
                                   "which runs with local_copy = off");
        if (rc < 0 && n->pending) {
            /* The network job runs: its done ends the refit, failed. */
            fail_path(n, PATH_LOCAL, rc, err->msg);
            rf_xfer_abort(n->xfer);
            return 0;
        }
        if (rc < 0)
            return rc;
        n->pending++;
    }
    if (n->islice.nowners > 0) {
        rc = rf_install_run(n->inst, &n->islice, n->version, n->verify, n->timeout_s,
                            on_installed, n, err);
        if (rc < 0 && n->pending) {
            fail_path(n, PATH_LOCAL, rc, err->msg);
            abort_paths(n);
            return 0;
        }
        if (rc < 0)
            return rc;
        n->pending++;
    }
    return 0;
}

/* One cluster-wide key the coordinator decides: logged when the value this daemon runs with
 * changes to one its own config does not say, or back. */
static void adopt(rf_node *n, const char *key, const char *mine, const char *cluster,
                  const char *was)
{
    if (strcmp(cluster, was) == 0)
        return;
    if (strcmp(cluster, mine) == 0)
        RF_INFO("%s: refits run with %s = %s again, as this daemon's config says", key, key,
                cluster);
    else
        RF_WARN("%s: this daemon's config (%s) says %s, the coordinator's says %s: refits run "
                "with %s = %s (%s is cluster-wide: the coordinator's value holds; set it "
                "there, or set %s = %s here to silence this)", key, n->cfg->config_path, mine,
                cluster, key, cluster, key, key, cluster);
}

/* The refit's verify and deadline: what Start carries (the coordinator's config), or this
 * daemon's own with a coordinator that sends none. -EPROTO with msg when Start carries values
 * this daemon cannot run with. */
static int cluster_settings(rf_node *n, const Refit__Start *s, char *msg, size_t len)
{
    const Refit__ClusterConfig *cc = s->config;
    char mine[16], cluster[16], was[16];
    int verify = n->cfg->verify, timeout_s = n->cfg->refit_timeout_s;

    if (cc) {
        if (cc->verify > RF_VERIFY_FULL) {
            snprintf(msg, len, "Start(%llu) refused: it carries verify = %u, which this daemon "
                     "does not know (0 off, 1 sample, 2 full); is the coordinator's build newer "
                     "than this one?", (unsigned long long)s->version, cc->verify);
            return -EPROTO;
        }
        if (cc->refit_timeout_s < 1 || cc->refit_timeout_s > 86400) {
            snprintf(msg, len, "Start(%llu) refused: it carries refit_timeout_s = %u, outside "
                     "1 .. 86400; is the coordinator's build newer than this one?",
                     (unsigned long long)s->version, cc->refit_timeout_s);
            return -EPROTO;
        }
        verify = (int)cc->verify;
        timeout_s = (int)cc->refit_timeout_s;
    }
    adopt(n, "verify", rf_verify_name(n->cfg->verify), rf_verify_name(verify),
          rf_verify_name(n->verify));
    snprintf(mine, sizeof(mine), "%d", n->cfg->refit_timeout_s);
    snprintf(cluster, sizeof(cluster), "%d", timeout_s);
    snprintf(was, sizeof(was), "%d", n->timeout_s);
    adopt(n, "refit_timeout_s", mine, cluster, was);
    n->verify = verify;
    n->timeout_s = timeout_s;
    return 0;
}

static void on_start(rf_node *n, const Refit__Start *s)
{
    char msg[320];

    if (n->preparing > 0 && !n->held_start) {
        size_t len = refit__start__get_packed_size(s);

        if ((n->held_start = malloc(len ? len : 1))) {
            n->held_len = refit__start__pack(s, n->held_start);
            n->held_version = s->version;
            n->held_t = now_s();
            RF_INFO("Start(%llu) held until the data path is set up",
                    (unsigned long long)s->version);
            snapshot_soon(n);
            return;
        }
        snprintf(msg, sizeof(msg), "Start(%llu): out of memory holding it while the data path "
                 "is set up", (unsigned long long)s->version);
        send_done(n, s->version, NULL, msg);
        return;
    }
    run_start(n, s, now_s());
}

/* Runs Start s, which arrived at t_arrived (it may have been held while the data path was set
 * up). */
static void run_start(rf_node *n, const Refit__Start *s, double t_arrived)
{
    rf_err err = {0};
    char msg[320];
    int rc;

    if (n->running || n->preparing > 0) {
        snprintf(msg, sizeof(msg), "Start(%llu) while version %llu is still moving",
                 (unsigned long long)s->version, (unsigned long long)n->version);
        send_done(n, s->version, NULL, msg);
        return;
    }
    n->version = s->version;
    n->aborted = 0; /* a version may run again after an abort */
    n->t_start = t_arrived;
    n->t_begin = 0;
    if (s->version <= n->committed) {
        snprintf(msg, sizeof(msg), "Start(%llu) refused: version %llu is already committed",
                 (unsigned long long)s->version, (unsigned long long)n->committed);
        send_done(n, s->version, NULL, msg);
        return;
    }
    if (!n->slice.complete || n->slice_stale || s->plan_id.len != RF_PLAN_ID_BYTES ||
        memcmp(s->plan_id.data, n->slice.plan_id, RF_PLAN_ID_BYTES) != 0 ||
        n->slice.generation != rf_registry_generation(n->reg) || !rf_registry_complete(n->reg)) {
        if (n->slice_error[0] && s->plan_id.len == RF_PLAN_ID_BYTES &&
            memcmp(s->plan_id.data, n->refused_plan, RF_PLAN_ID_BYTES) == 0)
            snprintf(msg, sizeof(msg), "Start(%llu): this daemon refused the plan: %s",
                     (unsigned long long)s->version, n->slice_error);
        else
            snprintf(msg, sizeof(msg), "Start(%llu) names a plan this daemon does not hold "
                     "(its inventory changed or the slice is incomplete); the coordinator "
                     "replans", (unsigned long long)s->version);
        send_done(n, s->version, NULL, msg);
        return;
    }
    if (cluster_settings(n, s, msg, sizeof(msg)) < 0) {
        RF_ERROR("%s", msg);
        send_done(n, s->version, NULL, msg);
        return;
    }
    n->slice.job.version = s->version;
    n->slice.job.verify = n->slice.ljob.verify = n->verify;
    n->slice.job.timeout_s = n->slice.ljob.timeout_s = n->timeout_s;
    n->t_begin = now_s();
    rf_registry_hold(n->reg, true);
    rc = run_paths(n, &err);
    if (rc < 0) {
        rf_registry_hold(n->reg, false);
        snprintf(msg, sizeof(msg), "data path of version %llu could not start: %s",
                 (unsigned long long)s->version, err.msg);
        RF_ERROR("%s", msg);
        send_done(n, s->version, NULL, msg);
        return;
    }
    /* One data path per node at a time: Start while running was refused above. */
    assert(!n->running);
    n->running = true;
    /* After the data path is under way: the event is asynchronous (engines never acknowledge
     * it, their gate is the receive quorum), so writing it first would only hold the bytes
     * back by a write to every engine. */
    if (n->side == RF_DST)
        rf_registry_notify(n->reg, RF_REG_INSTALLING, s->version, NULL);
    if (n->pending == 0)
        refit_ended(n); /* nothing of this plan moves through this daemon */
    else
        snapshot_soon(n);
}

/* transport = nccl: joins the world of the slice, one rank per local GPU endpoint that has
 * network messages (none: this daemon stays out of the world). */
static int join_world(rf_node *n, const rf_inv *inv, rf_err *err)
{
    uint32_t nep = rf_inv_nendpoints(inv), nlocal = 0, i;
    uint32_t *ranks = NULL;
    const char **uuids = NULL;
    int rc = 0;
    rf_xfer_world w;

    if (!rf_xfer_has_world(n->xfer) || n->slice.job.nmsgs == 0)
        return 0;
    if (!n->slice.has_nccl_id)
        return rf_err_set(err, -EPROTO, "transport nccl, but the plan slice carries no NCCL "
                          "id: is the coordinator configured with transport = nccl too?");
    if (n->slice.nlocal_eps != nep)
        return rf_err_set(err, -EPROTO, "the plan slice ranks %u endpoints, this daemon holds "
                          "%u: the plan is stale", n->slice.nlocal_eps, nep);
    ranks = calloc(nep ? nep : 1, sizeof(*ranks));
    uuids = calloc(nep ? nep : 1, sizeof(*uuids));
    if (!ranks || !uuids) {
        rc = rf_err_set(err, -ENOMEM, "out of memory joining the NCCL world");
        goto out;
    }
    /* The transport maps each endpoint's CUDA UUID to its device. */
    for (i = 0; i < nep; i++) {
        if (n->slice.ranks[i] >= n->slice.nranks)
            continue; /* only local copies touch this endpoint */
        ranks[nlocal] = n->slice.ranks[i];
        uuids[nlocal++] = rf_registry_endpoint_device(n->reg, i);
    }
    memset(&w, 0, sizeof(w));
    w.nranks = n->slice.nranks;
    w.nlocal = nlocal;
    w.local_ranks = ranks;
    w.local_uuids = uuids;
    memcpy(w.unique_id, n->slice.nccl_id, sizeof(w.unique_id));
    rc = rf_xfer_set_world(n->xfer, &w, err);
out:
    free(ranks);
    free(uuids);
    return rc;
}

/* Makes the completed pending slice the one Start runs: the peers and checks that need no
 * running job. Called when the data path is idle. */
static void install_slice(rf_node *n)
{
    const rf_inv *inv = rf_registry_inv(n->reg);
    const char **addrs = NULL;
    rf_err err = {0};
    uint32_t i, self = UINT32_MAX;
    int rc;

    /* The slice a data path reads is never replaced under it. */
    assert(!n->running && n->preparing == 0);
    rf_slice_job_reset(&n->slice);
    rf_install_plan_reset(&n->islice);
    n->slice = n->next;
    n->islice = n->inext;
    rf_slice_job_init(&n->next);
    memset(&n->inext, 0, sizeof(n->inext));
    addrs = calloc(n->slice.npeers ? n->slice.npeers : 1, sizeof(*addrs));
    if (!addrs) {
        RF_ERROR("out of memory for the plan slice");
        goto fail;
    }
    for (i = 0; i < n->slice.npeers; i++) {
        addrs[i] = n->slice.peers[i].data_addr;
        if (n->slice.peers[i].daemon_id == n->daemon_id)
            self = i;
    }
    if (self == UINT32_MAX) {
        RF_ERROR("the plan slice does not list this daemon among its peers");
        goto fail;
    }
    rc = rf_xfer_set_peers(n->xfer, self, n->slice.npeers, addrs, &err);
    if (rc < 0) {
        RF_ERROR("data path peers: %s", err.msg);
        goto fail;
    }
    if (n->lxfer) {
        /* Local copies name their source daemon as the peer; they need no address. */
        for (i = 0; i < n->slice.npeers; i++)
            addrs[i] = NULL;
        rc = rf_xfer_set_peers(n->lxfer, self, n->slice.npeers, addrs, &err);
        if (rc < 0) {
            RF_ERROR("local copy peers: %s", err.msg);
            goto fail;
        }
        /* Trainer memory that no plan names any more is unmapped (no job runs now). */
        rf_srcmap_prune(n->srcs, &n->slice);
    }
    rc = join_world(n, inv, &err);
    if (rc < 0) {
        RF_ERROR("%s", err.msg);
        set_error(n, err.msg);
        goto fail;
    }
    /* The plan's budget is per endpoint (GPU); this daemon drives all of its endpoints. */
    n->slice.job.staging_bytes = ((uint64_t)n->cfg->staging_mib << 20) *
                                 (rf_inv_nendpoints(inv) ? rf_inv_nendpoints(inv) : 1);
    /* The settings in force; each Start sets those it carries. */
    n->slice.job.timeout_s = n->slice.ljob.timeout_s = n->timeout_s;
    n->slice.job.verify = n->slice.ljob.verify = n->verify;
    memcpy(n->slice.job.digest_seed, n->digest_seed, sizeof(n->digest_seed));
    memcpy(n->slice.ljob.digest_seed, n->digest_seed, sizeof(n->digest_seed));
    if ((rc = rf_xfer_job_check(&n->slice.job, n->slice.npeers, &err)) < 0 ||
        (rc = rf_xfer_job_check(&n->slice.ljob, n->slice.npeers, &err)) < 0) {
        RF_ERROR("plan slice is inconsistent: %s", err.msg);
        set_error(n, err.msg);
        goto fail;
    }
    n->slice.job.checked = n->slice.ljob.checked = true;
    n->slice.job.plan_key = n->slice.ljob.plan_key = n->islice.serial = ++n->slice_keys;
    rf_metric_set(n->m_slice_msgs, n->slice.job.nmsgs);
    RF_INFO("plan slice complete: %u messages, %llu bytes, %u rounds; %u local copies, %llu "
            "bytes%s", n->slice.job.nmsgs, (unsigned long long)n->slice.bytes,
            n->slice.job.nrounds, n->slice.ljob.nmsgs, (unsigned long long)n->slice.lbytes,
            n->islice.nowners ? "; engines install some in their own process" : "");
    if (n->islice.nowners)
        RF_INFO("in-process installs: %u engines, %u local copies, %llu bytes",
                n->islice.nowners, n->islice.nmsgs, (unsigned long long)n->islice.bytes);
    free(addrs);
    prepare_paths(n);
    snapshot_soon(n);
    return;
fail:
    free(addrs);
    rf_slice_job_reset(&n->slice);
    rf_install_plan_reset(&n->islice);
}

/* The slice's data paths are set up: a Start held meanwhile runs now; otherwise a slice that
 * completed meanwhile replaces this one. */
static void on_prepared(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    rf_node *n = arg;
    const char *name = t == n->lxfer ? "local copies" : "network";

    assert(n->preparing > 0);
    n->preparing--;
    if (res->code < 0 && !n->closer.closing && !n->slice_stale)
        RF_WARN("setting up the %s data path ahead of Start failed: %s (Start sets it up "
                "again)", name, res->error);
    else if (res->code == 0)
        RF_INFO("%s data path set up ahead of Start in %.3f s", name, res->seconds);
    if (n->preparing > 0 || n->closer.closing)
        return;
    drop_stale_slice(n);
    if (n->held_start) {
        Refit__Start *s = refit__start__unpack(NULL, n->held_len, n->held_start);

        free(n->held_start);
        n->held_start = NULL;
        if (s) {
            run_start(n, s, n->held_t);
            refit__start__free_unpacked(s, NULL);
        } else {
            RF_ERROR("a held Start could not be read back; the coordinator's deadline ends it");
        }
    } else if (n->next.complete) {
        install_slice(n);
    }
    snapshot_soon(n);
}

/* Sets up the data paths of the slice Start will run (communicators, copy plans, device
 * buffers) now, so that its first refit moves bytes at once. tcp sets up as it runs. */
static void prepare_paths(rf_node *n)
{
    struct {
        rf_xfer_transport *t;
        rf_xfer_job *job;
    } p[2] = {{n->xfer, &n->slice.job}, {n->lxfer, &n->slice.ljob}};

    for (int i = 0; i < 2; i++) {
        rf_err err = {0};

        if (!p[i].t || p[i].job->nmsgs == 0)
            continue;
        if (rf_xfer_prepare(p[i].t, p[i].job, on_prepared, n, &err) == 0)
            n->preparing++;
        else if (err.code != -ENOTSUP)
            RF_WARN("setting up a data path ahead of Start: %s (Start sets it up again)",
                    err.msg);
    }
}

/* Forgets the plan (the inventory changed, the coordinator went away). The slice a running
 * data path reads is only marked stale; it is freed when the data path ended. */
static void drop_slice(rf_node *n)
{
    rf_slice_job_reset(&n->next);
    rf_install_plan_reset(&n->inext);
    if (n->running || n->preparing > 0) {
        n->slice_stale = true;
        abort_paths(n);
    } else {
        rf_slice_job_reset(&n->slice);
        rf_install_plan_reset(&n->islice);
    }
}

/* The trainers' memory that the local copies of frame ps read, mapped through the srcmap:
 * only the regions of the pieces they read, fetched from a publisherd the first time its
 * generation (or a piece not mapped yet) appears. */
static int local_sources(rf_node *n, const Refit__PlanSlice *ps, rf_slice_src **out, rf_err *err)
{
    *out = NULL;
    for (size_t i = 0; i < ps->n_msgs; i++)
        if (ps->msgs[i]->kind == RF_PLAN_LOCAL && !n->srcs)
            return rf_err_set(err, -EPROTO, "the plan has local copies for this daemon, which "
                              "runs with local_copy = off (is the coordinator's build older?)");
    return n->srcs ? rf_srcmap_frame(n->srcs, ps, out, err) : 0;
}

/* Frames collect in n->next; a complete slice replaces n->slice once no data path runs. */
static void on_slice(rf_node *n, const Refit__PlanSlice *ps)
{
    const rf_inv *inv = rf_registry_inv(n->reg);
    uint32_t nreg = rf_inv_nregions(inv), i;
    uint8_t **bases = NULL;
    rf_slice_src *srcs = NULL;
    Refit__PlanSlice rest;
    rf_err err = {0};
    int rc;

    if (ps->generation != rf_registry_generation(n->reg)) {
        RF_INFO("ignoring a plan slice for inventory generation %llu (now %llu)",
                (unsigned long long)ps->generation,
                (unsigned long long)rf_registry_generation(n->reg));
        return;
    }
    bases = calloc(nreg ? nreg : 1, sizeof(*bases));
    if (!bases) {
        RF_ERROR("out of memory for the plan slice");
        rf_slice_job_reset(&n->next);
        rf_install_plan_reset(&n->inext);
        return;
    }
    for (i = 0; i < nreg; i++)
        bases[i] = rf_registry_region_base(n->reg, i);
    /* A frame after a complete slice starts the next one (rf_slice_job_add does the same). */
    if (n->next.complete)
        rf_install_plan_reset(&n->inext);
    /* Copies into engines' in-process memory go to their installers, the rest is ours. */
    rc = rf_install_plan_add(&n->inext, n->reg, ps, &rest, &err);
    if (rc == 0 && n->inext.nowners > 0 && n->inst == NULL)
        rc = rf_err_set(&err, -EPROTO, "the plan has copies into engines' in-process memory, "
                        "which this daemon runs with local_copy = off");
    if (rc == 0)
        rc = local_sources(n, &rest, &srcs, &err);
    if (rc == 0)
        rc = rf_slice_job_add(&n->next, &rest, inv, n->side, bases, srcs, &err);
    free(rest.msgs);
    free(bases);
    free(srcs);
    if (rc < 0) {
        RF_ERROR("plan slice refused: %s", err.msg);
        set_error(n, err.msg);
        /* Start of this plan says why, for the trainers waiting on it. */
        snprintf(n->slice_error, sizeof(n->slice_error), "%s", err.msg);
        if (ps->plan_id.len == RF_PLAN_ID_BYTES)
            memcpy(n->refused_plan, ps->plan_id.data, RF_PLAN_ID_BYTES);
        rf_slice_job_reset(&n->next);
        rf_install_plan_reset(&n->inext);
        return;
    }
    if (n->next.complete && !n->running && n->preparing == 0)
        install_slice(n);
}

static void on_commit(rf_node *n, uint64_t version)
{
    if (version <= n->committed)
        return;
    n->committed = version;
    if (n->side == RF_SRC)
        rf_registry_release(n->reg, version);
    rf_registry_notify(n->reg, RF_REG_COMMITTED, version, NULL);
    send_idle(n);
    if (n->last.version == version)
        snprintf(n->last.result, sizeof(n->last.result), "committed");
    rf_metric_add(n->m_refits, 1, "committed");
    rf_metric_set(n->m_committed, (double)version);
    rf_metric_observe(n->m_stage, now_s() - n->t_start, "total");
    RF_INFO("version %llu committed", (unsigned long long)version);
    snapshot_soon(n);
}

static void on_abort(rf_node *n, uint64_t version, const char *reason)
{
    char msg[320];

    snprintf(msg, sizeof(msg), "refit of version %llu aborted: %s", (unsigned long long)version,
             reason);
    RF_WARN("%s", msg);
    set_error(n, msg);
    n->aborted = version;
    if (n->running && n->version == version)
        abort_paths(n);
    if (n->held_start && n->held_version == version) {
        free(n->held_start);
        n->held_start = NULL;
        send_done(n, version, NULL, "aborted before its data path started");
    }
    if (n->side == RF_SRC) {
        rf_registry_abort(n->reg, version, reason);
        /* The coordinator forgot every publisher's readiness at the abort. */
        send_ready(n);
    }
    rf_registry_notify(n->reg, RF_REG_ABORTED, version, reason);
    if (n->last.version == version || !n->running)
        snprintf(n->last.result, sizeof(n->last.result), "aborted");
    rf_metric_add(n->m_refits, 1, "aborted");
    snapshot_soon(n);
}

/* The coordinator's reason why nothing can be refitted now, or "" when that is over. */
static void on_blocked(rf_node *n, const Refit__Blocked *b)
{
    const char *why = b->reason ? b->reason : "";

    if (strcmp(why, n->blocked) == 0)
        return;
    snprintf(n->blocked, sizeof(n->blocked), "%s", why);
    if (why[0]) {
        RF_WARN("no version after %llu can be refitted now: %s",
                (unsigned long long)b->committed, why);
        rf_registry_block(n->reg, why);
    } else {
        RF_INFO("the cluster can refit again");
        rf_registry_block(n->reg, NULL);
    }
    snapshot_soon(n);
}

/* ---- the coordinator connection --------------------------------------------------------- */

void rf_node__coord_up(rf_node *n, void *peer)
{
    n->coord = peer;
    rf_metric_set(n->m_peers, 1);
    drop_slice(n);
    send_inventory(n);
    send_ready(n);
    send_idle(n);
    snapshot_soon(n);
}

static void coord_up(rf_peer *p, const Refit__Hello *hello)
{
    RF_INFO("connected to coordinator %s (%s)", hello->node, rf_peer_remote(p));
    if (hello->role != REFIT__ROLE__ROLE_COORDINATOR) {
        RF_ERROR("%s is not a coordinator; check coordinator_addr", rf_peer_remote(p));
        rf_peer_close(p, "not a coordinator");
        return;
    }
    rf_node__coord_up(rf_peer_data(p), p);
}

static void node_envelope(rf_node *n, const Refit__Envelope *env)
{
    switch (env->body_case) {
    case REFIT__ENVELOPE__BODY_PLAN_SLICE:
        on_slice(n, env->plan_slice);
        break;
    case REFIT__ENVELOPE__BODY_START:
        on_start(n, env->start);
        break;
    case REFIT__ENVELOPE__BODY_COMMIT:
        on_commit(n, env->commit->version);
        break;
    case REFIT__ENVELOPE__BODY_ABORT:
        on_abort(n, env->abort->version, env->abort->reason);
        break;
    case REFIT__ENVELOPE__BODY_BLOCKED:
        on_blocked(n, env->blocked);
        break;
    case REFIT__ENVELOPE__BODY_ERROR:
        RF_ERROR("coordinator reports: %s", env->error->message);
        set_error(n, env->error->message);
        break;
    default:
        RF_WARN("unexpected message %d from the coordinator", env->body_case);
        break;
    }
}

static void coord_envelope(rf_peer *p, const Refit__Envelope *env)
{
    node_envelope(rf_peer_data(p), env);
}

void rf_node__envelope(rf_node *n, const Refit__Envelope *env)
{
    node_envelope(n, env);
}

void rf_node__set_send(rf_node *n, rf_node__send_fn fn, void *arg)
{
    n->send = fn ? fn : peer_send;
    n->send_arg = fn ? arg : NULL;
}

void rf_node__coord_down(rf_node *n, void *peer, const char *reason)
{
    if (n->coord != peer)
        return;
    RF_WARN("lost the coordinator: %s", reason);
    n->coord = NULL;
    rf_metric_set(n->m_peers, 0);
    drop_slice(n);
    /* What blocked refits is the coordinator's to say again once it is back. */
    if (n->blocked[0]) {
        n->blocked[0] = '\0';
        rf_registry_block(n->reg, NULL);
    }
    snapshot_soon(n);
}

static void coord_down(rf_peer *p, const char *reason)
{
    rf_node *n = rf_peer_data(p);

    if (n)
        rf_node__coord_down(n, p, reason);
}

/* ---- status -------------------------------------------------------------------------------- */

/* What this daemon waits for before its part of the next refit can start ("" : nothing here;
 * the coordinator's status says what the cluster waits for), from its own view and reg, its
 * registry's status document. */
static void waiting_for(const rf_node *n, json_t *reg, char *buf, size_t len)
{
    json_t *cl = json_object_get(reg, "clients"), *c;
    size_t i, off = 0, k = 0, sealed = 0;
    bool trainers = n->side == RF_SRC;

    buf[0] = '\0';
    if (n->running)
        return;
    if (n->blocked[0]) {
        snprintf(buf, len, "blocked: %s", n->blocked);
        return;
    }
    if (!n->coord) {
        snprintf(buf, len, "the coordinator at %s", n->cfg->coordinator_addr);
        return;
    }
    if (!rf_registry_complete(n->reg)) {
        json_array_foreach(cl, i, c)
            if (json_is_true(json_object_get(c, "sealed")))
                sealed++;
        snprintf(buf, len, "local clients: %zu of %d %s registered and sealed", sealed,
                 n->cfg->clients, trainers ? "trainers" : "engines");
        return;
    }
    if (!n->slice.complete) {
        snprintf(buf, len, "the plan slice from the coordinator");
        return;
    }
    /* The quorums: engines that must consume the committed version, trainers that must
     * publish a newer one. */
    json_array_foreach(cl, i, c) {
        const char *kind = json_string_value(json_object_get(c, "kind"));
        bool waits = !kind ? false : trainers ? strcmp(kind, "trainer") == 0 &&
                                (uint64_t)json_integer_value(json_object_get(c, "published")) <=
                                    n->committed
                              : strcmp(kind, "engine") == 0 &&
                                json_is_true(json_object_get(c, "gated")) &&
                                (uint64_t)json_integer_value(json_object_get(c, "consumed")) <
                                    n->committed;

        if (!waits || off >= len)
            continue;
        off += (size_t)snprintf(buf + off, len - off, "%s%s (rank %d)", k++ ? ", " : trainers
                                ? "publish quorum: trainers that have published no version "
                                  "after the committed one: "
                                : "receive quorum: engines that have not consumed the committed "
                                  "version: ", json_string_value(json_object_get(c, "name")),
                                (int)json_integer_value(json_object_get(c, "rank")));
    }
    if (k == 0)
        snprintf(buf, len, "the coordinator's Start");
}

json_t *rf_node_status(rf_node *n)
{
    json_t *st = json_object(), *reg = rf_registry_status(n->reg), *last, *adopted;
    char plan[RF_PLAN_ID_HEX] = "", wait[1024];
    uint64_t iv;
    uint32_t inst_n, inst_left;
    bool inst_ab;

    if (n->slice.complete)
        rf_plan_id_to_hex(n->slice.plan_id, plan);
    json_object_set_new(st, "role", json_string(role_name(n)));
    json_object_set_new(st, "node", json_string(n->cfg->node));
    json_object_set_new(st, "index", json_integer(n->cfg->index));
    json_object_set_new(st, "version", json_string(RF_VERSION));
    json_object_set_new(st, "transport", json_string(rf_transport_name(n->cfg->transport)));
    json_object_set_new(st, "coordinator", json_pack("{s:s, s:b}", "addr",
                        n->cfg->coordinator_addr, "connected", n->coord != NULL));
    json_object_set_new(st, "plan_id", json_string(plan));
    json_object_set_new(st, "plan_messages", json_integer(n->slice.complete ? n->slice.job.nmsgs : 0));
    json_object_set_new(st, "plan_bytes", json_integer((json_int_t)(n->slice.complete ? n->slice.bytes : 0)));
    json_object_set_new(st, "plan_local_copies", json_integer(n->slice.complete ? n->slice.ljob.nmsgs : 0));
    json_object_set_new(st, "plan_local_bytes", json_integer((json_int_t)(n->slice.complete ? n->slice.lbytes : 0)));
    /* The plan's data paths are being set up ahead of its first Start. */
    json_object_set_new(st, "preparing", json_boolean(n->preparing > 0));
    json_object_set_new(st, "local_copy", json_string(n->cfg->local_copy == RF_LOCAL_COPY_AUTO ? "auto" : "off"));
    /* The cluster-wide keys this daemon runs with (the coordinator's, from its last Start),
     * and those where that is not what its own config says. */
    json_object_set_new(st, "verify", json_string(rf_verify_name(n->verify)));
    json_object_set_new(st, "refit_timeout_s", json_integer(n->timeout_s));
    adopted = json_object();
    if (n->verify != n->cfg->verify)
        json_object_set_new(adopted, "verify", json_pack("{s:s, s:s}", "config",
                            rf_verify_name(n->cfg->verify), "cluster",
                            rf_verify_name(n->verify)));
    if (n->timeout_s != n->cfg->refit_timeout_s)
        json_object_set_new(adopted, "refit_timeout_s", json_pack("{s:i, s:i}", "config",
                            n->cfg->refit_timeout_s, "cluster", n->timeout_s));
    json_object_set_new(st, "adopted", adopted);
    json_object_set_new(st, "committed", json_integer((json_int_t)n->committed));
    json_object_set_new(st, "refit_in_flight", n->running ? json_integer((json_int_t)n->version)
                                                          : json_null());
    if (n->running)
        json_object_set_new(st, "progress", json_pack(
            "{s:I, s:I, s:I, s:f}", "version", (json_int_t)n->version, "bytes_done",
            (json_int_t)(rf_xfer_progress(n->xfer) + (n->lxfer ? rf_xfer_progress(n->lxfer) : 0)),
            "bytes_total", (json_int_t)(n->slice.bytes + n->slice.lbytes),
            "elapsed_s", now_s() - n->t_start));
    if (rf_install_running(n->inst, &iv, &inst_n, &inst_left, &inst_ab))
        /* Engines' own installers copy: the bytes they did show once they answer. */
        json_object_set_new(st, "installing", json_pack("{s:I, s:I, s:I, s:b}", "version",
                            (json_int_t)iv, "installers", (json_int_t)inst_n, "unanswered",
                            (json_int_t)inst_left, "aborting", inst_ab));
    else
        json_object_set_new(st, "installing", json_null());
    last = json_pack("{s:I, s:s, s:I, s:f, s:f, s:f, s:I}", "version",
                     (json_int_t)n->last.version, "result", n->last.result, "bytes",
                     (json_int_t)n->last.bytes, "wait_s", n->last.wait_s, "transfer_s",
                     n->last.transfer_s, "total_s", n->last.total_s, "peak_staging",
                     (json_int_t)n->last.peak_staging);
    json_object_set_new(last, "paths", json_pack("{s:{s:I, s:f}, s:{s:I, s:f}}",
                        path_names[PATH_NET], "bytes", (json_int_t)n->last.path[PATH_NET].bytes,
                        "seconds", n->last.path[PATH_NET].seconds, path_names[PATH_LOCAL],
                        "bytes", (json_int_t)n->last.path[PATH_LOCAL].bytes, "seconds",
                        n->last.path[PATH_LOCAL].seconds));
    json_object_set_new(st, "last_refit", last);
    json_object_set_new(st, "last_error", json_string(n->last_error));
    /* Why no version can be refitted until something changes (null: nothing blocks). */
    json_object_set_new(st, "blocked", n->blocked[0] ? json_string(n->blocked) : json_null());
    /* What its part of the next refit waits for (null: a refit is in flight). */
    waiting_for(n, reg, wait, sizeof(wait));
    json_object_set_new(st, "waiting_for", wait[0] ? json_string(wait) : json_null());
    json_object_set_new(st, "clients", reg ? reg : json_null());
    if (n->status_hook)
        n->status_hook(st, n->status_arg);
    return st;
}

char *rf_node_status_snapshot(rf_node *n)
{
    char *s;

    pthread_mutex_lock(&n->snap_lock);
    s = n->snapshot ? strdup(n->snapshot) : NULL;
    pthread_mutex_unlock(&n->snap_lock);
    return s;
}

void rf_node_status_line(rf_node *n, char *buf, size_t len)
{
    if (n->running)
        snprintf(buf, len, "refit of version %llu in flight", (unsigned long long)n->version);
    else if (n->blocked[0])
        snprintf(buf, len, "blocked: %s; committed %llu", n->blocked,
                 (unsigned long long)n->committed);
    else if (!n->coord)
        snprintf(buf, len, "waiting for the coordinator at %s; committed %llu",
                 n->cfg->coordinator_addr, (unsigned long long)n->committed);
    else if (!rf_registry_complete(n->reg))
        snprintf(buf, len, "waiting for local clients to register; committed %llu",
                 (unsigned long long)n->committed);
    else if (!n->slice.complete)
        snprintf(buf, len, "waiting for the plan; committed %llu",
                 (unsigned long long)n->committed);
    else
        snprintf(buf, len, "ready; committed %llu", (unsigned long long)n->committed);
}

void rf_node_set_status_hook(rf_node *n, rf_node_status_hook fn, void *arg)
{
    n->status_hook = fn;
    n->status_arg = arg;
}

void rf_node_status_changed(rf_node *n)
{
    snapshot_soon(n);
}

static void on_tick(uv_timer_t *t)
{
    rf_node *n = container_of(t, rf_node, tick);

    rf_metric_set(n->m_clients, (double)rf_registry_nclients(n->reg));
    rf_install_tick(n->inst);
    refresh_snapshot(n);
}

/* ---- life cycle ------------------------------------------------------------------------------ */

static int add_metrics(rf_node *n)
{
    rf_metrics *m = n->metrics;
    int rc = 0;

    rc |= rf_metrics_counter(m, &n->m_refits, "refit_refits_total",
                             "Refits seen by this daemon, by result", "result");
    rc |= rf_metrics_histogram(m, &n->m_stage, "refit_stage_seconds",
                               "Duration of refit stages on this daemon", "stage",
                               rf_metrics_seconds_buckets, rf_metrics_seconds_nbuckets);
    rc |= rf_metrics_counter(m, &n->m_bytes, "refit_bytes_total",
                             "Payload bytes moved, by peer daemon and direction", "peer,direction");
    rc |= rf_metrics_gauge(m, &n->m_committed, "refit_committed_version",
                           "Version committed last", NULL);
    rc |= rf_metrics_gauge(m, &n->m_peers, "refit_coordinator_connected",
                           "1 when the connection to the coordinator is up", NULL);
    rc |= rf_metrics_gauge(m, &n->m_clients, "refit_clients_connected",
                           "Local trainer or engine clients connected", NULL);
    rc |= rf_metrics_gauge(m, &n->m_slice_msgs, "refit_slice_messages",
                           "Messages in this daemon's plan slice", NULL);
    rc |= rf_metrics_info(m, &n->m_error, "refit_last_error", "The last error this daemon saw",
                          "message");
    rc |= rf_metrics_counter(m, &n->m_path_bytes, "refit_path_bytes_total",
                             "Payload bytes of committed-or-not refits that moved, by path "
                             "(network: tcp or nccl; local: same-host copies)", "path");
    rc |= rf_metrics_counter(m, &n->m_path_seconds, "refit_path_seconds_total",
                             "Seconds the data path of each path ran", "path");
    if (rc < 0)
        return -EINVAL;
    /* Gauges scraped before the first event read 0, not absent. */
    rf_metric_set(n->m_committed, 0);
    rf_metric_set(n->m_peers, 0);
    rf_metric_set(n->m_clients, 0);
    rf_metric_set(n->m_slice_msgs, 0);
    for (int p = PATH_NET; p <= PATH_LOCAL; p++) {
        rf_metric_add(n->m_path_bytes, 0, path_names[p]);
        rf_metric_add(n->m_path_seconds, 0, path_names[p]);
    }
    return 0;
}

/* local_copy = auto: this machine's identity and, for a publisherd, its socket as a path the
 * receiverd can open from anywhere (Hello.host_id, Hello.local_sock). */
static int local_identity(const rf_daemon_cfg *cfg, char *host, size_t hlen, char *sock,
                          size_t slen, rf_err *err)
{
    char cwd[PATH_MAX];
    int rc;

    host[0] = sock[0] = '\0';
    if (cfg->local_copy != RF_LOCAL_COPY_AUTO)
        return 0;
    if ((rc = rf_daemon_host_id(cfg, host, hlen, err)) < 0)
        return rc;
    if (cfg->socket[0] == '/')
        snprintf(sock, slen, "%s", cfg->socket);
    else if (getcwd(cwd, sizeof(cwd)))
        snprintf(sock, slen, "%s/%s", cwd, cfg->socket);
    else
        return rf_err_set(err, -errno, "local_copy: the socket path %s is relative and the "
                          "working directory unknown; give an absolute path", cfg->socket);
    return 0;
}

static void start_closed(void *arg)
{
    (*(unsigned *)arg)--;
}

/* A start that failed closes the transports it opened and waits for them here: a transport
 * closes on the loop (nccl tears its world down on a worker first), and the daemon's exit path
 * would otherwise close their handles under them. */
static void start_failed_close(uv_loop_t *loop, rf_node *n)
{
    unsigned left = 0;

    if (n->xfer) {
        left++;
        rf_xfer_close(n->xfer, start_closed, &left);
    }
    if (n->lxfer) {
        left++;
        rf_xfer_close(n->lxfer, start_closed, &left);
    }
    while (left > 0 && uv_run(loop, UV_RUN_ONCE))
        ;
}

int rf_node_start(uv_loop_t *loop, const rf_node_opts *opts, rf_node **out, rf_err *err)
{
    const rf_daemon_cfg *cfg = opts->cfg;
    rf_registry_opts ro = {0};
    rf_registry_cb cb = {0};
    rf_peer_config pc = {0};
    rf_xfer_open_opts xo = {0};
    rf_node *n = calloc(1, sizeof(*n));
    char host_id[256], local_sock[PATH_MAX];
    int rc;

    if (!n)
        return rf_err_set(err, -ENOMEM, "out of memory");
    n->loop = loop;
    n->cfg = cfg;
    n->side = cfg->role == RF_DAEMON_PUBLISHER ? RF_SRC : RF_DST;
    n->daemon_id = opts->daemon_id;
    n->metrics = opts->metrics;
    n->send = peer_send;
    n->verify = cfg->verify;
    n->timeout_s = cfg->refit_timeout_s;
    pthread_mutex_init(&n->snap_lock, NULL);
    rf_slice_job_init(&n->slice);
    snprintf(n->last.result, sizeof(n->last.result), "none");
    rc = add_metrics(n);
    if (rc < 0) {
        rf_err_set(err, rc, "registering the node's metrics failed");
        goto fail;
    }

    rc = local_identity(cfg, host_id, sizeof(host_id), local_sock, sizeof(local_sock), err);
    if (rc < 0)
        goto fail;
    xo.nccl = cfg->transport == RF_TRANSPORT_NCCL;
    xo.listen_addr = cfg->data_listen;
    xo.key = opts->key->bytes;
    xo.key_len = opts->key->len;
    rf_xfer_digest_seed(opts->key->bytes, opts->key->len, n->digest_seed);
    rc = rf_xfer_open(loop, &xo, &n->xfer, err);
    if (rc < 0)
        goto fail;
    n->xfers_open++;
    if (cfg->local_copy == RF_LOCAL_COPY_AUTO && n->side == RF_DST) {
        rc = rf_xfer_local_new(loop, xo.nccl, &n->lxfer, err);
        if (rc < 0)
            goto fail;
        n->xfers_open++;
        rc = rf_srcmap_new(opts->key->bytes, opts->key->len, cfg->peer_timeout_ms / 1000.0,
                           &n->srcs, err);
        if (rc < 0)
            goto fail;
    }

    ro.socket_path = cfg->socket;
    ro.side = n->side;
    ro.expected_clients = (unsigned)cfg->clients;
    ro.node = (uint32_t)cfg->index;
    ro.allowed_uids = cfg->socket_uids.v;
    ro.n_allowed_uids = cfg->socket_uids.n;
    ro.gpu_memory = cfg->transport == RF_TRANSPORT_NCCL;
    cb.on_inventory = on_inventory;
    cb.on_change = on_change;
    cb.on_ready = on_ready;
    cb.on_status = on_status;
    cb.on_refit = on_refit;
    cb.on_consumed = on_consumed;
    cb.on_install_done = on_install_done;
    cb.on_install_lost = on_install_lost;
    if (cfg->local_copy == RF_LOCAL_COPY_AUTO && n->side == RF_DST)
        cb.on_install_sources = on_install_sources;
    rc = rf_registry_open(loop, &ro, &cb, n, &n->reg, err);
    if (rc < 0)
        goto fail;
    if (cfg->local_copy == RF_LOCAL_COPY_AUTO && n->side == RF_DST) {
        /* Engines that install in their own process get, per plan, the trainers' memory their
         * part reads, fetched here with the key (which never leaves this daemon). */
        rc = rf_install_new(loop, n->reg, opts->key->bytes, opts->key->len,
                            cfg->peer_timeout_ms / 1000.0, &n->inst, err);
        if (rc < 0)
            goto fail;
    }
    if (cfg->local_copy == RF_LOCAL_COPY_AUTO && n->side == RF_SRC) {
        /* Receiverds on this host fetch the trainers' memory here, proving the cluster key. */
        rc = rf_registry_set_export_key(n->reg, opts->key->bytes, opts->key->len);
        if (rc < 0) {
            rf_err_set(err, rc, "out of memory setting up local copies");
            goto fail;
        }
    }

    pc.key = opts->key;
    pc.role = n->side == RF_SRC ? REFIT__ROLE__ROLE_PUBLISHER : REFIT__ROLE__ROLE_RECEIVER;
    pc.node = cfg->node;
    pc.daemon_id = n->daemon_id;
    pc.data_addr = rf_xfer_data_addr(n->xfer);
    pc.host_id = host_id;
    pc.local_sock = n->side == RF_SRC ? local_sock : "";
    pc.index = (uint32_t)cfg->index;
    pc.max_frame = (uint32_t)cfg->max_frame_mib << 20;
    pc.heartbeat_ms = (uint64_t)cfg->heartbeat_ms;
    pc.timeout_ms = (uint64_t)cfg->peer_timeout_ms;
    pc.cb.on_up = coord_up;
    pc.cb.on_envelope = coord_envelope;
    pc.cb.on_down = coord_down;
    pc.data = n;
    rc = rf_peer_connect(loop, cfg->coordinator_addr, &pc, &n->conn, err);
    if (rc < 0)
        goto fail;

    uv_timer_init(loop, &n->tick);
    uv_timer_start(&n->tick, on_tick, 1000, 1000);
    uv_timer_init(loop, &n->snap_timer);
    refresh_snapshot(n);
    RF_INFO("%s %s: local socket %s, transport %s%s%s, coordinator %s", role_name(n), cfg->node,
            cfg->socket, rf_xfer_name(n->xfer), pc.data_addr[0] ? " on " : "", pc.data_addr,
            cfg->coordinator_addr);
    *out = n;
    return 0;
fail:
    if (n->reg)
        rf_registry_close(n->reg);
    start_failed_close(loop, n);
    rf_srcmap_free(n->srcs);
    rf_install_free(n->inst);
    free(n->held_start);
    pthread_mutex_destroy(&n->snap_lock);
    free(n);
    return rc;
}

static void node_free(rf_node *n)
{
    if (!rf_closer_done(&n->closer))
        return;
    rf_slice_job_reset(&n->slice);
    rf_slice_job_reset(&n->next);
    rf_install_plan_reset(&n->islice);
    rf_install_plan_reset(&n->inext);
    rf_install_free(n->inst);
    pthread_mutex_destroy(&n->snap_lock);
    free(n->snapshot);
    free(n);
}

static void tick_closed(uv_handle_t *h)
{
    node_free(container_of((uv_timer_t *)h, rf_node, tick));
}

static void snap_timer_closed(uv_handle_t *h)
{
    node_free(container_of((uv_timer_t *)h, rf_node, snap_timer));
}

/* The registry and the local trainers' mappings (the client memory the data paths read and
 * write) go only after every data path stopped. */
static void xfer_closed(void *arg)
{
    rf_node *n = arg;

    if (--n->xfers_open == 0) {
        rf_registry_close(n->reg);
        rf_srcmap_free(n->srcs);
        n->srcs = NULL;
    }
    node_free(n);
}

void rf_node_close(rf_node *n)
{
    /* The connector's peer keeps a pointer to n: detach it before n goes away (a test's fake
     * coordinator is its own). */
    if (n->coord && n->send == peer_send)
        rf_peer_set_data(n->coord, NULL);
    n->coord = NULL;
    rf_closer_begin(&n->closer);
    rf_peer_connector_close(n->conn);
    rf_closer_add(&n->closer);
    rf_xfer_close(n->xfer, xfer_closed, n);
    if (n->lxfer) {
        rf_closer_add(&n->closer);
        rf_xfer_close(n->lxfer, xfer_closed, n);
    }
    rf_closer_add(&n->closer);
    uv_close((uv_handle_t *)&n->tick, tick_closed);
    rf_closer_add(&n->closer);
    uv_close((uv_handle_t *)&n->snap_timer, snap_timer_closed);
    node_free(n);
}
