/* publisherd/main.c - refit-publisherd: serves the trainers of one training node and sends
 * their weights; the one configured as coordinator also runs the cluster state machine. */
#include "coordinator.h"
#include "daemon.h"

static int coord_start(uv_loop_t *loop, const rf_daemon_cfg *cfg, const rf_peer_key *key,
                       uint64_t daemon_id, rf_metrics *metrics, void **state, rf_err *err)
{
    rf_coord *c = NULL;
    int rc;

    *state = NULL;
    if (!cfg->coordinator)
        return 0;
    rc = rf_coord_start(loop, cfg, key, daemon_id, metrics, &c, err);
    *state = c;
    return rc;
}

static void status_changed(void *node)
{
    rf_node_status_changed(node);
}

static void coord_attach(void *state, rf_node *node)
{
    rf_node_set_status_hook(node, rf_coord_status, state);
    rf_coord_set_on_change(state, status_changed, node);
}

static void coord_close(void *state)
{
    rf_coord_close(state);
}

int main(int argc, char **argv)
{
    static const rf_daemon_hooks hooks = {coord_start, coord_attach, coord_close};

    return rf_daemon_main(RF_DAEMON_PUBLISHER, argc, argv, &hooks);
}
