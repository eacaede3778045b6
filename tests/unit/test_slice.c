/* tests/unit/test_slice.c - the bridge between the plan and the daemons on real model ranks:
 * inventories through their wire form and the coordinator's merge, refusals of inventories
 * that do not fit together, and every member's plan slice through the wire into the job it
 * becomes, compared item by item with the plan itself. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "member_inv.h"
#include "model.h"
#include "plan.h"
#include "slice.h"

/* Two publishers (trainer tp=2, a rank each) and two receivers (engine tp=4, two ranks each). */
#define NMEM 4

typedef struct member_def {
    rf_side side;
    int first, n;
    const char *layout;
} member_def;

static const member_def defs[NMEM] = {
    {RF_SRC, 0, 1, "tp=2"}, {RF_SRC, 1, 1, "tp=2"}, {RF_DST, 0, 2, "tp=4"}, {RF_DST, 2, 2, "tp=4"},
};

static rf_model *model;
static rf_inv *local[NMEM];
static Refit__Inventory *wire[NMEM]; /* each member's inventory, packed and unpacked again */
static rf_side sides[NMEM];

static rf_inv *member_inv(const member_def *d)
{
    return test_member_inv(model, d->layout, d->side, d->first, d->n);
}

/* msg through its bytes, as a daemon's inventory reaches the coordinator. */
static Refit__Inventory *through_wire(const Refit__Inventory *msg)
{
    size_t len = refit__inventory__get_packed_size(msg);
    uint8_t *buf = malloc(len ? len : 1);
    Refit__Inventory *out;

    cr_assert_not_null(buf);
    refit__inventory__pack(msg, buf);
    out = refit__inventory__unpack(NULL, len, buf);
    free(buf);
    cr_assert_not_null(out);
    return out;
}

static void setup(void)
{
    rf_model *full = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_model_load("qwen3-0.6b", &full, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_shrink(full, 16, &model, &err), 0, "%s", err.msg);
    rf_model_free(full);
    for (int m = 0; m < NMEM; m++) {
        Refit__Inventory msg;

        sides[m] = defs[m].side;
        local[m] = member_inv(&defs[m]);
        cr_assert_eq(rf_slice_inv_pack(local[m], sides[m], 10 + (uint64_t)m, &msg), 0);
        wire[m] = through_wire(&msg);
        rf_slice_inv_msg_free(&msg);
    }
}

static void teardown(void)
{
    for (int m = 0; m < NMEM; m++) {
        refit__inventory__free_unpacked(wire[m], NULL);
        rf_inv_free(local[m]);
    }
    rf_model_free(model);
}

TestSuite(slice, .init = setup, .fini = teardown);

static void same_piece(const rf_inv *a, const rf_piece *pa, const rf_inv *b, const rf_piece *pb,
                       uint32_t region_shift, const char *what)
{
    const rf_tensor *ta = rf_inv_tensor(a, pa->tensor), *tb = rf_inv_tensor(b, pb->tensor);

    cr_assert_str_eq(ta->name, tb->name, "%s: tensor %s became %s", what, ta->name, tb->name);
    cr_assert(rf_box_equal(&pa->box, &pb->box, ta->ndim), "%s: the box of %s changed", what,
              ta->name);
    cr_assert_eq(memcmp(pa->strides, pb->strides, sizeof(pa->strides)), 0,
                 "%s: the strides of %s changed", what, ta->name);
    cr_assert_eq(pa->offset, pb->offset);
    cr_assert_eq(pa->region + region_shift, pb->region, "%s: %s moved from region %u to %u",
                 what, ta->name, pa->region, pb->region);
}

Test(slice, an_inventory_survives_the_wire_and_a_merge_of_itself)
{
    Refit__Inventory *one[1] = {wire[0]};
    rf_slice_map map = {0};
    rf_inv *g = NULL;
    rf_err err = {0};
    rf_piece pa, pb;

    cr_assert_eq(wire[0]->generation, 10);
    cr_assert(wire[0]->complete);
    cr_assert_eq(rf_slice_merge(one, sides, 1, &g, &map, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_ntensors(g), rf_inv_ntensors(local[0]));
    cr_assert_eq(rf_inv_nendpoints(g), rf_inv_nendpoints(local[0]));
    cr_assert_eq(rf_inv_nregions(g), rf_inv_nregions(local[0]));
    cr_assert_eq(rf_inv_npieces(g, RF_SRC), rf_inv_npieces(local[0], RF_SRC));
    cr_assert_gt(rf_inv_npieces(g, RF_SRC), 100, "the rank holds the model's pieces");
    for (uint32_t r = 0; r < rf_inv_nregions(g); r++)
        cr_assert_eq(rf_inv_region(g, r)->size, rf_inv_region(local[0], r)->size);
    for (uint32_t i = 0; i < rf_inv_npieces(g, RF_SRC); i++) {
        rf_inv_piece(local[0], RF_SRC, i, &pa);
        rf_inv_piece(g, RF_SRC, i, &pb);
        same_piece(local[0], &pa, g, &pb, 0, "round trip");
    }
    rf_inv_free(g);
    rf_slice_map_free(&map);
}

Test(slice, the_merge_places_each_member_after_the_ones_before)
{
    rf_slice_map map = {0};
    rf_inv *g = NULL;
    rf_err err = {0};
    uint32_t eps = 0, regions = 0, pieces[2] = {0, 0};

    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), 0, "%s", err.msg);
    cr_assert_eq(map.nmembers, NMEM);
    cr_assert_eq(rf_inv_ntensors(g), rf_model_ntensors(model), "members share the tensors");
    for (uint32_t m = 0; m < NMEM; m++) {
        const rf_slice_member *me = &map.members[m];

        cr_assert_eq(me->side, sides[m]);
        cr_assert_eq(me->ep_base, eps);
        cr_assert_eq(me->nep, (uint32_t)defs[m].n);
        cr_assert_eq(me->region_base, regions);
        cr_assert_eq(me->piece_base, pieces[sides[m]]);
        cr_assert_eq(me->npiece, rf_inv_npieces(local[m], sides[m]));
        for (uint32_t e = 0; e < me->nep; e++) {
            cr_assert_eq(map.ep_member[me->ep_base + e], m);
            cr_assert_eq(rf_inv_endpoint(g, me->ep_base + e)->node, m,
                         "member %u's endpoints are node %u", m, m);
            cr_assert_eq(rf_inv_endpoint(g, me->ep_base + e)->side, sides[m]);
        }
        for (uint32_t i = 0; i < me->npiece; i++) {
            rf_piece pa, pb;

            rf_inv_piece(local[m], sides[m], i, &pa);
            rf_inv_piece(g, sides[m], me->piece_base + i, &pb);
            same_piece(local[m], &pa, g, &pb, me->region_base, "merge");
        }
        eps += me->nep;
        regions += me->nregion;
        pieces[sides[m]] += me->npiece;
    }
    cr_assert_eq(rf_inv_nendpoints(g), eps);
    cr_assert_eq(rf_inv_nregions(g), regions);
    rf_inv_free(g);
    rf_slice_map_free(&map);
}

