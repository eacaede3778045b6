/* common/service/metrics.h - a small thread-safe registry of Prometheus metrics and its text rendering
 * (exposition format 0.0.4). The event loop updates, the HTTP thread renders. */
#ifndef RF_METRICS_H
#define RF_METRICS_H

#include <stddef.h>

typedef struct rf_metrics rf_metrics;
typedef struct rf_metric rf_metric; /* one family: a name, its help, its label names */

/* Bucket bounds in seconds for stage and refit durations: 1 ms .. 10 min. */
extern const double rf_metrics_seconds_buckets[];
extern const size_t rf_metrics_seconds_nbuckets;

rf_metrics *rf_metrics_new(void);
void rf_metrics_free(rf_metrics *m);

/* Family registration. labels is NULL or "" for none, or comma-separated label names
 * ("peer,direction"). Names must match [a-zA-Z_:][a-zA-Z0-9_:]* (labels: no ':', no
 * leading "__"), be unique in the registry, and a histogram may not have a label "le".
 * Returns 0 and *out (owned by the registry), or -EINVAL / -EEXIST / -ENOMEM. */
int rf_metrics_counter(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                       const char *labels);
int rf_metrics_gauge(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                     const char *labels);
/* bounds: strictly increasing finite upper bounds; +Inf is added by the renderer. */
int rf_metrics_histogram(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                         const char *labels, const double *bounds, size_t nbounds);
/* An info metric: one series whose labels carry the information, value 1, rendered as a
 * gauge ("refit_build_info{version=\"0.1.0\",node=\"gpu-7\"} 1"). */
int rf_metrics_info(rf_metrics *m, rf_metric **out, const char *name, const char *help,
                    const char *labels);

/* Updates. The label values follow as const char * arguments, exactly as many as the family
 * has label names; a series is created on first use. Return 0, -EINVAL (wrong kind of family,
 * NULL label value, negative counter increment, NaN observation) or -ENOMEM. */
int rf_metric_add(rf_metric *f, double v, ...);     /* counter or gauge */
int rf_metric_set(rf_metric *f, double v, ...);     /* gauge */
int rf_metric_observe(rf_metric *f, double v, ...); /* histogram */
int rf_metric_info_set(rf_metric *f, ...);          /* info: replaces the label values */
/* Drops one series (a peer that left); 0 or -ENOENT. */
int rf_metric_remove(rf_metric *f, ...);

/* Renders every family in registration order, series in creation order, into a malloc'd
 * NUL-terminated string. Families without series print only # HELP and # TYPE.
 * Returns 0 or -ENOMEM. */
int rf_metrics_render(rf_metrics *m, char **out, size_t *len);

#endif
