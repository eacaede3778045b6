/* common/data/xfer_tcp.c - the tcp transport: moves a job's messages between daemons' host memory
 * over TCP data sockets, on a worker thread that drives every peer connection with poll(). */
#include "xfer_tcp.h"
#include "xfer_core.h"

#include <arpa/inet.h>
#include <assert.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "addr.h"
#include "copy.h"
#include "qcopy.h"
#include "log.h"
#include "macros.h"

/* Wire format, little-endian; protocol 3. Handshake (HMAC-SHA256 under the cluster key K,
 * each use under its own NUL-terminated tag, so no proof stands for another):
 *   acceptor  -> connector: na, a fresh 32-byte nonce
 *   connector -> acceptor:  hello = {"RFXH", 3, from, to, nc (its own fresh nonce)}
 *                           || HMAC(K, "refit-data-v3 hello" || na || hello body)
 *   acceptor  -> connector: {"RFXA"} || HMAC(K, "refit-data-v3 accept" || na || hello body)
 * Both nonces make each side's proof worthless on any other connection, and binding both
 * indices keeps a hello from being turned around or aimed at another daemon. The connector
 * sends nothing but the hello until the acceptance proves the key: weights never go to an
 * impostor. Both ends then hold the connection's frame key
 *   Kc = HMAC(K, "refit-data-v3 frames" || na || hello body),
 * fresh on every connection (the acceptor's nonce) and never sent. Frames then flow from the
 * connector to the acceptor only: a header {"RFXF", seq, version, bytes} and its tag, then the
 * payload in segments of SEG_LEN bytes (the last one shorter), each followed by its tag. The
 * n-th tag of a connection (n = 0, 1, ... over headers and segments alike, kept between jobs
 * while the connection lives) is Poly1305 under a one-time key, the first 32 bytes of
 * ChaCha20(Kc, nonce = n): the counter binds every header and segment to its place in its
 * connection, so none can be altered, replayed, reordered, dropped from the middle or moved
 * to another connection. A header is checked before it is acted on and a segment before any
 * byte of it is installed: packed segments land in staging, which is scattered only after the
 * whole message passed; direct ones land in a per-connection bounce buffer and are copied
 * into client memory once they passed. Nothing is encrypted: an observer on the path reads
 * the weights. A connection that fails the hello is closed without touching the job or the
 * peer's authenticated connection; a frame that fails its tag fails the job (-EBADMSG).
 * The listener is served at all times: during a job by the job's worker, between jobs by an
 * idle thread of the transport's own, so that a connection is challenged when it arrives and
 * closed when its hello fails or does not come within HELLO_TIMEOUT_S, job or not. */
#define HELLO_MAGIC 0x48584652u /* "RFXH" */
#define ACK_MAGIC 0x41584652u   /* "RFXA" */
#define FRAME_MAGIC 0x46584652u /* "RFXF" */
#define PROTO_VERSION 3u        /* 2: the hello was authenticated; 3: both ends prove the key
                                   and every frame carries a tag */
#define NONCE_LEN RF_XFER_TCP__NONCE_LEN
#define MAC_LEN crypto_auth_hmacsha256_BYTES
#define HELLO_BODY RF_XFER_TCP__HELLO_BODY
#define HELLO_LEN RF_XFER_TCP__HELLO_LEN
#define ACK_LEN (4 + MAC_LEN)
#define HDR_LEN RF_XFER_TCP__HDR_LEN
_Static_assert(HELLO_LEN == HELLO_BODY + MAC_LEN, "xfer_tcp.h's hello size is this one");
#define TAG_LEN crypto_onetimeauth_BYTES
/* Poly1305 ran at ~5.3 GB/s on the dev VM from 4 KiB up, keyed BLAKE2b and HMAC-SHA512-256 at
 * ~0.8 (bench/RESULTS.md). A segment is checked while it is still in the cache it was received
 * into, and a direct one goes through a bounce buffer of this size: small enough for L2, large
 * enough that the 16-byte tag and the per-segment key cost nothing. */
#define SEG_LEN (256u << 10)
/* A peer answers the nonce at once; anything slower is not one of ours. */
#define HELLO_TIMEOUT_S 5.0
#define ADDR_MAX 300

enum { MSG_PENDING = 0, MSG_BUSY, MSG_DONE };

/* What the idle thread is asked to do. */
enum { IDLE_SERVE = 0, IDLE_PARK, IDLE_QUIT };

/* Where an outgoing connection is in its handshake; frames go out only once it is ready. */
enum { OUT_READY = 0, OUT_CONNECTING, OUT_NONCE, OUT_HELLO, OUT_ACK };

/* One data connection. Outgoing ones carry this daemon's sends to `peer`, incoming ones the
 * peer's sends to us; an accepted one waits among the pending until its hello proves which
 * peer it is. */
typedef struct conn {
    int fd;
    uint32_t peer;
    int stage;         /* outgoing: OUT_... */
    bool active;       /* incoming: delivered bytes of a frame in this job */
    uint8_t buf[HELLO_LEN]; /* outgoing: hello, or a header and its tag, to write; incoming:
                               hello, or a header and its tag, read */
    size_t buf_len, buf_done;
    uint8_t nonce[NONCE_LEN]; /* the acceptor's nonce: pending, the one we sent; outgoing, the
                                 one we answer */
    uint8_t ack[ACK_LEN];     /* outgoing: the acceptance read */
    uint8_t proof[MAC_LEN];   /* outgoing: the acceptance the acceptor must send */
    size_t hs_done;           /* outgoing: bytes of the nonce or of the acceptance read */
    double since;             /* pending: when it was accepted */
    bool hello_ok;            /* pending: a whole hello that proved the key between jobs,
                                 waiting for the next job's table (kept past the timeout) */
    char raddr[64];           /* pending: the remote address, for the log */
    uint8_t key[crypto_stream_chacha20_KEYBYTES]; /* the connection's frame key */
    uint64_t ctr;      /* tags of this connection so far: the next tag's counter */
    int64_t cur;       /* message in flight (index into the job), -1 when none */
    uint64_t done;     /* payload bytes of cur moved */
    uint64_t seg_start, seg_end; /* the segment of cur being moved, [start, end) */
    uint8_t tag[TAG_LEN];        /* its tag: outgoing, computed; incoming, read */
    size_t tag_done;             /* bytes of tag moved; outgoing: TAG_LEN once sent */
    uint8_t *payload;
    uint8_t *bounce;   /* incoming: SEG_LEN bytes where a direct segment waits for its check */
} conn;

typedef struct seq_ent {
    uint32_t seq, idx;
} seq_ent;

/* One item of a packed message reduced for the host copy: `count` runs of `run` bytes,
 * `stride` bytes apart in client memory, packed back to back in staging from `soff`; count 0
 * marks a shape with more than one strided dim (or 2^32 runs or more), copied through a
 * descriptor of item `idx`. */
typedef struct run_item {
    uint8_t *mem;
    uint64_t soff, run;
    int64_t stride;
    uint32_t count, idx;
} run_item;

/* State of one job, owned by the worker thread. */
typedef struct jstate {
    const rf_xfer_job *job;
    uint32_t npeers;
    uint32_t *send_first, *send_idx, *send_cur; /* per peer: its sends in job order */
    uint32_t *recv_open;  /* per peer: receives in admitted rounds not yet done */
    seq_ent *recv_seq;    /* receives sorted by seq */
    uint32_t nrecv;
    uint8_t *state;       /* per message: MSG_PENDING/BUSY/DONE */
    uint8_t **staging;    /* per message: its payload in staging (packed only) */
    uint32_t *round_first; /* nrounds + 1 */
    uint32_t *round_left;
    uint64_t *round_bytes;
    uint32_t lo, hi;       /* admitted rounds: [lo, hi), at most two */
    uint64_t arena_size;   /* staging this job uses */
    uint64_t staging_now;
    uint32_t left;         /* messages not done */
    rf_xfer_order order;   /* a relay's sends wait for its receives of earlier rounds */
} jstate;

