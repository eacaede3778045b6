/* publisherd/coordinator.h - the cluster state machine, run by the one publisherd configured
 * as coordinator: membership, the plan, publish quorum, Start, Done, Commit or Abort. */
#ifndef RF_COORDINATOR_H
#define RF_COORDINATOR_H

#include <jansson.h>
#include <uv.h>

#include "daemon_cfg.h"
#include "metrics.h"
#include "peer.h"

typedef struct rf_coord rf_coord;

int rf_coord_start(uv_loop_t *loop, const rf_daemon_cfg *cfg, const rf_peer_key *key,
                   uint64_t daemon_id, rf_metrics *metrics, rf_coord **out, rf_err *err);
void rf_coord_close(rf_coord *c);
/* Adds the cluster view ("cluster": members, plan, state, last refit) to a status document;
 * the signature of rf_node_status_hook. */
void rf_coord_status(json_t *status, void *arg);
/* Fuzzing and tests: handles env as if authenticated member (publishers 0..npub-1, then the
 * receivers) had sent it. */
void rf_coord__envelope(rf_coord *c, uint32_t member, const Refit__Envelope *env);

#endif
