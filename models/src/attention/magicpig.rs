//! MagicPIG (research/seeds/000-magicpig.md): attention as an expectation, estimated by
//! sampling keys through locality-sensitive hashing and correcting by importance weights.
//!
//! Index, per layer and KV head, over the context before the recent window: keys centred on
//! their mean (without centring keys sit in a cone far from every query and almost nothing
//! collides, §2.4), hashed by SimHash into `L` tables of `K` bits (one Gaussian projection
//! shared by every head and layer, seeded), each table a counting-sorted bucket list (CSR).
//! Decode, per *query* head (tables per KV head, retrieval per query head, as the authors'
//! GQA code: a per-group union would change each key's sampling probability): key `i` is
//! sampled iff its code equals the query's in at least two tables; its logit gets
//! `-log(u_i + 1e-4)` with `u_i = P[Binomial(L, p_i^K) ≥ 2]`, `p_i = 1 - θ_i/π` (Eq. 10–11,
//! in the cancellation-free form of the spec's §6). The `1e-4` caps a rare key's weight at
//! 1e4: a deliberate bias, as in the authors' code. Sinks and everything after the index
//! (the window, the question, the answer so far) are static: exact, weight 1. One softmax
//! over both is the LSE merge of Algorithm 1.
//!
//! Budget → (K, L): the user gives a budget, the paper gives (K, L). With `tables=0` the
//! smallest `L` whose expected cost under uniform buckets (Eq. 21) reaches the budget is used,
//! lowering `K` from `bits` when even `MAX_TABLES` tables cannot; real keys cost 1.1–3× Eq. 21
//! (Table 8), which the harness reports as achieved cost. A budget covering every key makes
//! every token static: exact dense attention, the paper's own limit.

use std::collections::BTreeMap;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rayon::prelude::*;

use candle_core::{DType, Device, Tensor};

use super::select::{
    budgeted_settings, dot, index_base, query_rows, sparse_decode, visible, HeadPick, IndexSource, Indexes, LayerRows,
    SectionReader, SectionWriter,
};
use super::workload::normal;
use super::{Attended, Attention, AttnCall, Budget, Dense, ParamSpec, Params};
use crate::error::{Error, Result};
use crate::kv::KvStore;
use crate::offload::{self, OffloadKv};

pub(super) const PARAMS: [ParamSpec; 6] = [
    ParamSpec {
        name: "bits",
        default: 10.0,
        min: 1.0,
        max: 12.0,
        integer: true,
        doc: "K, hash bits per table (each table keeps 2^K bucket offsets per KV head)",
    },
    ParamSpec {
        name: "tables",
        default: 0.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "L, hash tables, 2 or more (0: the fewest that reach the budget, Eq. 21)",
    },
    ParamSpec { name: "sinks", default: 4.0, min: 0.0, max: 1024.0, integer: true, doc: "first tokens kept exact" },
    ParamSpec {
        name: "window",
        default: 64.0,
        min: 1.0,
        max: 1_048_576.0,
        integer: true,
        doc: "most recent tokens kept exact, the query's own at least (with everything after the indexed context)",
    },
    ParamSpec {
        name: "dense_layers",
        default: 1.0,
        min: 0.0,
        max: 1.0,
        integer: true,
        doc: "1: layers 0 and L/2 attend densely (the paper's {0, 16}); 0: none",
    },
    ParamSpec { name: "seed", default: 0.0, min: 0.0, max: 4_294_967_295.0, integer: true, doc: "projection seed" },
];

/// Most tables the budget rule will use (the paper's largest is 300; DRAM grows with L).
const MAX_TABLES: usize = 1024;
/// The authors' floor under `u` before the log: caps an importance weight at 1e4.
const U_FLOOR: f64 = 1e-4;

