/* fuzz/fuzz_slice.c - the control plane's envelopes as the coordinator and the daemons use
 * them (common/control/slice.h): any stream of framed refit.Envelope messages. Inventories are merged
 * into the cluster inventory as the coordinator does (rf_slice_merge); when that succeeds and
 * the cluster is small, it is planned and every member's slice is built, sent through
 * protobuf and turned into the member's job against its own inventory, which must be
 * accepted and pass rf_xfer_job_check: a slice the coordinator built is never refused. Plan
 * slices in the input are added to a job against the first member's inventory, as a daemon
 * does with the frames it receives, and checked once complete.
 * Input: [sides: bit i set = member i is a receiver] then frames (4-byte big-endian length,
 * then the packed Envelope), the daemons' control-channel framing. */
#include <errno.h>
#include <sys/mman.h>

#include "fuzz.h"
#include "plan.h"
#include "refit.pb-c.h"
#include "slice.h"
#include "wire.h"
#include "xfer.h"

#define MAX_MEMBERS 8
#define MAX_SLICES 16
#define MAX_PLAN_PIECES 4096         /* larger clusters take too long to plan per input */
#define MAX_TENSOR_BYTES (1ull << 30) /* and so do tensors that make millions of messages */
#define FRAME_XFERS 16               /* small frames, so that slices span several */

typedef struct input {
    uint8_t sides;
    Refit__Inventory *invs[MAX_MEMBERS];
    uint32_t ninvs;
    Refit__Envelope *envs[MAX_MEMBERS + MAX_SLICES];
    uint32_t nenvs;
    const Refit__PlanSlice *slices[MAX_SLICES];
    uint32_t nslices;
} input;

static int on_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    input *in = ctx;
    Refit__Envelope *env;

    if (in->nenvs == MAX_MEMBERS + MAX_SLICES)
        return -E2BIG;
    env = refit__envelope__unpack(NULL, len, body);
    if (env == NULL)
        return 0;
    in->envs[in->nenvs++] = env;
    if (env->body_case == REFIT__ENVELOPE__BODY_INVENTORY && in->ninvs < MAX_MEMBERS)
        in->invs[in->ninvs++] = env->inventory;
    else if (env->body_case == REFIT__ENVELOPE__BODY_PLAN_SLICE && in->nslices < MAX_SLICES)
        in->slices[in->nslices++] = env->plan_slice;
    return 0;
}

static rf_side side_of(const input *in, uint32_t m)
{
    return in->sides & (1u << m) ? RF_DST : RF_SRC;
}

/* The inventory member m holds itself: its message merged alone keeps its local ids. */
static rf_inv *local_inv(const input *in, uint32_t m)
{
    rf_side side = side_of(in, m);
    rf_slice_map map;
    rf_inv *inv = NULL;
    rf_err err = {0};

    if (rf_slice_merge(&in->invs[m], &side, 1, &inv, &map, &err) < 0)
        return NULL;
    rf_slice_map_free(&map);
    return inv;
}

static bool small_tensors(const rf_inv *inv)
{
    uint32_t i;

    for (i = 0; i < rf_inv_ntensors(inv); i++) {
        const rf_tensor *t = rf_inv_tensor(inv, i);
        uint64_t bytes = rf_dtype_size(t->dtype);
        int d;

        for (d = 0; d < t->ndim; d++) {
            if ((uint64_t)t->shape[d] > MAX_TENSOR_BYTES)
                return false;
            bytes *= (uint64_t)t->shape[d];
            if (bytes > MAX_TENSOR_BYTES)
                return false;
        }
    }
    return true;
}

/* The daemon maps every region of its inventory before it takes a slice: address space only
 * here (nothing reads or writes it), so any size the inventory allows can be mapped. NULL
 * when a region cannot be (larger than the address space): the input is skipped. */
