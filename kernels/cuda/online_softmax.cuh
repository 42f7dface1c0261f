// The online-softmax step both prefill kernels take per key tile (flash.cu, flash_sm90a.cu):
// each thread holds two query rows (the mma accumulator layout: rows g and g + 8 of 16), whose
// 4 threads of a quad share each row's columns.
#pragma once

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
