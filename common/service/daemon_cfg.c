/* common/service/daemon_cfg.c - key tables of the two daemons and their cross-key checks. */
#include "daemon_cfg.h"

#include <errno.h>
#include <netdb.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sodium.h>

#include "addr.h"
#include "rpc.h"

static const char *const transport_names[] = { "tcp", "nccl", NULL };
static const char *const verify_names[] = { "off", "sample", "full", NULL };
static const char *const level_names[] = { "error", "warn", "info", "debug", NULL };
static const char *const local_copy_names[] = { "off", "auto", NULL };
static const char *const relay_names[] = { "off", "on", NULL };

#define OFF(f) offsetof(rf_daemon_cfg, f)
#define KSTR(n, def, fl, help) { #n, RF_CFG_STRING, OFF(n), def, 0, 0, 0, 0, NULL, fl, help }
#define KWORD(n, def, maxlen, fl, help) \
    { #n, RF_CFG_STRING, OFF(n), def, 0, maxlen, 0, 0, NULL, (fl) | RF_CFG_WORD, help }
#define KADDR(n, def, lo, fl, help) \
    { #n, RF_CFG_HOSTPORT, OFF(n), def, lo, 65535, 0, 0, NULL, fl, help }
#define KINT(n, def, lo, hi, help) { #n, RF_CFG_INT, OFF(n), def, lo, hi, 0, 0, NULL, 0, help }
#define KBOOL(n, def, help) { #n, RF_CFG_BOOL, OFF(n), def, 0, 0, 0, 0, NULL, 0, help }
#define KENUM(n, def, names, help) \
    { #n, RF_CFG_ENUM, OFF(n), def, 0, 0, 0, 0, names, 0, help }

/* Keys common to both daemons, in help order. Defaults that depend on the role come from the
 * role's own lines below. */
#define COMMON_KEYS(sock, status)                                                              \
    KSTR(node, "", RF_CFG_EMPTY_OK,                                                            \
         "Name of this node in the cluster, unique among all daemons; empty means the host "   \
         "name."),                                                                             \
    KINT(publishers, "1", 1, 65536,                                                           \
         "Number of refit-publisherd daemons in the cluster, the coordinator included. The "   \
         "coordinator waits for all of them before planning."),                                \
    KINT(receivers, "1", 1, 65536,                                                            \
         "Number of refit-receiverd daemons in the cluster."),                                 \
    KINT(clients, "1", 1, 4096,                                                               \
         "Number of local clients (trainer ranks or engine workers) this daemon waits for "    \
         "before it reports its inventory."),                                                  \
    KINT(index, "0", 0, 65535,                                                                \
         "This daemon's index among the daemons of its role, 0 .. publishers-1 or "            \
         "receivers-1."),                                                                      \
    KSTR(socket, sock, 0, "Path of the local RPC socket for clients and refitctl (mode 0660)."), \
    { "socket_uids", RF_CFG_UIDS, OFF(socket_uids), "", 0, 0, 0, 0, NULL, 0,                   \
      "Users (names or uids, comma separated) allowed on the local socket besides the "       \
      "daemon's own user; checked with SO_PEERCRED." },                                        \
    KADDR(data_listen, "127.0.0.1:0", 0, 0,                                                    \
          "Address for data connections from peers (tcp transport, NCCL bootstrap); port 0 "   \
          "picks a free port. Use an address the other nodes can reach."),                    \
    KADDR(status_listen, status, 0, RF_CFG_EMPTY_OK,                                          \
          "HTTP address of /metrics (Prometheus) and /status (JSON); \"\" disables it."),      \
    KSTR(cluster_key_file, "/etc/refit/cluster.key", 0,                                        \
         "File with the cluster's shared secret, used to authenticate every control "         \
         "connection (HMAC-SHA256). Same content on every node, readable only by the daemon."), \
    KENUM(transport, "tcp", transport_names,                                                   \
          "How bytes move: nccl (GPU to GPU) or tcp (host memory over sockets; machines "      \
          "without GPUs, tests). Cluster-wide: the coordinator refuses a daemon with another " \
          "transport than its own."),                                                          \
    KINT(staging_mib, "256", 1, 65536,                                                         \
         "Staging budget per GPU and round, MiB: the most extra GPU memory a refit uses. The "  \
         "coordinator plans with the smallest budget of all daemons."),                        \
    KINT(direct_min_kib, "1024", 0, 1048576,                                                   \
         "Runs contiguous on both sides and at least this large (KiB) are sent directly "      \
         "between client buffers instead of through staging. Read by the coordinator, which "  \
         "plans; other daemons follow the plan."),                                             \
    KENUM(local_copy, "auto", local_copy_names,                                                \
          "Same-host refits: auto copies straight from the memory of trainers on this host "   \
          "into engine memory (no NCCL, no sockets), fetching the trainers' memory from the "  \
          "local publisherd's socket; off sends every byte over the transport."),             \
    KWORD(host_id, "", RF_DAEMON_HOST_ID_MAX, RF_CFG_EMPTY_OK,                               \
          "Identity of this machine for local_copy: daemons with the same host_id share "      \
          "memory. Empty means the kernel's boot id (else /etc/machine-id); set it when "     \
          "daemons that cannot share memory run on one kernel (separate IPC namespaces). One " \
          "word of printable ASCII."),                                                         \
    KENUM(relay, "off", relay_names,                                                           \
          "Relays (read by the coordinator): on lets engine replicas forward bytes they "      \
          "received earlier in a refit to other replicas, so trainers send each byte about "   \
          "once; off feeds every engine from the trainers. Other daemons accept the key and "  \
          "follow the plan they are given."),                                                  \
    KENUM(verify, "sample", verify_names,                                                      \
          "Digest check of transferred bytes before commit: off, sample (a sample of each "    \
          "transfer) or full. Cluster-wide: every daemon runs each refit with the "             \
          "coordinator's value, sent with its Start."),                                        \
    KINT(heartbeat_ms, "1000", 10, 60000,                                                      \
         "Interval of heartbeats on control connections, ms. A member's must be below the "    \
         "coordinator's peer_timeout_ms and the coordinator's below the member's, or the "     \
         "coordinator refuses the member."),                                                   \
    KINT(peer_timeout_ms, "10000", 100, 3600000,                                               \
         "A peer silent this long is declared dead, ms; must exceed heartbeat_ms."),          \
    KINT(refit_timeout_s, "600", 1, 86400,                                                     \
         "A refit not done by then is aborted and the committed version stays, seconds. "      \
         "Cluster-wide: every daemon runs each refit with the coordinator's value."),          \
    KENUM(log_level, "info", level_names, "Log level: error, warn, info or debug."),          \
    KINT(max_frame_mib, "64", 1, 2048,                                                         \
         "Largest control message accepted from another daemon (plan slices are the large "    \
         "ones), MiB. Local clients' requests have a fixed limit of 64 KiB.")

_Static_assert(RF_RPC_MAX_REQUEST == 64u << 10, "max_frame_mib's help names the RPC limit");

static const rf_cfg_key publisherd_keys[] = {
    KBOOL(coordinator, "false",
          "This publisherd is the coordinator: it listens on coordinator_addr and runs the "
          "cluster (membership, plan, quorum, commit). Exactly one daemon sets it."),
    KADDR(coordinator_addr, "127.0.0.1:7470", 0, 0,
          "Coordinator address: the coordinator listens on it, every other daemon connects "
          "to it."),
    KINT(busy_poll_ms, "1000", 0, 60000,
         "Coordinator: once the first daemon reported its data path done, poll the control "
         "connections without sleeping until the last one does, for at most this long (ms), "
         "so that the last Done is read at once instead of after the CPU wakes from idle. "
         "Costs up to one core for that time; 0 turns it off."),
    COMMON_KEYS("/run/refit/publisherd.sock", "127.0.0.1:9464"),
};

static const rf_cfg_key receiverd_keys[] = {
    KADDR(coordinator_addr, "127.0.0.1:7470", 1, 0,
          "Address of the coordinator (a refit-publisherd) to connect to."),
    COMMON_KEYS("/run/refit/receiverd.sock", "127.0.0.1:9465"),
};

static const char *const publisherd_sections[] = { "common", "publisherd", NULL };
static const char *const receiverd_sections[] = { "common", "receiverd", NULL };

static int finish(rf_daemon_cfg *c, rf_err *err)
{
    char host[256];
    int count = c->role == RF_DAEMON_PUBLISHER ? c->publishers : c->receivers;

    if (c->node == NULL || c->node[0] == '\0') {
        char *copy;

        if (gethostname(host, sizeof(host)) != 0 || host[0] == '\0')
            return rf_err_set(err, -EINVAL, "'node' is not set and the host name is unknown; "
                              "set node to a name unique in the cluster");
        host[sizeof(host) - 1] = '\0';
        copy = strdup(host);
        if (copy == NULL)
            return rf_err_set(err, -ENOMEM, "out of memory setting 'node'");
        free(c->node);
        c->node = copy;
    }
    if (c->index >= count)
        return rf_err_set(err, -EINVAL, "'index' is %d but there are %d %s (index counts from 0)",
                          c->index, count,
                          c->role == RF_DAEMON_PUBLISHER ? "publishers" : "receivers");
    if (c->peer_timeout_ms <= c->heartbeat_ms)
        return rf_err_set(err, -EINVAL,
                          "'peer_timeout_ms' (%d) must be larger than 'heartbeat_ms' (%d), or "
                          "every peer is declared dead between two heartbeats",
                          c->peer_timeout_ms, c->heartbeat_ms);
    /* Every daemon but the coordinator connects to coordinator_addr: it needs a host and the
     * coordinator's real port, not the listener's ":7470" or port 0. */
    if (!c->coordinator) {
        rf_addr a;

        if (rf_addr_parse(c->coordinator_addr, RF_ADDR_CONNECT, &a, err) < 0)
            return rf_err_wrap(err, "'coordinator_addr'%s: ",
                               c->role == RF_DAEMON_PUBLISHER
                                   ? " (connected to, as coordinator = false)" : "");
    }
    return 0;
}

/* An address the daemon will listen on must resolve to an address of this machine. Bound
 * with port 0, so a daemon already listening on the configured port (the one whose new config
 * is being checked) does not count against it. The port itself is taken only at start-up. */
static int check_listen(const char *key, const char *addr, const char *advice, rf_err *err)
{
    struct addrinfo *res = NULL, *ai;
    rf_addr a;
    rf_err why;
    int fd, rc = 0, e = 0;

    if (rf_addr_parse(addr, RF_ADDR_LISTEN, &a, err) < 0)
        return rf_err_wrap(err, "'%s': ", key);
    strcpy(a.port, "0");
    a.port_num = 0;
    rc = rf_addr_resolve(&a, RF_ADDR_LISTEN, &res, &why);
    if (rc < 0)
        return rf_err_set(err, rc, "'%s' %s: %s; %s", key, addr, why.msg, advice);
    for (ai = res; ai != NULL; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            close(fd);
            goto out;
        }
        e = errno;
        close(fd);
    }
    rc = rf_err_set(err, e == EADDRNOTAVAIL ? -EADDRNOTAVAIL : -e,
                    "'%s' %s: cannot listen on %s here: %s; %s", key, addr,
                    a.host[0] ? a.host : "any address", strerror(e), advice);
out:
    freeaddrinfo(res);
    return rc;
}

int rf_daemon_cfg_check(const rf_daemon_cfg *c, rf_peer_key *key, rf_err *err)
{
    int rc;

    rc = rf_peer_load_key(c->cluster_key_file, key, err);
    if (rc < 0)
        return rc;
    rc = rf_rpc_path_check(c->socket, err);
    if (rc < 0)
        goto fail;
    if (c->status_listen[0] != '\0') {
        rc = check_listen("status_listen", c->status_listen, "use an address of this machine, "
                          "or \"\" to disable the status endpoint", err);
        if (rc < 0)
            goto fail;
    }
    /* The data listener exists with the tcp transport; NCCL brings up its own. */
    if (c->transport == RF_TRANSPORT_TCP) {
        rc = check_listen("data_listen", c->data_listen, "use an address of this machine "
                          "that the other nodes can reach", err);
        if (rc < 0)
            goto fail;
    }
    if (c->role == RF_DAEMON_PUBLISHER && c->coordinator) {
        rc = check_listen("coordinator_addr", c->coordinator_addr, "the coordinator listens "
                          "on it: use an address of this machine", err);
        if (rc < 0)
            goto fail;
    }
    return 0;
fail:
    sodium_memzero(key, sizeof(*key));
    return rc;
}

/* --check-config: the same check as start-up; the key is read and forgotten. */
static int check(void *obj, rf_err *err)
{
    rf_peer_key key;
    int rc = rf_daemon_cfg_check(obj, &key, err);

    sodium_memzero(&key, sizeof(key));
    return rc;
}

static int finish_publisherd(void *obj, rf_err *err)
{
    rf_daemon_cfg *c = obj;

    c->role = RF_DAEMON_PUBLISHER;
    return finish(c, err);
}

static int finish_receiverd(void *obj, rf_err *err)
{
    rf_daemon_cfg *c = obj;

    c->role = RF_DAEMON_RECEIVER;
    return finish(c, err);
}

const rf_cfg_table rf_daemon_cfg_publisherd = {
    .program = "refit-publisherd",
    .version = RF_VERSION,
    .default_config = "/etc/refit/publisherd.conf",
    .sections = publisherd_sections,
    .keys = publisherd_keys,
    .nkeys = sizeof(publisherd_keys) / sizeof(publisherd_keys[0]),
    .finish = finish_publisherd,
    .check = check,
};

const rf_cfg_table rf_daemon_cfg_receiverd = {
    .program = "refit-receiverd",
    .version = RF_VERSION,
    .default_config = "/etc/refit/receiverd.conf",
    .sections = receiverd_sections,
    .keys = receiverd_keys,
    .nkeys = sizeof(receiverd_keys) / sizeof(receiverd_keys[0]),
    .finish = finish_receiverd,
    .check = check,
};

static const rf_cfg_table *table_of(int role)
{
    return role == RF_DAEMON_RECEIVER ? &rf_daemon_cfg_receiverd : &rf_daemon_cfg_publisherd;
}

int rf_daemon_cfg_load(rf_daemon_cfg *c, int role, int argc, char **argv, rf_cfg_next *next,
                       rf_err *err)
{
    const rf_cfg_table *t = table_of(role);
    const char *path = t->default_config;
    int rc;

    memset(c, 0, sizeof(*c));
    c->role = role;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            path = argv[i + 1];
        else if (strncmp(argv[i], "--config=", 9) == 0)
            path = argv[i] + 9;
    }
    c->config_path = strdup(path);
    if (c->config_path == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory loading the configuration");
    rc = rf_cfg_load(t, c, argc, argv, next, err);
    c->role = role;
    return rc;
}

void rf_daemon_cfg_free(rf_daemon_cfg *c)
{
    rf_cfg_free(table_of(c->role), c);
    free(c->config_path);
    c->config_path = NULL;
}

const char *rf_transport_name(int transport)
{
    return transport == RF_TRANSPORT_NCCL ? "nccl" : "tcp";
}

const char *rf_verify_name(int verify)
{
    return verify >= RF_VERIFY_OFF && verify <= RF_VERIFY_FULL ? verify_names[verify] : "?";
}

/* The first line of path, trimmed, appended to out. */
static int read_id(const char *path, char *out, size_t len)
{
    char line[128];
    size_t n, used = strlen(out);
    FILE *f = fopen(path, "r");

    if (!f)
        return -errno;
    if (!fgets(line, sizeof(line), f)) {
        fclose(f);
        return -EIO;
    }
    fclose(f);
    n = strcspn(line, " \t\r\n");
    line[n] = '\0';
    if (n == 0)
        return -EIO;
    snprintf(out + used, len - used, "%s%s", used ? "/" : "", line);
    return 0;
}

int rf_daemon_host_id(const rf_daemon_cfg *c, char *out, size_t len, rf_err *err)
{
    int rc;

    out[0] = '\0';
    if (c->host_id && c->host_id[0]) {
        snprintf(out, len, "%s", c->host_id);
        return 0;
    }
    /* The running kernel: containers of one machine share it (and may not share a
     * machine-id, or have an empty one); a reboot is another host, nothing mapped survives. */
    if ((rc = read_id("/proc/sys/kernel/random/boot_id", out, len)) == 0)
        return 0;
    if ((rc = read_id("/etc/machine-id", out, len)) == 0)
        return 0;
    return rf_err_set(err, rc, "local_copy = auto needs this machine's identity, but neither "
                      "/proc/sys/kernel/random/boot_id nor /etc/machine-id can be read (%s); "
                      "set host_id, or local_copy = off", strerror(-rc));
}
