//! The attention seam: the decoder hands each layer's queries to an [`Attention`] method,
//! which reads what it chooses from the [`KvStore`] and returns the layer's attention output.
//!
//! The decoder knows nothing about which rows a method reads; sparse methods and offloaded
//! tiers plug in here without touching the model code (mistral.rs's pluggable attention is the
//! model). Every method is declared once, by its [`MethodSpec`] in the [`REGISTRY`], and built
//! from a [`MethodChoice`] — a name, a user-facing *budget* (tokens, or a fraction of the
//! context; the paper's default when none is given) and `key=value` knobs, each validated
//! against the method's [`ParamSpec`] table, so a bad value is refused with the valid range.
//!
//! Sparse methods act on decode steps (one query token); a multi-token call (the question
//! appended to a context) is dense, as the papers prefill their prompts densely — except
//! BUZZ, whose cache is what it kept, for every later call of the conversation.
//!
//! A method reports what it read ([`Attended`]): the quality harness turns that into recall of
//! the true top keys and the fraction of the KV cache touched, so cost is measured, never
//! assumed from the budget.
//!
//! Indexes (MagicPIG's hash tables, Double Sparsity's label cache, the IVF lists) cover the
//! saved context; the first time a layer decodes they are loaded from the context file's index
//! sections (`folio context index`) or built from the stored keys, and kept until
//! [`Attention::reset`].
//! Keys after the indexed prefix (the question and the answer so far) are attended densely by
//! MagicPIG and HiP, as their papers keep generated tokens dense; top-k, IVF and Double
//! Sparsity score them exactly and let them compete for the budget.

mod buzz;
pub mod cost;
mod dense;
mod double_sparsity;
mod fast;
mod hip;
pub mod host_pool;
mod ivf;
mod magicpig;
pub mod method;
mod params;
pub mod reads;
mod registry;
mod select;
pub mod sparse_prefill;
mod streaming;
mod topk;

pub use buzz::Buzz;
pub use cost::{CostInput, Shape, StepCost};
pub use dense::Dense;
pub use double_sparsity::{Channels, DoubleSparsity};
pub use hip::Hip;
pub use ivf::TopKIvf;
pub use magicpig::MagicPig;
pub use method::{DefaultBudget, MethodSpec, Needs, Path, Tier, Tiers};
pub use params::{parse_params, Budget, ParamSpec, Params};
pub use reads::{Passage, ReadSummary, ReadTally, Weighing};
pub use registry::{by_name, names, spec, MethodChoice, REGISTRY};
pub use select::{dot, query_rows, visible, IndexSource, LayerRows};
pub use sparse_prefill::{SparseAttention, SparsePrefill};
pub use streaming::Streaming;
pub use topk::TopK;

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::Tensor;

use crate::error::Result;
use crate::kv_cache::Exact;
use crate::kv_cache::KvStore;

/// One layer's attention call.
pub struct AttnCall<'a> {
    /// The model layer, of `layers`.
    pub layer: usize,
    pub layers: usize,
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

impl AttnCall<'_> {
    /// The call as an exact attention over its store's layer ([`DecodeTier::dense`]).
    pub fn exact(&self) -> Exact<'_> {
        Exact { layer: self.kv_layer, q: self.q, q_start: self.q_start, scale: self.scale, window: self.window }
    }
}

/// What one call computed and what it read.
pub struct Attended {
    /// `[q_heads, t, head_dim]` in the dtype of the call's queries.
    pub out: Tensor,
    /// The key positions the attention read (for the last query row of the call).
    pub read: Read,
    /// Key rows the search touched per query head to make that choice (bucket walks, label
    /// scans, representative scores), in units of one full key row.
    pub searched: f64,
}

impl Attended {
    pub fn dense(out: Tensor) -> Self {
        Self { out, read: Read::All, searched: 0.0 }
    }
}

/// The key positions a call read.
pub enum Read {
    /// Every visible key.
    All,
    /// Per query head, the sorted key positions read.
    Rows(Vec<Vec<usize>>),
    /// Per query head, the positions a fast path picked on its device, `[q_heads, s]` u32
    /// (distinct per row, in any order): copied to the host only when [`Read::rows`] asks, so a
    /// decode step that nobody measures does not pay for it.
    Picked(Tensor),
    /// Per KV head, the positions every query head of its group read, `[kv_heads, s]` u32 on
    /// the device (distinct per row, in any order; `group` query heads a KV head): a pick
    /// shared by the group, expanded and copied to the host only when [`Read::rows`] asks.
    Grouped { idx: Tensor, group: usize },
    /// Per query head, the positions of `idx [q_heads, s]` (u32 on the device, distinct per
    /// row, each before `range`) and every position of `range`: a pick kept on the device beside
    /// a window read whole, copied to the host only when [`Read::rows`] asks.
    PickedAndRange { idx: Tensor, range: (usize, usize) },
    /// The same ranges of positions for each of `heads` query heads (ascending, disjoint).
    Spans { heads: usize, spans: Vec<(usize, usize)> },
    /// Per query head, the positions `picks` a sample read (ascending) between positions every
    /// head read, `before` (each below any pick) and `after` (each above): joined only when
    /// [`Read::rows`] asks (~2 ms a step at a million tokens otherwise).
    Sampled { before: Vec<u32>, picks: Drawn, after: Vec<u32> },
}

/// Per query head, the positions a sample read, ascending: drawn on the host, or by a GPU —
/// the first heads' still where it drew them (copied to the host only when [`Read::rows`]
/// asks), the rest's already reported to the host for the CPU to attend.
pub enum Drawn {
    Host(Vec<Vec<u32>>),
    Device { first: Option<Box<dyn DeviceDraw>>, rest: Vec<Vec<u32>> },
}

