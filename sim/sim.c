/* sim/sim.c - simulated clients' shared part: registration of a model's ranks and the
 * (version, tensor, index) pattern; engines' FP8 pieces and their exact check. */
#include "sim.h"
#include "quant_ref.h"
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

/* Whether piece p is registered as FP8: a bf16/fp16/fp32 tensor of >= 2 dims, rows
 * contiguous, and (unless fp8_off_grid) each matrix of the box on the format's grid. Trainers
 * hold only the decoder layers' matrices in FP8 (the embedding and the output head stay in
 * their dtype, as FP8 checkpoints keep them), so that engines whose shards of those are off the
 * grid still match them. */
static int fp8_wanted(const sim *s, const rf_piece *p)
{
    const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
    int nd = t->ndim;

    if (!s->fp8 || nd < 2 || p->strides[nd - 1] != 1 ||
        (t->dtype != RF_DT_BF16 && t->dtype != RF_DT_FP16 && t->dtype != RF_DT_FP32) ||
        (s->side == RF_SRC && strstr(t->name, ".layers.") == NULL))
        return 0;
    return s->fp8_off_grid ||
           rf_quant_box_ok(&s->fp8_fmt, (uint64_t)t->shape[nd - 2], (uint64_t)t->shape[nd - 1],
                           (uint64_t)p->box.start[nd - 2], (uint64_t)p->box.start[nd - 1],
                           (uint64_t)p->box.extent[nd - 2], (uint64_t)p->box.extent[nd - 1],
                           NULL) == 0;
}

/* The rank's memory for FP8 pieces, before its regions are placed. A region whose pieces are
 * all FP8 keeps its layout with 1-byte elements (offsets and size divided by the dtype's size,
 * strides as they are: a fused qkv_proj stays one buffer); an FP8 piece of a region that also
 * holds other pieces moves to a region of its own, row-major. The scales of every FP8 piece
 * go to one more region, each piece's row-major over its block grid (rows padded to
 * fp8_scale_pad scales), 64-byte aligned. */
