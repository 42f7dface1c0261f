//! [`Engine`]: a loaded model with its tokenizer, chat template and generation defaults —
//! everything the CLI and the window need to chat with it, in one type whose methods all live
//! in this folder: loading and identity here, documents laid out into a context's tokens in
//! [`layout`], a method's index stored in a context file in [`indexes`], the channel
//! calibration a method needs in [`calibration`].

mod calibration;
mod indexes;
mod layout;

use std::ops::ControlFlow;

use candle_core::{DType, Device};

pub use indexes::StoredIndex;

use crate::attention::{Attention, Dense};
use crate::chat::{ChatTemplate, Message};
use crate::config::ModelConfig;
use crate::context::{ContextFile, Fingerprint, ModelStamp};
use crate::error::{Error, Result};
use crate::generate::{self, GenerateParams, Generation, GenerationConfig};
use crate::gguf::{GgufFile, Quantization};
use crate::loader::{self, ModelFiles, ModelSource};
use crate::model::{Model, Quantize};
use crate::tokenizer::Tokenizer;

/// What a fingerprint's quantisation says after the type of weights quantized on load.
const QUANTIZED_ON_LOAD: &str = " (quantized on load)";

/// How a context's model compares with the loaded one ([`Engine::check_context`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContextModel {
    Same,
    /// Other weights of the same model, read because [`Engine::accept_other_weights`] asked
    /// for it: the fingerprint fields that differ (`quantization "Q4_K_M" vs "Q8_0"`).
    OtherWeights(Vec<String>),
}

/// Tokens per forward pass when scoring a text (bounds the `[chunk, vocab]` logits).
pub const PERPLEXITY_CHUNK: usize = 512;

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
    /// The weights' quantisation: a GGUF file's, or what `--quantize` made of a safetensors
    /// model's; `None` for weights in the model's dtype.
    quantization: Option<Quantization>,
    /// A GGUF's tokenizer checksum (the tokenizer has no file of its own to hash).
    gguf_tokenizer: Option<String>,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
    /// [`Engine::accept_other_weights`].
    other_weights: std::sync::atomic::AtomicBool,
}

impl Engine {
    pub fn load(spec: &str, device: &Device, dtype: DType) -> Result<Self> {
        Self::load_with(spec, device, dtype, &mut |_| std::ops::ControlFlow::Continue(()))
    }

    /// [`Engine::load`] with no download: a repo id must be in the Hugging Face cache whole. For
    /// a model named by something other than the person — a context file's header, the model
    /// of the last session — so that opening a file never reaches the network.
    pub fn load_cached(spec: &str, device: &Device, dtype: DType, quantize: Option<Quantize>) -> Result<Self> {
        if let ModelSource::Hub { repo, revision } = ModelSource::parse(spec)? {
            if !crate::loader::cached_whole(&repo, revision.as_deref()) {
                return Err(Error::NotDownloaded { repo });
            }
        }
        Self::load_quantized(spec, device, dtype, quantize, &mut |_| ControlFlow::Continue(()))
    }

    /// [`Engine::load`], a download from the hub (a repo id not cached yet) reporting its
    /// progress to `on_download`; `Break` stops it, keeping what arrived for the next load.
    pub fn load_with(
        spec: &str,
        device: &Device,
        dtype: DType,
        on_download: &mut dyn FnMut(&crate::download::DownloadProgress) -> std::ops::ControlFlow<()>,
    ) -> Result<Self> {
        Self::load_quantized(spec, device, dtype, None, on_download)
    }

    /// [`Engine::load_with`], a safetensors model's projections quantized to `quantize` as
    /// they load (`--quantize`; a GGUF is quantized already and refuses it).
    pub fn load_quantized(
        spec: &str,
        device: &Device,
        dtype: DType,
        quantize: Option<Quantize>,
        on_download: &mut dyn FnMut(&crate::download::DownloadProgress) -> std::ops::ControlFlow<()>,
    ) -> Result<Self> {
        let started = std::time::Instant::now();
        let loaded = Self::load_files(spec, device, dtype, quantize, on_download);
        match &loaded {
            Ok(e) => tracing::info!(
                model = %e.name, source = spec, device = ?device.location(), ?dtype,
                gpu = folio_runtime::gpu::cuda_unavailable().unwrap_or("usable"),
                seconds = started.elapsed().as_secs_f64(), "model loaded"
            ),
            Err(error) => tracing::warn!(source = spec, %error, "model not loaded"),
        }
        loaded
    }

