/* common/model/model.h - synthetic models (real HF tensor names, dtypes and shapes from an
 * architecture config) and the rank layouts of both sides as the real systems lay them out: a
 * Megatron-like trainer (TP/PP/EP/ETP/DP) and a vLLM-like engine (TP/EP/DP), or SGLang's with DP
 * attention (attn=dp). Used by tests, the simulator, `refitctl plan` and the planner benchmark. */
#ifndef RF_MODEL_H
#define RF_MODEL_H

#include <stdint.h>

#include "err.h"
#include "layout.h"

typedef struct rf_model rf_model; /* opaque: arch config + tensor list with roles */

/* A builtin ("qwen3-0.6b", "qwen3-4b", "qwen3-30b-a3b", "deepseek-v3") or the path of a JSON
 * file with HF config.json keys (model_type qwen3 | qwen3_moe | deepseek_v3, plus an optional
 * "name"). -ENOENT for an unknown name, -EINVAL for a bad file; err names the key and file. */
int rf_model_load(const char *name_or_path, rf_model **out, rf_err *err);
void rf_model_free(rf_model *m);
/* A copy with the same structure (head counts, expert counts, layers) but every large dim
 * (hidden, intermediate, vocab, head_dim, lora ranks) divided by div and rounded up to a multiple
 * of gcd(dim, 16), so that a TP/ETP of up to 16 that divided a dim still divides it; for tests
 * that execute plans in host memory. */
int rf_model_shrink(const rf_model *m, int div, rf_model **out, rf_err *err);
const char *rf_model_name(const rf_model *m);
uint32_t rf_model_ntensors(const rf_model *m);
const rf_tensor *rf_model_tensor(const rf_model *m, uint32_t i); /* name, dtype, shape */
uint64_t rf_model_bytes(const rf_model *m);
/* Index of the tensor with this HF name, or -ENOENT. Linear; for tests and tools. */
int rf_model_find(const rf_model *m, const char *name, uint32_t *id);

/* A side's parallelism. Unset keys take defaults: tp = pp = ep = etp = 1; on the trainer side
 * dp = max(1, ep*etp/tp), on the engine side dp = 1. The engine's rank r is dp_rank*tp + tp_rank;
 * attention and dense weights are sharded by tp and replicated over dp. Its ep either divides
 * tp (each replica's TP group holds all experts, tp/ep ranks sharing one expert group) or equals
 * tp*dp (vLLM --enable-expert-parallel: rank r holds experts [r*E/ep, (r+1)*E/ep) whole).
 *
 * attn_dp (engine key attn=dp, attn=tp the default) is SGLang's --enable-dp-attention: tp is the
 * whole world (tp ranks, not tp*dp) and dp divides it. MoE, dense MLPs, shared experts and
 * lm_head are sharded over all tp ranks as without it (experts over ep groups of tp/ep ranks);
 * attention (q/k/v/o, MLA's q_b/kv_b/o) is sharded over attention-TP = tp/dp within each of the
 * dp groups of consecutive ranks, so dp = tp replicates it whole on every rank; the vocabulary
 * embedding is held whole by every rank (SGLang builds VocabParallelEmbedding with
 * enable_tp=not is_dp_attention_enabled()). */
typedef struct rf_par {
    int tp, pp, ep, etp, dp;
    int attn_dp; /* engine: 1 for SGLang's DP attention (attn=dp) */
} rf_par;

/* Parses "tp=2,pp=2,ep=4,dp=2" (integer keys) and "attn=dp|tp" for a side (the empty string
 * gives the defaults) and checks it against the model; each problem gets one line in err naming
 * it. */
int rf_par_parse(const char *s, rf_side side, const rf_model *m, rf_par *out, rf_err *err);
int rf_par_world(const rf_par *p, rf_side side); /* number of ranks */

/* One rank's share: its regions (sizes) and pieces, pieces' region indices local to the rank
 * (0..nregions-1, each region emitted before its pieces). Emitted through callbacks so that
 * 256 ranks x 45k pieces never sit in memory twice. A callback's negative return stops the
 * generation and is returned as is (the callback may fill err through its ctx). */
typedef struct rf_rank_sink {
    void *ctx;
    int (*region)(void *ctx, uint32_t local_region, uint64_t size);
    int (*piece)(void *ctx, const rf_piece *p); /* p->region is the local region index,
                                                   p->tensor the model tensor index */
} rf_rank_sink;
int rf_model_rank(const rf_model *m, const rf_par *p, rf_side side, int rank,
                  const rf_rank_sink *sink, rf_err *err);

/* Adds all tensors of m, then every rank of both sides as endpoints (node = rank /
 * gpus_per_node; the engine side's nodes numbered after the trainer side's), their regions and
 * pieces, to inv. Endpoint ids: trainer ranks first, in rank order, then engine ranks. */
int rf_model_build_inv(const rf_model *m, const rf_par *src, const rf_par *dst,
                       int gpus_per_node, rf_inv *inv, rf_err *err);

#endif