static int fp8_layout(sim *s, sim_rank *r)
{
    uint32_t nreg = r->nregions, k, g, scale_region;
    uint64_t scale_size = 0;
    size_t ses = rf_dtype_size(rf_quant_scale_dtype(&s->fp8_fmt));

    r->quants = calloc(r->npieces ? r->npieces : 1, sizeof(*r->quants));
    if (!r->quants)
        return -ENOMEM;
    for (g = 0; g < nreg; g++) {
        int all = 1, any = 0;
        size_t es = 0;

        for (k = 0; k < r->npieces; k++) {
            if (r->pieces[k].region != g)
                continue;
            es = rf_dtype_size(rf_model_tensor(s->model, r->pieces[k].tensor)->dtype);
            if (fp8_wanted(s, &r->pieces[k]))
                any = 1;
            else
                all = 0;
        }
        if (!any)
            continue;
        if (all) {
            r->regions[g].size /= es;
            for (k = 0; k < r->npieces; k++)
                if (r->pieces[k].region == g) {
                    r->pieces[k].offset /= es;
                    r->pieces[k].quant = UINT32_MAX; /* numbered below */
                }
            continue;
        }
        for (k = 0; k < r->npieces; k++) {
            rf_piece *p = &r->pieces[k];
            const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
            int64_t st = 1;

            if (p->region != g || !fp8_wanted(s, p))
                continue;
            for (int d = t->ndim - 1; d >= 0; d--) {
                p->strides[d] = st;
                st *= p->box.extent[d];
            }
            if (sink_region(r, r->nregions, (uint64_t)st) < 0)
                return -ENOMEM;
            p->region = r->nregions - 1;
            p->offset = 0;
            p->quant = UINT32_MAX;
        }
    }
    scale_region = r->nregions;
    for (k = 0; k < r->npieces; k++) {
        rf_piece *p = &r->pieces[k];
        const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
        rf_quant_decl *q = &r->quants[r->nquants];
        int nd = t->ndim, d;
        rf_box sb;

        if (p->quant != UINT32_MAX)
            continue;
        q->kind = s->fp8_fmt.kind;
        q->br = s->fp8_fmt.br;
        q->bc = s->fp8_fmt.bc;
        q->scale_region = scale_region;
        q->scale_offset = (scale_size + 63) & ~(uint64_t)63;
        rf_inv_scale_box(q, nd, t->shape, &p->box, &sb);
        q->scale_strides[nd - 1] = 1;
        q->scale_strides[nd - 2] = (sb.extent[nd - 1] + s->fp8_scale_pad - 1) /
                                   s->fp8_scale_pad * s->fp8_scale_pad;
        for (d = nd - 3; d >= 0; d--)
            q->scale_strides[d] = q->scale_strides[d + 1] * sb.extent[d + 1];
        scale_size = q->scale_offset + (uint64_t)(q->scale_strides[0] * sb.extent[0]) * ses;
        p->quant = ++r->nquants;
    }
    if (r->nquants > 0 && sink_region(r, scale_region, scale_size) < 0)
        return -ENOMEM;
    return 0;
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

static int setup(sim *s, rf_side side, const char *model, int shrink, const char *layout,
                 const char *ranks, const char *socket, int gpu, int vmm, uint64_t vmm_chunk,
                 const sim_opts *o);

int sim_setup_device(sim *s, rf_side side, const char *model, int shrink, const char *layout,
                     const char *ranks, const char *socket, int gpu, int vmm,
                     uint64_t vmm_chunk)
{
    return setup(s, side, model, shrink, layout, ranks, socket, gpu, vmm, vmm_chunk, NULL);
}

/* o: the options of FP8 pieces (NULL: none). */
static int setup(sim *s, rf_side side, const char *model, int shrink, const char *layout,
                 const char *ranks, const char *socket, int gpu, int vmm, uint64_t vmm_chunk,
                 const sim_opts *o)
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
    if (o && o->fp8) {
        if (rf_quant_fmt_parse(o->fp8, &s->fp8_fmt, &err) < 0) {
            fprintf(stderr, "--fp8: %s\n", err.msg);
            return -1;
        }
        s->fp8 = 1;
        snprintf(s->fp8_name, sizeof(s->fp8_name), "%s", o->fp8);
        s->fp8_off_grid = o->fp8_off_grid;
        s->fp8_scale_pad = o->fp8_scale_pad ? o->fp8_scale_pad : 1;
    }
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
        s->tensor_salt[t] = sim_name_salt(rf_model_tensor(m, t)->name) |
                            (o && o->finite ? SIM_FINITE : 0);
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
        if (s->fp8 && fp8_layout(s, r) < 0) {
            fprintf(stderr, "rank %d: out of memory laying out its FP8 pieces\n", r->rank);
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
            const rf_piece *p = &r->pieces[k];
            const rf_tensor *tn = rf_model_tensor(m, p->tensor);
            uint64_t n = (uint64_t)rf_box_numel(&p->box, tn->ndim);

            if (p->quant) {
                rf_box sb;

                rf_inv_scale_box(&r->quants[p->quant - 1], tn->ndim, tn->shape, &p->box, &sb);
                s->fp8_pieces++;
                s->fp8_bytes += n;
                s->fp8_scale_bytes += (uint64_t)rf_box_numel(&sb, tn->ndim) *
                                      rf_dtype_size(rf_quant_scale_dtype(&s->fp8_fmt));
            } else {
                s->kept_pieces++;
                s->kept_bytes += n * rf_dtype_size(tn->dtype);
            }
        }
    }
    s->bytes = s->fp8_bytes + s->fp8_scale_bytes + s->kept_bytes;
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
        const rf_quant_decl *q = p->quant ? &r->quants[p->quant - 1] : NULL;

        if (q)
            rc = refit_add_piece_fp8(r->c, t->name, t->dtype, t->ndim, t->shape,
                                     r->regions[p->region].id, p->offset, p->box.start,
                                     p->box.extent, p->strides, s->fp8_name,
                                     r->regions[q->scale_region].id, q->scale_offset,
                                     q->scale_strides);
        else
            rc = refit_add_piece(r->c, t->name, t->dtype, t->ndim, t->shape,
                                 r->regions[p->region].id, p->offset, p->box.start,
                                 p->box.extent, p->strides);
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
        free(r->quants);
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
/* The rank's pieces the GPU kernels fill and check: all but FP8 ones (*n of them, in piece
 * order; gpu_piece_index maps back). */
