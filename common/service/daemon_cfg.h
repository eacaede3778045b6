/* common/service/daemon_cfg.h - the configuration of refit-publisherd and refit-receiverd: typed fields
 * and the key tables behind them (common/service/cfg). */
#ifndef RF_DAEMON_CFG_H
#define RF_DAEMON_CFG_H

#include <stdbool.h>

#include "cfg.h"
#include "err.h"
#include "peer.h"
#include "xfer.h" /* rf_verify */

#define RF_VERSION "0.1.0"

enum rf_daemon_role { RF_DAEMON_PUBLISHER = 0, RF_DAEMON_RECEIVER = 1 };
enum rf_transport { RF_TRANSPORT_TCP = 0, RF_TRANSPORT_NCCL = 1 };
enum rf_local_copy { RF_LOCAL_COPY_OFF = 0, RF_LOCAL_COPY_AUTO = 1 };
enum rf_relay { RF_RELAY_OFF = 0, RF_RELAY_ON = 1 };

typedef struct rf_daemon_cfg {
    int role;                 /* enum rf_daemon_role, set by rf_daemon_cfg_load */
    char *node;               /* cluster-unique node name; default: the host name */
    bool coordinator;         /* publisherd only: this daemon runs the cluster state machine */
    char *coordinator_addr;   /* host:port to connect to; to listen on when coordinator */
    int busy_poll_ms;         /* coordinator: spin after the first Done, at most this long */
    int publishers;           /* expected publisher daemons, the coordinator included */
    int receivers;            /* expected receiver daemons */
    int clients;              /* expected local clients (trainer ranks / engine workers) */
    int index;                /* this daemon's index among its role, 0..publishers-1 etc. */
    char *socket;             /* local RPC socket path */
    rf_cfg_uids socket_uids;  /* uids allowed on the socket besides the daemon's own */
    char *data_listen;        /* host:port for data connections (tcp transport, NCCL boot) */
    char *status_listen;      /* host:port of /metrics and /status; "" disables */
    char *cluster_key_file;   /* shared secret for peer authentication */
    int transport;            /* enum rf_transport */
    int staging_mib;          /* staging budget per GPU per round, MiB */
    int direct_min_kib;       /* contiguous runs at least this large go zero-copy, KiB */
    int local_copy;           /* RF_LOCAL_COPY_*: same-host copies on (auto) or off */
    char *host_id;            /* this machine, for local_copy; "" means machine-id + boot id */
    int relay;                /* enum rf_relay: the coordinator plans with relays (issue 14) */
    int verify;               /* enum rf_verify */
    int heartbeat_ms;
    int peer_timeout_ms;      /* a peer silent this long is dead; > heartbeat_ms */
    int refit_timeout_s;      /* a refit not done by then is aborted */
    int log_level;            /* enum rf_log_level */
    int max_frame_mib;        /* largest control frame accepted, MiB */
    char *config_path;        /* not a key: the file that was read (for status) */
} rf_daemon_cfg;

extern const rf_cfg_table rf_daemon_cfg_publisherd;
extern const rf_cfg_table rf_daemon_cfg_receiverd;

/* Loads c (zeroed or not, it is reset) for role from argv (--config, --help, --version,
 * --check-config, --key=value) as rf_cfg_load does, then checks the keys against each other.
 * 0 with *next, or a negative errno with err; release c with rf_daemon_cfg_free either way. */
int rf_daemon_cfg_load(rf_daemon_cfg *c, int role, int argc, char **argv, rf_cfg_next *next,
                       rf_err *err);
void rf_daemon_cfg_free(rf_daemon_cfg *c);

/* What start-up needs of the machine, checked without changing anything: the cluster key
 * file (loaded into *key), the local socket path (fits a Unix socket address; a file there
 * is a socket), and the addresses the daemon listens on (resolve to addresses of this
 * machine). Start-up and --check-config both run it, so --check-config refuses what start-up
 * would. 0, or a negative errno with err saying what to change: -EADDRNOTAVAIL when an
 * address does not resolve or is not this machine's (the network may still be coming up),
 * anything else is wrong in the configuration or its files. */
int rf_daemon_cfg_check(const rf_daemon_cfg *c, rf_peer_key *key, rf_err *err);

const char *rf_transport_name(int transport);
/* The longest host_id, bytes: one word of printable ASCII (RF_CFG_WORD), so that it reads the
 * same in logs, status and the Hello that compares it. */
#define RF_DAEMON_HOST_ID_MAX 255
/* This machine's identity for same-host refits: c->host_id, or else the kernel's boot id
 * (/proc/sys/kernel/random/boot_id: one per running kernel, so containers of one machine
 * agree and a reboot is another host), or else /etc/machine-id. 0, or -errno with err when
 * none is readable (set host_id). */
int rf_daemon_host_id(const rf_daemon_cfg *c, char *out, size_t len, rf_err *err);
const char *rf_verify_name(int verify);

#endif
