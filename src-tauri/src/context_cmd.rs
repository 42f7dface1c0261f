//! `folio prefill`, `folio context info` and `folio context index`: the context-file flows
//! (`folio chat --context` is the session API's, in cli.rs).

use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use folio_models::context::format::SectionKind;
use folio_models::context::staging;
use folio_models::context::{
    self, Bookkeeping, BuildOptions, BuildReport, Builder, Change, ContextFile, DocumentSpan, KvDtype, Progress,
};
use folio_models::error::human_bytes;
use folio_models::prefill::PrefillMode;
use folio_models::Engine;
use serde_json::json;

use crate::cli::Common;
use crate::{ingest, library_cmd, listing};

#[derive(Args)]
pub struct PrefillArgs {
    /// Documents: files or folders (recursive), in order.
    #[arg(long, num_args = 1.., required_unless_present = "context", conflicts_with = "context")]
    docs: Vec<PathBuf>,
    /// Change this saved context: --add documents (only they are prefilled, after its tokens:
    /// the saved K/V stays valid, attention is causal) or --remove one (the documents after it
    /// are prefilled again); the file is replaced atomically unless --out names another. Alone,
    /// it finishes an interrupted change.
    #[arg(long)]
    context: Option<PathBuf>,
    /// Documents to add to --context: files or folders, in order.
    #[arg(long, num_args = 1.., requires = "context", conflicts_with = "remove")]
    add: Vec<PathBuf>,
    /// A document to take out of --context (its path or title, as `folio context info` lists
    /// them); the documents after it are read again and must be unchanged.
    #[arg(long, requires = "context")]
    remove: Option<String>,
    /// The context file to write (with --context, default: that file).
    #[arg(long, required_unless_present = "context")]
    out: Option<PathBuf>,
    /// How K/V is stored: bf16 (default), bf16-fp8 (bf16 keys, fp8 values: about 3/4 the size,
    /// nearly bf16's accuracy), fp8 (e4m3 + per-row scale, half the size) or f32. A grown
    /// context keeps its own.
    #[arg(long)]
    kv_dtype: Option<String>,
    /// Memory the prefill may use beyond the model weights, e.g. 2GiB, 512MiB (default: a
    /// chunk of 2048 tokens).
    #[arg(long)]
    memory_budget: Option<String>,
    /// How the prefill attends: dense (every earlier key, the default) or sparse[:KNOBS]
    /// (each block of 64 queries to the sinks, its 2,048 best keys and a 1,024-key window;
    /// knobs block, keys, sinks, window, e.g. sparse:keys=4096). Sparse is faster on long
    /// contexts and may cost answers (docs/quality.md); the file records which made it. A
    /// resume keeps the interrupted prefill's.
    #[arg(long)]
    prefill: Option<String>,
    /// System message placed before the documents (chat models).
    #[arg(long, conflicts_with = "context")]
    system: Option<String>,
    /// Replace the context file already at --out (without it, Folio says so; a file at --out
    /// that is not a context is never replaced).
    #[arg(long)]
    force: bool,
    /// Discard an interrupted prefill of the same output instead of refusing.
    #[arg(long)]
    restart: bool,
    /// Do not list the context in the library (`folio library`).
    #[arg(long)]
    no_library: bool,
    /// Prefill nothing: list each document with its tokens and each skip with its reason, the
    /// total against the model's context length, and the file, memory, disk and time the
    /// prefill would need (what the window's staging sheet shows).
    #[arg(long, conflicts_with = "context")]
    dry_run: bool,
    /// The report as JSON on stdout, and the progress as JSON lines on stderr
    /// (`{"progress": {layer, layers, layer_tokens, tokens, fraction, tokens_per_s, eta_s}}`).
    #[arg(long)]
    json: bool,
}

/// A flag Ctrl-C sets: the prefill stops after its current chunk and checkpoints its last
/// finished layer. Without the handler (one already installed) Ctrl-C simply kills the process,
/// which resumes from the last checkpoint written.
pub fn ctrl_c_flag() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let _ = ctrlc::set_handler(move || f.store(true, Ordering::SeqCst));
    flag
}

