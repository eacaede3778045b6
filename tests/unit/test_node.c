/* tests/unit/test_node.c - a daemon's node driven through its coordinator handlers: the test
 * plays the coordinator (a fake peer, every envelope the node sends recorded) while real
 * trainers and engines talk to the node's registry over its Unix socket with librefit, and the
 * node's loop runs on a thread of its own. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "node.h"
#include "loop_thread.h"
#include "plan.h"
#include "refit.h"
#include "slice.h"

typedef struct harness {
    test_loop l; /* its mu also guards the recorder's out[] */
    char dir[64], conf[96], sock[96], coord_addr[32];
    int closed_fd; /* a bound, never listening socket: connecting to it is refused */
    int closed_port;
    rf_daemon_cfg cfg;
    rf_peer_key key;
    rf_metrics *metrics;
    rf_node *n;
    int fake_coord;
    Refit__Envelope **out; /* what the node sent, in order (under mu) */
    size_t nout, cap;
} harness;

static harness H;

#define DAEMON_ID 4242

/* ---- the fake coordinator ------------------------------------------------------------------ */

static int record(void *peer, const Refit__Envelope *env, void *arg)
{
    size_t len = refit__envelope__get_packed_size(env);
    uint8_t *buf = malloc(len ? len : 1);
    Refit__Envelope *copy;

    (void)arg;
    cr_assert_eq(peer, &H.fake_coord, "the node sent to a peer that is not its coordinator");
    cr_assert_not_null(buf);
    refit__envelope__pack(env, buf);
    copy = refit__envelope__unpack(NULL, len, buf);
    free(buf);
    cr_assert_not_null(copy, "an envelope of the node does not unpack");
    pthread_mutex_lock(&H.l.mu);
    if (H.nout == H.cap) {
        H.cap = H.cap ? 2 * H.cap : 64;
        H.out = realloc(H.out, H.cap * sizeof(*H.out));
    }
    H.out[H.nout++] = copy;
    pthread_cond_broadcast(&H.l.cv);
    pthread_mutex_unlock(&H.l.mu);
    return 0;
}

static size_t mark(void)
{
    size_t n;

    pthread_mutex_lock(&H.l.mu);
    n = H.nout;
    pthread_mutex_unlock(&H.l.mu);
    return n;
}

/* Waits up to 5 s (or ms) for an envelope of kind sent at or after index from; returns it. */
static const Refit__Envelope *wait_sent_ms(size_t from, Refit__Envelope__BodyCase kind, int ms)
{
    const Refit__Envelope *got = NULL;
    struct timespec ts;
    size_t i = from;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&H.l.mu);
    while (!got) {
        for (; i < H.nout && !got; i++)
            if (H.out[i]->body_case == kind)
                got = H.out[i];
        if (!got && pthread_cond_timedwait(&H.l.cv, &H.l.mu, &ts) != 0)
            break;
    }
    pthread_mutex_unlock(&H.l.mu);
    return got;
}

static const Refit__Envelope *wait_sent(size_t from, Refit__Envelope__BodyCase kind)
{
    const Refit__Envelope *e = wait_sent_ms(from, kind, 5000);

    cr_assert_not_null(e, "the node sent no envelope of kind %d within 5 s", kind);
    return e;
}

/* The last Ready the node sent since from (its readiness as the coordinator would see it). */
static uint64_t wait_ready(size_t from, uint64_t want)
{
    struct timespec ts;
    uint64_t v = UINT64_MAX;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 5;
    pthread_mutex_lock(&H.l.mu);
    for (;;) {
        for (size_t i = from; i < H.nout; i++)
            if (H.out[i]->body_case == REFIT__ENVELOPE__BODY_READY)
                v = H.out[i]->ready->version;
        if (v == want || pthread_cond_timedwait(&H.l.cv, &H.l.mu, &ts) != 0)
            break;
    }
    pthread_mutex_unlock(&H.l.mu);
    cr_assert_eq(v, want, "the node's last Ready says %llu, wanted %llu",
                 (unsigned long long)v, (unsigned long long)want);
    return v;
}

static void do_coord_up(void *arg)
{
    (void)arg;
    rf_node__set_send(H.n, record, NULL);
    rf_node__coord_up(H.n, &H.fake_coord);
}

static void do_envelope(void *arg)
{
    rf_node__envelope(H.n, arg);
}

static void from_coord(const Refit__Envelope *env)
{
    test_loop_run(&H.l, do_envelope, (void *)env);
}

/* Start(v) of plan_id, with the coordinator's cluster-wide settings cc (NULL: none, as an
 * older coordinator sends it). */