typedef struct tcp {
    rf_xfer_core base;
    int lfd;
    char addr[ADDR_MAX];
    conn *out, *in; /* base.npeers each, indexed by peer */
    rf_addr *to;    /* base.npeers: where each peer listens, parsed by set_peers */
    /* The peer table hellos are checked against: base's self and npeers as set_peers last
     * took them. The core updates base's own after set_peers returns, while the idle thread
     * may already serve the listener again, so the handshake reads these. */
    uint32_t self, npeers;
    conn *pending;  /* accepted, hello not read yet */
    size_t npending, cap_pending;
    /* Between jobs the idle thread serves the listener and the pending connections (accept,
     * challenge, hello, expiry). It is the only one to touch them, the peer table and the
     * key while it serves: a job's worker parks it before its first step and lets it serve
     * again after the last; set_peers, set_key and release park it too. Started with the
     * first key (the hellos need one). */
    pthread_t idle_thread;
    pthread_mutex_t idle_mu;
    pthread_cond_t idle_cv;
    int idle_fd;     /* eventfd: wakes the idle thread's poll to look at idle_want */
    int idle_want;   /* IDLE_SERVE, IDLE_PARK, IDLE_QUIT; under idle_mu */
    bool idle_parked; /* under idle_mu: the idle thread touches nothing until idle_want changes */
    bool idle_started;
    /* A hello that failed authentication between jobs: the likely cause of a job's silence,
     * handed to base.note when the next job starts (base.note is the job's). */
    char idle_note[sizeof(((rf_xfer_core *)0)->note)];
    struct pollfd *idle_pfd;
    size_t idle_pcap;
    /* The cluster key the hellos are authenticated with (rf_xfer_tcp_set_key). */
    uint8_t *key;
    size_t key_len;
    /* Staging, kept between jobs so that a refit does not fault in fresh pages every round;
     * never larger than the budget. Even rounds sit at its start, odd ones at its end, so
     * that two open rounds never overlap. */
    uint8_t *arena;
    uint64_t arena_cap;
    /* The packed messages' items reduced to runs (worker thread), msg_first[i] .. [i + 1] for
     * message i, kept between jobs of the same plan_key: a refit then reads 40 bytes an item
     * rather than its ~380-byte geometry, and checks and reduces nothing (100k tiny tensors:
     * 38 MB of items walked on each side every refit, more than the bytes moved). */
    run_item *runs;
    uint32_t *msg_first;
    uint64_t runs_key;
    rf_copy_desc desc; /* the general case, one item at a time */
    /* Test hook, never set in production: REFIT_TEST_CORRUPT_RELAY=1 in the environment at
     * creation makes this transport a faulty relay, flipping the first byte of every packed
     * message it forwards (a job's sends that also receives) after gathering it and before
     * digesting it, so that only the end-to-end check can tell (tests/e2e/82). */
    bool corrupt_relays;
    /* The worker's poll set, kept between steps and jobs: what each entry is and for whom. */
    struct pollfd *pfd;
    uint32_t *pref;
    uint8_t *pkind;
    size_t pcap;
    jstate js;
} tcp;

/* A backend's failures are the core's: the first one is the job's. */
#define fail(t, ...) rf_xfer__fail(&(t)->base, __VA_ARGS__)

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;

    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;

    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static void conn_init(conn *c)
{
    memset(c, 0, sizeof(*c));
    c->fd = -1;
    c->cur = -1;
}

static void conn_close(conn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->bounce);
    sodium_memzero(c->key, sizeof(c->key));
    conn_init(c);
}

static void close_all_conns(tcp *t)
{
    for (uint32_t p = 0; p < t->base.npeers; p++) {
        conn_close(&t->out[p]);
        conn_close(&t->in[p]);
    }
    for (size_t i = 0; i < t->npending; i++)
        conn_close(&t->pending[i]);
    t->npending = 0;
}

/* ---- the worker: job state ---- */

static void js_free(jstate *s)
{
    free(s->send_first);
    free(s->send_idx);
    free(s->send_cur);
    free(s->recv_open);
    free(s->recv_seq);
    free(s->state);
    free(s->staging);
    free(s->round_first);
    free(s->round_left);
    free(s->round_bytes);
    rf_xfer__order_free(&s->order);
    memset(s, 0, sizeof(*s));
}

static int seq_cmp(const void *a, const void *b)
{
    const seq_ent *x = a, *y = b;

    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static int js_init(jstate *s, const rf_xfer_job *job, uint32_t npeers)
{
    uint32_t i, nr = job->nrounds, n = job->nmsgs;

    memset(s, 0, sizeof(*s));
    s->job = job;
    s->npeers = npeers;
    s->send_first = calloc(npeers + 1, sizeof(uint32_t));
    s->send_cur = calloc(npeers, sizeof(uint32_t));
    s->send_idx = calloc(n ? n : 1, sizeof(uint32_t));
    s->recv_open = calloc(npeers, sizeof(uint32_t));
    s->recv_seq = calloc(n ? n : 1, sizeof(seq_ent));
    s->state = calloc(n ? n : 1, 1);
    s->staging = calloc(n ? n : 1, sizeof(uint8_t *));
    s->round_first = calloc(nr + 1, sizeof(uint32_t));
    s->round_left = calloc(nr ? nr : 1, sizeof(uint32_t));
    s->round_bytes = calloc(nr ? nr : 1, sizeof(uint64_t));
    if (!s->send_first || !s->send_cur || !s->send_idx || !s->recv_open || !s->recv_seq ||
        !s->state || !s->staging || !s->round_first || !s->round_left || !s->round_bytes ||
        rf_xfer__order_init(&s->order, job) < 0)
        return -ENOMEM;
    for (i = 0; i < n; i++) {
        const rf_xfer_msg *m = &job->msgs[i];

        if (m->send)
            s->send_first[m->peer + 1]++;
        else
            s->recv_seq[s->nrecv++] = (seq_ent){m->seq, i};
        s->round_left[m->round]++;
        if (m->kind == RF_PLAN_PACKED)
            s->round_bytes[m->round] += m->bytes;
    }
    for (uint32_t p = 0; p < npeers; p++)
        s->send_first[p + 1] += s->send_first[p];
    for (i = 0; i < n; i++) {
        const rf_xfer_msg *m = &job->msgs[i];

        if (m->send)
            s->send_idx[s->send_first[m->peer] + s->send_cur[m->peer]++] = i;
    }
    memset(s->send_cur, 0, npeers * sizeof(uint32_t));
    qsort(s->recv_seq, s->nrecv, sizeof(seq_ent), seq_cmp);
    /* Messages are sorted by round, so each round is one range of them. */
    for (i = 0; i < n; i++)
        s->round_first[job->msgs[i].round + 1] = i + 1;
    for (uint32_t r = 1; r <= nr; r++)
        if (s->round_first[r] < s->round_first[r - 1])
            s->round_first[r] = s->round_first[r - 1];
    s->left = n;
    return 0;
}

static int find_recv(const jstate *s, uint32_t seq)
{
    size_t lo = 0, hi = s->nrecv;

    while (lo < hi) {
        size_t mid = (lo + hi) / 2;

        if (s->recv_seq[mid].seq < seq)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s->nrecv && s->recv_seq[lo].seq == seq ? (int)s->recv_seq[lo].idx : -1;
}

/* The first unfinished message, to name in a deadline or abort message. */
static void describe_outstanding(rf_xfer_core *base, char *buf, size_t len)
{
    tcp *t = (tcp *)base;
    const jstate *s = &t->js;
    const rf_xfer_job *job = s->job;

    snprintf(buf, len, "nothing");
    for (uint32_t i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];
        const conn *c;
        uint64_t moved = 0;

        if (s->state[i] == MSG_DONE)
            continue;
        c = m->send ? &t->out[m->peer] : &t->in[m->peer];
        if (c->cur == (int64_t)i)
            moved = c->done;
        snprintf(buf, len, "%u messages outstanding, first %s message seq %u (round %u) %s peer "
                 "%u (%s), %llu of %llu bytes moved", s->left, m->send ? "sending" : "receiving",
                 m->seq, m->round, m->send ? "to" : "from", m->peer,
                 rf_xfer__peer_addr(base, m->peer), (unsigned long long)moved,
                 (unsigned long long)m->bytes);
        return;
    }
}

/* ---- the worker: rounds and staging ---- */

/* Reduces every packed item of the job to runs, unless the table was built for this job's
 * plan_key already. */
static int runs_build(tcp *t)
{
    const rf_xfer_job *job = t->js.job;
    uint64_t total = 0;
    uint32_t i, k, n = 0;
    rf_err err;
    int rc;

    if (job->plan_key != 0 && job->plan_key == t->runs_key)
        return 0;
    free(t->runs);
    free(t->msg_first);
    t->runs_key = 0;
    for (i = 0; i < job->nmsgs; i++)
        if (job->msgs[i].kind == RF_PLAN_PACKED)
            total += job->msgs[i].nitems;
    t->runs = malloc((total ? total : 1) * sizeof(run_item));
    t->msg_first = malloc(((size_t)job->nmsgs + 1) * sizeof(uint32_t));
    if (!t->runs || !t->msg_first || total > UINT32_MAX)
        return fail(t, -ENOMEM, "out of memory reducing %llu packed items",
                    (unsigned long long)total);
    for (i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];

        t->msg_first[i] = n;
        if (m->kind != RF_PLAN_PACKED)
            continue;
        for (k = 0; k < m->nitems; k++) {
            const rf_xfer_item *it = &m->items[k];
            run_item *r = &t->runs[n++];
            rf_copy_flat f;

            if (it->quant.q.kind != 0) {
                /* FP8: quantized by the sender, installed with its scales (copy_items). */
                rf_err_clear(&err);
                if ((rc = rf_qcopy_check(it, !m->send, &err)) < 0)
                    return fail(t, rc, "message seq %u item %u: %s", m->seq, k, err.msg);
                *r = (run_item){.mem = it->base, .soff = it->msg_off, .count = 0, .idx = k};
                continue;
            }
            rf_copy_desc_set(&t->desc, it->base, &it->piece, it->ndim, it->esize, &it->box,
                             it->msg_off);
            rf_err_clear(&err);
            if ((rc = rf_copy_check(&t->desc, k, &err)) < 0)
                return fail(t, rc, "message seq %u: %s", m->seq, err.msg);
            rf_copy_flatten(&t->desc, &f);
            *r = (run_item){.mem = it->base + f.first, .soff = it->msg_off, .run = f.run,
                            .stride = f.inner_str, .count = 1, .idx = k};
            if (f.n > 0 || f.inner_ext > UINT32_MAX)
                r->count = 0;
            else if (f.inner_str != 0)
                r->count = (uint32_t)f.inner_ext;
        }
    }
    t->msg_first[job->nmsgs] = n;
    t->runs_key = job->plan_key;
    return 0;
}

