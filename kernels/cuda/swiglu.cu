// The gated MLP's activation in one pass: out = SiLU(gate) * up, bf16 in and out.
// CPU reference: mlp::swiglu's candle path (SiLU, then the product); kernels/tests/mlp.rs
// holds this kernel to it bit for bit on fresh random inputs.
//
// Why: candle runs SiLU and the product as two passes, and the second reads the gate's SiLU
// back: 5 bf16 values of traffic per element instead of 3 (H200, 8192 x 18944: 1.08 ms against
// PyTorch's 0.38 ms; docs/performance.md). The arithmetic is candle's and PyTorch's to the bit:
// SiLU in f32 (x / (1 + exp(-x)), IEEE division and expf) rounded to bf16, then the product of
// two bf16 values (exact in f32) rounded to bf16.
//
// Each thread takes VEC consecutive elements (16-byte loads and stores); the tail past the
// last whole vector goes element by element.

#include <cuda_bf16.h>
#include <stdint.h>

#define VEC 8  // bf16 values in 16 bytes

__device__ __forceinline__ __nv_bfloat16 swiglu_one(__nv_bfloat16 g, __nv_bfloat16 u) {
    const float x = __bfloat162float(g);
    const __nv_bfloat16 silu = __float2bfloat16(x / (1.0f + expf(-x)));
    return __float2bfloat16(__bfloat162float(silu) * __bfloat162float(u));
}

// grid ceil(n / VEC / blockDim.x); gate, up and out 16-byte aligned.
extern "C" __global__ void swiglu_bf16(const __nv_bfloat16* __restrict__ gate, const __nv_bfloat16* __restrict__ up,
                                       __nv_bfloat16* __restrict__ out, unsigned long long n) {
    const unsigned long long v = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x, i0 = v * VEC;
    if (i0 + VEC <= n) {
        const uint4 gv = *reinterpret_cast<const uint4*>(gate + i0), uv = *reinterpret_cast<const uint4*>(up + i0);
        const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(&gv);
        const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(&uv);
        uint4 ov;
        __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&ov);
#pragma unroll
        for (int e = 0; e < VEC; e++) o[e] = swiglu_one(g[e], u[e]);
        *reinterpret_cast<uint4*>(out + i0) = ov;
    } else {
        for (unsigned long long i = i0; i < n; i++) out[i] = swiglu_one(gate[i], up[i]);
    }
}
