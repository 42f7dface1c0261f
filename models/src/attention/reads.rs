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

use std::collections::BTreeMap;
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use super::select::visible;
use super::{Attended, Attention, AttnCall, IndexSource, Knobs};
use crate::error::Result;
use crate::kv_cache::KvStore;

/// Most visible rows for which a call's attention mass is computed (a `[heads, rows]`
/// softmax beside the method's own attention).
pub const MASS_MAX_ROWS: usize = 1 << 17;

/// Positions per passage: the unit of "where in the document" a summary reports.
pub const PASSAGE_ROWS: usize = 32;

/// Passages kept per document in a summary, heaviest first.
pub const PASSAGES_KEPT: usize = 4;

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
        Self { method, spans, block_base, weigh: false, tally: Mutex::new(tally) }
    }

    /// The passage block of `pos` in span `span`.
    fn block(&self, span: usize, pos: usize) -> usize {
        self.block_base[span] + (pos - self.spans[span].0) / PASSAGE_ROWS
    }

    /// Also weighs what is read by its attention mass (see the module docs).
    pub fn with_mass(mut self) -> Self {
        self.weigh = true;
        self
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
        if let Some(Mass { per_span, other, in_spans }) = mass {
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
            }
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
                for (&(_, pos), m) in picked.iter().zip(weights) {
                    add(pos, m as f64);
                }
            }
        }
        Ok(Some(Mass { per_span, other, in_spans }))
    }

    /// What was read so far: the documents most weighed first (most read when no call was
    /// weighed); unread ones left out.
    pub fn summary(&self) -> ReadSummary {
        let guard = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        let t = &*guard;
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
                passages: self.passages(t, document),
            })
            .collect();
        documents.sort_by(|a, b| {
            match weighed {
                true => b.mass.total_cmp(&a.mass),
                false => b.rows.total_cmp(&a.rows),
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
        }
    }
}

/// A weighed call's mass: per span, outside them, and each in-span row's `(block, mass)`.
struct Mass {
    per_span: Vec<f64>,
    other: f64,
    in_spans: Vec<(usize, f64)>,
}

