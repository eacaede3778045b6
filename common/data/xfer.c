/* common/data/xfer.c - the transport core: checks on a transfer job before a byte moves, the worker
 * thread that runs one job at a time through a backend (xfer_core.h), its abort, deadline and
 * result, the peer table, close, the verification digest, and the choice of a daemon's
 * transport. */
#include "xfer_core.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "macros.h"
#include "qcopy.h"
#include "quant_fmt.h"

typedef struct span {
    uint64_t off, bytes;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;

    return x->off < y->off ? -1 : x->off > y->off;
}

/* side is "" for the items, "source " for a local message's source items. */
static int check_item_of(const rf_xfer_msg *m, const rf_xfer_item *it, uint32_t k,
                         const char *side, rf_err *err)
{
    /* The receiving end of an FP8 transfer is the FP8 piece; the sending end (a sent message,
     * a local message's source items) quantizes. */
    bool dst = !m->send && side[0] == '\0';
    const char *what;
    char box[160];
    int64_t numel;
    rf_err qerr = {0};
    int qrc;

    if (it->ndim < 1 || it->ndim > RF_MAX_DIMS || it->esize == 0 || it->esize > 16)
        return rf_err_set(err, -EINVAL, "message seq %u %sitem %u has %d dims and elements of "
                          "%zu bytes; the job was built wrong", m->seq, side, k, it->ndim,
                          it->esize);
    numel = rf_box_numel(&it->box, it->ndim);
    if (it->base == NULL)
        what = "has no mapped memory; map the piece's region before running the job";
    else if (rf_box_empty(&it->box, it->ndim) ||
             !rf_box_contains(&it->piece.box, &it->box, it->ndim))
        what = "is empty or outside its local piece: the plan is stale";
    else if (it->quant.q.kind != 0 && (qrc = rf_qcopy_check(it, dst, &qerr)) < 0)
        what = qerr.msg;
    else if (it->quant.q.kind == 0 && it->bytes != (uint64_t)numel * it->esize)
        what = "holds another number of bytes than the item says";
    else if (it->msg_off > m->bytes || it->bytes > m->bytes - it->msg_off)
        what = "lies outside its message's payload";
    else
        return 0;
    /* Formatting only on the way out: a 100k-tensor job checks 100k items every refit. */
    rf_box_format(&it->box, it->ndim, box, sizeof(box));
    return rf_err_set(err, -EINVAL, "message seq %u %sitem %u (box %s, %llu bytes at offset "
                      "%llu of %llu) %s", m->seq, side, k, box, (unsigned long long)it->bytes,
                      (unsigned long long)it->msg_off, (unsigned long long)m->bytes, what);
}

/* The ends of a relay tree (rf_xfer_origin): origins only where a relay transfer is received,
 * inside its box; recipients only where an origin transfer is sent. */
static int check_item_e2e(const rf_xfer_msg *m, const rf_xfer_item *it, uint32_t k, rf_err *err)
{
    char box[160], ob[160];

    if ((it->norigins > 0 && it->origins == NULL) || (it->nrelay_to > 0 && it->relay_to == NULL))
        return rf_err_set(err, -EINVAL, "message seq %u item %u counts %u origins and %u relay "
                          "recipients without their arrays; the job was built wrong", m->seq, k,
                          it->norigins, it->nrelay_to);
    if ((it->norigins > 0 && (m->send || m->kind == RF_PLAN_LOCAL)) ||
        (it->nrelay_to > 0 && !m->send))
        return rf_err_set(err, -EINVAL, "message seq %u item %u lists %s on its %s end; only "
                          "a received relay lists origins and a sent origin recipients: the "
                          "job was built wrong", m->seq, k,
                          it->norigins > 0 ? "relay origins" : "relay recipients",
                          m->send ? "sending" : "receiving");
    for (uint32_t o = 0; o < it->norigins; o++) {
        const rf_box *b = &it->origins[o].box;

        if (!rf_box_empty(b, it->ndim) && rf_box_contains(&it->box, b, it->ndim))
            continue;
        rf_box_format(&it->box, it->ndim, box, sizeof(box));
        rf_box_format(b, it->ndim, ob, sizeof(ob));
        return rf_err_set(err, -EINVAL, "message seq %u item %u relays box %s, but its origin "
                          "transfer %llu is box %s, empty or outside it; the job was built "
                          "wrong", m->seq, k, box, (unsigned long long)it->origins[o].id, ob);
    }
    return 0;
}

static int check_item(const rf_xfer_msg *m, uint32_t k, rf_err *err)
{
    int rc = check_item_of(m, &m->items[k], k, "", err);

    if (rc == 0 && (m->items[k].norigins > 0 || m->items[k].nrelay_to > 0))
        rc = check_item_e2e(m, &m->items[k], k, err);
    return rc;
}

