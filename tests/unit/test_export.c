/* tests/unit/test_export.c - same-host export: a trainers' registry on a loop thread, trainers
 * registering real memfds through librefit, and rf_export_fetch (or raw requests) from the
 * test's thread over the real socket; every refusal and every check of the client hit. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "export.h"
#include "loop_thread.h"
#include "mem.h"
#include "refit.h"
#include "refit.pb-c.h"
#include "registry.h"
#include "rpc.h"
#include "wire.h"

typedef struct harness {
    test_loop l;
    rf_registry *reg;
    char dir[64], path[128];
    int n_inventory, n_change;
} harness;

static harness H;
static uint8_t KEY[32], OTHER_KEY[40];


static void cb_inventory(rf_registry *r, void *ud) { (void)r; (void)ud; test_loop_bump(&H.l, &H.n_inventory); }
static void cb_change(rf_registry *r, void *ud) { (void)r; (void)ud; test_loop_bump(&H.l, &H.n_change); }





static void wait_inventory(int n) { test_loop_wait(&H.l, &H.n_inventory, n); }

static void call_set_key(void *arg)
{
    const uint8_t *k = arg;

    rf_registry_set_export_key(H.reg, k, k ? sizeof(KEY) : 0);
}

/* A registry of the given side; with_key: export on with KEY. */
static void open_registry(rf_side side, unsigned expected, bool with_key)
{
    static const rf_registry_cb cb = {.on_inventory = cb_inventory, .on_change = cb_change};
    rf_registry_opts o = {0};
    rf_err err = {0};

    o.socket_path = H.path;
    o.side = side;
    o.expected_clients = expected;
    cr_assert_eq(rf_registry_open(&H.l.loop, &o, &cb, NULL, &H.reg, &err), 0, "%s", err.msg);
    test_loop_start(&H.l);
    if (with_key)
        test_loop_run(&H.l, call_set_key, KEY);
}

/* Every piece id, for the fetches that ask for all the trainers' memory: all_n of them. */
static uint32_t ALLP[4096];
static size_t all_n;

static void setup(void)
{
    size_t i;

    for (i = 0; i < sizeof(ALLP) / sizeof(ALLP[0]); i++)
        ALLP[i] = (uint32_t)i;
    all_n = 4;

    memset(&H, 0, sizeof(H));
    test_loop_init(&H.l);
    snprintf(H.dir, sizeof(H.dir), "/tmp/rf_exp_XXXXXX");
    cr_assert(mkdtemp(H.dir));
    snprintf(H.path, sizeof(H.path), "%s/pub.sock", H.dir);
    for (i = 0; i < sizeof(KEY); i++)
        KEY[i] = (uint8_t)(i * 7 + 1);
    for (i = 0; i < sizeof(OTHER_KEY); i++)
        OTHER_KEY[i] = (uint8_t)(i * 7 + 2);
}

static void close_registry(void *arg)
{
    (void)arg;
    rf_registry_close(H.reg);
    H.reg = NULL;
}

static void teardown(void)
{
    test_loop_stop(&H.l, close_registry, NULL);
    unlink(H.path);
    rmdir(H.dir);
}

TestSuite(export, .init = setup, .fini = teardown);

#define OK(call, c) cr_assert_eq((call), 0, "%s: %s", #call, refit_last_error(c))

static refit_client *trainer(const char *name, int rank)
{
    refit_client *c = NULL;

    OK(refit_connect(H.path, name, rank, REFIT_TRAINER, &c), NULL);
    return c;
}

/* The registered trainers: t0 holds rows 0-1 of "w" [4, 8] fp32 in a region of its own, and
 * "b" [3] at offset 4096 and "c" [4] at offset 0 of a larger memfd (two regions of one object:
 * the registry keeps one fd for both); t1 rows 2-3 of "w". Every region's bytes are one value,
 * distinct per region. */
typedef struct trainers {
    refit_client *t0, *t1;
    int big_fd;            /* t0's memfd of 8192 bytes */
    uint8_t *big;
    void *w0, *w1;
} trainers;

static void start_trainers(trainers *T, bool seal_t1)
{
    const int64_t shw[2] = {4, 8}, s0[2] = {0, 0}, s2[2] = {2, 0}, ext[2] = {2, 8};
    const int64_t shb[1] = {3}, sb[1] = {0}, eb[1] = {3}, shc[1] = {4}, ec[1] = {4};
    uint32_t r;

    T->t0 = trainer("t0", 0);
    T->t1 = trainer("t1", 1);
    OK(refit_alloc_host(T->t0, 64, &T->w0, &r), T->t0);
    memset(T->w0, 0xa1, 64);
    OK(refit_add_piece(T->t0, "w", REFIT_FP32, 2, shw, r, 0, s0, ext, NULL), T->t0);
    T->big_fd = memfd_create("big", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_geq(T->big_fd, 0);
    cr_assert_eq(ftruncate(T->big_fd, 8192), 0);
    T->big = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, T->big_fd, 0);
    cr_assert_neq(T->big, MAP_FAILED);
    memset(T->big, 0x11, 8192);
    memset(T->big + 4096, 0xb2, 12);
    OK(refit_region_memfd_at(T->t0, T->big_fd, 4096, 12, &r), T->t0);
    OK(refit_add_piece(T->t0, "b", REFIT_FP32, 1, shb, r, 0, sb, eb, NULL), T->t0);
    memset(T->big, 0xd4, 16);
    OK(refit_region_memfd_at(T->t0, T->big_fd, 0, 16, &r), T->t0);
    OK(refit_add_piece(T->t0, "c", REFIT_FP32, 1, shc, r, 0, sb, ec, NULL), T->t0);
    OK(refit_alloc_host(T->t1, 64, &T->w1, &r), T->t1);
    memset(T->w1, 0xc3, 64);
    OK(refit_add_piece(T->t1, "w", REFIT_FP32, 2, shw, r, 0, s2, ext, NULL), T->t1);
    OK(refit_seal(T->t0), T->t0);
    if (seal_t1) {
        OK(refit_seal(T->t1), T->t1);
        wait_inventory(1);
    }
}

