/* common/service/admit.h - the bounded table of a server's connections that have proven
 * nothing yet (a control connection in its handshake, an HTTP connection without a request),
 * and the rule for which one gives way to a new connection when it is full. */
#ifndef RF_ADMIT_H
#define RF_ADMIT_H

#include <stdint.h>

struct sockaddr;

/* Connections from one source: an IPv4 address, or an IPv6 /64 (one host commonly holds a
 * whole /64, so counting its addresses one by one would count nothing). */
typedef struct rf_admit_src {
    uint8_t key[16];
    uint32_t n;                 /* entries of the table from this source; 0: slot unused */
} rf_admit_src;

/* One connection in the table, embedded in its owner's struct (container_of). */
typedef struct rf_admit_entry {
    struct rf_admit_entry *older, *newer;
    rf_admit_src *src;          /* NULL while not in a table */
} rf_admit_entry;

typedef struct rf_admit {
    rf_admit_entry *oldest, *newest;
    rf_admit_src *srcs;         /* cap slots (the owner's): cap entries have at most cap sources */
    uint32_t count, cap;
} rf_admit;

/* A table of at most cap entries (cap >= 1), with srcs (cap slots) the caller owns and keeps
 * until the table is no longer used; the table allocates nothing. */
void rf_admit_init(rf_admit *t, rf_admit_src *srcs, uint32_t cap);

/* NULL while the table has room. When it is full: the entry that must leave before another
 * enters, the oldest entry of the source that holds the most entries (the oldest of those
 * sources' oldest entries on a tie). */
rf_admit_entry *rf_admit_victim(const rf_admit *t);
/* Adds e, from sa (AF_INET or AF_INET6; any other family counts as one source), as the newest
 * entry. The table must have room (take rf_admit_victim out first) and e must not be in a
 * table. */
void rf_admit_add(rf_admit *t, rf_admit_entry *e, const struct sockaddr *sa);
/* Takes e out of t; nothing when e is in no table. */
void rf_admit_remove(rf_admit *t, rf_admit_entry *e);
/* How many entries e's source holds in its table (0 when e is in none). */
uint32_t rf_admit_src_count(const rf_admit_entry *e);

#endif