/// `u = P[Binomial(L, p^K) ≥ 2]` for a single-hyperplane collision probability `p`, via
/// `(1-P)^L + L P (1-P)^(L-1) = (1-P)^(L-1) (1 + (L-1) P)` in logs, which avoids the naive
/// form's cancellation down to `L·P ≈ 1e-6`; below that the leading term `C(L,2) P²`.
pub fn sampling_probability(p: f64, bits: usize, tables: usize) -> f64 {
    if p <= 0.0 || tables < 2 {
        return 0.0;
    }
    let big_p = (bits as f64 * p.ln()).exp();
    if big_p >= 1.0 {
        return 1.0;
    }
    let l1 = (tables - 1) as f64;
    if tables as f64 * big_p < 1e-6 {
        return tables as f64 * l1 / 2.0 * big_p * big_p;
    }
    let a = l1 * (-big_p).ln_1p() + (l1 * big_p).ln_1p();
    -a.exp_m1()
}

/// Single-hyperplane collision probability of two vectors with cosine `cos`.
pub fn collision_probability(cos: f64) -> f64 {
    1.0 - cos.clamp(-1.0, 1.0).acos() / std::f64::consts::PI
}

/// (K, L) for a target sampled fraction: Eq. 21 (uniform buckets, p = 1/2 per bit).
pub fn tables_for(fraction: f64, max_bits: usize) -> (usize, usize) {
    for bits in (1..=max_bits).rev() {
        if let Some(l) = (2..=MAX_TABLES).find(|&l| sampling_probability(0.5, bits, l) >= fraction) {
            return (bits, l);
        }
    }
    (1, MAX_TABLES)
}

/// The `K·L` hyperplanes, `[d][K·L]` row-major, i.i.d. N(0, 1) from `seed`.
fn projection(d: usize, planes: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..d * planes).map(|_| normal(&mut rng)).collect()
}

/// Codes of `x` in every table: bit `b` of table `l` is `x · W[:, l·K + b] > 0`.
fn codes(x: &[f32], w: &[f32], bits: usize, tables: usize) -> Vec<u32> {
    let planes = bits * tables;
    let mut proj = vec![0f32; planes];
    for (i, xi) in x.iter().enumerate() {
        for (p, wv) in proj.iter_mut().zip(&w[i * planes..][..planes]) {
            *p += xi * wv;
        }
    }
    (0..tables).map(|l| (0..bits).fold(0u32, |c, b| c | (u32::from(proj[l * bits + b] > 0.0) << b))).collect()
}

/// One KV head's tables over keys `first..first + n`.
struct HeadTables {
    mean: Vec<f32>,
    /// |k_i - mean| for each indexed key.
    norms: Vec<f32>,
    /// Per table: the indexed keys (offsets from `first`) sorted by code, and bucket starts
    /// (`2^K + 1` offsets into it).
    order: Vec<Vec<u32>>,
    start: Vec<Vec<u32>>,
}

/// One layer's index.
struct LayerIndex {
    /// Indexed keys: `first..end`; the rest of the context is static.
    first: usize,
    end: usize,
    bits: usize,
    tables: usize,
    w: Vec<f32>,
    heads: Vec<HeadTables>,
}

impl LayerIndex {
    fn build(rows: &LayerRows, first: usize, end: usize, bits: usize, tables: usize, seed: u64) -> Result<Self> {
        let whole = |f: &mut dyn FnMut(usize, &[f32], usize)| -> Result<()> {
            f(0, &rows.k, rows.len);
            Ok(())
        };
        Self::build_chunked((rows.kv_heads, rows.head_dim), first, end, (bits, tables, seed), &whole)
    }

