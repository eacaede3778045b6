/* tests/unit/test_rpc.c - the local RPC transport: a server on a loop thread, raw clients
 * over real Unix sockets sending good and bad frames, fds and wrong credentials. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rpc.h"
#include "wire.h"

typedef struct srv {
    uv_loop_t loop;
    uv_async_t stop;
    pthread_t th;
    rf_rpc_server *s;
    char dir[64], path[128];
    pthread_mutex_t mu;
    int connects, closes, last_send_rc;
} srv;

static srv S;

static void on_connect(rf_rpc_conn *c, void *ud)
{
    srv *s = ud;

    (void)c;
    pthread_mutex_lock(&s->mu);
    s->connects++;
    pthread_mutex_unlock(&s->mu);
}

static void on_close(rf_rpc_conn *c, void *ud)
{
    srv *s = ud;

    (void)c;
    pthread_mutex_lock(&s->mu);
    s->closes++;
    pthread_mutex_unlock(&s->mu);
}

/* Echo server: answers each request with its body case in `region`; RegisterRegion answers
 * the size of the fd it carried in `version` (with chunks: the sum over its fds, in order, of
 * (index + 1) * size, so order shows); Status floods the client with 1 MiB answers. */
static void on_request(rf_rpc_conn *c, const Refit__Rpc__Request *q, void *ud)
{
    Refit__Rpc__Response r = REFIT__RPC__RESPONSE__INIT;
    srv *s = ud;
    int i, rc = 0;

    r.id = q->id;
    r.region = (uint32_t)q->body_case;
    if (q->body_case == REFIT__RPC__REQUEST__BODY_REGISTER_REGION) {
        size_t k, n = q->register_region->n_chunks ? q->register_region->n_chunks : 1;

        for (k = 0; k < n; k++) {
            int fd = rf_rpc_conn_take_fd(c);
            struct stat st;

            if (fd >= 0 && fstat(fd, &st) == 0)
                r.version += (k + 1) * (uint64_t)st.st_size;
            if (fd >= 0)
                close(fd);
        }
        rf_rpc_conn_send(c, &r);
    } else if (q->body_case == REFIT__RPC__REQUEST__BODY_STATUS) {
        char *big = malloc(1 << 20);

        memset(big, 'x', (1 << 20) - 1);
        big[(1 << 20) - 1] = '\0';
        r.status_json = big;
        for (i = 0; i < 40 && rc == 0; i++)
            rc = rf_rpc_conn_send(c, &r);
        pthread_mutex_lock(&s->mu);
        s->last_send_rc = rc;
        pthread_mutex_unlock(&s->mu);
        free(big);
    } else {
        rf_rpc_conn_send(c, &r);
    }
}

static void stop_cb(uv_async_t *a)
{
    srv *s = a->data;

    rf_rpc_server_close(s->s);
    uv_close((uv_handle_t *)a, NULL);
}

static void *loop_main(void *arg)
{
    srv *s = arg;

    uv_run(&s->loop, UV_RUN_DEFAULT);
    return NULL;
}

static int start(srv *s, const rf_rpc_server_opts *base, rf_err *err)
{
    static const rf_rpc_server_cb cb = {on_connect, on_request, on_close};
    rf_rpc_server_opts o = {0};
    int rc;

    if (base)
        o = *base;
    o.path = s->path;
    o.max_frame = o.max_frame ? o.max_frame : 4096;
    rc = rf_rpc_server_open(&s->loop, &o, &cb, s, &s->s, err);
    if (rc < 0)
        return rc;
    uv_async_init(&s->loop, &s->stop, stop_cb);
    s->stop.data = s;
    pthread_create(&s->th, NULL, loop_main, s);
    return 0;
}

static void setup(void)
{
    memset(&S, 0, sizeof(S));
    pthread_mutex_init(&S.mu, NULL);
    snprintf(S.dir, sizeof(S.dir), "/tmp/rf_rpc_XXXXXX");
    cr_assert(mkdtemp(S.dir));
    snprintf(S.path, sizeof(S.path), "%s/run/refit/t.sock", S.dir);
    uv_loop_init(&S.loop);
}

