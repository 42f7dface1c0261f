//! Text formats: plain text in any common encoding, Markdown, source code, CSV/TSV, JSON,
//! Jupyter notebooks and generic XML.
//!
//! Encodings, in order: a byte order mark (UTF-8, UTF-16LE/BE) decides; UTF-16 without one is
//! recognised by its zero bytes (ASCII text in UTF-16 has a zero in every other byte); valid
//! UTF-8 is UTF-8; otherwise a file holding any valid multi-byte UTF-8 sequence is UTF-8 with
//! its invalid bytes replaced (and counted), and one with none is a legacy encoding detected by
//! `chardetng` (Windows-1252 for Western text) — named in a warning, never silently.

use crate::limits::{Budget, Limit, LimitHit};
use crate::out::Out;
use crate::{Extracted, Format, Refusal};

/// Share of control characters (other than tab, newline, carriage return, form feed) past
/// which decoded "text" is really binary.
const MAX_CONTROL_SHARE: f64 = 0.01;
/// Invalid places per valid non-ASCII character past which bytes are taken for a legacy
/// encoding rather than damaged UTF-8.
const LEGACY_INVALID_PER_VALID: usize = 4;
/// Bytes sampled to recognise UTF-16 without a byte order mark.
const UTF16_SAMPLE: usize = 4096;

/// Text decoded from bytes, with what the decoding had to do.
pub(crate) struct Decoded {
    pub text: String,
    pub warnings: Vec<String>,
}

pub(crate) fn decode(bytes: &[u8], budget: &Budget) -> Result<Decoded, Refusal> {
    budget.tick()?;
    let mut warnings = Vec::new();
    let text = if let Some((encoding, bom)) = encoding_rs::Encoding::for_bom(bytes) {
        let (text, errors) = encoding.decode_without_bom_handling(&bytes[bom..]);
        if errors {
            warnings.push(format!(
                "{} replacement characters stand for bytes invalid in {}",
                count_replacements(&text),
                encoding.name()
            ));
        }
        text.into_owned()
    } else if let Some(encoding) = utf16_without_bom(bytes) {
        let (text, _) = encoding.decode_without_bom_handling(bytes);
        warnings.push(format!("read as {} (it has no byte order mark)", encoding.name()));
        text.into_owned()
    } else if bytes.contains(&0) {
        return Err(Refusal::Binary("it holds NUL bytes, which text never does".into()));
    } else {
        match std::str::from_utf8(bytes) {
            Ok(text) => text.to_owned(),
            Err(_) => legacy_or_lossy(bytes, &mut warnings),
        }
    };
    let controls = text.chars().filter(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r' | '\x0C')).count();
    if controls as f64 > MAX_CONTROL_SHARE * text.chars().count().max(1) as f64 {
        return Err(Refusal::Binary(format!("{controls} control characters: not text")));
    }
    Ok(Decoded { text, warnings })
}

/// Bytes that are not UTF-8: UTF-8 with some damage when they hold a valid multi-byte
/// sequence, a legacy single-byte encoding otherwise.
fn legacy_or_lossy(bytes: &[u8], warnings: &mut Vec<String>) -> String {
    let (mut invalid_bytes, mut places, mut multibyte) = (0, 0, 0);
    for chunk in bytes.utf8_chunks() {
        multibyte += chunk.valid().chars().filter(|c| !c.is_ascii()).count();
        if !chunk.invalid().is_empty() {
            invalid_bytes += chunk.invalid().len();
            places += 1;
        }
    }
    // Legacy multi-byte encodings (GBK, Shift_JIS, Big5) form valid UTF-8 pairs by chance,
    // about one in ten: many more invalid places than valid characters means not UTF-8.
    if places > LEGACY_INVALID_PER_VALID * multibyte {
        let mut detector = chardetng::EncodingDetector::new(chardetng::Iso2022JpDetection::Deny);
        detector.feed(bytes, true);
        let encoding = detector.guess(None, chardetng::Utf8Detection::Deny);
        if encoding != encoding_rs::UTF_8 {
            let (text, _, _) = encoding.decode(bytes);
            warnings.push(format!("read as {} (detected: it is not UTF-8)", encoding.name()));
            return text.into_owned();
        }
    }
    warnings.push(format!(
        "{invalid_bytes} invalid UTF-8 byte{} in {places} place{} replaced by U+FFFD",
        plural(invalid_bytes),
        plural(places)
    ));
    String::from_utf8_lossy(bytes).into_owned()
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// UTF-16 without a byte order mark: zeros in one byte of most pairs and almost never in the
/// other (true of text in any Latin script).
fn utf16_without_bom(bytes: &[u8]) -> Option<&'static encoding_rs::Encoding> {
    let sample = &bytes[..bytes.len().min(UTF16_SAMPLE) & !1];
    let pairs = sample.len() / 2;
    if pairs < 2 {
        return None;
    }
    let even = sample.iter().step_by(2).filter(|&&b| b == 0).count();
    let odd = sample.iter().skip(1).step_by(2).filter(|&&b| b == 0).count();
    let (most, few) = (pairs * 3 / 10, pairs / 50);
    match (even, odd) {
        (e, o) if o >= most && e <= few => Some(encoding_rs::UTF_16LE),
        (e, o) if e >= most && o <= few => Some(encoding_rs::UTF_16BE),
        _ => None,
    }
}

fn count_replacements(text: &str) -> usize {
    text.chars().filter(|&c| c == char::REPLACEMENT_CHARACTER).count()
}

/// Plain text, Markdown and code: the text exactly as decoded (a context's checksum of a text
/// file is the file's own), Markdown's ATX headings (`#` to `###`, outside code fences)
/// starting parts.
pub(crate) fn text(bytes: &[u8], format: Format, budget: &Budget) -> Result<Extracted, Refusal> {
    let decoded = decode(bytes, budget)?;
    if decoded.text.len() > budget.limits.text_bytes {
        return Err(LimitHit::new(
            Limit::TextSize,
            format!("its text is {}, over {}", bytes_text(decoded.text.len()), bytes_text(budget.limits.text_bytes)),
        )
        .into());
    }
    let parts = if format == Format::Markdown { markdown_parts(&decoded.text) } else { Vec::new() };
    Ok(Extracted { text: decoded.text, parts, warnings: decoded.warnings })
}

fn bytes_text(n: usize) -> String {
    crate::limits::bytes(n as u64)
}

/// Where a Markdown text's headings of levels 1 to 3 start (outside code fences).
fn markdown_parts(text: &str) -> Vec<crate::Part> {
    let mut parts = Vec::new();
    let (mut fenced, mut at) = (false, 0);
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
        }
        let hashes = trimmed.bytes().take_while(|&b| b == b'#').count();
        if !fenced && (1..=3).contains(&hashes) && trimmed[hashes..].starts_with([' ', '\t']) {
            let label = crate::out::collapse(trimmed[hashes..].trim().trim_end_matches('#'));
            if !label.is_empty() {
                parts.push(crate::Part { label, at });
            }
        }
        at += line.len();
    }
    parts
}

