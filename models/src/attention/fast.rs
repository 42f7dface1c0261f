//! The shared half of the methods' fast paths: attention over the rows a step picked, over any
//! decode tier ([`crate::kv_cache::DecodeTier`]: resident or offloaded). A method scores and picks
//! with its own index; these gather the picks through the tier and run the kernel over the
//! gathered rows (`folio_kernels::sparse::decode_attention_rows`), or, for a method that
//! scores its cache by the attention it received (BUZZ), exact attention with the
//! probabilities.

use candle_core::{DType, Device, Tensor};
use folio_kernels::sparse;

use folio_kernels::attention::{merge, AttnOutput};

use super::AttnCall;
use crate::error::{Error, Result};
use crate::kv_cache::DecodeTier;
use crate::profile::span;

/// Positions per chunk of [`attend_scored`] at most (64 Ki, as the tiers' scans).
const SCAN_CHUNK: usize = 1 << 16;

/// One decode step's attention over the positions `idx [rows, s]` (u32, visible, distinct per
/// row): one row per query head, or one per KV head when a group shares its pick (then each
/// row is read once for the whole group). `bias [q_heads, s]` is added to the logits (−∞ pads a
/// head's shorter pick). Gathers the rows and runs the row attention kernel over them. Output
/// `[q_heads, 1, d]` in the query's dtype.
pub fn attend_selected(
    call: &AttnCall<'_>,
    kv: &dyn DecodeTier,
    idx: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (out, _lse) = selected_partial(call, kv, idx, bias)?;
    Ok(out.unsqueeze(1)?.to_dtype(call.q.dtype())?)
}

/// [`attend_selected`] as a partial attention: `out [q_heads, d]` f32 and its LSE `[q_heads]`,
/// to merge with attention over other positions.
pub fn selected_partial(
    call: &AttnCall<'_>,
    kv: &dyn DecodeTier,
    idx: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let s = idx.dim(1)?;
    let dev = idx.device();
    let (k, v) = span(dev, "attention: gather", || kv.gather(call.kv_layer, idx, call.q_start + 1))?;
    // The gathered rows are the kernel's K/V: `rows` heads of `s` rows each, read in order, once
    // for all the query heads that share them.
    span(dev, "attention: kernel", || {
        Ok(sparse::decode_attention_rows(&call.q.squeeze(1)?, &k, &v, s, bias, call.scale)?)
    })
}

/// The positions a top-k method reads in one decode step: the `k` best of `scores` (over the
/// candidates `lo..cut`, index = position − `lo`) and the window `cut..hi`, `[q_heads, s]` u32.
pub fn top_and_window(
    scores: Option<&Tensor>,
    k: usize,
    heads: usize,
    lo: usize,
    (cut, hi): (usize, usize),
    device: &Device,
) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(2);
    if let Some(scores) = scores.filter(|_| cut > lo) {
        let top = folio_kernels::select::topk(scores, k)?;
        parts.push(top.broadcast_add(&Tensor::new(lo as u32, device)?)?);
    }
    if hi > cut {
        parts.push(Tensor::arange(cut as u32, hi as u32, device)?.unsqueeze(0)?.repeat((heads, 1))?);
    }
    Ok(Tensor::cat(&parts, 1)?)
}

/// Logits per KV head in one chunk of [`attend_scored`] (rows × positions), and the fewest
/// positions a chunk takes.
const SCAN_ELEMS: usize = 8 * SCAN_CHUNK;
const MIN_SCORED_CHUNK: usize = 4096;

/// Masked logits stand at this value rather than −∞, so a chunk with no visible key merges
/// without NaNs (every row sees at least its own token somewhere).
const MASKED: f64 = -1e30;

