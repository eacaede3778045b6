/* common/service/cfg.c - table-driven config: defaults, INI file through libinih with line numbers,
 * command-line overrides, help text and "did you mean" suggestions. */
#include "cfg.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <math.h>
#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "addr.h"

/* inih's line buffer (INI_MAX_LINE in the distribution build). */
#define LINE_MAX_LEN 200

static void *field(void *obj, const rf_cfg_key *k)
{
    return (char *)obj + k->offset;
}

/* "staging-mib" -> "staging_mib" into out; 0 or -EINVAL when too long. */
static int normalize(const char *name, char *out, size_t outlen)
{
    size_t n = strlen(name);

    if (n >= outlen)
        return -EINVAL;
    for (size_t i = 0; i <= n; i++)
        out[i] = name[i] == '-' ? '_' : name[i];
    return 0;
}

static const rf_cfg_key *find_key(const rf_cfg_table *t, const char *name)
{
    char norm[128];

    if (normalize(name, norm, sizeof(norm)) != 0)
        return NULL;
    for (size_t i = 0; i < t->nkeys; i++)
        if (strcmp(t->keys[i].name, norm) == 0)
            return &t->keys[i];
    return NULL;
}

static size_t edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b), row[128];

    if (lb >= 128)
        return SIZE_MAX;
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];

        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);

            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

/* The closest key name, if it is close enough to be a typo; NULL otherwise. */
static const char *suggest(const rf_cfg_table *t, const char *name)
{
    char norm[128];
    const char *best = NULL;
    size_t bestd = SIZE_MAX, limit;

    if (normalize(name, norm, sizeof(norm)) != 0)
        return NULL;
    limit = strlen(norm) / 3;
    if (limit < 1)
        limit = 1;
    if (limit > 3)
        limit = 3;
    for (size_t i = 0; i < t->nkeys; i++) {
        size_t d = edit_distance(norm, t->keys[i].name);

        if (d < bestd) {
            bestd = d;
            best = t->keys[i].name;
        }
    }
    return bestd <= limit ? best : NULL;
}

static int parse_bool(const char *v, bool *out)
{
    static const char *const yes[] = { "true", "yes", "on", "1" };
    static const char *const no[] = { "false", "no", "off", "0" };

    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(v, yes[i]) == 0) {
            *out = true;
            return 0;
        }
        if (strcasecmp(v, no[i]) == 0) {
            *out = false;
            return 0;
        }
    }
    return -EINVAL;
}

static int parse_uids(const char *v, rf_cfg_uids *out, const char *where, const char *name,
                      rf_err *err)
{
    char *copy = strdup(v), *save = NULL, *tok;
    rf_cfg_uids u = { 0, NULL };
    int rc = 0;

    if (copy == NULL)
        return rf_err_set(err, -ENOMEM, "%s: out of memory reading '%s'", where, name);
    for (tok = strtok_r(copy, ", \t", &save); tok; tok = strtok_r(NULL, ", \t", &save)) {
        uid_t *nv = realloc(u.v, (u.n + 1) * sizeof(uid_t));
        char *end;

        if (nv == NULL) {
            rc = rf_err_set(err, -ENOMEM, "%s: out of memory reading '%s'", where, name);
            goto out;
        }
        u.v = nv;
        if (isdigit((unsigned char)tok[0])) {
            unsigned long long id;

            errno = 0;
            id = strtoull(tok, &end, 10);
            if (errno != 0 || *end != '\0' || id >= (unsigned long long)(uid_t)-1) {
                rc = rf_err_set(err, -EINVAL, "%s: '%s' must list uids or user names, got '%s'",
                                where, name, tok);
                goto out;
            }
            u.v[u.n++] = (uid_t)id;
        } else {
            struct passwd pw, *res = NULL;
            char buf[4096];

            if (getpwnam_r(tok, &pw, buf, sizeof(buf), &res) != 0 || res == NULL) {
                rc = rf_err_set(err, -EINVAL,
                                "%s: '%s' names user '%s', who does not exist on this host "
                                "(give a user name from /etc/passwd or a numeric uid)",
                                where, name, tok);
                goto out;
            }
            u.v[u.n++] = pw.pw_uid;
        }
    }
    free(out->v);
    *out = u;
    u.v = NULL;
out:
    free(u.v);
    free(copy);
    return rc;
}

