//! A projection's output as attention heads: `[t, n * hd]` plus the projection's bias, if any,
//! to `[n, t, hd]` ([`split`]; with RoPE on the Q and K heads, [`split_rope`]), and attention's
//! heads back as rows for the output projection ([`merge`]), each in one pass on CUDA; and a
//! decode step's new K or V row into per-query-head buffers ([`place_row`]), in one launch.
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
        let y = crate::layout::vector_aligned(y)?;
        let op = crate::cuda_op::CudaOnly(cuda::SplitHeads { n, hd });
        return match bias {
            Some(b) => y.apply_op2_no_bwd(&crate::layout::vector_aligned(b)?, &op),
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

/// [`split`], then RoPE on the first `roped` heads (the rotate-half form, as
/// `candle_nn::rotary_emb::rope`; `cos`, `sin` `[t, hd / 2]` for the rows' positions): a layer's
/// Q and K heads ready for attention and its V heads, from one stacked projection in one pass
/// on CUDA (a decode step's five launches were a tenth of its small kernels' time), the same
/// bits as the reference.
pub fn split_rope(
    y: &Tensor,
    bias: Option<&Tensor>,
    (n, roped, hd): (usize, usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let t = y.dim(0)?;
    if roped > n || !hd.is_multiple_of(2) || (roped > 0 && (cos.dims() != [t, hd / 2] || sin.dims() != [t, hd / 2])) {
        candle_core::bail!(
            "split rope: {roped} of {n} heads of {hd} over {t} rows with cos {:?} and sin {:?}",
            cos.dims(),
            sin.dims()
        );
    }
    if roped == 0 {
        return split(y, bias, n, hd);
    }
    #[cfg(feature = "cuda")]
    if y.device().is_cuda()
        && [y.dtype(), cos.dtype(), sin.dtype()].iter().all(|&d| d == candle_core::DType::BF16)
        && y.dims2()?.1 == n * hd
        && bias.is_none_or(|b| b.dims() == [n * hd] && b.dtype() == y.dtype())
    {
        let op = cuda::SplitRope { n, roped, hd, bias: bias.map(|b| b.contiguous()).transpose()? };
        return y.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &crate::cuda_op::CudaOnly(op));
    }
    split_rope_reference(y, bias, (n, roped, hd), cos, sin)
}

/// [`split_rope`] as candle's ops: [`reference`]'s split, then candle-nn's `rope` over the first
/// `roped` heads.
pub fn split_rope_reference(
    y: &Tensor,
    bias: Option<&Tensor>,
    (n, roped, hd): (usize, usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let heads = reference(y, bias, n, hd)?;
    if roped == 0 {
        return Ok(heads);
    }
    let rotated = candle_nn::rotary_emb::rope(&heads.narrow(0, 0, roped)?.unsqueeze(0)?, cos, sin)?.squeeze(0)?;
    if roped == n {
        return Ok(rotated);
    }
    Tensor::cat(&[&rotated, &heads.narrow(0, roped, n - roped)?], 0)
}

/// Heads `a` (`[n, t, hd]`) as rows `[t, n * hd]`: for one row (a decode step) the same
/// memory, a view rather than a launch.
pub fn merge(a: &Tensor) -> Result<Tensor> {
    if let (Ok((n, 1, hd)), true) = (a.dims3(), a.is_contiguous()) {
        return a.reshape((1, n * hd));
    }
    #[cfg(feature = "cuda")]
    if a.device().is_cuda() && a.dtype() == candle_core::DType::BF16 {
        let (n, _, hd) = a.dims3()?;
        if hd > 0 && hd % cuda::VEC == 0 && n > 0 {
            return crate::layout::vector_aligned(a)?
                .apply_op1_no_bwd(&crate::cuda_op::CudaOnly(cuda::MergeHeads { n, hd }));
        }
    }
    merge_reference(a)
}

/// candle's ops for [`merge`]: what the kernel is held to, and what every other case runs.
pub fn merge_reference(a: &Tensor) -> Result<Tensor> {
    let (n, t, hd) = a.dims3()?;
    a.transpose(0, 1)?.reshape((t, n * hd))
}

/// Writes row `row` of `src [kv_heads, t, d]` (any strides, a row's values contiguous) to slot
/// `slot` of `dst [kv_heads · group, cap, d]` (contiguous, same dtype and device), KV head `h`'s
/// row to query heads `h · group ..`: a decode step's new row into buffers kept per query head
/// (HiP's kept rows) or per KV head (`group` 1: a streaming ring). On CUDA one launch (candle's
/// way is three copies: the row made contiguous, broadcast over the group, set into the slot).
pub fn place_row(dst: &Tensor, src: &Tensor, row: usize, slot: usize, group: usize) -> Result<()> {
    let (heads, cap, d) = dst.dims3()?;
    let (kv_heads, t, sd) = src.dims3()?;
    if group == 0 || heads != kv_heads * group || sd != d || row >= t || slot >= cap || src.dtype() != dst.dtype() {
        candle_core::bail!(
            "place row: row {row} of {:?} into slot {slot} of {:?} ({:?}, {:?}), group {group}",
            src.dims(),
            dst.dims(),
            src.dtype(),
            dst.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda()
        && dst.is_contiguous()
        && src.layout().stride()[2] == 1
        && matches!(dst.dtype(), candle_core::DType::BF16 | candle_core::DType::F16 | candle_core::DType::F32)
    {
        return dst.inplace_op2(src, &cuda::PlaceRow { row, slot, group });
    }
    place_row_reference(dst, src, row, slot, group)
}

/// candle's ops for [`place_row`]: what the kernel is held to, and what every other case runs.
pub fn place_row_reference(dst: &Tensor, src: &Tensor, row: usize, slot: usize, group: usize) -> Result<()> {
    let (kv_heads, _, d) = src.dims3()?;
    let one = src.narrow(1, row, 1)?.unsqueeze(1)?.broadcast_as((kv_heads, group, 1, d))?;
    dst.slice_set(&one.reshape((kv_heads * group, 1, d))?.contiguous()?, 1, slot)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CpuStorage, CudaStorage, InplaceOp2, Layout, Result, Shape};

    use crate::cuda_op::{CudaOp1, CudaOp2, CudaOp3};

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

    /// [`super::split_rope`]'s launch: inputs y, cos, sin; the bias carried.
    pub struct SplitRope {
        pub n: usize,
        pub roped: usize,
        pub hd: usize,
        pub bias: Option<candle_core::Tensor>,
    }

    impl CudaOp3 for SplitRope {
        const NAME: &'static str = "folio-split-rope";

        fn cuda_fwd(&self, [y, cos, sin]: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)> {
            let count = y.1.shape().elem_count();
            let (n, hd) = (self.n, self.hd);
            let t = count / (n * hd);
            if count > i32::MAX as usize {
                candle_core::bail!("split rope: {count} values are past the kernel's i32 indices");
            }
            let dev = y.0.device().clone();
            // SAFETY: every output pair is written by the thread owning it.
            let out = unsafe { dev.alloc::<half::bf16>(count.max(1))? };
            let bias_guard = self.bias.as_ref().map(|b| b.storage_and_layout());
            if count > 0 {
                fn view<'a>((s, l): (&'a CudaStorage, &Layout)) -> Result<CudaView<'a, half::bf16>> {
                    Ok(s.as_cuda_slice::<half::bf16>()?.slice(l.start_offset()..))
                }
                let (yv, cv, sv) = (view(y)?, view(cos)?, view(sin)?);
                let bias = match &bias_guard {
                    Some((s, l)) => Some(view((crate::cuda_op::cuda_storage(s, "split rope's bias")?, l))?),
                    None => None,
                };
                let cfg = LaunchConfig {
                    grid_dim: ((count / 2).div_ceil(THREADS) as u32, 1, 1),
                    block_dim: (THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ints = [t, n, self.roped, hd].map(|x| x as i32);
                let func = dev.get_or_load_custom_func("split_rope_bf16", MODULE, PTX)?;
                let mut b = func.builder();
                let null = 0u64;
                b.arg(&yv).arg(&cv).arg(&sv);
                match &bias {
                    Some(v) => b.arg(v),
                    None => b.arg(&null),
                };
                b.arg(&out);
                for x in &ints {
                    b.arg(x);
                }
                // SAFETY: y is [t, n·hd], cos and sin [t, hd/2], the bias n·hd values, all
                // contiguous bf16 (the caller made them so); out holds `count`.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, t, hd))))
        }
    }

    /// [`super::place_row`]'s launch: values copied as their bits.
    pub struct PlaceRow {
        pub row: usize,
        pub slot: usize,
        pub group: usize,
    }

    impl InplaceOp2 for PlaceRow {
        fn name(&self) -> &'static str {
            "folio-place-row"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            candle_core::bail!("place row runs on CUDA only: on the CPU its caller runs the reference")
        }

        fn cuda_fwd(&self, dst: &mut CudaStorage, dl: &Layout, src: &CudaStorage, sl: &Layout) -> Result<()> {
            let (heads, cap, d) = dl.shape().dims3()?;
            let head_stride = sl.stride()[0];
            let from = sl.start_offset() + self.row * sl.stride()[1];
            let ints = [cap, self.slot, d, self.group];
            if ints.iter().any(|&x| x > i32::MAX as usize) {
                candle_core::bail!("place row: sizes past the kernel's i32 arguments");
            }
            let ints = ints.map(|x| x as i32);
            let dev = dst.device().clone();
            let cfg = LaunchConfig {
                grid_dim: (heads as u32, 1, 1),
                block_dim: (d.min(THREADS) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            macro_rules! run {
                ($t:ty, $name:expr) => {{
                    let s = src.as_cuda_slice::<$t>()?.slice(from..);
                    let o = dst.as_cuda_slice_mut::<$t>()?;
                    let mut o = o.slice_mut(dl.start_offset()..);
                    let func = dev.get_or_load_custom_func($name, MODULE, PTX)?;
                    let mut b = func.builder();
                    let stride = head_stride as i64;
                    b.arg(&s).arg(&mut o).arg(&stride);
                    for x in &ints {
                        b.arg(x);
                    }
                    // SAFETY: src holds heads / group rows of d values `head_stride` apart from
                    // `from`; dst is a contiguous [heads, cap, d] with slot < cap.
                    unsafe { b.launch(cfg) }.w()?;
                }};
            }
            match dst.dtype() {
                candle_core::DType::BF16 => run!(half::bf16, "place_row_16"),
                candle_core::DType::F16 => run!(half::f16, "place_row_16"),
                candle_core::DType::F32 => run!(f32, "place_row_32"),
                other => candle_core::bail!("place row: {other:?} values"),
            }
            Ok(())
        }
    }
}
