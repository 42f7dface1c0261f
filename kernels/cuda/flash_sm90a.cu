// Causal (optionally windowed) prefill attention for Hopper (sm_90a) with warpgroup MMA and TMA:
// the same contract as flash.cu (bf16 Q, K, V in; f32 output and LSE out; a query that sees no
// key gets output 0 and LSE -inf), for head dim 128, the dim of every 7-8B model Folio runs.
// CPU reference: attention::reference::attention_block; kernels/tests/attention.rs holds this
// kernel to it on fresh random inputs (the same cases as flash.cu's).
//
// Why a second kernel: flash.cu's mma.sync (one warp, m16n8k16, B fragments loaded by each
// thread from shared memory) reaches ~29% of the H100/H200's measured bf16 GEMM rate. Hopper's
// wgmma lets a warpgroup (4 warps) multiply a 64x128 tile with its operands read by the tensor
// cores straight from shared memory, and its TMA unit copies a whole tile into shared memory
// on one thread's request (FlashAttention-3, Shah et al. 2024, section 3). Consumer GPUs
// (sm_80/sm_89) have neither and keep flash.cu.
//
// Work split (warp specialisation): a block owns 128 query rows of one query head. Warpgroup 2
// is the producer: one of its threads asks TMA for Q, then for each 128-key tile of K and of V
// into one of three stages, each with a "full" mbarrier the copy's bytes complete. Warpgroups 0
// and 1 are the consumers, 64 query rows each: per tile, S = Q K^T (64x128, eight k-steps over
// the head dim, Q from registers, read once from its tile, and K from shared memory), the
// online softmax in registers (each thread holds
// 2 rows x 32 columns of S in wgmma's accumulator layout, mma.sync's C layout per 8 columns),
// then O += P V with P from registers (the accumulator layout re-packed to bf16 is the
// A-fragment layout) and V read N-major (the transpose flag: V keeps its [key][dim] layout).
// A consumer releases a stage (its "empty" mbarrier, one arrival per consumer warp) once its
// P V over it has completed; the producer waits for that before refilling the stage. Registers
// move from the producer to the consumers (setmaxnreg): 40 and 232 a thread.
//
// In-warpgroup overlap: a consumer issues S of tile t+1, rescales the output while S runs
// (skipped where no row of the warp moved its max), issues P V of tile t, waits for S only, and
// runs the softmax of t+1 while P V of t is still on the tensor cores. The exp2s (one MUFU
// instruction each) are what the tensor cores would otherwise wait for; the order is
// FlashAttention-3's (section 3.2).
//
// Measured (H200, `folio bench kernels`, 28/4 heads x 32k causal, % of the bf16 GEMM in the
// same run; docs/performance.md): every thread copying with cp.async between block-wide
// barriers, 48%; a producer warpgroup copying with cp.async, 37-38% (its ~30 instructions per
// 16-byte copy crowd the consumers' issue slots: copies alone took 10.4 ms of the 14.7 ms the
// TMA kernel now takes in all); TMA, 69%. On an H100 (a standalone harness timing variants
// of this file, 2026-11-26): 554-561 TFLOP/s with the rescale after P V and Q read from shared
// memory by every S; issuing S before the rescale +2%, Q from registers +2% more, skipping
// rescales by 1 +1.5% more (586-596, 74-75% of the 793 TFLOP/s GEMM), the output unchanged to
// the bit. Tried and left out: consumers taking turns at the tensor cores (FlashAttention-3's
// ping-pong, named barriers: no difference, there and on an H200), row max and sum in four
// partial chains (slower: registers), exp2 on packed bf16 pairs (ptxas serialised the MMAs
// for want of registers, 23% slower).
//
// Shared-memory layout (wgmma's 128-byte swizzle, which TMA writes): a tile of R rows of 128
// bf16 is two column blocks of 64 (128 bytes a row), each [R][128 B], with the 16-byte chunk c
// of row r at chunk c ^ (r % 8): the 8 rows x 128 B swizzle atom (1024 B, 1024-aligned). K is
// a K-major operand (stride between 8-row groups: 1024 B); V is an N-major operand (the next 64
// dims are R * 128 B on, the next 8 keys 1024 B on); Q's tile is read by its consumers once,
// into registers, by the same addressing.
//
// Cost per (query row, visible key): 4 * 128 FLOPs; K/V read once per 128-row query tile.