Test(slice, inventories_that_do_not_fit_together_are_refused_naming_the_daemon)
{
    rf_slice_map map = {0};
    rf_inv *g = (rf_inv *)1;
    rf_err err = {0};
    int64_t saved;
    uint32_t saved_u;

    /* Daemon 1 describes a tensor with another shape than daemon 0. */
    saved = wire[1]->tensors[3]->shape[0];
    wire[1]->tensors[3]->shape[0] = saved + 1;
    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), -EINVAL);
    cr_assert_null(g);
    cr_assert(strstr(err.msg, "inventory of daemon 1: "), "%s", err.msg);
    cr_assert(strstr(err.msg, wire[1]->tensors[3]->name), "%s", err.msg);
    wire[1]->tensors[3]->shape[0] = saved;
    /* A region on an endpoint the daemon did not send. */
    saved_u = wire[2]->regions[0]->endpoint;
    wire[2]->regions[0]->endpoint = 9;
    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), -EINVAL);
    cr_assert(strstr(err.msg, "inventory of daemon 2: region 0 names endpoint 9 of 2"), "%s",
              err.msg);
    wire[2]->regions[0]->endpoint = saved_u;
    /* A piece in a region the daemon did not send. */
    saved_u = wire[3]->pieces[5]->region;
    wire[3]->pieces[5]->region = 1000;
    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), -EINVAL);
    cr_assert(strstr(err.msg, "inventory of daemon 3: piece 5 names"), "%s", err.msg);
    wire[3]->pieces[5]->region = saved_u;
    /* Restored, they merge. */
    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), 0, "%s", err.msg);
    rf_inv_free(g);
    rf_slice_map_free(&map);
}

/* A frame through its bytes, as a slice reaches a daemon. */
static Refit__PlanSlice *frame_through_wire(const Refit__PlanSlice *f)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT, *back;
    Refit__PlanSlice *out;
    size_t len;
    uint8_t *buf;

    env.body_case = REFIT__ENVELOPE__BODY_PLAN_SLICE;
    env.plan_slice = (Refit__PlanSlice *)f;
    len = refit__envelope__get_packed_size(&env);
    buf = malloc(len);
    cr_assert_not_null(buf);
    refit__envelope__pack(&env, buf);
    back = refit__envelope__unpack(NULL, len, buf);
    free(buf);
    cr_assert_not_null(back);
    cr_assert_eq(back->body_case, REFIT__ENVELOPE__BODY_PLAN_SLICE);
    out = back->plan_slice;
    back->plan_slice = NULL;
    back->body_case = REFIT__ENVELOPE__BODY__NOT_SET;
    refit__envelope__free_unpacked(back, NULL);
    return out;
}

