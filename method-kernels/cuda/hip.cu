// A hierarchical search over blocks of keys (HiP's): each round halves every kept node (a range
// of blocks) and scores each half by its representative block. References and docs in
// method-kernels/src/hip/mod.rs; method-kernels/tests/hip.rs holds the kernels to them.

#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>

#include "../../kernels/cuda/select.cuh"

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// halve: a thread per (head, node). The node is nodes[h, keep[h, j]] (nodes[h, j] without
// keep), a range [f, l) of blocks; its halves [f, mid) and [mid, l) go to out's candidates
// j and n + j, and the key positions of each half's representative block (its middle block)
// to the positions part, clamped into the keys: first + min(rep * b + o, min(rep * b + b, keys) - 1).
//   nodes [heads, m, 2] u32   keep [heads, n] u32 or null
//   out: cand [heads, 2n, 2] u32, then pos [heads, 2n, b] u32
extern "C" __global__ void halve(const uint32_t* nodes, const uint32_t* keep, uint32_t* out, int heads, int m, int n,
                                 int b, int first, int keys) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= heads * n) return;
    const int h = t / n, j = t % n;
    const uint32_t src = keep ? keep[t] : (uint32_t)j;
    const uint32_t f = nodes[((size_t)h * m + src) * 2], l = nodes[((size_t)h * m + src) * 2 + 1];
    const uint32_t mid = f + (l - f) / 2;
    uint32_t* cand = out + (size_t)h * 2 * n * 2;
    uint32_t* pos = out + (size_t)heads * 2 * n * 2 + (size_t)h * 2 * n * b;
    cand[(size_t)j * 2] = f;
    cand[(size_t)j * 2 + 1] = mid;
    cand[(size_t)(n + j) * 2] = mid;
    cand[(size_t)(n + j) * 2 + 1] = l;
    const uint32_t reps[2] = {f + (mid - f) / 2, mid + (l - mid) / 2};
    for (int side = 0; side < 2; ++side) {
        const long long start = (long long)reps[side] * b;
        const long long last = (start + b < keys ? start + b : keys) - 1;
        uint32_t* p = pos + (size_t)(side * n + j) * b;
        for (int o = 0; o < b; ++o) p[o] = (uint32_t)((start + o < last ? start + o : last) + first);
    }
}

// expand: a thread per (head, slot) of the positions a head reads after the search: the sinks
// lo..first, then the b keys of each kept node's first block f, first + f * b + o (whole
// blocks: the caller's region is a multiple of b keys).
//   nodes [heads, m, 2] u32   keep [heads, n] u32   pos [heads, (first - lo) + n * b] u32
extern "C" __global__ void expand(const uint32_t* nodes, const uint32_t* keep, uint32_t* pos, int heads, int m, int n,
                                  int b, int lo, int first) {
    const int sinks = first - lo, s = sinks + n * b;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)heads * s) return;
    const int h = (int)(t / s), slot = (int)(t % s);
    if (slot < sinks) {
        pos[t] = (uint32_t)(lo + slot);
        return;
    }
    const int j = (slot - sinks) / b, o = (slot - sinks) % b;
    const uint32_t f = nodes[((size_t)h * m + keep[(size_t)h * n + j]) * 2];
    pos[t] = (uint32_t)first + f * (uint32_t)b + (uint32_t)o;
}

// block_max: a warp per (head, candidate): the largest q . k over the candidate's b keys, or
// -inf for an empty half (l <= f).
//   q [heads, d] f32   keys [heads, c * b, d] T   cand [heads, c, 2] u32   z [heads, c] f32
#define WARPS 4

template <typename T>
__device__ void block_max(const float* q, const T* keys, const uint32_t* cand, float* z, int heads, int c, int b,
                          int d) {
    const int w = blockIdx.x * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (w >= heads * c) return;
    const int h = w / c;
    float best = -INFINITY;
    for (int o = 0; o < b; ++o) {
        const T* row = keys + ((size_t)w * b + o) * d;
        float dot = 0.f;
        for (int i = lane; i < d; i += 32) dot += q[(size_t)h * d + i] * to_f32(row[i]);
        for (int s = 16; s > 0; s >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, s);
        best = fmaxf(best, dot);
    }
    if (lane == 0) z[w] = cand[(size_t)w * 2 + 1] > cand[(size_t)w * 2] ? best : -INFINITY;
}

