//! Approximate top-k through an inverted-file index (the paper is named in [`SPEC`]; the
//! authors' `IndexIVFFlat` with inner product): per layer and KV head, the context's keys are
//! clustered by spherical k-means with inner-product assignment (unit centroids, so a long
//! one cannot swallow every key; trained on at most `TRAIN_KEYS` keys
//! spread evenly over the context, not the first ones, so late documents shape the lists
//! too) into `nlist` lists; a query scores
//! the centroids, scans the keys of the `nprobe` best lists exactly and keeps the top `k` by
//! q·k, plus the recent window. Search reads `nlist + Σ|probed lists|` key rows instead of
//! all `T`: about `nprobe/nlist` of the context. Inner-product search over L2 clusters is
//! not exact (queries are not distributed like keys), so the harness reports the recall
//! against the exact scan; with `nprobe = nlist` it *is* the exact scan — which the authors'
//! list count (`ceil(T/1000)`, nprobe 8) makes it below about 8k keys.
//!
//! GQA as exact top-k: one index per KV head, one search per query head.

use std::collections::BTreeMap;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::SeedableRng;

use super::cost::{CostInput, StepCost};
use super::method::Tiers;
use super::method::{budgeted, Budgeted};
use super::select::{
    dot, index_base, query_rows, sparse_decode, top_positions, HeadPick, IndexSource, Indexes, LayerRows,
    SectionReader, SectionWriter,
};
use super::{Attended, Attention, AttnCall, Budget, DefaultBudget, Knobs, MethodSpec, Needs, ParamSpec, Params, Path};
use crate::error::{Error, Result};
use crate::kv_cache::KvStore;

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "topk-ivf",
    summary: "approximate top-k: keys clustered into lists, a query scans only its nearest lists",
    paper: "Hoover, Synk et al., Exploiting Sparsity for Long Context Inference (arXiv 2502.06766), its Faiss \
            IndexIVFFlat search",
    default_budget: Some(DefaultBudget { budget: "1%", source: "exact top-k's default (the same paper, Table 1)" }),
    params: &PARAMS,
    needs: Needs { calibration: false, index: Some("inverted lists of the context's keys (k-means per KV head)") },
    tiers: Tiers {
        resident: Path::Reference("the lists are searched on the CPU over the resident layer"),
        offloaded: Path::None(
            "no offloaded fast path yet: the probed lists are scattered rows of every layer, which the \
             offloaded tier would gather per step; use topk (exact scan) or resident",
        ),
    },
    cost,
    build: budgeted::<TopKIvf>,
};

/// What a fast path would move: the centroids and the probed lists' keys (searched per query
/// head), then the picks' K and V per query head.
fn cost(input: &CostInput<'_>) -> StepCost {
    let lists = match input.params.usize("nlist") {
        0 => default_lists(input.context),
        n => n,
    };
    let probed = (input.params.usize("nprobe").min(lists) * input.context).div_ceil(lists);
    let picked = input.budget + input.params.usize("window");
    let heads = input.shape.heads;
    let per_layer = input.keys(lists + probed, heads) + input.rows(picked, heads);
    StepCost { link_bytes: input.layers() * per_layer, ..StepCost::default() }
}

const PARAMS: [ParamSpec; 4] = [
    ParamSpec { name: "nprobe", default: 8.0, min: 1.0, max: 65536.0, integer: true, doc: "lists scanned per query" },
    ParamSpec {
        name: "nlist",
        default: 0.0,
        min: 0.0,
        max: 65536.0,
        integer: true,
        doc: "lists per layer and KV head (0: ceil(T/1000), sqrt(T) past 900k, as the authors' code)",
    },
    super::topk::WINDOW,
    ParamSpec { name: "seed", default: 0.0, min: 0.0, max: 4_294_967_295.0, integer: true, doc: "k-means seed" },
];

/// k-means training: at most this many keys, this many Lloyd rounds.
const TRAIN_KEYS: usize = 100_000;
const KMEANS_ROUNDS: usize = 10;

/// The authors' list count for `n` keys.
pub fn default_lists(n: usize) -> usize {
    if n > 900_000 { (n as f64).sqrt().ceil() as usize } else { n.div_ceil(1000) }.max(1)
}

