//! Word processor files: DOCX (Office Open XML) and ODT (OpenDocument Text), read from their
//! main XML part with `quick-xml` events.
//!
//! Why not a DOCX or ODF crate: the ones on crates.io either write documents (docx-rs reads
//! little), or read the whole container without limits; the text of both formats is a small,
//! well specified subset (paragraphs with a style, runs of text, list and table elements), and
//! walking its events keeps every limit in our hands. Headings come from the paragraph's style
//! (DOCX: the style's outline level or its "heading N" name in styles.xml, so localized style
//! ids work; ODT: `text:h`'s outline level).

use std::collections::HashMap;

use quick_xml::events::Event;

use crate::limits::{bytes, Budget, Limit, LimitHit, MAX_SPACE_RUN};
use crate::out::{collapse, Out};
use crate::plain::{attr, walk_xml, xml_reference};
use crate::zipped::Container;
use crate::{Extracted, Format, Refusal};

/// Deepest list level Word writes (`w:ilvl` 0–8); a larger value is damage, read as 8.
const MAX_LIST_LEVEL: usize = 8;

/// What the paragraph being read is.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Body,
    Heading(usize),
    Item(usize),
}

/// Paragraphs, list items and tables as they close, written to `out`.
struct Blocks<'o, 'b, 'l> {
    out: &'o mut Out<'b, 'l>,
    kind: Kind,
    para: String,
    /// Cells of the row being read, and the cell's text, while inside a table.
    row: Vec<String>,
    cell: Option<String>,
    tables: usize,
    in_list: bool,
}

impl<'o, 'b, 'l> Blocks<'o, 'b, 'l> {
    fn new(out: &'o mut Out<'b, 'l>) -> Self {
        Self { out, kind: Kind::Body, para: String::new(), row: Vec::new(), cell: None, tables: 0, in_list: false }
    }

    /// Inline text of the paragraph being read, bounded by the text size limit (one paragraph
    /// of a million `text:s` spaces must not grow past it before it is written).
    fn text(&mut self, s: &str) -> Result<(), LimitHit> {
        let limit = self.out.text_limit();
        if self.para.len() + s.len() > limit {
            return Err(LimitHit::new(Limit::TextSize, format!("a paragraph longer than {}", bytes(limit as u64))));
        }
        self.para.push_str(s);
        Ok(())
    }

    fn end_paragraph(&mut self) -> Result<(), LimitHit> {
        let text = std::mem::take(&mut self.para);
        let kind = std::mem::replace(&mut self.kind, Kind::Body);
        if let Some(cell) = &mut self.cell {
            if !cell.is_empty() {
                cell.push(' ');
            }
            cell.push_str(text.trim());
            return Ok(());
        }
        if self.in_list && !matches!(kind, Kind::Item(_)) && !text.trim().is_empty() {
            self.out.end_block()?;
            self.in_list = false;
        }
        match kind {
            Kind::Heading(level) => self.out.heading(level, &text),
            Kind::Item(depth) => {
                self.in_list = true;
                self.out.item(depth, "-", &collapse(&text))
            }
            Kind::Body => self.out.paragraph(&text),
        }
    }

    fn start_table(&mut self) -> Result<(), LimitHit> {
        if self.tables == 0 {
            self.out.end_block()?;
        }
        self.tables += 1;
        Ok(())
    }

    fn start_cell(&mut self) {
        if self.tables == 1 {
            self.cell = Some(String::new());
        }
    }

    fn end_cell(&mut self) {
        if self.tables == 1 {
            if let Some(cell) = self.cell.take() {
                self.row.push(cell);
            }
        }
    }

    fn end_row(&mut self) -> Result<(), LimitHit> {
        if self.tables == 1 {
            let row = std::mem::take(&mut self.row);
            return self.out.row(&row);
        }
        Ok(())
    }

    fn end_table(&mut self) -> Result<(), LimitHit> {
        self.tables = self.tables.saturating_sub(1);
        if self.tables == 0 {
            self.out.end_block()?;
        }
        Ok(())
    }
}

/// DOCX: word/document.xml's body in order.
pub(crate) fn docx(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let mut zip = Container::open(bytes, Format::Docx, budget)?;
    let headings = match zip.text("word/styles.xml")? {
        Some(styles) => heading_styles(&styles, budget)?,
        None => HashMap::new(),
    };
    let xml = zip.required("word/document.xml")?;
    let mut out = Out::new(budget);
    let mut blocks = Blocks::new(&mut out);
    let (mut in_text, mut skip_from) = (false, None::<usize>);
    let mut list_level: Option<usize> = None;
    walk_xml(&xml, Format::Docx, budget, |event, depth| {
        match event {
            Event::Start(e) => {
                if skip_from.is_some() {
                    return Ok(());
                }
                match e.local_name().as_ref() {
                    // Alternate renderings of the same content, deleted text, field codes.
                    "Fallback" | "instrText" | "del" | "delText" => skip_from = Some(depth),
                    "p" => list_level = None,
                    "t" => in_text = true,
                    "numPr" => list_level = Some(0),
                    "tbl" => blocks.start_table()?,
                    "tc" => blocks.start_cell(),
                    _ => {}
                }
            }
            Event::Empty(e) if skip_from.is_none() => match e.local_name().as_ref() {
                "pStyle" => {
                    if let Some(level) = attr(&e, "val").and_then(|id| headings.get(&id).copied()) {
                        blocks.kind = Kind::Heading(level);
                    }
                }
                "ilvl" => {
                    list_level =
                        attr(&e, "val").and_then(|v| v.parse::<usize>().ok()).map(|l| l.min(MAX_LIST_LEVEL)).or(Some(0))
                }
                "tab" => blocks.text("\t")?,
                "br" | "cr" => blocks.text("\n")?,
                _ => {}
            },
            Event::End(e) => {
                if skip_from == Some(depth) {
                    skip_from = None;
                } else if skip_from.is_none() {
                    match e.local_name().as_ref() {
                        "t" => in_text = false,
                        "p" => {
                            if let (Some(level), Kind::Body) = (list_level, blocks.kind) {
                                blocks.kind = Kind::Item(level);
                            }
                            blocks.end_paragraph()?;
                        }
                        "tc" => blocks.end_cell(),
                        "tr" => blocks.end_row()?,
                        "tbl" => blocks.end_table()?,
                        _ => {}
                    }
                }
            }
            Event::Text(t) if in_text && skip_from.is_none() => blocks.text(&t.xml10_content())?,
            Event::GeneralRef(r) if in_text && skip_from.is_none() => blocks.text(&xml_reference(&r))?,
            _ => {}
        }
        Ok(())
    })?;
    Ok(out.finish())
}

