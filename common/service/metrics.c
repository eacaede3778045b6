/* common/service/metrics.c - registry, series lookup and Prometheus text rendering. One mutex guards
 * the whole registry: updates are a few per refit stage, renders one per scrape. */
#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double rf_metrics_seconds_buckets[] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
};
const size_t rf_metrics_seconds_nbuckets =
    sizeof(rf_metrics_seconds_buckets) / sizeof(rf_metrics_seconds_buckets[0]);

enum kind { K_COUNTER, K_GAUGE, K_HISTOGRAM, K_INFO };

#define MAX_LABELS 16

typedef struct series {
    char **values;     /* one per label name */
    double value;      /* counter, gauge */
    uint64_t *buckets; /* histogram: per-bound counts, not cumulative; nbounds + 1 (+Inf) */
    double sum;
    uint64_t count;
} series;

struct rf_metric {
    rf_metrics *reg;
    enum kind kind;
    char *name;
    char *help;
    size_t nlabels;
    char **labels;
    double *bounds;
    size_t nbounds;
    series *s;
    size_t ns, cap;
};

struct rf_metrics {
    pthread_mutex_t lock;
    rf_metric **fam;
    size_t nfam, cap;
};

static const char *const type_names[] = { "counter", "gauge", "histogram", "gauge" };

rf_metrics *rf_metrics_new(void)
{
    rf_metrics *m = calloc(1, sizeof(*m));

    if (m == NULL)
        return NULL;
    if (pthread_mutex_init(&m->lock, NULL) != 0) {
        free(m);
        return NULL;
    }
    return m;
}

static void series_clear(rf_metric *f, series *s)
{
    for (size_t i = 0; i < f->nlabels; i++)
        free(s->values[i]);
    free(s->values);
    free(s->buckets);
}

static void family_free(rf_metric *f)
{
    if (f == NULL)
        return;
    for (size_t i = 0; i < f->ns; i++)
        series_clear(f, &f->s[i]);
    free(f->s);
    for (size_t i = 0; i < f->nlabels; i++)
        free(f->labels[i]);
    free(f->labels);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f);
}

void rf_metrics_free(rf_metrics *m)
{
    if (m == NULL)
        return;
    for (size_t i = 0; i < m->nfam; i++)
        family_free(m->fam[i]);
    free(m->fam);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

static int valid_name(const char *s, int allow_colon)
{
    if (s == NULL || *s == '\0')
        return 0;
    for (const char *p = s; *p; p++) {
        int alpha = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' ||
                    (allow_colon && *p == ':');
        int digit = *p >= '0' && *p <= '9';

        if (!alpha && !(digit && p != s))
            return 0;
    }
    return 1;
}

/* Splits "a,b" into label names, checking each. */
static int split_labels(rf_metric *f, const char *labels)
{
    const char *p = labels;

    if (labels == NULL || *labels == '\0')
        return 0;
    f->labels = calloc(MAX_LABELS, sizeof(char *));
    if (f->labels == NULL)
        return -ENOMEM;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        char *name;

        if (f->nlabels == MAX_LABELS)
            return -EINVAL;
        name = strndup(p, n);
        if (name == NULL)
            return -ENOMEM;
        f->labels[f->nlabels++] = name;
        if (!valid_name(name, 0) || strncmp(name, "__", 2) == 0 ||
            (f->kind == K_HISTOGRAM && strcmp(name, "le") == 0))
            return -EINVAL;
        for (size_t i = 0; i + 1 < f->nlabels; i++)
            if (strcmp(f->labels[i], name) == 0)
                return -EINVAL;
        if (comma == NULL)
            return 0;
        p = comma + 1;
    }
}

