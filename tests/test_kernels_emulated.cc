/* Every hand-written CUDA kernel of libtandem_cuda.so run on the CPU under the emulation of
 * CUDA's execution model (src/device/cuda/emulate.cuh), against the CPU's reference ops and the
 * CPU's own kernels, on the shapes where kernels break: one element, sizes that are not
 * multiples of the block, more blocks than a grid takes (grid-stride loops), zero rows. The
 * kernels are the library's own headers, compiled here by the C++ compiler; the CUDA libraries'
 * calls (cuBLASLt, cuDNN, NCCL) are not emulated and are tested on a GPU only
 * (test_cuda_graph, test_cuda_comm). The emulation's own rules are test_cuda_emulation's. Each
 * case runs in a child process, so a kernel the emulation stops fails its case only. */
#include "test_emulated.h"

extern "C" {
#include "tandem/optim.h"

#include "comm/comm_impl.h"
#include "ops/ref/ref.h"
}
#include "tandem/graph.h"

#include "comm/cuda/ipc.cuh"
#include "device/cuda/channels.cuh"
#include "device/cuda/elements.cuh"
#include "device/cuda/multi_tensor.cuh"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/batch_norm.cuh"
#include "ops/cuda/concat.cuh"
#include "ops/cuda/conv2d.cuh"
#include "ops/cuda/dropout.cuh"
#include "ops/cuda/eltwise.cuh"
#include "ops/cuda/embedding.cuh"
#include "ops/cuda/layer_norm.cuh"
#include "ops/cuda/linear.cuh"
#include "ops/cuda/nll_loss.cuh"
#include "ops/cuda/normalize.cuh"
#include "ops/cuda/softmax.cuh"

/* ---- the device layer's kernels (src/device/cuda) ---- */

/* Conversions between every pair of dtypes, as the host converts (floats to nearest even
 * through f32, integers through int64), over a grid of more than 65535 blocks (the grid-stride
 * loop's second lap) and one element. */
static void device_convert(void) {
    const td_dtype all[] = {TD_F32, TD_F64, TD_BF16, TD_F16, TD_I32, TD_I64, TD_U8};
    for (size_t n : {(size_t)1, (size_t)1000, (size_t)65535 * 256 + 3}) {
        std::vector<double> v(n);
        for (size_t i = 0; i < n; i++) v[i] = (double)(i % 509) - 200.25 + (i % 3) * 1e-3;
        for (td_dtype st : all)
            for (td_dtype dt : all) {
                if (n > 1000 && !(st == TD_F32 && dt == TD_BF16)) continue; /* one long pass */
                size_t ss = td_dtype_size(st), ds = td_dtype_size(dt);
                char *src = td__emu::alloc<char>(n * ss, "src");
                char *dst = td__emu::alloc<char>(n * ds, "dst");
                for (size_t i = 0; i < n; i++) td_st_dt(src, st, i, v[i]);
                td__launch_convert(nullptr, dst, dt, src, st, n);
                size_t bad = 0;
                for (size_t i = 0; i < n; i++) {
                    double x = td_ld_dt(src, st, i), want;
                    if (dt == TD_F32 || dt == TD_BF16 || dt == TD_F16)
                        want = dt == TD_F32    ? (double)(float)x
                               : dt == TD_BF16 ? td__bf16_to_f32(td__f32_to_bf16((float)x))
                                               : td__f16_to_f32(td__f32_to_f16((float)x));
                    else if (dt == TD_F64)
                        want = x;
                    else
                        want = dt == TD_I32   ? (double)(int32_t)(int64_t)x
                               : dt == TD_I64 ? (double)(int64_t)x
                                              : (double)(uint8_t)(int64_t)x;
                    if (td_ld_dt(dst, dt, i) != want) bad++;
                }
                if (bad) TEST_FAIL_AT("convert %d -> %d, %zu elements: %zu wrong", st, dt, n, bad);
                td__emu::release(src);
                td__emu::release(dst);
            }
    }
}

static void device_fill(void) {
    for (int size : {2, 4})
        for (size_t n : {(size_t)1, (size_t)257, size == 2 ? (size_t)65535 * 256 + 1 : 1000}) {
            char *p = td__emu::alloc<char>(n * (size_t)size, "p");
            td__launch_fill(nullptr, p, 0xabcd1234u, size, n);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++)
                bad += size == 2 ? ((uint16_t *)p)[i] != 0x1234 : ((uint32_t *)p)[i] != 0xabcd1234u;
            CHECK_EQ(bad, 0);
            td__emu::release(p);
        }
}

/* SyncBatchNorm's channel sums and affine map against sums in double in plain loops. */
static void device_channels(void) {
    struct {
        int64_t N, C, S;
    } shapes[] = {{1, 1, 1}, {3, 5, 7}, {2, 3, 300}, {0, 4, 9}, {4, 2, 0}, {1, 3000, 1}};
    for (auto sh : shapes) {
        int64_t N = sh.N, C = sh.C, S = sh.S, total = N * C * S;
        float *x = uniform((size_t)total, "x"), *dy = uniform((size_t)total, "dy");
        float *mean = uniform((size_t)C, "mean"), *coef = uniform((size_t)(4 * C), "coef");
        double *s = td__emu::alloc<double>((size_t)(2 * C), "sums");
        for (int with_dy = 0; with_dy < 2; with_dy++) {
            td__launch_channel_sums(nullptr, x, with_dy ? dy : nullptr, with_dy ? mean : nullptr, N,
                                    C, S, s);
            for (int64_t c = 0; c < C; c++) {
                double a = 0, b = 0;
                for (int64_t n = 0; n < N; n++)
                    for (int64_t j = 0; j < S; j++) {
                        double v = x[(n * C + c) * S + j], g = dy[(n * C + c) * S + j];
                        a += with_dy ? g : v;
                        b += with_dy ? g * (v - mean[c]) : v * v;
                    }
                CHECK_NEAR(s[c], a, 1e-12 * (1 + fabs(a)) * (double)(N * S + 1));
                CHECK_NEAR(s[C + c], b, 1e-12 * (1 + fabs(b)) * (double)(N * S + 1));
            }
        }
        float *out = td__emu::alloc<float>((size_t)total, "out");
        for (int extra = 0; extra < 2; extra++) {
            td__launch_channel_affine(nullptr, out, x, coef, extra ? dy : nullptr, N, C, S);
            size_t bad = 0;
            for (int64_t i = 0; i < total; i++) {
                int64_t c = (i / S) % C;
                float v = (x[i] - coef[c]) * coef[C + c] + coef[2 * C + c];
                if (extra) v = v + coef[3 * C + c] * dy[i];
                bad += out[i] != v;
            }
            CHECK_EQ(bad, 0);
        }
    }
}

/* ---- the optimizers' multi-tensor kernels (src/device/cuda/multi_tensor.cuh) ---- */

/* One parameter of a multi-tensor case: its values on the host for the CPU optimizer, and in
 * guarded buffers for the kernels. */
