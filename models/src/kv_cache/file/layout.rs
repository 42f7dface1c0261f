//! Where a context's rows lie in the file tier's memory: the fp8 scales it reads at open, a
//! stamp a block, and slots of a block's rows with their scales and records — and so the
//! least memory the tier opens with, which the planner asks of the budget too.

use folio_context_file::format::SectionKind;
use folio_context_file::rows::Stored;
use folio_context_file::KvDtype;

use super::BLOCK_ROWS;

/// The smallest cache the file tier opens with (a few blocks of each head: less, and a step's
/// picks pass the cache by); less room than that is a refusal.
pub const FILE_CACHE_MIN: u64 = 1 << 20;

/// Host bytes a cache slot costs beside its rows (its key, CLOCK's bit, its gather, its entry
/// in the key map with the map's spare room: about 45), held in the host budget with the rows.
pub(super) const SLOT_META_BYTES: usize = 64;

/// How a file's rows lie in the tier's memory: see [`Layout::of`].
pub(super) struct Layout {
    pub(super) keys: bool,
    pub(super) stored: [Stored; 2],
    /// Blocks of the file (a stamp each), bytes of the fp8 scales the tier reads into memory.
    pub(super) blocks: usize,
    pub(super) scales: u64,
    pub(super) stamps: u64,
    /// A slot's rows, and its scales (one for each fp8 row a slot could hold).
    pub(super) slot_bytes: usize,
    pub(super) scale_bytes: usize,
}

impl Layout {
    /// The layout of `sections` sections of `[heads, n, d]` rows stored as `kv_dtype`, key
    /// sections read by the tier or not (`keys`).
    pub(super) fn of(kv_dtype: KvDtype, (sections, heads, n, d): (usize, usize, usize, usize), keys: bool) -> Self {
        let stored = [SectionKind::Keys, SectionKind::Values].map(|k| kv_dtype.codec(k).stored(heads * n, d));
        let fp8 = stored.map(|s| matches!(s, Stored::Fp8 { .. }));
        let with_scales = (0..sections).filter(|&s| (keys || s % 2 == 1) && fp8[s % 2]).count();
        let blocks = sections * heads * n.div_ceil(BLOCK_ROWS);
        let slot_bytes = stored.iter().map(|s| s.row_bytes(d) * BLOCK_ROWS).max().unwrap_or(0);
        let scale_bytes = if fp8.contains(&true) { 4 * slot_bytes / d.max(1) } else { 0 };
        let scales = with_scales as u64 * 4 * (heads * n) as u64;
        Self { keys, stored, blocks, scales, stamps: 4 * blocks as u64, slot_bytes, scale_bytes }
    }

    /// Whether section `s`'s scales are read into memory.
    pub(super) fn with_scales(&self, s: usize) -> bool {
        (self.keys || s % 2 == 1) && matches!(self.stored[s % 2], Stored::Fp8 { .. })
    }

    /// Host bytes a slot takes: its rows, its scales, its records.
    pub(super) fn per_slot(&self) -> usize {
        self.slot_bytes + self.scale_bytes + SLOT_META_BYTES
    }
}

/// The least host memory the file tier opens a context's K/V with (`layers` layers of
/// `[heads, n, d]` rows stored as `kv_dtype`): every section's fp8 scales, a record a block,
/// one block, and at least [`FILE_CACHE_MIN`] — what the planner and
/// `OffloadKv::from_context` ask of the budget's share before planning or opening it.
pub fn least_bytes(kv_dtype: KvDtype, (layers, heads, n, d): (usize, usize, usize, usize)) -> u64 {
    let layout = Layout::of(kv_dtype, (2 * layers, heads, n, d), true);
    (layout.scales + layout.stamps + layout.per_slot() as u64).max(FILE_CACHE_MIN)
}