static void send_start_with(uint64_t v, const uint8_t *plan_id, Refit__ClusterConfig *cc)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Start s = REFIT__START__INIT;

    s.version = v;
    s.plan_id.data = (uint8_t *)plan_id;
    s.plan_id.len = 32;
    s.config = cc;
    env.body_case = REFIT__ENVELOPE__BODY_START;
    env.start = &s;
    from_coord(&env);
}

static void send_start(uint64_t v, const uint8_t *plan_id)
{
    send_start_with(v, plan_id, NULL);
}

static void send_commit(uint64_t v)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Commit c = REFIT__COMMIT__INIT;

    c.version = v;
    env.body_case = REFIT__ENVELOPE__BODY_COMMIT;
    env.commit = &c;
    from_coord(&env);
}

static void send_abort(uint64_t v, const char *reason)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Abort a = REFIT__ABORT__INIT;

    a.version = v;
    a.reason = (char *)reason;
    env.body_case = REFIT__ENVELOPE__BODY_ABORT;
    env.abort = &a;
    from_coord(&env);
}

typedef struct status_req {
    json_t *st;
} status_req;

static void do_status(void *arg)
{
    ((status_req *)arg)->st = rf_node_status(H.n);
}

static json_t *node_status(void)
{
    status_req r = {0};

    test_loop_run(&H.l, do_status, &r);
    return r.st;
}

static json_int_t status_int(const char *key)
{
    json_t *st = node_status();
    json_int_t v = json_integer_value(json_object_get(st, key));

    json_decref(st);
    return v;
}

/* ---- the fixture ------------------------------------------------------------------------------ */

static void start_node(const char *role, ...)
{
    char *argv[48] = {"test_node", "--config", H.conf, "--coordinator-addr", H.coord_addr,
                      "--publishers", "1", "--receivers", "1", "--clients", "1",
                      "--node", "n0", "--socket", H.sock, "--status-listen", "",
                      "--data-listen", "127.0.0.1:0", "--refit-timeout-s", "1"};
    int argc = 21;
    rf_node_opts o = {0};
    rf_cfg_next next;
    rf_err err = {0};
    va_list ap;

    va_start(ap, role);
    for (const char *a = va_arg(ap, const char *); a; a = va_arg(ap, const char *))
        argv[argc++] = (char *)a;
    va_end(ap);
    cr_assert_eq(rf_daemon_cfg_load(&H.cfg, strcmp(role, "publisher") == 0
                                     ? RF_DAEMON_PUBLISHER : RF_DAEMON_RECEIVER,
                                     argc, argv, &next, &err), 0, "%s", err.msg);
    o.cfg = &H.cfg;
    o.key = &H.key;
    o.daemon_id = DAEMON_ID;
    o.metrics = H.metrics;
    cr_assert_eq(rf_node_start(&H.l.loop, &o, &H.n, &err), 0, "%s", err.msg);
    test_loop_start(&H.l);
}

