/* common/data/xfer.h - the data path's transport interface: the job a daemon runs for one refit (its
 * slice of the plan, resolved to local memory) and what a transport does with it, whichever
 * backend moves the bytes (the core is xfer.c; backends follow xfer_core.h). */
#ifndef RF_XFER_H
#define RF_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "err.h"
#include "layout.h"
#include "plan.h"

/* One transfer, seen from the local side: the sub-box `box` of the local piece, whose
 * memory is `base` (the mapped start of the piece's region). In a packed message the box's
 * elements lie, row-major and dense, at msg_off in the payload; a direct message has exactly
 * one item, contiguous in local memory, whose bytes are the whole payload. */
/* An FP8 transfer (issue 15): the destination piece is float8_e4m3fn with scales, and the
 * sending side quantizes. Its payload at msg_off is the box's FP8 elements, row-major (numel
 * bytes), then the scales of the box's blocks, row-major over its block grid
 * (rf_qcopy_bytes); the item's bytes are both. */
typedef struct rf_xfer_quant {
    rf_quant_decl q;      /* kind 0: not quantized. Format (kind, br, bc) on both sides; the
                             scale fields only on the receiving side */
    rf_dtype dt;          /* the tensor's dtype, quantized from */
    int64_t rows, cols;   /* the tensor's last two dims: the matrix the grid lies on */
    uint8_t *scale_base;  /* receiving side: the mapped start of the scales' region */
    rf_piece scale;       /* receiving side: the piece's scales (rf_inv_quant_scales) */
} rf_xfer_quant;

/* Relays' end-to-end check (plan.h, "Relay trees"). A relay forwards bytes from its own
 * memory, so the digests of its messages prove only that they arrived as the relay sent them.
 * Each replica fed by a relay therefore also checks what it received against what the
 * trainers sent: for every origin transfer t of the tree, its sender adds, per relay transfer
 * r of the tree, the TERM H(r, t, C) with C the digest of t's payload, and the receiver of r
 * adds the same term over the bytes of t's box in what it received (see rf_xfer_result). A
 * term names its recipient r, so that wrong bytes which reach two replicas alike do not
 * cancel. An origin transfer as the relay's receiver sees it: */
typedef struct rf_xfer_origin {
    uint64_t id;          /* the origin transfer (its index in the plan) */
    uint32_t seq;         /* its message's: verify = sample picks an origin by it */
    rf_box box;           /* inside the relay item's box; on the FP8 grid for an FP8 item */
} rf_xfer_origin;

typedef struct rf_xfer_item {
    uint8_t *base;
    rf_piece piece;
    int ndim;
    size_t esize;         /* of the piece's stored elements: 1 for an FP8 destination */
    rf_box box;
    uint64_t msg_off, bytes;
    rf_xfer_quant quant;
    /* End to end (above), 0 and NULL elsewhere: the sending end of an origin transfer lists
     * the nrelay_to relay transfers whose receivers check its bytes; the receiving end of a
     * relay transfer lists the norigins origins whose boxes tile its own. id is this
     * transfer's index in the plan. */
    uint64_t id;
    uint32_t nrelay_to, norigins;
    const uint64_t *relay_to;
    const rf_xfer_origin *origins;
} rf_xfer_item;

/* One message of the plan, local side. seq is the message's index in the global plan, the
 * same on both ends, and names the message on the wire. */
typedef struct rf_xfer_msg {
    uint32_t seq;
    uint32_t round, kind; /* kind: rf_plan_kind */
    bool send;            /* this daemon sends it, else receives it */
    uint32_t peer;        /* index into the transport's peer table */
    uint32_t ep, peer_ep; /* global endpoint ids (GPUs) of this side and of the other side:
                             the NCCL ranks of the two ends */
    uint64_t bytes;
    /* A relay message (plan.h, "Relay trees"), checked end to end: every byte of it lies in
     * its receiving end's items' origins (rf_xfer_origin), whose terms cover it, so it has no
     * message digest; both ends say so, and a receiving end whose items leave a byte out is
     * refused. */
    bool e2e;
    uint32_t nitems;
    rf_xfer_item *items;
    /* RF_PLAN_LOCAL messages only (else NULL): the daemon that receives the message copies it
     * itself, from the source's memory mapped here. items are then the destination side and
     * src_items[i] (nitems entries) the source side of the same transfer: same box (global
     * coordinates), esize, msg_off and bytes, another piece. send is false, peer the source's
     * daemon. Only the local transport (rf_xfer_local_new) takes them. */
    rf_xfer_item *src_items;
} rf_xfer_msg;