static void stop_trainers(trainers *T)
{
    refit_close(T->t0);
    refit_close(T->t1);
    munmap(T->big, 8192);
    close(T->big_fd);
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *de;
    int n = 0;

    cr_assert_not_null(d);
    while ((de = readdir(d)) != NULL)
        if (de->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1; /* the directory's own fd */
}

/* Waits (up to 5 s) for this process to hold n fds again: the registry closes a peer's
 * connection when it reads the peer's close, on its own thread. */
static void wait_fds(int n)
{
    int i, now = count_fds();

    for (i = 0; i < 500 && now != n; i++) {
        struct pollfd none;

        poll(&none, 0, 10);
        now = count_fds();
    }
    cr_assert_eq(now, n, "%d fds open, %d expected", now, n);
}

/* What the test's thread compares against, read on the loop. */
typedef struct check {
    const rf_export *e;
    uint8_t *const *mapped;  /* per region: the exported fd's mapping + offset */
    uint64_t generation;
    char why[256];
} check;

static void compare_on_loop(void *arg)
{
    check *k = arg;
    const rf_inv *a = k->e->inv, *b = rf_registry_inv(H.reg);
    uint32_t i;

    k->generation = rf_registry_generation(H.reg);
    k->why[0] = '\0';
    if (rf_inv_ntensors(a) != rf_inv_ntensors(b) || rf_inv_nregions(a) != rf_inv_nregions(b) ||
        rf_inv_npieces(a, RF_SRC) != rf_inv_npieces(b, RF_SRC) ||
        rf_inv_npieces(a, RF_DST) != 0 || rf_inv_nendpoints(a) != rf_inv_nendpoints(b)) {
        snprintf(k->why, sizeof(k->why), "counts differ");
        return;
    }
    for (i = 0; i < rf_inv_ntensors(a); i++) {
        const rf_tensor *x = rf_inv_tensor(a, i), *y = rf_inv_tensor(b, i);

        if (strcmp(x->name, y->name) != 0 || x->dtype != y->dtype || x->ndim != y->ndim ||
            memcmp(x->shape, y->shape, sizeof(x->shape)) != 0) {
            snprintf(k->why, sizeof(k->why), "tensor %u differs", i);
            return;
        }
    }
    for (i = 0; i < rf_inv_nregions(a); i++) {
        const rf_region *x = rf_inv_region(a, i), *y = rf_inv_region(b, i);

        if (x->size != y->size || x->endpoint != y->endpoint || x->size != k->e->regions[i].size) {
            snprintf(k->why, sizeof(k->why), "region %u differs", i);
            return;
        }
        /* The exported fd maps the very bytes the registry mapped for that id. */
        if (memcmp(k->mapped[i], rf_registry_region_base(H.reg, i), x->size) != 0) {
            snprintf(k->why, sizeof(k->why), "region %u holds other bytes", i);
            return;
        }
    }
    for (i = 0; i < rf_inv_npieces(a, RF_SRC); i++) {
        rf_piece x, y;

        rf_inv_piece(a, RF_SRC, i, &x);
        rf_inv_piece(b, RF_SRC, i, &y);
        if (x.tensor != y.tensor || x.region != y.region || x.offset != y.offset ||
            memcmp(&x.box, &y.box, sizeof(x.box)) != 0 ||
            memcmp(x.strides, y.strides, sizeof(x.strides)) != 0) {
            snprintf(k->why, sizeof(k->why), "piece %u differs", i);
            return;
        }
    }
}

static rf_export *fetch_ok(void)
{
    rf_export *e = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_export_fetch(H.path, KEY, sizeof(KEY), ALLP, all_n, 5, &e, &err), 0, "%s",
                 err.msg);
    cr_assert_not_null(e);
    return e;
}

#define FETCH_FAILS(path, key, klen, tmo, code, text)                                         \
    do {                                                                                      \
        rf_export *e_ = (rf_export *)1;                                                       \
        rf_err err_ = {0};                                                                    \
        int rc_ = rf_export_fetch((path), (key), (klen), ALLP, all_n, (tmo), &e_, &err_);     \
        cr_assert_eq(rc_, (code), "fetch returned %d: %s", rc_, err_.msg);                    \
        cr_assert_null(e_);                                                                   \
        cr_assert(strstr(err_.msg, (text)), "message '%s' lacks '%s'", err_.msg, (text));     \
    } while (0)

