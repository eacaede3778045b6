/* common/control/registry.c - the daemon side of the local RPC: clients, their regions and pieces,
 * the local inventory, the version handshakes with trainers, engines and refitctl, and the
 * export of the trainers' memory to a receiverd on the same host. */
#define RF_LOG_MODULE "registry"
#include "registry.h"

#include <assert.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "export.h"
#include "log.h"
#include "quant_fmt.h"
#include "refit.pb-c.h"
#include "rpc.h"
#include "slice.h"
#include "version.h"

#define DEVICE_MAX 128
#define CLIENT_NAME_MAX 128

typedef enum wait_kind { WAIT_RELEASED, WAIT_VERSION, WAIT_CTL } wait_kind;

/* A region keeps what its client said about it (kind, offset, handle bytes) and, for the kinds
 * that travel as a descriptor, the received fd itself: a same-host receiverd is handed the
 * region exactly as the trainer registered it (rf_registry exports, the region owns the fd). */
typedef struct reg_region {
    char device[DEVICE_MAX];
    rf_mem_ref *ref;
    uint64_t size;
    rf_mem_kind kind;
    uint64_t offset;
    uint8_t *handle;     /* malloc'd copy of the handle bytes, NULL when none */
    size_t handle_len;
    int fd;              /* memfd, cuda_vmm_fd: the received descriptor; -1 for cuda_ipc and
                            for a region with chunks */
    bool fd_shared;      /* fd is an earlier region's of the same client (one memfd) */
    rf_mem_chunk *chunks; /* cuda_vmm_fd over several allocations: each with its received fd,
                             owned; NULL when none */
    uint32_t nchunks;
    uint64_t vmm_base;   /* cuda_vmm_fd: where its client maps the allocation (0: not said) */
    uint64_t owner;      /* its client's uid, named in the export beside vmm_base */
    uint32_t inv_id;     /* in the live inventory */
    uint32_t scratch_id; /* in the seal check's scratch inventory */
    bool inproc;         /* MEM_INPROC: not mapped here (ref NULL); its engine installs */
} reg_region;

typedef struct reg_piece {
    char *tensor;
    rf_dtype dtype;
    int ndim;
    int64_t shape[RF_MAX_DIMS];
    uint32_t region; /* client-local */
    uint64_t offset;
    rf_box box;
    int64_t strides[RF_MAX_DIMS];
    bool fp8;          /* stored as FP8 with the scales of q (scale_region client-local) */
    rf_quant_decl q;
} reg_piece;

typedef struct reg_waiter {
    uint64_t id, version;
    wait_kind kind;
} reg_waiter;

typedef struct reg_client {
    rf_registry *reg;
    rf_rpc_conn *conn;
    struct reg_client *prev, *next;
    bool hello, sealed;
    int kind; /* Refit__Rpc__ClientKind */
    char name[CLIENT_NAME_MAX];
    int rank, pid;
    reg_region *regions;
    uint32_t nregions, cap_regions;
    reg_piece *pieces;
    uint32_t npieces, cap_pieces;
    uint64_t published; /* trainers: the last version published (versions only increase) */
    uint64_t offered;   /* trainers: the version their memory holds for a refit; 0 after an
                           abort or release of it, until they publish again */
    bool gated;        /* engines: installs wait for Consumed */
    uint64_t consumed; /* gated engines: last version they are done with */
    reg_waiter *waiters;
    size_t nwaiters, cap_waiters;
    /* The memfd of the client's last memfd region: the regions of one memfd (a trainer's one
     * allocation holding every tensor) share one kept fd, so the daemon holds one fd per
     * object, not per region. VMM fds cannot be told apart (every exported fd reports the
     * same inode): each keeps its own. */
    dev_t memfd_dev;
    ino_t memfd_ino;
    int memfd_fd;       /* -1: none yet */
    /* peers: the server nonce of the last ExportHello, good for one Export */
    uint8_t nonce[RF_EXPORT_NONCE_BYTES];
    bool has_nonce;
    /* In-process install: an engine with MEM_INPROC regions gets a token at Seal, which its
     * installer connection (a CLIENT_INSTALLER of the same process) presents to attach. */
    uint64_t uid;                 /* unique in this registry, never 0 */
    uint64_t mem_owner;           /* its rf_mem_desc.owner: its VMM regions share mappings */
    uint8_t token[RF_REGISTRY_TOKEN_BYTES];
    bool has_token;
    struct reg_client *installer; /* engine: its attached installer */
    struct reg_client *engine;    /* installer: the engine it installs for */
} reg_client;

struct rf_registry {
    uv_loop_t *loop;
    rf_rpc_server *srv;
    rf_side side;
    unsigned expected;
    uint32_t node;
    rf_registry_cb cb;
    void *ud;
    rf_mem_cache *mem;
    reg_client *clients;
    rf_inv *inv;
    char (*ep_device)[DEVICE_MAX]; /* per inventory endpoint */
    uint64_t *ep_owner;            /* per inventory endpoint: the engine uid whose in-process
                                      regions it holds, 0 for shared memory */
    uint32_t cap_owner;
    uint64_t next_uid;
    uint32_t cap_ep;
    rf_mem_ref **region_ref;       /* per inventory region */
    uint32_t cap_region;
    uint64_t generation, ready, released, committed;
    char abort_msg[768]; /* trainers: why the last abort took their publishes back */
    char blocked[768];   /* why the cluster can refit nothing now ("": it can) */
    bool complete, closing;
    /* While the data path runs, memory of clients that leave stays mapped until it ends. */
    bool held;
    rf_mem_ref **deferred;
    uint32_t ndeferred, cap_deferred;
    uint64_t consumed; /* last value reported through on_consumed */
    bool gpu_only;     /* the transport moves GPU memory (nccl), else host memory (tcp) */
    uint8_t *export_key; /* the cluster key, NULL: same-host export off */
    size_t export_key_len;
};

static const char *kind_name(int kind)
{
    switch (kind) {
    case REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER: return "trainer";
    case REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE: return "engine";
    case REFIT__RPC__CLIENT_KIND__CLIENT_CTL: return "ctl";
    case REFIT__RPC__CLIENT_KIND__CLIENT_PEER: return "peer";
    case REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER: return "installer";
    default: return "unknown";
    }
}

/* Trainers and engines: the clients that hold memory and count against expected_clients. */
static bool is_data(const reg_client *c)
{
    return c->hello && (c->kind == REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER ||
                        c->kind == REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE);
}

static int grow(void **p, uint32_t *cap, uint32_t need, size_t elem)
{
    uint32_t n = *cap ? *cap : 8;
    void *np;

    if (need <= *cap)
        return 0;
    while (n < need)
        n *= 2;
    np = realloc(*p, (size_t)n * elem);
    if (np == NULL)
        return -ENOMEM;
    *p = np;
    *cap = n;
    return 0;
}

/* Adds a region of client owner to inv. The live inventory has one endpoint per device
 * string for shared memory, and one per device and engine for in-process regions (a local
 * message into one is then that engine's alone); it records the region's mapping. A scratch
 * inventory (the seal check) holds one client: an endpoint per device of its regions. */
static int add_region(rf_registry *r, rf_inv *inv, const reg_client *owner, reg_region *rg,
                      bool live, rf_err *err)
{
    uint32_t nep = rf_inv_nendpoints(inv), ep = nep, id;
    uint64_t who = rg->inproc ? owner->uid : 0;
    int rc;

    if (live) {
        for (ep = 0; ep < nep; ep++)
            if (strcmp(r->ep_device[ep], rg->device) == 0 && r->ep_owner[ep] == who)
                break;
    } else {
        /* The client's earlier regions on the same device share the endpoint here too (an
         * FP8 piece's scales must lie on its GPU). */
        for (const reg_region *o = owner->regions; o < rg && ep == nep; o++)
            if (strcmp(o->device, rg->device) == 0 && o->inproc == rg->inproc)
                ep = rf_inv_region(inv, o->scratch_id)->endpoint;
    }
    if (ep == nep) {
        rc = rf_inv_add_endpoint(inv, r->side, r->node, &ep, err);
        if (rc < 0)
            return rc;
        if (live) {
            if (grow((void **)&r->ep_device, &r->cap_ep, ep + 1, DEVICE_MAX) < 0 ||
                grow((void **)&r->ep_owner, &r->cap_owner, ep + 1, sizeof(uint64_t)) < 0)
                return rf_err_set(err, -ENOMEM, "out of memory adding an endpoint");
            memcpy(r->ep_device[ep], rg->device, DEVICE_MAX);
            r->ep_owner[ep] = who;
        }
    }
    rc = rf_inv_add_region(inv, ep, rg->size, &id, err);
    if (rc < 0)
        return rc;
    if (live) {
        if (grow((void **)&r->region_ref, &r->cap_region, id + 1, sizeof(rf_mem_ref *)) < 0)
            return rf_err_set(err, -ENOMEM, "out of memory adding a region");
        r->region_ref[id] = rg->ref;
        rg->inv_id = id;
    } else {
        rg->scratch_id = id;
    }
    return 0;
}

static int add_piece(rf_inv *inv, const reg_client *c, const reg_piece *rp, bool live,
                     rf_err *err)
{
    const reg_region *rg = &c->regions[rp->region];
    uint32_t t, id;
    rf_piece p;
    int rc;

    rc = rf_inv_add_tensor(inv, rp->tensor, rp->dtype, rp->ndim, rp->shape, &t, err);
    if (rc < 0)
        return rc;
    memset(&p, 0, sizeof(p));
    p.tensor = t;
    p.region = live ? rg->inv_id : rg->scratch_id;
    p.offset = rp->offset;
    p.box = rp->box;
    memcpy(p.strides, rp->strides, sizeof(p.strides));
    if (rp->fp8) {
        const reg_region *sg = &c->regions[rp->q.scale_region];
        rf_quant_decl q = rp->q;

        q.scale_region = live ? sg->inv_id : sg->scratch_id;
        if ((rc = rf_inv_add_quant(inv, &q, &p.quant, err)) < 0)
            return rc;
    }
    return rf_inv_add_piece(inv, &p, &id, err);
}

