/* tests/unit/test_coord.c - the coordinator's state machine driven through its message handlers:
 * the test plays two publishers and a receiver (fake peers, no sockets) whose inventories are a
 * real model's ranks, so the real planner runs on the loop's thread pool; every envelope the
 * coordinator sends is recorded, and its state read back from its status document. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../publisherd/coordinator.h"
#include "member_inv.h"
#include "model.h"
#include "slice.h"
#include "version.h"

#define NPUB 2
#define NRECV 1
#define NMEM (NPUB + NRECV)
#define RECV0 NPUB /* member index of receiver 0 */

/* What the coordinator sent, in order, to whom. */
typedef struct sent {
    uint32_t member;
    Refit__Envelope *env; /* unpacked from the bytes the coordinator's envelope packs to */
} sent;

typedef struct fake_peer {
    uint32_t member;
} fake_peer;

typedef struct harness {
    uv_loop_t loop;
    uv_timer_t guard;
    bool guard_fired;
    char dir[64], conf[96];
    rf_daemon_cfg cfg;
    rf_peer_key key;
    rf_metrics *metrics;
    rf_coord *c;
    fake_peer peers[NMEM];
    uint64_t daemon_id[NMEM];
    uint64_t inv_gen[NMEM];
    sent *out;
    size_t nout, cap;
    rf_model *model;
    Refit__Inventory inv[NMEM]; /* each member's complete inventory */
} harness;

static harness H;

/* ---- recording ------------------------------------------------------------------------- */

static int record(void *peer, const Refit__Envelope *env, void *arg)
{
    fake_peer *p = peer;
    size_t len = refit__envelope__get_packed_size(env);
    uint8_t *buf = malloc(len ? len : 1);

    (void)arg;
    cr_assert_not_null(buf);
    refit__envelope__pack(env, buf);
    if (H.nout == H.cap) {
        H.cap = H.cap ? 2 * H.cap : 64;
        H.out = realloc(H.out, H.cap * sizeof(*H.out));
        cr_assert_not_null(H.out);
    }
    H.out[H.nout].member = p->member;
    H.out[H.nout].env = refit__envelope__unpack(NULL, len, buf);
    cr_assert_not_null(H.out[H.nout].env, "an envelope to member %u does not unpack", p->member);
    H.nout++;
    free(buf);
    return 0;
}

/* How many envelopes of kind went to member since mark (an index into the record). */
static size_t count_since(size_t mark, uint32_t member, Refit__Envelope__BodyCase kind)
{
    size_t i, n = 0;

    for (i = mark; i < H.nout; i++)
        if (H.out[i].member == member && H.out[i].env->body_case == kind)
            n++;
    return n;
}

static size_t count(uint32_t member, Refit__Envelope__BodyCase kind)
{
    return count_since(0, member, kind);
}

/* The last envelope of kind to member (NULL: none since mark); *at gets its index. */
static const Refit__Envelope *last_since(size_t mark, uint32_t member,
                                         Refit__Envelope__BodyCase kind, size_t *at)
{
    size_t i;

    for (i = H.nout; i-- > mark;)
        if (H.out[i].member == member && H.out[i].env->body_case == kind) {
            if (at)
                *at = i;
            return H.out[i].env;
        }
    return NULL;
}

static const Refit__Envelope *last(uint32_t member, Refit__Envelope__BodyCase kind)
{
    return last_since(0, member, kind, NULL);
}

/* No Start went to anyone since mark. */
static void no_start_since(size_t mark, const char *why)
{
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count_since(mark, m, REFIT__ENVELOPE__BODY_START), 0,
                     "member %u got a Start, though %s", m, why);
}

/* ---- the coordinator's status ------------------------------------------------------------- */

static json_t *cluster(void)
{
    json_t *st = json_object();

    rf_coord_status(st, H.c);
    return st;
}

static const char *st_state(void)
{
    static char buf[32];
    json_t *st = cluster();

    snprintf(buf, sizeof(buf), "%s",
             json_string_value(json_object_get(json_object_get(st, "cluster"), "state")));
    json_decref(st);
    return buf;
}

static json_int_t st_int(const char *key)
{
    json_t *st = cluster();
    json_int_t v = json_integer_value(json_object_get(json_object_get(st, "cluster"), key));

    json_decref(st);
    return v;
}

static bool st_plan_ready(void)
{
    json_t *st = cluster();
    bool v = json_is_true(json_object_get(
        json_object_get(json_object_get(st, "cluster"), "plan"), "ready"));

    json_decref(st);
    return v;
}

static json_int_t st_ready(uint32_t pub)
{
    json_t *st = cluster();
    json_t *m = json_array_get(json_object_get(json_object_get(st, "cluster"), "members"), pub);
    json_int_t v = json_integer_value(json_object_get(m, "ready"));

    json_decref(st);
    return v;
}

static void st_last_error(char *buf, size_t len)
{
    json_t *st = cluster();

    snprintf(buf, len, "%s", json_string_value(json_object_get(json_object_get(st, "cluster"),
                                                               "last_error")));
    json_decref(st);
}

/* ---- running the loop ------------------------------------------------------------------------ */

static void guard_cb(uv_timer_t *t)
{
    (void)t;
    H.guard_fired = true;
}

/* Runs the loop until pred() holds, at most ms; returns whether it held. */
static bool run_until(bool (*pred)(void), uint64_t ms)
{
    H.guard_fired = false;
    uv_timer_start(&H.guard, guard_cb, ms, 0);
    while (!pred() && !H.guard_fired)
        uv_run(&H.loop, UV_RUN_ONCE);
    uv_timer_stop(&H.guard);
    return pred();
}

/* Every member holds a whole plan slice (its last frame) sent since plan_mark. */
static size_t plan_mark;
static bool slices_arrived(void)
{
    for (uint32_t m = 0; m < NMEM; m++) {
        bool got = false;

        for (size_t i = plan_mark; i < H.nout; i++)
            if (H.out[i].member == m &&
                H.out[i].env->body_case == REFIT__ENVELOPE__BODY_PLAN_SLICE &&
                H.out[i].env->plan_slice->last)
                got = true;
        if (!got)
            return false;
    }
    return true;
}

static void wait_plan(void)
{
    cr_assert(run_until(slices_arrived, 20000), "no plan slice reached every member in 20 s");
    cr_assert(st_plan_ready(), "slices went out but the status says the plan is not ready");
    plan_mark = H.nout;
}

/* ---- inventories of real ranks ------------------------------------------------------------ */

