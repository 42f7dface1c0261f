//! The committed corpus (tests/ingest, made by tools/make-ingest-corpus.sh with LibreOffice,
//! pandoc and qpdf): every format's text checked — order, headings, lists, tables, pages and
//! chapters — and every bad file refused with its specific reason while the rest is read.

use std::path::{Path, PathBuf};

use folio_ingest::{read_file, read_paths, Document, Format, Limits};

fn corpus(part: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/ingest")).join(part)
}

fn read(name: &str) -> Document {
    read_file(&corpus("good").join(name), &Limits::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn labels(d: &Document) -> Vec<&str> {
    d.parts.iter().map(|p| p.label.as_str()).collect()
}

/// The part of `d` that holds `needle`.
fn part_of<'a>(d: &'a Document, needle: &str) -> &'a str {
    let at = d.text.find(needle).unwrap_or_else(|| panic!("{} lacks {needle:?}:\n{}", d.title, d.text));
    d.parts.iter().rev().find(|p| p.at <= at).map_or("", |p| p.label.as_str())
}

/// What a word processor's report reads as: Markdown headings, list items, table rows.
const REPORT: &str = "# Quarterly Report\n\n## Summary\n\nRevenue rose in two of three regions this quarter. Staff \
                      numbers stayed close to plan, and costs were lower than expected.\n\n## Regional Figures\n\n\
                      - North grew by 12 percent\n- South held steady\n- East fell by 3 percent\n\n\
                      | Region | Revenue | Staff |\n| North | 4200 | 31 |\n| South | 3900 | 28 |\n\n## Outlook\n\n\
                      We expect steady growth in the next quarter. Earlier reports are kept in the archive";

#[test]
fn word_processor_files_keep_headings_lists_and_tables() {
    for name in ["report.docx", "report.odt"] {
        let d = read(name);
        assert_eq!(d.text, format!("{REPORT}.\n"), "{name}");
        assert_eq!(labels(&d), ["Quarterly Report", "Summary", "Regional Figures", "Outlook"], "{name}");
    }
    let html = read("report.html");
    assert_eq!(html.format, Format::Html);
    assert_eq!(html.text, format!("{REPORT} (https://example.org/archive).\n"), "scripts, styles and nav dropped");
    assert!(!html.text.contains("Home") && !html.text.contains("tracking"));
}

#[test]
fn pdf_pages_are_parts_in_reading_order() {
    let d = read("report.pdf");
    assert_eq!(labels(&d), ["p. 1", "p. 2", "p. 3"]);
    assert_eq!(part_of(&d, "Revenue rose"), "p. 1");
    assert_eq!(part_of(&d, "East fell by 3 percent"), "p. 2");
    assert_eq!(part_of(&d, "North 4200 31"), "p. 2");
    assert_eq!(part_of(&d, "We expect steady growth"), "p. 3");
    let order: Vec<usize> = ["Quarterly Report", "Summary", "Regional Figures", "South held steady", "Outlook"]
        .iter()
        .map(|w| d.text.find(w).unwrap())
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "reading order: {order:?}");
    let notes = read("field_notes.pdf");
    assert_eq!(part_of(&notes, "The secret code of amber falcon is 48152."), "p. 2");
    assert_eq!(part_of(&notes, "Nobody opened the gate at night."), "p. 1");
}

#[test]
fn epub_chapters_follow_the_spine() {
    let d = read("report.epub");
    assert_eq!(labels(&d), ["Quarterly Report", "Summary", "Regional Figures", "Outlook"]);
    assert!(d.text.contains("| North | 4200 | 31 |"));
    let diary = read("the_diary_of_greta.epub");
    assert_eq!(labels(&diary), ["Greta", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]);
    assert_eq!(part_of(&diary, "The pass key is 90417."), "Monday");
    assert_eq!(part_of(&diary, "The secret code of violet lynx is 11863."), "Friday");
}

#[test]
fn samples_keep_every_fact_in_rich_formats() {
    let records = read("market_records.docx");
    for fact in ["cobalt heron is 66120", "jade tiger is 90455", "crimson owl is 27093"] {
        assert_eq!(part_of(&records, fact), "Market Report");
    }
    let notes = read("field_notes.html");
    assert_eq!(part_of(&notes, "silver otter is 30719"), "After the Storm");
}

