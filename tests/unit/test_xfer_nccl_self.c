/* tests/unit/test_xfer_nccl_self.c - the nccl transport on one GPU. NCCL takes one rank per GPU,
 * so one transport drives a world of one rank that sends to itself (NCCL's send/recv to self):
 * every message of a plan both sent and received in one job, as a relay's are. A bf16 plan
 * (qwen3 shrunk, trainer tp=2 -> engine tp=4, packed and direct messages over many rounds)
 * checked byte for byte, and FP8 engines (issue 15) of every format: quantized by the sender
 * into staging with the GPU quantizer, or copied from trainers' FP8 pieces, every installed FP8
 * byte and scale compared with the reference and the digests of both ends equal; the bf16
 * plan's digests (made on the GPU) also equal the host reference (wdigest) of its packed source.
 * Skipped without a CUDA device. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "layout.h"
#include "macros.h"
#include "model.h"
#include "plan.h"
#include "slice.h"
#include "qcopy.h"
#include "xfer.h"

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy.h"
#include "drv_cuda.h"
#include "wdigest.h"
#include "xfer_data.h"
#include "fp8_data.h"

#define NEED_GPU()                                                                    \
    do {                                                                              \
        if (!rf_cuda_available()) {                                                   \
            printf("skipped: no CUDA device\n");                                      \
            cr_skip_test("no CUDA device");                                           \
        }                                                                             \
    } while (0)

/* ---- a world of one rank ------------------------------------------------------------------ */

typedef struct self {
    uv_loop_t loop;
    uv_timer_t guard;
    rf_xfer_transport *t;
    rf_xfer_result res;
    bool got;
} self;

static void on_guard(uv_timer_t *h)
{
    (void)h;
    cr_assert_fail("a job did not finish within 60 s: the transport hangs");
}

static void self_open(self *w)
{
    const char *addrs[2] = {"trainers-daemon", "engines-daemon"};
    uint8_t uid[RF_XFER_NCCL_ID_BYTES];
    uint32_t rank = 0;
    int dev = 0;
    rf_xfer_world wd = {.nranks = 1, .nlocal = 1, .local_ranks = &rank, .local_devices = &dev};
    rf_err err;

    memset(w, 0, sizeof(*w));
    cr_assert_eq(uv_loop_init(&w->loop), 0);
    uv_timer_init(&w->loop, &w->guard);
    cr_assert_eq(rf_xfer_nccl_new(&w->loop, &w->t, &err), 0, "%s", err.msg);
    /* Peer 1 (the engines' daemon) is where the sends go, peer 0 where receives come from;
     * both are this transport's one rank. */
    cr_assert_eq(rf_xfer_set_peers(w->t, 0, 2, addrs, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_xfer_nccl_unique_id(uid, &err), 0, "%s", err.msg);
    memcpy(wd.unique_id, uid, sizeof(uid));
    cr_assert_eq(rf_xfer_set_world(w->t, &wd, &err), 0, "%s", err.msg);
}

static void on_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    self *w = arg;

    (void)t;
    cr_assert(!w->got, "done called twice");
    w->res = *res;
    w->got = true;
    uv_stop(&w->loop);
}

static void self_run(self *w, const rf_xfer_job *job)
{
    rf_err err;

    w->got = false;
    memset(&w->res, 0, sizeof(w->res));
    cr_assert_eq(rf_xfer_run(w->t, job, on_done, w, &err), 0, "%s", err.msg);
    uv_timer_start(&w->guard, on_guard, 60000, 0);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    uv_timer_stop(&w->guard);
    cr_assert(w->got);
}

static void on_closed(void *arg)
{
    *(int *)arg = 1;
}

static void self_close(self *w)
{
    int closed = 0;

    rf_xfer_close(w->t, on_closed, &closed);
    uv_close((uv_handle_t *)&w->guard, NULL);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    cr_assert_eq(closed, 1);
    cr_assert_eq(uv_loop_close(&w->loop), 0, "handles left open on the loop");
}

/* ---- memory and jobs ------------------------------------------------------------------------ */

/* Every region of inv on GPU 0 (dev), with a host mirror (host) to fill and check: one byte
 * past each region, all 0xee to begin with. */
typedef struct gmem {
    const rf_inv *inv;
    uint32_t n;
    uint8_t **dev, **host;
} gmem;

