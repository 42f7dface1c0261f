//! `folio bench prefill`: synthetic prompts prefilled into context files with the real
//! builder, then reopened as a user would, to the first token after a short question (see the
//! parent module's docs for what is printed).

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use folio_models::attention::{Dense, Tier};
use folio_models::config::ModelConfig;
use folio_models::context::{self, BuildOptions, HiddenPlace, KvDtype, ModelStamp, PrefixPlan, StageSeconds};
use folio_models::error::human_bytes;
use folio_models::kv_cache::OffloadKv;
use folio_models::kv_cache::{ContextKv, KvStore};
use folio_models::model::Logits;
use folio_models::{device_name, Engine};
use folio_runtime::device::MemorySampler;
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use super::{matmul_flops, QUESTION_TOKENS, WARMUP_TOKENS};
use crate::cli::Common;
use crate::context_cmd::parse_bytes;
use folio_runtime::host_memory::peak_rss;

/// Bytes read to measure the disk's read rate (or the whole file, if smaller), in pieces of
/// [`DISK_PROBE_PIECE`].
pub(super) const DISK_PROBE_BYTES: usize = 2 << 30;
pub(super) const DISK_PROBE_PIECE: usize = 16 << 20;

/// Device memory a prefill under `--vram-budget` leaves outside its chunk plan: cuBLAS
/// workspaces, the allocator's rounding, the LM head's logits.
pub(super) const VRAM_MARGIN: u64 = 1 << 30;

#[derive(Args)]
pub struct PrefillBenchArgs {
    /// Prompt lengths, comma-separated (e.g. 8192,32768).
    #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
    tokens: Vec<usize>,
    /// K/V storage: bf16, bf16-fp8, fp8 or f32 (as `folio prefill --kv-dtype`).
    #[arg(long, default_value = "bf16")]
    kv_dtype: String,
    /// Bytes the prefill's working set may use beyond the weights (the chunk plan's budget).
    #[arg(long)]
    memory_budget: Option<String>,
    /// Device memory the whole run may use (e.g. 24GiB): what is left after the weights becomes
    /// the chunk plan's budget, the peak is sampled from the driver, and a peak over it fails.
    #[arg(long)]
    vram_budget: Option<String>,
    /// A model shape (assets/shapes/*.json) with random weights instead of `--model` (speed and
    /// memory depend on the shape only; the reopen's first token is timed, not read).
    #[arg(long)]
    shape: Option<PathBuf>,
    /// Folder for the context files (default: the system temp folder); each is deleted after use.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the file of an interrupted run in `--dir` and resume it (from its checkpoint): a
    /// prefill longer than one sitting finishes over several runs, each reporting its own layers.
    #[arg(long, requires = "dir")]
    resume: bool,
    /// Also grow each context by this many new tokens (`folio prefill --context --add`) and
    /// time it against a prefill of everything in one go.
    #[arg(long, conflicts_with = "resume")]
    append: Option<usize>,
    /// After the timed rows, prefill the first length once more with the device synchronised
    /// around each operation, and print where that run's time went, op by op.
    #[arg(long)]
    profile: bool,
    /// Reopen on the offloaded tier (the file's K/V read in place from host memory, as `folio
    /// chat --offload` does) even where the decoded layers would fit the device; without it the
    /// reopen goes there only when they would not fit what `--vram-budget` leaves.
    #[arg(long)]
    offload: bool,
    #[arg(long)]
    json: bool,
}

/// Where one reopen's time went.
#[derive(Serialize, Clone, Copy)]
pub(super) struct Reopen {
    /// Open to the first token's logits.
    seconds: f64,
    /// The file opened: header, token ids and document table verified, the model's fingerprint
    /// checked.
    open: f64,
    /// The K/V store made: on the offloaded tier every K/V section's checksum verified and the
    /// mapping registered with the device; on the resident tier nothing yet (layers are decoded
    /// when the question first reads them).
    store: f64,
    /// The question through the model, attending every saved row densely, to the first
    /// token's logits.
    question: f64,
    /// On the offloaded tier: whether the rows were read in place from the file's mapping (a
    /// GPU that cannot register it gets them copied into page-locked memory instead).
    in_place: bool,
}

