/* The DataParallel vs DistributedDataParallel comparison this project set out to reproduce
 * (PyTorch with apex AMP: ResNet-101, batch 128, 3 GPUs), on this machine.
 *
 * DP: one process, td_dp with one replica thread per device. DDP: one process per device
 * (fork), each with its own graph, a shm process group and td_ddp hung on the graph's
 * grad-ready hook. Same model, same global batch, same synthetic data, one oneDNN thread per
 * device, each device pinned to its own core. Prints cumulative wall time every 20 iterations
 * (as that comparison's table), samples/s, the DDP/DP ratio, where each method's time goes and the
 * peak memory of every DP replica and DDP rank; --repeat keeps the fastest of several alternating
 * runs. Every run happens in a child process so that the parent never starts an OpenMP
 * runtime before forking. It does not load Fashion-MNIST: data loading is not what is being
 * compared. That table also has DDP with apex AMP: --amp O1,O2,O3 (the default) adds
 * those rows, DDP with the graph at each level in bf16. --device cuda:N puts every DP replica
 * and every DDP rank on that GPU (one GPU shared, as this project's GPU machine has; DP's
 * gradients are then summed through the host, DDP's all-reduced over CUDA IPC). */
#include "tandem/dp.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/comm.h"
#include "tandem/ddp.h"
#include "tandem/graph.h"
#include "tandem/nn.h"
#include "tandem/optim.h"
#include "tandem/tensor.h"

#include "bench.h"

#define SAMPLE (28 * 28)
#define N_BATCHES 4   /* distinct synthetic batches, cycled */
#define MAX_POINTS 64 /* cumulative-time points (every 20 iterations) */
#define MAX_DEV 8

typedef struct {
    td_model_kind model;
    int iters, devices, json;
    int pin;    /* 1: each device (DP replica thread, DDP rank) pinned to its own core */
    int repeat; /* runs per method, alternating DP and DDP; the fastest of each is shown */
    int64_t batch;
    double lr, momentum;
    td_amp_level amp; /* the level DDP's graphs run at */
    int n_amp;        /* extra DDP rows, one per level in amps */
    td_amp_level amps[3];
    td_device device; /* --device: where every DP replica and DDP rank trains */
} options;

/* What one process sends back through its pipe. */
typedef struct {
    int ok;
    int n_points;
    double cum_s[MAX_POINTS]; /* wall seconds after 20, 40, ... iterations */
    double total_s;
    float last_loss;
    size_t mem[MAX_DEV]; /* DP: every replica; DDP: this rank in mem[0] */
    size_t mem_detail[MAX_DEV][6];
    double phase_s[TD_DP_PHASE_COUNT]; /* DP: td_dp_phase_seconds; DDP: the first 4 below */
} result;

/* DDP's parts of a step, in result.phase_s. */
enum { DDP_FORWARD = 0, DDP_BACKWARD, DDP_WAIT, DDP_OPTIMIZER, DDP_PARTS };
static const char *const ddp_part_names[DDP_PARTS] = {"forward", "backward", "allreduce wait",
                                                      "optimizer"};

static float *g_x;
static int64_t *g_y;

static void make_data(const options *o) {
    size_t B = (size_t)o->batch;
    g_x = malloc(N_BATCHES * B * SAMPLE * sizeof(float));
    g_y = malloc(N_BATCHES * B * sizeof(int64_t));
    if (!g_x || !g_y) {
        fprintf(stderr, "dp_vs_ddp: out of memory\n");
        exit(1);
    }
    td_rng rng;
    td_rng_init(&rng, 1234);
    for (size_t i = 0; i < N_BATCHES * B * SAMPLE; i++) g_x[i] = td_rng_normal(&rng);
    for (size_t i = 0; i < N_BATCHES * B; i++) g_y[i] = (int64_t)td_rng_below(&rng, 10);
}

static void record(result *r, int it, uint64_t t0) {
    if (it % 20 == 0 && r->n_points < MAX_POINTS)
        r->cum_s[r->n_points++] = (double)(td_time_ns() - t0) * 1e-9;
}

static size_t param_bytes(const td_param *p, size_t n) {
    size_t s = 0;
    for (size_t i = 0; i < n; i++) s += p[i].count * td_dtype_size(p[i].dtype);
    return s;
}

/* ---- DP: one process, one replica thread per device ------------------------------------ */

