/* tests/unit/local_world.c - one local transport on a loop of the test's own. */
#include "local_world.h"

#include <criterion/criterion.h>
#include <string.h>
#include <time.h>

#include "macros.h"

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void on_guard(uv_timer_t *h)
{
    (void)h;
    cr_assert_fail("a job did not finish within 120 s: the transport hangs");
}

void world_open(world *w, bool gpu)
{
    const char *addrs[2] = {NULL, NULL};
    rf_err err;

    memset(w, 0, sizeof(*w));
    cr_assert_eq(uv_loop_init(&w->loop), 0);
    uv_timer_init(&w->loop, &w->guard);
    uv_idle_init(&w->loop, &w->watch);
    cr_assert_eq(rf_xfer_local_new(&w->loop, gpu, &w->t, &err), 0, "%s", err.msg);
    cr_assert_str_eq(rf_xfer_name(w->t), "local");
    cr_assert(!rf_xfer_has_world(w->t));
    cr_assert(!rf_xfer_needs_world(w->t));
    cr_assert_str_eq(rf_xfer_data_addr(w->t), "");
    /* Peer 0: the trainers' daemon on this host, which needs no address. */
    cr_assert_eq(rf_xfer_set_peers(w->t, 1, 2, addrs, &err), 0, "%s", err.msg);
}

void world_on_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    world *w = arg;

    cr_assert_eq(t, w->t);
    cr_assert(!w->got, "done called twice");
    w->res = *res;
    w->got = true;
    w->t_done = now_s();
    uv_idle_stop(&w->watch);
    uv_stop(&w->loop);
}

static void on_watch(uv_idle_t *h)
{
    world *w = container_of(h, world, watch);

    if (rf_xfer_progress(w->t) > 0) {
        w->t_abort = now_s();
        rf_xfer_abort(w->t);
        uv_idle_stop(h);
    }
}

void world_run(world *w, rf_xfer_job *job, bool abort_mid)
{
    rf_err err;

    w->got = false;
    memset(&w->res, 0, sizeof(w->res));
    cr_assert_eq(rf_xfer_run(w->t, job, world_on_done, w, &err), 0, "%s", err.msg);
    if (abort_mid)
        uv_idle_start(&w->watch, on_watch);
    uv_timer_start(&w->guard, on_guard, 120000, 0);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w->guard);
    cr_assert(w->got);
}

void world_prepare(world *w, rf_xfer_job *job)
{
    rf_err err;

    w->got = false;
    memset(&w->res, 0, sizeof(w->res));
    cr_assert_eq(rf_xfer_prepare(w->t, job, world_on_done, w, &err), 0, "%s", err.msg);
    uv_timer_start(&w->guard, on_guard, 120000, 0);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w->guard);
    cr_assert(w->got);
}

static void on_closed(void *arg)
{
    ((world *)arg)->closing--;
}

void world_close(world *w)
{
    w->closing = 1;
    rf_xfer_close(w->t, on_closed, w);
    uv_close((uv_handle_t *)&w->guard, NULL);
    uv_close((uv_handle_t *)&w->watch, NULL);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    cr_assert_eq(w->closing, 0);
    cr_assert_eq(uv_loop_close(&w->loop), 0, "handles left open on the loop");
}
