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

use candle_core::{DType, Device, Tensor};

use super::select::{budgeted_settings, dot, query_rows, sparse_decode, visible, HeadPick, LayerRows, PerLayer};
use super::{Attended, Attention, AttnCall, Budget, Dense, ParamSpec, Params};
use crate::error::Result;
use crate::offload::{self, OffloadKv};

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
    let found = search_blocks_batched(1, blocks, n, |wanted| Ok(vec![wanted[0].iter().map(|&b| score(b)).collect()]));
    let mut found = found.expect("scoring here cannot fail");
    found.pop().expect("one head")
}

/// [`search_blocks`] for `heads` searches at once: each round, `score(wanted)` gets the blocks
/// every head still needs scored (`wanted[h]`) and returns their scores, so a GPU scores a
/// whole round of every head in one gather. Per head: the chosen blocks ascending and how many
/// blocks were scored.
pub fn search_blocks_batched(
    heads: usize,
    blocks: usize,
    n: usize,
    mut score: impl FnMut(&[Vec<usize>]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<(Vec<usize>, usize)>> {
    if blocks <= n {
        return Ok(vec![((0..blocks).collect(), 0); heads]);
    }
    let round = |j: usize| ((j * blocks) as f64 / n as f64).round() as usize;
    let start: Vec<(usize, usize)> = (0..n).map(|j| (round(j), round(j + 1))).filter(|(f, l)| l > f).collect();
    let mut nodes = vec![start; heads];
    let mut memo: Vec<HashMap<usize, f32>> = vec![HashMap::new(); heads];
    // A node's candidates: (range, block whose keys stand for it).
    let split = |&(f, l): &(usize, usize)| -> Vec<((usize, usize), usize)> {
        if l - f == 1 {
            vec![((f, l), f)]
        } else {
            let m = f + (l - f) / 2;
            vec![((f, m), f + (m - f) / 2), ((m, l), m + (l - m) / 2)]
        }
    };
    while nodes.iter().any(|ns| ns.iter().any(|(f, l)| l - f > 1)) {
        let wanted: Vec<Vec<usize>> = nodes
            .iter()
            .zip(&memo)
            .map(|(ns, seen)| {
                let mut w: Vec<usize> =
                    ns.iter().flat_map(split).map(|c| c.1).filter(|b| !seen.contains_key(b)).collect();
                w.sort_unstable();
                w.dedup();
                w
            })
            .collect();
        for ((seen, w), sc) in memo.iter_mut().zip(&wanted).zip(score(&wanted)?) {
            seen.extend(w.iter().copied().zip(sc));
        }
        for (ns, seen) in nodes.iter_mut().zip(&memo) {
            let mut cand: Vec<((usize, usize), f32)> = ns.iter().flat_map(split).map(|(r, b)| (r, seen[&b])).collect();
            cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0 .0.cmp(&b.0 .0)));
            cand.truncate(n);
            *ns = cand.into_iter().map(|c| c.0).collect();
        }
    }
    Ok(nodes
        .into_iter()
        .zip(memo)
        .map(|(ns, seen)| {
            let mut chosen: Vec<usize> = ns.into_iter().map(|(f, _)| f).collect();
            chosen.sort_unstable();
            (chosen, seen.len())
        })
        .collect())
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

impl Hip {
    /// The fast path over an offloaded store: each refresh searches every query head's blocks
    /// at once, one gather of the round's representative keys per round; each step gathers
    /// the heads' picks (sinks, chosen blocks, window) and runs the selected-row kernel.
    fn attend_offloaded(&self, call: &AttnCall<'_>, kv: &OffloadKv) -> Result<Attended> {
        let (lo, hi) = visible(call);
        let q = call.q.squeeze(1)?;
        let heads = q.dim(0)?;
        let dev = q.device().clone();
        let first = self.params.usize("sinks").clamp(lo, hi);
        let window_start = hi.saturating_sub(self.params.usize("window")).max(first);
        let b = self.params.usize("block");
        let mut cache = self.masks.lock();
        let stale = |m: &Vec<Mask>| {
            m.len() != heads || m[0].built_hi > hi || hi - m[0].built_hi >= self.params.usize("refresh")
        };
        let mut searched = 0;
        if cache.get(&call.layer).is_none_or(stale) {
            let blocks = window_start.saturating_sub(first).div_ceil(b);
            let n = self.budget.tokens(hi - lo).div_ceil(b).max(1);
            let qf = q.to_dtype(DType::F32)?.unsqueeze(1)?;
            // A round's scores: every wanted block's keys gathered per head (short lists and the
            // last, shorter block padded by repeating a key: a max is unchanged by repeats).
            let score = |wanted: &[Vec<usize>]| -> Result<Vec<Vec<f32>>> {
                let m = wanted.iter().map(Vec::len).max().unwrap_or(0);
                if m == 0 {
                    return Ok(vec![Vec::new(); heads]);
                }
                let pos: Vec<u32> = wanted
                    .iter()
                    .flat_map(|w| {
                        (0..m).flat_map(move |i| {
                            let blk = w.get(i).or(w.last()).copied().unwrap_or(0);
                            let last = ((blk + 1) * b).min(window_start - first) - 1;
                            (0..b).map(move |j| (first + (blk * b + j).min(last)) as u32)
                        })
                    })
                    .collect();
                let idx = Tensor::from_vec(pos, (heads, m * b), &dev)?;
                let keys = kv.gather_keys(call.kv_layer, &idx, hi)?.to_dtype(DType::F32)?;
                let z = qf.matmul(&keys.transpose(1, 2)?)?.reshape((heads, m, b))?.max(2)?;
                let z: Vec<Vec<f32>> = z.to_device(&Device::Cpu)?.to_vec2()?;
                Ok(z.into_iter().zip(wanted).map(|(row, w)| row[..w.len()].to_vec()).collect())
            };
            let found = search_blocks_batched(heads, blocks, n, score)?;
            let masks = found
                .into_iter()
                .map(|(chosen, scored)| {
                    searched += scored * b;
                    let keys =
                        chosen.into_iter().flat_map(|blk| first + blk * b..(first + (blk + 1) * b).min(window_start));
                    Mask { keys: keys.collect(), window_start, built_hi: hi }
                })
                .collect();
            cache.insert(call.layer, masks);
        }
        let picks: Vec<Vec<usize>> = cache[&call.layer]
            .iter()
            .map(|m| {
                let chosen = m.keys.iter().copied().filter(|&p| p >= first);
                (lo..first).chain(chosen).chain(m.window_start.max(first)..hi).collect()
            })
            .collect();
        // Heads may pick a few keys fewer (a shorter last block): pad with a key at −∞.
        let s = picks.iter().map(Vec::len).max().unwrap_or(0);
        let mut pos = Vec::with_capacity(heads * s);
        let mut bias = Vec::with_capacity(heads * s);
        for p in &picks {
            pos.extend(p.iter().map(|&x| x as u32));
            bias.extend(std::iter::repeat_n(0f32, p.len()));
            pos.extend(std::iter::repeat_n(p[0] as u32, s - p.len()));
            bias.extend(std::iter::repeat_n(f32::NEG_INFINITY, s - p.len()));
        }
        let idx = Tensor::from_vec(pos, (heads, s), &dev)?;
        let padded = picks.iter().any(|p| p.len() < s);
        let bias = if padded { Some(Tensor::from_vec(bias, (heads, s), &dev)?) } else { None };
        let out = offload::attend_selected(call, kv, &idx, bias.as_ref())?;
        Ok(Attended { out, read: Some(picks), searched: searched as f64 / heads as f64 })
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
        let offloaded = call.kv.offloaded();
        if call.layer < self.params.usize("dense_layers") {
            if let Some(kv) = offloaded {
                // Read every step: keep the layer on the device rather than cross the link.
                kv.keep_resident(call.kv_layer)?;
            }
            return Dense.attend(call);
        }
        if let (Some(kv), 1) = (offloaded, call.q.dim(1)?) {
            return self.attend_offloaded(call, kv);
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
