/* common/control/install.h - in-process install, the receiverd's side: engines whose memory
 * cannot be exported (a VMM allocation without a shareable handle type, plain host memory)
 * register it as in-process regions, and their own librefit installs into it (protocol in
 * proto/rpc.proto; the engine's side is client/lib/refit_install.c). Here: the engines' part
 * of each plan slice, held out of the daemon's own job (rf_install_plan), and the runs that
 * hand it to their installers and collect their InstallDone (rf_install). Runs on the
 * daemon's loop. */
#ifndef RF_INSTALL_H
#define RF_INSTALL_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "err.h"
#include "refit.pb-c.h"
#include "registry.h"
#include "rpc.pb-c.h"
#include "xfer.h"

/* An installer that has not answered InstallAbort within this long is given up: the refit
 * ends failed without it (the copies it may still run write its own engine's memory). */
#define RF_INSTALL_ABORT_WAIT_S 5.0

typedef struct rf_install_owner rf_install_owner;

/* The engines' part of one plan slice: per engine with in-process regions, its local
 * messages as packed PlanSlice frames, the last with last = true. */
typedef struct rf_install_plan {
    uint32_t nowners;
    rf_install_owner *owners;
    uint64_t serial;   /* set by the caller once complete: tells plans apart (never 0) */
    uint64_t bytes;    /* bytes the engines install */
    uint32_t nmsgs;
} rf_install_plan;

/* Splits slice frame ps: messages into in-process endpoints (rf_registry_endpoint_owner)
 * join their engine's frames in p; *rest gets a shallow copy of ps holding the others (its
 * msgs array malloc'd: free(rest->msgs)). A network message into an in-process endpoint is
 * refused (-EOPNOTSUPP, naming the engine): only same-host copies reach such memory. */
int rf_install_plan_add(rf_install_plan *p, const rf_registry *reg, const Refit__PlanSlice *ps,
                        Refit__PlanSlice *rest, rf_err *err);
void rf_install_plan_reset(rf_install_plan *p);

typedef struct rf_install rf_install;
/* Called on the loop when every installer of a run answered (or was given up); res is valid
 * during the call. */
typedef void (*rf_install_done_cb)(const rf_xfer_result *res, void *arg);

/* key (key_len bytes, copied): the cluster key, which proves this daemon to the publisherds
 * on its host when an installer asks for their memory; fetch_timeout_s bounds one fetch. */
int rf_install_new(uv_loop_t *loop, rf_registry *reg, const uint8_t *key, size_t key_len,
                   double fetch_timeout_s, rf_install **out, rf_err *err);
/* NULL is fine. Not while a run is in flight (its callback would never come). */
void rf_install_free(rf_install *in);
/* Runs version on the installers of plan p: each is sent the plan first if it has not got
 * this one (serial) since it attached, then InstallRun. 0 with nothing to run (no owners),
 * 1 when started (cb follows), or the error (nothing started). One run at a time. */
int rf_install_run(rf_install *in, const rf_install_plan *p, uint64_t version, int verify,
                   double timeout_s, rf_install_done_cb cb, void *arg, rf_err *err);
/* Sends InstallAbort to the installers still running; those that do not answer within
 * RF_INSTALL_ABORT_WAIT_S are given up. */
void rf_install_abort(rf_install *in);
/* Gives up the installers that did not answer an abort in time: call it every second or so
 * (the daemon's tick). */
void rf_install_tick(rf_install *in);
/* For status: whether a run is in flight, its version, its installers and how many of them
 * have not answered yet, and whether it is being aborted. false with nothing running. */
bool rf_install_running(const rf_install *in, uint64_t *version, uint32_t *installers,
                        uint32_t *unanswered, bool *aborting);
/* The installer of engine uid asks for the memory of the local publisher m names: only while
 * a run is in flight (-ESTALE otherwise), only a publisher and generation the engine's part
 * of that run's plan reads from (-EACCES, -ESTALE), and only the regions holding the pieces
 * that part reads. Fetched from the publisherd with the key (blocking, bounded by the fetch
 * timeout), its memfds reopened read-only and every fd passed on chan; *out is the Export's
 * answer to relay (the caller frees it). */
int rf_install_sources(rf_install *in, uint64_t uid, const Refit__Rpc__InstallSources *m,
                       int chan, Refit__Rpc__Response **out, rf_err *err);
/* The registry's callbacks, forwarded by the daemon. */
void rf_install_on_done(rf_install *in, uint64_t uid, const Refit__Rpc__InstallDone *m);
void rf_install_on_lost(rf_install *in, uint64_t uid, const char *why);

#endif
