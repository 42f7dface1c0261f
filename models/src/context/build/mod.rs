//! Writing a context file: layer-major prefill into a page-aligned file, with checkpoints
//! between layers and an atomic rename at the end.
//!
//! Everything in flight lives in `<out>.partial/` next to the output:
//!
//! * `context.tmp`: the future file, preallocated to its final size (so a full disk is found
//!   before any work, not after an hour); token ids and spans written first, each layer's K
//!   and V written when the layer finishes (on a thread, beside the next layer); the header last.
//! * `hidden-0.bin`, `hidden-1.bin`: the hidden states a checkpoint resumes from. The hidden
//!   states between layers live on the device, in RAM or in these files (`HiddenPlace`,
//!   `crate::prefill`); in files, every layer writes one and reads the other; elsewhere a
//!   checkpoint copies a finished layer's states into the file its checkpoint does not name.
//! * `checkpoint.json`: the job (the header with blank K/V checksums), the chunk size, how
//!   many layers are done with their checksums, which hidden file holds the states the next
//!   layer reads, and their checksum. Replaced atomically.
//! * `lock`: held while a prefill runs, so two processes never write one output.
//!
//! When to checkpoint: with the hidden states in files, after every layer (they are on disk
//! anyway). On the device or in RAM, when the work since the last checkpoint is
//! [`CHECKPOINT_COST_FACTOR`] times what one costs (a small model: every layer; a 7B model at
//! 1M tokens, 7 GiB of hidden states: every couple of minutes), written beside the next layers;
//! and always when a layer fails or is cancelled (the last finished layer first), so Ctrl-C
//! loses nothing. A kill -9 loses the layers since the last checkpoint. The last layer has no
//! checkpoint of its own: the file is finished right after it.
//!
//! A layer's bytes are not fsynced before its checkpoint: a 7B model writes 7 GiB of hidden
//! states a layer at 1M tokens, and a cloud volume at ~130 MB/s would hold every checkpoint for
//! close to a minute of flushing. A killed process loses nothing it checkpointed (its writes are
//! in the page cache); an OS crash or power cut may lose pages the checkpoint vouches for, so a
//! resume first checks every checksum the checkpoint names and starts over on a mismatch. The
//! finished file is fsynced before its rename. Each layer's K/V sections start their way to
//! the disk as soon as they are written (write-back, not waited for), so that final fsync waits
//! for the last layer's bytes rather than the whole file's: at 128k tokens of a 7B model, 3.9 GB
//! of dirty pages flushed at the end held the finished prefill ~1.5 s.
//!
//! A killed prefill resumes from its checkpoint's layer; the computation is deterministic and
//! the chunking is pinned by the checkpoint, so the resumed file is byte-identical to an
//! uninterrupted run, wherever the hidden states lived in either. A failure removes the partial
//! folder when nothing in it is worth resuming (no finished layer) or the disk is full; a
//! cancel, or a failure after finished layers, keeps it and says to rerun; another job's
//! folder, or one whose resume this run refuses, is left alone. An existing `out` is only ever
//! replaced by a rename of a complete, fsynced file.

use std::fs::File;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use folio_runtime::device::Queued;
use serde::Serialize;

use folio_context_file::atomic::check_replaceable;
use folio_context_file::format::{Header, ModelStamp};
use folio_context_file::partial::{partial_dir, read_checkpoint, Checkpoint};
use folio_context_file::{ContextFile, KvDtype};

use super::cost::{PrefillCost, Timed};
use super::prompt::PrefixPlan;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::prefill::{plan_chunk, PrefillMode};

mod job;
mod persist;

#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub kv_dtype: KvDtype,
    /// Bytes the prefill's working set may use beyond the model weights (`None`: default chunk).
    pub memory_budget: Option<u64>,
    /// Discard an interrupted prefill of `out` that does not match this one.
    pub restart: bool,
    /// Where the hidden states between layers live (`None`: the device when they fit the
    /// budget, else RAM when it has room, else files; see `crate::prefill`).
    pub hidden_in: Option<HiddenPlace>,
    /// The cost fitted by the last prefill of the same kind (`prefill`) with this model on this
    /// device (the library keeps one per kind): the ETA until this run has timed enough of its
    /// own chunks. A dense prefill's cost would make a sparse one's ETA several times too long.
    pub prior_cost: Option<PrefillCost>,
    /// How the tokens computed here attend (the file records it).
    pub prefill: PrefillMode,
}

impl BuildOptions {
    /// A new context's dense prefill in `kv_dtype`: the default chunk, the hidden states where
    /// they fit, no interrupted prefill discarded, no earlier cost known.
    pub fn new(kv_dtype: KvDtype) -> Self {
        Self {
            kv_dtype,
            memory_budget: None,
            restart: false,
            hidden_in: None,
            prior_cost: None,
            prefill: PrefillMode::Dense,
        }
    }
}