Test(slice, every_members_slice_becomes_the_plans_messages_on_its_side)
{
    static const char *addrs[NMEM] = {"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"};
    rf_slice_peer peers[NMEM];
    uint8_t **bases[NMEM], **gbases;
    rf_slice_map map = {0};
    rf_plan_opts opts;
    rf_plan *plan = NULL;
    rf_inv *g = NULL;
    rf_err err = {0};
    uint64_t sent = 0, recvd = 0;
    uint32_t msgs_seen = 0;

    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), 0, "%s", err.msg);
    rf_plan_opts_default(&opts);
    /* Small enough that both kinds of message and several rounds occur. */
    opts.staging_bytes = 1 << 20;
    opts.direct_min_bytes = 64 << 10;
    cr_assert_eq(rf_plan_build(g, &opts, &plan, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_plan_nrounds(plan), 1);
    gbases = calloc(rf_inv_nregions(g), sizeof(*gbases));
    for (uint32_t m = 0; m < NMEM; m++) {
        peers[m] = (rf_slice_peer){.daemon_id = 100 + m, .data_addr = addrs[m],
                                   .role = sides[m] == RF_SRC ? REFIT__ROLE__ROLE_PUBLISHER
                                                              : REFIT__ROLE__ROLE_RECEIVER};
        bases[m] = calloc(rf_inv_nregions(local[m]), sizeof(*bases[m]));
        for (uint32_t r = 0; r < rf_inv_nregions(local[m]); r++) {
            bases[m][r] = malloc(rf_inv_region(local[m], r)->size);
            cr_assert_not_null(bases[m][r]);
            gbases[map.members[m].region_base + r] = bases[m][r];
        }
    }
    for (uint32_t m = 0; m < NMEM; m++) {
        Refit__PlanSlice **frames = NULL;
        rf_slice_job job;
        size_t n = 0;

        /* At most 200 transfers a frame: a slice of several frames. */
        cr_assert_eq(rf_slice_build(plan, &map, m, peers, 10 + m, 200, NULL, &frames, &n), 0);
        cr_assert_gt(n, 1, "member %u's slice fits one frame; the test wants several", m);
        rf_slice_job_init(&job);
        for (size_t f = 0; f < n; f++) {
            Refit__PlanSlice *back = frame_through_wire(frames[f]);

            cr_assert_eq(back->last, f + 1 == n);
            cr_assert(!job.complete);
            cr_assert_eq(rf_slice_job_add(&job, back, local[m], sides[m], bases[m], NULL, &err), 0,
                         "member %u frame %zu: %s", m, f, err.msg);
            refit__plan_slice__free_unpacked(back, NULL);
            rf_slice_msg_free(frames[f]);
        }
        free(frames);
        cr_assert(job.complete);
        cr_assert_eq(memcmp(job.plan_id, rf_plan_id(plan), 32), 0);
        cr_assert_eq(job.generation, 10 + m);
        cr_assert_eq(job.ep_base, map.members[m].ep_base);
        cr_assert_eq(job.nranks, rf_inv_nendpoints(g));
        cr_assert_eq(job.npeers, NMEM);
        for (uint32_t p = 0; p < NMEM; p++) {
            cr_assert_eq(job.peers[p].daemon_id, 100 + p);
            cr_assert_str_eq(job.peers[p].data_addr, addrs[p]);
        }
        cr_assert_eq(job.job.nrounds, rf_plan_nrounds(plan));
        cr_assert_eq(rf_xfer_job_check(&job.job, NMEM, &err), 0, "member %u: %s", m, err.msg);
        /* Each message is the plan's message of that seq, seen from this side. */
        for (uint32_t i = 0; i < job.job.nmsgs; i++) {
            const rf_xfer_msg *xm = &job.job.msgs[i];
            const rf_plan_msg *pm = rf_plan_msg_at(plan, xm->seq);
            rf_xfer_msg want;

            cr_assert_eq(xm->send, sides[m] == RF_SRC);
            cr_assert_eq(map.ep_member[xm->send ? pm->src_ep : pm->dst_ep], m);
            cr_assert_eq(xm->peer, map.ep_member[xm->send ? pm->dst_ep : pm->src_ep]);
            cr_assert_eq(rf_slice_msg_from_plan(plan, xm->seq, sides[m], gbases, xm->peer,
                                                &want, &err), 0);
            cr_assert_eq(xm->ep, want.ep);
            cr_assert_eq(xm->peer_ep, want.peer_ep);
            cr_assert_eq(xm->round, want.round);
            cr_assert_eq(xm->kind, want.kind);
            cr_assert_eq(xm->bytes, want.bytes);
            cr_assert_eq(xm->nitems, want.nitems);
            for (uint32_t k = 0; k < xm->nitems; k++) {
                const rf_xfer_item *a = &xm->items[k], *b = &want.items[k];

                cr_assert_eq(a->base, b->base, "seq %u item %u lies in another region",
                             xm->seq, k);
                cr_assert_eq(a->ndim, b->ndim);
                cr_assert_eq(a->esize, b->esize);
                cr_assert(rf_box_equal(&a->box, &b->box, a->ndim));
                cr_assert(rf_box_equal(&a->piece.box, &b->piece.box, a->ndim));
                cr_assert_eq(a->piece.offset, b->piece.offset);
                cr_assert_eq(memcmp(a->piece.strides, b->piece.strides,
                                    sizeof(a->piece.strides)), 0);
                cr_assert_eq(a->msg_off, b->msg_off);
                cr_assert_eq(a->bytes, b->bytes);
            }
            free(want.items);
            if (xm->send)
                sent += xm->bytes;
            else
                recvd += xm->bytes;
            msgs_seen++;
        }
        rf_slice_job_reset(&job);
    }
    /* Every message was in exactly two slices, its sender's and its receiver's. */
    cr_assert_eq(msgs_seen, 2 * rf_plan_nmsgs(plan));
    cr_assert_eq(sent, rf_plan_stats_get(plan)->dst_bytes);
    cr_assert_eq(recvd, rf_plan_stats_get(plan)->dst_bytes);
    for (uint32_t m = 0; m < NMEM; m++) {
        for (uint32_t r = 0; r < rf_inv_nregions(local[m]); r++)
            free(bases[m][r]);
        free(bases[m]);
    }
    free(gbases);
    rf_plan_free(plan);
    rf_inv_free(g);
    rf_slice_map_free(&map);
}

