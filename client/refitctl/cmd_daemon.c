/* client/refitctl/cmd_daemon.c - the commands that talk to a running daemon over its local
 * socket: status, refit, wait, watch. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctl.h"
#include "refit.h"

static const char *default_socket(void)
{
    const char *s = getenv("REFIT_SOCKET");

    if (s && s[0])
        return s;
    if (access(RF_CTL_SOCKET_PUB, F_OK) == 0)
        return RF_CTL_SOCKET_PUB;
    return RF_CTL_SOCKET_RECV;
}

/* Strict number parsing: the whole argument, in range; 0 or -1 (message printed). */
static int parse_version(const char *s, uint64_t *out)
{
    char *end = NULL;

    errno = 0;
    *out = strtoull(s, &end, 10);
    if (errno || end == s || *end || *out == 0 || s[0] == '-') {
        fprintf(stderr, "refitctl: '%s' is not a version (a whole number >= 1)\n", s);
        return -1;
    }
    return 0;
}

static int parse_timeout(const char *s, int *ms)
{
    char *end = NULL;
    double v;

    errno = 0;
    v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= 0) || v > 2e6) {
        fprintf(stderr, "refitctl: --timeout takes seconds between 0 and 2000000, not '%s'\n",
                s);
        return -1;
    }
    *ms = (int)(v * 1000);
    return 0;
}

/* Connects as a ctl client. On failure prints why (the daemon's own words when it refused
 * us) and returns NULL with *status: RF_CTL_EXIT_NODAEMON when nobody serves the socket, 1
 * when a daemon is there but would not take us (a uid it does not allow, say). */
static refit_client *dial(const char *socket, int *status)
{
    refit_client *c = NULL;
    int rc = refit_connect(socket, "refitctl", 0, REFIT_CTL, &c);

    if (rc == -ENOENT || rc == -ECONNREFUSED || rc == -ENOTSOCK) {
        fprintf(stderr, "refitctl: no daemon at %s: %s\n", socket, refit_last_error(NULL));
        *status = RF_CTL_EXIT_NODAEMON;
        return NULL;
    }
    if (rc < 0) {
        fprintf(stderr, "refitctl: the daemon at %s did not take us: %s\n", socket,
                refit_last_error(NULL));
        *status = 1;
        return NULL;
    }
    return c;
}

/* The options every daemon command takes; returns optind or -1 (usage printed). */
static int parse_common(int argc, char **argv, const char *usage, const char **socket,
                        int *json, int *timeout_ms, uint64_t *version)
{
    static const struct option opts[] = {{"socket", 1, 0, 's'},  {"json", 0, 0, 'j'},
                                         {"timeout", 1, 0, 't'}, {"version", 1, 0, 'v'},
                                         {"help", 0, 0, 'h'},    {0, 0, 0, 0}};
    int o;

    optind = 1;
    *socket = default_socket();
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 's': *socket = optarg; break;
        case 'j': if (json) { *json = 1; break; } goto bad;
        case 't':
            if (!timeout_ms || parse_timeout(optarg, timeout_ms) < 0)
                goto bad;
            break;
        case 'v':
            if (!version || parse_version(optarg, version) < 0)
                goto bad;
            break;
        case 'h': printf("%s", usage); exit(0);
        default: goto bad;
        }
    }
    return optind;
bad:
    fprintf(stderr, "%s", usage);
    return -1;
}

static double num(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);

    return json_is_number(v) ? json_number_value(v) : 0;
}

static const char *str(json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));

    return s ? s : "";
}

