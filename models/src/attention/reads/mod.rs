//! What the attention read while answering, per document: the raw material of the app's
//! sources panel. [`ReadTally`] wraps the method that answers and, on every decode step of
//! every layer, adds each query head's read rows to the document span that holds them.
//!
//! Dense attention reads every visible row: its rows are counted as the overlap of each span
//! with the visible range, without walking positions. A fast path's picks are copied from the
//! device only here, when an answer's reads are tallied. Rows after the documents (the chat head before them, the
//! question, the answer so far) are counted apart, so the documents' shares say how much of
//! the reading went to them.
//!
//! Rows alone do not say what mattered: dense reads every row, so its row shares follow the
//! documents' lengths. With [`ReadTally::with_mass`] each decode call also adds the attention
//! mass of the rows it read — softmax(q·K·scale) over the visible rows, the exact weights,
//! summed over query heads — to their spans, so a document's mass share says where the
//! attention went. It costs a pass over the visible keys per call, so it is computed for the
//! first [`MASS_FULL_STEPS`] steps of an answer and one in [`MASS_STEP_STRIDE`] after, and only
//! when the keys live on the query's device (the resident tier: on the offloaded tier the saved
//! keys are host memory, and a pass over them is what that tier exists to avoid) and the
//! visible rows are at most [`MASS_MAX_ROWS`]; other calls count rows only, and the summary
//! says how many calls were weighed.
//!
//! Where in a document: a weighing tally also adds each row's mass to its passage (a block of
//! [`PASSAGE_ROWS`] positions counted from its document's start), and each document's summary keeps its [`PASSAGES_KEPT`] heaviest
//! passages — what the window shows when a source is clicked. A call that is not weighed but
//! picks rows (a sparse method on the offloaded tier, or past `MASS_MAX_ROWS`) counts its picks
//! per passage instead; dense attention's unweighed reads cover every row alike and say nothing
//! of where, so they add no passage. Blocks, not single rows: a row is a token, and a reader
//! wants the sentence around it; a fixed grid keeps the tally one add per row read.
//!
//! Which passage the answer came from: most of a step's mass goes to rows that are not
//! sources — attention sinks (a document's first tokens on a long context), the recent rows,
//! and whatever the layers that do not copy look at — so raw mass marked a title and
//! unrelated lists above the fact (issue #44; at 100k tokens the context's first passage came
//! first in 5 of 27 answers). With [`ReadTally::with_copies`] each weighed call also keeps its
//! [`COPY_ROWS`] heaviest document rows past the first [`SINK_ROWS`], and when the answer is
//! known ([`ReadTally::summary_of`]) a step's rows count for the passages only where the
//! document says what the step read and wrote: the row holds the step's output token after its
//! input token, or the input token before the output (the two ways a copying head points, at
//! the copied token or at the one before it). A pair, not the output token alone: an answer
//! writes "the", "of" and "." too, which every passage holds. And a pair the documents hold
//! many times (". the") is weak evidence of where: a row's weight is shared among the pair's
//! places, so a pair held once (the fact's "falcon is", its digits) speaks for its passage
//! alone. Mass elsewhere is left out of where; it still counts in the documents' shares.
//! Passages fall back to raw mass when nothing the answer wrote was found in a document (an
//! answer in the model's own words). Measured with `folio eval sources` (docs/quality.md).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use super::select::visible;
use super::{Attended, Attention, AttnCall, IndexSource, Knobs};
use crate::error::Result;
use crate::kv_cache::KvStore;

/// Most visible rows for which a call's attention mass is computed (a `[heads, rows]`
/// softmax beside the method's own attention): 2M, past the longest context a model here
/// reads (the demo model's 1,179,648), so that dense answers at 1M tokens have sources too.
/// Its cost grows with the rows (docs/engine.md: measured at 30k and 115k).
pub const MASS_MAX_ROWS: usize = 1 << 21;

/// Most bytes a call's weighing may take on the device: the layer's keys in f32 and the
/// `[heads, rows]` scores. 1 GiB holds the demo model's 1M tokens (288 MiB); a 7B model's
/// 1M-token layer (2.2 GiB) is not weighed, and counts rows only.
pub const MASS_MAX_BYTES: usize = 1 << 30;

/// Positions per passage: the unit of "where in the document" a summary reports.
pub const PASSAGE_ROWS: usize = 32;