/* The DP run, in a process of its own: fills *out. */
static int run_dp(int rank, int world, void *out, void *arg) {
    (void)rank, (void)world;
    const options *o = arg;
    result r;
    memset(&r, 0, sizeof r);
    td_dp_params p = td_dp_default_params();
    p.n_devices = o->devices;
    p.global_batch = o->batch;
    p.model = o->model;
    p.pin_threads = o->pin;
    p.sgd.lr = o->lr;
    p.sgd.momentum = o->momentum;
    p.graph.device = o->device;
    td_dp *dp = NULL;
    CHECK(td_dp_create(&dp, &p));
    uint64_t t0 = td_time_ns();
    for (int it = 1; it <= o->iters; it++) {
        size_t k = (size_t)(it % N_BATCHES);
        CHECK(td_dp_step(dp, g_x + k * (size_t)o->batch * SAMPLE, g_y + k * (size_t)o->batch,
                         &r.last_loss));
        CHECK(td_loss_check(r.last_loss, it));
        record(&r, it, t0);
    }
    if (o->device.type != TD_DEVICE_CPU) CHECK(td_device_synchronize(o->device));
    r.total_s = (double)(td_time_ns() - t0) * 1e-9;
    for (int d = 0; d < o->devices; d++) {
        td_dp_memory m;
        CHECK(td_dp_memory_stats(dp, d, &m));
        r.mem[d] = m.total_bytes;
        size_t det[6] = {m.param_bytes,  m.graph_bytes,  m.input_bytes,
                         m.output_bytes, m.reduce_bytes, m.optimizer_bytes};
        memcpy(r.mem_detail[d], det, sizeof det);
    }
    td_dp_phase_seconds(dp, r.phase_s);
    td_dp_destroy(dp);
    r.ok = 1;
    memcpy(out, &r, sizeof r);
    return 0;
}

/* ---- DDP: one process per device -------------------------------------------------------- */

typedef struct {
    td_ddp *ddp;
    td_status status;
} hook_ctx;

static void on_grad_ready(size_t i, void *arg) {
    hook_ctx *h = arg;
    td_status s = td_ddp_grad_ready(h->ddp, i);
    if (s != TD_OK && h->status == TD_OK) h->status = s;
}

/* One DDP rank (bench_ranks pins it when asked): fills *out. */
static int run_ddp_rank(int rank, int world, void *out, void *arg) {
    const options *o = arg;
    (void)world;
    result r;
    memset(&r, 0, sizeof r);
    int64_t b = o->batch / o->devices;
    td_graph *g = NULL;
    td_model m;
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = o->amp;
    gp.device = o->device;
    CHECK(td_graph_create(&g, &gp));
    CHECK(td_model_build(g, o->model, b, 0, &m));
    td_param *params, *buffers;
    size_t n, nb;
    CHECK(td_graph_parameters(g, &params, &n));
    CHECK(td_graph_buffers(g, &buffers, &nb));

    td_comm *comm = bench_comm();

    td_ddp *ddp = NULL;
    CHECK(td_ddp_create(&ddp, comm, params, n, buffers, nb, NULL));
    hook_ctx h = {ddp, TD_OK};
    td_graph_set_grad_ready_hook(g, on_grad_ready, &h);
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = o->lr;
    sp.momentum = o->momentum;
    td_optim *opt = NULL;
    CHECK(td_optim_create_sgd(&opt, params, n, &sp));

    CHECK(td_comm_barrier(comm));
    uint64_t t0 = td_time_ns();
    for (int it = 1; it <= o->iters; it++) {
        size_t k = (size_t)(it % N_BATCHES);
        size_t first = k * (size_t)o->batch + (size_t)(rank * b);
        uint64_t t = td_time_ns(), u;
        CHECK(td_ddp_prepare_forward(ddp));
        CHECK(td_tensor_write(m.input, g_x + first * SAMPLE));
        CHECK(td_tensor_write(m.labels, g_y + first));
        CHECK(td_graph_zero_grad(g));
        CHECK(td_graph_forward(g));
        u = td_time_ns();
        r.phase_s[DDP_FORWARD] += (double)(u - t) * 1e-9;
        t = u;
        CHECK(td_graph_backward(g, m.loss));
        CHECK(h.status);
        u = td_time_ns();
        r.phase_s[DDP_BACKWARD] += (double)(u - t) * 1e-9;
        t = u;
        CHECK(td_ddp_finish_backward(ddp));
        u = td_time_ns();
        r.phase_s[DDP_WAIT] += (double)(u - t) * 1e-9;
        t = u;
        CHECK(td_optim_step(opt));
        CHECK(td_tensor_read(m.loss, &r.last_loss));
        CHECK(td_loss_check(r.last_loss, it));
        r.phase_s[DDP_OPTIMIZER] += (double)(td_time_ns() - t) * 1e-9;
        record(&r, it, t0);
    }
    r.total_s = (double)(td_time_ns() - t0) * 1e-9;
    for (size_t i = 0; i < n; i++)
        if (td_tensor_grad(td_graph_param_tensor(g, i)) != params[i].grad) {
            fprintf(stderr, "dp_vs_ddp: rank %d: gradient of '%s' no longer in DDP's bucket\n",
                    rank, params[i].name);
            _exit(1);
        }
    /* Parameters and buffers, the graph's arena (activations and gradients), DDP's buckets
     * (exactly the gradients), the optimizer's momentum and this rank's slice of the batch. */
    td_param *state;
    size_t n_state;
    td_optim_state(opt, &state, &n_state);
    size_t det[6] = {param_bytes(params, n) + param_bytes(buffers, nb),
                     td_graph_memory_bytes(g),
                     (size_t)b * (SAMPLE * sizeof(float) + sizeof(int64_t)),
                     0,
                     param_bytes(params, n),
                     param_bytes(state, n_state)};
    memcpy(r.mem_detail[0], det, sizeof det);
    for (int j = 0; j < 6; j++) r.mem[0] += det[j];
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_comm_destroy(comm);
    td_graph_destroy(g);
    r.ok = 1;
    memcpy(out, &r, sizeof r);
    return 0;
}

