/* fuzz/fuzz_rpc.c - the local RPC as a daemon serves it: a real registry (common/control/registry.h)
 * on a real Unix socket, with up to two clients writing any bytes to it, and the daemon's own
 * events (release, abort, commit, hold) between their requests. Every input runs on a fresh
 * registry, which must close each client when the client closes its end and must close its
 * loop without a handle left.
 * Input: [config] then records, each a 4-byte big-endian word W:
 *   W < 2^31: a frame of W bytes follows (sent with its header as it stands; a length past
 *     the input sends the rest). A RegisterRegion of kind memfd or cuda_vmm_fd gets a fresh
 *     1 MiB sealed memfd passed with it, as librefit does.
 *   W >= 2^31: an action a = (W >> 24) & 7 with value v = W & 0xffffff: 0 switch to client
 *     v % 2 (connecting it), 1 close the current client, 2 release(v), 3 abort(v),
 *     4 notify committed v, 5 notify aborted v, 6 notify installing v, 7 hold(v & 1).
 * config: bit 0 side (engines), bit 1 two expected clients, bit 2 GPU memory only. */
#include <errno.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>

#include "fuzz.h"
#include "registry.h"
#include "rpc.pb-c.h"
#include "wire.h"

#define NCLIENTS 2
#define MEMFD_BYTES (1u << 20)

typedef struct harness {
    uv_loop_t loop;
    rf_registry *reg;
    char path[128];
    int fd[NCLIENTS];   /* client ends, -1 when not connected */
    bool eof[NCLIENTS]; /* the daemon closed that client */
    int cur;
    rf_wire_reader rd[NCLIENTS]; /* FUZZ_LOG=1: replies decoded and printed */
    bool show;
} harness;

static int cb_status(rf_registry *r, char **json, rf_err *err, void *ud)
{
    json_t *j = rf_registry_status(r);

    (void)ud;
    if (j == NULL)
        return rf_err_set(err, -ENOMEM, "no status");
    *json = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return *json ? 0 : rf_err_set(err, -ENOMEM, "status does not render");
}

/* Both answers a daemon gives: odd versions are triggered, even ones refused. */
static int cb_refit(rf_registry *r, uint64_t v, rf_err *err, void *ud)
{
    (void)r;
    (void)ud;
    return v % 2 ? 0 : rf_err_set(err, -EBUSY, "a refit is already running");
}

static int cb_wait(rf_registry *r, uint64_t v, rf_err *err, void *ud)
{
    (void)r;
    (void)ud;
    return v % 3 ? 0 : rf_err_set(err, -EINVAL, "version %llu was never triggered",
                                  (unsigned long long)v);
}

static int show_reply(void *ctx, const uint8_t *body, uint32_t len)
{
    Refit__Rpc__Response *r = refit__rpc__response__unpack(NULL, len, body);

    if (r != NULL)
        fprintf(stderr, "fuzz_rpc: client %d: reply id %llu code %d: %s%s%s\n",
                (int)(intptr_t)ctx, (unsigned long long)r->id, r->code, r->message,
                r->event ? " (event)" : "", r->status_json && r->status_json[0] ? " (status)" : "");
    refit__rpc__response__free_unpacked(r, NULL);
    return 0;
}

/* Reads whatever the daemon sent a client (replies, events), and notes its close. */
static void drain(harness *h, int i)
{
    uint8_t buf[65536];

    while (h->fd[i] >= 0 && !h->eof[i]) {
        ssize_t n = recv(h->fd[i], buf, sizeof(buf), MSG_DONTWAIT);

        if (n > 0 && h->show)
            rf_wire_reader_feed(&h->rd[i], buf, (size_t)n, show_reply, (void *)(intptr_t)i);
        if (n > 0)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        h->eof[i] = true;
    }
}

/* Lets the daemon handle what was sent: a few loop turns, the clients drained in between. */
static void pump(harness *h)
{
    int k, i;

    for (k = 0; k < 3; k++) {
        uv_run(&h->loop, UV_RUN_NOWAIT);
        for (i = 0; i < NCLIENTS; i++)
            drain(h, i);
    }
}

static void client_close(harness *h, int i)
{
    if (h->fd[i] >= 0)
        close(h->fd[i]);
    h->fd[i] = -1;
    h->eof[i] = false;
}

static void client_connect(harness *h, int i)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};

    client_close(h, i);
    rf_wire_reader_reset(&h->rd[i]);
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", h->path);
    h->fd[i] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (h->fd[i] < 0 || connect(h->fd[i], (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        perror("fuzz_rpc: connect to the registry's socket");
        abort();
    }
    pump(h);
}

/* Sends len bytes on the current client, with fd as SCM_RIGHTS on the first byte when
 * fd >= 0. Stops early once the daemon closed the client (it may, on bad input). */
static void client_send(harness *h, const uint8_t *p, size_t len, int fd)
{
    int c = h->cur;

    while (len > 0 && h->fd[c] >= 0 && !h->eof[c]) {
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = {(void *)p, len};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t n;

        if (fd >= 0) {
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.space;
            mh.msg_controllen = sizeof(ctl.space);
            CMSG_FIRSTHDR(&mh)->cmsg_level = SOL_SOCKET;
            CMSG_FIRSTHDR(&mh)->cmsg_type = SCM_RIGHTS;
            CMSG_FIRSTHDR(&mh)->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(CMSG_FIRSTHDR(&mh)), &fd, sizeof(int));
        }
        n = sendmsg(h->fd[c], &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            fd = -1;
        } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
            h->eof[c] = true;
            break;
        }
        pump(h);
    }
}

