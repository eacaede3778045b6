/* tests/unit/test_peer.c - authenticated control connections over real TCP on 127.0.0.1: the
 * handshake both ways, wrong keys, version mismatch, hostile raw clients and acceptors (the
 * reflection attack, replayed proofs, tampered, replayed and reordered frames), the limits
 * before authentication, heartbeats and timeouts, reconnect with backoff, key files, and a
 * loop that closes cleanly every time. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "peer.h"
#include "refit.pb-c.h"
#include "wire.h"

/* What one side saw through its callbacks. */
struct side {
    int up, down, envs, retries;
    rf_peer *peer;                 /* the last peer that came up, while up */
    char down_reason[512];
    char retry_reason[512];
    uint64_t retry_delays[16];
    Refit__Role hello_role;
    char hello_node[64], hello_data_addr[64];
    uint64_t hello_daemon_id;
    uint32_t hello_index;
    Refit__Envelope__BodyCase last_case;
    uint64_t last_version;
    int echo;                      /* answer every Start with a Commit of the same version */
    int close_on_up;               /* rf_peer_close from inside on_up */
};

static void on_up(rf_peer *p, const Refit__Hello *h)
{
    struct side *s = rf_peer_data(p);

    cr_assert_eq(rf_peer_hello(p), h);
    cr_assert(rf_peer_is_up(p));
    s->up++;
    s->peer = p;
    s->hello_role = h->role;
    snprintf(s->hello_node, sizeof(s->hello_node), "%s", h->node);
    snprintf(s->hello_data_addr, sizeof(s->hello_data_addr), "%s", h->data_addr);
    s->hello_daemon_id = h->daemon_id;
    s->hello_index = h->index;
    if (s->close_on_up)
        rf_peer_close(p, "closed from on_up");
}

static void on_envelope(rf_peer *p, const Refit__Envelope *env)
{
    struct side *s = rf_peer_data(p);

    s->envs++;
    s->last_case = env->body_case;
    if (env->body_case == REFIT__ENVELOPE__BODY_START) {
        s->last_version = env->start->version;
        if (s->echo) {
            Refit__Envelope out = REFIT__ENVELOPE__INIT;
            Refit__Commit c = REFIT__COMMIT__INIT;

            c.version = env->start->version;
            out.body_case = REFIT__ENVELOPE__BODY_COMMIT;
            out.commit = &c;
            cr_assert_eq(rf_peer_send(p, &out), 0);
        }
    } else if (env->body_case == REFIT__ENVELOPE__BODY_COMMIT) {
        s->last_version = env->commit->version;
    }
}

static void on_down(rf_peer *p, const char *reason)
{
    struct side *s = rf_peer_data(p);

    s->down++;
    if (s->peer == p)
        s->peer = NULL;
    snprintf(s->down_reason, sizeof(s->down_reason), "%s", reason);
}

static void on_retry(rf_peer_connector *c, const char *reason, uint64_t delay_ms)
{
    struct side *s = rf_peer_connector_data(c);

    if (s->retries < 16)
        s->retry_delays[s->retries] = delay_ms;
    s->retries++;
    snprintf(s->retry_reason, sizeof(s->retry_reason), "%s", reason);
}

static uv_loop_t loop;
static rf_peer_key key1, key2;

static void setup(void)
{
    cr_assert_geq(sodium_init(), 0);
    cr_assert_eq(uv_loop_init(&loop), 0);
    key1.len = 32;
    randombytes_buf(key1.bytes, key1.len);
    key2.len = 48;
    randombytes_buf(key2.bytes, key2.len);
}

static void close_open(uv_handle_t *h, void *arg)
{
    if (!uv_is_closing(h)) {
        (*(int *)arg)++;
        uv_close(h, NULL);
    }
}

/* Every test ends here, after closing its listeners and connectors: their graceful closes
 * finish on their own, no handle may be left for uv_walk to close, and the loop closes. */
static void finish(void)
{
    int open = 0;

    for (int i = 0; i < 5000 && uv_loop_alive(&loop); i++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        usleep(1000);
    }
    uv_walk(&loop, close_open, &open);
    cr_assert_eq(open, 0, "%d handles left open after closing listeners and connectors", open);
    cr_assert_eq(uv_run(&loop, UV_RUN_DEFAULT), 0);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

TestSuite(peer, .init = setup, .timeout = 30);

static rf_peer_config mkcfg(struct side *s, const rf_peer_key *key, Refit__Role role,
                            const char *node)
{
    rf_peer_config c;

    memset(&c, 0, sizeof(c));
    c.key = key;
    c.role = role;
    c.node = node;
    c.daemon_id = 0xabc0000000000000ull | (uint64_t)role;
    c.data_addr = role == REFIT__ROLE__ROLE_RECEIVER ? "127.0.0.1:9100" : "127.0.0.1:9000";
    c.index = (uint32_t)role + 10;
    c.heartbeat_ms = 50;
    c.timeout_ms = 1000;
    c.backoff_min_ms = 20;
    c.backoff_max_ms = 100;
    c.cb.on_up = on_up;
    c.cb.on_envelope = on_envelope;
    c.cb.on_down = on_down;
    c.cb.on_retry = on_retry;
    c.data = s;
    return c;
}

/* Runs the loop until *counter reaches target; false after ms. */
static int run_until(const int *counter, int target, int ms)
{
    for (int i = 0; i < ms && *counter < target; i++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        if (*counter < target)
            usleep(1000);
    }
    return *counter >= target;
}

static void run_for(int ms)
{
    for (int i = 0; i < ms; i++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        usleep(1000);
    }
}

static rf_peer_listener *listen_on(struct side *s, const rf_peer_key *key, const char *addr,
                                   rf_peer_config *over)
{
    rf_peer_config cfg = over ? *over : mkcfg(s, key, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    rf_err err = {0};

    cr_assert_eq(rf_peer_listen(&loop, addr, &cfg, &l, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_peer_listener_port(l), 0);
    cr_assert_eq(rf_peer_listener_data(l), s);
    return l;
}

static rf_peer_connector *connect_to(struct side *s, int port, rf_peer_config *cfg)
{
    rf_peer_connector *c;
    rf_err err = {0};
    char addr[64];

    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    cr_assert_eq(cfg->data, s);
    cr_assert_eq(rf_peer_connect(&loop, addr, cfg, &c, &err), 0, "%s", err.msg);
    return c;
}

Test(peer, handshake_both_ways_then_envelopes)
{
    struct side L = {0}, C = {0};
    rf_peer_listener *l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "recv-7");
    rf_peer_connector *c = connect_to(&C, rf_peer_listener_port(l), &cc);
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Start st = REFIT__START__INIT;

    L.echo = 1;
    cr_assert(run_until(&C.up, 1, 3000));
    cr_assert(run_until(&L.up, 1, 3000));
    /* Each side sees the other's Hello. */
    cr_assert_eq(L.hello_role, REFIT__ROLE__ROLE_RECEIVER);
    cr_assert_str_eq(L.hello_node, "recv-7");
    cr_assert_str_eq(L.hello_data_addr, "127.0.0.1:9100");
    cr_assert_eq(L.hello_daemon_id, 0xabc0000000000000ull | REFIT__ROLE__ROLE_RECEIVER);
    cr_assert_eq(L.hello_index, REFIT__ROLE__ROLE_RECEIVER + 10);
    cr_assert_eq(C.hello_role, REFIT__ROLE__ROLE_COORDINATOR);
    cr_assert_str_eq(C.hello_node, "coord");
    cr_assert_eq(rf_peer_connector_peer(c), C.peer);
    cr_assert_eq(rf_peer_connector_of(C.peer), c);
    cr_assert_null(rf_peer_connector_of(L.peer));
    cr_assert_eq(strncmp(rf_peer_remote(C.peer), "127.0.0.1:", 10), 0);
    cr_assert_eq(strncmp(rf_peer_remote(L.peer), "127.0.0.1:", 10), 0);

    /* A request and its answer, through the owner callbacks. */
    st.version = 42;
    env.body_case = REFIT__ENVELOPE__BODY_START;
    env.start = &st;
    cr_assert_eq(rf_peer_send(C.peer, &env), 0);
    cr_assert(run_until(&C.envs, 1, 3000));
    cr_assert_eq(L.last_case, REFIT__ENVELOPE__BODY_START);
    cr_assert_eq(L.last_version, 42);
    cr_assert_eq(C.last_case, REFIT__ENVELOPE__BODY_COMMIT);
    cr_assert_eq(C.last_version, 42);

    /* An envelope without a body is refused locally. */
    env.body_case = REFIT__ENVELOPE__BODY__NOT_SET;
    cr_assert_eq(rf_peer_send(C.peer, &env), -EINVAL);

    rf_peer_connector_close(c);
    cr_assert(run_until(&L.down, 1, 3000));
    cr_assert(run_until(&C.down, 1, 3000));
    cr_assert_str_eq(C.down_reason, "connector closed");
    cr_assert(strstr(L.down_reason, "connection closed by peer"), "%s", L.down_reason);
    cr_assert_eq(C.retries, 0, "a closed connector does not retry");
    rf_peer_listener_close(l);
    finish();
}

Test(peer, heartbeats_keep_idle_connection_alive)
{
    struct side L = {0}, C = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_PUBLISHER, "pub");
    rf_peer_listener *l;
    rf_peer_connector *c;

    lc.heartbeat_ms = cc.heartbeat_ms = 20;
    lc.timeout_ms = cc.timeout_ms = 150;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    c = connect_to(&C, rf_peer_listener_port(l), &cc);
    cr_assert(run_until(&C.up, 1, 3000));
    cr_assert(run_until(&L.up, 1, 3000));
    /* Several timeouts long with no traffic but heartbeats, which never reach the owner. */
    run_for(600);
    cr_assert_eq(L.down, 0, "%s", L.down_reason);
    cr_assert_eq(C.down, 0, "%s", C.down_reason);
    cr_assert_eq(L.envs + C.envs, 0);
    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    finish();
    cr_assert_eq(L.down, 1);
    cr_assert_eq(C.down, 1);
}

Test(peer, wrong_key_fails_on_both_sides)
{
    struct side L = {0}, C = {0};
    rf_peer_listener *l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    rf_peer_config cc = mkcfg(&C, &key2, REFIT__ROLE__ROLE_RECEIVER, "recv");
    rf_peer_connector *c = connect_to(&C, rf_peer_listener_port(l), &cc);

    cr_assert(run_until(&L.down, 1, 3000));
    cr_assert(run_until(&C.down, 1, 3000));
    cr_assert_eq(L.up + C.up, 0);
    cr_assert(strstr(L.down_reason, "authentication failed: cluster keys differ (check "
                     "cluster_key_file on both nodes)"), "%s", L.down_reason);
    cr_assert(strstr(C.down_reason, "authentication failed: cluster keys differ"), "%s",
              C.down_reason);
    /* The connector keeps trying, with growing delays. */
    cr_assert(run_until(&C.retries, 2, 3000));
    cr_assert_eq(C.retry_delays[0], 20);
    cr_assert_eq(C.retry_delays[1], 40);
    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    finish();
}

Test(peer, protocol_version_mismatch_names_both_versions)
{
    struct side L = {0}, C = {0};
    rf_peer_listener *l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "recv");
    rf_peer_connector *c;

    cc.protocol_version = RF_PEER_PROTOCOL_VERSION + 1;
    c = connect_to(&C, rf_peer_listener_port(l), &cc);
    cr_assert(run_until(&L.down, 1, 3000));
    cr_assert(run_until(&C.down, 1, 3000));
    cr_assert_eq(L.up + C.up, 0);
    for (int i = 0; i < 2; i++) {
        const char *r = i ? C.down_reason : L.down_reason;

        cr_assert(strstr(r, "protocol version mismatch"), "%s", r);
        char mine[32], theirs[32];

        snprintf(mine, sizeof(mine), "version %d", RF_PEER_PROTOCOL_VERSION);
        snprintf(theirs, sizeof(theirs), "version %d", RF_PEER_PROTOCOL_VERSION + 1);
        cr_assert(strstr(r, mine), "%s", r);
        cr_assert(strstr(r, theirs), "%s", r);
    }
    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    finish();
}