/* Trainers tp=2 (rank 0 on publisher 0, rank 1 on publisher 1), engines tp=2 on receiver 0. */
static void make_inventories(void)
{
    rf_model *full = NULL;
    rf_err err = {0};
    rf_inv *inv;

    cr_assert_eq(rf_model_load("qwen3-0.6b", &full, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(full, 16, &H.model, &err), 0, "%s", err.msg);
    rf_model_free(full);
    for (uint32_t m = 0; m < NMEM; m++) {
        rf_side side = m < NPUB ? RF_SRC : RF_DST;

        inv = m < NPUB ? test_member_inv(H.model, "tp=2", side, (int)m, 1)
                     : test_member_inv(H.model, "tp=2", side, 0, 2);
        H.inv_gen[m] = 1;
        cr_assert_eq(rf_slice_inv_pack(inv, side, H.inv_gen[m], &H.inv[m]), 0);
        rf_inv_free(inv);
    }
}

/* ---- the fixture -------------------------------------------------------------------------- */

/* Starts the coordinator with these flags after the common ones (NULL-terminated). */
static void start_coord(const char *first, ...)
{
    char *argv[48] = {"test_coord", "--config", H.conf, "--coordinator",
                      "--coordinator-addr", "127.0.0.1:0", "--publishers", "2",
                      "--receivers", "1", "--node", "coord", "--status-listen", "",
                      "--busy-poll-ms", "0"};
    int argc = 16;
    rf_cfg_next next;
    rf_err err = {0};
    va_list ap;

    va_start(ap, first);
    for (const char *a = first; a; a = va_arg(ap, const char *))
        argv[argc++] = (char *)a;
    va_end(ap);
    cr_assert_eq(rf_daemon_cfg_load(&H.cfg, RF_DAEMON_PUBLISHER, argc, argv, &next, &err), 0,
                 "%s", err.msg);
    cr_assert_eq(rf_coord_start(&H.loop, &H.cfg, &H.key, 99, H.metrics, &H.c, &err), 0, "%s",
                 err.msg);
    rf_coord__set_send(H.c, record, NULL);
}

static void setup(void)
{
    FILE *f;

    memset(&H, 0, sizeof(H));
    snprintf(H.dir, sizeof(H.dir), "/tmp/rf_coord_XXXXXX");
    cr_assert(mkdtemp(H.dir));
    snprintf(H.conf, sizeof(H.conf), "%s/empty.conf", H.dir);
    f = fopen(H.conf, "w");
    cr_assert_not_null(f);
    fclose(f);
    H.key.len = 32;
    memset(H.key.bytes, 0x5a, H.key.len);
    H.metrics = rf_metrics_new();
    cr_assert_not_null(H.metrics);
    cr_assert_eq(uv_loop_init(&H.loop), 0);
    uv_timer_init(&H.loop, &H.guard);
    for (uint32_t m = 0; m < NMEM; m++) {
        H.peers[m].member = m;
        H.daemon_id[m] = 1000 + m;
    }
    make_inventories();
}

static void teardown(void)
{
    if (H.c)
        rf_coord_close(H.c);
    uv_close((uv_handle_t *)&H.guard, NULL);
    uv_run(&H.loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&H.loop), 0, "loop closed with handles open");
    for (size_t i = 0; i < H.nout; i++)
        refit__envelope__free_unpacked(H.out[i].env, NULL);
    free(H.out);
    for (uint32_t m = 0; m < NMEM; m++)
        rf_slice_inv_msg_free(&H.inv[m]);
    rf_model_free(H.model);
    rf_metrics_free(H.metrics);
    rf_daemon_cfg_free(&H.cfg);
    unlink(H.conf);
    rmdir(H.dir);
}

TestSuite(coord, .init = setup, .fini = teardown, .timeout = 60);

/* ---- what members say ------------------------------------------------------------------------ */

static int join(uint32_t m)
{
    Refit__Hello h = REFIT__HELLO__INIT;
    char node[32], addr[32];
    rf_err err = {0};

    snprintf(node, sizeof(node), "%s%u", m < NPUB ? "pub" : "recv", m < NPUB ? m : m - NPUB);
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", 20000 + m);
    h.role = m < NPUB ? REFIT__ROLE__ROLE_PUBLISHER : REFIT__ROLE__ROLE_RECEIVER;
    h.index = m < NPUB ? m : m - NPUB;
    h.node = node;
    h.data_addr = addr;
    h.daemon_id = H.daemon_id[m];
    return rf_coord__member_up(H.c, &h, &H.peers[m], "test", &err);
}

static void inventory(uint32_t m, uint64_t committed)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;

    H.inv[m].generation = H.inv_gen[m];
    H.inv[m].committed = committed;
    env.body_case = REFIT__ENVELOPE__BODY_INVENTORY;
    env.inventory = &H.inv[m];
    rf_coord__envelope(H.c, m, &env);
}

static void inventory_incomplete(uint32_t m)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Inventory inv = REFIT__INVENTORY__INIT;

    inv.generation = ++H.inv_gen[m];
    inv.complete = false;
    env.body_case = REFIT__ENVELOPE__BODY_INVENTORY;
    env.inventory = &inv;
    rf_coord__envelope(H.c, m, &env);
}

static void ready(uint32_t m, uint64_t v)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Ready r = REFIT__READY__INIT;

    r.version = v;
    env.body_case = REFIT__ENVELOPE__BODY_READY;
    env.ready = &r;
    rf_coord__envelope(H.c, m, &env);
}

static void idle(uint32_t m, bool yes, uint64_t v)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Idle i = REFIT__IDLE__INIT;

    i.ready = yes;
    i.version = v;
    env.body_case = REFIT__ENVELOPE__BODY_IDLE;
    env.idle = &i;
    rf_coord__envelope(H.c, m, &env);
}

static void trigger(uint32_t m, uint64_t v)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Trigger t = REFIT__TRIGGER__INIT;

    t.version = v;
    env.body_case = REFIT__ENVELOPE__BODY_TRIGGER;
    env.trigger = &t;
    rf_coord__envelope(H.c, m, &env);
}

/* Done of version v; the digest is fill repeated (members' digests XOR to zero when the
 * fills do). */
static void done(uint32_t m, uint64_t v, bool ok, uint8_t fill, const char *error)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Done d = REFIT__DONE__INIT;
    uint8_t digest[32];

    memset(digest, fill, sizeof(digest));
    d.version = v;
    d.ok = ok;
    d.error = (char *)(error ? error : "");
    d.bytes = 1000;
    d.digest.data = digest;
    d.digest.len = 32;
    env.body_case = REFIT__ENVELOPE__BODY_DONE;
    env.done = &d;
    rf_coord__envelope(H.c, m, &env);
}

/* Every member joined and sent its inventory (committed 0), the plan is built, the receiver's
 * engines are idle. */
static void cluster_up(void)
{
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    for (uint32_t m = 0; m < NMEM; m++)
        inventory(m, 0);
    wait_plan();
    idle(RECV0, true, 0);
}

/* Both publishers ready with v: Start(v) goes out; checks it and returns the record's mark. */
static size_t start(uint64_t v)
{
    size_t mark = H.nout;
    const Refit__Envelope *e;

    ready(0, v);
    ready(1, v);
    for (uint32_t m = 0; m < NMEM; m++) {
        cr_assert_eq(count_since(mark, m, REFIT__ENVELOPE__BODY_START), 1,
                     "member %u did not get one Start(%llu)", m, (unsigned long long)v);
        e = last(m, REFIT__ENVELOPE__BODY_START);
        cr_assert_eq(e->start->version, v);
    }
    cr_assert_str_eq(st_state(), "running");
    cr_assert_eq(st_int("version_in_flight"), (json_int_t)v);
    return mark;
}

/* The last Blocked member m got since mark; NULL when none. */
static const char *blocked_since(size_t mark, uint32_t m)
{
    const Refit__Envelope *e = last_since(mark, m, REFIT__ENVELOPE__BODY_BLOCKED, NULL);

    return e ? e->blocked->reason : NULL;
}

/* Every member's last Blocked since mark holds want ("" : the block cleared), and the
 * coordinator's status says the same. */
