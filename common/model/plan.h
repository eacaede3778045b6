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
    uint32_t relay;            /* 0 (the default): every destination byte comes from a source
                                  endpoint. 1: relays (below) may forward bytes between
                                  destination endpoints. Other values are refused. Part of the
                                  plan id only when on, so plans without relays keep their ids. */
} rf_plan_opts;

void rf_plan_opts_default(rf_plan_opts *o);

/* Relays (rf_plan_opts.relay). Engines usually outnumber trainers, and every engine replica
 * holds the same bytes, so with relays a destination piece may be fed by another destination
 * piece with the same tensor, box and strides (a replica on another endpoint) that received
 * those bytes earlier in the plan, instead of by a trainer. Replicas form trees per chunk:
 * a piece larger than RF_PLAN_RELAY_CHUNK (or half the staging budget, if smaller) is cut
 * into chunks along its outer dims, and each chunk has its tree (at most
 * RF_PLAN_RELAY_FANOUT children per holder, filled breadth first), so that a relay forwards
 * chunk c while it receives chunk c+1 (the rounds make the pipeline).
 * - A relay message has rf_plan_msg.relay != 0 (the hop count: 1 when its source endpoint
 *   got the bytes from trainers). Its src_ep is a DESTINATION endpoint, and the `src` of each
 *   of its transfers is a DESTINATION piece id (rf_inv_piece(inv, RF_DST, src)) whose memory
 *   holds the box once written. A message with relay == 0 is read as before.
 * - Ordering rule: a relay message in round r reads only bytes that its source endpoint
 *   received in messages of rounds < r. A daemon therefore starts a round's relay sends only
 *   after its receives of all earlier rounds are complete; nothing else orders rounds.
 * - Relay messages are direct or packed (never local): a packed relay uses staging on both
 *   ends like any packed message, within half the budget per endpoint and round.
 * - FP8 replicas (one format) relay their payload, FP8 elements and scales, in packed
 *   messages and chunks of whole blocks; a plan whose FP8 replicas the receivers quantize (the
 *   trainers' shards cut their blocks) is refused with relays on.
 * - Replica choice minimises the busiest link (bytes an endpoint sends or receives over the
 *   network, relayed bytes counted on both ends): a replica forwards only while its relay
 *   sends stay within the largest engine ingress, which is the floor of any plan.
 * - Only network paths relay: a destination endpoint that shares a host with some source
 *   endpoint is planned as without relays (its same-host cells copied locally) and relays
 *   nothing, since its local copies run beside the network rounds, unordered by them. */
/* Relay trees: the replicas of one chunk (every relay of it moves the chunk's whole box) form
 * trees, each rooted at a replica that the sources fed. That replica received the chunk in
 * the tree's ORIGIN transfers, trainers' transfers whose boxes tile the chunk; every other
 * replica of the tree received it in one RELAY transfer. A relay reads its own memory, so no
 * message digest proves that it forwarded what the trainers sent: the verification checks
 * each relay transfer's bytes against its tree's origins end to end (xfer.h, "Relays").
 * Transfers are named by their index in message order (rf_plan_xfer_at). */
#define RF_PLAN_NO_CHUNK UINT32_MAX
#define RF_PLAN_RELAY_CHUNK (16ull << 20)
#define RF_PLAN_RELAY_MAX_DEPTH 16 /* hops from a trainer, at most */
#define RF_PLAN_RELAY_FANOUT 4     /* replicas one holder of a chunk feeds, at most */

/* One transfer: the bytes of `box` (global coordinates of the tensor of both pieces) go from
 * source piece src to destination piece dst. Packed transfers lie in their message's payload
 * at msg_off, as the box's elements in row-major order. */
