// Causal (optionally windowed) prefill attention for Hopper (sm_90a) with warpgroup MMA:
// the same contract as flash.cu (bf16 Q, K, V in; f32 output and LSE out; a query that sees no
// key gets output 0 and LSE -inf), for head dim 128, the dim of every 7-8B model Folio runs.
// CPU reference: attention::reference::attention_block; kernels/tests/attention.rs holds this
// kernel to it on fresh random inputs (the same cases as flash.cu's).
//
// Why a second kernel: flash.cu's mma.sync (one warp, m16n8k16, B fragments loaded by each
// thread from shared memory) reaches ~29% of the H100's bf16 GEMM rate. Hopper's wgmma lets a
// warpgroup (4 warps) multiply a 64x128 tile with both B operands read by the tensor cores
// straight from shared memory, with no per-thread fragment loads (FlashAttention-3, Shah et al.
// 2024, section 3). Consumer GPUs (sm_80/sm_89) have no wgmma and keep flash.cu.
//
// Work split: a block owns 128 query rows of one query head; each of its two warpgroups owns
// 64 of them. Key tiles of 128 rows pass through shared memory in three stages filled with
// cp.async (the next tile's copies are in flight while this one is multiplied, and a tile's
// P V runs on while the one after it is waited for). Per tile a warpgroup
// computes S = Q K^T (64x128, eight k-steps over the head dim, Q and K both from shared
// memory), the online softmax in registers (each thread holds 2 rows x 32 columns of S in
// wgmma's accumulator layout, which is mma.sync's C layout per 8 columns), then O += P V with
// P from registers (the accumulator layout re-packed to bf16 is the A-fragment layout) and V
// from shared memory read N-major (the transpose flag): V stays in its [key][dim] layout.
//
// Shared-memory layout (wgmma's 128-byte swizzle): a tile of R rows of 128 bf16 is stored as
// two column blocks of 64 (128 bytes a row), each [R][128 B], with the 16-byte chunk c of row r
// at chunk c ^ (r % 8): the 8 rows x 128 B swizzle atom (1024 B, 1024-aligned). K and Q are
// K-major operands (stride between 8-row groups: 1024 B); V is an N-major operand (the next 64
// dims are R * 128 B on, the next 8 keys 1024 B on).
//
// Cost per (query row, visible key): 4 * 128 FLOPs; K/V read once per 128-row query tile.

#include <cuda_bf16.h>
#include <stdint.h>

#include "online_softmax.cuh"

#define D 128                      // head dim
#define CHUNKS (D / 8)             // 16-byte chunks per row
#define ATOM_ROW 128               // bytes per row of a 64-column block
#define SWIZZLE_ATOM 1024          // 8 rows x 128 B
#define STAGES 3

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled region of `rows` rows.
__device__ __forceinline__ uint32_t swizzled(int r, int c, int rows) {
    return (uint32_t)((c >> 3) * rows * ATOM_ROW + r * ATOM_ROW + (((c & 7) ^ (r & 7)) << 4));
}

