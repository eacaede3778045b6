/* common/control/rpc.c - the local RPC transport: a libuv server over uv_poll (libuv cannot receive
 * arbitrary fds, so the sockets are read with recvmsg), and blocking client calls. */
#include "rpc.h"

#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "macros.h"
#include "wire.h"


struct rf_rpc_server {
    uv_loop_t *loop;
    uv_poll_t poll; /* the listening socket */
    uv_timer_t reaper; /* closes connections whose send failed, outside the sender's stack */
    int fd;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    ino_t ino;      /* of the socket file we bound, so close removes only ours */
    dev_t dev;
    uid_t *uids;
    size_t nuids;
    gid_t *gids;
    size_t ngids;
    uint32_t max_frame;
    rf_rpc_server_cb cb;
    void *ud;
    bool closing;
    unsigned handles; /* open uv handles (listener + connections); freed at 0 */
    rf_rpc_conn *conns;
};

struct rf_rpc_conn {
    rf_rpc_server *srv;
    uv_poll_t poll;
    int fd;
    rf_rpc_conn *prev, *next;
    struct ucred cred;
    rf_wire_reader reader;
    int fds[RF_RPC_MAX_FDS];
    unsigned nfds;
    uint8_t *out;
    size_t out_len, out_cap, out_off;
    size_t max_output; /* 0: RF_RPC_MAX_OUTPUT */
    bool announced; /* on_connect was called, so on_close is owed */
    bool closing;
    bool failed; /* a send failed: closed by the reaper */
    bool poll_writable;
    void *data;
};

static void server_unref(rf_rpc_server *s)
{
    if (--s->handles > 0)
        return;
    free(s->uids);
    free(s->gids);
    free(s);
}

static int mkdir_parents(const char *path, rf_err *err)
{
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    char *slash;
    size_t i;

    snprintf(dir, sizeof(dir), "%s", path);
    slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir)
        return 0;
    *slash = '\0';
    for (i = 1; dir[i] != '\0'; i++) {
        if (dir[i] != '/')
            continue;
        dir[i] = '\0';
        if (mkdir(dir, 0755) < 0 && errno != EEXIST)
            return rf_err_set(err, -errno, "cannot create directory %s for socket %s: %s", dir,
                              path, strerror(errno));
        dir[i] = '/';
    }
    if (mkdir(dir, 0755) < 0 && errno != EEXIST)
        return rf_err_set(err, -errno, "cannot create runtime directory %s for socket %s: %s",
                          dir, path, strerror(errno));
    return 0;
}

static int fill_addr(const char *path, struct sockaddr_un *sa, rf_err *err)
{
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    if (path == NULL || path[0] == '\0')
        return rf_err_set(err, -EINVAL, "no socket path given");
    if (strlen(path) >= sizeof(sa->sun_path))
        return rf_err_set(err, -ENAMETOOLONG,
                          "socket path %s is %zu bytes; Unix sockets allow at most %zu: use a "
                          "shorter path", path, strlen(path), sizeof(sa->sun_path) - 1);
    memcpy(sa->sun_path, path, strlen(path) + 1);
    return 0;
}

/* The checks of a socket path that need nothing but the path: it fits sun_path, and what is
 * there, if anything, is a socket (*exists says whether something is). */
static int path_check(const char *path, struct sockaddr_un *sa, bool *exists, rf_err *err)
{
    struct stat st;
    int rc;

    *exists = false;
    rc = fill_addr(path, sa, err);
    if (rc < 0)
        return rc;
    if (lstat(path, &st) < 0) {
        if (errno == ENOENT)
            return 0; /* the directories are made when the socket is */
        if (errno == ENOTDIR)
            return rf_err_set(err, -ENOTDIR, "socket path %s goes through a file that is not "
                              "a directory: choose another socket path", path);
        return rf_err_set(err, -errno, "cannot look at socket path %s: %s", path,
                          strerror(errno));
    }
    if (!S_ISSOCK(st.st_mode))
        return rf_err_set(err, -EEXIST, "%s exists and is not a socket: remove it or choose "
                          "another socket path", path);
    *exists = true;
    return 0;
}