static void teardown(void)
{
    char cmd[128];

    if (S.s) {
        uv_async_send(&S.stop);
        pthread_join(S.th, NULL);
    }
    uv_run(&S.loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&S.loop), 0, "loop closed with handles open");
    snprintf(cmd, sizeof(cmd), "rm -rf %s", S.dir);
    cr_assert(system(cmd) == 0);
}

TestSuite(rpc, .init = setup, .fini = teardown);

static int dial(void)
{
    rf_err err = {0};
    int fd;

    cr_assert_eq(rf_rpc_dial(S.path, &fd, &err), 0, "%s", err.msg);
    return fd;
}

/* Reads one whole frame (blocking, 5 s) and decodes it; NULL on EOF. */
static Refit__Rpc__Response *read_resp(int fd)
{
    struct timeval tv = {5, 0};
    uint8_t hdr[4], *body;
    uint32_t len, have = 0;
    Refit__Rpc__Response *r;
    ssize_t n;

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    while (have < 4) {
        n = recv(fd, hdr + have, 4 - have, 0);
        if (n <= 0)
            return NULL;
        have += (uint32_t)n;
    }
    memcpy(&len, hdr, 4);
    len = ntohl(len);
    body = malloc(len ? len : 1);
    for (have = 0; have < len; have += (uint32_t)n) {
        n = recv(fd, body + have, len - have, 0);
        cr_assert(n > 0, "short frame");
    }
    r = refit__rpc__response__unpack(NULL, len, body);
    free(body);
    cr_assert_not_null(r);
    return r;
}

static void send_status(int fd, uint64_t id)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Status st = REFIT__RPC__STATUS__INIT;
    rf_err err = {0};

    q.id = id;
    q.body_case = REFIT__RPC__REQUEST__BODY_STATUS;
    q.status = &st;
    cr_assert_eq(rf_rpc_send(fd, &q, -1, &err), 0, "%s", err.msg);
}

static void ping(int fd, uint64_t id)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Seal seal = REFIT__RPC__SEAL__INIT;
    Refit__Rpc__Response *r;
    rf_err err = {0};

    q.id = id;
    q.body_case = REFIT__RPC__REQUEST__BODY_SEAL;
    q.seal = &seal;
    cr_assert_eq(rf_rpc_send(fd, &q, -1, &err), 0, "%s", err.msg);
    r = read_resp(fd);
    cr_assert_not_null(r, "server stopped answering");
    cr_assert_eq(r->id, id);
    cr_assert_eq(r->code, 0);
    cr_assert_eq(r->region, REFIT__RPC__REQUEST__BODY_SEAL);
    refit__rpc__response__free_unpacked(r, NULL);
}

static void expect_error_then_eof(int fd, int code, const char *text)
{
    Refit__Rpc__Response *r = read_resp(fd);

    cr_assert_not_null(r, "no error answer");
    cr_assert_eq(r->id, 0);
    cr_assert_eq(r->code, code, "code %d: %s", r->code, r->message);
    cr_assert(strstr(r->message, text), "%s", r->message);
    refit__rpc__response__free_unpacked(r, NULL);
    cr_assert_null(read_resp(fd), "connection left open");
}

Test(rpc, socket_created_with_modes_and_answers)
{
    rf_err err = {0};
    struct stat st;
    char dir[160];
    int fd;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(stat(S.path, &st), 0);
    cr_assert(S_ISSOCK(st.st_mode));
    cr_assert_eq(st.st_mode & 0777, 0660);
    snprintf(dir, sizeof(dir), "%s/run/refit", S.dir);
    cr_assert_eq(stat(dir, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0755);
    fd = dial();
    ping(fd, 1);
    ping(fd, 2);
    close(fd);
}

Test(rpc, fd_passed_with_request)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion rr = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__Response *r;
    rf_err err = {0};
    int fd, mfd, i;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    fd = dial();
    for (i = 1; i <= 3; i++) {
        mfd = memfd_create("t", MFD_CLOEXEC);
        cr_assert(ftruncate(mfd, 1000 * i) == 0);
        q.id = (uint64_t)i;
        q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
        q.register_region = &rr;
        rr.device = "host";
        cr_assert_eq(rf_rpc_send(fd, &q, mfd, &err), 0, "%s", err.msg);
        close(mfd);
    }
    for (i = 1; i <= 3; i++) {
        r = read_resp(fd);
        cr_assert_eq(r->id, (uint64_t)i);
        cr_assert_eq(r->version, 1000u * i, "fd %d arrived with its own request", i);
        refit__rpc__response__free_unpacked(r, NULL);
    }
    close(fd);
}

