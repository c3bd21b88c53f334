/* All-reduce on device memory, nccl-tests style: f32 SUM in place from 4 KB to 256 MB (x4
 * steps; --max-bytes), at world 1 (NCCL, a GPU of its own) and at worlds 2 and 4 with every
 * rank on cuda:0 (CUDA IPC: NCCL refuses ranks that share a GPU), each through td_comm with
 * the group's own choice of path, which the table names. algbw = bytes / time and busbw =
 * algbw * 2(n-1)/n; a call's time is the slowest rank's, the median over its calls.
 *
 * Beside each size, the GPU's own device-to-device copy of the same bytes (cudaMemcpyAsync and
 * a wait, as td_device_copy does), measured in the same run by rank 0 alone, and the roofline
 * it sets for ranks that share that GPU's memory: an all-reduce of S bytes over n buffers in
 * one memory must read every buffer and write every buffer at least once, 2nS bytes of
 * traffic where the copy moves 2S, so it takes at least n copies' time: algbw <= copy / n,
 * busbw <= copy * 2(n-1)/n^2 (0.5 copy at n = 2, 0.375 at n = 4). "of roofline" is busbw over
 * that bound. At world 1 busbw is 0 by definition and algbw is the column to read (NCCL's
 * in-place all-reduce of one rank is no copy at all).
 *
 *   build/bench/allreduce_gpu [--worlds 1,2,4] [--max-bytes N] [--iters K] [--json]
 *
 * Where no GPU is visible it says why and exits 0 without measuring. The parent never starts
 * CUDA: the ranks are forked. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/device.h"

#include "bench.h"

#define MAX_SIZES 16

typedef struct {
    size_t max_bytes;
    int iters, json;
} options;

typedef struct {
    int n;                    /* sizes measured */
    size_t bytes[MAX_SIZES];  /* per size */
    double coll_s[MAX_SIZES]; /* median all-reduce time, the slowest rank's */
    double copy_s[MAX_SIZES]; /* median device-to-device copy time (rank 0) */
    char path[16];            /* the group's device path */
    char gpu[256];
} result;

/* Calls of one size: fewer for the largest, so that the whole sweep stays short. */
static int calls_for(size_t bytes, int iters) {
    int k = bytes >= ((size_t)64 << 20) ? iters / 4 : iters;
    return k < 3 ? 3 : k;
}

static int rank_main(int rank, int world, void *out, void *arg) {
    const options *o = arg;
    result *res = out;
    (void)world;
    memset(res, 0, sizeof *res);
    td_comm_params cp = td_comm_default_params();
    cp.backend = TD_BACKEND_SHM;
    td_comm *w = NULL;
    CHECK(td_comm_create(&w, &cp));
    td_device d = td_device_cuda(0);
    td_device_properties props;
    CHECK(td_device_get_properties(d, &props));
    snprintf(res->gpu, sizeof res->gpu, "%s", props.name);
    size_t count = o->max_bytes / sizeof(float);
    float *host = malloc(count * sizeof *host);
    for (size_t i = 0; i < count; i++) host[i] = (float)((i + (size_t)rank) % 5);
    void *buf = NULL, *copy = NULL;
    CHECK(td_device_alloc(d, count * sizeof *host, &buf));
    CHECK(td_device_copy(d, buf, td_device_cpu(), host, count * sizeof *host));
    if (rank == 0) CHECK(td_device_alloc(d, count * sizeof *host, &copy));
    double *times = malloc((size_t)(o->iters + 4) * sizeof *times);
    for (size_t bytes = 4096; bytes <= o->max_bytes && res->n < MAX_SIZES; bytes *= 4) {
        size_t n = bytes / sizeof(float);
        int calls = calls_for(bytes, o->iters);
        for (int k = 0; k < 2; k++) CHECK(td_comm_allreduce(w, buf, buf, n, TD_F32, TD_OP_SUM));
        for (int k = 0; k < calls; k++) {
            CHECK(td_comm_barrier(w));
            uint64_t t0 = td_time_ns();
            CHECK(td_comm_allreduce(w, buf, buf, n, TD_F32, TD_OP_SUM));
            double t = (double)(td_time_ns() - t0) / 1e9;
            CHECK(td_comm_allreduce(w, &t, &t, 1, TD_F64, TD_OP_MAX));
            times[k] = t;
        }
        res->bytes[res->n] = bytes;
        res->coll_s[res->n] = bench_median(times, calls);
        /* The ceiling, with the other ranks waiting at the barrier. */
        if (rank == 0) {
            CHECK(td_device_copy(d, copy, d, buf, bytes));
            for (int k = 0; k < calls; k++) {
                uint64_t t0 = td_time_ns();
                CHECK(td_device_copy(d, copy, d, buf, bytes));
                times[k] = (double)(td_time_ns() - t0) / 1e9;
            }
            res->copy_s[res->n] = bench_median(times, calls);
        }
        CHECK(td_comm_barrier(w));
        res->n++;
    }
    snprintf(res->path, sizeof res->path, "%s", td_comm_device_path(w));
    free(times);
    free(host);
    CHECK(td_device_free(d, buf));
    if (copy) CHECK(td_device_free(d, copy));
    td_comm_destroy(w);
    return 0;
}

