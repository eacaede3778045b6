/* common/control/slice.c - inventories to and from protobuf, the coordinator's merge, plan slices
 * per daemon and the transfer job a daemon builds from its slice. */
#include "slice.h"

#include "qcopy.h"
#include "quant_fmt.h"

#include <stdlib.h>
#include <string.h>

static int64_t *dup_dims(const int64_t *v, int n)
{
    int64_t *out = malloc(sizeof(*out) * (size_t)(n ? n : 1));

    if (out)
        memcpy(out, v, sizeof(*out) * (size_t)n);
    return out;
}

int rf_slice_inv_pack(const rf_inv *local, rf_side side, uint64_t generation,
                      Refit__Inventory *out)
{
    uint32_t nt = rf_inv_ntensors(local), ne = rf_inv_nendpoints(local);
    uint32_t nr = rf_inv_nregions(local), np = rf_inv_npieces(local, side);
    Refit__Inventory init = REFIT__INVENTORY__INIT;
    uint32_t i;

    *out = init;
    out->generation = generation;
    out->complete = true;
    out->tensors = calloc(nt ? nt : 1, sizeof(*out->tensors));
    out->endpoints = calloc(ne ? ne : 1, sizeof(*out->endpoints));
    out->regions = calloc(nr ? nr : 1, sizeof(*out->regions));
    out->pieces = calloc(np ? np : 1, sizeof(*out->pieces));
    if (!out->tensors || !out->endpoints || !out->regions || !out->pieces)
        goto nomem;

    for (i = 0; i < nt; i++) {
        const rf_tensor *t = rf_inv_tensor(local, i);
        Refit__TensorDesc *d = malloc(sizeof(*d));

        if (!d)
            goto nomem;
        refit__tensor_desc__init(d);
        out->tensors[out->n_tensors++] = d;
        d->name = strdup(t->name);
        d->dtype = t->dtype;
        d->n_shape = (size_t)t->ndim;
        d->shape = dup_dims(t->shape, t->ndim);
        if (!d->name || !d->shape)
            goto nomem;
    }
    for (i = 0; i < ne; i++) {
        Refit__EndpointDesc *d = malloc(sizeof(*d));

        if (!d)
            goto nomem;
        refit__endpoint_desc__init(d);
        out->endpoints[out->n_endpoints++] = d;
        d->local_id = i;
        d->device = strdup("host");
        if (!d->device)
            goto nomem;
    }
    for (i = 0; i < nr; i++) {
        const rf_region *r = rf_inv_region(local, i);
        Refit__RegionDesc *d = malloc(sizeof(*d));

        if (!d)
            goto nomem;
        refit__region_desc__init(d);
        out->regions[out->n_regions++] = d;
        d->local_id = i;
        d->endpoint = r->endpoint;
        d->size = r->size;
    }
    for (i = 0; i < np; i++) {
        Refit__PieceDesc *d = malloc(sizeof(*d));
        rf_piece p;
        int nd;

        if (!d)
            goto nomem;
        refit__piece_desc__init(d);
        out->pieces[out->n_pieces++] = d;
        rf_inv_piece(local, side, i, &p);
        nd = rf_inv_tensor(local, p.tensor)->ndim;
        d->tensor = p.tensor;
        d->region = p.region;
        d->offset = p.offset;
        d->n_start = d->n_extent = d->n_strides = (size_t)nd;
        d->start = dup_dims(p.box.start, nd);
        d->extent = dup_dims(p.box.extent, nd);
        d->strides = dup_dims(p.strides, nd);
        if (!d->start || !d->extent || !d->strides)
            goto nomem;
        if (p.quant) {
            const rf_quant_decl *q = rf_inv_quant(local, p.quant);

            d->quant_kind = (uint32_t)q->kind;
            d->quant_br = q->br;
            d->quant_bc = q->bc;
            d->scale_region = q->scale_region;
            d->scale_offset = q->scale_offset;
            d->n_scale_strides = (size_t)nd;
            if (!(d->scale_strides = dup_dims(q->scale_strides, nd)))
                goto nomem;
        }
    }
    return 0;

nomem:
    rf_slice_inv_msg_free(out);
    return -ENOMEM;
}

void rf_slice_inv_msg_free(Refit__Inventory *msg)
{
    size_t i;

    for (i = 0; i < msg->n_tensors; i++) {
        free(msg->tensors[i]->name);
        free(msg->tensors[i]->shape);
        free(msg->tensors[i]);
    }
    for (i = 0; i < msg->n_endpoints; i++) {
        free(msg->endpoints[i]->device);
        free(msg->endpoints[i]);
    }
    for (i = 0; i < msg->n_regions; i++)
        free(msg->regions[i]);
    for (i = 0; i < msg->n_pieces; i++) {
        free(msg->pieces[i]->start);
        free(msg->pieces[i]->extent);
        free(msg->pieces[i]->strides);
        free(msg->pieces[i]->scale_strides);
        free(msg->pieces[i]);
    }
    free(msg->tensors);
    free(msg->endpoints);
    free(msg->regions);
    free(msg->pieces);
    msg->tensors = NULL;
    msg->endpoints = NULL;
    msg->regions = NULL;
    msg->pieces = NULL;
    msg->n_tensors = msg->n_endpoints = msg->n_regions = msg->n_pieces = 0;
}

void rf_slice_map_free(rf_slice_map *map)
{
    free(map->members);
    free(map->ep_member);
    map->members = NULL;
    map->ep_member = NULL;
    map->nmembers = 0;
}

/* The FP8 declaration of piece i (description d, nd dims) of member m into p->quant. */
static int merge_quant(rf_inv *g, const rf_slice_member *mem, uint32_t m, size_t i,
                       const Refit__PieceDesc *d, const Refit__Inventory *in, int nd,
                       rf_piece *p, rf_err *err)
{
    rf_quant_decl q = {.kind = (int)d->quant_kind, .br = d->quant_br, .bc = d->quant_bc,
                       .scale_offset = d->scale_offset};
    int rc;

    if (d->scale_region >= in->n_regions || d->n_scale_strides != (size_t)nd)
        return rf_err_set(err, -EINVAL, "inventory of daemon %u: FP8 piece %zu of %s names "
                          "scale region %u of %zu with %zu scale strides for %d dims", m, i,
                          in->tensors[d->tensor]->name, d->scale_region, in->n_regions,
                          d->n_scale_strides, nd);
    q.scale_region = mem->region_base + d->scale_region;
    for (int k = 0; k < nd; k++)
        q.scale_strides[k] = d->scale_strides[k];
    if ((rc = rf_inv_add_quant(g, &q, &p->quant, err)) < 0)
        rf_err_wrap(err, "inventory of daemon %u: piece %zu: ", m, i);
    return rc;
}

