//! Context files: a document collection prefilled once, saved, reopened in seconds.
//!
//! * [`format`]: the bytes (docs/context-file.md is the specification).
//! * [`codec`]: how K/V rows are stored (f32, bf16, fp8 e4m3 with a scale per row, bf16 keys
//!   with fp8 values).
//! * [`prompt`]: documents → tokens and spans; a question → the tokens appended to them.
//! * [`builder`]: the one call that makes or changes a context — new, add, remove, resume —
//!   planned, prefilled and handed to the library's bookkeeping.
//! * [`staging`]: what a set of documents would make, counted and estimated before a prefill.
//! * [`build`]: layer-major prefill into a file, checkpointed per layer, saved atomically.
//! * [`file`]: opening and verifying a saved file (memory-mapped).
//! * [`kv`]: the KV store of a conversation over a saved context.
//! * [`indexes`]: a method's index stored in a saved file.

pub mod build;
pub mod builder;
pub mod codec;
pub mod file;
pub mod format;
pub mod indexes;
pub mod kv;
pub mod prompt;
pub mod staging;

pub use build::{
    append, build, extend, partial_dir, pending, pending_date, write_atomic, Base, BuildOptions, BuildReport,
    HiddenPlace, Pending, Progress, StageSeconds,
};
pub use builder::{Bookkeeping, Builder, Change, Planned, Reread, SavedDocuments, DEFAULT_KV_DTYPE};
pub use codec::KvDtype;
pub use file::{ContextFile, VerifyReport};
pub use format::{DocumentSpan, Fingerprint, Header, ModelStamp, SpanPart};
pub use indexes::StoredIndex;
pub use kv::ContextKv;
pub use prompt::{DocumentText, PrefixPlan, TextPart, TokenCount};
