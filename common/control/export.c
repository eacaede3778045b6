/* common/control/export.c - the receiverd's blocking client of same-host export: Hello as a peer,
 * ExportHello for the publisherd's nonce, Export with the proof and a back channel for the
 * region fds, then the answer turned into an rf_inv and one rf_mem_desc per region. */
#include "export.h"

#include <inttypes.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "refit.pb-c.h"
#include "rpc.h"
#include "slice.h"

/* One fetch: the connection and the deadline every wait of it is bounded by. */
typedef struct xchg {
    const char *path;
    int fd;
    double timeout_s;
    struct timespec deadline; /* CLOCK_MONOTONIC */
    uint64_t next_id;
} xchg;

void rf_export_mac(const uint8_t *key, size_t key_len, const uint8_t *server_nonce,
                   const uint8_t *client_nonce, uint8_t *mac)
{
    static const char label[] = RF_EXPORT_LABEL;
    crypto_auth_hmacsha256_state st;

    crypto_auth_hmacsha256_init(&st, key, key_len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, sizeof(label)); /* with NUL */
    crypto_auth_hmacsha256_update(&st, server_nonce, RF_EXPORT_NONCE_BYTES);
    crypto_auth_hmacsha256_update(&st, client_nonce, RF_EXPORT_NONCE_BYTES);
    crypto_auth_hmacsha256_final(&st, mac);
    sodium_memzero(&st, sizeof(st));
}

/* Milliseconds left before the deadline, rounded up so a wait never ends early; 0 past it. */
static int left_ms(const xchg *x)
{
    struct timespec now;
    int64_t ns;

    clock_gettime(CLOCK_MONOTONIC, &now);
    ns = (int64_t)(x->deadline.tv_sec - now.tv_sec) * 1000000000 +
         (x->deadline.tv_nsec - now.tv_nsec);
    if (ns <= 0)
        return 0;
    return ns / 1000000 >= INT32_MAX ? INT32_MAX : (int)((ns + 999999) / 1000000);
}

static int wait_readable(const xchg *x, int fd, const char *what, rf_err *err)
{
    for (;;) {
        struct pollfd p = {fd, POLLIN, 0};
        int rc = poll(&p, 1, left_ms(x));

        if (rc > 0)
            return 0;
        if (rc == 0)
            return rf_err_set(err, -ETIMEDOUT, "same-host export from %s: no answer to %s "
                              "within %.3g s: is refit-publisherd there hung or overloaded?",
                              x->path, what, x->timeout_s);
        if (errno != EINTR)
            return rf_err_set(err, -errno, "same-host export from %s: poll: %s", x->path,
                              strerror(errno));
    }
}

static int read_full(const xchg *x, uint8_t *buf, size_t len, const char *what, rf_err *err)
{
    size_t off = 0;
    int rc;

    while (off < len) {
        ssize_t n;

        rc = wait_readable(x, x->fd, what, err);
        if (rc < 0)
            return rc;
        n = recv(x->fd, buf + off, len - off, MSG_DONTWAIT);
        if (n == 0)
            return rf_err_set(err, -ECONNRESET, "same-host export from %s: refit-publisherd "
                              "closed the connection before answering %s", x->path, what);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return rf_err_set(err, -errno, "same-host export from %s: reading the answer to "
                              "%s: %s", x->path, what, strerror(errno));
        }
        off += (size_t)n;
    }
    return 0;
}

/* Sends q (with passfd as SCM_RIGHTS when >= 0) and reads its answer into *out. A refusal
 * (a negative code) fails with the publisherd's own message. */
