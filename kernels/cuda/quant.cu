// Quantized weights (the GGUF block formats) times activations, and the weights dequantized to
// bf16 or f32, reading the blocks as stored.
// CPU reference: kernels/src/quant/reference.rs (the formats' definitions, value by value, and
// the activations' 8-bit quantization); kernels/tests/quant.rs holds the kernels to it on fresh
// random blocks: the dequantized values bit for bit, the product within f32 summation order.
//
// Why: a decode step reads every weight once, so its projections should run at the card's memory
// rate over the weights' bytes (Q4_K: 0.56 of a byte per weight against bf16's 2). candle's
// quantized CUDA products gave NaN on every quantized fixture on an H200, or (its dequantize-
// multiply kernel) read f32 activations at a fifth of the rate (docs/gguf.md). A first version of
// this kernel kept the activations in bf16 and dequantized each weight to f32: Nsight Compute
// (H200) showed it at 81% of its L1 throughput (the activations, 2 bytes a weight) and 68% of its
// issue slots (unpacking and converting: 4-5 instructions a weight in its PTX) with DRAM at 21%,
// 31-39 us for a 7B MLP gate matrix in every format. So the product quantizes the activations to 8
// bits per 32 values first (quantize_q8_bf16, as llama.cpp's CUDA backend does; ggml's CPU
// kernels, which Folio's CPU path runs through candle, do so per 32 for Q4_0/Q8_0 and per 256
// for the K-quants) and multiplies 4 quants at a time with dp4a: under one instruction per
// weight, 1 byte of activations per weight.
//
// The layout every format shares: one warp takes one output row; each step of
// its loop covers 1024 weights (four K-quant super-blocks, or thirty-two 32-weight blocks of
// Q8_0/Q4_0), and each lane takes 32 of them as two *runs* of 16 consecutive columns, each run
// with one scale (and, for Q4_K/Q5_K, one min): w = d * (q - offset) - m. A run's quants are
// unpacked 4 to a 32-bit word (one AND per 4 nibbles). The dequantized value keeps the formula's
// two roundings apart (no fused multiply-add), the reference's to the bit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define WARP 32
#define RUN 16          // weights per run
#define STEP 1024       // weights a warp covers per step: 32 lanes x 2 runs x 16
#define TILE 256        // weights per K-quant super-block
#define LANES_PER_TILE 8
#define SMALL_BLOCK 32  // weights per Q4_0/Q8_0 block
#define Q8_BLOCK 32     // activations per 8-bit scale (reference::Q8_BLOCK)
#define Q8_SUM 16       // activations per sum of quants (reference::Q8_SUM)

// Where each block keeps what (bytes from the block's start; the formats' definitions are in
// kernels/src/quant/reference.rs). Q4_0 and Q8_0: the scale d, then the quants.
#define SMALL_QS 2
// Q4_K and Q5_K: d, dmin, 12 bytes of scales and mins, [Q5_K: 32 bytes of fifth bits,] nibbles.
#define K_DMIN 2
#define K_SCALES 4
#define Q4K_QS 16
#define Q5K_QH 16
#define Q5K_QS 48
// Q6_K: low nibbles, 2-bit highs, 16 signed scales, d.
#define Q6K_QH 128
#define Q6K_SCALES 192
#define Q6K_D 208

// Format codes: kernels/src/quant/mod.rs, BlockFormat::kernel.
#define FMT_Q4_0 0
#define FMT_Q8_0 1
#define FMT_Q4_K 2
#define FMT_Q5_K 3
#define FMT_Q6_K 4

__device__ __forceinline__ float f16_at(const uint8_t* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}

// Four bytes from a 2-byte-aligned address (Q8_0, Q4_0 and Q6_K blocks are 34, 18 and 210 bytes).
__device__ __forceinline__ uint32_t u32_at2(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}

// 16 bytes as 4 words, from a 16-byte-aligned address or (ALIGNED false) a 2-byte-aligned one.
template <bool ALIGNED>
__device__ __forceinline__ void words16(const uint8_t* p, uint32_t w[4]) {
    if (ALIGNED) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = u32_at2(p + 4 * i);
    }
}

// The K-quants' 6-bit scale and min of sub-block j (0..8) from their 12 packed bytes.
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* s, int& sc, int& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// One run: 16 unsigned byte quants (4 to a word), the scale d, the min m (0 when the format has
// none) and the first column. A weight is d * (q - OFFSET) - m.
struct Run {
    uint32_t q[4];
    float d, m;
    int col;
};

template <int FMT>
struct Format;

