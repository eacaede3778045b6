/* tests/unit/test_metrics.c - exact Prometheus text for every metric kind, escaping, number
 * formatting, every registration and update error, and updates racing renders. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"

static rf_metrics *m;

static void setup(void)
{
    m = rf_metrics_new();
    cr_assert_not_null(m);
}

static void teardown(void)
{
    rf_metrics_free(m);
}

TestSuite(metrics, .init = setup, .fini = teardown);

static char *render(void)
{
    char *s = NULL;
    size_t len = 0;

    cr_assert_eq(rf_metrics_render(m, &s, &len), 0);
    cr_assert_eq(len, strlen(s));
    return s;
}

static void assert_render(const char *want)
{
    char *s = render();

    cr_assert_str_eq(s, want);
    free(s);
}

Test(metrics, empty_registry_renders_nothing)
{
    assert_render("");
}

Test(metrics, counter_gauge_info_exact_text)
{
    rf_metric *refits, *peers, *version, *info;

    cr_assert_eq(rf_metrics_counter(m, &refits, "refit_refits_total", "Refits by result.",
                                     "result"), 0);
    cr_assert_eq(rf_metrics_gauge(m, &peers, "refit_peers_connected", "Connected peers.", NULL), 0);
    cr_assert_eq(rf_metrics_gauge(m, &version, "refit_committed_version",
                                  "Last committed version.", ""), 0);
    cr_assert_eq(rf_metrics_info(m, &info, "refit_build_info", "Build and node.",
                                 "version,node,role"), 0);

    cr_assert_eq(rf_metric_add(refits, 1, "ok"), 0);
    cr_assert_eq(rf_metric_add(refits, 1, "ok"), 0);
    cr_assert_eq(rf_metric_add(refits, 1, "aborted"), 0);
    cr_assert_eq(rf_metric_set(peers, 3), 0);
    cr_assert_eq(rf_metric_add(peers, -1), 0);
    cr_assert_eq(rf_metric_set(version, 17), 0);
    cr_assert_eq(rf_metric_info_set(info, "0.0.9", "old", "publisher"), 0);
    cr_assert_eq(rf_metric_info_set(info, "0.1.0", "gpu-7", "publisher"), 0);

    assert_render("# HELP refit_refits_total Refits by result.\n"
                  "# TYPE refit_refits_total counter\n"
                  "refit_refits_total{result=\"ok\"} 2\n"
                  "refit_refits_total{result=\"aborted\"} 1\n"
                  "# HELP refit_peers_connected Connected peers.\n"
                  "# TYPE refit_peers_connected gauge\n"
                  "refit_peers_connected 2\n"
                  "# HELP refit_committed_version Last committed version.\n"
                  "# TYPE refit_committed_version gauge\n"
                  "refit_committed_version 17\n"
                  "# HELP refit_build_info Build and node.\n"
                  "# TYPE refit_build_info gauge\n"
                  "refit_build_info{version=\"0.1.0\",node=\"gpu-7\",role=\"publisher\"} 1\n");
}

Test(metrics, histogram_buckets_are_cumulative_and_le_inclusive)
{
    static const double bounds[] = { 0.1, 1 };
    rf_metric *h;

    cr_assert_eq(rf_metrics_histogram(m, &h, "refit_stage_seconds", "Stage durations.",
                                      "stage", bounds, 2), 0);
    cr_assert_eq(rf_metric_observe(h, 0.05, "send"), 0);
    cr_assert_eq(rf_metric_observe(h, 0.1, "send"), 0);
    cr_assert_eq(rf_metric_observe(h, 0.25, "send"), 0);
    cr_assert_eq(rf_metric_observe(h, 5, "send"), 0);
    cr_assert_eq(rf_metric_observe(h, 2, "plan"), 0);

    assert_render("# HELP refit_stage_seconds Stage durations.\n"
                  "# TYPE refit_stage_seconds histogram\n"
                  "refit_stage_seconds_bucket{stage=\"send\",le=\"0.1\"} 2\n"
                  "refit_stage_seconds_bucket{stage=\"send\",le=\"1\"} 3\n"
                  "refit_stage_seconds_bucket{stage=\"send\",le=\"+Inf\"} 4\n"
                  "refit_stage_seconds_sum{stage=\"send\"} 5.4\n"
                  "refit_stage_seconds_count{stage=\"send\"} 4\n"
                  "refit_stage_seconds_bucket{stage=\"plan\",le=\"0.1\"} 0\n"
                  "refit_stage_seconds_bucket{stage=\"plan\",le=\"1\"} 0\n"
                  "refit_stage_seconds_bucket{stage=\"plan\",le=\"+Inf\"} 1\n"
                  "refit_stage_seconds_sum{stage=\"plan\"} 2\n"
                  "refit_stage_seconds_count{stage=\"plan\"} 1\n");
}

Test(metrics, histogram_without_labels_and_standard_buckets)
{
    rf_metric *h;
    char *s;

    cr_assert_eq(rf_metrics_histogram(m, &h, "refit_duration_seconds", "Refit duration.", NULL,
                                      rf_metrics_seconds_buckets, rf_metrics_seconds_nbuckets), 0);
    cr_assert_eq(rf_metric_observe(h, 0.003), 0);
    s = render();
    cr_assert_not_null(strstr(s, "refit_duration_seconds_bucket{le=\"0.0025\"} 0\n"
                                 "refit_duration_seconds_bucket{le=\"0.005\"} 1\n"));
    cr_assert_not_null(strstr(s, "refit_duration_seconds_bucket{le=\"600\"} 1\n"
                                 "refit_duration_seconds_bucket{le=\"+Inf\"} 1\n"
                                 "refit_duration_seconds_sum 0.003\n"
                                 "refit_duration_seconds_count 1\n"));
    free(s);
}

Test(metrics, escaping_of_help_and_label_values)
{
    rf_metric *c;

    cr_assert_eq(rf_metrics_counter(m, &c, "refit_bytes_total", "Bytes \\ per \"peer\"\nsent.",
                                     "peer"), 0);
    cr_assert_eq(rf_metric_add(c, 4096, "node \"a\"\\b\nc"), 0);
    assert_render("# HELP refit_bytes_total Bytes \\\\ per \"peer\"\\nsent.\n"
                  "# TYPE refit_bytes_total counter\n"
                  "refit_bytes_total{peer=\"node \\\"a\\\"\\\\b\\nc\"} 4096\n");
}

Test(metrics, number_formatting)
{
    rf_metric *g;

    cr_assert_eq(rf_metrics_gauge(m, &g, "g", "h", "k"), 0);
    rf_metric_set(g, 0.1, "a");
    rf_metric_set(g, 1e15, "b");
    rf_metric_set(g, 123456789012.0, "c");
    rf_metric_set(g, -2.5e-9, "d");
    rf_metric_set(g, INFINITY, "e");
    rf_metric_set(g, -INFINITY, "f");
    rf_metric_set(g, NAN, "g");
    rf_metric_set(g, 1.0 / 3, "h");
    assert_render("# HELP g h\n# TYPE g gauge\n"
                  "g{k=\"a\"} 0.1\n"
                  "g{k=\"b\"} 1e+15\n"
                  "g{k=\"c\"} 123456789012\n"
                  "g{k=\"d\"} -2.5e-09\n"
                  "g{k=\"e\"} +Inf\n"
                  "g{k=\"f\"} -Inf\n"
                  "g{k=\"g\"} NaN\n"
                  "g{k=\"h\"} 0.3333333333333333\n");
}

Test(metrics, remove_drops_a_series)
{
    rf_metric *g;

    cr_assert_eq(rf_metrics_gauge(m, &g, "refit_peer_up", "Peer up.", "peer,role"), 0);
    rf_metric_set(g, 1, "a", "publisher");
    rf_metric_set(g, 1, "b", "receiver");
    rf_metric_set(g, 1, "c", "receiver");
    cr_assert_eq(rf_metric_remove(g, "b", "receiver"), 0);
    cr_assert_eq(rf_metric_remove(g, "b", "receiver"), -ENOENT);
    cr_assert_eq(rf_metric_remove(g, "a", "receiver"), -ENOENT);
    assert_render("# HELP refit_peer_up Peer up.\n# TYPE refit_peer_up gauge\n"
                  "refit_peer_up{peer=\"a\",role=\"publisher\"} 1\n"
                  "refit_peer_up{peer=\"c\",role=\"receiver\"} 1\n");
}

Test(metrics, registration_errors)
{
    static const double up[] = { 1, 2 }, flat[] = { 1, 1 }, down[] = { 2, 1 };
    static const double inf[] = { 1, INFINITY };
    rf_metric *f = NULL;

    cr_assert_eq(rf_metrics_counter(m, &f, "1abc", "h", NULL), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "a-b", "h", NULL), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "", "h", NULL), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, NULL, "h", NULL), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "ok", NULL, NULL), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "ok", "h", "__reserved"), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "ok", "h", "a:b"), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "ok", "h", "a,,b"), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "ok", "h", "a,b,a"), -EINVAL);
    cr_assert_eq(rf_metrics_counter(m, &f, "ok", "h",
                                     "a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q"), -EINVAL);
    cr_assert_eq(rf_metrics_histogram(m, &f, "h1", "h", "le", up, 2), -EINVAL);
    cr_assert_eq(rf_metrics_histogram(m, &f, "h1", "h", NULL, flat, 2), -EINVAL);
    cr_assert_eq(rf_metrics_histogram(m, &f, "h1", "h", NULL, down, 2), -EINVAL);
    cr_assert_eq(rf_metrics_histogram(m, &f, "h1", "h", NULL, inf, 2), -EINVAL);
    cr_assert_eq(rf_metrics_histogram(m, &f, "h1", "h", NULL, NULL, 0), -EINVAL);
    cr_assert_null(f);
    cr_assert_eq(rf_metrics_counter(m, &f, "ns:ok_total", "h", "le"), 0);
    cr_assert_eq(rf_metrics_gauge(m, &f, "ns:ok_total", "h", NULL), -EEXIST);
    assert_render("# HELP ns:ok_total h\n# TYPE ns:ok_total counter\n");
}

Test(metrics, update_errors)
{
    static const double b[] = { 1 };
    rf_metric *c, *g, *h, *i;

    cr_assert_eq(rf_metrics_counter(m, &c, "c", "h", "x"), 0);
    cr_assert_eq(rf_metrics_gauge(m, &g, "g", "h", NULL), 0);
    cr_assert_eq(rf_metrics_histogram(m, &h, "hist", "h", NULL, b, 1), 0);
    cr_assert_eq(rf_metrics_info(m, &i, "i_info", "h", "v"), 0);

    cr_assert_eq(rf_metric_add(c, -1, "a"), -EINVAL);
    cr_assert_eq(rf_metric_add(c, NAN, "a"), -EINVAL);
    cr_assert_eq(rf_metric_add(c, 1, (const char *)NULL), -EINVAL);
    cr_assert_eq(rf_metric_set(c, 1, "a"), -EINVAL);
    cr_assert_eq(rf_metric_observe(c, 1, "a"), -EINVAL);
    cr_assert_eq(rf_metric_info_set(c, "a"), -EINVAL);
    cr_assert_eq(rf_metric_observe(g, 1), -EINVAL);
    cr_assert_eq(rf_metric_add(h, 1), -EINVAL);
    cr_assert_eq(rf_metric_observe(h, NAN), -EINVAL);
    cr_assert_eq(rf_metric_add(i, 1, "v"), -EINVAL);
    cr_assert_eq(rf_metric_add(NULL, 1), -EINVAL);
    cr_assert_eq(rf_metrics_render(NULL, NULL, NULL), -EINVAL);
    /* A gauge may go down; nothing above created a series. */
    cr_assert_eq(rf_metric_add(g, -3), 0);
    assert_render("# HELP c h\n# TYPE c counter\n"
                  "# HELP g h\n# TYPE g gauge\ng -3\n"
                  "# HELP hist h\n# TYPE hist histogram\n"
                  "# HELP i_info h\n# TYPE i_info gauge\n");
}