/* A verification digest (BLAKE2b-256) and an NCCL unique id (ncclUniqueId, sent in plan
 * slices), in bytes. */
#define RF_XFER_DIGEST_BYTES 32
#define RF_XFER_DIGEST_SEED_BYTES 32
#define RF_XFER_NCCL_ID_BYTES 128

/* How much of the moved bytes is digested (the config's `verify`, the job's verify): one enum
 * from the config file to the transports. */
typedef enum rf_verify { RF_VERIFY_OFF = 0, RF_VERIFY_SAMPLE = 1, RF_VERIFY_FULL = 2 } rf_verify;
/* verify = sample digests the first RF_XFER_SAMPLE_BYTES of one message in
 * RF_XFER_SAMPLE_EVERY (by seq, so both ends agree): cheap enough to leave on, and it still
 * catches a peer that installs another version or a misrouted message. */
#define RF_XFER_SAMPLE_EVERY 16
#define RF_XFER_SAMPLE_BYTES (64u << 10)

/* Everything one daemon sends and receives in one refit. Messages are sorted by round; a
 * daemon sends its messages to one peer in the order they appear here, and its peers'
 * jobs list them in the same order (both come from the one plan). */
typedef struct rf_xfer_job {
    uint64_t version;
    uint32_t nrounds, nmsgs;
    rf_xfer_msg *msgs;
    /* This daemon's staging budget, 0 for none: the plan's budget per endpoint times the
     * endpoints this daemon drives. One round's packed payloads (sent and received, a
     * message to itself counted twice) must fit in it; two rounds are in flight at once
     * when they fit together. */
    uint64_t staging_bytes;
    double timeout_s; /* deadline for the whole job, from rf_xfer_run; > 0 */
    bool checked;           /* rf_xfer_job_check passed on these messages already (a daemon
                               checks its cached slice once, not at every refit: 100k-tensor
                               jobs take ~0.1 s to check) */
    int verify;             /* RF_VERIFY_OFF, _FULL (every message) or _SAMPLE (the
                               messages rf_xfer_msg_verified picks) */
    uint64_t plan_key;      /* 0, or a key the caller gives only to jobs with identical
                               messages (items, bases, rounds): a transport may then keep what
                               it derived from them for the next job with that key */
    /* The key of the digests that GPU paths compute (wdigest.h), the same on every daemon of
     * the cluster (the node derives it from the cluster key) and secret to them. */
    uint8_t digest_seed[RF_XFER_DIGEST_SEED_BYTES];
} rf_xfer_job;

/* What a job did. With verify on, digest_sent is the XOR over the messages this daemon sent
 * of a term of the message's seq and payload, digest_recv the same over the messages it
 * received (relay messages have none: rf_xfer_msg.e2e): BLAKE2b-256(seq as 4 bytes
 * little-endian || payload) where the payload is in host memory (tcp, the host local copies),
 * rf_wdigest_term of its lanes under the job's digest_seed where it is in GPU memory (nccl, the
 * GPU local copies, but for messages the local copies quantize to FP8, whose source is
 * quantized on the host to check them); both ends of a message take the same one. For relays,
 * digest_sent XORs the terms of the origin transfers this daemon sent, digest_recv those of
 * the relay transfers it received (rf_xfer_origin, rf_xfer_e2e_term). The XOR of every
 * daemon's digest_sent equals the XOR of every daemon's digest_recv when every byte arrived as
 * sent and every relay forwarded the trainers' bytes. */
typedef struct rf_xfer_result {
    int code; /* 0 or a negative errno */
    char error[256];
    uint64_t bytes_sent, bytes_recv; /* payload bytes */
    double seconds;
    uint8_t digest_sent[RF_XFER_DIGEST_BYTES], digest_recv[RF_XFER_DIGEST_BYTES];
    uint64_t peak_staging; /* most staging bytes held at once */
} rf_xfer_result;

/* A transport: one of the backends below behind the transport core (xfer.c), which runs one
 * job at a time on a worker thread and reports to the loop thread. */
typedef struct rf_xfer_transport rf_xfer_transport;

