//! The shared half of the methods' fast paths: attention over the rows a step picked, over any
//! decode tier ([`crate::tier::DecodeTier`]: resident or offloaded). A method scores and picks
//! with its own index; these gather the picks through the tier and run the kernel over the
//! gathered rows (`folio_kernels::sparse::decode_attention_rows`), or, for a method that
//! scores its cache by the attention it received (BUZZ), exact attention with the
//! probabilities.

use candle_core::{DType, Device, Tensor};
use folio_kernels::sparse;

use super::AttnCall;
use crate::error::{Error, Result};
use crate::profile::span;
use crate::tier::DecodeTier;

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

/// Per-head picks of different lengths (positions, and logit biases or none) as the `[heads, s]`
/// positions [`attend_selected`] takes, plus a `[heads, s]` bias when any row carries biases or
/// is short: a short row is padded with `filler` (any visible position) at −∞, read but never
/// weighted.
pub fn pad_picks(picks: &[(Vec<u32>, Vec<f32>)], filler: u32, device: &Device) -> Result<(Tensor, Option<Tensor>)> {
    let heads = picks.len();
    let s = picks.iter().map(|(pos, _)| pos.len()).max().unwrap_or(0);
    let needs_bias = picks.iter().any(|(pos, bias)| pos.len() < s || !bias.is_empty());
    let (mut idx, mut bias) = (Vec::with_capacity(heads * s), Vec::with_capacity(heads * s));
    for (pos, b) in picks {
        let pad = s - pos.len();
        idx.extend(pos.iter().copied().chain(std::iter::repeat_n(filler, pad)));
        if needs_bias {
            bias.extend(b.iter().copied().chain(std::iter::repeat_n(0.0, pos.len() - b.len())));
            bias.extend(std::iter::repeat_n(f32::NEG_INFINITY, pad));
        }
    }
    let idx = Tensor::from_vec(idx, (heads, s), device)?;
    let bias = if needs_bias { Some(Tensor::from_vec(bias, (heads, s), device)?) } else { None };
    Ok((idx, bias))
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
/// scores its cache by accumulated attention (BUZZ) needs. Two passes over the positions in
/// chunks (the log-sum-exp, then the probabilities), one when they fit in one chunk.
pub fn attend_scored(call: &AttnCall<'_>, kv: &dyn DecodeTier, idx: &Tensor) -> Result<(Tensor, Vec<f32>)> {
    let (heads, t, d) = call.q.dims3()?;
    let (kvh, s) = idx.dims2()?;
    let rows = heads / kvh * t;
    let dev = call.q.device();
    let end = call.q_start + t;
    // [kv, group, t, d] -> [kv, group·t, d]: row i of a KV head is query head i / t, position i % t.
    let q = call.q.to_dtype(DType::F32)?.reshape((kvh, rows, d))?;
    let row_pos: Vec<f32> = (0..rows).map(|i| (call.q_start + i % t) as f32).collect();
    let row_lo: Vec<f32> =
        row_pos.iter().map(|&p| call.window.map_or(0.0, |w| (p as usize + 1).saturating_sub(w) as f32)).collect();
    let row_pos = Tensor::from_vec(row_pos, (1, rows, 1), dev)?;
    let row_lo = Tensor::from_vec(row_lo, (1, rows, 1), dev)?;
    let masked = Tensor::new(MASKED as f32, dev)?;
    // Chunks hold `[kv, rows, len]` logits: a long question (many rows) gets shorter ones.
    let chunk = (SCAN_ELEMS / rows.max(1)).clamp(MIN_SCORED_CHUNK, SCAN_CHUNK);
    let chunks: Vec<(usize, usize)> = (0..s).step_by(chunk).map(|c| (c, chunk.min(s - c))).collect();
    // Scaled, masked logits `[kv, rows, len]` of a chunk, and its values.
    let logits = |(c, len): (usize, usize)| -> Result<(Tensor, Tensor)> {
        let ic = idx.narrow(1, c, len)?;
        let (k, v) = kv.gather(call.kv_layer, &ic, end)?;
        let z = (q.matmul(&k.to_dtype(DType::F32)?.transpose(1, 2)?)? * call.scale as f64)?;
        let key_pos = ic.to_dtype(DType::F32)?.unsqueeze(1)?;
        let visible = (key_pos.broadcast_le(&row_pos)? * key_pos.broadcast_ge(&row_lo)?)?;
        Ok((visible.where_cond(&z, &masked.broadcast_as(z.shape())?)?, v))
    };
    let mut first = None;
    let (mut m, mut l) = (None::<Tensor>, None::<Tensor>);
    for &chunk in &chunks {
        let (z, v) = logits(chunk)?;
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
        if chunks.len() == 1 {
            first = Some((z, v));
        }
    }
    let (Some(m), Some(l)) = (m, l) else {
        return Err(Error::Invalid(format!("no positions to attend in layer {}", call.layer)));
    };
    let lse = (m + l.log()?)?;
    let mut out = Tensor::zeros((kvh, rows, d), DType::F32, dev)?;
    let mut scores = Vec::with_capacity(kvh * s);
    let mut per_chunk = Vec::with_capacity(chunks.len());
    for &chunk in &chunks {
        let (z, v) = match first.take() {
            Some(both) => both,
            None => logits(chunk)?,
        };
        let p = z.broadcast_sub(&lse)?.exp()?;
        out = (out + p.matmul(&v.to_dtype(DType::F32)?)?)?;
        per_chunk.push(p.sum(1)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?);
    }
    for g in 0..kvh {
        for c in &per_chunk {
            scores.extend_from_slice(&c[g]);
        }
    }
    let out = out.reshape((heads, t, d))?.to_dtype(call.q.dtype())?;
    Ok((out, scores))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_picks_pad_at_minus_infinity() -> Result<()> {
        let dev = Device::Cpu;
        // Equal rows without biases need no bias tensor.
        let (idx, bias) = pad_picks(&[(vec![1, 2], vec![]), (vec![3, 4], vec![])], 9, &dev)?;
        assert_eq!(idx.to_vec2::<u32>()?, [[1, 2], [3, 4]]);
        assert!(bias.is_none());
        // A short row is padded with the filler at −∞; rows without biases get zeros.
        let (idx, bias) = pad_picks(&[(vec![1, 2, 3], vec![]), (vec![5], vec![0.5])], 9, &dev)?;
        assert_eq!(idx.to_vec2::<u32>()?, [[1, 2, 3], [5, 9, 9]]);
        let inf = f32::NEG_INFINITY;
        assert_eq!(bias.expect("a short row needs a bias").to_vec2::<f32>()?, [[0.0, 0.0, 0.0], [0.5, inf, inf]]);
        Ok(())
    }
}
