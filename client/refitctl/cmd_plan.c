/* client/refitctl/cmd_plan.c - `refitctl plan`: runs the planner offline on a synthetic model
 * and two layouts, and reports transfers, loads, imbalance and a predicted refit time. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "ctl.h"
#include "layout.h"
#include "model.h"
#include "plan.h"
#include "quant_fmt.h"

#define TOP_N 5

static void plan_usage(FILE *f)
{
    fprintf(f,
            "usage: refitctl plan --model NAME|FILE --src LAYOUT --dst LAYOUT [options]\n"
            "\n"
            "Plans a refit from a trainer layout to an engine layout of a synthetic model, on\n"
            "this machine, without daemons, and prints what the plan would move.\n"
            "\n"
            "  --model NAME|FILE   qwen3-0.6b, qwen3-4b, qwen3-30b-a3b, deepseek-v3, or a JSON file\n"
            "                      with HF config.json keys\n"
            "  --src LAYOUT        trainer parallelism, e.g. tp=2,pp=2,ep=4,dp=2\n"
            "  --dst LAYOUT        engine parallelism, e.g. tp=4,dp=4; ep divides tp or equals\n"
            "                      tp*dp (vLLM expert parallelism: tp=2,dp=4,ep=8); attn=dp is\n"
            "                      SGLang's --enable-dp-attention: tp ranks in all, attention\n"
            "                      over tp/dp ranks per DP group (tp=8,dp=8,attn=dp)\n"
            "  --staging-mib N     staging budget per GPU in MiB (default 256)\n"
            "  --direct-min-mib N  smallest contiguous transfer sent direct, MiB (default 4)\n"
            "  --link-gbps X       bandwidth of each GPU's link in Gbit/s (default 400)\n"
            "  --gpus-per-node N   GPUs per node on both sides, for link loads (default 8)\n"
            "  --colocate[=N]      what-if: trainers and engines share machines of --gpus-per-node\n"
            "                      GPUs (colocated RL): trainer rank r and engine rank r are on\n"
            "                      machine r / gpus-per-node, and transfers between one machine's\n"
            "                      GPUs are local copies. =N: only engine ranks 0..N-1 share the\n"
            "                      trainers' machines, the others are elsewhere\n"
            "  --local-gbps X      bandwidth of local copies out of or into one GPU in Gbit/s\n"
            "                      (default 3200: the ~400 GB/s copy engines measured between\n"
            "                      two H200s)\n"
            "  --relay             let engine replicas forward bytes they received to other\n"
            "                      replicas (relays), so trainers send each byte about once\n"
            "  --fp8 FORMAT        what-if: the engines serve FP8 (block, block:RxC, channel,\n"
            "                      tensor, mxfp8): every engine piece of a 2-dim-or-more weight\n"
            "                      whose box lies on the format's grid is FP8, quantized by its\n"
            "                      sender (the plan refuses trainer shards that cut a block)\n"
            "  --explain           add per-path, per-tensor-class, top sender, receiver and link\n"
            "                      tables, and with --relay the relay structure\n"
            "  --json              print one JSON object instead of text\n"
            "\n"
            "Predicted time: every GPU sends and receives at once over its own link of\n"
            "--link-gbps, so a refit takes as long as the busiest GPU needs for its bytes:\n"
            "  predicted = max over GPUs of max(bytes sent, bytes received) / (link_gbps*1e9/8).\n"
            "Local copies (--colocate) run beside the network and take\n"
            "  max over GPUs of local bytes read or written / (local_gbps*1e9/8);\n"
            "the prediction is the larger of the two. A relay counts on both ends (the relay\n"
            "sends, the replica receives), and relays add the pipeline's fill: depth chunks.\n"
            "It ignores latency, staging copies and node-level (NIC, switch) limits; max link\n"
            "bytes shows how much one node pair carries. The floor is the most network bytes\n"
            "one engine GPU must take in over its link: no plan is faster.\n"
            "\n"
            "Exit status: 0 planned, 1 the plan failed (uncovered bytes), 2 bad arguments,\n"
            "model or layout.\n");
}

typedef struct plan_args {
    const char *model, *src, *dst;
    double staging_mib, direct_min_mib, link_gbps, local_gbps;
    int gpus_per_node;
    int colocate;  /* engine ranks on the trainers' machines: 0 none, -1 all, else that many */
    const char *fp8; /* --fp8: the engines' FP8 format, NULL for none */
    int explain, json, relay;
} plan_args;

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double peak_rss_bytes(void)
{
    struct rusage ru;

    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss * 1024.0; /* KiB on Linux */
}