#[derive(Serialize)]
pub(super) struct Row {
    tokens: usize,
    /// Layers this run computed (fewer than the model's when it resumed an interrupted one).
    layers_computed: usize,
    prefill_seconds: f64,
    tokens_per_s: f64,
    flops_per_s: f64,
    /// Prefill FLOP rate ÷ the device's large-matmul FLOP rate.
    flops_ratio_to_matmul: f64,
    peak_rss_bytes: Option<u64>,
    /// Device memory in use at the peak (driver's total − free), off the CPU.
    peak_vram_bytes: Option<u64>,
    chunk: usize,
    /// Where the prefill's time went.
    stages: StageSeconds,
    /// Where the hidden states between layers lived, and the checkpoints written.
    hidden_in: HiddenPlace,
    checkpoints: usize,
    working_set_bytes: u64,
    file_bytes: u64,
    /// Reopen-to-first-token time with the file evicted from the page cache (as after a
    /// reboot), and again with it cached (as the second time a user opens it).
    reopen_first_token_seconds: f64,
    reopen_warm_seconds: f64,
    /// Reopen-to-first-token time ÷ prefill time.
    reopen_ratio: f64,
    /// "resident" or "offloaded": where the reopen's K/V lived.
    reopen_tier: &'static str,
    reopen_cold: Reopen,
    reopen_warm: Reopen,
    /// The disk's sequential read rate, bytes/s, measured on the file after the reopens (its
    /// first [`DISK_PROBE_BYTES`] evicted from the page cache and read back): the cold reopen's
    /// limit is the file's bytes over it.
    disk_read_bytes_per_s: f64,
    /// Growing the context by `--append` tokens.
    append: Option<AppendRow>,
}

#[derive(Serialize)]
pub(super) struct AppendRow {
    new_tokens: usize,
    /// Growing the saved context: only the new tokens computed.
    append_seconds: f64,
    /// Prefilling old and new tokens in one go.
    full_seconds: f64,
    /// append ÷ full.
    ratio: f64,
    /// The share of the full prefill's attention and matmul work that is the new tokens'
    /// (the ratio an append would have with no fixed costs).
    work_share: f64,
}

/// What `bench prefill` prefills with: a loaded model, or random weights of a real shape.
pub(super) struct Subject {
    name: String,
    stamp: ModelStamp,
    made: Made,
}

pub(super) enum Made {
    Loaded(Box<Engine>),
    Random(Box<folio_models::model::Model>),
}

impl Subject {
    fn new(common: &Common, a: &PrefillBenchArgs) -> Result<Self> {
        let Some(shape) = &a.shape else {
            let engine = common.engine()?;
            let stamp = engine.stamp()?.clone();
            return Ok(Self { name: engine.name.clone(), stamp, made: Made::Loaded(Box::new(engine)) });
        };
        if common.model.is_some() {
            anyhow::bail!("--shape and --model are two different models: give one");
        }
        let mut cfg = ModelConfig::from_file(shape)?;
        // A shape is a fact about cost: prompts past its trained length are still measured,
        // with the question after the reopen and any growth.
        let longest = a.tokens.iter().map(|&n| positions_used(n, a)).max().unwrap_or(0);
        cfg.max_position_embeddings = cfg.max_position_embeddings.max(longest);
        let device = folio_models::parse_device(&common.device)?;
        let dtype = folio_models::parse_dtype(&common.dtype, &device)?;
        let model = folio_models::model::Model::random(&cfg, &device, dtype, super::shape::INIT_STD)?;
        let name = shape.file_stem().map_or("shape".into(), |s| s.to_string_lossy().into_owned());
        let fingerprint = cfg.fingerprint("none".into(), "random".into())?;
        let stamp = ModelStamp { name: name.clone(), source: shape.display().to_string(), fingerprint };
        Ok(Self { name: format!("{name} (random weights)"), stamp, made: Made::Random(Box::new(model)) })
    }

    fn model(&self) -> &folio_models::model::Model {
        match &self.made {
            Made::Loaded(e) => &e.model,
            Made::Random(m) => m,
        }
    }
}

/// Positions a row of `n` tokens takes: its prompt, any growth, and the question asked after
/// the reopen.
pub(super) fn positions_used(n: usize, a: &PrefillBenchArgs) -> usize {
    n + a.append.unwrap_or(0) + QUESTION_TOKENS
}