Test(rpc, malformed_frame_closes_only_that_client)
{
    uint8_t frame[] = {0, 0, 0, 3, 0xff, 0xff, 0xff};
    rf_err err = {0};
    int bad, good;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    good = dial();
    bad = dial();
    cr_assert_eq(send(bad, frame, sizeof(frame), 0), (ssize_t)sizeof(frame));
    expect_error_then_eof(bad, -EBADMSG, "malformed request frame");
    ping(good, 7);
    close(bad);
    close(good);
}

Test(rpc, oversized_frame_refused_before_reading_it)
{
    uint8_t hdr[4] = {0x00, 0x10, 0x00, 0x00}; /* 1 MiB, max is 4096 */
    rf_err err = {0};
    int bad, good;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    good = dial();
    bad = dial();
    cr_assert_eq(send(bad, hdr, 4, 0), 4);
    expect_error_then_eof(bad, -EMSGSIZE, "larger than the maximum of 4096");
    ping(good, 1);
    close(bad);
    close(good);
}

/* The daemons pass their peer limit (64 MiB) as max_frame; requests are held to
 * RF_RPC_MAX_REQUEST all the same. A frame of exactly the limit is read; one byte more, or a
 * 4 GiB length, is refused on the length alone (no body sent, nothing allocated for it),
 * with a message naming the limit, and only that connection is closed. */
Test(rpc, request_limit_checked_on_the_length)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Hello h = REFIT__RPC__HELLO__INIT;
    Refit__Rpc__Response *r;
    rf_rpc_server_opts o = {0};
    rf_err err = {0};
    uint8_t over[4], huge[4] = {0xff, 0xff, 0xff, 0xff};
    uint32_t be = htonl(RF_RPC_MAX_REQUEST + 1);
    char *name = calloc(1, RF_RPC_MAX_REQUEST);
    size_t n = RF_RPC_MAX_REQUEST - 16;
    char text[128];
    int good, bad;

    o.max_frame = 64u << 20;
    cr_assert_eq(start(&S, &o, &err), 0, "%s", err.msg);
    q.id = 5;
    q.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    q.hello = &h;
    h.name = name;
    memset(name, 'n', n);
    while (refit__rpc__request__get_packed_size(&q) > RF_RPC_MAX_REQUEST)
        name[--n] = '\0';
    while (refit__rpc__request__get_packed_size(&q) < RF_RPC_MAX_REQUEST)
        name[n++] = 'n';
    cr_assert_eq(refit__rpc__request__get_packed_size(&q), RF_RPC_MAX_REQUEST);
    good = dial();
    cr_assert_eq(rf_rpc_send(good, &q, -1, &err), 0, "%s", err.msg);
    r = read_resp(good);
    cr_assert_not_null(r, "a request of exactly the limit was not answered");
    cr_assert_eq(r->id, 5);
    cr_assert_eq(r->code, 0, "%s", r->message);
    refit__rpc__response__free_unpacked(r, NULL);

    memcpy(over, &be, 4);
    snprintf(text, sizeof(text), "request frame of %u bytes is larger than the maximum of %u "
             "bytes", RF_RPC_MAX_REQUEST + 1, RF_RPC_MAX_REQUEST);
    bad = dial();
    cr_assert_eq(send(bad, over, 4, 0), 4);
    expect_error_then_eof(bad, -EMSGSIZE, text);
    close(bad);
    bad = dial();
    cr_assert_eq(send(bad, huge, 4, 0), 4);
    expect_error_then_eof(bad, -EMSGSIZE, "request frame of 4294967295 bytes is larger than "
                          "the maximum of 65536 bytes");
    close(bad);
    ping(good, 6);
    close(good);

    /* The client side does not send what the daemon would refuse. */
    name[n] = 'n';
    good = dial();
    cr_assert_eq(rf_rpc_send(good, &q, -1, &err), -EMSGSIZE);
    cr_assert(strstr(err.msg, "larger than the 65536 bytes a daemon accepts"), "%s", err.msg);
    ping(good, 7);
    close(good);
    free(name);
}

