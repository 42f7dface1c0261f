// Sparse-decode kernels. Each has a CPU reference in kernels/src/sparse/reference.rs,
// and kernels/tests/sparse.rs holds them to it on fresh random inputs.
//
// decode_attention_rows: one decode step's attention of each query head over its KV head's first
// rows (the rows a method picked, gathered), each row read once per GQA group, with an optional
// additive logit bias per row (MagicPIG's -log u, −∞ for a padded pick). Output: the normalised
// attention output and its log-sum-exp, so partial attentions over disjoint key sets merge
// exactly (`merge`).
//
// attention_mass: the probability each key row received in a decode step, summed over a KV
// group's query heads (BUZZ's scores), without reading V or materialising the logits.
//
// simhash_codes: MagicPIG's K-bit SimHash code of each row in each of L tables.

#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>

#include "mma.cuh"
#include "online_softmax.cuh"

#define MAX_D 256

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// Threads of a decode block (the value kernel's and the merge's).
#define TILE 128

// Eight channels of a row as f32 (16-byte aligned).
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* x) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int j = 0; j < 4; ++j) {
        x[2 * j] = __low2float(h2[j]);
        x[2 * j + 1] = __high2float(h2[j]);
    }
}

__device__ __forceinline__ void load8(const float* p, float* x) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// decode_attention_rows: every query head of a KV group attends the same rows, the first `rows`
// of its KV head (a gathered pick, a cache's live slots, a resident layer), so each K and V row
// is read once per GROUP_BLOCK query heads rather than once per query head (7 times for a 7:1
// GQA group: the cost of the per-head selected-row kernel this replaced). Two kernels and the
// merge, each with a simple loop, since a single tiled kernel (scores, a block-wide online
// softmax, then V, per tile of 128 rows) spent its time on barriers and shared-memory reads,
// not memory (23% of the copy bandwidth over 105k rows of an H100; these reach 28%, the value
// kernel held back by its registers: see docs/performance.md):
//  * decode_rows_logits: a thread per row scores its K row against the block's query heads
//    (GROUP_BLOCK at a time, their queries in shared memory): z [heads, rows] f32, scaled and
//    biased, and each head's maximum over the block's rows, bmax [heads, row blocks];
//  * decode_rows_values: flash-decoding's split over rows, a block per (KV head, chunk,
//    GROUP_BLOCK heads): each head's stabiliser is the largest bmax of the logit blocks the
//    chunk overlaps (no pass over the logits to find it); each thread takes 8 channels of every
//    (128 / (d / 8))-th row (16-byte loads), weighting them for every head and summing the
//    weights as it goes; the block's row lanes are summed in shared memory into one partial
//    (acc[d], m, l) per head, merged by decode_attention_merge.
//   q [heads, d] f32   k, v [kv_heads, n, d] T   bias [heads, rows] f32 or null
//   z [heads, rows] f32   bmax [heads, ceil(rows / LOGIT_THREADS)] f32   part [heads, chunks, d + 2] f32
#define GROUP_BLOCK 8
#define LOGIT_THREADS 128

// dot[h] = sq[h] . row over d channels for the first nh of GROUP_BLOCK heads (queries [nh, d]
// in shared memory), each summed in channel order: eight channels per load where the row
// allows (rows start 16-byte aligned when d is a multiple of 8), then the rest one by one. The
// loops over heads run to GROUP_BLOCK with the absent heads masked, so dot stays in registers.
template <typename T>
__device__ __forceinline__ void group_dots(const T* row, const float* sq, int d, int nh, float* dot) {
#pragma unroll
    for (int h = 0; h < GROUP_BLOCK; ++h) dot[h] = 0.f;
    const int wide = d % 8 == 0 ? d : 0;
#pragma unroll 8
    for (int i = 0; i < wide; i += 8) {
        float x[8];
        load8(row + i, x);
#pragma unroll
        for (int h = 0; h < GROUP_BLOCK; ++h) {
            if (h < nh) {
#pragma unroll
                for (int c = 0; c < 8; ++c) dot[h] += sq[h * d + i + c] * x[c];
            }
        }
    }
    for (int i = wide; i < d; ++i) {
        const float x = to_f32(row[i]);
#pragma unroll
        for (int h = 0; h < GROUP_BLOCK; ++h) {
            if (h < nh) dot[h] += sq[h * d + i] * x;
        }
    }
}

