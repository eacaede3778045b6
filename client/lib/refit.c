/* client/lib/refit.c - librefit: blocking calls over the daemon's Unix socket (common/control/rpc),
 * answers matched to requests by id, pushed events queued until refit_next_event. */
#include "refit.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "layout.h"
#include "quant_fmt.h"
#include "refit_int.h"
#include "rpc.h"
#include "wire.h"

#define SAME(a, b) ((int)(a) == (int)(b))
_Static_assert(SAME(REFIT_BF16, RF_DT_BF16) && SAME(REFIT_BOOL, RF_DT_BOOL) &&
               SAME(REFIT_FP8_E4M3, RF_DT_FP8_E4M3) && SAME(REFIT_INT64, RF_DT_INT64),
               "refit.h dtypes must match rf_dtype");
_Static_assert(SAME(REFIT_TRAINER, REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER) &&
               SAME(REFIT_ENGINE, REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE) &&
               SAME(REFIT_CTL, REFIT__RPC__CLIENT_KIND__CLIENT_CTL), "client kinds");
_Static_assert(SAME(REFIT_EVENT_INSTALLING, REFIT__RPC__EVENT_KIND__EVENT_INSTALLING) &&
               SAME(REFIT_EVENT_ABORTED, REFIT__RPC__EVENT_KIND__EVENT_ABORTED), "event kinds");

#define MAX_ANSWER (64u << 20) /* status documents can be large */
#define ERR_MAX 1024

typedef struct host_alloc {
    void *p;
    size_t len;
} host_alloc;

typedef struct event {
    int kind;
    uint64_t version;
} event;

/* How a region is written: by the daemon (it mapped the memory), or by this process's
 * installer (in-process; ptr is the memory, why says why it was chosen). */
typedef struct region_mode {
    bool inproc;
    void *ptr;
    bool gpu;
    char why[384];
} region_mode;

struct refit_client {
    int fd;
    int kind;
    uint64_t next_id;
    bool broken; /* the daemon closed the connection or the stream is out of step */
    rf_wire_reader reader;
    Refit__Rpc__Response **answers; /* decoded, not yet claimed */
    size_t nanswers, cap_answers;
    event *events;
    size_t nevents, cap_events;
    host_alloc *allocs;
    size_t nallocs, cap_allocs;
    region_mode *modes; /* per region id */
    size_t nmodes, cap_modes;
    Refit__Rpc__Response **installs; /* installers: pushed Install messages, unclaimed */
    size_t ninstalls, cap_installs;
    char *path;         /* the socket, for the installer's own connection */
    char name[128];
    int rank;
    refit_installer *installer;
    char err[ERR_MAX];
};

static __thread char tls_err[ERR_MAX];

#define fail refit__fail

int refit__fail(refit_client *c, int code, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof(tls_err), fmt, ap);
    va_end(ap);
    if (c)
        memcpy(c->err, tls_err, sizeof(c->err));
    return code;
}

const char *refit_last_error(const refit_client *c)
{
    return c ? c->err : tls_err;
}

static int64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int push_event(refit_client *c, const Refit__Rpc__Event *e)
{
    if (c->nevents == c->cap_events) {
        size_t n = c->cap_events ? c->cap_events * 2 : 16;
        event *ne = realloc(c->events, n * sizeof(*ne));

        if (ne == NULL)
            return -ENOMEM;
        c->events = ne;
        c->cap_events = n;
    }
    c->events[c->nevents++] = (event){(int)e->kind, e->version};
    return 0;
}

/* Appends r to a queue of responses (answers, or an installer's pushes); frees it when
 * there is no room. */
static int queue(Refit__Rpc__Response ***q, size_t *n, size_t *cap, Refit__Rpc__Response *r)
{
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 8;
        Refit__Rpc__Response **nq = realloc(*q, ncap * sizeof(*nq));

        if (nq == NULL) {
            refit__rpc__response__free_unpacked(r, NULL);
            return -ENOMEM;
        }
        *q = nq;
        *cap = ncap;
    }
    (*q)[(*n)++] = r;
    return 0;
}

