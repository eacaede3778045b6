/* common/control/peer.c - authenticated control connections between daemons: handshake (Hello, then
 * an HMAC-SHA256 challenge/response over the cluster key in which the connector proves first),
 * a keyed MAC and sequence number on every later frame, heartbeats, dead-peer detection, a
 * listener and a reconnecting connector. */
#include "peer.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "addr.h"
#include "admit.h"
#include "macros.h"
#include "wire.h"


/* How long a closing connection may take to flush its last frames before it is cut. */
#define PEER_LINGER_MAX_MS 2000

/* What a listener or connector hands to each of its connections; owned by that owner. */
struct peer_settings {
    uv_loop_t *loop;
    rf_peer_key key;
    Refit__Role role;
    char *node;
    uint64_t daemon_id;
    char *data_addr;
    char *host_id, *local_sock;
    uint32_t index;
    uint32_t version;
    uint32_t max_frame;
    uint32_t max_pending;
    uint64_t heartbeat_ms, timeout_ms, backoff_min_ms, backoff_max_ms;
    rf_peer_callbacks cb;
    void *data;
};

struct rf_peer {
    uv_tcp_t tcp;
    uv_timer_t timer;           /* heartbeats, timeouts, and the linger of a closing peer */
    uv_connect_t connect_req;
    uv_shutdown_t shutdown_req;
    rf_wire_stream ws;
    const struct peer_settings *set;
    rf_peer_listener *listener; /* exactly one of listener and connector is set */
    rf_peer_connector *connector;
    rf_peer *next, **pprev;     /* the listener's list */
    rf_admit_entry adm;         /* in its listener's table while in its handshake */
    int open_handles;
    int established;            /* TCP connected or accepted: on_down will be called */
    int challenged;             /* the peer's Challenge arrived (a connector then proved) */
    int up;                     /* both proofs checked: frames carry seq and MAC from now on */
    int closing;                /* no more reads or sends; waiting for shutdown or linger */
    int handles_closing;
    uint8_t nonce[RF_PEER_NONCE_BYTES];       /* ours, sent in our Challenge */
    uint8_t their_nonce[RF_PEER_NONCE_BYTES]; /* from their Challenge */
    uint8_t my_hello[crypto_generichash_BYTES];    /* BLAKE2b of the Hello frame we sent */
    uint8_t their_hello[crypto_generichash_BYTES]; /* and of the one we received */
    uint8_t tx_key[RF_PEER_MAC_BYTES];        /* frame MAC keys of this connection, per direction */
    uint8_t rx_key[RF_PEER_MAC_BYTES];
    uint64_t tx_seq, rx_seq;    /* the last frame sent / received with a MAC */
    Refit__Envelope *hello_env; /* the peer's Hello, owned here until the peer is freed */
    uint64_t t_start;           /* TCP up: the handshake deadline counts from here */
    uint64_t last_rx;
    uint64_t hb_seq;
    char remote[320];
    char reason[512];
    char peer_error[256];       /* the last Error message the peer sent */
    void *data;
};

struct rf_peer_listener {
    uv_tcp_t tcp;
    struct peer_settings set;
    rf_peer *peers;
    rf_admit pending;           /* accepted connections in their handshake, not closing */
    int port;
    int closing;
    int tcp_closed;
    rf_admit_src srcs[];        /* max_pending: the sources of pending */
};

struct rf_peer_connector {
    uv_timer_t retry;
    uv_getaddrinfo_t gai;
    struct peer_settings set;
    char addr[300];
    rf_addr to;
    rf_peer *cur;
    uint64_t backoff;
    int gai_pending;
    int closing;
    int retry_closed;
};

/* ---- settings ---- */

static int settings_init(struct peer_settings *s, uv_loop_t *loop, const rf_peer_config *cfg,
                         rf_err *err)
{
    memset(s, 0, sizeof(*s));
    if (cfg->key == NULL || cfg->key->len < RF_PEER_KEY_MIN || cfg->key->len > RF_PEER_KEY_MAX)
        return rf_err_set(err, -EINVAL, "peer config: cluster key missing or not %d..%d bytes; "
                          "load it with rf_peer_load_key", RF_PEER_KEY_MIN, RF_PEER_KEY_MAX);
    if (sodium_init() < 0)
        return rf_err_set(err, -EIO, "libsodium failed to initialise (no entropy source?)");
    /* Our Hello must fit the small frames a peer accepts before authentication. */
    if ((cfg->node && strlen(cfg->node) > RF_PEER_HELLO_STR_MAX) ||
        (cfg->data_addr && strlen(cfg->data_addr) > RF_PEER_HELLO_STR_MAX) ||
        (cfg->host_id && strlen(cfg->host_id) > RF_PEER_HELLO_STR_MAX) ||
        (cfg->local_sock && strlen(cfg->local_sock) > RF_PEER_HELLO_STR_MAX))
        return rf_err_set(err, -EINVAL, "peer config: node name, data address, host id or "
                          "socket path longer than %d bytes; choose a shorter one",
                          RF_PEER_HELLO_STR_MAX);
    s->loop = loop;
    s->key = *cfg->key;
    s->role = cfg->role;
    s->node = strdup(cfg->node ? cfg->node : "");
    s->data_addr = strdup(cfg->data_addr ? cfg->data_addr : "");
    s->host_id = strdup(cfg->host_id ? cfg->host_id : "");
    s->local_sock = strdup(cfg->local_sock ? cfg->local_sock : "");
    if (s->node == NULL || s->data_addr == NULL || s->host_id == NULL || s->local_sock == NULL) {
        free(s->node);
        free(s->data_addr);
        free(s->host_id);
        free(s->local_sock);
        sodium_memzero(&s->key, sizeof(s->key));
        return rf_err_set(err, -ENOMEM, "peer config: out of memory");
    }
    s->daemon_id = cfg->daemon_id;
    s->index = cfg->index;
    s->version = cfg->protocol_version ? cfg->protocol_version : RF_PEER_PROTOCOL_VERSION;
    s->max_frame = cfg->max_frame ? cfg->max_frame : RF_WIRE_MAX_DEFAULT;
    s->max_pending = cfg->max_pending ? cfg->max_pending : RF_PEER_MAX_PENDING_DEFAULT;
    s->heartbeat_ms = cfg->heartbeat_ms ? cfg->heartbeat_ms : RF_PEER_HEARTBEAT_MS_DEFAULT;
    s->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : RF_PEER_TIMEOUT_MS_DEFAULT;
    s->backoff_min_ms = cfg->backoff_min_ms ? cfg->backoff_min_ms : RF_PEER_BACKOFF_MIN_MS_DEFAULT;
    s->backoff_max_ms = cfg->backoff_max_ms ? cfg->backoff_max_ms : RF_PEER_BACKOFF_MAX_MS_DEFAULT;
    if (s->backoff_max_ms < s->backoff_min_ms)
        s->backoff_max_ms = s->backoff_min_ms;
    s->cb = cfg->cb;
    s->data = cfg->data;
    return 0;
}