extern "C" __global__ void block_max_f32(const float* q, const float* keys, const uint32_t* cand, float* z, int heads,
                                         int c, int b, int d) {
    block_max<float>(q, keys, cand, z, heads, c, b, d);
}

extern "C" __global__ void block_max_bf16(const float* q, const __nv_bfloat16* keys, const uint32_t* cand, float* z,
                                          int heads, int c, int b, int d) {
    block_max<__nv_bfloat16>(q, keys, cand, z, heads, c, b, d);
}

// hip_search: HiP's whole block search for one query head per block, in one launch: the
// rounds method-kernels/src/hip/mod.rs composes from halve, a gather of the representatives' keys,
// block_max and topk_small (its docs), here without leaving the block — the nodes, the
// candidates' keys for the sort and the query stay in shared memory, and the representative
// keys are read where they lie (host memory mapped into the device's address space, widened
// as gather_rows_wide would, rounded to the tier's dtype O as its gather would). Each
// candidate is scored by a warp with block_max's arithmetic and kept by topk_small's sort, so
// the positions are the composed search's exactly. One launch instead of four a round: at a
// million tokens a search is 11 rounds, and the launches and their hand-offs were a third of
// its device time and nearly all of its host time.
//   q [heads, d] f32   out [heads, (first - lo) + n * b] u32; rows as gather_wide's (group,
//   n_rows, tail_n, d); n survivors of `blocks` blocks of b keys from key `first`; 2n <= 2048.
// Its shared memory is sized to the search (8·p + 4·(4n + 2n + pn + d) bytes, p and pn the
// powers of two from 2n and n): at HiP's default 12 KB a block where a fixed 2048-candidate
// layout took 46 KB, so that the step's own kernels beside it (the search runs on a second
// stream for a few ms) still find room on the multiprocessors it holds.

template <int S>
__device__ __forceinline__ float load1(const char* src, const float* scales, size_t row, int i, int d);
template <>
__device__ __forceinline__ float load1<0>(const char* src, const float*, size_t row, int i, int d) {
    return reinterpret_cast<const float*>(src)[row * d + i];
}
template <>
__device__ __forceinline__ float load1<1>(const char* src, const float*, size_t row, int i, int d) {
    return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t*>(src)[row * d + i] << 16);
}
template <>
__device__ __forceinline__ float load1<2>(const char* src, const float* scales, size_t row, int i, int d) {
    const __nv_fp8_storage_t code = reinterpret_cast<const uint8_t*>(src)[row * d + i];
    return fp8_value(code, scales[row]);
}

// A value as the gather leaves it: rounded to the tier's dtype, read back as f32.
__device__ __forceinline__ float as_read(float v, const float*) { return v; }
__device__ __forceinline__ float as_read(float v, const __nv_bfloat16*) {
    return __bfloat162float(__float2bfloat16_rn(v));
}
__device__ __forceinline__ float wide(float v) { return v; }
__device__ __forceinline__ float wide(__nv_bfloat16 v) { return __bfloat162float(v); }

