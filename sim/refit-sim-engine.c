/* sim/refit-sim-engine.c - simulated engine ranks: export buffers of a model's engine-side
 * shards to refit-receiverd (bf16 as the trainers', or FP8 with scales), then after each
 * committed version check every byte. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim.h"

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: refit-sim-engine --model NAME|FILE --layout LAYOUT [options]\n"
            "  --socket PATH      receiverd socket (default $REFIT_SOCKET or %s)\n"
            "  --model NAME|FILE  as for refit-sim-trainer (the same model on both sides)\n"
            "  --shrink N         as for refit-sim-trainer\n"
            "  --layout LAYOUT    engine parallelism, e.g. tp=4,dp=2 or tp=4,ep=4\n"
            "  --ranks A-B        the ranks this process plays (default: all)\n"
            "  --device D         host (default), cuda (rank r on GPU r mod count) or cuda:N\n"
            "  --gpu N            the same as --device cuda:N\n"
            "  --cuda-vmm         GPU memory from cuMemCreate (shared as a POSIX fd), not cudaMalloc\n"
            "  --cuda-vmm-chunk B the same as VMM allocations of B bytes mapped back to back\n"
            "                     (as PyTorch's expandable segments map theirs): tensors span them\n"
            "  --finite-weights   every weight a finite number, as a trained model's are (the\n"
            "                     default puts Inf, NaN, 0 or a subnormal in 1 of 4096 to test\n"
            "                     FP8 edge cases); trainers and engines must agree\n"
            "  --inproc           memory the daemon cannot map, installed by librefit in this\n"
            "                     process (on GPUs: VMM allocations without a handle type)\n"
            "  --start V          first version to expect (default 1)\n"
            "  --versions K       verify versions until START+K-1 is reached (default 1); a\n"
            "                     later version the daemon committed is checked instead\n"
            "  --timeout-ms T     wait for a version at most T ms (default 120000)\n"
            "  --fp8 FORMAT       serve FP8: every piece of >= 2 dims whose box lies on the grid\n"
            "                     of FORMAT (block, block:RxC, channel, tensor, mxfp8) is\n"
            "                     float8_e4m3fn with its scales, checked against the scalar\n"
            "                     reference; the others keep the tensor's dtype (memory the\n"
            "                     receiverd maps: host or GPU, not --inproc)\n"
            "  --fp8-off-grid     also pieces whose box cuts the grid (the daemon must refuse)\n"
            "  --fp8-scale-pad N  pad each row of a piece's scales to a multiple of N scales\n"
            "                     (default 1: dense); the padding must stay untouched\n"
            "  --no-check         do not check the installed bytes (for benchmarks of models\n"
            "                     too large to check on the host; the tests check)\n"
            "Exits 1 if any installed byte is wrong or a version never commits.\n"
            "REFIT_SIM_FP8_CORRUPT=element|scale|padding flips one bit of the first FP8 piece\n"
            "(padding: of its scale rows' padding) before the first check, which must then\n"
            "count 1 wrong element (a test of the check).\n",
            REFIT_SOCKET_RECEIVER);
}

/* Tells the receiverd that every rank has taken version v in (its next install may start). */
static void consume(const sim *s, uint64_t v)
{
    for (int i = 0; i < s->count; i++)
        if (refit_consumed(s->ranks[i].c, v) < 0)
            fprintf(stderr, "engine rank %d: %s\n", s->ranks[i].rank,
                    refit_last_error(s->ranks[i].c));
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {SIM_COMMON_OPTIONS, {"help", 0, 0, 'h'},
                                         {"fp8", 1, 0, 'F'}, {"fp8-off-grid", 0, 0, 'O'},
                                         {"fp8-scale-pad", 1, 0, 'P'}, {"no-check", 0, 0, 'N'},
                                         {0, 0, 0, 0}};
    const char *corrupt = getenv("REFIT_SIM_FP8_CORRUPT");
    uint64_t v, wrong_total = 0;
    double blocked_since = 0; /* waits end at once: the cluster cannot refit (0: they wait) */
    int o, i, status = 1, checked = 0, no_check = 0;
    sim_opts so;
    sim s;

    sim_opts_init(&so, REFIT_SOCKET_RECEIVER);
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (sim_opt(&so, o, optarg))
            continue;
        if (o == 'h') {
            usage(stdout);
            return 0;
        }
        if (o == 'N') {
            no_check = 1;
            continue;
        }
        if (o == 'F') {
            so.fp8 = optarg;
            continue;
        }
        if (o == 'O') {
            so.fp8_off_grid = 1;
            continue;
        }
        if (o == 'P') {
            char *end = NULL;
            unsigned long n = strtoul(optarg, &end, 10);

            if (end == optarg || *end != '\0' || n < 1 || n > 1024) {
                fprintf(stderr, "--fp8-scale-pad %s: give a number of scales from 1 to 1024\n",
                        optarg);
                return 2;
            }
            so.fp8_scale_pad = (uint32_t)n;
            continue;
        }
        usage(stderr);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if ((so.fp8_off_grid || so.fp8_scale_pad) && !so.fp8) {
        fprintf(stderr, "--fp8-off-grid and --fp8-scale-pad go with --fp8 FORMAT\n");
        return 2;
    }
    if (corrupt && strcmp(corrupt, "element") != 0 && strcmp(corrupt, "scale") != 0 &&
        strcmp(corrupt, "padding") != 0) {
        fprintf(stderr, "REFIT_SIM_FP8_CORRUPT=%s: give element, scale or padding\n", corrupt);
        return 2;
    }
    if (sim_open(&s, RF_DST, &so) < 0)
        return 2;
    if (s.fp8)
        printf("engine ranks %d-%d: fp8 %s: %llu pieces FP8 (%llu bytes and %llu bytes of "
               "scales), %llu pieces kept as their tensor's dtype (%llu bytes)\n", s.first,
               s.first + s.count - 1, s.fp8_name, (unsigned long long)s.fp8_pieces,
               (unsigned long long)s.fp8_bytes, (unsigned long long)s.fp8_scale_bytes,
               (unsigned long long)s.kept_pieces, (unsigned long long)s.kept_bytes);
    if (corrupt && s.fp8_pieces == 0) {
        fprintf(stderr, "REFIT_SIM_FP8_CORRUPT: no FP8 piece to corrupt (give --fp8 FORMAT "
                "with pieces on its grid)\n");
        sim_close(&s);
        return 2;
    }
    sim_fill_garbage(&s);
    if (sim_register(&s, so.timeout_ms) < 0)
        goto out;
    printf("engine ranks %d-%d: registered %llu bytes of %s\n", s.first, s.first + s.count - 1,
           (unsigned long long)s.bytes, rf_model_name(s.model));

    for (v = so.start; v < so.start + so.versions;) {
        double t0 = sim_now();
        uint64_t wrong, reached = v, got = 0;
        int rc = 0;

        /* The daemon may have committed a later version than the one waited for (an operator
         * triggered it, this engine came back late): the memory holds what it committed, so
         * that is what is checked, once every rank has reached it. */
        for (i = 0; i < s.count && rc == 0; i++) {
            rc = refit_wait_version_reached(s.ranks[i].c, reached, so.timeout_ms, &got);
            if (rc == 0 && got > reached) {
                reached = got;
                i = -1;
            }
        }
        if (rc == -ECONNRESET || rc == -EPIPE || rc == -ENOTCONN) {
            fprintf(stderr, "engine: lost receiverd (%s); registering again\n",
                    refit_last_error(s.ranks[i - 1].c));
            if (sim_register(&s, so.timeout_ms) < 0)
                goto out;
            continue;
        }
        if (rc == -ETIMEDOUT) {
            fprintf(stderr, "engine: version %llu was not committed within %d ms\n",
                    (unsigned long long)v, so.timeout_ms);
            goto out;
        }
        if (rc == -EAGAIN) {
            /* The cluster cannot refit now (the message says why): ask again once it may. */
            fprintf(stderr, "engine: version %llu: %s\n", (unsigned long long)v,
                    refit_last_error(s.ranks[i - 1].c));
            if (blocked_since == 0)
                blocked_since = t0;
            if (sim_now() - blocked_since > so.timeout_ms / 1000.0)
                goto out;
            usleep(200 * 1000);
            continue;
        }
        blocked_since = 0;
        if (rc < 0) {
            /* An abort: the model may hold a mix of versions until the retry commits. */
            fprintf(stderr, "engine: version %llu: %s; waiting for the retry\n",
                    (unsigned long long)v, refit_last_error(s.ranks[i - 1].c));
            continue;
        }
        if (reached != v)
            printf("engine ranks %d-%d: waited for version %llu, the daemon committed version "
                   "%llu: checking that one\n", s.first, s.first + s.count - 1,
                   (unsigned long long)v, (unsigned long long)reached);
        if (corrupt && checked == 0 && sim_fp8_corrupt(&s, corrupt) < 0)
            fprintf(stderr, "REFIT_SIM_FP8_CORRUPT=%s: no FP8 piece has that to flip\n",
                    corrupt);
        if (no_check) {
            printf("engine ranks %d-%d: version %llu committed after %.3f s, not checked "
                   "(--no-check)\n", s.first, s.first + s.count - 1, (unsigned long long)reached,
                   sim_now() - t0);
            consume(&s, reached);
            v = reached + 1;
            continue;
        }
        wrong = sim_verify(&s, reached, 5);
        wrong_total += wrong;
        /* Once: whether the expected FP8 content could show misplaced scales and elements. */
        if (s.fp8_elems > 0 && checked == 0)
            printf("engine ranks %d-%d: fp8 check: scales of neighbouring blocks differ in "
                   "%llu of %llu pairs, %llu of %llu elements quantize to nonzero\n", s.first,
                   s.first + s.count - 1, (unsigned long long)s.fp8_pairs_differ,
                   (unsigned long long)s.fp8_pairs, (unsigned long long)s.fp8_elems_nonzero,
                   (unsigned long long)s.fp8_elems);
        checked++;
        printf("engine ranks %d-%d: version %llu committed after %.3f s, verified %llu bytes, "
               "%llu wrong elements\n", s.first, s.first + s.count - 1,
               (unsigned long long)reached, sim_now() - t0, (unsigned long long)s.bytes,
               (unsigned long long)wrong);
        consume(&s, reached);
        v = reached + 1;
    }
    status = wrong_total ? 1 : 0;
out:
    sim_close(&s);
    return status;
}