Test(export, fetch_gives_the_inventory_regions_and_trainer_memory)
{
    uint8_t *maps[4] = {0}, *mapped[4];
    uint64_t lens[4];
    rf_mem_cache *cache = rf_mem_cache_new();
    trainers T;
    check k = {0};
    rf_export *e;
    uint32_t i, seen = 0;

    open_registry(RF_SRC, 2, true);
    start_trainers(&T, true);
    e = fetch_ok();
    cr_assert_eq(e->nregions, 4);
    for (i = 0; i < e->nregions; i++) {
        const rf_mem_desc *d = &e->regions[i];
        rf_mem_ref *ref = NULL;
        rf_err err = {0};
        uint64_t j;

        cr_assert_eq(d->kind, RF_MEM_MEMFD);
        cr_assert_str_eq(d->device, "host");
        cr_assert_geq(d->fd, 0);
        cr_assert_eq(d->handle_len, 0);
        lens[i] = d->offset + d->size;
        maps[i] = mmap(NULL, lens[i], PROT_READ, MAP_SHARED, d->fd, 0);
        cr_assert_neq(maps[i], MAP_FAILED);
        mapped[i] = maps[i] + d->offset;
        /* Each region is one trainer region, whole: its one value, each value once. */
        for (j = 1; j < d->size; j++)
            cr_assert_eq(mapped[i][j], mapped[i][0]);
        if (mapped[i][0] == 0xa1 && d->size == 64 && d->offset == 0)
            seen |= 1;
        if (mapped[i][0] == 0xb2 && d->size == 12 && d->offset == 4096)
            seen |= 2;
        if (mapped[i][0] == 0xc3 && d->size == 64 && d->offset == 0)
            seen |= 4;
        if (mapped[i][0] == 0xd4 && d->size == 16 && d->offset == 0)
            seen |= 16;
        /* A receiverd imports the description as it stands. */
        cr_assert_eq(rf_mem_import(cache, d, &ref, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(rf_mem_ref_base(ref), mapped[i], d->size), 0);
        rf_mem_release(cache, ref);
    }
    cr_assert_eq(seen, 7 | 16, "the four trainer regions, each once");
    /* Ids are the publisher's: the inventory equals the registry's, piece for piece. */
    k.e = e;
    k.mapped = mapped;
    test_loop_run(&H.l, compare_on_loop, &k);
    cr_assert_str_eq(k.why, "");
    cr_assert_eq(e->generation, k.generation);
    cr_assert_eq(rf_inv_ntensors(e->inv), 3);
    cr_assert_eq(rf_inv_npieces(e->inv, RF_SRC), 4);
    /* The mapping is the trainer's memory, live. */
    memset(T.w1, 0x5e, 64);
    for (i = 0; i < 4; i++)
        if (e->regions[i].size == 64 && mapped[i][0] == 0x5e)
            seen |= 8;
    cr_assert_eq(seen, 31);
    for (i = 0; i < 4; i++)
        munmap(maps[i], lens[i]);
    rf_export_free(e);
    rf_mem_cache_free(cache);
    stop_trainers(&T);
}

/* Least privilege: an Export gets the regions of the pieces it names (and nothing of the
 * others but their place), no pieces the inventory alone, a piece it does not hold -ESTALE. */
Test(export, only_the_regions_of_the_asked_pieces_are_granted)
{
    const uint32_t one[1] = {3}, stale[2] = {1, 4};
    trainers T;
    rf_export *e = NULL;
    rf_err err = {0};
    uint32_t i, granted = 0;
    int base;

    open_registry(RF_SRC, 2, true);
    start_trainers(&T, true);
    base = count_fds();
    cr_assert_eq(rf_export_fetch(H.path, KEY, sizeof(KEY), one, 1, 5, &e, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(e->nregions, 4);
    for (i = 0; i < e->nregions; i++) {
        const rf_mem_desc *d = &e->regions[i];
        rf_piece p;

        rf_inv_piece(e->inv, RF_SRC, 3, &p);
        if (i == p.region) {
            cr_assert_eq(d->kind, RF_MEM_MEMFD);
            cr_assert_geq(d->fd, 0);
            granted++;
        } else {
            cr_assert_eq(d->kind, 0, "region %u of no asked piece is granted", i);
            cr_assert_eq(d->fd, -1);
            cr_assert_null(d->device);
        }
    }
    cr_assert_eq(granted, 1);
    rf_export_free(e);
    wait_fds(base);
    e = NULL;
    /* No pieces: what the publisherd holds, none of its memory. */
    cr_assert_eq(rf_export_fetch(H.path, KEY, sizeof(KEY), NULL, 0, 5, &e, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(rf_inv_npieces(e->inv, RF_SRC), 4);
    for (i = 0; i < e->nregions; i++)
        cr_assert_eq(e->regions[i].kind, 0);
    rf_export_free(e);
    e = (rf_export *)1;
    cr_assert_eq(rf_export_fetch(H.path, KEY, sizeof(KEY), stale, 2, 5, &e, &err), -ESTALE,
                 "%s", err.msg);
    cr_assert_null(e);
    cr_assert(strstr(err.msg, "asks for piece 4, this publisherd holds 4"), "%s", err.msg);
    wait_fds(base);
    stop_trainers(&T);
}

Test(export, wrong_key_is_refused_with_the_reason)
{
    trainers T;

    open_registry(RF_SRC, 2, true);
    start_trainers(&T, true);
    FETCH_FAILS(H.path, OTHER_KEY, sizeof(OTHER_KEY), 5, -EACCES, "wrong MAC from pid");
    FETCH_FAILS(H.path, OTHER_KEY, sizeof(OTHER_KEY), 5, -EACCES, H.path);
    FETCH_FAILS(H.path, KEY, sizeof(KEY) - 1, 5, -EINVAL, "a cluster key of 32 to 1024 bytes");
    FETCH_FAILS(H.path, NULL, 0, 5, -EINVAL, "got 0");
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 0, -EINVAL, "timeout 0 s");
    stop_trainers(&T);
}

Test(export, refused_while_the_inventory_is_incomplete)
{
    trainers T;
    rf_export *e;

    open_registry(RF_SRC, 2, true);
    start_trainers(&T, false);
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 5, -EAGAIN,
                "inventory incomplete (1 of 2 trainers sealed): retry after the next plan");
    OK(refit_seal(T.t1), T.t1);
    wait_inventory(1);
    e = fetch_ok();
    rf_export_free(e);
    /* A trainer leaving makes it incomplete again. */
    refit_close(T.t1);
    T.t1 = NULL;
    test_loop_wait(&H.l, &H.n_change, 1);
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 5, -EAGAIN, "inventory incomplete (1 of 2");
    stop_trainers(&T);
}

Test(export, receiver_side_and_keyless_registries_refuse)
{
    open_registry(RF_DST, 1, true);
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 5, -EOPNOTSUPP,
                "peer client connected to the receiver daemon");
}

Test(export, keyless_registry_refuses)
{
    trainers T;

    open_registry(RF_SRC, 2, false);
    start_trainers(&T, true);
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 5, -ENOKEY, "same-host export is off");
    /* Turned on, then off again. */
    test_loop_run(&H.l, call_set_key, KEY);
    rf_export_free(fetch_ok());
    test_loop_run(&H.l, call_set_key, NULL);
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 5, -ENOKEY, "no export key set");
    stop_trainers(&T);
}

typedef struct keycase { size_t len; int rc; } keycase;
static void call_key_len(void *arg)
{
    static uint8_t big[RF_EXPORT_KEY_MAX + 1];
    keycase *kc = arg;

    kc->rc = rf_registry_set_export_key(H.reg, big, kc->len);
}