// Each format's block bytes, its quants' offset and whether its weights have mins.
template <>
struct Format<FMT_Q4_0> {
    static constexpr int BLOCK_BYTES = 18;
    static constexpr int OFFSET = 8;
    static constexpr bool MINS = false;
};
template <>
struct Format<FMT_Q8_0> {
    static constexpr int BLOCK_BYTES = 34;
    static constexpr int OFFSET = 128;  // the signed bytes with their top bit flipped
    static constexpr bool MINS = false;
};
template <>
struct Format<FMT_Q4_K> {
    static constexpr int BLOCK_BYTES = 144;
    static constexpr int OFFSET = 0;
    static constexpr bool MINS = true;
};
template <>
struct Format<FMT_Q5_K> {
    static constexpr int BLOCK_BYTES = 176;
    static constexpr int OFFSET = 0;
    static constexpr bool MINS = true;
};
template <>
struct Format<FMT_Q6_K> {
    static constexpr int BLOCK_BYTES = 210;
    static constexpr int OFFSET = 32;
    static constexpr bool MINS = false;
};

// Lane `lane`'s two runs of step `step` of a row starting at `row` (k columns). False when the
// step is the row's last and partial and this lane's block is past its end.
template <int FMT>
__device__ __forceinline__ bool lane_runs(const uint8_t* row, int step, int lane, int k, Run& A, Run& B) {
    if (FMT == FMT_Q8_0 || FMT == FMT_Q4_0) {
        // A lane is one 32-weight block.
        const int blk = step * WARP + lane;
        if (blk >= k / SMALL_BLOCK) return false;
        const uint8_t* p = row + (size_t)blk * Format<FMT>::BLOCK_BYTES;
        A.d = B.d = f16_at(p);
        A.m = B.m = 0.0f;
        A.col = blk * SMALL_BLOCK;
        B.col = A.col + RUN;
        if (FMT == FMT_Q8_0) {
            words16<false>(p + SMALL_QS, A.q);
            words16<false>(p + SMALL_QS + RUN, B.q);
#pragma unroll
            for (int i = 0; i < 4; i++) A.q[i] ^= 0x80808080u, B.q[i] ^= 0x80808080u;
        } else {
            // Byte l holds weight l in its low nibble and weight l + 16 in its high one.
            uint32_t w[4];
            words16<false>(p + SMALL_QS, w);
#pragma unroll
            for (int i = 0; i < 4; i++) A.q[i] = w[i] & 0x0F0F0F0Fu, B.q[i] = (w[i] >> 4) & 0x0F0F0F0Fu;
        }
        return true;
    }
    const int tile = step * (WARP / LANES_PER_TILE) + lane / LANES_PER_TILE, i = lane % LANES_PER_TILE;
    if (tile >= k / TILE) return false;
    if (FMT == FMT_Q4_K || FMT == FMT_Q5_K) {
        // d, dmin, 12 bytes of scales, [Q5_K: 32 bytes of fifth bits,] 128 bytes of nibbles; 64
        // weights j: 32 bytes whose low nibbles are sub-block 2j and high ones 2j + 1. Lane i
        // takes bytes l0..l0+16 of group j = i / 2.
        const uint8_t* p = row + (size_t)tile * Format<FMT>::BLOCK_BYTES;
        const float d = f16_at(p), dmin = f16_at(p + K_DMIN);
        const int j = i / 2, l0 = RUN * (i % 2);
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * j, p + K_SCALES, sc1, m1);
        scale_min_k4(2 * j + 1, p + K_SCALES, sc2, m2);
        A.d = __fmul_rn(d, (float)sc1), A.m = __fmul_rn(dmin, (float)m1);
        B.d = __fmul_rn(d, (float)sc2), B.m = __fmul_rn(dmin, (float)m2);
        A.col = tile * TILE + 64 * j + l0;
        B.col = A.col + 32;
        uint32_t w[4];
        words16<true>(p + (FMT == FMT_Q4_K ? Q4K_QS : Q5K_QS) + 32 * j + l0, w);
#pragma unroll
        for (int b = 0; b < 4; b++) A.q[b] = w[b] & 0x0F0F0F0Fu, B.q[b] = (w[b] >> 4) & 0x0F0F0F0Fu;
        if (FMT == FMT_Q5_K) {
            uint32_t h[4];
            words16<true>(p + Q5K_QH + l0, h);
#pragma unroll
            for (int b = 0; b < 4; b++) {
                A.q[b] |= ((h[b] >> (2 * j)) & 0x01010101u) << 4;
                B.q[b] |= ((h[b] >> (2 * j + 1)) & 0x01010101u) << 4;
            }
        }
        return true;
    }
    // Q6_K: ql[128], qh[64], scales[16] (signed, one per 16 weights), d. Each half n of 128
    // weights: quarters 0 and 2 are the low and high nibbles of ql[0..32], quarters 1 and 3 those
    // of ql[32..64]; qh byte l holds the four quarters' top two bits. Lane i takes bytes
    // l0..l0+16 of quarter pair s = (i / 2) % 2 of half n = i / 4.
    const uint8_t* p = row + (size_t)tile * Format<FMT>::BLOCK_BYTES;
    const float d = f16_at(p + Q6K_D);
    const int n = i / 4, s = (i / 2) % 2, l0 = RUN * (i % 2), is = i % 2;
    uint32_t ql[4], qh[4];
    words16<false>(p + 64 * n + 32 * s + l0, ql);
    words16<false>(p + Q6K_QH + 32 * n + l0, qh);
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + Q6K_SCALES + 8 * n);
    A.d = __fmul_rn(d, (float)scales[is + 2 * s]), B.d = __fmul_rn(d, (float)scales[is + 2 * s + 4]);
    A.m = B.m = 0.0f;
    A.col = tile * TILE + 128 * n + 32 * s + l0;
    B.col = A.col + 64;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        A.q[b] = (ql[b] & 0x0F0F0F0Fu) | (((qh[b] >> (2 * s)) & 0x03030303u) << 4);
        B.q[b] = ((ql[b] >> 4) & 0x0F0F0F0Fu) | (((qh[b] >> (2 * s + 4)) & 0x03030303u) << 4);
    }
    return true;
}

