/* tests/unit/test_xfer_local_cuda.c - the local transport on GPU memory in one process: source and
 * destination regions cudaMalloc'd here (one GPU: same-device copies; two: the sources on the
 * other GPU, peer copies), jobs of local messages from real plans checked byte for byte through
 * host mirrors, digests (made on the GPU) against the host reference (wdigest) of the packed
 * source, warm jobs that allocate nothing, a corrupted copy caught by the digests, an abort that
 * lands mid-job and a deadline, each followed by a good job. Skipped without a CUDA device. */
#include <criterion/criterion.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "layout.h"
#include "macros.h"
#include "model.h"
#include "plan.h"
#include "xfer.h"

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy.h"
#include "drv_cuda.h"
#include "xfer_data.h"
#include "slice.h"
#include "local_world.h"
#include "wdigest.h"
#include "xfer_local_int.h"

#define NEED_GPU()                                                                    \
    do {                                                                              \
        if (!rf_cuda_available()) {                                                   \
            printf("skipped: no CUDA device\n");                                      \
            cr_skip_test("no CUDA device");                                           \
        }                                                                             \
    } while (0)

static int ngpus(void)
{
    int n = 0;

    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}


/* Every region on a GPU (sources on src_dev, destinations on dst_dev), with host mirrors. */
typedef struct cluster {
    const rf_inv *inv;
    uint32_t nregions;
    uint8_t **dev, **host;
} cluster;

static void cluster_alloc(cluster *c, const rf_inv *inv, int src_dev, int dst_dev)
{
    c->inv = inv;
    c->nregions = rf_inv_nregions(inv);
    c->dev = calloc(c->nregions, sizeof(*c->dev));
    c->host = calloc(c->nregions, sizeof(*c->host));
    for (uint32_t r = 0; r < c->nregions; r++) {
        const rf_region *rg = rf_inv_region(inv, r);

        cr_assert_eq(cudaSetDevice(rf_inv_endpoint(inv, rg->endpoint)->side == RF_SRC ? src_dev
                                                                                     : dst_dev),
                     cudaSuccess);
        cr_assert_eq(cudaMalloc((void **)&c->dev[r], rg->size + 1), cudaSuccess);
        c->host[r] = malloc(rg->size + 1);
        memset(c->host[r], 0xee, rg->size + 1);
    }
}

static void cluster_push(cluster *c)
{
    for (uint32_t r = 0; r < c->nregions; r++)
        cr_assert_eq(cudaMemcpy(c->dev[r], c->host[r], rf_inv_region(c->inv, r)->size + 1,
                                cudaMemcpyHostToDevice), cudaSuccess);
}

static void cluster_pull(cluster *c)
{
    for (uint32_t r = 0; r < c->nregions; r++)
        cr_assert_eq(cudaMemcpy(c->host[r], c->dev[r], rf_inv_region(c->inv, r)->size + 1,
                                cudaMemcpyDeviceToHost), cudaSuccess);
}

static void cluster_free(cluster *c)
{
    for (uint32_t r = 0; r < c->nregions; r++) {
        cudaFree(c->dev[r]);
        free(c->host[r]);
    }
    free(c->dev);
    free(c->host);
}

/* One local message per plan message, items pointing at base[] (device or host mirrors). */
static void local_job(const rf_plan *pl, uint8_t *const *bases, int verify, rf_xfer_job *job)
{
    rf_err err = {0};

    memset(job, 0, sizeof(*job));
    cr_assert_eq(rf_slice_local_job_from_plan(pl, bases, job, &err), 0, "%s", err.msg);
    job->timeout_s = 60;
    job->verify = verify;
    for (int i = 0; i < RF_XFER_DIGEST_SEED_BYTES; i++)
        job->digest_seed[i] = (uint8_t)(i * 29 + 5);
}

static void job_free(rf_xfer_job *j)
{
    rf_slice_local_job_free(j);
    memset(j, 0, sizeof(*j));
}

/* The wdigest term (the job's seed) of each verified message's packed source, from the host
 * mirror's job. */