Test(export, export_key_length_bounds)
{
    keycase kc[4] = {{31, 0}, {32, 0}, {1024, 0}, {1025, 0}};
    int i;

    open_registry(RF_SRC, 1, false);
    for (i = 0; i < 4; i++)
        test_loop_run(&H.l, call_key_len, &kc[i]);
    cr_assert_eq(kc[0].rc, -EINVAL);
    cr_assert_eq(kc[1].rc, 0);
    cr_assert_eq(kc[2].rc, 0);
    cr_assert_eq(kc[3].rc, -EINVAL);
}

Test(export, connect_failures_name_the_socket)
{
    char stale[160], longp[200];
    struct sockaddr_un sa = {0};
    int s;

    FETCH_FAILS("/nonexistent/pub.sock", KEY, sizeof(KEY), 5, -ENOENT,
                "is refit-publisherd running there, and may this user connect?");
    /* A socket file nobody listens on. */
    snprintf(stale, sizeof(stale), "%s/stale.sock", H.dir);
    s = socket(AF_UNIX, SOCK_STREAM, 0);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", stale);
    cr_assert_eq(bind(s, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(s);
    FETCH_FAILS(stale, KEY, sizeof(KEY), 5, -ECONNREFUSED, stale);
    unlink(stale);
    memset(longp, 'x', sizeof(longp) - 1);
    longp[sizeof(longp) - 1] = '\0';
    FETCH_FAILS(longp, KEY, sizeof(KEY), 5, -EINVAL, "longer than");
    FETCH_FAILS("", KEY, sizeof(KEY), 5, -EINVAL, "is empty");
}

Test(export, no_fd_leaks_in_the_client_or_the_registry)
{
    trainers T;
    rf_export *e;
    int base, i;

    open_registry(RF_SRC, 2, true);
    start_trainers(&T, true);
    base = count_fds();
    for (i = 0; i < 3; i++) {
        e = fetch_ok();
        /* While held: one fd per region, nothing else of the fetch. */
        wait_fds(base + 4);
        rf_export_free(e);
        wait_fds(base);
    }
    FETCH_FAILS(H.path, OTHER_KEY, sizeof(OTHER_KEY), 5, -EACCES, "wrong MAC");
    wait_fds(base);
    test_loop_run(&H.l, call_set_key, NULL);
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 5, -ENOKEY, "export is off");
    wait_fds(base);
    stop_trainers(&T);
}

/* ---- raw requests: what rf_export_fetch never sends ---- */

static int grab(void *ctx, const uint8_t *b, uint32_t len)
{
    *(Refit__Rpc__Response **)ctx = refit__rpc__response__unpack(NULL, len, b);
    return 0;
}

/* Sends q (with passfd) and reads one answer; NULL when the daemon closed first. */
static Refit__Rpc__Response *raw_call(int fd, Refit__Rpc__Request *q, int passfd)
{
    rf_wire_reader rd;
    Refit__Rpc__Response *out = NULL;
    uint8_t buf[4096];
    ssize_t n;

    rf_wire_reader_init(&rd, 0);
    cr_assert_eq(rf_rpc_send(fd, q, passfd, NULL), 0);
    while (out == NULL && (n = recv(fd, buf, sizeof(buf), 0)) > 0)
        cr_assert_eq(rf_wire_reader_feed(&rd, buf, (size_t)n, grab, &out), 0);
    rf_wire_reader_reset(&rd);
    return out;
}

static void expect(Refit__Rpc__Response *r, int code, const char *text)
{
    cr_assert_not_null(r, "no answer");
    cr_assert_eq(r->code, code, "code %d: %s", r->code, r->message);
    cr_assert(strstr(r->message, text), "'%s' lacks '%s'", r->message, text);
    refit__rpc__response__free_unpacked(r, NULL);
}

/* The daemon closed the connection: the next read ends. */
static void expect_closed(int fd)
{
    struct pollfd p = {fd, POLLIN, 0};
    uint8_t b;

    cr_assert_eq(poll(&p, 1, 5000), 1);
    cr_assert_eq(recv(fd, &b, 1, 0), 0);
}

static int raw_peer(int kind)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Hello h = REFIT__RPC__HELLO__INIT;
    int fd;

    cr_assert_eq(rf_rpc_dial(H.path, &fd, NULL), 0);
    h.protocol_version = RF_RPC_PROTOCOL_VERSION;
    h.kind = kind;
    h.rank = 5;
    q.id = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    q.hello = &h;
    expect(raw_call(fd, &q, -1), 0, "welcome");
    return fd;
}

/* ExportHello: the server nonce in ns. */
static void raw_export_hello(int fd, uint8_t *ns)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__ExportHello eh = REFIT__RPC__EXPORT_HELLO__INIT;
    Refit__Rpc__Response *r;

    q.id = 2;
    q.body_case = REFIT__RPC__REQUEST__BODY_EXPORT_HELLO;
    q.export_hello = &eh;
    r = raw_call(fd, &q, -1);
    cr_assert_not_null(r);
    cr_assert_eq(r->code, 0, "%s", r->message);
    cr_assert_eq(r->nonce.len, RF_EXPORT_NONCE_BYTES);
    memcpy(ns, r->nonce.data, RF_EXPORT_NONCE_BYTES);
    refit__rpc__response__free_unpacked(r, NULL);
}

/* Export with the given nonce and mac lengths, the mac computed with key over ns and a fresh
 * client nonce, and chan as its back channel (-1: none). */
