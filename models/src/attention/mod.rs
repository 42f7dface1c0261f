//! The attention seam: the decoder hands each layer's queries to an [`Attention`] method,
//! which reads what it chooses from the [`KvStore`] and returns the layer's attention output.
//!
//! The decoder knows nothing about which rows a method reads; sparse methods and offloaded
//! tiers (later issues) plug in here without touching the model code (mistral.rs's pluggable
//! attention is the model).

mod dense;

pub use dense::Dense;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::kv::KvStore;

/// One layer's attention call.
pub struct AttnCall<'a> {
    /// The model layer.
    pub layer: usize,
    /// Where that layer's rows are in `kv`: the same index, except in layer-major prefill,
    /// whose store holds one layer at a time.
    pub kv_layer: usize,
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

/// Method names `by_name` accepts (sparse methods join them in their own issue).
pub const METHODS: [&str; 1] = ["dense"];

/// The attention method called `name`, with its user-facing budget if it takes one.
pub fn by_name(name: &str, budget: Option<&str>) -> Result<Box<dyn Attention>> {
    match (name, budget) {
        ("dense", None) => Ok(Box::new(Dense)),
        ("dense", Some(b)) => {
            Err(Error::Invalid(format!("dense attention reads every token; it takes no budget (got {b})")))
        }
        _ => Err(Error::Invalid(format!("unknown attention method \"{name}\"; available: {}", METHODS.join(", ")))),
    }
}
