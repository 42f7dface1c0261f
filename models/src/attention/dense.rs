//! Dense attention: every visible key, exactly. The oracle every sparse method is measured
//! against (DESIGN.md §4).

use folio_kernels::attention::{attention_block, merge, Mask};

use super::{Attended, Attention, AttnCall};
use crate::error::{Error, Result};

#[derive(Debug, Default, Clone, Copy)]
pub struct Dense;

impl Attention for Dense {
    fn name(&self) -> &'static str {
        "dense"
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