// Starts the copy of `rows` rows of D bf16 (row stride D elements) into the swizzled region
// at shared address `dst`; rows at or past `valid` are zero-filled (their scores are masked,
// and a zero V row times a zero probability stays 0, where uninitialised bits could be NaN).
__device__ __forceinline__ void load_rows(uint32_t dst, const __nv_bfloat16* src, int valid, int rows) {
    for (int i = threadIdx.x; i < rows * CHUNKS; i += blockDim.x) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const __nv_bfloat16* from = r < valid ? src + (size_t)r * D + c * 8 : src;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + swizzled(r, c, rows)), "l"(from),
                     "r"(r < valid ? 16 : 0)
                     : "memory");
    }
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lead, uint32_t stride) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lead & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Keeps the compiler from moving accesses of accumulator registers across the asynchronous
// MMAs that write them (they are written between issue and wait, unseen by the compiler).
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// d (64x128, f32) = A B (+ d when `accumulate`): A K-major from shared memory, B K-major.
__device__ __forceinline__ void mma_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (64x128, f32) += A B: A (bf16) from registers, B N-major (transposed) from shared memory.
__device__ __forceinline__ void mma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// grid (ceil(q_len / ROWS), q_heads), block 128 * WARPGROUPS threads; dynamic shared memory:
// Q (ROWS rows), STAGES stages of a K and a V tile (KEYS rows each), and SWIZZLE_ATOM bytes of
// room to align them (the launch in kernels/src/attention/cuda.rs computes the same). out [q_heads, q_len, D] f32, lse [q_heads, q_len] f32;
// q [q_heads, q_len, D]; k and v are [kv_heads, kv_len, D] with rows D apart and heads
// `k_head_stride` / `v_head_stride` apart (a prefill's keys so far are a view of the layer's
// larger cache: read in place).
template <int KEYS, int WARPGROUPS>
__device__ __forceinline__ void flash_wgmma(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                                            const __nv_bfloat16* __restrict__ v, float* __restrict__ out,
                                            float* __restrict__ lse, int q_len, int kv_len, int groups,
                                            long long q_offset, long long k_start, long long window, float scale,
                                            long long k_head_stride, long long v_head_stride) {
    constexpr int ROWS = 64 * WARPGROUPS;  // query rows per block
    constexpr int Q_BYTES = ROWS * D * 2, TILE_BYTES = KEYS * D * 2;
    constexpr int S = KEYS / 2;  // score accumulators per thread (64 x KEYS over 128 threads)
    extern __shared__ unsigned char smem[];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem) + SWIZZLE_ATOM - 1) & ~(SWIZZLE_ATOM - 1);
    const uint32_t qs = base, kbuf = base + Q_BYTES, vbuf = kbuf + STAGES * TILE_BYTES;

    // Heaviest (latest) query tiles first: causal work grows with the tile index.
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, kvh = h / groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wg = warp / 4;                     // warpgroup: query rows 64 wg ..
    const int g = lane / 4, t = lane % 4;        // accumulator row group and column pair
    const int i0 = tile * ROWS;
    const int rows = min(ROWS, q_len - i0);
    const __nv_bfloat16* kh = k + (size_t)kvh * k_head_stride;
    const __nv_bfloat16* vh = v + (size_t)kvh * v_head_stride;

    // Key range (local indices) some row of this tile may see.
    const long long p_first = q_offset + i0, p_last = q_offset + i0 + rows - 1;
    int j_lo, j_hi;
    tile_key_range(q_offset, i0, rows, window, k_start, kv_len, j_lo, j_hi);

    // This thread's two rows of the block: r0 and r0 + 8.
    const int r0 = wg * 64 + (warp % 4) * 16 + g;
    const long long pos0 = q_offset + i0 + r0, pos1 = pos0 + 8;
    const float sl2 = scale * LOG2E;  // scores in log2 units: exp2 is one instruction
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;

    load_rows(qs, q + ((size_t)h * q_len + i0) * D, rows, ROWS);
    if (j_lo < j_hi) {
        const int first = min(KEYS, j_hi - j_lo);
        load_rows(kbuf, kh + (size_t)j_lo * D, first, KEYS);
        load_rows(vbuf, vh + (size_t)j_lo * D, first, KEYS);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");

    // start_copies: the tile at key j0 in `stage` has landed in every thread and is made visible
    // to the tensor cores (the async proxy); the copies of the tile after it start into the
    // next stage, last read by the products of the tile two before, which every warpgroup
    // waited for before reaching the barrier. issue_s: S = Q K^T over the head dim in k-steps
    // of 16 (32 bytes within a 128-byte row).
    float s[S];
    auto start_copies = [&](int j0, int stage) {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (j0 + KEYS < j_hi) {
            const int next = min(KEYS, j_hi - j0 - KEYS), to = (stage + 1) % STAGES;
            load_rows(kbuf + to * TILE_BYTES, kh + (size_t)(j0 + KEYS) * D, next, KEYS);
            load_rows(vbuf + to * TILE_BYTES, vh + (size_t)(j0 + KEYS) * D, next, KEYS);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    auto issue_s = [&](int stage) {
        const uint32_t ks = kbuf + stage * TILE_BYTES;
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            const uint32_t col = (c % 4) * 32;
            const uint64_t a = descriptor(qs + (c / 4) * ROWS * ATOM_ROW + wg * 64 * ATOM_ROW + col, 16, SWIZZLE_ATOM);
            const uint64_t b = descriptor(ks + (c / 4) * KEYS * ATOM_ROW + col, 16, SWIZZLE_ATOM);
            mma_ss(s, a, b, c > 0);
        }
        wgmma_commit();
    };

    // The P V of a tile runs while every thread waits for the next tile's copies, meets the
    // others at the barrier and starts the copies of the tile after it. (Issuing the next S
    // before waiting for P V as well made ptxas serialise every wgmma, warning C7515: the
    // score and output accumulators are then live across the same pipeline stage.)
    if (j_lo < j_hi) {
        start_copies(j_lo, 0);
        issue_s(0);
        wgmma_wait();
        pin(s);
    }
    for (int j0 = j_lo, stage = 0; j0 < j_hi; j0 += KEYS, stage = (stage + 1) % STAGES) {
        const int valid = min(KEYS, j_hi - j0);
        const uint32_t vs = vbuf + stage * TILE_BYTES;

        // Mask when the tile reaches past the diagonal, below the window, or past the keys.
        const long long key_first = k_start + j0, key_last = k_start + j0 + KEYS - 1;
        const bool masked = valid < KEYS || key_last > p_first || (window > 0 && key_first <= p_last - window);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int i = 0; i < S; i++) {
            float x = s[i] * sl2;
            if (masked) {
                const int jj = (i / 4) * 8 + t * 2 + (i & 1);
                const long long kp = k_start + j0 + jj, p = (i & 2) ? pos1 : pos0;
                if (jj >= valid || kp > p || (window > 0 && p - kp >= window)) x = -INFINITY;
            }
            s[i] = x;
            mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], x);
        }
        float shift[2], alpha[2];
        online_softmax_step(m, l, mx, shift, alpha);
