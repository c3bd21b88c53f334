/* Training throughput on one GPU, tandem vs PyTorch eager (and torch.compile), side by side in
 * one run.
 *
 * For each model and precision at batch 128: samples/s of forward + backward + optimizer step (SGD
 * with momentum) with the batch resident on the GPU, as the median of timed windows after warm-up,
 * each window ended by a device synchronisation. Models: PyTorch's MNIST example Net, the MLP, the
 * CNN and the small ResNet on Fashion-MNIST images, torchvision's ResNet-50 and ResNet-101 on
 * random 3 x 224 x 224 images, and the GPT (td_gpt_default_params: 4 blocks, width 128) on random
 * byte tokens, a sample being one sequence of 128 tokens. Precisions: f32 (TF32 off, PyTorch's
 * default for matmuls), tf32 (allow_tf32 on both sides), bf16 (apex O1 here, torch.autocast there).
 * tandem runs with its sweeps recorded as CUDA graphs (the default) and, as a second column,
 * launching every op (--no-graphs-column drops it), so the table shows what the recording buys.
 *
 * The PyTorch peer (bench/train_gpu_torch.py) runs every row in one process and prints one
 * JSON line per row; --compile adds torch.compile rows for the models it compiles quickly.
 * A last table measures the largest linear's matmul alone through PyTorch (cuBLASLt) beside
 * tandem's linear node, the ceiling for that shape.
 *
 *   build/bench/train_gpu [--models net,mlp,cnn,resnet,resnet50,resnet101,gpt]
 *                         [--precisions f32,tf32,bf16] [--iters 20] [--windows 5] [--batch 128]
 *                         [--no-torch] [--compile] [--no-graphs-column] [--json]
 *
 * Where no GPU is visible it says why and exits 0 without measuring. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/tandem.h"

#include "bench.h"

#define MAX_ROWS 64

typedef struct {
    int iters, windows, warmup;
    int64_t batch;
} timing;

typedef enum { P_F32, P_TF32, P_BF16, P_COUNT } precision;
static const char *const precision_names[P_COUNT] = {"f32", "tf32", "bf16"};

/* One step of a measured graph: forward, backward (from the loss, or from dy), and the
 * optimizer's step when there is one. */
typedef struct {
    td_graph *g;
    td_tensor *from;
    const float *dy; /* NULL: backward from the scalar loss `from` */
    td_optim *opt;
} stepper;

static td_status step(const stepper *s) {
    td_status st = td_graph_forward(s->g);
    if (st == TD_OK)
        st = s->dy ? td_graph_backward_from(s->g, s->from, s->dy) : td_graph_backward(s->g, s->from);
    if (st == TD_OK && s->opt) st = td_optim_step(s->opt);
    if (st == TD_OK) st = td_graph_zero_grad(s->g);
    return st;
}

/* The median over the timed windows of `work` units per step (samples, or TFLOP) per second,
 * after a warm-up window; each window is ended by a synchronisation of the GPU. A failure
 * (the GPU side's first runs may have them) ends this row only: -1, with what failed. */
static double median_rate(const stepper *s, double work, const timing *tm, const char *row) {
    double *rates = malloc((size_t)tm->windows * sizeof *rates);
    int64_t steps = 0;
    for (int w = -1; w < tm->windows; w++) { /* window -1 is the warm-up */
        int iters = w < 0 ? tm->warmup : tm->iters;
        td_status st = td_device_synchronize(td_device_cuda(0));
        uint64_t t0 = td_time_ns();
        for (int i = 0; i < iters && st == TD_OK; i++) st = step(s);
        if (st == TD_OK) st = td_device_synchronize(td_device_cuda(0));
        steps += iters;
        float loss; /* the window's last, read once a window: a NaN stays NaN after it */
        if (st == TD_OK && !s->dy && (st = td_tensor_read(s->from, &loss)) == TD_OK)
            st = td_loss_check(loss, steps);
        if (st != TD_OK) {
            fprintf(stderr, "train_gpu: %s: %s\n", row, td_last_error());
            free(rates);
            return -1;
        }
        if (w >= 0) rates[w] = work * iters / ((double)(td_time_ns() - t0) * 1e-9);
    }
    qsort(rates, (size_t)tm->windows, sizeof *rates, bench_cmp_double);
    double median = rates[tm->windows / 2];
    free(rates);
    return median;
}

