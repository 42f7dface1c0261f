// RMSNorm of each row: out[c] = x[c] * rsqrt(mean(x^2) + eps) * w[c], f32 or bf16, one warp a
// row (a block a row where rows are few: rmsnorm_row_block). CPU reference: norm::reference (candle-nn's rms_norm); kernels/tests/norm.rs holds this
// kernel to candle's CUDA kernel bit for bit on fresh random inputs.
//
// Why: candle's kernel gives each row a block of 1024 threads (rows of 1024 values or more)
// that each square three or four values, then meet at a barrier to add their sums: at a 7B
// model's 3584-wide rows that ran at 29% of the copy bandwidth (8192 rows on an H200: 109 us,
// `folio bench kernels`, docs/performance.md). Here one warp takes a row and no barrier is
// needed (50 us there).
//
// The same bits as candle: candle's thread j (of B = 32 for rows under 1024 values, else 1024)
// sums x[c]^2 for c = j, j + B, ... in order; each warp of threads adds its 32 sums by a
// butterfly (xor 16, 8, 4, 2, 1); with B = 1024, lane l of a second butterfly takes warp l's
// total. Float addition commutes exactly, so every lane of a butterfly ends with the same bits,
// and the sum is one fixed tree, which a warp here rebuilds:
// - rows of 1024 values or more whose width is a whole number of 16-byte vectors
//   (rmsnorm_row_vec): lane l reads the vectors at c = VEC·l + 32·VEC·m, so it holds every
//   term of candle's threads j = VEC·l + e + 32·VEC·r (e < VEC, r < 1024 / (32·VEC)), in
//   candle's order; a butterfly step that pairs threads VEC or more apart is a shuffle between
//   lanes, a nearer one an add between the lane's own registers. Lane L then fetches candle
//   warp L's total and runs the second butterfly.
// - any other row (rmsnorm_row): lane l plays candle's threads l, l + 32, ..., l + B - 32 with
//   one value a load.
// The mean, rsqrtf and the two products are candle's expressions.

#include <cuda_bf16.h>
#include <stdint.h>

#define WARP 32
#define WARPS_PER_BLOCK 8
#define MAX_VIRTUAL_WARPS 32  // candle's 1024 threads

__device__ __forceinline__ float butterfly(float x) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xffffffff, x, mask, WARP);
    return x;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16(x); }

// VW: candle's warps per row (1 for rows under 1024 values, else 32).
template <typename T, int VW>
__device__ __forceinline__ void rmsnorm_row(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                                            int rows, int cols, float eps) {
    const int lane = threadIdx.x % WARP;
    const long long row = (long long)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP;
    if (row >= rows) return;  // a whole warp leaves: the shuffles below see full warps only
    const T* xr = x + row * cols;
    constexpr int B = VW * WARP;
    float sums[VW];
#pragma unroll
    for (int v = 0; v < VW; v++) sums[v] = 0.0f;
    for (int base = 0; base < cols; base += B) {
#pragma unroll
        for (int v = 0; v < VW; v++) {
            const int c = base + v * WARP + lane;
            if (c < cols) {
                const float xi = to_float(xr[c]);
                sums[v] += xi * xi;
            }
        }
    }
    float total = 0.0f;
#pragma unroll
    for (int v = 0; v < VW; v++) {
        const float s = butterfly(sums[v]);
        if (VW == 1 || v == lane) total = s;
    }
    if (VW > 1) total = butterfly(total);
    const float mean = total / cols;
    const float scale = rsqrtf(mean + eps);
    T* orow = out + row * cols;
    for (int c = lane; c < cols; c += WARP) store(orow + c, scale * to_float(xr[c]) * to_float(w[c]));
}

// 16 bytes of T.
template <typename T> struct Vec16;
template <> struct Vec16<float> { static constexpr int N = 4; };
template <> struct Vec16<__nv_bfloat16> { static constexpr int N = 8; };

template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[Vec16<T>::N]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < Vec16<T>::N; e++) out[e] = to_float(v[e]);
}