/// The list a key belongs to: the centroid with the largest inner product (ties to the
/// first), the metric the lists are probed by.
fn nearest(x: &[f32], centroids: &[Vec<f32>]) -> usize {
    let (mut best, mut best_score) = (0, f32::NEG_INFINITY);
    for (i, c) in centroids.iter().enumerate() {
        let s = dot(x, c);
        if s > best_score {
            (best, best_score) = (i, s);
        }
    }
    best
}

/// Unit length, so no centroid wins inner products by its norm alone (spherical k-means).
fn normalized(x: Vec<f32>) -> Vec<f32> {
    let n = dot(&x, &x).sqrt();
    if n > 0.0 {
        x.into_iter().map(|v| v / n).collect()
    } else {
        x
    }
}

/// One KV head's clusters over keys `0..end`.
struct HeadIvf {
    centroids: Vec<Vec<f32>>,
    lists: Vec<Vec<usize>>,
}

impl HeadIvf {
    fn build(rows: &LayerRows, head: usize, end: usize, nlist: usize, seed: u64) -> Self {
        if end == 0 {
            return Self { centroids: Vec::new(), lists: Vec::new() };
        }
        let mut rng = StdRng::seed_from_u64(seed ^ head as u64);
        let nlist = nlist.min(end).max(1);
        let train: Vec<usize> =
            if end > TRAIN_KEYS { (0..TRAIN_KEYS).map(|i| i * end / TRAIN_KEYS).collect() } else { (0..end).collect() };
        let mut centroids: Vec<Vec<f32>> = sample(&mut rng, train.len(), nlist)
            .into_iter()
            .map(|i| normalized(rows.key(head, train[i]).to_vec()))
            .collect();
        for _ in 0..KMEANS_ROUNDS {
            let mut sums = vec![vec![0f64; rows.head_dim]; nlist];
            let mut counts = vec![0usize; nlist];
            for &p in &train {
                let c = nearest(rows.key(head, p), &centroids);
                counts[c] += 1;
                for (s, x) in sums[c].iter_mut().zip(rows.key(head, p)) {
                    *s += *x as f64;
                }
            }
            for ((c, s), n) in centroids.iter_mut().zip(&sums).zip(&counts) {
                // An empty cluster keeps its centroid.
                if *n > 0 {
                    *c = normalized(s.iter().map(|x| (x / *n as f64) as f32).collect());
                }
            }
        }
        let mut lists = vec![Vec::new(); nlist];
        for p in 0..end {
            lists[nearest(rows.key(head, p), &centroids)].push(p);
        }
        Self { centroids, lists }
    }
}

struct LayerIvf {
    end: usize,
    heads: Vec<HeadIvf>,
}

impl LayerIvf {
    /// Per KV head: list count, centroids, list lengths, then every list's positions.
    fn encode(&self) -> Vec<u8> {
        let mut w = SectionWriter::default();
        for h in &self.heads {
            w.u32s([h.centroids.len() as u32]);
            h.centroids.iter().for_each(|c| w.f32s(c));
            w.u32s(h.lists.iter().map(|l| l.len() as u32));
            h.lists.iter().for_each(|l| w.u32s(l.iter().map(|&p| p as u32)));
        }
        w.0
    }

    fn decode(bytes: &[u8], name: &str, end: usize, kv_heads: usize, d: usize) -> Result<Self> {
        let mut r = SectionReader::new(bytes, name);
        let bad = || Error::Invalid(format!("index section \"{name}\" does not hold lists of its keys"));
        let mut heads = Vec::with_capacity(kv_heads);
        for _ in 0..kv_heads {
            let nlist = r.u32s(1)?[0] as usize;
            if nlist > end.max(1) {
                return Err(bad());
            }
            let centroids = (0..nlist).map(|_| r.f32s(d)).collect::<Result<Vec<_>>>()?;
            let sizes = r.u32s(nlist)?;
            if sizes.iter().map(|&n| n as usize).sum::<usize>() != end {
                return Err(bad());
            }
            let lists = sizes
                .iter()
                .map(|&n| Ok(r.u32s(n as usize)?.into_iter().map(|p| p as usize).collect::<Vec<_>>()))
                .collect::<Result<Vec<_>>>()?;
            // Every key in exactly one list.
            let mut seen = vec![false; end];
            if !lists.iter().flatten().all(|&p| p < end && !std::mem::replace(&mut seen[p], true)) {
                return Err(bad());
            }
            heads.push(HeadIvf { centroids, lists });
        }
        r.finish()?;
        Ok(Self { end, heads })
    }
}

