/* td_args: a command line parsed option by option (tandem/args.h). Each td_args_X offers one
 * option to the current argument; the first whose name matches takes it and checks its value.
 * td_args_next moves on, and an argument that nothing took is the unknown option. */
#include "tandem/args.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core_impl.h"

void td_args_init(td_args *a, const char *program, int argc, char **argv) {
    memset(a, 0, sizeof *a);
    a->program = program;
    a->argc = argc;
    a->argv = argv;
    a->index = 0;
    a->taken = 1; /* argv[0] */
}

void td_args_error(td_args *a, const char *fmt, ...) {
    if (a->failed) return; /* the first error is the one to read */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->message, sizeof a->message, fmt, ap);
    va_end(ap);
    a->failed = 1;
}

static const char *current(const td_args *a) {
    return a->index < a->argc ? a->argv[a->index] : NULL;
}

static int is_option(const td_args *a, const char *arg) {
    return !a->positional_only && arg[0] == '-' && arg[1] != '\0';
}

/* An error when no option took the current argument; 1 when one did (or there is none). */
static int check_taken(td_args *a) {
    const char *arg = current(a);
    if (!arg || a->taken) return 1;
    if (is_option(a, arg)) {
        td_args_error(a, "unknown option %.*s", (int)strcspn(arg, "="), arg);
        a->show_usage = 1;
    } else {
        td_args_error(a, "unexpected argument '%s'", arg);
    }
    return 0;
}

int td_args_next(td_args *a) {
    if (a->failed || a->help || !check_taken(a)) return 0;
    a->index++;
    a->taken = 0;
    const char *arg = current(a);
    if (!arg) return 0;
    if (!a->positional_only && !strcmp(arg, "--")) {
        a->positional_only = 1;
        a->taken = 1;
        return td_args_next(a);
    }
    if (is_option(a, arg) && (!strcmp(arg, "-h") || !strcmp(arg, "--help"))) {
        a->help = 1;
        return 0;
    }
    return 1;
}

/* Whether the current argument, up to any '=', is option `name` ('-' and '_' alike). */
static int matches(const td_args *a, const char *name) {
    if (a->failed || a->taken) return 0;
    const char *arg = current(a);
    if (!arg || !is_option(a, arg)) return 0;
    size_t i = 0;
    for (; name[i] && arg[i] && arg[i] != '='; i++) {
        char x = arg[i] == '_' ? '-' : arg[i], y = name[i] == '_' ? '-' : name[i];
        if (x != y) return 0;
    }
    return !name[i] && (!arg[i] || arg[i] == '=');
}

/* The option's name as written, for messages: the argument up to '='. */
static int name_len(const td_args *a) { return (int)strcspn(current(a), "="); }

int td_args_is(td_args *a, const char *name) {
    if (!matches(a, name)) return 0;
    a->taken = 1;
    a->option = a->index;
    return 1;
}

const char *td_args_value(td_args *a) {
    const char *arg = current(a);
    if (!arg) return NULL;
    const char *eq = strchr(arg, '=');
    if (eq) return eq + 1;
    if (a->index + 1 >= a->argc) {
        td_args_error(a, "%.*s needs a value", name_len(a), arg);
        return NULL;
    }
    a->index++; /* the value is taken with its option */
    return a->argv[a->index];
}

int td_args_bad_value(td_args *a, const char *value, const char *takes) {
    const char *name = a->argv[a->option];
    td_args_error(a, "%.*s %s: expected %s", (int)strcspn(name, "="), name, value, takes);
    return 1;
}

int td_args_flag(td_args *a, const char *name, int *out) { return td_args_set(a, name, out, 1); }

int td_args_set(td_args *a, const char *name, int *out, int value) {
    if (!td_args_is(a, name)) return 0;
    if (strchr(current(a), '='))
        td_args_error(a, "%s takes no value", name);
    else
        *out = value;
    return 1;
}

int td_args_string(td_args *a, const char *name, const char **out) {
    if (!td_args_is(a, name)) return 0;
    const char *v = td_args_value(a);
    if (v) *out = v;
    return 1;
}

/* An integer in [min, max] and what to call the range in a message. */
static int parse_long(const char *v, long min, long max, long *out, char *takes, size_t cap) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!errno && end != v && !*end && x >= min && x <= max) {
        *out = x;
        return 1;
    }
    if (max == LONG_MAX || (max == INT_MAX && min > INT_MIN))
        snprintf(takes, cap, "an integer >= %ld", min);
    else
        snprintf(takes, cap, "an integer from %ld to %ld", min, max);
    return 0;
}

int td_args_long(td_args *a, const char *name, long min, long max, long *out) {
    if (!td_args_is(a, name)) return 0;
    const char *v = td_args_value(a);
    char takes[96];
    long x;
    if (v && parse_long(v, min, max, &x, takes, sizeof takes))
        *out = x;
    else if (v)
        td_args_bad_value(a, v, takes);
    return 1;
}