static void setup(void)
{
    struct sockaddr_in a = {0};
    socklen_t alen = sizeof(a);
    FILE *f;

    memset(&H, 0, sizeof(H));
    test_loop_init(&H.l);
    snprintf(H.dir, sizeof(H.dir), "/tmp/rf_node_XXXXXX");
    cr_assert(mkdtemp(H.dir));
    snprintf(H.conf, sizeof(H.conf), "%s/empty.conf", H.dir);
    snprintf(H.sock, sizeof(H.sock), "%s/d.sock", H.dir);
    f = fopen(H.conf, "w");
    cr_assert_not_null(f);
    fclose(f);
    /* The node's connector tries the coordinator address all along: nobody answers there. */
    H.closed_fd = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(H.closed_fd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(getsockname(H.closed_fd, (struct sockaddr *)&a, &alen), 0);
    H.closed_port = ntohs(a.sin_port);
    snprintf(H.coord_addr, sizeof(H.coord_addr), "127.0.0.1:%d", H.closed_port);
    H.key.len = 32;
    memset(H.key.bytes, 0x5a, H.key.len);
    H.metrics = rf_metrics_new();
    cr_assert_not_null(H.metrics);
}

static void close_node(void *arg)
{
    (void)arg;
    if (H.n)
        rf_node_close(H.n);
    H.n = NULL;
}

static void teardown(void)
{
    test_loop_stop(&H.l, close_node, NULL);
    for (size_t i = 0; i < H.nout; i++)
        refit__envelope__free_unpacked(H.out[i], NULL);
    free(H.out);
    rf_metrics_free(H.metrics);
    rf_daemon_cfg_free(&H.cfg);
    close(H.closed_fd);
    unlink(H.sock);
    unlink(H.conf);
    rmdir(H.dir);
}

TestSuite(node, .init = setup, .fini = teardown, .timeout = 60);

/* ---- clients -------------------------------------------------------------------------------- */

#define OK(call, c) cr_assert_eq((call), 0, "%s: %s", #call, refit_last_error(c))

static const int64_t shape_w[2] = {4, 8};

/* A client holding all of tensor "w" [4, 8] fp32, sealed. */
static refit_client *client(int kind, const char *name)
{
    const int64_t start[2] = {0, 0}, strides[2] = {8, 1};
    refit_client *c = NULL;
    uint32_t region;
    void *mem;

    cr_assert_eq(refit_connect(H.sock, name, 0, kind, &c), 0, "connect: %s",
                 refit_last_error(NULL));
    OK(refit_alloc_host(c, 128, &mem, &region), c);
    memset(mem, 0x42, 128);
    OK(refit_add_piece(c, "w", REFIT_FP32, 2, shape_w, region, 0, start, shape_w, strides), c);
    OK(refit_seal(c), c);
    return c;
}

/* The complete inventory the node sent since from. */
static const Refit__Inventory *wait_complete_inventory(size_t from)
{
    for (;;) {
        const Refit__Envelope *e = wait_sent(from, REFIT__ENVELOPE__BODY_INVENTORY);

        if (e->inventory->complete)
            return e->inventory;
        pthread_mutex_lock(&H.l.mu);
        for (from = 0; from < H.nout && H.out[from] != e; from++)
            ;
        pthread_mutex_unlock(&H.l.mu);
        from++;
    }
}

/* ---- a plan slice for the node, as the coordinator builds it ---------------------------------- */

typedef struct slices {
    Refit__PlanSlice **frames;
    size_t n;
    uint8_t plan_id[32];
} slices;

/* The node (whose inventory is mine, of side) and its counterpart at a closed port holding all
 * of "w": the real merge, planner and slice builder, as the coordinator runs them. With
 * same_host both daemons are on one host, so a receiver node's slice holds local copies. */
static void build_slices_for(const Refit__Inventory *mine, rf_side side, bool same_host,
                             slices *out)
{
    const int64_t strides[2] = {8, 1};
    Refit__Inventory recv_msg, *invs[2];
    rf_side sides[2] = {RF_SRC, RF_DST};
    rf_slice_peer peers[2];
    rf_slice_map map = {0};
    rf_inv *local = rf_inv_new(), *global = NULL;
    rf_plan *plan = NULL;
    rf_plan_opts opts;
    rf_err err = {0};
    char addr[32];
    uint32_t t, ep, rg;
    rf_piece p = {0};

    cr_assert_eq(rf_inv_add_tensor(local, "w", RF_DT_FP32, 2, shape_w, &t, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(rf_inv_add_endpoint(local, side == RF_SRC ? RF_DST : RF_SRC, 0, &ep, &err), 0);
    cr_assert_eq(rf_inv_add_region(local, ep, 128, &rg, &err), 0);
    p.tensor = t;
    p.region = rg;
    rf_box_full(&p.box, 2, shape_w);
    memcpy(p.strides, strides, sizeof(strides));
    cr_assert_eq(rf_inv_add_piece(local, &p, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_slice_inv_pack(local, side == RF_SRC ? RF_DST : RF_SRC, 1, &recv_msg), 0);
    invs[side == RF_SRC ? 0 : 1] = (Refit__Inventory *)mine;
    invs[side == RF_SRC ? 1 : 0] = &recv_msg;
    cr_assert_eq(rf_slice_merge(invs, sides, 2, &global, &map, &err), 0, "%s", err.msg);
    for (uint32_t e = 0; same_host && e < rf_inv_nendpoints(global); e++)
        cr_assert_eq(rf_inv_set_endpoint_host(global, e, 0, &err), 0);
    rf_plan_opts_default(&opts);
    cr_assert_eq(rf_plan_build(global, &opts, &plan, &err), 0, "%s", err.msg);
    memcpy(out->plan_id, rf_plan_id(plan), 32);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", H.closed_port);
    peers[0] = (rf_slice_peer){.daemon_id = side == RF_SRC ? DAEMON_ID : 7,
                               .data_addr = side == RF_SRC ? "127.0.0.1:1" : addr,
                               .role = REFIT__ROLE__ROLE_PUBLISHER, .local_sock = "/nowhere"};
    peers[1] = (rf_slice_peer){.daemon_id = side == RF_SRC ? 7 : DAEMON_ID,
                               .data_addr = side == RF_SRC ? addr : "127.0.0.1:1",
                               .role = REFIT__ROLE__ROLE_RECEIVER};
    cr_assert_eq(rf_slice_build(plan, &map, side == RF_SRC ? 0 : 1, peers, mine->generation,
                                100000, NULL, &out->frames, &out->n), 0);
    rf_plan_free(plan);
    rf_inv_free(global);
    rf_inv_free(local);
    rf_slice_map_free(&map);
    rf_slice_inv_msg_free(&recv_msg);
}

static void build_slices(const Refit__Inventory *mine, slices *out)
{
    build_slices_for(mine, RF_SRC, false, out);
}

static void give_slices(slices *s)
{
    for (size_t i = 0; i < s->n; i++) {
        Refit__Envelope env = REFIT__ENVELOPE__INIT;

        env.body_case = REFIT__ENVELOPE__BODY_PLAN_SLICE;
        env.plan_slice = s->frames[i];
        from_coord(&env);
        rf_slice_msg_free(s->frames[i]);
    }
    free(s->frames);
    s->frames = NULL;
}

static void check_waiting_for(const char *want);

static bool status_plan_is(const uint8_t *id)
{
    json_t *st = node_status();
    const char *plan = json_string_value(json_object_get(st, "plan_id"));
    char want[65];
    bool same;

    for (int i = 0; i < 32; i++)
        snprintf(want + 2 * i, 3, "%02x", id[i]);
    same = plan && strcmp(plan, want) == 0;
    json_decref(st);
    return same;
}

/* ---- tests ------------------------------------------------------------------------------------ */

Test(node, reports_inventory_and_readiness_to_the_coordinator)
{
    const Refit__Envelope *e;
    const Refit__Inventory *inv;
    refit_client *t;
    slices s = {0};
    size_t m;

    start_node("publisher", NULL);
    test_loop_run(&H.l, do_coord_up, NULL);
    e = wait_sent(0, REFIT__ENVELOPE__BODY_INVENTORY);
    cr_assert(!e->inventory->complete, "an inventory without its trainer is complete");
    wait_ready(0, 0);
    m = mark();
    t = client(REFIT_TRAINER, "t0");
    inv = wait_complete_inventory(m);
    cr_assert_eq(inv->n_pieces, 1);
    cr_assert_eq(inv->n_tensors, 1);
    cr_assert_str_eq(inv->tensors[0]->name, "w");
    cr_assert_eq(inv->committed, 0);
    /* With its slice, what it waits for is its trainers' publish, then the Start. */
    build_slices(inv, &s);
    give_slices(&s);
    check_waiting_for("publish quorum: trainers that have published no version after the "
                      "committed one: t0 (rank 0)");
    m = mark();
    OK(refit_publish(t, 3), t);
    wait_ready(m, 3);
    check_waiting_for("the coordinator's Start");
    /* The trainer leaves: the inventory is incomplete and the readiness gone. */
    m = mark();
    refit_close(t);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_INVENTORY);
    cr_assert(!e->inventory->complete);
    wait_ready(m, 0);
}

Test(node, start_for_a_plan_it_does_not_hold_answers_a_failed_done)
{
    uint8_t other[32];
    const Refit__Envelope *e;
    refit_client *t;
    slices s = {0};
    size_t m;

    start_node("publisher", NULL);
    test_loop_run(&H.l, do_coord_up, NULL);
    m = mark();
    t = client(REFIT_TRAINER, "t0");
    build_slices(wait_complete_inventory(m), &s);
    OK(refit_publish(t, 1), t);
    /* No slice yet. */
    m = mark();
    send_start(1, s.plan_id);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_DONE);
    cr_assert_eq(e->done->version, 1);
    cr_assert(!e->done->ok);
    cr_assert(strstr(e->done->error, "names a plan this daemon does not hold"), "%s",
              e->done->error);
    give_slices(&s);
    cr_assert(status_plan_is(s.plan_id), "the node does not show the slice it was given");
    /* A slice, but Start names another plan. */
    memcpy(other, s.plan_id, 32);
    other[0] ^= 1;
    m = mark();
    send_start(1, other);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_DONE);
    cr_assert(!e->done->ok);
    cr_assert(strstr(e->done->error, "does not hold"), "%s", e->done->error);
    /* The plan it holds: the data path runs, and its failure (the receiver's data address
     * refuses connections) comes back as Done(ok = false) with the transport's reason. */
    m = mark();
    send_start(1, s.plan_id);
    e = wait_sent_ms(m, REFIT__ENVELOPE__BODY_DONE, 10000);
    cr_assert_not_null(e, "no Done within 10 s of a Start for the plan the node holds");
    cr_assert(!e->done->ok);
    cr_assert(strstr(e->done->error, "data path of version 1 failed"), "%s", e->done->error);
    /* Version 1 again, aborted by the coordinator while (or after) its data path fails:
     * whichever ends first, the status says "aborted" with the abort's reason, not the data
     * path's follow-on error. */
    m = mark();
    send_start(1, s.plan_id);
    send_abort(1, "receiver 0 (r0) timed out");
    cr_assert_not_null(wait_sent_ms(m, REFIT__ENVELOPE__BODY_DONE, 10000));
    {
        json_t *st = node_status();
        json_t *last = json_object_get(st, "last_refit");

        cr_assert_str_eq(json_string_value(json_object_get(last, "result")), "aborted");
        cr_assert(strncmp(json_string_value(json_object_get(st, "last_error")),
                          "refit of version 1 aborted: receiver 0 (r0) timed out", 53) == 0,
                  "last_error: %s", json_string_value(json_object_get(st, "last_error")));
        json_decref(st);
    }
    /* The trainer re-registers: the slice it held is stale. */
    refit_close(t);
    m = mark();
    t = client(REFIT_TRAINER, "t0b");
    wait_complete_inventory(m);
    m = mark();
    send_start(2, s.plan_id);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_DONE);
    cr_assert(!e->done->ok);
    cr_assert(strstr(e->done->error, "does not hold"), "%s", e->done->error);
    refit_close(t);
}

