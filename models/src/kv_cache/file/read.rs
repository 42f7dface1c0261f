//! How the file tier reads blocks: the blocks a gather misses (or a read-ahead wants) grouped
//! into runs of consecutive blocks, the runs read in batches on the read threads, each batch
//! placed in the cache's slots before the next is read.
//!
//! Why batches: a cold step misses gigabytes, and what a read holds in flight is host memory
//! the budget must see; a batch bounds it while keeping dozens of reads in parallel. Why a
//! read-ahead apart from the gathers: a step's picks are known before the step reads them
//! (HiP searches a layer's blocks one step before it uses them), so their blocks can be read
//! while the device works, and the tier's lock is then held only to look blocks up and to place
//! them — a gather that comes meanwhile is not held behind the disk.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

use rayon::prelude::*;

use super::cache::Found;
use super::{block_key, io, split_key, FileRows, State, BLOCK_ROWS};
use crate::error::{Error, Result};

/// Bytes of consecutive blocks read in one call at most: 2 MiB, large enough for a disk's
/// sequential rate, small enough that a scan's runs spread over the threads.
const RUN_BYTES: usize = 2 << 20;

/// Blocks not asked for that a run reads to join the missing blocks on either side: one read of
/// 12 KiB costs a disk less than two of 4 KiB (an NVMe serves ~1M reads a second and ~7 GB/s:
/// a read is worth ~7 KiB of its bandwidth; a virtio disk far more).
const GAP_BLOCKS: usize = 1;

/// Bytes of blocks read before they are placed and the next are read (at most; a small cache
/// reads less at once): bounds what a gather holds in flight (a cold step misses GBs) while
/// keeping dozens of reads in parallel.
const READ_BATCH_BYTES: usize = 32 << 20;

/// Read-aheads in flight at most: HiP starts three or four a step, each as its layer's search
/// ends, and the disk serves them together (one at a time, the step waited for a queue of them:
/// its read-aheads took 3× their own time to finish).
const AHEAD_MAX: usize = 4;

/// Share of the cache's bytes a batch may take: a batch is held twice (the aligned reads and
/// the blocks cut from them), and a gather and [`AHEAD_MAX`] read-aheads may each have one in
/// flight — a sixth of the cache beside it at most, within the budget's room the cache left.
const BATCH_SHARE: usize = 64;

/// A block a gather misses: its key, the slot it fills (none: it passes the cache), its group.
pub(super) type Miss = (u64, Option<usize>, usize);

/// Widens a group's rows from its block's bytes.
pub(super) type Widen<'a> = &'a (dyn Fn(usize, &[u8]) + Sync);

/// A run of consecutive blocks of one head of one section, read with one call.
struct Run {
    section: usize,
    head: usize,
    first: usize,
    blocks: usize,
}

/// A batch's runs as read: each run's bytes and the bytes its read took; the seconds it took.
type Batch = (Vec<(Vec<u8>, u64)>, f64);

impl FileRows {
    /// [`Self::read_blocks`], and on an error the slots it was to fill forgotten (they hold no
    /// rows).
    pub(super) fn read_or_forget(&self, missing: &[Miss], state: &mut State, widen: Option<Widen<'_>>) -> Result<()> {
        let read = self.read_blocks(missing, state, widen);
        if read.is_err() {
            missing.iter().filter_map(|&(_, slot, _)| slot).for_each(|slot| state.cache.forget(slot));
        }
        read
    }

    /// Reads the `missing` blocks (`(key, slot, group)`, in key order: the file's order), puts
    /// each into its slot if it has one (with its scales; the device's queued gathers done
    /// first), and hands its bytes to `widen(group, bytes)` if given.
    fn read_blocks(&self, missing: &[Miss], state: &mut State, widen: Option<Widen<'_>>) -> Result<()> {
        let mut quiet = !missing.iter().any(|m| m.1.is_some());
        let keys: Vec<u64> = missing.iter().map(|m| m.0).collect();
        let runs = self.runs(&keys);
        let (mut next, mut bytes_read, mut reads, mut seconds) = (0, 0, 0, 0.0);
        for batch in batches(&runs, self.batch_limit(state), state.cache.slot_bytes()) {
            let (read, took) = self.read_batch(batch)?;
            seconds += took;
            if !quiet {
                let gather = state.gathers;
                state.cache.quiesce(gather)?;
                quiet = true;
            }
            let pieces = wanted(&read, batch, &keys, &mut next);
            for &(i, piece) in &pieces {
                if let (key, Some(slot), _) = missing[i] {
                    state.cache.write(slot, piece, self.block_scales(key));
                }
            }
            (bytes_read, reads) = (bytes_read + read.iter().map(|r| r.1).sum::<u64>(), reads + read.len() as u64);
            if let Some(widen) = widen {
                pieces.par_iter().for_each(|&(i, piece)| widen(missing[i].2, piece));
            }
        }
        let s = &mut state.stats;
        s.blocks_read += missing.len() as u64;
        s.reads += reads;
        s.bytes_read += bytes_read;
        s.read_seconds += seconds;
        Ok(())
    }

