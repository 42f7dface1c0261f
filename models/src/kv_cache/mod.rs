//! The KV store seam: where the decoder writes post-RoPE keys and values and where attention
//! methods read them.
//!
//! Layout: per layer, `[kv_heads, capacity, head_dim]`, so one token's row for
//! one head is contiguous and a sparse gather reads whole rows. Storage is preallocated and
//! written in place (`slice_set`); it grows by doubling when a conversation outgrows it, never
//! by concatenating per step. The tiered store over a saved context file
//! ([`crate::kv_cache::ContextKv`]) implements the same trait.
//!
//! A store hands out its rows as *segments* (runs of consecutive positions that live in one
//! place: a saved prefix, an in-memory tail) rather than one tensor: attention runs on each and
//! merges the partials by log-sum-exp, so a million-token prefix is never copied to append a
//! question to it.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
mod context;
mod file;
mod offload;
mod tier;

pub use context::ContextKv;
pub(crate) use file::Spill;
pub use file::{
    block_read_rate, least_bytes, open_for_reads, read_paced, spill_reads, FileRows, FileStats, BLOCK_ROWS,
    FILE_CACHE_MIN,
};
pub use offload::{file_tier_bytes, OffloadKv, FILE_CACHE_SHARE, KEYS_IN_MEMORY_SHARE};
pub use tier::{dense_over_segments, DecodeTier, Exact, PositionsLater, ReadAhead, Resident, TierRef};

/// Rows of positions `start..start + len` of one layer: K and V `[kv_heads, len, head_dim]`.
#[derive(Debug, Clone)]
pub struct KvSegment {
    pub start: usize,
    pub k: Tensor,
    pub v: Tensor,
}

/// Storage of the per-layer K/V rows of one sequence.
pub trait KvStore: Send {
    /// Tokens stored (identical for every layer between forward passes).
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes `k`, `v` (`[kv_heads, t, head_dim]`, post-RoPE) for positions `pos..pos + t` of
    /// `layer`. Positions must continue the stored sequence (`pos <= len`); writing at
    /// `pos < len` overwrites (a regenerated tail).
    fn write(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()>;

    /// K and V of `layer` for positions `0..end`, as consecutive segments in position order.
    fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>>;

    /// Sets the stored length after a forward pass wrote every layer up to `len`.
    fn set_len(&mut self, len: usize) -> Result<()>;

    /// Makes room for `total` tokens at once, so a known-length prefill or generation does not
    /// grow the store step by step.
    fn reserve(&mut self, total: usize) -> Result<()>;

    /// Positions `0..saved_len()` are a saved, read-only prefix (a context file): attention
    /// indexes cover exactly it, so they can be stored with it. 0 when nothing is saved.
    fn saved_len(&self) -> usize {
        0
    }

    /// A stored index section of the saved prefix (`name` says which method and settings),
    /// checksum-verified; `None` when the store has none of that name.
    fn saved_index(&self, _name: &str, _layer: usize) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    /// The decode tier the methods' fast paths run on ([`DecodeTier`]); `None` runs their CPU
    /// references.
    fn tier(&self) -> Option<TierRef<'_>> {
        None
    }
}

/// A store whose methods run their CPU references: `store` with its tier hidden. The
/// references are what the fast paths are held to in the tests.
pub struct Reference<S>(pub S);

impl<S: KvStore> KvStore for Reference<S> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn write(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.0.write(layer, pos, k, v)
    }

    fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>> {
        self.0.segments(layer, end)
    }

    fn set_len(&mut self, len: usize) -> Result<()> {
        self.0.set_len(len)
    }

    fn reserve(&mut self, total: usize) -> Result<()> {
        self.0.reserve(total)
    }

    fn saved_len(&self) -> usize {
        self.0.saved_len()
    }

    fn saved_index(&self, name: &str, layer: usize) -> Result<Option<Vec<u8>>> {
        self.0.saved_index(name, layer)
    }
}

/// Dense store on one device: every row of every layer resident.
pub struct DenseKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Highest position written per layer, to check the write/set_len protocol.
    written: Vec<usize>,
    len: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

/// Smallest allocation, so that short chats do not reallocate on their first tokens.
const MIN_CAPACITY: usize = 256;

impl DenseKv {
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Self {
        Self {
            k: Vec::new(),
            v: Vec::new(),
            written: vec![0; layers],
            len: 0,
            capacity: 0,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        }
        .with_layers(layers)
    }

    fn with_layers(mut self, layers: usize) -> Self {
        self.k = Vec::with_capacity(layers);
        self.v = Vec::with_capacity(layers);
        self
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn grow(&mut self, total: usize) -> Result<()> {
        if total <= self.capacity && self.k.len() == self.written.len() {
            return Ok(());
        }
        let capacity = total.max(MIN_CAPACITY).max(self.capacity * 2);
        let shape = (self.kv_heads, capacity, self.head_dim);
        let mut k = Vec::with_capacity(self.written.len());
        let mut v = Vec::with_capacity(self.written.len());
        for layer in 0..self.written.len() {
            let nk = Tensor::zeros(shape, self.dtype, &self.device)?;
            let nv = Tensor::zeros(shape, self.dtype, &self.device)?;
            let keep = self.written[layer];
            if keep > 0 {
                nk.slice_set(&self.k[layer].narrow(1, 0, keep)?.contiguous()?, 1, 0)?;
                nv.slice_set(&self.v[layer].narrow(1, 0, keep)?.contiguous()?, 1, 0)?;
            }
            k.push(nk);
            v.push(nv);
        }
        self.k = k;
        self.v = v;
        self.capacity = capacity;
        Ok(())
    }
}

impl KvStore for DenseKv {
    fn len(&self) -> usize {
        self.len
    }