static void human_bytes(double b, char *out, size_t len)
{
    const char *u[] = {"B", "KB", "MB", "GB", "TB"};
    int i = 0;

    while (b >= 1000 && i < 4) {
        b /= 1000;
        i++;
    }
    snprintf(out, len, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

static void print_status(json_t *st)
{
    json_t *cl = json_object_get(st, "clients"), *last = json_object_get(st, "last_refit");
    json_t *co = json_object_get(st, "coordinator"), *cluster = json_object_get(st, "cluster");
    json_t *flight = json_object_get(st, "refit_in_flight");
    char b1[32];

    printf("%s on node %s (index %d), refit %s, transport %s\n", str(st, "role"),
           str(st, "node"), (int)num(st, "index"), str(st, "version"), str(st, "transport"));
    printf("coordinator   %s, %s\n", str(co, "addr"),
           json_is_true(json_object_get(co, "connected")) ? "connected" : "NOT CONNECTED");
    if (cl) {
        printf("clients       %d connected of %d expected %s, inventory %s (%d tensors, %d "
               "pieces)\n", (int)num(cl, "connected_clients"), (int)num(cl, "expected_clients"),
               str(cl, "side"), json_is_true(json_object_get(cl, "complete")) ? "complete"
                                                                              : "incomplete",
               (int)num(cl, "tensors"), (int)num(cl, "pieces"));
    }
    human_bytes(num(st, "plan_bytes"), b1, sizeof(b1));
    printf("plan          %s (%d messages, %s on this daemon)\n",
           str(st, "plan_id")[0] ? str(st, "plan_id") : "none yet", (int)num(st, "plan_messages"),
           b1);
    printf("committed     version %.0f", num(st, "committed"));
    if (json_is_integer(flight))
        printf(", refit of version %" JSON_INTEGER_FORMAT " in flight", json_integer_value(flight));
    printf("\n");
    /* The coordinator's reason why no version can be refitted now. */
    if (str(st, "blocked")[0])
        printf("blocked       %s\n", str(st, "blocked"));
    else if (str(st, "waiting_for")[0])
        printf("waiting for   %s\n", str(st, "waiting_for"));
    human_bytes(num(last, "bytes"), b1, sizeof(b1));
    printf("last refit    version %.0f %s, %s, wait %.3f s, transfer %.3f s, total %.3f s\n",
           num(last, "version"), str(last, "result"), b1, num(last, "wait_s"),
           num(last, "transfer_s"), num(last, "total_s"));
    if (cluster) {
        json_t *plan = json_object_get(cluster, "plan"), *cl_last = json_object_get(cluster,
                                                                                     "last_refit");
        json_t *m;
        size_t i;
        double s2c = num(cl_last, "start_to_commit_s");

        printf("cluster       %s, committed version %.0f%s%s\n", str(cluster, "state"),
               num(cluster, "committed"), str(cluster, "waiting_for")[0] ? "; waiting for " : "",
               str(cluster, "waiting_for"));
        json_array_foreach(json_object_get(cluster, "members"), i, m) {
            json_t *ready = json_object_get(m, "ready");
            char what[48];

            if (ready && num(m, "ready") > 0)
                snprintf(what, sizeof(what), "ready with %.0f", num(m, "ready"));
            else if (ready)
                snprintf(what, sizeof(what), "nothing to refit");
            else
                snprintf(what, sizeof(what), "%s", json_is_true(json_object_get(
                         m, "ready_to_install")) ? "engines ready" : "engines busy");
            printf("  %-9s %d  %-16s %-13s inventory %-10s %s\n", str(m, "role"),
                   (int)num(m, "index"), str(m, "node"),
                   json_is_true(json_object_get(m, "connected")) ? "connected" : "DISCONNECTED",
                   json_is_true(json_object_get(m, "inventory_complete")) ? "complete"
                                                                          : "incomplete",
                   what);
        }
        human_bytes(num(plan, "dst_bytes"), b1, sizeof(b1));
        printf("  plan      %d tensors, %.0f transfers, %.0f messages, %.0f rounds, %s, built "
               "in %.3f s\n", (int)num(plan, "tensors"), num(plan, "transfers"),
               num(plan, "messages"), num(plan, "rounds"), b1, num(plan, "build_s"));
        human_bytes(num(cl_last, "bytes"), b1, sizeof(b1));
        printf("  last      version %.0f %s, %s: publish quorum %.3f s, transfer %.3f s, "
               "start->commit %.3f s (%.2f GB/s)\n", num(cl_last, "version"),
               str(cl_last, "result"), b1, num(cl_last, "publish_quorum_s"),
               num(cl_last, "transfer_s"), s2c, s2c > 0 ? num(cl_last, "bytes") / s2c / 1e9 : 0);
        if (str(cluster, "last_error")[0])
            printf("  error     %s\n", str(cluster, "last_error"));
    }
    if (str(st, "last_error")[0])
        printf("last error    %s\n", str(st, "last_error"));
}

int rf_ctl_status(int argc, char **argv)
{
    static const char usage[] =
        "usage: refitctl status [--socket PATH] [--json]\n"
        "Shows the daemon's role, its coordinator connection, its local clients, the plan, the\n"
        "committed version and the last refit with its stage times; on the coordinator also\n"
        "the cluster: every member, the plan and the last refit as the coordinator saw it.\n";
    const char *socket;
    refit_client *c;
    char *txt = NULL;
    json_t *st;
    int json = 0, rc;

    if (parse_common(argc, argv, usage, &socket, &json, NULL, NULL) != argc) {
        if (optind < argc)
            fprintf(stderr, "refitctl status: unexpected argument '%s'\n%s", argv[optind], usage);
        return 2;
    }
    c = dial(socket, &rc);
    if (!c)
        return rc;
    rc = refit_status_json(c, &txt);
    if (rc < 0) {
        fprintf(stderr, "refitctl: status: %s\n", refit_last_error(c));
        refit_close(c);
        return 1;
    }
    refit_close(c);
    if (json) {
        printf("%s\n", txt);
        free(txt);
        return 0;
    }
    st = json_loads(txt, 0, NULL);
    free(txt);
    if (!st) {
        fprintf(stderr, "refitctl: the daemon's status is not JSON\n");
        return 1;
    }
    print_status(st);
    json_decref(st);
    return 0;
}

int rf_ctl_refit(int argc, char **argv)
{
    static const char usage[] =
        "usage: refitctl refit --version N [--socket PATH] [--wait] [--timeout SECONDS]\n"
        "Triggers a refit of version N from the weights the trainers hold now, without\n"
        "waiting for their publish (any daemon forwards it to the coordinator). N must be\n"
        "newer than the committed version. With --wait, waits for the commit: exit 0 when\n"
        "committed, 1 when aborted, timed out, or the cluster cannot refit it now (the\n"
        "coordinator's reason is printed).\n";
    static const struct option opts[] = {{"socket", 1, 0, 's'}, {"version", 1, 0, 'v'},
                                         {"wait", 0, 0, 'w'},   {"timeout", 1, 0, 't'},
                                         {"help", 0, 0, 'h'},   {0, 0, 0, 0}};
    const char *socket = default_socket();
    uint64_t version = 0;
    int o, wait = 0, timeout_ms = -1, rc;
    refit_client *c;

    optind = 1;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 's': socket = optarg; break;
        case 'v':
            if (parse_version(optarg, &version) < 0)
                return 2;
            break;
        case 'w': wait = 1; break;
        case 't':
            if (parse_timeout(optarg, &timeout_ms) < 0)
                return 2;
            break;
        case 'h': printf("%s", usage); return 0;
        default: fprintf(stderr, "%s", usage); return 2;
        }
    }
    if (version == 0 || optind != argc) {
        fprintf(stderr, "refitctl refit: give the version to refit as --version N (N >= 1)\n");
        return 2;
    }
    c = dial(socket, &rc);
    if (!c)
        return rc;
    rc = refit_trigger(c, version);
    if (rc < 0) {
        fprintf(stderr, "refitctl: %s\n", refit_last_error(c));
        refit_close(c);
        return 1;
    }
    printf("refit of version %" PRIu64 " triggered\n", version);
    if (wait) {
        rc = refit_wait(c, version, timeout_ms);
        if (rc < 0)
            fprintf(stderr, "refitctl: %s\n", refit_last_error(c));
        else
            printf("version %" PRIu64 " committed\n", version);
    }
    refit_close(c);
    return rc < 0 ? 1 : 0;
}