template <typename T>
__device__ void decode_rows_logits(const float* q, const T* k, const float* bias, float* z, float* bmax, int heads,
                                   int kv_heads, int n, int d, int rows, float scale) {
    const int g = blockIdx.y, group = heads / kv_heads;
    const int j = blockIdx.x * LOGIT_THREADS + threadIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const T* row = k + ((size_t)g * n + j) * d;
    __shared__ float s_q[GROUP_BLOCK * MAX_D], s_max[LOGIT_THREADS / 32][GROUP_BLOCK];
    for (int first = 0; first < group; first += GROUP_BLOCK) {
        const int nh = min(GROUP_BLOCK, group - first), h0 = g * group + first;
        __syncthreads();  // the last heads' queries are read
        for (int e = threadIdx.x; e < nh * d; e += LOGIT_THREADS) s_q[e] = q[(size_t)h0 * d + e];
        __syncthreads();
        float dot[GROUP_BLOCK];
        // A thread past the rows scores nothing but still meets the block's barriers.
        group_dots(row, s_q, j < rows ? d : 0, nh, dot);
        // Each logit, and each head's largest over the block's rows (the value kernel's
        // stabiliser: no second pass over the logits to find it).
#pragma unroll
        for (int h = 0; h < GROUP_BLOCK; ++h) {
            if (h < nh) {
                const size_t at = (size_t)(h0 + h) * rows + j;
                float zj = -INFINITY;
                if (j < rows) {
                    zj = dot[h] * scale + (bias ? bias[at] : 0.f);
                    z[at] = zj;
                }
                for (int o = 16; o > 0; o >>= 1) zj = fmaxf(zj, __shfl_xor_sync(0xffffffff, zj, o));
                if (lane == 0) s_max[warp][h] = zj;
            }
        }
        __syncthreads();
        if (threadIdx.x < nh) {
            float mx = -INFINITY;
            for (int w = 0; w < LOGIT_THREADS / 32; ++w) mx = fmaxf(mx, s_max[w][threadIdx.x]);
            bmax[(size_t)(h0 + threadIdx.x) * gridDim.x + blockIdx.x] = mx;
        }
    }
}

// Channels a thread of decode_rows_values takes (one 16-byte load of bf16), and the shared
// floats its row lanes are summed in (lanes x GROUP_BLOCK x (d + 1) <= VALUE_SCRATCH, lanes =
// TILE / (d / 8) or TILE / d).
#define VALUE_CHANNELS 8
#define VALUE_SCRATCH (8192 + 1024)