int rf_rpc_path_check(const char *path, rf_err *err)
{
    struct sockaddr_un sa;
    bool exists;

    return path_check(path, &sa, &exists, err);
}

/* A socket file left by a dead daemon is replaced; one somebody answers on is not. */
static int clear_stale(const char *path, const struct sockaddr_un *sa, rf_err *err)
{
    int fd = -1, rc = 0;

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return rf_err_set(err, -errno, "socket(): %s", strerror(errno));
    if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) == 0) {
        rc = rf_err_set(err, -EADDRINUSE, "another process is serving on %s: stop it first "
                        "or choose another socket path", path);
        goto out;
    }
    if (errno != ECONNREFUSED && errno != ENOENT) {
        rc = rf_err_set(err, -errno, "cannot probe existing socket %s: %s", path,
                        strerror(errno));
        goto out;
    }
    if (unlink(path) < 0 && errno != ENOENT)
        rc = rf_err_set(err, -errno, "cannot remove stale socket %s: %s", path,
                        strerror(errno));
out:
    close(fd);
    return rc;
}

static bool cred_allowed(const rf_rpc_server *s, const struct ucred *cr)
{
    size_t i;

    if (cr->uid == 0)
        return true;
    for (i = 0; i < s->nuids; i++)
        if (s->uids[i] == cr->uid)
            return true;
    for (i = 0; i < s->ngids; i++)
        if (s->gids[i] == cr->gid)
            return true;
    return false;
}

static void conn_close_cb(uv_handle_t *h)
{
    rf_rpc_conn *c = container_of((uv_poll_t *)h, rf_rpc_conn, poll);
    rf_rpc_server *s = c->srv;
    unsigned i;

    for (i = 0; i < c->nfds; i++)
        close(c->fds[i]);
    close(c->fd);
    rf_wire_reader_reset(&c->reader);
    free(c->out);
    free(c);
    server_unref(s);
}

static int conn_flush(rf_rpc_conn *c)
{
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return -errno;
        }
        c->out_off += (size_t)n;
    }
    if (c->out_off == c->out_len)
        c->out_off = c->out_len = 0;
    return 0;
}

static void conn_poll_cb(uv_poll_t *h, int status, int events);

static void conn_update_poll(rf_rpc_conn *c)
{
    bool want = c->out_len > 0;
    int events = UV_READABLE | (want ? UV_WRITABLE : 0);

    if (c->closing || want == c->poll_writable)
        return;
    c->poll_writable = want;
    uv_poll_start(&c->poll, events, conn_poll_cb);
}

void rf_rpc_conn_close(rf_rpc_conn *c)
{
    rf_rpc_server *s = c->srv;

    if (c->closing)
        return;
    conn_flush(c);
    c->closing = true;
    shutdown(c->fd, SHUT_RDWR);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    uv_poll_stop(&c->poll);
    if (c->announced && s->cb.on_close)
        s->cb.on_close(c, s->ud);
    uv_close((uv_handle_t *)&c->poll, conn_close_cb);
}

static void reaper_cb(uv_timer_t *t)
{
    rf_rpc_server *s = container_of(t, rf_rpc_server, reaper);
    rf_rpc_conn *c, *next;

    for (c = s->conns; c != NULL; c = next) {
        next = c->next;
        if (c->failed) {
            c->out_len = c->out_off = 0;
            rf_rpc_conn_close(c);
            next = s->conns; /* on_close may have closed others: start again */
        }
    }
}

/* A failed send closes the connection from the loop, not from inside the caller, which may
 * be walking its own list of clients. */
static void conn_fail(rf_rpc_conn *c)
{
    c->failed = true;
    if (!c->srv->closing)
        uv_timer_start(&c->srv->reaper, reaper_cb, 0, 0);
}