pub(super) fn bench_prefill(common: &Common, a: PrefillBenchArgs) -> Result<()> {
    let kv_dtype = KvDtype::parse(&a.kv_dtype)?;
    if let Some(d) = a.dir.as_ref().filter(|d| !d.is_dir()) {
        anyhow::bail!("--dir {}: no such folder (the context files are written there: create it first)", d.display());
    }
    let device = folio_models::parse_device(&common.device)?;
    let sampler = MemorySampler::start(&device)?;
    let subject = Subject::new(common, &a)?;
    let model = subject.model();
    // Before any prefill: a row that cannot take its question fails after minutes otherwise.
    let window = model.config().max_position_embeddings;
    if let Some(&n) = a.tokens.iter().find(|&&n| positions_used(n, &a) > window) {
        anyhow::bail!(
            "--tokens {n} leaves no room for the {QUESTION_TOKENS}-token question asked after the reopen{}: {} has \
             {window} positions, so a row can be at most {} tokens",
            a.append.map_or(String::new(), |m| format!(" and the {m} tokens --append adds")),
            subject.name,
            window.saturating_sub(positions_used(0, &a))
        );
    }
    let vram_budget = a.vram_budget.as_deref().map(parse_bytes).transpose()?;
    // The chunk plan gets what the VRAM budget leaves after what is in use now (the weights,
    // the runtime) and a margin for cuBLAS and the allocator.
    let mut memory_budget = a.memory_budget.as_deref().map(parse_bytes).transpose()?;
    if let (Some(b), Some((used, _))) = (vram_budget, sampler.now()?) {
        let left = b.checked_sub(used + VRAM_MARGIN).with_context(|| {
            format!(
                "--vram-budget {} is below what is already in use ({}: weights and runtime) plus a {} margin",
                human_bytes(b),
                human_bytes(used),
                human_bytes(VRAM_MARGIN)
            )
        })?;
        memory_budget = Some(memory_budget.map_or(left, |m| m.min(left)));
    }
    let dir = match &a.dir {
        Some(d) if a.resume => Scratch::Kept(d.clone()),
        d => Scratch::Temp(
            tempfile::Builder::new().prefix("folio-bench").tempdir_in(d.clone().unwrap_or_else(std::env::temp_dir))?,
        ),
    };
    let matmul = matmul_flops(model.device(), model.dtype())?;
    // One short prefill first, untimed: the driver compiles each kernel's PTX at its first
    // launch and cuBLAS loads its kernels lazily (seconds, once per process; the driver's cache
    // keeps them across runs on a user's machine), and the peer script warms up the same way.
    let warm_tokens = a.tokens.iter().copied().min().unwrap_or(0).min(WARMUP_TOKENS);
    let warmup = {
        let started = Instant::now();
        let opts = BuildOptions { memory_budget, restart: true, ..BuildOptions::new(kv_dtype) };
        let n = warm_tokens;
        let out = dir.path().join("warm-up.folio");
        let plan = PrefixPlan::raw_tokens((0..n as u32).map(|i| i % model.config().vocab_size as u32).collect());
        context::build(model, &subject.stamp, &plan, &out, &opts, &mut |_| ControlFlow::Continue(()))?;
        std::fs::remove_file(&out).with_context(|| format!("removing {}", out.display()))?;
        started.elapsed().as_secs_f64()
    };
    if !a.json {
        println!("warm-up: a {warm_tokens}-token prefill in {warmup:.2} s (kernel compilation, first allocations)");
    }
    // Ctrl-C stops a long prefill between chunks with its last finished layer kept, so that
    // `--dir D --resume` picks it up again.
    let stop = crate::context_cmd::ctrl_c_flag();
    let mut rows = Vec::new();
    for &n in &a.tokens {
        let opts = BuildOptions { memory_budget, restart: !a.resume, ..BuildOptions::new(kv_dtype) };
        let measure = Measure { matmul, sampler: &sampler, stop: &stop };
        rows.push(one(&subject, n, &opts, dir.path(), (a.append, a.offload), &measure)?);
        if !a.json {
            let row = rows.last().expect("just pushed");
            print_row(row, rows.len() == 1, &subject, matmul);
            if let Some(g) = &row.append {
                println!(
                    "{:>8} grown by {} tokens in {:.2} s; all {} in one go {:.2} s: {:.1}% of it (the new tokens' \
                     share of the work {:.1}%)",
                    "",
                    g.new_tokens,
                    g.append_seconds,
                    row.tokens + g.new_tokens,
                    g.full_seconds,
                    100.0 * g.ratio,
                    100.0 * g.work_share
                );
            }
        }
    }
    let profile = match (a.profile, a.tokens.first()) {
        (true, Some(&n)) => Some(profile_prefill(&subject, n, kv_dtype, memory_budget, dir.path())?),
        _ => None,
    };
    if let (Some(p), false) = (&profile, a.json) {
        print_profile(p);
    }
    if a.json {
        let doc = serde_json::json!({
            "model": subject.name,
            "device": device_name(model.device()),
            "dtype": format!("{:?}", model.dtype()).to_lowercase(),
            "kv_dtype": kv_dtype,
            "threads": candle_core::utils::get_num_threads(),
            "matmul_flops_per_s": matmul,
            "vram_budget_bytes": vram_budget,
            "warmup_seconds": warmup,
            "rows": rows,
            "profile": profile,
        });
        println!("{doc}");
    }
    if let Some(b) = vram_budget {
        if let Some(r) = rows.iter().find(|r| r.peak_vram_bytes.is_some_and(|p| p > b)) {
            anyhow::bail!(
                "the prefill of {} tokens peaked at {} of device memory, over the {} budget",
                r.tokens,
                human_bytes(r.peak_vram_bytes.unwrap_or(0)),
                human_bytes(b)
            );
        }
    }
    Ok(())
}