typedef struct {
    const char *name;
    size_t count;
    td_dtype dtype, master; /* master: TD_F32 (O2 master weights) or the dtype (O3) */
    int has_grad;
} mt_spec;

static const mt_spec mt_specs[] = {
    {"one", 1, TD_F32, TD_F32, 1},      {"chunks", 2 * TD__MT_CHUNK + 5, TD_F32, TD_F32, 1},
    {"o2", 700, TD_BF16, TD_F32, 1},    {"o3", 300, TD_F16, TD_F16, 1},
    {"no_grad", 50, TD_F32, TD_F32, 0}, {"empty", 0, TD_F32, TD_F32, 1},
    {"o2_half", 33, TD_F16, TD_F32, 1},
};
#define MT_N (sizeof mt_specs / sizeof *mt_specs)

/* The step's scalars, rounded from double as the CPU's optimizer rounds them. */
static td__mt_args mt_args(int adamw, const td_sgd_params *sgd, const td_adamw_params *aw) {
    td__mt_args a = {};
    a.op = adamw ? TD__MT_ADAMW : TD__MT_SGD;
    if (!adamw) {
        a.neg_lr = (float)(-sgd->lr);
        a.weight_decay = (float)sgd->weight_decay;
        a.momentum = (float)sgd->momentum;
        a.keep = (float)(1.0 - sgd->dampening);
        a.nesterov = sgd->nesterov;
    } else {
        a.decay = (float)(1.0 - aw->lr * aw->weight_decay);
        a.beta1 = (float)aw->beta1;
        a.beta2 = (float)aw->beta2;
        a.one_b1 = (float)(1.0 - aw->beta1);
        a.one_b2 = (float)(1.0 - aw->beta2);
        a.eps = (float)aw->eps;
    }
    return a;
}

/* Runs the multi-tensor launch over list[0..n) as the library does: planned, the list copied
 * into a guarded buffer, the scratch sized for the chunks. */
static double mt_run(const td__mt_args *a, td__mt_tensor *list, size_t n) {
    uint64_t chunks;
    size_t kept = td__mt_plan(a, list, n, &chunks);
    if (!kept) return 0;
    td__mt_tensor *dev = td__emu::alloc<td__mt_tensor>(kept, "list");
    memcpy((void *)dev, list, kept * sizeof *list);
    double *partials = td__emu::alloc<double>(chunks, "partials");
    int *flag = td__emu::alloc<int>(1, "flag");
    *flag = 0;
    td__launch_multi_tensor(nullptr, a, dev, kept, chunks, partials, flag);
    double r = a->op == TD__MT_SQUARES ? partials[0] : a->op == TD__MT_UNSCALE ? *flag : 0;
    td__emu::release(dev);
    td__emu::release(partials);
    td__emu::release(flag);
    return r;
}

/* Three steps of SGD (with momentum, dampening, weight decay, Nesterov or not) and of AdamW on
 * f32 parameters and on bf16 and f16 ones with f32 masters (O2) or in place (O3), against the
 * CPU's optimizer: the same bits in every parameter and every state buffer. */
static void optim_steps(int adamw, int nesterov) {
    td_param cpu[MT_N], dev[MT_N];
    void *grads[MT_N];
    for (size_t i = 0; i < MT_N; i++) {
        const mt_spec *m = &mt_specs[i];
        size_t es = td_dtype_size(m->dtype), c = m->count;
        td_param p = {};
        p.name = m->name;
        p.count = c;
        p.dtype = m->dtype;
        p.master_dtype = m->master;
        p.ndim = 1;
        p.shape[0] = (int64_t)c;
        cpu[i] = dev[i] = p;
        cpu[i].data = malloc(c * es + 1);
        cpu[i].grad = m->has_grad ? malloc(c * es + 1) : NULL;
        dev[i].data = td__emu::alloc<char>(c * es, m->name);
        grads[i] = m->has_grad ? td__emu::alloc<char>(c * es, "grad") : NULL;
        for (size_t j = 0; j < c; j++) td__store(cpu[i].data, m->dtype, j, td_rng_normal(&rng));
        memcpy(dev[i].data, cpu[i].data, c * es);
    }
    td_sgd_params sgd = td_sgd_default_params();
    sgd.lr = 0.05;
    sgd.momentum = 0.9;
    sgd.dampening = nesterov ? 0 : 0.1;
    sgd.weight_decay = 1e-2;
    sgd.nesterov = nesterov;
    td_adamw_params aw = td_adamw_default_params();
    aw.lr = 0.01;
    td_optim *o;
    CHECK_OK(adamw ? td_optim_create_adamw(&o, cpu, MT_N, &aw)
                   : td_optim_create_sgd(&o, cpu, MT_N, &sgd));
    /* The kernels' state: master weights from the parameters, zeroed buffers. */
    td__mt_tensor list[MT_N];
    for (size_t i = 0; i < MT_N; i++) {
        const mt_spec *m = &mt_specs[i];
        int low = m->dtype != TD_F32, o2 = low && m->master == TD_F32;
        td_dtype sd = low && !o2 ? m->dtype : TD_F32;
        size_t c = m->count, ss = td_dtype_size(sd);
        list[i] = td__mt_tensor{};
        list[i].param = dev[i].data;
        list[i].grad = grads[i];
        list[i].buf1 = td__emu::alloc<char>(c * ss, "buf1");
        list[i].buf2 = adamw ? td__emu::alloc<char>(c * ss, "buf2") : nullptr;
        memset(list[i].buf1, 0, c * ss);
        if (list[i].buf2) memset(list[i].buf2, 0, c * ss);
        list[i].master = o2 ? td__emu::alloc<float>(c, "master") : nullptr;
        list[i].count = c;
        list[i].dtype = m->dtype;
        list[i].state_dtype = sd;
        if (o2) {
            td__mt_args init = {};
            init.op = TD__MT_MASTER_INIT;
            td__mt_tensor t = list[i];
            mt_run(&init, &t, 1);
        }
    }
    for (int step = 1; step <= 3; step++) {
        for (size_t i = 0; i < MT_N; i++) {
            const mt_spec *m = &mt_specs[i];
            if (!m->has_grad) continue;
            for (size_t j = 0; j < m->count; j++)
                td__store(cpu[i].grad, m->dtype, j, td_rng_normal(&rng));
            memcpy(grads[i], cpu[i].grad, m->count * td_dtype_size(m->dtype));
        }
        CHECK_OK(td_optim_step(o));
        td__mt_args a = mt_args(adamw, &sgd, &aw);
        td__mt_tensor l[MT_N];
        for (size_t i = 0; i < MT_N; i++) {
            l[i] = list[i];
            l[i].first = step == 1;
            double bc1 = 1.0 - pow(aw.beta1, step), bc2 = 1.0 - pow(aw.beta2, step);
            l[i].neg_step = (float)(-(aw.lr / bc1));
            l[i].bc2_sqrt = (float)sqrt(bc2);
        }
        mt_run(&a, l, MT_N);
    }
    for (size_t i = 0; i < MT_N; i++) {
        size_t bytes = mt_specs[i].count * td_dtype_size(mt_specs[i].dtype);
        if (memcmp(cpu[i].data, dev[i].data, bytes))
            TEST_FAIL_AT("%s %s: parameter '%s' differs from the CPU's", adamw ? "AdamW" : "SGD",
                         nesterov ? "(Nesterov)" : "", mt_specs[i].name);
    }
    /* The CPU's state tensors, by name, against the kernels' buffers. */
    td_param *state;
    size_t ns;
    td_optim_state(o, &state, &ns);
    size_t compared = 0;
    for (size_t k = 0; k < ns; k++)
        for (size_t i = 0; i < MT_N; i++) {
            std::string base = std::string("optim.") + mt_specs[i].name + ".";
            const void *mine = nullptr;
            if (state[k].name == base + (adamw ? "exp_avg" : "momentum_buffer"))
                mine = list[i].buf1;
            if (state[k].name == base + "exp_avg_sq") mine = list[i].buf2;
            if (!mine || !mt_specs[i].has_grad || !state[k].count) continue;
            compared++;
            if (memcmp(state[k].data, mine, state[k].count * td_dtype_size(state[k].dtype)))
                TEST_FAIL_AT("state '%s' differs from the CPU's", state[k].name);
        }
    CHECK(compared >= (adamw ? 8u : 4u));
    td_optim_destroy(o);
}