#[test]
fn mail_notebooks_and_data_read_as_text() {
    let mail = read("letter.eml");
    assert_eq!(mail.format, Format::Email);
    assert!(
        mail.text.starts_with("Subject: Budget meeting\nFrom: Alice Example <alice@example.org>\n"),
        "{}",
        mail.text
    );
    assert!(mail.text.contains("The budget meeting moves to Thursday."));
    assert!(mail.text.contains("Attachments (not read): budget.pdf (application/pdf)"));
    let inbox = read("inbox.mbox");
    assert_eq!(labels(&inbox), ["First note", "Second note"]);
    assert!(inbox.text.contains("\nFrom the desk of Alice, with thanks."), "mboxo escape undone");
    let nb = read("notebook.ipynb");
    assert_eq!(
        nb.text,
        "# Analysis\n\n```python\nprint(sum([1, 2, 3]))\n```\n\n```output\n6\n```\n\nThe total is six.\n"
    );
    for name in ["table.csv", "table.tsv"] {
        let t = read(name);
        assert_eq!(t.text.lines().nth(1), Some("| Oslo | 709000 | Capital, largest city |"), "{name}");
        assert_eq!(t.text.lines().count(), 4, "{name}");
    }
    let json = read("data.json");
    assert!(json.text.contains("\"city\": \"Bergen\"") && json.text.contains("\"books\": 17"));
}

#[test]
fn encodings_are_detected_and_reported() {
    let latin = read("latin1.txt");
    assert!(latin.text.starts_with("Café crème brûlée — naïve façade\n"), "{}", latin.text);
    assert_eq!(latin.warnings, ["read as windows-1252 (detected: it is not UTF-8)"]);
    for name in ["utf16le-bom.txt", "utf16be-bom.txt"] {
        let d = read(name);
        assert!(d.text.contains("The ferry to the café leaves at seven."), "{name}");
        assert!(d.warnings.is_empty(), "{name}: {:?}", d.warnings);
    }
    let bad = |name: &str| read_file(&corpus("bad").join(name), &Limits::default());
    let damaged = bad("invalid-utf8.txt").unwrap();
    assert_eq!(damaged.warnings, ["3 invalid UTF-8 bytes in 3 places replaced by U+FFFD"]);
    assert!(damaged.text.contains("Renée"));
    let no_bom = bad("utf16le-nobom.txt").unwrap();
    assert!(no_bom.text.starts_with("The ferry leaves the harbor at seven."));
    assert_eq!(no_bom.warnings, ["read as UTF-16LE (it has no byte order mark)"]);
}