static Refit__Rpc__Response *raw_export(int fd, const uint8_t *ns, const uint8_t *key,
                                        size_t nonce_len, size_t mac_len, int chan)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Export ex = REFIT__RPC__EXPORT__INIT;
    uint8_t nc[RF_EXPORT_NONCE_BYTES + 1], mac[RF_EXPORT_MAC_BYTES + 1] = {0};

    randombytes_buf(nc, sizeof(nc));
    rf_export_mac(key, sizeof(KEY), ns, nc, mac);
    ex.nonce.data = nc;
    ex.nonce.len = nonce_len;
    ex.mac.data = mac;
    ex.mac.len = mac_len;
    ex.pieces = ALLP;
    ex.n_pieces = all_n;
    q.id = 3;
    q.body_case = REFIT__RPC__REQUEST__BODY_EXPORT_REQUEST;
    q.export_request = &ex;
    return raw_call(fd, &q, chan);
}

static void seqpacket(int *sv)
{
    cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
}

Test(export, raw_protocol_refusals)
{
    uint8_t ns[RF_EXPORT_NONCE_BYTES], zero[RF_EXPORT_NONCE_BYTES] = {0};
    Refit__Rpc__Response *r;
    trainers T;
    int fd, sv[2], st[2];

    open_registry(RF_SRC, 2, true);
    start_trainers(&T, true);

    /* Export before any ExportHello: no nonce to prove anything on. */
    fd = raw_peer(REFIT__RPC__CLIENT_KIND__CLIENT_PEER);
    seqpacket(sv);
    expect(raw_export(fd, zero, KEY, 32, 32, sv[1]), -EPROTO, "send ExportHello first");
    /* A nonce serves one Export: the second with the same proof is refused. */
    raw_export_hello(fd, ns);
    r = raw_export(fd, ns, KEY, 32, 32, sv[1]);
    cr_assert_not_null(r);
    cr_assert_eq(r->code, 0, "%s", r->message);
    cr_assert_eq(r->n_regions, 4);
    refit__rpc__response__free_unpacked(r, NULL);
    expect(raw_export(fd, ns, KEY, 32, 32, sv[1]), -EPROTO, "each nonce serves one Export");
    close(sv[0]);
    close(sv[1]);
    /* No back channel, or one of the wrong type: refused, connection closed. */
    raw_export_hello(fd, ns);
    expect(raw_export(fd, ns, KEY, 32, 32, -1), -EINVAL, "Export without its back channel");
    expect_closed(fd);
    close(fd);
    fd = raw_peer(REFIT__RPC__CLIENT_KIND__CLIENT_PEER);
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, st), 0);
    raw_export_hello(fd, ns);
    expect(raw_export(fd, ns, KEY, 32, 32, st[1]), -EINVAL, "SOCK_SEQPACKET");
    expect_closed(fd);
    close(fd);
    close(st[0]);
    close(st[1]);
    /* A back channel whose other end is gone: the fds cannot be passed. */
    fd = raw_peer(REFIT__RPC__CLIENT_KIND__CLIENT_PEER);
    seqpacket(sv);
    close(sv[0]);
    raw_export_hello(fd, ns);
    expect(raw_export(fd, ns, KEY, 32, 32, sv[1]), -EPIPE, "the other end closed it");
    close(sv[1]);
    /* Wrong lengths: refused and closed, and the nonce is spent. */
    seqpacket(sv);
    raw_export_hello(fd, ns);
    expect(raw_export(fd, ns, KEY, 16, 32, sv[1]), -EINVAL, "a 16-byte nonce and a 32-byte mac");
    expect_closed(fd);
    close(fd);
    fd = raw_peer(REFIT__RPC__CLIENT_KIND__CLIENT_PEER);
    raw_export_hello(fd, ns);
    expect(raw_export(fd, ns, KEY, 32, 33, sv[1]), -EINVAL, "a 32-byte nonce and a 33-byte mac");
    expect_closed(fd);
    close(fd);
    /* A wrong MAC spends the nonce too, and closes the connection. */
    fd = raw_peer(REFIT__RPC__CLIENT_KIND__CLIENT_PEER);
    raw_export_hello(fd, ns);
    expect(raw_export(fd, ns, OTHER_KEY, 32, 32, sv[1]), -EACCES, "closing the connection");
    expect_closed(fd);
    close(fd);
    close(sv[0]);
    close(sv[1]);
    /* Export is for peers only. */
    fd = raw_peer(REFIT__RPC__CLIENT_KIND__CLIENT_CTL);
    seqpacket(sv);
    {
        Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
        Refit__Rpc__ExportHello eh = REFIT__RPC__EXPORT_HELLO__INIT;

        q.id = 9;
        q.body_case = REFIT__RPC__REQUEST__BODY_EXPORT_HELLO;
        q.export_hello = &eh;
        expect(raw_call(fd, &q, -1), -EPERM, "ExportHello is for peer clients");
    }
    expect(raw_export(fd, zero, KEY, 32, 32, sv[1]), -EPERM, "Export is for peer clients");
    close(fd);
    /* Peers register nothing and do not count as trainers. */
    fd = raw_peer(REFIT__RPC__CLIENT_KIND__CLIENT_PEER);
    {
        Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
        Refit__Rpc__Seal seal = REFIT__RPC__SEAL__INIT;

        q.id = 10;
        q.body_case = REFIT__RPC__REQUEST__BODY_SEAL;
        q.seal = &seal;
        expect(raw_call(fd, &q, -1), -EPERM, "is for trainer and engine clients, not peer");
    }
    close(fd);
    close(sv[0]);
    close(sv[1]);
    stop_trainers(&T);
}

/* ---- a hand-written publisherd that answers wrongly, for the client's own checks ---- */

typedef enum fake_mode {
    FK_SILENT,      /* accepts, reads, never answers */
    FK_CLOSE,       /* reads Hello and closes */
    FK_GARBAGE,     /* answers Hello with bytes that are no Response */
    FK_HUGE,        /* announces a 4 GiB answer */
    FK_WRONG_ID,    /* answers Hello with another id */
    FK_SHORT_NONCE, /* a 16-byte nonce */
    FK_BAD_INV,     /* inventory bytes that are no Inventory */
    FK_COUNT,       /* 2 regions listed, 1 in the inventory */
    FK_KIND,        /* a CUDA IPC region with has_fd */
    FK_MERGE,       /* a piece naming a tensor that is not there */
    FK_FEWER,       /* 2 fd regions, 1 fd passed, channel closed */
    FK_MORE,        /* 1 fd region, 2 fds passed */
    FK_HOLD,        /* 2 fd regions, 1 fd passed, channel kept open */
    FK_CHUNKS,      /* 1 VMM region over 3 allocations, 3 fds passed: fine */
    FK_CHUNK_GAP,   /* its chunks not back to back */
    FK_CHUNK_KIND,  /* a memfd region with chunks */
    FK_CHUNK_FEWER, /* 3 chunks, 2 fds passed, channel closed */
} fake_mode;