static int inv_add_client(rf_registry *r, rf_inv *inv, reg_client *c, bool live, rf_err *err)
{
    uint32_t i;
    int rc;

    for (i = 0; i < c->nregions; i++) {
        rc = add_region(r, inv, c, &c->regions[i], live, err);
        if (rc < 0)
            return rc;
    }
    for (i = 0; i < c->npieces; i++) {
        rc = add_piece(inv, c, &c->pieces[i], live, err);
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* Builds the live inventory again from every client's registrations (after one left or had
 * its pieces dropped). They were all valid together before, so only memory can fail. */
static int rebuild(rf_registry *r, rf_err *err)
{
    rf_inv *inv = rf_inv_new();
    reg_client *c;
    int rc = 0;

    if (r->inv)
        rf_inv_free(r->inv);
    r->inv = inv;
    if (inv == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory rebuilding the local inventory");
    for (c = r->clients; c != NULL; c = c->next) {
        rc = inv_add_client(r, inv, c, true, err);
        if (rc < 0)
            break;
    }
    r->generation++;
    return rc;
}

static unsigned count_data(const rf_registry *r, bool sealed_only)
{
    const reg_client *c;
    unsigned n = 0;

    /* An engine with in-process regions counts as sealed once its installer is attached:
     * no plan is made for memory nobody can write. */
    for (c = r->clients; c != NULL; c = c->next)
        if (is_data(c) && (!sealed_only || (c->sealed && (!c->has_token || c->installer))))
            n++;
    return n;
}

static void check_complete(rf_registry *r)
{
    if (r->complete || r->closing || count_data(r, true) != r->expected)
        return;
    r->complete = true;
    if (r->cb.on_inventory)
        r->cb.on_inventory(r, r->ud);
}

static void changed(rf_registry *r)
{
    r->complete = false;
    if (!r->closing && r->cb.on_change)
        r->cb.on_change(r, r->ud);
}

/* Trainers: the version a refit may read from this daemon's memory: every expected client is
 * here, sealed, and offers that same version, not released yet. 0 otherwise: a client is
 * missing or re-registering (its successor has published nothing), the clients offer different
 * versions (one has moved on), or an abort took the offer back. */
static uint64_t ready_version(const rf_registry *r)
{
    const reg_client *c;
    uint64_t v = 0;

    if (r->side != RF_SRC || r->expected == 0 || count_data(r, true) != r->expected)
        return 0;
    for (c = r->clients; c != NULL; c = c->next) {
        if (!is_data(c))
            continue;
        if (c->offered == 0 || (v != 0 && c->offered != v))
            return 0;
        v = c->offered;
    }
    return v > r->released ? v : 0;
}

/* Readiness belongs to the clients that published it: recomputed at every change of them or
 * of their offers, and reported whenever it changes, to 0 included. */
static void check_ready(rf_registry *r)
{
    uint64_t v = ready_version(r);

    if (v == r->ready)
        return;
    r->ready = v;
    if (!r->closing && r->cb.on_ready)
        r->cb.on_ready(r, v, r->ud);
}

static void reply_version(reg_client *c, uint64_t id, uint64_t version)
{
    Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;

    resp.id = id;
    resp.version = version;
    rf_rpc_conn_send(c->conn, &resp);
}

static int add_waiter(reg_client *c, uint64_t id, uint64_t version, wait_kind kind)
{
    if (c->nwaiters == c->cap_waiters) {
        size_t n = c->cap_waiters ? c->cap_waiters * 2 : 4;
        reg_waiter *w = realloc(c->waiters, n * sizeof(*w));

        if (w == NULL)
            return -ENOMEM;
        c->waiters = w;
        c->cap_waiters = n;
    }
    c->waiters[c->nwaiters++] = (reg_waiter){id, version, kind};
    return 0;
}

/* Answers the waiters of the given kinds whose version is in (lo, hi]: with the version hi
 * when code is 0, else with the error. */
static void answer_waiters(rf_registry *r, unsigned kinds, uint64_t lo, uint64_t hi, int code,
                           const char *msg)
{
    reg_client *c;
    size_t i, j;

    for (c = r->clients; c != NULL; c = c->next) {
        for (i = 0, j = 0; i < c->nwaiters; i++) {
            reg_waiter w = c->waiters[i];

            if ((kinds & (1u << w.kind)) && w.version > lo && w.version <= hi) {
                if (code == 0)
                    reply_version(c, w.id, hi);
                else
                    rf_rpc_conn_reply(c->conn, w.id, code, "%s", msg);
            } else {
                c->waiters[j++] = w;
            }
        }
        c->nwaiters = j;
    }
}

/* A waiter of c for a version the cluster cannot refit now is answered -EAGAIN with the
 * cluster's reason. */
static void reply_blocked(rf_registry *r, reg_client *c, uint64_t id, uint64_t version)
{
    rf_rpc_conn_reply(c->conn, id, -EAGAIN, "version %" PRIu64 " cannot be refitted now: %s",
                      version, r->blocked);
}

static void check_consumed(rf_registry *r);

static void release_ref(rf_registry *r, rf_mem_ref *ref)
{
    if (ref == NULL)
        return;
    if (r->held && grow((void **)&r->deferred, &r->cap_deferred, r->ndeferred + 1,
                        sizeof(*r->deferred)) == 0) {
        r->deferred[r->ndeferred++] = ref;
        return;
    }
    /* Out of memory while held: nothing better than releasing now; the data path then
     * fails on the unmapped memory only if it still touches this client's regions. */
    rf_mem_release(r->mem, ref);
}

static void client_free(reg_client *c)
{
    uint32_t i;

    for (i = 0; i < c->nregions; i++) {
        release_ref(c->reg, c->regions[i].ref);
        /* The mapping may stay (held), the descriptor need not: a receiverd that fetched it
         * holds its own copy. */
        if (c->regions[i].fd >= 0 && !c->regions[i].fd_shared)
            close(c->regions[i].fd);
        for (uint32_t k = 0; k < c->regions[i].nchunks; k++)
            close(c->regions[i].chunks[k].fd);
        free(c->regions[i].chunks);
        free(c->regions[i].handle);
    }
    for (i = 0; i < c->npieces; i++)
        free(c->pieces[i].tensor);
    free(c->regions);
    free(c->pieces);
    free(c->waiters);
    free(c);
}

static void drop_pieces(reg_client *c)
{
    uint32_t i;

    for (i = 0; i < c->npieces; i++)
        free(c->pieces[i].tensor);
    c->npieces = 0;
}

static void on_connect(rf_rpc_conn *conn, void *ud)
{
    rf_registry *r = ud;
    reg_client *c = calloc(1, sizeof(*c));

    if (c == NULL) {
        rf_rpc_conn_reply(conn, 0, -ENOMEM, "daemon out of memory: closing the connection");
        rf_rpc_conn_close(conn);
        return;
    }
    c->reg = r;
    c->conn = conn;
    c->memfd_fd = -1;
    c->uid = ++r->next_uid;
    c->mem_owner = rf_mem_owner_new();
    c->next = r->clients;
    if (r->clients)
        r->clients->prev = c;
    r->clients = c;
    rf_rpc_conn_set_data(conn, c);
}

static void on_close(rf_rpc_conn *conn, void *ud)
{
    rf_registry *r = ud;
    reg_client *c = rf_rpc_conn_data(conn);
    bool data, had;
    rf_err err;

    if (c == NULL)
        return;
    data = is_data(c);
    had = c->nregions > 0 || c->npieces > 0;
    if (c->engine || c->installer) {
        reg_client *e = c->engine ? c->engine : c;
        char why[384];

        snprintf(why, sizeof(why), "the %s of engine '%s' (rank %d, pid %d) %s", c->engine ?
                 "in-process installer" : "process", e->name, e->rank, e->pid, c->engine ?
                 "closed its connection" : "left");
        bool engine_stays = c->engine != NULL;

        if (c->engine)
            c->engine->installer = NULL;
        else
            c->installer->engine = NULL;
        c->engine = c->installer = NULL;
        if (r->cb.on_install_lost && !r->closing)
            r->cb.on_install_lost(r, e->uid, why, r->ud);
        /* An engine without its installer cannot be written: incomplete until one attaches. */
        if (engine_stays) {
            r->generation++;
            changed(r);
        }
    }
    if (c->prev)
        c->prev->next = c->next;
    else
        r->clients = c->next;
    if (c->next)
        c->next->prev = c->prev;
    /* The inventory must stop naming the client's regions before they are unmapped. */
    if (had && rebuild(r, &err) < 0)
        fprintf(stderr, "registry: %s\n", err.msg);
    client_free(c);
    /* Readiness first: the inventory change that follows is reported with it already gone. */
    check_ready(r);
    if (data)
        changed(r);
    check_consumed(r);
}

static void do_hello(rf_registry *r, reg_client *c, uint64_t id, const Refit__Rpc__Hello *h)
{
    const reg_client *o;
    bool want_trainer = r->side == RF_SRC;

    if (c->hello) {
        rf_rpc_conn_reply(c->conn, id, -EISCONN, "Hello sent twice on one connection");
        return;
    }
    if (h->protocol_version != RF_RPC_PROTOCOL_VERSION) {
        rf_rpc_conn_reply(c->conn, id, -EPROTONOSUPPORT, "client speaks protocol version %u, "
                          "this daemon %d: use a librefit of the daemon's release",
                          h->protocol_version, RF_RPC_PROTOCOL_VERSION);
        return;
    }
    if (h->kind != REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER &&
        h->kind != REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE &&
        h->kind != REFIT__RPC__CLIENT_KIND__CLIENT_CTL &&
        h->kind != REFIT__RPC__CLIENT_KIND__CLIENT_PEER &&
        h->kind != REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "unknown client kind %d (trainer, engine, "
                          "ctl, peer or installer)", (int)h->kind);
        return;
    }
    if (h->kind == REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER && r->side != RF_DST) {
        rf_rpc_conn_reply(c->conn, id, -EOPNOTSUPP, "installer client connected to the "
                          "publisher daemon: installers serve engines, on refit-receiverd");
        return;
    }
    /* Only trainers' memory is exported: a receiverd asking another receiverd has the wrong
     * socket, and hears so before it proves anything. */
    if (h->kind == REFIT__RPC__CLIENT_KIND__CLIENT_PEER && r->side != RF_SRC) {
        rf_rpc_conn_reply(c->conn, id, -EOPNOTSUPP, "peer client connected to the receiver "
                          "daemon: exported trainer memory comes from refit-publisherd's "
                          "socket (its local_sock)");
        return;
    }
    if (h->kind == REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER ||
        h->kind == REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE) {
        if ((h->kind == REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER) != want_trainer) {
            rf_rpc_conn_reply(c->conn, id, -EINVAL, "%s client connected to the %s daemon: "
                              "trainers connect to refit-publisherd, engines to "
                              "refit-receiverd", kind_name(h->kind),
                              want_trainer ? "publisher" : "receiver");
            return;
        }
        if (h->rank < 0 || h->rank > RF_REGISTRY_MAX_RANK) {
            rf_rpc_conn_reply(c->conn, id, -EINVAL, "rank %d is outside 0..%d: give the "
                              "client's global rank", h->rank, RF_REGISTRY_MAX_RANK);
            return;
        }
        for (o = r->clients; o != NULL; o = o->next) {
            if (is_data(o) && o->rank == h->rank) {
                rf_rpc_conn_reply(c->conn, id, -EADDRINUSE, "rank %d is already connected "
                                  "(client '%s', pid %d)", h->rank, o->name, o->pid);
                return;
            }
        }
        if (count_data(r, false) >= r->expected) {
            rf_rpc_conn_reply(c->conn, id, -EUSERS, "this daemon expects %u %s clients and "
                              "all are connected: check the daemon's expected_clients",
                              r->expected, kind_name(h->kind));
            return;
        }
    }
    c->hello = true;
    c->kind = h->kind;
    c->rank = h->rank;
    c->pid = h->pid;
    /* A new engine has nothing to consume: its memory waits for the next commit. */
    c->consumed = r->committed;
    snprintf(c->name, sizeof(c->name), "%s", h->name && h->name[0] ? h->name : "unnamed");
    rf_rpc_conn_reply(c->conn, id, 0, "welcome");
}

uint64_t rf_registry_consumed(const rf_registry *r)
{
    const reg_client *c;
    uint64_t min = UINT64_MAX;

    for (c = r->clients; c != NULL; c = c->next)
        if (c->hello && c->gated && c->consumed < min)
            min = c->consumed;
    return min;
}

static void check_consumed(rf_registry *r)
{
    uint64_t now = rf_registry_consumed(r);

    if (now == r->consumed || r->closing)
        return;
    r->consumed = now;
    if (r->cb.on_consumed)
        r->cb.on_consumed(r, now, r->ud);
}

static void do_gate(rf_registry *r, reg_client *c, uint64_t id)
{
    if (c->kind != REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE) {
        rf_rpc_conn_reply(c->conn, id, -EPERM, "Gate is for engines, not %s clients",
                          kind_name(c->kind));
        return;
    }
    if (c->sealed) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "Gate after Seal: gate the client before "
                          "sealing, so no install can start before the gate holds");
        return;
    }
    c->gated = true;
    rf_rpc_conn_reply(c->conn, id, 0, "gated: installs wait for Consumed");
    check_consumed(r);
}

