//! The context file as the K/V's lowest tier: when the host budget cannot hold a context's rows,
//! they stay on disk and a step reads the blocks of rows it picks, through a cache of the
//! blocks it keeps picking, in the file's compact dtype.
//!
//! Why: a million tokens of a 7B model are 28 GiB of fp8 K/V and 56 GiB of bf16, more than a
//! 32 GiB laptop can hold beside the OS, the app and the model's embedding table; but a sparse
//! step reads a few thousand rows a head, mostly the rows the step before read (a window that
//! moves by one, a search's leaves that change little between refreshes), so a cache of row
//! blocks far smaller than the file serves nearly every row and the disk serves the rest.
//!
//! How: a block is [`BLOCK_ROWS`] consecutive positions of one head of one K or V section: for
//! fp8 rows of 128 values, 4 KiB, the page a disk reads anyway. The fp8 rows' scales (4 bytes a
//! row, apart from the codes in the section) are read into memory when the tier opens, so that
//! a block is one read, not two. A gather maps its positions to blocks, takes each from the
//! cache ([`cache::BlockCache`]) or a slot to fill, reads the misses in file order — runs of
//! consecutive blocks coalesced into one read, runs read in parallel by [`io::IO_THREADS`] threads
//! (an NVMe serves its rate only with dozens of reads in flight; a thread waiting on the disk
//! takes no core), with the page cache bypassed so that the host budget sees every byte held
//! and the benchmarks the disk's own rate — and widens the rows it was asked for. A scan (dense
//! attention, an index build) passes through without caching: a pass over the whole file would
//! evict every block the steps keep. Where another disk is emulated
//! ([`folio_runtime::disk`]), the file is read through the page cache and each read held to
//! that disk's pace.
//!
//! Rows past the saved prefix (the conversation's) are the offloaded tier's device tail, as
//! on the host tier ([`gather`] merges them).

mod cache;
mod io;
mod layout;
mod read;
mod spill;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};
use folio_context_file::rows::{fp8_row_values, stored_row, Stored};
use folio_context_file::KvDtype;
use folio_kernels::select::HostRows;
use folio_kernels::Positions;
use folio_runtime::disk;
use folio_runtime::host_budget::{self, Hold};
use rayon::prelude::*;

use crate::error::{human_bytes, kv_refused, Error, Result};
use crate::profile::span;
use cache::{BlockCache, Found};
pub use io::{block_read_rate, open_for_reads, read_paced};
use layout::Layout;
pub use layout::{least_bytes, FILE_CACHE_MIN};
use read::Miss;
pub use spill::{spill_reads, Spill};

/// Rows of one head in a block: 4 KiB of fp8 rows (8 KiB of bf16) at 128 values a row — a disk
/// reads no less than a 4 KiB page, and a larger block reads rows no one picked (at 256 rows,
/// HiP's 64-row leaves read 4× their bytes and missed the cache more, a block holding rows
/// the next search did not keep).
pub const BLOCK_ROWS: usize = 32;

/// KV heads a block's key has room for.
const MAX_HEADS: usize = 0xff;

