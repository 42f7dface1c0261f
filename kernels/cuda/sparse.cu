// Sparse-decode kernels. Each has a CPU reference in kernels/src/sparse.rs (`reference::`),
// and kernels/tests/sparse.rs holds them to it on fresh random inputs.
//
// decode_attention: one decode step's attention over selected key rows, gathered in the kernel
// (only the selected K and V rows are read), with an optional additive logit bias per selected
// row (MagicPIG's -log u). Output: the normalised attention output and its log-sum-exp, so
// partial attentions over disjoint key sets merge exactly (`merge`).
//
// simhash_pack: MagicPIG's K-bit SimHash code of each row in each of L tables, from the
// projections (a GEMM, run by the BLAS).

#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>

#define WARPS 4
#define MAX_D 256

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Loads `per_lane` consecutive elements as floats: one 8-byte load for 4 bf16, one 16-byte load
// for 4 f32 when `wide` (d == 128: every lane's first element is a multiple of 4 from an aligned
// row), element by element otherwise.
__device__ __forceinline__ void load_row(const __nv_bfloat16* p, int per_lane, int valid, bool wide, float* out) {
    if (wide) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
        const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
        out[0] = __low2float(a); out[1] = __high2float(a); out[2] = __low2float(b); out[3] = __high2float(b);
        return;
    }
    for (int c = 0; c < per_lane; ++c) out[c] = c < valid ? __bfloat162float(p[c]) : 0.f;
}

__device__ __forceinline__ void load_row(const float* p, int per_lane, int valid, bool wide, float* out) {
    if (wide) {
        const float4 raw = *reinterpret_cast<const float4*>(p);
        out[0] = raw.x; out[1] = raw.y; out[2] = raw.z; out[3] = raw.w;
        return;
    }
    for (int c = 0; c < per_lane; ++c) out[c] = c < valid ? p[c] : 0.f;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// Split over the selection: block (h, c) takes rows [c*rows_per_block, (c+1)*rows_per_block) of
// head h's selection (the launcher sizes chunks so the grid fills the GPU a few times over); warp w of it takes rows w, w+WARPS, ... of that chunk and keeps an online
// softmax (max m, sum l, accumulator over its lanes' channels); the block's warps merge in
// shared memory and write one partial (m, l, acc[d]) per chunk; decode_attention_merge then
// merges a head's chunks. Thousands of blocks keep enough row loads in flight to approach the
// memory bandwidth, which a block per head (28 blocks for 132 SMs) cannot.
//   q    [heads, d] f32           k, v [kv_heads, n, d] T
//   idx  [heads, sel] u32 (positions < n)    bias [heads, sel] f32 or null
//   part [heads, chunks, d + 2] f32: acc[d], m, l
template <typename T>
__device__ void decode_attention_partial(const float* q, const T* k, const T* v, const uint32_t* idx,
                                         const float* bias, float* part, int heads, int kv_heads,
                                         int n, int d, int sel, int rows_per_block, float scale) {
    const int h = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = heads / kv_heads;
    const T* kh = k + (size_t)(h / group) * n * d;
    const T* vh = v + (size_t)(h / group) * n * d;
    const float* qh = q + (size_t)h * d;
    // Lane `lane` owns the contiguous channels [lane * per_lane, (lane + 1) * per_lane); at
    // d = 128 a row is one wide load per lane (8 bytes of bf16, 16 of f32).
    const int per_lane = (d + 31) / 32;
    float qr[MAX_D / 32], acc[MAX_D / 32], kr[MAX_D / 32], vr[MAX_D / 32];
    for (int c = 0; c < per_lane; ++c) {
        int ch = lane * per_lane + c;
        qr[c] = ch < d ? qh[ch] : 0.f;
        acc[c] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const int end = min(sel, (chunk + 1) * rows_per_block);
    const int first = lane * per_lane;
    const int valid = max(0, min(per_lane, d - first));
    const bool wide = d == 4 * 32;
    // Two rows per iteration: twice the bytes in flight per warp.
    for (int j = chunk * rows_per_block + warp; j < end; j += 2 * WARPS) {
        // Positions past the stored rows are never read (the launcher refuses them before the
        // launch; the clamp keeps a bad one from reading out of bounds).
        const uint32_t p0 = idx[(size_t)h * sel + j];
        const bool two = j + WARPS < end;
        const uint32_t p1 = two ? idx[(size_t)h * sel + j + WARPS] : p0;
        const size_t row0 = (size_t)(p0 < (uint32_t)n ? p0 : 0) * d + first;
        const size_t row1 = (size_t)(p1 < (uint32_t)n ? p1 : 0) * d + first;
        float kr1[MAX_D / 32], vr1[MAX_D / 32];
        load_row(kh + row0, per_lane, valid, wide, kr);
        load_row(vh + row0, per_lane, valid, wide, vr);
        load_row(kh + row1, per_lane, valid, wide, kr1);
        load_row(vh + row1, per_lane, valid, wide, vr1);
        float dot0 = 0.f, dot1 = 0.f;
        for (int c = 0; c < per_lane; ++c) {
            dot0 += qr[c] * kr[c];
            dot1 += qr[c] * kr1[c];
        }
        dot0 = warp_sum(dot0);
        dot1 = warp_sum(dot1);
        const float s0 = dot0 * scale + (bias ? bias[(size_t)h * sel + j] : 0.f);
        const float s1 = two ? dot1 * scale + (bias ? bias[(size_t)h * sel + j + WARPS] : 0.f) : -INFINITY;
        const float m_new = fmaxf(m, fmaxf(s0, s1));
        const float keep = __expf(m - m_new), w0 = __expf(s0 - m_new), w1 = two ? __expf(s1 - m_new) : 0.f;
        l = l * keep + w0 + w1;
        for (int c = 0; c < per_lane; ++c) acc[c] = acc[c] * keep + w0 * vr[c] + w1 * vr1[c];
        m = m_new;
    }
    __shared__ float s_m[WARPS], s_l[WARPS], s_acc[WARPS][MAX_D];
    if (lane == 0) { s_m[warp] = m; s_l[warp] = l; }
    for (int c = 0; c < per_lane; ++c) {
        int ch = lane * per_lane + c;
        if (ch < d) s_acc[warp][ch] = acc[c];
    }
    __syncthreads();
    float mm = -INFINITY;
    for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, s_m[w]);
    float* out = part + ((size_t)h * chunks + chunk) * (d + 2);
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < WARPS; ++w)
            if (s_m[w] != -INFINITY) o += s_acc[w][ch] * __expf(s_m[w] - mm);
        out[ch] = o;
    }
    if (threadIdx.x == 0) {
        float ll = 0.f;
        for (int w = 0; w < WARPS; ++w) ll += s_m[w] == -INFINITY ? 0.f : s_l[w] * __expf(s_m[w] - mm);
        out[d] = mm;
        out[d + 1] = ll;
    }
}

