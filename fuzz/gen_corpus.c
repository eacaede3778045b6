/* fuzz/gen_corpus.c - writes the seed corpus of every fuzz target (fuzz/corpus/NAME/) from
 * real messages: inventories of a small model laid out by common/model/model, the plan slices the
 * planner makes of them, the RPC requests librefit sends, the daemons' example configs. Run
 * by `make fuzz-corpus`; the files are committed, so a seed changes only when this does.
 * Usage: gen_corpus DIR */
#include <errno.h>
#include <sys/stat.h>

#include "fuzz.h"
#include "model.h"
#include "plan.h"
#include "refit.pb-c.h"
#include "rpc.pb-c.h"
#include "slice.h"
#include "wire.h"

/* A small qwen3 and a small MoE: every kind of tensor, few bytes (regions fit 1 MiB memfds). */
static const char *DENSE = "{\"model_type\": \"qwen3\", \"name\": \"tiny-qwen3\", "
    "\"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 8, "
    "\"num_key_value_heads\": 2, \"head_dim\": 16, \"intermediate_size\": 128, "
    "\"vocab_size\": 1000, \"tie_word_embeddings\": false, \"torch_dtype\": \"float16\"}";
static const char *MOE = "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, "
    "\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 4, "
    "\"moe_intermediate_size\": 32, \"num_experts\": 8, \"vocab_size\": 500}";
static const char *DSV3 = "{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64, "
    "\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"intermediate_size\": 96, "
    "\"moe_intermediate_size\": 16, \"n_routed_experts\": 8, \"n_shared_experts\": 2, "
    "\"first_k_dense_replace\": 1, \"q_lora_rank\": null, \"kv_lora_rank\": 32, "
    "\"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 8, \"v_head_dim\": 16, "
    "\"vocab_size\": 300, \"torch_dtype\": \"bfloat16\"}";

/* A growing byte buffer: one seed file. */
typedef struct buf {
    uint8_t *p;
    size_t len, cap;
} buf;

