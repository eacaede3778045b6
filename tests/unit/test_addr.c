/* tests/unit/test_addr.c - the one address grammar: each form accepted and refused, to listen
 * and to connect, with the message a person gets; resolving and binding real sockets. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "addr.h"

#define L RF_ADDR_LISTEN
#define C RF_ADDR_CONNECT

/* Fixed arrays rather than pointers: Criterion runs each parameter in a fresh process and
 * only the parameter array itself is copied into its shared arena. */
struct addr_case {
    char in[320];
    rf_addr_use use;
    int rc;
    char host[260];  /* when accepted */
    int port;
    char msg[160];   /* when refused: a part of the message */
};

static const struct addr_case cases[] = {
    /* Accepted by both. */
    { "127.0.0.1:7470", L, 0, "127.0.0.1", 7470, "" },
    { "127.0.0.1:7470", C, 0, "127.0.0.1", 7470, "" },
    { "[::1]:7470", L, 0, "::1", 7470, "" },
    { "[::1]:7470", C, 0, "::1", 7470, "" },
    { "[fe80::1%eth0]:1", C, 0, "fe80::1%eth0", 1, "" },
    { "node-3.cluster:65535", C, 0, "node-3.cluster", 65535, "" },
    { "h:007470", C, 0, "h", 7470, "" },
    /* Listening only: all interfaces, port 0. */
    { ":0", L, 0, "", 0, "" },
    { ":7470", L, 0, "", 7470, "" },
    { "*:7470", L, 0, "", 7470, "" },
    { "node-3.cluster:0", L, 0, "node-3.cluster", 0, "" },
    { "[::]:0", L, 0, "::", 0, "" },
    { ":0", C, -EINVAL, "", 0, "names no host, and a connection needs one; write host:port" },
    { ":7470", C, -EINVAL, "", 0, "write host:port, as 127.0.0.1:7470" },
    { "*:7470", C, -EINVAL, "", 0, "names no host" },
    { "host:0", C, -EINVAL, "", 0, "has port 0, which only a listener may use" },
    { "[::1]:0", C, -EINVAL, "", 0, "has port 0" },
    /* IPv6 without brackets: the message shows the bracketed form. */
    { "::1:7470", L, -EINVAL, "", 0, "address '::1:7470' has an IPv6 address without brackets; "
                                     "write [::1]:7470" },
    { "::1:7470", C, -EINVAL, "", 0, "write [::1]:7470" },
    { "fe80::1", L, -EINVAL, "", 0, "as [fe80::1]:PORT" },
    { "::1", C, -EINVAL, "", 0, "as [::1]:PORT" },
    /* Missing or bad ports. */
    { "host", L, -EINVAL, "", 0, "address 'host' has no port; write host:PORT" },
    { "host:", C, -EINVAL, "", 0, "address 'host:' has no port after ':'; write host:PORT" },
    { "[::1]", L, -EINVAL, "", 0, "address '[::1]' has no port; write [::1]:PORT" },
    { "[::1]:", L, -EINVAL, "", 0, "write [::1]:PORT" },
    { "host:65536", L, -EINVAL, "", 0, "port '65536' is not a number in 0..65535" },
    { "host:65536", C, -EINVAL, "", 0, "port '65536' is not a number in 1..65535" },
    { "host:-1", L, -EINVAL, "", 0, "port '-1' is not a number" },
    { "host:+1", C, -EINVAL, "", 0, "port '+1' is not a number" },
    { "host: 1", C, -EINVAL, "", 0, "port ' 1' is not a number" },
    { "host:80x", L, -EINVAL, "", 0, "port '80x' is not a number" },
    { "host:99999999999999999999", L, -EINVAL, "", 0, "is not a number in 0..65535" },
    /* Brackets. */
    { "[::1]80", L, -EINVAL, "", 0, "has '80' after ']' where ':port' belongs; write [::1]:PORT" },
    { "[::1:80", L, -EINVAL, "", 0, "has no ']' after its IPv6 address" },
    { "[]:80", L, -EINVAL, "", 0, "nothing between the brackets; write [ipv6]:port, as "
                                  "[::1]:7470, or :port for all interfaces" },
    { "[localhost]:80", C, -EINVAL, "", 0, "brackets are for IPv6 addresses only; write "
                                           "localhost:80" },
    { "host]:80", L, -EINVAL, "", 0, "stray bracket" },
    { "[::1]]:80", L, -EINVAL, "", 0, "after ']' where ':port' belongs" },
    /* The host itself. */
    { "", L, -EINVAL, "", 0, "address is empty; write host:port, as 127.0.0.1:7470 (or :7470 "
                             "for all interfaces)" },
    { "", C, -EINVAL, "", 0, "address is empty" },
    { "ho st:80", C, -EINVAL, "", 0, "the host 'ho st' has a space" },
    { "ho\tst:80", L, -EINVAL, "", 0, "has a space, a control character" },
    /* 255 characters fit; 256 and more are longer than any host name. The hosts are filled
     * in by the parameter function. */
    { "@255", L, 0, "@255", 80, "" },
    { "@256", C, -EINVAL, "", 0, "the host is 256 characters long, more than a host name can "
                                 "be (255)" },
    { "@300", L, -EINVAL, "", 0, "the host is 300 characters long" },
};

/* "@N" stands for a host of N letters 'a' with ":80" after it. */
static void expand(char *s, size_t size, int with_port)
{
    int n;

    if (s[0] != '@')
        return;
    n = atoi(s + 1);
    cr_assert_lt((size_t)n + 4, size);
    memset(s, 'a', (size_t)n);
    strcpy(s + n, with_port ? ":80" : "");
}

static void free_cases(struct criterion_test_params *ctp)
{
    cr_free(ctp->params);
}