static void do_consumed(rf_registry *r, reg_client *c, uint64_t id, uint64_t version)
{
    if (!c->gated) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "Consumed from a client that is not gated: "
                          "send Gate before Seal");
        return;
    }
    if (version > r->committed || version < c->consumed) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "Consumed(%" PRIu64 ") outside [%" PRIu64
                          ", %" PRIu64 "]: only committed versions can be consumed, in order",
                          version, c->consumed, r->committed);
        return;
    }
    c->consumed = version;
    rf_rpc_conn_reply(c->conn, id, 0, "consumed");
    check_consumed(r);
}

void rf_registry_hold(rf_registry *r, bool hold)
{
    uint32_t i;

    r->held = hold;
    if (hold)
        return;
    for (i = 0; i < r->ndeferred; i++)
        rf_mem_release(r->mem, r->deferred[i]);
    r->ndeferred = 0;
}

static bool need_registering(reg_client *c, uint64_t id, const char *what)
{
    if (!is_data(c)) {
        rf_rpc_conn_reply(c->conn, id, -EPERM, "%s is for trainer and engine clients, not %s",
                          what, kind_name(c->kind));
        return false;
    }
    if (c->sealed) {
        rf_rpc_conn_reply(c->conn, id, -EBUSY, "%s after Seal: reconnect to register again",
                          what);
        return false;
    }
    return true;
}

/* A region over several VMM allocations: chunks back to back from 0, one fd each (fds[i],
 * moved into *out). 0 with *out NULL when the request has no chunks; a refusal is answered. */
static int region_chunks(reg_client *c, uint64_t id, const Refit__Rpc__RegisterRegion *m,
                         int *fds, size_t nfds, rf_mem_chunk **out)
{
    rf_mem_chunk *ch = NULL;
    uint64_t at = 0;
    size_t i;

    *out = NULL;
    if (m->n_chunks == 0)
        return 0;
    if (m->kind != REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "region %u: a %s region with %zu chunks: only "
                          "cuda_vmm_fd regions are made of several allocations", c->nregions,
                          rf_mem_kind_name((rf_mem_kind)m->kind), m->n_chunks);
        return -EINVAL;
    }
    if (m->n_chunks > RF_MEM_MAX_CHUNKS) {
        rf_rpc_conn_reply(c->conn, id, -E2BIG, "region %u on %s spans %zu allocations, more "
                          "than the %d one region may: register the range as several regions",
                          c->nregions, m->device, m->n_chunks, RF_MEM_MAX_CHUNKS);
        return -E2BIG;
    }
    for (i = 0; i < m->n_chunks; i++) {
        if (m->chunks[i]->offset != at || m->chunks[i]->size == 0 ||
            m->chunks[i]->size > UINT64_MAX - at) {
            rf_rpc_conn_reply(c->conn, id, -EINVAL, "region %u on %s: chunk %zu of %zu is "
                              "%" PRIu64 " bytes at offset %" PRIu64 ", expected a size > 0 "
                              "at offset %" PRIu64 ": chunks are the allocations mapped back "
                              "to back, in address order", c->nregions, m->device, i,
                              m->n_chunks, m->chunks[i]->size, m->chunks[i]->offset, at);
            return -EINVAL;
        }
        at += m->chunks[i]->size;
    }
    if (nfds < m->n_chunks || fds[m->n_chunks - 1] < 0) {
        size_t got = 0;

        while (got < nfds && fds[got] >= 0)
            got++;
        rf_rpc_conn_reply(c->conn, id, -EBADF, "region %u on %s: %zu chunks but %zu file "
                          "descriptors came with the request: send one fd of "
                          "cuMemExportToShareableHandle per chunk, in order (SCM_RIGHTS)",
                          c->nregions, m->device, m->n_chunks, got);
        return -EBADF;
    }
    ch = calloc(m->n_chunks, sizeof(*ch));
    if (ch == NULL) {
        rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory registering a region");
        return -ENOMEM;
    }
    for (i = 0; i < m->n_chunks; i++) {
        ch[i].size = m->chunks[i]->size;
        ch[i].fd = fds[i];
        fds[i] = -1;
    }
    *out = ch;
    return 0;
}

/* Appends a region to c and the live inventory and answers its id; rg's owned parts move
 * into c only on success (*rg is then cleared). */
static int add_client_region(rf_registry *r, reg_client *c, uint64_t id, reg_region *rg)
{
    Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;
    rf_err err = {0};
    int rc;

    if (grow((void **)&c->regions, &c->cap_regions, c->nregions + 1, sizeof(reg_region)) < 0) {
        rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory registering a region");
        return -ENOMEM;
    }
    rc = add_region(r, r->inv, c, rg, true, &err);
    if (rc < 0) {
        rebuild(r, NULL);
        rf_rpc_conn_reply(c->conn, id, rc, "region %u: %s", c->nregions, err.msg);
        return rc;
    }
    c->regions[c->nregions++] = *rg;
    memset(rg, 0, sizeof(*rg));
    rg->fd = -1;
    r->generation++;
    resp.id = id;
    resp.region = c->nregions - 1;
    rf_rpc_conn_send(c->conn, &resp);
    return 0;
}

/* MEM_INPROC: memory the daemon cannot map, which the engine's installer writes itself. */
static void do_region_inproc(rf_registry *r, reg_client *c, uint64_t id,
                             const Refit__Rpc__RegisterRegion *m)
{
    reg_region rg;

    if (r->side != RF_DST) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "in-process regions are for engines: a "
                          "trainer's memory must be shareable (a memfd, a CUDA IPC handle or "
                          "a VMM fd) for the daemons to read it");
        return;
    }
    if (m->size == 0 || m->n_chunks > 0 || m->ipc_handle.len > 0 || m->offset != 0) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "in-process region: give its size (> 0) "
                          "and nothing else (no handle, chunks or offset)");
        return;
    }
    if (r->gpu_only == (strcmp(m->device, "host") == 0)) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "in-process region on %s: this daemon's "
                          "transport moves %s memory only", m->device,
                          r->gpu_only ? "GPU" : "host");
        return;
    }
    memset(&rg, 0, sizeof(rg));
    rg.fd = -1;
    rg.inproc = true;
    rg.kind = (rf_mem_kind)REFIT__RPC__MEM_KIND__MEM_INPROC;
    rg.size = m->size;
    snprintf(rg.device, sizeof(rg.device), "%s", m->device);
    add_client_region(r, c, id, &rg);
}