/* The model's layers: tandem's reference models (the GPT among them), or torchvision's
 * ResNets. */
static td_status model_sequential(const char *name, td_sequential **out) {
    int depth = !strcmp(name, "resnet50") ? 50 : !strcmp(name, "resnet101") ? 101 : 0;
    if (depth) {
        td_resnet_params p;
        td_status st = td_resnet_torchvision_params(depth, &p);
        return st != TD_OK ? st : td_resnet_sequential(&p, out);
    }
    td_model_kind kind;
    td_status st = td_model_kind_parse(name, &kind);
    return st != TD_OK ? st : td_model_sequential(kind, out);
}

/* Samples/s of one row, or -1 (with the reason printed) when it could not run. */
static double run_tandem(const char *name, precision prec, int graphs, const timing *tm) {
    td_sequential *s;
    CHECK(model_sequential(name, &s));
    td_graph_params gp = td_graph_default_params();
    gp.device = td_device_cuda(0);
    gp.cuda_graphs = graphs;
    gp.allow_tf32 = prec == P_TF32;
    if (prec == P_BF16) {
        gp.amp.level = TD_AMP_O1;
        gp.amp.dtype = TD_BF16;
    }
    td_graph *g;
    td_model m;
    CHECK(td_graph_create(&g, &gp));
    td_status st = td_model_build_sequential(g, s, tm->batch, 1, &m);
    td_sequential_destroy(s);
    if (st != TD_OK) {
        fprintf(stderr, "train_gpu: %s %s: %s\n", name, precision_names[prec], td_last_error());
        td_graph_destroy(g);
        return -1;
    }
    /* A batch of real images for the 28 x 28 models, random ones for the ImageNet-sized, random
     * tokens for the GPT (whose labels are one per position). */
    size_t per = (size_t)(td_tensor_numel(m.input) / tm->batch);
    size_t nlabels = (size_t)td_tensor_numel(m.labels);
    float *x = malloc((size_t)tm->batch * per * sizeof *x);
    int64_t *y = malloc(nlabels * sizeof *y);
    int64_t classes = td_tensor_shape(m.output).dim[1];
    td_dataset *data = NULL;
    if (per == 784 && td_dataset_load_fashion_mnist(&data, NULL, TD_SPLIT_TEST) == TD_OK) {
        memcpy(x, td_dataset_x(data), (size_t)tm->batch * per * sizeof *x);
        memcpy(y, td_dataset_y(data), nlabels * sizeof *y);
        td_dataset_destroy(data);
    } else {
        td_rng rng;
        td_rng_init(&rng, 3);
        for (size_t i = 0; i < (size_t)tm->batch * per; i++)
            x[i] = m.kind == TD_MODEL_GPT ? (float)td_rng_below(&rng, (uint32_t)classes)
                                          : td_rng_normal(&rng);
        for (size_t i = 0; i < nlabels; i++) y[i] = td_rng_below(&rng, (uint32_t)classes);
    }
    CHECK(td_tensor_write(m.input, x));
    CHECK(td_tensor_write(m.labels, y));
    free(x);
    free(y);
    td_param *params;
    size_t n;
    CHECK(td_graph_parameters(g, &params, &n));
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.01;
    sp.momentum = 0.9;
    td_optim *opt;
    CHECK(td_optim_create_sgd(&opt, params, n, &sp));
    stepper train = {g, m.loss, NULL, opt};
    char row[64];
    snprintf(row, sizeof row, "%s %s", name, precision_names[prec]);
    double median = median_rate(&train, (double)tm->batch, tm, row);
    const char *why = NULL;
    if (graphs && td_graph_replays(g, &why) == 0)
        fprintf(stderr, "train_gpu: %s %s: no sweep was replayed%s%s\n", name,
                precision_names[prec], why ? ": " : "", why ? why : "");
    td_optim_destroy(opt);
    td_graph_destroy(g);
    td_device_empty_cache(gp.device);
    return median;
}

