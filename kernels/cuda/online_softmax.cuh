// What both prefill kernels (flash.cu, flash_sm90a.cu) share: the key range a query tile sees,
// the online-softmax step per key tile and its finish, where each thread holds two query rows (the mma
// accumulator layout: rows g and g + 8 of 16) whose 4 threads of a quad share each row's columns.
#pragma once

#define LOG2E 1.4426950408889634f  // scores in log2 units: exp2 is one instruction
#define LN2 0.6931471805599453f

// 2^x in one MUFU instruction: exp2f without fast-math also handles results in the denormal
// range with extra instructions per call, and a probability below 2^-126 is 0 to bf16 P and
// to the f32 row sums anyway. exp2(-inf) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The keys (local indices j_lo..j_hi of a block at positions k_start..k_start + kv_len) some
// query of rows i0..i0 + rows (at positions q_offset + i) may see: causal, within `window`
// when it is positive.
__device__ __forceinline__ void tile_key_range(long long q_offset, int i0, int rows, long long window, long long k_start,
                                               int kv_len, int& j_lo, int& j_hi) {
    const long long p_first = q_offset + i0, p_last = q_offset + i0 + rows - 1;
    long long lo_pos = window > 0 ? p_first - window + 1 : 0;
    if (lo_pos < k_start) lo_pos = k_start;
    long long hi_pos = p_last + 1;
    if (hi_pos > k_start + kv_len) hi_pos = k_start + kv_len;
    j_lo = (int)(lo_pos - k_start);
    j_hi = (int)(hi_pos - k_start);
}

// Given this tile's row maxima `mx` (this thread's share, in log2 units), finishes them over
// the quad, then moves the running max `m` and sum `l` to them: `shift` is what the tile's
// scores are reduced by before exp2, `alpha` what the output accumulated so far is scaled by.
// A row that has seen nothing yet shifts by 0: exp2(-inf - 0) = 0, never NaN.
__device__ __forceinline__ void online_softmax_step(float (&m)[2], float (&l)[2], float (&mx)[2], float (&shift)[2],
                                                    float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        shift[r] = mx[r] == -INFINITY ? 0.f : mx[r];
        alpha[r] = exp2f(m[r] - shift[r]);
        m[r] = mx[r];
        l[r] *= alpha[r];
    }
}

// After the last tile: each row's sum over the quad, the factor its output is scaled by (0 for
// a row that saw no key), and its log-sum-exp in natural units (-inf for such a row; `m` is in
// log2 units).
__device__ __forceinline__ void online_softmax_finish(const float (&m)[2], float (&l)[2], float (&inv)[2],
                                                      float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
        inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        lse[r] = l[r] > 0.f ? (m[r] + log2f(l[r])) * LN2 : -INFINITY;
    }
}