void rf_rpc_conn_set_max_output(rf_rpc_conn *c, size_t bytes)
{
    c->max_output = bytes;
}

int rf_rpc_conn_send(rf_rpc_conn *c, const Refit__Rpc__Response *resp)
{
    uint8_t *frame = NULL;
    size_t len = 0;
    int rc;

    if (c->closing || c->failed)
        return -EPIPE;
    rc = rf_wire_pack(&resp->base, &frame, &len);
    if (rc < 0)
        goto out;
    if (c->out_len + len > (c->max_output ? c->max_output : RF_RPC_MAX_OUTPUT)) {
        /* The peer stopped reading; holding more would let one client eat the daemon. */
        rc = -ENOBUFS;
        conn_fail(c);
        goto out;
    }
    if (c->out_len + len > c->out_cap) {
        size_t cap = c->out_cap ? c->out_cap : 4096;
        uint8_t *nb;

        while (cap < c->out_len + len)
            cap *= 2;
        nb = realloc(c->out, cap);
        if (nb == NULL) {
            rc = -ENOMEM;
            goto out;
        }
        c->out = nb;
        c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, frame, len);
    c->out_len += len;
    rc = conn_flush(c);
    if (rc < 0) {
        conn_fail(c);
        goto out;
    }
    conn_update_poll(c);
out:
    free(frame);
    return rc;
}

int rf_rpc_conn_reply(rf_rpc_conn *c, uint64_t id, int code, const char *fmt, ...)
{
    Refit__Rpc__Response r = REFIT__RPC__RESPONSE__INIT;
    char msg[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    r.id = id;
    r.code = code;
    r.message = msg;
    return rf_rpc_conn_send(c, &r);
}

int rf_rpc_conn_take_fd(rf_rpc_conn *c)
{
    int fd;

    if (c->nfds == 0)
        return -1;
    fd = c->fds[0];
    memmove(c->fds, c->fds + 1, (c->nfds - 1) * sizeof(int));
    c->nfds--;
    return fd;
}

void rf_rpc_conn_set_data(rf_rpc_conn *c, void *data) { c->data = data; }
void *rf_rpc_conn_data(const rf_rpc_conn *c) { return c->data; }

void rf_rpc_conn_cred(const rf_rpc_conn *c, pid_t *pid, uid_t *uid, gid_t *gid)
{
    if (pid)
        *pid = c->cred.pid;
    if (uid)
        *uid = c->cred.uid;
    if (gid)
        *gid = c->cred.gid;
}

static bool get_varint(const uint8_t *b, size_t len, size_t *i, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64 && *i < len; shift += 7) {
        uint8_t c = b[(*i)++];

        *v |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80))
            return true;
    }
    return false;
}

/* Whether no string field of message d in b (at any depth) holds a NUL byte: protobuf-c
 * hands strings over NUL-terminated, so "block\0x" would be read as "block" and a name cut
 * short without a word. Whatever else is wrong with b is left to the unpacker: this walk only
 * says false for a NUL it found (depth is bounded like the unpacker's nesting). */
static bool strings_nul_free(const ProtobufCMessageDescriptor *d, const uint8_t *b, size_t len,
                             int depth, const char **field)
{
    size_t i = 0;

    while (i < len) {
        const ProtobufCFieldDescriptor *f;
        uint64_t key, n;

        if (!get_varint(b, len, &i, &key))
            return true;
        switch (key & 7) {
        case 0:
            if (!get_varint(b, len, &i, &n))
                return true;
            continue;
        case 1:
            i += 8;
            continue;
        case 5:
            i += 4;
            continue;
        case 2:
            break;
        default:
            return true;
        }
        if (!get_varint(b, len, &i, &n) || n > len - i)
            return true;
        f = protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
        if (f && f->type == PROTOBUF_C_TYPE_STRING && memchr(b + i, 0, n)) {
            *field = f->name;
            return false;
        }
        if (f && f->type == PROTOBUF_C_TYPE_MESSAGE && depth < 8 &&
            !strings_nul_free(f->descriptor, b + i, n, depth + 1, field))
            return false;
        i += n;
    }
    return true;
}