// Quant e (0..16) of a run minus the format's offset, exactly, as a float: the byte placed in the
// mantissa of 2^23 (0x4B000000), then 2^23 + offset taken away.
template <int FMT>
__device__ __forceinline__ float quant(const Run& r, int e) {
    const uint32_t bits = __byte_perm(r.q[e / 4], 0x4B000000u, 0x7540u + (e % 4));
    return __int_as_float(bits) - (8388608.0f + (float)Format<FMT>::OFFSET);
}

// The activations quantized to 8 bits per block of Q8_BLOCK (as llama.cpp's CUDA products do):
// d = max|x| / 127, q = round(x / d) (half away from zero; all 0 when max|x| is 0), and each
// Q8_SUM values' sum of q for the formats with mins. One warp per block; grid
// ceil(values / Q8_BLOCK / warps per block). x: `values` bf16, values a multiple of Q8_BLOCK.
extern "C" __global__ void quantize_q8_bf16(const __nv_bfloat16* __restrict__ x, int8_t* __restrict__ qx,
                                            float* __restrict__ dx, int* __restrict__ s16, long long values) {
    const int lane = threadIdx.x % WARP;
    const long long blk = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (blk * Q8_BLOCK >= values) return;
    const float v = __bfloat162float(x[blk * Q8_BLOCK + lane]);
    float amax = fabsf(v);
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 127.0f);
    const int q = amax == 0.0f ? 0 : (int)roundf(__fdiv_rn(v, d));
    qx[blk * Q8_BLOCK + lane] = (int8_t)q;
    int sum = q;
#pragma unroll
    for (int o = Q8_SUM / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);  // within each half-warp
    if (lane == 0) dx[blk] = d;
    if (lane % Q8_SUM == 0) s16[blk * (Q8_BLOCK / Q8_SUM) + lane / Q8_SUM] = sum;
}

// A run's sum of (q - offset) * qx: its quants made signed bytes (q - offset, 4 at once; the
// K-quants' are already) and multiplied with the activations' bytes 4 at a time (dp4a).
template <int FMT>
__device__ __forceinline__ int run_dot(const Run& r, const uint4 xq) {
    const uint32_t xw[4] = {xq.x, xq.y, xq.z, xq.w};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t q = r.q[i];
        if constexpr (Format<FMT>::OFFSET != 0) q = __vsub4(q, (uint32_t)Format<FMT>::OFFSET * 0x01010101u);
        sum = __dp4a((int)q, (int)xw[i], sum);
    }
    return sum;
}

// A run's share of the product: d * dx * sum((q - offset) * qx) - m * dx * sum(qx).
template <int FMT>
__device__ __forceinline__ float run_share(const Run& r, const uint4 xq, float dx, int s) {
    const float dot = r.d * dx * (float)run_dot<FMT>(r, xq);
    return Format<FMT>::MINS ? dot - r.m * dx * (float)s : dot;
}

