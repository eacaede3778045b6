/* common/service/addr.c - parsing "host:port" addresses with one grammar, and resolving them. */
#include "addr.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

/* Whether h[0..n) is an IPv6 literal, a zone ("%eth0") allowed: used only to suggest the
 * bracketed form of an address written without brackets. */
static int is_ipv6(const char *h, size_t n)
{
    char buf[INET6_ADDRSTRLEN + 1];
    unsigned char bin[16];
    const char *zone = memchr(h, '%', n);

    if (zone != NULL)
        n = (size_t)(zone - h);
    if (n == 0 || n >= sizeof(buf))
        return 0;
    memcpy(buf, h, n);
    buf[n] = '\0';
    return inet_pton(AF_INET6, buf, bin) == 1;
}

/* "::1:7470" may be [::1]:7470 or the address ::1:7470 without a port; suggest the first when
 * what precedes the last ':' is an IPv6 address and a port follows it, else bracket it all. */
static int refuse_bare_ipv6(const char *s, const char *colon, rf_err *err)
{
    const char *p = colon + 1;

    if (*p != '\0' && strspn(p, "0123456789") == strlen(p) && is_ipv6(s, (size_t)(colon - s)))
        return rf_err_set(err, -EINVAL, "address '%s' has an IPv6 address without brackets; "
                          "write [%.*s]:%s", s, (int)(colon - s), s, p);
    return rf_err_set(err, -EINVAL, "address '%s' has more than one ':'; an IPv6 address goes "
                      "in brackets before the port, as [%s]:PORT", s, s);
}

/* Spaces and control characters are never part of a host, and '[' ']' only around IPv6. */
static int bad_host_char(const char *h, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)h[i];

        if (isspace(ch) || iscntrl(ch) || ch == '[' || ch == ']')
            return 1;
    }
    return 0;
}

int rf_addr_parse(const char *s, rf_addr_use use, rf_addr *out, rf_err *err)
{
    const int listen = use == RF_ADDR_LISTEN;
    const char *h, *colon, *p;
    const char *range = listen ? "0..65535" : "1..65535";
    size_t hlen, plen;
    unsigned long v = 0;
    int bracketed = 0;

    if (s == NULL || *s == '\0')
        return rf_err_set(err, -EINVAL, "address is empty; write host:port, as %s",
                          listen ? "127.0.0.1:7470 (or :7470 for all interfaces)"
                                 : "127.0.0.1:7470");
    if (s[0] == '[') {
        const char *close = strchr(s, ']');

        bracketed = 1;
        h = s + 1;
        if (close == NULL)
            return rf_err_set(err, -EINVAL, "address '%s' has no ']' after its IPv6 address; "
                              "write [ipv6]:port, as [::1]:7470", s);
        hlen = (size_t)(close - h);
        if (close[1] == '\0')
            return rf_err_set(err, -EINVAL, "address '%s' has no port; write %s:PORT", s, s);
        if (close[1] != ':')
            return rf_err_set(err, -EINVAL, "address '%s' has '%s' after ']' where ':port' "
                              "belongs; write %.*s:PORT", s, close + 1, (int)(close + 1 - s), s);
        if (hlen == 0)
            return rf_err_set(err, -EINVAL, "address '%s' has nothing between the brackets; "
                              "write [ipv6]:port, as [::1]:7470%s", s,
                              listen ? ", or :port for all interfaces" : "");
        if (memchr(h, ':', hlen) == NULL)
            return rf_err_set(err, -EINVAL, "address '%s': brackets are for IPv6 addresses "
                              "only; write %.*s%s", s, (int)hlen, h, close + 1);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (colon == NULL)
            return rf_err_set(err, -EINVAL, "address '%s' has no port; write %s:PORT", s, s);
        h = s;
        hlen = (size_t)(colon - s);
        if (memchr(s, ':', hlen) != NULL)
            return refuse_bare_ipv6(s, colon, err);
    }
    p = colon + 1;
    plen = strlen(p);
    if (plen == 0)
        return rf_err_set(err, -EINVAL, "address '%s' has no port after ':'; write %sPORT", s,
                          s);
    /* Digits only: strtoul would take " 1", "+1" and "-1" (as a huge number). Stop summing
     * once past the range so that a long string of digits cannot wrap. */
    for (size_t i = 0; i < plen; i++) {
        if (p[i] < '0' || p[i] > '9') {
            v = 65536;
            break;
        }
        if (v <= 65535)
            v = v * 10 + (unsigned long)(p[i] - '0');
    }
    if (v > 65535)
        return rf_err_set(err, -EINVAL, "address '%s': port '%s' is not a number in %s", s, p,
                          range);
    if (bad_host_char(h, hlen))
        return rf_err_set(err, -EINVAL, "address '%s': the host '%.*s' has a space, a control "
                          "character or a stray bracket; write host:port or [ipv6]:port", s,
                          (int)hlen, h);
    if (hlen >= sizeof(out->host))
        return rf_err_set(err, -EINVAL, "address '%.40s...': the host is %zu characters long, "
                          "more than a host name can be (%zu); shorten it", s, hlen,
                          sizeof(out->host) - 1);
    if (!bracketed && (hlen == 0 || (hlen == 1 && h[0] == '*')) && !listen)
        return rf_err_set(err, -EINVAL, "address '%s' names no host, and a connection needs "
                          "one; write host:port, as 127.0.0.1:%s", s, v ? p : "7470");
    if (v == 0 && !listen)
        return rf_err_set(err, -EINVAL, "address '%s' has port 0, which only a listener may "
                          "use (the system then picks a free port); give the port the other "
                          "side listens on", s);
    if (!bracketed && hlen == 1 && h[0] == '*')
        hlen = 0;
    memcpy(out->host, h, hlen);
    out->host[hlen] = '\0';
    out->port_num = (uint16_t)v;
    snprintf(out->port, sizeof(out->port), "%lu", v);
    return 0;
}

const char *rf_addr_hints(const rf_addr *a, rf_addr_use use, struct addrinfo *hints)
{
    memset(hints, 0, sizeof(*hints));
    hints->ai_family = AF_UNSPEC;
    hints->ai_socktype = SOCK_STREAM;
    hints->ai_flags = AI_NUMERICSERV | (use == RF_ADDR_LISTEN ? AI_PASSIVE : 0);
    return a->host[0] != '\0' ? a->host : NULL;
}

int rf_addr_resolve(const rf_addr *a, rf_addr_use use, struct addrinfo **res, rf_err *err)
{
    struct addrinfo hints;
    const char *node = rf_addr_hints(a, use, &hints);
    int g, rc;

    *res = NULL;
    g = getaddrinfo(node, a->port, &hints, res);
    if (g == 0)
        return 0;
    switch (g) {
    case EAI_SYSTEM:
        rc = errno ? -errno : -EIO;
        break;
    case EAI_MEMORY:
        rc = -ENOMEM;
        break;
    case EAI_NONAME:
    case EAI_AGAIN:
    case EAI_FAIL:
#ifdef EAI_NODATA
    case EAI_NODATA:
#endif
#ifdef EAI_ADDRFAMILY
    case EAI_ADDRFAMILY:
#endif
        rc = -EADDRNOTAVAIL;
        break;
    default:
        rc = -EINVAL;
        break;
    }
    *res = NULL;
    return rf_err_set(err, rc, "cannot resolve '%s': %s", node ? node : "all interfaces",
                      g == EAI_SYSTEM ? strerror(-rc) : gai_strerror(g));
}
