/* common/control/srcmap.c - local publishers' exported memory, imported once per generation:
 * only the regions the plan's pieces lie in, asked for again when a later frame reads more. */
#define RF_LOG_MODULE "srcmap"
#include "srcmap.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "export.h"
#include "log.h"
#include "mem.h"
#include "peer.h"

typedef struct src_entry {
    uint64_t daemon_id, generation;
    rf_export **exps;   /* every fetch of this generation; the first one's inventory rules */
    uint32_t nexps;
    uint32_t nregions;
    rf_mem_ref **refs;  /* per region of the inventory, NULL where not granted yet */
    uint8_t **bases;
    uint64_t (*own)[2]; /* the publisherd's owner numbers -> this process's */
    uint32_t nown;
    struct src_entry *next;
} src_entry;

struct rf_srcmap {
    uint8_t key[RF_PEER_KEY_MAX];
    size_t key_len;
    rf_srcmap_fetch_fn fetch; /* NULL: the key proves us */
    void *fetch_ctx;
    double timeout_s;
    /* One cache for every publisher and generation: an unchanged trainer region of a new
     * generation reuses its mapping (a CUDA IPC handle cannot be opened twice). */
    rf_mem_cache *cache;
    src_entry *entries;
    uint64_t fetches;
};

static int srcmap_alloc(rf_srcmap **out, rf_err *err)
{
    rf_srcmap *m = calloc(1, sizeof(*m));

    if (!m || !(m->cache = rf_mem_cache_new())) {
        free(m);
        return rf_err_set(err, -ENOMEM, "out of memory for the local sources");
    }
    *out = m;
    return 0;
}

int rf_srcmap_new(const uint8_t *key, size_t key_len, double timeout_s, rf_srcmap **out,
                  rf_err *err)
{
    int rc;

    if (key_len == 0 || key_len > RF_PEER_KEY_MAX)
        return rf_err_set(err, -EINVAL, "srcmap: a cluster key of 1..%d bytes is needed",
                          RF_PEER_KEY_MAX);
    if ((rc = srcmap_alloc(out, err)) < 0)
        return rc;
    memcpy((*out)->key, key, key_len);
    (*out)->key_len = key_len;
    (*out)->timeout_s = timeout_s;
    return 0;
}

int rf_srcmap_new_fetcher(rf_srcmap_fetch_fn fetch, void *ctx, rf_srcmap **out, rf_err *err)
{
    int rc;

    if ((rc = srcmap_alloc(out, err)) < 0)
        return rc;
    (*out)->fetch = fetch;
    (*out)->fetch_ctx = ctx;
    return 0;
}

static void entry_free(rf_srcmap *m, src_entry *e)
{
    uint32_t i;

    for (i = 0; e->refs && i < e->nregions; i++)
        if (e->refs[i])
            rf_mem_release(m->cache, e->refs[i]);
    free(e->refs);
    free(e->bases);
    for (i = 0; i < e->nexps; i++)
        rf_export_free(e->exps[i]);
    free(e->exps);
    free(e->own);
    free(e);
}

void rf_srcmap_free(rf_srcmap *m)
{
    if (!m)
        return;
    while (m->entries) {
        src_entry *e = m->entries;

        m->entries = e->next;
        entry_free(m, e);
    }
    rf_mem_cache_free(m->cache);
    sodium_memzero(m->key, sizeof(m->key));
    free(m);
}

/* A trainer's VMM regions of one allocation share a mapping: their publisherd numbers the
 * trainer (owner), which becomes a number of this process, new for each generation, so a
 * trainer that came back with other allocations at the same addresses never meets the
 * mappings of its last life. Trainers are few: a short table. */
static int own_map(src_entry *e, uint64_t *owner, rf_err *err)
{
    uint32_t j;

    if (*owner == 0)
        return 0;
    for (j = 0; j < e->nown && e->own[j][0] != *owner; j++)
        ;
    if (j == e->nown) {
        uint64_t (*no)[2] = realloc(e->own, (e->nown + 1) * sizeof(*e->own));

        if (no == NULL)
            return rf_err_set(err, -ENOMEM, "out of memory mapping trainer memory");
        e->own = no;
        e->own[j][0] = *owner;
        e->own[j][1] = rf_mem_owner_new();
        e->nown++;
    }
    *owner = e->own[j][1];
    return 0;
}