static void check_blocked(size_t mark, const char *want)
{
    json_t *st = cluster(), *b = json_object_get(json_object_get(st, "cluster"), "blocked");

    for (uint32_t m = 0; m < NMEM; m++) {
        const char *got = blocked_since(mark, m);

        cr_assert_not_null(got, "member %u was not told whether refits are blocked", m);
        if (want[0])
            cr_assert(strstr(got, want), "member %u was told it is blocked by: '%s'", m, got);
        else
            cr_assert_str_eq(got, "", "member %u is still told refits are blocked", m);
    }
    if (want[0])
        cr_assert(json_is_string(b) && strstr(json_string_value(b), want),
                  "the status says blocked: %s", json_is_string(b) ? json_string_value(b)
                                                                   : "null");
    else
        cr_assert(json_is_null(b), "the status still says blocked: %s", json_string_value(b));
    json_decref(st);
}

static size_t block_mark;
static bool blocked_everywhere(void)
{
    for (uint32_t m = 0; m < NMEM; m++) {
        const char *got = blocked_since(block_mark, m);

        if (!got || !got[0])
            return false;
    }
    return true;
}

/* ---- membership and the plan ---------------------------------------------------------------- */

Test(coord, plan_waits_for_every_member_and_every_complete_inventory)
{
    start_coord(NULL);
    cr_assert_eq(join(0), 0);
    cr_assert_eq(join(1), 0);
    inventory(0, 0);
    inventory(1, 0);
    /* Receiver 0 has not joined: no plan, whatever the loop does. */
    uv_run(&H.loop, UV_RUN_NOWAIT);
    cr_assert(!st_plan_ready());
    cr_assert_eq(join(RECV0), 0);
    inventory_incomplete(RECV0);
    uv_run(&H.loop, UV_RUN_NOWAIT);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count(m, REFIT__ENVELOPE__BODY_PLAN_SLICE), 0,
                     "member %u got a plan slice while receiver 0's inventory is incomplete", m);
    cr_assert(!st_plan_ready());
    /* The last complete inventory builds the plan, and every member gets its slice. */
    inventory(RECV0, 0);
    wait_plan();
    for (uint32_t m = 0; m < NMEM; m++) {
        const Refit__Envelope *e = last(m, REFIT__ENVELOPE__BODY_PLAN_SLICE);

        cr_assert_eq(e->plan_slice->generation, H.inv_gen[m]);
        cr_assert_eq(e->plan_slice->plan_id.len, 32);
        cr_assert_eq(e->plan_slice->n_peers, NMEM, "a slice names every member's data address");
    }
    /* A member whose inventory goes incomplete takes the plan away. */
    inventory_incomplete(1);
    cr_assert(!st_plan_ready());
}

Test(coord, a_plan_that_fails_blocks_every_member_until_an_inventory_changes)
{
    Refit__TensorDesc *t = H.inv[RECV0].tensors[0];
    uint32_t dtype = t->dtype;
    char want[256];

    /* The engines hold their first tensor in another dtype than the trainers. */
    t->dtype = dtype == RF_DT_BF16 ? RF_DT_FP16 : RF_DT_BF16;
    snprintf(want, sizeof(want), "the coordinator cannot plan: inventory of daemon %u: tensor "
             "%s registered as ", RECV0, t->name);
    start_coord(NULL);
    block_mark = H.nout;
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    for (uint32_t m = 0; m < NMEM; m++)
        inventory(m, 0);
    cr_assert(run_until(blocked_everywhere, 20000), "no member was told the plan failed");
    check_blocked(block_mark, want);
    cr_assert(strstr(blocked_since(block_mark, 0), "both sides must agree on dtype and global "
                     "shape"), "told: %s", blocked_since(block_mark, 0));
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count(m, REFIT__ENVELOPE__BODY_PLAN_SLICE), 0);
    /* The same reason is not sent again while it holds. */
    block_mark = H.nout;
    ready(0, 1);
    ready(1, 1);
    cr_assert_eq(count_since(block_mark, 0, REFIT__ENVELOPE__BODY_BLOCKED), 0);
    no_start_since(block_mark, "the plan failed");
    /* The engines register again with the trainers' dtype: at once nothing blocks, before
     * the plan is even built, and then it builds. */
    t->dtype = dtype;
    H.inv_gen[RECV0]++;
    block_mark = H.nout;
    inventory(RECV0, 0);
    check_blocked(block_mark, "");
    wait_plan();
    check_blocked(block_mark, "");
}

/* The coordinator's status says what the cluster waits for. */
static void check_waiting_for(const char *want)
{
    json_t *st = cluster(), *w = json_object_get(json_object_get(st, "cluster"), "waiting_for");

    if (want)
        cr_assert_str_eq(json_is_string(w) ? json_string_value(w) : "(null)", want);
    else
        cr_assert(json_is_null(w), "waiting for: %s", json_string_value(w));
    json_decref(st);
}

Test(coord, the_status_says_what_the_cluster_waits_for)
{
    start_coord(NULL);
    check_waiting_for("inventories: publisher 0 never connected; publisher 1 never connected; "
                      "receiver 0 never connected");
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    inventory(0, 0);
    inventory(1, 0);
    check_waiting_for("inventories: receiver 0 (recv0) sent no inventory yet");
    inventory_incomplete(RECV0);
    check_waiting_for("inventories: receiver 0 (recv0) incomplete (its clients have not all "
                      "registered and sealed)");
    inventory(RECV0, 0);
    check_waiting_for("the plan, being built");
    wait_plan();
    check_waiting_for("receive quorum: receiver 0 (recv0): its gated engines have not consumed "
                      "version 0");
    idle(RECV0, true, 0);
    check_waiting_for("publish quorum: publisher 0 (pub0): its trainers have published no "
                      "version after 0; publisher 1 (pub1): its trainers have published no "
                      "version after 0");
    ready(0, 1);
    check_waiting_for("publish quorum: publisher 0 (pub0) offers version 1; publisher 1 (pub1): "
                      "its trainers have published no version after 0");
    ready(1, 1);
    check_waiting_for("Done of version 1 from: publisher 0 (pub0) publisher 1 (pub1) receiver 0 "
                      "(recv0)");
    done(0, 1, true, 0, NULL);
    done(RECV0, 1, true, 0, NULL);
    check_waiting_for("Done of version 1 from: publisher 1 (pub1)");
    done(1, 1, true, 0, NULL);
    cr_assert_eq(st_int("committed"), 1);
    check_waiting_for("receive quorum: receiver 0 (recv0): its gated engines have not consumed "
                      "version 1");
    rf_coord__member_down(H.c, &H.peers[1], "killed");
    check_waiting_for("inventories: publisher 1 (pub1) disconnected");
}

