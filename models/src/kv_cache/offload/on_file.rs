//! The offloaded store over the file tier: a context's rows left in its file ([`FileRows`]),
//! its keys in host memory when the budget has room for them; and the layout a context file
//! gives its K/V sections, for rows stored without a prefill (the benchmarks and tests).

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use folio_context_file::format::{SectionKind, PAGE};
use folio_context_file::{ContextFile, KvDtype};
use folio_kernels::select::{HostRows, SharedHost, Stored};
use folio_runtime::host_budget::{self, Held};

use super::{OffloadKv, SCAN_CHUNK};
use crate::context::EncodeTensor;
use crate::error::{kv_refused, Error, Result};
use crate::kv_cache::FileRows;

/// The most of the file tier's host memory its keys may take to be read into it (the rest
/// caches value blocks): below a quarter left for values, a step's picks would miss more than
/// the keys in memory save.
pub const KEYS_IN_MEMORY_SHARE: f64 = 0.75;

/// Bytes of one read while the keys are read into memory: 4 MiB, many in flight.
const READ_BYTES: usize = 4 << 20;

impl OffloadKv {
    /// [`Self::stored`]'s rows written to the file at `path` (its sections as [`Self::stored`]
    /// lays them out, no header) and read on the file tier with a cache of `cache_bytes`: the
    /// file tier's benchmark and tests without a prefill.
    pub fn stored_file(
        path: &std::path::Path,
        shape: (usize, usize, usize, usize),
        (kv_dtype, dtype): (KvDtype, DType),
        device: &Device,
        rows: impl FnMut(usize, usize, usize) -> Result<(Tensor, Tensor)>,
        cache_bytes: u64,
    ) -> Result<Self> {
        use folio_context_file::platform::PositionalIo;
        let (offsets, end) = stored_layout(shape, kv_dtype);
        let out = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        out.set_len(end as u64).map_err(|e| Error::io(path, e))?;
        encode_stored(shape, kv_dtype, &offsets, rows, |at, bytes| {
            out.write_all_at(bytes, at as u64).map_err(|e| Error::io(path, e))
        })?;
        out.sync_all().map_err(|e| Error::io(path, e))?;
        let sections = offsets.iter().map(|&at| at as u64).collect();
        Self::over_file(path, sections, (kv_dtype, dtype), shape, cache_bytes, device)
    }

    /// A saved context's rows left in its file, `cache_bytes` of host memory held in the host
    /// budget for them (the file tier: [`Self::over_file`]), every K/V section verified first
    /// by reading the file (not its mapping: the pages would stay resident).
    pub fn on_file(file: Arc<ContextFile>, cache_bytes: u64, dtype: DType, device: &Device) -> Result<Self> {
        let h = file.header();
        let shape = (h.layers, h.kv_heads, h.tokens, h.head_dim);
        let sections = file.kv_sections_read()?.iter().map(|&(at, _)| at as u64).collect();
        let mut kv = Self::over_file(file.path(), sections, (h.kv_dtype, dtype), shape, cache_bytes, device)?;
        // Opened last: if the path named another file by then, what was read may be its.
        if let Some(rows) = &kv.file_rows {
            file.check_same(rows.file())?;
        }
        kv.file = Some(file);
        Ok(kv)
    }

    /// The file tier over the K/V sections at `sections` of the file at `path` with
    /// `cache_bytes` of host memory: every layer's keys read into page-locked host memory when
    /// they take at most [`KEYS_IN_MEMORY_SHARE`] of it (the methods' searches and scans read
    /// them where they lie, as on the host tier), the rest of it a cache of the value blocks a
    /// step picks; else a cache of K and V blocks alike.
    ///
    /// Why keys first: a method scores keys far more than it reads values (HiP's search reads
    /// representatives spread over every block of a layer's keys, then the values of the few
    /// blocks it keeps), and through a cache of blocks each scattered key costs a block's read.
    fn over_file(
        path: &Path,
        sections: Vec<u64>,
        (kv_dtype, dtype): (KvDtype, DType),
        (layers, kv_heads, saved, head_dim): (usize, usize, usize, usize),
        cache_bytes: u64,
        device: &Device,
    ) -> Result<Self> {
        let key_section = kv_dtype.section_bytes(SectionKind::Keys, kv_heads * saved, head_dim);
        let keys_bytes = layers as u64 * key_section.next_multiple_of(PAGE);
        let in_memory = saved > 0 && keys_bytes as f64 <= cache_bytes as f64 * KEYS_IN_MEMORY_SHARE;
        let host_keys = match in_memory {
            true => {
                let at: Vec<u64> = sections.iter().step_by(2).copied().collect();
                let shared = read_sections(path, &at, key_section as usize, device)?;
                let stored = kv_dtype.codec(SectionKind::Keys).stored(kv_heads * saved, head_dim);
                let step = key_section.next_multiple_of(PAGE) as usize;
                (0..layers)
                    .map(|l| Ok(HostRows::view(device, &shared, l * step, stored, (kv_heads, saved, head_dim), dtype)?))
                    .collect::<Result<Vec<_>>>()?
            }
            false => Vec::new(),
        };
        let blocks = if in_memory { cache_bytes - keys_bytes } else { cache_bytes };
        let shape = (kv_heads, saved, head_dim);
        let rows = FileRows::open(path, sections, kv_dtype, shape, (blocks, !in_memory), (dtype, device))?;
        let shape = (layers, kv_heads, saved, head_dim);
        Ok(Self { file_rows: Some(Arc::new(rows)), host_keys, ..Self::empty(shape, dtype, device) })
    }
}