static void optim_sgd(void) { optim_steps(0, 0); }
static void optim_sgd_nesterov(void) { optim_steps(0, 1); }
static void optim_adamw(void) { optim_steps(1, 0); }

/* The squared norm of every gradient (clipping), scaling, and unscaling with its overflow flag
 * (the loss scaler). */
static void optim_norm_scale(void) {
    td__mt_tensor list[MT_N];
    double want = 0;
    for (size_t i = 0; i < MT_N; i++) {
        const mt_spec *m = &mt_specs[i];
        list[i] = td__mt_tensor{};
        list[i].count = m->count;
        list[i].dtype = m->dtype;
        list[i].grad =
            m->has_grad ? td__emu::alloc<char>(m->count * td_dtype_size(m->dtype), "g") : nullptr;
        for (size_t j = 0; m->has_grad && j < m->count; j++) {
            td__store(list[i].grad, m->dtype, j, td_rng_normal(&rng));
            double v = td__load(list[i].grad, m->dtype, j);
            want += v * v;
        }
    }
    td__mt_args a = {};
    a.op = TD__MT_SQUARES;
    td__mt_tensor l[MT_N];
    memcpy(l, list, sizeof l);
    CHECK_NEAR(mt_run(&a, l, MT_N), want, 1e-12 * want);
    a.op = TD__MT_SCALE;
    a.factor = 0.375f;
    memcpy(l, list, sizeof l);
    std::vector<float> before(mt_specs[1].count);
    for (size_t j = 0; j < before.size(); j++) before[j] = td__load(list[1].grad, TD_F32, j);
    mt_run(&a, l, MT_N);
    for (size_t j = 0; j < before.size(); j++)
        CHECK_EQ(td__f32_bits(((float *)list[1].grad)[j]), td__f32_bits(before[j] * 0.375f));
    a.op = TD__MT_UNSCALE;
    a.factor = 0.5f;
    memcpy(l, list, sizeof l);
    CHECK_EQ(mt_run(&a, l, MT_N), 0);
    td__store(list[3].grad, TD_F16, 299, INFINITY); /* an overflow in the scaled backward */
    memcpy(l, list, sizeof l);
    CHECK_EQ(mt_run(&a, l, MT_N), 1);
}

/* ---- the IPC path's reductions (src/comm/cuda) ---- */

/* The reduction over 1 to 8 ranks' buffers at an offset, every dtype and op, against the
 * host's td__reduce (the same fold order, so the same bits), integers at their extremes (sums
 * and products wrap). */
static void ipc_reduce(void) {
    const td_dtype all[] = {TD_F32, TD_F64, TD_BF16, TD_F16, TD_I32, TD_I64, TD_U8};
    const td_reduce_op ops[] = {TD_OP_SUM, TD_OP_PROD, TD_OP_MIN, TD_OP_MAX, TD_OP_AVG};
    for (int ranks : {1, 2, 3, 8})
        for (size_t n : {(size_t)1, (size_t)1000})
            for (td_dtype dt : all)
                for (td_reduce_op op : ops) {
                    size_t es = td_dtype_size(dt), at = 5;
                    td__ipc_peers peers;
                    const void *src[TD__IPC_MAX_RANKS];
                    for (int r = 0; r < ranks; r++) {
                        char *b = td__emu::alloc<char>((at + n) * es, "staging");
                        for (size_t i = 0; i < at + n; i++) {
                            uint32_t u = td_rng_u32(&rng);
                            if (dt == TD_I64)
                                ((int64_t *)b)[i] = i % 7 == 0 ? INT64_MAX - (int64_t)(u % 3)
                                                               : (int64_t)u * 4099 - (1ll << 40);
                            else if (dt == TD_I32 || dt == TD_U8)
                                td_st_dt(b, dt, i,
                                         i % 7 == 0 ? 2147483647.0 - u % 3
                                                    : (double)(u % 1000) - 300);
                            else
                                td_st_dt(b, dt, i, td_rng_normal(&rng) * 3);
                        }
                        peers.p[r] = b;
                        src[r] = b + at * es;
                    }
                    char *got = td__emu::alloc<char>(n * es, "dst");
                    std::vector<char> want(n * es);
                    CHECK_EQ(td__launch_ipc_reduce(nullptr, got, peers, ranks, at, n, dt, op), 0);
                    td__reduce(want.data(), src, ranks, n, dt, op, ranks);
                    if (memcmp(got, want.data(), n * es))
                        TEST_FAIL_AT("%d ranks, %zu elements of dtype %d, op %d: not the host's",
                                     ranks, n, dt, op);
                    td__emu::release(got);
                    for (int r = 0; r < ranks; r++) td__emu::release((void *)peers.p[r]);
                }
}

/* ---- the graph's kernels (src/ops/cuda) ---- */

typedef void (*ref_act)(float *, const float *, size_t);
typedef void (*ref_act_grad)(float *, const float *, const float *, size_t);

/* ReLU, GELU and tanh GELU forward and backward (written and added), add, and the converting
 * y = beta y + alpha x, in every float dtype, against the reference ops. */