/* ---- driver ------------------------------------------------------------------------------ */

static int measure_dp(const options *o, result *r) {
    return bench_ranks(1, 0, run_dp, (void *)o, r, sizeof *r) == 0 && r->ok;
}

static int measure_ddp(const options *o, result *r) {
    result rr[MAX_DEV];
    memset(rr, 0, sizeof rr);
    if (bench_ranks(o->devices, o->pin, run_ddp_rank, (void *)o, rr, sizeof *rr) != 0) return 0;
    double loss_sum = 0;
    int ok = 1;
    for (int rank = 0; rank < o->devices; rank++) {
        ok &= rr[rank].ok;
        loss_sum += rr[rank].last_loss;
        r->mem[rank] = rr[rank].mem[0];
        memcpy(r->mem_detail[rank], rr[rank].mem_detail[0], sizeof rr[rank].mem_detail[0]);
    }
    size_t mem[MAX_DEV], detail[MAX_DEV][6];
    memcpy(mem, r->mem, sizeof mem);
    memcpy(detail, r->mem_detail, sizeof detail);
    *r = rr[0];
    memcpy(r->mem, mem, sizeof mem);
    memcpy(r->mem_detail, detail, sizeof detail);
    r->last_loss = (float)(loss_sum / o->devices); /* the global-batch mean, as DP reports */
    return ok;
}

static double mib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

static void print_row(const char *name, const result *r, const options *o) {
    printf("%-8s", name);
    for (int i = 0; i < r->n_points; i++) printf(" %8.2f", r->cum_s[i]);
    printf("   %9.1f\n", (double)o->batch * o->iters / r->total_s);
}

static void print_json(const char *method, const result *r, const options *o) {
    printf("{\"bench\":\"dp_vs_ddp\",\"model\":\"%s\",\"method\":\"%s\",\"devices\":%d,"
           "\"global_batch\":%lld,\"iters\":%d,\"repeat\":%d,\"cumulative_s\":[",
           td_model_name(o->model), method, o->devices, (long long)o->batch, o->iters, o->repeat);
    for (int i = 0; i < r->n_points; i++) printf("%s%.4f", i ? "," : "", r->cum_s[i]);
    printf("],\"samples_per_s\":%.2f,\"peak_bytes\":[", (double)o->batch * o->iters / r->total_s);
    for (int d = 0; d < o->devices; d++) printf("%s%zu", d ? "," : "", r->mem[d]);
    printf("],\"final_loss\":%.5f}\n", (double)r->last_loss);
}

