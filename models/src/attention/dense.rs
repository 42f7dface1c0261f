//! Dense attention: every visible key, exactly. The oracle every sparse method is measured
//! against (docs/architecture.md).

use folio_kernels::attention::{attention_block, merge, Mask};

use super::cost::{CostInput, StepCost};
use super::{Attended, Attention, AttnCall, Knobs, MethodSpec, Needs, Path};
use crate::error::{Error, Result};

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "dense",
    summary: "every visible key, exactly: the oracle the sparse methods are measured against",
    paper: "Vaswani et al., Attention Is All You Need (2017)",
    default_budget: None,
    params: &[],
    needs: Needs { calibration: false, index: None },
    resident: Path::Fast,
    offloaded: Path::Fast,
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

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        if let Some(kv) = call.kv.offloaded() {
            return Ok(Attended::dense(crate::offload::dense(call, kv)?));
        }
        let t = call.q.dim(1)?;
        let mask = Mask { q_offset: call.q_start, window: call.window };
        let mut acc = None;
        for seg in call.kv.segments(call.kv_layer, call.q_start + t)? {
            let part = attention_block(call.q, &seg.k, &seg.v, seg.start, mask, call.scale)?;
            acc = Some(match acc {
                None => part,
                Some(prev) => merge(&prev, &part)?,
            });
        }
        let out = acc.ok_or_else(|| Error::Invalid(format!("no keys stored for layer {}", call.layer)))?;
        Ok(Attended::dense(out.out.to_dtype(call.q.dtype())?))
    }
}