static void do_region(rf_registry *r, reg_client *c, uint64_t id,
                      const Refit__Rpc__RegisterRegion *m, int *fds, size_t nfds)
{
    rf_mem_desc d = {0};
    rf_mem_ref *ref = NULL;
    rf_mem_chunk *chunks = NULL;
    size_t nchunks = 0;
    reg_region rg;
    uint8_t *handle = NULL;
    bool shared;
    struct stat st;
    rf_err err = {0};
    int rc, fd = nfds > 0 ? fds[0] : -1;

    if (!need_registering(c, id, "RegisterRegion"))
        goto out;
    if (m->device == NULL || m->device[0] == '\0' || strlen(m->device) >= DEVICE_MAX) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "region device must be \"host\" or a GPU "
                          "UUID (1 to %d characters)", DEVICE_MAX - 1);
        goto out;
    }
    if (m->kind == REFIT__RPC__MEM_KIND__MEM_INPROC) {
        do_region_inproc(r, c, id, m);
        goto out;
    }
    if ((m->kind == REFIT__RPC__MEM_KIND__MEM_MEMFD) != (strcmp(m->device, "host") == 0)) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "region on device %s with memory kind %s: "
                          "host memory is a memfd, GPU memory a CUDA handle", m->device,
                          rf_mem_kind_name((rf_mem_kind)m->kind));
        goto out;
    }
    if (region_chunks(c, id, m, fds, nfds, &chunks) < 0)
        goto out;
    if (chunks != NULL) {
        nchunks = m->n_chunks;
        fd = -1; /* fds[0] is the first chunk's, now in chunks */
    }
    if (r->gpu_only != (m->kind != REFIT__RPC__MEM_KIND__MEM_MEMFD)) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "region on %s: this daemon's transport moves "
                          "%s memory only; register %s memory, or run the daemons with "
                          "transport = %s", m->device, r->gpu_only ? "GPU" : "host",
                          r->gpu_only ? "GPU (CUDA)" : "host (memfd)",
                          r->gpu_only ? "tcp" : "nccl");
        goto out;
    }
    d.kind = (rf_mem_kind)m->kind;
    d.device = m->device;
    d.size = m->size;
    d.offset = m->offset;
    d.handle = m->ipc_handle.data;
    d.handle_len = m->ipc_handle.len;
    d.fd = fd;
    d.chunks = chunks;
    d.nchunks = nchunks;
    if (d.kind == RF_MEM_CUDA_VMM_FD) {
        d.vmm_base = m->vmm_base;
        d.owner = c->mem_owner;
    }
    rc = rf_mem_import(r->mem, &d, &ref, &err);
    if (rc < 0) {
        rf_rpc_conn_reply(c->conn, id, rc, "region %u: %s", c->nregions, err.msg);
        goto out;
    }
    /* Handle bytes are kept for the kinds whose import checked them (cuda_ipc, cuda_vmm_fd);
     * a memfd's would be bytes nothing reads. */
    if (d.kind == RF_MEM_MEMFD)
        d.handle_len = 0;
    if (d.handle_len > 0 && (handle = malloc(d.handle_len)) == NULL) {
        rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory registering a region");
        goto out;
    }
    memset(&rg, 0, sizeof(rg));
    rg.fd = -1;
    snprintf(rg.device, sizeof(rg.device), "%s", m->device);
    rg.size = m->size;
    rg.ref = ref;
    rg.kind = d.kind;
    rg.offset = d.offset;
    if (handle)
        memcpy(handle, d.handle, d.handle_len);
    rg.handle = handle;
    rg.handle_len = d.handle_len;
    rg.chunks = chunks;
    rg.nchunks = (uint32_t)nchunks;
    rg.vmm_base = d.vmm_base;
    rg.owner = c->uid;
    /* The region owns the received descriptor from here: kept to export it again. A region
     * of the same memfd as the client's last one shares that one's (regions of a client go
     * together, in client_free). */
    shared = d.kind == RF_MEM_MEMFD && c->memfd_fd >= 0 && fstat(fd, &st) == 0 &&
             st.st_dev == c->memfd_dev && st.st_ino == c->memfd_ino;
    rg.fd = shared ? c->memfd_fd : fd;
    rg.fd_shared = shared;
    if (add_client_region(r, c, id, &rg) < 0) {
        rf_mem_release(r->mem, ref); /* rg still holds handle, chunks and fd: freed below */
        ref = NULL;
        goto out;
    }
    handle = NULL;
    chunks = NULL;
    ref = NULL;
    if (!shared) {
        if (d.kind == RF_MEM_MEMFD && fstat(fd, &st) == 0) {
            c->memfd_fd = fd;
            c->memfd_dev = st.st_dev;
            c->memfd_ino = st.st_ino;
        }
        fd = -1;
    }
out:
    free(handle);
    if (ref)
        rf_mem_release(r->mem, ref);
    if (fd >= 0)
        close(fd);
    for (size_t i = 0; i < nchunks && chunks != NULL; i++)
        close(chunks[i].fd);
    free(chunks);
    /* Fds the request brought beyond what it used (they are its own: never a later one's). */
    for (size_t i = 1; i < nfds; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* The FP8 part of a RegisterPiece into p; false when refused (answered). */
static bool fp8_request(reg_client *c, uint64_t id, const Refit__Rpc__RegisterPiece *m,
                        reg_piece *p)
{
    rf_quant_fmt f;
    rf_err err = {0};

    if (rf_quant_fmt_parse(m->quant, &f, &err) < 0) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "FP8 piece of %s: %s", m->tensor, err.msg);
        return false;
    }
    if (m->n_scale_strides != m->n_shape) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "FP8 piece of %s has %zu scale strides for %zu "
                          "dims: one per dim", m->tensor, m->n_scale_strides, m->n_shape);
        return false;
    }
    if (m->scale_region >= c->nregions) {
        rf_rpc_conn_reply(c->conn, id, -ENOENT, "FP8 piece of %s keeps its scales in unknown "
                          "region %u (this client registered %u regions)", m->tensor,
                          m->scale_region, c->nregions);
        return false;
    }
    p->fp8 = true;
    p->q.kind = f.kind;
    p->q.br = f.br;
    p->q.bc = f.bc;
    p->q.scale_region = m->scale_region;
    p->q.scale_offset = m->scale_offset;
    for (size_t d = 0; d < RF_MAX_DIMS; d++)
        p->q.scale_strides[d] = d < m->n_shape ? m->scale_strides[d] : 0;
    return true;
}

static void do_piece(rf_registry *r, reg_client *c, uint64_t id,
                     const Refit__Rpc__RegisterPiece *m)
{
    reg_piece p;
    rf_err err = {0};
    uint32_t ntensors;
    size_t d;
    int rc;

    memset(&p, 0, sizeof(p));
    if (!need_registering(c, id, "RegisterPiece"))
        return;
    /* First: every later refusal echoes the name. */
    if (m->tensor == NULL || rf_tensor_name_check(m->tensor, &err) < 0) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "piece refused: %s",
                          m->tensor ? err.msg : "no tensor name");
        return;
    }
    if (m->n_shape < 1 || m->n_shape > RF_MAX_DIMS || m->n_start != m->n_shape ||
        m->n_extent != m->n_shape || m->n_strides != m->n_shape) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "piece of %s has %zu shape dims, %zu start, "
                          "%zu extent and %zu strides: all must be one per dim, 1 to %d dims",
                          m->tensor, m->n_shape, m->n_start, m->n_extent, m->n_strides,
                          RF_MAX_DIMS);
        return;
    }
    if (m->region >= c->nregions) {
        rf_rpc_conn_reply(c->conn, id, -ENOENT, "piece of %s names unknown region %u (this "
                          "client registered %u regions)", m->tensor, m->region, c->nregions);
        return;
    }
    if (m->dtype >= RF_DT__COUNT) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "piece of %s has unknown dtype %u", m->tensor,
                          m->dtype);
        return;
    }
    if (m->quant != NULL && m->quant[0] != '\0' && !fp8_request(c, id, m, &p))
        return;
    p.dtype = (rf_dtype)m->dtype;
    p.ndim = (int)m->n_shape;
    p.region = m->region;
    p.offset = m->offset;
    for (d = 0; d < RF_MAX_DIMS; d++) {
        p.box.start[d] = d < m->n_shape ? m->start[d] : 0;
        p.box.extent[d] = d < m->n_shape ? m->extent[d] : 1;
        p.shape[d] = d < m->n_shape ? m->shape[d] : 1;
        p.strides[d] = d < m->n_shape ? m->strides[d] : 0;
    }
    p.tensor = strdup(m->tensor);
    if (p.tensor == NULL ||
        grow((void **)&c->pieces, &c->cap_pieces, c->npieces + 1, sizeof(reg_piece)) < 0) {
        free(p.tensor);
        rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory registering a piece");
        return;
    }
    /* Validate by adding to the live inventory; a tensor created by a piece that then fails
     * is removed by a rebuild, so nothing stays half-registered. */
    ntensors = rf_inv_ntensors(r->inv);
    rc = add_piece(r->inv, c, &p, true, &err);
    if (rc < 0) {
        if (rf_inv_ntensors(r->inv) != ntensors)
            rebuild(r, NULL);
        free(p.tensor);
        rf_rpc_conn_reply(c->conn, id, rc, "%s", err.msg);
        return;
    }
    c->pieces[c->npieces++] = p;
    r->generation++;
    {
        Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;

        resp.id = id;
        resp.piece = c->npieces - 1;
        rf_rpc_conn_send(c->conn, &resp);
    }
}

