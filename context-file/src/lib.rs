//! Folio's context file: a document collection's K/V cache as one self-describing file —
//! its format ([`format`]), how K/V rows are stored ([`codec`], [`rows`]), opening and verifying
//! a saved file ([`file`]), the partial folder of a prefill in flight ([`partial`]) and writes
//! that never lose the old file ([`atomic`]). docs/context-file.md is the specification.
//!
//! # Rules
//!
//! - **Its own crate, small.** The engine writes context files and the library lists them;
//!   both read them through this crate, so the library needs no model, tensor or GPU code to
//!   show what a file holds. No candle, no tokenizer, no SQLite here: bytes, checksums, serde.
//! - **Nothing is trusted before it is checked.** Opening reads the preamble, the header and the
//!   token and document sections, each against its checksum; a K/V section is checked when it
//!   is first read. A damaged, truncated, foreign or newer file is an [`Error`] that names the
//!   file and the damaged part, never a panic.
//! - **Old files are read.** The format's version is checked against the range this build
//!   reads (`format::OLDEST_READABLE_VERSION..=format::FORMAT_VERSION`); so is a checkpoint's.
//! - **Nothing is lost.** Every replacement is a complete fsynced file renamed over the old one
//!   ([`atomic`]), and only regular files are replaced.

pub mod atomic;
pub mod codec;
mod error;
pub mod file;
pub mod format;
pub mod os_path;
pub mod partial;
pub mod platform;
pub mod rows;

pub use codec::Codec;
pub use error::{io_message, Error, Result};
pub use file::{ContextFile, VerifyReport};
pub use format::{DocumentSpan, Fingerprint, Header, KvDtype, ModelStamp, PrefillRun, SpanPart, DENSE_PREFILL};
pub use partial::{partial_dir, pending, pending_date, Pending};