/* The limit is far above the largest request a client can make: a RegisterPiece with the
 * longest tensor name, every dim, and every number at its longest encoding. */
Test(rpc, largest_real_request_is_far_under_the_limit)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterPiece m = REFIT__RPC__REGISTER_PIECE__INIT;
    int64_t dims[8];
    char name[256];

    memset(name, 'x', 255);
    name[255] = '\0';
    for (int i = 0; i < 8; i++)
        dims[i] = INT64_MIN;
    m.tensor = name;
    m.dtype = UINT32_MAX;
    m.region = UINT32_MAX;
    m.offset = UINT64_MAX;
    m.n_shape = m.n_start = m.n_extent = m.n_strides = 8;
    m.shape = m.start = m.extent = m.strides = dims;
    q.id = UINT64_MAX;
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_PIECE;
    q.register_piece = &m;
    cr_assert_leq(refit__rpc__request__get_packed_size(&q), 700);
    cr_assert_leq(refit__rpc__request__get_packed_size(&q) * 64, RF_RPC_MAX_REQUEST);
}

/* A region over the most VMM allocations a request may bring an fd for, with the largest
 * numbers, fits a request four times over. */
Test(rpc, largest_chunked_region_fits_a_request)
{
    static Refit__Rpc__VmmChunk ch[RF_RPC_MAX_FDS], *chp[RF_RPC_MAX_FDS];
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion m = REFIT__RPC__REGISTER_REGION__INIT;
    char dev[128];

    memset(dev, 'G', sizeof(dev) - 1);
    dev[sizeof(dev) - 1] = '\0';
    for (int i = 0; i < RF_RPC_MAX_FDS; i++) {
        refit__rpc__vmm_chunk__init(&ch[i]);
        ch[i].size = ch[i].offset = UINT64_MAX;
        chp[i] = &ch[i];
    }
    m.size = m.offset = UINT64_MAX;
    m.device = dev;
    m.kind = REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD;
    m.n_chunks = RF_RPC_MAX_FDS;
    m.chunks = chp;
    q.id = UINT64_MAX;
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    q.register_region = &m;
    cr_assert_leq(refit__rpc__request__get_packed_size(&q) * 2, RF_RPC_MAX_REQUEST);
}

Test(rpc, unknown_request_answered_and_kept)
{
    /* A Request with only an id: no body this daemon knows (a newer client's request). */
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Response *r;
    rf_err err = {0};
    int fd;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    fd = dial();
    q.id = 42;
    cr_assert_eq(rf_rpc_send(fd, &q, -1, &err), 0, "%s", err.msg);
    r = read_resp(fd);
    cr_assert_eq(r->id, 42);
    cr_assert_eq(r->code, -EOPNOTSUPP);
    cr_assert(strstr(r->message, "unknown request"), "%s", r->message);
    refit__rpc__response__free_unpacked(r, NULL);
    ping(fd, 43);
    close(fd);
}

/* More fds than a request may bring, with no request: sent as the kernel takes them (at most
 * 253 a message), one memfd repeated, on single bytes. The server holds them until the cut,
 * so this process needs room for them. */
