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

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::ops::ControlFlow;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Tensor;
use folio_kernels::device::Queued;
use serde::Serialize;

use folio_context_file::atomic::{check_replaceable, sync_dir};
use folio_context_file::partial::{
    open_if_present, partial_dir, read_checkpoint, write_checkpoint, Checkpoint, CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
};
use folio_context_file::{ContextFile, KvDtype};

use super::encode::EncodeTensor;
use super::prompt::PrefixPlan;
use crate::error::{human_bytes, Error, Result};
use crate::model::Model;
use crate::prefill::{
    layer_output, plan_chunk, run_layer, FileHidden, Hidden, HiddenSnapshot, HiddenStore, HostHidden, MemoryHidden,
    RopeTables,
};
use folio_context_file::format::{checksum, file_checksum, Header, ModelStamp, SectionKind};

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
    build_job(model, stamp, None, plan, out, opts, on_progress)
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
    build_job(model, stamp, base, plan, out, opts, on_progress)
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
    let docs_json = serde_json::to_vec(&plan.documents).map_err(|e| Error::Invalid(e.to_string()))?;
    let shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
    let job = Header::new(
        stamp.clone(),
        opts.kv_dtype,
        plan.tokens.len(),
        docs_json.len() as u64,
        shape,
        plan.prompt.clone(),
    );
    let kv_section = opts.kv_dtype.max_section_bytes(cfg.num_kv_heads * plan.tokens.len(), cfg.head_dim);
    let chunk_plan = plan_chunk(model, plan.tokens.len(), kv_section, opts.memory_budget)?;
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
    on_progress: &'a mut dyn FnMut(&Progress) -> ControlFlow<()>,
    /// The partial folder holds this job (started fresh, or a matching checkpoint resumed).
    owns_dir: bool,
}