// Rows of at least 1024 values, cols % VEC == 0, rows 16-byte aligned (see the header).
template <typename T>
__device__ __forceinline__ void rmsnorm_row_vec(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                                                int rows, int cols, float eps) {
    constexpr int VEC = Vec16<T>::N;
    constexpr int SPAN = WARP * VEC;                        // values one warp-wide load covers
    constexpr int R = MAX_VIRTUAL_WARPS * WARP / SPAN;      // loads per 1024 values
    constexpr int LANES_PER_WARP_SUM = WARP / VEC;          // lanes holding one candle warp's threads
    const int lane = threadIdx.x % WARP;
    const long long row = (long long)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP;
    if (row >= rows) return;
    const T* xr = x + row * cols;
    // sums[r][e]: candle's thread VEC·lane + e + SPAN·r.
    float sums[R][VEC];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int e = 0; e < VEC; e++) sums[r][e] = 0.0f;
    for (int base = 0; base < cols; base += MAX_VIRTUAL_WARPS * WARP) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int c = base + r * SPAN + lane * VEC;
            if (c < cols) {
                float v[VEC];
                load_vec(xr + c, v);
#pragma unroll
                for (int e = 0; e < VEC; e++) sums[r][e] += v[e] * v[e];
            }
        }
    }
    // Candle's first butterfly over each of its warps' threads (i = j mod 32 = VEC·(lane mod
    // LANES_PER_WARP_SUM) + e).
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (mask >= VEC) {
#pragma unroll
                for (int e = 0; e < VEC; e++) sums[r][e] += __shfl_xor_sync(0xffffffff, sums[r][e], mask / VEC, WARP);
            } else {
                float next[VEC];
#pragma unroll
                for (int e = 0; e < VEC; e++) next[e] = sums[r][e] + sums[r][e ^ mask];
#pragma unroll
                for (int e = 0; e < VEC; e++) sums[r][e] = next[e];
            }
        }
    }
    // Candle warp W's total is sums[W / VEC][*] in lanes LANES_PER_WARP_SUM · (W mod VEC) + ...
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float s = __shfl_sync(0xffffffff, sums[r][0], LANES_PER_WARP_SUM * (lane % VEC), WARP);
        if (r == lane / VEC) total = s;
    }
    total = butterfly(total);
    const float mean = total / cols;
    const float scale = rsqrtf(mean + eps);
    T* orow = out + row * cols;
    for (int c = lane * VEC; c < cols; c += SPAN) {
        float xv[VEC], wv[VEC];
        load_vec(xr + c, xv);
        load_vec(w + c, wv);
        uint4 raw;
        T* o = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int e = 0; e < VEC; e++) store(o + e, scale * xv[e] * wv[e]);
        *reinterpret_cast<uint4*>(orow + c) = raw;
    }
}

// A few rows of 1024 values or more (a decode step's one token): a block of candle's 1024
// threads a row, in candle's own layout — thread j squares x[c] for c = j, j + 1024, ... in
// order, each warp adds by a butterfly, and every warp then runs the second butterfly over
// the 32 warps' totals, lane l taking warp l's. One warp walking a whole 3584-wide row took
// 10.7 us on an H200, 57 of them a 7B decode step. With a residual `r` (else null) the row
// normalised is x + r, added as candle adds two values of T, and written to `sum` too: a
// layer's residual add and the norm after it in one launch.
template <typename T>
__device__ __forceinline__ void rmsnorm_row_block(const T* __restrict__ x, const T* __restrict__ r,
                                                  const T* __restrict__ w, T* __restrict__ sum_out,
                                                  T* __restrict__ out, int cols, float eps) {
    __shared__ float warp_sums[MAX_VIRTUAL_WARPS];
    constexpr int B = MAX_VIRTUAL_WARPS * WARP;
    const int j = threadIdx.x, lane = j % WARP;
    const long long at = (long long)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = j; c < cols; c += B) {
        T v = x[at + c];
        if (r != nullptr) {
            v = v + r[at + c];
            sum_out[at + c] = v;
        }
        const float xi = to_float(v);
        sum += xi * xi;
    }
    sum = butterfly(sum);
    if (lane == 0) warp_sums[j / WARP] = sum;
    __syncthreads();
    const float total = butterfly(warp_sums[lane]);
    const float mean = total / cols;
    const float scale = rsqrtf(mean + eps);
    // This thread's own columns: the sums it wrote above.
    const T* src = r != nullptr ? sum_out : x;
    for (int c = j; c < cols; c += B) store(out + at + c, scale * to_float(src[at + c]) * to_float(w[c]));
}

// grid rows, block 1024; cols >= 1024; x, r, w, sum and out contiguous (r and sum null, or both not).
#define RMSNORM_BLOCK(T, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(MAX_VIRTUAL_WARPS * WARP)                          \
        NAME(const T* x, const T* r, const T* w, T* sum, T* out, int cols, float eps) {             \
        rmsnorm_row_block<T>(x, r, w, sum, out, cols, eps);                                         \
    }

RMSNORM_BLOCK(float, rmsnorm_block_f32)
RMSNORM_BLOCK(__nv_bfloat16, rmsnorm_block_bf16)

// grid ceil(rows / WARPS_PER_BLOCK), block WARPS_PER_BLOCK * WARP; x, w and out contiguous; with
// `vectors`, cols % (16 / sizeof(T)) == 0 and x, w and out 16-byte aligned.
#define RMSNORM(T, NAME)                                                                                  \
    extern "C" __global__ void NAME(const T* x, const T* w, T* out, int rows, int cols, float eps,       \
                                    int vectors) {                                                        \
        if (cols < 1024) rmsnorm_row<T, 1>(x, w, out, rows, cols, eps);                                  \
        else if (vectors) rmsnorm_row_vec<T>(x, w, out, rows, cols, eps);                                \
        else rmsnorm_row<T, MAX_VIRTUAL_WARPS>(x, w, out, rows, cols, eps);                               \
    }

RMSNORM(float, rmsnorm_f32)
RMSNORM(__nv_bfloat16, rmsnorm_bf16)