/// Where one prefill's time went: each span of the forward pass with the device synchronised
/// around it (`folio_models::profile`), and the stages outside the forward passes.
#[derive(Serialize)]
pub(super) struct Profile {
    tokens: usize,
    seconds: f64,
    spans: Vec<ProfileSpan>,
    stages: StageSeconds,
}

#[derive(Serialize)]
pub(super) struct ProfileSpan {
    name: &'static str,
    seconds: f64,
    calls: usize,
}

pub(super) fn profile_prefill(
    subject: &Subject,
    n: usize,
    kv_dtype: KvDtype,
    memory_budget: Option<u64>,
    dir: &std::path::Path,
) -> Result<Profile> {
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(n as u64);
    let plan = PrefixPlan::raw_tokens((0..n).map(|_| rng.random_range(0..vocab)).collect());
    let out = dir.join(format!("profile-{n}.folio"));
    let opts = BuildOptions { memory_budget, restart: true, ..BuildOptions::new(kv_dtype) };
    folio_models::profile::start(folio_models::profile::Clock::Device);
    let report = context::build(model, &subject.stamp, &plan, &out, &opts, &mut |_| ControlFlow::Continue(()));
    let spans = folio_models::profile::finish();
    let report = report?;
    std::fs::remove_file(&out).with_context(|| format!("removing {}", out.display()))?;
    Ok(Profile {
        tokens: n,
        seconds: report.seconds,
        spans: spans.into_iter().map(|(name, seconds, calls)| ProfileSpan { name, seconds, calls }).collect(),
        stages: report.stages,
    })
}

pub(super) fn print_profile(p: &Profile) {
    println!("\nprofile of a {}-token prefill (device synchronised around each op): {:.2} s", p.tokens, p.seconds);
    println!("  {:<28} {:>9} {:>7} {:>7}", "op", "seconds", "share", "calls");
    let st = &p.stages;
    let outside = [
        ("K/V encode", st.encode),
        ("K/V store (writer waits)", st.store),
        ("hidden states (checkpoints)", st.hidden_io),
    ];
    let spans = p.spans.iter().map(|s| (s.name, s.seconds, Some(s.calls)));
    for (name, secs, calls) in spans.chain(outside.into_iter().map(|(n, s)| (n, s, None))) {
        let calls = calls.map_or(String::new(), |c| c.to_string());
        println!("  {:<28} {:>9.3} {:>6.1}% {:>7}", name, secs, 100.0 * secs / p.seconds, calls);
    }
}

/// What each timed row is measured against: the large-matmul rate, the device memory sampler,
/// and the Ctrl-C flag that stops a row between chunks.
#[derive(Clone, Copy)]
pub(super) struct Measure<'a> {
    matmul: f64,
    sampler: &'a MemorySampler,
    stop: &'a std::sync::atomic::AtomicBool,
}

/// Where the bench's context files go: a temporary folder, or `--dir` kept for `--resume`.
pub(super) enum Scratch {
    Temp(tempfile::TempDir),
    Kept(PathBuf),
}