static void gmem_alloc(gmem *g, const rf_inv *inv, uint8_t **host)
{
    g->inv = inv;
    g->n = rf_inv_nregions(inv);
    g->dev = calloc(g->n, sizeof(*g->dev));
    g->host = host ? host : calloc(g->n, sizeof(*g->host));
    cr_assert(g->dev && g->host);
    cr_assert_eq(cudaSetDevice(0), cudaSuccess);
    for (uint32_t r = 0; r < g->n; r++) {
        uint64_t size = rf_inv_region(inv, r)->size + 1;

        cr_assert_eq(cudaMalloc((void **)&g->dev[r], size), cudaSuccess);
        if (!g->host[r])
            cr_assert_not_null(g->host[r] = malloc(size));
        memset(g->host[r], 0xee, size);
        cr_assert_eq(cudaMemcpy(g->dev[r], g->host[r], size, cudaMemcpyHostToDevice),
                     cudaSuccess);
    }
}

static void gmem_free(gmem *g)
{
    for (uint32_t r = 0; r < g->n; r++) {
        cudaFree(g->dev[r]);
        free(g->host[r]);
    }
    free(g->dev);
    free(g->host);
}

/* The mirrors of one side's regions to the GPU (sources) or back (destinations). */
static void gmem_sync(gmem *g, rf_side side)
{
    for (uint32_t r = 0; r < g->n; r++) {
        const rf_region *rg = rf_inv_region(g->inv, r);

        if (rf_inv_endpoint(g->inv, rg->endpoint)->side != side)
            continue;
        if (side == RF_SRC)
            cr_assert_eq(cudaMemcpy(g->dev[r], g->host[r], rg->size, cudaMemcpyHostToDevice),
                         cudaSuccess);
        else
            cr_assert_eq(cudaMemcpy(g->host[r], g->dev[r], rg->size + 1,
                                    cudaMemcpyDeviceToHost), cudaSuccess);
    }
}

/* The plan's messages as one job of this rank: each sent (to peer 1) and received (from peer
 * 0), in plan order, both ends rank 0; the staging budget of both daemons. */
static void self_job(const rf_plan *pl, const rf_plan_opts *o, uint8_t **bases, uint64_t version,
                     int verify, uint64_t key, rf_xfer_job *job)
{
    uint32_t n = rf_plan_nmsgs(pl);
    rf_err err;

    memset(job, 0, sizeof(*job));
    job->version = version;
    job->nrounds = rf_plan_nrounds(pl);
    job->timeout_s = 30;
    job->verify = verify;
    job->plan_key = key;
    for (int i = 0; i < RF_XFER_DIGEST_SEED_BYTES; i++)
        job->digest_seed[i] = (uint8_t)(i * 13 + 1);
    job->staging_bytes = 2 * o->staging_bytes;
    job->nmsgs = 2 * n;
    job->msgs = calloc(job->nmsgs ? job->nmsgs : 1, sizeof(rf_xfer_msg));
    cr_assert_not_null(job->msgs);
    for (uint32_t mi = 0; mi < n; mi++) {
        for (int d = 0; d < 2; d++) {
            rf_xfer_msg *m = &job->msgs[2 * mi + (uint32_t)d];

            cr_assert_eq(rf_slice_msg_from_plan(pl, mi, d == 0 ? RF_SRC : RF_DST, bases,
                                                d == 0 ? 1 : 0, m, &err), 0, "%s", err.msg);
            m->ep = m->peer_ep = 0;
        }
    }
}

static void job_free(rf_xfer_job *j)
{
    for (uint32_t i = 0; i < j->nmsgs; i++)
        free(j->msgs[i].items);
    free(j->msgs);
    memset(j, 0, sizeof(*j));
}

/* Runs job, which must succeed having sent and received every message's bytes (payload: FP8
 * ones are their elements and scales), digests equal when verifying. */
static void run_ok(self *w, const rf_xfer_job *job)
{
    uint8_t zero[RF_XFER_DIGEST_BYTES] = {0};
    uint64_t bytes = 0;

    for (uint32_t i = 0; i < job->nmsgs; i++)
        bytes += job->msgs[i].send ? job->msgs[i].bytes : 0;
    cr_assert_gt(bytes, 0);
    self_run(w, job);
    cr_assert_eq(w->res.code, 0, "version %llu: %s", (unsigned long long)job->version,
                 w->res.error);
    cr_assert_eq(w->res.bytes_sent, bytes);
    cr_assert_eq(w->res.bytes_recv, bytes);
    cr_assert_eq(memcmp(w->res.digest_sent, w->res.digest_recv, RF_XFER_DIGEST_BYTES), 0,
                 "the digests of what was sent and what was received differ");
    if (job->verify != RF_VERIFY_OFF)
        cr_assert_neq(memcmp(w->res.digest_sent, zero, sizeof(zero)), 0, "nothing digested");
}

