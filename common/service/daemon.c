/* common/service/daemon.c - the main of both daemons: config, key, loop, node, status endpoint,
 * signals and systemd notification; the role-specific part comes in through hooks. */
#define RF_LOG_MODULE "daemon"
#include "daemon.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "addr.h"
#include "httpd.h"
#include "log.h"
#ifdef RF_HAVE_CUDA
#include "mem_cuda.h"
#endif
#include "sdnotify.h"

typedef struct rf_daemon_state {
    uv_loop_t loop;
    uv_signal_t sigint, sigterm;
    uv_timer_t watchdog;
    rf_node *node;
    const rf_daemon_hooks *hooks;
    void *hook_state;
    rf_httpd *httpd;
    bool stopping;
} daemon_state;

static char *status_json(void *arg)
{
    return rf_node_status_snapshot(arg);
}

static void walk_close(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

static void stop(daemon_state *d, const char *why)
{
    if (d->stopping)
        return;
    d->stopping = true;
    RF_INFO("stopping: %s", why);
    rf_sd_notify("STOPPING=1");
    if (d->hooks && d->hooks->close && d->hook_state)
        d->hooks->close(d->hook_state);
    rf_node_close(d->node);
    uv_close((uv_handle_t *)&d->sigint, NULL);
    uv_close((uv_handle_t *)&d->sigterm, NULL);
    uv_close((uv_handle_t *)&d->watchdog, NULL);
}

static void on_signal(uv_signal_t *s, int signum)
{
    daemon_state *d = s->data;

    stop(d, signum == SIGINT ? "SIGINT" : "SIGTERM");
}

/* Runs on the loop: a stuck loop stops feeding systemd's watchdog, which then restarts us. */
static void on_watchdog(uv_timer_t *t)
{
    daemon_state *d = t->data;
    char line[256];

    rf_node_status_line(d->node, line, sizeof(line));
    rf_sd_notify("WATCHDOG=1\nSTATUS=%s", line);
}

int rf_daemon_main(int role, int argc, char **argv, const rf_daemon_hooks *hooks)
{
    rf_daemon_cfg cfg;
    rf_cfg_next next = RF_CFG_RUN;
    rf_err err = {0};
    rf_peer_key key;
    rf_metrics *metrics = NULL;
    rf_node_opts no = {0};
    daemon_state d;
    uint64_t wd, daemon_id;
    int rc, status = 1;

    memset(&cfg, 0, sizeof(cfg));
    memset(&d, 0, sizeof(d));
    rc = rf_daemon_cfg_load(&cfg, role, argc, argv, &next, &err);
    if (rc < 0) {
        fprintf(stderr, "%s\n", err.msg);
        rf_daemon_cfg_free(&cfg);
        return rf_cfg_check_only(argc, argv) ? 1 : RF_CFG_EXIT_CONFIG;
    }
    if (next == RF_CFG_EXIT) {
        rf_daemon_cfg_free(&cfg);
        return 0;
    }
    rf_log_init(cfg.log_level, RF_LOG_JOURNAL_AUTO);
    signal(SIGPIPE, SIG_IGN);
    if (sodium_init() < 0) {
        RF_ERROR("libsodium failed to initialise");
        goto out_cfg;
    }
    /* The same check as --check-config. An address that is not (yet) this machine's may be
     * a network still coming up: exit 1, which systemd retries; the rest is the config's. */
    rc = rf_daemon_cfg_check(&cfg, &key, &err);
    if (rc < 0) {
        RF_ERROR("%s", err.msg);
        status = rc == -EADDRNOTAVAIL ? 1 : RF_CFG_EXIT_CONFIG;
        goto out_cfg;
    }
    randombytes_buf(&daemon_id, sizeof(daemon_id));
#ifdef RF_HAVE_CUDA
    /* GPU memory import; without a GPU the daemon still serves host memory. */
    if (rf_mem_cuda_init(&err) < 0)
        RF_INFO("CUDA memory import unavailable: %s", err.msg);
    rf_err_clear(&err);
#endif
    metrics = rf_metrics_new();
    uv_loop_init(&d.loop);
    d.hooks = hooks;

    no.cfg = &cfg;
    no.key = &key;
    no.daemon_id = daemon_id;
    no.metrics = metrics;
    /* The coordinator listens before the local node connects to it, so start the hooks
     * first when there are any: the node's first attempt then finds the listener. */
    if (hooks && hooks->start) {
        rc = hooks->start(&d.loop, &cfg, &key, daemon_id, metrics, &d.hook_state, &err);
        if (rc < 0) {
            RF_ERROR("%s", err.msg);
            goto out_loop;
        }
    }
    rc = rf_node_start(&d.loop, &no, &d.node, &err);
    if (rc < 0) {
        RF_ERROR("%s", err.msg);
        if (hooks && hooks->close && d.hook_state)
            hooks->close(d.hook_state);
        goto out_loop;
    }
    if (hooks && hooks->attach && d.hook_state)
        hooks->attach(d.hook_state, d.node);
    /* Initialised before anything can fail, so that stop() may close them. */
    uv_signal_init(&d.loop, &d.sigint);
    uv_signal_init(&d.loop, &d.sigterm);
    d.sigint.data = d.sigterm.data = &d;
    uv_signal_start(&d.sigint, on_signal, SIGINT);
    uv_signal_start(&d.sigterm, on_signal, SIGTERM);
    uv_timer_init(&d.loop, &d.watchdog);
    d.watchdog.data = &d;
    if (cfg.status_listen[0]) {
        rc = rf_httpd_start(&d.httpd, cfg.status_listen, metrics, status_json, d.node, &err);
        if (rc < 0) {
            RF_ERROR("%s", err.msg);
            stop(&d, "status endpoint failed");
            uv_run(&d.loop, UV_RUN_DEFAULT);
            status = 1;
            goto out_loop;
        }
        {
            rf_addr a;
            const char *host = rf_addr_parse(cfg.status_listen, RF_ADDR_LISTEN, &a, NULL) == 0
                                   ? (a.host[0] ? a.host : "0.0.0.0") : cfg.status_listen;

            RF_INFO("status endpoint on http://%s%s%s:%d/ (/metrics, /status)",
                    strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "",
                    rf_httpd_port(d.httpd));
        }
    }
    wd = rf_sd_watchdog_usec();
    uv_timer_start(&d.watchdog, on_watchdog, 0, wd ? wd / 2000 : 5000);
    rf_sd_notify("READY=1\nSTATUS=started");

    uv_run(&d.loop, UV_RUN_DEFAULT);
    status = 0;
out_loop:
    rf_httpd_stop(d.httpd);
    uv_walk(&d.loop, walk_close, NULL);
    uv_run(&d.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d.loop) != 0) {
        RF_ERROR("event loop still had open handles at exit");
        status = status ? status : 1;
    }
    rf_metrics_free(metrics);
    sodium_memzero(&key, sizeof(key));
out_cfg:
    rf_daemon_cfg_free(&cfg);
    return status;
}
