//! StreamingLLM's baseline: the first `sinks` tokens (attention sinks) and the most recent
//! tokens, the rest never read. Budget = sinks + window. Same set for every head (the paper's
//! choice: no scoring at all), so GQA needs no decision.

use candle_core::Tensor;

use super::select::{budgeted_settings, sparse_decode, visible, HeadPick};
use super::{Attended, Attention, AttnCall, Budget, ParamSpec, Params};
use crate::error::Result;

pub(super) const PARAMS: [ParamSpec; 1] = [ParamSpec {
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

impl Streaming {
    pub fn new(budget: Budget, params: Params) -> Self {
        Self { budget, params }
    }

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
    fn name(&self) -> &'static str {
        "streaming"
    }

    fn settings(&self) -> serde_json::Value {
        budgeted_settings(self.name(), &self.budget, &self.params)
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let heads = call.q.dim(0)?;
        if let (Some(kv), 1) = (call.kv.offloaded(), call.q.dim(1)?) {
            let (lo, hi) = visible(call);
            let pick = self.selection(lo, hi);
            let pos: Vec<u32> = pick.iter().map(|&p| p as u32).collect();
            // One pick for every head: each KV head's rows are read once for its group.
            let idx = Tensor::from_vec(pos, (1, pick.len()), call.q.device())?.repeat((kv.kv_heads(), 1))?;
            let out = crate::offload::attend_selected(call, kv, &idx, None)?;
            return Ok(Attended { out, read: Some(vec![pick; heads]), searched: 0.0 });
        }
        sparse_decode(call, |_, lo, hi| Ok((vec![HeadPick::plain(self.selection(lo, hi)); heads], 0.0)))
    }
}