/* ---- a raw client or acceptor: a plain blocking socket driven by hand, speaking protocol 3
 * as proto/refit.proto describes it, written independently of peer.c ---- */

#define RAW_MAX 512

struct raw {
    int fd;
    rf_wire_reader r;
    Refit__Envelope *env[RAW_MAX];
    uint8_t *body[RAW_MAX];     /* every frame's bytes as they arrived */
    uint32_t blen[RAW_MAX];
    int n;
    int eof;
    /* Frames from index mac_from on (when > 0) must carry a valid MAC and the next seq. */
    int mac_from;
    uint8_t tx[32], rx[32];
    uint64_t tx_seq, rx_seq;
    uint8_t hs[1024];           /* the handshake frames this side sent, byte for byte */
    size_t hs_len;
};

static const char L_CONNECTOR[] = "refit-ctl-v3/connector-proof";
static const char L_ACCEPTOR[] = "refit-ctl-v3/acceptor-proof";
static const char L_C2A[] = "refit-ctl-v3/frames-c2a";
static const char L_A2C[] = "refit-ctl-v3/frames-a2c";

/* HMAC-SHA256(key, label || 0 || T), T = H(hello_c) || nonce_c || H(hello_a) || nonce_a. */
static void spec_hmac(const rf_peer_key *k, const char *label, const uint8_t t[128],
                      uint8_t out[32])
{
    crypto_auth_hmacsha256_state st;

    crypto_auth_hmacsha256_init(&st, k->bytes, k->len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, strlen(label) + 1);
    crypto_auth_hmacsha256_update(&st, t, 128);
    crypto_auth_hmacsha256_final(&st, out);
}

static void spec_t(uint8_t t[128], const uint8_t *hello_c, size_t hello_c_len,
                   const uint8_t nonce_c[32], const uint8_t *hello_a, size_t hello_a_len,
                   const uint8_t nonce_a[32])
{
    crypto_generichash(t, 32, hello_c, hello_c_len, NULL, 0);
    memcpy(t + 32, nonce_c, 32);
    crypto_generichash(t + 64, 32, hello_a, hello_a_len, NULL, 0);
    memcpy(t + 96, nonce_a, 32);
}

/* A frame as a keyed sender builds it: seq set, then field 15 with BLAKE2b-256 keyed over the
 * bytes before it. Returns the malloc'd frame, length prefix included. */
static uint8_t *spec_keyed_frame(const Refit__Envelope *env, uint64_t seq, const uint8_t key[32],
                                 size_t *len)
{
    Refit__Envelope e = *env;
    size_t n;
    uint8_t *out;
    uint32_t be;

    e.seq = seq;
    e.mac.data = NULL;
    e.mac.len = 0;
    n = refit__envelope__get_packed_size(&e);
    out = malloc(4 + n + 34);
    cr_assert_not_null(out);
    cr_assert_eq(refit__envelope__pack(&e, out + 4), n);
    out[4 + n] = 0x7a;
    out[5 + n] = 32;
    crypto_generichash(out + 6 + n, 32, out + 4, n, key, 32);
    be = htonl((uint32_t)(n + 34));
    memcpy(out, &be, 4);
    *len = 4 + n + 34;
    return out;
}

static int raw_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    struct raw *w = ctx;
    Refit__Envelope *e = refit__envelope__unpack(NULL, len, body);

    cr_assert_not_null(e, "the daemon sent an undecodable frame");
    cr_assert_lt(w->n, RAW_MAX);
    if (w->mac_from > 0 && w->n >= w->mac_from) {
        uint8_t tag[32];

        cr_assert_geq(len, 34, "the daemon's frame %d has no MAC", w->n);
        cr_assert(body[len - 34] == 0x7a && body[len - 33] == 32,
                  "the daemon's frame %d does not end with its MAC field", w->n);
        crypto_generichash(tag, 32, body, len - 34, w->rx, 32);
        cr_assert_eq(memcmp(tag, body + len - 32, 32), 0, "the daemon's frame %d: wrong MAC",
                     w->n);
        cr_assert_eq(e->seq, w->rx_seq + 1, "the daemon's frame %d: seq %" PRIu64 ", expected %"
                     PRIu64, w->n, e->seq, w->rx_seq + 1);
        w->rx_seq = e->seq;
    }
    w->body[w->n] = malloc(len ? len : 1);
    memcpy(w->body[w->n], body, len);
    w->blen[w->n] = len;
    w->env[w->n++] = e;
    return 0;
}

static void raw_init(struct raw *w, int fd)
{
    memset(w, 0, sizeof(*w));
    rf_wire_reader_init(&w->r, 0);
    w->fd = fd;
}

/* Connects from src (a loopback address such as "127.0.0.2"; NULL: the system's choice). */
static void raw_open_from(struct raw *w, int port, const char *src)
{
    struct sockaddr_in a;
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    cr_assert_geq(fd, 0);
    raw_init(w, fd);
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    if (src != NULL) {
        cr_assert_eq(inet_pton(AF_INET, src, &a.sin_addr), 1);
        cr_assert_eq(bind(w->fd, (struct sockaddr *)&a, sizeof(a)), 0, "bind %s: %s", src,
                     strerror(errno));
    }
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(w->fd, (struct sockaddr *)&a, sizeof(a)), 0);
}

static void raw_open(struct raw *w, int port)
{
    raw_open_from(w, port, NULL);
}

static void raw_close(struct raw *w)
{
    for (int i = 0; i < w->n; i++) {
        refit__envelope__free_unpacked(w->env[i], NULL);
        free(w->body[i]);
    }
    rf_wire_reader_reset(&w->r);
    close(w->fd);
}

static void raw_write(struct raw *w, const void *b, size_t n)
{
    cr_assert_eq(write(w->fd, b, n), (ssize_t)n);
}

/* Sends env without a MAC; during the handshake the bytes are kept in w->hs. Returns where
 * the frame's body starts in w->hs (or -1). */
static long raw_send(struct raw *w, const Refit__Envelope *env)
{
    uint8_t *buf;
    size_t len;
    long at = -1;

    cr_assert_eq(rf_wire_pack(&env->base, &buf, &len), 0);
    if (w->hs_len + len <= sizeof(w->hs)) {
        memcpy(w->hs + w->hs_len, buf, len);
        at = (long)w->hs_len + 4;
        w->hs_len += len;
    }
    raw_write(w, buf, len);
    free(buf);
    return at;
}

/* The length of the frame whose body starts at w->hs + at. */
static size_t hs_body_len(const struct raw *w, long at)
{
    uint32_t be;

    memcpy(&be, w->hs + at - 4, 4);
    return ntohl(be);
}

static void raw_send_keyed(struct raw *w, const Refit__Envelope *env)
{
    size_t len;
    uint8_t *f = spec_keyed_frame(env, ++w->tx_seq, w->tx, &len);

    raw_write(w, f, len);
    free(f);
}

