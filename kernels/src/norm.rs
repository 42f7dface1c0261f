//! RMSNorm of each row on CUDA, one warp a row (a block a row where there are few): the same bits
//! as candle's kernel, without its block-wide barrier where rows are many.
//!
//! Why: a prefill normalises every token twice a layer. candle's CUDA kernel gives each row of
//! 1024 values or more a block of 1024 threads that square three or four values each and then
//! meet at a barrier: at a 7B model's 3584-wide rows (8192 of them, an H200) it took 109 µs, 29%
//! of the copy bandwidth (`folio bench kernels`, docs/performance.md). The kernel
//! (kernels/cuda/rmsnorm.cu) has one warp play candle's 1024 threads with 16-byte loads, adding
//! in their order, so the result is candle's to the bit and the model's output does not move
//! (50 µs there). A decode step's one row is the other way round: one warp walking 3584 values
//! took 10.7 µs, 57 times a step of a 7B model; up to 256 rows each gets candle's own block of
//! 1024 threads, in candle's order too, and [`add_rms_norm`] adds the layer's residual in the
//! same launch (the residual add was one more ~2.5 µs launch a layer). The reference is candle-nn's `rms_norm`, which every other dtype and device
//! runs (on the CPU it is candle's own arithmetic, not this kernel's).

use candle_core::{Result, Tensor};

/// `x` (`[.., n]`) normalised over its last dimension, times `w` (`[n]`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if cuda::runs(x, w)? {
        return crate::layout::vector_aligned(x)?
            .apply_op2_no_bwd(&crate::layout::vector_aligned(w)?, &crate::cuda_op::CudaOnly(cuda::RmsNorm { eps }));
    }
    reference(x, w, eps)
}

/// candle-nn's `rms_norm`: what the kernel is held to, and what every other case runs.
pub fn reference(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    candle_nn::ops::rms_norm(x, w, eps)
}

/// `x + r` and that sum normalised as [`rms_norm`] does: a layer's residual add and the norm
/// after it, in one launch on CUDA where the rows are few (a decode step's), the same bits as
/// [`add_rms_norm_reference`].
pub fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.dims() == r.dims() && x.dtype() == r.dtype() && cuda::runs(x, w)? && cuda::few_rows(x)? {
        let both = x.contiguous()?.apply_op3_no_bwd(
            &r.contiguous()?,
            &w.contiguous()?,
            &crate::cuda_op::CudaOnly(cuda::AddRmsNorm { eps }),
        )?;
        return Ok((both.get(0)?, both.get(1)?));
    }
    add_rms_norm_reference(x, r, w, eps)
}

