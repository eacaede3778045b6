/* common/data/xfer_core.h - the transport core as its backends see it (xfer_tcp.c, xfer_nccl.c): the
 * contract a backend fulfils (rf_xfer_backend), the state every transport shares and the
 * helpers a backend calls. Only common/xfer*.c include it. */
#ifndef RF_XFER_CORE_H
#define RF_XFER_CORE_H

#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>

#include "wdigest.h"
#include "xfer.h"

typedef struct rf_xfer_core rf_xfer_core;

/* The backend contract, for xfer_*.c (their helpers are in xfer_core.h). The core (xfer.c)
 * owns a job's life: it refuses what it can check itself (closing, busy, no peer table, no
 * deadline, rf_xfer_job_check), runs one job at a time on a worker thread of its own, stops it
 * at an abort or at the deadline, hands the result to the loop thread, keeps the peer table,
 * and closes. A backend only posts, progresses and cancels its own operations; every hook gets
 * the core embedded first in the backend's struct, and, unless said otherwise, may be NULL.
 *
 * Loop thread, no job running:
 *   set_peers  adopts the peer table the core is about to keep (the old one is still in t):
 *              check the addresses, carry per-peer state over; -errno with err to refuse it.
 *   check      refuses a job the backend cannot run (no key, no world, the job outside it);
 *              called after the core's own checks.
 *   release    frees the backend (required): called once, after the core's handle is closed.
 * Worker thread, t->job set, one call after the other:
 *   start      prepares the job (required); 0 or the error, set with rf_xfer__fail.
 *   progress   one step of work (required); may block up to wait_s seconds, waking early when
 *              rf_xfer__wake_fd turns readable (an abort). 1 when the job is complete, 0 to
 *              be called again, or the error, set with rf_xfer__fail. A step that waits longer
 *              on something (a world joining) checks rf_xfer__stop itself.
 *   describe   names what is outstanding (required), for "aborted with ..." and "deadline of
 *              N s passed with ...".
 *   finish     the job ended with rc (0 or its error): release what was only the job's and,
 *              when it failed, cancel what is in flight so the next job starts clean.
 *   teardown   releases, at close, what is slow to release (communicators, device memory):
 *              run on a worker before the handle closes.
 * The optional set_world and needs_world implement rf_xfer_set_world/rf_xfer_needs_world.
 *
 * A new backend needs none of the harness: it embeds rf_xfer_core, calls rf_xfer__init last
 * in its constructor, and fills in this table. */
typedef struct rf_xfer_backend {
    const char *name;
    /* start sets up only what this process keeps for the job (communicators, device buffers,
     * its plan of execution) and reaches no peer except through a collective world join:
     * rf_xfer_prepare may run it alone, ahead of the job. */
    bool prepares;
    bool local;  /* runs RF_PLAN_LOCAL messages, and only those; the core refuses them on
                    every other backend */
    int (*set_peers)(rf_xfer_core *t, uint32_t self, uint32_t npeers, char *const *addrs,
                     rf_err *err);
    int (*check)(rf_xfer_core *t, const rf_xfer_job *job, rf_err *err);
    void (*release)(rf_xfer_core *t);
    int (*start)(rf_xfer_core *t);
    int (*progress)(rf_xfer_core *t, double wait_s);
    void (*describe)(rf_xfer_core *t, char *buf, size_t len);
    void (*finish)(rf_xfer_core *t, int rc);
    void (*teardown)(rf_xfer_core *t);
    int (*set_world)(rf_xfer_core *t, const rf_xfer_world *w, rf_err *err);
    bool (*needs_world)(const rf_xfer_core *t);
} rf_xfer_backend;

/* A transport is its backend's table; callers see it only through the functions of xfer.h. */
struct rf_xfer_transport {
    const rf_xfer_backend *ops;
};

/* What every transport holds, embedded first in its backend's struct (whose hooks cast back).
 * Fields from `job` on are the worker's while a job runs and the loop thread's otherwise;
 * running, closing and the callbacks are the loop thread's. */
struct rf_xfer_core {
    rf_xfer_transport pub;
    /* Where the other daemons reach this transport's data path (tcp: its listener), set by
     * rf_xfer_open; NULL when they need no address (nccl bootstraps from the unique id). */
    const char *data_addr;
    /* Payload bytes the running job has moved so far (rf_xfer__moved adds, anyone reads). */
    _Atomic uint64_t progress;
    uv_loop_t *loop;
    uv_async_t async;
    int wake_fd; /* eventfd written by rf_xfer_abort: wakes a progress step that polls */
    uint32_t self, npeers;
    char **addrs; /* npeers entries, each may be NULL (a backend that needs none) */
    bool running, closing, tearing_down, handle_closed;
    atomic_bool abort_req, finished;
    pthread_t thread;
    rf_xfer_done_cb done;
    void *done_arg;
    rf_xfer_close_cb close_cb;
    void *close_arg;
    const rf_xfer_job *job;
    bool prepare; /* the worker runs only the backend's start for job (rf_xfer_prepare) */
    /* Test hook, never set in production: REFIT_TEST_PREPARE_GATE names a file that a setup
     * ahead of Start waits for before it begins, so that a test can hold it in flight. */
    const char *prepare_gate;
    /* Test hook, never set in production: while the file REFIT_TEST_JOB_HOLD names exists, a
     * job that has moved bytes holds before its next step (an abort or the deadline still
     * ends it), so that a test can act while a refit is certainly in flight. */
    const char *job_hold;
    double deadline; /* monotonic seconds, set when the worker starts */
    rf_xfer_result result;
    /* A likely cause of silence, named first in a deadline message (tcp: a peer whose hello
     * failed authentication); cleared at each job's start. */
    char note[176];
};