/// Passages kept per document in a summary, heaviest first.
pub const PASSAGES_KEPT: usize = 4;

/// Document rows kept per weighed call for the copy weighing: its heaviest, summed over query
/// heads. A copying head's row is among a call's first few; the rest of the list is room for
/// sinks and the layers that look elsewhere.
pub const COPY_ROWS: usize = 256;

/// The context's first rows, left out of the copy weighing: attention sinks, which most heads
/// weigh whatever they look for (StreamingLLM keeps 4; on a long context the first document's
/// first words, after the chat head, weigh as sinks too). Later documents' first rows count.
pub const SINK_ROWS: usize = 16;

/// How a session weighs its answers' sources (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Weighing {
    /// Rows counted, nothing weighed: the cheapest, and what a CLI answer without sources needs.
    #[default]
    Off,
    /// Passages by the attention mass of every row read ([`ReadTally::with_mass`]).
    Mass,
    /// Mass, and passages where the answer copied from ([`ReadTally::with_copies`]): what the
    /// window shows.
    Copied,
}

/// A stretch of a document the attention read, `start..end` in context positions.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Passage {
    pub start: usize,
    pub end: usize,
    /// Of the document's weight: its mass when calls were weighed, else its picked rows.
    pub share: f64,
    /// The page, chapter or section it is in ("p. 12"), when the document has parts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "ts", ts(optional))]
    pub part: Option<String>,
}

/// Rows read in one document span.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpanReads {
    /// The span's index in the context's document table.
    pub document: usize,
    /// K/V rows read in the span, summed over decode steps, layers and query heads.
    pub rows: f64,
    /// `rows` over every row read (documents and the rest).
    pub share: f64,
    /// The attention mass of the rows read in the span, summed over the weighed calls and
    /// their query heads.
    pub mass: f64,
    /// `mass` over the mass of every row read; `None` when no call was weighed.
    pub mass_share: Option<f64>,
    /// Where in the span the weight went, heaviest first (a weighing tally only; empty when
    /// nothing says where, as for dense reads not weighed).
    pub passages: Vec<Passage>,
}

/// Rows read per document span over an answer.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReadSummary {
    /// The spans read, most weighed (else most read) first.
    pub documents: Vec<SpanReads>,
    /// Rows outside every span: the chat head, the question, the answer so far.
    pub other_rows: f64,
    pub total_rows: f64,
    /// Decode steps counted (one per generated token after the first, and one per question
    /// token when the question is read one token at a time).
    pub steps: usize,
    /// Decode calls (steps × layers) whose attention mass was weighed, of `calls`.
    pub weighed_calls: usize,
    pub calls: usize,
    /// The rows the decode calls could see, summed over calls and query heads: `total_rows`
    /// over it is the fraction of the cache read.
    pub visible_rows: f64,
    /// The passages are where the answer copied from (else by mass or picks: see the module
    /// docs).
    pub copied: bool,
}

#[derive(Default)]
struct Tally {
    rows: Vec<f64>,
    other_rows: f64,
    mass: Vec<f64>,
    other_mass: f64,
    steps: usize,
    calls: usize,
    weighed_calls: usize,
    visible_rows: f64,
    /// Per passage block (position / PASSAGE_ROWS): attention mass, and picked rows.
    block_mass: Vec<f64>,
    block_rows: Vec<f64>,
    /// Per step (a tally that keeps copies): its calls' heaviest document rows, `(position,
    /// weight)`, resolved against the answer by [`ReadTally::summary_of`] — by attention mass
    /// where calls were weighed, else by the heads that picked them (a weak signal in other
    /// units: used only when no call was weighed, as on the offloaded tier).
    step_rows: Vec<Vec<(u32, f32)>>,
    step_picks: Vec<Vec<(u32, f32)>>,
}

impl Tally {
    fn add_block(blocks: &mut Vec<f64>, b: usize, x: f64) {
        if b >= blocks.len() {
            blocks.resize(b + 1, 0.0);
        }
        blocks[b] += x;
    }
}

/// Tallies what `method` reads in the spans `[start, end)` (sorted, disjoint).
pub struct ReadTally<'a> {
    method: &'a dyn Attention,
    spans: Vec<(usize, usize)>,
    /// Each span's first passage block: a span's passages start at its first position, so a
    /// passage never mixes two documents.
    block_base: Vec<usize>,
    weigh: bool,
    /// The context's tokens, when the copy weighing is on.
    copies: Option<&'a [u32]>,
    tally: Mutex<Tally>,
}

