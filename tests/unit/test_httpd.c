/* tests/unit/test_httpd.c - the status server over real HTTP on 127.0.0.1 (port 0), with a
 * plain socket client: /metrics, /status, 404, 405, 500, HEAD, bind errors, clean stop. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "httpd.h"
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
