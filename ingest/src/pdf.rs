//! PDF: the text layer page by page (`pdf-extract` on `lopdf`), each page a part "p. N".
//!
//! Reading order is the order of the page's content stream, which is the reading order for
//! what word processors and LaTeX produce; multi-column scans and hand-placed layouts may
//! interleave columns (docs/ingest.md). An encrypted file opens when its user password is
//! empty (the common "no copying" protection) and is refused otherwise; a file whose pages
//! carry no text is a scan, reported as such.

use crate::limits::{Budget, Limit, LimitHit};
use crate::out::Out;
use crate::{Extracted, Format, Refusal};

pub(crate) fn extract(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let mut doc = lopdf::Document::load_mem(bytes).map_err(|e| damaged(&e))?;
    if doc.is_encrypted() && doc.decrypt("").is_err() {
        return Err(Refusal::Encrypted);
    }
    let pages = doc.get_pages();
    if pages.len() > budget.limits.pages {
        return Err(
            LimitHit::new(Limit::Pages, format!("it has {} pages, over {}", pages.len(), budget.limits.pages)).into()
        );
    }
    if pages.is_empty() {
        return Err(Refusal::damaged(Format::Pdf, "it has no pages"));
    }
    let mut out = Out::new(budget);
    let mut with_text = 0;
    let mut failed = Vec::new();
    for (&number, &page_id) in &pages {
        budget.tick()?;
        if let Some(why) = unreadable_content(&doc, page_id) {
            failed.push((number, why));
            continue;
        }
        let mut text = String::new();
        // pdf-extract unwraps on some damaged pages: one such page is a failed page, not a
        // failed document.
        let page = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut output = pdf_extract::PlainTextOutput::new(&mut text);
            pdf_extract::output_doc_page(&doc, &mut output, number)
        }));
        match page {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failed.push((number, e.to_string()));
                continue;
            }
            Err(_) => {
                failed.push((number, "the PDF reader failed on it".into()));
                continue;
            }
        }
        let text = tidy(&text);
        if text.is_empty() {
            continue;
        }
        with_text += 1;
        out.part(format!("p. {number}"));
        out.verbatim(&text)?;
    }
    if with_text == 0 && failed.is_empty() {
        return Err(Refusal::NoTextLayer);
    }
    if with_text == 0 {
        let (page, why) = &failed[0];
        return Err(Refusal::damaged(Format::Pdf, format!("no page could be read (page {page}: {why})")));
    }
    if !failed.is_empty() {
        let list: Vec<String> = failed.iter().take(5).map(|(n, _)| n.to_string()).collect();
        out.warn(format!(
            "{} of {} pages could not be read (pages {}{}): {}",
            failed.len(),
            pages.len(),
            list.join(", "),
            if failed.len() > 5 { ", …" } else { "" },
            failed[0].1
        ));
    }
    Ok(out.finish())
}

/// Why a page's content cannot be read, when it cannot: a content stream the reader dropped —
/// one whose /Length runs past the file's end is not loaded — so that the page would read as
/// empty, like a scan's or a blank page, and be left out without a word. (A stream whose filter
/// the reader cannot decode is read raw by the text extractor, as it is, and is not counted.)
fn unreadable_content(doc: &lopdf::Document, page: lopdf::ObjectId) -> Option<String> {
    // The page's own /Contents entry — a stream, an array of streams, or a reference to either:
    // the reader's list of a page's contents leaves out the objects it dropped.
    let mut contents = doc.get_dictionary(page).ok()?.get(b"Contents").ok()?.clone();
    if let lopdf::Object::Reference(id) = contents {
        match doc.get_object(id) {
            Ok(lopdf::Object::Array(list)) => contents = lopdf::Object::Array(list.clone()),
            Ok(_) => {}
            Err(e) => return Some(format!("its content (object {} {}) cannot be read: {e}", id.0, id.1)),
        }
    }
    let ids: Vec<lopdf::ObjectId> = match &contents {
        lopdf::Object::Reference(id) => vec![*id],
        lopdf::Object::Array(list) => list.iter().filter_map(|o| o.as_reference().ok()).collect(),
        _ => Vec::new(),
    };
    ids.into_iter().find_map(|id| {
        let why = match doc.get_object(id) {
            Ok(lopdf::Object::Stream(_)) => return None,
            // What the reader keeps of a stream whose /Length runs past the file: its dictionary.
            Ok(other) => format!("it is a {} where a content stream belongs", other.enum_variant()),
            Err(e) => e.to_string(),
        };
        Some(format!("its content (object {} {}) cannot be read: {why}", id.0, id.1))
    })
}

fn damaged(e: &lopdf::Error) -> Refusal {
    let detail = match e {
        lopdf::Error::Xref(_) | lopdf::Error::MissingXrefEntry => format!("its cross-reference table is broken ({e})"),
        _ => e.to_string(),
    };
    Refusal::damaged(Format::Pdf, detail)
}

/// A page's text as paragraphs: trailing spaces and runs of blank lines removed (pdf-extract
/// marks vertical gaps with several newlines), and lines that a paragraph wrapped joined again.
/// A line is taken for wrapped when it is nearly as long as the page's longest line (it ran to
/// the margin) and the next one is not a list item; a hyphen at the wrap is kept (telling
/// hyphenation from compounds needs a dictionary).
fn tidy(text: &str) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    let longest = lines.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let mut out = String::with_capacity(text.len());
    let (mut blank, mut wrapped) = (0, false);
    for line in lines {
        if line.trim().is_empty() {
            blank += 1;
            continue;
        }
        if !out.is_empty() {
            let item = line.trim_start().starts_with(LIST_MARKERS);
            out.push_str(match (blank > 0, wrapped && !item) {
                (true, _) => "\n\n",
                (false, true) if out.ends_with('-') => "",
                (false, true) => " ",
                (false, false) => "\n",
            });
        }
        blank = 0;
        wrapped = line.chars().count() * WRAP_SHARE_DEN >= longest * WRAP_SHARE_NUM;
        out.push_str(if out.ends_with(' ') || out.is_empty() || out.ends_with('-') { line.trim_start() } else { line });
    }
    out
}

/// A line at least this share (7/10) of the page's longest line ran to the right margin.
const WRAP_SHARE_NUM: usize = 7;
const WRAP_SHARE_DEN: usize = 10;
/// How list items start in PDF text.
const LIST_MARKERS: [char; 6] = ['•', '◦', '▪', '–', '-', '*'];
