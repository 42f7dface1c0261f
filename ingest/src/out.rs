//! The text a reader writes: blocks (headings, paragraphs, list items, table rows) as
//! Markdown-like plain text, parts where headings, pages and chapters start, and the text size
//! limit applied as it grows (the document is cut there and the cut is a warning).

use crate::limits::{bytes, Budget, Limit, LimitHit};
use crate::{Extracted, Part};

/// Deepest list nesting indented (deeper items are indented as deep as this).
const MAX_INDENT: usize = 16;

/// Deepest heading that starts a part: deeper ones are kept as text but would make the
/// sources too fine-grained to read.
const PART_HEADING_LEVEL: usize = 3;

pub(crate) struct Out<'b, 'l> {
    budget: &'b Budget<'l>,
    text: String,
    parts: Vec<Part>,
    warnings: Vec<String>,
    /// Set once the text size limit cut the document: everything after is dropped.
    full: bool,
}

impl<'b, 'l> Out<'b, 'l> {
    pub fn new(budget: &'b Budget<'l>) -> Self {
        Self { budget, text: String::new(), parts: Vec::new(), warnings: Vec::new(), full: false }
    }

    /// A part starts here.
    pub fn part(&mut self, label: impl Into<String>) {
        let label = label.into();
        let label = label.trim();
        if label.is_empty() || self.full {
            return;
        }
        // Two parts at one offset (a chapter whose first line is its heading): the later,
        // more specific one names it.
        if self.parts.last().is_some_and(|p| p.at == self.text.len()) {
            self.parts.pop();
        }
        self.parts.push(Part { label: label.to_owned(), at: self.text.len() });
    }

    pub fn heading(&mut self, level: usize, text: &str) -> Result<(), LimitHit> {
        let text = collapse(text);
        if text.is_empty() {
            return Ok(());
        }
        if level <= PART_HEADING_LEVEL {
            self.part(&text);
        }
        let level = level.clamp(1, 6);
        self.block(&format!("{} {text}", "#".repeat(level)))
    }

    pub fn paragraph(&mut self, text: &str) -> Result<(), LimitHit> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(());
        }
        self.block(text)
    }

    /// A list item at `depth` (0 for the outer list); `marker` is "-" or "1.".
    pub fn item(&mut self, depth: usize, marker: &str, text: &str) -> Result<(), LimitHit> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(());
        }
        let line = format!("{}{marker} {text}\n", "  ".repeat(depth.min(MAX_INDENT)));
        self.push(&line)
    }

    /// A table row as `| a | b |`; a table ends with [`Out::end_table`].
    pub fn row(&mut self, cells: &[String]) -> Result<(), LimitHit> {
        if cells.iter().all(|c| c.trim().is_empty()) {
            return Ok(());
        }
        let cells: Vec<String> = cells.iter().map(|c| collapse(c).replace('|', "\\|")).collect();
        self.push(&format!("| {} |\n", cells.join(" | ")))
    }

    /// Ends a list or table: a blank line before the next block.
    pub fn end_block(&mut self) -> Result<(), LimitHit> {
        if !self.text.is_empty() && !self.text.ends_with("\n\n") {
            self.push("\n")?;
        }
        Ok(())
    }

    /// Text as it is (code, plain text), followed by a blank line.
    pub fn verbatim(&mut self, text: &str) -> Result<(), LimitHit> {
        self.block(text.trim_end_matches(['\n', '\r']))
    }

    fn block(&mut self, text: &str) -> Result<(), LimitHit> {
        if text.trim().is_empty() {
            return Ok(());
        }
        self.end_block()?;
        self.push(text)?;
        self.push("\n\n")
    }

    pub fn push(&mut self, s: &str) -> Result<(), LimitHit> {
        self.budget.tick()?;
        if self.full {
            return Ok(());
        }
        let room = self.budget.limits.text_bytes.saturating_sub(self.text.len());
        if s.len() > room {
            let mut cut = room;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            self.text.push_str(&s[..cut]);
            self.full = true;
            let hit = LimitHit::new(
                Limit::TextSize,
                format!("its text was cut at {}", bytes(self.budget.limits.text_bytes as u64)),
            );
            self.warnings.push(hit.to_string());
            return Ok(());
        }
        self.text.push_str(s);
        Ok(())
    }

    /// Most bytes of text this document may have.
    pub fn text_limit(&self) -> usize {
        self.budget.limits.text_bytes
    }

    pub fn warn(&mut self, warning: impl Into<String>) {
        self.warnings.push(warning.into());
    }

    pub fn finish(mut self) -> Extracted {
        let trimmed = self.text.trim_end().len();
        self.text.truncate(trimmed);
        if !self.text.is_empty() {
            self.text.push('\n');
        }
        let end = self.text.len();
        self.parts.retain(|p| p.at < end);
        Extracted { text: self.text, parts: self.parts, warnings: self.warnings }
    }
}

/// Runs of whitespace as one space, trimmed: how HTML and word processors' inline text reads.
pub(crate) fn collapse(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for word in s.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}
