//! Double Sparsity (research/seeds/003-double-sparsity.md): token sparsity chosen through
//! channel sparsity. A few calibrated "outlier" channels of q·k ([`Channels`], from
//! `folio calibrate`) rank tokens almost as well as the full product; their key values form a
//! compact label cache (4-bit, asymmetric min–max per token and head, §3.2), scanned each step
//! to pick the top-k tokens, over which attention runs exactly (Algorithm 1).
//!
//! GQA: one channel set and label row per *KV* head (policy B: label memory stays at the
//! paper's 1/16 of K), top-k per *query* head with its own query restricted to those
//! channels, as SGLang does. No sinks, no forced window, no dense layers: the paper has none
//! (`window` is offered, 0 by default). Labels of the stored context are the index; those of
//! the question and answer tokens are made as they arrive (the paper appends each new token's
//! label before scoring, so the current token is a candidate, not forced in).
//! `bits=16` keeps labels unquantized: with every channel that is exactly top-k.

pub use crate::calibrate::Channels;

use std::sync::Arc;

use super::select::{budgeted_settings, query_rows, sparse_decode, top_positions, HeadPick, LayerRows, PerLayer};
use super::{Attended, Attention, AttnCall, Budget, ParamSpec, Params};
use crate::error::{Error, Result};

pub(super) const PARAMS: [ParamSpec; 3] = [
    ParamSpec {
        name: "channels",
        default: 0.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "r, outlier channels per KV head (0: head_dim/4, the paper's 1/16 label cache at 4 bits)",
    },
    ParamSpec { name: "bits", default: 4.0, min: 1.0, max: 16.0, integer: true, doc: "label bits (16: unquantized)" },
    ParamSpec {
        name: "window",
        default: 0.0,
        min: 0.0,
        max: 1_048_576.0,
        integer: true,
        doc: "most recent tokens always attended (the paper: none)",
    },
];

/// Label bits at which labels are kept as they are.
const FULL_BITS: usize = 16;

/// One token's label: the key at the chosen channels, min–max quantized.
fn label(key: &[f32], channels: &[usize], bits: usize) -> Vec<f32> {
    let x: Vec<f32> = channels.iter().map(|&c| key[c]).collect();
    if bits >= FULL_BITS {
        return x;
    }
    let max_q = ((1u32 << bits) - 1) as f32;
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let range = if hi > lo { hi - lo } else { 1.0 };
    x.iter().map(|v| ((v - lo) * max_q / range).round().clamp(0.0, max_q) * range / max_q + lo).collect()
}

/// A layer's label cache over positions `0..end`, per KV head, dequantized for the reference
/// scan (a compact form is `bits` per value plus a scale and offset per row; the reference
/// keeps both in f32, so a port storing them in f16 may rank near-ties differently).
struct Labels {
    end: usize,
    channels: Vec<Vec<usize>>,
    rows: Vec<Vec<Vec<f32>>>,
}

pub struct DoubleSparsity {
    budget: Budget,
    params: Params,
    calibration: Arc<Channels>,
    labels: PerLayer<Arc<Labels>>,
}

impl DoubleSparsity {
    pub fn new(budget: Budget, params: Params, calibration: Arc<Channels>) -> Self {
        Self { budget, params, calibration, labels: PerLayer::new() }
    }

    fn channel_count(&self, head_dim: usize) -> usize {
        match self.params.usize("channels") {
            0 => (head_dim / 4).max(1),
            r => r.min(head_dim),
        }
    }

    fn layer_labels(&self, call: &AttnCall<'_>, rows: &LayerRows, hi: usize) -> Result<Arc<Labels>> {
        let mut cache = self.labels.lock();
        if let Some(l) = cache.get(&call.layer).filter(|l| l.end <= hi) {
            return Ok(l.clone());
        }
        let order = &self.calibration.order;
        if call.layer >= order.len() || order[call.layer].len() != rows.kv_heads {
            return Err(Error::Invalid(format!(
                "the channel calibration has {} layers x {} KV heads; this model has layer {} with {} KV heads",
                order.len(),
                order.first().map_or(0, |l| l.len()),
                call.layer,
                rows.kv_heads
            )));
        }
        let r = self.channel_count(rows.head_dim);
        let bits = self.params.usize("bits");
        let channels: Vec<Vec<usize>> = (0..rows.kv_heads).map(|g| self.calibration.top(call.layer, g, r)).collect();
        let label_rows = channels
            .iter()
            .enumerate()
            .map(|(g, c)| (0..hi).map(|p| label(rows.key(g, p), c, bits)).collect())
            .collect();
        let l = Arc::new(Labels { end: hi, channels, rows: label_rows });
        cache.insert(call.layer, l.clone());
        Ok(l)
    }
}

impl Attention for DoubleSparsity {
    fn name(&self) -> &'static str {
        "double-sparsity"
    }

    fn settings(&self) -> serde_json::Value {
        budgeted_settings(self.name(), &self.budget, &self.params)
    }

    fn reset(&self) {
        self.labels.clear();
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        sparse_decode(call, |rows, lo, hi| {
            let labels = self.layer_labels(call, rows, hi)?;
            let bits = self.params.usize("bits");
            let queries = query_rows(call)?;
            let groups = queries.len() / rows.kv_heads;
            let window = self.params.usize("window").min(hi - lo);
            let cut = hi - window;
            let picks = queries
                .iter()
                .enumerate()
                .map(|(h, q)| {
                    let g = h / groups;
                    let ch = &labels.channels[g];
                    let ql: Vec<f32> = ch.iter().map(|&c| q[0][c]).collect();
                    let score = |p: usize| -> f32 {
                        let fresh;
                        let row = if p < labels.end {
                            &labels.rows[g][p]
                        } else {
                            fresh = label(rows.key(g, p), ch, bits);
                            &fresh
                        };
                        ql.iter().zip(row).map(|(a, b)| a * b).sum()
                    };
                    let mut order = top_positions((lo..cut).collect(), self.budget.tokens(hi - lo), score);
                    order.extend(cut..hi);
                    HeadPick::plain(order)
                })
                .collect();
            let r = labels.channels[0].len();
            let row_bytes = if bits >= FULL_BITS { 2.0 * r as f64 } else { (r * bits) as f64 / 8.0 + 4.0 };
            Ok((picks, (cut - lo) as f64 * row_bytes / (2 * rows.head_dim) as f64))
        })
    }
}