    /// [`Self::build`] from keys delivered in position order by `chunks`, which is called twice
    /// (the mean, then the codes) and hands `f(start, keys [kv_heads, c, d] f32, c)` for each
    /// chunk of `c` positions from `start`: an offloaded layer is read a chunk at a time, never
    /// whole. The sums run in position order either way, so both builds are the same index.
    #[allow(clippy::type_complexity)]
    fn build_chunked(
        (kv_heads, d): (usize, usize),
        first: usize,
        end: usize,
        (bits, tables, seed): (usize, usize, u64),
        chunks: &dyn Fn(&mut dyn FnMut(usize, &[f32], usize)) -> Result<()>,
    ) -> Result<Self> {
        let n = end - first;
        let w = projection(d, bits * tables, seed);
        // The chunk's rows inside first..end.
        let span =
            |start: usize, c: usize| first.max(start).min(start + c) - start..end.min(start + c).max(start) - start;
        let mut sums = vec![vec![0f64; d]; kv_heads];
        // Chunks must tile the positions in order: a gap and an overlap of the same size would
        // pass the count check below and give a wrong index.
        let mut next = 0;
        let mut in_order = true;
        chunks(&mut |start, keys, c| {
            in_order &= start == next;
            next = start + c;
            for (h, sum) in sums.iter_mut().enumerate() {
                for j in span(start, c) {
                    for (m, x) in sum.iter_mut().zip(&keys[(h * c + j) * d..][..d]) {
                        *m += *x as f64;
                    }
                }
            }
        })?;
        if !in_order {
            return Err(Error::Invalid("magicpig: key chunks must follow each other in position order".into()));
        }
        let means: Vec<Vec<f32>> = sums.iter().map(|s| s.iter().map(|m| (m / n as f64) as f32).collect()).collect();
        let mut norms: Vec<Vec<f32>> = (0..kv_heads).map(|_| Vec::with_capacity(n)).collect();
        let mut all_codes: Vec<Vec<Vec<u32>>> = (0..kv_heads).map(|_| Vec::with_capacity(n)).collect();
        chunks(&mut |start, keys, c| {
            for (h, mean) in means.iter().enumerate() {
                // d·K·L multiply-adds a key: over the cores (rayon keeps the order).
                let coded: Vec<(f32, Vec<u32>)> = span(start, c)
                    .into_par_iter()
                    .map(|j| {
                        let x: Vec<f32> = keys[(h * c + j) * d..][..d].iter().zip(mean).map(|(a, b)| a - b).collect();
                        (dot(&x, &x).sqrt(), codes(&x, &w, bits, tables))
                    })
                    .collect();
                for (norm, code) in coded {
                    norms[h].push(norm);
                    all_codes[h].push(code);
                }
            }
        })?;
        if all_codes.iter().any(|c| c.len() != n) {
            return Err(Error::Invalid(format!("magicpig: the keys {first}..{end} were not all delivered")));
        }
        let heads = means
            .into_iter()
            .zip(norms)
            .zip(all_codes)
            .map(|((mean, norms), all_codes)| {
                // Counting sort per table.
                let buckets = 1usize << bits;
                let (mut order, mut start) = (Vec::with_capacity(tables), Vec::with_capacity(tables));
                for l in 0..tables {
                    let mut count = vec![0u32; buckets + 1];
                    for c in &all_codes {
                        count[c[l] as usize + 1] += 1;
                    }
                    for b in 0..buckets {
                        count[b + 1] += count[b];
                    }
                    let mut next = count.clone();
                    let mut ord = vec![0u32; n];
                    for (i, c) in all_codes.iter().enumerate() {
                        let slot = &mut next[c[l] as usize];
                        ord[*slot as usize] = i as u32;
                        *slot += 1;
                    }
                    order.push(ord);
                    start.push(count);
                }
                HeadTables { mean, norms, order, start }
            })
            .collect();
        Ok(Self { first, end, bits, tables, w, heads })
    }

    /// The logit bias `−log(u + 1e-4)` of indexed key `i` (row `key`) sampled for query `q`
    /// (norm `q_norm`): `u` from the cosine with the centred key, the vector the hash saw.
    fn logit_bias(&self, t: &HeadTables, q: &[f32], q_norm: f32, i: usize, key: &[f32]) -> f32 {
        let centred: Vec<f32> = key.iter().zip(&t.mean).map(|(a, b)| a - b).collect();
        let cos = dot(q, &centred) as f64 / (q_norm as f64 * t.norms[i].max(f32::MIN_POSITIVE) as f64);
        let u = sampling_probability(collision_probability(cos), self.bits, self.tables);
        -((u + U_FLOOR).ln()) as f32
    }