static int call(xchg *x, Refit__Rpc__Request *q, int passfd, const char *what,
                Refit__Rpc__Response **out, rf_err *err)
{
    Refit__Rpc__Response *r = NULL;
    uint8_t hdr[4], *body = NULL;
    uint32_t len;
    int rc;

    *out = NULL;
    q->id = ++x->next_id;
    rc = rf_rpc_send(x->fd, q, passfd, err);
    if (rc < 0) {
        rf_err_wrap(err, "same-host export from %s, sending %s: ", x->path, what);
        goto out;
    }
    rc = read_full(x, hdr, sizeof(hdr), what, err);
    if (rc < 0)
        goto out;
    len = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
    /* The daemon never queues more than RF_RPC_MAX_OUTPUT for a client. */
    if (len > RF_RPC_MAX_OUTPUT) {
        rc = rf_err_set(err, -EBADMSG, "same-host export from %s: the answer to %s announces "
                        "%u bytes, more than a daemon sends (%u): is the socket a refit "
                        "daemon of this release?", x->path, what, len, RF_RPC_MAX_OUTPUT);
        goto out;
    }
    body = malloc(len ? len : 1);
    if (body == NULL) {
        rc = rf_err_set(err, -ENOMEM, "same-host export from %s: out of memory for the "
                        "answer to %s (%u bytes)", x->path, what, len);
        goto out;
    }
    rc = read_full(x, body, len, what, err);
    if (rc < 0)
        goto out;
    r = refit__rpc__response__unpack(NULL, len, body);
    if (r == NULL) {
        rc = rf_err_set(err, -EBADMSG, "same-host export from %s: malformed answer to %s "
                        "(%u bytes that do not decode as refit.rpc.Response): is the socket "
                        "a refit daemon of this release?", x->path, what, len);
        goto out;
    }
    if (r->code < 0) {
        rc = rf_err_set(err, r->code, "refit-publisherd at %s refused %s: %s", x->path, what,
                        r->message ? r->message : "(no message)");
        goto out;
    }
    if (r->id != q->id) {
        rc = rf_err_set(err, -EBADMSG, "same-host export from %s: the answer to %s (id %llu) "
                        "carries id %llu", x->path, what, (unsigned long long)q->id,
                        (unsigned long long)r->id);
        goto out;
    }
    *out = r;
    r = NULL;
    rc = 0;
out:
    if (r)
        refit__rpc__response__free_unpacked(r, NULL);
    free(body);
    return rc;
}

/* A connect that cannot hang: SO_SNDTIMEO bounds it (a listener with a full backlog) and every
 * later send. */
static int dial(xchg *x, rf_err *err)
{
    struct sockaddr_un sa = {0};
    struct timeval tv;
    int rc;

    if (x->path == NULL || x->path[0] == '\0' || strlen(x->path) >= sizeof(sa.sun_path))
        return rf_err_set(err, -EINVAL, "same-host export: socket path '%s' is empty or longer "
                          "than %zu bytes", x->path ? x->path : "", sizeof(sa.sun_path) - 1);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, x->path, strlen(x->path) + 1);
    x->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (x->fd < 0)
        return rf_err_set(err, -errno, "same-host export: socket(): %s", strerror(errno));
    tv.tv_sec = (time_t)x->timeout_s;
    tv.tv_usec = (suseconds_t)((x->timeout_s - (double)tv.tv_sec) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0)
        tv.tv_usec = 1; /* 0 would mean no limit */
    setsockopt(x->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (connect(x->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        rc = -errno;
        return rf_err_set(err, rc, "same-host export: cannot connect to refit-publisherd's "
                          "socket %s (%s): is refit-publisherd running there, and may this "
                          "user connect?", x->path, strerror(-rc));
    }
    return 0;
}

/* Receives exactly need fds from the back channel into fds. */
static int recv_fds(const xchg *x, int chan, int *fds, uint32_t need, rf_err *err)
{
    uint32_t have = 0;
    int rc;

    while (have < need) {
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int) * RF_EXPORT_FDS_PER_PACKET)];
        } ctl;
        uint8_t byte;
        struct iovec iov = {&byte, 1};
        struct msghdr mh = {0};
        struct cmsghdr *cm;
        bool extra = false;
        ssize_t n;

        rc = wait_readable(x, chan, "Export (its region fds)", err);
        if (rc < 0)
            return rc;
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof(ctl.space);
        n = recvmsg(chan, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return rf_err_set(err, -errno, "same-host export from %s: reading the region fds: "
                              "%s", x->path, strerror(errno));
        }
        for (cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm)) {
            size_t i, nf;

            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
                continue;
            nf = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (i = 0; i < nf; i++) {
                int fd;

                memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                if (have < need) {
                    fds[have++] = fd;
                } else {
                    close(fd);
                    extra = true;
                }
            }
        }
        /* The kernel truncates what this process may not open (RLIMIT_NOFILE): say so, it
         * reads like a short count otherwise. */
        if (mh.msg_flags & MSG_CTRUNC) {
            struct rlimit rl = {0};

            getrlimit(RLIMIT_NOFILE, &rl);
            return rf_err_set(err, -EMFILE, "same-host export from %s: the region fds did not "
                              "all fit in this process (%u of %u received; its open-file limit "
                              "is %llu): raise LimitNOFILE (ulimit -n) of refit-receiverd above "
                              "the trainers' region count", x->path, have, need,
                              (unsigned long long)rl.rlim_cur);
        }
        if (extra)
            return rf_err_set(err, -EBADMSG, "same-host export from %s: refit-publisherd "
                              "passed more than the %u fds its regions take (one per region "
                              "with has_fd, per chunk of a VMM range)", x->path, need);
        if (n == 0)
            return rf_err_set(err, -EPROTO, "same-host export from %s: refit-publisherd "
                              "passed %u fds, fewer than the %u its regions take (one per "
                              "region with has_fd, per chunk of a VMM range)", x->path, have,
                              need);
    }
    return 0;
}