/// Style ids of DOCX heading styles and their levels: from `w:outlineLvl` (0 is level 1) or
/// the style's name ("heading 2", "Title").
fn heading_styles(xml: &str, budget: &Budget) -> Result<HashMap<String, usize>, Refusal> {
    let mut levels = HashMap::new();
    let mut id: Option<String> = None;
    walk_xml(xml, Format::Docx, budget, |event, _| {
        match event {
            Event::Start(e) if e.local_name().as_ref() == "style" => id = attr(&e, "styleId"),
            Event::End(e) if e.local_name().as_ref() == "style" => id = None,
            Event::Empty(e) => {
                let Some(id) = &id else { return Ok(()) };
                let level = match e.local_name().as_ref() {
                    "outlineLvl" => attr(&e, "val").and_then(|v| v.parse::<usize>().ok()).map(|l| l + 1),
                    "name" => attr(&e, "val").and_then(|name| {
                        let name = name.to_lowercase();
                        if name == "title" {
                            Some(1)
                        } else {
                            name.strip_prefix("heading ").and_then(|n| n.parse().ok())
                        }
                    }),
                    _ => None,
                };
                // Outline level 9 and beyond is "body text" in Word.
                if let Some(level @ 1..=9) = level {
                    levels.insert(id.clone(), level);
                }
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok(levels)
}

/// ODT: content.xml's `office:text` in order.
pub(crate) fn odt(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let mut zip = Container::open(bytes, Format::Odt, budget)?;
    let xml = zip.required("content.xml")?;
    let mut out = Out::new(budget);
    let mut blocks = Blocks::new(&mut out);
    let (mut lists, mut skip_from, mut in_body) = (0usize, None::<usize>, false);
    // Paragraph elements open (a text:p inside a text:h's frame, a note's body).
    let mut open = 0usize;
    walk_xml(&xml, Format::Odt, budget, |event, depth| {
        match event {
            Event::Start(e) => {
                if skip_from.is_some() {
                    return Ok(());
                }
                match e.local_name().as_ref() {
                    "text" if e.name().as_ref() == "office:text" => in_body = true,
                    "annotation" | "tracked-changes" | "note-citation" => skip_from = Some(depth),
                    "h" => {
                        open += 1;
                        let level = attr(&e, "outline-level").and_then(|l| l.parse().ok()).unwrap_or(1);
                        blocks.kind = Kind::Heading(level);
                    }
                    "p" => {
                        open += 1;
                        if lists > 0 && blocks.kind == Kind::Body {
                            blocks.kind = Kind::Item(lists - 1);
                        }
                    }
                    "list" => lists += 1,
                    "table" => blocks.start_table()?,
                    "table-cell" => blocks.start_cell(),
                    _ => {}
                }
            }
            Event::Empty(e) if skip_from.is_none() && open > 0 => match e.local_name().as_ref() {
                "s" => {
                    let n = attr(&e, "c").and_then(|c| c.parse::<usize>().ok()).unwrap_or(1);
                    blocks.text(&" ".repeat(n.min(MAX_SPACE_RUN)))?;
                }
                "tab" => blocks.text("\t")?,
                "line-break" => blocks.text("\n")?,
                _ => {}
            },
            Event::End(e) => {
                if skip_from == Some(depth) {
                    skip_from = None;
                } else if skip_from.is_none() {
                    match e.local_name().as_ref() {
                        "h" | "p" => {
                            open = open.saturating_sub(1);
                            if open == 0 {
                                blocks.end_paragraph()?;
                            }
                        }
                        "list" => lists = lists.saturating_sub(1),
                        "table-cell" => blocks.end_cell(),
                        "table-row" => blocks.end_row()?,
                        "table" => blocks.end_table()?,
                        _ => {}
                    }
                }
            }
            Event::Text(t) if open > 0 && in_body && skip_from.is_none() => blocks.text(&t.xml10_content())?,
            Event::GeneralRef(r) if open > 0 && in_body && skip_from.is_none() => blocks.text(&xml_reference(&r))?,
            _ => {}
        }
        Ok(())
    })?;
    Ok(out.finish())
}