static int on_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    refit_client *c = ctx;
    Refit__Rpc__Response *r = refit__rpc__response__unpack(NULL, len, body);

    if (r == NULL)
        return fail(c, -EBADMSG, "malformed answer from the daemon (%u bytes): is the "
                    "socket a refit daemon of the same release?", len);
    if (r->id == 0 && r->event != NULL) {
        int rc = push_event(c, r->event);

        refit__rpc__response__free_unpacked(r, NULL);
        return rc;
    }
    if (r->id == 0 && r->install != NULL)
        return queue(&c->installs, &c->ninstalls, &c->cap_installs, r);
    return queue(&c->answers, &c->nanswers, &c->cap_answers, r);
}

/* Reads what arrives within timeout_ms (< 0: until something does). 0, -ETIMEDOUT, or a
 * connection error with the message set. */
static int pump(refit_client *c, int timeout_ms)
{
    struct pollfd pfd = {c->fd, POLLIN, 0};
    uint8_t buf[65536];
    ssize_t n;
    int rc;

    if (c->broken)
        return fail(c, -ENOTCONN, "the connection to the daemon is closed: connect again");
    rc = poll(&pfd, 1, timeout_ms);
    if (rc < 0)
        return errno == EINTR ? 0 : fail(c, -errno, "poll: %s", strerror(errno));
    if (rc == 0)
        return -ETIMEDOUT;
    n = recv(c->fd, buf, sizeof(buf), 0);
    if (n < 0) {
        if (errno == EINTR || errno == EAGAIN)
            return 0;
        c->broken = true;
        return fail(c, -errno, "reading from the daemon: %s", strerror(errno));
    }
    if (n == 0) {
        c->broken = true;
        return fail(c, -ECONNRESET, "the daemon closed the connection");
    }
    rc = rf_wire_reader_feed(&c->reader, buf, (size_t)n, on_frame, c);
    if (rc < 0) {
        c->broken = true;
        if (rc == -EMSGSIZE)
            return fail(c, rc, "answer from the daemon larger than %u bytes", MAX_ANSWER);
        if (rc == -ENOMEM)
            return fail(c, rc, "out of memory reading from the daemon");
        return rc;
    }
    return 0;
}

static int remaining(int64_t deadline)
{
    int64_t left;

    if (deadline < 0)
        return -1;
    left = deadline - now_ms();
    return left < 0 ? 0 : (int)left;
}

/* Waits for the answer to id. A connection-level error (id 0) fails the call with the
 * daemon's message; answers to earlier calls that timed out are dropped. */
static int await(refit_client *c, uint64_t id, int timeout_ms, Refit__Rpc__Response **out)
{
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    size_t i;
    int rc;

    *out = NULL;
    for (;;) {
        Refit__Rpc__Response *found = NULL;
        size_t j = 0;

        /* Keep nothing but what we look for: answers to timed-out calls are stale. */
        for (i = 0; i < c->nanswers; i++) {
            Refit__Rpc__Response *r = c->answers[i];

            if (found == NULL && (r->id == id || (r->id == 0 && r->code < 0)))
                found = r;
            else if (found != NULL)
                c->answers[j++] = r;
            else
                refit__rpc__response__free_unpacked(r, NULL);
        }
        c->nanswers = j;
        if (found != NULL) {
            if (found->code < 0) {
                rc = fail(c, found->code, "%s",
                          found->message ? found->message : strerror(-found->code));
                if (found->id == 0)
                    c->broken = true;
                refit__rpc__response__free_unpacked(found, NULL);
                return rc;
            }
            *out = found;
            return 0;
        }
        rc = pump(c, remaining(deadline));
        if (rc == -ETIMEDOUT)
            return fail(c, rc, "no answer from the daemon within %d ms", timeout_ms);
        if (rc < 0)
            return rc;
    }
}

/* A send failed. A daemon that refuses a client (a uid it does not allow, a bad frame)
 * writes why and closes, and the write that follows fails (EPIPE): its reason is still in
 * our receive buffer, and it is what the caller must see. Reads what is left, for a short
 * while, and fails with the daemon's message if it wrote one; otherwise with rc, whose
 * message is already set. */
static int farewell(refit_client *c, int rc)
{
    char send_err[ERR_MAX];
    int64_t deadline = now_ms() + 1000;
    size_t i;

    memcpy(send_err, c->err, sizeof(send_err));
    while (!c->broken && pump(c, remaining(deadline)) == 0)
        ;
    for (i = 0; i < c->nanswers; i++) {
        Refit__Rpc__Response *r = c->answers[i];

        if (r->id == 0 && r->code < 0)
            return fail(c, r->code, "%s", r->message ? r->message : strerror(-r->code));
    }
    return fail(c, rc, "%s", send_err);
}

