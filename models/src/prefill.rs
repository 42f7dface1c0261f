//! Layer-major chunked prefill (docs/architecture.md).
//!
//! Token-major prefill (every layer for chunk 1, then every layer for chunk 2, …) must keep
//! every layer's K/V of the whole prompt resident at once; a million tokens of a 7B model is
//! 56 GiB. Layer-major runs *all* tokens through layer 0 in chunks, then all through layer 1,
//! and so on: only one layer's K/V is resident at a time (then it is encoded and written out),
//! and the hidden states between layers live in a [`Hidden`] store. The attention of each chunk is exact
//! causal attention over the layer's keys so far, through the same kernel as decode (query
//! chunks × key blocks, merged by log-sum-exp: never a T×T matrix). Only the last position
//! goes through the LM head.
//!
//! The chunk size is what the memory budget controls: [`plan_chunk`] turns a budget into the
//! largest chunk whose working set (one layer's K/V, the RoPE tables, the chunk's activations,
//! the attention score block, the encode buffer) fits, and refuses budgets below the minimum.
//!
//! Where the hidden states live ([`HiddenStore`]): on the device when both stores fit the
//! budget beside the working set (a 7B model's are 0.9 GiB each at 128k tokens), else in host
//! RAM, else in scratch files. Each trip through a file cost a 7B prefill more than its
//! attention did at 32k–128k tokens (docs/performance.md): every chunk went device → host →
//! file and back. RAM is what a machine that decodes the context offloaded has anyway (the
//! K/V of a million tokens is 28–56 GiB; the hidden states 14 GiB); the files remain for a
//! machine that has not.

use folio_context_file::platform::PositionalIo;
use std::fs::File;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use folio_runtime::device::{copy_to_host, from_host_bytes, to_host_bytes};

use crate::attention::{Attention, Dense, SparseAttention, SparsePrefill};
use crate::error::{Error, Result};
use crate::kv_cache::OffloadKv;
use crate::kv_cache::{DenseKv, KvStore};
use crate::model::Model;
use crate::profile::span;

/// Chunk size without a memory budget: large enough that per-chunk overheads vanish, small
/// enough that activations stay at a few hundred MB for 7B-class shapes.
pub const DEFAULT_CHUNK: usize = 2048;
/// Largest chunk a generous budget buys; beyond this, bigger chunks stop being faster.
const MAX_CHUNK: usize = 8192;
/// Below this many tokens per chunk, prefill would be dominated by per-chunk overhead: a
/// budget that only allows fewer is refused.
const MIN_CHUNK: usize = 16;

/// How a prefill attends: to every earlier key, or sparsely
/// ([`crate::attention::sparse_prefill`]: sinks, the best key blocks of each query block, a
/// window). `--prefill dense | sparse[:KNOBS]`; a context file records it per stretch of tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillMode {
    #[default]
    Dense,
    Sparse(SparsePrefill),
}

impl PrefillMode {
    /// `--prefill sparse`: the sparse prefill at its defaults (the staging sheet's choice).
    pub const SPARSE: Self = Self::Sparse(SparsePrefill::DEFAULT);

