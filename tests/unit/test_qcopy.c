/* tests/unit/test_qcopy.c - FP8 engines on the host path (issue 15), from the inventory to the
 * installed bytes: bf16 trainer shards (rows split in two, experts split) planned into FP8
 * engine shards (rows in four, one expert each) of every format, run by the local transport
 * (memfd memory, host 7), and every installed FP8 byte and scale compared with the scalar
 * reference (rf_quant_ref) of the trainers' bf16 values; the pattern's random bytes include
 * NaN, Inf, subnormals and values past 448. Also the refusals: an engine box off the grid, a
 * trainer shard that cuts a block. Trainers' FP8 pieces copied into engine FP8 pieces of their
 * format, and refused into another format or bf16. Relays of FP8 replicas in whole blocks. The
 * helpers the GPU paths place their work with, against the host path's bytes. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <uv.h>

#include "layout.h"
#include "local_world.h"
#include "plan.h"
#include "qcopy.h"
#include "qshadow.h"
#include "quant.h"
#include "quant_ref.h"
#include "slice.h"
#include "xfer.h"
#include "xfer_data.h"
#include "fp8_data.h"

/* Every region in memfd memory (the local transport maps it as a peer daemon's), 0xee. */
static void map_memfd(fixture *f)
{
    f->bases = calloc(f->nregions, sizeof(*f->bases));
    f->lens = calloc(f->nregions, sizeof(*f->lens));
    for (uint32_t r = 0; r < f->nregions; r++) {
        int fd = memfd_create("refit-test-fp8", MFD_CLOEXEC);

        f->lens[r] = rf_inv_region(f->inv, r)->size + 1;
        cr_assert(fd >= 0 && ftruncate(fd, (off_t)f->lens[r]) == 0);
        f->bases[r] = mmap(NULL, f->lens[r], PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        cr_assert_neq(f->bases[r], MAP_FAILED);
        close(fd);
        memset(f->bases[r], 0xee, f->lens[r]);
    }
}

static void fixture_free(fixture *f)
{
    for (uint32_t r = 0; r < f->nregions; r++)
        munmap(f->bases[r], f->lens[r]);
    free(f->bases);
    free(f->lens);
    rf_inv_free(f->inv);
}

static void run_local(fixture *f, const rf_plan *pl, uint64_t version, int verify)
{
    rf_xfer_job job;
    world w;
    rf_err err = {0};
    uint8_t zero[RF_XFER_DIGEST_BYTES] = {0};

    memset(&job, 0, sizeof(job));
    cr_assert_eq(rf_slice_local_job_from_plan(pl, f->bases, &job, &err), 0, "%s", err.msg);
    job.version = version;
    job.timeout_s = 30;
    job.verify = verify;
    cr_assert_eq(rf_xfer_job_check(&job, 2, &err), 0, "%s", err.msg);
    xd_fill(f->inv, f->bases, version);
    fill_fp8_sources(f, version);
    world_open(&w, false);
    world_run(&w, &job, false);
    cr_assert_eq(w.res.code, 0, "%s", w.res.error);
    cr_assert_eq(memcmp(w.res.digest_sent, w.res.digest_recv, RF_XFER_DIGEST_BYTES), 0,
                 "the digests of what was quantized and what was installed differ");
    if (verify != RF_VERIFY_OFF)
        cr_assert_neq(memcmp(w.res.digest_sent, zero, sizeof(zero)), 0, "nothing digested");
    world_close(&w);
    rf_slice_local_job_free(&job);
}

static void refit_format(const char *name, bool e_only, bool fp8_src)
{
    rf_quant_fmt q;
    fixture f;
    rf_plan *pl = NULL;
    rf_err err = {0};
    const rf_plan_stats *st;

    cr_assert_eq(rf_quant_fmt_parse(name, &q, &err), 0, "%s", err.msg);
    build(&f, &q, e_only, fp8_src, true);
    map_memfd(&f);
    cr_assert_eq(rf_plan_build(f.inv, NULL, &pl, &err), 0, "%s: %s", name, err.msg);
    st = rf_plan_stats_get(pl);
    cr_assert_gt(fp8_src ? st->fp8_copy_transfers : st->quant_transfers, 0,
                 "%s: no FP8 transfer planned", name);
    cr_assert_eq(fp8_src ? st->quant_transfers : st->fp8_copy_transfers, 0,
                 "%s: FP8 %s planned", name, fp8_src ? "quantized" : "copied");
    cr_assert_eq(st->direct_bytes + st->packed_bytes, 0, "%s: all on one host, all local", name);
    for (uint64_t v = 1; v <= 2; v++) {
        run_local(&f, pl, v, v == 1 ? RF_VERIFY_FULL : RF_VERIFY_SAMPLE);
        check_refit(&f, name, e_only, v);
    }
    rf_plan_free(pl);
    fixture_free(&f);
}

Test(qcopy, block_format_byte_for_byte) { refit_format("block:32x64", false, false); }
Test(qcopy, channel_format_byte_for_byte) { refit_format("channel", false, false); }
Test(qcopy, mxfp8_format_byte_for_byte) { refit_format("mxfp8", false, false); }
/* One scale for the whole matrix: only the experts, each whole on its engine, can be FP8. */
Test(qcopy, tensor_format_byte_for_byte) { refit_format("tensor", true, false); }
/* Trainers holding the weights in FP8 of the engines' format: their bytes and scales are
 * copied as they are, resharded (rows in halves into quarters, experts two into one). */
Test(qcopy, fp8_sources_block_format) { refit_format("block:32x64", false, true); }
Test(qcopy, fp8_sources_channel_format) { refit_format("channel", false, true); }
Test(qcopy, fp8_sources_mxfp8_format) { refit_format("mxfp8", false, true); }
Test(qcopy, fp8_sources_tensor_format) { refit_format("tensor", true, true); }

/* ---- refusals ------------------------------------------------------------------------------ */

/* w alone: trainers split its rows in ns parts (in FP8 of format sfmt, or bf16 when NULL),
 * engines in nd parts as FP8 in format dfmt ("none": bf16); the first piece added that fails
 * stops (its error in err). 0 when all went in. */
static int small(fixture *f, int ns, int nd, const char *sfmt, const char *dfmt, rf_err *err)
{
    int64_t ws[2] = {W_ROWS, W_COLS};
    rf_quant_fmt q[2];
    uint32_t ep, id;
    int rc = 0;

    memset(f, 0, sizeof(*f));
    f->inv = rf_inv_new();
    if (sfmt)
        cr_assert_eq(rf_quant_fmt_parse(sfmt, &q[0], err), 0);
    if (strcmp(dfmt, "none") != 0)
        cr_assert_eq(rf_quant_fmt_parse(dfmt, &q[1], err), 0);
    cr_assert_eq(rf_inv_add_tensor(f->inv, "w.weight", RF_DT_BF16, 2, ws, &f->w, err), 0);
    for (int side = 0; side < 2 && rc == 0; side++) {
        int n = side == 0 ? ns : nd;

        for (int r = 0; r < n && rc == 0; r++) {
            int64_t s2[2] = {r * W_ROWS / n, 0}, x2[2] = {W_ROWS / n, W_COLS};

            cr_assert_eq(rf_inv_add_endpoint(f->inv, side == 0 ? RF_SRC : RF_DST, (uint32_t)side,
                                             &ep, err), 0);
            rc = add(f, ep, f->w, 2, s2, x2,
                     (side == 0 ? sfmt != NULL : strcmp(dfmt, "none") != 0) ? &q[side] : NULL,
                     &id, err);
        }
    }
    return rc;
}

Test(qcopy, engine_box_off_the_grid_is_refused_at_registration)
{
    fixture f;
    rf_err err = {0};

    /* 64-row shards of 128x128 blocks. */
    cr_assert_eq(small(&f, 2, 4, NULL, "block", &err), -EINVAL);
    cr_assert(strstr(err.msg, "FP8 piece of w.weight") && strstr(err.msg, "cuts the 128x128 "
              "blocks"), "%s", err.msg);
    rf_inv_free(f.inv);
    /* Channel scales need whole rows; tensor the whole matrix. */
    cr_assert_eq(small(&f, 1, 4, NULL, "tensor", &err), -EINVAL);
    cr_assert(strstr(err.msg, "only the whole matrix"), "%s", err.msg);
    rf_inv_free(f.inv);
}

/* A trainer's FP8 piece goes only into an engine FP8 piece of its format: the plan refuses
 * another format, and a plain (bf16) engine piece, naming the tensor. */
Test(qcopy, fp8_sources_need_the_same_format)
{
    fixture f;
    rf_plan *pl = NULL;
    rf_err err = {0};

    cr_assert_eq(small(&f, 2, 2, "block:64x64", "block:64x64", &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(f.inv, NULL, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_stats_get(pl)->fp8_copy_transfers, 2);
    rf_plan_free(pl);
    rf_inv_free(f.inv);
    cr_assert_eq(small(&f, 2, 2, "block:64x64", "block:32x64", &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(f.inv, NULL, &pl, &err), -EOPNOTSUPP);
    cr_assert(strstr(err.msg, "tensor w.weight: a trainer holds it in FP8 block:64x64 and an "
                     "engine's FP8 piece is block:32x64"), "%s", err.msg);
    rf_inv_free(f.inv);
    cr_assert_eq(small(&f, 2, 2, "block:64x64", "none", &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(f.inv, NULL, &pl, &err), -EOPNOTSUPP);
    cr_assert(strstr(err.msg, "tensor w.weight: a trainer holds it in FP8 and an engine in "
                     "bf16"), "%s", err.msg);
    rf_inv_free(f.inv);
}

Test(qcopy, trainer_shards_cutting_a_block_are_quantized_on_the_receiver)
{
    fixture f;
    rf_plan *pl = NULL;
    rf_xfer_job job = {0};
    rf_err err = {0};

    /* Engines hold w whole in 256x64 blocks; trainers' 64-row shards cut each block: their
     * transfers carry bf16 for the receiver to quantize (e2e 64 runs them). */
    cr_assert_eq(small(&f, 4, 1, NULL, "block:256x64", &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(f.inv, NULL, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_stats_get(pl)->quant_transfers, 0);
    cr_assert_eq(rf_plan_stats_get(pl)->recv_quant_transfers, 4);
    cr_assert_eq(rf_plan_stats_get(pl)->recv_quant_bytes, 4 * 64 * W_COLS * 2);
    cr_assert_eq(rf_plan_stats_get(pl)->direct_bytes, 0, "FP8 transfers are never direct");
    /* Without daemons no slice job keeps the shadow: refused, naming the tensor (nothing is
     * read or written, so the regions need no memory). */
    f.bases = calloc(rf_inv_nregions(f.inv), sizeof(*f.bases));
    cr_assert_eq(rf_slice_local_job_from_plan(pl, f.bases, &job, &err), -ENOTSUP);
    cr_assert(strstr(err.msg, "w.weight: the plan quantizes it on the receiver"), "%s", err.msg);
    free(f.bases);
    rf_plan_free(pl);
    rf_inv_free(f.inv);
    /* The same shards into 64x64 blocks plan. */
    cr_assert_eq(small(&f, 4, 1, NULL, "block:64x64", &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(f.inv, NULL, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_stats_get(pl)->quant_transfers, 4);
    /* FP8 bytes and 4 x 6 fp32 scales per 64-row shard. */
    cr_assert_eq(rf_plan_stats_get(pl)->quant_bytes, 4 * (64 * W_COLS + 6 * 4));
    cr_assert_eq(rf_plan_stats_get(pl)->direct_bytes, 0, "FP8 transfers are never direct");
    rf_plan_free(pl);
    rf_inv_free(f.inv);
}

/* w whole on one trainer (bf16, or split in two row halves) and whole on three engine replicas
 * (FP8 in format fmt), each on a node of its own: replicas that relays may feed. */
static void replicas(fixture *f, int ns, const char *fmt)
{
    int64_t ws[2] = {W_ROWS, W_COLS}, x2[2] = {W_ROWS / ns, W_COLS}, s0[2] = {0, 0};
    rf_quant_fmt q;
    uint32_t ep, id;
    rf_err err = {0};

    memset(f, 0, sizeof(*f));
    f->inv = rf_inv_new();
    cr_assert_eq(rf_quant_fmt_parse(fmt, &q, &err), 0);
    cr_assert_eq(rf_inv_add_tensor(f->inv, "w.weight", RF_DT_BF16, 2, ws, &f->w, &err), 0);
    for (int r = 0; r < ns; r++) {
        int64_t s2[2] = {r * W_ROWS / ns, 0};

        cr_assert_eq(rf_inv_add_endpoint(f->inv, RF_SRC, 0, &ep, &err), 0);
        cr_assert_eq(add(f, ep, f->w, 2, s2, x2, NULL, &id, &err), 0, "%s", err.msg);
    }
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(rf_inv_add_endpoint(f->inv, RF_DST, 1 + (uint32_t)r, &ep, &err), 0);
        cr_assert_eq(add(f, ep, f->w, 2, s0, ws, &q, &f->dst_w[r], &err), 0, "%s", err.msg);
    }
}

/* Replicas of an FP8 piece relay its payload to each other: chunks of whole blocks (staging
 * small enough to cut w), each relay transfer the FP8 elements and scales of its box, never
 * direct. Where the trainers' shards cut the blocks, the replicas quantize only once the refit
 * landed and cannot forward before: refused, naming the tensor. */
Test(qcopy, relays_forward_fp8_in_whole_blocks)
{
    fixture f;
    rf_plan *pl = NULL;
    rf_plan_opts o;
    rf_err err = {0};
    const rf_plan_stats *st;
    uint64_t relayed = 0;

    replicas(&f, 1, "block:32x64");
    rf_plan_opts_default(&o);
    o.relay = 1;
    o.staging_bytes = 64 << 10;
    cr_assert_eq(rf_plan_build(f.inv, &o, &pl, &err), 0, "%s", err.msg);
    st = rf_plan_stats_get(pl);
    cr_assert_gt(st->relay_transfers, 0, "the plan relays nothing");
    for (uint32_t m = 0; m < rf_plan_nmsgs(pl); m++) {
        const rf_plan_msg *pm = rf_plan_msg_at(pl, m);

        for (uint32_t k = 0; pm->relay && k < pm->count; k++) {
            const rf_plan_xfer *x = rf_plan_xfer_at(pl, (uint64_t)pm->first + k);
            const rf_box *bx = rf_plan_box(pl, x->box);

            cr_assert_eq(pm->kind, RF_PLAN_PACKED, "an FP8 relay must be packed");
            cr_assert(bx->start[0] % 32 == 0 && (bx->extent[0] % 32 == 0 ||
                      bx->start[0] + bx->extent[0] == W_ROWS) && bx->start[1] % 64 == 0,
                      "relay box [%lld+%lld, %lld+%lld] cuts the 32x64 blocks",
                      (long long)bx->start[0], (long long)bx->extent[0],
                      (long long)bx->start[1], (long long)bx->extent[1]);
            cr_assert_eq(x->bytes, (uint64_t)(bx->extent[0] * bx->extent[1]) +
                                       (uint64_t)((bx->extent[0] + 31) / 32) *
                                           (uint64_t)((bx->extent[1] + 63) / 64) * 4,
                         "a relay's bytes are its FP8 elements and scales");
            relayed += x->bytes;
        }
    }
    cr_assert_eq(relayed, st->relay_bytes);
    cr_assert_lt(st->relay_chunk_bytes, (uint64_t)W_ROWS * W_COLS, "w was not cut in chunks");
    rf_plan_free(pl);
    rf_inv_free(f.inv);
    /* Trainer halves of 128 rows cut the 96-row blocks. */
    replicas(&f, 2, "block:96x64");
    cr_assert_eq(rf_plan_build(f.inv, &o, &pl, &err), -EOPNOTSUPP);
    cr_assert(strstr(err.msg, "relays cannot forward FP8 tensor w.weight: the trainers' shards "
                     "cut its blocks"), "%s", err.msg);
    rf_inv_free(f.inv);
}

/* Two FP8 pieces side by side in one region (a fused weight): one byte an element, so they
 * do not overlap (at the tensor's two bytes they would); one byte further they do. */
Test(qcopy, fp8_pieces_overlap_at_one_byte_an_element)
{
    int64_t sh[2] = {128, 64};
    rf_quant_decl qd = {.kind = RF_QUANT_BLOCK, .br = 64, .bc = 64, .scale_strides = {1, 1}};
    rf_inv *inv = rf_inv_new();
    uint32_t t, ep, r, rs, id;
    rf_err err = {0};
    rf_piece p = {0};

    cr_assert_eq(rf_inv_add_tensor(inv, "w", RF_DT_BF16, 2, sh, &t, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 0, &ep, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, ep, 128 * 64, &r, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, ep, 64, &rs, &err), 0);
    qd.scale_region = rs;
    for (int k = 0; k < 2; k++) {
        p = (rf_piece){.tensor = t, .region = r, .offset = (uint64_t)k * 64 * 64,
                       .box = {{k * 64, 0}, {64, 64}}, .strides = {64, 1}};
        qd.scale_offset = (uint64_t)k * 4;
        cr_assert_eq(rf_inv_add_quant(inv, &qd, &p.quant, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
    rf_inv_free(inv);

    inv = rf_inv_new();
    cr_assert_eq(rf_inv_add_tensor(inv, "w", RF_DT_BF16, 2, sh, &t, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 0, &ep, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, ep, 128 * 64, &r, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, ep, 64, &rs, &err), 0);
    qd.scale_region = rs;
    for (int k = 0; k < 2; k++) {
        p = (rf_piece){.tensor = t, .region = r, .offset = (uint64_t)k * (64 * 64 - 1),
                       .box = {{k * 64, 0}, {64, 64}}, .strides = {64, 1}};
        qd.scale_offset = (uint64_t)k * 4;
        cr_assert_eq(rf_inv_add_quant(inv, &qd, &p.quant, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), -EINVAL);
    cr_assert(strstr(err.msg, "both write byte 4095"), "%s", err.msg);
    rf_inv_free(inv);
}

/* The helpers the GPU local copies and the GPU shadows use, held to the host path's bytes on
 * every FP8 item of a refit's local job: rf_qcopy_descs gathers an FP8 piece's elements and
 * scales in payload order (rf_qcopy_pack of an FP8 source, rf_qcopy_read of what was
 * installed); rf_qcopy_matrix_at places each matrix so that rf_quant_host writes into the
 * piece and its scales exactly what the refit installed. */
static void gather_fp8(const rf_xfer_item *it, uint8_t *out)
{
    rf_copy_desc e, s;
    uint64_t fp8;

    rf_qcopy_bytes(&it->quant.q, it->ndim, it->quant.rows, it->quant.cols, &it->box, &fp8);
    rf_qcopy_descs(it, &e, &s);
    e.staging_off = 0;
    s.staging_off = fp8;
    rf_copy_run(&e, out, true);
    rf_copy_run(&s, out, true);
}

static void helpers_agree(const char *name, bool fp8_src)
{
    rf_quant_fmt q;
    fixture f;
    rf_plan *pl = NULL;
    rf_xfer_job job;
    rf_err err = {0};
    uint64_t items = 0;

    cr_assert_eq(rf_quant_fmt_parse(name, &q, &err), 0, "%s", err.msg);
    build(&f, &q, false, fp8_src, true);
    map_memfd(&f);
    cr_assert_eq(rf_plan_build(f.inv, NULL, &pl, &err), 0, "%s: %s", name, err.msg);
    run_local(&f, pl, 1, RF_VERIFY_OFF);
    memset(&job, 0, sizeof(job));
    cr_assert_eq(rf_slice_local_job_from_plan(pl, f.bases, &job, &err), 0, "%s", err.msg);
    for (uint32_t i = 0; i < job.nmsgs; i++) {
        for (uint32_t k = 0; k < job.msgs[i].nitems; k++) {
            const rf_xfer_item *s = &job.msgs[i].src_items[k], *d = &job.msgs[i].items[k];
            rf_quant_fmt f8 = {d->quant.q.kind, d->quant.q.br, d->quant.q.bc};
            uint8_t *want, *got, *zero;

            if (d->quant.q.kind == 0)
                continue;
            want = malloc(d->bytes);
            got = malloc(d->bytes);
            cr_assert(want && got);
            items++;
            rf_qcopy_read(d, want);
            gather_fp8(d, got);
            cr_assert_eq(memcmp(want, got, d->bytes), 0, "%s: message %u item %u: the "
                         "destination's descriptors gather other bytes", name, i, k);
            if (fp8_src) {
                rf_qcopy_pack(s, want);
                gather_fp8(s, got);
                cr_assert_eq(memcmp(want, got, d->bytes), 0, "%s: message %u item %u: the "
                             "source's descriptors gather other bytes", name, i, k);
            } else {
                /* Cleared, then quantized matrix by matrix where rf_qcopy_matrix_at says. */
                rf_qcopy_read(d, want);
                cr_assert_not_null(zero = calloc(1, d->bytes));
                rf_qcopy_unpack(d, zero);
                free(zero);
                for (uint64_t l = 0; l < rf_qcopy_nmatrices(&d->box, d->ndim); l++) {
                    rf_qcopy_matrix m;

                    rf_qcopy_matrix_at(s, d, l, &m);
                    cr_assert_eq(rf_quant_host(&f8, d->quant.dt, m.src, m.src_row_stride,
                                               (uint64_t)d->box.extent[d->ndim - 2],
                                               (uint64_t)d->box.extent[d->ndim - 1], m.q,
                                               m.q_row_stride, m.scales, m.scale_row_stride,
                                               &err), 0, "%s", err.msg);
                }
                rf_qcopy_read(d, got);
                cr_assert_eq(memcmp(want, got, d->bytes), 0, "%s: message %u item %u: the "
                             "matrices quantized where rf_qcopy_matrix_at puts them differ",
                             name, i, k);
            }
            free(want);
            free(got);
        }
    }
    cr_assert_gt(items, 0, "%s: no FP8 item", name);
    rf_slice_local_job_free(&job);
    rf_plan_free(pl);
    fixture_free(&f);
}

Test(qcopy, gpu_helpers_place_matrices_as_the_host_does)
{
    helpers_agree("block:32x64", false);
    helpers_agree("channel", false);
    helpers_agree("mxfp8", false);
}

Test(qcopy, gpu_helpers_gather_fp8_pieces_in_payload_order)
{
    helpers_agree("block:32x64", true);
    helpers_agree("mxfp8", true);
}

/* A shadow of a piece in host memory is host memory. */
Test(qcopy, shadow_of_a_host_piece_is_host_memory)
{
    uint8_t piece[64] = {0};
    rf_qshadow sh;
    rf_err err = {0};

    cr_assert_eq(rf_qshadow_alloc(&sh, piece, 4096, &err), 0, "%s", err.msg);
    cr_assert_eq(sh.dev, -1);
    cr_assert_not_null(sh.buf);
    memset(sh.buf, 1, 4096);
    rf_qshadow_free(&sh);
    cr_assert_null(sh.buf);
}