template <typename T> static void eltwise_case(void) {
    const int variants[] = {TD__ELT_RELU, TD__ELT_GELU, TD__ELT_GELU_TANH};
    const ref_act fwd[] = {td__ref_relu_forward, td__ref_gelu_forward, td__ref_gelu_tanh_forward};
    const ref_act_grad bwd[] = {td__ref_relu_backward, td__ref_gelu_backward,
                                td__ref_gelu_tanh_backward};
    double tol = tol_of<T>();
    for (size_t n : {(size_t)1, (size_t)257, (size_t)1000}) {
        std::vector<float> x = values(n, -3, 3), dy = values(n), old = values(n), a = values(n);
        T *dx_ = to_device<T>(x, "x"), *ddy = to_device<T>(dy, "dy"), *da = to_device<T>(a, "a");
        T *y = td__emu::alloc<T>(n, "y"), *g = td__emu::alloc<T>(n, "dx");
        std::vector<float> want(n), want_g(n);
        for (int v = 0; v < 3; v++) {
            td__launch_act_forward<T>(nullptr, y, dx_, n, variants[v]);
            fwd[v](want.data(), x.data(), n);
            CHECK_CLOSE(to_host(y, n).data(), want.data(), n, tol);
            for (float beta : {0.f, 1.f}) {
                std::vector<float> o = old;
                T *dg = to_device<T>(o, "dx");
                td__launch_act_backward<T>(nullptr, dg, ddy, dx_, n, variants[v], beta);
                bwd[v](want_g.data(), dy.data(), x.data(), n);
                for (size_t i = 0; i < n; i++) want_g[i] += beta * o[i];
                CHECK_CLOSE(to_host(dg, n).data(), want_g.data(), n, 2 * tol);
                td__emu::release(dg);
            }
        }
        td__launch_add<T>(nullptr, y, dx_, da, n);
        for (size_t i = 0; i < n; i++) want[i] = x[i] + a[i];
        CHECK_CLOSE(to_host(y, n).data(), want.data(), n, tol);
        /* from f32 into T and back, rounded as a store rounds */
        std::vector<float> o = old;
        T *acc = to_device<T>(o, "acc");
        float *src = td__emu::alloc<float>(n, "src");
        memcpy(src, a.data(), n * sizeof(float));
        td__launch_add_into<T, float>(nullptr, acc, src, n, 0.5f, 2.f);
        for (size_t i = 0; i < n; i++) {
            T r;
            td_st(&r, 0, 2.f * o[i] + 0.5f * a[i]);
            CHECK_EQ(td__f32_bits(td_ld(acc, i)), td__f32_bits(td_ld(&r, 0)));
        }
        td__launch_add_into<float, T>(nullptr, src, acc, n, 1.f, 0.f);
        for (size_t i = 0; i < n; i++) CHECK_EQ(td__f32_bits(src[i]), td__f32_bits(td_ld(acc, i)));
        for (void *p :
             {(void *)dx_, (void *)ddy, (void *)da, (void *)y, (void *)g, (void *)acc, (void *)src})
            td__emu::release(p);
    }
}

/* ReLU of a NaN on the GPU is what the CPU op (a graph on the CPU, oneDNN) gives: 0, where
 * PyTorch keeps the NaN; its gradient there is 0; the folded ReLU of batch norm alike. */
static void relu_nan_as_the_cpu_op(void) {
    td_graph *gr;
    td_graph_params gp = td_graph_default_params();
    CHECK_OK(td_graph_create(&gr, &gp));
    td_tensor *x, *y;
    int64_t dims[2] = {1, 4};
    CHECK_OK(td_graph_input(gr, "x", td_shape_make(2, dims), TD_F32, 0, &x));
    CHECK_OK(td_graph_relu(gr, x, &y));
    CHECK_OK(td_graph_compile(gr));
    float in[4] = {NAN, -1.f, 2.f, -NAN}, cpu[4];
    CHECK_OK(td_tensor_write(x, in));
    CHECK_OK(td_graph_forward(gr));
    CHECK_OK(td_tensor_read(y, cpu));
    td_graph_destroy(gr);
    float *dx = td__emu::alloc<float>(4, "x"), *dy = td__emu::alloc<float>(4, "y");
    memcpy(dx, in, sizeof in);
    td__launch_act_forward<float>(nullptr, dy, dx, 4, TD__ELT_RELU);
    for (int i = 0; i < 4; i++) CHECK_EQ(td__f32_bits(dy[i]), td__f32_bits(cpu[i]));
    td__launch_bn_relu<float>(nullptr, dx, 4);
    for (int i = 0; i < 4; i++) CHECK_EQ(td__f32_bits(dx[i]), td__f32_bits(cpu[i]));
    float *g = td__emu::alloc<float>(4, "dy"), *out = td__emu::alloc<float>(4, "dx");
    for (int i = 0; i < 4; i++) g[i] = 1.f;
    memcpy(dx, in, sizeof in);
    td__launch_act_backward<float>(nullptr, out, g, dx, 4, TD__ELT_RELU, 0.f);
    CHECK(out[0] == 0.f && out[1] == 0.f && out[2] == 1.f && out[3] == 0.f);
}

static void eltwise_f32(void) { eltwise_case<float>(); }
static void eltwise_bf16(void) { eltwise_case<__nv_bfloat16>(); }
static void eltwise_f16(void) { eltwise_case<__half>(); }

/* Softmax and log-softmax over rows wider and narrower than a block, none at all. */
static void softmax_rows(void) {
    for (unsigned rows : {0u, 1u, 3u})
        for (int64_t C : {1, 255, 257, 1000})
            for (int log = 0; log < 2; log++) {
                size_t n = rows * (size_t)C;
                std::vector<float> x = values(n, -5, 5), dy = values(n), want(n), old = values(n);
                float *dx_ = to_device<float>(x, "x"), *ddy = to_device<float>(dy, "dy");
                float *y = td__emu::alloc<float>(n, "y"), *dg = to_device<float>(old, "dx");
                td__launch_softmax_forward(nullptr, y, dx_, rows, C, log);
                (log ? td__ref_log_softmax_forward : td__ref_softmax_forward)(want.data(), x.data(),
                                                                              rows, (int)C);
                CHECK_CLOSE(y, want.data(), n, 1e-5);
                td__launch_softmax_backward(nullptr, dg, ddy, y, rows, C, log, 1.f);
                (log ? td__ref_log_softmax_backward
                     : td__ref_softmax_backward)(want.data(), dy.data(), y, rows, (int)C);
                for (size_t i = 0; i < n; i++) want[i] += old[i];
                CHECK_CLOSE(dg, want.data(), n, 1e-5);
                for (void *p : {(void *)dx_, (void *)ddy, (void *)y, (void *)dg})
                    td__emu::release(p);
            }
}

/* The loss and its gradient, mean and sum; a label outside [0, C) is skipped and the first
 * such sample named; no samples give a NaN mean, as PyTorch's. */