/* Adds member m's inventory to the global one; tmap translates its tensor indices. */
static int merge_one(rf_inv *g, const Refit__Inventory *in, uint32_t m, rf_slice_member *mem,
                     rf_err *err)
{
    uint32_t *tmap = NULL;
    size_t i;
    int rc = 0;

    tmap = malloc(sizeof(*tmap) * (in->n_tensors ? in->n_tensors : 1));
    if (!tmap)
        return rf_err_set(err, -ENOMEM, "out of memory merging inventories");
    for (i = 0; i < in->n_tensors; i++) {
        const Refit__TensorDesc *t = in->tensors[i];
        rf_dtype dt = (rf_dtype)t->dtype;

        if (t->dtype >= RF_DT__COUNT || t->n_shape < 1 || t->n_shape > RF_MAX_DIMS) {
            rc = rf_err_set(err, -EINVAL, "daemon %u describes tensor %s with dtype %u and %zu "
                            "dims, which refit cannot hold", m, t->name, t->dtype, t->n_shape);
            goto out;
        }
        rc = rf_inv_add_tensor(g, t->name, dt, (int)t->n_shape, t->shape, &tmap[i], err);
        if (rc < 0) {
            rf_err_wrap(err, "inventory of daemon %u: ", m);
            goto out;
        }
    }
    mem->ep_base = rf_inv_nendpoints(g);
    mem->nep = (uint32_t)in->n_endpoints;
    for (i = 0; i < in->n_endpoints; i++) {
        uint32_t id;

        rc = rf_inv_add_endpoint(g, mem->side, m, &id, err);
        if (rc < 0)
            goto out;
    }
    mem->region_base = rf_inv_nregions(g);
    mem->nregion = (uint32_t)in->n_regions;
    for (i = 0; i < in->n_regions; i++) {
        const Refit__RegionDesc *r = in->regions[i];
        uint32_t id;

        if (r->endpoint >= in->n_endpoints) {
            rc = rf_err_set(err, -EINVAL, "inventory of daemon %u: region %zu names endpoint "
                            "%u of %zu", m, i, r->endpoint, in->n_endpoints);
            goto out;
        }
        rc = rf_inv_add_region(g, mem->ep_base + r->endpoint, r->size, &id, err);
        if (rc < 0)
            goto out;
    }
    mem->piece_base = rf_inv_npieces(g, mem->side);
    mem->npiece = (uint32_t)in->n_pieces;
    for (i = 0; i < in->n_pieces; i++) {
        const Refit__PieceDesc *d = in->pieces[i];
        rf_piece p;
        uint32_t id;
        int nd, k;

        if (d->tensor >= in->n_tensors || d->region >= in->n_regions) {
            rc = rf_err_set(err, -EINVAL, "inventory of daemon %u: piece %zu names tensor %u "
                            "of %zu and region %u of %zu", m, i, d->tensor, in->n_tensors,
                            d->region, in->n_regions);
            goto out;
        }
        nd = (int)in->tensors[d->tensor]->n_shape;
        if (d->n_start != (size_t)nd || d->n_extent != (size_t)nd || d->n_strides != (size_t)nd) {
            rc = rf_err_set(err, -EINVAL, "inventory of daemon %u: piece %zu of %s has %zu/%zu/"
                            "%zu start/extent/stride dims, the tensor has %d", m, i,
                            in->tensors[d->tensor]->name, d->n_start, d->n_extent,
                            d->n_strides, nd);
            goto out;
        }
        memset(&p, 0, sizeof(p));
        p.tensor = tmap[d->tensor];
        p.region = mem->region_base + d->region;
        p.offset = d->offset;
        for (k = 0; k < RF_MAX_DIMS; k++) {
            p.box.start[k] = k < nd ? d->start[k] : 0;
            p.box.extent[k] = k < nd ? d->extent[k] : 1;
            p.strides[k] = k < nd ? d->strides[k] : 0;
        }
        if (d->quant_kind != 0 && (rc = merge_quant(g, mem, m, i, d, in, nd, &p, err)) < 0)
            goto out;
        rc = rf_inv_add_piece(g, &p, &id, err);
        if (rc < 0) {
            rf_err_wrap(err, "inventory of daemon %u: ", m);
            goto out;
        }
    }
out:
    free(tmap);
    return rc;
}

int rf_slice_merge(Refit__Inventory *const *invs, const rf_side *sides, uint32_t nmembers,
                   rf_inv **global, rf_slice_map *map, rf_err *err)
{
    rf_inv *g = NULL;
    uint32_t m, e;
    int rc = 0;

    memset(map, 0, sizeof(*map));
    g = rf_inv_new();
    map->members = calloc(nmembers ? nmembers : 1, sizeof(*map->members));
    if (!g || !map->members) {
        rc = rf_err_set(err, -ENOMEM, "out of memory merging inventories");
        goto out;
    }
    map->nmembers = nmembers;
    for (m = 0; m < nmembers; m++) {
        map->members[m].side = sides[m];
        rc = merge_one(g, invs[m], m, &map->members[m], err);
        if (rc < 0)
            goto out;
    }
    map->ep_member = malloc(sizeof(*map->ep_member) * (rf_inv_nendpoints(g) + 1));
    if (!map->ep_member) {
        rc = rf_err_set(err, -ENOMEM, "out of memory merging inventories");
        goto out;
    }
    for (m = 0; m < nmembers; m++)
        for (e = 0; e < map->members[m].nep; e++)
            map->ep_member[map->members[m].ep_base + e] = m;
    rc = rf_inv_check_dst_overlap(g, err);
out:
    if (rc < 0) {
        rf_inv_free(g);
        rf_slice_map_free(map);
        g = NULL;
    }
    *global = g;
    return rc;
}

static void slice_xfer_free(Refit__SliceXfer *sx)
{
    for (size_t o = 0; o < sx->n_origins; o++) {
        free(sx->origins[o]->start);
        free(sx->origins[o]->extent);
        free(sx->origins[o]);
    }
    free(sx->origins);
    free(sx->relay_to);
    free(sx->start);
    free(sx->extent);
    free(sx);
}

static void slice_msg_del(Refit__SliceMsg *sm)
{
    for (size_t k = 0; k < sm->n_xfers; k++)
        slice_xfer_free(sm->xfers[k]);
    free(sm->xfers);
    free(sm);
}

void rf_slice_msg_free(Refit__PlanSlice *s)
{
    size_t i;

    if (!s)
        return;
    for (i = 0; i < s->n_msgs; i++)
        slice_msg_del(s->msgs[i]);
    for (i = 0; i < s->n_peers; i++) {
        free(s->peers[i]->data_addr);
        free(s->peers[i]->local_sock);
        free(s->peers[i]);
    }
    free(s->msgs);
    free(s->peers);
    free(s->ranks);
    free(s->plan_id.data);
    free(s->nccl_id.data);
    free(s);
}

/* The NCCL world: endpoints with a network (not local) message, ranked in endpoint order.
 * rank[ep] = its rank or UINT32_MAX; returns the world's size. */
static uint32_t world_ranks(const rf_plan *plan, uint32_t *rank)
{
    uint32_t ne = rf_inv_nendpoints(rf_plan_inv(plan)), i, n = 0;

    for (i = 0; i < ne; i++)
        rank[i] = UINT32_MAX;
    for (i = 0; i < rf_plan_nmsgs(plan); i++) {
        const rf_plan_msg *pm = rf_plan_msg_at(plan, i);

        if (pm->kind == RF_PLAN_LOCAL)
            continue;
        rank[pm->src_ep] = rank[pm->dst_ep] = 0;
    }
    for (i = 0; i < ne; i++)
        if (rank[i] == 0)
            rank[i] = n++;
    return n;
}