    fn load_files(
        spec: &str,
        device: &Device,
        dtype: DType,
        quantize: Option<Quantize>,
        on_download: &mut dyn FnMut(&crate::download::DownloadProgress) -> std::ops::ControlFlow<()>,
    ) -> Result<Self> {
        let source = ModelSource::parse(spec)?;
        let hf = match ModelFiles::resolve_with(&source, on_download)? {
            ModelFiles::Hf(files) => files,
            ModelFiles::Gguf(path) if quantize.is_none() => {
                return Self::load_gguf(&source, spec, &path, device, dtype)
            }
            ModelFiles::Gguf(path) => {
                return Err(Error::Invalid(format!(
                    "{} is a GGUF file, quantized already: --quantize applies to safetensors models",
                    path.display()
                )))
            }
        };
        let files = hf.clone();
        let cfg = ModelConfig::from_file(&files.config)?;
        let tokenizer = Tokenizer::from_file(&files.tokenizer, cfg.bos_token_id)?;
        let chat_template = ChatTemplate::load(files.chat_template.as_deref(), files.tokenizer_config.as_deref())?;
        let generation_config = match &files.generation_config {
            Some(p) => GenerationConfig::from_file(p)?,
            None => GenerationConfig::default(),
        };
        let model = Model::load(&cfg, &files.weights, device, dtype, quantize)?;
        let quantization = quantize.map(|q| {
            let census = model.weights();
            Quantization {
                name: format!("{}{QUANTIZED_ON_LOAD}", q.name()),
                bits_per_weight: census.bits_per_weight(),
                weight_bytes: census.bytes,
                tensor_types: census.types,
            }
        });
        Ok(Self {
            name: source.display_name(),
            source: spec.to_owned(),
            stamp: std::sync::OnceLock::new(),
            calibrations: std::sync::OnceLock::new(),
            files: ModelFiles::Hf(hf),
            quantization,
            gguf_tokenizer: None,
            model,
            tokenizer,
            chat_template,
            generation_config,
            other_weights: Default::default(),
        })
    }