    /// Reads into the cache the blocks of `layer`'s K (`kind` 0) or V (1) at `idx` (as
    /// [`Self::fetch`] takes them) that it does not hold, for the gather that will ask for
    /// them (see the module docs): the lock is held to look them up and to place each batch,
    /// not while the disk reads. A block a gather reads meanwhile is read twice and placed
    /// once. At most [`AHEAD_MAX`] read-aheads run at once (each holds a batch).
    pub fn read_ahead(&self, (layer, kind): (usize, usize), idx: &[u32], (sel, group): (usize, usize)) -> Result<()> {
        let section = self.section(layer, kind)?;
        let _slot = AheadSlot::take(&self.ahead);
        let blocks = self.by_block(section, idx, sel, group);
        let (keys, limit, slot_bytes) = {
            let mut state = self.lock();
            // (A block cached already is marked used: the gather to come wants it kept.)
            let keys: Vec<u64> = blocks.groups.iter().map(|g| g.0).filter(|&key| !state.cache.touch(key)).collect();
            (keys, self.batch_limit(&state), state.cache.slot_bytes())
        };
        let runs = self.runs(&keys);
        let mut next = 0;
        for batch in batches(&runs, limit, slot_bytes) {
            let (read, seconds) = self.read_batch(batch)?;
            let pieces = wanted(&read, batch, &keys, &mut next);
            let mut state = self.lock();
            state.gathers += 1;
            let gather = state.gathers;
            // (slot, piece): a block a gather cached meanwhile is a hit, left as it is.
            let fills: Vec<(usize, usize)> = (pieces.iter().enumerate())
                .filter_map(|(p, &(i, _))| match state.cache.take(keys[i], gather) {
                    Found::Fill(slot) => Some((slot, p)),
                    Found::Hit(_) | Found::Pass => None,
                })
                .collect();
            if let Err(e) = fills.first().map_or(Ok(()), |_| state.cache.quiesce(gather)) {
                // The slots taken hold no rows: forgotten, not served.
                fills.iter().for_each(|&(slot, _)| state.cache.forget(slot));
                return Err(e.into());
            }
            for &(slot, p) in &fills {
                let (i, piece) = pieces[p];
                state.cache.write(slot, piece, self.block_scales(keys[i]));
            }
            let s = &mut state.stats;
            s.blocks_ahead += fills.len() as u64;
            s.reads += read.len() as u64;
            s.bytes_read += read.iter().map(|r| r.1).sum::<u64>();
            s.ahead_seconds += seconds;
        }
        Ok(())
    }

    /// Counts a read-ahead asked for at `asked`, its positions in hand at `got`, done now.
    pub fn count_read_ahead(&self, asked: Instant, got: Instant) {
        let s = &mut self.lock().stats;
        s.read_aheads += 1;
        s.ahead_start_seconds += (got - asked).as_secs_f64();
        s.ahead_wall_seconds += got.elapsed().as_secs_f64();
    }

    /// Block `key`'s fp8 scales (none for rows without), as a slot keeps them.
    fn block_scales(&self, key: u64) -> &[f32] {
        let (section, head, block) = split_key(key);
        let scales = &self.scales[section];
        if scales.is_empty() {
            return &[];
        }
        let from = head * self.n + block * BLOCK_ROWS;
        &scales[from..(from + BLOCK_ROWS).min((head + 1) * self.n)]
    }