static void list_names(const char *const *names, char *buf, size_t len, const char *sep)
{
    size_t off = 0;

    buf[0] = '\0';
    for (size_t i = 0; names[i] && off < len; i++) {
        int n = snprintf(buf + off, len - off, "%s%s", i ? sep : "", names[i]);

        if (n < 0)
            break;
        off += (size_t)n;
    }
}

/* A STRING value against its key's length bound and RF_CFG_WORD. The value itself is not
 * printed: it may hold the very bytes that are refused (a newline would split the message). */
static int check_string(const rf_cfg_key *k, const char *value, const char *where, rf_err *err)
{
    size_t len = strlen(value);

    if (k->max > 0 && len > (unsigned long long)k->max)
        return rf_err_set(err, -EINVAL, "%s: '%s' is %zu bytes long; the limit is %lld", where,
                          k->name, len, k->max);
    if (!(k->flags & RF_CFG_WORD))
        return 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)value[i];

        if (ch >= 0x21 && ch <= 0x7e)
            continue;
        return rf_err_set(err, -EINVAL, "%s: '%s' holds %s 0x%02x at byte %zu; it must be one "
                          "word of printable ASCII (no spaces or control characters)", where,
                          k->name, ch == ' ' ? "a space," : ch < 0x20 || ch == 0x7f ?
                          "the control character" : "the non-ASCII byte", ch, i);
    }
    return 0;
}

