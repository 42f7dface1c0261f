//! The attention quality harness (`folio eval attention`): every method at every budget,
//! measured against dense attention on the same keys, on real decode steps of a saved context
//! and on synthetic workloads ([`crate::workload`]).
//!
//! Context runs first decode `steps` tokens densely (greedy) after a question, keeping the
//! dense next-token distributions; each method then replays the same tokens (teacher forcing),
//! so its per-layer errors are measured on its own queries against dense attention over the
//! same KV, and the KL divergence of its next-token distribution from dense's is the
//! end-to-end cost of its errors.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::probe::{LayerTally, Probe};
use crate::workload::Case;
use folio_models::attention::{Attention, Dense};
use folio_models::context::ContextFile;
use folio_models::distribution::{argmax, kl_divergence};
use folio_models::error::Result;
use folio_models::kv_cache::ContextKv;
use folio_models::model::Logits;
use folio_models::Engine;

/// Synthetic calls are one layer deep in a 32-layer model, past every method's dense
/// leading layers (HiP's 3, MagicPIG's {0, 16}).
pub const SYNTHETIC_LAYER: usize = 20;
pub const SYNTHETIC_LAYERS: usize = 32;

/// One method at one budget, ready to measure.
pub struct Candidate {
    pub method: String,
    pub budget: String,
    pub attention: Box<dyn Attention>,
}

/// Figures of one (method, budget), overall and per layer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub rel_error: f64,
    pub recall: f64,
    pub mass: f64,
    /// Rows read per query head, and per KV head group (the union), / visible.
    pub read: f64,
    pub kv_read: f64,
    pub searched: f64,
}

impl From<&LayerTally> for Summary {
    fn from(t: &LayerTally) -> Self {
        Self {
            rel_error: t.rel_error(),
            recall: t.mean_recall(),
            mass: t.mean_mass(),
            read: t.read_fraction(),
            kv_read: t.kv_read_fraction(),
            searched: t.search_fraction(),
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub workload: String,
    pub method: String,
    pub budget: String,
    pub settings: serde_json::Value,
    /// Every layer pooled: the cost (a dense layer reads everything).
    pub overall: Summary,
    /// The layers the method ran sparse, pooled: its error, recall and mass where it acts
    /// (equal to `overall` when no layer is dense; `None` when every layer was).
    pub sparse_layers: Option<Summary>,
    /// Per layer; a method's dense layers show error 0 and read 1.
    pub layers: BTreeMap<usize, Summary>,
    /// Mean KL(dense ‖ method) of the next-token distribution, nats (context runs only).
    pub kl: Option<f64>,
}

fn summarize(workload: &str, c: &Candidate, tallies: &BTreeMap<usize, LayerTally>, kl: Option<f64>) -> Row {
    let (mut all, mut sparse) = (LayerTally::default(), LayerTally::default());
    for t in tallies.values() {
        all.add(t);
        if !t.is_dense() {
            sparse.add(t);
        }
    }
    Row {
        workload: workload.to_owned(),
        method: c.method.clone(),
        budget: c.budget.clone(),
        settings: c.attention.settings(),
        overall: Summary::from(&all),
        sparse_layers: (sparse.steps > 0).then(|| Summary::from(&sparse)),
        layers: tallies.iter().map(|(l, t)| (*l, Summary::from(t))).collect(),
        kl,
    }
}

/// Each candidate over every decode step of `case`.
pub fn synthetic(case: &Case, candidates: &[Candidate]) -> Result<Vec<Row>> {
    let spec = &case.spec;
    let kv = case.store()?;
    candidates
        .iter()
        .map(|c| {
            c.attention.reset();
            let probe = Probe::new(c.attention.as_ref());
            for s in 0..case.queries.len() {
                probe.attend(&case.call(s, &kv, (SYNTHETIC_LAYER, SYNTHETIC_LAYERS)))?;
            }
            Ok(summarize(spec.name, c, &probe.tallies(), None))
        })
        .collect()
}

/// Natural-log softmax of a logits row.
fn row(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
}

/// What a context run measured besides the rows: the dense answer it replayed.
pub struct ContextRun {
    pub rows: Vec<Row>,
    pub answer: Vec<u32>,
}

/// Every candidate on `steps` decode steps after `tail` (the question, templated) on `file`.
pub fn on_context(
    engine: &Engine,
    file: &Arc<ContextFile>,
    tail: &[u32],
    steps: usize,
    resident_budget: u64,
    candidates: &[Candidate],
    mut progress: impl FnMut(&Candidate),
) -> Result<ContextRun> {
    let model = &engine.model;
    let fresh = || ContextKv::new(file.clone(), model.dtype(), model.device(), resident_budget);
    // The dense reference: its greedy tokens and next-token distributions.
    let mut kv = fresh();
    let mut logits = row(&model.forward(tail, &mut kv, &Dense, Logits::Last)?)?;
    let (mut answer, mut dense) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    for _ in 0..steps {
        let next = argmax(&logits);
        answer.push(next);
        logits = row(&model.forward(&[next], &mut kv, &Dense, Logits::Last)?)?;
        dense.push(logits.clone());
    }
    let workload = format!("context ({} tokens)", file.header().tokens);
    let mut rows = Vec::with_capacity(candidates.len());
    for c in candidates {
        progress(c);
        c.attention.reset();
        let probe = Probe::new(c.attention.as_ref());
        let mut kv = fresh();
        model.forward(tail, &mut kv, &probe, Logits::Last)?;
        let mut kl = 0.0;
        for (tok, reference) in answer.iter().zip(&dense) {
            let got = row(&model.forward(&[*tok], &mut kv, &probe, Logits::Last)?)?;
            kl += kl_divergence(reference, &got);
        }
        rows.push(summarize(&workload, c, &probe.tallies(), Some(kl / steps.max(1) as f64)));
    }
    Ok(ContextRun { rows, answer })
}
