//! Causal attention over one sequence, returning the output and the per-query log-sum-exp.
//!
//! Layout (DESIGN.md §2): queries `[q_heads, q_len, head_dim]`, keys and values
//! `[kv_heads, kv_len, head_dim]`, one token's row contiguous. Grouped-query attention maps
//! query head `h` to KV head `h / (q_heads / kv_heads)`, as Hugging Face's `repeat_kv` does.
//!
//! Positions: query `i` sits at absolute position `mask.q_offset + i`, key `j` at position `j`.
//! Key `j` is visible from query position `p` when `j <= p` and, with a sliding window `w`,
//! `p - j < w` (the window counts the query's own token, as transformers' Mistral does).

use candle_core::{DType, Device, Result, Tensor, D};

/// Which keys each query may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mask {
    /// Absolute position of the first query.
    pub q_offset: usize,
    /// Sliding-window size in tokens (the query's own token included); `None` for full causal.
    pub window: Option<usize>,
}

impl Mask {
    pub fn causal(q_offset: usize) -> Self {
        Self { q_offset, window: None }
    }

    /// Whether key position `key` is visible from query position `pos`.
    pub fn visible(&self, pos: usize, key: usize) -> bool {
        key <= pos && self.window.is_none_or(|w| pos - key < w)
    }

    /// Half-open range of key positions that query position `pos` may see.
    fn key_range(&self, pos: usize) -> (usize, usize) {
        (self.window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos + 1)
    }
}

/// Attention output `[q_heads, q_len, head_dim]` (f32) and log-sum-exp `[q_heads, q_len]` (f32),
/// where the LSE is taken over the scaled scores `scale * q·k` of the visible keys.
#[derive(Debug, Clone)]
pub struct AttnOutput {
    pub out: Tensor,
    pub lse: Tensor,
}

/// Upper bound on the number of f32 scores materialised at once. Queries are processed in
/// chunks and keys in blocks (online softmax, merged by LSE) so that neither prefill nor decode
/// ever builds a `q_len × kv_len` matrix larger than this: 64 MiB in host memory, 512 MiB on a
/// GPU (fewer, larger launches matter more there).
const MAX_SCORE_ELEMS_CPU: usize = 1 << 24;
const MAX_SCORE_ELEMS_GPU: usize = 1 << 27;

/// Smallest key block a query chunk is given before the chunk shrinks instead: long prefills
/// keep a few thousand keys per block, so the per-block merge stays a small share of the work.
const MIN_KEY_BLOCK: usize = 4096;

/// Fast path: causal (optionally windowed) attention with LSE over a whole sequence, on the
/// tensors' device. The keys must reach the last query (`q_offset + q_len <= kv_len`).
///
/// bf16 inputs on CUDA with a head dim of 32, 64 or 128 run the tensor-core kernel of
/// kernels/cuda/flash.cu (scores and softmax in f32, the probabilities rounded to bf16 for the
/// second product, no score matrix in memory). Everything else computes in f32 whatever the
/// input dtype (scores and softmax in bf16 lose too much), with the score matrix bounded by
/// [`MAX_SCORE_ELEMS_CPU`] / [`MAX_SCORE_ELEMS_GPU`].
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f32) -> Result<AttnOutput> {
    attention_with_limit(q, k, v, mask, scale, max_score_elems(q.device()))
}

/// [`attention`] with an explicit bound on the scores materialised at once.
pub fn attention_with_limit(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Mask,
    scale: f32,
    max_scores: usize,
) -> Result<AttnOutput> {
    let (_, q_len, _) = q.dims3()?;
    let kv_len = k.dim(1)?;
    // Every query sees at least its own key: the keys must reach the last query's position.
    if mask.q_offset + q_len > kv_len {
        candle_core::bail!(
            "attention: queries at positions {}..{} need keys up to there, but kv_len is {kv_len}",
            mask.q_offset,
            mask.q_offset + q_len
        );
    }
    attention_block_with_limit(q, k, v, 0, mask, scale, max_scores)
}

/// Partial attention over one block of keys that sit at absolute positions
/// `k_start..k_start + kv_len` (a saved prefix, an in-memory tail, a sparse selection's run).
/// Queries that see no key of the block get output 0 and LSE `-inf`, so that [`merge`] of the
/// partials over disjoint blocks is exactly the attention over their union.
pub fn attention_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_start: usize,
    mask: Mask,
    scale: f32,
) -> Result<AttnOutput> {
    attention_block_with_limit(q, k, v, k_start, mask, scale, max_score_elems(q.device()))
}

