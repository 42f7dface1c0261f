//! A projection's output as attention heads: `[t, n * hd]` plus the projection's bias, if any,
//! to `[n, t, hd]`, in one pass on CUDA.
//!
//! Why: every layer of a prefill does this to Q, K and V. candle adds the bias in one pass and
//! moves the heads in another, through its general strided copy; the kernel
//! (kernels/cuda/heads.cu) reads each value once and writes it once, 16 bytes at a time, and
//! adds the bias as candle does, so the result is the same to the bit. The reference is
//! candle's ops; every other dtype and device runs it.

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