/// What the tier has done since it opened (a step's figures are the difference of two readings).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct FileStats {
    /// Bytes of host memory the tier holds: its block cache, the fp8 rows' scales, its records.
    pub cache_bytes: u64,
    /// Blocks the cache holds, and the bytes of scales read into memory.
    pub slots: u64,
    pub scales_in_memory: u64,
    /// Bytes of the keys read into host memory (then the cache holds value blocks only).
    pub keys_in_memory: u64,
    /// Whether reads bypass the page cache (else a disk is emulated, whose medium is the page
    /// cache, or the file system refused it: the rate may be the page cache's).
    pub direct: bool,
    /// Gathers, and those the device read from the cache (a step's picks that all had a slot;
    /// the others were widened by the CPU).
    pub gathers: u64,
    pub device_gathers: u64,
    /// Blocks asked for (once per gather), and those the cache held.
    pub blocks: u64,
    pub hits: u64,
    /// Blocks read from the file that were asked for, the reads they took and their bytes
    /// (alignment and the blocks of gaps a read spans included).
    pub blocks_read: u64,
    pub reads: u64,
    pub bytes_read: u64,
    /// Seconds the gathers spent reading the file.
    pub read_seconds: f64,
    /// Blocks read ahead of the gathers that ask for them and placed in the cache, and the
    /// seconds spent reading them (while the device worked; their reads and bytes are among
    /// the above).
    pub blocks_ahead: u64,
    pub ahead_seconds: f64,
    /// Read-aheads done; seconds from a read-ahead being asked for to its positions in hand (the search it
    /// waits for), and from then to its blocks placed (a place among the read-aheads running,
    /// the sort, the lock, the disk, the placing: [`Self::ahead_seconds`]'s reads are a part).
    pub read_aheads: u64,
    pub ahead_start_seconds: f64,
    pub ahead_wall_seconds: f64,
    /// The process's reads so far that took longer than the emulated disk would have
    /// ([`folio_runtime::disk::late_reads`]; 0 when none is emulated).
    pub late_reads: u64,
    /// Reads and bytes (alignment included) of the methods' state on disk beside the file, the
    /// process's so far ([`Spill`]: MagicPIG's bucket lists).
    pub spill_reads: u64,
    pub spill_bytes: u64,
    /// Distinct blocks the steps' picks used, and those the previous step that read their
    /// section (layer, K or V) had used too.
    pub step_blocks: u64,
    pub step_again: u64,
}

/// The saved rows of a context laid out as a context file lays them out, read from disk; see the
/// module docs.
pub struct FileRows {
    path: PathBuf,
    file: File,
    /// Byte offset of each K/V section in the file: K then V of layer 0, then layer 1, …
    sections: Vec<u64>,
    /// How K and V sections store their rows.
    stored: [Stored; 2],
    heads: usize,
    n: usize,
    d: usize,
    /// Whether key sections are read here (else the keys are in host memory beside the tier).
    keys: bool,
    /// Each section's fp8 row scales (`heads · n`; empty for sections without scales or not
    /// read here), and the host budget's hold on them and the step stamps.
    scales: Vec<Vec<f32>>,
    _hold: Hold,
    /// The cache's slots as K (0) and V (1) rows the device gathers from (a kind not read
    /// here has none), and that device.
    views: [Option<HostRows>; 2],
    device: Device,
    state: Mutex<State>,
    /// The read-aheads running.
    ahead: read::Aheads,
}

struct State {
    cache: BlockCache,
    /// Gathers and steps so far (a gather's slots are not evicted by itself).
    gathers: u64,
    step: u32,
    /// The step that last picked each block of the file (`NEVER`: none), and per section the
    /// last step that picked in it and the one before: how much of a step's picks the
    /// section's previous picks had too, whatever the cache kept.
    picked: Vec<u32>,
    section_steps: Vec<(u32, u32)>,
    stats: FileStats,
}

/// No step.
const NEVER: u32 = u32::MAX;

impl State {
    /// Counts block `key` (`at` in [`State::picked`]) as picked by this step: once a step, as
    /// picked by its section's previous picking step or not.
    fn count_pick(&mut self, section: usize, at: usize) {
        let step = self.step;
        let seen = &mut self.section_steps[section];
        if seen.0 != step {
            *seen = (step, seen.0);
        }
        let before = seen.1;
        if self.picked[at] != step {
            self.stats.step_blocks += 1;
            self.stats.step_again += u64::from(before != NEVER && self.picked[at] == before);
            self.picked[at] = step;
        }
    }
}

/// A gather's rows, as [`FileRows::fetch`] gives them.
pub enum Fetched {
    /// Gathered by the device from the cache: `[rows, sel, d]` in the tier's dtype.
    Gathered(Tensor),
    /// Widened here: `rows · sel · d` f32.
    Widened(Vec<f32>),
}

/// A gather's positions by block: `order` holds (block key, index of the position) sorted,
/// `groups` each block's key and its range of `order`.
struct ByBlock {
    order: Vec<(u64, u32)>,
    groups: Vec<(u64, std::ops::Range<usize>)>,
}