/* Drives the loop and reads what the daemon sent until n frames (or EOF when n < 0). */
static int raw_pump(struct raw *w, int n, int ms)
{
    uint8_t buf[65536];

    for (int i = 0; i < ms; i++) {
        ssize_t got;

        uv_run(&loop, UV_RUN_NOWAIT);
        while ((got = recv(w->fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0)
            cr_assert_eq(rf_wire_reader_feed(&w->r, buf, (size_t)got, raw_frame, w), 0);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
            w->eof = 1;
        if (n >= 0 ? w->n >= n : w->eof)
            return 1;
        usleep(1000);
    }
    return 0;
}

/* The last Error received, or NULL. */
static const char *raw_error(struct raw *w)
{
    for (int i = w->n - 1; i >= 0; i--)
        if (w->env[i]->body_case == REFIT__ENVELOPE__BODY_ERROR)
            return w->env[i]->error->message;
    return NULL;
}

static int raw_count(struct raw *w, Refit__Envelope__BodyCase bc)
{
    int k = 0;

    for (int i = 0; i < w->n; i++)
        k += w->env[i]->body_case == bc;
    return k;
}

static long raw_hello(struct raw *w, Refit__Role role, const char *node)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Hello h = REFIT__HELLO__INIT;

    h.protocol_version = RF_PEER_PROTOCOL_VERSION;
    h.role = role;
    h.node = (char *)node;
    h.daemon_id = 77;
    env.body_case = REFIT__ENVELOPE__BODY_HELLO;
    env.hello = &h;
    return raw_send(w, &env);
}

static void raw_challenge(struct raw *w, const uint8_t *nonce, size_t len)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Challenge ch = REFIT__CHALLENGE__INIT;

    ch.nonce.data = (uint8_t *)nonce;
    ch.nonce.len = len;
    env.body_case = REFIT__ENVELOPE__BODY_CHALLENGE;
    env.challenge = &ch;
    raw_send(w, &env);
}

static void raw_auth(struct raw *w, const uint8_t *mac, size_t len)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Auth au = REFIT__AUTH__INIT;

    au.mac.data = (uint8_t *)mac;
    au.mac.len = len;
    env.body_case = REFIT__ENVELOPE__BODY_AUTH;
    env.auth = &au;
    raw_send(w, &env);
}

/* The connector's side of the handshake against a daemon's listener, with key k and the
 * given proof label (L_CONNECTOR for an honest one). Leaves T in t. Returns after sending
 * Auth; the daemon's answer is not read yet. */
static void raw_prove(struct raw *w, const rf_peer_key *k, const char *label, uint8_t t[128])
{
    uint8_t nonce[32], m[32];
    long hello_at;

    cr_assert(raw_pump(w, 2, 3000));
    cr_assert_eq(w->env[0]->body_case, REFIT__ENVELOPE__BODY_HELLO);
    cr_assert_eq(w->env[0]->hello->protocol_version, RF_PEER_PROTOCOL_VERSION);
    cr_assert_eq(w->env[1]->body_case, REFIT__ENVELOPE__BODY_CHALLENGE);
    cr_assert_eq(w->env[1]->challenge->nonce.len, 32);
    hello_at = raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
    cr_assert_geq(hello_at, 0);
    randombytes_buf(nonce, sizeof(nonce));
    raw_challenge(w, nonce, 32);
    spec_t(t, w->hs + hello_at, hs_body_len(w, hello_at), nonce, w->body[0], w->blen[0],
           w->env[1]->challenge->nonce.data);
    spec_hmac(k, label, t, m);
    raw_auth(w, m, 32);
}

/* A complete, honest handshake as a connector; checks the daemon's own proof and from then
 * on every frame's MAC and sequence. */
static void raw_handshake(struct raw *w, const rf_peer_key *k, Refit__Role daemon_role)
{
    uint8_t t[128], m[32];

    raw_prove(w, k, L_CONNECTOR, t);
    cr_assert_eq(w->env[0]->hello->role, daemon_role);
    spec_hmac(k, L_C2A, t, w->tx);
    spec_hmac(k, L_A2C, t, w->rx);
    w->mac_from = 3;
    cr_assert(raw_pump(w, 3, 3000));
    cr_assert_eq(w->env[2]->body_case, REFIT__ENVELOPE__BODY_AUTH, "%s", raw_error(w));
    spec_hmac(k, L_ACCEPTOR, t, m);
    cr_assert_eq(w->env[2]->auth->mac.len, 32);
    cr_assert_eq(memcmp(w->env[2]->auth->mac.data, m, 32), 0, "daemon's Auth is not "
                 "HMAC-SHA256(key, 'refit-ctl-v3/acceptor-proof' 0 || T)");
}

enum bad_kind { BAD_OVERSIZED, BAD_PREAUTH_BIG, BAD_GARBAGE, BAD_NO_BODY, BAD_START_FIRST,
                BAD_HTTP, BAD_START_AFTER_HELLO, BAD_CHALLENGE_FIRST, BAD_AUTH_FIRST,
                BAD_HELLO_TWICE, BAD_CHALLENGE_TWICE, BAD_OWN_NONCE, BAD_SHORT_NONCE,
                BAD_MAC_LEN, BAD_WRONG_MAC, BAD_WRONG_KEY, BAD_ACCEPTOR_LABEL, BAD_NO_ROLE,
                BAD_HELLO_AFTER_AUTH, BAD_NO_MAC, BAD_TAMPERED, BAD_REPLAYED, BAD_SEQ_SKIP,
                BAD_REFLECTED_FRAME, BAD_OTHER_CONNECTION };

static const struct {
    enum bad_kind kind;
    const char *expect;
    int authed;                 /* the raw client completes the handshake first */
} bad_cases[] = {
    {BAD_OVERSIZED, "frame of 1048576 bytes exceeds the maximum of 4096 bytes before "
                    "authentication", 0},
    /* Under max_frame (65536 here) but over the limit before authentication. */
    {BAD_PREAUTH_BIG, "frame of 5000 bytes exceeds the maximum of 4096 bytes before "
                      "authentication", 0},
    {BAD_GARBAGE, "malformed frame: 5 bytes", 0},
    {BAD_NO_BODY, "frame without a message body", 0},
    {BAD_START_FIRST, "start received before authentication completed", 0},
    {BAD_HTTP, "exceeds the maximum", 0},
    {BAD_START_AFTER_HELLO, "start received before authentication completed", 0},
    {BAD_CHALLENGE_FIRST, "Challenge before Hello", 0},
    {BAD_AUTH_FIRST, "Auth before Challenge", 0},
    {BAD_HELLO_TWICE, "second Hello on one connection", 0},
    {BAD_CHALLENGE_TWICE, "second Challenge on one connection", 0},
    {BAD_OWN_NONCE, "Challenge repeats our own nonce", 0},
    {BAD_SHORT_NONCE, "Challenge nonce of 8 bytes, expected 32", 0},
    {BAD_MAC_LEN, "Auth of 16 bytes, expected 32", 0},
    {BAD_WRONG_MAC, "authentication failed: cluster keys differ", 0},
    {BAD_WRONG_KEY, "authentication failed: cluster keys differ", 0},
    /* The right key and transcript, but the acceptor's label: a proof for the other
     * direction is no proof. */
    {BAD_ACCEPTOR_LABEL, "authentication failed: cluster keys differ", 0},
    {BAD_NO_ROLE, "has no valid role", 0},
    {BAD_HELLO_AFTER_AUTH, "hello after authentication completed", 1},
    {BAD_NO_MAC, "frame 1 from 127.0.0.1:", 1},
    {BAD_TAMPERED, "frame 2 from 127.0.0.1:", 1},
    {BAD_REPLAYED, "replayed frame from 127.0.0.1:", 1},
    {BAD_SEQ_SKIP, "has sequence 5, expected 2: frames were dropped or reordered", 1},
    {BAD_REFLECTED_FRAME, "failed its MAC check", 1},
    {BAD_OTHER_CONNECTION, "failed its MAC check", 1},
};

/* A second message each post-handshake case needs: what it says after the frame number. */
static const char *bad_detail(enum bad_kind kind)
{
    switch (kind) {
    case BAD_NO_MAC:
        return "carries no MAC";
    case BAD_TAMPERED:
        return "failed its MAC check: altered on the way";
    case BAD_REPLAYED:
        return "sequence 1 came before (expected 2)";
    default:
        return "";
    }
}