impl Job<'_> {
    fn compute(&self) -> String {
        format!("{} {:?}", crate::device_name(self.model.device()), self.model.dtype()).to_lowercase()
    }

    /// Whether the checkpoint is this job's: same header, compute, base, and the same token
    /// ids and document spans by checksum (the header records only their sizes, and a resume
    /// must not mix layers of other tokens of the same length).
    fn same_job(&self, cp: &Checkpoint) -> bool {
        let tokens: Vec<u8> = self.plan.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        cp.job == self.job
            && cp.compute == self.compute()
            && cp.base_tokens == self.base_tokens()
            && cp.checksums.first() == Some(&checksum(&tokens))
            && cp.checksums.get(1) == Some(&checksum(&self.docs_json))
    }

    /// Tokens taken from the base context.
    fn base_tokens(&self) -> usize {
        self.base.map_or(0, |b| b.keep)
    }

    /// The tokens this job computes.
    fn computed(&self) -> &[u32] {
        &self.plan.tokens[self.base_tokens()..]
    }

    fn hidden_bytes(&self) -> u64 {
        (self.computed().len() * self.model.config().hidden_size * self.model.dtype().size_in_bytes()) as u64
    }

    /// The base context's K and V of `layer` for its kept tokens, `[kv_heads, keep, head_dim]`
    /// on the device.
    fn prefix(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>> {
        let Some(Base { file, keep }) = self.base else { return Ok(None) };
        let cfg = self.model.config();
        let shape = (cfg.num_kv_heads, file.tokens().len(), cfg.head_dim);
        let (k, v) = file.layer_kv(layer)?;
        let dev = self.model.device();
        let kept = |x: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(x, shape, dev)?.narrow(1, 0, keep)?.contiguous()?.to_dtype(self.model.dtype())?)
        };
        Ok(Some((kept(k)?, kept(v)?)))
    }

    /// Whether the bytes a checkpoint vouches for are on disk as it says: every section written
    /// so far and the hidden states the next layer reads, by checksum.
    fn intact(&self, cp: &Checkpoint, tmp: &Path, hidden_paths: &[PathBuf; 2]) -> Result<bool> {
        let Some(file) = open_if_present(tmp)? else { return Ok(false) };
        for (s, want) in self.job.sections.iter().zip(&cp.checksums) {
            if file_checksum(&file, s.offset, s.bytes).ok().as_ref() != Some(want) {
                return Ok(false);
            }
        }
        if cp.layers_done == 0 {
            return Ok(true);
        }
        let p = &hidden_paths[cp.hidden_file.unwrap_or((cp.layers_done - 1) % 2)];
        let Some(f) = open_if_present(p)? else { return Ok(false) };
        let cfg = self.model.config();
        let stored = FileHidden::new(f, p, cfg.hidden_size, self.model.dtype(), self.model.device());
        Ok(stored.stored_checksum(self.computed().len()).ok().as_ref() == Some(&cp.hidden))
    }

    fn run(&mut self, opts: &BuildOptions) -> Result<BuildReport> {
        let started = Instant::now();
        let cp_path = self.dir.join("checkpoint.json");
        let tmp = self.dir.join("context.tmp");
        let hidden_paths = [self.dir.join("hidden-0.bin"), self.dir.join("hidden-1.bin")];
        let cfg = self.model.config();
        // `t` tokens in the file, `n` of them computed here (all, unless growing a context).
        let (layers, t, n) = (cfg.num_layers, self.plan.tokens.len(), self.computed().len());
        let section = self.job.kv_dtype.max_section_bytes(cfg.num_kv_heads * t, cfg.head_dim);
        let mut checkpoint = match read_checkpoint(&cp_path)? {
            Some(cp) if self.same_job(&cp) => {
                // A resume computes with the chunk it started with (the bytes depend on it):
                // that chunk's working set is what runs, and it must fit today's budget;
                // `--restart` plans anew, otherwise the interrupted prefill is left as it is.
                let need = crate::prefill::chunk_working_set(self.model, t, section, cp.chunk);
                match opts.memory_budget.filter(|&b| need > b && cp.layers_done < layers) {
                    Some(b) if !opts.restart => {
                        return Err(Error::Invalid(format!(
                            "this prefill resumes in chunks of {} tokens, as it started, which need {} of \
                             working memory; the budget is {}: give a budget of at least that, or --restart \
                             to plan it anew",
                            cp.chunk,
                            human_bytes(need),
                            human_bytes(b)
                        )));
                    }
                    Some(_) => {
                        self.owns_dir = true;
                        self.start_fresh(&cp_path, &tmp, &hidden_paths)?
                    }
                    None => {
                        self.owns_dir = true;
                        if self.intact(&cp, &tmp, &hidden_paths)? {
                            cp
                        } else {
                            // What the checkpoint names did not all reach the disk (an OS crash
                            // or a power cut): start over rather than resume from wrong bytes.
                            self.start_fresh(&cp_path, &tmp, &hidden_paths)?
                        }
                    }
                }
            }
            Some(cp) if !opts.restart => return Err(self.mismatch(&cp)),
            _ => {
                self.owns_dir = true;
                self.start_fresh(&cp_path, &tmp, &hidden_paths)?
            }
        };
        self.chunk = checkpoint.chunk;
        let working_set = crate::prefill::chunk_working_set(self.model, t, section, self.chunk);
        let resumed_layers = checkpoint.layers_done;
        let file = OpenOptions::new().read(true).write(true).open(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let place = opts.hidden_in.unwrap_or_else(|| self.hidden_place(working_set, opts.memory_budget));
        // Hidden states on the device are part of its working set.
        let working_set = working_set + if place == HiddenPlace::Device { 2 * self.hidden_bytes() } else { 0 };
        // Store `i` is backed by hidden file `files[i]`: the checkpoint's file must be the store
        // the next layer reads (`layer_output` of the last finished layer).
        let done = checkpoint.layers_done;
        let cp_file = checkpoint.hidden_file.unwrap_or(done.saturating_sub(1) % 2);
        let files = if done == 0 || cp_file == (done - 1) % 2 { [0, 1] } else { [1, 0] };
        let mut hidden = [self.store(place, &hidden_paths[files[0]])?, self.store(place, &hidden_paths[files[1]])?];
        let mut stages = StageSeconds::default();
        if done > 0 && place != HiddenPlace::Files {
            let at = Instant::now();
            let p = &hidden_paths[cp_file];
            let f = File::open(p).map_err(|e| Error::io(p, e))?;
            hidden[(done - 1) % 2].load(&f, p, n, self.chunk)?;
            stages.hidden_io += at.elapsed().as_secs_f64();
        }
        let rope = RopeTables::new(self.model, t - n, n, self.chunk)?;
        let run_start = Instant::now();
        let mut sections = checkpoint.checksums.clone();
        let mut checkpoints = 0;
        let mut persisted_layer = done.checked_sub(1);
        // The last checkpoint's time, and what the next one is expected to cost.
        let (mut since, mut persist_cost) = (Instant::now(), self.hidden_bytes() as f64 / INITIAL_PERSIST_RATE);
        // Where the device's queue stood before the first layer and after each: the layers'
        // device time, read once the work is done. The host does not wait for a layer before
        // queueing the next, so the device never idles between layers.
        let mut marks = vec![Queued::timed(self.model.device())?];
        let outcome = std::thread::scope(|scope| -> Result<()> {
            let mut in_flight: Option<Persist<'_>> = None;
            let mut store_in_flight: Option<StoreWriter<'_>> = None;
            // The K and V buffers of the previous layer, back from its writer for reuse.
            let mut spare: [Vec<u8>; 2] = Default::default();
            for layer in done..layers {
                let prefix = self.prefix(layer)?;
                let (done_before, on_progress) = ((layer - resumed_layers) * n, &mut self.on_progress);
                let mut report = |tokens: usize| {
                    let secs = run_start.elapsed().as_secs_f64().max(1e-9);
                    let rate = (done_before + tokens) as f64 / secs;
                    let left = ((layers - layer) * n - tokens) as f64;
                    on_progress(&Progress {
                        layer,
                        layers,
                        layer_tokens: tokens,
                        tokens: n,
                        fraction: (layer * n + tokens) as f64 / (layers * n) as f64,
                        tokens_per_s: rate / layers as f64,
                        eta_s: (rate > 0.0).then(|| left / rate),
                    })
                };
                let at = Instant::now();
                let computed = &self.plan.tokens[t - n..];
                let result = run_layer(self.model, layer, computed, prefix.as_ref(), &mut hidden, &rope, &mut report);
                let (k, v) = match result {
                    Ok(kv) => kv,
                    Err(e) => {
                        // Keep the last finished layer before giving up (a cancel is resumed
                        // from it). Best effort: the error reported is the layer's, and a
                        // failure here leaves the previous checkpoint as it was.
                        let mut keep = || -> Result<()> {
                            if let Some(w) = store_in_flight.take() {
                                sections.extend(self.finish_store(w, &marks, &tmp, &mut stages, &mut spare)?);
                            }
                            if let Some(p) = in_flight.take() {
                                let (cp, st, n) = (&mut checkpoint, &mut stages, &mut checkpoints);
                                self.finish_persist(p, cp, &cp_path, &sections, st, n)?;
                            }
                            let last = layer.checked_sub(1).filter(|&l| persisted_layer != Some(l));
                            if let (Some(l), true) = (last, place != HiddenPlace::Files) {
                                let free = 1 - checkpoint.hidden_file.unwrap_or(cp_file);
                                let p = self.start_persist(&hidden, l, free, &hidden_paths, scope, &mut stages)?;
                                let (cp, st, n) = (&mut checkpoint, &mut stages, &mut checkpoints);
                                self.finish_persist(p, cp, &cp_path, &sections, st, n)?;
                            }
                            Ok(())
                        };
                        let _ = keep();
                        return Err(e);
                    }
                };
                // On a GPU the layer is queued, not done: the time here is the host's, and the
                // device's replaces it at the end (`marks`).
                stages.compute += at.elapsed().as_secs_f64();
                // The layer before's K and V reach the file (their copies run beside this
                // layer, once the device has finished that one): their buffers are free for
                // this layer's. The wait for the device is not the store's.
                if let Some(w) = store_in_flight.take() {
                    sections.extend(self.finish_store(w, &marks, &tmp, &mut stages, &mut spare)?);
                }
                marks.push(Queued::timed(self.model.device())?);
                // The layer's K and V in the file's dtype, encoded where they are; copied to the
                // host and written to the file by a thread of their own, beside the next layer's
                // compute (`PendingSection::finish_into`).
                let at = Instant::now();
                let mut pieces = Vec::with_capacity(2);
                for (i, (kind, x)) in [(SectionKind::Keys, k), (SectionKind::Values, v)].into_iter().enumerate() {
                    let pending = self.job.kv_dtype.codec(kind).start_encode(&x, self.model.config().head_dim)?;
                    let s = self.job.section(kind, Some(layer)).expect("every layer has K and V sections");
                    pieces.push((s.offset, pending, std::mem::take(&mut spare[i])));
                }
                stages.encode += at.elapsed().as_secs_f64();
                let f = &file;
                store_in_flight = Some(scope.spawn(move || {
                    // K and V side by side, each copied, written and hashed on a thread of its
                    // own: nothing hides the last layer's store (or one slower than a layer).
                    let done: Vec<_> = std::thread::scope(|s| {
                        let each = pieces.into_iter().map(|(at, pending, mut bytes)| {
                            s.spawn(move || {
                                let written =
                                    pending.finish_into(&mut bytes).map_err(StoreError::Encode).and_then(|()| {
                                        f.write_all_at(&bytes, at).map_err(StoreError::Write)?;
                                        start_write_back(f, at, bytes.len());
                                        Ok(checksum(&bytes))
                                    });
                                (written, bytes)
                            })
                        });
                        let each: Vec<_> = each.collect();
                        each.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
                    });
                    let (sums, buffers): (Vec<_>, Vec<_>) = done.into_iter().unzip();
                    (sums.into_iter().collect(), buffers)
                }));
                if layer + 1 == layers {
                    break;
                }
                if place == HiddenPlace::Files {
                    // The files are the stores: every layer's output is on disk as it is written.
                    // No fsync here: the checkpoint names the checksums of what the resume will
                    // read, and a resume checks them (see `intact`).
                    if let Some(w) = store_in_flight.take() {
                        sections.extend(self.finish_store(w, &marks, &tmp, &mut stages, &mut spare)?);
                    }
                    let at = Instant::now();
                    checkpoint.hidden = hidden[layer % 2]
                        .written_checksum(n)
                        .ok_or_else(|| Error::Invalid(format!("layer {layer} wrote its hidden states out of order")))?;
                    checkpoint.hidden_file = Some(files[layer % 2]);
                    checkpoint.layers_done = layer + 1;
                    checkpoint.checksums = sections.clone();
                    write_checkpoint(&cp_path, &checkpoint)?;
                    checkpoints += 1;
                    persisted_layer = Some(layer);
                    stages.store += at.elapsed().as_secs_f64();
                    continue;
                }
                if let Some(p) = in_flight.take_if(|p| p.writer.is_finished()) {
                    // (Its layer is an earlier one: its sections were collected when the next
                    // layer's writer started.)
                    persist_cost =
                        self.finish_persist(p, &mut checkpoint, &cp_path, &sections, &mut stages, &mut checkpoints)?;
                    since = Instant::now();
                }
                // A checkpoint when the work since the last one is worth its cost many times
                // over (CHECKPOINT_COST_FACTOR).
                if in_flight.is_none() && since.elapsed().as_secs_f64() >= CHECKPOINT_COST_FACTOR * persist_cost {
                    let free = 1 - checkpoint.hidden_file.unwrap_or(cp_file);
                    in_flight = Some(self.start_persist(&hidden, layer, free, &hidden_paths, scope, &mut stages)?);
                    persisted_layer = Some(layer);
                }
            }
            if let Some(w) = store_in_flight.take() {
                sections.extend(self.finish_store(w, &marks, &tmp, &mut stages, &mut spare)?);
            }
            // The finished file does not need the last checkpoint's hidden states.
            if let Some(p) = in_flight.take() {
                let _ = p.writer.join();
            }
            Ok(())
        });
        outcome?;
        // The device's time for the layers, where it has a queue (the host's time on the CPU).
        let device_secs = marks.windows(2).map(|m| Ok(m[1].seconds_since(&m[0])?)).sum::<Result<Option<f64>>>()?;
        if let Some(secs) = device_secs {
            stages.compute = secs;
        }
        checkpoint.checksums = sections;
        let at = Instant::now();
        let last = layer_output(&hidden, layers - 1).read(n - 1, 1)?;
        let next_token = self.model.head(&last)?.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        let header = self.finished_header(&checkpoint)?;
        self.write_at(&file, &tmp, 0, &header.encode())?;
        sync(&file, &tmp)?;
        drop(file);
        // The checkpoint goes first: a crash between the two leaves a folder that starts over,
        // never a checkpoint whose context.tmp has already been renamed away.
        std::fs::remove_file(&cp_path).map_err(|e| Error::io(&cp_path, e))?;
        sync_dir(&cp_path)?;
        check_replaceable(self.out)?;
        std::fs::rename(&tmp, self.out).map_err(|e| Error::io(self.out, e))?;
        sync_dir(self.out)?;
        let computed = (layers - resumed_layers) * n;
        let run_secs = run_start.elapsed().as_secs_f64();
        stages.store += at.elapsed().as_secs_f64();
        // File stores do their I/O inside the forward passes: counted there, moved here. (The
        // final row read for the LM head counts in both; clamp the rounding.)
        let file_io: f64 = hidden.iter().map(|h| h.io_time().as_secs_f64()).sum();
        stages.hidden_io += file_io;
        stages.compute = (stages.compute - file_io).max(0.0);
        Ok(BuildReport {
            path: self.out.to_owned(),
            tokens: t,
            computed_tokens: n,
            layers,
            documents: self.plan.documents.len(),
            kv_dtype: header.kv_dtype,
            file_bytes: header.file_bytes,
            seconds: started.elapsed().as_secs_f64(),
            tokens_per_s: if run_secs > 0.0 { computed as f64 / layers as f64 / run_secs } else { 0.0 },
            resumed_layers,
            chunk: self.chunk,
            working_set_bytes: working_set,
            next_token,
            stages,
            hidden_in: place,
            checkpoints,
        })
    }

    /// Where the hidden states go when the caller does not say. On a GPU: the device when both
    /// stores fit the budget beside the working set, RAM when it has room for both, else files
    /// (the trips through files were most of a 7B prefill there). On the CPU, files: compute
    /// dominates, the page cache makes them nearly free, RAM stays for the model and its K/V,
    /// and every layer is a checkpoint.
    fn hidden_place(&self, working_set: u64, budget: Option<u64>) -> HiddenPlace {
        let both = 2 * self.hidden_bytes();
        if !self.model.device().is_cuda() {
            HiddenPlace::Files
        } else if budget.is_some_and(|b| working_set + both <= b) {
            HiddenPlace::Device
        } else if crate::host_memory::available()
            .is_some_and(|free| free >= RAM_HIDDEN_COPIES * self.hidden_bytes() + RAM_HEADROOM)
        {
            HiddenPlace::Ram
        } else {
            HiddenPlace::Files
        }
    }

    /// An empty store of `place` (a file store writes `path`).
    fn store(&self, place: HiddenPlace, path: &Path) -> Result<HiddenStore> {
        let (cfg, n) = (self.model.config(), self.computed().len());
        let (dtype, device) = (self.model.dtype(), self.model.device());
        Ok(match place {
            HiddenPlace::Device => HiddenStore::Device(MemoryHidden::new(n, cfg.hidden_size, dtype, device)?),
            HiddenPlace::Ram => HiddenStore::Host(HostHidden::new(n, self.chunk, cfg.hidden_size, dtype, device)),
            HiddenPlace::Files => {
                let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| Error::io(path, e))?;
                HiddenStore::File(Box::new(FileHidden::new(f, path, cfg.hidden_size, dtype, device)))
            }
        })
    }

    /// Starts writing layer `layer`'s output (`layer_output`) to hidden file `file` on a thread
    /// of `scope`: the copy off the device happens here, the disk write beside the next layers.
    fn start_persist<'scope>(
        &self,
        hidden: &[HiddenStore; 2],
        layer: usize,
        file: usize,
        paths: &[PathBuf; 2],
        scope: &'scope std::thread::Scope<'scope, '_>,
        stages: &mut StageSeconds,
    ) -> Result<Persist<'scope>> {
        let at = Instant::now();
        let snapshot: HiddenSnapshot = layer_output(hidden, layer)
            .snapshot(self.computed().len())?
            .ok_or_else(|| Error::Invalid("internal: a file store has no snapshot to persist".into()))?;
        let snapshot_secs = at.elapsed().as_secs_f64();
        stages.hidden_io += snapshot_secs;
        let path = paths[file].clone();
        let f = OpenOptions::new().write(true).open(&path).map_err(|e| self.io(&path, e))?;
        let writer = scope.spawn(move || {
            let at = Instant::now();
            snapshot.write_to(&f).map(|sum| (sum, at.elapsed().as_secs_f64()))
        });
        Ok(Persist { layer, file, path, snapshot_secs, writer })
    }

    /// Waits for a layer's K/V sections to reach the file; their checksums. Their buffers go
    /// back to `spare`. The writer's layer is the last one `marks` ends: the wait for the device
    /// to finish it is the layer's time, not the store's.
    fn finish_store(
        &self,
        w: StoreWriter<'_>,
        marks: &[Queued],
        tmp: &Path,
        stages: &mut StageSeconds,
        spare: &mut [Vec<u8>; 2],
    ) -> Result<Vec<String>> {
        marks.last().map(Queued::wait).transpose()?;
        let at = Instant::now();
        let (written, buffers) = w.join().map_err(|_| Error::Invalid("the K/V writer panicked".into()))?;
        stages.store += at.elapsed().as_secs_f64();
        for (slot, b) in spare.iter_mut().zip(buffers) {
            *slot = b;
        }
        written.map_err(|e| match e {
            StoreError::Encode(e) => e,
            StoreError::Write(e) => self.io(tmp, e),
        })
    }

    /// Waits for a persist and writes the checkpoint it makes resumable: layers up to its
    /// layer done, their sections' checksums (every section up to it must be written), its
    /// hidden file. Returns what the checkpoint cost: the copy off the device and the write.
    fn finish_persist(
        &self,
        p: Persist<'_>,
        checkpoint: &mut Checkpoint,
        cp_path: &Path,
        sections: &[String],
        stages: &mut StageSeconds,
        checkpoints: &mut usize,
    ) -> Result<f64> {
        let at = Instant::now();
        let written = p.writer.join().map_err(|_| Error::Invalid("the hidden-state writer panicked".into()))?;
        let (sum, write_secs) = written.map_err(|e| self.io(&p.path, e))?;
        checkpoint.hidden = sum;
        checkpoint.hidden_file = Some(p.file);
        checkpoint.layers_done = p.layer + 1;
        checkpoint.checksums = sections[..SECTIONS_BEFORE_LAYERS + 2 * (p.layer + 1)].to_vec();
        write_checkpoint(cp_path, checkpoint)?;
        *checkpoints += 1;
        stages.store += at.elapsed().as_secs_f64();
        Ok(p.snapshot_secs + write_secs)
    }

    /// A new partial folder: preallocated files, the small sections, checkpoint at layer 0.
    fn start_fresh(&self, cp_path: &Path, tmp: &Path, hidden_paths: &[PathBuf; 2]) -> Result<Checkpoint> {
        for p in [cp_path, tmp, &hidden_paths[0], &hidden_paths[1]] {
            match std::fs::remove_file(p) {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(Error::io(p, e)),
                _ => {}
            }
        }
        let needed = self.job.file_bytes + 2 * self.hidden_bytes();
        if let Ok(free) = fs4::available_space(self.dir) {
            if free < needed {
                return Err(self.disk_full(format!("{} free", human_bytes(free))));
            }
        }
        let file = self.create(tmp, self.job.file_bytes)?;
        for p in hidden_paths {
            self.create(p, self.hidden_bytes())?;
        }
        let tokens: Vec<u8> = self.plan.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        for (kind, bytes) in [(SectionKind::Tokens, &tokens), (SectionKind::Documents, &self.docs_json)] {
            let s = self.job.section(kind, None).expect("the layout has the small sections");
            self.write_at(&file, tmp, s.offset, bytes)?;
        }
        sync(&file, tmp)?;
        let cp = Checkpoint {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            job: self.job.clone(),
            compute: self.compute(),
            chunk: self.chunk,
            layers_done: 0,
            checksums: vec![checksum(&tokens), checksum(&self.docs_json)],
            hidden: String::new(),
            hidden_file: None,
            base_tokens: self.base_tokens(),
        };
        write_checkpoint(cp_path, &cp)?;
        Ok(cp)
    }

    /// Creates `path` with `bytes` allocated on disk (not a sparse file): a disk too small for
    /// the prefill fails here, before any compute.
    fn create(&self, path: &Path, bytes: u64) -> Result<File> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| self.io(path, e))?;
        if bytes > 0 {
            <File as fs4::FileExt>::allocate(&f, bytes).map_err(|e| self.io(path, e))?;
        }
        Ok(f)
    }

    fn write_at(&self, file: &File, path: &Path, offset: u64, bytes: &[u8]) -> Result<()> {
        file.write_all_at(bytes, offset).map_err(|e| self.io(path, e))
    }

    fn io(&self, path: &Path, e: std::io::Error) -> Error {
        if is_disk_full(&e) {
            self.disk_full(e.to_string())
        } else {
            Error::io(path, e)
        }
    }

    fn disk_full(&self, detail: String) -> Error {
        Error::DiskFull {
            path: self.out.to_owned(),
            needed: self.job.file_bytes + 2 * self.hidden_bytes(),
            file: self.job.file_bytes,
            detail,
        }
    }

    fn mismatch(&self, cp: &Checkpoint) -> Error {
        let what = if cp.base_tokens != self.base_tokens() {
            if cp.base_tokens > 0 {
                "it adds documents to the saved context (rerun with --context and the same --add)".to_owned()
            } else {
                "it prefills every document, not an addition".to_owned()
            }
        } else if cp.compute != self.compute() {
            format!("it ran on {} and this run is {}", cp.compute, self.compute())
        } else if cp.job.model != self.job.model {
            format!("it used model {}", cp.job.model.name)
        } else if cp.job.kv_dtype != self.job.kv_dtype {
            format!("it stores {} K/V", cp.job.kv_dtype.name())
        } else {
            format!("its documents or prompt differ ({} tokens then, {} now)", cp.job.tokens, self.job.tokens)
        };
        Error::Invalid(format!(
            "an interrupted prefill of {} is waiting in {} but does not match this one: {what}; \
             rerun the original command to resume it, or pass --restart to discard it",
            self.out.display(),
            self.dir.display()
        ))
    }

    /// The job's header with every section's checksum filled in.
    fn finished_header(&self, cp: &Checkpoint) -> Result<Header> {
        let mut header = self.job.clone();
        if cp.checksums.len() != header.sections.len() {
            return Err(Error::Invalid(format!(
                "the checkpoint in {} lists {} checksums for {} sections; pass --restart",
                self.dir.display(),
                cp.checksums.len(),
                header.sections.len()
            )));
        }
        for (s, sum) in header.sections.iter_mut().zip(&cp.checksums) {
            s.xxh3 = sum.clone();
        }
        if header.to_json().len() != self.job.to_json().len() {
            return Err(Error::Invalid("internal: the finished header changed length".into()));
        }
        Ok(header)
    }
}