static void settings_free(struct peer_settings *s)
{
    free(s->node);
    free(s->data_addr);
    free(s->host_id);
    free(s->local_sock);
    sodium_memzero(&s->key, sizeof(s->key));
}

/* ---- key ---- */

int rf_peer_load_key(const char *path, rf_peer_key *key, rf_err *err)
{
    struct stat st;
    uint8_t buf[RF_PEER_KEY_MAX + 1];
    ssize_t n;
    size_t len = 0;
    int fd = -1, rc = 0, text = 1;

    key->len = 0;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = rf_err_set(err, -errno, "cannot open cluster key file %s: %s; create the same "
                        "file on every node (head -c 32 /dev/urandom > %s; chmod 600 %s)",
                        path, strerror(errno), path, path);
        goto out;
    }
    if (fstat(fd, &st) < 0) {
        rc = rf_err_set(err, -errno, "cannot stat cluster key file %s: %s", path,
                        strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = rf_err_set(err, -EINVAL, "cluster key file %s is not a regular file", path);
        goto out;
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        rc = rf_err_set(err, -EPERM, "cluster key file %s has mode %04o: group or others may "
                        "access it; run chmod 600 %s", path, (unsigned)(st.st_mode & 07777),
                        path);
        goto out;
    }
    while (len < sizeof(buf)) {
        n = read(fd, buf + len, sizeof(buf) - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rc = rf_err_set(err, -errno, "cannot read cluster key file %s: %s", path,
                            strerror(errno));
            goto out;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    if (len > RF_PEER_KEY_MAX) {
        rc = rf_err_set(err, -EINVAL, "cluster key file %s is longer than %d bytes; it should "
                        "hold one key (e.g. 32 random bytes)", path, RF_PEER_KEY_MAX);
        goto out;
    }
    for (size_t i = 0; i < len; i++)
        if (!(buf[i] >= 0x20 && buf[i] < 0x7f) && buf[i] != '\n' && buf[i] != '\r' &&
            buf[i] != '\t')
            text = 0;
    if (text)
        while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r' ||
                           buf[len - 1] == ' ' || buf[len - 1] == '\t'))
            len--;
    if (len < RF_PEER_KEY_MIN) {
        rc = rf_err_set(err, -EINVAL, "cluster key file %s holds %zu bytes; a key needs at "
                        "least %d (head -c 32 /dev/urandom > %s)", path, len, RF_PEER_KEY_MIN,
                        path);
        goto out;
    }
    memcpy(key->bytes, buf, len);
    key->len = len;
out:
    sodium_memzero(buf, sizeof(buf));
    if (fd >= 0)
        close(fd);
    return rc;
}

/* ---- one connection ---- */

static void connector_peer_gone(rf_peer_connector *c, rf_peer *p);
static void listener_peer_gone(rf_peer_listener *l, rf_peer *p);
static void peer_tick(uv_timer_t *t);

static const char *body_name(Refit__Envelope__BodyCase bc)
{
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field(&refit__envelope__descriptor, (unsigned)bc);

    return f ? f->name : "unknown message";
}

