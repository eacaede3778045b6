/* common/xfer.c - checks on a transfer job that every transport runs before moving a byte, and
 * the choice of a daemon's transport. */
#include "xfer.h"

#include <stdlib.h>
#include <string.h>

typedef struct span {
    uint64_t off, bytes;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;

    return x->off < y->off ? -1 : x->off > y->off;
}

static int check_item(const rf_xfer_msg *m, uint32_t k, rf_err *err)
{
    const rf_xfer_item *it = &m->items[k];
    const char *what;
    char box[160];
    int64_t numel;

    if (it->ndim < 1 || it->ndim > RF_MAX_DIMS || it->esize == 0 || it->esize > 16)
        return rf_err_set(err, -EINVAL, "message seq %u item %u has %d dims and elements of "
                          "%zu bytes; the job was built wrong", m->seq, k, it->ndim, it->esize);
    numel = rf_box_numel(&it->box, it->ndim);
    if (it->base == NULL)
        what = "has no mapped memory; map the piece's region before running the job";
    else if (rf_box_empty(&it->box, it->ndim) ||
             !rf_box_contains(&it->piece.box, &it->box, it->ndim))
        what = "is empty or outside its local piece: the plan is stale";
    else if (it->bytes != (uint64_t)numel * it->esize)
        what = "holds another number of bytes than the item says";
    else if (it->msg_off > m->bytes || it->bytes > m->bytes - it->msg_off)
        what = "lies outside its message's payload";
    else
        return 0;
    /* Formatting only on the way out: a 100k-tensor job checks 100k items every refit. */
    rf_box_format(&it->box, it->ndim, box, sizeof(box));
    return rf_err_set(err, -EINVAL, "message seq %u item %u (box %s, %llu bytes at offset %llu "
                      "of %llu) %s", m->seq, k, box, (unsigned long long)it->bytes,
                      (unsigned long long)it->msg_off, (unsigned long long)m->bytes, what);
}

/* A packed payload must be tiled exactly by its items: a gap would send whatever the staging
 * buffer held before, an overlap would write one destination byte twice. */
static int check_packed_tiling(const rf_xfer_msg *m, rf_err *err)
{
    span *s = NULL;
    uint64_t end = 0;
    uint32_t k;
    int rc = 0;

    s = malloc((m->nitems ? m->nitems : 1) * sizeof(*s));
    if (!s)
        return rf_err_set(err, -ENOMEM, "out of memory checking message seq %u", m->seq);
    for (k = 0; k < m->nitems; k++) {
        s[k].off = m->items[k].msg_off;
        s[k].bytes = m->items[k].bytes;
    }
    qsort(s, m->nitems, sizeof(*s), span_cmp);
    for (k = 0; k < m->nitems; k++) {
        if (s[k].off != end) {
            rc = rf_err_set(err, -EINVAL, "packed message seq %u: its items %s at payload "
                            "offset %llu; the job was built wrong", m->seq,
                            s[k].off > end ? "leave a gap" : "overlap",
                            (unsigned long long)end);
            goto out;
        }
        end += s[k].bytes;
    }
    if (end != m->bytes)
        rc = rf_err_set(err, -EINVAL, "packed message seq %u says %llu bytes, its items hold "
                        "%llu", m->seq, (unsigned long long)m->bytes, (unsigned long long)end);
out:
    free(s);
    return rc;
}

static int u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* seq must name one message per direction: the receiver finds a frame's message by it. */
static int check_unique_seqs(const rf_xfer_job *job, rf_err *err)
{
    uint64_t *keys = NULL;
    uint32_t i;
    int rc = 0;

    keys = malloc((job->nmsgs ? job->nmsgs : 1) * sizeof(*keys));
    if (!keys)
        return rf_err_set(err, -ENOMEM, "out of memory checking a job of %u messages",
                          job->nmsgs);
    for (i = 0; i < job->nmsgs; i++)
        keys[i] = ((uint64_t)job->msgs[i].seq << 1) | (job->msgs[i].send ? 1u : 0u);
    qsort(keys, job->nmsgs, sizeof(*keys), u64_cmp);
    for (i = 1; i < job->nmsgs; i++) {
        if (keys[i] == keys[i - 1]) {
            rc = rf_err_set(err, -EINVAL, "message seq %llu appears twice among the messages "
                            "this daemon %s; the job was built wrong",
                            (unsigned long long)(keys[i] >> 1), keys[i] & 1 ? "sends" : "receives");
            break;
        }
    }
    free(keys);
    return rc;
}

