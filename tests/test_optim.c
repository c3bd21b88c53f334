/* Optimizers, LR schedules and gradient clipping against values PyTorch computed
 * (tests/fixtures/optim/make_optim_ref.py), bit-exact resume through a checkpoint, and bf16 /
 * f16 parameters with master weights (O2) and without (O3) against f32 parameters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/checkpoint.h"
#include "tandem/optim.h"

#include "test.h"

#define FIXTURE "tests/fixtures/optim/optim_ref.safetensors"
#define T 6
#define NP 3

static td_checkpoint *ref;

static const char *pnames[NP] = {"w1", "b1", "w2"};
static const int64_t pshapes[NP][2] = {{4, 3}, {3, 0}, {5, 0}};
static const int pndim[NP] = {2, 1, 1};

/* A fixture tensor as a fresh malloc'd buffer (NULL and a failed check when absent). */
static void *fetch(const char *name, td_dtype dtype, size_t *count) {
    for (size_t i = 0; ref && i < td_checkpoint_count(ref); i++) {
        td_param info;
        CHECK_OK(td_checkpoint_tensor(ref, i, &info));
        if (strcmp(info.name, name) != 0) continue;
        CHECK_EQ(info.dtype, dtype);
        info.data = malloc(info.count * td_dtype_size(dtype) + 1);
        CHECK_OK(td_checkpoint_read(ref, &info, 1));
        if (count) *count = info.count;
        return info.data;
    }
    TEST_FAIL_AT("fixture has no tensor %s", name);
    return NULL;
}

typedef struct {
    td_param p[NP];
    float *data[NP];
    float *grad[T][NP]; /* fixture gradients of each step */
    int32_t *mask;      /* (T, NP) */
} problem;

static int problem_init(problem *pr) {
    memset(pr, 0, sizeof *pr);
    char name[64];
    int ok = 1;
    for (int i = 0; i < NP; i++) {
        snprintf(name, sizeof name, "init.%s", pnames[i]);
        size_t count = 0;
        pr->data[i] = fetch(name, TD_F32, &count);
        ok &= pr->data[i] != NULL;
        pr->p[i].name = pnames[i];
        pr->p[i].data = pr->data[i];
        pr->p[i].count = count;
        pr->p[i].dtype = TD_F32;
        pr->p[i].ndim = pndim[i];
        for (int d = 0; d < pndim[i]; d++) pr->p[i].shape[d] = pshapes[i][d];
        for (int t = 0; t < T; t++) {
            snprintf(name, sizeof name, "grad.%d.%s", t, pnames[i]);
            pr->grad[t][i] = fetch(name, TD_F32, NULL);
            ok &= pr->grad[t][i] != NULL;
        }
    }
    pr->mask = fetch("mask", TD_I32, NULL);
    return ok && pr->mask;
}

static void problem_free(problem *pr) {
    for (int i = 0; i < NP; i++) {
        free(pr->data[i]);
        for (int t = 0; t < T; t++) free(pr->grad[t][i]);
    }
    free(pr->mask);
}

/* Points each parameter at step t's gradient, or NULL where PyTorch had p.grad None. */
static void set_grads(problem *pr, int t) {
    for (int i = 0; i < NP; i++) pr->p[i].grad = pr->mask[t * NP + i] ? pr->grad[t][i] : NULL;
}

static td_status make_optim(const char *config, td_param *p, size_t n, td_optim **o) {
    if (strncmp(config, "sgd", 3) == 0) {
        td_sgd_params hp = td_sgd_default_params();
        hp.lr = 0.1;
        if (!strcmp(config, "sgd_momentum")) {
            hp.momentum = 0.9;
            hp.dampening = 0.1;
            hp.weight_decay = 0.01;
        } else if (!strcmp(config, "sgd_nesterov")) {
            hp.lr = 0.05;
            hp.momentum = 0.9;
            hp.weight_decay = 1e-3;
            hp.nesterov = 1;
        }
        return td_optim_create_sgd(o, p, n, &hp);
    }
    td_adamw_params hp = td_adamw_default_params();
    if (!strcmp(config, "adamw")) {
        hp.lr = 1e-2;
        hp.beta2 = 0.99;
        hp.weight_decay = 0.1;
    }
    return td_optim_create_adamw(o, p, n, &hp);
}

