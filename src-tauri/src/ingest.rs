//! Document ingestion, minimal: plain text, Markdown and source code, as files or folders.
//!
//! A file is taken when it is UTF-8 text: no NUL byte and valid UTF-8 (which is what every
//! text, Markdown and source file is, whatever its extension). Folders are walked recursively
//! in sorted order, so the same folder always gives the same context. Skipped, each with its
//! reason: hidden files and folders (names starting with `.`: `.git`, editor state), symbolic
//! links (a link out of the folder would pull in files the user did not pick), binary files,
//! empty files, files listed twice, and rich formats whose text needs extraction (PDF, DOCX,
//! EPUB, HTML: a later issue). A path that does not exist is an error, not a skip.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use folio_models::context::{DocumentSpan, DocumentText};

/// Extensions of formats whose text must be extracted, not read as is.
const RICH_FORMATS: [&str; 9] = ["pdf", "docx", "doc", "odt", "rtf", "epub", "html", "htm", "xhtml"];

#[derive(Debug, Default)]
pub struct Ingested {
    pub documents: Vec<DocumentText>,
    /// Paths left out, each with the reason.
    pub skipped: Vec<(PathBuf, String)>,
}

/// The documents in `paths` for the CLI: a path that does not exist is an error, and so is a
/// set with no readable document.
pub fn collect(paths: &[PathBuf]) -> Result<Ingested> {
    let out = gather(paths, true)?;
    if out.documents.is_empty() {
        bail!(
            "no readable documents in {} ({} skipped); Folio reads plain text, Markdown and source code",
            paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            out.skipped.len()
        );
    }
    Ok(out)
}

/// The documents in `paths` for the window's staging sheet: whatever cannot be read, a dropped
/// path that vanished included, is a skip with its reason, and an empty set is not an error
/// (the sheet shows the reasons).
pub fn collect_lenient(paths: &[PathBuf]) -> Ingested {
    gather(paths, false).unwrap_or_else(|e| Ingested {
        documents: Vec::new(),
        skipped: vec![(paths.first().cloned().unwrap_or_default(), format!("{e:#}"))],
    })
}

/// Why a document saved in a context cannot be read again as it was prefilled.
pub enum Reread {
    Unreadable { path: PathBuf, why: String },
    Changed { path: String },
}

/// The documents of `spans` read again from their paths, each checked against the checksum
/// it was prefilled with: what resuming a prefill, or re-prefilling the documents after a
/// removed one, must compute from.
pub fn reread_saved(spans: &[&DocumentSpan]) -> std::result::Result<Vec<DocumentText>, Reread> {
    let paths: Vec<PathBuf> = spans.iter().map(|s| PathBuf::from(&s.path)).collect();
    let found = collect_lenient(&paths);
    if let Some((path, why)) = found.skipped.into_iter().next() {
        return Err(Reread::Unreadable { path, why });
    }
    match found.documents.iter().zip(spans).find(|(d, s)| d.xxh3 != s.xxh3) {
        Some((d, _)) => Err(Reread::Changed { path: d.path.clone() }),
        None => Ok(found.documents),
    }
}

fn gather(paths: &[PathBuf], strict: bool) -> Result<Ingested> {
    let mut out = Ingested::default();
    let mut seen = BTreeSet::new();
    for root in paths {
        let meta = match std::fs::metadata(root) {
            Ok(m) => m,
            Err(e) if !strict => {
                out.skipped.push((root.clone(), format!("cannot read it: {e}")));
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read it", root.display())),
        };
        if meta.is_file() {
            add_file(root, &mut seen, &mut out)?;
            continue;
        }
        let walk = walkdir::WalkDir::new(root).follow_links(false).sort_by_file_name().into_iter();
        // Hidden entries are pruned here (a hidden folder's contents are never visited) and
        // reported by `report_hidden_children` when their parent folder is entered.
        let walk = walk.filter_entry(|e| e.depth() == 0 || !e.file_name().to_string_lossy().starts_with('.'));
        for entry in walk {
            let entry = entry.with_context(|| format!("reading folder {}", root.display()))?;
            let path = entry.path();
            if entry.file_type().is_dir() {
                report_hidden_children(path, &mut out);
                continue;
            }
            if entry.file_type().is_symlink() {
                out.skipped.push((path.to_owned(), "symbolic link (not followed)".into()));
                continue;
            }
            add_file(path, &mut seen, &mut out)?;
        }
    }
    Ok(out)
}

fn report_hidden_children(dir: &Path, out: &mut Ingested) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut hidden: Vec<PathBuf> =
        entries.flatten().filter(|e| e.file_name().to_string_lossy().starts_with('.')).map(|e| e.path()).collect();
    hidden.sort();
    out.skipped.extend(hidden.into_iter().map(|p| (p, "hidden".to_owned())));
}