Test(slice, a_frame_of_another_plan_or_a_stale_piece_is_refused)
{
    Refit__PlanSlice **frames = NULL;
    uint8_t **bases;
    rf_slice_peer peers[NMEM];
    rf_slice_map map = {0};
    rf_plan_opts opts;
    rf_plan *plan = NULL;
    rf_inv *g = NULL;
    rf_err err = {0};
    rf_slice_job job;
    size_t n = 0;
    uint32_t saved;

    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), 0, "%s", err.msg);
    rf_plan_opts_default(&opts);
    cr_assert_eq(rf_plan_build(g, &opts, &plan, &err), 0, "%s", err.msg);
    for (uint32_t m = 0; m < NMEM; m++)
        peers[m] = (rf_slice_peer){.daemon_id = 100 + m, .data_addr = "",
                                   .role = REFIT__ROLE__ROLE_PUBLISHER};
    cr_assert_eq(rf_slice_build(plan, &map, 2, peers, 1, 100, NULL, &frames, &n), 0);
    cr_assert_gt(n, 1);
    bases = calloc(rf_inv_nregions(local[2]), sizeof(*bases));
    for (uint32_t r = 0; r < rf_inv_nregions(local[2]); r++)
        bases[r] = (uint8_t *)(uintptr_t)(4096 * (r + 1)); /* never dereferenced here */
    rf_slice_job_init(&job);
    cr_assert_eq(rf_slice_job_add(&job, frames[0], local[2], RF_DST, bases, NULL, &err), 0, "%s",
                 err.msg);
    /* The second frame claims another plan. */
    frames[1]->plan_id.data[0] ^= 0xff;
    cr_assert_eq(rf_slice_job_add(&job, frames[1], local[2], RF_DST, bases, NULL, &err), -EPROTO);
    cr_assert(strstr(err.msg, "belongs to another plan"), "%s", err.msg);
    frames[1]->plan_id.data[0] ^= 0xff;
    /* A piece this daemon does not hold (its inventory changed under the plan). */
    rf_slice_job_reset(&job);
    saved = frames[0]->msgs[0]->xfers[0]->piece;
    frames[0]->msgs[0]->xfers[0]->piece = rf_inv_npieces(local[2], RF_DST);
    cr_assert_eq(rf_slice_job_add(&job, frames[0], local[2], RF_DST, bases, NULL, &err), -EPROTO);
    cr_assert(strstr(err.msg, "the plan is stale"), "%s", err.msg);
    frames[0]->msgs[0]->xfers[0]->piece = saved;
    rf_slice_job_reset(&job);
    for (size_t f = 0; f < n; f++)
        rf_slice_msg_free(frames[f]);
    free(frames);
    free(bases);
    rf_plan_free(plan);
    rf_inv_free(g);
    rf_slice_map_free(&map);
}

/* Same-host copies: publisher 0 and receiverd 2 on one host, publisher 1 and receiverd 3 each on
 * a host of its own. Receiverd 2's slice holds its local copies (source pieces in publisher 0's
 * ids, resolved against publisher 0's memory as the daemon maps it), nobody else's; publishers
 * never see local messages; the NCCL world holds only endpoints with network messages. */
