//! Where a layer's bucket lists lie — host memory (mapped for a GPU's walk) or a spill file on
//! the disk the file tier reads ([`Spill`]) — and the walk that counts a query's collisions
//! over them.
//!
//! Why on disk: at a million keys of the 7B shape the lists are 15–30 GB (2 bytes a key a
//! table, L = 66–153), more than a 32 GiB laptop has beside its keys; their run starts (~40 MB
//! a layer, ~1 GB in all) and the keys' norms stay in memory. Why that costs one read per
//! (query head, table): a table's members are sorted by (code, segment, key), so one code's runs
//! in every segment lie together — ~1,000 keys at a million keys and K = 10, 2 KiB, one read of
//! one or two 4 KiB pages — and the walk, given those bytes, counts exactly what it counts over
//! memory.

use std::borrow::Cow;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use super::{HeadTables, HugePages, LayerIndex, SEGMENT_KEYS};
use crate::error::Result;
use crate::kv_cache::Spill;
use folio_method_kernels::magicpig as lsh;
use rayon::prelude::*;

/// Runs (one table's members in one segment, ~64 entries at a million keys and K = 10) ahead of
/// the one being walked whose loads are started.
const WALK_AHEAD: usize = 8;

/// 64-bit words of a one-bit-per-key set over a segment.
const SEGMENT_WORDS: usize = SEGMENT_KEYS / 64;

/// A KV head's bucket lists, `[tables][n]` u16.
pub(in crate::attention::magicpig) enum Lists {
    /// In host memory, shared: a GPU walks them in place.
    Memory(Arc<HugePages<u16>>),
    /// At `at` of a layer's spill file.
    Disk { spill: Arc<Spill>, at: u64 },
}

/// A query's runs read from disk: per table, its code's members over the segments walked.
pub(in crate::attention::magicpig) struct ReadRuns {
    tables: Vec<Vec<u16>>,
    segs: Range<usize>,
}

impl HeadTables {
    /// Where table `l`'s members from `range` lie on disk (offset, bytes), for lists on disk.
    fn span(&self, at: u64, l: usize, range: &Range<usize>) -> (u64, usize) {
        let from = (l * self.len() + range.start) as u64 * 2;
        (at + from, range.len() * 2)
    }

    /// Table `l`'s members, read back from disk where they lie there.
    pub(in crate::attention::magicpig) fn table(&self, l: usize) -> Result<Cow<'_, [u16]>> {
        match &self.lists {
            Lists::Memory(_) => Ok(Cow::Borrowed(self.members(l).unwrap_or_default())),
            Lists::Disk { spill, at } => {
                let bytes = spill.read(&[self.span(*at, l, &(0..self.len()))])?;
                Ok(Cow::Owned(u16s(&bytes[0])))
            }
        }
    }
}

/// Members as written ([`LayerIndex::spill`]: this machine's byte order).
fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes.chunks_exact(2).map(|b| u16::from_ne_bytes([b[0], b[1]])).collect()
}

/// Counts, a segment at a time, the keys in at least two of the runs `run(table, segment)`
/// gives over segments `segs` of `tables` tables: their offsets (ascending) and the entries
/// walked. `ahead` is called before each run is walked (the memory walk's prefetch).
///
/// Why a segment at a time: the two bitsets (keys seen once, seen twice: one bit each) then
/// cover one segment — 16 KB, in a core's L1, where a bitset of every key took 256 KB at a
/// million keys — and a head's walk splits into ranges of segments. The bits are set without
/// a branch, and the sample is read off the second set in key order, the order the caller
/// reads rows and norms in (ascending addresses, not one cache and TLB miss each).
fn collide<'r>(
    tables: usize,
    segs: Range<usize>,
    run: impl Fn(usize, usize) -> &'r [u16],
    mut ahead: impl FnMut(),
) -> (Vec<usize>, usize) {
    let (mut once, mut twice) = ([0u64; SEGMENT_WORDS], [0u64; SEGMENT_WORDS]);
    let (mut out, mut walked) = (Vec::new(), 0);
    for s in segs {
        for l in 0..tables {
            ahead();
            let members = run(l, s);
            walked += members.len();
            for &m in members {
                let (w, bit) = (m as usize / 64, 1u64 << (m % 64));
                twice[w] |= once[w] & bit;
                once[w] |= bit;
            }
        }
        for (w, &bits) in twice.iter().enumerate() {
            let mut rest = bits;
            while rest != 0 {
                out.push(s * SEGMENT_KEYS + w * 64 + rest.trailing_zeros() as usize);
                rest &= rest - 1;
            }
        }
        once.fill(0);
        twice.fill(0);
    }
    (out, walked)
}

impl LayerIndex {
    /// Offsets (from `first`) of the keys whose code equals `q`'s in at least two tables,
    /// ascending, and the index entries walked ([`collide`]); lists on disk are read first.
    pub(in crate::attention::magicpig) fn retrieve(&self, head: usize, q: &[f32]) -> Result<(Vec<usize>, usize)> {
        self.retrieve_segments(head, &self.query_codes(q), 0..self.segments())
    }