Test(node, commit_releases_the_trainers_and_a_committed_version_is_refused)
{
    const Refit__Envelope *e;
    refit_client *t;
    uint8_t id[32] = {0};
    size_t m;

    start_node("publisher", NULL);
    test_loop_run(&H.l, do_coord_up, NULL);
    t = client(REFIT_TRAINER, "t0");
    m = mark();
    OK(refit_publish(t, 4), t);
    wait_ready(m, 4);
    cr_assert_eq(refit_wait_released(t, 4, 0), -ETIMEDOUT, "released before the commit");
    send_commit(4);
    OK(refit_wait_released(t, 4, 5000), t);
    cr_assert_eq(status_int("committed"), 4);
    m = mark();
    send_start(4, id);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_DONE);
    cr_assert(!e->done->ok);
    cr_assert(strstr(e->done->error, "Start(4) refused: version 4 is already committed"), "%s",
              e->done->error);
    /* A later inventory carries the committed version (a restarted coordinator reads it). */
    refit_close(t);
    m = mark();
    t = client(REFIT_TRAINER, "t0b");
    cr_assert_eq(wait_complete_inventory(m)->committed, 4);
    refit_close(t);
}

/* The registry's ready version in the node's status. */
static json_int_t registry_ready(void)
{
    json_t *st = node_status();
    json_int_t v = json_integer_value(json_object_get(json_object_get(st, "clients"), "ready"));

    json_decref(st);
    return v;
}