/* Gathers packed message i's items into its staging, or scatters them from it. */
static void copy_items(tcp *t, uint32_t i, uint8_t *staging, bool gather)
{
    const rf_xfer_msg *m = &t->js.job->msgs[i];

    for (uint32_t e = t->msg_first[i]; e < t->msg_first[i + 1]; e++) {
        const run_item *r = &t->runs[e];
        uint8_t *mem = r->mem, *st = staging + r->soff;

        if (r->count == 0) {
            const rf_xfer_item *it = &m->items[r->idx];

            if (it->quant.q.kind != 0) {
                if (gather)
                    rf_qcopy_pack(it, staging + it->msg_off);
                else
                    rf_qcopy_unpack(it, staging + it->msg_off);
                continue;
            }
            rf_copy_desc_set(&t->desc, it->base, &it->piece, it->ndim, it->esize, &it->box,
                             it->msg_off);
            rf_copy_run(&t->desc, staging, gather);
            continue;
        }
        for (uint32_t c = 0; c < r->count; c++, mem += r->stride, st += r->run) {
            if (gather)
                memcpy(st, mem, r->run);
            else
                memcpy(mem, st, r->run);
        }
    }
}

/* Admits rounds while at most two are open and their packed payloads fit in the budget
 * together (one always fits: rf_xfer_job_check saw to it); retires finished rounds. */
static bool pair_fits(const jstate *s, uint32_t r)
{
    uint64_t b = s->job->staging_bytes;

    return r + 1 < s->job->nrounds &&
           (b == 0 || s->round_bytes[r] + s->round_bytes[r + 1] <= b);
}

/* The staging a job needs: the largest round, or two neighbours that are open together. */
static int arena_reserve(tcp *t)
{
    jstate *s = &t->js;
    uint64_t need = 0, b = s->job->staging_bytes;

    for (uint32_t r = 0; r < s->job->nrounds; r++) {
        uint64_t n = s->round_bytes[r] + (pair_fits(s, r) ? s->round_bytes[r + 1] : 0);

        if (n > need)
            need = n;
    }
    s->arena_size = need;
    if (t->arena_cap >= need && (b == 0 || t->arena_cap <= b))
        return 0;
    free(t->arena);
    t->arena = NULL;
    t->arena_cap = 0;
    if (need == 0)
        return 0;
    t->arena = malloc(need);
    if (!t->arena)
        return fail(t, -ENOMEM, "out of memory for %llu bytes of staging; lower the staging "
                    "budget", (unsigned long long)need);
    t->arena_cap = need;
    return 0;
}

static int window_update(tcp *t)
{
    jstate *s = &t->js;
    const rf_xfer_job *job = s->job;

    for (;;) {
        bool changed = false;

        while (s->lo < s->hi && s->round_left[s->lo] == 0) {
            s->staging_now -= s->round_bytes[s->lo];
            s->lo++;
            changed = true;
        }
        while (s->hi < job->nrounds && s->hi < s->lo + 2 &&
               (s->hi == s->lo || job->staging_bytes == 0 ||
                s->staging_now + s->round_bytes[s->hi] <= job->staging_bytes)) {
            uint32_t r = s->hi;
            uint64_t off = r & 1 ? s->arena_size - s->round_bytes[r] : 0;

            s->staging_now += s->round_bytes[r];
            rf_xfer__staging(&t->base, s->staging_now);
            for (uint32_t i = s->round_first[r]; i < s->round_first[r + 1]; i++) {
                const rf_xfer_msg *m = &job->msgs[i];

                if (m->kind == RF_PLAN_PACKED) {
                    s->staging[i] = t->arena + off;
                    off += m->bytes;
                }
                if (!m->send)
                    s->recv_open[m->peer]++;
            }
            s->hi++;
            changed = true;
        }
        /* At most two rounds open, and two only when they fit in the budget together. */
        assert(s->lo <= s->hi && s->hi - s->lo <= 2);
        assert(s->hi - s->lo < 2 || job->staging_bytes == 0 ||
               s->staging_now <= job->staging_bytes);
        if (!changed)
            return 0;
    }
}

static int msg_done(tcp *t, uint32_t i)
{
    jstate *s = &t->js;
    const rf_xfer_msg *m = &s->job->msgs[i];

    /* A message moves once, and only while its round is admitted. */
    assert(s->state[i] == MSG_BUSY && s->left > 0 && s->round_left[m->round] > 0);
    assert(m->round >= s->lo && m->round < s->hi && (m->send || s->recv_open[m->peer] > 0));
    s->state[i] = MSG_DONE;
    s->round_left[m->round]--;
    s->left--;
    if (!m->send) {
        s->recv_open[m->peer]--;
        rf_xfer__order_recv_done(&s->order, m->round);
    }
    return window_update(t);
}

/* ---- the worker: connections ---- */

/* The handshake's proofs and the frame key: HMAC-SHA256(key, tag || acceptor's nonce || hello
 * body), the body as it stands on the wire (magic, protocol, from, to, connector's nonce). The
 * tags end with their NUL, so that none is a prefix of another. */
static const char HS_HELLO[] = "refit-data-v3 hello";
static const char HS_ACCEPT[] = "refit-data-v3 accept";
static const char HS_FRAMES[] = "refit-data-v3 frames";

static void hs_mac_key(const uint8_t *key, size_t key_len, const char *tag, size_t tag_len,
                       const uint8_t *nonce, const uint8_t *body, uint8_t *out)
{
    crypto_auth_hmacsha256_state st;

    crypto_auth_hmacsha256_init(&st, key, key_len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)tag, tag_len);
    crypto_auth_hmacsha256_update(&st, nonce, NONCE_LEN);
    crypto_auth_hmacsha256_update(&st, body, HELLO_BODY);
    crypto_auth_hmacsha256_final(&st, out);
    sodium_memzero(&st, sizeof(st));
}

static void hs_mac(const tcp *t, const char *tag, size_t tag_len, const uint8_t *nonce,
                   const uint8_t *body, uint8_t *out)
{
    hs_mac_key(t->key, t->key_len, tag, tag_len, nonce, body, out);
}

/* The tag of the connection's next header or segment: Poly1305 under the one-time key that
 * ChaCha20 makes from the frame key and the counter, as ChaCha20-Poly1305 makes its key (RFC
 * 8439, 2.6; here the original ChaCha20 with its 64-bit nonce, the counter). */
static void frame_tag(conn *c, const uint8_t *p, size_t len, uint8_t out[TAG_LEN])
{
    uint8_t otk[crypto_onetimeauth_KEYBYTES], n[crypto_stream_chacha20_NONCEBYTES];

    put64(n, c->ctr++);
    crypto_stream_chacha20(otk, sizeof(otk), n, c->key);
    crypto_onetimeauth(out, p, len, otk);
    sodium_memzero(otk, sizeof(otk));
}

/* Whether tag is the connection's next one over p (constant time); counts it either way. */
static bool frame_tag_ok(conn *c, const uint8_t *p, size_t len, const uint8_t tag[TAG_LEN])
{
    uint8_t want[TAG_LEN];
    bool ok;

    frame_tag(c, p, len, want);
    ok = crypto_verify_16(want, tag) == 0;
    sodium_memzero(want, sizeof(want));
    return ok;
}

static int start_connect(tcp *t, uint32_t p, uint32_t seq)
{
    conn *c = &t->out[p];
    struct addrinfo *ai = NULL;
    int fd = -1, one = 1, rc;
    rf_err err = {0};

    if (rf_addr_resolve(&t->to[p], RF_ADDR_CONNECT, &ai, &err) < 0)
        return fail(t, -EHOSTUNREACH, "resolving peer %u (%s) for message seq %u: %s", p,
                    t->base.addrs[p], seq, err.msg);
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = fail(t, -errno, "socket for peer %u (%s): %s", p, t->base.addrs[p], strerror(errno));
        goto out;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS) {
        rc = fail(t, -errno, "connect to peer %u (%s) for message seq %u: %s", p, t->base.addrs[p],
                  seq, strerror(errno));
        goto out;
    }
    conn_init(c);
    c->fd = fd;
    c->peer = p;
    c->stage = OUT_CONNECTING;
    fd = -1;
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    if (ai)
        freeaddrinfo(ai);
    return rc;
}

/* A kept outgoing connection is dead when the peer closed it (its job failed): we never
 * receive on it, so anything readable is EOF, a reset, or junk. */
static bool conn_alive(const conn *c)
{
    uint8_t b;
    ssize_t n = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);

    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

static int prepare_send(tcp *t, conn *c, uint32_t i)
{
    jstate *s = &t->js;
    const rf_xfer_msg *m = &s->job->msgs[i];
    uint8_t *h;

    assert(s->state[i] == MSG_PENDING && c->cur < 0);
    if (m->kind == RF_PLAN_PACKED) {
        copy_items(t, i, s->staging[i], true);
        c->payload = s->staging[i];
        if (t->corrupt_relays && s->order.gated && m->bytes > 0)
            c->payload[0] ^= 0xff;
    } else {
        c->payload = rf_xfer_direct_ptr(m);
    }
    rf_xfer__digest_msg(&t->base, m, c->payload);
    h = c->buf + c->buf_len;
    put32(h, FRAME_MAGIC);
    put32(h + 4, m->seq);
    put64(h + 8, s->job->version);
    put64(h + 16, m->bytes);
    frame_tag(c, h, HDR_LEN, h + HDR_LEN);
    c->buf_len += HDR_LEN + TAG_LEN;
    c->cur = i;
    c->done = c->seg_start = c->seg_end = 0;
    c->tag_done = TAG_LEN;
    s->state[i] = MSG_BUSY;
    return 0;
}

