//! What a file is, from its first bytes (and, for ZIP containers, the names of its entries);
//! the extension only chooses among text formats, which bytes alone cannot tell apart.

use std::io::Cursor;

use serde::Serialize;

/// The formats Folio reads (and the kinds it names when it does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Format {
    Pdf,
    Docx,
    Odt,
    Epub,
    Html,
    Rtf,
    Email,
    Mbox,
    Notebook,
    Json,
    Csv,
    Tsv,
    Xml,
    Markdown,
    Text,
    Code,
    /// A ZIP archive that is none of the document containers.
    Zip,
    /// Not text: what it looks like (an image, an executable, "not text").
    #[serde(skip)]
    Binary(&'static str),
}

impl Format {
    /// The short name shown beside a document ("pdf", "docx").
    pub fn name(self) -> &'static str {
        match self {
            Format::Pdf => "PDF",
            Format::Docx => "DOCX",
            Format::Odt => "ODT",
            Format::Epub => "EPUB",
            Format::Html => "HTML",
            Format::Rtf => "RTF",
            Format::Email => "e-mail",
            Format::Mbox => "mbox",
            Format::Notebook => "notebook",
            Format::Json => "JSON",
            Format::Csv => "CSV",
            Format::Tsv => "TSV",
            Format::Xml => "XML",
            Format::Markdown => "Markdown",
            Format::Text => "text",
            Format::Code => "code",
            Format::Zip => "ZIP",
            Format::Binary(_) => "binary",
        }
    }
}

/// Magic numbers of binary files people keep beside their documents: named in the skip so the
/// user sees why ("a PNG image"), not just "binary".
const BINARY_MAGIC: [(&[u8], &str); 12] = [
    (b"\x89PNG", "a PNG image"),
    (b"\xFF\xD8\xFF", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"\x7FELF", "an executable"),
    (b"MZ", "a Windows executable"),
    (b"\x1F\x8B", "a gzip archive"),
    (b"BZh", "a bzip2 archive"),
    (b"\xFD7zXZ", "an xz archive"),
    (b"7z\xBC\xAF", "a 7-Zip archive"),
    (b"Rar!", "a RAR archive"),
    (b"\xD0\xCF\x11\xE0", "an old Microsoft Office file (DOC/XLS/PPT)"),
    (b"SQLite format 3\0", "an SQLite database"),
];

/// Extensions read as Markdown.
const MARKDOWN: [&str; 4] = ["md", "markdown", "mdown", "mkd"];
/// Extensions of source code (read as text, kept verbatim).
const CODE: [&str; 40] = [
    "rs", "py", "js", "ts", "tsx", "jsx", "c", "h", "cc", "cpp", "hpp", "cs", "java", "kt", "go", "rb", "php", "swift",
    "scala", "sh", "bash", "zsh", "ps1", "sql", "r", "jl", "lua", "pl", "hs", "ml", "ex", "erl", "clj", "svelte",
    "vue", "css", "scss", "toml", "yaml", "yml",
];

/// The format of `bytes`, a file named `name`.
pub fn detect(bytes: &[u8], name: &str) -> Format {
    let ext = std::path::Path::new(name).extension().map(|e| e.to_string_lossy().to_lowercase()).unwrap_or_default();
    let head = &bytes[..bytes.len().min(1024)];
    // PDF writers may put bytes before the header (it must be in the first KiB); a text file
    // that merely mentions "%PDF-" must start with it to be taken for one.
    let text_named = MARKDOWN.contains(&ext.as_str()) || CODE.contains(&ext.as_str()) || ext == "txt";
    if if text_named { bytes.starts_with(b"%PDF-") } else { find(head, b"%PDF-").is_some() } {
        return Format::Pdf;
    }
    if bytes.starts_with(b"PK\x03\x04") {
        return container(bytes);
    }
    if head.starts_with(b"{\\rtf") {
        return Format::Rtf;
    }
    for (magic, what) in BINARY_MAGIC {
        if bytes.starts_with(magic) {
            return Format::Binary(what);
        }
    }
    let start = trim_start(strip_bom(head));
    if start.starts_with(b"From ") && looks_like_headers(after_line(start)) {
        return Format::Mbox;
    }
    if looks_like_headers(start) && (ext == "eml" || ext.is_empty() || ext == "msg" || ext == "txt") {
        return Format::Email;
    }
    let lower = String::from_utf8_lossy(&start[..start.len().min(256)]).to_lowercase();
    if lower.starts_with("<!doctype html") || lower.starts_with("<html") || ["html", "htm", "xhtml"].contains(&&*ext) {
        return Format::Html;
    }
    match ext.as_str() {
        "ipynb" => Format::Notebook,
        "json" => Format::Json,
        "csv" => Format::Csv,
        "tsv" | "tab" => Format::Tsv,
        "xml" => Format::Xml,
        "eml" => Format::Email,
        "mbox" => Format::Mbox,
        e if MARKDOWN.contains(&e) => Format::Markdown,
        e if CODE.contains(&e) => Format::Code,
        _ if lower.starts_with("<?xml") => Format::Xml,
        _ => Format::Text,
    }
}

