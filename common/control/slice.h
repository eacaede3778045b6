/* common/control/slice.h - the bridge between the cluster plan and each daemon: a daemon's local
 * inventory to and from its protobuf form, the coordinator's merge of every daemon's inventory
 * into one, the plan slice each daemon receives, and the transfer job a slice becomes. */
#ifndef RF_SLICE_H
#define RF_SLICE_H

#include <stdint.h>

#include "layout.h"
#include "plan.h"
#include "qshadow.h"
#include "refit.pb-c.h"
#include "xfer.h"

/* Builds the Inventory message of a daemon's local inventory (pieces of one side, in id
 * order). The message's arrays are malloc'd; rf_slice_inv_msg_free releases them. */
int rf_slice_inv_pack(const rf_inv *local, rf_side side, uint64_t generation,
                      Refit__Inventory *out);
void rf_slice_inv_msg_free(Refit__Inventory *msg);

/* Where each member's local ids start in the merged (global) inventory. Members are the
 * daemons in a fixed order (publishers by index, then receivers by index); member m's
 * endpoints all get node m. */
typedef struct rf_slice_member {
    rf_side side;
    uint32_t ep_base, nep;
    uint32_t region_base, nregion;
    uint32_t piece_base, npiece; /* piece ids of the member's side */
} rf_slice_member;

typedef struct rf_slice_map {
    uint32_t nmembers;
    rf_slice_member *members;
    uint32_t *ep_member; /* global endpoint -> member */
} rf_slice_map;

/* Merges the inventories (one per member, sides[m] saying which side member m serves) into
 * a new global inventory. A tensor described differently by two members, a piece naming a
 * region or tensor that its member did not send, or any piece that fails validation is an
 * error naming the member and the tensor. */
int rf_slice_merge(Refit__Inventory *const *invs, const rf_side *sides, uint32_t nmembers,
                   rf_inv **global, rf_slice_map *map, rf_err *err);
void rf_slice_map_free(rf_slice_map *map);

/* The slice of member m: every message it sends or receives, with transfers in its local
 * piece ids, split into frames of at most max_xfers transfers each. *out is a malloc'd array
 * of *nout messages; free each with rf_slice_msg_free, then the array. peers holds the data
 * address of every member (nmembers entries) and daemon ids. */
typedef struct rf_slice_peer {
    uint64_t daemon_id;
    const char *data_addr;
    Refit__Role role;
    const char *local_sock; /* a publisher's trainer socket, NULL or "" when not shared */
    uint64_t generation;    /* the member's inventory generation the plan is built on */
} rf_slice_peer;

/* A publisher's messages of kind RF_PLAN_LOCAL are left out of its slice (the receiver's
 * daemon copies them); a receiver's carry each transfer's source piece in the publisher's
 * local ids. A receiver's slice also holds the relays it forwards (rf_plan_msg.relay; send =
 * true, pieces its own destination pieces: it sends bytes it received earlier in the refit). ranks: every member's endpoints that have network messages, numbered in global
 * endpoint order, form the NCCL world. */
int rf_slice_build(const rf_plan *plan, const rf_slice_map *map, uint32_t m,
                   const rf_slice_peer *peers, uint64_t generation, uint32_t max_xfers,
                   const uint8_t *nccl_id, Refit__PlanSlice ***out, size_t *nout);
void rf_slice_msg_free(Refit__PlanSlice *s);

/* On a daemon: the job its slice frames turn into. Add every frame in order; the job is
 * complete after the frame with last = true. Pieces are resolved against the local inventory
 * and each region's mapped base (bases indexed by local region id). */
/* An FP8 destination piece that transfers off its format's grid reach (a trainer's shard
 * boundary cuts its blocks): they land in the tensor's dtype in this buffer (qshadow.h: in
 * the piece's memory, host or GPU), dense over the piece's box, and rf_slice_job_quantize
 * quantizes their blocks into the piece. */
typedef struct rf_slice_shadow {
    uint32_t piece;          /* local piece id */
    rf_xfer_item fp8;        /* the FP8 piece as an item (box set per block run) */
    rf_piece dense;          /* the buffer as a piece of the tensor (region unused) */
    rf_qshadow mem;
} rf_slice_shadow;