#define THREADS 4
#define ITERS 20000

static rf_metric *racing_c, *racing_h;

static void *updater(void *arg)
{
    char peer[16];

    snprintf(peer, sizeof(peer), "p%d", (int)(long)arg % 2);
    for (int i = 0; i < ITERS; i++) {
        rf_metric_add(racing_c, 1, peer);
        rf_metric_observe(racing_h, 0.5);
    }
    return NULL;
}

Test(metrics, concurrent_updates_and_renders)
{
    static const double b[] = { 1 };
    pthread_t t[THREADS];
    char *s;

    cr_assert_eq(rf_metrics_counter(m, &racing_c, "c_total", "h", "peer"), 0);
    cr_assert_eq(rf_metrics_histogram(m, &racing_h, "h_seconds", "h", NULL, b, 1), 0);
    for (long i = 0; i < THREADS; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, updater, (void *)i), 0);
    for (int i = 0; i < 200; i++)
        free(render());
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    s = render();
    cr_assert_not_null(strstr(s, "c_total{peer=\"p0\"} 40000\n"));
    cr_assert_not_null(strstr(s, "c_total{peer=\"p1\"} 40000\n"));
    cr_assert_not_null(strstr(s, "h_seconds_bucket{le=\"1\"} 80000\n"
                                 "h_seconds_bucket{le=\"+Inf\"} 80000\n"
                                 "h_seconds_sum 40000\nh_seconds_count 80000\n"));
    free(s);
}
