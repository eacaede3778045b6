/* sim/sim.c - simulated clients' shared part: registration of a model's ranks and the
 * (version, tensor, index) pattern. */
#include "sim.h"
#include "sim_pattern.h"
#ifdef RF_HAVE_CUDA
#include "sim_cuda.h"
#endif

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

double sim_now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int parse_ranks(const char *s, int world, int *first, int *count)
{
    int a, b;

    if (s == NULL || strcmp(s, "all") == 0) {
        *first = 0;
        *count = world;
        return 0;
    }
    if (sscanf(s, "%d-%d", &a, &b) == 2 || (sscanf(s, "%d", &a) == 1 && (b = a, 1))) {
        if (a < 0 || b < a || b >= world) {
            fprintf(stderr, "ranks %s lie outside the layout's %d ranks\n", s, world);
            return -1;
        }
        *first = a;
        *count = b - a + 1;
        return 0;
    }
    fprintf(stderr, "--ranks takes A-B, A or all, not '%s'\n", s);
    return -1;
}

static int sink_region(void *ctx, uint32_t local, uint64_t size)
{
    sim_rank *r = ctx;
    sim_region *n = realloc(r->regions, (local + 1) * sizeof(*n));

    if (!n)
        return -ENOMEM;
    r->regions = n;
    memset(&n[local], 0, sizeof(n[local]));
    n[local].size = size;
    if (local + 1 > r->nregions)
        r->nregions = local + 1;
    return 0;
}

static int sink_piece(void *ctx, const rf_piece *p)
{
    sim_rank *r = ctx;

    if (r->npieces == r->cap_pieces) {
        uint32_t cap = r->cap_pieces ? r->cap_pieces * 2 : 256;
        rf_piece *n = realloc(r->pieces, cap * sizeof(*n));

        if (!n)
            return -ENOMEM;
        r->pieces = n;
        r->cap_pieces = cap;
    }
    r->pieces[r->npieces++] = *p;
    return 0;
}

int sim_parse_device(const char *device, int *gpu)
{
    int n;

    if (device == NULL || strcmp(device, "host") == 0) {
        *gpu = SIM_HOST;
        return 0;
    }
#ifdef RF_HAVE_CUDA
    if (strcmp(device, "cuda") == 0) {
        *gpu = SIM_GPU_PER_RANK;
        return 0;
    }
    if (sscanf(device, "cuda:%d", &n) == 1 && n >= 0) {
        *gpu = n;
        return 0;
    }
    fprintf(stderr, "--device takes host, cuda or cuda:N, not '%s'\n", device);
#else
    (void)n;
    fprintf(stderr, "--device %s: these simulated clients were built without CUDA; rebuild "
            "where the CUDA toolkit is installed, or use --device host\n", device);
#endif
    return -1;
}

int sim_setup(sim *s, rf_side side, const char *model, int shrink, const char *layout,
              const char *ranks, const char *socket)
{
    return sim_setup_device(s, side, model, shrink, layout, ranks, socket, SIM_HOST, 0, 0);
}

