//! The bounds every document is read under, each with the name the user reads when it is hit.
//!
//! Why limits and not "whatever fits": the input is whatever a user drags in, including files
//! made to hurt parsers (a 1 KB zip that unpacks to 1 GB, an XML "billion laughs", a 100 000
//! deep nesting, a 50 MB line). Each limit is far above any real document of its kind, so a
//! real document never meets one; when a file does, the reason names the limit and its value.

use std::time::{Duration, Instant};

/// Largest file read: a 1M-token context is about 4 MB of text; a 256 MiB PDF is still a
/// book with images.
pub const MAX_FILE_BYTES: u64 = 256 << 20;
/// Most bytes unpacked from one container (DOCX, ODT, EPUB), all entries together.
pub const MAX_UNZIPPED_BYTES: u64 = 256 << 20;
/// Most an entry may grow when unpacked, for entries past [`RATIO_FLOOR_BYTES`]: real XML
/// compresses 5–20×; zip bombs compress 1000×.
pub const MAX_RATIO: u64 = 100;
/// Entries smaller than this are not checked for ratio (tiny files of repeated bytes are real).
pub const RATIO_FLOOR_BYTES: u64 = 1 << 20;
/// Deepest element or value nesting followed (XML, HTML, JSON).
pub const MAX_DEPTH: usize = 512;
/// Longest run of spaces one ODT `<text:s text:c="N"/>` element stands for: a real document's
/// runs are a few spaces; a crafted count (10^12) must not become a terabyte of them.
pub const MAX_SPACE_RUN: usize = 1 << 16;
/// Most pages read from one PDF.
pub const MAX_PAGES: usize = 20_000;
/// Most extracted text kept from one document (about 16M tokens: 16 contexts of 1M).
pub const MAX_TEXT_BYTES: usize = 64 << 20;
/// Longest a document may take to read.
pub const TIME_PER_DOCUMENT: Duration = Duration::from_secs(60);

/// Which bound was met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    FileSize,
    UnzippedSize,
    Ratio,
    EntityExpansion,
    Depth,
    Pages,
    TextSize,
    Time,
}

impl Limit {
    /// The limit's name as the user reads it.
    pub fn name(self) -> &'static str {
        match self {
            Limit::FileSize => "file size limit",
            Limit::UnzippedSize => "unzipped size limit",
            Limit::Ratio => "compression ratio limit",
            Limit::EntityExpansion => "XML entity expansion limit",
            Limit::Depth => "nesting depth limit",
            Limit::Pages => "page limit",
            Limit::TextSize => "text size limit",
            Limit::Time => "time limit per document",
        }
    }
}

/// A limit met, with what was found.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{detail} ({})", .limit.name())]
pub struct LimitHit {
    pub limit: Limit,
    pub detail: String,
}

impl LimitHit {
    pub fn new(limit: Limit, detail: impl Into<String>) -> Self {
        Self { limit, detail: detail.into() }
    }
}

/// The bounds of one read; [`Limits::default`] are the named constants above.
#[derive(Debug, Clone)]
pub struct Limits {
    pub file_bytes: u64,
    pub unzipped_bytes: u64,
    pub ratio: u64,
    pub depth: usize,
    pub pages: usize,
    pub text_bytes: usize,
    pub time: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            file_bytes: MAX_FILE_BYTES,
            unzipped_bytes: MAX_UNZIPPED_BYTES,
            ratio: MAX_RATIO,
            depth: MAX_DEPTH,
            pages: MAX_PAGES,
            text_bytes: MAX_TEXT_BYTES,
            time: TIME_PER_DOCUMENT,
        }
    }
}

/// One document's limits with its clock started: readers call [`Budget::tick`] in their loops
/// so that our own code stops at the time limit (a third-party parser that hangs is left behind
/// by the worker thread instead).
pub(crate) struct Budget<'a> {
    pub limits: &'a Limits,
    deadline: Instant,
}

impl<'a> Budget<'a> {
    pub fn start(limits: &'a Limits) -> Self {
        Self { limits, deadline: Instant::now() + limits.time }
    }

    pub fn tick(&self) -> Result<(), LimitHit> {
        if Instant::now() > self.deadline {
            return Err(time_hit(self.limits.time));
        }
        Ok(())
    }

    pub fn depth(&self, depth: usize) -> Result<(), LimitHit> {
        if depth > self.limits.depth {
            return Err(LimitHit::new(Limit::Depth, format!("nested deeper than {} levels", self.limits.depth)));
        }
        Ok(())
    }
}

pub(crate) fn time_hit(limit: Duration) -> LimitHit {
    LimitHit::new(Limit::Time, format!("still reading it after {} s", limit.as_secs()))
}

/// Bytes as a person reads them (binary units, one decimal).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} bytes");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}