/* A local message's source item k moves the very elements of its destination item k: the
 * same box, element size and place in the payload, from a piece of its own. */
static int check_src_item(const rf_xfer_msg *m, uint32_t k, rf_err *err)
{
    const rf_xfer_item *s = &m->src_items[k], *d = &m->items[k];
    char sb[160], db[160];
    int rc;

    if ((rc = check_item_of(m, s, k, "source ", err)) < 0)
        return rc;
    if (s->ndim == d->ndim && (s->esize == d->esize || d->quant.q.kind != 0) &&
        s->quant.q.kind == d->quant.q.kind && rf_box_equal(&s->box, &d->box, d->ndim) &&
        s->msg_off == d->msg_off && s->bytes == d->bytes)
        return 0;
    rf_box_format(&s->box, s->ndim, sb, sizeof(sb));
    rf_box_format(&d->box, d->ndim, db, sizeof(db));
    return rf_err_set(err, -EINVAL, "local message seq %u item %u copies box %s (%d dims, "
                      "%zu-byte elements, %llu bytes at offset %llu) into box %s (%d dims, "
                      "%zu-byte elements, %llu bytes at offset %llu); a transfer's two sides "
                      "must be the same box: the job was built wrong", m->seq, k, sb, s->ndim,
                      s->esize, (unsigned long long)s->bytes, (unsigned long long)s->msg_off, db,
                      d->ndim, d->esize, (unsigned long long)d->bytes,
                      (unsigned long long)d->msg_off);
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

/* A received relay message without a message digest must have every byte in its items'
 * origins: the items tile the payload (checked before), so each item's origins must tile its
 * box, which they do when they lie inside it (checked with the item) without overlap and add
 * up to its volume. */
static int check_e2e_cover(const rf_xfer_msg *m, rf_err *err)
{
    for (uint32_t k = 0; k < m->nitems; k++) {
        const rf_xfer_item *it = &m->items[k];
        int64_t got = 0;
        rf_box cut;

        for (uint32_t o = 0; o < it->norigins; o++) {
            got += rf_box_numel(&it->origins[o].box, it->ndim);
            for (uint32_t q = 0; q < o; q++)
                if (rf_box_intersect(&it->origins[o].box, &it->origins[q].box, it->ndim, &cut))
                    got = -1;
        }
        if (got != rf_box_numel(&it->box, it->ndim))
            return rf_err_set(err, -EINVAL, "relay message seq %u has no message digest, but "
                              "the origins of its item %u (%u of them) do not tile its box: "
                              "bytes would go unchecked; the job was built wrong", m->seq, k,
                              it->norigins);
    }
    return 0;
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
        if (m->kind != RF_PLAN_DIRECT && m->kind != RF_PLAN_PACKED && m->kind != RF_PLAN_LOCAL)
            return rf_err_set(err, -EINVAL, "message seq %u has unknown kind %u", m->seq,
                              m->kind);
        if (m->nitems > 0 && m->items == NULL)
            return rf_err_set(err, -EINVAL, "message seq %u has %u items and no item array",
                              m->seq, m->nitems);
        for (k = 0; k < m->nitems; k++)
            if ((rc = check_item(m, k, err)) < 0)
                return rc;
        if (m->kind == RF_PLAN_LOCAL) {
            /* The receiving daemon copies it from the source's memory mapped here. */
            if (m->send)
                return rf_err_set(err, -EINVAL, "local message seq %u is marked as sent; a "
                                  "local copy belongs to the daemon of its destination only",
                                  m->seq);
            if (m->e2e)
                return rf_err_set(err, -EINVAL, "local message seq %u is marked as a relay "
                                  "checked end to end, which a local copy never is; the job "
                                  "was built wrong", m->seq);
            if (m->nitems > 0 && m->src_items == NULL)
                return rf_err_set(err, -EINVAL, "local message seq %u has %u items and no "
                                  "source items; map the sources' pieces into the job",
                                  m->seq, m->nitems);
            for (k = 0; k < m->nitems; k++)
                if ((rc = check_src_item(m, k, err)) < 0)
                    return rc;
            if ((rc = check_packed_tiling(m, err)) < 0)
                return rc;
            continue;
        }
        if (m->src_items != NULL)
            return rf_err_set(err, -EINVAL, "message seq %u (%s) has source items, which only "
                              "a local message carries; the job was built wrong", m->seq,
                              m->kind == RF_PLAN_DIRECT ? "direct" : "packed");
        if (m->e2e && !m->send && (rc = check_e2e_cover(m, err)) < 0)
            return rc;
        if (m->kind == RF_PLAN_DIRECT) {
            const rf_xfer_item *it = &m->items[0];

            if (m->nitems != 1 || it->msg_off != 0 || it->bytes != m->bytes)
                return rf_err_set(err, -EINVAL, "direct message seq %u must carry exactly one "
                                  "item of its %llu bytes; it has %u", m->seq,
                                  (unsigned long long)m->bytes, m->nitems);
            if (it->quant.q.kind != 0)
                return rf_err_set(err, -EINVAL, "direct message seq %u is quantized to FP8, "
                                  "which only packed and local messages are", m->seq);
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

/* ---- the core: the worker ---- */

double rf_xfer__now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int rf_xfer__fail(rf_xfer_core *t, int code, const char *fmt, ...)
{
    va_list ap;

    assert(code < 0);
    if (t->result.code != 0)
        return t->result.code;
    t->result.code = code;
    va_start(ap, fmt);
    vsnprintf(t->result.error, sizeof(t->result.error), fmt, ap);
    va_end(ap);
    return code;
}

int rf_xfer__stop(const rf_xfer_core *t)
{
    if (atomic_load(&t->abort_req))
        return -ECANCELED;
    return rf_xfer__now() > t->deadline ? -ETIMEDOUT : 0;
}

const char *rf_xfer__peer_addr(const rf_xfer_core *t, uint32_t p)
{
    return p < t->npeers && t->addrs[p] ? t->addrs[p] : "?";
}

void rf_xfer__moved(rf_xfer_core *t, const rf_xfer_msg *m)
{
    if (m->send)
        t->result.bytes_sent += m->bytes;
    else
        t->result.bytes_recv += m->bytes;
    atomic_fetch_add_explicit(&t->progress, m->bytes, memory_order_relaxed);
}

void rf_xfer__staging(rf_xfer_core *t, uint64_t bytes)
{
    if (bytes > t->result.peak_staging)
        t->result.peak_staging = bytes;
}

static void order_advance(rf_xfer_order *o)
{
    while (o->recv_lo < o->nrounds && o->recv_left[o->recv_lo] == 0)
        o->recv_lo++;
}

int rf_xfer__order_init(rf_xfer_order *o, const rf_xfer_job *job)
{
    bool sends = false, recvs = false;

    memset(o, 0, sizeof(*o));
    o->nrounds = job->nrounds;
    o->recv_left = calloc(job->nrounds ? job->nrounds : 1, sizeof(*o->recv_left));
    if (!o->recv_left)
        return -ENOMEM;
    for (uint32_t i = 0; i < job->nmsgs; i++) {
        const rf_xfer_msg *m = &job->msgs[i];

        sends |= m->send;
        recvs |= !m->send;
        if (!m->send)
            o->recv_left[m->round]++;
    }
    o->gated = sends && recvs;
    order_advance(o);
    return 0;
}

void rf_xfer__order_recv_done(rf_xfer_order *o, uint32_t round)
{
    assert(round < o->nrounds && o->recv_left[round] > 0);
    o->recv_left[round]--;
    order_advance(o);
}

void rf_xfer__order_free(rf_xfer_order *o)
{
    free(o->recv_left);
    memset(o, 0, sizeof(*o));
}

bool rf_xfer__digest_begin(rf_xfer_core *t, const rf_xfer_msg *m, rf_xfer_digest *d)
{
    uint8_t seq[4];

    if (!rf_xfer_msg_verified(t->job, m))
        return false;
    for (int i = 0; i < 4; i++)
        seq[i] = (uint8_t)(m->seq >> (8 * i));
    crypto_generichash_init(&d->st, NULL, 0, RF_XFER_DIGEST_BYTES);
    crypto_generichash_update(&d->st, seq, sizeof(seq));
    d->acc = m->send ? t->result.digest_sent : t->result.digest_recv;
    d->left = rf_xfer_msg_digest_bytes(t->job, m);
    return true;
}

void rf_xfer__digest_add(rf_xfer_digest *d, const uint8_t *p, uint64_t n)
{
    if (n > d->left)
        n = d->left;
    if (n > 0)
        crypto_generichash_update(&d->st, p, n);
    d->left -= n;
}

void rf_xfer__digest_end(rf_xfer_digest *d)
{
    uint8_t h[RF_XFER_DIGEST_BYTES];

    /* Both ends must digest the same bytes, or the digests differ for no fault of the data. */
    assert(d->left == 0);
    crypto_generichash_final(&d->st, h, sizeof(h));
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
        d->acc[i] ^= h[i];
}

void rf_xfer__digest_msg(rf_xfer_core *t, const rf_xfer_msg *m, const uint8_t *payload)
{
    rf_xfer_digest d;

    if (rf_xfer__digest_begin(t, m, &d)) {
        rf_xfer__digest_add(&d, payload, d.left);
        rf_xfer__digest_end(&d);
    }
    for (uint32_t k = 0; k < m->nitems; k++)
        if (rf_xfer__e2e_bytes(t->job, m, &m->items[k]) > 0)
            rf_xfer__e2e_item(t, &m->items[k], payload + m->items[k].msg_off);
}

void rf_xfer_digest_seed(const uint8_t *key, size_t key_len,
                         uint8_t out[RF_XFER_DIGEST_SEED_BYTES])
{
    static const char label[] = "refit-wdigest-seed-v1";
    crypto_auth_hmacsha256_state st;

    _Static_assert(crypto_auth_hmacsha256_BYTES == RF_XFER_DIGEST_SEED_BYTES,
                   "the seed is one HMAC-SHA256");
    crypto_auth_hmacsha256_init(&st, key, key_len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, sizeof(label) - 1);
    crypto_auth_hmacsha256_final(&st, out);
}

void rf_xfer__wdigest_fold(rf_xfer_core *t, const rf_xfer_msg *m, bool sent,
                           const rf_wdigest_acc *acc)
{
    uint8_t h[RF_WDIGEST_TERM_BYTES], *to = sent ? t->result.digest_sent : t->result.digest_recv;

    _Static_assert(RF_WDIGEST_TERM_BYTES == RF_XFER_DIGEST_BYTES &&
                   RF_WDIGEST_SEED_BYTES == RF_XFER_DIGEST_SEED_BYTES,
                   "a wdigest term is a message digest, its seed the job's");
    assert(rf_xfer_msg_verified(t->job, m));
    rf_wdigest_term(acc, m->seq, rf_xfer_msg_digest_bytes(t->job, m), h);
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
        to[i] ^= h[i];
}

/* ---- relays end to end ---- */

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

void rf_xfer_e2e_term(uint64_t relay, uint64_t origin, const uint8_t content[RF_XFER_DIGEST_BYTES],
                      uint8_t out[RF_XFER_DIGEST_BYTES])
{
    static const char tag[] = "refit-relay-e2e-v1";
    uint8_t buf[sizeof(tag) - 1 + 16 + RF_XFER_DIGEST_BYTES];

    memcpy(buf, tag, sizeof(tag) - 1);
    put_le64(buf + sizeof(tag) - 1, relay);
    put_le64(buf + sizeof(tag) - 1 + 8, origin);
    memcpy(buf + sizeof(tag) - 1 + 16, content, RF_XFER_DIGEST_BYTES);
    crypto_generichash(out, RF_XFER_DIGEST_BYTES, buf, sizeof(buf), NULL, 0);
}

/* The payload bytes of box b of item it's tensor: its elements, or for an FP8 item its FP8
 * elements and its blocks' scales. */
static uint64_t box_payload(const rf_xfer_item *it, const rf_box *b)
{
    if (it->quant.q.kind != 0)
        return rf_qcopy_bytes(&it->quant.q, it->ndim, it->quant.rows, it->quant.cols, b, NULL);
    return (uint64_t)rf_box_numel(b, it->ndim) * it->esize;
}

uint64_t rf_xfer__e2e_bytes(const rf_xfer_job *job, const rf_xfer_msg *m, const rf_xfer_item *it)
{
    if (job->verify == RF_VERIFY_OFF)
        return 0;
    if (it->nrelay_to > 0)
        return rf_xfer_seq_verified(job, m->seq) ? rf_xfer_digest_bytes(job, it->bytes) : 0;
    for (uint32_t o = 0; o < it->norigins; o++)
        if (rf_xfer_seq_verified(job, it->origins[o].seq))
            return it->bytes;
    return 0;
}

/* Feeds sub-box `in` of a payload that holds box `out` dense and row-major (elements of esize
 * bytes from p on) to the hash, in `in`'s own row-major order, until *left bytes went in. */
static void hash_subbox(crypto_generichash_state *st, const uint8_t *p, const rf_box *out,
                        const rf_box *in, int nd, size_t esize, uint64_t *left)
{
    int64_t idx[RF_MAX_DIMS] = {0}, stride[RF_MAX_DIMS], s = 1;
    uint64_t row = (uint64_t)in->extent[nd - 1] * esize;

    for (int d = nd - 1; d >= 0; d--) {
        stride[d] = s;
        s *= out->extent[d];
    }
    while (*left > 0) {
        uint64_t off = 0, n = row < *left ? row : *left;
        int d;

        for (d = 0; d < nd; d++)
            off += (uint64_t)(in->start[d] - out->start[d] + idx[d]) * (uint64_t)stride[d];
        crypto_generichash_update(st, p + off * esize, n);
        *left -= n;
        /* The next row: the dims before the last count like an odometer. */
        for (d = nd - 2; d >= 0; d--) {
            if (++idx[d] < in->extent[d])
                break;
            idx[d] = 0;
        }
        if (d < 0)
            break;
    }
}

/* The content digest of origin o from the payload p of relay item it (box it->box): the bytes
 * of o's box as o's own payload lays them out, of which the first `left`. */
static void origin_content(const rf_xfer_item *it, const rf_xfer_origin *o, const uint8_t *p,
                           uint64_t left, uint8_t out[RF_XFER_DIGEST_BYTES])
{
    crypto_generichash_state st;

    crypto_generichash_init(&st, NULL, 0, RF_XFER_DIGEST_BYTES);
    if (it->quant.q.kind == 0) {
        hash_subbox(&st, p, &it->box, &o->box, it->ndim, it->esize, &left);
    } else {
        /* FP8: the elements, one byte each, then the scales of the blocks, each payload over
         * its own box; o lies on the grid, so its blocks are some of the item's. */
        const rf_quant_decl *q = &it->quant.q;
        rf_quant_fmt f = {q->kind, q->br, q->bc};
        int64_t shape[RF_MAX_DIMS] = {0};
        rf_box sb_it, sb_o;
        uint64_t fp8;

        shape[it->ndim - 2] = it->quant.rows;
        shape[it->ndim - 1] = it->quant.cols;
        rf_inv_scale_box(q, it->ndim, shape, &it->box, &sb_it);
        rf_inv_scale_box(q, it->ndim, shape, &o->box, &sb_o);
        rf_qcopy_bytes(q, it->ndim, it->quant.rows, it->quant.cols, &it->box, &fp8);
        hash_subbox(&st, p, &it->box, &o->box, it->ndim, 1, &left);
        hash_subbox(&st, p + fp8, &sb_it, &sb_o, it->ndim,
                    rf_dtype_size(rf_quant_scale_dtype(&f)), &left);
    }
    assert(left == 0);
    crypto_generichash_final(&st, out, RF_XFER_DIGEST_BYTES);
}

static void xor_into(uint8_t *acc, const uint8_t *h)
{
    for (int i = 0; i < RF_XFER_DIGEST_BYTES; i++)
        acc[i] ^= h[i];
}

void rf_xfer__e2e_item(rf_xfer_core *t, const rf_xfer_item *it, const uint8_t *p)
{
    const rf_xfer_job *job = t->job;
    uint8_t c[RF_XFER_DIGEST_BYTES], term[RF_XFER_DIGEST_BYTES];

    if (it->nrelay_to > 0) {
        /* One digest of the bytes sent, then one small hash per relay that forwards them. */
        crypto_generichash(c, sizeof(c), p, rf_xfer_digest_bytes(job, it->bytes), NULL, 0);
        for (uint32_t r = 0; r < it->nrelay_to; r++) {
            rf_xfer_e2e_term(it->relay_to[r], it->id, c, term);
            xor_into(t->result.digest_sent, term);
        }
        return;
    }
    for (uint32_t k = 0; k < it->norigins; k++) {
        const rf_xfer_origin *o = &it->origins[k];

        if (!rf_xfer_seq_verified(job, o->seq))
            continue;
        origin_content(it, o, p, rf_xfer_digest_bytes(job, box_payload(it, &o->box)), c);
        rf_xfer_e2e_term(it->id, o->id, c, term);
        xor_into(t->result.digest_recv, term);
    }
}

/* The test hooks' wait: until path exists (exists) or is gone, or an abort or the deadline
 * fails the job, saying it was `what`. */
static int wait_file(rf_xfer_core *t, const char *path, bool exists, const char *what)
{
    int stop;

    while ((access(path, F_OK) == 0) != exists)
        if ((stop = rf_xfer__stop(t)) < 0)
            return rf_xfer__fail(t, stop, "%s while %s", stop == -ECANCELED ? "aborted" :
                                 "deadline passed", what);
        else
            usleep(10000);
    return 0;
}

/* REFIT_TEST_JOB_HOLD: once the job moved bytes, waits while the file exists; returns rc, or
 * the abort or deadline that ended the wait. */
static int hold(rf_xfer_core *t, int rc)
{
    int stop;

    if (atomic_load_explicit(&t->progress, memory_order_relaxed) == 0 ||
        access(t->job_hold, F_OK) != 0)
        return rc;
    RF_WARN("xfer %s: version %llu held in flight while %s exists (REFIT_TEST_JOB_HOLD)",
            t->pub.ops->name, (unsigned long long)t->job->version, t->job_hold);
    stop = wait_file(t, t->job_hold, false, "held in flight by REFIT_TEST_JOB_HOLD");
    return stop < 0 ? stop : rc;
}

/* Steps the backend until the job is complete, fails, is aborted or runs out of time; the
 * backend's own steps name what failed, the core names what was outstanding. */
static int run_job(rf_xfer_core *t)
{
    const rf_xfer_backend *be = t->pub.ops;
    double wait_s = t->job->timeout_s < 1.0 ? t->job->timeout_s : 1.0;
    char what[300];
    int rc = 0;

    if (t->prepare && t->prepare_gate &&
        (rc = wait_file(t, t->prepare_gate, true,
                        "setting up ahead of Start, held by REFIT_TEST_PREPARE_GATE")) < 0)
        return rc;
    rc = be->start(t);
    if (t->prepare)
        return rc < 0 ? rc : 0;
    while (rc == 0) {
        rc = be->progress(t, wait_s);
        if (rc >= 0 && t->job_hold && (rc = hold(t, rc)) < 0)
            break;
        if (rc != 0)
            break;
        if (atomic_load(&t->abort_req)) {
            be->describe(t, what, sizeof(what));
            rc = rf_xfer__fail(t, -ECANCELED, "aborted with %s", what);
            break;
        }
        wait_s = t->deadline - rf_xfer__now();
        if (wait_s <= 0) {
            be->describe(t, what, sizeof(what));
            /* The note goes first: it is the likelier cause, and the message is short. */
            rc = rf_xfer__fail(t, -ETIMEDOUT, "deadline of %.1f s passed%s%s%s with %s",
                               t->job->timeout_s, t->note[0] ? " (" : "", t->note,
                               t->note[0] ? ")" : "", what);
            break;
        }
        if (wait_s > 1.0)
            wait_s = 1.0;
    }
    /* A backend that fails says why (the contract): the result carries its words. */
    assert(rc >= 0 || t->result.code < 0);
    return rc < 0 ? rc : 0;
}

static void *worker_main(void *arg)
{
    rf_xfer_core *t = arg;
    double t0 = rf_xfer__now();
    int rc;

    if (t->tearing_down) {
        t->pub.ops->teardown(t);
    } else {
        t->deadline = t0 + t->job->timeout_s;
        t->note[0] = '\0';
        rc = run_job(t);
        if (t->pub.ops->finish)
            t->pub.ops->finish(t, rc);
    }
    t->result.seconds = rf_xfer__now() - t0;
    atomic_store(&t->finished, true);
    uv_async_send(&t->async);
    return NULL;
}

static int start_worker(rf_xfer_core *t)
{
    int rc;

    /* One job (or the teardown) at a time: the worker owns the backend's job state. */
    assert(!t->running);
    atomic_store(&t->finished, false);
    rc = pthread_create(&t->thread, NULL, worker_main, t);
    if (rc != 0)
        return -rc;
    t->running = true;
    return 0;
}

/* ---- the core: the loop thread ---- */

static void on_closed(uv_handle_t *h)
{
    rf_xfer_core *t = container_of((uv_async_t *)h, rf_xfer_core, async);
    rf_xfer_close_cb cb = t->close_cb;
    void *arg = t->close_arg;

    for (uint32_t p = 0; p < t->npeers; p++)
        free(t->addrs[p]);
    free(t->addrs);
    if (t->wake_fd >= 0)
        close(t->wake_fd);
    t->pub.ops->release(t);
    if (cb)
        cb(arg);
}

static void close_handle(rf_xfer_core *t)
{
    assert(!t->handle_closed && !t->running);
    t->handle_closed = true;
    uv_close((uv_handle_t *)&t->async, on_closed);
}

/* Closing once no job runs: a backend with slow resources releases them on a worker first. */
static void finish_close(rf_xfer_core *t)
{
    if (t->handle_closed)
        return;
    if (t->pub.ops->teardown && !t->tearing_down) {
        t->tearing_down = true;
        if (start_worker(t) == 0)
            return;
    }
    close_handle(t);
}

static void on_async(uv_async_t *a)
{
    rf_xfer_core *t = container_of(a, rf_xfer_core, async);
    rf_xfer_result res;
    rf_xfer_done_cb done;
    void *arg;

    if (!t->running || !atomic_load(&t->finished))
        return;
    pthread_join(t->thread, NULL);
    t->running = false;
    if (t->tearing_down) {
        close_handle(t);
        return;
    }
    res = t->result;
    done = t->done;
    arg = t->done_arg;
    t->done = NULL;
    t->job = NULL;
    if (done)
        done(&t->pub, &res, arg);
    if (t->closing && !t->running)
        finish_close(t);
}

int rf_xfer__new(size_t size, const rf_xfer_backend *be, uv_loop_t *loop, rf_xfer_core **out,
                 rf_err *err)
{
    rf_xfer_core *t = NULL;
    int rc;

    assert(size >= sizeof(*t) && be->start && be->progress && be->describe && be->release);
    *out = NULL;
    /* The verification digest is libsodium's, and so is tcp's authentication. */
    if (sodium_init() < 0)
        return rf_err_set(err, -EIO, "xfer %s: libsodium failed to initialise", be->name);
    t = calloc(1, size);
    if (!t)
        return rf_err_set(err, -ENOMEM, "xfer %s: out of memory", be->name);
    t->pub.ops = be;
    t->loop = loop;
    atomic_init(&t->progress, 0);
    atomic_init(&t->abort_req, false);
    atomic_init(&t->finished, false);
    t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t->wake_fd < 0) {
        rc = rf_err_set(err, -errno, "xfer %s: eventfd: %s", be->name, strerror(errno));
        goto fail;
    }
    t->prepare_gate = getenv("REFIT_TEST_PREPARE_GATE");
    if (t->prepare_gate && !t->prepare_gate[0])
        t->prepare_gate = NULL;
    if (t->prepare_gate)
        RF_WARN("REFIT_TEST_PREPARE_GATE is set: xfer %s sets jobs up ahead of Start only once "
                "%s exists (a test hook; unset it outside tests)", be->name, t->prepare_gate);
    t->job_hold = getenv("REFIT_TEST_JOB_HOLD");
    if (t->job_hold && !t->job_hold[0])
        t->job_hold = NULL;
    if (t->job_hold)
        RF_WARN("REFIT_TEST_JOB_HOLD is set: xfer %s holds a job in flight while %s exists (a "
                "test hook; unset it outside tests)", be->name, t->job_hold);
    rc = uv_async_init(loop, &t->async, on_async);
    if (rc < 0) {
        rf_err_set(err, rc, "xfer %s: uv_async_init: %s", be->name, uv_strerror(rc));
        goto fail;
    }
    *out = t;
    return 0;
fail:
    if (t->wake_fd >= 0)
        close(t->wake_fd);
    free(t);
    return rc;
}

/* Every transport's struct starts with its core, whose own first member is the public face. */
static rf_xfer_core *core_of(rf_xfer_transport *pub)
{
    return container_of(pub, rf_xfer_core, pub);
}

static const rf_xfer_core *const_core_of(const rf_xfer_transport *pub)
{
    return container_of(pub, const rf_xfer_core, pub);
}

const char *rf_xfer_name(const rf_xfer_transport *pub)
{
    return pub->ops->name;
}

const char *rf_xfer_data_addr(const rf_xfer_transport *pub)
{
    const rf_xfer_core *t = const_core_of(pub);

    return t->data_addr ? t->data_addr : "";
}

uint64_t rf_xfer_progress(const rf_xfer_transport *pub)
{
    return atomic_load_explicit(&const_core_of(pub)->progress, memory_order_relaxed);
}

int rf_xfer_set_peers(rf_xfer_transport *pub, uint32_t self, uint32_t npeers,
                      const char *const *addrs, rf_err *err)
{
    rf_xfer_core *t = core_of(pub);
    const char *name = t->pub.ops->name;
    char **naddrs = NULL;
    uint32_t p;
    int rc = 0;

    if (t->running || t->closing)
        return rf_err_set(err, -EBUSY, "xfer %s: cannot change peers while a job runs", name);
    if (npeers == 0 || self >= npeers)
        return rf_err_set(err, -EINVAL, "xfer %s: this daemon's index %u is outside a peer "
                          "table of %u", name, self, npeers);
    naddrs = calloc(npeers, sizeof(*naddrs));
    if (!naddrs)
        return rf_err_set(err, -ENOMEM, "xfer %s: out of memory for %u peers", name, npeers);
    for (p = 0; p < npeers; p++) {
        if (addrs && addrs[p] && !(naddrs[p] = strdup(addrs[p]))) {
            rc = rf_err_set(err, -ENOMEM, "xfer %s: out of memory for %u peers", name, npeers);
            goto out;
        }
    }
    if (t->pub.ops->set_peers && (rc = t->pub.ops->set_peers(t, self, npeers, naddrs, err)) < 0)
        goto out;
    /* The new table is kept, the old one freed below. */
    for (p = 0; p < t->npeers; p++)
        free(t->addrs[p]);
    free(t->addrs);
    t->addrs = naddrs;
    t->self = self;
    t->npeers = npeers;
    naddrs = NULL;
out:
    if (naddrs) {
        for (p = 0; p < npeers; p++)
            free(naddrs[p]);
        free(naddrs);
    }
    return rc;
}

/* Local copies run only on the local transport (which refuses everything else itself): a
 * network backend handed one would read memory it has no business with, or wait for a frame no
 * daemon sends. Checked at every run, whether or not the job was checked. */
static int check_kinds(const rf_xfer_core *t, const rf_xfer_job *job, rf_err *err)
{
    if (t->pub.ops->local)
        return 0;
    for (uint32_t i = 0; i < job->nmsgs; i++)
        if (job->msgs[i].kind == RF_PLAN_LOCAL)
            return rf_err_set(err, -EINVAL, "xfer %s: message seq %u is a local copy "
                              "(source and destination on this host), which only the local "
                              "transport runs; hand local messages to it", t->pub.ops->name,
                              job->msgs[i].seq);
    return 0;
}

static int submit(rf_xfer_transport *pub, const rf_xfer_job *job, bool prepare,
                  rf_xfer_done_cb done, void *arg, rf_err *err)
{
    rf_xfer_core *t = core_of(pub);
    const char *name = t->pub.ops->name;
    uint64_t drain;
    int rc;

    if (t->closing)
        return rf_err_set(err, -ECANCELED, "xfer %s: the transport is closing", name);
    if (t->running)
        return rf_err_set(err, -EBUSY, "xfer %s: a job (version %llu) is still running", name,
                          (unsigned long long)t->job->version);
    if (t->npeers == 0)
        return rf_err_set(err, -EINVAL, "xfer %s: no peer table; call set_peers first", name);
    if (!(job->timeout_s > 0))
        return rf_err_set(err, -EINVAL, "xfer %s: job for version %llu has no deadline "
                          "(timeout %g s); set timeout_s", name,
                          (unsigned long long)job->version, job->timeout_s);
    if (!job->checked && (rc = rf_xfer_job_check(job, t->npeers, err)) < 0)
        return rc;
    if ((rc = check_kinds(t, job, err)) < 0 ||
        (t->pub.ops->check && (rc = t->pub.ops->check(t, job, err)) < 0))
        return rc;
    memset(&t->result, 0, sizeof(t->result));
    atomic_store_explicit(&t->progress, 0, memory_order_relaxed);
    /* An abort meant for the previous job must not hit this one. */
    while (read(t->wake_fd, &drain, sizeof(drain)) > 0)
        ;
    atomic_store(&t->abort_req, false);
    t->job = job;
    t->prepare = prepare;
    t->done = done;
    t->done_arg = arg;
    rc = start_worker(t);
    if (rc < 0) {
        t->job = NULL;
        return rf_err_set(err, rc, "xfer %s: starting the worker thread: %s", name,
                          strerror(-rc));
    }
    return 0;
}

int rf_xfer_run(rf_xfer_transport *pub, const rf_xfer_job *job, rf_xfer_done_cb done, void *arg,
                rf_err *err)
{
    return submit(pub, job, false, done, arg, err);
}

int rf_xfer_prepare(rf_xfer_transport *pub, const rf_xfer_job *job, rf_xfer_done_cb done,
                    void *arg, rf_err *err)
{
    if (!pub->ops->prepares)
        return rf_err_set(err, -ENOTSUP, "xfer %s: this transport sets a job up when it runs "
                          "it, not ahead", pub->ops->name);
    return submit(pub, job, true, done, arg, err);
}

static void abort_job(rf_xfer_core *t)
{
    uint64_t one = 1;

    if (!t->running || t->tearing_down)
        return;
    atomic_store(&t->abort_req, true);
    if (write(t->wake_fd, &one, sizeof(one)) < 0) {
        /* The counter is saturated, so the worker is being woken anyway. */
    }
}

void rf_xfer_abort(rf_xfer_transport *pub)
{
    abort_job(core_of(pub));
}

void rf_xfer_close(rf_xfer_transport *pub, rf_xfer_close_cb cb, void *arg)
{
    rf_xfer_core *t = core_of(pub);

    if (t->closing)
        return;
    t->closing = true;
    t->close_cb = cb;
    t->close_arg = arg;
    if (t->running)
        abort_job(t);
    else
        finish_close(t);
}

int rf_xfer_set_world(rf_xfer_transport *pub, const rf_xfer_world *w, rf_err *err)
{
    return pub->ops->set_world ? pub->ops->set_world(core_of(pub), w, err) : 0;
}

bool rf_xfer_needs_world(const rf_xfer_transport *pub)
{
    return pub->ops->needs_world ? pub->ops->needs_world(const_core_of(pub)) : false;
}

bool rf_xfer_has_world(const rf_xfer_transport *pub)
{
    return pub->ops->set_world != NULL;
}

/* ---- a daemon's transport ---- */

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
    core_of(t)->data_addr = rf_xfer_tcp_addr(t);
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

int rf_xfer_nccl_unique_id(uint8_t out[RF_XFER_NCCL_ID_BYTES], rf_err *err)
{
    (void)out;
    return rf_err_set(err, -ENOTSUP, "transport = nccl, but this build of refit has no NCCL");
}
#endif