static int family_add(rf_metrics *m, rf_metric **out, enum kind kind, const char *name,
                      const char *help, const char *labels, const double *bounds, size_t nbounds)
{
    rf_metric *f = NULL;
    int rc;

    if (m == NULL || out == NULL || !valid_name(name, 1) || help == NULL)
        return -EINVAL;
    f = calloc(1, sizeof(*f));
    if (f == NULL)
        return -ENOMEM;
    f->reg = m;
    f->kind = kind;
    f->name = strdup(name);
    f->help = strdup(help);
    if (f->name == NULL || f->help == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    rc = split_labels(f, labels);
    if (rc != 0)
        goto out;
    if (kind == K_HISTOGRAM) {
        if (bounds == NULL || nbounds == 0) {
            rc = -EINVAL;
            goto out;
        }
        for (size_t i = 0; i < nbounds; i++) {
            if (!isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1])) {
                rc = -EINVAL;
                goto out;
            }
        }
        f->bounds = malloc(nbounds * sizeof(double));
        if (f->bounds == NULL) {
            rc = -ENOMEM;
            goto out;
        }
        memcpy(f->bounds, bounds, nbounds * sizeof(double));
        f->nbounds = nbounds;
    }

    pthread_mutex_lock(&m->lock);
    for (size_t i = 0; i < m->nfam; i++) {
        if (strcmp(m->fam[i]->name, name) == 0) {
            rc = -EEXIST;
            break;
        }
    }
    if (rc == 0 && m->nfam == m->cap) {
        size_t ncap = m->cap ? m->cap * 2 : 16;
        rf_metric **nf = realloc(m->fam, ncap * sizeof(*nf));

        if (nf == NULL) {
            rc = -ENOMEM;
        } else {
            m->fam = nf;
            m->cap = ncap;
        }
    }
    if (rc == 0) {
        m->fam[m->nfam++] = f;
        *out = f;
        f = NULL;
    }
    pthread_mutex_unlock(&m->lock);
out:
    family_free(f);
    return rc;
}

int rf_metrics_counter(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                       const char *labels)
{
    return family_add(m, out, K_COUNTER, name, help, labels, NULL, 0);
}

int rf_metrics_gauge(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                     const char *labels)
{
    return family_add(m, out, K_GAUGE, name, help, labels, NULL, 0);
}

int rf_metrics_histogram(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                         const char *labels, const double *bounds, size_t nbounds)
{
    return family_add(m, out, K_HISTOGRAM, name, help, labels, bounds, nbounds);
}

int rf_metrics_info(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                    const char *labels)
{
    return family_add(m, out, K_INFO, name, help, labels, NULL, 0);
}

/* Reads the label values of one call; -EINVAL for a NULL value. */
static int read_values(rf_metric *f, va_list ap, const char **vals)
{
    for (size_t i = 0; i < f->nlabels; i++) {
        vals[i] = va_arg(ap, const char *);
        if (vals[i] == NULL)
            return -EINVAL;
    }
    return 0;
}

static series *find_series(rf_metric *f, const char **vals)
{
    for (size_t i = 0; i < f->ns; i++) {
        size_t j = 0;

        while (j < f->nlabels && strcmp(f->s[i].values[j], vals[j]) == 0)
            j++;
        if (j == f->nlabels)
            return &f->s[i];
    }
    return NULL;
}

/* Called with the lock held. */
static series *get_series(rf_metric *f, const char **vals)
{
    series *s = find_series(f, vals), ns;

    if (s != NULL)
        return s;
    memset(&ns, 0, sizeof(ns));
    if (f->ns == f->cap) {
        size_t ncap = f->cap ? f->cap * 2 : 4;
        series *n = realloc(f->s, ncap * sizeof(*n));

        if (n == NULL)
            return NULL;
        f->s = n;
        f->cap = ncap;
    }
    ns.values = calloc(f->nlabels ? f->nlabels : 1, sizeof(char *));
    if (ns.values == NULL)
        return NULL;
    for (size_t i = 0; i < f->nlabels; i++) {
        ns.values[i] = strdup(vals[i]);
        if (ns.values[i] == NULL)
            goto fail;
    }
    if (f->kind == K_HISTOGRAM) {
        ns.buckets = calloc(f->nbounds + 1, sizeof(uint64_t));
        if (ns.buckets == NULL)
            goto fail;
    }
    f->s[f->ns] = ns;
    return &f->s[f->ns++];
fail:
    series_clear(f, &ns);
    return NULL;
}

