//! Documents for a context, read by `folio_ingest` (PDF, DOCX, ODT, EPUB, HTML, e-mail,
//! notebooks, data and text files; its crate docs state the rules) and turned into the engine's
//! [`DocumentText`]: the text with its parts (pages, chapters, sections) and the checksum a
//! resumed or re-prefilled context compares against.
//!
//! Beside reading: staging ([`stage`]: the files read here, their tokens counted by the engine's
//! `context::staging`) and [`Files`], the engine's reader of a context's saved documents (what a
//! removal or a resume reads again).
//!
//! The checksum is of the extracted text, not of the file: it is what the context's tokens
//! were computed from, so a re-read that extracts the same text continues the same context.

use std::path::PathBuf;

use anyhow::{bail, Result};
use folio_context_file::os_path;
use folio_ingest::{Format, Limits};
use folio_models::context::format::checksum;
use folio_models::context::staging::{self, ReadNotes, Skip, Staged};
use folio_models::context::{DocumentSpan, DocumentText, Reread, SavedDocuments, TextPart};
use folio_models::Engine;
use serde::Serialize;

#[derive(Debug, Default)]
pub struct Ingested {
    pub documents: Vec<DocumentText>,
    /// Per document, in the same order: what it was read as and what the reader noticed.
    pub notes: Vec<Notes>,
    /// Paths left out, each with the reason.
    pub skipped: Vec<(PathBuf, String)>,
}

/// What reading a document found beside its text.
#[derive(Debug, Clone)]
pub struct Notes {
    pub format: Format,
    pub file_bytes: u64,
    pub warnings: Vec<String>,
}

/// The documents in `paths` for the CLI: a path that does not exist is an error, and so is a
/// set with no readable document (with every reason).
pub fn collect(paths: &[PathBuf]) -> Result<Ingested> {
    let out = gather(paths, true, &|_, _| {})?;
    if out.documents.is_empty() {
        let reasons: Vec<String> = out.skipped.iter().map(|(p, why)| format!("\n  {}: {why}", p.display())).collect();
        bail!(
            "no readable documents in {} ({} skipped):{}",
            paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            out.skipped.len(),
            reasons.concat()
        );
    }
    Ok(out)
}

/// The documents in `paths` for the window's staging sheet: whatever cannot be read, a dropped
/// path that vanished included, is a skip with its reason, and an empty set is not an error
/// (the sheet shows the reasons). `on_read(done, total)` follows the reads.
pub fn collect_lenient(paths: &[PathBuf], on_read: &(dyn Fn(usize, usize) + Sync)) -> Ingested {
    gather(paths, false, on_read).unwrap_or_else(|e| Ingested {
        skipped: vec![(paths.first().cloned().unwrap_or_default(), format!("{e:#}"))],
        ..Ingested::default()
    })
}

/// The documents of `spans` read again from their paths, each checked against the checksum
/// it was prefilled with: what resuming a prefill, or re-prefilling the documents after a
/// removed one, must compute from.
fn reread_saved(spans: &[&DocumentSpan]) -> std::result::Result<Vec<DocumentText>, Reread> {
    let paths: Vec<PathBuf> = spans.iter().map(|s| os_path::from_stored(&s.path)).collect();
    let found = collect_lenient(&paths, &|_, _| {});
    if let Some((path, why)) = found.skipped.into_iter().next() {
        return Err(Reread::Unreadable { path, why });
    }
    if found.documents.len() != spans.len() {
        // A saved path that is a folder now gives several documents.
        let path =
            spans.iter().find(|s| os_path::from_stored(&s.path).is_dir()).map_or_else(String::new, |s| s.path.clone());
        return Err(Reread::Changed { path });
    }
    let mut documents = Vec::with_capacity(spans.len());
    for (d, span) in found.documents.into_iter().zip(spans) {
        if d.xxh3 == span.xxh3 {
            documents.push(d);
            continue;
        }
        // Contexts of format version 1 were prefilled from a text file's raw UTF-8 (CSV, JSON
        // and BOM-prefixed text read differently now): that text, if it is what was saved.
        match std::fs::read(os_path::from_stored(&d.path)).ok().and_then(|b| String::from_utf8(b).ok()) {
            Some(raw) if checksum(raw.as_bytes()) == span.xxh3 => documents.push(DocumentText {
                bytes: raw.len() as u64,
                xxh3: span.xxh3.clone(),
                parts: Vec::new(),
                text: raw,
                ..d
            }),
            _ => return Err(Reread::Changed { path: d.path }),
        }
    }
    Ok(documents)
}

/// The engine's reader of saved documents: from their files, as `folio_ingest` reads them.
pub struct Files;

impl SavedDocuments for Files {
    fn reread(&self, spans: &[&DocumentSpan]) -> std::result::Result<Vec<DocumentText>, Reread> {
        reread_saved(spans)
    }
}

/// What staging is doing, for its progress line.
#[derive(Debug, Clone, Copy, Serialize)]
#[cfg_attr(feature = "gui", derive(ts_rs::TS))]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Reading,
    Counting,
}