/* Parses one value of key k into obj; the messages name where and the key. */
static int set_value(const rf_cfg_key *k, void *obj, const char *value, const char *where,
                     rf_err *err)
{
    void *dst = field(obj, k);
    char unq[1024];
    size_t vl = strlen(value);
    char *end;

    /* A value may be quoted to make it explicit, as in status_listen = "" (disabled). */
    if (vl >= 2 && value[0] == '"' && value[vl - 1] == '"') {
        if (vl - 2 >= sizeof(unq))
            return rf_err_set(err, -EINVAL, "%s: value of '%s' is too long", where, k->name);
        memcpy(unq, value + 1, vl - 2);
        unq[vl - 2] = '\0';
        value = unq;
    }

    switch (k->type) {
    case RF_CFG_STRING:
    case RF_CFG_HOSTPORT: {
        char *copy;
        int rc;

        if (*value == '\0' && !(k->flags & RF_CFG_EMPTY_OK))
            return rf_err_set(err, -EINVAL, "%s: '%s' must not be empty", where, k->name);
        if (k->type == RF_CFG_STRING && (rc = check_string(k, value, where, err)) < 0)
            return rc;
        if (k->type == RF_CFG_HOSTPORT && *value != '\0') {
            rf_addr a;

            /* Syntax only, in the listener's grammar (the widest): whether this key is
             * listened on or connected to, and whether its host is this machine's, is the
             * program's check (rf_cfg_table.check). */
            if (rf_addr_parse(value, RF_ADDR_LISTEN, &a, err) < 0)
                return rf_err_wrap(err, "%s: '%s': ", where, k->name);
            if (a.port_num < k->min || a.port_num > k->max)
                return rf_err_set(err, -EINVAL,
                                  "%s: '%s' port must be between %lld and %lld, got %u", where,
                                  k->name, k->min, k->max, (unsigned)a.port_num);
        }
        copy = strdup(value);
        if (copy == NULL)
            return rf_err_set(err, -ENOMEM, "%s: out of memory reading '%s'", where, k->name);
        free(*(char **)dst);
        *(char **)dst = copy;
        return 0;
    }
    case RF_CFG_INT: {
        long long v;

        errno = 0;
        v = strtoll(value, &end, 10);
        if (*value == '\0' || isspace((unsigned char)*value) || *end != '\0')
            return rf_err_set(err, -EINVAL,
                              "%s: '%s' must be an integer between %lld and %lld, got '%s'",
                              where, k->name, k->min, k->max, value);
        if (errno == ERANGE || v < k->min || v > k->max)
            return rf_err_set(err, -EINVAL, "%s: '%s' must be between %lld and %lld, got %s",
                              where, k->name, k->min, k->max, value);
        *(int *)dst = (int)v;
        return 0;
    }
    case RF_CFG_DOUBLE: {
        double v;

        v = strtod(value, &end);
        if (*value == '\0' || isspace((unsigned char)*value) || *end != '\0' || !isfinite(v))
            return rf_err_set(err, -EINVAL,
                              "%s: '%s' must be a number between %g and %g, got '%s'", where,
                              k->name, k->dmin, k->dmax, value);
        if (v < k->dmin || v > k->dmax)
            return rf_err_set(err, -EINVAL, "%s: '%s' must be between %g and %g, got %s",
                              where, k->name, k->dmin, k->dmax, value);
        *(double *)dst = v;
        return 0;
    }
    case RF_CFG_BOOL:
        if (parse_bool(value, (bool *)dst) != 0)
            return rf_err_set(err, -EINVAL,
                              "%s: '%s' must be true or false (yes/no, on/off, 1/0), got '%s'",
                              where, k->name, value);
        return 0;
    case RF_CFG_ENUM: {
        char names[256];

        for (int i = 0; k->names[i]; i++) {
            if (strcasecmp(value, k->names[i]) == 0) {
                *(int *)dst = i;
                return 0;
            }
        }
        list_names(k->names, names, sizeof(names), ", ");
        return rf_err_set(err, -EINVAL, "%s: '%s' must be one of %s; got '%s'", where, k->name,
                          names, value);
    }
    case RF_CFG_UIDS:
        return parse_uids(value, (rf_cfg_uids *)dst, where, k->name, err);
    }
    return rf_err_set(err, -EINVAL, "%s: '%s' has an unknown type", where, k->name);
}

int rf_cfg_set(const rf_cfg_table *t, void *obj, const char *name, const char *value,
               const char *where, rf_err *err)
{
    const rf_cfg_key *k = find_key(t, name);

    if (k == NULL) {
        const char *s = suggest(t, name);

        if (s != NULL)
            return rf_err_set(err, -ENOENT, "%s: unknown key '%s' (did you mean '%s'?)", where,
                              name, s);
        return rf_err_set(err, -ENOENT, "%s: unknown key '%s' (%s --help lists the keys)",
                          where, name, t->program);
    }
    return set_value(k, obj, value, where, err);
}

void rf_cfg_free(const rf_cfg_table *t, void *obj)
{
    for (size_t i = 0; i < t->nkeys; i++) {
        const rf_cfg_key *k = &t->keys[i];
        void *dst = field(obj, k);

        if (k->type == RF_CFG_STRING || k->type == RF_CFG_HOSTPORT) {
            free(*(char **)dst);
            *(char **)dst = NULL;
        } else if (k->type == RF_CFG_UIDS) {
            rf_cfg_uids *u = dst;

            free(u->v);
            u->v = NULL;
            u->n = 0;
        }
    }
}

/* State of one file parse. inih does not pass line numbers to the handler in the
 * distribution build, so our reader counts them: the handler always runs on the line the
 * reader returned last. */
typedef struct file_ctx {
    const rf_cfg_table *t;
    void *obj;
    const char *path;
    FILE *f;
    int lineno;
    int *seen; /* per key: the line that set it, 0 if none */
    int rc;
    rf_err *err;
} file_ctx;

