/* tests/unit/test_registry.c - the daemon-side registry driven on a loop thread while librefit
 * calls it from the test's thread: real sockets, real memfds, every refusal checked. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "export.h"
#include "mem.h"
#include "mem_cuda.h"
#include "refit.h"
#include "loop_thread.h"
#include "registry.h"
#include "rpc.h"
#include "wire.h"

typedef struct harness {
    test_loop l;
    uv_timer_t timer;
    rf_registry *reg;
    char dir[64], path[128];
    /* recorded by callbacks */
    int n_inventory, n_change, n_ready, n_refit, n_consumed;
    uint64_t ready, refit, timer_version, consumed;
    int timer_kind; /* 0 abort, RF_REG_* notify */
    bool refuse_refit, refuse_wait;
} harness;

static harness H;


static void cb_inventory(rf_registry *r, void *ud) { (void)r; (void)ud; test_loop_bump(&H.l, &H.n_inventory); }
static void cb_change(rf_registry *r, void *ud) { (void)r; (void)ud; test_loop_bump(&H.l, &H.n_change); }

static void cb_consumed(rf_registry *r, uint64_t v, void *ud)
{
    (void)r;
    (void)ud;
    H.consumed = v;
    test_loop_bump(&H.l, &H.n_consumed);
}

static void cb_ready(rf_registry *r, uint64_t v, void *ud)
{
    (void)r;
    (void)ud;
    H.ready = v;
    test_loop_bump(&H.l, &H.n_ready);
}

static int cb_status(rf_registry *r, char **json, rf_err *err, void *ud)
{
    json_t *j = rf_registry_status(r);

    (void)ud;
    if (j == NULL)
        return rf_err_set(err, -ENOMEM, "no status");
    *json = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return 0;
}

static int cb_refit(rf_registry *r, uint64_t v, rf_err *err, void *ud)
{
    (void)r;
    (void)ud;
    if (H.refuse_refit)
        return rf_err_set(err, -EBUSY, "a refit is already running");
    H.refit = v;
    test_loop_bump(&H.l, &H.n_refit);
    return 0;
}

static int cb_wait(rf_registry *r, uint64_t v, rf_err *err, void *ud)
{
    (void)r;
    (void)ud;
    if (H.refuse_wait)
        return rf_err_set(err, -EINVAL, "version %llu was never triggered",
                          (unsigned long long)v);
    return 0;
}





static void open_registry(rf_side side, unsigned expected)
{
    static const rf_registry_cb cb = {cb_inventory, cb_change, cb_ready, cb_status, cb_refit,
                                      cb_wait, cb_consumed, NULL, NULL, NULL};
    rf_registry_opts o = {0};
    rf_err err = {0};

    o.socket_path = H.path;
    o.side = side;
    o.expected_clients = expected;
    cr_assert_eq(rf_registry_open(&H.l.loop, &o, &cb, NULL, &H.reg, &err), 0, "%s", err.msg);
    test_loop_start(&H.l);
}

static void setup(void)
{
    memset(&H, 0, sizeof(H));
    test_loop_init(&H.l);
    snprintf(H.dir, sizeof(H.dir), "/tmp/rf_reg_XXXXXX");
    cr_assert(mkdtemp(H.dir));
    snprintf(H.path, sizeof(H.path), "%s/d.sock", H.dir);
    uv_timer_init(&H.l.loop, &H.timer);
}

static void close_all(void *arg)
{
    (void)arg;
    rf_registry_close(H.reg);
    H.reg = NULL;
    uv_close((uv_handle_t *)&H.timer, NULL);
}

static void teardown(void)
{
    test_loop_stop(&H.l, close_all, NULL);
    rmdir(H.dir);
}

TestSuite(registry, .init = setup, .fini = teardown);

static refit_client *conn(const char *name, int rank, int kind)
{
    refit_client *c = NULL;
    int rc = refit_connect(H.path, name, rank, kind, &c);

    cr_assert_eq(rc, 0, "connect %s: %s", name, refit_last_error(NULL));
    return c;
}

