/* common/model/plan.h - the reshard planner: who sends which box of which tensor to whom, grouped
 * into messages per endpoint pair and scheduled in rounds under a staging budget. */
#ifndef RF_PLAN_H
#define RF_PLAN_H

#include <stdint.h>

#include "layout.h"

typedef enum rf_plan_kind {
    RF_PLAN_DIRECT = 0, /* contiguous on both sides and large: sent from source memory
                           straight into destination memory, no copy */
    RF_PLAN_PACKED = 1, /* strided or small: gathered into staging, sent with the other
                           packed transfers of the same endpoint pair and round, scattered */
    RF_PLAN_LOCAL = 2   /* source and destination endpoints on one host (rf_endpoint.host):
                           the destination's daemon copies every transfer straight from source
                           memory into destination memory (no staging, no network); its
                           transfers tile the message at msg_off in row-major box order, which
                           only the verification digest uses */
} rf_plan_kind;

typedef struct rf_plan_opts {
    uint64_t staging_bytes;    /* staging budget per endpoint (GPU); default 256 MiB.
                                  A round uses at most half of it (double buffering). */
    uint64_t direct_min_bytes; /* smallest contiguous transfer sent direct; default 4 MiB */
} rf_plan_opts;

void rf_plan_opts_default(rf_plan_opts *o);

/* One transfer: the bytes of `box` (global coordinates of the tensor of both pieces) go from
 * source piece src to destination piece dst. Packed transfers lie in their message's payload
 * at msg_off, as the box's elements in row-major order. */
typedef struct rf_plan_xfer {
    uint32_t src;    /* source piece id */
    uint32_t dst;    /* destination piece id */
    uint32_t box;    /* index into the plan's box table (rf_plan_box) */
    uint32_t msg;    /* message that carries it */
    uint64_t msg_off;
    uint64_t bytes;
} rf_plan_xfer;

/* One message: one NCCL send/recv pair (or one tcp frame) between two endpoints in a round.
 * A direct message carries exactly one transfer; a packed one the transfers
 * [first, first + count) of the plan's transfer array, which is sorted by message. A local
 * message (RF_PLAN_LOCAL) likewise carries [first, first + count): the transfers of one
 * (src_ep, dst_ep) pair on one host, at most half the staging budget of them (a single larger
 * transfer is a message of its own), always in round 0: it uses no staging and no network,
 * so the rounds and max_staging_bytes are those of the packed messages alone. */
typedef struct rf_plan_msg {
    uint32_t src_ep, dst_ep;
    uint32_t round;
    uint32_t kind; /* rf_plan_kind */
    uint32_t first, count;
    uint64_t bytes;
} rf_plan_msg;

typedef struct rf_plan_stats {
    uint32_t tensors;
    uint64_t src_pieces, dst_pieces;
    uint64_t transfers, messages, rounds;
    uint64_t direct_bytes, packed_bytes, dst_bytes;
    uint64_t direct_transfers, packed_transfers;
    uint64_t runs; /* contiguous memory runs over all transfers, both sides */
    uint64_t max_sender_bytes, max_receiver_bytes, max_link_bytes;
    double mean_sender_bytes, mean_receiver_bytes;
    uint64_t max_staging_bytes; /* largest staging use of any endpoint in any round */
    /* Same-host transfers (RF_PLAN_LOCAL). Network bytes are direct_bytes + packed_bytes;
     * dst_bytes is all three. The per-endpoint loads above (sender, receiver) count every
     * path; max_link_bytes counts the network alone. */
    uint64_t local_bytes, local_transfers, local_messages;
} rf_plan_stats;

typedef struct rf_plan rf_plan;

/* Builds the plan for every destination piece of inv. Deterministic: the same inventory and
 * options give the same plan, byte for byte, and the same plan_id. Fails closed (-EINVAL)
 * when a destination byte has no source, naming the tensor and the uncovered box. The
 * inventory must outlive the plan.
 * Replica choice: a destination cell that some source on the destination's host holds is
 * copied locally from one of those (the one that has given the fewest local bytes so far,
 * then the lowest piece id); only cells no same-host source holds go over the network, to
 * the holder minimising max(sender network bytes, link bytes). Local bytes load no link and
 * no sender's network share. Without hosts (RF_HOST_NONE everywhere) nothing is local and
 * the plan is what it was before hosts existed. */
int rf_plan_build(const rf_inv *inv, const rf_plan_opts *opts, rf_plan **out, rf_err *err);
void rf_plan_free(rf_plan *plan);

/* A digest (BLAKE2b, 32 bytes) of the inventory and the options: two daemons holding plans
 * with the same id hold the same plan. Endpoints' hosts are in it when any endpoint has one
 * (an inventory without hosts keeps the id it had before hosts existed). */
#define RF_PLAN_ID_BYTES 32                        /* BLAKE2b-256 */
#define RF_PLAN_ID_HEX (2 * RF_PLAN_ID_BYTES + 1)  /* with its NUL */
const uint8_t *rf_plan_id(const rf_plan *plan);
void rf_plan_id_hex(const rf_plan *plan, char out[RF_PLAN_ID_HEX]);
/* The one hex encoder of plan ids (libsodium's), for ids held without their plan. */
void rf_plan_id_to_hex(const uint8_t id[RF_PLAN_ID_BYTES], char out[RF_PLAN_ID_HEX]);
/* The same digest without building a plan. */
void rf_plan_digest(const rf_inv *inv, const rf_plan_opts *opts, uint8_t out[RF_PLAN_ID_BYTES]);

const rf_inv *rf_plan_inv(const rf_plan *plan);
uint64_t rf_plan_nxfers(const rf_plan *plan);
uint32_t rf_plan_nmsgs(const rf_plan *plan);
uint32_t rf_plan_nrounds(const rf_plan *plan);
const rf_plan_xfer *rf_plan_xfer_at(const rf_plan *plan, uint64_t i);
const rf_plan_msg *rf_plan_msg_at(const rf_plan *plan, uint32_t i); /* sorted by (round, src_ep, dst_ep) */
const rf_box *rf_plan_box(const rf_plan *plan, uint32_t i);
const rf_plan_stats *rf_plan_stats_get(const rf_plan *plan);
size_t rf_plan_memory(const rf_plan *plan); /* bytes held by the plan */
/* Bytes sent by source endpoint ep / received by destination endpoint ep. */
uint64_t rf_plan_sent_bytes(const rf_plan *plan, uint32_t ep);
uint64_t rf_plan_recv_bytes(const rf_plan *plan, uint32_t ep);
/* Of those, the bytes endpoint ep sends (a source) or receives (a destination) on one path
 * (kind: RF_PLAN_DIRECT, RF_PLAN_PACKED or RF_PLAN_LOCAL); 0 for a bad ep or kind. */
uint64_t rf_plan_path_bytes(const rf_plan *plan, uint32_t ep, uint32_t kind);

#endif