Test(coord, members_outside_the_configuration_are_refused)
{
    Refit__Hello h = REFIT__HELLO__INIT;
    rf_err err = {0};
    fake_peer extra = {7};

    start_coord(NULL);
    h.node = "x";
    h.data_addr = "";
    h.role = REFIT__ROLE__ROLE_PUBLISHER;
    h.index = 2;
    cr_assert_eq(rf_coord__member_up(H.c, &h, &extra, "test", &err), -EINVAL);
    cr_assert(strstr(err.msg, "publisher index 2 is outside the configured publishers"), "%s",
              err.msg);
    h.role = REFIT__ROLE__ROLE_RECEIVER;
    h.index = 1;
    cr_assert_eq(rf_coord__member_up(H.c, &h, &extra, "test", &err), -EINVAL);
    cr_assert(strstr(err.msg, "receiver index 1 is outside"), "%s", err.msg);
    h.role = REFIT__ROLE__ROLE_COORDINATOR;
    h.index = 0;
    cr_assert_eq(rf_coord__member_up(H.c, &h, &extra, "test", &err), -EINVAL);
    cr_assert(strstr(err.msg, "cannot join as a member"), "%s", err.msg);
    cr_assert_eq(join(0), 0);
    h.role = REFIT__ROLE__ROLE_PUBLISHER;
    h.index = 0;
    cr_assert_eq(rf_coord__member_up(H.c, &h, &extra, "test", &err), -EEXIST);
    cr_assert(strstr(err.msg, "publisher index 0 is already connected"), "%s", err.msg);
    /* Nothing of the refused joins counts: the slot still belongs to the first. */
    rf_coord__member_down(H.c, &extra, "closed");
    cr_assert_eq(join(0), -EEXIST);
}

/* ---- Start: readiness and the receive quorum ------------------------------------------------ */

Test(coord, start_only_when_every_publisher_reports_the_same_version)
{
    size_t mark, at_recv, at_pub;
    const Refit__Envelope *e;
    char plan[65];
    json_t *st;

    start_coord(NULL);
    cluster_up();
    mark = H.nout;
    ready(0, 1);
    no_start_since(mark, "publisher 1 is not ready");
    ready(1, 2);
    no_start_since(mark, "the publishers offer versions 1 and 2");
    ready(0, 0);
    no_start_since(mark, "publisher 0 took its readiness back");
    cr_assert_str_eq(st_state(), "idle");
    ready(0, 2);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count_since(mark, m, REFIT__ENVELOPE__BODY_START), 1);
    e = last_since(mark, RECV0, REFIT__ENVELOPE__BODY_START, &at_recv);
    cr_assert_eq(e->start->version, 2);
    last_since(mark, 0, REFIT__ENVELOPE__BODY_START, &at_pub);
    cr_assert_lt(at_recv, at_pub, "receivers get Start before the publishers");
    /* Start names the plan the status shows. */
    st = cluster();
    snprintf(plan, sizeof(plan), "%s", json_string_value(json_object_get(
        json_object_get(json_object_get(st, "cluster"), "plan"), "id")));
    json_decref(st);
    for (int i = 0; i < 32; i++) {
        char hex[3];

        snprintf(hex, sizeof(hex), "%02x", e->start->plan_id.data[i]);
        cr_assert(strncmp(plan + 2 * i, hex, 2) == 0, "Start's plan id is not the status's %s",
                  plan);
    }
}

Test(coord, a_trainers_new_inventory_takes_its_readiness_away)
{
    size_t mark;

    start_coord(NULL);
    cluster_up();
    /* The receiver's engines hold the start back while readiness comes in. */
    idle(RECV0, false, 0);
    ready(0, 1);
    ready(1, 1);
    cr_assert_eq(st_ready(1), 1);
    /* Publisher 1's trainer re-registered: its readiness is gone with its old inventory. */
    H.inv_gen[1]++;
    inventory(1, 0);
    cr_assert_eq(st_ready(1), 0, "a new inventory keeps the readiness of the old clients");
    cr_assert_eq(st_ready(0), 1);
    wait_plan();
    mark = H.nout;
    idle(RECV0, true, 0);
    no_start_since(mark, "publisher 1 has not said it is ready since its new inventory");
    ready(1, 1);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count_since(mark, m, REFIT__ENVELOPE__BODY_START), 1);
}

Test(coord, the_receive_quorum_holds_the_next_start)
{
    size_t mark;

    start_coord(NULL);
    cluster_up();
    start(2);
    done(0, 2, true, 0x11, NULL);
    done(1, 2, true, 0x11, NULL);
    done(RECV0, 2, true, 0x00, NULL);
    for (uint32_t m = 0; m < NMEM; m++) {
        cr_assert_eq(count(m, REFIT__ENVELOPE__BODY_COMMIT), 1);
        cr_assert_eq(last(m, REFIT__ENVELOPE__BODY_COMMIT)->commit->version, 2);
    }
    cr_assert_eq(st_int("committed"), 2);
    cr_assert_str_eq(st_state(), "idle");
    /* After the commit the receiver must say again that its engines consumed version 2. */
    mark = H.nout;
    ready(0, 3);
    ready(1, 3);
    no_start_since(mark, "the receiver's engines have not consumed version 2");
    idle(RECV0, false, 1);
    no_start_since(mark, "the receiver says its engines are still busy");
    idle(RECV0, true, 2);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count_since(mark, m, REFIT__ENVELOPE__BODY_START), 1);
    cr_assert_eq(st_int("version_in_flight"), 3);
}

/* ---- Done: commit, abort, settle ---------------------------------------------------------- */

Test(coord, equal_digests_commit_and_differing_digests_abort_at_once)
{
    char err[256];

    start_coord(NULL);
    cluster_up();
    start(1);
    done(0, 1, true, 0x3c, NULL);
    done(1, 1, true, 0x00, NULL);
    cr_assert_eq(count(0, REFIT__ENVELOPE__BODY_COMMIT), 0, "committed before every Done");
    done(RECV0, 1, true, 0x3d, NULL);
    for (uint32_t m = 0; m < NMEM; m++) {
        cr_assert_eq(count(m, REFIT__ENVELOPE__BODY_COMMIT), 0);
        cr_assert_eq(last(m, REFIT__ENVELOPE__BODY_ABORT)->abort->version, 1);
        cr_assert(strstr(last(m, REFIT__ENVELOPE__BODY_ABORT)->abort->reason,
                         "verification failed"));
    }
    st_last_error(err, sizeof(err));
    cr_assert(strstr(err, "version 1 aborted: verification failed"), "%s", err);
    /* Every Done is in: nothing to settle, the next version may start at once. */
    cr_assert_str_eq(st_state(), "idle");
    cr_assert_eq(st_int("committed"), 0);
    start(2);
    done(0, 2, true, 0x3c, NULL);
    done(1, 2, true, 0x01, NULL);
    done(RECV0, 2, true, 0x3d, NULL);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(last(m, REFIT__ENVELOPE__BODY_COMMIT)->commit->version, 2);
    cr_assert_eq(st_int("committed"), 2);
}

Test(coord, a_failed_done_aborts_and_settles_until_every_done)
{
    size_t mark;

    start_coord(NULL);
    cluster_up();
    start(1);
    done(1, 1, false, 0, "data path of version 1 failed: connection reset by pub0");
    for (uint32_t m = 0; m < NMEM; m++) {
        const Refit__Envelope *e = last(m, REFIT__ENVELOPE__BODY_ABORT);

        cr_assert_not_null(e, "member %u got no Abort", m);
        cr_assert_eq(e->abort->version, 1);
        cr_assert(strstr(e->abort->reason, "publisher 1 (pub1): data path of version 1 failed"),
                  "%s", e->abort->reason);
    }
    cr_assert_str_eq(st_state(), "aborting");
    cr_assert_eq(st_ready(0), 0, "readiness survives an abort");
    cr_assert_eq(st_ready(1), 0);
    /* While the others' data paths may still run, nothing starts, readiness or not. */
    mark = H.nout;
    ready(0, 1);
    ready(1, 1);
    no_start_since(mark, "publisher 0 and receiver 0 have not reported Done of the aborted "
                   "version");
    done(0, 1, false, 0, "aborted");
    cr_assert_str_eq(st_state(), "aborting");
    done(RECV0, 1, true, 0, NULL);
    /* Settled. The readiness sent during the settle was after the abort, so it counts. */
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count_since(mark, m, REFIT__ENVELOPE__BODY_START), 1);
    cr_assert_eq(st_int("version_in_flight"), 1);
}