#define OK(call, c) cr_assert_eq((call), 0, "%s: %s", #call, refit_last_error(c))
#define FAILS(call, c, code, text)                                                        \
    do {                                                                                  \
        int rc_ = (call);                                                                 \
        cr_assert_eq(rc_, (code), "%s returned %d: %s", #call, rc_, refit_last_error(c)); \
        cr_assert(strstr(refit_last_error(c), (text)), "%s: message '%s' lacks '%s'",     \
                  #call, refit_last_error(c), (text));                                    \
    } while (0)

/* Things read on the loop thread. */
typedef struct probe {
    uint32_t ntensors, nregions, npieces, nendpoints;
    uint64_t generation;
    bool complete;
    const char *ep0;
    uint32_t region;
    uint8_t fill;
    size_t len;
} probe;

static void do_probe(void *arg)
{
    probe *p = arg;
    const rf_inv *inv = rf_registry_inv(H.reg);

    p->ntensors = rf_inv_ntensors(inv);
    p->nregions = rf_inv_nregions(inv);
    p->nendpoints = rf_inv_nendpoints(inv);
    p->npieces = rf_inv_npieces(inv, RF_SRC) + rf_inv_npieces(inv, RF_DST);
    p->generation = rf_registry_generation(H.reg);
    p->complete = rf_registry_complete(H.reg);
    p->ep0 = p->nendpoints ? rf_registry_endpoint_device(H.reg, 0) : NULL;
    if (p->len) {
        cr_assert_eq(rf_registry_region_kind(H.reg, p->region), RF_MEM_MEMFD);
        memset(rf_registry_region_base(H.reg, p->region), p->fill, p->len);
    }
}

static probe get_probe(void)
{
    probe p = {0};

    test_loop_run(&H.l, do_probe, &p);
    return p;
}

static const int64_t shape2[2] = {4, 8};

/* Registers tensor "w" [4, 8] fp32 split in two row halves from two regions. */
static void register_halves(refit_client *c, float **mem)
{
    const int64_t s0[2] = {0, 0}, s1[2] = {2, 0}, ext[2] = {2, 8};
    void *a, *b;
    uint32_t ra, rb;

    OK(refit_alloc_host(c, 64, &a, &ra), c);
    OK(refit_alloc_host(c, 64, &b, &rb), c);
    OK(refit_add_piece(c, "w", REFIT_FP32, 2, shape2, ra, 0, s0, ext, NULL), c);
    OK(refit_add_piece(c, "w", REFIT_FP32, 2, shape2, rb, 0, s1, ext, NULL), c);
    if (mem) {
        mem[0] = a;
        mem[1] = b;
    }
}

static void call_release(void *arg) { rf_registry_release(H.reg, *(uint64_t *)arg); }
static void call_abort(void *arg) { rf_registry_abort(H.reg, *(uint64_t *)arg, "test abort"); }
static void get_ready(void *arg) { *(uint64_t *)arg = rf_registry_ready(H.reg); }

/* The registry's readiness now: requests answered before this call have been handled. */
static uint64_t ready_now(void)
{
    uint64_t v = 0;

    test_loop_run(&H.l, get_ready, &v);
    return v;
}

/* What the coordinator's Blocked says in the tests (timer kind TIMER_BLOCK). */
#define BLOCK_REASON "the coordinator cannot plan: tensor w registered as fp32 [4, 8] and " \
                     "again as fp16 [4, 8]"
#define TIMER_BLOCK (-1)
static uint64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}
static void call_block(void *arg) { rf_registry_block(H.reg, arg); }
static void timer_cb(uv_timer_t *t)
{
    (void)t;
    if (H.timer_kind == TIMER_BLOCK)
        rf_registry_block(H.reg, BLOCK_REASON);
    else if (H.timer_kind == 0)
        rf_registry_abort(H.reg, H.timer_version, "receiver 3 timed out");
    else
        rf_registry_notify(H.reg, (rf_reg_event)H.timer_kind, H.timer_version,
                           "receiver 3 timed out");
}

/* Schedules an abort (kind 0) or notify on the loop 100 ms from now, so that the test's
 * thread is blocked in a wait when it comes. */
typedef struct later { int kind; uint64_t version; } later;
static void do_later(void *arg)
{
    later *l = arg;

    H.timer_kind = l->kind;
    H.timer_version = l->version;
    uv_timer_start(&H.timer, timer_cb, 100, 0);
}
static void schedule(int kind, uint64_t version)
{
    later l = {kind, version};

    test_loop_run(&H.l, do_later, &l);
}

Test(registry, trainers_register_publish_and_are_released)
{
    refit_client *t0, *t1;
    float *mem[2];
    uint64_t v = 1;
    probe p;

    open_registry(RF_SRC, 2);
    t0 = conn("t0", 0, REFIT_TRAINER);
    t1 = conn("t1", 1, REFIT_TRAINER);
    register_halves(t0, mem);
    {
        const int64_t st[1] = {0}, ext[1] = {3};
        const int64_t sh[1] = {3};
        void *m;
        uint32_t r;

        OK(refit_alloc_host(t1, 12, &m, &r), t1);
        OK(refit_add_piece(t1, "b", REFIT_FP32, 1, sh, r, 0, st, ext, NULL), t1);
    }
    OK(refit_seal(t0), t0);
    p = get_probe();
    cr_assert_eq(p.complete, false);
    cr_assert_eq(H.n_inventory, 0);
    OK(refit_seal(t1), t1);
    test_loop_wait(&H.l, &H.n_inventory, 1);
    p = get_probe();
    cr_assert(p.complete);
    cr_assert_eq(p.ntensors, 2);
    cr_assert_eq(p.nregions, 3);
    cr_assert_eq(p.npieces, 3);
    cr_assert_eq(p.nendpoints, 1, "one host endpoint per daemon");
    cr_assert_str_eq(p.ep0, "host");
    /* The daemon's mapping is the trainer's memory. */
    p.region = 1;
    p.len = 64;
    p.fill = 0x3f;
    test_loop_run(&H.l, do_probe, &p);
    cr_assert_eq(((uint8_t *)mem[1])[63], 0x3f);
    cr_assert_eq(((uint8_t *)mem[0])[0], 0);

    OK(refit_publish(t0, 1), t0);
    cr_assert_eq(ready_now(), 0, "ready only when every trainer published");
    cr_assert_eq(H.n_ready, 0);
    OK(refit_publish(t1, 1), t1);
    test_loop_wait(&H.l, &H.n_ready, 1);
    cr_assert_eq(H.ready, 1);
    FAILS(refit_wait_released(t0, 1, 50), t0, -ETIMEDOUT, "version 1 was not released within 50 ms");
    test_loop_run(&H.l, call_release, &v);
    OK(refit_wait_released(t0, 1, 2000), t0);
    OK(refit_wait_released(t1, 1, 2000), t1);
    /* The release takes the offer back: readiness reported as 0. */
    test_loop_wait(&H.l, &H.n_ready, 2);
    cr_assert_eq(H.ready, 0);
    FAILS(refit_publish(t0, 1), t0, -ERANGE, "must be newer than the committed version 1");

    /* Version 2 aborts while t0 waits: the error names the reason, readiness goes to 0, and
     * only when every trainer published 2 again is it ready again. */
    OK(refit_publish(t0, 2), t0);
    OK(refit_publish(t1, 2), t1);
    test_loop_wait(&H.l, &H.n_ready, 3);
    cr_assert_eq(H.ready, 2);
    schedule(0, 2);
    FAILS(refit_wait_released(t0, 2, 5000), t0, -ECANCELED,
          "refit of version 2 aborted: receiver 3 timed out");
    cr_assert_eq(ready_now(), 0);
    OK(refit_publish(t0, 2), t0);
    cr_assert_eq(ready_now(), 0, "t1 has not published 2 again");
    OK(refit_publish(t1, 2), t1);
    cr_assert_eq(ready_now(), 2);
    cr_assert_eq(H.n_ready, 5, "2, then 0 at the abort, then 2 again");
    refit_close(t0);
    refit_close(t1);
}

/* Readiness belongs to the clients that published it: a trainer leaving takes it away, its
 * successor publishes nothing until it publishes, and trainers offering different versions
 * are not ready (the memory holds two versions). */
Test(registry, readiness_dies_with_its_clients)
{
    refit_client *t0, *t1;
    uint64_t v = 2;

    open_registry(RF_SRC, 2);
    t0 = conn("t0", 0, REFIT_TRAINER);
    t1 = conn("t1", 1, REFIT_TRAINER);
    register_halves(t0, NULL);
    register_halves(t1, NULL);
    OK(refit_seal(t0), t0);
    OK(refit_seal(t1), t1);
    OK(refit_publish(t0, 2), t0);
    OK(refit_publish(t1, 2), t1);
    cr_assert_eq(ready_now(), 2);

    refit_close(t1);
    test_loop_wait(&H.l, &H.n_change, 1);
    cr_assert_eq(ready_now(), 0, "a trainer left: its publish is gone");
    cr_assert_eq(H.ready, 0);
    t1 = conn("t1b", 1, REFIT_TRAINER);
    register_halves(t1, NULL);
    OK(refit_seal(t1), t1);
    cr_assert_eq(ready_now(), 0, "the new trainer has published nothing");
    OK(refit_publish(t1, 50), t1);
    cr_assert_eq(ready_now(), 0, "t0 offers 2, t1 offers 50: never version 2 from t1's memory");
    OK(refit_publish(t0, 50), t0);
    cr_assert_eq(ready_now(), 50);
    /* A trainer moving on alone makes the daemon not ready again. */
    OK(refit_publish(t0, 51), t0);
    cr_assert_eq(ready_now(), 0);
    /* An abort of an older version does not take back a newer offer. */
    test_loop_run(&H.l, call_abort, &v);
    OK(refit_publish(t1, 51), t1);
    cr_assert_eq(ready_now(), 51);
    /* A wait that comes after the abort of its version fails at once with the reason (it
     * would otherwise wait out its timeout: no abort comes again). */
    v = 51;
    test_loop_run(&H.l, call_abort, &v);
    FAILS(refit_wait_released(t0, 51, 5000), t0, -ECANCELED,
          "refit of version 51 aborted: test abort");
    OK(refit_publish(t0, 51), t0);
    FAILS(refit_wait_released(t0, 51, 50), t0, -ETIMEDOUT, "not released within 50 ms");
    refit_close(t0);
    refit_close(t1);
}

/* No version near the top of the version space gets in (UINT64_MAX was once a sentinel). */
Test(registry, publish_versions_bounded)
{
    refit_client *t0;

    open_registry(RF_SRC, 1);
    t0 = conn("t0", 0, REFIT_TRAINER);
    register_halves(t0, NULL);
    OK(refit_seal(t0), t0);
    FAILS(refit_publish(t0, UINT64_MAX), t0, -ERANGE, "at most 4294967296 ahead of it");
    FAILS(refit_publish(t0, 0), t0, -ERANGE, "must be newer than the committed version 0");
    OK(refit_publish(t0, UINT64_C(1) << 32), t0);
    cr_assert_eq(ready_now(), UINT64_C(1) << 32);
    refit_close(t0);
}

Test(registry, client_leaving_drops_its_regions_and_reregisters)
{
    refit_client *t0, *t1;
    probe p;

    open_registry(RF_SRC, 2);
    t0 = conn("t0", 0, REFIT_TRAINER);
    t1 = conn("t1", 1, REFIT_TRAINER);
    register_halves(t0, NULL);
    register_halves(t1, NULL);
    OK(refit_seal(t0), t0);
    OK(refit_seal(t1), t1);
    test_loop_wait(&H.l, &H.n_inventory, 1);
    cr_assert_eq(get_probe().nregions, 4);
    refit_close(t1);
    test_loop_wait(&H.l, &H.n_change, 1);
    p = get_probe();
    cr_assert_not(p.complete);
    cr_assert_eq(p.nregions, 2, "the departed client's regions are gone");
    cr_assert_eq(p.npieces, 2);
    t1 = conn("t1 again", 1, REFIT_TRAINER);
    register_halves(t1, NULL);
    OK(refit_seal(t1), t1);
    test_loop_wait(&H.l, &H.n_inventory, 2);
    p = get_probe();
    cr_assert(p.complete);
    cr_assert_eq(p.npieces, 4);
    refit_close(t0);
    refit_close(t1);
}

Test(registry, registration_errors_name_the_problem)
{
    const int64_t z2[2] = {0, 0}, ext[2] = {2, 8}, big[2] = {5, 8}, st1[2] = {3, 0};
    const int64_t other[2] = {8, 4}, strides_far[2] = {100, 1};
    refit_client *t0, *t1;
    uint32_t r0, region;
    int fd, unsealed;
    void *m;
    probe before, after;

    open_registry(RF_SRC, 2);
    t0 = conn("t0", 0, REFIT_TRAINER);
    OK(refit_alloc_host(t0, 64, &m, &r0), t0);
    before = get_probe();
    FAILS(refit_add_piece(t0, "w", REFIT_FP32, 2, shape2, 7, 0, z2, ext, NULL), t0, -ENOENT,
          "names unknown region 7");
    FAILS(refit_add_piece(t0, "w", REFIT_FP32, 2, shape2, r0, 0, st1, ext, NULL), t0, -EINVAL,
          "lies outside its shape");
    FAILS(refit_add_piece(t0, "w", REFIT_FP32, 2, shape2, r0, 0, z2, big, NULL), t0, -EINVAL,
          "lies outside its shape");
    FAILS(refit_add_piece(t0, "w", REFIT_FP32, 2, shape2, r0, 0, z2, ext, strides_far), t0,
          -EINVAL, "lies outside its registered region");
    FAILS(refit_add_piece(t0, "w", REFIT_FP32, 2, shape2, r0, 8, z2, ext, NULL), t0, -EINVAL,
          "lies outside its registered region");
    FAILS(refit_add_piece(t0, "w", 99, 2, shape2, r0, 0, z2, ext, NULL), t0, -EINVAL,
          "unknown dtype 99");
    /* A bad name is refused before any other check, so no reply echoes it raw. */
    FAILS(refit_add_piece(t0, "w\nx", 99, 2, shape2, 7, 0, z2, ext, NULL), t0, -EINVAL,
          "piece refused: ");
    cr_assert(strstr(refit_last_error(t0), "\"w\\nx\""), "name not escaped: %s",
              refit_last_error(t0));
    cr_assert_null(strchr(refit_last_error(t0), '\n'), "raw newline echoed");
    FAILS(refit_add_piece(t0, "w", REFIT_FP32, 9, shape2, r0, 0, z2, ext, NULL), t0, -EINVAL,
          "ndim 9");
    after = get_probe();
    cr_assert_eq(after.ntensors, before.ntensors, "nothing half-registered");
    cr_assert_eq(after.npieces, 0);
    OK(refit_add_piece(t0, "w", REFIT_FP32, 2, shape2, r0, 0, z2, ext, NULL), t0);
    FAILS(refit_add_piece(t0, "w", REFIT_BF16, 2, shape2, r0, 0, z2, ext, NULL), t0, -EINVAL,
          "tensor w registered as");
    t1 = conn("t1", 1, REFIT_TRAINER);
    OK(refit_alloc_host(t1, 64, &m, &region), t1);
    FAILS(refit_add_piece(t1, "w", REFIT_FP32, 2, other, region, 0, z2, ext, NULL), t1,
          -EINVAL, "tensor w registered as");

    /* Memory: a memfd smaller than claimed, an unsealed one, size 0. */
    fd = memfd_create("small", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert(ftruncate(fd, 100) == 0);
    FAILS(refit_region_memfd(t1, fd, 4096, &region), t1, -EINVAL,
          "memfd is 100 bytes, smaller than the region claimed");
    unsealed = memfd_create("unsealed", MFD_CLOEXEC);
    cr_assert(ftruncate(unsealed, 4096) == 0);
    FAILS(refit_region_memfd(t1, unsealed, 4096, &region), t1, -EINVAL,
          "not sealed against shrinking");
    FAILS(refit_region_memfd(t1, fd, 0, &region), t1, -EINVAL, "size 0");
    close(fd);
    close(unsealed);
    after = get_probe();
    cr_assert_eq(after.nregions, 2);
    cr_assert_eq(after.npieces, 1);

    /* After seal nothing more is taken; publish needs a seal first. */
    FAILS(refit_publish(t1, 1), t1, -EINVAL, "before Seal");
    OK(refit_seal(t0), t0);
    FAILS(refit_add_piece(t0, "w", REFIT_FP32, 2, shape2, r0, 0, z2, ext, NULL), t0, -EBUSY,
          "after Seal");
    FAILS(refit_alloc_host(t0, 64, &m, &region), t0, -EBUSY, "after Seal");
    refit_close(t0);
    refit_close(t1);
}

Test(registry, hello_refusals)
{
    refit_client *c = NULL, *t0, *t1;

    open_registry(RF_SRC, 2);
    FAILS(refit_connect(H.path, "e", 0, REFIT_ENGINE, &c), NULL, -EINVAL,
          "engine client connected to the publisher daemon");
    cr_assert_null(c);
    FAILS(refit_connect(H.path, "t", -1, REFIT_TRAINER, &c), NULL, -EINVAL,
          "rank -1 is outside 0..1048575");
    FAILS(refit_connect(H.path, "t", INT32_MAX, REFIT_TRAINER, &c), NULL, -EINVAL,
          "rank 2147483647 is outside 0..1048575");
    FAILS(refit_connect(H.path, "t", 0, 7, &c), NULL, -EINVAL, "unknown client kind 7");
    t0 = conn("t0", 0, REFIT_TRAINER);
    FAILS(refit_connect(H.path, "dup", 0, REFIT_TRAINER, &c), NULL, -EADDRINUSE,
          "rank 0 is already connected (client 't0'");
    t1 = conn("t1", 1, REFIT_TRAINER);
    FAILS(refit_connect(H.path, "t2", 2, REFIT_TRAINER, &c), NULL, -EUSERS,
          "expects 2 trainer clients");
    FAILS(refit_connect("/nonexistent/x.sock", "t", 0, REFIT_TRAINER, &c), NULL, -ENOENT,
          "is the daemon running");
    /* ctl clients do not count against the expected trainers. */
    c = conn("ctl", 0, REFIT_CTL);
    refit_close(c);
    refit_close(t0);
    refit_close(t1);
}

static int grab(void *ctx, const uint8_t *b, uint32_t len)
{
    *(Refit__Rpc__Response **)ctx = refit__rpc__response__unpack(NULL, len, b);
    return 0;
}

/* The next answer on fd. */
static Refit__Rpc__Response *raw_read(int fd)
{
    rf_wire_reader rd;
    Refit__Rpc__Response *out = NULL;
    uint8_t buf[4096];
    ssize_t n;

    rf_wire_reader_init(&rd, 0);
    while (out == NULL && (n = recv(fd, buf, sizeof(buf), 0)) > 0)
        cr_assert_eq(rf_wire_reader_feed(&rd, buf, (size_t)n, grab, &out), 0);
    rf_wire_reader_reset(&rd);
    cr_assert_not_null(out);
    return out;
}

/* Raw requests the C API never sends: before Hello, Hello twice, a CUDA region here. */
static Refit__Rpc__Response *raw_call(int fd, Refit__Rpc__Request *q)
{
    cr_assert_eq(rf_rpc_send(fd, q, -1, NULL), 0);
    return raw_read(fd);
}

static void expect_raw(int fd, Refit__Rpc__Request *q, int code, const char *text)
{
    Refit__Rpc__Response *r = raw_call(fd, q);

    cr_assert_eq(r->id, q->id);
    cr_assert_eq(r->code, code, "code %d: %s", r->code, r->message);
    cr_assert(strstr(r->message, text), "'%s' lacks '%s'", r->message, text);
    refit__rpc__response__free_unpacked(r, NULL);
}

Test(registry, protocol_refusals)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Hello h = REFIT__RPC__HELLO__INIT;
    Refit__Rpc__Seal seal = REFIT__RPC__SEAL__INIT;
    Refit__Rpc__RegisterRegion rr = REFIT__RPC__REGISTER_REGION__INIT;
    uint8_t handle[64] = {1};
    int fd;

    open_registry(RF_DST, 1);
    cr_assert_eq(rf_rpc_dial(H.path, &fd, NULL), 0);
    q.id = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_SEAL;
    q.seal = &seal;
    expect_raw(fd, &q, -EPROTO, "say Hello first");
    q.id = 2;
    q.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    q.hello = &h;
    h.protocol_version = 99;
    h.kind = REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE;
    expect_raw(fd, &q, -EPROTONOSUPPORT, "protocol version 99");
    h.protocol_version = RF_RPC_PROTOCOL_VERSION;
    q.id = 3;
    expect_raw(fd, &q, 0, "welcome");
    q.id = 4;
    expect_raw(fd, &q, -EISCONN, "Hello sent twice");
    q.id = 5;
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    q.register_region = &rr;
    rr.kind = REFIT__RPC__MEM_KIND__MEM_CUDA_IPC;
    rr.device = "GPU-0b5c";
    rr.size = 1024;
    rr.ipc_handle.data = handle;
    rr.ipc_handle.len = sizeof(handle);
    expect_raw(fd, &q, -EINVAL, "transport moves host memory only");
    q.id = 6;
    rr.device = "host";
    expect_raw(fd, &q, -EINVAL, "host memory is a memfd");
    q.id = 7;
    rr.device = "";
    expect_raw(fd, &q, -EINVAL, "region device must be");
    q.id = 8;
    rr.kind = REFIT__RPC__MEM_KIND__MEM_MEMFD;
    rr.device = "host";
    expect_raw(fd, &q, -EBADF, "without a file descriptor");
    close(fd);
}

Test(registry, engine_overlap_refused_at_seal)
{
    const int64_t sh[1] = {16}, s0[1] = {0}, s8[1] = {8}, e8[1] = {8};
    refit_client *e0, *e1;
    uint32_t r;
    void *m;

    open_registry(RF_DST, 2);
    e0 = conn("e0", 0, REFIT_ENGINE);
    e1 = conn("e1", 1, REFIT_ENGINE);
    OK(refit_alloc_host(e0, 64, &m, &r), e0);
    /* Two tensors written to the same 32 bytes. */
    OK(refit_add_piece(e0, "a", REFIT_FP32, 1, sh, r, 0, s0, e8, NULL), e0);
    OK(refit_add_piece(e0, "b", REFIT_FP32, 1, sh, r, 16, s8, e8, NULL), e0);
    /* An unfinished overlap of e0 must not fail e1's seal. */
    OK(refit_alloc_host(e1, 64, &m, &r), e1);
    OK(refit_add_piece(e1, "a", REFIT_FP32, 1, sh, r, 0, s8, e8, NULL), e1);
    OK(refit_seal(e1), e1);
    FAILS(refit_seal(e0), e0, -EINVAL, "seal refused");
    cr_assert(strstr(refit_last_error(e0), "a ") && strstr(refit_last_error(e0), "b "),
              "both pieces named: %s", refit_last_error(e0));
    cr_assert(strstr(refit_last_error(e0), "register them again"));
    test_loop_wait(&H.l, &H.n_change, 1);
    cr_assert_eq(get_probe().npieces, 1, "e0's pieces dropped");
    OK(refit_add_piece(e0, "b", REFIT_FP32, 1, sh, 0, 32, s8, e8, NULL), e0);
    OK(refit_seal(e0), e0);
    test_loop_wait(&H.l, &H.n_inventory, 1);
    cr_assert_eq(get_probe().npieces, 2);
    refit_close(e0);
    refit_close(e1);
}

typedef struct notify_args { int ev; uint64_t v; } notify_args;
static void call_notify(void *arg)
{
    notify_args *n = arg;

    rf_registry_notify(H.reg, (rf_reg_event)n->ev, n->v, "r");
}

Test(registry, engines_get_events_and_version_waits)
{
    const int64_t sh[1] = {4}, s0[1] = {0};
    refit_client *e0, *t;
    notify_args n;
    uint64_t version;
    int ev;
    uint32_t r;
    void *m;

    open_registry(RF_DST, 1);
    e0 = conn("e0", 0, REFIT_ENGINE);
    OK(refit_alloc_host(e0, 16, &m, &r), e0);
    OK(refit_add_piece(e0, "x", REFIT_FP32, 1, sh, r, 0, s0, sh, NULL), e0);
    OK(refit_seal(e0), e0);
    FAILS(refit_next_event(e0, 20, &ev, &version), e0, -ETIMEDOUT, "no event");
    n = (notify_args){RF_REG_INSTALLING, 1};
    test_loop_run(&H.l, call_notify, &n);
    n = (notify_args){RF_REG_COMMITTED, 1};
    test_loop_run(&H.l, call_notify, &n);
    OK(refit_wait_version(e0, 1, 2000), e0);
    OK(refit_next_event(e0, 2000, &ev, &version), e0);
    cr_assert_eq(ev, REFIT_EVENT_INSTALLING);
    cr_assert_eq(version, 1);
    OK(refit_next_event(e0, 2000, &ev, &version), e0);
    cr_assert_eq(ev, REFIT_EVENT_COMMITTED);
    schedule(RF_REG_ABORTED, 2);
    FAILS(refit_wait_version(e0, 2, 5000), e0, -ECANCELED,
          "refit of version 2 aborted: receiver 3 timed out");
    OK(refit_next_event(e0, 2000, &ev, &version), e0);
    cr_assert_eq(ev, REFIT_EVENT_ABORTED);
    cr_assert_eq(version, 2);
    schedule(RF_REG_COMMITTED, 3);
    OK(refit_wait_version(e0, 3, 5000), e0);
    FAILS(refit_publish(e0, 4), e0, -EPERM, "Publish is for trainers");
    FAILS(refit_wait_released(e0, 4, 100), e0, -EPERM, "WaitReleased is for trainers");
    t = conn("ctl", 0, REFIT_CTL);
    FAILS(refit_wait_version(t, 4, 100), t, -EPERM, "WaitVersion is for engines");
    FAILS(refit_seal(t), t, -EPERM, "Seal is for trainer and engine clients");
    refit_close(t);
    refit_close(e0);
}

Test(registry, ctl_status_trigger_wait)
{
    refit_client *c;
    char *json = NULL;
    json_t *j;
    notify_args n;

    open_registry(RF_SRC, 1);
    c = conn("refitctl", 0, REFIT_CTL);
    OK(refit_status_json(c, &json), c);
    j = json_loads(json, 0, NULL);
    cr_assert_not_null(j, "%s", json);
    cr_assert_str_eq(json_string_value(json_object_get(j, "side")), "trainers");
    cr_assert_eq(json_integer_value(json_object_get(j, "expected_clients")), 1);
    cr_assert_eq(json_array_size(json_object_get(j, "clients")), 1);
    json_decref(j);
    free(json);
    OK(refit_trigger(c, 5), c);
    test_loop_wait(&H.l, &H.n_refit, 1);
    cr_assert_eq(H.refit, 5);
    H.refuse_refit = true;
    FAILS(refit_trigger(c, 6), c, -EBUSY, "refit 6: a refit is already running");
    schedule(RF_REG_COMMITTED, 5);
    OK(refit_wait(c, 5, 5000), c);
    OK(refit_wait(c, 4, 100), c); /* already committed */
    schedule(RF_REG_ABORTED, 6);
    FAILS(refit_wait(c, 6, 5000), c, -ECANCELED, "refit of version 6 aborted");
    H.refuse_wait = true;
    FAILS(refit_wait(c, 7, 100), c, -EINVAL, "version 7 was never triggered");
    n = (notify_args){RF_REG_COMMITTED, 7};
    test_loop_run(&H.l, call_notify, &n);
    OK(refit_wait(c, 7, 100), c);
    refit_close(c);
}

/* The cluster cannot refit: waits queued and new end at once with its reason, the offer
 * stands, and once it clears the same waits wait and are answered as usual. */
Test(registry, a_blocked_cluster_ends_every_wait_with_its_reason_until_it_clears)
{
    refit_client *t, *c;
    uint64_t v = 1, t0;

    open_registry(RF_SRC, 1);
    t = conn("t0", 0, REFIT_TRAINER);
    c = conn("refitctl", 0, REFIT_CTL);
    register_halves(t, NULL);
    OK(refit_seal(t), t);
    OK(refit_publish(t, 1), t);
    test_loop_wait(&H.l, &H.n_ready, 1);
    /* Queued before the block comes: answered when it does, not at the timeout. */
    schedule(TIMER_BLOCK, 0);
    t0 = now_ms();
    FAILS(refit_wait_released(t, 1, 10000), t, -EAGAIN,
          "version 1 cannot be refitted now: " BLOCK_REASON);
    cr_assert_lt(now_ms() - t0, 5000, "the blocked wait took %llu ms",
                 (unsigned long long)(now_ms() - t0));
    /* New waits while blocked: at once. */
    FAILS(refit_wait_released(t, 1, 3000), t, -EAGAIN, BLOCK_REASON);
    FAILS(refit_wait(c, 1, 3000), c, -EAGAIN, "version 1 cannot be refitted now: " BLOCK_REASON);
    /* A version already reached is no wait: answered as usual. */
    cr_assert_eq(ready_now(), 1, "the block took the trainer's offer away");
    /* Cleared: waits wait again, and end as the refit does. */
    test_loop_run(&H.l, call_block, NULL);
    FAILS(refit_wait_released(t, 1, 50), t, -ETIMEDOUT, "version 1 was not released within");
    schedule(RF_REG_COMMITTED, 1);
    OK(refit_wait(c, 1, 5000), c);
    test_loop_run(&H.l, call_release, &v);
    OK(refit_wait_released(t, 1, 2000), t);
    /* A version already committed is answered while blocked. */
    test_loop_run(&H.l, call_block, (void *)BLOCK_REASON);
    OK(refit_wait(c, 1, 100), c);
    OK(refit_wait_released(t, 1, 100), t);
    refit_close(c);
    refit_close(t);
}

Test(registry, daemon_without_ctl_callbacks_refuses)
{
    rf_registry_opts o = {0};
    rf_registry_cb cb = {0};
    refit_client *c;
    char *json;
    rf_err err = {0};

    o.socket_path = H.path;
    o.side = RF_DST;
    o.expected_clients = 0;
    cr_assert_eq(rf_registry_open(&H.l.loop, &o, &cb, NULL, &H.reg, &err), -EINVAL);
    cr_assert(strstr(err.msg, "expects 0 clients"), "%s", err.msg);
    o.expected_clients = 1;
    cr_assert_eq(rf_registry_open(&H.l.loop, &o, &cb, NULL, &H.reg, &err), 0, "%s", err.msg);
    test_loop_start(&H.l);
    c = conn("ctl", 0, REFIT_CTL);
    FAILS(refit_status_json(c, &json), c, -ENOTSUP, "does not serve status");
    FAILS(refit_trigger(c, 1), c, -ENOTSUP, "send them to the coordinator");
    refit_close(c);
}

Test(registry, bad_frame_from_one_client_others_served)
{
    uint8_t junk[] = {0, 0, 0, 2, 0xff, 0xff};
    refit_client *e0, *e1;
    probe p;

    open_registry(RF_DST, 2);
    e0 = conn("e0", 0, REFIT_ENGINE);
    e1 = conn("e1", 1, REFIT_ENGINE);
    {
        /* librefit's fd is private; reach it through a fresh raw client instead. */
        int fd;
        Refit__Rpc__Response *r;

        cr_assert_eq(rf_rpc_dial(H.path, &fd, NULL), 0);
        cr_assert_eq(send(fd, junk, sizeof(junk), 0), (ssize_t)sizeof(junk));
        {
            rf_wire_reader rd;
            uint8_t buf[1024];
            ssize_t n;

            rf_wire_reader_init(&rd, 0);
            r = NULL;
            while (r == NULL && (n = recv(fd, buf, sizeof(buf), 0)) > 0)
                rf_wire_reader_feed(&rd, buf, (size_t)n, grab, &r);
            rf_wire_reader_reset(&rd);
        }
        cr_assert_not_null(r);
        cr_assert_eq(r->code, -EBADMSG);
        refit__rpc__response__free_unpacked(r, NULL);
        close(fd);
    }
    register_halves(e0, NULL);
    OK(refit_seal(e0), e0);
    p = get_probe();
    cr_assert_eq(p.npieces, 2);
    refit_close(e0);
    refit_close(e1);
}

static void read_consumed(void *arg)
{
    *(uint64_t *)arg = rf_registry_consumed(H.reg);
}

/* "name:gated:consumed " or "name:ungated " per engine of the status, in its order. */
static void read_gates(void *arg)
{
    json_t *st = rf_registry_status(H.reg), *cl;
    char *out = arg;
    size_t i, len = 0;

    cr_assert_not_null(st);
    out[0] = '\0';
    json_array_foreach(json_object_get(st, "clients"), i, cl) {
        const char *name = json_string_value(json_object_get(cl, "name"));

        if (json_is_true(json_object_get(cl, "gated")))
            len += (size_t)snprintf(out + len, 256 - len, "%s:gated:%lld ", name,
                                    (long long)json_integer_value(json_object_get(cl, "consumed")));
        else
            len += (size_t)snprintf(out + len, 256 - len, "%s:%s ", name,
                                    json_object_get(cl, "consumed") ? "consumed?" : "ungated");
    }
    json_decref(st);
}

Test(registry, gated_engines_hold_installs_until_consumed)
{
    char gates[256];
    int64_t sh[1] = {16}, s0[1] = {0}, s1[1] = {8}, ext[1] = {8};
    refit_client *e0, *e1, *t;
    notify_args n;
    uint32_t r;
    uint64_t consumed;
    void *p;

    open_registry(RF_DST, 2);
    test_loop_run(&H.l, read_consumed, &consumed);
    cr_assert_eq(consumed, UINT64_MAX, "no gated engine: nothing holds installs");
    e0 = conn("e0", 0, REFIT_ENGINE);
    e1 = conn("e1", 1, REFIT_ENGINE);
    OK(refit_alloc_host(e0, 64, &p, &r), e0);
    OK(refit_add_piece(e0, "x", REFIT_FP32, 1, sh, r, 0, s0, ext, NULL), e0);
    FAILS(refit_consumed(e0, 0), e0, -EINVAL, "not gated");
    OK(refit_gate(e0), e0);
    test_loop_wait(&H.l, &H.n_consumed, 1);
    cr_assert_eq(H.consumed, 0);
    OK(refit_seal(e0), e0);
    FAILS(refit_gate(e0), e0, -EINVAL, "Gate after Seal");
    OK(refit_alloc_host(e1, 64, &p, &r), e1);
    OK(refit_add_piece(e1, "x", REFIT_FP32, 1, sh, r, 0, s1, ext, NULL), e1);
    OK(refit_seal(e1), e1); /* not gated: takes installs whenever they come */

    n = (notify_args){RF_REG_COMMITTED, 1};
    test_loop_run(&H.l, call_notify, &n);
    OK(refit_wait_version(e0, 1, 2000), e0);
    test_loop_run(&H.l, read_consumed, &consumed);
    cr_assert_eq(consumed, 0, "version 1 not consumed yet: the next install must wait");
    FAILS(refit_consumed(e0, 2), e0, -EINVAL, "only committed versions can be consumed");
    OK(refit_consumed(e0, 1), e0);
    test_loop_wait(&H.l, &H.n_consumed, 2);
    cr_assert_eq(H.consumed, 1);
    FAILS(refit_consumed(e0, 0), e0, -EINVAL, "in order");
    /* The status says which engine holds the next install back, and at which version. */
    test_loop_run(&H.l, read_gates, gates);
    cr_assert_str_eq(gates, "e1:ungated e0:gated:1 ", "%s", gates);

    /* A gated engine that leaves no longer holds anyone back. */
    refit_close(e0);
    test_loop_wait(&H.l, &H.n_consumed, 3);
    cr_assert_eq(H.consumed, UINT64_MAX);
    t = conn("ctl", 0, REFIT_CTL);
    FAILS(refit_gate(t), t, -EPERM, "Gate is for engines");
    refit_close(t);
    refit_close(e1);
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

/* Waits (up to 5 s) for this process to hold n fds: the daemon closes what it refuses or
 * drops on the loop thread, just after it answers. */
static void wait_fds(int n, const char *what)
{
    int i, now = count_fds();

    for (i = 0; i < 500 && now != n; i++, now = count_fds())
        poll(NULL, 0, 10);
    cr_assert_eq(now, n, "%s: %d fds open, %d expected", what, now, n);
}

/* The registry keeps each memfd it is given (a same-host receiverd is handed it again) for as
 * long as the region lives, one per object, closes one it refuses at once, and closes them
 * all when the client goes. */
Test(registry, region_fds_live_with_their_regions)
{
    int base, fd, i;
    refit_client *t;
    uint32_t r;
    void *m;

    open_registry(RF_SRC, 1);
    base = count_fds();
    t = conn("t0", 0, REFIT_TRAINER);
    for (i = 0; i < 3; i++)
        OK(refit_alloc_host(t, 4096, &m, &r), t);
    /* The client's socket, the daemon's end of it, and one fd per region. */
    wait_fds(base + 2 + 3, "three regions");
    fd = memfd_create("short", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_eq(ftruncate(fd, 100), 0);
    FAILS(refit_region_memfd(t, fd, 4096, &r), t, -EINVAL, "register a size that fits");
    close(fd);
    wait_fds(base + 2 + 3, "a refused region's fd is not kept");
    /* Regions of one memfd (one allocation holding many tensors) keep one fd between them. */
    fd = memfd_create("one", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_eq(ftruncate(fd, 8192), 0);
    for (i = 0; i < 4; i++)
        OK(refit_region_memfd_at(t, fd, (uint64_t)i * 2048, 2048, &r), t);
    close(fd);
    wait_fds(base + 2 + 3 + 1, "four regions of one memfd");
    refit_close(t);
    wait_fds(base, "after the client left");
}

/* A raw RegisterRegion with chunks and nfds descriptors (fds[i]); returns the answer's code
 * and checks its message. */
static void expect_chunked(int fd, uint64_t id, int kind, const char *device,
                           const uint64_t *sizes, const uint64_t *offsets, size_t n,
                           const int *fds, size_t nfds, int code, const char *text)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion rr = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__VmmChunk *ch = calloc(n, sizeof(*ch)), **chp = calloc(n, sizeof(*chp));
    Refit__Rpc__Response *r = NULL;
    rf_wire_reader rd;
    uint8_t buf[4096];
    rf_err err = {0};
    ssize_t got;

    for (size_t i = 0; i < n; i++) {
        refit__rpc__vmm_chunk__init(&ch[i]);
        ch[i].size = sizes[i];
        ch[i].offset = offsets[i];
        chp[i] = &ch[i];
    }
    q.id = id;
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    q.register_region = &rr;
    rr.kind = (Refit__Rpc__MemKind)kind;
    rr.device = (char *)device;
    rr.size = 4096;
    rr.n_chunks = n;
    rr.chunks = chp;
    cr_assert_eq(rf_rpc_send_fds(fd, &q, fds, nfds, &err), 0, "%s", err.msg);
    rf_wire_reader_init(&rd, 0);
    while (r == NULL && (got = recv(fd, buf, sizeof(buf), 0)) > 0)
        cr_assert_eq(rf_wire_reader_feed(&rd, buf, (size_t)got, grab, &r), 0);
    rf_wire_reader_reset(&rd);
    cr_assert_not_null(r);
    cr_assert_eq(r->id, id);
    cr_assert_eq(r->code, code, "code %d: %s", r->code, r->message);
    cr_assert(strstr(r->message, text), "'%s' lacks '%s'", r->message, text);
    refit__rpc__response__free_unpacked(r, NULL);
    free(chp);
    free(ch);
}

static void raw_hello(int fd, int kind)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Hello h = REFIT__RPC__HELLO__INIT;

    q.id = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    q.hello = &h;
    h.protocol_version = RF_RPC_PROTOCOL_VERSION;
    h.kind = (Refit__Rpc__ClientKind)kind;
    h.name = "raw";
    expect_raw(fd, &q, 0, "welcome");
}

/* A region over several VMM allocations brings one fd per chunk: every refusal of one claims
 * exactly its fds (the next request's fd stays its own) and closes them all. Memfds stand in
 * for the VMM fds: each case is refused before anything imports them. */
Test(registry, chunked_region_refusals_close_every_fd)
{
    const uint64_t mib2 = 2u << 20;
    const uint64_t sizes[3] = {mib2, mib2, mib2}, at[3] = {0, mib2, 2 * mib2};
    const uint64_t gap[2] = {0, 2 * mib2};
    static uint64_t many_sizes[RF_MEM_MAX_CHUNKS + 1], many_at[RF_MEM_MAX_CHUNKS + 1];
    static int many_fds[RF_RPC_MAX_FDS];
    int fd, base, m[3], i;
    uint64_t id = 10;
    void *mem;
    uint32_t region;
    refit_client *t;

    open_registry(RF_SRC, 1);
    base = count_fds();
    cr_assert_eq(rf_rpc_dial(H.path, &fd, NULL), 0);
    raw_hello(fd, REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER);
    for (i = 0; i < 3; i++) {
        m[i] = memfd_create("chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        cr_assert_eq(ftruncate(m[i], (off_t)mib2), 0);
    }
    /* Our socket, the daemon's end, our three memfds. */
    wait_fds(base + 2 + 3, "connected");
    expect_chunked(fd, id++, REFIT__RPC__MEM_KIND__MEM_MEMFD, "host", sizes, at, 3, m, 3,
                   -EINVAL, "only cuda_vmm_fd regions are made of several allocations");
    wait_fds(base + 2 + 3, "a memfd region with chunks");
    expect_chunked(fd, id++, REFIT__RPC__MEM_KIND__MEM_CUDA_IPC, "GPU-0b5c", sizes, at, 3, m, 3,
                   -EINVAL, "a cuda_ipc region with 3 chunks");
    wait_fds(base + 2 + 3, "a cuda_ipc region with chunks");
    expect_chunked(fd, id++, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, "GPU-0b5c", sizes, gap, 2,
                   m, 2, -EINVAL, "chunk 1 of 2 is 2097152 bytes at offset 4194304, expected "
                   "a size > 0 at offset 2097152");
    wait_fds(base + 2 + 3, "chunks not back to back");
    expect_chunked(fd, id++, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, "GPU-0b5c", sizes, at, 3,
                   m, 2, -EBADF, "3 chunks but 2 file descriptors came with the request");
    wait_fds(base + 2 + 3, "fewer fds than chunks");
    /* Well formed, on a daemon whose transport moves host memory. */
    expect_chunked(fd, id++, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, "GPU-0b5c", sizes, at, 3,
                   m, 3, -EINVAL, "transport moves host memory only");
    wait_fds(base + 2 + 3, "a GPU region on a host daemon");
    /* More chunks than a region may span, with every fd a request may bring. */
    for (i = 0; i <= RF_MEM_MAX_CHUNKS; i++) {
        many_sizes[i] = mib2;
        many_at[i] = (uint64_t)i * mib2;
    }
    for (i = 0; i < RF_RPC_MAX_FDS; i++)
        many_fds[i] = m[i % 3];
    expect_chunked(fd, id++, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, "GPU-0b5c", many_sizes,
                   many_at, RF_MEM_MAX_CHUNKS + 1, many_fds, RF_RPC_MAX_FDS, -E2BIG,
                   "spans 1025 allocations, more than the 1024 one region may");
    wait_fds(base + 2 + 3, "too many chunks");
    for (i = 0; i < 3; i++)
        close(m[i]);
    close(fd);
    wait_fds(base, "after the raw client left");
    /* The daemon still serves memfd regions, each with its own fd. */
    t = conn("t0", 0, REFIT_TRAINER);
    OK(refit_alloc_host(t, 4096, &mem, &region), t);
    cr_assert_eq(region, 0);
    refit_close(t);
    wait_fds(base, "after the trainer left");
}

/* On a GPU daemon a well-formed region over three allocations is imported, and three memfds
 * are no CUDA allocations: refused (without CUDA: not supported) with all three closed. */
Test(registry, chunked_region_of_non_cuda_fds_refused_on_a_gpu_daemon)
{
    static const rf_registry_cb cb = {cb_inventory, cb_change, cb_ready, cb_status, cb_refit,
                                      cb_wait, cb_consumed, NULL, NULL, NULL};
    const uint64_t mib2 = 2u << 20;
    const uint64_t sizes[3] = {mib2, mib2, mib2}, at[3] = {0, mib2, 2 * mib2};
    rf_registry_opts o = {0};
    rf_err err = {0};
    int fd, base, m[3], i;

    o.socket_path = H.path;
    o.side = RF_SRC;
    o.expected_clients = 1;
    o.gpu_memory = true;
    cr_assert_eq(rf_registry_open(&H.l.loop, &o, &cb, NULL, &H.reg, &err), 0, "%s", err.msg);
    test_loop_start(&H.l);
    base = count_fds();
    cr_assert_eq(rf_rpc_dial(H.path, &fd, NULL), 0);
    raw_hello(fd, REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER);
    for (i = 0; i < 3; i++) {
        m[i] = memfd_create("chunk", MFD_CLOEXEC);
        cr_assert_eq(ftruncate(m[i], (off_t)mib2), 0);
    }
    wait_fds(base + 2 + 3, "connected");
#ifdef RF_HAVE_CUDA
    if (rf_mem_cuda_init(&err) == 0) {
        /* The driver's own fds (it keeps /dev/nvidia* open) are counted from here. */
        base = count_fds() - 2 - 3;
        expect_chunked(fd, 10, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, "GPU-0b5c", sizes, at, 3,
                       m, 3, -ENODEV, "no visible GPU has UUID GPU-0b5c");
    } else
#endif
        expect_chunked(fd, 10, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, "GPU-0b5c", sizes, at, 3,
                       m, 3, -ENOTSUP, "memory kind cuda_vmm_fd is not supported");
    wait_fds(base + 2 + 3, "refused chunks");
    for (i = 0; i < 3; i++)
        close(m[i]);
    close(fd);
    wait_fds(base, "after the client left");
}

static void set_key(void *arg)
{
    static const uint8_t key[32] = {7};

    (void)arg;
    cr_assert_eq(rf_registry_set_export_key(H.reg, key, sizeof(key)), 0);
}

/* In-process install: an engine's MEM_INPROC region, the install token of its Seal, and every
 * refusal of the installer's requests. */
/* An engine's part of a plan goes to its installer at once: more than a client's
 * RF_RPC_MAX_OUTPUT, unread while it is pushed (installer_out_room). */
typedef struct big_push {
    int rc;
    rf_err err;
} big_push;

#define BIG_PUSHES 40
#define BIG_PUSH_BYTES (1u << 20)

static void push_big(void *arg)
{
    Refit__Rpc__Install m = REFIT__RPC__INSTALL__INIT;
    Refit__Rpc__InstallPlan ip = REFIT__RPC__INSTALL_PLAN__INIT;
    big_push *b = arg;
    uint8_t *frame = calloc(1, BIG_PUSH_BYTES);
    uint64_t uid = rf_registry_endpoint_owner(H.reg, 0);

    m.body_case = REFIT__RPC__INSTALL__BODY_PLAN;
    m.plan = &ip;
    ip.slice.data = frame;
    ip.slice.len = BIG_PUSH_BYTES;
    b->rc = uid ? 0 : -ENOENT;
    for (int i = 0; i < BIG_PUSHES && b->rc == 0; i++)
        b->rc = rf_registry_install_push(H.reg, uid, &m, &b->err);
    free(frame);
}

static int count_push(void *ctx, const uint8_t *b, uint32_t len)
{
    Refit__Rpc__Response *r = refit__rpc__response__unpack(NULL, len, b);

    if (r && r->install && r->install->plan && r->install->plan->slice.len == BIG_PUSH_BYTES)
        (*(int *)ctx)++;
    refit__rpc__response__free_unpacked(r, NULL);
    return 0;
}

static void big_push_arrives(int ins)
{
    big_push b = {0};
    rf_wire_reader rd;
    uint8_t *buf = malloc(1 << 16);
    ssize_t n = 0;
    int got = 0;

    cr_assert_gt((size_t)BIG_PUSHES * BIG_PUSH_BYTES, RF_RPC_MAX_OUTPUT);
    test_loop_run(&H.l, push_big, &b);
    cr_assert_eq(b.rc, 0, "pushing %u MiB to an unread installer: %s", BIG_PUSHES, b.err.msg);
    rf_wire_reader_init(&rd, 0);
    while (got < BIG_PUSHES && (n = recv(ins, buf, 1 << 16, 0)) > 0)
        cr_assert_eq(rf_wire_reader_feed(&rd, buf, (size_t)n, count_push, &got), 0);
    rf_wire_reader_reset(&rd);
    free(buf);
    cr_assert_eq(got, BIG_PUSHES, "the installer got %d of %d pushes", got, BIG_PUSHES);
}

Test(registry, inproc_regions_and_installer_refusals)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion rr = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__Seal seal = REFIT__RPC__SEAL__INIT;
    Refit__Rpc__InstallerAttach at = REFIT__RPC__INSTALLER_ATTACH__INIT;
    Refit__Rpc__InstallSources sg = REFIT__RPC__INSTALL_SOURCES__INIT;
    Refit__Rpc__InstallDone dn = REFIT__RPC__INSTALL_DONE__INIT;
    Refit__Rpc__Response *r;
    uint8_t token[RF_REGISTRY_TOKEN_BYTES], bad[RF_REGISTRY_TOKEN_BYTES] = {0};
    /* Request { id = 16, field 17 (InstallSign, retired) = {} }, framed. */
    static const uint8_t sign_frame[] = {0, 0, 0, 5, 0x08, 16, 0x8a, 0x01, 0x00};
    int eng, ins, ins2, status, sv[2];
    pid_t pid;

    open_registry(RF_DST, 1);
    cr_assert_eq(rf_rpc_dial(H.path, &eng, NULL), 0);
    raw_hello(eng, REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE);
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    q.register_region = &rr;
    rr.kind = REFIT__RPC__MEM_KIND__MEM_INPROC;
    rr.device = "host";
    q.id = 2;
    expect_raw(eng, &q, -EINVAL, "give its size (> 0) and nothing else");
    rr.size = 4096;
    rr.offset = 8;
    q.id = 3;
    expect_raw(eng, &q, -EINVAL, "give its size (> 0) and nothing else");
    rr.offset = 0;
    rr.device = "GPU-0b5c";
    q.id = 4;
    expect_raw(eng, &q, -EINVAL, "transport moves host memory only");
    rr.device = "host";
    q.id = 5;
    expect_raw(eng, &q, 0, "");
    q.id = 6;
    q.body_case = REFIT__RPC__REQUEST__BODY_SEAL;
    q.seal = &seal;
    r = raw_call(eng, &q);
    cr_assert_eq(r->code, 0, "%s", r->message);
    cr_assert_eq(r->install_token.len, sizeof(token), "Seal of an in-process engine gives a token");
    memcpy(token, r->install_token.data, sizeof(token));
    refit__rpc__response__free_unpacked(r, NULL);

    /* An engine's requests are not an installer's. */
    q.id = 7;
    q.body_case = REFIT__RPC__REQUEST__BODY_INSTALL_SOURCES;
    q.install_sources = &sg;
    expect_raw(eng, &q, -EPERM, "for installer clients");

    cr_assert_eq(rf_rpc_dial(H.path, &ins, NULL), 0);
    raw_hello(ins, REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER);
    q.id = 8;
    expect_raw(ins, &q, -EPROTO, "before InstallerAttach");
    q.id = 9;
    q.body_case = REFIT__RPC__REQUEST__BODY_INSTALL_DONE;
    q.install_done = &dn;
    expect_raw(ins, &q, -EPROTO, "before InstallerAttach");
    q.id = 10;
    q.body_case = REFIT__RPC__REQUEST__BODY_INSTALLER_ATTACH;
    q.installer_attach = &at;
    at.token.data = bad;
    at.token.len = sizeof(bad);
    expect_raw(ins, &q, -EACCES, "no engine of this daemon holds that install token");
    /* Another process with the right token is refused: the installer is the engine's own. */
    pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        Refit__Rpc__Request cq = REFIT__RPC__REQUEST__INIT;
        Refit__Rpc__Hello h = REFIT__RPC__HELLO__INIT;
        Refit__Rpc__InstallerAttach ca = REFIT__RPC__INSTALLER_ATTACH__INIT;
        Refit__Rpc__Response *cr = NULL;
        rf_wire_reader rd;
        uint8_t buf[4096];
        ssize_t n;
        int fd, got = 0;

        if (rf_rpc_dial(H.path, &fd, NULL) < 0)
            _exit(2);
        cq.id = 1;
        cq.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
        cq.hello = &h;
        h.protocol_version = RF_RPC_PROTOCOL_VERSION;
        h.kind = REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER;
        h.name = "other";
        ca.token.data = token;
        ca.token.len = sizeof(token);
        rf_rpc_send(fd, &cq, -1, NULL);
        cq.id = 2;
        cq.body_case = REFIT__RPC__REQUEST__BODY_INSTALLER_ATTACH;
        cq.installer_attach = &ca;
        rf_rpc_send(fd, &cq, -1, NULL);
        rf_wire_reader_init(&rd, 0);
        while (!got && (n = recv(fd, buf, sizeof(buf), 0)) > 0) {
            rf_wire_reader_feed(&rd, buf, (size_t)n, grab, &cr);
            if (cr && cr->id == 2)
                got = 1;
            else if (cr) {
                refit__rpc__response__free_unpacked(cr, NULL);
                cr = NULL;
            }
        }
        _exit(got && cr->code == -EACCES && strstr(cr->message, "engine's own process") ? 0 : 1);
    }
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "another process attached with the engine's token");
    at.token.data = token;
    q.id = 11;
    expect_raw(ins, &q, 0, "attached to engine");
    big_push_arrives(ins);
    q.id = 12;
    expect_raw(ins, &q, -EISCONN, "already attached");
    cr_assert_eq(rf_rpc_dial(H.path, &ins2, NULL), 0);
    raw_hello(ins2, REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER);
    q.id = 13;
    expect_raw(ins2, &q, -EBUSY, "has an installer attached");
    /* Trainer memory comes on a back channel, and only from a daemon that copies from
     * trainers on its host (its node answers; this registry has no such callback). */
    q.id = 14;
    q.body_case = REFIT__RPC__REQUEST__BODY_INSTALL_SOURCES;
    q.install_sources = &sg;
    expect_raw(ins, &q, -EINVAL, "without its back channel");
    cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
    q.id = 15;
    cr_assert_eq(rf_rpc_send(ins, &q, sv[1], NULL), 0);
    close(sv[1]);
    {
        r = raw_read(ins);
        cr_assert_eq(r->code, -ENOKEY, "%d: %s", r->code, r->message);
        cr_assert(strstr(r->message, "no trainer memory to give"), "%s", r->message);
        refit__rpc__response__free_unpacked(r, NULL);
    }
    /* The registry closes its copy of the back channel (after its answer, so it is waited
     * for): nothing was passed on it, the next read is the end. */
    {
        struct pollfd pf = {.fd = sv[0], .events = POLLIN};
        char b;

        cr_assert_eq(poll(&pf, 1, 10000), 1, "the registry kept the back channel open");
        cr_assert_eq(recv(sv[0], &b, 1, MSG_DONTWAIT), 0);
        close(sv[0]);
    }
    /* InstallSign, which signed an Export proof for any nonce, is gone, key or not. */
    test_loop_run(&H.l, set_key, NULL);
    cr_assert_eq(write(ins, sign_frame, sizeof(sign_frame)), (ssize_t)sizeof(sign_frame));
    {
        r = raw_read(ins);
        cr_assert_eq(r->id, 16);
        cr_assert_eq(r->code, -EOPNOTSUPP, "%d: %s", r->code, r->message);
        cr_assert(strstr(r->message, "unknown request"), "%s", r->message);
        refit__rpc__response__free_unpacked(r, NULL);
    }
    close(ins2);
    close(ins);
    close(eng);
}