static sim_gpu_piece *gpu_pieces(const sim *s, const sim_rank *r, uint32_t *n)
{
    sim_gpu_piece *g = calloc(r->npieces ? r->npieces : 1, sizeof(*g));

    *n = 0;
    for (uint32_t k = 0; g && k < r->npieces; k++) {
        const rf_piece *p = &r->pieces[k];
        const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
        sim_gpu_piece *o = &g[*n];

        if (p->quant)
            continue;
        o->addr = r->regions[p->region].base + p->offset;
        o->salt = s->tensor_salt[p->tensor];
        o->numel = (uint64_t)rf_box_numel(&p->box, t->ndim);
        o->esize = (uint32_t)rf_dtype_size(t->dtype);
        o->ndim = t->ndim;
        memcpy(o->start, p->box.start, sizeof(o->start));
        memcpy(o->extent, p->box.extent, sizeof(o->extent));
        memcpy(o->strides, p->strides, sizeof(o->strides));
        memcpy(o->shape, t->shape, sizeof(o->shape));
        (*n)++;
    }
    return g;
}

static uint32_t gpu_piece_index(const sim_rank *r, uint32_t j)
{
    for (uint32_t k = 0; k < r->npieces; k++)
        if (!r->pieces[k].quant && j-- == 0)
            return k;
    return 0;
}
#endif

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
    uint64_t s_pairs, s_differ, e_count, e_nonzero; /* FP8: see sim.fp8_pairs */
    bool fill;       /* verify_fp8 writes the reference instead (a trainer's FP8 piece) */
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

/* "[a, b, c]" of n coordinates. */
static const char *coords(char *buf, size_t len, const int64_t *x, int n)
{
    size_t o = 0;

    buf[0] = '\0';
    for (int d = 0; d < n && o < len; d++)
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "[", (long long)x[d]);
    if (o < len)
        snprintf(buf + o, len - o, "]");
    return buf;
}

/* A scale's bytes for a person: the fp32 value, or the E8M0 byte and its power of two. */
static const char *scale_str(char *buf, size_t len, const uint8_t *p, int mx)
{
    uint32_t u;
    float f;

    if (mx) {
        snprintf(buf, len, "e8m0 %02x (2^%d)", p[0], (int)p[0] - 127);
        return buf;
    }
    memcpy(&u, p, sizeof(u));
    memcpy(&f, p, sizeof(f));
    snprintf(buf, len, "%08x (%.9g)", (unsigned)u, (double)f);
    return buf;
}

/* One FP8 piece: per matrix of its box (one per index of the leading dims), the trainers'
 * values of the whole matrix at this version, quantized by the scalar reference with the grid
 * at the box's origin (the box lies on the tensor's grid, so that is the tensor's grid), then
 * every FP8 byte, every scale and the padding of every scale row compared. */
