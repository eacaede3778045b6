/* common/control/registry.h - what a daemon embeds to serve its local clients: the RPC server, the
 * clients, their imported regions and validated pieces (a local rf_inv), publish/release for
 * trainers, version events for engines, the refitctl requests, and (publisherd) the export of
 * the trainers' memory to an authenticated refit-receiverd on the same host (ExportHello and
 * Export in proto/rpc.proto; the receiverd's side is common/control/export.h). Runs on the
 * daemon's loop; every function here is called on that loop's thread. */
#ifndef RF_REGISTRY_H
#define RF_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <jansson.h>
#include <uv.h>

#include "err.h"
#include "layout.h"
#include "mem.h"
#include "rpc.pb-c.h"

/* The install token an engine with in-process regions gets at Seal. */
#define RF_REGISTRY_TOKEN_BYTES 32

typedef struct rf_registry rf_registry;

typedef enum rf_reg_event {
    RF_REG_INSTALLING = 1, /* values match refit.rpc.EventKind */
    RF_REG_COMMITTED = 2,
    RF_REG_ABORTED = 3,
} rf_reg_event;

typedef struct rf_registry_cb {
    /* Every expected client has sealed: the local inventory is complete. Called again after
     * a change (a client left, or re-registered) once it is complete again. */
    void (*on_inventory)(rf_registry *r, void *ud);
    /* A trainer or engine client left or had its pieces dropped: the inventory changed and is
     * incomplete until on_inventory. */
    void (*on_change)(rf_registry *r, void *ud);
    /* Trainers only: readiness changed. version: every expected trainer is sealed and offers
     * exactly this version, not released yet; 0: not ready (a trainer left or re-registered,
     * they offer different versions, or the offer was released or aborted). */
    void (*on_ready)(rf_registry *r, uint64_t version, void *ud);
    /* refitctl status: set *json to a malloc'd JSON document (the registry frees it), or
     * fail with err. NULL: status requests are refused. */
    int (*on_status)(rf_registry *r, char **json, rf_err *err, void *ud);
    /* refitctl trigger of a refit to version: 0, or a negative errno with err filled. */
    int (*on_refit)(rf_registry *r, uint64_t version, rf_err *err, void *ud);
    /* refitctl wait for version (not committed yet): 0 to let the registry hold the waiter
     * until rf_registry_notify answers it, or refuse with err. May be NULL (accept all). */
    int (*on_wait)(rf_registry *r, uint64_t version, rf_err *err, void *ud);
    /* Engines only: rf_registry_consumed changed (a gated engine consumed a version, joined
     * or left). May be NULL. */
    void (*on_consumed)(rf_registry *r, uint64_t consumed, void *ud);
    /* Engines with in-process regions: the installer of engine uid answered InstallDone (m
     * valid during the call), or the installer or its engine went away (why says which).
     * May be NULL. */
    void (*on_install_done)(rf_registry *r, uint64_t uid, const Refit__Rpc__InstallDone *m,
                            void *ud);
    void (*on_install_lost)(rf_registry *r, uint64_t uid, const char *why, void *ud);
    /* The installer of engine uid asks for the trainers' memory of a local publisher
     * (InstallSources, m valid during the call): pass the region fds on chan and set *out to
     * the answer (the registry sends and frees it), or fail with err. NULL: refused, the
     * daemon copies nothing from trainers on its host. */
    int (*on_install_sources)(rf_registry *r, uint64_t uid,
                              const Refit__Rpc__InstallSources *m, int chan,
                              Refit__Rpc__Response **out, rf_err *err, void *ud);
} rf_registry_cb;

typedef struct rf_registry_opts {
    const char *socket_path;
    rf_side side;               /* RF_SRC: trainers (publisherd); RF_DST: engines (receiverd) */
    unsigned expected_clients;  /* trainers or engines this daemon serves */
    uint32_t node;              /* rf_endpoint.node of this daemon's endpoints */
    const uid_t *allowed_uids;  /* see rf_rpc_server_opts: none means the daemon's own uid */
    size_t n_allowed_uids;
    const gid_t *allowed_gids;
    size_t n_allowed_gids;
    uint32_t max_frame;         /* 0: RF_RPC_MAX_REQUEST; only a lower limit applies (tests) */
    bool gpu_memory;            /* regions must be GPU memory (nccl transport); else host
                                   memory (tcp transport, which reads regions with the CPU) */
} rf_registry_opts;

int rf_registry_open(uv_loop_t *loop, const rf_registry_opts *opts, const rf_registry_cb *cb,
                     void *ud, rf_registry **out, rf_err *err);
/* Closes the socket and every client (no callbacks are called from here on) and frees the
 * registry; libuv handles finish closing when the loop runs next. */
void rf_registry_close(rf_registry *r);

