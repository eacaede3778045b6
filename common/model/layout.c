/* common/model/layout.c - dtypes, boxes, the compact inventory of tensors/endpoints/regions/pieces, and
 * the geometry of a piece in memory (byte offsets, contiguous runs, DTensor placements). */
#include "layout.h"
#include "quant_fmt.h"

#include <assert.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ---- dtypes ------------------------------------------------------------------------------ */

static const struct {
    const char *name;
    size_t size;
} dtypes[RF_DT__COUNT] = {
    [RF_DT_BF16] = {"bf16", 2},         [RF_DT_FP16] = {"fp16", 2},
    [RF_DT_FP32] = {"fp32", 4},         [RF_DT_FP64] = {"fp64", 8},
    [RF_DT_FP8_E4M3] = {"fp8_e4m3", 1}, [RF_DT_FP8_E5M2] = {"fp8_e5m2", 1},
    [RF_DT_INT8] = {"int8", 1},         [RF_DT_UINT8] = {"uint8", 1},
    [RF_DT_INT16] = {"int16", 2},       [RF_DT_INT32] = {"int32", 4},
    [RF_DT_INT64] = {"int64", 8},       [RF_DT_BOOL] = {"bool", 1},
};

/* torch's spellings (with or without the "torch." prefix) next to ours. */
static const struct {
    const char *name;
    rf_dtype dt;
} dtype_aliases[] = {
    {"bfloat16", RF_DT_BF16},      {"float16", RF_DT_FP16},       {"half", RF_DT_FP16},
    {"float32", RF_DT_FP32},       {"float", RF_DT_FP32},         {"float64", RF_DT_FP64},
    {"double", RF_DT_FP64},        {"float8_e4m3fn", RF_DT_FP8_E4M3},
    {"float8_e4m3", RF_DT_FP8_E4M3}, {"float8_e5m2", RF_DT_FP8_E5M2},
    {"short", RF_DT_INT16},        {"int", RF_DT_INT32},          {"long", RF_DT_INT64},
};

size_t rf_dtype_size(rf_dtype dt)
{
    return ((unsigned)dt < RF_DT__COUNT) ? dtypes[dt].size : 0;
}

const char *rf_dtype_name(rf_dtype dt)
{
    return ((unsigned)dt < RF_DT__COUNT) ? dtypes[dt].name : "?";
}

int rf_dtype_parse(const char *s, rf_dtype *out)
{
    if (s == NULL)
        return -EINVAL;
    if (strncmp(s, "torch.", 6) == 0)
        s += 6;
    for (int i = 0; i < RF_DT__COUNT; i++) {
        if (strcmp(s, dtypes[i].name) == 0) {
            *out = (rf_dtype)i;
            return 0;
        }
    }
    for (size_t i = 0; i < sizeof(dtype_aliases) / sizeof(dtype_aliases[0]); i++) {
        if (strcmp(s, dtype_aliases[i].name) == 0) {
            *out = dtype_aliases[i].dt;
            return 0;
        }
    }
    return -EINVAL;
}

/* ---- boxes ------------------------------------------------------------------------------- */

void rf_box_full(rf_box *b, int ndim, const int64_t *shape)
{
    for (int d = 0; d < RF_MAX_DIMS; d++) {
        b->start[d] = 0;
        b->extent[d] = d < ndim ? shape[d] : 1;
    }
}

int64_t rf_box_numel(const rf_box *b, int ndim)
{
    int64_t n = 1;

    for (int d = 0; d < ndim; d++)
        n *= b->extent[d] > 0 ? b->extent[d] : 0;
    return n;
}

bool rf_box_empty(const rf_box *b, int ndim)
{
    for (int d = 0; d < ndim; d++)
        if (b->extent[d] <= 0)
            return true;
    return false;
}

bool rf_box_intersect(const rf_box *a, const rf_box *b, int ndim, rf_box *out)
{
    bool nonempty = true;

    for (int d = 0; d < ndim; d++) {
        int64_t lo = a->start[d] > b->start[d] ? a->start[d] : b->start[d];
        int64_t ea = a->start[d] + a->extent[d], eb = b->start[d] + b->extent[d];
        int64_t hi = ea < eb ? ea : eb;

        out->start[d] = lo;
        out->extent[d] = hi > lo ? hi - lo : 0;
        if (hi <= lo)
            nonempty = false;
    }
    for (int d = ndim; d < RF_MAX_DIMS; d++) {
        out->start[d] = 0;
        out->extent[d] = 1;
    }
    return nonempty;
}

bool rf_box_contains(const rf_box *outer, const rf_box *inner, int ndim)
{
    for (int d = 0; d < ndim; d++) {
        if (inner->start[d] < outer->start[d] ||
            inner->start[d] + inner->extent[d] > outer->start[d] + outer->extent[d])
            return false;
    }
    return true;
}

bool rf_box_equal(const rf_box *a, const rf_box *b, int ndim)
{
    for (int d = 0; d < ndim; d++)
        if (a->start[d] != b->start[d] || a->extent[d] != b->extent[d])
            return false;
    return true;
}

int rf_box_format(const rf_box *b, int ndim, char *buf, size_t len)
{
    size_t used = 0;
    int n;

    n = snprintf(buf, len, "[");
    used += (size_t)n;
    for (int d = 0; d < ndim; d++) {
        n = snprintf(used < len ? buf + used : NULL, used < len ? len - used : 0,
                     "%s%" PRId64 ":%" PRId64, d ? ", " : "", b->start[d],
                     b->start[d] + b->extent[d]);
        used += (size_t)n;
    }
    n = snprintf(used < len ? buf + used : NULL, used < len ? len - used : 0, "]");
    used += (size_t)n;
    return (int)used;
}

static void format_shape(int ndim, const int64_t *shape, char *buf, size_t len)
{
    size_t used = 0;

    used += (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && used < len; d++)
        used += (size_t)snprintf(buf + used, len - used, "%s%" PRId64, d ? ", " : "", shape[d]);
    if (used < len)
        snprintf(buf + used, len - used, "]");
}

/* ---- the inventory ----------------------------------------------------------------------- */

/* Box and strides of a piece, interned: pieces of one shard layout share a handful of them. */
typedef rf_geom geom;

/* The record of a piece is the public rf_piece_rec (read-only access for hot loops). */
typedef rf_piece_rec piece_rec;

/* Names live in fixed blocks so that rf_tensor.name pointers stay valid while the pool grows. */
typedef struct name_block {
    struct name_block *next;
    size_t used, cap;
    char data[];
} name_block;

struct rf_inv {
    rf_tensor *tensors;
    uint32_t ntensors, cap_tensors;
    uint32_t *tensor_hash; /* id + 1, 0 = empty; capacity a power of two */
    uint32_t tensor_hash_cap;
    name_block *names;
    size_t names_bytes;

    rf_endpoint *endpoints;
    uint32_t nendpoints, cap_endpoints;
    rf_region *regions;
    uint32_t nregions, cap_regions;