impl Scratch {
    fn path(&self) -> &std::path::Path {
        match self {
            Self::Temp(t) => t.path(),
            Self::Kept(p) => p,
        }
    }
}

pub(super) fn one(
    subject: &Subject,
    n: usize,
    opts: &BuildOptions,
    dir: &std::path::Path,
    (append, offload): (Option<usize>, bool),
    m: &Measure<'_>,
) -> Result<Row> {
    let Measure { matmul, sampler, stop } = *m;
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(n as u64);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let plan = PrefixPlan::raw_tokens(tokens);
    let out = dir.join(format!("bench-{n}.folio"));
    // Peak RSS per length: Linux resets VmHWM when "5" is written to clear_refs.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    sampler.reset();
    let report = context::build(model, &subject.stamp, &plan, &out, opts, &mut |_| {
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    let (peak, peak_vram) = (peak_rss(), sampler.peak());
    // On stderr at once: at a million tokens the reopen after it takes a minute more, and a run
    // cut short there still says what the prefill did.
    eprintln!(
        "prefilled {n} tokens in {:.2} s ({:.0} tokens/s; {} of {} layers computed here), peak VRAM {}, peak RSS {}; \
         reopening",
        report.seconds,
        report.tokens_per_s,
        report.layers - report.resumed_layers,
        report.layers,
        peak_vram.map_or("n/a".into(), human_bytes),
        peak.map_or("n/a".into(), human_bytes)
    );
    // Open as `folio chat --context` does (the model's fingerprint checked), then a question
    // through the model until the first token's logits exist, on the tier a user's settings
    // would put it: the offloaded one when the decoded layers do not fit the device.
    let cfg = model.config();
    let decoded = (cfg.kv_bytes_per_token(model.dtype().size_in_bytes()) * n) as u64;
    let tier =
        if offload || opts.memory_budget.is_some_and(|b| decoded > b) { Tier::Offloaded } else { Tier::Resident };
    let mut reopen = || -> Result<Reopen> {
        let start = Instant::now();
        let file = match &subject.made {
            Made::Loaded(engine) => engine.open_context(&out)?,
            Made::Random(_) => {
                let file = folio_models::context::ContextFile::open(&out)?;
                if file.header().model.fingerprint != subject.stamp.fingerprint {
                    anyhow::bail!("{} was not made by this shape", out.display());
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
        let question: Vec<u32> = (0..QUESTION_TOKENS).map(|_| rng.random_range(0..vocab)).collect();
        let logits = model.forward(&question, kv.as_mut(), &Dense, Logits::Last)?;
        logits.argmax(1)?.to_vec1::<u32>()?;
        let seconds = start.elapsed().as_secs_f64();
        Ok(Reopen { seconds, open, store, question: seconds - open - store, in_place })
    };
    drop_page_cache(&out);
    let reopen_cold = reopen()?;
    let reopen_warm = reopen()?;
    // The reopen keeps every layer on the device; what the pool keeps of it afterwards is not
    // the next row's.
    folio_runtime::device::trim_pool(model.device())?;
    let disk_read_bytes_per_s = disk_read_rate(&out)?;
    let append = append.map(|m| grow(subject, &out, m, opts, dir, &mut rng)).transpose()?;
    std::fs::remove_file(&out).with_context(|| format!("removing {}", out.display()))?;
    let computed = report.layers - report.resumed_layers;
    let flops = prefill_flops(model.config(), n) * computed as f64 / report.layers as f64 / report.seconds;
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

/// Grows the context at `base` by `m` random tokens, and prefills the same tokens in one go.
pub(super) fn grow(
    subject: &Subject,
    base: &std::path::Path,
    m: usize,
    opts: &BuildOptions,
    dir: &std::path::Path,
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
        std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))?;
    }
    let cfg = model.config();
    let work_share = 1.0 - prefill_flops(cfg, n) / prefill_flops(cfg, n + m);
    Ok(AppendRow { new_tokens: m, append_seconds, full_seconds, ratio: append_seconds / full_seconds, work_share })
}

pub(super) fn print_row(r: &Row, first: bool, subject: &Subject, matmul: f64) {
    if first {
        println!(
            "model {} on {} ({:?}, {} threads); large-matmul rate {:.1} GFLOP/s",
            subject.name,
            device_name(subject.model().device()),
            subject.model().dtype(),
            candle_core::utils::get_num_threads(),
            matmul / 1e9
        );
        println!(
            "{:>8} {:>7} {:>10} {:>9} {:>8} {:>7} {:>6} {:>10} {:>10} {:>11} {:>10} {:>12} {:>8}",
            "tokens",
            "layers",
            "prefill s",
            "tok/s",
            "GFLOP/s",
            "÷peak",
            "chunk",
            "peak RSS",
            "peak VRAM",
            "working set",
            "file",
            "reopen→1st s",
            "÷prefill"
        );
    }
    let opt = |x: Option<u64>| x.map_or("-".into(), human_bytes);
    println!(
        "{:>8} {:>7} {:>10.2} {:>9.0} {:>8.2} {:>6.1}% {:>6} {:>10} {:>10} {:>11} {:>10} {:>12} {:>8}",
        r.tokens,
        r.layers_computed,
        r.prefill_seconds,
        r.tokens_per_s,
        r.flops_per_s / 1e9,
        100.0 * r.flops_ratio_to_matmul,
        r.chunk,
        opt(r.peak_rss_bytes),
        opt(r.peak_vram_bytes),
        human_bytes(r.working_set_bytes),
        human_bytes(r.file_bytes),
        format!("{:.4}", r.reopen_first_token_seconds),
        format!("{:.3}%", 100.0 * r.reopen_ratio),
    );
    let st = &r.stages;
    println!(
        "{:>8} seconds in: compute {:.2}, hidden states {:.2} (kept in {:?}, checkpoints: {}), K/V encode {:.2}, \
         store {:.2}",
        "", st.compute, st.hidden_io, r.hidden_in, r.checkpoints, st.encode, st.store
    );
    let parts = |x: &Reopen| {
        let how = match (r.reopen_tier, x.in_place) {
            ("offloaded", true) => ", rows read in place",
            ("offloaded", false) => ", rows copied: the GPU would not register the file's mapping",
            _ => "",
        };
        format!("open {:.3}, K/V store {:.3}, question {:.3}{how}", x.open, x.store, x.question)
    };
    println!(
        "{:>8} reopen on the {} tier: from disk {:.3} s ({}; the file over the disk's {}/s read rate: {:.2} s), \
         cached {:.3} s ({})",
        "",
        r.reopen_tier,
        r.reopen_cold.seconds,
        parts(&r.reopen_cold),
        human_bytes(r.disk_read_bytes_per_s as u64),
        r.file_bytes as f64 / r.disk_read_bytes_per_s,
        r.reopen_warm.seconds,
        parts(&r.reopen_warm)
    );
}

/// Multiply-adds ×2 of a layer-major prefill of `n` tokens: projections and MLP per token and
/// layer, causal attention (QKᵀ and PV over n²/2 pairs), one LM-head row.
pub(super) fn prefill_flops(c: &ModelConfig, n: usize) -> f64 {
    let (h, q, kv, i) = (
        c.hidden_size as f64,
        (c.num_heads * c.head_dim) as f64,
        (c.num_kv_heads * c.head_dim) as f64,
        c.intermediate_size as f64,
    );
    let per_token_layer = 2.0 * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i);
    let n = n as f64;
    let attention = 2.0 * 2.0 * q * n * n / 2.0;
    c.num_layers as f64 * (per_token_layer * n + attention) + 2.0 * h * c.vocab_size as f64
}

/// The disk's sequential read rate, bytes/s: the first [`DISK_PROBE_BYTES`] of `path` evicted
/// from the page cache and read back in large pieces.
pub(super) fn disk_read_rate(path: &std::path::Path) -> Result<f64> {
    use std::io::Read;
    drop_page_cache(path);
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut buf = vec![0u8; DISK_PROBE_PIECE];
    let (start, mut read) = (Instant::now(), 0usize);
    while read < DISK_PROBE_BYTES {
        match f.read(&mut buf).with_context(|| format!("reading {}", path.display()))? {
            0 => break,
            got => read += got,
        }
    }
    Ok(read as f64 / start.elapsed().as_secs_f64())
}

/// Evicts a fully written file from the page cache, so the reopen reads from disk as after a reboot.
pub(super) fn drop_page_cache(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::File::open(path) {
        // SAFETY: advisory call on a valid, open file descriptor.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}
