//! A decode step's projection on CUDA: one bf16 row times a bf16 weight, `x @ W^T`, with
//! blocks small enough to share a multiprocessor.
//!
//! Why: cuBLAS's decode GEMVs are fast alone (3.6–3.7 TB/s of weights on an H200) but each of
//! their blocks fills a multiprocessor (168 registers × 384 threads), in clusters of four. While
//! a kernel on a second stream holds a block on some multiprocessors — HiP's search waits ~2 ms
//! a layer on the host link, 28 blocks — the GEMVs' clusters fit fewer to a wave and a step ran
//! 3 ms longer with its searches than without (docs/results/2026-12-01-decode-kernels). This
//! kernel (kernels/cuda/gemv.cu) gives each weight row a warp and each block 256 threads of a
//! few dozen registers, so its thousands of blocks fill whatever is free. It sums in f32 in its
//! own order and rounds once, so it is held to the definition within that, not to cuBLAS's bits;
//! every other shape, dtype and device runs candle's matmul.

use candle_core::{Result, Tensor};

/// `x @ w^T` for `x` `[rows, k]` and `w` `[n, k]`: the kernel where `x` is one bf16 row on CUDA
/// and `w` bf16 with `k` a multiple of 8, candle's matmul otherwise.
pub fn product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && x.dtype() == candle_core::DType::BF16
        && w.dtype() == candle_core::DType::BF16
        && x.rank() == 2
        && x.dim(0)? == 1
        && w.rank() == 2
        && w.dim(1)? == x.dim(1)?
        && x.dim(1)?.is_multiple_of(cuda::VEC)
        && w.dim(0)? <= i32::MAX as usize
    {
        let w = crate::layout::vector_aligned(w)?;
        return crate::layout::vector_aligned(x)?.apply_op2_no_bwd(&w, &crate::cuda_op::CudaOnly(cuda::Gemv));
    }
    reference(x, w)
}

/// candle's matmul: what every other case runs, and the tests' other side.
pub fn reference(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.matmul(&w.t()?)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use crate::cuda_op::CudaOp2;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gemv.ptx"));
    const MODULE: &str = "folio_gemv";
    /// GEMV_WARPS in the kernel: weight rows a block takes, a warp each.
    const ROWS_PER_BLOCK: usize = 8;
    /// VEC in the kernel: bf16 values a 16-byte load holds.
    pub const VEC: usize = 8;

    pub struct Gemv;

    impl CudaOp2 for Gemv {
        const NAME: &'static str = "folio-gemv";

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (n, k) = wl.shape().dims2()?;
            let dev = x.device().clone();
            // SAFETY: a warp writes each output value.
            let y = unsafe { dev.alloc::<half::bf16>(n.max(1))? };
            if n > 0 {
                let xs = x.as_cuda_slice::<half::bf16>()?.slice(xl.start_offset()..);
                let ws = w.as_cuda_slice::<half::bf16>()?.slice(wl.start_offset()..);
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
                    block_dim: ((ROWS_PER_BLOCK * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let (n_i, k_i) = (n as i32, k as i32);
                let func = dev.get_or_load_custom_func("gemv_bf16", MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&xs).arg(&ws).arg(&y).arg(&n_i).arg(&k_i);
                // SAFETY: x holds k and w n × k contiguous bf16, both 16-byte aligned
                // (vector_aligned), k % 8 == 0 (checked by the caller); y holds n.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((CudaStorage::wrap_cuda_slice(y, dev), Shape::from((1, n))))
        }
    }
}
