/* tests/unit/loop_thread.h - a libuv loop on a thread of its own, for the unit tests that drive a
 * daemon part (registry, node) from the test's thread: run a function on the loop and wait for
 * it, wait for a counter the loop's callbacks bump, stop (tests/unit/loop_thread.c). */
#ifndef RF_LOOP_THREAD_H
#define RF_LOOP_THREAD_H

#include <pthread.h>
#include <stdbool.h>

#include <uv.h>

typedef struct test_loop {
    uv_loop_t loop;
    uv_async_t async;
    pthread_t th;
    bool started;       /* the loop thread runs (test_loop_start) */
    pthread_mutex_t mu; /* guards what follows, and what the test's callbacks share */
    pthread_cond_t cv;  /* broadcast after every change under mu */
    void (*fn)(void *);
    void *arg;
    bool done, stop;
    void (*fin)(void *); /* at stop, on the loop: closes what the test opened there */
    void *fin_arg;
} test_loop;

/* The loop and its async handle, not running yet (the test opens its handles on l->loop). */
void test_loop_init(test_loop *l);
/* Runs the loop on its thread. */
void test_loop_start(test_loop *l);
/* Runs fn(arg) on the loop thread and waits for it; fn runs without mu held. */
void test_loop_run(test_loop *l, void (*fn)(void *), void *arg);
/* From a loop callback: *counter++, under mu, waking the waiters. */
void test_loop_bump(test_loop *l, int *counter);
/* Waits up to 5 s for *counter (bumped with test_loop_bump) to reach n; fails the test if not. */
void test_loop_wait(test_loop *l, int *counter, int n);
/* Runs fin(arg) on the loop (NULL: nothing), closes the async handle, lets the loop end (on its
 * thread, or on this one when it never started) and checks that no handle was left open. */
void test_loop_stop(test_loop *l, void (*fin)(void *), void *arg);

#endif
