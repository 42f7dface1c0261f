//! The shared half of sparse decode: read a layer's keys, attend exactly over a per-head
//! selection of them. This is the CPU reference every method's fast path will be held to:
//! keys are gathered and scored with plain loops, softmax accumulates in f64.

use candle_core::{DType, Device, Tensor};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Attended, Attention, AttnCall, Dense, Read};
use crate::error::{Error, Result};
use crate::kv_cache::KvStore;

/// The layer's keys and values for positions `0..end` as f32 on the CPU, `[kv_heads, end, d]`
/// flattened row-major, with their shape.
pub struct LayerRows {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub kv_heads: usize,
    pub len: usize,
    pub head_dim: usize,
}

impl LayerRows {
    pub fn read(call: &AttnCall<'_>, end: usize) -> Result<Self> {
        Self::read_store(call.kv, call.kv_layer, end)
    }

    pub fn read_store(kv: &dyn KvStore, layer: usize, end: usize) -> Result<Self> {
        let segs = kv.segments(layer, end)?;
        let flat = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?) };
        let ks: Vec<Tensor> = segs.iter().map(|s| flat(&s.k)).collect::<Result<_>>()?;
        let vs: Vec<Tensor> = segs.iter().map(|s| flat(&s.v)).collect::<Result<_>>()?;
        let (k, v) = (Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?);
        let (kv_heads, len, head_dim) = k.dims3()?;
        if len != end {
            return Err(Error::Invalid(format!("layer {layer} has {len} rows, expected {end}")));
        }
        Ok(Self { k: k.flatten_all()?.to_vec1()?, v: v.flatten_all()?.to_vec1()?, kv_heads, len, head_dim })
    }

    pub fn key(&self, head: usize, pos: usize) -> &[f32] {
        &self.k[(head * self.len + pos) * self.head_dim..][..self.head_dim]
    }

    pub fn value(&self, head: usize, pos: usize) -> &[f32] {
        &self.v[(head * self.len + pos) * self.head_dim..][..self.head_dim]
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Query rows of a call as f32, `[q_heads][t][d]`.
pub fn query_rows(call: &AttnCall<'_>) -> Result<Vec<Vec<Vec<f32>>>> {
    Ok(call.q.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec3()?)
}

/// One query head's choice: key positions (distinct, visible) and, optionally, an additive
/// logit bias per position (MagicPIG's `-log u_i`); empty `bias` means none.
#[derive(Debug, Clone, Default)]
pub(super) struct HeadPick {
    pub pos: Vec<usize>,
    pub bias: Vec<f32>,
}

impl HeadPick {
    pub fn plain(pos: Vec<usize>) -> Self {
        Self { pos, bias: Vec::new() }
    }
}

/// Softmax attention of one query row over `keys` (position, logit bias) of KV head `kvh`:
/// `Σ softmax(q·k·scale + bias) v`, in f64. An empty set gives zeros.
pub(super) fn attend_row(
    q: &[f32],
    rows: &LayerRows,
    kvh: usize,
    keys: impl Iterator<Item = (usize, f32)> + Clone,
    scale: f32,
) -> Vec<f32> {
    attend_row_lse(q, rows, kvh, keys, scale).0
}

/// [`attend_row`] and the log-sum-exp of its logits (`-inf` over an empty set), for references
/// whose fast paths merge partials by LSE.
pub(super) fn attend_row_lse(
    q: &[f32],
    rows: &LayerRows,
    kvh: usize,
    keys: impl Iterator<Item = (usize, f32)> + Clone,
    scale: f32,
) -> (Vec<f32>, f32) {
    let logits: Vec<(usize, f64)> =
        keys.map(|(p, b)| (p, (dot(q, rows.key(kvh, p)) * scale) as f64 + b as f64)).collect();
    let max = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
    let mut acc = vec![0f64; rows.head_dim];
    let mut total = 0f64;
    for &(p, z) in &logits {
        let w = (z - max).exp();
        total += w;
        for (a, v) in acc.iter_mut().zip(rows.value(kvh, p)) {
            *a += w * *v as f64;
        }
    }
    let out = acc.iter().map(|a| if total > 0.0 { (a / total) as f32 } else { 0.0 }).collect();
    (out, (max + total.ln()) as f32)
}

/// A decode step's output `[q_heads, 1, d]` from per-head picks, on the query's device.
fn attend_picks(call: &AttnCall<'_>, rows: &LayerRows, picks: &[HeadPick]) -> Result<Tensor> {
    let queries = query_rows(call)?;
    let groups = queries.len() / rows.kv_heads;
    let mut out = Vec::with_capacity(queries.len() * rows.head_dim);
    for (h, pick) in picks.iter().enumerate() {
        let bias = |i: usize| pick.bias.get(i).copied().unwrap_or(0.0);
        let keys = pick.pos.iter().enumerate().map(|(i, &p)| (p, bias(i)));
        out.extend(attend_row(&queries[h][0], rows, h / groups, keys, call.scale));
    }
    Ok(Tensor::from_vec(out, (picks.len(), 1, rows.head_dim), &Device::Cpu)?
        .to_dtype(call.q.dtype())?
        .to_device(call.q.device())?)
}

/// The visible key range `lo..hi` of a one-token call (the sliding window applied).
pub fn visible(call: &AttnCall<'_>) -> (usize, usize) {
    let hi = call.q_start + 1;
    (call.window.map_or(0, |w| hi.saturating_sub(w)), hi)
}

/// The common frame of every sparse method: a multi-token call runs dense; a decode step reads
/// the layer's rows, asks `select` for each query head's pick among the visible `lo..hi` and
/// the key rows its search touched, and attends exactly over the picks.
pub(super) fn sparse_decode(
    call: &AttnCall<'_>,
    select: impl FnOnce(&LayerRows, usize, usize) -> Result<(Vec<HeadPick>, f64)>,
) -> Result<Attended> {
    if call.q.dim(1)? != 1 {
        return Dense.attend(call);
    }
    let (lo, hi) = visible(call);
    let rows = LayerRows::read(call, hi)?;
    let (mut picks, searched) = select(&rows, lo, hi)?;
    for p in &mut picks {
        if !p.pos.windows(2).all(|w| w[0] < w[1]) {
            // Sort (bias along) so `read` is a sorted set, as the harness expects.
            let mut both: Vec<(usize, f32)> =
                p.pos.iter().enumerate().map(|(i, &x)| (x, p.bias.get(i).copied().unwrap_or(0.0))).collect();
            both.sort_by_key(|x| x.0);
            both.dedup_by_key(|x| x.0);
            let had_bias = !p.bias.is_empty();
            p.pos = both.iter().map(|x| x.0).collect();
            p.bias = if had_bias { both.iter().map(|x| x.1).collect() } else { Vec::new() };
        }
        debug_assert!(p.pos.iter().all(|&x| x >= lo && x < hi), "pick outside the visible range");
    }
    let out = attend_picks(call, &rows, &picks)?;
    Ok(Attended { out, read: Read::Rows(picks.into_iter().map(|p| p.pos).collect()), searched })
}

/// The `k` candidates with the largest scores (ties to the earlier position), ascending.
pub(super) fn top_positions(candidates: Vec<usize>, k: usize, score: impl Fn(usize) -> f32) -> Vec<usize> {
    let mut scored: Vec<(usize, f32)> = candidates.into_iter().map(|p| (p, score(p))).collect();
    if k < scored.len() {
        scored.select_nth_unstable_by(k, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        scored.truncate(k);
    }
    let mut out: Vec<usize> = scored.into_iter().map(|x| x.0).collect();
    out.sort_unstable();
    out
}

/// Per-layer state a method keeps between decode steps (an index, cached masks, an evicting
/// cache), dropped by [`super::Attention::reset`]. A poisoned lock (a panic mid-update in
/// another thread) still hands out the map: every entry is replaced whole, never half-written.
pub(super) struct PerLayer<T>(Mutex<HashMap<usize, T>>);

impl<T> PerLayer<T> {
    pub fn new() -> Self {
        Self(Mutex::new(HashMap::new()))
    }

    pub fn lock(&self) -> MutexGuard<'_, HashMap<usize, T>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn clear(&self) {
        self.lock().clear();
    }
}

/// Where a layer's index came from: a context-file section, built from the keys, or rebuilt
/// because the stored section was damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "lowercase")]
pub enum IndexSource {
    File,
    Built,
    Rebuilt,
}

/// Per-layer indexes of the saved context (MagicPIG's tables, Double Sparsity's labels, IVF
/// lists), each with where it came from: cached here, else the store's section, else built.
pub(super) struct Indexes<T>(PerLayer<(Arc<T>, IndexSource)>);

impl<T> Indexes<T> {
    pub fn new() -> Self {
        Self(PerLayer::new())
    }

    pub fn clear(&self) {
        self.0.clear();
    }

    pub fn sources(&self) -> BTreeMap<usize, IndexSource> {
        self.0.lock().iter().map(|(l, (_, s))| (*l, *s)).collect()
    }

    /// The layer's cached index, if `covers` says it still applies.
    pub fn cached(&self, layer: usize, covers: impl Fn(&T) -> bool) -> Option<Arc<T>> {
        self.0.lock().get(&layer).filter(|(ix, _)| covers(ix)).map(|(ix, _)| ix.clone())
    }

    /// The store's section `name` for this call's layer, decoded, else `build()`; kept for
    /// later steps (a failed build is the call's error). A damaged section (a failed checksum or a malformed body) is recorded as
    /// `Rebuilt`: an index is a cache of the keys, so it is built again rather than failing
    /// the answer.
    pub fn load(
        &self,
        call: &AttnCall<'_>,
        name: &str,
        decode: impl FnOnce(&[u8]) -> Result<T>,
        build: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        self.load_placed(call, name, (decode, build), Ok)
    }

    /// [`Self::load`], the index then handed to `place` (MagicPIG's lists moved to disk on the
    /// file tier), whose error is the call's: a failure there says nothing of the section.
    pub fn load_placed(
        &self,
        call: &AttnCall<'_>,
        name: &str,
        (decode, build): (impl FnOnce(&[u8]) -> Result<T>, impl FnOnce() -> Result<T>),
        place: impl FnOnce(T) -> Result<T>,
    ) -> Result<Arc<T>> {
        let stored = call.kv.saved_index(name, call.kv_layer).and_then(|b| b.map(|b| decode(&b)).transpose());
        let (ix, source) = match stored {
            Ok(Some(ix)) => (ix, IndexSource::File),
            Ok(None) => (build()?, IndexSource::Built),
            Err(_) => (build()?, IndexSource::Rebuilt),
        };
        let ix = Arc::new(place(ix)?);
        self.0.lock().insert(call.layer, (ix.clone(), source));
        Ok(ix)
    }
}

/// The end of the keys an index covers: the saved prefix when the store has one (so the
/// index is a function of the context file alone and can be stored in it), else everything
/// visible at the first decode step.
pub(super) fn index_base(kv: &dyn KvStore, hi: usize) -> usize {
    match kv.saved_len() {
        0 => hi,
        saved => saved.min(hi),
    }
}

/// Little-endian arrays, the body of index sections.
#[derive(Default)]
pub(super) struct SectionWriter(pub Vec<u8>);

impl SectionWriter {
    pub fn u32s(&mut self, xs: impl IntoIterator<Item = u32>) {
        xs.into_iter().for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
    }

    pub fn f32s(&mut self, xs: &[f32]) {
        xs.iter().for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
    }

    pub fn u16s(&mut self, xs: &[u16]) {
        xs.iter().for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
    }

    pub fn u8s(&mut self, xs: &[u8]) {
        self.0.extend_from_slice(xs);
    }
}

/// Reads back what [`SectionWriter`] wrote, refusing short or overlong sections.
pub(super) struct SectionReader<'a> {
    bytes: &'a [u8],
    name: &'a str,
}

impl<'a> SectionReader<'a> {
    pub fn new(bytes: &'a [u8], name: &'a str) -> Self {
        Self { bytes, name }
    }

    /// The next `n` bytes.
    pub fn u8s(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.bytes.len() < n {
            return Err(Error::Invalid(format!("index section \"{}\" is shorter than its settings say", self.name)));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    pub fn u16s(&mut self, n: usize) -> Result<Vec<u16>> {
        Ok(self.u8s(n * 2)?.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
    }

    pub fn u32s(&mut self, n: usize) -> Result<Vec<u32>> {
        Ok(self.u8s(n * 4)?.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    pub fn f32s(&mut self, n: usize) -> Result<Vec<f32>> {
        Ok(self.u8s(n * 4)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// Every byte was read.
    pub fn finish(self) -> Result<()> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(Error::Invalid(format!("index section \"{}\" is longer than its settings say", self.name)))
        }
    }
}
