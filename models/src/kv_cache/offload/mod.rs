//! The offloaded KV tier: a saved context's rows in host memory — or, past the host budget,
//! left in the context file (the file tier: [`on_file`], `crate::kv_cache::FileRows`) — the
//! conversation's on the device; a [`DecodeTier`] the methods' fast paths run on
//! (crate::attention's `fast` module holds what they share).
//!
//! Why this shape: at a million tokens a 7B model's K/V is ~57 GB, twice a consumer GPU, while a
//! decode step of a sparse method reads a few thousand rows per head. So the saved prefix lives
//! in host memory ([`HostRows`]: page-locked and mapped into the GPU's address space; a
//! context file's rows read in place, in the file's dtype, from its registered mapping) and a
//! step moves only what the method picked: the GPU scores with its index, selects with the
//! top-k kernel, and the gather kernel pulls the chosen rows over the host link straight into
//! the buffer the attention kernel reads. The question and answer tokens (the *tail*) are
//! written on the device, as the methods' papers keep generated tokens there. When even a
//! compact dtype's rows do not fit the host budget, they are read from the file a block at a
//! time through a cache of what the steps keep picking, the keys kept in host memory when they
//! fit (the file tier's module docs say why).
//!
//! On the CPU device the same code runs over plain host buffers with the kernels' references,
//! which is how CI checks the offloaded paths against the methods' CPU references.

use candle_core::{DType, Device, Tensor};
use folio_kernels::attention::{attention_block, merge, AttnOutput, Mask};
use folio_kernels::select::{HostRows, SharedHost};
use folio_kernels::sparse;
use folio_kernels::Positions;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

mod on_file;

use super::file::{self as file_tier, least_bytes, FileRows, FileStats};
use super::tier::{DecodeTier, Exact, PositionsLater, ReadAhead, TierRef};
use super::{KvSegment, KvStore, SavedTail};
use crate::error::{kv_refused, Error, Result};
use folio_context_file::format::SectionKind;
use folio_context_file::{ContextFile, KvDtype};
use folio_runtime::host_budget::{self, Held, Hold};
pub use on_file::KEYS_IN_MEMORY_SHARE;
use on_file::{encode_stored, stored_layout};

/// Rows per host chunk when a step must read everything (dense attention, the exact top-k
/// scan, building an index): 64 Ki rows per KV head keeps a chunk's K+V at 64 MiB for a
/// 4-KV-head, 128-dim bf16 layer.
const SCAN_CHUNK: usize = 1 << 16;

/// The share of the host budget's room a context file's cache takes when its rows stay on disk:
/// the rest is for what comes after the open (a method's tables, a step's buffers, the app).
pub const FILE_CACHE_SHARE: f64 = 0.75;

/// The host memory the file tier takes for `kv` bytes of rows when the host budget has `room`
/// left: its share of the room, no more than the rows (what `from_context`, the planner and the
/// bench all size it by).
pub fn file_tier_bytes(room: u64, kv: u64) -> u64 {
    ((room as f64 * FILE_CACHE_SHARE) as u64).min(kv)
}