/* One result of the PyTorch peer: a model's samples/s or a matmul shape's TFLOP/s. */
typedef struct {
    char model[24], precision[8], mode[16];
    double value;
} peer_row;

/* The string value of "key" in a JSON line, into out (n bytes); 0 when absent. */
static int json_string(const char *line, const char *key, char *out, size_t n) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": \"", key);
    const char *k = strstr(line, pat);
    if (!k) return 0;
    k += strlen(pat);
    size_t len = strcspn(k, "\"");
    snprintf(out, n, "%.*s", (int)(len < n ? len : n - 1), k);
    return 1;
}

/* Runs the peer once for every row; returns how many rows it printed (0 when it failed). */
static int run_torch(const char *models, const char *precisions, const char *matmuls, int compile,
                     const timing *tm, peer_row *rows, int cap) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "python3 bench/train_gpu_torch.py --models %s --precisions %s --matmuls %s "
             "--batch %lld --iters %d --windows %d --warmup %d%s",
             models, precisions, matmuls, (long long)tm->batch, tm->iters, tm->windows, tm->warmup,
             compile ? " --compile" : "");
    FILE *p = popen(cmd, "r");
    if (!p) return 0;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, p) && n < cap) {
        peer_row r = {0};
        const char *v = strstr(line, "\"samples_per_s\": ");
        if (!v) v = strstr(line, "\"tflops\": ");
        if (!v || !(json_string(line, "model", r.model, sizeof r.model) ||
                    json_string(line, "matmul", r.model, sizeof r.model)))
            continue;
        json_string(line, "precision", r.precision, sizeof r.precision);
        json_string(line, "mode", r.mode, sizeof r.mode);
        r.value = atof(strchr(v, ':') + 1);
        rows[n++] = r;
    }
    pclose(p);
    return n;
}

static double peer_value(const peer_row *rows, int n, const char *model, const char *prec,
                         const char *mode) {
    for (int i = 0; i < n; i++)
        if (!strcmp(rows[i].model, model) && !strcmp(rows[i].precision, prec) &&
            !strcmp(rows[i].mode, mode))
            return rows[i].value;
    return -1;
}

/* TFLOP/s of a graph that is one linear node y = x W^T, x (M, K), W (N, K), random, run forward
 * and backward from a random dy that stays on the GPU: the same three products the peer times
 * alone. bf16 is apex O2 (the weight kept in bf16), so no cast runs beside the products. */
static double run_matmul(int64_t M, int64_t K, int64_t N, precision prec, const timing *tm) {
    td_graph_params gp = td_graph_default_params();
    gp.device = td_device_cuda(0);
    gp.allow_tf32 = prec == P_TF32;
    if (prec == P_BF16) {
        gp.amp.level = TD_AMP_O2;
        gp.amp.dtype = TD_BF16;
    }
    td_graph *g;
    td_tensor *x, *w, *y;
    CHECK(td_graph_create(&g, &gp));
    CHECK(td_graph_input(g, "x", td_shape_2d(M, K), TD_F32, 1, &x));
    CHECK(td_graph_param(g, "w", td_shape_2d(N, K), &w));
    CHECK(td_graph_linear(g, x, w, NULL, &y));
    CHECK(td_graph_compile(g));
    size_t big = (size_t)(M > N ? M : N) * (size_t)(K > N ? K : N);
    float *host = malloc(big * sizeof *host);
    td_rng rng;
    td_rng_init(&rng, 5);
    for (size_t i = 0; i < big; i++) host[i] = td_rng_normal(&rng);
    CHECK(td_tensor_write(x, host));
    CHECK(td_tensor_write(w, host));
    void *dy = NULL;
    CHECK(td_device_alloc(gp.device, (size_t)(M * N) * sizeof *host, &dy));
    CHECK(td_device_copy(gp.device, dy, td_device_cpu(), host, (size_t)(M * N) * sizeof *host));
    free(host);
    stepper sweeps = {g, y, dy, NULL};
    char row[64];
    snprintf(row, sizeof row, "matmul %lldx%lldx%lld %s", (long long)M, (long long)K, (long long)N,
             precision_names[prec]);
    double median = median_rate(&sweeps, 6.0 * (double)M * (double)K * (double)N / 1e12, tm, row);
    CHECK(td_device_free(gp.device, dy));
    td_graph_destroy(g);
    td_device_empty_cache(gp.device);
    return median;
}

