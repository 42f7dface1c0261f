//! Prefill speed, memory, file size and reopen-to-first-token time (`folio bench prefill`):
//! synthetic prompts (random token ids) of each requested length prefilled into a context file
//! with the real builder, then the file reopened as a person would and a short question run to
//! its first token. Each row carries its prefill tokens/s, the FLOP rate against a large
//! matmul's on the same device (the compute limit in practice), peak RSS and device memory,
//! the file's bytes, and the reopen's time from disk and cached with the disk's read rate
//! measured on the file.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use folio_models::attention::{Dense, Tier};
use folio_models::config::ModelConfig;
use folio_models::context::{
    self, BuildOptions, BuildReport, HiddenPlace, KvDtype, ModelStamp, PrefixPlan, StageSeconds,
};
use folio_models::error::{human_bytes, Error, Result};
use folio_models::kv_cache::{ContextKv, KvStore, OffloadKv};
use folio_models::model::{Logits, Model};
use folio_models::prefill::PrefillMode;
use folio_models::{device_name, Engine};
use folio_runtime::device::MemorySampler;
use folio_runtime::host_memory::{drop_page_cache, peak_rss, reset_peak_rss};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use super::decode::INIT_STD;
use super::matmul_flops;

/// Bytes read to measure the disk's read rate (or the whole file, if smaller), in pieces of
/// [`DISK_PROBE_PIECE`].
const DISK_PROBE_BYTES: usize = 2 << 30;
const DISK_PROBE_PIECE: usize = 16 << 20;
/// Device memory a prefill under a VRAM budget leaves outside its chunk plan: cuBLAS
/// workspaces, the allocator's rounding, the LM head's logits.
pub const VRAM_MARGIN: u64 = 1 << 30;
/// Tokens of the question asked after reopening.
pub const QUESTION_TOKENS: usize = 16;
/// Tokens of the untimed warm-up (one chunk of the largest size, or a few under a tight budget).
const WARMUP_TOKENS: usize = 8192;

/// What a prefill bench runs.
pub struct PrefillBench {
    /// Prompt lengths, one row each.
    pub tokens: Vec<usize>,
    pub kv_dtype: KvDtype,
    /// Bytes the prefill's working set may use beyond the weights (the chunk plan's budget).
    pub memory_budget: Option<u64>,
    /// Device memory the whole run may use: what is left after the weights becomes the chunk
    /// plan's budget, the peak is sampled from the driver, and a peak over it fails.
    pub vram_budget: Option<u64>,
    /// Folder for the context files (default: the system temp folder); each is deleted after use.
    pub dir: Option<PathBuf>,
    /// Keep the file of an interrupted run in `dir` and resume it from its checkpoint.
    pub resume: bool,
    /// Also grow each context by this many new tokens and time it against a prefill of
    /// everything in one go.
    pub append: Option<usize>,
    /// After the timed rows, the first length once more with the device synchronised around
    /// each operation: where that run's time went, op by op.
    pub profile: bool,
    /// Reopen on the offloaded tier even where the decoded layers would fit the device.
    pub offload: bool,
    /// How every prefill of the bench attends (`--prefill`).
    pub prefill: PrefillMode,
}

impl PrefillBench {
    /// Positions a row of `n` tokens takes: its prompt, any growth, and the question asked
    /// after the reopen.
    pub fn positions_used(&self, n: usize) -> usize {
        n + self.append.unwrap_or(0) + QUESTION_TOKENS
    }
}

/// Where one reopen's time went.
#[derive(Serialize, Clone, Copy)]
pub struct Reopen {
    /// Open to the first token's logits.
    pub seconds: f64,
    /// The file opened: header, token ids and document table verified, the model's fingerprint
    /// checked.
    pub open: f64,
    /// The K/V store made: on the offloaded tier every K/V section's checksum verified and the
    /// mapping registered with the device; on the resident tier nothing yet (layers are decoded
    /// when the question first reads them).
    pub store: f64,
    /// The question through the model, attending every saved row densely, to the first
    /// token's logits.
    pub question: f64,
    /// On the offloaded tier: whether the rows were read in place from the file's mapping (a
    /// GPU that cannot register it gets them copied into page-locked memory instead).
    pub in_place: bool,
}