    /// `dense`, `sparse`, or `sparse:` and knobs (`sparse:keys=1024,window=512`).
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim().split_once(':').unwrap_or((text.trim(), "")) {
            ("dense", "") => Ok(Self::Dense),
            ("sparse", knobs) => Ok(Self::Sparse(SparsePrefill::parse(knobs)?)),
            _ => Err(Error::Invalid(format!(
                "unknown prefill `{text}`: dense, sparse, or sparse:KNOBS (block, keys, sinks, window; e.g. \
                 sparse:keys=1024)"
            ))),
        }
    }

    /// Refuses a sparse prefill of a model with a sliding window of its own (`name` is the
    /// model's, for the message): the window already bounds what a row reads.
    pub fn check(&self, cfg: &crate::config::ModelConfig, name: &str) -> Result<()> {
        match (self, cfg.sliding_window) {
            (Self::Sparse(_), Some(w)) => Err(Error::Invalid(format!(
                "{name} attends within a sliding window of {w} tokens: a sparse prefill would change nothing it \
                 computes; prefill it densely (--prefill dense)"
            ))),
            _ => Ok(()),
        }
    }

    /// Whether a run of this prefill over `tokens` computed tokens times enough of it to be the
    /// next estimates' cost: a dense run always; a sparse one only where most rows are sparse
    /// (its first `keys_per_row` rows read every earlier key, as dense rows do, and a fit of a
    /// short run would say a 1M-token sparse prefill takes about as long as a dense one).
    pub fn keeps_fit(&self, tokens: usize) -> bool {
        match self {
            Self::Dense => true,
            Self::Sparse(p) => tokens >= SPARSE_FIT_ROWS * p.keys_per_row(),
        }
    }

    /// What the context file records: `dense`, or `sparse:` and every knob.
    pub fn name(&self) -> String {
        match self {
            Self::Dense => folio_context_file::DENSE_PREFILL.into(),
            Self::Sparse(p) => format!("sparse:{}", p.knobs()),
        }
    }
}

/// Computed tokens, in multiples of a sparse row's keys, from which a sparse prefill's fitted
/// cost is kept: three quarters of its rows sparse.
const SPARSE_FIT_ROWS: usize = 4;

/// Hidden states of every token between two layers (`[tokens, hidden]`), read and written
/// one chunk at a time.
pub trait Hidden {
    fn read(&self, start: usize, n: usize) -> Result<Tensor>;
    fn write(&mut self, start: usize, x: &Tensor) -> Result<()>;
}

/// Hidden states in one preallocated tensor (tests, short prompts).
pub struct MemoryHidden(Tensor);

impl MemoryHidden {
    pub fn new(tokens: usize, hidden: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self(Tensor::zeros((tokens, hidden), dtype, device)?))
    }
}

impl Hidden for MemoryHidden {
    fn read(&self, start: usize, n: usize) -> Result<Tensor> {
        Ok(self.0.narrow(0, start, n)?)
    }

    fn write(&mut self, start: usize, x: &Tensor) -> Result<()> {
        Ok(self.0.slice_set(x, 0, start)?)
    }
}

/// Hidden states in a scratch file, read and written with positioned I/O (not mmap, so they
/// never count as the process's resident memory). Writes from position 0 onwards in order
/// (what [`run_layer`] does) are hashed as they go: a checkpoint records the hash instead of
/// waiting for the disk (see `context::build`).
pub struct FileHidden {
    file: File,
    path: PathBuf,
    hidden: usize,
    dtype: DType,
    device: Device,
    /// xxh3 of rows `0..next` as written; `None` after an out-of-order write.
    digest: Option<(xxhash_rust::xxh3::Xxh3, usize)>,
    /// Time spent in file I/O and hashing (not in moving tensors to and from the device).
    io: std::cell::Cell<std::time::Duration>,
}

impl FileHidden {
    pub fn new(file: File, path: &Path, hidden: usize, dtype: DType, device: &Device) -> Self {
        Self {
            file,
            path: path.to_owned(),
            hidden,
            dtype,
            device: device.clone(),
            digest: None,
            io: Default::default(),
        }
    }

    /// Time spent in this store's file I/O and hashing so far.
    pub fn io_time(&self) -> std::time::Duration {
        self.io.get()
    }

    /// xxh3 of the first `rows` rows, when they were written in order since the last write
    /// at row 0 (the format of `folio_context_file::format::checksum`).
    pub fn written_checksum(&self, rows: usize) -> Option<String> {
        let (h, next) = self.digest.as_ref()?;
        (*next == rows).then(|| folio_context_file::format::checksum_hex(h.digest()))
    }

    /// xxh3 of the first `rows` rows as the file holds them now.
    pub fn stored_checksum(&self, rows: usize) -> Result<String> {
        let bytes = (rows * self.hidden * self.dtype.size_in_bytes()) as u64;
        folio_context_file::format::file_checksum(&self.file, 0, bytes).map_err(|e| Error::io(&self.path, e))
    }
}