/* Makes a transport of backend be on loop: size bytes, zeroed, whose first member is the core
 * (the backend's struct), set up. Called last by a backend's constructor, once whatever can
 * fail is done: undoing this needs the loop (rf_xfer_close). */
int rf_xfer__new(size_t size, const rf_xfer_backend *be, uv_loop_t *loop, rf_xfer_core **out,
                 rf_err *err);

/* Monotonic seconds. */
double rf_xfer__now(void);
/* Fails the running job with code and a message for the result; the first failure wins (the
 * later ones are its consequences). Returns the job's code. Worker thread. */
int rf_xfer__fail(rf_xfer_core *t, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* -ECANCELED after an abort, -ETIMEDOUT past the deadline, else 0: for a step that waits. */
int rf_xfer__stop(const rf_xfer_core *t);
/* Peer p's data address, or "?" (no such peer, or none given). */
const char *rf_xfer__peer_addr(const rf_xfer_core *t, uint32_t p);
/* Message m (bytes payload bytes) is moved: counted in the result and in rf_xfer_progress. */
void rf_xfer__moved(rf_xfer_core *t, const rf_xfer_msg *m);
/* The job holds `bytes` of staging now: the result keeps the most. */
void rf_xfer__staging(rf_xfer_core *t, uint64_t bytes);

static inline int rf_xfer__wake_fd(const rf_xfer_core *t)
{
    return t->wake_fd;
}

/* Relays (plan.h's ordering rule): a daemon that both receives and sends in one job (a
 * receiverd forwarding what it received) sends a message of round r only once every message
 * it receives in rounds < r is complete, its bytes in destination memory. A job that only
 * sends or only receives (publishers, receivers without relays) is not gated: its rounds
 * overlap as the backend allows. Worker thread. */
typedef struct rf_xfer_order {
    uint32_t *recv_left; /* per round: receives not complete yet */
    uint32_t nrounds;
    uint32_t recv_lo;    /* the first round with a receive not complete; nrounds when none */
    bool gated;          /* the job sends and receives */
} rf_xfer_order;

/* -ENOMEM (nothing held), else 0. */
int rf_xfer__order_init(rf_xfer_order *o, const rf_xfer_job *job);
/* A receive of round `round` is complete. */
void rf_xfer__order_recv_done(rf_xfer_order *o, uint32_t round);
void rf_xfer__order_free(rf_xfer_order *o);
/* Whether sends of round `round` may start. */
static inline bool rf_xfer__order_send_ok(const rf_xfer_order *o, uint32_t round)
{
    return !o->gated || round <= o->recv_lo;
}

/* The verification digest (xfer.h, rf_xfer_result): BLAKE2b-256 of the message's seq as 4
 * bytes little-endian and its first rf_xfer_msg_digest_bytes payload bytes, XORed into the
 * digest of its direction. rf_xfer__digest_begin returns false when the job's verify setting
 * does not pick m; else the payload goes in through _add, in order, and _end folds it in. */
typedef struct rf_xfer_digest {
    crypto_generichash_state st;
    uint8_t *acc;
    uint64_t left; /* payload bytes the digest still covers */
} rf_xfer_digest;

bool rf_xfer__digest_begin(rf_xfer_core *t, const rf_xfer_msg *m, rf_xfer_digest *d);
void rf_xfer__digest_add(rf_xfer_digest *d, const uint8_t *p, uint64_t n);
void rf_xfer__digest_end(rf_xfer_digest *d);
/* Relays' end-to-end terms (xfer.h, rf_xfer_origin) of item it of message m: rf_xfer__e2e_bytes
 * says how many leading bytes of its payload they read (0: none, it is no end of a relay tree
 * or verify picks none of its origins), rf_xfer__e2e_item folds them into the running job's
 * digests from p, those bytes in host memory. */
uint64_t rf_xfer__e2e_bytes(const rf_xfer_job *job, const rf_xfer_msg *m, const rf_xfer_item *it);
void rf_xfer__e2e_item(rf_xfer_core *t, const rf_xfer_item *it, const uint8_t *p);
/* All of it for a payload in host memory: the message's digest and its items' terms. */
void rf_xfer__digest_msg(rf_xfer_core *t, const rf_xfer_msg *m, const uint8_t *payload);
/* The message digest of a payload digested on the GPU (wdigest.h, under the job's digest_seed):
 * the term of verified message m, whose first rf_xfer_msg_digest_bytes payload bytes gave lanes
 * acc, XORed into digest_sent (sent) or digest_recv. */
void rf_xfer__wdigest_fold(rf_xfer_core *t, const rf_xfer_msg *m, bool sent,
                           const rf_wdigest_acc *acc);

#endif