/* Fetches the regions of pieces (sorted, unique) and maps those granted that e lacks. */
static int entry_fetch(rf_srcmap *m, src_entry *e, const char *path, const uint32_t *pieces,
                       size_t npieces, rf_err *err)
{
    rf_export *x = NULL, **xs;
    uint32_t i, n, mapped = 0;
    int rc;

    if (m->fetch)
        rc = m->fetch(m->fetch_ctx, e->daemon_id, e->generation, path, pieces, npieces, &x,
                      err);
    else
        rc = rf_export_fetch(path, m->key, m->key_len, pieces, npieces, m->timeout_s, &x, err);
    if (rc < 0)
        return rc;
    m->fetches++;
    if ((xs = realloc(e->exps, (e->nexps + 1) * sizeof(*xs))) == NULL) {
        rf_export_free(x);
        return rf_err_set(err, -ENOMEM, "out of memory mapping the trainers of %s", path);
    }
    e->exps = xs;
    e->exps[e->nexps++] = x;
    if (x->generation != e->generation)
        return rf_err_set(err, -ESTALE, "the publisherd at %s holds inventory generation %llu, "
                          "the plan was built on %llu: its trainers changed, a new plan follows",
                          path, (unsigned long long)x->generation,
                          (unsigned long long)e->generation);
    n = x->nregions;
    if (e->refs == NULL) {
        e->nregions = n;
        e->refs = calloc(n ? n : 1, sizeof(*e->refs));
        e->bases = calloc(n ? n : 1, sizeof(*e->bases));
        if (!e->refs || !e->bases)
            return rf_err_set(err, -ENOMEM, "out of memory mapping the trainers of %s", path);
    } else if (n != e->nregions) {
        return rf_err_set(err, -EBADMSG, "the publisherd at %s answered %u regions for "
                          "generation %llu, %u before", path, n,
                          (unsigned long long)e->generation, e->nregions);
    }
    for (i = 0; i < n; i++) {
        rf_mem_desc *d = &x->regions[i];
        rf_err ierr = {0};

        if (d->kind == 0 || e->refs[i] != NULL)
            continue; /* not granted, or mapped from an earlier fetch */
        if ((rc = own_map(e, &d->owner, err)) < 0)
            return rc;
        rc = rf_mem_import(m->cache, d, &e->refs[i], &ierr);
        if (rc < 0)
            return rf_err_set(err, rc, "mapping trainer region %u of the publisherd at %s "
                              "(%s on %s): %s", i, path, rf_mem_kind_name(d->kind), d->device,
                              ierr.msg);
        e->bases[i] = rf_mem_ref_base(e->refs[i]);
        mapped++;
        /* The mapping holds the memory now: one fd per region (per allocation of a VMM
         * range) would otherwise stay open. */
        rf_export_close_fds(x, i);
    }
    RF_INFO("mapped %u of the %u trainer regions of the publisherd at %s (generation %llu, "
            "%zu pieces asked for)", mapped, n, path, (unsigned long long)e->generation,
            npieces);
    return 0;
}

/* Whether every region piece p reads (its own, and an FP8 piece's scales) is mapped in e. */
static bool piece_mapped(const src_entry *e, uint32_t p)
{
    const rf_inv *inv = e->exps[0]->inv;
    rf_piece pc;

    if (p >= rf_inv_npieces(inv, RF_SRC))
        return true; /* the slice names it stale itself */
    rf_inv_piece(inv, RF_SRC, p, &pc);
    if (pc.region >= e->nregions || !e->bases[pc.region])
        return false;
    return pc.quant == 0 || e->bases[rf_inv_quant(inv, pc.quant)->scale_region] != NULL;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

    return x < y ? -1 : x > y;
}

