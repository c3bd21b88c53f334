/* The torch.distributed backend (bindings/torch/, the module tandem_torch) through PyTorch's own
 * API in real processes: every collective against gloo's results at worlds 2 to 4
 * (tests/torch/collectives.py), PyTorch's DDP recipe (examples/torch/ddp_mnist.py) trained
 * with init_process_group("tandem") to gloo's parameters, a rank that dies or calls another
 * collective raised as an exception on every other rank (tests/torch/errors.py), and the
 * rendezvous port and Work.wait's timeout (tests/torch/edges.py). The ranks run
 * under tandemrun, as Debian's torchrun 1.13 does not start under Python 3.11.
 *
 * Where the module is built (make builds it when PyTorch's C++ headers and pybind11 are
 * installed: sh scripts/deps.sh torch), make check runs world 2 and the failures, about 25 s;
 * worlds 3 and 4 run under make check-long (TD_LONG=1) and make check-torch (TD_TORCH=1). Where
 * it is not built, and under the sanitizers (an unsanitized python3 would load it), each case
 * skips with one line saying why. */
#include <libgen.h>
#include <limits.h>

#include "test.h"
#include "test_program.h" /* run, field */

static char python_dir[PATH_MAX + 16], launcher[PATH_MAX + 16], dir[64];

#define PYTHON "/usr/bin/python3 -W ignore"

/* Why the module cannot be tested here, or NULL when BUILD/python holds it (and the
 * environment points Python there). */
static const char *not_built(void) {
#if defined(__SANITIZE_ADDRESS__)
    return "the torch backend is not built under SAN=1 (an unsanitized python3 loads it)";
#endif
    char cmd[PATH_MAX + 64];
    snprintf(cmd, sizeof cmd, "ls %s/tandem_torch*.so > /dev/null 2>&1", python_dir);
    if (python_dir[0] && system(cmd) == 0) return NULL;
    return "the torch backend is not built: no PyTorch C++ headers or pybind11 (sh "
           "scripts/deps.sh torch installs them, then make)";
}

/* TD_TORCH or TD_LONG set to 1: the larger worlds too. */
static int long_run(void) {
    const char *t = getenv("TD_TORCH"), *l = getenv("TD_LONG");
    return (t && !strcmp(t, "1")) || (l && !strcmp(l, "1"));
}

#define NEED_MODULE()                      \
    do {                                   \
        const char *why_not = not_built(); \
        if (why_not) {                     \
            SKIP("%s", why_not);           \
            return;                        \
        }                                  \
    } while (0)

#define NEED_LONG()                                                                       \
    do {                                                                                  \
        NEED_MODULE();                                                                    \
        if (!long_run()) {                                                                \
            SKIP("worlds 3 and 4 of the torch backend run under make check-long or make " \
                 "check-torch");                                                          \
            return;                                                                       \
        }                                                                                 \
    } while (0)

/* How many times `needle` occurs in the last run's output. */
static int occurrences(const char *needle) {
    int n = 0;
    for (const char *p = output; (p = strstr(p, needle)); p++) n++;
    return n;
}

static void collectives_world(int world) {
    CHECK_EQ(run("%s --nproc-per-node %d %s %s", launcher, world, PYTHON,
                 test_source_path("tests/torch/collectives.py")),
             0);
    /* every rank ran every case, and none failed */
    CHECK_EQ(occurrences(" passed, 0 failed"), world);
    CHECK_EQ(occurrences("FAIL"), 0);
    const char *at = strstr(output, "rank 0: ");
    CHECK(at && atoi(at + 8) > 200);
}

static void collectives_match_gloo_at_2(void) {
    NEED_MODULE();
    collectives_world(2);
}

static void collectives_match_gloo_at_3(void) {
    NEED_LONG();
    collectives_world(3);
}

static void collectives_match_gloo_at_4(void) {
    NEED_LONG();
    collectives_world(4);
}

/* The example trained 20 steps over gloo and over tandem at `world` ends on the same
 * parameters: the same bits at world 2 (one addition per element), within 1e-5 at 3 and 4 (the
 * ranks' gradients added in another order). */
static void ddp_matches_gloo(int world) {
    static const char *const backends[2] = {"gloo", "tandem"};
    for (int b = 0; b < 2; b++) {
        CHECK_EQ(run("%s --nproc-per-node %d %s %s --backend %s --max-steps 20 --save %s/%s.pt",
                     launcher, world, PYTHON, test_source_path("examples/torch/ddp_mnist.py"),
                     backends[b], dir, backends[b]),
                 0);
        char says[64];
        snprintf(says, sizeof says, "%s: 20 steps on %d ranks", backends[b], world);
        if (!strstr(output, says)) TEST_FAIL_AT("wanted \"%s\" in:\n%s", says, output);
    }
    CHECK_EQ(run("%s %s %s/gloo.pt %s/tandem.pt", PYTHON,
                 test_source_path("tests/torch/compare_params.py"), dir, dir),
             0);
    double diff = field("max difference ");
    if (!(diff >= 0 && diff <= (world == 2 ? 0 : 1e-5)))
        TEST_FAIL_AT("world %d: tandem's parameters are %g from gloo's: %s", world, diff, output);
}

static void ddp_example_trains_to_gloos_parameters(void) {
    NEED_MODULE();
    ddp_matches_gloo(2);
}

static void ddp_example_at_3_and_4(void) {
    NEED_LONG();
    ddp_matches_gloo(3);
    ddp_matches_gloo(4);
}

static void failures_raise_on_every_rank(void) {
    NEED_MODULE();
    CHECK_EQ(run("%s %s", PYTHON, test_source_path("tests/torch/errors.py")), 0);
    CHECK(strstr(output, "0 failed") != NULL);
    CHECK_EQ(occurrences("ok   "), 3);
}

/* tests/torch/edges.py: the port rank 0 publishes for tandem's store is listening when it is
 * published, and Work.wait(timeout) gives up at its timeout while a later wait() completes. */
static void rendezvous_port_is_held_and_wait_keeps_its_timeout(void) {
    NEED_MODULE();
    CHECK_EQ(run("%s --nproc-per-node 2 %s %s", launcher, PYTHON,
                 test_source_path("tests/torch/edges.py")),
             0);
    CHECK(strstr(output, "rank 0: 3 passed, 0 failed") && strstr(output, "rank 1: 1 passed"));
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (realpath(argv[0], self)) {
        char *tests = dirname(self); /* BUILD/tests */
        char build[PATH_MAX];
        snprintf(build, sizeof build, "%s", dirname(tests));
        snprintf(python_dir, sizeof python_dir, "%s/python", build);
        snprintf(launcher, sizeof launcher, "%s/bin/tandemrun", build);
    }
    setenv("PYTHONPATH", python_dir, 1);
    setenv("OMP_NUM_THREADS", "1", 1);
    snprintf(dir, sizeof dir, "/tmp/td_test_torch_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    RUN(collectives_match_gloo_at_2);
    RUN(collectives_match_gloo_at_3);
    RUN(collectives_match_gloo_at_4);
    RUN(ddp_example_trains_to_gloos_parameters);
    RUN(ddp_example_at_3_and_4);
    RUN(failures_raise_on_every_rank);
    RUN(rendezvous_port_is_held_and_wait_keeps_its_timeout);
    test_remove_dir(dir);
    TEST_END();
}