/// Decode steps weighed in full at the start of an answer; after them, one in
/// [`MASS_STEP_STRIDE`]. Weighing a call costs a pass over the visible keys and a softmax
/// beside the method's attention: weighing every call took the demo model's dense decode on an
/// H100 from 359 to 76 tokens/s at 30k tokens and 123 to 46 at 115k, HiP's from 115 to 91 and
/// 100 to 42 (`tools/sources-bench.sh`, docs/results/sources-bench-h100-2026-11-25.log). A short
/// answer is weighed whole; a long one by a sample of its steps, which a share over many steps
/// barely notices.
pub const MASS_FULL_STEPS: usize = 16;
pub const MASS_STEP_STRIDE: usize = 8;

/// Whether decode step `step` (0-based; its layer-0 call not yet counted) is weighed.
fn weighs_step(step: usize) -> bool {
    step < MASS_FULL_STEPS || step.is_multiple_of(MASS_STEP_STRIDE)
}

/// Where each of `positions` (sorted) falls: the span's index, or `None` outside them all.
fn span_of(spans: &[(usize, usize)], p: usize) -> Option<usize> {
    let i = spans.partition_point(|&(_, end)| end <= p);
    spans.get(i).filter(|&&(start, _)| start <= p).map(|_| i)
}

impl<'a> ReadTally<'a> {
    pub fn new(method: &'a dyn Attention, spans: Vec<(usize, usize)>) -> Self {
        let n = spans.len();
        let tally = Tally { rows: vec![0.0; n], mass: vec![0.0; n], ..Tally::default() };
        let block_base = spans
            .iter()
            .scan(0, |next, &(start, end)| {
                let base = *next;
                *next += (end - start).div_ceil(PASSAGE_ROWS);
                Some(base)
            })
            .collect();
        Self { method, spans, block_base, weigh: false, copies: None, tally: Mutex::new(tally) }
    }

    /// The passage block of `pos` in span `span`.
    fn block(&self, span: usize, pos: usize) -> usize {
        self.block_base[span] + (pos - self.spans[span].0) / PASSAGE_ROWS
    }

    /// Span `span`'s passage blocks, `first..last`, within a tally of `len` blocks (a tally
    /// grows its blocks as rows land in them, so it may end before the span does).
    fn blocks_of(&self, span: usize, len: usize) -> std::ops::Range<usize> {
        let (start, end) = self.spans[span];
        let first = self.block_base[span];
        first.min(len)..(first + (end - start).div_ceil(PASSAGE_ROWS)).min(len)
    }

    /// Also weighs what is read by its attention mass (see the module docs).
    pub fn with_mass(mut self) -> Self {
        self.weigh = true;
        self
    }

    /// Also finds which passages the answer copied from, `tokens` being the context's (see
    /// the module docs); passages then follow [`ReadTally::summary_of`]'s answer.
    pub fn with_copies(mut self, tokens: &'a [u32]) -> Self {
        self.copies = Some(tokens);
        self
    }

