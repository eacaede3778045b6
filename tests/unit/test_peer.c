/* tests/unit/test_peer.c - authenticated control connections over real TCP on 127.0.0.1: the
 * handshake both ways, wrong keys, version mismatch, hostile raw clients, heartbeats and
 * timeouts, reconnect with backoff, key files, and a loop that closes cleanly every time. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
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

/* ---- a raw client: a plain blocking socket driven by hand ---- */

struct raw {
    int fd;
    rf_wire_reader r;
    Refit__Envelope *env[256];
    int n;
    int eof;
};

static int raw_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    struct raw *w = ctx;
    Refit__Envelope *e = refit__envelope__unpack(NULL, len, body);

    cr_assert_not_null(e, "the daemon sent an undecodable frame");
    if (w->n < 256)
        w->env[w->n++] = e;
    else
        refit__envelope__free_unpacked(e, NULL);
    return 0;
}

static void raw_open(struct raw *w, int port)
{
    struct sockaddr_in a;

    memset(w, 0, sizeof(*w));
    rf_wire_reader_init(&w->r, 0);
    w->fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(w->fd, 0);
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(w->fd, (struct sockaddr *)&a, sizeof(a)), 0);
}

static void raw_close(struct raw *w)
{
    for (int i = 0; i < w->n; i++)
        refit__envelope__free_unpacked(w->env[i], NULL);
    rf_wire_reader_reset(&w->r);
    close(w->fd);
}

static void raw_write(struct raw *w, const void *b, size_t n)
{
    cr_assert_eq(write(w->fd, b, n), (ssize_t)n);
}

static void raw_send(struct raw *w, const Refit__Envelope *env)
{
    uint8_t *buf;
    size_t len;

    cr_assert_eq(rf_wire_pack(&env->base, &buf, &len), 0);
    raw_write(w, buf, len);
    free(buf);
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

static void mac(const rf_peer_key *k, const uint8_t *challenger, const uint8_t *prover,
                Refit__Role role, uint8_t *out)
{
    crypto_auth_hmacsha256_state st;
    uint8_t r = (uint8_t)role;

    crypto_auth_hmacsha256_init(&st, k->bytes, k->len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)"refit-auth-v1", 13);
    crypto_auth_hmacsha256_update(&st, challenger, 32);
    crypto_auth_hmacsha256_update(&st, prover, 32);
    crypto_auth_hmacsha256_update(&st, &r, 1);
    crypto_auth_hmacsha256_final(&st, out);
}

/* The handshake written out from the protocol description, independently of peer.c; checks
 * the daemon's own Auth too. */
static void raw_handshake(struct raw *w, const rf_peer_key *k, Refit__Role daemon_role)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Hello h = REFIT__HELLO__INIT;
    Refit__Challenge ch = REFIT__CHALLENGE__INIT;
    Refit__Auth au = REFIT__AUTH__INIT;
    uint8_t nonce[32], m[32];

    cr_assert(raw_pump(w, 2, 3000));
    cr_assert_eq(w->env[0]->body_case, REFIT__ENVELOPE__BODY_HELLO);
    cr_assert_eq(w->env[0]->hello->protocol_version, RF_PEER_PROTOCOL_VERSION);
    cr_assert_eq(w->env[0]->hello->role, daemon_role);
    cr_assert_eq(w->env[1]->body_case, REFIT__ENVELOPE__BODY_CHALLENGE);
    cr_assert_eq(w->env[1]->challenge->nonce.len, 32);

    h.protocol_version = RF_PEER_PROTOCOL_VERSION;
    h.role = REFIT__ROLE__ROLE_RECEIVER;
    h.node = "raw";
    env.body_case = REFIT__ENVELOPE__BODY_HELLO;
    env.hello = &h;
    raw_send(w, &env);
    randombytes_buf(nonce, sizeof(nonce));
    ch.nonce.data = nonce;
    ch.nonce.len = 32;
    env.body_case = REFIT__ENVELOPE__BODY_CHALLENGE;
    env.challenge = &ch;
    raw_send(w, &env);
    mac(k, w->env[1]->challenge->nonce.data, nonce, REFIT__ROLE__ROLE_RECEIVER, m);
    au.mac.data = m;
    au.mac.len = 32;
    env.body_case = REFIT__ENVELOPE__BODY_AUTH;
    env.auth = &au;
    raw_send(w, &env);

    cr_assert(raw_pump(w, 3, 3000));
    cr_assert_eq(w->env[2]->body_case, REFIT__ENVELOPE__BODY_AUTH);
    mac(k, nonce, w->env[1]->challenge->nonce.data, daemon_role, m);
    cr_assert_eq(w->env[2]->auth->mac.len, 32);
    cr_assert_eq(memcmp(w->env[2]->auth->mac.data, m, 32), 0, "daemon's Auth is not "
                 "HMAC-SHA256(key, tag || our nonce || its nonce || its role)");
}