Test(rpc, too_many_fds_closes_client)
{
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * RF_RPC_FDS_PER_MSG)];
    } ctl;
    /* The bytes start a frame of 256 bytes that never completes. */
    static const uint8_t bytes[] = {0, 0, 1, 0, 0, 0, 0, 0};
    int fds[RF_RPC_FDS_PER_MSG], fd, mfd, i, k = 0, sent = 0;
    struct rlimit rl;
    rf_err err = {0};

    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_cur < 2 * RF_RPC_MAX_FDS + 64) {
        if (rl.rlim_max < 2 * RF_RPC_MAX_FDS + 64)
            cr_skip("RLIMIT_NOFILE hard limit %llu is below %d",
                    (unsigned long long)rl.rlim_max, 2 * RF_RPC_MAX_FDS + 64);
        rl.rlim_cur = 2 * RF_RPC_MAX_FDS + 64;
        cr_assert_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
    }
    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    fd = dial();
    mfd = memfd_create("t", MFD_CLOEXEC);
    for (i = 0; i < RF_RPC_FDS_PER_MSG; i++)
        fds[i] = mfd;
    while (sent <= RF_RPC_MAX_FDS) {
        struct iovec iov = {(void *)&bytes[k++], 1};
        struct msghdr mh = {0};
        struct cmsghdr *cm;

        memset(&ctl, 0, sizeof(ctl));
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof(ctl.space);
        cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(fds));
        memcpy(CMSG_DATA(cm), fds, sizeof(fds));
        if (sendmsg(fd, &mh, MSG_NOSIGNAL) != 1)
            break; /* the server cut us already */
        sent += RF_RPC_FDS_PER_MSG;
    }
    cr_assert_gt(sent, RF_RPC_MAX_FDS);
    expect_error_then_eof(fd, -EMFILE, "too many file descriptors");
    close(mfd);
    close(fd);
}

/* Fds the daemon's process may not open (its RLIMIT_NOFILE; the server runs in this process
 * here) are refused by that name, not as a short count. */
Test(rpc, fds_over_the_open_file_limit_name_the_limit)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion rr = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__VmmChunk ch[8], *chp[8];
    struct rlimit old, low;
    rf_err err = {0};
    int fds[8], fd, i, open_now = 0;
    DIR *d;
    struct dirent *de;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    fd = dial();
    for (i = 0; i < 8; i++) {
        fds[i] = memfd_create("chunk", MFD_CLOEXEC);
        refit__rpc__vmm_chunk__init(&ch[i]);
        chp[i] = &ch[i];
    }
    cr_assert_not_null(d = opendir("/proc/self/fd"));
    while ((de = readdir(d)) != NULL)
        open_now += de->d_name[0] != '.';
    closedir(d);
    /* Room for 3 more: the directory's own fd counted above is closed again. */
    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
    low = old;
    low.rlim_cur = (rlim_t)open_now - 1 + 3;
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
    q.id = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    q.register_region = &rr;
    rr.device = "GPU-0";
    rr.n_chunks = 8;
    rr.chunks = chp;
    cr_assert_eq(rf_rpc_send_fds(fd, &q, fds, 8, &err), 0, "%s", err.msg);
    expect_error_then_eof(fd, -EMFILE, "raise LimitNOFILE (ulimit -n) of the daemon");
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
    for (i = 0; i < 8; i++)
        close(fds[i]);
    close(fd);
}

/* A region over more allocations than one message carries: its fds come in order on the
 * frame's first bytes, all claimed by it, and the next request's fd is still its own. */
Test(rpc, many_fds_with_one_request_arrive_in_order)
{
    enum { N = 2 * RF_RPC_FDS_PER_MSG + 17 };
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__RegisterRegion rr = REFIT__RPC__REGISTER_REGION__INIT;
    Refit__Rpc__VmmChunk ch[N], *chp[N];
    Refit__Rpc__Response *r;
    uint64_t want = 0;
    int fds[N], fd, mfd, i;
    rf_err err = {0};

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    fd = dial();
    for (i = 0; i < N; i++) {
        fds[i] = memfd_create("chunk", MFD_CLOEXEC);
        cr_assert_geq(fds[i], 0);
        cr_assert_eq(ftruncate(fds[i], i + 1), 0);
        want += (uint64_t)(i + 1) * (uint64_t)(i + 1);
        refit__rpc__vmm_chunk__init(&ch[i]);
        ch[i].size = (uint64_t)i + 1;
        chp[i] = &ch[i];
    }
    q.id = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
    q.register_region = &rr;
    rr.device = "GPU-0";
    rr.n_chunks = N;
    rr.chunks = chp;
    cr_assert_eq(rf_rpc_send_fds(fd, &q, fds, N, &err), 0, "%s", err.msg);
    for (i = 0; i < N; i++)
        close(fds[i]);
    mfd = memfd_create("next", MFD_CLOEXEC);
    cr_assert_eq(ftruncate(mfd, 4242), 0);
    rr.n_chunks = 0;
    rr.chunks = NULL;
    q.id = 2;
    cr_assert_eq(rf_rpc_send(fd, &q, mfd, &err), 0, "%s", err.msg);
    close(mfd);
    r = read_resp(fd);
    cr_assert_eq(r->id, 1);
    cr_assert_eq(r->version, want, "the %d fds came in order with their request", N);
    refit__rpc__response__free_unpacked(r, NULL);
    r = read_resp(fd);
    cr_assert_eq(r->id, 2);
    cr_assert_eq(r->version, 4242u, "the next request's fd is its own");
    refit__rpc__response__free_unpacked(r, NULL);
    close(fd);
}