    /// Offsets (from `first`) of the keys whose code equals `q`'s in at least two tables, in
    /// the order they reach the second collision, and the index entries walked.
    fn retrieve(&self, head: usize, q: &[f32]) -> (Vec<usize>, usize) {
        thread_local! {
            /// Collision counts per indexed key, all zero between calls: clearing only the
            /// entries a walk touched costs the walk, not the context (28 MB a layer at 1M).
            static COUNT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let t = &self.heads[head];
        let qc = codes(q, &self.w, self.bits, self.tables);
        let buckets =
            |l: usize, c: u32| &t.order[l][t.start[l][c as usize] as usize..t.start[l][c as usize + 1] as usize];
        COUNT.with_borrow_mut(|count| {
            if count.len() < self.end - self.first {
                count.resize(self.end - self.first, 0);
            }
            let (mut out, mut walked) = (Vec::new(), 0);
            for (l, &c) in qc.iter().enumerate() {
                let bucket = buckets(l, c);
                walked += bucket.len();
                for &i in bucket {
                    let n = &mut count[i as usize];
                    *n = n.saturating_add(1);
                    if *n == 2 {
                        out.push(i as usize);
                    }
                }
            }
            for (l, &c) in qc.iter().enumerate() {
                buckets(l, c).iter().for_each(|&i| count[i as usize] = 0);
            }
            (out, walked)
        })
    }
}

/// What a layer's index covers and how it hashes: a function of the store's saved prefix and
/// the settings alone, so it names a context-file section.
struct Plan {
    first: usize,
    end: usize,
    bits: usize,
    tables: usize,
    seed: u64,
}

impl Plan {
    fn name(&self) -> String {
        format!(
            "magicpig v1 bits={} tables={} keys={}..{} seed={}",
            self.bits, self.tables, self.first, self.end, self.seed
        )
    }
}

impl LayerIndex {
    /// The hyperplanes first (stored, not regenerated: the file must not depend on a random
    /// generator's version), then per KV head the mean, norms and bucket lists.
    fn encode(&self) -> Vec<u8> {
        let mut w = SectionWriter::default();
        w.f32s(&self.w);
        for h in &self.heads {
            w.f32s(&h.mean);
            w.f32s(&h.norms);
            for (start, order) in h.start.iter().zip(&h.order) {
                w.u32s(start.iter().copied());
                w.u32s(order.iter().copied());
            }
        }
        w.0
    }

    fn decode(bytes: &[u8], name: &str, plan: &Plan, kv_heads: usize, d: usize) -> Result<Self> {
        let mut r = SectionReader::new(bytes, name);
        let n = plan.end - plan.first;
        let planes = r.f32s(d * plan.bits * plan.tables)?;
        let mut heads = Vec::with_capacity(kv_heads);
        for _ in 0..kv_heads {
            let (mean, norms) = (r.f32s(d)?, r.f32s(n)?);
            let (mut start, mut order) = (Vec::new(), Vec::new());
            for _ in 0..plan.tables {
                let s = r.u32s((1 << plan.bits) + 1)?;
                let o = r.u32s(n)?;
                if s.windows(2).any(|w| w[0] > w[1])
                    || s.last() != Some(&(n as u32))
                    || o.iter().any(|&i| i as usize >= n)
                {
                    return Err(Error::Invalid(format!("index section \"{name}\" has bucket lists out of range")));
                }
                start.push(s);
                order.push(o);
            }
            heads.push(HeadTables { mean, norms, order, start });
        }
        r.finish()?;
        Ok(Self { first: plan.first, end: plan.end, bits: plan.bits, tables: plan.tables, w: planes, heads })
    }
}

pub struct MagicPig {
    budget: Budget,
    params: Params,
    index: Indexes<LayerIndex>,
}

impl MagicPig {
    pub fn new(budget: Budget, params: Params) -> Result<Self> {
        if params.usize("tables") == 1 {
            return Err(Error::Invalid(
                "magicpig samples keys that collide in at least 2 tables: give tables=0 (from the budget) or 2..=1024"
                    .into(),
            ));
        }
        Ok(Self { budget, params, index: Indexes::new() })
    }

    fn dense_layer(&self, layer: usize, layers: usize) -> bool {
        self.params.usize("dense_layers") == 1 && (layer == 0 || layer == layers / 2)
    }

