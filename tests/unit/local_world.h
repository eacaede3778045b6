/* tests/unit/local_world.h - one local transport on a loop of the test's own, for
 * test_xfer_local and test_xfer_local_cuda (tests/unit/local_world.c; unit tests only). */
#ifndef RF_LOCAL_WORLD_H
#define RF_LOCAL_WORLD_H

#include <stdbool.h>

#include <uv.h>

#include "xfer.h"

typedef struct world {
    uv_loop_t loop;
    uv_timer_t guard;  /* fails the test when a job hangs */
    uv_idle_t watch;   /* the abort-mid-copy watcher */
    rf_xfer_transport *t;
    rf_xfer_result res;
    bool got;
    int closing;
    double t_abort, t_done; /* monotonic seconds of the last abort and done */
} world;

/* A local transport (GPU memory with gpu) whose peer 0 is the trainers' daemon of this host. */
void world_open(world *w, bool gpu);
/* Runs job to its end (fails the test after 120 s); with abort_mid, aborts it as soon as it
 * reports its first copied bytes, so that the abort lands mid-copy. w->res is its result. */
void world_run(world *w, rf_xfer_job *job, bool abort_mid);
/* Sets job up (rf_xfer_prepare) and waits for its done; w->res is its result. */
void world_prepare(world *w, rf_xfer_job *job);
/* Closes the transport and the loop; every handle must be gone. */
void world_close(world *w);
/* The done callback world_run passes (for tests that call rf_xfer_run themselves). */
void world_on_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg);

#endif