/// Reads `paths` and counts their tokens with `engine` (the window's staging sheet, `folio
/// prefill --dry-run`); `on_progress(phase, done, total)` follows the reads, then the count.
pub fn stage(engine: &Engine, paths: &[PathBuf], on_progress: &(dyn Fn(Phase, usize, usize) + Sync)) -> Staged {
    let started = std::time::Instant::now();
    let found = collect_lenient(paths, &|done, total| on_progress(Phase::Reading, done, total));
    let total = found.documents.len();
    let skipped =
        found.skipped.iter().map(|(p, r)| Skip { path: p.display().to_string(), reason: r.clone() }).collect();
    let notes: Vec<ReadNotes> = found
        .notes
        .iter()
        .map(|n| ReadNotes { kind: n.format.name().to_owned(), file_bytes: n.file_bytes, warnings: n.warnings.clone() })
        .collect();
    staging::count(engine, &found.documents, &notes, skipped, started, &|done| {
        on_progress(Phase::Counting, done, total)
    })
}

fn gather(paths: &[PathBuf], strict: bool, on_read: &(dyn Fn(usize, usize) + Sync)) -> Result<Ingested> {
    let batch = folio_ingest::read_paths(paths, strict, &Limits::default(), on_read)?;
    let mut out =
        Ingested { skipped: batch.skipped.into_iter().map(|s| (s.path, s.reason)).collect(), ..Ingested::default() };
    for d in batch.documents {
        out.notes.push(Notes { format: d.format, file_bytes: d.file_bytes, warnings: d.warnings });
        out.documents.push(DocumentText {
            title: d.title,
            path: os_path::to_stored(&d.path),
            bytes: d.text.len() as u64,
            xxh3: checksum(d.text.as_bytes()),
            kind: d.format.name().into(),
            parts: d.parts.into_iter().map(|p| TextPart { label: p.label, at: p.at }).collect(),
            text: d.text,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_walked_in_order_with_reasons_for_skips() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        std::fs::create_dir_all(d.join("src/.cache"))?;
        std::fs::write(d.join("b.md"), "# B\nbody")?;
        std::fs::write(d.join("a.txt"), "alpha")?;
        std::fs::write(d.join("src/main.rs"), "fn main() {}")?;
        std::fs::write(d.join("src/.cache/x.txt"), "hidden")?;
        std::fs::write(d.join(".env"), "SECRET=1")?;
        std::fs::write(d.join("logo.png"), [0x89, b'P', b'N', b'G', 0, 0, 1])?;
        std::fs::write(d.join("paper.pdf"), "%PDF-1.7")?;
        std::fs::write(d.join("empty.txt"), "")?;
        #[cfg(unix)]
        std::os::unix::fs::symlink(d.join("a.txt"), d.join("link.txt"))?;
        let got = collect(&[d.to_owned(), d.join("a.txt")])?;
        let titles: Vec<&str> = got.documents.iter().map(|x| x.title.as_str()).collect();
        assert_eq!(titles, ["a.txt", "b.md", "main.rs"]);
        assert_eq!(got.documents[1].parts, [TextPart { label: "B".into(), at: 0 }]);
        let reasons: Vec<(String, &str)> = got
            .skipped
            .iter()
            .map(|(p, r)| (p.strip_prefix(d).unwrap_or(p).display().to_string(), r.as_str()))
            .collect();
        for (name, why) in [
            (".env", "hidden"),
            ("src/.cache", "hidden"),
            ("logo.png", "binary (a PNG image)"),
            ("paper.pdf", "a damaged PDF"),
            ("empty.txt", "empty"),
            ("link.txt", "symbolic link"),
            ("a.txt", "listed twice"),
        ] {
            assert!(reasons.iter().any(|(p, r)| p == name && r.starts_with(why)), "{name}: {reasons:?}");
        }
        assert!(collect(&[d.join("missing")]).unwrap_err().to_string().contains("missing"));
        let lenient = collect_lenient(&[d.join("missing"), d.join("a.txt")], &|_, _| {});
        assert_eq!(lenient.documents.len(), 1);
        assert!(lenient.skipped[0].1.starts_with("cannot read it"), "{:?}", lenient.skipped);
        // A set of only bad files says why, file by file.
        let e = collect(&[d.join("logo.png"), d.join("empty.txt")]).unwrap_err().to_string();
        assert!(e.contains("no readable documents") && e.contains("(2 skipped)"), "{e}");
        assert!(e.contains("logo.png: binary (a PNG image)") && e.contains("empty.txt: empty"), "{e}");
        Ok(())
    }

    /// Staging reads through folio-ingest and counts with the engine: the sheet's total is the
    /// planned context's length for the same documents.
    #[test]
    fn staging_the_samples_counts_what_the_prefill_plans() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");
        let engine = Engine::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
        let samples = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/samples"));
        let phases = std::sync::Mutex::new(Vec::new());
        let staged = stage(&engine, std::slice::from_ref(&samples), &|phase, _, _| {
            phases.lock().unwrap().push(format!("{phase:?}"));
        });
        assert_eq!(staged.documents.len(), 3, "{:?}", staged.skipped);
        let plan = engine.plan_context(&collect(&[samples]).unwrap().documents, None, None).unwrap();
        let total = staged.head_tokens + staged.documents.iter().map(|d| d.tokens).sum::<usize>();
        assert_eq!(total, plan.tokens.len());
        let phases = phases.into_inner().unwrap();
        assert!(phases.first().is_some_and(|p| p == "Reading") && phases.last().is_some_and(|p| p == "Counting"));
    }
}
