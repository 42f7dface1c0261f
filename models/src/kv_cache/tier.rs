//! Decode tiers: what the attention methods' fast paths ask of the store they decode over —
//! score keys, gather the rows they pick, attend exactly — behind one trait, so a method never
//! looks for a concrete store and every store with rows on the compute path runs the fast paths.
//!
//! Two implementations: the offloaded tier ([`crate::kv_cache::OffloadKv`]: saved rows in host
//! memory, a pick gathered over the host link by the gather kernel) and the resident one here,
//! over any store's segments on the model's device ([`crate::kv_cache::DenseKv`], a context's
//! [`crate::kv_cache::ContextKv`]): picks are gathered from device memory with `index_select`,
//! scores are one batched matmul per segment. A store offers its tier through
//! [`KvStore::tier`]; one without (the [`crate::kv_cache::Reference`] wrapper) runs each method's CPU
//! reference, which is how the tests hold the fast paths to them.
//!
//! Positions are absolute; a store's rows `0..saved()` are the saved prefix its indexes cover
//! (0 for a store with nothing saved, whose indexes then cover what is visible at the first
//! decode step).

use candle_core::{DType, Device, Tensor};
use folio_kernels::attention::{attention_block, merge, Mask};
use folio_kernels::select::HostRows;

use super::{KvSegment, KvStore};
use crate::error::{Error, Result};

/// A store's tier as [`KvStore::tier`] hands it out: the store itself, or a resident view of
/// its segments made for the call.
pub enum TierRef<'a> {
    Store(&'a dyn DecodeTier),
    Resident(Resident<'a>),
}

impl<'a> std::ops::Deref for TierRef<'a> {
    type Target = dyn DecodeTier + 'a;

    fn deref(&self) -> &Self::Target {
        match self {
            Self::Store(tier) => *tier,
            Self::Resident(view) => view,
        }
    }
}

/// One exact attention a tier computes ([`DecodeTier::dense`]): queries over every key they
/// see.
pub struct Exact<'a> {
    /// The layer's index in the store.
    pub layer: usize,
    /// Post-RoPE queries `[q_heads, t, head_dim]` for positions `q_start..q_start + t`.
    pub q: &'a Tensor,
    pub q_start: usize,
    pub scale: f32,
    /// Sliding window, counted with the query's own token.
    pub window: Option<usize>,
}