/* The last Error the raw client received, or NULL. */
static const char *raw_error(struct raw *w)
{
    for (int i = w->n - 1; i >= 0; i--)
        if (w->env[i]->body_case == REFIT__ENVELOPE__BODY_ERROR)
            return w->env[i]->error->message;
    return NULL;
}

enum bad_kind { BAD_OVERSIZED, BAD_GARBAGE, BAD_NO_BODY, BAD_START_FIRST, BAD_HTTP,
                BAD_START_AFTER_HELLO, BAD_AUTH_FIRST, BAD_SHORT_NONCE, BAD_WRONG_MAC,
                BAD_HELLO_AFTER_AUTH, BAD_NO_ROLE };

static const struct {
    enum bad_kind kind;
    const char *expect;
} bad_cases[] = {
    {BAD_OVERSIZED, "frame of 1048576 bytes exceeds the maximum of 65536 bytes"},
    {BAD_GARBAGE, "malformed frame: 5 bytes"},
    {BAD_NO_BODY, "frame without a message body"},
    {BAD_START_FIRST, "start received before authentication completed"},
    {BAD_HTTP, "exceeds the maximum"},
    {BAD_START_AFTER_HELLO, "start received before authentication completed"},
    {BAD_AUTH_FIRST, "Auth before Challenge"},
    {BAD_SHORT_NONCE, "Challenge nonce of 8 bytes, expected 32"},
    {BAD_WRONG_MAC, "authentication failed: cluster keys differ"},
    {BAD_HELLO_AFTER_AUTH, "hello after authentication completed"},
    {BAD_NO_ROLE, "has no valid role"},
};

static void send_bad(struct raw *w, enum bad_kind kind)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Hello h = REFIT__HELLO__INIT;
    Refit__Start st = REFIT__START__INIT;
    Refit__Challenge ch = REFIT__CHALLENGE__INIT;
    Refit__Auth au = REFIT__AUTH__INIT;
    uint8_t zeros[32] = {0};
    static const uint8_t big[4] = {0, 0x10, 0, 0};
    static const uint8_t garbage[9] = {0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff, 0xff};
    static const uint8_t empty[4] = {0, 0, 0, 0};

    h.protocol_version = RF_PEER_PROTOCOL_VERSION;
    h.role = REFIT__ROLE__ROLE_RECEIVER;
    h.node = "raw";
    st.version = 9;
    switch (kind) {
    case BAD_OVERSIZED:
        raw_write(w, big, 4);
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
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send(w, &env);
        /* fall through */
    case BAD_START_FIRST:
        env.body_case = REFIT__ENVELOPE__BODY_START;
        env.start = &st;
        raw_send(w, &env);
        break;
    case BAD_AUTH_FIRST:
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send(w, &env);
        au.mac.data = zeros;
        au.mac.len = 32;
        env.body_case = REFIT__ENVELOPE__BODY_AUTH;
        env.auth = &au;
        raw_send(w, &env);
        break;
    case BAD_SHORT_NONCE:
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send(w, &env);
        ch.nonce.data = zeros;
        ch.nonce.len = 8;
        env.body_case = REFIT__ENVELOPE__BODY_CHALLENGE;
        env.challenge = &ch;
        raw_send(w, &env);
        break;
    case BAD_WRONG_MAC:
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send(w, &env);
        zeros[0] = 1;
        ch.nonce.data = zeros;
        ch.nonce.len = 32;
        env.body_case = REFIT__ENVELOPE__BODY_CHALLENGE;
        env.challenge = &ch;
        raw_send(w, &env);
        au.mac.data = zeros;
        au.mac.len = 32;
        env.body_case = REFIT__ENVELOPE__BODY_AUTH;
        env.auth = &au;
        raw_send(w, &env);
        break;
    case BAD_HELLO_AFTER_AUTH:
        raw_handshake(w, &key1, REFIT__ROLE__ROLE_COORDINATOR);
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send(w, &env);
        break;
    case BAD_NO_ROLE:
        h.role = REFIT__ROLE__ROLE_UNKNOWN;
        env.body_case = REFIT__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        raw_send(w, &env);
        break;
    }
}