static int on_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    rf_rpc_conn *c = ctx;
    rf_rpc_server *s = c->srv;
    Refit__Rpc__Request *req;
    const char *field = "";

    req = refit__rpc__request__unpack(NULL, len, body);
    if (req == NULL) {
        rf_rpc_conn_reply(c, 0, -EBADMSG, "malformed request frame (%u bytes that do not "
                          "decode as refit.rpc.Request): closing the connection", len);
        return -EBADMSG;
    }
    if (!strings_nul_free(&refit__rpc__request__descriptor, body, len, 0, &field)) {
        rf_rpc_conn_reply(c, req->id, -EINVAL, "request %llu holds a NUL byte inside its "
                          "string field '%s' (names and formats are text without NUL): "
                          "closing the connection", (unsigned long long)req->id, field);
        refit__rpc__request__free_unpacked(req, NULL);
        return -EBADMSG;
    }
    if (req->body_case == REFIT__RPC__REQUEST__BODY__NOT_SET) {
        /* A newer client, or garbage that happens to decode: the stream is still in step. */
        rf_rpc_conn_reply(c, req->id, -EOPNOTSUPP, "unknown request (no request body this "
                          "daemon knows, protocol version %d): upgrade the daemon or the "
                          "client", RF_RPC_PROTOCOL_VERSION);
    } else if (s->cb.on_request) {
        s->cb.on_request(c, req, s->ud);
    }
    refit__rpc__request__free_unpacked(req, NULL);
    return c->closing ? -EPIPE : 0;
}

static void conn_read(rf_rpc_conn *c)
{
    uint8_t buf[16384];
    union {
        struct cmsghdr h;
        /* One message's worth: a read stops at the next message with descriptors, and the
         * kernel puts at most 253 (SCM_MAX_FD) on one. */
        char space[CMSG_SPACE(sizeof(int) * 253)];
    } ctl;
    int round;

    /* A bounded number of reads per wakeup, so one busy client cannot starve the others. */
    for (round = 0; round < 16 && !c->closing; round++) {
        struct iovec iov = {buf, sizeof(buf)};
        struct msghdr mh = {0};
        struct cmsghdr *cm;
        bool too_many = false;
        ssize_t n;
        int rc;

        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof(ctl.space);
        n = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                rf_rpc_conn_close(c);
            return;
        }
        for (cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm)) {
            size_t i, nf;

            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
                continue;
            nf = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (i = 0; i < nf; i++) {
                int fd;

                memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                if (c->nfds < RF_RPC_MAX_FDS) {
                    c->fds[c->nfds++] = fd;
                } else {
                    close(fd);
                    too_many = true;
                }
            }
        }
        if (too_many) {
            rf_rpc_conn_reply(c, 0, -EMFILE, "too many file descriptors sent without the "
                              "requests that claim them (at most %d): closing the connection",
                              RF_RPC_MAX_FDS);
            rf_rpc_conn_close(c);
            return;
        }
        /* The kernel drops the fds it cannot install in this process: its open-file limit,
         * which a region over many VMM allocations (one fd each, kept) can reach. */
        if (mh.msg_flags & MSG_CTRUNC) {
            struct rlimit rl = {0};

            getrlimit(RLIMIT_NOFILE, &rl);
            rf_rpc_conn_reply(c, 0, -EMFILE, "the daemon could not take the file descriptors "
                              "sent: its open-file limit (RLIMIT_NOFILE %llu) is reached; "
                              "raise LimitNOFILE (ulimit -n) of the daemon, which keeps one fd "
                              "per registered memfd or VMM allocation: closing the connection",
                              (unsigned long long)rl.rlim_cur);
            rf_rpc_conn_close(c);
            return;
        }
        if (n == 0) {
            rf_rpc_conn_close(c);
            return;
        }
        rc = rf_wire_reader_feed(&c->reader, buf, (size_t)n, on_frame, c);
        if (rc == -EMSGSIZE)
            rf_rpc_conn_reply(c, 0, -EMSGSIZE, "request frame of %u bytes is larger than the "
                              "maximum of %u bytes for a request (no real request comes "
                              "near it): closing the connection", c->reader.body_len,
                              c->srv->max_frame);
        else if (rc == -ENOMEM)
            rf_rpc_conn_reply(c, 0, -ENOMEM, "out of memory reading a request: closing the "
                              "connection");
        if (rc < 0) {
            rf_rpc_conn_close(c);
            return;
        }
    }
}