/// Whether attention over `dtype` inputs with this head dim on `device` runs the fused
/// tensor-core kernel, which makes no f32 copy of K/V and no score block (callers budgeting
/// memory count neither then; it does copy K/V given as a strided view, in their dtype).
pub fn fused(device: &Device, dtype: DType, head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    return cuda::takes(device, dtype, head_dim);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype, head_dim);
        false
    }
}

/// How many f32 scores the kernel materialises at most on `device` (callers budgeting memory
/// count it).
pub fn max_score_elems(device: &Device) -> usize {
    if device.is_cpu() {
        MAX_SCORE_ELEMS_CPU
    } else {
        MAX_SCORE_ELEMS_GPU
    }
}

/// [`attention_block`] with an explicit bound on the scores materialised at once.
pub fn attention_block_with_limit(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_start: usize,
    mask: Mask,
    scale: f32,
    max_scores: usize,
) -> Result<AttnOutput> {
    let (q_heads, q_len, head_dim) = q.dims3()?;
    let (kv_heads, kv_len, k_dim) = k.dims3()?;
    if v.dims3()? != (kv_heads, kv_len, head_dim) || k_dim != head_dim {
        candle_core::bail!("attention: shapes do not agree: q {:?}, k {:?}, v {:?}", q.dims(), k.dims(), v.dims());
    }
    if kv_heads == 0 || q_heads % kv_heads != 0 {
        candle_core::bail!("attention: {q_heads} query heads are not a multiple of {kv_heads} KV heads");
    }
    if mask.window == Some(0) {
        candle_core::bail!("attention: a sliding window of 0 tokens sees nothing");
    }
    #[cfg(feature = "cuda")]
    if [k, v].iter().all(|t| t.dtype() == q.dtype()) && cuda::takes(q.device(), q.dtype(), head_dim) {
        return cuda::flash_prefill(q, k, v, k_start, mask, scale);
    }
    let groups = q_heads / kv_heads;
    let device = q.device();
    let q = q.to_dtype(DType::F32)?;
    let k = k.to_dtype(DType::F32)?;
    let v = v.to_dtype(DType::F32)?;
    let k_end_abs = k_start + kv_len;

    // Query chunk: as many queries as fit MIN_KEY_BLOCK keys each; key block: what is left.
    let chunk = (max_scores / (q_heads * MIN_KEY_BLOCK)).clamp(1, q_len.max(1));
    let block = (max_scores / (q_heads * chunk)).max(1);
    let mut outs = Vec::with_capacity(q_len.div_ceil(chunk));
    let mut lses = Vec::with_capacity(outs.capacity());
    let mut c0 = 0;
    while c0 < q_len {
        let n = chunk.min(q_len - c0);
        let first = mask.q_offset + c0;
        let last = first + n - 1;
        // Keys of this block some query of the chunk may see, in absolute positions.
        let lo = mask.key_range(first).0.max(k_start);
        let hi = mask.key_range(last).1.min(k_end_abs);
        // [q_heads, n, d] -> [kv_heads, groups * n, d]: the heads of one group share K/V.
        let qc = q.narrow(1, c0, n)?.contiguous()?.reshape((kv_heads, groups * n, head_dim))?;
        let mut acc: Option<AttnOutput> = None;
        let mut b0 = lo;
        while b0 < hi {
            let b1 = (b0 + block).min(hi);
            let part = scores_block(&qc, &k, &v, k_start, b0, b1, &mask, first, n, scale, device)?;
            acc = Some(match acc {
                None => part,
                Some(prev) => merge(&prev, &part)?,
            });
            b0 = b1;
        }
        let part = match acc {
            Some(p) => p,
            None => AttnOutput {
                out: Tensor::zeros((kv_heads, groups * n, head_dim), DType::F32, device)?,
                lse: Tensor::full(f32::NEG_INFINITY, (kv_heads, groups * n, 1), device)?,
            },
        };
        outs.push(part.out.reshape((q_heads, n, head_dim))?);
        lses.push(part.lse.reshape((q_heads, n))?);
        c0 += n;
    }
    if outs.is_empty() {
        return Ok(AttnOutput {
            out: Tensor::zeros((q_heads, 0, head_dim), DType::F32, device)?,
            lse: Tensor::zeros((q_heads, 0), DType::F32, device)?,
        });
    }
    Ok(AttnOutput { out: Tensor::cat(&outs, 1)?, lse: Tensor::cat(&lses, 1)? })
}

