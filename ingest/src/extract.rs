//! One document's bytes to its text: the format detected by content, then that format's
//! reader, under a [`Budget`](crate::limits::Budget). The batch driver (`collect`) adds the
//! worker thread, the time limit and the file checks around it.

use crate::detect::{self, Format};
use crate::document::{Extracted, Refusal};
use crate::limits::{self, Limits};
use crate::{email, html, office, pdf, plain};

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
    if extracted.text.trim().is_empty() {
        return Err(Refusal::NoText);
    }
    Ok((format, extracted))
}

/// RTF: no maintained Rust crate reads it (docs/ingest.md), and Folio does not hand-write one.
const RTF_UNSUPPORTED: &str =
    "RTF is not read (no maintained RTF reader for Rust); save it as DOCX or ODT from your word processor";

const ZIP_UNSUPPORTED: &str = "a ZIP archive that is not a DOCX, ODT or EPUB document; unpack it and add its files";
