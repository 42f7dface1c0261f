// Sparse-decode kernels. Each has a CPU reference in kernels/src/sparse.rs (`reference::`),
// and kernels/tests/sparse.rs holds them to it on fresh random inputs.
//
// decode_attention: one decode step's attention over selected key rows, gathered in the kernel
// (only the selected K and V rows are read), with an optional additive logit bias per selected
// row (MagicPIG's -log u). Output: the normalised attention output and its log-sum-exp, so
// partial attentions over disjoint key sets merge exactly (`merge`).
//
// simhash_codes: MagicPIG's K-bit SimHash code of each row in each of L tables.

#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>

#define MAX_D 256

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// Split over the selection: block (h, c) takes rows [c*rows_per_block, (c+1)*rows_per_block) of
// head h's selection (the launcher sizes chunks so the grid fills the GPU a few times over) in
// tiles of TILE rows, flash-decoding's layout: first each thread scores one row (its whole K
// row, so a tile has TILE row loads in flight and no per-row reductions), then a block-wide
// max and sum update the online softmax, then each thread accumulates its own channels over
// the tile's V rows (coalesced across threads). The block writes one partial (acc[d], m, l);
// decode_attention_merge merges a head's chunks.
//   q    [heads, d] f32           k, v [kv_heads, n, d] T
//   idx  [heads, sel] u32 (positions < n)    bias [heads, sel] f32 or null
//   part [heads, chunks, d + 2] f32: acc[d], m, l
#define TILE 128

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) {
        float y = __shfl_xor_sync(0xffffffff, x, o);
        x = is_max ? fmaxf(x, y) : x + y;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch is free
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < TILE / 32; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
    return r;
}

// q . row over d channels: 16-byte loads when the row allows them.
__device__ __forceinline__ float row_dot(const float* sq, const __nv_bfloat16* row, int d) {
    float dot = 0.f;
    if (d % 8 == 0) {
        for (int i = 0; i < d; i += 8) {
            const uint4 raw = *reinterpret_cast<const uint4*>(row + i);
            const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
            for (int j = 0; j < 4; ++j) {
                dot += sq[i + 2 * j] * __low2float(h2[j]) + sq[i + 2 * j + 1] * __high2float(h2[j]);
            }
        }
        return dot;
    }
    for (int i = 0; i < d; ++i) dot += sq[i] * __bfloat162float(row[i]);
    return dot;
}

__device__ __forceinline__ float row_dot(const float* sq, const float* row, int d) {
    float dot = 0.f;
    if (d % 4 == 0) {
        for (int i = 0; i < d; i += 4) {
            const float4 r = *reinterpret_cast<const float4*>(row + i);
            dot += sq[i] * r.x + sq[i + 1] * r.y + sq[i + 2] * r.z + sq[i + 3] * r.w;
        }
        return dot;
    }
    for (int i = 0; i < d; ++i) dot += sq[i] * row[i];
    return dot;
}