#include <cuda_bf16.h>
#include <stdint.h>

#include "mma.cuh"
#include "online_softmax.cuh"

#define D 128                  // head dim
#define ATOM_ROW 128           // bytes per row of a 64-column block
#define SWIZZLE_ATOM 1024      // 8 rows x 128 B
#define STAGES 3               // K and V tiles in flight
#define KEYS 128               // keys per tile
#define CONSUMERS 2            // consumer warpgroups, 64 query rows each
#define ROWS (64 * CONSUMERS)  // query rows per block
#define THREADS (128 * (CONSUMERS + 1))
#define BOX_ROWS 128           // rows of a TMA box (the host's tensor maps say the same)
static_assert(ROWS == BOX_ROWS && KEYS == BOX_ROWS, "Q and each tile are one box of rows");
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232      // 128 * 40 + 256 * 232 <= 65536, the register file

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
// Waits until at most N committed groups of this warpgroup's MMAs are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait_for() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
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

// d (64x128, f32) = A B (+ d when `accumulate`): A (bf16) from registers, B K-major from shared memory.
__device__ __forceinline__ void mma_rk(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// --- mbarriers and TMA ---
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nretry:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra retry;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Expects `bytes` more on `bar` in its current phase, and arrives.
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// A TMA descriptor (a CUtensorMap, encoded on the host by cuTensorMapEncodeTiled in
// kernels/src/attention/cuda.rs): a [heads][rows][128] bf16 tensor read in boxes of 128 rows x
// 64 columns, 128-byte swizzled (the layout above). Rows past the tensor's end arrive as zeros.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};
// Copies the box at (column x, row y, head z) of `map` to `dst`; its bytes complete on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const TensorMap* map, int x, int y, int z, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}
// Both 64-column halves of the BOX_ROWS rows from `row` of one head.
__device__ __forceinline__ void tma_tile(uint32_t dst, const TensorMap* map, int row, int head, uint32_t bar) {
    tma_load(dst, map, 0, row, head, bar);
    tma_load(dst + BOX_ROWS * ATOM_ROW, map, 64, row, head, bar);
}

// grid (ceil(q_len / ROWS), q_heads), block THREADS; dynamic shared memory: Q (ROWS rows),
// STAGES stages of a K and a V tile (KEYS rows each), and SWIZZLE_ATOM bytes of room to align
// them (the launch in kernels/src/attention/cuda.rs computes the same). out [q_heads, q_len, D]
// f32, lse [q_heads, q_len] f32. tq maps q [q_heads, q_len, D]; tk and tv map k and v
// [kv_heads, kv_len, D] (a prefill's keys so far are a view of the layer's larger cache, read
// in place: the maps carry its head stride). q, k and v come as pointers too, unread: the
// launch passes them so that the stream orders this kernel after their writers.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    flash_prefill_wgmma_128(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                            float* __restrict__ out, float* __restrict__ lse, int q_len, int kv_len, int groups,
                            long long q_offset, long long k_start, long long window, float scale,
                            const __grid_constant__ TensorMap tq, const __grid_constant__ TensorMap tk,
                            const __grid_constant__ TensorMap tv) {
    constexpr int Q_BYTES = ROWS * D * 2, TILE_BYTES = KEYS * D * 2;
    constexpr int S = KEYS / 2;  // score accumulators per thread (64 x KEYS over 128 threads)
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[3 * STAGES + 1];  // per stage: K full, V full, empty; Q full
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem) + SWIZZLE_ATOM - 1) & ~(SWIZZLE_ATOM - 1);
    const uint32_t qs = base, kbuf = base + Q_BYTES, vbuf = kbuf + STAGES * TILE_BYTES;
    const uint32_t full_k = (uint32_t)__cvta_generic_to_shared(bars), full_v = full_k + 8 * STAGES,
                   empty = full_v + 8 * STAGES, q_full = empty + 8 * STAGES;

    // Heaviest (latest) query tiles first, of every head before the next tile (the grid's x
    // is the head): causal work grows with the tile index, and the last wave on the GPU is
    // then the lightest tiles of all heads rather than one head's light tiles before another's
    // heavy ones.
    const int tile = gridDim.y - 1 - blockIdx.y;
    const int h = blockIdx.x, kvh = h / groups;
    const int wg = threadIdx.x / 128;
    const int i0 = tile * ROWS;
    const int rows = min(ROWS, q_len - i0);
    const long long p_first = q_offset + i0, p_last = q_offset + i0 + rows - 1;
    int j_lo, j_hi;
    tile_key_range(q_offset, i0, rows, window, k_start, kv_len, j_lo, j_hi);
    const int tiles = j_lo < j_hi ? (j_hi - j_lo + KEYS - 1) / KEYS : 0;

    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; st++) {
            mbar_init(full_k + 8 * st, 1);
            mbar_init(full_v + 8 * st, 1);
            mbar_init(empty + 8 * st, 4 * CONSUMERS);
        }
        mbar_init(q_full, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == CONSUMERS) {
        // The producer. Tile t goes to stage t % STAGES once the consumers are done with tile
        // t - STAGES there (the empty barrier's phase t / STAGES - 1).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        if (threadIdx.x == 128 * CONSUMERS && tiles > 0) {
            mbar_expect(q_full, Q_BYTES);
            tma_tile(qs, &tq, i0, h, q_full);
            for (int t = 0; t < tiles; t++) {
                const int stage = t % STAGES, j0 = j_lo + t * KEYS;
                if (t >= STAGES) mbar_wait(empty + 8 * stage, ((t / STAGES) - 1) & 1);
                mbar_expect(full_k + 8 * stage, TILE_BYTES);
                tma_tile(kbuf + stage * TILE_BYTES, &tk, j0, kvh, full_k + 8 * stage);
                mbar_expect(full_v + 8 * stage, TILE_BYTES);
                tma_tile(vbuf + stage * TILE_BYTES, &tv, j0, kvh, full_v + 8 * stage);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));

    // A consumer. This thread's two rows of the block: r0 and r0 + 8.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t4 = lane % 4;  // accumulator row group and column pair
    const int r0 = wg * 64 + (warp % 4) * 16 + g;
    const long long pos0 = q_offset + i0 + r0, pos1 = pos0 + 8;
    const float sl2 = scale * LOG2E;  // scores in log2 units: exp2 is one instruction
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
    float s[S];

    auto wait_full = [&](uint32_t bars_at, int t) { mbar_wait(bars_at + 8 * (t % STAGES), (t / STAGES) & 1); };
    // This thread's A fragments of its warpgroup's 64 rows of Q, read once from the swizzled
    // tile: per k-step of 16 dims, (row g, dims 2 t4..) (row g + 8, ..) (row g, dims 8 + 2 t4..)
    // (row g + 8, ..), two bf16 a register. S then reads only K from shared memory.
    uint32_t qa[D / 16][4];
    auto load_q = [&]() {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int row = r0 + (j & 1) * 8, c = kk * 16 + (j >> 1) * 8 + 2 * t4;
                const uint32_t chunk = ((c % 64) / 8) ^ (row % 8);
                const uint32_t addr = qs + (c / 64) * ROWS * ATOM_ROW + row * ATOM_ROW + chunk * 16 + (c % 8) * 2;
                asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(qa[kk][j]) : "r"(addr));
            }
        }
    };
    // S = Q K^T over the head dim in k-steps of 16 (32 bytes within K's 128-byte rows).
    auto issue_s = [&](int stage) {
        const uint32_t ks = kbuf + stage * TILE_BYTES;
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            const uint64_t b = descriptor(ks + (c / 4) * KEYS * ATOM_ROW + (c % 4) * 32, 16, SWIZZLE_ATOM);
            mma_rk(s, qa[c], b, c > 0);
        }
        wgmma_commit();
    };
    // The softmax of tile t: masked where the tile reaches past the diagonal, below the window
    // or past the keys; the scores become exp2(score * scale * log2 e - shift) in place (the
    // scale folded into one FMA), the row sums move on, and alpha is what the output
    // accumulated so far is to be scaled by.
    float alpha[2];
    auto softmax = [&](int t) {
        const int j0 = j_lo + t * KEYS, valid = min(KEYS, j_hi - j0);
        const long long key_first = k_start + j0, key_last = k_start + j0 + KEYS - 1;
        const bool masked = valid < KEYS || key_last > p_first || (window > 0 && key_first <= p_last - window);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < S; i++) {
            if (masked) {
                const int jj = (i / 4) * 8 + t4 * 2 + (i & 1);
                const long long kp = k_start + j0 + jj, p = (i & 2) ? pos1 : pos0;
                if (jj >= valid || kp > p || (window > 0 && p - kp >= window)) s[i] = -INFINITY;
            }
            mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
        }
        mx[0] = fmaxf(m[0], mx[0] * sl2);
        mx[1] = fmaxf(m[1], mx[1] * sl2);
        float shift[2];
        online_softmax_step(m, l, mx, shift, alpha);
