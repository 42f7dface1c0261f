//! Folio's inference engine.
//!
//! * [`engine`]: [`Engine`], a loaded model — the one type the CLI and the window hold, with
//!   every method of it in that folder; [`device`]: which device and dtype it runs on.
//! * [`config`], [`loader`]: a Hugging Face model folder (or cached/hub repo) → config + files;
//!   [`gguf`]: a llama.cpp GGUF file → the same config, tokenizer, template and (quantized) weights.
//! * [`model`]: one generic decoder whose per-family differences are config flags.
//! * [`kv_cache`], [`attention`]: the seam between the decoder and how K/V is stored (on the
//!   device, offloaded to host memory, read from a saved context) and attended (dense and the
//!   sparse methods, each declared once in [`attention::REGISTRY`]).
//! * [`tokenizer`], [`chat`], [`generate`]: text in, text out, with Hugging Face semantics.
//! * [`prefill`], [`context`]: layer-major prefill of a document collection into a context
//!   file, and conversations over a reopened one; [`plan`]: what fits where.
//! * [`session`], [`conversation`]: the API the CLI and the desktop app both call — open a
//!   context on a tier, ask with a method, get an [`session::Answer`]; [`distribution`]: how
//!   far a sparse answer strays from dense.
//!
//! Measuring the methods is folio-eval's job, the machine's readings folio-runtime's.
//!
//! Rules of this crate (docs/architecture.md):
//!
//! * it depends on folio-runtime, folio-kernels, folio-method-kernels, folio-context-file and
//!   the model stack (candle, tokenizers, minijinja, hf-hub),
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
pub mod device;
pub mod distribution;
pub mod download;
pub mod engine;
pub mod error;
pub mod excerpt;
pub mod generate;
pub mod gguf;
pub mod kv_cache;
pub mod loader;
pub mod model;
pub mod plan;
pub mod prefill;
pub mod profile;
pub mod random;
pub mod rope;
pub mod session;
pub mod tokenizer;

pub use device::{cuda_device, device_name, parse_device, parse_dtype};
pub use engine::{Engine, Perplexity};
pub use error::{Error, Result};