static char *file_reader(char *str, int num, void *stream)
{
    file_ctx *c = stream;
    size_t len, lead = 0;

    if (c->rc != 0 || fgets(str, num, c->f) == NULL)
        return NULL;
    c->lineno++;
    len = strlen(str);
    if (len > 0 && str[len - 1] != '\n' && !feof(c->f)) {
        c->rc = rf_err_set(c->err, -EINVAL, "%s:%d: line is longer than %d characters",
                           c->path, c->lineno, num - 3);
        return NULL;
    }
    /* Leading blanks would make inih treat the line as the continuation of the previous
     * value; we have no multi-line values, so an indented line is an ordinary line. */
    while (str[lead] == ' ' || str[lead] == '\t')
        lead++;
    if (lead)
        memmove(str, str + lead, len - lead + 1);
    return str;
}

static int file_handler(void *user, const char *section, const char *name, const char *value)
{
    file_ctx *c = user;
    char where[512];
    const rf_cfg_key *k;
    bool allowed = section[0] == '\0';

    if (c->rc != 0)
        return 0;
    for (size_t i = 0; !allowed && c->t->sections && c->t->sections[i]; i++)
        allowed = strcmp(section, c->t->sections[i]) == 0;
    if (!allowed) {
        char names[256] = "";

        if (c->t->sections)
            list_names(c->t->sections, names, sizeof(names), "], [");
        c->rc = rf_err_set(c->err, -EINVAL,
                           "%s:%d: section [%s] is not read by %s (its keys go in [%s])",
                           c->path, c->lineno, section, c->t->program, names);
        return 0;
    }
    snprintf(where, sizeof(where), "%s:%d", c->path, c->lineno);
    k = find_key(c->t, name);
    if (k != NULL && strcmp(k->name, name) != 0) {
        /* Files use the key names as written in the table, flags may use dashes. */
        c->rc = rf_err_set(c->err, -ENOENT, "%s: unknown key '%s' (did you mean '%s'?)", where,
                           name, k->name);
        return 0;
    }
    if (k != NULL && c->seen[k - c->t->keys] != 0) {
        c->rc = rf_err_set(c->err, -EINVAL, "%s: '%s' is already set on line %d", where, name,
                           c->seen[k - c->t->keys]);
        return 0;
    }
    c->rc = rf_cfg_set(c->t, c->obj, name, value, where, c->err);
    if (c->rc == 0)
        c->seen[k - c->t->keys] = c->lineno;
    return c->rc == 0;
}

/* 0, -ENOENT when the file does not exist, or another error with err filled. */
static int load_file(const rf_cfg_table *t, void *obj, const char *path, rf_err *err)
{
    file_ctx c = { .t = t, .obj = obj, .path = path, .err = err };
    int rc = 0, r;

    c.f = fopen(path, "re");
    if (c.f == NULL) {
        rc = -errno;
        rf_err_set(err, rc, "cannot open config file %s: %s", path, strerror(errno));
        goto out;
    }
    c.seen = calloc(t->nkeys ? t->nkeys : 1, sizeof(int));
    if (c.seen == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory reading %s", path);
        goto out;
    }
    r = ini_parse_stream(file_reader, &c, file_handler, &c);
    if (c.rc != 0) {
        rc = c.rc;
    } else if (ferror(c.f)) {
        rc = rf_err_set(err, -EIO, "cannot read config file %s", path);
    } else if (r == -2) {
        rc = rf_err_set(err, -ENOMEM, "out of memory reading %s", path);
    } else if (r > 0) {
        rc = rf_err_set(err, -EINVAL,
                        "%s:%d: cannot parse the line: expected 'key = value', '[section]' or "
                        "a comment starting with ';' or '#'",
                        path, r);
    }
out:
    free(c.seen);
    if (c.f)
        fclose(c.f);
    return rc;
}

bool rf_cfg_check_only(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--check-config") == 0)
            return true;
    return false;
}

