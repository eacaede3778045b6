/* tests/unit/test_xfer_nccl.c - the nccl transport on two GPUs in one process: two transports
 * (ranks 0 and 1) on one loop, a real plan (qwen3 shrunk, trainer tp=2 on GPU 0, engine tp=4
 * on GPU 1) checked byte for byte with verification digests, an abort and a deadline mid-job
 * each followed by a good job in a fresh world, and the checks that need no GPU. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "layout.h"
#include "macros.h"
#include "model.h"
#include "plan.h"
#include "slice.h"
#include "xfer.h"

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "drv_cuda.h"
#include "xfer_data.h"

static bool two_gpus(void)
{
    int n = 0;

    if (!rf_cuda_available())
        return false;
    return cudaGetDeviceCount(&n) == cudaSuccess && n >= 2;
}

#define NEED_GPUS()                                                                   \
    do {                                                                              \
        if (!two_gpus()) {                                                            \
            printf("skipped: no CUDA device\n");                                      \
            cr_skip_test("no CUDA device");                                           \
        }                                                                             \
    } while (0)

/* ---- two transports on one loop --------------------------------------------------------- */

typedef struct world {
    uv_loop_t loop;
    uv_timer_t guard, poke;
    rf_xfer_transport *t[2];
    rf_xfer_result res[2];
    bool got[2];
    int pending, closing;
    int poke_target;
} world;

static void on_guard(uv_timer_t *h)
{
    (void)h;
    cr_assert_fail("a job did not finish within 60 s: the transport hangs");
}

static void set_world(world *w)
{
    uint8_t uid[RF_XFER_NCCL_ID_BYTES];
    rf_err err;

    cr_assert_eq(rf_xfer_nccl_unique_id(uid, &err), 0, "%s", err.msg);
    for (int i = 0; i < 2; i++) {
        uint32_t rank = (uint32_t)i;
        int dev = i;
        rf_xfer_world wd = {.nranks = 2, .nlocal = 1, .local_ranks = &rank,
                            .local_devices = &dev};

        memcpy(wd.unique_id, uid, sizeof(uid));
        cr_assert_eq(rf_xfer_set_world(w->t[i], &wd, &err), 0, "%s", err.msg);
        cr_assert(!rf_xfer_needs_world(w->t[i]));
    }
}

static void world_open(world *w)
{
    const char *addrs[2] = {"gpu0-daemon", "gpu1-daemon"};
    rf_err err;

    memset(w, 0, sizeof(*w));
    cr_assert_eq(uv_loop_init(&w->loop), 0);
    uv_timer_init(&w->loop, &w->guard);
    uv_timer_init(&w->loop, &w->poke);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(rf_xfer_nccl_new(&w->loop, &w->t[i], &err), 0, "%s", err.msg);
        cr_assert_str_eq(rf_xfer_name(w->t[i]), "nccl");
        cr_assert(rf_xfer_needs_world(w->t[i]));
        cr_assert_eq(rf_xfer_set_peers(w->t[i], (uint32_t)i, 2, addrs, &err), 0, "%s",
                     err.msg);
    }
    set_world(w);
}

static void on_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    world *w = arg;

    for (int i = 0; i < 2; i++) {
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

    rf_xfer_abort(w->t[w->poke_target]);
}

/* Runs jobs[i] on transport i (NULL: none); abort_ms > 0 aborts transport poke_target then. */
static void world_run(world *w, rf_xfer_job **jobs, uint64_t abort_ms)
{
    rf_err err;

    memset(w->got, 0, sizeof(w->got));
    memset(w->res, 0, sizeof(w->res));
    w->pending = 0;
    for (int i = 0; i < 2; i++) {
        if (!jobs[i])
            continue;
        cr_assert_eq(rf_xfer_run(w->t[i], jobs[i], on_done, w, &err), 0, "%s", err.msg);
        w->pending++;
    }
    if (abort_ms > 0)
        uv_timer_start(&w->poke, on_poke, abort_ms, 0);
    uv_timer_start(&w->guard, on_guard, 60000, 0);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w->guard);
    uv_timer_stop(&w->poke);
}

static void on_closed(void *arg)
{
    world *w = arg;

    w->closing--;
}

