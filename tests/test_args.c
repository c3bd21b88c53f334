/* td_args, the programs' option parser: every kind of value in both spellings (--name VALUE,
 * --name=VALUE, '_' for '-'), and each way a command line goes wrong named as the issue it is:
 * a bad number names the option, the value and what it wanted; a missing value, an unknown
 * option and a stray argument say so; -h and --help end the parse with exit status 0; "--"
 * makes the rest positional. Then every program of tools/, examples/ and bench/ through it:
 * --help prints the usage and exits 0, a bad number is named with exit status 2. */
#include <libgen.h>
#include <limits.h>
#include <math.h>

#include "tandem/args.h"

#include "test.h"
#include "test_program.h" /* run, output */

static char build[PATH_MAX];

/* The parse of a command line `line` (words split at spaces) by a program that knows the
 * options below; returns what td_args_finish returned, with stdout and stderr silenced. */
typedef struct {
    int flag, stages, list[8], nlist, choice;
    long steps;
    double lr, temperature;
    uint64_t seed;
    const char *data, *positional[4];
    int npositional;
    td_args a;
} parsed;

static int parse(const char *line, parsed *p) {
    static char buf[512];
    char *argv[32];
    int argc = 0;
    snprintf(buf, sizeof buf, "prog %s", line);
    for (char *save = NULL, *w = strtok_r(buf, " ", &save); w && argc < 31;
         w = strtok_r(NULL, " ", &save))
        argv[argc++] = w;
    argv[argc] = NULL;
    memset(p, 0, sizeof *p);
    p->steps = 2000;
    p->choice = -1;
    td_args_init(&p->a, "prog", argc, argv);
    while (td_args_next(&p->a)) {
        td_args_flag(&p->a, "--amp", &p->flag);
        td_args_long(&p->a, "--steps", 1, LONG_MAX, &p->steps);
        td_args_int(&p->a, "--stages", 1, 16, &p->stages);
        td_args_real(&p->a, "--lr", 0, INFINITY, &p->lr);
        td_args_positive(&p->a, "--temperature", INFINITY, &p->temperature);
        td_args_u64(&p->a, "--seed", &p->seed);
        td_args_string(&p->a, "--data", &p->data);
        td_args_choice(&p->a, "--pipeline", "naive|gpipe|1f1b", &p->choice);
        td_args_int_list(&p->a, "--worlds", 1, 64, p->list, 8, &p->nlist);
        if (p->npositional < 4 && td_args_positional(&p->a, &p->positional[p->npositional]))
            p->npositional++;
    }
    fflush(stdout);
    fflush(stderr);
    int out = dup(1), err = dup(2);
    FILE *null = fopen("/dev/null", "w");
    dup2(fileno(null), 1);
    dup2(fileno(null), 2);
    int rc = td_args_finish(&p->a, "usage: prog [options]\n");
    fflush(stdout);
    fflush(stderr);
    dup2(out, 1);
    dup2(err, 2);
    close(out);
    close(err);
    fclose(null);
    return rc;
}

/* `line` is refused with status 2 and the message `says`. */
static void expect_refused(const char *line, const char *says) {
    parsed p;
    int rc = parse(line, &p);
    if (rc != 2 || strcmp(p.a.message, says))
        TEST_FAIL_AT("'%s': status %d, message '%s'; wanted 2 and '%s'", line, rc, p.a.message,
                     says);
}

static void values_in_both_spellings(void) {
    parsed p;
    CHECK_EQ(parse("--amp --steps 10 --stages=3 --lr 3e-3 --temperature=0.5 --seed "
                   "18446744073709551615 --data /tmp/x --pipeline 1f1b --worlds 1,2,4 a b",
                   &p),
             -1);
    CHECK(p.flag == 1 && p.steps == 10 && p.stages == 3 && p.lr == 3e-3 && p.temperature == 0.5);
    CHECK(p.seed == UINT64_MAX && !strcmp(p.data, "/tmp/x") && p.choice == 2);
    CHECK(p.nlist == 3 && p.list[0] == 1 && p.list[1] == 2 && p.list[2] == 4);
    CHECK(p.npositional == 2 && !strcmp(p.positional[0], "a") && !strcmp(p.positional[1], "b"));
    /* torchrun's underscores; a negative-looking value is a value */
    CHECK_EQ(parse("--lr=0 --data -x", &p), -1);
    CHECK(p.lr == 0 && !strcmp(p.data, "-x"));
    CHECK_EQ(parse("--pipe_line gpipe", &p), 2); /* "_" is "-", not a wildcard */
    CHECK_EQ(parse("--pipeline gpipe", &p), -1);
    CHECK_EQ(p.choice, 1);
    /* "--" ends the options */
    CHECK_EQ(parse("--steps 5 -- --amp -x", &p), -1);
    CHECK(p.steps == 5 && p.flag == 0 && p.npositional == 2 && !strcmp(p.positional[0], "--amp"));
}