    /// The blocks `keys` (sorted) as runs: consecutive blocks of one head of one section, and
    /// up to [`GAP_BLOCKS`] not asked for between two that are, [`RUN_BYTES`] at most.
    fn runs(&self, keys: &[u64]) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        for &key in keys {
            let (section, head, block) = split_key(key);
            let run_blocks = RUN_BYTES / (self.stored[section % 2].row_bytes(self.d) * BLOCK_ROWS);
            match runs.last_mut() {
                Some(r)
                    if r.section == section
                        && r.head == head
                        && block - (r.first + r.blocks) <= GAP_BLOCKS
                        && block + 1 - r.first <= run_blocks =>
                {
                    r.blocks = block + 1 - r.first
                }
                _ => runs.push(Run { section, head, first: block, blocks: 1 }),
            }
        }
        runs
    }

    /// Bytes of blocks a batch reads at most (see [`BATCH_SHARE`]).
    fn batch_limit(&self, state: &State) -> usize {
        let slot_bytes = state.cache.slot_bytes();
        (state.stats.cache_bytes as usize / BATCH_SHARE).clamp(slot_bytes, READ_BATCH_BYTES)
    }

    /// A batch's runs read in parallel on the read threads.
    fn read_batch(&self, batch: &[Run]) -> Result<Batch> {
        let started = Instant::now();
        let read = io::io_pool()
            .install(|| batch.par_iter().map(|run| self.read_run(run)).collect::<std::io::Result<_>>())
            .map_err(|e| Error::Context {
                path: self.path.clone(),
                msg: format!(
                    "reading its K/V rows from disk: {e}; if the file was changed or cut short since it was \
                     opened, open it again (or prefill again)"
                ),
            })?;
        Ok((read, started.elapsed().as_secs_f64()))
    }

    /// A run's blocks (a head's last block padded), with the bytes read (one read).
    fn read_run(&self, run: &Run) -> std::io::Result<(Vec<u8>, u64)> {
        let rb = self.stored[run.section % 2].row_bytes(self.d);
        let first_row = run.head * self.n + run.first * BLOCK_ROWS;
        let rows = (run.blocks * BLOCK_ROWS).min(self.n - run.first * BLOCK_ROWS);
        let mut out = vec![0u8; rb * BLOCK_ROWS * run.blocks];
        let offset = self.sections[run.section] + (first_row * rb) as u64;
        let read = io::read_into(&self.file, offset, &mut out[..rows * rb])?;
        Ok((out, read))
    }
}

/// Read-aheads running, and their wake-up: see [`AheadSlot`].
pub(super) type Aheads = (Mutex<usize>, Condvar);

/// One of the [`AHEAD_MAX`] places for a read-ahead, held while it runs.
struct AheadSlot<'a>(&'a Aheads);

impl<'a> AheadSlot<'a> {
    /// Waits for a place.
    fn take(aheads: &'a Aheads) -> Self {
        let mut running = aheads.0.lock().unwrap_or_else(|e| e.into_inner());
        while *running >= AHEAD_MAX {
            running = aheads.1.wait(running).unwrap_or_else(|e| e.into_inner());
        }
        *running += 1;
        Self(aheads)
    }
}

impl Drop for AheadSlot<'_> {
    fn drop(&mut self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0 .1.notify_one();
    }
}

/// `runs` cut into batches of about `limit` bytes of blocks of `slot_bytes` (a run at least).
fn batches(runs: &[Run], limit: usize, slot_bytes: usize) -> Vec<&[Run]> {
    let mut out = Vec::new();
    let mut rest = runs;
    while !rest.is_empty() {
        let (mut take, mut bytes) = (0, 0);
        while take < rest.len() && (take == 0 || bytes < limit) {
            bytes += rest[take].blocks * slot_bytes;
            take += 1;
        }
        let (batch, after) = rest.split_at(take);
        out.push(batch);
        rest = after;
    }
    out
}

/// The blocks of `keys` (sorted; from `*next` on) that a batch's runs read, each with its index
/// in `keys` and its bytes; `*next` moves past them. The blocks of gaps are left out.
fn wanted<'r>(read: &'r [(Vec<u8>, u64)], batch: &[Run], keys: &[u64], next: &mut usize) -> Vec<(usize, &'r [u8])> {
    let mut out = Vec::new();
    for ((bytes, _), run) in read.iter().zip(batch) {
        for (b, piece) in bytes.chunks_exact(bytes.len() / run.blocks).enumerate() {
            if keys.get(*next) == Some(&block_key(run.section, run.head, run.first + b)) {
                out.push((*next, piece));
                *next += 1;
            }
        }
    }
    out
}