/* The regions of the answer agree with the inventory and with their kinds. */
static int check_regions(const xchg *x, const Refit__Rpc__Response *r,
                         const Refit__Inventory *inv, uint32_t *nfds, rf_err *err)
{
    size_t i;

    *nfds = 0;
    if (r->n_regions != inv->n_regions)
        return rf_err_set(err, -EBADMSG, "same-host export from %s: the answer lists %zu "
                          "regions, its inventory %zu", x->path, r->n_regions, inv->n_regions);
    for (i = 0; i < r->n_regions; i++) {
        const Refit__Rpc__ExportRegion *g = r->regions[i];
        bool fd_kind = g->kind == REFIT__RPC__MEM_KIND__MEM_MEMFD ||
                       g->kind == REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD;

        /* A region that holds no asked-for piece is not granted: nothing but its place. */
        if (g->kind == REFIT__RPC__MEM_KIND__MEM_UNKNOWN) {
            if (g->has_fd || g->n_chunks > 0 || g->handle.len > 0)
                return rf_err_set(err, -EBADMSG, "same-host export from %s: region %zu is not "
                                  "granted but carries a handle or fds", x->path, i);
            continue;
        }
        if ((!fd_kind && g->kind != REFIT__RPC__MEM_KIND__MEM_CUDA_IPC) ||
            g->device == NULL || g->device[0] == '\0' || g->has_fd != fd_kind)
            return rf_err_set(err, -EBADMSG, "same-host export from %s: region %zu has "
                              "memory kind %d on device '%s' with has_fd %d, which do not go "
                              "together", x->path, i, (int)g->kind,
                              g->device ? g->device : "", (int)g->has_fd);
        if (g->n_chunks > 0) {
            uint64_t at = 0;

            if (g->kind != REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD ||
                g->n_chunks > RF_MEM_MAX_CHUNKS)
                return rf_err_set(err, -EBADMSG, "same-host export from %s: region %zu of "
                                  "kind %d lists %zu chunks (only a cuda_vmm_fd region has "
                                  "them, at most %d)", x->path, i, (int)g->kind, g->n_chunks,
                                  RF_MEM_MAX_CHUNKS);
            for (size_t k = 0; k < g->n_chunks; k++) {
                if (g->chunks[k]->offset != at || g->chunks[k]->size == 0 ||
                    g->chunks[k]->size > UINT64_MAX - at)
                    return rf_err_set(err, -EBADMSG, "same-host export from %s: region %zu: "
                                      "chunk %zu is %" PRIu64 " bytes at offset %" PRIu64
                                      ", not the next one back to back (%" PRIu64 ")",
                                      x->path, i, k, g->chunks[k]->size,
                                      g->chunks[k]->offset, at);
                at += g->chunks[k]->size;
            }
        }
        *nfds += g->has_fd ? (g->n_chunks ? (uint32_t)g->n_chunks : 1) : 0;
    }
    return 0;
}

