//! StreamingLLM's baseline: the first `sinks` tokens (attention sinks) and the most recent
//! tokens, the rest never read. Budget = sinks + window. Same set for every head (the paper's
//! choice: no scoring at all), so GQA needs no decision.

use candle_core::Tensor;

use super::cost::{per_kv_head, CostInput, StepCost};
use super::fast;
use super::registry::{budgeted, Budgeted};
use super::select::{sparse_decode, visible, HeadPick};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Knobs, MethodSpec, Needs, ParamSpec, Params, Read, Tiers,
};
use crate::error::Result;

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
}

impl Budgeted for Streaming {
    fn new(budget: Budget, params: Params) -> Result<Self> {
        Ok(Self { budget, params })
    }
}

impl Streaming {
    /// The positions a query at `pos` reads, among the visible `lo..hi`.
    pub fn selection(&self, lo: usize, hi: usize) -> Vec<usize> {
        let n = self.budget.tokens(hi - lo);
        let sinks = self.params.usize("sinks").min(n);
        let recent = n - sinks;
        let head_end = (lo + sinks).min(hi);
        let tail_start = hi.saturating_sub(recent).max(head_end);
        (lo..head_end).chain(tail_start..hi).collect()
    }
}

impl Attention for Streaming {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let heads = call.q.dim(0)?;
        if let (Some(kv), 1) = (call.kv.tier(), call.q.dim(1)?) {
            let (lo, hi) = visible(call);
            let pick = self.selection(lo, hi);
            // One pick for every head: each KV head's rows are read once for its group.
            let idx = crate::profile::span(call.q.device(), "attention: pick", || {
                let pos: Vec<u32> = pick.iter().map(|&p| p as u32).collect();
                Ok(Tensor::from_vec(pos, (1, pick.len()), call.q.device())?.repeat((kv.kv_heads(), 1))?)
            })?;
            let out = fast::attend_selected(call, &*kv, &idx, None)?;
            return Ok(Attended { out, read: Read::Grouped { group: heads / kv.kv_heads(), idx }, searched: 0.0 });
        }
        sparse_decode(call, |_, lo, hi| Ok((vec![HeadPick::plain(self.selection(lo, hi)); heads], 0.0)))
    }
}
