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
    if y.device().is_cuda() && y.dtype() == candle_core::DType::BF16 && hd.is_multiple_of(cuda::VEC) {
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

    pub struct MergeHeads {
        pub n: usize,
        pub hd: usize,
    }

    /// Launches heads.cu's kernel `name` over `count` bf16 values of `n` heads of `hd`: its
    /// arguments are `sources` (each a storage and its layout), the output, then t, n and hd,
    /// as both kernels take them. The output is `count` fresh values.
    fn launch(
        name: &str,
        sources: &[(&CudaStorage, &Layout)],
        count: usize,
        (n, hd): (usize, usize),
    ) -> Result<CudaStorage> {
        let t = count / (n * hd);
        if t > i32::MAX as usize || n * hd > i32::MAX as usize {
            candle_core::bail!("{name}: {t} rows of {n} x {hd} values are past the kernel's i32 indices");
        }
        let dev = sources[0].0.device().clone();
        // SAFETY: every output vector is written by the thread owning it.
        let out = unsafe { dev.alloc::<half::bf16>(count.max(1))? };
        if count > 0 {
            let views = sources
                .iter()
                .map(|(s, l)| s.as_cuda_slice::<half::bf16>().map(|v| v.slice(l.start_offset()..)))
                .collect::<Result<Vec<_>>>()?;
            let cfg = LaunchConfig {
                grid_dim: ((count / VEC).div_ceil(THREADS) as u32, 1, 1),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let ints = [t as i32, n as i32, hd as i32];
            let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
            let mut b = func.builder();
            for v in &views {
                b.arg(v);
            }
            b.arg(&out).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]);
            // SAFETY: the sources are contiguous bf16 starting 16-byte aligned (vector_aligned):
            // `count` values (a bias: n·hd); hd % VEC == 0; out holds `count`.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    impl SplitHeads {
        fn launch(
            &self,
            y: (&CudaStorage, &Layout),
            bias: Option<(&CudaStorage, &Layout)>,
        ) -> Result<(CudaStorage, Shape)> {
            let count = y.1.shape().elem_count();
            let (name, sources) = match bias {
                Some(b) => ("split_heads_bias_bf16", vec![y, b]),
                None => ("split_heads_bf16", vec![y]),
            };
            let out = launch(name, &sources, count, (self.n, self.hd))?;
            Ok((out, Shape::from((self.n, count / (self.n * self.hd), self.hd))))
        }
    }

    impl CudaOp1 for MergeHeads {
        const NAME: &'static str = "folio-merge-heads";

        fn cuda_fwd(&self, a: &CudaStorage, al: &Layout) -> Result<(CudaStorage, Shape)> {
            let count = al.shape().elem_count();
            let out = launch("merge_heads_bf16", &[(a, al)], count, (self.n, self.hd))?;
            Ok((out, Shape::from((count / (self.n * self.hd), self.n * self.hd))))
        }
    }

    impl CudaOp1 for SplitHeads {
        const NAME: &'static str = "folio-split-heads";

        fn cuda_fwd(&self, y: &CudaStorage, yl: &Layout) -> Result<(CudaStorage, Shape)> {
            self.launch((y, yl), None)
        }
    }

    impl CudaOp2 for SplitHeads {
        const NAME: &'static str = "folio-split-heads-bias";

        fn cuda_fwd(&self, y: &CudaStorage, yl: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
            self.launch((y, yl), Some((b, bl)))
        }
    }
}