static Refit__PlanSlice *new_frame(const rf_plan *plan, const rf_slice_map *map,
                                   const rf_slice_peer *peers, uint64_t generation, uint32_t m,
                                   const uint8_t *nccl_id, const uint32_t *rank, uint32_t nranks)
{
    const rf_slice_member *me = &map->members[m];
    Refit__PlanSlice *s = malloc(sizeof(*s));
    uint32_t i;

    if (!s)
        return NULL;
    refit__plan_slice__init(s);
    s->rounds = rf_plan_nrounds(plan);
    s->generation = generation;
    s->global_ep_base = me->ep_base;
    s->nranks = nranks;
    s->ranks = malloc((me->nep ? me->nep : 1) * sizeof(*s->ranks));
    if (!s->ranks)
        goto fail;
    for (i = 0; i < me->nep; i++)
        s->ranks[i] = rank[me->ep_base + i] == UINT32_MAX ? nranks : rank[me->ep_base + i];
    s->n_ranks = me->nep;
    if (nccl_id) {
        s->nccl_id.data = malloc(RF_XFER_NCCL_ID_BYTES);
        if (!s->nccl_id.data)
            goto fail;
        memcpy(s->nccl_id.data, nccl_id, RF_XFER_NCCL_ID_BYTES);
        s->nccl_id.len = RF_XFER_NCCL_ID_BYTES;
    }
    s->plan_id.data = malloc(RF_PLAN_ID_BYTES);
    s->peers = calloc(map->nmembers, sizeof(*s->peers));
    if (!s->plan_id.data || !s->peers)
        goto fail;
    memcpy(s->plan_id.data, rf_plan_id(plan), RF_PLAN_ID_BYTES);
    s->plan_id.len = RF_PLAN_ID_BYTES;
    for (i = 0; i < map->nmembers; i++) {
        Refit__PeerAddr *p = malloc(sizeof(*p));

        if (!p)
            goto fail;
        refit__peer_addr__init(p);
        s->peers[s->n_peers++] = p;
        p->daemon_id = peers[i].daemon_id;
        p->role = peers[i].role;
        p->data_addr = strdup(peers[i].data_addr ? peers[i].data_addr : "");
        p->local_sock = strdup(peers[i].local_sock ? peers[i].local_sock : "");
        p->generation = peers[i].generation;
        if (!p->data_addr || !p->local_sock)
            goto fail;
    }
    return s;
fail:
    rf_slice_msg_free(s);
    return NULL;
}

static int push_frame(Refit__PlanSlice ***out, size_t *nout, size_t *cap, Refit__PlanSlice *s)
{
    if (*nout == *cap) {
        size_t ncap = *cap ? *cap * 2 : 4;
        Refit__PlanSlice **n = realloc(*out, ncap * sizeof(*n));

        if (!n)
            return -ENOMEM;
        *out = n;
        *cap = ncap;
    }
    (*out)[(*nout)++] = s;
    return 0;
}

/* Relays end to end (xfer.h, rf_xfer_origin): the tree of transfer i of plan message pm, and
 * how many entries its end (send) lists: the receiving end of a relay its tree's origins, the
 * sending end of an origin its tree's relays; 0 for any other. */
static uint32_t e2e_count(const rf_plan *plan, const rf_plan_msg *pm, uint64_t i, bool send,
                          uint32_t *chunk)
{
    const uint32_t *o, *r;
    uint32_t no, nr;

    *chunk = rf_plan_xfer_chunk(plan, i);
    if (*chunk == RF_PLAN_NO_CHUNK || pm->kind == RF_PLAN_LOCAL)
        return 0;
    rf_plan_chunk(plan, *chunk, &o, &no, &r, &nr);
    if (!send && pm->relay != 0)
        return no;
    return send && pm->relay == 0 ? nr : 0;
}

/* The end-to-end entries of transfer i (send: its end) into sx. -ENOMEM. */
static int slice_e2e(const rf_plan *plan, const rf_plan_msg *pm, uint64_t i, bool send, int nd,
                     Refit__SliceXfer *sx)
{
    const uint32_t *o, *r;
    uint32_t no, nr, c, n = e2e_count(plan, pm, i, send, &c);

    if (n == 0)
        return 0;
    sx->id = i;
    rf_plan_chunk(plan, c, &o, &no, &r, &nr);
    if (send) {
        if (!(sx->relay_to = malloc(n * sizeof(*sx->relay_to))))
            return -ENOMEM;
        for (uint32_t k = 0; k < n; k++)
            sx->relay_to[sx->n_relay_to++] = r[k];
        return 0;
    }
    if (!(sx->origins = calloc(n, sizeof(*sx->origins))))
        return -ENOMEM;
    for (uint32_t k = 0; k < n; k++) {
        const rf_plan_xfer *x = rf_plan_xfer_at(plan, o[k]);
        const rf_box *b = rf_plan_box(plan, x->box);
        Refit__SliceXfer__Origin *so = malloc(sizeof(*so));

        if (!so)
            return -ENOMEM;
        refit__slice_xfer__origin__init(so);
        sx->origins[sx->n_origins++] = so;
        so->id = o[k];
        so->seq = x->msg;
        so->n_start = so->n_extent = (size_t)nd;
        so->start = dup_dims(b->start, nd);
        so->extent = dup_dims(b->extent, nd);
        if (!so->start || !so->extent)
            return -ENOMEM;
    }
    return 0;
}

/* Member m's side of plan message seq: send says which end it is (a publisher always sends;
 * a receiver receives, and sends the relays it forwards, whose transfers' sources are its own
 * destination pieces, so piece ids translate through the member's one piece base either way). */
static Refit__SliceMsg *slice_msg_new(const rf_plan *plan, const rf_slice_map *map, uint32_t m,
                                      uint32_t seq, const uint32_t *rank, bool send)
{
    const rf_plan_msg *pm = rf_plan_msg_at(plan, seq);
    const rf_slice_member *me = &map->members[m];
    const rf_inv *inv = rf_plan_inv(plan);
    Refit__SliceMsg *sm = malloc(sizeof(*sm));
    uint32_t k;

    if (!sm)
        return NULL;
    refit__slice_msg__init(sm);
    sm->round = pm->round;
    sm->kind = pm->kind;
    sm->send = send;
    sm->local_ep = (send ? pm->src_ep : pm->dst_ep) - me->ep_base;
    sm->peer_ep = send ? pm->dst_ep : pm->src_ep;
    sm->peer = map->ep_member[sm->peer_ep];
    if (pm->kind != RF_PLAN_LOCAL)
        sm->peer_ep = rank[sm->peer_ep]; /* the other end's NCCL rank */
    sm->bytes = pm->bytes;
    sm->seq = seq;
    /* Every relay transfer is in a relay tree (rf_plan_chunk): its origins cover it. */
    sm->end_to_end = pm->relay != 0;
    sm->xfers = calloc(pm->count ? pm->count : 1, sizeof(*sm->xfers));
    if (!sm->xfers)
        goto fail;
    for (k = 0; k < pm->count; k++) {
        const rf_plan_xfer *x = rf_plan_xfer_at(plan, (uint64_t)pm->first + k);
        const rf_box *b = rf_plan_box(plan, x->box);
        uint32_t piece = send ? x->src : x->dst;
        int nd = rf_inv_tensor(inv, rf_inv_piece_tensor(inv, me->side, piece))->ndim;
        /* A relay's source is a destination piece, whose format is no transfer's. */
        const rf_quant_decl *dq = rf_inv_quant(inv, rf_inv_piece_recs(inv, RF_DST)[x->dst].quant);
        Refit__SliceXfer *sx = malloc(sizeof(*sx));

        if (!sx)
            goto fail;
        refit__slice_xfer__init(sx);
        sm->xfers[sm->n_xfers++] = sx;
        sx->piece = piece - me->piece_base;
        if (pm->kind == RF_PLAN_LOCAL)
            sx->src_piece = x->src - map->members[sm->peer].piece_base;
        sx->msg_off = x->msg_off;
        sx->bytes = x->bytes;
        if (dq != NULL) {
            sx->quant_kind = (uint32_t)dq->kind;
            sx->quant_br = dq->br;
            sx->quant_bc = dq->bc;
        }
        sx->n_start = sx->n_extent = (size_t)nd;
        sx->start = dup_dims(b->start, nd);
        sx->extent = dup_dims(b->extent, nd);
        if (!sx->start || !sx->extent ||
            slice_e2e(plan, pm, (uint64_t)pm->first + k, send, nd, sx) < 0)
            goto fail;
    }
    return sm;
fail:
    slice_msg_del(sm);
    return NULL;
}