impl FileRows {
    /// The rows of the file at `path`, `kv_dtype` sections at `sections` (K then V of each
    /// layer), `[heads, n, d]` each, keys read here or not (`keys`), in at most `cache_bytes`
    /// of host memory held in the host budget: the scales and the records first, the rest a
    /// cache of whole blocks (at least one) that `device` gathers `dtype` rows from.
    pub fn open(
        path: &Path,
        sections: Vec<u64>,
        kv_dtype: KvDtype,
        (heads, n, d): (usize, usize, usize),
        (cache_bytes, keys): (u64, bool),
        (dtype, device): (DType, &Device),
    ) -> Result<Self> {
        if heads > MAX_HEADS {
            return Err(Error::Invalid(format!("the file tier reads at most {MAX_HEADS} KV heads, not {heads}")));
        }
        let layout = Layout::of(kv_dtype, (sections.len(), heads, n, d), keys);
        let (stored, slot_bytes, scale_bytes) = (layout.stored, layout.slot_bytes, layout.scale_bytes);
        let (side, per_slot) = (layout.scales + layout.stamps, layout.per_slot());
        if cache_bytes < side + per_slot as u64 {
            return Err(Error::Invalid(format!(
                "the file tier over {} needs at least {} of host memory (its fp8 scales, a record a block, a block); \
                 {} was left for it: raise --host-budget",
                path.display(),
                human_bytes(side + per_slot as u64),
                human_bytes(cache_bytes)
            )));
        }
        let (file, direct) = open_for_reads(path).map_err(|e| Error::io(path, e))?;
        let hold = host_budget::hold(side, &format!("the K/V scales of {}", path.display())).map_err(kv_refused)?;
        // One section at a time: what is read beside the held scales is one section's.
        let scales = sections
            .iter()
            .enumerate()
            .map(|(s, &base)| match (layout.with_scales(s), stored[s % 2]) {
                (true, Stored::Fp8 { scales }) => io::read_scales(&file, base + scales as u64, heads * n),
                _ => Ok(Vec::new()),
            })
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::Context { path: path.to_owned(), msg: format!("reading its K/V scales: {e}") })?;
        let slots = ((cache_bytes - side) / per_slot as u64) as usize;
        let slots_held = (slots * per_slot) as u64;
        let what = format!("the K/V cache of {}", path.display());
        let cache_hold = host_budget::hold(slots_held, &what).map_err(kv_refused)?;
        let cache = BlockCache::new(slots, (slot_bytes, scale_bytes), cache_hold, device).map_err(|e| {
            Error::Invalid(format!("{} of host memory for the K/V cache: {e}", human_bytes(slots_held)))
        })?;
        // The slots as rows of each kind the tier reads, for the device's gathers; none where
        // the device cannot read them (the CPU then widens every gather).
        let view = |kind: usize| -> Option<HostRows> {
            if (kind == 0 && !keys) || !cache.on_device() {
                return None;
            }
            let rows = slots * slot_bytes / stored[kind].row_bytes(d);
            let as_slots = match stored[kind] {
                Stored::Fp8 { .. } => Stored::Fp8 { scales: slots * slot_bytes },
                other => other,
            };
            HostRows::view(device, cache.shared(), 0, as_slots, (1, rows, d), dtype)
                .inspect_err(|e| tracing::warn!(error = %e, "the file tier's rows are widened by the CPU"))
                .ok()
        };
        let views = [view(0), view(1)];
        let stats = FileStats {
            cache_bytes: slots_held + side,
            slots: slots as u64,
            scales_in_memory: layout.scales,
            direct,
            ..FileStats::default()
        };
        Ok(Self {
            path: path.to_owned(),
            file,
            stored,
            heads,
            n,
            d,
            keys,
            scales,
            _hold: hold,
            views,
            device: device.clone(),
            state: Mutex::new(State {
                cache,
                gathers: 0,
                step: 0,
                picked: vec![NEVER; layout.blocks],
                section_steps: vec![(NEVER, NEVER); sections.len()],
                stats,
            }),
            ahead: (Mutex::new(0), std::sync::Condvar::new()),
            sections,
        })
    }

    /// The file the rows are read from.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The directory of that file: where a method's state too large for host memory goes
    /// ([`Spill`]), on the disk the tier reads.
    pub(crate) fn dir(&self) -> &Path {
        self.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
    }

    /// Bytes of host memory the cache holds.
    pub fn cache_bytes(&self) -> u64 {
        self.lock().stats.cache_bytes
    }

    /// What the tier has done so far (and the methods' spills beside it: the process's).
    pub fn stats(&self) -> FileStats {
        let (spill_reads, spill_bytes) = spill_reads();
        FileStats { late_reads: disk::late_reads(), spill_reads, spill_bytes, ..self.lock().stats }
    }

    /// A decode step ended: the next lookups count as the next step's.
    pub fn end_step(&self) {
        let mut state = self.lock();
        // (After 4 billion steps the stamps wrap: the overlap reads low for one step.)
        state.step = state.step.wrapping_add(1) % NEVER;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => {
                // A gather panicked between taking slots and filling them: no cached block is
                // trusted after it.
                let mut state = poisoned.into_inner();
                state.cache.clear();
                self.state.clear_poison();
                state
            }
        }
    }

    /// Rows of `layer`'s K (`kind` 0) or V (1) at the positions `idx` (`rows · sel` of them;
    /// row `r` of head `r / group`), `d` values each in `idx`'s order; a position at or past
    /// the saved length gives zeros or another row (the caller's tail has it). `keep`: the
    /// blocks read go into the cache (a step's picks), or pass through it (a scan). A step's
    /// picks that all have a slot are gathered from the cache by the device ([`Fetched::Gathered`],
    /// `[rows, sel, d]` in the tier's dtype); others are widened to f32 here.
    pub fn fetch(
        &self,
        (layer, kind): (usize, usize),
        idx: &[u32],
        (sel, group): (usize, usize),
        keep: bool,
    ) -> Result<Fetched> {
        let section = self.section(layer, kind)?;
        let blocks = self.by_block(section, idx, sel, group);
        let mut state = self.lock();
        state.gathers += 1;
        let (hits, missing) = self.look_up(&mut state, section, &blocks.groups, keep);
        let view = self.views[kind].as_ref().filter(|_| keep && missing.iter().all(|m| m.1.is_some()));
        let fetched = match view {
            Some(view) => {
                self.read_or_forget(&missing, &mut state, None)?;
                let per_slot = state.cache.slot_bytes() / self.stored[kind].row_bytes(self.d);
                let slots: Vec<(usize, usize)> =
                    hits.iter().copied().chain(missing.iter().filter_map(|m| Some((m.2, m.1?)))).collect();
                let mut at = vec![0u32; idx.len()];
                for &(g, slot) in &slots {
                    for &(_, i) in &blocks.order[blocks.groups[g].1.clone()] {
                        at[i as usize] = (slot * per_slot + idx[i as usize] as usize % BLOCK_ROWS) as u32;
                    }
                }
                let rows = idx.len() / sel;
                let at = Tensor::from_vec(at, (rows, sel), &self.device)?;
                // Queued while the lock is held: a later gather refilling one of these slots
                // waits for the device first.
                let gathered = view.gather(&at, rows, None, Positions::Trusted)?;
                let gather = state.gathers;
                state.cache.queued_on_device(slots.iter().map(|&(_, slot)| slot), gather);
                Fetched::Gathered(gathered)
            }
            None => {
                let mut out = vec![0f32; idx.len() * self.d];
                let rows_out = RowsOut { ptr: out.as_mut_ptr(), d: self.d };
                let (stored, scales) = (self.stored[kind], &self.scales[section]);
                // Widens the rows of group `g` from its block's bytes.
                let widen = |g: usize, bytes: &[u8]| {
                    let head = split_key(blocks.groups[g].0).1;
                    for &(_, i) in &blocks.order[blocks.groups[g].1.clone()] {
                        let p = idx[i as usize] as usize;
                        // SAFETY: `i` is in one group only, once: no two threads write the same row.
                        let out = unsafe { rows_out.row(i as usize) };
                        widen_row(bytes, stored, p % BLOCK_ROWS, scales.get(head * self.n + p).copied(), out);
                    }
                };
                let cache = &state.cache;
                hits.par_iter().for_each(|&(g, slot)| widen(g, cache.slot(slot)));
                self.read_or_forget(&missing, &mut state, Some(&widen))?;
                Fetched::Widened(out)
            }
        };
        let s = &mut state.stats;
        s.gathers += 1;
        s.device_gathers += u64::from(matches!(fetched, Fetched::Gathered(_)));
        s.blocks += blocks.groups.len() as u64;
        s.hits += hits.len() as u64;
        Ok(fetched)
    }

    /// The section of `layer`'s K (`kind` 0) or V (1), if the tier reads it.
    fn section(&self, layer: usize, kind: usize) -> Result<usize> {
        let section = 2 * layer + kind;
        if section >= self.sections.len() || kind > 1 || (kind == 0 && !self.keys) {
            return Err(Error::Invalid(format!("the file tier reads no section {kind} of layer {layer}")));
        }
        Ok(section)
    }

    /// The positions `idx` of `section` by block, in the file's order; positions at or past
    /// the saved length are left out.
    fn by_block(&self, section: usize, idx: &[u32], sel: usize, group: usize) -> ByBlock {
        let mut order: Vec<(u64, u32)> = idx
            .iter()
            .enumerate()
            .filter(|&(_, &p)| (p as usize) < self.n)
            .map(|(i, &p)| (block_key(section, i / sel / group, p as usize / BLOCK_ROWS), i as u32))
            .collect();
        // A refresh's picks are tens of thousands of positions: sorted on the cores.
        order.par_sort_unstable();
        let groups = order
            .chunk_by(|a, b| a.0 == b.0)
            .scan(0, |at, g| {
                let range = *at..*at + g.len();
                *at += g.len();
                Some((g[0].0, range))
            })
            .collect();
        ByBlock { order, groups }
    }

    /// Each block of `groups` from the cache: taken for a step's picks (`keep`: a slot to fill
    /// when it is not cached), found for a scan. The hits `(group, slot)` and the misses
    /// `(key, slot to fill, group)` in the file's order.
    fn look_up(
        &self,
        state: &mut State,
        section: usize,
        groups: &[(u64, std::ops::Range<usize>)],
        keep: bool,
    ) -> (Vec<(usize, usize)>, Vec<Miss>) {
        let gather = state.gathers;
        let blocks_per_head = self.n.div_ceil(BLOCK_ROWS);
        let (mut hits, mut missing) = (Vec::new(), Vec::new());
        for (g, &(key, _)) in groups.iter().enumerate() {
            let found = match keep {
                true => {
                    let (_, head, block) = split_key(key);
                    state.count_pick(section, (section * self.heads + head) * blocks_per_head + block);
                    state.cache.take(key, gather)
                }
                false => state.cache.find(key, gather).map_or(Found::Pass, Found::Hit),
            };
            match found {
                Found::Hit(slot) => hits.push((g, slot)),
                Found::Fill(slot) => missing.push((key, Some(slot), g)),
                Found::Pass => missing.push((key, None, g)),
            }
        }
        (hits, missing)
    }
}

