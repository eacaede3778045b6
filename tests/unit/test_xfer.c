/* tests/unit/test_xfer.c - the tcp transport between several instances in one process over
 * 127.0.0.1: jobs by hand and from real plans checked byte for byte, rounds under a tiny
 * staging budget, verification digests, dead peers, stale versions, deadlines, aborts, the
 * authenticated handshake against forged, replayed and old hellos and impostor acceptors, and
 * the tagged frames against an attacker on the path who flips, replays or moves bytes. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "layout.h"
#include "log.h"
#include "macros.h"
#include "model.h"
#include "plan.h"
#include "quant_fmt.h"
#include "slice.h"
#include "xfer.h"
#include "xfer_data.h"

#define MAXD 4

/* ---- a world of transports on one loop -------------------------------------------------- */

typedef struct world {
    uv_loop_t loop;
    uv_timer_t guard, poke;
    int n;
    rf_xfer_transport *t[MAXD];
    rf_xfer_result res[MAXD];
    bool got[MAXD];
    int pending, closing;
    void (*poke_fn)(struct world *w);
    int poke_target;
} world;

static void on_guard(uv_timer_t *h)
{
    (void)h;
    cr_assert_fail("a job did not finish within 30 s: the transport hangs");
}

static void world_init_loop(world *w)
{
    memset(w, 0, sizeof(*w));
    cr_assert_eq(uv_loop_init(&w->loop), 0);
    uv_timer_init(&w->loop, &w->guard);
    uv_timer_init(&w->loop, &w->poke);
}

static const char *addr_of(world *w, int i)
{
    return rf_xfer_tcp_addr(w->t[i]);
}

/* Cluster keys: every byte `fill`. The world's transports share KEY_A. */
#define KEY_A 0xa1
#define KEY_B 0xb2

static void key_bytes(uint8_t fill, uint8_t out[RF_XFER_TCP_KEY_MIN])
{
    memset(out, fill, RF_XFER_TCP_KEY_MIN);
}

static void set_key(rf_xfer_transport *t, uint8_t fill)
{
    uint8_t k[RF_XFER_TCP_KEY_MIN];

    key_bytes(fill, k);
    cr_assert_eq(rf_xfer_tcp_set_key(t, k, sizeof(k)), 0);
}

static void world_set_peers(world *w)
{
    const char *addrs[MAXD];
    rf_err err;

    for (int i = 0; i < w->n; i++)
        addrs[i] = addr_of(w, i);
    for (int i = 0; i < w->n; i++)
        cr_assert_eq(rf_xfer_set_peers(w->t[i], (uint32_t)i, (uint32_t)w->n, addrs, &err), 0,
                     "%s", err.msg);
}

static void world_open(world *w, int n)
{
    rf_err err;

    world_init_loop(w);
    w->n = n;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(rf_xfer_tcp_new(&w->loop, "127.0.0.1:0", &w->t[i], &err), 0, "%s",
                     err.msg);
        cr_assert_str_eq(rf_xfer_name(w->t[i]), "tcp");
        cr_assert(strncmp(addr_of(w, i), "127.0.0.1:", 10) == 0, "%s", addr_of(w, i));
        cr_assert_neq(strcmp(addr_of(w, i), "127.0.0.1:0"), 0);
        set_key(w->t[i], KEY_A);
    }
    world_set_peers(w);
}

static void on_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    world *w = arg;

    for (int i = 0; i < w->n; i++) {
        if (w->t[i] == t) {
            cr_assert(!w->got[i], "done called twice for transport %d", i);
            w->res[i] = *res;
            w->got[i] = true;
        }
    }
    if (--w->pending == 0)
        uv_stop(&w->loop);
}

static void on_poke(uv_timer_t *h)
{
    world *w = container_of(h, world, poke);

    w->poke_fn(w);
}

/* Runs jobs[i] on transport i (NULL: none) until every started job is done; poke, when set,
 * fires after poke_ms on the loop thread. */
static void world_run_poke(world *w, rf_xfer_job **jobs, void (*poke)(world *), uint64_t poke_ms)
{
    rf_err err;

    memset(w->got, 0, sizeof(w->got));
    memset(w->res, 0, sizeof(w->res));
    w->pending = 0;
    for (int i = 0; i < w->n; i++) {
        if (!jobs[i])
            continue;
        cr_assert_eq(rf_xfer_run(w->t[i], jobs[i], on_done, w, &err), 0, "%s", err.msg);
        w->pending++;
    }
    if (poke) {
        w->poke_fn = poke;
        uv_timer_start(&w->poke, on_poke, poke_ms, 0);
    }
    uv_timer_start(&w->guard, on_guard, 30000, 0);
    if (w->pending > 0)
        uv_run(&w->loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w->guard);
    uv_timer_stop(&w->poke);
}

static void world_run(world *w, rf_xfer_job **jobs)
{
    world_run_poke(w, jobs, NULL, 0);
}

static void on_closed(void *arg)
{
    world *w = arg;

    w->closing--;
}

static void world_close(world *w)
{
    for (int i = 0; i < w->n; i++) {
        if (w->t[i]) {
            w->closing++;
            rf_xfer_close(w->t[i], on_closed, w);
            w->t[i] = NULL;
        }
    }
    uv_close((uv_handle_t *)&w->guard, NULL);
    uv_close((uv_handle_t *)&w->poke, NULL);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    cr_assert_eq(w->closing, 0);
    cr_assert_eq(uv_loop_close(&w->loop), 0, "handles left open on the loop");
}

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- data: xfer_data.h's pattern per (tensor, element, version) --------------------------- */

/* A cluster in host memory: one buffer per region of the inventory. */
typedef struct cluster {
    const rf_inv *inv;
    uint8_t **bases;
    uint32_t nregions;
} cluster;

static void cluster_alloc(cluster *c, const rf_inv *inv)
{
    c->inv = inv;
    c->nregions = rf_inv_nregions(inv);
    c->bases = calloc(c->nregions, sizeof(*c->bases));
    cr_assert_not_null(c->bases);
    for (uint32_t r = 0; r < c->nregions; r++) {
        c->bases[r] = malloc(rf_inv_region(inv, r)->size + 1);
        cr_assert_not_null(c->bases[r]);
        memset(c->bases[r], 0xee, rf_inv_region(inv, r)->size + 1);
    }
}

static void cluster_free(cluster *c)
{
    for (uint32_t r = 0; r < c->nregions; r++)
        free(c->bases[r]);
    free(c->bases);
}

static void fill_sources(cluster *c, uint64_t version)
{
    xd_fill(c->inv, c->bases, version);
}

/* Every destination byte holds the version's pattern; every other byte of a destination
 * region is untouched (0xee). */
static void check_destinations(cluster *c, uint64_t version)
{
    uint64_t wrong, stray;

    xd_check(c->inv, c->bases, version, &wrong, &stray);
    cr_assert_eq(wrong, 0, "%llu destination bytes wrong", (unsigned long long)wrong);
    cr_assert_eq(stray, 0, "%llu bytes outside destination pieces written",
                 (unsigned long long)stray);
}

/* ---- jobs from a plan ---------------------------------------------------------------------- */

static void job_push(rf_xfer_job *j, const rf_xfer_msg *m)
{
    j->msgs = realloc(j->msgs, (j->nmsgs + 1) * sizeof(*j->msgs));
    cr_assert_not_null(j->msgs);
    j->msgs[j->nmsgs++] = *m;
}

static void job_free(rf_xfer_job *j)
{
    for (uint32_t i = 0; i < j->nmsgs; i++)
        free(j->msgs[i].items);
    free(j->msgs);
    memset(j, 0, sizeof(*j));
}

static rf_xfer_msg plan_side(const rf_plan *pl, uint32_t mi, rf_side side, uint8_t **bases,
                             uint32_t peer)
{
    rf_xfer_msg m;
    rf_err err;

    cr_assert_eq(rf_slice_msg_from_plan(pl, mi, side, bases, peer, &m, &err), 0, "%s", err.msg);
    return m;
}

/* The job of every daemon: ep_daemon maps each endpoint of the plan's inventory to a daemon.
 * A daemon's staging budget is the plan's per endpoint times its endpoints. */
static void jobs_from_plan(const rf_plan *pl, const rf_plan_opts *o, const uint32_t *ep_daemon,
                           int ndaemons, uint8_t **bases, uint64_t version, int verify,
                           rf_xfer_job *jobs)
{
    const rf_inv *inv = rf_plan_inv(pl);

    for (int d = 0; d < ndaemons; d++) {
        memset(&jobs[d], 0, sizeof(jobs[d]));
        jobs[d].version = version;
        jobs[d].nrounds = rf_plan_nrounds(pl);
        jobs[d].timeout_s = 20;
        jobs[d].verify = verify;
    }
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++)
        jobs[ep_daemon[e]].staging_bytes += o->staging_bytes;
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *pm = rf_plan_msg_at(pl, mi);
        uint32_t ds = ep_daemon[pm->src_ep], dd = ep_daemon[pm->dst_ep];
        rf_xfer_msg s = plan_side(pl, mi, RF_SRC, bases, dd);
        rf_xfer_msg r = plan_side(pl, mi, RF_DST, bases, ds);

        job_push(&jobs[ds], &s);
        job_push(&jobs[dd], &r);
    }
}

static void digests_agree(const world *w)
{
    uint8_t s[RF_XFER_DIGEST_BYTES] = {0}, r[RF_XFER_DIGEST_BYTES] = {0};
    uint8_t zero[RF_XFER_DIGEST_BYTES] = {0};

    for (int i = 0; i < w->n; i++) {
        for (int b = 0; b < RF_XFER_DIGEST_BYTES; b++) {
            s[b] ^= w->res[i].digest_sent[b];
            r[b] ^= w->res[i].digest_recv[b];
        }
    }
    cr_assert(memcmp(s, zero, sizeof(s)) != 0, "verify on, yet no digest was computed");
    cr_assert(memcmp(s, r, sizeof(s)) == 0,
              "XOR of sent digests differs from XOR of received ones");
}

/* ---- a hand-made inventory: splits, replicas, a transposed store, padding --------------- */

typedef struct builder {
    rf_inv *inv;
    uint32_t region[MAXD];
    uint64_t cursor[MAXD];
} builder;

#define REGION_BYTES (2u << 20)

static uint32_t add_tensor(builder *b, const char *name, rf_dtype dt, int ndim,
                           const int64_t *shape)
{
    uint32_t id;
    rf_err err;

    cr_assert_eq(rf_inv_add_tensor(b->inv, name, dt, ndim, shape, &id, &err), 0, "%s",
                 err.msg);
    return id;
}

/* A piece of box on endpoint ep; strides NULL means dense row-major. */
static void add_piece(builder *b, uint32_t ep, uint32_t tensor, const int64_t *start,
                      const int64_t *extent, const int64_t *strides)
{
    const rf_tensor *t = rf_inv_tensor(b->inv, tensor);
    size_t es = rf_dtype_size(t->dtype);
    rf_piece p;
    uint64_t span = 1;
    uint32_t id;
    rf_err err;

    memset(&p, 0, sizeof(p));
    p.tensor = tensor;
    p.region = b->region[ep];
    p.offset = b->cursor[ep];
    for (int d = 0; d < RF_MAX_DIMS; d++) {
        p.box.start[d] = d < t->ndim ? start[d] : 0;
        p.box.extent[d] = d < t->ndim ? extent[d] : 1;
    }
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (strides) {
            p.strides[d] = strides[d];
        } else {
            p.strides[d] = (int64_t)span;
            span *= (uint64_t)extent[d];
        }
    }
    span = 1;
    for (int d = 0; d < t->ndim; d++)
        span += (uint64_t)(extent[d] - 1) * (uint64_t)p.strides[d];
    b->cursor[ep] += (span * es + 63) & ~63ull;
    cr_assert_eq(rf_inv_add_piece(b->inv, &p, &id, &err), 0, "%s", err.msg);
}

/* Endpoints: src 0 (daemon 0), src 1 (daemon 1), dst 2 (daemon 1), dst 3 (daemon 2); daemon 1
 * so sends to itself too. */
static const uint32_t hand_ep_daemon[4] = {0, 1, 1, 2};

static rf_inv *hand_inv(void)
{
    builder b = {.inv = rf_inv_new()};
    uint32_t ep, big, tr, cube, norms[12];
    rf_err err;

    cr_assert_not_null(b.inv);
    for (int e = 0; e < 4; e++) {
        cr_assert_eq(rf_inv_add_endpoint(b.inv, e < 2 ? RF_SRC : RF_DST, (uint32_t)e, &ep,
                                         &err), 0, "%s", err.msg);
        cr_assert_eq(rf_inv_add_region(b.inv, ep, REGION_BYTES, &b.region[e], &err), 0, "%s",
                     err.msg);
    }
    /* fp32 [256, 512]: row halves on the sources; whole on dst 2 (direct), left columns on
     * dst 3 (strided on the source side: packed, and split to fit the budget). */
    big = add_tensor(&b, "model.layers.0.mlp.up_proj.weight", RF_DT_FP32, 2,
                     (int64_t[]){256, 512});
    add_piece(&b, 0, big, (int64_t[]){0, 0}, (int64_t[]){128, 512}, NULL);
    add_piece(&b, 1, big, (int64_t[]){128, 0}, (int64_t[]){128, 512}, NULL);
    add_piece(&b, 2, big, (int64_t[]){0, 0}, (int64_t[]){256, 512}, NULL);
    add_piece(&b, 3, big, (int64_t[]){0, 0}, (int64_t[]){256, 256}, NULL);
    /* bf16 [96, 80]: replicated on both sources; stored transposed on dst 2, right columns
     * on dst 3. */
    tr = add_tensor(&b, "model.layers.0.self_attn.o_proj.weight", RF_DT_BF16, 2,
                    (int64_t[]){96, 80});
    add_piece(&b, 0, tr, (int64_t[]){0, 0}, (int64_t[]){96, 80}, NULL);
    add_piece(&b, 1, tr, (int64_t[]){0, 0}, (int64_t[]){96, 80}, NULL);
    add_piece(&b, 2, tr, (int64_t[]){0, 0}, (int64_t[]){96, 80}, (int64_t[]){1, 96});
    add_piece(&b, 3, tr, (int64_t[]){0, 40}, (int64_t[]){96, 40}, NULL);
    /* int64 [3, 5, 7]: split on dim 1 by the sources, padded rows (stride 8) on dst 3. */
    cube = add_tensor(&b, "model.layers.0.mlp.gate.e_score_correction_bias", RF_DT_INT64, 3,
                      (int64_t[]){3, 5, 7});
    add_piece(&b, 0, cube, (int64_t[]){0, 0, 0}, (int64_t[]){3, 2, 7}, NULL);
    add_piece(&b, 1, cube, (int64_t[]){0, 2, 0}, (int64_t[]){3, 3, 7}, NULL);
    add_piece(&b, 3, cube, (int64_t[]){0, 0, 0}, (int64_t[]){3, 5, 7}, (int64_t[]){40, 8, 1});
    /* Many small norms, replicated everywhere: packed together. */
    for (int i = 0; i < 12; i++) {
        char name[64];

        snprintf(name, sizeof(name), "model.layers.%d.input_layernorm.weight", i);
        norms[i] = add_tensor(&b, name, RF_DT_FP16, 1, (int64_t[]){64 + i});
        add_piece(&b, 0, norms[i], (int64_t[]){0}, (int64_t[]){64 + i}, NULL);
        add_piece(&b, 1, norms[i], (int64_t[]){0}, (int64_t[]){64 + i}, NULL);
        add_piece(&b, 2, norms[i], (int64_t[]){0}, (int64_t[]){64 + i}, NULL);
        add_piece(&b, 3, norms[i], (int64_t[]){0}, (int64_t[]){64 + i}, NULL);
    }
    cr_assert_eq(rf_inv_check_dst_overlap(b.inv, &err), 0, "%s", err.msg);
    return b.inv;
}

/* Plans inv, runs it twice (versions 1 and 2, connections kept) on ndaemons transports with
 * verification on, and checks every destination byte and the digests each time. */
static void run_plan(rf_inv *inv, const rf_plan_opts *o, const uint32_t *ep_daemon,
                     int ndaemons, uint32_t min_rounds)
{
    rf_xfer_job jobs[MAXD], *jp[MAXD];
    const rf_plan_stats *st;
    rf_plan *pl = NULL;
    cluster c;
    world w;
    rf_err err;

    cr_assert_eq(rf_plan_build(inv, o, &pl, &err), 0, "%s", err.msg);
    st = rf_plan_stats_get(pl);
    cr_assert_geq(rf_plan_nrounds(pl), min_rounds, "only %u rounds", rf_plan_nrounds(pl));
    cr_assert_gt(st->direct_transfers, 0, "the plan has no direct transfer to test");
    cr_assert_gt(st->packed_transfers, 0, "the plan has no packed transfer to test");
    cluster_alloc(&c, inv);
    world_open(&w, ndaemons);
    for (uint64_t v = 1; v <= 2; v++) {
        uint64_t sent = 0, recv = 0;

        fill_sources(&c, v);
        jobs_from_plan(pl, o, ep_daemon, ndaemons, c.bases, v, 1, jobs);
        for (int d = 0; d < ndaemons; d++)
            jp[d] = &jobs[d];
        world_run(&w, jp);
        for (int d = 0; d < ndaemons; d++) {
            cr_assert_eq(w.res[d].code, 0, "daemon %d: %s", d, w.res[d].error);
            cr_assert_leq(w.res[d].peak_staging, jobs[d].staging_bytes);
            sent += w.res[d].bytes_sent;
            recv += w.res[d].bytes_recv;
        }
        cr_assert_eq(sent, st->dst_bytes);
        cr_assert_eq(recv, st->dst_bytes);
        check_destinations(&c, v);
        digests_agree(&w);
        for (int d = 0; d < ndaemons; d++)
            job_free(&jobs[d]);
    }
    world_close(&w);
    cluster_free(&c);
    rf_plan_free(pl);
}