int rf_srcmap_get(rf_srcmap *m, uint64_t daemon_id, uint64_t generation,
                  const char *socket_path, uint32_t *pieces, size_t npieces, rf_slice_src *out,
                  rf_err *err)
{
    src_entry *e;
    size_t w = 0;
    bool created = false;
    int rc;

    for (e = m->entries; e; e = e->next)
        if (e->daemon_id == daemon_id && e->generation == generation)
            break;
    if (e == NULL) {
        if (!socket_path || !socket_path[0])
            return rf_err_set(err, -EPROTO, "the plan copies from publisher %016llx on this "
                              "host, which announced no socket", (unsigned long long)daemon_id);
        if ((e = calloc(1, sizeof(*e))) == NULL)
            return rf_err_set(err, -ENOMEM, "out of memory for the local sources");
        e->daemon_id = daemon_id;
        e->generation = generation;
        created = true;
    }
    /* The pieces whose memory is not mapped yet, sorted and unique. */
    qsort(pieces, npieces, sizeof(*pieces), cmp_u32);
    for (size_t i = 0; i < npieces; i++)
        if ((w == 0 || pieces[w - 1] != pieces[i]) && (created || !piece_mapped(e, pieces[i])))
            pieces[w++] = pieces[i];
    if ((w > 0 || created) && (rc = entry_fetch(m, e, socket_path, pieces, w, err)) < 0) {
        if (created)
            entry_free(m, e);
        return rc;
    }
    if (created) {
        e->next = m->entries;
        m->entries = e;
    }
    out->inv = e->exps ? e->exps[0]->inv : NULL;
    out->bases = e->bases;
    return 0;
}

int rf_srcmap_frame(rf_srcmap *m, const Refit__PlanSlice *ps, rf_slice_src **out, rf_err *err)
{
    uint32_t *pieces = NULL;
    size_t cap = 0;
    int rc = 0;

    *out = NULL;
    for (size_t i = 0; i < ps->n_msgs; i++)
        if (ps->msgs[i]->kind == RF_PLAN_LOCAL && ps->msgs[i]->peer >= ps->n_peers)
            return rf_err_set(err, -EPROTO, "plan slice message %u names peer %u of %zu",
                              ps->msgs[i]->seq, ps->msgs[i]->peer, ps->n_peers);
    /* One pass per peer that local messages name: its pieces, then one fetch at most. */
    for (size_t p = 0; p < ps->n_peers && rc == 0; p++) {
        const Refit__PeerAddr *pa = ps->peers[p];
        size_t n = 0;
        bool any = false;

        for (size_t i = 0; i < ps->n_msgs; i++) {
            const Refit__SliceMsg *sm = ps->msgs[i];

            if (sm->kind != RF_PLAN_LOCAL || sm->peer != p)
                continue;
            any = true;
            if (n + sm->n_xfers > cap) {
                size_t nc = (n + sm->n_xfers) * 2;
                uint32_t *np = realloc(pieces, nc * sizeof(*np));

                if (np == NULL) {
                    rc = rf_err_set(err, -ENOMEM, "out of memory for the plan slice");
                    goto out;
                }
                pieces = np;
                cap = nc;
            }
            for (size_t t = 0; t < sm->n_xfers; t++)
                pieces[n++] = sm->xfers[t]->src_piece;
        }
        if (!any)
            continue;
        if (!*out && !(*out = calloc(ps->n_peers, sizeof(**out)))) {
            rc = rf_err_set(err, -ENOMEM, "out of memory for the plan slice");
            goto out;
        }
        rc = rf_srcmap_get(m, pa->daemon_id, pa->generation, pa->local_sock, pieces, n,
                           &(*out)[p], err);
    }
out:
    free(pieces);
    if (rc < 0) {
        free(*out);
        *out = NULL;
    }
    return rc;
}

void rf_srcmap_prune(rf_srcmap *m, const rf_slice_job *keep)
{
    src_entry **pp = &m->entries;

    while (*pp) {
        src_entry *e = *pp;
        bool kept = false;
        uint32_t i;

        for (i = 0; keep && i < keep->npeers; i++)
            if (keep->peers[i].daemon_id == e->daemon_id &&
                keep->peers[i].generation == e->generation)
                kept = true;
        if (kept) {
            pp = &e->next;
            continue;
        }
        *pp = e->next;
        entry_free(m, e);
    }
}

uint32_t rf_srcmap_count(const rf_srcmap *m)
{
    uint32_t n = 0;
    const src_entry *e;

    for (e = m->entries; e; e = e->next)
        n++;
    return n;
}

uint64_t rf_srcmap_fetches(const rf_srcmap *m)
{
    return m->fetches;
}