/// Positions a method drew on its device and keeps there: read back only when asked.
pub trait DeviceDraw: Send + Sync {
    /// Each query head's positions, ascending.
    fn positions(&self) -> Result<Vec<Vec<u32>>>;
}

impl Drawn {
    fn positions(&self) -> Result<std::borrow::Cow<'_, [Vec<u32>]>> {
        Ok(match self {
            Self::Host(picks) => std::borrow::Cow::Borrowed(picks),
            Self::Device { first: None, rest } => std::borrow::Cow::Borrowed(rest),
            Self::Device { first: Some(sample), rest } => {
                std::borrow::Cow::Owned(sample.positions()?.into_iter().chain(rest.iter().cloned()).collect())
            }
        })
    }
}

impl Read {
    /// Per query head, the sorted positions read; `None` when every visible key was.
    pub fn rows(&self) -> Result<Option<std::borrow::Cow<'_, [Vec<usize>]>>> {
        Ok(match self {
            Self::All => None,
            Self::Rows(rows) => Some(std::borrow::Cow::Borrowed(rows)),
            Self::Picked(idx) => Some(std::borrow::Cow::Owned(sorted_rows(idx, 1)?)),
            Self::Grouped { idx, group } => Some(std::borrow::Cow::Owned(sorted_rows(idx, *group)?)),
            Self::PickedAndRange { idx, range } => {
                let mut rows = sorted_rows(idx, 1)?;
                rows.iter_mut().for_each(|row| row.extend(range.0..range.1));
                Some(std::borrow::Cow::Owned(rows))
            }
            Self::Spans { heads, spans } => {
                let row: Vec<usize> = spans.iter().flat_map(|&(a, b)| a..b).collect();
                Some(std::borrow::Cow::Owned(vec![row; *heads]))
            }
            Self::Sampled { before, picks, after } => Some(std::borrow::Cow::Owned(
                picks
                    .positions()?
                    .iter()
                    .map(|pick| before.iter().chain(pick).chain(after).map(|&p| p as usize).collect())
                    .collect(),
            )),
        })
    }
}

/// The rows of `idx [rows, s]` (u32, on any device) sorted, each repeated `repeat` times.
fn sorted_rows(idx: &Tensor, repeat: usize) -> Result<Vec<Vec<usize>>> {
    let picked = idx.to_device(&candle_core::Device::Cpu)?.to_vec2::<u32>()?;
    Ok(picked
        .into_iter()
        .flat_map(|row| {
            let mut row: Vec<usize> = row.into_iter().map(|p| p as usize).collect();
            row.sort_unstable();
            std::iter::repeat_n(row, repeat)
        })
        .collect())
}

/// An attention method.
pub trait Attention: Send + Sync {
    /// The method's registry entry, budget and knobs (a wrapper forwards its method's).
    fn knobs(&self) -> Knobs<'_>;

    fn name(&self) -> &'static str {
        self.knobs().spec.name
    }

    /// The method's settings as recorded with each answer (`--json`): its name, and its
    /// budget and every knob when it has them.
    fn settings(&self) -> serde_json::Value {
        let k = self.knobs();
        match (k.budget, k.params) {
            (Some(budget), Some(params)) => {
                serde_json::json!({ "method": k.spec.name, "budget": budget, "params": params })
            }
            _ => serde_json::json!({ "method": k.spec.name }),
        }
    }

    /// What the method has set for itself while running, for reports (MagicPIG's balanced
    /// split); never part of [`Attention::settings`], which says whether two methods are the
    /// same one (a session keeps its method, and its state, while they are equal).
    fn learned(&self) -> Option<serde_json::Value> {
        None
    }

    /// The attention output of one layer's call and what it read.
    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended>;

    /// Output `[q_heads, t, head_dim]` in the dtype of `call.q`.
    fn forward(&self, call: &AttnCall<'_>) -> Result<Tensor> {
        Ok(self.attend(call)?.out)
    }

    /// Forgets indexes and conversation state; called before each new generation, whose
    /// store may hold different keys at the same positions.
    fn reset(&self) {}

    /// Forgets the conversation too: what [`Attention::reset`] keeps across its turns (BUZZ's
    /// cache), with the indexes. For a caller that runs unrelated prompts through one method
    /// (the needle eval), whose next prompt could start at the position where the last ended.
    fn end_conversation(&self) {
        self.reset()
    }

    /// This method's index of `layer` over `kv`'s saved prefix as a context-file section
    /// (name, bytes), for `folio context index`; `None` for methods (or layers) without one.
    fn index_section(&self, _kv: &dyn KvStore, _layer: usize, _layers: usize) -> Result<Option<(String, Vec<u8>)>> {
        Ok(None)
    }

    /// Where each layer's index came from since the last reset.
    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        BTreeMap::new()
    }
}

/// What a method is and how it is set: see [`Attention::knobs`].
pub struct Knobs<'a> {
    pub spec: &'static MethodSpec,
    /// `None` for a method without a budget (dense).
    pub budget: Option<&'a Budget>,
    pub params: Option<&'a Params>,
}

impl<'a> Knobs<'a> {
    /// A budgeted method's knobs.
    pub fn of(spec: &'static MethodSpec, budget: &'a Budget, params: &'a Params) -> Self {
        Self { spec, budget: Some(budget), params: Some(params) }
    }
}

/// What some methods need besides their knobs: Double Sparsity's calibrated channels.
#[derive(Default, Clone)]
pub struct Resources {
    pub channels: Option<Arc<Channels>>,
}