/* The descriptor librefit would send with this frame, or -1. */
static int frame_fd(const uint8_t *body, size_t len)
{
    Refit__Rpc__Request *q = refit__rpc__request__unpack(NULL, len, body);
    int fd = -1;

    if (q != NULL && q->body_case == REFIT__RPC__REQUEST__BODY_REGISTER_REGION &&
        (q->register_region->kind == REFIT__RPC__MEM_KIND__MEM_MEMFD ||
         q->register_region->kind == REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD)) {
        fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, MEMFD_BYTES) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0) {
            perror("fuzz_rpc: memfd");
            abort();
        }
    }
    if (q != NULL)
        refit__rpc__request__free_unpacked(q, NULL);
    return fd;
}

static void action(harness *h, uint32_t w)
{
    uint32_t v = w & 0xffffff;

    switch ((w >> 24) & 7) {
    case 0:
        h->cur = (int)(v % NCLIENTS);
        if (h->fd[h->cur] < 0 || h->eof[h->cur])
            client_connect(h, h->cur);
        break;
    case 1:
        client_close(h, h->cur);
        break;
    case 2: rf_registry_release(h->reg, v); break;
    case 3: rf_registry_abort(h->reg, v, "fuzz: the refit failed"); break;
    case 4: rf_registry_notify(h->reg, RF_REG_COMMITTED, v, NULL); break;
    case 5: rf_registry_notify(h->reg, RF_REG_ABORTED, v, "fuzz: the refit failed"); break;
    case 6: rf_registry_notify(h->reg, RF_REG_INSTALLING, v, NULL); break;
    case 7: rf_registry_hold(h->reg, v & 1); break;
    }
    pump(h);
}

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const rf_registry_cb cb = {.on_status = cb_status, .on_refit = cb_refit,
                                      .on_wait = cb_wait};
    static harness h;
    rf_registry_opts o = {0};
    rf_err err = {0};
    size_t off = 1;
    double t0;
    int i;

    if (size < 1)
        return 0;
    fuzz_quiet();
    memset(&h, 0, sizeof(h));
    h.show = getenv("FUZZ_LOG") != NULL;
    for (i = 0; i < NCLIENTS; i++) {
        h.fd[i] = -1;
        rf_wire_reader_init(&h.rd[i], 0);
    }
    snprintf(h.path, sizeof(h.path), "%s/reg.sock", fuzz_dir());
    uv_loop_init(&h.loop);
    o.socket_path = h.path;
    o.side = data[0] & 1 ? RF_DST : RF_SRC;
    o.expected_clients = data[0] & 2 ? 2 : 1;
    o.gpu_memory = (data[0] & 4) != 0;
    if (rf_registry_open(&h.loop, &o, &cb, NULL, &h.reg, &err) < 0) {
        fprintf(stderr, "fuzz_rpc: registry on %s: %s\n", h.path, err.msg);
        abort();
    }
    client_connect(&h, 0);
    while (off + 4 <= size) {
        uint32_t w = fuzz_be32(data + off);
        size_t len;

        if (w & 0x80000000u) {
            action(&h, w);
            off += 4;
            continue;
        }
        len = size - off - 4 < w ? size - off - 4 : w;
        if (h.fd[h.cur] >= 0 && !h.eof[h.cur]) {
            int fd = frame_fd(data + off + 4, len);

            client_send(&h, data + off, 4 + len, fd);
            if (fd >= 0)
                close(fd);
        }
        off += 4 + len;
    }
    if (off < size)
        client_send(&h, data + off, size - off, -1);
    /* Every client leaves by closing its end; the daemon must close its side in turn. */
    for (i = 0; i < NCLIENTS; i++)
        if (h.fd[i] >= 0)
            shutdown(h.fd[i], SHUT_WR);
    t0 = now_s();
    for (;;) {
        bool open = false;

        pump(&h);
        for (i = 0; i < NCLIENTS; i++)
            open |= h.fd[i] >= 0 && !h.eof[i];
        if (!open)
            break;
        if (now_s() - t0 > 5) {
            fprintf(stderr, "fuzz_rpc: the registry kept a client's connection open 5 s after "
                    "the client shut it down\n");
            abort();
        }
        poll(NULL, 0, 1);
    }
    for (i = 0; i < NCLIENTS; i++) {
        client_close(&h, i);
        rf_wire_reader_reset(&h.rd[i]);
    }
    rf_registry_close(h.reg);
    uv_run(&h.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&h.loop) != 0) {
        fprintf(stderr, "fuzz_rpc: the registry left handles open on its loop after close\n");
        abort();
    }
    return 0;
}