/* Builds the export from the checked answer; the fds move into it. */
static int build(const xchg *x, const Refit__Rpc__Response *r, Refit__Inventory *inv,
                 int *fds, rf_export **out, rf_err *err)
{
    const rf_side sides[1] = {RF_SRC};
    rf_slice_map map;
    rf_export *e;
    uint32_t i, k = 0;
    rf_err merr = {0};
    int rc;

    e = calloc(1, sizeof(*e));
    if (e == NULL)
        return rf_err_set(err, -ENOMEM, "same-host export from %s: out of memory", x->path);
    e->regions = calloc(r->n_regions ? r->n_regions : 1, sizeof(*e->regions));
    if (e->regions == NULL) {
        rc = rf_err_set(err, -ENOMEM, "same-host export from %s: out of memory", x->path);
        goto out;
    }
    e->nregions = (uint32_t)r->n_regions;
    for (i = 0; i < e->nregions; i++)
        e->regions[i].fd = -1;
    e->generation = r->generation;
    /* One member merged alone keeps its ids: tensors, regions and pieces stay the publisher's
     * local ones, which the plan slices name. */
    rc = rf_slice_merge(&inv, sides, 1, &e->inv, &map, &merr);
    if (rc < 0) {
        rf_err_set(err, rc, "same-host export from %s: the exported inventory is not valid: %s",
                   x->path, merr.msg);
        goto out;
    }
    rf_slice_map_free(&map);
    for (i = 0; i < e->nregions; i++) {
        const Refit__Rpc__ExportRegion *g = r->regions[i];
        rf_mem_desc *d = &e->regions[i];
        uint8_t *h = NULL;

        if (g->kind == REFIT__RPC__MEM_KIND__MEM_UNKNOWN)
            continue; /* not granted: kind 0, no device, nothing to map */
        d->kind = (rf_mem_kind)g->kind;
        d->size = g->size;
        d->offset = g->offset;
        if (d->kind == RF_MEM_CUDA_VMM_FD && g->vmm_base != 0 && g->owner != 0) {
            d->vmm_base = g->vmm_base;
            d->owner = g->owner;
        }
        d->device = strdup(g->device);
        if (g->handle.len > 0 && (h = malloc(g->handle.len)) != NULL)
            memcpy(h, g->handle.data, g->handle.len);
        d->handle = h;
        d->handle_len = h ? g->handle.len : 0;
        if (g->n_chunks > 0) {
            rf_mem_chunk *ch = calloc(g->n_chunks, sizeof(*ch));

            if (ch == NULL) {
                rc = rf_err_set(err, -ENOMEM, "same-host export from %s: out of memory",
                                x->path);
                goto out;
            }
            for (size_t j = 0; j < g->n_chunks; j++) {
                ch[j].size = g->chunks[j]->size;
                ch[j].fd = fds[k];
                fds[k++] = -1;
            }
            d->chunks = ch;
            d->nchunks = g->n_chunks;
        } else if (g->has_fd) {
            d->fd = fds[k];
            fds[k++] = -1;
        }
        if (d->device == NULL || (g->handle.len > 0 && h == NULL)) {
            rc = rf_err_set(err, -ENOMEM, "same-host export from %s: out of memory", x->path);
            goto out;
        }
    }
    *out = e;
    e = NULL;
    rc = 0;
out:
    rf_export_free(e);
    return rc;
}