static void optimizers_match_pytorch(void) {
    const char *configs[] = {"sgd_plain", "sgd_momentum", "sgd_nesterov", "adamw", "adamw_default"};
    for (size_t c = 0; c < sizeof configs / sizeof *configs; c++) {
        problem pr;
        if (!problem_init(&pr)) {
            problem_free(&pr);
            return;
        }
        char name[64];
        snprintf(name, sizeof name, "%s.lr", configs[c]);
        double *lr = fetch(name, TD_F64, NULL);
        td_optim *o = NULL;
        CHECK_OK(make_optim(configs[c], pr.p, NP, &o));
        for (int t = 0; o && lr && t < T; t++) {
            set_grads(&pr, t);
            td_optim_set_lr(o, lr[t]);
            CHECK_NEAR(td_optim_get_lr(o), lr[t], 0);
            CHECK_OK(td_optim_step(o));
        }
        double worst = 0;
        for (int i = 0; i < NP; i++) {
            snprintf(name, sizeof name, "%s.%s", configs[c], pnames[i]);
            float *want = fetch(name, TD_F32, NULL);
            for (size_t j = 0; want && j < pr.p[i].count; j++) {
                double diff = fabs((double)pr.data[i][j] - want[j]);
                if (diff > worst) worst = diff;
                CHECK_NEAR(pr.data[i][j], want[j], 1e-6 + 1e-6 * fabs(want[j]));
            }
            free(want);
        }
        printf("     %-14s max |tandem - torch| = %.3g\n", configs[c], worst);
        td_optim_destroy(o);
        free(lr);
        problem_free(&pr);
    }
}

static void optimizer_state_lists_buffers_and_steps(void) {
    problem pr;
    if (!problem_init(&pr)) {
        problem_free(&pr);
        return;
    }
    td_optim *o = NULL;
    CHECK_OK(make_optim("adamw", pr.p, NP, &o));
    if (!o) goto done;
    td_param *st = NULL;
    size_t n = 0;
    td_optim_state(o, &st, &n);
    CHECK_EQ(n, 1 + 2 * NP);
    CHECK(strcmp(st[0].name, "optim.step") == 0);
    CHECK_EQ(st[0].dtype, TD_I64);
    CHECK(strcmp(st[1].name, "optim.w1.exp_avg") == 0);
    CHECK(strcmp(st[2].name, "optim.w1.exp_avg_sq") == 0);
    CHECK_EQ(st[1].ndim, 2);
    CHECK_EQ(st[1].shape[0], 4);
    CHECK_EQ(st[1].count, 12);
    for (int t = 0; t < T; t++) {
        set_grads(&pr, t);
        CHECK_OK(td_optim_step(o));
    }
    const int64_t *steps = st[0].data;
    for (int i = 0; i < NP; i++) { /* each parameter counts only the steps it had a gradient */
        int64_t want = 0;
        for (int t = 0; t < T; t++) want += pr.mask[t * NP + i] != 0;
        CHECK_EQ(steps[i], want);
    }
    td_optim_zero_grad(o);
    for (size_t j = 0; j < 5; j++) CHECK_EQ(pr.grad[T - 1][2][j], 0.0f);
    td_optim_destroy(o);
    /* SGD without momentum keeps only the step counts. */
    td_sgd_params sgd = td_sgd_default_params();
    CHECK_OK(td_optim_create_sgd(&o, pr.p, NP, &sgd));
    td_optim_state(o, &st, &n);
    CHECK_EQ(n, 1);
    td_optim_destroy(o);
    CHECK_OK(make_optim("sgd_momentum", pr.p, NP, &o));
    td_optim_state(o, &st, &n);
    CHECK_EQ(n, 1 + NP);
    if (n > 3) CHECK(strcmp(st[3].name, "optim.w2.momentum_buffer") == 0);
    td_optim_destroy(o);
done:
    problem_free(&pr);
}

/* Runs T steps straight, and 3 steps + checkpoint + fresh optimizer + load + 3 steps; the two
 * must agree bit for bit (parameters and optimizer state). */