/* The sender refuses what no daemon takes, before sending anything. */
Test(rpc, more_fds_than_a_request_may_bring_refused)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Seal seal = REFIT__RPC__SEAL__INIT;
    static int fds[RF_RPC_MAX_FDS + 1];
    rf_err err = {0};
    int sv[2];

    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    q.id = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_SEAL;
    q.seal = &seal;
    cr_assert_eq(rf_rpc_send_fds(sv[0], &q, fds, RF_RPC_MAX_FDS + 1, &err), -E2BIG);
    cr_assert(strstr(err.msg, "at most 1024"), "%s", err.msg);
    /* An empty request is its 4-byte length alone: room for 4 batches of fds, not for 5. */
    refit__rpc__request__init(&q);
    cr_assert_eq(rf_rpc_send_fds(sv[0], &q, fds, RF_RPC_MAX_FDS, &err), -EINVAL);
    cr_assert(strstr(err.msg, "cannot carry"), "%s", err.msg);
    close(sv[0]);
    close(sv[1]);
}

Test(rpc, client_that_stops_reading_is_cut)
{
    rf_err err = {0};
    int fd, rc, closes;
    char buf[65536];
    ssize_t n;
    size_t total = 0;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    fd = dial();
    send_status(fd, 1); /* 40 MiB of answers: more than RF_RPC_MAX_OUTPUT */
    for (int i = 0; i < 500; i++) {
        pthread_mutex_lock(&S.mu);
        closes = S.closes;
        rc = S.last_send_rc;
        pthread_mutex_unlock(&S.mu);
        if (closes)
            break;
        usleep(10000);
    }
    cr_assert_eq(rc, -ENOBUFS);
    cr_assert_eq(closes, 1, "the flooded client is closed");
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0)
        total += (size_t)n;
    cr_assert_eq(n, 0);
    cr_assert(total < 40u << 20);
    close(fd);
}

Test(rpc, stale_socket_replaced_live_one_refused)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    rf_rpc_server *second = NULL;
    rf_rpc_server_opts o = {0};
    rf_rpc_server_cb cb = {0};
    rf_err err = {0};
    char dir[160];
    int fd;

    /* A socket file nobody listens on, as a crashed daemon leaves it. */
    snprintf(dir, sizeof(dir), "%s/run", S.dir);
    mkdir(dir, 0755);
    snprintf(dir, sizeof(dir), "%s/run/refit", S.dir);
    mkdir(dir, 0755);
    cr_assert(strlen(S.path) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, S.path, strlen(S.path) + 1);
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(fd);
    cr_assert_eq(start(&S, NULL, &err), 0, "stale socket not replaced: %s", err.msg);
    fd = dial();
    ping(fd, 1);
    close(fd);
    o.path = S.path;
    cr_assert_eq(rf_rpc_server_open(&S.loop, &o, &cb, NULL, &second, &err), -EADDRINUSE);
    cr_assert(strstr(err.msg, "another process is serving on"), "%s", err.msg);
    cr_assert_null(second);
    fd = dial(); /* the first server still owns its socket */
    ping(fd, 2);
    close(fd);
}