/* qwen3-0.6b shrunk 16x, laid out src -> dst into inv (one endpoint per rank). */
static void shrunk_qwen3(const char *src, const char *dst, rf_inv *inv)
{
    rf_model *m = NULL, *s = NULL;
    rf_par ps, pd;
    rf_err err;

    cr_assert_eq(rf_model_load("qwen3-0.6b", &m, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(m, 16, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse(src, RF_SRC, s, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse(dst, RF_DST, s, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(s, &ps, &pd, 8, inv, &err), 0, "%s", err.msg);
    rf_model_free(s);
    rf_model_free(m);
}

/* A folded inventory keeps every id and moves each side to one endpoint; every message of a
 * plan over it becomes a transport message on each side with the plan's fields and items. */
Test(xfer_plan, folded_sides_and_messages_from_plan)
{
    rf_inv *full = rf_inv_new(), *fold = NULL;
    rf_plan_opts o = {.staging_bytes = 256 << 10, .direct_min_bytes = 16 << 10};
    rf_plan *pl = NULL;
    uint8_t **bases;
    rf_err err;

    shrunk_qwen3("tp=2,dp=2", "tp=4", full);
    cr_assert_eq(rf_inv_fold_sides(full, &fold, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_nendpoints(fold), 2);
    cr_assert_eq(rf_inv_ntensors(fold), rf_inv_ntensors(full));
    cr_assert_eq(rf_inv_nregions(fold), rf_inv_nregions(full));
    for (uint32_t r = 0; r < rf_inv_nregions(full); r++) {
        cr_assert_eq(rf_inv_region(fold, r)->size, rf_inv_region(full, r)->size);
        cr_assert_eq(rf_inv_endpoint(fold, rf_inv_region(fold, r)->endpoint)->side,
                     rf_inv_endpoint(full, rf_inv_region(full, r)->endpoint)->side);
    }
    for (int side = 0; side < 2; side++) {
        cr_assert_eq(rf_inv_npieces(fold, (rf_side)side), rf_inv_npieces(full, (rf_side)side));
        for (uint32_t i = 0; i < rf_inv_npieces(full, (rf_side)side); i++) {
            rf_piece a, b;

            rf_inv_piece(full, (rf_side)side, i, &a);
            rf_inv_piece(fold, (rf_side)side, i, &b);
            cr_assert(a.tensor == b.tensor && a.region == b.region &&
                      memcmp(&a.box, &b.box, sizeof(a.box)) == 0 &&
                      memcmp(a.strides, b.strides, sizeof(a.strides)) == 0, "piece %u differs", i);
            cr_assert_eq(rf_inv_piece_endpoint(fold, (rf_side)side, i), (uint32_t)side);
        }
    }
    cr_assert_eq(rf_plan_build(fold, &o, &pl, &err), 0, "%s", err.msg);
    bases = calloc(rf_inv_nregions(fold), sizeof(*bases));
    for (uint32_t r = 0; r < rf_inv_nregions(fold); r++)
        bases[r] = (uint8_t *)(uintptr_t)(0x100000u * (r + 1));
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *pm = rf_plan_msg_at(pl, mi);

        for (int side = 0; side < 2; side++) {
            rf_xfer_msg x;
            uint64_t sum = 0;

            cr_assert_eq(rf_slice_msg_from_plan(pl, mi, (rf_side)side, bases, 7, &x, &err), 0,
                         "%s", err.msg);
            cr_assert(x.seq == mi && x.round == pm->round && x.kind == pm->kind &&
                      x.bytes == pm->bytes && x.nitems == pm->count && x.peer == 7);
            cr_assert_eq(x.send, side == RF_SRC);
            cr_assert_eq(x.ep, side == RF_SRC ? pm->src_ep : pm->dst_ep);
            cr_assert_eq(x.peer_ep, side == RF_SRC ? pm->dst_ep : pm->src_ep);
            for (uint32_t k = 0; k < x.nitems; k++) {
                cr_assert_eq(x.items[k].base, bases[x.items[k].piece.region]);
                cr_assert_eq(rf_inv_endpoint(fold, rf_inv_region(fold, x.items[k].piece.region)
                                                       ->endpoint)->side, (rf_side)side);
                sum += x.items[k].bytes;
            }
            cr_assert_eq(sum, x.bytes, "message %u: items hold %llu of %llu bytes", mi,
                         (unsigned long long)sum, (unsigned long long)x.bytes);
            free(x.items);
        }
    }
    free(bases);
    rf_plan_free(pl);
    rf_inv_free(fold);
    rf_inv_free(full);
}

Test(xfer_plan, hand_layout_three_daemons_tiny_budget)
{
    rf_inv *inv = hand_inv();
    rf_plan_opts o = {.staging_bytes = 64 << 10, .direct_min_bytes = 64 << 10};

    run_plan(inv, &o, hand_ep_daemon, 3, 4);
    rf_inv_free(inv);
}

Test(xfer_plan, hand_layout_large_budget_one_round)
{
    rf_inv *inv = hand_inv();
    rf_plan_opts o = {.staging_bytes = 64 << 20, .direct_min_bytes = 64 << 10};

    run_plan(inv, &o, hand_ep_daemon, 3, 1);
    rf_inv_free(inv);
}

/* 700 small fp16 tensors, whole on src endpoint 0 (daemon 0); on dst endpoint 1 (daemon 1) each
 * is two pieces, the second with padded elements (stride 2): one packed message of 1,400
 * items. */
static const uint32_t many_ep_daemon[2] = {0, 1};

static rf_inv *many_inv(void)
{
    builder b = {.inv = rf_inv_new()};
    uint32_t ep;
    rf_err err;

    cr_assert_not_null(b.inv);
    for (int e = 0; e < 2; e++) {
        cr_assert_eq(rf_inv_add_endpoint(b.inv, e == 0 ? RF_SRC : RF_DST, (uint32_t)e, &ep,
                                         &err), 0, "%s", err.msg);
        cr_assert_eq(rf_inv_add_region(b.inv, ep, REGION_BYTES, &b.region[e], &err), 0, "%s",
                     err.msg);
    }
    for (int i = 0; i < 700; i++) {
        char name[64];
        int64_t n = 5 + i % 7, half = n / 2;
        uint32_t t;

        snprintf(name, sizeof(name), "model.layers.%d.post_attention_layernorm.weight", i);
        t = add_tensor(&b, name, RF_DT_FP16, 1, (int64_t[]){n});
        add_piece(&b, 0, t, (int64_t[]){0}, (int64_t[]){n}, NULL);
        add_piece(&b, 1, t, (int64_t[]){0}, (int64_t[]){half}, NULL);
        add_piece(&b, 1, t, (int64_t[]){half}, (int64_t[]){n - half}, (int64_t[]){2});
    }
    cr_assert_eq(rf_inv_check_dst_overlap(b.inv, &err), 0, "%s", err.msg);
    return b.inv;
}

/* Runs version v of plan pl over cluster c's memory on w's nd daemons, every job with plan_key
 * key, and checks every destination byte and the digests. Returns the most items one message
 * had. */
static uint32_t run_keyed(world *w, const rf_plan *pl, const rf_plan_opts *o,
                          const uint32_t *ep_daemon, int nd, cluster *c, uint64_t v, uint64_t key)
{
    rf_xfer_job jobs[MAXD], *jp[MAXD];
    uint32_t most = 0;

    fill_sources(c, v);
    jobs_from_plan(pl, o, ep_daemon, nd, c->bases, v, 1, jobs);
    for (int d = 0; d < nd; d++) {
        jobs[d].plan_key = key;
        jp[d] = &jobs[d];
        for (uint32_t i = 0; i < jobs[d].nmsgs; i++)
            if (jobs[d].msgs[i].nitems > most)
                most = jobs[d].msgs[i].nitems;
    }
    world_run(w, jp);
    for (int d = 0; d < nd; d++)
        cr_assert_eq(w->res[d].code, 0, "key %llu, version %llu, daemon %d: %s",
                     (unsigned long long)key, (unsigned long long)v, d, w->res[d].error);
    check_destinations(c, v);
    digests_agree(w);
    for (int d = 0; d < nd; d++)
        job_free(&jobs[d]);
    return most;
}

/* A packed message of 1,400 items, contiguous and strided: every byte lands, twice over (the
 * second job has the same plan_key and reuses the items reduced for the first). */
Test(xfer_plan, message_of_1400_items_twice)
{
    rf_inv *inv = many_inv();
    rf_plan_opts o = {.staging_bytes = 64 << 20, .direct_min_bytes = 64 << 20};
    rf_plan *pl = NULL;
    uint32_t most;
    cluster c;
    world w;
    rf_err err;

    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cluster_alloc(&c, inv);
    world_open(&w, 2);
    most = run_keyed(&w, pl, &o, many_ep_daemon, 2, &c, 1, 1);
    cr_assert_geq(most, 1400, "the largest message has %u items, fewer than the test needs", most);
    run_keyed(&w, pl, &o, many_ep_daemon, 2, &c, 2, 1);
    world_close(&w);
    cluster_free(&c);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* The tcp transport keeps the packed items it reduced for a plan_key: the same plan over
 * other memory under another key lands its bytes there (a kept table would write into the
 * first memory), and going back to the first key rebuilds again. */
Test(xfer_plan, kept_items_follow_the_plan_key)
{
    rf_inv *inv = hand_inv();
    rf_plan_opts o = {.staging_bytes = 64 << 10, .direct_min_bytes = 64 << 10};
    rf_plan *pl = NULL;
    cluster a, b;
    world w;
    rf_err err;

    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cluster_alloc(&a, inv);
    cluster_alloc(&b, inv);
    world_open(&w, 3);
    run_keyed(&w, pl, &o, hand_ep_daemon, 3, &a, 1, 5);
    run_keyed(&w, pl, &o, hand_ep_daemon, 3, &a, 2, 5);
    run_keyed(&w, pl, &o, hand_ep_daemon, 3, &b, 3, 6);
    check_destinations(&a, 2);
    run_keyed(&w, pl, &o, hand_ep_daemon, 3, &a, 4, 5);
    check_destinations(&b, 3);
    world_close(&w);
    cluster_free(&a);
    cluster_free(&b);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* A real model layout: qwen3 shrunk, trainer tp=2 on daemons 0-1, engine tp=4 on daemons 2-3
 * (two engine GPUs per daemon). */
Test(xfer_plan, qwen3_tp2_to_tp4_four_daemons)
{
    rf_inv *inv = rf_inv_new();
    rf_plan_opts o = {.staging_bytes = 1 << 20, .direct_min_bytes = 16 << 10};
    uint32_t *ep_daemon;

    shrunk_qwen3("tp=2", "tp=4", inv);
    cr_assert_eq(rf_inv_nendpoints(inv), 6);
    ep_daemon = (uint32_t[]){0, 1, 2, 2, 3, 3};
    run_plan(inv, &o, ep_daemon, 4, 2);
    rf_inv_free(inv);
}

/* ---- jobs by hand ------------------------------------------------------------------------- */

/* A dense row-major 2-D fp32 piece of shape [rows, cols] at base. */
static rf_xfer_item item2d(uint8_t *base, int64_t rows, int64_t cols, const int64_t *strides,
                           int64_t r0, int64_t nr, uint64_t msg_off)
{
    rf_xfer_item it;

    memset(&it, 0, sizeof(it));
    it.base = base;
    it.ndim = 2;
    it.esize = 4;
    rf_box_full(&it.piece.box, 2, (int64_t[]){rows, cols});
    it.piece.strides[0] = strides ? strides[0] : cols;
    it.piece.strides[1] = strides ? strides[1] : 1;
    it.box = it.piece.box;
    it.box.start[0] = r0;
    it.box.extent[0] = nr;
    it.msg_off = msg_off;
    it.bytes = (uint64_t)nr * (uint64_t)cols * 4;
    return it;
}

typedef struct pair {
    float *src, *dst_direct, *dst_t;
    rf_xfer_item s_items[3], r_items[3];
    rf_xfer_msg smsgs[2], rmsgs[2];
    rf_xfer_job sjob, rjob;
} pair;

#define ROWS 256
#define COLS 1024

/* Daemon 0 sends a [ROWS, COLS] fp32 matrix to daemon 1 twice: direct into a row-major copy,
 * and packed (two row slabs in one message) into a transposed store. */
static void pair_init(pair *p, uint64_t version)
{
    size_t n = (size_t)ROWS * COLS;

    memset(p, 0, sizeof(*p));
    p->src = malloc(n * 4);
    p->dst_direct = calloc(n, 4);
    p->dst_t = calloc(n, 4);
    for (size_t i = 0; i < n; i++)
        p->src[i] = (float)i + (float)version;
    p->s_items[0] = item2d((uint8_t *)p->src, ROWS, COLS, NULL, 0, ROWS, 0);
    p->r_items[0] = item2d((uint8_t *)p->dst_direct, ROWS, COLS, NULL, 0, ROWS, 0);
    p->s_items[1] = item2d((uint8_t *)p->src, ROWS, COLS, NULL, 0, ROWS / 2, 0);
    p->s_items[2] = item2d((uint8_t *)p->src, ROWS, COLS, NULL, ROWS / 2, ROWS / 2,
                           (uint64_t)n * 2);
    p->r_items[1] = item2d((uint8_t *)p->dst_t, ROWS, COLS, (int64_t[]){1, ROWS}, ROWS / 2,
                           ROWS / 2, (uint64_t)n * 2);
    p->r_items[2] = item2d((uint8_t *)p->dst_t, ROWS, COLS, (int64_t[]){1, ROWS}, 0, ROWS / 2,
                           0);
    p->smsgs[0] = (rf_xfer_msg){.seq = 10, .round = 0, .kind = RF_PLAN_DIRECT, .send = true,
                                .peer = 1, .bytes = n * 4, .nitems = 1, .items = &p->s_items[0]};
    p->smsgs[1] = (rf_xfer_msg){.seq = 11, .round = 1, .kind = RF_PLAN_PACKED, .send = true,
                                .peer = 1, .bytes = n * 4, .nitems = 2, .items = &p->s_items[1]};
    p->rmsgs[0] = p->smsgs[0];
    p->rmsgs[0].send = false;
    p->rmsgs[0].peer = 0;
    p->rmsgs[0].items = &p->r_items[0];
    p->rmsgs[1] = p->smsgs[1];
    p->rmsgs[1].send = false;
    p->rmsgs[1].peer = 0;
    p->rmsgs[1].items = &p->r_items[1];
    p->sjob = (rf_xfer_job){.version = version, .nrounds = 2, .nmsgs = 2, .msgs = p->smsgs,
                            .staging_bytes = 2 * n * 4, .timeout_s = 10, .verify = RF_VERIFY_FULL};
    p->rjob = p->sjob;
    p->rjob.msgs = p->rmsgs;
}

static void pair_check(const pair *p)
{
    uint64_t wrong = 0;

    for (int64_t r = 0; r < ROWS; r++) {
        for (int64_t c = 0; c < COLS; c++) {
            float want = p->src[r * COLS + c];

            wrong += p->dst_direct[r * COLS + c] != want;
            wrong += p->dst_t[c * ROWS + r] != want;
        }
    }
    cr_assert_eq(wrong, 0, "%llu elements wrong", (unsigned long long)wrong);
}

static void pair_free(pair *p)
{
    free(p->src);
    free(p->dst_direct);
    free(p->dst_t);
}

Test(xfer_hand, direct_and_packed_between_two)
{
    pair p;
    world w;

    pair_init(&p, 7);
    world_open(&w, 2);
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[0].code, 0, "%s", w.res[0].error);
    cr_assert_eq(w.res[1].code, 0, "%s", w.res[1].error);
    cr_assert_eq(w.res[0].bytes_sent, 2ull * ROWS * COLS * 4);
    cr_assert_eq(w.res[1].bytes_recv, 2ull * ROWS * COLS * 4);
    cr_assert_eq(w.res[0].bytes_recv, 0);
    /* Only the packed message takes staging, on each side. */
    cr_assert_eq(w.res[0].peak_staging, (uint64_t)ROWS * COLS * 4);
    cr_assert_eq(w.res[1].peak_staging, (uint64_t)ROWS * COLS * 4);
    cr_assert_gt(w.res[1].seconds, 0);
    pair_check(&p);
    digests_agree(&w);
    world_close(&w);
    pair_free(&p);
}

/* BLAKE2b-256(seq as 4 bytes little-endian || the first `bytes` of payload), XORed into acc:
 * the digest as xfer.h defines it, computed here apart from the transport. */
static void digest_ref(uint32_t seq, const void *payload, size_t bytes,
                       uint8_t acc[RF_XFER_DIGEST_BYTES])
{
    crypto_generichash_state st;
    uint8_t le[4] = {(uint8_t)seq, (uint8_t)(seq >> 8), (uint8_t)(seq >> 16),
                     (uint8_t)(seq >> 24)};
    uint8_t h[RF_XFER_DIGEST_BYTES];

    crypto_generichash_init(&st, NULL, 0, sizeof(h));
    crypto_generichash_update(&st, le, sizeof(le));
    crypto_generichash_update(&st, payload, bytes);
    crypto_generichash_final(&st, h, sizeof(h));
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
        acc[i] ^= h[i];
}

/* The digests the coordinator compares between daemons, whatever release or transport made
 * them, are exactly the documented ones: every message under verify = full, the first
 * RF_XFER_SAMPLE_BYTES of the messages whose seq is a multiple of RF_XFER_SAMPLE_EVERY under
 * sample, none under off; the sent ones on the sender, the received ones on the receiver.
 * Both messages of the pair carry the source matrix as their payload, row-major. */
Test(xfer_hand, digests_are_blake2b_of_seq_and_payload)
{
    static const int verify[3] = {RF_VERIFY_FULL, RF_VERIFY_SAMPLE, RF_VERIFY_OFF};
    size_t n = (size_t)ROWS * COLS * 4;
    uint8_t zero[RF_XFER_DIGEST_BYTES] = {0}, full[RF_XFER_DIGEST_BYTES] = {0};
    uint8_t sample[RF_XFER_DIGEST_BYTES] = {0};
    pair p;
    world w;

    cr_assert_gt(n, RF_XFER_SAMPLE_BYTES, "the sample must cover less than the message");
    pair_init(&p, 3);
    /* Seq 32 is sampled, 33 is not. */
    p.smsgs[0].seq = p.rmsgs[0].seq = 2 * RF_XFER_SAMPLE_EVERY;
    p.smsgs[1].seq = p.rmsgs[1].seq = 2 * RF_XFER_SAMPLE_EVERY + 1;
    digest_ref(p.smsgs[0].seq, p.src, n, full);
    digest_ref(p.smsgs[1].seq, p.src, n, full);
    digest_ref(p.smsgs[0].seq, p.src, RF_XFER_SAMPLE_BYTES, sample);
    cr_assert_neq(memcmp(full, sample, sizeof(zero)), 0);
    world_open(&w, 2);
    for (int v = 0; v < 3; v++) {
        const uint8_t *want = v == 0 ? full : v == 1 ? sample : zero;

        p.sjob.verify = p.rjob.verify = verify[v];
        world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
        cr_assert_eq(w.res[0].code, 0, "%s", w.res[0].error);
        cr_assert_eq(w.res[1].code, 0, "%s", w.res[1].error);
        cr_assert_eq(memcmp(w.res[0].digest_sent, want, sizeof(zero)), 0, "verify %d: sender",
                     verify[v]);
        cr_assert_eq(memcmp(w.res[1].digest_recv, want, sizeof(zero)), 0, "verify %d: receiver",
                     verify[v]);
        cr_assert_eq(memcmp(w.res[0].digest_recv, zero, sizeof(zero)), 0, "verify %d", verify[v]);
        cr_assert_eq(memcmp(w.res[1].digest_sent, zero, sizeof(zero)), 0, "verify %d", verify[v]);
        pair_check(&p);
    }
    world_close(&w);
    pair_free(&p);
}

/* A job its caller marked checked (a daemon's cached slice) whose packed item lies outside its
 * piece all the same: the transport refuses it when it reduces the items, naming the message,
 * before any byte moves, and both sides report the failure. */
Test(xfer_hand, packed_item_outside_its_piece_is_refused)
{
    pair p;
    world w;

    pair_init(&p, 3);
    p.s_items[2].box.start[0] = ROWS;
    p.sjob.checked = true;
    p.rjob.timeout_s = 1; /* it waits for bytes that never come */
    world_open(&w, 2);
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[0].code, -EINVAL, "%d: %s", w.res[0].code, w.res[0].error);
    cr_assert(strstr(w.res[0].error, "message seq 11") &&
              strstr(w.res[0].error, "not inside its piece"), "%s", w.res[0].error);
    cr_assert_eq(w.res[0].bytes_sent, 0);
    cr_assert_neq(w.res[1].code, 0, "the receiver did not notice the sender's failure");
    world_close(&w);
    pair_free(&p);
}

/* A 1-D byte piece of n bytes at base; the item moves [start, start + len). */
static rf_xfer_item item1d(uint8_t *base, uint64_t n, uint64_t start, uint64_t len,
                           uint64_t msg_off)
{
    rf_xfer_item it;

    memset(&it, 0, sizeof(it));
    it.base = base;
    it.ndim = 1;
    it.esize = 1;
    rf_box_full(&it.piece.box, 1, (int64_t[]){(int64_t)n});
    it.piece.strides[0] = 1;
    it.box = it.piece.box;
    it.box.start[0] = (int64_t)start;
    it.box.extent[0] = (int64_t)len;
    it.msg_off = msg_off;
    it.bytes = len;
    return it;
}

typedef struct overlap {
    rf_xfer_job *late;
} overlap;

static overlap ov;

static void poke_start_late(world *w)
{
    rf_err err;

    cr_assert_eq(rf_xfer_run(w->t[1], ov.late, on_done, w, &err), 0, "%s", err.msg);
    w->pending++;
}

/* Daemon 0 sends round 0 to daemon 1, which starts late, and round 1 to daemon 2: round 1 is
 * packed while round 0 still waits on the wire, in the other half of the staging. */
Test(xfer_hand, two_rounds_in_flight_do_not_share_staging)
{
    uint64_t n = 16u << 20;
    uint8_t *src = malloc(2 * n), *d1 = calloc(n, 1), *d2 = calloc(n, 1);
    rf_xfer_item si[2], r1, r2;
    rf_xfer_msg sm[2], m1, m2;
    rf_xfer_job j0, j1, j2;
    world w;

    cr_assert(src && d1 && d2);
    for (uint64_t i = 0; i < 2 * n; i++)
        src[i] = xd_pattern(9, i, 0, 1);
    si[0] = item1d(src, 2 * n, 0, n, 0);
    si[1] = item1d(src, 2 * n, n, n, 0);
    r1 = item1d(d1, n, 0, n, 0);
    r2 = item1d(d2, n, 0, n, 0);
    sm[0] = (rf_xfer_msg){.seq = 0, .round = 0, .kind = RF_PLAN_PACKED, .send = true,
                          .peer = 1, .bytes = n, .nitems = 1, .items = &si[0]};
    sm[1] = (rf_xfer_msg){.seq = 1, .round = 1, .kind = RF_PLAN_PACKED, .send = true,
                          .peer = 2, .bytes = n, .nitems = 1, .items = &si[1]};
    m1 = sm[0];
    m1.send = false;
    m1.peer = 0;
    m1.items = &r1;
    m2 = sm[1];
    m2.send = false;
    m2.peer = 0;
    m2.items = &r2;
    j0 = (rf_xfer_job){.version = 1, .nrounds = 2, .nmsgs = 2, .msgs = sm,
                       .staging_bytes = 2 * n, .timeout_s = 20, .verify = RF_VERIFY_FULL};
    j1 = j0;
    j1.nmsgs = 1;
    j1.msgs = &m1;
    j2 = j1;
    j2.msgs = &m2;
    ov.late = &j1;
    world_open(&w, 3);
    world_run_poke(&w, (rf_xfer_job *[]){&j0, NULL, &j2}, poke_start_late, 150);
    for (int d = 0; d < 3; d++)
        cr_assert_eq(w.res[d].code, 0, "daemon %d: %s", d, w.res[d].error);
    cr_assert_eq(w.res[0].peak_staging, 2 * n, "both rounds were not open at once");
    cr_assert(memcmp(d1, src, n) == 0, "round 0 was overwritten in staging");
    cr_assert(memcmp(d2, src + n, n) == 0);
    digests_agree(&w);
    world_close(&w);
    free(src);
    free(d1);
    free(d2);
}

/* ---- failures --------------------------------------------------------------------------- */

/* Wire format, as the transport writes it (little-endian). */
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static int dial(const char *addr)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    const char *colon = strrchr(addr, ':');
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    cr_assert_geq(fd, 0);
    sa.sin_port = htons((uint16_t)atoi(colon + 1));
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

/* Reads exactly len bytes (5 s at most); returns how many came before EOF or the timeout. */
static size_t read_full(int fd, uint8_t *buf, size_t len)
{
    struct timeval tv = {.tv_sec = 5};
    size_t got = 0;

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    while (got < len) {
        ssize_t n = read(fd, buf + got, len - got);

        if (n <= 0)
            break;
        got += (size_t)n;
    }
    return got;
}

/* Whether the other end closes fd within secs (reading and discarding what comes). */
static bool closed_within(int fd, double secs)
{
    double end = now_s() + secs;
    struct timeval tv = {.tv_usec = 100000};
    uint8_t b[64];

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    while (now_s() < end) {
        ssize_t n = read(fd, b, sizeof(b));

        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return true;
    }
    return false;
}

/* ---- the data protocol (3), written here from its specification ---------------------- */

#define HELLO_BODY 48 /* "RFXH", 3, from, to, the connector's nonce */
#define HELLO_LEN 80  /* body and HMAC-SHA256 */
#define ACK_LEN 36    /* "RFXA" and HMAC-SHA256 */
#define HDR_LEN 24    /* "RFXF", seq, version, bytes */
#define TAG_LEN 16    /* Poly1305 */
#define SEG_LEN (256u << 10)

/* HMAC-SHA256(key, tag with its NUL || acceptor's nonce || hello body). */
static void hs_mac(uint8_t key_fill, const char *tag, const uint8_t nonce[32],
                   const uint8_t body[HELLO_BODY], uint8_t out[32])
{
    uint8_t key[RF_XFER_TCP_KEY_MIN];
    crypto_auth_hmacsha256_state st;

    key_bytes(key_fill, key);
    crypto_auth_hmacsha256_init(&st, key, sizeof(key));
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)tag, strlen(tag) + 1);
    crypto_auth_hmacsha256_update(&st, nonce, 32);
    crypto_auth_hmacsha256_update(&st, body, HELLO_BODY);
    crypto_auth_hmacsha256_final(&st, out);
}

/* The hello of peer `from` to `to` holding key_fill, answering the acceptor's nonce na with
 * its own nonce nc. */
static void make_hello(uint8_t out[HELLO_LEN], uint8_t key_fill, const uint8_t na[32],
                       const uint8_t nc[32], uint32_t from, uint32_t to)
{
    put32(out, 0x48584652u);
    put32(out + 4, 3);
    put32(out + 8, from);
    put32(out + 12, to);
    memcpy(out + 16, nc, 32);
    hs_mac(key_fill, "refit-data-v3 hello", na, out, out + HELLO_BODY);
}

/* One side of an authenticated connection: its frame key and tag counter. */
typedef struct fconn {
    int fd;
    uint8_t key[32];
    uint64_t ctr;
} fconn;

static void fconn_keys(fconn *f, uint8_t key_fill, const uint8_t na[32],
                       const uint8_t hello[HELLO_BODY])
{
    hs_mac(key_fill, "refit-data-v3 frames", na, hello, f->key);
    f->ctr = 0;
}

/* The connection's next tag: Poly1305 under ChaCha20(frame key, nonce = counter)[0..32). */
static void ftag(fconn *f, const uint8_t *p, size_t len, uint8_t out[TAG_LEN])
{
    uint8_t otk[32], n[8];

    put64(n, f->ctr++);
    crypto_stream_chacha20(otk, sizeof(otk), n, f->key);
    crypto_onetimeauth(out, p, len, otk);
}

static void write_all(int fd, const void *buf, size_t len)
{
    cr_assert_eq(write(fd, buf, len), (ssize_t)len);
}

/* Connects to a running transport as peer `from` (to `to`) holding key_fill: reads the
 * nonce, sends the hello. *accepted tells whether an acceptance that proves key_fill came
 * back; then f is ready for frames. */
static fconn auth_dial(const char *addr, uint8_t key_fill, uint32_t from, uint32_t to,
                       bool *accepted)
{
    uint8_t na[32], nc[32], hello[HELLO_LEN], ack[ACK_LEN], want[32];
    fconn f = {.fd = dial(addr)};

    cr_assert_eq(read_full(f.fd, na, sizeof(na)), sizeof(na), "no nonce from %s", addr);
    randombytes_buf(nc, sizeof(nc));
    make_hello(hello, key_fill, na, nc, from, to);
    write_all(f.fd, hello, sizeof(hello));
    hs_mac(key_fill, "refit-data-v3 accept", na, hello, want);
    *accepted = read_full(f.fd, ack, sizeof(ack)) == sizeof(ack) &&
                memcmp(ack, "RFXA", 4) == 0 && memcmp(ack + 4, want, 32) == 0;
    fconn_keys(&f, key_fill, na, hello);
    return f;
}

/* A frame header and its tag. */
static void fake_header(fconn *f, uint32_t magic, uint32_t seq, uint64_t version,
                        uint64_t bytes)
{
    uint8_t h[HDR_LEN + TAG_LEN];

    put32(h, magic);
    put32(h + 4, seq);
    put64(h + 8, version);
    put64(h + 16, bytes);
    ftag(f, h, HDR_LEN, h + HDR_LEN);
    write_all(f->fd, h, sizeof(h));
}

/* `len` bytes of payload from p, in segments each followed by its tag; a last segment cut
 * short by len goes without one. */
static void fake_payload(fconn *f, const uint8_t *p, uint64_t bytes, size_t len)
{
    for (uint64_t off = 0; off < len; off += SEG_LEN) {
        uint64_t seg = bytes - off < SEG_LEN ? bytes - off : SEG_LEN;
        uint8_t tag[TAG_LEN];

        if (off + seg > len) {
            write_all(f->fd, p + off, len - off);
            return;
        }
        ftag(f, p + off, seg, tag);
        write_all(f->fd, p + off, seg);
        write_all(f->fd, tag, sizeof(tag));
    }
}

/* A fake peer `from` that authenticates to daemon `to` (whose job must be running) and writes
 * a frame header, then `len` bytes of (zero) payload. */
static fconn fake_sender(const char *addr, uint32_t from, uint32_t to, uint32_t magic,
                         uint32_t seq, uint64_t version, uint64_t bytes, size_t len)
{
    uint8_t *payload = calloc(len + 1, 1);
    bool accepted;
    fconn f = auth_dial(addr, KEY_A, from, to, &accepted);

    cr_assert(accepted, "the fake peer's hello was not accepted");
    fake_header(&f, magic, seq, version, bytes);
    fake_payload(&f, payload, bytes, len);
    free(payload);
    return f;
}

/* What poke_fake does once daemon 1's job runs: fake_sender as daemon 0 with these, then the
 * same header again when asked (tagged in its place), then `extra` bytes, then close when
 * asked. */
static struct {
    uint32_t magic, seq;
    uint64_t version, bytes;
    size_t len;
    bool twice;
    const uint8_t *extra;
    size_t extra_len;
    bool close_after;
    fconn f;
} fk;

static void fake_set(uint32_t magic, uint32_t seq, uint64_t version, uint64_t bytes, size_t len)
{
    memset(&fk, 0, sizeof(fk));
    fk.magic = magic;
    fk.seq = seq;
    fk.version = version;
    fk.bytes = bytes;
    fk.len = len;
    fk.f.fd = -1;
}

static void poke_fake(world *w)
{
    fk.f = fake_sender(addr_of(w, 1), 0, 1, fk.magic, fk.seq, fk.version, fk.bytes, fk.len);
    if (fk.twice)
        fake_header(&fk.f, fk.magic, fk.seq, fk.version, fk.bytes);
    if (fk.extra_len)
        write_all(fk.f.fd, fk.extra, fk.extra_len);
    if (fk.close_after) {
        close(fk.f.fd);
        fk.f.fd = -1;
    }
}

/* Daemon 1 receives the pair's messages from daemon 0; daemon 0 then runs its side. */
static void good_pair_run(world *w, uint64_t version)
{
    pair p;

    pair_init(&p, version);
    world_run(w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w->res[0].code, 0, "%s", w->res[0].error);
    cr_assert_eq(w->res[1].code, 0, "%s", w->res[1].error);
    pair_check(&p);
    pair_free(&p);
}

Test(xfer_fail, sender_dies_mid_payload_then_good_job)
{
    pair p;
    world w;

    pair_init(&p, 3);
    world_open(&w, 2);
    /* Daemon 0 dies after 1000 bytes of message seq 10. */
    fake_set(0x46584652u, 10, 3, p.rmsgs[0].bytes, 1000);
    fk.close_after = true;
    world_run_poke(&w, (rf_xfer_job *[]){NULL, &p.rjob}, poke_fake, 1);
    cr_assert_eq(w.res[1].code, -ECONNRESET, "%d %s", w.res[1].code, w.res[1].error);
    cr_assert(strstr(w.res[1].error, "seq 10") && strstr(w.res[1].error, "peer 0") &&
              strstr(w.res[1].error, "1000 of"), "%s", w.res[1].error);
    pair_free(&p);
    good_pair_run(&w, 4);
    world_close(&w);
}

static fconn second;

static void poke_reconnect(world *w)
{
    bool accepted;

    poke_fake(w);
    usleep(100000);
    second = auth_dial(addr_of(w, 1), KEY_A, 0, 1, &accepted);
    cr_assert(!accepted, "a reconnection in the middle of a message was accepted");
}

/* Daemon 0 stalls inside a message, then connects again (authenticated): its old stream
 * cannot be resumed. */
Test(xfer_fail, reconnect_mid_message_fails)
{
    pair p;
    world w;

    pair_init(&p, 3);
    world_open(&w, 2);
    fake_set(0x46584652u, 10, 3, p.rmsgs[0].bytes, 500);
    world_run_poke(&w, (rf_xfer_job *[]){NULL, &p.rjob}, poke_reconnect, 1);
    cr_assert_eq(w.res[1].code, -ECONNRESET, "%s", w.res[1].error);
    cr_assert(strstr(w.res[1].error, "reconnected") && strstr(w.res[1].error, "seq 10"), "%s",
              w.res[1].error);
    close(fk.f.fd);
    close(second.fd);
    pair_free(&p);
    good_pair_run(&w, 4);
    world_close(&w);
}

Test(xfer_fail, bad_magic_and_unexpected_seq)
{
    struct {
        uint32_t magic, seq;
        uint64_t bytes;
        int code;
        const char *says;
    } cases[] = {
        {0xdeadbeef, 10, ROWS * COLS * 4, -EPROTO, "magic 0xdeadbeef"},
        {0x46584652u, 99, 16, -EPROTO, "seq 99"},
        {0x46584652u, 10, 16, -EPROTO, "16 bytes"},
        {0x46584652u, 11, ROWS * COLS * 4, -EPROTO, "round 2"},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        pair p;
        world w;

        pair_init(&p, 3);
        /* Rounds 0 and 1 are open, so seq 11 moved to round 2 is early. */
        p.rmsgs[1].round = 2;
        p.rjob.nrounds = 3;
        world_open(&w, 2);
        fake_set(cases[i].magic, cases[i].seq, 3, cases[i].bytes, 0);
        world_run_poke(&w, (rf_xfer_job *[]){NULL, &p.rjob}, poke_fake, 1);
        close(fk.f.fd);
        cr_assert_eq(w.res[1].code, cases[i].code, "case %zu: %s", i, w.res[1].error);
        cr_assert(strstr(w.res[1].error, cases[i].says) && strstr(w.res[1].error, "peer 0"),
                  "case %zu: %s", i, w.res[1].error);
        good_pair_run(&w, 4);
        world_close(&w);
        pair_free(&p);
    }
}

/* Message seq 10 shrunk to one row (4 KiB) so that a fake peer can write it whole. */
static void pair_small_direct(pair *p)
{
    p->r_items[0] = item2d((uint8_t *)p->dst_direct, ROWS, COLS, NULL, 0, 1, 0);
    p->rmsgs[0].bytes = COLS * 4;
}

Test(xfer_fail, same_message_twice)
{
    pair p;
    world w;

    pair_init(&p, 3);
    pair_small_direct(&p);
    world_open(&w, 2);
    /* The second header is tagged in its place: the transport itself sees the same seq. */
    fake_set(0x46584652u, 10, 3, COLS * 4, COLS * 4);
    fk.twice = true;
    world_run_poke(&w, (rf_xfer_job *[]){NULL, &p.rjob}, poke_fake, 1);
    cr_assert_eq(w.res[1].code, -EPROTO, "%s", w.res[1].error);
    cr_assert(strstr(w.res[1].error, "seq 10 twice"), "%s", w.res[1].error);
    /* The first copy was installed, the job still failed. */
    cr_assert_eq(w.res[1].bytes_recv, COLS * 4);
    close(fk.f.fd);
    pair_free(&p);
    good_pair_run(&w, 4);
    world_close(&w);
}

Test(xfer_fail, peer_dies_inside_a_header)
{
    pair p;
    world w;
    uint8_t buf[10];

    pair_init(&p, 3);
    pair_small_direct(&p);
    world_open(&w, 2);
    /* One whole message, then 10 bytes of the next header. */
    memset(buf, 0, sizeof(buf));
    fake_set(0x46584652u, 10, 3, COLS * 4, COLS * 4);
    fk.extra = buf;
    fk.extra_len = sizeof(buf);
    fk.close_after = true;
    world_run_poke(&w, (rf_xfer_job *[]){NULL, &p.rjob}, poke_fake, 1);
    cr_assert_eq(w.res[1].code, -ECONNRESET, "%s", w.res[1].error);
    cr_assert(strstr(w.res[1].error, "inside a frame header") &&
              strstr(w.res[1].error, "seq 11 expected"), "%s", w.res[1].error);
    pair_free(&p);
    good_pair_run(&w, 4);
    world_close(&w);
}

/* A connection that is not one of ours (bad hello) is dropped without failing the job. */
Test(xfer_fail, stranger_connection_is_ignored)
{
    world w;
    int fd;

    world_open(&w, 2);
    fd = dial(addr_of(&w, 1));
    cr_assert_eq(write(fd, "GET / HTTP/1.0\r\n\r\n", 18), 18);
    good_pair_run(&w, 1);
    close(fd);
    world_close(&w);
}

Test(xfer_fail, version_mismatch_then_good_job)
{
    pair p;
    world w;

    pair_init(&p, 5);
    p.rjob.version = 6;
    world_open(&w, 2);
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[1].code, -ESTALE, "%s", w.res[1].error);
    cr_assert(strstr(w.res[1].error, "version 5") && strstr(w.res[1].error, "seq 10"), "%s",
              w.res[1].error);
    /* Nothing of version 5 was installed. */
    for (size_t i = 0; i < (size_t)ROWS * COLS; i++)
        cr_assert_eq(p.dst_t[i], 0.0f);
    pair_free(&p);
    good_pair_run(&w, 7);
    good_pair_run(&w, 8);
    world_close(&w);
}

Test(xfer_fail, deadline_names_the_missing_message)
{
    pair p;
    world w;
    double t0;

    pair_init(&p, 1);
    p.rjob.timeout_s = 0.3;
    world_open(&w, 2);
    t0 = now_s();
    world_run(&w, (rf_xfer_job *[]){NULL, &p.rjob});
    cr_assert_eq(w.res[1].code, -ETIMEDOUT, "%s", w.res[1].error);
    cr_assert(now_s() - t0 < 2.0);
    cr_assert(strstr(w.res[1].error, "seq 10") && strstr(w.res[1].error, "peer 0"), "%s",
              w.res[1].error);
    pair_free(&p);
    good_pair_run(&w, 2);
    world_close(&w);
}

static void poke_abort(world *w)
{
    rf_xfer_abort(w->t[w->poke_target]);
}

Test(xfer_fail, abort_is_prompt_then_good_job)
{
    pair p;
    world w;
    double t0;

    pair_init(&p, 1);
    p.rjob.timeout_s = 20;
    world_open(&w, 2);
    rf_xfer_abort(w.t[1]); /* no job: nothing happens, and the next job is not hit */
    w.poke_target = 1;
    t0 = now_s();
    world_run_poke(&w, (rf_xfer_job *[]){NULL, &p.rjob}, poke_abort, 50);
    cr_assert_eq(w.res[1].code, -ECANCELED, "%s", w.res[1].error);
    cr_assert(now_s() - t0 < 2.0, "abort took %.2f s", now_s() - t0);
    cr_assert(strstr(w.res[1].error, "seq 10"), "%s", w.res[1].error);
    pair_free(&p);
    good_pair_run(&w, 2);
    world_close(&w);
}

/* The receiver of a large message goes away while the sender is blocked on it: the sender
 * fails naming the peer and the message; a restarted peer (new address) then works. */
static void poke_kill(world *w)
{
    rf_xfer_close(w->t[w->poke_target], NULL, NULL);
}

Test(xfer_fail, receiver_dies_while_sender_blocked)
{
    size_t n = 32u << 20;
    uint8_t *big = malloc(n), *sink = malloc(n);
    rf_xfer_item si, ri, gi;
    rf_xfer_msg sm, rm[2];
    rf_xfer_job sj, rj;
    world w;
    rf_err err;

    cr_assert(big && sink);
    memset(big, 0x5a, n);
    memset(&si, 0, sizeof(si));
    si.base = big;
    si.ndim = 1;
    si.esize = 1;
    rf_box_full(&si.piece.box, 1, (int64_t[]){(int64_t)n});
    si.piece.strides[0] = 1;
    si.box = si.piece.box;
    si.bytes = n;
    ri = si;
    ri.base = sink;
    gi = ri;
    sm = (rf_xfer_msg){.seq = 1, .round = 2, .kind = RF_PLAN_DIRECT, .send = true, .peer = 1,
                       .bytes = n, .nitems = 1, .items = &si};
    /* The receiver first waits, in round 0, for a message daemon 2 never sends, so it does
     * not read daemon 0's round-2 message and daemon 0 blocks on a full socket. */
    rm[0] = (rf_xfer_msg){.seq = 0, .round = 0, .kind = RF_PLAN_DIRECT, .send = false,
                          .peer = 2, .bytes = n, .nitems = 1, .items = &gi};
    rm[1] = sm;
    rm[1].send = false;
    rm[1].peer = 0;
    rm[1].items = &ri;
    sj = (rf_xfer_job){.version = 1, .nrounds = 3, .nmsgs = 1, .msgs = &sm, .timeout_s = 20};
    rj = (rf_xfer_job){.version = 1, .nrounds = 3, .nmsgs = 2, .msgs = rm, .timeout_s = 20,
                       .staging_bytes = 1};
    world_open(&w, 3);
    w.poke_target = 1;
    world_run_poke(&w, (rf_xfer_job *[]){&sj, &rj, NULL}, poke_kill, 200);
    cr_assert_lt(w.res[0].code, 0);
    cr_assert(w.res[0].code == -ECONNRESET || w.res[0].code == -EPIPE, "%s", w.res[0].error);
    cr_assert(strstr(w.res[0].error, "seq 1 ") && strstr(w.res[0].error, "peer 1"), "%s",
              w.res[0].error);
    cr_assert_eq(w.res[1].code, -ECANCELED, "%s", w.res[1].error);
    w.t[1] = NULL;
    /* Daemon 1 restarts on a new port; daemon 0 reconnects to it. */
    cr_assert_eq(rf_xfer_tcp_new(&w.loop, "127.0.0.1:0", &w.t[1], &err), 0, "%s", err.msg);
    set_key(w.t[1], KEY_A);
    world_set_peers(&w);
    rj.nmsgs = 1;
    rj.msgs = &rm[1];
    rm[1].round = 0;
    sm.round = 0;
    sj.nrounds = rj.nrounds = 1;
    memset(sink, 0, n);
    world_run(&w, (rf_xfer_job *[]){&sj, &rj, NULL});
    cr_assert_eq(w.res[0].code, 0, "%s", w.res[0].error);
    cr_assert_eq(w.res[1].code, 0, "%s", w.res[1].error);
    cr_assert(memcmp(big, sink, n) == 0);
    world_close(&w);
    free(big);
    free(sink);
}

Test(xfer_fail, close_while_running_reports_then_frees)
{
    pair p;
    world w;

    pair_init(&p, 1);
    world_open(&w, 2);
    w.poke_target = 1;
    world_run_poke(&w, (rf_xfer_job *[]){NULL, &p.rjob}, poke_kill, 30);
    cr_assert(w.got[1]);
    cr_assert_eq(w.res[1].code, -ECANCELED, "%s", w.res[1].error);
    w.t[1] = NULL;
    world_close(&w);
    pair_free(&p);
}

Test(xfer_fail, connect_refused_names_the_peer)
{
    pair p;
    world w;
    const char *addrs[2];
    char dead[64];
    int fd;
    struct sockaddr_in sa;
    socklen_t sl = sizeof(sa);
    rf_err err;

    /* A port that was bound a moment ago and is closed now. */
    fd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    snprintf(dead, sizeof(dead), "127.0.0.1:%u", ntohs(sa.sin_port));
    close(fd);
    pair_init(&p, 1);
    world_open(&w, 2);
    addrs[0] = addr_of(&w, 0);
    addrs[1] = dead;
    cr_assert_eq(rf_xfer_set_peers(w.t[0], 0, 2, addrs, &err), 0, "%s", err.msg);
    world_run(&w, (rf_xfer_job *[]){&p.sjob, NULL});
    cr_assert_eq(w.res[0].code, -ECONNREFUSED, "%s", w.res[0].error);
    cr_assert(strstr(w.res[0].error, dead) && strstr(w.res[0].error, "seq 10"), "%s",
              w.res[0].error);
    world_set_peers(&w);
    pair_free(&p);
    good_pair_run(&w, 2);
    world_close(&w);
}

/* ---- authentication of data connections ------------------------------------------------- */

static int listen_local(char *addr, size_t len)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    struct timeval tv = {.tv_sec = 5};
    socklen_t sl = sizeof(sa);
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    cr_assert_geq(fd, 0);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(listen(fd, 8), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    /* accept gives up after 5 s rather than hang the loop thread. */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    snprintf(addr, len, "127.0.0.1:%u", ntohs(sa.sin_port));
    return fd;
}

/* Log lines go to a file the test reads back. */
static int log_capture(void)
{
    char path[] = "/tmp/test_xfer_log.XXXXXX";
    int fd = mkstemp(path);

    cr_assert_geq(fd, 0);
    unlink(path);
    rf_log_set_fd(fd);
    return fd;
}

static char *log_release(int fd)
{
    off_t n = lseek(fd, 0, SEEK_END);
    char *text = calloc((size_t)n + 1, 1);

    rf_log_set_fd(2);
    cr_assert_not_null(text);
    cr_assert_eq(pread(fd, text, (size_t)n, 0), (ssize_t)n);
    close(fd);
    return text;
}

static size_t count_of(const char *text, const char *what)
{
    size_t k = 0;

    for (const char *p = strstr(text, what); p; p = strstr(p + 1, what))
        k++;
    return k;
}

/* A stand-in for daemon 1 that daemon 0 connects to: it closes at once, or sends a nonce and
 * takes the hello (keeping it), then closes or answers something that is no acceptance, or an
 * acceptance that does not prove the cluster key: under another key, or the proof of another
 * connection (as a replayed one would be). It then counts what daemon 0 sends until it hangs
 * up. */
enum { ACC_CLOSE, ACC_TAKE_HELLO, ACC_BAD_ACK, ACC_OTHER_KEY, ACC_STALE_PROOF };

static struct {
    int lfd, how;
    uint8_t nonce[32], hello[HELLO_LEN];
    size_t got, after;
} fa;

static void poke_fake_acceptor(world *w)
{
    int fd = accept(fa.lfd, NULL, NULL);
    uint8_t ack[ACK_LEN], other[HELLO_LEN], sink[4096];
    ssize_t n;

    (void)w;
    cr_assert_geq(fd, 0, "daemon 0 did not connect");
    fa.got = fa.after = 0;
    if (fa.how != ACC_CLOSE) {
        randombytes_buf(fa.nonce, sizeof(fa.nonce));
        write_all(fd, fa.nonce, sizeof(fa.nonce));
        fa.got = read_full(fd, fa.hello, sizeof(fa.hello));
        memcpy(ack, "RFXA", 4);
        memcpy(other, fa.hello, sizeof(other));
        other[16] ^= 1; /* another connector nonce: another connection's hello */
        if (fa.how == ACC_BAD_ACK)
            write_all(fd, "NOPE", 4);
        if (fa.how == ACC_OTHER_KEY)
            hs_mac(KEY_B, "refit-data-v3 accept", fa.nonce, fa.hello, ack + 4);
        if (fa.how == ACC_STALE_PROOF)
            hs_mac(KEY_A, "refit-data-v3 accept", fa.nonce, other, ack + 4);
        if (fa.how == ACC_OTHER_KEY || fa.how == ACC_STALE_PROOF) {
            write_all(fd, ack, sizeof(ack));
            /* read_full's 5 s receive timeout bounds this: daemon 0 must hang up first. */
            while ((n = read(fd, sink, sizeof(sink))) > 0)
                fa.after += (size_t)n;
            cr_assert_eq(n, 0, "daemon 0 neither sent nor hung up: %s", strerror(errno));
        }
    }
    close(fd);
}

/* Daemon 0 sends to an impostor of daemon 1 (at fake) and captures its hello in fa. */
static void run_against_fake(world *w, int how, const char *fake, rf_xfer_job *job)
{
    const char *addrs[2] = {addr_of(w, 0), fake};
    rf_err err;

    fa.how = how;
    cr_assert_eq(rf_xfer_set_peers(w->t[0], 0, 2, addrs, &err), 0, "%s", err.msg);
    world_run_poke(w, (rf_xfer_job *[]){job, NULL, NULL}, poke_fake_acceptor, 1);
}

/* The connector's side: a peer that sends no nonce, one that takes the hello and hangs up,
 * one that answers with no acceptance, and two impostors whose acceptance does not prove the
 * key (they hold another one, or replay another connection's); each fails the job naming the
 * peer and the message, and the impostors get not one byte after the hello. The hello it took
 * is the spec's, byte for byte. */
Test(xfer_auth, connector_names_a_peer_that_refuses)
{
    struct {
        int how, code;
        const char *says;
    } cases[] = {
        {ACC_CLOSE, -ECONNRESET, "sent no challenge"},
        {ACC_TAKE_HELLO, -EACCES, "different cluster key"},
        {ACC_BAD_ACK, -EPROTO, "not an acceptance"},
        {ACC_OTHER_KEY, -EACCES, "without proving the cluster key"},
        {ACC_STALE_PROOF, -EACCES, "nothing was sent to it"},
    };
    world w;

    world_open(&w, 2);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char fake[64];
        uint8_t want[HELLO_LEN];
        pair p;

        pair_init(&p, 1);
        fa.lfd = listen_local(fake, sizeof(fake));
        run_against_fake(&w, cases[i].how, fake, &p.sjob);
        cr_assert_eq(w.res[0].code, cases[i].code, "case %zu: %s", i, w.res[0].error);
        cr_assert(strstr(w.res[0].error, cases[i].says) && strstr(w.res[0].error, "peer 1") &&
                  strstr(w.res[0].error, fake) && strstr(w.res[0].error, "seq 10"),
                  "case %zu: %s", i, w.res[0].error);
        cr_assert_eq(w.res[0].bytes_sent, 0, "case %zu", i);
        cr_assert_eq(fa.after, 0, "case %zu: %zu bytes went to an impostor", i, fa.after);
        if (cases[i].how != ACC_CLOSE) {
            cr_assert_eq(fa.got, sizeof(fa.hello), "case %zu: hello of %zu bytes", i, fa.got);
            make_hello(want, KEY_A, fa.nonce, fa.hello + 16, 0, 1);
            cr_assert(memcmp(fa.hello, want, sizeof(want)) == 0,
                      "case %zu: the hello is not {RFXH, 3, 0, 1, nc, HMAC(key, tag||na||body)}",
                      i);
        }
        close(fa.lfd);
        pair_free(&p);
    }
    world_set_peers(&w);
    good_pair_run(&w, 2);
    world_close(&w);
}

