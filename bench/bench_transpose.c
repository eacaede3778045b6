/* bench/bench_transpose.c - transposed weights in host memory: four bf16 [4096 x 8192] weights
 * (64 MiB each) that the trainer holds transposed (strides (1, 4096)) copied into row-major
 * engine memory, beside memcpy of the same bytes (the ceiling) and the same copy untransposed,
 * in one run: the copy layer on one thread (pair copy; the tcp transport's gather into staging
 * and scatter out of it) and the local transport's pool of threads. Every destination byte is
 * checked after each case (#wrong). Target: transposed >= 0.3x memcpy and <= 3.3x plain. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "copy.h"
#include "layout.h"
#include "plan.h"
#include "slice.h"
#include "xfer.h"
#include "xfer_local_int.h"

#define NW 4
#define ROWS 4096
#define COLS 8192
#define ES 2
#define WBYTES ((uint64_t)ROWS * COLS * ES)
#define ITERS 5
#define TARGET_MEMCPY 0.3
#define TARGET_PLAIN 3.3

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "bench_transpose: %s: %s\n", what, msg);
    exit(1);
}

/* Element (i, j) of weight w: a value no two neighbours share, so any misplaced element shows. */
static inline uint16_t val(int w, uint32_t i, uint32_t j)
{
    return (uint16_t)(i * 31u + j * 7u + (uint32_t)w * 1009u + (i >> 3) * 13u);
}

/* Fills weight w's memory as a layout holds it: transposed (element (i, j) at j * ROWS + i) or
 * row-major (at i * COLS + j); written in memory order. */
static void fill(uint8_t *mem, int w, bool transposed)
{
    uint16_t *p = (uint16_t *)(void *)mem;

    if (transposed) {
        for (uint32_t j = 0; j < COLS; j++)
            for (uint32_t i = 0; i < ROWS; i++)
                *p++ = val(w, i, j);
    } else {
        for (uint32_t i = 0; i < ROWS; i++)
            for (uint32_t j = 0; j < COLS; j++)
                *p++ = val(w, i, j);
    }
}

/* Elements of weight w's memory that are not where the layout puts them. */
static uint64_t wrong(const uint8_t *mem, int w, bool transposed)
{
    const uint16_t *p = (const uint16_t *)(const void *)mem;
    uint64_t bad = 0;

    if (transposed) {
        for (uint32_t j = 0; j < COLS; j++)
            for (uint32_t i = 0; i < ROWS; i++)
                bad += *p++ != val(w, i, j);
    } else {
        for (uint32_t i = 0; i < ROWS; i++)
            for (uint32_t j = 0; j < COLS; j++)
                bad += *p++ != val(w, i, j);
    }
    return bad;
}

static uint64_t wrong_all(uint8_t *const *mem, bool transposed)
{
    uint64_t bad = 0;

    for (int w = 0; w < NW; w++)
        bad += wrong(mem[w], w, transposed);
    return bad;
}

static void clear_all(uint8_t *const *mem)
{
    for (int w = 0; w < NW; w++)
        memset(mem[w], 0, WBYTES);
}

/* A weight's piece: the whole [ROWS, COLS], transposed or row-major. */
static void piece_of(rf_piece *p, bool transposed)
{
    int64_t shape[2] = {ROWS, COLS};

    memset(p, 0, sizeof(*p));
    rf_box_full(&p->box, 2, shape);
    p->strides[0] = transposed ? 1 : COLS;
    p->strides[1] = transposed ? ROWS : 1;
}

typedef struct row {
    const char *name;
    double best;
    uint64_t bad;
} row;

static double memcpy_s;

static void print_row(const row *r, double plain)
{
    double gbs = (double)(NW * WBYTES) / 1e9 / r->best;

    printf("%-46s %8.4f %8.2f %8.2f ", r->name, r->best, gbs, memcpy_s / r->best);
    if (plain > 0)
        printf("%8.2f", r->best / plain);
    else
        printf("%8s", "-");
    printf(" %7llu\n", (unsigned long long)r->bad);
}

/* ---- the copy layer on one thread ---- */

typedef enum { PAIR, GATHER, SCATTER } op;

/* The four weights copied ITERS times by one call of the copy layer; best time. */
static double time_op(op o, uint8_t *const *src, uint8_t *const *dst, uint8_t *staging,
                      bool src_t, bool dst_t)
{
    rf_copy_pair pr[NW];
    rf_copy_desc d[NW];
    rf_piece ps, pd;
    rf_box b;
    rf_err err;
    double best = 1e30;

    piece_of(&ps, src_t);
    piece_of(&pd, dst_t);
    b = ps.box;
    for (int w = 0; w < NW; w++) {
        if (o == PAIR) {
            rf_copy_desc_set(&pr[w].src, src[w], &ps, 2, ES, &b, 0);
            rf_copy_desc_set(&pr[w].dst, dst[w], &pd, 2, ES, &b, 0);
        } else if (o == GATHER)
            rf_copy_desc_set(&d[w], src[w], &ps, 2, ES, &b, (uint64_t)w * WBYTES);
        else
            rf_copy_desc_set(&d[w], dst[w], &pd, 2, ES, &b, (uint64_t)w * WBYTES);
    }
    for (int it = 0; it <= ITERS; it++) {
        double t0 = now();
        int rc = o == PAIR     ? rf_copy_pairs(pr, NW, &err)
                 : o == GATHER ? rf_copy_gather(d, NW, staging, &err)
                               : rf_copy_scatter(d, NW, staging, &err);

        t0 = now() - t0;
        if (rc < 0)
            die("copy", err.msg);
        if (it > 0 && t0 < best)
            best = t0;
    }
    return best;
}