static void nll_loss_labels(void) {
    for (int64_t N : {1, 300})
        for (int64_t C : {1, 7, 1000})
            for (int mean = 0; mean < 2; mean++) {
                size_t n = (size_t)(N * C);
                std::vector<float> lp = values(n, -4, 0), old = values(n);
                int64_t *lab = td__emu::alloc<int64_t>((size_t)N, "labels");
                for (int64_t i = 0; i < N; i++) lab[i] = td_rng_below(&rng, (uint32_t)C);
                float *dlp = to_device<float>(lp, "logp"), *loss = td__emu::alloc<float>(1, "loss");
                float *dloss = td__emu::alloc<float>(1, "dloss"), *g = to_device<float>(old, "g");
                unsigned long long *bad = td__emu::alloc<unsigned long long>(1, "bad");
                *bad = ~0ull;
                *dloss = 0.75f;
                td__launch_nll_forward(nullptr, loss, dlp, lab, N, C, mean, bad);
                float want;
                td__ref_reduction red = mean ? TD__REF_MEAN : TD__REF_SUM;
                CHECK_OK(
                    td__ref_nll_loss_forward(&want, lp.data(), lab, (int)N, (int)C, red, -100));
                CHECK_NEAR(*loss, want, 1e-5 * (1 + fabs(want)));
                CHECK_EQ(*bad, ~0ull);
                td__launch_nll_backward(nullptr, g, dloss, lab, N, C, mean, 1.f);
                std::vector<float> wg(n);
                CHECK_OK(
                    td__ref_nll_loss_backward(wg.data(), 0.75f, lab, (int)N, (int)C, red, -100));
                for (size_t i = 0; i < n; i++) wg[i] += old[i];
                CHECK_CLOSE(g, wg.data(), n, 1e-6);
                if (N > 10) {
                    lab[9] = -1;
                    lab[5] = C;
                    td__launch_nll_forward(nullptr, loss, dlp, lab, N, C, mean, bad);
                    CHECK_EQ(*bad, 5);
                }
            }
    float *loss = td__emu::alloc<float>(1, "loss");
    unsigned long long *bad = td__emu::alloc<unsigned long long>(1, "bad");
    td__launch_nll_forward(nullptr, loss, td__emu::alloc<float>(0, "logp"),
                           td__emu::alloc<int64_t>(0, "labels"), 0, 5, 1, bad);
    CHECK(std::isnan(*loss));
}

/* Three inputs side by side along dim 1 and back, written and added. */
template <typename T> static void concat_case(void) {
    for (int N : {1, 3})
        for (size_t inner : {(size_t)1, (size_t)7}) {
            const int C[3] = {1, 5, 2};
            size_t row = 8 * inner, at = 0;
            std::vector<float> xs[3], want(N * row), out_old = values(N * row);
            T *dev[3];
            const float *xp[3];
            T *y = td__emu::alloc<T>(N * row, "y");
            for (int k = 0; k < 3; k++) {
                xs[k] = values((size_t)N * C[k] * inner);
                dev[k] = to_device<T>(xs[k], "x");
                xp[k] = xs[k].data();
                size_t w = C[k] * inner;
                td__launch_concat_rows<T>(nullptr, y, row, at, dev[k], w, 0, (size_t)N, w, 0.f);
                at += w;
            }
            td__ref_concat_forward(want.data(), xp, C, 3, N, inner);
            CHECK_CLOSE(to_host(y, N * row).data(), want.data(), N * row, 0);
            at = 0;
            for (int k = 0; k < 3; k++) { /* backward into the inputs' old values: added */
                size_t w = C[k] * inner;
                std::vector<float> wk(xs[k].size());
                float *dk = wk.data();
                td__launch_concat_rows<T>(nullptr, dev[k], w, 0, y, row, at, (size_t)N, w, 1.f);
                float *outs[3] = {NULL, NULL, NULL};
                outs[k] = dk;
                td__ref_concat_backward(outs, want.data(), C, 3, N, inner);
                for (size_t i = 0; i < wk.size(); i++) wk[i] += xs[k][i];
                CHECK_CLOSE(to_host(dev[k], wk.size()).data(), wk.data(), wk.size(), tol_of<T>());
                at += w;
            }
        }
}

static void concat_f32(void) { concat_case<float>(); }
static void concat_bf16(void) { concat_case<__nv_bfloat16>(); }
static void concat_f16(void) { concat_case<__half>(); }

/* L2 normalisation of rows, some shorter than eps (clamped), and none, against the formula in
 * double. */
static void normalize_rows(void) {
    float eps = 1e-3f;
    for (unsigned N : {0u, 1u, 4u})
        for (int64_t D : {1, 3, 300}) {
            size_t n = N * (size_t)D;
            std::vector<float> x = values(n), dy = values(n), old = values(n);
            if (N > 1)
                for (int64_t j = 0; j < D; j++) x[D + j] *= 1e-6f; /* row 1 is clamped */
            float *dx_ = to_device<float>(x, "x"), *ddy = to_device<float>(dy, "dy");
            float *y = td__emu::alloc<float>(n, "y"), *g = to_device<float>(old, "dx");
            double *norms = td__emu::alloc<double>(N, "norms");
            td__launch_norm_forward(nullptr, y, norms, dx_, N, D, eps);
            td__launch_norm_backward(nullptr, g, ddy, dx_, norms, N, D, 1.f);
            std::vector<float> wy(n), wg(n);
            for (unsigned r = 0; r < N; r++) {
                double sq = 0, dot = 0;
                for (int64_t j = 0; j < D; j++) {
                    sq += (double)x[r * D + j] * x[r * D + j];
                    dot += (double)x[r * D + j] * dy[r * D + j];
                }
                double norm = sqrt(sq);
                int clamped = norm < eps;
                if (clamped) norm = eps;
                for (int64_t j = 0; j < D; j++) {
                    size_t i = r * D + j;
                    wy[i] = (float)(x[i] / norm);
                    wg[i] = old[i] + (float)(dy[i] / norm -
                                             (clamped ? 0 : x[i] * dot / (norm * norm * norm)));
                }
            }
            CHECK_CLOSE(y, wy.data(), n, 1e-6);
            CHECK_CLOSE(g, wg.data(), n, 1e-5);
        }
}

/* Masks: element masks from the forward's RNG offset and from each sample's own stream, and
 * channel masks, the same bits as the CPU's Philox words (td_philox4x32, as the CPU op draws
 * them); applied forward and backward as the reference op applies them. */
