//! The KV store of a conversation over a saved context: the context's rows (read-only) and an
//! in-memory tail for everything after them (the question, the answer, follow-up turns).
//!
//! Tiers (docs/architecture.md): the context file, memory-mapped, is the disk tier; a layer's rows are
//! decoded from it into the compute dtype on the model's device the first time attention asks
//! for them, and kept *resident* up to a byte budget (the layers decoded first stay; those past
//! the budget are decoded again on each use, see `prefix_layer`). On a GPU the resident layers are the hot set; the
//! sparse methods of later issues read single rows through the same file instead of whole
//! layers. Writing inside the saved prefix is refused: the file is never rewritten.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use super::tier::{self, TierRef};
use super::{KvSegment, KvStore, SavedTail};
use crate::error::{Error, Result};
use folio_context_file::ContextFile;

/// Where the prefix rows come from.
enum Prefix {
    File(Arc<ContextFile>),
    /// Already-computed K/V per layer (the never-saved path of a fresh in-memory prefill).
    Memory(Vec<(Tensor, Tensor)>),
}

struct Resident {
    layers: Vec<Option<(Tensor, Tensor)>>,
    bytes: u64,
}

pub struct ContextKv {
    prefix: Prefix,
    prefix_len: usize,
    tail: SavedTail,
    resident: Mutex<Resident>,
    budget: u64,
    layer_bytes: u64,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl ContextKv {
    /// A store over `file` for a model computing in `dtype` on `device`, keeping at most
    /// `resident_budget` bytes of decoded layers (at least one layer is always kept).
    pub fn new(file: Arc<ContextFile>, dtype: DType, device: &Device, resident_budget: u64) -> Self {
        let h = file.header();
        let (layers, len, kv_heads, head_dim) = (h.layers, h.tokens, h.kv_heads, h.head_dim);
        Self::with_prefix(Prefix::File(file), layers, len, kv_heads, head_dim, dtype, device, resident_budget)
    }

    /// A store whose prefix is K/V already in memory (`[kv_heads, len, head_dim]` per layer).
    pub fn from_layers(layers: Vec<(Tensor, Tensor)>, dtype: DType, device: &Device) -> Result<Self> {
        let (kv_heads, len, head_dim) =
            layers.first().ok_or_else(|| Error::Invalid("a context needs at least one layer".into()))?.0.dims3()?;
        let n = layers.len();
        Ok(Self::with_prefix(Prefix::Memory(layers), n, len, kv_heads, head_dim, dtype, device, u64::MAX))
    }

    #[allow(clippy::too_many_arguments)]
    fn with_prefix(
        prefix: Prefix,
        layers: usize,
        prefix_len: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
        budget: u64,
    ) -> Self {
        Self {
            prefix,
            prefix_len,
            tail: SavedTail::new(prefix_len, layers, kv_heads, head_dim, dtype, device),
            resident: Mutex::new(Resident { layers: vec![None; layers], bytes: 0 }),
            budget,
            layer_bytes: (2 * kv_heads * prefix_len * head_dim * dtype.size_in_bytes()) as u64,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        }
    }

    /// Tokens of the saved prefix.
    pub fn prefix_len(&self) -> usize {
        self.prefix_len
    }

    /// Bytes of decoded prefix layers currently resident.
    pub fn resident_bytes(&self) -> u64 {
        self.resident.lock().map_or(0, |r| r.bytes)
    }

    fn prefix_layer(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        let file = match &self.prefix {
            Prefix::Memory(layers) => {
                return layers
                    .get(layer)
                    .cloned()
                    .ok_or_else(|| Error::Invalid(format!("no layer {layer} in the context")))
            }
            Prefix::File(file) => file,
        };
        let mut res = self.resident.lock().map_err(|_| Error::Invalid("the KV cache lock was poisoned".into()))?;
        if let Some(kv) = res.layers.get(layer).cloned().flatten() {
            return Ok(kv);
        }
        let (k, v) = file.layer_kv(layer)?;
        let shape = (self.kv_heads, self.prefix_len, self.head_dim);
        // Uploaded as f32 through page-locked staging and cast where it lands: a pageable copy
        // and a single-threaded cast on the host made a 7B model's 128k-token reopen take 41 s.
        let load = |x: Vec<f32>| -> Result<Tensor> {
            let dims = [shape.0, shape.1, shape.2];
            let t = folio_runtime::device::from_host_bytes(bytemuck::cast_slice(&x), DType::F32, &dims, &self.device)?;
            Ok(t.to_dtype(self.dtype)?)
        };
        let kv = (load(k)?, load(v)?);
        // Kept while the budget has room (one layer at least), never evicted: every step reads
        // the layers in order, so a least-recently-used policy with room for k < L layers
        // would miss on every layer; keeping the first k decodes only the other L − k again.
        if res.bytes + self.layer_bytes <= self.budget || res.bytes == 0 {
            res.layers[layer] = Some(kv.clone());
            res.bytes += self.layer_bytes;
        }
        Ok(kv)
    }
}

impl KvStore for ContextKv {
    fn len(&self) -> usize {
        self.tail.len()
    }

    fn saved_len(&self) -> usize {
        self.prefix_len
    }

    fn saved_index(&self, name: &str, layer: usize) -> Result<Option<Vec<u8>>> {
        match &self.prefix {
            Prefix::File(file) => Ok(file.index(name, layer)?.map(<[u8]>::to_vec)),
            Prefix::Memory(_) => Ok(None),
        }
    }

    fn write(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.tail.write(layer, pos, k, v)
    }

    fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>> {
        let (k, v) = self.prefix_layer(layer)?;
        if end <= self.prefix_len {
            return Ok(vec![KvSegment { start: 0, k: k.narrow(1, 0, end)?, v: v.narrow(1, 0, end)? }]);
        }
        let mut segs = vec![KvSegment { start: 0, k, v }];
        segs.extend(self.tail.segments(layer, end)?);
        Ok(segs)
    }

    fn set_len(&mut self, len: usize) -> Result<()> {
        self.tail.set_len(len)
    }

    fn reserve(&mut self, total: usize) -> Result<()> {
        self.tail.reserve(total)
    }

    fn tier(&self) -> Option<TierRef<'_>> {
        Some(tier::Resident::of(self, self.kv_heads, self.head_dim, &self.device))
    }
}