/* ---- the local transport's pool ---- */

typedef struct lrun {
    uv_loop_t loop;
    rf_xfer_transport *t;
    rf_xfer_result res;
} lrun;

static void lrun_done(rf_xfer_transport *t, const rf_xfer_result *res, void *arg)
{
    lrun *w = arg;

    (void)t;
    w->res = *res;
    uv_stop(&w->loop);
}

static void lrun_closed(void *arg)
{
    (void)arg;
}

/* The four weights as an inventory on one host: trainer pieces in src (transposed or not),
 * engine pieces row-major in dst, one region each; planned, and the engines' local job. */
static void local_job(bool src_t, uint8_t **src, uint8_t **dst, rf_inv **inv, rf_plan **pl,
                      rf_xfer_job *job)
{
    uint32_t ep[2], tid;
    uint8_t *bases[2 * NW];
    rf_err err = {0};

    *inv = rf_inv_new();
    for (int s = 0; s < 2; s++)
        if (rf_inv_add_endpoint(*inv, s ? RF_DST : RF_SRC, (uint32_t)s, &ep[s], &err) < 0 ||
            rf_inv_set_endpoint_host(*inv, ep[s], 7, &err) < 0)
            die("inventory", err.msg);
    for (int w = 0; w < NW; w++) {
        char name[64];
        rf_piece p;

        snprintf(name, sizeof(name), "model.layers.%d.mlp.down_proj.weight", w);
        if (rf_inv_add_tensor(*inv, name, RF_DT_BF16, 2, (int64_t[]){ROWS, COLS}, &tid,
                              &err) < 0)
            die("inventory", err.msg);
        for (int s = 0; s < 2; s++) {
            uint32_t r;

            if (rf_inv_add_region(*inv, ep[s], WBYTES, &r, &err) < 0)
                die("inventory", err.msg);
            bases[r] = s ? dst[w] : src[w];
            piece_of(&p, s == 0 && src_t);
            p.tensor = tid;
            p.region = r;
            if (rf_inv_add_piece(*inv, &p, NULL, &err) < 0)
                die("inventory", err.msg);
        }
    }
    if (rf_plan_build(*inv, NULL, pl, &err) < 0)
        die("plan", err.msg);
    memset(job, 0, sizeof(*job));
    if (rf_slice_local_job_from_plan(*pl, bases, job, &err) < 0)
        die("local job", err.msg);
    job->timeout_s = 300;
}

/* The local job run ITERS times warm on a pool of `threads`; best time; *agree whether the
 * last run's digests agree (verify full). */
static double time_local(rf_xfer_job *job, unsigned threads, int verify, bool *agree)
{
    static const uint8_t zero[RF_XFER_DIGEST_BYTES];
    const char *addrs[2] = {NULL, NULL};
    rf_err err = {0};
    lrun w;
    double best = 1e30;

    memset(&w, 0, sizeof(w));
    uv_loop_init(&w.loop);
    if (rf_xfer_local_new(&w.loop, false, &w.t, &err) < 0 ||
        rf_xfer_set_peers(w.t, 1, 2, addrs, &err) < 0 ||
        rf_xfer_local_set_threads(w.t, threads, &err) < 0)
        die("local transport", err.msg);
    job->verify = verify;
    job->plan_key = 1;
    for (int it = 0; it <= ITERS; it++) {
        double t0 = now();

        job->version = (uint64_t)it + 1;
        if (rf_xfer_run(w.t, job, lrun_done, &w, &err) < 0)
            die("run", err.msg);
        uv_run(&w.loop, UV_RUN_DEFAULT);
        t0 = now() - t0;
        if (w.res.code < 0)
            die("local job", w.res.error);
        if (it > 0 && t0 < best)
            best = t0;
    }
    *agree = memcmp(w.res.digest_sent, zero, sizeof(zero)) != 0 &&
             memcmp(w.res.digest_sent, w.res.digest_recv, sizeof(zero)) == 0;
    rf_xfer_close(w.t, lrun_closed, NULL);
    uv_run(&w.loop, UV_RUN_DEFAULT);
    uv_loop_close(&w.loop);
    return best;
}