impl Hidden for FileHidden {
    fn read(&self, start: usize, n: usize) -> Result<Tensor> {
        let row = (self.hidden * self.dtype.size_in_bytes()) as u64;
        let started = std::time::Instant::now();
        let mut bytes = vec![0u8; n * row as usize];
        self.file.read_exact_at(&mut bytes, start as u64 * row).map_err(|e| Error::io(&self.path, e))?;
        self.io.set(self.io.get() + started.elapsed());
        Ok(from_host_bytes(&bytes, self.dtype, &[n, self.hidden], &self.device)?)
    }

    fn write(&mut self, start: usize, x: &Tensor) -> Result<()> {
        let row = (self.hidden * self.dtype.size_in_bytes()) as u64;
        let bytes = tensor_bytes(x)?;
        let started = std::time::Instant::now();
        self.file.write_all_at(&bytes, start as u64 * row).map_err(|e| Error::io(&self.path, e))?;
        if start == 0 {
            self.digest = Some((xxhash_rust::xxh3::Xxh3::new(), 0));
        }
        self.digest = self.digest.take().filter(|(_, next)| *next == start).map(|(mut h, _)| {
            h.update(&bytes);
            (h, start + bytes.len() / row as usize)
        });
        self.io.set(self.io.get() + started.elapsed());
        Ok(())
    }
}

/// Hidden states in host memory, one buffer per chunk as [`run_layer`] writes them (reads and
/// writes are chunk-aligned; a read inside one chunk is a slice of it). Buffers are shared, so
/// a snapshot of a layer's output ([`HiddenStore::snapshot`]) can be written to disk on
/// another thread while the next layers replace them.
pub struct HostHidden {
    chunk: usize,
    hidden: usize,
    dtype: DType,
    device: Device,
    chunks: Vec<Option<std::sync::Arc<Vec<u8>>>>,
}

impl HostHidden {
    pub fn new(tokens: usize, chunk: usize, hidden: usize, dtype: DType, device: &Device) -> Self {
        Self { chunk, hidden, dtype, device: device.clone(), chunks: vec![None; tokens.div_ceil(chunk.max(1))] }
    }

    fn row_bytes(&self) -> usize {
        self.hidden * self.dtype.size_in_bytes()
    }
}

impl Hidden for HostHidden {
    fn read(&self, start: usize, n: usize) -> Result<Tensor> {
        let (c, at) = (start / self.chunk, start % self.chunk);
        let buf = self.chunks.get(c).and_then(|b| b.as_ref());
        let row = self.row_bytes();
        match buf {
            Some(b) if (at + n) * row <= b.len() => {
                Ok(from_host_bytes(&b[at * row..(at + n) * row], self.dtype, &[n, self.hidden], &self.device)?)
            }
            _ => Err(Error::Invalid(format!(
                "hidden rows {start}..{} were read before they were written, or across chunks of {}",
                start + n,
                self.chunk
            ))),
        }
    }

    fn write(&mut self, start: usize, x: &Tensor) -> Result<()> {
        if !start.is_multiple_of(self.chunk) || x.dim(0)? > self.chunk {
            return Err(Error::Invalid(format!("hidden rows written at {start}, not a chunk of {}", self.chunk)));
        }
        let slot = self
            .chunks
            .get_mut(start / self.chunk)
            .ok_or_else(|| Error::Invalid(format!("hidden rows written at {start}, past the prompt")))?;
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        // The chunk's buffer from the layer before last is reused in place unless a checkpoint
        // still holds it (a fresh one costs a page fault per 4 KiB: more than the copy).
        match slot.as_mut().and_then(std::sync::Arc::get_mut).filter(|b| b.len() == bytes) {
            Some(buf) => copy_to_host(x, buf)?,
            None => *slot = Some(std::sync::Arc::new(tensor_bytes(x)?)),
        }
        Ok(())
    }
}

/// A layer's output hidden states copied off the device (or shared with a [`HostHidden`]), in
/// row order: what a checkpoint writes to disk.
pub struct HiddenSnapshot(Vec<std::sync::Arc<Vec<u8>>>);