#[derive(Serialize)]
pub struct Row {
    pub tokens: usize,
    /// Layers this run computed (fewer than the model's when it resumed an interrupted one).
    pub layers_computed: usize,
    pub prefill_seconds: f64,
    pub tokens_per_s: f64,
    pub flops_per_s: f64,
    /// Prefill FLOP rate ÷ the device's large-matmul FLOP rate.
    pub flops_ratio_to_matmul: f64,
    pub peak_rss_bytes: Option<u64>,
    /// Device memory in use at the peak (driver's total − free), off the CPU.
    pub peak_vram_bytes: Option<u64>,
    pub chunk: usize,
    /// Where the prefill's time went.
    pub stages: StageSeconds,
    /// Where the hidden states between layers lived, and the checkpoints written.
    pub hidden_in: HiddenPlace,
    pub checkpoints: usize,
    pub working_set_bytes: u64,
    pub file_bytes: u64,
    /// Reopen-to-first-token time with the file evicted from the page cache (as after a
    /// reboot), and again with it cached (as the second time a user opens it).
    pub reopen_first_token_seconds: f64,
    pub reopen_warm_seconds: f64,
    /// Reopen-to-first-token time ÷ prefill time.
    pub reopen_ratio: f64,
    /// "resident" or "offloaded": where the reopen's K/V lived.
    pub reopen_tier: &'static str,
    pub reopen_cold: Reopen,
    pub reopen_warm: Reopen,
    /// The disk's sequential read rate, bytes/s, measured on the file after the reopens (its
    /// first `DISK_PROBE_BYTES` evicted from the page cache and read back): the cold reopen's
    /// limit is the file's bytes over it.
    pub disk_read_bytes_per_s: f64,
    /// Growing the context by [`PrefillBench::append`] tokens.
    pub append: Option<AppendRow>,
}

#[derive(Serialize)]
pub struct AppendRow {
    pub new_tokens: usize,
    /// Growing the saved context: only the new tokens computed.
    pub append_seconds: f64,
    /// Prefilling old and new tokens in one go.
    pub full_seconds: f64,
    /// append ÷ full.
    pub ratio: f64,
    /// The share of the full prefill's attention and matmul work that is the new tokens'
    /// (the ratio an append would have with no fixed costs).
    pub work_share: f64,
}

/// What a prefill bench prefills with: a loaded model, or random weights of a real shape.
pub struct Subject {
    name: String,
    stamp: ModelStamp,
    made: Made,
}

enum Made {
    Loaded(Box<Engine>),
    Random(Box<Model>),
}

impl Subject {
    /// A loaded model: its rows' reopens go through [`Engine::open_context`].
    pub fn loaded(engine: Engine) -> Result<Self> {
        let stamp = engine.stamp()?.clone();
        Ok(Self { name: engine.name.clone(), stamp, made: Made::Loaded(Box::new(engine)) })
    }

    /// Random weights of the shape at `shape` (assets/shapes/*.json), with room for
    /// `positions`: a shape is a fact about cost, so prompts past its trained length are still
    /// measured.
    /// With `quantize`, the projections quantized (`folio bench prefill --weights`).
    pub fn random(
        shape: &Path,
        device: &Device,
        dtype: DType,
        positions: usize,
        quantize: Option<folio_models::model::Quantize>,
    ) -> Result<Self> {
        let mut cfg = ModelConfig::from_file(shape)?;
        cfg.max_position_embeddings = cfg.max_position_embeddings.max(positions);
        let model = Model::random(&cfg, device, dtype, INIT_STD, quantize)?;
        let name = shape.file_stem().map_or("shape".into(), |s| s.to_string_lossy().into_owned());
        let weights = quantize.map(|q| q.name().to_owned());
        let fingerprint = cfg.fingerprint("none".into(), "random".into(), weights.clone())?;
        let stamp = ModelStamp { name: name.clone(), source: shape.display().to_string(), fingerprint };
        let described = weights.map_or_else(|| "random weights".to_owned(), |w| format!("random {w} weights"));
        Ok(Self { name: format!("{name} ({described})"), stamp, made: Made::Random(Box::new(model)) })
    }

    /// The model's name as the report gives it.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn model(&self) -> &Model {
        match &self.made {
            Made::Loaded(e) => &e.model,
            Made::Random(m) => m,
        }
    }
}

