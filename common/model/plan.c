/* common/model/plan.c - the reshard planner: cuts every destination piece along the boundaries of the
 * source pieces that overlap it, picks one holder per cell (a same-host one first, else
 * balancing sender and link loads), then groups the transfers into messages per endpoint pair
 * and schedules the network ones in rounds. */
#include "plan.h"
#include "quant_fmt.h"

#include <assert.h>
#include <inttypes.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define MiB (1024ull * 1024ull)
/* Smallest accepted staging budget: a round must hold at least one element of any dtype. */
#define MIN_STAGING 4096ull
/* Dense tables of endpoint or node pairs up to this many entries, else hash tables (set
 * below, with the tests' hook). */
static uint64_t linkmat_max;

struct rf_plan {
    const rf_inv *inv;
    rf_plan_opts opts;
    uint8_t id[RF_PLAN_ID_BYTES];
    /* The transfers in the order they were planned (destination piece by piece), in a mapping
     * of their own (big_alloc), and order: the index of the i-th transfer in message order.
     * Moving twelve million transfers into message order would cost a second copy of them
     * in fresh memory, which is the dearest part of planning at that size. */
    rf_plan_xfer *xfers;
    size_t xfers_bytes;
    uint32_t *order;
    size_t order_bytes;
    uint64_t nxfers;
    rf_plan_msg *msgs;
    uint32_t nmsgs;
    uint32_t nrounds;
    rf_box *boxes;
    uint32_t nboxes;
    uint32_t nendpoints;
    uint64_t *sent; /* per endpoint id */
    uint64_t *recv;
    uint64_t *path; /* [kind * nendpoints + endpoint]: sent or received bytes per path */
    rf_plan_stats st;
    /* Relay trees (rf_plan_chunk), NULL and 0 without relays: xchunk[i] is the tree of the
     * i-th transfer in message order, or RF_PLAN_NO_CHUNK; tree c's transfers are cx[cfirst[c]
     * .. cfirst[c + 1]), its origins first (corig[c] of them), then its relays, each part in
     * message order. */
    uint32_t *xchunk;
    uint32_t nchunks;
    uint32_t *cfirst, *corig, *cx;
};

void rf_plan_opts_default(rf_plan_opts *o)
{
    o->staging_bytes = 256 * MiB;
    o->direct_min_bytes = 4 * MiB;
    o->relay = 0;
}

/* ---- small growable arrays and hash tables ------------------------------------------------ */