/* What a message weighs against a frame's max_xfers: its transfers and their end-to-end
 * entries, each about one transfer's size on the wire or less. */
static size_t slice_msg_weight(const Refit__SliceMsg *sm)
{
    size_t w = sm->n_xfers;

    for (size_t k = 0; k < sm->n_xfers; k++)
        w += sm->xfers[k]->n_relay_to + sm->xfers[k]->n_origins;
    return w;
}

int rf_slice_build(const rf_plan *plan, const rf_slice_map *map, uint32_t m,
                   const rf_slice_peer *peers, uint64_t generation, uint32_t max_xfers,
                   const uint8_t *nccl_id, Refit__PlanSlice ***out, size_t *nout)
{
    const rf_slice_member *me = &map->members[m];
    uint32_t nmsgs = rf_plan_nmsgs(plan), i, nranks;
    uint32_t *rank = malloc((rf_inv_nendpoints(rf_plan_inv(plan)) + 1) * sizeof(*rank));
    Refit__PlanSlice *cur = NULL;
    size_t cap = 0, cur_msgs_cap = 0, cur_xfers = 0, w;
    int rc = 0;

    *out = NULL;
    *nout = 0;
    if (!rank)
        return -ENOMEM;
    nranks = world_ranks(plan, rank);
    cur = new_frame(plan, map, peers, generation, m, nccl_id, rank, nranks);
    if (!cur) {
        free(rank);
        return -ENOMEM;
    }
    for (i = 0; i < nmsgs * 2; i++) {
        /* Each message twice: its sending end, then its receiving end. A publisher is only
         * ever the first; a receiver the second, and the first of the relays it forwards (a
         * relay between two endpoints of one receiver is in its slice twice). */
        const rf_plan_msg *pm = rf_plan_msg_at(plan, i / 2);
        bool send = i % 2 == 0;
        uint32_t ep = send ? pm->src_ep : pm->dst_ep;
        Refit__SliceMsg *sm;

        if (ep < me->ep_base || ep >= me->ep_base + me->nep)
            continue;
        if (send != (me->side == RF_SRC) && !(send && pm->relay != 0))
            continue; /* only a relay has a receiver at its sending end */
        if (pm->kind == RF_PLAN_LOCAL && me->side == RF_SRC)
            continue; /* the receiver's daemon copies it */
        sm = slice_msg_new(plan, map, m, i / 2, rank, send);
        if (!sm) {
            rc = -ENOMEM;
            goto fail;
        }
        w = slice_msg_weight(sm);
        if (cur->n_msgs > 0 && cur_xfers + w > max_xfers) {
            rc = push_frame(out, nout, &cap, cur);
            cur = rc < 0 ? cur : new_frame(plan, map, peers, generation, m, nccl_id, rank,
                                           nranks);
            cur_msgs_cap = 0;
            cur_xfers = 0;
            if (rc == 0 && !cur)
                rc = -ENOMEM;
        }
        if (rc == 0 && cur->n_msgs == cur_msgs_cap) {
            size_t ncap = cur_msgs_cap ? cur_msgs_cap * 2 : 64;
            Refit__SliceMsg **n = realloc(cur->msgs, ncap * sizeof(*n));

            if (n) {
                cur->msgs = n;
                cur_msgs_cap = ncap;
            } else {
                rc = -ENOMEM;
            }
        }
        if (rc < 0) {
            slice_msg_del(sm); /* in no frame yet */
            goto fail;
        }
        cur->msgs[cur->n_msgs++] = sm;
        cur_xfers += w;
    }
    cur->last = true;
    rc = push_frame(out, nout, &cap, cur);
    if (rc < 0)
        goto fail;
    free(rank);
    return 0;
fail:
    free(rank);
    rf_slice_msg_free(cur);
    while (*nout > 0)
        rf_slice_msg_free((*out)[--(*nout)]);
    free(*out);
    *out = NULL;
    return rc;
}

void rf_slice_job_init(rf_slice_job *j)
{
    memset(j, 0, sizeof(*j));
}

static void free_msgs(rf_xfer_job *job)
{
    uint32_t i;

    for (i = 0; i < job->nmsgs; i++) {
        free(job->msgs[i].items);
        free(job->msgs[i].src_items);
    }
    free(job->msgs);
}

void rf_slice_job_reset(rf_slice_job *j)
{
    uint32_t i;

    for (i = 0; i < j->nshadows; i++)
        rf_qshadow_free(&j->shadows[i].mem);
    free(j->shadows);
    free(j->qruns);
    free_msgs(&j->job);
    free_msgs(&j->ljob);
    for (i = 0; i < j->npeers; i++) {
        free((char *)j->peers[i].data_addr);
        free((char *)j->peers[i].local_sock);
    }
    free(j->peers);
    free(j->ranks);
    rf_slice_job_init(j);
}

/* The tensor's dtype and matrix, for a quantized item. */
static void quant_matrix(const rf_tensor *t, rf_xfer_quant *x)
{
    x->dt = t->dtype;
    x->rows = t->ndim >= 2 ? t->shape[t->ndim - 2] : 0;
    x->cols = t->ndim >= 2 ? t->shape[t->ndim - 1] : 0;
}

/* An item into an FP8 piece of inv: its element size, format and scales' memory. */
static void quant_dst(const rf_inv *inv, const rf_tensor *t, uint8_t *const *bases,
                      rf_xfer_item *it)
{
    it->esize = 1;
    it->quant.q = *rf_inv_quant(inv, it->piece.quant);
    quant_matrix(t, &it->quant);
    rf_inv_quant_scales(inv, &it->piece, &it->quant.scale);
    it->quant.scale_base = bases[it->quant.scale.region];
}

/* The source side of a local transfer into FP8 item d quantizes with d's format; a trainer's
 * FP8 piece (its own declaration already resolved by quant_dst) copies its elements and scales
 * and is left as it is. */
static void quant_src_of(const rf_xfer_item *d, rf_xfer_item *s)
{
    if (s->piece.quant != 0)
        return;
    memset(&s->quant, 0, sizeof(s->quant));
    if (d->quant.q.kind == 0)
        return;
    s->quant.q.kind = d->quant.q.kind;
    s->quant.q.br = d->quant.q.br;
    s->quant.q.bc = d->quant.q.bc;
    s->quant.dt = d->quant.dt;
    s->quant.rows = d->quant.rows;
    s->quant.cols = d->quant.cols;
}

