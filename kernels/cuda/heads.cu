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

// split_rope: split_heads_bias, then RoPE (the rotate-half form: d and d + hd/2 a pair) on the
// first `roped` heads, in one pass: out[h][i][p], out[h][i][p + hd/2] from y[i][h * hd + p] and
// y[i][h * hd + p + hd/2] (+ bias), rotated by cos[i][p], sin[i][p] when h < roped. A thread a
// pair. The arithmetic is split's bias add and candle's rope kernel's expressions on
// __nv_bfloat16 (each product and sum rounded to bf16), so the result is theirs to the bit:
// a decode step's Q, K and V heads in one launch of a few thousand threads, where split and
// rope took five (each ~2.3 us of a step's ~6 ms, 28 layers). CPU reference:
// heads::split_rope_reference.
// grid ceil(t * n * hd / 2 / blockDim.x); hd even; cos and sin [t][hd / 2]; bias null or [n * hd].
extern "C" __global__ void split_rope_bf16(const __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ cos,
                                           const __nv_bfloat16* __restrict__ sin,
                                           const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                           int t, int n, int roped, int hd) {
    const long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int half = hd / 2;
    if (v >= (long long)t * n * half) return;
    const int p = (int)(v % half);
    const long long hi = v / half;
    const int i = (int)(hi % t), h = (int)(hi / t);
    const int col = h * hd + p;
    const __nv_bfloat16* row = y + (size_t)i * n * hd;
    __nv_bfloat16 a = row[col], b = row[col + half];
    if (bias != nullptr) {
        a = a + bias[col];
        b = b + bias[col + half];
    }
    __nv_bfloat16* o = out + ((size_t)h * t + i) * hd;
    if (h < roped) {
        const __nv_bfloat16 c = cos[(size_t)i * half + p], s = sin[(size_t)i * half + p];
        o[p] = a * c - b * s;
        o[p + half] = a * s + b * c;
    } else {
        o[p] = a;
        o[p + half] = b;
    }
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