template <typename T> static void dropout_case(void) {
    float p = 0.3f, scale = 1.f / (1.f - p);
    uint64_t seed = 0x1234abcd;
    td__gpu_rng_key *key = td__emu::alloc<td__gpu_rng_key>(1, "key");
    *key = td__gpu_rng_key{seed, 3, 7, 40};
    for (int by_sample = 0; by_sample < 2; by_sample++)
        for (int channel = 0; channel < 2; channel++) {
            int64_t N = 3, C = 4, HW = 5;
            size_t n = (size_t)(N * C * HW), count = channel ? (size_t)(N * C) : n;
            unsigned char *keep = td__emu::alloc<unsigned char>(count, "keep");
            td__launch_dropout_draw(nullptr, keep, count, N, key, 5, 6, by_sample, p);
            uint64_t per = count / (size_t)N;
            std::vector<uint8_t> want(count);
            for (size_t e = 0; e < count; e++) {
                uint32_t b[4];
                uint64_t w = by_sample ? 6 + e % per : 3 + 5 + e;
                if (by_sample)
                    td_philox4x32_stream(seed, (uint64_t)7 << 32 | (40 + e / per), w >> 2, b);
                else
                    td_philox4x32(seed, w >> 2, b);
                want[e] = td__philox_uniform(b[w & 3]) >= p;
                CHECK_EQ(keep[e], want[e]);
            }
            std::vector<float> x = values(n), dy = values(n), wy(n), wg(n);
            T *dx_ = to_device<T>(x, "x"), *ddy = to_device<T>(dy, "dy");
            T *y = td__emu::alloc<T>(n, "y"), *g = td__emu::alloc<T>(n, "dx");
            td__launch_dropout_apply<T>(nullptr, y, dx_, keep, n, count, scale, 0.f);
            td__launch_dropout_apply<T>(nullptr, g, ddy, keep, n, count, scale, 0.f);
            if (channel) {
                td__ref_dropout2d_forward(wy.data(), x.data(), want.data(), scale, (int)N, (int)C,
                                          (size_t)HW);
                td__ref_dropout2d_backward(wg.data(), dy.data(), want.data(), scale, (int)N, (int)C,
                                           (size_t)HW);
            } else {
                td__ref_dropout_forward(wy.data(), x.data(), want.data(), scale, n);
                td__ref_dropout_backward(wg.data(), dy.data(), want.data(), scale, n);
            }
            CHECK_CLOSE(to_host(y, n).data(), wy.data(), n, tol_of<T>());
            CHECK_CLOSE(to_host(g, n).data(), wg.data(), n, tol_of<T>());
            td__launch_dropout_apply<T>(nullptr, y, dx_, nullptr, n, count, scale, 0.f);
            CHECK_CLOSE(to_host(y, n).data(), x.data(), n, 0); /* no mask: a copy */
        }
    td__launch_dropout_draw(nullptr, nullptr, 0, 0, key, 0, 0, 1, p); /* no samples */
    td__launch_dropout_apply<T>(nullptr, nullptr, nullptr, nullptr, 0, 0, scale, 0.f);
}

static void dropout_f32(void) { dropout_case<float>(); }
static void dropout_bf16(void) { dropout_case<__nv_bfloat16>(); }
static void dropout_f16(void) { dropout_case<__half>(); }

/* Forward (its mean and rstd), dx, and the weight and bias gradients in two stages, with and
 * without weight and bias, over rows fewer than a chunk, more than 1024 chunks of 64 (chunks
 * grow), and none. */
static void layer_norm_rows(void) {
    float eps = 1e-5f;
    for (int64_t rows : {0, 1, 3, 130})
        for (int64_t C : {1, 33, 300})
            for (int affine = 0; affine < 2; affine++) {
                size_t n = (size_t)(rows * C);
                std::vector<float> x = values(n, -2, 2), dy = values(n), w = values(C),
                                   b = values(C);
                std::vector<float> old = values(n), ow = values(C), ob = values(C);
                float *dx_ = to_device<float>(x, "x"), *ddy = to_device<float>(dy, "dy");
                float *dw_ = affine ? to_device<float>(w, "w") : nullptr;
                float *db_ = affine ? to_device<float>(b, "b") : nullptr;
                float *y = td__emu::alloc<float>(n, "y"),
                      *st = td__emu::alloc<float>(2 * rows, "st");
                float *g = to_device<float>(old, "dx"), *gw = to_device<float>(ow, "dw");
                float *gb = to_device<float>(ob, "db");
                float *partial = td__emu::alloc<float>(2 * td__partials(rows) * C, "partial");
                td__launch_ln_forward(nullptr, y, st, st + rows, dx_, dw_, db_, rows, C, eps);
                std::vector<float> wy(n), wm(rows), wr(rows), wg(n), wgw(C), wgb(C);
                td__ref_layer_norm_forward(wy.data(), wm.data(), wr.data(), x.data(),
                                           affine ? w.data() : NULL, affine ? b.data() : NULL, rows,
                                           (int)C, eps);
                CHECK_CLOSE(y, wy.data(), n, 1e-5);
                CHECK_CLOSE(st, wm.data(), rows, 1e-5);
                CHECK_CLOSE(st + rows, wr.data(), rows, 1e-4);
                td__launch_ln_dx(nullptr, g, ddy, dx_, dw_, st, st + rows, rows, C, 1.f);
                td__launch_ln_params(nullptr, gw, gb, partial, ddy, dx_, st, st + rows, rows, C,
                                     1.f, 0.f);
                td__ref_layer_norm_backward(wg.data(), wgw.data(), wgb.data(), dy.data(), x.data(),
                                            affine ? w.data() : NULL, rows, (int)C, eps);
                for (size_t i = 0; i < n; i++) wg[i] += old[i];
                for (int64_t c = 0; c < C; c++) wgw[c] += ow[c];
                CHECK_CLOSE(g, wg.data(), n, 1e-4);
                CHECK_CLOSE(gw, wgw.data(), C, 1e-4);
                CHECK_CLOSE(gb, wgb.data(), C, 1e-4);
            }
    /* 66000 rows: chunks of 65 rows, 1016 of them (the parameters' stages only) */
    int64_t rows = 66000, C = 3;
    size_t n = (size_t)(rows * C);
    std::vector<float> x = values(n), dy = values(n), m(rows), r(rows), wgw(C), wgb(C);
    td__ref_layer_norm_forward(values(n).data(), m.data(), r.data(), x.data(), NULL, NULL, rows,
                               (int)C, 1e-5f);
    float *dx_ = to_device<float>(x, "x"), *ddy = to_device<float>(dy, "dy");
    float *dm = to_device<float>(m, "mean"), *dr = to_device<float>(r, "rstd");
    float *gw = td__emu::alloc<float>(C, "dw"), *gb = td__emu::alloc<float>(C, "db");
    float *partial = td__emu::alloc<float>(2 * td__partials(rows) * C, "partial");
    CHECK(td__partial_rows(rows) > 64);
    td__launch_ln_params(nullptr, gw, gb, partial, ddy, dx_, dm, dr, rows, C, 0.f, 0.f);
    for (int64_t c = 0; c < C; c++) {
        double sw = 0, sb = 0;
        for (int64_t i = 0; i < rows; i++) {
            sw += (double)dy[i * C + c] * (x[i * C + c] - m[i]) * r[i];
            sb += dy[i * C + c];
        }
        CHECK_NEAR(gw[c], sw, 1e-3);
        CHECK_NEAR(gb[c], sb, 1e-3);
    }
}

/* The CPU's sum for a table element in a low dtype: each step rounded, in order. */
template <typename T> static float rounded_sum(float acc, float add) {
    T t;
    td_st(&t, 0, acc + add);
    return td_ld(&t, 0);
}