static int parse_num(const char *opt, const char *s, double lo, double hi, double *out)
{
    char *end;
    double v;

    errno = 0;
    v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !(v >= lo && v <= hi)) {
        fprintf(stderr, "refitctl plan: %s '%s' is not a number in [%g, %g]\n", opt, s, lo, hi);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, plan_args *a)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"src", required_argument, NULL, 's'},
        {"dst", required_argument, NULL, 'd'},
        {"staging-mib", required_argument, NULL, 'S'},
        {"direct-min-mib", required_argument, NULL, 'D'},
        {"link-gbps", required_argument, NULL, 'l'},
        {"gpus-per-node", required_argument, NULL, 'g'},
        {"colocate", optional_argument, NULL, 'c'},
        {"local-gbps", required_argument, NULL, 'L'},
        {"explain", no_argument, NULL, 'e'},
        {"relay", no_argument, NULL, 'r'},
        {"fp8", required_argument, NULL, 'F'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    double g = 8, n;
    int c;

    memset(a, 0, sizeof(*a));
    a->staging_mib = 256;
    a->direct_min_mib = 4;
    a->link_gbps = 400;
    a->local_gbps = 3200;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': a->model = optarg; break;
        case 's': a->src = optarg; break;
        case 'd': a->dst = optarg; break;
        case 'S':
            if (parse_num("--staging-mib", optarg, 1.0 / 256, 1 << 20, &a->staging_mib))
                return 2;
            break;
        case 'D':
            if (parse_num("--direct-min-mib", optarg, 0, 1 << 20, &a->direct_min_mib))
                return 2;
            break;
        case 'l':
            if (parse_num("--link-gbps", optarg, 1e-3, 1e6, &a->link_gbps))
                return 2;
            break;
        case 'g':
            if (parse_num("--gpus-per-node", optarg, 1, 1 << 16, &g))
                return 2;
            break;
        case 'c':
            a->colocate = -1;
            if (optarg) {
                if (parse_num("--colocate", optarg, 1, 1 << 20, &n))
                    return 2;
                if (n != (int)n) {
                    fprintf(stderr, "refitctl plan: --colocate=%s: give a whole number of engine "
                            "ranks\n", optarg);
                    return 2;
                }
                a->colocate = (int)n;
            }
            break;
        case 'L':
            if (parse_num("--local-gbps", optarg, 1e-3, 1e7, &a->local_gbps))
                return 2;
            break;
        case 'e': a->explain = 1; break;
        case 'r': a->relay = 1; break;
        case 'F': a->fp8 = optarg; break;
        case 'j': a->json = 1; break;
        case 'h': plan_usage(stdout); return 0;
        default:
            fprintf(stderr, "refitctl plan: unknown or incomplete option '%s'; see "
                    "`refitctl plan --help`\n", argv[optind - 1]);
            return 2;
        }
    }
    a->gpus_per_node = (int)g;
    if (optind < argc) {
        fprintf(stderr, "refitctl plan: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (a->model == NULL || a->src == NULL || a->dst == NULL) {
        fprintf(stderr, "refitctl plan: --model, --src and --dst are required; see "
                "`refitctl plan --help`\n");
        return 2;
    }
    return -1;
}

static void fmt_bytes(double b, char *buf, size_t len)
{
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int i = 0;

    while (b >= 1024 && i < 5) {
        b /= 1024;
        i++;
    }
    snprintf(buf, len, i ? "%.2f %s" : "%.0f %s", b, u[i]);
}

/* The class of a tensor: its name with layer and expert numbers replaced by '*'. */
static void tensor_class(const char *name, char *out, size_t len)
{
    size_t o = 0;

    for (const char *p = name; *p && o + 2 < len;) {
        if ((p == name || p[-1] == '.') && *p >= '0' && *p <= '9') {
            while (*p >= '0' && *p <= '9')
                p++;
            out[o++] = '*';
            continue;
        }
        out[o++] = *p++;
    }
    out[o] = '\0';
}

typedef struct kv {
    uint64_t key, val;
} kv;

static int cmp_val_desc(const void *a, const void *b)
{
    const kv *x = a, *y = b;

    if (x->val != y->val)
        return x->val < y->val ? 1 : -1;
    return (x->key > y->key) - (x->key < y->key);
}