/* The three-daemon job of the attack test: daemon 0 sends seq 0, 2, 3 (rounds 0, 1, 2) to
 * daemon 1, daemon 2 sends seq 1 (round 0), started late by the attacks' poke. Round 2 waits
 * for it, so daemon 0's seq 3 waits on an authenticated connection that sits idle between
 * frames: the state in which a forged hello used to replace it. */
#define ATK_N (1u << 20)

static struct {
    rf_xfer_job *late;
    uint8_t captured[HELLO_LEN];
} atk;

static void poke_attacks(world *w)
{
    const char *a1 = addr_of(w, 1);
    uint8_t nonce[32], nc[32] = {0}, hello[HELLO_LEN], old[48];
    bool accepted;
    int silent, fd;
    fconn f;
    double t0;
    rf_err err;

    /* Connected, then silent: only the hello timeout ends it. */
    silent = dial(a1);
    cr_assert_eq(read_full(silent, nonce, sizeof(nonce)), sizeof(nonce));
    t0 = now_s();
    /* A hello as daemon 0 with the MAC of another key. */
    f = auth_dial(a1, KEY_B, 0, 1, &accepted);
    cr_assert(!accepted, "a hello under another key was accepted");
    cr_assert(closed_within(f.fd, 2));
    close(f.fd);
    /* The hello captured from daemon 0's real connection, replayed against a fresh nonce. */
    fd = dial(a1);
    cr_assert_eq(read_full(fd, nonce, sizeof(nonce)), sizeof(nonce));
    cr_assert(memcmp(nonce, fa.nonce, sizeof(nonce)) != 0);
    write_all(fd, atk.captured, sizeof(atk.captured));
    cr_assert(closed_within(fd, 2), "a replayed hello was not dropped");
    close(fd);
    /* The hello of the previous release (protocol 2), as daemon 0. */
    fd = dial(a1);
    cr_assert_eq(read_full(fd, nonce, sizeof(nonce)), sizeof(nonce));
    memset(old, 0, sizeof(old));
    put32(old, 0x48584652u);
    put32(old + 4, 2);
    put32(old + 8, 0);
    put32(old + 12, 1);
    write_all(fd, old, sizeof(old));
    cr_assert(closed_within(fd, 2), "an old hello was not dropped");
    close(fd);
    /* A hello with the right key, but for daemon 2. */
    f = auth_dial(a1, KEY_A, 0, 2, &accepted);
    cr_assert(!accepted, "a hello for another daemon was accepted");
    close(f.fd);
    /* Half a hello, then gone. */
    fd = dial(a1);
    cr_assert_eq(read_full(fd, nonce, sizeof(nonce)), sizeof(nonce));
    make_hello(hello, KEY_A, nonce, nc, 0, 1);
    write_all(fd, hello, 20);
    close(fd);
    cr_assert(closed_within(silent, 8), "a silent connection outlived the hello timeout");
    cr_assert(now_s() - t0 > 4.5, "a silent connection was dropped after %.1f s",
              now_s() - t0);
    close(silent);
    cr_assert_eq(rf_xfer_run(w->t[2], atk.late, on_done, w, &err), 0, "%s", err.msg);
    w->pending++;
}

