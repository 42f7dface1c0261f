//! HiP (research/seeds/001-hip.md): hierarchically pruned attention. Keys close in position
//! score alike ("attention locality"), so a branch's representative block stands for it and a
//! greedy tree search finds each query's top blocks in O(k log T) instead of scoring every key.
//!
//! Decode, per *query* head (the paper is MHA; per query head like top-k, since heads of a
//! group attend differently), over the context between the sinks and the recent window, cut
//! into blocks of `block` keys: start from `n = k / block` equal branches; each round splits
//! every branch in two, scores each half by the max of q·k over its middle block (the
//! representative the paper found best, Table 16), and keeps the `n` best halves (ties to the
//! earlier block); after ⌈log₂(N/n)⌉ rounds every branch is one block. Exact attention then
//! runs over sinks ∪ chosen blocks ∪ window. Masks are refreshed every `refresh` decode steps
//! and reused in between, the window growing from the refresh point (§2.4); the first
//! `dense_layers` layers stay dense (the paper's l_d = 3 for 7B models). With k covering the
//! whole region nothing is pruned: dense.
//!
//! Sinks and window sizes are not stated in the paper; 4 and 64 are StreamingLLM's sinks and
//! the window the other methods here use.

use std::collections::HashMap;

use super::select::{budgeted_settings, dot, query_rows, sparse_decode, HeadPick, LayerRows, PerLayer};
use super::{Attended, Attention, AttnCall, Budget, Dense, ParamSpec, Params};
use crate::error::Result;

pub(super) const PARAMS: [ParamSpec; 5] = [
    ParamSpec { name: "block", default: 2.0, min: 1.0, max: 256.0, integer: true, doc: "b_k, keys per block" },
    ParamSpec {
        name: "sinks",
        default: 4.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "first tokens always attended",
    },
    ParamSpec {
        name: "window",
        default: 64.0,
        min: 1.0,
        max: 1_048_576.0,
        integer: true,
        doc: "most recent tokens always attended (the query's own at least), outside the budget",
    },
    ParamSpec {
        name: "dense_layers",
        default: 3.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "l_d, leading layers kept dense",
    },
    ParamSpec {
        name: "refresh",
        default: 8.0,
        min: 1.0,
        max: 4096.0,
        integer: true,
        doc: "r_m, decode steps per mask",
    },
];

/// One query head's cached mask: chosen key positions, the window start and the step
/// (visible end) it was built at.
#[derive(Clone)]
struct Mask {
    keys: Vec<usize>,
    window_start: usize,
    built_hi: usize,
}

pub struct Hip {
    budget: Budget,
    params: Params,
    masks: PerLayer<Vec<Mask>>,
}

/// The hierarchical search over blocks `0..blocks` for `n` survivors; `score(b)` scores block
/// `b` (by its keys). Returns the chosen blocks ascending and how many blocks were scored.
pub fn search_blocks(blocks: usize, n: usize, mut score: impl FnMut(usize) -> f32) -> (Vec<usize>, usize) {
    if blocks <= n {
        return ((0..blocks).collect(), 0);
    }
    let round = |j: usize| ((j * blocks) as f64 / n as f64).round() as usize;
    let mut nodes: Vec<(usize, usize)> = (0..n).map(|j| (round(j), round(j + 1))).filter(|(f, l)| l > f).collect();
    let mut scored = 0;
    let mut memo: HashMap<usize, f32> = HashMap::new();
    let mut score_of = |b: usize, scored: &mut usize| {
        *memo.entry(b).or_insert_with(|| {
            *scored += 1;
            score(b)
        })
    };
    while nodes.iter().any(|(f, l)| l - f > 1) {
        let mut cand: Vec<((usize, usize), f32)> = Vec::with_capacity(2 * nodes.len());
        for &(f, l) in &nodes {
            if l - f == 1 {
                cand.push(((f, l), score_of(f, &mut scored)));
            } else {
                let m = f + (l - f) / 2;
                cand.push(((f, m), score_of(f + (m - f) / 2, &mut scored)));
                cand.push(((m, l), score_of(m + (l - m) / 2, &mut scored)));
            }
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0 .0.cmp(&b.0 .0)));
        cand.truncate(n);
        nodes = cand.into_iter().map(|c| c.0).collect();
    }
    let mut chosen: Vec<usize> = nodes.into_iter().map(|(f, _)| f).collect();
    chosen.sort_unstable();
    (chosen, scored)
}