impl HiddenSnapshot {
    /// Writes the rows to `file` from offset 0, returning their checksum (the format of
    /// `folio_context_file::format::checksum`).
    pub fn write_to(&self, file: &File) -> std::io::Result<String> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut at = 0u64;
        for piece in &self.0 {
            file.write_all_at(piece, at)?;
            h.update(piece);
            at += piece.len() as u64;
        }
        Ok(folio_context_file::format::checksum_hex(h.digest()))
    }
}

/// Where a prefill keeps the hidden states between layers (module docs: why three places).
pub enum HiddenStore {
    Device(MemoryHidden),
    Host(HostHidden),
    File(Box<FileHidden>),
}

impl HiddenStore {
    /// The first `rows` rows as host bytes for a checkpoint, or `None` for a file store (its
    /// file is already the checkpoint's).
    pub fn snapshot(&self, rows: usize) -> Result<Option<HiddenSnapshot>> {
        match self {
            Self::Device(m) => {
                Ok(Some(HiddenSnapshot(vec![std::sync::Arc::new(tensor_bytes(&m.0.narrow(0, 0, rows)?)?)])))
            }
            Self::Host(h) => {
                let pieces = h.chunks.iter().take(rows.div_ceil(h.chunk)).cloned().collect::<Option<Vec<_>>>();
                pieces.map(|p| Some(HiddenSnapshot(p))).ok_or_else(|| {
                    Error::Invalid(format!("a snapshot of {rows} hidden rows before they were all written"))
                })
            }
            Self::File(_) => Ok(None),
        }
    }

    /// Fills the first `rows` rows from `file` (a checkpoint's hidden states), chunk by chunk:
    /// into RAM as read, onto the device through staging.
    pub fn load(&mut self, file: &File, path: &Path, rows: usize, chunk: usize) -> Result<()> {
        let (hidden, dtype, device) = match self {
            Self::Device(m) => (m.0.dim(1)?, m.0.dtype(), m.0.device().clone()),
            Self::Host(h) => (h.hidden, h.dtype, h.device.clone()),
            Self::File(_) => return Ok(()),
        };
        let row = hidden * dtype.size_in_bytes();
        let mut start = 0;
        while start < rows {
            let n = chunk.min(rows - start);
            let mut bytes = vec![0u8; n * row];
            file.read_exact_at(&mut bytes, (start * row) as u64).map_err(|e| Error::io(path, e))?;
            match self {
                Self::Host(h) if start % h.chunk == 0 && n <= h.chunk => {
                    h.chunks[start / h.chunk] = Some(std::sync::Arc::new(bytes));
                }
                _ => self.write(start, &from_host_bytes(&bytes, dtype, &[n, hidden], &device)?)?,
            }
            start += n;
        }
        Ok(())
    }

    /// xxh3 of the first `rows` rows as written in order (file stores only: see
    /// [`FileHidden::written_checksum`]).
    pub fn written_checksum(&self, rows: usize) -> Option<String> {
        match self {
            Self::File(f) => f.written_checksum(rows),
            _ => None,
        }
    }

    /// Time spent in file I/O (file stores only).
    pub fn io_time(&self) -> std::time::Duration {
        match self {
            Self::File(f) => f.io_time(),
            _ => Default::default(),
        }
    }
}

impl Hidden for HiddenStore {
    fn read(&self, start: usize, n: usize) -> Result<Tensor> {
        match self {
            Self::Device(m) => m.read(start, n),
            Self::Host(h) => h.read(start, n),
            Self::File(f) => f.read(start, n),
        }
    }

    fn write(&mut self, start: usize, x: &Tensor) -> Result<()> {
        match self {
            Self::Device(m) => m.write(start, x),
            Self::Host(h) => h.write(start, x),
            Self::File(f) => f.write(start, x),
        }
    }
}

/// Raw bytes of a tensor in its own dtype (little-endian: the only byte order Folio builds for).
fn tensor_bytes(x: &Tensor) -> Result<Vec<u8>> {
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::Invalid(format!("hidden states in {:?} are not supported", x.dtype())));
    }
    Ok(to_host_bytes(x)?)
}