typedef struct rf_plan_xfer {
    uint32_t src;    /* source piece id; a destination piece id in a relay message */
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
    uint32_t relay; /* 0: from a source endpoint; else a relay of that many hops (above) */
    uint32_t pad_;  /* always 0 */
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
    /* Relays. direct_bytes and packed_bytes include relayed bytes; the per-endpoint sent bytes
     * of a destination endpoint are the bytes it relays. max_sender_bytes and
     * mean_sender_bytes are over source endpoints; max_link_bytes covers relay links too. */
    uint64_t source_bytes;     /* bytes source endpoints send (network and local) */
    uint64_t relay_bytes, relay_transfers, relay_messages;
    uint64_t max_relay_sender_bytes; /* most bytes one destination endpoint relays */
    uint64_t relay_chunk_bytes;      /* largest relay unit (the pipeline's step) */
    uint32_t relay_depth;            /* most hops of any relay */
    uint32_t relay_fanout;           /* most replicas one holder of a chunk feeds */
    uint64_t relay_depth_bytes[RF_PLAN_RELAY_MAX_DEPTH + 1]; /* bytes received per hop count */
    /* FP8 (issue 15): transfers into FP8 destination pieces, quantized by their sender (the
     * publisherd gathering them, or the receiverd's local copy); their bytes (FP8 elements
     * and scales) are also counted on their path above. */
    uint64_t quant_bytes, quant_transfers;
    /* Transfers into FP8 pieces whose box a trainer's shard cuts off the grid: they carry
     * the tensor's dtype and the receiver quantizes (bytes in that dtype). */
    uint64_t recv_quant_bytes, recv_quant_transfers;
    /* Transfers from trainers' FP8 pieces into engines' FP8 pieces of the same format: the
     * sender copies its FP8 elements and scales (the same payload as a quantized one). */
    uint64_t fp8_copy_bytes, fp8_copy_transfers;
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
/* Relay trees (above): how many trees have a relay; the tree of transfer i (an origin or a
 * relay), RF_PLAN_NO_CHUNK for a transfer of none (no relays, or a tree without a relay);
 * tree c's origins and relays, as transfer indices in message order (empty for a bad c). */
uint32_t rf_plan_nchunks(const rf_plan *plan);
uint32_t rf_plan_xfer_chunk(const rf_plan *plan, uint64_t i);
void rf_plan_chunk(const rf_plan *plan, uint32_t c, const uint32_t **origins,
                   uint32_t *norigins, const uint32_t **relays, uint32_t *nrelays);
/* Bytes sent by endpoint ep (a source, or a destination relaying) / received by destination
 * endpoint ep. */
uint64_t rf_plan_sent_bytes(const rf_plan *plan, uint32_t ep);
uint64_t rf_plan_recv_bytes(const rf_plan *plan, uint32_t ep);
/* Of those, the bytes endpoint ep sends (a source) or receives (a destination) on one path
 * (kind: RF_PLAN_DIRECT, RF_PLAN_PACKED or RF_PLAN_LOCAL); 0 for a bad ep or kind. A
 * destination's relay sends are not in it. */
uint64_t rf_plan_path_bytes(const rf_plan *plan, uint32_t ep, uint32_t kind);

/* The time model of `refitctl plan` and bench_plan: every GPU sends and receives at once over
 * its own link of link_Bps bytes/s; local copies run beside it at local_Bps.
 * network_s: max over endpoints of max(network bytes sent, network bytes received) / link_Bps;
 * local_s:   max over endpoints of local bytes / local_Bps;
 * fill_s:    relays only: the pipeline's fill and drain. A holder forwards a chunk to its
 *            children one after the other, so the last chunk reaches the deepest replica
 *            relay_depth * relay_fanout chunk times (relay_chunk_bytes / link_Bps) after
 *            the sources sent it, at most;
 * predicted_s = max(network_s, local_s) + fill_s;
 * floor_s:   max over destination endpoints of the network bytes it must take in / link_Bps
 *            (what it holds less what it copies locally): no plan of this inventory on these
 *            links is faster. Latency, staging copies and NIC limits are not modelled. */
typedef struct rf_plan_time {
    double network_s, local_s, fill_s, predicted_s, floor_s;
} rf_plan_time;
void rf_plan_predict(const rf_plan *plan, double link_Bps, double local_Bps, rf_plan_time *out);

#endif