Test(node, abort_takes_the_offer_back_and_ready_is_sent_again)
{
    refit_client *t;
    size_t m;

    start_node("publisher", NULL);
    test_loop_run(&H.l, do_coord_up, NULL);
    t = client(REFIT_TRAINER, "t0");
    m = mark();
    OK(refit_publish(t, 2), t);
    wait_ready(m, 2);
    cr_assert_eq(registry_ready(), 2);
    m = mark();
    send_abort(2, "receiver 0 (r0) timed out");
    /* The coordinator forgot this publisher's readiness at the abort: the node says it anew,
     * and the registry took the trainer's offer back, so it says 0. */
    wait_ready(m, 0);
    cr_assert_eq(registry_ready(), 0, "the registry still offers the aborted version");
    cr_assert_eq(status_int("committed"), 0);
    /* The trainer publishes the version again: ready again. */
    m = mark();
    OK(refit_publish(t, 2), t);
    wait_ready(m, 2);
    /* The trainer moved on to 3 when the abort of 2 comes: its offer stands, and the node says
     * so again, because the coordinator forgot every publisher's readiness at the abort. */
    m = mark();
    OK(refit_publish(t, 3), t);
    wait_ready(m, 3);
    m = mark();
    send_abort(2, "publisher 1 lost");
    wait_ready(m, 3);
    cr_assert_eq(registry_ready(), 3);
    refit_close(t);
}

