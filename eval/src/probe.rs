//! Measuring a method against dense attention on the same call: the quality harness wraps a
//! method in a [`Probe`], which on every decode step also runs dense attention over the same
//! queries and keys and records, per layer, the relative output error, the recall of the true
//! top keys, the attention mass the read keys hold, and the cost (rows read, rows searched).
//! Multi-token calls pass through unmeasured (every method but BUZZ is dense there).

use std::collections::BTreeMap;
use std::sync::Mutex;

use folio_models::attention::{dot, query_rows, visible, Attended, Attention, AttnCall, Dense, Knobs, LayerRows};
use folio_models::error::Result;

/// Sums over the decode steps of one layer.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct LayerTally {
    /// Σ‖o − o_dense‖², Σ‖o_dense‖² over heads and steps.
    pub err_sq: f64,
    pub ref_sq: f64,
    /// Σ over heads and steps of recall, mass captured, rows read / visible, rows searched /
    /// visible; and how many (head, step) pairs were added.
    pub recall: f64,
    pub mass: f64,
    pub read: f64,
    pub searched: f64,
    pub samples: usize,
    /// Σ over KV heads and steps of the rows the whole group read (the union of its query
    /// heads' picks) / visible: the KV traffic, when query heads pick differently; and how
    /// many (KV head, step) pairs were added.
    pub kv_read: f64,
    pub kv_samples: usize,
    /// Steps at which the method read every visible key (its dense layers).
    pub dense_steps: usize,
    pub steps: usize,
}

impl LayerTally {
    pub fn add(&mut self, other: &LayerTally) {
        self.err_sq += other.err_sq;
        self.ref_sq += other.ref_sq;
        self.recall += other.recall;
        self.mass += other.mass;
        self.read += other.read;
        self.searched += other.searched;
        self.samples += other.samples;
        self.kv_read += other.kv_read;
        self.kv_samples += other.kv_samples;
        self.dense_steps += other.dense_steps;
        self.steps += other.steps;
    }

    /// Whether every measured step of this layer was dense.
    pub fn is_dense(&self) -> bool {
        self.steps > 0 && self.dense_steps == self.steps
    }

    /// ‖o − o_dense‖ / ‖o_dense‖ over everything added.
    pub fn rel_error(&self) -> f64 {
        if self.ref_sq > 0.0 {
            (self.err_sq / self.ref_sq).sqrt()
        } else {
            0.0
        }
    }

    fn mean(&self, x: f64) -> f64 {
        if self.samples > 0 {
            x / self.samples as f64
        } else {
            0.0
        }
    }

    pub fn mean_recall(&self) -> f64 {
        self.mean(self.recall)
    }

    pub fn mean_mass(&self) -> f64 {
        self.mean(self.mass)
    }

    /// Fraction of the visible K and V rows attended.
    pub fn read_fraction(&self) -> f64 {
        self.mean(self.read)
    }

    /// Key-row equivalents the search touched, as a fraction of the visible keys.
    pub fn search_fraction(&self) -> f64 {
        self.mean(self.searched)
    }

    /// Fraction of the visible K and V rows each KV head's group read together.
    pub fn kv_read_fraction(&self) -> f64 {
        if self.kv_samples > 0 {
            self.kv_read / self.kv_samples as f64
        } else {
            0.0
        }
    }
}

/// Compares one decode call's output and read set with dense attention on the same rows.
pub fn measure(call: &AttnCall<'_>, got: &Attended, dense: &Attended) -> Result<LayerTally> {
    let (lo, hi) = visible(call);
    let rows = LayerRows::read(call, hi)?;
    let queries = query_rows(call)?;
    let groups = queries.len() / rows.kv_heads;
    let a = got
        .out
        .to_dtype(candle_core::DType::F32)?
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let b = dense
        .out
        .to_dtype(candle_core::DType::F32)?
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let d = rows.head_dim;
    let n = hi - lo;
    // Only visible positions count (a method must not read others; the probe does not trust it).
    let sets: Option<Vec<Vec<usize>>> = got
        .read
        .rows()?
        .map(|sets| sets.iter().map(|s| s.iter().copied().filter(|p| (lo..hi).contains(p)).collect()).collect());
    let mut t = LayerTally { steps: 1, dense_steps: usize::from(sets.is_none()), ..Default::default() };
    for g in 0..rows.kv_heads {
        let union = match &sets {
            None => n,
            Some(sets) => {
                sets[g * groups..(g + 1) * groups].iter().flatten().collect::<std::collections::HashSet<_>>().len()
            }
        };
        t.kv_read += union as f64 / n as f64;
        t.kv_samples += 1;
    }
    for (h, q) in queries.iter().enumerate() {
        let (oa, ob) = (&a[h * d..][..d], &b[h * d..][..d]);
        t.err_sq += oa.iter().zip(ob).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>();
        t.ref_sq += ob.iter().map(|y| (*y as f64).powi(2)).sum::<f64>();
        // True attention over the visible keys.
        let g = h / groups;
        let logits: Vec<f64> = (lo..hi).map(|p| (dot(&q[0], rows.key(g, p)) * call.scale) as f64).collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logits.iter().map(|z| (z - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let (read_n, mass, recall) = match &sets {
            None => (n, 1.0, 1.0),
            Some(sets) => {
                let set = &sets[h];
                let mass = set.iter().map(|&p| w[p - lo]).sum::<f64>() / total;
                // The |set| truly largest keys, and how many of them were read.
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|x, y| w[*y].total_cmp(&w[*x]).then(x.cmp(y)));
                let top: std::collections::HashSet<usize> = order.iter().take(set.len()).map(|i| i + lo).collect();
                let hit = set.iter().filter(|p| top.contains(p)).count();
                (set.len(), mass, if set.is_empty() { 1.0 } else { hit as f64 / set.len() as f64 })
            }
        };
        t.recall += recall;
        t.mass += mass;
        t.read += read_n as f64 / n as f64;
        t.searched += got.searched / n as f64;
        t.samples += 1;
    }
    Ok(t)
}

/// A method under measurement: attends with it, tallies each decode step against dense.
pub struct Probe<'a> {
    pub method: &'a dyn Attention,
    tallies: Mutex<BTreeMap<usize, LayerTally>>,
}

impl<'a> Probe<'a> {
    pub fn new(method: &'a dyn Attention) -> Self {
        Self { method, tallies: Mutex::new(BTreeMap::new()) }
    }

    /// Per-layer sums so far.
    pub fn tallies(&self) -> BTreeMap<usize, LayerTally> {
        self.tallies.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Attention for Probe<'_> {
    fn knobs(&self) -> Knobs<'_> {
        self.method.knobs()
    }

    fn reset(&self) {
        self.method.reset();
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let got = self.method.attend(call)?;
        if call.q.dim(1)? == 1 {
            let dense = Dense.attend(call)?;
            let tally = measure(call, &got, &dense)?;
            self.tallies.lock().unwrap_or_else(|e| e.into_inner()).entry(call.layer).or_default().add(&tally);
        }
        Ok(got)
    }
}