fn add_file(path: &Path, seen: &mut BTreeSet<PathBuf>, out: &mut Ingested) -> Result<()> {
    let canonical = match path.canonicalize() {
        Ok(c) => c,
        Err(e) => {
            out.skipped.push((path.to_owned(), format!("cannot resolve it: {e}")));
            return Ok(());
        }
    };
    if !seen.insert(canonical) {
        out.skipped.push((path.to_owned(), "listed twice".into()));
        return Ok(());
    }
    let ext = path.extension().map(|e| e.to_string_lossy().to_lowercase()).unwrap_or_default();
    if RICH_FORMATS.contains(&ext.as_str()) {
        out.skipped.push((
            path.to_owned(),
            format!("{} files are not supported yet (plain text, Markdown and source code are)", ext.to_uppercase()),
        ));
        return Ok(());
    }
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            // One unreadable file (permissions, a read error) never stops the rest.
            out.skipped.push((path.to_owned(), format!("cannot read it: {e}")));
            return Ok(());
        }
    };
    if bytes.is_empty() {
        out.skipped.push((path.to_owned(), "empty".into()));
        return Ok(());
    }
    let text = match String::from_utf8(bytes) {
        Ok(t) if !t.contains('\0') => t,
        _ => {
            out.skipped.push((path.to_owned(), "binary (not UTF-8 text)".into()));
            return Ok(());
        }
    };
    out.documents.push(DocumentText {
        title: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        path: path.display().to_string(),
        bytes: text.len() as u64,
        xxh3: folio_models::context::format::checksum(text.as_bytes()),
        text,
    });
    Ok(())
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
        std::os::unix::fs::symlink(d.join("a.txt"), d.join("link.txt"))?;
        let got = collect(&[d.to_owned(), d.join("a.txt")])?;
        let titles: Vec<&str> = got.documents.iter().map(|x| x.title.as_str()).collect();
        assert_eq!(titles, ["a.txt", "b.md", "main.rs"]);
        let reasons: Vec<(String, &str)> = got
            .skipped
            .iter()
            .map(|(p, r)| (p.strip_prefix(d).unwrap_or(p).display().to_string(), r.as_str()))
            .collect();
        for (name, why) in [
            (".env", "hidden"),
            ("src/.cache", "hidden"),
            ("logo.png", "binary"),
            ("paper.pdf", "PDF files are not supported yet"),
            ("empty.txt", "empty"),
            ("link.txt", "symbolic link"),
            ("a.txt", "listed twice"),
        ] {
            assert!(reasons.iter().any(|(p, r)| p == name && r.starts_with(why)), "{name}: {reasons:?}");
        }
        assert!(collect(&[d.join("missing")]).unwrap_err().to_string().contains("missing"));
        let lenient = collect_lenient(&[d.join("missing"), d.join("a.txt")]);
        assert_eq!(lenient.documents.len(), 1);
        assert!(lenient.skipped[0].1.starts_with("cannot read it"), "{:?}", lenient.skipped);
        assert!(collect(&[d.join("logo.png")]).unwrap_err().to_string().contains("no readable documents"));
        Ok(())
    }
}