Test(slice, local_copies_go_to_the_receivers_slice_with_their_source_pieces)
{
    static const uint32_t host[NMEM] = {0, 1, 0, 2};
    rf_slice_peer peers[NMEM];
    uint8_t **bases[NMEM], **gbases;
    rf_slice_map map = {0};
    rf_plan_opts opts;
    rf_plan *plan = NULL;
    rf_inv *g = NULL;
    rf_err err = {0};
    uint64_t local_bytes = 0, net_recv = 0;
    uint32_t e, with_net = 0;

    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), 0, "%s", err.msg);
    for (e = 0; e < rf_inv_nendpoints(g); e++)
        cr_assert_eq(rf_inv_set_endpoint_host(g, e, host[map.ep_member[e]], &err), 0);
    cr_assert_eq(rf_inv_set_endpoint_host(g, e, 0, &err), -EINVAL);
    rf_plan_opts_default(&opts);
    cr_assert_eq(rf_plan_build(g, &opts, &plan, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_plan_stats_get(plan)->local_bytes, 0);
    cr_assert_lt(rf_plan_stats_get(plan)->local_bytes, rf_plan_stats_get(plan)->dst_bytes);
    /* Endpoints with a network message: the world. */
    for (e = 0; e < rf_inv_nendpoints(g); e++) {
        bool net = false;

        for (uint32_t i = 0; i < rf_plan_nmsgs(plan); i++) {
            const rf_plan_msg *pm = rf_plan_msg_at(plan, i);

            net |= pm->kind != RF_PLAN_LOCAL && (pm->src_ep == e || pm->dst_ep == e);
        }
        with_net += net;
    }
    gbases = calloc(rf_inv_nregions(g), sizeof(*gbases));
    for (uint32_t m = 0; m < NMEM; m++) {
        peers[m] = (rf_slice_peer){.daemon_id = 100 + m, .data_addr = "",
                                   .role = sides[m] == RF_SRC ? REFIT__ROLE__ROLE_PUBLISHER
                                                              : REFIT__ROLE__ROLE_RECEIVER,
                                   .local_sock = m == 0 ? "/run/pub0.sock" : "",
                                   .generation = 7 + m};
        bases[m] = calloc(rf_inv_nregions(local[m]), sizeof(*bases[m]));
        for (uint32_t r = 0; r < rf_inv_nregions(local[m]); r++) {
            bases[m][r] = (uint8_t *)(uintptr_t)(((uint64_t)m << 32) + 4096 * (r + 1));
            gbases[map.members[m].region_base + r] = bases[m][r];
        }
    }
    for (uint32_t m = 0; m < NMEM; m++) {
        Refit__PlanSlice **frames = NULL;
        rf_slice_src srcs[NMEM] = {{0}};
        rf_slice_job job;
        size_t n = 0;

        srcs[0] = (rf_slice_src){.inv = local[0], .bases = bases[0]};
        cr_assert_eq(rf_slice_build(plan, &map, m, peers, 1, 100000, NULL, &frames, &n), 0);
        rf_slice_job_init(&job);
        for (size_t f = 0; f < n; f++) {
            Refit__PlanSlice *back = frame_through_wire(frames[f]);
            bool has_local = false;

            for (size_t i = 0; i < back->n_msgs; i++)
                has_local |= back->msgs[i]->kind == RF_PLAN_LOCAL;
            if (has_local) {
                rf_slice_job scratch;

                /* Without the publisher's memory mapped, or on the trainers' side: refused. */
                rf_slice_job_init(&scratch);
                cr_assert_eq(rf_slice_job_add(&scratch, back, local[m], sides[m], bases[m], NULL,
                                              &err), -EPROTO);
                cr_assert(strstr(err.msg, "has not mapped"), "%s", err.msg);
                rf_slice_job_reset(&scratch);
                cr_assert_eq(rf_slice_job_add(&scratch, back, local[m], RF_SRC, bases[m], srcs,
                                              &err), -EPROTO);
                cr_assert(strstr(err.msg, "only the receiving daemon"), "%s", err.msg);
                rf_slice_job_reset(&scratch);
            }
            cr_assert_eq(rf_slice_job_add(&job, back, local[m], sides[m], bases[m], srcs, &err),
                         0, "member %u: %s", m, err.msg);
            refit__plan_slice__free_unpacked(back, NULL);
            rf_slice_msg_free(frames[f]);
        }
        free(frames);
        cr_assert(job.complete);
        cr_assert_eq(job.nranks, with_net);
        cr_assert_eq(job.nlocal_eps, map.members[m].nep);
        cr_assert_str_eq(job.peers[0].local_sock, "/run/pub0.sock");
        cr_assert_eq(job.peers[0].generation, 7);
        if (m != 2)
            cr_assert_eq(job.ljob.nmsgs, 0, "member %u got local copies", m);
        else
            cr_assert_gt(job.ljob.nmsgs, 0);
        cr_assert_eq(rf_xfer_job_check(&job.job, NMEM, &err), 0, "%s", err.msg);
        for (uint32_t i = 0; i < job.ljob.nmsgs; i++) {
            const rf_xfer_msg *xm = &job.ljob.msgs[i];
            rf_xfer_msg want_dst, want_src;

            cr_assert_eq(xm->kind, RF_PLAN_LOCAL);
            cr_assert(!xm->send);
            cr_assert_eq(xm->peer, 0);
            cr_assert_eq(rf_slice_msg_from_plan(plan, xm->seq, RF_DST, gbases, 0, &want_dst,
                                                &err), 0);
            cr_assert_eq(rf_slice_msg_from_plan(plan, xm->seq, RF_SRC, gbases, 0, &want_src,
                                                &err), 0);
            cr_assert_eq(xm->nitems, want_dst.nitems);
            for (uint32_t k = 0; k < xm->nitems; k++) {
                cr_assert_eq(xm->items[k].base, want_dst.items[k].base);
                cr_assert_eq(xm->src_items[k].base, want_src.items[k].base,
                             "seq %u item %u reads another region", xm->seq, k);
                cr_assert_eq(xm->src_items[k].piece.offset, want_src.items[k].piece.offset);
                cr_assert(rf_box_equal(&xm->src_items[k].box, &xm->items[k].box,
                                       xm->items[k].ndim));
            }
            free(want_dst.items);
            free(want_src.items);
            local_bytes += xm->bytes;
        }
        for (uint32_t i = 0; i < job.job.nmsgs; i++) {
            cr_assert_neq(job.job.msgs[i].kind, RF_PLAN_LOCAL);
            cr_assert_lt(job.job.msgs[i].ep, with_net, "a network message outside the world");
            if (!job.job.msgs[i].send)
                net_recv += job.job.msgs[i].bytes;
        }
        rf_slice_job_reset(&job);
    }
    cr_assert_eq(local_bytes, rf_plan_stats_get(plan)->local_bytes);
    cr_assert_eq(local_bytes + net_recv, rf_plan_stats_get(plan)->dst_bytes);
    for (uint32_t m = 0; m < NMEM; m++)
        free(bases[m]);
    free(gbases);
    rf_plan_free(plan);
    rf_inv_free(g);
    rf_slice_map_free(&map);
}

/* Relays: one trainer (tp=1) feeds four engine replicas (tp=1 each, a receiverd each). With
 * relays on, a receiver's slice holds the relays it forwards (send = true, items in its own
 * destination pieces, resolved against its own memory) beside what it receives; a
 * publisher's slice is what the plan has it send. Every message is in exactly two slices'
 * jobs, and an engine's in-process memory (no base in the daemon) cannot be a relay's
 * source: the slice is refused, naming it. */
