/* common/service/httpd.c - libmicrohttpd with its internal polling thread on a socket we bind
 * ourselves, so that bind errors reach the operator with their errno. */
#include "httpd.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "addr.h"
#include "admit.h"
#include "log.h"
#include "macros.h"

#define METRICS_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* Slow or half-open clients (a request line and never the end of its headers) must not keep
 * /status from a person or a scraper, wherever they connect from. Every client we serve sends
 * its request at once, so a connection idle for HTTPD_TIMEOUT_S is dropped, and the server
 * holds up to HTTPD_MAX_CONNS connections (a quarter of the descriptors the process may open,
 * at most). All but HTTPD_BUSY_RESERVE of them may be waiting for their request; when that
 * many wait, a new connection is not refused (whoever holds them, from the person's own
 * address say, would keep everyone out) but the oldest waiting connection of the address
 * holding the most of them is closed (shut down; libmicrohttpd then sees its end). A client
 * that sends its request as it connects leaves the table one round trip later, so it is never
 * the oldest for long, and one address cannot push out another's while it holds more. A limit
 * per address below the table's would lock the person on that address out instead. */
#define HTTPD_TIMEOUT_S 5u
#define HTTPD_MAX_CONNS 1024u
#define HTTPD_MIN_CONNS 64u
#define HTTPD_BUSY_RESERVE 32u
#define HTTPD_BACKLOG 256u
#define HTTPD_WARN_EVERY_S 10
_Static_assert(HTTPD_MIN_CONNS > HTTPD_BUSY_RESERVE, "the table of waiting connections has room");

/* One connection, from libmicrohttpd's notice of its start to that of its end; in the table
 * while no request of it is being answered. */
struct hconn {
    rf_admit_entry adm;
    struct MHD_Connection *c;
    struct hconn *next_free;
};

struct rf_httpd {
    struct MHD_Daemon *d;
    rf_metrics *metrics;
    rf_httpd_status_fn status;
    void *status_arg;
    int port;
    unsigned max_conns;
    pthread_mutex_t log_mu; /* warn_limited's rate limit */
    time_t log_window;
    unsigned log_held;
    /* Touched only on libmicrohttpd's one thread. */
    rf_admit waiting;       /* connections without a request being answered */
    rf_admit_src *srcs;     /* the table's sources */
    struct hconn *conns;    /* max_conns records: libmicrohttpd holds no more connections */
    struct hconn *free_conns;
};

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned code, const char *type,
                             char *body, size_t len, enum MHD_ResponseMemoryMode mode)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
    enum MHD_Result ret;

    if (r == NULL) {
        if (mode == MHD_RESPMEM_MUST_FREE)
            free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (code == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    ret = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned code, const char *fmt,
                                  ...) __attribute__((format(printf, 3, 4)));

static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned code, const char *fmt,
                                  ...)
{
    char *body = NULL;
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vasprintf(&body, fmt, ap);
    va_end(ap);
    if (n < 0)
        return MHD_NO;
    return reply(conn, code, "text/plain; charset=utf-8", body, (size_t)n,
                 MHD_RESPMEM_MUST_FREE);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_size, void **req_cls)
{
    rf_httpd *h = cls;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);

    (void)version;
    (void)upload_data;
    (void)req_cls;
    /* A request is being answered: the connection is no longer one that waits. */
    if (ci != NULL && ci->socket_context != NULL)
        rf_admit_remove(&h->waiting, &((struct hconn *)ci->socket_context)->adm);
    if (*upload_size != 0) {
        /* Nothing here accepts a body; drop it and answer once it has been read. */
        *upload_size = 0;
        return MHD_YES;
    }
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return reply_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method %s not allowed\n", method);

    if (strcmp(url, "/metrics") == 0 && h->metrics != NULL) {
        char *text = NULL;
        size_t len = 0;

        if (rf_metrics_render(h->metrics, &text, &len) != 0)
            return reply_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
        return reply(conn, MHD_HTTP_OK, METRICS_TYPE, text, len, MHD_RESPMEM_MUST_FREE);
    }
    if (strcmp(url, "/status") == 0 && h->status != NULL) {
        char *json = h->status(h->status_arg);

        if (json == NULL)
            return reply_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR,
                              "status is not available, see the daemon's log\n");
        return reply(conn, MHD_HTTP_OK, "application/json", json, strlen(json),
                     MHD_RESPMEM_MUST_FREE);
    }
    return reply_text(conn, MHD_HTTP_NOT_FOUND, "no such page: %s (try /metrics or /status)\n",
                      url);
}