/* Sends req (with passfd) and waits for its answer; *out may be NULL when only the code
 * matters. */
static int call_fds(refit_client *c, Refit__Rpc__Request *req, const int *fds, size_t nfds,
                    int timeout_ms, Refit__Rpc__Response **out)
{
    Refit__Rpc__Response *r = NULL;
    rf_err err = {0};
    int rc;

    if (c == NULL)
        return fail(NULL, -EINVAL, "no client: connect first");
    if (c->broken)
        return fail(c, -ENOTCONN, "the connection to the daemon is closed: connect again");
    req->id = ++c->next_id;
    rc = rf_rpc_send_fds(c->fd, req, fds, nfds, &err);
    if (rc == -EMSGSIZE || rc == -E2BIG)
        return fail(c, rc, "%s", err.msg); /* not sent: the connection is still in step */
    if (rc < 0) {
        fail(c, rc, "%s", err.msg);
        rc = farewell(c, rc);
        c->broken = true;
        return rc;
    }
    rc = await(c, req->id, timeout_ms, &r);
    if (rc == 0 && out)
        *out = r;
    else if (r)
        refit__rpc__response__free_unpacked(r, NULL);
    return rc;
}

static int call(refit_client *c, Refit__Rpc__Request *req, int passfd, int timeout_ms,
                Refit__Rpc__Response **out)
{
    return call_fds(c, req, &passfd, passfd >= 0 ? 1 : 0, timeout_ms, out);
}

static int simple(refit_client *c, Refit__Rpc__Request *req, int timeout_ms)
{
    return call(c, req, -1, timeout_ms, NULL);
}

/* A wait that timed out says which version did not come in time (the daemon may be fine). */
static int timed_wait(refit_client *c, Refit__Rpc__Request *req, uint64_t version,
                      int timeout_ms, const char *what)
{
    int rc = simple(c, req, timeout_ms);

    if (rc == -ETIMEDOUT)
        return fail(c, rc, "version %llu was not %s within %d ms", (unsigned long long)version,
                    what, timeout_ms);
    return rc;
}

static void client_free(refit_client *c)
{
    size_t i;

    /* The installer first: it writes this client's memory until it stopped. */
    refit__installer_stop(c->installer);
    if (c->fd >= 0)
        close(c->fd);
    rf_wire_reader_reset(&c->reader);
    for (i = 0; i < c->nanswers; i++)
        refit__rpc__response__free_unpacked(c->answers[i], NULL);
    for (i = 0; i < c->nallocs; i++)
        munmap(c->allocs[i].p, c->allocs[i].len);
    for (i = 0; i < c->ninstalls; i++)
        refit__rpc__response__free_unpacked(c->installs[i], NULL);
    free(c->installs);
    free(c->modes);
    free(c->path);
    free(c->answers);
    free(c->events);
    free(c->allocs);
    free(c);
}

int refit_connect(const char *socket_path, const char *name, int rank, int kind,
                  refit_client **out)
{
    if (out == NULL)
        return fail(NULL, -EINVAL, "refit_connect: out is NULL");
    *out = NULL;
    if (kind != REFIT_TRAINER && kind != REFIT_ENGINE && kind != REFIT_CTL)
        return fail(NULL, -EINVAL, "unknown client kind %d: REFIT_TRAINER, REFIT_ENGINE or "
                    "REFIT_CTL", kind);
    return refit__connect(socket_path, name, rank, kind, out);
}

