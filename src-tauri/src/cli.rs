//! Headless subcommands. Each one loads what it needs, does one job, and prints either a
//! human-readable result or (with `--json`) one JSON document.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use folio_models::attention::{self, Attention};
use folio_models::chat::Message;
use folio_models::generate::{GenerateParams, SamplingParams};
use folio_models::{device_name, parse_device, parse_dtype, Engine};
use serde_json::json;

/// Options shared by every subcommand.
pub struct Common {
    pub model: Option<String>,
    pub device: String,
    pub dtype: String,
}

impl Common {
    pub(crate) fn engine(&self) -> Result<Engine> {
        let spec = self.model.as_deref().context("--model is required: a model folder or a Hugging Face repo id")?;
        self.load(spec)
    }

    /// `--model` if given, else `source` (the model a context file names).
    pub(crate) fn engine_or(&self, source: &str) -> Result<Engine> {
        self.load(self.model.as_deref().unwrap_or(source))
    }

    fn load(&self, spec: &str) -> Result<Engine> {
        let device = parse_device(&self.device)?;
        let dtype = parse_dtype(&self.dtype, &device)?;
        Ok(Engine::load(spec, &device, dtype)?)
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
    /// Keep a multi-turn conversation over the context in this JSON file (created if missing).
    #[arg(long = "continue", value_name = "CHAT_JSON", requires = "context")]
    pub(crate) continue_file: Option<PathBuf>,
    /// Keep the saved context in host memory and move only the rows the method picks to the
    /// device (the offloaded engine: dense, streaming, topk, double-sparsity, buzz, hip,
    /// magicpig); without it, whole layers are decoded into device memory as they are used.
    #[arg(long, requires = "context")]
    pub(crate) offload: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 512)]
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
    /// Print one JSON document instead of streaming text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The attention method flags, shared by every command that runs the model.
#[derive(Args)]
pub struct MethodArgs {
    /// Attention method: dense, streaming, topk, topk-ivf, magicpig, hip, double-sparsity, buzz.
    #[arg(long, default_value = "dense")]
    pub(crate) method: String,
    /// The method's budget: tokens (2048) or a share of the context (2%, 0.02).
    #[arg(long)]
    pub(crate) budget: Option<String>,
    /// A method knob, key=value (repeatable); an invalid one lists the valid names and ranges.
    #[arg(long = "param")]
    params: Vec<String>,
}

impl MethodArgs {
    /// The attention method the flags ask for, on `engine`'s model (Double Sparsity reads the
    /// model's channel calibration).
    pub(crate) fn build(&self, engine: &Engine) -> Result<Box<dyn Attention>> {
        let params = attention::parse_params(&self.params)?;
        let resources = resources_for(&[self.method.as_str()], engine)?;
        Ok(attention::by_name(&self.method, self.budget.as_deref(), &params, &resources)?)
    }
}

/// Refuses `--offload` with a method that has no fast path over the offloaded store.
pub(crate) fn check_offloaded(method: &str) -> Result<()> {
    if !folio_models::offload::METHODS.contains(&method) {
        bail!(
            "--offload runs {}; {method} reads the context through the resident store (drop --offload)",
            folio_models::offload::METHODS.join(", ")
        );
    }
    Ok(())
}

/// What `methods` need from `engine`'s model folder: the channel calibration, only when
/// double-sparsity is among them (its absence is then an error naming `folio calibrate`).
pub(crate) fn resources_for(methods: &[&str], engine: &Engine) -> Result<attention::Resources> {
    let mut resources = attention::Resources::default();
    if methods.contains(&"double-sparsity") {
        let calibration = folio_models::calibrate::Calibration::load(engine.model_dir(), engine.stamp()?)?;
        resources.channels = Some(std::sync::Arc::new(calibration.channels));
    }
    Ok(resources)
}

impl ChatArgs {
    /// Generation settings: the flags, else the model's generation_config.json.
    fn params(&self, engine: &Engine) -> GenerateParams {
        let defaults = engine.generation_config.sampling_defaults();
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.or(defaults.top_p),
            top_k: self.top_k.or(defaults.top_k),
            repetition_penalty: self.repetition_penalty.unwrap_or(defaults.repetition_penalty),
            seed: self.seed,
        };
        GenerateParams {
            max_new_tokens: self.max_tokens,
            sampling,
            stop_strings: self.stop.clone(),
            eos_token_ids: engine.eos_token_ids(),
        }
    }
}

pub fn chat(common: &Common, a: ChatArgs) -> Result<()> {
    if let Some(ctx) = &a.context {
        return crate::context_cmd::chat(common, &a, ctx, |e| a.params(e));
    }
    let engine = common.engine()?;
    let attn = a.attention.build(&engine)?;
    let prompt = match (&a.raw, &a.question) {
        (Some(raw), _) => engine.tokenizer.encode_raw(raw)?,
        (None, Some(q)) => {
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(Message::new("system", s));
            }
            messages.push(Message::new("user", q));
            engine.chat_prompt(&messages)?
        }
        (None, None) => bail!("give a question, or --raw TEXT"),
    };
    let params = a.params(&engine);
    let start = Instant::now();
    let mut stdout = std::io::stdout().lock();
    let generation = engine.generate_with(attn.as_ref(), &prompt, &params, |piece| {
        if !a.json {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    let secs = start.elapsed().as_secs_f64();
    if a.json {
        let doc = json!({
            "model": engine.name,
            "prompt_tokens": prompt,
            "tokens": generation.tokens,
            "text": generation.text,
            "stop_reason": generation.stop_reason,
            "sampling": params.sampling,
            "attention": attn.settings(),
            "seconds": secs,
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
    #[arg(long)]
    json: bool,
}

pub fn perplexity(common: &Common, a: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let engine = common.engine()?;
    let mut ids = engine.tokenizer.encode_raw(&text)?;
    if let Some(n) = a.max_tokens {
        ids.truncate(n);
    }
    let p = engine.perplexity(&ids)?;
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

/// Bytes per element of the KV cache as Folio stores it by default (bf16; DESIGN.md §2).
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
    });
    if a.json {
        println!("{doc}");
    } else {
        println!("model           {}", engine.name);
        println!("architecture    {}", cfg.arch.name());
        println!("parameters      {}", human_count(engine.model.parameters()));
        println!("layers          {}", cfg.num_layers);
        println!("heads           {} query / {} KV, head_dim {}", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        println!("max context     {} tokens", cfg.max_position_embeddings);
        println!("KV per token    {} bytes (bf16)", cfg.kv_bytes_per_token(KV_STORAGE_BYTES));
        println!("device          {} ({})", device_name(engine.model.device()), doc["dtype"].as_str().unwrap_or(""));
    }
    Ok(())
}

fn human_count(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}