static int cmp_key(const void *a, const void *b)
{
    const kv *x = a, *y = b;

    return (x->key > y->key) - (x->key < y->key);
}

typedef struct tclass {
    char name[RF_NAME_MAX];
    uint64_t tensors, transfers, bytes, direct_bytes, local_bytes;
} tclass;

static const char *const path_names[3] = {"direct", "packed", "local"};

/* The time endpoint e needs for its bytes: network bytes over its link, local copies over
 * the local bandwidth, the two at once. */
static double ep_seconds(const rf_plan *pl, uint32_t e, double bps, double lbps)
{
    bool src = rf_inv_endpoint(rf_plan_inv(pl), e)->side == RF_SRC;
    uint64_t tot = src ? rf_plan_sent_bytes(pl, e) : rf_plan_recv_bytes(pl, e);
    uint64_t loc = rf_plan_path_bytes(pl, e, RF_PLAN_LOCAL);
    double net = (double)(tot - loc) / bps, l = (double)loc / lbps;

    /* A destination's sends are relays, over its link beside what it receives. */
    if (!src && (double)rf_plan_sent_bytes(pl, e) / bps > net)
        net = (double)rf_plan_sent_bytes(pl, e) / bps;

    return net > l ? net : l;
}

/* Messages, transfers and bytes per path (direct, packed, local), as a table or into jo. */
static void explain_paths(const rf_plan *pl, json_t *jo)
{
    uint64_t msgs[3] = {0}, xfers[3] = {0}, bytes[3] = {0}, all = 0;
    char b1[32];

    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *m = rf_plan_msg_at(pl, mi);
        msgs[m->kind]++;
        xfers[m->kind] += m->count;
        bytes[m->kind] += m->bytes;
        all += m->bytes;
    }
    if (jo) {
        json_t *ja = json_array();
        for (int k = 0; k < 3; k++)
            json_array_append_new(ja, json_pack("{s:s, s:I, s:I, s:I}", "path", path_names[k],
                                                "messages", (json_int_t)msgs[k], "transfers",
                                                (json_int_t)xfers[k], "bytes",
                                                (json_int_t)bytes[k]));
        json_object_set_new(jo, "paths", ja);
        return;
    }
    printf("\nper path:\n  %-8s %10s %10s %12s %8s\n", "path", "messages", "transfers", "bytes",
           "share");
    for (int k = 0; k < 3; k++) {
        fmt_bytes((double)bytes[k], b1, sizeof(b1));
        printf("  %-8s %10llu %10llu %12s %7.1f%%\n", path_names[k], (unsigned long long)msgs[k],
               (unsigned long long)xfers[k], b1, all ? 100.0 * (double)bytes[k] / (double)all : 0.0);
    }
}

/* With relays: who sends what (trainers, relaying engines), how deep the trees are, bytes
 * received per hop count, and the rounds that pipeline them. */
static void explain_relay(const rf_plan *pl, json_t *jo)
{
    const rf_plan_stats *st = rf_plan_stats_get(pl);
    const rf_inv *inv = rf_plan_inv(pl);
    uint64_t relays = 0, msgs = 0;
    char b1[32], b2[32], b3[32];

    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++)
        relays += rf_inv_endpoint(inv, e)->side == RF_DST && rf_plan_sent_bytes(pl, e) > 0;
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++)
        msgs += rf_plan_msg_at(pl, mi)->relay != 0;
    if (jo) {
        json_t *ja = json_array();
        for (uint32_t d = 0; d <= st->relay_depth; d++)
            json_array_append_new(ja, json_integer((json_int_t)st->relay_depth_bytes[d]));
        json_object_set_new(jo, "relay_structure",
                            json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o}",
                                      "source_bytes", (json_int_t)st->source_bytes,
                                      "relay_bytes", (json_int_t)st->relay_bytes,
                                      "relaying_endpoints", (json_int_t)relays,
                                      "relay_messages", (json_int_t)msgs,
                                      "depth", (json_int_t)st->relay_depth,
                                      "fanout", (json_int_t)st->relay_fanout,
                                      "chunk_bytes", (json_int_t)st->relay_chunk_bytes,
                                      "rounds", (json_int_t)st->rounds, "bytes_by_hops", ja));
        return;
    }
    fmt_bytes((double)st->source_bytes, b1, sizeof(b1));
    fmt_bytes((double)st->relay_bytes, b2, sizeof(b2));
    fmt_bytes((double)st->dst_bytes, b3, sizeof(b3));
    printf("\nrelays:\n  trainers send %s, engines relay %s, of %s received\n", b1, b2, b3);
    fmt_bytes((double)st->max_relay_sender_bytes, b1, sizeof(b1));
    fmt_bytes((double)st->relay_chunk_bytes, b2, sizeof(b2));
    printf("  %llu engine GPUs relay (max %s each) in %llu relay messages (%llu transfers)\n",
           (unsigned long long)relays, b1, (unsigned long long)msgs,
           (unsigned long long)st->relay_transfers);
    printf("  trees %u hops deep, up to %u children per holder, chunks up to %s, %llu rounds\n",
           st->relay_depth, st->relay_fanout, b2, (unsigned long long)st->rounds);
    printf("  received by hops from a trainer:");
    for (uint32_t d = 0; d <= st->relay_depth; d++) {
        fmt_bytes((double)st->relay_depth_bytes[d], b1, sizeof(b1));
        printf("%s %u: %s", d ? "," : "", d, b1);
    }
    printf("\n");
}