Test(rpc, bad_paths_refused)
{
    rf_rpc_server *s = NULL;
    rf_rpc_server_opts o = {0};
    rf_rpc_server_cb cb = {0};
    rf_err err = {0};
    char longp[200], file[160];
    int fd;

    memset(longp, 'a', sizeof(longp) - 1);
    longp[0] = '/';
    longp[sizeof(longp) - 1] = '\0';
    o.path = longp;
    cr_assert_eq(rf_rpc_server_open(&S.loop, &o, &cb, NULL, &s, &err), -ENAMETOOLONG);
    cr_assert(strstr(err.msg, "shorter path"), "%s", err.msg);
    snprintf(file, sizeof(file), "%s/plain", S.dir);
    fd = open(file, O_CREAT | O_WRONLY, 0644);
    close(fd);
    o.path = file;
    cr_assert_eq(rf_rpc_server_open(&S.loop, &o, &cb, NULL, &s, &err), -EEXIST);
    cr_assert(strstr(err.msg, "is not a socket"), "%s", err.msg);
    cr_assert_eq(access(file, F_OK), 0, "a non-socket file must not be removed");
    snprintf(file, sizeof(file), "%s/plain/sub/t.sock", S.dir);
    o.path = file;
    cr_assert_eq(rf_rpc_server_open(&S.loop, &o, &cb, NULL, &s, &err), -ENOTDIR);
    cr_assert(strstr(err.msg, "goes through a file that is not a directory"), "%s", err.msg);
    cr_assert_null(s);

    /* --check-config asks the same question without opening anything. */
    cr_assert_eq(rf_rpc_path_check(longp, &err), -ENAMETOOLONG);
    cr_assert(strstr(err.msg, "Unix sockets allow at most 107"), "%s", err.msg);
    cr_assert_eq(rf_rpc_path_check("", &err), -EINVAL);
    cr_assert_eq(rf_rpc_path_check(file, &err), -ENOTDIR);
    snprintf(file, sizeof(file), "%s/plain", S.dir);
    cr_assert_eq(rf_rpc_path_check(file, &err), -EEXIST);
    snprintf(file, sizeof(file), "%s/not/yet/t.sock", S.dir);
    cr_assert_eq(rf_rpc_path_check(file, &err), 0, "%s", err.msg);
    snprintf(file, sizeof(file), "%s/not", S.dir);
    cr_assert_neq(access(file, F_OK), 0, "the check made a directory");
    snprintf(file, sizeof(file), "%s/loop", S.dir);
    cr_assert_eq(symlink("loop", file), 0);
    snprintf(file, sizeof(file), "%s/loop/t.sock", S.dir);
    cr_assert_eq(rf_rpc_path_check(file, &err), -ELOOP);
    cr_assert(strstr(err.msg, "cannot look at socket path"), "%s", err.msg);
}

Test(rpc, dial_errors_say_what_to_check)
{
    rf_err err = {0};
    int fd;

    cr_assert_eq(rf_rpc_dial(S.path, &fd, &err), -ENOENT);
    cr_assert(strstr(err.msg, "is the daemon running"), "%s", err.msg);
    cr_assert_eq(fd, -1);
}

/* Credentials: as root, a child that drops to nobody is refused (root always passes); as
 * another user, an allowed list without our uid refuses us. */
Test(rpc, peer_uid_not_allowed)
{
    uid_t other = 4242;
    rf_rpc_server_opts o = {0};
    rf_err err = {0};
    int fd, status;
    pid_t pid;

    o.allowed_uids = &other;
    o.n_allowed_uids = 1;
    cr_assert_eq(start(&S, &o, &err), 0, "%s", err.msg);
    if (geteuid() != 0) {
        fd = dial();
        expect_error_then_eof(fd, -EACCES, "is not allowed on");
        close(fd);
        return;
    }
    fd = dial();
    ping(fd, 1); /* root */
    close(fd);
    /* Only the test opens the socket to others, so the child can reach it at all. */
    chmod(S.dir, 0755);
    chmod(S.path, 0666);
    pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        Refit__Rpc__Response *r;

        if (setgid(65534) != 0 || setuid(65534) != 0)
            _exit(10);
        if (rf_rpc_dial(S.path, &fd, &err) < 0)
            _exit(11);
        r = read_resp(fd);
        if (r == NULL || r->code != -EACCES || !strstr(r->message, "uid 65534"))
            _exit(12);
        _exit(read_resp(fd) == NULL ? 0 : 13);
    }
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status));
    cr_assert_eq(WEXITSTATUS(status), 0, "child check %d failed", WEXITSTATUS(status));
    pthread_mutex_lock(&S.mu);
    cr_assert_eq(S.connects, 1, "the refused client never reached on_connect");
    pthread_mutex_unlock(&S.mu);
}