/* Warnings about clients that hold connections come per connection: one line per
 * HTTPD_WARN_EVERY_S is logged. True when this one may be, with *held the count held back
 * since the last. Runs on libmicrohttpd's thread (and on ours while it starts). */
static bool warn_turn(rf_httpd *h, unsigned *held)
{
    time_t now = time(NULL);
    bool say = false;

    pthread_mutex_lock(&h->log_mu);
    if (now - h->log_window >= HTTPD_WARN_EVERY_S) {
        h->log_window = now;
        *held = h->log_held;
        h->log_held = 0;
        say = true;
    } else {
        h->log_held++;
    }
    pthread_mutex_unlock(&h->log_mu);
    if (say && *held > 0)
        RF_WARN("status http: %u more warnings like the next were held back", *held);
    return say;
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    rf_httpd *h = cls;
    char msg[512];
    unsigned held;
    size_t n;

    vsnprintf(msg, sizeof(msg), fmt, ap);
    n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n')
        msg[--n] = '\0';
    if (!warn_turn(h, &held))
        return;
    if (strstr(msg, "connection limit") != NULL)
        RF_WARN("status http: %s (limits: %u connections, %u of them waiting for a request; "
                "idle ones are closed after %u s)", msg, h->max_conns, h->waiting.cap,
                HTTPD_TIMEOUT_S);
    else
        RF_WARN("status http: %s", msg);
}

static const struct sockaddr *conn_addr(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *i =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);

    return i != NULL ? i->client_addr : NULL;
}

static void addr_name(const struct sockaddr *sa, char *buf, size_t len)
{
    char ip[INET6_ADDRSTRLEN] = "an unknown address";

    if (sa != NULL && sa->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, ip, sizeof(ip));
    else if (sa != NULL && sa->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, ip, sizeof(ip));
    snprintf(buf, len, "%s", ip);
}

/* hc just connected and waits for its request: it becomes the newest entry of the table, and
 * when the table is full the oldest connection of the address holding the most entries is
 * shut down first. A connection waits only once: the handler answers a request as soon as its
 * headers are in, and libmicrohttpd closes a connection whose response came that early
 * (Connection: close), so no connection is kept open to wait for a second request. */
static void wait_for_request(rf_httpd *h, struct hconn *hc)
{
    rf_admit_entry *v = rf_admit_victim(&h->waiting);

    if (v != NULL) {
        struct hconn *vc = container_of(v, struct hconn, adm);
        const union MHD_ConnectionInfo *fd =
            MHD_get_connection_info(vc->c, MHD_CONNECTION_INFO_CONNECTION_FD);
        char who[INET6_ADDRSTRLEN + 32], to[INET6_ADDRSTRLEN + 32];
        unsigned n = rf_admit_src_count(v), held;

        rf_admit_remove(&h->waiting, v);
        /* libmicrohttpd owns the descriptor and closes it once it reads the end; a failure
         * here means the connection is already ending. */
        if (fd != NULL)
            shutdown(fd->connect_fd, SHUT_RDWR);
        if (warn_turn(h, &held)) {
            addr_name(conn_addr(vc->c), who, sizeof(who));
            addr_name(conn_addr(hc->c), to, sizeof(to));
            RF_WARN("status http: closed the oldest connection from %s that had no request "
                    "being answered, for a new one from %s: %u connections were waiting for "
                    "a request (the limit), %u of them from %s, which no address exceeded "
                    "(clients that connect and do not send their request?)", who, to,
                    h->waiting.cap, n, who);
        }
    }
    rf_admit_add(&h->waiting, &hc->adm, conn_addr(hc->c));
}

static void on_connection(void *cls, struct MHD_Connection *c, void **ctx,
                          enum MHD_ConnectionNotificationCode what)
{
    rf_httpd *h = cls;
    struct hconn *hc = *ctx;

    if (what == MHD_CONNECTION_NOTIFY_STARTED) {
        /* libmicrohttpd holds at most max_conns connections, one record each; a connection
         * without one would only be bounded by the idle timeout. */
        hc = h->free_conns;
        if (hc == NULL)
            return;
        h->free_conns = hc->next_free;
        hc->c = c;
        *ctx = hc;
        wait_for_request(h, hc);
        return;
    }
    if (hc == NULL)
        return;
    rf_admit_remove(&h->waiting, &hc->adm);
    hc->c = NULL;
    hc->next_free = h->free_conns;
    h->free_conns = hc;
    *ctx = NULL;
}

/* The connection limit: HTTPD_MAX_CONNS, or a quarter of RLIMIT_NOFILE when that is lower,
 * so that a flood of HTTP clients cannot take the descriptors the daemon's own clients,
 * peers and memory need. */