static int explain(const rf_plan *pl, double bps, double lbps, int relay, json_t *jo)
{
    const rf_inv *inv = rf_plan_inv(pl);
    uint32_t nt = rf_inv_ntensors(inv), ne = rf_inv_nendpoints(inv), nm = rf_plan_nmsgs(pl);
    uint32_t *cls = calloc((size_t)nt + 1, sizeof(*cls));
    tclass *cl = NULL;
    kv *ep = calloc((size_t)ne + 1, sizeof(*ep)), *links = calloc((size_t)nm + 1, sizeof(*links));
    size_t ncl = 0, nlinks = 0;
    char c[RF_NAME_MAX], b1[32], b2[32];
    json_t *ja = NULL;
    int rc = 0;

    if (cls == NULL || ep == NULL || links == NULL) {
        fprintf(stderr, "refitctl plan: out of memory for --explain\n");
        rc = -ENOMEM;
        goto out;
    }
    for (uint32_t t = 0; t < nt; t++) {
        size_t k;
        tensor_class(rf_inv_tensor(inv, t)->name, c, sizeof(c));
        for (k = 0; k < ncl && strcmp(cl[k].name, c) != 0; k++)
            ;
        if (k == ncl) {
            tclass *q = realloc(cl, (ncl + 1) * sizeof(*cl));
            if (q == NULL) {
                rc = -ENOMEM;
                goto out;
            }
            cl = q;
            memset(&cl[ncl], 0, sizeof(*cl));
            snprintf(cl[ncl].name, sizeof(cl[ncl].name), "%s", c);
            ncl++;
        }
        cls[t] = (uint32_t)k;
        cl[k].tensors++;
    }
    for (uint32_t mi = 0; mi < nm; mi++) {
        const rf_plan_msg *m = rf_plan_msg_at(pl, mi);
        for (uint32_t k = 0; k < m->count; k++) {
            const rf_plan_xfer *x = rf_plan_xfer_at(pl, (uint64_t)m->first + k);
            tclass *q = &cl[cls[rf_inv_piece_tensor(inv, RF_DST, x->dst)]];
            q->transfers++;
            q->bytes += x->bytes;
            if (m->kind == RF_PLAN_DIRECT)
                q->direct_bytes += x->bytes;
            else if (m->kind == RF_PLAN_LOCAL)
                q->local_bytes += x->bytes;
        }
        /* Local copies use no link between nodes. */
        if (m->kind == RF_PLAN_LOCAL)
            continue;
        links[nlinks].key = ((uint64_t)rf_inv_endpoint(inv, m->src_ep)->node << 32) |
                            rf_inv_endpoint(inv, m->dst_ep)->node;
        links[nlinks++].val = m->bytes;
    }
    /* Links: sum message bytes per node pair. */
    qsort(links, nlinks, sizeof(*links), cmp_key);
    {
        size_t w = 0;
        for (size_t i = 0; i < nlinks; i++) {
            if (w > 0 && links[w - 1].key == links[i].key)
                links[w - 1].val += links[i].val;
            else
                links[w++] = links[i];
        }
        nlinks = w;
    }
    qsort(links, nlinks, sizeof(*links), cmp_val_desc);

    explain_paths(pl, jo);
    if (relay)
        explain_relay(pl, jo);
    if (jo) {
        ja = json_array();
        for (size_t k = 0; k < ncl; k++)
            json_array_append_new(ja, json_pack("{s:s, s:I, s:I, s:I, s:I, s:I}", "class",
                                                cl[k].name, "tensors", (json_int_t)cl[k].tensors,
                                                "transfers", (json_int_t)cl[k].transfers,
                                                "bytes", (json_int_t)cl[k].bytes,
                                                "direct_bytes", (json_int_t)cl[k].direct_bytes,
                                                "local_bytes", (json_int_t)cl[k].local_bytes));
        json_object_set_new(jo, "classes", ja);
    } else {
        printf("\nper tensor class:\n  %-48s %8s %10s %12s %8s %8s\n", "class", "tensors",
               "transfers", "bytes", "direct", "local");
        for (size_t k = 0; k < ncl; k++) {
            double tot = cl[k].bytes ? (double)cl[k].bytes : 1.0;
            fmt_bytes((double)cl[k].bytes, b1, sizeof(b1));
            printf("  %-48s %8llu %10llu %12s %7.1f%% %7.1f%%\n", cl[k].name,
                   (unsigned long long)cl[k].tensors, (unsigned long long)cl[k].transfers, b1,
                   100.0 * (double)cl[k].direct_bytes / tot,
                   100.0 * (double)cl[k].local_bytes / tot);
        }
    }
    for (int side = 0; side < 2; side++) {
        size_t n = 0;
        const char *what = side ? "receivers" : "senders";
        for (uint32_t e = 0; e < ne; e++) {
            if ((int)rf_inv_endpoint(inv, e)->side != side)
                continue;
            ep[n].key = e;
            ep[n++].val = side ? rf_plan_recv_bytes(pl, e) : rf_plan_sent_bytes(pl, e);
        }
        qsort(ep, n, sizeof(*ep), cmp_val_desc);
        if (jo) {
            ja = json_array();
            for (size_t i = 0; i < n && i < TOP_N; i++)
                json_array_append_new(ja, json_pack("{s:I, s:I, s:I, s:I}", "endpoint",
                                                    (json_int_t)ep[i].key, "node",
                                                    (json_int_t)rf_inv_endpoint(inv, (uint32_t)ep[i].key)->node,
                                                    "bytes", (json_int_t)ep[i].val,
                                                    "local_bytes",
                                                    (json_int_t)rf_plan_path_bytes(pl, (uint32_t)ep[i].key,
                                                                                   RF_PLAN_LOCAL)));
            json_object_set_new(jo, side ? "top_receivers" : "top_senders", ja);
        } else {
            printf("\ntop %s:\n", what);
            for (size_t i = 0; i < n && i < TOP_N; i++) {
                uint32_t e = (uint32_t)ep[i].key;
                fmt_bytes((double)ep[i].val, b1, sizeof(b1));
                fmt_bytes((double)rf_plan_path_bytes(pl, e, RF_PLAN_LOCAL), b2, sizeof(b2));
                printf("  endpoint %-6u node %-5u %12s  %.3f s", e, rf_inv_endpoint(inv, e)->node,
                       b1, ep_seconds(pl, e, bps, lbps));
                if (rf_plan_stats_get(pl)->local_bytes)
                    printf("  (local %s)", b2);
                printf("\n");
            }
        }
    }
    if (jo) {
        ja = json_array();
        for (size_t i = 0; i < nlinks && i < TOP_N; i++)
            json_array_append_new(ja, json_pack("{s:I, s:I, s:I}", "src_node",
                                                (json_int_t)(links[i].key >> 32), "dst_node",
                                                (json_int_t)(links[i].key & 0xffffffffu), "bytes",
                                                (json_int_t)links[i].val));
        json_object_set_new(jo, "top_links", ja);
    } else {
        printf("\ntop links (source node -> destination node):\n");
        for (size_t i = 0; i < nlinks && i < TOP_N; i++) {
            fmt_bytes((double)links[i].val, b2, sizeof(b2));
            printf("  %5llu -> %-5llu %12s\n", (unsigned long long)(links[i].key >> 32),
                   (unsigned long long)(links[i].key & 0xffffffffu), b2);
        }
    }
out:
    free(cls);
    free(cl);
    free(ep);
    free(links);
    return rc;
}