int rf_xfer_job_check(const rf_xfer_job *job, uint32_t npeers, rf_err *err)
{
    uint64_t round_packed = 0;
    uint32_t i, k, round = 0;
    int rc;

    if (job->nmsgs > 0 && job->msgs == NULL)
        return rf_err_set(err, -EINVAL, "job of %u messages has no message array", job->nmsgs);
    for (i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];

        if (m->round >= job->nrounds || m->round < round)
            return rf_err_set(err, -EINVAL, "message seq %u is in round %u, after round %u of "
                              "%u: messages must be sorted by round and inside nrounds",
                              m->seq, m->round, round, job->nrounds);
        if (m->round != round)
            round_packed = 0;
        round = m->round;
        if (m->peer >= npeers)
            return rf_err_set(err, -EINVAL, "message seq %u names peer %u, the peer table holds "
                              "%u; set the peers first", m->seq, m->peer, npeers);
        if (m->kind != RF_PLAN_DIRECT && m->kind != RF_PLAN_PACKED)
            return rf_err_set(err, -EINVAL, "message seq %u has unknown kind %u", m->seq,
                              m->kind);
        if (m->nitems > 0 && m->items == NULL)
            return rf_err_set(err, -EINVAL, "message seq %u has %u items and no item array",
                              m->seq, m->nitems);
        for (k = 0; k < m->nitems; k++)
            if ((rc = check_item(m, k, err)) < 0)
                return rc;
        if (m->kind == RF_PLAN_DIRECT) {
            const rf_xfer_item *it = &m->items[0];

            if (m->nitems != 1 || it->msg_off != 0 || it->bytes != m->bytes)
                return rf_err_set(err, -EINVAL, "direct message seq %u must carry exactly one "
                                  "item of its %llu bytes; it has %u", m->seq,
                                  (unsigned long long)m->bytes, m->nitems);
            if (!rf_piece_contiguous(&it->piece, it->ndim, it->esize, &it->box, NULL)) {
                char box[160];

                rf_box_format(&it->box, it->ndim, box, sizeof(box));
                return rf_err_set(err, -EINVAL, "direct message seq %u moves box %s, which is "
                                  "not contiguous in local memory; it must be packed",
                                  m->seq, box);
            }
        } else {
            if ((rc = check_packed_tiling(m, err)) < 0)
                return rc;
            round_packed += m->bytes;
            if (job->staging_bytes > 0 && round_packed > job->staging_bytes)
                return rf_err_set(err, -ENOSPC, "round %u packs more than %llu bytes on this "
                                  "daemon, its staging budget; rebuild the plan with this "
                                  "budget or raise it", round,
                                  (unsigned long long)job->staging_bytes);
        }
    }
    return check_unique_seqs(job, err);
}

uint8_t *rf_xfer_direct_ptr(const rf_xfer_msg *m)
{
    const rf_xfer_item *it = &m->items[0];

    return it->base + rf_piece_byte_offset(&it->piece, it->ndim, it->esize, it->box.start);
}

int rf_xfer_open(uv_loop_t *loop, const rf_xfer_open_opts *o, rf_xfer_transport **out,
                 rf_err *err)
{
    rf_xfer_transport *t = NULL;
    int rc;

    *out = NULL;
    if (o->nccl)
        return rf_xfer_nccl_new(loop, out, err);
    rc = rf_xfer_tcp_new(loop, o->listen_addr, &t, err);
    if (rc < 0)
        return rc;
    rc = rf_xfer_tcp_set_key(t, o->key, o->key_len);
    if (rc < 0) {
        /* The listener is bound already: the loop finishes closing it. */
        rf_xfer_close(t, NULL, NULL);
        return rf_err_set(err, rc, "the cluster key (%zu bytes) cannot authenticate data "
                          "connections; it needs at least %d bytes", o->key_len,
                          RF_XFER_TCP_KEY_MIN);
    }
    t->data_addr = rf_xfer_tcp_addr(t);
    *out = t;
    return 0;
}

#ifndef RF_HAVE_CUDA
/* Built without a CUDA toolkit: the nccl transport is not there, and saying so is all a
 * daemon configured for it can do. */
int rf_xfer_nccl_new(uv_loop_t *loop, rf_xfer_transport **out, rf_err *err)
{
    (void)loop;
    *out = NULL;
    return rf_err_set(err, -ENOTSUP, "transport = nccl, but this build of refit has no CUDA "
                      "or NCCL: rebuild with CUDA_HOME (and NCCL_HOME) pointing at a toolkit "
                      "with NCCL, or set transport = tcp");
}

int rf_xfer_nccl_unique_id(uint8_t out[128], rf_err *err)
{
    (void)out;
    return rf_err_set(err, -ENOTSUP, "transport = nccl, but this build of refit has no NCCL");
}
#endif
