/* sim/refit-sim-trainer.c - simulated trainer ranks: register a model's shards with
 * refit-publisherd, then for each version write weights that encode (version, tensor, index),
 * publish and wait until the cluster committed them. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sim.h"

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: refit-sim-trainer --model NAME|FILE --layout LAYOUT [options]\n"
            "  --socket PATH      publisherd socket (default $REFIT_SOCKET or %s)\n"
            "  --model NAME|FILE  qwen3-0.6b, qwen3-4b, qwen3-30b-a3b, deepseek-v3 or a JSON spec\n"
            "  --shrink N         divide the model's large dims by N (same structure, less memory)\n"
            "  --layout LAYOUT    trainer parallelism, e.g. tp=2,pp=2,ep=4,dp=2\n"
            "  --ranks A-B        the ranks this process plays (default: all)\n"
            "  --device D         host (default), cuda (rank r on GPU r mod count) or cuda:N\n"
            "  --gpu N            the same as --device cuda:N\n"
            "  --cuda-vmm         GPU memory from cuMemCreate (shared as a POSIX fd), not cudaMalloc\n"
            "  --cuda-vmm-chunk B the same as VMM allocations of B bytes mapped back to back\n"
            "                     (as PyTorch's expandable segments map theirs): tensors span them\n"
            "  --finite-weights   every weight a finite number, as a trained model's are (the\n"
            "                     default puts Inf, NaN, 0 or a subnormal in 1 of 4096 to test\n"
            "                     FP8 edge cases); trainers and engines must agree\n"
            "  --start V          first version (default 1)\n"
            "  --versions K       versions to publish (default 1)\n"
            "  --retries R        publishes of one version after aborts (default 5)\n"
            "  --timeout-ms T     wait for a release at most T ms (default 120000)\n"
            "  --report           print the cluster's refit summary after each version\n"
            "  --fp8 FORMAT       hold weights in FP8: every piece of a decoder layer's matrix\n"
            "                     whose box lies on the grid of FORMAT (block, block:RxC,\n"
            "                     channel, tensor, mxfp8) is float8_e4m3fn with scales, each\n"
            "                     version's values quantized by the reference; engines need\n"
            "                     FP8 pieces of the same format for them\n"
            "  --step-ms T        wait T ms after each release before writing the next version,\n"
            "                     as a training step would (default 0)\n"
            "  --hold V           then write version V's weights without publishing them and\n"
            "                     stay registered (for `refitctl refit --version V`)\n"
            "  --publish-when F   publish version V only once file F holds a number >= V, so\n"
            "                     that a test decides when each version becomes ready (gives up\n"
            "                     after --timeout-ms)\n",
            REFIT_SOCKET_PUBLISHER);
}

/* Prints one row of the refit table from the coordinator's status (when this trainer's daemon
 * is the coordinator; other publishers have no cluster view). */
static void report(refit_client *c, uint64_t version)
{
    char *txt = NULL;
    json_t *st, *last;

    if (refit_status_json(c, &txt) < 0)
        return;
    st = json_loads(txt, 0, NULL);
    free(txt);
    last = st ? json_object_get(json_object_get(st, "cluster"), "last_refit") : NULL;
    if (last) {
        double bytes = (double)json_integer_value(json_object_get(last, "bytes"));
        double commit = json_real_value(json_object_get(last, "start_to_commit_s"));
        double quorum = json_real_value(json_object_get(last, "publish_quorum_s"));
        double xfer = json_real_value(json_object_get(last, "transfer_s"));

        printf("refit %-4llu %12.0f bytes  quorum %7.4f s  transfer %7.4f s  start->commit "
               "%7.4f s  %6.2f GB/s\n", (unsigned long long)version, bytes, quorum, xfer,
               commit, commit > 0 ? bytes / commit / 1e9 : 0.0);
    }
    json_decref(st);
}

/* The number in file path, or 0 while it is missing, empty or being rewritten. */
static uint64_t read_gate(const char *path)
{
    char buf[32] = "";
    FILE *f = fopen(path, "r");
    size_t n;

    if (!f)
        return 0;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strtoull(buf, NULL, 10);
}

/* --publish-when: waits until the test allows version v to be published. A test that forgot to
 * allow it must not leave the trainer waiting forever: -ETIMEDOUT after timeout_ms. */