    /// The index over `sinks..base - window` of the context (`base`: the saved prefix, else
    /// what is visible at the first decode); `None` when that range is empty or the budget, a
    /// share of the context, covers it: every token static.
    fn plan(&self, kv: &dyn KvStore, hi: usize) -> Option<Plan> {
        let base = index_base(kv, hi);
        let first = self.params.usize("sinks").min(base);
        let end = base.saturating_sub(self.params.usize("window")).max(first);
        let sparse = end - first;
        let want = self.budget.tokens(base);
        if sparse == 0 || want >= sparse {
            return None;
        }
        let (bits, tables) = match self.params.usize("tables") {
            0 => tables_for(want as f64 / sparse as f64, self.params.usize("bits")),
            l => (self.params.usize("bits"), l),
        };
        Some(Plan { first, end, bits, tables, seed: self.params.get("seed") as u64 })
    }

    /// The layer's index: cached, else read from the context file, else built.
    fn layer_index(&self, call: &AttnCall<'_>, rows: &LayerRows, hi: usize) -> Result<Option<Arc<LayerIndex>>> {
        self.layer_index_with(call, hi, (rows.kv_heads, rows.head_dim), |plan| {
            LayerIndex::build(rows, plan.first, plan.end, plan.bits, plan.tables, plan.seed)
        })
    }

    /// [`Self::layer_index`] with the build left to the caller (`shape`: KV heads, head dim).
    fn layer_index_with(
        &self,
        call: &AttnCall<'_>,
        hi: usize,
        (kv_heads, d): (usize, usize),
        build: impl FnOnce(&Plan) -> Result<LayerIndex>,
    ) -> Result<Option<Arc<LayerIndex>>> {
        if let Some(ix) = self.index.cached(call.layer, |ix| ix.end <= hi) {
            return Ok(Some(ix));
        }
        let Some(plan) = self.plan(call.kv, hi) else { return Ok(None) };
        let name = plan.name();
        Ok(Some(self.index.load(call, &name, |b| LayerIndex::decode(b, &name, &plan, kv_heads, d), || build(&plan))?))
    }
}

impl MagicPig {
    /// A decode step over the offloaded tier: the tables are walked on the host as on the
    /// resident path, but only the sampled keys are read (gathered, for their cosines and so
    /// their weights), and the selected-row kernel attends over the sample and the static part
    /// with those weights as logit biases; a head's shorter pick is padded with −∞ biases.
    /// (The paper attends on the CPU so the sample never crosses the link; docs/engine.md.)
    fn attend_offloaded(&self, call: &AttnCall<'_>, kv: &OffloadKv) -> Result<Attended> {
        let (lo, hi) = visible(call);
        // Stored tables, else built once from the layer's saved keys, a chunk at a time.
        let ix = self.layer_index_with(call, hi, (kv.kv_heads(), kv.head_dim()), |plan| {
            let chunks = |f: &mut dyn FnMut(usize, &[f32], usize)| -> Result<()> {
                let mut start = 0;
                kv.for_each_key_chunk(call.kv_layer, |k| {
                    let c = k.dim(1)?;
                    f(start, &k.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?, c);
                    start += c;
                    Ok(())
                })
            };
            LayerIndex::build_chunked(
                (kv.kv_heads(), kv.head_dim()),
                plan.first,
                plan.end,
                (plan.bits, plan.tables, plan.seed),
                &chunks,
            )
        })?;
        let Some(ix) = ix else {
            // Every token static: exact attention over the visible keys.
            return Dense.attend(call);
        };
        let queries = query_rows(call)?;
        let heads = queries.len();
        let groups = heads / kv.kv_heads();
        // Per query head: (offset into the index, position) of each sampled key.
        let mut walked_total = 0;
        let sampled: Vec<Vec<(usize, usize)>> = queries
            .iter()
            .enumerate()
            .map(|(h, q)| {
                let (found, walked) = ix.retrieve(h / groups, &q[0]);
                walked_total += walked;
                found.into_iter().map(|i| (i, ix.first + i)).filter(|&(_, p)| p >= lo).collect()
            })
            .collect();
        let most = sampled.iter().map(Vec::len).max().unwrap_or(0);
        // The sampled keys `[heads, most, d]`, padded with the current token's (never used).
        let keys: Vec<Vec<Vec<f32>>> = match most {
            0 => Vec::new(),
            _ => {
                let idx: Vec<u32> = sampled
                    .iter()
                    .flat_map(|s| s.iter().map(|&(_, p)| p as u32).chain(std::iter::repeat((hi - 1) as u32)).take(most))
                    .collect();
                let idx = Tensor::from_vec(idx, (heads, most), call.q.device())?;
                kv.gather_keys(call.kv_layer, &idx, hi)?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec3()?
            }
        };
        let statics: Vec<usize> = (lo..ix.first.max(lo)).chain(ix.end.max(lo)..hi).collect();
        let mut picks: Vec<(Vec<u32>, Vec<f32>)> = Vec::with_capacity(heads);
        for (h, (q, found)) in queries.iter().zip(&sampled).enumerate() {
            let (q, t) = (&q[0], &ix.heads[h / groups]);
            let q_norm = dot(q, q).sqrt().max(f32::MIN_POSITIVE);
            let mut pos: Vec<u32> = statics.iter().map(|&p| p as u32).collect();
            let mut bias = vec![0f32; pos.len()];
            for (j, &(i, p)) in found.iter().enumerate() {
                pos.push(p as u32);
                bias.push(ix.logit_bias(t, q, q_norm, i, &keys[h][j]));
            }
            picks.push((pos, bias));
        }
        let read = picks
            .iter()
            .map(|(pos, _)| {
                let mut sorted: Vec<usize> = pos.iter().map(|&p| p as usize).collect();
                sorted.sort_unstable();
                sorted
            })
            .collect();
        let (idx, bias) = offload::pad_picks(&picks, (hi - 1) as u32, call.q.device())?;
        let out = offload::attend_selected(call, kv, &idx, bias.as_ref())?;
        // Index entries are 4 bytes; a bf16 key row is 2·d.
        let searched = walked_total as f64 * 4.0 / (2 * kv.head_dim()) as f64 / heads as f64;
        Ok(Attended { out, read: Some(read), searched })
    }
}

impl Attention for MagicPig {
    fn name(&self) -> &'static str {
        "magicpig"
    }