/// The RoPE cos/sin tables of every chunk of a layer-major prefill, made once and used by
/// every layer (chunk `c` of each layer sits at the same positions). Made on the CPU in
/// parallel and moved to the device: making them per chunk and layer cost a 7B prefill 11% of
/// its time at 128k tokens (docs/performance.md). `head_dim` values a token, counted in the
/// working set ([`plan_chunk`]).
pub struct RopeTables {
    chunk: usize,
    tables: Vec<(Tensor, Tensor)>,
}

impl RopeTables {
    /// Tables for `tokens` positions from `first`, in chunks of `chunk`.
    pub fn new(model: &Model, first: usize, tokens: usize, chunk: usize) -> Result<Self> {
        use rayon::prelude::*;
        let chunk = chunk.max(1);
        let starts: Vec<usize> = (0..tokens).step_by(chunk).collect();
        let on_cpu = starts
            .par_iter()
            .map(|&s| model.rope_on(first + s, chunk.min(tokens - s), &Device::Cpu))
            .collect::<Result<Vec<_>>>()?;
        let device = model.device();
        let moved =
            |t: &Tensor| -> Result<Tensor> { Ok(from_host_bytes(&to_host_bytes(t)?, t.dtype(), t.dims(), device)?) };
        let tables = on_cpu.iter().map(|(c, s)| Ok((moved(c)?, moved(s)?))).collect::<Result<_>>()?;
        Ok(Self { chunk, tables })
    }

    /// Tokens per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    fn table(&self, i: usize) -> Result<&(Tensor, Tensor)> {
        self.tables.get(i).ok_or_else(|| Error::Invalid(format!("no RoPE table for chunk {i}")))
    }
}

/// How a prefill is chunked, and the working set that implies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ChunkPlan {
    pub chunk: usize,
    /// Estimate of the prefill's memory beyond the model weights, in bytes (an upper bound
    /// until the K/V copies overlapped the next layer: docs/performance.md records peaks
    /// 0.8–1.3 GB above it since, cause not yet found).
    pub working_set: u64,
}

/// The largest chunk whose working set fits `budget` (or [`DEFAULT_CHUNK`] without one) for a
/// prefill of `tokens` tokens whose larger K/V section is `section_bytes` once encoded (a
/// layer's two sections are held while the next layer runs).
pub fn plan_chunk(
    model: &Model,
    tokens: usize,
    (section_bytes, mode): (u64, PrefillMode),
    budget: Option<u64>,
) -> Result<ChunkPlan> {
    let (fixed, per_token) = working_set_terms(model, tokens, section_bytes, mode);
    let most = tokens.clamp(1, MAX_CHUNK);
    let chunk = match budget {
        None => DEFAULT_CHUNK.min(most),
        Some(b) => {
            let fit = (b.saturating_sub(fixed) / per_token) as usize;
            if fit < MIN_CHUNK.min(most) {
                return Err(Error::MemoryBudget {
                    budget: b,
                    needed: fixed + MIN_CHUNK.min(most) as u64 * per_token,
                    tokens,
                });
            }
            fit.min(most)
        }
    };
    // A sparse prefill's chunks end on whole query blocks where they can: a block cut by a
    // chunk's edge is estimated from part of its rows, so the result would depend on the budget.
    let chunk = match mode {
        PrefillMode::Sparse(p) if chunk >= p.block => chunk / p.block * p.block,
        _ => chunk,
    };
    Ok(ChunkPlan { chunk, working_set: fixed + chunk as u64 * per_token })
}

/// The working set of a prefill that runs in chunks of `chunk` tokens (a resumed one keeps
/// the chunk it started with).
pub fn chunk_working_set(model: &Model, tokens: usize, (section_bytes, mode): (u64, PrefillMode), chunk: usize) -> u64 {
    let (fixed, per_token) = working_set_terms(model, tokens, section_bytes, mode);
    fixed + chunk as u64 * per_token
}