/* --colocate: trainer rank r and engine rank r (of the first `colocate` engine ranks, -1 all)
 * on machine r / gpus_per_node. The inventory holds each side's ranks in order. */
static int place_hosts(rf_inv *inv, const plan_args *a, rf_err *err)
{
    uint32_t rank[2] = {0, 0};
    int rc = 0;

    for (uint32_t e = 0; e < rf_inv_nendpoints(inv) && rc == 0; e++) {
        rf_side side = rf_inv_endpoint(inv, e)->side;
        uint32_t r = rank[side]++;
        bool on = side == RF_SRC || a->colocate < 0 || r < (uint32_t)a->colocate;

        rc = rf_inv_set_endpoint_host(inv, e, on ? r / (uint32_t)a->gpus_per_node : RF_HOST_NONE,
                                      err);
    }
    return rc;
}

int rf_ctl_plan(int argc, char **argv)
{
    plan_args a;
    rf_model *m = NULL;
    rf_inv *inv = NULL;
    rf_plan *pl = NULL;
    rf_par ps, pd;
    rf_plan_opts o;
    rf_err err;
    json_t *jo = NULL;
    double t0, t1, bps, lbps, pred = 0, pred_net = 0, pred_local = 0, ratio;
    rf_plan_time tm;
    char id[RF_PLAN_ID_HEX] = "", b1[32], b2[32], b3[32];
    uint32_t fp8_pieces = 0;
    int rc;

    rf_err_clear(&err);
    rc = parse_args(argc, argv, &a);
    if (rc >= 0)
        return rc;
    rc = 2;
    if (rf_model_load(a.model, &m, &err) < 0) {
        fprintf(stderr, "refitctl plan: %s\n", err.msg);
        goto out;
    }
    if (rf_par_parse(a.src, RF_SRC, m, &ps, &err) < 0 ||
        rf_par_parse(a.dst, RF_DST, m, &pd, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        goto out;
    }
    inv = rf_inv_new();
    if (inv == NULL || rf_model_build_inv(m, &ps, &pd, a.gpus_per_node, inv, &err) < 0) {
        fprintf(stderr, "refitctl plan: %s\n", inv ? err.msg : "out of memory");
        rc = 1;
        goto out;
    }
    if (a.colocate && place_hosts(inv, &a, &err) < 0) {
        fprintf(stderr, "refitctl plan: placing endpoints on machines: %s\n", err.msg);
        rc = 1;
        goto out;
    }
    if (a.fp8) {
        rf_quant_fmt qf;
        rf_inv *q8 = NULL;

        if (rf_quant_fmt_parse(a.fp8, &qf, &err) < 0) {
            fprintf(stderr, "refitctl plan: --fp8: %s\n", err.msg);
            goto out;
        }
        if (rf_quant_inv_fp8(inv, &qf, &q8, &fp8_pieces, &err) < 0) {
            fprintf(stderr, "refitctl plan: --fp8 %s: %s\n", a.fp8, err.msg);
            rc = 1;
            goto out;
        }
        rf_inv_free(inv);
        inv = q8;
    }
    rf_plan_opts_default(&o);
    o.staging_bytes = (uint64_t)(a.staging_mib * 1024 * 1024);
    o.direct_min_bytes = (uint64_t)(a.direct_min_mib * 1024 * 1024);
    o.relay = (uint32_t)a.relay;
    t0 = now();
    if (rf_plan_build(inv, &o, &pl, &err) < 0) {
        rc = err.code == -EINVAL && strncmp(err.msg, "plan: staging", 13) == 0 ? 2 : 1;
        if (a.json) {
            jo = json_pack("{s:b, s:s}", "covered", 0, "error", err.msg);
            json_dumpf(jo, stdout, JSON_COMPACT);
            printf("\n");
        }
        fprintf(stderr, "refitctl plan: %s\n", err.msg);
        goto out;
    }
    t1 = now();
    bps = a.link_gbps * 1e9 / 8;
    lbps = a.local_gbps * 1e9 / 8;
    /* Network bytes per GPU over its link; local copies at the local bandwidth out of each
     * trainer GPU and into each engine GPU, beside the network (plan.h, rf_plan_predict). */
    rf_plan_predict(pl, bps, lbps, &tm);
    pred_net = tm.network_s;
    pred_local = tm.local_s;
    pred = tm.predicted_s;
    ratio = tm.floor_s > 0 ? pred / tm.floor_s : 0;
    rf_plan_id_hex(pl, id);
    const rf_plan_stats *st = rf_plan_stats_get(pl);
    double simb = st->mean_sender_bytes > 0 ? (double)st->max_sender_bytes / st->mean_sender_bytes : 0;
    double rimb = st->mean_receiver_bytes > 0 ? (double)st->max_receiver_bytes / st->mean_receiver_bytes : 0;
    if (a.json) {
        jo = json_object();
        json_object_set_new(jo, "model", json_string(rf_model_name(m)));
        json_object_set_new(jo, "src", json_string(a.src));
        json_object_set_new(jo, "dst", json_string(a.dst));
        json_object_set_new(jo, "covered", json_true());
        json_object_set_new(jo, "plan_id", json_string(id));
#define JI(k, v) json_object_set_new(jo, k, json_integer((json_int_t)(v)))
#define JR(k, v) json_object_set_new(jo, k, json_real(v))
        JI("tensors", st->tensors);
        JI("src_pieces", st->src_pieces);
        JI("dst_pieces", st->dst_pieces);
        JI("transfers", st->transfers);
        JI("direct_transfers", st->direct_transfers);
        JI("packed_transfers", st->packed_transfers);
        JI("messages", st->messages);
        JI("rounds", st->rounds);
        JI("dst_bytes", st->dst_bytes);
        JI("direct_bytes", st->direct_bytes);
        JI("packed_bytes", st->packed_bytes);
        JI("local_transfers", st->local_transfers);
        JI("local_bytes", st->local_bytes);
        JI("local_messages", st->local_messages);
        JI("fp8_pieces", fp8_pieces);
        JI("quant_transfers", st->quant_transfers);
        JI("quant_bytes", st->quant_bytes);
        JI("fp8_copy_transfers", st->fp8_copy_transfers);
        JI("fp8_copy_bytes", st->fp8_copy_bytes);
        JI("recv_quant_transfers", st->recv_quant_transfers);
        JI("recv_quant_bytes", st->recv_quant_bytes);
        JI("colocated_engines", a.colocate < 0 ? rf_par_world(&pd, RF_DST)
                                : a.colocate < rf_par_world(&pd, RF_DST) ? a.colocate
                                : rf_par_world(&pd, RF_DST));
        JI("runs", st->runs);
        JI("max_sender_bytes", st->max_sender_bytes);
        JR("mean_sender_bytes", st->mean_sender_bytes);
        JI("max_receiver_bytes", st->max_receiver_bytes);
        JR("mean_receiver_bytes", st->mean_receiver_bytes);
        JI("max_link_bytes", st->max_link_bytes);
        JI("max_staging_bytes", st->max_staging_bytes);
        JR("sender_imbalance", simb);
        JR("receiver_imbalance", rimb);
        JR("link_gbps", a.link_gbps);
        JI("staging_bytes", o.staging_bytes);
        JR("local_gbps", a.local_gbps);
        JR("predicted_seconds", pred);
        JR("predicted_network_seconds", pred_net);
        JR("predicted_local_seconds", pred_local);
        JR("predicted_fill_seconds", tm.fill_s);
        JR("floor_seconds", tm.floor_s);
        JR("predicted_over_floor", ratio);
        json_object_set_new(jo, "relay", json_boolean(a.relay));
        JI("source_bytes", st->source_bytes);
        JI("relay_bytes", st->relay_bytes);
        JI("relay_transfers", st->relay_transfers);
        JI("relay_messages", st->relay_messages);
        JI("relay_depth", st->relay_depth);
        JI("max_relay_sender_bytes", st->max_relay_sender_bytes);
        JR("plan_seconds", t1 - t0);
        JI("plan_memory_bytes", rf_plan_memory(pl));
        JI("inventory_memory_bytes", rf_inv_memory(inv));
        JI("peak_rss_bytes", (uint64_t)peak_rss_bytes());
#undef JI
#undef JR
        if (a.explain && explain(pl, bps, lbps, a.relay, jo) < 0) {
            rc = 1;
            goto out;
        }
        json_dumpf(jo, stdout, JSON_COMPACT);
        printf("\n");
        rc = 0;
        goto out;
    }
    printf("model        %s (%u tensors, ", rf_model_name(m), st->tensors);
    fmt_bytes((double)rf_model_bytes(m), b1, sizeof(b1));
    printf("%s)\n", b1);
    printf("layouts      trainer %s (%d GPUs) -> engine %s (%d GPUs), %d GPUs per node\n", a.src,
           rf_par_world(&ps, RF_SRC), a.dst, rf_par_world(&pd, RF_DST), a.gpus_per_node);
    if (a.colocate < 0)
        printf("colocated    every engine rank on its trainer rank's machine\n");
    else if (a.colocate > 0)
        printf("colocated    engine ranks 0..%d on their trainer ranks' machines, the rest "
               "elsewhere\n", a.colocate - 1);
    printf("pieces       %llu source, %llu destination\n", (unsigned long long)st->src_pieces,
           (unsigned long long)st->dst_pieces);
    if (a.fp8) {
        fmt_bytes((double)st->quant_bytes, b1, sizeof(b1));
        printf("fp8          %u engine pieces in %s; %llu transfers, %s of FP8 elements and "
               "scales, quantized by their senders\n", fp8_pieces, a.fp8,
               (unsigned long long)st->quant_transfers, b1);
        fmt_bytes((double)st->recv_quant_bytes, b1, sizeof(b1));
        printf("             %llu transfers cut off the grid by the trainers' shards, %s in the "
               "tensors' dtype, quantized by their receivers\n",
               (unsigned long long)st->recv_quant_transfers, b1);
    }
    fmt_bytes((double)st->direct_bytes, b1, sizeof(b1));
    fmt_bytes((double)st->packed_bytes, b2, sizeof(b2));
    fmt_bytes((double)st->dst_bytes, b3, sizeof(b3));
    printf("transfers    %llu (%llu direct, %s; %llu packed, %s", (unsigned long long)st->transfers,
           (unsigned long long)st->direct_transfers, b1, (unsigned long long)st->packed_transfers,
           b2);
    if (st->local_transfers) {
        fmt_bytes((double)st->local_bytes, b1, sizeof(b1));
        printf("; %llu local, %s", (unsigned long long)st->local_transfers, b1);
    }
    printf("), %s in all\n", b3);
    printf("messages     %llu in %llu rounds", (unsigned long long)st->messages,
           (unsigned long long)st->rounds);
    if (st->local_messages)
        printf(" (%llu local, all in round 0)", (unsigned long long)st->local_messages);
    printf("; memory runs %llu\n", (unsigned long long)st->runs);
    fmt_bytes((double)st->max_sender_bytes, b1, sizeof(b1));
    fmt_bytes(st->mean_sender_bytes, b2, sizeof(b2));
    printf("per sender   max %s, mean %s, imbalance %.3f\n", b1, b2, simb);
    fmt_bytes((double)st->max_receiver_bytes, b1, sizeof(b1));
    fmt_bytes(st->mean_receiver_bytes, b2, sizeof(b2));
    printf("per receiver max %s, mean %s, imbalance %.3f\n", b1, b2, rimb);
    fmt_bytes((double)st->max_link_bytes, b1, sizeof(b1));
    fmt_bytes((double)st->max_staging_bytes, b2, sizeof(b2));
    printf("per link     max %s; staging per GPU and round max %s (budget %.0f MiB)\n", b1, b2,
           a.staging_mib);
    fmt_bytes(peak_rss_bytes(), b1, sizeof(b1));
    printf("plan build   %.3f s, peak memory %s\n", t1 - t0, b1);
    if (st->local_bytes) {
        printf("predicted    %.3f s: network %.3f s at %g Gbit/s per GPU, local copies %.3f s "
               "at %g Gbit/s", pred, pred_net, a.link_gbps, pred_local, a.local_gbps);
        if (tm.fill_s > 0)
            printf(", then the relay pipeline's fill %.3f s", tm.fill_s);
        printf("\n");
    } else if (tm.fill_s > 0) {
        printf("predicted    %.3f s at %g Gbit/s per GPU (pipeline fill %.3f s included)\n",
               pred, a.link_gbps, tm.fill_s);
    } else {
        printf("predicted    %.3f s at %g Gbit/s per GPU\n", pred, a.link_gbps);
    }
    printf("floor        %.3f s: the most one engine GPU takes in over its link; predicted / "
           "floor %.2f\n", tm.floor_s, ratio);
    if (a.relay) {
        fmt_bytes((double)st->source_bytes, b1, sizeof(b1));
        fmt_bytes((double)st->relay_bytes, b2, sizeof(b2));
        fmt_bytes((double)st->max_relay_sender_bytes, b3, sizeof(b3));
        printf("relays       trainers send %s, engines relay %s (max %s one GPU), depth %u\n",
               b1, b2, b3, st->relay_depth);
    }
    printf("plan id      %s\n", id);
    if (a.explain && explain(pl, bps, lbps, a.relay, NULL) < 0) {
        rc = 1;
        goto out;
    }
    rc = 0;
out:
    json_decref(jo);
    rf_plan_free(pl);
    rf_inv_free(inv);
    rf_model_free(m);
    return rc;
}