Test(coord, readiness_must_be_reported_again_after_an_abort)
{
    size_t mark;

    start_coord(NULL);
    cluster_up();
    start(1);
    done(RECV0, 1, false, 0, "data path of version 1 failed: timed out");
    done(0, 1, false, 0, "aborted");
    done(1, 1, false, 0, "aborted");
    cr_assert_str_eq(st_state(), "idle");
    mark = H.nout;
    /* Settled, the plan stands, the engines are idle: only readiness is missing. */
    uv_run(&H.loop, UV_RUN_NOWAIT);
    no_start_since(mark, "no publisher said it is ready since the abort");
    ready(0, 1);
    no_start_since(mark, "only publisher 0 said it is ready since the abort");
    ready(1, 1);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count_since(mark, m, REFIT__ENVELOPE__BODY_START), 1);
}

Test(coord, the_settle_ends_without_a_silent_members_done)
{
    start_coord(NULL);
    cluster_up();
    start(1);
    done(0, 1, false, 0, "data path of version 1 failed");
    cr_assert_str_eq(st_state(), "aborting");
    /* Publisher 1 and receiver 0 never answer: the settle timer ends the wait. */
    cr_assert(rf_coord__expire(H.c), "no settle timer was pending");
    cr_assert_str_eq(st_state(), "idle");
    cr_assert(!rf_coord__expire(H.c), "a timer is still pending after the settle");
    /* A late Done of the aborted version changes nothing. */
    done(1, 1, true, 0, NULL);
    cr_assert_str_eq(st_state(), "idle");
    start(2);
}

Test(coord, the_deadline_aborts_naming_the_silent_members)
{
    const Refit__Envelope *e;

    start_coord(NULL);
    cluster_up();
    start(1);
    done(0, 1, true, 0, NULL);
    cr_assert(rf_coord__expire(H.c), "no deadline was pending while a refit ran");
    e = last(0, REFIT__ENVELOPE__BODY_ABORT);
    cr_assert_not_null(e);
    cr_assert(strstr(e->abort->reason, "no Done within 600 s from: publisher 1 (pub1) "
                     "receiver 0 (recv0)"), "%s", e->abort->reason);
    cr_assert_str_eq(st_state(), "aborting");
    done(1, 1, false, 0, "aborted");
    done(RECV0, 1, false, 0, "aborted");
    cr_assert_str_eq(st_state(), "idle");
}

static bool abort_sent(void)
{
    return count(RECV0, REFIT__ENVELOPE__BODY_ABORT) > 0;
}

Test(coord, the_deadline_timer_fires_after_refit_timeout_s)
{
    uint64_t t0, ms;

    start_coord("--refit-timeout-s", "1", NULL);
    cluster_up();
    start(1);
    t0 = uv_hrtime();
    /* The coordinator's deadline is refit_timeout_s plus one second, so that a member's own
     * data-path deadline (refit_timeout_s) reports first. */
    cr_assert(run_until(abort_sent, 5000), "no Abort within 5 s of a 1 s refit timeout");
    ms = (uv_hrtime() - t0) / 1000000;
    cr_assert_geq(ms, 1900, "the deadline fired after %llu ms", (unsigned long long)ms);
    cr_assert(strstr(last(RECV0, REFIT__ENVELOPE__BODY_ABORT)->abort->reason,
                     "no Done within 1 s"));
}

Test(coord, a_member_lost_mid_refit_aborts_and_the_plan_waits_for_it)
{
    const Refit__Envelope *e;

    start_coord(NULL);
    cluster_up();
    start(1);
    done(0, 1, true, 0, NULL);
    rf_coord__member_down(H.c, &H.peers[RECV0], "heartbeat timeout");
    e = last(0, REFIT__ENVELOPE__BODY_ABORT);
    cr_assert_not_null(e, "losing a member mid-refit did not abort");
    cr_assert(strstr(e->abort->reason, "lost receiver 0 (recv0): heartbeat timeout"), "%s",
              e->abort->reason);
    cr_assert_eq(count(RECV0, REFIT__ENVELOPE__BODY_ABORT), 0, "the lost member was sent to");
    cr_assert(!st_plan_ready(), "the plan survived a member's loss");
    cr_assert_str_eq(st_state(), "aborting");
    done(1, 1, false, 0, "aborted");
    cr_assert_str_eq(st_state(), "idle", "the lost member's Done was waited for");
    /* It comes back (same process): its inventory makes the plan again. */
    cr_assert_eq(join(RECV0), 0);
    inventory(RECV0, 0);
    wait_plan();
    idle(RECV0, true, 0);
    start(2);
}

/* ---- versions --------------------------------------------------------------------------------- */

static void expect_error(uint32_t m, size_t mark, const char *text)
{
    const Refit__Envelope *e = last_since(mark, m, REFIT__ENVELOPE__BODY_ERROR, NULL);

    cr_assert_not_null(e, "member %u got no Error (wanted '%s')", m, text);
    cr_assert_eq(e->error->code, -ERANGE);
    cr_assert(strstr(e->error->message, text), "'%s' lacks '%s'", e->error->message, text);
}

Test(coord, versions_outside_the_window_are_refused_with_an_error)
{
    const uint64_t step = RF_VERSION_MAX_STEP;
    size_t mark;

    start_coord(NULL);
    cluster_up();
    start(5);
    done(0, 5, true, 0, NULL);
    done(1, 5, true, 0, NULL);
    done(RECV0, 5, true, 0, NULL);
    cr_assert_eq(st_int("committed"), 5);
    idle(RECV0, true, 5);

    mark = H.nout;
    ready(0, 5);
    expect_error(0, mark, "Ready of version 5 refused: a version must be newer than the "
                 "committed version 5");
    cr_assert_eq(st_ready(0), 0);
    mark = H.nout;
    ready(0, 5 + step + 1);
    expect_error(0, mark, "at most 4294967296 ahead");
    cr_assert_eq(st_ready(0), 0);
    mark = H.nout;
    trigger(RECV0, 3);
    expect_error(RECV0, mark, "Trigger of version 3 refused");
    trigger(1, 5 + step + 1);
    expect_error(1, mark, "Trigger of version 4294967302 refused");
    no_start_since(mark, "every version offered lies outside (5, 5 + 2^32]");
    cr_assert_str_eq(st_state(), "idle");
    /* The edge of the window is allowed. */
    mark = start(5 + step);
    cr_assert_eq(count_since(mark, 0, REFIT__ENVELOPE__BODY_ERROR), 0);
}

Test(coord, an_operator_trigger_starts_without_readiness_and_an_abort_consumes_it)
{
    size_t mark;

    start_coord(NULL);
    cluster_up();
    mark = H.nout;
    trigger(RECV0, 4);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(last_since(mark, m, REFIT__ENVELOPE__BODY_START, NULL)->start->version, 4);
    done(0, 4, false, 0, "trainer memory gone");
    done(1, 4, false, 0, "aborted");
    done(RECV0, 4, false, 0, "aborted");
    mark = H.nout;
    cr_assert_str_eq(st_state(), "idle");
    uv_run(&H.loop, UV_RUN_NOWAIT);
    no_start_since(mark, "the trigger of the aborted version 4 was consumed by the abort");
}