static void digest_ref(const rf_xfer_job *hjob, uint8_t acc[RF_XFER_DIGEST_BYTES])
{
    rf_wdigest_key key;

    rf_wdigest_key_derive(hjob->digest_seed, &key);
    memset(acc, 0, RF_XFER_DIGEST_BYTES);
    for (uint32_t i = 0; i < hjob->nmsgs; i++) {
        const rf_xfer_msg *m = &hjob->msgs[i];
        rf_wdigest_acc lanes = {{0, 0}};
        uint8_t h[RF_XFER_DIGEST_BYTES], *payload;
        rf_err err;

        if (!rf_xfer_msg_verified(hjob, m) || m->bytes == 0)
            continue;
        payload = malloc(m->bytes + 1);
        for (uint32_t k = 0; k < m->nitems; k++) {
            const rf_xfer_item *it = &m->src_items[k];
            rf_copy_desc d;

            rf_copy_desc_set(&d, it->base, &it->piece, it->ndim, it->esize, &it->box,
                             it->msg_off);
            cr_assert_eq(rf_copy_gather(&d, 1, payload, &err), 0, "%s", err.msg);
        }
        rf_wdigest_add(&key, 0, payload, rf_xfer_msg_digest_bytes(hjob, m), &lanes);
        rf_wdigest_term(&lanes, m->seq, rf_xfer_msg_digest_bytes(hjob, m), h);
        for (int b = 0; b < RF_XFER_DIGEST_BYTES; b++)
            acc[b] ^= h[b];
        free(payload);
    }
}