static unsigned conn_limit(void)
{
    struct rlimit rl;
    rlim_t quarter;

    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return HTTPD_MAX_CONNS;
    quarter = rl.rlim_cur / 4;
    if (quarter < HTTPD_MIN_CONNS)
        return HTTPD_MIN_CONNS;
    return quarter < HTTPD_MAX_CONNS ? (unsigned)quarter : HTTPD_MAX_CONNS;
}

/* Binds and listens on addr; 0 with the socket and its port, or a negative errno with err filled. */
static int listen_on(const char *addr, int *fd_out, int *port_out, int *ipv6, rf_err *err)
{
    struct addrinfo *res = NULL;
    struct sockaddr_storage ss;
    socklen_t sslen = sizeof(ss);
    rf_addr a;
    int fd = -1, one = 1, rc = 0;

    if (rf_addr_parse(addr, RF_ADDR_LISTEN, &a, err) < 0)
        return rf_err_wrap(err, "status_listen: ");
    rc = rf_addr_resolve(&a, RF_ADDR_LISTEN, &res, err);
    if (rc < 0) {
        rf_err_wrap(err, "status listen address '%s': ", addr);
        goto out;
    }
    fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                res->ai_protocol);
    if (fd < 0) {
        rc = rf_err_set(err, -errno, "cannot create a socket for %s: %s", addr, strerror(errno));
        goto out;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, (int)HTTPD_BACKLOG) != 0 ||
        getsockname(fd, (struct sockaddr *)&ss, &sslen) != 0) {
        rc = rf_err_set(err, -errno,
                        "cannot listen on %s for status HTTP: %s; choose another "
                        "status_listen address or set it to \"\" to disable the endpoint",
                        addr, strerror(errno));
        goto out;
    }
    *ipv6 = ss.ss_family == AF_INET6;
    *port_out = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
    *fd_out = fd;
    fd = -1;
out:
    if (fd >= 0)
        close(fd);
    if (res)
        freeaddrinfo(res);
    return rc;
}

int rf_httpd_start(rf_httpd **out, const char *listen_addr, rf_metrics *metrics,
                   rf_httpd_status_fn status, void *status_arg, rf_err *err)
{
    rf_httpd *h = NULL;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG |
                     MHD_USE_AUTO;
    unsigned max = conn_limit();
    int fd = -1, ipv6 = 0, rc;

    /* One allocation: h, a record per connection, a source per place in the table. */
    h = calloc(1, sizeof(*h) + max * sizeof(struct hconn) + max * sizeof(rf_admit_src));
    if (h == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory starting the status server");
    h->metrics = metrics;
    h->status = status;
    h->status_arg = status_arg;
    h->max_conns = max;
    h->conns = (struct hconn *)(h + 1);
    h->srcs = (rf_admit_src *)(h->conns + max);
    for (unsigned i = max; i-- > 0;) {
        h->conns[i].next_free = h->free_conns;
        h->free_conns = &h->conns[i];
    }
    rf_admit_init(&h->waiting, h->srcs, max - HTTPD_BUSY_RESERVE);
    pthread_mutex_init(&h->log_mu, NULL);
    rc = listen_on(listen_addr, &fd, &h->port, &ipv6, err);
    if (rc != 0)
        goto out;
    if (ipv6)
        flags |= MHD_USE_IPv6;
    /* MHD takes the listening socket and closes it in MHD_stop_daemon. Whether a failed start
     * closes it is not documented, so we give it up either way: a leaked socket in a start-up
     * that fails anyway beats closing a descriptor number another thread may reuse. */
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, handle, h,
                            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, h,
                            MHD_OPTION_LISTEN_SOCKET, fd,
                            MHD_OPTION_CONNECTION_LIMIT, h->max_conns,
                            MHD_OPTION_CONNECTION_TIMEOUT, HTTPD_TIMEOUT_S,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
                            MHD_OPTION_END);
    fd = -1;
    if (h->d == NULL) {
        rc = rf_err_set(err, -EIO, "libmicrohttpd could not start the status server on %s "
                        "(see the warnings above)", listen_addr);
        goto out;
    }
    *out = h;
    h = NULL;
out:
    if (fd >= 0)
        close(fd);
    if (h != NULL)
        pthread_mutex_destroy(&h->log_mu);
    free(h);
    return rc;
}

int rf_httpd_port(const rf_httpd *h)
{
    return h->port;
}

void rf_httpd_stop(rf_httpd *h)
{
    if (h == NULL)
        return;
    MHD_stop_daemon(h->d);
    pthread_mutex_destroy(&h->log_mu);
    free(h);
}