Test(xfer_auth, forged_replayed_and_old_hellos_leave_the_job_alone)
{
    uint8_t *src = malloc(4 * ATK_N), *dst = calloc(4, ATK_N);
    rf_xfer_item si[4], ri[4];
    rf_xfer_msg s0[3], s2, r1[4];
    rf_xfer_job j0, j1, j2;
    char fake[64], *log;
    world w;
    pair p;
    int logfd;

    cr_assert(src && dst);
    for (uint64_t i = 0; i < 4 * ATK_N; i++)
        src[i] = xd_pattern(5, i, 0, 9);
    for (uint32_t q = 0; q < 4; q++) {
        /* seq q: bytes [q * ATK_N, (q + 1) * ATK_N) */
        si[q] = item1d(src, 4 * ATK_N, q * ATK_N, ATK_N, 0);
        ri[q] = item1d(dst, 4 * ATK_N, q * ATK_N, ATK_N, 0);
        r1[q] = (rf_xfer_msg){.seq = q, .round = q == 0 ? 0 : q - 1, .kind = RF_PLAN_DIRECT,
                              .peer = q == 1 ? 2 : 0, .bytes = ATK_N, .nitems = 1,
                              .items = &ri[q]};
    }
    for (uint32_t k = 0; k < 3; k++) {
        uint32_t q = k == 0 ? 0 : k + 1;

        s0[k] = r1[q];
        s0[k].send = true;
        s0[k].peer = 1;
        s0[k].items = &si[q];
    }
    s2 = r1[1];
    s2.send = true;
    s2.peer = 1;
    s2.items = &si[1];
    j0 = (rf_xfer_job){.version = 9, .nrounds = 3, .nmsgs = 3, .msgs = s0, .timeout_s = 20,
                       .verify = RF_VERIFY_FULL};
    j1 = j0;
    j1.nmsgs = 4;
    j1.msgs = r1;
    j2 = j0;
    j2.nmsgs = 1;
    j2.msgs = &s2;
    atk.late = &j2;

    world_open(&w, 3);
    /* A hello from daemon 0's real connection, captured by an impostor of daemon 1. */
    pair_init(&p, 1);
    fa.lfd = listen_local(fake, sizeof(fake));
    run_against_fake(&w, ACC_TAKE_HELLO, fake, &p.sjob);
    cr_assert_eq(fa.got, sizeof(atk.captured));
    memcpy(atk.captured, fa.hello, sizeof(atk.captured));
    close(fa.lfd);
    pair_free(&p);
    world_set_peers(&w);

    logfd = log_capture();
    world_run_poke(&w, (rf_xfer_job *[]){&j0, &j1, NULL}, poke_attacks, 300);
    log = log_release(logfd);
    for (int d = 0; d < 3; d++)
        cr_assert_eq(w.res[d].code, 0, "daemon %d: %s", d, w.res[d].error);
    cr_assert_eq(w.res[1].bytes_recv, 4ull * ATK_N);
    cr_assert(memcmp(src, dst, 4 * ATK_N) == 0, "bytes differ after the attacks");
    digests_agree(&w);
    /* Each one was dropped and logged with where it came from. */
    cr_assert_eq(count_of(log, "dropped the data connection from 127.0.0.1:"), 6, "%s", log);
    cr_assert_eq(count_of(log, "claims to be peer 0") , 2, "%s", log);
    cr_assert(strstr(log, "fails authentication"), "%s", log);
    cr_assert(strstr(log, "magic 0x48584652, protocol 2"), "%s", log);
    cr_assert(strstr(log, "from peer 0 to peer 2"), "%s", log);
    cr_assert(strstr(log, "closed after 20 of the 80 bytes"), "%s", log);
    cr_assert(strstr(log, "no complete hello within 5 s (0 of 80 bytes)"), "%s", log);
    free(log);
    world_close(&w);
    free(src);
    free(dst);
}

