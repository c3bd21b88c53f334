/* Training throughput of the GPT (tokens per second of forward, backward and AdamW) in tandem and
 * in PyTorch on the same model, batch and thread count, in f32 and bf16 (tandem O1 against
 * torch.autocast(bfloat16)), at worlds 1 and 2 (DDP; ranks forked and pinned, one OpenMP thread
 * each), plus the deterministic mode's cost against the default DDP. Random tokens: throughput
 * does not depend on the text. The PyTorch peer is bench/gpt_torch.py (nanoGPT's model).
 *
 *   build/bench/gpt [--layers N --heads N --width C --context T --batch GLOBAL --iters N]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/tandem.h"

#include "bench.h"

typedef struct {
    td_gpt_params model;
    int batch, iters, warmup, amp, deterministic;
} setup;

/* One rank: warm-up steps, then `iters` timed steps; rank 0 writes tokens/s. */
static int rank_fn(int rank, int world, void *result, void *arg) {
    const setup *su = arg;
    td_comm *comm = world > 1 || su->deterministic ? bench_comm() : NULL;
    int64_t T = su->model.context;
    int64_t local = su->deterministic ? su->batch / 4 : su->batch / world;
    td_graph_params gp = td_graph_default_params();
    if (su->amp) gp.amp.level = TD_AMP_O1;
    td_graph *g;
    td_model m;
    td_sequential *s;
    CHECK(td_graph_create(&g, &gp));
    CHECK(td_gpt_sequential(&su->model, &s));
    CHECK(td_model_build_sequential(g, s, local, 1, &m));
    td_param *params;
    size_t n;
    CHECK(td_graph_parameters(g, &params, &n));
    td_ddp *ddp = NULL;
    if (comm) {
        td_ddp_params dp = td_ddp_default_params();
        dp.deterministic = su->deterministic;
        dp.shards = 4;
        CHECK(td_ddp_create(&ddp, comm, params, n, NULL, 0, &dp));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    }
    td_adamw_params ap = td_adamw_default_params();
    td_optim *opt;
    CHECK(td_optim_create_adamw(&opt, params, n, &ap));
    float *x = td_tensor_data(m.input);
    int64_t *y = td_tensor_data(m.labels);
    td_rng r;
    td_rng_init(&r, (uint64_t)rank + 1);
    for (int64_t i = 0; i < local * T; i++) x[i] = (float)td_rng_below(&r, 256), y[i] = i % 256;
    size_t shards = 1;
    if (su->deterministic) {
        size_t first;
        td_ddp_shards(ddp, &first, &shards);
    }
    uint64_t t0 = 0;
    for (int it = 0; it < su->warmup + su->iters; it++) {
        if (it == su->warmup) {
            if (comm) CHECK(td_comm_barrier(comm));
            t0 = td_time_ns();
        }
        for (size_t j = 0; j < shards; j++) {
            if (ddp) CHECK(td_ddp_prepare_forward(ddp));
            CHECK(td_graph_forward(g));
            CHECK(td_graph_zero_grad(g));
            CHECK(td_graph_backward(g, m.loss));
            if (ddp) CHECK(td_ddp_finish_backward(ddp));
        }
        CHECK(td_optim_step(opt));
    }
    double s_elapsed = (double)(td_time_ns() - t0) / 1e9;
    if (rank == 0) *(double *)result = (double)su->batch * (double)T * su->iters / s_elapsed;
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_graph_destroy(g);
    td_sequential_destroy(s);
    td_comm_destroy(comm);
    return 0;
}

static double tandem_rate(const setup *su, int world) {
    double results[4] = {0};
    if (bench_ranks(world, 1, rank_fn, (void *)su, results, sizeof(double))) exit(1);
    return results[0];
}

static double torch_rate(const setup *su, int world) {
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/gpt_torch.py "
             "--layers %d --heads %d --width %lld --context %lld --batch %d --iters %d "
             "--warmup %d --world %d%s",
             su->model.layers, su->model.heads, (long long)su->model.width,
             (long long)su->model.context, su->batch, su->iters, su->warmup, world,
             su->amp ? " --bf16" : "");
    FILE *p = popen(cmd, "r");
    double rate = NAN;
    if (p) {
        char line[256];
        while (fgets(line, sizeof line, p))
            if (!strncmp(line, "tokens_per_s ", 13)) rate = atof(line + 13);
        pclose(p);
    }
    return rate;
}

int main(int argc, char **argv) {
    bench_one_thread(argv);
    setup su = {.model = td_gpt_default_params(), .batch = 16, .iters = 5, .warmup = 2};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--layers"))
            su.model.layers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--heads"))
            su.model.heads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--width"))
            su.model.width = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--context"))
            su.model.context = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch"))
            su.batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters"))
            su.iters = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: gpt [--layers N] [--heads N] [--width C] [--context T] "
                            "[--batch GLOBAL] [--iters N]\n");
            return 2;
        }
    }
    char cpu[256];
    printf("GPT %d layers, %d heads, width %lld, context %lld, global batch %d; one thread per "
           "rank; %s\n",
           su.model.layers, su.model.heads, (long long)su.model.width, (long long)su.model.context,
           su.batch, bench_cpu_name(cpu, sizeof cpu));
    printf("%-6s %5s %14s %14s %7s\n", "dtype", "world", "tandem tok/s", "torch tok/s", "ratio");
    for (int amp = 0; amp < 2; amp++)
        for (int world = 1; world <= 2; world++) {
            su.amp = amp;
            double a = tandem_rate(&su, world), b = torch_rate(&su, world);
            printf("%-6s %5d %14.0f %14.0f %6.2fx\n", amp ? "bf16" : "f32", world, a, b, a / b);
            fflush(stdout);
        }
    su.amp = 0;
    double plain = tandem_rate(&su, 2);
    su.deterministic = 1;
    double det = tandem_rate(&su, 2);
    printf("deterministic mode, f32, world 2, 4 shards: %.0f tok/s, %.2fx the default DDP's %.0f\n",
           det, det / plain, plain);
    return 0;
}