int refit__connect(const char *socket_path, const char *name, int rank, int kind,
                   refit_client **out)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Hello hello = REFIT__RPC__HELLO__INIT;
    refit_client *c = NULL;
    rf_err err = {0};
    const char *path = socket_path;
    int rc;

    if (path == NULL)
        path = getenv("REFIT_SOCKET");
    if (path == NULL || path[0] == '\0')
        path = kind == REFIT_ENGINE ? REFIT_SOCKET_RECEIVER : REFIT_SOCKET_PUBLISHER;
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return fail(NULL, -ENOMEM, "out of memory");
    c->fd = -1;
    c->kind = kind;
    c->rank = rank;
    snprintf(c->name, sizeof(c->name), "%s", name ? name : "");
    if ((c->path = strdup(path)) == NULL) {
        rc = fail(NULL, -ENOMEM, "out of memory");
        goto out;
    }
    rf_wire_reader_init(&c->reader, MAX_ANSWER);
    rc = rf_rpc_dial(path, &c->fd, &err);
    if (rc < 0) {
        fail(NULL, rc, "%s", err.msg);
        goto out;
    }
    hello.protocol_version = RF_RPC_PROTOCOL_VERSION;
    hello.name = (char *)(name ? name : "");
    hello.rank = rank;
    hello.kind = (Refit__Rpc__ClientKind)kind;
    hello.pid = getpid();
    req.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    req.hello = &hello;
    rc = simple(c, &req, 30000);
    if (rc < 0) {
        fail(NULL, rc, "%s: %s", path, c->err);
        goto out;
    }
    *out = c;
    c = NULL;
out:
    if (c)
        client_free(c);
    return rc;
}

int refit_region_memfd(refit_client *c, int fd, uint64_t size, uint32_t *region)
{
    return refit_region_memfd_at(c, fd, 0, size, region);
}

int refit__register_region(refit_client *c, const char *device, int kind, const void *handle,
                           size_t handle_len, uint64_t offset, uint64_t size, int passfd,
                           uint64_t vmm_base, uint32_t *region)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion m = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__Response *r = NULL;
    int rc;

    m.size = size;
    m.offset = offset;
    m.device = (char *)device;
    m.kind = (Refit__Rpc__MemKind)kind;
    m.vmm_base = vmm_base;
    if (handle != NULL) {
        m.ipc_handle.data = (uint8_t *)(uintptr_t)handle;
        m.ipc_handle.len = handle_len;
    }
    req.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    req.register_region = &m;
    rc = call(c, &req, passfd, 30000, &r);
    if (rc == 0) {
        *region = r->region;
        refit__rpc__response__free_unpacked(r, NULL);
    }
    return rc;
}

int refit__register_vmm_chunks(refit_client *c, const char *device, uint64_t offset,
                               uint64_t size, const uint64_t *chunk_sizes, const int *fds,
                               size_t n, uint64_t vmm_base, uint32_t *region)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion m = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__VmmChunk *ch = calloc(n ? n : 1, sizeof(*ch));
    Refit__Rpc__VmmChunk **chp = calloc(n ? n : 1, sizeof(*chp));
    Refit__Rpc__Response *r = NULL;
    uint64_t at = 0;
    int rc;

    if (ch == NULL || chp == NULL) {
        rc = fail(c, -ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        refit__rpc__vmm_chunk__init(&ch[i]);
        ch[i].size = chunk_sizes[i];
        ch[i].offset = at;
        at += chunk_sizes[i];
        chp[i] = &ch[i];
    }
    m.size = size;
    m.offset = offset;
    m.device = (char *)device;
    m.kind = REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD;
    m.vmm_base = vmm_base;
    m.n_chunks = n;
    m.chunks = chp;
    req.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    req.register_region = &m;
    rc = call_fds(c, &req, fds, n, 30000, &r);
    if (rc == 0) {
        *region = r->region;
        refit__rpc__response__free_unpacked(r, NULL);
    }
out:
    free(chp);
    free(ch);
    return rc;
}

int refit_region_memfd_at(refit_client *c, int fd, uint64_t offset, uint64_t size,
                          uint32_t *region)
{
    if (c == NULL || region == NULL || fd < 0)
        return fail(c, -EINVAL, "refit_region_memfd: needs a client, a memfd and a region "
                    "pointer");
    /* The daemon maps the memfd and refuses one that could shrink under it. A memfd made
     * without MFD_ALLOW_SEALING fails here and the daemon's answer says so. */
    (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK);
    return refit__register_region(c, "host", REFIT__RPC__MEM_KIND__MEM_MEMFD, NULL, 0, offset,
                                  size, fd, 0, region);
}

