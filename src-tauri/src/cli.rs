//! Headless subcommands. Each one loads what it needs, does one job, and prints either a
//! human-readable result or (with `--json`) one JSON document.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use folio_models::attention::{Attention, IndexSource, MethodChoice, Path, Tier};
use folio_models::context::ContextFile;
use folio_models::conversation::Conversation;
use folio_models::session::{self, GenerationSettings, Session};
use folio_models::{device_name, parse_device, parse_dtype, Engine};
use serde_json::json;

/// Options shared by every subcommand.
pub struct Common {
    pub model: Option<String>,
    pub device: String,
    pub dtype: String,
    /// `--quantize`: q8_0 or q4k, for a safetensors model.
    pub quantize: Option<String>,
    /// `--accept-other-weights`: read a context made with other weights of the model.
    pub accept_other_weights: bool,
}

impl Common {
    pub(crate) fn engine(&self) -> Result<Engine> {
        let spec = self
            .model
            .as_deref()
            .context("--model is required: a model folder, a GGUF file or a Hugging Face repo id")?;
        self.load(spec)
    }

    /// The device as the library's prefill rates name it ("cpu", "CUDA 0 (…)").
    pub(crate) fn device_label(&self) -> Result<String> {
        Ok(device_name(&parse_device(&self.device)?))
    }

    /// `--quantize`, checked.
    fn quantization(&self) -> Result<Option<folio_models::model::Quantize>> {
        Ok(self.quantize.as_deref().map(folio_models::model::Quantize::parse).transpose()?)
    }

    /// `--model` if given, else `source` (the model a context file names), which is found
    /// locally or refused: a file's content never starts a download.
    pub(crate) fn engine_or(&self, source: &str) -> Result<Engine> {
        match &self.model {
            Some(model) => self.load(model),
            None => {
                let device = parse_device(&self.device)?;
                let dtype = parse_dtype(&self.dtype, &device)?;
                let engine = Engine::load_cached(source, &device, dtype, self.quantization()?)?;
                engine.accept_other_weights(self.accept_other_weights);
                Ok(engine)
            }
        }
    }

    /// Loads `spec`; a repo id not cached yet downloads first, with a bar on stderr (bytes,
    /// rate, time left) when stderr is a terminal.
    pub(crate) fn load(&self, spec: &str) -> Result<Engine> {
        let device = parse_device(&self.device)?;
        let dtype = parse_dtype(&self.dtype, &device)?;
        let quantize = self.quantization()?;
        let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(download_bar).flatten();
        let engine = Engine::load_quantized(spec, &device, dtype, quantize, &mut |p| {
            if let Some(bar) = &bar {
                bar.set_length(p.total);
                bar.set_position(p.done);
                bar.set_message(format!("{} {}", p.repo, p.file));
            }
            std::ops::ControlFlow::Continue(())
        });
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        let engine = engine?;
        engine.accept_other_weights(self.accept_other_weights);
        Ok(engine)
    }
}

/// Tells the person on stderr that a context is read with other weights than made it.
pub(crate) fn warn_other_weights(verdict: &folio_models::engine::ContextModel) {
    if let folio_models::engine::ContextModel::OtherWeights(differences) = verdict {
        eprintln!(
            "warning: this context was made with other weights of the model ({}); answering from its K/V with \
             these weights (--accept-other-weights)",
            differences.join("; ")
        );
    }
}

#[derive(Args)]
pub struct ChatArgs {
    /// The question (rendered with the model's chat template).
    #[arg(conflicts_with = "raw", required_unless_present = "raw")]
    pub(crate) question: Option<String>,
    /// Text given to the model as is: no chat template (BOS added per the model).
    #[arg(long, conflicts_with = "context")]
    pub(crate) raw: Option<String>,
    /// System message (with --context, the one given at prefill is used).
    #[arg(long, conflicts_with_all = ["raw", "context"])]
    system: Option<String>,
    /// Ask over a saved context file (from `folio prefill`); --model defaults to the model
    /// that made it.
    #[arg(long)]
    context: Option<PathBuf>,
    /// Keep a multi-turn conversation in this JSON file (created if missing).
    #[arg(long = "continue", value_name = "CHAT_JSON", conflicts_with = "raw")]
    pub(crate) continue_file: Option<PathBuf>,
    /// Keep the saved context in host memory and move only the rows the method picks to the
    /// device (the offloaded tier; `folio methods` lists which methods run there); without it,
    /// whole layers are decoded into device memory as they are used.
    #[arg(long, requires = "context")]
    pub(crate) offload: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = session::DEFAULT_MAX_TOKENS)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: the model's generation_config.json.
    #[arg(long)]
    temperature: Option<f64>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this string appears (not included in the answer). Repeatable.
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    pub(crate) attention: MethodArgs,
    /// Weigh the answer's sources (`--json`'s "sources") by the attention mass of the rows read,
    /// as the window does: a pass over the visible keys per decode call (docs/engine.md).
    #[arg(long)]
    sources: bool,
    /// Print one JSON document instead of streaming text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The attention method flag, shared by every command that runs the model.
