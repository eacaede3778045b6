/* tests/unit/loop_thread.c - a libuv loop on a thread of its own, for the unit tests. */
#include "loop_thread.h"

#include <criterion/criterion.h>
#include <string.h>
#include <time.h>

#include "macros.h"

static void async_cb(uv_async_t *a)
{
    test_loop *l = container_of(a, test_loop, async);
    void (*fn)(void *);
    void *arg;

    pthread_mutex_lock(&l->mu);
    fn = l->fn;
    arg = l->arg;
    pthread_mutex_unlock(&l->mu);
    /* Unlocked: fn may make the daemon part call back, and the callbacks take the lock. */
    if (fn)
        fn(arg);
    pthread_mutex_lock(&l->mu);
    if (fn) {
        l->fn = NULL;
        l->done = true;
    }
    if (l->stop) {
        if (l->fin)
            l->fin(l->fin_arg);
        l->fin = NULL;
        uv_close((uv_handle_t *)&l->async, NULL);
    }
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void *loop_main(void *arg)
{
    test_loop *l = arg;

    uv_run(&l->loop, UV_RUN_DEFAULT);
    return NULL;
}

void test_loop_init(test_loop *l)
{
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    cr_assert_eq(uv_loop_init(&l->loop), 0);
    cr_assert_eq(uv_async_init(&l->loop, &l->async, async_cb), 0);
}

void test_loop_start(test_loop *l)
{
    cr_assert_eq(pthread_create(&l->th, NULL, loop_main, l), 0);
    l->started = true;
}

void test_loop_run(test_loop *l, void (*fn)(void *), void *arg)
{
    pthread_mutex_lock(&l->mu);
    l->fn = fn;
    l->arg = arg;
    l->done = false;
    uv_async_send(&l->async);
    while (!l->done)
        pthread_cond_wait(&l->cv, &l->mu);
    pthread_mutex_unlock(&l->mu);
}

void test_loop_bump(test_loop *l, int *counter)
{
    pthread_mutex_lock(&l->mu);
    (*counter)++;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

void test_loop_wait(test_loop *l, int *counter, int n)
{
    struct timespec ts;
    int got;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 5;
    pthread_mutex_lock(&l->mu);
    while (*counter < n)
        if (pthread_cond_timedwait(&l->cv, &l->mu, &ts) != 0)
            break;
    got = *counter;
    /* Unlocked before asserting: a failed test still tears down (teardown takes the lock). */
    pthread_mutex_unlock(&l->mu);
    cr_assert_geq(got, n, "callback did not come");
}

void test_loop_stop(test_loop *l, void (*fin)(void *), void *arg)
{
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    l->fin = fin;
    l->fin_arg = arg;
    pthread_mutex_unlock(&l->mu);
    uv_async_send(&l->async);
    /* The loop thread runs fin, closes the async handle and ends; without it (the test never
     * started it) this thread runs the loop to the same end. */
    if (l->started)
        pthread_join(l->th, NULL);
    uv_run(&l->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&l->loop), 0, "loop closed with handles open");
}