    geom *geoms;
    uint32_t ngeoms, cap_geoms;
    uint32_t *geom_hash;
    uint32_t geom_hash_cap;
    /* The geometries of the last pieces added, with their byte extent for one element size:
     * shard layouts repeat one box and strides over many tensors (every expert of a layer), so
     * most pieces skip the stride checks and the hash lookup. */
    struct recent_geom {
        uint32_t gid1; /* geometry id + 1, 0 = unused */
        int eff;       /* dims up to the last non-canonical one */
        size_t esize;
        uint64_t last; /* last byte touched, relative to the piece offset */
    } recent[2];

    piece_rec *pieces[2];
    uint32_t npieces[2], cap_pieces[2];

    rf_quant_decl *quants; /* FP8 scale declarations, id i + 1 at [i] */
    uint32_t nquants, cap_quants;
};

/* Grows *arr (of elements of size esz) so that it holds at least need elements. */
static int grow(void **arr, uint32_t *cap, uint32_t need, size_t esz)
{
    uint64_t ncap;
    void *p;

    if (need <= *cap)
        return 0;
    ncap = *cap ? (uint64_t)*cap * 2 : 16;
    while (ncap < need)
        ncap *= 2;
    if (ncap > UINT32_MAX)
        ncap = UINT32_MAX;
    if (ncap < need)
        return -ENOMEM;
    p = realloc(*arr, ncap * esz);
    if (p == NULL)
        return -ENOMEM;
    *arr = p;
    *cap = (uint32_t)ncap;
    return 0;
}

/* The piece arrays hold millions of records: they live in their own mapping, grown with
 * mremap (no copy) and backed by transparent huge pages where the kernel allows, which saves
 * most of the page faults of filling a few hundred MiB. */
static int grow_pieces(rf_inv *inv, int side, uint32_t need)
{
    size_t old = (size_t)inv->cap_pieces[side] * sizeof(piece_rec), nbytes;
    uint64_t ncap;
    void *p;

    if (need <= inv->cap_pieces[side])
        return 0;
    ncap = inv->cap_pieces[side] ? (uint64_t)inv->cap_pieces[side] * 2 : 65536;
    while (ncap < need)
        ncap *= 2;
    if (ncap > UINT32_MAX)
        ncap = UINT32_MAX;
    if (ncap < need)
        return -ENOMEM;
    nbytes = (size_t)ncap * sizeof(piece_rec);
    if (inv->pieces[side] == NULL)
        p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    else
        p = mremap(inv->pieces[side], old, nbytes, MREMAP_MAYMOVE);
    if (p == MAP_FAILED)
        return -ENOMEM;
    (void)madvise(p, nbytes, MADV_HUGEPAGE);
    inv->pieces[side] = p;
    inv->cap_pieces[side] = (uint32_t)ncap;
    return 0;
}

rf_inv *rf_inv_new(void)
{
    return calloc(1, sizeof(rf_inv));
}

void rf_inv_free(rf_inv *inv)
{
    name_block *b, *next;

    if (inv == NULL)
        return;
    for (b = inv->names; b; b = next) {
        next = b->next;
        free(b);
    }
    free(inv->tensors);
    free(inv->tensor_hash);
    free(inv->endpoints);
    free(inv->regions);
    free(inv->geoms);
    free(inv->geom_hash);
    free(inv->quants);
    for (int side = 0; side < 2; side++)
        if (inv->pieces[side])
            munmap(inv->pieces[side], (size_t)inv->cap_pieces[side] * sizeof(piece_rec));
    free(inv);
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ULL;

    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ULL;
    }
    return h;
}