static void send_bad(struct raw *w, enum bad_kind kind, int port)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Hello h = REFIT__HELLO__INIT;
    Refit__Start st = REFIT__START__INIT;
    uint8_t zeros[32] = {0}, nonce[32], t[128];
    static const uint8_t big[4] = {0, 0x10, 0, 0};
    static const uint8_t big5000[4] = {0, 0, 0x13, 0x88};
    static const uint8_t garbage[9] = {0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff, 0xff};
    static const uint8_t empty[4] = {0, 0, 0, 0};
    uint8_t *f;
    size_t len;

    randombytes_buf(nonce, sizeof(nonce));
    h.protocol_version = RF_PEER_PROTOCOL_VERSION;
    h.role = REFIT__ROLE__ROLE_RECEIVER;
    h.node = "raw";
    st.version = 9;
    switch (kind) {
    case BAD_OVERSIZED:
        raw_write(w, big, 4);
        break;
    case BAD_PREAUTH_BIG:
        raw_write(w, big5000, 4);
        break;
    case BAD_GARBAGE:
        raw_write(w, garbage, sizeof(garbage));
        break;
    case BAD_NO_BODY:
        raw_write(w, empty, 4);
        break;
    case BAD_HTTP:
        raw_write(w, "GET / HTTP/1.1\r\n\r\n", 18);
        break;
    case BAD_START_AFTER_HELLO:
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        /* fall through */
    case BAD_START_FIRST:
        env.body_case = REFIT__ENVELOPE__BODY_START;
        env.start = &st;
        raw_send(w, &env);
        break;
    case BAD_CHALLENGE_FIRST:
        raw_challenge(w, nonce, 32);
        break;
    case BAD_AUTH_FIRST:
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        raw_auth(w, zeros, 32);
        break;
    case BAD_HELLO_TWICE:
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        break;
    case BAD_CHALLENGE_TWICE:
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        raw_challenge(w, nonce, 32);
        raw_challenge(w, nonce, 32);
        break;
    case BAD_OWN_NONCE:
        cr_assert(raw_pump(w, 2, 3000));
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        raw_challenge(w, w->env[1]->challenge->nonce.data, 32);
        break;
    case BAD_SHORT_NONCE:
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        raw_challenge(w, zeros, 8);
        break;
    case BAD_MAC_LEN:
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        raw_challenge(w, nonce, 32);
        raw_auth(w, zeros, 16);
        break;
    case BAD_WRONG_MAC:
        raw_hello(w, REFIT__ROLE__ROLE_RECEIVER, "raw");
        raw_challenge(w, nonce, 32);
        raw_auth(w, zeros, 32);
        break;
    case BAD_WRONG_KEY:
        raw_prove(w, &key2, L_CONNECTOR, t);
        break;
    case BAD_ACCEPTOR_LABEL:
        raw_prove(w, &key1, L_ACCEPTOR, t);
        break;
    case BAD_NO_ROLE:
        h.role = REFIT__ROLE__ROLE_UNKNOWN;
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send(w, &env);
        break;
    case BAD_HELLO_AFTER_AUTH:
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send_keyed(w, &env);
        break;
    case BAD_NO_MAC:
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        env.body_case = REFIT__ENVELOPE__BODY_START;
        env.start = &st;
        raw_send(w, &env);
        break;
    case BAD_TAMPERED:
        /* One good frame, then one whose version was changed after the MAC was computed. */
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        env.body_case = REFIT__ENVELOPE__BODY_START;
        env.start = &st;
        raw_send_keyed(w, &env);
        f = spec_keyed_frame(&env, ++w->tx_seq, w->tx, &len);
        cr_assert_eq(f[4 + 3], 9, "Start.version is not where the test expects it");
        f[4 + 3] = 10;
        raw_write(w, f, len);
        free(f);
        break;
    case BAD_REPLAYED:
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        env.body_case = REFIT__ENVELOPE__BODY_START;
        env.start = &st;
        f = spec_keyed_frame(&env, ++w->tx_seq, w->tx, &len);
        raw_write(w, f, len);
        raw_write(w, f, len);
        free(f);
        break;
    case BAD_SEQ_SKIP:
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        env.body_case = REFIT__ENVELOPE__BODY_START;
        env.start = &st;
        raw_send_keyed(w, &env);
        f = spec_keyed_frame(&env, 5, w->tx, &len);
        raw_write(w, f, len);
        free(f);
        break;
    case BAD_REFLECTED_FRAME:
        /* The daemon's own first authenticated frame (a heartbeat), sent back to it: valid
         * in its direction, so not in ours. */
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        cr_assert(raw_pump(w, 4, 3000));
        {
            uint32_t be = htonl(w->blen[3]);

            raw_write(w, &be, 4);
            raw_write(w, w->body[3], w->blen[3]);
        }
        break;
    case BAD_OTHER_CONNECTION: {
        /* A frame made for another authenticated connection of the same listener. */
        struct raw o;

        raw_open(&o, port);
        raw_handshake(&o, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        env.body_case = REFIT__ENVELOPE__BODY_START;
        env.start = &st;
        f = spec_keyed_frame(&env, 1, o.tx, &len);
        raw_write(w, f, len);
        free(f);
        raw_close(&o);
        break;
    }
    }
}

/* Every hostile client gets an Error naming its problem and is closed; the listener keeps
 * serving and a good peer still comes up after each. After the handshake the daemon's
 * Error carries its MAC like every frame (raw_frame checks it). */
Test(peer, bad_clients_get_error_and_close_listener_survives)
{
    struct side L = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    size_t ncase = sizeof(bad_cases) / sizeof(bad_cases[0]);

    lc.max_frame = 65536;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    for (size_t i = 0; i < ncase; i++) {
        struct side C = {0};
        rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_PUBLISHER, "good");
        rf_peer_connector *c;
        struct raw w;
        const char *msg;
        int downs = L.down, ups = L.up;
        int extra = bad_cases[i].kind == BAD_OTHER_CONNECTION;

        raw_open(&w, rf_peer_listener_port(l));
        send_bad(&w, bad_cases[i].kind, rf_peer_listener_port(l));
        cr_assert(raw_pump(&w, -1, 3000), "case %zu: not closed", i);
        msg = raw_error(&w);
        cr_assert_not_null(msg, "case %zu: no Error envelope", i);
        cr_assert(strstr(msg, bad_cases[i].expect), "case %zu: Error '%s', expected '%s'", i,
                  msg, bad_cases[i].expect);
        cr_assert(strstr(msg, bad_detail(bad_cases[i].kind)), "case %zu: Error '%s', "
                  "expected '%s'", i, msg, bad_detail(bad_cases[i].kind));
        cr_assert(run_until(&L.down, downs + 1 + extra, 3000));
        cr_assert_eq(L.up, ups + (bad_cases[i].authed ? 1 + extra : 0), "case %zu", i);
        raw_close(&w);
        /* The reason of this client's connection (the other one closed without a reason). */
        cr_assert(strstr(L.down_reason, bad_cases[i].expect) || extra, "case %zu: reason '%s'",
                  i, L.down_reason);

        ups = L.up;
        c = connect_to(&C, rf_peer_listener_port(l), &cc);
        cr_assert(run_until(&C.up, 1, 3000), "case %zu: good peer did not come up", i);
        cr_assert(run_until(&L.up, ups + 1, 3000));
        rf_peer_connector_close(c);
        cr_assert(run_until(&C.down, 1, 3000));
    }
    rf_peer_listener_close(l);
    finish();
}

/* A peer that connects and never says anything is dropped at the handshake timeout. */
Test(peer, silent_client_handshake_timeout)
{
    struct side L = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    struct raw w;

    lc.heartbeat_ms = 20;
    lc.timeout_ms = 150;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    raw_open(&w, rf_peer_listener_port(l));
    cr_assert(raw_pump(&w, -1, 3000), "silent client not closed");
    cr_assert_eq(L.down, 1);
    cr_assert(strstr(L.down_reason, "handshake with 127.0.0.1:"), "%s", L.down_reason);
    cr_assert(strstr(L.down_reason, "not completed within 150 ms"), "%s", L.down_reason);
    raw_close(&w);
    rf_peer_listener_close(l);
    finish();
}

/* An authenticated peer that stops reading and writing is declared dead by heartbeat
 * timeout; until then it was sent heartbeats. */
Test(peer, authenticated_peer_goes_silent_heartbeat_timeout)
{
    struct side L = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    struct raw w;
    int hb = 0;

    lc.heartbeat_ms = 20;
    lc.timeout_ms = 200;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    raw_open(&w, rf_peer_listener_port(l));
    raw_handshake(&w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
    cr_assert(run_until(&L.up, 1, 3000));
    cr_assert_str_eq(L.hello_node, "raw");
    cr_assert(run_until(&L.down, 1, 3000));
    cr_assert(strstr(L.down_reason, "heartbeat timeout: no frame from 127.0.0.1:"), "%s",
              L.down_reason);
    cr_assert(strstr(L.down_reason, "limit 200 ms"), "%s", L.down_reason);
    cr_assert(raw_pump(&w, -1, 3000));
    for (int i = 0; i < w.n; i++)
        hb += w.env[i]->body_case == REFIT__ENVELOPE__BODY_HEARTBEAT;
    cr_assert_geq(hb, 3, "only %d heartbeats before the timeout", hb);
    raw_close(&w);
    rf_peer_listener_close(l);
    finish();
}

/* Closing a peer whose other end takes nothing: the queued frames cannot go out, and the
 * linger bounds the wait. */
Test(peer, close_with_unsent_data_lingers_then_cuts)
{
    struct side L = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Start st = REFIT__START__INIT;
    uint8_t *blob = calloc(1, 1 << 20);
    struct raw w;
    uint64_t t0;
    int rcvbuf = 4096;

    lc.timeout_ms = 400;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    raw_open(&w, rf_peer_listener_port(l));
    cr_assert_eq(setsockopt(w.fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf)), 0);
    raw_handshake(&w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
    cr_assert(run_until(&L.up, 1, 3000));
    st.version = 1;
    st.plan_id.data = blob;
    st.plan_id.len = 1 << 20;
    env.body_case = REFIT__ENVELOPE__BODY_START;
    env.start = &st;
    for (int i = 0; i < 64; i++)
        cr_assert_eq(rf_peer_send(L.peer, &env), 0);
    free(blob);
    uv_update_time(&loop);
    t0 = uv_now(&loop);
    rf_peer_close(L.peer, "closed by test");
    cr_assert(run_until(&L.down, 1, 3000));
    uv_update_time(&loop);
    cr_assert_str_eq(L.down_reason, "closed by test");
    cr_assert_geq(uv_now(&loop) - t0, 350, "closed before the linger");
    cr_assert_lt(uv_now(&loop) - t0, 2000);
    raw_close(&w);
    rf_peer_listener_close(l);
    finish();
}

Test(peer, send_before_up_and_close_from_on_up)
{
    struct side L = {0}, C = {0};
    rf_peer_listener *l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "recv");
    rf_peer_connector *c;

    C.close_on_up = 1;
    c = connect_to(&C, rf_peer_listener_port(l), &cc);
    cr_assert_null(rf_peer_connector_peer(c));
    cr_assert(run_until(&C.down, 1, 3000));
    cr_assert_str_eq(C.down_reason, "closed from on_up");
    /* The connector brings the connection back at the shortest delay. */
    cr_assert_eq(C.retry_delays[0], 20);
    cr_assert(run_until(&C.up, 2, 3000));
    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    finish();
}