static bool has_inproc(const reg_client *c)
{
    for (uint32_t i = 0; i < c->nregions; i++)
        if (c->regions[i].inproc)
            return true;
    return false;
}

static void do_seal(rf_registry *r, reg_client *c, uint64_t id)
{
    rf_err err = {0};
    rf_inv *scratch = NULL;
    int rc = 0;

    if (!need_registering(c, id, "Seal"))
        return;
    if (r->side == RF_DST) {
        /* Regions belong to one client, so overlaps are checked on this client's pieces
         * alone: another engine's unfinished registration cannot fail this one. */
        scratch = rf_inv_new();
        rc = scratch ? inv_add_client(r, scratch, c, false, &err)
                     : rf_err_set(&err, -ENOMEM, "out of memory sealing");
        if (rc == 0)
            rc = rf_inv_check_dst_overlap(scratch, &err);
        rf_inv_free(scratch);
    }
    if (rc < 0) {
        drop_pieces(c);
        rebuild(r, NULL);
        rf_rpc_conn_reply(c->conn, id, rc, "seal refused: %s; this client's pieces were "
                          "dropped (its regions kept): register them again", err.msg);
        changed(r);
        check_ready(r);
        return;
    }
    c->sealed = true;
    r->generation++;
    if (has_inproc(c)) {
        Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;

        randombytes_buf(c->token, sizeof(c->token));
        c->has_token = true;
        resp.id = id;
        resp.message = "sealed: attach the installer";
        resp.install_token.data = c->token;
        resp.install_token.len = sizeof(c->token);
        rf_rpc_conn_send(c->conn, &resp);
    } else {
        rf_rpc_conn_reply(c->conn, id, 0, "sealed");
    }
    check_complete(r);
    check_ready(r);
}

static void do_publish(rf_registry *r, reg_client *c, uint64_t id, uint64_t version)
{
    rf_err err = {0};

    if (c->kind != REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER) {
        rf_rpc_conn_reply(c->conn, id, -EPERM, "Publish is for trainers, not %s clients",
                          kind_name(c->kind));
        return;
    }
    if (!c->sealed) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "Publish of version %" PRIu64 " before Seal: "
                          "register the pieces and seal first", version);
        return;
    }
    if (rf_version_check(version, r->released, "Publish", &err) < 0) {
        rf_rpc_conn_reply(c->conn, id, err.code, "%s", err.msg);
        return;
    }
    /* The same version again is how trainers retry after an abort. */
    if (version < c->published) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "Publish of version %" PRIu64 ": versions "
                          "must not decrease (this client published %" PRIu64 ")", version,
                          c->published);
        return;
    }
    c->published = version;
    c->offered = version;
    rf_rpc_conn_reply(c->conn, id, 0, "published");
    check_ready(r);
}

static void do_wait(rf_registry *r, reg_client *c, uint64_t id, uint64_t version, wait_kind k)
{
    uint64_t reached = k == WAIT_RELEASED ? r->released : r->committed;
    rf_err err = {0};
    int rc;

    if (k == WAIT_RELEASED && c->kind != REFIT__RPC__CLIENT_KIND__CLIENT_TRAINER) {
        rf_rpc_conn_reply(c->conn, id, -EPERM, "WaitReleased is for trainers, not %s clients",
                          kind_name(c->kind));
        return;
    }
    if (k == WAIT_VERSION && c->kind != REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE) {
        rf_rpc_conn_reply(c->conn, id, -EPERM, "WaitVersion is for engines, not %s clients",
                          kind_name(c->kind));
        return;
    }
    if (reached >= version) {
        reply_version(c, id, reached);
        return;
    }
    /* A wait that comes after the abort of what this trainer published (its offer was taken
     * back) fails now as the waiters queued before the abort did: it would never be answered. */
    if (k == WAIT_RELEASED && c->published >= version && c->offered < version) {
        rf_rpc_conn_reply(c->conn, id, -ECANCELED, "%s", r->abort_msg[0] ? r->abort_msg :
                          "this trainer's publish was taken back: publish again to retry");
        return;
    }
    /* Not final: the same wait once the cause is gone waits as usual. */
    if (r->blocked[0]) {
        reply_blocked(r, c, id, version);
        return;
    }
    if (k == WAIT_CTL && r->cb.on_wait) {
        rc = r->cb.on_wait(r, version, &err, r->ud);
        if (rc < 0) {
            rf_rpc_conn_reply(c->conn, id, rc, "%s", err.msg);
            return;
        }
    }
    if (add_waiter(c, id, version, k) < 0)
        rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory adding a waiter");
}

static void do_status(rf_registry *r, reg_client *c, uint64_t id)
{
    Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;
    rf_err err = {0};
    char *json = NULL;
    int rc;

    if (r->cb.on_status == NULL) {
        rf_rpc_conn_reply(c->conn, id, -ENOTSUP, "this daemon does not serve status");
        return;
    }
    rc = r->cb.on_status(r, &json, &err, r->ud);
    if (rc < 0) {
        rf_rpc_conn_reply(c->conn, id, rc, "status: %s", err.msg);
        return;
    }
    resp.id = id;
    resp.status_json = json ? json : "{}";
    rf_rpc_conn_send(c->conn, &resp);
    free(json);
}

static void do_refit(rf_registry *r, reg_client *c, uint64_t id, uint64_t version)
{
    rf_err err = {0};
    int rc;

    if (r->cb.on_refit == NULL) {
        rf_rpc_conn_reply(c->conn, id, -ENOTSUP, "this daemon does not take refit triggers: "
                          "send them to the coordinator");
        return;
    }
    rc = r->cb.on_refit(r, version, &err, r->ud);
    if (rc < 0)
        rf_rpc_conn_reply(c->conn, id, rc, "refit %" PRIu64 ": %s", version, err.msg);
    else
        rf_rpc_conn_reply(c->conn, id, 0, "refit %" PRIu64 " triggered", version);
}

/* Same-host export (proto/rpc.proto has the protocol). A peer proves the cluster key on a
 * nonce of ours, so a process that may connect to the socket (SO_PEERCRED) but lacks the key
 * gets nothing, and a recorded proof fits no other Export. */
static bool peer_only(reg_client *c, uint64_t id, const char *what)
{
    if (c->kind == REFIT__RPC__CLIENT_KIND__CLIENT_PEER)
        return true;
    rf_rpc_conn_reply(c->conn, id, -EPERM, "%s is for peer clients (a local refit-receiverd), "
                      "not %s clients", what, kind_name(c->kind));
    return false;
}

static bool export_key_set(const rf_registry *r, reg_client *c, uint64_t id)
{
    if (r->export_key)
        return true;
    rf_rpc_conn_reply(c->conn, id, -ENOKEY, "same-host export is off on this publisherd (no "
                      "export key set): its node sets the cluster key when local_copy is on");
    return false;
}

static void do_export_hello(rf_registry *r, reg_client *c, uint64_t id)
{
    Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;

    if (!peer_only(c, id, "ExportHello") || !export_key_set(r, c, id))
        return;
    randombytes_buf(c->nonce, sizeof(c->nonce));
    c->has_nonce = true;
    resp.id = id;
    resp.nonce.data = c->nonce;
    resp.nonce.len = sizeof(c->nonce);
    rf_rpc_conn_send(c->conn, &resp);
}

/* Passes the fds of the regions in tab that are granted (in order, those that have one, a
 * region's chunks in order) on the peer's back channel. */
static int send_fds(int chan, reg_region *const *tab, const bool *grant, uint32_t n,
                    rf_err *err)
{
    uint32_t nfds = 0, i, k = 0;
    int *fds, rc;

    for (i = 0; i < n; i++)
        if (grant[i])
            nfds += tab[i]->nchunks ? tab[i]->nchunks : tab[i]->fd >= 0;
    if ((fds = malloc((nfds ? nfds : 1) * sizeof(*fds))) == NULL)
        return rf_err_set(err, -ENOMEM, "daemon out of memory passing the region fds");
    for (i = 0; i < n; i++) {
        if (!grant[i])
            continue;
        for (uint32_t j = 0; j < tab[i]->nchunks; j++)
            fds[k++] = tab[i]->chunks[j].fd;
        if (tab[i]->nchunks == 0 && tab[i]->fd >= 0)
            fds[k++] = tab[i]->fd;
    }
    rc = rf_export_pass_fds(chan, fds, nfds, err);
    free(fds);
    return rc;
}

/* The regions an Export may have: those holding one of its pieces, and an FP8 piece's scales.
 * -ESTALE for a piece this inventory does not hold (the asker's plan is of another
 * generation). */
static int grant_regions(const rf_registry *r, const Refit__Rpc__Export *m, bool *grant,
                         uint32_t *ngrant, rf_err *err)
{
    uint32_t npieces = rf_inv_npieces(r->inv, RF_SRC);

    *ngrant = 0;
    for (size_t i = 0; i < m->n_pieces; i++) {
        rf_piece p;
        uint32_t reg[2];
        int nreg = 1;

        if (m->pieces[i] >= npieces)
            return rf_err_set(err, -ESTALE, "Export asks for piece %u, this publisherd holds "
                              "%u (generation %llu): the plan is stale", m->pieces[i], npieces,
                              (unsigned long long)r->generation);
        rf_inv_piece(r->inv, RF_SRC, m->pieces[i], &p);
        reg[0] = p.region;
        if (p.quant != 0)
            reg[nreg++] = rf_inv_quant(r->inv, p.quant)->scale_region;
        for (int k = 0; k < nreg; k++)
            if (!grant[reg[k]]) {
                grant[reg[k]] = true;
                (*ngrant)++;
            }
    }
    return 0;
}

