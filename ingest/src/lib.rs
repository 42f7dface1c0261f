//! Folio's document reader: files and folders in, each document's text out with its structure
//! (headings, pages, chapters), every file that cannot be read named with its reason.
//!
//! # Rules
//!
//! - **One bad file never stops a batch.** [`read_paths`] returns every document it could read
//!   and a [`Skip`] with a specific reason for every other one: unreadable, damaged, encrypted,
//!   a limit hit, a parser that crashed or ran out of time. Only a path the user named that
//!   does not exist is an error of the whole call (they mistyped it).
//! - **Types by content, not only by extension.** A PDF named `.txt` is read as a PDF, a ZIP
//!   container is told apart by what it holds (`word/document.xml`, an EPUB's `mimetype`, an
//!   ODF's), e-mail by its headers; the extension decides only among text formats.
//! - **Never a silent mojibake or truncation.** Text is UTF-8, UTF-8 with a BOM, UTF-16 with
//!   or without a BOM, or a legacy encoding detected by `chardetng`; invalid UTF-8 in a mostly
//!   UTF-8 file is replaced and the count is a warning. A document cut off by a limit says so.
//! - **Bounded.** Every input is read under [`Limits`]: file size, unzipped size and ratio
//!   (zip bombs), XML entity declarations (never expanded), nesting depth, line length,
//!   pages, text per document and time per document. The limit hit is named in the reason.
//!   Parsers run on a worker thread: a panic is caught and reported, and a parser still
//!   running at its time limit is left behind (its result dropped) so the batch goes on.
//! - **Structure kept as text.** Headings become Markdown headings, lists `- ` items, tables
//!   `| a | b |` rows, links their text with the address. Each document carries [`Part`]s —
//!   PDF pages, EPUB chapters, heading sections — as byte offsets into its text, which the
//!   context file records as token ranges so sources can say "report.pdf, p. 12".
//!
//! # Why these libraries
//!
//! docs/ingest.md weighs each choice (maintenance, licence, speed, what it cannot read) and
//! the rejected alternatives. In short: `pdf-extract` on `lopdf` for PDF text by page (pure
//! Rust; pdfium and MuPDF would need native libraries, MuPDF is AGPL), `zip` + `quick-xml`
//! for DOCX/ODT/EPUB (the containers are read entry by entry under the limits, which no
//! higher-level DOCX or EPUB crate lets us do), `scraper` (html5ever, the browser-grade HTML
//! parser) for HTML and EPUB chapters, `mail-parser` for e-mail, `csv` and `serde_json` for
//! data, `encoding_rs` + `chardetng` (Firefox's) for encodings.

mod collect;
mod detect;
mod email;
mod html;
mod limits;
mod office;
mod out;
mod pdf;
mod plain;
mod zipped;

use std::path::PathBuf;

pub use collect::{read_bytes, read_file, read_paths, Batch, PathError, Skip};
pub use detect::Format;
pub use limits::{bytes, Limit, Limits};

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

/// The text of a document held in `bytes`, named `name` (its extension helps only among text
/// formats), under `limits`, on the calling thread: what the fuzz harness and the benchmark
/// call. [`read_file`] adds the worker thread, the time limit and the file checks.
pub fn extract(bytes: &[u8], name: &str, limits: &Limits) -> Result<(Format, Extracted), Refusal> {
    if bytes.is_empty() {
        return Err(Refusal::Empty);
    }
    let format = detect::detect(bytes, name);
    let budget = limits::Budget::start(limits);
    let extracted = match format {
        Format::Pdf => pdf::extract(bytes, &budget)?,
        Format::Docx => office::docx(bytes, &budget)?,
        Format::Odt => office::odt(bytes, &budget)?,
        Format::Epub => html::epub(bytes, &budget)?,
        Format::Html => html::html(&plain::decode(bytes, &budget)?, &budget)?,
        Format::Rtf => return Err(Refusal::Unsupported(RTF_UNSUPPORTED.into())),
        Format::Email => email::message(bytes, &budget)?,
        Format::Mbox => email::mbox(bytes, &budget)?,
        Format::Notebook => plain::notebook(bytes, &budget)?,
        Format::Json => plain::json(bytes, &budget)?,
        Format::Csv | Format::Tsv => plain::table(bytes, format == Format::Tsv, &budget)?,
        Format::Xml => plain::xml(bytes, &budget)?,
        Format::Markdown | Format::Text | Format::Code => plain::text(bytes, format, &budget)?,
        Format::Zip => return Err(Refusal::Unsupported(ZIP_UNSUPPORTED.into())),
        Format::Binary(kind) => return Err(Refusal::Binary(kind.into())),
    };
    budget.check_lines(&extracted.text)?;
    if extracted.text.trim().is_empty() {
        return Err(Refusal::NoText);
    }
    Ok((format, extracted))
}

/// RTF: no maintained Rust crate reads it (docs/ingest.md), and Folio does not hand-write one.
const RTF_UNSUPPORTED: &str =
    "RTF is not read (no maintained RTF reader for Rust); save it as DOCX or ODT from your word processor";

const ZIP_UNSUPPORTED: &str = "a ZIP archive that is not a DOCX, ODT or EPUB document; unpack it and add its files";
