// MagicPIG's sample on the GPU, over bucket lists and rows that lie in host memory (mapped into
// the device's address space; the lists' run starts in device memory): the table walk (`lsh_walk`) and the attention over what it found
// (`lsh_attend_*`). Definitions and the reasons for this split: method-kernels/src/magicpig/mod.rs.
#include <cfloat>
#include <cstdint>
#include <cuda_bf16.h>

#include "../../kernels/cuda/select.cuh"

// Keys per segment of a bucket list (members are 16-bit offsets within it): SEGMENT_KEYS.
#define SEG_KEYS 65536
#define SEG_WORDS (SEG_KEYS / 32)
#define WALK_THREADS 512
// Members each thread of the walk loads before it sets their bits (loads in flight together).
#define WALK_UNROLL 4
// The most tables (MAX_TABLES) and segments (MAX_SEGMENTS) the kernels hold in shared memory.
#define MAX_TABLES 1024
#define MAX_SEGS 2048
#define ATTEND_WARPS 8
#define REPORT_THREADS 256
// Values of a head a lane holds (head dims up to 32 · 8 = 256, four at a time).
#define LANE_VALUES 8

// Largest `l` with scan[l] <= j, for scan[0] = 0 <= j < scan[tables]: the table whose run holds
// the block's j-th member.
__device__ __forceinline__ int table_of(const uint32_t* scan, int tables, uint32_t j) {
    int lo = 0, hi = tables;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (scan[mid] <= j) lo = mid;
        else hi = mid;
    }
    return lo;
}

// Inclusive sum of `x` over the warp's lanes.
__device__ __forceinline__ uint32_t warp_inclusive(uint32_t x, int lane) {
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

// One block per (segment, query head h0 + blockIdx.y, its codes' row blockIdx.y; a walk may
// cover a range of the heads): the keys of segment `s` whose code equals the head's in
// at least two tables. Every table's run for the segment (its start and end in `starts`, then
// its members) is read where it lies; each member sets its bit in `once`, or in `twice` when
// `once` had it. The keys in `twice` from `skip` on are written ascending as positions
// `first + key` from `picks[h][s · SEG_KEYS]` on, their number to `counts[h][s]` (h the row).
// members[kvh], starts[kvh]: device addresses of KV head kvh's lists ([tables][n] u16 in host
// memory and [tables][2^bits · segs + 1] u32 in device memory: lsh::Tables says why).
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
    lsh_walk(const unsigned long long* members, const unsigned long long* starts, const uint32_t* codes,
             uint32_t* picks, uint32_t* counts, int n, int segs, int tables, int bits, int group, int h0, int first,
             int skip, unsigned long long* link_bytes) {
    __shared__ uint32_t once[SEG_WORDS], twice[SEG_WORDS];
    __shared__ uint32_t from[MAX_TABLES], scan[MAX_TABLES + 1];
    __shared__ uint32_t warp_sums[WALK_THREADS / 32];
    const int s = blockIdx.x, h = blockIdx.y, kvh = (h0 + h) / group, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const uint16_t* mem = reinterpret_cast<const uint16_t*>(members[kvh]);
    const uint32_t* st = reinterpret_cast<const uint32_t*>(starts[kvh]);
    const size_t per_table = ((size_t)1 << bits) * segs + 1;
    for (int w = t; w < SEG_WORDS; w += WALK_THREADS) {
        once[w] = 0;
        twice[w] = 0;
    }
    for (int l = t; l < tables; l += WALK_THREADS) {
        // A code past 2^bits would read past the lists: taken modulo 2^bits (codes are < 2^bits).
        const uint32_t c = codes[(size_t)h * tables + l] & (uint32_t)(((size_t)1 << bits) - 1);
        const size_t at = l * per_table + (size_t)c * segs + s;
        const uint32_t a = st[at], b = st[at + 1];
        from[l] = a;
        scan[l + 1] = b - a;
    }
    __syncthreads();
    // The runs' lengths summed in order, 32 tables at a time by the first warp.
    if (warp == 0) {
        uint32_t carry = 0;
        for (int base = 0; base < tables; base += 32) {
            const int l = base + lane;
            const uint32_t x = l < tables ? scan[l + 1] : 0;
            const uint32_t incl = warp_inclusive(x, lane) + carry;
            if (l < tables) scan[l + 1] = incl;
            carry = __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) scan[0] = 0;
    }
    __syncthreads();
    const uint32_t total = scan[tables];
    // What crossed the link: the runs' members (kernels/src/link).
    if (link_bytes != nullptr && t == 0) atomicAdd(link_bytes, 2ull * total);
    for (uint32_t j0 = t; j0 < total; j0 += WALK_THREADS * WALK_UNROLL) {
        uint32_t m[WALK_UNROLL];
#pragma unroll
        for (int u = 0; u < WALK_UNROLL; ++u) {
            const uint32_t j = j0 + u * WALK_THREADS;
            if (j < total) {
                const int l = table_of(scan, tables, j);
                m[u] = mem[(size_t)l * n + from[l] + (j - scan[l])];
            }
        }
#pragma unroll
        for (int u = 0; u < WALK_UNROLL; ++u) {
            if (j0 + u * WALK_THREADS < total) {
                const uint32_t bit = 1u << (m[u] & 31);
                if (atomicOr(&once[m[u] >> 5], bit) & bit) atomicOr(&twice[m[u] >> 5], bit);
            }
        }
    }
    __syncthreads();
    // Each thread takes SEG_WORDS / WALK_THREADS consecutive words; a block-wide exclusive sum of
    // their keys places each thread's picks.
    constexpr int WORDS = SEG_WORDS / WALK_THREADS;
    uint32_t mine[WORDS], count = 0;
    const long long seg_base = (long long)s * SEG_KEYS;
#pragma unroll
    for (int i = 0; i < WORDS; ++i) {
        const long long base = seg_base + (long long)(t * WORDS + i) * 32;
        uint32_t x = twice[t * WORDS + i];
        if (base + 32 <= skip) x = 0;
        else if (base < skip) x &= 0xffffffffu << (skip - base);
        mine[i] = x;
        count += __popc(x);
    }
    const uint32_t incl = warp_inclusive(count, lane);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const uint32_t x = lane < WALK_THREADS / 32 ? warp_sums[lane] : 0;
        const uint32_t w_incl = warp_inclusive(x, lane);
        __syncwarp();
        if (lane < WALK_THREADS / 32) warp_sums[lane] = w_incl - x;
    }
    __syncthreads();
    uint32_t at = warp_sums[warp] + incl - count;
    uint32_t* out = picks + ((size_t)h * segs + s) * SEG_KEYS;
#pragma unroll
    for (int i = 0; i < WORDS; ++i) {
        const uint32_t base = (uint32_t)(seg_base + (t * WORDS + i) * 32) + first;
        for (uint32_t x = mine[i]; x != 0; x &= x - 1) out[at++] = base + __ffs(x) - 1;
    }
    if (t == WALK_THREADS - 1) counts[(size_t)h * segs + s] = at;
}