/* The next message for this connection when its round is open and, for a relay, the
 * receives of the rounds before it are in: it reads the memory they wrote. */
static int64_t next_send(const jstate *s, uint32_t p)
{
    uint32_t k = s->send_first[p] + s->send_cur[p], r;

    if (k >= s->send_first[p + 1])
        return -1;
    r = s->job->msgs[s->send_idx[k]].round;
    if (r >= s->hi || !rf_xfer__order_send_ok(&s->order, r))
        return -1;
    return s->send_idx[k];
}

static bool send_wanted(const tcp *t, const conn *c)
{
    return c->stage != OUT_READY || c->buf_done < c->buf_len || c->cur >= 0 ||
           next_send(&t->js, c->peer) >= 0;
}

/* The first message still to send to p, to name when its connection fails. */
static uint32_t waiting_seq(const tcp *t, uint32_t p)
{
    int64_t nx = next_send(&t->js, p);

    return nx >= 0 ? t->js.job->msgs[nx].seq : 0;
}

/* Reads the acceptor's nonce (then builds our hello) or, once the hello went out, its
 * acceptance, which must prove the key before any frame goes out. Returns 1 when the step is
 * complete, 0 when more bytes are to come, or the job's error. */
static int out_handshake_read(tcp *t, conn *c)
{
    uint32_t p = c->peer;
    bool nonce = c->stage == OUT_NONCE;
    size_t want = nonce ? NONCE_LEN : ACK_LEN;
    uint8_t *dst = nonce ? c->nonce : c->ack;
    ssize_t n = recv(c->fd, dst + c->hs_done, want - c->hs_done, MSG_DONTWAIT);

    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    if (n <= 0) {
        int e = n < 0 ? errno : 0;
        const char *why = e ? strerror(e) : "connection closed";

        if (nonce)
            return fail(t, e ? -e : -ECONNRESET, "peer %u (%s) sent no challenge on "
                        "its data port (%s) with message seq %u waiting; is it a refit daemon "
                        "speaking data protocol %u?", p, t->base.addrs[p], why, waiting_seq(t, p),
                        PROTO_VERSION);
        return fail(t, -EACCES, "peer %u (%s) did not accept our data connection's hello (%s) "
                    "with message seq %u waiting: it holds a different cluster key (give every "
                    "daemon the same cluster_key_file), runs an older release (data protocol "
                    "below %u), or its own job failed (see its log)", p, t->base.addrs[p], why,
                    waiting_seq(t, p), PROTO_VERSION);
    }
    c->hs_done += (size_t)n;
    /* Something that is no acceptance is named as soon as its magic is in. */
    if (!nonce && c->hs_done >= 4 && get32(c->ack) != ACK_MAGIC)
        return fail(t, -EPROTO, "peer %u (%s) answered our data connection's hello with "
                    "0x%08x, not an acceptance, with message seq %u waiting; is it a refit "
                    "daemon speaking data protocol %u?", p, t->base.addrs[p], get32(c->ack),
                    waiting_seq(t, p), PROTO_VERSION);
    if (c->hs_done < want)
        return 0;
    c->hs_done = 0;
    if (nonce) {
        put32(c->buf, HELLO_MAGIC);
        put32(c->buf + 4, PROTO_VERSION);
        put32(c->buf + 8, t->base.self);
        put32(c->buf + 12, p);
        randombytes_buf(c->buf + 16, NONCE_LEN);
        hs_mac(t, HS_HELLO, sizeof(HS_HELLO), c->nonce, c->buf, c->buf + HELLO_BODY);
        hs_mac(t, HS_ACCEPT, sizeof(HS_ACCEPT), c->nonce, c->buf, c->proof);
        hs_mac(t, HS_FRAMES, sizeof(HS_FRAMES), c->nonce, c->buf, c->key);
        c->buf_len = HELLO_LEN;
        c->buf_done = 0;
        c->stage = OUT_HELLO;
        return 1;
    }
    if (crypto_verify_32(c->ack + 4, c->proof) != 0)
        return fail(t, -EACCES, "peer %u (%s) accepted our data connection without proving the "
                    "cluster key, with message seq %u waiting; nothing was sent to it. It holds "
                    "a different cluster key (give every daemon the same cluster_key_file), or "
                    "something else answers on that address", p, t->base.addrs[p],
                    waiting_seq(t, p));
    c->ctr = 0;
    c->stage = OUT_READY;
    return 1;
}

static int send_progress(tcp *t, conn *c)
{
    jstate *s = &t->js;
    uint32_t p = c->peer;

    if (c->stage == OUT_CONNECTING) {
        int soerr = 0;
        socklen_t len = sizeof(soerr);

        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &len) < 0)
            soerr = errno;
        if (soerr == EINPROGRESS || soerr == EALREADY)
            return 0;
        if (soerr != 0)
            return fail(t, -soerr, "connect to peer %u (%s) for message seq %u: %s; is its "
                        "daemon up?", p, t->base.addrs[p], waiting_seq(t, p), strerror(soerr));
        c->stage = OUT_NONCE;
    }
    if (c->stage == OUT_NONCE || c->stage == OUT_ACK) {
        int rc = out_handshake_read(t, c);

        if (rc <= 0)
            return rc;
    }
    for (;;) {
        struct iovec iov[3];
        struct msghdr mh;
        int niov = 0;
        ssize_t n;
        size_t k;
        int64_t nx;
        int rc;

        if (c->cur < 0) {
            nx = c->stage == OUT_READY ? next_send(s, p) : -1;
            if (nx < 0 && c->buf_done == c->buf_len)
                return 0;
            if (nx >= 0) {
                s->send_cur[p]++;
                if ((rc = prepare_send(t, c, (uint32_t)nx)) < 0)
                    return rc;
            }
        }
        if (c->buf_done < c->buf_len) {
            iov[niov].iov_base = c->buf + c->buf_done;
            iov[niov++].iov_len = c->buf_len - c->buf_done;
        }
        if (c->cur >= 0) {
            uint64_t bytes = s->job->msgs[c->cur].bytes;

            /* The next segment is tagged as it goes out, while it is in the cache. */
            if (c->done == c->seg_end && c->tag_done == TAG_LEN && c->done < bytes) {
                c->seg_start = c->done;
                c->seg_end = c->done + (bytes - c->done < SEG_LEN ? bytes - c->done : SEG_LEN);
                frame_tag(c, c->payload + c->seg_start, c->seg_end - c->seg_start, c->tag);
                c->tag_done = 0;
            }
            if (c->done < c->seg_end) {
                iov[niov].iov_base = c->payload + c->done;
                iov[niov++].iov_len = c->seg_end - c->done;
            }
            if (c->tag_done < TAG_LEN) {
                iov[niov].iov_base = c->tag + c->tag_done;
                iov[niov++].iov_len = TAG_LEN - c->tag_done;
            }
        }
        if (niov > 0) {
            memset(&mh, 0, sizeof(mh));
            mh.msg_iov = iov;
            mh.msg_iovlen = (size_t)niov;
            n = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                    return 0;
                if (c->cur >= 0) {
                    const rf_xfer_msg *m = &s->job->msgs[c->cur];

                    return fail(t, -errno, "sending message seq %u (round %u) to peer %u (%s): "
                                "%s after %llu of %llu bytes", m->seq, m->round, p,
                                t->base.addrs[p], strerror(errno), (unsigned long long)c->done,
                                (unsigned long long)m->bytes);
                }
                return fail(t, -errno, "sending to peer %u (%s): %s", p, t->base.addrs[p],
                            strerror(errno));
            }
            /* What went out, in iov order: header (or hello), payload, tag. */
            k = (size_t)n < c->buf_len - c->buf_done ? (size_t)n : c->buf_len - c->buf_done;
            c->buf_done += k;
            n -= (ssize_t)k;
            if (c->cur >= 0) {
                k = (size_t)n < c->seg_end - c->done ? (size_t)n : c->seg_end - c->done;
                c->done += k;
                n -= (ssize_t)k;
                c->tag_done += (size_t)n;
            }
        }
        if (c->buf_done == c->buf_len) {
            c->buf_len = c->buf_done = 0;
            /* The hello is out: frames wait for the acceptance. */
            if (c->stage == OUT_HELLO) {
                c->stage = OUT_ACK;
                return 0;
            }
            if (c->cur >= 0 && c->done == s->job->msgs[c->cur].bytes && c->tag_done == TAG_LEN) {
                uint32_t i = (uint32_t)c->cur;

                rf_xfer__moved(&t->base, &s->job->msgs[i]);
                c->cur = -1;
                if ((rc = msg_done(t, i)) < 0)
                    return rc;
            }
        }
    }
}

static bool recv_wanted(const tcp *t, const conn *c)
{
    return c->cur >= 0 || c->buf_done > 0 || t->js.recv_open[c->peer] > 0;
}

/* The first message still expected from p, to name when its connection breaks. */
static uint32_t expected_seq(const tcp *t, uint32_t p)
{
    const rf_xfer_job *job = t->js.job;

    for (uint32_t i = 0; i < job->nmsgs; i++)
        if (!job->msgs[i].send && job->msgs[i].peer == p && t->js.state[i] != MSG_DONE)
            return job->msgs[i].seq;
    return 0;
}