ParameterizedTestParameters(addr, forms)
{
    size_t n = sizeof(cases) / sizeof(cases[0]);
    struct addr_case *p = cr_malloc(sizeof(cases));

    memcpy(p, cases, sizeof(cases));
    for (size_t i = 0; i < n; i++) {
        expand(p[i].in, sizeof(p[i].in), 1);
        expand(p[i].host, sizeof(p[i].host), 0);
    }
    return cr_make_param_array(struct addr_case, p, n, free_cases);
}

ParameterizedTest(struct addr_case *tc, addr, forms)
{
    rf_addr a;
    rf_err err = { 0 };
    char port[8];
    int rc;

    memset(&a, 0x5a, sizeof(a));
    rc = rf_addr_parse(tc->in, tc->use, &a, &err);
    cr_assert_eq(rc, tc->rc, "'%s' (%s): rc %d: %s", tc->in, tc->use == L ? "listen" : "connect",
                 rc, err.msg);
    if (rc == 0) {
        cr_assert_str_eq(a.host, tc->host, "'%s'", tc->in);
        cr_assert_eq(a.port_num, tc->port, "'%s'", tc->in);
        snprintf(port, sizeof(port), "%d", tc->port);
        cr_assert_str_eq(a.port, port, "'%s'", tc->in);
        return;
    }
    cr_assert_eq(err.code, rc);
    cr_assert_not_null(strstr(err.msg, tc->msg), "'%s': message \"%s\" lacks \"%s\"", tc->in,
                       err.msg, tc->msg);
    /* Every refusal names the address (an over-long one by its beginning). */
    if (tc->in[0] != '\0') {
        char head[41];

        snprintf(head, sizeof(head), "%s", tc->in);
        cr_assert_not_null(strstr(err.msg, head), "'%s': %s", tc->in, err.msg);
    }
}

Test(addr, null_is_refused_and_err_may_be_null)
{
    rf_addr a;
    rf_err err;

    cr_assert_eq(rf_addr_parse(NULL, L, &a, &err), -EINVAL);
    cr_assert_not_null(strstr(err.msg, "address is empty"), "%s", err.msg);
    cr_assert_eq(rf_addr_parse("::1:80", C, &a, NULL), -EINVAL);
    cr_assert_eq(rf_addr_parse("127.0.0.1:80", C, &a, NULL), 0);
}

/* What the hints say: all interfaces is a NULL node with AI_PASSIVE; a connection is never
 * passive. */
Test(addr, hints)
{
    struct addrinfo h;
    rf_addr a;

    cr_assert_eq(rf_addr_parse(":0", L, &a, NULL), 0);
    cr_assert_null(rf_addr_hints(&a, L, &h));
    cr_assert(h.ai_flags & AI_PASSIVE);
    cr_assert(h.ai_flags & AI_NUMERICSERV);
    cr_assert_eq(h.ai_socktype, SOCK_STREAM);
    cr_assert_eq(h.ai_family, AF_UNSPEC);
    cr_assert_eq(rf_addr_parse("127.0.0.1:7470", C, &a, NULL), 0);
    cr_assert_str_eq(rf_addr_hints(&a, C, &h), "127.0.0.1");
    cr_assert_not(h.ai_flags & AI_PASSIVE);
}

static int port_of(int fd)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);

    cr_assert_eq(getsockname(fd, (struct sockaddr *)&ss, &sl), 0);
    return ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                          : ((struct sockaddr_in *)&ss)->sin_port);
}

/* ":0" resolves to the wildcard, which a real socket binds and listens on; a connection to
 * 127.0.0.1 on the port the system picked, resolved through the same module, reaches it. */
Test(addr, resolve_listen_all_interfaces_and_connect)
{
    struct addrinfo *res = NULL, *cres = NULL;
    rf_addr a, to;
    rf_err err;
    char s[32];
    int lfd, cfd, afd, one = 1;

    cr_assert_eq(rf_addr_parse(":0", L, &a, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_addr_resolve(&a, L, &res, &err), 0, "%s", err.msg);
    lfd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    cr_assert_geq(lfd, 0);
    if (res->ai_family == AF_INET6)
        setsockopt(lfd, IPPROTO_IPV6, IPV6_V6ONLY, &(int){ 0 }, sizeof(int));
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    cr_assert_eq(bind(lfd, res->ai_addr, res->ai_addrlen), 0);
    cr_assert_eq(listen(lfd, 4), 0);
    freeaddrinfo(res);

    snprintf(s, sizeof(s), "127.0.0.1:%d", port_of(lfd));
    cr_assert_eq(rf_addr_parse(s, C, &to, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_addr_resolve(&to, C, &cres, &err), 0, "%s", err.msg);
    cfd = socket(cres->ai_family, cres->ai_socktype, cres->ai_protocol);
    cr_assert_geq(cfd, 0);
    cr_assert_eq(connect(cfd, cres->ai_addr, cres->ai_addrlen), 0);
    freeaddrinfo(cres);
    afd = accept(lfd, NULL, NULL);
    cr_assert_geq(afd, 0);
    close(afd);
    close(cfd);
    close(lfd);
}

/* A name that does not resolve is -EADDRNOTAVAIL (the network may still be coming up), and
 * the message names the host. */
Test(addr, resolve_failure_names_the_host)
{
    struct addrinfo *res = (struct addrinfo *)&res;
    rf_addr a;
    rf_err err;

    cr_assert_eq(rf_addr_parse("nosuch.invalid:80", C, &a, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_addr_resolve(&a, C, &res, &err), -EADDRNOTAVAIL, "%s", err.msg);
    cr_assert_null(res);
    cr_assert_not_null(strstr(err.msg, "cannot resolve 'nosuch.invalid': "), "%s", err.msg);
}