/* Whether box of tensor t lies on FP8 format (kind, br, bc)'s grid: the planner's test of who
 * quantizes (on the grid: the sender; off it: the receiver, from the tensor's dtype). */
static bool on_grid(int kind, uint32_t br, uint32_t bc, const rf_tensor *t, const rf_box *b)
{
    rf_quant_fmt f = {kind, br, bc};
    int L = t->ndim - 2;

    return rf_quant_box_ok(&f, (uint64_t)t->shape[L], (uint64_t)t->shape[L + 1],
                           (uint64_t)b->start[L], (uint64_t)b->start[L + 1],
                           (uint64_t)b->extent[L], (uint64_t)b->extent[L + 1], NULL) == 0;
}

/* Without daemons there is no slice job to keep a shadow in. */
static int off_grid(const rf_tensor *t, rf_err *err)
{
    return rf_err_set(err, -ENOTSUP, "%s: the plan quantizes it on the receiver (the trainers' "
                      "shards cut its FP8 blocks), which needs a daemon's slice job; plans run "
                      "without daemons take engine shards on the trainers' boundaries", t->name);
}

/* Room for one more element of *p (n in use, *cap allocated, esz bytes each): doubled when full. */
static int grow_one(void **p, uint64_t *cap, uint64_t n, size_t esz, rf_err *err)
{
    uint64_t ncap = *cap ? *cap * 2 : 8;
    void *q;

    if (n < *cap)
        return 0;
    if (!(q = realloc(*p, ncap * esz)))
        return rf_err_set(err, -ENOMEM, "out of memory for the plan slice");
    *p = q;
    *cap = ncap;
    return 0;
}

/* The shadow of FP8 item it (its piece, local id piece), made on first use: *out its index. */
static int shadow_of(rf_slice_job *j, uint32_t piece, const rf_xfer_item *it,
                     const rf_tensor *t, uint32_t *out, rf_err *err)
{
    rf_slice_shadow *sh;
    int64_t st = 1;
    uint64_t bytes;
    rf_err e = {0};
    int rc;

    for (uint32_t i = 0; i < j->nshadows; i++)
        if (j->shadows[i].piece == piece) {
            *out = i;
            return 0;
        }
    if (it->quant.scale.strides[t->ndim - 1] != 1)
        return rf_err_set(err, -ENOTSUP, "%s: quantizing on the receiver needs the FP8 piece's "
                          "scales contiguous along their rows (stride %lld)", t->name,
                          (long long)it->quant.scale.strides[t->ndim - 1]);
    if ((rc = grow_one((void **)&j->shadows, &j->cap_shadows, j->nshadows, sizeof(*sh), err)) < 0)
        return rc;
    sh = &j->shadows[j->nshadows];
    memset(sh, 0, sizeof(*sh));
    sh->piece = piece;
    sh->fp8 = *it;
    sh->dense = it->piece;
    sh->dense.quant = 0;
    sh->dense.offset = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        sh->dense.strides[d] = st;
        st *= it->piece.box.extent[d];
    }
    bytes = (uint64_t)st * rf_dtype_size(t->dtype);
    /* In the piece's memory: it->base is its region's, host or GPU. */
    if ((rc = rf_qshadow_alloc(&sh->mem, it->base, bytes, &e)) < 0)
        return rf_err_set(err, rc, "the shadow of FP8 piece %s: %s", t->name, e.msg);
    j->shadow_bytes += bytes;
    *out = j->nshadows++;
    return 0;
}

/* Receiving end of a transfer off FP8 item it's grid: it lands in the piece's shadow, in the
 * tensor's dtype, and the hull of its box on the grid is a run of blocks to quantize. */
static int shadow_item(rf_slice_job *j, uint32_t piece, const rf_tensor *t, rf_xfer_item *it,
                       rf_err *err)
{
    rf_quant_fmt f = {it->quant.q.kind, it->quant.q.br, it->quant.q.bc};
    int L = t->ndim - 2;
    uint64_t step[2];
    uint32_t si = 0;
    rf_slice_qrun *q;
    int rc;

    if (!j)
        return rf_err_set(err, -EPROTO, "%s: a transfer off its FP8 grid on the sending side",
                          t->name);
    if ((rc = shadow_of(j, piece, it, t, &si, err)) < 0)
        return rc;
    if ((rc = grow_one((void **)&j->qruns, &j->cap_qruns, j->nqruns, sizeof(*q), err)) < 0)
        return rc;
    q = &j->qruns[j->nqruns++];
    memset(q, 0, sizeof(*q));
    q->shadow = si;
    q->box = it->box;
    rf_quant_fmt_block(&f, (uint64_t)t->shape[L], (uint64_t)t->shape[L + 1], &step[0], &step[1]);
    for (int d = L; d < L + 2; d++) {
        int64_t a = it->box.start[d] / (int64_t)step[d - L] * (int64_t)step[d - L];
        int64_t b = (it->box.start[d] + it->box.extent[d] + (int64_t)step[d - L] - 1) /
                    (int64_t)step[d - L] * (int64_t)step[d - L];

        b = b < t->shape[d] ? b : t->shape[d];
        q->box.start[d] = a;
        q->box.extent[d] = b - a;
    }
    it->base = j->shadows[si].mem.buf;
    it->piece = j->shadows[si].dense;
    it->esize = rf_dtype_size(t->dtype);
    memset(&it->quant, 0, sizeof(it->quant));
    return 0;
}

/* One transfer's side of local memory: piece of inv (side), box from the slice. j (NULL
 * where the slice has no job) keeps the shadows of FP8 pieces quantized here. */
static int resolve_item(rf_slice_job *j, const Refit__SliceMsg *sm, const Refit__SliceXfer *sx,
                        uint32_t piece, const rf_inv *inv, rf_side side, uint8_t *const *bases,
                        rf_xfer_item *it, rf_err *err)
{
    const rf_tensor *t;
    int d;

    if (piece >= rf_inv_npieces(inv, side))
        return rf_err_set(err, -EPROTO, "plan slice message %u names %s piece %u, the %s "
                          "holds %u: the plan is stale", sm->seq,
                          side == RF_SRC ? "source" : "local", piece,
                          side == RF_SRC ? "publisher" : "daemon", rf_inv_npieces(inv, side));
    rf_inv_piece(inv, side, piece, &it->piece);
    t = rf_inv_tensor(inv, it->piece.tensor);
    if (sx->n_start != (size_t)t->ndim || sx->n_extent != (size_t)t->ndim)
        return rf_err_set(err, -EPROTO, "plan slice box for %s has %zu dims, the tensor %d",
                          t->name, sx->n_start, t->ndim);
    it->ndim = t->ndim;
    it->esize = rf_dtype_size(t->dtype);
    for (d = 0; d < RF_MAX_DIMS; d++) {
        it->box.start[d] = d < t->ndim ? sx->start[d] : 0;
        it->box.extent[d] = d < t->ndim ? sx->extent[d] : 1;
    }
    if (!rf_box_contains(&it->piece.box, &it->box, t->ndim))
        return rf_err_set(err, -EPROTO, "plan slice moves a box of %s outside the %s piece: "
                          "the plan is stale", t->name, side == RF_SRC ? "source" : "local");
    it->base = bases[it->piece.region];
    it->msg_off = sx->msg_off;
    it->bytes = sx->bytes;
    memset(&it->quant, 0, sizeof(it->quant));
    if (it->piece.quant != 0) {
        /* An engine's FP8 piece, or a trainer's, whose bytes and scales are sent as they are. */
        quant_dst(inv, t, bases, it);
        if ((int)sx->quant_kind != it->quant.q.kind ||
            (sx->quant_kind != 0 && (sx->quant_br != it->quant.q.br ||
                                     sx->quant_bc != it->quant.q.bc)))
            return rf_err_set(err, -EPROTO, "plan slice message %u moves %s as %s its FP8 "
                              "piece: the plan is stale", sm->seq, t->name,
                              sx->quant_kind ? "another format than" : "plain bytes into");
        if (!on_grid(it->quant.q.kind, it->quant.q.br, it->quant.q.bc, t, &it->box))
            return shadow_item(side == RF_DST ? j : NULL, piece, t, it, err);
    } else if (sx->quant_kind != 0 &&
               on_grid((int)sx->quant_kind, sx->quant_br, sx->quant_bc, t, &it->box)) {
        /* The sending end of a transfer into an FP8 piece quantizes it. */
        it->quant.q.kind = (int)sx->quant_kind;
        it->quant.q.br = sx->quant_br;
        it->quant.q.bc = sx->quant_bc;
        quant_matrix(t, &it->quant);
    }
    return 0;
}