// The bias table read by linear interpolation at `cos` (lsh::interpolate's arithmetic; a NaN
// cosine reads as −1 here, through fmaxf).
__device__ __forceinline__ float interpolate(const float* table, int steps, float cos) {
    const float x = (fminf(fmaxf(cos, -1.f), 1.f) + 1.f) * 0.5f * (float)steps;
    const int i = min((int)x, steps - 1);
    const float frac = x - (float)i;
    return table[i] + frac * (table[i + 1] - table[i]);
}

__device__ __forceinline__ void load4(const float* p, float* x) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    x[0] = u.x;
    x[1] = u.y;
    x[2] = u.z;
    x[3] = u.w;
}

__device__ __forceinline__ void load4(const __nv_bfloat16* p, float* x) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    x[0] = __uint_as_float(u.x << 16);
    x[1] = __uint_as_float(u.x & 0xffff0000u);
    x[2] = __uint_as_float(u.y << 16);
    x[3] = __uint_as_float(u.y & 0xffff0000u);
}

// Where the attention reads a head's rows: values of the compute dtype (f32, bf16), or a context
// file's fp8 e4m3 codes with one f32 scale per row (value = code · scale, the file's decode).
// `load` gives the 4 values from channel `ch` of row `row` (of d values); `row_bytes` is what a
// row moves over the link.
template <typename T>
struct PlainRows {
    const T* p;
    __device__ __forceinline__ void load(size_t row, int d, int ch, float* x) const { load4(p + row * d + ch, x); }
    __device__ __forceinline__ static unsigned long long row_bytes(int d) { return (unsigned long long)d * sizeof(T); }
};