    fn settings(&self) -> serde_json::Value {
        budgeted_settings(self.name(), &self.budget, &self.params)
    }

    fn reset(&self) {
        self.index.clear();
    }

    fn index_section(&self, kv: &dyn KvStore, layer: usize, layers: usize) -> Result<Option<(String, Vec<u8>)>> {
        let saved = kv.saved_len();
        if saved == 0 || self.dense_layer(layer, layers) {
            return Ok(None);
        }
        let Some(plan) = self.plan(kv, saved) else {
            return Ok(None);
        };
        let rows = LayerRows::read_store(kv, layer, plan.end)?;
        let ix = LayerIndex::build(&rows, plan.first, plan.end, plan.bits, plan.tables, plan.seed)?;
        Ok(Some((plan.name(), ix.encode())))
    }

    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        self.index.sources()
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        if self.dense_layer(call.layer, call.layers) {
            return Dense.attend(call);
        }
        if let (Some(kv), 1) = (call.kv.offloaded(), call.q.dim(1)?) {
            return self.attend_offloaded(call, kv);
        }
        sparse_decode(call, |rows, lo, hi| {
            let Some(ix) = self.layer_index(call, rows, hi)? else {
                return Ok((vec![HeadPick::plain((lo..hi).collect()); call.q.dim(0)?], 0.0));
            };
            let queries = query_rows(call)?;
            let groups = queries.len() / rows.kv_heads;
            let mut walked_total = 0;
            let picks = queries
                .iter()
                .enumerate()
                .map(|(h, q)| {
                    let q = &q[0];
                    let kvh = h / groups;
                    let t = &ix.heads[kvh];
                    let (sampled, walked) = ix.retrieve(kvh, q);
                    walked_total += walked;
                    let q_norm = dot(q, q).sqrt().max(f32::MIN_POSITIVE);
                    // Static part: sinks and everything after the index, weight 1.
                    let mut pick = HeadPick::default();
                    for p in (lo..ix.first.max(lo)).chain(ix.end.max(lo)..hi) {
                        pick.pos.push(p);
                        pick.bias.push(0.0);
                    }
                    for i in sampled {
                        let p = ix.first + i;
                        if p < lo {
                            continue;
                        }
                        pick.pos.push(p);
                        pick.bias.push(ix.logit_bias(t, q, q_norm, i, rows.key(kvh, p)));
                    }
                    pick
                })
                .collect();
            // Index entries are 4 bytes; a bf16 key row is 2·d.
            let searched = walked_total as f64 * 4.0 / (2 * rows.head_dim) as f64 / queries.len() as f64;
            Ok((picks, searched))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn rand_vec(rng: &mut StdRng, d: usize) -> Vec<f32> {
        (0..d).map(|_| normal(rng)).collect()
    }

    /// The stable form equals the textbook one where the latter is accurate, and the
    /// budget rule inverts it.
    #[test]
    fn sampling_probability_matches_the_binomial_tail() {
        for (p, k, l) in [(0.9, 10, 150), (0.7, 4, 20), (0.5, 1, 3), (0.99, 8, 75)] {
            let big_p = f64::powi(p, k as i32);
            let naive = 1.0 - (1.0 - big_p).powi(l as i32) - l as f64 * big_p * (1.0 - big_p).powi(l as i32 - 1);
            let got = sampling_probability(p, k, l);
            assert!((got - naive).abs() < 1e-12, "{p} {k} {l}: {got} vs {naive}");
        }
        // Tiny P: the naive form cancels to 0 in f64, the stable one keeps (L choose 2) P².
        let tiny = sampling_probability(0.1, 10, 150);
        let expect = 150.0 * 149.0 / 2.0 * 1e-20;
        assert!((tiny / expect - 1.0).abs() < 1e-6, "{tiny} vs {expect}");
        let (k, l) = tables_for(0.02, 10);
        assert_eq!(k, 10);
        assert!(sampling_probability(0.5, k, l) >= 0.02 && sampling_probability(0.5, k, l - 1) < 0.02);
        // Out of reach at K = 10 within MAX_TABLES: K comes down.
        assert!(tables_for(0.6, 10).0 < 10);
    }

    /// Built from chunks of any size (as an offloaded layer is read, boundaries inside and
    /// outside the indexed range), the index is the one built from the whole layer.
    #[test]
    fn chunked_build_equals_whole() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let (kv_heads, len, d, first, end) = (2, 500, 16, 7, 431);
        let k: Vec<f32> = (0..kv_heads * len * d).map(|_| normal(&mut rng)).collect();
        let rows = LayerRows { k: k.clone(), v: vec![0.0; k.len()], kv_heads, len, head_dim: d };
        let whole = LayerIndex::build(&rows, first, end, 4, 6, seed).unwrap();
        let cuts = [0, 3, 100, 101, 257, 431, 499, 500];
        let chunks = |f: &mut dyn FnMut(usize, &[f32], usize)| -> Result<()> {
            for w in cuts.windows(2) {
                let (a, b) = (w[0], w[1]);
                let part: Vec<f32> =
                    (0..kv_heads).flat_map(|h| k[(h * len + a) * d..(h * len + b) * d].to_vec()).collect();
                f(a, &part, b - a);
            }
            Ok(())
        };
        let parts = LayerIndex::build_chunked((kv_heads, d), first, end, (4, 6, seed), &chunks).unwrap();
        assert_eq!((parts.first, parts.end, &parts.w), (whole.first, whole.end, &whole.w));
        for (a, b) in parts.heads.iter().zip(&whole.heads) {
            assert!(a.mean == b.mean && a.norms == b.norms, "seed {seed}");
            assert!(a.order == b.order && a.start == b.start, "seed {seed}");
        }
        // Chunks that miss some of the range are an error, not a short index.
        let short = |f: &mut dyn FnMut(usize, &[f32], usize)| -> Result<()> {
            f(0, &k[..kv_heads * 100 * d], 100);
            Ok(())
        };
        assert!(LayerIndex::build_chunked((kv_heads, d), first, end, (4, 6, seed), &short).is_err());
        // As many keys as needed, but not in order: an error too.
        let shuffled = |f: &mut dyn FnMut(usize, &[f32], usize)| -> Result<()> {
            let part = |a: usize, b: usize| -> Vec<f32> {
                (0..kv_heads).flat_map(|h| k[(h * len + a) * d..(h * len + b) * d].to_vec()).collect()
            };
            f(250, &part(250, 500), 250);
            f(0, &part(0, 250), 250);
            Ok(())
        };
        assert!(LayerIndex::build_chunked((kv_heads, d), first, end, (4, 6, seed), &shuffled).is_err());
    }

    /// Retrieval returns exactly the keys whose codes match the query's in ≥ 2 tables, each
    /// once, and the bucket lists are permutations with every member in its bucket.
    #[test]
    fn retrieval_equals_brute_force_collision_counting() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let (d, n, heads) = (16, 700, 2);
        let k: Vec<f32> = (0..heads * n * d).map(|_| normal(&mut rng) + 0.8).collect();
        let rows = LayerRows { k: k.clone(), v: k, kv_heads: heads, len: n, head_dim: d };
        let (first, end, bits, tables) = (3, n - 20, 4, 12);
        let ix = LayerIndex::build(&rows, first, end, bits, tables, seed).unwrap();
        for h in 0..heads {
            let t = &ix.heads[h];
            for l in 0..tables {
                let mut seen = t.order[l].clone();
                seen.sort_unstable();
                assert!(seen.iter().enumerate().all(|(i, &x)| i as u32 == x), "table {l} is not a permutation");
                for b in 0..1usize << bits {
                    for &i in &t.order[l][t.start[l][b] as usize..t.start[l][b + 1] as usize] {
                        let c: Vec<f32> =
                            rows.key(h, first + i as usize).iter().zip(&t.mean).map(|(a, m)| a - m).collect();
                        assert_eq!(codes(&c, &ix.w, bits, tables)[l] as usize, b);
                    }
                }
            }
            for _ in 0..5 {
                let q = rand_vec(&mut rng, d);
                let (mut got, _) = ix.retrieve(h, &q);
                got.sort_unstable();
                let qc = codes(&q, &ix.w, bits, tables);
                let want: Vec<usize> = (0..end - first)
                    .filter(|&i| {
                        let c: Vec<f32> = rows.key(h, first + i).iter().zip(&t.mean).map(|(a, m)| a - m).collect();
                        codes(&c, &ix.w, bits, tables).iter().zip(&qc).filter(|(a, b)| a == b).count() >= 2
                    })
                    .collect();
                assert_eq!(got, want, "seed {seed}");
            }
        }
    }