static void conn_poll_cb(uv_poll_t *h, int status, int events)
{
    rf_rpc_conn *c = container_of(h, rf_rpc_conn, poll);

    if (c->closing || c->failed)
        return;
    if (status < 0) {
        rf_rpc_conn_close(c);
        return;
    }
    if (events & UV_WRITABLE) {
        if (conn_flush(c) < 0) {
            rf_rpc_conn_close(c);
            return;
        }
        conn_update_poll(c);
    }
    if (events & (UV_READABLE | UV_DISCONNECT))
        conn_read(c);
}

static void accept_one(rf_rpc_server *s, int fd)
{
    rf_rpc_conn *c;
    socklen_t len = sizeof(c->cred);

    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        close(fd);
        return;
    }
    c->srv = s;
    c->fd = fd;
    rf_wire_reader_init(&c->reader, s->max_frame);
    if (uv_poll_init(s->loop, &c->poll, fd) < 0) {
        close(fd);
        free(c);
        return;
    }
    s->handles++;
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    uv_poll_start(&c->poll, UV_READABLE, conn_poll_cb);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c->cred, &len) < 0) {
        rf_rpc_conn_reply(c, 0, -EACCES, "cannot read the peer credentials of the connection "
                          "(%s): closing it", strerror(errno));
        rf_rpc_conn_close(c);
        return;
    }
    if (!cred_allowed(s, &c->cred)) {
        rf_rpc_conn_reply(c, 0, -EACCES, "uid %u gid %u (pid %d) is not allowed on %s: add "
                          "the uid or gid to the daemon's allowed list", (unsigned)c->cred.uid,
                          (unsigned)c->cred.gid, (int)c->cred.pid, s->path);
        rf_rpc_conn_close(c);
        return;
    }
    c->announced = true;
    if (s->cb.on_connect)
        s->cb.on_connect(c, s->ud);
}

static void listen_cb(uv_poll_t *h, int status, int events)
{
    rf_rpc_server *s = container_of(h, rf_rpc_server, poll);
    int i;

    (void)events;
    if (status < 0 || s->closing)
        return;
    for (i = 0; i < 64; i++) {
        int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

        if (fd < 0)
            return; /* EAGAIN, or a transient error (EMFILE, ...) retried on the next wakeup */
        accept_one(s, fd);
    }
}