/// Markdown: kept as written, with ATX headings (`#` to `###`, outside code fences) starting parts.
pub(crate) fn markdown_into(out: &mut Out, text: &str) -> Result<(), LimitHit> {
    let mut fenced = false;
    let mut block = String::new();
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
        }
        let hashes = trimmed.bytes().take_while(|&b| b == b'#').count();
        let heading = !fenced && (1..=6).contains(&hashes) && trimmed[hashes..].starts_with([' ', '\t']);
        if heading {
            out.verbatim(&std::mem::take(&mut block))?;
            out.heading(hashes, trimmed[hashes..].trim().trim_end_matches('#'))?;
        } else {
            block.push_str(line);
        }
    }
    out.verbatim(&block)
}

/// CSV or TSV: one `| a | b |` row per record, the header row first as written.
pub(crate) fn table(bytes: &[u8], tabs: bool, budget: &Budget) -> Result<Extracted, Refusal> {
    let decoded = decode(bytes, budget)?;
    let mut out = Out::new(budget);
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(if tabs { b'\t' } else { b',' })
        .quoting(!tabs)
        .from_reader(decoded.text.as_bytes());
    for record in reader.records() {
        let record = record.map_err(|e| Refusal::damaged(if tabs { Format::Tsv } else { Format::Csv }, e))?;
        let cells: Vec<String> = record.iter().map(str::to_owned).collect();
        out.row(&cells)?;
    }
    for w in decoded.warnings {
        out.warn(w);
    }
    Ok(out.finish())
}

/// JSON, pretty-printed (keys in their order); nesting past serde_json's own recursion limit
/// is the nesting depth limit.
pub(crate) fn json(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let value = parse_json(bytes, budget, Format::Json)?;
    // Pretty-printing grows deep nesting by its indentation: written through a writer that
    // stops at the text size limit, never built whole first.
    let mut pretty = Bounded { bytes: Vec::new(), limit: budget.limits.text_bytes };
    if serde_json::to_writer_pretty(&mut pretty, &value).is_err() {
        return Err(LimitHit::new(
            Limit::TextSize,
            format!("pretty-printed, it is longer than {}", crate::limits::bytes(budget.limits.text_bytes as u64)),
        )
        .into());
    }
    let mut out = Out::new(budget);
    out.push(&String::from_utf8_lossy(&pretty.bytes))?;
    Ok(out.finish())
}