extern "C" __global__ void decode_attention_partial_f32(const float* q, const float* k, const float* v,
                                                        const uint32_t* idx, const float* bias, float* part,
                                                        int heads, int kv_heads, int n, int d, int sel,
                                                        int rows_per_block, float scale) {
    decode_attention_partial<float>(q, k, v, idx, bias, part, heads, kv_heads, n, d, sel, rows_per_block, scale);
}

extern "C" __global__ void decode_attention_partial_bf16(const float* q, const __nv_bfloat16* k,
                                                         const __nv_bfloat16* v, const uint32_t* idx,
                                                         const float* bias, float* part, int heads,
                                                         int kv_heads, int n, int d, int sel, int rows_per_block,
                                                         float scale) {
    decode_attention_partial<__nv_bfloat16>(q, k, v, idx, bias, part, heads, kv_heads, n, d, sel, rows_per_block,
                                            scale);
}

// One block per head: merges the head's chunk partials by their maxima.
//   part [heads, chunks, d + 2]   out [heads, d]   lse [heads] (-inf and zeros when empty)
extern "C" __global__ void decode_attention_merge(const float* part, float* out, float* lse, int chunks, int d) {
    const int h = blockIdx.x;
    const float* p = part + (size_t)h * chunks * (d + 2);
    float mm = -INFINITY;
    for (int c = 0; c < chunks; ++c) mm = fmaxf(mm, p[(size_t)c * (d + 2) + d]);
    float ll = 0.f;
    for (int c = 0; c < chunks; ++c) {
        const float m = p[(size_t)c * (d + 2) + d];
        if (m != -INFINITY) ll += p[(size_t)c * (d + 2) + d + 1] * __expf(m - mm);
    }
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x) {
        float o = 0.f;
        for (int c = 0; c < chunks; ++c) {
            const float m = p[(size_t)c * (d + 2) + d];
            if (m != -INFINITY) o += p[(size_t)c * (d + 2) + ch] * __expf(m - mm);
        }
        out[(size_t)h * d + ch] = ll > 0.f ? o / ll : 0.f;
    }
    if (threadIdx.x == 0) lse[h] = ll > 0.f ? mm + logf(ll) : -INFINITY;
}