// out[r, n] = sum_k x̂[r, k] * W[n, k], x̂ the activations quantized by quantize_q8_bf16. Grid
// (ceil(N / warps per block), R); each warp takes one row. (Four rows a warp, each activation
// load serving four weights, measured slower at 9 of 10 7B shapes and formats: docs/results/
// 2026-11-30-quant-kernels/bench-kernels-dp4a-four-rows.json.)
// qx: R rows of k bytes; dx: R rows of k / Q8_BLOCK scales; s16: R rows of k / Q8_SUM sums;
// blocks: N rows of row_bytes.
template <int FMT>
__device__ void matvec(const uint8_t* __restrict__ blocks, const int8_t* __restrict__ qx,
                       const float* __restrict__ dx, const int* __restrict__ s16, __nv_bfloat16* __restrict__ out,
                       int n_rows, int k, int row_bytes) {
    const int lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    const int n = blockIdx.x * warps + threadIdx.x / WARP;
    if (n >= n_rows) return;
    const uint8_t* row = blocks + (size_t)n * row_bytes;
    const int8_t* xr = qx + (size_t)blockIdx.y * k;
    const float* dr = dx + (size_t)blockIdx.y * (k / Q8_BLOCK);
    const int* sr = s16 + (size_t)blockIdx.y * (k / Q8_SUM);
    const int steps = (k + STEP - 1) / STEP;
    float acc = 0.0f;
#pragma unroll 2
    for (int t = 0; t < steps; t++) {
        Run A, B;
        if (!lane_runs<FMT>(row, t, lane, k, A, B)) continue;
        const uint4 xa = *reinterpret_cast<const uint4*>(xr + A.col);
        const uint4 xb = *reinterpret_cast<const uint4*>(xr + B.col);
        const int sa = Format<FMT>::MINS ? sr[A.col / Q8_SUM] : 0, sb = Format<FMT>::MINS ? sr[B.col / Q8_SUM] : 0;
        acc += run_share<FMT>(A, xa, dr[A.col / Q8_BLOCK], sa) + run_share<FMT>(B, xb, dr[B.col / Q8_BLOCK], sb);
    }
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[(size_t)blockIdx.y * n_rows + n] = __float2bfloat16(acc);
}

__device__ __forceinline__ void store(__nv_bfloat16* o, float v) { *o = __float2bfloat16(v); }
__device__ __forceinline__ void store(float* o, float v) { *o = v; }

// W dequantized to bf16 or f32, N x k. One thread per lane-unit (32 weights); grid
// ceil(N * steps * 32 / blockDim).
template <int FMT, typename T>
__device__ void dequantize(const uint8_t* __restrict__ blocks, T* __restrict__ out, int n_rows, int k,
                           int row_bytes) {
    const int steps = (k + STEP - 1) / STEP;
    const unsigned long long unit = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= (unsigned long long)n_rows * steps * WARP) return;
    const int n = (int)(unit / ((unsigned long long)steps * WARP));
    const int rest = (int)(unit % ((unsigned long long)steps * WARP)), t = rest / WARP, lane = rest % WARP;
    Run runs[2];
    if (!lane_runs<FMT>(blocks + (size_t)n * row_bytes, t, lane, k, runs[0], runs[1])) return;
    T* o = out + (size_t)n * k;
#pragma unroll
    for (int r = 0; r < 2; r++) {
#pragma unroll
        for (int e = 0; e < RUN; e++) {
            store(o + runs[r].col + e, __fsub_rn(__fmul_rn(runs[r].d, quant<FMT>(runs[r], e)), runs[r].m));
        }
    }
}

#define FORMAT_KERNELS(NAME, FMT)                                                                        \
    extern "C" __global__ void qmatvec_##NAME(const uint8_t* blocks, const int8_t* qx, const float* dx,     \
                                              const int* s16, __nv_bfloat16* out, int n_rows, int k,       \
                                              int row_bytes) {                                             \
        matvec<FMT>(blocks, qx, dx, s16, out, n_rows, k, row_bytes);                                     \
    }                                                                                                    \
    extern "C" __global__ void qdequant_bf16_##NAME(const uint8_t* blocks, __nv_bfloat16* out, int n_rows, \
                                                    int k, int row_bytes) {                                \
        dequantize<FMT>(blocks, out, n_rows, k, row_bytes);                                              \
    }                                                                                                    \
    extern "C" __global__ void qdequant_f32_##NAME(const uint8_t* blocks, float* out, int n_rows, int k,   \
                                                   int row_bytes) {                                        \
        dequantize<FMT>(blocks, out, n_rows, k, row_bytes);                                              \
    }

FORMAT_KERNELS(q4_0, FMT_Q4_0)
FORMAT_KERNELS(q8_0, FMT_Q8_0)
FORMAT_KERNELS(q4_k, FMT_Q4_K)
FORMAT_KERNELS(q5_k, FMT_Q5_K)
FORMAT_KERNELS(q6_k, FMT_Q6_K)
