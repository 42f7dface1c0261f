//! Context files: a document collection prefilled once, saved, reopened in seconds.
//!
//! * [`format`], [`codec`], [`file`]: the file itself — its bytes, how K/V rows are stored, and
//!   opening and verifying a saved one — are the `folio-context-file` crate's, re-exported here
//!   (the library reads files through that crate alone).
//! * [`encode`]: a layer's K/V tensors encoded into a section where they are (fp8 on the GPU).
//! * [`prompt`]: documents → tokens and spans; a question → the tokens appended to them.
//! * [`builder`]: the one call that makes or changes a context — new, add, remove, resume —
//!   planned, prefilled and handed to the library's bookkeeping.
//! * [`staging`]: what a set of documents would make, counted and estimated before a prefill;
//!   [`cost`]: a prefill's time, fitted to this machine's own timings; [`answers`]: what a
//!   sparse prefill was measured to cost in answers on a model.
//! * [`build`]: layer-major prefill into a file, checkpointed per layer, saved atomically.

pub mod answers;
pub mod build;
pub mod builder;
pub mod cost;
pub mod encode;
pub mod prompt;
pub mod staging;

pub use build::{append, build, extend, Base, BuildOptions, BuildReport, HiddenPlace, Progress, StageSeconds};
pub use builder::{Bookkeeping, Builder, Change, Planned, Reread, SavedDocuments, DEFAULT_KV_DTYPE};
pub use cost::PrefillCost;
pub use encode::EncodeTensor;
pub use folio_context_file::atomic::{check_replaceable, write_atomic};
pub use folio_context_file::{codec, file, format, platform};
pub use folio_context_file::{partial_dir, pending, pending_date, Pending};
pub use folio_context_file::{
    ContextFile, DocumentSpan, Fingerprint, Header, KvDtype, ModelStamp, PrefillRun, SpanPart, VerifyReport,
    DENSE_PREFILL,
};
pub use prompt::{DocumentText, PrefixPlan, TextPart, TokenCount, ANSWER_ROOM, DEFAULT_DOCUMENT_TEMPLATE};
