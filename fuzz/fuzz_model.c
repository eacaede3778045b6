/* fuzz/fuzz_model.c - the model spec reader and the layouts (common/model/model.h): any JSON as a
 * model spec file, any trainer and engine layout strings. When the spec and both layouts are
 * accepted and the model is small enough to lay out quickly, every rank of both sides is laid
 * out into an inventory (common/model/layout.h validates each piece) and planned: the layouts of
 * one model always cover every tensor on both sides, so neither step may fail.
 * Input: the JSON text, then optionally a NUL, the trainer layout, a NUL, the engine layout. */
#include <errno.h>

#include "fuzz.h"
#include "model.h"
#include "plan.h"

/* Past these the inventory and plan take longer than an input should. */
#define MAX_TENSORS 2000
#define MAX_RANKS 16
#define MAX_BYTES (4ull << 30) /* packed transfers of more make too many messages */

/* The NUL-terminated string at *p (inside end), or "" when the input ends first. */
static char *next_str(const uint8_t **p, const uint8_t *end, char *buf, size_t cap)
{
    const uint8_t *nul = *p < end ? memchr(*p, 0, (size_t)(end - *p)) : NULL;
    size_t n = nul ? (size_t)(nul - *p) : (size_t)(end - *p);

    if (*p >= end) {
        buf[0] = '\0';
        return buf;
    }
    if (n >= cap)
        n = cap - 1;
    memcpy(buf, *p, n);
    buf[n] = '\0';
    *p = nul ? nul + 1 : end;
    return buf;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char path[160];
    const uint8_t *nul = memchr(data, 0, size), *p, *end = data + size;
    char src_s[128], dst_s[128];
    rf_model *m = NULL;
    rf_inv *inv = NULL;
    rf_plan *plan = NULL;
    rf_plan_opts po;
    rf_par src, dst;
    rf_err err = {0};
    int rc;

    fuzz_quiet();
    if (path[0] == '\0')
        snprintf(path, sizeof(path), "%s/model.json", fuzz_dir());
    fuzz_write_file(path, data, nul ? (size_t)(nul - data) : size);
    p = nul ? nul + 1 : end;
    next_str(&p, end, src_s, sizeof(src_s));
    next_str(&p, end, dst_s, sizeof(dst_s));

    rc = rf_model_load(path, &m, &err);
    if (rc < 0) {
        if (err.msg[0] == '\0')
            abort(); /* a refused spec must say why */
        goto out;
    }
    if (rf_par_parse(src_s, RF_SRC, m, &src, &err) < 0 ||
        rf_par_parse(dst_s, RF_DST, m, &dst, &err) < 0)
        goto out;
    if (rf_model_ntensors(m) > MAX_TENSORS || rf_model_bytes(m) > MAX_BYTES ||
        rf_par_world(&src, RF_SRC) > MAX_RANKS ||
        rf_par_world(&dst, RF_DST) > MAX_RANKS)
        goto out;
    inv = rf_inv_new();
    if (inv == NULL)
        goto out;
    rc = rf_model_build_inv(m, &src, &dst, 8, inv, &err);
    if (rc == -ENOMEM)
        goto out;
    if (rc < 0) {
        fprintf(stderr, "fuzz_model: %s laid out as trainer '%s', engine '%s' (both accepted) "
                "does not make a valid inventory: %s\n", rf_model_name(m), src_s, dst_s, err.msg);
        abort();
    }
    rf_plan_opts_default(&po);
    rc = rf_plan_build(inv, &po, &plan, &err);
    if (rc < 0 && rc != -ENOMEM) {
        fprintf(stderr, "fuzz_model: %s laid out as trainer '%s', engine '%s' does not plan: %s\n",
                rf_model_name(m), src_s, dst_s, err.msg);
        abort();
    }
out:
    rf_plan_free(plan);
    rf_inv_free(inv);
    rf_model_free(m);
    return 0;
}