static void resume_through_checkpoint_is_bit_exact(void) {
    const char *configs[] = {"sgd_momentum", "sgd_nesterov", "adamw"};
    char path[] = "/tmp/td_test_optim_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) return;
    close(fd);
    for (size_t c = 0; c < 3; c++) {
        problem a, b;
        if (!problem_init(&a) || !problem_init(&b)) {
            problem_free(&a);
            problem_free(&b);
            break;
        }
        td_optim *oa = NULL, *ob = NULL;
        CHECK_OK(make_optim(configs[c], a.p, NP, &oa));
        CHECK_OK(make_optim(configs[c], b.p, NP, &ob));
        if (!oa || !ob) {
            td_optim_destroy(oa);
            td_optim_destroy(ob);
            problem_free(&a);
            problem_free(&b);
            continue;
        }
        for (int t = 0; t < T; t++) {
            set_grads(&a, t);
            CHECK_OK(td_optim_step(oa));
        }
        for (int t = 0; t < 3; t++) {
            set_grads(&b, t);
            CHECK_OK(td_optim_step(ob));
        }
        td_param *st = NULL;
        size_t ns = 0;
        td_optim_state(ob, &st, &ns);
        td_param all[NP + 1 + 2 * NP];
        memcpy(all, b.p, sizeof b.p);
        memcpy(all + NP, st, ns * sizeof *st);
        td_checkpoint_meta meta[1] = {{"step", "3"}};
        CHECK_OK(td_checkpoint_save(path, all, NP + ns, meta, 1));
        td_optim_destroy(ob);
        /* A fresh run: parameters scrambled, new optimizer, then everything loaded back. */
        for (int i = 0; i < NP; i++) memset(b.data[i], 0x7f, b.p[i].count * sizeof(float));
        CHECK_OK(make_optim(configs[c], b.p, NP, &ob));
        td_optim_state(ob, &st, &ns);
        memcpy(all, b.p, sizeof b.p);
        memcpy(all + NP, st, ns * sizeof *st);
        CHECK_OK(td_checkpoint_load(path, all, NP + ns));
        for (int t = 3; t < T; t++) {
            set_grads(&b, t);
            CHECK_OK(td_optim_step(ob));
        }
        for (int i = 0; i < NP; i++)
            CHECK(memcmp(a.data[i], b.data[i], a.p[i].count * sizeof(float)) == 0);
        td_param *sa = NULL;
        size_t na = 0;
        td_optim_state(oa, &sa, &na);
        td_optim_state(ob, &st, &ns);
        CHECK_EQ(na, ns);
        for (size_t k = 0; k < na && k < ns; k++)
            CHECK(memcmp(sa[k].data, st[k].data, sa[k].count * td_dtype_size(sa[k].dtype)) == 0);
        td_optim_destroy(oa);
        td_optim_destroy(ob);
        problem_free(&a);
        problem_free(&b);
    }
    unlink(path);
}

static void check_schedule(const char *name, const td_lr_schedule_params *s, double tol) {
    size_t n = 0;
    double *want = fetch(name, TD_F64, &n);
    for (size_t t = 0; want && t < n; t++) {
        double got = td_lr_schedule_at(s, (int64_t)t);
        if (!(fabs(got - want[t]) <= tol))
            TEST_FAIL_AT("%s at step %zu: %.12g vs torch %.12g", name, t, got, want[t]);
    }
    free(want);
}

static void schedules_match_pytorch(void) {
    td_lr_schedule_params s = td_lr_schedule_default_params();
    s.base_lr = 0.1;
    s.kind = TD_LR_STEP;
    s.step_size = 3;
    s.gamma = 0.5;
    check_schedule("sched.step", &s, 1e-12);
    s = td_lr_schedule_default_params();
    s.base_lr = 0.1;
    s.kind = TD_LR_COSINE;
    s.t_max = 10;
    s.eta_min = 0.001;
    check_schedule("sched.cosine", &s, 1e-12);
    s = td_lr_schedule_default_params();
    s.base_lr = 0.1;
    s.warmup_steps = 4;
    s.warmup_start_factor = 0.25;
    check_schedule("sched.linear", &s, 1e-12);
    s = td_lr_schedule_default_params();
    s.base_lr = 0.1;
    s.kind = TD_LR_COSINE;
    s.t_max = 10;
    s.warmup_steps = 5;
    s.warmup_start_factor = 0.1;
    check_schedule("sched.warmup_cosine", &s, 1e-12);
    s = td_lr_schedule_default_params();
    s.base_lr = 0.2;
    s.kind = TD_LR_STEP;
    s.step_size = 4;
    s.gamma = 0.1;
    s.warmup_steps = 3;
    s.warmup_start_factor = 0.5;
    check_schedule("sched.warmup_step", &s, 1e-12);
    CHECK_NEAR(td_lr_step(1.0, 2, 0.5, 5), 0.25, 0);
    CHECK_NEAR(td_lr_cosine(1.0, 0.0, 4, 4), 0.0, 1e-15);
    CHECK_NEAR(td_lr_linear_factor(0.5, 1.0, 10, 5), 0.75, 1e-15);
    CHECK_NEAR(td_lr_linear_factor(0.5, 1.0, 10, 50), 1.0, 0);
}