static int grow(void **p, uint64_t *cap, uint64_t need, size_t elem)
{
    uint64_t c = *cap ? *cap : 64;
    void *q;

    if (need <= *cap)
        return 0;
    while (c < need)
        c *= 2;
    q = realloc(*p, c * elem);
    if (q == NULL)
        return -ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

/* Arrays of hundreds of MiB (the transfers of a large plan) get a mapping of their own with
 * transparent huge pages where the kernel allows: one page fault per 2 MiB instead of 512,
 * and growing or shrinking them with mremap copies nothing. */
static void *big_alloc(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

    if (p == MAP_FAILED)
        return NULL;
    (void)madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

static void big_free(void *p, size_t bytes)
{
    if (p)
        munmap(p, bytes);
}

/* Resizes *p (of *bytes) to hold n elements of size elem; a NULL *p is allocated. */
static int big_resize(void **p, size_t *bytes, uint64_t n, size_t elem)
{
    size_t nb = (size_t)n * elem;
    void *q;

    if (nb == 0)
        nb = elem;
    if (*p == NULL) {
        q = big_alloc(nb);
        if (q == NULL)
            return -ENOMEM;
    } else {
        q = mremap(*p, *bytes, nb, MREMAP_MAYMOVE);
        if (q == MAP_FAILED)
            return -ENOMEM;
        if (nb > *bytes)
            (void)madvise(q, nb, MADV_HUGEPAGE);
    }
    *p = q;
    *bytes = nb;
    return 0;
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* Box table: boxes interned by value (unused dims normalised to [0:1]). */
typedef struct boxtab {
    rf_box *boxes;
    uint64_t n, cap;
    uint32_t *slots; /* index + 1, 0 = empty */
    uint64_t nslots;
} boxtab;

static uint64_t box_hash(const rf_box *b)
{
    uint64_t h = 0;

    for (int d = 0; d < RF_MAX_DIMS; d++)
        h = (h ^ (uint64_t)b->start[d]) * 0x100000001b3ull ^ (uint64_t)b->extent[d] * 0x9e3779b97f4a7c15ull;
    return mix64(h);
}

static int boxtab_rehash(boxtab *t, uint64_t nslots)
{
    uint32_t *s = calloc(nslots, sizeof(*s));

    if (s == NULL)
        return -ENOMEM;
    for (uint64_t i = 0; i < t->n; i++) {
        uint64_t j = box_hash(&t->boxes[i]) & (nslots - 1);
        while (s[j])
            j = (j + 1) & (nslots - 1);
        s[j] = (uint32_t)(i + 1);
    }
    free(t->slots);
    t->slots = s;
    t->nslots = nslots;
    return 0;
}

static int boxtab_intern(boxtab *t, const rf_box *b, uint32_t *id)
{
    uint64_t j;
    int rc;

    if ((t->n + 1) * 2 > t->nslots) {
        rc = boxtab_rehash(t, t->nslots ? t->nslots * 2 : 1024);
        if (rc)
            return rc;
    }
    j = box_hash(b) & (t->nslots - 1);
    while (t->slots[j]) {
        uint32_t i = t->slots[j] - 1;
        if (memcmp(&t->boxes[i], b, sizeof(*b)) == 0) {
            *id = i;
            return 0;
        }
        j = (j + 1) & (t->nslots - 1);
    }
    if (t->n >= UINT32_MAX - 1)
        return -E2BIG;
    rc = grow((void **)&t->boxes, &t->cap, t->n + 1, sizeof(rf_box));
    if (rc)
        return rc;
    t->boxes[t->n] = *b;
    t->slots[j] = (uint32_t)(t->n + 1);
    *id = (uint32_t)t->n++;
    return 0;
}

/* Link loads keyed by (source node, destination node). */
typedef struct linktab {
    uint64_t *keys; /* key + 1, 0 = empty */
    uint64_t *vals;
    uint64_t n, nslots;
} linktab;

static uint64_t *linktab_find(const linktab *t, uint64_t key)
{
    uint64_t j;

    if (t->nslots == 0)
        return NULL;
    j = mix64(key + 1) & (t->nslots - 1);
    while (t->keys[j]) {
        if (t->keys[j] == key + 1)
            return &t->vals[j];
        j = (j + 1) & (t->nslots - 1);
    }
    return NULL;
}

/* The load counter of a link, added at 0 if new. Pointers stay valid until the next
 * insertion of a new key. */
static int linktab_slot(linktab *t, uint64_t key, uint64_t **val)
{
    uint64_t j;

    if ((*val = linktab_find(t, key)) != NULL)
        return 0;
    if ((t->n + 1) * 2 > t->nslots) {
        uint64_t ns = t->nslots ? t->nslots * 2 : 256;
        uint64_t *k = calloc(ns, sizeof(*k)), *v = calloc(ns, sizeof(*v));
        if (k == NULL || v == NULL) {
            free(k);
            free(v);
            return -ENOMEM;
        }
        for (uint64_t i = 0; i < t->nslots; i++) {
            if (!t->keys[i])
                continue;
            j = mix64(t->keys[i]) & (ns - 1);
            while (k[j])
                j = (j + 1) & (ns - 1);
            k[j] = t->keys[i];
            v[j] = t->vals[i];
        }
        free(t->keys);
        free(t->vals);
        t->keys = k;
        t->vals = v;
        t->nslots = ns;
    }
    j = mix64(key + 1) & (t->nslots - 1);
    while (t->keys[j])
        j = (j + 1) & (t->nslots - 1);
    t->keys[j] = key + 1;
    t->n++;
    *val = &t->vals[j];
    return 0;
}

/* Stable LSD radix sort of (key, val) pairs by key, 16 bits a pass over the bits in use. */
static int radix_sort(uint64_t *key, uint32_t *val, uint64_t n, int bits)
{
    uint64_t *k2 = NULL, *cnt = NULL;
    uint32_t *v2 = NULL;
    int rc = 0;

    if (n < 2 || bits <= 0)
        return 0;
    k2 = malloc(n * sizeof(*k2));
    v2 = malloc(n * sizeof(*v2));
    cnt = malloc(65536 * sizeof(*cnt));
    if (k2 == NULL || v2 == NULL || cnt == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    for (int shift = 0; shift < bits; shift += 16) {
        uint64_t sum = 0;
        memset(cnt, 0, 65536 * sizeof(*cnt));
        for (uint64_t i = 0; i < n; i++)
            cnt[(key[i] >> shift) & 0xffff]++;
        for (int b = 0; b < 65536; b++) {
            uint64_t c = cnt[b];
            cnt[b] = sum;
            sum += c;
        }
        for (uint64_t i = 0; i < n; i++) {
            uint64_t o = cnt[(key[i] >> shift) & 0xffff]++;
            k2[o] = key[i];
            v2[o] = val[i];
        }
        memcpy(key, k2, n * sizeof(*key));
        memcpy(val, v2, n * sizeof(*val));
    }
out:
    free(k2);
    free(v2);
    free(cnt);
    return rc;
}

static int bits_for(uint64_t n) /* bits needed for values 0..n-1 */
{
    int b = 0;

    while (b < 64 && (n - 1) >> b)
        b++;
    return b;
}

/* ---- the digest ------------------------------------------------------------------------ */

/* Values are written as LEB128 varints: the digest is over a faithful, compact encoding. */
typedef struct hbuf {
    crypto_generichash_state st;
    uint8_t buf[16384];
    size_t n;
} hbuf;

static void hb_flush(hbuf *h)
{
    crypto_generichash_update(&h->st, h->buf, h->n);
    h->n = 0;
}

/* Appends v with no room check: callers make sure of 10 free bytes per value. */
static inline void hb_put(hbuf *h, uint64_t v)
{
    while (v >= 0x80) {
        h->buf[h->n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    h->buf[h->n++] = (uint8_t)v;
}

static inline void hb_u64(hbuf *h, uint64_t v)
{
    if (h->n > sizeof(h->buf) - 16)
        hb_flush(h);
    hb_put(h, v);
}

static void hb_bytes(hbuf *h, const void *p, size_t len)
{
    hb_u64(h, len);
    hb_flush(h);
    crypto_generichash_update(&h->st, p, len);
}

/* Signed difference, zigzag-encoded so that small steps either way stay one byte. */
static inline uint64_t zz(uint64_t cur, uint64_t prev)
{
    int64_t d = (int64_t)(cur - prev);

    return ((uint64_t)d << 1) ^ (uint64_t)(d >> 63);
}

/* The geometry table (every box and strides in use, interned) is hashed once, then each piece
 * as its compact record: the tensor, region and offset as differences from the previous
 * piece's and the geometry id. Pieces of a shard layout mostly step by one tensor and a
 * steady offset, so a piece costs a few bytes of hashing instead of its whole box. The
 * encoding is faithful: the table and the records give back every piece exactly. */
void rf_plan_digest(const rf_inv *inv, const rf_plan_opts *opts, uint8_t out[RF_PLAN_ID_BYTES])
{
    static const char tag[] = "refit-plan-v2", hosts_tag[] = "hosts", relay_tag[] = "relay-v1",
                      quant_tag[] = "fp8-v1";
    hbuf hb, *h = &hb;
    uint32_t nt = rf_inv_ntensors(inv), ng = rf_inv_ngeoms(inv);
    const rf_geom *geoms = rf_inv_geoms(inv);

    h->n = 0;
    crypto_generichash_init(&h->st, NULL, 0, RF_PLAN_ID_BYTES);
    hb_bytes(h, tag, sizeof(tag));
    hb_u64(h, opts->staging_bytes);
    hb_u64(h, opts->direct_min_bytes);
    hb_u64(h, nt);
    for (uint32_t t = 0; t < nt; t++) {
        const rf_tensor *tt = rf_inv_tensor(inv, t);
        hb_bytes(h, tt->name, strlen(tt->name));
        hb_u64(h, (uint64_t)tt->dtype);
        hb_u64(h, (uint64_t)tt->ndim);
        for (int d = 0; d < tt->ndim; d++)
            hb_u64(h, (uint64_t)tt->shape[d]);
    }
    hb_u64(h, rf_inv_nendpoints(inv));
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++) {
        const rf_endpoint *ep = rf_inv_endpoint(inv, e);
        hb_u64(h, (uint64_t)ep->side);
        hb_u64(h, ep->node);
    }
    hb_u64(h, rf_inv_nregions(inv));
    for (uint32_t r = 0; r < rf_inv_nregions(inv); r++) {
        const rf_region *rg = rf_inv_region(inv, r);
        hb_u64(h, rg->endpoint);
        hb_u64(h, rg->size);
    }
    hb_u64(h, ng);
    for (uint32_t g = 0; g < ng; g++) {
        for (int d = 0; d < RF_MAX_DIMS; d++) {
            hb_u64(h, (uint64_t)geoms[g].box.start[d]);
            hb_u64(h, (uint64_t)geoms[g].box.extent[d]);
            hb_u64(h, (uint64_t)geoms[g].strides[d]);
        }
    }
    for (int s = RF_SRC; s <= RF_DST; s++) {
        uint32_t np = rf_inv_npieces(inv, (rf_side)s);
        const rf_piece_rec *r = rf_inv_piece_recs(inv, (rf_side)s);
        uint64_t pt = 0, pr = 0, po = 0;
        hb_u64(h, np);
        for (uint32_t i = 0; i < np; i++) {
            if (h->n > sizeof(h->buf) - 48)
                hb_flush(h);
            hb_put(h, zz(r[i].tensor, pt));
            hb_put(h, zz(r[i].region, pr));
            hb_put(h, r[i].geom);
            hb_put(h, zz(r[i].offset, po));
            pt = r[i].tensor;
            pr = r[i].region;
            po = r[i].offset;
        }
    }
    /* Hosts come last and only when some endpoint has one: the encoding above says where it
     * ends (every count is in it), so a suffix tells inventories with hosts from those
     * without, and an inventory without hosts keeps the id it had before hosts existed. */
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++) {
        if (rf_inv_endpoint(inv, e)->host == RF_HOST_NONE)
            continue;
        hb_bytes(h, hosts_tag, sizeof(hosts_tag));
        for (uint32_t k = 0; k < rf_inv_nendpoints(inv); k++)
            hb_u64(h, rf_inv_endpoint(inv, k)->host);
        break;
    }
    /* FP8 pieces likewise (issue 15): which pieces, and each declaration, only when any is. */
    if (rf_inv_nquants(inv) > 0) {
        const rf_piece_rec *r = rf_inv_piece_recs(inv, RF_DST);

        hb_bytes(h, quant_tag, sizeof(quant_tag));
        for (uint32_t i = 0; i < rf_inv_npieces(inv, RF_DST); i++)
            hb_u64(h, r[i].quant);
        for (uint32_t q = 1; q <= rf_inv_nquants(inv); q++) {
            const rf_quant_decl *qd = rf_inv_quant(inv, q);

            hb_u64(h, (uint64_t)qd->kind);
            hb_u64(h, qd->br);
            hb_u64(h, qd->bc);
            hb_u64(h, qd->scale_region);
            hb_u64(h, qd->scale_offset);
            for (int d = 0; d < RF_MAX_DIMS; d++)
                hb_u64(h, (uint64_t)qd->scale_strides[d]);
        }
    }
    /* Relays likewise: a suffix only when on, so a plan without them keeps its id. */
    if (opts->relay) {
        hb_bytes(h, relay_tag, sizeof(relay_tag));
        hb_u64(h, opts->relay);
    }
    hb_flush(h);
    crypto_generichash_final(&h->st, out, RF_PLAN_ID_BYTES);
}

/* ---- building ------------------------------------------------------------------------- */

/* Per tensor, the source pieces sorted by their start along one "key" dim, with the largest
 * extent along it, so that a destination box finds its overlapping sources by binary search. */
typedef struct srcidx {
    uint64_t *first;  /* per tensor, into ids/kstart; first[nt] = total */
    uint32_t *ids;
    int64_t *kstart;  /* start along the key dim, sorted within a tensor */
    int64_t *maxext;  /* per tensor: largest extent along the key dim */
    uint8_t *kdim;    /* per tensor: the key dim */
} srcidx;

/* What planning one destination piece reads about its tensor and the tensor's sources, packed
 * so that it comes from one or two cache lines: the pieces of a rank walk the tensors in order,
 * so these are read almost sequentially, where the scattered source records would miss. */
typedef struct tinfo {
    uint32_t first, count; /* into the packed sources */
    int64_t maxext;        /* largest source extent along the key dim */
    uint8_t kdim, ndim, esize;
} tinfo;

typedef struct sent {
    int64_t kstart;        /* start along the key dim; sorted within a tensor */
    uint32_t id, ep;       /* source piece and its endpoint */
    const rf_geom *g;
} sent;

/* A candidate source for one destination piece. */
typedef struct cand {
    uint32_t id;
    uint32_t ep;
    uint64_t link;     /* (src node << 32) | dst node */
    uint64_t *linkp;   /* that link's load */
    const rf_geom *g;  /* its box (unused dims [0:1]) and strides, in the inventory */
    bool local;        /* on the destination's host: copied there, no network */
    int32_t lo[RF_MAX_DIMS], hi[RF_MAX_DIMS]; /* cell ranges covered, per dim */
} cand;

typedef struct builder {
    const rf_inv *inv;
    rf_plan *plan;
    uint64_t half;
    srcidx si;
    tinfo *ti;        /* per tensor */
    sent *se;         /* sources in index order */
    uint64_t *load;   /* sender load per endpoint: network bytes */
    uint64_t *lload;  /* per source endpoint: bytes copied from it on its host */
    linktab links;
    boxtab boxes;
    uint64_t nx, capx;
    /* Messages in the order they are opened (build ids). A packed message stays open for
     * more transfers of its endpoint pair until the next one would overflow half the budget:
     * open[pair] (dense, source index * destination endpoints + destination index) or the
     * hash table opentab hold its build id + 1. */
    rf_plan_msg *mb;
    uint64_t nmb, capmb;
    uint32_t *open;
    linktab opentab;
    /* The same for local messages, whose pairs are never network pairs; NULL and empty
     * unless some source and destination share a host. */
    uint32_t *open_local;
    linktab opentab_local;
    uint32_t *host;   /* endpoint id -> host */
    bool any_local;   /* some source endpoint and destination endpoint share a host */
    uint32_t *epidx;  /* endpoint id -> dense index within its side */
    uint32_t nsrc_ep, ndst_ep;
    uint32_t *node;   /* endpoint id -> node */
    uint32_t *nodeidx; /* endpoint id -> dense node index within its side */
    uint32_t nsrc_node, ndst_node;
    uint64_t *linkmat; /* dense link loads [src node idx][dst node idx], or NULL: hash */
    uint32_t *sidx_ep, *didx_ep; /* dense endpoint index -> endpoint id, per side */
    uint32_t *src_ep;  /* source piece -> endpoint */
    uint32_t *reg_ep;  /* region -> endpoint */
    uint8_t *t_ndim;   /* per tensor: ndim and element size */
    uint8_t *t_esize;
    const rf_piece_rec *srec, *drec;
    const rf_geom *geoms;
    /* Per geometry, when the table is small enough: the interned box id of its box (+ 1, 0 =
     * not yet) and the number of contiguous runs of its box in its own memory. A destination
     * piece sent whole, the common case, then costs no box hashing nor run counting. */
    uint32_t *gbid;
    uint64_t *gruns;
    /* scratch for one destination piece */
    cand *cands;
    uint64_t ncand, capcand;
    int64_t *cuts[RF_MAX_DIMS];
    uint64_t capcuts[RF_MAX_DIMS];
    int ncuts[RF_MAX_DIMS];
    int32_t *holder;
    uint8_t *done;
    uint64_t capcells, capdone;
    int32_t *hs; /* holders of one cell */
    uint64_t caphs;
    /* Relays (opts.relay), NULL and 0 when off. A unit is one chunk of one destination piece
     * as a relay source sees it: written by the transfers tagged with it in wunit, ready
     * (fully written) at the end of round ready[unit]. */
    bool relay;
    uint64_t rchunk;   /* largest chunk */
    uint64_t rmsg;     /* largest packed message */
    uint64_t rcap;     /* a replica relays only while its sends stay within this */
    uint32_t cur_unit; /* the unit emit tags transfers with; NO_UNIT for none */
    uint32_t *wunit;   /* per transfer in build order */
    size_t wunit_bytes;
    uint32_t *ready;
    uint64_t nunits, capunits;
    struct rlay *rl;   /* relay transfers in build order */
    uint64_t nrl, caprl;
    linktab rlinks;    /* relay link loads: (source node << 32) | destination node */
    uint64_t *rlinkmat; /* or dense, [source][destination] destination node index */
    uint8_t *ep_local; /* per endpoint: a destination sharing a host with some source */
    uint32_t *stamp;   /* per endpoint: last set that used it */
    uint32_t setgen;
    uint32_t *mem;     /* one set's relay members */
    struct placed *pc; /* one chunk's members that hold it */
    uint64_t capmem, cappc;
} builder;

#define NO_UNIT UINT32_MAX

/* A relay transfer, until its message is formed: its index in the build order, the units it
 * reads and writes, the dense indices of its two endpoints, its hop count and its kind.
 * Scheduling takes relays in round order, far from build order: what it needs is here, so
 * that it does not chase transfers and piece records around memory. */
typedef struct rlay {
    uint32_t x, src_unit, unit;
    uint32_t qi, pi;
    uint8_t depth, kind;
} rlay;

/* A member of a replica set that holds one chunk: a relay source for the next ones. */
typedef struct placed {
    uint32_t piece, ep, unit, depth, kids;
} placed;

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

    return (x > y) - (x < y);
}

static int build_srcidx(builder *b, rf_err *err)
{
    const rf_inv *inv = b->inv;
    uint32_t nt = rf_inv_ntensors(inv), ns = rf_inv_npieces(inv, RF_SRC);
    srcidx *si = &b->si;
    uint64_t *fill = NULL, *key = NULL;
    uint32_t *val = NULL;
    int64_t (*lo)[RF_MAX_DIMS] = NULL; /* per tensor scratch: distinct-start heuristic */
    const rf_piece_rec *sr = b->srec;
    int rc = 0;

    si->first = calloc((uint64_t)nt + 1, sizeof(*si->first));
    si->ids = malloc(((uint64_t)ns + 1) * sizeof(*si->ids));
    si->kstart = malloc(((uint64_t)ns + 1) * sizeof(*si->kstart));
    si->maxext = calloc((uint64_t)nt + 1, sizeof(*si->maxext));
    si->kdim = calloc((uint64_t)nt + 1, 1);
    fill = calloc((uint64_t)nt + 1, sizeof(*fill));
    if (!si->first || !si->ids || !si->kstart || !si->maxext || !si->kdim || !fill) {
        rc = rf_err_set(err, -ENOMEM, "plan: out of memory indexing %u source pieces", ns);
        goto out;
    }
    for (uint32_t i = 0; i < ns; i++)
        si->first[sr[i].tensor + 1]++;
    for (uint32_t t = 0; t < nt; t++)
        si->first[t + 1] += si->first[t];
    /* The key dim of a tensor is the one along which its source pieces are split the most:
     * the first dim where two pieces start at different places is a good enough proxy and
     * costs one pass. */
    lo = malloc(((uint64_t)nt + 1) * sizeof(*lo));
    if (lo == NULL) {
        rc = rf_err_set(err, -ENOMEM, "plan: out of memory indexing %u source pieces", ns);
        goto out;
    }
    memset(si->kdim, 0xff, nt);
    for (uint32_t i = 0; i < ns; i++) {
        uint32_t t = sr[i].tensor;
        const rf_box *pb = &b->geoms[sr[i].geom].box;
        if (fill[t] == 0) {
            memcpy(lo[t], pb->start, sizeof(lo[t]));
        } else if (si->kdim[t] == 0xff) {
            for (int d = 0; d < RF_MAX_DIMS; d++) {
                if (pb->start[d] != lo[t][d]) {
                    si->kdim[t] = (uint8_t)d;
                    break;
                }
            }
        }
        fill[t]++;
    }
    for (uint32_t t = 0; t < nt; t++) {
        if (si->kdim[t] == 0xff)
            si->kdim[t] = 0;
        fill[t] = si->first[t];
    }
    for (uint32_t i = 0; i < ns; i++) {
        uint32_t t = sr[i].tensor;
        const rf_box *pb = &b->geoms[sr[i].geom].box;
        int k = si->kdim[t];
        si->ids[fill[t]] = i;
        si->kstart[fill[t]] = pb->start[k];
        fill[t]++;
        if (pb->extent[k] > si->maxext[t])
            si->maxext[t] = pb->extent[k];
    }
    /* Sort each tensor's group by start (stable: by piece id among equal starts). One radix
     * sort over (tensor, start) keeps this linear. */
    key = malloc(((uint64_t)ns + 1) * sizeof(*key));
    val = malloc(((uint64_t)ns + 1) * sizeof(*val));
    if (key == NULL || val == NULL) {
        rc = rf_err_set(err, -ENOMEM, "plan: out of memory indexing %u source pieces", ns);
        goto out;
    }
    {
        int64_t maxs = 0;
        int sb, tb;
        for (uint32_t i = 0; i < ns; i++)
            if (si->kstart[i] > maxs)
                maxs = si->kstart[i];
        sb = bits_for((uint64_t)maxs + 1);
        tb = bits_for((uint64_t)nt + 1);
        if (sb + tb <= 64) {
            uint64_t pos = 0;
            for (uint32_t t = 0; t < nt; t++)
                for (; pos < si->first[t + 1]; pos++)
                    key[pos] = ((uint64_t)t << sb) | (uint64_t)si->kstart[pos];
            for (uint32_t i = 0; i < ns; i++)
                val[i] = si->ids[i];
            rc = radix_sort(key, val, ns, sb + tb);
            if (rc) {
                rf_err_set(err, rc, "plan: out of memory sorting %u source pieces", ns);
                goto out;
            }
            for (uint32_t i = 0; i < ns; i++) {
                si->ids[i] = val[i];
                si->kstart[i] = (int64_t)(key[i] & (sb == 64 ? ~0ull : ((1ull << sb) - 1)));
            }
        } else {
            /* Coordinates too large for one key: fall back to sorting by start only within
             * each tensor through the same path, tensor by tensor. */
            for (uint32_t t = 0; t < nt; t++) {
                uint64_t a = si->first[t], n = si->first[t + 1] - a;
                for (uint64_t i = 0; i < n; i++) {
                    key[i] = (uint64_t)si->kstart[a + i];
                    val[i] = si->ids[a + i];
                }
                rc = radix_sort(key, val, n, sb);
                if (rc) {
                    rf_err_set(err, rc, "plan: out of memory sorting %u source pieces", ns);
                    goto out;
                }
                for (uint64_t i = 0; i < n; i++) {
                    si->kstart[a + i] = (int64_t)key[i];
                    si->ids[a + i] = val[i];
                }
            }
        }
    }
    b->ti = malloc(((uint64_t)nt + 1) * sizeof(*b->ti));
    b->se = malloc(((uint64_t)ns + 1) * sizeof(*b->se));
    if (b->ti == NULL || b->se == NULL) {
        rc = rf_err_set(err, -ENOMEM, "plan: out of memory indexing %u source pieces", ns);
        goto out;
    }
    for (uint32_t t = 0; t < nt; t++)
        b->ti[t] = (tinfo){.first = (uint32_t)si->first[t],
                           .count = (uint32_t)(si->first[t + 1] - si->first[t]),
                           .maxext = si->maxext[t], .kdim = si->kdim[t], .ndim = b->t_ndim[t],
                           .esize = b->t_esize[t]};
    for (uint32_t i = 0; i < ns; i++)
        b->se[i] = (sent){.kstart = si->kstart[i], .id = si->ids[i], .ep = b->src_ep[si->ids[i]],
                          .g = &b->geoms[sr[si->ids[i]].geom]};
out:
    free(fill);
    free(key);
    free(val);
    free(lo);
    return rc;
}

static void box_norm(rf_box *b, int ndim)
{
    for (int d = ndim; d < RF_MAX_DIMS; d++) {
        b->start[d] = 0;
        b->extent[d] = 1;
    }
}

/* Contiguous runs that sub occupies in memory laid out with these strides, as rf_piece_runs
 * counts them: the innermost dims that are contiguous merge into one run, and each index of
 * the dims outside them is a run of its own. */
static inline uint64_t nruns(const int64_t *strides, int ndim, const rf_box *sub)
{
    uint64_t run_el = 1, n = 1;
    int d = ndim - 1;

    for (; d >= 0; d--) {
        uint64_t ext = (uint64_t)sub->extent[d];
        if (ext == 1)
            continue;
        if ((uint64_t)strides[d] != run_el)
            break;
        run_el *= ext;
    }
    for (; d >= 0; d--)
        n *= (uint64_t)sub->extent[d];
    return n;
}

static inline uint64_t numel(const rf_box *box, int ndim)
{
    uint64_t n = 1;

    for (int d = 0; d < ndim; d++)
        n *= (uint64_t)box->extent[d];
    return n;
}

/* The destination piece being planned, as the phases of plan_piece and emit read it: filled
 * once per piece, so that emit takes the piece as one argument rather than five. */
typedef struct dpiece {
    uint32_t id;        /* destination piece id */
    uint32_t geom;      /* its geometry: box (unused dims [0:1]) and strides */
    uint32_t tensor;
    uint32_t ep, node;  /* its endpoint and that endpoint's node */
    int ndim;
    size_t esize;
    const rf_box *box;  /* its box, in the inventory, or a chunk of it (relays) */
    bool whole;         /* box is the piece's own box */
    const rf_quant_decl *quant; /* an FP8 piece: its format (NULL for none) */
    int64_t rows, cols; /* with quant: the tensor's matrix (its last two dims) */
} dpiece;

/* The grid step of FP8 piece dp along dim d: a box edge there must fall on a multiple of it
 * (or on the matrix's end); 1 for leading dims. */
static int64_t quant_step(const dpiece *dp, int d)
{
    rf_quant_fmt f = {dp->quant->kind, dp->quant->br, dp->quant->bc};
    uint64_t br, bc;

    if (d < dp->ndim - 2)
        return 1;
    rf_quant_fmt_block(&f, (uint64_t)dp->rows, (uint64_t)dp->cols, &br, &bc);
    return (int64_t)(d == dp->ndim - 2 ? br : bc);
}

/* A transfer of box into FP8 piece dp from candidate c. A box on the format's grid is
 * quantized by its sender (the source's rows must be contiguous): *bytes becomes the FP8
 * elements and scales, and 0 is returned. A box a trainer's shard boundary cuts off the grid
 * carries the tensor's dtype and is quantized by the receiver once every transfer into the
 * piece has landed (every block such a boundary cuts is covered by such boxes only): *bytes
 * becomes its elements in the tensor's dtype, and 1 is returned. The receiver tells the two
 * apart by the same test (rf_quant_box_ok). */
static int quant_xfer(const builder *b, const dpiece *dp, const cand *c, const rf_box *box,
                      uint64_t *bytes, rf_err *err);

static int emit(builder *b, const dpiece *dp, const cand *c, const rf_box *box, uint64_t bytes,
                bool whole, rf_err *err);

/* Room for one more transfer (and its unit tag, with relays), once its box is interned with
 * result rc: the transfers' array grows by doubling in its own mapping. */
static int xfer_room(builder *b, int rc, rf_err *err)
{
    rf_plan *pl = b->plan;

    if (b->nx >= UINT32_MAX - 1)
        return rf_err_set(err, -E2BIG, "plan: %llu transfers exceed the 32-bit transfer index",
                          (unsigned long long)b->nx + 1);
    if (rc == 0 && b->nx >= b->capx) {
        rc = big_resize((void **)&pl->xfers, &pl->xfers_bytes, b->capx * 2, sizeof(rf_plan_xfer));
        if (rc == 0 && b->wunit)
            rc = big_resize((void **)&b->wunit, &b->wunit_bytes, b->capx * 2, sizeof(uint32_t));
        if (rc == 0)
            b->capx *= 2;
    }
    if (rc)
        return rf_err_set(err, rc, "plan: out of memory after %llu transfers",
                          (unsigned long long)b->nx);
    return 0;
}

/* A packed transfer larger than half the staging budget would fit no round: it is split along
 * the outermost dim of extent > 1 into slabs that fit, and a single slab that is still too
 * large is split again along the next dim, by emit's own check on each slab. */
static int emit_slabs(builder *b, const dpiece *dp, const cand *c, const rf_box *box,
                      uint64_t bytes, bool recvq, rf_err *err)
{
    int ndim = dp->ndim, d = 0, rc;
    uint64_t slab;
    rf_box sub = *box;

    while (d < ndim && box->extent[d] == 1)
        d++;
    slab = bytes / (uint64_t)box->extent[d];
    if (dp->quant && !recvq) {
        /* FP8: slabs stay on the format's grid, whole blocks each. A box off the grid (it
         * carries the tensor's dtype) is cut like any other: emit classifies each slab by
         * its own box, as the receiver does, and every block a slab boundary cuts is covered
         * by slabs off the grid, which land in the shadow. */
        int64_t step = quant_step(dp, d), k = (int64_t)(b->half / slab) / step * step;

        if (k == 0)
            return rf_err_set(err, -ENOSPC, "plan: a %" PRId64 "-element block row of FP8 "
                              "tensor %s does not fit half the staging budget (%llu bytes); "
                              "raise staging", step * (int64_t)(numel(box, ndim) /
                              (uint64_t)box->extent[d]), rf_inv_tensor(b->inv, dp->tensor)->name,
                              (unsigned long long)b->half);
        for (int64_t s = 0; s < box->extent[d]; s += k) {
            sub.start[d] = box->start[d] + s;
            sub.extent[d] = box->extent[d] - s < k ? box->extent[d] - s : k;
            if ((rc = emit(b, dp, c, &sub, numel(&sub, ndim) * dp->esize, false, err)))
                return rc;
        }
        return 0;
    }
    if (slab <= b->half) {
        int64_t k = (int64_t)(b->half / slab);
        for (int64_t s = 0; s < box->extent[d]; s += k) {
            sub.start[d] = box->start[d] + s;
            sub.extent[d] = box->extent[d] - s < k ? box->extent[d] - s : k;
            rc = emit(b, dp, c, &sub, numel(&sub, ndim) * dp->esize, false, err);
            if (rc)
                return rc;
        }
    } else {
        for (int64_t s = 0; s < box->extent[d]; s++) {
            sub.start[d] = box->start[d] + s;
            sub.extent[d] = 1;
            rc = emit(b, dp, c, &sub, numel(&sub, ndim) * dp->esize, false, err);
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* The message that carries a new transfer of bytes from src_ep to dst_ep. Messages are formed
 * while transfers are emitted: a packed or local transfer joins its pair's open message of
 * its kind while that still fits half the budget, else opens a new one; a direct one gets its
 * own. Local messages are bounded like packed ones although they use no staging, so that the
 * local transport's digests and progress come in pieces of a known size. */
static int msg_for(builder *b, uint32_t src_ep, uint32_t dst_ep, rf_plan_kind kind,
                   uint64_t bytes, rf_plan_msg **out, rf_err *err)
{
    uint32_t *slot32 = NULL;
    uint64_t *slot64 = NULL, open = 0;
    rf_plan_msg *mm;

    if (kind != RF_PLAN_DIRECT) {
        uint32_t si = b->epidx[src_ep], di = b->epidx[dst_ep];
        uint32_t *dense = kind == RF_PLAN_LOCAL ? b->open_local : b->open;
        linktab *tab = kind == RF_PLAN_LOCAL ? &b->opentab_local : &b->opentab;
        if (dense) {
            slot32 = &dense[(uint64_t)si * b->ndst_ep + di];
            open = *slot32;
        } else {
            if (linktab_slot(tab, (uint64_t)si << 32 | di, &slot64))
                return rf_err_set(err, -ENOMEM, "plan: out of memory for open messages");
            open = *slot64;
        }
    }
    /* With relays, a packed message holds at most rmsg (plan_with_relays). */
    if (open && b->mb[open - 1].bytes + bytes <= (b->rmsg ? b->rmsg : b->half)) {
        *out = &b->mb[open - 1];
        return 0;
    }
    if (b->nmb >= UINT32_MAX - 1)
        return rf_err_set(err, -E2BIG, "plan: more than 2^32 messages");
    if (grow((void **)&b->mb, &b->capmb, b->nmb + 1, sizeof(rf_plan_msg)))
        return rf_err_set(err, -ENOMEM, "plan: out of memory after %llu messages",
                          (unsigned long long)b->nmb);
    mm = &b->mb[b->nmb];
    *mm = (rf_plan_msg){.src_ep = src_ep, .dst_ep = dst_ep, .round = 0, .kind = kind,
                   .first = (uint32_t)b->nx, .count = 0, .bytes = 0};
    b->nmb++;
    if (kind == RF_PLAN_LOCAL)
        b->plan->st.local_messages++;
    if (slot32)
        *slot32 = (uint32_t)b->nmb;
    else if (slot64)
        *slot64 = b->nmb;
    *out = mm;
    return 0;
}

/* A trainer's FP8 piece (c) goes only into an engine's FP8 piece of the same format, whose
 * bytes and scales its own are, block for block: the transfer is then planned as one that
 * quantizes (the same payload), and its sender copies instead. 1 for such a source, 0 for a
 * plain one, or the refusal. */
static int fp8_source_ok(const builder *b, const dpiece *dp, const cand *c, rf_err *err)
{
    uint32_t sq = rf_inv_piece_recs(b->inv, RF_SRC)[c->id].quant;
    const rf_quant_decl *q = sq ? rf_inv_quant(b->inv, sq) : NULL;
    const char *name = rf_inv_tensor(b->inv, dp->tensor)->name;

    if (!q)
        return 0;
    if (!dp->quant)
        return rf_err_set(err, -EOPNOTSUPP, "plan: tensor %s: a trainer holds it in FP8 and an "
                          "engine in %s; FP8 is copied only into engine FP8 pieces of the same "
                          "format (dequantizing is not built)", name,
                          rf_dtype_name(rf_inv_tensor(b->inv, dp->tensor)->dtype));
    if (q->kind != dp->quant->kind || q->br != dp->quant->br || q->bc != dp->quant->bc) {
        rf_quant_fmt sf = {q->kind, q->br, q->bc}, df = {dp->quant->kind, dp->quant->br,
                                                         dp->quant->bc};
        char sn[32], dn[32];

        rf_quant_fmt_format(&sf, sn, sizeof(sn));
        rf_quant_fmt_format(&df, dn, sizeof(dn));
        return rf_err_set(err, -EOPNOTSUPP, "plan: tensor %s: a trainer holds it in FP8 %s and "
                          "an engine's FP8 piece is %s; re-quantizing FP8 is not built", name,
                          sn, dn);
    }
    return 1;
}

/* Emits the transfer of box (of bytes) from candidate c to destination piece dp. whole says
 * that box is the destination piece's own box, whose interned id and run count the geometry
 * cache keeps. */
static int emit(builder *b, const dpiece *dp, const cand *c, const rf_box *box, uint64_t bytes,
                bool whole, rf_err *err)
{
    rf_plan *pl = b->plan;
    uint64_t sruns = nruns(c->g->strides, dp->ndim, box), druns;
    rf_plan_kind kind;
    uint32_t bid;
    rf_plan_msg *mm = NULL;
    int rc, recvq = 0, fp8_src;

    if ((fp8_src = fp8_source_ok(b, dp, c, err)) < 0)
        return fp8_src;
    if (dp->quant && (recvq = quant_xfer(b, dp, c, box, &bytes, err)) < 0)
        return recvq;
    if (recvq && b->cur_unit != NO_UNIT)
        return rf_err_set(err, -EOPNOTSUPP, "plan: relays cannot forward FP8 tensor %s: the "
                          "trainers' shards cut its blocks, which its receivers quantize only "
                          "once the refit landed; run the coordinator with relay = off",
                          rf_inv_tensor(b->inv, dp->tensor)->name);
    if (whole && b->gruns)
        druns = b->gruns[dp->geom];
    else
        druns = nruns(b->geoms[dp->geom].strides, dp->ndim, box);
    /* Contiguous here means one byte range in row-major order of the box on both sides. A
     * local copy reads source memory itself, so neither contiguity nor size changes its path,
     * and it needs no staging, so it is never cut into slabs. */
    if (c->local)
        kind = RF_PLAN_LOCAL;
    else if (!dp->quant && bytes >= pl->opts.direct_min_bytes && sruns == 1 && druns == 1)
        kind = RF_PLAN_DIRECT;
    else
        kind = RF_PLAN_PACKED;
    if (kind == RF_PLAN_PACKED && bytes > b->half)
        return emit_slabs(b, dp, c, box, bytes, recvq == 1, err);
    if (whole && b->gbid && b->gbid[dp->geom]) {
        bid = b->gbid[dp->geom] - 1;
        rc = 0;
    } else {
        rc = boxtab_intern(&b->boxes, box, &bid);
        if (rc == 0 && whole && b->gbid)
            b->gbid[dp->geom] = bid + 1;
    }
    rc = xfer_room(b, rc, err);
    if (rc)
        return rc;
    rc = msg_for(b, c->ep, dp->ep, kind, bytes, &mm, err);
    if (rc)
        return rc;
    pl->xfers[b->nx] = (rf_plan_xfer){.src = c->id, .dst = dp->id, .box = bid,
                                 .msg = (uint32_t)(mm - b->mb), .msg_off = mm->bytes,
                                 .bytes = bytes};
    if (b->wunit)
        b->wunit[b->nx] = b->cur_unit;
    mm->bytes += bytes;
    mm->count++;
    b->nx++;
    pl->sent[c->ep] += bytes;
    pl->recv[dp->ep] += bytes;
    pl->path[(uint64_t)kind * pl->nendpoints + c->ep] += bytes;
    pl->path[(uint64_t)kind * pl->nendpoints + dp->ep] += bytes;
    if (kind == RF_PLAN_DIRECT) {
        pl->st.direct_bytes += bytes;
        pl->st.direct_transfers++;
    } else if (kind == RF_PLAN_PACKED) {
        pl->st.packed_bytes += bytes;
        pl->st.packed_transfers++;
    } else {
        pl->st.local_bytes += bytes;
        pl->st.local_transfers++;
    }
    pl->st.runs += sruns + druns;
    if (recvq) {
        pl->st.recv_quant_bytes += bytes;
        pl->st.recv_quant_transfers++;
    } else if (fp8_src) {
        pl->st.fp8_copy_bytes += bytes;
        pl->st.fp8_copy_transfers++;
    } else if (dp->quant) {
        pl->st.quant_bytes += bytes;
        pl->st.quant_transfers++;
    }
    return 0;
}

/* The payload of a box of an FP8 piece of format q (ndim dims): its FP8 elements, then the
 * scales of its blocks. The box lies on the format's grid. */
static uint64_t fp8_payload(const rf_quant_decl *q, const rf_box *box, int nd)
{
    rf_quant_fmt f = {q->kind, q->br, q->bc};
    uint64_t sr, sc, nm = 1;

    rf_quant_scale_shape(&f, (uint64_t)box->extent[nd - 2], (uint64_t)box->extent[nd - 1], &sr,
                         &sc, NULL);
    for (int d = 0; d < nd - 2; d++)
        nm *= (uint64_t)box->extent[d];
    return numel(box, nd) + nm * sr * sc * rf_dtype_size(rf_quant_scale_dtype(&f));
}

static int quant_xfer(const builder *b, const dpiece *dp, const cand *c, const rf_box *box,
                      uint64_t *bytes, rf_err *err)
{
    rf_quant_fmt f = {dp->quant->kind, dp->quant->br, dp->quant->bc};
    const char *name = rf_inv_tensor(b->inv, dp->tensor)->name;
    int nd = dp->ndim, rc;

    rc = rf_quant_box_ok(&f, (uint64_t)dp->rows, (uint64_t)dp->cols,
                         (uint64_t)box->start[nd - 2], (uint64_t)box->start[nd - 1],
                         (uint64_t)box->extent[nd - 2], (uint64_t)box->extent[nd - 1], NULL);
    if (rc < 0) {
        /* The destination's own box was checked at registration: a source's edge cuts it. */
        *bytes = numel(box, nd) * rf_dtype_size(rf_inv_tensor(b->inv, dp->tensor)->dtype);
        return 1;
    }
    if (c->g->strides[nd - 1] != 1)
        return rf_err_set(err, -EINVAL, "plan: FP8 tensor %s: a trainer's piece has stride %"
                          PRId64 " on its last dim; quantizing on the sender needs contiguous "
                          "rows", name, c->g->strides[nd - 1]);
    *bytes = fp8_payload(dp->quant, box, nd);
    return 0;
}

/* Of the holders hs, those on the destination's host: the one that has given the fewest local
 * bytes so far, ties to the lower piece id; -1 when none is local. A local copy runs at the
 * memory or NVLink bandwidth of one host, several times any network link, so a same-host
 * holder is taken even when it is the busier one; among several, spreading the reads keeps
 * any one source GPU's memory from being the bottleneck. */
static int pick_local(const builder *b, const int32_t *hs, int nh)
{
    int best = -1;
    uint64_t bload = 0;
    uint32_t bid = 0;

    for (int i = 0; i < nh; i++) {
        const cand *c = &b->cands[hs[i]];
        uint64_t l = b->lload[c->ep];
        if (!c->local)
            continue;
        if (best < 0 || l < bload || (l == bload && c->id < bid)) {
            best = hs[i];
            bload = l;
            bid = c->id;
        }
    }
    return best;
}

/* The holder of a cell. A same-host one if any (pick_local); else the one that keeps the
 * largest of its sender's and its link's network load lowest; ties go to the lower sender
 * load, then to the lower piece id (candidates are in piece-id order of the index, so the
 * scan order decides the rest deterministically). */
static int pick(builder *b, const int32_t *hs, int nh, uint64_t bytes)
{
    int best = -1;
    uint64_t bcost = 0, bsend = 0;
    uint32_t bid = 0;

    if (b->any_local && (best = pick_local(b, hs, nh)) >= 0)
        return best;
    for (int i = 0; i < nh; i++) {
        const cand *c = &b->cands[hs[i]];
        uint64_t s = b->load[c->ep] + bytes;
        uint64_t l = *c->linkp + bytes;
        uint64_t cost = s > l ? s : l;
        if (best < 0 || cost < bcost || (cost == bcost && (s < bsend ||
                                          (s == bsend && c->id < bid)))) {
            best = hs[i];
            bcost = cost;
            bsend = s;
            bid = c->id;
        }
    }
    return best;
}

static int charge(builder *b, const cand *c, uint64_t bytes, rf_err *err)
{
    (void)err;
    if (c->local) {
        b->lload[c->ep] += bytes;
        return 0;
    }
    *c->linkp += bytes;
    b->load[c->ep] += bytes;
    return 0;
}

static int uncovered(builder *b, const rf_tensor *t, const rf_box *box, uint32_t dst_ep,
                     rf_err *err)
{
    char bs[256];

    (void)b;
    rf_box_format(box, t->ndim, bs, sizeof(bs));
    return rf_err_set(err, -EINVAL,
                      "no source holds %s %s (destination piece on endpoint %u); check that "
                      "the training side registered every shard of this tensor",
                      t->name, bs, dst_ep);
}

static int add_cut(builder *b, int d, int64_t v)
{
    if (grow((void **)&b->cuts[d], &b->capcuts[d], (uint64_t)b->ncuts[d] + 1, sizeof(int64_t)))
        return -ENOMEM;
    b->cuts[d][b->ncuts[d]++] = v;
    return 0;
}

static int find_cut(const int64_t *c, int n, int64_t v)
{
    int lo = 0, hi = n - 1;

    while (lo < hi) {
        int m = (lo + hi) / 2;
        if (c[m] < v)
            lo = m + 1;
        else
            hi = m;
    }
    return lo;
}

/* Phase 1 of planning a piece: the range [lo, hi) of the tensor's sources (sorted by start
 * along the key dim) whose start lies where they could still reach the box, from the box's
 * start less the largest source extent along that dim to the box's end. */
static void key_range(const builder *b, const dpiece *dp, const tinfo *ti, uint64_t *lo,
                      uint64_t *hi)
{
    const sent *se = b->se;
    uint64_t a = ti->first, z = a + ti->count, l = a, h = z;
    int k = ti->kdim;
    int64_t qlo, qhi;

    if (z - a == 1) {
        *lo = a; /* the one source: the overlap test decides */
        *hi = z;
        return;
    }
    qlo = dp->box->start[k] - ti->maxext + 1;
    qhi = dp->box->start[k] + dp->box->extent[k];
    while (l < h) {
        uint64_t m = (l + h) / 2;
        if (se[m].kstart < qlo)
            l = m + 1;
        else
            h = m;
    }
    *lo = l;
    h = z;
    while (l < h) {
        uint64_t m = (l + h) / 2;
        if (se[m].kstart < qhi)
            l = m + 1;
        else
            h = m;
    }
    *hi = l;
}

/* Phase 2: of the sources in [lo, hi), the candidates are those that overlap the box; those
 * that hold all of it go to b->hs, *nfull of them, for the fast path (only the same-host ones
 * when some candidate is on the destination's host). Each candidate's link load pointer is
 * taken once every link exists, since the hash table may grow. */
static int find_cands(builder *b, const dpiece *dp, uint64_t lo, uint64_t hi, int *nfull,
                      rf_err *err)
{
    const sent *se = b->se;
    const rf_box *dbox = dp->box;
    int ndim = dp->ndim, nf = 0, nlocal = 0;

    if (grow((void **)&b->cands, &b->capcand, hi - lo + 1, sizeof(cand)) ||
        grow((void **)&b->hs, &b->caphs, hi - lo + 1, sizeof(int32_t)))
        return rf_err_set(err, -ENOMEM, "plan: out of memory");
    b->ncand = 0;
    for (uint64_t i = lo; i < hi; i++) {
        const rf_geom *sg = se[i].g;
        bool full = true;
        cand *c;
        int d;
        for (d = 0; d < ndim; d++) {
            int64_t s0 = sg->box.start[d], s1 = s0 + sg->box.extent[d];
            int64_t d0 = dbox->start[d], d1 = d0 + dbox->extent[d];
            if (s0 >= d1 || s1 <= d0)
                break;
            if (s0 > d0 || s1 < d1)
                full = false;
        }
        if (d < ndim)
            continue;
        c = &b->cands[b->ncand];
        c->g = sg;
        c->id = se[i].id;
        c->ep = se[i].ep;
        c->local = b->any_local && b->host[c->ep] != RF_HOST_NONE &&
                   b->host[c->ep] == b->host[dp->ep];
        nlocal += c->local;
        if (full)
            b->hs[nf++] = (int32_t)b->ncand;
        b->ncand++;
    }
    /* With a same-host candidate, the fast path may take only same-host holders of the whole
     * box: a remote one would send cells that a local one holds over the network. */
    if (nlocal > 0) {
        int w = 0;
        for (int i = 0; i < nf; i++)
            if (b->cands[b->hs[i]].local)
                b->hs[w++] = b->hs[i];
        nf = w;
    }
    *nfull = nf;
    if (b->linkmat) {
        uint64_t *row = &b->linkmat[b->nodeidx[dp->ep]];
        for (uint64_t i = 0; i < b->ncand; i++)
            b->cands[i].linkp = &row[(uint64_t)b->nodeidx[b->cands[i].ep] * b->ndst_node];
    } else {
        for (uint64_t i = 0; i < b->ncand; i++)
            b->cands[i].link = ((uint64_t)b->node[b->cands[i].ep] << 32) | dp->node;
        for (int pass = 0; pass < 2; pass++)
            for (uint64_t i = 0; i < b->ncand; i++)
                if (linktab_slot(&b->links, b->cands[i].link, &b->cands[i].linkp))
                    return rf_err_set(err, -ENOMEM, "plan: out of memory for link loads");
    }
    return 0;
}

/* The fast path, and the common case: some sources hold the whole box, so it needs no
 * cutting; the least loaded of the nfull in b->hs sends it in one transfer. */
static int send_whole(builder *b, const dpiece *dp, int nfull, rf_err *err)
{
    uint64_t bytes = numel(dp->box, dp->ndim) * dp->esize;
    int w = nfull == 1 ? b->hs[0] : pick(b, b->hs, nfull, bytes);
    int rc = charge(b, &b->cands[w], bytes, err);

    if (rc == 0)
        rc = emit(b, dp, &b->cands[w], dp->box, bytes, dp->whole, err);
    return rc;
}

/* Phase 3: cuts the box along every source boundary inside it into a grid of *ncells cells,
 * records each candidate's range of cells per dim, and sizes the per-cell tables. */
static int cut_box(builder *b, const dpiece *dp, uint64_t *ncells, rf_err *err)
{
    const rf_box *dbox = dp->box;
    int ndim = dp->ndim;
    uint64_t nc = 1;

    for (int d = 0; d < ndim; d++) {
        int64_t s = dbox->start[d], e = s + dbox->extent[d];
        int n = 1;
        b->ncuts[d] = 0;
        if (add_cut(b, d, s) || add_cut(b, d, e))
            return rf_err_set(err, -ENOMEM, "plan: out of memory");
        for (uint64_t i = 0; i < b->ncand; i++) {
            int64_t cs = b->cands[i].g->box.start[d], ce = cs + b->cands[i].g->box.extent[d];
            if (cs > s && cs < e && add_cut(b, d, cs))
                return rf_err_set(err, -ENOMEM, "plan: out of memory");
            if (ce > s && ce < e && add_cut(b, d, ce))
                return rf_err_set(err, -ENOMEM, "plan: out of memory");
        }
        qsort(b->cuts[d], (size_t)b->ncuts[d], sizeof(int64_t), cmp_i64);
        for (int i = 1; i < b->ncuts[d]; i++)
            if (b->cuts[d][i] != b->cuts[d][n - 1])
                b->cuts[d][n++] = b->cuts[d][i];
        b->ncuts[d] = n;
        nc *= (uint64_t)(b->ncuts[d] - 1);
    }
    for (uint64_t i = 0; i < b->ncand; i++) {
        cand *c = &b->cands[i];
        for (int d = 0; d < ndim; d++) {
            int64_t s = c->g->box.start[d], e = s + c->g->box.extent[d];
            int64_t bs = dbox->start[d], be = bs + dbox->extent[d];
            c->lo[d] = find_cut(b->cuts[d], b->ncuts[d], s > bs ? s : bs);
            c->hi[d] = find_cut(b->cuts[d], b->ncuts[d], e < be ? e : be);
        }
    }
    if (grow((void **)&b->holder, &b->capcells, nc, sizeof(int32_t)) ||
        grow((void **)&b->done, &b->capdone, nc, 1))
        return rf_err_set(err, -ENOMEM, "plan: out of memory cutting a piece into %llu cells",
                          (unsigned long long)nc);
    *ncells = nc;
    return 0;
}

/* Steps idx to the next cell of the grid in row-major order (wrapping to all zeros). */
static void next_cell(int32_t *idx, const int *ncuts, int ndim)
{
    for (int d = ndim - 1; d >= 0; d--) {
        if (++idx[d] < ncuts[d] - 1)
            break;
        idx[d] = 0;
    }
}

/* Phase 4: one holder per cell, in row-major cell order, each picked and charged as it comes
 * so that later cells see the loads the earlier ones added; -1 marks a cell nobody holds. */
static int assign_cells(builder *b, const dpiece *dp, uint64_t ncells, rf_err *err)
{
    int32_t idx[RF_MAX_DIMS] = {0};
    int32_t *hs = b->hs;
    int ndim = dp->ndim;
    int rc;

    for (uint64_t cell = 0; cell < ncells; cell++) {
        int nh = 0;
        uint64_t cell_el = 1;
        for (uint64_t i = 0; i < b->ncand; i++) {
            const cand *c = &b->cands[i];
            int in = 1;
            for (int d = 0; d < ndim && in; d++)
                in = idx[d] >= c->lo[d] && idx[d] < c->hi[d];
            if (in)
                hs[nh++] = (int32_t)i;
        }
        for (int d = 0; d < ndim; d++)
            cell_el *= (uint64_t)(b->cuts[d][idx[d] + 1] - b->cuts[d][idx[d]]);
        b->holder[cell] = nh == 0 ? -1 : pick(b, hs, nh, cell_el * dp->esize);
        if (nh > 0) {
            rc = charge(b, &b->cands[b->holder[cell]], cell_el * dp->esize, err);
            if (rc)
                return rc;
        }
        next_cell(idx, b->ncuts, ndim);
    }
    return 0;
}

/* Steps j to the next cell of the block idx + [0, ext) in row-major order, leaving dim skip
 * where it is (-1 skips none); false once the block is done. */
static bool next_in_block(int32_t *j, const int32_t *idx, const int32_t *ext, int ndim,
                          int skip)
{
    for (int e = ndim - 1; e >= 0; e--) {
        if (e == skip)
            continue;
        if (++j[e] < idx[e] + ext[e])
            return true;
        j[e] = idx[e];
    }
    return false;
}

static uint64_t cell_index(const int32_t *j, const int64_t *cstride, int ndim)
{
    uint64_t ci = 0;

    for (int q = 0; q < ndim; q++)
        ci += (uint64_t)j[q] * (uint64_t)cstride[q];
    return ci;
}

/* Whether the block idx + [0, ext) can grow by one cell along dim d: the slab of cells just
 * past it there lies inside the grid, is unmerged and has holder h throughout. */
static bool slab_joins(const builder *b, const int64_t *cstride, int ndim, const int32_t *idx,
                       const int32_t *ext, int d, int32_t h)
{
    int32_t j[RF_MAX_DIMS];

    if (idx[d] + ext[d] >= b->ncuts[d] - 1)
        return false;
    memcpy(j, idx, sizeof(j));
    j[d] = idx[d] + ext[d];
    do {
        uint64_t ci = cell_index(j, cstride, ndim);
        if (b->done[ci] || b->holder[ci] != h)
            return false;
    } while (next_in_block(j, idx, ext, ndim, d));
    return true;
}

/* Phase 5, for one box: grows a block of cells from the unmerged cell idx (holder h),
 * innermost dim first, while the slab it would add has the same holder and is unmerged;
 * marks the block merged and emits it as one transfer (or fails if nobody holds it). */
static int merge_from(builder *b, const dpiece *dp, const int64_t *cstride, const int32_t *idx,
                      int32_t h, rf_err *err)
{
    int ndim = dp->ndim;
    int32_t ext[RF_MAX_DIMS], j[RF_MAX_DIMS];
    rf_box box;

    for (int d = 0; d < ndim; d++)
        ext[d] = 1;
    for (int d = ndim - 1; d >= 0; d--)
        while (slab_joins(b, cstride, ndim, idx, ext, d, h))
            ext[d]++;
    memcpy(j, idx, sizeof(j));
    do
        b->done[cell_index(j, cstride, ndim)] = 1;
    while (next_in_block(j, idx, ext, ndim, -1));
    for (int d = 0; d < ndim; d++) {
        box.start[d] = b->cuts[d][idx[d]];
        box.extent[d] = b->cuts[d][idx[d] + ext[d]] - box.start[d];
    }
    box_norm(&box, ndim);
    if (h < 0)
        return uncovered(b, rf_inv_tensor(b->inv, dp->tensor), &box, dp->ep, err);
    return emit(b, dp, &b->cands[h], &box, numel(&box, ndim) * dp->esize, false, err);
}

/* Phase 5: merges the cells into as few boxes as a greedy pass finds, starting a box at each
 * first unmerged cell in row-major order, so that neighbouring cells of one holder go as one
 * transfer. */
static int merge_cells(builder *b, const dpiece *dp, uint64_t ncells, rf_err *err)
{
    int ndim = dp->ndim;
    int64_t cstride[RF_MAX_DIMS];
    int32_t idx[RF_MAX_DIMS] = {0};
    int rc;

    memset(b->done, 0, ncells);
    cstride[ndim - 1] = 1;
    for (int d = ndim - 2; d >= 0; d--)
        cstride[d] = cstride[d + 1] * (b->ncuts[d + 1] - 1);
    for (uint64_t cell = 0; cell < ncells; cell++) {
        if (!b->done[cell]) {
            rc = merge_from(b, dp, cstride, idx, b->holder[cell], err);
            if (rc)
                return rc;
        }
        next_cell(idx, b->ncuts, ndim);
    }
    return 0;
}

/* Plans box (the whole of destination piece dst, or a chunk of it) from the sources: finds
 * those that overlap it, then either sends it whole from one of them or cuts it into cells,
 * gives each cell a holder and merges the cells back into boxes, one transfer each. */
static int plan_box(builder *b, uint32_t dst, const rf_box *box, bool whole, rf_err *err)
{
    const rf_piece_rec *dr = &b->drec[dst];
    const tinfo *ti = &b->ti[dr->tensor];
    uint32_t dst_ep = b->reg_ep[dr->region];
    dpiece dp = {.id = dst, .geom = dr->geom, .tensor = dr->tensor, .ep = dst_ep,
                 .node = b->node[dst_ep], .ndim = ti->ndim, .esize = ti->esize,
                 .box = box, .whole = whole};

    if (dr->quant) {
        const rf_tensor *t = rf_inv_tensor(b->inv, dr->tensor);

        dp.quant = rf_inv_quant(b->inv, dr->quant);
        dp.esize = 1; /* loads count what goes out: one byte an element, scales aside */
        dp.rows = t->shape[t->ndim - 2];
        dp.cols = t->shape[t->ndim - 1];
    }
    uint64_t lo, hi, ncells = 0;
    int nfull = 0, rc;

    key_range(b, &dp, ti, &lo, &hi);
    rc = find_cands(b, &dp, lo, hi, &nfull, err);
    if (rc)
        return rc;
    if (nfull > 0)
        return send_whole(b, &dp, nfull, err);
    rc = cut_box(b, &dp, &ncells, err);
    if (rc == 0)
        rc = assign_cells(b, &dp, ncells, err);
    if (rc == 0)
        rc = merge_cells(b, &dp, ncells, err);
    return rc;
}

static int plan_piece(builder *b, uint32_t dst, rf_err *err)
{
    /* The geometry's box has its unused dims at [0:1] already. */
    return plan_box(b, dst, &b->geoms[b->drec[dst].geom].box, true, err);
}

/* ---- relays: replica sets and their trees ------------------------------------------------ */

/* A new unit, not yet ready (ready is raised to the round of each transfer that writes it). */
static int new_unit(builder *b, uint32_t *unit, rf_err *err)
{
    if (b->nunits >= NO_UNIT - 1)
        return rf_err_set(err, -E2BIG, "plan: more than 2^32 relay units");
    if (grow((void **)&b->ready, &b->capunits, b->nunits + 1, sizeof(uint32_t)))
        return rf_err_set(err, -ENOMEM, "plan: out of memory after %llu relay units",
                          (unsigned long long)b->nunits);
    b->ready[b->nunits] = 0;
    *unit = (uint32_t)b->nunits++;
    return 0;
}

/* Emits the relay of box (a chunk of both, or their whole box) from destination piece q,
 * which holds it as unit src_unit at hop count depth - 1, to destination piece p, a replica
 * of q (same tensor and geometry). Its message and round are chosen by schedule, once the
 * round that completes src_unit is known; *unit is the unit it writes. */
static int relay_emit(builder *b, const placed *q, uint32_t p, const rf_box *box, bool whole,
                      uint64_t bytes, uint32_t depth, uint32_t *unit, rf_err *err)
{
    rf_plan *pl = b->plan;
    const rf_piece_rec *pr = &b->drec[p];
    uint32_t pep = b->reg_ep[pr->region], bid;
    int ndim = b->t_ndim[pr->tensor];
    uint64_t runs, *link;
    rf_plan_kind kind;
    int rc;

    /* Replicas share their strides, so the box is one run on both sides or on neither. */
    if (whole && b->gruns)
        runs = b->gruns[pr->geom];
    else
        runs = nruns(b->geoms[pr->geom].strides, ndim, box);
    /* An FP8 payload (elements, then scales) is never one run of the piece's memory. */
    kind = !pr->quant && bytes >= pl->opts.direct_min_bytes && runs == 1 ? RF_PLAN_DIRECT
                                                                          : RF_PLAN_PACKED;
    if (whole && b->gbid && b->gbid[pr->geom]) {
        bid = b->gbid[pr->geom] - 1;
        rc = 0;
    } else {
        rc = boxtab_intern(&b->boxes, box, &bid);
        if (rc == 0 && whole && b->gbid)
            b->gbid[pr->geom] = bid + 1;
    }
    rc = xfer_room(b, rc, err);
    if (rc)
        return rc;
    if (grow((void **)&b->rl, &b->caprl, b->nrl + 1, sizeof(rlay)))
        rc = -ENOMEM;
    if (rc == 0 && b->rlinkmat)
        link = &b->rlinkmat[(uint64_t)b->nodeidx[q->ep] * b->ndst_node + b->nodeidx[pep]];
    else if (rc == 0)
        rc = linktab_slot(&b->rlinks, (uint64_t)b->node[q->ep] << 32 | b->node[pep], &link);
    if (rc)
        return rf_err_set(err, rc, "plan: out of memory after %llu transfers",
                          (unsigned long long)b->nx);
    rc = new_unit(b, unit, err);
    if (rc)
        return rc;
    pl->xfers[b->nx] = (rf_plan_xfer){.src = q->piece, .dst = p, .box = bid, .msg = UINT32_MAX,
                                      .msg_off = 0, .bytes = bytes};
    b->wunit[b->nx] = *unit;
    b->rl[b->nrl++] = (rlay){.x = (uint32_t)b->nx, .src_unit = q->unit, .unit = *unit,
                             .qi = b->epidx[q->ep], .pi = b->epidx[pep],
                             .depth = (uint8_t)depth, .kind = (uint8_t)kind};
    b->nx++;
    *link += bytes;
    pl->sent[q->ep] += bytes;
    pl->recv[pep] += bytes;
    pl->path[(uint64_t)kind * pl->nendpoints + pep] += bytes;
    if (kind == RF_PLAN_DIRECT) {
        pl->st.direct_bytes += bytes;
        pl->st.direct_transfers++;
    } else {
        pl->st.packed_bytes += bytes;
        pl->st.packed_transfers++;
    }
    pl->st.runs += 2 * runs;
    pl->st.relay_bytes += bytes;
    pl->st.relay_transfers++;
    pl->st.relay_depth_bytes[depth] += bytes;
    if (depth > pl->st.relay_depth)
        pl->st.relay_depth = depth;
    if (bytes > pl->st.relay_chunk_bytes)
        pl->st.relay_chunk_bytes = bytes;
    return 0;
}

/* One chunk of a replica set: mem[0..nm) are pieces on distinct endpoints with the same
 * tensor and geometry, in piece order. The member whose endpoint has relayed least so far
 * (then the lower piece id) gets the chunk from the sources; the others, in cyclic order
 * after it, form a tree filled breadth first with RF_PLAN_RELAY_FANOUT children per holder:
 * shallow and of small fanout, which keeps the pipeline's fill short (plan.h). The tree's
 * shape depends only on its root, so the chunks that reach one root in one round go on to
 * the same children in the same rounds, and pack into few messages. A member whose parent
 * in that tree is full (its sends would pass rcap, or hops the limit) is fed by the holder
 * of fewest hops that qualifies (then the least busy, then the lower piece id), and with
 * none by the sources again. */
static int relay_chunk(builder *b, uint32_t nm, const rf_box *box, bool whole, uint64_t bytes,
                       rf_err *err)
{
    const uint64_t *sent = b->plan->sent;
    const uint32_t *mem = b->mem;
    uint32_t r0 = 0, e0 = b->reg_ep[b->drec[mem[0]].region];
    placed *pc = b->pc;
    int rc = 0;

    for (uint32_t i = 1; i < nm; i++) {
        uint32_t e = b->reg_ep[b->drec[mem[i]].region];
        if (sent[e] < sent[e0]) {
            r0 = i;
            e0 = e;
        }
    }
    for (uint32_t i = 0; i < nm && rc == 0; i++) {
        uint32_t p = mem[(r0 + i) % nm], ep = b->reg_ep[b->drec[p].region], unit = NO_UNIT;
        int best = -1;
#define QUALIFIES(q)                                                                           \
    ((q)->depth < RF_PLAN_RELAY_MAX_DEPTH && (q)->kids < RF_PLAN_RELAY_FANOUT &&                \
     sent[(q)->ep] + bytes <= b->rcap)
        if (i > 0 && QUALIFIES(&pc[(i - 1) / RF_PLAN_RELAY_FANOUT]))
            best = (int)((i - 1) / RF_PLAN_RELAY_FANOUT);
        for (uint32_t j = 0; j < i && best < 0; j++) {
            const placed *q = &pc[j];
            if (!QUALIFIES(q))
                continue;
            if (best < 0 || q->depth < pc[best].depth ||
                (q->depth == pc[best].depth && (sent[q->ep] < sent[pc[best].ep] ||
                                                (sent[q->ep] == sent[pc[best].ep] &&
                                                 q->piece < pc[best].piece))))
                best = (int)j;
        }
#undef QUALIFIES
        if (best < 0) {
            rc = new_unit(b, &unit, err);
            if (rc)
                break;
            b->cur_unit = unit;
            rc = plan_box(b, p, box, whole, err);
            b->cur_unit = NO_UNIT;
            pc[i] = (placed){.piece = p, .ep = ep, .unit = unit};
        } else {
            uint32_t depth = pc[best].depth + 1;
            rc = relay_emit(b, &pc[best], p, box, whole, bytes, depth, &unit, err);
            if (++pc[best].kids > b->plan->st.relay_fanout)
                b->plan->st.relay_fanout = pc[best].kids;
            pc[i] = (placed){.piece = p, .ep = ep, .unit = unit, .depth = depth};
        }
    }
    return rc;
}

/* The FP8 format of the set in b->mem (NULL for plain pieces): its chunks are whole blocks, and
 * a chunk's payload is its FP8 elements and its blocks' scales. */
static const rf_quant_decl *set_quant(const builder *b)
{
    uint32_t q = b->drec[b->mem[0]].quant;

    return q ? rf_inv_quant(b->inv, q) : NULL;
}

/* The step a chunk edge along dim d must fall on: 1, or for an FP8 set's matrix dims its block
 * (the tensor's matrix ends a block early where it is not a multiple). */
static int64_t relay_step(const builder *b, const rf_quant_decl *q, int ndim, int d)
{
    const rf_tensor *t = rf_inv_tensor(b->inv, b->drec[b->mem[0]].tensor);
    rf_quant_fmt f;
    uint64_t br, bc;

    if (!q || d < ndim - 2)
        return 1;
    f = (rf_quant_fmt){q->kind, q->br, q->bc};
    rf_quant_fmt_block(&f, (uint64_t)t->shape[ndim - 2], (uint64_t)t->shape[ndim - 1], &br, &bc);
    return (int64_t)(d == ndim - 2 ? br : bc);
}

/* Cuts box into chunks of at most rchunk bytes along its outer dims from dim d on (several rows
 * of the first dim of extent > 1 to a chunk; a row still too large is cut along the next dim;
 * an FP8 set's chunks in whole blocks) and plans each chunk's tree. Chunks pipeline: a member
 * forwards one while it takes the next. */
static int relay_tile(builder *b, uint32_t nm, const rf_box *box, int ndim, size_t esize,
                      bool whole, int d, rf_err *err)
{
    const rf_quant_decl *q = set_quant(b);
    uint64_t bytes = q ? fp8_payload(q, box, ndim) : numel(box, ndim) * esize, row;
    rf_box sub = *box;
    int64_t k, step = 1;
    int rc;

    if (bytes <= b->rchunk)
        return relay_chunk(b, nm, box, whole, bytes, err);
    while (d < ndim && box->extent[d] <= (step = relay_step(b, q, ndim, d)))
        d++;
    if (d == ndim)
        return relay_chunk(b, nm, box, whole, bytes, err); /* one FP8 block */
    /* Rounded up: an FP8 box's last block may hold fewer rows than its share of scales. */
    row = (bytes + (uint64_t)box->extent[d] - 1) / (uint64_t)box->extent[d];
    k = row <= b->rchunk ? (int64_t)(b->rchunk / row) : 1;
    k = k <= step ? step : k / step * step;
    for (int64_t s = 0; s < box->extent[d]; s += k) {
        sub.start[d] = box->start[d] + s;
        sub.extent[d] = box->extent[d] - s < k ? box->extent[d] - s : k;
        /* A chunk still too large (one row, or one row of blocks) is cut along later dims. */
        rc = relay_tile(b, nm, &sub, ndim, esize, false, d + 1, err);
        if (rc)
            return rc;
    }
    return 0;
}

/* Whether destination pieces p and q are both plain or both FP8 of one format: only then does
 * one forward the other's payload. */
static bool same_fp8(const builder *b, uint32_t p, uint32_t q)
{
    const rf_quant_decl *a = rf_inv_quant(b->inv, b->drec[p].quant);
    const rf_quant_decl *c = rf_inv_quant(b->inv, b->drec[q].quant);

    if (!a || !c)
        return !a && !c;
    return a->kind == c->kind && a->br == c->br && a->bc == c->bc;
}

/* One replica set: the destination pieces ids[0..k) with the same tensor and geometry. A
 * piece on an endpoint that shares a host with some source is planned as without relays and
 * relays nothing: its local copies run beside the network rounds, which therefore do not
 * say when it holds its bytes. So is a second piece of the set on one endpoint, and one of
 * another FP8 format than the first's (or plain where it is FP8). */
static int plan_set(builder *b, const uint32_t *ids, uint32_t k, rf_err *err)
{
    uint32_t nm = 0, gen = ++b->setgen;
    const rf_piece_rec *dr = &b->drec[ids[0]];
    int rc = 0;

    if (grow((void **)&b->mem, &b->capmem, k, sizeof(uint32_t)))
        return rf_err_set(err, -ENOMEM, "plan: out of memory for a set of %u replicas", k);
    if (grow((void **)&b->pc, &b->cappc, k, sizeof(placed)))
        return rf_err_set(err, -ENOMEM, "plan: out of memory for a set of %u replicas", k);
    for (uint32_t i = 0; i < k && rc == 0; i++) {
        uint32_t ep = b->reg_ep[b->drec[ids[i]].region];
        if ((b->ep_local && b->ep_local[ep]) || b->stamp[ep] == gen ||
            !same_fp8(b, ids[i], ids[0])) {
            rc = plan_piece(b, ids[i], err);
            continue;
        }
        b->stamp[ep] = gen;
        b->mem[nm++] = ids[i];
    }
    if (rc || nm == 0)
        return rc;
    if (nm == 1)
        return plan_piece(b, b->mem[0], err);
    return relay_tile(b, nm, &b->geoms[dr->geom].box, b->t_ndim[dr->tensor],
                      dr->quant ? 1 : b->t_esize[dr->tensor], true, 0, err);
}

/* Planning with relays: the destination pieces in replica sets (same tensor and geometry),
 * set by set in the order of each set's first piece. A counting sort by tensor and a chain
 * through the pieces find the sets in linear time and little memory, which matters at
 * twelve million pieces. rcap, the most a replica may relay, is the largest ingress of any
 * destination endpoint: relaying up to it never makes an endpoint busier than the busiest
 * receiver, which every plan has. */
static int plan_with_relays(builder *b, rf_err *err)
{
    uint32_t nd = rf_inv_npieces(b->inv, RF_DST), ne = rf_inv_nendpoints(b->inv);
    uint32_t nt = rf_inv_ntensors(b->inv), ng = rf_inv_ngeoms(b->inv);
    uint64_t *held = NULL, *tfirst = NULL, capids = 0;
    uint32_t *next = NULL, *ids = NULL, *tord = NULL, *gstamp = NULL, *glast = NULL;
    uint8_t *seen = NULL;
    int rc = 0;

    b->rchunk = b->half < RF_PLAN_RELAY_CHUNK ? b->half : RF_PLAN_RELAY_CHUNK;
    /* A packed message of a few trainers holds a chunk at most, so that a round (schedule) can
     * hold a little for every replica and their relays of the next one are even; with many
     * trainers, a round mixes many of their messages anyway, and messages of up to
     * RF_PLAN_RELAY_FANOUT trainers' chunks (at most half the budget) keep their number down
     * (deepseek-v3: 3.6 million messages of one chunk against 0.54 million). */
    b->rmsg = b->rchunk *
              (b->nsrc_ep > RF_PLAN_RELAY_FANOUT ? b->nsrc_ep / RF_PLAN_RELAY_FANOUT : 1);
    if (b->rmsg > b->half)
        b->rmsg = b->half;
    if ((uint64_t)b->ndst_node * b->ndst_node <= linkmat_max) {
        b->rlinkmat = calloc((uint64_t)b->ndst_node * b->ndst_node + 1, sizeof(uint64_t));
        if (b->rlinkmat == NULL)
            goto nomem;
    }
    b->stamp = calloc((uint64_t)ne + 1, sizeof(uint32_t));
    held = calloc((uint64_t)ne + 1, sizeof(uint64_t));
    next = malloc(((uint64_t)nd + 1) * sizeof(*next));
    tord = malloc(((uint64_t)nd + 1) * sizeof(*tord));
    tfirst = calloc((uint64_t)nt + 2, sizeof(*tfirst));
    gstamp = calloc((uint64_t)ng + 1, sizeof(*gstamp));
    glast = malloc(((uint64_t)ng + 1) * sizeof(*glast));
    /* Most pieces are one unit and most units but the sets' first relay: reserve for that. */
    b->caprl = (uint64_t)nd + 64;
    b->capunits = (uint64_t)nd + 64;
    b->rl = malloc(b->caprl * sizeof(*b->rl));
    b->ready = malloc(b->capunits * sizeof(*b->ready));
    if (!b->stamp || !held || !next || !tord || !tfirst || !gstamp || !glast || !b->rl ||
        !b->ready)
        goto nomem;
    /* The pieces by tensor (a stable counting sort), then within a tensor chained by
     * geometry in piece order: next[i] is the next piece of i's set. */
    for (uint32_t i = 0; i < nd; i++) {
        const rf_piece_rec *r = &b->drec[i];
        held[b->reg_ep[r->region]] += numel(&b->geoms[r->geom].box, b->t_ndim[r->tensor]) *
                                      (r->quant ? 1 : b->t_esize[r->tensor]);
        tfirst[r->tensor + 2]++;
    }
    for (uint32_t t = 0; t < nt; t++)
        tfirst[t + 2] += tfirst[t + 1];
    for (uint32_t i = 0; i < nd; i++)
        tord[tfirst[b->drec[i].tensor + 1]++] = i;
    for (uint32_t t = 0; t < nt; t++) {
        for (uint64_t k = t ? tfirst[t] : 0; k < tfirst[t + 1]; k++) {
            uint32_t i = tord[k], g = b->drec[i].geom;
            if (gstamp[g] == t + 1)
                next[glast[g]] = i;
            gstamp[g] = t + 1;
            glast[g] = i;
            next[i] = UINT32_MAX;
        }
    }
    free(tord);
    free(tfirst);
    free(gstamp);
    free(glast);
    tord = gstamp = glast = NULL;
    tfirst = NULL;
    seen = calloc((uint64_t)nd + 1, 1);
    if (seen == NULL)
        goto nomem;
    for (uint32_t e = 0; e < ne; e++)
        if (held[e] > b->rcap)
            b->rcap = held[e];
    /* Set by set, in the order of each set's first piece (the one not yet seen). */
    for (uint32_t i = 0; i < nd && rc == 0; i++) {
        uint32_t k = 0;
        if (seen[i])
            continue;
        for (uint32_t j = i; j != UINT32_MAX; j = next[j]) {
            if (grow((void **)&ids, &capids, (uint64_t)k + 1, sizeof(*ids)))
                goto nomem;
            ids[k++] = j;
            seen[j] = 1;
        }
        rc = plan_set(b, ids, k, err);
    }
    goto out;
nomem:
    rc = rf_err_set(err, -ENOMEM, "plan: out of memory grouping %u destination pieces", nd);
out:
    free(held);
    free(next);
    free(seen);
    free(ids);
    free(tord);
    free(tfirst);
    free(gstamp);
    free(glast);
    return rc;
}

/* What schedule works on, shared by its phases and freed at its one exit: the messages in
 * creation order, the permutations between build, creation and final order, and each
 * endpoint's staging use per round. */
typedef struct sched {
    uint64_t nm;       /* messages */
    rf_plan_msg *m;         /* in creation order */
    uint32_t *corder;  /* creation position -> build id */
    uint32_t *mperm;   /* final position -> creation position */
    uint32_t *fin;     /* build id -> final position */
    uint32_t *cursor;  /* final position -> next slot of its transfers in message order */
    uint64_t *mkey;    /* sort keys */
    uint64_t **use;    /* per endpoint: bytes in each round */
    uint64_t **duse;   /* with relays: direct bytes per endpoint and round, apart */
    uint64_t **lsend, **lrecv; /* with relays: bytes each endpoint sends, receives per round */
    uint64_t lcap;     /* with relays: what a relay may bring a round's lsend, lrecv to */
    uint64_t *tcap;    /* with relays: what the trainers' messages may bring a round's lsend
                        * (tcap[2e]) and lrecv (tcap[2e + 1]) of endpoint e to */
    uint64_t *lhint;   /* with relays: [4e + k], no round before it is open (has more than a
                        * 16th of the cap left) for endpoint e's trainer sends (k = 0),
                        * receives (1), relay sends (2), relay receives (3) */
    uint64_t *usecap;
    uint64_t *hint;    /* per endpoint: no round before this one has room left */
    uint32_t ne, R;    /* endpoints, rounds */
} sched;

static int sched_nomem(const builder *b, rf_err *err)
{
    return rf_err_set(err, -ENOMEM, "plan: out of memory scheduling %llu transfers",
                      (unsigned long long)b->nx);
}

/* Creation order, which the rounds are filled in: by (source endpoint, destination endpoint,
 * packed before direct), then by first transfer. Build ids already follow the first transfer,
 * so a stable sort by the pair key alone gives it. */
static int creation_order(const builder *b, sched *s, rf_err *err)
{
    int db = bits_for(b->ndst_ep ? b->ndst_ep : 1);
    int pbits = bits_for(b->nsrc_ep ? b->nsrc_ep : 1) + db + 1;
    const rf_plan_msg *mb = b->mb;

    for (uint64_t i = 0; i < s->nm; i++) {
        s->mkey[i] = (((uint64_t)b->epidx[mb[i].src_ep] << db | b->epidx[mb[i].dst_ep]) << 1) |
                     (mb[i].kind == RF_PLAN_DIRECT);
        s->corder[i] = (uint32_t)i;
    }
    if (radix_sort(s->mkey, s->corder, s->nm, pbits))
        return sched_nomem(b, err);
    for (uint64_t i = 0; i < s->nm; i++)
        s->m[i] = mb[s->corder[i]];
    return 0;
}

/* Makes room for rounds [0, R) in every endpoint's use (and duse) table. */
static int extend_rounds(const builder *b, sched *s, uint64_t R, rf_err *err)
{
    if (R <= s->R)
        return 0;
    if (R > UINT32_MAX - 1)
        return rf_err_set(err, -E2BIG, "plan: more than 2^32 rounds");
    for (uint32_t e = 0; e < s->ne; e++) {
        uint64_t old = s->usecap[e], cap = old;
        if (grow((void **)&s->use[e], &s->usecap[e], R, sizeof(uint64_t)))
            return sched_nomem(b, err);
        memset(s->use[e] + old, 0, (s->usecap[e] - old) * sizeof(uint64_t));
        if (s->duse) {
            uint64_t c2 = old, c3 = old;
            if (grow((void **)&s->duse[e], &cap, R, sizeof(uint64_t)) ||
                grow((void **)&s->lsend[e], &c2, R, sizeof(uint64_t)) ||
                grow((void **)&s->lrecv[e], &c3, R, sizeof(uint64_t)))
                return sched_nomem(b, err);
            memset(s->duse[e] + old, 0, (cap - old) * sizeof(uint64_t));
            memset(s->lsend[e] + old, 0, (c2 - old) * sizeof(uint64_t));
            memset(s->lrecv[e] + old, 0, (c3 - old) * sizeof(uint64_t));
        }
    }
    s->R = (uint32_t)R;
    return 0;
}

/* With relays, the rounds the trainers' messages spread over: enough that the busiest
 * endpoint sends or receives about RF_PLAN_RELAY_FANOUT chunks a round (relays included);
 * s->lcap becomes that endpoint's bytes over those rounds, with some slack. A relay forwards a
 * round's bytes in a later round (the ordering rule), so a round is the pipeline's step: with
 * the few rounds that staging alone asks for (two for a 1 GiB model with 128 MiB halves), the
 * last round's relays run after every trainer byte is out and the refit takes ~1.6x its
 * floor (bench/RESULTS.md, the namespace cluster). At most RELAY_ROUNDS_MAX rounds (a tail
 * of 1/256 is small enough; more rounds cost plan time and memory). RELAY_STEP: the
 * step in chunks at the busiest endpoint; TCAP_SLACK: what a trainer's message may add to a
 * round beyond its ends' even share (tcap); a relay may go 1/RELAY_SLACK and a chunk beyond the
 * busiest endpoint's even share (lcap). */
#define RELAY_STEP RF_PLAN_RELAY_FANOUT
#define TCAP_SLACK (b->rchunk / 4)
#define RELAY_SLACK 16
#define RELAY_SCAN 16
#define RELAY_ROUNDS_MAX 256
static uint64_t relay_rounds(const builder *b, sched *s)
{
    const rf_plan *pl = b->plan;
    uint64_t most = 0, step, R;

    for (uint32_t e = 0; e < pl->nendpoints; e++) {
        if (pl->sent[e] > most)
            most = pl->sent[e];
        if (pl->recv[e] > most)
            most = pl->recv[e];
    }
    step = (uint64_t)RELAY_STEP * (b->rchunk ? b->rchunk : RF_PLAN_RELAY_CHUNK);
    R = (most + step - 1) / step;
    R = R < 1 ? 1 : R > RELAY_ROUNDS_MAX ? RELAY_ROUNDS_MAX : R;
    s->lcap = most / R + most / R / RELAY_SLACK + b->rchunk;
    /* What the trainers send an endpoint, spread evenly over the rounds: the replicas then
     * hold about as much new in every round, so that their relays of the next one are even. */
    s->tcap = calloc(2 * (uint64_t)s->ne + 1, sizeof(uint64_t));
    s->lhint = calloc(4 * (uint64_t)s->ne + 1, sizeof(uint64_t));
    if (s->tcap == NULL || s->lhint == NULL) {
        free(s->tcap);
        s->tcap = NULL;
        return 0;
    }
    for (uint64_t i = 0; i < s->nm; i++) {
        s->tcap[2 * (uint64_t)s->m[i].src_ep] += s->m[i].bytes;
        s->tcap[2 * (uint64_t)s->m[i].dst_ep + 1] += s->m[i].bytes;
    }
    for (uint64_t e = 0; e < 2 * (uint64_t)s->ne; e++)
        s->tcap[e] = s->tcap[e] / R + TCAP_SLACK;
    return R;
}

/* A packed message goes, first fit, into the earliest round from `from` on where it fits
 * under half the budget on both its ends, so that staging double-buffers. */
static int place_packed_one(builder *b, sched *s, rf_plan_msg *m, uint64_t from, rf_err *err)
{
    uint32_t se = m->src_ep, de = m->dst_ep;
    uint64_t **use = s->use, *hint = s->hint, r;
    int rc;

    r = hint[se] > hint[de] ? hint[se] : hint[de];
    if (r < from)
        r = from;
    for (;; r++) {
        uint64_t us = r < s->R ? use[se][r] : 0, ud = r < s->R ? use[de][r] : 0;
        if (us + m->bytes <= b->half && ud + m->bytes <= b->half)
            break;
    }
    rc = extend_rounds(b, s, r + 1, err);
    if (rc)
        return rc;
    m->round = (uint32_t)r;
    use[se][r] += m->bytes;
    use[de][r] += m->bytes;
    if (s->lsend) {
        s->lsend[se][r] += m->bytes;
        s->lrecv[de][r] += m->bytes;
    }
    while (hint[se] < s->R && use[se][hint[se]] >= b->half)
        hint[se]++;
    while (hint[de] < s->R && use[de][hint[de]] >= b->half)
        hint[de]++;
    return 0;
}

static void note_staging(builder *b, const sched *s)
{
    for (uint32_t e = 0; e < s->ne; e++)
        for (uint32_t r = 0; r < s->R; r++)
            if (s->use[e][r] > b->plan->st.max_staging_bytes)
                b->plan->st.max_staging_bytes = s->use[e][r];
}

/* Rounds for the packed messages, in creation order. Records the largest staging use in the
 * plan's stats. */
static int place_packed(builder *b, sched *s, rf_err *err)
{
    rf_plan_msg *m = s->m;
    int rc;

    s->use = calloc((uint64_t)s->ne + 1, sizeof(*s->use));
    s->usecap = calloc((uint64_t)s->ne + 1, sizeof(*s->usecap));
    s->hint = calloc((uint64_t)s->ne + 1, sizeof(*s->hint));
    if (!s->use || !s->usecap || !s->hint)
        return sched_nomem(b, err);
    if (b->relay) {
        s->duse = calloc((uint64_t)s->ne + 1, sizeof(*s->duse));
        s->lsend = calloc((uint64_t)s->ne + 1, sizeof(*s->lsend));
        s->lrecv = calloc((uint64_t)s->ne + 1, sizeof(*s->lrecv));
        if (s->duse == NULL || s->lsend == NULL || s->lrecv == NULL)
            return sched_nomem(b, err);
        if (s->nm > 0) {
            rc = extend_rounds(b, s, relay_rounds(b, s), err);
            if (rc == 0 && s->tcap == NULL)
                rc = sched_nomem(b, err);
            if (rc)
                return rc;
        }
        return 0; /* place_sources places them */
    }
    for (uint64_t i = 0; i < s->nm; i++) {
        if (m[i].kind != RF_PLAN_PACKED)
            continue;
        rc = place_packed_one(b, s, &m[i], 0, err);
        if (rc)
            return rc;
    }
    note_staging(b, s);
    return 0;
}

/* A direct message needs no staging: it goes to the round from `from` on where the larger of
 * its two ends' loads is least (the first such round on ties), spreading the direct messages
 * over the packed rounds. Without relays the loads are the use table itself (direct messages
 * are placed after every packed one); with relays, packed messages are placed after direct
 * ones too, so direct bytes are counted apart (duse) and never take staging room. */
static int place_direct_one(const builder *b, sched *s, rf_plan_msg *m, uint64_t from,
                            rf_err *err)
{
    uint32_t se = m->src_ep, de = m->dst_ep, best = (uint32_t)from;
    uint64_t bc = UINT64_MAX, **use = s->use, **duse = s->duse;
    int rc = extend_rounds(b, s, from + 1, err);

    if (rc)
        return rc;
    for (uint32_t r = (uint32_t)from; r < s->R; r++) {
        uint64_t us = use[se][r] + (duse ? duse[se][r] : 0);
        uint64_t ud = use[de][r] + (duse ? duse[de][r] : 0);
        uint64_t c = us > ud ? us : ud;
        if (c < bc) {
            bc = c;
            best = r;
        }
    }
    m->round = best;
    use = duse ? duse : use;
    use[se][best] += m->bytes;
    use[de][best] += m->bytes;
    if (s->lsend) {
        s->lsend[se][best] += m->bytes;
        s->lrecv[de][best] += m->bytes;
    }
    return 0;
}

/* With relays, a message goes, first fit, into the earliest round from `from` on where its
 * source sends and its destination receives at most lcap bytes with it (a relay) or tcap (a
 * trainer's message), or where neither end has anything yet; packed, where it also fits under
 * half the budget on both ends. A relay forwards as soon as its link has room, so that the
 * rounds stay about equal and few are left once the trainers are done. */
static int place_relay_one(builder *b, sched *s, rf_plan_msg *m, uint64_t from, rf_err *err)
{
    uint32_t se = m->src_ep, de = m->dst_ep;
    bool packed = m->kind == RF_PLAN_PACKED;
    uint64_t r, scap = m->relay ? s->lcap : s->tcap[2 * se];
    uint64_t rcap = m->relay ? s->lcap : s->tcap[2 * de + 1];
    uint64_t *hs = &s->lhint[4 * (uint64_t)se + (m->relay ? 2 : 0)];
    uint64_t *hr = &s->lhint[4 * (uint64_t)de + (m->relay ? 3 : 1)];
    uint64_t end, best = UINT64_MAX, bover = UINT64_MAX;
    int rc;

    /* Rounds nearly full on either end are passed for good, and a message that fits none of
     * the RELAY_SCAN rounds from there goes where it overflows its caps least: the scan stays
     * short (deepseek-v3 has millions of messages over thousands of rounds). */
    while (*hs < s->R && s->lsend[se][*hs] + scap / 16 >= scap)
        (*hs)++;
    while (*hr < s->R && s->lrecv[de][*hr] + rcap / 16 >= rcap)
        (*hr)++;
    r = from > *hs ? from : *hs;
    if (*hr > r)
        r = *hr;
    if (packed && s->hint[se] > r)
        r = s->hint[se];
    if (packed && s->hint[de] > r)
        r = s->hint[de];
    end = r + RELAY_SCAN < s->R ? r + RELAY_SCAN : s->R;
    for (; r < end; r++) {
        uint64_t ls = s->lsend[se][r], lr = s->lrecv[de][r], over;
        if (packed && (s->use[se][r] + m->bytes > b->half || s->use[de][r] + m->bytes > b->half))
            continue;
        if ((ls + m->bytes <= scap && lr + m->bytes <= rcap) || (ls == 0 && lr == 0))
            break;
        over = ls + m->bytes > scap ? ls + m->bytes - scap : 0;
        if (lr + m->bytes > rcap && lr + m->bytes - rcap > over)
            over = lr + m->bytes - rcap;
        if (over < bover) {
            bover = over;
            best = r;
        }
    }
    if (r == end && end < s->R)
        r = best != UINT64_MAX ? best : end;
    if (packed)
        return place_packed_one(b, s, m, r, err);
    rc = extend_rounds(b, s, r + 1, err);
    if (rc)
        return rc;
    m->round = (uint32_t)r;
    s->duse[se][r] += m->bytes;
    s->duse[de][r] += m->bytes;
    s->lsend[se][r] += m->bytes;
    s->lrecv[de][r] += m->bytes;
    return 0;
}

/* With relays, the trainers' messages, packed and direct, each first fit under tcap (and the
 * staging half), taken across endpoint pairs in turn: by how far into its pair's bytes a
 * message starts (creation order holds a pair's messages together). So every round holds
 * about as much for every replica, and its relays in the next round are even too. */
static int place_sources(builder *b, sched *s, rf_err *err)
{
    uint64_t n = s->nm, *key = malloc((n + 1) * sizeof(*key));
    uint32_t *idx = malloc((n + 1) * sizeof(*idx));
    int rc = 0;

    if (key == NULL || idx == NULL) {
        rc = sched_nomem(b, err);
        goto out;
    }
    for (uint64_t i = 0, j; i < n; i = j) {
        uint64_t tot = 0, cum = 0;
        for (j = i; j < n && s->m[j].src_ep == s->m[i].src_ep && s->m[j].dst_ep == s->m[i].dst_ep;
             j++)
            tot += s->m[j].bytes;
        for (uint64_t k = i; k < j; k++) {
            key[k] = tot ? (uint64_t)(((unsigned __int128)cum << 32) / tot) : 0;
            idx[k] = (uint32_t)k;
            cum += s->m[k].bytes;
        }
    }
    if (radix_sort(key, idx, n, 33)) {
        rc = sched_nomem(b, err);
        goto out;
    }
    for (uint64_t i = 0; i < n && rc == 0; i++) {
        rf_plan_msg *m = &s->m[idx[i]];
        if (m->kind == RF_PLAN_PACKED || m->kind == RF_PLAN_DIRECT)
            rc = place_relay_one(b, s, m, 0, err);
    }
out:
    free(key);
    free(idx);
    return rc;
}

static int place_direct(builder *b, sched *s, rf_err *err)
{
    int rc;

    if (s->R == 0 && s->nm > 0) {
        rc = extend_rounds(b, s, 1, err);
        if (rc)
            return rc;
    }
    if (s->tcap)
        return place_sources(b, s, err);
    for (uint64_t i = 0; i < s->nm; i++) {
        if (s->m[i].kind != RF_PLAN_DIRECT)
            continue;
        rc = place_direct_one(b, s, &s->m[i], 0, err);
        if (rc)
            return rc;
    }
    return 0;
}

/* The relay messages, hop count by hop count once the rounds of the messages before are
 * known. A relay transfer may go from round ready[its source unit] + 1 on (the ordering rule
 * of plan.h). Those of one hop count are taken by that round (a stable counting sort, so in
 * build order within a round); the packed ones of one endpoint pair and round form messages
 * of at most half the budget, a direct one is a message of its own. The messages of a round
 * are placed from it on in the order they were formed, and each transfer's unit is then ready
 * in its message's round. */
static int place_relays(builder *b, sched *s, rf_err *err)
{
    rf_plan *pl = b->plan;
    uint64_t nm0 = s->nm, capm = s->nm + 1, capc = s->nm + 1, npairs;
    uint64_t *cnt = NULL, capcnt = 0, *open = NULL;
    uint32_t *mround = malloc((nm0 + 1) * sizeof(uint32_t)), *idx = NULL;
    linktab opentab = {0};
    int rc = 0;

    npairs = (uint64_t)b->ndst_ep * b->ndst_ep;
    idx = malloc((b->nrl + 1) * sizeof(*idx));
    if (npairs <= linkmat_max)
        open = calloc(npairs + 1, sizeof(*open));
    if (mround == NULL || idx == NULL || (npairs <= linkmat_max && open == NULL))
        goto nomem;
    for (uint64_t i = 0; i < nm0; i++)
        mround[s->corder[i]] = s->m[i].round;
    for (uint64_t x = 0; x < b->nx; x++) {
        uint32_t u = b->wunit[x], mi = pl->xfers[x].msg;
        if (u != NO_UNIT && mi != UINT32_MAX && mround[mi] > b->ready[u])
            b->ready[u] = mround[mi];
    }
    for (uint32_t d = 1; d <= pl->st.relay_depth; d++) {
        uint64_t maxf = 0, n = 0;
        for (uint64_t i = 0; i < b->nrl; i++)
            if (b->rl[i].depth == d && b->ready[b->rl[i].src_unit] + 1ull > maxf)
                maxf = b->ready[b->rl[i].src_unit] + 1ull;
        if (grow((void **)&cnt, &capcnt, maxf + 2, sizeof(*cnt)))
            goto nomem;
        memset(cnt, 0, (maxf + 2) * sizeof(*cnt));
        for (uint64_t i = 0; i < b->nrl; i++)
            if (b->rl[i].depth == d)
                cnt[b->ready[b->rl[i].src_unit] + 2]++;
        for (uint64_t f = 1; f < maxf + 2; f++)
            cnt[f] += cnt[f - 1];
        /* cnt[f] is where the relays that may go from round f on start; once they are in
         * idx, where they end. */
        for (uint64_t i = 0; i < b->nrl; i++) {
            if (b->rl[i].depth != d)
                continue;
            idx[cnt[b->ready[b->rl[i].src_unit] + 1]++] = (uint32_t)i;
            n++;
        }
        for (uint64_t i = 0, f = 1; i < n; f++) {
            uint64_t first = s->nm, end = cnt[f];
            if (i >= end)
                continue;
            for (uint64_t j = i; j < end; j++) {
                const rlay *r = &b->rl[idx[j]];
                rf_plan_xfer *x = &pl->xfers[r->x];
                /* The relays of a round lie all over memory: fetch ahead, the relay record
                 * 16 on and the transfer of the one 8 on (its record fetched 8 ago). */
                if (j + 16 < end)
                    __builtin_prefetch(&b->rl[idx[j + 16]]);
                if (j + 8 < end)
                    __builtin_prefetch(&pl->xfers[b->rl[idx[j + 8]].x], 1);
                uint32_t qe = b->didx_ep[r->qi], pe = b->didx_ep[r->pi];
                uint64_t pair = (uint64_t)r->qi * b->ndst_ep + r->pi, *slot = NULL;
                rf_plan_msg *m = NULL;
                if (r->kind == RF_PLAN_PACKED) {
                    if (open)
                        slot = &open[pair];
                    else if (linktab_slot(&opentab, pair, &slot))
                        goto nomem;
                    /* An open message of this round only: built here, so past first. */
                    if (*slot > first && s->m[*slot - 1].bytes + x->bytes <= b->rmsg)
                        m = &s->m[*slot - 1];
                }
                if (m == NULL) {
                    if (grow((void **)&s->m, &capm, s->nm + 1, sizeof(*s->m)) ||
                        grow((void **)&s->corder, &capc, s->nm + 1, sizeof(*s->corder)))
                        goto nomem;
                    if (b->nmb + 1 >= UINT32_MAX) {
                        rc = rf_err_set(err, -E2BIG, "plan: more than 2^32 messages");
                        goto out;
                    }
                    m = &s->m[s->nm];
                    *m = (rf_plan_msg){.src_ep = qe, .dst_ep = pe, .kind = r->kind, .relay = d};
                    s->corder[s->nm++] = (uint32_t)b->nmb++;
                    if (slot)
                        *slot = s->nm;
                }
                /* Build ids and positions in s->m agree: both count every message. */
                x->msg = (uint32_t)(m - s->m);
                x->msg_off = m->bytes;
                m->bytes += x->bytes;
                m->count++;
            }
            for (uint64_t k = first; k < s->nm; k++) {
                rc = place_relay_one(b, s, &s->m[k], f, err);
                if (rc)
                    goto out;
            }
            pl->st.relay_messages += s->nm - first;
            i = end;
        }
        /* Each relay's unit is ready in its message's round. The next hop count reads these
         * units only, so they are set once the level is placed, in build order (which reads
         * the relays and transfers in memory order). */
        for (uint64_t i = 0; i < b->nrl; i++)
            if (b->rl[i].depth == d)
                b->ready[b->rl[i].unit] = s->m[pl->xfers[b->rl[i].x].msg].round;
    }
    note_staging(b, s);
    /* The arrays of final_order, for every message. */
    {
        uint64_t *k2 = realloc(s->mkey, (s->nm + 1) * sizeof(*s->mkey));
        uint32_t *p2, *f2;
        if (k2)
            s->mkey = k2;
        p2 = realloc(s->mperm, (s->nm + 1) * sizeof(*s->mperm));
        if (p2)
            s->mperm = p2;
        f2 = realloc(s->fin, (s->nm + 1) * sizeof(*s->fin));
        if (f2)
            s->fin = f2;
        if (!k2 || !p2 || !f2)
            goto nomem;
    }
    goto out;
nomem:
    rc = sched_nomem(b, err);
out:
    free(mround);
    free(idx);
    free(cnt);
    free(open);
    free(opentab.keys);
    free(opentab.vals);
    return rc;
}

/* The final message order, (round, src, dst, creation order), as the permutation s->mperm;
 * then the plan's messages in that order with their transfer ranges, and fin, which renumbers
 * a build id to its final position. */
static int final_order(builder *b, sched *s, rf_err *err)
{
    rf_plan *pl = b->plan;
    uint32_t ne = s->ne, R = s->R;
    int eb = bits_for(ne ? ne : 1), rb = bits_for(R ? R : 1);
    uint64_t first = 0;

    if (2 * eb + rb > 64)
        return rf_err_set(err, -E2BIG, "plan: %u rounds of %u endpoints do not fit the sort key",
                          R, ne);
    for (uint64_t i = 0; i < s->nm; i++) {
        s->mkey[i] = ((uint64_t)s->m[i].round << (2 * eb)) |
                     ((uint64_t)s->m[i].src_ep << eb) | s->m[i].dst_ep;
        s->mperm[i] = (uint32_t)i;
    }
    if (radix_sort(s->mkey, s->mperm, s->nm, 2 * eb + rb))
        return sched_nomem(b, err);
    /* The keys are done with: give their memory back before the plan's messages take theirs. */
    free(s->mkey);
    s->mkey = NULL;
    pl->msgs = malloc((s->nm + 1) * sizeof(*pl->msgs));
    s->cursor = malloc((s->nm + 1) * sizeof(*s->cursor));
    if (pl->msgs == NULL || s->cursor == NULL)
        return sched_nomem(b, err);
    for (uint64_t i = 0; i < s->nm; i++) {
        pl->msgs[i] = s->m[s->mperm[i]];
        pl->msgs[i].first = (uint32_t)first;
        s->cursor[i] = (uint32_t)first;
        s->fin[s->corder[s->mperm[i]]] = (uint32_t)i;
        first += pl->msgs[i].count;
    }
    return 0;
}

/* The transfers' message order (the plan's order array), in one sequential pass over the
 * transfers: the messages open at any one time are those of a few destination endpoints, so
 * the writes stay in cache. Each transfer's msg becomes its message's final position. */
static int order_xfers(builder *b, sched *s, rf_err *err)
{
    rf_plan *pl = b->plan;
    uint64_t n = b->nx;
    size_t ybytes = (n + 1) * sizeof(uint32_t);
    uint32_t *y = big_alloc(ybytes);

    if (y == NULL)
        return sched_nomem(b, err);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t f = s->fin[pl->xfers[i].msg];
        pl->xfers[i].msg = f;
        y[s->cursor[f]++] = (uint32_t)i;
    }
    pl->order = y;
    pl->order_bytes = ybytes;
    return 0;
}

/* Groups transfers into messages, schedules rounds, and sorts everything into its final
 * order. The messages were formed while the transfers were emitted, in destination-piece
 * order: a message's transfers are in that order, and its build id orders it by its first
 * transfer. */
static int schedule(builder *b, rf_err *err)
{
    rf_plan *pl = b->plan;
    sched s = {.nm = b->nmb, .ne = rf_inv_nendpoints(b->inv)};
    uint64_t nm = s.nm;
    int rc;

    s.mkey = malloc((nm + 1) * sizeof(*s.mkey));
    s.corder = malloc((nm + 1) * sizeof(*s.corder));
    s.mperm = malloc((nm + 1) * sizeof(*s.mperm));
    s.fin = malloc((nm + 1) * sizeof(*s.fin));
    s.m = malloc((nm + 1) * sizeof(*s.m));
    if (!s.mkey || !s.corder || !s.mperm || !s.fin || !s.m) {
        rc = sched_nomem(b, err);
        goto out;
    }
    rc = creation_order(b, &s, err);
    if (rc == 0)
        rc = place_packed(b, &s, err);
    if (rc == 0)
        rc = place_direct(b, &s, err);
    if (rc == 0 && b->relay)
        rc = place_relays(b, &s, err);
    if (rc == 0)
        rc = final_order(b, &s, err);
    if (rc == 0)
        rc = order_xfers(b, &s, err);
    if (rc)
        goto out;
    pl->nmsgs = (uint32_t)s.nm;
    pl->nrounds = s.nm ? s.R : 0;
out:
    free(s.corder);
    free(s.fin);
    free(s.mperm);
    free(s.cursor);
    free(s.mkey);
    free(s.m);
    for (uint32_t e = 0; e < s.ne; e++) {
        if (s.use)
            free(s.use[e]);
        if (s.duse)
            free(s.duse[e]);
    }
    for (uint32_t e = 0; e < s.ne; e++) {
        if (s.lsend)
            free(s.lsend[e]);
        if (s.lrecv)
            free(s.lrecv[e]);
    }
    free(s.use);
    free(s.duse);
    free(s.lsend);
    free(s.lrecv);
    free(s.tcap);
    free(s.lhint);
    free(s.usecap);
    free(s.hint);
    return rc;
}

/* The relay trees (rf_plan_chunk), once the transfers are in message order. A unit's tree is
 * the unit its first replica got from the sources (relay_chunk): a relay's unit belongs to the
 * tree of the unit it reads, which was made before it, so one pass in build order finds them.
 * Trees without a relay are left out: their one replica took the chunk from the trainers, and
 * the message digests check that already. */
static int relay_trees(builder *b, rf_err *err)
{
    rf_plan *pl = b->plan;
    uint64_t nx = pl->nxfers, nu = b->nunits;
    uint32_t *root = malloc((nu + 1) * sizeof(uint32_t));
    uint32_t *cid = malloc((nu + 1) * sizeof(uint32_t));
    uint32_t *nrel = calloc(nu + 1, sizeof(uint32_t)), *ofill = NULL, *rfill = NULL, nc = 0;
    int rc = 0;

    if (root == NULL || cid == NULL || nrel == NULL)
        goto nomem;
    for (uint64_t u = 0; u < nu; u++)
        root[u] = (uint32_t)u;
    for (uint64_t i = 0; i < b->nrl; i++) {
        const rlay *r = &b->rl[i];

        assert(r->src_unit < r->unit);
        root[r->unit] = root[r->src_unit];
        nrel[root[r->unit]]++;
    }
    for (uint64_t u = 0; u < nu; u++)
        cid[u] = root[u] == u && nrel[u] > 0 ? nc++ : RF_PLAN_NO_CHUNK;
    if (nc == 0)
        goto out;
    pl->xchunk = malloc((nx + 1) * sizeof(uint32_t));
    pl->cfirst = calloc((uint64_t)nc + 1, sizeof(uint32_t));
    pl->corig = calloc((uint64_t)nc + 1, sizeof(uint32_t));
    ofill = calloc((uint64_t)nc + 1, sizeof(uint32_t));
    rfill = calloc((uint64_t)nc + 1, sizeof(uint32_t));
    if (pl->xchunk == NULL || pl->cfirst == NULL || pl->corig == NULL || ofill == NULL ||
        rfill == NULL)
        goto nomem;
    pl->nchunks = nc;
    for (uint64_t i = 0; i < nx; i++) {
        uint32_t x = pl->order[i], u = b->wunit[x];
        uint32_t c = u == NO_UNIT ? RF_PLAN_NO_CHUNK : cid[root[u]];

        pl->xchunk[i] = c;
        if (c == RF_PLAN_NO_CHUNK)
            continue;
        pl->cfirst[c + 1]++;
        if (pl->msgs[pl->xfers[x].msg].relay == 0)
            pl->corig[c]++;
    }
    for (uint32_t c = 0; c < nc; c++)
        pl->cfirst[c + 1] += pl->cfirst[c];
    pl->cx = malloc(((uint64_t)pl->cfirst[nc] + 1) * sizeof(uint32_t));
    if (pl->cx == NULL)
        goto nomem;
    for (uint64_t i = 0; i < nx; i++) {
        uint32_t c = pl->xchunk[i], x = pl->order[i];

        if (c == RF_PLAN_NO_CHUNK)
            continue;
        if (pl->msgs[pl->xfers[x].msg].relay == 0)
            pl->cx[pl->cfirst[c] + ofill[c]++] = (uint32_t)i;
        else
            pl->cx[pl->cfirst[c] + pl->corig[c] + rfill[c]++] = (uint32_t)i;
    }
    goto out;
nomem:
    rc = rf_err_set(err, -ENOMEM, "plan: out of memory for the relay trees of %llu transfers",
                    (unsigned long long)nx);
out:
    free(root);
    free(cid);
    free(nrel);
    free(ofill);
    free(rfill);
    return rc;
}

static void builder_free(builder *b)
{
    free(b->si.first);
    free(b->si.ids);
    free(b->si.kstart);
    free(b->si.maxext);
    free(b->si.kdim);
    free(b->ti);
    free(b->se);
    free(b->load);
    free(b->lload);
    free(b->links.keys);
    free(b->links.vals);
    free(b->boxes.slots);
    free(b->boxes.boxes);
    free(b->mb);
    free(b->open);
    free(b->opentab.keys);
    free(b->opentab.vals);
    free(b->open_local);
    free(b->opentab_local.keys);
    free(b->opentab_local.vals);
    free(b->host);
    free(b->epidx);
    free(b->node);
    free(b->nodeidx);
    free(b->linkmat);
    free(b->sidx_ep);
    free(b->didx_ep);
    free(b->src_ep);
    free(b->reg_ep);
    free(b->t_ndim);
    free(b->t_esize);
    free(b->gbid);
    free(b->gruns);
    free(b->cands);
    for (int d = 0; d < RF_MAX_DIMS; d++)
        free(b->cuts[d]);
    free(b->holder);
    free(b->done);
    free(b->hs);
    big_free(b->wunit, b->wunit_bytes);
    free(b->ready);
    free(b->rl);
    free(b->rlinks.keys);
    free(b->rlinks.vals);
    free(b->rlinkmat);
    free(b->ep_local);
    free(b->stamp);
    free(b->mem);
    free(b->pc);
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

    return (x > y) - (x < y);
}

/* Dense per-side endpoint and node numbering, link loads, piece endpoints, per-tensor sizes,
 * and the per-geometry cache when the geometry table is of a modest size (it is a handful of
 * entries for real layouts, but one per piece at worst). */
static uint64_t geom_cache_max = 256ull * MiB;
static uint64_t linkmat_max = 1ull << 22; /* also bounds the dense open-message table */

/* For tests: lower the limits so the paths for very large inventories (no geometry cache,
 * link loads in a hash table) run on small ones. Not thread-safe; call before building. */
void rf_plan__set_limits(uint64_t geom_cache_bytes, uint64_t link_matrix_entries);
void rf_plan__set_limits(uint64_t geom_cache_bytes, uint64_t link_matrix_entries)
{
    geom_cache_max = geom_cache_bytes;
    linkmat_max = link_matrix_entries;
}
/* Each endpoint's host, and whether any source endpoint shares a host with a destination
 * endpoint (else nothing is local and planning takes none of the same-host steps). */
static int setup_hosts(builder *b)
{
    uint32_t ne = rf_inv_nendpoints(b->inv), n = 0;
    uint32_t *scratch = malloc(((uint64_t)ne + 1) * sizeof(uint32_t));

    b->host = malloc(((uint64_t)ne + 1) * sizeof(uint32_t));
    b->lload = calloc((uint64_t)ne + 1, sizeof(uint64_t));
    if (scratch == NULL || b->host == NULL || b->lload == NULL) {
        free(scratch);
        return -ENOMEM;
    }
    for (uint32_t e = 0; e < ne; e++) {
        const rf_endpoint *ep = rf_inv_endpoint(b->inv, e);
        b->host[e] = ep->host;
        if (ep->side == RF_SRC && ep->host != RF_HOST_NONE)
            scratch[n++] = ep->host;
    }
    qsort(scratch, n, sizeof(uint32_t), cmp_u32);
    for (uint32_t e = 0; e < ne && !b->any_local && n > 0; e++) {
        const rf_endpoint *ep = rf_inv_endpoint(b->inv, e);
        if (ep->side == RF_DST && ep->host != RF_HOST_NONE &&
            bsearch(&ep->host, scratch, n, sizeof(uint32_t), cmp_u32))
            b->any_local = true;
    }
    /* With relays, the destinations that may take local copies (plan_set). */
    if (b->relay && b->any_local) {
        b->ep_local = calloc((uint64_t)ne + 1, 1);
        if (b->ep_local == NULL) {
            free(scratch);
            return -ENOMEM;
        }
        for (uint32_t e = 0; e < ne; e++) {
            const rf_endpoint *ep = rf_inv_endpoint(b->inv, e);
            b->ep_local[e] = ep->side == RF_DST && ep->host != RF_HOST_NONE &&
                             bsearch(&ep->host, scratch, n, sizeof(uint32_t), cmp_u32);
        }
    }
    free(scratch);
    return 0;
}

static int setup(builder *b, rf_err *err)
{
    const rf_inv *inv = b->inv;
    uint32_t ne = rf_inv_nendpoints(inv), ns = rf_inv_npieces(inv, RF_SRC);
    uint32_t nr = rf_inv_nregions(inv), nt = rf_inv_ntensors(inv), ng = rf_inv_ngeoms(inv);
    uint32_t *nodes[2] = {NULL, NULL}, nn[2] = {0, 0};
    int rc = 0;

    b->srec = rf_inv_piece_recs(inv, RF_SRC);
    b->drec = rf_inv_piece_recs(inv, RF_DST);
    b->geoms = rf_inv_geoms(inv);
    b->reg_ep = malloc(((uint64_t)nr + 1) * sizeof(uint32_t));
    b->t_ndim = malloc((uint64_t)nt + 1);
    b->t_esize = malloc((uint64_t)nt + 1);
    if (!b->reg_ep || !b->t_ndim || !b->t_esize)
        goto nomem;

    b->sidx_ep = malloc(((uint64_t)ne + 1) * sizeof(uint32_t));
    b->didx_ep = malloc(((uint64_t)ne + 1) * sizeof(uint32_t));
    b->nodeidx = malloc(((uint64_t)ne + 1) * sizeof(uint32_t));
    b->src_ep = malloc(((uint64_t)ns + 1) * sizeof(uint32_t));
    nodes[0] = malloc(((uint64_t)ne + 1) * sizeof(uint32_t));
    nodes[1] = malloc(((uint64_t)ne + 1) * sizeof(uint32_t));
    if (!b->sidx_ep || !b->didx_ep || !b->nodeidx || !b->src_ep || !nodes[0] || !nodes[1])
        goto nomem;
    for (uint32_t e = 0; e < ne; e++) {
        const rf_endpoint *ep = rf_inv_endpoint(inv, e);
        b->node[e] = ep->node;
        if (ep->side == RF_SRC) {
            b->sidx_ep[b->nsrc_ep] = e;
            b->epidx[e] = b->nsrc_ep++;
        } else {
            b->didx_ep[b->ndst_ep] = e;
            b->epidx[e] = b->ndst_ep++;
        }
        nodes[ep->side][nn[ep->side]++] = ep->node;
    }
    for (int s = 0; s < 2; s++) {
        uint32_t w = 0;
        qsort(nodes[s], nn[s], sizeof(uint32_t), cmp_u32);
        for (uint32_t i = 0; i < nn[s]; i++)
            if (w == 0 || nodes[s][w - 1] != nodes[s][i])
                nodes[s][w++] = nodes[s][i];
        nn[s] = w;
    }
    b->nsrc_node = nn[0];
    b->ndst_node = nn[1];
    for (uint32_t e = 0; e < ne; e++) {
        const rf_endpoint *ep = rf_inv_endpoint(inv, e);
        uint32_t *f = bsearch(&ep->node, nodes[ep->side], nn[ep->side], sizeof(uint32_t), cmp_u32);
        b->nodeidx[e] = (uint32_t)(f - nodes[ep->side]);
    }
    if ((uint64_t)nn[0] * nn[1] <= linkmat_max) {
        b->linkmat = calloc((uint64_t)nn[0] * nn[1] + 1, sizeof(uint64_t));
        if (b->linkmat == NULL)
            goto nomem;
    }
    if ((uint64_t)b->nsrc_ep * b->ndst_ep <= linkmat_max) {
        b->open = calloc((uint64_t)b->nsrc_ep * b->ndst_ep + 1, sizeof(uint32_t));
        if (b->open == NULL)
            goto nomem;
    }
    rc = setup_hosts(b);
    if (rc)
        goto nomem;
    if (b->any_local && (uint64_t)b->nsrc_ep * b->ndst_ep <= linkmat_max) {
        b->open_local = calloc((uint64_t)b->nsrc_ep * b->ndst_ep + 1, sizeof(uint32_t));
        if (b->open_local == NULL)
            goto nomem;
    }
    for (uint32_t r = 0; r < nr; r++)
        b->reg_ep[r] = rf_inv_region(inv, r)->endpoint;
    for (uint32_t i = 0; i < ns; i++)
        b->src_ep[i] = b->reg_ep[b->srec[i].region];
    for (uint32_t t = 0; t < nt; t++) {
        const rf_tensor *tt = rf_inv_tensor(inv, t);
        b->t_ndim[t] = (uint8_t)tt->ndim;
        b->t_esize[t] = (uint8_t)rf_dtype_size(tt->dtype);
    }
    if ((uint64_t)ng * (sizeof(*b->gbid) + sizeof(*b->gruns)) <= geom_cache_max) {
        b->gbid = calloc((uint64_t)ng + 1, sizeof(*b->gbid));
        b->gruns = malloc(((uint64_t)ng + 1) * sizeof(*b->gruns));
        if (b->gbid == NULL || b->gruns == NULL)
            goto nomem;
        /* Dims past a tensor's ndim have extent 1 and add no runs. */
        for (uint32_t g = 0; g < ng; g++)
            b->gruns[g] = nruns(b->geoms[g].strides, RF_MAX_DIMS, &b->geoms[g].box);
    }
    goto out;
nomem:
    rc = rf_err_set(err, -ENOMEM, "plan: out of memory setting up for %u endpoints", ne);
out:
    free(nodes[0]);
    free(nodes[1]);
    return rc;
}

int rf_plan_build(const rf_inv *inv, const rf_plan_opts *opts, rf_plan **out, rf_err *err)
{
    builder b;
    rf_plan *pl = NULL;
    rf_plan_opts def;
    uint32_t ne, nd;
    int rc = 0;

    memset(&b, 0, sizeof(b));
    *out = NULL;
    if (opts == NULL) {
        rf_plan_opts_default(&def);
        opts = &def;
    }
    if (opts->staging_bytes < MIN_STAGING) {
        rc = rf_err_set(err, -EINVAL,
                        "plan: staging budget of %llu bytes is below the minimum of %llu; "
                        "raise staging_bytes",
                        (unsigned long long)opts->staging_bytes, MIN_STAGING);
        goto out;
    }
    if (opts->relay > 1) {
        rc = rf_err_set(err, -EINVAL, "plan: relay is %u; give 0 (off) or 1 (relays between "
                        "destination replicas)", opts->relay);
        goto out;
    }
    if (sodium_init() < 0) {
        rc = rf_err_set(err, -EIO, "plan: libsodium failed to initialise");
        goto out;
    }
    pl = calloc(1, sizeof(*pl));
    ne = rf_inv_nendpoints(inv);
    nd = rf_inv_npieces(inv, RF_DST);
    if (pl == NULL)
        goto nomem;
    pl->inv = inv;
    pl->opts = *opts;
    pl->nendpoints = ne;
    pl->sent = calloc((uint64_t)ne + 1, sizeof(uint64_t));
    pl->recv = calloc((uint64_t)ne + 1, sizeof(uint64_t));
    pl->path = calloc(3 * (uint64_t)ne + 1, sizeof(uint64_t));
    b.inv = inv;
    b.plan = pl;
    b.half = opts->staging_bytes / 2;
    b.relay = opts->relay != 0;
    b.cur_unit = NO_UNIT;
    b.load = calloc((uint64_t)ne + 1, sizeof(uint64_t));
    b.epidx = calloc((uint64_t)ne + 1, sizeof(uint32_t));
    b.node = calloc((uint64_t)ne + 1, sizeof(uint32_t));
    if (!pl->sent || !pl->recv || !pl->path || !b.load || !b.epidx || !b.node)
        goto nomem;
    rc = setup(&b, err);
    if (rc)
        goto out;
    rc = build_srcidx(&b, err);
    if (rc)
        goto out;
    /* Most destination pieces take one transfer: reserve that many up front. */
    b.capx = (uint64_t)nd + 64;
    if (big_resize((void **)&pl->xfers, &pl->xfers_bytes, b.capx, sizeof(rf_plan_xfer)))
        goto nomem;
    if (b.relay) {
        if (big_resize((void **)&b.wunit, &b.wunit_bytes, b.capx, sizeof(uint32_t)))
            goto nomem;
        rc = plan_with_relays(&b, err);
        if (rc)
            goto out;
    }
    for (uint32_t i = 0; i < nd && !b.relay; i++) {
        rc = plan_piece(&b, i, err);
        if (rc)
            goto out;
    }
    pl->nxfers = b.nx;
    rc = schedule(&b, err);
    if (rc == 0 && b.relay)
        rc = relay_trees(&b, err);
    if (rc)
        goto out;
    /* The transfer array was reserved for one transfer per piece and grown by doubling. */
    (void)big_resize((void **)&pl->xfers, &pl->xfers_bytes, pl->nxfers + 1, sizeof(rf_plan_xfer));
    pl->boxes = b.boxes.boxes;
    pl->nboxes = (uint32_t)b.boxes.n;
    b.boxes.boxes = NULL;

    pl->st.tensors = rf_inv_ntensors(inv);
    pl->st.src_pieces = rf_inv_npieces(inv, RF_SRC);
    pl->st.dst_pieces = nd;
    pl->st.transfers = pl->nxfers;
    pl->st.messages = pl->nmsgs;
    pl->st.rounds = pl->nrounds;
    {
        uint64_t tot_s = 0, tot_r = 0;
        for (uint32_t e = 0; e < ne; e++) {
            bool src = rf_inv_endpoint(inv, e)->side == RF_SRC;
            tot_s += src ? pl->sent[e] : 0;
            tot_r += pl->recv[e];
            if (src && pl->sent[e] > pl->st.max_sender_bytes)
                pl->st.max_sender_bytes = pl->sent[e];
            if (!src && pl->sent[e] > pl->st.max_relay_sender_bytes)
                pl->st.max_relay_sender_bytes = pl->sent[e];
            if (pl->recv[e] > pl->st.max_receiver_bytes)
                pl->st.max_receiver_bytes = pl->recv[e];
        }
        pl->st.source_bytes = tot_s;
        pl->st.relay_depth_bytes[0] = tot_r - pl->st.relay_bytes;
        for (uint64_t i = 0; i < b.rlinks.nslots; i++)
            if (b.rlinks.keys[i] && b.rlinks.vals[i] > pl->st.max_link_bytes)
                pl->st.max_link_bytes = b.rlinks.vals[i];
        if (b.rlinkmat)
            for (uint64_t i = 0; i < (uint64_t)b.ndst_node * b.ndst_node; i++)
                if (b.rlinkmat[i] > pl->st.max_link_bytes)
                    pl->st.max_link_bytes = b.rlinkmat[i];
        pl->st.mean_sender_bytes = b.nsrc_ep ? (double)tot_s / b.nsrc_ep : 0.0;
        pl->st.mean_receiver_bytes = b.ndst_ep ? (double)tot_r / b.ndst_ep : 0.0;
        pl->st.dst_bytes = tot_r;
        for (uint64_t i = 0; i < b.links.nslots; i++)
            if (b.links.keys[i] && b.links.vals[i] > pl->st.max_link_bytes)
                pl->st.max_link_bytes = b.links.vals[i];
        if (b.linkmat)
            for (uint64_t i = 0; i < (uint64_t)b.nsrc_node * b.ndst_node; i++)
                if (b.linkmat[i] > pl->st.max_link_bytes)
                    pl->st.max_link_bytes = b.linkmat[i];
    }
    rf_plan_digest(inv, opts, pl->id);
    *out = pl;
    pl = NULL;
    goto out;
nomem:
    rc = rf_err_set(err, -ENOMEM, "plan: out of memory");
out:
    builder_free(&b);
    rf_plan_free(pl);
    return rc;
}

void rf_plan_free(rf_plan *plan)
{
    if (plan == NULL)
        return;
    big_free(plan->xfers, plan->xfers_bytes);
    big_free(plan->order, plan->order_bytes);
    free(plan->msgs);
    free(plan->boxes);
    free(plan->sent);
    free(plan->recv);
    free(plan->path);
    free(plan->xchunk);
    free(plan->cfirst);
    free(plan->corig);
    free(plan->cx);
    free(plan);
}

const uint8_t *rf_plan_id(const rf_plan *plan)
{
    return plan->id;
}

void rf_plan_id_to_hex(const uint8_t id[RF_PLAN_ID_BYTES], char out[RF_PLAN_ID_HEX])
{
    sodium_bin2hex(out, RF_PLAN_ID_HEX, id, RF_PLAN_ID_BYTES);
}

void rf_plan_id_hex(const rf_plan *plan, char out[RF_PLAN_ID_HEX])
{
    rf_plan_id_to_hex(plan->id, out);
}

const rf_inv *rf_plan_inv(const rf_plan *plan)
{
    return plan->inv;
}

uint64_t rf_plan_nxfers(const rf_plan *plan)
{
    return plan->nxfers;
}

uint32_t rf_plan_nmsgs(const rf_plan *plan)
{
    return plan->nmsgs;
}

uint32_t rf_plan_nrounds(const rf_plan *plan)
{
    return plan->nrounds;
}

const rf_plan_xfer *rf_plan_xfer_at(const rf_plan *plan, uint64_t i)
{
    return i < plan->nxfers ? &plan->xfers[plan->order[i]] : NULL;
}

const rf_plan_msg *rf_plan_msg_at(const rf_plan *plan, uint32_t i)
{
    return i < plan->nmsgs ? &plan->msgs[i] : NULL;
}

const rf_box *rf_plan_box(const rf_plan *plan, uint32_t i)
{
    return i < plan->nboxes ? &plan->boxes[i] : NULL;
}

const rf_plan_stats *rf_plan_stats_get(const rf_plan *plan)
{
    return &plan->st;
}

size_t rf_plan_memory(const rf_plan *plan)
{
    size_t chunks = plan->xchunk ? plan->nxfers * sizeof(uint32_t) +
                                       (2 * (size_t)plan->nchunks + 1) * sizeof(uint32_t) +
                                       (size_t)plan->cfirst[plan->nchunks] * sizeof(uint32_t)
                                 : 0;

    return sizeof(*plan) + plan->nxfers * (sizeof(rf_plan_xfer) + sizeof(uint32_t)) + plan->nmsgs * sizeof(rf_plan_msg) +
           plan->nboxes * sizeof(rf_box) + 5 * (size_t)plan->nendpoints * sizeof(uint64_t) +
           chunks;
}

uint32_t rf_plan_nchunks(const rf_plan *plan)
{
    return plan->nchunks;
}

uint32_t rf_plan_xfer_chunk(const rf_plan *plan, uint64_t i)
{
    return plan->xchunk && i < plan->nxfers ? plan->xchunk[i] : RF_PLAN_NO_CHUNK;
}

void rf_plan_chunk(const rf_plan *plan, uint32_t c, const uint32_t **origins,
                   uint32_t *norigins, const uint32_t **relays, uint32_t *nrelays)
{
    uint32_t a, o;

    if (c >= plan->nchunks) {
        *origins = *relays = NULL;
        *norigins = *nrelays = 0;
        return;
    }
    a = plan->cfirst[c];
    o = plan->corig[c];
    *origins = &plan->cx[a];
    *norigins = o;
    *relays = &plan->cx[a + o];
    *nrelays = plan->cfirst[c + 1] - a - o;
}

uint64_t rf_plan_sent_bytes(const rf_plan *plan, uint32_t ep)
{
    return ep < plan->nendpoints ? plan->sent[ep] : 0;
}

uint64_t rf_plan_recv_bytes(const rf_plan *plan, uint32_t ep)
{
    return ep < plan->nendpoints ? plan->recv[ep] : 0;
}

uint64_t rf_plan_path_bytes(const rf_plan *plan, uint32_t ep, uint32_t kind)
{
    if (ep >= plan->nendpoints || kind > RF_PLAN_LOCAL)
        return 0;
    return plan->path[(uint64_t)kind * plan->nendpoints + ep];
}

void rf_plan_predict(const rf_plan *plan, double link_Bps, double local_Bps, rf_plan_time *out)
{
    uint64_t maxnet = 0, maxloc = 0, maxin = 0;
    const rf_inv *inv = plan->inv;

    for (uint32_t e = 0; e < plan->nendpoints; e++) {
        uint64_t loc = plan->path[(uint64_t)RF_PLAN_LOCAL * plan->nendpoints + e];
        uint64_t s = plan->sent[e], r = plan->recv[e], net;
        if (rf_inv_endpoint(inv, e)->side == RF_SRC) {
            net = s - loc;
        } else {
            /* A destination's sends are its relays: network only. */
            net = r - loc > s ? r - loc : s;
            if (r - loc > maxin)
                maxin = r - loc;
        }
        if (net > maxnet)
            maxnet = net;
        if (loc > maxloc)
            maxloc = loc;
    }
    out->network_s = (double)maxnet / link_Bps;
    out->local_s = (double)maxloc / local_Bps;
    out->fill_s = (double)plan->st.relay_depth * plan->st.relay_fanout *
                  (double)plan->st.relay_chunk_bytes / link_Bps;
    out->predicted_s = (out->network_s > out->local_s ? out->network_s : out->local_s) +
                       out->fill_s;
    out->floor_s = (double)maxin / link_Bps;
}