/* Daemons with different keys cannot run a job; each side says why. A key change closes the
 * connections made under the old key, so the first job here does not carry over. */
Test(xfer_auth, different_keys_cannot_run_a_job)
{
    pair p;
    world w;

    world_open(&w, 2);
    good_pair_run(&w, 1);
    set_key(w.t[1], KEY_B);
    pair_init(&p, 2);
    p.rjob.timeout_s = 1;
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[0].code, -EACCES, "%s", w.res[0].error);
    cr_assert(strstr(w.res[0].error, "peer 1") && strstr(w.res[0].error, addr_of(&w, 1)) &&
              strstr(w.res[0].error, "different cluster key"), "%s", w.res[0].error);
    cr_assert_eq(w.res[1].code, -ETIMEDOUT, "%s", w.res[1].error);
    cr_assert(strstr(w.res[1].error, "claiming to be peer 0 failed authentication"), "%s",
              w.res[1].error);
    for (size_t i = 0; i < (size_t)ROWS * COLS; i++)
        cr_assert_eq(p.dst_t[i], 0.0f);
    pair_free(&p);
    set_key(w.t[1], KEY_A);
    good_pair_run(&w, 3);
    world_close(&w);
}

Test(xfer_auth, no_key_is_refused_and_bad_keys)
{
    rf_xfer_transport *bare = NULL;
    uint8_t k[RF_XFER_TCP_KEY_MIN];
    const char *addrs[2];
    pair p;
    world w;
    rf_err err;

    pair_init(&p, 1);
    world_open(&w, 2);
    cr_assert_eq(rf_xfer_tcp_new(&w.loop, "127.0.0.1:0", &bare, &err), 0, "%s", err.msg);
    addrs[0] = rf_xfer_tcp_addr(bare);
    addrs[1] = addr_of(&w, 1);
    cr_assert_eq(rf_xfer_set_peers(bare, 0, 2, addrs, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_run(bare, &p.sjob, on_done, &w, &err), -ENOKEY);
    cr_assert(strstr(err.msg, "no cluster key") && strstr(err.msg, "rf_xfer_tcp_set_key"), "%s",
              err.msg);
    key_bytes(KEY_A, k);
    cr_assert_eq(rf_xfer_tcp_set_key(bare, k, sizeof(k) - 1), -EINVAL);
    cr_assert_eq(rf_xfer_tcp_set_key(bare, NULL, sizeof(k)), -EINVAL);
    cr_assert_eq(rf_xfer_tcp_set_key(NULL, k, sizeof(k)), -EINVAL);
    cr_assert_eq(rf_xfer_run(bare, &p.sjob, on_done, &w, &err), -ENOKEY);
    rf_xfer_close(bare, NULL, NULL);
    cr_assert_eq(rf_xfer_tcp_set_key(bare, k, sizeof(k)), -EBUSY);
    /* While a job runs the key stays. */
    p.rjob.timeout_s = 0.2;
    cr_assert_eq(rf_xfer_run(w.t[1], &p.rjob, on_done, &w, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_tcp_set_key(w.t[1], k, sizeof(k)), -EBUSY);
    w.pending = 1;
    uv_timer_start(&w.guard, on_guard, 30000, 0);
    uv_run(&w.loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w.guard);
    cr_assert_eq(w.res[1].code, -ETIMEDOUT);
    world_close(&w);
    pair_free(&p);
}

/* A connection reset as soon as it is made cannot take its nonce (the reset came before the
 * listener was served) or send its hello (the nonce went first): either way it is dropped and
 * logged at once, job or not, and the next job runs. */
Test(xfer_auth, reset_before_accept_is_dropped)
{
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    world w;
    char *log = NULL;
    int fd, logfd;
    double end;

    world_open(&w, 2);
    logfd = log_capture();
    fd = dial(addr_of(&w, 1));
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
    for (end = now_s() + 5.0; now_s() < end; usleep(10000)) {
        off_t n = lseek(logfd, 0, SEEK_END);

        free(log);
        log = calloc((size_t)n + 1, 1);
        cr_assert_not_null(log);
        cr_assert_eq(pread(logfd, log, (size_t)n, 0), (ssize_t)n);
        if (strstr(log, "sending its challenge failed") ||
            strstr(log, "it was reset before it sent its hello"))
            break;
    }
    free(log);
    log = log_release(logfd);
    cr_assert(strstr(log, "sending its challenge failed") ||
              strstr(log, "it was reset before it sent its hello"), "%s", log);
    free(log);
    good_pair_run(&w, 1);
    world_close(&w);
}

/* ---- an attacker on the path ------------------------------------------------------------ */

/* A relay between daemon 0 and daemon 1 on a thread of its own: daemon 0's peer table names
 * it as daemon 1, and it connects every connection it accepts to the real daemon 1 and
 * forwards both ways. To the bytes daemon 0 sends after its hello (frame offsets, 0 = the
 * first byte of the first frame) it does what `how` says; it keeps the first rec_cap of them
 * from its first connection. */
enum { MITM_PASS, MITM_FLIP, MITM_REPLAY, MITM_INJECT_OLD };

typedef struct mitm {
    int lfd, stop[2];
    char addr[64], target[64];
    pthread_t th;
    int how;
    uint64_t at;   /* FLIP: the byte flipped. REPLAY: where [0, at) is sent a second time. */
    uint8_t *rec;  /* INJECT_OLD: sent right after the hello of every later connection */
    uint64_t rec_cap;
    int conns;
} mitm;

static bool send_all(int fd, const uint8_t *p, size_t len)
{
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);

        if (n <= 0)
            return false;
        p += n;
        len -= (size_t)n;
    }
    return true;
}

/* Forwards n bytes of connection `conn` from daemon 0, the stream's first *off bytes being
 * gone already, doing the attack on the way. */
static bool mitm_forward(mitm *m, int afd, int conn, uint8_t *buf, size_t n, uint64_t *off)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t a = *off + i;

        if (a < HELLO_LEN)
            continue;
        if (conn == 0 && a - HELLO_LEN < m->rec_cap)
            m->rec[a - HELLO_LEN] = buf[i];
        if (m->how == MITM_FLIP && conn == 0 && a - HELLO_LEN == m->at)
            buf[i] ^= 0x01;
    }
    while (n > 0) {
        /* Cut at the points where something is slipped in. */
        uint64_t cut = n;

        if (*off < HELLO_LEN && HELLO_LEN - *off < cut)
            cut = HELLO_LEN - *off;
        if (m->how == MITM_REPLAY && conn == 0 && *off < HELLO_LEN + m->at &&
            HELLO_LEN + m->at - *off < cut)
            cut = HELLO_LEN + m->at - *off;
        if (!send_all(afd, buf, cut))
            return false;
        buf += cut;
        n -= cut;
        *off += cut;
        if (*off == HELLO_LEN && m->how == MITM_INJECT_OLD && conn > 0 &&
            !send_all(afd, m->rec, m->rec_cap))
            return false;
        if (m->how == MITM_REPLAY && conn == 0 && *off == HELLO_LEN + m->at &&
            !send_all(afd, m->rec, m->at))
            return false;
    }
    return true;
}

/* Relays one connection until either end or the test hangs up. */
static void mitm_relay(mitm *m, int cfd, int afd, int conn)
{
    static uint8_t buf[64 << 10];
    uint64_t off = 0;

    for (;;) {
        struct pollfd pf[3] = {{.fd = cfd, .events = POLLIN}, {.fd = afd, .events = POLLIN},
                               {.fd = m->stop[0], .events = POLLIN}};
        ssize_t n;

        if (poll(pf, 3, -1) < 0 || pf[2].revents)
            return;
        if (pf[1].revents) {
            n = read(afd, buf, sizeof(buf));
            if (n <= 0 || !send_all(cfd, buf, (size_t)n))
                return;
        }
        if (pf[0].revents) {
            n = read(cfd, buf, sizeof(buf));
            if (n <= 0 || !mitm_forward(m, afd, conn, buf, (size_t)n, &off))
                return;
        }
    }
}

static void *mitm_main(void *arg)
{
    mitm *m = arg;

    for (;;) {
        struct pollfd pf[2] = {{.fd = m->lfd, .events = POLLIN},
                               {.fd = m->stop[0], .events = POLLIN}};
        int cfd, afd;

        if (poll(pf, 2, -1) < 0 || pf[1].revents)
            return NULL;
        if ((cfd = accept(m->lfd, NULL, NULL)) < 0)
            continue;
        afd = socket(AF_INET, SOCK_STREAM, 0);
        {
            struct sockaddr_in sa = {.sin_family = AF_INET};

            sa.sin_port = htons((uint16_t)atoi(strrchr(m->target, ':') + 1));
            inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
            if (connect(afd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
                mitm_relay(m, cfd, afd, m->conns);
        }
        m->conns++;
        close(cfd);
        close(afd);
    }
}

/* Starts the relay and puts it in daemon 0's peer table in place of daemon 1. */
static void mitm_start(mitm *m, world *w, int how, uint64_t at, uint64_t rec_cap)
{
    const char *addrs[2];
    rf_err err;

    memset(m, 0, sizeof(*m));
    m->how = how;
    m->at = at;
    m->rec_cap = rec_cap;
    m->rec = calloc(rec_cap + 1, 1);
    cr_assert_not_null(m->rec);
    m->lfd = listen_local(m->addr, sizeof(m->addr));
    snprintf(m->target, sizeof(m->target), "%s", addr_of(w, 1));
    cr_assert_eq(pipe(m->stop), 0);
    cr_assert_eq(pthread_create(&m->th, NULL, mitm_main, m), 0);
    addrs[0] = addr_of(w, 0);
    addrs[1] = m->addr;
    cr_assert_eq(rf_xfer_set_peers(w->t[0], 0, 2, addrs, &err), 0, "%s", err.msg);
}

static void mitm_stop(mitm *m, world *w)
{
    cr_assert_eq(write(m->stop[1], "x", 1), 1);
    pthread_join(m->th, NULL);
    close(m->stop[0]);
    close(m->stop[1]);
    close(m->lfd);
    free(m->rec);
    world_set_peers(w);
}

/* The pair's frames on daemon 0's connection: seq 10 (direct, 1 MiB: four segments), then
 * seq 11 (packed, the same size). */
#define SEG_WIRE ((uint64_t)SEG_LEN + TAG_LEN)
#define F10 ((uint64_t)HDR_LEN + TAG_LEN + 4 * SEG_WIRE)

/* Elements of the pair's two destinations that hold their source value (installed) and that
 * hold neither it nor the initial 0 (wrong). */
static void pair_count(const pair *p, uint64_t *direct, uint64_t *packed, uint64_t *wrong)
{
    *direct = *packed = *wrong = 0;
    for (int64_t r = 0; r < ROWS; r++) {
        for (int64_t c = 0; c < COLS; c++) {
            float want = p->src[r * COLS + c], d = p->dst_direct[r * COLS + c];
            float t = p->dst_t[c * ROWS + r];

            *direct += d == want;
            *packed += t == want;
            *wrong += (d != want && d != 0.0f) + (t != want && t != 0.0f);
        }
    }
}

/* A relay that only forwards changes nothing: the pair's job goes through it whole. */
Test(xfer_mitm, a_faithful_relay_changes_nothing)
{
    pair p;
    world w;
    mitm m;

    pair_init(&p, 1);
    world_open(&w, 2);
    mitm_start(&m, &w, MITM_PASS, 0, 0);
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[0].code, 0, "%s", w.res[0].error);
    cr_assert_eq(w.res[1].code, 0, "%s", w.res[1].error);
    pair_check(&p);
    digests_agree(&w);
    mitm_stop(&m, &w);
    cr_assert_eq(m.conns, 1);
    world_close(&w);
    pair_free(&p);
}

/* One bit flipped on the way, in a header, a payload segment or a tag, of the direct message
 * or the packed one: the receiver fails the job naming what failed, no element holds a wrong
 * value, and exactly the segments checked before the flip are installed (a packed message is
 * scattered only once all of it passed). A good job follows. */
Test(xfer_mitm, a_flipped_bit_fails_the_job_and_installs_nothing_wrong)
{
    const uint64_t seg_elems = SEG_LEN / 4, all = (uint64_t)ROWS * COLS;
    struct {
        uint64_t at;
        const char *says;
        uint64_t direct; /* elements of seq 10 installed */
    } cases[] = {
        {4, "header from peer 0 (127.0.0.1:", 0},
        {HDR_LEN + TAG_LEN + 2 * SEG_WIRE + 100, "bytes 524288..786432 of message seq 10",
         2 * seg_elems},
        {HDR_LEN + TAG_LEN + SEG_LEN + 3, "bytes 0..262144 of message seq 10", 0},
        {F10 + 9, "message seq 11 expected, fails", all},
        {F10 + HDR_LEN + TAG_LEN + 3 * SEG_WIRE + SEG_LEN - 1,
         "bytes 786432..1048576 of message seq 11", all},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint64_t direct, packed, wrong;
        pair p;
        world w;
        mitm m;

        pair_init(&p, 1);
        world_open(&w, 2);
        mitm_start(&m, &w, MITM_FLIP, cases[i].at, 0);
        world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
        cr_assert_eq(w.res[1].code, -EBADMSG, "case %zu: %d %s", i, w.res[1].code,
                     w.res[1].error);
        cr_assert(strstr(w.res[1].error, cases[i].says) &&
                  strstr(w.res[1].error, "authentication") &&
                  strstr(w.res[1].error, "Nothing of"), "case %zu: %s", i, w.res[1].error);
        pair_count(&p, &direct, &packed, &wrong);
        cr_assert_eq(wrong, 0, "case %zu: %llu wrong elements installed", i,
                     (unsigned long long)wrong);
        cr_assert_eq(direct, cases[i].direct, "case %zu: %llu of seq 10 installed", i,
                     (unsigned long long)direct);
        cr_assert_eq(packed, 0, "case %zu: %llu of seq 11 installed", i,
                     (unsigned long long)packed);
        mitm_stop(&m, &w);
        good_pair_run(&w, 2);
        world_close(&w);
        pair_free(&p);
    }
}

/* The whole first frame sent again right after itself: the copy's tags are the first
 * frame's, not the next ones, so the repeated header fails and nothing of it is installed. */
Test(xfer_mitm, a_replayed_frame_fails_the_job)
{
    uint64_t direct, packed, wrong;
    pair p;
    world w;
    mitm m;

    pair_init(&p, 1);
    world_open(&w, 2);
    mitm_start(&m, &w, MITM_REPLAY, F10, F10);
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[1].code, -EBADMSG, "%d %s", w.res[1].code, w.res[1].error);
    cr_assert(strstr(w.res[1].error, "frame header from peer 0") &&
              strstr(w.res[1].error, "message seq 11 expected, fails authentication"), "%s",
              w.res[1].error);
    pair_count(&p, &direct, &packed, &wrong);
    cr_assert_eq(wrong, 0);
    cr_assert_eq(direct, (uint64_t)ROWS * COLS, "seq 10 itself was good");
    cr_assert_eq(packed, 0);
    mitm_stop(&m, &w);
    good_pair_run(&w, 2);
    world_close(&w);
    pair_free(&p);
}

/* A frame recorded on one connection, slipped into the next one right after its hello (the
 * same job again, so that only the connection differs): refused, nothing installed. */
Test(xfer_mitm, a_frame_from_an_old_connection_fails_the_job)
{
    uint64_t direct, packed, wrong;
    pair p;
    world w;
    mitm m;

    pair_init(&p, 1);
    world_open(&w, 2);
    mitm_start(&m, &w, MITM_INJECT_OLD, 0, F10);
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[0].code, 0, "%s", w.res[0].error);
    cr_assert_eq(w.res[1].code, 0, "%s", w.res[1].error);
    pair_check(&p);
    memset(p.dst_direct, 0, (size_t)ROWS * COLS * 4);
    memset(p.dst_t, 0, (size_t)ROWS * COLS * 4);
    /* A changed key closes the connections: both daemons connect afresh under KEY_A. */
    for (int d = 0; d < 2; d++) {
        set_key(w.t[d], KEY_B);
        set_key(w.t[d], KEY_A);
    }
    world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
    cr_assert_eq(w.res[1].code, -EBADMSG, "%d %s", w.res[1].code, w.res[1].error);
    cr_assert(strstr(w.res[1].error, "message seq 10 expected, fails authentication"), "%s",
              w.res[1].error);
    pair_count(&p, &direct, &packed, &wrong);
    cr_assert_eq(wrong + direct + packed, 0, "%llu %llu %llu", (unsigned long long)wrong,
                 (unsigned long long)direct, (unsigned long long)packed);
    mitm_stop(&m, &w);
    cr_assert_eq(m.conns, 2, "the second job did not connect afresh");
    good_pair_run(&w, 2);
    world_close(&w);
    pair_free(&p);
}

