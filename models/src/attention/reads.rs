//! What the attention read while answering, per document: the raw material of the app's
//! sources panel. [`ReadTally`] wraps the method that answers and, on every decode step of
//! every layer, adds each query head's read rows to the document span that holds them.
//!
//! Dense attention reads every visible row: its rows are counted as the overlap of each span
//! with the visible range, without walking positions. A fast path's picks are copied from the
//! device only here, when an answer's reads are tallied. Rows after the documents (the chat head before them, the
//! question, the answer so far) are counted apart, so the documents' shares say how much of
//! the reading went to them.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::select::visible;
use super::{Attended, Attention, AttnCall, IndexSource, Knobs};
use crate::error::Result;
use crate::kv::KvStore;

/// Rows read in one document span.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpanReads {
    /// The span's index in the context's document table.
    pub document: usize,
    /// K/V rows read in the span, summed over decode steps, layers and query heads.
    pub rows: f64,
    /// `rows` over every row read (documents and the rest).
    pub share: f64,
}

/// Rows read per document span over an answer.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReadSummary {
    /// The spans read, most read first.
    pub documents: Vec<SpanReads>,
    /// Rows outside every span: the chat head, the question, the answer so far.
    pub other_rows: f64,
    pub total_rows: f64,
    /// Decode steps counted (one per generated token after the first).
    pub steps: usize,
}

/// Tallies what `method` reads in the spans `[start, end)` (sorted, disjoint).
pub struct ReadTally<'a> {
    method: &'a dyn Attention,
    spans: Vec<(usize, usize)>,
    tally: Mutex<(Vec<f64>, f64, usize)>,
}

impl<'a> ReadTally<'a> {
    pub fn new(method: &'a dyn Attention, spans: Vec<(usize, usize)>) -> Self {
        let n = spans.len();
        Self { method, spans, tally: Mutex::new((vec![0.0; n], 0.0, 0)) }
    }

    fn add(&self, call: &AttnCall<'_>, got: &Attended) -> Result<()> {
        let (lo, hi) = visible(call);
        let heads = call.q.dim(0)?;
        let mut guard = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        let (per_span, other, steps) = &mut *guard;
        if call.layer == 0 {
            *steps += 1;
        }
        match got.read.rows()? {
            None => {
                let mut inside = 0;
                for (i, &(start, end)) in self.spans.iter().enumerate() {
                    let n = end.min(hi).saturating_sub(start.max(lo));
                    per_span[i] += (n * heads) as f64;
                    inside += n;
                }
                *other += ((hi - lo - inside) * heads) as f64;
            }
            Some(sets) => {
                // Each head's positions are sorted: a span's count is two binary searches.
                for set in sets.iter() {
                    let mut inside = 0;
                    for (i, &(start, end)) in self.spans.iter().enumerate() {
                        let n = set.partition_point(|&p| p < end) - set.partition_point(|&p| p < start);
                        per_span[i] += n as f64;
                        inside += n;
                    }
                    *other += (set.len() - inside) as f64;
                }
            }
        }
        Ok(())
    }

    /// What was read so far, most-read documents first (unread ones left out).
    pub fn summary(&self) -> ReadSummary {
        let guard = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        let (per_span, other, steps) = &*guard;
        let total = per_span.iter().sum::<f64>() + other;
        let mut documents: Vec<SpanReads> = per_span
            .iter()
            .enumerate()
            .filter(|(_, &rows)| rows > 0.0)
            .map(|(document, &rows)| SpanReads { document, rows, share: rows / total })
            .collect();
        documents.sort_by(|a, b| b.rows.total_cmp(&a.rows).then(a.document.cmp(&b.document)));
        ReadSummary { documents, other_rows: *other, total_rows: total, steps: *steps }
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
    use crate::kv::DenseKv;
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
}
