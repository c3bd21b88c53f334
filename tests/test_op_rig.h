/* What the op tests share: random inputs, the tolerance check, fixture loading, and the "rig",
 * a one-op graph built through the public API whose leaves are recorded at build time and
 * written after compile, then run forward and backward_from an upstream gradient. Header-only;
 * a test includes it once, after nothing else of the harness. */
#ifndef TANDEM_TEST_OP_RIG_H
#define TANDEM_TEST_OP_RIG_H

#include <string.h>

#include "tandem/graph.h"

#include "fixture.h"
#include "test.h"

#define TOL 1e-4

static td_rng rng;

static float *randn(size_t n) {
    float *a = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) a[i] = td_rng_normal(&rng);
    return a;
}

static float *scratch(size_t n) { return calloc(n ? n : 1, sizeof(float)); }

static void check_close(const char *what, const float *got, const float *want, size_t n,
                        double tol) {
    int bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (!(d <= tol * (1.0 + fabs(want[i])))) {
            if (bad++ < 3)
                TEST_FAIL_AT("%s[%zu]: graph %.9g, expected %.9g", what, i, (double)got[i],
                             (double)want[i]);
        }
        if (d > worst) worst = d;
    }
    if (bad) TEST_FAIL_AT("%s: %d of %zu differ (worst %.3g)", what, bad, n, worst);
}

/* Loads a fixture or fails the case with the loader's message. */
static int load(fixture *f, const char *name) {
    td_status st = fixture_load(f, name);
    if (st != TD_OK) TEST_FAIL_AT("%s", td_last_error());
    return st == TD_OK;
}

/* ---- a one-op graph: leaves are recorded at build time and written after compile ------ */

#define RIG_MAX 16

typedef struct {
    td_graph *g;
    int n;
    td_tensor *t[RIG_MAX];
    const void *src[RIG_MAX];
    int ok; /* 0 after any failed call (already reported) */
} rig;

#define RIG_CALL(r, call)                                                                   \
    do {                                                                                    \
        td_status rig_s_ = (call);                                                          \
        if (rig_s_ != TD_OK) {                                                              \
            TEST_FAIL_AT("%s -> %s: %s", #call, td_status_string(rig_s_), td_last_error()); \
            (r)->ok = 0;                                                                    \
        }                                                                                   \
    } while (0)

static void rig_init(rig *r) {
    memset(r, 0, sizeof *r);
    r->ok = 1;
    RIG_CALL(r, td_graph_create(&r->g, NULL));
}

static void rig_free(rig *r) {
    if (r->g) td_graph_destroy(r->g);
    r->g = NULL;
}

/* Ends a one-op run: frees the graph and says whether every call succeeded. */
static int rig_done(rig *r) {
    int ok = r->ok;
    rig_free(r);
    return ok;
}

static void rig_keep(rig *r, td_tensor *t, const void *src) {
    if (r->n < RIG_MAX) {
        r->t[r->n] = t;
        r->src[r->n] = src;
        r->n++;
    }
}

/* kind 0: input with gradient, 1: parameter, 2: buffer, 3: input without gradient */
static td_tensor *rig_leaf(rig *r, int kind, const char *name, td_shape s, td_dtype dt,
                           const void *data) {
    td_tensor *t = NULL;
    if (!r->ok) return NULL;
    if (kind == 1)
        RIG_CALL(r, td_graph_param(r->g, name, s, &t));
    else if (kind == 2)
        RIG_CALL(r, td_graph_buffer(r->g, name, s, &t));
    else
        RIG_CALL(r, td_graph_input(r->g, name, s, dt, kind == 0, &t));
    if (t) rig_keep(r, t, data);
    return t;
}

/* Compiles, writes the leaves, runs forward, then backward from y with upstream dy. */
static int rig_run(rig *r, td_tensor *y, const float *dy) {
    if (!r->ok || !y) return 0;
    RIG_CALL(r, td_graph_compile(r->g));
    for (int i = 0; r->ok && i < r->n; i++) RIG_CALL(r, td_tensor_write(r->t[i], r->src[i]));
    if (r->ok) RIG_CALL(r, td_graph_forward(r->g));
    if (r->ok) RIG_CALL(r, td_graph_zero_grad(r->g));
    if (r->ok && dy) RIG_CALL(r, td_graph_backward_from(r->g, y, dy));
    return r->ok;
}

static void rig_read(rig *r, td_tensor *t, float *dst) {
    if (r->ok) RIG_CALL(r, td_tensor_read(t, dst));
}

static void rig_grad(rig *r, td_tensor *t, float *dst) {
    if (r->ok) RIG_CALL(r, td_tensor_read_grad(t, dst));
}

#endif