static uint8_t **map_regions(const rf_inv *local)
{
    uint32_t n = rf_inv_nregions(local), i;
    uint8_t **bases = calloc(n + 1, sizeof(*bases));

    for (i = 0; bases != NULL && i < n; i++) {
        void *p = mmap(NULL, rf_inv_region(local, i)->size, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

        if (p == MAP_FAILED) {
            while (i-- > 0)
                munmap(bases[i], rf_inv_region(local, i)->size);
            free(bases);
            return NULL;
        }
        bases[i] = p;
    }
    return bases;
}

static void unmap_regions(const rf_inv *local, uint8_t **bases)
{
    uint32_t i;

    for (i = 0; bases != NULL && i < rf_inv_nregions(local); i++)
        munmap(bases[i], rf_inv_region(local, i)->size);
    free(bases);
}

/* Member m's slice as the coordinator builds it, through the wire, into m's job. */
static void check_member(const input *in, const rf_plan *plan, const rf_slice_map *map,
                         const rf_slice_peer *peers, uint32_t m)
{
    Refit__PlanSlice **frames = NULL;
    size_t nframes = 0, i;
    rf_inv *local = local_inv(in, m);
    uint8_t **bases = NULL;
    rf_slice_job job;
    rf_err err = {0};
    int rc;

    rf_slice_job_init(&job);
    if (local == NULL) {
        fprintf(stderr, "fuzz_slice: member %u's inventory merged with the others but not "
                "alone\n", m);
        abort();
    }
    rc = rf_slice_build(plan, map, m, peers, 7, FRAME_XFERS, NULL, &frames, &nframes);
    if (rc == -ENOMEM)
        goto out;
    if (rc < 0) {
        fprintf(stderr, "fuzz_slice: slice of member %u: %d\n", m, rc);
        abort();
    }
    bases = map_regions(local);
    if (bases == NULL)
        goto out;
    for (i = 0; i < nframes; i++) {
        Refit__Envelope env = REFIT__ENVELOPE__INIT, *back;
        uint8_t *buf = NULL;
        size_t len;

        env.body_case = REFIT__ENVELOPE__BODY_PLAN_SLICE;
        env.plan_slice = frames[i];
        if (rf_wire_pack(&env.base, &buf, &len) < 0)
            goto out;
        back = refit__envelope__unpack(NULL, len - 4, buf + 4);
        free(buf);
        if (back == NULL || back->body_case != REFIT__ENVELOPE__BODY_PLAN_SLICE) {
            fprintf(stderr, "fuzz_slice: frame %zu of member %u's slice does not unpack\n", i, m);
            abort();
        }
        rc = rf_slice_job_add(&job, back->plan_slice, local, side_of(in, m), bases, NULL, &err);
        refit__envelope__free_unpacked(back, NULL);
        if (rc == -ENOMEM)
            goto out;
        if (rc < 0) {
            fprintf(stderr, "fuzz_slice: member %u refuses frame %zu of the slice the plan "
                    "gave it: %s\n", m, i, err.msg);
            abort();
        }
    }
    if (!job.complete) {
        fprintf(stderr, "fuzz_slice: member %u's slice has no last frame\n", m);
        abort();
    }
    job.job.staging_bytes = (256ull << 20) * (rf_inv_nendpoints(local) ? rf_inv_nendpoints(local)
                                                                        : 1);
    rc = rf_xfer_job_check(&job.job, job.npeers, &err);
    if (rc < 0 && rc != -ENOMEM) {
        fprintf(stderr, "fuzz_slice: member %u's job from its own slice fails the check: %s\n",
                m, err.msg);
        abort();
    }
out:
    rf_slice_job_reset(&job);
    unmap_regions(local, bases);
    for (i = 0; i < nframes; i++)
        rf_slice_msg_free(frames[i]);
    free(frames);
    rf_inv_free(local);
}

static void plan_cluster(const input *in)
{
    rf_side sides[MAX_MEMBERS];
    rf_slice_peer peers[MAX_MEMBERS] = {{0}};
    rf_slice_map map;
    rf_inv *global = NULL;
    rf_plan *plan = NULL;
    rf_plan_opts po;
    rf_err err = {0};
    uint32_t m;
    int rc;

    for (m = 0; m < in->ninvs; m++) {
        sides[m] = side_of(in, m);
        peers[m].daemon_id = 1000 + m;
        peers[m].data_addr = "127.0.0.1:7471";
        peers[m].role = sides[m] == RF_SRC ? REFIT__ROLE__ROLE_PUBLISHER : REFIT__ROLE__ROLE_RECEIVER;
    }
    rc = rf_slice_merge(in->invs, sides, in->ninvs, &global, &map, &err);
    if (rc < 0) {
        if (err.msg[0] == '\0')
            abort(); /* a refused inventory must say why */
        return;
    }
    if (rf_inv_npieces(global, RF_SRC) + rf_inv_npieces(global, RF_DST) <= MAX_PLAN_PIECES &&
        small_tensors(global)) {
        rf_plan_opts_default(&po);
        /* A plan fails for inventories that do not cover every destination byte: fine. */
        if (rf_plan_build(global, &po, &plan, &err) == 0)
            for (m = 0; m < in->ninvs; m++)
                check_member(in, plan, &map, peers, m);
    }
    rf_plan_free(plan);
    rf_inv_free(global);
    rf_slice_map_free(&map);
}

/* The plan slices of the input, as a daemon holding member 0's inventory receives them. */
static void receive_slices(const input *in)
{
    rf_inv *local = in->ninvs > 0 ? local_inv(in, 0) : rf_inv_new();
    uint8_t **bases = NULL;
    rf_slice_job job;
    uint32_t i;

    rf_slice_job_init(&job);
    if (local == NULL)
        return;
    bases = map_regions(local);
    for (i = 0; bases != NULL && i < in->nslices; i++) {
        rf_err err = {0};

        if (rf_slice_job_add(&job, in->slices[i], local, side_of(in, 0), bases, NULL, &err) < 0) {
            rf_slice_job_reset(&job);
            continue;
        }
        if (job.complete) {
            job.job.staging_bytes = 256ull << 20;
            rf_xfer_job_check(&job.job, job.npeers, &err);
        }
    }
    rf_slice_job_reset(&job);
    unmap_regions(local, bases);
    rf_inv_free(local);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static input in;
    rf_wire_reader r;
    uint32_t i;

    if (size < 1)
        return 0;
    fuzz_quiet();
    memset(&in, 0, sizeof(in));
    in.sides = data[0];
    rf_wire_reader_init(&r, 1u << 20);
    rf_wire_reader_feed(&r, data + 1, size - 1, on_frame, &in);
    rf_wire_reader_reset(&r);
    if (in.ninvs > 0)
        plan_cluster(&in);
    receive_slices(&in);
    for (i = 0; i < in.nenvs; i++)
        refit__envelope__free_unpacked(in.envs[i], NULL);
    return 0;
}