/// Row `r` of a block's `bytes` stored as `stored` into `out`; an fp8 row with its `scale`.
fn widen_row(bytes: &[u8], stored: Stored, r: usize, scale: Option<f32>, out: &mut [f32]) {
    match (stored, scale) {
        (Stored::Fp8 { .. }, Some(scale)) => {
            let d = out.len();
            fp8_row_values(&bytes[r * d..(r + 1) * d], scale, out)
        }
        _ => stored_row(bytes, stored, r, out.len(), out),
    }
}

/// A gather's output rows, written by several threads: each row by one.
struct RowsOut {
    ptr: *mut f32,
    d: usize,
}

// SAFETY: the rows are disjoint; `row`'s callers write each row from one thread.
unsafe impl Sync for RowsOut {}

impl RowsOut {
    /// Row `i` (`d` values).
    ///
    /// # Safety
    /// `i` is within the output, and no other reference to row `i` is alive.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, i: usize) -> &mut [f32] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.d), self.d) }
    }
}

/// A block's key: section, head, block, in the file's order.
fn block_key(section: usize, head: usize, block: usize) -> u64 {
    ((section as u64) << 40) | ((head as u64) << 32) | block as u64
}

fn split_key(key: u64) -> (usize, usize, usize) {
    ((key >> 40) as usize, ((key >> 32) & MAX_HEADS as u64) as usize, (key & 0xffff_ffff) as usize)
}

