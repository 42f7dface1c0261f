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
//!   (zip bombs), XML entity declarations (never expanded), nesting depth,
//!   pages, text per document and time per document. The limit hit is named in the reason.
//!   Parsers run on a worker thread: a panic is caught and reported, and a parser still
//!   running at its time limit is left behind (its result dropped) so the batch goes on.
//!   A long line is not a limit: a 1M-token text export or a minified file is a person's
//!   document, read whole (the tokenizer takes a text with very long lines in pieces).
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
mod document;
mod email;
mod extract;
mod html;
mod limits;
mod office;
mod out;
mod pdf;
mod plain;
mod zipped;

pub use collect::{read_bytes, read_file, read_paths, Batch, PathError, Skip};
pub use detect::Format;
pub use document::{io_message, Document, Extracted, Part, Refusal};
pub use extract::extract;
pub use limits::{bytes, Limit, Limits};