Test(node, a_receiver_says_idle_and_tells_its_engines)
{
    const Refit__Envelope *e;
    refit_client *eng;
    uint64_t v = 0;
    int ev = 0;
    size_t m;

    start_node("receiver", NULL);
    test_loop_run(&H.l, do_coord_up, NULL);
    e = wait_sent(0, REFIT__ENVELOPE__BODY_IDLE);
    cr_assert(e->idle->ready, "a receiver without gated engines holds the quorum");
    eng = client(REFIT_ENGINE, "e0");
    m = mark();
    send_commit(1);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_IDLE);
    cr_assert(e->idle->ready);
    OK(refit_next_event(eng, 5000, &ev, &v), eng);
    cr_assert_eq(ev, REFIT_EVENT_COMMITTED);
    cr_assert_eq(v, 1);
    send_abort(2, "publisher 0 lost");
    OK(refit_next_event(eng, 5000, &ev, &v), eng);
    cr_assert_eq(ev, REFIT_EVENT_ABORTED);
    cr_assert_eq(v, 2);
    cr_assert_eq(wait_sent_ms(m, REFIT__ENVELOPE__BODY_READY, 0), NULL,
                 "a receiver sent Ready");
    refit_close(eng);
}

static void send_blocked(const char *reason)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Blocked b = REFIT__BLOCKED__INIT;

    b.committed = 0;
    b.reason = (char *)reason;
    env.body_case = REFIT__ENVELOPE__BODY_BLOCKED;
    env.blocked = &b;
    from_coord(&env);
}

static void do_coord_down(void *arg)
{
    (void)arg;
    rf_node__coord_down(H.n, &H.fake_coord, "test: connection lost");
}

static void do_status_line(void *arg)
{
    rf_node_status_line(H.n, arg, 1024);
}

/* The node's status says blocked with want (NULL: not blocked), and so does its status line. */
static void check_status_blocked(const char *want)
{
    json_t *st = node_status(), *b = json_object_get(st, "blocked");
    char line[1024];

    test_loop_run(&H.l, do_status_line, line);
    if (want) {
        cr_assert(json_is_string(b), "the status does not say blocked");
        cr_assert_str_eq(json_string_value(b), want);
        cr_assert(strstr(line, want), "the status line says: %s", line);
    } else {
        cr_assert(json_is_null(b), "the status still says blocked: %s", json_string_value(b));
        cr_assert_null(strstr(line, "blocked"), "the status line says: %s", line);
    }
    json_decref(st);
}

/* The node's status says it waits for want. */
static void check_waiting_for(const char *want)
{
    json_t *st = node_status(), *w = json_object_get(st, "waiting_for");

    cr_assert_str_eq(json_is_string(w) ? json_string_value(w) : "(null)", want);
    json_decref(st);
}

#define WHY_BLOCKED "the coordinator cannot plan: inventory of daemon 1: tensor w registered " \
                    "as fp32 [4, 8] and again as fp16 [4, 8]: both sides must agree on dtype " \
                    "and global shape"

/* The coordinator says nothing can be refitted: the engine's wait ends at once with its
 * reason, the status shows it, and once it clears (or the coordinator is lost) the engine
 * waits as usual. */
Test(node, blocked_ends_the_engines_waits_with_the_coordinators_reason)
{
    refit_client *eng;

    char want[128];

    start_node("receiver", NULL);
    snprintf(want, sizeof(want), "the coordinator at %s", H.coord_addr);
    check_waiting_for(want);
    test_loop_run(&H.l, do_coord_up, NULL);
    check_waiting_for("local clients: 0 of 1 engines registered and sealed");
    eng = client(REFIT_ENGINE, "e0");
    check_waiting_for("the plan slice from the coordinator");
    check_status_blocked(NULL);
    send_blocked(WHY_BLOCKED);
    check_status_blocked(WHY_BLOCKED);
    check_waiting_for("blocked: " WHY_BLOCKED);
    cr_assert_eq(refit_wait_version(eng, 1, 5000), -EAGAIN, "%s", refit_last_error(eng));
    cr_assert_str_eq(refit_last_error(eng), "version 1 cannot be refitted now: " WHY_BLOCKED);
    /* Cleared: the engine waits again until the commit. */
    send_blocked("");
    check_status_blocked(NULL);
    cr_assert_eq(refit_wait_version(eng, 1, 50), -ETIMEDOUT, "%s", refit_last_error(eng));
    send_commit(1);
    cr_assert_eq(refit_wait_version(eng, 1, 5000), 0, "%s", refit_last_error(eng));
    /* A lost coordinator's reason goes with it: its successor says what holds. */
    send_blocked(WHY_BLOCKED);
    cr_assert_eq(refit_wait_version(eng, 2, 5000), -EAGAIN, "%s", refit_last_error(eng));
    test_loop_run(&H.l, do_coord_down, NULL);
    check_status_blocked(NULL);
    check_waiting_for(want);
    cr_assert_eq(refit_wait_version(eng, 2, 50), -ETIMEDOUT, "%s", refit_last_error(eng));
    refit_close(eng);
}

