/* sim/refit-sim-cudacheck.c - the GPU import check: hosts a publisher-side registry with the
 * CUDA memory implementations installed, lets simulated trainers on GPUs (refit-sim-trainer
 * --device cuda) register, and at each published version reads every registered piece back
 * through the imported handles twice (the gather kernel into GPU staging, and cudaMemcpy of
 * whole regions gathered on the host) and checks it against the pattern; then releases the
 * version. Exits 0 when every byte was right, 1 otherwise, 77 without a CUDA device. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <uv.h>

#include "copy.h"
#include "copy_cuda.h"
#include "log.h"
#include "mem_cuda.h"
#include "registry.h"
#include "sim.h"
#include "sim_pattern.h"

typedef struct check {
    uv_loop_t loop;
    rf_registry *reg;
    uint64_t first, last;   /* versions to check */
    uint64_t wrong;
    int failed;
    int done;               /* the last version is checked: stop once the trainers left */
} check;

/* Checks the staging of n descriptors (pieces' whole boxes, row-major) against version. */
static uint64_t verify_staging(const rf_inv *inv, const uint32_t *pieces, size_t n,
                               const uint8_t *stage, uint64_t version, const char *how)
{
    uint64_t wrong = 0, off = 0;

    for (size_t i = 0; i < n; i++) {
        rf_piece p;
        const rf_tensor *t;
        int64_t idx[RF_MAX_DIMS] = {0};
        uint64_t salt, es;
        int d;

        rf_inv_piece(inv, RF_SRC, pieces[i], &p);
        t = rf_inv_tensor(inv, p.tensor);
        salt = sim_name_salt(t->name);
        es = rf_dtype_size(t->dtype);
        for (;;) {
            uint64_t g = 0, want, got = 0;

            for (d = 0; d < t->ndim; d++)
                g = g * (uint64_t)t->shape[d] + (uint64_t)(p.box.start[d] + idx[d]);
            want = sim_pattern(salt, version, g);
            memcpy(&got, stage + off, es);
            if (memcmp(&got, &want, es) != 0 && wrong++ < 5)
                fprintf(stderr, "cudacheck (%s): %s element %llu holds %llx, version %llu has "
                        "%llx\n", how, t->name, (unsigned long long)g,
                        (unsigned long long)got, (unsigned long long)version,
                        (unsigned long long)want);
            off += es;
            for (d = t->ndim - 1; d >= 0; d--) {
                if (++idx[d] < p.box.extent[d])
                    break;
                idx[d] = 0;
            }
            if (d < 0)
                break;
        }
    }
    return wrong;
}