/// `out [rows, sel, d]` in `dtype` on `device`: `rows`'s saved rows of `layer`'s `kind` at
/// `idx [rows, sel]` (row `r` reads head `r / group`), positions from the saved length on read
/// from `tail [heads, tail_n, d]` (the device tail); `keep` as [`FileRows::fetch`]; `listed`:
/// `idx`'s positions on the host already (else copied from the device). The file tier's
/// [`folio_kernels::select::HostRows::gather`].
pub(crate) fn gather(
    rows: &FileRows,
    (layer, kind): (usize, usize),
    (idx, listed): (&Tensor, Option<&[u32]>),
    group: usize,
    tail: Option<&Tensor>,
    (dtype, device): (DType, &Device),
    keep: bool,
) -> Result<Tensor> {
    let (ih, sel) = idx.dims2()?;
    if group == 0 || ih != rows.heads * group {
        return Err(Error::Invalid(format!(
            "file tier: gathering {:?} with group {group} from {} heads",
            idx.dims(),
            rows.heads
        )));
    }
    let tail_n = match tail {
        Some(t) => {
            let (th, tn, td) = t.dims3()?;
            if th != rows.heads || td != rows.d || t.dtype() != dtype {
                return Err(Error::Invalid(format!(
                    "file tier: tail {:?} {:?} does not continue its rows",
                    t.dims(),
                    t.dtype()
                )));
            }
            tn
        }
        None => 0,
    };
    let d = rows.d;
    if sel == 0 {
        return Ok(Tensor::zeros((ih, 0, d), dtype, device)?);
    }
    let copied;
    let pos: &[u32] = match listed {
        Some(listed) => listed,
        None => {
            copied = idx.flatten_all()?.to_vec1::<u32>()?;
            &copied
        }
    };
    if let Some(&bad) = pos.iter().find(|&&p| p as usize >= rows.n + tail_n) {
        return Err(Error::Invalid(format!("file tier: position {bad} is past the {} stored rows", rows.n + tail_n)));
    }
    let out = span(device, "attention: file tier fetch", || {
        Ok(match rows.fetch((layer, kind), pos, (sel, group), keep)? {
            Fetched::Gathered(out) => out,
            // Narrowed where the device is: on a GPU in a launch, where the CPU would take one
            // core a value (a scan's 64 Ki rows of 4 heads are 33 M values).
            Fetched::Widened(rows) => {
                Tensor::from_vec(rows, (ih, sel, d), &Device::Cpu)?.to_device(device)?.to_dtype(dtype)?
            }
        })
    })?;
    let Some(tail) = tail.filter(|_| pos.iter().any(|&p| p as usize >= rows.n)) else {
        return Ok(out);
    };
    // The tail's rows where the positions are past the saved ones, one selection on the device.
    let from: Vec<u32> = pos
        .iter()
        .enumerate()
        .map(|(i, &p)| if p as usize >= rows.n { ((i / sel / group) * tail_n + p as usize - rows.n) as u32 } else { 0 })
        .collect();
    let mask: Vec<u8> = pos.iter().map(|&p| u8::from(p as usize >= rows.n)).collect();
    let flat = tail.contiguous()?.reshape((rows.heads * tail_n, d))?;
    let picked = flat.index_select(&Tensor::from_vec(from, ih * sel, device)?, 0)?.reshape((ih, sel, d))?;
    let mask = Tensor::from_vec(mask, (ih, sel, 1), device)?.broadcast_as((ih, sel, d))?;
    Ok(mask.where_cond(&picked, &out)?)
}