/* The rank's one allocation: a sealed memfd mapped here, or GPU memory. */
static int alloc_rank(sim *s, sim_rank *r)
{
    if (s->gpu == SIM_HOST) {
        r->fd = memfd_create("refit-sim", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (r->fd < 0 || ftruncate(r->fd, (off_t)(r->mem_size ? r->mem_size : 1)) < 0 ||
            fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0) {
            perror("memfd");
            return -1;
        }
        r->mem = mmap(NULL, r->mem_size ? r->mem_size : 1, PROT_READ | PROT_WRITE, MAP_SHARED,
                      r->fd, 0);
        if (r->mem == MAP_FAILED) {
            perror("mmap");
            r->mem = NULL;
            return -1;
        }
        return 0;
    }
#ifdef RF_HAVE_CUDA
    {
        int ndev = sim_cuda_device_count();
        void *p = NULL;

        if (ndev == 0) {
            fprintf(stderr, "rank %d: --device cuda but no CUDA device is visible\n", r->rank);
            return -1;
        }
        r->gpu = s->gpu == SIM_GPU_PER_RANK ? r->rank % ndev : s->gpu;
        if (r->gpu >= ndev) {
            fprintf(stderr, "rank %d: GPU %d asked for, %d visible\n", r->rank, r->gpu, ndev);
            r->gpu = -1;
            return -1;
        }
        if (sim_cuda_alloc(r->gpu, r->mem_size, s->vmm, s->vmm_chunk, &p, &r->gpu_state) < 0) {
            fprintf(stderr, "rank %d: cannot allocate %llu bytes on GPU %d\n", r->rank,
                    (unsigned long long)r->mem_size, r->gpu);
            r->gpu = -1;
            return -1;
        }
        r->mem = p;
        return 0;
    }
#else
    return -1;
#endif
}

int sim_setup_device(sim *s, rf_side side, const char *model, int shrink, const char *layout,
                     const char *ranks, const char *socket, int gpu, int vmm,
                     uint64_t vmm_chunk)
{
    rf_err err = {0};
    rf_model *m = NULL;
    uint32_t t;
    int i;

    memset(s, 0, sizeof(*s));
    s->gpu = gpu;
    s->vmm = vmm;
    s->vmm_chunk = vmm_chunk;
    s->socket = socket;
    s->side = side;
    if (rf_model_load(model, &m, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    if (shrink > 1) {
        rf_model *small = NULL;

        if (rf_model_shrink(m, shrink, &small, &err) < 0) {
            fprintf(stderr, "%s\n", err.msg);
            rf_model_free(m);
            return -1;
        }
        rf_model_free(m);
        m = small;
    }
    s->model = m;
    if (rf_par_parse(layout, side, m, &s->par, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    if (parse_ranks(ranks, rf_par_world(&s->par, side), &s->first, &s->count) < 0)
        return -1;
    s->tensor_salt = calloc(rf_model_ntensors(m), sizeof(*s->tensor_salt));
    s->ranks = calloc((size_t)s->count, sizeof(*s->ranks));
    if (!s->tensor_salt || !s->ranks)
        return -1;
    for (t = 0; t < rf_model_ntensors(m); t++)
        s->tensor_salt[t] = sim_name_salt(rf_model_tensor(m, t)->name);
    for (i = 0; i < s->count; i++) {
        sim_rank *r = &s->ranks[i];
        rf_rank_sink sink = {r, sink_region, sink_piece};
        uint32_t k;

        r->rank = s->first + i;
        r->fd = -1;
        r->gpu = -1;
        if (rf_model_rank(m, &s->par, side, r->rank, &sink, &err) < 0) {
            fprintf(stderr, "rank %d: %s\n", r->rank, err.msg);
            return -1;
        }
        /* Regions 256-byte aligned inside the rank's one allocation, like a caching
         * allocator's blocks. */
        r->mem_size = 0;
        for (k = 0; k < r->nregions; k++) {
            r->regions[k].offset = r->mem_size;
            r->mem_size += (r->regions[k].size + 255) & ~(uint64_t)255;
        }
        if (alloc_rank(s, r) < 0)
            return -1;
        for (k = 0; k < r->nregions; k++)
            r->regions[k].base = r->mem + r->regions[k].offset;
        for (k = 0; k < r->npieces; k++) {
            const rf_tensor *tn = rf_model_tensor(m, r->pieces[k].tensor);

            s->bytes += (uint64_t)rf_box_numel(&r->pieces[k].box, tn->ndim) *
                        rf_dtype_size(tn->dtype);
        }
    }
    return 0;
}

static int register_rank(sim *s, sim_rank *r)
{
    char name[64];
    uint32_t k;
    int rc;

    snprintf(name, sizeof(name), "%s-%d", s->side == RF_SRC ? "trainer" : "engine", r->rank);
    rc = refit_connect(s->socket, name, r->rank, s->side == RF_SRC ? REFIT_TRAINER
                                                                    : REFIT_ENGINE, &r->c);
    if (rc < 0)
        return rc;
    for (k = 0; k < r->nregions; k++) {
        if (r->gpu >= 0)
            rc = refit_region_cuda(r->c, r->regions[k].base, r->regions[k].size,
                                   &r->regions[k].id);
        else if (s->inproc)
            rc = refit_region_inproc(r->c, r->regions[k].base, r->regions[k].size,
                                     &r->regions[k].id);
        else
            rc = refit_region_memfd_at(r->c, r->fd, r->regions[k].offset, r->regions[k].size,
                                       &r->regions[k].id);
        if (rc < 0)
            goto fail;
    }
    for (k = 0; k < r->npieces; k++) {
        const rf_piece *p = &r->pieces[k];
        const rf_tensor *t = rf_model_tensor(s->model, p->tensor);

        rc = refit_add_piece(r->c, t->name, t->dtype, t->ndim, t->shape,
                             r->regions[p->region].id, p->offset, p->box.start, p->box.extent,
                             p->strides);
        if (rc < 0)
            goto fail;
    }
    /* Engines check every byte of a committed version before the next may be installed. */
    if (s->side == RF_DST) {
        rc = refit_gate(r->c);
        if (rc < 0)
            goto fail;
    }
    rc = refit_seal(r->c);
    if (rc < 0)
        goto fail;
    return 0;
fail:
    fprintf(stderr, "rank %d: %s\n", r->rank, refit_last_error(r->c));
    refit_close(r->c);
    r->c = NULL;
    return rc;
}

int sim_register(sim *s, int timeout_ms)
{
    double deadline = sim_now() + timeout_ms / 1000.0;
    int i, rc;

    for (i = 0; i < s->count; i++) {
        sim_rank *r = &s->ranks[i];

        if (r->c) {
            refit_close(r->c);
            r->c = NULL;
        }
        for (;;) {
            rc = register_rank(s, r);
            if (rc == 0)
                break;
            /* Only a daemon that is not there (yet) is worth waiting for. */
            if ((rc != -ENOENT && rc != -ECONNREFUSED && rc != -ECONNRESET) ||
                sim_now() > deadline) {
                fprintf(stderr, "rank %d: cannot register with %s: %s\n", r->rank, s->socket,
                        strerror(-rc));
                return rc;
            }
            usleep(100 * 1000);
        }
    }
    return 0;
}

void sim_close(sim *s)
{
    int i;

    for (i = 0; s->ranks && i < s->count; i++) {
        sim_rank *r = &s->ranks[i];

        if (r->c)
            refit_close(r->c);
#ifdef RF_HAVE_CUDA
        if (r->gpu >= 0)
            sim_cuda_free(r->gpu, r->mem, r->gpu_state);
        else
#endif
        if (r->mem)
            munmap(r->mem, r->mem_size ? r->mem_size : 1);
        if (r->fd >= 0)
            close(r->fd);
        free(r->regions);
        free(r->pieces);
    }
    free(s->ranks);
    free(s->tensor_salt);
    rf_model_free(s->model);
}

/* Visits every element of a piece: for each innermost row, the global flat index of its first
 * element and the byte address of it. */
typedef void (*row_fn)(void *ctx, uint8_t *addr, uint64_t gidx, int64_t n, size_t esize,
                       int64_t stride, uint64_t salt);

static void for_rows(const sim *s, const sim_rank *r, const rf_piece *p, row_fn fn, void *ctx)
{
    const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
    size_t es = rf_dtype_size(t->dtype);
    int nd = t->ndim, d;
    int64_t idx[RF_MAX_DIMS] = {0};
    uint8_t *base = r->regions[p->region].base;

    for (;;) {
        uint64_t gidx = 0, off = p->offset;

        for (d = 0; d < nd; d++) {
            gidx = gidx * (uint64_t)t->shape[d] + (uint64_t)(p->box.start[d] + idx[d]);
            off += (uint64_t)(idx[d] * p->strides[d]) * es;
        }
        fn(ctx, base + off, gidx, p->box.extent[nd - 1], es, p->strides[nd - 1],
           s->tensor_salt[p->tensor]);
        for (d = nd - 2; d >= 0; d--) {
            if (++idx[d] < p->box.extent[d])
                break;
            idx[d] = 0;
        }
        if (d < 0)
            return;
    }
}

static void fill_row(void *ctx, uint8_t *addr, uint64_t gidx, int64_t n, size_t es,
                     int64_t stride, uint64_t salt)
{
    uint64_t version = *(uint64_t *)ctx;
    int64_t i;

    for (i = 0; i < n; i++) {
        uint64_t v = sim_pattern(salt, version, gidx + (uint64_t)i);

        memcpy(addr + (size_t)(i * stride) * es, &v, es);
    }
}

#ifdef RF_HAVE_CUDA
/* The rank's pieces as the kernels take them (malloc'd; NULL when out of memory). */
static sim_gpu_piece *gpu_pieces(const sim *s, const sim_rank *r)
{
    sim_gpu_piece *g = calloc(r->npieces ? r->npieces : 1, sizeof(*g));

    for (uint32_t k = 0; g && k < r->npieces; k++) {
        const rf_piece *p = &r->pieces[k];
        const rf_tensor *t = rf_model_tensor(s->model, p->tensor);

        g[k].addr = r->regions[p->region].base + p->offset;
        g[k].salt = s->tensor_salt[p->tensor];
        g[k].numel = (uint64_t)rf_box_numel(&p->box, t->ndim);
        g[k].esize = (uint32_t)rf_dtype_size(t->dtype);
        g[k].ndim = t->ndim;
        memcpy(g[k].start, p->box.start, sizeof(g[k].start));
        memcpy(g[k].extent, p->box.extent, sizeof(g[k].extent));
        memcpy(g[k].strides, p->strides, sizeof(g[k].strides));
        memcpy(g[k].shape, t->shape, sizeof(g[k].shape));
    }
    return g;
}
#endif

void sim_fill(sim *s, uint64_t version)
{
    int i;
    uint32_t k;

    for (i = 0; i < s->count; i++) {
#ifdef RF_HAVE_CUDA
        if (s->ranks[i].gpu >= 0) {
            sim_gpu_piece *g = gpu_pieces(s, &s->ranks[i]);

            if (g == NULL || sim_cuda_fill(s->ranks[i].gpu, g, s->ranks[i].npieces, version) < 0)
                fprintf(stderr, "rank %d: cannot fill version %llu on GPU %d\n",
                        s->ranks[i].rank, (unsigned long long)version, s->ranks[i].gpu);
            free(g);
            continue;
        }
#endif
        for (k = 0; k < s->ranks[i].npieces; k++)
            for_rows(s, &s->ranks[i], &s->ranks[i].pieces[k], fill_row, &version);
    }
}

void sim_fill_garbage(sim *s)
{
    int i;

    for (i = 0; i < s->count; i++) {
#ifdef RF_HAVE_CUDA
        if (s->ranks[i].gpu >= 0) {
            sim_cuda_memset(s->ranks[i].gpu, s->ranks[i].mem, 0xee, s->ranks[i].mem_size);
            continue;
        }
#endif
        memset(s->ranks[i].mem, 0xee, s->ranks[i].mem_size);
    }
}

typedef struct verify_ctx {
    const sim *s;
    const rf_piece *p;
    int rank;
    uint64_t version, wrong;
    int max_report, reported;
} verify_ctx;

static void verify_row(void *ctx, uint8_t *addr, uint64_t gidx, int64_t n, size_t es,
                       int64_t stride, uint64_t salt)
{
    verify_ctx *v = ctx;
    int64_t i;

    for (i = 0; i < n; i++) {
        uint64_t want = sim_pattern(salt, v->version, gidx + (uint64_t)i), got = 0;

        memcpy(&got, addr + (size_t)(i * stride) * es, es);
        if (memcmp(&got, &want, es) == 0)
            continue;
        if (v->reported++ < v->max_report) {
            const rf_tensor *t = rf_model_tensor(v->s->model, v->p->tensor);

            fprintf(stderr, "rank %d: %s element %llu holds %0*llx, version %llu has %0*llx\n",
                    v->rank, t->name, (unsigned long long)(gidx + (uint64_t)i), (int)es * 2,
                    (unsigned long long)got, (unsigned long long)v->version, (int)es * 2,
                    (unsigned long long)(es < 8 ? want & ((1ULL << (es * 8)) - 1) : want));
        }
        v->wrong++;
    }
}

uint64_t sim_verify(sim *s, uint64_t version, int max_report)
{
    verify_ctx v = {s, NULL, 0, version, 0, max_report, 0};
    int i;
    uint32_t k;

    for (i = 0; i < s->count; i++) {
        v.rank = s->ranks[i].rank;
#ifdef RF_HAVE_CUDA
        if (s->ranks[i].gpu >= 0) {
            sim_gpu_piece *g = gpu_pieces(s, &s->ranks[i]);
            sim_gpu_bad bad = {0};
            uint64_t w = g ? sim_cuda_verify(s->ranks[i].gpu, g, s->ranks[i].npieces, version,
                                             &bad) : UINT64_MAX;

            free(g);
            if (w == UINT64_MAX) {
                fprintf(stderr, "rank %d: cannot verify on GPU %d\n", v.rank,
                        s->ranks[i].gpu);
                w = 1;
            } else if (w > 0 && max_report > 0) {
                const rf_piece *p = &s->ranks[i].pieces[bad.piece];
                const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
                int es = (int)rf_dtype_size(t->dtype);

                fprintf(stderr, "rank %d: %s element %llu holds %0*llx, version %llu has "
                        "%0*llx (%llu wrong on GPU %d)\n", v.rank, t->name,
                        (unsigned long long)bad.gidx, es * 2, (unsigned long long)bad.got,
                        (unsigned long long)version, es * 2, (unsigned long long)bad.want,
                        (unsigned long long)w, s->ranks[i].gpu);
            }
            v.wrong += w;
            continue;
        }
#endif
        for (k = 0; k < s->ranks[i].npieces; k++) {
            v.p = &s->ranks[i].pieces[k];
            for_rows(s, &s->ranks[i], v.p, verify_row, &v);
        }
    }
    return v.wrong;
}

void sim_opts_init(sim_opts *o, const char *default_socket)
{
    const char *env = getenv("REFIT_SOCKET");

    memset(o, 0, sizeof(*o));
    o->socket = env ? env : default_socket;
    o->layout = "";
    o->device = "host";
    o->shrink = 1;
    o->timeout_ms = 120000;
    o->start = 1;
    o->versions = 1;
}

int sim_opt(sim_opts *o, int c, const char *arg)
{
    switch (c) {
    case 's': o->socket = arg; break;
    case 'm': o->model = arg; break;
    case 'k': o->shrink = atoi(arg); break;
    case 'l': o->layout = arg; break;
    case 'r': o->ranks = arg; break;
    case 'v': o->start = strtoull(arg, NULL, 10); break;
    case 'n': o->versions = strtoull(arg, NULL, 10); break;
    case 't': o->timeout_ms = atoi(arg); break;
    case 'D': o->device = arg; break;
    case 'G':
        snprintf(o->gpu_dev, sizeof(o->gpu_dev), "cuda:%s", arg);
        o->device = o->gpu_dev;
        break;
    case 'V': o->vmm = 1; break;
    case 'I': o->inproc = 1; break;
    case 'C':
        /* Implies --cuda-vmm: the chunks are VMM allocations. Checked in sim_open. */
        o->vmm = 1;
        o->vmm_chunk_arg = arg;
        break;
    default: return 0;
    }
    return 1;
}

int sim_open(sim *s, rf_side side, sim_opts *o)
{
    int gpu;

    if (!o->model || o->start == 0) {
        fprintf(stderr, "give --model, and --start of at least 1\n");
        return -1;
    }
    if (sim_parse_device(o->device, &gpu) < 0)
        return -1;
    if (o->vmm_chunk_arg != NULL) {
        char *end = NULL;

        o->vmm_chunk = strtoull(o->vmm_chunk_arg, &end, 10);
        if (end == o->vmm_chunk_arg || *end != '\0' || o->vmm_chunk == 0) {
            fprintf(stderr, "--cuda-vmm-chunk %s: give the size of each VMM allocation in "
                    "bytes (> 0; e.g. 2097152 for PyTorch's small expandable segments)\n",
                    o->vmm_chunk_arg);
            return -1;
        }
    }
#ifdef RF_HAVE_CUDA
    /* GPU memory no daemon can map: VMM allocations without a shareable handle type. */
    if (o->inproc && gpu != SIM_HOST)
        o->vmm = SIM_VMM_PRIVATE;
#endif
    if (sim_setup_device(s, side, o->model, o->shrink, o->layout, o->ranks, o->socket, gpu,
                         o->vmm, o->vmm_chunk) < 0)
        return -1;
    s->inproc = o->inproc;
    return 0;
}