// Packs SimHash codes from projections computed by a GEMM (x · W on the BLAS): one thread per
// (row, table), bit b = (proj[row, l*K + b] > 0).
//   proj [rows, K*L] f32   codes [rows, L] u32
extern "C" __global__ void simhash_pack(const float* proj, uint32_t* codes, int rows, int bits, int tables) {
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)rows * tables) return;
    const int row = t / tables, l = t % tables;
    const float* p = proj + (size_t)row * bits * tables + (size_t)l * bits;
    uint32_t code = 0;
    for (int b = 0; b < bits; ++b) code |= (uint32_t)(p[b] > 0.f) << b;
    codes[t] = code;
}

// Double Sparsity's label scores: one thread per (query head, token); the token's label is r
// codes (one byte each) with an offset and range, so the score is
// (range / max_q) * sum_i q_i * code_i + offset * sum_i q_i, without dequantizing.
//   ql [heads, r] f32 (each query head's query at its KV head's channels)
//   codes [kv_heads, n, r] u8   scale [kv_heads, n, 2] f32 (offset, range)   scores [heads, n] f32
extern "C" __global__ void label_scores(const float* ql, const uint8_t* codes, const float* scale,
                                        float* scores, int heads, int kv_heads, int n, int r, float max_q) {
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)heads * n) return;
    const int h = t / n, p = t % n;
    const int g = h / (heads / kv_heads);
    const float* q = ql + (size_t)h * r;
    const uint8_t* c = codes + ((size_t)g * n + p) * r;
    float dot = 0.f, qsum = 0.f;
    for (int i = 0; i < r; ++i) {
        dot += q[i] * (float)c[i];
        qsum += q[i];
    }
    const float* s = scale + ((size_t)g * n + p) * 2;
    scores[t] = s[1] / max_q * dot + s[0] * qsum;
}

// HiP's block scores: one warp per (query head, block); the score of a block is the largest
// q.k over its keys [start, min(start + block, end)), -inf for an empty block.
//   q [heads, d] f32   k [kv_heads, n, d] T   starts [heads, blocks] u32   scores [heads, blocks] f32
template <typename T>
__device__ void block_scores(const float* q, const T* k, const uint32_t* starts, float* scores, int heads,
                             int kv_heads, int n, int d, int blocks, int block, int end) {
    const size_t wid = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (wid >= (size_t)heads * blocks) return;
    const int h = wid / blocks;
    const T* kh = k + (size_t)(h / (heads / kv_heads)) * n * d;
    const float* qh = q + (size_t)h * d;
    const uint32_t first = starts[wid];
    const uint32_t last = min((uint32_t)min(end, n), first + (uint32_t)block);
    float best = -INFINITY;
    for (uint32_t p = first; p < last; ++p) {
        float dot = 0.f;
        for (int ch = lane; ch < d; ch += 32) dot += qh[ch] * to_f32(kh[(size_t)p * d + ch]);
        best = fmaxf(best, warp_sum(dot));
    }
    if (lane == 0) scores[wid] = best;
}

extern "C" __global__ void block_scores_f32(const float* q, const float* k, const uint32_t* starts, float* scores,
                                            int heads, int kv_heads, int n, int d, int blocks, int block, int end) {
    block_scores<float>(q, k, starts, scores, heads, kv_heads, n, d, blocks, block, end);
}

extern "C" __global__ void block_scores_bf16(const float* q, const __nv_bfloat16* k, const uint32_t* starts,
                                             float* scores, int heads, int kv_heads, int n, int d, int blocks,
                                             int block, int end) {
    block_scores<__nv_bfloat16>(q, k, starts, scores, heads, kv_heads, n, d, blocks, block, end);
}
