/* Per-channel kernels over an f32 (N, C, S) tensor, for ops whose statistics cross ranks and so
 * are summed by the host's process group between kernels (SyncBatchNorm,
 * src/ops/sync_batch_norm_device.c): the sums of a channel, and an affine map per channel.
 * Queued on the stream given; the kernels are in channels.cuh. */
#include "device/cuda/channels.cuh"
#include "device/cuda/runtime.cuh"

td_status td__cu_channel_sums(int device, void *stream, const float *x, const float *dy,
                              const float *mean, int64_t N, int64_t C, int64_t S, double *s) {
    if (C == 0) return TD_OK;
    if (C > INT32_MAX)
        return td__host->fail(TD_EINVAL, "channel sums: %lld channels", (long long)C);
    TD__CU(cudaSetDevice(device));
    td__launch_channel_sums((cudaStream_t)stream, x, dy, mean, N, C, S, s);
    TD__CU(cudaGetLastError());
    return TD_OK;
}

td_status td__cu_channel_affine(int device, void *stream, float *out, const float *in,
                                const float *coef, const float *extra, int64_t N, int64_t C,
                                int64_t S) {
    if (N * C * S == 0) return TD_OK;
    TD__CU(cudaSetDevice(device));
    td__launch_channel_affine((cudaStream_t)stream, out, in, coef, extra, N, C, S);
    TD__CU(cudaGetLastError());
    return TD_OK;
}