/* A receiver whose gated engine has not consumed the committed version waits for it. */
Test(node, a_receiver_waits_for_its_gated_engines)
{
    const int64_t start[2] = {0, 0}, strides[2] = {8, 1};
    refit_client *eng = NULL;
    uint32_t region;
    slices s = {0};
    void *mem;
    size_t m;

    start_node("receiver", NULL);
    test_loop_run(&H.l, do_coord_up, NULL);
    m = mark();
    cr_assert_eq(refit_connect(H.sock, "e0", 0, REFIT_ENGINE, &eng), 0, "%s",
                 refit_last_error(NULL));
    OK(refit_alloc_host(eng, 128, &mem, &region), eng);
    OK(refit_add_piece(eng, "w", REFIT_FP32, 2, shape_w, region, 0, start, shape_w, strides),
       eng);
    OK(refit_gate(eng), eng);
    OK(refit_seal(eng), eng);
    build_slices_for(wait_complete_inventory(m), RF_DST, false, &s);
    give_slices(&s);
    send_commit(1);
    check_waiting_for("receive quorum: engines that have not consumed the committed version: "
                      "e0 (rank 0)");
    OK(refit_consumed(eng, 1), eng);
    check_waiting_for("the coordinator's Start");
    refit_close(eng);
}

/* A receiver with local_copy = off handed local copies (a coordinator that thinks otherwise),
 * and one with local_copy = auto whose publisher's socket is gone: the slice is refused with
 * the reason, and the status says it. */
static void local_slice_refused(const char *local_copy, const char *want)
{
    refit_client *eng;
    slices s;
    size_t m;
    json_t *st;

    start_node("receiver", "--local-copy", local_copy, NULL);
    m = mark();
    test_loop_run(&H.l, do_coord_up, NULL);
    eng = client(REFIT_ENGINE, "e0");
    build_slices_for(wait_complete_inventory(m), RF_DST, true, &s);
    /* The node handles each frame on its loop before give_slices returns: the refusal is in
     * its status by then. */
    give_slices(&s);
    st = node_status();
    cr_assert(strstr(json_string_value(json_object_get(st, "last_error")), want),
              "no '%s' in the node's last_error: %s", want,
              json_string_value(json_object_get(st, "last_error")));
    cr_assert_eq(json_integer_value(json_object_get(st, "plan_local_copies")), 0);
    json_decref(st);
    refit_close(eng);
}

Test(node, local_copies_for_a_receiver_with_local_copy_off_are_refused)
{
    local_slice_refused("off", "runs with local_copy = off");
}

Test(node, local_copies_from_a_publisher_that_cannot_be_reached_are_refused)
{
    local_slice_refused("auto", "/nowhere");
}

Test(node, a_cluster_key_too_short_for_the_data_path_stops_start_up)
{
    char *argv[] = {"test_node", "--config", H.conf, "--coordinator-addr", H.coord_addr,
                    "--socket", H.sock, "--status-listen", "", "--data-listen", "127.0.0.1:0"};
    rf_node_opts o = {0};
    rf_cfg_next next;
    rf_err err = {0};
    rf_node *n = NULL;

    cr_assert_eq(rf_daemon_cfg_load(&H.cfg, RF_DAEMON_PUBLISHER, 11, argv, &next, &err), 0,
                 "%s", err.msg);
    H.key.len = RF_XFER_TCP_KEY_MIN - 1;
    o.cfg = &H.cfg;
    o.key = &H.key;
    o.daemon_id = DAEMON_ID;
    o.metrics = H.metrics;
    cr_assert_eq(rf_node_start(&H.l.loop, &o, &n, &err), -EINVAL);
    cr_assert_null(n);
    cr_assert(strstr(err.msg, "the cluster key (31 bytes) cannot authenticate data connections; "
                     "it needs at least 32 bytes"), "%s", err.msg);
}

/* The cluster-wide keys: the node reports its own in every inventory and runs each refit with
 * those its Start carries (the coordinator's), whatever its own file says. */