/// Sections of `len` bytes at the offsets `at` of the file at `path`, read as the file tier
/// reads (page cache bypassed, in reads of [`READ_BYTES`] over the cores) into host memory
/// held in the host budget, each from a page boundary, and shared with `device` (registered
/// in place on a GPU).
fn read_sections(path: &Path, at: &[u64], len: usize, device: &Device) -> Result<Arc<SharedHost>> {
    use crate::kv_cache::file::{open_for_reads, read_paced};
    use rayon::prelude::*;
    let step = len.next_multiple_of(PAGE as usize);
    let what = format!("the keys of {} in host memory", path.display());
    let hold = host_budget::hold((step * at.len()) as u64, &what).map_err(kv_refused)?;
    let mut mem = folio_runtime::host_memory::anon_huge(step * at.len()).map_err(|e| Error::io(path, e))?;
    let (file, _) = open_for_reads(path).map_err(|e| Error::io(path, e))?;
    // Disjoint pieces of the memory, each with the file's bytes it gets.
    let mut jobs = Vec::new();
    let mut rest: &mut [u8] = &mut mem;
    for &offset in at {
        let (mut section, after) = rest.split_at_mut(step);
        rest = after;
        let mut done = 0;
        while done < len {
            let n = READ_BYTES.min(step - done);
            let (piece, more) = section.split_at_mut(n);
            section = more;
            jobs.push((piece, offset + done as u64, n.min(len - done)));
            done += n;
        }
    }
    jobs.into_par_iter()
        .try_for_each(|(piece, offset, need)| read_paced(&file, piece, offset, need))
        .map_err(|e| Error::Context { path: path.to_owned(), msg: format!("reading its keys into memory: {e}") })?;
    let mem = mem.make_read_only().map_err(|e| Error::io(path, e))?;
    Ok(SharedHost::new(device, Arc::new(Held::new(mem, hold)))?)
}

/// Where [`OffloadKv::stored`] lays out the K and V sections of `(layers, kv_heads, saved, d)`
/// rows stored as `kv_dtype` (as a context file does, page-aligned), and the bytes in all.
pub(super) fn stored_layout(
    (layers, kv_heads, saved, head_dim): (usize, usize, usize, usize),
    kv_dtype: KvDtype,
) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(2 * layers);
    let mut end = 0usize;
    for _ in 0..layers {
        for kind in [SectionKind::Keys, SectionKind::Values] {
            offsets.push(end);
            end = (end + kv_dtype.section_bytes(kind, kv_heads * saved, head_dim) as usize)
                .next_multiple_of(PAGE as usize);
        }
    }
    (offsets, end)
}

/// Encodes the rows `rows(layer, start, t)` gives ([`OffloadKv::stored`]) a fill chunk at a
/// time, handing each head's piece to `write(byte offset, bytes)` at its place in the layout.
pub(super) fn encode_stored(
    (layers, kv_heads, saved, head_dim): (usize, usize, usize, usize),
    kv_dtype: KvDtype,
    offsets: &[usize],
    mut rows: impl FnMut(usize, usize, usize) -> Result<(Tensor, Tensor)>,
    mut write: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let n = kv_heads * saved;
    for layer in 0..layers {
        for start in (0..saved).step_by(SCAN_CHUNK) {
            let t = SCAN_CHUNK.min(saved - start);
            let (k, v) = rows(layer, start, t)?;
            for (i, (kind, x)) in [SectionKind::Keys, SectionKind::Values].into_iter().zip([k, v]).enumerate() {
                let codec = kv_dtype.codec(kind);
                let (whole, part) = (codec.stored(n, head_dim), codec.stored(t, head_dim));
                let section = offsets[2 * layer + i];
                for head in 0..kv_heads {
                    let bytes = codec.encode_tensor(&x.get(head)?, head_dim)?;
                    let (row_bytes, first) = (whole.row_bytes(head_dim), head * saved + start);
                    write(section + first * row_bytes, &bytes[..t * row_bytes])?;
                    if let (Stored::Fp8 { scales }, Stored::Fp8 { scales: from }) = (whole, part) {
                        write(section + scales + 4 * first, &bytes[from..from + 4 * t])?;
                    }
                }
            }
        }
    }
    Ok(())
}
