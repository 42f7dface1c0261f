//! RMSNorm of each row on CUDA with one warp a row: the same bits as candle's kernel, without
//! its block-wide barrier.
//!
//! Why: a prefill normalises every token twice a layer. candle's CUDA kernel gives each row of
//! 1024 values or more a block of 1024 threads that square three or four values each and then
//! meet at a barrier: at a 7B model's 3584-wide rows (8192 of them, an H200) it took 109 µs, 29%
//! of the copy bandwidth (`folio bench kernels`, docs/performance.md). The kernel
//! (kernels/cuda/rmsnorm.cu) has one warp play candle's 1024 threads with 16-byte loads, adding
//! in their order, so the result is candle's to the bit and the model's output does not move
//! (50 µs there). The reference is candle-nn's `rms_norm`, which every other dtype and device
//! runs (on the CPU it is candle's own arithmetic, not this kernel's).

use candle_core::{Result, Tensor};

/// `x` (`[.., n]`) normalised over its last dimension, times `w` (`[n]`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && x.dtype() == w.dtype()
        && matches!(x.dtype(), candle_core::DType::BF16 | candle_core::DType::F32)
    {
        let n = x.dim(candle_core::D::Minus1)?;
        if w.dims1()? != n {
            candle_core::bail!("rms norm: rows of {n} values and {} weights", w.elem_count());
        }
        return crate::layout::vector_aligned(x)?
            .apply_op2_no_bwd(&crate::layout::vector_aligned(w)?, &crate::cuda_op::CudaOnly(cuda::RmsNorm { eps }));
    }
    reference(x, w, eps)
}

/// candle-nn's `rms_norm`: what the kernel is held to, and what every other case runs.
pub fn reference(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    candle_nn::ops::rms_norm(x, w, eps)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};

    use crate::cuda_op::CudaOp2;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rmsnorm.ptx"));
    const MODULE: &str = "folio_rmsnorm";
    /// WARPS_PER_BLOCK in the kernel: rows a block takes, one a warp.
    const ROWS_PER_BLOCK: usize = 8;
    const WARP: usize = 32;
    /// The kernel's vector loads.
    const VECTOR_BYTES: usize = 16;

    pub struct RmsNorm {
        pub eps: f32,
    }

    impl RmsNorm {
        fn launch<T: DeviceRepr + candle_core::cuda::CudaDType>(
            &self,
            name: &str,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> Result<CudaStorage> {
            let count = xl.shape().elem_count();
            let cols = xl.shape().dims().last().copied().unwrap_or(1).max(1);
            let rows = count / cols;
            if rows > i32::MAX as usize || cols > i32::MAX as usize {
                candle_core::bail!("rms norm: {rows} rows of {cols} values are past the kernel's i32 indices");
            }
            let dev = x.device().clone();
            // SAFETY: every output value is written by the warp owning its row.
            let out = unsafe { dev.alloc::<T>(count.max(1))? };
            if count > 0 {
                let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
                let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
                    block_dim: ((ROWS_PER_BLOCK * WARP) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // Whole 16-byte vectors a row: every row starts on a 16-byte boundary too.
                let vectors = i32::from((cols * std::mem::size_of::<T>()).is_multiple_of(VECTOR_BYTES));
                let (rows, cols) = (rows as i32, cols as i32);
                let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&xs).arg(&ws).arg(&out).arg(&rows).arg(&cols).arg(&self.eps).arg(&vectors);
                // SAFETY: x is rows × cols contiguous and w holds cols values (checked by the
                // caller), both starting 16-byte aligned (vector_aligned), as out does (fresh);
                // out holds rows · cols.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
    }

    impl CudaOp2 for RmsNorm {
        const NAME: &'static str = "folio-rms-norm";

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
            let out = match x.dtype() {
                DType::BF16 => self.launch::<half::bf16>("rmsnorm_bf16", x, xl, w, wl)?,
                DType::F32 => self.launch::<f32>("rmsnorm_f32", x, xl, w, wl)?,
                other => candle_core::bail!("rms norm of {other:?} runs candle's kernel, not this one"),
            };
            Ok((out, xl.shape().clone()))
        }
    }
}