static void peer_set_reason(rf_peer *p, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void peer_set_reason(rf_peer *p, const char *fmt, ...)
{
    va_list ap;

    if (p->reason[0])
        return;
    va_start(ap, fmt);
    vsnprintf(p->reason, sizeof(p->reason), fmt, ap);
    va_end(ap);
}

/* The connection left its handshake (it came up, or it is closing): it no longer counts
 * against its listener's limit. */
static void peer_unpend(rf_peer *p)
{
    if (p->listener)
        rf_admit_remove(&p->listener->pending, &p->adm);
}

static void peer_release(rf_peer *p)
{
    if (--p->open_handles > 0)
        return;
    peer_unpend(p);
    if (p->established && p->set->cb.on_down)
        p->set->cb.on_down(p, p->reason[0] ? p->reason : "closed");
    if (p->hello_env)
        refit__envelope__free_unpacked(p->hello_env, NULL);
    if (p->listener)
        listener_peer_gone(p->listener, p);
    else
        connector_peer_gone(p->connector, p);
    sodium_memzero(p->tx_key, sizeof(p->tx_key));
    sodium_memzero(p->rx_key, sizeof(p->rx_key));
    free(p);
}

static void peer_tcp_closed(uv_handle_t *h)
{
    peer_release(container_of((uv_tcp_t *)h, rf_peer, tcp));
}

static void peer_timer_closed(uv_handle_t *h)
{
    peer_release(container_of((uv_timer_t *)h, rf_peer, timer));
}

/* Closes both handles now; pending writes are cancelled. */
static void peer_close_now(rf_peer *p)
{
    if (p->handles_closing)
        return;
    p->handles_closing = 1;
    p->closing = 1;
    peer_unpend(p);
    rf_wire_read_stop(&p->ws);
    uv_close((uv_handle_t *)&p->tcp, peer_tcp_closed);
    uv_close((uv_handle_t *)&p->timer, peer_timer_closed);
}

static void peer_shutdown_done(uv_shutdown_t *req, int status)
{
    (void)status;
    peer_close_now(container_of(req, rf_peer, shutdown_req));
}

/* Stops reading and lets queued frames (an Error, say) go out before closing; the timer cuts
 * the wait short if the other end does not take them. */
static void peer_linger_close(rf_peer *p)
{
    uint64_t linger = p->set->timeout_ms < PEER_LINGER_MAX_MS ? p->set->timeout_ms
                                                               : PEER_LINGER_MAX_MS;

    if (p->closing)
        return;
    p->closing = 1;
    peer_unpend(p);
    if (!p->established) {
        peer_close_now(p);
        return;
    }
    rf_wire_read_stop(&p->ws);
    uv_timer_start(&p->timer, peer_tick, linger, 0);
    if (uv_shutdown(&p->shutdown_req, (uv_stream_t *)&p->tcp, peer_shutdown_done) < 0)
        peer_close_now(p);
}

static void peer_write_done(void *ctx, int status)
{
    rf_peer *p = ctx;

    if (status < 0 && status != UV_ECANCELED && !p->closing) {
        peer_set_reason(p, "write to %s failed: %s", p->remote, uv_strerror(status));
        peer_close_now(p);
    }
}

/* The bytes that end every frame after the handshake: protobuf field 15 (Envelope.mac),
 * length-delimited, 32 bytes. */
#define PEER_MAC_FIELD 0x7a
#define PEER_MAC_TRAILER (2 + RF_PEER_MAC_BYTES)

/* Before the handshake completes frames go out as they are. After it, each carries the next
 * sequence number of its direction and ends with a BLAKE2b MAC, keyed for this connection and
 * direction, over the frame's bytes before it: an on-path attacker can then neither forge,
 * alter, replay, reorder nor drop a frame (a Commit, say) unnoticed, and a frame cannot be
 * moved to another connection or sent back the other way. */
static int peer_write(rf_peer *p, const Refit__Envelope *env)
{
    Refit__Envelope e;
    uint8_t *buf, *body;
    size_t len, blen;
    int rc;

    if (!p->up)
        return rf_wire_write((uv_stream_t *)&p->tcp, &env->base, peer_write_done, p);
    e = *env;
    e.mac.data = NULL;
    e.mac.len = 0;
    e.seq = p->tx_seq + 1;
    rc = rf_wire_pack_tail(&e.base, PEER_MAC_TRAILER, &buf, &len);
    if (rc < 0)
        return rc;
    body = buf + 4;
    blen = len - 4 - PEER_MAC_TRAILER;
    body[blen] = PEER_MAC_FIELD;
    body[blen + 1] = RF_PEER_MAC_BYTES;
    crypto_generichash(body + blen + 2, RF_PEER_MAC_BYTES, body, blen, p->tx_key,
                       sizeof(p->tx_key));
    rc = rf_wire_write_buf((uv_stream_t *)&p->tcp, buf, len, peer_write_done, p);
    if (rc < 0) {
        /* The peer would see a gap in the sequence; the stream is broken anyway. */
        if (!p->closing) {
            peer_set_reason(p, "cannot write to %s: %s", p->remote, uv_strerror(rc));
            peer_close_now(p);
        }
        return rc;
    }
    p->tx_seq++;
    return 0;
}

/* Tells the peer what was wrong with an Error frame, records the same words as the reason,
 * and closes the connection once the Error is out. */
static void peer_fail(rf_peer *p, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void peer_fail(rf_peer *p, int code, const char *fmt, ...)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Error e = REFIT__ERROR__INIT;
    char msg[512];
    va_list ap;

    if (p->closing)
        return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    peer_set_reason(p, "%s", msg);
    e.code = code;
    e.message = msg;
    env.body_case = REFIT__ENVELOPE__BODY_ERROR;
    env.error = &e;
    peer_write(p, &env);
    peer_linger_close(p);
}

/* The handshake of protocol 3 (proto/refit.proto has the formulas). The connector proves
 * first and the acceptor answers only a proof it has checked: the old symmetric exchange made
 * the acceptor compute its proof for whoever sent it a Challenge, which a client without the
 * key could reflect through a second connection. The transcript T binds both Hellos (roles,
 * ids, addresses) and both nonces, and every use of the key has its own label, so a proof is
 * worth nothing on another connection, in the other direction, or as a frame key. */
static const char lbl_connector[] = "refit-ctl-v3/connector-proof";
static const char lbl_acceptor[] = "refit-ctl-v3/acceptor-proof";
static const char lbl_c2a[] = "refit-ctl-v3/frames-c2a";
static const char lbl_a2c[] = "refit-ctl-v3/frames-a2c";

#define PEER_T_BYTES (2 * crypto_generichash_BYTES + 2 * RF_PEER_NONCE_BYTES)

/* T = BLAKE2b(connector's Hello) || nonce_c || BLAKE2b(acceptor's Hello) || nonce_a. */
static void peer_transcript(const rf_peer *p, uint8_t *t)
{
    int conn = p->connector != NULL;

    memcpy(t, conn ? p->my_hello : p->their_hello, crypto_generichash_BYTES);
    t += crypto_generichash_BYTES;
    memcpy(t, conn ? p->nonce : p->their_nonce, RF_PEER_NONCE_BYTES);
    t += RF_PEER_NONCE_BYTES;
    memcpy(t, conn ? p->their_hello : p->my_hello, crypto_generichash_BYTES);
    t += crypto_generichash_BYTES;
    memcpy(t, conn ? p->their_nonce : p->nonce, RF_PEER_NONCE_BYTES);
}

/* HMAC-SHA256(key, label || 0 || T). */
static void peer_hmac(const rf_peer_key *k, const char *label, const uint8_t *t, uint8_t *out)
{
    crypto_auth_hmacsha256_state st;

    crypto_auth_hmacsha256_init(&st, k->bytes, k->len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, strlen(label) + 1);
    crypto_auth_hmacsha256_update(&st, t, PEER_T_BYTES);
    crypto_auth_hmacsha256_final(&st, out);
    sodium_memzero(&st, sizeof(st));
}

static void peer_send_auth(rf_peer *p, const uint8_t *mac)
{
    Refit__Envelope out = REFIT__ENVELOPE__INIT;
    Refit__Auth auth = REFIT__AUTH__INIT;

    auth.mac.data = (uint8_t *)mac;
    auth.mac.len = RF_PEER_MAC_BYTES;
    out.body_case = REFIT__ENVELOPE__BODY_AUTH;
    out.auth = &auth;
    peer_write(p, &out);
}

/* Both proofs are checked: derive the frame keys, take large frames from now on, and tell
 * the owner. */
static void peer_come_up(rf_peer *p, const uint8_t *t)
{
    const struct peer_settings *s = p->set;
    int conn = p->connector != NULL;

    peer_hmac(&s->key, conn ? lbl_c2a : lbl_a2c, t, p->tx_key);
    peer_hmac(&s->key, conn ? lbl_a2c : lbl_c2a, t, p->rx_key);
    p->up = 1;
    peer_unpend(p);
    rf_wire_reader_set_max(&p->ws.reader, s->max_frame);
    /* Heartbeats from now on; until here the timer held the handshake deadline. */
    uv_timer_start(&p->timer, peer_tick, s->heartbeat_ms, s->heartbeat_ms);
    if (p->connector)
        p->connector->backoff = s->backoff_min_ms;
    if (s->cb.on_up)
        s->cb.on_up(p, p->hello_env->hello);
}

static const char auth_failed[] =
    "authentication failed: cluster keys differ (check cluster_key_file on both nodes)";

/* Handles one frame (env, decoded from body) before authentication completed. Returns 1 when
 * env was kept. */
static int peer_handshake(rf_peer *p, Refit__Envelope *env, const uint8_t *body, uint32_t len)
{
    const struct peer_settings *s = p->set;
    uint8_t t[PEER_T_BYTES], mac[RF_PEER_MAC_BYTES];

    switch (env->body_case) {
    case REFIT__ENVELOPE__BODY_HELLO: {
        Refit__Hello *h = env->hello;

        if (p->hello_env) {
            peer_fail(p, -EPROTO, "protocol error: second Hello on one connection");
            return 0;
        }
        if (h->protocol_version != s->version) {
            peer_fail(p, -EPROTONOSUPPORT, "protocol version mismatch: node '%s' speaks "
                      "version %" PRIu32 ", node '%s' speaks version %" PRIu32 "; run the same "
                      "refit release on every node", s->node, s->version, h->node,
                      h->protocol_version);
            return 0;
        }
        if (h->role != REFIT__ROLE__ROLE_PUBLISHER && h->role != REFIT__ROLE__ROLE_RECEIVER &&
            h->role != REFIT__ROLE__ROLE_COORDINATOR) {
            peer_fail(p, -EPROTO, "protocol error: Hello from node '%s' has no valid role (%d)",
                      h->node, (int)h->role);
            return 0;
        }
        crypto_generichash(p->their_hello, sizeof(p->their_hello), body, len, NULL, 0);
        p->hello_env = env;
        return 1;
    }
    case REFIT__ENVELOPE__BODY_CHALLENGE:
        if (p->hello_env == NULL) {
            peer_fail(p, -EPROTO, "protocol error: Challenge before Hello");
            return 0;
        }
        if (p->challenged) {
            peer_fail(p, -EPROTO, "protocol error: second Challenge on one connection");
            return 0;
        }
        if (env->challenge->nonce.len != RF_PEER_NONCE_BYTES) {
            peer_fail(p, -EPROTO, "protocol error: Challenge nonce of %zu bytes, expected %d",
                      env->challenge->nonce.len, RF_PEER_NONCE_BYTES);
            return 0;
        }
        /* Our own nonce coming back is someone replaying our challenge at us. */
        if (memcmp(env->challenge->nonce.data, p->nonce, RF_PEER_NONCE_BYTES) == 0) {
            peer_fail(p, -EPROTO, "protocol error: Challenge repeats our own nonce");
            return 0;
        }
        memcpy(p->their_nonce, env->challenge->nonce.data, RF_PEER_NONCE_BYTES);
        p->challenged = 1;
        /* The connector proves first; an acceptor waits for that proof. */
        if (p->connector) {
            peer_transcript(p, t);
            peer_hmac(&s->key, lbl_connector, t, mac);
            peer_send_auth(p, mac);
        }
        break;
    case REFIT__ENVELOPE__BODY_AUTH:
        if (!p->challenged) {
            peer_fail(p, -EPROTO, "protocol error: Auth before Challenge");
            return 0;
        }
        if (env->auth->mac.len != RF_PEER_MAC_BYTES) {
            peer_fail(p, -EPROTO, "protocol error: Auth of %zu bytes, expected %d",
                      env->auth->mac.len, RF_PEER_MAC_BYTES);
            return 0;
        }
        peer_transcript(p, t);
        if (p->connector) {
            peer_hmac(&s->key, lbl_acceptor, t, mac);
            if (crypto_verify_32(env->auth->mac.data, mac) != 0) {
                peer_fail(p, -EACCES, "authentication failed: %s answered with a wrong proof "
                          "of the cluster key: keys differ, or it is not a refit daemon of "
                          "this cluster (check cluster_key_file and coordinator_addr)",
                          p->remote);
                break;
            }
        } else {
            peer_hmac(&s->key, lbl_connector, t, mac);
            if (crypto_verify_32(env->auth->mac.data, mac) != 0) {
                peer_fail(p, -EACCES, "%s", auth_failed);
                break;
            }
            /* Only now, to a peer that showed the key, does the acceptor prove it too. */
            peer_hmac(&s->key, lbl_acceptor, t, mac);
            peer_send_auth(p, mac);
        }
        peer_come_up(p, t);
        break;
    case REFIT__ENVELOPE__BODY_ERROR:
        peer_set_reason(p, "rejected by peer %s: %s", p->remote,
                        env->error->message ? env->error->message : "");
        peer_close_now(p);
        return 0;
    case REFIT__ENVELOPE__BODY__NOT_SET:
        peer_fail(p, -EPROTO, "protocol error: frame without a message body (unknown message "
                  "type? run the same refit release on every node)");
        return 0;
    default:
        peer_fail(p, -EPROTO, "protocol error: %s received before authentication completed; "
                  "only Hello, Challenge, Auth and Error are allowed until then",
                  body_name(env->body_case));
        return 0;
    }
    sodium_memzero(t, sizeof(t));
    sodium_memzero(mac, sizeof(mac));
    return 0;
}

/* After the handshake: checks the frame's MAC (before decoding anything) and leaves the
 * length of the frame without it in *len. 0, or the code peer_fail was given. */
static int peer_check_mac(rf_peer *p, const uint8_t *body, uint32_t *len)
{
    uint8_t tag[RF_PEER_MAC_BYTES];
    uint32_t blen;

    if (*len < PEER_MAC_TRAILER || body[*len - PEER_MAC_TRAILER] != PEER_MAC_FIELD ||
        body[*len - PEER_MAC_TRAILER + 1] != RF_PEER_MAC_BYTES) {
        peer_fail(p, -EBADMSG, "frame %" PRIu64 " from %s carries no MAC, which every frame "
                  "after the handshake must end with (injected on the way?); closing the "
                  "connection", p->rx_seq + 1, p->remote);
        return -EBADMSG;
    }
    blen = *len - PEER_MAC_TRAILER;
    crypto_generichash(tag, sizeof(tag), body, blen, p->rx_key, sizeof(p->rx_key));
    if (crypto_verify_32(tag, body + blen + 2) != 0) {
        peer_fail(p, -EBADMSG, "frame %" PRIu64 " from %s failed its MAC check: altered on "
                  "the way, or not sent by the authenticated peer; closing the connection",
                  p->rx_seq + 1, p->remote);
        return -EBADMSG;
    }
    *len = blen;
    return 0;
}

static int peer_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    rf_peer *p = ctx;
    Refit__Envelope *env;
    int kept = 0, rc;

    if (p->closing)
        return -ECANCELED;
    p->last_rx = uv_now(p->set->loop);
    if (p->up && (rc = peer_check_mac(p, body, &len)) < 0)
        return rc;
    env = refit__envelope__unpack(NULL, len, body);
    if (env == NULL) {
        peer_fail(p, -EBADMSG, "malformed frame: %" PRIu32 " bytes that do not decode as a "
                  "refit Envelope", len);
        return -EBADMSG;
    }
    if (!p->up) {
        kept = peer_handshake(p, env, body, len);
    } else if (env->seq != p->rx_seq + 1) {
        if (env->seq <= p->rx_seq)
            peer_fail(p, -EPROTO, "replayed frame from %s: sequence %" PRIu64 " came before "
                      "(expected %" PRIu64 "); closing the connection", p->remote, env->seq,
                      p->rx_seq + 1);
        else
            peer_fail(p, -EPROTO, "frame from %s has sequence %" PRIu64 ", expected %" PRIu64
                      ": frames were dropped or reordered on the way; closing the connection",
                      p->remote, env->seq, p->rx_seq + 1);
    } else {
        p->rx_seq = env->seq;
        switch (env->body_case) {
        case REFIT__ENVELOPE__BODY_HEARTBEAT:
            break;
        case REFIT__ENVELOPE__BODY_HELLO:
        case REFIT__ENVELOPE__BODY_CHALLENGE:
        case REFIT__ENVELOPE__BODY_AUTH:
            peer_fail(p, -EPROTO, "protocol error: %s after authentication completed",
                      body_name(env->body_case));
            break;
        case REFIT__ENVELOPE__BODY__NOT_SET:
            peer_fail(p, -EPROTO, "protocol error: frame without a message body (unknown "
                      "message type? run the same refit release on every node)");
            break;
        case REFIT__ENVELOPE__BODY_ERROR:
            /* Remembered for the reason when the peer then hangs up; the owner sees it too. */
            snprintf(p->peer_error, sizeof(p->peer_error), "%s",
                     env->error->message ? env->error->message : "");
            if (p->set->cb.on_envelope)
                p->set->cb.on_envelope(p, env);
            break;
        default:
            if (p->set->cb.on_envelope)
                p->set->cb.on_envelope(p, env);
            break;
        }
    }
    if (!kept)
        refit__envelope__free_unpacked(env, NULL);
    return p->closing ? -ECANCELED : 0;
}