/// What a prefill bench reports as it goes.
pub enum PrefillEvent<'a> {
    /// The untimed warm-up is done (kernel compilation, first allocations), and the
    /// large-matmul rate the rows are held to measured.
    WarmedUp { tokens: usize, seconds: f64, matmul_flops_per_s: f64 },
    /// A row's prefill is done, before its reopens (at a million tokens they take a minute
    /// more): what the prefill did, with the peaks.
    Prefilled { report: &'a BuildReport, peak_vram: Option<u64>, peak_rss: Option<u64> },
    /// A row is measured.
    Row(&'a Row),
}

/// Everything a prefill bench measured (`folio bench prefill --json` prints it).
#[derive(Serialize)]
pub struct PrefillReport {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub kv_dtype: KvDtype,
    /// How the prefills attended (`dense`, or `sparse:` and its knobs).
    pub prefill: String,
    pub threads: usize,
    pub matmul_flops_per_s: f64,
    pub vram_budget_bytes: Option<u64>,
    pub warmup_seconds: f64,
    pub rows: Vec<Row>,
    pub profile: Option<Profile>,
}

impl PrefillReport {
    /// A row whose peak device memory went over the VRAM budget fails the run.
    pub fn check_budget(&self) -> Result<()> {
        let Some(b) = self.vram_budget_bytes else { return Ok(()) };
        match self.rows.iter().find(|r| r.peak_vram_bytes.is_some_and(|p| p > b)) {
            Some(r) => Err(Error::Invalid(format!(
                "the prefill of {} tokens peaked at {} of device memory, over the {} budget",
                r.tokens,
                human_bytes(r.peak_vram_bytes.unwrap_or(0)),
                human_bytes(b)
            ))),
            None => Ok(()),
        }
    }
}

/// Prefills each of `b.tokens` with `subject` and reopens each file as a person would,
/// handing each event to `on` as it happens. `stop` (Ctrl-C) ends a long prefill between
/// chunks with its last finished layer kept, so that a run with `dir` and `resume` picks it up
/// again.
pub fn run<E: From<Error>>(
    subject: &Subject,
    b: &PrefillBench,
    stop: &AtomicBool,
    mut on: impl FnMut(PrefillEvent<'_>) -> std::result::Result<(), E>,
) -> std::result::Result<PrefillReport, E> {
    if let Some(d) = b.dir.as_ref().filter(|d| !d.is_dir()) {
        let d = d.display();
        return Err(Error::Invalid(format!(
            "--dir {d}: no such folder (the context files are written there: create it first)"
        ))
        .into());
    }
    let model = subject.model();
    check_positions(subject, b)?;
    let sampler = MemorySampler::start(model.device()).map_err(Error::from)?;
    let memory_budget = chunk_budget(b, &sampler)?;
    let dir = match &b.dir {
        Some(d) if b.resume => Scratch::Kept(d.clone()),
        d => Scratch::Temp(
            tempfile::Builder::new()
                .prefix("folio-bench")
                .tempdir_in(d.clone().unwrap_or_else(std::env::temp_dir))
                .map_err(|e| Error::io(d.clone().unwrap_or_else(std::env::temp_dir), e))?,
        ),
    };
    let matmul = matmul_flops(model.device(), model.dtype())?;
    // One short prefill first, untimed: the driver compiles each kernel's PTX at its first
    // launch and cuBLAS loads its kernels lazily (seconds, once per process; the driver's cache
    // keeps them across runs on a person's machine), and the peer script warms up the same way.
    let warm_tokens = b.tokens.iter().copied().min().unwrap_or(0).min(WARMUP_TOKENS);
    let warmup = {
        let started = Instant::now();
        let opts = BuildOptions { memory_budget, restart: true, prefill: b.prefill, ..BuildOptions::new(b.kv_dtype) };
        let out = dir.path().join("warm-up.folio");
        let vocab = model.config().vocab_size as u32;
        let plan = PrefixPlan::raw_tokens((0..warm_tokens as u32).map(|i| i % vocab).collect());
        context::build(model, &subject.stamp, &plan, &out, &opts, &mut |_| ControlFlow::Continue(()))?;
        remove(&out)?;
        started.elapsed().as_secs_f64()
    };
    on(PrefillEvent::WarmedUp { tokens: warm_tokens, seconds: warmup, matmul_flops_per_s: matmul })?;
    let mut rows = Vec::new();
    for &n in &b.tokens {
        let opts =
            BuildOptions { memory_budget, restart: !b.resume, prefill: b.prefill, ..BuildOptions::new(b.kv_dtype) };
        let measure = Measure { matmul, sampler: &sampler, stop };
        let row = one(subject, n, &opts, dir.path(), (b.append, b.offload), &measure, &mut on)?;
        on(PrefillEvent::Row(&row))?;
        rows.push(row);
    }
    let profile = match (b.profile, b.tokens.first()) {
        (true, Some(&n)) => Some(profile_prefill(subject, n, (b.kv_dtype, b.prefill), memory_budget, dir.path())?),
        _ => None,
    };
    Ok(PrefillReport {
        model: subject.name.clone(),
        device: device_name(model.device()),
        dtype: format!("{:?}", model.dtype()).to_lowercase(),
        kv_dtype: b.kv_dtype,
        prefill: b.prefill.name(),
        threads: candle_core::utils::get_num_threads(),
        matmul_flops_per_s: matmul,
        vram_budget_bytes: b.vram_budget,
        warmup_seconds: warmup,
        rows,
        profile,
    })
}

/// Refuses, before any prefill, a row that cannot take its question (it would fail after
/// minutes otherwise).
fn check_positions(subject: &Subject, b: &PrefillBench) -> Result<()> {
    let window = subject.model().config().max_position_embeddings;
    match b.tokens.iter().find(|&&n| b.positions_used(n) > window) {
        Some(&n) => Err(Error::Invalid(format!(
            "--tokens {n} leaves no room for the {QUESTION_TOKENS}-token question asked after the reopen{}: {} has \
             {window} positions, so a row can be at most {} tokens",
            b.append.map_or(String::new(), |m| format!(" and the {m} tokens --append adds")),
            subject.name,
            window.saturating_sub(b.positions_used(0))
        ))),
        None => Ok(()),
    }
}

/// The chunk plan's budget: the memory budget, and what the VRAM budget leaves after what is
/// in use now (the weights, the runtime) and a margin for cuBLAS and the allocator.
fn chunk_budget(b: &PrefillBench, sampler: &MemorySampler) -> Result<Option<u64>> {
    let (Some(vram), Some((used, _))) = (b.vram_budget, sampler.now().map_err(Error::from)?) else {
        return Ok(b.memory_budget);
    };
    let left = vram.checked_sub(used + VRAM_MARGIN).ok_or_else(|| {
        Error::Invalid(format!(
            "--vram-budget {} is below what is already in use ({}: weights and runtime) plus a {} margin",
            human_bytes(vram),
            human_bytes(used),
            human_bytes(VRAM_MARGIN)
        ))
    })?;
    Ok(Some(b.memory_budget.map_or(left, |m| m.min(left))))
}

/// Deletes a context file the bench made.
fn remove(path: &Path) -> Result<()> {
    std::fs::remove_file(path).map_err(|e| Error::io(path, e))
}

/// Where one prefill's time went: each span of the forward pass with the device synchronised
/// around it (`folio_models::profile`), and the stages outside the forward passes.
#[derive(Serialize)]
pub struct Profile {
    pub tokens: usize,
    pub seconds: f64,
    pub spans: Vec<ProfileSpan>,
    pub stages: StageSeconds,
}

#[derive(Serialize)]
pub struct ProfileSpan {
    pub name: &'static str,
    pub seconds: f64,
    pub calls: usize,
}

fn profile_prefill(
    subject: &Subject,
    n: usize,
    (kv_dtype, prefill): (KvDtype, PrefillMode),
    memory_budget: Option<u64>,
    dir: &Path,
) -> Result<Profile> {
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(n as u64);
    let plan = PrefixPlan::raw_tokens((0..n).map(|_| rng.random_range(0..vocab)).collect());
    let out = dir.join(format!("profile-{n}.folio"));
    // The bench's prefill (a sparse one's estimate, gather and kernel are timed apart).
    let opts = BuildOptions { memory_budget, restart: true, prefill, ..BuildOptions::new(kv_dtype) };
    folio_models::profile::start(folio_models::profile::Clock::Device);
    let report = context::build(model, &subject.stamp, &plan, &out, &opts, &mut |_| ControlFlow::Continue(()));
    let spans = folio_models::profile::finish();
    let report = report?;
    remove(&out)?;
    Ok(Profile {
        tokens: n,
        seconds: report.seconds,
        spans: spans.into_iter().map(|(name, seconds, calls)| ProfileSpan { name, seconds, calls }).collect(),
        stages: report.stages,
    })
}

/// What each timed row is measured against: the large-matmul rate, the device memory sampler,
/// and the Ctrl-C flag that stops a row between chunks.
#[derive(Clone, Copy)]
struct Measure<'a> {
    matmul: f64,
    sampler: &'a MemorySampler,
    stop: &'a AtomicBool,
}

/// Where the bench's context files go: a temporary folder, or `dir` kept for `resume`.
enum Scratch {
    Temp(tempfile::TempDir),
    Kept(PathBuf),
}

impl Scratch {
    fn path(&self) -> &Path {
        match self {
            Self::Temp(t) => t.path(),
            Self::Kept(p) => p,
        }
    }
}

/// One row: `n` random tokens prefilled into a file in `dir`, reopened from disk and cached,
/// the disk's read rate measured on the file, and the growth by `append` tokens if asked for.
fn one<E: From<Error>>(
    subject: &Subject,
    n: usize,
    opts: &BuildOptions,
    dir: &Path,
    (append, offload): (Option<usize>, bool),
    m: &Measure<'_>,
    on: &mut impl FnMut(PrefillEvent<'_>) -> std::result::Result<(), E>,
) -> std::result::Result<Row, E> {
    let Measure { matmul, sampler, stop } = *m;
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(n as u64);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let plan = PrefixPlan::raw_tokens(tokens);
    let out = dir.join(format!("bench-{n}.folio"));
    // Peaks per length.
    reset_peak_rss();
    sampler.reset();
    let report = context::build(model, &subject.stamp, &plan, &out, opts, &mut |_| {
        if stop.load(Ordering::SeqCst) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    let (peak, peak_vram) = (peak_rss(), sampler.peak());
    on(PrefillEvent::Prefilled { report: &report, peak_vram, peak_rss: peak })?;
    // Open as `folio chat --context` does, on the tier a person's settings would put it: the
    // offloaded one when the decoded layers do not fit the device.
    let cfg = model.config();
    let decoded = (cfg.kv_bytes_per_token(model.dtype().size_in_bytes()) * n) as u64;
    let tier =
        if offload || opts.memory_budget.is_some_and(|b| decoded > b) { Tier::Offloaded } else { Tier::Resident };
    drop_page_cache(&out);
    let reopen_cold = reopen(subject, &out, tier, &mut rng)?;
    let reopen_warm = reopen(subject, &out, tier, &mut rng)?;
    // The reopen keeps every layer on the device; what the pool keeps of it afterwards is not
    // the next row's.
    folio_runtime::device::trim_pool(model.device()).map_err(Error::from)?;
    let disk_read_bytes_per_s = disk_read_rate(&out)?;
    let append = append.map(|m| grow(subject, &out, m, opts, dir, &mut rng)).transpose()?;
    remove(&out)?;
    let computed = report.layers - report.resumed_layers;
    let flops =
        prefill_flops(model.config(), n, opts.prefill) * computed as f64 / report.layers as f64 / report.seconds;
    Ok(Row {
        tokens: n,
        layers_computed: computed,
        prefill_seconds: report.seconds,
        tokens_per_s: report.tokens_per_s,
        flops_per_s: flops,
        flops_ratio_to_matmul: flops / matmul,
        peak_rss_bytes: peak,
        peak_vram_bytes: peak_vram,
        chunk: report.chunk,
        stages: report.stages.clone(),
        hidden_in: report.hidden_in,
        checkpoints: report.checkpoints,
        working_set_bytes: report.working_set_bytes,
        file_bytes: report.file_bytes,
        reopen_first_token_seconds: reopen_cold.seconds,
        reopen_warm_seconds: reopen_warm.seconds,
        reopen_ratio: reopen_cold.seconds / report.seconds,
        reopen_tier: tier.name(),
        reopen_cold,
        reopen_warm,
        disk_read_bytes_per_s,
        append,
    })
}

/// Opens `out` as `folio chat --context` does (the model's fingerprint checked), then runs a
/// random question through the model, attending every saved row densely, until the first
/// token's logits exist.
fn reopen(subject: &Subject, out: &Path, tier: Tier, rng: &mut StdRng) -> Result<Reopen> {
    let model = subject.model();
    let start = Instant::now();
    let file = match &subject.made {
        Made::Loaded(engine) => engine.open_context(out)?,
        Made::Random(_) => {
            let file = context::ContextFile::open(out)?;
            if file.header().model.fingerprint != subject.stamp.fingerprint {
                return Err(Error::Invalid(format!("{} was not made by this shape", out.display())));
            }
            file
        }
    };
    let open = start.elapsed().as_secs_f64();
    let file = Arc::new(file);
    let (mut kv, in_place): (Box<dyn KvStore>, bool) = match tier {
        Tier::Resident => (Box::new(ContextKv::new(file, model.dtype(), model.device(), u64::MAX)), false),
        Tier::Offloaded => {
            let kv = OffloadKv::from_context(file, model.dtype(), model.device())?;
            let in_place = kv.in_place();
            (Box::new(kv), in_place)
        }
    };
    let store = start.elapsed().as_secs_f64() - open;
    let vocab = model.config().vocab_size as u32;
    let question: Vec<u32> = (0..QUESTION_TOKENS).map(|_| rng.random_range(0..vocab)).collect();
    let logits = model.forward(&question, kv.as_mut(), &Dense, Logits::Last)?;
    logits.argmax(1)?.to_vec1::<u32>()?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(Reopen { seconds, open, store, question: seconds - open - store, in_place })
}

/// Grows the context at `base` by `m` random tokens, and prefills the same tokens in one go.
fn grow(
    subject: &Subject,
    base: &Path,
    m: usize,
    opts: &BuildOptions,
    dir: &Path,
    rng: &mut StdRng,
) -> Result<AppendRow> {
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let file = folio_models::context::ContextFile::open(base)?;
    let n = file.tokens().len();
    let mut plan = PrefixPlan::raw_tokens(file.tokens().to_vec());
    plan.tokens.extend((0..m).map(|_| rng.random_range(0..vocab)));
    plan.documents = file.documents().to_vec();
    let mut added = plan.documents[0].clone();
    (added.title, added.start, added.end) = ("added".into(), n, n + m);
    plan.documents.push(added);
    let (grown, whole) = (dir.join(format!("bench-{n}+{m}.folio")), dir.join(format!("bench-{}.folio", n + m)));
    let started = Instant::now();
    context::append(model, &subject.stamp, &file, &plan, &grown, opts, &mut |_| ControlFlow::Continue(()))?;
    let append_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    context::build(model, &subject.stamp, &plan, &whole, opts, &mut |_| ControlFlow::Continue(()))?;
    let full_seconds = started.elapsed().as_secs_f64();
    for p in [&grown, &whole] {
        remove(p)?;
    }
    let cfg = model.config();
    let work_share = 1.0 - prefill_flops(cfg, n, opts.prefill) / prefill_flops(cfg, n + m, opts.prefill);
    Ok(AppendRow { new_tokens: m, append_seconds, full_seconds, ratio: append_seconds / full_seconds, work_share })
}

/// Multiply-adds ×2 of a layer-major prefill of `n` tokens: projections and MLP per token and
/// layer, causal attention (QKᵀ and PV over n²/2 pairs; a sparse prefill's over the keys its rows
/// keep, its own block counted whole, its estimate not at all), one LM-head row.
fn prefill_flops(c: &ModelConfig, n: usize, mode: PrefillMode) -> f64 {
    let (h, q, kv, i) = (
        c.hidden_size as f64,
        (c.num_heads * c.head_dim) as f64,
        (c.num_kv_heads * c.head_dim) as f64,
        c.intermediate_size as f64,
    );
    let per_token_layer = 2.0 * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i);
    let pairs = match mode {
        PrefillMode::Dense => (n as f64).powi(2) / 2.0,
        PrefillMode::Sparse(p) => {
            let dense = (p.first_sparse_block() * p.block).min(n) as f64;
            dense * dense / 2.0 + (n as f64 - dense) * p.keys_per_row() as f64
        }
    };
    let n = n as f64;
    let attention = 2.0 * 2.0 * q * pairs;
    c.num_layers as f64 * (per_token_layer * n + attention) + 2.0 * h * c.vocab_size as f64
}

/// The disk's sequential read rate, bytes/s: the first [`DISK_PROBE_BYTES`] of `path` evicted
/// from the page cache and read back in large pieces.
fn disk_read_rate(path: &Path) -> Result<f64> {
    use std::io::Read;
    drop_page_cache(path);
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut buf = vec![0u8; DISK_PROBE_PIECE];
    let (start, mut read) = (Instant::now(), 0usize);
    while read < DISK_PROBE_BYTES {
        match f.read(&mut buf).map_err(|e| Error::io(path, e))? {
            0 => break,
            got => read += got,
        }
    }
    Ok(read as f64 / start.elapsed().as_secs_f64())
}