/* A run of blocks of a shadow to quantize: the hull on the grid of one transfer's box. */
typedef struct rf_slice_qrun {
    uint32_t shadow;
    rf_box box;
} rf_slice_qrun;

typedef struct rf_slice_job {
    rf_xfer_job job;         /* version set per refit by the caller: the network messages */
    rf_xfer_job ljob;        /* the local messages (RF_PLAN_LOCAL), for the local transport */
    uint64_t lbytes;         /* bytes of ljob */
    uint8_t plan_id[RF_PLAN_ID_BYTES];
    bool complete;
    uint64_t generation;
    uint32_t npeers;
    rf_slice_peer *peers;    /* data_addr strings owned by the job */
    uint64_t bytes;          /* bytes this daemon sends or receives */
    uint32_t ep_base;        /* global endpoint id of local endpoint 0 */
    uint32_t nranks;         /* endpoints with network messages: the NCCL world's size */
    uint32_t nlocal_eps;
    uint32_t *ranks;         /* NCCL rank of each local endpoint, nranks for none */
    bool has_nccl_id;
    uint8_t nccl_id[RF_XFER_NCCL_ID_BYTES];
    uint32_t cap_msgs, cap_lmsgs;
    uint32_t nshadows;
    uint64_t cap_shadows;
    rf_slice_shadow *shadows;
    uint64_t nqruns, cap_qruns;
    rf_slice_qrun *qruns;    /* sorted and unique once the slice is complete */
    uint64_t shadow_bytes;
} rf_slice_job;

/* Where the source pieces of local messages are: the local inventory of the publisher at peer
 * index p and the base of each of its regions as mapped in this process (see rf_export). */
typedef struct rf_slice_src {
    const rf_inv *inv;
    uint8_t *const *bases;
} rf_slice_src;

void rf_slice_job_init(rf_slice_job *j);
/* srcs: one entry per peer of the slice (frame->n_peers), or NULL for a slice without local
 * messages; a local message whose peer has no source (inv NULL) is an error. A relay sent
 * from memory this daemon has not mapped (bases[region] NULL: an engine's in-process region)
 * is refused with -EOPNOTSUPP. */
int rf_slice_job_add(rf_slice_job *j, const Refit__PlanSlice *frame, const rf_inv *local,
                     rf_side side, uint8_t *const *bases, const rf_slice_src *srcs,
                     rf_err *err);
void rf_slice_job_reset(rf_slice_job *j);
/* Quantize on the receiver (issue 15): after every message of the refit landed, the blocks
 * that transfers off an FP8 piece's grid brought into its shadow are quantized into the piece
 * and its scales, by the host or by the piece's GPU. 0, -ENOMEM, or the GPU's failure. */
int rf_slice_job_quantize(rf_slice_job *j, rf_err *err);

/* Without daemons (a process that drives a plan's transports itself: benchmarks, tests): one
 * side of plan message mi as a transport message. Items point into bases[region of the piece
 * on that side] (a relay's RF_SRC side is its source's destination pieces); peer is the caller's index of the other side's transport; ep and peer_ep are
 * the plan's endpoint ids. out->items is malloc'd (free it). -ENOMEM. */
int rf_slice_msg_from_plan(const rf_plan *plan, uint32_t mi, rf_side side,
                           uint8_t *const *bases, uint32_t peer, rf_xfer_msg *out, rf_err *err);
/* Without daemons, for the local transport: every message of the plan, whatever its kind, as a
 * local copy (RF_PLAN_LOCAL, peer 0): destination items and their source twins in
 * bases[region of the piece], transfers tiled in plan order. Fills job's messages and rounds;
 * version, timeout and verify are the caller's. -ENOMEM (job empty). */
int rf_slice_local_job_from_plan(const rf_plan *plan, uint8_t *const *bases, rf_xfer_job *job,
                                 rf_err *err);
void rf_slice_local_job_free(rf_xfer_job *job);

#endif