#define RELAY_MEM 5

Test(slice, a_receivers_slice_holds_the_relays_it_forwards)
{
    static const member_def rdefs[RELAY_MEM] = {
        {RF_SRC, 0, 1, "tp=1"}, {RF_DST, 0, 1, "tp=1"}, {RF_DST, 0, 1, "tp=1"},
        {RF_DST, 0, 1, "tp=1"}, {RF_DST, 0, 1, "tp=1"},
    };
    rf_inv *rlocal[RELAY_MEM];
    Refit__Inventory *rwire[RELAY_MEM];
    rf_side rsides[RELAY_MEM];
    rf_slice_peer peers[RELAY_MEM];
    uint8_t **bases[RELAY_MEM], **gbases;
    rf_slice_map map = {0};
    rf_plan_opts opts;
    rf_plan *plan = NULL;
    rf_inv *g = NULL;
    rf_err err = {0};
    uint64_t sent = 0, recvd = 0, relayed = 0, origins = 0, relay_to = 0;
    uint32_t msgs_seen = 0, m;
    bool refused = false, bad_dims = false;

    for (m = 0; m < RELAY_MEM; m++) {
        Refit__Inventory msg;

        rsides[m] = rdefs[m].side;
        rlocal[m] = member_inv(&rdefs[m]);
        cr_assert_eq(rf_slice_inv_pack(rlocal[m], rsides[m], 1, &msg), 0);
        rwire[m] = through_wire(&msg);
        rf_slice_inv_msg_free(&msg);
    }
    cr_assert_eq(rf_slice_merge(rwire, rsides, RELAY_MEM, &g, &map, &err), 0, "%s", err.msg);
    rf_plan_opts_default(&opts);
    opts.staging_bytes = 1 << 20;
    opts.direct_min_bytes = 64 << 10;
    opts.relay = 1;
    cr_assert_eq(rf_plan_build(g, &opts, &plan, &err), 0, "%s", err.msg);
    cr_assert_gt(rf_plan_stats_get(plan)->relay_messages, 0, "the plan relays nothing");
    cr_assert_lt(rf_plan_stats_get(plan)->source_bytes, rf_plan_stats_get(plan)->dst_bytes);
    gbases = calloc(rf_inv_nregions(g), sizeof(*gbases));
    for (m = 0; m < RELAY_MEM; m++) {
        peers[m] = (rf_slice_peer){.daemon_id = 100 + m, .data_addr = "",
                                   .role = rsides[m] == RF_SRC ? REFIT__ROLE__ROLE_PUBLISHER
                                                               : REFIT__ROLE__ROLE_RECEIVER};
        bases[m] = calloc(rf_inv_nregions(rlocal[m]), sizeof(*bases[m]));
        for (uint32_t r = 0; r < rf_inv_nregions(rlocal[m]); r++) {
            bases[m][r] = (uint8_t *)(uintptr_t)(((uint64_t)(m + 1) << 32) + 4096 * (r + 1));
            gbases[map.members[m].region_base + r] = bases[m][r];
        }
    }
    for (m = 0; m < RELAY_MEM; m++) {
        Refit__PlanSlice **frames = NULL;
        rf_slice_job job;
        uint64_t want_sends = 0, want_recvs = 0, sends = 0, recvs = 0;
        size_t n = 0;

        for (uint32_t i = 0; i < rf_plan_nmsgs(plan); i++) {
            const rf_plan_msg *pm = rf_plan_msg_at(plan, i);

            want_sends += map.ep_member[pm->src_ep] == m;
            want_recvs += map.ep_member[pm->dst_ep] == m;
        }
        cr_assert_eq(rf_slice_build(plan, &map, m, peers, 1, 300, NULL, &frames, &n), 0);
        rf_slice_job_init(&job);
        for (size_t f = 0; f < n; f++) {
            Refit__PlanSlice *back = frame_through_wire(frames[f]);
            size_t weight = 0;

            /* A frame holds at most 300 transfers and end-to-end entries (one message of more
             * goes alone). */
            for (size_t i = 0; i < back->n_msgs; i++)
                for (size_t k = 0; k < back->msgs[i]->n_xfers; k++)
                    weight += 1 + back->msgs[i]->xfers[k]->n_relay_to +
                              back->msgs[i]->xfers[k]->n_origins;
            cr_assert(weight <= 300 || back->n_msgs == 1, "member %u frame %zu weighs %zu", m,
                      f, weight);
            /* An origin whose box has another number of dims than its tensor: refused. */
            for (size_t i = 0; i < back->n_msgs && !bad_dims; i++) {
                Refit__SliceXfer *sx = back->msgs[i]->xfers[0];
                rf_slice_job scratch;

                if (sx->n_origins == 0)
                    continue;
                sx->origins[0]->n_start--;
                rf_slice_job_init(&scratch);
                cr_assert_eq(rf_slice_job_add(&scratch, back, rlocal[m], rsides[m], bases[m],
                                              NULL, &err), -EPROTO);
                cr_assert(strstr(err.msg, "from an origin transfer whose box has 1 dims, the "
                                 "tensor 2: the plan is stale"), "%s", err.msg);
                rf_slice_job_reset(&scratch);
                sx->origins[0]->n_start++;
                bad_dims = true;
            }
            cr_assert_eq(rf_slice_job_add(&job, back, rlocal[m], rsides[m], bases[m], NULL,
                                          &err), 0, "member %u frame %zu: %s", m, f, err.msg);
            /* The same frame with the memory of a relay's source in-process: refused. */
            for (size_t i = 0; i < back->n_msgs && !refused; i++) {
                const Refit__SliceMsg *sm = back->msgs[i];
                if (!sm->send || rsides[m] != RF_DST)
                    continue;
                {
                    rf_piece p;
                    rf_slice_job scratch;
                    uint8_t *saved;

                    rf_inv_piece(rlocal[m], RF_DST, sm->xfers[0]->piece, &p);
                    saved = bases[m][p.region];
                    bases[m][p.region] = NULL;
                    rf_slice_job_init(&scratch);
                    cr_assert_eq(rf_slice_job_add(&scratch, back, rlocal[m], RF_DST, bases[m],
                                                  NULL, &err), -EOPNOTSUPP);
                    cr_assert(strstr(err.msg, "in-process in its engine (MEM_INPROC)"), "%s",
                              err.msg);
                    cr_assert(strstr(err.msg, "relay = off"), "%s", err.msg);
                    rf_slice_job_reset(&scratch);
                    bases[m][p.region] = saved;
                    refused = true;
                }
            }
            refit__plan_slice__free_unpacked(back, NULL);
            rf_slice_msg_free(frames[f]);
        }
        free(frames);
        cr_assert(job.complete);
        cr_assert_eq(rf_xfer_job_check(&job.job, RELAY_MEM, &err), 0, "member %u: %s", m,
                     err.msg);
        for (uint32_t i = 0; i < job.job.nmsgs; i++) {
            const rf_xfer_msg *xm = &job.job.msgs[i];
            const rf_plan_msg *pm = rf_plan_msg_at(plan, xm->seq);
            rf_xfer_msg want;

            cr_assert_eq(map.ep_member[xm->send ? pm->src_ep : pm->dst_ep], m);
            cr_assert_eq(xm->peer, map.ep_member[xm->send ? pm->dst_ep : pm->src_ep]);
            if (rsides[m] == RF_SRC)
                cr_assert(xm->send && !pm->relay, "a publisher got seq %u", xm->seq);
            else if (xm->send)
                cr_assert(pm->relay, "receiver %u sends seq %u, which is no relay", m, xm->seq);
            /* The sending end of a relay reads this member's own destination memory. */
            cr_assert_eq(rf_slice_msg_from_plan(plan, xm->seq, xm->send ? RF_SRC : RF_DST,
                                                gbases, xm->peer, &want, &err), 0);
            cr_assert_eq(xm->round, want.round);
            cr_assert_eq(xm->bytes, want.bytes);
            cr_assert_eq(xm->nitems, want.nitems);
            /* A relay message has no message digest at either end: its ends check it. */
            cr_assert_eq(xm->e2e, pm->relay != 0, "seq %u", xm->seq);
            cr_assert_eq(want.e2e, xm->e2e);
            for (uint32_t k = 0; k < xm->nitems; k++) {
                cr_assert_eq(xm->items[k].base, want.items[k].base,
                             "seq %u item %u lies in another region", xm->seq, k);
                cr_assert_eq(xm->items[k].piece.offset, want.items[k].piece.offset);
                cr_assert(rf_box_equal(&xm->items[k].box, &want.items[k].box,
                                       xm->items[k].ndim));
                cr_assert_eq(xm->items[k].msg_off, want.items[k].msg_off);
                /* The relay trees' ends: the same as the plan gives without daemons. */
                cr_assert_eq(xm->items[k].norigins, want.items[k].norigins, "seq %u", xm->seq);
                cr_assert_eq(xm->items[k].nrelay_to, want.items[k].nrelay_to, "seq %u", xm->seq);
                if (xm->items[k].norigins || xm->items[k].nrelay_to)
                    cr_assert_eq(xm->items[k].id, want.items[k].id);
                for (uint32_t r = 0; r < xm->items[k].nrelay_to; r++)
                    cr_assert_eq(xm->items[k].relay_to[r], want.items[k].relay_to[r]);
                for (uint32_t o = 0; o < xm->items[k].norigins; o++) {
                    const rf_xfer_origin *a = &xm->items[k].origins[o];
                    const rf_xfer_origin *b = &want.items[k].origins[o];

                    cr_assert(a->id == b->id && a->seq == b->seq &&
                              memcmp(&a->box, &b->box, sizeof(a->box)) == 0);
                }
                origins += xm->items[k].norigins;
                relay_to += xm->items[k].nrelay_to;
            }
            free(want.items);
            if (xm->send) {
                sends++;
                sent += xm->bytes;
                relayed += pm->relay ? xm->bytes : 0;
            } else {
                recvs++;
                recvd += xm->bytes;
            }
            msgs_seen++;
        }
        cr_assert_eq(sends, want_sends, "member %u", m);
        cr_assert_eq(recvs, want_recvs, "member %u", m);
        if (rsides[m] == RF_SRC)
            cr_assert_eq(sends, rf_plan_nmsgs(plan) - rf_plan_stats_get(plan)->relay_messages);
        rf_slice_job_reset(&job);
    }
    cr_assert(refused, "no relay send was tried with in-process memory");
    cr_assert(bad_dims, "no relay lists its origins");
    /* Every relay transfer's receiver lists its tree's origins, every origin's sender the
     * tree's relays: the two lists hold one entry per (origin, relay) pair alike. */
    cr_assert_gt(origins, 0);
    cr_assert_eq(origins, relay_to);
    cr_assert_eq(msgs_seen, 2 * rf_plan_nmsgs(plan));
    cr_assert_eq(sent, rf_plan_stats_get(plan)->dst_bytes);
    cr_assert_eq(recvd, rf_plan_stats_get(plan)->dst_bytes);
    cr_assert_eq(relayed, rf_plan_stats_get(plan)->relay_bytes);
    for (m = 0; m < RELAY_MEM; m++) {
        free(bases[m]);
        refit__inventory__free_unpacked(rwire[m], NULL);
        rf_inv_free(rlocal[m]);
    }
    free(gbases);
    rf_plan_free(plan);
    rf_inv_free(g);
    rf_slice_map_free(&map);
}