static void verify_fp8(verify_ctx *v, const sim_rank *r, const rf_piece *p)
{
    const sim *s = v->s;
    const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
    const rf_quant_decl *q = &r->quants[p->quant - 1];
    rf_quant_fmt f = {q->kind, q->br, q->bc};
    int nd = t->ndim, L = nd - 2, mx = f.kind == RF_QUANT_MXFP8, d;
    size_t es = rf_dtype_size(t->dtype), ses = rf_dtype_size(rf_quant_scale_dtype(&f));
    uint64_t rows = (uint64_t)p->box.extent[L], cols = (uint64_t)p->box.extent[L + 1];
    uint64_t salt = s->tensor_salt[p->tensor], srows, scols;
    const uint8_t *base = r->regions[p->region].base + p->offset;
    const uint8_t *sbase = r->regions[q->scale_region].base + q->scale_offset;
    int64_t lead[RF_MAX_DIMS] = {0}, x[RF_MAX_DIMS];
    uint8_t *src, *qx, *sx;
    char at[120], got[48], want[48];
    rf_box sb;

    rf_inv_scale_box(q, nd, t->shape, &p->box, &sb);
    srows = (uint64_t)sb.extent[L];
    scols = (uint64_t)sb.extent[L + 1];
    src = malloc(rows * cols * es);
    qx = malloc(rows * cols);
    sx = malloc(srows * scols * ses);
    if (!src || !qx || !sx) {
        fprintf(stderr, "rank %d: %s: out of memory verifying an FP8 piece\n", v->rank,
                t->name);
        v->wrong++;
        goto out;
    }
    for (;;) {
        uint64_t g0 = 0;
        int64_t off = 0, soff = 0;

        for (d = 0; d < L; d++) {
            g0 = g0 * (uint64_t)t->shape[d] + (uint64_t)(p->box.start[d] + lead[d]);
            off += lead[d] * p->strides[d];
            soff += lead[d] * q->scale_strides[d];
            x[d] = p->box.start[d] + lead[d];
        }
        for (uint64_t i = 0; i < rows; i++) {
            uint64_t g = (g0 * (uint64_t)t->shape[L] + (uint64_t)p->box.start[L] + i) *
                         (uint64_t)t->shape[L + 1] + (uint64_t)p->box.start[L + 1];

            for (uint64_t j = 0; j < cols; j++) {
                uint64_t val = sim_pattern(salt, v->version, g + j);

                memcpy(src + (i * cols + j) * es, &val, es);
            }
        }
        rf_quant_ref(&f, t->dtype, src, (int64_t)cols, rows, cols, qx, (int64_t)cols, sx,
                     (int64_t)scols);
        for (uint64_t i = 0; v->fill && i < rows; i++)
            for (uint64_t j = 0; j < cols; j++)
                ((uint8_t *)base)[off + (int64_t)i * p->strides[L] +
                                  (int64_t)j * p->strides[L + 1]] = qx[i * cols + j];
        for (uint64_t i = 0; v->fill && i < srows; i++)
            for (uint64_t j = 0; j < scols; j++)
                memcpy((uint8_t *)sbase + (soff + (int64_t)i * q->scale_strides[L] +
                                           (int64_t)j * q->scale_strides[L + 1]) * (int64_t)ses,
                       sx + (i * scols + j) * ses, ses);
        for (uint64_t i = 0; !v->fill && i < srows; i++)
            for (uint64_t j = 0; j < scols; j++) {
                const uint8_t *w = sx + (i * scols + j) * ses;
                const uint8_t *h = sbase + (soff + (int64_t)i * q->scale_strides[L] +
                                            (int64_t)j * q->scale_strides[L + 1]) * (int64_t)ses;

                if (i * scols + j > 0) {
                    v->s_pairs++;
                    v->s_differ += memcmp(w, w - ses, ses) != 0;
                }
                if (memcmp(h, w, ses) == 0)
                    continue;
                if (v->reported++ < v->max_report) {
                    x[L] = sb.start[L] + (int64_t)i;
                    x[L + 1] = sb.start[L + 1] + (int64_t)j;
                    fprintf(stderr, "rank %d: %s FP8 scale of block %s holds %s, version %llu "
                            "has %s\n", v->rank, t->name, coords(at, sizeof(at), x, nd),
                            scale_str(got, sizeof(got), h, mx), (unsigned long long)v->version,
                            scale_str(want, sizeof(want), w, mx));
                }
                v->wrong++;
            }
        /* Nothing may write past a scale row: its padding still holds the filler. */
        for (uint64_t i = 0; !v->fill && q->scale_strides[L + 1] == 1 && i < srows; i++) {
            const uint8_t *h = sbase + (soff + (int64_t)i * q->scale_strides[L]) * (int64_t)ses;

            for (uint64_t b = scols * ses; b < (uint64_t)q->scale_strides[L] * ses; b++)
                if (h[b] != 0xee) {
                    if (v->reported++ < v->max_report)
                        fprintf(stderr, "rank %d: %s: byte %llu of the padding after FP8 "
                                "scale row %lld was written (%02x)\n", v->rank, t->name,
                                (unsigned long long)(b - scols * ses),
                                (long long)(sb.start[L] + (int64_t)i), h[b]);
                    v->wrong++;
                    break;
                }
        }
        for (uint64_t i = 0; !v->fill && i < rows; i++)
            for (uint64_t j = 0; j < cols; j++) {
                uint8_t w = qx[i * cols + j];
                uint8_t h = base[off + (int64_t)i * p->strides[L] +
                                 (int64_t)j * p->strides[L + 1]];

                v->e_count++;
                v->e_nonzero += (w & 0x7F) != 0;
                if (h == w)
                    continue;
                if (v->reported++ < v->max_report) {
                    uint64_t val = 0;

                    memcpy(&val, src + (i * cols + j) * es, es);
                    x[L] = p->box.start[L] + (int64_t)i;
                    x[L + 1] = p->box.start[L + 1] + (int64_t)j;
                    fprintf(stderr, "rank %d: %s FP8 element %s holds %02x, version %llu "
                            "quantizes to %02x (from %0*llx)\n", v->rank, t->name,
                            coords(at, sizeof(at), x, nd), h, (unsigned long long)v->version,
                            w, (int)es * 2, (unsigned long long)val);
                }
                v->wrong++;
            }
        for (d = L - 1; d >= 0; d--) {
            if (++lead[d] < p->box.extent[d])
                break;
            lead[d] = 0;
        }
        if (d < 0)
            break;
    }
out:
    free(src);
    free(qx);
    free(sx);
}