/* Token lookups from i64, i32 and f32 ids, a bad id giving a zero row and its position, and the
 * table's gradient in token order (each step rounded to T); tables of 1, 5 and 3000 rows (3 a
 * block). Position embeddings forward and backward, the rows past T taking none. */
template <typename T> static void embedding_case(void) {
    for (int64_t V : {1, 5, 3000})
        for (int64_t C : {1, 64})
            for (td_dtype idt : {TD_I64, TD_I32, TD_F32}) {
                size_t n = 300;
                std::vector<float> table = values((size_t)(V * C)), dy = values(n * (size_t)C);
                T *dt_ = to_device<T>(table, "table"), *ddy = to_device<T>(dy, "dy");
                char *ids = td__emu::alloc<char>(n * td_dtype_size(idt), "ids");
                std::vector<int64_t> idx(n);
                for (size_t i = 0; i < n; i++) {
                    idx[i] = td_rng_below(&rng, (uint32_t)V);
                    td_st_dt(ids, idt, i, (double)idx[i]);
                }
                td_st_dt(ids, idt, 7, (double)V); /* out of the table */
                if (idt == TD_F32) td_st_dt(ids, idt, 3, 0.5);
                size_t first_bad = idt == TD_F32 ? 3 : 7;
                T *y = td__emu::alloc<T>(n * (size_t)C, "y");
                unsigned long long *bad = td__emu::alloc<unsigned long long>(1, "bad");
                *bad = ~0ull;
                td__launch_token_forward<T>(nullptr, y, dt_, ids, idt, n, V, C, bad);
                CHECK_EQ(*bad, first_bad);
                for (size_t i = 0; i < n; i++)
                    for (int64_t c = 0; c < C; c++) {
                        float got = td_ld(y, i * C + c);
                        int ok = i == 7 || (idt == TD_F32 && i == 3)
                                     ? got == 0.f
                                     : got == table[(size_t)(idx[i] * C + c)];
                        if (!ok) {
                            TEST_FAIL_AT("token %zu column %lld: %g", i, (long long)c, got);
                            i = n;
                            break;
                        }
                    }
                std::vector<float> old = values((size_t)(V * C)), want = old;
                T *g = to_device<T>(old, "dtable");
                want = old;
                td__launch_token_backward<T>(nullptr, g, ddy, ids, idt, n, V, C, 1.f);
                for (size_t i = 0; i < n; i++) {
                    if (i == 7 || (idt == TD_F32 && i == 3)) continue;
                    for (int64_t c = 0; c < C; c++) {
                        float &a = want[(size_t)(idx[i] * C + c)];
                        a = rounded_sum<T>(a, dy[i * C + c]);
                    }
                }
                CHECK_CLOSE(to_host(g, want.size()).data(), want.data(), want.size(), 0);
            }
    int S = 3, Tn = 5, C = 7, V = 8;
    size_t n = (size_t)(S * Tn * C);
    std::vector<float> x = values(n), table = values((size_t)(V * C)), dy = values(n), wy(n);
    T *dx_ = to_device<T>(x, "x"), *dtab = to_device<T>(table, "table"),
      *ddy = to_device<T>(dy, "dy");
    T *y = td__emu::alloc<T>(n, "y");
    td__launch_position_forward<T>(nullptr, y, dx_, dtab, n, Tn, C);
    for (size_t i = 0; i < n; i++) wy[i] = rounded_sum<T>(x[i], table[i % (size_t)(Tn * C)]);
    CHECK_CLOSE(to_host(y, n).data(), wy.data(), n, 0);
    std::vector<float> old = values((size_t)(V * C)), want((size_t)(V * C), 0.f);
    T *g = to_device<T>(old, "dtable");
    td__launch_position_backward<T>(nullptr, g, ddy, n, Tn, C, V, 1.f);
    for (int64_t e = 0; e < V * C; e++) {
        float acc = old[e];
        for (int s = 0; e < Tn * C && s < S; s++) acc = rounded_sum<T>(acc, dy[s * Tn * C + e]);
        want[e] = acc;
    }
    CHECK_CLOSE(to_host(g, want.size()).data(), want.data(), want.size(), 0);
}

static void embedding_f32(void) { embedding_case<float>(); }
static void embedding_bf16(void) { embedding_case<__nv_bfloat16>(); }
static void embedding_f16(void) { embedding_case<__half>(); }

/* Causal attention forward and backward against the reference, heads whose tiles are 32, 16
 * and 8 positions, sequences shorter and longer than a tile and not a multiple of it, none. */
template <typename T>
static void attention_case(int64_t B, int64_t Tn, int64_t H, int64_t hs, double tol) {
    td__att_shape a = {B, Tn, H * hs, H, hs, td__att_tile(hs)};
    size_t nq = (size_t)(B * Tn * 3 * a.C), ny = (size_t)(B * Tn * a.C),
           rows = (size_t)(B * H * Tn);
    std::vector<float> qkv = values(nq, -1, 1), dy = values(ny), old = values(nq);
    T *dq = to_device<T>(qkv, "qkv"), *ddy = to_device<T>(dy, "dy"), *g = to_device<T>(old, "dqkv");
    T *y = td__emu::alloc<T>(ny, "y");
    float *lse = td__emu::alloc<float>(rows, "lse"), *D = td__emu::alloc<float>(rows, "D");
    td__launch_att_forward<T>(nullptr, &a, y, lse, dq);
    td__launch_att_backward<T>(nullptr, &a, g, D, ddy, y, dq, lse, 1.f);
    std::vector<float> wy(ny), wg(nq);
    td__ref_attention_forward(wy.data(), qkv.data(), (int)B, (int)Tn, (int)a.C, (int)H);
    td__ref_attention_backward(wg.data(), dy.data(), qkv.data(), (int)B, (int)Tn, (int)a.C, (int)H);
    for (size_t i = 0; i < nq; i++) wg[i] += old[i];
    CHECK_CLOSE(to_host(y, ny).data(), wy.data(), ny, tol);
    CHECK_CLOSE(to_host(g, nq).data(), wg.data(), nq, 3 * tol);
}

static void attention_tiles(void) {
    attention_case<float>(1, 1, 1, 8, 1e-5);
    attention_case<float>(2, 33, 2, 8, 1e-5);   /* tile 32: two tiles, the second of 1 */
    attention_case<float>(1, 40, 1, 64, 1e-5);  /* tile 16 */
    attention_case<float>(1, 17, 2, 128, 1e-5); /* tile 8, 3 tiles */
    attention_case<float>(0, 5, 2, 8, 0);
    attention_case<__nv_bfloat16>(1, 20, 2, 16, 3e-2);
    attention_case<__half>(1, 20, 2, 16, 5e-3);
}

/* Batch norm's own kernels: eval backward (dx; weight and bias gradients per channel) against
 * the reference, the folded ReLU's mask, and no channels. */