Test(registry, inproc_refused_for_trainers_and_installers_on_the_publisher)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion rr = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__Hello h = REFIT__RPC__HELLO__INIT;
    int fd, fd2;

    open_registry(RF_SRC, 1);
    cr_assert_eq(rf_rpc_dial(H.path, &fd, NULL), 0);
    raw_hello(fd, REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER);
    q.id = 2;
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    q.register_region = &rr;
    rr.kind = REFIT__RPC__MEM_KIND__MEM_INPROC;
    rr.device = "host";
    rr.size = 4096;
    expect_raw(fd, &q, -EINVAL, "in-process regions are for engines");
    cr_assert_eq(rf_rpc_dial(H.path, &fd2, NULL), 0);
    q.id = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    q.hello = &h;
    h.protocol_version = RF_RPC_PROTOCOL_VERSION;
    h.kind = REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER;
    expect_raw(fd2, &q, -EOPNOTSUPP, "installers serve engines");
    close(fd2);
    close(fd);
}

/* FP8 pieces (issue 15): an engine registers one with its scales; each refusal names why. */
Test(registry, fp8_pieces_and_their_refusals)
{
    int64_t sh[2] = {128, 128}, s0[2] = {0, 0}, half[2] = {64, 128}, whole[2] = {128, 128};
    int64_t ssh[2];
    size_t ses;
    refit_client *e;
    uint32_t r, rs, ri, ris;
    void *p, *ps, *pi = malloc(128 * 128), *pis = malloc(64);

    cr_assert_eq(refit_fp8_scale_shape("block:64x64", 2, sh, s0, whole, ssh, &ses), 0);
    cr_assert(ssh[0] == 2 && ssh[1] == 2 && ses == 4);
    cr_assert_eq(refit_fp8_scale_shape("mxfp8", 2, sh, s0, half, ssh, &ses), 0);
    cr_assert(ssh[0] == 64 && ssh[1] == 4 && ses == 1);
    cr_assert_eq(refit_fp8_scale_shape("nonsense", 2, sh, s0, half, ssh, &ses), -EINVAL);
    open_registry(RF_DST, 1);
    e = conn("e0", 0, REFIT_ENGINE);
    OK(refit_alloc_host(e, 128 * 128, &p, &r), e);
    OK(refit_alloc_host(e, 64, &ps, &rs), e);
    OK(refit_region_inproc(e, pi, 128 * 128, &ri), e);
    OK(refit_region_inproc(e, pis, 64, &ris), e);
    FAILS(refit_add_piece_fp8(e, "w", REFIT_BF16, 2, sh, r, 0, s0, whole, NULL, "block:7",
                              rs, 0, NULL), e, -EINVAL, "quantization format \"block:7\"");
    FAILS(refit_add_piece_fp8(e, "w", REFIT_BF16, 2, sh, r, 0, s0, whole, NULL, "block:64x64",
                              9, 0, NULL), e, -ENOENT, "keeps its scales in unknown region 9");
    FAILS(refit_add_piece_fp8(e, "w", REFIT_BF16, 2, sh, r, 0, s0, half, NULL, "block",
                              rs, 0, NULL), e, -EINVAL, "cuts the 128x128 blocks");
    FAILS(refit_add_piece_fp8(e, "w", REFIT_BF16, 2, sh, r, 0, s0, whole, NULL, "block:64x64",
                              rs, 60, NULL), e, -EINVAL, "FP8 scales of w lie outside");
    FAILS(refit_add_piece_fp8(e, "w", REFIT_INT32, 2, sh, r, 0, s0, whole, NULL, "block:64x64",
                              rs, 0, NULL), e, -EINVAL, "quantized from int32");
    OK(refit_add_piece_fp8(e, "w", REFIT_BF16, 2, sh, r, 0, s0, whole, NULL, "block:64x64", rs,
                           0, NULL), e);
    /* In-process memory too, its scales beside it: the engine's own installer quantizes
     * (e2e 62). */
    OK(refit_add_piece_fp8(e, "wi", REFIT_BF16, 2, sh, ri, 0, s0, whole, NULL, "block:64x64",
                           ris, 0, NULL), e);
    OK(refit_seal(e), e);
    refit_close(e);
    free(pi);
    free(pis);
}

/* A trainer that holds a weight in FP8 registers it as engines do (its bytes and scales are
 * copied as they are); the same checks hold, here a box off the grid. */
Test(registry, fp8_pieces_of_trainers)
{
    int64_t sh[2] = {128, 128}, s0[2] = {0, 0}, whole[2] = {128, 128}, half[2] = {96, 128};
    refit_client *t;
    uint32_t r;
    void *p;

    open_registry(RF_SRC, 1);
    t = conn("t0", 0, REFIT_TRAINER);
    OK(refit_alloc_host(t, 128 * 128 * 2, &p, &r), t);
    OK(refit_add_piece_fp8(t, "w", REFIT_BF16, 2, sh, r, 0, s0, whole, NULL, "block:64x64", r,
                           128 * 128, NULL), t);
    FAILS(refit_add_piece_fp8(t, "v", REFIT_BF16, 2, sh, r, 0, s0, half, NULL, "block:64x64",
                              r, 128 * 128, NULL), t, -EINVAL, "cuts the 64x64 blocks");
    refit_close(t);
}
