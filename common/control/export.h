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
#include "rpc.pb-c.h"

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
    rf_mem_desc *regions;    /* per local region id, kind 0 where not granted (no piece
                                asked for lies in it); device strings, handle bytes, chunk
                                arrays and fds owned by the export (fd -1 when none); a VMM
                                region's owner is its trainer's number in the publisherd, which
                                an importer replaces by one of its own (rf_srcmap does) */
} rf_export;

/* Connects to the publisherd's socket as a peer client, proves the cluster key (key, key_len
 * bytes: the daemons' rf_peer_key) and fetches the export of the npieces source pieces (the
 * publisher's local piece ids) a plan reads: the regions holding them (and an FP8 piece's
 * scales) come mapped-ready with their fds, every other region with kind 0 (not granted,
 * nothing to map). No pieces: the inventory alone. Blocking: every wait is bounded by
 * timeout_s in all (poll), so it may run on a daemon's loop thread once per plan. The
 * inventory's ids are the publisher's local ids (one member merged alone keeps them). Errors
 * name the socket and what failed: the connect (-ENOENT, -ECONNREFUSED, -EACCES: is the
 * publisherd running there, may this user connect), the publisherd's refusal with its message
 * (-EACCES: a different cluster key; -EAGAIN: its inventory is incomplete, retry after the
 * next plan; -ESTALE: a piece it does not hold; -ENOKEY: export is off there; -EOPNOTSUPP:
 * the socket is a receiverd's), -ETIMEDOUT, -EBADMSG for an answer that does not parse or
 * agree with itself, -EPROTO for fewer fds than regions with has_fd (one per chunk for a VMM
 * region over several allocations), -EMFILE when this process may not open them all (one fd
 * per exported memfd or VMM region, per chunk: RLIMIT_NOFILE must exceed that count).
 * Nothing is left open on failure. */
int rf_export_fetch(const char *socket_path, const uint8_t *key, size_t key_len,
                    const uint32_t *pieces, size_t npieces, double timeout_s, rf_export **out,
                    rf_err *err);

/* The same fetch left as the publisherd answered, checked, for a receiverd to relay to an
 * engine's installer (InstallSources): resp is the Export's answer, fds its region fds in
 * answer order. */
typedef struct rf_export_answer {
    Refit__Rpc__Response *resp;
    int *fds;
    uint32_t nfds;
} rf_export_answer;
int rf_export_fetch_answer(const char *socket_path, const uint8_t *key, size_t key_len,
                           const uint32_t *pieces, size_t npieces, double timeout_s,
                           rf_export_answer *out, rf_err *err);
/* Closes the fds and frees the answer; a zeroed one is fine. */
void rf_export_answer_free(rf_export_answer *a);
/* The installer's side of that relay: builds the export from the relayed answer r, whose fds
 * come on the back channel chan within timeout_s; from names the sender in errors. */
int rf_export_take(const char *from, const Refit__Rpc__Response *r, int chan, double timeout_s,
                   rf_export **out, rf_err *err);
/* Passes n fds on a back channel, at most RF_EXPORT_FDS_PER_PACKET a packet (one data byte
 * each). Never blocks: the kernel queues a packet whole or refuses it (-EAGAIN). */
int rf_export_pass_fds(int chan, const int *fds, uint32_t n, rf_err *err);

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