/* ---- bf16 ---------------------------------------------------------------------------------- */

/* The XOR of the wdigest terms (hjob's seed) of hjob's verified sends, each payload packed from
 * the host mirrors its items point at: what both ends' digests must be. */
static void digest_ref(const rf_xfer_job *hjob, uint8_t out[RF_XFER_DIGEST_BYTES])
{
    rf_wdigest_key key;

    rf_wdigest_key_derive(hjob->digest_seed, &key);
    memset(out, 0, RF_XFER_DIGEST_BYTES);
    for (uint32_t i = 0; i < hjob->nmsgs; i++) {
        const rf_xfer_msg *m = &hjob->msgs[i];
        uint64_t db = rf_xfer_msg_digest_bytes(hjob, m);
        rf_wdigest_acc acc = {{0, 0}};
        uint8_t h[RF_XFER_DIGEST_BYTES], *payload;
        rf_err err;

        if (!m->send || !rf_xfer_msg_verified(hjob, m))
            continue;
        cr_assert_not_null(payload = malloc(m->bytes + 1));
        for (uint32_t k = 0; k < m->nitems; k++) {
            const rf_xfer_item *it = &m->items[k];
            rf_copy_desc d;

            rf_copy_desc_set(&d, it->base, &it->piece, it->ndim, it->esize, &it->box,
                             it->msg_off);
            cr_assert_eq(rf_copy_gather(&d, 1, payload, &err), 0, "%s", err.msg);
        }
        rf_wdigest_add(&key, 0, payload, db, &acc);
        rf_wdigest_term(&acc, m->seq, db, h);
        for (int b = 0; b < RF_XFER_DIGEST_BYTES; b++)
            out[b] ^= h[b];
        free(payload);
    }
}

/* qwen3-0.6b shrunk 16x, trainer tp=2 to engine tp=4, every source on endpoint 0 and every
 * destination on endpoint 1; a staging budget small enough for many rounds of both kinds of
 * message. Three versions: verified in full, sampled, and unverified with four rounds in
 * flight, the plan of execution kept between the last two. */
