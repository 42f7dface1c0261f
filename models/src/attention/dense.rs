//! Dense attention: every visible key, exactly. The oracle every sparse method is measured
//! against (docs/architecture.md).

use super::cost::{CostInput, StepCost};
use super::{Attended, Attention, AttnCall, Knobs, MethodSpec, Needs, Tiers};
use crate::error::Result;
use crate::kv_cache::dense_over_segments;

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "dense",
    summary: "every visible key, exactly: the oracle the sparse methods are measured against",
    paper: "Vaswani et al., Attention Is All You Need (2017)",
    default_budget: None,
    params: &[],
    needs: Needs { calibration: false, index: None },
    tiers: Tiers::FAST,
    cost,
    build: |_, _, _| Ok(Box::new(Dense)),
};

/// Every row of every layer over the link, each step.
fn cost(input: &CostInput<'_>) -> StepCost {
    StepCost { link_bytes: input.layers() * input.rows(input.context, input.shape.kv_heads), ..StepCost::default() }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Dense;

impl Dense {
    /// Dense attention's knobs (none): for wrappers that attend densely under its name.
    pub const KNOBS: Knobs<'static> = Knobs { spec: &SPEC, budget: None, params: None };
}

impl Attention for Dense {
    fn knobs(&self) -> Knobs<'_> {
        Self::KNOBS
    }

    /// On a tier, its exact attention (the offloaded one reads the saved rows in chunks over
    /// the link); without one, the attention kernel over the store's segments, merged by LSE.
    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let out = match call.kv.tier() {
            Some(tier) => tier.dense(&call.exact())?,
            None => dense_over_segments(call.kv, &call.exact())?,
        };
        Ok(Attended::dense(out))
    }
}