/// candle's add, then [`rms_norm`]: what [`add_rms_norm`] is held to.
pub fn add_rms_norm_reference(x: &Tensor, r: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let sum = (x + r)?;
    let normed = rms_norm(&sum, w, eps)?;
    Ok((sum, normed))
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

    use crate::cuda_op::{CudaOp2, CudaOp3};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rmsnorm.ptx"));
    const MODULE: &str = "folio_rmsnorm";
    /// WARPS_PER_BLOCK in the kernel: rows a block takes, one a warp.
    const ROWS_PER_BLOCK: usize = 8;
    const WARP: usize = 32;
    /// The kernel's vector loads.
    const VECTOR_BYTES: usize = 16;
    /// Up to this many rows (of 1024 values or more) a row gets a block of candle's 1024
    /// threads (`rmsnorm_block_*`) rather than a warp: about what the multiprocessors hold at
    /// once (two such blocks each on an H200's 132), past which the warps' rows in parallel
    /// win (a prefill chunk's thousands).
    const BLOCK_ROWS: usize = 256;
    /// candle's threads a row of 1024 values or more (MAX_VIRTUAL_WARPS · WARP).
    const BLOCK_THREADS: usize = 1024;

    /// Whether the kernels take `x` and `w`: both on CUDA, bf16 or f32 alike, `w` a row's width.
    pub fn runs(x: &Tensor, w: &Tensor) -> Result<bool> {
        if !x.device().is_cuda() || x.dtype() != w.dtype() || !matches!(x.dtype(), DType::BF16 | DType::F32) {
            return Ok(false);
        }
        let n = x.dim(candle_core::D::Minus1)?;
        if w.dims1()? != n {
            candle_core::bail!("rms norm: rows of {n} values and {} weights", w.elem_count());
        }
        Ok(true)
    }

    /// Whether `x`'s rows get a block each (few, and wide).
    pub fn few_rows(x: &Tensor) -> Result<bool> {
        let cols = x.dim(candle_core::D::Minus1)?;
        Ok(block_a_row(x.elem_count() / cols.max(1), cols))
    }

    /// Whether `rows` rows of `cols` values get a block each rather than a warp.
    fn block_a_row(rows: usize, cols: usize) -> bool {
        rows <= BLOCK_ROWS && cols >= BLOCK_THREADS
    }

    /// Rows and columns of `xl`, checked against the kernels' i32 indices.
    fn rows_cols(xl: &Layout) -> Result<(usize, usize)> {
        let count = xl.shape().elem_count();
        let cols = xl.shape().dims().last().copied().unwrap_or(1).max(1);
        let rows = count / cols;
        if rows > i32::MAX as usize || cols > i32::MAX as usize {
            candle_core::bail!("rms norm: {rows} rows of {cols} values are past the kernel's i32 indices");
        }
        Ok((rows, cols))
    }

    /// `rmsnorm_block_*`'s launch over `rows` rows of `cols`: a block of 1024 threads a row.
    fn block_config(rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK_THREADS as u32, 1, 1), shared_mem_bytes: 0 }
    }

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
            let (rows, cols) = rows_cols(xl)?;
            let count = rows * cols;
            let dev = x.device().clone();
            // SAFETY: every output value is written by the warp owning its row.
            let out = unsafe { dev.alloc::<T>(count.max(1))? };
            if count > 0 {
                let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
                let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
                if block_a_row(rows, cols) {
                    let (cols, null) = (cols as i32, 0u64);
                    let func = dev.get_or_load_custom_func(&name.replace("rmsnorm_", "rmsnorm_block_"), MODULE, PTX)?;
                    let mut b = func.builder();
                    b.arg(&xs).arg(&null).arg(&ws).arg(&null).arg(&out).arg(&cols).arg(&self.eps);
                    // SAFETY: x is rows × cols contiguous and w holds cols values (checked by
                    // the caller); out holds rows · cols; no residual.
                    unsafe { b.launch(block_config(rows)) }.w()?;
                    return Ok(CudaStorage::wrap_cuda_slice(out, dev));
                }
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

    /// [`super::add_rms_norm`]'s launch: inputs x, r, w (contiguous, few wide rows); the output
    /// `[2, ..x]` holds the sum, then the normalised sum.
    pub struct AddRmsNorm {
        pub eps: f32,
    }

    impl AddRmsNorm {
        fn launch<T: DeviceRepr + candle_core::cuda::CudaDType>(
            &self,
            name: &str,
            [(x, xl), (r, rl), (w, wl)]: [(&CudaStorage, &Layout); 3],
        ) -> Result<CudaStorage> {
            let (rows, cols) = rows_cols(xl)?;
            let count = rows * cols;
            let dev = x.device().clone();
            // SAFETY: the kernel writes both halves, every value of them.
            let mut both = unsafe { dev.alloc::<T>((2 * count).max(1))? };
            if count > 0 {
                let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
                let rs = r.as_cuda_slice::<T>()?.slice(rl.start_offset()..);
                let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
                let (mut sum, mut out) = both.split_at_mut(count);
                let cols = cols as i32;
                let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&xs).arg(&rs).arg(&ws).arg(&mut sum).arg(&mut out).arg(&cols).arg(&self.eps);
                // SAFETY: x and r are rows × cols contiguous, w holds cols values (checked by
                // the caller); `both` holds the sum's rows · cols, then the output's.
                unsafe { b.launch(block_config(rows)) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(both, dev))
        }
    }

    impl CudaOp3 for AddRmsNorm {
        const NAME: &'static str = "folio-add-rms-norm";

        fn cuda_fwd(&self, inputs: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)> {
            let xl = inputs[0].1;
            let out = match inputs[0].0.dtype() {
                DType::BF16 => self.launch::<half::bf16>("rmsnorm_block_bf16", inputs)?,
                DType::F32 => self.launch::<f32>("rmsnorm_block_f32", inputs)?,
                other => candle_core::bail!("add rms norm of {other:?} runs candle's ops, not this kernel"),
            };
            let mut dims = vec![2];
            dims.extend_from_slice(xl.shape().dims());
            Ok((out, Shape::from(dims)))
        }
    }
}
