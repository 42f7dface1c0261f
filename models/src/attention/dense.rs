//! Dense attention: every visible key, exactly. The oracle every sparse method is measured
//! against (DESIGN.md §4).

use candle_core::Tensor;
use folio_kernels::attention::{attention, Mask};

use super::{Attention, AttnCall};
use crate::error::Result;

#[derive(Debug, Default, Clone, Copy)]
pub struct Dense;

impl Attention for Dense {
    fn name(&self) -> &'static str {
        "dense"
    }

    fn forward(&self, call: &AttnCall<'_>) -> Result<Tensor> {
        let t = call.q.dim(1)?;
        let (k, v) = call.kv.read(call.layer, call.q_start + t)?;
        let mask = Mask { q_offset: call.q_start, window: call.window };
        let out = attention(call.q, &k, &v, mask, call.scale)?;
        Ok(out.out.to_dtype(call.q.dtype())?)
    }
}