template <typename T>
__device__ void decode_rows_values(const float* z, const float* bmax, const T* v, float* part, int heads, int kv_heads,
                                   int n, int d, int rows, int rows_per_block) {
    const int g = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const int t = threadIdx.x;
    const int group = heads / kv_heads, first = blockIdx.z * GROUP_BLOCK;
    const int nh = min(GROUP_BLOCK, group - first), h0 = g * group + first;
    const int begin = chunk * rows_per_block, end = min(rows, begin + rows_per_block);
    const int row_blocks = (rows + LOGIT_THREADS - 1) / LOGIT_THREADS;
    __shared__ float s_m[GROUP_BLOCK], s_acc[VALUE_SCRATCH];
    // Each head's stabiliser: the largest logit of the logit blocks this chunk overlaps (at
    // least the chunk's own maximum, and a neighbour's at most).
    if (t < nh) {
        float mx = -INFINITY;
        for (int b = begin / LOGIT_THREADS; b * LOGIT_THREADS < end; ++b) {
            mx = fmaxf(mx, bmax[(size_t)(h0 + t) * row_blocks + b]);
        }
        s_m[t] = mx;
    }
    __syncthreads();
    // Thread layout: `groups` channel groups of `vec` channels across a row, `lanes` rows at once.
    const int vec = d % VALUE_CHANNELS == 0 ? VALUE_CHANNELS : 1;
    const int groups = d / vec, lanes = TILE / groups;
    const int cg = t % groups, rl = t / groups;
    float m[GROUP_BLOCK], l[GROUP_BLOCK];
#pragma unroll
    for (int h = 0; h < GROUP_BLOCK; ++h) {
        m[h] = h < nh ? s_m[h] : -INFINITY;
        l[h] = 0.f;
    }
    float acc[GROUP_BLOCK][VALUE_CHANNELS];
#pragma unroll
    for (int h = 0; h < GROUP_BLOCK; ++h)
#pragma unroll
        for (int c = 0; c < VALUE_CHANNELS; ++c) acc[h][c] = 0.f;
    if (rl < lanes) {
        const T* vh = v + (size_t)g * n * d + cg * vec;
        // Unrolled so that several rows' loads (V and the logits) are in flight at once.
#pragma unroll 4
        for (int r = begin + rl; r < end; r += lanes) {
            float x[VALUE_CHANNELS];
            if (vec == VALUE_CHANNELS) {
                load8(vh + (size_t)r * d, x);
            } else {
                x[0] = to_f32(vh[(size_t)r * d]);
            }
#pragma unroll
            for (int h = 0; h < GROUP_BLOCK; ++h) {
                if (h < nh && m[h] != -INFINITY) {
                    const float p = __expf(z[(size_t)(h0 + h) * rows + r] - m[h]);
                    l[h] += p;
#pragma unroll
                    for (int c = 0; c < VALUE_CHANNELS; ++c) acc[h][c] += p * x[c];
                }
            }
        }
        // Each row lane's sums into shared memory: [lane][head][channel], and its weights'
        // sum (the channel group 0 thread's; every group's is the same) after them.
#pragma unroll
        for (int h = 0; h < GROUP_BLOCK; ++h) {
            if (h < nh) {
                for (int c = 0; c < vec; ++c) s_acc[(rl * GROUP_BLOCK + h) * d + cg * vec + c] = acc[h][c];
                if (cg == 0) s_acc[lanes * GROUP_BLOCK * d + rl * GROUP_BLOCK + h] = l[h];
            }
        }
    }
    __syncthreads();
    for (int e = t; e < nh * d; e += TILE) {
        const int h = e / d, ch = e % d;
        float o = 0.f;
        for (int r = 0; r < lanes; ++r) o += s_acc[(r * GROUP_BLOCK + h) * d + ch];
        part[((size_t)(h0 + h) * chunks + chunk) * (d + 2) + ch] = o;
    }
    if (t < nh) {
        float sum = 0.f;
        for (int r = 0; r < lanes; ++r) sum += s_acc[lanes * GROUP_BLOCK * d + r * GROUP_BLOCK + t];
        float* out = part + ((size_t)(h0 + t) * chunks + chunk) * (d + 2);
        out[d] = s_m[t];
        out[d + 1] = sum;
    }
}

extern "C" __global__ void decode_rows_logits_f32(const float* q, const float* k, const float* bias, float* z,
                                                  float* bmax, int heads, int kv_heads, int n, int d, int rows,
                                                  float scale) {
    decode_rows_logits<float>(q, k, bias, z, bmax, heads, kv_heads, n, d, rows, scale);
}

extern "C" __global__ void decode_rows_logits_bf16(const float* q, const __nv_bfloat16* k, const float* bias,
                                                   float* z, float* bmax, int heads, int kv_heads, int n, int d,
                                                   int rows, float scale) {
    decode_rows_logits<__nv_bfloat16>(q, k, bias, z, bmax, heads, kv_heads, n, d, rows, scale);
}

extern "C" __global__ void decode_rows_values_f32(const float* z, const float* bmax, const float* v, float* part,
                                                  int heads, int kv_heads, int n, int d, int rows,
                                                  int rows_per_block) {
    decode_rows_values<float>(z, bmax, v, part, heads, kv_heads, n, d, rows, rows_per_block);
}

extern "C" __global__ void decode_rows_values_bf16(const float* z, const float* bmax, const __nv_bfloat16* v,
                                                   float* part, int heads, int kv_heads, int n, int d, int rows,
                                                   int rows_per_block) {
    decode_rows_values<__nv_bfloat16>(z, bmax, v, part, heads, kv_heads, n, d, rows, rows_per_block);
}