Test(peer, reconnect_after_listener_restart)
{
    struct side L1 = {0}, L2 = {0}, C = {0};
    rf_peer_listener *l = listen_on(&L1, &key1, "127.0.0.1:0", NULL);
    int port = rf_peer_listener_port(l);
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "recv");
    rf_peer_connector *c = connect_to(&C, port, &cc);
    char addr[64];

    cr_assert(run_until(&C.up, 1, 3000));
    rf_peer_listener_close(l);
    cr_assert(run_until(&C.down, 1, 3000));
    cr_assert_eq(L1.down, 1);
    cr_assert_str_eq(L1.down_reason, "listener closed");
    cr_assert(strstr(C.down_reason, "connection closed by peer"), "%s", C.down_reason);
    /* Refused attempts back off: 20 (after an up connection), 40, 80, then capped at 100. */
    cr_assert(run_until(&C.retries, 5, 3000));
    cr_assert(strstr(C.retry_reason, "cannot connect to 127.0.0.1:"), "%s", C.retry_reason);
    cr_assert(strstr(C.retry_reason, "connection refused"), "%s", C.retry_reason);
    cr_assert_eq(C.retry_delays[0], 20);
    cr_assert_eq(C.retry_delays[1], 40);
    cr_assert_eq(C.retry_delays[2], 80);
    cr_assert_eq(C.retry_delays[3], 100);
    cr_assert_eq(C.retry_delays[4], 100);
    cr_assert_eq(C.down, 1, "failed connects are not connections: no on_down");

    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    l = listen_on(&L2, &key1, addr, NULL);
    cr_assert(run_until(&C.up, 2, 3000));
    cr_assert(run_until(&L2.up, 1, 3000));
    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    finish();
}

/* Closing a connector while it waits to retry, and a listener with peers still connected. */
Test(peer, close_everything_mid_flight)
{
    struct side L = {0}, C1 = {0}, C2 = {0};
    rf_peer_config cc = mkcfg(&C1, &key1, REFIT__ROLE__ROLE_RECEIVER, "r1");
    rf_peer_listener *l;
    rf_peer_connector *c1, *c2;
    struct raw w;

    /* c2 aims at a port where nothing listens, so it sits in backoff. */
    l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    c1 = connect_to(&C1, rf_peer_listener_port(l), &cc);
    cc = mkcfg(&C2, &key1, REFIT__ROLE__ROLE_PUBLISHER, "p1");
    c2 = connect_to(&C2, 1, &cc);
    cr_assert(run_until(&C1.up, 1, 3000));
    cr_assert(run_until(&C2.retries, 1, 3000));
    raw_open(&w, rf_peer_listener_port(l));
    cr_assert(raw_pump(&w, 2, 3000));
    rf_peer_listener_close(l);
    rf_peer_connector_close(c2);
    rf_peer_connector_close(c1);
    finish();
    cr_assert_eq(L.down, 2, "both the peer and the half-open raw client are closed");
    cr_assert_eq(C1.down, 1);
    cr_assert_eq(C2.down, 0);
    raw_close(&w);
}

/* ---- configuration errors ---- */

Test(peer, listen_errors)
{
    struct side L = {0};
    rf_peer_config cfg = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l, *l2;
    rf_peer_connector *c;
    rf_peer_key shortkey = {.len = 8};
    rf_err err = {0};
    char addr[64];

    cr_assert_eq(rf_peer_listen(&loop, "nope", &cfg, &l, &err), -EINVAL);
    cr_assert(strstr(err.msg, "has no port"), "%s", err.msg);
    cr_assert_eq(rf_peer_listen(&loop, "127.0.0.1:99999", &cfg, &l, &err), -EINVAL);
    cr_assert(strstr(err.msg, "not a number in 0..65535"), "%s", err.msg);
    cr_assert_eq(rf_peer_listen(&loop, "::1:80", &cfg, &l, &err), -EINVAL);
    cr_assert(strstr(err.msg, "brackets"), "%s", err.msg);
    cr_assert_eq(rf_peer_listen(&loop, "[::1:80", &cfg, &l, &err), -EINVAL);
    cr_assert_eq(rf_peer_connect(&loop, ":80", &cfg, &c, &err), -EINVAL);
    cr_assert(strstr(err.msg, "no host"), "%s", err.msg);
    cr_assert_eq(rf_peer_connect(&loop, "*:80", &cfg, &c, &err), -EINVAL);
    cr_assert(strstr(err.msg, "no host"), "%s", err.msg);
    cr_assert_eq(rf_peer_connect(&loop, "127.0.0.1:0", &cfg, &c, &err), -EINVAL);
    cr_assert(strstr(err.msg, "has port 0"), "%s", err.msg);
    cr_assert_eq(rf_peer_connect(&loop, "::1:80", &cfg, &c, &err), -EINVAL);
    cr_assert(strstr(err.msg, "write [::1]:80"), "%s", err.msg);
    cr_assert_null(c);
    cfg.max_pending = RF_PEER_MAX_PENDING_MAX + 1;
    cr_assert_eq(rf_peer_listen(&loop, "127.0.0.1:0", &cfg, &l, &err), -EINVAL);
    cr_assert(strstr(err.msg, "65537 connections in their handshake is more than the 65536"),
              "%s", err.msg);
    cr_assert_null(l);
    cfg.max_pending = 0;
    cfg.key = &shortkey;
    cr_assert_eq(rf_peer_listen(&loop, "127.0.0.1:0", &cfg, &l, &err), -EINVAL);
    cr_assert(strstr(err.msg, "cluster key"), "%s", err.msg);
    cr_assert_eq(rf_peer_connect(&loop, "127.0.0.1:1", &cfg, &c, &err), -EINVAL);
    cfg.key = &key1;
    /* A Hello that would not fit the frames a peer takes before authentication. */
    {
        static char longname[RF_PEER_HELLO_STR_MAX + 2];

        memset(longname, 'n', RF_PEER_HELLO_STR_MAX + 1);
        cfg.node = longname;
        cr_assert_eq(rf_peer_listen(&loop, "127.0.0.1:0", &cfg, &l, &err), -EINVAL);
        cr_assert(strstr(err.msg, "longer than 960 bytes"), "%s", err.msg);
        cfg.node = "coord";
        cfg.data_addr = longname;
        cr_assert_eq(rf_peer_connect(&loop, "127.0.0.1:1", &cfg, &c, &err), -EINVAL);
        cr_assert(strstr(err.msg, "data address, host id"), "%s", err.msg);
        cfg.data_addr = NULL;
        cfg.host_id = longname;
        cr_assert_eq(rf_peer_connect(&loop, "127.0.0.1:1", &cfg, &c, &err), -EINVAL);
        cfg.host_id = NULL;
        cfg.local_sock = longname;
        cr_assert_eq(rf_peer_connect(&loop, "127.0.0.1:1", &cfg, &c, &err), -EINVAL);
        cr_assert(strstr(err.msg, "socket path"), "%s", err.msg);
        cfg.local_sock = NULL;
        /* The longest allowed, all four at once, still comes up: its Hello fits. */
        longname[RF_PEER_HELLO_STR_MAX] = '\0';
        cfg.node = longname;
        {
            struct side C = {0};
            rf_peer_listener *ll = listen_on(&L, &key1, "127.0.0.1:0", &cfg);
            rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, longname);
            rf_peer_connector *cn;

            cc.data_addr = longname;
            cc.host_id = longname;
            cc.local_sock = longname;
            cn = connect_to(&C, rf_peer_listener_port(ll), &cc);
            cr_assert(run_until(&C.up, 1, 3000), "%s", C.down_reason);
            cr_assert(run_until(&L.up, 1, 3000));
            cr_assert_eq(strlen(C.hello_node), 63, "(the test keeps 63 bytes of it)");
            rf_peer_connector_close(cn);
            rf_peer_listener_close(ll);
            cr_assert(run_until(&C.down, 1, 3000));
        }
        cfg.node = "coord";
        cfg.data_addr = NULL;
    }

    /* A port in use. */
    l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", rf_peer_listener_port(l));
    cr_assert_lt(rf_peer_listen(&loop, addr, &cfg, &l2, &err), 0);
    cr_assert_null(l2);
    cr_assert(strstr(err.msg, "cannot listen on 127.0.0.1:"), "%s", err.msg);
    cr_assert(strstr(err.msg, "address already in use"), "%s", err.msg);
    rf_peer_listener_close(l);

    /* Wildcard and IPv6 forms are accepted. */
    cr_assert_eq(rf_peer_listen(&loop, "*:0", &cfg, &l, &err), 0, "%s", err.msg);
    rf_peer_listener_close(l);
    cr_assert_eq(rf_peer_listen(&loop, ":0", &cfg, &l, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_peer_listener_port(l), 0);
    rf_peer_listener_close(l);
    if (rf_peer_listen(&loop, "[::1]:0", &cfg, &l, &err) == 0)
        rf_peer_listener_close(l);
    finish();
}

static char tmpdir[64];

static const char *write_key(const char *name, const void *data, size_t len, mode_t mode)
{
    static char path[128];
    int fd;

    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, data, len), (ssize_t)len);
    cr_assert_eq(fchmod(fd, mode), 0);
    close(fd);
    return path;
}