/// Every bad file of the corpus, and the ones made here (a symlink loop, an unreadable file, a
/// named pipe), in one batch with good files: each refused with its reason, the good ones read
/// — a 50 MB HTML page of one line among them, whole (a long line is no reason to refuse).
#[test]
fn every_bad_file_is_named_with_its_reason_and_the_batch_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let one_line = format!("<html><body><p>{}</p></body></html>", "harbor, ".repeat(50 << 20 >> 3));
    std::fs::write(d.join("one-line.html"), one_line).unwrap();
    std::os::unix::fs::symlink(d.join("loop"), d.join("loop")).unwrap();
    std::fs::write(d.join("secret.txt"), "not for you").unwrap();
    std::fs::set_permissions(d.join("secret.txt"), std::os::unix::fs::PermissionsExt::from_mode(0o000)).unwrap();
    let fifo = std::ffi::CString::new(d.join("pipe.txt").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    std::fs::write(d.join("fine.txt"), "The harbor opens at six.").unwrap();

    let mut paths: Vec<PathBuf> = std::fs::read_dir(corpus("bad")).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    paths.extend(["one-line.html", "loop", "secret.txt", "pipe.txt", "fine.txt"].map(|n| d.join(n)));
    paths.push(corpus("good").join("report.rtf"));
    paths.push(corpus("good").join("scanned.pdf"));
    let batch = without_file_permissions(|| read_paths(&paths, true, &Limits::default(), &|_, _| {}).unwrap());

    let read: Vec<&str> = batch.documents.iter().map(|d| d.title.as_str()).collect();
    assert_eq!(read, ["invalid-utf8.txt", "utf16le-nobom.txt", "one-line.html", "fine.txt"]);
    let one_line = &batch.documents[2].text;
    assert_eq!(one_line.trim_end().len(), "harbor, ".repeat(50 << 20 >> 3).trim_end().len(), "read whole");
    let reason = |name: &str| {
        let skip =
            batch.skipped.iter().find(|s| s.path.ends_with(name)).unwrap_or_else(|| panic!("{name} not skipped"));
        skip.reason.clone()
    };
    for (name, expected) in [
        ("encrypted.pdf", "encrypted with a password"),
        ("truncated.pdf", "a damaged PDF: its cross-reference table is broken"),
        ("broken-xref.pdf", "a damaged PDF"),
        ("bomb.docx", "(compression ratio limit)"),
        ("missing-spine.epub", "its spine lists EPUB/text/ch002.xhtml, which is not in the EPUB"),
        ("entities.xml", "(XML entity expansion limit)"),
        ("binary.txt", "binary (it holds NUL bytes"),
        ("empty.txt", "empty"),
        ("loop", "cannot read it: too many levels of symbolic links"),
        ("secret.txt", "cannot read it: permission denied"),
        ("pipe.txt", "a named pipe, not a regular file"),
        ("report.rtf", "RTF is not read"),
        ("scanned.pdf", "no text layer (a scan or images of pages); Folio does not do OCR"),
    ] {
        let got = reason(name);
        assert!(got.contains(expected), "{name}: {got:?} lacks {expected:?}");
    }
}

/// Runs `f` on a thread (and the threads it starts) without the capabilities that let root
/// ignore file permissions, so an unreadable file is unreadable in CI's container too.
/// Capabilities are per thread on Linux and inherited by threads created after the change.
fn without_file_permissions<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            drop_dac_capabilities();
            f()
        })
        .join()
        .unwrap()
    })
}

fn drop_dac_capabilities() {
    /// `_LINUX_CAPABILITY_VERSION_3` and the two capabilities that bypass read permission.
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_DAC_OVERRIDE: u32 = 1;
    const CAP_DAC_READ_SEARCH: u32 = 2;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header { version: VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()), 0);
        data[0].effective &= !((1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH));
        assert_eq!(libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()), 0);
    }
}

/// A file that grows while it is read is refused, not read half-way.
#[test]
fn a_file_that_changes_while_read_is_refused() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("growing.txt");
    std::fs::write(&path, "harbor ".repeat(8 << 20)).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let refusal = std::thread::scope(|s| {
        s.spawn(|| {
            let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                f.write_all(b"more ").unwrap();
            }
        });
        let mut refusal = None;
        for _ in 0..20 {
            if let Err(e) = read_file(&path, &Limits::default()) {
                refusal = Some(e.to_string());
                break;
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        refusal
    });
    assert_eq!(refusal.as_deref(), Some("it changed while it was read; add it again once it is saved"));
}

/// A PDF whose page content stream declares a /Length past the file's end: the page would read
/// as empty, like a blank page or a scan, and be left out without a word. It is a page that
/// could not be read, named in a warning; with every page so, the file is a damaged PDF, not a
/// scan.
#[test]
fn a_page_with_a_runaway_stream_length_is_named_not_dropped() {
    let good = std::fs::read(corpus("good").join("report.pdf")).unwrap();
    // The first page's content stream; the same length of text, so the file's offsets hold.
    let at = good.windows(13).position(|w| w == b"/Length 3 0 R").expect("the first stream's length");
    let mut bad = good.clone();
    bad[at..at + 13].copy_from_slice(b"/Length 99999");
    let (_, read) = folio_ingest::read_bytes(std::sync::Arc::new(bad), "runaway.pdf", &Limits::default()).unwrap();
    assert!(
        read.warnings.iter().any(|w| w.starts_with("1 of 3 pages could not be read (pages 1)")),
        "{:?}",
        read.warnings
    );
}