/* n items and the end-to-end entries they list (rf_xfer_origin), in one block that freeing
 * the items releases. */
static rf_xfer_item *items_alloc(size_t n, size_t norigins, size_t nrelay_to,
                                 rf_xfer_origin **origins, uint64_t **relay_to)
{
    size_t a = (n ? n : 1) * sizeof(rf_xfer_item), b = norigins * sizeof(rf_xfer_origin);
    uint8_t *p = calloc(1, a + b + nrelay_to * sizeof(uint64_t));

    if (!p)
        return NULL;
    *origins = (rf_xfer_origin *)(p + a);
    *relay_to = (uint64_t *)(p + a + b);
    return (rf_xfer_item *)p;
}

/* Transfer sx's end-to-end entries into item it (resolved), from the room at *o and *r on. */
static int resolve_e2e(const Refit__SliceMsg *sm, const Refit__SliceXfer *sx, rf_xfer_item *it,
                       const rf_inv *inv, rf_xfer_origin **o, uint64_t **r, rf_err *err)
{
    if (sx->n_origins == 0 && sx->n_relay_to == 0)
        return 0;
    it->id = sx->id;
    if (sx->n_relay_to > 0) {
        memcpy(*r, sx->relay_to, sx->n_relay_to * sizeof(**r));
        it->relay_to = *r;
        it->nrelay_to = (uint32_t)sx->n_relay_to;
        *r += sx->n_relay_to;
    }
    if (sx->n_origins == 0)
        return 0;
    it->origins = *o;
    for (size_t k = 0; k < sx->n_origins; k++) {
        const Refit__SliceXfer__Origin *so = sx->origins[k];
        rf_xfer_origin *x = &(*o)[k];

        if (so->n_start != (size_t)it->ndim || so->n_extent != (size_t)it->ndim)
            return rf_err_set(err, -EPROTO, "plan slice message %u relays %s from an origin "
                              "transfer whose box has %zu dims, the tensor %d: the plan is "
                              "stale", sm->seq, rf_inv_tensor(inv, it->piece.tensor)->name,
                              so->n_start, it->ndim);
        x->id = so->id;
        x->seq = so->seq;
        for (int d = 0; d < RF_MAX_DIMS; d++) {
            x->box.start[d] = d < it->ndim ? so->start[d] : 0;
            x->box.extent[d] = d < it->ndim ? so->extent[d] : 1;
        }
    }
    it->norigins = (uint32_t)sx->n_origins;
    *o += sx->n_origins;
    return 0;
}

static int grow_msgs(rf_xfer_job *job, uint32_t *cap, size_t more, rf_err *err)
{
    uint32_t ncap = *cap ? *cap : 64;
    rf_xfer_msg *n;

    if (job->nmsgs + more <= *cap)
        return 0;
    while (ncap < job->nmsgs + more)
        ncap *= 2;
    n = realloc(job->msgs, ncap * sizeof(*n));
    if (!n)
        return rf_err_set(err, -ENOMEM, "out of memory for the plan slice");
    job->msgs = n;
    *cap = ncap;
    return 0;
}

static int first_frame(rf_slice_job *j, const Refit__PlanSlice *frame, rf_err *err)
{
    size_t i;

    memcpy(j->plan_id, frame->plan_id.data, RF_PLAN_ID_BYTES);
    j->generation = frame->generation;
    j->job.nrounds = frame->rounds;
    j->ljob.nrounds = 1;
    j->ep_base = frame->global_ep_base;
    j->nranks = frame->nranks;
    j->has_nccl_id = frame->nccl_id.len == RF_XFER_NCCL_ID_BYTES;
    if (j->has_nccl_id)
        memcpy(j->nccl_id, frame->nccl_id.data, RF_XFER_NCCL_ID_BYTES);
    j->ranks = malloc((frame->n_ranks ? frame->n_ranks : 1) * sizeof(*j->ranks));
    j->peers = calloc(frame->n_peers ? frame->n_peers : 1, sizeof(*j->peers));
    if (!j->peers || !j->ranks)
        return rf_err_set(err, -ENOMEM, "out of memory for the plan slice");
    for (i = 0; i < frame->n_ranks; i++) {
        if (frame->ranks[i] > frame->nranks)
            return rf_err_set(err, -EPROTO, "plan slice gives local endpoint %zu rank %u of %u",
                              i, frame->ranks[i], frame->nranks);
        j->ranks[i] = frame->ranks[i];
    }
    j->nlocal_eps = (uint32_t)frame->n_ranks;
    for (i = 0; i < frame->n_peers; i++) {
        j->peers[i].daemon_id = frame->peers[i]->daemon_id;
        j->peers[i].role = frame->peers[i]->role;
        j->peers[i].generation = frame->peers[i]->generation;
        j->peers[i].data_addr = strdup(frame->peers[i]->data_addr);
        j->peers[i].local_sock = strdup(frame->peers[i]->local_sock);
        j->npeers++;
        if (!j->peers[i].data_addr || !j->peers[i].local_sock)
            return rf_err_set(err, -ENOMEM, "out of memory for the plan slice");
    }
    return 0;
}

static void qruns_unique(rf_slice_job *j);