#ifdef RF_HAVE_CUDA
/* The FP8 pieces of a rank on a GPU: its memory copied to the host, then verify_fp8 on the
 * copy, against the same scalar reference; with v->fill (a trainer's pieces) the reference
 * is written into the copy, which goes back to the GPU. */
static void verify_fp8_gpu(verify_ctx *v, const sim_rank *r)
{
    sim_rank h = *r;
    uint8_t *mem = malloc(r->mem_size ? r->mem_size : 1);
    sim_region *rg = calloc(r->nregions ? r->nregions : 1, sizeof(*rg));

    if (!mem || !rg || sim_cuda_read(r->gpu, mem, r->mem, r->mem_size) < 0) {
        fprintf(stderr, "rank %d: cannot read its FP8 pieces from GPU %d\n", r->rank, r->gpu);
        v->wrong++;
        goto out;
    }
    for (uint32_t k = 0; k < r->nregions; k++) {
        rg[k] = r->regions[k];
        rg[k].base = mem + r->regions[k].offset;
    }
    h.regions = rg;
    h.mem = mem;
    for (uint32_t k = 0; k < r->npieces; k++) {
        v->p = &r->pieces[k];
        if (v->p->quant)
            verify_fp8(v, &h, v->p);
    }
    if (v->fill && sim_cuda_write(r->gpu, r->mem, mem, r->mem_size) < 0) {
        fprintf(stderr, "rank %d: cannot write its FP8 pieces to GPU %d\n", r->rank, r->gpu);
        v->wrong++;
    }
out:
    free(mem);
    free(rg);
}
#endif

/* Flips bit 0 of the byte at p of rank r's memory. */
static void flip(const sim_rank *r, uint8_t *p)
{
#ifdef RF_HAVE_CUDA
    if (r->gpu >= 0) {
        if (sim_cuda_flip(r->gpu, p) < 0)
            fprintf(stderr, "rank %d: cannot flip a byte on GPU %d\n", r->rank, r->gpu);
        return;
    }
#else
    (void)r;
#endif
    *p ^= 1;
}

int sim_fp8_corrupt(sim *s, const char *what)
{
    for (int i = 0; i < s->count; i++) {
        sim_rank *r = &s->ranks[i];

        for (uint32_t k = 0; k < r->npieces; k++) {
            const rf_piece *p = &r->pieces[k];
            const rf_quant_decl *q = p->quant ? &r->quants[p->quant - 1] : NULL;
            const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
            const char *name = t->name;
            int L = t->ndim - 2;

            if (!q)
                continue;
            if (strcmp(what, "padding") == 0) {
                rf_quant_fmt f = {q->kind, q->br, q->bc};
                size_t ses = rf_dtype_size(rf_quant_scale_dtype(&f));
                rf_box sb;

                rf_inv_scale_box(q, t->ndim, t->shape, &p->box, &sb);
                if (q->scale_strides[L] <= sb.extent[L + 1])
                    continue;
                flip(r, &r->regions[q->scale_region].base[q->scale_offset +
                                                          (uint64_t)sb.extent[L + 1] * ses]);
                fprintf(stderr, "rank %d: %s: flipped bit 0 of the padding after its first "
                        "row of FP8 scales\n", r->rank, name);
            } else if (strcmp(what, "element") == 0) {
                flip(r, &r->regions[p->region].base[p->offset]);
                fprintf(stderr, "rank %d: %s: flipped bit 0 of its first FP8 element\n",
                        r->rank, name);
            } else if (strcmp(what, "scale") == 0) {
                flip(r, &r->regions[q->scale_region].base[q->scale_offset]);
                fprintf(stderr, "rank %d: %s: flipped bit 0 of its first FP8 scale\n",
                        r->rank, name);
            } else {
                return -1;
            }
            return 0;
        }
    }
    return -1;
}

