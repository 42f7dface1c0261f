//! Folio's inference engine.
//!
//! * [`config`], [`loader`]: a Hugging Face model folder (or cached/hub repo) → config + files.
//! * [`model`]: one generic decoder whose per-family differences are config flags.
//! * [`kv`], [`attention`]: the seam between the decoder and how K/V is stored and attended;
//!   dense attention over a preallocated store here, sparse methods and tiers later.
//! * [`tokenizer`], [`chat`], [`generate`]: text in, text out, with Hugging Face semantics.
//! * [`prefill`], [`context`]: layer-major prefill of a document collection into a context
//!   file, and conversations over a reopened one.
//!
//! * [`session`], [`conversation`]: the API the CLI and the desktop app both call — open a
//!   context on a tier, ask with a method, get an [`session::Answer`].
//!
//! Rules of this crate (docs/architecture.md):
//!
//! * it depends on folio-kernels and the model stack (candle, tokenizers, minijinja, hf-hub),
//!   never on Tauri, SQLite, clap or a terminal: the product layer (src-tauri) renders;
//! * it never prints: long work reports through callbacks, failures are typed [`Error`]s that
//!   say what is wrong and what to do;
//! * an attention method is named in its own module and the registry
//!   ([`attention::REGISTRY`]) only; every consumer reads the registry.

pub mod attention;
pub mod calibrate;
pub mod chat;
pub mod config;
pub mod context;
pub mod conversation;
pub mod error;
pub mod eval;
pub mod excerpt;
pub mod generate;
pub mod host_memory;
pub mod kv_cache;
pub mod loader;
pub mod model;
pub mod plan;
pub mod prefill;
pub mod profile;
pub mod rope;
pub mod session;
pub mod tokenizer;

use std::ops::ControlFlow;

use candle_core::{DType, Device};

pub use error::{Error, Result};

use crate::attention::{Attention, Dense};
use crate::chat::{ChatTemplate, Message};
use crate::config::ModelConfig;
use crate::context::{ContextFile, ModelStamp};
use crate::generate::{GenerateParams, Generation, GenerationConfig};
use crate::loader::{ModelFiles, ModelSource};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// Tokens per forward pass when scoring a text (bounds the `[chunk, vocab]` logits).
const PERPLEXITY_CHUNK: usize = 512;

/// `auto` (CUDA when built with it and a GPU answers, else CPU), `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(spec: &str) -> Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" if candle_core::utils::cuda_is_available() => Ok(cuda_device(0).unwrap_or(Device::Cpu)),
        "auto" => Ok(Device::Cpu),
        _ => {
            let ordinal = match spec.strip_prefix("cuda") {
                Some("") => 0,
                Some(rest) => rest
                    .strip_prefix(':')
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| Error::Invalid(format!("bad device \"{spec}\": use auto, cpu, cuda or cuda:N")))?,
                None => return Err(Error::Invalid(format!("bad device \"{spec}\": use auto, cpu, cuda or cuda:N"))),
            };
            if !candle_core::utils::cuda_is_available() {
                return Err(Error::Invalid(format!(
                    "device {spec} asked for, but this build of Folio has no CUDA support (build with --features cuda)"
                )));
            }
            cuda_device(ordinal)
        }
    }
}

/// The CUDA device `ordinal` as the engine runs it: without cudarc's per-allocation events.
/// cudarc gives each device allocation a read and a write event (two `cuEventCreate` on
/// allocation, two destroys on free) so that, once a context has a second stream, every launch
/// can order each buffer's uses across streams by recording and waiting on them. Folio runs
/// everything on candle's one stream except HiP's search a step ahead, which orders its few
/// buffers by hand (`folio_kernels::select::HostRows::search_blocks`: the side stream joins
/// candle's before the launch, candle's waits on the search's event before reading its
/// output, and its inputs live until then). With tracking on, a decode step — hundreds of small
/// allocations — paid for the events on the host that queues the GPU's work, and, once the side
/// stream existed, an event record and wait per buffer of every launch. Page-locked host rows
/// are written only while a tier is filled (each write synchronises) and freed after the
/// context is synchronised (`Mapped`'s and `Registered`'s drops), so they need no event either.
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = &device {
        // SAFETY: cudarc's rules for turning tracking off — no use of a buffer on another
        // stream before its allocation or after its free, no concurrent writes from two
        // streams — hold: candle's work is on one stream, and the one use of the second
        // stream (above) orders its buffers with events and keeps them alive itself.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(device)
}

