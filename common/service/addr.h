/* common/service/addr.h - the one grammar of network addresses ("host:port", "[ipv6]:port", ":port"),
 * used by config checking and by every listener and connector, so that what the config check
 * accepts is what the sockets accept. */
#ifndef RF_ADDR_H
#define RF_ADDR_H

#include <stdint.h>

#include "err.h"

struct addrinfo;

/* What an address is for. A listener may name all interfaces (":7470", "*:7470") and port 0
 * (the system picks a free one); a connector needs a host and the port the other side
 * listens on. */
typedef enum { RF_ADDR_LISTEN, RF_ADDR_CONNECT } rf_addr_use;

typedef struct rf_addr {
    char host[256];     /* without brackets; "" = all interfaces (RF_ADDR_LISTEN only) */
    char port[6];       /* port_num in decimal, for getaddrinfo */
    uint16_t port_num;
} rf_addr;

/* Parses s as one of
 *   host:port       a name or IPv4 address, as node-3:7470 or 10.0.0.1:7470
 *   [ipv6]:port     an IPv6 address in brackets, as [::1]:7470 or [fe80::1%eth0]:7470
 *   :port, *:port   all interfaces (RF_ADDR_LISTEN only)
 * with a decimal port in 0..65535 (1..65535 for RF_ADDR_CONNECT). 0 with *out, or -EINVAL with
 * err naming the address and what to write instead (an IPv6 address without brackets is
 * refused with its bracketed form). */
int rf_addr_parse(const char *s, rf_addr_use use, rf_addr *out, rf_err *err);

/* Fills *hints for getaddrinfo of a (any family, stream, numeric port; AI_PASSIVE to listen)
 * and returns the node to pass: NULL for all interfaces, else a->host. */
const char *rf_addr_hints(const rf_addr *a, rf_addr_use use, struct addrinfo *hints);

/* getaddrinfo of a with rf_addr_hints: 0 with *res (release with freeaddrinfo), or a negative
 * errno with err ("cannot resolve 'host': why"): -EADDRNOTAVAIL when the name does not
 * resolve (yet: DNS or the network may still be coming up). */
int rf_addr_resolve(const rf_addr *a, rf_addr_use use, struct addrinfo **res, rf_err *err);

#endif
