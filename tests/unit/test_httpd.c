/* tests/unit/test_httpd.c - the status server over real HTTP on 127.0.0.1 (port 0), with a
 * plain socket client: /metrics, /status, 404, 405, 500, HEAD, bind errors, clean stop, and
 * which connection gives way when too many wait for a request. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "httpd.h"
#include "log.h"
#include "metrics.h"

typedef struct resp {
    int code;
    char head[4096];
    char *body;
} resp;

static int connect_port(int port)
{
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    cr_assert_geq(fd, 0);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        int e = errno;

        close(fd);
        return -e;
    }
    return fd;
}

/* One HTTP/1.0 request; the server closes the connection after the response. */
static resp request(int port, const char *method, const char *path)
{
    resp r = { 0 };
    char req[512], *all = NULL, *sep;
    size_t len = 0, cap = 0;
    int fd = connect_port(port);

    cr_assert_geq(fd, 0, "connect: %s", strerror(-fd));
    snprintf(req, sizeof(req), "%s %s HTTP/1.0\r\nHost: localhost\r\n\r\n", method, path);
    cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    for (;;) {
        ssize_t n;

        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            all = realloc(all, cap);
            cr_assert_not_null(all);
        }
        n = read(fd, all + len, cap - len - 1);
        cr_assert_geq(n, 0);
        if (n == 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    all[len] = '\0';
    cr_assert_eq(sscanf(all, "HTTP/1.%*d %d", &r.code), 1, "bad response: %s", all);
    sep = strstr(all, "\r\n\r\n");
    cr_assert_not_null(sep);
    snprintf(r.head, sizeof(r.head), "%.*s", (int)(sep + 2 - all), all);
    r.body = strdup(sep + 4);
    free(all);
    return r;
}

static int has_header(const resp *r, const char *line)
{
    char want[512];

    snprintf(want, sizeof(want), "\r\n%s\r\n", line);
    return strcasestr(r->head, want) != NULL;
}

static int status_calls;

static char *status_json(void *arg)
{
    json_t *o = json_pack("{s:s, s:i, s:[s,s]}", "node", (const char *)arg, "committed_version",
                          17, "peers", "a", "b");
    char *s = json_dumps(o, JSON_COMPACT);

    status_calls++;
    json_decref(o);
    return s;
}

static char *status_fails(void *arg)
{
    (void)arg;
    return NULL;
}

static rf_metrics *m;
static rf_httpd *h;

static void setup(void)
{
    rf_metric *c;
    rf_err err;

    m = rf_metrics_new();
    cr_assert_not_null(m);
    cr_assert_eq(rf_metrics_counter(m, &c, "refit_refits_total", "Refits.", "result"), 0);
    cr_assert_eq(rf_metric_add(c, 3, "ok"), 0);
    cr_assert_eq(rf_httpd_start(&h, "127.0.0.1:0", m, status_json, "gpu-7", &err), 0, "%s",
                 err.msg);
    cr_assert_gt(rf_httpd_port(h), 0);
}

static void teardown(void)
{
    rf_httpd_stop(h);
    rf_metrics_free(m);
}

TestSuite(httpd, .init = setup, .fini = teardown);

Test(httpd, metrics_in_prometheus_text_format)
{
    resp r = request(rf_httpd_port(h), "GET", "/metrics");
    char *want = NULL;

    cr_assert_eq(r.code, 200);
    cr_assert(has_header(&r, "Content-Type: text/plain; version=0.0.4; charset=utf-8"), "%s",
              r.head);
    cr_assert_eq(rf_metrics_render(m, &want, NULL), 0);
    cr_assert_str_eq(r.body, want);
    cr_assert_not_null(strstr(r.body, "refit_refits_total{result=\"ok\"} 3\n"));
    free(want);
    free(r.body);
}

Test(httpd, status_is_the_callbacks_json)
{
    resp r = request(rf_httpd_port(h), "GET", "/status?pretty=1");
    json_error_t jerr;
    json_t *o;

    cr_assert_eq(r.code, 200);
    cr_assert(has_header(&r, "Content-Type: application/json"), "%s", r.head);
    o = json_loads(r.body, 0, &jerr);
    cr_assert_not_null(o, "%s: %s", jerr.text, r.body);
    cr_assert_str_eq(json_string_value(json_object_get(o, "node")), "gpu-7");
    cr_assert_eq(json_integer_value(json_object_get(o, "committed_version")), 17);
    cr_assert_eq(json_array_size(json_object_get(o, "peers")), 2);
    json_decref(o);
    free(r.body);
}

Test(httpd, unknown_paths_methods_and_head)
{
    resp r = request(rf_httpd_port(h), "GET", "/nope");

    cr_assert_eq(r.code, 404);
    cr_assert_not_null(strstr(r.body, "/nope"));
    free(r.body);

    r = request(rf_httpd_port(h), "GET", "/");
    cr_assert_eq(r.code, 404);
    free(r.body);

    r = request(rf_httpd_port(h), "DELETE", "/metrics");
    cr_assert_eq(r.code, 405);
    cr_assert(has_header(&r, "Allow: GET, HEAD"), "%s", r.head);
    free(r.body);

    r = request(rf_httpd_port(h), "HEAD", "/metrics");
    cr_assert_eq(r.code, 200);
    cr_assert_str_eq(r.body, "");
    free(r.body);
}

Test(httpd, post_with_a_body_is_refused)
{
    const char *req = "POST /status HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello";
    char buf[4096];
    ssize_t n, len = 0;
    int fd = connect_port(rf_httpd_port(h)), code = 0;

    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    while ((n = read(fd, buf + len, sizeof(buf) - 1 - (size_t)len)) > 0)
        len += n;
    buf[len] = '\0';
    close(fd);
    cr_assert_eq(sscanf(buf, "HTTP/1.%*d %d", &code), 1, "%s", buf);
    cr_assert_eq(code, 405);
}

Test(httpd, status_failure_is_500_and_missing_sources_404)
{
    rf_httpd *h2 = NULL;
    rf_err err;
    resp r;

    cr_assert_eq(rf_httpd_start(&h2, "127.0.0.1:0", NULL, status_fails, NULL, &err), 0, "%s",
                 err.msg);
    r = request(rf_httpd_port(h2), "GET", "/status");
    cr_assert_eq(r.code, 500);
    free(r.body);
    r = request(rf_httpd_port(h2), "GET", "/metrics");
    cr_assert_eq(r.code, 404);
    free(r.body);
    rf_httpd_stop(h2);

    cr_assert_eq(rf_httpd_start(&h2, "localhost:0", m, NULL, NULL, &err), 0, "%s", err.msg);
    r = request(rf_httpd_port(h2), "GET", "/status");
    cr_assert_eq(r.code, 404);
    free(r.body);
    rf_httpd_stop(h2);
}

Test(httpd, bind_errors_name_the_address)
{
    rf_httpd *h2 = NULL;
    rf_err err;
    char addr[64];

    snprintf(addr, sizeof(addr), "127.0.0.1:%d", rf_httpd_port(h));
    cr_assert_eq(rf_httpd_start(&h2, addr, m, NULL, NULL, &err), -EADDRINUSE);
    cr_assert_null(h2);
    cr_assert_not_null(strstr(err.msg, addr), "%s", err.msg);
    cr_assert_not_null(strstr(err.msg, "status_listen"), "%s", err.msg);

    cr_assert_eq(rf_httpd_start(&h2, "127.0.0.1", m, NULL, NULL, &err), -EINVAL);
    cr_assert_str_eq(err.msg, "status_listen: address '127.0.0.1' has no port; write "
                     "127.0.0.1:PORT");
    cr_assert_eq(rf_httpd_start(&h2, "127.0.0.1:99999", m, NULL, NULL, &err), -EINVAL);
    cr_assert_not_null(strstr(err.msg, "port '99999' is not a number in 0..65535"), "%s",
                       err.msg);
    cr_assert_eq(rf_httpd_start(&h2, "nosuch.invalid:0", m, NULL, NULL, &err), -EADDRNOTAVAIL);
    cr_assert(strstr(err.msg, "status listen address 'nosuch.invalid:0': cannot resolve "
                     "'nosuch.invalid': ") == err.msg, "%s", err.msg);
    /* All interfaces, in both of its forms. */
    cr_assert_eq(rf_httpd_start(&h2, ":0", m, NULL, NULL, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_httpd_port(h2), 0);
    rf_httpd_stop(h2);
    h2 = NULL;
    cr_assert_eq(rf_httpd_start(&h2, "*:0", m, NULL, NULL, &err), 0, "%s", err.msg);
    rf_httpd_stop(h2);
    h2 = NULL;
    /* An address of no local interface. */
    cr_assert_eq(rf_httpd_start(&h2, "192.0.2.1:0", m, NULL, NULL, &err), -EADDRNOTAVAIL, "%s",
                 err.msg);
    cr_assert_null(h2);
}

Test(httpd, many_scrapes_then_clean_stop_closes_the_port)
{
    int port = rf_httpd_port(h), fd;

    for (int i = 0; i < 50; i++) {
        resp r = request(port, "GET", i % 2 ? "/metrics" : "/status");

        cr_assert_eq(r.code, 200);
        free(r.body);
    }
    cr_assert_eq(status_calls, 25);
    rf_httpd_stop(h);
    h = NULL;
    fd = connect_port(port);
    cr_assert_eq(fd, -ECONNREFUSED);
    rf_httpd_stop(NULL);
}

/* ---- connections that wait for a request, and which one gives way ---- */

/* A server whose table of waiting connections is small: at most 64 connections (a quarter of
 * 256 descriptors), 32 of them waiting for a request. The limit is the worker's own. */
static rf_httpd *start_small(rf_httpd_status_fn status)
{
    struct rlimit rl;
    rf_httpd *s = NULL;
    rf_err err;

    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    rl.rlim_cur = 256;
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &rl), 0, "%s", strerror(errno));
    cr_assert_eq(rf_httpd_start(&s, "127.0.0.1:0", m, status, "small", &err), 0, "%s",
                 err.msg);
    return s;
}