static void put(buf *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2;
        b->p = realloc(b->p, b->cap);
        if (b->p == NULL)
            abort();
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

static void put_byte(buf *b, uint8_t v) { put(b, &v, 1); }

static void put_be32(buf *b, uint32_t v)
{
    uint8_t x[4] = {v >> 24, v >> 16, v >> 8, v};

    put(b, x, 4);
}

/* A message as the wire carries it: 4-byte big-endian length, then the packed bytes. */
static void put_msg(buf *b, const ProtobufCMessage *m)
{
    uint8_t *f = NULL;
    size_t n;

    if (rf_wire_pack(m, &f, &n) < 0)
        abort();
    put(b, f, n);
    free(f);
}

static const char *g_dir;

static void save(const char *target, const char *name, const buf *b)
{
    char path[512];

    if (mkdir(g_dir, 0755) < 0 && errno != EEXIST) {
        perror(g_dir);
        exit(1);
    }
    snprintf(path, sizeof(path), "%s/%s", g_dir, target);
    if (mkdir(path, 0755) < 0 && errno != EEXIST) {
        perror(path);
        exit(1);
    }
    snprintf(path, sizeof(path), "%s/%s/%s", g_dir, target, name);
    fuzz_write_file(path, b->p, b->len);
    printf("  %-40s %6zu bytes\n", path, b->len);
}

static rf_model *load_spec(const char *json)
{
    char path[160];
    rf_model *m = NULL;
    rf_err err = {0};

    snprintf(path, sizeof(path), "%s/spec.json", fuzz_dir());
    fuzz_write_file(path, (const uint8_t *)json, strlen(json));
    if (rf_model_load(path, &m, &err) < 0) {
        fprintf(stderr, "gen_corpus: %s\n", err.msg);
        exit(1);
    }
    return m;
}

/* The cluster inventory of model m laid out as src and dst, one endpoint (daemon) a rank. */
static rf_inv *cluster(const rf_model *m, const char *src_s, const char *dst_s)
{
    rf_inv *inv = rf_inv_new();
    rf_par src, dst;
    rf_err err = {0};

    if (rf_par_parse(src_s, RF_SRC, m, &src, &err) < 0 ||
        rf_par_parse(dst_s, RF_DST, m, &dst, &err) < 0 ||
        rf_model_build_inv(m, &src, &dst, 1, inv, &err) < 0) {
        fprintf(stderr, "gen_corpus: %s\n", err.msg);
        exit(1);
    }
    return inv;
}

/* What the daemon of endpoint ep holds itself: every tensor, its endpoint, regions, pieces. */
static rf_inv *local_of(const rf_inv *g, uint32_t ep)
{
    const rf_endpoint *e = rf_inv_endpoint(g, ep);
    rf_inv *l = rf_inv_new();
    uint32_t *rmap = calloc(rf_inv_nregions(g) + 1, sizeof(*rmap));
    rf_err err = {0};
    uint32_t i, id;

    for (i = 0; i < rf_inv_ntensors(g); i++) {
        const rf_tensor *t = rf_inv_tensor(g, i);

        rf_inv_add_tensor(l, t->name, t->dtype, t->ndim, t->shape, &id, &err);
    }
    rf_inv_add_endpoint(l, e->side, 0, &id, &err);
    for (i = 0; i < rf_inv_nregions(g); i++)
        if (rf_inv_region(g, i)->endpoint == ep)
            rf_inv_add_region(l, 0, rf_inv_region(g, i)->size, &rmap[i], &err);
    for (i = 0; i < rf_inv_npieces(g, e->side); i++) {
        rf_piece p;

        rf_inv_piece(g, e->side, i, &p);
        if (rf_inv_region(g, p.region)->endpoint != ep)
            continue;
        p.region = rmap[p.region];
        if (rf_inv_add_piece(l, &p, &id, &err) < 0) {
            fprintf(stderr, "gen_corpus: %s\n", err.msg);
            exit(1);
        }
    }
    free(rmap);
    return l;
}

/* Seeds of fuzz_slice and fuzz_wire: every member's Inventory, then the slice frames the
 * coordinator sends member 0, as one control-channel stream. */
static void slice_seed(const char *name, const char *json, const char *src_s, const char *dst_s)
{
    rf_model *m = load_spec(json);
    rf_inv *g = cluster(m, src_s, dst_s);
    uint32_t nep = rf_inv_nendpoints(g), e;
    Refit__Inventory *msgs = calloc(nep, sizeof(*msgs));
    Refit__Inventory **ptrs = calloc(nep, sizeof(*ptrs));
    rf_side *sides = calloc(nep, sizeof(*sides));
    rf_slice_peer *peers = calloc(nep, sizeof(*peers));
    Refit__PlanSlice **frames = NULL;
    size_t nframes = 0, i;
    rf_slice_map map;
    rf_inv *merged = NULL;
    rf_plan *plan = NULL;
    rf_plan_opts po;
    rf_err err = {0};
    uint8_t side_bits = 0;
    buf b = {0}, w = {0};

    put_byte(&b, 0);
    for (e = 0; e < nep; e++) {
        rf_inv *l = local_of(g, e);
        Refit__Envelope env = REFIT__ENVELOPE__INIT;

        sides[e] = rf_inv_endpoint(g, e)->side;
        if (sides[e] == RF_DST)
            side_bits |= (uint8_t)(1u << e);
        peers[e].daemon_id = 100 + e;
        peers[e].data_addr = "127.0.0.1:7471";
        peers[e].role = sides[e] == RF_SRC ? REFIT__ROLE__ROLE_PUBLISHER : REFIT__ROLE__ROLE_RECEIVER;
        rf_slice_inv_pack(l, sides[e], 1, &msgs[e]);
        msgs[e].complete = true;
        ptrs[e] = &msgs[e];
        env.body_case = REFIT__ENVELOPE__BODY_INVENTORY;
        env.inventory = &msgs[e];
        put_msg(&b, &env.base);
        rf_inv_free(l);
    }
    b.p[0] = side_bits;
    rf_plan_opts_default(&po);
    if (rf_slice_merge(ptrs, sides, nep, &merged, &map, &err) < 0 ||
        rf_plan_build(merged, &po, &plan, &err) < 0 ||
        rf_slice_build(plan, &map, 0, peers, 1, 16, NULL, &frames, &nframes) < 0) {
        fprintf(stderr, "gen_corpus: %s: %s\n", name, err.msg);
        exit(1);
    }
    for (i = 0; i < nframes && i < 4; i++) {
        Refit__Envelope env = REFIT__ENVELOPE__INIT;

        env.body_case = REFIT__ENVELOPE__BODY_PLAN_SLICE;
        env.plan_slice = frames[i];
        put_msg(&b, &env.base);
    }
    save("slice", name, &b);
    put_byte(&w, 0);
    put_byte(&w, 7);
    put(&w, b.p + 1, b.len - 1);
    save("wire", name, &w);
    for (i = 0; i < nframes; i++)
        rf_slice_msg_free(frames[i]);
    free(frames);
    for (e = 0; e < nep; e++)
        rf_slice_inv_msg_free(&msgs[e]);
    free(msgs);
    free(ptrs);
    free(sides);
    free(peers);
    rf_plan_free(plan);
    rf_slice_map_free(&map);
    rf_inv_free(merged);
    rf_inv_free(g);
    rf_model_free(m);
    free(b.p);
    free(w.p);
}

/* fuzz_rpc actions (see fuzz_rpc.c). */
#define ACT(a, v) (0x80000000u | (uint32_t)(a) << 24 | ((v) & 0xffffff))

static void put_req(buf *b, Refit__Rpc__Request *q)
{
    static uint64_t id;

    q->id = ++id;
    put_msg(b, &q->base);
}

static void put_hello(buf *b, Refit__Rpc__ClientKind kind, int rank)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    Refit__Rpc__Hello h = REFIT__RPC__HELLO__INIT;

    h.protocol_version = 1;
    h.name = "fuzz";
    h.rank = rank;
    h.kind = kind;
    h.pid = 1;
    q.body_case = REFIT__RPC__REQUEST__BODY_HELLO;
    q.hello = &h;
    put_req(b, &q);
}