template <typename T> static void batch_norm_case(void) {
    double tol = std::is_same<T, float>::value ? 1e-5 : 2 * tol_of<T>();
    for (int64_t C : {0, 3, 300}) {
        int64_t N = 2, HW = 5;
        size_t n = (size_t)(N * C * HW);
        float eps = 1e-5f;
        std::vector<float> x = values(n), dy = values(n), w = values(C), rm = values(C);
        std::vector<float> rv = values(C, 0.5f, 2.f), old = values(n), ow = values(C),
                           ob = values(C);
        T *dx_ = to_device<T>(x, "x"), *ddy = to_device<T>(dy, "dy"), *g = to_device<T>(old, "dx");
        float *dw_ = to_device<float>(w, "w"), *drm = to_device<float>(rm, "rm");
        float *drv = to_device<float>(rv, "rv");
        float *gw = to_device<float>(ow, "dw"), *gb = to_device<float>(ob, "db");
        td__launch_bn_eval_dx<T>(nullptr, g, ddy, dw_, drv, eps, N, C, HW, 1.f);
        td__launch_bn_eval_params<T>(nullptr, gw, gb, 1.f, 0.f, ddy, dx_, drm, drv, eps, N, C, HW);
        std::vector<float> wg(n), wgw(C), wgb(C);
        td__ref_batchnorm2d_backward_eval(wg.data(), wgw.data(), wgb.data(), dy.data(), x.data(),
                                          rm.data(), rv.data(), w.data(), (int)N, (int)C, (int)HW,
                                          eps);
        for (size_t i = 0; i < n; i++) wg[i] += old[i];
        for (int64_t c = 0; c < C; c++) wgw[c] += ow[c];
        CHECK_CLOSE(to_host(g, n).data(), wg.data(), n, tol);
        CHECK_CLOSE(gw, wgw.data(), C, 1e-5);
        CHECK_CLOSE(gb, wgb.data(), C, 1e-5);
        T *mask = td__emu::alloc<T>(n, "mask");
        td__launch_bn_relu_mask<T>(nullptr, mask, ddy, dx_, n);
        for (size_t i = 0; i < n; i++)
            CHECK_EQ(td__f32_bits(td_ld(mask, i)), td__f32_bits(x[i] > 0 ? dy[i] : 0.f));
    }
}

static void batch_norm_eval(void) {
    batch_norm_case<float>();
    batch_norm_case<__nv_bfloat16>();
    batch_norm_case<__half>();
}

/* A convolution's bias added per channel and its gradient, and no channels. */
template <typename T> static void conv_bias_case(void) {
    for (int64_t C : {0, 5, 300}) {
        int64_t N = 2, HW = 7;
        size_t n = (size_t)(N * C * HW);
        std::vector<float> y = values(n), b = values(C), dy = values(n), old = values(C);
        T *dy_ = to_device<T>(y, "y"), *db_ = to_device<T>(b, "b"), *ddy = to_device<T>(dy, "dy");
        T *g = to_device<T>(old, "db");
        td__launch_conv_bias_add<T>(nullptr, dy_, db_, N, C, HW);
        td__launch_conv_bias_grad<T>(nullptr, g, ddy, N, C, HW, 1.f);
        std::vector<float> wy(n), wg(C);
        for (size_t i = 0; i < n; i++) wy[i] = y[i] + b[(i / HW) % C];
        for (int64_t c = 0; c < C; c++) {
            double s = old[c];
            for (int64_t k = 0; k < N * HW; k++) s += dy[(k / HW * C + c) * HW + k % HW];
            wg[c] = (float)s;
        }
        CHECK_CLOSE(to_host(dy_, n).data(), wy.data(), n, tol_of<T>());
        CHECK_CLOSE(to_host(g, C).data(), wg.data(), C, 2 * tol_of<T>());
    }
}

static void conv2d_bias(void) {
    conv_bias_case<float>();
    conv_bias_case<__nv_bfloat16>();
    conv_bias_case<__half>();
}

/* A linear's bias gradient, the column sums of dy in two stages, over batches of one row, of
 * fewer rows than a chunk, of more than 1024 chunks of 64 (chunks grow), every float dtype. */
template <typename T> static void column_sum_case(void) {
    for (int64_t rows : {1, 100, 70000})
        for (int64_t cols : {1, 33, 300}) {
            if (rows * cols > 2000000) continue;
            size_t n = (size_t)(rows * cols);
            std::vector<float> dy = values(n), old = values(cols);
            T *ddy = to_device<T>(dy, "dy"), *g = to_device<T>(old, "db");
            float *partial = td__emu::alloc<float>(td__partials(rows) * cols, "partial");
            td__launch_column_sum<T>(nullptr, g, partial, ddy, rows, cols, 1.f);
            std::vector<float> want(cols);
            for (int64_t c = 0; c < cols; c++) {
                double s = old[c];
                for (int64_t r = 0; r < rows; r++) s += dy[r * cols + c];
                want[c] = (float)s;
            }
            CHECK_CLOSE(to_host(g, cols).data(), want.data(), cols,
                        (std::is_same<T, float>::value ? 1e-5 : 2 * tol_of<T>()) * sqrt(rows));
        }
}

static void linear_bias_grad(void) {
    column_sum_case<float>();
    column_sum_case<__nv_bfloat16>();
    column_sum_case<__half>();
}

int main(void) {
    td_rng_init(&rng, 1234);
    RUN_ISOLATED(device_convert);
    RUN_ISOLATED(device_fill);
    RUN_ISOLATED(device_channels);
    RUN_ISOLATED(optim_sgd);
    RUN_ISOLATED(optim_sgd_nesterov);
    RUN_ISOLATED(optim_adamw);
    RUN_ISOLATED(optim_norm_scale);
    RUN_ISOLATED(ipc_reduce);
    RUN_ISOLATED(eltwise_f32);
    RUN_ISOLATED(eltwise_bf16);
    RUN_ISOLATED(eltwise_f16);
    RUN_ISOLATED(relu_nan_as_the_cpu_op);
    RUN_ISOLATED(softmax_rows);
    RUN_ISOLATED(nll_loss_labels);
    RUN_ISOLATED(concat_f32);
    RUN_ISOLATED(concat_bf16);
    RUN_ISOLATED(concat_f16);
    RUN_ISOLATED(normalize_rows);
    RUN_ISOLATED(dropout_f32);
    RUN_ISOLATED(dropout_bf16);
    RUN_ISOLATED(dropout_f16);
    RUN_ISOLATED(layer_norm_rows);
    RUN_ISOLATED(embedding_f32);
    RUN_ISOLATED(embedding_bf16);
    RUN_ISOLATED(embedding_f16);
    RUN_ISOLATED(attention_tiles);
    RUN_ISOLATED(batch_norm_eval);
    RUN_ISOLATED(conv2d_bias);
    RUN_ISOLATED(linear_bias_grad);
    TEST_END();
}