/* A string field with a NUL inside (protobuf-c would hand it over cut at the NUL: a format
 * "block\0garbage" read as "block") closes the connection naming the field, at any depth;
 * a NUL in a bytes field is data. Frames written by hand: id 5, then the body. */
static void expect_nul_refused(const uint8_t *body, size_t n, const char *field)
{
    uint8_t frame[128];
    Refit__Rpc__Response *r;
    uint32_t len = htonl((uint32_t)n);
    char want[64];
    int fd = dial();

    cr_assert_lt(n + 4, sizeof(frame));
    memcpy(frame, &len, 4);
    memcpy(frame + 4, body, n);
    cr_assert_eq(send(fd, frame, n + 4, 0), (ssize_t)(n + 4));
    r = read_resp(fd);
    cr_assert_not_null(r, "no answer");
    cr_assert_eq(r->id, 5);
    cr_assert_eq(r->code, -EINVAL, "code %d: %s", r->code, r->message);
    snprintf(want, sizeof(want), "string field '%s'", field);
    cr_assert(strstr(r->message, want), "'%s' lacks '%s'", r->message, want);
    refit__rpc__response__free_unpacked(r, NULL);
    cr_assert_null(read_resp(fd), "connection left open");
    close(fd);
}

Test(rpc, a_nul_inside_a_string_field_is_refused_by_name)
{
    /* RegisterPiece { tensor = "model.w\0x" } */
    static const uint8_t tensor[] = {0x08, 5, 0x22, 11, 0x0a, 9, 'm', 'o', 'd', 'e', 'l', '.',
                                     'w', 0, 'x'};
    /* RegisterPiece { tensor = "model.w", quant = "block\0garbage" } */
    static const uint8_t quant[] = {0x08, 5, 0x22, 24, 0x0a, 7, 'm', 'o', 'd', 'e', 'l', '.',
                                    'w', 0x4a, 13, 'b', 'l', 'o', 'c', 'k', 0, 'g', 'a', 'r',
                                    'b', 'a', 'g', 'e'};
    /* Hello { name = "a\0b" } */
    static const uint8_t hello[] = {0x08, 5, 0x12, 5, 0x12, 3, 'a', 0, 'b'};
    /* InstallerAttach { token = "\0\0" }: bytes, not a string */
    static const uint8_t token[] = {0x08, 6, 0x82, 0x01, 4, 0x0a, 2, 0, 0};
    uint8_t frame[sizeof(token) + 4];
    uint32_t len = htonl(sizeof(token));
    Refit__Rpc__Response *r;
    rf_err err = {0};
    int fd;

    cr_assert_eq(start(&S, NULL, &err), 0, "%s", err.msg);
    expect_nul_refused(tensor, sizeof(tensor), "tensor");
    expect_nul_refused(quant, sizeof(quant), "quant");
    expect_nul_refused(hello, sizeof(hello), "name");
    fd = dial();
    memcpy(frame, &len, 4);
    memcpy(frame + 4, token, sizeof(token));
    cr_assert_eq(send(fd, frame, sizeof(frame), 0), (ssize_t)sizeof(frame));
    r = read_resp(fd);
    cr_assert_not_null(r);
    cr_assert_eq(r->id, 6);
    cr_assert_eq(r->code, 0, "%s", r->message);
    cr_assert_eq(r->region, REFIT__RPC__REQUEST__BODY_INSTALLER_ATTACH);
    refit__rpc__response__free_unpacked(r, NULL);
    ping(fd, 7);
    close(fd);
}