// decode_rows_mma: decode_attention_rows on tensor cores, for bf16 queries and rows without a
// bias (what the model's decode passes on a GPU). The group's query heads are the 16 rows of
// an mma.sync m16n8k16 product (padded past the group), so a K or V row is read once per 16
// heads, and the dot products and the weighted sum of values are bf16 products accumulated in
// f32 (P rounded to bf16, as the prefill kernels round it) instead of every thread's f32 loops:
// the two-kernel path above reached 28% of the copy bandwidth over 105k rows, held back by its
// registers and its logits' round trip through memory.
// grid (kv_heads * ceil(group / 16), chunks), block 32 * DECODE_WARPS. A block takes its
// chunk's rows in tiles of DECODE_KEYS (copied with cp.async into shared memory, two stages, as
// flash.cu does); warp w takes rows 16w..16w+15 of each tile: S = Q·Kᵀ (16×16), the online
// softmax per head, O += P·V. At the end the warps' states are merged in shared memory into the
// chunk's partial (acc[d], m, l) per head, as decode_rows_values writes it, for
// decode_attention_merge.
//   q [heads, D] bf16   k, v [kv_heads, n, D] bf16   part [heads, chunks, D + 2] f32
#define DECODE_WARPS 4
#define DECODE_KEYS (16 * DECODE_WARPS)
#define DECODE_PAD 8  // bf16 of padding per shared-memory row: fragment loads hit 32 banks