/// A `Write` that refuses to grow past `limit` bytes.
struct Bounded {
    bytes: Vec<u8>,
    limit: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > self.limit {
            return Err(std::io::Error::other("text size limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn parse_json(bytes: &[u8], budget: &Budget, format: Format) -> Result<serde_json::Value, Refusal> {
    let decoded = decode(bytes, budget)?;
    serde_json::from_str(&decoded.text).map_err(|e| {
        if e.to_string().contains("recursion limit") {
            Refusal::Limit(LimitHit::new(Limit::Depth, "JSON nested deeper than 128 levels"))
        } else {
            Refusal::damaged(format, e)
        }
    })
}

/// A Jupyter notebook: its cells in order — Markdown as Markdown, code fenced in the kernel's
/// language with its text outputs after it.
pub(crate) fn notebook(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let nb = parse_json(bytes, budget, Format::Notebook)?;
    let cells = nb
        .get("cells")
        .and_then(|c| c.as_array())
        .ok_or_else(|| Refusal::damaged(Format::Notebook, "it has no \"cells\" list (nbformat 4)"))?;
    let language = nb
        .pointer("/metadata/language_info/name")
        .or_else(|| nb.pointer("/metadata/kernelspec/language"))
        .and_then(|l| l.as_str())
        .unwrap_or("");
    let mut out = Out::new(budget);
    for cell in cells {
        let source = joined(cell.get("source"));
        match cell.get("cell_type").and_then(|t| t.as_str()) {
            Some("markdown") => markdown_into(&mut out, &source)?,
            Some("code") => {
                if !source.trim().is_empty() {
                    out.verbatim(&format!("```{language}\n{}\n```", source.trim_end()))?;
                }
                for output in cell.get("outputs").and_then(|o| o.as_array()).into_iter().flatten() {
                    let text = match output.get("output_type").and_then(|t| t.as_str()) {
                        Some("stream") => joined(output.get("text")),
                        Some("execute_result" | "display_data") => joined(output.pointer("/data/text~1plain")),
                        Some("error") => {
                            let name = output.get("ename").and_then(|e| e.as_str()).unwrap_or("error");
                            let value = output.get("evalue").and_then(|e| e.as_str()).unwrap_or("");
                            format!("{name}: {value}")
                        }
                        _ => String::new(),
                    };
                    if !text.trim().is_empty() {
                        out.verbatim(&format!("```output\n{}\n```", text.trim_end()))?;
                    }
                }
            }
            _ => out.verbatim(&source)?,
        }
    }
    Ok(out.finish())
}

/// nbformat's multi-line strings: a string or a list of lines.
fn joined(value: Option<&serde_json::Value>) -> String {
    match value {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(lines)) => lines.iter().filter_map(|l| l.as_str()).collect(),
        _ => String::new(),
    }
}

/// Generic XML: the text of its elements, one block per element that holds text.
pub(crate) fn xml(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let decoded = decode(bytes, budget)?;
    let mut out = Out::new(budget);
    let mut current = String::new();
    walk_xml(&decoded.text, Format::Xml, budget, |event, _| {
        use quick_xml::events::Event;
        match event {
            Event::Start(_) | Event::End(_) => out.paragraph(&std::mem::take(&mut current))?,
            Event::Text(t) => current.push_str(&t.xml10_content()),
            Event::CData(c) => current.push_str(&c),
            Event::GeneralRef(r) => current.push_str(&xml_reference(&r)),
            _ => {}
        }
        Ok(())
    })?;
    out.paragraph(&current)?;
    Ok(out.finish())
}

/// Walks the events of `xml` (part of a `format` file): the clock checked, a DTD declaring
/// entities refused, nesting bounded; `on(event, depth)` sees every other event but the end,
/// with the depth of its element (a start and its end see the same).
pub(crate) fn walk_xml(
    xml: &str,
    format: Format,
    budget: &Budget,
    mut on: impl FnMut(quick_xml::events::Event, usize) -> Result<(), Refusal>,
) -> Result<(), Refusal> {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_str(xml);
    let mut depth = 0usize;
    loop {
        budget.tick()?;
        let event = reader.read_event().map_err(|e| xml_error(format, &reader, e))?;
        let at = match &event {
            Event::DocType(d) => {
                refuse_entities(d)?;
                continue;
            }
            Event::Eof => return Ok(()),
            Event::Start(_) => {
                depth += 1;
                budget.depth(depth)?;
                depth
            }
            Event::End(_) => {
                depth = depth.saturating_sub(1);
                depth + 1
            }
            _ => depth,
        };
        on(event, at)?;
    }
}

/// The value of the attribute whose local name is `local` (namespace prefixes ignored).
pub(crate) fn attr(e: &quick_xml::events::BytesStart, local: &str) -> Option<String> {
    e.attributes()
        .flatten()
        .find(|a| a.key.local_name().as_ref() == local)
        .and_then(|a| a.normalized_value(quick_xml::XmlVersion::Implicit1_0).ok().map(|v| v.into_owned()))
}

/// A DTD declaring entities is refused: expanding them is how "billion laughs" files explode,
/// and no document format Folio reads needs them.
pub(crate) fn refuse_entities(doctype: &quick_xml::events::BytesText) -> Result<(), LimitHit> {
    if doctype.xml10_content().contains("<!ENTITY") {
        return Err(LimitHit::new(
            Limit::EntityExpansion,
            "it declares XML entities in a DTD; Folio never expands them",
        ));
    }
    Ok(())
}

/// The text an entity reference stands for: XML's five predefined entities and character
/// references; anything else (declared in a DTD we refuse) is left out.
pub(crate) fn xml_reference(r: &quick_xml::events::BytesRef) -> String {
    if let Ok(Some(c)) = r.resolve_char_ref() {
        return c.to_string();
    }
    match &**r {
        "amp" => "&",
        "lt" => "<",
        "gt" => ">",
        "quot" => "\"",
        "apos" => "'",
        _ => "",
    }
    .to_owned()
}

/// A parse error of XML inside `format`, with where it happened.
pub(crate) fn xml_error(format: Format, reader: &quick_xml::Reader<&[u8]>, e: quick_xml::Error) -> Refusal {
    Refusal::damaged(format, format!("XML error at byte {}: {e}", reader.error_position()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Limits;

    fn decoded(bytes: &[u8]) -> Decoded {
        let limits = Limits::default();
        decode(bytes, &Budget::start(&limits)).unwrap()
    }

    #[test]
    fn encodings_are_detected_and_named() {
        let d = decoded(b"plain ascii\r\nline two");
        assert_eq!((d.text.as_str(), d.warnings.len()), ("plain ascii\r\nline two", 0));
        let utf16: Vec<u8> = "\u{FEFF}caf\u{e9} ok".encode_utf16().flat_map(u16::to_le_bytes).collect();
        assert_eq!(decoded(&utf16).text, "caf\u{e9} ok");
        let no_bom: Vec<u8> = "hello world, in utf-16".encode_utf16().flat_map(u16::to_be_bytes).collect();
        let d = decoded(&no_bom);
        assert_eq!(d.text, "hello world, in utf-16");
        assert!(d.warnings[0].contains("UTF-16BE"), "{:?}", d.warnings);
        let latin = b"Caf\xe9 cr\xe8me br\xfbl\xe9e, na\xefve fa\xe7ade";
        let d = decoded(latin);
        assert_eq!(d.text, "Café crème brûlée, naïve façade");
        assert!(d.warnings[0].contains("windows-1252"), "{:?}", d.warnings);
        let damaged = "naïve text with a bad byte \u{1}".replace('\u{1}', "");
        let mut bytes = damaged.into_bytes();
        bytes.extend_from_slice(b"\xff and more");
        let d = decoded(&bytes);
        assert!(
            d.text.contains('\u{FFFD}') && d.warnings[0].starts_with("1 invalid UTF-8 byte in 1 place"),
            "{:?}",
            d.warnings
        );
    }

    #[test]
    fn markdown_headings_start_parts_outside_code() {
        let limits = Limits::default();
        let budget = Budget::start(&limits);
        let md = "# Title\nintro\n```\n# not a heading\n```\n## Part two\nbody\n";
        let got = text(md.as_bytes(), Format::Markdown, &budget).unwrap();
        let labels: Vec<(&str, &str)> =
            got.parts.iter().map(|p| (p.label.as_str(), got.text[p.at..].lines().next().unwrap())).collect();
        assert_eq!(labels, [("Title", "# Title"), ("Part two", "## Part two")]);
        assert_eq!(got.text, md, "kept as written");
    }
}