/// `f32`, `bf16`, `f16`, or `auto`: f32 on CPU (candle's CPU kernels are fastest and exact
/// there), bf16 on a GPU.
pub fn parse_dtype(spec: &str, device: &Device) -> Result<DType> {
    match spec {
        "auto" => Ok(if device.is_cpu() { DType::F32 } else { DType::BF16 }),
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        _ => Err(Error::Invalid(format!("bad dtype \"{spec}\": use auto, f32, bf16 or f16"))),
    }
}

pub fn device_name(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// A loaded model with everything needed to chat with it.
pub struct Engine {
    pub name: String,
    /// The model as it was asked for (a folder or repo id), recorded in context files.
    pub source: String,
    /// [`Engine::stamp`], computed on first use (it hashes the tokenizer and samples the weights).
    stamp: std::sync::OnceLock<ModelStamp>,
    /// A folder of channel calibrations kept outside model folders (the window's: Folio's
    /// home), read when the model's folder has none; see [`Engine::calibration_dir`].
    calibrations: std::sync::OnceLock<std::path::PathBuf>,
    pub files: ModelFiles,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
}

impl Engine {
    pub fn load(spec: &str, device: &Device, dtype: DType) -> Result<Self> {
        let source = ModelSource::parse(spec)?;
        let files = ModelFiles::resolve(&source)?;
        let cfg = ModelConfig::from_file(&files.config)?;
        let tokenizer = Tokenizer::from_file(&files.tokenizer, cfg.bos_token_id)?;
        let chat_template = ChatTemplate::load(files.chat_template.as_deref(), files.tokenizer_config.as_deref())?;
        let generation_config = match &files.generation_config {
            Some(p) => GenerationConfig::from_file(p)?,
            None => GenerationConfig::default(),
        };
        let model = Model::load(&cfg, &files.weights, device, dtype)?;
        Ok(Self {
            name: source.display_name(),
            source: spec.to_owned(),
            stamp: std::sync::OnceLock::new(),
            calibrations: std::sync::OnceLock::new(),
            files,
            model,
            tokenizer,
            chat_template,
            generation_config,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// What identifies this model in a context file.
    /// The folder holding the model's config.json (and Folio's files about it).
    pub fn model_dir(&self) -> &std::path::Path {
        self.files.config.parent().unwrap_or(std::path::Path::new("."))
    }

    pub fn stamp(&self) -> Result<&ModelStamp> {
        if let Some(stamp) = self.stamp.get() {
            return Ok(stamp);
        }
        let cfg = self.config();
        let tokenizer = std::fs::read(&self.files.tokenizer).map_err(|e| Error::io(&self.files.tokenizer, e))?;
        let stamp = ModelStamp {
            name: self.name.clone(),
            source: self.source.clone(),
            fingerprint: cfg.fingerprint(
                folio_context_file::format::checksum(&tokenizer),
                loader::weights_hash(&self.files.weights)?,
            )?,
        };
        Ok(self.stamp.get_or_init(|| stamp))
    }

    /// Opens a saved context for this model: refused when another model made it.
    pub fn open_context(&self, path: &std::path::Path) -> Result<ContextFile> {
        let file = ContextFile::open(path)?;
        self.check_context(&file)?;
        Ok(file)
    }

    /// Refuses a context another model made, or whose tokens this model cannot embed.
    pub fn check_context(&self, file: &ContextFile) -> Result<()> {
        let made = &file.header().model;
        let ours = self.stamp()?;
        if made.fingerprint != ours.fingerprint {
            return Err(Error::WrongModel {
                made_by: made.name.clone(),
                made_by_source: made.source.clone(),
                loaded: ours.name.clone(),
                differences: made.fingerprint.differences(&ours.fingerprint),
            });
        }
        if let Some(&bad) = file.tokens().iter().find(|&&t| t as usize >= self.config().vocab_size) {
            return Err(Error::Context {
                path: file.path().to_owned(),
                msg: format!("token id {bad} is outside the vocabulary"),
            });
        }
        Ok(())
    }

    /// What `methods` need from this model's folder: the channel calibration, loaded only
    /// when one of them needs it (its absence is then an error naming `folio calibrate`).
    pub fn resources(&self, methods: &[attention::MethodChoice]) -> Result<attention::Resources> {
        let mut resources = attention::Resources::default();
        if methods.iter().map(|m| m.spec()).collect::<Result<Vec<_>>>()?.iter().any(|s| s.needs.calibration) {
            let calibration = calibrate::Calibration::load(&self.calibration_source()?, self.stamp()?)?;
            resources.channels = Some(std::sync::Arc::new(calibration.channels));
        }
        Ok(resources)
    }

    /// Keeps calibrations made for this model under `dir` (one folder per model fingerprint)
    /// besides its own folder; the first call wins.
    pub fn keep_calibrations_in(&self, dir: std::path::PathBuf) {
        let _ = self.calibrations.set(dir);
    }

    /// Where a calibration made now for this model is written: the calibrations folder's
    /// folder for its fingerprint when one is set (model folders may be read-only, or a
    /// source tree), else the model's folder (`folio calibrate`).
    pub fn calibration_dir(&self) -> Result<std::path::PathBuf> {
        match self.calibrations.get() {
            Some(dir) => {
                let stamp = self.stamp()?;
                let id = serde_json::to_vec(&stamp.fingerprint).map_err(|e| Error::Invalid(e.to_string()))?;
                let id = folio_context_file::format::checksum(&id);
                Ok(dir.join(format!("{}-{}", stamp.name.replace(['/', '\\'], "_"), id)))
            }
            None => Ok(self.model_dir().to_owned()),
        }
    }

    /// The folder the calibration is read from: the model's when it holds one for this model,
    /// else the calibrations folder's when it holds one (else the model's: its error names it).
    pub fn calibration_source(&self) -> Result<std::path::PathBuf> {
        let own = self.model_dir();
        let kept = self.calibration_dir()?;
        // The model's own when it loads for this model; else the kept one when there is one.
        if calibrate::Calibration::load(own, self.stamp()?).is_ok() || !calibrate::Calibration::path(&kept).is_file() {
            return Ok(own.to_owned());
        }
        Ok(kept)
    }

    /// End-of-sequence ids: generation_config.json's, else config.json's.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let ids = self.generation_config.eos_token_ids();
        if ids.is_empty() {
            self.config().eos_token_ids.clone()
        } else {
            ids
        }
    }

    /// Token ids of a chat prompt (rendered, generation prompt added, no extra special tokens).
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let template = self.chat_template.as_ref().ok_or(Error::NoChatTemplate)?;
        self.tokenizer.encode_prompt(&template.render(messages, true)?)
    }

    /// Generates from `prompt` with dense attention on a fresh KV store.
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Generation> {
        self.generate_with(&Dense, prompt, params, on_text)
    }

    /// Generates from `prompt` with the attention method `attn` on a fresh KV store.
    pub fn generate_with(
        &self,
        attn: &dyn Attention,
        prompt: &[u32],
        params: &GenerateParams,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let mut kv = self.model.new_kv();
        generate::generate(&self.model, &self.tokenizer, attn, &mut kv, prompt, params, on_text)
    }

    /// Perplexity of `ids` as transformers computes it with `labels=input_ids`: the mean
    /// negative log-likelihood of tokens 1.. (the first token is not scored).
    pub fn perplexity(&self, ids: &[u32]) -> Result<Perplexity> {
        if ids.len() < 2 {
            return Err(Error::Invalid(format!("perplexity needs at least 2 tokens, the text has {}", ids.len())));
        }
        let logp = self.model.token_log_probs(ids, PERPLEXITY_CHUNK, &Dense)?;
        let mean_nll = -logp.iter().map(|&x| x as f64).sum::<f64>() / logp.len() as f64;
        Ok(Perplexity { tokens: ids.len(), mean_nll, perplexity: mean_nll.exp() })
    }
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Perplexity {
    pub tokens: usize,
    pub mean_nll: f64,
    pub perplexity: f64,
}