static void print_world(int world, const result *r, const options *o) {
    double factor = world > 1 ? 2.0 * (world - 1) / world : 0.0;
    if (!o->json) {
        printf("\nworld %d on cuda:0 (%s), path %s\n", world, r->gpu, r->path);
        printf("%10s %11s %11s %11s %11s %10s %11s\n", "bytes", "time us", "algbw GB/s",
               "busbw GB/s", "copy GB/s", "busbw/copy", "of roofline");
    }
    for (int i = 0; i < r->n; i++) {
        double alg = (double)r->bytes[i] / r->coll_s[i] / 1e9;
        double copy = (double)r->bytes[i] / r->copy_s[i] / 1e9;
        double bus = alg * factor;
        /* the bound above; world 1 copies nothing at all, so it has none */
        double roof = world > 1 ? copy * 2.0 * (world - 1) / ((double)world * world) : 0.0;
        if (o->json)
            printf("{\"bench\":\"allreduce_gpu\",\"gpu\":\"%s\",\"world\":%d,\"path\":\"%s\","
                   "\"bytes\":%zu,\"time_us\":%.3f,\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f,"
                   "\"copy_gbs\":%.3f,\"busbw_over_copy\":%.4f,\"of_roofline\":%.4f}\n",
                   r->gpu, world, r->path, r->bytes[i], r->coll_s[i] * 1e6, alg, bus, copy,
                   bus / copy, roof > 0 ? bus / roof : 0.0);
        else if (roof > 0)
            printf("%10zu %11.1f %11.2f %11.2f %11.2f %9.2fx %10.2fx\n", r->bytes[i],
                   r->coll_s[i] * 1e6, alg, bus, copy, bus / copy, bus / roof);
        else
            printf("%10zu %11.1f %11.2f %11.2f %11.2f %9.2fx %11s\n", r->bytes[i],
                   r->coll_s[i] * 1e6, alg, bus, copy, alg / copy, "-");
    }
}

int main(int argc, char **argv) {
    options o = {.max_bytes = (size_t)256 << 20, .iters = 20, .json = 0};
    int worlds[8] = {1, 2, 4}, n_worlds = 3;
    long max_bytes = (long)o.max_bytes;
    td_args a;
    td_args_init(&a, "allreduce_gpu", argc, argv);
    while (td_args_next(&a)) {
        td_args_int_list(&a, "--worlds", 1, 8, worlds, 8, &n_worlds);
        td_args_long(&a, "--max-bytes", 4096, LONG_MAX, &max_bytes);
        td_args_int(&a, "--iters", 1, INT_MAX, &o.iters);
        td_args_flag(&a, "--json", &o.json);
    }
    bench_args_finish(&a, "usage: allreduce_gpu [--worlds 1,2,4] [--max-bytes N] [--iters K] "
                          "[--json]\n");
    o.max_bytes = (size_t)max_bytes;
    if (bench_gpus("allreduce_gpu") == 0) return 0;
    char cpu[256];
    if (!o.json)
        printf("allreduce_gpu: f32 sum in place on device memory; host %s; %d calls a size "
               "(a quarter from 64 MB)\n",
               bench_cpu_name(cpu, sizeof cpu), o.iters);
    for (int w = 0; w < n_worlds; w++) {
        int world = worlds[w];
        result res[8];
        if (bench_ranks(world, 0, rank_main, &o, res, sizeof res[0]) != 0) {
            fprintf(stderr, "allreduce_gpu: world %d failed\n", world);
            return 1;
        }
        print_world(world, &res[0], &o);
        fflush(stdout);
    }
    return 0;
}