static int set_deadline(xchg *x, double timeout_s, rf_err *err)
{
    if (!(timeout_s > 0 && timeout_s < 1e6))
        return rf_err_set(err, -EINVAL, "same-host export: timeout %g s: give 0 < timeout < "
                          "1e6 s", timeout_s);
    x->timeout_s = timeout_s;
    clock_gettime(CLOCK_MONOTONIC, &x->deadline);
    x->deadline.tv_sec += (time_t)timeout_s;
    x->deadline.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
    if (x->deadline.tv_nsec >= 1000000000) {
        x->deadline.tv_sec++;
        x->deadline.tv_nsec -= 1000000000;
    }
    return 0;
}

static void close_fds(int *fds, uint32_t n)
{
    for (uint32_t i = 0; fds && i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free(fds);
}

/* Checks an Export's answer r against its own inventory and reads the fds it announces from
 * chan: *inv and *fds (*nfds of them) are the caller's on success. */
static int take_answer(const xchg *x, const Refit__Rpc__Response *r, int chan,
                       Refit__Inventory **inv, int **fds, uint32_t *nfds, rf_err *err)
{
    int rc;

    *fds = NULL;
    *nfds = 0;
    *inv = refit__inventory__unpack(NULL, r->inventory.len, r->inventory.data);
    if (*inv == NULL)
        return rf_err_set(err, -EBADMSG, "same-host export from %s: the exported inventory "
                          "(%zu bytes) does not decode as refit.Inventory", x->path,
                          r->inventory.len);
    rc = check_regions(x, r, *inv, nfds, err);
    if (rc == 0 && (*fds = malloc((*nfds ? *nfds : 1) * sizeof(**fds))) == NULL)
        rc = rf_err_set(err, -ENOMEM, "same-host export from %s: out of memory", x->path);
    for (uint32_t i = 0; rc == 0 && i < *nfds; i++)
        (*fds)[i] = -1;
    if (rc == 0)
        rc = recv_fds(x, chan, *fds, *nfds, err);
    if (rc < 0) {
        close_fds(*fds, *nfds);
        *fds = NULL;
        *nfds = 0;
        refit__inventory__free_unpacked(*inv, NULL);
        *inv = NULL;
    }
    return rc;
}

/* Hello as a peer, ExportHello, then Export of pieces with the key's proof: *out is the
 * answer, whose fds wait on *chan (the caller closes it). */
static int request(xchg *x, const uint8_t *key, size_t key_len, const uint32_t *pieces,
                   size_t npieces, Refit__Rpc__Response **out, int *chan, rf_err *err)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Hello hello = REFIT__RPC__HELLO__INIT;
    Refit__Rpc__ExportHello ehello = REFIT__RPC__EXPORT_HELLO__INIT;
    Refit__Rpc__Export ex = REFIT__RPC__EXPORT__INIT;
    Refit__Rpc__Response *r = NULL;
    uint8_t ns[RF_EXPORT_NONCE_BYTES], nc[RF_EXPORT_NONCE_BYTES], mac[RF_EXPORT_MAC_BYTES];
    int sv[2] = {-1, -1};
    int rc;

    *out = NULL;
    *chan = -1;
    if (key == NULL || key_len < RF_EXPORT_KEY_MIN || key_len > RF_EXPORT_KEY_MAX)
        return rf_err_set(err, -EINVAL, "same-host export: a cluster key of %d to %d bytes is "
                          "needed, got %zu", RF_EXPORT_KEY_MIN, RF_EXPORT_KEY_MAX,
                          key ? key_len : 0);
    if (sodium_init() < 0)
        return rf_err_set(err, -EIO, "libsodium failed to initialise (no entropy source?)");
    rc = dial(x, err);
    if (rc < 0)
        goto out;

    hello.protocol_version = RF_RPC_PROTOCOL_VERSION;
    hello.name = "refit-receiverd";
    hello.kind = REFIT__RPC__CLIENT_KIND__CLIENT_PEER;
    hello.pid = (int32_t)getpid();
    q.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    q.hello = &hello;
    rc = call(x, &q, -1, "Hello", &r, err);
    if (rc < 0)
        goto out;
    refit__rpc__response__free_unpacked(r, NULL);
    r = NULL;

    q.body_case = REFIT__RPC__REQUEST__BODY_EXPORT_HELLO;
    q.export_hello = &ehello;
    rc = call(x, &q, -1, "ExportHello", &r, err);
    if (rc < 0)
        goto out;
    if (r->nonce.len != RF_EXPORT_NONCE_BYTES) {
        rc = rf_err_set(err, -EBADMSG, "same-host export from %s: ExportHello answered with a "
                        "%zu-byte nonce, not %d", x->path, r->nonce.len, RF_EXPORT_NONCE_BYTES);
        goto out;
    }
    memcpy(ns, r->nonce.data, sizeof(ns));
    refit__rpc__response__free_unpacked(r, NULL);
    r = NULL;

    randombytes_buf(nc, sizeof(nc));
    rf_export_mac(key, key_len, ns, nc, mac);
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
        rc = rf_err_set(err, -errno, "same-host export from %s: socketpair for the region fds: "
                        "%s", x->path, strerror(errno));
        goto out;
    }
    ex.nonce.data = nc;
    ex.nonce.len = sizeof(nc);
    ex.mac.data = mac;
    ex.mac.len = sizeof(mac);
    ex.pieces = (uint32_t *)pieces;
    ex.n_pieces = npieces;
    q.body_case = REFIT__RPC__REQUEST__BODY_EXPORT_REQUEST;
    q.export_request = &ex;
    rc = call(x, &q, sv[1], "Export", &r, err);
    /* Only the publisherd's copy of our end may stay open: its close ends the fds. */
    close(sv[1]);
    sv[1] = -1;
    if (rc < 0)
        goto out;
    *out = r;
    r = NULL;
    *chan = sv[0];
    sv[0] = -1;