/* Called on the loop thread when a job ends, successfully or not; res is valid during the
 * call. The transport accepts the next job from inside the callback. */
typedef void (*rf_xfer_done_cb)(rf_xfer_transport *t, const rf_xfer_result *res, void *arg);
/* Called on the loop thread once the transport's memory is released. */
typedef void (*rf_xfer_close_cb)(void *arg);

typedef struct rf_xfer_world rf_xfer_world;

/* "tcp", "nccl" or "local". */
const char *rf_xfer_name(const rf_xfer_transport *t);
/* The address a daemon announces in its Hello for data connections; "" for none (nccl
 * bootstraps from the unique id). */
const char *rf_xfer_data_addr(const rf_xfer_transport *t);
/* Payload bytes the running job has sent and received so far (refitctl watch); any thread. */
uint64_t rf_xfer_progress(const rf_xfer_transport *t);
/* The world: this daemon's index and every peer's data address (npeers entries, self
 * included; a transport that needs no address takes NULL ones). Loop thread, no job running
 * (-EBUSY otherwise). Connections to peers whose address changed are closed; the others are
 * kept. */
int rf_xfer_set_peers(rf_xfer_transport *t, uint32_t self, uint32_t npeers,
                      const char *const *addrs, rf_err *err);
/* Starts job on a worker thread; done is called on the loop thread when it ends. The job
 * and the memory it names stay valid and untouched until then. A job that cannot start
 * (invalid, another one running) returns the error and done is never called. */
int rf_xfer_run(rf_xfer_transport *t, const rf_xfer_job *job, rf_xfer_done_cb done, void *arg,
                rf_err *err);
/* Sets up, on the worker, what running job will need and the transport keeps for the next job
 * of the same plan_key (nccl: the world's communicators, the plan of execution, staging;
 * local: the copy plan, device buffers), moving nothing: the first refit of a plan then moves
 * bytes at once. Checked and reported like rf_xfer_run (done with bytes 0); the job is not
 * run. -ENOTSUP from a transport that sets jobs up only as they run (tcp). A world join waits
 * for every rank, as a job's would. */
int rf_xfer_prepare(rf_xfer_transport *t, const rf_xfer_job *job, rf_xfer_done_cb done,
                    void *arg, rf_err *err);
/* Makes the running job fail promptly with -ECANCELED (no-op when none runs). */
void rf_xfer_abort(rf_xfer_transport *t);
/* Aborts any running job (its done runs first) and releases the transport; cb, which may be
 * NULL, runs once everything is freed. The loop must keep running until then. A second close
 * does nothing. */
void rf_xfer_close(rf_xfer_transport *t, rf_xfer_close_cb cb, void *arg);

/* The NCCL world: one rank per GPU endpoint of the whole cluster (rank = global endpoint id),
 * the unique id made by the coordinator (rf_xfer_nccl_unique_id) and handed to every daemon
 * over the authenticated control connection, and the endpoints this daemon drives with the
 * CUDA device of each: its ordinal, or the CUDA UUID its clients registered the endpoint's
 * memory under ("GPU-..."), which the transport maps to this process's ordinal. */
struct rf_xfer_world {
    uint32_t nranks;
    uint32_t nlocal;
    const uint32_t *local_ranks;      /* nlocal global endpoint ids */
    const int *local_devices;         /* nlocal CUDA device ordinals, or NULL: */
    const char *const *local_uuids;   /* nlocal CUDA UUIDs, used when local_devices is NULL */
    uint8_t unique_id[RF_XFER_NCCL_ID_BYTES];
};

/* The NCCL world of the whole cluster, for transports with a collective world (0 and
 * nothing done for tcp). Loop thread, no job running (-EBUSY otherwise). Communicators are
 * made on the worker at the start of the next job. */
int rf_xfer_set_world(rf_xfer_transport *t, const rf_xfer_world *w, rf_err *err);
/* True when the transport cannot run a job until set_world gives it a world with a fresh
 * unique id (none was set yet, or a failed job tore the world down); false for tcp. */
bool rf_xfer_needs_world(const rf_xfer_transport *t);
/* Whether the transport runs in a collective world (nccl) that set_world must give it. */
bool rf_xfer_has_world(const rf_xfer_transport *t);