/// Exact attention of a call's rows over the positions `idx [kv_heads, s]` (u32; one set per KV
/// head, shared by its query heads; each row sees the positions at or before its own, inside the
/// model's window), and the attention probability each position received summed over the
/// group's query heads and the call's rows, `[kv_heads · s]` on the host: what a method that
/// scores its cache by accumulated attention (BUZZ) needs.
///
/// The first `open` positions of every row of `idx` are ones every row of the call sees (before
/// its first position, or its own with one row; ignored under a model window): they go through
/// the row kernels in chunks — `decode_attention_rows` with the call's rows as the heads of their
/// KV head, then `attention_mass` with the final log-sum-exp, K read twice and V once, nothing
/// to the host but the sums at the end. Callers pass them where those kernels run on tensor
/// cores (`sparse::rows_on_tensor_cores`; their CUDA-core and CPU forms cost more than the path
/// below). The others (the call's own positions, a window, every position elsewhere) take the
/// masked path: two passes of f32 logits in chunks (the log-sum-exp, then the probabilities),
/// one when they fit in one chunk.
pub fn attend_scored(
    call: &AttnCall<'_>,
    kv: &dyn DecodeTier,
    idx: &Tensor,
    open: usize,
) -> Result<(Tensor, Vec<f32>)> {
    let (heads, t, d) = call.q.dims3()?;
    let (kvh, s) = idx.dims2()?;
    let open = if call.window.is_none() { open.min(s) } else { 0 };
    let rows = heads / kvh * t;
    let dev = call.q.device();
    let end = call.q_start + t;
    // The call's rows as heads of their KV head: row h·t + i is query head h at position i, and
    // row j of KV head g's `rows` is its j-th (the masked path's [kv, rows] order too).
    let q_rows = call.q.contiguous()?.reshape((heads * t, d))?;
    let open_chunks: Vec<(usize, usize)> =
        (0..open).step_by(SCAN_CHUNK).map(|c| (c, SCAN_CHUNK.min(open - c))).collect();
    let mut open_part: Option<AttnOutput> = None;
    for &(c, len) in &open_chunks {
        let ic = idx.narrow(1, c, len)?;
        let (k, v) = span(dev, "attention: gather", || kv.gather(call.kv_layer, &ic, end))?;
        let (out, lse) = sparse::decode_attention_rows(&q_rows, &k, &v, len, None, call.scale)?;
        let part = AttnOutput { out, lse };
        open_part = Some(match open_part {
            None => part,
            Some(prev) => merge(&prev, &part)?,
        });
    }
    let rest = s - open;
    let rest_idx = idx.narrow(1, open, rest)?;
    let masked_part = if rest > 0 { Some(masked_lse(call, kv, &rest_idx)?) } else { None };
    // The log-sum-exp over every position, [heads · t].
    let lse = match (&open_part, &masked_part) {
        (Some(o), Some(m)) => {
            let m = m.lse.flatten_all()?;
            let top = o.lse.maximum(&m)?;
            (top.clone() + ((o.lse.clone() - &top)?.exp()? + (m - &top)?.exp()?)?.log()?)?
        }
        (Some(o), None) => o.lse.clone(),
        (None, Some(m)) => m.lse.flatten_all()?,
        (None, None) => return Err(Error::Invalid(format!("no positions to attend in layer {}", call.layer))),
    };
    let mut out = match &open_part {
        Some(o) => o.out.broadcast_mul(&(o.lse.clone() - &lse)?.exp()?.unsqueeze(1)?)?,
        None => Tensor::zeros((heads * t, d), DType::F32, dev)?,
    };
    let mut masses = Vec::with_capacity(open_chunks.len() + 1);
    for &(c, len) in &open_chunks {
        let ic = idx.narrow(1, c, len)?;
        let k = span(dev, "attention: gather", || kv.gather_keys(call.kv_layer, &ic, end))?;
        masses.push(sparse::attention_mass(&q_rows, &k, &lse, None, len, call.scale)?);
    }
    if let Some(m) = masked_part {
        let (o, mass) = masked_probs(m, &lse.reshape((kvh, rows, 1))?)?;
        out = (out + o.reshape((heads * t, d))?)?;
        masses.push(mass);
    }
    let masses = Tensor::cat(&masses, 1)?;
    let mut scores = vec![0f32; kvh * s];
    folio_runtime::device::copy_to_host(&masses, bytemuck::cast_slice_mut(&mut scores))?;
    let out = out.reshape((heads, t, d))?.to_dtype(call.q.dtype())?;
    Ok((out, scores))
}