/* Reads back the pieces on one GPU both ways; returns wrong elements or UINT64_MAX. */
static uint64_t check_device(check *c, const char *uuid, uint64_t version)
{
    const rf_inv *inv = rf_registry_inv(c->reg);
    uint32_t np = rf_inv_npieces(inv, RF_SRC), nr = rf_inv_nregions(inv), n = 0;
    rf_copy_desc *gd = calloc(np ? np : 1, sizeof(*gd)), *hd = calloc(np ? np : 1, sizeof(*hd));
    uint32_t *pieces = calloc(np ? np : 1, sizeof(*pieces));
    uint8_t **hostcopy = calloc(nr ? nr : 1, sizeof(*hostcopy));
    uint8_t *stage = NULL, *dstage = NULL, *hstage = NULL;
    uint64_t bytes = 0, wrong = UINT64_MAX;
    rf_err err = {0};
    int ord = -1;
    double t0;

    if (!gd || !hd || !pieces || !hostcopy || rf_cuda_device_of_uuid(uuid, &ord, &err) < 0 ||
        cudaSetDevice(ord) != cudaSuccess) {
        fprintf(stderr, "cudacheck: %s\n", err.msg[0] ? err.msg : "setup failed");
        goto out;
    }
    for (uint32_t i = 0; i < np; i++) {
        rf_piece p;
        const rf_tensor *t;
        uint32_t ep;

        rf_inv_piece(inv, RF_SRC, i, &p);
        ep = rf_inv_region(inv, p.region)->endpoint;
        if (strcmp(rf_registry_endpoint_device(c->reg, ep), uuid) != 0)
            continue;
        t = rf_inv_tensor(inv, p.tensor);
        if (hostcopy[p.region] == NULL) {
            uint64_t rs = rf_inv_region(inv, p.region)->size;

            hostcopy[p.region] = malloc(rs);
            if (hostcopy[p.region] == NULL ||
                cudaMemcpy(hostcopy[p.region], rf_registry_region_base(c->reg, p.region), rs,
                           cudaMemcpyDeviceToHost) != cudaSuccess) {
                fprintf(stderr, "cudacheck: cannot read region %u (%llu bytes) on %s\n",
                        p.region, (unsigned long long)rs, uuid);
                goto out;
            }
        }
        rf_copy_desc_set(&gd[n], rf_registry_region_base(c->reg, p.region), &p, t->ndim,
                         rf_dtype_size(t->dtype), &p.box, bytes);
        rf_copy_desc_set(&hd[n], hostcopy[p.region], &p, t->ndim, rf_dtype_size(t->dtype),
                         &p.box, bytes);
        bytes += rf_copy_desc_bytes(&gd[n]);
        pieces[n++] = i;
    }
    stage = malloc(bytes ? bytes : 1);
    hstage = malloc(bytes ? bytes : 1);
    if (!stage || !hstage || cudaMalloc((void **)&dstage, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudacheck: no memory for %llu bytes of staging\n",
                (unsigned long long)bytes);
        goto out;
    }
    t0 = sim_now();
    if (rf_copy_cuda_gather(gd, n, dstage, 0, &err) < 0 ||
        cudaMemcpy(stage, dstage, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        fprintf(stderr, "cudacheck: gather on %s: %s\n", uuid,
                err.msg[0] ? err.msg : cudaGetErrorString(cudaGetLastError()));
        goto out;
    }
    if (rf_copy_gather(hd, n, hstage, &err) < 0) {
        fprintf(stderr, "cudacheck: host gather: %s\n", err.msg);
        goto out;
    }
    wrong = verify_staging(inv, pieces, n, stage, version, "gather kernel") +
            verify_staging(inv, pieces, n, hstage, version, "cudaMemcpy of the regions");
    printf("cudacheck: version %llu on %s: %u pieces, %llu bytes read through the imported "
           "handles in %.3f s, %llu wrong\n", (unsigned long long)version, uuid, n,
           (unsigned long long)bytes, sim_now() - t0, (unsigned long long)wrong);
out:
    for (uint32_t r = 0; hostcopy && r < nr; r++)
        free(hostcopy[r]);
    free(hostcopy);
    cudaFree(dstage);
    free(stage);
    free(hstage);
    free(gd);
    free(hd);
    free(pieces);
    return wrong;
}

static void on_ready(rf_registry *r, uint64_t version, void *ud)
{
    check *c = ud;
    const rf_inv *inv = rf_registry_inv(r);
    uint32_t ne = rf_inv_nendpoints(inv);

    if (version < c->first) {
        rf_registry_release(r, version);
        return;
    }
    for (uint32_t e = 0; e < ne; e++) {
        uint64_t w = check_device(c, rf_registry_endpoint_device(r, e), version);

        if (w == UINT64_MAX)
            c->failed = 1;
        else
            c->wrong += w;
    }
    rf_registry_release(r, version);
    if (c->failed)
        uv_stop(&c->loop);
    else if (version >= c->last)
        c->done = 1;
}

/* A trainer left: after the last version that is how the run ends. */
static void on_change(rf_registry *r, void *ud)
{
    check *c = ud;

    (void)r;
    if (c->done)
        uv_stop(&c->loop);
}

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: refit-sim-cudacheck --socket PATH [--clients N] [--start V] [--versions K]\n"
            "  Serves N trainers (default 1) like refit-publisherd's registry, with CUDA\n"
            "  memory import; checks versions V..V+K-1 (default 1..1) of their weights.\n");
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"socket", 1, 0, 's'}, {"clients", 1, 0, 'c'}, {"start", 1, 0, 'v'},
        {"versions", 1, 0, 'n'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    static const rf_registry_cb cb = {.on_ready = on_ready, .on_change = on_change};
    rf_registry_opts ro = {0};
    const char *socket = NULL;
    unsigned clients = 1;
    uint64_t versions = 1;
    rf_err err = {0};
    check c;
    int o, status = 1;

    memset(&c, 0, sizeof(c));
    c.first = 1;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 's': socket = optarg; break;
        case 'c': clients = (unsigned)atoi(optarg); break;
        case 'v': c.first = strtoull(optarg, NULL, 10); break;
        case 'n': versions = strtoull(optarg, NULL, 10); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (socket == NULL || clients == 0 || versions == 0) {
        usage(stderr);
        return 2;
    }
    c.last = c.first + versions - 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    rf_log_init(RF_LOG_INFO, 0);
    if (rf_mem_cuda_init(&err) < 0) {
        printf("skipped: no CUDA device (%s)\n", err.msg);
        return 77;
    }
    uv_loop_init(&c.loop);
    ro.gpu_memory = true;
    ro.socket_path = socket;
    ro.side = RF_SRC;
    ro.expected_clients = clients;
    if (rf_registry_open(&c.loop, &ro, &cb, &c, &c.reg, &err) < 0) {
        fprintf(stderr, "cudacheck: %s\n", err.msg);
        goto out;
    }
    uv_run(&c.loop, UV_RUN_DEFAULT);
    rf_registry_close(c.reg);
    uv_run(&c.loop, UV_RUN_DEFAULT);
    rf_copy_cuda_thread_release();
    status = c.failed || c.wrong ? 1 : 0;
    printf("cudacheck: %s (%llu wrong)\n", status ? "FAILED" : "all bytes right",
           (unsigned long long)c.wrong);
out:
    if (uv_loop_close(&c.loop) != 0)
        fprintf(stderr, "cudacheck: loop closed with handles open\n");
    return status;
}

#else

int main(void)
{
    printf("skipped: no CUDA device (refit-sim-cudacheck was built without CUDA)\n");
    return 77;
}

#endif