#[derive(Args)]
pub struct MethodArgs {
    /// Attention method, its budget and knobs: METHOD[:BUDGET][:KEY=VALUE]..., e.g. hip,
    /// hip:2048, magicpig:2%:bits=9. Without a budget, the method's paper default. `folio methods`
    /// lists every method with its budget and knobs.
    #[arg(long, default_value_t = MethodChoice::default(), value_parser = parse_method)]
    pub(crate) method: MethodChoice,
}

/// clap's reader of one [`MethodChoice`].
pub(crate) fn parse_method(text: &str) -> std::result::Result<MethodChoice, String> {
    MethodChoice::parse(text).map_err(|e| e.to_string())
}

impl MethodArgs {
    /// The attention method the flag asks for, on `engine`'s model (Double Sparsity reads the
    /// model's channel calibration).
    pub(crate) fn build(&self, engine: &Engine) -> Result<Box<dyn Attention>> {
        let resources = engine.resources(std::slice::from_ref(&self.method))?;
        Ok(self.method.build(&resources)?)
    }
}

impl ChatArgs {
    fn settings(&self) -> GenerationSettings {
        GenerationSettings {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            system: self.system.clone(),
        }
    }
}

/// `folio chat`: a question to the bare model or over a saved context, through the session
/// API (the window's path too); `--raw` text goes to the model without a template.
pub fn chat(common: &Common, a: ChatArgs) -> Result<()> {
    let method = &a.attention.method;
    let tier = if a.offload { Tier::Offloaded } else { Tier::Resident };
    if a.context.is_some() {
        // Before minutes of loading: a method this tier cannot run.
        method.spec()?.check_tier(tier)?;
    }
    let opening = Instant::now();
    let file = a.context.as_deref().map(ContextFile::open).transpose()?;
    let engine = Arc::new(match &file {
        Some(f) => common.engine_or(&f.header().model.source)?,
        None => common.engine()?,
    });
    let loaded = opening.elapsed().as_secs_f64();
    if let Some(raw) = &a.raw {
        return chat_raw(&engine, &a, raw);
    }
    let question = a.question.as_deref().context("give a question, or --raw TEXT")?;
    let mut session = match file {
        Some(f) => {
            warn_other_weights(&engine.check_context(&f)?);
            Session::over(engine.clone(), Arc::new(f), tier)?
        }
        None => Session::bare(engine.clone()),
    };
    session.weigh_sources(a.sources);
    let open_seconds = opening.elapsed().as_secs_f64() - loaded;
    let mut conv = match (&a.continue_file, session.context()) {
        (Some(p), Some(file)) => Conversation::load_or_new(p, file)?,
        (Some(p), None) if p.exists() => Conversation::load(p)?,
        (_, Some(_)) => session.new_conversation(),
        (_, None) => Conversation::bare(a.system.clone()),
    };
    let mut stdout = std::io::stdout().lock();
    let answer = session.ask(&mut conv, question, method, &a.settings(), |piece| {
        if !a.json {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    if answer.index.values().any(|s| *s == IndexSource::Rebuilt) {
        eprintln!(
            "warning: a stored {} index in {} is damaged; it was rebuilt for this answer \
             (run `folio context index` again to store a good one)",
            method.method,
            a.context.as_deref().map_or(String::new(), |p| p.display().to_string())
        );
    }
    if let Some(p) = &a.continue_file {
        conv.save(p)?;
    }
    if a.json {
        // `prefill`: which prefill computed which of the saved tokens (dense or sparse).
        let context = session.context().map(|f| {
            json!({"path": f.path(), "tokens": f.header().tokens, "documents": f.documents().len(), "tier": tier,
                   "prefill": f.header().prefill_runs()})
        });
        // Over a context the turn's tokens follow the saved ones; with the bare model they are
        // the whole prompt.
        let prompt_key = if context.is_some() { "tail_tokens" } else { "prompt_tokens" };
        let mut doc = json!({
            "model": engine.name,
            "context": context,
            "method": answer.method.to_string(),
            "attention": answer.settings,
            "index": answer.index,
            "reused_tokens": answer.reused_tokens,
            "tokens": answer.tokens,
            "text": answer.text,
            "stop_reason": answer.stop_reason,
            "sampling": a.settings().params(&engine).sampling,
            "sources": answer.sources,
            "model_load_seconds": loaded,
            "open_seconds": open_seconds,
            "first_token_seconds": answer.timings.first_token_s,
            "decode_tokens_per_second": answer.timings.decode_tokens_per_s,
            "seconds": answer.timings.seconds,
        });
        doc[prompt_key] = json!(answer.tail_tokens);
        writeln!(stdout, "{doc}")?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}

/// `folio chat --raw TEXT`: the text as is, no template, no conversation.
fn chat_raw(engine: &Engine, a: &ChatArgs, raw: &str) -> Result<()> {
    let attn = a.attention.build(engine)?;
    let prompt = engine.tokenizer.encode_raw(raw)?;
    let params = a.settings().params(engine);
    let mut stdout = std::io::stdout().lock();
    let generation = engine.generate_with(attn.as_ref(), &prompt, &params, |piece| {
        if !a.json {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    if a.json {
        let doc = json!({
            "model": engine.name,
            "prompt_tokens": prompt,
            "tokens": generation.tokens,
            "text": generation.text,
            "stop_reason": generation.stop_reason,
            "sampling": params.sampling,
            "attention": attn.settings(),
            "seconds": generation.seconds,
        });
        writeln!(stdout, "{doc}")?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}

#[derive(Args)]
pub struct PerplexityArgs {
    /// Text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Score only the file's first N tokens (counted after the BOS rule).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Tokens per forward pass. 1 scores the text as a decode does, a token at a time (the
    /// matrix-vector kernels), where the default scores it as a prefill does.
    #[arg(long, default_value_t = folio_models::engine::PERPLEXITY_CHUNK)]
    chunk: usize,
    #[arg(long)]
    json: bool,
}

/// The largest text `folio perplexity` reads (a million tokens of English is about 4 MiB).
const MAX_PERPLEXITY_BYTES: u64 = 256 << 20;

pub fn perplexity(common: &Common, a: PerplexityArgs) -> Result<()> {
    let bytes = folio_context_file::atomic::read_input(&a.file, "a text to score", MAX_PERPLEXITY_BYTES)?;
    let text = String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", a.file.display()))?;
    let engine = common.engine()?;
    let mut ids = engine.tokenizer.encode_raw(&text)?;
    if let Some(n) = a.max_tokens {
        ids.truncate(n);
    }
    let p = engine.perplexity_in_chunks(&ids, a.chunk)?;
    if a.json {
        println!("{}", serde_json::to_string(&p)?);
    } else {
        println!("perplexity {:.4} (mean NLL {:.6} over {} tokens)", p.perplexity, p.mean_nll, p.tokens);
    }
    Ok(())
}

#[derive(Args)]
pub struct InfoArgs {
    #[arg(long)]
    json: bool,
}

/// Bytes per element of the KV cache as Folio stores it by default (bf16).
const KV_STORAGE_BYTES: usize = 2;

pub fn info(common: &Common, a: InfoArgs) -> Result<()> {
    let engine = common.engine()?;
    let cfg = engine.config();
    let doc = json!({
        "model": engine.name,
        "architecture": cfg.arch,
        "parameters": engine.model.parameters(),
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "attention_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_context": cfg.max_position_embeddings,
        "kv_bytes_per_token": cfg.kv_bytes_per_token(KV_STORAGE_BYTES),
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "sliding_window": cfg.sliding_window,
        "device": device_name(engine.model.device()),
        "dtype": format!("{:?}", engine.model.dtype()).to_lowercase(),
        "chat_template": engine.chat_template.is_some(),
        "weights": weights_facts(&engine),
        "gpu": gpu_facts(),
    });
    if a.json {
        println!("{doc}");
    } else {
        println!("model           {}", engine.name);
        println!("architecture    {}", cfg.arch.name());
        println!("parameters      {}", human_count(engine.model.parameters()));
        match engine.quantization() {
            Some(q) => println!(
                "weights         {} ({:.2} bits per weight, {}; {})",
                q.name,
                q.bits_per_weight,
                folio_models::error::human_bytes(q.weight_bytes),
                q.tensor_types.iter().map(|(t, n)| format!("{n} {t}")).collect::<Vec<_>>().join(", ")
            ),
            None => println!(
                "weights         {} as saved, {} here",
                cfg.saved_dtype.as_deref().unwrap_or("dtype unstated"),
                doc["dtype"].as_str().unwrap_or("")
            ),
        }
        println!("layers          {}", cfg.num_layers);
        println!("heads           {} query / {} KV, head_dim {}", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        println!("max context     {} tokens", cfg.max_position_embeddings);
        println!("KV per token    {} bytes (bf16)", cfg.kv_bytes_per_token(KV_STORAGE_BYTES));
        println!("device          {} ({})", device_name(engine.model.device()), doc["dtype"].as_str().unwrap_or(""));
        match folio_runtime::gpu::cuda_devices() {
            Ok(gpus) => gpus.iter().for_each(|g| {
                let gib = g.memory_bytes as f64 / (1u64 << 30) as f64;
                println!(
                    "GPU             cuda:{} {} ({gib:.0} GiB, compute {}.{})",
                    g.ordinal, g.name, g.compute.0, g.compute.1
                )
            }),
            Err(why) => println!("GPU             none usable, Folio runs on the CPU: {why}"),
        }
    }
    Ok(())
}

/// The weights' format for `info --json`: a GGUF's quantisation, bits per weight and bytes, or
/// a safetensors checkpoint's saved dtype.
fn weights_facts(engine: &folio_models::Engine) -> serde_json::Value {
    let format = if folio_models::gguf::is_gguf(std::path::Path::new(&engine.source)) { "gguf" } else { "safetensors" };
    match engine.quantization() {
        Some(q) => json!({"format": format, "quantization": q.name, "bits_per_weight": q.bits_per_weight,
            "bytes": q.weight_bytes, "tensor_types": q.tensor_types}),
        None => json!({"format": format, "saved_dtype": engine.config().saved_dtype}),
    }
}

/// The usable GPUs, or why there is none, for `info --json`.
fn gpu_facts() -> serde_json::Value {
    match folio_runtime::gpu::cuda_devices() {
        Ok(gpus) => json!(gpus
            .iter()
            .map(|g| json!({"ordinal": g.ordinal, "name": g.name, "memory_bytes": g.memory_bytes,
                "compute": format!("{}.{}", g.compute.0, g.compute.1)}))
            .collect::<Vec<_>>()),
        Err(why) => json!({ "unavailable": why }),
    }
}

fn human_count(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

#[derive(Args)]
pub struct MethodsArgs {
    #[arg(long)]
    json: bool,
}

/// `folio methods`: the registry — every attention method with its paper, default budget,
/// knobs, needs and tiers.
pub fn methods(a: MethodsArgs) -> Result<()> {
    if a.json {
        println!("{}", serde_json::to_string(&folio_models::attention::REGISTRY)?);
        return Ok(());
    }
    for m in folio_models::attention::REGISTRY {
        println!("{}: {}", m.name, m.summary);
        println!("  paper      {}", m.paper);
        match &m.default_budget {
            Some(d) => println!("  budget     {} by default ({})", d.budget, d.source),
            None => println!("  budget     none: reads every key"),
        }
        for p in m.params {
            let kind = if p.integer { "integer" } else { "number" };
            println!("  {:<10} {kind} {}..={}, default {}: {}", p.name, p.min, p.max, p.default, p.doc);
        }
        if m.needs.calibration {
            println!("  needs      the model's channel calibration (`folio calibrate`)");
        }
        if let Some(index) = m.needs.index {
            println!("  index      {index} (stored with `folio context index`)");
        }
        for tier in [Tier::Resident, Tier::Offloaded] {
            let path = match m.path(tier) {
                Path::Fast => "fast path".to_owned(),
                Path::Reference(why) => format!("CPU reference: {why}"),
                Path::None(why) => format!("not run: {why}"),
            };
            println!("  {:<10} {path}", tier.name());
        }
        println!();
    }
    println!("Name one as METHOD[:BUDGET][:KEY=VALUE]..., e.g. --method hip:2048:refresh=16");
    Ok(())
}

/// The bar of a model's download: bytes, rate and time left, as `huggingface-cli` shows them.
fn download_bar() -> Option<indicatif::ProgressBar> {
    let style =
        indicatif::ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} {bytes_per_sec} {eta} left  {msg}")
            .ok()?;
    Some(indicatif::ProgressBar::new(0).with_style(style))
}