/* ---- refused jobs and bad arguments ----------------------------------------------------- */

Test(xfer_check, refused_jobs)
{
    world w;
    rf_err err;
    const char *bad_addrs[2] = {"127.0.0.1:1", "no-port"};

    world_open(&w, 2);
    /* Each mutation of a good job, and the words its error must carry. */
    for (int c = 0; c < 9; c++) {
        pair p;
        rf_xfer_job *j;
        const char *says = "";
        int code = -EINVAL;

        pair_init(&p, 1);
        j = &p.sjob;
        switch (c) {
        case 0: p.smsgs[1].round = 0; p.smsgs[0].round = 1; says = "sorted"; break;
        case 1: p.smsgs[1].peer = 5; says = "peer 5"; break;
        case 2: p.s_items[2].msg_off -= 4; says = "overlap"; break;
        case 3: p.smsgs[1].nitems = 1; p.smsgs[1].items = &p.s_items[2]; says = "gap"; break;
        case 4: p.smsgs[1].seq = 10; says = "twice"; break;
        case 5: j->staging_bytes = 1000; code = -ENOSPC; says = "budget"; break;
        case 6:
            p.s_items[0] = item2d((uint8_t *)p.src, ROWS, COLS, (int64_t[]){1, ROWS}, 0, ROWS, 0);
            says = "not contiguous";
            break;
        case 7: j->timeout_s = 0; says = "deadline"; break;
        case 8: p.s_items[1].base = NULL; says = "no mapped memory"; break;
        }
        rf_err_clear(&err);
        /* The structural check alone, as a daemon runs it on a fresh slice, needs no
         * deadline yet. */
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), c == 7 ? 0 : code, "case %d: %s", c,
                     err.msg);
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_run(w.t[0], j, on_done, &w, &err), code, "case %d: %s", c, err.msg);
        cr_assert(strstr(err.msg, says), "case %d: %s", c, err.msg);
        pair_free(&p);
    }
    cr_assert_eq(rf_xfer_set_peers(w.t[0], 0, 0, bad_addrs, &err), -EINVAL);
    cr_assert_eq(rf_xfer_set_peers(w.t[0], 2, 2, bad_addrs, &err), -EINVAL);
    cr_assert_eq(rf_xfer_set_peers(w.t[0], 0, 2, bad_addrs, &err), -EINVAL);
    cr_assert(strstr(err.msg, "no-port"), "%s", err.msg);
    /* A peer is connected to: it needs a host, a port other than 0, and an address at all. */
    for (int c = 0; c < 3; c++) {
        const char *peer1[3] = {"*:7000", "127.0.0.1:0", NULL};
        const char *says[3] = {"names no host", "port 0", "no data address"};

        bad_addrs[1] = peer1[c];
        cr_assert_eq(rf_xfer_set_peers(w.t[0], 0, 2, bad_addrs, &err), -EINVAL, "case %d", c);
        cr_assert(strstr(err.msg, says[c]) && strstr(err.msg, "peer 1"), "case %d: %s", c,
                  err.msg);
    }
    world_close(&w);
}