static void print_wrapped(FILE *f, const char *text, int indent, int width)
{
    const char *p = text;

    while (*p) {
        int col = indent;
        const char *line_end = p, *q = p;

        /* Take words while they fit; a single overlong word goes on a line of its own. */
        while (*q) {
            const char *w = q;

            while (*w && *w != ' ' && *w != '\n')
                w++;
            if (line_end != p && col + (w - q) > width)
                break;
            col += (int)(w - q) + 1;
            line_end = w;
            q = w;
            if (*q == '\n')
                break;
            while (*q == ' ')
                q++;
        }
        fprintf(f, "%*s%.*s\n", indent, "", (int)(line_end - p), p);
        p = line_end;
        while (*p == ' ' || *p == '\n')
            p++;
    }
}

void rf_cfg_print_help(const rf_cfg_table *t, FILE *f)
{
    char sections[256] = "";

    if (t->sections)
        list_names(t->sections, sections, sizeof(sections), "], [");
    fprintf(f,
            "Usage: %s [--config PATH] [--check-config] [--KEY=VALUE]...\n\n"
            "  --config PATH     config file (default %s)\n"
            "                    keys are read from sections [%s]\n"
            "                    and from before the first section\n"
            "  --check-config    check the config file and flags and what start-up needs of\n"
            "                    the machine (files, paths, addresses), print the result,\n"
            "                    exit 0 if valid and 1 if not\n"
            "  --help            print this help\n"
            "  --version         print the version\n\n"
            "Keys: write \"key = value\" in the config file, or --key=value or --key value\n"
            "(dashes or underscores) on the command line, which overrides the file.\n\n",
            t->program, t->default_config, sections);
    for (size_t i = 0; i < t->nkeys; i++) {
        const rf_cfg_key *k = &t->keys[i];
        char type[256];

        switch (k->type) {
        case RF_CFG_STRING:
            if (k->max > 0)
                snprintf(type, sizeof(type), "%s of at most %lld bytes",
                         (k->flags & RF_CFG_WORD) ? "WORD" : "STRING", k->max);
            else
                snprintf(type, sizeof(type), "%s", (k->flags & RF_CFG_WORD) ? "WORD" : "STRING");
            break;
        case RF_CFG_INT:
            snprintf(type, sizeof(type), "INT %lld..%lld", k->min, k->max);
            break;
        case RF_CFG_DOUBLE:
            snprintf(type, sizeof(type), "NUMBER %g..%g", k->dmin, k->dmax);
            break;
        case RF_CFG_BOOL:
            snprintf(type, sizeof(type), "BOOL");
            break;
        case RF_CFG_ENUM:
            list_names(k->names, type, sizeof(type), "|");
            break;
        case RF_CFG_HOSTPORT:
            snprintf(type, sizeof(type), "HOST:PORT%s",
                     (k->flags & RF_CFG_EMPTY_OK) ? " or \"\"" : "");
            break;
        case RF_CFG_UIDS:
            snprintf(type, sizeof(type), "USER,...");
            break;
        }
        fprintf(f, "  %s = %s  (default: %s%s%s)\n", k->name, type,
                k->def[0] ? "" : "\"", k->def, k->def[0] ? "" : "\"");
        print_wrapped(f, k->help, 6, 78);
    }
}

typedef struct flag_set {
    const char *name; /* points into argv: "staging-mib" or "staging-mib=5" */
    size_t namelen;
    const char *value;
} flag_set;