int refit__register_inproc(refit_client *c, const char *device, void *ptr, uint64_t size,
                           const char *why, uint32_t *region)
{
    int rc;

    if (c == NULL || ptr == NULL || region == NULL || size == 0)
        return fail(c, -EINVAL, "refit_region_inproc: needs a client, memory, a size > 0 and "
                    "a region pointer");
    if (c->kind != REFIT_ENGINE)
        return fail(c, -EINVAL, "in-process regions are for engines: a trainer's memory must "
                    "be shareable (refit_alloc_host, refit_region_memfd, refit_region_cuda)");
    rc = refit__register_region(c, device, REFIT__RPC__MEM_KIND__MEM_INPROC, NULL, 0, 0, size,
                                -1, 0, region);
    if (rc == 0)
        rc = refit__region_mode_set(c, *region, ptr, strcmp(device, "host") != 0, why);
    return rc;
}

#ifndef RF_HAVE_CUDA
int refit_region_inproc(refit_client *c, void *ptr, uint64_t size, uint32_t *region)
{
    return refit__register_inproc(c, "host", ptr, size, "registered as in-process host memory "
                                  "(refit_region_inproc)", region);
}

/* Without a CUDA toolkit at build time there is no GPU path (client/lib/refit_cuda.c). */
int refit_region_cuda(refit_client *c, const void *devptr, uint64_t size, uint32_t *region)
{
    (void)devptr;
    (void)size;
    (void)region;
    return fail(c, -ENOTSUP, "this librefit was built without CUDA: rebuild it where the "
                "CUDA toolkit is installed, or register host memory (refit_alloc_host)");
}
#endif

int refit_alloc_host(refit_client *c, uint64_t size, void **ptr, uint32_t *region)
{
    void *p = MAP_FAILED;
    int fd = -1, rc;

    if (c == NULL || ptr == NULL || region == NULL || size == 0)
        return fail(c, -EINVAL, "refit_alloc_host: needs a client, a size > 0 and out "
                    "pointers");
    if (c->nallocs == c->cap_allocs) {
        size_t n = c->cap_allocs ? c->cap_allocs * 2 : 8;
        host_alloc *na = realloc(c->allocs, n * sizeof(*na));

        if (na == NULL)
            return fail(c, -ENOMEM, "out of memory");
        c->allocs = na;
        c->cap_allocs = n;
    }
    fd = memfd_create("refit", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        rc = fail(c, -errno, "memfd_create: %s", strerror(errno));
        goto out;
    }
    if (ftruncate(fd, (off_t)size) < 0) {
        rc = fail(c, -errno, "cannot size a memfd to %llu bytes: %s",
                  (unsigned long long)size, strerror(errno));
        goto out;
    }
    p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        rc = fail(c, -errno, "cannot map %llu bytes: %s", (unsigned long long)size,
                  strerror(errno));
        goto out;
    }
    rc = refit_region_memfd(c, fd, size, region);
    if (rc < 0)
        goto out;
    c->allocs[c->nallocs++] = (host_alloc){p, size};
    *ptr = p;
    p = MAP_FAILED;
out:
    if (p != MAP_FAILED)
        munmap(p, size);
    if (fd >= 0)
        close(fd);
    return rc;
}

/* Row-major strides over extent (ndim checked). */
static void row_major(int ndim, const int64_t *extent, int64_t *out)
{
    int64_t s = 1;

    for (int d = ndim - 1; d >= 0; d--) {
        out[d] = s;
        s *= extent[d] > 0 ? extent[d] : 1;
    }
}

int refit_fp8_scale_shape(const char *format, int ndim, const int64_t *shape,
                          const int64_t *start, const int64_t *extent, int64_t *scale_shape,
                          size_t *scale_esize)
{
    rf_quant_fmt f;
    rf_quant_decl q = {0};
    rf_box b, sb;

    if (format == NULL || shape == NULL || start == NULL || extent == NULL ||
        scale_shape == NULL || ndim < 2 || ndim > RF_MAX_DIMS ||
        rf_quant_fmt_parse(format, &f, NULL) < 0)
        return -EINVAL;
    q.kind = f.kind;
    q.br = f.br;
    q.bc = f.bc;
    for (int d = 0; d < RF_MAX_DIMS; d++) {
        b.start[d] = d < ndim ? start[d] : 0;
        b.extent[d] = d < ndim ? extent[d] : 1;
    }
    rf_inv_scale_box(&q, ndim, shape, &b, &sb);
    for (int d = 0; d < ndim; d++)
        scale_shape[d] = sb.extent[d];
    if (scale_esize)
        *scale_esize = rf_dtype_size(rf_quant_scale_dtype(&f));
    return 0;
}