/// Which document a ZIP holds: OOXML's main part, an OPF package's `mimetype` entry (EPUB and
/// ODF both write it first, uncompressed).
fn container(bytes: &[u8]) -> Format {
    let Ok(mut zip) = zip::ZipArchive::new(Cursor::new(bytes)) else {
        // A damaged ZIP: the name is the best guess left, and its reader reports the damage.
        return Format::Zip;
    };
    if zip.index_for_name("word/document.xml").is_some() {
        return Format::Docx;
    }
    let mimetype = zip.by_name("mimetype").ok().and_then(|f| {
        use std::io::Read;
        let mut s = String::new();
        f.take(128).read_to_string(&mut s).ok().map(|_| s.trim().to_owned())
    });
    match mimetype.as_deref() {
        Some("application/epub+zip") => Format::Epub,
        Some("application/vnd.oasis.opendocument.text") => Format::Odt,
        _ if zip.index_for_name("META-INF/container.xml").is_some() => Format::Epub,
        _ if zip.index_for_name("content.xml").is_some() => Format::Odt,
        _ => Format::Zip,
    }
}

/// Whether `text` starts with RFC 5322 header lines (`Name: value`), among them one that every
/// message has.
fn looks_like_headers(text: &[u8]) -> bool {
    const KNOWN: [&str; 6] = ["from", "to", "subject", "date", "message-id", "received"];
    let text = String::from_utf8_lossy(&text[..text.len().min(1024)]);
    let mut headers = 0;
    let mut known = false;
    for line in text.lines() {
        if line.is_empty() {
            break;
        }
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let Some((name, _)) = line.split_once(':') else { return false };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return false;
        }
        known |= KNOWN.contains(&name.to_ascii_lowercase().as_str());
        headers += 1;
    }
    headers >= 2 && known
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn strip_bom(b: &[u8]) -> &[u8] {
    b.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(b)
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

fn after_line(b: &[u8]) -> &[u8] {
    b.iter().position(|&c| c == b'\n').map_or(&[][..], |i| &b[i + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_wins_over_the_extension() {
        assert_eq!(detect(b"%PDF-1.7\n...", "notes.txt"), Format::Pdf);
        assert_eq!(detect(b"\x89PNG\r\n\x1a\n", "a.md"), Format::Binary("a PNG image"));
        assert_eq!(detect(b"<!DOCTYPE html><p>x", "page.txt"), Format::Html);
        assert_eq!(detect(b"From: a@b.c\nSubject: hi\n\nbody", "note"), Format::Email);
        assert_eq!(detect(b"From a@b Thu Jan 1 00:00:00 2026\nFrom: a@b.c\nSubject: x\n\nb", "box"), Format::Mbox);
        assert_eq!(detect(b"From here on, read carefully.\n", "a.txt"), Format::Text);
        assert_eq!(detect(b"# Title", "a.md"), Format::Markdown);
        assert_eq!(detect(b"fn main() {}", "main.rs"), Format::Code);
        assert_eq!(detect(b"a,b\n1,2", "t.csv"), Format::Csv);
    }
}