int rf_rpc_server_open(uv_loop_t *loop, const rf_rpc_server_opts *opts,
                       const rf_rpc_server_cb *cb, void *ud, rf_rpc_server **out, rf_err *err)
{
    struct sockaddr_un sa;
    struct stat st;
    rf_rpc_server *s = NULL;
    bool bound = false, exists;
    int rc;

    *out = NULL;
    rc = path_check(opts->path, &sa, &exists, err);
    if (rc < 0)
        return rc;
    s = calloc(1, sizeof(*s));
    if (s == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory opening %s", opts->path);
    s->fd = -1;
    s->loop = loop;
    s->cb = *cb;
    s->ud = ud;
    s->max_frame = opts->max_frame && opts->max_frame < RF_RPC_MAX_REQUEST ? opts->max_frame
                                                                          : RF_RPC_MAX_REQUEST;
    snprintf(s->path, sizeof(s->path), "%s", opts->path);
    if (opts->n_allowed_uids == 0 && opts->n_allowed_gids == 0) {
        s->nuids = 1;
        s->uids = malloc(sizeof(uid_t));
        if (s->uids)
            s->uids[0] = geteuid();
    } else {
        s->nuids = opts->n_allowed_uids;
        s->ngids = opts->n_allowed_gids;
        s->uids = malloc((s->nuids + 1) * sizeof(uid_t));
        s->gids = malloc((s->ngids + 1) * sizeof(gid_t));
        if (s->uids && s->nuids)
            memcpy(s->uids, opts->allowed_uids, s->nuids * sizeof(uid_t));
        if (s->gids && s->ngids)
            memcpy(s->gids, opts->allowed_gids, s->ngids * sizeof(gid_t));
    }
    if (s->uids == NULL || (s->ngids && s->gids == NULL)) {
        rc = rf_err_set(err, -ENOMEM, "out of memory opening %s", opts->path);
        goto out;
    }
    rc = mkdir_parents(opts->path, err);
    if (rc < 0)
        goto out;
    if (exists) {
        rc = clear_stale(opts->path, &sa, err);
        if (rc < 0)
            goto out;
    }
    s->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->fd < 0) {
        rc = rf_err_set(err, -errno, "socket() for %s: %s", opts->path, strerror(errno));
        goto out;
    }
    if (bind(s->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        rc = rf_err_set(err, -errno, "cannot bind %s: %s", opts->path, strerror(errno));
        goto out;
    }
    bound = true;
    /* Mode before listen(): nobody can connect in between. */
    if (chmod(opts->path, 0660) < 0 || stat(opts->path, &st) < 0) {
        rc = rf_err_set(err, -errno, "cannot set mode 0660 on %s: %s", opts->path,
                        strerror(errno));
        goto out;
    }
    s->ino = st.st_ino;
    s->dev = st.st_dev;
    if (listen(s->fd, 128) < 0) {
        rc = rf_err_set(err, -errno, "cannot listen on %s: %s", opts->path, strerror(errno));
        goto out;
    }
    rc = uv_poll_init(loop, &s->poll, s->fd);
    if (rc < 0) {
        rf_err_set(err, rc, "uv_poll_init on %s: %s", opts->path, uv_strerror(rc));
        goto out;
    }
    uv_timer_init(loop, &s->reaper);
    s->handles = 2;
    uv_poll_start(&s->poll, UV_READABLE, listen_cb);
    *out = s;
    s = NULL;
    rc = 0;
out:
    if (s) {
        if (bound)
            unlink(opts->path);
        if (s->fd >= 0)
            close(s->fd);
        free(s->uids);
        free(s->gids);
        free(s);
    }
    return rc;
}

static void listen_close_cb(uv_handle_t *h)
{
    rf_rpc_server *s = container_of((uv_poll_t *)h, rf_rpc_server, poll);

    close(s->fd);
    server_unref(s);
}

static void reaper_close_cb(uv_handle_t *h)
{
    server_unref(container_of((uv_timer_t *)h, rf_rpc_server, reaper));
}

void rf_rpc_server_close(rf_rpc_server *s)
{
    struct stat st;

    if (s == NULL || s->closing)
        return;
    s->closing = true;
    while (s->conns)
        rf_rpc_conn_close(s->conns);
    if (stat(s->path, &st) == 0 && st.st_ino == s->ino && st.st_dev == s->dev)
        unlink(s->path);
    uv_poll_stop(&s->poll);
    uv_close((uv_handle_t *)&s->poll, listen_close_cb);
    uv_close((uv_handle_t *)&s->reaper, reaper_close_cb);
}

const char *rf_rpc_server_path(const rf_rpc_server *s)
{
    return s->path;
}

int rf_rpc_dial(const char *path, int *fd, rf_err *err)
{
    struct sockaddr_un sa;
    int s, rc;

    *fd = -1;
    rc = fill_addr(path, &sa, err);
    if (rc < 0)
        return rc;
    s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return rf_err_set(err, -errno, "socket(): %s", strerror(errno));
    if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        rc = -errno;
        close(s);
        if (rc == -ENOENT)
            return rf_err_set(err, rc, "no socket at %s: is the daemon running? (set "
                              "REFIT_SOCKET to another path if it listens elsewhere)", path);
        if (rc == -ECONNREFUSED)
            return rf_err_set(err, rc, "nobody is listening on %s (a stale socket): start "
                              "the daemon", path);
        if (rc == -EACCES)
            return rf_err_set(err, rc, "permission denied connecting to %s: the socket is "
                              "mode 0660; run as the daemon's user or group", path);
        return rf_err_set(err, rc, "cannot connect to %s: %s", path, strerror(-rc));
    }
    *fd = s;
    return 0;
}