typedef struct fake {
    fake_mode mode;
    int lfd;
    char path[160];
    pthread_t th;
} fake;

static void fake_send(int fd, const Refit__Rpc__Response *r)
{
    uint8_t *buf = NULL;
    size_t len = 0;

    cr_assert_eq(rf_wire_pack(&r->base, &buf, &len), 0);
    cr_assert_eq(send(fd, buf, len, MSG_NOSIGNAL), (ssize_t)len);
    free(buf);
}

/* Reads one request (and the fd sent with it, if any); NULL at the client's close. */
static Refit__Rpc__Request *fake_read(int fd, int *passed)
{
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int))];
    } ctl;
    uint8_t hdr[4], *body;
    struct iovec iov = {hdr, 4};
    struct msghdr mh = {0};
    struct cmsghdr *cm;
    Refit__Rpc__Request *q;
    uint32_t len;
    ssize_t n;

    *passed = -1;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.space;
    mh.msg_controllen = sizeof(ctl.space);
    n = recvmsg(fd, &mh, MSG_WAITALL);
    if (n != 4)
        return NULL;
    for (cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm))
        if (cm->cmsg_type == SCM_RIGHTS)
            memcpy(passed, CMSG_DATA(cm), sizeof(int));
    len = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
    body = malloc(len + 1);
    if (recv(fd, body, len, MSG_WAITALL) != (ssize_t)len) {
        free(body);
        return NULL;
    }
    q = refit__rpc__request__unpack(NULL, len, body);
    free(body);
    return q;
}

/* Passes n fresh memfds, the i-th (i + 1) * 4096 bytes long (so their order shows). */
static void pass_fds(int chan, int n)
{
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(4 * sizeof(int))];
    } ctl;
    int fds[4];
    uint8_t byte = (uint8_t)n;
    struct iovec iov = {&byte, 1};
    struct msghdr mh = {0};
    struct cmsghdr *cm;
    int i;

    for (i = 0; i < n; i++) {
        fds[i] = memfd_create("fake", MFD_CLOEXEC);
        cr_assert_eq(ftruncate(fds[i], (off_t)(i + 1) * 4096), 0);
    }
    memset(&ctl, 0, sizeof(ctl));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.space;
    mh.msg_controllen = CMSG_SPACE(n * sizeof(int));
    cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(n * sizeof(int));
    memcpy(CMSG_DATA(cm), fds, n * sizeof(int));
    sendmsg(chan, &mh, MSG_NOSIGNAL);
    for (i = 0; i < n; i++)
        close(fds[i]);
}

/* The Export answer of the mode: an inventory of "w" [4] fp32 in nreg regions. */
static void fake_export(const fake *f, int fd, uint64_t id, int chan)
{
    Refit__Rpc__Response r = REFIT__RPC__RESPONSE__INIT;
    Refit__Inventory inv = REFIT__INVENTORY__INIT;
    Refit__TensorDesc t = REFIT__TENSOR_DESC__INIT, *tp = &t;
    Refit__EndpointDesc ep = REFIT__ENDPOINT_DESC__INIT, *epp = &ep;
    Refit__RegionDesc rg[2] = {REFIT__REGION_DESC__INIT, REFIT__REGION_DESC__INIT};
    Refit__RegionDesc *rgp[2] = {&rg[0], &rg[1]};
    Refit__PieceDesc pc = REFIT__PIECE_DESC__INIT, *pcp = &pc;
    Refit__Rpc__ExportRegion er[2] = {REFIT__RPC__EXPORT_REGION__INIT,
                                      REFIT__RPC__EXPORT_REGION__INIT};
    Refit__Rpc__ExportRegion *erp[2] = {&er[0], &er[1]};
    int64_t shape[1] = {4}, start[1] = {0}, ext[1] = {4}, strides[1] = {1};
    uint8_t junk[2] = {0xff, 0xff}, packed[512];
    bool two = f->mode == FK_FEWER || f->mode == FK_HOLD;
    bool chunked = f->mode == FK_CHUNKS || f->mode == FK_CHUNK_GAP ||
                   f->mode == FK_CHUNK_KIND || f->mode == FK_CHUNK_FEWER;
    Refit__Rpc__VmmChunk ch[3], *chp[3];
    size_t i;
    int nfds = f->mode == FK_MORE ? 2 : 1;

    t.name = "w";
    t.dtype = REFIT_FP32;
    t.n_shape = 1;
    t.shape = shape;
    ep.device = "host";
    pc.tensor = f->mode == FK_MERGE ? 3 : 0;
    pc.n_start = pc.n_extent = pc.n_strides = 1;
    pc.start = start;
    pc.extent = ext;
    pc.strides = strides;
    for (i = 0; i < 2; i++) {
        rg[i].local_id = (uint32_t)i;
        rg[i].size = 16;
        er[i].kind = f->mode == FK_KIND ? REFIT__RPC__MEM_KIND__MEM_CUDA_IPC
                                        : REFIT__RPC__MEM_KIND__MEM_MEMFD;
        er[i].device = "host";
        er[i].size = 16;
        er[i].has_fd = true;
    }
    if (chunked) {
        for (i = 0; i < 3; i++) {
            refit__rpc__vmm_chunk__init(&ch[i]);
            ch[i].size = 2u << 20;
            ch[i].offset = (f->mode == FK_CHUNK_GAP && i == 2 ? 5 : i) * (2u << 20);
            chp[i] = &ch[i];
        }
        er[0].kind = f->mode == FK_CHUNK_KIND ? REFIT__RPC__MEM_KIND__MEM_MEMFD
                                               : REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD;
        er[0].device = f->mode == FK_CHUNK_KIND ? "host" : "GPU-0b5c";
        er[0].offset = 4096;
        er[0].n_chunks = 3;
        er[0].chunks = chp;
        nfds = f->mode == FK_CHUNK_FEWER ? 2 : 3;
    }
    inv.n_tensors = 1;
    inv.tensors = &tp;
    inv.n_endpoints = 1;
    inv.endpoints = &epp;
    inv.n_regions = two ? 2 : 1;
    inv.regions = rgp;
    inv.n_pieces = 1;
    inv.pieces = &pcp;
    r.id = id;
    r.n_regions = two || f->mode == FK_COUNT ? 2 : 1;
    r.regions = erp;
    if (f->mode == FK_BAD_INV) {
        r.inventory.data = junk;
        r.inventory.len = sizeof(junk);
    } else {
        r.inventory.len = refit__inventory__pack(&inv, packed);
        r.inventory.data = packed;
    }
    /* One fd a region, but for the modes about the fds. */
    pass_fds(chan, nfds);
    fake_send(fd, &r);
}

