//! StreamingLLM's baseline: the first `sinks` tokens (attention sinks) and the most recent
//! tokens, the rest never read. Budget = sinks + window. Same set for every head (the paper's
//! choice: no scoring at all), so GQA needs no decision.
//!
//! The fast path keeps each layer's sinks and window on the device (`Ring`): the window is a
//! ring whose oldest row the step's new one replaces, since attention does not depend on the
//! order it reads its rows in. A step then gathers one row per KV head instead of the whole
//! window over the link (at 1M tokens on an H100 the window's gather was 3.5 ms of an 11.8 ms
//! step).

use candle_core::Tensor;
use folio_kernels::{heads, sparse};

use super::cost::{per_kv_head, CostInput, StepCost};
use super::method::{budgeted, Budgeted};
use super::select::{sparse_decode, visible, HeadPick, PerLayer};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Knobs, MethodSpec, Needs, ParamSpec, Params, Read, Tiers,
};
use crate::error::Result;
use crate::kv_cache::DecodeTier;
use crate::profile::span;

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "streaming",
    summary: "attention sinks plus the most recent tokens; the rest is never read (a baseline)",
    paper: "Xiao et al., Efficient Streaming Language Models with Attention Sinks (ICLR 2024)",
    default_budget: Some(DefaultBudget {
        budget: "2048",
        source: "Folio's: the paper sets no budget for long inputs; 4 sinks + 2044 recent tokens, the budget of \
                 Folio's 1M-token benchmarks",
    }),
    params: &PARAMS,
    needs: Needs::NONE,
    tiers: Tiers::FAST,
    cost,
    build: budgeted::<Streaming>,
};

/// The same sinks and window for every head of a KV group.
fn cost(input: &CostInput<'_>) -> StepCost {
    per_kv_head(input, input.budget)
}

const PARAMS: [ParamSpec; 1] = [ParamSpec {
    name: "sinks",
    default: 4.0,
    min: 0.0,
    max: 1024.0,
    integer: true,
    doc: "first tokens always attended (the rest of the budget is the recent window)",
}];

pub struct Streaming {
    budget: Budget,
    params: Params,
    rings: PerLayer<Ring>,
}

impl Budgeted for Streaming {
    fn new(budget: Budget, params: Params) -> Result<Self> {
        Ok(Self { budget, params, rings: PerLayer::new() })
    }
}

/// What a query reads among the visible `lo..hi`: the sinks `lo..head_end` and the window
/// `tail_start..hi`, at most `recent` rows.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Frame {
    lo: usize,
    head_end: usize,
    recent: usize,
    tail_start: usize,
}

/// One layer's sinks and window on the device, per KV head: `k`, `v` `[kv_heads, sinks +
/// max(recent, 1), d]`, the sinks first, then position `p` of the window in slot `(p − head_end) mod
/// recent` after them, rows up to position `next` (exclusive) written. While the window fills,
/// its rows are the slots' first ones; once full, each new row replaces the one that left.
struct Ring {
    frame: Frame,
    k: Tensor,
    v: Tensor,
    next: usize,
}

impl Frame {
    /// The ring slot of window position `p`.
    fn slot(&self, p: usize) -> usize {
        self.head_end - self.lo + (p - self.head_end) % self.recent
    }

    /// Rows the kernel reads with positions up to `next` (exclusive) written: the sinks and the
    /// window's filled slots.
    fn rows(&self, next: usize) -> usize {
        self.head_end - self.lo + (next - self.tail_start.min(next)).min(self.recent)
    }
}

/// New rows a step adds to its ring one by one; more (a question before it) rebuild the ring.
const MAX_RING_STEP_ROWS: usize = 16;

impl Streaming {
    fn frame(&self, lo: usize, hi: usize) -> Frame {
        let n = self.budget.tokens(hi - lo);
        let sinks = self.params.usize("sinks").min(n);
        let recent = n - sinks;
        let head_end = (lo + sinks).min(hi);
        let tail_start = hi.saturating_sub(recent).max(head_end);
        Frame { lo, head_end, recent, tail_start }
    }