int td_args_int(td_args *a, const char *name, int min, int max, int *out) {
    long x = *out;
    int took = td_args_long(a, name, min, max, &x);
    if (took && !a->failed) *out = (int)x;
    return took;
}

int td_args_u64(td_args *a, const char *name, uint64_t *out) {
    if (!td_args_is(a, name)) return 0;
    const char *v = td_args_value(a);
    if (!v) return 1;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-' || v[0] == '+' || v[0] == ' ')
        td_args_bad_value(a, v, "an unsigned 64-bit integer");
    else
        *out = (uint64_t)x;
    return 1;
}

/* A finite number, or 0. */
static int parse_real(const char *v, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x) || (errno == ERANGE && x != 0)) return 0;
    *out = x;
    return 1;
}

int td_args_real(td_args *a, const char *name, double min, double max, double *out) {
    if (!td_args_is(a, name)) return 0;
    const char *v = td_args_value(a);
    double x;
    if (!v) return 1;
    if (parse_real(v, &x) && x >= min && x < max) {
        *out = x;
        return 1;
    }
    char takes[96];
    if (isinf(max))
        snprintf(takes, sizeof takes, "a number >= %g", min);
    else
        snprintf(takes, sizeof takes, "a number in [%g, %g)", min, max);
    return td_args_bad_value(a, v, takes);
}

int td_args_positive(td_args *a, const char *name, double max, double *out) {
    if (!td_args_is(a, name)) return 0;
    const char *v = td_args_value(a);
    double x;
    if (!v) return 1;
    if (parse_real(v, &x) && x > 0 && x < max) {
        *out = x;
        return 1;
    }
    char takes[96];
    if (isinf(max))
        snprintf(takes, sizeof takes, "a number > 0");
    else
        snprintf(takes, sizeof takes, "a number > 0 and < %g", max);
    return td_args_bad_value(a, v, takes);
}

int td_args_choice(td_args *a, const char *name, const char *choices, int *out) {
    if (!td_args_is(a, name)) return 0;
    const char *v = td_args_value(a);
    if (!v) return 1;
    size_t vlen = strlen(v);
    int k = 0;
    for (const char *c = choices; *c; k++) {
        size_t n = strcspn(c, "|");
        if (n == vlen && !strncmp(c, v, n)) {
            *out = k;
            return 1;
        }
        c += n + (c[n] == '|');
    }
    /* "a, b or c" from "a|b|c" */
    char takes[256];
    size_t at = 0;
    for (const char *c = choices; *c && at < sizeof takes;) {
        size_t n = strcspn(c, "|");
        const char *sep = at == 0 ? "" : c[n] ? ", " : " or ";
        at += (size_t)snprintf(takes + at, sizeof takes - at, "%s%.*s", sep, (int)n, c);
        c += n + (c[n] == '|');
    }
    return td_args_bad_value(a, v, takes);
}

int td_args_int_list(td_args *a, const char *name, int min, int max, int *out, int cap, int *n) {
    if (!td_args_is(a, name)) return 0;
    const char *v = td_args_value(a);
    if (!v) return 1;
    int count = 0, ok = *v != '\0';
    char takes[256];
    for (const char *p = v; ok && *p;) {
        char item[32];
        size_t len = strcspn(p, ",");
        long x = 0;
        ok = len > 0 && len < sizeof item && count < cap;
        if (ok) {
            memcpy(item, p, len);
            item[len] = '\0';
            ok = parse_long(item, min, max, &x, takes, sizeof takes);
        }
        if (ok) out[count++] = (int)x;
        p += len;
        if (*p == ',' && !*++p) ok = 0; /* a trailing comma */
    }
    if (ok) {
        *n = count;
        return 1;
    }
    char range[96];
    if (max == INT_MAX)
        snprintf(range, sizeof range, "each >= %d", min);
    else
        snprintf(range, sizeof range, "each from %d to %d", min, max);
    snprintf(takes, sizeof takes, "at most %d comma-separated integers, %s", cap, range);
    return td_args_bad_value(a, v, takes);
}

int td_args_positional(td_args *a, const char **out) {
    if (a->failed || a->taken) return 0;
    const char *arg = current(a);
    if (!arg || is_option(a, arg)) return 0;
    a->taken = 1;
    *out = arg;
    return 1;
}

int td_args_finish(td_args *a, const char *usage) {
    if (!a->failed && !a->help) check_taken(a); /* the loop may have ended before next() did */
    if (a->help) {
        fputs(usage, stdout);
        return 0;
    }
    if (!a->failed) return -1;
    fprintf(stderr, "%s: %s\n", a->program, a->message);
    if (a->show_usage)
        fputs(usage, stderr);
    else
        fprintf(stderr, "run '%s --help' for the options\n", a->program);
    return 2;
}