Test(coord, a_restarted_coordinator_continues_from_the_members_committed_version)
{
    size_t mark;

    start_coord(NULL);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    inventory(0, 7);
    inventory(1, 6);
    cr_assert_eq(st_int("committed"), 7);
    inventory(RECV0, 7);
    wait_plan();
    idle(RECV0, true, 7);
    mark = H.nout;
    ready(0, 7);
    expect_error(0, mark, "newer than the committed version 7");
    ready(1, 7);
    no_start_since(mark, "version 7 is committed already");
    start(8);
}

/* ---- status ---------------------------------------------------------------------------------- */

static int n_changes;
static void count_change(void *arg)
{
    (void)arg;
    n_changes++;
}

/* Whoever renders the status snapshot is told after every change of the cluster view: a join,
 * an inventory, the plan, a Ready, a Start, a commit (it was once up to 1 s stale). */
Test(coord, every_change_of_the_cluster_view_is_announced)
{
    int before;

    start_coord(NULL);
    n_changes = 0;
    rf_coord_set_on_change(H.c, count_change, NULL);
    cr_assert_eq(join(0), 0);
    cr_assert_eq(n_changes, 1, "a join");
    for (uint32_t m = 1; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    before = n_changes;
    for (uint32_t m = 0; m < NMEM; m++)
        inventory(m, 0);
    cr_assert_eq(n_changes, before + (int)NMEM, "one per inventory");
    before = n_changes;
    wait_plan();
    cr_assert_gt(n_changes, before, "the plan built");
    idle(RECV0, true, 0);
    before = n_changes;
    ready(0, 1);
    cr_assert_eq(n_changes, before + 1, "a Ready");
    rf_coord_set_on_change(H.c, NULL, NULL);
    ready(1, 1);
    cr_assert_eq(n_changes, before + 1, "no callback once unset");
}

/* A member listening on all interfaces is named to its peers by the address it reached the
 * coordinator from, with its listener's port; a named address is kept as it is. */
Test(coord, a_wildcard_data_address_becomes_the_members_reachable_one)
{
    static const char *const given[NMEM] = {"0.0.0.0:7471", "[::]:7472", "10.0.0.9:7473"};
    static const char *const from[NMEM] = {"10.1.2.3:50000", "[fd00::5]:50001", "10.1.2.4:1"};
    static const char *const want[NMEM] = {"10.1.2.3:7471", "[fd00::5]:7472", "10.0.0.9:7473"};
    const Refit__PlanSlice *ps;

    start_coord(NULL);
    for (uint32_t m = 0; m < NMEM; m++) {
        Refit__Hello h = REFIT__HELLO__INIT;
        rf_err err = {0};

        h.role = m < NPUB ? REFIT__ROLE__ROLE_PUBLISHER : REFIT__ROLE__ROLE_RECEIVER;
        h.index = m < NPUB ? m : m - NPUB;
        h.node = (char *)"n";
        h.data_addr = (char *)given[m];
        h.daemon_id = H.daemon_id[m];
        cr_assert_eq(rf_coord__member_up(H.c, &h, &H.peers[m], from[m], &err), 0, "%s",
                     err.msg);
    }
    for (uint32_t m = 0; m < NMEM; m++)
        inventory(m, 0);
    wait_plan();
    ps = last(0, REFIT__ENVELOPE__BODY_PLAN_SLICE)->plan_slice;
    cr_assert_eq(ps->n_peers, NMEM);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_str_eq(ps->peers[m]->data_addr, want[m], "member %u", m);
}

/* ---- relays --------------------------------------------------------------------------------- */

/* The plan document's field (cluster.plan.key) or the last refit's. */
static json_int_t st_sub(const char *obj, const char *key)
{
    json_t *st = cluster();
    json_int_t v = json_integer_value(
        json_object_get(json_object_get(json_object_get(st, "cluster"), obj), key));

    json_decref(st);
    return v;
}

/* Messages of the receiver's plan slice (sent since mark) that it sends, and those it
 * receives. */
static void recv_slice_sides(size_t mark, size_t *sends, size_t *recvs)
{
    *sends = *recvs = 0;
    for (size_t i = mark; i < H.nout; i++) {
        const Refit__PlanSlice *ps;

        if (H.out[i].member != RECV0 ||
            H.out[i].env->body_case != REFIT__ENVELOPE__BODY_PLAN_SLICE)
            continue;
        ps = H.out[i].env->plan_slice;
        for (size_t k = 0; k < ps->n_msgs; k++) {
            *sends += ps->msgs[k]->send;
            *recvs += !ps->msgs[k]->send;
        }
    }
}

/* relay = on reaches the planner: the receiver holds two engine replicas (tp=1, dp=2), and
 * with relays one forwards to the other what the trainers sent it (its slice has messages it
 * sends, the plan document counts them); the refit's bytes are what the receivers installed,
 * not what they installed and forwarded. Losing the relaying receiver mid-refit aborts. With
 * relay = off (the default) the same cluster plans no relay. */
static void relay_cluster(bool on)
{
    rf_inv *inv = test_member_inv(H.model, "tp=1,dp=2", RF_DST, 0, 2);
    size_t mark, sends, recvs;
    json_int_t dst, relayed;
    const Refit__Envelope *e;

    rf_slice_inv_msg_free(&H.inv[RECV0]);
    cr_assert_eq(rf_slice_inv_pack(inv, RF_DST, H.inv_gen[RECV0], &H.inv[RECV0]), 0);
    rf_inv_free(inv);
    if (on)
        start_coord("--staging-mib", "1", "--relay", "on", NULL);
    else
        start_coord("--staging-mib", "1", NULL);
    mark = H.nout;
    cluster_up();
    recv_slice_sides(mark, &sends, &recvs);
    dst = st_sub("plan", "dst_bytes");
    relayed = st_sub("plan", "relay_bytes");
    cr_assert_gt(recvs, 0);
    if (!on) {
        cr_assert_eq(st_sub("plan", "relay_messages"), 0);
        cr_assert_eq(relayed, 0);
        cr_assert_eq(sends, 0, "a receiver sends without relays");
        return;
    }
    cr_assert_gt(st_sub("plan", "relay_messages"), 0, "relay = on planned no relay");
    cr_assert_gt(st_sub("plan", "relay_depth"), 0);
    cr_assert_gt(relayed, 0);
    cr_assert_lt(relayed, dst);
    cr_assert_eq((json_int_t)sends, st_sub("plan", "relay_messages"),
                 "the receiver's slice lacks relays it forwards");
    /* A refit: the receiver's Done counts what it installed and what it forwarded. */
    start(1);
    {
        Refit__Envelope env = REFIT__ENVELOPE__INIT;
        Refit__Done d = REFIT__DONE__INIT;
        uint8_t digest[32] = {0};

        done(0, 1, true, 0, NULL);
        done(1, 1, true, 0, NULL);
        d.version = 1;
        d.ok = true;
        d.error = "";
        d.bytes = (uint64_t)(dst + relayed);
        d.digest.data = digest;
        d.digest.len = 32;
        env.body_case = REFIT__ENVELOPE__BODY_DONE;
        env.done = &d;
        rf_coord__envelope(H.c, RECV0, &env);
    }
    cr_assert_eq(st_int("committed"), 1);
    cr_assert_eq(st_sub("last_refit", "bytes"), dst, "the refit's bytes count relays twice");
    /* The relay dies mid-refit: the version aborts, nothing commits. */
    idle(RECV0, true, 1);
    start(2);
    done(0, 2, true, 0, NULL);
    rf_coord__member_down(H.c, &H.peers[RECV0], "connection reset");
    e = last(0, REFIT__ENVELOPE__BODY_ABORT);
    cr_assert_not_null(e, "losing the relaying receiver mid-refit did not abort");
    cr_assert_eq(e->abort->version, 2);
    cr_assert_eq(count(0, REFIT__ENVELOPE__BODY_COMMIT), 1);
    done(1, 2, false, 0, "aborted");
    cr_assert_eq(st_int("committed"), 1);
}

Test(coord, relay_on_plans_relays_into_the_receivers_slice)
{
    relay_cluster(true);
}

Test(coord, relay_off_plans_none)
{
    relay_cluster(false);
}

/* ---- cluster-wide configuration -------------------------------------------------------------- */

/* A member's own cluster-wide keys as its inventory carries them: the coordinator's values
 * until a test changes one. */
static Refit__ClusterConfig member_config(void)
{
    Refit__ClusterConfig cc = REFIT__CLUSTER_CONFIG__INIT;

    cc.transport = (uint32_t)H.cfg.transport;
    cc.verify = (uint32_t)H.cfg.verify;
    cc.refit_timeout_s = (uint32_t)H.cfg.refit_timeout_s;
    cc.staging_mib = (uint32_t)H.cfg.staging_mib;
    cc.heartbeat_ms = (uint32_t)H.cfg.heartbeat_ms;
    cc.peer_timeout_ms = (uint32_t)H.cfg.peer_timeout_ms;
    cc.config_file = "/etc/refit/receiverd.conf";
    return cc;
}

static void inventory_with(uint32_t m, Refit__ClusterConfig *cc)
{
    H.inv[m].config = cc;
    inventory(m, 0);
    H.inv[m].config = NULL;
}

/* Member m's entry of the coordinator's status; *st holds it (the caller decrefs). */
static json_t *st_member(uint32_t m, json_t **st)
{
    *st = cluster();
    return json_array_get(json_object_get(json_object_get(*st, "cluster"), "members"), m);
}

/* The coordinator's status says member m is refused with want (NULL: not refused), and so
 * does the cluster's last error. */
static void check_refused(uint32_t m, const char *want)
{
    json_t *st, *mem = st_member(m, &st), *r = json_object_get(mem, "refused");
    char err[512];

    if (!want) {
        cr_assert(json_is_null(r), "member %u is refused: %s", m, json_string_value(r));
    } else {
        cr_assert(json_is_string(r), "member %u is not refused in the status", m);
        cr_assert(strstr(json_string_value(r), want), "member %u refused with: %s", m,
                  json_string_value(r));
        st_last_error(err, sizeof(err));
        cr_assert_str_eq(err, json_string_value(r));
    }
    json_decref(st);
}

/* The last Error member m got since mark holds want. */
static void check_error_to(uint32_t m, size_t mark, const char *want)
{
    const Refit__Envelope *e = last_since(mark, m, REFIT__ENVELOPE__BODY_ERROR, NULL);

    cr_assert_not_null(e, "member %u got no Error", m);
    cr_assert(strstr(e->error->message, want), "member %u was told: %s", m, e->error->message);
}

Test(coord, a_member_on_another_transport_is_refused_until_it_comes_back_on_the_coordinators)
{
    Refit__ClusterConfig cc;
    size_t mark;

    start_coord(NULL);
    cc = member_config();
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    inventory_with(0, &cc);
    inventory(1, 0); /* an older build: no config, nothing compared */
    mark = H.nout;
    cc.transport = RF_TRANSPORT_NCCL;
    inventory_with(RECV0, &cc);
    check_error_to(RECV0, mark, "receiver 0 (recv0) is refused: it runs transport = nccl, the "
                   "coordinator transport = tcp: transport is cluster-wide");
    check_error_to(RECV0, mark, "set transport = tcp in /etc/refit/receiverd.conf on recv0 and "
                   "restart it, or run every daemon with transport = nccl");
    check_refused(RECV0, "receiver 0 (recv0) is refused: it runs transport = nccl");
    check_refused(0, NULL);
    /* Every member is told that the refused member blocks refits, and one that joins later
     * is told as it joins. */
    check_blocked(mark, "receiver 0 (recv0) is refused: it runs transport = nccl");
    rf_coord__member_down(H.c, &H.peers[1], "restarting");
    mark = H.nout;
    cr_assert_eq(join(1), 0);
    cr_assert_eq(count_since(mark, 1, REFIT__ENVELOPE__BODY_BLOCKED), 1);
    cr_assert(strstr(blocked_since(mark, 1), "receiver 0 (recv0) is refused"));
    inventory(1, 0);
    /* Every inventory is complete, but nothing is planned while a member is refused. */
    uv_run(&H.loop, UV_RUN_NOWAIT);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count(m, REFIT__ENVELOPE__BODY_PLAN_SLICE), 0,
                     "member %u got a plan slice beside a refused member", m);
    cr_assert(!st_plan_ready());
    /* Its inventory again (a client re-registered): still refused. */
    cc.transport = 7;
    mark = H.nout;
    inventory_with(RECV0, &cc);
    check_error_to(RECV0, mark, "it runs transport = unknown (7), the coordinator transport = "
                   "tcp");
    /* Restarted with the coordinator's transport: it joins the plan, and nothing blocks. */
    mark = H.nout;
    rf_coord__member_down(H.c, &H.peers[RECV0], "restarting");
    H.daemon_id[RECV0]++;
    cr_assert_eq(join(RECV0), 0);
    check_refused(RECV0, NULL);
    for (uint32_t m = 0; m < NPUB; m++)
        cr_assert_str_eq(blocked_since(mark, m), "", "member %u is still told it is blocked", m);
    cc.transport = RF_TRANSPORT_TCP;
    inventory_with(RECV0, &cc);
    wait_plan();
    check_refused(RECV0, NULL);
}