/* Every hostile client gets an Error naming its problem and is closed; the listener keeps
 * serving and a good peer still comes up after each. */
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

        raw_open(&w, rf_peer_listener_port(l));
        send_bad(&w, bad_cases[i].kind);
        cr_assert(raw_pump(&w, -1, 3000), "case %zu: not closed", i);
        msg = raw_error(&w);
        cr_assert_not_null(msg, "case %zu: no Error envelope", i);
        cr_assert(strstr(msg, bad_cases[i].expect), "case %zu: Error '%s', expected '%s'", i,
                  msg, bad_cases[i].expect);
        cr_assert(run_until(&L.down, downs + 1, 3000));
        cr_assert(strstr(L.down_reason, bad_cases[i].expect), "case %zu: reason '%s'", i,
                  L.down_reason);
        raw_close(&w);

        c = connect_to(&C, rf_peer_listener_port(l), &cc);
        cr_assert(run_until(&C.up, 1, 3000), "case %zu: good peer did not come up", i);
        cr_assert(run_until(&L.up, ups + 1 + (bad_cases[i].kind == BAD_HELLO_AFTER_AUTH), 3000));
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
    cfg.key = &shortkey;
    cr_assert_eq(rf_peer_listen(&loop, "127.0.0.1:0", &cfg, &l, &err), -EINVAL);
    cr_assert(strstr(err.msg, "cluster key"), "%s", err.msg);
    cr_assert_eq(rf_peer_connect(&loop, "127.0.0.1:1", &cfg, &c, &err), -EINVAL);
    cfg.key = &key1;

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

/* A client without the key cannot borrow the daemon's own proof: it reflects the daemon's
 * challenge of one connection as its challenge on a second connection, claims the daemon's
 * role, and replays the daemon's answer on the first. Both nonces are bound into the proof,
 * so this fails. */
Test(peer, reflected_challenge_does_not_authenticate)
{
    struct side L = {0};
    rf_peer_config lc = mkcfg(&L, &key1, REFIT__ROLE__ROLE_COORDINATOR, "coord");
    rf_peer_listener *l;
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Hello h = REFIT__HELLO__INIT;
    Refit__Challenge ch = REFIT__CHALLENGE__INIT;
    Refit__Auth au = REFIT__AUTH__INIT;
    struct raw a, b;
    uint8_t na[32];
    const char *msg;

    l = listen_on(&L, &key1, "127.0.0.1:0", &lc);
    raw_open(&a, rf_peer_listener_port(l));
    raw_open(&b, rf_peer_listener_port(l));
    cr_assert(raw_pump(&a, 2, 3000));
    cr_assert(raw_pump(&b, 2, 3000));
    cr_assert_eq(a.env[1]->body_case, REFIT__ENVELOPE__BODY_CHALLENGE);
    h.protocol_version = RF_PEER_PROTOCOL_VERSION;
    h.role = REFIT__ROLE__ROLE_COORDINATOR;
    h.node = "mirror";
    env.body_case = REFIT__ENVELOPE__BODY_HELLO;
    env.hello = &h;
    raw_send(&a, &env);
    raw_send(&b, &env);
    randombytes_buf(na, sizeof(na));
    ch.nonce.data = na;
    ch.nonce.len = sizeof(na);
    env.body_case = REFIT__ENVELOPE__BODY_CHALLENGE;
    env.challenge = &ch;
    raw_send(&a, &env);
    ch.nonce = a.env[1]->challenge->nonce;
    raw_send(&b, &env);
    cr_assert(raw_pump(&b, 3, 3000), "the daemon did not answer the reflected challenge");
    cr_assert_eq(b.env[2]->body_case, REFIT__ENVELOPE__BODY_AUTH);
    au.mac = b.env[2]->auth->mac;
    env.body_case = REFIT__ENVELOPE__BODY_AUTH;
    env.auth = &au;
    raw_send(&a, &env);
    cr_assert(raw_pump(&a, -1, 3000), "connection with a reflected proof not closed");
    msg = raw_error(&a);
    cr_assert_not_null(msg);
    cr_assert(strstr(msg, "authentication failed"), "%s", msg);
    cr_assert_eq(L.up, 0, "a peer without the key came up");
    raw_close(&a);
    raw_close(&b);
    rf_peer_listener_close(l);
    finish();
}