/* A connection from src, a loopback address. */
static int connect_from(int port, const char *src)
{
    struct sockaddr_in sa = { .sin_family = AF_INET };
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    cr_assert_geq(fd, 0);
    cr_assert_eq(inet_pton(AF_INET, src, &sa.sin_addr), 1);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind %s: %s", src,
                 strerror(errno));
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "%s", strerror(errno));
    return fd;
}

/* A request line and a header, and never the end of the headers. The connections are
 * accepted in the order they are made (each is in the listen queue when connect returns). */
static int half_open(int port, const char *src)
{
    static const char half[] = "GET /status HTTP/1.1\r\nHost: refit\r\n";
    int fd = connect_from(port, src);

    cr_assert_eq(write(fd, half, strlen(half)), (ssize_t)strlen(half));
    return fd;
}

/* Whether the server closed fd (end of stream or reset) within ms; reads nothing. */
static int closed_within(int fd, int ms)
{
    struct pollfd p = { .fd = fd, .events = POLLIN | POLLRDHUP };
    char c;
    ssize_t n;

    if (poll(&p, 1, ms) <= 0)
        return 0;
    n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* GET path on fd (HTTP/1.1, kept open): the status code, and the body length in *len. */
static int get_on(int fd, const char *path, size_t *len)
{
    char req[256], head[8192];
    size_t have = 0, body = 0;
    char *end = NULL, *cl;
    int code = 0;

    snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: refit\r\n\r\n", path);
    cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    while (end == NULL) {
        ssize_t n = read(fd, head + have, sizeof(head) - 1 - have);

        cr_assert_gt(n, 0, "the connection ended before the response's headers");
        have += (size_t)n;
        head[have] = '\0';
        end = strstr(head, "\r\n\r\n");
    }
    cr_assert_eq(sscanf(head, "HTTP/1.1 %d", &code), 1, "%s", head);
    cl = strcasestr(head, "\r\nContent-Length: ");
    cr_assert_not_null(cl, "%s", head);
    body = strtoul(cl + 18, NULL, 10);
    for (size_t got = have - (size_t)(end + 4 - head); got < body;) {
        static char sink[65536];
        ssize_t n = read(fd, sink, body - got < sizeof(sink) ? body - got : sizeof(sink));

        cr_assert_gt(n, 0, "the connection ended after %zu of %zu bytes of the body", got, body);
        got += (size_t)n;
    }
    *len = body;
    return code;
}

static int get_from(int port, const char *src)
{
    int fd = connect_from(port, src), code;
    size_t len;

    code = get_on(fd, "/status", &len);
    close(fd);
    return code;
}

/* When 32 connections wait for a request and one more comes, the oldest waiting connection of
 * the address that holds the most of them is closed: not an older one from an address that
 * holds fewer, and a GET from the crowded address itself is answered, while that address
 * opens more connections than the server holds in all. */
Test(httpd, waiting_connections_give_way_oldest_of_the_largest_address)
{
    FILE *log = tmpfile();
    rf_httpd *s = start_small(status_json);
    int port = rf_httpd_port(s), lone, newcomer, crowd[31 + 60];
    char text[8192];
    size_t n;

    cr_assert_not_null(log);
    rf_log_set_fd(fileno(log));
    lone = half_open(port, "127.0.0.3");
    for (int i = 0; i < 31; i++)
        crowd[i] = half_open(port, "127.0.0.2");
    cr_assert_not(closed_within(crowd[0], 200), "closed while the table had room");
    newcomer = half_open(port, "127.0.0.4");
    cr_assert(closed_within(crowd[0], 2000), "the oldest connection of 127.0.0.2 was not "
              "closed for a new one");
    close(crowd[0]);
    cr_assert_not(closed_within(lone, 0), "the lone connection of 127.0.0.3 was closed, "
                  "though 127.0.0.2 held more");
    cr_assert_eq(get_from(port, "127.0.0.2"), 200);
    cr_assert(closed_within(crowd[1], 2000));
    close(crowd[1]);
    /* The answered GET left the table: the next connection takes its place. */
    crowd[31] = half_open(port, "127.0.0.2");
    cr_assert_not(closed_within(crowd[2], 200), "closed while the table had room");
    for (int i = 32; i < 31 + 60; i++) {
        crowd[i] = half_open(port, "127.0.0.2");
        cr_assert(closed_within(crowd[i - 30], 2000), "connection %d of 127.0.0.2 was not "
                  "closed for connection %d", i - 30, i);
        close(crowd[i - 30]);
    }
    cr_assert_eq(get_from(port, "127.0.0.2"), 200);
    cr_assert_not(closed_within(lone, 0));
    cr_assert_not(closed_within(newcomer, 0));
    cr_assert_not(closed_within(crowd[31 + 60 - 1], 0));
    rf_httpd_stop(s);
    /* One warning per 10 s however many go, naming who gave way to whom and why. */
    rf_log_set_fd(2);
    rewind(log);
    n = fread(text, 1, sizeof(text) - 1, log);
    text[n] = '\0';
    fclose(log);
    cr_assert(strstr(text, "status http: closed the oldest connection from 127.0.0.2 that had "
                     "no request being answered, for a new one from 127.0.0.4: 32 connections "
                     "were waiting for a request (the limit), 31 of them from 127.0.0.2, which "
                     "no address exceeded"), "%s", text);
    cr_assert_null(strstr(strstr(text, "status http") + 1, "status http"), "%s", text);
    for (int i = 31 + 60 - 30; i < 31 + 60; i++)
        close(crowd[i]);
    close(lone);
    close(newcomer);
}

/* A connection waits for a request only once: the server closes it after its response (it
 * answers as soon as the headers are in, and libmicrohttpd closes such a connection), so no
 * connection kept open between requests escapes the table. Should that change, the table must
 * take such connections back. */
Test(httpd, answered_connection_is_closed)
{
    rf_httpd *s = start_small(status_json);
    int kept = connect_from(rf_httpd_port(s), "127.0.0.5");
    size_t len;

    cr_assert_eq(get_on(kept, "/status", &len), 200);
    cr_assert(closed_within(kept, 2000), "the connection was kept open after its response");
    rf_httpd_stop(s);
    close(kept);
}

/* 4 MiB of JSON: more than the socket takes before the client reads. */
static char *status_big(void *arg)
{
    size_t n = 4u << 20;
    char *s = malloc(n + 1);

    (void)arg;
    cr_assert_not_null(s);
    memset(s, ' ', n);
    memcpy(s, "{\"pad\":\"", 8);
    memset(s + 8, 'x', n - 10);
    memcpy(s + n - 2, "\"}", 2);
    s[n] = '\0';
    return s;
}

/* A connection whose request is being answered (the client reads its response slowly) is not
 * one that waits: the crowd of its address pushes out only connections without a request. */
Test(httpd, connection_being_answered_never_gives_way)
{
    rf_httpd *s = start_small(status_big);
    int port = rf_httpd_port(s), busy, w[40];
    static const char req[] = "GET /status HTTP/1.1\r\nHost: refit\r\n\r\n";

    busy = connect_from(port, "127.0.0.7");
    cr_assert_eq(write(busy, req, strlen(req)), (ssize_t)strlen(req));
    /* The response has begun: its first bytes are here, the rest waits for our reads. */
    cr_assert_eq(closed_within(busy, 2000), 0);
    for (int i = 0; i < 40; i++)
        w[i] = half_open(port, "127.0.0.7");
    cr_assert(closed_within(w[7], 2000), "40 waiting connections in a table of 32");
    {
        /* The rest of the response, whole. */
        char head[256];
        ssize_t n = read(busy, head, sizeof(head) - 1);

        cr_assert_gt(n, 12);
        head[n] = '\0';
        cr_assert(strncmp(head, "HTTP/1.1 200", 12) == 0, "%s", head);
        for (size_t got = (size_t)n; got < (4u << 20);) {
            static char sink[65536];

            n = read(busy, sink, sizeof(sink));
            cr_assert_gt(n, 0, "the response ended after %zu bytes", got);
            got += (size_t)n;
        }
    }
    rf_httpd_stop(s);
    for (int i = 0; i < 40; i++)
        close(w[i]);
    close(busy);
}
