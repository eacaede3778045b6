/* common/model/layout.h - the data model: dtypes, tensors, boxes, memory regions and pieces, and the
 * inventory that holds every piece of a cluster (or of one daemon) compactly. */
#ifndef RF_LAYOUT_H
#define RF_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"

#define RF_MAX_DIMS 8
#define RF_NAME_MAX 256 /* longest tensor name, terminating NUL included */

typedef enum rf_dtype {
    RF_DT_BF16 = 0,
    RF_DT_FP16,
    RF_DT_FP32,
    RF_DT_FP64,
    RF_DT_FP8_E4M3,
    RF_DT_FP8_E5M2,
    RF_DT_INT8,
    RF_DT_UINT8,
    RF_DT_INT16,
    RF_DT_INT32,
    RF_DT_INT64,
    RF_DT_BOOL,
    RF_DT__COUNT
} rf_dtype;

/* Size in bytes of one element; 0 for a value outside the enum. */
size_t rf_dtype_size(rf_dtype dt);
/* "bf16", "fp32", ...; "?" for a value outside the enum. */
const char *rf_dtype_name(rf_dtype dt);
/* Accepts our names and torch's ("bfloat16", "float32", "float8_e4m3fn", ...). 0 or -EINVAL. */
int rf_dtype_parse(const char *s, rf_dtype *out);

/* A box in global tensor coordinates: start and extent per dim; the number of dims is the
 * tensor's. Unused dims are start 0, extent 1, so numel over RF_MAX_DIMS is right too. */
typedef struct rf_box {
    int64_t start[RF_MAX_DIMS];
    int64_t extent[RF_MAX_DIMS];
} rf_box;

void rf_box_full(rf_box *b, int ndim, const int64_t *shape); /* the whole tensor */
int64_t rf_box_numel(const rf_box *b, int ndim);
bool rf_box_empty(const rf_box *b, int ndim);
/* Intersection of a and b into out (out may alias a or b); false when it is empty. */
bool rf_box_intersect(const rf_box *a, const rf_box *b, int ndim, rf_box *out);
bool rf_box_contains(const rf_box *outer, const rf_box *inner, int ndim);
bool rf_box_equal(const rf_box *a, const rf_box *b, int ndim);
/* "[0:4096, 0:2048]" (start:end per dim); returns what snprintf returns. */
int rf_box_format(const rf_box *b, int ndim, char *buf, size_t len);

typedef struct rf_tensor {
    const char *name; /* owned by the inventory */
    rf_dtype dtype;
    int ndim;         /* 1..RF_MAX_DIMS (0-dim scalars are registered as shape [1]) */
    int64_t shape[RF_MAX_DIMS];
} rf_tensor;

typedef enum rf_side { RF_SRC = 0, RF_DST = 1 } rf_side;

/* An endpoint is one GPU (or one host memory domain on the host path) that holds pieces.
 * node names the daemon, for link loads; side says trainer (SRC) or engine (DST); host names
 * the machine: a source and a destination endpoint with the same host (not RF_HOST_NONE) can
 * be joined by local copies (the planner's RF_PLAN_LOCAL messages) instead of the network. */
#define RF_HOST_NONE UINT32_MAX
typedef struct rf_endpoint {
    rf_side side;
    uint32_t node;
    uint32_t host; /* RF_HOST_NONE (the default): never local to anything */
} rf_endpoint;

/* A region is one registered allocation on an endpoint (an imported IPC handle, a memfd). */
typedef struct rf_region {
    uint32_t endpoint;
    uint64_t size; /* bytes */
} rf_region;

/* The part of a tensor one client holds: the box in global coordinates, where its origin
 * lies in a region (offset, bytes) and the element strides of the local storage per dim.
 * Element i (global index start+i) is at offset + sum(i[d] * strides[d]) * dtype_size. */
typedef struct rf_piece {
    uint32_t tensor;
    uint32_t region; /* the endpoint, and so the side, follow from the region */
    uint64_t offset;
    rf_box box;
    int64_t strides[RF_MAX_DIMS];
    uint32_t quant;  /* 0: stored as the tensor's dtype; else a destination piece stored as
                        float8_e4m3fn (1 byte an element, same offset and strides) with the
                        scales of rf_inv_quant(inv, quant) (issue 15) */
} rf_piece;

/* How an FP8 destination piece keeps its scales (issue 15). The piece's matrix is its box's
 * last two dims (rows x cols of the weight; leading dims, a MoE weight's experts, each one
 * matrix); fmt's block grid starts at the tensor's origin, and the piece's box must lie on it
 * (rf_quant_box_ok for each matrix of the box). The scales of the piece's blocks lie in
 * scale_region (on the piece's endpoint) at scale_offset, scale_strides elements of the
 * format's scale dtype apart per dim of the block grid: dims before the last two are the box's
 * own (one scale grid per leading index), the last two count blocks from the box's first. */
