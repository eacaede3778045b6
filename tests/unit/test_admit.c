/* tests/unit/test_admit.c - the table of connections that have proven nothing yet: which one
 * gives way when it is full (the oldest of the source holding the most), how sources are
 * counted (IPv4, IPv4-mapped IPv6, IPv6 /64), and removal from anywhere in the table. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "admit.h"

static struct sockaddr_storage addr_of(const char *ip)
{
    struct sockaddr_storage ss;

    memset(&ss, 0, sizeof(ss));
    if (strchr(ip, ':')) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;

        a->sin6_family = AF_INET6;
        cr_assert_eq(inet_pton(AF_INET6, ip, &a->sin6_addr), 1, "%s", ip);
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;

        a->sin_family = AF_INET;
        cr_assert_eq(inet_pton(AF_INET, ip, &a->sin_addr), 1, "%s", ip);
    }
    return ss;
}

static void add(rf_admit *t, rf_admit_entry *e, const char *ip)
{
    struct sockaddr_storage ss = addr_of(ip);

    rf_admit_add(t, e, (struct sockaddr *)&ss);
}

/* Adds e after taking out the victim, as a server does; returns the victim (NULL: room). */
static rf_admit_entry *admit(rf_admit *t, rf_admit_entry *e, const char *ip)
{
    rf_admit_entry *v = rf_admit_victim(t);

    if (v)
        rf_admit_remove(t, v);
    add(t, e, ip);
    return v;
}

Test(admit, room_then_oldest_of_the_largest_source)
{
    rf_admit_src srcs[4];
    rf_admit_entry e[8] = {{0}};
    rf_admit t;

    rf_admit_init(&t, srcs, 4);
    cr_assert_null(rf_admit_victim(&t));
    /* e0 from A (the oldest), then three from B: full. */
    cr_assert_null(admit(&t, &e[0], "10.0.0.1"));
    cr_assert_null(admit(&t, &e[1], "10.0.0.2"));
    cr_assert_null(admit(&t, &e[2], "10.0.0.2"));
    cr_assert_null(admit(&t, &e[3], "10.0.0.2"));
    cr_assert_eq(t.count, 4);
    cr_assert_eq(rf_admit_src_count(&e[0]), 1);
    cr_assert_eq(rf_admit_src_count(&e[3]), 3);
    /* B holds the most: its oldest goes, not the older e0. */
    cr_assert_eq(admit(&t, &e[4], "10.0.0.3"), &e[1]);
    cr_assert_eq(rf_admit_src_count(&e[1]), 0);
    cr_assert_eq(admit(&t, &e[5], "10.0.0.1"), &e[2]);
    /* A, B and C hold 2, 1, 1: A's oldest, e0. */
    cr_assert_eq(admit(&t, &e[6], "10.0.0.4"), &e[0]);
    /* Four sources with one each: a tie, so the oldest of all, e3. */
    cr_assert_eq(admit(&t, &e[7], "10.0.0.5"), &e[3]);
    cr_assert_eq(t.count, 4);
    cr_assert_eq(t.oldest, &e[4]);
    cr_assert_eq(t.newest, &e[7]);
}

Test(admit, ties_go_to_the_source_with_the_oldest_entry)
{
    rf_admit_src srcs[4];
    rf_admit_entry e[5] = {{0}};
    rf_admit t;

    rf_admit_init(&t, srcs, 4);
    add(&t, &e[0], "10.0.0.9");
    add(&t, &e[1], "10.0.0.7");
    add(&t, &e[2], "10.0.0.9");
    add(&t, &e[3], "10.0.0.7");
    cr_assert_eq(rf_admit_victim(&t), &e[0]);
    rf_admit_remove(&t, &e[0]);
    add(&t, &e[4], "10.0.0.9");
    cr_assert_eq(rf_admit_victim(&t), &e[1]);
}

/* Removing from the middle, the ends, twice, and an entry in no table keeps the list and the
 * counts right; a freed source slot is reused for another source. */
Test(admit, removal_anywhere)
{
    rf_admit_src srcs[3];
    rf_admit_entry e[5] = {{0}};
    rf_admit t;

    rf_admit_init(&t, srcs, 3);
    rf_admit_remove(&t, &e[4]);
    cr_assert_eq(t.count, 0);
    add(&t, &e[0], "10.0.0.1");
    add(&t, &e[1], "10.0.0.2");
    add(&t, &e[2], "10.0.0.3");
    rf_admit_remove(&t, &e[1]);
    rf_admit_remove(&t, &e[1]);
    cr_assert_eq(t.count, 2);
    cr_assert_eq(t.oldest, &e[0]);
    cr_assert_eq(e[0].newer, &e[2]);
    cr_assert_eq(e[2].older, &e[0]);
    add(&t, &e[3], "10.0.0.4");
    cr_assert_eq(rf_admit_src_count(&e[3]), 1);
    rf_admit_remove(&t, &e[0]);
    rf_admit_remove(&t, &e[3]);
    cr_assert_eq(t.oldest, &e[2]);
    cr_assert_eq(t.newest, &e[2]);
    rf_admit_remove(&t, &e[2]);
    cr_assert_null(t.oldest);
    cr_assert_null(t.newest);
    cr_assert_eq(t.count, 0);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(srcs[i].n, 0);
}

/* One host is one source: an IPv4 address and its IPv4-mapped IPv6 form, and every address of
 * an IPv6 /64. Other /64s are other sources; every other family is one source. */
Test(admit, sources)
{
    rf_admit_src srcs[8];
    rf_admit_entry e[8] = {{0}};
    struct sockaddr_un un = { .sun_family = AF_UNIX };
    rf_admit t;

    rf_admit_init(&t, srcs, 8);
    add(&t, &e[0], "192.0.2.7");
    add(&t, &e[1], "::ffff:192.0.2.7");
    cr_assert_eq(rf_admit_src_count(&e[0]), 2);
    add(&t, &e[2], "2001:db8:1:2::1");
    add(&t, &e[3], "2001:db8:1:2:ffff::9");
    cr_assert_eq(rf_admit_src_count(&e[2]), 2);
    add(&t, &e[4], "2001:db8:1:3::1");
    cr_assert_eq(rf_admit_src_count(&e[4]), 1);
    add(&t, &e[5], "192.0.2.8");
    cr_assert_eq(rf_admit_src_count(&e[5]), 1);
    rf_admit_add(&t, &e[6], (struct sockaddr *)&un);
    rf_admit_add(&t, &e[7], NULL);
    cr_assert_eq(rf_admit_src_count(&e[7]), 2);
    cr_assert_eq(rf_admit_src_count(&e[0]), 2);
}