int rf_slice_job_add(rf_slice_job *j, const Refit__PlanSlice *frame, const rf_inv *local,
                     rf_side side, uint8_t *const *bases, const rf_slice_src *srcs,
                     rf_err *err)
{
    size_t i, k;
    int rc;

    if (j->complete)
        rf_slice_job_reset(j);
    if (frame->plan_id.len != RF_PLAN_ID_BYTES)
        return rf_err_set(err, -EPROTO, "plan slice carries a plan id of %zu bytes, not %d",
                          frame->plan_id.len, RF_PLAN_ID_BYTES);
    if (j->job.nmsgs == 0 && j->ljob.nmsgs == 0 && j->npeers == 0) {
        if ((rc = first_frame(j, frame, err)) < 0)
            return rc;
    } else if (memcmp(j->plan_id, frame->plan_id.data, RF_PLAN_ID_BYTES) != 0) {
        return rf_err_set(err, -EPROTO, "plan slice frame belongs to another plan than the "
                          "frames before it");
    }
    if ((rc = grow_msgs(&j->job, &j->cap_msgs, frame->n_msgs, err)) < 0 ||
        (rc = grow_msgs(&j->ljob, &j->cap_lmsgs, frame->n_msgs, err)) < 0)
        return rc;
    for (i = 0; i < frame->n_msgs; i++) {
        const Refit__SliceMsg *sm = frame->msgs[i];
        bool is_local = sm->kind == RF_PLAN_LOCAL;
        rf_xfer_job *job = is_local ? &j->ljob : &j->job;
        rf_xfer_msg *xm = &job->msgs[job->nmsgs];
        rf_xfer_origin *orig = NULL;
        uint64_t *relay_to = NULL;
        size_t norig = 0, nrelay_to = 0;

        memset(xm, 0, sizeof(*xm));
        if (sm->peer >= j->npeers)
            return rf_err_set(err, -EPROTO, "plan slice message %u names peer %u of %u",
                              sm->seq, sm->peer, j->npeers);
        if (sm->local_ep >= j->nlocal_eps)
            return rf_err_set(err, -EPROTO, "plan slice message %u names local endpoint %u of "
                              "%u", sm->seq, sm->local_ep, j->nlocal_eps);
        if (is_local && (side != RF_DST || sm->send))
            return rf_err_set(err, -EPROTO, "plan slice message %u is a local copy, which only "
                              "the receiving daemon runs", sm->seq);
        if (is_local && (!srcs || !srcs[sm->peer].inv))
            return rf_err_set(err, -EPROTO, "plan slice message %u copies from publisher %u, "
                              "whose memory this daemon has not mapped", sm->seq, sm->peer);
        xm->seq = sm->seq;
        xm->round = sm->round;
        xm->kind = sm->kind;
        xm->send = sm->send;
        xm->peer = sm->peer;
        /* NCCL ranks; a local message keeps global endpoint ids (only logs read them). */
        xm->ep = is_local ? frame->global_ep_base + sm->local_ep : j->ranks[sm->local_ep];
        xm->peer_ep = sm->peer_ep;
        xm->bytes = sm->bytes;
        xm->e2e = sm->end_to_end;
        for (k = 0; k < sm->n_xfers; k++) {
            norig += sm->xfers[k]->n_origins;
            nrelay_to += sm->xfers[k]->n_relay_to;
        }
        xm->items = items_alloc(sm->n_xfers, norig, nrelay_to, &orig, &relay_to);
        if (is_local)
            xm->src_items = calloc(sm->n_xfers ? sm->n_xfers : 1, sizeof(*xm->src_items));
        job->nmsgs++;
        if (!xm->items || (is_local && !xm->src_items))
            return rf_err_set(err, -ENOMEM, "out of memory for the plan slice");
        for (k = 0; k < sm->n_xfers; k++) {
            const Refit__SliceXfer *sx = sm->xfers[k];

            rc = resolve_item(j, sm, sx, sx->piece, local, side, bases, &xm->items[k], err);
            if (rc == 0)
                rc = resolve_e2e(sm, sx, &xm->items[k], local, &orig, &relay_to, err);
            /* A relay reads what this daemon installed; memory only its engine's process
             * maps (an in-process region, no base here) cannot be forwarded. */
            if (rc == 0 && sm->send && side == RF_DST && xm->items[k].base == NULL)
                rc = rf_err_set(err, -EOPNOTSUPP, "plan slice message %u relays %s from "
                                "local endpoint %u, whose memory is in-process in its engine "
                                "(MEM_INPROC) and cannot be read by this daemon; run the "
                                "coordinator with relay = off, or register shareable memory",
                                sm->seq,
                                rf_inv_tensor(local, xm->items[k].piece.tensor)->name,
                                sm->local_ep);
            if (rc == 0 && is_local) {
                const rf_slice_src *src = &srcs[sm->peer];

                rc = resolve_item(NULL, sm, sx, sx->src_piece, src->inv, RF_SRC, src->bases,
                                  &xm->src_items[k], err);
                /* A publisherd grants only the regions asked for: one missing here means the
                 * export was asked for other pieces than this frame reads. */
                if (rc == 0 && (xm->src_items[k].base == NULL ||
                                (xm->src_items[k].piece.quant != 0 &&
                                 xm->src_items[k].quant.scale_base == NULL)))
                    rc = rf_err_set(err, -EACCES, "plan slice message %u copies %s from trainer "
                                    "memory of publisher %u that was not granted to this "
                                    "process", sm->seq,
                                    rf_inv_tensor(src->inv,
                                                  xm->src_items[k].piece.tensor)->name,
                                    sm->peer);
                if (rc == 0)
                    quant_src_of(&xm->items[k], &xm->src_items[k]);
                if (rc == 0 &&
                    strcmp(rf_inv_tensor(src->inv, xm->src_items[k].piece.tensor)->name,
                           rf_inv_tensor(local, xm->items[k].piece.tensor)->name) != 0)
                    rc = rf_err_set(err, -EPROTO, "plan slice message %u copies %s into %s: "
                                    "the plan is stale", sm->seq,
                                    rf_inv_tensor(src->inv, xm->src_items[k].piece.tensor)->name,
                                    rf_inv_tensor(local, xm->items[k].piece.tensor)->name);
            }
            if (rc < 0)
                return rc;
            xm->nitems++;
        }
        if (is_local)
            j->lbytes += sm->bytes;
        else
            j->bytes += sm->bytes;
    }
    if (frame->last) {
        j->complete = true;
        qruns_unique(j);
    }
    return 0;
}

static int qrun_cmp(const void *a, const void *b)
{
    return memcmp(a, b, sizeof(rf_slice_qrun));
}

/* Transfers of one box cut into slabs, or of neighbouring boxes, often share a hull. */
static void qruns_unique(rf_slice_job *j)
{
    uint64_t n = 0;

    if (j->nqruns == 0)
        return;
    qsort(j->qruns, j->nqruns, sizeof(*j->qruns), qrun_cmp);
    for (uint64_t i = 0; i < j->nqruns; i++)
        if (n == 0 || qrun_cmp(&j->qruns[n - 1], &j->qruns[i]) != 0)
            j->qruns[n++] = j->qruns[i];
    j->nqruns = n;
}

int rf_slice_job_quantize(rf_slice_job *j, rf_err *err)
{
    uint8_t *buf = NULL;
    uint64_t cap = 0;
    int rc = 0;

    for (uint64_t i = 0; i < j->nqruns && rc == 0; i++) {
        const rf_slice_qrun *q = &j->qruns[i];
        const rf_slice_shadow *sh = &j->shadows[q->shadow];
        rf_xfer_item src = {0}, dst = sh->fp8;

        /* The run's blocks lie whole in the shadow: every transfer into a block a shard
         * boundary cuts is off the grid too, so it landed there. */
        src.base = sh->mem.buf;
        src.piece = sh->dense;
        src.ndim = dst.ndim;
        src.esize = rf_dtype_size(dst.quant.dt);
        src.box = q->box;
        src.quant = dst.quant;
        dst.box = q->box;
        src.bytes = dst.bytes = rf_qcopy_bytes(&dst.quant.q, dst.ndim, dst.quant.rows,
                                               dst.quant.cols, &q->box, NULL);
        rc = rf_qshadow_quantize(&sh->mem, &src, &dst, &buf, &cap, err);
    }
    free(buf);
    return rc;
}