static int run_model(const options *o) {
    result dp, ddp, amp[3];
    memset(&dp, 0, sizeof dp);
    memset(&ddp, 0, sizeof ddp);
    memset(amp, 0, sizeof amp);
    int dp_ok = 1, ddp_ok = 1, amp_ok[3] = {1, 1, 1};
    /* Alternating runs and keeping each method's fastest filters out the moments when
     * something else on the machine took a core, which hits one run, not the method. */
    for (int k = 0; k < o->repeat; k++) {
        result a, b;
        memset(&a, 0, sizeof a);
        memset(&b, 0, sizeof b);
        int a_ok = measure_dp(o, &a), b_ok = measure_ddp(o, &b);
        dp_ok &= a_ok;
        ddp_ok &= b_ok;
        if (a_ok && (k == 0 || a.total_s < dp.total_s)) dp = a;
        if (b_ok && (k == 0 || b.total_s < ddp.total_s)) ddp = b;
        for (int l = 0; l < o->n_amp; l++) {
            options at = *o;
            at.amp = o->amps[l];
            memset(&b, 0, sizeof b);
            b_ok = measure_ddp(&at, &b);
            amp_ok[l] &= b_ok;
            if (b_ok && (k == 0 || b.total_s < amp[l].total_s)) amp[l] = b;
        }
    }
    if (o->json) {
        if (dp_ok) print_json("dp", &dp, o);
        if (ddp_ok) print_json("ddp", &ddp, o);
        for (int l = 0; l < o->n_amp; l++) {
            char method[16];
            snprintf(method, sizeof method, "ddp+O%d", (int)o->amps[l]);
            if (amp_ok[l]) print_json(method, &amp[l], o);
        }
        if (dp_ok && ddp_ok)
            printf("{\"bench\":\"dp_vs_ddp\",\"model\":\"%s\",\"ddp_over_dp\":%.3f}\n",
                   td_model_name(o->model), dp.total_s / ddp.total_s);
        return dp_ok && ddp_ok && amp_ok[0] && amp_ok[1] && amp_ok[2];
    }
    char cpu[256];
    printf("\n%s\nmodel %s, global batch %lld, %d devices (1 core and 1 oneDNN thread each), %d "
           "iterations, "
           "fastest of %d run(s) per method\n",
           bench_cpu_name(cpu, sizeof cpu), td_model_name(o->model), (long long)o->batch,
           o->devices, o->iters, o->repeat);
    printf("cumulative wall seconds after iteration:\n%-8s", "");
    for (int i = 20; i <= o->iters && i / 20 <= MAX_POINTS; i += 20) printf(" %8d", i);
    printf("   samples/s\n");
    if (dp_ok)
        print_row("DP", &dp, o);
    else
        printf("DP       failed (see the error above)\n");
    if (ddp_ok)
        print_row("DDP", &ddp, o);
    else
        printf("DDP      unavailable or failed (see the error above)\n");
    for (int l = 0; l < o->n_amp; l++) {
        char name[16];
        snprintf(name, sizeof name, "DDP+O%d", (int)o->amps[l]);
        if (amp_ok[l])
            print_row(name, &amp[l], o);
        else
            printf("%-8s failed (see the error above)\n", name);
    }
    if (dp_ok && ddp_ok)
        printf("DDP/DP throughput: %.2fx   final loss DP %.4f, DDP %.4f\n",
               dp.total_s / ddp.total_s, (double)dp.last_loss, (double)ddp.last_loss);
    for (int l = 0; l < o->n_amp; l++)
        if (ddp_ok && amp_ok[l])
            printf("DDP+O%d/DDP throughput (bf16): %.2fx   final loss %.4f\n", (int)o->amps[l],
                   ddp.total_s / amp[l].total_s, (double)amp[l].last_loss);
    if (dp_ok) {
        double sum = 0;
        for (int i = 0; i < TD_DP_PHASE_COUNT; i++) sum += dp.phase_s[i];
        printf("DP time per step:");
        for (int i = 0; i < TD_DP_PHASE_COUNT; i++)
            printf(" %s %.1f%%", td_dp_phase_name((td_dp_phase)i), 100.0 * dp.phase_s[i] / sum);
        printf("\n");
    }
    if (ddp_ok) {
        double sum = 0;
        for (int i = 0; i < DDP_PARTS; i++) sum += ddp.phase_s[i];
        printf("DDP time per step (rank 0):");
        for (int i = 0; i < DDP_PARTS; i++)
            printf(" %s %.1f%%", ddp_part_names[i], 100.0 * ddp.phase_s[i] / sum);
        printf("\n");
    }
    static const char *parts[6] = {"params",  "graph",          "inputs",
                                   "outputs", "reduce/buckets", "optim"};
    for (int m = 0; m < 2; m++) {
        const result *r = m == 0 ? &dp : &ddp;
        if (!(m == 0 ? dp_ok : ddp_ok)) continue;
        for (int d = 0; d < o->devices; d++) {
            printf("peak memory %s %s %d: %7.2f MiB (", m == 0 ? "DP " : "DDP",
                   m == 0 ? "replica" : "rank   ", d, mib(r->mem[d]));
            for (int j = 0; j < 6; j++)
                printf("%s%s %.2f", j ? ", " : "", parts[j], mib(r->mem_detail[d][j]));
            printf(")\n");
        }
    }
    return dp_ok && ddp_ok && amp_ok[0] && amp_ok[1] && amp_ok[2];
}