template <int D>
__device__ void decode_rows_mma(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                                const __nv_bfloat16* __restrict__ v, float* __restrict__ part, int heads, int kv_heads,
                                int n, int rows, int rows_per_block, float scale) {
    constexpr int STRIDE = D + DECODE_PAD, DK = D / 16, DN = D / 8, TILE_E = DECODE_KEYS * STRIDE;
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* const kbuf = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* const vbuf = kbuf + 2 * TILE_E;
    const int group = heads / kv_heads, head_blocks = (group + 15) / 16;
    const int kvh = blockIdx.x / head_blocks, hb = blockIdx.x % head_blocks;
    const int chunk = blockIdx.y, chunks = gridDim.y;
    const int c0 = chunk * rows_per_block, c1 = min(rows, c0 + rows_per_block);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int nh = min(16, group - hb * 16), h0 = kvh * group + hb * 16;
    const __nv_bfloat16* kh = k + (size_t)kvh * n * D;
    const __nv_bfloat16* vh = v + (size_t)kvh * n * D;

    // Q fragments of heads h0 + g and h0 + g + 8 (zeros past the group), once per block.
    uint32_t qa[DK][4];
    const uint32_t* q0 = reinterpret_cast<const uint32_t*>(q + (size_t)(h0 + g) * D);
    const uint32_t* q1 = reinterpret_cast<const uint32_t*>(q + (size_t)(h0 + g + 8) * D);
    load_q_fragments<DK>(qa, q0, q1, g < nh, g + 8 < nh, t);

    const float sl2 = scale * LOG2E;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[DN][4];
#pragma unroll
    for (int c = 0; c < DN; c++) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.f;

    if (c0 < c1) {
        load_rows_async<D, DECODE_KEYS, DECODE_PAD>(kbuf, kh + (size_t)c0 * D, min(DECODE_KEYS, c1 - c0));
        load_rows_async<D, DECODE_KEYS, DECODE_PAD>(vbuf, vh + (size_t)c0 * D, min(DECODE_KEYS, c1 - c0));
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    for (int j0 = c0, stage = 0; j0 < c1; j0 += DECODE_KEYS, stage ^= 1) {
        const int valid = min(DECODE_KEYS, c1 - j0);
        if (j0 + DECODE_KEYS < c1) {
            const int next = min(DECODE_KEYS, c1 - j0 - DECODE_KEYS);
            load_rows_async<D, DECODE_KEYS, DECODE_PAD>(kbuf + (stage ^ 1) * TILE_E, kh + (size_t)(j0 + DECODE_KEYS) * D,
                                                        next);
            load_rows_async<D, DECODE_KEYS, DECODE_PAD>(vbuf + (stage ^ 1) * TILE_E, vh + (size_t)(j0 + DECODE_KEYS) * D,
                                                        next);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        __syncthreads();
        // This warp's 16 rows of the tile.
        const __nv_bfloat16* ks = kbuf + stage * TILE_E + warp * 16 * STRIDE;
        const __nv_bfloat16* vs = vbuf + stage * TILE_E + warp * 16 * STRIDE;
        float sc[2][4];
#pragma unroll
        for (int nn = 0; nn < 2; nn++) sc[nn][0] = sc[nn][1] = sc[nn][2] = sc[nn][3] = 0.f;
#pragma unroll
        for (int c = 0; c < DK; c++) {
#pragma unroll
            for (int nn = 0; nn < 2; nn++) {
                const __nv_bfloat16* kr = ks + (nn * 8 + g) * STRIDE + c * 16 + t * 2;
                mma_bf16(sc[nn], qa[c], *reinterpret_cast<const uint32_t*>(kr),
                         *reinterpret_cast<const uint32_t*>(kr + 8));
            }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nn = 0; nn < 2; nn++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (warp * 16 + nn * 8 + t * 2 + (e & 1) >= valid) sc[nn][e] = -INFINITY;
                mx[e / 2] = fmaxf(mx[e / 2], sc[nn][e]);
            }
        }
        mx[0] = fmaxf(m[0], mx[0] * sl2);
        mx[1] = fmaxf(m[1], mx[1] * sl2);
        float shift[2], alpha[2];
        online_softmax_step(m, l, mx, shift, alpha);
        scale_rows<DN>(o, alpha);
        uint32_t pa[4];
#pragma unroll
        for (int nn = 0; nn < 2; nn++) {
            const float p0 = fast_exp2(fmaf(sc[nn][0], sl2, -shift[0]));
            const float p1 = fast_exp2(fmaf(sc[nn][1], sl2, -shift[0]));
            const float p2 = fast_exp2(fmaf(sc[nn][2], sl2, -shift[1]));
            const float p3 = fast_exp2(fmaf(sc[nn][3], sl2, -shift[1]));
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            pa[nn * 2] = pack_bf16(p0, p1);
            pa[nn * 2 + 1] = pack_bf16(p2, p3);
        }
        pv_16_rows<DN, STRIDE>(o, pa, vs, lane);
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    // The warps' states through shared memory (the tiles' space, free now): o [warps][16][D],
    // then m and l [warps][16].
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
    }
    float* so = reinterpret_cast<float*>(smem);
    float* sm = so + DECODE_WARPS * 16 * D;
    float* sl = sm + DECODE_WARPS * 16;
#pragma unroll
    for (int c = 0; c < DN; c++) {
        float* r0 = so + (warp * 16 + g) * D + c * 8 + t * 2;
        r0[0] = o[c][0];
        r0[1] = o[c][1];
        r0[8 * D] = o[c][2];
        r0[8 * D + 1] = o[c][3];
    }
    if (t == 0) {
        sm[warp * 16 + g] = m[0];
        sm[warp * 16 + g + 8] = m[1];
        sl[warp * 16 + g] = l[0];
        sl[warp * 16 + g + 8] = l[1];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * D; i += blockDim.x) {
        const int r = i / D, ch = i % D;
        float mm = -INFINITY;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; w++) mm = fmaxf(mm, sm[w * 16 + r]);
        float acc = 0.f, sum = 0.f;
        if (mm != -INFINITY) {
#pragma unroll
            for (int w = 0; w < DECODE_WARPS; w++) {
                const float wt = fast_exp2(sm[w * 16 + r] - mm);
                acc += wt * so[(w * 16 + r) * D + ch];
                sum += wt * sl[w * 16 + r];
            }
        }
        float* dst = part + ((size_t)(h0 + r) * chunks + chunk) * (D + 2);
        dst[ch] = acc;
        if (ch == 0) {
            dst[D] = mm == -INFINITY ? -INFINITY : mm * LN2;  // natural units, as the merge reads them
            dst[D + 1] = sum;
        }
    }
}

