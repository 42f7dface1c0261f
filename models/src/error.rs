//! One error type for the engine. Every variant names what is wrong *and* what to do, because
//! these messages reach users verbatim (CLI and desktop app alike).

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{file} not found in {dir}: a model folder needs config.json, tokenizer.json and \
         safetensors weights (model.safetensors, or model.safetensors.index.json with its shards)"
    )]
    MissingFile { file: String, dir: PathBuf },

    #[error("unsupported model_type \"{found}\" in config.json; Folio supports: {}", supported.join(", "))]
    UnsupportedModelType { found: String, supported: Vec<&'static str> },

    #[error("{path}: {msg}")]
    InvalidConfig { path: PathBuf, msg: String },

    #[error(
        "{path} is truncated: its header describes {expected} bytes but the file has {actual}; \
         download or copy it again"
    )]
    WeightsTruncated { path: PathBuf, expected: u64, actual: u64 },

    #[error("{path}: invalid safetensors file: {msg}")]
    InvalidWeights { path: PathBuf, msg: String },

    #[error("{path}: {msg}")]
    Gguf { path: PathBuf, msg: String },

    #[error("tensor {name} is missing from the model weights")]
    MissingTensor { name: String },

    #[error(
        "the prompt is {tokens} tokens, longer than the model's context length of {limit} tokens \
         (max_position_embeddings); nothing was truncated: shorten the input or use a model with a \
         longer context"
    )]
    PromptTooLong { tokens: usize, limit: usize },

    #[error(
        "model {repo} is not in the Hugging Face cache ({cache}: {file} is missing) and downloads \
         are off (HF_HUB_OFFLINE); download it once with network access, or pass a local model folder"
    )]
    ModelNotCached { repo: String, file: String, cache: PathBuf },

    #[error("{0} is neither a model folder nor a Hugging Face repo id (owner/name)")]
    BadModelSpec(String),

    #[error(
        "model {repo} is not in the Hugging Face cache, and Folio downloads a model only when asked: load it by \
         name to download it (--model {repo}, or Change model in the window), or pass another --model"
    )]
    NotDownloaded { repo: String },

    #[error("downloading {repo}/{file} from the Hugging Face hub failed: {msg}")]
    Download { repo: String, file: String, msg: String },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    Template(String),

    #[error(
        "the model has no chat template (no chat_template.jinja, none in tokenizer_config.json); use raw text instead"
    )]
    NoChatTemplate,

    #[error("{0}")]
    Invalid(String),

    #[error("{path}: {msg}")]
    Context { path: PathBuf, msg: String },

    #[error(
        "this context was made with model {made_by} but the loaded model is {loaded} (different: {}); \
         chat with the model that made it (--model {made_by_source}) or prefill the documents again",
        differences.join("; ")
    )]
    WrongModel { made_by: String, made_by_source: String, loaded: String, differences: Vec<String> },

    #[error(
        "this context was made with other weights of this model ({made_by}; the loaded one is {loaded}; different: \
         {}); chat with the weights that made it (--model {made_by_source}), prefill the documents again, or read it \
         with these weights anyway (--accept-other-weights: its K/V stay the other weights', so answers differ \
         from a prefill with these)",
        differences.join("; ")
    )]
    OtherWeights { made_by: String, made_by_source: String, loaded: String, differences: Vec<String> },

    #[error(
        "the documents are {tokens} tokens but the model's context length is {limit} ({room} kept free for the \
         question and answer): {}; nothing was prefilled: remove documents or use a model with a longer context",
        documents.iter().map(|(p, n)| format!("{p} {n} tokens")).collect::<Vec<_>>().join(", ")
    )]
    CollectionTooLong { tokens: usize, limit: usize, room: usize, documents: Vec<(String, usize)> },

    #[error(
        "not enough disk space to write {}: {detail}; the prefill needs {} ({} for the context file, the rest \
         scratch space until it finishes); free space or choose another location. Nothing was kept",
        path.display(), human_bytes(*needed), human_bytes(*file)
    )]
    DiskFull { path: PathBuf, needed: u64, file: u64, detail: String },

    #[error(
        "a memory budget of {} is too small for {tokens} tokens: one layer's K/V and the smallest chunk need {}; \
         raise --memory-budget",
        human_bytes(*budget), human_bytes(*needed)
    )]
    MemoryBudget { budget: u64, needed: u64, tokens: usize },

    #[error("{0}")]
    Cancelled(String),

    #[error("{error}; the finished layers are kept in {}: run the same command again to resume", dir.display())]
    Resumable { error: Box<Error>, dir: PathBuf },

    /// Not a `#[source]`: the message already says it once, and an error chain printed with
    /// its causes (`{:#}`) would say it again ("… (os error 13): Permission denied (os error 13)").
    #[error("{}: {}", path.display(), io_message(error))]
    Io { path: PathBuf, error: std::io::Error },

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// An I/O error with the path it concerns (the message names both).
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), error: source }
    }
}

/// A hold of host memory the budget refused, with what a person can change.
impl From<folio_runtime::host_budget::Refused> for Error {
    fn from(r: folio_runtime::host_budget::Refused) -> Self {
        refused(r, "")
    }
}

/// A refused hold with what else would do beside raising the budget (`remedy`, e.g. ", or
/// store the K/V in fp8"; empty: the budget alone).
pub fn refused(r: folio_runtime::host_budget::Refused, remedy: &str) -> Error {
    Error::Invalid(format!("{r}; raise the host budget (--host-budget, or Settings → Engine in the window){remedy}"))
}

/// A refused hold of the K/V's host memory: a compact dtype would do too.
pub fn kv_refused(r: folio_runtime::host_budget::Refused) -> Error {
    refused(r, ", or store the context's K/V in fp8 (--kv-dtype fp8: half of bf16)")
}

/// `1.5 GiB`, `512 KiB`, `12 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{x:.1} {}", UNITS[unit])
    }
}

pub use folio_context_file::io_message;

impl From<folio_context_file::Error> for Error {
    /// The context-file crate's errors are the engine's, word for word.
    fn from(e: folio_context_file::Error) -> Self {
        match e {
            folio_context_file::Error::Context { path, msg } => Self::Context { path, msg },
            folio_context_file::Error::Invalid(msg) => Self::Invalid(msg),
            folio_context_file::Error::Io { path, error } => Self::Io { path, error },
        }
    }
}