    /// The positions a query at `pos` reads, among the visible `lo..hi`.
    pub fn selection(&self, lo: usize, hi: usize) -> Vec<usize> {
        let f = self.frame(lo, hi);
        (lo..f.head_end).chain(f.tail_start..hi).collect()
    }

    /// The fast path: the layer's ring brought up to the step's own row (built when there is
    /// none, its frame changed — sinks moved by a model window, a budget share that changed
    /// with the length, no window at all — or the steps did not go forward from it by at most
    /// [`MAX_RING_STEP_ROWS`]), then the row kernel over it, each row read once for its group.
    /// A store cut back must be followed by [`Attention::reset`], as every caller does before
    /// a generation: the ring's rows are not checked against the store.
    fn attend_fast(&self, call: &AttnCall<'_>, kv: &dyn DecodeTier) -> Result<Attended> {
        let (lo, hi) = visible(call);
        let heads = call.q.dim(0)?;
        let dev = call.q.device();
        let kvh = kv.kv_heads();
        let frame = self.frame(lo, hi);
        let mut rings = self.rings.lock();
        let keep = rings.get(&call.layer).is_some_and(|r| {
            let same = (r.frame.lo, r.frame.head_end, r.frame.recent) == (lo, frame.head_end, frame.recent);
            same && frame.recent > 0 && r.next < hi && hi - r.next <= MAX_RING_STEP_ROWS
        });
        if keep {
            let ring = rings.get_mut(&call.layer).ok_or_else(|| crate::error::Error::Invalid("no ring".into()))?;
            for p in ring.next..hi {
                let slot = ring.frame.slot(p);
                span(dev, "attention: gather", || {
                    let (k, v) = kv.row(call.kv_layer, p)?;
                    heads::place_row(&ring.k, &k, 0, slot, 1)?;
                    Ok(heads::place_row(&ring.v, &v, 0, slot, 1)?)
                })?;
            }
            ring.next = hi;
            ring.frame.tail_start = frame.tail_start;
        } else {
            // Slot order: the sinks, then each window position at its slot.
            let sinks = frame.head_end - lo;
            let mut pos: Vec<u32> = (lo..frame.head_end).map(|p| p as u32).collect();
            pos.resize(sinks + frame.recent.max(1), (hi - 1) as u32);
            for p in frame.tail_start..hi {
                pos[frame.slot(p)] = p as u32;
            }
            let len = pos.len();
            let idx = Tensor::from_vec(pos, (1, len), dev)?.repeat((kvh, 1))?;
            let (k, v) = span(dev, "attention: gather", || kv.gather(call.kv_layer, &idx, hi))?;
            rings.insert(call.layer, Ring { frame, k, v, next: hi });
        }
        let ring = &rings[&call.layer];
        let (out, _lse) = span(dev, "attention: kernel", || {
            Ok(sparse::decode_attention_rows(
                &call.q.squeeze(1)?,
                &ring.k,
                &ring.v,
                ring.frame.rows(ring.next),
                None,
                call.scale,
            )?)
        })?;
        let read = Read::Spans { heads, spans: vec![(lo, frame.head_end), (frame.tail_start, hi)] };
        Ok(Attended { out: out.unsqueeze(1)?.to_dtype(call.q.dtype())?, read, searched: 0.0 })
    }
}

impl Attention for Streaming {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    fn reset(&self) {
        self.rings.clear();
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let heads = call.q.dim(0)?;
        if let (Some(kv), 1) = (call.kv.tier(), call.q.dim(1)?) {
            return self.attend_fast(call, &*kv);
        }
        sparse_decode(call, |_, lo, hi| Ok((vec![HeadPick::plain(self.selection(lo, hi)); heads], 0.0)))
    }
}