static void put_version_req(buf *b, Refit__Rpc__Request__BodyCase c, uint64_t v)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    /* Every such body is {uint64 version = 1}: a Publish packs to the same bytes. */
    Refit__Rpc__Publish p = REFIT__RPC__PUBLISH__INIT;

    p.version = v;
    q.body_case = c;
    q.publish = &p; /* the oneof's members share one pointer */
    put_req(b, &q);
}

static void put_empty_req(buf *b, Refit__Rpc__Request__BodyCase c)
{
    Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
    /* Seal, Status and Gate have no fields: an empty Seal packs to the same bytes. */
    Refit__Rpc__Seal s = REFIT__RPC__SEAL__INIT;

    q.body_case = c;
    q.seal = &s;
    put_req(b, &q);
}

/* Registers the first regions and pieces rank 0 of side holds, as librefit does. */
static void put_rank(buf *b, const rf_model *m, rf_side side)
{
    rf_inv *g = cluster(m, "", "");
    uint32_t ep = side == RF_SRC ? 0 : 1, i, nreg = 0, npieces = 0;
    uint32_t *rmap = calloc(rf_inv_nregions(g) + 1, sizeof(*rmap));

    for (i = 0; i < rf_inv_nregions(g) && nreg < 2; i++) {
        Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
        Refit__Rpc__RegisterRegion r = REFIT__RPC__REGISTER_REGION__INIT;

        if (rf_inv_region(g, i)->endpoint != ep || rf_inv_region(g, i)->size > (1u << 20)) {
            rmap[i] = UINT32_MAX;
            continue;
        }
        r.size = rf_inv_region(g, i)->size;
        r.device = "host";
        r.kind = REFIT__RPC__MEM_KIND__MEM_MEMFD;
        q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_REGION;
        q.register_region = &r;
        put_req(b, &q);
        rmap[i] = nreg++;
    }
    for (; i < rf_inv_nregions(g); i++)
        rmap[i] = UINT32_MAX;
    for (i = 0; i < rf_inv_npieces(g, side) && npieces < 6; i++) {
        Refit__Rpc__Request q = REFIT__RPC__REQUEST__INIT;
        Refit__Rpc__RegisterPiece rp = REFIT__RPC__REGISTER_PIECE__INIT;
        const rf_tensor *t;
        rf_piece p;

        rf_inv_piece(g, side, i, &p);
        if (rmap[p.region] == UINT32_MAX)
            continue;
        t = rf_inv_tensor(g, p.tensor);
        rp.tensor = (char *)t->name;
        rp.dtype = t->dtype;
        rp.n_shape = rp.n_start = rp.n_extent = rp.n_strides = (size_t)t->ndim;
        rp.shape = (int64_t *)t->shape;
        rp.start = p.box.start;
        rp.extent = p.box.extent;
        rp.strides = p.strides;
        rp.region = rmap[p.region];
        rp.offset = p.offset;
        q.body_case = REFIT__RPC__REQUEST__BODY_REGISTER_PIECE;
        q.register_piece = &rp;
        put_req(b, &q);
        npieces++;
    }
    free(rmap);
    rf_inv_free(g);
}

