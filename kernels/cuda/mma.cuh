// What the mma.sync kernels share (the prefill kernels, sparse.cu's decode over rows): the bf16
// m16n8k16 product with f32 accumulation, packing two f32 into a bf16 pair (the accumulator
// layout of one product is the A-operand layout of the next), the asynchronous copy of a tile
// of rows into padded shared memory, the query fragments, an accumulator's row scaling and the
// P·V product over 16 rows.
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

// A fragments of a 16-row block of queries (rows g and g + 8 of it, `q0` and `q1`, D bf16 each,
// read as 32-bit words) for the DK = D / 16 k-chunks of a QK product; a row not `has` reads as
// zeros (its pointer is not dereferenced).
template <int DK>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qa)[DK][4], const uint32_t* q0, const uint32_t* q1,
                                                 bool has0, bool has1, int t) {
#pragma unroll
    for (int c = 0; c < DK; c++) {
        const int w = (c * 16 + t * 2) / 2;  // 32-bit word of the column pair
        qa[c][0] = has0 ? q0[w] : 0u;
        qa[c][1] = has1 ? q1[w] : 0u;
        qa[c][2] = has0 ? q0[w + 4] : 0u;
        qa[c][3] = has1 ? q1[w + 4] : 0u;
    }
}

// Scales an accumulator's rows: this thread's row g by alpha[0], row g + 8 by alpha[1].
template <int DN>
__device__ __forceinline__ void scale_rows(float (&o)[DN][4], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < DN; n++) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
    }
}

// o += P · V over 16 rows of V in shared memory (`v16`, row stride STRIDE bf16): `pa` is P's A
// fragment for those 16 rows. ldmatrix.trans hands each lane V[2t (+1)][8n + g] (and 8 rows on):
// the B fragment of the product, two n-tiles per instruction; lane L addresses row L % 16 at
// column 8 * (n + L / 16).
template <int DN, int STRIDE>
__device__ __forceinline__ void pv_16_rows(float (&o)[DN][4], const uint32_t (&pa)[4], const __nv_bfloat16* v16,
                                           int lane) {
    const uint32_t row_addr = (uint32_t)__cvta_generic_to_shared(v16 + (lane % 16) * STRIDE + (lane / 16) * 8);
#pragma unroll
    for (int n = 0; n < DN; n += 2) {
        uint32_t b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "r"(row_addr + n * 8 * 2));
        mma_bf16(o[n], pa, b0, b1);
        mma_bf16(o[n + 1], pa, b2, b3);
    }
}
