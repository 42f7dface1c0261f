//! What a source looks like when it is clicked: the document's text at the passages the
//! attention read ([`crate::attention::Passage`]), with some text either side, from the
//! context file's own tokens.
//!
//! Why from the tokens and not the document on disk: the tokens are what the model read, they
//! are in the file (a moved, changed or deleted source still shows), and a position maps to
//! them exactly; mapping token positions back into a PDF's or an HTML file's bytes would need
//! the extraction's offsets. The text of a stretch is decoded from the tokens before it too
//! (a prefix decode), so a boundary inside a multi-byte character or a merged space does not
//! garble the pieces: each piece is what a prefix decode adds to the one before, after cutting
//! back to where the two agree (a character split by a boundary shows whole, in the later
//! piece).

use serde::Serialize;

use crate::attention::Passage;
use crate::context::ContextFile;
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// Tokens of text shown either side of a passage.
pub const AROUND: usize = 96;

/// Tokens shown from a document's start when no passage says where it was read.
pub const OPENING: usize = 2 * AROUND;

/// A run of text: read by the attention (with the passage's share) or around what was.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Piece {
    pub text: String,
    /// The share of the document's weight of the passage this text is (of the passages, when
    /// several touch), when it is one.
    pub read: Option<f64>,
}

/// A stretch of the document: `start..end` in tokens from its first token.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Excerpt {
    pub start: usize,
    pub end: usize,
    /// The page, chapter or section it starts in ("p. 12"), when the document has parts.
    pub part: Option<String>,
    pub pieces: Vec<Piece>,
}

/// A document's excerpts, in document order.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct DocumentExcerpts {
    pub document: usize,
    pub title: String,
    pub path: String,
    /// The document's tokens in the context.
    pub tokens: usize,
    pub excerpts: Vec<Excerpt>,
}

/// The text of `document` of `file` around `passages` (context positions, as an answer's
/// sources give them), `around` tokens either side; the document's opening when there are none.
/// Refused when a passage lies outside the document (a passage of another context).
pub fn excerpts(
    tokenizer: &Tokenizer,
    file: &ContextFile,
    document: usize,
    passages: &[Passage],
    around: usize,
) -> Result<DocumentExcerpts> {
    let span = file.documents().get(document).ok_or_else(|| {
        Error::Invalid(format!("the context has {} documents; there is no document {document}", file.documents().len()))
    })?;
    let (ds, de) = (span.start, span.end);
    if let Some(p) = passages.iter().find(|p| p.start < ds || p.end > de || p.start >= p.end) {
        return Err(Error::Invalid(format!(
            "passage {}..{} is not inside \"{}\" (tokens {ds}..{de}): the answer was made over another version of \
             the context",
            p.start, p.end, span.title
        )));
    }
    let mut read: Vec<&Passage> = passages.iter().collect();
    read.sort_by_key(|p| p.start);
    // Windows around the passages, merged where they touch.
    let mut windows: Vec<(usize, usize)> = Vec::new();
    for p in &read {
        let (s, e) = (p.start.saturating_sub(around).max(ds), (p.end + around).min(de));
        match windows.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => windows.push((s, e)),
        }
    }
    if windows.is_empty() {
        windows.push((ds, (ds + OPENING).min(de)));
    }
    let tokens = file.tokens();
    let mut out = Vec::with_capacity(windows.len());
    for (ws, we) in windows {
        // The window's stretches: read ones (overlaps cut off) and those between them.
        let (mut stretches, mut cursor): (Vec<(usize, usize, Option<f64>)>, usize) = (Vec::new(), ws);
        for p in read.iter().filter(|p| p.end > ws && p.start < we) {
            let (s, e) = (p.start.max(cursor), p.end.min(we));
            if s >= e {
                continue;
            }
            if s > cursor {
                stretches.push((cursor, s, None));
            }
            stretches.push((s, e, Some(p.share)));
            cursor = e;
        }
        if cursor < we {
            stretches.push((cursor, we, None));
        }
        let mut pieces: Vec<Piece> = Vec::new();
        let mut before = String::new();
        for (_, b, share) in stretches {
            let upto = tokenizer.decode(&tokens[ws..b], true)?;
            // A boundary inside a character leaves a U+FFFD that the longer decode completes:
            // the text shown so far is cut back to where the two decodes agree.
            let agree = before
                .char_indices()
                .zip(upto.chars())
                .find(|((_, x), y)| x != y)
                .map_or(before.len().min(upto.len()), |((i, _), _)| i);
            let mut cut = before.len() - agree;
            while cut > 0 {
                let Some(last) = pieces.last_mut() else { break };
                let n = cut.min(last.text.len());
                last.text.truncate(last.text.len() - n);
                cut -= n;
                if last.text.is_empty() {
                    pieces.pop();
                }
            }
            let text = upto[agree..].to_owned();
            before = upto;
            // Passages that touch read as one (a sentence cut by the passage grid), their
            // shares summed.
            match (pieces.last_mut(), share) {
                (Some(last), None) if last.read.is_none() => last.text.push_str(&text),
                (Some(Piece { text: t, read: Some(r) }), Some(share)) => {
                    t.push_str(&text);
                    *r += share;
                }
                _ => pieces.push(Piece { text, read: share }),
            }
        }
        out.push(Excerpt { start: ws - ds, end: we - ds, part: span.part_at(ws).map(str::to_owned), pieces });
    }
    Ok(DocumentExcerpts {
        document,
        title: span.title.clone(),
        path: span.path.clone(),
        tokens: de - ds,
        excerpts: out,
    })
}