static void peer_read_error(void *ctx, int err)
{
    rf_peer *p = ctx;

    if (p->closing)
        return;
    if (err == -EMSGSIZE && !p->up) {
        peer_fail(p, -EMSGSIZE, "frame of %" PRIu32 " bytes exceeds the maximum of %" PRIu32
                  " bytes before authentication (Hello, Challenge and Auth are small)",
                  p->ws.reader.body_len, p->ws.reader.max);
        return;
    }
    if (err == -EMSGSIZE) {
        peer_fail(p, -EMSGSIZE, "frame of %" PRIu32 " bytes exceeds the maximum of %" PRIu32
                  " bytes", p->ws.reader.body_len, p->ws.reader.max);
        return;
    }
    if (err == UV_EOF && p->peer_error[0])
        peer_set_reason(p, "peer %s closed the connection after reporting: %s", p->remote,
                        p->peer_error);
    else if (err == UV_EOF)
        peer_set_reason(p, "connection closed by peer %s", p->remote);
    else if (err == -ENOMEM)
        peer_set_reason(p, "out of memory for a frame of %" PRIu32 " bytes from %s",
                        p->ws.reader.body_len, p->remote);
    else
        peer_set_reason(p, "read from %s failed: %s", p->remote, uv_strerror(err));
    peer_close_now(p);
}

