//! What a prefill costs, as a model fitted to this machine's own timings: each layer's forward
//! pass over tokens `from..to` of a context takes `per_token · (to − from)` seconds for what
//! every token pays alone (projections, the MLP, norms) and `per_pair · pairs(from, to)` for
//! attention, whose work grows with every earlier token a new one reads.
//!
//! Why a model and not a rate: a single tokens-per-second figure, measured on a short context,
//! underestimated a 20,709-token prefill on the demo model by 7× (49 s said, 5.8 min taken), and
//! an ETA extrapolated from the first chunks of a layer grew from 1 min to 4.5 min within it:
//! attention's quadratic term is small on the first chunks and dominates the last. Fitted on the
//! chunks a run has timed, and kept in the library from the last run on the same model and
//! device, the model predicts both the staging sheet's time and the ETA.
//!
//! A sparse prefill fits the same two terms with other values, and is kept apart (one cost per
//! kind of prefill): its rows read a fixed number of keys past the first few thousand tokens —
//! a per-token term — and its pattern's estimate scores every earlier key block — a per-pair
//! term, a block's worth smaller (1M tokens of the 7B shape on an H200: 90 s sparse, 444 s
//! dense). A dense cost would make its ETA several times too long.

use serde::{Deserialize, Serialize};

/// Seconds per layer: per token computed, and per (query, key) pair attended.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillCost {
    pub per_token: f64,
    pub per_pair: f64,
}

/// One timed stretch of a layer: tokens `from..to` (context positions) took `seconds`.
#[derive(Debug, Clone, Copy)]
pub struct Timed {
    pub from: usize,
    pub to: usize,
    pub seconds: f64,
}

/// (query, key) pairs of causal attention for queries `from..to`: query `i` reads `i + 1` keys.
pub fn pairs(from: usize, to: usize) -> f64 {
    let tri = |n: usize| n as f64 * (n as f64 + 1.0) / 2.0;
    tri(to) - tri(from)
}

impl PrefillCost {
    /// A cost with no attention term, from a rate of whole-prefill tokens per second over
    /// `layers` (what earlier Folio versions kept).
    pub fn from_rate(tokens_per_s: f64, layers: usize) -> Option<Self> {
        (tokens_per_s > 0.0 && layers > 0)
            .then(|| Self { per_token: 1.0 / (tokens_per_s * layers as f64), per_pair: 0.0 })
    }

    /// One layer over tokens `from..to`.
    pub fn layer_seconds(&self, from: usize, to: usize) -> f64 {
        self.per_token * to.saturating_sub(from) as f64 + self.per_pair * pairs(from, to.max(from))
    }

    /// The whole prefill: `layers` layers over tokens `from..to`.
    pub fn seconds(&self, layers: usize, from: usize, to: usize) -> f64 {
        layers as f64 * self.layer_seconds(from, to)
    }

    /// The cost that fits `timed` best in relative terms (each stretch's error over its own
    /// time, so short chunks count as much as long ones), both terms at least zero; `None`
    /// with nothing timed. With one stretch, or stretches that cannot tell the terms apart,
    /// the term that fits better alone.
    pub fn fit(timed: &[Timed]) -> Option<Self> {
        let rows: Vec<(f64, f64, f64)> = timed
            .iter()
            .filter(|t| t.to > t.from && t.seconds > 0.0)
            .map(|t| ((t.to - t.from) as f64 / t.seconds, pairs(t.from, t.to) / t.seconds, 1.0))
            .collect();
        if rows.is_empty() {
            return None;
        }
        // Weighted least squares: minimise Σ (a·x + b·y − 1)² over the scaled rows.
        let (mut xx, mut xy, mut yy, mut x1, mut y1) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (x, y, one) in &rows {
            xx += x * x;
            xy += x * y;
            yy += y * y;
            x1 += x * one;
            y1 += y * one;
        }
        let residual = |a: f64, b: f64| rows.iter().map(|(x, y, one)| (a * x + b * y - one).powi(2)).sum::<f64>();
        let det = xx * yy - xy * xy;
        let mut candidates = vec![(x1 / xx, 0.0), (0.0, y1 / yy)];
        if det > 1e-12 * xx * yy {
            let (a, b) = ((x1 * yy - y1 * xy) / det, (y1 * xx - x1 * xy) / det);
            if a >= 0.0 && b >= 0.0 {
                candidates.push((a, b));
            }
        }
        let (a, b) = candidates
            .into_iter()
            .filter(|(a, b)| a.is_finite() && b.is_finite())
            .min_by(|p, q| residual(p.0, p.1).total_cmp(&residual(q.0, q.1)))?;
        Some(Self { per_token: a, per_pair: b })
    }
}

