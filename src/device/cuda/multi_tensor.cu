/* The multi-tensor kernels of src/device/multi_tensor.h on a GPU: the list and the launch's
 * scratch go to the device, the kernels (multi_tensor.cuh) run on the stream given, and the
 * operations with a result wait for it. */
#include "device/cuda/multi_tensor.cuh"
#include "device/cuda/runtime.cuh"

/* Scratch layout: the list, then the flag (8 bytes), then one double per chunk. */
td_status td__cu_multi_tensor(td_device d, void *stream, const td__mt_args *args,
                              td__mt_tensor *list, size_t n, void **scratch, size_t *scratch_bytes,
                              double *result) {
    uint64_t chunks;
    size_t kept = td__mt_plan(args, list, n, &chunks);
    if (result) *result = 0;
    if (kept == 0) return TD_OK;
    if (chunks > 0x7fffffffu)
        return td__host->fail(TD_EINVAL,
                              "multi-tensor kernel: %llu chunks are too many for one "
                              "launch",
                              (unsigned long long)chunks);
    size_t list_bytes = (kept * sizeof *list + 7) & ~(size_t)7;
    size_t need = list_bytes + 8 + chunks * sizeof(double);
    cudaStream_t s = (cudaStream_t)stream;
    if (*scratch_bytes < need) {
        if (*scratch) td__host->free(d, *scratch);
        *scratch = NULL;
        *scratch_bytes = 0;
        td_status st = td__host->alloc(d, need, scratch);
        if (st != TD_OK) return st;
        *scratch_bytes = need;
    }
    char *base = (char *)*scratch;
    int *flag = (int *)(base + list_bytes);
    double *partials = (double *)(base + list_bytes + 8);
    TD__CU(cudaSetDevice(d.index));
    TD__CU(cudaMemcpyAsync(base, list, kept * sizeof *list, cudaMemcpyHostToDevice, s));
    if (args->op == TD__MT_UNSCALE) TD__CU(cudaMemsetAsync(flag, 0, sizeof(int), s));
    td__launch_multi_tensor(s, args, (const td__mt_tensor *)base, kept, chunks, partials, flag);
    TD__CU(cudaGetLastError());
    if (args->op == TD__MT_SQUARES) {
        TD__CU(cudaMemcpyAsync(result, partials, sizeof(double), cudaMemcpyDeviceToHost, s));
        TD__CU(cudaStreamSynchronize(s));
    } else if (args->op == TD__MT_UNSCALE) {
        int f = 0;
        TD__CU(cudaMemcpyAsync(&f, flag, sizeof f, cudaMemcpyDeviceToHost, s));
        TD__CU(cudaStreamSynchronize(s));
        *result = f;
    }
    return TD_OK;
}