/* The RegisterPiece both calls send: a plain piece (m0 without a format), or an FP8 one (m0
 * with its format, scale region, offset and strides). strides NULL: row-major over the box. */
static int send_piece(refit_client *c, const char *tensor, int dtype, int ndim,
                      const int64_t *shape, uint32_t region, uint64_t offset,
                      const int64_t *start, const int64_t *extent, const int64_t *strides,
                      Refit__Rpc__RegisterPiece *m)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    int64_t dense[RF_MAX_DIMS];

    if (dtype < 0)
        return fail(c, -EINVAL, "tensor %s: unknown dtype %d", tensor, dtype);
    if (strides == NULL) {
        /* Row-major over the box: the common case of a piece stored densely. */
        row_major(ndim, extent, dense);
        strides = dense;
    }
    m->tensor = (char *)tensor;
    m->dtype = (uint32_t)dtype;
    m->n_shape = m->n_start = m->n_extent = m->n_strides = (size_t)ndim;
    m->shape = (int64_t *)shape;
    m->start = (int64_t *)start;
    m->extent = (int64_t *)extent;
    m->strides = (int64_t *)strides;
    m->region = region;
    m->offset = offset;
    req.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_PIECE;
    req.register_piece = m;
    return simple(c, &req, 30000);
}

int refit_add_piece_fp8(refit_client *c, const char *tensor, int dtype, int ndim,
                        const int64_t *shape, uint32_t region, uint64_t offset,
                        const int64_t *start, const int64_t *extent, const int64_t *strides,
                        const char *format, uint32_t scale_region, uint64_t scale_offset,
                        const int64_t *scale_strides)
{
    Refit__Rpc__RegisterPiece m = REFIT__RPC__REGISTER_PIECE__INIT;
    int64_t sdense[RF_MAX_DIMS], sshape[RF_MAX_DIMS];
    rf_quant_fmt f;
    rf_err err = {0};

    if (c == NULL || tensor == NULL || shape == NULL || start == NULL || extent == NULL ||
        format == NULL)
        return fail(c, -EINVAL, "refit_add_piece_fp8: needs a client, a tensor name, shape, "
                    "start, extent and a format");
    if (ndim < 2 || ndim > RF_MAX_DIMS)
        return fail(c, -EINVAL, "tensor %s: an FP8 piece has 2 to %d dims (rows and columns, "
                    "experts before them), not %d", tensor, RF_MAX_DIMS, ndim);
    if (rf_quant_fmt_parse(format, &f, &err) < 0)
        return fail(c, -EINVAL, "tensor %s: %s", tensor, err.msg);
    if (scale_strides == NULL) {
        refit_fp8_scale_shape(format, ndim, shape, start, extent, sshape, NULL);
        row_major(ndim, sshape, sdense);
        scale_strides = sdense;
    }
    m.quant = (char *)format;
    m.scale_region = scale_region;
    m.scale_offset = scale_offset;
    m.n_scale_strides = (size_t)ndim;
    m.scale_strides = (int64_t *)scale_strides;
    return send_piece(c, tensor, dtype, ndim, shape, region, offset, start, extent, strides, &m);
}

int refit_add_piece(refit_client *c, const char *tensor, int dtype, int ndim,
                    const int64_t *shape, uint32_t region, uint64_t offset,
                    const int64_t *start, const int64_t *extent, const int64_t *strides)
{
    Refit__Rpc__RegisterPiece m = REFIT__RPC__REGISTER_PIECE__INIT;

    if (c == NULL || tensor == NULL || shape == NULL || start == NULL || extent == NULL)
        return fail(c, -EINVAL, "refit_add_piece: needs a client, a tensor name, shape, start "
                    "and extent");
    if (ndim < 1 || ndim > RF_MAX_DIMS)
        return fail(c, -EINVAL, "tensor %s: ndim %d, 1 to %d are supported", tensor, ndim,
                    RF_MAX_DIMS);
    return send_piece(c, tensor, dtype, ndim, shape, region, offset, start, extent, strides, &m);
}