static void *fake_main(void *arg)
{
    fake *f = arg;
    Refit__Rpc__Request *q;
    int fd, passed, chan = -1;

    fd = accept(f->lfd, NULL, NULL);
    if (fd < 0)
        return NULL;
    while ((q = fake_read(fd, &passed)) != NULL) {
        Refit__Rpc__Response r = REFIT__RPC__RESPONSE__INIT;
        uint8_t nonce[RF_EXPORT_NONCE_BYTES] = {0};

        if (passed >= 0)
            chan = passed;
        r.id = q->id;
        if (f->mode == FK_CLOSE) {
            refit__rpc__request__free_unpacked(q, NULL);
            break;
        } else if (f->mode == FK_SILENT) {
            /* nothing */
        } else if (q->body_case == REFIT__RPC__REQUEST__BODY_HELLO && f->mode == FK_GARBAGE) {
            static const uint8_t junk[] = {0, 0, 0, 2, 0xff, 0xff};

            send(fd, junk, sizeof(junk), MSG_NOSIGNAL);
        } else if (q->body_case == REFIT__RPC__REQUEST__BODY_HELLO && f->mode == FK_HUGE) {
            static const uint8_t huge[] = {0xff, 0xff, 0xff, 0xff};

            send(fd, huge, sizeof(huge), MSG_NOSIGNAL);
        } else if (q->body_case == REFIT__RPC__REQUEST__BODY_HELLO) {
            r.id = f->mode == FK_WRONG_ID ? q->id + 7 : q->id;
            fake_send(fd, &r);
        } else if (q->body_case == REFIT__RPC__REQUEST__BODY_EXPORT_HELLO) {
            r.nonce.data = nonce;
            r.nonce.len = f->mode == FK_SHORT_NONCE ? 16 : sizeof(nonce);
            fake_send(fd, &r);
        } else if (q->body_case == REFIT__RPC__REQUEST__BODY_EXPORT_REQUEST) {
            fake_export(f, fd, q->id, chan);
            if (f->mode != FK_HOLD) {
                close(chan);
                chan = -1;
            }
        }
        refit__rpc__request__free_unpacked(q, NULL);
    }
    if (chan >= 0)
        close(chan);
    close(fd);
    return NULL;
}