/// A layer's hidden states on their way to a hidden file, for a checkpoint.
struct Persist<'scope> {
    layer: usize,
    file: usize,
    path: PathBuf,
    /// Seconds the copy off the device (or out of the store) held the prefill up.
    snapshot_secs: f64,
    /// The write: the checksum of what it wrote, and its seconds.
    writer: std::thread::ScopedJoinHandle<'scope, std::io::Result<(String, f64)>>,
}

/// A layer's K and V sections on their way off the device and into the context file: their
/// checksums, and the buffers back.
type StoreWriter<'scope> =
    std::thread::ScopedJoinHandle<'scope, (std::result::Result<Vec<String>, StoreError>, Vec<Vec<u8>>)>;

/// Why a layer's K/V did not reach the file: its copy off the device (or its encode), or the
/// write (which [`Job::io`] tells apart from a full disk).
enum StoreError {
    Encode(Error),
    Write(std::io::Error),
}

/// An error that says the disk (or the user's quota) is full.
fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::StorageFull | ErrorKind::FileTooLarge | ErrorKind::QuotaExceeded)
}

/// Starts writing `len` bytes at `offset` of `file` back to the disk without waiting for them.
/// Advisory: an error here loses nothing, as the finished file's fsync still makes every byte
/// durable or fails.
#[cfg(target_os = "linux")]
fn start_write_back(file: &File, offset: u64, len: usize) {
    use std::os::fd::AsRawFd;
    // SAFETY: `file` is open for the call's duration; sync_file_range only schedules I/O.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn start_write_back(_: &File, _: u64, _: usize) {}

fn sync(file: &File, path: &Path) -> Result<()> {
    file.sync_all().map_err(|e| Error::io(path, e))
}