static rf_inv *colocated(const char *model, int div, const char *src, const char *dst)
{
    rf_model *m = NULL, *s = NULL;
    rf_inv *inv = rf_inv_new();
    rf_par ps, pd;
    rf_err err;

    cr_assert_eq(rf_model_load(model, &m, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(m, div, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse(src, RF_SRC, s, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse(dst, RF_DST, s, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(s, &ps, &pd, 8, inv, &err), 0, "%s", err.msg);
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++)
        cr_assert_eq(rf_inv_set_endpoint_host(inv, e, 3, &err), 0, "%s", err.msg);
    rf_model_free(s);
    rf_model_free(m);
    return inv;
}

/* Every verify setting, cold then warm: all destination bytes right, nothing else written,
 * digests the reference's on both sides, the warm job allocating nothing. */
static void plan_case(const char *model, int div, const char *src, const char *dst,
                      int src_dev, int dst_dev)
{
    static const int verify[3] = {RF_VERIFY_FULL, RF_VERIFY_SAMPLE, RF_VERIFY_OFF};
    rf_inv *inv = colocated(model, div, src, dst);
    rf_plan_opts o;
    rf_plan *pl = NULL;
    cluster c;
    world w;
    rf_err err;
    uint64_t version = 1, total = 0;

    rf_plan_opts_default(&o);
    o.staging_bytes = 256 << 10;
    o.direct_min_bytes = 64 << 10;
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    for (uint32_t i = 0; i < rf_plan_nmsgs(pl); i++)
        total += rf_plan_msg_at(pl, i)->bytes;
    cluster_alloc(&c, inv, src_dev, dst_dev);
    world_open(&w, true);
    for (int v = 0; v < 3; v++) {
        rf_xfer_job job, hjob;
        uint8_t want[RF_XFER_DIGEST_BYTES];

        local_job(pl, c.dev, verify[v], &job);
        local_job(pl, c.host, verify[v], &hjob);
        job.plan_key = 10 + (uint64_t)v;
        for (int warm = 0; warm < 2; warm++, version++) {
            uint64_t a0, a1, wrong, stray, peak;

            for (uint32_t r = 0; r < c.nregions; r++)
                memset(c.host[r], 0xee, rf_inv_region(inv, r)->size + 1);
            xd_fill(inv, c.host, version);
            cluster_push(&c);
            digest_ref(&hjob, want);
            job.version = version;
            rf_xfer_local_stats(w.t, &a0, NULL, NULL);
            world_run(&w, &job, false);
            rf_xfer_local_stats(w.t, &a1, NULL, &peak);
            cr_assert_eq(w.res.code, 0, "%s", w.res.error);
            cr_assert_eq(w.res.bytes_recv, total);
            cluster_pull(&c);
            xd_check(inv, c.host, version, &wrong, &stray);
            cr_assert_eq(wrong, 0, "%llu destination bytes wrong (verify %d, warm %d)",
                         (unsigned long long)wrong, verify[v], warm);
            cr_assert_eq(stray, 0, "%llu bytes outside destination pieces written",
                         (unsigned long long)stray);
            cr_assert_eq(memcmp(w.res.digest_sent, want, sizeof(want)), 0, "verify %d: sent",
                         verify[v]);
            cr_assert_eq(memcmp(w.res.digest_recv, want, sizeof(want)), 0, "verify %d: recv",
                         verify[v]);
            cr_assert_leq(peak, 64ull << 20, "extra device memory %llu bytes",
                          (unsigned long long)peak);
            if (warm)
                cr_assert_eq(a1, a0, "the warm job made %llu allocations",
                             (unsigned long long)(a1 - a0));
        }
        job_free(&job);
        job_free(&hjob);
    }
    world_close(&w);
    cluster_free(&c);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

Test(xfer_local_cuda, same_gpu_qwen3_tp2_to_tp4)
{
    NEED_GPU();
    plan_case("qwen3-0.6b", 16, "tp=2", "tp=4", 0, 0);
}

Test(xfer_local_cuda, same_gpu_experts_tp2_ep2_to_tp4)
{
    NEED_GPU();
    plan_case("qwen3-30b-a3b", 32, "tp=2,ep=2", "tp=4", 0, 0);
}

Test(xfer_local_cuda, peer_gpus_qwen3)
{
    NEED_GPU();
    if (ngpus() < 2) {
        printf("skipped: one GPU\n");
        cr_skip_test("peer copies need two GPUs");
    }
    plan_case("qwen3-0.6b", 16, "tp=2", "tp=4", 1, 0);
}

/* ---- a large job: NMSG messages of MSG bytes, GPU to GPU memory on device 0 ---------------- */

#define MSG (256ull << 20)
#define NMSG 24

typedef struct big {
    uint8_t *src, *dst;
    rf_xfer_job job;
} big;

static void big_init(big *b)
{
    uint64_t n = MSG * NMSG;

    memset(b, 0, sizeof(*b));
    cr_assert_eq(cudaSetDevice(0), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&b->src, n), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&b->dst, n), cudaSuccess);
    for (uint32_t i = 0; i < NMSG; i++)
        cr_assert_eq(cudaMemset(b->src + i * MSG, (int)(i * 7 + 1), MSG), cudaSuccess);
    cr_assert_eq(cudaMemset(b->dst, 0, n), cudaSuccess);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    b->job = (rf_xfer_job){.version = 1, .nrounds = 1, .nmsgs = NMSG, .timeout_s = 60,
                           .verify = RF_VERIFY_SAMPLE, .plan_key = 77};
    b->job.msgs = calloc(NMSG, sizeof(rf_xfer_msg));
    for (uint32_t i = 0; i < NMSG; i++) {
        rf_xfer_msg *m = &b->job.msgs[i];
        int64_t shape[1] = {(int64_t)(MSG * NMSG)};

        *m = (rf_xfer_msg){.seq = i, .kind = RF_PLAN_LOCAL, .nitems = 1, .bytes = MSG};
        m->items = calloc(1, sizeof(rf_xfer_item));
        m->src_items = calloc(1, sizeof(rf_xfer_item));
        for (int s = 0; s < 2; s++) {
            rf_xfer_item *it = s ? m->src_items : m->items;

            it->base = s ? b->src : b->dst;
            it->ndim = 1;
            it->esize = 1;
            rf_box_full(&it->piece.box, 1, shape);
            it->piece.strides[0] = 1;
            it->box = it->piece.box;
            it->box.start[0] = (int64_t)(i * MSG);
            it->box.extent[0] = (int64_t)MSG;
            it->bytes = MSG;
        }
    }
}

/* The first and last bytes of each message, and one in the middle, hold its source's fill. */
static void big_check(const big *b)
{
    for (uint32_t i = 0; i < NMSG; i++) {
        uint64_t at[3] = {0, MSG / 2 + 12345, MSG - 1};

        for (int k = 0; k < 3; k++) {
            uint8_t v = 0;

            cr_assert_eq(cudaMemcpy(&v, b->dst + i * MSG + at[k], 1, cudaMemcpyDeviceToHost),
                         cudaSuccess);
            cr_assert_eq(v, (uint8_t)(i * 7 + 1), "message %u byte %llu", i,
                         (unsigned long long)at[k]);
        }
    }
}

static void big_free(big *b)
{
    cudaFree(b->src);
    cudaFree(b->dst);
    job_free(&b->job);
}

/* Aborted once the first batch is in: -ECANCELED with part of the job copied; then the whole
 * job, whose sampled digests agree; then a deadline far too short, and the job again. */
Test(xfer_local_cuda, abort_and_deadline_mid_job_then_good_jobs)
{
    big b;
    world w;
    uint8_t x[RF_XFER_DIGEST_BYTES] = {0};

    rf_err err;

    NEED_GPU();
    big_init(&b);
    world_open(&w, true);
    /* Batches of 1 GiB: six of them, so that the abort after the first lands mid-job. */
    cr_assert_eq(rf_xfer_local_tune_gpu(w.t, 1ull << 30, 0, &err), 0, "%s", err.msg);
    world_run(&w, &b.job, true);
    cr_assert_eq(w.res.code, -ECANCELED, "%d %s", w.res.code, w.res.error);
    cr_assert(strstr(w.res.error, "aborted with batch") != NULL, "%s", w.res.error);
    cr_assert_gt(w.res.bytes_recv, 0);
    cr_assert_lt(w.res.bytes_recv, MSG * NMSG, "the abort came after the whole copy");
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    big_check(&b);
    cr_assert_neq(memcmp(w.res.digest_sent, x, sizeof(x)), 0);
    cr_assert_eq(memcmp(w.res.digest_sent, w.res.digest_recv, sizeof(x)), 0);
    b.job.timeout_s = 0.0005;
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, -ETIMEDOUT, "%d %s", w.res.code, w.res.error);
    cr_assert_lt(w.res.bytes_recv, MSG * NMSG);
    b.job.timeout_s = 60;
    cr_assert_eq(cudaMemset(b.dst, 0, MSG * NMSG), cudaSuccess);
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    big_check(&b);
    world_close(&w);
    big_free(&b);
}

/* Corruption between the two digests: message 1's destination moved onto the second half of
 * message 0's (a job built wrong), so whichever copy lands last there, one message's
 * destination holds bytes other than its source's: the daemon's XOR is not zero. The same job
 * unmoved is clean. */
Test(xfer_local_cuda, overlapping_destinations_break_the_digest)
{
    big b;
    world w;
    uint8_t x[RF_XFER_DIGEST_BYTES], zero[RF_XFER_DIGEST_BYTES] = {0};

    NEED_GPU();
    big_init(&b);
    b.job.nmsgs = 2;
    b.job.verify = RF_VERIFY_FULL;
    world_open(&w, true);
    for (int moved = 0; moved < 2; moved++) {
        /* The destination piece's origin moved by half a message: message 1's box lands on
         * dst + MSG / 2 instead of dst + MSG. */
        b.job.msgs[1].items[0].piece.box.start[0] = (int64_t)(moved ? MSG / 2 : 0);
        /* Another plan: a kept plan would copy to the old place. */
        b.job.plan_key = 200 + (uint64_t)moved;
        world_run(&w, &b.job, false);
        cr_assert_eq(w.res.code, 0, "%s", w.res.error);
        for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
            x[i] = w.res.digest_sent[i] ^ w.res.digest_recv[i];
        cr_assert_neq(memcmp(w.res.digest_sent, zero, sizeof(zero)), 0, "nothing digested");
        if (moved)
            cr_assert_neq(memcmp(x, zero, sizeof(zero)), 0, "a corrupted copy passed "
                          "verification");
        else
            cr_assert_eq(memcmp(x, zero, sizeof(zero)), 0, "a clean copy failed verification");
    }
    world_close(&w);
    b.job.nmsgs = NMSG;
    big_free(&b);
}

/* Host memory handed to the GPU transport is refused, naming the message. */
Test(xfer_local_cuda, host_memory_is_refused)
{
    big b;
    world w;
    uint8_t *host;

    NEED_GPU();
    big_init(&b);
    host = malloc(MSG * NMSG);
    b.job.nmsgs = 2;
    b.job.msgs[1].src_items[0].base = host;
    world_open(&w, true);
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, -EINVAL, "%s", w.res.error);
    cr_assert(strstr(w.res.error, "seq 1: the source memory") != NULL, "%s", w.res.error);
    cr_assert(strstr(w.res.error, "is not GPU memory") != NULL, "%s", w.res.error);
    b.job.msgs[1].src_items[0].base = b.src;
    world_run(&w, &b.job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    world_close(&w);
    free(host);
    big_free(&b);
}

#else

Test(xfer_local_cuda, skipped)
{
    cr_skip_test("no CUDA device (built without CUDA)");
}

#endif