static void world_close(world *w)
{
    for (int i = 0; i < 2; i++) {
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

/* ---- data ---------------------------------------------------------------------------------- */

/* The cluster's memory: every source region on GPU 0, every destination region on GPU 1,
 * with host mirrors to fill and check. */
typedef struct cluster {
    const rf_inv *inv;
    uint32_t nregions;
    uint8_t **dev, **host;
} cluster;

static void cluster_alloc(cluster *c, const rf_inv *inv)
{
    c->inv = inv;
    c->nregions = rf_inv_nregions(inv);
    c->dev = calloc(c->nregions, sizeof(*c->dev));
    c->host = calloc(c->nregions, sizeof(*c->host));
    for (uint32_t r = 0; r < c->nregions; r++) {
        const rf_region *rg = rf_inv_region(inv, r);

        cr_assert_eq(cudaSetDevice(rf_inv_endpoint(inv, rg->endpoint)->side == RF_SRC ? 0 : 1),
                     cudaSuccess);
        cr_assert_eq(cudaMalloc((void **)&c->dev[r], rg->size + 1), cudaSuccess);
        c->host[r] = malloc(rg->size + 1);
        cr_assert_not_null(c->host[r]);
        memset(c->host[r], 0xee, rg->size + 1);
        cr_assert_eq(cudaMemcpy(c->dev[r], c->host[r], rg->size + 1, cudaMemcpyHostToDevice),
                     cudaSuccess);
    }
}

static void cluster_free(cluster *c)
{
    for (uint32_t r = 0; r < c->nregions; r++) {
        cudaFree(c->dev[r]);
        free(c->host[r]);
    }
    free(c->dev);
    free(c->host);
}

static void fill_sources(cluster *c, uint64_t version)
{
    xd_fill(c->inv, c->host, version);
    for (uint32_t r = 0; r < c->nregions; r++)
        if (rf_inv_endpoint(c->inv, rf_inv_region(c->inv, r)->endpoint)->side == RF_SRC)
            cr_assert_eq(cudaMemcpy(c->dev[r], c->host[r], rf_inv_region(c->inv, r)->size,
                                    cudaMemcpyHostToDevice), cudaSuccess);
}

/* Every destination byte holds the version's pattern, every other byte is untouched. */
static void check_destinations(cluster *c, uint64_t version)
{
    uint64_t wrong, stray;

    for (uint32_t r = 0; r < c->nregions; r++)
        if (rf_inv_endpoint(c->inv, rf_inv_region(c->inv, r)->endpoint)->side == RF_DST)
            cr_assert_eq(cudaMemcpy(c->host[r], c->dev[r], rf_inv_region(c->inv, r)->size + 1,
                                    cudaMemcpyDeviceToHost), cudaSuccess);
    xd_check(c->inv, c->host, version, &wrong, &stray);
    cr_assert_eq(wrong, 0, "%llu destination bytes wrong", (unsigned long long)wrong);
    cr_assert_eq(stray, 0, "%llu bytes outside destination pieces written",
                 (unsigned long long)stray);
}

/* ---- the inventory and the jobs ------------------------------------------------------------- */

/* inv with every source endpoint folded into endpoint 0 (GPU 0) and every destination one into
 * endpoint 1 (GPU 1); tensor, region and piece ids are kept. NCCL takes one rank per GPU. */
static rf_inv *two_endpoints(const rf_inv *in)
{
    rf_inv *out = NULL;
    rf_err err;

    cr_assert_eq(rf_inv_fold_sides(in, &out, &err), 0, "%s", err.msg);
    return out;
}

static rf_xfer_msg plan_side(const rf_plan *pl, uint32_t mi, rf_side side, uint8_t **bases)
{
    rf_xfer_msg m;
    rf_err err;

    cr_assert_eq(rf_slice_msg_from_plan(pl, mi, side, bases, side == RF_SRC ? 1 : 0, &m, &err),
                 0, "%s", err.msg);
    return m;
}

/* jobs[0]: every send (rank 0), jobs[1]: every receive (rank 1). */
static void jobs_from_plan(const rf_plan *pl, const rf_plan_opts *o, uint8_t **bases,
                           uint64_t version, double timeout_s, rf_xfer_job *jobs)
{
    uint32_t n = rf_plan_nmsgs(pl);

    for (int d = 0; d < 2; d++) {
        memset(&jobs[d], 0, sizeof(jobs[d]));
        jobs[d].version = version;
        jobs[d].nrounds = rf_plan_nrounds(pl);
        jobs[d].timeout_s = timeout_s;
        jobs[d].verify = RF_VERIFY_FULL;
        jobs[d].staging_bytes = o->staging_bytes;
        jobs[d].nmsgs = n;
        jobs[d].msgs = calloc(n ? n : 1, sizeof(rf_xfer_msg));
        cr_assert_not_null(jobs[d].msgs);
    }
    for (uint32_t mi = 0; mi < n; mi++) {
        jobs[0].msgs[mi] = plan_side(pl, mi, RF_SRC, bases);
        jobs[1].msgs[mi] = plan_side(pl, mi, RF_DST, bases);
    }
}

static void job_free(rf_xfer_job *j)
{
    for (uint32_t i = 0; i < j->nmsgs; i++)
        free(j->msgs[i].items);
    free(j->msgs);
    memset(j, 0, sizeof(*j));
}

static void digests_agree(const world *w)
{
    uint8_t s[RF_XFER_DIGEST_BYTES] = {0}, r[RF_XFER_DIGEST_BYTES] = {0};
    uint8_t zero[RF_XFER_DIGEST_BYTES] = {0};

    for (int i = 0; i < 2; i++) {
        for (int b = 0; b < RF_XFER_DIGEST_BYTES; b++) {
            s[b] ^= w->res[i].digest_sent[b];
            r[b] ^= w->res[i].digest_recv[b];
        }
    }
    cr_assert(memcmp(s, zero, sizeof(s)) != 0, "verify on, yet no digest was computed");
    cr_assert(memcmp(s, r, sizeof(s)) == 0,
              "XOR of sent digests differs from XOR of received ones");
}

typedef struct fixture {
    rf_model *m, *s;
    rf_inv *full, *inv;
    rf_plan *pl;
    rf_plan_opts o;
    cluster c;
    world w;
} fixture;

/* qwen3-0.6b shrunk 16x, trainer tp=2 (4 KiB... per piece) to engine tp=4, a staging budget
 * small enough for many rounds with both kinds of message. */
static void fixture_open(fixture *f)
{
    rf_par ps, pd;
    rf_err err;

    memset(f, 0, sizeof(*f));
    f->o = (rf_plan_opts){.staging_bytes = 512 << 10, .direct_min_bytes = 16 << 10};
    f->full = rf_inv_new();
    cr_assert_eq(rf_model_load("qwen3-0.6b", &f->m, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(f->m, 16, &f->s, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=2", RF_SRC, f->s, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=4", RF_DST, f->s, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(f->s, &ps, &pd, 8, f->full, &err), 0, "%s", err.msg);
    f->inv = two_endpoints(f->full);
    cr_assert_eq(rf_plan_build(f->inv, &f->o, &f->pl, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_plan_stats_get(f->pl)->direct_transfers, 0);
    cr_assert_gt(rf_plan_stats_get(f->pl)->packed_transfers, 0);
    cr_assert_geq(rf_plan_nrounds(f->pl), 3, "only %u rounds", rf_plan_nrounds(f->pl));
    cluster_alloc(&f->c, f->inv);
    world_open(&f->w);
}

static void fixture_close(fixture *f)
{
    world_close(&f->w);
    cluster_free(&f->c);
    rf_plan_free(f->pl);
    rf_inv_free(f->inv);
    rf_inv_free(f->full);
    rf_model_free(f->s);
    rf_model_free(f->m);
}

/* A whole refit of version v on both ranks, checked byte for byte. */
static void good_refit(fixture *f, uint64_t v)
{
    rf_xfer_job jobs[2];
    rf_xfer_job *jp[2] = {&jobs[0], &jobs[1]};
    const rf_plan_stats *st = rf_plan_stats_get(f->pl);

    fill_sources(&f->c, v);
    jobs_from_plan(f->pl, &f->o, f->c.dev, v, 30, jobs);
    world_run(&f->w, jp, 0);
    for (int d = 0; d < 2; d++) {
        cr_assert_eq(f->w.res[d].code, 0, "rank %d: %s", d, f->w.res[d].error);
        cr_assert_leq(f->w.res[d].peak_staging, jobs[d].staging_bytes + 4096,
                      "rank %d held %llu bytes of staging", d,
                      (unsigned long long)f->w.res[d].peak_staging);
    }
    cr_assert_eq(f->w.res[0].bytes_sent, st->dst_bytes);
    cr_assert_eq(f->w.res[1].bytes_recv, st->dst_bytes);
    check_destinations(&f->c, v);
    digests_agree(&f->w);
    job_free(&jobs[0]);
    job_free(&jobs[1]);
}

Test(xfer_nccl, plan_refit_between_two_gpus)
{
    fixture f;
    uint64_t now = 0, peak = 0;

    NEED_GPUS();
    fixture_open(&f);
    good_refit(&f, 1);
    /* Warm: communicators and staging are kept. */
    good_refit(&f, 2);
    rf_xfer_nccl_memory(f.w.t[0], &now, &peak);
    cr_assert_gt(now, 0, "no staging kept between jobs");
    cr_assert_leq(peak, f.o.staging_bytes + 4096);
    fixture_close(&f);
}

/* Runs jobs (already built over cluster c's memory) for version v and checks every byte. */
static void run_checked(fixture *f, cluster *c, rf_xfer_job *jobs, uint64_t v)
{
    rf_xfer_job *jp[2] = {&jobs[0], &jobs[1]};

    fill_sources(c, v);
    for (int d = 0; d < 2; d++)
        jobs[d].version = v;
    world_run(&f->w, jp, 0);
    for (int d = 0; d < 2; d++)
        cr_assert_eq(f->w.res[d].code, 0, "rank %d: %s", d, f->w.res[d].error);
    check_destinations(c, v);
}

/* Jobs with a plan_key keep their plan of execution for the next job of that key; another
 * key in the same job structures (another plan over other memory) is derived anew, or the
 * bytes would land in the first memory; unverified jobs run with four rounds enqueued, and
 * under each tuning the bytes stay right. */
Test(xfer_nccl, kept_plan_only_for_its_key)
{
    fixture f;
    rf_xfer_job jobs[2];
    rf_plan *other = NULL;
    rf_plan_opts o2;
    cluster c2;
    rf_err err;
    static const rf_xfer_nccl_tuning tunes[] = {{0, 0, 0}, {8, 2, 0}, {1, 1, 0}, {0, 3, 0}};

    NEED_GPUS();
    fixture_open(&f);
    jobs_from_plan(f.pl, &f.o, f.c.dev, 1, 30, jobs);
    for (int d = 0; d < 2; d++) {
        jobs[d].verify = RF_VERIFY_OFF;
        jobs[d].plan_key = 7;
    }
    for (size_t k = 0; k < sizeof(tunes) / sizeof(tunes[0]); k++) {
        for (int d = 0; d < 2; d++)
            cr_assert_eq(rf_xfer_nccl_tune(f.w.t[d], &tunes[k], &err), 0, "%s", err.msg);
        run_checked(&f, &f.c, jobs, 1 + k);
    }
    /* Another plan (every transfer packed, smaller rounds) in the same structures. */
    job_free(&jobs[0]);
    job_free(&jobs[1]);
    o2 = f.o;
    o2.staging_bytes = 256 << 10;
    o2.direct_min_bytes = UINT64_MAX;
    cr_assert_eq(rf_plan_build(f.inv, &o2, &other, &err), 0, "%s", err.msg);
    cr_assert_neq(rf_plan_nrounds(other), rf_plan_nrounds(f.pl));
    cluster_alloc(&c2, f.inv);
    jobs_from_plan(other, &o2, c2.dev, 10, 30, jobs);
    for (int d = 0; d < 2; d++) {
        jobs[d].verify = RF_VERIFY_OFF;
        jobs[d].plan_key = 8;
    }
    run_checked(&f, &c2, jobs, 10);
    run_checked(&f, &c2, jobs, 11);
    /* Tuning waits for the job to end. */
    cr_assert_eq(rf_xfer_run(f.w.t[0], &jobs[0], on_done, &f.w, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_nccl_tune(f.w.t[0], &tunes[0], &err), -EBUSY);
    cr_assert(strstr(err.msg, "while a job runs") != NULL, "%s", err.msg);
    cr_assert_eq(rf_xfer_run(f.w.t[1], &jobs[1], on_done, &f.w, &err), 0, "%s", err.msg);
    f.w.pending = 2;
    memset(f.w.got, 0, sizeof(f.w.got));
    uv_timer_start(&f.w.guard, on_guard, 60000, 0);
    uv_run(&f.w.loop, UV_RUN_DEFAULT);
    uv_timer_stop(&f.w.guard);
    for (int d = 0; d < 2; d++)
        cr_assert_eq(f.w.res[d].code, 0, "rank %d: %s", d, f.w.res[d].error);
    job_free(&jobs[0]);
    job_free(&jobs[1]);
    rf_plan_free(other);
    cluster_free(&c2);
    fixture_close(&f);
}

/* Rank 1 alone waits for data rank 0 never sends; stop it by abort (abort_ms) or deadline.
 * Then the world is spent: the same id is refused, a fresh one works. */
static void fail_then_good(fixture *f, uint64_t abort_ms, double timeout_s, int verify,
                           int code, const char *what)
{
    rf_xfer_job jobs[2];
    rf_xfer_job *jp[2] = {NULL, &jobs[1]};
    rf_err err;

    good_refit(f, 1); /* the world is up */
    jobs_from_plan(f->pl, &f->o, f->c.dev, 2, timeout_s, jobs);
    jobs[1].verify = verify;
    f->w.poke_target = 1;
    world_run(&f->w, jp, abort_ms);
    cr_assert_eq(f->w.res[1].code, code, "%d: %s", f->w.res[1].code, f->w.res[1].error);
    cr_assert(strstr(f->w.res[1].error, what) != NULL, "%s", f->w.res[1].error);
    cr_assert(strstr(f->w.res[1].error, "seq ") != NULL, "no message named: %s",
              f->w.res[1].error);
    cr_assert(strstr(f->w.res[1].error, "gpu0-daemon") != NULL, "no peer named: %s",
              f->w.res[1].error);
    job_free(&jobs[0]);
    job_free(&jobs[1]);
    cr_assert(rf_xfer_needs_world(f->w.t[1]));
    cr_assert_eq(rf_xfer_run(f->w.t[1], &(rf_xfer_job){.nrounds = 0, .timeout_s = 1}, NULL,
                             NULL, &err), -ESTALE);
    cr_assert(strstr(err.msg, "fresh unique id") != NULL, "%s", err.msg);
    set_world(&f->w);
    good_refit(f, 3);
}

Test(xfer_nccl, abort_mid_job_then_good_job)
{
    fixture f;

    NEED_GPUS();
    fixture_open(&f);
    fail_then_good(&f, 300, 30, RF_VERIFY_FULL, -ECANCELED, "aborted");
    fixture_close(&f);
}

/* Unverified: four rounds of receives enqueued ahead when the abort comes. */
Test(xfer_nccl, abort_with_rounds_enqueued_ahead_then_good_job)
{
    fixture f;

    NEED_GPUS();
    fixture_open(&f);
    fail_then_good(&f, 300, 30, RF_VERIFY_OFF, -ECANCELED, "aborted");
    fixture_close(&f);
}

Test(xfer_nccl, deadline_then_good_job)
{
    fixture f;

    NEED_GPUS();
    fixture_open(&f);
    fail_then_good(&f, 0, 0.5, RF_VERIFY_FULL, -ETIMEDOUT, "deadline of 0.5 s passed");
    fixture_close(&f);
}

Test(xfer_nccl, spent_unique_id_is_refused)
{
    fixture f;
    rf_xfer_job jobs[2];
    rf_xfer_job *jp[2] = {NULL, &jobs[1]};
    uint8_t uid[RF_XFER_NCCL_ID_BYTES];
    uint32_t rank = 1;
    int dev = 1;
    rf_xfer_world wd = {.nranks = 2, .nlocal = 1, .local_ranks = &rank, .local_devices = &dev};
    rf_err err;

    NEED_GPUS();
    fixture_open(&f);
    cr_assert_eq(rf_xfer_nccl_unique_id(uid, &err), 0, "%s", err.msg);
    /* Only rank 1 joins a world that rank 0 never joins: the deadline covers the setup. */
    memcpy(wd.unique_id, uid, sizeof(uid));
    cr_assert_eq(rf_xfer_set_world(f.w.t[1], &wd, &err), 0, "%s", err.msg);
    jobs_from_plan(f.pl, &f.o, f.c.dev, 1, 0.5, jobs);
    world_run(&f.w, jp, 0);
    cr_assert_eq(f.w.res[1].code, -ETIMEDOUT, "%s", f.w.res[1].error);
    cr_assert(strstr(f.w.res[1].error, "joined") != NULL, "%s", f.w.res[1].error);
    cr_assert_eq(rf_xfer_set_world(f.w.t[1], &wd, &err), -EINVAL);
    cr_assert(strstr(err.msg, "fresh one") != NULL, "%s", err.msg);
    job_free(&jobs[0]);
    job_free(&jobs[1]);
    set_world(&f.w);
    good_refit(&f, 2);
    fixture_close(&f);
}

/* A job naming a rank this daemon does not drive is refused before anything moves. */
Test(xfer_nccl, job_outside_the_world_is_refused)
{
    fixture f;
    rf_xfer_job jobs[2];
    rf_err err;

    NEED_GPUS();
    fixture_open(&f);
    jobs_from_plan(f.pl, &f.o, f.c.dev, 1, 5, jobs);
    /* Rank 0's sends handed to rank 1. */
    cr_assert_eq(rf_xfer_run(f.w.t[1], &jobs[0], NULL, NULL, &err), -EINVAL);
    cr_assert(strstr(err.msg, "drives no rank 0") != NULL, "%s", err.msg);
    job_free(&jobs[0]);
    job_free(&jobs[1]);
    fixture_close(&f);
}

#endif /* RF_HAVE_CUDA */

/* ---- what needs no GPU ------------------------------------------------------------------- */

#ifdef RF_HAVE_CUDA
static void closed_cb(void *arg)
{
    *(int *)arg = 1;
}

Test(xfer_nccl_nogpu, needs_a_world_and_checks_it)
{
    uv_loop_t loop;
    rf_xfer_transport *t = NULL;
    const char *addrs[2] = {"a", "b"};
    uint32_t ranks[2] = {0, 0};
    int devs[2] = {0, 1}, closed = 0;
    rf_xfer_world wd = {.nranks = 2, .nlocal = 2, .local_ranks = ranks, .local_devices = devs};
    rf_xfer_job job = {.nrounds = 0, .timeout_s = 1};
    rf_err err;

    cr_assert_eq(uv_loop_init(&loop), 0);
    cr_assert_eq(rf_xfer_nccl_new(&loop, &t, &err), 0, "%s", err.msg);
    cr_assert(rf_xfer_needs_world(t));
    cr_assert_eq(rf_xfer_run(t, &job, NULL, NULL, &err), -EINVAL);
    cr_assert(strstr(err.msg, "set_peers") != NULL, "%s", err.msg);
    cr_assert_eq(rf_xfer_set_peers(t, 2, 2, addrs, &err), -EINVAL);
    cr_assert_eq(rf_xfer_set_peers(t, 0, 2, addrs, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_run(t, &job, NULL, NULL, &err), -ESTALE);
    cr_assert(strstr(err.msg, "set_world") != NULL, "%s", err.msg);
    /* Two local ranks the same. */
    cr_assert_eq(rf_xfer_set_world(t, &wd, &err), -EINVAL);
    cr_assert(strstr(err.msg, "one rank per GPU") != NULL, "%s", err.msg);
    ranks[1] = 2;
    cr_assert_eq(rf_xfer_set_world(t, &wd, &err), -EINVAL);
    cr_assert(strstr(err.msg, "outside a world of 2") != NULL, "%s", err.msg);
    wd.nlocal = 0;
    cr_assert_eq(rf_xfer_set_world(t, &wd, &err), -EINVAL);
    wd.nlocal = 1;
    cr_assert_eq(rf_xfer_set_world(t, &wd, &err), 0, "%s", err.msg);
    cr_assert(!rf_xfer_needs_world(t));
    /* Tuning out of range. */
    cr_assert_eq(rf_xfer_nccl_tune(t, &(rf_xfer_nccl_tuning){.window = 5}, &err), -EINVAL);
    cr_assert(strstr(err.msg, "at most 4") != NULL, "%s", err.msg);
    cr_assert_eq(rf_xfer_nccl_tune(t, &(rf_xfer_nccl_tuning){.diag = 0x10}, &err), -EINVAL);
    cr_assert(strstr(err.msg, "unknown diagnostic flags") != NULL, "%s", err.msg);
    cr_assert_eq(rf_xfer_nccl_tune(t, &(rf_xfer_nccl_tuning){.copy_blocks = 4, .window = 1},
                                   &err), 0, "%s", err.msg);
    /* No deadline. */
    job.timeout_s = 0;
    cr_assert_eq(rf_xfer_run(t, &job, NULL, NULL, &err), -EINVAL);
    cr_assert(strstr(err.msg, "deadline") != NULL, "%s", err.msg);
    rf_xfer_close(t, closed_cb, &closed);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(closed, 1);
    cr_assert_eq(uv_loop_close(&loop), 0, "handles left open on the loop");
}
#else
Test(xfer_nccl, built_without_cuda)
{
    printf("skipped: no CUDA device\n");
    cr_skip_test("no CUDA device");
}
#endif
