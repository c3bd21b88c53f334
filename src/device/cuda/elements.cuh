/* The kernels of elements.cu and their launches: converting n elements between dtypes, and
 * filling n elements of 2 or 4 bytes with a bit pattern. Compiles for a GPU and under the CPU's
 * emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_ELEMENTS_CUH
#define TANDEM_CUDA_ELEMENTS_CUH

#include "device/cuda/dtype.cuh"

static __global__ void __launch_bounds__(TD__THREADS)
    td__convert_kernel(void *dst, int dt, const void *src, int st, size_t n) {
    TD__GRID_STRIDE(i, n) td_st_dt(dst, dt, i, td_ld_dt(src, st, i));
}

static __global__ void __launch_bounds__(TD__THREADS)
    td__fill_kernel(unsigned char *p, uint32_t bits, int size, size_t n) {
    TD__GRID_STRIDE(i, n) {
        if (size == 2)
            ((uint16_t *)p)[i] = (uint16_t)bits;
        else
            ((uint32_t *)p)[i] = bits;
    }
}

/* dst (n elements of dtype dt) = src (n elements of dtype st), on stream s. */
static inline void td__launch_convert(cudaStream_t s, void *dst, int dt, const void *src, int st,
                                      size_t n) {
    if (n) td__launch<td__convert_kernel>(td__blocks(n), 0, s, dst, dt, src, st, n);
}

/* n elements of `size` bytes (2 or 4) at p set to bits, on stream s. */
static inline void td__launch_fill(cudaStream_t s, void *p, uint32_t bits, int size, size_t n) {
    if (n) td__launch<td__fill_kernel>(td__blocks(n), 0, s, (unsigned char *)p, bits, size, n);
}

#endif