int main(int argc, char **argv) {
    /* One oneDNN thread per device for both methods: two spinning OpenMP threads per pinned
     * core otherwise make everything ~30x slower. */
    bench_one_thread(argv);
    options o = {TD_MODEL_CNN,
                 100,
                 2,
                 0,
                 1,
                 1,
                 128,
                 0.01,
                 0.9,
                 TD_AMP_O0,
                 3,
                 {TD_AMP_O1, TD_AMP_O2, TD_AMP_O3},
                 td_device_cpu()};
    int model = -1, no_pin = 0;
    long batch = (long)o.batch;
    const char *device = NULL;
    td_args a;
    td_args_init(&a, "dp_vs_ddp", argc, argv);
    while (td_args_next(&a)) {
        td_args_int(&a, "--iters", 1, INT_MAX, &o.iters);
        td_args_choice(&a, "--model", "net|mlp|cnn|resnet", &model);
        td_args_int(&a, "--devices", 1, MAX_DEV, &o.devices);
        td_args_long(&a, "--batch", 1, LONG_MAX, &batch);
        td_args_flag(&a, "--json", &o.json);
        td_args_flag(&a, "--no-pin", &no_pin);
        td_args_int(&a, "--repeat", 1, INT_MAX, &o.repeat);
        if (td_args_string(&a, "--device", &device) && td_device_parse(device, &o.device) != TD_OK)
            td_args_bad_value(&a, device, "cpu or cuda:N");
        if (td_args_is(&a, "--amp")) { /* "O1,O3", or "none" */
            const char *v = td_args_value(&a);
            o.n_amp = 0;
            for (const char *l = v; v && strcmp(v, "none") && *l; l += l[2] == ',' ? 3 : 2) {
                if (l[0] != 'O' || l[1] < '1' || l[1] > '3' || (l[2] && l[2] != ',') ||
                    o.n_amp == 3) {
                    td_args_bad_value(&a, v, "levels O1..O3, comma-separated, or none");
                    break;
                }
                o.amps[o.n_amp++] = (td_amp_level)(l[1] - '0');
            }
        }
    }
    if (batch % o.devices)
        td_args_error(&a, "--batch %ld does not split over --devices %d", batch, o.devices);
    bench_args_finish(&a, "usage: dp_vs_ddp [--iters N (100)] [--model cnn|mlp|net (cnn and "
                          "mlp)] [--devices D (2)] [--batch B (128)] [--repeat R (1)] [--amp "
                          "O1,O2,O3|none] [--json] [--no-pin] [--device cpu|cuda:N]\n");
    int both = model < 0;
    if (model >= 0) o.model = (td_model_kind)model; /* the names in td_model_kind's order */
    o.batch = batch;
    if (no_pin) o.pin = 0;
    if (o.device.type != TD_DEVICE_CPU && bench_gpus("dp_vs_ddp") == 0) return 0;
    make_data(&o);
    int ok = run_model(&o);
    if (both) {
        o.model = TD_MODEL_MLP;
        ok &= run_model(&o);
    }
    free(g_x);
    free(g_y);
    return ok ? 0 : 1;
}