int main(void)
{
    uint8_t *src[NW], *dst[NW], *staging;
    unsigned threads[2] = {1, 2};
    row r;
    double plain, tr, worst_mem = 1e30, worst_plain = 0;

    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int w = 0; w < NW; w++) {
        src[w] = mmap(NULL, WBYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        dst[w] = mmap(NULL, WBYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (src[w] == MAP_FAILED || dst[w] == MAP_FAILED)
            die("mmap", "out of memory for 512 MiB of weights");
        fill(src[w], w, false);
        memset(dst[w], 0, WBYTES);
    }
    staging = mmap(NULL, NW * WBYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (staging == MAP_FAILED)
        die("mmap", "out of memory for 256 MiB of staging");
    memset(staging, 0, NW * WBYTES);

    printf("bench_transpose: %d bf16 weights [%d x %d] (%.0f MiB each, %.3f GB), %ld CPUs, "
           "best of %d warm runs\n", NW, ROWS, COLS, (double)WBYTES / (1 << 20),
           (double)(NW * WBYTES) / 1e9, sysconf(_SC_NPROCESSORS_ONLN), ITERS);
    printf("%-46s %8s %8s %8s %8s %7s\n", "case", "best_s", "GB/s", "xmemcpy", "xplain",
           "#wrong");

    memcpy_s = 1e30;
    for (int it = 0; it <= ITERS; it++) {
        double t0 = now();

        for (int w = 0; w < NW; w++)
            memcpy(dst[w], src[w], WBYTES);
        t0 = now() - t0;
        if (it > 0 && t0 < memcpy_s)
            memcpy_s = t0;
    }
    r = (row){"memcpy, one thread (ceiling)", memcpy_s, wrong_all(dst, false)};
    print_row(&r, 0);

    /* One thread, the copy layer: plain first, then the trainer's copy transposed. */
    clear_all(dst);
    plain = time_op(PAIR, src, dst, NULL, false, false);
    r = (row){"pair copy, plain", plain, wrong_all(dst, false)};
    print_row(&r, 0);
    for (int w = 0; w < NW; w++)
        fill(src[w], w, true);
    clear_all(dst);
    tr = time_op(PAIR, src, dst, NULL, true, false);
    r = (row){"pair copy, transposed source", tr, wrong_all(dst, false)};
    print_row(&r, plain);
    worst_mem = memcpy_s / tr < worst_mem ? memcpy_s / tr : worst_mem;
    worst_plain = tr / plain > worst_plain ? tr / plain : worst_plain;

    /* The tcp transport's halves: gather of the transposed pieces into staging, scatter of
     * staging into transposed pieces (an engine that holds the weight transposed). */
    tr = time_op(GATHER, src, NULL, staging, true, false);
    for (int w = 0; w < NW; w++)
        memcpy(dst[w], staging + (uint64_t)w * WBYTES, WBYTES);
    r = (row){"gather (tcp pack), transposed piece", tr, wrong_all(dst, false)};
    print_row(&r, plain);
    worst_mem = memcpy_s / tr < worst_mem ? memcpy_s / tr : worst_mem;
    clear_all(dst);
    tr = time_op(SCATTER, NULL, dst, staging, false, true);
    r = (row){"scatter (tcp unpack), transposed piece", tr, wrong_all(dst, true)};
    print_row(&r, plain);
    worst_mem = memcpy_s / tr < worst_mem ? memcpy_s / tr : worst_mem;

    /* The local transport (the host path between a trainer and an engine on one host), with
     * verification off and full (both ends' digests of every byte). */
    for (int ti = 0; ti < 2; ti++) {
        double lplain[2] = {0, 0};

        for (int t = 0; t < 2; t++) {
            rf_inv *inv;
            rf_plan *pl;
            rf_xfer_job job;

            for (int w = 0; w < NW; w++)
                fill(src[w], w, t == 1);
            local_job(t == 1, src, dst, &inv, &pl, &job);
            for (int v = 0; v < 2; v++) {
                bool agree;
                char name[64];
                double s;

                clear_all(dst);
                s = time_local(&job, threads[ti], v ? RF_VERIFY_FULL : RF_VERIFY_OFF, &agree);
                snprintf(name, sizeof(name), "local transport %u thr, %s%s", threads[ti],
                         t ? "transposed" : "plain", v ? ", verify full" : "");
                /* A verified run whose digests disagree counts as one more wrong. */
                r = (row){name, s, wrong_all(dst, false) + (v && !agree)};
                print_row(&r, t ? lplain[v] : 0);
                if (t == 0) {
                    lplain[v] = s;
                } else if (v == 0) {
                    worst_mem = memcpy_s / s < worst_mem ? memcpy_s / s : worst_mem;
                    worst_plain = s / lplain[0] > worst_plain ? s / lplain[0] : worst_plain;
                }
            }
            rf_slice_local_job_free(&job);
            rf_plan_free(pl);
            rf_inv_free(inv);
        }
    }
    printf("transposed copies without verification: worst %.2fx memcpy (target >= %.1fx), "
           "worst %.2fx plain (target <= %.1fx): %s\n", worst_mem, TARGET_MEMCPY, worst_plain,
           TARGET_PLAIN, worst_mem >= TARGET_MEMCPY && worst_plain <= TARGET_PLAIN ? "met"
                                                                                     : "NOT MET");
    for (int w = 0; w < NW; w++) {
        munmap(src[w], WBYTES);
        munmap(dst[w], WBYTES);
    }
    munmap(staging, NW * WBYTES);
    return 0;
}