Test(node, a_refit_runs_with_the_verify_and_deadline_its_start_carries)
{
    Refit__ClusterConfig cc = REFIT__CLUSTER_CONFIG__INIT;
    const Refit__Inventory *inv;
    const Refit__Envelope *e;
    refit_client *t;
    slices s = {0};
    json_t *st;
    size_t m;

    start_node("publisher", "--verify", "off", "--staging-mib", "64", NULL);
    test_loop_run(&H.l, do_coord_up, NULL);
    m = mark();
    t = client(REFIT_TRAINER, "t0");
    inv = wait_complete_inventory(m);
    cr_assert_not_null(inv->config, "the inventory carries no cluster-wide keys");
    cr_assert_eq(inv->config->verify, RF_VERIFY_OFF);
    cr_assert_eq(inv->config->transport, RF_TRANSPORT_TCP);
    cr_assert_eq(inv->config->refit_timeout_s, 1);
    cr_assert_eq(inv->config->staging_mib, 64);
    cr_assert_eq(inv->config->heartbeat_ms, 1000);
    cr_assert_eq(inv->config->peer_timeout_ms, 10000);
    cr_assert_str_eq(inv->config->config_file, H.conf);
    build_slices(inv, &s);
    OK(refit_publish(t, 1), t);
    give_slices(&s);
    cr_assert(status_plan_is(s.plan_id));
    /* The coordinator verifies in full: the Done carries the digest, though this daemon's
     * file says off (its data path fails at the receiver's closed port: the Done is a failed
     * one, with what moved). */
    cc.verify = RF_VERIFY_FULL;
    cc.refit_timeout_s = 2;
    m = mark();
    send_start_with(1, s.plan_id, &cc);
    e = wait_sent_ms(m, REFIT__ENVELOPE__BODY_DONE, 10000);
    cr_assert_not_null(e, "no Done within 10 s");
    cr_assert(strstr(e->done->error, "data path of version 1 failed"), "%s", e->done->error);
    cr_assert_eq(e->done->digest.len, 32, "verify = full from Start, but the Done has no digest");
    st = node_status();
    cr_assert_str_eq(json_string_value(json_object_get(st, "verify")), "full");
    cr_assert_eq(json_integer_value(json_object_get(st, "refit_timeout_s")), 2);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(json_object_get(
                     st, "adopted"), "verify"), "config")), "off");
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(json_object_get(
                     st, "adopted"), "verify"), "cluster")), "full");
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(json_object_get(
                 st, "adopted"), "refit_timeout_s"), "config")), 1);
    json_decref(st);
    /* A coordinator that sends none: this daemon's own verify, off, and no digest. */
    m = mark();
    send_start(1, s.plan_id);
    e = wait_sent_ms(m, REFIT__ENVELOPE__BODY_DONE, 10000);
    cr_assert_not_null(e, "no Done within 10 s");
    cr_assert(strstr(e->done->error, "data path of version 1 failed"), "%s", e->done->error);
    cr_assert_eq(e->done->digest.len, 0, "verify = off, but the Done has a digest");
    st = node_status();
    cr_assert_str_eq(json_string_value(json_object_get(st, "verify")), "off");
    cr_assert_eq(json_object_size(json_object_get(st, "adopted")), 0);
    json_decref(st);
    /* Values this daemon cannot run with: the Start is refused, naming them. */
    cc.verify = 3;
    m = mark();
    send_start_with(1, s.plan_id, &cc);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_DONE);
    cr_assert(!e->done->ok);
    cr_assert(strstr(e->done->error, "Start(1) refused: it carries verify = 3, which this "
                     "daemon does not know"), "%s", e->done->error);
    cc.verify = RF_VERIFY_SAMPLE;
    cc.refit_timeout_s = 0;
    m = mark();
    send_start_with(1, s.plan_id, &cc);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_DONE);
    cr_assert(strstr(e->done->error, "Start(1) refused: it carries refit_timeout_s = 0, outside "
                     "1 .. 86400"), "%s", e->done->error);
    cc.refit_timeout_s = 86401;
    m = mark();
    send_start_with(1, s.plan_id, &cc);
    e = wait_sent(m, REFIT__ENVELOPE__BODY_DONE);
    cr_assert(strstr(e->done->error, "refit_timeout_s = 86401, outside"), "%s", e->done->error);
    /* A refused Start changes nothing the daemon runs with. */
    cr_assert_eq(status_int("refit_timeout_s"), 1);
    refit_close(t);
}