    /// The `COPY_ROWS` heaviest of `rows` that lie in a document and are not sinks.
    fn heaviest(&self, mut rows: Vec<(u32, f32)>) -> Vec<(u32, f32)> {
        rows.retain(|&(p, w)| w > 0.0 && p as usize >= SINK_ROWS && span_of(&self.spans, p as usize).is_some());
        if rows.len() > COPY_ROWS {
            // Ties (rows picked by as many heads) go to the earlier row, the same on every run.
            rows.select_nth_unstable_by(COPY_ROWS, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            rows.truncate(COPY_ROWS);
        }
        rows
    }

    fn add(&self, call: &AttnCall<'_>, got: &Attended) -> Result<()> {
        let (lo, hi) = visible(call);
        let heads = call.q.dim(0)?;
        let read = got.read.rows()?;
        // The step this call belongs to (layer 0 counts it, below).
        let step =
            self.tally.lock().unwrap_or_else(|e| e.into_inner()).steps.saturating_sub(usize::from(call.layer > 0));
        let mass = match self.weigh && weighs_step(step) {
            true => self.mass(call, read.as_deref())?,
            false => None,
        };
        let mut guard = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        let t = &mut *guard;
        if call.layer == 0 {
            t.steps += 1;
        }
        t.calls += 1;
        t.visible_rows += ((hi - lo) * heads) as f64;
        let weighed = mass.is_some();
        let mut heavy = Vec::new();
        if let Some(Mass { per_span, other, in_spans, top }) = mass {
            heavy = top;
            t.weighed_calls += 1;
            t.mass.iter_mut().zip(per_span).for_each(|(m, x)| *m += x);
            t.other_mass += other;
            for (b, m) in in_spans {
                Tally::add_block(&mut t.block_mass, b, m);
            }
        }
        match read {
            None => {
                let mut inside = 0;
                for (i, &(start, end)) in self.spans.iter().enumerate() {
                    let n = end.min(hi).saturating_sub(start.max(lo));
                    t.rows[i] += (n * heads) as f64;
                    inside += n;
                }
                t.other_rows += ((hi - lo - inside) * heads) as f64;
            }
            Some(sets) => {
                // Each head's positions are sorted: a span's count is two binary searches.
                for set in sets.iter() {
                    let mut inside = 0;
                    for (i, &(start, end)) in self.spans.iter().enumerate() {
                        let n = set.partition_point(|&p| p < end) - set.partition_point(|&p| p < start);
                        t.rows[i] += n as f64;
                        inside += n;
                    }
                    t.other_rows += (set.len() - inside) as f64;
                    if self.weigh && !weighed {
                        for &p in set.iter() {
                            if let Some(i) = span_of(&self.spans, p) {
                                Tally::add_block(&mut t.block_rows, self.block(i, p), 1.0);
                            }
                        }
                    }
                }
                if self.copies.is_some() && !weighed {
                    // Not weighed: a row's weight is the number of heads that picked it.
                    heavy = self.heaviest(per_row(sets.iter().flat_map(|set| set.iter().map(|&p| (p, 1.0)))));
                }
            }
        }
        if self.copies.is_some() && !heavy.is_empty() {
            let by_step = if weighed { &mut t.step_rows } else { &mut t.step_picks };
            if by_step.len() <= step {
                by_step.resize(step + 1, Vec::new());
            }
            by_step[step].extend(heavy);
        }
        Ok(())
    }

    /// The attention mass of the rows this call read, per span and outside them, summed over
    /// query heads; `None` when it is not weighed (see the module docs).
    fn mass(&self, call: &AttnCall<'_>, read: Option<&[Vec<usize>]>) -> Result<Option<Mass>> {
        let (lo, hi) = visible(call);
        let n = hi - lo;
        if n == 0 || n > MASS_MAX_ROWS {
            return Ok(None);
        }
        let q = call.q.squeeze(1)?.to_dtype(DType::F32)?;
        let (heads, d) = q.dims2()?;
        let segments = call.kv.segments(call.kv_layer, hi)?;
        let kv_heads = match segments.first() {
            Some(seg) => seg.k.dim(0)?,
            None => 0,
        };
        if hi * (kv_heads * d + heads) * std::mem::size_of::<f32>() > MASS_MAX_BYTES {
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(segments.len());
        let mut at = 0;
        for seg in &segments {
            if seg.start != at || !seg.k.device().same_device(q.device()) {
                return Ok(None);
            }
            let k = seg.k.to_dtype(DType::F32)?;
            let (kv_heads, len, _) = k.dims3()?;
            let scores = q.reshape((kv_heads, heads / kv_heads, d))?.matmul(&k.transpose(1, 2)?.contiguous()?)?;
            parts.push(scores.reshape((heads, len))?);
            at += len;
        }
        if at < hi {
            return Ok(None);
        }
        let scores = Tensor::cat(&parts, 1)?.narrow(1, lo, n)?.affine(call.scale as f64, 0.0)?;
        let p = candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?;
        let (mut per_span, mut other, mut in_spans) = (vec![0.0; self.spans.len()], 0.0, Vec::new());
        let keep_top = self.copies.is_some();
        let mut top = Vec::new();
        let mut add = |pos: usize, m: f64| match span_of(&self.spans, pos) {
            Some(i) => {
                per_span[i] += m;
                in_spans.push((self.block(i, pos), m));
            }
            None => other += m,
        };
        match read {
            None => {
                // A column of weights per position (summed over heads) comes back; on the GPU a
                // device-side sum per span was slower (candle's index_add walks the positions
                // in one thread; its cumsum is a matmul with an n×n triangle).
                let column: Vec<f32> = p.sum(0)?.to_device(&candle_core::Device::Cpu)?.to_vec1()?;
                if keep_top {
                    top = self.heaviest(column.iter().enumerate().map(|(i, &m)| ((lo + i) as u32, m)).collect());
                }
                for (i, m) in column.into_iter().enumerate() {
                    add(lo + i, m as f64);
                }
            }
            Some(sets) => {
                // The read rows' weights only, gathered where they are.
                let picked: Vec<(usize, usize)> = sets
                    .iter()
                    .enumerate()
                    .flat_map(|(h, set)| set.iter().filter(|&&pos| (lo..hi).contains(&pos)).map(move |&pos| (h, pos)))
                    .collect();
                let flat: Vec<u32> = picked.iter().map(|&(h, pos)| (h * n + pos - lo) as u32).collect();
                let index = Tensor::from_vec(flat, picked.len(), p.device())?;
                let weights: Vec<f32> =
                    p.flatten_all()?.index_select(&index, 0)?.to_device(&candle_core::Device::Cpu)?.to_vec1()?;
                if keep_top {
                    top = self.heaviest(per_row(picked.iter().zip(&weights).map(|(&(_, pos), &m)| (pos, m))));
                }
                for (&(_, pos), m) in picked.iter().zip(weights) {
                    add(pos, m as f64);
                }
            }
        }
        Ok(Some(Mass { per_span, other, in_spans, top }))
    }

    /// What was read so far: the documents most weighed first (most read when no call was
    /// weighed); unread ones left out.
    pub fn summary(&self) -> ReadSummary {
        self.summary_of(&[])
    }

    /// [`ReadTally::summary`] once the answer's tokens are known: with copies kept, each
    /// document's passages are where the answer copied from (see the module docs).
    pub fn summary_of(&self, answer: &[u32]) -> ReadSummary {
        let guard = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        let t = &*guard;
        let copied = self.copied_blocks(t, answer);
        let total = t.rows.iter().sum::<f64>() + t.other_rows;
        let total_mass = t.mass.iter().sum::<f64>() + t.other_mass;
        let weighed = t.weighed_calls > 0 && total_mass > 0.0;
        let mut documents: Vec<SpanReads> = t
            .rows
            .iter()
            .zip(&t.mass)
            .enumerate()
            .filter(|(_, (&rows, _))| rows > 0.0)
            .map(|(document, (&rows, &mass))| SpanReads {
                document,
                rows,
                share: rows / total,
                mass,
                mass_share: weighed.then(|| mass / total_mass),
                passages: self.passages(t, &copied, document),
            })
            .collect();
        // Where the answer copied from comes first: the panel's first line is its first
        // source's first passage. Else the most weighed (most read) document.
        let copied_in: Vec<f64> =
            (0..self.spans.len()).map(|d| copied[self.blocks_of(d, copied.len())].iter().sum()).collect();
        let by_copies = documents.iter().any(|r| copied_in[r.document] > 0.0);
        documents.sort_by(|a, b| {
            match (by_copies, weighed) {
                (true, _) => copied_in[b.document].total_cmp(&copied_in[a.document]),
                (false, true) => b.mass.total_cmp(&a.mass),
                (false, false) => b.rows.total_cmp(&a.rows),
            }
            .then(a.document.cmp(&b.document))
        });
        ReadSummary {
            documents,
            other_rows: t.other_rows,
            total_rows: total,
            steps: t.steps,
            weighed_calls: t.weighed_calls,
            calls: t.calls,
            visible_rows: t.visible_rows,
            copied: by_copies,
        }
    }
}

/// A weighed call's mass: per span, outside them, each in-span row's `(block, mass)`, and
/// (when copies are kept) its heaviest document rows.
struct Mass {
    per_span: Vec<f64>,
    other: f64,
    in_spans: Vec<(usize, f64)>,
    top: Vec<(u32, f32)>,
}

/// Weights summed per position (a row read by several heads is one row).
fn per_row(rows: impl Iterator<Item = (usize, f32)>) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = rows.map(|(p, w)| (p as u32, w)).collect();
    all.sort_unstable_by_key(|r| r.0);
    all.dedup_by(|next, kept| {
        let same = next.0 == kept.0;
        if same {
            kept.1 += next.1;
        }
        same
    });
    all
}

impl ReadTally<'_> {
    /// Per passage block, the weight of the rows each step read that hold what the step wrote.
    /// The answer's token `k` is the output of the step `answer.len() - k` from the end: the
    /// last token is never run, and the steps before the answer's (a question read one token
    /// at a time) wrote prompt tokens, which are not the answer.
    fn copied_blocks(&self, t: &Tally, answer: &[u32]) -> Vec<f64> {
        let mut blocks = Vec::new();
        let Some(tokens) = self.copies else { return blocks };
        let by_step = if t.step_rows.iter().any(|r| !r.is_empty()) { &t.step_rows } else { &t.step_picks };
        // Each step's (read, wrote) pair: the step's input is the answer's previous token
        // (unknown for its first, which is left out).
        let step_pair = |i: usize| {
            let k = (i + answer.len()).checked_sub(t.steps)?;
            Some((answer[k.checked_sub(1)?], answer[k]))
        };
        // How often the documents hold each pair: a row holding a pair the documents hold a
        // hundred times (". the") says little of where the answer came from; one they hold
        // once says it all. A row's weight is shared among the pair's places.
        let mut held: HashMap<(u32, u32), f64> = (0..by_step.len()).filter_map(step_pair).map(|p| (p, 0.0)).collect();
        for &(start, end) in &self.spans {
            for w in tokens[start.min(tokens.len())..end.min(tokens.len())].windows(2) {
                if let Some(n) = held.get_mut(&(w[0], w[1])) {
                    *n += 1.0;
                }
            }
        }
        for (i, rows) in by_step.iter().enumerate() {
            let Some((read, wrote)) = step_pair(i) else { continue };
            let places = held.get(&(read, wrote)).copied().unwrap_or(0.0).max(1.0);
            for &(p, w) in rows {
                let p = p as usize;
                let at = |q: Option<usize>| q.and_then(|q| tokens.get(q)).copied();
                let holds = (at(Some(p)) == Some(wrote) && at(p.checked_sub(1)) == Some(read))
                    || (at(Some(p)) == Some(read) && at(Some(p + 1)) == Some(wrote));
                if let Some(span) = span_of(&self.spans, p).filter(|_| holds) {
                    Tally::add_block(&mut blocks, self.block(span, p), w as f64 / places);
                }
            }
        }
        blocks
    }