static void peer_tick(uv_timer_t *t)
{
    rf_peer *p = container_of(t, rf_peer, timer);
    const struct peer_settings *s = p->set;
    uint64_t now = uv_now(s->loop), idle = now - p->last_rx;

    if (p->closing) {
        /* The linger ran out: the other end did not take our last frames. */
        peer_close_now(p);
        return;
    }
    /* The handshake has one deadline from the moment TCP came up, however the peer paces its
     * frames or drips a frame's bytes. */
    if (p->established && !p->up) {
        if (now - p->t_start < s->timeout_ms) {
            uv_timer_start(&p->timer, peer_tick, s->timeout_ms - (now - p->t_start), 0);
            return;
        }
        peer_set_reason(p, "handshake with %s not completed within %" PRIu64 " ms", p->remote,
                        s->timeout_ms);
        peer_close_now(p);
        return;
    }
    if (idle < s->timeout_ms) {
        if (p->up) {
            Refit__Envelope env = REFIT__ENVELOPE__INIT;
            Refit__Heartbeat hb = REFIT__HEARTBEAT__INIT;

            hb.seq = ++p->hb_seq;
            env.body_case = REFIT__ENVELOPE__BODY_HEARTBEAT;
            env.heartbeat = &hb;
            peer_write(p, &env);
        }
        return;
    }
    if (!p->established)
        peer_set_reason(p, "connect to %s timed out after %" PRIu64 " ms", p->remote, idle);
    else
        peer_set_reason(p, "heartbeat timeout: no frame from %s for %" PRIu64 " ms (limit %"
                        PRIu64 " ms); peer presumed dead", p->remote, idle, s->timeout_ms);
    peer_close_now(p);
}