Test(xfer_check, busy_while_running_and_no_peers)
{
    pair p;
    world w;
    rf_xfer_transport *lone = NULL;
    const char *addrs[2];
    rf_err err;

    pair_init(&p, 1);
    world_open(&w, 2);
    p.rjob.timeout_s = 0.2;
    cr_assert_eq(rf_xfer_run(w.t[1], &p.rjob, on_done, &w, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_run(w.t[1], &p.rjob, on_done, &w, &err), -EBUSY);
    addrs[0] = addr_of(&w, 0);
    addrs[1] = addr_of(&w, 1);
    cr_assert_eq(rf_xfer_set_peers(w.t[1], 1, 2, addrs, &err), -EBUSY);
    w.pending = 1;
    uv_timer_start(&w.guard, on_guard, 30000, 0);
    uv_run(&w.loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w.guard);
    cr_assert_eq(w.res[1].code, -ETIMEDOUT);
    /* A transport with no peer table refuses jobs. */
    cr_assert_eq(rf_xfer_tcp_new(&w.loop, "127.0.0.1:0", &lone, &err), 0, "%s", err.msg);
    set_key(lone, KEY_A);
    cr_assert_eq(rf_xfer_run(lone, &p.sjob, on_done, &w, &err), -EINVAL);
    cr_assert(strstr(err.msg, "set_peers"), "%s", err.msg);
    rf_xfer_close(lone, NULL, NULL);
    /* Closing, not yet closed: jobs are refused, a second close is harmless. */
    cr_assert_eq(rf_xfer_run(lone, &p.sjob, on_done, &w, &err), -ECANCELED);
    rf_xfer_close(lone, NULL, NULL);
    cr_assert_eq(rf_xfer_tcp_new(&w.loop, "nonsense", &lone, &err), -EINVAL);
    cr_assert_null(lone);
    /* The port of a running listener is taken. */
    cr_assert_lt(rf_xfer_tcp_new(&w.loop, addr_of(&w, 0), &lone, &err), 0);
    cr_assert(strstr(err.msg, "cannot listen"), "%s", err.msg);
    world_close(&w);
    pair_free(&p);
}

/* ":0" and "*:0" listen on every interface: a peer reaches the transport through loopback at
 * the port it announces, and a job runs over it. A listen address without a port is refused
 * with the fix. */
Test(xfer_check, all_interfaces_listener)
{
    const char *listen[2] = {":0", "*:0"};
    const char *addrs[2];
    char reach[64];
    rf_err err;

    for (int c = 0; c < 2; c++) {
        const char *port;
        world w;
        pair p;

        world_init_loop(&w);
        w.n = 2;
        cr_assert_eq(rf_xfer_tcp_new(&w.loop, "127.0.0.1:0", &w.t[0], &err), 0, "%s", err.msg);
        cr_assert_eq(rf_xfer_tcp_new(&w.loop, listen[c], &w.t[1], &err), 0, "%s: %s",
                     listen[c], err.msg);
        port = strrchr(addr_of(&w, 1), ':');
        cr_assert(strncmp(addr_of(&w, 1), "0.0.0.0:", 8) == 0 ||
                  strncmp(addr_of(&w, 1), "[::]:", 5) == 0, "%s bound %s", listen[c],
                  addr_of(&w, 1));
        snprintf(reach, sizeof(reach), "127.0.0.1%s", port);
        addrs[0] = addr_of(&w, 0);
        addrs[1] = reach;
        for (int i = 0; i < 2; i++) {
            set_key(w.t[i], KEY_A);
            cr_assert_eq(rf_xfer_set_peers(w.t[i], (uint32_t)i, 2, addrs, &err), 0, "%s",
                         err.msg);
        }
        pair_init(&p, 5);
        world_run(&w, (rf_xfer_job *[]){&p.sjob, &p.rjob});
        cr_assert_eq(w.res[0].code, 0, "%s", w.res[0].error);
        cr_assert_eq(w.res[1].code, 0, "%s", w.res[1].error);
        pair_check(&p);
        world_close(&w);
        pair_free(&p);
    }
    {
        uv_loop_t loop;
        rf_xfer_transport *t = NULL;

        cr_assert_eq(uv_loop_init(&loop), 0);
        cr_assert_eq(rf_xfer_tcp_new(&loop, "127.0.0.1", &t, &err), -EINVAL);
        cr_assert_null(t);
        cr_assert(strstr(err.msg, "data listen address") && strstr(err.msg, "no port"), "%s",
                  err.msg);
        cr_assert_eq(uv_loop_close(&loop), 0);
    }
}

Test(xfer_check, ipv6_listener)
{
    rf_xfer_transport *t = NULL;
    uv_loop_t loop;
    rf_err err;
    int rc;

    uv_loop_init(&loop);
    rc = rf_xfer_tcp_new(&loop, "[::1]:0", &t, &err);
    if (rc == 0) {
        cr_assert(strncmp(rf_xfer_tcp_addr(t), "[::1]:", 6) == 0, "%s", rf_xfer_tcp_addr(t));
        rf_xfer_close(t, NULL, NULL);
    } else {
        cr_log_warn("no IPv6 loopback here: %s", err.msg);
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

/* ---- relays: a daemon that receives and forwards ------------------------------------------- */

/* A real plan with relays: qwen3 shrunk, one trainer (daemon 0) and three engine replicas
 * (daemons 1-3), a staging budget small enough for many rounds. Every destination byte lands,
 * twice over, the replicas forward what they received (their sent bytes are the plan's relay
 * bytes), and the digests of relayed messages cancel like any other. */
Test(xfer_relay, qwen3_one_trainer_three_replicas_relaying)
{
    rf_inv *inv = rf_inv_new();
    rf_plan_opts o = {.staging_bytes = 1 << 20, .direct_min_bytes = 16 << 10, .relay = 1};
    rf_xfer_job jobs[MAXD], *jp[MAXD];
    const rf_plan_stats *st;
    rf_plan *pl = NULL;
    cluster c;
    world w;
    rf_err err;

    shrunk_qwen3("tp=1", "tp=1,dp=3", inv);
    cr_assert_eq(rf_inv_nendpoints(inv), 4);
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    st = rf_plan_stats_get(pl);
    cr_assert_gt(st->relay_messages, 0, "the plan relays nothing");
    cr_assert_gt(rf_plan_nrounds(pl), 2);
    cluster_alloc(&c, inv);
    world_open(&w, 4);
    for (uint64_t v = 1; v <= 2; v++) {
        uint64_t relayed = 0;

        fill_sources(&c, v);
        jobs_from_plan(pl, &o, (uint32_t[]){0, 1, 2, 3}, 4, c.bases, v, RF_VERIFY_FULL, jobs);
        for (int d = 0; d < 4; d++)
            jp[d] = &jobs[d];
        world_run(&w, jp);
        for (int d = 0; d < 4; d++) {
            cr_assert_eq(w.res[d].code, 0, "daemon %d: %s", d, w.res[d].error);
            if (d > 0)
                relayed += w.res[d].bytes_sent;
        }
        cr_assert_eq(w.res[0].bytes_sent, st->source_bytes);
        cr_assert_eq(relayed, st->relay_bytes);
        cr_assert_gt(relayed, 0);
        check_destinations(&c, v);
        digests_agree(&w);
        for (int d = 0; d < 4; d++)
            job_free(&jobs[d]);
    }
    world_close(&w);
    cluster_free(&c);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* The rest of a fake peer's payload from byte `from` (a segment boundary) on, each segment
 * with its tag. */
static void fake_payload_from(fconn *f, const uint8_t *p, uint64_t bytes, uint64_t from)
{
    for (uint64_t off = from; off < bytes; off += SEG_LEN) {
        uint64_t seg = bytes - off < SEG_LEN ? bytes - off : SEG_LEN;
        uint8_t tag[TAG_LEN];

        ftag(f, p + off, seg, tag);
        write_all(f->fd, p + off, seg);
        write_all(f->fd, tag, sizeof(tag));
    }
}

/* Relays by hand: peer 0 is a fake trainer the test drives (a socket speaking the data
 * protocol), daemon 1 the relay, daemon 2 the relay's receiver. */
#define RL_N (1u << 20)

static struct {
    uint8_t *src, *src2; /* what the fake trainer sends: seq 0, seq 2 */
    fconn a;
    uint64_t held;       /* bytes of seq 0 sent before the gate */
    uint32_t watch;      /* the daemon whose progress poke_relay waits on */
    uint64_t watch_bytes;
    bool fired;
} rl;

/* Once daemon 1's job runs: the fake trainer sends seq 0's header and its first rl.held bytes
 * (whole segments), and holds the rest. */
static void poke_relay_start(world *w)
{
    bool accepted;

    rl.a = auth_dial(addr_of(w, 1), KEY_A, 0, 1, &accepted);
    cr_assert(accepted, "the fake trainer's hello was not accepted");
    fake_header(&rl.a, 0x46584652u, 0, 9, RL_N);
    fake_payload(&rl.a, rl.src, RL_N, rl.held);
}

/* A relay sends round 1 only once its receive of round 0 is complete. The fake trainer sends
 * half of seq 0 and holds the rest (the gate): the receiver's job runs to its deadline with
 * nothing of seq 1 arrived (a relay that sent at once would have sent the relay's memory as it
 * was, 0xee, and the receiver's job would have ended done). Then the trainer sends the rest
 * and the receiver, run again, gets exactly what the relay received; the relay's digests
 * (received seq 0, sent seq 1) are those of the trainer's bytes. */
Test(xfer_relay, a_relays_send_waits_for_its_receive)
{
    uint8_t *bmem = malloc(RL_N), *cmem = malloc(RL_N);
    uint8_t want_recv[RF_XFER_DIGEST_BYTES] = {0}, want_sent[RF_XFER_DIGEST_BYTES] = {0};
    rf_xfer_item bi = item1d(bmem, RL_N, 0, RL_N, 0), ci = item1d(cmem, RL_N, 0, RL_N, 0);
    rf_xfer_msg bm[2], cm;
    rf_xfer_job bj, cj;
    rf_err err;
    world w;

    memset(&rl, 0, sizeof(rl));
    rl.src = malloc(RL_N);
    cr_assert(bmem && cmem && rl.src);
    for (uint64_t i = 0; i < RL_N; i++)
        rl.src[i] = xd_pattern(3, i, 0, 9);
    memset(bmem, 0xee, RL_N);
    memset(cmem, 0xee, RL_N);
    rl.held = RL_N / 2;
    bm[0] = (rf_xfer_msg){.seq = 0, .round = 0, .kind = RF_PLAN_DIRECT, .send = false,
                          .peer = 0, .bytes = RL_N, .nitems = 1, .items = &bi};
    bm[1] = (rf_xfer_msg){.seq = 1, .round = 1, .kind = RF_PLAN_DIRECT, .send = true,
                          .peer = 2, .bytes = RL_N, .nitems = 1, .items = &bi};
    cm = bm[1];
    cm.send = false;
    cm.peer = 1;
    cm.items = &ci;
    bj = (rf_xfer_job){.version = 9, .nrounds = 2, .nmsgs = 2, .msgs = bm, .timeout_s = 20,
                       .verify = RF_VERIFY_FULL};
    cj = bj;
    cj.nmsgs = 1;
    cj.msgs = &cm;
    cj.timeout_s = 0.5;
    world_open(&w, 3);

    /* The gate closed: the receiver's job ends at its deadline, the relay's runs on. */
    memset(w.got, 0, sizeof(w.got));
    cr_assert_eq(rf_xfer_run(w.t[1], &bj, on_done, &w, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_run(w.t[2], &cj, on_done, &w, &err), 0, "%s", err.msg);
    w.pending = 1;
    w.poke_fn = poke_relay_start;
    uv_timer_start(&w.poke, on_poke, 1, 0);
    uv_timer_start(&w.guard, on_guard, 30000, 0);
    uv_run(&w.loop, UV_RUN_DEFAULT);
    cr_assert(w.got[2] && !w.got[1]);
    cr_assert_eq(w.res[2].code, -ETIMEDOUT, "%d %s", w.res[2].code, w.res[2].error);
    cr_assert(strstr(w.res[2].error, "receiving message seq 1 (round 1) from peer 1") &&
              strstr(w.res[2].error, "0 of 1048576 bytes moved"), "%s", w.res[2].error);
    cr_assert_eq(w.res[2].bytes_recv, 0);
    for (uint64_t i = 0; i < RL_N; i++)
        cr_assert_eq(cmem[i], 0xee, "byte %llu of the receiver's memory written while the relay "
                     "had half its receive", (unsigned long long)i);

    /* The gate open: the rest of seq 0, and the receiver again. */
    fake_payload_from(&rl.a, rl.src, RL_N, rl.held);
    cj.timeout_s = 20;
    w.got[2] = false;
    cr_assert_eq(rf_xfer_run(w.t[2], &cj, on_done, &w, &err), 0, "%s", err.msg);
    w.pending = 2;
    uv_run(&w.loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w.guard);
    cr_assert_eq(w.res[1].code, 0, "%s", w.res[1].error);
    cr_assert_eq(w.res[2].code, 0, "%s", w.res[2].error);
    cr_assert_eq(w.res[1].bytes_recv, RL_N);
    cr_assert_eq(w.res[1].bytes_sent, RL_N);
    cr_assert(memcmp(bmem, rl.src, RL_N) == 0, "the relay's memory is not what it received");
    cr_assert(memcmp(cmem, rl.src, RL_N) == 0, "the relay sent other bytes than it received");
    digest_ref(0, rl.src, RL_N, want_recv);
    digest_ref(1, rl.src, RL_N, want_sent);
    cr_assert(memcmp(w.res[1].digest_recv, want_recv, sizeof(want_recv)) == 0);
    cr_assert(memcmp(w.res[1].digest_sent, want_sent, sizeof(want_sent)) == 0);
    cr_assert(memcmp(w.res[2].digest_recv, want_sent, sizeof(want_sent)) == 0);
    close(rl.a.fd);
    world_close(&w);
    free(rl.src);
    free(bmem);
    free(cmem);
}

/* Until daemon rl.watch has moved rl.watch_bytes, then once: the fake trainer dies inside
 * seq 2. */
static void poke_relay_kill(world *w)
{
    if (rl.fired || rf_xfer_progress(w->t[rl.watch]) < rl.watch_bytes)
        return;
    rl.fired = true;
    uv_timer_stop(&w->poke);
    close(rl.a.fd);
    rl.a.fd = -1;
}

static void poke_relay_two(world *w)
{
    poke_relay_start(w);
    /* seq 2, the second message of the same connection: 1000 bytes, then silence. */
    fake_header(&rl.a, 0x46584652u, 2, 9, RL_N);
    fake_payload(&rl.a, rl.src2, RL_N, 1000);
    w->poke_fn = poke_relay_kill;
    uv_timer_start(&w->poke, on_poke, 1, 1);
}

/* A relay whose own source dies while it forwards: the relay has passed on round 0's bytes
 * (its receiver got seq 1 whole, which the test waits for), is receiving seq 2 and holds seq
 * 3 back for it. The fake trainer dies inside seq 2: the relay's job fails naming seq 2 and
 * the trainer, and its receiver's job fails too (the relay drops its connections), naming
 * seq 3 and the relay; nothing of seq 3 is installed. Then the three run a good relay job. */
Test(xfer_relay, a_relay_that_fails_mid_forward_fails_the_job)
{
    uint8_t *bmem = malloc(2 * RL_N), *cmem = malloc(2 * RL_N);
    rf_xfer_item b0 = item1d(bmem, 2 * RL_N, 0, RL_N, 0);
    rf_xfer_item b1 = item1d(bmem, 2 * RL_N, RL_N, RL_N, 0);
    rf_xfer_item c0 = item1d(cmem, 2 * RL_N, 0, RL_N, 0);
    rf_xfer_item c1 = item1d(cmem, 2 * RL_N, RL_N, RL_N, 0);
    rf_xfer_msg bm[4], cm[2];
    rf_xfer_job bj, cj;
    world w;

    memset(&rl, 0, sizeof(rl));
    rl.src = malloc(RL_N);
    rl.src2 = malloc(RL_N);
    cr_assert(bmem && cmem && rl.src && rl.src2);
    for (uint64_t i = 0; i < RL_N; i++) {
        rl.src[i] = xd_pattern(4, i, 0, 9);
        rl.src2[i] = xd_pattern(5, i, 0, 9);
    }
    memset(bmem, 0xee, 2 * RL_N);
    memset(cmem, 0xee, 2 * RL_N);
    rl.held = RL_N;
    rl.watch = 2;
    rl.watch_bytes = RL_N;
    bm[0] = (rf_xfer_msg){.seq = 0, .round = 0, .kind = RF_PLAN_DIRECT, .send = false,
                          .peer = 0, .bytes = RL_N, .nitems = 1, .items = &b0};
    bm[1] = (rf_xfer_msg){.seq = 1, .round = 1, .kind = RF_PLAN_DIRECT, .send = true,
                          .peer = 2, .bytes = RL_N, .nitems = 1, .items = &b0};
    bm[2] = (rf_xfer_msg){.seq = 2, .round = 1, .kind = RF_PLAN_DIRECT, .send = false,
                          .peer = 0, .bytes = RL_N, .nitems = 1, .items = &b1};
    bm[3] = (rf_xfer_msg){.seq = 3, .round = 2, .kind = RF_PLAN_DIRECT, .send = true,
                          .peer = 2, .bytes = RL_N, .nitems = 1, .items = &b1};
    cm[0] = bm[1];
    cm[0].send = false;
    cm[0].peer = 1;
    cm[0].items = &c0;
    cm[1] = bm[3];
    cm[1].send = false;
    cm[1].peer = 1;
    cm[1].items = &c1;
    bj = (rf_xfer_job){.version = 9, .nrounds = 3, .nmsgs = 4, .msgs = bm, .timeout_s = 20,
                       .verify = RF_VERIFY_FULL};
    cj = bj;
    cj.nmsgs = 2;
    cj.msgs = cm;
    world_open(&w, 3);
    world_run_poke(&w, (rf_xfer_job *[]){NULL, &bj, &cj}, poke_relay_two, 1);
    cr_assert(rl.fired, "the jobs ended before the relay forwarded seq 1");
    cr_assert_eq(w.res[1].code, -ECONNRESET, "%d %s", w.res[1].code, w.res[1].error);
    cr_assert(strstr(w.res[1].error, "seq 2") && strstr(w.res[1].error, "peer 0") &&
              strstr(w.res[1].error, "1000 of"), "%s", w.res[1].error);
    cr_assert_lt(w.res[2].code, 0, "the relay's receiver committed without seq 3");
    cr_assert(strstr(w.res[2].error, "seq 3") && strstr(w.res[2].error, "peer 1"), "%s",
              w.res[2].error);
    cr_assert_eq(w.res[2].bytes_recv, RL_N);
    cr_assert(memcmp(cmem, rl.src, RL_N) == 0, "seq 1 forwarded other bytes");
    for (uint64_t i = RL_N; i < 2 * RL_N; i++)
        cr_assert_eq(cmem[i], 0xee, "byte %llu of seq 3 installed after the relay failed",
                     (unsigned long long)i);

    /* The same three daemons, a whole relay job: the trainer is a real transport now. */
    {
        uint8_t *amem = malloc(2 * RL_N);
        rf_xfer_item a0 = item1d(amem, 2 * RL_N, 0, RL_N, 0);
        rf_xfer_item a1 = item1d(amem, 2 * RL_N, RL_N, RL_N, 0);
        rf_xfer_msg am[2] = {bm[0], bm[2]};
        rf_xfer_job aj = bj;

        cr_assert_not_null(amem);
        for (uint64_t i = 0; i < 2 * RL_N; i++)
            amem[i] = xd_pattern(6, i, 0, 10);
        for (int k = 0; k < 2; k++) {
            am[k].send = true;
            am[k].peer = 1;
        }
        am[0].items = &a0;
        am[1].items = &a1;
        aj.version = bj.version = cj.version = 10;
        aj.nmsgs = 2;
        aj.msgs = am;
        world_run(&w, (rf_xfer_job *[]){&aj, &bj, &cj});
        for (int d = 0; d < 3; d++)
            cr_assert_eq(w.res[d].code, 0, "daemon %d: %s", d, w.res[d].error);
        cr_assert(memcmp(cmem, amem, 2 * RL_N) == 0);
        digests_agree(&w);
        free(amem);
    }
    world_close(&w);
    free(rl.src);
    free(rl.src2);
    free(bmem);
    free(cmem);
}

/* ---- relays checked end to end (xfer.h, rf_xfer_origin) ------------------------------------ */

/* Whether the XOR of every daemon's sent digests equals that of their received ones: what the
 * coordinator's commit rests on. */
static bool digests_match(const world *w)
{
    uint8_t x[RF_XFER_DIGEST_BYTES] = {0};

    for (int i = 0; i < w->n; i++)
        for (int b = 0; b < RF_XFER_DIGEST_BYTES; b++)
            x[b] ^= w->res[i].digest_sent[b] ^ w->res[i].digest_recv[b];
    for (int b = 0; b < RF_XFER_DIGEST_BYTES; b++)
        if (x[b])
            return false;
    return true;
}

/* The relay trees' ends of the jobs: items that list origins, and those with more than one. */
static void count_ends(const rf_xfer_job *jobs, int n, uint64_t *ends, uint64_t *multi)
{
    *ends = *multi = 0;
    for (int d = 0; d < n; d++)
        for (uint32_t i = 0; i < jobs[d].nmsgs; i++)
            for (uint32_t k = 0; k < jobs[d].msgs[i].nitems; k++) {
                const rf_xfer_item *it = &jobs[d].msgs[i].items[k];

                *ends += it->norigins > 0 || it->nrelay_to > 0;
                *multi += it->norigins > 1;
            }
}

/* The jobs as digests of messages alone would check them: no relay tree's ends, and relay
 * messages with their message digests. */
static void strip_ends(rf_xfer_job *jobs, int n)
{
    for (int d = 0; d < n; d++)
        for (uint32_t i = 0; i < jobs[d].nmsgs; i++) {
            jobs[d].msgs[i].e2e = false;
            for (uint32_t k = 0; k < jobs[d].msgs[i].nitems; k++)
                jobs[d].msgs[i].items[k].norigins = jobs[d].msgs[i].items[k].nrelay_to = 0;
        }
}

/* Under verify = sample, whether a relay corrupted by the test hook (the first byte of each
 * packed relay it sends) shows: the first item of a received packed relay holds that byte,
 * in the origin whose box starts where the item's does, and only a sampled origin is checked. */
static bool sampled_corruption(const rf_xfer_job *jobs, int n)
{
    for (int d = 0; d < n; d++)
        for (uint32_t i = 0; i < jobs[d].nmsgs; i++) {
            const rf_xfer_msg *m = &jobs[d].msgs[i];
            const rf_xfer_item *it = m->nitems ? &m->items[0] : NULL;

            if (m->send || m->kind != RF_PLAN_PACKED || !it || it->norigins == 0)
                continue;
            for (uint32_t o = 0; o < it->norigins; o++)
                if (rf_box_equal(&it->origins[o].box, &it->box, it->ndim) ||
                    memcmp(it->origins[o].box.start, it->box.start,
                           sizeof(it->box.start)) == 0)
                    if (it->origins[o].seq % RF_XFER_SAMPLE_EVERY == 0)
                        return true;
        }
    return false;
}

/* Runs plan pl on 4 daemons (ep_daemon) with verify, version v: the jobs stay in jobs. */
static void run_relay_jobs(world *w, const rf_plan *pl, const rf_plan_opts *o,
                           const uint32_t *ep_daemon, cluster *c, uint64_t v, int verify,
                           rf_xfer_job *jobs, bool strip)
{
    rf_xfer_job *jp[MAXD];

    fill_sources(c, v);
    jobs_from_plan(pl, o, ep_daemon, 4, c->bases, v, verify, jobs);
    if (strip)
        strip_ends(jobs, 4);
    for (int d = 0; d < 4; d++)
        jp[d] = &jobs[d];
    world_run(w, jp);
    for (int d = 0; d < 4; d++)
        cr_assert_eq(w->res[d].code, 0, "daemon %d: %s", d, w->res[d].error);
}

/* A relay that forwards other bytes than it received (the tcp transport's test hook flips the
 * first byte of every packed message it relays, before digesting it): qwen3 from two trainers
 * (tp=2: the replicas' chunks of the row-parallel weights are tiled by both trainers' shards)
 * to three replicas. Clean, the digests agree under full and sample. Corrupted, the engines
 * hold wrong bytes, the digests of messages alone still agree (each hop digests what it moved:
 * that is how such a relay committed), and with the relay trees' ends they differ: a root that
 * feeds two replicas the same wrong bytes does not cancel out. Under sample the corruption
 * shows too: the plan's messages are small enough that a sampled origin is among those hit. */
Test(xfer_relay, a_relay_that_forwards_wrong_bytes_fails_the_digests, .timeout = 60)
{
    rf_inv *inv = rf_inv_new();
    rf_plan_opts o = {.staging_bytes = 256 << 10, .direct_min_bytes = 64 << 10, .relay = 1};
    static const uint32_t ep_daemon[5] = {0, 0, 1, 2, 3};
    rf_xfer_job jobs[MAXD];
    uint64_t ends, multi, wrong, stray;
    rf_plan *pl = NULL;
    cluster c;
    world w;
    rf_err err;

    shrunk_qwen3("tp=2", "tp=1,dp=3", inv);
    cr_assert_eq(rf_inv_nendpoints(inv), 5);
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_plan_stats_get(pl)->relay_messages, 0, "the plan relays nothing");
    cluster_alloc(&c, inv);

    world_open(&w, 4);
    run_relay_jobs(&w, pl, &o, ep_daemon, &c, 1, RF_VERIFY_FULL, jobs, false);
    check_destinations(&c, 1);
    cr_assert(digests_match(&w), "clean relays, verify full: the digests differ");
    count_ends(jobs, 4, &ends, &multi);
    cr_assert_gt(ends, 0, "no relay tree's end in the jobs");
    cr_assert_gt(multi, 0, "no relayed chunk is tiled by two trainers' shards");
    for (int d = 0; d < 4; d++)
        job_free(&jobs[d]);
    run_relay_jobs(&w, pl, &o, ep_daemon, &c, 2, RF_VERIFY_SAMPLE, jobs, false);
    check_destinations(&c, 2);
    cr_assert(digests_match(&w), "clean relays, verify sample: the digests differ");
    for (int d = 0; d < 4; d++)
        job_free(&jobs[d]);
    world_close(&w);

    cr_assert_eq(setenv("REFIT_TEST_CORRUPT_RELAY", "1", 1), 0);
    world_open(&w, 4);
    cr_assert_eq(unsetenv("REFIT_TEST_CORRUPT_RELAY"), 0);
    run_relay_jobs(&w, pl, &o, ep_daemon, &c, 3, RF_VERIFY_FULL, jobs, true);
    xd_check(inv, c.bases, 3, &wrong, &stray);
    cr_assert_gt(wrong, 0, "the test hook corrupted nothing");
    cr_assert(digests_match(&w), "the digests of messages alone caught a faulty relay");
    for (int d = 0; d < 4; d++)
        job_free(&jobs[d]);
    run_relay_jobs(&w, pl, &o, ep_daemon, &c, 4, RF_VERIFY_FULL, jobs, false);
    xd_check(inv, c.bases, 4, &wrong, &stray);
    cr_assert_gt(wrong, 0);
    cr_assert(!digests_match(&w), "a relay forwarded wrong bytes and the digests agree");
    for (int d = 0; d < 4; d++)
        job_free(&jobs[d]);
    run_relay_jobs(&w, pl, &o, ep_daemon, &c, 5, RF_VERIFY_SAMPLE, jobs, false);
    cr_assert(sampled_corruption(jobs, 4), "verify sample checks no origin the hook corrupts");
    cr_assert(!digests_match(&w), "verify sample: a corrupted origin is sampled, yet the "
              "digests agree");
    for (int d = 0; d < 4; d++)
        job_free(&jobs[d]);
    world_close(&w);
    cluster_free(&c);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* A dense piece of box (start, extent) of tensor on endpoint ep, in a region of its own; FP8
 * in format q (its scales in another region of ep) unless q is NULL. */
static void fp8_relay_piece(rf_inv *inv, uint32_t ep, uint32_t tensor, const int64_t *start,
                            const int64_t *extent, const rf_quant_fmt *q)
{
    const rf_tensor *t = rf_inv_tensor(inv, tensor);
    int nd = t->ndim;
    rf_piece p = {0};
    uint64_t n = 1;
    int64_t s = 1;
    uint32_t id;
    rf_err err;

    for (int d = RF_MAX_DIMS - 1; d >= 0; d--) {
        p.box.start[d] = d < nd ? start[d] : 0;
        p.box.extent[d] = d < nd ? extent[d] : 1;
        p.strides[d] = d < nd ? s : 0;
        s *= d < nd ? extent[d] : 1;
        n *= (uint64_t)p.box.extent[d];
    }
    p.tensor = tensor;
    cr_assert_eq(rf_inv_add_region(inv, ep, q ? n : n * rf_dtype_size(t->dtype), &p.region,
                                   &err), 0, "%s", err.msg);
    if (q) {
        rf_quant_decl qd = {.kind = q->kind, .br = q->br, .bc = q->bc};
        int64_t ss = 1;
        rf_box sb;

        rf_inv_scale_box(&qd, nd, t->shape, &p.box, &sb);
        for (int d = nd - 1; d >= 0; d--) {
            qd.scale_strides[d] = ss;
            ss *= sb.extent[d];
        }
        cr_assert_eq(rf_inv_add_region(inv, ep, (uint64_t)ss *
                                       rf_dtype_size(rf_quant_scale_dtype(q)),
                                       &qd.scale_region, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_inv_add_quant(inv, &qd, &p.quant, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), 0, "%s", err.msg);
}

/* Two bf16 trainers (one daemon) holding the column halves of a weight [256, 384] and of
 * experts [4, 128, 96] (split at column 64: the last block of each row is partial), three
 * engine replicas holding both whole in FP8 format fmt, one daemon each. */
static rf_inv *fp8_relay_inv(const char *fmt)
{
    static const int64_t ws[2] = {256, 384}, es[3] = {4, 128, 96};
    rf_inv *inv = rf_inv_new();
    rf_quant_fmt q;
    uint32_t w, e, ep;
    rf_err err;

    cr_assert_eq(rf_quant_fmt_parse(fmt, &q, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_add_tensor(inv, "w.weight", RF_DT_BF16, 2, ws, &w, &err), 0);
    cr_assert_eq(rf_inv_add_tensor(inv, "e.weight", RF_DT_BF16, 3, es, &e, &err), 0);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(rf_inv_add_endpoint(inv, RF_SRC, 0, &ep, &err), 0);
        fp8_relay_piece(inv, ep, w, (int64_t[]){0, r * 192}, (int64_t[]){256, 192}, NULL);
        fp8_relay_piece(inv, ep, e, (int64_t[]){0, 0, r * 64}, (int64_t[]){4, 128, r ? 32 : 64},
                        NULL);
    }
    for (uint32_t r = 0; r < 3; r++) {
        cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 1 + r, &ep, &err), 0);
        fp8_relay_piece(inv, ep, w, (int64_t[]){0, 0}, ws, &q);
        fp8_relay_piece(inv, ep, e, (int64_t[]){0, 0, 0}, es, &q);
    }
    return inv;
}

/* Wrong bytes of the replicas' FP8 elements and scales against replica 0's (every region of a
 * replica endpoint in order); *written: replica 0's bytes that are not the untouched 0xee. */
static uint64_t fp8_replicas_differ(const rf_inv *inv, uint8_t **bases, uint64_t *written)
{
    uint32_t regs[3][8], nr[3] = {0};
    uint64_t wrong = 0;

    for (uint32_t r = 0; r < rf_inv_nregions(inv); r++) {
        uint32_t ep = rf_inv_region(inv, r)->endpoint;

        if (rf_inv_endpoint(inv, ep)->side == RF_DST)
            regs[ep - 2][nr[ep - 2]++] = r;
    }
    *written = 0;
    for (uint32_t k = 0; k < nr[0]; k++) {
        uint64_t size = rf_inv_region(inv, regs[0][k])->size;

        for (uint64_t b = 0; b < size; b++) {
            *written += bases[regs[0][k]][b] != 0xee;
            for (int r = 1; r < 3; r++)
                wrong += bases[regs[r][k]][b] != bases[regs[0][k]][b];
        }
    }
    return wrong;
}

/* FP8 replicas relay their payload as it is (FP8 elements, then the blocks' scales), and each
 * replica fed by a relay checks the trainers' quantized tiles inside it: the weight's chunks
 * are tiled by both trainers' column halves, the experts' by a tile of whole blocks and one
 * whose last block is partial, over a leading dim. Clean, the replicas agree byte for byte and
 * so do the digests; with a relay that corrupts what it forwards, the digests differ, though
 * those of messages alone agree. Blocks of 32x64 (fp32 scales) and MXFP8 (one-byte scales). */
Test(xfer_relay, fp8_relays_are_checked_end_to_end, .timeout = 60)
{
    static const char *fmts[2] = {"block:32x64", "mxfp8"};
    static const uint32_t ep_daemon[5] = {0, 0, 1, 2, 3};
    rf_plan_opts o = {.staging_bytes = 64 << 10, .direct_min_bytes = 4 << 20, .relay = 1};

    for (int f = 0; f < 2; f++) {
        rf_inv *inv = fp8_relay_inv(fmts[f]);
        rf_xfer_job jobs[MAXD];
        uint64_t ends, multi, written;
        rf_plan *pl = NULL;
        cluster c;
        world w;
        rf_err err;

        cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s: %s", fmts[f], err.msg);
        cr_assert_gt(rf_plan_stats_get(pl)->relay_transfers, 0, "%s: no relays", fmts[f]);
        cluster_alloc(&c, inv);
        world_open(&w, 4);
        run_relay_jobs(&w, pl, &o, ep_daemon, &c, 1, RF_VERIFY_FULL, jobs, false);
        cr_assert_eq(fp8_replicas_differ(inv, c.bases, &written), 0, "%s: replicas differ",
                     fmts[f]);
        cr_assert_gt(written, 0);
        cr_assert(digests_match(&w), "%s: clean FP8 relays, yet the digests differ", fmts[f]);
        count_ends(jobs, 4, &ends, &multi);
        cr_assert_gt(multi, 0, "%s: no relayed chunk is tiled by two trainers' shards",
                     fmts[f]);
        for (int d = 0; d < 4; d++)
            job_free(&jobs[d]);
        world_close(&w);

        cr_assert_eq(setenv("REFIT_TEST_CORRUPT_RELAY", "1", 1), 0);
        world_open(&w, 4);
        cr_assert_eq(unsetenv("REFIT_TEST_CORRUPT_RELAY"), 0);
        run_relay_jobs(&w, pl, &o, ep_daemon, &c, 2, RF_VERIFY_FULL, jobs, true);
        cr_assert_gt(fp8_replicas_differ(inv, c.bases, &written), 0,
                     "%s: the test hook corrupted nothing", fmts[f]);
        cr_assert(digests_match(&w), "%s: the digests of messages alone caught the relay",
                  fmts[f]);
        for (int d = 0; d < 4; d++)
            job_free(&jobs[d]);
        run_relay_jobs(&w, pl, &o, ep_daemon, &c, 3, RF_VERIFY_FULL, jobs, false);
        cr_assert(!digests_match(&w), "%s: a relay forwarded wrong FP8 bytes and the digests "
                  "agree", fmts[f]);
        for (int d = 0; d < 4; d++)
            job_free(&jobs[d]);
        world_close(&w);
        cluster_free(&c);
        rf_plan_free(pl);
        rf_inv_free(inv);
    }
}

/* Box [r0, r0 + nr) x [c0, c0 + nc) of a dense fp32 [rows, cols] matrix at base. */
static rf_xfer_item item_box(float *base, int64_t rows, int64_t cols, int64_t r0, int64_t nr,
                             int64_t c0, int64_t nc, uint64_t msg_off)
{
    rf_xfer_item it;

    memset(&it, 0, sizeof(it));
    it.base = (uint8_t *)base;
    it.ndim = 2;
    it.esize = 4;
    rf_box_full(&it.piece.box, 2, (int64_t[]){rows, cols});
    it.piece.strides[0] = cols;
    it.piece.strides[1] = 1;
    it.box = it.piece.box;
    it.box.start[0] = r0;
    it.box.extent[0] = nr;
    it.box.start[1] = c0;
    it.box.extent[1] = nc;
    it.msg_off = msg_off;
    it.bytes = (uint64_t)(nr * nc) * 4;
    return it;
}

/* The term of relay transfer r for origin o over bytes, as xfer.h documents it. */
static void term_ref(uint64_t r, uint64_t o, const void *bytes, size_t n,
                     uint8_t acc[RF_XFER_DIGEST_BYTES])
{
    uint8_t c[RF_XFER_DIGEST_BYTES], h[RF_XFER_DIGEST_BYTES], le[16];
    crypto_generichash_state st;

    crypto_generichash(c, sizeof(c), bytes, n, NULL, 0);
    for (int i = 0; i < 8; i++) {
        le[i] = (uint8_t)(r >> (8 * i));
        le[8 + i] = (uint8_t)(o >> (8 * i));
    }
    crypto_generichash_init(&st, NULL, 0, sizeof(h));
    crypto_generichash_update(&st, (const uint8_t *)"refit-relay-e2e-v1", 18);
    crypto_generichash_update(&st, le, sizeof(le));
    crypto_generichash_update(&st, c, sizeof(c));
    crypto_generichash_final(&st, h, sizeof(h));
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
        acc[i] ^= h[i];
}

/* The relay terms are exactly the documented ones. A trainer (daemon 0) sends the left and
 * right halves of an fp32 [8, 16] matrix (origins 0 and 1) in one packed message to a relay
 * (daemon 1), which forwards the whole matrix (relay transfer 2, a relay message without a
 * message digest) to daemon 2: the trainer's sent digest is its message's and the terms of both
 * origins for relay 2 over the halves' bytes, the relay's are its received message's alone,
 * the last receiver's received digest is the same terms, over the halves cut out of the whole
 * it received; under sample too (seq 0 is picked), under off none. */
Test(xfer_relay, relay_terms_are_the_documented_ones)
{
    enum { R = 8, C = 16, H = C / 2 };
    float src[R * C], mid[R * C], leaf[R * C], halves[2][R * H];
    rf_xfer_item ti[2], bi[3], ci;
    rf_xfer_origin org[2];
    uint64_t to[1] = {2};
    rf_xfer_msg am, bm[2], cm;
    rf_xfer_job aj, bj, cj;
    world w;

    for (int i = 0; i < R * C; i++)
        src[i] = (float)i * 0.5f - 3.0f;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            halves[c / H][r * H + c % H] = src[r * C + c];
    ti[0] = item_box(src, R, C, 0, R, 0, H, 0);
    ti[1] = item_box(src, R, C, 0, R, H, H, sizeof(halves[0]));
    bi[0] = item_box(mid, R, C, 0, R, 0, H, 0);
    bi[1] = item_box(mid, R, C, 0, R, H, H, sizeof(halves[0]));
    bi[2] = item_box(mid, R, C, 0, R, 0, C, 0);
    ci = item_box(leaf, R, C, 0, R, 0, C, 0);
    for (int k = 0; k < 2; k++) {
        ti[k].id = (uint64_t)k;
        ti[k].relay_to = to;
        ti[k].nrelay_to = 1;
        org[k] = (rf_xfer_origin){.id = (uint64_t)k, .seq = 0, .box = ti[k].box};
    }
    ci.id = 2;
    ci.origins = org;
    ci.norigins = 2;
    am = (rf_xfer_msg){.seq = 0, .round = 0, .kind = RF_PLAN_PACKED, .send = true, .peer = 1,
                       .bytes = sizeof(src), .nitems = 2, .items = ti};
    bm[0] = am;
    bm[0].send = false;
    bm[0].peer = 0;
    bm[0].items = bi;
    bm[1] = (rf_xfer_msg){.seq = 1, .round = 1, .kind = RF_PLAN_PACKED, .send = true, .peer = 2,
                          .bytes = sizeof(src), .e2e = true, .nitems = 1, .items = &bi[2]};
    cm = bm[1];
    cm.send = false;
    cm.peer = 1;
    cm.items = &ci;
    aj = (rf_xfer_job){.version = 4, .nrounds = 2, .nmsgs = 1, .msgs = &am, .timeout_s = 20};
    bj = aj;
    bj.nmsgs = 2;
    bj.msgs = bm;
    cj = aj;
    cj.msgs = &cm;
    world_open(&w, 3);
    for (int v = RF_VERIFY_OFF; v <= RF_VERIFY_FULL; v++) {
        uint8_t sent[RF_XFER_DIGEST_BYTES] = {0}, recv[RF_XFER_DIGEST_BYTES] = {0};
        uint8_t mid_recv[RF_XFER_DIGEST_BYTES] = {0}, zero[RF_XFER_DIGEST_BYTES] = {0};

        aj.verify = bj.verify = cj.verify = v;
        memset(mid, 0, sizeof(mid));
        memset(leaf, 0, sizeof(leaf));
        world_run(&w, (rf_xfer_job *[]){&aj, &bj, &cj});
        for (int d = 0; d < 3; d++)
            cr_assert_eq(w.res[d].code, 0, "daemon %d: %s", d, w.res[d].error);
        cr_assert(memcmp(leaf, src, sizeof(src)) == 0);
        if (v != RF_VERIFY_OFF) {
            digest_ref(0, halves, sizeof(halves), sent);
            digest_ref(0, halves, sizeof(halves), mid_recv);
            for (int k = 0; k < 2; k++) {
                term_ref(2, (uint64_t)k, halves[k], sizeof(halves[k]), sent);
                term_ref(2, (uint64_t)k, halves[k], sizeof(halves[k]), recv);
            }
        }
        cr_assert(memcmp(w.res[0].digest_sent, sent, sizeof(sent)) == 0, "verify %d", v);
        cr_assert(memcmp(w.res[1].digest_recv, mid_recv, sizeof(recv)) == 0, "verify %d", v);
        cr_assert(memcmp(w.res[1].digest_sent, zero, sizeof(zero)) == 0, "verify %d", v);
        cr_assert(memcmp(w.res[2].digest_recv, recv, sizeof(recv)) == 0, "verify %d", v);
        cr_assert(digests_match(&w), "verify %d", v);
    }
    world_close(&w);
}

/* The ends of a relay tree where they cannot be: refused by the job check, naming the message
 * and item. */
Test(xfer_check, relay_ends_out_of_place_are_refused)
{
    rf_xfer_origin inside = {.id = 7, .seq = 3}, outside = inside, empty = inside;
    uint64_t to[1] = {9};

    for (int c = 0; c < 8; c++) {
        pair p;
        rf_xfer_job *j;
        const char *says = "";
        rf_xfer_origin two[2];
        rf_err err;

        pair_init(&p, 1);
        inside.box = p.r_items[0].box;
        inside.box.extent[0] = ROWS / 2;
        outside.box = p.r_items[0].box;
        outside.box.start[0] = ROWS / 2;
        empty.box = inside.box;
        empty.box.extent[1] = 0;
        j = &p.rjob;
        switch (c) {
        case 0:
            p.r_items[0].norigins = 1;
            says = "counts 1 origins and 0 relay recipients without their arrays";
            break;
        case 1:
            p.s_items[0].origins = &inside;
            p.s_items[0].norigins = 1;
            j = &p.sjob;
            says = "seq 10 item 0 lists relay origins on its sending end";
            break;
        case 2:
            p.r_items[1].relay_to = to;
            p.r_items[1].nrelay_to = 1;
            says = "seq 11 item 0 lists relay recipients on its receiving end";
            break;
        case 3:
            p.r_items[0].origins = &outside;
            p.r_items[0].norigins = 1;
            says = "origin transfer 7 is box [128:384, 0:1024], empty or outside it";
            break;
        case 4:
            p.r_items[0].origins = &empty;
            p.r_items[0].norigins = 1;
            says = "empty or outside it";
            break;
        case 5:
            /* A relay without a message digest whose origins leave half its item out. */
            p.rmsgs[0].e2e = true;
            p.r_items[0].origins = &inside;
            p.r_items[0].norigins = 1;
            says = "relay message seq 10 has no message digest, but the origins of its item 0 "
                   "(1 of them) do not tile its box";
            break;
        case 6:
            /* Two origins that add up to its volume but overlap (row ROWS / 2 - 1 twice, the
             * last row never). */
            p.rmsgs[0].e2e = true;
            two[0] = two[1] = inside;
            two[1].box.start[0] = ROWS / 2 - 1;
            p.r_items[0].origins = two;
            p.r_items[0].norigins = 2;
            says = "(2 of them) do not tile its box";
            break;
        case 7:
            p.rmsgs[0].e2e = true;
            p.rmsgs[0].kind = RF_PLAN_LOCAL;
            says = "local message seq 10 is marked as a relay checked end to end";
            break;
        }
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), -EINVAL, "case %d", c);
        cr_assert(strstr(err.msg, says), "case %d: %s", c, err.msg);
        /* The same item as a well-placed end passes; so does a relay whose two origins tile
         * it. */
        if (c == 3) {
            p.r_items[0].origins = &inside;
            cr_assert_eq(rf_xfer_job_check(j, 2, &err), 0, "%s", err.msg);
        }
        if (c == 6) {
            two[1].box.start[0] = ROWS / 2;
            cr_assert_eq(rf_xfer_job_check(j, 2, &err), 0, "%s", err.msg);
        }
        pair_free(&p);
    }
}

/* ---- between jobs: the listener is served -------------------------------------------------- */

/* No job runs: a connection is challenged at once and garbage closes it; the transports' own
 * connections carry the next job as before. */
Test(xfer_idle, garbage_between_jobs_is_read_and_refused)
{
    uint8_t na[32];
    world w;
    int fd;

    world_open(&w, 2);
    good_pair_run(&w, 1);
    fd = dial(addr_of(&w, 1));
    cr_assert_eq(read_full(fd, na, sizeof(na)), sizeof(na), "no challenge between jobs");
    cr_assert_eq(write(fd, "GET / HTTP/1.0\r\n\r\n", 18), 18);
    cr_assert(closed_within(fd, 2.0), "garbage sent between jobs was not refused");
    close(fd);
    good_pair_run(&w, 2);
    world_close(&w);
}

/* A connection that stays silent, or stops inside its hello, is closed once the hello timeout
 * (5 s) passed, job or not. */
Test(xfer_idle, silence_between_jobs_is_closed_after_the_hello_timeout)
{
    uint8_t na[32], head[8];
    int quiet, half;
    double t0;
    world w;

    world_open(&w, 2);
    t0 = now_s();
    quiet = dial(addr_of(&w, 0));
    half = dial(addr_of(&w, 0));
    cr_assert_eq(read_full(quiet, na, sizeof(na)), sizeof(na), "no challenge between jobs");
    cr_assert_eq(read_full(half, na, sizeof(na)), sizeof(na), "no challenge between jobs");
    put32(head, 0x48584652u);
    put32(head + 4, 3);
    write_all(half, head, sizeof(head));
    cr_assert(closed_within(quiet, 8.0), "a silent connection was kept between jobs");
    cr_assert(closed_within(half, 8.0), "half a hello was kept between jobs");
    cr_assert_geq(now_s() - t0, 4.5, "closed before its hello was due");
    close(quiet);
    close(half);
    good_pair_run(&w, 1);
    world_close(&w);
}

/* Hellos are checked between jobs as in one: another key is refused at once, and the job that
 * then waits in vain names it; the key's hello is held, neither answered nor closed (the plan
 * that numbers its peers may not be installed yet), and the next job accepts it. */
Test(xfer_idle, hellos_between_jobs)
{
    bool accepted;
    fconn f;
    pair p;
    world w;

    world_open(&w, 2);
    f = auth_dial(addr_of(&w, 1), KEY_B, 0, 1, &accepted);
    cr_assert_not(accepted, "a hello under another key was accepted");
    cr_assert(closed_within(f.fd, 2.0));
    close(f.fd);
    pair_init(&p, 1);
    p.rjob.timeout_s = 0.3;
    world_run(&w, (rf_xfer_job *[]){NULL, &p.rjob});
    cr_assert_eq(w.res[1].code, -ETIMEDOUT, "%s", w.res[1].error);
    cr_assert(strstr(w.res[1].error, "claiming to be peer 0 failed authentication: cluster keys "
                     "differ?"), "%s", w.res[1].error);
    pair_free(&p);
    {
        uint8_t na[32], nc[32], hello[HELLO_LEN], ack[ACK_LEN], want[32];
        struct timeval tv = {.tv_usec = 500000};
        int fd = dial(addr_of(&w, 1));

        cr_assert_eq(read_full(fd, na, sizeof(na)), sizeof(na));
        randombytes_buf(nc, sizeof(nc));
        make_hello(hello, KEY_A, na, nc, 0, 1);
        write_all(fd, hello, sizeof(hello));
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        cr_assert_lt(read(fd, ack, sizeof(ack)), 0, "a hello was answered or closed between "
                     "jobs");
        cr_assert(errno == EAGAIN || errno == EWOULDBLOCK, "%s", strerror(errno));
        /* The plan is installed after the peer connected: its hello waits through that. */
        world_set_peers(&w);
        pair_init(&p, 1);
        p.rjob.timeout_s = 0.3;
        world_run(&w, (rf_xfer_job *[]){NULL, &p.rjob});
        pair_free(&p);
        hs_mac(KEY_A, "refit-data-v3 accept", na, hello, want);
        cr_assert_eq(read_full(fd, ack, sizeof(ack)), sizeof(ack), "the job did not accept the "
                     "held hello");
        cr_assert(memcmp(ack, "RFXA", 4) == 0 && memcmp(ack + 4, want, 32) == 0);
        close(fd);
    }
    good_pair_run(&w, 2);
    world_close(&w);
}

/* A packed message that says more bytes than its items tile is refused on either side: the
 * tail past the items would go out as whatever the staging buffer held. One that says fewer
 * leaves an item outside its payload. The gap and overlap cases are in refused_jobs. */
Test(xfer_check, a_packed_message_longer_than_its_items_is_refused)
{
    rf_err err;

    for (int side = 0; side < 2; side++) {
        pair p;
        rf_xfer_job *j;
        rf_xfer_msg *m;
        char want[96];

        pair_init(&p, 1);
        j = side ? &p.rjob : &p.sjob;
        m = side ? &p.rmsgs[1] : &p.smsgs[1];
        cr_assert_eq(m->kind, RF_PLAN_PACKED);
        snprintf(want, sizeof(want), "packed message seq 11 says %llu bytes, its items hold %llu",
                 (unsigned long long)m->bytes + 4, (unsigned long long)m->bytes);
        m->bytes += 4;
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), -EINVAL, "side %d: %s", side, err.msg);
        cr_assert(strstr(err.msg, want), "side %d: %s", side, err.msg);
        m->bytes -= 8;
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), -EINVAL, "side %d: %s", side, err.msg);
        cr_assert(strstr(err.msg, "lies outside its message's payload"), "side %d: %s", side,
                  err.msg);
        m->bytes += 4;
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), 0, "side %d: %s", side, err.msg);
        pair_free(&p);
    }
}