    /// A key's inclusion rate over fresh projections matches u = P[Bin(L, p^K) ≥ 2], and one
    /// table's collision rate matches (1 - θ/π)^K.
    #[test]
    fn sampling_probability_matches_monte_carlo() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let (d, bits, tables, draws) = (8, 3, 6, 20_000);
        let q = rand_vec(&mut rng, d);
        for _ in 0..3 {
            // A key at a random angle to q.
            let mix: f32 = rng.random_range(-0.5..1.5);
            let k: Vec<f32> = q.iter().zip(rand_vec(&mut rng, d)).map(|(a, b)| mix * a + b).collect();
            let cos = dot(&q, &k) as f64 / (dot(&q, &q) as f64 * dot(&k, &k) as f64).sqrt();
            let p = collision_probability(cos);
            let (mut sampled, mut first_table) = (0, 0);
            for _ in 0..draws {
                let w = projection(d, bits * tables, rng.random());
                let (cq, ck) = (codes(&q, &w, bits, tables), codes(&k, &w, bits, tables));
                let hits = cq.iter().zip(&ck).filter(|(a, b)| a == b).count();
                sampled += usize::from(hits >= 2);
                first_table += usize::from(cq[0] == ck[0]);
            }
            let tol = |x: f64| 4.0 * (x * (1.0 - x) / draws as f64).sqrt() + 1e-3;
            let u = sampling_probability(p, bits, tables);
            let rate = sampled as f64 / draws as f64;
            assert!((rate - u).abs() < tol(u), "seed {seed}: cos {cos:.3}: sampled {rate} vs u {u}");
            let one = p.powi(bits as i32);
            let rate1 = first_table as f64 / draws as f64;
            assert!((rate1 - one).abs() < tol(one), "seed {seed}: one table {rate1} vs {one}");
        }
    }
}
