//! What a read produces: a [`Document`] with its [`Part`]s, or the [`Refusal`] that says why
//! not. Kept apart from the readers so that every reader and the batch driver name the same
//! types without importing each other.

use std::path::PathBuf;

use crate::detect::Format;
use crate::limits;

/// One document read: its text, where its parts start, and what the reader noticed.
#[derive(Debug, Clone)]
pub struct Document {
    pub path: PathBuf,
    /// The file name, as a title.
    pub title: String,
    pub format: Format,
    pub text: String,
    pub parts: Vec<Part>,
    /// Size of the file on disk.
    pub file_bytes: u64,
    /// Things the user should know but that did not stop the read (bytes replaced, an
    /// encoding guessed, a limit that cut the text).
    pub warnings: Vec<String>,
}

/// Where a part of a document starts: a PDF page ("p. 3"), an EPUB chapter or a heading's
/// section (its title).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub label: String,
    /// Byte offset in the document's text (a char boundary).
    pub at: usize,
}

/// A document's text as a reader extracted it from bytes.
#[derive(Debug, Clone, Default)]
pub struct Extracted {
    pub text: String,
    pub parts: Vec<Part>,
    pub warnings: Vec<String>,
}

/// Why a file was not read. The `Display` text is what the user reads beside the file name.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Limit(#[from] limits::LimitHit),
    #[error("cannot read it: {}", io_message(.0))]
    Io(std::io::Error),
    #[error("empty")]
    Empty,
    #[error("binary ({0}), not a document Folio reads")]
    Binary(String),
    #[error("encrypted with a password; Folio cannot open it (save an unprotected copy)")]
    Encrypted,
    #[error(
        "this PDF has no text layer (a scan or images of pages); Folio does not do OCR — run it through an OCR \
         tool such as ocrmypdf first"
    )]
    NoTextLayer,
    #[error("a damaged {format}: {detail}")]
    Damaged { format: &'static str, detail: String },
    #[error("the {format} reader failed on it ({detail}); the file is probably damaged")]
    Crashed { format: &'static str, detail: String },
    #[error("{0}")]
    Unsupported(String),
    #[error("it changed while it was read; add it again once it is saved")]
    Changed,
    #[error("it has no text")]
    NoText,
}

impl Refusal {
    pub(crate) fn damaged(format: Format, detail: impl std::fmt::Display) -> Self {
        Refusal::Damaged { format: format.name(), detail: detail.to_string() }
    }
}

/// An I/O error's message once, as part of a sentence: `std::io::Error`'s `Display` repeats the
/// OS error's code ("Permission denied (os error 13)"), which callers used to print after their
/// own text; here it reads "permission denied".
pub fn io_message(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = match e.raw_os_error() {
        Some(code) => text.strip_suffix(&format!(" (os error {code})")).map(str::to_owned).unwrap_or(text),
        None => text,
    };
    // Lowercase the first letter unless it starts an acronym ("IO error" stays).
    let mut chars = text.chars();
    match (chars.next(), chars.next()) {
        (Some(first), Some(second)) if first.is_uppercase() && second.is_lowercase() => {
            first.to_lowercase().chain(text[first.len_utf8()..].chars()).collect()
        }
        _ => text,
    }
}