int rf_ctl_wait(int argc, char **argv)
{
    static const char usage[] =
        "usage: refitctl wait N [--socket PATH] [--timeout SECONDS]\n"
        "Waits until version N (or a later one) is committed: exit 0; 1 when the refit of N is\n"
        "aborted, the timeout passes, or the cluster cannot refit it now (the coordinator's\n"
        "reason is printed: a plan that fails, a refused daemon).\n";
    const char *socket;
    uint64_t version = 0;
    int timeout_ms = -1, idx, rc;
    refit_client *c;

    idx = parse_common(argc, argv, usage, &socket, NULL, &timeout_ms, &version);
    if (idx < 0)
        return 2;
    if (idx + 1 != argc || parse_version(argv[idx], &version) < 0) {
        fprintf(stderr, "refitctl wait: give the version to wait for (N >= 1)\n%s", usage);
        return 2;
    }
    c = dial(socket, &rc);
    if (!c)
        return rc;
    rc = refit_wait(c, version, timeout_ms);
    if (rc < 0)
        fprintf(stderr, "refitctl: %s\n", refit_last_error(c));
    else
        printf("version %" PRIu64 " committed\n", version);
    refit_close(c);
    return rc < 0 ? 1 : 0;
}

/* One line of `refitctl watch`: what the daemon is doing now. */
static void watch_line(json_t *st, char *out, size_t len)
{
    json_t *prog = json_object_get(st, "progress"), *cluster = json_object_get(st, "cluster");
    json_t *last = json_object_get(st, "last_refit");
    char done[32], total[32];

    if (prog) {
        double d = num(prog, "bytes_done"), t = num(prog, "bytes_total");
        double el = num(prog, "elapsed_s");

        human_bytes(d, done, sizeof(done));
        human_bytes(t, total, sizeof(total));
        snprintf(out, len, "version %.0f moving: %s of %s (%.0f%%), %.2f GB/s, %.1f s",
                 num(prog, "version"), done, total, t > 0 ? 100 * d / t : 100.0,
                 el > 0 ? d / el / 1e9 : 0.0, el);
    } else if (cluster && !json_is_null(json_object_get(cluster, "version_in_flight"))) {
        snprintf(out, len, "cluster %s version %.0f (committed %.0f)", str(cluster, "state"),
                 num(cluster, "version_in_flight"), num(cluster, "committed"));
    } else {
        human_bytes(num(last, "bytes"), total, sizeof(total));
        snprintf(out, len, "idle: committed version %.0f; last refit version %.0f %s, %s in "
                 "%.3f s", num(st, "committed"), num(last, "version"), str(last, "result"),
                 total, num(last, "total_s"));
    }
}