impl Hip {
    pub fn new(budget: Budget, params: Params) -> Self {
        Self { budget, params, masks: PerLayer::new() }
    }

    /// A fresh mask for one query head keeping `k` keys of `first..window_start`, and how
    /// many keys the search scored.
    fn build(
        &self,
        q: &[f32],
        rows: &LayerRows,
        kvh: usize,
        region: (usize, usize),
        k: usize,
        hi: usize,
    ) -> (Mask, usize) {
        let (first, window_start) = region;
        let b = self.params.usize("block");
        let blocks = window_start.saturating_sub(first).div_ceil(b);
        let block_keys = |blk: usize| first + blk * b..(first + (blk + 1) * b).min(window_start);
        let mut scored = 0;
        let (chosen, _) = search_blocks(blocks, k.div_ceil(b).max(1), |blk| {
            scored += block_keys(blk).len();
            block_keys(blk).map(|p| dot(q, rows.key(kvh, p))).fold(f32::NEG_INFINITY, f32::max)
        });
        let keys = chosen.into_iter().flat_map(block_keys).collect();
        (Mask { keys, window_start, built_hi: hi }, scored)
    }
}

impl Attention for Hip {
    fn name(&self) -> &'static str {
        "hip"
    }

    fn settings(&self) -> serde_json::Value {
        budgeted_settings(self.name(), &self.budget, &self.params)
    }

    fn reset(&self) {
        self.masks.clear();
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        if call.layer < self.params.usize("dense_layers") {
            return Dense.attend(call);
        }
        sparse_decode(call, |rows, lo, hi| {
            let queries = query_rows(call)?;
            let groups = queries.len() / rows.kv_heads;
            // Sinks are the sequence's first tokens (those still visible).
            let first = self.params.usize("sinks").clamp(lo, hi);
            let window_start = hi.saturating_sub(self.params.usize("window")).max(first);
            let mut cache = self.masks.lock();
            let stale = |m: &Vec<Mask>| {
                m.len() != queries.len() || m[0].built_hi > hi || hi - m[0].built_hi >= self.params.usize("refresh")
            };
            let mut searched = 0;
            if cache.get(&call.layer).is_none_or(stale) {
                let masks = queries
                    .iter()
                    .enumerate()
                    .map(|(h, q)| {
                        let k = self.budget.tokens(hi - lo);
                        let (m, s) = self.build(&q[0], rows, h / groups, (first, window_start), k, hi);
                        searched += s;
                        m
                    })
                    .collect();
                cache.insert(call.layer, masks);
            }
            let masks = &cache[&call.layer];
            let picks = masks
                .iter()
                .map(|m| {
                    // A sliding model window may have moved past keys chosen at the last refresh.
                    let chosen = m.keys.iter().copied().filter(|&p| p >= first);
                    let pos = (lo..first).chain(chosen).chain(m.window_start.max(first)..hi).collect();
                    HeadPick::plain(pos)
                })
                .collect();
            Ok((picks, searched as f64 / queries.len() as f64))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With one survivor per block the search keeps everything; a single planted peak is found
    /// among thousands of blocks while scoring O(n log N) of them.
    #[test]
    fn search_finds_planted_peaks_cheaply() {
        let (all, scored) = search_blocks(10, 10, |_| 0.0);
        assert_eq!((all, scored), ((0..10).collect(), 0));
        // A smooth score with its peak at block 3001: locality makes the greedy search exact.
        let peak = 3001usize;
        let (chosen, scored) = search_blocks(4096, 4, |b| -((b as f32 - peak as f32).abs()));
        assert!(chosen.contains(&peak), "{chosen:?}");
        assert!(scored < 4 * 2 * 12 + 8, "scored {scored} blocks");
    }
}