/* A frame's message naming the first peer or local endpoint past the slice's tables, or a
 * transfer whose box leaves the local piece, is refused before any memory is addressed. */
Test(slice, endpoints_past_the_tables_and_boxes_outside_the_piece_are_refused)
{
    Refit__PlanSlice **frames = NULL;
    Refit__SliceMsg *sm;
    Refit__SliceXfer *sx;
    uint8_t **bases;
    rf_slice_peer peers[NMEM];
    rf_slice_map map = {0};
    rf_plan_opts opts;
    rf_plan *plan = NULL;
    rf_inv *g = NULL;
    rf_err err = {0};
    rf_slice_job job;
    size_t n = 0;
    uint32_t npeers, neps, saved;
    int64_t s0, e0;
    char want[96];

    cr_assert_eq(rf_slice_merge(wire, sides, NMEM, &g, &map, &err), 0, "%s", err.msg);
    rf_plan_opts_default(&opts);
    cr_assert_eq(rf_plan_build(g, &opts, &plan, &err), 0, "%s", err.msg);
    for (uint32_t m = 0; m < NMEM; m++)
        peers[m] = (rf_slice_peer){.daemon_id = 100 + m, .data_addr = "",
                                   .role = REFIT__ROLE__ROLE_PUBLISHER};
    cr_assert_eq(rf_slice_build(plan, &map, 2, peers, 1, 100, NULL, &frames, &n), 0);
    cr_assert_gt(n, 0);
    bases = calloc(rf_inv_nregions(local[2]), sizeof(*bases));
    for (uint32_t r = 0; r < rf_inv_nregions(local[2]); r++)
        bases[r] = (uint8_t *)(uintptr_t)(4096 * (r + 1)); /* never dereferenced here */
    rf_slice_job_init(&job);
    cr_assert_eq(rf_slice_job_add(&job, frames[0], local[2], RF_DST, bases, NULL, &err), 0, "%s",
                 err.msg);
    npeers = job.npeers;
    neps = job.nlocal_eps;
    cr_assert_gt(npeers, 0);
    cr_assert_gt(neps, 0);
    rf_slice_job_reset(&job);
    cr_assert_gt(frames[0]->n_msgs, 0);
    sm = frames[0]->msgs[0];
    cr_assert_gt(sm->n_xfers, 0);
    sx = sm->xfers[0];

    saved = sm->peer;
    sm->peer = npeers;
    cr_assert_eq(rf_slice_job_add(&job, frames[0], local[2], RF_DST, bases, NULL, &err), -EPROTO);
    snprintf(want, sizeof(want), "message %u names peer %u of %u", sm->seq, npeers, npeers);
    cr_assert(strstr(err.msg, want), "%s", err.msg);
    sm->peer = saved;
    rf_slice_job_reset(&job);

    saved = sm->local_ep;
    sm->local_ep = neps;
    cr_assert_eq(rf_slice_job_add(&job, frames[0], local[2], RF_DST, bases, NULL, &err), -EPROTO);
    snprintf(want, sizeof(want), "message %u names local endpoint %u of %u", sm->seq, neps,
             neps);
    cr_assert(strstr(err.msg, want), "%s", err.msg);
    sm->local_ep = saved;
    rf_slice_job_reset(&job);

    /* One element before the piece, and one row past its end. */
    s0 = sx->start[0];
    e0 = sx->extent[0];
    for (int c = 0; c < 2; c++) {
        rf_piece pc;

        rf_inv_piece(local[2], RF_DST, sx->piece, &pc);
        if (c == 0)
            sx->start[0] = pc.box.start[0] - 1;
        else
            sx->extent[0] = pc.box.start[0] + pc.box.extent[0] - s0 + 1;
        cr_assert_eq(rf_slice_job_add(&job, frames[0], local[2], RF_DST, bases, NULL, &err),
                     -EPROTO, "case %d", c);
        cr_assert(strstr(err.msg, "outside the local piece: the plan is stale"), "case %d: %s",
                  c, err.msg);
        sx->start[0] = s0;
        sx->extent[0] = e0;
        rf_slice_job_reset(&job);
    }
    /* Restored, the frame resolves again. */
    cr_assert_eq(rf_slice_job_add(&job, frames[0], local[2], RF_DST, bases, NULL, &err), 0, "%s",
                 err.msg);
    rf_slice_job_reset(&job);
    for (size_t f = 0; f < n; f++)
        rf_slice_msg_free(frames[f]);
    free(frames);
    free(bases);
    rf_plan_free(plan);
    rf_inv_free(g);
    rf_slice_map_free(&map);
}
