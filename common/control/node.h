/* common/control/node.h - one daemon's membership in the cluster, shared by refit-publisherd and
 * refit-receiverd: it serves the local clients (registry), reports the inventory and
 * readiness to the coordinator, receives its plan slice, runs the data path on Start and
 * reports Done, and applies Commit and Abort to its clients. */
#ifndef RF_NODE_H
#define RF_NODE_H

#include <jansson.h>
#include <uv.h>

#include "daemon_cfg.h"
#include "err.h"
#include "metrics.h"
#include "peer.h"

typedef struct rf_node rf_node;

/* Adds daemon-specific members to the status document (the coordinator's cluster view). */
typedef void (*rf_node_status_hook)(json_t *status, void *arg);

typedef struct rf_node_opts {
    const rf_daemon_cfg *cfg;
    const rf_peer_key *key;
    uint64_t daemon_id;
    rf_metrics *metrics; /* the daemon's registry; node families are added to it */
} rf_node_opts;

/* Opens the local socket, the data listener and the connection to the coordinator. */
int rf_node_start(uv_loop_t *loop, const rf_node_opts *opts, rf_node **out, rf_err *err);
/* Closes everything; handles finish closing while the loop runs. */
void rf_node_close(rf_node *n);

void rf_node_set_status_hook(rf_node *n, rf_node_status_hook fn, void *arg);
/* What the status hook adds changed: the snapshot is rendered again within a few ms. */
void rf_node_status_changed(rf_node *n);
/* The status document (caller decrefs), built on the loop thread. */
json_t *rf_node_status(rf_node *n);

/* ---- for tests and fuzzing only: the node without a coordinator's socket -----------------
 * A test plays the coordinator: rf_node__coord_up makes peer (any non-NULL pointer of its own)
 * the node's coordinator connection, rf_node__envelope hands in what the coordinator sends,
 * rf_node__coord_down drops it, and the function given to rf_node__set_send records what the
 * node sends. The node's connector keeps trying cfg->coordinator_addr meanwhile (point it at
 * a port nobody listens on). */

/* Sends env to peer; 0 or a negative errno (logged, as a failed rf_peer_send is). */
typedef int (*rf_node__send_fn)(void *peer, const Refit__Envelope *env, void *arg);
/* Every envelope to the coordinator goes through fn from now on (NULL: rf_peer_send again);
 * the node then never calls rf_peer_* on its coordinator peer. */
void rf_node__set_send(rf_node *n, rf_node__send_fn fn, void *arg);
/* The coordinator on peer passed the handshake (the connector's on_up, once the Hello said
 * coordinator): the node sends its inventory, readiness and receive quorum. */
void rf_node__coord_up(rf_node *n, void *peer);
/* The coordinator connection on peer ended; a peer that is not the current one is ignored. */
void rf_node__coord_down(rf_node *n, void *peer, const char *reason);
/* Handles env as if the coordinator had sent it. */
void rf_node__envelope(rf_node *n, const Refit__Envelope *env);
/* The last status document rendered by the loop, safe to call from any thread. */
char *rf_node_status_snapshot(rf_node *n);
/* A one-line summary for systemd's STATUS=. */
void rf_node_status_line(rf_node *n, char *buf, size_t len);

#endif