Test(peer, load_key_files)
{
    rf_peer_key k;
    rf_err err = {0};
    uint8_t raw[32], big[RF_PEER_KEY_MAX + 10];
    const char *hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n";
    const char *p;

    snprintf(tmpdir, sizeof(tmpdir), "/tmp/rf_peer_keyXXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir));
    randombytes_buf(raw, sizeof(raw));
    raw[31] = '\n';   /* binary keys are taken byte for byte, a final newline included */
    raw[0] = 0;

    p = write_key("raw", raw, sizeof(raw), 0600);
    cr_assert_eq(rf_peer_load_key(p, &k, &err), 0, "%s", err.msg);
    cr_assert_eq(k.len, 32);
    cr_assert_eq(memcmp(k.bytes, raw, 32), 0);
    unlink(p);

    p = write_key("hex", hex, strlen(hex), 0400);
    cr_assert_eq(rf_peer_load_key(p, &k, &err), 0, "%s", err.msg);
    cr_assert_eq(k.len, 64, "text keys lose their trailing newline");
    cr_assert_eq(memcmp(k.bytes, hex, 64), 0);
    unlink(p);

    p = write_key("readable", raw, sizeof(raw), 0640);
    cr_assert_eq(rf_peer_load_key(p, &k, &err), -EPERM);
    cr_assert(strstr(err.msg, "mode 0640") && strstr(err.msg, "chmod 600"), "%s", err.msg);
    unlink(p);

    p = write_key("world", raw, sizeof(raw), 0604);
    cr_assert_eq(rf_peer_load_key(p, &k, &err), -EPERM);
    unlink(p);

    p = write_key("short", "0123456789abcdef\n", 17, 0600);
    cr_assert_eq(rf_peer_load_key(p, &k, &err), -EINVAL);
    cr_assert(strstr(err.msg, "holds 16 bytes") && strstr(err.msg, "at least 32"), "%s",
              err.msg);
    unlink(p);

    memset(big, 'a', sizeof(big));
    p = write_key("big", big, sizeof(big), 0600);
    cr_assert_eq(rf_peer_load_key(p, &k, &err), -EINVAL);
    cr_assert(strstr(err.msg, "longer than"), "%s", err.msg);
    unlink(p);

    snprintf((char *)big, sizeof(big), "%s/missing", tmpdir);
    cr_assert_eq(rf_peer_load_key((char *)big, &k, &err), -ENOENT);
    cr_assert(strstr(err.msg, "cannot open cluster key file"), "%s", err.msg);

    cr_assert_eq(rf_peer_load_key(tmpdir, &k, &err), -EINVAL);
    cr_assert(strstr(err.msg, "not a regular file"), "%s", err.msg);
    rmdir(tmpdir);
    finish();
}

/* The reflection attack of protocol 2, over two connections to a real listener by a client
 * without the key: it echoes the daemon's own Hello and reflects each connection's challenge
 * into the other, hoping the daemon computes on one connection the proof it needs on the
 * other. The acceptor proves nothing before it has checked the connector's proof, so it
 * sends no Auth on either connection; what the client can send is refused, and the other
 * connection ends at the handshake deadline. */
Test(peer, reflection_without_key_gets_no_proof)
{
    struct side L = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    struct raw a, b;
    uint8_t guess[32];
    const char *msg;

    lc.timeout_ms = 500;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    raw_open(&a, rf_peer_listener_port(l));
    raw_open(&b, rf_peer_listener_port(l));
    cr_assert(raw_pump(&a, 2, 3000));
    cr_assert(raw_pump(&b, 2, 3000));
    /* The daemon's own Hello, byte for byte, and the other connection's nonce. */
    {
        uint32_t be = htonl(a.blen[0]);

        raw_write(&a, &be, 4);
        raw_write(&a, a.body[0], a.blen[0]);
        raw_write(&b, &be, 4);
        raw_write(&b, a.body[0], a.blen[0]);
    }
    raw_challenge(&a, b.env[1]->challenge->nonce.data, 32);
    raw_challenge(&b, a.env[1]->challenge->nonce.data, 32);
    /* a tries the best it has: bytes it has seen. */
    memcpy(guess, b.env[1]->challenge->nonce.data, 32);
    raw_auth(&a, guess, 32);
    cr_assert(raw_pump(&a, -1, 3000));
    msg = raw_error(&a);
    cr_assert_not_null(msg, "a was closed without an Error");
    cr_assert(strstr(msg, "authentication failed"), "%s", msg);
    /* b gives the daemon every chance to answer, until it is closed at the deadline. */
    cr_assert(raw_pump(&b, -1, 3000), "b was not closed at the handshake deadline");
    cr_assert_eq(b.n, 2, "b got more than Hello and Challenge");
    cr_assert_eq(raw_count(&a, REFIT__ENVELOPE__BODY_AUTH) +
                 raw_count(&b, REFIT__ENVELOPE__BODY_AUTH), 0,
                 "the daemon sent a proof to a client that showed none");
    cr_assert(run_until(&L.down, 2, 3000));
    cr_assert(strstr(L.down_reason, "handshake with 127.0.0.1:"), "%s", L.down_reason);
    cr_assert_eq(L.up, 0, "a peer without the key came up");
    raw_close(&a);
    raw_close(&b);
    rf_peer_listener_close(l);
    finish();
}

/* A complete handshake recorded on one connection and replayed byte for byte on another is
 * refused: the proof binds the acceptor's fresh nonce. */
Test(peer, replayed_proof_fails_on_a_new_connection)
{
    struct side L = {0};
    rf_peer_listener *l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    struct raw a, b;
    const char *msg;

    raw_open(&a, rf_peer_listener_port(l));
    raw_handshake(&a, &key1, REFIT__ROLE__ROLE_COORDINATOR);
    cr_assert(run_until(&L.up, 1, 3000));
    raw_open(&b, rf_peer_listener_port(l));
    cr_assert(raw_pump(&b, 2, 3000));
    raw_write(&b, a.hs, a.hs_len);
    cr_assert(raw_pump(&b, -1, 3000), "replayed handshake not closed");
    msg = raw_error(&b);
    cr_assert_not_null(msg);
    cr_assert(strstr(msg, "authentication failed: cluster keys differ"), "%s", msg);
    cr_assert_eq(raw_count(&b, REFIT__ENVELOPE__BODY_AUTH), 0);
    cr_assert(run_until(&L.down, 1, 3000));
    cr_assert_eq(L.up, 1);
    raw_close(&b);
    raw_close(&a);
    rf_peer_listener_close(l);
    finish();
}

/* Before authentication a frame may be 4 KiB: a header announcing max_frame - 1 bytes is
 * refused by itself, before any body byte is sent (the reader allocates nothing for it,
 * test_wire checks that). After the handshake frames up to max_frame pass. */
Test(peer, small_frames_until_authenticated)
{
    struct side L = {0};
    rf_peer_listener *l = listen_on(&L, &key1, "127.0.0.1:0", NULL);
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Start st = REFIT__START__INIT;
    static uint8_t blob[100000];
    uint8_t hdr[4];
    uint32_t be = htonl(RF_WIRE_MAX_DEFAULT - 1);
    struct raw a, b;
    char expect[128];
    const char *msg;

    raw_open(&a, rf_peer_listener_port(l));
    memcpy(hdr, &be, 4);
    raw_write(&a, hdr, 4);
    cr_assert(raw_pump(&a, -1, 3000));
    msg = raw_error(&a);
    cr_assert_not_null(msg);
    snprintf(expect, sizeof(expect), "frame of %u bytes exceeds the maximum of %d bytes before "
             "authentication", RF_WIRE_MAX_DEFAULT - 1, RF_PEER_PREAUTH_FRAME_MAX);
    cr_assert(strstr(msg, expect), "%s", msg);
    cr_assert(run_until(&L.down, 1, 3000));

    raw_open(&b, rf_peer_listener_port(l));
    raw_handshake(&b, &key1, REFIT__ROLE__ROLE_COORDINATOR);
    st.version = 5;
    st.plan_id.data = blob;
    st.plan_id.len = sizeof(blob);
    env.body_case = REFIT__ENVELOPE__BODY_START;
    env.start = &st;
    raw_send_keyed(&b, &env);
    cr_assert(run_until(&L.envs, 1, 3000));
    cr_assert_eq(L.last_case, REFIT__ENVELOPE__BODY_START);
    cr_assert_eq(L.last_version, 5);
    raw_close(&a);
    raw_close(&b);
    rf_peer_listener_close(l);
    finish();
}

/* At most 64 connections of a listener may be in their handshake at once. For one more, the
 * oldest connection of the source address holding the most of them is closed, with the reason
 * given to the owner (and, best effort, to the client), and the newcomer is served: not the
 * oldest connection overall when another address holds more, and never a connection that
 * already left its handshake. A daemon of the cluster connecting while the table is full gets
 * in. */
Test(peer, full_handshake_table_closes_oldest_of_the_largest_source)
{
    struct side L = {0}, C = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "good");
    rf_peer_listener *l;
    rf_peer_connector *c;
    static struct raw w[RF_PEER_MAX_PENDING_DEFAULT + 2];
    const int cap = RF_PEER_MAX_PENDING_DEFAULT;
    struct raw lone, up;
    char expect[256];
    const char *msg;

    lc.timeout_ms = 20000;      /* nobody reaches the deadline here */
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    /* An authenticated peer, then the oldest stranger alone on its address, then 63 from
     * another: the table is full. */
    raw_open(&up, rf_peer_listener_port(l));
    raw_handshake(&up, &key1, REFIT__ROLE__ROLE_COORDINATOR);
    cr_assert(run_until(&L.up, 1, 3000));
    raw_open_from(&lone, rf_peer_listener_port(l), "127.0.0.3");
    cr_assert(raw_pump(&lone, 2, 3000), "the lone stranger was not served");
    for (int i = 0; i < cap - 1; i++) {
        raw_open_from(&w[i], rf_peer_listener_port(l), "127.0.0.2");
        cr_assert(raw_pump(&w[i], 2, 3000), "connection %d not served", i);
    }
    cr_assert_eq(L.down, 0);

    /* One more from the crowded address: served, and that address's oldest goes. */
    raw_open_from(&w[cap - 1], rf_peer_listener_port(l), "127.0.0.2");
    cr_assert(raw_pump(&w[cap - 1], 2, 3000), "the newcomer was not served");
    cr_assert(raw_pump(&w[0], -1, 3000), "the oldest connection of 127.0.0.2 was not closed");
    msg = raw_error(&w[0]);
    snprintf(expect, sizeof(expect), "%d connections to this listener were in their handshake "
             "(limit %d), %d of them from the address of this one (127.0.0.2:", cap, cap,
             cap - 1);
    cr_assert(msg && strstr(msg, "closed to make room for a new connection from 127.0.0.2:") &&
              strstr(msg, expect), "%s", msg ? msg : "(no Error)");
    cr_assert(run_until(&L.down, 1, 3000));
    cr_assert(strstr(L.down_reason, expect), "%s", L.down_reason);

    /* One from a third address: again 127.0.0.2's oldest, not the older lone stranger. */
    raw_open_from(&w[cap], rf_peer_listener_port(l), "127.0.0.4");
    cr_assert(raw_pump(&w[cap], 2, 3000), "the newcomer from 127.0.0.4 was not served");
    cr_assert(raw_pump(&w[1], -1, 3000), "the second oldest of 127.0.0.2 was not closed");
    cr_assert(run_until(&L.down, 2, 3000));

    /* A daemon with the key comes up through the full table. */
    c = connect_to(&C, rf_peer_listener_port(l), &cc);
    cr_assert(run_until(&C.up, 1, 3000), "the daemon did not come up: %s", C.retry_reason);
    cr_assert(run_until(&L.up, 2, 3000));
    cr_assert(raw_pump(&w[2], -1, 3000), "the third oldest of 127.0.0.2 was not closed");
    cr_assert(run_until(&L.down, 3, 3000));
    run_for(50);
    cr_assert_not(lone.eof, "the lone stranger was closed, though 127.0.0.2 held more");
    cr_assert_not(up.eof, "the authenticated peer was closed");
    for (int i = 3; i <= cap; i++)
        cr_assert_not(w[i].eof, "connection %d was closed", i);
    cr_assert_eq(L.down, 3);

    /* A connection that leaves its handshake frees its place: the next newcomer closes no
     * one. */
    raw_close(&w[3]);
    cr_assert(run_until(&L.down, 4, 3000));
    raw_open_from(&w[3], rf_peer_listener_port(l), "127.0.0.2");
    cr_assert(raw_pump(&w[3], 2, 3000), "the connection in a freed place was not served");
    run_for(50);
    cr_assert_eq(L.down, 4);
    cr_assert_not(w[4].eof, "a connection was closed though a place was free");
    for (int i = 0; i <= cap; i++)
        raw_close(&w[i]);
    raw_close(&lone);
    raw_close(&up);
    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    finish();
}