Test(xfer_nccl_self, bf16_plan_byte_for_byte_on_one_gpu)
{
    rf_model *m, *s;
    rf_inv *full = rf_inv_new(), *inv = NULL;
    rf_plan *pl = NULL;
    rf_plan_opts o = {.staging_bytes = 512 << 10, .direct_min_bytes = 16 << 10};
    rf_par ps, pd;
    rf_xfer_job job;
    gmem g;
    self w;
    rf_err err;

    NEED_GPU();
    cr_assert_eq(rf_model_load("qwen3-0.6b", &m, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(m, 16, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=2", RF_SRC, s, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=4", RF_DST, s, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(s, &ps, &pd, 8, full, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_fold_sides(full, &inv, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_plan_stats_get(pl)->direct_transfers, 0);
    cr_assert_gt(rf_plan_stats_get(pl)->packed_transfers, 0);
    cr_assert_geq(rf_plan_nrounds(pl), 3, "only %u rounds", rf_plan_nrounds(pl));
    gmem_alloc(&g, inv, NULL);
    self_open(&w);
    for (uint64_t v = 1; v <= 3; v++) {
        uint64_t wrong, stray;

        xd_fill(inv, g.host, v);
        gmem_sync(&g, RF_SRC);
        self_job(pl, &o, g.dev, v, v == 1 ? RF_VERIFY_FULL : v == 2 ? RF_VERIFY_SAMPLE
                                                                    : RF_VERIFY_OFF,
                 v >= 2 ? 5 : 0, &job);
        run_ok(&w, &job);
        cr_assert_eq(w.res.bytes_recv, rf_plan_stats_get(pl)->dst_bytes);
        if (job.verify != RF_VERIFY_OFF) {
            uint8_t want[RF_XFER_DIGEST_BYTES];
            rf_xfer_job hjob;

            self_job(pl, &o, g.host, v, job.verify, 0, &hjob);
            digest_ref(&hjob, want);
            cr_assert_eq(memcmp(w.res.digest_sent, want, sizeof(want)), 0,
                         "version %llu: the digest of what was sent is not the reference's",
                         (unsigned long long)v);
            job_free(&hjob);
        }
        gmem_sync(&g, RF_DST);
        xd_check(inv, g.host, v, &wrong, &stray);
        cr_assert_eq(wrong, 0, "version %llu: %llu destination bytes wrong",
                     (unsigned long long)v, (unsigned long long)wrong);
        cr_assert_eq(stray, 0, "version %llu: %llu bytes outside destination pieces written",
                     (unsigned long long)v, (unsigned long long)stray);
        job_free(&job);
    }
    self_close(&w);
    gmem_free(&g);
    rf_plan_free(pl);
    rf_inv_free(inv);
    rf_inv_free(full);
    rf_model_free(s);
    rf_model_free(m);
}

/* ---- FP8 engines (issue 15) ------------------------------------------------------------------ */

/* fp8_data.h's trainers (w rows in halves, experts two each) and FP8 engines of format name
 * (w rows in quarters unless e_only, one expert each) on two hosts, so every transfer goes
 * through staging; fp8_src: trainers holding the same format, copied as they are. Three
 * versions as above, every FP8 byte and scale against the reference of the trainers' values,
 * the plain pieces (the norm) byte for byte. */
static void fp8_refit(const char *name, bool e_only, bool fp8_src)
{
    rf_plan_opts o = {.staging_bytes = 32 << 10, .direct_min_bytes = 16 << 10};
    const rf_plan_stats *st;
    rf_quant_fmt q;
    rf_plan *pl = NULL;
    rf_xfer_job job;
    fixture f;
    gmem g;
    self w;
    rf_err err = {0};

    NEED_GPU();
    cr_assert_eq(rf_quant_fmt_parse(name, &q, &err), 0, "%s", err.msg);
    build(&f, &q, e_only, fp8_src, false);
    cr_assert_eq(rf_plan_build(f.inv, &o, &pl, &err), 0, "%s: %s", name, err.msg);
    st = rf_plan_stats_get(pl);
    cr_assert_gt(fp8_src ? st->fp8_copy_transfers : st->quant_transfers, 0,
                 "%s: no FP8 transfer planned", name);
    cr_assert_gt(rf_plan_nrounds(pl), 1, "%s: one round only", name);
    f.bases = calloc(rf_inv_nregions(f.inv), sizeof(*f.bases));
    gmem_alloc(&g, f.inv, f.bases);
    self_open(&w);
    for (uint64_t v = 1; v <= 3; v++) {
        xd_fill(f.inv, f.bases, v);
        fill_fp8_sources(&f, v);
        gmem_sync(&g, RF_SRC);
        self_job(pl, &o, g.dev, v, v == 1 ? RF_VERIFY_FULL : v == 2 ? RF_VERIFY_SAMPLE
                                                                    : RF_VERIFY_OFF,
                 v >= 2 ? 9 : 0, &job);
        run_ok(&w, &job);
        gmem_sync(&g, RF_DST);
        check_refit(&f, name, e_only, v);
        job_free(&job);
    }
    self_close(&w);
    gmem_free(&g); /* and f.bases, the mirrors */
    rf_plan_free(pl);
    rf_inv_free(f.inv);
}

Test(xfer_nccl_self, fp8_block_quantized_by_the_sender) { fp8_refit("block:32x64", false, false); }
Test(xfer_nccl_self, fp8_channel_quantized_by_the_sender) { fp8_refit("channel", false, false); }
Test(xfer_nccl_self, fp8_mxfp8_quantized_by_the_sender) { fp8_refit("mxfp8", false, false); }
Test(xfer_nccl_self, fp8_tensor_quantized_by_the_sender) { fp8_refit("tensor", true, false); }
Test(xfer_nccl_self, fp8_block_sources_copied) { fp8_refit("block:32x64", false, true); }
Test(xfer_nccl_self, fp8_mxfp8_sources_copied) { fp8_refit("mxfp8", false, true); }

/* ---- relays checked end to end ------------------------------------------------------------ */

/* Whether the job's relay trees have ends (xfer.h, rf_xfer_origin): receivers of relays that
 * list two origins or more, and senders of origins. */
static void relay_ends(const rf_xfer_job *job, uint64_t *multi, uint64_t *senders)
{
    *multi = *senders = 0;
    for (uint32_t i = 0; i < job->nmsgs; i++)
        for (uint32_t k = 0; k < job->msgs[i].nitems; k++) {
            *multi += job->msgs[i].items[k].norigins > 1;
            *senders += job->msgs[i].items[k].nrelay_to > 0;
        }
}

/* The same job as message digests alone would check it (relay messages with theirs). */
static void strip_ends(rf_xfer_job *job)
{
    for (uint32_t i = 0; i < job->nmsgs; i++) {
        job->msgs[i].e2e = false;
        for (uint32_t k = 0; k < job->msgs[i].nitems; k++)
            job->msgs[i].items[k].norigins = job->msgs[i].items[k].nrelay_to = 0;
    }
}

/* Runs plan pl (with relays) as one job of this rank: versions 1 to 3 in full, in sample,
 * and in full without the relay trees' ends, each checked (check) and with equal digests at
 * both ends; then version 3 again with the ends: the terms of both ends (read from device
 * staging or memory) agree, and they are there (its digests differ from those without). */
static void relay_runs(self *w, const rf_plan *pl, const rf_plan_opts *o, gmem *g,
                       void (*fill)(void *, uint64_t), void (*check)(void *, uint64_t), void *arg)
{
    uint8_t without[RF_XFER_DIGEST_BYTES];
    uint64_t multi, senders;
    rf_xfer_job job;

    for (uint64_t v = 1; v <= 3; v++) {
        fill(arg, v);
        gmem_sync(g, RF_SRC);
        self_job(pl, o, g->dev, v, v == 2 ? RF_VERIFY_SAMPLE : RF_VERIFY_FULL, 0, &job);
        relay_ends(&job, &multi, &senders);
        cr_assert(multi > 0 && senders > 0, "the relay trees have no ends to check");
        if (v == 3)
            strip_ends(&job);
        run_ok(w, &job);
        gmem_sync(g, RF_DST);
        check(arg, v);
        job_free(&job);
    }
    /* Version 3 again, with the trees' ends: its digests differ from those without. */
    memcpy(without, w->res.digest_sent, sizeof(without));
    self_job(pl, o, g->dev, 3, RF_VERIFY_FULL, 0, &job);
    run_ok(w, &job);
    cr_assert_neq(memcmp(without, w->res.digest_sent, sizeof(without)), 0,
                  "the relay trees' terms changed nothing: they were not computed");
    job_free(&job);
}

typedef struct bf16_ctx {
    const rf_inv *inv;
    gmem *g;
} bf16_ctx;

static void bf16_fill(void *arg, uint64_t v)
{
    bf16_ctx *c = arg;

    xd_fill(c->inv, c->g->host, v);
}

static void bf16_check(void *arg, uint64_t v)
{
    bf16_ctx *c = arg;
    uint64_t wrong, stray;

    xd_check(c->inv, c->g->host, v, &wrong, &stray);
    cr_assert(wrong == 0 && stray == 0, "version %llu: %llu bytes wrong, %llu stray",
              (unsigned long long)v, (unsigned long long)wrong, (unsigned long long)stray);
}

/* Relays over NCCL: qwen3 shrunk, trainer tp=2 to three engine replicas (tp=1,dp=3), relays
 * on, every endpoint this rank's: a relay's gather waits for the rounds before it, and each
 * replica fed by a relay checks the trainers' bytes end to end (the terms of both ends read
 * from the GPU), byte for byte right, under full and sample. */
Test(xfer_nccl_self, relays_checked_end_to_end)
{
    rf_model *m, *s;
    rf_inv *inv = rf_inv_new();
    rf_plan *pl = NULL;
    rf_plan_opts o = {.staging_bytes = 256 << 10, .direct_min_bytes = 64 << 10, .relay = 1};
    rf_par ps, pd;
    gmem g;
    self w;
    rf_err err;

    NEED_GPU();
    cr_assert_eq(rf_model_load("qwen3-0.6b", &m, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(m, 16, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=2", RF_SRC, s, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse("tp=1,dp=3", RF_DST, s, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(s, &ps, &pd, 8, inv, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_plan_stats_get(pl)->relay_messages, 0, "the plan relays nothing");
    gmem_alloc(&g, inv, NULL);
    self_open(&w);
    relay_runs(&w, pl, &o, &g, bf16_fill, bf16_check, &(bf16_ctx){.inv = inv, .g = &g});
    self_close(&w);
    gmem_free(&g);
    rf_plan_free(pl);
    rf_inv_free(inv);
    rf_model_free(s);
    rf_model_free(m);
}

static void fp8_fill(void *arg, uint64_t v)
{
    fixture *f = arg;

    xd_fill(f->inv, f->bases, v);
}

static void fp8_check(void *arg, uint64_t v)
{
    fixture *f = arg;

    for (int r = 0; r < 3; r++)
        cr_assert_eq(check_fp8(f, f->dst_w[r], v), 0, "version %llu: replica %d wrong",
                     (unsigned long long)v, r);
}

/* FP8 replicas (block:32x64, MXFP8) fed by relays over NCCL: two bf16 trainers hold w's column
 * halves, so each relayed chunk holds two origins, quantized by the sender on the GPU; the
 * replicas forward their FP8 elements and scales as they are, every byte and scale of each
 * against the reference, the terms of both ends equal. */
static void fp8_relays(const char *name)
{
    rf_plan_opts o = {.staging_bytes = 64 << 10, .direct_min_bytes = 4 << 20, .relay = 1};
    int64_t ws[2] = {W_ROWS, W_COLS}, s0[2] = {0, 0}, half[2] = {W_ROWS, W_COLS / 2};
    rf_quant_fmt q;
    rf_plan *pl = NULL;
    uint32_t ep, id;
    fixture f;
    gmem g;
    self w;
    rf_err err = {0};

    NEED_GPU();
    memset(&f, 0, sizeof(f));
    f.inv = rf_inv_new();
    cr_assert_eq(rf_quant_fmt_parse(name, &q, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_add_tensor(f.inv, "w.weight", RF_DT_BF16, 2, ws, &f.w, &err), 0);
    for (int r = 0; r < 2; r++) {
        int64_t st[2] = {0, r * W_COLS / 2};

        cr_assert_eq(rf_inv_add_endpoint(f.inv, RF_SRC, 0, &ep, &err), 0);
        cr_assert_eq(add(&f, ep, f.w, 2, st, half, NULL, &id, &err), 0, "%s", err.msg);
    }
    for (uint32_t r = 0; r < 3; r++) {
        cr_assert_eq(rf_inv_add_endpoint(f.inv, RF_DST, 1 + r, &ep, &err), 0);
        cr_assert_eq(add(&f, ep, f.w, 2, s0, ws, &q, &f.dst_w[r], &err), 0, "%s", err.msg);
    }
    f.nregions = rf_inv_nregions(f.inv);
    cr_assert_eq(rf_plan_build(f.inv, &o, &pl, &err), 0, "%s: %s", name, err.msg);
    cr_assert_gt(rf_plan_stats_get(pl)->relay_transfers, 0, "%s: no relays", name);
    f.bases = calloc(f.nregions, sizeof(*f.bases));
    gmem_alloc(&g, f.inv, f.bases);
    self_open(&w);
    relay_runs(&w, pl, &o, &g, fp8_fill, fp8_check, &f);
    self_close(&w);
    gmem_free(&g); /* and f.bases, the mirrors */
    rf_plan_free(pl);
    rf_inv_free(f.inv);
}

Test(xfer_nccl_self, fp8_block_relays_checked_end_to_end) { fp8_relays("block:32x64"); }
Test(xfer_nccl_self, fp8_mxfp8_relays_checked_end_to_end) { fp8_relays("mxfp8"); }

/* Scales the payload cannot take in place: bf16 tensors of an odd number of elements packed
 * before FP8 ones put the FP8 items' fp32 scales off a 4-byte boundary in staging; the sender
 * quantizes them into scratch and copies them into place. Trainers (host 1) hold every tensor
 * whole, the engine (host 2) the 64x64 and 64x128 ones in block:32x32 FP8. misplaced_scales
 * counts the FP8 items of the plan's sends whose scales lie so (the case must happen). */
static uint32_t misplaced_scales(const fixture *f, const rf_plan *pl)
{
    uint8_t **bases = calloc(f->nregions, sizeof(*bases)); /* the layout needs no memory */
    uint32_t misplaced = 0;
    rf_xfer_job job;

    cr_assert_not_null(bases);
    self_job(pl, &(rf_plan_opts){.staging_bytes = 1 << 20}, bases, 1, RF_VERIFY_OFF, 0, &job);
    for (uint32_t i = 0; i < job.nmsgs; i++) {
        const rf_xfer_msg *m = &job.msgs[i];

        for (uint32_t k = 0; m->send && k < m->nitems; k++) {
            const rf_xfer_item *it = &m->items[k];
            uint64_t fp8;

            if (it->quant.q.kind == 0)
                continue;
            cr_assert_eq(m->kind, RF_PLAN_PACKED);
            rf_qcopy_bytes(&it->quant.q, it->ndim, it->quant.rows, it->quant.cols, &it->box,
                           &fp8);
            misplaced += (it->msg_off + fp8) % 4 != 0;
        }
    }
    job_free(&job);
    free(bases);
    return misplaced;
}

Test(xfer_nccl_self, fp8_scales_after_odd_items_go_through_scratch)
{
    static const int64_t shapes[4][2] = {{1, 3}, {64, 64}, {1, 5}, {64, 128}};
    static const char *names[4] = {"a.weight", "w.weight", "b.weight", "v.weight"};
    rf_plan_opts o = {.staging_bytes = 1 << 20, .direct_min_bytes = 1 << 20};
    rf_quant_fmt q;
    rf_plan *pl = NULL;
    rf_xfer_job job;
    uint32_t t[4], ep[2], id, misplaced, nfp8 = 0, fp8ids[2];
    fixture f;
    gmem g;
    self w;
    rf_err err = {0};

    memset(&f, 0, sizeof(f));
    f.inv = rf_inv_new();
    cr_assert_eq(rf_quant_fmt_parse("block:32x32", &q, &err), 0, "%s", err.msg);
    for (int k = 0; k < 4; k++)
        cr_assert_eq(rf_inv_add_tensor(f.inv, names[k], RF_DT_BF16, 2, shapes[k], &t[k], &err),
                     0, "%s", err.msg);
    for (int side = 0; side < 2; side++) {
        cr_assert_eq(rf_inv_add_endpoint(f.inv, side ? RF_DST : RF_SRC, (uint32_t)side,
                                         &ep[side], &err), 0);
        cr_assert_eq(rf_inv_set_endpoint_host(f.inv, ep[side], 1 + side, &err), 0);
        for (int k = 0; k < 4; k++) {
            int64_t s0[2] = {0, 0};
            bool fp8 = side == 1 && shapes[k][0] > 1;

            cr_assert_eq(add(&f, ep[side], t[k], 2, s0, shapes[k], fp8 ? &q : NULL, &id, &err),
                         0, "%s", err.msg);
            if (fp8)
                fp8ids[nfp8++] = id;
        }
    }
    f.nregions = rf_inv_nregions(f.inv);
    cr_assert_eq(rf_plan_build(f.inv, &o, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_stats_get(pl)->quant_transfers, 2);
    /* The case happened: some FP8 item's scales lie off a 4-byte boundary. */
    misplaced = misplaced_scales(&f, pl);
    cr_assert_gt(misplaced, 0, "no FP8 item's scales are misplaced: the test tests nothing");
    if (!rf_cuda_available()) {
        rf_plan_free(pl);
        rf_inv_free(f.inv);
    }
    NEED_GPU();
    f.bases = calloc(f.nregions, sizeof(*f.bases));
    gmem_alloc(&g, f.inv, f.bases);
    self_open(&w);
    for (uint64_t v = 1; v <= 2; v++) {
        xd_fill(f.inv, f.bases, v);
        gmem_sync(&g, RF_SRC);
        self_job(pl, &o, g.dev, v, RF_VERIFY_FULL, 11, &job);
        run_ok(&w, &job);
        gmem_sync(&g, RF_DST);
        for (uint32_t k = 0; k < nfp8; k++)
            cr_assert_eq(check_fp8(&f, fp8ids[k], v), 0, "version %llu: FP8 piece %u wrong",
                         (unsigned long long)v, k);
        cr_assert_eq(check_plain(&f, v), 0, "version %llu: plain pieces wrong",
                     (unsigned long long)v);
        job_free(&job);
    }
    self_close(&w);
    gmem_free(&g);
    rf_plan_free(pl);
    rf_inv_free(f.inv);
}

#else
Test(xfer_nccl_self, built_without_cuda)
{
    printf("skipped: no CUDA device\n");
    cr_skip_test("no CUDA device");
}
#endif