enum op { OP_ADD, OP_SET, OP_OBSERVE, OP_INFO, OP_REMOVE };

static int update(rf_metric *f, enum op op, double v, va_list ap)
{
    const char *vals[MAX_LABELS];
    series *s;
    int rc;

    if (f == NULL)
        return -EINVAL;
    rc = read_values(f, ap, vals);
    if (rc != 0)
        return rc;
    switch (op) {
    case OP_ADD:
        if ((f->kind != K_COUNTER && f->kind != K_GAUGE) || isnan(v) ||
            (f->kind == K_COUNTER && v < 0))
            return -EINVAL;
        break;
    case OP_SET:
        if (f->kind != K_GAUGE)
            return -EINVAL;
        break;
    case OP_OBSERVE:
        if (f->kind != K_HISTOGRAM || isnan(v))
            return -EINVAL;
        break;
    case OP_INFO:
        if (f->kind != K_INFO)
            return -EINVAL;
        break;
    case OP_REMOVE:
        break;
    }

    pthread_mutex_lock(&f->reg->lock);
    if (op == OP_REMOVE) {
        s = find_series(f, vals);
        if (s == NULL) {
            rc = -ENOENT;
        } else {
            size_t i = (size_t)(s - f->s);

            series_clear(f, s);
            memmove(&f->s[i], &f->s[i + 1], (f->ns - i - 1) * sizeof(series));
            f->ns--;
        }
        goto out;
    }
    if (op == OP_INFO) {
        /* An info metric holds one series: the current set of label values. */
        while (f->ns > 0)
            series_clear(f, &f->s[--f->ns]);
    }
    s = get_series(f, vals);
    if (s == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    switch (op) {
    case OP_ADD:
        s->value += v;
        break;
    case OP_SET:
        s->value = v;
        break;
    case OP_INFO:
        s->value = 1;
        break;
    case OP_OBSERVE: {
        size_t b = 0;

        while (b < f->nbounds && v > f->bounds[b])
            b++;
        s->buckets[b]++;
        s->sum += v;
        s->count++;
        break;
    }
    case OP_REMOVE:
        break;
    }
out:
    pthread_mutex_unlock(&f->reg->lock);
    return rc;
}

#define UPDATE_VA(f, op, v)                                                        \
    do {                                                                           \
        va_list ap;                                                                \
        int rc_;                                                                   \
        va_start(ap, v);                                                           \
        rc_ = update((f), (op), (v), ap);                                          \
        va_end(ap);                                                                \
        return rc_;                                                                \
    } while (0)

int rf_metric_add(rf_metric *f, double v, ...)
{
    UPDATE_VA(f, OP_ADD, v);
}

int rf_metric_set(rf_metric *f, double v, ...)
{
    UPDATE_VA(f, OP_SET, v);
}

int rf_metric_observe(rf_metric *f, double v, ...)
{
    UPDATE_VA(f, OP_OBSERVE, v);
}

int rf_metric_info_set(rf_metric *f, ...)
{
    va_list ap;
    int rc;

    va_start(ap, f);
    rc = update(f, OP_INFO, 0, ap);
    va_end(ap);
    return rc;
}

int rf_metric_remove(rf_metric *f, ...)
{
    va_list ap;
    int rc;

    va_start(ap, f);
    rc = update(f, OP_REMOVE, 0, ap);
    va_end(ap);
    return rc;
}

/* A growing output buffer; a failed allocation sticks and is reported at the end. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    int failed;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->failed)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t ncap = b->cap ? b->cap : 4096;
        char *np;

        while (b->len + n + 1 > ncap)
            ncap *= 2;
        np = realloc(b->p, ncap);
        if (np == NULL) {
            b->failed = 1;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

/* HELP text escapes backslash and newline; label values also escape the double quote. */
static void sb_escaped(sbuf *b, const char *s, int quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            sb_str(b, "\\\\");
        else if (*s == '\n')
            sb_str(b, "\\n");
        else if (quote && *s == '"')
            sb_str(b, "\\\"");
        else
            sb_put(b, s, 1);
    }
}