#pragma unroll
        for (int i = 0; i < S; i++) {
            s[i] = fast_exp2(fmaf(s[i], sl2, -shift[(i >> 1) & 1]));
            l[(i >> 1) & 1] += s[i];
        }
    };
    // P in bf16 as the A fragments of P V: 16 keys per k-step, the low and high 8 columns of
    // each row pair.
    uint32_t pa[KEYS / 16][4];
    auto pack = [&]() {
#pragma unroll
        for (int n = 0; n < KEYS / 8; n++) {
            pa[n / 2][(n & 1) * 2] = pack_bf16(s[n * 4], s[n * 4 + 1]);
            pa[n / 2][(n & 1) * 2 + 1] = pack_bf16(s[n * 4 + 2], s[n * 4 + 3]);
        }
    };
    // O += P V in k-steps of 16 keys (2048 bytes of the tile's first column block).
    auto issue_pv = [&](int stage) {
        const uint32_t vs = vbuf + stage * TILE_BYTES;
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < KEYS / 16; c++) {
            mma_rs(o, pa[c], descriptor(vs + c * 16 * ATOM_ROW, KEYS * ATOM_ROW, SWIZZLE_ATOM));
        }
        wgmma_commit();
    };

    // The output accumulated so far, moved to the running max (alpha of the last softmax).
    // Where no row of the warp moved its max, alpha is 1 for all and the products are skipped:
    // after the first tiles of a long row that is most tiles.
    auto rescale = [&]() {
        if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
        for (int i = 0; i < 64; i++) o[i] *= alpha[(i >> 1) & 1];
    };

    if (tiles > 0) {
        mbar_wait(q_full, 0);
        load_q();
        wait_full(full_k, 0);
        issue_s(0);
        wgmma_wait_for<0>();
        pin(s);
        softmax(0);
        pack();
    }
    // S of the next tile is issued first and the output rescaled while it runs; then P V of
    // this tile, and the next softmax while P V runs. (The last tile, with no S after it, is
    // its own step: ptxas keeps the MMAs asynchronous only where every path commits the same
    // groups, else it serialises them, warning C7514/C7515.)
    for (int t = 0; t + 1 < tiles; t++) {
        const int stage = t % STAGES;
        wait_full(full_k, t + 1);
        pin(o);
        issue_s((t + 1) % STAGES);
        rescale();
        wait_full(full_v, t);
        pin(o);
        issue_pv(stage);
        wgmma_wait_for<1>();
        pin(s);
        softmax(t + 1);
        wgmma_wait_for<0>();
        pin(o);
        if (lane == 0) mbar_arrive(empty + 8 * stage);
        pack();
    }
    if (tiles > 0) {
        rescale();
        wait_full(full_v, tiles - 1);
        pin(o);
        issue_pv((tiles - 1) % STAGES);
        wgmma_wait_for<0>();
        pin(o);
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
            *reinterpret_cast<float2*>(orow + n * 8 + t4 * 2) =
                make_float2(o[n * 4 + r * 2] * inv[r], o[n * 4 + r * 2 + 1] * inv[r]);
        }
        if (t4 == 0) lse[at] = row_lse[r];
    }
}