    /// [`Self::retrieve`] over the keys of segments `segs` only, for a query whose codes are
    /// `qc` (a head's walk can be split into parts that run on different cores).
    pub(in crate::attention::magicpig) fn retrieve_segments(
        &self,
        head: usize,
        qc: &[u32],
        segs: Range<usize>,
    ) -> Result<(Vec<usize>, usize)> {
        let t = &self.heads[head];
        let members = match &t.lists {
            Lists::Memory(members) => members,
            Lists::Disk { .. } => {
                let runs = self.read_runs(&[(head, qc)], segs)?;
                return Ok(self.walk_read(head, qc, &runs[0]));
            }
        };
        let n = t.len();
        let run = |l: usize, s: usize| &members[l * n..][t.run_at(l, qc[l], s..s + 1)];
        // Each run is a DRAM miss the hardware cannot predict: every table's run starts are
        // loaded first (independent loads, in flight together), then each run a few runs
        // before it is walked.
        qc.iter().enumerate().for_each(|(l, &c)| t.prefetch_starts(l, c));
        // The next run to prefetch: table `pl` of segment `ps`, WALK_AHEAD runs ahead.
        let (mut ps, mut pl, end, tables) = (segs.start, 0, segs.end, qc.len());
        let mut prefetch_next = || {
            if ps < end && tables > 0 {
                lsh::prefetch_lines(run(pl, ps));
                pl += 1;
                if pl == tables {
                    (ps, pl) = (ps + 1, 0);
                }
            }
        };
        (0..WALK_AHEAD).for_each(|_| prefetch_next());
        Ok(collide(tables, segs, run, prefetch_next))
    }

    /// The runs of each `(KV head, codes)` query over segments `segs`, read from the lists on
    /// disk: one read per query and table, every query's at once.
    pub(in crate::attention::magicpig) fn read_runs(
        &self,
        queries: &[(usize, &[u32])],
        segs: Range<usize>,
    ) -> Result<Vec<ReadRuns>> {
        let mut spans = Vec::new();
        let mut spill = None;
        for &(head, qc) in queries {
            let t = &self.heads[head];
            let Lists::Disk { spill: s, at } = &t.lists else {
                return Err(crate::error::Error::Invalid("magicpig: these bucket lists are in memory".into()));
            };
            // One spill a layer: every head's lists are in it.
            debug_assert!(spill.as_ref().is_none_or(|first| Arc::ptr_eq(first, s)));
            spill = Some(s.clone());
            spans.extend(qc.iter().enumerate().map(|(l, &c)| t.span(*at, l, &t.run_at(l, c, segs.clone()))));
        }
        let Some(spill) = spill else { return Ok(Vec::new()) };
        let mut read = spill.read(&spans)?.into_iter();
        Ok(queries
            .iter()
            .map(|(_, qc)| ReadRuns {
                tables: read.by_ref().take(qc.len()).map(|b| u16s(&b)).collect(),
                segs: segs.clone(),
            })
            .collect())
    }

    /// [`Self::retrieve`] for each `(KV head, codes)` query, over the current pool: lists on
    /// disk read for all of them at once ([`Self::read_runs`]).
    pub(in crate::attention::magicpig) fn retrieve_many(
        &self,
        queries: &[(usize, &[u32])],
    ) -> Result<Vec<(Vec<usize>, usize)>> {
        let segs = 0..self.segments();
        if !queries.iter().any(|&(h, _)| matches!(self.heads[h].lists, Lists::Disk { .. })) {
            return queries.par_iter().map(|&(h, qc)| self.retrieve_segments(h, qc, segs.clone())).collect();
        }
        let runs = self.read_runs(queries, segs)?;
        Ok(queries.par_iter().zip(&runs).map(|(&(h, qc), r)| self.walk_read(h, qc, r)).collect())
    }

    /// [`Self::retrieve_segments`] over runs [`Self::read_runs`] read for KV head `head` and
    /// codes `qc`.
    pub(in crate::attention::magicpig) fn walk_read(
        &self,
        head: usize,
        qc: &[u32],
        runs: &ReadRuns,
    ) -> (Vec<usize>, usize) {
        let t = &self.heads[head];
        let run = |l: usize, s: usize| {
            let first = t.run_at(l, qc[l], runs.segs.start..runs.segs.start).start;
            let r = t.run_at(l, qc[l], s..s + 1);
            &runs.tables[l][r.start - first..r.end - first]
        };
        collide(qc.len(), runs.segs.clone(), run, || {})
    }

    /// This index with its bucket lists moved to a spill file in `dir` (the context file's
    /// directory): each KV head's written, then its memory returned. The disk is asked for room
    /// for `layers` layers' lists like these (this one and those to come), so that a disk that
    /// cannot hold them all says so at the first layer, not minutes into the answer.
    pub(in crate::attention::magicpig) fn spill(mut self, dir: &Path, layers: usize) -> Result<Self> {
        let started = std::time::Instant::now();
        let bytes: u64 = self.heads.iter().map(|h| (h.len() * self.tables * 2) as u64 + PAGE).sum();
        let what = format!("magicpig's bucket lists ({layers} layers of {})", crate::error::human_bytes(bytes));
        let spill = Arc::new(Spill::create(dir, bytes * layers.max(1) as u64, &what)?);
        for h in &mut self.heads {
            if let Lists::Memory(members) = &h.lists {
                let at = spill.append(bytemuck::cast_slice::<u16, u8>(members))?;
                h.lists = Lists::Disk { spill: spill.clone(), at };
            }
        }
        tracing::info!(bytes, seconds = started.elapsed().as_secs_f64(), "magicpig's bucket lists written to disk");
        Ok(self)
    }
}

/// A page of a spill: each head's lists start on one, and the spill's first is its own.
const PAGE: u64 = 4096;
