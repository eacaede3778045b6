/* common/control/srcmap.h - a receiverd's view of the trainers' memory on its own host: for each
 * local publisherd, its exported regions (rf_export_fetch over the publisherd's socket) imported
 * into this process once per publisher inventory generation and kept until a plan no longer
 * names it, so a warm refit opens no handle. What the local transport copies from. */
#ifndef RF_SRCMAP_H
#define RF_SRCMAP_H

#include <stdint.h>

#include "err.h"
#include "export.h"
#include "slice.h"

typedef struct rf_srcmap rf_srcmap;

/* How a process without the key gets an export (an engine's installer asks its receiverd): the
 * export of pieces (sorted, unique; the publisher's local ids) of publisher daemon_id at
 * generation, or the error. */
typedef int (*rf_srcmap_fetch_fn)(void *ctx, uint64_t daemon_id, uint64_t generation,
                                  const char *socket_path, const uint32_t *pieces,
                                  size_t npieces, rf_export **out, rf_err *err);

/* key: the cluster key (proves this daemon to the publisherd); timeout_s bounds one fetch. */
int rf_srcmap_new(const uint8_t *key, size_t key_len, double timeout_s, rf_srcmap **out,
                  rf_err *err);
/* The same for a process without the key: fetch gets each export. */
int rf_srcmap_new_fetcher(rf_srcmap_fetch_fn fetch, void *ctx, rf_srcmap **out, rf_err *err);
/* Unmaps everything: call when no job reads from it any more. */
void rf_srcmap_free(rf_srcmap *m);

/* The publisher daemon_id at generation, with the regions of pieces (npieces of the
 * publisher's local ids; sorted in place) fetched from socket_path and imported unless held
 * already: *out (its inventory and the bases of the regions granted so far, NULL for the
 * others) stays valid until an rf_srcmap_prune that does not keep it. Only the pieces whose
 * memory is not mapped yet are asked for. A publisher that answers with another generation
 * than the plan's is -ESTALE (its trainers changed; the coordinator replans). */
int rf_srcmap_get(rf_srcmap *m, uint64_t daemon_id, uint64_t generation,
                  const char *socket_path, uint32_t *pieces, size_t npieces, rf_slice_src *out,
                  rf_err *err);
/* The trainers' memory that the local copies of frame ps read: *out (malloc'd, NULL when the
 * frame has no local copy) gets one entry per peer, filled for the peers local messages name,
 * each through rf_srcmap_get with the source pieces of those messages. */
int rf_srcmap_frame(rf_srcmap *m, const Refit__PlanSlice *ps, rf_slice_src **out, rf_err *err);
/* Releases every publisher mapping that job's peers do not name at their generation; the
 * caller guarantees no running job reads the others. */
void rf_srcmap_prune(rf_srcmap *m, const rf_slice_job *keep);
/* Publisher generations held, and fetches made since creation (the bench counts them). */
uint32_t rf_srcmap_count(const rf_srcmap *m);
uint64_t rf_srcmap_fetches(const rf_srcmap *m);

#endif