/* Checks a job's structure, whatever the transport (run checks it again, with the deadline):
 * messages sorted by round and inside nrounds, peers inside the table, seq unique per
 * direction, items inside their pieces and their message, a direct message one contiguous
 * item of the message's size, a packed one tiled by its items without gap or overlap, and,
 * when staging_bytes is set, each round's packed bytes inside it (-ENOSPC). The message
 * names the offending message's seq. */
int rf_xfer_job_check(const rf_xfer_job *job, uint32_t npeers, rf_err *err);
/* Whether the message of this seq is digested under the job's verify setting. */
static inline bool rf_xfer_seq_verified(const rf_xfer_job *job, uint32_t seq)
{
    return job->verify == RF_VERIFY_FULL ||
           (job->verify == RF_VERIFY_SAMPLE && seq % RF_XFER_SAMPLE_EVERY == 0);
}

/* How many leading bytes of a verified payload of `bytes` the digest covers. */
static inline uint64_t rf_xfer_digest_bytes(const rf_xfer_job *job, uint64_t bytes)
{
    if (job->verify == RF_VERIFY_SAMPLE && bytes > RF_XFER_SAMPLE_BYTES)
        return RF_XFER_SAMPLE_BYTES;
    return bytes;
}

/* Whether the payload of m has a message digest under the job's verify setting (a relay
 * message checked end to end has none). */
static inline bool rf_xfer_msg_verified(const rf_xfer_job *job, const rf_xfer_msg *m)
{
    return !m->e2e && rf_xfer_seq_verified(job, m->seq);
}

/* How many leading payload bytes of a verified message the digest covers. */
static inline uint64_t rf_xfer_msg_digest_bytes(const rf_xfer_job *job, const rf_xfer_msg *m)
{
    return rf_xfer_digest_bytes(job, m->bytes);
}

/* Relays' end-to-end check (rf_xfer_origin): both ends of an origin transfer t pick it by the
 * seq of t's message, as for a message digest, and digest the first rf_xfer_digest_bytes of
 * t's payload (its box's elements row-major; for FP8, then its blocks' scales). The term of
 * relay transfer `relay` for origin `origin` whose payload digest (BLAKE2b-256) is content:
 * BLAKE2b-256("refit-relay-e2e-v1" || relay || origin (8 bytes little-endian each) ||
 * content). */
void rf_xfer_e2e_term(uint64_t relay, uint64_t origin, const uint8_t content[RF_XFER_DIGEST_BYTES],
                      uint8_t out[RF_XFER_DIGEST_BYTES]);

/* The digest seed of a cluster (rf_xfer_job.digest_seed): HMAC-SHA256(key,
 * "refit-wdigest-seed-v1"), the same on every daemon and in-process installer that holds the
 * cluster key or is given the seed. */
void rf_xfer_digest_seed(const uint8_t *key, size_t key_len,
                         uint8_t out[RF_XFER_DIGEST_SEED_BYTES]);

/* Where a direct message's bytes lie in local memory (after rf_xfer_job_check). */
uint8_t *rf_xfer_direct_ptr(const rf_xfer_msg *m);

/* What a daemon's data path is made of: its transport = tcp or nccl setting, and what tcp
 * needs (nccl needs nothing at creation: its world comes with every plan). */
typedef struct rf_xfer_open_opts {
    bool nccl;               /* else tcp */
    const char *listen_addr; /* tcp: the data listener, "host:port" (port 0 picks one) */
    const uint8_t *key;      /* tcp: the cluster key, at least RF_XFER_TCP_KEY_MIN bytes */
    size_t key_len;
} rf_xfer_open_opts;

/* Makes the transport a daemon runs: nccl, or tcp listening on listen_addr with its data
 * connections authenticated by key; rf_xfer_data_addr then gives what the daemon announces.
 * 0, or a negative errno with err saying what to change (-ENOTSUP for nccl in a build without
 * CUDA). */
int rf_xfer_open(uv_loop_t *loop, const rf_xfer_open_opts *o, rf_xfer_transport **out,
                 rf_err *err);

/* The tcp transport: host memory over TCP data sockets between daemons. The data listener
 * is bound at creation on listen_addr ("host:port", "[v6]:port"; port 0 picks one);
 * rf_xfer_tcp_addr gives the bound address for the daemon's Hello. One connection per peer
 * pair and direction, made when first needed and kept between jobs; after a failed job all
 * are closed and the next job reconnects. Staging buffers (at most the budget) are kept
 * between jobs too, and released by close. */
