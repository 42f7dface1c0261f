//! Exact top-k attention (the paper is named in [`SPEC`]): at each decode step, every query head
//! reads the `k` keys with the largest q·k among the context, plus the most recent `window`
//! tokens (the question and the answer so far, which the paper keeps on the GPU and attends
//! densely), and softmax runs over exactly those.
//!
//! GQA: one selection per *query* head against its KV head's keys (`h / G`, as HF's
//! `repeat_kv`), as the authors' code does: heads of a group attend to different tokens, and a
//! shared selection would spend the budget on the group's average. Scores are the raw dot
//! products (the scale does not change the order). This is the obviously-right reference: a
//! full scan of every key; the approximate index and the GPU path are held to it.

use super::cost::{CostInput, StepCost};
use super::fast;
use super::method::{budgeted, Budgeted};
use super::select::{dot, query_rows, sparse_decode, top_positions, visible, HeadPick};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Knobs, MethodSpec, Needs, ParamSpec, Params, Read, Tiers,
};
use crate::error::Result;

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "topk",
    summary: "the exact top-k keys by q·k for each query head, plus the recent window",
    paper: "Hoover, Synk et al., Exploiting Sparsity for Long Context Inference: Million Token Contexts on \
            Commodity GPUs (arXiv 2502.06766)",
    default_budget: Some(DefaultBudget {
        budget: "1%",
        source: "the paper: k ≈ 1% of the context reaches ≥ 95% of full attention's task performance (§4)",
    }),
    params: &PARAMS,
    needs: Needs::NONE,
    tiers: Tiers::FAST,
    cost,
    build: budgeted::<TopK>,
};

/// The exact scan reads every key over the link; the picks bring their K and V per query head.
fn cost(input: &CostInput<'_>) -> StepCost {
    let picked = input.budget + input.params.usize("window");
    let per_layer = input.keys(input.context, input.shape.kv_heads) + input.rows(picked, input.shape.heads);
    StepCost { link_bytes: input.layers() * per_layer, ..StepCost::default() }
}

/// The recent window of the top-k family (exact and IVF).
pub(super) const WINDOW: ParamSpec = ParamSpec {
    name: "window",
    default: 64.0,
    min: 0.0,
    max: 1_048_576.0,
    integer: true,
    doc: "most recent tokens always attended, outside the top-k budget",
};

const PARAMS: [ParamSpec; 1] = [WINDOW];

pub struct TopK {
    budget: Budget,
    params: Params,
}

impl Budgeted for TopK {
    fn new(budget: Budget, params: Params) -> Result<Self> {
        Ok(Self { budget, params })
    }
}

impl TopK {
    /// The sorted positions of the `k` largest `scores` (index = position - `lo`) plus the
    /// window `hi - window..hi`. Ties keep the earlier position.
    pub fn selection(&self, scores: &[f32], lo: usize, hi: usize) -> Vec<usize> {
        let window = self.params.usize("window").min(hi - lo);
        let cut = hi - window;
        let mut out = top_positions((lo..cut).collect(), self.budget.tokens(hi - lo), |p| scores[p - lo]);
        out.extend(cut..hi);
        out
    }
}

impl Attention for TopK {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        if let (Some(kv), 1) = (call.kv.tier(), call.q.dim(1)?) {
            // The fast path: the exact scan reads every key of the context in chunks, the top-k
            // kernel picks, the gather brings only the picked rows' values.
            let (lo, hi) = visible(call);
            let cut = hi - self.params.usize("window").min(hi - lo);
            let q = call.q.squeeze(1)?;
            let scores = match cut > lo {
                true => Some(kv.scores(call.kv_layer, &q, cut)?.narrow(1, lo, cut - lo)?),
                false => None,
            };
            let heads = q.dim(0)?;
            let idx =
                fast::top_and_window(scores.as_ref(), self.budget.tokens(hi - lo), heads, lo, (cut, hi), q.device())?;
            let out = fast::attend_selected(call, &*kv, &idx, None)?;
            return Ok(Attended { out, read: Read::Picked(idx), searched: (cut - lo) as f64 });
        }
        sparse_decode(call, |rows, lo, hi| {
            let queries = query_rows(call)?;
            let groups = queries.len() / rows.kv_heads;
            let picks = queries
                .iter()
                .enumerate()
                .map(|(h, q)| {
                    let scores: Vec<f32> = (lo..hi).map(|p| dot(&q[0], rows.key(h / groups, p))).collect();
                    HeadPick::plain(self.selection(&scores, lo, hi))
                })
                .collect();
            // The exact scan scores every visible key outside the window.
            let window = self.params.usize("window").min(hi - lo);
            Ok((picks, (hi - lo - window) as f64))
        })
    }
}
