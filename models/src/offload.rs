//! The offloaded KV tier: a saved context's rows in host memory, the conversation's on the
//! device, and the decode-step primitives the attention methods build their fast paths from.
//!
//! Why this shape: at a million tokens a 7B model's K/V is ~57 GB, twice a consumer GPU, while a
//! decode step of a sparse method reads a few thousand rows per head. So the saved prefix lives
//! in host memory ([`HostRows`]: page-locked and mapped into the GPU's address space) and a
//! step moves only what the method picked: the GPU scores with its index, selects with the
//! top-k kernel, and the gather kernel pulls the chosen rows over the host link straight into
//! the buffer the attention kernel reads. The question and answer tokens (the *tail*) are
//! written on the device, as the methods' papers keep generated tokens there.
//!
//! On the CPU device the same code runs over plain host buffers with the kernels' references,
//! which is how CI checks the offloaded paths against the methods' CPU references.

use candle_core::{DType, Device, Tensor};
use folio_kernels::attention::{attention_block, merge, AttnOutput, Mask};
use folio_kernels::select::HostRows;
use folio_kernels::sparse;
use folio_kernels::Positions;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::attention::AttnCall;
use crate::context::ContextFile;
use crate::error::{Error, Result};
use crate::kv::{KvSegment, KvStore, SavedTail};
use crate::model::Model;
use crate::prefill::prefill_layers;

/// Rows per host chunk when a step must read everything (dense attention, the exact top-k
/// scan, building an index): 64 Ki rows per KV head keeps a chunk's K+V at 64 MiB for a
/// 4-KV-head, 128-dim bf16 layer.
const SCAN_CHUNK: usize = 1 << 16;