/* The first peer past the table, and a direct message longer than its one item, are refused
 * by the job check on either side. */
Test(xfer_check, a_peer_past_the_table_and_a_direct_message_longer_than_its_item)
{
    rf_err err;

    for (int side = 0; side < 2; side++) {
        pair p;
        rf_xfer_job *j;
        rf_xfer_msg *m;
        uint32_t saved;
        char want[128];

        pair_init(&p, 1);
        j = side ? &p.rjob : &p.sjob;
        m = side ? &p.rmsgs[0] : &p.smsgs[0];
        cr_assert_eq(m->kind, RF_PLAN_DIRECT);
        saved = m->peer;
        m->peer = 2;
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), -EINVAL, "side %d: %s", side, err.msg);
        cr_assert(strstr(err.msg, "message seq 10 names peer 2, the peer table holds 2"),
                  "side %d: %s", side, err.msg);
        m->peer = saved;
        snprintf(want, sizeof(want), "direct message seq 10 must carry exactly one item of its "
                 "%llu bytes", (unsigned long long)m->bytes + 4);
        m->bytes += 4;
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), -EINVAL, "side %d: %s", side, err.msg);
        cr_assert(strstr(err.msg, want), "side %d: %s", side, err.msg);
        m->bytes -= 4;
        rf_err_clear(&err);
        cr_assert_eq(rf_xfer_job_check(j, 2, &err), 0, "side %d: %s", side, err.msg);
        pair_free(&p);
    }
}
