/* common/service/admit.c - the table of connections that have proven nothing yet, oldest
 * first, counted per source, and which one gives way when it is full. */
#include "admit.h"

#include <assert.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

void rf_admit_init(rf_admit *t, rf_admit_src *srcs, uint32_t cap)
{
    assert(cap >= 1);
    memset(t, 0, sizeof(*t));
    memset(srcs, 0, cap * sizeof(*srcs));
    t->srcs = srcs;
    t->cap = cap;
}

/* IPv4 as its IPv4-mapped IPv6 form, so that a dual-stack listener counts one host once;
 * IPv6 cut to its /64. */
static void src_key(const struct sockaddr *sa, uint8_t key[16])
{
    memset(key, 0, 16);
    if (sa != NULL && sa->sa_family == AF_INET) {
        key[10] = key[11] = 0xff;
        memcpy(key + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    } else if (sa != NULL && sa->sa_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
        static const uint8_t mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };

        memcpy(key, a, memcmp(a, mapped, 12) == 0 ? 16 : 8);
    }
}

rf_admit_entry *rf_admit_victim(const rf_admit *t)
{
    uint32_t most = 0;

    if (t->count < t->cap)
        return NULL;
    for (uint32_t i = 0; i < t->cap; i++)
        if (t->srcs[i].n > most)
            most = t->srcs[i].n;
    for (rf_admit_entry *e = t->oldest; e; e = e->newer)
        if (e->src->n == most)
            return e;
    assert(!"a full table has an entry of its largest source");
    return NULL;
}

void rf_admit_add(rf_admit *t, rf_admit_entry *e, const struct sockaddr *sa)
{
    rf_admit_src *free_slot = NULL, *s = NULL;
    uint8_t key[16];

    assert(t->count < t->cap && e->src == NULL);
    src_key(sa, key);
    for (uint32_t i = 0; i < t->cap && s == NULL; i++) {
        if (t->srcs[i].n == 0) {
            if (free_slot == NULL)
                free_slot = &t->srcs[i];
        } else if (memcmp(t->srcs[i].key, key, 16) == 0) {
            s = &t->srcs[i];
        }
    }
    if (s == NULL) {
        /* Fewer than cap entries use fewer than cap slots. */
        assert(free_slot != NULL);
        s = free_slot;
        memcpy(s->key, key, 16);
    }
    s->n++;
    e->src = s;
    e->newer = NULL;
    e->older = t->newest;
    if (t->newest)
        t->newest->newer = e;
    else
        t->oldest = e;
    t->newest = e;
    t->count++;
}

void rf_admit_remove(rf_admit *t, rf_admit_entry *e)
{
    if (e->src == NULL)
        return;
    assert(t->count > 0 && e->src->n > 0);
    e->src->n--;
    e->src = NULL;
    if (e->older)
        e->older->newer = e->newer;
    else
        t->oldest = e->newer;
    if (e->newer)
        e->newer->older = e->older;
    else
        t->newest = e->older;
    e->older = e->newer = NULL;
    t->count--;
}

uint32_t rf_admit_src_count(const rf_admit_entry *e)
{
    return e->src ? e->src->n : 0;
}
