// Selection kernels: top-k of each row of scores, and the gather of selected K/V rows into a
// compact device buffer. CPU references in kernels/src/select/; kernels/tests/select.rs holds
// them to those on fresh random inputs.
//
// topk: radix select, three digit levels (11, 11, 10 bits) of an order-preserving u32 key of
// each f32 score. Each level histograms the row's keys that share the prefix fixed so far
// (many blocks per row, a shared-memory histogram each, summed with global atomics); one block
// per row then picks the digit where the k-th largest falls. After three levels the k-th key is
// known exactly; the collect pass writes every position above it and as many equal to it as k
// still needs. Four reads of the scores, no sort. Positions come out in arrival order.
//
// gather_rows: out[h, j, :] = src[h / group, idx[h, j], :] with 16-byte loads (positions past
// src's rows continue in a device tail: an offloaded context's question and answer). `src` may be
// host memory mapped into the device's address space (cuMemHostAlloc with DEVICEMAP): then
// this kernel is the copy over the host link, reading only the selected rows (no CPU gather
// pass, no staging buffer).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "select.cuh"

#define RADIX_BITS 11
#define BINS (1 << RADIX_BITS)
#define SELECT_THREADS 256

// Larger float -> larger key; -0 and +0 differ, NaN sorts above +inf (scores have none).
__device__ __forceinline__ uint32_t order_key(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Per-row state, [rows, 4] u32: prefix fixed so far, its mask, how many of the k are still
// needed from inside that prefix, and the count above the final key (set by the last pick).
#define ST_PREFIX 0
#define ST_MASK 1
#define ST_NEED 2
#define ST_ABOVE 3

extern "C" __global__ void topk_init(uint32_t* state, uint32_t* hist, int rows, int k) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    if (threadIdx.x == 0) {
        state[r * 4 + ST_PREFIX] = 0;
        state[r * 4 + ST_MASK] = 0;
        state[r * 4 + ST_NEED] = k;
        state[r * 4 + ST_ABOVE] = 0;
    }
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) hist[r * BINS + b] = 0;
}

// grid (blocks per row, rows). Histogram of the digit_bits-wide digit at `shift` over keys whose
// bits under `state.mask` equal the prefix.
extern "C" __global__ void topk_hist(const float* scores, const uint32_t* state, uint32_t* hist, int n, int shift,
                                     int digit_bits) {
    __shared__ uint32_t local[BINS];
    const int r = blockIdx.y;
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) local[b] = 0;
    __syncthreads();
    const uint32_t prefix = state[r * 4 + ST_PREFIX], mask = state[r * 4 + ST_MASK];
    const float* row = scores + (size_t)r * n;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint32_t key = order_key(row[i]);
        if ((key & mask) == prefix) atomicAdd(&local[(key >> shift) & ((1u << digit_bits) - 1)], 1u);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < BINS; b += blockDim.x)
        if (local[b]) atomicAdd(&hist[r * BINS + b], local[b]);
}

// One block per row: the digit holding the `need`-th largest key of the prefix; fixes it into
// the prefix, subtracts the keys above it from `need`, and clears the histogram for the next level.
extern "C" __global__ void topk_pick(uint32_t* state, uint32_t* hist, int shift, int digit_bits) {
    __shared__ uint32_t counts[BINS];
    const int r = blockIdx.x;
    uint32_t* h = hist + (size_t)r * BINS;
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        counts[b] = h[b];
        h[b] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t need = state[r * 4 + ST_NEED];
        const int top = (1 << digit_bits) - 1;
        uint32_t above = 0;
        int b = top;
        // need >= 1 always (k >= 1 and k <= keys in the prefix), so some digit reaches it.
        for (; b > 0; --b) {
            if (above + counts[b] >= need) break;
            above += counts[b];
        }
        state[r * 4 + ST_PREFIX] |= (uint32_t)b << shift;
        state[r * 4 + ST_MASK] |= (uint32_t)top << shift;
        state[r * 4 + ST_NEED] = need - above;
        state[r * 4 + ST_ABOVE] += above;
    }
}

// grid (blocks per row, rows). Writes positions with key > threshold to out[r, 0..above) and the
// first `need` positions equal to it after them. counters [rows, 2] start at zero.
extern "C" __global__ void topk_collect(const float* scores, const uint32_t* state, uint32_t* counters,
                                        uint32_t* out, int n, int k) {
    const int r = blockIdx.y;
    const uint32_t thr = state[r * 4 + ST_PREFIX], need = state[r * 4 + ST_NEED];
    const uint32_t above = state[r * 4 + ST_ABOVE];
    const float* row = scores + (size_t)r * n;
    uint32_t* o = out + (size_t)r * k;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint32_t key = order_key(row[i]);
        if (key > thr) {
            o[atomicAdd(&counters[r * 2], 1u)] = i;
        } else if (key == thr) {
            const uint32_t slot = atomicAdd(&counters[r * 2 + 1], 1u);
            if (slot < need) o[above + slot] = i;
        }
    }
}