#pragma unroll
        for (int i = 0; i < 64; i++) o[i] *= alpha[(i >> 1) & 1];
        // P in bf16 as the A fragments of the second product: 16 keys per k-step, the low
        // and high 8 columns of each row pair.
        uint32_t pa[KEYS / 16][4];
#pragma unroll
        for (int n = 0; n < KEYS / 8; n++) {
            const float p0 = exp2f(s[n * 4] - shift[0]), p1 = exp2f(s[n * 4 + 1] - shift[0]);
            const float p2 = exp2f(s[n * 4 + 2] - shift[1]), p3 = exp2f(s[n * 4 + 3] - shift[1]);
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            pa[n / 2][(n & 1) * 2] = pack_bf16(p0, p1);
            pa[n / 2][(n & 1) * 2 + 1] = pack_bf16(p2, p3);
        }

        // O += P V in k-steps of 16 keys (2048 bytes of the tile's first column block).
        pin(o);
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < KEYS / 16; c++) {
            mma_rs(o, pa[c], descriptor(vs + c * 16 * ATOM_ROW, KEYS * ATOM_ROW, SWIZZLE_ATOM));
        }
        wgmma_commit();
        if (j0 + KEYS < j_hi) start_copies(j0 + KEYS, (stage + 1) % STAGES);
        wgmma_wait();
        pin(o);
        if (j0 + KEYS < j_hi) {
            issue_s((stage + 1) % STAGES);
            wgmma_wait();
            pin(s);
        }
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
        for (int n = 0; n < D / 8; n++) {
            *reinterpret_cast<float2*>(orow + n * 8 + t * 2) =
                make_float2(o[n * 4 + r * 2] * inv[r], o[n * 4 + r * 2 + 1] * inv[r]);
        }
        if (t == 0) lse[at] = row_lse[r];
    }
}

#define FLASH_WGMMA(NAME, KEYS, WARPGROUPS, BLOCKS_PER_SM)                                                          \
    extern "C" __global__ void __launch_bounds__(128 * (WARPGROUPS), BLOCKS_PER_SM)                                \
        NAME(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, float* out, float* lse,         \
             int q_len, int kv_len, int groups, long long q_offset, long long k_start, long long window, float scale, \
             long long k_head_stride, long long v_head_stride) {                                                     \
        flash_wgmma<KEYS, WARPGROUPS>(q, k, v, out, lse, q_len, kv_len, groups, q_offset, k_start, window, scale,   \
                                      k_head_stride, v_head_stride);                                                 \
    }

// Two warpgroups sharing 128-key tiles, one block an SM. Measured against one warpgroup on
// 64-key tiles with two blocks an SM (each free to do its softmax while the other multiplies):
// 356 against 278 TFLOP/s on an H200 (docs/performance.md), so the shared tiles stay.
FLASH_WGMMA(flash_prefill_wgmma_128, 128, 2, 1)