typedef struct rf_quant_decl {
    int kind;          /* rf_quant_kind (quant_fmt.h); br x bc the block of RF_QUANT_BLOCK */
    uint32_t br, bc;
    uint32_t scale_region;
    uint64_t scale_offset;
    int64_t scale_strides[RF_MAX_DIMS];
} rf_quant_decl;

/* The inventory: tensors, endpoints, regions and pieces of both sides. Pieces are stored
 * compactly (box and strides interned, 24 bytes a piece) because a DeepSeek-V3 engine side
 * of 256 GPUs holds about 12 million of them. Indices are dense and stable: tensor ids,
 * endpoint ids, region ids and piece ids (per side) count from 0 in order of addition. */
typedef struct rf_inv rf_inv;

rf_inv *rf_inv_new(void);
void rf_inv_free(rf_inv *inv);

/* Whether name may name a tensor: 1 to RF_NAME_MAX - 1 bytes of valid UTF-8 (no overlong
 * forms, surrogates or code points past U+10FFFF) made of printable characters other than
 * space, quotes (" ') and backslash. Refused besides: control characters (C0 with newline and
 * tab, DEL, C1), the line and paragraph separators and the bidirectional controls, which
 * change how a line reads. Names are printed verbatim in logs, messages and status, and no
 * framework's parameter names (model.layers.3.mlp.up_proj.weight) need any of these. 0, or
 * -EINVAL with err naming the problem, its byte offset and the name escaped. */
int rf_tensor_name_check(const char *name, rf_err *err);
/* Writes s into out (always NUL-terminated, cut with "..." when it does not fit) between
 * double quotes, with C escapes for quotes, backslashes and control characters and \xNN for
 * bytes that are not valid UTF-8: safe to print whatever s holds. Returns out. */
char *rf_name_escape(const char *s, char *out, size_t outlen);

/* Adds a tensor or returns the id of the one with this name, which must then have the same
 * dtype and shape (-EINVAL naming both otherwise). A new name must pass
 * rf_tensor_name_check. Shape dims must be >= 1. */
int rf_inv_add_tensor(rf_inv *inv, const char *name, rf_dtype dtype, int ndim,
                      const int64_t *shape, uint32_t *id, rf_err *err);
/* 0 and *id, or -ENOENT. O(1) on average. */
int rf_inv_find_tensor(const rf_inv *inv, const char *name, uint32_t *id);
int rf_inv_add_endpoint(rf_inv *inv, rf_side side, uint32_t node, uint32_t *id, rf_err *err);
/* Puts endpoint id on host (RF_HOST_NONE: on no known host); -EINVAL for a bad id. */
int rf_inv_set_endpoint_host(rf_inv *inv, uint32_t id, uint32_t host, rf_err *err);
int rf_inv_add_region(rf_inv *inv, uint32_t endpoint, uint64_t size, uint32_t *id, rf_err *err);

/* Validates and adds a piece; nothing is added on error. Checks: the tensor and region
 * exist, the box is non-empty and inside the tensor's shape, strides are >= 0 (0 only on a
 * dim of extent 1), and every element lies inside the region. The message names the tensor,
 * the box and the region size. The side is the region's endpoint's side. */
int rf_inv_add_piece(rf_inv *inv, const rf_piece *p, uint32_t *id, rf_err *err);

/* Adds an FP8 scale declaration for pieces to name (rf_piece.quant = *id, from 1). The format
 * is checked here (rf_quant_fmt_check), the rest with each piece that names it. */
int rf_inv_add_quant(rf_inv *inv, const rf_quant_decl *q, uint32_t *id, rf_err *err);
uint32_t rf_inv_nquants(const rf_inv *inv); /* ids 1..nquants */
const rf_quant_decl *rf_inv_quant(const rf_inv *inv, uint32_t id);
/* The size in bytes of one stored element of piece p (1 for an FP8 piece). */
size_t rf_inv_piece_esize(const rf_inv *inv, const rf_piece *p);
/* The block-grid box of the scales of `sub` (a block-aligned box of a tensor of shape, ndim
 * >= 2): leading dims as sub's, the last two in blocks of q's grid from the tensor's origin. */
void rf_inv_scale_box(const rf_quant_decl *q, int ndim, const int64_t *shape, const rf_box *sub,
                      rf_box *out);
/* The scales of FP8 piece p as a piece of their own: box rf_inv_scale_box of p->box, region,
 * offset and strides of its declaration, quant 0. */
void rf_inv_quant_scales(const rf_inv *inv, const rf_piece *p, rf_piece *out);