impl PrefillCost {
    /// This cost's per-token term with the attention term fitted to `timed` (relative least
    /// squares, at least zero): for a cost that has no attention term — a rate, or a fit of a
    /// run too short to tell the terms apart (one chunk a layer, as a GPU prefills 4k tokens)
    /// — the run's own first chunks give the term that grows with the context, which a rate
    /// misses (it said 8 s of a 1M-token prefill that took 21 s). One term needs few chunks;
    /// fitting both from a layer's first chunks was 87% off.
    pub fn with_pairs_fitted(&self, timed: &[Timed]) -> Self {
        let (mut num, mut den) = (0.0, 0.0);
        // The first chunk carries the warm-up (see `scaled_to`), unless it is the only one.
        let skip = usize::from(timed.len() > 1);
        for t in timed[skip..].iter().filter(|t| t.to > t.from && t.seconds > 0.0) {
            let (x, y) = ((t.to - t.from) as f64 / t.seconds, pairs(t.from, t.to) / t.seconds);
            num += y * (1.0 - self.per_token * x);
            den += y * y;
        }
        let per_pair = if den > 0.0 { (num / den).max(0.0) } else { self.per_pair };
        Self { per_token: self.per_token, per_pair }
    }

    /// This cost scaled to what `timed` took against what it says they take, the run's first
    /// chunk left out (it carries the warm-up: a GPU compiles its kernels then) unless it is
    /// the only one. A prior fitted on another run keeps its shape — how the time grows with
    /// the context — but not always its level: a 4k-token run on a GPU, one chunk a layer
    /// timed from the host, left fits that said 2 s and 42 s of a 21 s prefill on two runs.
    pub fn scaled_to(&self, timed: &[Timed]) -> Self {
        let skip = usize::from(timed.len() > 1);
        let (took, says) =
            timed[skip..].iter().fold((0.0, 0.0), |(a, b), t| (a + t.seconds, b + self.layer_seconds(t.from, t.to)));
        match took > 0.0 && says > 0.0 {
            true => Self { per_token: self.per_token * took / says, per_pair: self.per_pair * took / says },
            false => *self,
        }
    }