int refit_seal(refit_client *c)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Seal m = REFIT__RPC__SEAL__INIT;
    Refit__Rpc__Response *r = NULL;
    int rc;

    req.body_case = REFIT__RPC__REQUEST__BODY_SEAL;
    req.seal = &m;
    rc = call(c, &req, -1, 60000, &r);
    if (rc < 0)
        return rc;
    /* An engine with in-process regions: its installer attaches before Seal returns (the
     * daemon plans for this engine only then). */
    if (r->install_token.len > 0) {
        void **ptrs = calloc(c->nmodes ? c->nmodes : 1, sizeof(*ptrs));
        bool gpu = false;

        if (ptrs == NULL) {
            rc = fail(c, -ENOMEM, "out of memory starting the installer");
        } else {
            for (size_t i = 0; i < c->nmodes; i++) {
                ptrs[i] = c->modes[i].inproc ? c->modes[i].ptr : NULL;
                gpu |= c->modes[i].inproc && c->modes[i].gpu;
            }
            refit__installer_stop(c->installer);
            c->installer = NULL;
            rc = refit__installer_start(c, c->path, c->name, c->rank, r->install_token.data,
                                        r->install_token.len, ptrs, c->nmodes, gpu,
                                        &c->installer);
            free(ptrs);
        }
    }
    refit__rpc__response__free_unpacked(r, NULL);
    return rc;
}

int refit__region_mode_set(refit_client *c, uint32_t region, void *ptr, bool gpu,
                           const char *why)
{
    if (region >= c->cap_modes) {
        size_t n = c->cap_modes ? c->cap_modes : 16;
        region_mode *nm;

        while (n <= region)
            n *= 2;
        if ((nm = realloc(c->modes, n * sizeof(*nm))) == NULL)
            return fail(c, -ENOMEM, "out of memory");
        memset(nm + c->cap_modes, 0, (n - c->cap_modes) * sizeof(*nm));
        c->modes = nm;
        c->cap_modes = n;
    }
    if (region >= c->nmodes)
        c->nmodes = region + 1;
    c->modes[region].inproc = why != NULL;
    c->modes[region].ptr = ptr;
    c->modes[region].gpu = gpu;
    snprintf(c->modes[region].why, sizeof(c->modes[region].why), "%s",
             why ? why : "the daemon mapped the memory and writes it");
    return 0;
}

int refit_region_mode(refit_client *c, uint32_t region, const char **why)
{
    static const char shared[] = "the daemon mapped the memory and writes it";

    if (c == NULL)
        return fail(NULL, -EINVAL, "no client: connect first");
    if (why)
        *why = region < c->nmodes ? c->modes[region].why : shared;
    return region < c->nmodes && c->modes[region].inproc ? REFIT_INSTALL_INPROC
                                                         : REFIT_INSTALL_DAEMON;
}

int refit__call(refit_client *c, Refit__Rpc__Request *req, int timeout_ms,
                Refit__Rpc__Response **out)
{
    return call(c, req, -1, timeout_ms, out);
}

int refit__call_fd(refit_client *c, Refit__Rpc__Request *req, int fd, int timeout_ms,
                   Refit__Rpc__Response **out)
{
    return call(c, req, fd, timeout_ms, out);
}

int refit__next_install(refit_client *c, int timeout_ms, Refit__Rpc__Response **out)
{
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    int rc;

    *out = NULL;
    for (;;) {
        if (c->ninstalls > 0) {
            *out = c->installs[0];
            memmove(c->installs, c->installs + 1, (c->ninstalls - 1) * sizeof(*c->installs));
            c->ninstalls--;
            return 0;
        }
        /* A connection-level error (id 0, code < 0) is the daemon's goodbye. */
        for (size_t i = 0; i < c->nanswers; i++)
            if (c->answers[i]->id == 0 && c->answers[i]->code < 0) {
                c->broken = true;
                return fail(c, c->answers[i]->code, "%s", c->answers[i]->message);
            }
        rc = pump(c, remaining(deadline));
        if (rc < 0)
            return rc;
        if (deadline >= 0 && remaining(deadline) == 0 && c->ninstalls == 0)
            return -ETIMEDOUT;
    }
}

int refit__fd(const refit_client *c)
{
    return c->fd;
}

int refit__kind(const refit_client *c)
{
    return c ? c->kind : 0;
}

int refit_publish(refit_client *c, uint64_t version)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Publish m = REFIT__RPC__PUBLISH__INIT;

    m.version = version;
    req.body_case = REFIT__RPC__REQUEST__BODY_PUBLISH;
    req.publish = &m;
    return simple(c, &req, 30000);
}