template <typename T>
__device__ void decode_attention_partial(const float* q, const T* k, const T* v, const uint32_t* idx,
                                         const float* bias, float* part, int heads, int kv_heads,
                                         int n, int d, int sel, int rows_per_block, float scale) {
    const int h = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const int t = threadIdx.x;
    const int group = heads / kv_heads;
    const T* kh = k + (size_t)(h / group) * n * d;
    const T* vh = v + (size_t)(h / group) * n * d;
    __shared__ float s_q[MAX_D], s_p[TILE], s_red[TILE / 32];
    __shared__ uint32_t s_pos[TILE];
    for (int ch = t; ch < d; ch += TILE) s_q[ch] = q[(size_t)h * d + ch];
    __syncthreads();
    float acc[MAX_D / TILE] = {0.f, 0.f};  // channels t and t + TILE
    float m = -INFINITY, l = 0.f;
    const int begin = chunk * rows_per_block;
    const int end = min(sel, begin + rows_per_block);
    for (int base = begin; base < end; base += TILE) {
        const int j = base + t;
        float s = -INFINITY;
        if (j < end) {
            // Positions past the stored rows are never read (the launcher refuses them before
            // the launch; the clamp keeps a bad one from reading out of bounds).
            uint32_t p = idx[(size_t)h * sel + j];
            p = p < (uint32_t)n ? p : 0;
            s_pos[t] = p;
            s = row_dot(s_q, kh + (size_t)p * d, d) * scale + (bias ? bias[(size_t)h * sel + j] : 0.f);
        }
        const float m_new = fmaxf(m, block_reduce(s, true, s_red));
        const float e = j < end ? __expf(s - m_new) : 0.f;
        s_p[t] = e;
        const float keep = m == -INFINITY ? 0.f : __expf(m - m_new);
        l = l * keep + block_reduce(e, false, s_red);  // its syncs also publish s_p and s_pos
        const int rows = min(TILE, end - base);
        for (int c = 0; c < MAX_D / TILE; ++c) {
            const int ch = t + c * TILE;
            if (ch >= d) break;
            float a = acc[c] * keep;
            for (int r = 0; r < rows; ++r) a += s_p[r] * to_f32(vh[(size_t)s_pos[r] * d + ch]);
            acc[c] = a;
        }
        m = m_new;
        __syncthreads();  // the next tile overwrites s_p and s_pos
    }
    float* out = part + ((size_t)h * chunks + chunk) * (d + 2);
    for (int c = 0; c < MAX_D / TILE; ++c) {
        const int ch = t + c * TILE;
        if (ch < d) out[ch] = acc[c];
    }
    if (t == 0) {
        out[d] = m;
        out[d + 1] = l;
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

// SimHash codes, bit for bit the CPU's (kernels/src/sparse.rs, reference::simhash_codes): each
// projection is summed over the d channels in order with one rounded multiply and one rounded
// add per channel (__fmul_rn/__fadd_rn: nvcc would otherwise fuse them into FMAs, whose single
// rounding flips the sign of near-zero projections against the CPU). Block: SH_ROWS rows x
// SH_TABLES tables, thread (row, table) computes that table's `bits` projections; a warp is 32
// rows of one table, so each plane's weight is one broadcast load, and the block's rows sit in
// shared memory (padded by one float: lanes read the same channel of different rows).
//   x [rows, d] f32   w [d, bits * tables] f32   codes [rows, tables] u32
#define SH_ROWS 32
#define SH_TABLES 8

extern "C" __global__ void simhash_codes(const float* x, const float* w, uint32_t* codes, int rows, int d, int bits,
                                         int tables) {
    extern __shared__ float xs[];  // [SH_ROWS][d + 1]
    const int r0 = blockIdx.x * SH_ROWS;
    const int tid = threadIdx.y * SH_ROWS + threadIdx.x;
    for (int e = tid; e < SH_ROWS * d; e += SH_ROWS * SH_TABLES) {
        const int r = e / d, i = e % d;
        xs[r * (d + 1) + i] = r0 + r < rows ? x[(size_t)(r0 + r) * d + i] : 0.f;
    }
    __syncthreads();
    const int row = r0 + threadIdx.x, l = blockIdx.y * SH_TABLES + threadIdx.y;
    if (row >= rows || l >= tables) return;
    const int planes = bits * tables;
    const float* xr = xs + threadIdx.x * (d + 1);
    uint32_t code = 0;
    for (int b = 0; b < bits; ++b) {
        const float* wp = w + (size_t)l * bits + b;
        float p = 0.f;
        for (int i = 0; i < d; ++i) p = __fadd_rn(p, __fmul_rn(xr[i], __ldg(wp + (size_t)i * planes)));
        code |= (uint32_t)(p > 0.f) << b;
    }
    codes[(size_t)row * tables + l] = code;
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
    if (r % 16 == 0) {
        // 16 codes per load (a token's codes start 16-byte aligned when r is a multiple of 16).
        for (int i = 0; i < r; i += 16) {
            const uint4 raw = *reinterpret_cast<const uint4*>(c + i);
            const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
            for (int j = 0; j < 16; ++j) {
                dot += q[i + j] * (float)b[j];
                qsum += q[i + j];
            }
        }
    } else {
        for (int i = 0; i < r; ++i) {
            dot += q[i] * (float)c[i];
            qsum += q[i];
        }
    }
    const float* s = scale + ((size_t)g * n + p) * 2;
    scores[t] = s[1] / max_q * dot + s[0] * qsum;
}