/* The answer to an authenticated Export: the local inventory, one ExportRegion per local
 * region id (granted: as registered; the others kind 0, empty), and the granted regions' fds
 * on the back channel before the answer. */
static void export_reply(rf_registry *r, reg_client *c, uint64_t id,
                         const Refit__Rpc__Export *m, int chan)
{
    Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;
    Refit__Inventory inv = REFIT__INVENTORY__INIT;
    Refit__Rpc__ExportRegion *er = NULL, **erp = NULL;
    Refit__Rpc__VmmChunk *chunk_msgs;
    reg_region **tab = NULL;
    bool *grant = NULL;
    uint32_t n = rf_inv_nregions(r->inv), i, ngrant = 0, nfds = 0;
    uint64_t at;
    uint8_t *packed = NULL;
    bool inv_built = false;
    const reg_client *o;
    size_t size;
    rf_err err = {0};
    int rc;

    tab = calloc(n ? n : 1, sizeof(*tab));
    er = calloc(n ? n : 1, sizeof(*er));
    erp = calloc(n ? n : 1, sizeof(*erp));
    grant = calloc(n ? n : 1, sizeof(*grant));
    if (!tab || !er || !erp || !grant) {
        rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory answering Export");
        goto out;
    }
    if ((rc = grant_regions(r, m, grant, &ngrant, &err)) < 0) {
        rf_rpc_conn_reply(c->conn, id, rc, "%s", err.msg);
        goto out;
    }
    rc = rf_slice_inv_pack(r->inv, RF_SRC, r->generation, &inv);
    if (rc < 0) {
        rf_rpc_conn_reply(c->conn, id, rc, "daemon out of memory answering Export");
        goto out;
    }
    inv_built = true;
    /* Every client's regions are in the live inventory (rebuilt after every change). */
    for (o = r->clients; o != NULL; o = o->next)
        for (i = 0; i < o->nregions; i++) {
            assert(o->regions[i].inv_id < n && tab[o->regions[i].inv_id] == NULL);
            tab[o->regions[i].inv_id] = &o->regions[i];
        }
    for (i = 0; i < n; i++) {
        assert(tab[i] != NULL);
        refit__rpc__export_region__init(&er[i]);
        erp[i] = &er[i];
        if (!grant[i])
            continue; /* kind 0: its place in the table, nothing to reach it by */
        nfds += tab[i]->nchunks ? tab[i]->nchunks : tab[i]->fd >= 0;
        er[i].kind = (Refit__Rpc__MemKind)tab[i]->kind;
        er[i].device = tab[i]->device;
        er[i].size = tab[i]->size;
        er[i].offset = tab[i]->offset;
        er[i].handle.data = tab[i]->handle;
        er[i].handle.len = tab[i]->handle_len;
        er[i].has_fd = tab[i]->fd >= 0 || tab[i]->nchunks > 0;
        if (tab[i]->vmm_base != 0) {
            er[i].vmm_base = tab[i]->vmm_base;
            er[i].owner = tab[i]->owner;
        }
        if (tab[i]->nchunks > 0) {
            er[i].chunks = calloc(tab[i]->nchunks, sizeof(*er[i].chunks));
            chunk_msgs = calloc(tab[i]->nchunks, sizeof(*chunk_msgs));
            if (er[i].chunks == NULL || chunk_msgs == NULL) {
                free(chunk_msgs);
                rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory answering "
                                  "Export");
                goto out;
            }
            er[i].n_chunks = tab[i]->nchunks;
            /* The chunk messages are one array, freed through its first pointer below. */
            at = 0;
            for (uint32_t k = 0; k < tab[i]->nchunks; k++) {
                refit__rpc__vmm_chunk__init(&chunk_msgs[k]);
                chunk_msgs[k].size = tab[i]->chunks[k].size;
                chunk_msgs[k].offset = at;
                er[i].chunks[k] = &chunk_msgs[k];
                at += tab[i]->chunks[k].size;
            }
        }
    }
    size = refit__inventory__get_packed_size(&inv);
    packed = malloc(size ? size : 1);
    if (packed == NULL) {
        rf_rpc_conn_reply(c->conn, id, -ENOMEM, "daemon out of memory answering Export");
        goto out;
    }
    refit__inventory__pack(&inv, packed);
    resp.id = id;
    resp.inventory.data = packed;
    resp.inventory.len = size;
    resp.generation = r->generation;
    resp.n_regions = n;
    resp.regions = erp;
    /* Checked here so the peer hears why: past this the RPC layer would cut it silently. */
    size = refit__rpc__response__get_packed_size(&resp) + 4;
    if (size > RF_RPC_MAX_OUTPUT) {
        rf_rpc_conn_reply(c->conn, id, -EMSGSIZE, "the export of %u regions and %u pieces "
                          "takes %zu bytes, more than the %u bytes of an RPC answer: "
                          "same-host export cannot serve this inventory", n,
                          rf_inv_npieces(r->inv, RF_SRC), size, RF_RPC_MAX_OUTPUT);
        goto out;
    }
    rc = send_fds(chan, tab, grant, n, &err);
    if (rc < 0) {
        rf_rpc_conn_reply(c->conn, id, rc, "%s", err.msg);
        goto out;
    }
    rf_rpc_conn_send(c->conn, &resp);
    {
        pid_t pid = 0;

        rf_rpc_conn_cred(c->conn, &pid, NULL, NULL);
        RF_INFO("exported %u of %u regions (%u fds) holding %zu asked-for pieces to pid %d "
                "(generation %llu)", ngrant, n, nfds, m->n_pieces, (int)pid,
                (unsigned long long)r->generation);
    }
out:
    if (inv_built)
        rf_slice_inv_msg_free(&inv);
    free(packed);
    free(erp);
    for (i = 0; er != NULL && i < n; i++) {
        if (er[i].chunks != NULL)
            free(er[i].chunks[0]);
        free(er[i].chunks);
    }
    free(er);
    free(tab);
    free(grant);
}

static void do_export(rf_registry *r, reg_client *c, uint64_t id, const Refit__Rpc__Export *m,
                      int chan)
{
    uint8_t ns[RF_EXPORT_NONCE_BYTES], want[RF_EXPORT_MAC_BYTES];
    bool had = c->has_nonce;
    int type = 0;
    socklen_t tlen = sizeof(type);

    if (!peer_only(c, id, "Export") || !export_key_set(r, c, id))
        goto out;
    /* One attempt per nonce, right or wrong: a guess costs a round trip to a fresh nonce. */
    memcpy(ns, c->nonce, sizeof(ns));
    sodium_memzero(c->nonce, sizeof(c->nonce));
    c->has_nonce = false;
    if (!had) {
        rf_rpc_conn_reply(c->conn, id, -EPROTO, "Export without a fresh nonce: send "
                          "ExportHello first (each nonce serves one Export)");
        goto out;
    }
    if (m->nonce.len != RF_EXPORT_NONCE_BYTES || m->mac.len != RF_EXPORT_MAC_BYTES) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "Export with a %zu-byte nonce and a %zu-byte "
                          "mac (both must be %d bytes): closing the connection", m->nonce.len,
                          m->mac.len, RF_EXPORT_NONCE_BYTES);
        rf_rpc_conn_close(c->conn); /* frees c */
        goto out;
    }
    rf_export_mac(r->export_key, r->export_key_len, ns, m->nonce.data, want);
    if (crypto_verify_32(want, m->mac.data) != 0) {
        pid_t pid;

        rf_rpc_conn_cred(c->conn, &pid, NULL, NULL);
        rf_rpc_conn_reply(c->conn, id, -EACCES, "Export refused: wrong MAC from pid %d, whose "
                          "cluster key differs from this publisherd's: give both daemons the "
                          "same key file; closing the connection", (int)pid);
        rf_rpc_conn_close(c->conn);
        goto out;
    }
    if (chan < 0 || getsockopt(chan, SOL_SOCKET, SO_TYPE, &type, &tlen) < 0 ||
        type != SOCK_SEQPACKET) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "Export without its back channel: send one end "
                          "of an AF_UNIX SOCK_SEQPACKET socketpair with the request (the "
                          "region fds come on it); closing the connection");
        rf_rpc_conn_close(c->conn);
        goto out;
    }
    if (!r->complete) {
        rf_rpc_conn_reply(c->conn, id, -EAGAIN, "inventory incomplete (%u of %u trainers "
                          "sealed): retry after the next plan", count_data(r, true),
                          r->expected);
        goto out;
    }
    export_reply(r, c, id, m, chan);
out:
    sodium_memzero(ns, sizeof(ns));
    if (chan >= 0)
        close(chan);
}

/* ---- in-process install: the installer's requests ---- */

static bool installer_only(reg_client *c, uint64_t id, const char *what, bool attached)
{
    if (c->kind != REFIT__RPC__CLIENT_KIND__CLIENT_INSTALLER) {
        rf_rpc_conn_reply(c->conn, id, -EPERM, "%s is for installer clients, not %s", what,
                          kind_name(c->kind));
        return false;
    }
    if (attached && c->engine == NULL) {
        rf_rpc_conn_reply(c->conn, id, -EPROTO, "%s before InstallerAttach (or its engine "
                          "left)", what);
        return false;
    }
    return true;
}