/// A saved prefix in host memory (or in its file, on the file tier) plus a device tail.
pub struct OffloadKv {
    host: Vec<(HostRows, HostRows)>,
    /// The host budget's hold on rows of this store's own (views hold theirs with the memory
    /// they share).
    _hold: Option<Hold>,
    /// The context file the prefix came from: its stored index sections serve the methods.
    file: Option<Arc<ContextFile>>,
    /// Whether `host` views shared memory in place (a file's mapping, [`Self::stored`]'s rows),
    /// rather than rows copied or filled into its own page-locked memory.
    in_place: bool,
    /// The saved rows when they stay in the context file (the file tier: `host` is empty), and
    /// on it each layer's keys when they were read into host memory (then the file serves values).
    file_rows: Option<Arc<FileRows>>,
    host_keys: Vec<HostRows>,
    /// Saved layers copied to the device because a method reads all of their rows every step
    /// (HiP's dense leading layers): `(k, v)` `[kv_heads, saved, d]`.
    resident: Mutex<HashMap<usize, (Tensor, Tensor)>>,
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
        let bytes = 2 * layers as u64 * HostRows::bytes_for(dtype, kv_heads, saved, head_dim)? as u64;
        let hold = host_budget::hold(bytes, "the offloaded K/V").map_err(kv_refused)?;
        let host = (0..layers)
            .map(|_| {
                Ok((
                    HostRows::new(device, dtype, kv_heads, saved, head_dim)?,
                    HostRows::new(device, dtype, kv_heads, saved, head_dim)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { host, _hold: Some(hold), ..Self::empty((layers, kv_heads, saved, head_dim), dtype, device) })
    }

    /// A store of `saved` rows per head with no rows yet (none in host memory, no file) and an
    /// empty tail: what each way of holding the rows fills in.
    fn empty((layers, kv_heads, saved, head_dim): (usize, usize, usize, usize), dtype: DType, device: &Device) -> Self {
        Self {
            host: Vec::new(),
            _hold: None,
            file: None,
            in_place: false,
            file_rows: None,
            host_keys: Vec::new(),
            resident: Mutex::new(HashMap::new()),
            saved,
            tail: SavedTail::new(saved, layers, kv_heads, head_dim, dtype, device),
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        }
    }

    /// A saved context's rows, read in place from the file's mapping (every K/V section's
    /// checksum verified first, over the machine's cores) in the file's dtype, widened to
    /// `dtype` by the gathers on `device`. On a GPU the mapping is registered (page-locked in
    /// place): no copy of the rows is made, and a step moves the file's bytes over the link.
    /// A GPU that refuses to register it (read-only registration is a device capability) gets
    /// [`Self::copied`] instead; [`Self::in_place`] says which. When the host budget cannot
    /// hold the file's mapping, the rows stay on disk: the file tier ([`Self::on_file`]) with a
    /// cache of [`FILE_CACHE_SHARE`] of what the budget has left.
    pub fn from_context(file: Arc<ContextFile>, dtype: DType, device: &Device) -> Result<Self> {
        let h = file.header();
        let hold = match file_hold(&file) {
            Ok(hold) => hold,
            Err(refused) => {
                let kv_bytes = h.layers as u64 * h.kv_dtype.kv_bytes(h.kv_heads * h.tokens, h.head_dim);
                let room = host_budget::room().unwrap_or(kv_bytes);
                let cache = file_tier_bytes(room, kv_bytes);
                if cache < least_bytes(h.kv_dtype, (h.layers, h.kv_heads, h.tokens, h.head_dim)) {
                    return Err(kv_refused(refused));
                }
                return Self::on_file(file, cache, dtype, device);
            }
        };
        let sections = file.kv_sections()?;
        let shared = match shared_host(&file, device, hold) {
            Ok(shared) => shared,
            // Refused registration (not the host budget's refusal: a copy would take more).
            Err(Error::Context { .. }) if device.is_cuda() => return Self::copied(file, dtype, device),
            Err(e) => return Err(e),
        };
        let offsets: Vec<usize> = sections.iter().map(|&(at, _)| at).collect();
        let shape = (h.layers, h.kv_heads, h.tokens, h.head_dim);
        let mut kv = Self::viewing(&shared, &offsets, h.kv_dtype, shape, dtype, device).map_err(|e| {
            Error::Context { path: file.path().to_owned(), msg: format!("reading its K/V in place: {e}") }
        })?;
        kv.file = Some(file);
        Ok(kv)
    }

    /// A saved prefix stored as a context file stores it (`kv_dtype`, each layer's K and V a
    /// section), in host memory of its own shared with `device` in place, the rows of positions
    /// `start..start + t` of a layer given by `rows(layer, start, t)` as `[kv_heads, t, d]` K and
    /// V: the file's tier without the file (`folio bench --shape --kv-dtype`).
    pub fn stored(
        shape: (usize, usize, usize, usize),
        kv_dtype: KvDtype,
        dtype: DType,
        device: &Device,
        rows: impl FnMut(usize, usize, usize) -> Result<(Tensor, Tensor)>,
    ) -> Result<Self> {
        let (offsets, end) = stored_layout(shape, kv_dtype);
        let hold = host_budget::hold(end as u64, "the offloaded K/V").map_err(kv_refused)?;
        // 2 MiB pages where the kernel has them: the CPU reads scattered rows (MagicPIG's sample).
        let mut mem = folio_runtime::host_memory::anon_huge(end)
            .map_err(|e| Error::Invalid(format!("{end} bytes of host memory: {e}")))?;
        encode_stored(shape, kv_dtype, &offsets, rows, |at, bytes| {
            mem[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(())
        })?;
        let mem = mem.make_read_only().map_err(|e| Error::Invalid(e.to_string()))?;
        let shared = SharedHost::new(device, Arc::new(Held::new(mem, hold)))?;
        Self::viewing(&shared, &offsets, kv_dtype, shape, dtype, device)
    }

    /// Views of each layer's K and V sections at `offsets` (K then V, layer by layer) of
    /// `shared`, stored as `kv_dtype`, gathered as `dtype`.
    fn viewing(
        shared: &Arc<SharedHost>,
        offsets: &[usize],
        kv_dtype: KvDtype,
        (layers, kv_heads, tokens, head_dim): (usize, usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let codec = |kind| kv_dtype.codec(kind).stored(kv_heads * tokens, head_dim);
        let (ks, vs) = (codec(SectionKind::Keys), codec(SectionKind::Values));
        let view = |at: usize, stored| HostRows::view(device, shared, at, stored, (kv_heads, tokens, head_dim), dtype);
        let host =
            offsets.chunks_exact(2).map(|kv| Ok((view(kv[0], ks)?, view(kv[1], vs)?))).collect::<Result<Vec<_>>>()?;
        if host.len() != layers {
            return Err(Error::Invalid(format!("{} K/V sections for {layers} layers", offsets.len())));
        }
        Ok(Self { host, in_place: true, ..Self::empty((layers, kv_heads, tokens, head_dim), dtype, device) })
    }

    /// A saved context's rows decoded from the file (checksums verified) into host memory of
    /// their own, in `dtype`: the path for a GPU that cannot register the file's mapping (page-
    /// locking fresh memory ran at 2.4 GB/s on the GPU machine, so a million tokens take tens
    /// of seconds where [`Self::from_context`] takes one).
    pub fn copied(file: Arc<ContextFile>, dtype: DType, device: &Device) -> Result<Self> {
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

    /// Whether the saved rows are read in place (from the context file's mapping, or as
    /// [`Self::stored`] laid them out) rather than copied.
    pub fn in_place(&self) -> bool {
        self.in_place
    }

    /// Writes saved rows `k`, `v` (`[kv_heads, t, head_dim]`) of `layer` at `pos..pos + t`.
    pub fn fill(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (hk, hv) =
            self.host.get_mut(layer).ok_or_else(|| Error::Invalid(format!("offloaded store: no layer {layer}")))?;
        hk.write(pos, &k.to_dtype(self.dtype)?)?;
        hv.write(pos, &v.to_dtype(self.dtype)?)?;
        Ok(())
    }

    /// Host bytes held for the saved prefix (K and V of every layer; on the file tier its cache).
    pub fn host_bytes(&self) -> u64 {
        let cache = self.file_rows.as_deref().map_or(0, FileRows::cache_bytes);
        let keys = self.host_keys.iter().map(|k| k.bytes() as u64).sum::<u64>();
        cache + keys + self.host.iter().map(|(k, v)| (k.bytes() + v.bytes()) as u64).sum::<u64>()
    }

    /// What the file tier has read so far, when the saved rows are on it.
    pub fn file_stats(&self) -> Option<FileStats> {
        let keys = self.host_keys.iter().map(|k| k.bytes() as u64).sum();
        self.file_rows.as_ref().map(|rows| FileStats { keys_in_memory: keys, ..rows.stats() })
    }

    fn layer(&self, layer: usize) -> Result<&(HostRows, HostRows)> {
        self.host.get(layer).ok_or_else(|| Error::Invalid(format!("offloaded store: no layer {layer}")))
    }

    /// The saved K (`kind` 0) or V (1) rows of `layer` at `idx` (`[rows, s]`, row `r` of KV head
    /// `r / group`), positions past the saved ones from `tail`: from host memory, or from the
    /// file tier (`keep`: a step's picks, cached; else a scan, passed through; `listed`: `idx`'s
    /// positions on the host already).
    fn read(
        &self,
        (layer, kind): (usize, usize),
        (idx, listed): (&Tensor, Option<&[u32]>),
        group: usize,
        tail: Option<&Tensor>,
        keep: bool,
    ) -> Result<Tensor> {
        if let (0, Some(keys)) = (kind, self.host_keys.get(layer)) {
            return Ok(keys.gather(idx, group, tail, Positions::Trusted)?);
        }
        if let Some(rows) = &self.file_rows {
            let at = (self.dtype, &self.device);
            return file_tier::gather(rows, (layer, kind), (idx, listed), group, tail, at, keep);
        }
        let (k, v) = self.layer(layer)?;
        Ok([k, v][kind].gather(idx, group, tail, Positions::Trusted)?)
    }

    /// The tail's keys below `end` alone, contiguous (the kernels read a contiguous tail): a
    /// search reads them every round, and copying the values beside them was half its device
    /// copies.
    fn tail_keys(&self, layer: usize, end: usize) -> Result<Option<Tensor>> {
        Ok(match self.tail.segments(layer, end)?.pop() {
            Some(seg) => Some(seg.k.contiguous()?),
            None => None,
        })
    }

    fn copy_resident(&self, layer: usize) -> Result<()> {
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
    }

    fn resident_rows(&self, layer: usize) -> Option<(Tensor, Tensor)> {
        self.resident.lock().unwrap_or_else(|e| e.into_inner()).get(&layer).cloned()
    }

    /// K and V rows at `idx` (positions also on the host where `listed`), as
    /// [`DecodeTier::gather`].
    fn gather_at(
        &self,
        layer: usize,
        (idx, listed): (&Tensor, Option<&[u32]>),
        end: usize,
    ) -> Result<(Tensor, Tensor)> {
        let group = idx.dim(0)? / self.kv_heads;
        let tail = self.tail_rows(layer, end)?;
        let (tk, tv) = (tail.as_ref().map(|t| &t.0), tail.as_ref().map(|t| &t.1));
        let k = self.read((layer, 0), (idx, listed), group, tk, true)?;
        Ok((k, self.read((layer, 1), (idx, listed), group, tv, true)?))
    }

    /// The tail's rows of `layer` up to absolute position `end` (`None` when there are none).
    fn tail_rows(&self, layer: usize, end: usize) -> Result<Option<(Tensor, Tensor)>> {
        match self.tail.segments(layer, end)?.pop() {
            Some(seg) => Ok(Some((seg.k.contiguous()?, seg.v.contiguous()?))),
            None => Ok(None),
        }
    }

    /// Rows `[kv_heads, end - start, d]` of positions `start..end` (all below the saved length).
    fn host_chunk(&self, layer: usize, start: usize, end: usize) -> Result<(Tensor, Tensor)> {
        let idx = self.chunk_positions(start, end)?;
        Ok((self.read((layer, 0), (&idx, None), 1, None, false)?, self.read((layer, 1), (&idx, None), 1, None, false)?))
    }

    /// Keys only of [`Self::host_chunk`]: a scan or an index build needs no values.
    fn host_keys(&self, layer: usize, start: usize, end: usize) -> Result<Tensor> {
        self.read((layer, 0), (&self.chunk_positions(start, end)?, None), 1, None, false)
    }

    /// `[kv_heads, end - start]` u32: positions `start..end` for every KV head.
    fn chunk_positions(&self, start: usize, end: usize) -> Result<Tensor> {
        Ok(Tensor::arange(start as u32, end as u32, &self.device)?.unsqueeze(0)?.repeat((self.kv_heads, 1))?)
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

    /// A forward pass ended: on the file tier, the next lookups are the next step's.
    fn set_len(&mut self, len: usize) -> Result<()> {
        if let Some(rows) = &self.file_rows {
            rows.end_step();
        }
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

    fn tier(&self) -> Option<TierRef<'_>> {
        Some(TierRef::Store(self))
    }
}

/// The offloaded tier: saved rows gathered from host memory by what a step picks (the gather
/// kernel reads them over the host link into the buffer the attention kernel reads), the tail
/// on the device.
impl DecodeTier for OffloadKv {
    fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    fn head_dim(&self) -> usize {
        self.head_dim
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn saved(&self) -> usize {
        self.saved
    }

    fn gather(&self, layer: usize, idx: &Tensor, end: usize) -> Result<(Tensor, Tensor)> {
        self.gather_at(layer, (idx, None), end)
    }

    fn gather_keys(&self, layer: usize, idx: &Tensor, end: usize) -> Result<Tensor> {
        let group = idx.dim(0)? / self.kv_heads;
        self.read((layer, 0), (idx, None), group, self.tail_keys(layer, end)?.as_ref(), true)
    }

    /// On the file tier, the saved rows a step's picks will read ([`FileRows::read_ahead`]):
    /// the values, and the keys where they are not in host memory.
    fn read_ahead(&self, layer: usize, (rows, sel): (usize, usize), positions: PositionsLater) -> Option<ReadAhead> {
        let file = self.file_rows.clone()?;
        if rows == 0 || !rows.is_multiple_of(self.kv_heads) {
            return None;
        }
        let kinds: &'static [usize] = if self.host_keys.is_empty() { &[0, 1] } else { &[1] };
        let group = rows / self.kv_heads;
        let asked = std::time::Instant::now();
        ReadAhead::spawn(move || {
            let pos = positions()?;
            if pos.len() != rows * sel {
                return Err(Error::Invalid(format!("a read-ahead of {rows}×{sel} positions got {}", pos.len())));
            }
            let got = std::time::Instant::now();
            for &kind in kinds {
                // A failed read is the gather's to report: it reads the blocks again.
                if let Err(e) = file.read_ahead((layer, kind), &pos, (sel, group)) {
                    tracing::warn!(error = %e, layer, "reading a step's rows ahead");
                }
            }
            file.count_read_ahead(asked, got);
            Ok(pos)
        })
    }

    fn reads_ahead(&self) -> bool {
        self.file_rows.is_some()
    }

    fn gather_listed(&self, layer: usize, idx: &Tensor, listed: &[u32], end: usize) -> Result<(Tensor, Tensor)> {
        if listed.len() != idx.elem_count() {
            return Err(Error::Invalid(format!("{} positions listed for a gather of {:?}", listed.len(), idx.dims())));
        }
        self.gather_at(layer, (idx, Some(listed)), end)
    }

    /// The rows in host memory (not the file tier's) gathered on the side stream; the tail's
    /// rows, copied contiguous on the device's stream first, are what the launches read.
    #[cfg(feature = "cuda")]
    fn gather_after(
        &self,
        layer: usize,
        idx: &Tensor,
        end: usize,
        side: &folio_kernels::select::Side,
    ) -> Result<Option<folio_kernels::select::SideWork>> {
        if self.file_rows.is_some() || !self.device.is_cuda() {
            return Ok(None);
        }
        let (k, v) = self.layer(layer)?;
        let group = idx.dim(0)? / self.kv_heads;
        let tail = self.tail_rows(layer, end)?;
        let (tk, tv) = (tail.as_ref().map(|t| &t.0), tail.as_ref().map(|t| &t.1));
        let written = vec![k.gather_after(idx, group, tk, side)?, v.gather_after(idx, group, tv, side)?];
        let read = tail.map(|(k, v)| vec![k, v]).unwrap_or_default();
        Ok(Some(folio_kernels::select::SideWork { written, read }))
    }

    /// A tail row is a view of the tail narrowed to it (the gather kernel would want the whole
    /// tail contiguous: a copy of every row the conversation wrote, per layer, per step).
    fn row(&self, layer: usize, pos: usize) -> Result<(Tensor, Tensor)> {
        if pos < self.saved {
            return super::tier::gather_row(self, layer, pos);
        }
        let seg = self
            .tail
            .segments(layer, pos + 1)?
            .pop()
            .ok_or_else(|| Error::Invalid(format!("no row {pos} in layer {layer}'s tail")))?;
        let at = pos - seg.start;
        // Views of the segment: the callers place the row with one launch each, strides and all.
        Ok((seg.k.narrow(1, at, 1)?, seg.v.narrow(1, at, 1)?))
    }

    /// The saved keys read in chunks over the link, the tail's on the device.
    fn scores(&self, layer: usize, q: &Tensor, end: usize) -> Result<Tensor> {
        let heads = q.dim(0)?;
        let group = heads / self.kv_heads;
        // [kv, group, d] @ [kv, d, c] -> [kv, group, c] -> [heads, c]
        let qg = q.to_dtype(DType::F32)?.reshape((self.kv_heads, group, self.head_dim))?;
        let score = |k: &Tensor| -> Result<Tensor> {
            let c = k.dim(1)?;
            Ok(qg.matmul(&k.to_dtype(DType::F32)?.transpose(1, 2)?)?.reshape((heads, c))?)
        };
        let mut parts = Vec::new();
        self.for_each_key_chunk(layer, end, &mut |k| {
            parts.push(score(k)?);
            Ok(())
        })?;
        Ok(Tensor::cat(&parts, 1)?)
    }

    fn keys(&self, layer: usize, start: usize, end: usize) -> Result<Tensor> {
        let mut parts = Vec::new();
        if start < self.saved {
            parts.push(self.host_keys(layer, start, end.min(self.saved))?);
        }
        if end > self.saved {
            // The keys alone (a search scoring them wants no copy of the values).
            let k =
                self.tail_keys(layer, end)?.ok_or_else(|| Error::Invalid(format!("no rows past {}", self.saved)))?;
            let from = start.max(self.saved);
            parts.push(k.narrow(1, from - self.saved, end - from)?);
        }
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// The saved keys a host chunk at a time, then the tail's.
    fn for_each_key_chunk(&self, layer: usize, end: usize, f: &mut dyn FnMut(&Tensor) -> Result<()>) -> Result<()> {
        for start in (0..end.min(self.saved)).step_by(SCAN_CHUNK) {
            f(&self.host_keys(layer, start, (start + SCAN_CHUNK).min(end.min(self.saved)))?)?;
        }
        if end > self.saved {
            f(&self.keys(layer, self.saved, end)?)?;
        }
        Ok(())
    }

    /// Exact attention reading the saved rows in chunks (each chunk's partial merged by LSE):
    /// dense decode, and the question's tokens for every method.
    fn dense(&self, query: &Exact<'_>) -> Result<Tensor> {
        let t = query.q.dim(1)?;
        let end = query.q_start + t;
        let mask = Mask { q_offset: query.q_start, window: query.window };
        let first = query.window.map_or(0, |w| (query.q_start + 1).saturating_sub(w));
        let mut acc: Option<AttnOutput> = None;
        let mut add = |part: AttnOutput| -> Result<()> {
            acc = Some(match acc.take() {
                None => part,
                Some(prev) => merge(&prev, &part)?,
            });
            Ok(())
        };
        let saved_end = end.min(self.saved);
        let mut start = first / SCAN_CHUNK * SCAN_CHUNK;
        let resident = self.resident_rows(query.layer);
        if let (Some((k, v)), 1, None, true) = (&resident, t, query.window, saved_end == self.saved) {
            // A decode step over a resident layer: every saved row through the row kernel, which
            // reads the bf16 rows as they are (no f32 working copies), once per KV group.
            let (out, lse) = sparse::decode_attention_rows(&query.q.squeeze(1)?, k, v, self.saved, None, query.scale)?;
            add(AttnOutput { out: out.unsqueeze(1)?, lse: lse.unsqueeze(1)? })?;
            start = saved_end;
        }
        while start < saved_end {
            // Chunks of the device copy when the layer is resident (so the f32 working copies stay
            // one chunk large), else gathered from the host.
            let stop = (start + SCAN_CHUNK).min(saved_end);
            let (k, v) = match &resident {
                Some((k, v)) => (k.narrow(1, start, stop - start)?, v.narrow(1, start, stop - start)?),
                None => self.host_chunk(query.layer, start, stop)?,
            };
            add(attention_block(query.q, &k, &v, start, mask, query.scale)?)?;
            start = stop;
        }
        if let Some((k, v)) = self.tail_rows(query.layer, end)? {
            add(attention_block(query.q, &k, &v, self.saved, mask, query.scale)?)?;
        }
        let out = acc.ok_or_else(|| Error::Invalid(format!("no keys stored for layer {}", query.layer)))?;
        Ok(out.out.to_dtype(query.q.dtype())?)
    }

    /// Copies `layer`'s saved rows to the device (once): dense attention over the layer then
    /// reads device memory, not the link.
    fn keep_resident(&self, layer: usize) -> Result<()> {
        self.copy_resident(layer)
    }

    /// `None` with nothing saved: every row is then the device tail's.
    fn host_rows(&self, layer: usize) -> Option<(&HostRows, &HostRows)> {
        self.host.get(layer).filter(|_| self.saved > 0).map(|(k, v)| (k, v))
    }

    fn file_dir(&self) -> Option<&std::path::Path> {
        self.file_rows.as_deref().map(FileRows::dir)
    }

    /// On the file tier, the keys read into host memory (the values stay in the file).
    fn host_keys(&self, layer: usize) -> Option<&HostRows> {
        match self.host.get(layer) {
            Some((k, _)) => Some(k),
            None => self.host_keys.get(layer),
        }
        .filter(|_| self.saved > 0)
    }
}

/// A context file's mapping as the bytes host rows view, and the host budget's hold on them: on
/// a GPU the whole mapping is page-locked in place; on the CPU the pages a step reads stay
/// resident (dense attention reads them all).
struct Mapped(Arc<ContextFile>, #[allow(dead_code)] Arc<Hold>);

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        self.0.mapped()
    }
}

/// The host budget's hold on each context file read in place, by the file's path and mapped
/// length: a file opened again (a session reopened on new settings while the old one lives)
/// maps the same pages of the page cache, so it is held once; a file replaced at that path (an
/// index stored: a new, longer file) is held anew.
type FileKey = (std::path::PathBuf, usize);
static FILE_HOLDS: std::sync::Mutex<Vec<(FileKey, std::sync::Weak<Hold>)>> = std::sync::Mutex::new(Vec::new());

/// The hold on `file`'s mapping: a live one on the same file, else a new one.
fn file_hold(file: &ContextFile) -> std::result::Result<Arc<Hold>, host_budget::Refused> {
    let path = file.path().canonicalize().unwrap_or_else(|_| file.path().to_owned());
    let key = (path, file.mapped().len());
    let mut all = FILE_HOLDS.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|(_, h)| h.strong_count() > 0);
    if let Some(live) = all.iter().filter(|(k, _)| *k == key).find_map(|(_, h)| h.upgrade()) {
        return Ok(live);
    }
    let what = format!("the K/V of {} (read in place)", file.path().display());
    let hold = Arc::new(host_budget::hold(file.mapped().len() as u64, &what)?);
    all.push((key, Arc::downgrade(&hold)));
    Ok(hold)
}

/// Every live registration of a context file's mapping: one per file, shared by every store
/// over it, since a GPU refuses to register the same pages twice. Entries whose file or
/// registration is gone are dropped on the next look.
static SHARED: std::sync::Mutex<Vec<(std::sync::Weak<ContextFile>, std::sync::Weak<SharedHost>)>> =
    std::sync::Mutex::new(Vec::new());

/// The mapping of `file` shared with `device`'s gathers (on a GPU registered in place,
/// page-locked), the one a live store over this file already holds if there is one. Keeps the
/// file open and mapped while any holder lives.
fn shared_host(file: &Arc<ContextFile>, device: &Device, hold: Arc<Hold>) -> Result<Arc<SharedHost>> {
    let mut all = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|(f, s)| f.strong_count() > 0 && s.strong_count() > 0);
    let live = all
        .iter()
        .filter(|(f, _)| f.upgrade().is_some_and(|f| Arc::ptr_eq(&f, file)))
        .find_map(|(_, s)| s.upgrade().filter(|s| s.registered() == device.is_cuda()));
    if let Some(live) = live {
        return Ok(live);
    }
    let shared = SharedHost::new(device, Arc::new(Mapped(file.clone(), hold))).map_err(|e| Error::Context {
        path: file.path().to_owned(),
        msg: format!("sharing its mapping with the device: {e}"),
    })?;
    all.push((Arc::downgrade(file), Arc::downgrade(&shared)));
    Ok(shared)
}