int rf_rpc_send_fds(int fd, const Refit__Rpc__Request *req, const int *fds, size_t nfds,
                    rf_err *err)
{
    uint8_t *frame = NULL;
    size_t len = 0, off = 0, sent_fds = 0;
    int rc;

    if (nfds > RF_RPC_MAX_FDS)
        return rf_err_set(err, -E2BIG, "a request with %zu file descriptors: a daemon takes "
                          "at most %d with one request", nfds, RF_RPC_MAX_FDS);
    rc = rf_wire_pack(&req->base, &frame, &len);
    if (rc < 0) {
        rf_err_set(err, rc, "cannot pack request: %s", strerror(-rc));
        goto out;
    }
    if (len - 4 > RF_RPC_MAX_REQUEST) {
        rc = rf_err_set(err, -EMSGSIZE, "request of %zu bytes is larger than the %u bytes a "
                        "daemon accepts (a name or string in it is far too long)", len - 4,
                        RF_RPC_MAX_REQUEST);
        goto out;
    }
    /* Every batch but the last rides on a byte of its own; the 4-byte length alone leaves
     * room for 4 batches, and a request with more fds lists them, so it is longer. */
    if ((nfds + RF_RPC_FDS_PER_MSG - 1) / RF_RPC_FDS_PER_MSG > len) {
        rc = rf_err_set(err, -EINVAL, "a request of %zu bytes cannot carry %zu file "
                        "descriptors", len, nfds);
        goto out;
    }
    while (off < len) {
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int) * RF_RPC_FDS_PER_MSG)];
        } ctl;
        size_t batch = nfds - sent_fds < RF_RPC_FDS_PER_MSG ? nfds - sent_fds
                                                            : RF_RPC_FDS_PER_MSG;
        struct iovec iov = {frame + off, len - off};
        struct msghdr mh = {0};
        ssize_t n;

        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        if (batch > 0) {
            struct cmsghdr *cm;

            /* Not the last batch: one byte, so the next batch starts a message of its own. */
            if (sent_fds + batch < nfds)
                iov.iov_len = 1;
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.space;
            mh.msg_controllen = CMSG_SPACE(sizeof(int) * batch);
            cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int) * batch);
            memcpy(CMSG_DATA(cm), fds + sent_fds, sizeof(int) * batch);
        }
        n = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            rc = rf_err_set(err, -errno, "cannot send to the daemon: %s%s", strerror(errno),
                            errno == EPIPE ? " (the daemon closed the connection)" : "");
            goto out;
        }
        /* A sendmsg that took any byte took its descriptors with it. */
        if (n > 0)
            sent_fds += batch;
        off += (size_t)n;
    }
    rc = 0;
out:
    free(frame);
    return rc;
}

int rf_rpc_send(int fd, const Refit__Rpc__Request *req, int passfd, rf_err *err)
{
    return rf_rpc_send_fds(fd, req, &passfd, passfd >= 0 ? 1 : 0, err);
}