    /// Span `document`'s heaviest passages: where the answer copied from when it did, else by
    /// mass where calls were weighed, else by picks.
    fn passages(&self, t: &Tally, copied: &[f64], document: usize) -> Vec<Passage> {
        let (start, end) = self.spans[document];
        let first = self.block_base[document];
        let of = |blocks: &[f64]| -> Vec<(usize, f64)> {
            self.blocks_of(document, blocks.len())
                .filter(|&b| blocks[b] > 0.0)
                .map(|b| (b - first, blocks[b]))
                .collect()
        };
        let mut blocks = of(copied);
        if blocks.is_empty() {
            blocks = of(&t.block_mass);
        }
        if blocks.is_empty() {
            blocks = of(&t.block_rows);
        }
        let total: f64 = blocks.iter().map(|b| b.1).sum();
        blocks.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        blocks
            .into_iter()
            .take(PASSAGES_KEPT)
            .map(|(b, w)| Passage {
                start: start + b * PASSAGE_ROWS,
                end: (start + (b + 1) * PASSAGE_ROWS).min(end),
                share: w / total,
                part: None,
            })
            .collect()
    }
}

impl Attention for ReadTally<'_> {
    fn knobs(&self) -> Knobs<'_> {
        self.method.knobs()
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let got = self.method.attend(call)?;
        if call.q.dim(1)? == 1 {
            self.add(call, &got)?;
        }
        Ok(got)
    }

    fn reset(&self) {
        self.method.reset();
    }

    fn end_conversation(&self) {
        self.method.end_conversation();
    }

    fn index_section(&self, kv: &dyn KvStore, layer: usize, layers: usize) -> Result<Option<(String, Vec<u8>)>> {
        self.method.index_section(kv, layer, layers)
    }

    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        self.method.index_sources()
    }
}

#[cfg(test)]
mod tests;