static rf_peer *peer_new(const struct peer_settings *s)
{
    rf_peer *p = calloc(1, sizeof(*p));

    if (p == NULL)
        return NULL;
    p->set = s;
    p->data = s->data;
    uv_tcp_init(s->loop, &p->tcp);
    uv_timer_init(s->loop, &p->timer);
    p->open_handles = 2;
    p->last_rx = uv_now(s->loop);
    return p;
}

static void peer_describe_remote(rf_peer *p)
{
    struct sockaddr_storage ss;
    int len = sizeof(ss);
    char ip[INET6_ADDRSTRLEN] = "?";
    int port = 0;

    if (uv_tcp_getpeername(&p->tcp, (struct sockaddr *)&ss, &len) != 0)
        return;
    if (ss.ss_family == AF_INET) {
        uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof(ip));
        port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        snprintf(p->remote, sizeof(p->remote), "%s:%d", ip, port);
    } else if (ss.ss_family == AF_INET6) {
        uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof(ip));
        port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
        snprintf(p->remote, sizeof(p->remote), "[%s]:%d", ip, port);
    }
}

/* The TCP connection exists: send Hello and our Challenge, start reading (small frames until
 * the handshake is done) and the handshake deadline. */
static void peer_start(rf_peer *p)
{
    const struct peer_settings *s = p->set;
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Hello hello = REFIT__HELLO__INIT;
    Refit__Challenge ch = REFIT__CHALLENGE__INIT;
    uint8_t *buf;
    size_t len;
    int rc;

    p->established = 1;
    p->t_start = p->last_rx = uv_now(s->loop);
    peer_describe_remote(p);
    uv_tcp_nodelay(&p->tcp, 1);
    rc = rf_wire_read_start(&p->ws, (uv_stream_t *)&p->tcp,
                            s->max_frame < RF_PEER_PREAUTH_FRAME_MAX ? s->max_frame
                                                                     : RF_PEER_PREAUTH_FRAME_MAX,
                            peer_frame, peer_read_error, p);
    if (rc < 0) {
        peer_set_reason(p, "cannot read from %s: %s", p->remote, uv_strerror(rc));
        peer_close_now(p);
        return;
    }
    randombytes_buf(p->nonce, sizeof(p->nonce));
    hello.protocol_version = s->version;
    hello.role = s->role;
    hello.node = s->node;
    hello.daemon_id = s->daemon_id;
    hello.data_addr = s->data_addr;
    hello.host_id = s->host_id;
    hello.local_sock = s->local_sock;
    hello.index = s->index;
    env.body_case = REFIT__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    /* Packed here so that the proofs bind exactly the bytes the peer receives. */
    rc = rf_wire_pack(&env.base, &buf, &len);
    if (rc == 0) {
        crypto_generichash(p->my_hello, sizeof(p->my_hello), buf + 4, len - 4, NULL, 0);
        rc = rf_wire_write_buf((uv_stream_t *)&p->tcp, buf, len, peer_write_done, p);
    }
    if (rc == 0) {
        ch.nonce.data = p->nonce;
        ch.nonce.len = sizeof(p->nonce);
        env.body_case = REFIT__ENVELOPE__BODY_CHALLENGE;
        env.challenge = &ch;
        rc = peer_write(p, &env);
    }
    if (rc < 0) {
        peer_set_reason(p, "cannot write to %s: %s", p->remote, uv_strerror(rc));
        peer_close_now(p);
        return;
    }
    uv_timer_start(&p->timer, peer_tick, s->timeout_ms, 0);
}

int rf_peer_send(rf_peer *p, const Refit__Envelope *env)
{
    if (!p->up || p->closing)
        return -ENOTCONN;
    if (env->body_case == REFIT__ENVELOPE__BODY__NOT_SET)
        return -EINVAL;
    return peer_write(p, env);
}

void rf_peer_close(rf_peer *p, const char *reason)
{
    peer_set_reason(p, "%s", reason ? reason : "closed by this daemon");
    peer_linger_close(p);
}

const Refit__Hello *rf_peer_hello(const rf_peer *p)
{
    return p->hello_env ? p->hello_env->hello : NULL;
}

int rf_peer_is_up(const rf_peer *p)
{
    return p->up && !p->closing;
}

const char *rf_peer_remote(const rf_peer *p)
{
    return p->remote;
}

rf_peer_connector *rf_peer_connector_of(const rf_peer *p)
{
    return p->connector;
}

void *rf_peer_data(const rf_peer *p)
{
    return p->data;
}

void rf_peer_set_data(rf_peer *p, void *data)
{
    p->data = data;
}

/* ---- listener ---- */

static void listener_maybe_free(rf_peer_listener *l)
{
    if (!l->closing || !l->tcp_closed || l->peers != NULL)
        return;
    settings_free(&l->set);
    free(l);
}