int rf_xfer_tcp_new(uv_loop_t *loop, const char *listen_addr, rf_xfer_transport **out,
                    rf_err *err);
/* The cluster key (at least RF_XFER_TCP_KEY_MIN bytes, copied) that data connections are
 * authenticated with (data protocol 3): both ends prove it over fresh nonces of both
 * (HMAC-SHA256), the connector sends nothing until the acceptor has, and every frame header and
 * 256 KiB payload segment then carries a Poly1305 tag under a key of that connection, counted
 * per connection. A connection that does not prove the key is dropped and logged without
 * disturbing the job; a frame whose tag fails fails the job with -EBADMSG and nothing of it is
 * installed. A transport without a key
 * refuses jobs. Loop thread, no job running. Returns 0, -EINVAL (not a tcp transport, key
 * too short), -EBUSY (a job runs or the transport is closing) or -ENOMEM; a changed key
 * closes the connections made under the old one. */
#define RF_XFER_TCP_KEY_MIN 32
int rf_xfer_tcp_set_key(rf_xfer_transport *t, const uint8_t *key, size_t len);
const char *rf_xfer_tcp_addr(const rf_xfer_transport *t);

/* The local transport: RF_PLAN_LOCAL messages, copies from memory of a trainer on this host
 * (imported by this daemon) straight into its engines' memory, on the worker (no staging, no
 * network): host memory with memcpy (threads where it pays), or, with gpu, device memory with
 * the batched copy kernels and cudaMemcpyAsync on a stream per device. Its jobs hold only
 * local messages; with verify on, a message's digest goes into digest_sent from the source
 * bytes read before the copy and into digest_recv from the destination bytes after it, so the
 * daemon's XOR is zero exactly when the copy is right. Needs no peers' addresses and no world
 * (set_peers with NULL addresses names the source daemons). */
int rf_xfer_local_new(uv_loop_t *loop, bool gpu, rf_xfer_transport **out, rf_err *err);

/* The nccl transport (built with CUDA only, RF_HAVE_CUDA): GPU memory between the cluster's
 * GPU endpoints with NCCL send/recv, one ncclGroupStart/End per round over every local GPU;
 * packed messages gathered into per-GPU device staging with the copy kernels and scattered
 * after, direct ones sent from and received into the items' device memory. Needs set_peers
 * (the peer table names peers in messages) and set_world before its first job; after a failed
 * or aborted job its communicators are aborted and needs_world is true until set_world gives
 * a fresh unique id. Staging (at most the job's budget, split over the local GPUs) is kept
 * between jobs and released by close. */
int rf_xfer_nccl_new(uv_loop_t *loop, rf_xfer_transport **out, rf_err *err);
/* A fresh NCCL unique id (ncclGetUniqueId), for the coordinator to hand out: it holds the
 * bootstrap address of the process that calls this, which must stay up while ranks join. */
int rf_xfer_nccl_unique_id(uint8_t out[RF_XFER_NCCL_ID_BYTES], rf_err *err);
/* Device memory the transport holds now: staging and descriptor buffers over all local GPUs
 * (NCCL's own buffers not included), and the most it held at once since creation. */
void rf_xfer_nccl_memory(const rf_xfer_transport *t, uint64_t *now, uint64_t *peak);
/* Tuning of the nccl transport, for benchmarks and for operators who measured their own
 * machines. Zero fields keep the defaults. The diagnostic flags leave out the copies or the
 * wire to time the rest: the bytes are then wrong, never use them in a refit. */
enum { RF_XFER_NCCL_DIAG_NO_COPY = 1, RF_XFER_NCCL_DIAG_NO_WIRE = 2 };
typedef struct rf_xfer_nccl_tuning {
    unsigned copy_blocks; /* blocks per gather/scatter launch (0: 16 per SM) */
    unsigned window;      /* rounds enqueued at once without verification, 1..4 (0: 4) */
    unsigned diag;        /* RF_XFER_NCCL_DIAG_* */
} rf_xfer_nccl_tuning;
/* -EBUSY while a job runs, -EINVAL for a window above 4 or unknown flags. */
int rf_xfer_nccl_tune(rf_xfer_transport *t, const rf_xfer_nccl_tuning *tu, rf_err *err);

#endif
