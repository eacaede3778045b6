/* common/control/srcmap.c - local publishers' exported memory, imported once per generation. */
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
    rf_export *exp;
    rf_mem_ref **refs;  /* per region of exp */
    uint8_t **bases;
    struct src_entry *next;
} src_entry;

struct rf_srcmap {
    uint8_t key[RF_PEER_KEY_MAX];
    size_t key_len;
    rf_export_signer signer; /* fn NULL: the key proves us */
    double timeout_s;
    /* One cache for every publisher and generation: an unchanged trainer region of a new
     * generation reuses its mapping (a CUDA IPC handle cannot be opened twice). */
    rf_mem_cache *cache;
    src_entry *entries;
    uint64_t fetches;
};

int rf_srcmap_new(const uint8_t *key, size_t key_len, double timeout_s, rf_srcmap **out,
                  rf_err *err)
{
    rf_srcmap *m;

    if (key_len == 0 || key_len > RF_PEER_KEY_MAX)
        return rf_err_set(err, -EINVAL, "srcmap: a cluster key of 1..%d bytes is needed",
                          RF_PEER_KEY_MAX);
    m = calloc(1, sizeof(*m));
    if (!m || !(m->cache = rf_mem_cache_new())) {
        free(m);
        return rf_err_set(err, -ENOMEM, "out of memory for the local sources");
    }
    memcpy(m->key, key, key_len);
    m->key_len = key_len;
    m->timeout_s = timeout_s;
    *out = m;
    return 0;
}

int rf_srcmap_new_signed(const rf_export_signer *signer, double timeout_s, rf_srcmap **out,
                         rf_err *err)
{
    rf_srcmap *m = calloc(1, sizeof(*m));

    if (!m || !(m->cache = rf_mem_cache_new())) {
        free(m);
        return rf_err_set(err, -ENOMEM, "out of memory for the local sources");
    }
    m->signer = *signer;
    m->timeout_s = timeout_s;
    *out = m;
    return 0;
}

static void entry_free(rf_srcmap *m, src_entry *e)
{
    uint32_t i;

    for (i = 0; e->refs && i < e->exp->nregions; i++)
        if (e->refs[i])
            rf_mem_release(m->cache, e->refs[i]);
    free(e->refs);
    free(e->bases);
    rf_export_free(e->exp);
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

static int entry_load(rf_srcmap *m, src_entry *e, const char *path, rf_err *err)
{
    uint64_t (*own)[2] = NULL; /* the publisherd's owner numbers -> this process's */
    uint32_t i, n, nown = 0;
    int rc;

    rc = m->signer.fn ? rf_export_fetch_signed(path, &m->signer, m->timeout_s, &e->exp, err)
                      : rf_export_fetch(path, m->key, m->key_len, m->timeout_s, &e->exp, err);
    if (rc < 0)
        return rc;
    m->fetches++;
    if (e->exp->generation != e->generation)
        return rf_err_set(err, -ESTALE, "the publisherd at %s holds inventory generation %llu, "
                          "the plan was built on %llu: its trainers changed, a new plan follows",
                          path, (unsigned long long)e->exp->generation,
                          (unsigned long long)e->generation);
    n = e->exp->nregions;
    e->refs = calloc(n ? n : 1, sizeof(*e->refs));
    e->bases = calloc(n ? n : 1, sizeof(*e->bases));
    if (!e->refs || !e->bases)
        return rf_err_set(err, -ENOMEM, "out of memory mapping the trainers of %s", path);
    /* A trainer's VMM regions of one allocation share a mapping: their publisherd numbers the
     * trainer (owner), which becomes a number of this process, new for each export, so a
     * trainer that came back with other allocations at the same addresses never meets the
     * mappings of its last life. Trainers are few: a short table. */
    for (i = 0; i < n; i++) {
        rf_mem_desc *d = &e->exp->regions[i];
        uint32_t j;

        if (d->owner == 0)
            continue;
        for (j = 0; j < nown && own[j][0] != d->owner; j++)
            ;
        if (j == nown) {
            uint64_t (*no)[2] = realloc(own, (nown + 1) * sizeof(*own));

            if (no == NULL) {
                free(own);
                return rf_err_set(err, -ENOMEM, "out of memory mapping the trainers of %s",
                                  path);
            }
            own = no;
            own[nown][0] = d->owner;
            own[nown++][1] = rf_mem_owner_new();
        }
        d->owner = own[j][1];
    }
    free(own);
    for (i = 0; i < n; i++) {
        rf_err ierr = {0};

        rc = rf_mem_import(m->cache, &e->exp->regions[i], &e->refs[i], &ierr);
        if (rc < 0)
            return rf_err_set(err, rc, "mapping trainer region %u of the publisherd at %s "
                              "(%s on %s): %s", i, path,
                              rf_mem_kind_name(e->exp->regions[i].kind),
                              e->exp->regions[i].device, ierr.msg);
        e->bases[i] = rf_mem_ref_base(e->refs[i]);
        /* The mapping holds the memory now: one fd per region (per allocation of a VMM
         * range) would otherwise stay open. */
        rf_export_close_fds(e->exp, i);
    }
    return 0;
}

int rf_srcmap_get(rf_srcmap *m, uint64_t daemon_id, uint64_t generation,
                  const char *socket_path, rf_slice_src *out, rf_err *err)
{
    src_entry *e;
    int rc;

    for (e = m->entries; e; e = e->next)
        if (e->daemon_id == daemon_id && e->generation == generation)
            goto found;
    if (!socket_path || !socket_path[0])
        return rf_err_set(err, -EPROTO, "the plan copies from publisher %016llx on this host, "
                          "which announced no socket", (unsigned long long)daemon_id);
    e = calloc(1, sizeof(*e));
    if (!e)
        return rf_err_set(err, -ENOMEM, "out of memory for the local sources");
    e->daemon_id = daemon_id;
    e->generation = generation;
    rc = entry_load(m, e, socket_path, err);
    if (rc < 0) {
        entry_free(m, e);
        return rc;
    }
    RF_INFO("mapped %u trainer regions of the publisherd at %s (generation %llu)",
            e->exp->nregions, socket_path, (unsigned long long)generation);
    e->next = m->entries;
    m->entries = e;
found:
    out->inv = e->exp->inv;
    out->bases = e->bases;
    return 0;
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