impl ReadTally<'_> {
    /// Span `document`'s heaviest passages: by mass where calls were weighed, else by picks.
    fn passages(&self, t: &Tally, document: usize) -> Vec<Passage> {
        let (start, end) = self.spans[document];
        let first = self.block_base[document];
        let of = |blocks: &[f64]| -> Vec<(usize, f64)> {
            let last = (first + (end - start).div_ceil(PASSAGE_ROWS)).min(blocks.len());
            (first..last).filter(|&b| blocks[b] > 0.0).map(|b| (b - first, blocks[b])).collect()
        };
        let mut blocks = of(&t.block_mass);
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
mod tests {
    use super::*;
    use crate::attention::{by_name, Resources};
    use crate::kv_cache::DenseKv;
    use candle_core::{DType, Device, Tensor};

    /// Dense counts every visible row by span; streaming's sinks and window land where they are.
    #[test]
    fn rows_land_in_their_spans() -> Result<()> {
        let dev = Device::Cpu;
        let (heads, d, t) = (2, 4, 40);
        let mut kv = DenseKv::new(1, 1, d, DType::F32, &dev);
        kv.write(0, 0, &Tensor::randn(0f32, 1.0, (1, t, d), &dev)?, &Tensor::randn(0f32, 1.0, (1, t, d), &dev)?)?;
        kv.set_len(t)?;
        let q = Tensor::randn(0f32, 1.0, (heads, 1, d), &dev)?;
        let call =
            AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: t - 1, kv: &kv, scale: 0.5, window: None };
        let spans = vec![(2, 10), (10, 30)];
        let dense = by_name("dense", None, &[], &Resources::default())?;
        let tally = ReadTally::new(dense.as_ref(), spans.clone());
        tally.attend(&call)?;
        let s = tally.summary();
        assert_eq!((s.total_rows, s.other_rows, s.steps), ((t * heads) as f64, (12 * heads) as f64, 1));
        assert_eq!(s.documents.iter().map(|r| (r.document, r.rows)).collect::<Vec<_>>(), [(1, 40.0), (0, 16.0)]);
        // 4 sinks (positions 0..4: 2 outside, 2 in span 0) and a window of 4 (36..40: outside).
        let streaming = by_name("streaming", Some("8"), &[], &Resources::default())?;
        let tally = ReadTally::new(streaming.as_ref(), spans);
        tally.attend(&call)?;
        let s = tally.summary();
        assert_eq!((s.total_rows, s.other_rows), ((8 * heads) as f64, (6 * heads) as f64));
        assert_eq!(s.documents.len(), 1);
        assert_eq!((s.documents[0].document, s.documents[0].share), (0, 0.25));
        Ok(())
    }

    /// The weighed tally against a host reference on random keys: for dense, each span gets
    /// the softmax weights of its rows summed over heads (all spans and the rest: one per
    /// head); for streaming, only the rows it read count, at their exact weights.
    #[test]
    fn mass_is_the_exact_attention_weight_of_the_rows_read() -> Result<()> {
        let dev = Device::Cpu;
        let (heads, kv_heads, d, t) = (4, 2, 8, 50);
        let mut kv = DenseKv::new(1, kv_heads, d, DType::F32, &dev);
        let k = Tensor::randn(0f32, 1.0, (kv_heads, t, d), &dev)?;
        kv.write(0, 0, &k, &Tensor::randn(0f32, 1.0, (kv_heads, t, d), &dev)?)?;
        kv.set_len(t)?;
        let q = Tensor::randn(0f32, 1.0, (heads, 1, d), &dev)?;
        let call =
            AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: t - 1, kv: &kv, scale: 0.35, window: None };
        // The reference: softmax over every visible key, per head, on the host.
        let (qv, kv_rows): (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) = (q.squeeze(1)?.to_vec2()?, k.to_vec3()?);
        let weights: Vec<Vec<f64>> = (0..heads)
            .map(|h| {
                let g = h / (heads / kv_heads);
                let z: Vec<f64> = (0..t)
                    .map(|p| 0.35 * qv[h].iter().zip(&kv_rows[g][p]).map(|(a, b)| (a * b) as f64).sum::<f64>())
                    .collect();
                let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                e.into_iter().map(|x| x / sum).collect()
            })
            .collect();
        let spans = vec![(2, 10), (10, 30)];
        let want = |rows: &dyn Fn(usize) -> bool| -> Vec<f64> {
            spans
                .iter()
                .map(|&(a, b)| {
                    (0..heads).map(|h| (a..b).filter(|&p| rows(p)).map(|p| weights[h][p]).sum::<f64>()).sum()
                })
                .collect()
        };
        let close = |got: &[SpanReads], want: &[f64]| {
            for r in got {
                assert!(
                    (r.mass - want[r.document]).abs() < 1e-5,
                    "span {}: {} vs {}",
                    r.document,
                    r.mass,
                    want[r.document]
                );
            }
        };
        let dense = by_name("dense", None, &[], &Resources::default())?;
        let tally = ReadTally::new(dense.as_ref(), spans.clone()).with_mass();
        tally.attend(&call)?;
        let s = tally.summary();
        assert_eq!((s.weighed_calls, s.calls), (1, 1));
        close(&s.documents, &want(&|_| true));
        let shares: f64 = s.documents.iter().map(|r| r.mass_share.unwrap()).sum();
        let outside: f64 = (0..heads).map(|h| (0..2).chain(30..t).map(|p| weights[h][p]).sum::<f64>()).sum();
        assert!((shares - (heads as f64 - outside) / heads as f64).abs() < 1e-5, "{shares}");
        // Streaming reads sinks 0..4 and the window 42..50: span 0 gets positions 2 and 3.
        let streaming = by_name("streaming", Some("12"), &[], &Resources::default())?;
        let tally = ReadTally::new(streaming.as_ref(), spans.clone()).with_mass();
        tally.attend(&call)?;
        let s = tally.summary();
        assert_eq!(s.documents.len(), 1);
        close(&s.documents, &want(&|p| !(4..42).contains(&p)));
        // Without with_mass nothing is weighed and rows order the documents.
        let tally = ReadTally::new(dense.as_ref(), spans);
        tally.attend(&call)?;
        let s = tally.summary();
        assert!(s.weighed_calls == 0 && s.documents.iter().all(|r| r.mass_share.is_none()));
        // A long answer is weighed by a sample of its steps.
        let weighed: Vec<usize> = (0..40).filter(|&s| weighs_step(s)).collect();
        assert_eq!(weighed, (0..16).chain([16, 24, 32]).collect::<Vec<_>>());
        Ok(())
    }

    /// Passages: with random keys and one key planted to match every query, the planted
    /// row's block leads its document's passages, each passage's share is its blocks' exact
    /// mass over the document's (host reference), and passages stay inside their span. A
    /// sparse method not weighed reports where it picked.
    #[test]
    fn passages_say_where_the_weight_went() -> Result<()> {
        let dev = Device::Cpu;
        let (heads, kv_heads, d, t) = (2, 1, 8, 200);
        let seed = match std::env::var("FOLIO_SEED") {
            Ok(s) => s.parse().expect("FOLIO_SEED is a u64"),
            Err(_) => rand::random(),
        };
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
        use rand::Rng;
        let planted = rng.random_range(70..150);
        let mut keys: Vec<f32> = (0..t * d).map(|_| rng.random_range(-0.3f32..0.3)).collect();
        let q: Vec<f32> = (0..heads * d).map(|i| if i % d == 0 { 4.0 } else { 0.0 }).collect();
        keys[planted * d] = 3.0;
        let k = Tensor::from_vec(keys.clone(), (kv_heads, t, d), &dev)?;
        let mut kv = DenseKv::new(1, kv_heads, d, DType::F32, &dev);
        kv.write(0, 0, &k, &Tensor::randn(0f32, 1.0, (kv_heads, t, d), &dev)?)?;
        kv.set_len(t)?;
        let q = Tensor::from_vec(q, (heads, 1, d), &dev)?;
        let call =
            AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: t - 1, kv: &kv, scale: 1.0, window: None };
        let spans = vec![(10, 60), (60, 190)];
        let dense = by_name("dense", None, &[], &Resources::default())?;
        let tally = ReadTally::new(dense.as_ref(), spans.clone()).with_mass();
        tally.attend(&call)?;
        let s = tally.summary();
        let doc = s.documents.iter().find(|r| r.document == 1).expect("span 1 read");
        let first = &doc.passages[0];
        assert!((first.start..first.end).contains(&planted), "seed {seed}: {:?} vs {planted}", doc.passages);
        assert_eq!(doc.passages.len(), PASSAGES_KEPT);
        // Host reference: softmax of q·k (every head has the same q), summed per block.
        let z: Vec<f64> = (0..t).map(|p| 4.0 * keys[p * d] as f64).collect();
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let in_doc: f64 = (60..190).map(|p| e[p] / sum).sum();
        for p in &doc.passages {
            assert!(p.start >= 60 && p.end <= 190 && p.start < p.end, "{p:?}");
            let want = (p.start..p.end).map(|x| e[x] / sum).sum::<f64>() / in_doc;
            assert!((p.share - want).abs() < 1e-5, "seed {seed}: {p:?} vs {want}");
        }
        let span0 = s.documents.iter().find(|r| r.document == 0).expect("span 0 read");
        assert!(span0.passages.iter().all(|p| p.start >= 10 && p.end <= 60));
        // Not weighed: dense says nothing of where; a picking method says where it picked.
        let tally = ReadTally::new(dense.as_ref(), spans.clone());
        tally.attend(&call)?;
        assert!(tally.summary().documents.iter().all(|r| r.passages.is_empty()));
        let topk = by_name("topk", Some("8"), &[], &Resources::default())?;
        let tally = ReadTally::new(topk.as_ref(), spans).with_mass();
        tally.attend(&call)?;
        let s = tally.summary();
        let doc = s.documents.iter().find(|r| r.document == 1).expect("span 1 read");
        assert!((doc.passages[0].start..doc.passages[0].end).contains(&planted), "seed {seed}: {:?}", doc.passages);
        Ok(())
    }
}