out:
    if (r)
        refit__rpc__response__free_unpacked(r, NULL);
    if (sv[0] >= 0)
        close(sv[0]);
    sodium_memzero(mac, sizeof(mac));
    return rc;
}

/* request and take_answer in one bounded exchange: *r, *inv and *fds are the caller's on
 * success (every fd, chan and the connection closed on failure). */
static int fetch(const char *socket_path, const uint8_t *key, size_t key_len,
                 const uint32_t *pieces, size_t npieces, double timeout_s,
                 Refit__Rpc__Response **r, Refit__Inventory **inv, int **fds, uint32_t *nfds,
                 rf_err *err)
{
    xchg x = {socket_path, -1, timeout_s, {0, 0}, 0};
    int chan = -1, rc;

    *r = NULL;
    *inv = NULL;
    *fds = NULL;
    *nfds = 0;
    if ((rc = set_deadline(&x, timeout_s, err)) == 0 &&
        (rc = request(&x, key, key_len, pieces, npieces, r, &chan, err)) == 0)
        rc = take_answer(&x, *r, chan, inv, fds, nfds, err);
    if (rc < 0 && *r) {
        refit__rpc__response__free_unpacked(*r, NULL);
        *r = NULL;
    }
    if (chan >= 0)
        close(chan);
    if (x.fd >= 0)
        close(x.fd);
    return rc;
}

int rf_export_fetch(const char *socket_path, const uint8_t *key, size_t key_len,
                    const uint32_t *pieces, size_t npieces, double timeout_s, rf_export **out,
                    rf_err *err)
{
    xchg x = {socket_path, -1, timeout_s, {0, 0}, 0};
    Refit__Rpc__Response *r;
    Refit__Inventory *inv;
    uint32_t nfds;
    int *fds, rc;

    *out = NULL;
    rc = fetch(socket_path, key, key_len, pieces, npieces, timeout_s, &r, &inv, &fds, &nfds,
               err);
    if (rc < 0)
        return rc;
    rc = build(&x, r, inv, fds, out, err);
    close_fds(fds, nfds);
    refit__inventory__free_unpacked(inv, NULL);
    refit__rpc__response__free_unpacked(r, NULL);
    return rc;
}