static void bad_numbers_name_the_option_and_what_it_wanted(void) {
    expect_refused("--steps 10x", "--steps 10x: expected an integer >= 1");
    expect_refused("--steps 3.5", "--steps 3.5: expected an integer >= 1");
    expect_refused("--steps -2", "--steps -2: expected an integer >= 1");
    expect_refused("--steps=", "--steps : expected an integer >= 1");
    expect_refused("--steps 99999999999999999999", "--steps 99999999999999999999: expected an "
                                                   "integer >= 1");
    expect_refused("--stages 0", "--stages 0: expected an integer from 1 to 16");
    expect_refused("--stages=17", "--stages 17: expected an integer from 1 to 16");
    expect_refused("--lr inf", "--lr inf: expected a number >= 0");
    expect_refused("--lr nan", "--lr nan: expected a number >= 0");
    expect_refused("--lr 1e400", "--lr 1e400: expected a number >= 0");
    expect_refused("--lr -1", "--lr -1: expected a number >= 0");
    expect_refused("--lr 0.1.2", "--lr 0.1.2: expected a number >= 0");
    expect_refused("--temperature 0", "--temperature 0: expected a number > 0");
    expect_refused("--seed -1", "--seed -1: expected an unsigned 64-bit integer");
    expect_refused("--pipeline 2f2b", "--pipeline 2f2b: expected naive, gpipe or 1f1b");
    expect_refused("--worlds 1,,2", "--worlds 1,,2: expected at most 8 comma-separated integers, "
                                    "each from 1 to 64");
    expect_refused("--worlds 1,2,", "--worlds 1,2,: expected at most 8 comma-separated "
                                    "integers, each from 1 to 64");
    expect_refused("--worlds 0", "--worlds 0: expected at most 8 comma-separated integers, each "
                                 "from 1 to 64");
    /* the first error is the one reported */
    expect_refused("--steps x --stages 0", "--steps x: expected an integer >= 1");
}

static void missing_unknown_and_stray_arguments(void) {
    expect_refused("--steps", "--steps needs a value");
    expect_refused("--amp=1", "--amp takes no value");
    expect_refused("--epoch 2", "unknown option --epoch");
    expect_refused("--steps=3 --bogus=4", "unknown option --bogus");
    expect_refused("-x", "unknown option -x");
    parsed p;
    CHECK_EQ(parse("--epoch 2", &p), 2);
    CHECK(p.a.show_usage); /* the usage follows an unknown option */
    CHECK_EQ(parse("--steps x", &p), 2);
    CHECK(!p.a.show_usage); /* not a bad value */
}

static void help_exits_0(void) {
    parsed p;
    CHECK_EQ(parse("--help", &p), 0);
    CHECK_EQ(parse("--steps 3 -h", &p), 0);
    CHECK_EQ(parse("--steps 3 --help --bogus", &p), 0);
    CHECK_EQ(parse("-- --help", &p), -1); /* after "--" it is an argument */
}

/* A program's own check after the loop, and a value it reads itself. */
static void program_checks_go_through_the_same_door(void) {
    char *argv[] = {"prog", "--resume", "auto", "--size", "3x4", NULL};
    td_args a;
    td_args_init(&a, "prog", 5, argv);
    const char *resume = NULL;
    while (td_args_next(&a)) {
        td_args_string(&a, "--resume", &resume);
        if (td_args_is(&a, "--size")) {
            const char *v = td_args_value(&a);
            if (v && strcmp(v, "3x3")) td_args_bad_value(&a, v, "a square like 3x3");
        }
    }
    CHECK(a.failed && !strcmp(a.message, "--size 3x4: expected a square like 3x3"));
    td_args_init(&a, "prog", 3, argv);
    while (td_args_next(&a)) td_args_string(&a, "--resume", &resume);
    CHECK(!a.failed && !strcmp(resume, "auto"));
    td_args_error(&a, "--resume auto resumes from the --checkpoint file; give one");
    td_args_error(&a, "a second complaint is not the one to read");
    CHECK(a.failed && strstr(a.message, "give one"));
}