    /// The fit worth keeping for the next prefill: one over stretches that tell the two terms
    /// apart (at least two different ones), else `None` — a change shorter than a chunk times
    /// the same stretch in every layer, and its one-term fit would replace a better one.
    pub fn fit_kept(timed: &[Timed]) -> Option<Self> {
        let mut stretches: Vec<(usize, usize)> = timed.iter().map(|t| (t.from, t.to)).collect();
        stretches.sort_unstable();
        stretches.dedup();
        if stretches.len() < 2 {
            return None;
        }
        Self::fit(timed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Timings made by a known cost (with ±2% noise) are fitted back to it, and the fit
    /// predicts a longer context within a few percent; a rate alone cannot.
    #[test]
    fn a_fit_recovers_the_cost_and_predicts_longer_contexts() {
        let truth = PrefillCost { per_token: 2e-4, per_pair: 3e-8 };
        let mut noise = 0.98;
        let timed: Vec<Timed> = (0..12)
            .map(|k| {
                noise = if noise > 1.0 { 0.98 } else { 1.02 };
                let (from, to) = (k * 512, (k + 1) * 512);
                Timed { from, to, seconds: truth.layer_seconds(from, to) * noise }
            })
            .collect();
        let fit = PrefillCost::fit(&timed).unwrap();
        let (want, got) = (truth.seconds(4, 0, 20_709), fit.seconds(4, 0, 20_709));
        assert!((got / want - 1.0).abs() < 0.05, "predicted {got:.1} s, truth {want:.1} s ({fit:?})");
        // The rate of the same first 6k tokens says under 70% of it (past the 30% it must hold).
        let secs: f64 = timed.iter().map(|t| t.seconds).sum();
        let rate = PrefillCost::from_rate(timed.last().unwrap().to as f64 / secs, 1).unwrap();
        assert!(rate.seconds(4, 0, 20_709) < 0.7 * want);
    }

    #[test]
    fn degenerate_timings_fit_one_term_or_nothing() {
        assert!(PrefillCost::fit(&[]).is_none());
        let one = PrefillCost::fit(&[Timed { from: 0, to: 100, seconds: 1.0 }]).unwrap();
        assert!((one.layer_seconds(0, 100) - 1.0).abs() < 1e-9, "{one:?}");
        assert!(one.per_token >= 0.0 && one.per_pair >= 0.0);
        assert_eq!(pairs(0, 3), 6.0);
        assert_eq!(pairs(2, 3), 3.0);
        assert_eq!(PrefillCost::from_rate(0.0, 4), None);
        // One stretch timed in every layer cannot tell the terms apart: nothing to keep.
        let same = [Timed { from: 0, to: 100, seconds: 1.0 }, Timed { from: 0, to: 100, seconds: 1.1 }];
        assert!(PrefillCost::fit_kept(&same).is_none());
        assert!(PrefillCost::fit_kept(&[same[0], Timed { from: 100, to: 200, seconds: 2.0 }]).is_some());
    }

    fn i_sign(from: usize) -> f64 {
        if (from / 65_536).is_multiple_of(2) {
            1.0
        } else {
            -1.0
        }
    }

    /// A per-token cost alone (a rate) and a few chunks of a run made by a known cost: the
    /// attention term is fitted back from them, and the whole prefill predicted within 5%.
    #[test]
    fn a_rate_gets_its_attention_term_from_the_first_chunks() {
        let truth = PrefillCost { per_token: 2e-6, per_pair: 3e-11 };
        let chunks: Vec<Timed> = (0..4)
            .map(|i| (i * 65_536, (i + 1) * 65_536))
            .map(|(from, to)| Timed {
                from,
                to,
                seconds: truth.layer_seconds(from, to) * (1.0 + 0.02 * (i_sign(from))),
            })
            .collect();
        let rate = PrefillCost { per_token: 2.1e-6, per_pair: 0.0 };
        let fitted = rate.with_pairs_fitted(&chunks);
        let (want, got) = (truth.seconds(4, 0, 1 << 20), fitted.seconds(4, 0, 1 << 20));
        assert!((got / want - 1.0).abs() < 0.05, "{fitted:?}: {got} s vs {want} s");
        assert!(rate.seconds(4, 0, 1 << 20) < 0.5 * want, "the rate alone misses most of it");
        assert_eq!(rate.with_pairs_fitted(&[]), rate);
    }

    /// A prior of the right shape at twice the level is brought to the run's own level by its
    /// chunks after the first (which took ten times longer: the warm-up).
    #[test]
    fn a_prior_is_scaled_to_the_chunks_timed() {
        let truth = PrefillCost { per_token: 2e-6, per_pair: 3e-11 };
        let prior = PrefillCost { per_token: 4e-6, per_pair: 6e-11 };
        let mut chunks: Vec<Timed> = (0..3)
            .map(|i| Timed {
                from: i * 65_536,
                to: (i + 1) * 65_536,
                seconds: truth.layer_seconds(i * 65_536, (i + 1) * 65_536),
            })
            .collect();
        chunks[0].seconds *= 10.0;
        let scaled = prior.scaled_to(&chunks);
        let (want, got) = (truth.seconds(4, 0, 1 << 20), scaled.seconds(4, 0, 1 << 20));
        assert!((got / want - 1.0).abs() < 1e-6, "{scaled:?}");
        assert_eq!(prior.scaled_to(&[]), prior);
    }
}