static int wait_gate(const char *path, uint64_t v, int timeout_ms)
{
    const struct timespec poll = {0, 2 * 1000000L};
    double deadline = sim_now() + timeout_ms / 1000.0;
    uint64_t allowed;

    while ((allowed = read_gate(path)) < v) {
        if (sim_now() > deadline) {
            fprintf(stderr, "refit-sim-trainer: version %llu was not allowed within %d ms: %s "
                    "holds %llu; write a number >= %llu there to publish it\n",
                    (unsigned long long)v, timeout_ms, path, (unsigned long long)allowed,
                    (unsigned long long)v);
            return -ETIMEDOUT;
        }
        nanosleep(&poll, NULL);
    }
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {SIM_COMMON_OPTIONS, {"retries", 1, 0, 'R'},
                                         {"report", 0, 0, 'p'}, {"hold", 1, 0, 'H'},
                                         {"step-ms", 1, 0, 'S'}, {"publish-when", 1, 0, 'W'},
                                         {"fp8", 1, 0, 'F'}, {"help", 0, 0, 'h'},
                                         {0, 0, 0, 0}};
    int retries = 5, do_report = 0, step_ms = 0, o, i, status = 1;
    uint64_t v, hold = 0;
    double blocked_since; /* waits of this version end at once: the cluster cannot refit */
    const char *gate = NULL;
    sim_opts so;
    sim s;

    sim_opts_init(&so, REFIT_SOCKET_PUBLISHER);
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (sim_opt(&so, o, optarg))
            continue;
        switch (o) {
        case 'R': retries = atoi(optarg); break;
        case 'p': do_report = 1; break;
        case 'H': hold = strtoull(optarg, NULL, 10); break;
        case 'W': gate = optarg; break;
        case 'F': so.fp8 = optarg; break;
        case 'S': {
            char *end;
            long ms;

            errno = 0;
            ms = strtol(optarg, &end, 10);
            if (errno || end == optarg || *end || ms < 0 || ms > 3600000) {
                fprintf(stderr, "refit-sim-trainer: --step-ms must be 0 or more, up to 3600000, "
                        "not %s\n", optarg);
                return 2;
            }
            step_ms = (int)ms;
            break;
        }
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (sim_open(&s, RF_SRC, &so) < 0)
        return 2;
    if (sim_register(&s, so.timeout_ms) < 0)
        goto out;
    printf("trainer ranks %d-%d: registered %llu bytes of %s\n", s.first, s.first + s.count - 1,
           (unsigned long long)s.bytes, rf_model_name(s.model));
    if (s.fp8)
        printf("trainer ranks %d-%d: fp8 %s: %llu pieces FP8 (%llu bytes and %llu bytes of "
               "scales), %llu kept in their dtype\n", s.first, s.first + s.count - 1, s.fp8_name,
               (unsigned long long)s.fp8_pieces, (unsigned long long)s.fp8_bytes,
               (unsigned long long)s.fp8_scale_bytes, (unsigned long long)s.kept_pieces);

    for (v = so.start; v < so.start + so.versions; v++) {
        int attempt, rc = 0, bad = 0;

        if (v > so.start && step_ms > 0) {
            struct timespec ts = {step_ms / 1000, (long)(step_ms % 1000) * 1000000L};

            while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
                ;
        }
        sim_fill(&s, v);
        if (gate && wait_gate(gate, v, so.timeout_ms) < 0)
            goto out;
        blocked_since = 0;
        for (attempt = 0; attempt <= retries; attempt++) {
            double t0 = sim_now();

            /* bad: the rank whose call failed (the wait's loop does not start after a failed
             * publish, so its index would not say). A wait that ended because the cluster
             * could not refit left the offers in place: only the waits are done again. */
            rc = 0;
            for (i = 0; i < s.count && rc == 0 && blocked_since == 0; i++)
                if ((rc = refit_publish(s.ranks[i].c, v)) < 0)
                    bad = i;
            for (i = 0; i < s.count && rc == 0; i++)
                if ((rc = refit_wait_released(s.ranks[i].c, v, so.timeout_ms)) < 0)
                    bad = i;
            if (rc == 0) {
                printf("trainer ranks %d-%d: version %llu released after %.3f s\n", s.first,
                       s.first + s.count - 1, (unsigned long long)v, sim_now() - t0);
                if (do_report)
                    report(s.ranks[0].c, v);
                break;
            }
            fprintf(stderr, "trainer ranks %d-%d: version %llu not released (attempt %d): %s\n",
                    s.first, s.first + s.count - 1, (unsigned long long)v, attempt + 1,
                    refit_last_error(s.ranks[bad].c));
            if (rc == -EAGAIN) {
                /* The cluster cannot refit now (the message says why): not an attempt; the
                 * same wait waits once the cause is gone (for timeout_ms at most). */
                if (blocked_since == 0)
                    blocked_since = t0;
                if (sim_now() - blocked_since > so.timeout_ms / 1000.0)
                    break;
                attempt--;
                usleep(200 * 1000);
                continue;
            }
            blocked_since = 0;
            if (rc == -ECONNRESET || rc == -EPIPE || rc == -ENOTCONN) {
                /* The daemon went away: register again once it is back. */
                if (sim_register(&s, so.timeout_ms) < 0)
                    goto out;
            } else {
                usleep(200 * 1000);
            }
        }
        if (rc != 0) {
            fprintf(stderr, "trainer: giving up on version %llu\n", (unsigned long long)v);
            goto out;
        }
    }
    if (hold) {
        /* For operator triggers: weights of version `hold` in place, never published; the
         * registration stays until the process is stopped. */
        sim_fill(&s, hold);
        printf("trainer ranks %d-%d: holding weights of version %llu unpublished\n", s.first,
               s.first + s.count - 1, (unsigned long long)hold);
        for (;;)
            pause();
    }
    status = 0;
out:
    sim_close(&s);
    return status;
}