static int parse_header(tcp *t, conn *c)
{
    jstate *s = &t->js;
    uint32_t p = c->peer, magic = get32(c->buf), seq = get32(c->buf + 4);
    uint64_t version = get64(c->buf + 8), bytes = get64(c->buf + 16);
    const rf_xfer_msg *m;
    int i;

    if (magic != FRAME_MAGIC)
        return fail(t, -EPROTO, "bad frame header from peer %u (%s): magic 0x%08x, expected "
                    "message seq %u; the stream is corrupt", p, t->base.addrs[p], magic,
                    expected_seq(t, p));
    if (version != s->job->version)
        return fail(t, -ESTALE, "frame for message seq %u from peer %u (%s) carries version "
                    "%llu, this job is version %llu; data of another refit is never installed",
                    seq, p, t->base.addrs[p], (unsigned long long)version,
                    (unsigned long long)s->job->version);
    i = find_recv(s, seq);
    if (i < 0 || s->job->msgs[i].peer != p)
        return fail(t, -EPROTO, "peer %u (%s) sent message seq %u, which this daemon does not "
                    "expect from it; the plans differ", p, t->base.addrs[p], seq);
    m = &s->job->msgs[i];
    if (s->state[i] != MSG_PENDING)
        return fail(t, -EPROTO, "peer %u (%s) sent message seq %u twice", p, t->base.addrs[p], seq);
    if (m->round >= s->hi)
        return fail(t, -EPROTO, "peer %u (%s) sent message seq %u of round %u before round %u "
                    "was done; it sends out of round order", p, t->base.addrs[p], seq, m->round,
                    s->lo);
    if (bytes != m->bytes)
        return fail(t, -EPROTO, "peer %u (%s) sent message seq %u with %llu bytes, the plan "
                    "says %llu; the plans differ", p, t->base.addrs[p], seq,
                    (unsigned long long)bytes, (unsigned long long)m->bytes);
    if (m->kind != RF_PLAN_PACKED && bytes > 0 && !c->bounce && !(c->bounce = malloc(SEG_LEN)))
        return fail(t, -ENOMEM, "out of memory for the %u-byte receive buffer of peer %u (%s)",
                    SEG_LEN, p, t->base.addrs[p]);
    c->cur = i;
    c->done = c->seg_start = c->seg_end = 0;
    c->tag_done = 0;
    c->payload = m->kind == RF_PLAN_PACKED ? s->staging[i] : rf_xfer_direct_ptr(m);
    s->state[i] = MSG_BUSY;
    return 0;
}

/* The segment [seg_start, seg_end) of the message in flight and its tag are in: installs it
 * (a direct one from the bounce buffer; a packed one stays in staging until the message is
 * whole) only if the tag is the connection's next one over its bytes. */
static int segment_done(tcp *t, conn *c)
{
    const rf_xfer_msg *m = &t->js.job->msgs[c->cur];
    uint32_t p = c->peer;
    bool direct = m->kind != RF_PLAN_PACKED;
    const uint8_t *src = direct ? c->bounce : c->payload + c->seg_start;
    size_t len = c->seg_end - c->seg_start;

    if (!frame_tag_ok(c, src, len, c->tag))
        return fail(t, -EBADMSG, "bytes %llu..%llu of message seq %u (round %u) from peer %u "
                    "(%s) fail authentication: altered on the way, replayed, or not from this "
                    "connection. Nothing of them was installed and this version will not "
                    "commit; if it recurs, look for a faulty NIC or an attacker on the path",
                    (unsigned long long)c->seg_start, (unsigned long long)c->seg_end, m->seq,
                    m->round, p, t->base.addrs[p]);
    if (direct)
        memcpy(c->payload + c->seg_start, c->bounce, len);
    c->seg_start = c->seg_end;
    c->tag_done = 0;
    return 0;
}

static int finish_recv(tcp *t, conn *c)
{
    jstate *s = &t->js;
    uint32_t i = (uint32_t)c->cur;
    const rf_xfer_msg *m = &s->job->msgs[i];

    rf_xfer__digest_msg(&t->base, m, c->payload);
    if (m->kind == RF_PLAN_PACKED)
        copy_items(t, i, s->staging[i], false);
    rf_xfer__moved(&t->base, m);
    c->cur = -1;
    return msg_done(t, i);
}

/* An incoming connection broke. One that brought nothing in this job is a leftover of an
 * earlier one (its peer failed and will reconnect): drop it quietly. */
static int recv_broken(tcp *t, conn *c, int e)
{
    uint32_t p = c->peer;
    const char *why = e ? strerror(e) : "connection closed by the peer";

    if (!c->active && c->cur < 0 && c->buf_done == 0) {
        conn_close(c);
        return 0;
    }
    if (c->cur >= 0) {
        const rf_xfer_msg *m = &t->js.job->msgs[c->cur];

        return fail(t, e ? -e : -ECONNRESET, "receiving message seq %u (round %u) from peer %u "
                    "(%s): %s after %llu of %llu bytes", m->seq, m->round, p, t->base.addrs[p], why,
                    (unsigned long long)c->done, (unsigned long long)m->bytes);
    }
    return fail(t, e ? -e : -ECONNRESET, "receiving from peer %u (%s), message seq %u expected: "
                "%s%s", p, t->base.addrs[p], expected_seq(t, p), why,
                c->buf_done ? " inside a frame header" : "");
}

static int recv_progress(tcp *t, conn *c)
{
    jstate *s = &t->js;

    for (;;) {
        uint8_t *dst;
        size_t want;
        ssize_t n;
        bool tag = false;
        int rc;

        if (c->cur >= 0) {
            const rf_xfer_msg *m = &s->job->msgs[c->cur];

            if (c->done == c->seg_end && c->seg_end > c->seg_start) {
                if (c->tag_done == TAG_LEN) {
                    if ((rc = segment_done(t, c)) < 0)
                        return rc;
                    continue;
                }
                tag = true;
                dst = c->tag + c->tag_done;
                want = TAG_LEN - c->tag_done;
            } else {
                if (c->done == m->bytes) {
                    if ((rc = finish_recv(t, c)) < 0)
                        return rc;
                    continue;
                }
                if (c->done == c->seg_end)
                    c->seg_end = c->done + (m->bytes - c->done < SEG_LEN ? m->bytes - c->done
                                                                          : SEG_LEN);
                dst = m->kind == RF_PLAN_PACKED ? c->payload + c->done
                                                : c->bounce + (c->done - c->seg_start);
                want = c->seg_end - c->done;
            }
        } else {
            if (c->buf_done == 0 && s->recv_open[c->peer] == 0)
                return 0;
            dst = c->buf + c->buf_done;
            want = HDR_LEN + TAG_LEN - c->buf_done;
        }
        n = recv(c->fd, dst, want, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return 0;
            return recv_broken(t, c, errno);
        }
        if (n == 0)
            return recv_broken(t, c, 0);
        c->active = true;
        if (tag) {
            c->tag_done += (size_t)n;
        } else if (c->cur >= 0) {
            c->done += (uint64_t)n;
        } else {
            c->buf_done += (size_t)n;
            if (c->buf_done == HDR_LEN + TAG_LEN) {
                c->buf_done = 0;
                if (!frame_tag_ok(c, c->buf, HDR_LEN, c->buf + HDR_LEN))
                    return fail(t, -EBADMSG, "a frame header from peer %u (%s), message seq "
                                "%u expected, fails authentication: altered on the way, "
                                "replayed, or not from this connection. Nothing of it was "
                                "installed and this version will not commit; if it recurs, "
                                "look for a faulty NIC or an attacker on the path", c->peer,
                                t->base.addrs[c->peer], expected_seq(t, c->peer));
                if ((rc = parse_header(t, c)) < 0)
                    return rc;
            }
        }
    }
}

/* Writes a few handshake bytes at once: a fresh socket has room for them, so not taking them
 * all means the connection is already broken. Returns 0 or a negative errno. */
static int send_now(int fd, const void *buf, size_t len)
{
    ssize_t n = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);

    if (n < 0)
        return -errno;
    return (size_t)n == len ? 0 : -EAGAIN;
}

