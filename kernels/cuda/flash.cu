// Causal (optionally windowed) attention over a block of keys on tensor cores, for prefill:
// bf16 Q, K, V in, f32 output and log-sum-exp out, online softmax, no score matrix in memory.
// CPU reference: attention::reference::attention_block; kernels/tests/attention.rs holds this
// kernel to it on fresh random inputs.
//
// Work split (FlashAttention-2's): a block owns 128 query rows of one query head, eight warps
// own 16 rows each and walk the key range in tiles of 64. Per tile a warp computes its 16×64
// scores with mma.sync m16n8k16 (bf16 in, f32 accumulate), keeps a running max and sum per
// row in registers, rescales its 16×D output accumulator, and multiplies P (the score
// fragment re-packed to bf16 in registers: the C layout of one 16×16 slice is the A layout of
// the next product) by the V tile. K and V tiles pass through shared memory, double-buffered:
// the next tile's cp.async copies are in flight while the tensor cores work on this one. Q
// stays in registers. Only tiles that cross the causal diagonal or the window's edge are masked.
//
// Cost per (query row, visible key): 4·D FLOPs; bytes: Q, K, V read once per block (K/V once
// per 128-row query tile), output written once in f32.
//
// Positions: query i is at q_offset + i, key j at k_start + j; key visible when its position
// is <= the query's and, with window w > 0, within w of it. A query that sees no key gets
// output 0 and LSE -inf (the LSE merge of partials over disjoint key blocks stays exact).

#include <cuda_bf16.h>
#include <stdint.h>

#include "mma.cuh"
#include "online_softmax.cuh"

#define WARPS 8          // each warp owns 16 query rows
#define ROWS (16 * WARPS) // query rows per block
#define KEYS 64          // keys per tile
#define PAD 8            // bf16 of padding per shared-memory row: fragment loads hit 32 banks