// topk_small: the k largest of a row of at most SMALL_MAX scores in one block: the row sorted
// in shared memory (bitonic, descending by score in total order, the lower position first
// among equals), then its first k positions sorted ascending. One launch, where the radix
// select takes eight (four passes of two) and would spend most of a short row's time in them:
// a HiP search round keeps the best half of a few hundred candidates per head.
//   scores [rows, n] f32   out [rows, k] u32   p: a power of two >= n, q: one >= k
extern "C" __global__ void topk_small(const float* scores, uint32_t* out, int n, int k, int p, int q) {
    __shared__ unsigned long long s_key[SMALL_MAX];
    const float* row = scores + (size_t)blockIdx.x * n;
    const int t = threadIdx.x;
    // Score in the high word, the complement of the position in the low word: larger keys
    // win, and among equal scores the lower position; padding (key 0) loses to every score.
    for (int i = t; i < p; i += SELECT_THREADS) {
        s_key[i] = i < n ? ((unsigned long long)sortable(row[i]) << 32) | (uint32_t)~i : 0ull;
    }
    bitonic_sort(s_key, p, true);
    __syncthreads();
    // The first k positions, then sorted ascending (padding past k as the largest).
    __shared__ uint32_t s_pos[SMALL_MAX];
    for (int i = t; i < q; i += SELECT_THREADS) s_pos[i] = i < k ? ~(uint32_t)s_key[i] : 0xffffffffu;
    bitonic_sort(s_pos, q, false);
    __syncthreads();
    for (int i = t; i < k; i += SELECT_THREADS) out[(size_t)blockIdx.x * k + i] = s_pos[i];
}

// One thread per 16-byte vector of an output row: vecs = row bytes / 16. Positions below `n`
// come from `src` (n rows per source head), the rest from `tail` (tail_n rows per head).
extern "C" __global__ void gather_rows(const uint4* src, const uint4* tail, const uint32_t* idx, uint4* out,
                                       long long total, int sel, int group, int n, int tail_n, int vecs) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= total) return;
    const long long row = t / vecs;
    const int v = (int)(t % vecs);
    const int g = (int)(row / sel) / group;
    // Clamped: a position past the rows (a caller's bug) reads the last row, never past it.
    const uint32_t p = min(idx[row], (uint32_t)(n + tail_n - 1));
    out[t] = p < (uint32_t)n ? src[((size_t)g * n + p) * vecs + v] : tail[((size_t)g * tail_n + (p - n)) * vecs + v];
}

// gather_rows_wide: gather_rows for rows stored in another dtype than the one they are read
// in (a context file's sections, read where they lie): each thread turns 8 consecutive values
// of a row into the output's dtype. Stored rows (S): 0 f32, 1 bf16, 2 fp8 e4m3 codes with one
// f32 scale per stored row in `scales` (value = code · scale, the file's decode; e4m3 widens to
// half exactly). Rounding to bf16 is to nearest even, as the CPU's f32 → bf16 cast. The tail
// holds rows in the output's dtype. d % 8 == 0; src 16-byte aligned (8 for fp8).

template <int S>
__device__ __forceinline__ void load8(const char* src, const float* scales, size_t row, int c, int d, float v[8]);
template <>
__device__ __forceinline__ void load8<0>(const char* src, const float*, size_t row, int c, int d, float v[8]) {
    const float4* p = reinterpret_cast<const float4*>(src + (row * d + (size_t)c * 8) * 4);
    const float4 a = p[0], b = p[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <>
__device__ __forceinline__ void load8<1>(const char* src, const float*, size_t row, int c, int d, float v[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(src + (row * d + (size_t)c * 8) * 2);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
template <>
__device__ __forceinline__ void load8<2>(const char* src, const float* scales, size_t row, int c, int d,
                                         float v[8]) {
    const uint2 u = *reinterpret_cast<const uint2*>(src + row * d + (size_t)c * 8);
    const float s = scales[row];
    const uint32_t w[2] = {u.x, u.y};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const __nv_fp8_storage_t code = (w[i / 4] >> (8 * (i % 4))) & 0xff;
        v[i] = fp8_value(code, s);
    }
}

__device__ __forceinline__ void store8(float* o, const float v[8]) {
    reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(__nv_bfloat16* o, const float v[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i]));
        const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1]));
        w[i] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(o) = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void copy8(const float* from, float* o) {
    reinterpret_cast<float4*>(o)[0] = reinterpret_cast<const float4*>(from)[0];
    reinterpret_cast<float4*>(o)[1] = reinterpret_cast<const float4*>(from)[1];
}
__device__ __forceinline__ void copy8(const __nv_bfloat16* from, __nv_bfloat16* o) {
    *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(from);
}

// One thread per 8 values of an output row: total = rows · d / 8.
template <int S, typename O>
__device__ void gather_wide(const char* src, const float* scales, const O* tail, const uint32_t* idx, O* out,
                            long long total, int sel, int group, int n, int tail_n, int d) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= total) return;
    const int per = d / 8;
    const long long row = t / per;
    const int c = (int)(t % per);
    const int g = (int)(row / sel) / group;
    const uint32_t p = min(idx[row], (uint32_t)(n + tail_n - 1));
    O* o = out + row * d + (size_t)c * 8;
    if (p < (uint32_t)n) {
        float v[8];
        load8<S>(src, scales, (size_t)g * n + p, c, d, v);
        store8(o, v);
    } else {
        copy8(tail + ((size_t)g * tail_n + (p - n)) * d + (size_t)c * 8, o);
    }
}

#define GATHER_WIDE(name, S, O)                                                                            \
    extern "C" __global__ void name(const char* src, const float* scales, const O* tail, const uint32_t* idx, \
                                    O* out, long long total, int sel, int group, int n, int tail_n, int d) {   \
        gather_wide<S, O>(src, scales, tail, idx, out, total, sel, group, n, tail_n, d);                      \
    }
GATHER_WIDE(gather_rows_fp8_bf16, 2, __nv_bfloat16)
GATHER_WIDE(gather_rows_fp8_f32, 2, float)
GATHER_WIDE(gather_rows_bf16_f32, 1, float)
GATHER_WIDE(gather_rows_f32_bf16, 0, __nv_bfloat16)