/// The masked path's logits of a chunk: scaled, masked `[kv, rows, len]` f32, and its values.
struct Masked<'a> {
    call: &'a AttnCall<'a>,
    kv: &'a dyn DecodeTier,
    idx: &'a Tensor,
    q: Tensor,
    row_pos: Tensor,
    row_lo: Tensor,
    chunks: Vec<(usize, usize)>,
    /// The only chunk's logits and values, kept from the first pass when there is one chunk.
    first: Option<(Tensor, Tensor)>,
    /// `[kv, rows, 1]` log-sum-exp of these positions alone (flattened: the call's rows' order).
    lse: Tensor,
}

impl<'a> Masked<'a> {
    fn logits(&self, (c, len): (usize, usize)) -> Result<(Tensor, Tensor)> {
        let (call, dev) = (self.call, self.call.q.device());
        let ic = self.idx.narrow(1, c, len)?;
        let end = call.q_start + call.q.dim(1)?;
        let (k, v) = span(dev, "attention: gather", || self.kv.gather(call.kv_layer, &ic, end))?;
        let z = (self.q.matmul(&k.to_dtype(DType::F32)?.transpose(1, 2)?)? * call.scale as f64)?;
        let key_pos = ic.to_dtype(DType::F32)?.unsqueeze(1)?;
        let visible = (key_pos.broadcast_le(&self.row_pos)? * key_pos.broadcast_ge(&self.row_lo)?)?;
        let masked = Tensor::new(MASKED as f32, dev)?;
        Ok((visible.where_cond(&z, &masked.broadcast_as(z.shape())?)?, v))
    }
}

/// First pass of the masked path over the positions `idx [kv, s]`: their log-sum-exp per row.
fn masked_lse<'a>(call: &'a AttnCall<'a>, kv: &'a dyn DecodeTier, idx: &'a Tensor) -> Result<Masked<'a>> {
    let (heads, t, d) = call.q.dims3()?;
    let (kvh, s) = idx.dims2()?;
    let rows = heads / kvh * t;
    let dev = call.q.device();
    // [kv, group, t, d] -> [kv, group·t, d]: row i of a KV head is query head i / t, position i % t.
    let q = call.q.to_dtype(DType::F32)?.reshape((kvh, rows, d))?;
    let row_pos: Vec<f32> = (0..rows).map(|i| (call.q_start + i % t) as f32).collect();
    let row_lo: Vec<f32> =
        row_pos.iter().map(|&p| call.window.map_or(0.0, |w| (p as usize + 1).saturating_sub(w) as f32)).collect();
    let row_pos = Tensor::from_vec(row_pos, (1, rows, 1), dev)?;
    let row_lo = Tensor::from_vec(row_lo, (1, rows, 1), dev)?;
    // Chunks hold `[kv, rows, len]` logits: a long question (many rows) gets shorter ones.
    let chunk = (SCAN_ELEMS / rows.max(1)).clamp(MIN_SCORED_CHUNK, SCAN_CHUNK);
    let chunks: Vec<(usize, usize)> = (0..s).step_by(chunk).map(|c| (c, chunk.min(s - c))).collect();
    let mut masked = Masked {
        call,
        kv,
        idx,
        q,
        row_pos,
        row_lo,
        chunks,
        first: None,
        lse: Tensor::zeros((kvh, rows, 1), DType::F32, dev)?,
    };
    let (mut m, mut l) = (None::<Tensor>, None::<Tensor>);
    for &chunk in &masked.chunks {
        let (z, v) = masked.logits(chunk)?;
        let mc = z.max_keepdim(2)?;
        let lc = z.broadcast_sub(&mc)?.exp()?.sum_keepdim(2)?;
        (m, l) = match (m, l) {
            (Some(m0), Some(l0)) => {
                let mn = m0.maximum(&mc)?;
                let l = ((l0 * (m0 - &mn)?.exp()?)? + (lc * (mc - &mn)?.exp()?)?)?;
                (Some(mn), Some(l))
            }
            _ => (Some(mc), Some(lc)),
        };
        if masked.chunks.len() == 1 {
            masked.first = Some((z, v));
        }
    }
    let (Some(m), Some(l)) = (m, l) else {
        return Err(Error::Invalid(format!("no positions to attend in layer {}", call.layer)));
    };
    masked.lse = (m + l.log()?)?;
    Ok(masked)
}

