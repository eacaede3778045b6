/* common/control/peer.h - authenticated daemon-to-daemon control connections over libuv TCP: a
 * listener, an outgoing connector that reconnects with backoff, the Hello / HMAC challenge
 * handshake (the connector proves the cluster key first), a MAC and sequence number on every
 * frame after it, heartbeats and dead-peer detection. After the handshake every Envelope goes
 * to the owner's callback. */
#ifndef RF_PEER_H
#define RF_PEER_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "err.h"
#include "refit.pb-c.h"

/* 2: both nonces bound into the proof. 3: the connector proves first and the acceptor answers
 * only a valid proof; proofs bind both Hellos and both nonces and are labelled by direction;
 * every frame after the handshake carries a sequence number and a MAC. */
#define RF_PEER_PROTOCOL_VERSION 3
#define RF_PEER_NONCE_BYTES 32
#define RF_PEER_MAC_BYTES 32
/* Until a connection is authenticated its frames may be at most this long (Hello, Challenge,
 * Auth and Error are small), so a stranger cannot make the daemon allocate max_frame. */
#define RF_PEER_PREAUTH_FRAME_MAX 4096
/* Longest node name, data address, host id and socket path a Hello may carry: four of them
 * fit the limit above. */
#define RF_PEER_HELLO_STR_MAX 960
#define RF_PEER_MAX_PENDING_DEFAULT 64
#define RF_PEER_MAX_PENDING_MAX 65536
#define RF_PEER_KEY_MIN 32
#define RF_PEER_KEY_MAX 1024
#define RF_PEER_HEARTBEAT_MS_DEFAULT 1000
#define RF_PEER_TIMEOUT_MS_DEFAULT 5000
#define RF_PEER_BACKOFF_MIN_MS_DEFAULT 100
#define RF_PEER_BACKOFF_MAX_MS_DEFAULT 5000

/* The shared cluster key every daemon proves it holds. */
typedef struct rf_peer_key {
    uint8_t bytes[RF_PEER_KEY_MAX];
    size_t len;
} rf_peer_key;

typedef struct rf_peer rf_peer;
typedef struct rf_peer_listener rf_peer_listener;
typedef struct rf_peer_connector rf_peer_connector;

typedef struct rf_peer_callbacks {
    /* The peer passed the handshake; hello is its Hello (also rf_peer_hello(p)). */
    void (*on_up)(rf_peer *p, const Refit__Hello *hello);
    /* One Envelope from an authenticated peer (never Hello/Challenge/Auth/Heartbeat). The
     * callback borrows env; the module frees it when the callback returns. */
    void (*on_envelope)(rf_peer *p, const Refit__Envelope *env);
    /* Called exactly once for every connection that was established (accepted, or connected
     * by a connector), whether or not it came up, when it is fully closed; reason says why in
     * words for a person. p is freed when this returns. Optional. */
    void (*on_down)(rf_peer *p, const char *reason);
    /* Connectors only, optional: the next attempt comes in delay_ms, after reason (a failed
     * connect, or the end of the last connection). */
    void (*on_retry)(rf_peer_connector *c, const char *reason, uint64_t delay_ms);
} rf_peer_callbacks;

/* What this daemon says about itself and how its connections behave. The listener and
 * connector copy everything (strings and key included); cfg may go away after the call. */
