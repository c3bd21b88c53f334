/* Elements of every dtype in device code, for every CUDA file of libtandem_cuda.so: typed
 * loads and stores through f32 (td_ld, td_st) and loads and stores by a td_dtype known only at
 * run time through double (td_ld_dt, td_st_dt). Floats round to nearest even on store, as the
 * host's td__convert does; integers go through int64, so u8 wraps. CUDA C++ (and the CPU's
 * emulation of it, device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_DTYPE_CUH
#define TANDEM_CUDA_DTYPE_CUH

#include "tandem/core.h"

#include "device/cuda/kernel.cuh"

/* Elements as f32, whatever their float dtype. */
template <typename T> __device__ __forceinline__ float td_ld(const T *p, size_t i);
template <> __device__ __forceinline__ float td_ld(const float *p, size_t i) { return p[i]; }
template <> __device__ __forceinline__ float td_ld(const __nv_bfloat16 *p, size_t i) {
    return __bfloat162float(p[i]);
}
template <> __device__ __forceinline__ float td_ld(const __half *p, size_t i) {
    return __half2float(p[i]);
}
template <typename T> __device__ __forceinline__ void td_st(T *p, size_t i, float v);
template <> __device__ __forceinline__ void td_st(float *p, size_t i, float v) { p[i] = v; }
template <> __device__ __forceinline__ void td_st(__nv_bfloat16 *p, size_t i, float v) {
    p[i] = __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ void td_st(__half *p, size_t i, float v) {
    p[i] = __float2half_rn(v);
}

/* Element i of p, of dtype dt, as a double. */
__device__ __forceinline__ double td_ld_dt(const void *p, int dt, size_t i) {
    switch (dt) {
    case TD_F32:
        return ((const float *)p)[i];
    case TD_F64:
        return ((const double *)p)[i];
    case TD_BF16:
        return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case TD_F16:
        return __half2float(((const __half *)p)[i]);
    case TD_I32:
        return ((const int32_t *)p)[i];
    case TD_I64:
        return (double)((const int64_t *)p)[i];
    default:
        return ((const uint8_t *)p)[i];
    }
}

/* Stores v as element i of p, of dtype dt (16-bit floats through f32). */
__device__ __forceinline__ void td_st_dt(void *p, int dt, size_t i, double v) {
    switch (dt) {
    case TD_F32:
        ((float *)p)[i] = (float)v;
        break;
    case TD_F64:
        ((double *)p)[i] = v;
        break;
    case TD_BF16:
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v);
        break;
    case TD_F16:
        ((__half *)p)[i] = __float2half_rn((float)v);
        break;
    case TD_I32:
        ((int32_t *)p)[i] = (int32_t)(int64_t)v;
        break;
    case TD_I64:
        ((int64_t *)p)[i] = (int64_t)v;
        break;
    default:
        ((uint8_t *)p)[i] = (uint8_t)(int64_t)v;
        break;
    }
}

#endif