pub struct TopKIvf {
    budget: Budget,
    params: Params,
    index: Indexes<LayerIvf>,
}

impl Budgeted for TopKIvf {
    fn new(budget: Budget, params: Params) -> Result<Self> {
        Ok(Self { budget, params, index: Indexes::new() })
    }
}

impl TopKIvf {
    /// The lists cover the context before the window (`base`: the saved prefix, else what is
    /// visible at the first decode): their end, list count and section name.
    fn plan(&self, kv: &dyn KvStore, hi: usize) -> (usize, usize, String) {
        let end = index_base(kv, hi).saturating_sub(self.params.usize("window"));
        let nlist = match self.params.usize("nlist") {
            0 => default_lists(end),
            n => n,
        };
        let name = format!("topk-ivf v1 nlist={nlist} keys=0..{end} seed={}", self.params.usize("seed"));
        (end, nlist, name)
    }

    fn build(&self, rows: &LayerRows, end: usize, nlist: usize) -> LayerIvf {
        let seed = self.params.get("seed") as u64;
        LayerIvf { end, heads: (0..rows.kv_heads).map(|h| HeadIvf::build(rows, h, end, nlist, seed)).collect() }
    }

    /// The layer's lists: cached, else read from the context file, else built.
    fn layer_index(&self, call: &AttnCall<'_>, rows: &LayerRows, hi: usize) -> Result<Arc<LayerIvf>> {
        if let Some(ix) = self.index.cached(call.layer, |ix| ix.end <= hi) {
            return Ok(ix);
        }
        let (end, nlist, name) = self.plan(call.kv, hi);
        self.index.load(
            call,
            &name,
            |b| LayerIvf::decode(b, &name, end, rows.kv_heads, rows.head_dim),
            || Ok(self.build(rows, end, nlist)),
        )
    }
}

impl Attention for TopKIvf {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    fn reset(&self) {
        self.index.clear();
    }

    fn index_section(&self, kv: &dyn KvStore, layer: usize, _layers: usize) -> Result<Option<(String, Vec<u8>)>> {
        let saved = kv.saved_len();
        if saved == 0 {
            return Ok(None);
        }
        let (end, nlist, name) = self.plan(kv, saved);
        if end == 0 {
            return Ok(None);
        }
        let rows = LayerRows::read_store(kv, layer, end)?;
        Ok(Some((name, self.build(&rows, end, nlist).encode())))
    }

    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        self.index.sources()
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        sparse_decode(call, |rows, lo, hi| {
            let ix = self.layer_index(call, rows, hi)?;
            let queries = query_rows(call)?;
            let groups = queries.len() / rows.kv_heads;
            let cut = hi.saturating_sub(self.params.usize("window")).max(lo);
            let mut searched = 0;
            let picks = queries
                .iter()
                .enumerate()
                .map(|(h, q)| {
                    let (q, g) = (&q[0], h / groups);
                    let head = &ix.heads[g];
                    let nprobe = self.params.usize("nprobe").min(head.centroids.len());
                    let lists =
                        top_positions((0..head.centroids.len()).collect(), nprobe, |c| dot(q, &head.centroids[c]));
                    let k = self.budget.tokens(hi - lo);
                    // Probed lists, then the unindexed keys before the window (the question); a
                    // budget covering the whole context skips the search.
                    let mut cand: Vec<usize> = if k >= cut - lo {
                        (lo..ix.end.max(lo)).collect()
                    } else {
                        lists.iter().flat_map(|&c| head.lists[c].iter().copied()).filter(|&p| p >= lo).collect()
                    };
                    cand.extend(ix.end.max(lo)..cut);
                    searched += head.centroids.len() + cand.len();
                    let mut pos = top_positions(cand, k, |p| dot(q, rows.key(g, p)));
                    pos.extend(cut..hi);
                    HeadPick::plain(pos)
                })
                .collect();
            Ok((picks, searched as f64 / queries.len() as f64))
        })
    }
}
