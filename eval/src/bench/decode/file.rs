//! A decode run on the file tier (`folio bench --shape --kv-on-disk DIR`): the context's random
//! rows written as a context file stores them into a file in `DIR` and read back on the file
//! tier through a cache of what the host budget leaves, as a reopened context larger than the
//! budget is; the disk's sequential read rate measured in the same run (the tier's limit), and
//! each timed step's disk bytes, reads, cache hits and the share of its blocks the step before
//! used too.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use folio_models::config::ModelConfig;
use folio_models::context::KvDtype;
use folio_models::error::{Error, Result};
use folio_models::kv_cache::{file_tier_bytes, FileStats, OffloadKv};
use folio_runtime::host_budget;
use rayon::prelude::*;
use serde::Serialize;

/// Bytes of the rows file read to measure the disk's rate (less when the file is smaller), in
/// reads of [`PROBE_READ`] spread over the cores: a disk serves many requests at once.
const PROBE_BYTES: u64 = 4 << 30;
const PROBE_READ: usize = 4 << 20;

/// The rows file, removed when the run ends however it ends (at a million tokens it is tens of GB).
pub(super) struct RowsFile(PathBuf);

impl RowsFile {
    pub(super) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RowsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The cache the file tier gets in this run: `FILE_CACHE_SHARE` of the host budget's room
/// once the process, the embedding table and the largest method state are counted, at most
/// the rows' bytes — what a context opened past the budget gets.
pub(super) fn cache_bytes(kv_bytes: u64, table: u64, state: u64) -> u64 {
    let process = folio_runtime::host_memory::rss().unwrap_or(0);
    let room = host_budget::budget().map_or(kv_bytes, |b| b.saturating_sub(process + table + state));
    file_tier_bytes(room, kv_bytes)
}

/// The rows file in `dir` filled with random rows stored as `kv_dtype`, on the file tier with
/// a cache of `cache` bytes; the seconds the fill took.
pub(super) fn fill(
    dir: &Path,
    cfg: &ModelConfig,
    context: usize,
    (kv_dtype, dtype): (KvDtype, DType),
    device: &Device,
    cache: u64,
) -> Result<(OffloadKv, RowsFile, f64)> {
    let started = Instant::now();
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let file = RowsFile(dir.join(format!("folio-bench-{}-{context}.kv", kv_dtype.name())));
    let random_rows = |t: usize| -> candle_core::Result<(Tensor, Tensor)> {
        let shape = (cfg.num_kv_heads, t, cfg.head_dim);
        let k = Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?;
        Ok((k, Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?))
    };
    let shape = (cfg.num_layers, cfg.num_kv_heads, context, cfg.head_dim);
    let kv = OffloadKv::stored_file(&file.0, shape, (kv_dtype, dtype), device, |_, _, t| Ok(random_rows(t)?), cache)?;
    Ok((kv, file, started.elapsed().as_secs_f64()))
}

/// The disk's sequential read rate (bytes/s) over `path`, read as the file tier reads (the
/// page cache bypassed; at the emulated disk's pace where one is).
pub(super) fn disk_rate(path: &Path) -> Result<f64> {
    use folio_models::kv_cache::{open_for_reads, read_paced};
    let (file, _) = open_for_reads(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let reads = (PROBE_BYTES.min(len) / PROBE_READ as u64).max(1) as usize;
    let started = Instant::now();
    (0..reads).into_par_iter().try_for_each_init(
        || memmap2::MmapMut::map_anon(PROBE_READ),
        |buf, i| -> Result<()> {
            let buf = buf.as_mut().map_err(|e| Error::Invalid(format!("a read buffer: {e}")))?;
            let at = i as u64 * PROBE_READ as u64;
            let need = (len - at).min(PROBE_READ as u64) as usize;
            read_paced(&file, buf, at, need).map_err(|e| Error::io(path, e))
        },
    )?;
    let bytes = (reads as u64 * PROBE_READ as u64).min(len);
    Ok(bytes as f64 / started.elapsed().as_secs_f64())
}

/// What the file tier did in a run's timed steps, per step.
#[derive(Serialize)]
pub struct FileSteps {
    pub cache_bytes: u64,
    /// Of the host memory the tier took, the keys read into it (the cache then holds values).
    pub keys_in_memory: u64,
    /// Of it, the fp8 rows' scales (read into memory when the tier opened), and the blocks the
    /// cache holds.
    pub scales_in_memory: u64,
    pub slots: u64,
    /// Reads bypassed the page cache (else a disk was emulated, or the file system refused: the
    /// rate may be memory's).
    pub direct: bool,
    /// The disk emulated (`--disk-gbps`, `--disk-iops`): its rate in bytes/s and reads/s; and
    /// the reads in the timed steps that took longer than it would have (the file was not all
    /// in the page cache: the emulation ran slower than asked).
    pub emulated_disk: Option<(f64, f64)>,
    pub late_reads: u64,
    /// The disk's sequential read rate measured in this run, bytes/s.
    pub disk_bandwidth: f64,
    pub disk_bytes_per_step: f64,
    pub disk_reads_per_step: f64,
    /// The bytes read ÷ the seconds spent reading them (reads in parallel overlap; read-aheads
    /// overlapping each other count their seconds each: a lower bound).
    pub disk_rate: f64,
    /// Milliseconds a step's gathers spent reading (the step waited for them), and those the
    /// read-aheads spent (beside the device's work), with the blocks they placed.
    pub disk_read_ms_per_step: f64,
    pub ahead_read_ms_per_step: f64,
    pub ahead_blocks_per_step: f64,
    /// A read-ahead's mean milliseconds from asked for to positions in hand, and from then to
    /// done.
    pub ahead_start_ms: f64,
    pub ahead_wall_ms: f64,
    /// Reads and bytes a step read of a method's state on disk beside the rows (MagicPIG's
    /// bucket lists: one read per query head and table), apart from the rows' above.
    pub state_reads_per_step: f64,
    pub state_bytes_per_step: f64,
    /// The disk bytes (rows and state) at the measured sequential rate: the step's floor on
    /// this tier.
    pub disk_floor_ms: f64,
    pub blocks_per_step: f64,
    /// Of the steps' gathers, the share the device read from the cache (their blocks all had a
    /// slot; the others were widened by the CPU); none when no gather was asked for.
    pub device_gathers: Option<f64>,
    /// Blocks found in the cache ÷ blocks asked for (none when no block was asked for).
    pub hit_rate: Option<f64>,
    /// Of the blocks a step's picks used, the share the section's previous picks used too
    /// (none when no block was picked).
    pub step_overlap: Option<f64>,
}

/// Milliseconds a time, of `seconds` over `times` (0 when none).
fn mean_ms(seconds: f64, times: u64) -> f64 {
    if times == 0 {
        0.0
    } else {
        seconds * 1e3 / times as f64
    }
}

/// [`FileSteps`] from the tier's counts before and after `steps` timed steps.
pub(super) fn per_step(before: &FileStats, after: &FileStats, steps: usize, disk_bandwidth: f64) -> FileSteps {
    let per = |a: u64, b: u64| (a - b) as f64 / steps as f64;
    let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
    let bytes = after.bytes_read - before.bytes_read;
    let seconds = after.read_seconds - before.read_seconds;
    let ahead = after.ahead_seconds - before.ahead_seconds;
    FileSteps {
        cache_bytes: after.cache_bytes,
        keys_in_memory: after.keys_in_memory,
        scales_in_memory: after.scales_in_memory,
        slots: after.slots,
        direct: after.direct,
        emulated_disk: folio_runtime::disk::rate().map(|r| (r.bytes_per_s, r.reads_per_s)),
        late_reads: after.late_reads - before.late_reads,
        disk_bandwidth,
        disk_bytes_per_step: per(after.bytes_read, before.bytes_read),
        disk_reads_per_step: per(after.reads, before.reads),
        disk_rate: if seconds + ahead > 0.0 { bytes as f64 / (seconds + ahead) } else { 0.0 },
        disk_read_ms_per_step: seconds * 1e3 / steps as f64,
        ahead_read_ms_per_step: ahead * 1e3 / steps as f64,
        ahead_blocks_per_step: per(after.blocks_ahead, before.blocks_ahead),
        ahead_start_ms: mean_ms(
            after.ahead_start_seconds - before.ahead_start_seconds,
            after.read_aheads - before.read_aheads,
        ),
        ahead_wall_ms: mean_ms(
            after.ahead_wall_seconds - before.ahead_wall_seconds,
            after.read_aheads - before.read_aheads,
        ),
        state_reads_per_step: per(after.spill_reads, before.spill_reads),
        state_bytes_per_step: per(after.spill_bytes, before.spill_bytes),
        disk_floor_ms: (per(after.bytes_read, before.bytes_read) + per(after.spill_bytes, before.spill_bytes))
            / disk_bandwidth
            * 1e3,
        blocks_per_step: per(after.blocks, before.blocks),
        device_gathers: ratio(after.device_gathers - before.device_gathers, after.gathers - before.gathers),
        hit_rate: ratio(after.hits - before.hits, after.blocks - before.blocks),
        step_overlap: ratio(after.step_again - before.step_again, after.step_blocks - before.step_blocks),
    }
}
