//! The attention seam: the decoder hands each layer's queries to an [`Attention`] method,
//! which reads what it chooses from the [`KvStore`] and returns the layer's attention output.
//!
//! The decoder knows nothing about which rows a method reads; sparse methods and offloaded
//! tiers (later issues) plug in here without touching the model code (mistral.rs's pluggable
//! attention is the model).

mod dense;

pub use dense::Dense;

use candle_core::Tensor;

use crate::error::Result;
use crate::kv::KvStore;

/// One layer's attention call.
pub struct AttnCall<'a> {
    pub layer: usize,
    /// Post-RoPE queries `[q_heads, t, head_dim]` for positions `q_start..q_start + t`.
    pub q: &'a Tensor,
    pub q_start: usize,
    /// The store holds this layer's rows for positions `0..q_start + t`.
    pub kv: &'a dyn KvStore,
    pub scale: f32,
    /// Sliding window (Mistral), counted with the query's own token.
    pub window: Option<usize>,
}

/// An attention method.
pub trait Attention: Send + Sync {
    fn name(&self) -> &'static str;

    /// Output `[q_heads, t, head_dim]` in the dtype of `call.q`.
    fn forward(&self, call: &AttnCall<'_>) -> Result<Tensor>;
}