/// Where a prefill keeps the hidden states between layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HiddenPlace {
    Device,
    Ram,
    Files,
}

/// Where a prefill stands, after each chunk.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Progress {
    pub layer: usize,
    pub layers: usize,
    /// Tokens of the current layer done.
    pub layer_tokens: usize,
    pub tokens: usize,
    /// Share of the whole prefill done, 0..=1.
    pub fraction: f64,
    /// Token-layers per second in this run, divided by the layer count: prompt tokens per second.
    pub tokens_per_s: f64,
    pub eta_s: Option<f64>,
}

/// Where a prefill's time went, in seconds of this run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageSeconds {
    /// The layers' forward passes, with the hidden states' trips to and from the device: on a
    /// GPU the device's time from the end of one layer to the end of the next (events), which
    /// includes any time the device idled while the host was held up (a checkpoint's copy, a
    /// store joined at once where the hidden states are files).
    pub compute: f64,
    /// Reading, writing and hashing the hidden-state files.
    pub hidden_io: f64,
    /// Queueing the K/V's encode to the file's dtype (on a GPU; the copy to the host runs on
    /// the writer's thread beside the next layer), or the encode itself on the host.
    pub encode: f64,
    /// Waiting for sections to be copied off the device, written and checksummed, once the
    /// device has finished their layer; checkpoints, the final fsyncs and rename.
    pub store: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BuildReport {
    pub path: PathBuf,
    pub tokens: usize,
    /// Tokens this prefill computed: all of them, or only the new ones when growing a context.
    pub computed_tokens: usize,
    pub layers: usize,
    pub documents: usize,
    pub kv_dtype: KvDtype,
    /// How the computed tokens attended ([`PrefillMode::name`]).
    pub prefill: String,
    pub file_bytes: u64,
    pub seconds: f64,
    /// Prompt tokens per second over the layers computed in this run.
    pub tokens_per_s: f64,
    /// Layers already done by an interrupted run this one resumed.
    pub resumed_layers: usize,
    pub chunk: usize,
    pub working_set_bytes: u64,
    /// Greedy next token after the documents (from the only LM-head call of the prefill).
    pub next_token: u32,
    pub stages: StageSeconds,
    /// Where the hidden states between layers lived.
    pub hidden_in: HiddenPlace,
    /// Checkpoints written by this run (resumable points; files mode writes one per layer).
    pub checkpoints: usize,
    /// The cost fitted to this run's timed chunks: the next estimate's and ETA's of its kind
    /// (none from a sparse run too short to say how a long one goes: `PrefillMode::keeps_fit`).
    pub cost: Option<PrefillCost>,
}

/// Hidden states in RAM or on the device are written to a hidden file for a checkpoint when the
/// work since the last one is at least this many times what a checkpoint costs (measured; at
/// first estimated at [`INITIAL_PERSIST_RATE`]): a small model checkpoints about every layer, a
/// 7B model at a million tokens (7 GiB of hidden states) every couple of minutes. The write runs
/// beside the next layers; a cancel or a failure checkpoints the last finished layer first.
const CHECKPOINT_COST_FACTOR: f64 = 20.0;
/// Bytes per second a checkpoint's hidden states are first assumed to be written at.
const INITIAL_PERSIST_RATE: f64 = 1e9;
/// RAM left to everything else when the hidden states are kept in RAM.
const RAM_HEADROOM: u64 = 4 << 30;
/// Copies of the hidden states RAM must hold: two stores, and a checkpoint's snapshot still
/// being written while its store is rewritten.
const RAM_HIDDEN_COPIES: u64 = 3;
/// Sections before the layers' K and V in a context file (token ids, document spans).
const SECTIONS_BEFORE_LAYERS: usize = 2;

/// Tries to take a partial folder's lock a few times: [`pending`] holds it for an instant to
/// tell whether a prefill runs, which must not make a starting prefill give up.
fn take_lock(lock: &File) -> bool {
    const TRIES: u32 = 20;
    const PAUSE: std::time::Duration = std::time::Duration::from_millis(25);
    for _ in 0..TRIES {
        if <File as fs4::FileExt>::try_lock(lock).is_ok() {
            return true;
        }
        std::thread::sleep(PAUSE);
    }
    false
}

/// Prefills `plan` with `model` into the context file `out`. See the module docs.
pub fn build(
    model: &Model,
    stamp: &ModelStamp,
    plan: &PrefixPlan,
    out: &Path,
    opts: &BuildOptions,
    on_progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>,
) -> Result<BuildReport> {
    logged("prefill", out, build_job(model, stamp, None, plan, out, opts, on_progress))
}