static void clipping_matches_pytorch(void) {
    const char *cases[] = {"clip", "noclip"};
    const double max_norm[] = {1.0, 100.0};
    char name[64];
    for (int c = 0; c < 2; c++) {
        float *g[2], *want[2];
        size_t cnt[2];
        for (int k = 0; k < 2; k++) {
            snprintf(name, sizeof name, "%s.g%d", cases[c], k);
            g[k] = fetch(name, TD_F32, &cnt[k]);
            snprintf(name, sizeof name, "%s.g%d_clipped", cases[c], k);
            want[k] = fetch(name, TD_F32, NULL);
        }
        snprintf(name, sizeof name, "%s.total", cases[c]);
        double *total = fetch(name, TD_F64, NULL);
        float dummy[12] = {0};
        td_param ps[3] = {
            {.name = "a",
             .data = dummy,
             .grad = g[0],
             .count = cnt[0],
             .dtype = TD_F32,
             .ndim = 1,
             .shape = {12}},
            {.name = "frozen",
             .data = dummy,
             .grad = NULL,
             .count = 12,
             .dtype = TD_F32,
             .ndim = 1,
             .shape = {12}},
            {.name = "b",
             .data = dummy,
             .grad = g[1],
             .count = cnt[1],
             .dtype = TD_F32,
             .ndim = 1,
             .shape = {5}},
        };
        double norm = -1;
        if (g[0] && g[1] && want[0] && want[1] && total) {
            CHECK_OK(td_clip_grad_norm(ps, 3, max_norm[c], &norm));
            CHECK_NEAR(norm, total[0], 1e-5 * total[0]);
            for (int k = 0; k < 2; k++)
                for (size_t j = 0; j < cnt[k]; j++)
                    CHECK_NEAR(g[k][j], want[k][j], 1e-6 + 1e-6 * fabs(want[k][j]));
            if (c == 0) CHECK(norm > 1.0);
        }
        for (int k = 0; k < 2; k++) {
            free(g[k]);
            free(want[k]);
        }
        free(total);
    }
    /* After clipping, the norm is max_norm (up to the 1e-6 guard). */
    float gr[4] = {3, 4, 0, 0};
    td_param p = {
        .name = "p", .data = gr, .grad = gr, .count = 4, .dtype = TD_F32, .ndim = 1, .shape = {4}};
    double norm = 0;
    CHECK_OK(td_clip_grad_norm(&p, 1, 0.5, &norm));
    CHECK_NEAR(norm, 5.0, 1e-12);
    CHECK_NEAR(sqrt(gr[0] * gr[0] + gr[1] * gr[1]), 0.5, 1e-6);
    CHECK_STATUS(td_clip_grad_norm(&p, 1, 0.0, NULL), TD_EINVAL);
}

/* ---- bf16 and f16 parameters -------------------------------------------------------- */

enum { LOW_N = 5000 }; /* more than two of the optimizer's blocks */

static uint16_t to_low(td_dtype dt, float x) {
    return dt == TD_BF16 ? td_f32_to_bf16(x) : td_f32_to_f16(x);
}

static float from_low(td_dtype dt, uint16_t h) {
    return dt == TD_BF16 ? td_bf16_to_f32(h) : td_f16_to_f32(h);
}

/* A reproducible value in [-1, 1). */
static float uniform(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / 8388608.0f - 1.0f;
}

/* Three steps of `config` on a parameter of dtype dt with master weights or without, and on the
 * same values in f32: with master weights the master is that f32 parameter and the values are
 * it rounded; without, the f32 parameter's values and state rounded to dt after each step are
 * the low parameter's, bit for bit. */