int rf_export_fetch_answer(const char *socket_path, const uint8_t *key, size_t key_len,
                           const uint32_t *pieces, size_t npieces, double timeout_s,
                           rf_export_answer *out, rf_err *err)
{
    Refit__Inventory *inv;
    int rc;

    memset(out, 0, sizeof(*out));
    rc = fetch(socket_path, key, key_len, pieces, npieces, timeout_s, &out->resp, &inv,
               &out->fds, &out->nfds, err);
    if (rc == 0)
        refit__inventory__free_unpacked(inv, NULL);
    return rc;
}

void rf_export_answer_free(rf_export_answer *a)
{
    close_fds(a->fds, a->nfds);
    if (a->resp)
        refit__rpc__response__free_unpacked(a->resp, NULL);
    memset(a, 0, sizeof(*a));
}

int rf_export_take(const char *from, const Refit__Rpc__Response *r, int chan, double timeout_s,
                   rf_export **out, rf_err *err)
{
    xchg x = {from, -1, timeout_s, {0, 0}, 0};
    Refit__Inventory *inv = NULL;
    int *fds = NULL;
    uint32_t nfds = 0;
    int rc;

    *out = NULL;
    if ((rc = set_deadline(&x, timeout_s, err)) < 0 ||
        (rc = take_answer(&x, r, chan, &inv, &fds, &nfds, err)) < 0)
        return rc;
    rc = build(&x, r, inv, fds, out, err);
    close_fds(fds, nfds);
    refit__inventory__free_unpacked(inv, NULL);
    return rc;
}

int rf_export_pass_fds(int chan, const int *fds, uint32_t n, rf_err *err)
{
    uint32_t i = 0;

    while (i < n) {
        uint32_t k = n - i < RF_EXPORT_FDS_PER_PACKET ? n - i : RF_EXPORT_FDS_PER_PACKET;
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int) * RF_EXPORT_FDS_PER_PACKET)];
        } ctl;
        uint8_t byte = (uint8_t)k;
        struct iovec iov = {&byte, 1};
        struct msghdr mh = {0};
        struct cmsghdr *cm;

        memset(&ctl, 0, sizeof(ctl));
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.space;
        mh.msg_controllen = CMSG_SPACE(k * sizeof(int));
        cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(k * sizeof(int));
        memcpy(CMSG_DATA(cm), fds + i, k * sizeof(int));
        while (sendmsg(chan, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
            if (errno == EINTR)
                continue;
            return rf_err_set(err, -errno, "cannot pass the region fds on the back channel: "
                              "%s%s", strerror(errno), errno == EPIPE ? " (the other end "
                              "closed it)" : "");
        }
        i += k;
    }
    return 0;
}

void rf_export_close_fds(rf_export *e, uint32_t i)
{
    rf_mem_desc *d = &e->regions[i];
    /* The export allocated the chunk array: only the descriptor's view of it is const. */
    rf_mem_chunk *ch = (rf_mem_chunk *)d->chunks;

    if (d->fd >= 0)
        close(d->fd);
    d->fd = -1;
    for (size_t k = 0; k < d->nchunks; k++) {
        if (ch[k].fd >= 0)
            close(ch[k].fd);
        ch[k].fd = -1;
    }
}

void rf_export_free(rf_export *e)
{
    uint32_t i;

    if (e == NULL)
        return;
    for (i = 0; e->regions && i < e->nregions; i++) {
        rf_export_close_fds(e, i);
        free((rf_mem_chunk *)e->regions[i].chunks);
        free((char *)e->regions[i].device);
        free((uint8_t *)e->regions[i].handle);
    }
    free(e->regions);
    rf_inv_free(e->inv);
    free(e);
}