/// See the module docs.
pub trait DecodeTier {
    fn kv_heads(&self) -> usize;
    fn head_dim(&self) -> usize;
    /// The compute device the tier hands its rows to.
    fn device(&self) -> &Device;
    /// Rows `0..saved()` are the saved prefix (what an index stored with it covers).
    fn saved(&self) -> usize;
    /// K and V rows `[rows, s, d]` of the positions `idx [rows, s]` (u32, `< end`) of each row's
    /// KV head (`rows` is the query heads, or the KV heads for a pick shared by a group).
    fn gather(&self, layer: usize, idx: &Tensor, end: usize) -> Result<(Tensor, Tensor)>;
    /// K rows only, as [`DecodeTier::gather`] (a search scoring keys needs no values).
    fn gather_keys(&self, layer: usize, idx: &Tensor, end: usize) -> Result<Tensor>;
    /// Exact q·k `[q_heads, end]` (f32) of one query `q [q_heads, d]` against every key below
    /// `end`: the exact top-k scan.
    fn scores(&self, layer: usize, q: &Tensor, end: usize) -> Result<Tensor>;
    /// Keys `[kv_heads, end - start, d]` of positions `start..end` on the device.
    fn keys(&self, layer: usize, start: usize, end: usize) -> Result<Tensor>;
    /// Keys of positions `0..end` in position order, in chunks `[kv_heads, c, d]`, for an index
    /// build.
    fn for_each_key_chunk(&self, layer: usize, end: usize, f: &mut dyn FnMut(&Tensor) -> Result<()>) -> Result<()>;
    /// Exact attention of `query` over every key it sees, in the query's dtype.
    fn dense(&self, query: &Exact<'_>) -> Result<Tensor>;
    /// K and V `[kv_heads, 1, d]` of position `pos` of every KV head (a decode step's own row,
    /// for a method that caches rows on the device: BUZZ, HiP, streaming), possibly a view of
    /// a larger tensor (any strides; [`folio_kernels::heads::place_row`] takes it as it is).
    fn row(&self, layer: usize, pos: usize) -> Result<(Tensor, Tensor)> {
        gather_row(self, layer, pos)
    }
    /// Keep every row of `layer` on the compute device from now on, for a method that reads
    /// all of them at each step. Nothing to do where they already are.
    fn keep_resident(&self, _layer: usize) -> Result<()> {
        Ok(())
    }
    /// The saved rows `0..saved()` of `layer` (K, V) where the tier keeps them in host memory,
    /// mapped for the device: for a method that reads them where they lie (a kernel reading
    /// scattered rows over the link, or the CPU attending them). `None` when the rows are not
    /// in host memory, or nothing is saved.
    fn host_rows(&self, _layer: usize) -> Option<(&HostRows, &HostRows)> {
        None
    }
    /// The saved keys `0..saved()` of `layer` where the tier keeps them in host memory, mapped
    /// for the device — with the values ([`DecodeTier::host_rows`]) or without them (the file
    /// tier with the keys read into memory) — for a method that reads keys alone where they lie
    /// (HiP's search).
    fn host_keys(&self, layer: usize) -> Option<&HostRows> {
        self.host_rows(layer).map(|(k, _)| k)
    }
    /// Where the saved rows lie when the tier reads them from a file (the file tier): the
    /// directory a method's state too large for host memory goes to ([`super::Spill`]), on
    /// the same disk. `None` where the rows are in memory.
    fn file_dir(&self) -> Option<&std::path::Path> {
        None
    }
    /// Starts reading, on a thread of its own, the saved rows a coming
    /// [`DecodeTier::gather_listed`] of `layer` will ask for — `dims` `[rows, s]` positions,
    /// given by `positions` when they are ready — where the tier reads rows from a slower
    /// medium than the one the gather reads (the file tier: the disk read while the device
    /// works, the gather a hit). `None` where nothing is read ahead.
    fn read_ahead(&self, _layer: usize, _dims: (usize, usize), _positions: PositionsLater) -> Option<ReadAhead> {
        None
    }
    /// Whether [`DecodeTier::read_ahead`] reads anything (a caller need not make the positions
    /// ready for the host where it does not).
    fn reads_ahead(&self) -> bool {
        false
    }
    /// [`DecodeTier::gather`] queued on the GPU's side stream once the device's own has queued
    /// everything so far (HiP: a searched mask's rows read over the host link beside the step,
    /// as the search's keys were, not on the step's own stream): the K and V rows written, and
    /// the tensors the launches read. `None` where the tier reads rows otherwise (from a file,
    /// or on the device: nothing to overlap), and then the caller gathers in order.
    #[cfg(feature = "cuda")]
    fn gather_after(
        &self,
        _layer: usize,
        _idx: &Tensor,
        _end: usize,
        _side: &folio_kernels::select::Side,
    ) -> Result<Option<folio_kernels::select::SideWork>> {
        Ok(None)
    }
    /// [`DecodeTier::gather`] with `idx`'s positions on the host too (`listed`, row-major; a
    /// [`ReadAhead`]'s): a tier that looks positions up on the CPU then need not wait for the
    /// device to bring them over.
    fn gather_listed(&self, layer: usize, idx: &Tensor, _listed: &[u32], end: usize) -> Result<(Tensor, Tensor)> {
        self.gather(layer, idx, end)
    }
}

/// A coming gather's positions, row-major, brought to the host when they are ready (run on the
/// read-ahead's thread: what it waits for, the caller does not).
pub type PositionsLater = Box<dyn FnOnce() -> candle_core::Result<Vec<u32>> + Send>;

/// A read-ahead in flight ([`DecodeTier::read_ahead`]); dropped unread, it is waited for (its
/// thread holds the tier, and with it the tier's host memory, until it is done).
pub struct ReadAhead(Option<std::thread::JoinHandle<Result<Vec<u32>>>>);

impl ReadAhead {
    /// Runs `read` on a thread of its own.
    pub(crate) fn spawn(read: impl FnOnce() -> Result<Vec<u32>> + Send + 'static) -> Option<Self> {
        let spawned = std::thread::Builder::new().name("folio-read-ahead".into()).spawn(read);
        spawned.inspect_err(|e| tracing::warn!(error = %e, "no thread to read ahead")).ok().map(|t| Self(Some(t)))
    }