/// Second pass of the masked path with the call's final log-sum-exp `lse [kv, rows, 1]`: the
/// weighted values `[kv, rows, d]` f32 and each position's probability summed over the rows,
/// `[kv, s]`.
fn masked_probs(mut masked: Masked<'_>, lse: &Tensor) -> Result<(Tensor, Tensor)> {
    let (heads, t, d) = masked.call.q.dims3()?;
    let kvh = masked.idx.dim(0)?;
    let call = masked.call;
    let mut out = Tensor::zeros((kvh, heads / kvh * t, d), DType::F32, call.q.device())?;
    let mut sums = Vec::with_capacity(masked.chunks.len());
    for chunk in masked.chunks.clone() {
        let (z, v) = match masked.first.take() {
            Some(both) => both,
            None => masked.logits(chunk)?,
        };
        let p = z.broadcast_sub(lse)?.exp()?;
        out = (out + p.matmul(&v.to_dtype(DType::F32)?)?)?;
        sums.push(p.sum(1)?);
    }
    Ok((out, Tensor::cat(&sums, 1)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row kernels over the positions every row sees give the masked path's attention and
    /// per-position sums: a question (several rows, its own positions masked) and a decode step
    /// (one row, all open), over saved rows and a tail, with a scattered live set; on the CPU,
    /// and on a GPU in f32 and in bf16 (whose row kernel rounds the softmax weights to bf16).
    #[test]
    fn open_positions_through_the_row_kernels_equal_the_masked_path() -> Result<()> {
        #[allow(unused_mut)] // only a CUDA build adds the GPU's runs
        let mut runs = vec![(Device::Cpu, DType::F32, 1e-5f32)];
        #[cfg(feature = "cuda")]
        if let Some(gpu) = folio_runtime::gpu::cuda_unavailable().is_none().then(|| Device::new_cuda(0).ok()).flatten()
        {
            runs.extend([(gpu.clone(), DType::F32, 1e-4), (gpu, DType::BF16, 1e-2)]);
        }
        for (dev, dtype, tolerance) in runs {
            open_positions_match(&dev, dtype, tolerance)?;
        }
        Ok(())
    }

    fn open_positions_match(dev: &Device, dtype: DType, tolerance: f32) -> Result<()> {
        use crate::kv_cache::KvStore;
        use crate::kv_cache::OffloadKv;
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let (kvh, group, d, saved) = (2, 7, 128, 70_000);
        let mut rng = StdRng::seed_from_u64(7);
        let mut random = |shape: &[usize]| -> Result<Tensor> {
            let n: usize = shape.iter().product();
            let x = Tensor::from_vec((0..n).map(|_| rng.random_range(-1f32..1.0)).collect::<Vec<_>>(), shape, dev)?;
            Ok(x.to_dtype(dtype)?)
        };
        let mut kv = OffloadKv::new(1, kvh, d, saved, dtype, dev)?;
        kv.fill(0, 0, &random(&[kvh, saved, d])?, &random(&[kvh, saved, d])?)?;
        for t in [4usize, 1] {
            kv.set_len(saved)?;
            kv.write(0, saved, &random(&[kvh, t, d])?, &random(&[kvh, t, d])?)?;
            let q = random(&[kvh * group, t, d])?;
            let call =
                AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: saved, kv: &kv, scale: 0.3, window: None };
            // Every third saved position (more than one chunk of them) and the call's own.
            let live: Vec<u32> = (0..saved as u32).step_by(3).chain(saved as u32..(saved + t) as u32).collect();
            let s = live.len();
            let idx = Tensor::from_vec(live.repeat(kvh), (kvh, s), dev)?;
            let open = if t == 1 { s } else { s - t };
            let (want_out, want) = attend_scored(&call, &kv, &idx, 0)?;
            let (got_out, got) = attend_scored(&call, &kv, &idx, open)?;
            let diff = (want_out.to_dtype(DType::F32)? - got_out.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < tolerance && worst < 1e-4, "{dev:?} {dtype:?} t {t}: out {diff}, sums {worst}");
            let total: f32 = got.iter().sum();
            assert!((total - (kvh * group * t) as f32).abs() < 1e-2, "each row's probabilities sum to 1: {total}");
        }
        Ok(())
    }
}