/// The working set's bytes independent of the chunk, and its bytes per token of a chunk.
fn working_set_terms(model: &Model, tokens: usize, section_bytes: u64, mode: PrefillMode) -> (u64, u64) {
    let cfg = model.config();
    let dsize = model.dtype().size_in_bytes() as u64;
    let kv_values = (tokens * cfg.num_kv_heads * cfg.head_dim) as u64;
    let (nq, nkv) = ((cfg.num_heads * cfg.head_dim) as u64, (cfg.num_kv_heads * cfg.head_dim) as u64);
    // One layer's K and V; the RoPE tables of every position (`RopeTables`); the layer
    // before's two sections on their way out while this one runs: on a GPU their encoded bytes
    // (encoded there and copied beside the next layer, `Codec::start_encode`), elsewhere an f32
    // copy and the encoded bytes. The fused kernel reads the keys so far in place; without it,
    // the f32 copy of K and V when computing in 16 bits, and the scores.
    let mut fixed = 2 * kv_values * dsize + (tokens * cfg.head_dim) as u64 * dsize + 2 * section_bytes;
    // Encoded without an f32 copy: a bf16 model's K/V on a GPU into a bf16, fp8 or bf16-fp8
    // file (an f32 file is the only one whose sections are 4 bytes a value).
    let in_place = model.device().is_cuda() && model.dtype() == DType::BF16 && section_bytes < kv_values * 4;
    if !in_place {
        fixed += kv_values * 4;
    }
    if !folio_kernels::attention::fused(model.device(), model.dtype(), cfg.head_dim) {
        if dsize != 4 {
            fixed += 2 * kv_values * 4;
        }
        fixed += 3 * 4 * folio_kernels::attention::max_score_elems(model.device()) as u64;
    }
    // A sparse prefill's staged batch and its key blocks' means (f32), at the largest chunk
    // (no larger than the context).
    if let PrefillMode::Sparse(p) = mode {
        let shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        fixed += p.staged_bytes(shape, tokens, MAX_CHUNK.min(tokens), model.dtype());
    }
    // Per token of a chunk: hidden in/out and norms, q/k/v (+ f32 q), MLP intermediates.
    let per_token =
        dsize * (6 * cfg.hidden_size as u64 + 3 * (nq + 2 * nkv) + 4 * cfg.intermediate_size as u64) + 4 * nq;
    (fixed, per_token)
}

/// Runs every token through decoder layer `layer`, a chunk at a time (`rope`'s). The two hidden
/// stores alternate: layer `l` reads the token embeddings (layer 0) or `hidden[(l + 1) % 2]`
/// (what layer `l - 1` wrote) and writes `hidden[l % 2]` ([`layer_output`]). Returns the
/// layer's K and V, `[kv_heads, tokens, head_dim]`. `progress` gets the tokens done so far
/// after each chunk and may cancel (between chunks).
///
/// With `prefix`, the layer's K and V of tokens that came before (`[kv_heads, p, head_dim]`,
/// from a saved context), `tokens` are the ones after them: they sit at positions `p..`,
/// attend to the prefix as well, and the K and V returned cover prefix and tokens. The hidden
/// stores hold only `tokens` (row 0 is position `p`). Attention is causal, so the prefix's K/V
/// is what a prefill of everything would have computed for it: growing a context computes
/// only the new tokens.
pub fn run_layer<H: Hidden>(
    model: &Model,
    layer: usize,
    tokens: &[u32],
    prefix: Option<&(Tensor, Tensor)>,
    hidden: &mut [H; 2],
    (rope, mode): (&RopeTables, PrefillMode),
    progress: &mut dyn FnMut(usize) -> ControlFlow<()>,
) -> Result<(Tensor, Tensor)> {
    let chunk = rope.chunk();
    // A sparse prefill's attention keeps the layer's key-block means across its chunks.
    let sparse = match mode {
        PrefillMode::Dense => None,
        PrefillMode::Sparse(pattern) => Some(SparseAttention::new(pattern)),
    };
    let attn: &dyn Attention = match &sparse {
        Some(s) => s,
        None => &Dense,
    };
    let cfg = model.config();
    let t = tokens.len();
    let mut kv = DenseKv::new(1, cfg.num_kv_heads, cfg.head_dim, model.dtype(), model.device());
    let offset = match prefix {
        Some((k, v)) => {
            let p = k.dim(1)?;
            kv.reserve(p + t)?;
            kv.write(0, 0, k, v)?;
            kv.set_len(p)?;
            p
        }
        None => {
            kv.reserve(t)?;
            0
        }
    };
    let [even, odd] = hidden;
    let (input, output) = if layer.is_multiple_of(2) { (&*odd, even) } else { (&*even, odd) };
    let mut start = 0;
    while start < t {
        let n = chunk.min(t - start);
        let dev = model.device();
        let x = span(dev, "hidden states in", || {
            if layer == 0 {
                model.embed(&tokens[start..start + n])
            } else {
                input.read(start, n)
            }
        })?;
        let y = model.layer_forward(layer, &x, offset + start, rope.table(start / chunk)?, &mut kv, 0, attn)?;
        kv.set_len(offset + start + n)?;
        span(dev, "hidden states out", || output.write(start, &y))?;
        start += n;
        if progress(start).is_break() {
            return Err(Error::Cancelled(format!("prefill cancelled in layer {layer}")));
        }
    }
    let seg = kv.segments(0, offset + t)?.remove(0);
    Ok((seg.k, seg.v))
}

