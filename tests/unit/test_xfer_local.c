/* tests/unit/test_xfer_local.c - the local transport on host memory: jobs of local messages made
 * from real plans (trainer and engine endpoints on one host) over memfd memory, every
 * destination byte checked; the digests against an independent BLAKE2b of the packed source,
 * and a corrupted copy caught; a warm job that allocates nothing; an abort that lands mid-copy
 * and a deadline, each followed by a good job; and the checks that refuse anything but local
 * messages on the local transport, and local messages anywhere else. */
#include <criterion/criterion.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "copy.h"
#include "layout.h"
#include "macros.h"
#include "model.h"
#include "plan.h"
#include "xfer.h"
#include "xfer_data.h"
#include "slice.h"
#include "local_world.h"
#include "xfer_local_int.h"

#ifdef RF_HAVE_CUDA
#include "drv_cuda.h"
#endif

/* ---- memory: every region a memfd mapped here, as a trainer's and an engine's are --------- */

typedef struct cluster {
    const rf_inv *inv;
    uint32_t nregions;
    uint8_t **bases;
    size_t *lens;
} cluster;

static void cluster_alloc(cluster *c, const rf_inv *inv)
{
    c->inv = inv;
    c->nregions = rf_inv_nregions(inv);
    c->bases = calloc(c->nregions, sizeof(*c->bases));
    c->lens = calloc(c->nregions, sizeof(*c->lens));
    for (uint32_t r = 0; r < c->nregions; r++) {
        int fd = memfd_create("refit-test-region", MFD_CLOEXEC);

        c->lens[r] = rf_inv_region(inv, r)->size + 1;
        cr_assert(fd >= 0);
        cr_assert_eq(ftruncate(fd, (off_t)c->lens[r]), 0);
        c->bases[r] = mmap(NULL, c->lens[r], PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        cr_assert_neq(c->bases[r], MAP_FAILED);
        close(fd);
        memset(c->bases[r], 0xee, c->lens[r]);
    }
}

static void cluster_free(cluster *c)
{
    for (uint32_t r = 0; r < c->nregions; r++)
        munmap(c->bases[r], c->lens[r]);
    free(c->bases);
    free(c->lens);
}

static void check_destinations(cluster *c, uint64_t version)
{
    uint64_t wrong, stray;

    xd_check(c->inv, c->bases, version, &wrong, &stray);
    cr_assert_eq(wrong, 0, "%llu destination bytes wrong", (unsigned long long)wrong);
    cr_assert_eq(stray, 0, "%llu bytes outside destination pieces written",
                 (unsigned long long)stray);
}

/* ---- local jobs from a plan ---------------------------------------------------------------- */

/* The engine side's job: one local message per plan message, its transfers tiling the payload
 * in plan order, each item with its source twin (what the planner's RF_PLAN_LOCAL messages
 * become in a receiving daemon). */
static void local_job(const rf_plan *pl, uint8_t *const *bases, uint64_t version, int verify,
                      rf_xfer_job *job)
{
    rf_err err = {0};

    memset(job, 0, sizeof(*job));
    cr_assert_eq(rf_slice_local_job_from_plan(pl, bases, job, &err), 0, "%s", err.msg);
    job->version = version;
    job->timeout_s = 30;
    job->verify = verify;
}

static void job_free(rf_xfer_job *j)
{
    rf_slice_local_job_free(j);
    memset(j, 0, sizeof(*j));
}

/* The digest xfer.h defines, apart from the transport: BLAKE2b-256(seq LE || the first
 * digest bytes of the message's source packed in payload order), XORed into acc. */
static void digest_ref(const rf_xfer_job *job, const rf_xfer_msg *m, bool dst_side,
                       uint8_t acc[RF_XFER_DIGEST_BYTES])
{
    crypto_generichash_state st;
    uint8_t le[4] = {(uint8_t)m->seq, (uint8_t)(m->seq >> 8), (uint8_t)(m->seq >> 16),
                     (uint8_t)(m->seq >> 24)};
    uint8_t h[RF_XFER_DIGEST_BYTES], *payload = malloc(m->bytes + 1);
    rf_err err;

    if (!rf_xfer_msg_verified(job, m)) {
        free(payload);
        return;
    }
    for (uint32_t k = 0; k < m->nitems; k++) {
        const rf_xfer_item *it = dst_side ? &m->items[k] : &m->src_items[k];
        rf_copy_desc d;

        rf_copy_desc_set(&d, it->base, &it->piece, it->ndim, it->esize, &it->box, it->msg_off);
        cr_assert_eq(rf_copy_gather(&d, 1, payload, &err), 0, "%s", err.msg);
    }
    crypto_generichash_init(&st, NULL, 0, sizeof(h));
    crypto_generichash_update(&st, le, sizeof(le));
    crypto_generichash_update(&st, payload, rf_xfer_msg_digest_bytes(job, m));
    crypto_generichash_final(&st, h, sizeof(h));
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
        acc[i] ^= h[i];
    free(payload);
}

static void digests_are_the_reference(const world *w, const rf_xfer_job *job)
{
    uint8_t want[RF_XFER_DIGEST_BYTES] = {0}, zero[RF_XFER_DIGEST_BYTES] = {0};

    for (uint32_t i = 0; i < job->nmsgs; i++)
        digest_ref(job, &job->msgs[i], false, want);
    if (job->verify != RF_VERIFY_OFF)
        cr_assert_neq(memcmp(want, zero, sizeof(zero)), 0, "no message was verified");
    cr_assert_eq(memcmp(w->res.digest_sent, want, sizeof(want)), 0,
                 "digest_sent is not BLAKE2b of the packed source (verify %d)", job->verify);
    cr_assert_eq(memcmp(w->res.digest_recv, want, sizeof(want)), 0,
                 "digest_recv differs from the source's (verify %d)", job->verify);
}

/* qwen3-0.6b shrunk 16x, trainer tp=2 and engine tp=4, every endpoint on host 7. */
static rf_inv *colocated_qwen3(const char *src, const char *dst)
{
    rf_model *m = NULL, *s = NULL;
    rf_inv *inv = rf_inv_new();
    rf_par ps, pd;
    rf_err err;

    cr_assert_eq(rf_model_load("qwen3-0.6b", &m, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(m, 16, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse(src, RF_SRC, s, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse(dst, RF_DST, s, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(s, &ps, &pd, 8, inv, &err), 0, "%s", err.msg);
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++)
        cr_assert_eq(rf_inv_set_endpoint_host(inv, e, 7, &err), 0, "%s", err.msg);
    rf_model_free(s);
    rf_model_free(m);
    return inv;
}

/* ---- refits -------------------------------------------------------------------------------- */

/* A real plan, three verify settings, one thread and the pool: every destination byte is the
 * source's, the digests are BLAKE2b of the packed bytes, and a warm job of the same plan_key
 * (a new version's bytes) allocates nothing. */
Test(xfer_local, plan_byte_for_byte_digests_and_warm_jobs)
{
    static const int verify[3] = {RF_VERIFY_FULL, RF_VERIFY_SAMPLE, RF_VERIFY_OFF};
    rf_inv *inv = colocated_qwen3("tp=2", "tp=4");
    rf_plan_opts o;
    rf_plan *pl = NULL;
    cluster c;
    world w;
    rf_err err;
    uint64_t version = 1, total = 0;

    rf_plan_opts_default(&o);
    o.staging_bytes = 64 << 10;
    o.direct_min_bytes = 16 << 10;
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cluster_alloc(&c, inv);
    world_open(&w, false);
    for (uint32_t i = 0; i < rf_plan_nmsgs(pl); i++)
        total += rf_plan_msg_at(pl, i)->bytes;
    cr_assert_gt(rf_plan_nmsgs(pl), 16, "the sample must pick some messages and not others");
    for (int threads = 1; threads <= 3; threads += 2) {
        cr_assert_eq(rf_xfer_local_set_threads(w.t, (unsigned)threads, &err), 0, "%s", err.msg);
        for (int v = 0; v < 3; v++) {
            rf_xfer_job job;
            uint64_t a0, a1;

            local_job(pl, c.bases, version, verify[v], &job);
            cr_assert_eq(rf_xfer_job_check(&job, 2, &err), 0, "%s", err.msg);
            job.checked = true;
            job.plan_key = 100 + (uint64_t)v;
            for (int warm = 0; warm < 2; warm++, version++) {
                job.version = version;
                xd_fill(inv, c.bases, version);
                rf_xfer_local_stats(w.t, &a0, NULL, NULL);
                world_run(&w, &job, false);
                rf_xfer_local_stats(w.t, &a1, NULL, NULL);
                cr_assert_eq(w.res.code, 0, "%s", w.res.error);
                cr_assert_eq(w.res.bytes_recv, total);
                cr_assert_eq(w.res.bytes_sent, 0);
                cr_assert_eq(w.res.peak_staging, 0, "a local copy uses no staging");
                cr_assert_eq(rf_xfer_progress(w.t), total);
                check_destinations(&c, version);
                digests_are_the_reference(&w, &job);
                if (warm)
                    cr_assert_eq(a1, a0, "the warm job of threads %d verify %d made %llu "
                                 "allocations", threads, verify[v],
                                 (unsigned long long)(a1 - a0));
                else
                    cr_assert_gt(a1, a0, "a cold job derives its plan");
            }
            job_free(&job);
        }
    }
    world_close(&w);
    cluster_free(&c);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* A job set up ahead (rf_xfer_prepare) moves nothing, derives the plan, and the job of that
 * plan_key then runs warm: the first refit of a plan does its setup before Start. */
Test(xfer_local, prepare_derives_the_plan_and_moves_nothing)
{
    rf_inv *inv = colocated_qwen3("tp=2", "tp=4");
    rf_plan_opts o;
    rf_plan *pl = NULL;
    rf_xfer_job job;
    cluster c;
    world w;
    rf_err err;
    uint64_t a0, a1, a2;

    rf_plan_opts_default(&o);
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cluster_alloc(&c, inv);
    world_open(&w, false);
    cr_assert_eq(rf_xfer_local_set_threads(w.t, 2, &err), 0, "%s", err.msg);
    local_job(pl, c.bases, 1, RF_VERIFY_SAMPLE, &job);
    job.plan_key = 1;
    xd_fill(inv, c.bases, 1);
    world_run(&w, &job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    check_destinations(&c, 1);

    /* The trainers hold version 2; the next plan is set up while engines still serve 1. */
    xd_fill(inv, c.bases, 2);
    job.plan_key = 2;
    job.version = 2;
    rf_xfer_local_stats(w.t, &a0, NULL, NULL);
    world_prepare(&w, &job);
    rf_xfer_local_stats(w.t, &a1, NULL, NULL);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    cr_assert_eq(w.res.bytes_recv + w.res.bytes_sent, 0);
    cr_assert_eq(rf_xfer_progress(w.t), 0);
    cr_assert_gt(a1, a0, "setting up a new plan_key derives its plan");
    check_destinations(&c, 1);

    world_run(&w, &job, false);
    rf_xfer_local_stats(w.t, &a2, NULL, NULL);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    cr_assert_eq(a2, a1, "the job after its setup made %llu allocations",
                 (unsigned long long)(a2 - a1));
    check_destinations(&c, 2);
    job_free(&job);
    world_close(&w);
    cluster_free(&c);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* Engine ep over tp x dp and a trainer with expert parallelism: many small strided boxes. */
Test(xfer_local, expert_layouts_byte_for_byte)
{
    rf_model *m = NULL, *s = NULL;
    rf_inv *inv = rf_inv_new();
    rf_par ps, pd;
    rf_plan *pl = NULL;
    rf_xfer_job job;
    cluster c;
    world w;
    rf_err err;

    cr_assert_eq(rf_model_load("qwen3-30b-a3b", &m, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(m, 32, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=2,ep=2", RF_SRC, s, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=4", RF_DST, s, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(s, &ps, &pd, 8, inv, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s", err.msg);
    cluster_alloc(&c, inv);
    xd_fill(inv, c.bases, 5);
    local_job(pl, c.bases, 5, RF_VERIFY_FULL, &job);
    world_open(&w, false);
    world_run(&w, &job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    check_destinations(&c, 5);
    digests_are_the_reference(&w, &job);
    world_close(&w);
    job_free(&job);
    cluster_free(&c);
    rf_plan_free(pl);
    rf_inv_free(inv);
    rf_model_free(s);
    rf_model_free(m);
}

/* ---- a large job by hand: one fp32 matrix, rows padded in the engine's copy -------------- */

#define ROWS 32768
#define COLS 1024
#define PADC 1040 /* engine row stride, elements */
#define MSG_ROWS 128

typedef struct big {
    uint8_t *src, *dst;
    size_t slen, dlen;
    rf_xfer_job job;
    uint32_t nall; /* messages allocated (a test may run fewer) */
} big;

static uint8_t *map_memfd(size_t len)
{
    int fd = memfd_create("refit-test-big", MFD_CLOEXEC);
    uint8_t *p;

    cr_assert(fd >= 0);
    cr_assert_eq(ftruncate(fd, (off_t)len), 0);
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq(p, MAP_FAILED);
    close(fd);
    return p;
}

static rf_xfer_item item2d(uint8_t *base, const int64_t *strides, int64_t row0, int64_t rows)
{
    rf_xfer_item it;

    memset(&it, 0, sizeof(it));
    it.base = base;
    it.ndim = 2;
    it.esize = 4;
    rf_box_full(&it.piece.box, 2, (int64_t[]){ROWS, COLS});
    it.piece.strides[0] = strides[0];
    it.piece.strides[1] = strides[1];
    it.box = it.piece.box;
    it.box.start[0] = row0;
    it.box.extent[0] = rows;
    it.bytes = (uint64_t)rows * COLS * 4;
    return it;
}

/* ROWS x COLS fp32 from a dense source into a row-padded destination, MSG_ROWS rows a
 * message, each message two items (its halves, in reverse msg_off order). */
static void big_init(big *b, uint64_t version)
{
    uint32_t n = ROWS / MSG_ROWS;
    int64_t ss[2] = {COLS, 1}, ds[2] = {PADC, 1};

    memset(b, 0, sizeof(*b));
    b->slen = (size_t)ROWS * COLS * 4;
    b->dlen = (size_t)ROWS * PADC * 4;
    b->src = map_memfd(b->slen);
    b->dst = map_memfd(b->dlen);
    for (size_t i = 0; i < b->slen / 8; i++)
        ((uint64_t *)b->src)[i] = i * 0x9e3779b97f4a7c15ull + version;
    memset(b->dst, 0xee, b->dlen);
    b->job = (rf_xfer_job){.version = version, .nrounds = 1, .nmsgs = n, .timeout_s = 30,
                           .verify = RF_VERIFY_SAMPLE, .plan_key = 9};
    b->job.msgs = calloc(n, sizeof(rf_xfer_msg));
    b->nall = n;
    for (uint32_t i = 0; i < n; i++) {
        rf_xfer_msg *m = &b->job.msgs[i];
        int64_t r0 = (int64_t)i * MSG_ROWS, h = MSG_ROWS / 2;

        *m = (rf_xfer_msg){.seq = i, .kind = RF_PLAN_LOCAL, .nitems = 2,
                           .bytes = (uint64_t)MSG_ROWS * COLS * 4};
        m->items = calloc(2, sizeof(rf_xfer_item));
        m->src_items = calloc(2, sizeof(rf_xfer_item));
        m->items[0] = item2d(b->dst, ds, r0 + h, h);
        m->src_items[0] = item2d(b->src, ss, r0 + h, h);
        m->items[1] = item2d(b->dst, ds, r0, h);
        m->src_items[1] = item2d(b->src, ss, r0, h);
        m->items[0].msg_off = m->src_items[0].msg_off = (uint64_t)h * COLS * 4;
    }
}

static void big_check(const big *b)
{
    for (size_t r = 0; r < ROWS; r++) {
        cr_assert_eq(memcmp(b->dst + r * PADC * 4, b->src + r * COLS * 4, COLS * 4), 0,
                     "row %zu differs", r);
        for (size_t c = COLS * 4; c < PADC * 4; c++)
            cr_assert_eq(b->dst[r * PADC * 4 + c], 0xee, "padding of row %zu written", r);
    }
}

static void big_free(big *b)
{
    munmap(b->src, b->slen);
    munmap(b->dst, b->dlen);
    b->job.nmsgs = b->nall;
    job_free(&b->job);
}

/* The abort is sent once bytes have been copied: the job fails with -ECANCELED soon after,
 * having copied part of the job, names what was left, and the next job on the same transport
 * copies everything. */
Test(xfer_local, abort_lands_mid_copy_then_good_job)
{
    big b;
    world w;
    uint64_t total;
    rf_err err;

    big_init(&b, 3);
    total = (uint64_t)ROWS * COLS * 4;
    world_open(&w, false);
    for (int threads = 1; threads <= 2; threads++) {
        cr_assert_eq(rf_xfer_local_set_threads(w.t, (unsigned)threads, &err), 0, "%s", err.msg);
        world_run(&w, &b.job, true);
        cr_assert_eq(w.res.code, -ECANCELED, "threads %d: %d %s", threads, w.res.code,
                     w.res.error);
        cr_assert(strstr(w.res.error, "aborted with local copy of message seq") != NULL, "%s",
                  w.res.error);
        cr_assert_gt(w.res.bytes_recv, 0);
        cr_assert_lt(w.res.bytes_recv, total, "the abort came after the whole copy");
        cr_assert_lt(w.t_done - w.t_abort, 0.5, "the abort took %.3f s to end the job",
                     w.t_done - w.t_abort);
    }
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    cr_assert_eq(w.res.bytes_recv, total);
    big_check(&b);
    world_close(&w);
    big_free(&b);
}

/* A deadline far shorter than the copy: -ETIMEDOUT naming the message it stopped at, part of
 * the bytes copied; then the same job with time enough. */
Test(xfer_local, deadline_then_good_job)
{
    big b;
    world w;

    big_init(&b, 4);
    b.job.timeout_s = 0.002;
    world_open(&w, false);
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, -ETIMEDOUT, "%d %s", w.res.code, w.res.error);
    cr_assert(strstr(w.res.error, "deadline of 0.0 s passed with local copy of message seq") !=
              NULL, "%s", w.res.error);
    cr_assert_lt(w.res.bytes_recv, (uint64_t)ROWS * COLS * 4);
    b.job.timeout_s = 30;
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    big_check(&b);
    world_close(&w);
    big_free(&b);
}

/* Corruption between the two digests: a message whose items' destinations overlap (a job built
 * wrong) leaves in memory bytes other than the source's, and the daemon's XOR is not zero; its
 * sent digest is still the source's. */
Test(xfer_local, overlapping_destinations_break_the_digest)
{
    big b;
    world w;
    uint8_t zero[RF_XFER_DIGEST_BYTES] = {0}, x[RF_XFER_DIGEST_BYTES], want[RF_XFER_DIGEST_BYTES] =
        {0};
    rf_xfer_msg *m;

    big_init(&b, 6);
    b.job.verify = RF_VERIFY_FULL;
    b.job.nmsgs = 1;
    m = &b.job.msgs[0];
    /* Item 0 (rows 64..127 of the source) lands on rows 32..95 of the destination. */
    m->items[0].base = b.dst - (size_t)32 * PADC * 4;
    world_open(&w, false);
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    digest_ref(&b.job, m, false, want);
    cr_assert_eq(memcmp(w.res.digest_sent, want, sizeof(want)), 0);
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
        x[i] = w.res.digest_sent[i] ^ w.res.digest_recv[i];
    cr_assert_neq(memcmp(x, zero, sizeof(zero)), 0, "a corrupted copy passed verification");
    world_close(&w);
    big_free(&b);
}

/* ---- checks -------------------------------------------------------------------------------- */

static void expect_refused(world *w, rf_xfer_job *job, const char *what)
{
    rf_err err;

    cr_assert_eq(rf_xfer_run(w->t, job, world_on_done, w, &err), -EINVAL, "expected: %s", what);
    cr_assert(strstr(err.msg, what) != NULL, "%s (expected: %s)", err.msg, what);
}

Test(xfer_local, job_checks_refuse_malformed_local_messages)
{
    big b;
    world w;
    rf_xfer_item *keep;
    rf_xfer_transport *tcp = NULL;
    const char *addrs[2] = {"127.0.0.1:1", "127.0.0.1:2"};
    rf_err err;

    big_init(&b, 1);
    b.job.nmsgs = 2;
    world_open(&w, false);

    keep = b.job.msgs[1].src_items;
    b.job.msgs[1].src_items = NULL;
    expect_refused(&w, &b.job, "local message seq 1 has 2 items and no source items");
    b.job.msgs[1].src_items = keep;

    b.job.msgs[1].src_items[1].box.start[0] += 1;
    expect_refused(&w, &b.job, "must be the same box");
    b.job.msgs[1].src_items[1].box.start[0] -= 1;

    b.job.msgs[1].src_items[0].box.start[0] = ROWS - 1;
    expect_refused(&w, &b.job, "message seq 1 source item 0");
    b.job.msgs[1].src_items[0].box.start[0] = MSG_ROWS + MSG_ROWS / 2;

    b.job.msgs[1].src_items[0].base = NULL;
    expect_refused(&w, &b.job, "source item 0");
    b.job.msgs[1].src_items[0].base = b.src;

    b.job.msgs[0].send = true;
    expect_refused(&w, &b.job, "local message seq 0 is marked as sent");
    b.job.msgs[0].send = false;

    b.job.msgs[0].items[0].msg_off = b.job.msgs[0].src_items[0].msg_off = 0;
    expect_refused(&w, &b.job, "overlap");
    b.job.msgs[0].items[0].msg_off = b.job.msgs[0].src_items[0].msg_off =
        (uint64_t)MSG_ROWS / 2 * COLS * 4;

    /* A packed message on the local transport, with and without source items. */
    b.job.msgs[1].kind = RF_PLAN_PACKED;
    expect_refused(&w, &b.job, "message seq 1 (packed) has source items");
    keep = b.job.msgs[1].src_items;
    b.job.msgs[1].src_items = NULL;
    expect_refused(&w, &b.job, "xfer local: message seq 1 is packed, not a local copy");
    b.job.msgs[1].src_items = keep;
    b.job.msgs[1].kind = RF_PLAN_LOCAL;

    /* A local message on the tcp transport, even in a job marked checked. */
    cr_assert_eq(rf_xfer_tcp_new(&w.loop, "127.0.0.1:0", &tcp, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_set_peers(tcp, 1, 2, addrs, &err), 0, "%s", err.msg);
    b.job.checked = true;
    cr_assert_eq(rf_xfer_run(tcp, &b.job, world_on_done, &w, &err), -EINVAL);
    cr_assert(strstr(err.msg, "xfer tcp: message seq 0 is a local copy") != NULL, "%s", err.msg);
    rf_xfer_close(tcp, NULL, NULL);

    /* The good job runs after all of that. */
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    world_close(&w);
    big_free(&b);
}

/* A job marked checked whose pair is malformed all the same: refused when the transport
 * reduces it, before a byte moves, naming the message. */
Test(xfer_local, checked_job_with_bad_pair_fails_before_copying)
{
    big b;
    world w;

    big_init(&b, 2);
    b.job.nmsgs = 2;
    b.job.checked = true;
    b.job.plan_key = 0;
    b.job.msgs[1].src_items[1].esize = 2;
    b.job.msgs[1].src_items[1].bytes = b.job.msgs[1].items[1].bytes;
    world_open(&w, false);
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, -EINVAL, "%s", w.res.error);
    cr_assert(strstr(w.res.error, "local message seq 1") != NULL, "%s", w.res.error);
    cr_assert_eq(w.res.bytes_recv, 0);
    for (size_t i = 0; i < b.dlen; i++)
        cr_assert_eq(b.dst[i], 0xee, "byte %zu written by a refused job", i);
    world_close(&w);
    big_free(&b);
}

Test(xfer_local, gpu_memory_needs_cuda_and_a_device)
{
    uv_loop_t loop;
    rf_xfer_transport *t = NULL;
    rf_err err;
    int rc;

    cr_assert_eq(uv_loop_init(&loop), 0);
    rc = rf_xfer_local_new(&loop, true, &t, &err);
#ifdef RF_HAVE_CUDA
    if (rf_cuda_available()) {
        cr_assert_eq(rc, 0, "%s", err.msg);
        rf_xfer_close(t, NULL, NULL);
        uv_run(&loop, UV_RUN_DEFAULT);
    } else {
        cr_assert_eq(rc, -ENODEV);
        cr_assert(strstr(err.msg, "needs a CUDA device") != NULL, "%s", err.msg);
    }
#else
    cr_assert_eq(rc, -ENOTSUP);
    cr_assert(strstr(err.msg, "this build of refit has none") != NULL, "%s", err.msg);
#endif
    cr_assert_null(rc < 0 ? t : NULL);
    cr_assert_eq(uv_loop_close(&loop), 0);
}