/* Shortest form that reads back as the same double; Prometheus spellings of the specials. */
static void sb_double(sbuf *b, double v)
{
    char tmp[40];

    if (isnan(v)) {
        sb_str(b, "NaN");
        return;
    }
    if (isinf(v)) {
        sb_str(b, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    /* Whole numbers (counts, bytes, versions) print without an exponent, as Prometheus
     * client libraries do; the rest take the fewest digits that read back exactly. */
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(tmp, sizeof(tmp), "%.0f", v);
        sb_str(b, tmp);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*g", prec, v);
        if (strtod(tmp, NULL) == v)
            break;
    }
    sb_str(b, tmp);
}

static void sb_u64(sbuf *b, uint64_t v)
{
    char tmp[24];

    snprintf(tmp, sizeof(tmp), "%llu", (unsigned long long)v);
    sb_str(b, tmp);
}

/* name{l1="v1",l2="v2",le="0.5"} with the extra "le" pair when le_or_null is given. */
static void sb_series_name(sbuf *b, const rf_metric *f, const series *s, const char *suffix,
                           const char *le)
{
    size_t n = 0;

    sb_str(b, f->name);
    sb_str(b, suffix);
    if (f->nlabels == 0 && le == NULL)
        return;
    sb_str(b, "{");
    for (size_t i = 0; i < f->nlabels; i++, n++) {
        if (n)
            sb_str(b, ",");
        sb_str(b, f->labels[i]);
        sb_str(b, "=\"");
        sb_escaped(b, s->values[i], 1);
        sb_str(b, "\"");
    }
    if (le != NULL) {
        if (n)
            sb_str(b, ",");
        sb_str(b, "le=\"");
        sb_str(b, le);
        sb_str(b, "\"");
    }
    sb_str(b, "}");
}

static void render_family(sbuf *b, const rf_metric *f)
{
    sb_str(b, "# HELP ");
    sb_str(b, f->name);
    sb_str(b, " ");
    sb_escaped(b, f->help, 0);
    sb_str(b, "\n# TYPE ");
    sb_str(b, f->name);
    sb_str(b, " ");
    sb_str(b, type_names[f->kind]);
    sb_str(b, "\n");
    for (size_t i = 0; i < f->ns; i++) {
        const series *s = &f->s[i];

        if (f->kind != K_HISTOGRAM) {
            sb_series_name(b, f, s, "", NULL);
            sb_str(b, " ");
            sb_double(b, s->value);
            sb_str(b, "\n");
            continue;
        }
        uint64_t cum = 0;

        for (size_t k = 0; k <= f->nbounds; k++) {
            sbuf le = { 0 };

            cum += s->buckets[k];
            if (k < f->nbounds)
                sb_double(&le, f->bounds[k]);
            else
                sb_str(&le, "+Inf");
            if (le.failed) {
                b->failed = 1;
                free(le.p);
                return;
            }
            sb_series_name(b, f, s, "_bucket", le.p);
            free(le.p);
            sb_str(b, " ");
            sb_u64(b, cum);
            sb_str(b, "\n");
        }
        sb_series_name(b, f, s, "_sum", NULL);
        sb_str(b, " ");
        sb_double(b, s->sum);
        sb_str(b, "\n");
        sb_series_name(b, f, s, "_count", NULL);
        sb_str(b, " ");
        sb_u64(b, s->count);
        sb_str(b, "\n");
    }
}

int rf_metrics_render(rf_metrics *m, char **out, size_t *len)
{
    sbuf b = { 0 };

    if (m == NULL || out == NULL)
        return -EINVAL;
    sb_put(&b, "", 0);
    pthread_mutex_lock(&m->lock);
    for (size_t i = 0; i < m->nfam; i++)
        render_family(&b, m->fam[i]);
    pthread_mutex_unlock(&m->lock);
    if (b.failed) {
        free(b.p);
        return -ENOMEM;
    }
    *out = b.p;
    if (len)
        *len = b.len;
    return 0;
}