static void listener_tcp_closed(uv_handle_t *h)
{
    rf_peer_listener *l = container_of((uv_tcp_t *)h, rf_peer_listener, tcp);

    l->tcp_closed = 1;
    listener_maybe_free(l);
}

static void listener_peer_gone(rf_peer_listener *l, rf_peer *p)
{
    *p->pprev = p->next;
    if (p->next)
        p->next->pprev = p->pprev;
    listener_maybe_free(l);
}

/* The listener's table of connections in their handshake is full and a new one came: v, the
 * oldest connection of the source holding the most places, goes to make room. The Error is
 * best effort (one non-blocking write); the owner hears the reason through on_down. */
static void listener_evict(rf_peer_listener *l, rf_peer *v, const char *newcomer)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Error e = REFIT__ERROR__INIT;
    uint8_t *buf;
    size_t len;
    uv_buf_t b;

    peer_set_reason(v, "closed to make room for a new connection from %s: %" PRIu32 " "
                    "connections to this listener were in their handshake (limit %" PRIu32 "), "
                    "%" PRIu32 " of them from the address of this one (%s), which no address "
                    "exceeded, and this was its oldest; a flood of connections that do not "
                    "authenticate?", newcomer, l->pending.count, l->set.max_pending,
                    rf_admit_src_count(&v->adm), v->remote);
    e.code = -EBUSY;
    e.message = v->reason;
    env.body_case = REFIT__ENVELOPE__BODY_ERROR;
    env.error = &e;
    if (rf_wire_pack(&env.base, &buf, &len) == 0) {
        b = uv_buf_init((char *)buf, (unsigned int)len);
        uv_try_write((uv_stream_t *)&v->tcp, &b, 1);
        free(buf);
    }
    peer_close_now(v);
}

/* Until a connection proves the key, nothing tells a daemon of the cluster from a stranger,
 * so every new connection is admitted, and the table of max_pending connections in their
 * handshake bounds what strangers hold (a small frame each, until the handshake deadline).
 * When it is full the newcomer does not wait or get refused (then a stranger re-opening what
 * is closed keeps every place taken, and a daemon that proves the key in milliseconds never
 * gets one): the oldest connection of the source address holding the most places is closed
 * instead. A daemon is then closed only when it is the oldest of the largest source: never
 * while a stranger on another address holds more places than the daemon's address, and on
 * the daemon's own address only after max_pending newer connections from there came before its
 * proof, which arrives one round trip after it connects. Places reserved for the configured
 * members would not help: a member is known by its Hello, which anyone can send, and its
 * address, which it shares with whatever else runs on its host. */
static void listener_accept(uv_stream_t *server, int status)
{
    rf_peer_listener *l = container_of((uv_tcp_t *)server, rf_peer_listener, tcp);
    struct sockaddr_storage ss;
    int sslen = sizeof(ss);
    rf_admit_entry *victim;
    rf_peer *p;

    /* A failed accept (out of descriptors, say) concerns that one connection only. */
    if (status < 0 || l->closing)
        return;
    p = peer_new(&l->set);
    if (p == NULL)
        return;
    p->listener = l;
    p->next = l->peers;
    if (l->peers)
        l->peers->pprev = &p->next;
    p->pprev = &l->peers;
    l->peers = p;
    if (uv_accept(server, (uv_stream_t *)&p->tcp) < 0 ||
        uv_tcp_getpeername(&p->tcp, (struct sockaddr *)&ss, &sslen) < 0) {
        /* Reset before it could be served: nothing to tell anyone. */
        peer_close_now(p);
        return;
    }
    peer_describe_remote(p);
    victim = rf_admit_victim(&l->pending);
    if (victim != NULL)
        listener_evict(l, container_of(victim, rf_peer, adm), p->remote);
    rf_admit_add(&l->pending, &p->adm, (struct sockaddr *)&ss);
    peer_start(p);
}

int rf_peer_listen(uv_loop_t *loop, const char *addr, const rf_peer_config *cfg,
                   rf_peer_listener **out, rf_err *err)
{
    rf_peer_listener *l = NULL;
    uv_getaddrinfo_t gai;
    struct addrinfo hints;
    struct sockaddr_storage ss;
    const char *node;
    rf_addr a;
    uint32_t max_pending = cfg->max_pending ? cfg->max_pending : RF_PEER_MAX_PENDING_DEFAULT;
    int len = sizeof(ss), rc, have_gai = 0;

    *out = NULL;
    if (max_pending > RF_PEER_MAX_PENDING_MAX)
        return rf_err_set(err, -EINVAL, "cannot listen on %s: %" PRIu32 " connections in their "
                          "handshake is more than the %d a listener may hold", addr, max_pending,
                          RF_PEER_MAX_PENDING_MAX);
    rc = rf_addr_parse(addr, RF_ADDR_LISTEN, &a, err);
    if (rc < 0)
        goto out;
    node = rf_addr_hints(&a, RF_ADDR_LISTEN, &hints);
    /* Without a callback libuv resolves synchronously; a listener starts once, at start-up. */
    rc = uv_getaddrinfo(loop, &gai, NULL, node, a.port, &hints);
    if (rc < 0) {
        rc = rf_err_set(err, rc, "cannot listen on %s: cannot resolve '%s': %s", addr,
                        node ? node : "all interfaces", uv_strerror(rc));
        goto out;
    }
    have_gai = 1;
    l = calloc(1, sizeof(*l) + (size_t)max_pending * sizeof(l->srcs[0]));
    if (l == NULL) {
        rc = rf_err_set(err, -ENOMEM, "cannot listen on %s: out of memory", addr);
        goto out;
    }
    rc = settings_init(&l->set, loop, cfg, err);
    if (rc < 0) {
        free(l);
        l = NULL;
        goto out;
    }
    rf_admit_init(&l->pending, l->srcs, l->set.max_pending);
    uv_tcp_init(loop, &l->tcp);
    rc = uv_tcp_bind(&l->tcp, gai.addrinfo->ai_addr, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&l->tcp, 128, listener_accept);
    if (rc == 0)
        rc = uv_tcp_getsockname(&l->tcp, (struct sockaddr *)&ss, &len);
    if (rc < 0) {
        rf_err_set(err, rc, "cannot listen on %s: %s (is another daemon using the port?)",
                   addr, uv_strerror(rc));
        /* The handle exists: it and l go away in the close callback. */
        l->closing = 1;
        uv_close((uv_handle_t *)&l->tcp, listener_tcp_closed);
        l = NULL;
        goto out;
    }
    l->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    *out = l;
out:
    if (have_gai)
        uv_freeaddrinfo(gai.addrinfo);
    return rc;
}