    /// Waits for the read; the positions it read the rows of.
    pub fn positions(mut self) -> Result<Vec<u32>> {
        let thread = self.0.take().ok_or_else(|| Error::Invalid("a read-ahead waited for twice".into()))?;
        thread.join().map_err(|_| Error::Invalid("a read-ahead's thread panicked".into()))?
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        if let Some(thread) = self.0.take() {
            let _ = thread.join();
        }
    }
}

/// [`DecodeTier::row`] through [`DecodeTier::gather`]: what a tier does for a row it cannot
/// hand out as a view.
pub(crate) fn gather_row<T: DecodeTier + ?Sized>(tier: &T, layer: usize, pos: usize) -> Result<(Tensor, Tensor)> {
    let idx = Tensor::from_vec(vec![pos as u32; tier.kv_heads()], (tier.kv_heads(), 1), tier.device())?;
    tier.gather(layer, &idx, pos + 1)
}

/// Rows per chunk of a resident scan or index build (bounds the f32 copies made of them).
const KEY_CHUNK: usize = 1 << 16;

/// The resident tier of `store`: its segments on the compute device.
pub struct Resident<'a> {
    store: &'a dyn KvStore,
    kv_heads: usize,
    head_dim: usize,
    device: &'a Device,
}

impl<'a> Resident<'a> {
    /// The view a store of `kv_heads` × `head_dim` rows on `device` offers as its tier.
    pub fn of(store: &'a dyn KvStore, kv_heads: usize, head_dim: usize, device: &'a Device) -> TierRef<'a> {
        TierRef::Resident(Self { store, kv_heads, head_dim, device })
    }
}

impl Resident<'_> {
    fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>> {
        self.store.segments(layer, end)
    }

    /// K (or V) rows `[rows, s, d]` at `idx [rows, s]` from `segs`: per segment and KV head, the
    /// group's positions (clamped into the segment) select from the head's rows — a contiguous
    /// view of the store, so nothing is copied but the picks — and each position keeps the
    /// segment it falls in. Positions are exact in f32 below 2^24 (16.7M tokens).
    fn pick(&self, segs: &[KvSegment], idx: &Tensor, values: bool) -> Result<Tensor> {
        let (rows, s) = idx.dims2()?;
        let group = rows / self.kv_heads;
        debug_assert!(group >= 1 && rows % self.kv_heads == 0, "{rows} rows over {} KV heads", self.kv_heads);
        let d = self.head_dim;
        let pos = idx.to_dtype(DType::F32)?;
        let mut out: Option<Tensor> = None;
        for seg in segs {
            let part = if values { &seg.v } else { &seg.k };
            let len = part.dim(1)?;
            if len == 0 {
                continue;
            }
            let local = (&pos - seg.start as f64)?.clamp(0.0, (len - 1) as f64)?.to_dtype(DType::U32)?;
            let heads = (0..self.kv_heads)
                .map(|h| {
                    let wanted = local.narrow(0, h * group, group)?.flatten_all()?;
                    Ok(part.get(h)?.index_select(&wanted, 0)?.reshape((group, s, d))?)
                })
                .collect::<Result<Vec<_>>>()?;
            let picked = Tensor::cat(&heads, 0)?;
            out = Some(match out {
                None => picked,
                Some(acc) => {
                    let inside = pos.ge(seg.start as f64)?.unsqueeze(2)?.broadcast_as((rows, s, d))?;
                    inside.where_cond(&picked, &acc)?
                }
            });
        }
        out.ok_or_else(|| Error::Invalid("no rows stored to gather from".into()))
    }
}

