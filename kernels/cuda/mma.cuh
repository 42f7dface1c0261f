// What the mma.sync kernels share (the prefill kernels, sparse.cu's decode over rows): the bf16
// m16n8k16 product with f32 accumulation, packing two f32 into a bf16 pair (the accumulator
// layout of one product is the A-operand layout of the next), and the asynchronous copy of a
// tile of rows into padded shared memory.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Starts the copy of ROWS rows of D bf16 (row stride D in global memory) into shared memory
// with row stride D + PAD, by the block's threads; rows past `valid` are zero-filled (cp.async
// reads 0 bytes of them).
template <int D, int ROWS, int PAD>
__device__ __forceinline__ void load_rows_async(__nv_bfloat16* dst, const __nv_bfloat16* src, int valid) {
    constexpr int VECS = D / 8;  // 16-byte pieces per row
    for (int i = threadIdx.x; i < ROWS * VECS; i += blockDim.x) {
        const int r = i / VECS, c = (i % VECS) * 8;
        const uint32_t to = (uint32_t)__cvta_generic_to_shared(dst + r * (D + PAD) + c);
        const __nv_bfloat16* from = r < valid ? src + (size_t)r * D + c : src;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(r < valid ? 16 : 0)
                     : "memory");
    }
}
