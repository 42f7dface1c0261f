// A decode step's projection: y[n] = sum_k x[k] * w[n][k] for one row x of bf16 and a
// row-major bf16 weight w [N][K] (a Linear's), f32 sums, y rounded to bf16 once. A warp a
// weight row: each lane reads 16-byte vectors (8 values) of it and of x, GEMV_UNROLL of them in
// flight, then the warp adds its lanes' sums. CPU reference: candle's matmul
// (gemv::reference); kernels/tests/gemv.rs holds the kernel to the definition within f32
// summation and one bf16 rounding.
//
// Why not cuBLAS's: its decode GEMVs (nvjet, 384 threads x 168 registers, in clusters of 4)
// take a whole multiprocessor a block. A kernel on a second stream that holds a block on some
// multiprocessors (HiP's search, waiting on the host link for ~2 ms) then leaves them no room,
// and a GEMV of 100-132 blocks runs in two waves. These blocks are 256 threads of a few dozen
// registers: they share a multiprocessor with anything, and the grid's thousands of them
// spread over whatever is free.

#include <cuda_bf16.h>
#include <stdint.h>

#define GEMV_WARPS 8
#define GEMV_UNROLL 4
#define VEC 8

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 fa = __bfloat1622float2(a2[i]), fb = __bfloat1622float2(b2[i]);
        s = fmaf(fa.x, fb.x, s);
        s = fmaf(fa.y, fb.y, s);
    }
    return s;
}

// grid ceil(n / GEMV_WARPS), block GEMV_WARPS * 32; k % VEC == 0; x and w 16-byte aligned.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y,
              int n, int k) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    if (row >= n) return;  // a whole warp leaves
    const uint4* wr = reinterpret_cast<const uint4*>(w + row * k);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int vecs = k / VEC;
    float sum = 0.f;
    int v = lane;
    for (; v + 32 * (GEMV_UNROLL - 1) < vecs; v += 32 * GEMV_UNROLL) {
        uint4 a[GEMV_UNROLL], b[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            a[u] = __ldg(wr + v + 32 * u);
            b[u] = __ldg(xv + v + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) sum += dot8(a[u], b[u]);
    }
    for (; v < vecs; v += 32) sum += dot8(__ldg(wr + v), __ldg(xv + v));
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, s);
    if (lane == 0) y[row] = __float2bfloat16(sum);
}