static void fmt_rate(char *buf, size_t n, double v) {
    if (v > 0)
        snprintf(buf, n, "%.0f", v);
    else
        snprintf(buf, n, "-");
}

static void fmt_ratio(char *buf, size_t n, double a, double b) {
    if (a > 0 && b > 0)
        snprintf(buf, n, "%.2fx", a / b);
    else
        snprintf(buf, n, "-");
}

static int model_ok(const char *name) {
    td_model_kind kind;
    return !strcmp(name, "resnet50") || !strcmp(name, "resnet101") ||
           td_model_kind_parse(name, &kind) == TD_OK;
}

static int precision_of(const char *name) {
    for (int k = 0; k < P_COUNT; k++)
        if (!strcmp(name, precision_names[k])) return k;
    return -1;
}

static int precision_ok(const char *name) { return precision_of(name) >= 0; }

static int matmul_ok(const char *shape) {
    long long M, K, N;
    char end;
    return sscanf(shape, "%lldx%lldx%lld%c", &M, &K, &N, &end) == 3 && M > 0 && K > 0 && N > 0;
}

int main(int argc, char **argv) {
    const char *models = "net,mlp,cnn,resnet,resnet50,resnet101,gpt", *precs = "f32,tf32,bf16",
               *matmuls = "128x1024x1024,8192x8192x8192";
    timing tm = {20, 5, 5, 128};
    int no_torch = 0, compile = 0, no_graphs_column = 0, json = 0;
    long batch = tm.batch;
    td_args a;
    td_args_init(&a, "train_gpu", argc, argv);
    while (td_args_next(&a)) {
        bench_list_option(&a, "--models", &models, model_ok,
                          "comma-separated models: net, mlp, cnn, resnet, resnet50, resnet101, "
                          "gpt");
        bench_list_option(&a, "--precisions", &precs, precision_ok,
                          "comma-separated precisions: f32, tf32, bf16");
        bench_list_option(&a, "--matmuls", &matmuls, matmul_ok, "comma-separated MxKxN shapes");
        td_args_int(&a, "--iters", 1, INT_MAX, &tm.iters);
        td_args_int(&a, "--windows", 1, INT_MAX, &tm.windows);
        td_args_long(&a, "--batch", 1, LONG_MAX, &batch);
        td_args_flag(&a, "--no-torch", &no_torch);
        td_args_flag(&a, "--compile", &compile);
        td_args_flag(&a, "--no-graphs-column", &no_graphs_column);
        td_args_flag(&a, "--json", &json);
    }
    bench_args_finish(&a, "usage: train_gpu [--models net,mlp,cnn,resnet,resnet50,resnet101,gpt] "
                          "[--precisions f32,tf32,bf16] [--matmuls MxKxN,...] [--iters N] "
                          "[--windows N] [--batch B] [--no-torch] [--compile] "
                          "[--no-graphs-column] [--json]\n");
    tm.batch = batch;
    int torch = !no_torch, plain_column = !no_graphs_column;
    int gpus = 0;
    CHECK(td_cuda_device_count(&gpus));
    if (!gpus) {
        printf("train_gpu: no GPU can be used here (%s); nothing measured\n",
               td_cuda_unavailable());
        return 0;
    }
    td_device_properties prop;
    CHECK(td_device_get_properties(td_device_cuda(0), &prop));
    char cpu[256];
    printf("%s (%d SMs, %.0f GiB), host %s\n", prop.name, prop.multiprocessors,
           (double)prop.total_memory / (1 << 30), bench_cpu_name(cpu, sizeof cpu));
    printf("samples/s at batch %lld, median of %d windows of %d steps (SGD momentum, batch on "
           "the GPU)\n",
           (long long)tm.batch, tm.windows, tm.iters);
    peer_row peer[MAX_ROWS];
    int npeer = torch ? run_torch(models, precs, matmuls, compile, &tm, peer, MAX_ROWS) : 0;
    if (torch && !npeer) fprintf(stderr, "train_gpu: the PyTorch peer printed nothing\n");
    printf("%-10s %-5s %10s %10s %10s %10s %8s %8s\n", "model", "prec", "tandem", "no graphs",
           "eager", "compile", "vs eager", "vs comp");
    char mlist[128], plist[64];
    snprintf(mlist, sizeof mlist, "%s", models);
    int failed = 0;
    for (char *ms = NULL, *name = strtok_r(mlist, ",", &ms); name;
         name = strtok_r(NULL, ",", &ms)) {
        snprintf(plist, sizeof plist, "%s", precs);
        for (char *ps = NULL, *pn = strtok_r(plist, ",", &ps); pn; pn = strtok_r(NULL, ",", &ps)) {
            int prec = precision_of(pn); /* checked with the options */
            double ours = run_tandem(name, (precision)prec, 1, &tm);
            double plain = plain_column ? run_tandem(name, (precision)prec, 0, &tm) : -1;
            double eager = peer_value(peer, npeer, name, pn, "eager");
            double comp = peer_value(peer, npeer, name, pn, "compile");
            failed |= ours < 0;
            char a[16], b[16], c[16], d[16], r1[16], r2[16];
            fmt_rate(a, sizeof a, ours);
            fmt_rate(b, sizeof b, plain);
            fmt_rate(c, sizeof c, eager);
            fmt_rate(d, sizeof d, comp);
            fmt_ratio(r1, sizeof r1, ours, eager);
            fmt_ratio(r2, sizeof r2, ours, comp);
            printf("%-10s %-5s %10s %10s %10s %10s %8s %8s\n", name, pn, a, b, c, d, r1, r2);
            if (json)
                printf("{\"model\": \"%s\", \"precision\": \"%s\", \"tandem\": %.1f, "
                       "\"tandem_no_graphs\": %.1f, \"eager\": %.1f, \"compile\": %.1f}\n",
                       name, pn, ours, plain, eager, comp);
            fflush(stdout);
        }
    }
    printf("\nlinear node forward + backward against the same three products alone through "
           "PyTorch (cuBLASLt), TFLOP/s\n%-16s %-5s %10s %10s %8s\n",
           "M x K x N", "prec", "tandem", "cuBLASLt", "ratio");
    char slist[128];
    snprintf(slist, sizeof slist, "%s", matmuls);
    for (char *ss = NULL, *shape = strtok_r(slist, ",", &ss); shape;
         shape = strtok_r(NULL, ",", &ss)) {
        long long M, K, N;
        sscanf(shape, "%lldx%lldx%lld", &M, &K, &N); /* checked with the options */
        snprintf(plist, sizeof plist, "%s", precs);
        for (char *ps = NULL, *pn = strtok_r(plist, ",", &ps); pn; pn = strtok_r(NULL, ",", &ps)) {
            int prec = precision_of(pn);
            double ours = run_matmul(M, K, N, (precision)prec, &tm);
            double alone = peer_value(peer, npeer, shape, pn, "matmul");
            char r[16];
            fmt_ratio(r, sizeof r, ours, alone);
            printf("%-16s %-5s %10.1f %10.1f %8s\n", shape, pn, ours, alone, r);
            if (json)
                printf("{\"matmul\": \"%s\", \"precision\": \"%s\", \"tandem_tflops\": "
                       "%.2f, \"cublaslt_tflops\": %.2f}\n",
                       shape, pn, ours, alone);
            fflush(stdout);
        }
    }
    return failed;
}