    /// A GGUF file: its config, tokenizer and chat template from its metadata.
    fn load_gguf(
        source: &ModelSource,
        spec: &str,
        path: &std::path::Path,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let cfg = file.config()?;
        let vocab = file.vocab()?;
        let tokenizer =
            Tokenizer::from_json(&vocab.tokenizer_json, vocab.continuation_json.as_deref(), path, vocab.bos_for_text)?;
        let chat_template = file
            .chat_template()?
            .map(|t| ChatTemplate::new(t, vocab.bos_token.clone(), vocab.eos_token.clone()))
            .transpose()?;
        let model = Model::load_gguf(&cfg, &file, device, dtype)?;
        Ok(Self {
            name: source.display_name(),
            source: spec.to_owned(),
            stamp: std::sync::OnceLock::new(),
            calibrations: std::sync::OnceLock::new(),
            files: ModelFiles::Gguf(path.to_owned()),
            quantization: Some(file.quantization()),
            gguf_tokenizer: Some(vocab.checksum.clone()),
            model,
            tokenizer,
            chat_template,
            generation_config: GenerationConfig::default(),
            other_weights: Default::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The weights' quantisation: a GGUF's, or `--quantize`'s (`None`: the weights are in the
    /// model's dtype).
    pub fn quantization(&self) -> Option<&Quantization> {
        self.quantization.as_ref()
    }

    /// The folder holding the model (and Folio's files about it).
    pub fn model_dir(&self) -> &std::path::Path {
        self.files.dir()
    }

    /// What identifies this model in a context file.
    pub fn stamp(&self) -> Result<&ModelStamp> {
        if let Some(stamp) = self.stamp.get() {
            return Ok(stamp);
        }
        let cfg = self.config();
        let (tokenizer, weights) = match (&self.files, &self.gguf_tokenizer) {
            (ModelFiles::Hf(files), _) => {
                let tokenizer = std::fs::read(&files.tokenizer).map_err(|e| Error::io(&files.tokenizer, e))?;
                (folio_context_file::format::checksum(&tokenizer), loader::weights_hash(&files.weights)?)
            }
            (ModelFiles::Gguf(path), Some(tokenizer)) => (tokenizer.clone(), crate::gguf::file_hash(path)?),
            (ModelFiles::Gguf(_), None) => return Err(Error::Invalid("a GGUF engine without its tokenizer".into())),
        };
        let stamp = ModelStamp {
            name: self.name.clone(),
            source: self.source.clone(),
            fingerprint: cfg.fingerprint(tokenizer, weights, self.quantization().map(|q| q.name.clone()))?,
        };
        Ok(self.stamp.get_or_init(|| stamp))
    }

    /// Opens a saved context for this model: refused when another model made it, or other
    /// weights of it unless [`Engine::accept_other_weights`] (see [`Engine::check_context`]).
    pub fn open_context(&self, path: &std::path::Path) -> Result<ContextFile> {
        let file = ContextFile::open(path)?;
        self.check_context(&file)?;
        Ok(file)
    }

    /// Whether a context made with other weights of this model — the same architecture, shapes
    /// and tokenizer, another quantisation or fine-tune — is read (`--accept-other-weights`)
    /// instead of refused. Its K/V were computed by those weights, so answers differ from a
    /// prefill with these (docs/gguf.md measures by how much); the caller tells the person so.
    pub fn accept_other_weights(&self, accept: bool) {
        self.other_weights.store(accept, std::sync::atomic::Ordering::Relaxed);
    }

    /// Refuses a context another model made, or whose tokens this model cannot embed; a context
    /// of this model's other weights is refused too unless [`Engine::accept_other_weights`].
    pub fn check_context(&self, file: &ContextFile) -> Result<ContextModel> {
        match self.compare_model(file)? {
            None => Ok(ContextModel::Same),
            Some(differences) if self.other_weights.load(std::sync::atomic::Ordering::Relaxed) => {
                Ok(ContextModel::OtherWeights(differences))
            }
            Some(differences) => {
                let (made_by, made_by_source, loaded) = self.makers(file)?;
                Err(Error::OtherWeights { made_by, made_by_source, loaded, differences })
            }
        }
    }

    /// [`Engine::check_context`] for a change to the file (documents appended or removed, an
    /// index stored): a context of other weights is refused whether or not reading it is
    /// accepted, so that one file never holds two models' K/V under one model's name.
    pub fn check_context_to_change(&self, file: &ContextFile) -> Result<()> {
        match self.compare_model(file)? {
            None => Ok(()),
            Some(differences) => Err(Error::Context {
                path: file.path().to_owned(),
                msg: format!(
                    "made with other weights of this model ({}): it cannot be changed with these (appending or \
                     removing documents, or storing an index, would mix two models' K/V in one file); change it \
                     with the weights that made it (--model {}) or prefill the documents again",
                    differences.join("; "),
                    self.makers(file)?.1
                ),
            }),
        }
    }

    /// `None` when `file` was made by this model's weights, the fingerprint's differences when
    /// by other weights of it (only the weights' hash and quantisation differ); refused when
    /// another model made it or its tokens are outside this vocabulary.
    fn compare_model(&self, file: &ContextFile) -> Result<Option<Vec<String>>> {
        let (made, ours) = (&file.header().model.fingerprint, &self.stamp()?.fingerprint);
        let differences = if made == ours {
            None
        } else {
            let weights = ours.weights.clone();
            let other_weights = Fingerprint { weights, quantization: ours.quantization.clone(), ..made.clone() };
            if &other_weights != ours {
                let (made_by, made_by_source, loaded) = self.makers(file)?;
                let differences = made.differences(ours);
                return Err(Error::WrongModel { made_by, made_by_source, loaded, differences });
            }
            Some(made.differences(ours))
        };
        if let Some(&bad) = file.tokens().iter().find(|&&t| t as usize >= self.config().vocab_size) {
            return Err(Error::Context {
                path: file.path().to_owned(),
                msg: format!("token id {bad} is outside the vocabulary"),
            });
        }
        Ok(differences)
    }

    /// The model that made `file`, how to load it again (with `--quantize` when its weights were
    /// quantized on load), and the loaded model's name.
    fn makers(&self, file: &ContextFile) -> Result<(String, String, String)> {
        let made = &file.header().model;
        let on_load = made.fingerprint.quantization.as_deref().and_then(|q| q.strip_suffix(QUANTIZED_ON_LOAD));
        let flag = on_load.and_then(Quantize::from_name).map(|q| format!(" --quantize {}", q.flag()));
        Ok((made.name.clone(), format!("{}{}", made.source, flag.unwrap_or_default()), self.stamp()?.name.clone()))
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
        self.perplexity_in_chunks(ids, PERPLEXITY_CHUNK)
    }

    /// [`Engine::perplexity`] with `chunk` tokens per forward pass (1: as a decode runs).
    pub fn perplexity_in_chunks(&self, ids: &[u32], chunk: usize) -> Result<Perplexity> {
        if ids.len() < 2 {
            return Err(Error::Invalid(format!("perplexity needs at least 2 tokens, the text has {}", ids.len())));
        }
        let logp = self.model.token_log_probs(ids, chunk, &Dense)?;
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