static void drop_pending(conn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void drop_pending(conn *c, const char *fmt, ...)
{
    char why[256];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    RF_WARN("dropped the data connection from %s: %s", c->raddr, why);
    conn_close(c);
}

/* Magic and protocol, the first 8 bytes of a hello. */
static bool hello_head_ok(const uint8_t *buf)
{
    return get32(buf) == HELLO_MAGIC && get32(buf + 4) == PROTO_VERSION;
}

int rf_xfer_tcp__hello_check(const uint8_t *key, size_t key_len, uint32_t self,
                             uint32_t npeers, const uint8_t nonce[RF_XFER_TCP__NONCE_LEN],
                             const uint8_t hello[RF_XFER_TCP__HELLO_LEN], uint32_t *from)
{
    uint8_t mac[MAC_LEN];
    int ok;

    *from = get32(hello + 8);
    if (!hello_head_ok(hello))
        return -EPROTO;
    if (*from >= npeers || get32(hello + 12) != self)
        return -ENXIO;
    hs_mac_key(key, key_len, HS_HELLO, sizeof(HS_HELLO), nonce, hello, mac);
    ok = crypto_verify_32(mac, hello + HELLO_BODY) == 0;
    sodium_memzero(mac, sizeof(mac));
    return ok ? 0 : -EACCES;
}

/* Where peer p listens, as set_peers parsed it (the idle thread does not read base.addrs,
 * which the core replaces after set_peers). */
static const char *peer_name(const tcp *t, uint32_t p, char *buf, size_t len)
{
    const rf_addr *a = &t->to[p];

    snprintf(buf, len, strchr(a->host, ':') ? "[%s]:%s" : "%s:%s", a->host, a->port);
    return buf;
}

static int hello_decide(tcp *t, size_t k);

/* Reads the hello of an accepted connection, in a job or between jobs (t->js.job NULL).
 * Only a hello that proves the key makes the connection the incoming one of its peer,
 * replacing an older one (which the peer abandoned when it reconnected); anything else is
 * dropped and logged, and neither the job nor the peer's connection notices. */
static int hello_progress(tcp *t, size_t k)
{
    conn *c = &t->pending[k];
    ssize_t n;

    /* A whole hello waiting for the next job's table reads nothing more; the peer may have
     * sent its first frames behind it, which the job reads. Only a close or reset ends it. */
    if (c->buf_done == HELLO_LEN) {
        uint8_t b;

        n = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            drop_pending(c, "it closed while its hello waited for this daemon's plan");
        return 0;
    }
    n = recv(c->fd, c->buf + c->buf_done, HELLO_LEN - c->buf_done, MSG_DONTWAIT);

    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    if (n <= 0) {
        /* A connection closed before it said anything (a port check) goes unlogged. */
        if (c->buf_done > 0)
            drop_pending(c, "it closed after %zu of the %d bytes of its hello", c->buf_done,
                         HELLO_LEN);
        else if (n < 0)
            drop_pending(c, "it was reset before it sent its hello: %s", strerror(errno));
        else
            conn_close(c);
        return 0;
    }
    c->buf_done += (size_t)n;
    /* Magic and protocol come first: an old or foreign client is told off at once rather
     * than left to the hello timeout. */
    if (c->buf_done >= 8 && !hello_head_ok(c->buf)) {
        drop_pending(c, "not a refit data hello of protocol %u (magic 0x%08x, protocol %u); a "
                     "daemon of an older release, or not a refit daemon", PROTO_VERSION,
                     get32(c->buf), get32(c->buf + 4));
        return 0;
    }
    if (c->buf_done < HELLO_LEN)
        return 0;
    return hello_decide(t, k);
}

/* The whole hello of pending connection k, judged against the peer table. Between jobs a hello
 * is only refused when it fails the key; otherwise it waits, whole and unanswered, for the next
 * job: a sender's job may start (and connect) before this daemon has installed the plan that
 * names it, whose table may number the peers otherwise, and tcp_start judges it with that. */
static int hello_decide(tcp *t, size_t k)
{
    conn *c = &t->pending[k];
    bool idle = t->js.job == NULL;
    uint8_t ack[ACK_LEN];
    char pname[ADDR_MAX];
    uint32_t from;
    int rc;

    rc = rf_xfer_tcp__hello_check(t->key, t->key_len, t->self, t->npeers, c->nonce, c->buf,
                                  &from);
    /* Its magic and protocol passed in hello_progress. */
    assert(rc != -EPROTO);
    if (idle && (rc == 0 || rc == -ENXIO)) {
        c->hello_ok = rc == 0;
        return 0;
    }
    if (rc == -ENXIO) {
        drop_pending(c, "its hello is from peer %u to peer %u, this daemon is peer %u of %u",
                     from, get32(c->buf + 12), t->self, t->npeers);
        return 0;
    }
    if (rc < 0) {
        char *note = idle ? t->idle_note : t->base.note;

        snprintf(note, sizeof(t->base.note), "a data connection from %s claiming to be peer %u "
                 "failed authentication: cluster keys differ?", c->raddr, from);
        drop_pending(c, "its hello claims to be peer %u (%s) but fails authentication: the "
                     "peer holds another cluster key, or the hello is forged or replayed",
                     from, peer_name(t, from, pname, sizeof(pname)));
        return 0;
    }
    /* Between jobs every incoming connection is between messages (a job ends with all its
     * messages in, a failed one closes them all). */
    assert(!idle || (t->in[from].cur < 0 && t->in[from].buf_done == 0));
    if (t->in[from].cur >= 0 || t->in[from].buf_done > 0) {
        const rf_xfer_msg *m = t->in[from].cur >= 0 ? &t->js.job->msgs[t->in[from].cur] : NULL;

        conn_close(c);
        return fail(t, -ECONNRESET, "peer %u (%s) reconnected in the middle of message seq %u; "
                    "it restarted or failed", from, peer_name(t, from, pname, sizeof(pname)),
                    m ? m->seq : expected_seq(t, from));
    }
    /* The acceptance proves the key in turn: the connector sends nothing to an impostor. */
    put32(ack, ACK_MAGIC);
    hs_mac(t, HS_ACCEPT, sizeof(HS_ACCEPT), c->nonce, c->buf, ack + 4);
    if ((rc = send_now(c->fd, ack, sizeof(ack))) < 0) {
        drop_pending(c, "sending the acceptance to peer %u failed: %s", from, strerror(-rc));
        return 0;
    }
    hs_mac(t, HS_FRAMES, sizeof(HS_FRAMES), c->nonce, c->buf, c->key);
    c->ctr = 0;
    conn_close(&t->in[from]);
    t->in[from] = *c;
    t->in[from].peer = from;
    t->in[from].buf_done = 0;
    conn_init(c);
    return 0;
}

/* The remote address of an accepted socket, for the log. */
static void name_remote(const struct sockaddr_storage *ss, socklen_t sl, char *out, size_t len)
{
    char h[INET6_ADDRSTRLEN], sv[8];

    if (getnameinfo((const struct sockaddr *)ss, sl, h, sizeof(h), sv, sizeof(sv),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
        snprintf(out, len, "an unknown address");
    else
        snprintf(out, len, ss->ss_family == AF_INET6 ? "[%s]:%s" : "%s:%s", h, sv);
}

/* Accepts what waits on the listener and sends each connection its nonce. */
static void accept_all(tcp *t)
{
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        int fd = accept4(t->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        int one = 1, rc;
        conn *c;

        if (fd < 0)
            return;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        if (t->npending == t->cap_pending) {
            size_t ncap = t->cap_pending ? t->cap_pending * 2 : 8;
            conn *n = realloc(t->pending, ncap * sizeof(*n));

            if (!n) {
                close(fd);
                return;
            }
            t->pending = n;
            t->cap_pending = ncap;
        }
        c = &t->pending[t->npending];
        conn_init(c);
        c->fd = fd;
        c->since = rf_xfer__now();
        name_remote(&ss, sl, c->raddr, sizeof(c->raddr));
        randombytes_buf(c->nonce, sizeof(c->nonce));
        if ((rc = send_now(fd, c->nonce, sizeof(c->nonce))) < 0) {
            drop_pending(c, "sending its challenge failed: %s", strerror(-rc));
            continue;
        }
        t->npending++;
    }
}

/* Drops accepted connections whose hello did not come in time. Runs after their input was
 * read, so a hello that waited in the socket between two jobs still counts. */
static void expire_pending(tcp *t)
{
    double now = rf_xfer__now();

    for (size_t i = 0; i < t->npending; i++) {
        conn *c = &t->pending[i];

        if (c->fd >= 0 && !c->hello_ok && now - c->since > HELLO_TIMEOUT_S)
            drop_pending(c, c->buf_done == HELLO_LEN ? "its hello names peers this daemon's "
                         "plan does not hold, and no job came within %.0f s (%zu of %d bytes)" :
                         "no complete hello within %.0f s (%zu of %d bytes)", HELLO_TIMEOUT_S,
                         c->buf_done, HELLO_LEN);
    }
}

static void compact_pending(tcp *t)
{
    size_t j = 0;

    for (size_t i = 0; i < t->npending; i++)
        if (t->pending[i].fd >= 0)
            t->pending[j++] = t->pending[i];
    t->npending = j;
}

/* ---- between jobs: the idle thread ---- */

/* The time left until the first pending connection's hello is due, in ms for poll (-1: none
 * pending). */
static int pending_wait_ms(const tcp *t)
{
    double now = rf_xfer__now(), first = 0.0;
    bool any = false;

    for (size_t i = 0; i < t->npending; i++) {
        double left = t->pending[i].since + HELLO_TIMEOUT_S - now;

        if (t->pending[i].hello_ok)
            continue; /* waits for a job, not for a deadline */
        if (!any || left < first)
            first = left;
        any = true;
    }
    if (!any)
        return -1;
    return first <= 0 ? 0 : (int)(first * 1000) + 1;
}

/* One poll over the wake-up, the listener and the pending connections, then what each ready
 * one can do: what a job's worker does for them, without a job. */
static void idle_step(tcp *t)
{
    size_t need = 2 + t->npending, n = 0;
    struct pollfd *pfd;
    uint64_t drain;

    if (need > t->idle_pcap) {
        pfd = realloc(t->idle_pfd, need * sizeof(*pfd));
        if (pfd == NULL) {
            /* Out of memory: what waits stays for the next job's worker, which expires it. */
            RF_WARN("xfer tcp: out of memory serving %zu data connections between jobs; they "
                    "wait for the next job", t->npending);
            poll(&(struct pollfd){.fd = t->idle_fd, .events = POLLIN}, 1, 1000);
            return;
        }
        t->idle_pfd = pfd;
        t->idle_pcap = need;
    }
    pfd = t->idle_pfd;
    pfd[n++] = (struct pollfd){.fd = t->idle_fd, .events = POLLIN};
    pfd[n++] = (struct pollfd){.fd = t->lfd, .events = POLLIN};
    /* A whole hello waiting for the next job's table may have frames behind it: only its
     * hang-up or error wakes this thread. */
    for (size_t k = 0; k < t->npending; k++)
        pfd[n++] = (struct pollfd){.fd = t->pending[k].fd,
                                   .events = t->pending[k].buf_done == HELLO_LEN ? 0 : POLLIN};
    if (poll(pfd, n, pending_wait_ms(t)) < 0)
        return;
    if (pfd[0].revents)
        while (read(t->idle_fd, &drain, sizeof(drain)) > 0)
            ;
    for (size_t k = 0; k + 2 < n; k++)
        if (pfd[k + 2].revents)
            hello_progress(t, k);
    expire_pending(t);
    compact_pending(t);
    if (pfd[1].revents)
        accept_all(t);
}

static void *idle_main(void *arg)
{
    tcp *t = arg;

    pthread_mutex_lock(&t->idle_mu);
    while (t->idle_want != IDLE_QUIT) {
        if (t->idle_want == IDLE_PARK) {
            t->idle_parked = true;
            pthread_cond_broadcast(&t->idle_cv);
            while (t->idle_want == IDLE_PARK)
                pthread_cond_wait(&t->idle_cv, &t->idle_mu);
            t->idle_parked = false;
            continue;
        }
        pthread_mutex_unlock(&t->idle_mu);
        idle_step(t);
        pthread_mutex_lock(&t->idle_mu);
    }
    t->idle_parked = true;
    pthread_cond_broadcast(&t->idle_cv);
    pthread_mutex_unlock(&t->idle_mu);
    return NULL;
}

/* Asks the idle thread for want (IDLE_PARK, IDLE_QUIT) and waits until it touches nothing. */
static void idle_stop(tcp *t, int want)
{
    uint64_t one = 1;

    if (!t->idle_started)
        return;
    pthread_mutex_lock(&t->idle_mu);
    t->idle_want = want;
    /* A parked thread waits on the condition, a serving one in poll: wake both. */
    pthread_cond_broadcast(&t->idle_cv);
    if (write(t->idle_fd, &one, sizeof(one)) < 0) {
        /* The counter is full: the thread has a wake-up waiting anyway. */
    }
    while (!t->idle_parked)
        pthread_cond_wait(&t->idle_cv, &t->idle_mu);
    pthread_mutex_unlock(&t->idle_mu);
}

/* Lets a parked idle thread serve again. */
static void idle_serve(tcp *t)
{
    if (!t->idle_started)
        return;
    pthread_mutex_lock(&t->idle_mu);
    t->idle_want = IDLE_SERVE;
    pthread_cond_broadcast(&t->idle_cv);
    pthread_mutex_unlock(&t->idle_mu);
}

/* Starts the idle thread (once); 0 or a negative errno. */
static int idle_start(tcp *t)
{
    int rc;

    if (t->idle_started)
        return 0;
    t->idle_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t->idle_fd < 0)
        return -errno;
    pthread_mutex_init(&t->idle_mu, NULL);
    pthread_cond_init(&t->idle_cv, NULL);
    t->idle_want = IDLE_SERVE;
    t->idle_parked = false;
    rc = pthread_create(&t->idle_thread, NULL, idle_main, t);
    if (rc != 0) {
        pthread_cond_destroy(&t->idle_cv);
        pthread_mutex_destroy(&t->idle_mu);
        close(t->idle_fd);
        t->idle_fd = -1;
        return -rc;
    }
    t->idle_started = true;
    return 0;
}

/* Stops the idle thread for good and frees what it held. */
static void idle_end(tcp *t)
{
    if (!t->idle_started)
        return;
    idle_stop(t, IDLE_QUIT);
    pthread_join(t->idle_thread, NULL);
    pthread_cond_destroy(&t->idle_cv);
    pthread_mutex_destroy(&t->idle_mu);
    close(t->idle_fd);
    t->idle_fd = -1;
    t->idle_started = false;
}

/* ---- the worker: the job ---- */

enum { PF_EVENT, PF_LISTEN, PF_PENDING, PF_IN, PF_OUT };

static int tcp_start(rf_xfer_core *base)
{
    tcp *t = (tcp *)base;
    jstate *s = &t->js;
    const rf_xfer_job *job = base->job;
    int rc;

    /* The listener is the worker's from here to tcp_finish. */
    idle_stop(t, IDLE_PARK);
    if (t->idle_note[0]) {
        memcpy(base->note, t->idle_note, sizeof(base->note));
        t->idle_note[0] = '\0';
    }
    if ((rc = js_init(s, job, base->npeers)) < 0)
        return fail(t, rc, "out of memory for a job of %u messages", job->nmsgs);
    for (uint32_t p = 0; p < base->npeers; p++) {
        conn *c = &t->out[p];

        c->cur = -1;
        c->buf_len = c->buf_done = 0;
        if (c->fd >= 0 && (c->stage != OUT_READY || !conn_alive(c)))
            conn_close(c);
        t->in[p].active = false;
    }
    if ((rc = arena_reserve(t)) < 0 || (rc = runs_build(t)) < 0 || (rc = window_update(t)) < 0)
        return rc;
    /* Hellos that came before this job's peer table are judged by it now. */
    for (size_t k = 0; k < t->npending; k++)
        if (t->pending[k].fd >= 0 && t->pending[k].buf_done == HELLO_LEN &&
            (rc = hello_decide(t, k)) < 0)
            return rc;
    return 0;
}

/* One poll over the wake-up, the listener, the accepted connections waiting for their hello and
 * every peer connection with work, then what each ready one can do without blocking. */
static int tcp_progress(rf_xfer_core *base, double wait_s)
{
    tcp *t = (tcp *)base;
    jstate *s = &t->js;
    const rf_xfer_job *job = s->job;
    size_t need = 2 + t->npending + 2 * (size_t)base->npeers, n = 0;
    struct pollfd *pfd;
    int pr, rc;

    if (s->left == 0)
        return 1;
    if (need > t->pcap) {
        free(t->pfd);
        free(t->pref);
        free(t->pkind);
        t->pfd = malloc(need * sizeof(*t->pfd));
        t->pref = malloc(need * sizeof(*t->pref));
        t->pkind = malloc(need);
        t->pcap = t->pfd && t->pref && t->pkind ? need : 0;
        if (t->pcap == 0)
            return fail(t, -ENOMEM, "out of memory polling %u peers", base->npeers);
    }
    pfd = t->pfd;
    pfd[n] = (struct pollfd){.fd = rf_xfer__wake_fd(base), .events = POLLIN};
    t->pkind[n++] = PF_EVENT;
    pfd[n] = (struct pollfd){.fd = t->lfd, .events = POLLIN};
    t->pkind[n++] = PF_LISTEN;
    for (size_t k = 0; k < t->npending; k++) {
        pfd[n] = (struct pollfd){.fd = t->pending[k].fd, .events = POLLIN};
        t->pref[n] = (uint32_t)k;
        t->pkind[n++] = PF_PENDING;
    }
    for (uint32_t p = 0; p < base->npeers; p++) {
        conn *c = &t->out[p];

        if (c->fd < 0 && next_send(s, p) >= 0) {
            if ((rc = start_connect(t, p, job->msgs[next_send(s, p)].seq)) < 0)
                return rc;
        }
        if (c->fd >= 0 && send_wanted(t, c)) {
            bool reading = c->stage == OUT_NONCE || c->stage == OUT_ACK;

            pfd[n] = (struct pollfd){.fd = c->fd, .events = reading ? POLLIN : POLLOUT};
            t->pref[n] = p;
            t->pkind[n++] = PF_OUT;
        }
        c = &t->in[p];
        if (c->fd >= 0 && recv_wanted(t, c)) {
            pfd[n] = (struct pollfd){.fd = c->fd, .events = POLLIN};
            t->pref[n] = p;
            t->pkind[n++] = PF_IN;
        }
    }
    assert(n <= need);
    pr = poll(pfd, n, (int)(wait_s * 1000) + 1);
    if (pr < 0) {
        if (errno == EINTR)
            return 0;
        return fail(t, -errno, "poll over %u peers: %s", base->npeers, strerror(errno));
    }
    for (size_t k = 0; k < n; k++) {
        uint32_t ref = t->pref[k];

        if (pfd[k].revents == 0)
            continue;
        switch (t->pkind[k]) {
        case PF_EVENT:
        case PF_LISTEN:
            break;
        case PF_PENDING:
            if ((rc = hello_progress(t, ref)) < 0)
                return rc;
            break;
        case PF_OUT:
            if ((rc = send_progress(t, &t->out[ref])) < 0)
                return rc;
            break;
        case PF_IN:
            if (t->in[ref].fd >= 0 && (rc = recv_progress(t, &t->in[ref])) < 0)
                return rc;
            break;
        }
    }
    expire_pending(t);
    compact_pending(t);
    if (pfd[1].revents)
        accept_all(t);
    return s->left == 0;
}

static void tcp_finish(rf_xfer_core *base, int rc)
{
    tcp *t = (tcp *)base;

    js_free(&t->js);
    /* A failed job leaves streams mid-frame or with stale frames: start over. */
    if (rc < 0)
        close_all_conns(t);
    idle_serve(t);
}

/* ---- the loop thread ---- */

static void tcp_release(rf_xfer_core *base)
{
    tcp *t = (tcp *)base;

    idle_end(t);
    close_all_conns(t);
    if (t->lfd >= 0)
        close(t->lfd);
    free(t->out);
    free(t->in);
    free(t->to);
    free(t->pending);
    free(t->arena);
    free(t->runs);
    free(t->msg_first);
    free(t->pfd);
    free(t->pref);
    free(t->pkind);
    free(t->idle_pfd);
    if (t->key)
        sodium_memzero(t->key, t->key_len);
    free(t->key);
    free(t);
}

/* Every peer needs an address to connect to; connections survive when the world keeps its
 * shape and the peer its address. */
static int tcp_set_peers(rf_xfer_core *base, uint32_t self, uint32_t npeers,
                         char *const *addrs, rf_err *err)
{
    tcp *t = (tcp *)base;
    conn *nout = NULL, *nin = NULL;
    rf_addr *nto = NULL;
    bool same_world = self == base->self && npeers == base->npeers;
    uint32_t p;
    int rc = 0;

    idle_stop(t, IDLE_PARK);
    nout = malloc(npeers * sizeof(*nout));
    nin = malloc(npeers * sizeof(*nin));
    nto = malloc(npeers * sizeof(*nto));
    if (!nout || !nin || !nto) {
        rc = rf_err_set(err, -ENOMEM, "xfer tcp: out of memory for %u peers", npeers);
        goto out;
    }
    for (p = 0; p < npeers; p++) {
        if (!addrs[p]) {
            rc = rf_err_set(err, -EINVAL, "xfer tcp: peer %u has no data address; its Hello "
                            "must announce one", p);
            goto out;
        }
        if ((rc = rf_addr_parse(addrs[p], RF_ADDR_CONNECT, &nto[p], err)) < 0) {
            rf_err_wrap(err, "xfer tcp: peer %u's data address: ", p);
            goto out;
        }
    }
    for (p = 0; p < npeers; p++) {
        conn_init(&nout[p]);
        conn_init(&nin[p]);
        if (same_world && strcmp(addrs[p], base->addrs[p]) == 0) {
            nout[p] = t->out[p];
            nin[p] = t->in[p];
            conn_init(&t->out[p]);
            conn_init(&t->in[p]);
        }
    }
    /* Accepted connections still in their hello stay: a peer of the new table may have
     * connected before this daemon installed it, and tcp_start judges its hello then. */
    for (p = 0; p < base->npeers; p++) {
        conn_close(&t->out[p]);
        conn_close(&t->in[p]);
    }
    free(t->out);
    free(t->in);
    free(t->to);
    t->out = nout;
    t->in = nin;
    t->to = nto;
    t->self = self;
    t->npeers = npeers;
    nout = nin = NULL;
    nto = NULL;
out:
    free(nout);
    free(nin);
    free(nto);
    idle_serve(t);
    return rc;
}

static int tcp_check(rf_xfer_core *base, const rf_xfer_job *job, rf_err *err)
{
    (void)job;
    if (!((tcp *)base)->key)
        return rf_err_set(err, -ENOKEY, "xfer tcp: no cluster key; data connections are "
                          "authenticated with it, so call rf_xfer_tcp_set_key before a job");
    return 0;
}

static const rf_xfer_backend tcp_backend = {
    .name = "tcp",
    .set_peers = tcp_set_peers,
    .check = tcp_check,
    .release = tcp_release,
    .start = tcp_start,
    .progress = tcp_progress,
    .describe = describe_outstanding,
    .finish = tcp_finish,
};

size_t rf_xfer_tcp__accept_headers(const rf_xfer_job *job, uint32_t npeers, uint32_t peer,
                                   const uint8_t *hdrs, size_t n, rf_xfer_result *res)
{
    tcp *t = calloc(1, sizeof(*t));
    size_t k = 0;
    uint32_t p;
    int rc = -ENOMEM;

    memset(res, 0, sizeof(*res));
    assert(peer < npeers);
    if (!t)
        goto out;
    t->lfd = -1;
    t->idle_fd = -1;
    t->base.pub.ops = &tcp_backend;
    t->base.job = job;
    t->base.npeers = npeers;
    t->base.addrs = calloc(npeers, sizeof(char *));
    t->in = calloc(npeers, sizeof(conn));
    t->out = calloc(npeers, sizeof(conn));
    if (!t->base.addrs || !t->in || !t->out)
        goto out;
    for (p = 0; p < npeers; p++) {
        conn_init(&t->in[p]);
        conn_init(&t->out[p]);
        t->in[p].peer = p;
        if (!(t->base.addrs[p] = strdup("peer.example:7471")))
            goto out;
    }
    if ((rc = js_init(&t->js, job, npeers)) < 0 || (rc = arena_reserve(t)) < 0 ||
        (rc = window_update(t)) < 0)
        goto out;
    for (k = 0; k < n; k++) {
        conn *c = &t->in[peer];

        memcpy(c->buf, hdrs + k * HDR_LEN, HDR_LEN);
        if ((rc = parse_header(t, c)) < 0)
            break;
        /* As if its payload and tags had come in and passed. */
        rc = msg_done(t, (uint32_t)c->cur);
        c->cur = -1;
        if (rc < 0)
            break;
    }
out:
    if (rc < 0 && t && t->base.result.code == 0)
        rf_xfer__fail(&t->base, rc, "out of memory applying frame headers");
    if (t) {
        *res = t->base.result;
        js_free(&t->js);
        for (p = 0; t->base.addrs && p < npeers; p++)
            free(t->base.addrs[p]);
        free(t->base.addrs);
        tcp_release(&t->base);
    } else {
        res->code = -ENOMEM;
    }
    return k;
}

/* Binds the data listener: 0 with its socket in *fd_out and its bound address in addr.
 * ":port" and "*:port" take every interface (rf_addr's grammar for listeners). */
static int bind_listener(const char *listen_addr, int *fd_out, char addr[ADDR_MAX], rf_err *err)
{
    char hbuf[NI_MAXHOST], sbuf[NI_MAXSERV];
    struct addrinfo *ai = NULL;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    int fd = -1, one = 1, rc;
    rf_addr a;

    if ((rc = rf_addr_parse(listen_addr, RF_ADDR_LISTEN, &a, err)) < 0)
        return rf_err_wrap(err, "xfer tcp: data listen address: ");
    if ((rc = rf_addr_resolve(&a, RF_ADDR_LISTEN, &ai, err)) < 0)
        return rf_err_wrap(err, "xfer tcp: data listen address '%s': ", listen_addr);
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = rf_err_set(err, -errno, "xfer tcp: socket for %s: %s", listen_addr,
                        strerror(errno));
        goto out;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0 ||
        getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
        rc = rf_err_set(err, -errno, "xfer tcp: cannot listen on %s: %s; pick a free data "
                        "port", listen_addr, strerror(errno));
        goto out;
    }
    rc = getnameinfo((struct sockaddr *)&ss, sl, hbuf, sizeof(hbuf), sbuf, sizeof(sbuf),
                     NI_NUMERICHOST | NI_NUMERICSERV);
    if (rc != 0) {
        rc = rf_err_set(err, -EINVAL, "xfer tcp: naming the bound address of %s: %s",
                        listen_addr, gai_strerror(rc));
        goto out;
    }
    snprintf(addr, ADDR_MAX, ss.ss_family == AF_INET6 ? "[%s]:%s" : "%s:%s", hbuf, sbuf);
    *fd_out = fd;
    fd = -1;
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    freeaddrinfo(ai);
    return rc;
}

int rf_xfer_tcp_new(uv_loop_t *loop, const char *listen_addr, rf_xfer_transport **out,
                    rf_err *err)
{
    rf_xfer_core *core = NULL;
    char addr[ADDR_MAX];
    int lfd = -1, rc;
    tcp *t;

    *out = NULL;
    if ((rc = bind_listener(listen_addr, &lfd, addr, err)) < 0)
        return rc;
    if ((rc = rf_xfer__new(sizeof(tcp), &tcp_backend, loop, &core, err)) < 0) {
        close(lfd);
        return rc;
    }
    t = (tcp *)core;
    t->lfd = lfd;
    t->idle_fd = -1;
    memcpy(t->addr, addr, sizeof(t->addr));
    {
        const char *hook = getenv("REFIT_TEST_CORRUPT_RELAY");

        t->corrupt_relays = hook && hook[0] && strcmp(hook, "0") != 0;
        if (t->corrupt_relays)
            RF_WARN("REFIT_TEST_CORRUPT_RELAY is set: this data path corrupts every packed "
                    "message it relays (a test hook; unset it outside tests)");
    }
    *out = &core->pub;
    return 0;
}

int rf_xfer_tcp_set_key(rf_xfer_transport *base, const uint8_t *key, size_t len)
{
    tcp *t = (tcp *)base;
    uint8_t *copy;

    if (!base || base->ops != &tcp_backend || !key || len < RF_XFER_TCP_KEY_MIN)
        return -EINVAL;
    if (t->base.running || t->base.closing)
        return -EBUSY;
    copy = malloc(len);
    if (!copy)
        return -ENOMEM;
    memcpy(copy, key, len);
    idle_stop(t, IDLE_PARK);
    /* Connections proved the old key; with a new one they must prove it again. */
    if (t->key && (t->key_len != len || sodium_memcmp(t->key, key, len) != 0))
        close_all_conns(t);
    if (t->key)
        sodium_memzero(t->key, t->key_len);
    free(t->key);
    t->key = copy;
    t->key_len = len;
    if (t->idle_started) {
        idle_serve(t);
        return 0;
    }
    /* From the first key on, the listener is served between jobs too. */
    return idle_start(t);
}

const char *rf_xfer_tcp_addr(const rf_xfer_transport *base)
{
    const tcp *t = (const tcp *)base;

    return t->addr;
}