int rf_cfg_load(const rf_cfg_table *t, void *obj, int argc, char **argv, rf_cfg_next *next,
                rf_err *err)
{
    flag_set *flags = NULL;
    size_t nflags = 0;
    const char *config = NULL;
    bool check = false, config_missing = false;
    int rc = 0;

    *next = RF_CFG_RUN;
    flags = calloc(argc > 0 ? (size_t)argc : 1, sizeof(*flags));
    if (flags == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory reading the command line");

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *eq;
        char name[128];
        const rf_cfg_key *k;

        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            rf_cfg_print_help(t, stdout);
            *next = RF_CFG_EXIT;
            goto out;
        }
        if (strcmp(a, "--version") == 0 || strcmp(a, "-V") == 0) {
            printf("%s %s\n", t->program, t->version);
            *next = RF_CFG_EXIT;
            goto out;
        }
        if (strcmp(a, "--check-config") == 0) {
            check = true;
            continue;
        }
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0') {
            rc = rf_err_set(err, -EINVAL, "unexpected argument '%s' (options are --key=value; "
                            "see %s --help)", a, t->program);
            goto out;
        }
        a += 2;
        eq = strchr(a, '=');
        if (strcmp(a, "config") == 0 || strncmp(a, "config=", 7) == 0) {
            if (eq == NULL && i + 1 >= argc) {
                rc = rf_err_set(err, -EINVAL, "option '--config' needs a path");
                goto out;
            }
            config = eq ? eq + 1 : argv[++i];
            continue;
        }
        snprintf(name, sizeof(name), "%.*s", (int)(eq ? (size_t)(eq - a) : strlen(a)), a);
        k = find_key(t, name);
        if (k == NULL) {
            const char *s = suggest(t, name);
            char dashed[128];

            if (s != NULL) {
                for (size_t j = 0; j <= strlen(s); j++)
                    dashed[j] = s[j] == '_' ? '-' : s[j];
                rc = rf_err_set(err, -ENOENT, "unknown option '--%s' (did you mean '--%s'?)",
                                name, dashed);
            } else {
                rc = rf_err_set(err, -ENOENT, "unknown option '--%s' (%s --help lists them)",
                                name, t->program);
            }
            goto out;
        }
        flags[nflags].name = a;
        flags[nflags].namelen = strlen(name);
        if (eq != NULL) {
            flags[nflags].value = eq + 1;
        } else if (k->type == RF_CFG_BOOL) {
            /* A bare boolean flag turns it on; --key=false turns it off. */
            flags[nflags].value = "true";
        } else if (i + 1 < argc) {
            flags[nflags].value = argv[++i];
        } else {
            rc = rf_err_set(err, -EINVAL, "option '--%s' needs a value", name);
            goto out;
        }
        nflags++;
    }

    for (size_t i = 0; i < t->nkeys; i++) {
        char where[160];

        snprintf(where, sizeof(where), "built-in default of %s", t->keys[i].name);
        rc = set_value(&t->keys[i], obj, t->keys[i].def, where, err);
        if (rc != 0)
            goto out;
    }

    if (config != NULL) {
        rc = load_file(t, obj, config, err);
    } else {
        config = t->default_config;
        rc = load_file(t, obj, config, err);
        /* Without --config, no file at the default place means: defaults and flags. */
        if (rc == -ENOENT) {
            config_missing = true;
            rc = 0;
            rf_err_clear(err);
        }
    }
    if (rc != 0)
        goto out;

    for (size_t i = 0; i < nflags; i++) {
        char where[160], name[128];

        snprintf(name, sizeof(name), "%.*s", (int)flags[i].namelen, flags[i].name);
        snprintf(where, sizeof(where), "--%s", name);
        rc = rf_cfg_set(t, obj, name, flags[i].value, where, err);
        if (rc != 0)
            goto out;
    }

    if (t->finish != NULL) {
        rc = t->finish(obj, err);
        if (rc != 0) {
            rf_err_wrap(err, "%s%s: ", config, config_missing ? " (not found) and flags" : "");
            goto out;
        }
    }
    if (check && t->check != NULL) {
        rc = t->check(obj, err);
        if (rc != 0)
            goto out;
    }
    if (check) {
        printf("%s: %s%s: configuration is valid\n", t->program, config,
               config_missing ? " (not found, defaults and flags)" : "");
        *next = RF_CFG_EXIT;
    }
out:
    free(flags);
    return rc;
}