/* Strangers on the daemon's own address keep arriving (four per turn of the loop) into a full
 * table while a daemon with the key connects: it comes up, because it proves the key long
 * before 64 newer connections could make it the oldest. */
Test(peer, keyed_daemon_gets_in_through_a_flood_from_its_address)
{
    struct side L = {0}, C = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "good");
    rf_peer_listener *l;
    rf_peer_connector *c;
    static struct raw w[RF_PEER_MAX_PENDING_DEFAULT + 400];
    int n = 0, turns = 0;

    lc.timeout_ms = 20000;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    for (; n < RF_PEER_MAX_PENDING_DEFAULT; n++) {
        raw_open(&w[n], rf_peer_listener_port(l));
        cr_assert(raw_pump(&w[n], 2, 3000), "connection %d not served", n);
    }
    c = connect_to(&C, rf_peer_listener_port(l), &cc);
    while (C.up == 0 && n + 4 <= (int)(sizeof(w) / sizeof(w[0]))) {
        for (int k = 0; k < 4; k++, n++)
            raw_open(&w[n], rf_peer_listener_port(l));
        uv_run(&loop, UV_RUN_NOWAIT);
        turns++;
    }
    cr_assert_eq(C.up, 1, "the daemon did not come up while %d strangers came (%s)",
                 n - RF_PEER_MAX_PENDING_DEFAULT, C.retry_reason);
    cr_assert(run_until(&L.up, 1, 3000));
    cr_assert_eq(C.retries, 0, "the daemon had to retry: %s", C.retry_reason);
    cr_assert(run_until(&L.down, n - RF_PEER_MAX_PENDING_DEFAULT, 3000),
              "%d strangers closed, %d expected", L.down, n - RF_PEER_MAX_PENDING_DEFAULT);
    cr_assert_gt(turns, 0);
    for (int i = 0; i < n; i++)
        raw_close(&w[i]);
    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    finish();
}

/* The handshake deadline counts from the moment TCP is up, not from the last frame: a client
 * that paces its frames (a Hello after 60% of the deadline, then one byte at a time) is
 * closed at the deadline. Counted from its last frame it would have lived to 160%. */
Test(peer, handshake_deadline_counts_from_connect)
{
    struct side L = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    struct raw w;
    uint64_t t0, hello_at, closed_at;
    uint8_t drip[40];
    size_t dripped = 0;

    lc.heartbeat_ms = 20;
    lc.timeout_ms = 400;
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    uv_update_time(&loop);
    t0 = uv_now(&loop);
    raw_open(&w, rf_peer_listener_port(l));
    cr_assert(raw_pump(&w, 2, 3000));
    memset(drip, 0x0a, sizeof(drip));
    drip[0] = drip[1] = 0;              /* a 2570-byte frame that never completes */
    do {
        raw_pump(&w, 3, 1);
        uv_update_time(&loop);
    } while (uv_now(&loop) - t0 < 240 && !w.eof);
    hello_at = uv_now(&loop) - t0;
    raw_hello(&w, REFIT__ROLE__ROLE_RECEIVER, "slow");
    while (!w.eof && uv_now(&loop) - t0 < 3000) {
        if (dripped < sizeof(drip))
            raw_write(&w, drip + dripped++, 1);
        raw_pump(&w, -1, 20);
        uv_update_time(&loop);
    }
    closed_at = uv_now(&loop) - t0;
    cr_assert(w.eof, "slow client never closed");
    cr_assert(run_until(&L.down, 1, 3000));
    cr_assert(strstr(L.down_reason, "not completed within 400 ms"), "%s", L.down_reason);
    cr_assert_geq(closed_at, 400);
    cr_assert_lt(closed_at, hello_at + 400, "closed %" PRIu64 " ms after connect, the Hello "
                 "came at %" PRIu64 " ms: the deadline was extended by the Hello", closed_at,
                 hello_at);
    raw_close(&w);
    rf_peer_listener_close(l);
    finish();
}

/* ---- the daemon as connector, against a raw acceptor ---- */

static int raw_listen(int *port)
{
    struct sockaddr_in a;
    socklen_t alen = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);

    cr_assert_geq(fd, 0);
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(fd, 8), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &alen), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

static void raw_accept(struct raw *w, int lfd)
{
    int fd = -1;

    for (int i = 0; i < 3000 && fd < 0; i++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        fd = accept(lfd, NULL, NULL);
        if (fd < 0)
            usleep(1000);
    }
    cr_assert_geq(fd, 0, "the connector did not connect");
    raw_init(w, fd);
}

enum acceptor_answer { ANSWER_HONEST, ANSWER_REFLECT, ANSWER_OTHER_KEY, ANSWER_NOTHING };

/* The acceptor's side: Hello and Challenge, then the connector's proof, which must be the
 * one the protocol defines; then an answer. Returns with the keys set for ANSWER_HONEST. */
static void raw_acceptor(struct raw *w, enum acceptor_answer ans)
{
    uint8_t nonce[32], t[128], m[32];
    long hello_at;

    hello_at = raw_hello(w, REFIT__ROLE__ROLE_COORDINATOR, "fake-coord");
    randombytes_buf(nonce, sizeof(nonce));
    raw_challenge(w, nonce, 32);
    cr_assert(raw_pump(w, 3, 3000));
    cr_assert_eq(w->env[0]->body_case, REFIT__ENVELOPE__BODY_HELLO);
    cr_assert_eq(w->env[1]->body_case, REFIT__ENVELOPE__BODY_CHALLENGE);
    cr_assert_eq(w->env[2]->body_case, REFIT__ENVELOPE__BODY_AUTH);
    spec_t(t, w->body[0], w->blen[0], w->env[1]->challenge->nonce.data, w->hs + hello_at,
           hs_body_len(w, hello_at), nonce);
    spec_hmac(&key1, L_CONNECTOR, t, m);
    cr_assert_eq(w->env[2]->auth->mac.len, 32);
    cr_assert_eq(memcmp(w->env[2]->auth->mac.data, m, 32), 0, "the connector's Auth is not "
                 "HMAC-SHA256(key, 'refit-ctl-v3/connector-proof' 0 || T)");
    switch (ans) {
    case ANSWER_HONEST:
        spec_hmac(&key1, L_ACCEPTOR, t, m);
        spec_hmac(&key1, L_A2C, t, w->tx);
        spec_hmac(&key1, L_C2A, t, w->rx);
        w->mac_from = 3;
        raw_auth(w, m, 32);
        break;
    case ANSWER_REFLECT:
        raw_auth(w, w->env[2]->auth->mac.data, 32);
        break;
    case ANSWER_OTHER_KEY:
        spec_hmac(&key2, L_ACCEPTOR, t, m);
        raw_auth(w, m, 32);
        break;
    case ANSWER_NOTHING:
        break;
    }
}