    fn write(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (h, t, d) = k.dims3()?;
        if (h, d) != (self.kv_heads, self.head_dim) || v.dims3()? != (h, t, d) {
            return Err(Error::Invalid(format!(
                "kv write: expected [{}, t, {}], got k {:?} v {:?}",
                self.kv_heads,
                self.head_dim,
                k.dims(),
                v.dims()
            )));
        }
        if layer >= self.written.len() || pos > self.len {
            return Err(Error::Invalid(format!("kv write at layer {layer}, position {pos} past the end {}", self.len)));
        }
        self.grow(pos + t)?;
        self.k[layer].slice_set(&k.to_dtype(self.dtype)?.contiguous()?, 1, pos)?;
        self.v[layer].slice_set(&v.to_dtype(self.dtype)?.contiguous()?, 1, pos)?;
        self.written[layer] = pos + t;
        Ok(())
    }

    fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>> {
        if layer >= self.k.len() || end > self.written[layer] {
            return Err(Error::Invalid(format!("kv read of {end} rows at layer {layer}: not written")));
        }
        Ok(vec![KvSegment { start: 0, k: self.k[layer].narrow(1, 0, end)?, v: self.v[layer].narrow(1, 0, end)? }])
    }

    fn set_len(&mut self, len: usize) -> Result<()> {
        if self.written.iter().any(|&w| w < len) {
            return Err(Error::Invalid(format!("kv length {len} set before every layer was written")));
        }
        self.len = len;
        self.written.iter_mut().for_each(|w| *w = len);
        Ok(())
    }

    fn reserve(&mut self, total: usize) -> Result<()> {
        self.grow(total)
    }

    fn tier(&self) -> Option<TierRef<'_>> {
        Some(Resident::of(self, self.kv_heads, self.head_dim, &self.device))
    }
}

/// What follows a saved, read-only prefix of `saved` tokens (the question, the answer,
/// follow-up turns): positions `saved..` in a device [`DenseKv`]. The stores over a saved
/// context (resident or offloaded) keep theirs here and differ only in where the prefix lives.
pub(crate) struct SavedTail {
    saved: usize,
    rows: DenseKv,
}

impl SavedTail {
    pub fn new(saved: usize, layers: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Self {
        Self { saved, rows: DenseKv::new(layers, kv_heads, head_dim, dtype, device) }
    }

    /// Tokens stored, prefix included.
    pub fn len(&self) -> usize {
        self.saved + self.rows.len()
    }

    pub fn write(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        if pos < self.saved {
            return Err(Error::Invalid(format!(
                "position {pos} is inside the saved context ({} tokens), which is read-only",
                self.saved
            )));
        }
        self.rows.write(layer, pos - self.saved, k, v)
    }

    /// The tail's segments of `layer` up to absolute position `end`, at their absolute
    /// positions (none when `end` is inside the prefix).
    pub fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>> {
        if end <= self.saved {
            return Ok(Vec::new());
        }
        let segs = self.rows.segments(layer, end - self.saved)?;
        Ok(segs.into_iter().map(|s| KvSegment { start: s.start + self.saved, ..s }).collect())
    }

    pub fn set_len(&mut self, len: usize) -> Result<()> {
        self.rows.set_len(len.checked_sub(self.saved).ok_or_else(|| {
            Error::Invalid(format!("length {len} is shorter than the saved context ({})", self.saved))
        })?)
    }

    pub fn reserve(&mut self, total: usize) -> Result<()> {
        self.rows.reserve(total.saturating_sub(self.saved))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_in_place_and_grows() -> Result<()> {
        let dev = Device::Cpu;
        let mut kv = DenseKv::new(2, 2, 4, DType::F32, &dev);
        let rows = |t: usize, base: f32| {
            Tensor::arange(0f32, (2 * t * 4) as f32, &dev).unwrap().affine(1.0, base as f64).unwrap().reshape((2, t, 4))
        };
        for layer in 0..2 {
            kv.write(layer, 0, &rows(3, 0.0)?, &rows(3, 100.0)?)?;
        }
        kv.set_len(3)?;
        let cap = kv.capacity();
        // Grow past the first allocation: earlier rows must survive the move.
        let big = cap + 5;
        for layer in 0..2 {
            kv.write(layer, 3, &rows(big - 3, 1000.0)?, &rows(big - 3, 2000.0)?)?;
        }
        kv.set_len(big)?;
        assert!(kv.capacity() >= big);
        let seg = kv.segments(1, big)?.remove(0);
        let (k, v) = (seg.k, seg.v);
        assert_eq!(k.dims(), &[2, big, 4]);
        assert_eq!(k.narrow(1, 0, 3)?.flatten_all()?.to_vec1::<f32>()?, rows(3, 0.0)?.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(v.narrow(1, 3, 1)?.flatten_all()?.to_vec1::<f32>()?[0], 2000.0);
        assert!(kv.segments(0, big + 1).is_err());
        assert!(kv.write(0, big + 2, &rows(1, 0.0)?, &rows(1, 0.0)?).is_err(), "gaps are refused");
        Ok(())
    }
}
