/* Contrastive learning: F.normalize and SimCLR's NT-Xent loss (local keys, and keys that hold
 * other ranks' rows as an all-gather gives them) against PyTorch (tests/fixtures/ops), bad
 * input named, and examples/contrastive end to end: with global negatives and SyncBatchNorm,
 * 2 and 4 ranks under tandemrun train the weights one process trains on the same global batch
 * (<= 1e-5), which local negatives do not, and the linear probe reports. TD_LONG=1 (make
 * check-long) trains the example's five epochs and wants the probe on the trained encoder 2
 * points above the one on the random encoder. */
#include <limits.h>

#include "tandem/tandem.h"

#include "fixture.h"
#include "test.h"
#include "test_program.h" /* run, field, checkpoint_distance */

#define TOL 1e-5

static char example[PATH_MAX], launcher[PATH_MAX], dir[64];

static void check_close(const char *what, const float *got, const float *want, size_t n) {
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - want[i]) <= TOL * (1.0 + fabs(want[i]))) && bad++ < 3)
            TEST_FAIL_AT("%s[%zu]: graph %.9g, PyTorch %.9g", what, i, (double)got[i],
                         (double)want[i]);
}

static int load(fixture *f, const char *name) {
    td_status st = fixture_load(f, name);
    if (st != TD_OK) TEST_FAIL_AT("%s", td_last_error());
    return st == TD_OK;
}

/* An input of the fixture array's shape holding its values, taking a gradient. */
static td_tensor *input_from(td_graph *g, const char *name, const fixture_array *a) {
    td_tensor *t = NULL;
    CHECK_OK(td_graph_input(g, name, td_shape_make(a->ndim, a->shape), TD_F32, 1, &t));
    return t;
}

static void normalize_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "normalize")) return;
    const fixture_array *x = fixture_get(&f, "x");
    td_graph *g;
    td_tensor *tx, *ty;
    CHECK_OK(td_graph_create(&g, NULL));
    tx = input_from(g, "x", x);
    CHECK_OK(td_graph_normalize(g, tx, (float)fixture_attr(&f, "eps", 0), &ty));
    CHECK_OK(td_graph_compile(g));
    CHECK_OK(td_tensor_write(tx, x->data));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward_from(g, ty, fixture_f32(&f, "dy")));
    float y[64], dx[64];
    CHECK_OK(td_tensor_read(ty, y));
    CHECK_OK(td_tensor_read_grad(tx, dx));
    check_close("normalize y", y, fixture_f32(&f, "y"), x->count);
    check_close("normalize dx (rows 2 and 3 below eps)", dx, fixture_f32(&f, "dx"), x->count);
    td_graph_destroy(g);
    fixture_free(&f);
}

/* nt_xent_local: keys are z itself; nt_xent_global: keys a separate input holding z's rows at
 * `first`, as td_graph_all_gather's output holds them. */
static void nt_xent_case(const char *name) {
    fixture f;
    if (!load(&f, name)) return;
    const fixture_array *z = fixture_get(&f, "z"), *keys = fixture_get(&f, "keys");
    td_graph *g;
    td_tensor *tz, *tk, *loss;
    CHECK_OK(td_graph_create(&g, NULL));
    tz = input_from(g, "z", z);
    tk = keys ? input_from(g, "keys", keys) : tz;
    CHECK_OK(td_nn_nt_xent(g, "ntxent", tz, tk, (int64_t)fixture_attr(&f, "first", -1),
                           (float)fixture_attr(&f, "temperature", 0), &loss));
    CHECK_OK(td_graph_compile(g));
    CHECK_OK(td_tensor_write(tz, z->data));
    if (keys) CHECK_OK(td_tensor_write(tk, keys->data));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward(g, loss));
    float l, dz[64], dk[64];
    CHECK_OK(td_tensor_read(loss, &l));
    CHECK_OK(td_tensor_read_grad(tz, dz));
    check_close("nt_xent loss", &l, fixture_f32(&f, "loss"), 1);
    check_close("nt_xent dz", dz, fixture_f32(&f, "dz"), z->count);
    if (keys) {
        CHECK_OK(td_tensor_read_grad(tk, dk));
        check_close("nt_xent dkeys", dk, fixture_f32(&f, "dkeys"), keys->count);
    }
    td_graph_destroy(g);
    fixture_free(&f);
}

static void nt_xent_with_local_keys_matches_pytorch(void) { nt_xent_case("nt_xent_local"); }

static void nt_xent_with_gathered_keys_matches_pytorch(void) { nt_xent_case("nt_xent_global"); }