Test(coord, heartbeats_one_side_would_miss_refuse_the_member)
{
    Refit__ClusterConfig cc;
    size_t mark;

    start_coord("--heartbeat-ms", "200", "--peer-timeout-ms", "2000", NULL);
    cc = member_config();
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    inventory(0, 0);
    inventory(1, 0);
    /* The member's heartbeats come no more often than the coordinator gives up. */
    cc.heartbeat_ms = 2000;
    cc.peer_timeout_ms = 10000;
    mark = H.nout;
    inventory_with(RECV0, &cc);
    check_error_to(RECV0, mark, "receiver 0 (recv0) is refused: it sends a heartbeat every "
                   "2000 ms (heartbeat_ms), but the coordinator declares a member dead after "
                   "2000 ms without a frame (peer_timeout_ms): set heartbeat_ms below 2000 in "
                   "/etc/refit/receiverd.conf on recv0, or peer_timeout_ms above 2000 in ");
    check_refused(RECV0, "it sends a heartbeat every 2000 ms");
    /* The member gives up on the coordinator before its heartbeat comes. */
    cc.heartbeat_ms = 100;
    cc.peer_timeout_ms = 200;
    mark = H.nout;
    inventory_with(RECV0, &cc);
    check_error_to(RECV0, mark, "receiver 0 (recv0) is refused: the coordinator sends a "
                   "heartbeat every 200 ms (heartbeat_ms), but it declares the coordinator "
                   "dead after 200 ms without a frame (peer_timeout_ms): set peer_timeout_ms "
                   "above 200 in /etc/refit/receiverd.conf on recv0, or heartbeat_ms below "
                   "200 in ");
    check_refused(RECV0, "the coordinator sends a heartbeat every 200 ms");
    uv_run(&H.loop, UV_RUN_NOWAIT);
    cr_assert(!st_plan_ready());
    /* Timings both sides keep: other values than the coordinator's, and no refusal. */
    cc.peer_timeout_ms = 201;
    cc.heartbeat_ms = 1999;
    inventory_with(RECV0, &cc);
    check_refused(RECV0, NULL);
    wait_plan();
}