static void rpc_seeds(void)
{
    rf_model *m = load_spec(DENSE);
    buf b = {0};

    /* A trainer: registers, seals, publishes 1 and waits for its release; refitctl on the
     * second connection asks for status, triggers 5 and waits for it. */
    put_byte(&b, 0);
    put_hello(&b, REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER, 0);
    put_rank(&b, m, RF_SRC);
    put_empty_req(&b, REFIT__RPC__REQUEST__BODY_SEAL);
    put_version_req(&b, REFIT__RPC__REQUEST__BODY_PUBLISH, 1);
    put_version_req(&b, REFIT__RPC__REQUEST__BODY_WAIT_RELEASED, 1);
    put_be32(&b, ACT(0, 1));
    put_hello(&b, REFIT__RPC__CLIENT_KIND__CLIENT_CTL, 0);
    put_empty_req(&b, REFIT__RPC__REQUEST__BODY_STATUS);
    put_version_req(&b, REFIT__RPC__REQUEST__BODY_REFIT, 5);
    put_version_req(&b, REFIT__RPC__REQUEST__BODY_WAIT, 5);
    put_be32(&b, ACT(2, 1));
    put_be32(&b, ACT(4, 5));
    put_be32(&b, ACT(0, 0));
    put_be32(&b, ACT(1, 0));
    save("rpc", "trainer-ctl", &b);

    /* A gated engine: registers, seals, waits for version 2, consumes it; an abort of 3. */
    b.len = 0;
    put_byte(&b, 1);
    put_hello(&b, REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE, 0);
    put_empty_req(&b, REFIT__RPC__REQUEST__BODY_GATE);
    put_rank(&b, m, RF_DST);
    put_empty_req(&b, REFIT__RPC__REQUEST__BODY_SEAL);
    put_version_req(&b, REFIT__RPC__REQUEST__BODY_WAIT_VERSION, 2);
    put_be32(&b, ACT(7, 1));
    put_be32(&b, ACT(6, 2));
    put_be32(&b, ACT(4, 2));
    put_version_req(&b, REFIT__RPC__REQUEST__BODY_CONSUMED, 2);
    put_be32(&b, ACT(5, 3));
    put_be32(&b, ACT(7, 0));
    save("rpc", "engine-gated", &b);

    /* Two trainers expected, one leaves after sealing and comes back. */
    b.len = 0;
    put_byte(&b, 2);
    put_hello(&b, REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER, 0);
    put_rank(&b, m, RF_SRC);
    put_empty_req(&b, REFIT__RPC__REQUEST__BODY_SEAL);
    put_be32(&b, ACT(1, 0));
    put_be32(&b, ACT(0, 0));
    put_hello(&b, REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER, 1);
    put_version_req(&b, REFIT__RPC__REQUEST__BODY_PUBLISH, 1);
    put_be32(&b, ACT(3, 1));
    save("rpc", "trainer-leaves", &b);
    free(b.p);
    rf_model_free(m);
}

static void text_seed(const char *target, const char *name, const char *text, const char *tail,
                      size_t tail_len)
{
    buf b = {0};

    put(&b, text, strlen(text));
    if (tail != NULL) {
        put_byte(&b, 0);
        put(&b, tail, tail_len);
    }
    save(target, name, &b);
    free(b.p);
}

static void file_seed(const char *target, const char *name, const char *path)
{
    FILE *f = fopen(path, "rb");
    char text[65536];
    size_t n;

    if (f == NULL) {
        perror(path);
        exit(1);
    }
    n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = '\0';
    text_seed(target, name, text, NULL, 0);
}

int main(int argc, char **argv)
{
    static const char flags[] = "--index=1\0--clients\0004\0--staging-mib=64\0--coordinator";
    static const char layouts[] = "tp=2,pp=2\0tp=4";

    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR (the corpus root, fuzz/corpus)\n", argv[0]);
        return 2;
    }
    g_dir = argv[1];
    fuzz_quiet();
    slice_seed("dense-tp2-tp1", DENSE, "tp=2", "");
    slice_seed("moe-ep2-tp2", MOE, "ep=2", "tp=2,ep=2");
    slice_seed("dsv3-pp2-tp1", DSV3, "pp=2", "");
    rpc_seeds();
    file_seed("cfg", "publisherd.conf.example", "systemd/publisherd.conf.example");
    file_seed("cfg", "receiverd.conf.example", "systemd/receiverd.conf.example");
    text_seed("cfg", "flags",
              "[common]\nnode = n1\npublishers = 2\nreceivers = 1\nsocket_uids = root, 0\n"
              "data_listen = [::1]:0\n[publisherd]\ncoordinator_addr = 127.0.0.1:7470\n"
              "verify = sample\ntransport = tcp\n", flags, sizeof(flags) - 1);
    text_seed("model", "dense", DENSE, layouts, sizeof(layouts) - 1);
    text_seed("model", "moe", MOE, "ep=2,tp=2\0tp=2,ep=2", 19);
    text_seed("model", "dsv3", DSV3, "pp=3,ep=4,dp=4\0tp=4,ep=4", 24);
    return 0;
}