// grid (ceil(q_len / ROWS), q_heads), block 32 * WARPS. out [q_heads, q_len, D] f32,
// lse [q_heads, q_len] f32; q [q_heads, q_len, D], k/v [kv_heads, kv_len, D] bf16 with rows D
// apart and heads k_head_stride / v_head_stride apart (a view of a larger cache, read in place).
template <int D>
__device__ void flash_prefill(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                              const __nv_bfloat16* __restrict__ v, float* __restrict__ out, float* __restrict__ lse,
                              int q_len, int kv_len, int groups, long long q_offset, long long k_start, long long window,
                              float scale, long long k_head_stride, long long v_head_stride) {
    constexpr int STRIDE = D + PAD;
    constexpr int DK = D / 16;  // k-chunks of the QK product
    constexpr int DN = D / 8;   // n-tiles of the PV product
    constexpr int TILE = KEYS * STRIDE;  // bf16 of one K or V tile; two stages of each
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* const kbuf = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* const vbuf = kbuf + 2 * TILE;

    // Heaviest (latest) query tiles first, of every head before the next tile (the grid's x
    // is the head): causal work grows with the tile index, and the last wave on the GPU is
    // then the lightest tiles of all heads rather than one head's light tiles before another's
    // heavy ones.
    const int tile = gridDim.y - 1 - blockIdx.y;
    const int h = blockIdx.x, kvh = h / groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // fragment row group and column pair
    const int i0 = tile * ROWS;
    const int rows = min(ROWS, q_len - i0);
    const __nv_bfloat16* kh = k + (size_t)kvh * k_head_stride;
    const __nv_bfloat16* vh = v + (size_t)kvh * v_head_stride;

    // Key range (local indices) some row of this tile may see.
    const long long p_first = q_offset + i0, p_last = q_offset + i0 + rows - 1;
    int j_lo, j_hi;
    tile_key_range(q_offset, i0, rows, window, k_start, kv_len, j_lo, j_hi);

    // Q fragments straight from global memory into registers, once per block; rows past the
    // queries read as zero (their results are never written).
    uint32_t qa[DK][4];
    const int r0 = warp * 16 + g;
    const uint32_t* q0 = reinterpret_cast<const uint32_t*>(q + ((size_t)h * q_len + i0 + r0) * D);
    const uint32_t* q1 = q0 + 8 * D / 2;
    load_q_fragments<DK>(qa, q0, q1, r0 < rows, r0 + 8 < rows, t);

    // This thread's two rows: r0 and r0 + 8 of the tile.
    const long long pos0 = q_offset + i0 + r0, pos1 = pos0 + 8;
    const float sl2 = scale * LOG2E;  // scores in log2 units: exp2 is one instruction
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[DN][4];
#pragma unroll
    for (int n = 0; n < DN; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    if (j_lo < j_hi) {
        load_rows_async<D, KEYS, PAD>(kbuf, kh + (size_t)j_lo * D, min(KEYS, j_hi - j_lo));
        load_rows_async<D, KEYS, PAD>(vbuf, vh + (size_t)j_lo * D, min(KEYS, j_hi - j_lo));
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    for (int j0 = j_lo, stage = 0; j0 < j_hi; j0 += KEYS, stage ^= 1) {
        const int valid = min(KEYS, j_hi - j0);
        // Next tile into the other stage (its readers finished at the end of the last
        // iteration), then wait for this one's copies only.
        if (j0 + KEYS < j_hi) {
            const int next = min(KEYS, j_hi - j0 - KEYS);
            load_rows_async<D, KEYS, PAD>(kbuf + (stage ^ 1) * TILE, kh + (size_t)(j0 + KEYS) * D, next);
            load_rows_async<D, KEYS, PAD>(vbuf + (stage ^ 1) * TILE, vh + (size_t)(j0 + KEYS) * D, next);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        __syncthreads();
        const __nv_bfloat16* ks = kbuf + stage * TILE;
        const __nv_bfloat16* vs = vbuf + stage * TILE;

        float s[KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < KEYS / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int c = 0; c < DK; c++) {
#pragma unroll
            for (int n = 0; n < KEYS / 8; n++) {
                const __nv_bfloat16* kr = ks + (n * 8 + g) * STRIDE + c * 16 + t * 2;
                mma_bf16(s[n], qa[c], *reinterpret_cast<const uint32_t*>(kr),
                         *reinterpret_cast<const uint32_t*>(kr + 8));
            }
        }

        // Mask when the tile reaches past the diagonal, below the window, or past the keys.
        const long long key_first = k_start + j0, key_last = k_start + j0 + KEYS - 1;
        const bool masked = valid < KEYS || key_last > p_first || (window > 0 && key_first <= p_last - window);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < KEYS / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (masked) {
                    const int jj = n * 8 + t * 2 + (e & 1);
                    const long long kp = k_start + j0 + jj, p = e < 2 ? pos0 : pos1;
                    if (jj >= valid || kp > p || (window > 0 && p - kp >= window)) s[n][e] = -INFINITY;
                }
                mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
            }
        }
        // Raw scores stay raw: the scale is folded into exp2's argument (one FMA).
        mx[0] = fmaxf(m[0], mx[0] * sl2);
        mx[1] = fmaxf(m[1], mx[1] * sl2);
        float shift[2], alpha[2];
        online_softmax_step(m, l, mx, shift, alpha);
        scale_rows<DN>(o, alpha);
        uint32_t pa[KEYS / 16][4];
#pragma unroll
        for (int n = 0; n < KEYS / 8; n++) {
            const float p0 = fast_exp2(fmaf(s[n][0], sl2, -shift[0]));
            const float p1 = fast_exp2(fmaf(s[n][1], sl2, -shift[0]));
            const float p2 = fast_exp2(fmaf(s[n][2], sl2, -shift[1]));
            const float p3 = fast_exp2(fmaf(s[n][3], sl2, -shift[1]));
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            // Score tile n is columns 8n..8n+7: the low (n even) or high (n odd) half of
            // the A fragment of k-chunk n / 2.
            pa[n / 2][(n & 1) * 2] = pack_bf16(p0, p1);
            pa[n / 2][(n & 1) * 2 + 1] = pack_bf16(p2, p3);
        }
#pragma unroll
        for (int c = 0; c < KEYS / 16; c++) pv_16_rows<DN, STRIDE>(o, pa[c], vs + c * 16 * STRIDE, lane);
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    float inv[2], row_lse[2];
    online_softmax_finish(m, l, inv, row_lse);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = r0 + r * 8;
        if (row >= rows) continue;
        const size_t at = (size_t)h * q_len + i0 + row;
        float* orow = out + at * D;
#pragma unroll
        for (int n = 0; n < DN; n++) {
            *reinterpret_cast<float2*>(orow + n * 8 + t * 2) =
                make_float2(o[n][r * 2] * inv[r], o[n][r * 2 + 1] * inv[r]);
        }
        if (t == 0) lse[at] = row_lse[r];
    }
}

#define FLASH(D)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                                          \
        flash_prefill_##D(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, float* out,         \
                          float* lse, int q_len, int kv_len, int groups, long long q_offset, long long k_start,        \
                          long long window, float scale, long long k_head_stride, long long v_head_stride) {          \
        flash_prefill<D>(q, k, v, out, lse, q_len, kv_len, groups, q_offset, k_start, window, scale, k_head_stride,   \
                         v_head_stride);                                                                              \
    }

FLASH(32)
FLASH(64)
FLASH(128)