/* Checks that no two destination pieces write the same bytes of one region (exact, also for
 * strided pieces whose spans interleave). The scales of an FP8 piece count as bytes it writes:
 * they may share no byte with its own elements, nor with another piece's elements or scales.
 * Run once when an inventory is sealed; -EINVAL naming both pieces' tensors and boxes. */
int rf_inv_check_dst_overlap(const rf_inv *inv, rf_err *err);

/* A copy of in in which every source endpoint is folded into one (node 0) and every
 * destination endpoint into another (node 1), tensor, region and piece ids kept: what a single
 * GPU pair sees when each side's ranks share a GPU (one NCCL rank per GPU). A side whose
 * endpoints all share a host keeps that host (else RF_HOST_NONE). -ENOMEM, or the error of a
 * piece that does not validate. */
int rf_inv_fold_sides(const rf_inv *in, rf_inv **out, rf_err *err);

uint32_t rf_inv_ntensors(const rf_inv *inv);
uint32_t rf_inv_nendpoints(const rf_inv *inv);
uint32_t rf_inv_nregions(const rf_inv *inv);
uint32_t rf_inv_npieces(const rf_inv *inv, rf_side side);
const rf_tensor *rf_inv_tensor(const rf_inv *inv, uint32_t id);
const rf_endpoint *rf_inv_endpoint(const rf_inv *inv, uint32_t id);
const rf_region *rf_inv_region(const rf_inv *inv, uint32_t id);
/* Copies piece id of a side out of the compact store. */
void rf_inv_piece(const rf_inv *inv, rf_side side, uint32_t id, rf_piece *out);
/* Cheap accessors that avoid the copy. */
uint32_t rf_inv_piece_tensor(const rf_inv *inv, rf_side side, uint32_t id);
uint32_t rf_inv_piece_region(const rf_inv *inv, rf_side side, uint32_t id);
uint32_t rf_inv_piece_endpoint(const rf_inv *inv, rf_side side, uint32_t id);
/* Raw read-only access to the compact store, for loops over millions of pieces (the planner,
 * the plan digest). A record names the piece's tensor, region, interned geometry (box and
 * strides, shared by every piece with the same ones), offset and quant (rf_piece.quant), so
 * records of equal pieces are equal bytes. The records of a side are valid until a piece is added. */
typedef struct rf_piece_rec {
    uint32_t tensor;
    uint32_t region;
    uint32_t geom;
    uint32_t quant;
    uint64_t offset;
} rf_piece_rec;

const rf_piece_rec *rf_inv_piece_recs(const rf_inv *inv, rf_side side); /* npieces of them */
/* Interned geometries (box and strides), ids 0..ngeoms-1 in order of first use. The box has
 * unused dims (past the tensor's ndim) at start 0, extent 1, and the strides are 0 there. */
typedef struct rf_geom {
    rf_box box;
    int64_t strides[RF_MAX_DIMS];
} rf_geom;

uint32_t rf_inv_ngeoms(const rf_inv *inv);
const rf_geom *rf_inv_geoms(const rf_inv *inv); /* ngeoms of them; valid as the records are */
/* Bytes held by the inventory itself (for the planner's peak-memory report). */
size_t rf_inv_memory(const rf_inv *inv);

/* Byte offset from the region start of global element idx (which must lie in p->box). */
uint64_t rf_piece_byte_offset(const rf_piece *p, int ndim, size_t esize, const int64_t *idx);
/* Whether sub (inside p->box) is one contiguous byte range in p's memory; if so and off is
 * not NULL, *off is its first byte's offset in the region. */
bool rf_piece_contiguous(const rf_piece *p, int ndim, size_t esize, const rf_box *sub,
                         uint64_t *off);
/* Number of contiguous runs sub occupies in p's memory (dims that are contiguous in memory
 * merged), and the bytes of each run. */
uint64_t rf_piece_runs(const rf_piece *p, int ndim, size_t esize, const rf_box *sub,
                       uint64_t *run_bytes);

/* DTensor-style placements: dim >= 0 means Shard(dim), RF_REPLICATE means Replicate.
 * Computes the box that mesh coordinate coord (one per mesh dim) holds of a tensor of the
 * given shape, with torch.chunk semantics for uneven splits (chunks of ceil(n/k), the last
 * ones smaller or empty). Several mesh dims sharding one tensor dim split it in mesh order.
 * Returns false if that rank holds nothing (an empty chunk). */
#define RF_REPLICATE (-1)
bool rf_placement_box(int ndim, const int64_t *shape, int mesh_ndim, const int64_t *mesh_shape,
                      const int *placements, const int64_t *coord, rf_box *out);
/* torch.chunk of n into k parts: start and length of part i (length 0 past the end). */
void rf_chunk(int64_t n, int64_t k, int64_t i, int64_t *start, int64_t *len);

#endif