pub fn prefill(common: &Common, a: PrefillArgs) -> Result<()> {
    if a.dry_run {
        return dry_run(common, &a);
    }
    let memory_budget = a.memory_budget.as_deref().map(parse_bytes).transpose()?;
    let explicit_dtype = a.kv_dtype.as_deref().map(KvDtype::parse).transpose()?;
    let explicit_mode = a.prefill.as_deref().map(PrefillMode::parse).transpose()?;
    let out = a.out.clone().or_else(|| a.context.clone()).context("--out is required")?;
    // Before anything opens it (a named pipe would wait for a writer forever), and before the
    // model loads: a path that cannot be written is said at once.
    context::check_replaceable(&out)?;
    let (engine, change, ingested) = what_to_make(common, &a, &out)?;
    check_out(&a, &out, &ingested)?;
    let mut builder = Builder::new(&engine, &out).restart(a.restart);
    if let Some(base) = &a.context {
        builder = builder.from(base);
    }
    let planned = builder.plan(change, &ingest::Files)?;
    warn_about_shrinking(&ingested, &planned.plan.documents);
    let keys = listing::PrefillKeys::new(&engine, &common.device_label()?);
    let mode = planned.prefill(explicit_mode);
    // The last cost of this kind of prefill (a sparse one has none until one has run here).
    let prior_cost = crate::library_cmd::stored_costs(&keys, vec![mode]).pop().and_then(|(_, c)| c);
    if planned.keep > 0 && !a.json {
        let (keep, n) = (planned.keep, planned.computed());
        let layers = engine.config().num_layers;
        let time =
            prior_cost.map_or(String::new(), |c| format!(", about {}", human_secs(c.seconds(layers, keep, keep + n))));
        eprintln!("prefilling {n} tokens after the {keep} kept as saved{time}");
    }
    let kv_dtype = planned.kv_dtype(explicit_dtype, context::DEFAULT_KV_DTYPE);
    let opts =
        BuildOptions { memory_budget, restart: a.restart, prior_cost, prefill: mode, ..BuildOptions::new(kv_dtype) };
    let stop = ctrl_c_flag();
    let bar = progress_bar(a.json);
    let mut on_progress = |p: &Progress| {
        if let Some(bar) = &bar {
            bar.set_position((p.fraction * 1000.0) as u64);
            let eta = p.eta_s.map_or(String::new(), |s| format!(", ETA {}", human_secs(s)));
            bar.set_message(format!(
                "layer {}/{} · {}/{} tokens · {:.0} tok/s{eta}",
                p.layer + 1,
                p.layers,
                p.layer_tokens,
                p.tokens,
                p.tokens_per_s
            ));
        } else if a.json {
            // With --json, progress is a feed too: one JSON line per chunk on stderr.
            eprintln!("{}", json!({ "progress": p }));
        }
        if stop.load(Ordering::SeqCst) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    // A change written over the file it changes (not to another --out) keeps its library row
    // whatever happens: a missing file is the row's `missing` status.
    let changes_a_file = a.context.as_deref() == Some(out.as_path());
    let mut listing = if a.no_library { None } else { library_cmd::listing(keys, changes_a_file) };
    let book: &mut dyn Bookkeeping = match listing.as_mut() {
        Some(l) => l,
        None => &mut (),
    };
    let report = builder.run(&planned, &opts, book, &mut on_progress)?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    print_report(&report, &ingested, &planned.plan.documents, a.json);
    Ok(())
}

/// The engine and the change `folio prefill`'s flags ask for, with the documents read for it:
/// the flags and the documents are checked before the model loads (which may take long).
fn what_to_make(common: &Common, a: &PrefillArgs, out: &Path) -> Result<(Engine, Change, ingest::Ingested)> {
    let Some(base) = &a.context else {
        let ingested = ingest::collect(&a.docs)?;
        warn_about(&ingested);
        let change = Change::New { documents: ingested.documents.clone(), system: a.system.clone() };
        return Ok((common.engine()?, change, ingested));
    };
    let source = ContextFile::open(base)?.header().model.source.clone();
    let (change, ingested) = match (&a.remove, a.add.is_empty()) {
        (Some(doc), _) => (Change::Remove(doc.clone()), ingest::Ingested::default()),
        (None, false) => {
            let ingested = ingest::collect(&a.add)?;
            warn_about(&ingested);
            (Change::Add(ingested.documents.clone()), ingested)
        }
        // --context alone finishes an interrupted change of it.
        (None, true) => match context::pending(out)? {
            Some(p) if p.base_tokens > 0 => (Change::Resume, ingest::Ingested::default()),
            _ => bail!(
                "--context needs --add PATH... (documents to add) or --remove DOC (a document to take out); there \
                 is no interrupted change of {} to finish",
                out.display()
            ),
        },
    };
    Ok((common.engine_or(&source)?, change, ingested))
}

/// What may be at `--out`: nothing, the context being changed, or another context file
/// (replaced with a warning, silently with --force). A person's other file — their notes, or
/// a document this prefill reads — is never replaced.
fn check_out(a: &PrefillArgs, out: &Path, ingested: &ingest::Ingested) -> Result<()> {
    let Ok(here) = out.canonicalize() else { return Ok(()) };
    let read = ingested
        .documents
        .iter()
        .any(|d| folio_context_file::os_path::from_stored(&d.path).canonicalize().is_ok_and(|p| p == here));
    if read {
        bail!("--out {} is one of the documents this prefill reads: write the context to another file", out.display());
    }
    if a.context.as_deref().and_then(|c| c.canonicalize().ok()).as_deref() == Some(here.as_path()) {
        return Ok(());
    }
    let mut magic = [0u8; 8];
    let is_context = std::fs::File::open(out).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok()
        && magic == folio_context_file::format::MAGIC;
    if !is_context {
        bail!(
            "--out {} exists and is not a Folio context file: Folio never replaces another file; choose a new path",
            out.display()
        );
    }
    if !a.force {
        eprintln!(
            "warning: replacing the context file {} (--force says you mean it; a later Folio will refuse without it)",
            out.display()
        );
    }
    Ok(())
}

fn warn_about(ingested: &ingest::Ingested) {
    for (path, why) in &ingested.skipped {
        eprintln!("skipped {}: {why}", path.display());
    }
    for (d, notes) in ingested.documents.iter().zip(&ingested.notes) {
        for w in &notes.warnings {
            eprintln!("warning {}: {w}", d.path);
        }
    }
}

/// `--dry-run`'s and the staging sheet's warning for a document that became far fewer tokens
/// than its text would as prose, said before the prefill starts.
fn warn_about_shrinking(ingested: &ingest::Ingested, spans: &[DocumentSpan]) {
    for d in &ingested.documents {
        let Some(span) = spans.iter().find(|s| s.path == d.path) else { continue };
        if let Some(w) = staging::shrink_warning(d.text.len(), span.end - span.start) {
            eprintln!("warning {}: {w}", d.path);
        }
    }
}

fn print_report(report: &BuildReport, ingested: &ingest::Ingested, documents: &[DocumentSpan], json: bool) {
    let peak = folio_runtime::host_memory::peak_rss();
    if json {
        let skipped: Vec<_> = ingested.skipped.iter().map(|(p, r)| json!({"path": p, "reason": r})).collect();
        println!("{}", json!({ "report": report, "peak_rss_bytes": peak, "skipped": skipped, "documents": documents }));
        return;
    }
    println!(
        "{}: {} documents, {} tokens, {} K/V, {}",
        report.path.display(),
        report.documents,
        report.tokens,
        report.kv_dtype.name(),
        human_bytes(report.file_bytes)
    );
    if report.prefill != folio_models::context::DENSE_PREFILL {
        println!("prefill      {} (attention of the computed tokens)", report.prefill);
    }
    if report.computed_tokens < report.tokens {
        println!("grown by {} tokens ({} documents in all)", report.computed_tokens, report.documents);
    }
    let resumed = if report.resumed_layers > 0 {
        format!(" (resumed after layer {})", report.resumed_layers)
    } else {
        String::new()
    };
    println!(
        "prefill {:.1} s, {:.0} tokens/s{resumed}; working set <= {}, peak RSS {}",
        report.seconds,
        report.tokens_per_s,
        human_bytes(report.working_set_bytes),
        peak.map_or("unknown".into(), human_bytes)
    );
}

/// `folio prefill --dry-run`: the staging sheet in the terminal.
fn dry_run(common: &Common, a: &PrefillArgs) -> Result<()> {
    let engine = common.engine()?;
    let kv_dtype = a.kv_dtype.as_deref().map(KvDtype::parse).transpose()?.unwrap_or(context::DEFAULT_KV_DTYPE);
    let staged = ingest::stage(&engine, &a.docs, &|_, _, _| {});
    let counted: usize = staged.documents.iter().map(|d| d.tokens).sum();
    let folder = match a.out.as_deref().and_then(std::path::Path::parent) {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => std::env::current_dir()?,
    };
    let mode = a.prefill.as_deref().map(PrefillMode::parse).transpose()?.unwrap_or_default();
    mode.check(engine.config(), &engine.name)?;
    let keys = listing::PrefillKeys::new(&engine, &common.device_label()?);
    let choices = library_cmd::stored_costs(&keys, staging::prefill_modes(&engine, mode));
    let est = staging::estimate(&engine, &staged.documents, kv_dtype, &folder, &choices)?;
    let tokens = est.tokens;
    if a.json {
        println!("{}", json!({ "staged": staged, "estimate": est, "tokens": tokens }));
    } else {
        for d in &staged.documents {
            let parts = match d.parts.len() {
                0 => String::new(),
                n => format!("  ({n} parts: {} …)", d.parts[0]),
            };
            println!("{:>10} tokens  {:<8} {:>10}  {}{parts}", d.tokens, d.kind, human_bytes(d.file_bytes), d.path);
            for w in &d.warnings {
                println!("           warning: {w}");
            }
        }
        for s in &staged.skipped {
            println!("skipped {}: {}", s.path, s.reason);
        }
        println!(
            "{} documents, {tokens} tokens (up to {} fit: the model's {} less {} kept for the answer); \
             counted in {:.2} s, {:.0} tokens/s",
            staged.documents.len(),
            est.limit,
            est.context_length,
            est.context_length - est.limit,
            staged.seconds,
            counted as f64 / staged.seconds.max(1e-9)
        );
        println!(
            "file {} ({} free), scratch {}",
            human_bytes(est.file_bytes),
            est.disk_free_bytes.map_or("?".into(), human_bytes),
            human_bytes(est.scratch_bytes)
        );
        print_choices(&est);
    }
    if !est.fits {
        bail!(
            "{tokens} tokens are {} over what the model reads ({}): remove documents; Folio never truncates",
            tokens - est.limit,
            est.limit
        );
    }
    Ok(())
}

/// The dry run's lines per prefill it could make: memory, time and measured cost in answers
/// (the staging sheet's choice), the one `--prefill` asked for first.
fn print_choices(est: &staging::Estimate) {
    for c in &est.choices {
        let kind = c.prefill.split(':').next().unwrap_or("dense");
        let time = match (c.predicted_seconds, c.rate_tokens_per_s) {
            (Some(s), Some(r)) => format!(
                "about {} at {r:.0} tokens/s (fitted to the last {kind} prefill with this model here)",
                human_secs(s)
            ),
            _ => format!("measured by the first {kind} prefill with this model here"),
        };
        let mark = if c.prefill == est.prefill { "*" } else { " " };
        println!(
            "{mark} prefill {}: working memory {} beyond the model; time {time}",
            c.prefill,
            human_bytes(c.working_set_bytes)
        );
        for a in &c.answers {
            let lost = match a.lost {
                0 => String::new(),
                n => format!("; it loses {n} a dense prefill answers right"),
            };
            println!(
                "    at {} tokens: {} of {} answers right (over a dense prefill {}), KL {:.4} nats, top-1 {:.1}% ({}){lost}",
                a.length,
                a.answered,
                a.prompts,
                a.dense_answered,
                a.mean_kl,
                a.top1_agreement * 100.0,
                a.measured,
            );
        }
        if kind != "dense" && c.answers.is_empty() {
            println!("    its cost in answers is not measured on this model (`folio eval fidelity --prefill`, then `folio eval prefill-cost`)");
        }
    }
}

fn progress_bar(json: bool) -> Option<indicatif::ProgressBar> {
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(1000);
    let style = indicatif::ProgressStyle::with_template("{bar:30} {percent:>3}% {msg}").ok()?;
    bar.set_style(style);
    Some(bar)
}

fn human_secs(s: f64) -> String {
    match s as u64 {
        s if s >= 3600 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{s}s"),
    }
}

/// `4GiB`, `512MiB`, `2G`, `1.5GB`, `1000000`.
pub(crate) fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 =
        num.trim().parse().with_context(|| format!("bad size \"{s}\": use e.g. 4GiB, 512MiB or a byte count"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024f64.powi(2),
        "g" | "gb" => 1e9,
        "gib" => 1024f64.powi(3),
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        _ => bail!("bad size unit in \"{s}\": use B, KiB, MiB, GiB, TiB (or kB, MB, GB, TB)"),
    };
    if !(n > 0.0 && n.is_finite()) {
        bail!("bad size \"{s}\": it must be positive");
    }
    // (2^64 bytes and more would saturate to 16 EiB, not be refused.)
    if n * mult >= u64::MAX as f64 {
        bail!("bad size \"{s}\": more bytes than a size can hold");
    }
    Ok((n * mult) as u64)
}

#[derive(Subcommand)]
pub enum ContextCommand {
    /// Model, tokens, documents and section sizes of a context file.
    Info(InfoArgs),
    /// Build an attention method's index (MagicPIG tables, Double Sparsity labels, IVF lists)
    /// for every layer and store it in the context file, so chats with those settings load it
    /// instead of building it on each open. Rewrites the file atomically.
    Index(IndexArgs),
}

#[derive(Args)]
pub struct IndexArgs {
    file: PathBuf,
    #[command(flatten)]
    attention: crate::cli::MethodArgs,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct InfoArgs {
    file: PathBuf,
    /// Check every section's checksum (reads the whole file).
    #[arg(long)]
    verify: bool,
    #[arg(long)]
    json: bool,
}

pub fn context(common: &Common, cmd: ContextCommand) -> Result<()> {
    match cmd {
        ContextCommand::Info(a) => info(a),
        ContextCommand::Index(a) => index(common, a),
    }
}

fn index(common: &Common, a: IndexArgs) -> Result<()> {
    let started = Instant::now();
    let source = ContextFile::open(&a.file)?.header().model.source.clone();
    let engine = common.engine_or(&source)?;
    let stored = engine.store_index(&a.file, &a.attention.method, |layer, layers| {
        if !a.json {
            eprint!("\rindexing: layer {layer}/{layers}");
        }
        ControlFlow::Continue(())
    })?;
    if !a.json {
        eprintln!();
    }
    let seconds = started.elapsed().as_secs_f64();
    if a.json {
        println!(
            "{}",
            json!({ "file": a.file, "attention": stored.settings, "sections": stored.sections,
                    "index_bytes": stored.index_bytes, "file_bytes": stored.header.file_bytes, "seconds": seconds })
        );
    } else {
        println!(
            "stored {} index sections ({}) in {}; the file is now {} ({seconds:.2} s)",
            stored.sections,
            human_bytes(stored.index_bytes),
            a.file.display(),
            human_bytes(stored.header.file_bytes)
        );
    }
    Ok(())
}

fn info(a: InfoArgs) -> Result<()> {
    let file = ContextFile::open(&a.file)?;
    let verified = if a.verify { Some(file.verify()?) } else { None };
    let h = file.header();
    let sum = |kind: SectionKind| -> u64 { h.sections.iter().filter(|s| s.kind == kind).map(|s| s.bytes).sum() };
    if a.json {
        let doc = json!({
            "path": a.file,
            "model": h.model,
            "kv_dtype": h.kv_dtype,
            "tokens": h.tokens,
            "layers": h.layers,
            "file_bytes": h.file_bytes,
            "prompt": h.prompt,
            "prefill": h.prefill_runs(),
            "documents": file.documents(),
            "sections": h.sections,
            "verified": verified,
        });
        println!("{doc}");
        return Ok(());
    }
    println!("context      {}", a.file.display());
    println!("model        {} ({}, {} layers)", h.model.name, h.model.fingerprint.architecture, h.layers);
    println!("tokens       {}", h.tokens);
    println!("K/V          {} ({} KV heads x {} dims)", h.kv_dtype.name(), h.kv_heads, h.head_dim);
    println!("file         {}", human_bytes(h.file_bytes));
    for run in h.prefill_runs() {
        println!("prefill      {} (tokens {}..{})", run.mode, run.from, run.to);
    }
    println!(
        "sections     tokens {}, documents {}, keys {}, values {}",
        human_bytes(sum(SectionKind::Tokens)),
        human_bytes(sum(SectionKind::Documents)),
        human_bytes(sum(SectionKind::Keys)),
        human_bytes(sum(SectionKind::Values))
    );
    println!("documents    {}", file.documents().len());
    for d in file.documents() {
        println!("  {:>9} tokens  {}", d.end - d.start, d.path);
    }
    let mut indexes: Vec<(&str, u64, usize)> = Vec::new();
    for s in h.sections.iter().filter(|s| s.kind == SectionKind::Index) {
        let name = s.name.as_deref().unwrap_or("?");
        match indexes.iter_mut().find(|i| i.0 == name) {
            Some(i) => (i.1, i.2) = (i.1 + s.bytes, i.2 + 1),
            None => indexes.push((name, s.bytes, 1)),
        }
    }
    for (name, bytes, layers) in indexes {
        println!("index        {name}: {layers} layers, {}", human_bytes(bytes));
    }
    if let Some(v) = verified {
        println!(
            "verified     {} sections, {} in {:.2} s: all checksums match",
            v.sections,
            human_bytes(v.bytes),
            v.seconds
        );
    }
    Ok(())
}