static void do_installer_attach(rf_registry *r, reg_client *c, uint64_t id,
                                const Refit__Rpc__InstallerAttach *m)
{
    reg_client *e;
    pid_t pid, epid;
    uid_t uid;
    gid_t gid;

    if (!installer_only(c, id, "InstallerAttach", false))
        return;
    if (c->engine) {
        rf_rpc_conn_reply(c->conn, id, -EISCONN, "installer already attached");
        return;
    }
    for (e = r->clients; e != NULL; e = e->next)
        if (e->has_token && m->token.len == sizeof(e->token) &&
            sodium_memcmp(e->token, m->token.data, sizeof(e->token)) == 0)
            break;
    if (e == NULL) {
        rf_rpc_conn_reply(c->conn, id, -EACCES, "no engine of this daemon holds that install "
                          "token: attach with the token of your engine's Seal");
        return;
    }
    rf_rpc_conn_cred(c->conn, &pid, &uid, &gid);
    rf_rpc_conn_cred(e->conn, &epid, &uid, &gid);
    if (pid != epid) {
        rf_rpc_conn_reply(c->conn, id, -EACCES, "installer of pid %d for engine '%s' of pid "
                          "%d: an engine's installer runs in the engine's own process",
                          (int)pid, e->name, (int)epid);
        return;
    }
    if (e->installer) {
        rf_rpc_conn_reply(c->conn, id, -EBUSY, "engine '%s' has an installer attached",
                          e->name);
        return;
    }
    e->installer = c;
    c->engine = e;
    rf_rpc_conn_set_max_output(c->conn, RF_REGISTRY_INSTALLER_OUTPUT);
    rf_rpc_conn_reply(c->conn, id, 0, "attached to engine '%s'", e->name);
    check_complete(r);
}

/* The trainers' memory an installer's plan reads: the daemon's callback fetches it (the
 * registry never hands out the key nor signs for anyone) and passes the fds on chan. */
static void do_install_sources(rf_registry *r, reg_client *c, uint64_t id,
                               const Refit__Rpc__InstallSources *m, int chan)
{
    Refit__Rpc__Response *resp = NULL;
    rf_err err = {0};
    int type = 0, rc;
    socklen_t tlen = sizeof(type);

    if (!installer_only(c, id, "InstallSources", true))
        goto out;
    if (chan < 0 || getsockopt(chan, SOL_SOCKET, SO_TYPE, &type, &tlen) < 0 ||
        type != SOCK_SEQPACKET) {
        rf_rpc_conn_reply(c->conn, id, -EINVAL, "InstallSources without its back channel: "
                          "send one end of an AF_UNIX SOCK_SEQPACKET socketpair with the "
                          "request (the region fds come on it)");
        goto out;
    }
    if (r->cb.on_install_sources == NULL) {
        rf_rpc_conn_reply(c->conn, id, -ENOKEY, "this receiverd copies nothing from trainers "
                          "on its host (local_copy = off): no trainer memory to give");
        goto out;
    }
    rc = r->cb.on_install_sources(r, c->engine->uid, m, chan, &resp, &err, r->ud);
    if (rc < 0) {
        rf_rpc_conn_reply(c->conn, id, rc, "%s", err.msg);
        goto out;
    }
    resp->id = id;
    resp->code = 0;
    rf_rpc_conn_send(c->conn, resp);
out:
    if (resp)
        refit__rpc__response__free_unpacked(resp, NULL);
    if (chan >= 0)
        close(chan);
}

static void do_install_done(rf_registry *r, reg_client *c, uint64_t id,
                            const Refit__Rpc__InstallDone *m)
{
    if (!installer_only(c, id, "InstallDone", true))
        return;
    rf_rpc_conn_reply(c->conn, id, 0, "noted");
    if (r->cb.on_install_done)
        r->cb.on_install_done(r, c->engine->uid, m, r->ud);
}

static void on_request(rf_rpc_conn *conn, const Refit__Rpc__Request *q, void *ud)
{
    rf_registry *r = ud;
    reg_client *c = rf_rpc_conn_data(conn);
    int fds[RF_RPC_MAX_FDS], fd = -1;
    size_t nfds = 0, i;

    _Static_assert(RF_RPC_MAX_FDS >= RF_MEM_MAX_CHUNKS, "a region's chunk fds fit a request");
    /* Only requests that travel with descriptors claim them, so fds stay matched to requests:
     * regions of the kinds that are fds (one per chunk when it lists chunks), Export and
     * InstallSources (their back channels). */
    if (q->body_case == REFIT__RPC__REQUEST__BODY_REGISTER_REGION &&
        (q->register_region->kind == REFIT__RPC__MEM_KIND__MEM_MEMFD ||
         q->register_region->kind == REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD ||
         q->register_region->n_chunks > 0)) {
        nfds = q->register_region->n_chunks ? q->register_region->n_chunks : 1;
        if (nfds > RF_RPC_MAX_FDS)
            nfds = RF_RPC_MAX_FDS;
        for (i = 0; i < nfds; i++)
            fds[i] = rf_rpc_conn_take_fd(conn);
        fd = fds[0];
    } else if (q->body_case == REFIT__RPC__REQUEST__BODY_EXPORT_REQUEST ||
               q->body_case == REFIT__RPC__REQUEST__BODY_INSTALL_SOURCES) {
        fd = rf_rpc_conn_take_fd(conn);
    }
    if (q->body_case != REFIT__RPC__REQUEST__BODY_HELLO && !c->hello) {
        rf_rpc_conn_reply(conn, q->id, -EPROTO, "request before Hello: say Hello first");
        for (i = 0; i < nfds; i++)
            if (fds[i] >= 0)
                close(fds[i]);
        if (nfds == 0 && fd >= 0)
            close(fd);
        return;
    }
    switch (q->body_case) {
    case REFIT__RPC__REQUEST__BODY_HELLO:
        do_hello(r, c, q->id, q->hello);
        break;
    case REFIT__RPC__REQUEST__BODY_REGISTER_REGION:
        do_region(r, c, q->id, q->register_region, fds, nfds);
        break;
    case REFIT__RPC__REQUEST__BODY_REGISTER_PIECE:
        do_piece(r, c, q->id, q->register_piece);
        break;
    case REFIT__RPC__REQUEST__BODY_SEAL:
        do_seal(r, c, q->id);
        break;
    case REFIT__RPC__REQUEST__BODY_PUBLISH:
        do_publish(r, c, q->id, q->publish->version);
        break;
    case REFIT__RPC__REQUEST__BODY_WAIT_RELEASED:
        do_wait(r, c, q->id, q->wait_released->version, WAIT_RELEASED);
        break;
    case REFIT__RPC__REQUEST__BODY_WAIT_VERSION:
        do_wait(r, c, q->id, q->wait_version->version, WAIT_VERSION);
        break;
    case REFIT__RPC__REQUEST__BODY_STATUS:
        do_status(r, c, q->id);
        break;
    case REFIT__RPC__REQUEST__BODY_REFIT:
        do_refit(r, c, q->id, q->refit->version);
        break;
    case REFIT__RPC__REQUEST__BODY_GATE:
        do_gate(r, c, q->id);
        break;
    case REFIT__RPC__REQUEST__BODY_CONSUMED:
        do_consumed(r, c, q->id, q->consumed->version);
        break;
    case REFIT__RPC__REQUEST__BODY_WAIT:
        do_wait(r, c, q->id, q->wait->version, WAIT_CTL);
        break;
    case REFIT__RPC__REQUEST__BODY_EXPORT_HELLO:
        do_export_hello(r, c, q->id);
        break;
    case REFIT__RPC__REQUEST__BODY_EXPORT_REQUEST:
        do_export(r, c, q->id, q->export_request, fd);
        break;
    case REFIT__RPC__REQUEST__BODY_INSTALLER_ATTACH:
        do_installer_attach(r, c, q->id, q->installer_attach);
        break;
    case REFIT__RPC__REQUEST__BODY_INSTALL_SOURCES:
        do_install_sources(r, c, q->id, q->install_sources, fd);
        break;
    case REFIT__RPC__REQUEST__BODY_INSTALL_DONE:
        do_install_done(r, c, q->id, q->install_done);
        break;
    default:
        rf_rpc_conn_reply(conn, q->id, -EOPNOTSUPP, "unknown request %d", (int)q->body_case);
        break;
    }
}