/// A saved prefix in host memory plus a device tail.
pub struct OffloadKv {
    host: Vec<(HostRows, HostRows)>,
    /// The context file the prefix came from: its stored index sections serve the methods.
    file: Option<Arc<ContextFile>>,
    /// Saved layers copied to the device because a method reads all of their rows every step
    /// (HiP's dense leading layers): `(k, v)` `[kv_heads, saved, d]`.
    resident: Mutex<HashMap<usize, (Tensor, Tensor)>>,
    /// `[q_heads, saved]` u32 positions `0..saved` per query head: a resident layer's decode
    /// step attends all of them through the selected-row kernel (made once, shared by layers).
    every_position: Mutex<Option<Tensor>>,
    saved: usize,
    tail: SavedTail,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl OffloadKv {
    /// Room for a `saved`-token prefix per layer on the host (zeros until [`Self::fill`]),
    /// and an empty tail on `device`.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        saved: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let host = (0..layers)
            .map(|_| {
                Ok((
                    HostRows::new(device, dtype, kv_heads, saved, head_dim)?,
                    HostRows::new(device, dtype, kv_heads, saved, head_dim)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            host,
            file: None,
            resident: Mutex::new(HashMap::new()),
            every_position: Mutex::new(None),
            saved,
            tail: SavedTail::new(saved, layers, kv_heads, head_dim, dtype, device),
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        })
    }

    /// A saved context's rows, decoded from the file (checksums verified) into host memory for
    /// a model computing in `dtype` on `device`.
    pub fn from_context(file: Arc<ContextFile>, dtype: DType, device: &Device) -> Result<Self> {
        let h = file.header();
        let (layers, kv_heads, tokens, head_dim) = (h.layers, h.kv_heads, h.tokens, h.head_dim);
        let mut kv = Self::new(layers, kv_heads, head_dim, tokens, dtype, device)?;
        for layer in 0..layers {
            let (k, v) = file.layer_kv(layer)?;
            let rows = |x: Vec<f32>| Tensor::from_vec(x, (kv_heads, tokens, head_dim), &Device::Cpu);
            kv.fill(layer, 0, &rows(k)?, &rows(v)?)?;
        }
        kv.file = Some(file);
        Ok(kv)
    }

    /// `tokens` prefilled layer-major on the model's device as the saved prefix, each layer's
    /// rows moved to host memory as soon as it is done: a context file's store without the file
    /// (the needle eval's offloaded tier). The device holds one layer's K/V at a time.
    pub fn prefill(model: &Model, tokens: &[u32], chunk: usize) -> Result<Self> {
        let cfg = model.config();
        let mut kv =
            Self::new(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tokens.len(), model.dtype(), model.device())?;
        prefill_layers(model, tokens, chunk, |layer, k, v| kv.fill(layer, 0, &k, &v))?;
        Ok(kv)
    }

    /// Writes saved rows `k`, `v` (`[kv_heads, t, head_dim]`) of `layer` at `pos..pos + t`.
    pub fn fill(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (hk, hv) =
            self.host.get_mut(layer).ok_or_else(|| Error::Invalid(format!("offloaded store: no layer {layer}")))?;
        hk.write(pos, &k.to_dtype(self.dtype)?)?;
        hv.write(pos, &v.to_dtype(self.dtype)?)?;
        Ok(())
    }

    pub fn saved(&self) -> usize {
        self.saved
    }

    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Host bytes held for the saved prefix (K and V of every layer).
    pub fn host_bytes(&self) -> u64 {
        self.host.iter().map(|(k, v)| (k.bytes() + v.bytes()) as u64).sum()
    }

    fn layer(&self, layer: usize) -> Result<&(HostRows, HostRows)> {
        self.host.get(layer).ok_or_else(|| Error::Invalid(format!("offloaded store: no layer {layer}")))
    }

    /// Copies `layer`'s saved rows to the device (once) for a method that reads every one of
    /// them each step; dense attention over the layer then reads device memory, not the link.
    pub fn keep_resident(&self, layer: usize) -> Result<()> {
        let mut resident = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        if let std::collections::hash_map::Entry::Vacant(slot) = resident.entry(layer) {
            // Filled in place, a chunk at a time: no second copy of the layer on the device.
            let shape = (self.kv_heads, self.saved, self.head_dim);
            let (k, v) =
                (Tensor::zeros(shape, self.dtype, &self.device)?, Tensor::zeros(shape, self.dtype, &self.device)?);
            for start in (0..self.saved).step_by(SCAN_CHUNK) {
                let (kc, vc) = self.host_chunk(layer, start, (start + SCAN_CHUNK).min(self.saved))?;
                k.slice_set(&kc, 1, start)?;
                v.slice_set(&vc, 1, start)?;
            }
            slot.insert((k, v));
        }
        Ok(())
    }

    /// Frees the layers kept resident (a method that wanted them is done).
    pub fn drop_resident(&self) {
        self.resident.lock().unwrap_or_else(|e| e.into_inner()).clear();
        *self.every_position.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn every_position(&self, heads: usize) -> Result<Tensor> {
        let mut slot = self.every_position.lock().unwrap_or_else(|e| e.into_inner());
        match &*slot {
            Some(t) if t.dim(0)? == heads => Ok(t.clone()),
            _ => {
                let t = Tensor::arange(0u32, self.saved as u32, &self.device)?.unsqueeze(0)?.repeat((heads, 1))?;
                *slot = Some(t.clone());
                Ok(t)
            }
        }
    }

    fn resident_rows(&self, layer: usize) -> Option<(Tensor, Tensor)> {
        self.resident.lock().unwrap_or_else(|e| e.into_inner()).get(&layer).cloned()
    }

    /// The tail's rows of `layer` up to absolute position `end` (`None` when there are none).
    pub fn tail_rows(&self, layer: usize, end: usize) -> Result<Option<(Tensor, Tensor)>> {
        match self.tail.segments(layer, end)?.pop() {
            Some(seg) => Ok(Some((seg.k.contiguous()?, seg.v.contiguous()?))),
            None => Ok(None),
        }
    }

    /// Rows `[kv_heads, end - start, d]` of positions `start..end` (all below the saved length).
    fn host_chunk(&self, layer: usize, start: usize, end: usize) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.layer(layer)?;
        let idx = self.chunk_positions(start, end)?;
        Ok((k.gather(&idx, 1, None, Positions::Trusted)?, v.gather(&idx, 1, None, Positions::Trusted)?))
    }

    /// A layer's saved K and V rows in host memory, for work the CPU does on them itself
    /// (MagicPIG's sampled attention).
    pub fn host_rows(&self, layer: usize) -> Result<(&HostRows, &HostRows)> {
        let (k, v) = self.layer(layer)?;
        Ok((k, v))
    }

    /// Saved keys `[kv_heads, end - start, d]` of positions `start..end` (below the saved
    /// length) on the device: an index build hashes them there.
    pub fn saved_keys(&self, layer: usize, start: usize, end: usize) -> Result<Tensor> {
        if start > end || end > self.saved {
            return Err(Error::Invalid(format!("saved keys {start}..{end} of {} rows", self.saved)));
        }
        self.host_keys(layer, start, end)
    }

    /// Keys only of [`Self::host_chunk`]: a scan or an index build needs no values.
    fn host_keys(&self, layer: usize, start: usize, end: usize) -> Result<Tensor> {
        let (k, _) = self.layer(layer)?;
        Ok(k.gather(&self.chunk_positions(start, end)?, 1, None, Positions::Trusted)?)
    }

    /// `[kv_heads, end - start]` u32: positions `start..end` for every KV head.
    fn chunk_positions(&self, start: usize, end: usize) -> Result<Tensor> {
        Ok(Tensor::arange(start as u32, end as u32, &self.device)?.unsqueeze(0)?.repeat((self.kv_heads, 1))?)
    }

    /// K and V rows `[rows, s, d]` of the positions `idx [rows, s]` (u32, `< end`, produced by
    /// the caller's selection) of each row's KV head (`rows` is the query heads, or the KV
    /// heads for a pick shared by a group): from the host below the saved length, the tail above.
    pub fn gather(&self, layer: usize, idx: &Tensor, end: usize) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.layer(layer)?;
        let group = idx.dim(0)? / self.kv_heads;
        let tail = self.tail_rows(layer, end)?;
        let (tk, tv) = (tail.as_ref().map(|t| &t.0), tail.as_ref().map(|t| &t.1));
        Ok((k.gather(idx, group, tk, Positions::Trusted)?, v.gather(idx, group, tv, Positions::Trusted)?))
    }

    /// K rows only, as [`Self::gather`] (a search scoring keys needs no values).
    pub fn gather_keys(&self, layer: usize, idx: &Tensor, end: usize) -> Result<Tensor> {
        let (k, _) = self.layer(layer)?;
        let group = idx.dim(0)? / self.kv_heads;
        let tail = self.tail_rows(layer, end)?;
        Ok(k.gather(idx, group, tail.as_ref().map(|t| &t.0), Positions::Trusted)?)
    }

    /// Exact q·k `[q_heads, end]` (f32) of one query `q [q_heads, d]` against every key below
    /// `end`, read in chunks: the exact top-k scan.
    pub fn scores(&self, layer: usize, q: &Tensor, end: usize) -> Result<Tensor> {
        let heads = q.dim(0)?;
        let group = heads / self.kv_heads;
        // [kv, group, d] @ [kv, d, c] -> [kv, group, c] -> [heads, c]
        let qg = q.to_dtype(DType::F32)?.reshape((self.kv_heads, group, self.head_dim))?;
        let score = |k: &Tensor| -> Result<Tensor> {
            let c = k.dim(1)?;
            Ok(qg.matmul(&k.to_dtype(DType::F32)?.transpose(1, 2)?)?.reshape((heads, c))?)
        };
        let mut parts = Vec::new();
        for start in (0..end.min(self.saved)).step_by(SCAN_CHUNK) {
            let k = self.host_keys(layer, start, (start + SCAN_CHUNK).min(end.min(self.saved)))?;
            parts.push(score(&k)?);
        }
        if let Some((k, _)) = self.tail_rows(layer, end)? {
            parts.push(score(&k)?);
        }
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// Every saved key of `layer` in position order, in chunks `k [kv_heads, c, d]`, for index builds.
    pub fn for_each_key_chunk(&self, layer: usize, mut f: impl FnMut(&Tensor) -> Result<()>) -> Result<()> {
        for start in (0..self.saved).step_by(SCAN_CHUNK) {
            f(&self.host_keys(layer, start, (start + SCAN_CHUNK).min(self.saved))?)?;
        }
        Ok(())
    }
}

impl KvStore for OffloadKv {
    fn len(&self) -> usize {
        self.tail.len()
    }

    fn write(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.tail.write(layer, pos, k, v)
    }

    /// Materialises the saved rows on the device: for the CPU references and small contexts;
    /// the offloaded paths read only what they pick.
    fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>> {
        let mut segs = Vec::new();
        if end > 0 && self.saved > 0 {
            let (k, v) = self.host_chunk(layer, 0, end.min(self.saved))?;
            segs.push(KvSegment { start: 0, k, v });
        }
        segs.extend(self.tail.segments(layer, end)?);
        Ok(segs)
    }

    fn set_len(&mut self, len: usize) -> Result<()> {
        self.tail.set_len(len)
    }

    fn reserve(&mut self, total: usize) -> Result<()> {
        self.tail.reserve(total)
    }

    fn saved_len(&self) -> usize {
        self.saved
    }

    fn saved_index(&self, name: &str, layer: usize) -> Result<Option<Vec<u8>>> {
        match &self.file {
            Some(file) => Ok(file.index(name, layer)?.map(<[u8]>::to_vec)),
            None => Ok(None),
        }
    }

    fn offloaded(&self) -> Option<&OffloadKv> {
        Some(self)
    }
}

/// Exact attention of a call over an offloaded store, reading the saved rows in chunks (each
/// chunk's partial merged by LSE): dense decode, and the question's tokens for every method.
pub fn dense(call: &AttnCall<'_>, kv: &OffloadKv) -> Result<Tensor> {
    let t = call.q.dim(1)?;
    let end = call.q_start + t;
    let mask = Mask { q_offset: call.q_start, window: call.window };
    let first = call.window.map_or(0, |w| (call.q_start + 1).saturating_sub(w));
    let mut acc: Option<AttnOutput> = None;
    let mut add = |part: AttnOutput| -> Result<()> {
        acc = Some(match acc.take() {
            None => part,
            Some(prev) => merge(&prev, &part)?,
        });
        Ok(())
    };
    let saved_end = end.min(kv.saved);
    let mut start = first / SCAN_CHUNK * SCAN_CHUNK;
    let resident = kv.resident_rows(call.kv_layer);
    if let (Some((k, v)), 1, None, true) = (&resident, t, call.window, saved_end == kv.saved) {
        // A decode step over a resident layer: every saved row through the selected-row
        // kernel, which reads the bf16 rows as they are (no f32 working copies).
        let q = call.q.squeeze(1)?;
        let idx = kv.every_position(q.dim(0)?)?;
        let (out, lse) = sparse::decode_attention(&q, k, v, &idx, None, call.scale, Positions::Trusted)?;
        add(AttnOutput { out: out.unsqueeze(1)?, lse: lse.unsqueeze(1)? })?;
        start = saved_end;
    }
    while start < saved_end {
        // Chunks of the device copy when the layer is resident (so the f32 working copies stay
        // one chunk large), else gathered from the host.
        let stop = (start + SCAN_CHUNK).min(saved_end);
        let (k, v) = match &resident {
            Some((k, v)) => (k.narrow(1, start, stop - start)?, v.narrow(1, start, stop - start)?),
            None => kv.host_chunk(call.kv_layer, start, stop)?,
        };
        add(attention_block(call.q, &k, &v, start, mask, call.scale)?)?;
        start = stop;
    }
    if let Some((k, v)) = kv.tail_rows(call.kv_layer, end)? {
        add(attention_block(call.q, &k, &v, kv.saved, mask, call.scale)?)?;
    }
    let out = acc.ok_or_else(|| Error::Invalid(format!("no keys stored for layer {}", call.layer)))?;
    Ok(out.out.to_dtype(call.q.dtype())?)
}

/// One decode step's attention over the positions `idx [rows, s]` (u32, visible, distinct per
/// row): one row per query head, or one per KV head when a group shares its pick (then each
/// row is read once for the whole group). `bias [q_heads, s]` is added to the logits (−∞ pads a
/// head's shorter pick). Gathers the rows and runs the selected-row attention kernel. Output
/// `[q_heads, 1, d]` in the query's dtype.
pub fn attend_selected(call: &AttnCall<'_>, kv: &OffloadKv, idx: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out, _lse) = selected_partial(call, kv, idx, bias)?;
    Ok(out.unsqueeze(1)?.to_dtype(call.q.dtype())?)
}

/// [`attend_selected`] as a partial attention: `out [q_heads, d]` f32 and its LSE `[q_heads]`,
/// to merge with attention over other positions.
pub fn selected_partial(
    call: &AttnCall<'_>,
    kv: &OffloadKv,
    idx: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let s = idx.dim(1)?;
    let (k, v) = kv.gather(call.kv_layer, idx, call.q_start + 1)?;
    // The gathered rows are the kernel's K/V: `rows` heads of `s` rows each, read in order.
    let q = call.q.squeeze(1)?;
    let own = Tensor::arange(0u32, s as u32, idx.device())?.unsqueeze(0)?.repeat((q.dim(0)?, 1))?;
    Ok(sparse::decode_attention(&q, &k, &v, &own, bias, call.scale, Positions::Trusted)?)
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
pub fn attend_scored(call: &AttnCall<'_>, kv: &OffloadKv, idx: &Tensor) -> Result<(Tensor, Vec<f32>)> {
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