static uint64_t mix64(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* Hashes the dims up to the last one that is not canonical (start 0, extent 1, stride 0), so
 * the value depends only on the record and costs a tensor's few dims, not RF_MAX_DIMS. */
static int geom_eff_dims(const geom *g)
{
    int n = RF_MAX_DIMS;

    while (n > 0 && g->box.start[n - 1] == 0 && g->box.extent[n - 1] == 1 &&
           g->strides[n - 1] == 0)
        n--;
    return n;
}

static uint64_t hash_geom(const geom *g)
{
    uint64_t h = 0x9e3779b97f4a7c15ULL;
    int n = geom_eff_dims(g);

    for (int d = 0; d < n; d++) {
        h = (h ^ (uint64_t)g->box.start[d]) * 0x100000001b3ULL;
        h = (h ^ (uint64_t)g->box.extent[d]) * 0x9e3779b97f4a7c15ULL;
        h = (h ^ (uint64_t)g->strides[d]) * 0xff51afd7ed558ccdULL;
        h ^= h >> 29;
    }
    return mix64(h + (uint64_t)n);
}

/* Rebuilds an open-addressing table of ids + 1 at twice the size. */
static int tensor_hash_grow(rf_inv *inv)
{
    uint32_t ncap = inv->tensor_hash_cap ? inv->tensor_hash_cap * 2 : 64;
    uint32_t *t = calloc(ncap, sizeof(*t));

    if (t == NULL)
        return -ENOMEM;
    for (uint32_t id = 0; id < inv->ntensors; id++) {
        uint32_t i = (uint32_t)hash_str(inv->tensors[id].name) & (ncap - 1);

        while (t[i])
            i = (i + 1) & (ncap - 1);
        t[i] = id + 1;
    }
    free(inv->tensor_hash);
    inv->tensor_hash = t;
    inv->tensor_hash_cap = ncap;
    return 0;
}

static int geom_hash_grow(rf_inv *inv)
{
    uint32_t ncap = inv->geom_hash_cap ? inv->geom_hash_cap * 2 : 256;
    uint32_t *t = calloc(ncap, sizeof(*t));

    if (t == NULL)
        return -ENOMEM;
    for (uint32_t id = 0; id < inv->ngeoms; id++) {
        uint32_t i = (uint32_t)hash_geom(&inv->geoms[id]) & (ncap - 1);

        while (t[i])
            i = (i + 1) & (ncap - 1);
        t[i] = id + 1;
    }
    free(inv->geom_hash);
    inv->geom_hash = t;
    inv->geom_hash_cap = ncap;
    return 0;
}

/* Returns the id of g in the geometry table, adding it if new. g is canonical: dims past the
 * tensor's are start 0, extent 1, stride 0. */
static int geom_intern(rf_inv *inv, const geom *g, uint32_t *id)
{
    uint64_t h;
    uint32_t i;
    int rc;

    if ((uint64_t)(inv->ngeoms + 1) * 2 > inv->geom_hash_cap) {
        rc = geom_hash_grow(inv);
        if (rc < 0)
            return rc;
    }
    h = hash_geom(g);
    i = (uint32_t)h & (inv->geom_hash_cap - 1);
    while (inv->geom_hash[i]) {
        uint32_t cand = inv->geom_hash[i] - 1;

        if (memcmp(&inv->geoms[cand], g, sizeof(*g)) == 0) {
            *id = cand;
            return 0;
        }
        i = (i + 1) & (inv->geom_hash_cap - 1);
    }
    rc = grow((void **)&inv->geoms, &inv->cap_geoms, inv->ngeoms + 1, sizeof(geom));
    if (rc < 0)
        return rc;
    inv->geoms[inv->ngeoms] = *g;
    inv->geom_hash[i] = inv->ngeoms + 1;
    *id = inv->ngeoms++;
    return 0;
}

static const char *pool_strdup(rf_inv *inv, const char *s)
{
    size_t n = strlen(s) + 1;
    name_block *b = inv->names;
    char *p;

    if (b == NULL || b->cap - b->used < n) {
        size_t cap = n > 65536 ? n : 65536;

        b = malloc(sizeof(*b) + cap);
        if (b == NULL)
            return NULL;
        b->next = inv->names;
        b->used = 0;
        b->cap = cap;
        inv->names = b;
        inv->names_bytes += sizeof(*b) + cap;
    }
    p = b->data + b->used;
    memcpy(p, s, n);
    b->used += n;
    return p;
}

int rf_inv_find_tensor(const rf_inv *inv, const char *name, uint32_t *id)
{
    uint32_t i;

    if (inv->tensor_hash_cap == 0)
        return -ENOENT;
    i = (uint32_t)hash_str(name) & (inv->tensor_hash_cap - 1);
    while (inv->tensor_hash[i]) {
        uint32_t cand = inv->tensor_hash[i] - 1;

        if (strcmp(inv->tensors[cand].name, name) == 0) {
            *id = cand;
            return 0;
        }
        i = (i + 1) & (inv->tensor_hash_cap - 1);
    }
    return -ENOENT;
}

/* One UTF-8 sequence at s (n bytes left): its length and code point, or 0 when the bytes
 * there are not valid UTF-8 (a stray continuation byte, a truncated sequence, an overlong
 * form, a surrogate, a code point past U+10FFFF). */
static size_t utf8_next(const unsigned char *s, size_t n, uint32_t *cp)
{
    size_t len, i;
    uint32_t c, min;

    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    if ((s[0] & 0xe0) == 0xc0) {
        len = 2, c = s[0] & 0x1f, min = 0x80;
    } else if ((s[0] & 0xf0) == 0xe0) {
        len = 3, c = s[0] & 0x0f, min = 0x800;
    } else if ((s[0] & 0xf8) == 0xf0) {
        len = 4, c = s[0] & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = c << 6 | (s[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return len;
}

/* Characters that would make a log line or a message read differently from what it holds. */
static const char *unprintable(uint32_t c)
{
    if (c < 0x20 || c == 0x7f || (c >= 0x80 && c <= 0x9f))
        return "a control character";
    if (c == 0x2028 || c == 0x2029)
        return "a line or paragraph separator";
    if (c == 0x200e || c == 0x200f || (c >= 0x202a && c <= 0x202e) ||
        (c >= 0x2066 && c <= 0x2069))
        return "a bidirectional control";
    return NULL;
}

char *rf_name_escape(const char *s, char *out, size_t outlen)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s), o = 0, i = 0;

    if (outlen < 6) {
        if (outlen > 0)
            out[0] = '\0';
        return out;
    }
    out[o++] = '"';
    while (i < n) {
        char tmp[8];
        size_t len, tl;
        uint32_t c = 0;

        len = utf8_next(p + i, n - i, &c);
        if (len == 0 || unprintable(c) != NULL) {
            static const char *const named[] = {['\n'] = "\\n", ['\t'] = "\\t",
                                                ['\r'] = "\\r"};

            if (len == 1 && c < sizeof(named) / sizeof(named[0]) && named[c] != NULL)
                tl = (size_t)snprintf(tmp, sizeof(tmp), "%s", named[c]);
            else
                tl = (size_t)snprintf(tmp, sizeof(tmp), "\\x%02x", p[i]);
            len = 1; /* a refused sequence is shown byte by byte */
        } else if (c == '"' || c == '\\') {
            tl = (size_t)snprintf(tmp, sizeof(tmp), "\\%c", (char)c);
        } else {
            memcpy(tmp, p + i, len);
            tl = len;
        }
        /* Room for this, the closing quote and the NUL, or the cut mark "..." instead. */
        if (o + tl + 2 > outlen || (i + len < n && o + tl + 5 > outlen)) {
            if (o + 5 > outlen)
                o = outlen - 5;
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        memcpy(out + o, tmp, tl);
        o += tl;
        i += len;
    }
    out[o++] = '"';
    out[o] = '\0';
    return out;
}

int rf_tensor_name_check(const char *name, rf_err *err)
{
    const unsigned char *p = (const unsigned char *)name;
    const char *what = NULL;
    char esc[160];
    size_t n, i, len;
    uint32_t c = 0;

    if (name == NULL || name[0] == '\0')
        return rf_err_set(err, -EINVAL, "tensor with an empty name: every tensor needs its HF "
                          "name");
    n = strlen(name);
    if (n >= RF_NAME_MAX)
        return rf_err_set(err, -EINVAL, "tensor name %s is %zu bytes long; the limit is %d",
                          rf_name_escape(name, esc, 80), n, RF_NAME_MAX - 1);
    for (i = 0; i < n; i += len) {
        len = utf8_next(p + i, n - i, &c);
        if (len == 0) {
            what = "a byte that is not valid UTF-8";
            break;
        }
        what = unprintable(c);
        if (what == NULL && c == ' ')
            what = "a space";
        else if (what == NULL && (c == '"' || c == '\''))
            what = "a quote";
        else if (what == NULL && c == '\\')
            what = "a backslash";
        if (what != NULL)
            break;
    }
    if (what == NULL)
        return 0;
    return rf_err_set(err, -EINVAL, "tensor name %s has %s (byte %zu, 0x%02x): a tensor name is "
                      "printable UTF-8 without spaces, quotes, backslashes or control "
                      "characters, like model.layers.0.mlp.up_proj.weight",
                      rf_name_escape(name, esc, sizeof(esc)), what, i, p[i]);
}

int rf_inv_add_tensor(rf_inv *inv, const char *name, rf_dtype dtype, int ndim,
                      const int64_t *shape, uint32_t *id, rf_err *err)
{
    char want[160], have[160];
    rf_tensor *t;
    uint32_t old;
    bool found;
    int rc;

    if (name == NULL || name[0] == '\0')
        return rf_err_set(err, -EINVAL, "tensor with an empty name: every tensor needs its HF name");
    /* A name already in the inventory passed the check when it came in; a piece registry of
     * millions of pieces names the same tensors again and again. */
    found = rf_inv_find_tensor(inv, name, &old) == 0;
    if (!found) {
        rc = rf_tensor_name_check(name, err);
        if (rc < 0)
            return rc;
    }
    if (rf_dtype_size(dtype) == 0)
        return rf_err_set(err, -EINVAL, "tensor %s has an unknown dtype %d", name, (int)dtype);
    if (ndim < 1 || ndim > RF_MAX_DIMS)
        return rf_err_set(err, -EINVAL, "tensor %s has %d dims; 1 to %d are supported (register "
                          "a scalar as shape [1])", name, ndim, RF_MAX_DIMS);
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 1) {
            format_shape(ndim, shape, want, sizeof(want));
            return rf_err_set(err, -EINVAL, "tensor %s has shape %s: every dim must be >= 1",
                              name, want);
        }
    }
    if (found) {
        t = &inv->tensors[old];
        if (t->dtype != dtype || t->ndim != ndim ||
            memcmp(t->shape, shape, (size_t)ndim * sizeof(int64_t)) != 0) {
            format_shape(t->ndim, t->shape, have, sizeof(have));
            format_shape(ndim, shape, want, sizeof(want));
            return rf_err_set(err, -EINVAL, "tensor %s registered as %s %s and again as %s %s: "
                              "both sides must agree on dtype and global shape", name,
                              rf_dtype_name(t->dtype), have, rf_dtype_name(dtype), want);
        }
        if (id)
            *id = old;
        return 0;
    }
    if (inv->ntensors == UINT32_MAX - 1)
        return rf_err_set(err, -ENOMEM, "too many tensors");
    if ((uint64_t)(inv->ntensors + 1) * 2 > inv->tensor_hash_cap) {
        rc = tensor_hash_grow(inv);
        if (rc < 0)
            return rf_err_set(err, rc, "out of memory adding tensor %s", name);
    }
    rc = grow((void **)&inv->tensors, &inv->cap_tensors, inv->ntensors + 1, sizeof(rf_tensor));
    if (rc < 0)
        return rf_err_set(err, rc, "out of memory adding tensor %s", name);
    t = &inv->tensors[inv->ntensors];
    t->name = pool_strdup(inv, name);
    if (t->name == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory adding tensor %s", name);
    t->dtype = dtype;
    t->ndim = ndim;
    for (int d = 0; d < RF_MAX_DIMS; d++)
        t->shape[d] = d < ndim ? shape[d] : 1;
    {
        uint32_t i = (uint32_t)hash_str(name) & (inv->tensor_hash_cap - 1);

        while (inv->tensor_hash[i])
            i = (i + 1) & (inv->tensor_hash_cap - 1);
        inv->tensor_hash[i] = inv->ntensors + 1;
    }
    if (id)
        *id = inv->ntensors;
    inv->ntensors++;
    return 0;
}

int rf_inv_add_endpoint(rf_inv *inv, rf_side side, uint32_t node, uint32_t *id, rf_err *err)
{
    int rc;

    if (side != RF_SRC && side != RF_DST)
        return rf_err_set(err, -EINVAL, "endpoint on node %u has side %d; use RF_SRC or RF_DST",
                          node, (int)side);
    rc = grow((void **)&inv->endpoints, &inv->cap_endpoints, inv->nendpoints + 1,
              sizeof(rf_endpoint));
    if (rc < 0)
        return rf_err_set(err, rc, "out of memory adding an endpoint");
    inv->endpoints[inv->nendpoints].side = side;
    inv->endpoints[inv->nendpoints].node = node;
    inv->endpoints[inv->nendpoints].host = RF_HOST_NONE;
    if (id)
        *id = inv->nendpoints;
    inv->nendpoints++;
    return 0;
}

int rf_inv_set_endpoint_host(rf_inv *inv, uint32_t id, uint32_t host, rf_err *err)
{
    if (id >= inv->nendpoints)
        return rf_err_set(err, -EINVAL, "host for endpoint %u but the inventory holds %u", id,
                          inv->nendpoints);
    inv->endpoints[id].host = host;
    return 0;
}

int rf_inv_add_region(rf_inv *inv, uint32_t endpoint, uint64_t size, uint32_t *id, rf_err *err)
{
    int rc;

    if (endpoint >= inv->nendpoints)
        return rf_err_set(err, -EINVAL, "region names endpoint %u but the inventory holds %u",
                          endpoint, inv->nendpoints);
    if (size == 0)
        return rf_err_set(err, -EINVAL, "region of endpoint %u has size 0", endpoint);
    rc = grow((void **)&inv->regions, &inv->cap_regions, inv->nregions + 1, sizeof(rf_region));
    if (rc < 0)
        return rf_err_set(err, rc, "out of memory adding a region");
    inv->regions[inv->nregions].endpoint = endpoint;
    inv->regions[inv->nregions].size = size;
    if (id)
        *id = inv->nregions;
    inv->nregions++;
    return 0;
}

/* Last byte a piece touches, relative to its offset (strides are >= 0); false on overflow. */
static bool piece_extent_bytes(const rf_box *b, const int64_t *strides, int ndim, size_t esize,
                               uint64_t *last)
{
    uint64_t el = 0, t;

    for (int d = 0; d < ndim; d++) {
        if (__builtin_mul_overflow((uint64_t)(b->extent[d] - 1), (uint64_t)strides[d], &t) ||
            __builtin_add_overflow(el, t, &el))
            return false;
    }
    if (__builtin_mul_overflow(el, (uint64_t)esize, &t) ||
        __builtin_add_overflow(t, (uint64_t)esize - 1, &t))
        return false;
    *last = t;
    return true;
}

/* ---- FP8 pieces (issue 15) ---------------------------------------------------------------- */

int rf_inv_add_quant(rf_inv *inv, const rf_quant_decl *q, uint32_t *id, rf_err *err)
{
    rf_quant_fmt f = {q->kind, q->br, q->bc};
    int rc = rf_quant_fmt_check(&f, err);

    if (rc < 0)
        return rc;
    for (int d = 0; d < RF_MAX_DIMS; d++)
        if (q->scale_strides[d] < 0)
            return rf_err_set(err, -EINVAL, "FP8 scales have negative stride %" PRId64 " on dim "
                              "%d", q->scale_strides[d], d);
    if (grow((void **)&inv->quants, &inv->cap_quants, inv->nquants + 1, sizeof(*q)) < 0)
        return rf_err_set(err, -ENOMEM, "out of memory adding FP8 scales");
    inv->quants[inv->nquants++] = *q;
    *id = inv->nquants;
    return 0;
}

uint32_t rf_inv_nquants(const rf_inv *inv) { return inv->nquants; }

const rf_quant_decl *rf_inv_quant(const rf_inv *inv, uint32_t id)
{
    return id >= 1 && id <= inv->nquants ? &inv->quants[id - 1] : NULL;
}

size_t rf_inv_piece_esize(const rf_inv *inv, const rf_piece *p)
{
    return p->quant ? 1 : rf_dtype_size(inv->tensors[p->tensor].dtype);
}

void rf_inv_scale_box(const rf_quant_decl *q, int ndim, const int64_t *shape, const rf_box *sub,
                      rf_box *out)
{
    rf_quant_fmt f = {q->kind, q->br, q->bc};
    uint64_t b[2];

    *out = *sub;
    rf_quant_fmt_block(&f, (uint64_t)shape[ndim - 2], (uint64_t)shape[ndim - 1], &b[0], &b[1]);
    for (int k = 0; k < 2; k++) {
        int d = ndim - 2 + k;
        int64_t lo = sub->start[d] / (int64_t)b[k];
        int64_t hi = (sub->start[d] + sub->extent[d] + (int64_t)b[k] - 1) / (int64_t)b[k];

        out->start[d] = lo;
        out->extent[d] = hi - lo;
    }
}

void rf_inv_quant_scales(const rf_inv *inv, const rf_piece *p, rf_piece *out)
{
    const rf_quant_decl *q = rf_inv_quant(inv, p->quant);
    const rf_tensor *t = &inv->tensors[p->tensor];

    memset(out, 0, sizeof(*out));
    out->tensor = p->tensor;
    out->region = q->scale_region;
    out->offset = q->scale_offset;
    rf_inv_scale_box(q, t->ndim, t->shape, &p->box, &out->box);
    for (int d = 0; d < t->ndim; d++)
        out->strides[d] = q->scale_strides[d];
}

/* An FP8 piece: of a bf16/fp16/fp32 tensor of at least 2 dims, whose box lies on the format's
 * grid, with its scales inside a region of its endpoint. An engine's is quantized into; a
 * trainer's (one that holds its weights in FP8) is copied with its scales into engine FP8
 * pieces of the same format. */
static int check_quant_piece(const rf_inv *inv, const rf_piece *p, const rf_tensor *t,
                             rf_err *err)
{
    const rf_quant_decl *q = rf_inv_quant(inv, p->quant);
    rf_quant_fmt f;
    rf_piece sc;
    uint64_t last = 0, end;
    size_t ses;
    int nd = t->ndim, rc;

    if (q == NULL)
        return rf_err_set(err, -EINVAL, "piece of %s names FP8 scales %u, the inventory holds %u",
                          t->name, p->quant, inv->nquants);
    f = (rf_quant_fmt){q->kind, q->br, q->bc};
    if (t->dtype != RF_DT_BF16 && t->dtype != RF_DT_FP16 && t->dtype != RF_DT_FP32)
        return rf_err_set(err, -EINVAL, "piece of %s is FP8-quantized from %s: only bf16, fp16 "
                          "and fp32 tensors are quantized", t->name, rf_dtype_name(t->dtype));
    if (nd < 2)
        return rf_err_set(err, -EINVAL, "piece of %s is FP8-quantized, but the tensor has %d "
                          "dim: a quantized weight has rows and columns", t->name, nd);
    if (p->strides[nd - 1] != 1)
        return rf_err_set(err, -EINVAL, "FP8 piece of %s has stride %" PRId64 " on its last dim: "
                          "its rows must be contiguous (stride 1)", t->name, p->strides[nd - 1]);
    rc = rf_quant_box_ok(&f, (uint64_t)t->shape[nd - 2], (uint64_t)t->shape[nd - 1],
                         (uint64_t)p->box.start[nd - 2], (uint64_t)p->box.start[nd - 1],
                         (uint64_t)p->box.extent[nd - 2], (uint64_t)p->box.extent[nd - 1], err);
    if (rc < 0) {
        rf_err_wrap(err, "FP8 piece of %s: ", t->name);
        return rc;
    }
    if (q->scale_region >= inv->nregions ||
        inv->regions[q->scale_region].endpoint != inv->regions[p->region].endpoint)
        return rf_err_set(err, -EINVAL, "FP8 piece of %s keeps its scales in region %u, which is "
                          "not a region of the piece's own GPU", t->name, q->scale_region);
    rf_inv_quant_scales(inv, p, &sc);
    ses = rf_dtype_size(rf_quant_scale_dtype(&f));
    for (int d = 0; d < nd; d++)
        if (sc.strides[d] == 0 && sc.box.extent[d] != 1)
            return rf_err_set(err, -EINVAL, "FP8 scales of %s have stride 0 on dim %d of %" PRId64
                              " blocks: scales would share memory", t->name, d, sc.box.extent[d]);
    if (!piece_extent_bytes(&sc.box, sc.strides, nd, ses, &last) ||
        __builtin_add_overflow(sc.offset, last, &end) || end >= inv->regions[sc.region].size)
        return rf_err_set(err, -EINVAL, "FP8 scales of %s lie outside their region (size %" PRIu64
                          ", offset %" PRIu64 ")", t->name, inv->regions[sc.region].size,
                          sc.offset);
    return 0;
}

int rf_inv_add_piece(rf_inv *inv, const rf_piece *p, uint32_t *id, rf_err *err)
{
    char bs[200], ss[160];
    const rf_tensor *t;
    const rf_region *r;
    rf_side side;
    uint64_t last = 0, end;
    size_t esize;
    geom g;
    uint32_t gid = UINT32_MAX;
    int ndim, rc;

    if (p->tensor >= inv->ntensors)
        return rf_err_set(err, -EINVAL, "piece names tensor %u but the inventory holds %u tensors",
                          p->tensor, inv->ntensors);
    t = &inv->tensors[p->tensor];
    ndim = t->ndim;
    if (p->region >= inv->nregions)
        return rf_err_set(err, -EINVAL, "piece of %s names region %u but the inventory holds %u "
                          "regions: register the region first", t->name, p->region,
                          inv->nregions);
    r = &inv->regions[p->region];
    side = inv->endpoints[r->endpoint].side;
    /* The box is formatted only on the error paths: this runs for millions of pieces. */
#define BOX_STR() rf_box_format(&p->box, ndim, bs, sizeof(bs))
    for (int d = 0; d < ndim; d++) {
        if (p->box.extent[d] < 1)
            return BOX_STR(), rf_err_set(err, -EINVAL, "box %s of %s is empty (dim %d has extent %" PRId64
                              ")", bs, t->name, d, p->box.extent[d]);
    }
    for (int d = 0; d < ndim; d++) {
        if (p->box.start[d] < 0 || p->box.start[d] > t->shape[d] - p->box.extent[d]) {
            format_shape(ndim, t->shape, ss, sizeof(ss));
            BOX_STR();
            return rf_err_set(err, -EINVAL, "box %s of %s lies outside its shape %s", bs, t->name,
                              ss);
        }
    }
    esize = rf_dtype_size(t->dtype);
    if (p->quant != 0) {
        if ((rc = check_quant_piece(inv, p, t, err)) < 0)
            return rc;
        esize = 1;
    }
    for (int k = 0; k < 2 && gid == UINT32_MAX; k++) {
        const struct recent_geom *c = &inv->recent[k];
        const geom *cg;
        int d;

        if (c->gid1 == 0 || c->esize != esize || c->eff > ndim)
            continue;
        cg = &inv->geoms[c->gid1 - 1];
        for (d = 0; d < ndim; d++)
            if (cg->box.start[d] != p->box.start[d] || cg->box.extent[d] != p->box.extent[d] ||
                cg->strides[d] != p->strides[d])
                break;
        if (d == ndim) {
            gid = c->gid1 - 1;
            last = c->last;
            if (k == 1) {
                struct recent_geom tmp = inv->recent[0];

                inv->recent[0] = inv->recent[1];
                inv->recent[1] = tmp;
            }
        }
    }
    if (gid == UINT32_MAX) {
        for (int d = 0; d < ndim; d++) {
            if (p->strides[d] < 0)
                return BOX_STR(), rf_err_set(err, -EINVAL, "piece %s %s has negative stride %"
                                             PRId64 " on dim %d; describe the storage with "
                                             "strides >= 0", t->name, bs, p->strides[d], d);
            if (p->strides[d] == 0 && p->box.extent[d] != 1)
                return BOX_STR(), rf_err_set(err, -EINVAL, "piece %s %s has stride 0 on dim %d of "
                                             "extent %" PRId64 ": elements would share memory",
                                             t->name, bs, d, p->box.extent[d]);
        }
        if (!piece_extent_bytes(&p->box, p->strides, ndim, esize, &last))
            return BOX_STR(), rf_err_set(err, -EINVAL, "piece %s %s lies outside its registered "
                                         "region (size %" PRIu64 "): its strides overflow 64-bit "
                                         "addressing", t->name, bs, r->size);
    }
    if (__builtin_add_overflow(p->offset, last, &end))
        return BOX_STR(), rf_err_set(err, -EINVAL, "piece %s %s lies outside its registered region "
                                     "(size %" PRIu64 "): offset %" PRIu64 " plus its extent "
                                     "overflows 64 bits", t->name, bs, r->size, p->offset);
    if (end >= r->size)
        return BOX_STR(), rf_err_set(err, -EINVAL, "piece %s %s lies outside its registered region "
                                     "(size %" PRIu64 "): it touches bytes %" PRIu64 " to %"
                                     PRIu64, t->name, bs, r->size, p->offset, end);

    rc = grow_pieces(inv, side, inv->npieces[side] + 1);
    if (rc == 0 && gid == UINT32_MAX) {
        g.box = p->box;
        memcpy(g.strides, p->strides, sizeof(g.strides));
        for (int d = ndim; d < RF_MAX_DIMS; d++) {
            g.box.start[d] = 0;
            g.box.extent[d] = 1;
            g.strides[d] = 0;
        }
        rc = geom_intern(inv, &g, &gid);
        if (rc == 0) {
            inv->recent[1] = inv->recent[0];
            inv->recent[0] = (struct recent_geom){
                .gid1 = gid + 1, .eff = geom_eff_dims(&g), .esize = esize, .last = last};
        }
    }
    if (rc < 0)
        return BOX_STR(), rf_err_set(err, rc, "out of memory adding piece %s %s", t->name, bs);
    inv->pieces[side][inv->npieces[side]] = (piece_rec){
        .tensor = p->tensor, .region = p->region, .geom = gid, .quant = p->quant,
        .offset = p->offset};
    if (id)
        *id = inv->npieces[side];
    inv->npieces[side]++;
    return 0;
#undef BOX_STR
}

uint32_t rf_inv_ntensors(const rf_inv *inv) { return inv->ntensors; }
uint32_t rf_inv_nendpoints(const rf_inv *inv) { return inv->nendpoints; }
uint32_t rf_inv_nregions(const rf_inv *inv) { return inv->nregions; }
uint32_t rf_inv_npieces(const rf_inv *inv, rf_side side) { return inv->npieces[side]; }
const rf_tensor *rf_inv_tensor(const rf_inv *inv, uint32_t id) { return &inv->tensors[id]; }
const rf_endpoint *rf_inv_endpoint(const rf_inv *inv, uint32_t id) { return &inv->endpoints[id]; }
const rf_region *rf_inv_region(const rf_inv *inv, uint32_t id) { return &inv->regions[id]; }

void rf_inv_piece(const rf_inv *inv, rf_side side, uint32_t id, rf_piece *out)
{
    const piece_rec *r = &inv->pieces[side][id];
    const geom *g = &inv->geoms[r->geom];

    out->tensor = r->tensor;
    out->region = r->region;
    out->offset = r->offset;
    out->box = g->box;
    memcpy(out->strides, g->strides, sizeof(out->strides));
    out->quant = r->quant;
}

uint32_t rf_inv_piece_tensor(const rf_inv *inv, rf_side side, uint32_t id)
{
    return inv->pieces[side][id].tensor;
}

uint32_t rf_inv_piece_region(const rf_inv *inv, rf_side side, uint32_t id)
{
    return inv->pieces[side][id].region;
}

uint32_t rf_inv_piece_endpoint(const rf_inv *inv, rf_side side, uint32_t id)
{
    return inv->regions[inv->pieces[side][id].region].endpoint;
}

const rf_piece_rec *rf_inv_piece_recs(const rf_inv *inv, rf_side side)
{
    return inv->pieces[side];
}

uint32_t rf_inv_ngeoms(const rf_inv *inv) { return inv->ngeoms; }
const rf_geom *rf_inv_geoms(const rf_inv *inv) { return inv->geoms; }

size_t rf_inv_memory(const rf_inv *inv)
{
    return sizeof(*inv) + (size_t)inv->cap_tensors * sizeof(rf_tensor) +
           (size_t)inv->tensor_hash_cap * sizeof(uint32_t) + inv->names_bytes +
           (size_t)inv->cap_endpoints * sizeof(rf_endpoint) +
           (size_t)inv->cap_regions * sizeof(rf_region) +
           (size_t)inv->cap_geoms * sizeof(geom) + (size_t)inv->geom_hash_cap * sizeof(uint32_t) +
           ((size_t)inv->cap_pieces[0] + inv->cap_pieces[1]) * sizeof(piece_rec) +
           (size_t)inv->cap_quants * sizeof(rf_quant_decl);
}

/* ---- piece geometry ---------------------------------------------------------------------- */

uint64_t rf_piece_byte_offset(const rf_piece *p, int ndim, size_t esize, const int64_t *idx)
{
    int64_t el = 0;

    for (int d = 0; d < ndim; d++)
        el += (idx[d] - p->box.start[d]) * p->strides[d];
    return p->offset + (uint64_t)el * esize;
}

/* The runs of sub in p's memory: the innermost dims that are contiguous in memory merge into
 * one run of run_el elements; the remaining (outer) dims, listed in nouter/outer_dims, each
 * give one run per index. Dims of extent 1 are ignored. */
typedef struct runs_shape {
    uint64_t run_el;
    uint64_t nruns;
    int nouter;
    int outer_dims[RF_MAX_DIMS];
} runs_shape;

static void runs_shape_of(const rf_piece *p, int ndim, const rf_box *sub, runs_shape *rs)
{
    bool open = true;

    rs->run_el = 1;
    rs->nruns = 1;
    rs->nouter = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        uint64_t ext = (uint64_t)sub->extent[d];

        if (ext == 1)
            continue;
        if (open && (uint64_t)p->strides[d] == rs->run_el) {
            rs->run_el *= ext;
            continue;
        }
        open = false;
        rs->nruns *= ext;
        rs->outer_dims[rs->nouter++] = d;
    }
}

bool rf_piece_contiguous(const rf_piece *p, int ndim, size_t esize, const rf_box *sub,
                         uint64_t *off)
{
    runs_shape rs;

    runs_shape_of(p, ndim, sub, &rs);
    if (rs.nruns != 1)
        return false;
    if (off)
        *off = rf_piece_byte_offset(p, ndim, esize, sub->start);
    return true;
}

uint64_t rf_piece_runs(const rf_piece *p, int ndim, size_t esize, const rf_box *sub,
                       uint64_t *run_bytes)
{
    runs_shape rs;

    runs_shape_of(p, ndim, sub, &rs);
    if (run_bytes)
        *run_bytes = rs.run_el * esize;
    return rs.nruns;
}

/* ---- destination overlap ----------------------------------------------------------------- */

/* What the check compares are the byte sets a destination writes: each piece's elements and,
 * for an FP8 piece, its scales, which the install writes like elements. An item code names
 * one: 2 * piece id, plus 1 for the piece's scales. */
#define ITEM_CODE(id, scales) (2 * (id) + (uint32_t)(scales))
#define ITEM_ID(code)         ((code) / 2)
#define ITEM_SCALES(code)     ((code) & 1)

typedef struct span {
    uint64_t lo, hi; /* first and last byte */
    uint32_t code;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;

    if (x->lo != y->lo)
        return x->lo < y->lo ? -1 : 1;
    if (x->hi != y->hi)
        return x->hi < y->hi ? -1 : 1;
    return x->code < y->code ? -1 : x->code > y->code;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* The bytes of item code as a piece of its own (an FP8 piece's scales: rf_inv_quant_scales)
 * and the size of one of its elements. */
static size_t item_piece(const rf_inv *inv, uint32_t code, rf_piece *out)
{
    rf_piece p;
    const rf_quant_decl *q;
    rf_quant_fmt f;

    rf_inv_piece(inv, RF_DST, ITEM_ID(code), &p);
    if (!ITEM_SCALES(code)) {
        *out = p;
        return rf_inv_piece_esize(inv, &p);
    }
    q = rf_inv_quant(inv, p.quant);
    assert(q != NULL);
    f = (rf_quant_fmt){q->kind, q->br, q->bc};
    rf_inv_quant_scales(inv, &p, out);
    return rf_dtype_size(rf_quant_scale_dtype(&f));
}

/* "w [0:64, 0:64]", or "the FP8 scales of w [0:64, 0:64]", into buf. */
static void item_format(const rf_inv *inv, uint32_t code, char *buf, size_t len)
{
    char bs[200];
    rf_piece p;

    rf_inv_piece(inv, RF_DST, ITEM_ID(code), &p);
    rf_box_format(&p.box, inv->tensors[p.tensor].ndim, bs, sizeof(bs));
    snprintf(buf, len, "%s%s %s", ITEM_SCALES(code) ? "the FP8 scales of " : "",
             inv->tensors[p.tensor].name, bs);
}

/* The start bytes of every run of piece p (whole box), sorted; *nout runs of *run_bytes. */
static int piece_run_starts(const rf_piece *p, int ndim, size_t esize, uint64_t **out,
                            uint64_t *nout, uint64_t *run_bytes)
{
    runs_shape rs;
    int64_t idx[RF_MAX_DIMS];
    uint64_t *v;

    runs_shape_of(p, ndim, &p->box, &rs);
    v = malloc(rs.nruns * sizeof(*v));
    if (v == NULL)
        return -ENOMEM;
    memset(idx, 0, sizeof(idx));
    for (uint64_t i = 0; i < rs.nruns; i++) {
        int64_t el = 0;

        for (int k = 0; k < rs.nouter; k++)
            el += idx[k] * p->strides[rs.outer_dims[k]];
        v[i] = p->offset + (uint64_t)el * esize;
        /* outer_dims[0] is the innermost of the outer dims: odometer from there. */
        for (int k = 0; k < rs.nouter; k++) {
            if (++idx[k] < p->box.extent[rs.outer_dims[k]])
                break;
            idx[k] = 0;
        }
    }
    qsort(v, rs.nruns, sizeof(*v), cmp_u64);
    *out = v;
    *nout = rs.nruns;
    *run_bytes = rs.run_el * esize;
    return 0;
}

/* Exact test: whether items a and b share a byte; *at is the first shared byte found. */
static int items_share_byte(const rf_inv *inv, uint32_t a, uint32_t b, bool *shared,
                            uint64_t *at)
{
    rf_piece pa, pb;
    size_t ea_size, eb_size;
    uint64_t *ra = NULL, *rb = NULL, na, nb, la, lb, i = 0, j = 0;
    int rc;

    ea_size = item_piece(inv, a, &pa);
    eb_size = item_piece(inv, b, &pb);
    *shared = false;
    rc = piece_run_starts(&pa, inv->tensors[pa.tensor].ndim, ea_size, &ra, &na, &la);
    if (rc == 0)
        rc = piece_run_starts(&pb, inv->tensors[pb.tensor].ndim, eb_size, &rb, &nb, &lb);
    if (rc < 0)
        goto out;
    /* Runs of one piece do not overlap each other in sane layouts, but a sweep that keeps the
     * furthest end seen handles it anyway: advance whichever run ends first. */
    while (i < na && j < nb) {
        uint64_t ea = ra[i] + la, eb = rb[j] + lb;
        uint64_t lo = ra[i] > rb[j] ? ra[i] : rb[j];

        if (lo < (ea < eb ? ea : eb)) {
            *shared = true;
            *at = lo;
            break;
        }
        if (ea <= eb)
            i++;
        else
            j++;
    }
out:
    free(ra);
    free(rb);
    return rc;
}

/* The region item code lies in. */
static uint32_t item_region(const rf_inv *inv, const piece_rec *pr, uint32_t code)
{
    const piece_rec *r = &pr[ITEM_ID(code)];

    return ITEM_SCALES(code) ? inv->quants[r->quant - 1].scale_region : r->region;
}

int rf_inv_check_dst_overlap(const rf_inv *inv, rf_err *err)
{
    const piece_rec *pr = inv->pieces[RF_DST];
    uint32_t n = inv->npieces[RF_DST];
    uint32_t *first = NULL, *order = NULL, *fill = NULL, maxg = 0;
    span *sp = NULL;
    int rc = 0;

    if (n == 0)
        return 0;
    if (n > UINT32_MAX / 2)
        return rf_err_set(err, -E2BIG, "%u destination pieces are more than the overlap check "
                          "counts (%u)", n, UINT32_MAX / 2);
    /* Bucket the items by region (counting sort: O(n), 4 bytes an item), then sort each
     * region's few items by span in a scratch array sized for the largest region. */
    first = calloc((size_t)inv->nregions + 1, sizeof(*first));
    order = malloc((size_t)n * 2 * sizeof(*order));
    fill = malloc(((size_t)inv->nregions + 1) * sizeof(*fill));
    if (first == NULL || order == NULL || fill == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory checking %u destination pieces", n);
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        first[pr[i].region + 1]++;
        if (pr[i].quant)
            first[inv->quants[pr[i].quant - 1].scale_region + 1]++;
    }
    for (uint32_t r = 0; r < inv->nregions; r++) {
        if (first[r + 1] > maxg)
            maxg = first[r + 1];
        first[r + 1] += first[r];
    }
    memcpy(fill, first, (size_t)inv->nregions * sizeof(*fill));
    for (uint32_t i = 0; i < n; i++) {
        order[fill[pr[i].region]++] = ITEM_CODE(i, 0);
        if (pr[i].quant)
            order[fill[item_region(inv, pr, ITEM_CODE(i, 1))]++] = ITEM_CODE(i, 1);
    }
    sp = malloc((size_t)maxg * sizeof(*sp));
    if (sp == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory checking %u destination pieces", n);
        goto out;
    }
    for (uint32_t r = 0; r < inv->nregions; r++) {
        uint32_t k = first[r + 1] - first[r];
        bool sorted = true;

        if (k < 2)
            continue;
        for (uint32_t i = 0; i < k; i++) {
            uint32_t code = order[first[r] + i];
            uint64_t last = 0, lo;

            if (ITEM_SCALES(code)) {
                rf_piece s;
                size_t es = item_piece(inv, code, &s);

                piece_extent_bytes(&s.box, s.strides, inv->tensors[s.tensor].ndim, es, &last);
                lo = s.offset;
            } else {
                const piece_rec *p = &pr[ITEM_ID(code)];
                const rf_tensor *t = &inv->tensors[p->tensor];
                const geom *g = &inv->geoms[p->geom];

                /* An FP8 piece holds one byte an element. */
                piece_extent_bytes(&g->box, g->strides, t->ndim,
                                   p->quant ? 1 : rf_dtype_size(t->dtype), &last);
                lo = p->offset;
            }
            sp[i] = (span){.lo = lo, .hi = lo + last, .code = code};
            if (i && cmp_span(&sp[i - 1], &sp[i]) > 0)
                sorted = false;
        }
        if (!sorted)
            qsort(sp, k, sizeof(*sp), cmp_span);
        for (uint32_t i = 0; i < k; i++) {
            for (uint32_t j = i + 1; j < k && sp[j].lo <= sp[i].hi; j++) {
                bool shared;
                uint64_t at = 0;

                rc = items_share_byte(inv, sp[i].code, sp[j].code, &shared, &at);
                if (rc < 0) {
                    rc = rf_err_set(err, rc, "out of memory checking destination pieces %u and "
                                    "%u for overlap", ITEM_ID(sp[i].code), ITEM_ID(sp[j].code));
                    goto out;
                }
                if (shared) {
                    char ba[RF_NAME_MAX + 240], bb[RF_NAME_MAX + 240];

                    item_format(inv, sp[i].code, ba, sizeof(ba));
                    item_format(inv, sp[j].code, bb, sizeof(bb));
                    rc = rf_err_set(err, -EINVAL, "destination pieces %s and %s both write "
                                    "byte %" PRIu64 " of region %u (endpoint %u): each "
                                    "destination byte, FP8 scales included, must belong to one "
                                    "piece", ba, bb, at, r, inv->regions[r].endpoint);
                    goto out;
                }
            }
        }
    }
out:
    free(first);
    free(order);
    free(fill);
    free(sp);
    return rc;
}

/* ---- placements -------------------------------------------------------------------------- */

void rf_chunk(int64_t n, int64_t k, int64_t i, int64_t *start, int64_t *len)
{
    int64_t c, s, e;

    if (k < 1 || i < 0 || n < 1) { /* no such part: empty */
        *start = 0;
        *len = 0;
        return;
    }
    c = (n + k - 1) / k;
    s = i * c;
    e = s + c;

    if (s > n)
        s = n;
    if (e > n)
        e = n;
    *start = s;
    *len = e - s;
}

bool rf_placement_box(int ndim, const int64_t *shape, int mesh_ndim, const int64_t *mesh_shape,
                      const int *placements, const int64_t *coord, rf_box *out)
{
    bool nonempty = true;

    rf_box_full(out, ndim, shape);
    for (int d = 0; d < ndim; d++) {
        int64_t idx = 0, parts = 1, s, l;

        /* Mesh dims sharding dim d combine in mesh order, the first outermost. */
        for (int m = 0; m < mesh_ndim; m++) {
            if (placements[m] == d) {
                idx = idx * mesh_shape[m] + coord[m];
                parts *= mesh_shape[m];
            }
        }
        if (parts == 1)
            continue;
        rf_chunk(shape[d], parts, idx, &s, &l);
        out->start[d] = s;
        out->extent[d] = l;
        if (l == 0)
            nonempty = false;
    }
    return nonempty;
}

/* The host every endpoint of side shares, else RF_HOST_NONE (also for a side with none). */
static uint32_t side_host(const rf_inv *in, rf_side side)
{
    uint32_t h = RF_HOST_NONE;
    bool first = true;

    for (uint32_t e = 0; e < in->nendpoints; e++) {
        if (in->endpoints[e].side != side)
            continue;
        if (!first && in->endpoints[e].host != h)
            return RF_HOST_NONE;
        h = in->endpoints[e].host;
        first = false;
    }
    return h;
}

int rf_inv_fold_sides(const rf_inv *in, rf_inv **out, rf_err *err)
{
    rf_inv *f = rf_inv_new();
    uint32_t id, ep;
    int rc = 0;

    *out = NULL;
    if (!f)
        return rf_err_set(err, -ENOMEM, "out of memory folding an inventory");
    for (uint32_t i = 0; i < rf_inv_ntensors(in) && rc == 0; i++) {
        const rf_tensor *t = rf_inv_tensor(in, i);

        rc = rf_inv_add_tensor(f, t->name, t->dtype, t->ndim, t->shape, &id, err);
    }
    /* A side whose endpoints all share a host keeps it, so that a colocated inventory folds
     * into a colocated pair (one GPU for trainers and engines: local copies). */
    if (rc == 0)
        rc = rf_inv_add_endpoint(f, RF_SRC, 0, &ep, err);
    if (rc == 0)
        f->endpoints[ep].host = side_host(in, RF_SRC);
    if (rc == 0)
        rc = rf_inv_add_endpoint(f, RF_DST, 1, &ep, err);
    if (rc == 0)
        f->endpoints[ep].host = side_host(in, RF_DST);
    for (uint32_t r = 0; r < rf_inv_nregions(in) && rc == 0; r++) {
        const rf_region *rg = rf_inv_region(in, r);

        rc = rf_inv_add_region(f, rf_inv_endpoint(in, rg->endpoint)->side == RF_SRC ? 0 : 1,
                               rg->size, &id, err);
    }
    for (uint32_t q = 1; q <= rf_inv_nquants(in) && rc == 0; q++)
        rc = rf_inv_add_quant(f, rf_inv_quant(in, q), &id, err);
    for (int side = 0; side < 2 && rc == 0; side++) {
        for (uint32_t i = 0; i < rf_inv_npieces(in, (rf_side)side) && rc == 0; i++) {
            rf_piece p;

            rf_inv_piece(in, (rf_side)side, i, &p);
            rc = rf_inv_add_piece(f, &p, &id, err);
        }
    }
    if (rc < 0) {
        rf_inv_free(f);
        return rc;
    }
    *out = f;
    return 0;
}