template <int S, typename O>
__device__ void hip_search(const float* q, const char* src, const float* scales, const O* tail, uint32_t* out,
                           int group, int n_rows, int tail_n, int d, int n, int blocks, int b, int first, int lo,
                           int rounds) {
    const int h = blockIdx.x, t = threadIdx.x, lane = t % 32, warp = t / 32, warps = blockDim.x / 32;
    const int g = h / group, c = 2 * n;
    const int p = c <= 1 ? 1 : 1 << (32 - __clz(c - 1)), pn = n <= 1 ? 1 : 1 << (32 - __clz(n - 1));
    // Shared memory sized to this search (search_shared_bytes): the keys to sort (p), the
    // candidates (2c), the nodes (2n), the survivors' order (pn) and the query (d).
    extern __shared__ unsigned long long s_key[];
    uint32_t* cand = reinterpret_cast<uint32_t*>(s_key + p);
    uint32_t* nodes = cand + 2 * c;
    uint32_t* s_pos = nodes + 2 * n;
    float* s_q = reinterpret_cast<float*>(s_pos + pn);
    const long long keys = (long long)blocks * b;
    const uint32_t last_row = (uint32_t)(n_rows + tail_n - 1);
    for (int i = t; i < d; i += blockDim.x) s_q[i] = q[(size_t)h * d + i];
    // The first nodes: n near-equal ranges of the blocks (Search::edge's rounding).
    for (int j = t; j < n; j += blockDim.x) {
        nodes[2 * j] = (uint32_t)round((double)j * blocks / n);
        nodes[2 * j + 1] = (uint32_t)round((double)(j + 1) * blocks / n);
    }
    __syncthreads();
    for (int r = 0; r < rounds; ++r) {
        // halve: node j's halves are candidates j and n + j.
        for (int j = t; j < n; j += blockDim.x) {
            const uint32_t f = nodes[2 * j], l = nodes[2 * j + 1], mid = f + (l - f) / 2;
            cand[2 * j] = f;
            cand[2 * j + 1] = mid;
            cand[2 * (n + j)] = mid;
            cand[2 * (n + j) + 1] = l;
        }
        for (int i = c + t; i < p; i += blockDim.x) s_key[i] = 0ull;
        __syncthreads();
        // block_max: a warp per candidate, its representative (middle) block's best key.
        for (int k = warp; k < c; k += warps) {
            const uint32_t f = cand[2 * k], l = cand[2 * k + 1], rep = f + (l - f) / 2;
            const long long start = (long long)rep * b;
            const long long last = (start + b < keys ? start + b : keys) - 1;
            float best = -INFINITY;
            for (int o = 0; o < b; ++o) {
                const uint32_t pos = min((uint32_t)((start + o < last ? start + o : last) + first), last_row);
                float dot = 0.f;
                if (pos < (uint32_t)n_rows) {
                    const size_t row = (size_t)g * n_rows + pos;
#pragma unroll 4
                    for (int i = lane; i < d; i += 32) dot += s_q[i] * as_read(load1<S>(src, scales, row, i, d), tail);
                } else {
                    const O* row = tail + ((size_t)g * tail_n + (pos - n_rows)) * d;
#pragma unroll 4
                    for (int i = lane; i < d; i += 32) dot += s_q[i] * wide(row[i]);
                }
                for (int s = 16; s > 0; s >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, s);
                best = fmaxf(best, dot);
            }
            if (lane == 0) {
                const float z = l > f ? best : -INFINITY;
                s_key[k] = ((unsigned long long)sortable(z) << 32) | (uint32_t)~k;
            }
        }
        // topk_small: the n best candidates (the lower one among equals), ascending.
        bitonic_sort(s_key, p, true);
        __syncthreads();
        for (int i = t; i < pn; i += blockDim.x) s_pos[i] = i < n ? ~(uint32_t)s_key[i] : 0xffffffffu;
        bitonic_sort(s_pos, pn, false);
        __syncthreads();
        for (int j = t; j < n; j += blockDim.x) {
            nodes[2 * j] = cand[2 * s_pos[j]];
            nodes[2 * j + 1] = cand[2 * s_pos[j] + 1];
        }
        __syncthreads();
    }
    // expand: the sinks, then each kept node's b keys.
    const int sinks = first - lo, s = sinks + n * b;
    for (int slot = t; slot < s; slot += blockDim.x) {
        const int j = (slot - sinks) / b, o = (slot - sinks) % b;
        out[(size_t)h * s + slot] = slot < sinks ? (uint32_t)(lo + slot) : (uint32_t)first + nodes[2 * j] * (uint32_t)b + o;
    }
}

#define SEARCH_THREADS 512
#define HIP_SEARCH(name, S, O)                                                                            \
    extern "C" __global__ void __launch_bounds__(SEARCH_THREADS)                                          \
        name(const float* q, const char* src, const float* scales, const O* tail, uint32_t* out, int group, \
             int n_rows, int tail_n, int d, int n, int blocks, int b, int first, int lo, int rounds) {      \
        hip_search<S, O>(q, src, scales, tail, out, group, n_rows, tail_n, d, n, blocks, b, first, lo, rounds); \
    }
HIP_SEARCH(hip_search_f32_f32, 0, float)
HIP_SEARCH(hip_search_f32_bf16, 0, __nv_bfloat16)
HIP_SEARCH(hip_search_bf16_f32, 1, float)
HIP_SEARCH(hip_search_bf16_bf16, 1, __nv_bfloat16)
HIP_SEARCH(hip_search_fp8_f32, 2, float)
HIP_SEARCH(hip_search_fp8_bf16, 2, __nv_bfloat16)