struct Fp8Rows {
    const uint8_t* codes;
    const float* scales;
    __device__ __forceinline__ void load(size_t row, int d, int ch, float* x) const {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + row * d + ch);
        const float s = scales[row];
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = fp8_value((__nv_fp8_storage_t)((w >> (8 * j)) & 0xff), s);
    }
    __device__ __forceinline__ static unsigned long long row_bytes(int d) { return (unsigned long long)d + 4; }
};

// One block per (segment, query head h0 + blockIdx.y) of a range of `heads` query heads: what
// the host needs of a walk, written where it reads it (host memory mapped into the device's
// address space: no copy to wait for, and the queue goes on to the GPU's own attention) — the
// range's counts, then `n_also` words of `also`, then the range's picks, head-major, each head's
// positions ascending, each slot's after those of every earlier (head, segment) of the range
// (the sum of the earlier counts, at most heads · MAX_SEGS, taken by each block). Nothing is
// written from word `cap` on: the host sums the counts and reports again into a larger buffer
// when the picks did not fit. A range of no heads launches one row of blocks for `also`.
extern "C" __global__ void __launch_bounds__(REPORT_THREADS)
    lsh_report(const uint32_t* picks, const uint32_t* counts, const uint32_t* also, uint32_t* out, int segs, int h0,
               int heads, int n_also, unsigned long long cap) {
    __shared__ uint32_t warp_sums[REPORT_THREADS / 32];
    const int s = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const uint32_t* mine = counts + (size_t)h0 * segs;
    const size_t slots = (size_t)heads * segs, lead = slots + n_also;
    if (s == 0 && blockIdx.y == 0) {
        for (size_t i = t; i < slots && i < cap; i += REPORT_THREADS) out[i] = mine[i];
        for (size_t i = t; i < (size_t)n_also && slots + i < cap; i += REPORT_THREADS) out[slots + i] = also[i];
    }
    if ((int)blockIdx.y >= heads) return;
    const int h = h0 + blockIdx.y;
    const int before = blockIdx.y * segs + s;
    uint32_t sum = 0;
    for (int i = t; i < before; i += REPORT_THREADS) sum += mine[i];
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    size_t at = lead;
    for (int w = 0; w < REPORT_THREADS / 32; ++w) at += warp_sums[w];
    const uint32_t n = mine[before];
    const uint32_t* from = picks + ((size_t)h * segs + s) * SEG_KEYS;
    for (uint32_t j = t; j < n && at + j < cap; j += REPORT_THREADS) out[at + j] = from[j];
}