int rf_slice_msg_from_plan(const rf_plan *plan, uint32_t mi, rf_side side,
                           uint8_t *const *bases, uint32_t peer, rf_xfer_msg *out, rf_err *err)
{
    const rf_inv *inv = rf_plan_inv(plan);
    const rf_plan_msg *pm = rf_plan_msg_at(plan, mi);
    /* A relay's sending end reads destination pieces. */
    rf_side pside = pm->relay ? RF_DST : side;
    bool send = side == RF_SRC;
    rf_xfer_origin *orig = NULL;
    uint64_t *relay_to = NULL;
    size_t ne2e = 0;
    uint32_t c;

    *out = (rf_xfer_msg){.seq = mi, .round = pm->round, .kind = pm->kind,
                         .send = send, .peer = peer, .bytes = pm->bytes, .e2e = pm->relay != 0,
                         .nitems = pm->count, .ep = side == RF_SRC ? pm->src_ep : pm->dst_ep,
                         .peer_ep = side == RF_SRC ? pm->dst_ep : pm->src_ep};
    for (uint32_t k = 0; k < pm->count; k++)
        ne2e += e2e_count(plan, pm, (uint64_t)pm->first + k, send, &c);
    out->items = items_alloc(pm->count, send ? 0 : ne2e, send ? ne2e : 0, &orig, &relay_to);
    if (!out->items)
        return rf_err_set(err, -ENOMEM, "out of memory for the %u items of message %u",
                          pm->count, mi);
    for (uint32_t k = 0; k < pm->count; k++) {
        const rf_plan_xfer *x = rf_plan_xfer_at(plan, (uint64_t)pm->first + k);
        rf_xfer_item *it = &out->items[k];
        const rf_tensor *t;
        const uint32_t *o, *r;
        uint32_t no, nr, n = e2e_count(plan, pm, (uint64_t)pm->first + k, send, &c);

        rf_inv_piece(inv, pside, side == RF_SRC ? x->src : x->dst, &it->piece);
        t = rf_inv_tensor(inv, it->piece.tensor);
        it->base = bases[it->piece.region];
        it->ndim = t->ndim;
        it->esize = rf_dtype_size(t->dtype);
        it->box = *rf_plan_box(plan, x->box);
        it->msg_off = x->msg_off;
        it->bytes = x->bytes;
        if (n > 0) {
            it->id = (uint64_t)pm->first + k;
            rf_plan_chunk(plan, c, &o, &no, &r, &nr);
            for (uint32_t e = 0; e < n && send; e++)
                relay_to[e] = r[e];
            for (uint32_t e = 0; e < n && !send; e++) {
                const rf_plan_xfer *ox = rf_plan_xfer_at(plan, o[e]);

                orig[e] = (rf_xfer_origin){.id = o[e], .seq = ox->msg,
                                           .box = *rf_plan_box(plan, ox->box)};
            }
            if (send) {
                it->relay_to = relay_to;
                it->nrelay_to = n;
                relay_to += n;
            } else {
                it->origins = orig;
                it->norigins = n;
                orig += n;
            }
        }
        if (rf_inv_piece_recs(inv, RF_DST)[x->dst].quant != 0) {
            rf_xfer_item d = {0};

            if (side == RF_DST) {
                quant_dst(inv, t, bases, it);
            } else {
                rf_inv_piece(inv, RF_DST, x->dst, &d.piece);
                quant_dst(inv, t, bases, &d);
                if (it->piece.quant != 0)
                    quant_dst(inv, t, bases, it);
                quant_src_of(&d, it);
            }
            if (!on_grid(side == RF_DST ? it->quant.q.kind : d.quant.q.kind,
                         side == RF_DST ? it->quant.q.br : d.quant.q.br,
                         side == RF_DST ? it->quant.q.bc : d.quant.q.bc, t, &it->box)) {
                free(out->items);
                out->items = NULL;
                return off_grid(t, err);
            }
        }
    }
    return 0;
}

void rf_slice_local_job_free(rf_xfer_job *job)
{
    free_msgs(job);
    job->msgs = NULL;
    job->nmsgs = 0;
}

int rf_slice_local_job_from_plan(const rf_plan *plan, uint8_t *const *bases, rf_xfer_job *job,
                                 rf_err *err)
{
    const rf_inv *inv = rf_plan_inv(plan);
    uint32_t mi, k;

    job->nrounds = rf_plan_nrounds(plan);
    job->nmsgs = 0;
    job->msgs = calloc(rf_plan_nmsgs(plan) ? rf_plan_nmsgs(plan) : 1, sizeof(*job->msgs));
    if (!job->msgs)
        return rf_err_set(err, -ENOMEM, "out of memory for a local job of %u messages",
                          rf_plan_nmsgs(plan));
    for (mi = 0; mi < rf_plan_nmsgs(plan); mi++) {
        const rf_plan_msg *pm = rf_plan_msg_at(plan, mi);
        rf_xfer_msg *m = &job->msgs[job->nmsgs++];
        uint64_t off = 0;

        *m = (rf_xfer_msg){.seq = mi, .round = pm->round, .kind = RF_PLAN_LOCAL,
                           .ep = pm->dst_ep, .peer_ep = pm->src_ep, .nitems = pm->count};
        m->items = calloc(pm->count ? pm->count : 1, sizeof(*m->items));
        m->src_items = calloc(pm->count ? pm->count : 1, sizeof(*m->src_items));
        if (!m->items || !m->src_items) {
            rf_slice_local_job_free(job);
            return rf_err_set(err, -ENOMEM, "out of memory for a local job");
        }
        for (k = 0; k < pm->count; k++) {
            const rf_plan_xfer *x = rf_plan_xfer_at(plan, (uint64_t)pm->first + k);
            rf_xfer_item *d = &m->items[k], *sr = &m->src_items[k];
            const rf_tensor *t;

            rf_inv_piece(inv, RF_DST, x->dst, &d->piece);
            rf_inv_piece(inv, pm->relay ? RF_DST : RF_SRC, x->src, &sr->piece);
            t = rf_inv_tensor(inv, d->piece.tensor);
            d->base = bases[d->piece.region];
            sr->base = bases[sr->piece.region];
            d->ndim = sr->ndim = t->ndim;
            d->esize = sr->esize = rf_dtype_size(t->dtype);
            d->box = sr->box = *rf_plan_box(plan, x->box);
            d->msg_off = sr->msg_off = off;
            d->bytes = sr->bytes = x->bytes;
            if (d->piece.quant != 0) {
                quant_dst(inv, t, bases, d);
                if (sr->piece.quant != 0)
                    quant_dst(inv, t, bases, sr);
                quant_src_of(d, sr);
                if (!on_grid(d->quant.q.kind, d->quant.q.br, d->quant.q.bc, t, &d->box)) {
                    rf_slice_local_job_free(job);
                    return off_grid(t, err);
                }
            }
            off += x->bytes;
        }
        m->bytes = off;
    }
    return 0;
}
