// A projection's output rows [t][n * hd] (plus its bias, when the model has one) as the heads
// attention reads, [n][t][hd], in one pass; and attention's output heads back as rows for the
// output projection. bf16 in and out.
// CPU references: heads::reference and heads::merge_reference (candle's broadcast add,
// reshape, transpose and copy); kernels/tests/heads.rs holds these kernels to them bit for bit
// on fresh random inputs.
//
// Why: candle adds the bias in one pass and moves the heads in another, through its general
// strided copy (an index computed per element); here each thread moves one 16-byte vector of
// a head's row. The bias is added as candle adds two bf16 values (`+` on __nv_bfloat16).
//
// split: out[h][i][d] = y[i][h * hd + d] (+ bias[h * hd + d]); merge: out[i][h * hd + d] =
// a[h][i][d]. hd % VEC == 0.

#include <cuda_bf16.h>
#include <stdint.h>

#define VEC 8  // bf16 values in 16 bytes

template <bool BIAS>
__device__ __forceinline__ void split_heads(const __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ bias,
                                            __nv_bfloat16* __restrict__ out, int t, int n, int hd) {
    const long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = hd / VEC;
    if (v >= (long long)t * n * per_row) return;
    // Output order: head, row, vector (coalesced writes).
    const int c = (int)(v % per_row);
    const long long hi = v / per_row;
    const int i = (int)(hi % t), h = (int)(hi / t);
    const int col = h * hd + c * VEC;
    uint4 x = *reinterpret_cast<const uint4*>(y + (size_t)i * n * hd + col);
    if (BIAS) {
        const uint4 b = *reinterpret_cast<const uint4*>(bias + col);
        __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(&x);
        const __nv_bfloat16* bs = reinterpret_cast<const __nv_bfloat16*>(&b);
#pragma unroll
        for (int e = 0; e < VEC; e++) xs[e] = xs[e] + bs[e];
    }
    *reinterpret_cast<uint4*>(out + ((size_t)h * t + i) * hd + c * VEC) = x;
}

// grid ceil(t * n * hd / VEC / blockDim.x); y, bias and out 16-byte aligned.
extern "C" __global__ void split_heads_bf16(const __nv_bfloat16* y, __nv_bfloat16* out, int t, int n, int hd) {
    split_heads<false>(y, nullptr, out, t, n, hd);
}
extern "C" __global__ void split_heads_bias_bf16(const __nv_bfloat16* y, const __nv_bfloat16* bias,
                                                 __nv_bfloat16* out, int t, int n, int hd) {
    split_heads<true>(y, bias, out, t, n, hd);
}

// grid ceil(t * n * hd / VEC / blockDim.x); a and out 16-byte aligned.
extern "C" __global__ void merge_heads_bf16(const __nv_bfloat16* __restrict__ a, __nv_bfloat16* __restrict__ out,
                                            int t, int n, int hd) {
    const long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = hd / VEC;
    if (v >= (long long)t * n * per_row) return;
    // Output order: row, head, vector (coalesced writes).
    const int c = (int)(v % per_row);
    const long long ih = v / per_row;
    const int h = (int)(ih % n), i = (int)(ih / n);
    const uint4 x = *reinterpret_cast<const uint4*>(a + ((size_t)h * t + i) * hd + c * VEC);
    *reinterpret_cast<uint4*>(out + (size_t)v * VEC) = x;
}

// A decode step's new row into per-query-head buffers: dst[h][slot][c] = src[h / group][c] for
// h < gridDim.x, c < d; `src` is the row of a [kv_heads][t][d] tensor at any strides (its
// head stride `src_head`, a row's values contiguous), dst a contiguous [heads][cap][d]. T: the
// dtype's bits (a copy moves them as they are). One launch for K or V instead of candle's
// contiguous copy, broadcast copy and slice copy.
template <typename T>
__device__ __forceinline__ void place_row(const T* __restrict__ src, T* __restrict__ dst, long long src_head, int cap,
                                          int slot, int d, int group) {
    const int h = blockIdx.x;
    const T* from = src + (long long)(h / group) * src_head;
    T* to = dst + ((size_t)h * cap + slot) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) to[c] = from[c];
}

extern "C" __global__ void place_row_16(const uint16_t* src, uint16_t* dst, long long src_head, int cap, int slot,
                                        int d, int group) {
    place_row(src, dst, src_head, cap, slot, d, group);
}
extern "C" __global__ void place_row_32(const uint32_t* src, uint32_t* dst, long long src_head, int cap, int slot,
                                        int d, int group) {
    place_row(src, dst, src_head, cap, slot, d, group);
}
