//! What one decode step of a method moves, from its settings and a model's shape: the input of
//! `folio bench --shape`'s floor, the app's memory planner and the registry's listing.
//!
//! Each method states its own cost ([`super::MethodSpec::cost`]) in its module, next to the
//! code that does the moving; this module holds the shared vocabulary. Figures are bytes per
//! decode step (all layers), split by where they are read — device memory, the host link,
//! host memory by the CPU — because each has its own bandwidth and the paths can overlap: the
//! floor of a step is the largest of the three times, not their sum.

use super::Params;

/// The facts of a model's shape a step's cost depends on.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Shape {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Shape {
    pub fn of(cfg: &crate::config::ModelConfig) -> Self {
        Self { layers: cfg.num_layers, heads: cfg.num_heads, kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim }
    }
}

/// What a cost is computed for: a shape, a context length, the bytes of one K/V element as
/// moved (the compute dtype's), the budget in tokens at that length, and the method's knobs.
pub struct CostInput<'a> {
    pub shape: Shape,
    pub context: usize,
    pub elem: usize,
    pub budget: usize,
    pub params: &'a Params,
}

impl CostInput<'_> {
    /// Bytes of the K and V rows of `n` positions for each of `per` heads in one layer.
    pub fn rows(&self, n: usize, per: usize) -> f64 {
        (n * per * 2 * self.shape.head_dim * self.elem) as f64
    }

    /// Bytes of one layer's keys alone, every position (an exact scan).
    pub fn keys(&self, n: usize) -> f64 {
        (n * self.shape.kv_heads * self.shape.head_dim * self.elem) as f64
    }

    pub fn layers(&self) -> f64 {
        self.shape.layers as f64
    }
}

/// One decode step's traffic beyond the weights, and the device memory the method holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepCost {
    /// Read in device memory: an index (labels), layers kept resident.
    pub device_bytes: f64,
    /// Moved over the host link: picked rows; every row for dense; every key for a scan.
    pub link_bytes: f64,
    /// Read by the CPU in host memory (MagicPIG's sample).
    pub host_bytes: f64,
    /// Device memory the method keeps while decoding (labels, resident layers, gathers).
    pub resident_bytes: u64,
}

/// Streaming and BUZZ: one set of `picked` positions per KV head, read once for its group.
pub fn per_kv_head(input: &CostInput<'_>, picked: usize) -> StepCost {
    StepCost { link_bytes: input.layers() * input.rows(picked, input.shape.kv_heads), ..StepCost::default() }
}