/* Turns same-host export on with the cluster key (copied; RF_EXPORT_KEY_MIN..MAX bytes, the
 * node passes rf_peer_key's bytes and len), or off with key NULL. A peer client (a local
 * refit-receiverd) proves the key on a fresh nonce of the registry and gets the local
 * inventory, every region as its trainer registered it, and the regions' fds. Only a trainers'
 * registry (RF_SRC) serves it, and only while its inventory is complete. -EINVAL for a key
 * length outside the bounds, -ENOMEM, -EIO when libsodium cannot start. */
int rf_registry_set_export_key(rf_registry *r, const uint8_t *key, size_t len);

/* The local inventory: valid until the next return to the loop that may change it (a client
 * request or disconnect); region ids index rf_registry_region_base. */
const rf_inv *rf_registry_inv(const rf_registry *r);
bool rf_registry_complete(const rf_registry *r);
uint64_t rf_registry_generation(const rf_registry *r); /* bumps at every inventory change */
void *rf_registry_region_base(const rf_registry *r, uint32_t region);
rf_mem_kind rf_registry_region_kind(const rf_registry *r, uint32_t region);
const char *rf_registry_endpoint_device(const rf_registry *r, uint32_t endpoint);
/* In-process install (proto/rpc.proto): the engine (a client uid, never 0) whose in-process
 * regions make up endpoint, 0 for an endpoint of shared memory (mapped here). */
uint64_t rf_registry_endpoint_owner(const rf_registry *r, uint32_t endpoint);
/* The live inventory region id of each region of client uid, in the client's order
 * (*ids malloc'd). -ENOENT when it left. */
int rf_registry_client_regions(const rf_registry *r, uint64_t uid, uint32_t **ids, size_t *n,
                               rf_err *err);
/* The unread output an attached installer's connection may hold: its engine's part of a plan is
 * pushed at once (inventory, region map, slice frames of up to 100k transfers each), which for
 * a large engine is more than a client's RF_RPC_MAX_OUTPUT. The installer is librefit's thread
 * in an engine this registry authenticated (same pid, Seal's token), and it reads as it goes. */
#define RF_REGISTRY_INSTALLER_OUTPUT (1ull << 30)
/* Pushes m to the installer of engine uid: -ENOENT (the engine left), -ENOTCONN (no installer
 * attached), or the connection's error, each with a message. */
int rf_registry_install_push(rf_registry *r, uint64_t uid, const Refit__Rpc__Install *m,
                             rf_err *err);
const char *rf_registry_client_name(const rf_registry *r, uint64_t uid);
uint64_t rf_registry_committed(const rf_registry *r);
/* Clients and versions as a JSON object, for the daemon's status document (caller decrefs). */
json_t *rf_registry_status(const rf_registry *r);

/* The receive quorum: the last version every gated engine is done with, UINT64_MAX when no
 * engine is gated. The daemon holds installs of newer versions until this reaches its
 * committed version. */
uint64_t rf_registry_consumed(const rf_registry *r);
/* While held, the memory of clients that leave stays mapped (the data path may be writing
 * it); releasing the hold unmaps what was deferred. */
void rf_registry_hold(rf_registry *r, bool hold);

/* The highest rank a client may give (ranks are global: engine ranks 8-15 on a second node). */
#define RF_REGISTRY_MAX_RANK ((1 << 20) - 1)

/* Trainers: the version every expected trainer publishes now and that is not released, or 0
 * (see rf_registry_cb.on_ready). */
uint64_t rf_registry_ready(const rf_registry *r);
/* Trainer or engine clients connected now, sealed or not (refitctl clients not counted). */
unsigned rf_registry_nclients(const rf_registry *r);
/* Trainers: version is committed, they may overwrite their weights: answers WaitReleased for
 * every version <= version. */
void rf_registry_release(rf_registry *r, uint64_t version);
/* Trainers: the refit of version failed: WaitReleased for versions in (released, version]
 * fail with reason; trainers may publish version again. */
void rf_registry_abort(rf_registry *r, uint64_t version, const char *reason);
/* The cluster can refit no version now, for reason (the coordinator's Blocked), or again
 * (reason NULL or ""). While blocked, every WaitReleased, WaitVersion and Wait for a version
 * not reached yet, queued or new, is answered -EAGAIN with a message that carries reason;
 * offers and events are untouched, so the same waits once it cleared wait as usual. */
void rf_registry_block(rf_registry *r, const char *reason);
/* Engines and refitctl: pushes the event to every engine client; COMMITTED raises the
 * committed version and answers WaitVersion and Wait up to it, ABORTED fails those waiting
 * for versions in (committed, version] with reason. Daemons on both sides call it for
 * commits and aborts so refitctl wait is answered everywhere. */
void rf_registry_notify(rf_registry *r, rf_reg_event ev, uint64_t version, const char *reason);

#endif
