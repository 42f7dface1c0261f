// What the selection kernels share with kernels that read host rows or sort a block's keys
// (method-kernels/cuda/hip.cu includes it): the fp8 row decode, a float's order-preserving key
// and a block-wide bitonic sort. Included, not compiled on its own.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// Scores a one-block top-k (topk_small) sorts in shared memory.
#define SMALL_MAX 2048

__device__ __forceinline__ uint32_t sortable(float f) {
    const uint32_t u = __float_as_uint(f);
    return u ^ ((u >> 31) ? 0xffffffffu : 0x80000000u);
}

// Sorts keys[0..p) (p a power of two) in shared memory, descending or ascending, with all the
// block's threads; the caller syncs before reading the result.
template <typename K>
__device__ void bitonic_sort(K* keys, int p, bool descending) {
    for (int size = 2; size <= p; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = threadIdx.x; i < p / 2; i += blockDim.x) {
                const int lo = 2 * stride * (i / stride) + i % stride, hi = lo + stride;
                // Runs alternate direction until the last merge, which goes the asked way.
                const bool down = ((lo & size) == 0) == descending;
                const K a = keys[lo], b = keys[hi];
                if ((a < b) == down && a != b) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
        }
    }
}

// An fp8 e4m3 code as the context file decodes it: widened to half (exact), times its row's scale.
__device__ __forceinline__ float fp8_value(__nv_fp8_storage_t code, float scale) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3))) * scale;
}
