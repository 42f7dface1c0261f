//! Causal attention over one sequence, returning the output and the per-query log-sum-exp.
//!
//! Layout: queries `[q_heads, q_len, head_dim]`, keys and values
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
/// bf16 inputs on CUDA with a head dim of 32, 64 or 128 run a tensor-core kernel (scores and
/// softmax in f32, the probabilities rounded to bf16 for the second product, no score matrix in
/// memory): kernels/cuda/flash_sm90a.cu on Hopper for head dim 128, kernels/cuda/flash.cu
/// otherwise ([`flash_kernels`]). Everything else computes in f32 whatever the
/// input dtype (scores and softmax in bf16 lose too much), with the score matrix bounded by
/// [`MAX_SCORE_ELEMS_CPU`] / [`MAX_SCORE_ELEMS_GPU`].
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f32) -> Result<AttnOutput> {
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
    attention_block(q, k, v, 0, mask, scale)
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

/// Whether attention over `dtype` inputs with this head dim on `device` runs a fused
/// tensor-core kernel, which makes no f32 copy of K/V and no score block (callers budgeting
/// memory count neither then; it reads K/V in place when their rows are contiguous, and copies
/// them, in their dtype, otherwise).
pub fn fused(device: &Device, dtype: DType, head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    return cuda::takes(device, dtype, head_dim);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype, head_dim);
        false
    }
}

/// The tensor-core prefill kernels (kernels/cuda/flash*.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashKernel {
    /// `mma.sync` m16n8k16, any GPU from sm_80 (flash.cu): head dims 32, 64, 128.
    MmaSync,
    /// Hopper's warpgroup `wgmma` (flash_sm90a.cu): head dim 128 on compute capability 9.0.
    Wgmma,
}

/// The kernels that take bf16 inputs of this head dim on `device`, fastest first; the first is
/// what [`attention_block`] runs. Empty off CUDA.
pub fn flash_kernels(device: &Device, head_dim: usize) -> Vec<FlashKernel> {
    #[cfg(feature = "cuda")]
    return cuda::kernels(device, head_dim);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, head_dim);
        Vec::new()
    }
}

/// [`attention_block`] through one named kernel (one of [`flash_kernels`]): for tests and
/// benchmarks that hold each kernel to the reference and time them side by side.
pub fn flash_attention_block(
    kernel: FlashKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_start: usize,
    mask: Mask,
    scale: f32,
) -> Result<AttnOutput> {
    check_shapes(q, k, v, mask)?;
    #[cfg(feature = "cuda")]
    return cuda::flash_prefill(kernel, q, k, v, k_start, mask, scale);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k_start, scale);
        candle_core::bail!("attention: the {kernel:?} kernel needs a CUDA build")
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
    check_shapes(q, k, v, mask)?;
    let (q_heads, q_len, head_dim) = q.dims3()?;
    let (kv_heads, kv_len, _) = k.dims3()?;
    #[cfg(feature = "cuda")]
    if [k, v].iter().all(|t| t.dtype() == q.dtype()) && cuda::takes(q.device(), q.dtype(), head_dim) {
        let kernel = cuda::kernels(q.device(), head_dim)[0];
        return cuda::flash_prefill(kernel, q, k, v, k_start, mask, scale);
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

/// Shapes `q [q_heads, q_len, d]`, `k`/`v` `[kv_heads, kv_len, d]` with `q_heads` a multiple of
/// `kv_heads`, and a window that sees something.
fn check_shapes(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask) -> Result<()> {
    let (q_heads, _, head_dim) = q.dims3()?;
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
    Ok(())
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
mod cuda;

/// The obviously-right versions, over row-major `f32` slices with the shapes of the fast path.
pub mod reference;