int rf_ctl_watch(int argc, char **argv)
{
    static const char usage[] =
        "usage: refitctl watch [--socket PATH] [--interval SECONDS] [--until N]\n"
        "Shows what the daemon is doing as it changes: a refit's progress (bytes done of the\n"
        "daemon's share, rate, elapsed) while its data path runs, the cluster stage on the\n"
        "coordinator, and each result. With --until N, exits once version N is committed\n"
        "(0) or the daemon goes away (3).\n";
    static const struct option opts[] = {{"socket", 1, 0, 's'}, {"interval", 1, 0, 'i'},
                                         {"until", 1, 0, 'u'},  {"help", 0, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *socket = default_socket();
    double interval = 0.2;
    uint64_t until = 0;
    char prev[256] = "", line[256];
    refit_client *c;
    int o, rc;

    optind = 1;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 's': socket = optarg; break;
        case 'i': {
            int ms;

            if (parse_timeout(optarg, &ms) < 0)
                return 2;
            interval = ms / 1000.0;
            break;
        }
        case 'u':
            if (parse_version(optarg, &until) < 0)
                return 2;
            break;
        case 'h': printf("%s", usage); return 0;
        default: fprintf(stderr, "%s", usage); return 2;
        }
    }
    if (interval < 0.01 || optind != argc) {
        fprintf(stderr, "%s", usage);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    c = dial(socket, &rc);
    if (!c)
        return rc;
    for (;;) {
        char *txt = NULL;
        json_t *st;

        if (refit_status_json(c, &txt) < 0) {
            fprintf(stderr, "refitctl: %s\n", refit_last_error(c));
            refit_close(c);
            return RF_CTL_EXIT_NODAEMON;
        }
        st = json_loads(txt, 0, NULL);
        free(txt);
        if (st) {
            watch_line(st, line, sizeof(line));
            if (strcmp(line, prev) != 0) {
                printf("%s\n", line);
                snprintf(prev, sizeof(prev), "%s", line);
            }
            if (until && num(st, "committed") >= (double)until) {
                json_decref(st);
                break;
            }
            json_decref(st);
        }
        usleep((useconds_t)(interval * 1e6));
    }
    refit_close(c);
    return 0;
}