/// The store [`run_layer`] wrote layer `layer`'s output to.
pub fn layer_output<H>(hidden: &[H; 2], layer: usize) -> &H {
    &hidden[layer % 2]
}

/// The whole layer-major prefill in memory: every layer's K/V and the last position's logits.
/// What [`crate::context::build`] computes, without files: the "never saved" path tests hold
/// the saved one to.
#[allow(clippy::type_complexity)]
pub fn prefill_in_memory(model: &Model, tokens: &[u32], chunk: usize) -> Result<(Vec<(Tensor, Tensor)>, Tensor)> {
    let mut layers = Vec::with_capacity(model.config().num_layers);
    let logits = prefill_layers(model, tokens, (chunk, PrefillMode::Dense), |_, k, v| {
        layers.push((k, v));
        Ok(())
    })?;
    Ok((layers, logits))
}

/// `tokens` prefilled layer-major on the model's device as an offloaded store's saved prefix,
/// each layer's rows moved to host memory as soon as it is done: a context file's store without
/// the file (the needle eval's offloaded tier). The device holds one layer's K/V at a time.
pub fn prefill_offloaded(model: &Model, tokens: &[u32], chunk: usize, mode: PrefillMode) -> Result<OffloadKv> {
    let cfg = model.config();
    let mut kv =
        OffloadKv::new(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tokens.len(), model.dtype(), model.device())?;
    prefill_layers(model, tokens, (chunk, mode), |layer, k, v| kv.fill(layer, 0, &k, &v))?;
    Ok(kv)
}

/// The layer-major prefill with hidden states in memory, handing each layer's K and V
/// (`[kv_heads, tokens, head_dim]`) to `on_layer` as soon as it is done, so the caller decides
/// whether the layers pile up on the device; returns the last position's logits.
pub fn prefill_layers(
    model: &Model,
    tokens: &[u32],
    (chunk, mode): (usize, PrefillMode),
    mut on_layer: impl FnMut(usize, Tensor, Tensor) -> Result<()>,
) -> Result<Tensor> {
    let cfg = model.config();
    if tokens.is_empty() {
        return Err(Error::Invalid("nothing to prefill: no tokens".into()));
    }
    cfg.check_fits(tokens.len())?;
    let new = || MemoryHidden::new(tokens.len(), cfg.hidden_size, model.dtype(), model.device());
    let mut hidden = [new()?, new()?];
    let rope = RopeTables::new(model, 0, tokens.len(), chunk)?;
    for layer in 0..cfg.num_layers {
        let (k, v) =
            run_layer(model, layer, tokens, None, &mut hidden, (&rope, mode), &mut |_| ControlFlow::Continue(()))?;
        on_layer(layer, k, v)?;
    }
    let last = layer_output(&hidden, cfg.num_layers - 1).read(tokens.len() - 1, 1)?;
    model.head(&last)
}