/* A daemon's connector against an acceptor that holds the key and follows the protocol as
 * written: the connector's proof is the defined one, it comes up, and frames in both
 * directions carry the defined MAC and sequence. */
Test(peer, connector_speaks_the_protocol)
{
    struct side C = {0};
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "recv");
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Start st = REFIT__START__INIT;
    Refit__Commit cm = REFIT__COMMIT__INIT;
    rf_peer_connector *c;
    struct raw w;
    int port, lfd = raw_listen(&port);

    c = connect_to(&C, port, &cc);
    raw_accept(&w, lfd);
    raw_acceptor(&w, ANSWER_HONEST);
    cr_assert(run_until(&C.up, 1, 3000), "%s", C.down_reason);
    st.version = 7;
    env.body_case = REFIT__ENVELOPE__BODY_START;
    env.start = &st;
    raw_send_keyed(&w, &env);
    raw_send_keyed(&w, &env);
    cr_assert(run_until(&C.envs, 2, 3000), "%s", C.down_reason);
    cr_assert_eq(C.last_version, 7);
    cm.version = 7;
    env.body_case = REFIT__ENVELOPE__BODY_COMMIT;
    env.commit = &cm;
    cr_assert_eq(rf_peer_send(C.peer, &env), 0);
    /* Its Commit and heartbeats, each checked by raw_frame. */
    cr_assert(raw_pump(&w, 6, 3000));
    cr_assert_eq(raw_count(&w, REFIT__ENVELOPE__BODY_COMMIT), 1);
    cr_assert_eq(C.down, 0, "%s", C.down_reason);
    rf_peer_connector_close(c);
    cr_assert(run_until(&C.down, 1, 3000));
    raw_close(&w);
    close(lfd);
    finish();
}

/* A daemon's connector refuses an acceptor that cannot prove the key: one that sends the
 * connector's own proof back, one with another key, and one that never answers (closed at
 * the handshake deadline). It never comes up. */
Test(peer, connector_refuses_acceptor_without_the_key)
{
    struct side C = {0};
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_RECEIVER, "recv");
    static const enum acceptor_answer answers[] = {ANSWER_REFLECT, ANSWER_OTHER_KEY,
                                                   ANSWER_NOTHING};
    static const char *expect[] = {"answered with a wrong proof of the cluster key",
                                   "answered with a wrong proof of the cluster key",
                                   "not completed within 300 ms"};
    rf_peer_connector *c;
    int port, lfd = raw_listen(&port);

    cc.timeout_ms = 300;
    c = connect_to(&C, port, &cc);
    for (int i = 0; i < 3; i++) {
        struct raw w;

        raw_accept(&w, lfd);
        raw_acceptor(&w, answers[i]);
        cr_assert(run_until(&C.down, i + 1, 3000), "case %d", i);
        cr_assert(strstr(C.down_reason, expect[i]), "case %d: %s", i, C.down_reason);
        if (answers[i] != ANSWER_NOTHING) {
            cr_assert(raw_pump(&w, -1, 3000));
            cr_assert(raw_error(&w) && strstr(raw_error(&w), "authentication failed"),
                      "case %d: %s", i, raw_error(&w) ? raw_error(&w) : "(no Error)");
        }
        raw_close(&w);
    }
    cr_assert_eq(C.up, 0);
    rf_peer_connector_close(c);
    close(lfd);
    finish();
}

/* ---- an attacker on the path between two real daemons ---- */

/* Frames from the connector (side c) go to the listener (side a) and back, frame by frame;
 * edit may change a frame's bytes or return 0 to drop it. */
struct relay {
    struct raw c, a;
    int fwd_c, fwd_a;           /* frames of each side already passed on */
    int (*edit)(int to_acceptor, int idx, uint8_t *body, uint32_t len);
};

static void relay_pass(struct raw *from, int *fwd, struct raw *to, int to_acceptor,
                       int (*edit)(int, int, uint8_t *, uint32_t))
{
    for (; *fwd < from->n; (*fwd)++) {
        uint32_t be = htonl(from->blen[*fwd]);

        if (edit && !edit(to_acceptor, *fwd, from->body[*fwd], from->blen[*fwd]))
            continue;
        /* The other end may have closed already: what it did not take is lost, as on a
         * real path. */
        if (send(to->fd, &be, 4, MSG_NOSIGNAL) == 4)
            (void)send(to->fd, from->body[*fwd], from->blen[*fwd], MSG_NOSIGNAL);
    }
}

/* Runs the loop and the relay until *counter reaches target; false after ms. */
static int relay_until(struct relay *r, const int *counter, int target, int ms)
{
    for (int i = 0; i < ms && *counter < target; i++) {
        raw_pump(&r->c, RAW_MAX, 1);
        raw_pump(&r->a, RAW_MAX, 1);
        relay_pass(&r->c, &r->fwd_c, &r->a, 1, r->edit);
        relay_pass(&r->a, &r->fwd_a, &r->c, 0, r->edit);
    }
    return *counter >= target;
}

static void relay_open(struct relay *r, int listener_port, int lfd)
{
    memset(r, 0, sizeof(*r));
    raw_accept(&r->c, lfd);
    raw_open(&r->a, listener_port);
}

/* Changes one byte of the acceptor's Hello on its way to the connector. */
static int edit_hello(int to_acceptor, int idx, uint8_t *body, uint32_t len)
{
    if (!to_acceptor && idx == 0)
        body[len - 1] ^= 1;
    return 1;
}

/* Drops the connector's first frame after the handshake (its frames 0-2 are Hello,
 * Challenge and Auth). */
static int edit_drop(int to_acceptor, int idx, uint8_t *body, uint32_t len)
{
    (void)body;
    (void)len;
    return !(to_acceptor && idx == 3);
}

/* A relay that passes everything changes nothing; but an altered Hello fails the handshake on
 * both sides, and after a faithful handshake a frame the relay injects, or one it drops, closes
 * the connection with the reason. */
Test(peer, attacker_on_the_path)
{
    struct side L = {0}, C = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_config cc = mkcfg(&C, &key1, REFIT__ROLE__ROLE_PUBLISHER, "pub");
    rf_peer_listener *l;
    rf_peer_connector *c;
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Start st = REFIT__START__INIT;
    uint8_t forged_key[32];
    struct relay r;
    int port, lfd = raw_listen(&port);
    size_t len;
    uint8_t *f;

    lc.heartbeat_ms = cc.heartbeat_ms = 1000;   /* only the test's frames after the handshake */
    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    c = connect_to(&C, port, &cc);
    st.version = 3;
    env.body_case = REFIT__ENVELOPE__BODY_START;
    env.start = &st;

    /* 1. Faithful: both come up through the relay, and a Start arrives. */
    relay_open(&r, rf_peer_listener_port(l), lfd);
    cr_assert(relay_until(&r, &C.up, 1, 3000), "%s", C.down_reason);
    cr_assert(relay_until(&r, &L.up, 1, 3000), "%s", L.down_reason);
    cr_assert_eq(rf_peer_send(C.peer, &env), 0);
    cr_assert(relay_until(&r, &L.envs, 1, 3000));
    cr_assert_eq(L.last_version, 3);
    /* Then the relay injects a Start of its own, without the frame key. */
    randombytes_buf(forged_key, sizeof(forged_key));
    f = spec_keyed_frame(&env, 2, forged_key, &len);
    raw_write(&r.a, f, len);
    free(f);
    cr_assert(relay_until(&r, &L.down, 1, 3000));
    cr_assert(strstr(L.down_reason, "frame 2 from 127.0.0.1:"), "%s", L.down_reason);
    cr_assert(strstr(L.down_reason, "failed its MAC check"), "%s", L.down_reason);
    cr_assert_eq(L.envs, 1, "the injected Start reached the owner");
    cr_assert(relay_until(&r, &C.down, 1, 3000));
    raw_close(&r.c);
    raw_close(&r.a);

    /* 2. The acceptor's Hello altered on the way: neither side comes up. */
    relay_open(&r, rf_peer_listener_port(l), lfd);
    r.edit = edit_hello;
    cr_assert(relay_until(&r, &L.down, 2, 3000));
    cr_assert(relay_until(&r, &C.down, 2, 3000));
    cr_assert(strstr(L.down_reason, "authentication failed"), "%s", L.down_reason);
    cr_assert(strstr(C.down_reason, "authentication failed"), "%s", C.down_reason);
    cr_assert_eq(L.up, 1);
    cr_assert_eq(C.up, 1);
    raw_close(&r.c);
    raw_close(&r.a);

    /* 3. A faithful handshake, then the connector's first frame dropped. */
    relay_open(&r, rf_peer_listener_port(l), lfd);
    r.edit = edit_drop;
    cr_assert(relay_until(&r, &C.up, 2, 3000), "%s", C.down_reason);
    cr_assert(relay_until(&r, &L.up, 2, 3000), "%s", L.down_reason);
    st.version = 4;
    cr_assert_eq(rf_peer_send(C.peer, &env), 0);
    st.version = 5;
    cr_assert_eq(rf_peer_send(C.peer, &env), 0);
    cr_assert(relay_until(&r, &L.down, 3, 3000));
    cr_assert(strstr(L.down_reason, "has sequence 2, expected 1: frames were dropped or "
                     "reordered"), "%s", L.down_reason);
    cr_assert_eq(L.envs, 1, "a Start after the dropped one reached the owner");
    raw_close(&r.c);
    raw_close(&r.a);

    rf_peer_connector_close(c);
    rf_peer_listener_close(l);
    close(lfd);
    finish();
}
