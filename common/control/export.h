/* common/control/export.h - a refit-receiverd's side of same-host export: it fetches, over the
 * local publisherd's Unix socket, the trainers' inventory and memory handles (memfd and VMM fds
 * by SCM_RIGHTS, CUDA IPC handles as bytes), so it can copy trainer memory straight into
 * engine memory. The protocol (ExportHello, Export) is described in proto/rpc.proto; the
 * publisherd's side is in common/control/registry.c. */
#ifndef RF_EXPORT_H
#define RF_EXPORT_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "layout.h"
#include "mem.h"

#define RF_EXPORT_NONCE_BYTES 32
#define RF_EXPORT_MAC_BYTES 32
/* The MAC's label; its terminating NUL is part of the MACed bytes. */
#define RF_EXPORT_LABEL "refit-local-v1/export"
/* The cluster key's bounds (rf_peer_load_key's RF_PEER_KEY_MIN and RF_PEER_KEY_MAX). */
#define RF_EXPORT_KEY_MIN 32
#define RF_EXPORT_KEY_MAX 1024
/* Region fds per packet on the back channel: near the kernel's 253 a message, because the
 * channel's send buffer holds about 280 packets whatever they carry (some 70k fds). */
#define RF_EXPORT_FDS_PER_PACKET 250

/* What a publisherd exported: its trainers' memory as they registered it. */
typedef struct rf_export {
    uint64_t generation;     /* the publisher's registry generation */
    rf_inv *inv;             /* its local inventory, its local ids (tensor/region/piece) */
    uint32_t nregions;
    rf_mem_desc *regions;    /* per local region id; device strings, handle bytes, chunk
                                arrays and fds owned by the export (fd -1 when none); a VMM
                                region's owner is its trainer's number in the publisherd, which
                                an importer replaces by one of its own (rf_srcmap does) */
} rf_export;

/* Connects to the publisherd's socket as a peer client, proves the cluster key (key, key_len
 * bytes: the daemons' rf_peer_key) and fetches the export. Blocking: every wait is bounded by
 * timeout_s in all (poll), so it may run on a daemon's loop thread once per plan. The
 * inventory's ids are the publisher's local ids (one member merged alone keeps them). Errors
 * name the socket and what failed: the connect (-ENOENT, -ECONNREFUSED, -EACCES: is the
 * publisherd running there, may this user connect), the publisherd's refusal with its message
 * (-EACCES: a different cluster key; -EAGAIN: its inventory is incomplete, retry after the
 * next plan; -ENOKEY: export is off there; -EOPNOTSUPP: the socket is a receiverd's),
 * -ETIMEDOUT, -EBADMSG for an answer that does not parse or agree with itself, -EPROTO for
 * fewer fds than regions with has_fd (one per chunk for a VMM region over several
 * allocations), -EMFILE when this process may not open them all (one fd per exported memfd or
 * VMM region, per chunk: RLIMIT_NOFILE must exceed that count).
 * Nothing is left open on failure. */
int rf_export_fetch(const char *socket_path, const uint8_t *key, size_t key_len,
                    double timeout_s, rf_export **out, rf_err *err);
/* The same for a process that does not hold the key: signer computes the Export's mac for
 * the publisherd's nonce ns and ours nc (an engine's installer asks its receiverd,
 * InstallSign), or fails with err (the fetch then fails with its code). */
typedef struct rf_export_signer {
    int (*fn)(void *ctx, const uint8_t *ns, const uint8_t *nc, uint8_t *mac, rf_err *err);
    void *ctx;
} rf_export_signer;
int rf_export_fetch_signed(const char *socket_path, const rf_export_signer *signer,
                           double timeout_s, rf_export **out, rf_err *err);
/* Closes the fds of region i (its fd, or each of its chunks') once it is mapped: the mapping
 * holds the memory, and a region over many VMM allocations would hold one fd per allocation.
 * Its descriptor keeps everything else; closing twice is fine. */
void rf_export_close_fds(rf_export *e, uint32_t i);
/* Frees the export and closes its fds (mappings made from them stay valid). NULL is fine. */
void rf_export_free(rf_export *e);

/* The Export's proof, HMAC-SHA256(key, RF_EXPORT_LABEL "\0" || server_nonce || client_nonce),
 * computed alike by both sides; nonces are RF_EXPORT_NONCE_BYTES, mac RF_EXPORT_MAC_BYTES. */
void rf_export_mac(const uint8_t *key, size_t key_len, const uint8_t *server_nonce,
                   const uint8_t *client_nonce, uint8_t *mac);

#endif