/// Logs how a prefill ended (its figures, never the documents' text) and passes it on.
fn logged(kind: &str, out: &Path, report: Result<BuildReport>) -> Result<BuildReport> {
    let path = out.display();
    match &report {
        Ok(r) => tracing::info!(
            kind, %path, tokens = r.tokens, computed_tokens = r.computed_tokens, layers = r.layers,
            resumed_layers = r.resumed_layers, documents = r.documents, kv_dtype = r.kv_dtype.name(),
            seconds = r.seconds, tokens_per_s = r.tokens_per_s, file_bytes = r.file_bytes, "context written"
        ),
        Err(error @ (Error::Cancelled(_) | Error::Resumable { .. })) => tracing::info!(kind, %path, %error, "stopped"),
        Err(error) => tracing::warn!(kind, %path, %error, "failed"),
    }
    report
}

/// Grows the saved context `base` into `out` (which may be `base`'s own path: the new version
/// replaces it atomically, and `base` stays readable until then): `plan` is `base`'s tokens
/// followed by new documents (`Engine::plan_append`), and only the new tokens are computed —
/// attention is causal, so every saved K/V row stays what a prefill of everything would have
/// computed. Resumable like [`build`]: run it again with the same base and documents.
pub fn append(
    model: &Model,
    stamp: &ModelStamp,
    base: &ContextFile,
    plan: &PrefixPlan,
    out: &Path,
    opts: &BuildOptions,
    on_progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>,
) -> Result<BuildReport> {
    let keep = Base { file: base, keep: base.tokens().len() };
    extend(model, stamp, keep, plan, out, opts, on_progress)
}

/// What a prefill takes from a saved context: its first `keep` tokens, K/V as saved.
#[derive(Clone, Copy)]
pub struct Base<'a> {
    pub file: &'a ContextFile,
    pub keep: usize,
}

/// The saved context `base.file` cut after `base.keep` tokens and continued with `plan`'s
/// tokens after them, written to `out` (which may be the base's own path): only the tokens
/// after `keep` are computed. [`append`] keeps every token; removing a document keeps the
/// tokens before it and re-prefills the documents after it (`Engine::plan_keeping`).
pub fn extend(
    model: &Model,
    stamp: &ModelStamp,
    base: Base<'_>,
    plan: &PrefixPlan,
    out: &Path,
    opts: &BuildOptions,
    on_progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>,
) -> Result<BuildReport> {
    let kind = if base.keep == base.file.tokens().len() { "append" } else { "change" };
    let Base { file: base, keep } = base;
    let h = base.header();
    let bad = |msg: String| Error::Context { path: base.path().to_owned(), msg };
    let differences = h.model.fingerprint.differences(&stamp.fingerprint);
    if !differences.is_empty() {
        return Err(bad(format!(
            "it was made with model {} and this is {} ({}): use --model {}",
            h.model.name,
            stamp.name,
            differences.join(", "),
            h.model.source
        )));
    }
    if h.kv_dtype != opts.kv_dtype {
        return Err(bad(format!("it stores {} K/V: use --kv-dtype {}", h.kv_dtype.name(), h.kv_dtype.name())));
    }
    let saved = &base.tokens()[..keep.min(base.tokens().len())];
    if keep > base.tokens().len() || !plan.tokens.starts_with(saved) || plan.tokens.len() <= keep {
        return Err(bad(format!("the new plan does not continue its first {keep} tokens with new ones")));
    }
    let base = (keep > 0).then_some(Base { file: base, keep });
    logged(kind, out, build_job(model, stamp, base, plan, out, opts, on_progress))
}

