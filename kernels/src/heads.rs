//! A projection's output as attention heads: `[t, n * hd]` plus the projection's bias, if any,
//! to `[n, t, hd]` ([`split`]), and attention's heads back as rows for the output projection
//! ([`merge`]), each in one pass on CUDA.
//!
//! Why: every layer of a prefill does this to Q, K and V, and back to its attention output.
//! candle adds the bias in one pass and moves the heads in another, through its general strided
//! copy (an index computed per element: 0.71 s for Q, K and V of a 7B model at 128k tokens,
//! against 0.16 s for their products); the kernels (kernels/cuda/heads.cu) read each value once
//! and write it once, 16 bytes at a time, and add the bias as candle does, so the result is the
//! same to the bit. The references are candle's ops; every other dtype and device runs them.

use candle_core::{Result, Tensor};

/// `y` (`[t, n * hd]`) plus `bias` (`[n * hd]`) as `[n, t, hd]`.
pub fn split(y: &Tensor, bias: Option<&Tensor>, n: usize, hd: usize) -> Result<Tensor> {
    let (_, width) = y.dims2()?;
    if n == 0 || hd == 0 || width != n * hd || bias.is_some_and(|b| b.dims() != [width] || b.dtype() != y.dtype()) {
        candle_core::bail!(
            "split heads: rows of {width} values (bias {:?}) are not {n} heads of {hd}",
            bias.map(|b| (b.dims().to_vec(), b.dtype()))
        );
    }
    #[cfg(feature = "cuda")]
    if y.device().is_cuda() && y.dtype() == candle_core::DType::BF16 && hd % cuda::VEC == 0 {
        let y = crate::vector_aligned(y)?;
        let op = crate::cuda_op::CudaOnly(cuda::SplitHeads { n, hd });
        return match bias {
            Some(b) => y.apply_op2_no_bwd(&crate::vector_aligned(b)?, &op),
            None => y.apply_op1_no_bwd(&op),
        };
    }
    reference(y, bias, n, hd)
}

/// candle's ops: what the kernel is held to, and what every other case runs.
pub fn reference(y: &Tensor, bias: Option<&Tensor>, n: usize, hd: usize) -> Result<Tensor> {
    let t = y.dim(0)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y.clone(),
    };
    y.reshape((t, n, hd))?.transpose(0, 1)?.contiguous()
}

/// Heads `a` (`[n, t, hd]`) as rows `[t, n * hd]`.
pub fn merge(a: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if a.device().is_cuda() && a.dtype() == candle_core::DType::BF16 {
        let (n, _, hd) = a.dims3()?;
        if hd > 0 && hd % cuda::VEC == 0 && n > 0 {
            return crate::vector_aligned(a)?.apply_op1_no_bwd(&crate::cuda_op::CudaOnly(cuda::MergeHeads { n, hd }));
        }
    }
    merge_reference(a)
}

/// candle's ops for [`merge`]: what the kernel is held to, and what every other case runs.
pub fn merge_reference(a: &Tensor) -> Result<Tensor> {
    let (n, t, hd) = a.dims3()?;
    a.transpose(0, 1)?.reshape((t, n * hd))
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use crate::cuda_op::{CudaOp1, CudaOp2};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/heads.ptx"));
    const MODULE: &str = "folio_heads";
    /// VEC in the kernel: bf16 values a thread moves (16 bytes).
    pub const VEC: usize = 8;
    const THREADS: usize = 256;

    pub struct SplitHeads {
        pub n: usize,
        pub hd: usize,
    }

    impl SplitHeads {
        fn launch(
            &self,
            y: &CudaStorage,
            yl: &Layout,
            bias: Option<(&CudaStorage, &Layout)>,
        ) -> Result<(CudaStorage, Shape)> {
            let (n, hd) = (self.n, self.hd);
            let count = yl.shape().elem_count();
            let t = count / (n * hd);
            if t > i32::MAX as usize || n * hd > i32::MAX as usize {
                candle_core::bail!("split heads: {t} rows of {n} x {hd} values are past the kernel's i32 indices");
            }
            let dev = y.device().clone();
            // SAFETY: every output vector is written by the thread owning it.
            let out = unsafe { dev.alloc::<half::bf16>(count.max(1))? };
            if count > 0 {
                let ys = y.as_cuda_slice::<half::bf16>()?.slice(yl.start_offset()..);
                let cfg = LaunchConfig {
                    grid_dim: ((count / VEC).div_ceil(THREADS) as u32, 1, 1),
                    block_dim: (THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ints = [t as i32, n as i32, hd as i32];
                let name = if bias.is_some() { "split_heads_bias_bf16" } else { "split_heads_bf16" };
                let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&ys);
                let bs = bias
                    .map(|(b, bl)| b.as_cuda_slice::<half::bf16>().map(|s| s.slice(bl.start_offset()..)))
                    .transpose()?;
                if let Some(bs) = &bs {
                    b.arg(bs);
                }
                b.arg(&out).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]);
                // SAFETY: y is t × n·hd contiguous bf16 and the bias n·hd, both starting 16-byte
                // aligned (vector_aligned); hd % VEC == 0; out holds t·n·hd.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, t, hd))))
        }
    }

    pub struct MergeHeads {
        pub n: usize,
        pub hd: usize,
    }

    impl CudaOp1 for MergeHeads {
        const NAME: &'static str = "folio-merge-heads";

        fn cuda_fwd(&self, a: &CudaStorage, al: &Layout) -> Result<(CudaStorage, Shape)> {
            let (n, hd) = (self.n, self.hd);
            let count = al.shape().elem_count();
            let t = count / (n * hd);
            if t > i32::MAX as usize || n * hd > i32::MAX as usize {
                candle_core::bail!("merge heads: {n} heads of {t} x {hd} values are past the kernel's i32 indices");
            }
            let dev = a.device().clone();
            // SAFETY: every output vector is written by the thread owning it.
            let out = unsafe { dev.alloc::<half::bf16>(count.max(1))? };
            if count > 0 {
                let avs = a.as_cuda_slice::<half::bf16>()?.slice(al.start_offset()..);
                let cfg = LaunchConfig {
                    grid_dim: ((count / VEC).div_ceil(THREADS) as u32, 1, 1),
                    block_dim: (THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ints = [t as i32, n as i32, hd as i32];
                let func = dev.get_or_load_custom_func("merge_heads_bf16", MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&avs).arg(&out).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]);
                // SAFETY: a is n × t × hd contiguous bf16 starting 16-byte aligned (vector_aligned);
                // hd % VEC == 0; out holds t·n·hd.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((t, n * hd))))
        }
    }

    impl CudaOp1 for SplitHeads {
        const NAME: &'static str = "folio-split-heads";

        fn cuda_fwd(&self, y: &CudaStorage, yl: &Layout) -> Result<(CudaStorage, Shape)> {
            self.launch(y, yl, None)
        }
    }

    impl CudaOp2 for SplitHeads {
        const NAME: &'static str = "folio-split-heads-bias";

        fn cuda_fwd(&self, y: &CudaStorage, yl: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
            self.launch(y, yl, Some((b, bl)))
        }
    }
}
