/* common/service/daemon.h - what refit-publisherd and refit-receiverd share around their cluster
 * logic: configuration, logging, the event loop, signals, systemd notification, the status
 * endpoint. */
#ifndef RF_DAEMON_H
#define RF_DAEMON_H

#include <uv.h>

#include "daemon_cfg.h"
#include "metrics.h"
#include "node.h"
#include "peer.h"

/* Role-specific parts (the coordinator): started before the node, so that the node's first
 * connection finds the coordinator listening; attached to the node once it runs; closed
 * before the node. */
typedef struct rf_daemon_hooks {
    int (*start)(uv_loop_t *loop, const rf_daemon_cfg *cfg, const rf_peer_key *key,
                 uint64_t daemon_id, rf_metrics *metrics, void **state, rf_err *err);
    /* Called once the node runs (to hook into its status). */
    void (*attach)(void *state, rf_node *node);
    void (*close)(void *state);
} rf_daemon_hooks;

/* Runs a daemon to completion; returns the process exit status. */
int rf_daemon_main(int role, int argc, char **argv, const rf_daemon_hooks *hooks);

#endif
