/* publisherd/coordinator.h - the cluster state machine, run by the one publisherd configured
 * as coordinator: membership, the plan, publish quorum, Start, Done, Commit or Abort. */
#ifndef RF_COORDINATOR_H
#define RF_COORDINATOR_H

#include <stdbool.h>

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
/* fn(arg) is called after every change of the cluster view (from the loop thread), so that
 * a status snapshot is rendered again; NULL for none. */
void rf_coord_set_on_change(rf_coord *c, void (*fn)(void *arg), void *arg);

/* ---- for tests and fuzzing only: the state machine without sockets -----------------------
 * A test plays the members: it makes them join with rf_coord__member_up (peer is any non-NULL
 * pointer of its own), hands in what they send with rf_coord__envelope, drops them with
 * rf_coord__member_down, and records what the coordinator sends them through the function
 * given to rf_coord__set_send. Plan builds still run on the loop's thread pool and the
 * deadlines on its timers: the test runs the loop. */

/* Sends env to peer; 0 or a negative errno (logged, as a failed rf_peer_send is). */
typedef int (*rf_coord__send_fn)(void *peer, const Refit__Envelope *env, void *arg);
/* Every envelope to a member goes through fn from now on (NULL: rf_peer_send again). The
 * coordinator then never calls rf_peer_* on its members' peers, which are the test's. */
void rf_coord__set_send(rf_coord *c, rf_coord__send_fn fn, void *arg);
/* A member passed the handshake with Hello h (what the listener's on_up does). from names
 * where it came from, for the log. 0, or -EINVAL (a role or index outside the configuration)
 * or -EEXIST (that member is already up) with err saying so; the caller refuses the peer. */
int rf_coord__member_up(rf_coord *c, const Refit__Hello *h, void *peer, const char *from,
                        rf_err *err);
/* The member on peer is gone (the listener's on_down); a peer that is no member is ignored. */
void rf_coord__member_down(rf_coord *c, void *peer, const char *reason);
/* Handles env as if authenticated member (publishers 0..npub-1, then the receivers) had
 * sent it. */
void rf_coord__envelope(rf_coord *c, uint32_t member, const Refit__Envelope *env);
/* Runs the pending timer now, refit deadline or abort settle, as if it had expired; false
 * when none was pending. */
bool rf_coord__expire(rf_coord *c);

#endif