static void fake_start(fake *f, fake_mode mode)
{
    struct sockaddr_un sa = {0};

    f->mode = mode;
    snprintf(f->path, sizeof(f->path), "%s/fake.sock", H.dir);
    f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
    cr_assert_eq(bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(listen(f->lfd, 4), 0);
    pthread_create(&f->th, NULL, fake_main, f);
}

static void fake_stop(fake *f)
{
    pthread_join(f->th, NULL);
    close(f->lfd);
    unlink(f->path);
}

/* Text inline: Criterion may run the test in a fresh process, where pointers would dangle. */
typedef struct fake_case {
    fake_mode mode;
    int code;
    char text[80];
} fake_case;

ParameterizedTestParameters(export, client_checks_what_it_is_answered)
{
    static fake_case cases[] = {
        {FK_CLOSE, -ECONNRESET, "closed the connection before answering Hello"},
        {FK_GARBAGE, -EBADMSG, "malformed answer to Hello"},
        {FK_HUGE, -EBADMSG, "announces 4294967295 bytes"},
        {FK_WRONG_ID, -EBADMSG, "the answer to Hello (id 1) carries id 8"},
        {FK_SHORT_NONCE, -EBADMSG, "ExportHello answered with a 16-byte nonce"},
        {FK_BAD_INV, -EBADMSG, "does not decode as refit.Inventory"},
        {FK_COUNT, -EBADMSG, "the answer lists 2 regions, its inventory 1"},
        {FK_KIND, -EBADMSG, "region 0 has memory kind 2"},
        {FK_MERGE, -EINVAL, "the exported inventory is not valid"},
        {FK_FEWER, -EPROTO, "passed 1 fds, fewer than the 2 its regions take"},
        {FK_MORE, -EBADMSG, "passed more than the 1 fds its regions take"},
        {FK_CHUNK_GAP, -EBADMSG, "at offset 10485760, not the next one back to back (4194304)"},
        {FK_CHUNK_KIND, -EBADMSG, "region 0 of kind 1 lists 3 chunks"},
        {FK_CHUNK_FEWER, -EPROTO, "passed 2 fds, fewer than the 3 its regions take"},
        {FK_HOLD, -ETIMEDOUT, "no answer to Export (its region fds) within 0.3 s"},
    };

    return cr_make_param_array(fake_case, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(fake_case *c, export, client_checks_what_it_is_answered)
{
    fake f;
    int base = count_fds();

    fake_start(&f, c->mode);
    FETCH_FAILS(f.path, KEY, sizeof(KEY), c->mode == FK_HOLD ? 0.3 : 5, c->code, c->text);
    fake_stop(&f);
    wait_fds(base);
}

/* A VMM region over three allocations comes as one region with its chunks, each with its own
 * fd in order (no single fd), and freeing the export closes them. */
Test(export, a_region_over_several_allocations_comes_with_its_chunk_fds)
{
    const rf_mem_desc *d;
    rf_export *e = NULL;
    rf_err err = {0};
    struct stat st;
    int base = count_fds(), rc;
    fake f;

    fake_start(&f, FK_CHUNKS);
    rc = rf_export_fetch(f.path, KEY, sizeof(KEY), ALLP, 1, 5, &e, &err);
    cr_assert_eq(rc, 0, "%s", err.msg);
    fake_stop(&f);
    cr_assert_eq(e->nregions, 1);
    d = &e->regions[0];
    cr_assert_eq(d->kind, RF_MEM_CUDA_VMM_FD);
    cr_assert_str_eq(d->device, "GPU-0b5c");
    cr_assert_eq(d->offset, 4096);
    cr_assert_eq(d->fd, -1, "a chunked region has no fd of its own");
    cr_assert_eq(d->nchunks, 3);
    for (size_t i = 0; i < 3; i++) {
        cr_assert_eq(d->chunks[i].size, 2u << 20);
        cr_assert_eq(fstat(d->chunks[i].fd, &st), 0);
        cr_assert_eq(st.st_size, (off_t)(i + 1) * 4096, "chunk %zu got fd of %lld bytes", i,
                     (long long)st.st_size);
    }
    cr_assert_eq(count_fds(), base + 3);
    /* Once mapped, a receiverd lets the fds go and keeps the rest of the descriptor. */
    rf_export_close_fds(e, 0);
    cr_assert_eq(count_fds(), base);
    cr_assert_eq(d->chunks[2].fd, -1);
    cr_assert_eq(d->chunks[2].size, 2u << 20);
    rf_export_close_fds(e, 0);
    rf_export_free(e);
    wait_fds(base);
}

Test(export, times_out_on_a_silent_server)
{
    struct timespec t0, t1;
    fake f;
    double s;

    fake_start(&f, FK_SILENT);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    FETCH_FAILS(f.path, KEY, sizeof(KEY), 0.3, -ETIMEDOUT,
                "no answer to Hello within 0.3 s: is refit-publisherd there hung");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    cr_assert(s >= 0.3 && s < 2.0, "took %.3f s", s);
    fake_stop(&f);
}

/* An answer larger than the RPC layer lets a client queue is refused with the reason, not cut
 * off silently: ~61k tensors with the longest names make an inventory over 16 MiB. */
Test(export, an_inventory_too_large_for_one_answer_is_refused_by_name, .timeout = 120)
{
    const int64_t sh[1] = {1}, st[1] = {0}, ex[1] = {1};
    char name[RF_NAME_MAX];
    refit_client *t;
    uint32_t r, i, n = (RF_RPC_MAX_OUTPUT / (RF_NAME_MAX - 1)) + 512;
    void *m;

    open_registry(RF_SRC, 1, true);
    t = trainer("t0", 0);
    OK(refit_alloc_host(t, 4096, &m, &r), t);
    memset(name, 'n', sizeof(name) - 1);
    name[sizeof(name) - 1] = '\0';
    for (i = 0; i < n; i++) {
        snprintf(name, 12, "%010u", i);
        name[10] = 'n';
        OK(refit_add_piece(t, name, REFIT_FP32, 1, sh, r, 0, st, ex, NULL), t);
    }
    OK(refit_seal(t), t);
    wait_inventory(1);
    FETCH_FAILS(H.path, KEY, sizeof(KEY), 30, -EMSGSIZE,
                "more than the 16777216 bytes of an RPC answer");
    refit_close(t);
}

/* More fds than one packet carries: they come in region order over several packets. */
Test(export, many_regions_come_in_order)
{
    const int64_t sh[1] = {16}, st[1] = {0}, ex[1] = {16};
    const uint32_t n = 3 * RF_EXPORT_FDS_PER_PACKET + 7;
    refit_client *t;
    uint8_t *mem;
    uint32_t i, r;
    rf_export *e;
    char name[32];
    int fd, base;

    open_registry(RF_SRC, 1, true);
    t = trainer("t0", 0);
    fd = memfd_create("many", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_eq(ftruncate(fd, (off_t)n * 64), 0);
    mem = mmap(NULL, (size_t)n * 64, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq(mem, MAP_FAILED);
    for (i = 0; i < n; i++) {
        memset(mem + (size_t)i * 64, (int)(i * 37 % 251), 64);
        OK(refit_region_memfd_at(t, fd, (uint64_t)i * 64, 64, &r), t);
        snprintf(name, sizeof(name), "t%u", i);
        OK(refit_add_piece(t, name, REFIT_UINT8, 1, sh, r, 0, st, ex, NULL), t);
    }
    OK(refit_seal(t), t);
    wait_inventory(1);
    base = count_fds();
    all_n = n;
    e = fetch_ok();
    cr_assert_eq(e->nregions, n);
    for (i = 0; i < n; i++) {
        const rf_mem_desc *d = &e->regions[i];
        uint8_t b;

        cr_assert_eq(d->offset, (uint64_t)i * 64);
        cr_assert_eq(pread(d->fd, &b, 1, (off_t)d->offset + 63), 1);
        cr_assert_eq(b, i * 37 % 251, "region %u reads %u", i, b);
    }
    rf_export_free(e);
    wait_fds(base);
    /* A receiverd whose open-file limit is below the region count hears what to raise, and
     * holds nothing afterwards. */
    {
        struct rlimit old, low;

        cr_assert_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
        low = old;
        low.rlim_cur = (rlim_t)base + 100;
        cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
        FETCH_FAILS(H.path, KEY, sizeof(KEY), 5, -EMFILE, "raise LimitNOFILE");
        cr_assert_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
        wait_fds(base);
    }
    munmap(mem, (size_t)n * 64);
    close(fd);
    refit_close(t);
}
