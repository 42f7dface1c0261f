// A hierarchical search over blocks of keys (HiP's): each round halves every kept node (a range
// of blocks) and scores each half by its representative block. References and docs in
// kernels/src/blocks.rs; kernels/tests/blocks.rs holds the kernels to them.

#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>

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
