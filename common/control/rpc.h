/* common/control/rpc.h - the local RPC transport (proto/rpc.proto): a Unix stream socket server on
 * libuv that checks peer credentials and receives file descriptors (SCM_RIGHTS), and the
 * blocking client-side calls librefit is built on. */
#ifndef RF_RPC_H
#define RF_RPC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <uv.h>

#include "err.h"
#include "rpc.pb-c.h"

#define RF_RPC_PROTOCOL_VERSION 1
/* The largest request a daemon accepts from a local client, checked on the 4-byte length
 * before anything is allocated: a longer one is answered with an error naming this limit and
 * the connection is closed. Requests are small: the largest real one is a RegisterPiece (a
 * tensor name of at most 255 bytes and 8 dims of shape, start, extent and strides), under
 * 700 bytes packed; pieces come one a request. A RegisterRegion over RF_RPC_MAX_FDS VMM
 * allocations lists them in about 24 KiB. Answers (a status document) go the other way
 * and are not bound by it. */
#define RF_RPC_MAX_REQUEST (64u << 10)
/* Received fds not yet claimed by a request: a region over several CUDA VMM allocations
 * brings one per allocation (RF_MEM_MAX_CHUNKS). */
#define RF_RPC_MAX_FDS 1024
/* Fds on one byte of a request (the kernel takes at most 253 a message). */
#define RF_RPC_FDS_PER_MSG 250
#define RF_RPC_MAX_OUTPUT (16u << 20)       /* unread replies/events before a client is cut */

typedef struct rf_rpc_server rf_rpc_server;
typedef struct rf_rpc_conn rf_rpc_conn;

typedef struct rf_rpc_server_cb {
    /* A client connected and passed the credential check. */
    void (*on_connect)(rf_rpc_conn *c, void *ud);
    /* One decoded request, valid during the call. The fds sent with it are claimed with
     * rf_rpc_conn_take_fd, in the order they were sent. The callback may send, and may close
     * c. */
    void (*on_request)(rf_rpc_conn *c, const Refit__Rpc__Request *req, void *ud);
    /* c is going away (peer left, bad input, rf_rpc_conn_close, server close); called once,
     * only for connections that on_connect saw. c must not be used after it returns. */
    void (*on_close)(rf_rpc_conn *c, void *ud);
} rf_rpc_server_cb;

typedef struct rf_rpc_server_opts {
    const char *path;              /* socket path; its directory is created 0755 if missing */
    const uid_t *allowed_uids;     /* besides root; none and no gids: the daemon's own euid */
    size_t n_allowed_uids;
    const gid_t *allowed_gids;
    size_t n_allowed_gids;
    uint32_t max_frame;            /* a lower limit than RF_RPC_MAX_REQUEST (tests); 0 or a
                                      larger value: RF_RPC_MAX_REQUEST */
} rf_rpc_server_opts;

/* What rf_rpc_server_open checks of path before it touches anything: not empty, short
 * enough for a Unix socket address, and nothing but a socket there (a stale one is replaced,
 * a live one is found only when opening). 0 or a negative errno with err saying what to
 * change. Changes nothing: --check-config runs it. */
int rf_rpc_path_check(const char *path, rf_err *err);
/* Creates the socket (mode 0660), replacing a stale socket file only when nobody answers on
 * it, and starts accepting on loop. -EADDRINUSE when a live server holds the path. */
int rf_rpc_server_open(uv_loop_t *loop, const rf_rpc_server_opts *opts,
                       const rf_rpc_server_cb *cb, void *ud, rf_rpc_server **out, rf_err *err);
/* Closes every connection (on_close for each), the listener, and removes the socket file.
 * Memory is freed in libuv close callbacks: run the loop afterwards. */
void rf_rpc_server_close(rf_rpc_server *s);
const char *rf_rpc_server_path(const rf_rpc_server *s);

/* Queues a response (written as soon as the socket takes it). -EPIPE on a closing
 * connection; a client that lets more than RF_RPC_MAX_OUTPUT (or the connection's own limit)
 * pile up is closed (-ENOBUFS). */
int rf_rpc_conn_send(rf_rpc_conn *c, const Refit__Rpc__Response *resp);
/* The unread output this connection may hold before it is cut, for a peer the daemon pushes
 * more to than it asked for (an engine's installer takes a whole plan at once); 0 restores
 * RF_RPC_MAX_OUTPUT. */
void rf_rpc_conn_set_max_output(rf_rpc_conn *c, size_t bytes);
/* Sends {id, code, message}. */
int rf_rpc_conn_reply(rf_rpc_conn *c, uint64_t id, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Writes what is queued (as far as the socket takes it without blocking) and closes c. */
void rf_rpc_conn_close(rf_rpc_conn *c);
/* The oldest received fd not yet claimed (the caller owns it), or -1. */
int rf_rpc_conn_take_fd(rf_rpc_conn *c);
void rf_rpc_conn_set_data(rf_rpc_conn *c, void *data);
void *rf_rpc_conn_data(const rf_rpc_conn *c);
/* The peer's credentials, as SO_PEERCRED gave them at accept. */
void rf_rpc_conn_cred(const rf_rpc_conn *c, pid_t *pid, uid_t *uid, gid_t *gid);

/* Client side, blocking. Connects to path (close-on-exec); messages say what to check. */
int rf_rpc_dial(const char *path, int *fd, rf_err *err);
/* Packs req into one frame and sends it, with passfd (>= 0) as SCM_RIGHTS on its first byte.
 * A request over RF_RPC_MAX_REQUEST is not sent: -EMSGSIZE. */
int rf_rpc_send(int fd, const Refit__Rpc__Request *req, int passfd, rf_err *err);
/* The same with nfds descriptors (at most RF_RPC_MAX_FDS), in order: RF_RPC_FDS_PER_MSG on
 * each of the frame's first bytes, so they have all arrived when the frame is whole. */
int rf_rpc_send_fds(int fd, const Refit__Rpc__Request *req, const int *fds, size_t nfds,
                    rf_err *err);

#endif
