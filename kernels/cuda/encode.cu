// K/V rows to fp8 e4m3 with one f32 scale per row, on the device: a prefill's layer leaves the
// GPU as the file's bytes (1 byte a value) instead of f32 (4 bytes) encoded on the CPU.
// CPU reference: encode::fp8_row (the context file's codec calls it); kernels/tests/encode.rs
// holds this kernel to it byte for byte on fresh random rows.
//
// One warp per row: the row's largest magnitude (warp max), scale = amax / 448 (1 for an all-zero
// row), each value divided by the scale and rounded to nearest even with saturation to the
// largest finite e4m3 (the CPU's float8 conversion is the same rule). A row holding a NaN or an
// infinity gets a NaN scale: the caller refuses it, as the CPU path does.
//
// out: rows * d codes, then rows f32 scales (at byte rows * d: d % 4 == 0 keeps them aligned).

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define FP8_E4M3_MAX 448.0f
#define ROWS_PER_BLOCK 8  // one warp each

template <typename T>
__device__ __forceinline__ float value(const T* p);
template <>
__device__ __forceinline__ float value(const float* p) {
    return *p;
}
template <>
__device__ __forceinline__ float value(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
}

template <typename T>
__device__ void fp8_rows(const T* __restrict__ x, uint8_t* __restrict__ out, int rows, int d) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T* r = x + (size_t)row * d;
    float amax = 0.f;
    bool finite = true;
    for (int i = lane; i < d; i += 32) {
        const float v = value(r + i);
        finite = finite && isfinite(v);
        amax = fmaxf(amax, fabsf(v));
    }
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    finite = __all_sync(0xffffffff, finite);
    const float scale = amax > 0.f ? amax / FP8_E4M3_MAX : 1.f;
    uint8_t* codes = out + (size_t)row * d;
    for (int i = lane; i < d; i += 32) codes[i] = __nv_cvt_float_to_fp8(value(r + i) / scale, __NV_SATFINITE, __NV_E4M3);
    if (lane == 0) reinterpret_cast<float*>(out + (size_t)rows * d)[row] = finite ? scale : NAN;
}

// grid ceil(rows / ROWS_PER_BLOCK), block 32 * ROWS_PER_BLOCK.
extern "C" __global__ void fp8_rows_bf16(const __nv_bfloat16* x, uint8_t* out, int rows, int d) {
    fp8_rows(x, out, rows, d);
}
extern "C" __global__ void fp8_rows_f32(const float* x, uint8_t* out, int rows, int d) { fp8_rows(x, out, rows, d); }