/// Softmax attention of one query chunk (`qc`: `[kv_heads, groups * n, d]`) over the keys at
/// absolute positions `b0..b1`; output `[kv_heads, groups * n, d]`, LSE `[kv_heads, groups * n, 1]`.
#[allow(clippy::too_many_arguments)]
fn scores_block(
    qc: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_start: usize,
    b0: usize,
    b1: usize,
    mask: &Mask,
    first: usize,
    n: usize,
    scale: f32,
    device: &Device,
) -> Result<AttnOutput> {
    let (kv_heads, rows, _) = qc.dims3()?;
    let groups = rows / n;
    let kl = b1 - b0;
    let kc = k.narrow(1, b0 - k_start, kl)?;
    let vc = v.narrow(1, b0 - k_start, kl)?.contiguous()?;
    let mut scores = (qc.matmul(&kc.t()?)? * scale as f64)?; // [kv_heads, groups*n, kl]
    let bias = mask_bias(mask, first, n, b0, b1, device)?;
    if let Some(bias) = &bias {
        scores = scores.reshape((kv_heads, groups, n, kl))?.broadcast_add(bias)?.reshape((kv_heads, groups * n, kl))?;
    }
    let max = scores.max_keepdim(D::Minus1)?;
    if bias.is_none() {
        // Every query sees every key of the block: no empty rows, no guards needed.
        let exp = scores.broadcast_sub(&max)?.exp()?;
        let sum = exp.sum_keepdim(D::Minus1)?;
        let lse = (max + sum.log()?)?;
        let out = exp.broadcast_div(&sum)?.matmul(&vc)?;
        return Ok(AttnOutput { out, lse });
    }
    // Rows that see nothing have max -inf: shift them by 0 instead, so exp gives 0 (not NaN),
    // their sum is 0, their LSE -inf and their output 0.
    let finite = max.ne(f64::NEG_INFINITY)?;
    let max = finite.where_cond(&max, &max.zeros_like()?)?;
    let exp = scores.broadcast_sub(&max)?.exp()?;
    let sum = exp.sum_keepdim(D::Minus1)?;
    let lse = (max + sum.log()?)?;
    let safe_sum = finite.where_cond(&sum, &sum.ones_like()?)?;
    let out = exp.broadcast_div(&safe_sum)?.matmul(&vc)?;
    Ok(AttnOutput { out, lse })
}

/// Exact combination of two partial attentions of the same queries over disjoint key sets:
/// each output is weighted by `exp(lse_part - lse_total)`. Shapes of `a` and `b` agree: output
/// `[.., d]`, LSE the same shape with a trailing dimension of 1, or without it (`[q_heads, q_len]`).
pub fn merge(a: &AttnOutput, b: &AttnOutput) -> Result<AttnOutput> {
    let keep_dim = a.lse.rank() == a.out.rank();
    let (la, lb) = if keep_dim {
        (a.lse.clone(), b.lse.clone())
    } else {
        (a.lse.unsqueeze(D::Minus1)?, b.lse.unsqueeze(D::Minus1)?)
    };
    let m = la.maximum(&lb)?;
    // Both empty: m is -inf; shift by 0 so that both weights are exp(-inf) = 0, not NaN.
    let finite = m.ne(f64::NEG_INFINITY)?;
    let m = finite.where_cond(&m, &m.zeros_like()?)?;
    let wa = la.broadcast_sub(&m)?.exp()?;
    let wb = lb.broadcast_sub(&m)?.exp()?;
    let total = (&wa + &wb)?;
    let lse = (m + total.log()?)?;
    let safe_total = finite.where_cond(&total, &total.ones_like()?)?;
    let out = (a.out.broadcast_mul(&wa)? + b.out.broadcast_mul(&wb)?)?.broadcast_div(&safe_total)?;
    let lse = if keep_dim { lse } else { lse.squeeze(D::Minus1)? };
    Ok(AttnOutput { out, lse })
}