#define DECODE_MMA(D)                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS)                                              \
        decode_rows_mma_##D(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, float* part, \
                            int heads, int kv_heads, int n, int rows, int rows_per_block, float scale) {         \
        decode_rows_mma<D>(q, k, v, part, heads, kv_heads, n, rows, rows_per_block, scale);                      \
    }
DECODE_MMA(32)
DECODE_MMA(64)
DECODE_MMA(128)

// Merges each head's chunk partials by their maxima: a block per (head, MERGE_CHANNELS
// channels), its threads MERGE_CHANNELS channels x (TILE / MERGE_CHANNELS) chunk lanes. Every
// block finds the head's maximum and weights (the chunks' m and l, a few hundred values) and
// keeps the weights in shared memory; each thread sums its channel over every
// (TILE / MERGE_CHANNELS)-th chunk, and the lanes are summed in shared memory. (A block a head
// with a thread a channel walking every chunk took 33 us over 256 chunks: longer than the
// attention it merged.)
//   part [heads, chunks, d + 2] (chunks <= MAX_CHUNKS)   out [heads, d]   lse [heads] (-inf and zeros when empty)
#define MAX_CHUNKS 1024
#define MERGE_CHANNELS 32

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) {
        const float y = __shfl_xor_sync(0xffffffff, x, o);
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

extern "C" __global__ void decode_attention_merge(const float* part, float* out, float* lse, int chunks, int d) {
    const int h = blockIdx.x, t = threadIdx.x;
    const float* p = part + (size_t)h * chunks * (d + 2);
    __shared__ float s_w[MAX_CHUNKS], s_red[TILE / 32], s_sum[TILE / MERGE_CHANNELS][MERGE_CHANNELS];
    float mx = -INFINITY;
    for (int c = t; c < chunks; c += TILE) mx = fmaxf(mx, p[(size_t)c * (d + 2) + d]);
    const float mm = block_reduce(mx, true, s_red);
    float sum = 0.f;
    for (int c = t; c < chunks; c += TILE) {
        const float m = p[(size_t)c * (d + 2) + d];
        const float w = m == -INFINITY ? 0.f : __expf(m - mm);
        s_w[c] = w;
        sum += w * p[(size_t)c * (d + 2) + d + 1];
    }
    const float ll = block_reduce(sum, false, s_red);  // its barriers also publish s_w
    const int ch = blockIdx.y * MERGE_CHANNELS + t % MERGE_CHANNELS, lane = t / MERGE_CHANNELS;
    float o = 0.f;
    if (ch < d) {
#pragma unroll 4
        for (int c = lane; c < chunks; c += TILE / MERGE_CHANNELS) o += p[(size_t)c * (d + 2) + ch] * s_w[c];
    }
    s_sum[lane][t % MERGE_CHANNELS] = o;
    __syncthreads();
    if (lane == 0 && ch < d) {
        float total = 0.f;
        for (int r = 0; r < TILE / MERGE_CHANNELS; ++r) total += s_sum[r][t];
        out[(size_t)h * d + ch] = ll > 0.f ? total / ll : 0.f;
    }
    if (blockIdx.y == 0 && t == 0) lse[h] = ll > 0.f ? mm + logf(ll) : -INFINITY;
}

// attention_mass: the attention probability each of a KV head's first s rows received in one
// decode step, summed over the query heads of its group (BUZZ's heavy-hitter score), added to
// the sums so far: out[g, j] = (j < prev_n ? prev[g, j] : 0)
//                             + sum over query heads h of group g of exp(q[h] . k[g, j] * scale - lse[h]).
// One thread per row: it reads its K row once and scores it against the group's query heads,
// GROUP_BLOCK at a time (their queries in shared memory; the row comes from L1 again for a
// larger group), so K is read once per group, not once per head.
//   q [heads, d] f32   k [kv_heads, n, d] T   lse [heads] f32 (-inf: the head attended nothing)
//   prev [kv_heads, prev_n] f32 or null   out [kv_heads, s] f32
#define MASS_THREADS 128

template <typename T>
__device__ void attention_mass(const float* q, const T* k, const float* lse, const float* prev, float* out,
                               int heads, int kv_heads, int n, int d, int s, int prev_n, float scale) {
    const int g = blockIdx.y, group = heads / kv_heads;
    const int j = blockIdx.x * MASS_THREADS + threadIdx.x;
    const T* row = k + ((size_t)g * n + j) * d;
    __shared__ float s_q[GROUP_BLOCK * MAX_D], s_lse[GROUP_BLOCK];
    float mass = 0.f;
    for (int first = 0; first < group; first += GROUP_BLOCK) {
        const int nh = min(GROUP_BLOCK, group - first), h0 = g * group + first;
        __syncthreads();  // the last heads' queries are read
        for (int e = threadIdx.x; e < nh * d; e += MASS_THREADS) s_q[e] = q[(size_t)h0 * d + e];
        if (threadIdx.x < nh) s_lse[threadIdx.x] = lse[h0 + threadIdx.x];
        __syncthreads();
        float dot[GROUP_BLOCK];
        // A thread past the rows scores nothing but still meets the block's barriers.
        group_dots(row, s_q, j < s ? d : 0, nh, dot);
#pragma unroll
        for (int h = 0; h < GROUP_BLOCK; ++h) {
            if (h < nh && s_lse[h] != -INFINITY) mass += __expf(dot[h] * scale - s_lse[h]);
        }
    }
    if (j < s) out[(size_t)g * s + j] = (j < prev_n ? prev[(size_t)g * prev_n + j] : 0.f) + mass;
}

extern "C" __global__ void attention_mass_f32(const float* q, const float* k, const float* lse, const float* prev,
                                              float* out, int heads, int kv_heads, int n, int d, int s, int prev_n,
                                              float scale) {
    attention_mass<float>(q, k, lse, prev, out, heads, kv_heads, n, d, s, prev_n, scale);
}

extern "C" __global__ void attention_mass_bf16(const float* q, const __nv_bfloat16* k, const float* lse,
                                               const float* prev, float* out, int heads, int kv_heads, int n, int d,
                                               int s, int prev_n, float scale) {
    attention_mass<__nv_bfloat16>(q, k, lse, prev, out, heads, kv_heads, n, d, s, prev_n, scale);
}

// SimHash codes, bit for bit the CPU's (kernels/src/sparse/reference.rs, simhash_codes): each
// projection is summed over the d channels in order with one rounded multiply and one rounded
// add per channel (__fmul_rn/__fadd_rn: nvcc would otherwise fuse them into FMAs, whose single
// rounding flips the sign of near-zero projections against the CPU). Block: SH_ROWS rows x
// SH_TABLES tables, thread (row, table) computes that table's bits `per · blockIdx.z ..` (all of
// them when gridDim.z is 1, stored; else a share, OR-ed into zeroed codes: a decode step's few
// rows fill a handful of blocks, and each projection is a chain of d dependent adds, so the
// bits go to blocks of their own); a warp is 32 rows of one table, so each plane's weight is
// one broadcast load, and the block's rows sit in shared memory (padded by one float: lanes
// read the same channel of different rows).
//   x [rows, d] f32   w [d, bits * tables] f32   codes [rows, tables] u32
#define SH_ROWS 32
#define SH_TABLES 8

extern "C" __global__ void simhash_codes(const float* x, const float* w, uint32_t* codes, int rows, int d, int bits,
                                         int tables, int per) {
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
    const int planes = bits * tables, b0 = blockIdx.z * per, b1 = min(bits, b0 + per);
    const float* xr = xs + threadIdx.x * (d + 1);
    uint32_t code = 0;
    for (int b = b0; b < b1; ++b) {
        const float* wp = w + (size_t)l * bits + b;
        float p = 0.f;
        for (int i = 0; i < d; ++i) p = __fadd_rn(p, __fmul_rn(xr[i], __ldg(wp + (size_t)i * planes)));
        code |= (uint32_t)(p > 0.f) << b;
    }
    if (gridDim.z == 1) codes[(size_t)row * tables + l] = code;
    else atomicOr(codes + (size_t)row * tables + l, code);
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