typedef struct rf_peer_config {
    const rf_peer_key *key;
    Refit__Role role;
    const char *node;            /* may be NULL: "" */
    uint64_t daemon_id;
    const char *data_addr;       /* may be NULL: "" */
    const char *host_id;         /* may be NULL: "" (Hello.host_id) */
    const char *local_sock;      /* may be NULL: "" (Hello.local_sock) */
    uint32_t index;
    uint32_t protocol_version;   /* 0: RF_PEER_PROTOCOL_VERSION */
    uint32_t max_frame;          /* 0: RF_WIRE_MAX_DEFAULT */
    uint64_t heartbeat_ms;       /* 0: RF_PEER_HEARTBEAT_MS_DEFAULT */
    uint64_t timeout_ms;         /* 0: RF_PEER_TIMEOUT_MS_DEFAULT; also bounds the connect, and
                                  * the whole handshake from the moment TCP is up */
    uint32_t max_pending;        /* listeners, 0: RF_PEER_MAX_PENDING_DEFAULT, at most
                                  * RF_PEER_MAX_PENDING_MAX. At most this many accepted
                                  * connections may be in their handshake at once; for one more,
                                  * the oldest of the source address that holds the most of them
                                  * is closed (on_down says why) */
    uint64_t backoff_min_ms;     /* 0: RF_PEER_BACKOFF_MIN_MS_DEFAULT (connectors) */
    uint64_t backoff_max_ms;     /* 0: RF_PEER_BACKOFF_MAX_MS_DEFAULT (connectors) */
    rf_peer_callbacks cb;
    void *data;                  /* initial rf_peer_data() of every peer; also the owner's data */
} rf_peer_config;

/* Reads the cluster key file: at least RF_PEER_KEY_MIN bytes, at most RF_PEER_KEY_MAX, a
 * regular file not readable or writable by group or others. A key file that is all printable
 * text (a hex or base64 key) loses its trailing whitespace; other files are used byte for
 * byte. */
int rf_peer_load_key(const char *path, rf_peer_key *key, rf_err *err);

/* Listens on addr ("host:port", "[v6]:port", "*:port" or ":port" for all interfaces; port 0
 * picks one, see rf_peer_listener_port). Accepted connections run the handshake and then the
 * callbacks in cfg. -EINVAL also for a node name, data address, host id or socket path longer than
 * RF_PEER_HELLO_STR_MAX (same for rf_peer_connect). */
int rf_peer_listen(uv_loop_t *loop, const char *addr, const rf_peer_config *cfg,
                   rf_peer_listener **out, rf_err *err);
int rf_peer_listener_port(const rf_peer_listener *l);
void *rf_peer_listener_data(const rf_peer_listener *l);
/* Stops listening and closes every connection it accepted (on_down: "listener closed"). The
 * listener is freed once they are all closed; do not use l after this call. */
void rf_peer_listener_close(rf_peer_listener *l);

/* Connects to addr ("host:port", resolved again at every attempt) and keeps a connection up
 * until rf_peer_connector_close: after a failed attempt or the end of a connection it retries
 * after backoff_min_ms, doubling up to backoff_max_ms; a connection that came up resets the
 * delay. The first attempt starts at once. */
int rf_peer_connect(uv_loop_t *loop, const char *addr, const rf_peer_config *cfg,
                    rf_peer_connector **out, rf_err *err);
/* The current connection once it is up, else NULL. */
rf_peer *rf_peer_connector_peer(const rf_peer_connector *c);
void *rf_peer_connector_data(const rf_peer_connector *c);
/* Stops retrying and closes the current connection (on_down: "connector closed"). The
 * connector is freed once everything is closed; do not use c after this call. */
void rf_peer_connector_close(rf_peer_connector *c);

/* Sends env to an up peer. 0, -ENOTCONN (not up, or closing), -EINVAL (no body), or a libuv
 * write error. The module packs env at once; env may go away after the call. */
int rf_peer_send(rf_peer *p, const Refit__Envelope *env);
/* Closes one connection gracefully (pending writes go out first, bounded by the timeout). A
 * connector's connection is then re-established; close the connector to stop that. */
void rf_peer_close(rf_peer *p, const char *reason);

/* The peer's Hello: NULL until it arrived. Valid until on_down returns. */
const Refit__Hello *rf_peer_hello(const rf_peer *p);
int rf_peer_is_up(const rf_peer *p);
/* "ip:port" of the other end. */
const char *rf_peer_remote(const rf_peer *p);
/* The connector that made p, or NULL for a connection accepted by a listener. */
rf_peer_connector *rf_peer_connector_of(const rf_peer *p);
void *rf_peer_data(const rf_peer *p);
void rf_peer_set_data(rf_peer *p, void *data);

#endif