fn build_job(
    model: &Model,
    stamp: &ModelStamp,
    base: Option<Base<'_>>,
    plan: &PrefixPlan,
    out: &Path,
    opts: &BuildOptions,
    on_progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>,
) -> Result<BuildReport> {
    let cfg = model.config();
    cfg.check_fits(plan.tokens.len())?;
    // Before minutes of compute, not at the final rename.
    check_replaceable(out)?;
    if plan.tokens.is_empty() {
        return Err(Error::Invalid("nothing to prefill: the context has no tokens".into()));
    }
    opts.prefill.check(cfg, &stamp.name)?;
    let docs_json = serde_json::to_vec(&plan.documents).map_err(|e| Error::Invalid(e.to_string()))?;
    let shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
    let mut job = Header::new(
        stamp.clone(),
        opts.kv_dtype,
        plan.tokens.len(),
        docs_json.len() as u64,
        shape,
        plan.prompt.clone(),
    );
    match &base {
        Some(b) => job.record_prefill(&b.file.header().prefill_runs(), b.keep, &opts.prefill.name()),
        None => job.record_prefill(&[], 0, &opts.prefill.name()),
    }
    let kv_section = opts.kv_dtype.max_section_bytes(cfg.num_kv_heads * plan.tokens.len(), cfg.head_dim);
    let chunk_plan = plan_chunk(model, plan.tokens.len(), (kv_section, opts.prefill), opts.memory_budget)?;
    let dir = partial_dir(out);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let lock_path = dir.join("lock");
    let lock = File::create(&lock_path).map_err(|e| Error::io(&lock_path, e))?;
    if !take_lock(&lock) {
        return Err(Error::Invalid(format!("another folio prefill is writing {} right now", out.display())));
    }
    let mut job_run = Job {
        model,
        plan,
        base,
        out,
        dir: &dir,
        job,
        docs_json,
        chunk: chunk_plan.chunk,
        prefill: opts.prefill,
        on_progress,
        owns_dir: false,
    };
    let result = job_run.run(opts);
    // Success removes the folder (the file is renamed out of it). A failure removes it when it
    // is this job's and holds nothing worth resuming, or when the disk is full (the scratch
    // space is what filled it); a cancel, or a failure after finished layers, keeps it for a
    // rerun and says so; another job's folder (a refused resume) is never touched.
    let result = match result {
        Ok(report) => {
            let _ = std::fs::remove_dir_all(&dir);
            Ok(report)
        }
        Err(e) if !job_run.owns_dir => Err(e),
        Err(e) => {
            let checkpointed =
                read_checkpoint(&dir.join("checkpoint.json")).ok().flatten().map_or(0, |cp| cp.layers_done);
            let keep = match e {
                Error::Cancelled(_) => true,
                Error::DiskFull { .. } => false,
                _ => checkpointed > 0,
            };
            if keep {
                Err(Error::Resumable { error: Box::new(e), dir: dir.clone() })
            } else {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    };
    drop(lock);
    result
}

/// One prefill into a partial folder: what it computes, where it writes, whom it reports to.
struct Job<'a> {
    model: &'a Model,
    plan: &'a PrefixPlan,
    /// The saved context this job continues: its kept tokens' K/V is read, not computed.
    base: Option<Base<'a>>,
    out: &'a Path,
    dir: &'a Path,
    job: Header,
    docs_json: Vec<u8>,
    chunk: usize,
    /// How the computed tokens attend (the header records it too).
    prefill: PrefillMode,
    on_progress: &'a mut dyn FnMut(&Progress) -> ControlFlow<()>,
    /// The partial folder holds this job (started fresh, or a matching checkpoint resumed).
    owns_dir: bool,
}

/// The files of a partial folder (the module docs say what each holds).
pub(super) struct Paths {
    pub(super) checkpoint: PathBuf,
    pub(super) tmp: PathBuf,
    pub(super) hidden: [PathBuf; 2],
}

impl Paths {
    pub(super) fn in_dir(dir: &Path) -> Self {
        Self {
            checkpoint: dir.join("checkpoint.json"),
            tmp: dir.join("context.tmp"),
            hidden: [dir.join("hidden-0.bin"), dir.join("hidden-1.bin")],
        }
    }
}

/// Where a run stands: what its checkpoint holds, the checksums of the sections written, the
/// time per stage, and the device's queue marks.
pub(super) struct Ledger {
    pub(super) checkpoint: Checkpoint,
    /// Every section's checksum written so far (the small sections, then K and V per layer).
    pub(super) sections: Vec<String>,
    pub(super) stages: StageSeconds,
    /// Checkpoints written by this run.
    pub(super) checkpoints: usize,
    /// Layers done when the run started.
    pub(super) resumed_layers: usize,
    /// The last layer whose hidden states a checkpoint holds, or is being written for one.
    pub(super) persisted_layer: Option<usize>,
    /// Where the device's queue stood before the first layer and after each: the layers'
    /// device time, read once the work is done.
    pub(super) marks: Vec<Queued>,
    /// The K and V buffers of the previous layer, back from its writer for reuse.
    pub(super) spare: [Vec<u8>; 2],
    /// The stretches of layers this run has timed (the ETA's cost is fitted to them).
    pub(super) timed: Vec<Timed>,
}

impl Ledger {
    /// The hidden file the checkpoint names (the layer parity's when it names none).
    pub(super) fn cp_file(&self) -> usize {
        let done = self.checkpoint.layers_done;
        self.checkpoint.hidden_file.unwrap_or(done.saturating_sub(1) % 2)
    }
}