/* Each program, by its path under the build: --help, and one bad number. */
static void every_program_parses_the_same_way(void) {
    static const char *const programs[][3] = {
        {"bin/tandemrun", "--nproc-per-node 2 --timeout 1x true",
         "--timeout 1x: expected a number > 0"},
        {"bin/tandem-consolidate", "a b --drop", "--drop needs a value"},
        {"bin/tandem-doctor", "dir --trace", "--trace needs a value"},
        {"examples/mnist", "--epochs 2.5", "--epochs 2.5: expected an integer >= 1"},
        {"examples/mnist", "--pipeline gpipe --stages 1x",
         "--stages 1x: expected an integer from 1"},
        {"examples/gpt", "--steps 10x", "--steps 10x: expected an integer >= 1"},
        {"examples/contrastive", "--temperature 0", "--temperature 0: expected a number > 0"},
        {"bench/allreduce", "--repeat 100", "--repeat 100: expected an integer from 1 to 99"},
        {"bench/allreduce_gpu", "--worlds 1,9", "--worlds 1,9: expected at most 8"},
        {"bench/contrastive", "--seeds -1", "--seeds -1: expected an integer from 1"},
        {"bench/dp_vs_ddp", "--iters ten", "--iters ten: expected an integer >= 1"},
        {"bench/gpt", "--windows 0", "--windows 0: expected an integer from 1"},
        {"bench/multihost", "--steps 1.5", "--steps 1.5: expected an integer >= 1"},
        {"bench/pipeline", "--micro 1,x", "--micro 1,x: expected at most"},
        {"bench/syncbn", "--world 1", "--world 1: expected an integer from 2"},
        {"bench/train", "--threads 0", "--threads 0: expected an integer from 1 to 64"},
        {"bench/train_gpu", "--precisions f8", "--precisions f8: expected comma-separated"},
        {"bench/zero", "--width 8", "--width 8: expected an integer >= 16"},
    };
    for (size_t k = 0; k < sizeof programs / sizeof *programs; k++) {
        const char *prog = programs[k][0];
        CHECK_EQ(run("%s/%s --help", build, prog), 0);
        if (strncmp(output, "usage: ", 7))
            TEST_FAIL_AT("%s --help: no usage first:\n%s", prog, output);
        int rc = run("%s/%s %s", build, prog, programs[k][1]);
        if (rc != 2 || !strstr(output, programs[k][2]))
            TEST_FAIL_AT("%s %s: exit %d (wanted 2), wanted \"%s\" in:\n%s", prog, programs[k][1],
                         rc, programs[k][2], output);
    }
    /* every program of the build is in the table */
    char listing[PATH_MAX + 128];
    snprintf(listing, sizeof listing, "cd %s && ls bin/* examples/* bench/*", build);
    CHECK_EQ(run("%s", listing), 0);
    static char names[sizeof output];
    memcpy(names, output, sizeof names);
    for (char *save = NULL, *n = strtok_r(names, "\n", &save); n; n = strtok_r(NULL, "\n", &save)) {
        int listed = 0;
        for (size_t k = 0; k < sizeof programs / sizeof *programs; k++)
            listed |= !strcmp(n, programs[k][0]);
        if (!listed) TEST_FAIL_AT("%s is not in the table of programs", n);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (!realpath(argv[0], self)) return 1;
    snprintf(build, sizeof build, "%s", dirname(dirname(self))); /* BUILD/tests/x -> BUILD */
    RUN(values_in_both_spellings);
    RUN(bad_numbers_name_the_option_and_what_it_wanted);
    RUN(missing_unknown_and_stray_arguments);
    RUN(help_exits_0);
    RUN(program_checks_go_through_the_same_door);
    RUN(every_program_parses_the_same_way);
    TEST_END();
}