static void bad_input_is_named(void) {
    td_graph *g;
    td_tensor *z, *img, *labels, *y;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_graph_input(g, "z", td_shape_2d(4, 3), TD_F32, 1, &z));
    CHECK_OK(td_graph_input(g, "img", td_shape_4d(2, 1, 2, 2), TD_F32, 1, &img));
    CHECK_OK(td_graph_input(g, "labels", td_shape_1d(4), TD_I64, 0, &labels));
    CHECK_STATUS(td_nn_nt_xent(g, "ntxent", z, z, 1, 0.5f, &y), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "[1, 5) of 4") != NULL);
    CHECK_STATUS(td_nn_nt_xent(g, "ntxent", z, z, 0, 0.0f, &y), TD_EINVAL);
    CHECK(strstr(td_last_error(), "temperature") != NULL);
    CHECK_STATUS(td_graph_normalize(g, img, 1e-12f, &y), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "'img' must be f32 (N, D)") != NULL);
    CHECK_STATUS(td_graph_all_gather(g, labels, &y), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "'labels'") != NULL);
    CHECK_STATUS(td_graph_scale(g, z, INFINITY, &y), TD_EINVAL);
    td_graph_destroy(g);
}

/* Trains three steps on global batches of `batch` at world `world` (1: no launcher) and writes
 * DIR/NAME.st. The learning rate is a tenth of the example's: a ReLU input within rounding of
 * zero may take the other branch at another world size (batch statistics differ in the last
 * bit), and through the next batch norm such a flip moves the lower layers by ~lr * 2e-4; at
 * 0.01 that stays well below 1e-5, and a different gradient (local negatives) moves them 1e-4. */
static int train_steps(int world, int batch, const char *negatives, const char *name) {
    char prefix[PATH_MAX + 64] = "";
    if (world > 1) snprintf(prefix, sizeof prefix, "%s --nproc-per-node %d", launcher, world);
    return run("%s %s --negatives %s --epochs 1 --max-steps 3 --batch %d --lr 0.01 --probe-train 0 "
               "--checkpoint %s/%s.st",
               prefix, example, negatives, batch, dir, name);
}

/* The relative distance of two runs' weights and running statistics taken together; each
 * tensor's own is printed too. Batch norm biases start at zero and their gradients are sums
 * that nearly cancel, so one process's f32 batch norm leaves them ~1e-5 of their own small
 * norm off from SyncBatchNorm's f64 sums: the model as a whole is the measure. */
static double distance(const char *a, const char *b) {
    char pa[128], pb[128], name[64] = "";
    snprintf(pa, sizeof pa, "%s/%s.st", dir, a);
    snprintf(pb, sizeof pb, "%s/%s.st", dir, b);
    double worst, d = checkpoint_distance(pa, pb, &worst, name, sizeof name);
    printf("    %s vs %s: %.2e of the weights' norm (largest in one tensor: %.2e, %s)\n", b, a, d,
           worst, name);
    return d;
}

static void global_negatives_train_as_one_process_at_world_2_and_4(void) {
    for (int i = 0; i < 2; i++) {
        int world = i ? 4 : 2, batch = i ? 64 : 32;
        char one[16], many[16];
        snprintf(one, sizeof one, "one_%d", batch);
        snprintf(many, sizeof many, "world%d_%d", world, batch);
        CHECK_EQ(train_steps(1, batch, "global", one), 0);
        CHECK_EQ(train_steps(world, batch, "global", many), 0);
        CHECK(distance(one, many) <= 1e-5);
    }
    /* Local negatives are a different loss at world 2: the comparison can tell. */
    CHECK_EQ(train_steps(2, 32, "local", "local2"), 0);
    CHECK(distance("one_32", "local2") > 5e-5);
}

static void probe_reports_trained_and_random_encoders(void) {
    CHECK_EQ(run("%s --nproc-per-node 2 %s --epochs 1 --max-steps 5 --batch 64 --probe-train "
                 "1024 --probe-test 500 --probe-epochs 2",
                 launcher, example),
             0);
    double trained = field("probe_trained "), random = field("probe_random ");
    printf("    5 steps: probe %.4f trained, %.4f random\n", trained, random);
    CHECK(trained > 0.3 && trained <= 1);
    CHECK(random > 0.3 && random <= 1);
}

static void probe_beats_the_random_encoder_after_five_epochs(void) {
    if (!getenv("TD_LONG")) return;
    CHECK_EQ(run("%s --nproc-per-node 2 %s --epochs 5", launcher, example), 0);
    double trained = field("probe_trained "), random = field("probe_random ");
    printf("    5 epochs, 2 ranks: probe %.4f trained, %.4f random\n", trained, random);
    CHECK(trained >= random + 0.02);
}

int main(int argc, char **argv) {
    (void)argc;
    if (program_test_start(argv[0], "contrastive", "contrastive", example, launcher, dir, NULL))
        return 1;
    RUN(normalize_matches_pytorch);
    RUN(nt_xent_with_local_keys_matches_pytorch);
    RUN(nt_xent_with_gathered_keys_matches_pytorch);
    RUN(bad_input_is_named);
    RUN(global_negatives_train_as_one_process_at_world_2_and_4);
    RUN(probe_reports_trained_and_random_encoders);
    RUN(probe_beats_the_random_encoder_after_five_epochs);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) return 1;
    TEST_END();
}