static void step_low_against_f32(const char *config, td_dtype dt, int master) {
    uint16_t *lw = malloc(LOW_N * 2), *lg = malloc(LOW_N * 2);
    float *w = malloc(LOW_N * 4), *g = malloc(LOW_N * 4);
    uint32_t rng = 7;
    for (size_t j = 0; j < LOW_N; j++) {
        lw[j] = to_low(dt, 0.5f * uniform(&rng));
        w[j] = from_low(dt, lw[j]);
    }
    td_param low = {.name = "w", .data = lw, .grad = lg, .count = LOW_N, .dtype = dt, .ndim = 1};
    td_param ref = {.name = "w", .data = w, .grad = g, .count = LOW_N, .dtype = TD_F32, .ndim = 1};
    low.shape[0] = ref.shape[0] = LOW_N;
    low.master_dtype = master ? TD_F32 : dt;
    td_optim *ol = NULL, *of = NULL;
    td_param *sl = NULL, *sf = NULL;
    size_t nl = 0, nf = 0;
    CHECK_OK(make_optim(config, &low, 1, &ol));
    CHECK_OK(make_optim(config, &ref, 1, &of));
    td_optim_state(ol, &sl, &nl);
    td_optim_state(of, &sf, &nf);
    CHECK_EQ(nl, nf + (size_t)master); /* "optim.w.master" last */
    for (size_t i = 1; i < nf && i < nl; i++) CHECK_EQ(sl[i].dtype, master ? TD_F32 : dt);
    int same = ol && of && nl == nf + (size_t)master;
    for (int t = 0; t < 3 && same; t++) {
        for (size_t j = 0; j < LOW_N; j++) {
            lg[j] = to_low(dt, uniform(&rng));
            g[j] = from_low(dt, lg[j]);
        }
        CHECK_OK(td_optim_step(ol));
        CHECK_OK(td_optim_step(of));
        for (size_t j = 0; j < LOW_N; j++) {
            if (master) {
                same &= ((float *)sl[nl - 1].data)[j] == w[j];
            } else { /* what storing in the low dtype does to the f32 run */
                w[j] = from_low(dt, to_low(dt, w[j]));
                for (size_t i = 1; i < nf; i++) {
                    float *v = (float *)sf[i].data + j;
                    *v = from_low(dt, to_low(dt, *v));
                    same &= ((uint16_t *)sl[i].data)[j] == to_low(dt, *v);
                }
            }
            same &= lw[j] == to_low(dt, w[j]);
        }
    }
    if (!same)
        TEST_FAIL_AT("%s, %s, %s master weights: not the f32 step rounded", config,
                     td_dtype_name(dt), master ? "with" : "without");
    td_optim_destroy(ol);
    td_optim_destroy(of);
    free(lw);
    free(lg);
    free(w);
    free(g);
}

static void low_precision_parameters_step_like_f32_rounded(void) {
    const char *configs[] = {"sgd_plain", "sgd_momentum", "sgd_nesterov", "adamw"};
    for (int c = 0; c < 4; c++)
        for (int master = 0; master < 2; master++) {
            step_low_against_f32(configs[c], TD_BF16, master);
            step_low_against_f32(configs[c], TD_F16, master);
        }
}

static void bad_options_are_errors_naming_the_problem(void) {
    float x[2] = {0}, g[2] = {0};
    double xd[2] = {0};
    td_param ps[2] = {
        {.name = "ok", .data = x, .grad = g, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}},
        {.name = "fc.weight",
         .data = xd,
         .grad = xd,
         .count = 2,
         .dtype = TD_F64,
         .ndim = 1,
         .shape = {2}},
    };
    td_optim *o = NULL;
    td_sgd_params sgd = td_sgd_default_params();
    CHECK_STATUS(td_optim_create_sgd(&o, ps, 2, &sgd), TD_EDTYPE);
    CHECK(strstr(td_last_error(), "fc.weight") != NULL);
    sgd.nesterov = 1;
    CHECK_STATUS(td_optim_create_sgd(&o, ps, 1, &sgd), TD_EINVAL);
    CHECK(strstr(td_last_error(), "nesterov") != NULL);
    td_adamw_params ad = td_adamw_default_params();
    ad.beta2 = 1.0;
    CHECK_STATUS(td_optim_create_adamw(&o, ps, 1, &ad), TD_EINVAL);
    CHECK(strstr(td_last_error(), "betas") != NULL);
    ps[1] = ps[0];
    ad = td_adamw_default_params();
    CHECK_STATUS(td_optim_create_adamw(&o, ps, 2, &ad), TD_EINVAL);
    CHECK(strstr(td_last_error(), "twice") != NULL);
    uint16_t h[2] = {0};
    td_param low = {.name = "fc.bias",
                    .data = h,
                    .grad = h,
                    .count = 2,
                    .dtype = TD_BF16,
                    .ndim = 1,
                    .shape = {2},
                    .master_dtype = TD_F16};
    CHECK_STATUS(td_optim_create_sgd(&o, &low, 1, &sgd), TD_EDTYPE);
    CHECK(strstr(td_last_error(), "fc.bias is bf16 with master_dtype f16") != NULL);
    CHECK(o == NULL);
}

int main(void) {
    td_status st = td_checkpoint_open(&ref, test_source_path(FIXTURE));
    if (st != TD_OK) fprintf(stderr, "cannot open the fixture: %s\n", td_last_error());
    RUN(optimizers_match_pytorch);
    RUN(optimizer_state_lists_buffers_and_steps);
    RUN(resume_through_checkpoint_is_bit_exact);
    RUN(schedules_match_pytorch);
    RUN(clipping_matches_pytorch);
    RUN(low_precision_parameters_step_like_f32_rounded);
    RUN(bad_options_are_errors_naming_the_problem);
    td_checkpoint_close(ref);
    TEST_END();
}