int rf_registry_open(uv_loop_t *loop, const rf_registry_opts *opts, const rf_registry_cb *cb,
                     void *ud, rf_registry **out, rf_err *err)
{
    static const rf_rpc_server_cb rpc_cb = {on_connect, on_request, on_close};
    rf_rpc_server_opts so = {0};
    rf_registry *r;
    int rc;

    *out = NULL;
    if (opts->side != RF_SRC && opts->side != RF_DST)
        return rf_err_set(err, -EINVAL, "registry side %d: RF_SRC or RF_DST", opts->side);
    if (opts->expected_clients == 0)
        return rf_err_set(err, -EINVAL, "registry on %s expects 0 clients: set at least 1",
                          opts->socket_path ? opts->socket_path : "(no path)");
    r = calloc(1, sizeof(*r));
    if (r == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory opening the registry");
    r->loop = loop;
    r->side = opts->side;
    r->expected = opts->expected_clients;
    r->node = opts->node;
    r->consumed = UINT64_MAX;
    r->gpu_only = opts->gpu_memory;
    if (cb)
        r->cb = *cb;
    r->ud = ud;
    r->mem = rf_mem_cache_new();
    r->inv = rf_inv_new();
    if (r->mem == NULL || r->inv == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory opening the registry");
        goto fail;
    }
    so.path = opts->socket_path;
    so.allowed_uids = opts->allowed_uids;
    so.n_allowed_uids = opts->n_allowed_uids;
    so.allowed_gids = opts->allowed_gids;
    so.n_allowed_gids = opts->n_allowed_gids;
    so.max_frame = opts->max_frame;
    rc = rf_rpc_server_open(loop, &so, &rpc_cb, r, &r->srv, err);
    if (rc < 0)
        goto fail;
    *out = r;
    return 0;
fail:
    rf_mem_cache_free(r->mem);
    rf_inv_free(r->inv);
    free(r);
    return rc;
}

void rf_registry_close(rf_registry *r)
{
    if (r == NULL)
        return;
    r->closing = true;
    rf_rpc_server_close(r->srv); /* on_close frees each client */
    rf_inv_free(r->inv);
    r->held = false;
    rf_registry_hold(r, false);
    free(r->deferred);
    rf_mem_cache_free(r->mem);
    free(r->ep_device);
    free(r->ep_owner);
    free(r->region_ref);
    rf_registry_set_export_key(r, NULL, 0);
    free(r);
}

int rf_registry_set_export_key(rf_registry *r, const uint8_t *key, size_t len)
{
    uint8_t *k = NULL;

    if (key != NULL && (len < RF_EXPORT_KEY_MIN || len > RF_EXPORT_KEY_MAX))
        return -EINVAL;
    if (key != NULL && sodium_init() < 0)
        return -EIO;
    if (key != NULL && (k = malloc(len)) == NULL)
        return -ENOMEM;
    if (k)
        memcpy(k, key, len);
    if (r->export_key) {
        sodium_memzero(r->export_key, r->export_key_len);
        free(r->export_key);
    }
    r->export_key = k;
    r->export_key_len = k ? len : 0;
    return 0;
}

const rf_inv *rf_registry_inv(const rf_registry *r) { return r->inv; }
bool rf_registry_complete(const rf_registry *r) { return r->complete; }
uint64_t rf_registry_generation(const rf_registry *r) { return r->generation; }
uint64_t rf_registry_committed(const rf_registry *r) { return r->committed; }

void *rf_registry_region_base(const rf_registry *r, uint32_t region)
{
    if (region >= rf_inv_nregions(r->inv) || r->region_ref[region] == NULL)
        return NULL;
    return rf_mem_ref_base(r->region_ref[region]);
}

rf_mem_kind rf_registry_region_kind(const rf_registry *r, uint32_t region)
{
    if (r->region_ref[region] == NULL)
        return (rf_mem_kind)REFIT__RPC__MEM_KIND__MEM_INPROC;
    return rf_mem_ref_kind(r->region_ref[region]);
}

uint64_t rf_registry_endpoint_owner(const rf_registry *r, uint32_t endpoint)
{
    if (endpoint >= rf_inv_nendpoints(r->inv))
        return 0;
    return r->ep_owner[endpoint];
}

static reg_client *find_uid(const rf_registry *r, uint64_t uid)
{
    reg_client *c;

    for (c = r->clients; c != NULL; c = c->next)
        if (c->uid == uid)
            return c;
    return NULL;
}

int rf_registry_client_regions(const rf_registry *r, uint64_t uid, uint32_t **ids, size_t *n,
                               rf_err *err)
{
    const reg_client *c = find_uid(r, uid);

    *ids = NULL;
    *n = 0;
    if (c == NULL)
        return rf_err_set(err, -ENOENT, "no client %llu here (it left)",
                          (unsigned long long)uid);
    if (c->nregions && (*ids = malloc(c->nregions * sizeof(uint32_t))) == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory listing a client's regions");
    for (uint32_t i = 0; i < c->nregions; i++)
        (*ids)[i] = c->regions[i].inv_id;
    *n = c->nregions;
    return 0;
}

int rf_registry_install_push(rf_registry *r, uint64_t uid, const Refit__Rpc__Install *m,
                             rf_err *err)
{
    Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;
    const reg_client *c = find_uid(r, uid);
    int rc;

    if (c == NULL)
        return rf_err_set(err, -ENOENT, "the engine with in-process regions left");
    if (c->installer == NULL)
        return rf_err_set(err, -ENOTCONN, "engine '%s' (rank %d, pid %d) registered "
                          "in-process memory but its installer is not attached: it must keep "
                          "its librefit client open (the installer is librefit's thread)",
                          c->name, c->rank, c->pid);
    resp.install = (Refit__Rpc__Install *)m;
    rc = rf_rpc_conn_send(c->installer->conn, &resp);
    if (rc < 0)
        return rf_err_set(err, rc, "writing to the installer of engine '%s': %s", c->name,
                          strerror(-rc));
    return 0;
}

const char *rf_registry_client_name(const rf_registry *r, uint64_t uid)
{
    const reg_client *c = find_uid(r, uid);

    return c ? c->name : "(gone)";
}

const char *rf_registry_endpoint_device(const rf_registry *r, uint32_t endpoint)
{
    if (endpoint >= rf_inv_nendpoints(r->inv))
        return NULL;
    return r->ep_device[endpoint];
}

json_t *rf_registry_status(const rf_registry *r)
{
    json_t *o = json_object(), *arr = json_array();
    const reg_client *c;

    if (o == NULL || arr == NULL) {
        json_decref(o);
        json_decref(arr);
        return NULL;
    }
    json_object_set_new(o, "side", json_string(r->side == RF_SRC ? "trainers" : "engines"));
    json_object_set_new(o, "socket", json_string(rf_rpc_server_path(r->srv)));
    json_object_set_new(o, "expected_clients", json_integer(r->expected));
    json_object_set_new(o, "connected_clients", json_integer(count_data(r, false)));
    json_object_set_new(o, "complete", json_boolean(r->complete));
    json_object_set_new(o, "generation", json_integer((json_int_t)r->generation));
    json_object_set_new(o, "tensors", json_integer(rf_inv_ntensors(r->inv)));
    json_object_set_new(o, "regions", json_integer(rf_inv_nregions(r->inv)));
    json_object_set_new(o, "pieces", json_integer(rf_inv_npieces(r->inv, r->side)));
    json_object_set_new(o, "ready", json_integer((json_int_t)r->ready));
    json_object_set_new(o, "released", json_integer((json_int_t)r->released));
    json_object_set_new(o, "committed", json_integer((json_int_t)r->committed));
    for (c = r->clients; c != NULL; c = c->next) {
        json_t *j;

        if (!c->hello)
            continue;
        j = json_pack("{s:s, s:s, s:i, s:i, s:b, s:i, s:i, s:I}", "name", c->name, "kind",
                      kind_name(c->kind), "rank", c->rank, "pid", c->pid, "sealed", c->sealed,
                      "regions", (int)c->nregions, "pieces", (int)c->npieces, "published",
                      (json_int_t)c->published);
        /* How the engine's memory is written: by the daemon (shared), or by its own
         * installer (in-process), and whether that one is attached. */
        if (j && c->kind == REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE) {
            json_object_set_new(j, "install", json_string(has_inproc(c) ? "in-process"
                                                                          : "daemon"));
            if (has_inproc(c))
                json_object_set_new(j, "installer_attached", json_boolean(c->installer));
            /* A gated engine holds the next install back until it consumed the last. */
            json_object_set_new(j, "gated", json_boolean(c->gated));
            if (c->gated)
                json_object_set_new(j, "consumed", json_integer((json_int_t)c->consumed));
        }
        if (j)
            json_array_append_new(arr, j);
    }
    json_object_set_new(o, "clients", arr);
    return o;
}

/* Takes back every offer of a version <= version (released, or aborted). */
static void withdraw_offers(rf_registry *r, uint64_t version)
{
    reg_client *c;

    for (c = r->clients; c != NULL; c = c->next)
        if (c->offered <= version)
            c->offered = 0;
}

void rf_registry_release(rf_registry *r, uint64_t version)
{
    if (version <= r->released)
        return;
    answer_waiters(r, 1u << WAIT_RELEASED, 0, version, 0, NULL);
    r->released = version;
    withdraw_offers(r, version);
    check_ready(r);
}

uint64_t rf_registry_ready(const rf_registry *r)
{
    return r->ready;
}

unsigned rf_registry_nclients(const rf_registry *r)
{
    return count_data(r, false);
}

void rf_registry_abort(rf_registry *r, uint64_t version, const char *reason)
{
    snprintf(r->abort_msg, sizeof(r->abort_msg), "refit of version %" PRIu64 " aborted: %s; "
             "the weights were not released, publish again to retry", version,
             reason ? reason : "no reason");
    answer_waiters(r, 1u << WAIT_RELEASED, r->released, version, -ECANCELED, r->abort_msg);
    /* The failed publishes are taken back: a persistent failure does not loop. Trainers publish
     * again (the same version or a later one) and readiness is reported anew. */
    withdraw_offers(r, version);
    check_ready(r);
}

void rf_registry_block(rf_registry *r, const char *reason)
{
    reg_client *c;
    size_t i;

    snprintf(r->blocked, sizeof(r->blocked), "%s", reason ? reason : "");
    if (!r->blocked[0])
        return;
    /* Every waiter waits for a version not reached yet (reached ones are answered at once). */
    for (c = r->clients; c != NULL; c = c->next) {
        for (i = 0; i < c->nwaiters; i++)
            reply_blocked(r, c, c->waiters[i].id, c->waiters[i].version);
        c->nwaiters = 0;
    }
}

void rf_registry_notify(rf_registry *r, rf_reg_event ev, uint64_t version, const char *reason)
{
    Refit__Rpc__Response resp = REFIT__RPC__RESPONSE__INIT;
    Refit__Rpc__Event e = REFIT__RPC__EVENT__INIT;
    reg_client *c;
    char msg[768];

    e.kind = (Refit__Rpc__EventKind)ev;
    e.version = version;
    e.reason = (char *)(reason ? reason : "");
    resp.event = &e;
    for (c = r->clients; c != NULL; c = c->next)
        if (c->hello && c->kind == REFIT__RPC__CLIENT_KIND__CLIENT_ENGINE)
            rf_rpc_conn_send(c->conn, &resp);
    if (ev == RF_REG_COMMITTED && version > r->committed) {
        answer_waiters(r, (1u << WAIT_VERSION) | (1u << WAIT_CTL), 0, version, 0, NULL);
        r->committed = version;
    } else if (ev == RF_REG_ABORTED) {
        snprintf(msg, sizeof(msg), "refit of version %" PRIu64 " aborted: %s; the engines "
                 "hold a mix of versions until the next commit", version,
                 reason ? reason : "no reason");
        answer_waiters(r, (1u << WAIT_VERSION) | (1u << WAIT_CTL), r->committed, version,
                       -ECANCELED, msg);
    }
}