void sim_fill(sim *s, uint64_t version)
{
    int i;
    uint32_t k;

    for (i = 0; i < s->count; i++) {
#ifdef RF_HAVE_CUDA
        if (s->ranks[i].gpu >= 0) {
            uint32_t ng = 0;
            sim_gpu_piece *g = gpu_pieces(s, &s->ranks[i], &ng);

            if (g == NULL || sim_cuda_fill(s->ranks[i].gpu, g, ng, version) < 0)
                fprintf(stderr, "rank %d: cannot fill version %llu on GPU %d\n",
                        s->ranks[i].rank, (unsigned long long)version, s->ranks[i].gpu);
            free(g);
            if (s->fp8) {
                /* A trainer's FP8 pieces: the reference written on the host, then copied. */
                verify_ctx v = {.s = s, .rank = s->ranks[i].rank, .version = version,
                                .fill = true};

                verify_fp8_gpu(&v, &s->ranks[i]);
            }
            continue;
        }
#endif
        /* A trainer's FP8 pieces hold the version's values quantized by the reference (what
         * an engine's verification expects: the blocks lie on one grid); sim_fill is never
         * called for engines. */
        for (k = 0; k < s->ranks[i].npieces; k++) {
            const rf_piece *p = &s->ranks[i].pieces[k];

            if (p->quant) {
                verify_ctx v = {.s = s, .p = p, .rank = s->ranks[i].rank, .version = version,
                                .fill = true};

                verify_fp8(&v, &s->ranks[i], p);
            } else {
                for_rows(s, &s->ranks[i], p, fill_row, &version);
            }
        }
    }
}

uint64_t sim_verify(sim *s, uint64_t version, int max_report)
{
    verify_ctx v = {.s = s, .version = version, .max_report = max_report};
    int i;
    uint32_t k;

    for (i = 0; i < s->count; i++) {
        v.rank = s->ranks[i].rank;
#ifdef RF_HAVE_CUDA
        if (s->ranks[i].gpu >= 0) {
            uint32_t ng = 0;
            sim_gpu_piece *g = gpu_pieces(s, &s->ranks[i], &ng);
            sim_gpu_bad bad = {0};
            uint64_t w = g ? sim_cuda_verify(s->ranks[i].gpu, g, ng, version, &bad)
                           : UINT64_MAX;

            free(g);
            if (w == UINT64_MAX) {
                fprintf(stderr, "rank %d: cannot verify on GPU %d\n", v.rank,
                        s->ranks[i].gpu);
                w = 1;
            } else if (w > 0 && max_report > 0) {
                const rf_piece *p = &s->ranks[i].pieces[gpu_piece_index(&s->ranks[i],
                                                                        bad.piece)];
                const rf_tensor *t = rf_model_tensor(s->model, p->tensor);
                int es = (int)rf_dtype_size(t->dtype);

                fprintf(stderr, "rank %d: %s element %llu holds %0*llx, version %llu has "
                        "%0*llx (%llu wrong on GPU %d)\n", v.rank, t->name,
                        (unsigned long long)bad.gidx, es * 2, (unsigned long long)bad.got,
                        (unsigned long long)version, es * 2, (unsigned long long)bad.want,
                        (unsigned long long)w, s->ranks[i].gpu);
            }
            v.wrong += w;
            if (s->fp8)
                verify_fp8_gpu(&v, &s->ranks[i]);
            continue;
        }
#endif
        for (k = 0; k < s->ranks[i].npieces; k++) {
            v.p = &s->ranks[i].pieces[k];
            if (v.p->quant)
                verify_fp8(&v, &s->ranks[i], v.p);
            else
                for_rows(s, &s->ranks[i], v.p, verify_row, &v);
        }
    }
    s->fp8_pairs = v.s_pairs;
    s->fp8_pairs_differ = v.s_differ;
    s->fp8_elems = v.e_count;
    s->fp8_elems_nonzero = v.e_nonzero;
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
    case 'W' + 256: o->finite = 1; break;
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
    if (setup(s, side, o->model, o->shrink, o->layout, o->ranks, o->socket, gpu, o->vmm,
              o->vmm_chunk, o) < 0)
        return -1;
    s->inproc = o->inproc;
    return 0;
}