/// Additive mask `[n, k_end - k_start]` (0 or -inf) for queries at `first..first + n`, or
/// `None` when every key of the range is visible to every query (decode, the common case).
/// Built on the device from position comparisons: no host loop, no host-to-device copy.
fn mask_bias(
    mask: &Mask,
    first: usize,
    n: usize,
    k_start: usize,
    k_end: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    let last = first + n - 1;
    if mask.visible(first, k_end - 1) && mask.visible(last, k_start) {
        return Ok(None);
    }
    let kl = k_end - k_start;
    let q = Tensor::arange(first as i64, (first + n) as i64, device)?.reshape((n, 1))?;
    let k = Tensor::arange(k_start as i64, k_end as i64, device)?.reshape((1, kl))?;
    let zeros = Tensor::zeros((n, kl), DType::F32, device)?;
    let blocked = Tensor::full(f32::NEG_INFINITY, (n, kl), device)?;
    let mut bias = k.broadcast_le(&q)?.where_cond(&zeros, &blocked)?;
    if let Some(w) = mask.window {
        // visible when pos - key < w, i.e. key + w > pos
        bias = (k + w as f64)?.broadcast_gt(&q)?.where_cond(&bias, &blocked)?;
    }
    Ok(Some(bias))
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Launching kernels/cuda/flash.cu: one `CustomOp3` whose output buffer holds the output
    //! rows and then the LSEs, split by the caller.

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

    use super::{AttnOutput, Mask};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
    const MODULE: &str = "folio_flash";
    /// Query rows per block and threads per block (ROWS and 32 × WARPS in the kernel).
    const ROWS: usize = 128;
    const THREADS: u32 = 256;
    /// Keys per tile (KEYS) and shared-memory row padding in bf16 (PAD): two stages of a K and
    /// a V tile.
    const KEYS: usize = 64;
    const PAD: usize = 8;
    /// Dynamic shared memory a launch gets without opting in.
    const DEFAULT_SHARED: usize = 48 * 1024;
    /// Head dims the kernel is instantiated for (FLASH(D)).
    const HEAD_DIMS: [usize; 3] = [32, 64, 128];

    /// Whether the tensor-core kernel takes inputs of this dtype and head dim on `device`.
    pub fn takes(device: &candle_core::Device, dtype: DType, head_dim: usize) -> bool {
        device.is_cuda() && dtype == DType::BF16 && HEAD_DIMS.contains(&head_dim)
    }

    struct Flash {
        dims: (usize, usize, usize, usize, usize), // q_heads, q_len, kv_len, groups, head_dim
        q_offset: i64,
        k_start: i64,
        window: i64,
        scale: f32,
    }

    impl CustomOp3 for Flash {
        fn name(&self) -> &'static str {
            "folio-flash-prefill"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("flash prefill runs on CUDA only; the CPU takes the f32 path")
        }

        fn cuda_fwd(
            &self,
            q: &CudaStorage,
            ql: &Layout,
            k: &CudaStorage,
            kl: &Layout,
            v: &CudaStorage,
            vl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (q_heads, q_len, kv_len, groups, d) = self.dims;
            let dev = q.device().clone();
            let qs = q.as_cuda_slice::<half::bf16>()?.slice(ql.start_offset()..);
            let ks = k.as_cuda_slice::<half::bf16>()?.slice(kl.start_offset()..);
            let vs = v.as_cuda_slice::<half::bf16>()?.slice(vl.start_offset()..);
            let rows = q_heads * q_len;
            // SAFETY: every query row's output and LSE is written by the block owning it.
            let out = unsafe { dev.alloc::<f32>(rows * d + rows)? };
            {
                let (out_o, out_l) = (out.slice(..rows * d), out.slice(rows * d..));
                let func = dev.get_or_load_custom_func(&format!("flash_prefill_{d}"), MODULE, PTX)?;
                let shared = 2 * 2 * KEYS * (d + PAD) * 2;
                if shared > DEFAULT_SHARED {
                    use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
                    let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                    func.set_attribute(attr, shared as i32).w()?;
                }
                let mut b = func.builder();
                let ints = [q_len as i32, kv_len as i32, groups as i32];
                b.arg(&qs).arg(&ks).arg(&vs).arg(&out_o).arg(&out_l);
                for x in &ints {
                    b.arg(x);
                }
                b.arg(&self.q_offset).arg(&self.k_start).arg(&self.window).arg(&self.scale);
                let cfg = LaunchConfig {
                    grid_dim: (q_len.div_ceil(ROWS) as u32, q_heads as u32, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: shared as u32,
                };
                // SAFETY: q is [q_heads, q_len, d], k and v [kv_heads, kv_len, d] contiguous
                // bf16 (the caller checked shapes and made them so); the kernel reads keys
                // 0..kv_len only.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows * d + rows)))
        }
    }

    /// Attention of `q [q_heads, q_len, d]` over `k`, `v` `[kv_heads, kv_len, d]` (bf16) at
    /// key positions `k_start..`, shapes already checked; f32 output and LSE.
    pub fn flash_prefill(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        k_start: usize,
        mask: Mask,
        scale: f32,
    ) -> Result<AttnOutput> {
        let (q_heads, q_len, d) = q.dims3()?;
        let (kv_heads, kv_len, _) = k.dims3()?;
        if q_len.max(kv_len) > i32::MAX as usize {
            candle_core::bail!("attention: {q_len} queries over {kv_len} keys is past the kernel's i32 positions");
        }
        if q_heads == 0 || q_len == 0 || kv_len == 0 {
            return Ok(AttnOutput {
                out: Tensor::zeros((q_heads, q_len, d), DType::F32, q.device())?,
                lse: Tensor::full(f32::NEG_INFINITY, (q_heads, q_len), q.device())?,
            });
        }
        let op = Flash {
            dims: (q_heads, q_len, kv_len, q_heads / kv_heads, d),
            q_offset: mask.q_offset as i64,
            k_start: k_start as i64,
            window: mask.window.map_or(0, |w| w as i64),
            scale,
        };
        // A prefill's keys so far are a narrowed view of the layer's cache: copied here (the
        // chunk plan counts the copy); reading them in place with a head stride is next.
        let both =
            crate::vector_aligned(q)?.apply_op3_no_bwd(&crate::vector_aligned(k)?, &crate::vector_aligned(v)?, &op)?;
        let rows = q_heads * q_len;
        Ok(AttnOutput {
            out: both.narrow(0, 0, rows * d)?.reshape((q_heads, q_len, d))?,
            lse: both.narrow(0, rows * d, rows)?.reshape((q_heads, q_len))?,
        })
    }
}

/// The obviously-right versions, over row-major `f32` slices with the shapes of the fast path.
pub mod reference {
    use super::Mask;

    /// Attention over a whole sequence: [`attention_block`] with the keys starting at position 0.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        mask: Mask,
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        attention_block(q, k, v, 0, q_heads, kv_heads, head_dim, mask, scale)
    }

    /// Keys at positions `k_start..`; returns `(out [q_heads * q_len * head_dim], lse [q_heads * q_len])`,
    /// with output 0 and LSE `-inf` for a query that sees none of the keys.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_block(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        k_start: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        mask: Mask,
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let q_len = q.len() / (q_heads * head_dim);
        let kv_len = k.len() / (kv_heads * head_dim);
        let groups = q_heads / kv_heads;
        let mut out = vec![0f32; q.len()];
        let mut lse = vec![f32::NEG_INFINITY; q_heads * q_len];
        for h in 0..q_heads {
            let kvh = h / groups;
            for i in 0..q_len {
                let pos = mask.q_offset + i;
                let qrow = &q[(h * q_len + i) * head_dim..][..head_dim];
                let keys: Vec<usize> = (0..kv_len).filter(|&j| mask.visible(pos, k_start + j)).collect();
                if keys.is_empty() {
                    continue;
                }
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let krow = &k[(kvh * kv_len + j) * head_dim..][..head_dim];
                        let dot: f64 = qrow.iter().zip(krow).map(|(a, b)| *a as f64 * *b as f64).sum();
                        dot * scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                lse[h * q_len + i] = (max + total.ln()) as f32;
                let orow = &mut out[(h * q_len + i) * head_dim..][..head_dim];
                for (w, &j) in weights.iter().zip(&keys) {
                    let vrow = &v[(kvh * kv_len + j) * head_dim..][..head_dim];
                    for (o, x) in orow.iter_mut().zip(vrow) {
                        *o += (w / total * *x as f64) as f32;
                    }
                }
            }
        }
        (out, lse)
    }
}