impl DecodeTier for Resident<'_> {
    fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    fn head_dim(&self) -> usize {
        self.head_dim
    }

    fn device(&self) -> &Device {
        self.device
    }

    fn saved(&self) -> usize {
        self.store.saved_len()
    }

    fn gather(&self, layer: usize, idx: &Tensor, end: usize) -> Result<(Tensor, Tensor)> {
        let segs = self.segments(layer, end)?;
        Ok((self.pick(&segs, idx, false)?, self.pick(&segs, idx, true)?))
    }

    fn gather_keys(&self, layer: usize, idx: &Tensor, end: usize) -> Result<Tensor> {
        self.pick(&self.segments(layer, end)?, idx, false)
    }

    /// Per segment, a [`KEY_CHUNK`] of keys at a time, so the f32 copy stays one chunk large.
    fn scores(&self, layer: usize, q: &Tensor, end: usize) -> Result<Tensor> {
        let heads = q.dim(0)?;
        let group = heads / self.kv_heads;
        // [kv, group, d] @ [kv, d, c] -> [kv, group, c] -> [heads, c].
        let qg = q.to_dtype(DType::F32)?.reshape((self.kv_heads, group, self.head_dim))?;
        let mut parts = Vec::new();
        for seg in self.segments(layer, end)? {
            let len = seg.k.dim(1)?;
            for start in (0..len).step_by(KEY_CHUNK) {
                let k = seg.k.narrow(1, start, KEY_CHUNK.min(len - start))?;
                let c = k.dim(1)?;
                parts.push(qg.matmul(&k.to_dtype(DType::F32)?.transpose(1, 2)?)?.reshape((heads, c))?);
            }
        }
        Ok(Tensor::cat(&parts, 1)?)
    }

    fn keys(&self, layer: usize, start: usize, end: usize) -> Result<Tensor> {
        let parts = self
            .segments(layer, end)?
            .into_iter()
            .filter_map(|seg| {
                let len = seg.k.dim(1).ok()?;
                let (a, b) = (start.max(seg.start), end.min(seg.start + len));
                (b > a).then(|| seg.k.narrow(1, a - seg.start, b - a))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        if parts.is_empty() {
            return Err(Error::Invalid(format!("no keys {start}..{end} stored for layer {layer}")));
        }
        Ok(Tensor::cat(&parts, 1)?)
    }

    fn for_each_key_chunk(&self, layer: usize, end: usize, f: &mut dyn FnMut(&Tensor) -> Result<()>) -> Result<()> {
        for start in (0..end).step_by(KEY_CHUNK) {
            f(&self.keys(layer, start, (start + KEY_CHUNK).min(end))?)?;
        }
        Ok(())
    }

    fn dense(&self, query: &Exact<'_>) -> Result<Tensor> {
        dense_over_segments(self.store, query)
    }
}

/// Exact attention of `query` over `store`'s segments, each segment's partial merged by LSE.
pub fn dense_over_segments(store: &dyn KvStore, query: &Exact<'_>) -> Result<Tensor> {
    let t = query.q.dim(1)?;
    let mask = Mask { q_offset: query.q_start, window: query.window };
    let mut acc = None;
    for seg in store.segments(query.layer, query.q_start + t)? {
        let part = attention_block(query.q, &seg.k, &seg.v, seg.start, mask, query.scale)?;
        acc = Some(match acc {
            None => part,
            Some(prev) => merge(&prev, &part)?,
        });
    }
    let out = acc.ok_or_else(|| Error::Invalid(format!("no keys stored for layer {}", query.layer)))?;
    Ok(out.out.to_dtype(query.q.dtype())?)
}