int rf_peer_listener_port(const rf_peer_listener *l)
{
    return l->port;
}

void *rf_peer_listener_data(const rf_peer_listener *l)
{
    return l->set.data;
}

void rf_peer_listener_close(rf_peer_listener *l)
{
    if (l->closing)
        return;
    l->closing = 1;
    uv_close((uv_handle_t *)&l->tcp, listener_tcp_closed);
    for (rf_peer *p = l->peers; p; p = p->next)
        rf_peer_close(p, "listener closed");
}

/* ---- connector ---- */

static void connector_attempt(rf_peer_connector *c);

static void connector_maybe_free(rf_peer_connector *c)
{
    if (!c->closing || !c->retry_closed || c->gai_pending || c->cur != NULL)
        return;
    settings_free(&c->set);
    free(c);
}

static void connector_retry_fired(uv_timer_t *t)
{
    connector_attempt(container_of(t, rf_peer_connector, retry));
}

static void connector_schedule(rf_peer_connector *c, const char *reason)
{
    uint64_t delay = c->backoff;

    if (c->closing)
        return;
    c->backoff = delay * 2 > c->set.backoff_max_ms ? c->set.backoff_max_ms : delay * 2;
    if (c->set.cb.on_retry)
        c->set.cb.on_retry(c, reason, delay);
    if (!c->closing)
        uv_timer_start(&c->retry, connector_retry_fired, delay, 0);
}

static void connector_peer_gone(rf_peer_connector *c, rf_peer *p)
{
    if (c->cur == p)
        c->cur = NULL;
    if (c->closing) {
        connector_maybe_free(c);
        return;
    }
    connector_schedule(c, p->reason[0] ? p->reason : "connection closed");
}

static void connector_connected(uv_connect_t *req, int status)
{
    rf_peer *p = container_of(req, rf_peer, connect_req);

    if (p->closing)
        return;
    if (status < 0) {
        peer_set_reason(p, "cannot connect to %s: %s", p->connector->addr, uv_strerror(status));
        peer_close_now(p);
        return;
    }
    peer_start(p);
}

static void connector_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    rf_peer_connector *c = container_of(req, rf_peer_connector, gai);
    char why[512];
    rf_peer *p;
    int rc;

    c->gai_pending = 0;
    if (c->closing) {
        uv_freeaddrinfo(res);
        connector_maybe_free(c);
        return;
    }
    if (status < 0) {
        snprintf(why, sizeof(why), "cannot resolve %s: %s", c->addr, uv_strerror(status));
        connector_schedule(c, why);
        return;
    }
    p = peer_new(&c->set);
    if (p == NULL) {
        uv_freeaddrinfo(res);
        connector_schedule(c, "out of memory");
        return;
    }
    p->connector = c;
    c->cur = p;
    snprintf(p->remote, sizeof(p->remote), "%s", c->addr);
    rc = uv_tcp_connect(&p->connect_req, &p->tcp, res->ai_addr, connector_connected);
    uv_freeaddrinfo(res);
    if (rc < 0) {
        peer_set_reason(p, "cannot connect to %s: %s", c->addr, uv_strerror(rc));
        peer_close_now(p);
        return;
    }
    /* The timer bounds the connect; peer_start restarts it for heartbeats. */
    uv_timer_start(&p->timer, peer_tick, c->set.heartbeat_ms, c->set.heartbeat_ms);
}

static void connector_attempt(rf_peer_connector *c)
{
    struct addrinfo hints;
    char why[512];
    int rc;

    if (c->closing)
        return;
    rc = uv_getaddrinfo(c->set.loop, &c->gai, connector_resolved,
                        rf_addr_hints(&c->to, RF_ADDR_CONNECT, &hints), c->to.port, &hints);
    if (rc < 0) {
        snprintf(why, sizeof(why), "cannot resolve %s: %s", c->addr, uv_strerror(rc));
        connector_schedule(c, why);
        return;
    }
    c->gai_pending = 1;
}

static void connector_retry_closed(uv_handle_t *h)
{
    rf_peer_connector *c = container_of((uv_timer_t *)h, rf_peer_connector, retry);

    c->retry_closed = 1;
    connector_maybe_free(c);
}

int rf_peer_connect(uv_loop_t *loop, const char *addr, const rf_peer_config *cfg,
                    rf_peer_connector **out, rf_err *err)
{
    rf_peer_connector *c = NULL;
    int rc;

    *out = NULL;
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return rf_err_set(err, -ENOMEM, "cannot connect to %s: out of memory", addr);
    rc = rf_addr_parse(addr, RF_ADDR_CONNECT, &c->to, err);
    if (rc == 0)
        rc = settings_init(&c->set, loop, cfg, err);
    if (rc < 0) {
        free(c);
        return rc;
    }
    snprintf(c->addr, sizeof(c->addr), "%s", addr);
    c->backoff = c->set.backoff_min_ms;
    uv_timer_init(loop, &c->retry);
    connector_attempt(c);
    *out = c;
    return 0;
}

rf_peer *rf_peer_connector_peer(const rf_peer_connector *c)
{
    return c->cur && rf_peer_is_up(c->cur) ? c->cur : NULL;
}

void *rf_peer_connector_data(const rf_peer_connector *c)
{
    return c->set.data;
}

void rf_peer_connector_close(rf_peer_connector *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    uv_close((uv_handle_t *)&c->retry, connector_retry_closed);
    if (c->gai_pending)
        uv_cancel((uv_req_t *)&c->gai);
    if (c->cur)
        rf_peer_close(c->cur, "connector closed");
}