Test(coord, start_carries_the_coordinators_verify_and_deadline_and_the_status_shows_differences)
{
    Refit__ClusterConfig same, other;
    json_t *st, *mem, *d;
    char b[64];

    start_coord("--verify", "full", "--refit-timeout-s", "30", NULL);
    same = member_config();
    other = member_config();
    other.verify = RF_VERIFY_OFF;
    other.refit_timeout_s = 600;
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(join(m), 0);
    inventory_with(0, &same);
    inventory(1, 0);
    inventory_with(RECV0, &other);
    wait_plan();
    idle(RECV0, true, 0);
    start(1);
    for (uint32_t m = 0; m < NMEM; m++) {
        const Refit__Start *s = last(m, REFIT__ENVELOPE__BODY_START)->start;

        cr_assert_not_null(s->config, "member %u's Start carries no settings", m);
        cr_assert_eq(s->config->verify, RF_VERIFY_FULL);
        cr_assert_eq(s->config->refit_timeout_s, 30);
        cr_assert_eq(s->config->transport, RF_TRANSPORT_TCP);
    }
    /* The receiver differs in verify and the deadline; it follows, so nothing is refused. */
    check_refused(RECV0, NULL);
    mem = st_member(RECV0, &st);
    d = json_object_get(mem, "config_differs");
    cr_assert_eq(json_array_size(d), 2, "%zu differences", json_array_size(d));
    snprintf(b, sizeof(b), "%s %s %s",
             json_string_value(json_object_get(json_array_get(d, 0), "key")),
             json_string_value(json_object_get(json_array_get(d, 0), "member")),
             json_string_value(json_object_get(json_array_get(d, 0), "cluster")));
    cr_assert_str_eq(b, "verify off full");
    cr_assert(strncmp(json_string_value(json_object_get(json_array_get(d, 0), "resolution")),
                      "adopted", 7) == 0);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(d, 1), "key")),
                     "refit_timeout_s");
    cr_assert_eq(json_integer_value(json_object_get(json_array_get(d, 1), "member")), 600);
    cr_assert_eq(json_integer_value(json_object_get(json_array_get(d, 1), "cluster")), 30);
    json_decref(st);
    /* The same keys: no difference; no config (an older build): null. */
    mem = st_member(0, &st);
    cr_assert_eq(json_array_size(json_object_get(mem, "config_differs")), 0);
    json_decref(st);
    mem = st_member(1, &st);
    cr_assert(json_is_null(json_object_get(mem, "config_differs")));
    json_decref(st);
    st = cluster();
    d = json_object_get(json_object_get(st, "cluster"), "config");
    cr_assert_str_eq(json_string_value(json_object_get(d, "verify")), "full");
    cr_assert_str_eq(json_string_value(json_object_get(d, "transport")), "tcp");
    cr_assert_eq(json_integer_value(json_object_get(d, "refit_timeout_s")), 30);
    json_decref(st);
    /* The digests of members that all verified with the coordinator's setting commit. */
    done(0, 1, true, 0x11, NULL);
    done(1, 1, true, 0x22, NULL);
    done(RECV0, 1, true, 0x33, NULL);
    cr_assert_eq(st_int("committed"), 1);
}

Test(coord, the_plan_takes_the_smallest_staging_budget_of_any_member)
{
    Refit__ClusterConfig cc;
    json_int_t rounds;
    size_t mark;

    start_coord(NULL);
    cluster_up();
    rounds = st_sub("plan", "rounds");
    cr_assert_eq(st_sub("config", "staging_mib"), 256);
    /* The receiver allows 1 MiB a GPU: the plan is built again within it, in more rounds. */
    cc = member_config();
    cc.staging_mib = 1;
    inventory_with(RECV0, &cc);
    cr_assert(!st_plan_ready());
    wait_plan();
    cr_assert_eq(st_sub("config", "staging_mib"), 1);
    cr_assert_gt(st_sub("plan", "rounds"), rounds, "a 1 MiB budget planned %lld rounds, as "
                 "256 MiB did", (long long)st_sub("plan", "rounds"));
    check_refused(RECV0, NULL);
    mark = H.nout;
    ready(0, 1);
    ready(1, 1);
    cr_assert_eq(count_since(mark, RECV0, REFIT__ENVELOPE__BODY_START), 1);
    cr_assert_not_null(last(RECV0, REFIT__ENVELOPE__BODY_START)->start->config);
    cr_assert_eq(last(RECV0, REFIT__ENVELOPE__BODY_START)->start->config->staging_mib, 1);
    /* A larger budget than the coordinator's changes nothing. */
    cc.staging_mib = 4096;
    rf_coord__member_down(H.c, &H.peers[RECV0], "restarting");
    H.daemon_id[RECV0]++;
    cr_assert_eq(join(RECV0), 0);
    inventory_with(RECV0, &cc);
    wait_plan();
    cr_assert_eq(st_sub("config", "staging_mib"), 256);
    cr_assert_eq(st_sub("plan", "rounds"), rounds);
}

/* A Done of an aborted version that arrives during the next refit is not that member's Done
 * of the next one: with verify off nothing else would stop a commit before the member
 * installed the version in flight. */
Test(coord, a_late_done_of_an_aborted_version_does_not_count_toward_the_next_refit)
{
    start_coord("--verify", "off", NULL);
    cluster_up();
    start(1);
    done(0, 1, false, 0, "data path of version 1 failed");
    cr_assert_str_eq(st_state(), "aborting");
    /* Receiver 0 stays silent through the settle; its Done of version 1 comes only later. */
    done(1, 1, false, 0, "aborted");
    cr_assert(rf_coord__expire(H.c), "no settle timer was pending");
    cr_assert_str_eq(st_state(), "idle");
    start(2);
    done(0, 2, true, 0, NULL);
    done(1, 2, true, 0, NULL);
    done(RECV0, 1, true, 0, NULL);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(count(m, REFIT__ENVELOPE__BODY_COMMIT), 0,
                     "member %u got a Commit of version 2 on receiver 0's Done of version 1", m);
    cr_assert_str_eq(st_state(), "running");
    cr_assert_eq(st_int("committed"), 0);
    done(RECV0, 2, true, 0, NULL);
    for (uint32_t m = 0; m < NMEM; m++)
        cr_assert_eq(last(m, REFIT__ENVELOPE__BODY_COMMIT)->commit->version, 2);
    cr_assert_eq(st_int("committed"), 2);
}