// Blocks (gridDim.x per head) × ATTEND_WARPS warps share each head's sample, warp c taking
// picks c, c + W, c + 2W, … (W warps a head), a pick at a time: its K and V rows read where
// they lie, the logit scale·q·k + bias(cos), cos = (q·k − q·mean) / (|q| · |k − mean|), and
// an online softmax. Each warp writes its partial (Σ e·v over d channels, then the max and
// Σ e) for the merge.
// The query heads are the first gridDim.y of the `sampled` heads the sample's buffer holds.
// query [heads][d + 2]: q, then |q| and q·mean; weights: the bias table (steps + 1), then the
// keys' centred norms [kv_heads][n_idx] of indexed keys first..first + n_idx.
template <typename R>
__device__ void lsh_attend(const R k, const R v, const float* query, const uint32_t* sample, const float* weights,
                           float* part, int sampled, int segs, int d, int rows, int group, int first, int n_idx,
                           int steps, float scale, unsigned long long* link_bytes) {
    __shared__ uint32_t scan[MAX_SEGS + 1];
    const int h = blockIdx.y, kvh = h / group, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t cap = (size_t)segs * SEG_KEYS;
    const uint32_t* picks = sample + h * cap;
    const uint32_t* counts = sample + (size_t)sampled * cap + (size_t)h * segs;
    if (threadIdx.x == 0) {
        scan[0] = 0;
        for (int s = 0; s < segs; ++s) scan[s + 1] = scan[s] + counts[s];
    }
    __syncthreads();
    const uint32_t total = scan[segs];
    // What crosses the link: the sample's K and V rows, counted once a head (kernels/src/link).
    if (link_bytes != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
        atomicAdd(link_bytes, 2ull * total * R::row_bytes(d));
    // Strided, not a contiguous share each: the picks are ascending, so a head's warps read
    // neighbouring positions at the same time, and the translations of the few pages they touch
    // serve them all. Contiguous shares read 64 places of ~1 GiB at once and bound the reads at
    // ~21 GB/s against ~39 strided (H100, results/decode-2026-11-28-aba/zc-probe3.cu).
    const uint32_t warps = gridDim.x * ATTEND_WARPS, c = blockIdx.x * ATTEND_WARPS + warp;
    const float* q = query + (size_t)h * (d + 2);
    const float q_norm = q[d], q_mean = q[d + 1];
    const float* table = weights;
    const float* norms = weights + steps + 1 + (size_t)kvh * n_idx;
    float qr[LANE_VALUES], acc[LANE_VALUES];
#pragma unroll
    for (int i = 0; i < LANE_VALUES; i += 4) {
        const int ch = lane * 4 + i * 32;
        // A head's row of `query` is d + 2 floats: not a 16-byte multiple, read a value at a time.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            qr[i + j] = ch < d ? q[ch + j] : 0.f;
            acc[i + j] = 0.f;
        }
    }
    float mx = -INFINITY, sum = 0.f;
    int s = 0;
    for (uint32_t j = c; j < total; j += warps) {
        while (scan[s + 1] <= j) ++s;
        const uint32_t pos = picks[(size_t)s * SEG_KEYS + (j - scan[s])];
        const size_t row = (size_t)kvh * rows + pos;
        float kx[LANE_VALUES], vx[LANE_VALUES];
#pragma unroll
        for (int i = 0; i < LANE_VALUES; i += 4) {
            const int ch = lane * 4 + i * 32;
            if (ch < d) {
                k.load(row, d, ch, kx + i);
                v.load(row, d, ch, vx + i);
            } else {
#pragma unroll
                for (int u = 0; u < 4; ++u) kx[i + u] = vx[i + u] = 0.f;
            }
        }
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < LANE_VALUES; i += 4) {
            if (lane * 4 + i * 32 < d) {
#pragma unroll
                for (int u = 0; u < 4; ++u) dot += qr[i + u] * kx[i + u];
            }
        }
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float kn = fmaxf(norms[pos - first], FLT_MIN);
        const float z = scale * dot + interpolate(table, steps, (dot - q_mean) / (q_norm * kn));
        if (z > mx) {
            const float r = expf(mx - z);
            sum *= r;
#pragma unroll
            for (int i = 0; i < LANE_VALUES; ++i) acc[i] *= r;
            mx = z;
        }
        const float e = expf(z - mx);
        sum += e;
#pragma unroll
        for (int i = 0; i < LANE_VALUES; ++i) acc[i] += e * vx[i];
    }
    float* p = part + ((size_t)h * warps + c) * (d + 2);
#pragma unroll
    for (int i = 0; i < LANE_VALUES; i += 4) {
        const int ch = lane * 4 + i * 32;
        if (ch < d) {
#pragma unroll
            for (int u = 0; u < 4; ++u) p[ch + u] = acc[i + u];
        }
    }
    if (lane == 0) {
        p[d] = mx;
        p[d + 1] = sum;
    }
}

// k_scales and v_scales: each row's scale of fp8 rows (unread for f32 and bf16).
#define LSH_ATTEND(name, T, ROWS, K, V)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * ATTEND_WARPS)                                                \
        name(const T* k, const T* v, const float* k_scales, const float* v_scales, const float* query,            \
             const uint32_t* sample, const float* weights, float* part, int sampled, int segs, int d, int rows,   \
             int group, int first, int n_idx, int steps, float scale, unsigned long long* link_bytes) {            \
        lsh_attend<ROWS>(K, V, query, sample, weights, part, sampled, segs, d, rows, group, first, n_idx, steps,  \
                         scale, link_bytes);                                                                       \
    }

LSH_ATTEND(lsh_attend_f32, float, PlainRows<float>, PlainRows<float>{k}, PlainRows<float>{v})
LSH_ATTEND(lsh_attend_bf16, __nv_bfloat16, PlainRows<__nv_bfloat16>, PlainRows<__nv_bfloat16>{k},
           PlainRows<__nv_bfloat16>{v})
LSH_ATTEND(lsh_attend_fp8, uint8_t, Fp8Rows, (Fp8Rows{k, k_scales}), (Fp8Rows{v, v_scales}))