int refit_wait_released(refit_client *c, uint64_t version, int timeout_ms)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__WaitReleased m = REFIT__RPC__WAIT_RELEASED__INIT;

    m.version = version;
    req.body_case = REFIT__RPC__REQUEST__BODY_WAIT_RELEASED;
    req.wait_released = &m;
    return timed_wait(c, &req, version, timeout_ms, "released");
}

int refit_wait_version(refit_client *c, uint64_t version, int timeout_ms)
{
    return refit_wait_version_reached(c, version, timeout_ms, NULL);
}

int refit_wait_version_reached(refit_client *c, uint64_t version, int timeout_ms,
                               uint64_t *reached)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__WaitVersion m = REFIT__RPC__WAIT_VERSION__INIT;
    Refit__Rpc__Response *r = NULL;
    int rc;

    m.version = version;
    req.body_case = REFIT__RPC__REQUEST__BODY_WAIT_VERSION;
    req.wait_version = &m;
    rc = call(c, &req, -1, timeout_ms, &r);
    if (rc == -ETIMEDOUT)
        return fail(c, rc, "version %llu was not committed within %d ms",
                    (unsigned long long)version, timeout_ms);
    if (rc < 0)
        return rc;
    /* A daemon always says the version it committed; one that says less than was asked for
     * does not speak this protocol. */
    if (r->version < version) {
        rc = fail(c, -EPROTO, "the daemon answered the wait for version %llu with version "
                  "%llu: is it a refit daemon of the same release?",
                  (unsigned long long)version, (unsigned long long)r->version);
    } else if (reached != NULL) {
        *reached = r->version;
    }
    refit__rpc__response__free_unpacked(r, NULL);
    return rc;
}

int refit_next_event(refit_client *c, int timeout_ms, int *event, uint64_t *version)
{
    int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    int rc;

    if (c == NULL || event == NULL || version == NULL)
        return fail(c, -EINVAL, "refit_next_event: needs a client and out pointers");
    while (c->nevents == 0) {
        rc = pump(c, remaining(deadline));
        if (rc == -ETIMEDOUT)
            return fail(c, rc, "no event within %d ms", timeout_ms);
        if (rc < 0)
            return rc;
    }
    *event = c->events[0].kind;
    *version = c->events[0].version;
    memmove(c->events, c->events + 1, (c->nevents - 1) * sizeof(*c->events));
    c->nevents--;
    return 0;
}

int refit_status_json(refit_client *c, char **json)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Status m = REFIT__RPC__STATUS__INIT;
    Refit__Rpc__Response *r = NULL;
    int rc;

    if (json == NULL)
        return fail(c, -EINVAL, "refit_status_json: json is NULL");
    req.body_case = REFIT__RPC__REQUEST__BODY_STATUS;
    req.status = &m;
    rc = call(c, &req, -1, 30000, &r);
    if (rc < 0)
        return rc;
    *json = strdup(r->status_json ? r->status_json : "{}");
    refit__rpc__response__free_unpacked(r, NULL);
    return *json ? 0 : fail(c, -ENOMEM, "out of memory");
}

int refit_trigger(refit_client *c, uint64_t version)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Refit m = REFIT__RPC__REFIT__INIT;

    m.version = version;
    req.body_case = REFIT__RPC__REQUEST__BODY_REFIT;
    req.refit = &m;
    return simple(c, &req, 30000);
}

int refit_wait(refit_client *c, uint64_t version, int timeout_ms)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Wait m = REFIT__RPC__WAIT__INIT;

    m.version = version;
    req.body_case = REFIT__RPC__REQUEST__BODY_WAIT;
    req.wait = &m;
    return timed_wait(c, &req, version, timeout_ms, "committed");
}

int refit_gate(refit_client *c)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Gate m = REFIT__RPC__GATE__INIT;

    req.body_case = REFIT__RPC__REQUEST__BODY_GATE;
    req.gate = &m;
    return simple(c, &req, -1);
}

int refit_consumed(refit_client *c, uint64_t version)
{
    Refit__Rpc__Request req = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Consumed m = REFIT__RPC__CONSUMED__INIT;

    m.version = version;
    req.body_case = REFIT__RPC__REQUEST__BODY_CONSUMED;
    req.consumed = &m;
    return simple(c, &req, -1);
}

int refit_close(refit_client *c)
{
    if (c)
        client_free(c);
    return 0;
}
