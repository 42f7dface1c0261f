//! The shared half of sparse decode: read a layer's keys, attend exactly over a per-head
//! selection of them. This is the CPU reference every method's fast path will be held to:
//! all keys are gathered and scored with plain loops where that is clearer than tensor ops.

use candle_core::{DType, Device, Tensor};
use folio_kernels::attention::{attention_block, Mask};

use super::{Attention, AttnCall, Dense};
use crate::error::{Error, Result};

/// The layer's keys and values for positions `0..end` as f32 on the CPU, `[kv_heads, end, d]`
/// flattened row-major, with their shape.
pub(super) struct LayerRows {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub kv_heads: usize,
    pub len: usize,
    pub head_dim: usize,
}

impl LayerRows {
    pub fn read(call: &AttnCall<'_>, end: usize) -> Result<Self> {
        let segs = call.kv.segments(call.kv_layer, end)?;
        let flat = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?) };
        let ks: Vec<Tensor> = segs.iter().map(|s| flat(&s.k)).collect::<Result<_>>()?;
        let vs: Vec<Tensor> = segs.iter().map(|s| flat(&s.v)).collect::<Result<_>>()?;
        let (k, v) = (Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?);
        let (kv_heads, len, head_dim) = k.dims3()?;
        if len != end {
            return Err(Error::Invalid(format!("layer {} has {len} rows, expected {end}", call.layer)));
        }
        Ok(Self { k: k.flatten_all()?.to_vec1()?, v: v.flatten_all()?.to_vec1()?, kv_heads, len, head_dim })
    }

    pub fn key(&self, head: usize, pos: usize) -> &[f32] {
        &self.k[(head * self.len + pos) * self.head_dim..][..self.head_dim]
    }

    fn rows(&self, data: &[f32], head: usize, positions: &[usize]) -> Vec<f32> {
        positions
            .iter()
            .flat_map(|&p| data[(head * self.len + p) * self.head_dim..][..self.head_dim].iter().copied())
            .collect()
    }
}

/// Query rows of a one-token call as f32, `[q_heads][d]`.
pub(super) fn query_rows(call: &AttnCall<'_>) -> Result<Vec<Vec<f32>>> {
    let q = call.q.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.squeeze(1)?;
    Ok(q.to_vec2()?)
}

/// Exact attention of each query head `h` over the key positions `selected[h]` (sorted,
/// distinct, all visible to the query), through the same kernel as dense attention.
/// Output `[q_heads, 1, d]` on the query's device and dtype.
fn attend_selected(call: &AttnCall<'_>, rows: &LayerRows, selected: &[Vec<usize>]) -> Result<Tensor> {
    let q_heads = call.q.dim(0)?;
    let groups = q_heads / rows.kv_heads;
    let d = rows.head_dim;
    let q = call.q.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let mut outs = Vec::with_capacity(q_heads);
    for (h, sel) in selected.iter().enumerate() {
        let kvh = h / groups;
        let k = Tensor::from_vec(rows.rows(&rows.k, kvh, sel), (1, sel.len(), d), &Device::Cpu)?;
        let v = Tensor::from_vec(rows.rows(&rows.v, kvh, sel), (1, sel.len(), d), &Device::Cpu)?;
        // The selected keys are all visible: a causal mask at a position past them is a no-op.
        let mask = Mask { q_offset: rows.len, window: None };
        outs.push(attention_block(&q.narrow(0, h, 1)?, &k, &v, 0, mask, call.scale)?.out);
    }
    Ok(Tensor::cat(&outs, 0)?.to_dtype(call.q.dtype())?.to_device(call.q.device())?)
}

/// The common frame of every sparse method: a multi-token call runs dense; a decode step reads
/// the layer's rows, asks `select` for each query head's key positions among the visible
/// `lo..hi` (the call's sliding window applied), and attends exactly over them.
pub(super) fn sparse_decode(
    call: &AttnCall<'_>,
    select: impl FnOnce(&LayerRows, usize, usize) -> Result<Vec<Vec<usize>>>,
) -> Result<Tensor> {
    if call.q.dim(1)? != 1 {
        return Dense.forward(call);
    }
    let hi = call.q_start + 1;
    let lo = call.window.map_or(0, |w| hi.saturating_sub(w));
    let rows = LayerRows::read(call, hi)?;
    let selected = select(&rows, lo, hi)?;
    attend_selected(call, &rows, &selected)
}
