//! MagicPIG (the paper is named in [`SPEC`]): attention as an expectation, estimated by
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
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use folio_kernels::attention::{merge, AttnOutput};
use folio_kernels::select::{self, lsh, HostRows};
use folio_kernels::sparse;
use rayon::prelude::*;

use super::cost::{CostInput, StepCost};
use super::fast;
use super::method::Tiers;
use super::method::{budgeted, Budgeted};
use super::select::{dot, index_base, query_rows, sparse_decode, visible, HeadPick, IndexSource, Indexes, LayerRows};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Dense, Drawn, Knobs, MethodSpec, Needs, ParamSpec, Params,
    Path, Read,
};
use crate::error::{Error, Result};
use crate::kv::KvStore;
use crate::profile::{self, span};
use crate::tier::DecodeTier;
use index::{LayerIndex, OnDevice, Plan, BIAS_TABLE_STEPS, INDEX_CHUNK};

mod index;

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "magicpig",
    summary: "LSH sampling: SimHash tables pick keys, importance-weighted attention over the sample, the CPU and GPU sharing it",
    paper: "Chen et al., MagicPIG: LSH Sampling for Efficient LLM Generation (ICLR 2025)",
    default_budget: Some(DefaultBudget {
        budget: "1%",
        source: "the paper's main setting, K = 10 and L = 150, expects 0.97% of the keys under uniform buckets \
                 (Eq. 21; 2% measured on real keys, Table 8): 1% gives K = 10, L = 153",
    }),
    params: &PARAMS,
    needs: Needs {
        calibration: false,
        index: Some("SimHash tables of the context's keys (L tables of 2^K buckets per KV head)"),
    },
    tiers: Tiers {
        resident: Path::Reference(
            "MagicPIG attends its sample on the CPU from host memory, as its paper does: that split needs the \
             rows there (the offloaded tier); on the resident tier the reference runs",
        ),
        offloaded: Path::Fast,
    },
    cost,
    build: budgeted::<MagicPig>,
};

/// The dense layers read every row over the link; the others gather their static part (sinks
/// and window) per query head on the device, walk each query head's tables (each table's
/// bucket run, 2 bytes a member) and read its sample: with `gpu=0` both in host memory by the
/// CPU, with `gpu=1` the walk over the link (the keys' norms kept on the device) and the sampled
/// rows of the `gpu_attend` share of heads over the link too, the rest's in host memory by the
/// CPU — counted so even where a step falls back to the CPU: a CPU device, fp8 rows.
fn cost(input: &CostInput<'_>) -> StepCost {
    let layers = input.shape.layers;
    // `dense_layers=1` keeps layers 0 and L/2 dense.
    let dense = if input.params.usize("dense_layers") == 1 { 2.min(layers) } else { 0 };
    let sparse = (layers - dense) as f64;
    let picked = input.params.usize("sinks") + input.params.usize("window");
    let (heads, kv_heads) = (input.shape.heads, input.shape.kv_heads);
    let link = dense as f64 * input.rows(input.context, kv_heads) + sparse * input.rows(picked, heads);
    let resident = input.rows(picked, heads) as u64;
    let sample = |heads: usize| sparse * input.rows(input.budget, heads);
    let indexed = input.context.saturating_sub(picked).max(1);
    let (bits, tables) = match input.params.usize("tables") {
        0 => tables_for(input.budget as f64 / indexed as f64, input.params.usize("bits")),
        l => (input.params.usize("bits"), l),
    };
    let walked = sparse * (heads * tables) as f64 * (indexed >> bits) as f64 * ENTRY_BYTES;
    if input.params.usize("gpu") == 0 {
        let host_bytes = sample(heads) + walked;
        return StepCost { device_bytes: 0.0, link_bytes: link, host_bytes, resident_bytes: resident };
    }
    let on_gpu = gpu_heads(input.params.get("gpu_attend"), heads);
    let norms = 4 * indexed as u64 * kv_heads as u64 * (layers - dense) as u64;
    StepCost {
        device_bytes: 0.0,
        link_bytes: link + sample(on_gpu) + walked,
        host_bytes: sample(heads - on_gpu),
        resident_bytes: resident + norms,
    }
}

/// Query heads whose sample the GPU attends (a layer's first), of `heads`, for a `gpu_attend`
/// share: the nearest whole number. By query head, not KV head: the 7B shape's 4 KV heads
/// would split a step only in quarters, too coarse to balance the two sides.
fn gpu_heads(share: f64, heads: usize) -> usize {
    ((share.clamp(0.0, 1.0) * heads as f64).round() as usize).min(heads)
}

const PARAMS: [ParamSpec; 9] = [
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
    super::params::RECENT_WINDOW,
    ParamSpec {
        name: "dense_layers",
        default: 1.0,
        min: 0.0,
        max: 1.0,
        integer: true,
        doc: "1: layers 0 and L/2 attend densely (the paper's {0, 16}); 0: none",
    },
    ParamSpec { name: "seed", default: 0.0, min: 0.0, max: 4_294_967_295.0, integer: true, doc: "projection seed" },
    ParamSpec {
        name: "gpu",
        default: 1.0,
        min: 0.0,
        max: 1.0,
        integer: true,
        doc: "1: a GPU takes the queries' codes, walks the tables over the host link and attends the \
              gpu_attend share of the sample, the CPU the rest in host memory (0: the CPU walks and attends \
              everything, as the paper splits it; a CPU device always does)",
    },
    ParamSpec {
        name: "gpu_attend",
        default: GPU_ATTEND,
        min: 0.0,
        max: 1.0,
        integer: false,
        doc: "with gpu=1, the share of query heads whose sample the GPU attends over the host link, to whole \
              heads; the CPU attends the rest's in host memory at the same time (1: all, 0: none); with \
              balance=1 where the split starts",
    },
    ParamSpec {
        name: "balance",
        default: 0.0,
        min: 0.0,
        max: 1.0,
        integer: true,
        doc: "with gpu=1 and both sides attending, 1: the split moves a query head at a time toward the side \
              that finishes first, to this machine's even point; 0: gpu_attend stays",
    },
];

/// The share of query heads whose sample the GPU attends (`gpu_attend`; with `balance=1`
/// where the split starts): 18 of the 7B shape's 28 heads on the H100 machine at 1M. Since
/// the GPU's warps read a head's picks strided (lsh.cu), its share reads ~1.9x faster, and the
/// best split moved from 14 heads to 18–20: 55.4 (14), 53.0 (16), 48.9 (18) on one host,
/// 48.0 (20) and 56.6 (22) on another (docs/performance.md). With the CPU's heads walked
/// first, 18 measured 44.8, 53.2 and 50.6 on three hosts; on the second, 20 heads 48.3 and
/// 16 heads 53.3. 18, not 20: one host favours 20, and 22 fell off where the GPU's side
/// became the longer; the next sweep decides.
const GPU_ATTEND: f64 = 0.64;

/// Bytes of a bucket-list entry walked (a 16-bit key offset), for the `searched` figure in
/// key-row equivalents (a bf16 key row is 2·d bytes).
const ENTRY_BYTES: f64 = 2.0;

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

pub struct MagicPig {
    budget: Budget,
    params: Params,
    index: Indexes<LayerIndex>,
    balance: Mutex<Balance>,
}

/// Where the split of the sample between the GPU and the CPU stands (`balance=1`): the query
/// heads the GPU attends, and the layers' votes since it last moved.
///
/// Why it moves: the two sides run at once, so a step waits for the slower, and which is
/// slower is the machine's: the CPU's share took 19.6 to 32.9 ms a step on five hosts of the
/// same H100 machine (host memory read at 59 to 89 GB/s), and a consumer PC's link is half an
/// H100's. Each layer votes for the side that finished first (the GPU's part done when the
/// CPU's is: one more head to the GPU; not done: one fewer); a net [`BALANCE_VOTES`] moves the
/// split a head, so it settles within a few steps and then dithers by a head at most.
/// Rejected: timing both sides and solving for the even point — the GPU's time needs a
/// synchronising event per layer, and the ratio drifts with what else the machine does anyway.
///
/// Off by default: at 1M (docs/performance.md) it settled at 13 of 28 heads and took 57.25 ms
/// a token between two runs of the fixed split it started from (14 heads), 54.04 and 54.13, in
/// one command (an A-B-A order: a bench's first method pays nothing the later ones do not).
/// That was before the GPU's reads were strided; from today's 18 heads it is not yet measured.
#[derive(Debug, Default)]
struct Balance {
    on_gpu: Option<usize>,
    votes: i64,
}

/// Net votes of the layers (one a layer, for the side that finished first) that move the split
/// a query head: about a 28-layer step's worth, so that one slow layer does not move it.
const BALANCE_VOTES: i64 = 16;

impl Balance {
    /// The GPU's heads of `heads` for this layer: where the split stands, else `start`.
    fn on_gpu(&mut self, heads: usize, start: usize) -> usize {
        (*self.on_gpu.get_or_insert(start)).min(heads)
    }

    /// A layer's vote, with `heads` query heads: the GPU finished first or not. The split stays
    /// within 1..heads − 1, each side a head at least, so that either can still vote.
    fn vote(&mut self, heads: usize, gpu_first: bool) {
        self.votes += if gpu_first { 1 } else { -1 };
        if self.votes.abs() >= BALANCE_VOTES {
            let at = self.on_gpu.unwrap_or(heads / 2);
            let moved = if self.votes > 0 { at + 1 } else { at.saturating_sub(1) };
            self.on_gpu = Some(moved.clamp(1, heads.saturating_sub(1).max(1)));
            self.votes = 0;
        }
    }
}

impl Budgeted for MagicPig {
    fn new(budget: Budget, params: Params) -> Result<Self> {
        if params.usize("tables") == 1 {
            return Err(Error::Invalid(
                "magicpig samples keys that collide in at least 2 tables: give tables=0 (from the budget) or 2..=1024"
                    .into(),
            ));
        }
        Ok(Self { budget, params, index: Indexes::new(), balance: Mutex::default() })
    }
}

impl MagicPig {
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
        self.layer_index_with(call, hi, (rows.kv_heads, rows.head_dim), |plan| LayerIndex::build(rows, plan))
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
    /// A decode step over the offloaded tier: the GPU attends the static part (sinks, window,
    /// the tokens after the saved prefix) while the sample is drawn and attended — as the paper
    /// splits it, by the CPU straight from host memory ([`Self::sample_on_host`], `gpu=0`), or
    /// by default walked by the GPU and attended by both ([`Self::sample_on_device`]; rows the
    /// kernels do not read, fp8, stay on the CPU); the partials merge by LSE.
    fn attend_fast(
        &self,
        call: &AttnCall<'_>,
        kv: &dyn DecodeTier,
        (keys, values): (&HostRows, &HostRows),
    ) -> Result<Attended> {
        let (lo, hi) = visible(call);
        // Stored tables, else built once from the layer's saved keys: means and norms from host
        // memory, codes on the device a chunk at a time.
        let ix = self.layer_index_with(call, hi, (kv.kv_heads(), kv.head_dim()), |plan| {
            let view = keys.host()?;
            let key = |h: usize, p: usize, out: &mut [f32]| view.row(h, p, out);
            let chunk = |a: usize, b: usize| kv.keys(call.kv_layer, a, b);
            LayerIndex::build_with((kv.kv_heads(), kv.head_dim()), plan, &key, &chunk, (INDEX_CHUNK, kv.device()))
        })?;
        let Some(ix) = ix else {
            // Every token static: exact attention over the visible keys.
            return Dense.attend(call);
        };
        let queries = query_rows(call)?;
        let (heads, d) = (queries.len(), kv.head_dim());
        let q_flat: Vec<f32> = queries.iter().flat_map(|q| q[0].iter().copied()).collect();
        // The static part on the device, every head the same positions: queued first, so the
        // GPU attends it while the sample is drawn.
        let mut statics: Vec<u32> = (lo..ix.first.max(lo)).chain(ix.end.max(lo)..hi).map(|p| p as u32).collect();
        let idx = Tensor::from_vec(statics.repeat(heads), (heads, statics.len()), call.q.device())?;
        let (out_g, lse_g) = fast::selected_partial(call, kv, &idx, None)?;
        let dev = call.q.device();
        let on_device = if dev.is_cuda() && self.params.usize("gpu") == 1 && lsh::reads(keys, values) {
            ix.on_device(dev)?
        } else {
            None
        };
        let (sampled_part, drawn, walked) = match on_device {
            Some(on) => {
                let q_dev = call.q.to_dtype(candle_core::DType::F32)?.reshape((heads, d))?;
                let start = gpu_heads(self.params.get("gpu_attend"), heads);
                let balancing = self.params.usize("balance") == 1;
                let lock = || self.balance.lock().unwrap_or_else(|e| e.into_inner());
                let on_gpu = if balancing { lock().on_gpu(heads, start) } else { start };
                // Spans that synchronise run the two sides in turn: no vote then.
                let vote = balancing && !profile::synchronising();
                let (part, drawn, walked, gpu_first) = Self::sample_on_device(
                    &ix,
                    &on,
                    (&q_dev, &q_flat, d),
                    (keys, values),
                    lo,
                    call.scale,
                    (on_gpu, vote),
                )?;
                if let Some(first) = gpu_first {
                    lock().vote(heads, first);
                }
                (part, drawn, walked)
            }
            None => Self::sample_on_host(&ix, (&q_flat, d), (keys, values), lo, call.scale, dev)?,
        };
        // What each head read (the harness's report), joined only if asked: the sample lies
        // between the sinks and the window.
        let at = statics.partition_point(|&p| (p as usize) < ix.first);
        let after = statics.split_off(at);
        let read = Read::Sampled { before: statics, picks: drawn, after };
        let static_part = AttnOutput { out: out_g.unsqueeze(1)?, lse: lse_g.unsqueeze(1)? };
        let out = merge(&static_part, &sampled_part)?.out.to_dtype(call.q.dtype())?;
        let searched = walked as f64 * ENTRY_BYTES / (2 * d) as f64 / heads as f64;
        Ok(Attended { out, read, searched })
    }

    /// The sample on the CPU, as the paper draws it: per query head, in up to WALK_PARTS ranges
    /// of segments, walk the tables, keep the visible keys, and attend them at once from host
    /// memory while they are this core's (each pick's stored norm for its weight, gathered in
    /// the walk). One task a (head, range), so that the heads end together on the cores (28
    /// whole heads were two rounds on 16 cores, the second a quarter idle) and the walk and the
    /// attention share a round of the pool; a range's picks are attended ATTEND_ROWS_PER_TASK
    /// at a time as tasks of their own, which idle cores take, so that a range holding most of
    /// its head's sample (attention clusters) does not end the round alone. The parts join by
    /// LSE. Returns the partial on `dev`, each head's picks, and the entries walked.
    fn sample_on_host(
        ix: &LayerIndex,
        (q_flat, d): (&[f32], usize),
        (keys, values): (&HostRows, &HostRows),
        lo: usize,
        scale: f32,
        dev: &candle_core::Device,
    ) -> Result<(AttnOutput, Drawn, usize)> {
        let heads = q_flat.len() / d;
        let groups = heads / ix.heads.len();
        let (kh, vh) = (keys.host()?, values.host()?);
        let sampled = span(dev, "attention: sample", || {
            on_cpu_pool(|| {
                let codes: Vec<Vec<u32>> =
                    (0..heads).into_par_iter().map(|h| ix.query_codes(&q_flat[h * d..(h + 1) * d])).collect();
                let q_of = |h: usize| &q_flat[h * d..(h + 1) * d];
                let weights: Vec<(f32, f32)> = (0..heads).map(|h| ix.query_weights(h / groups, q_of(h))).collect();
                let (segs, parts) = (ix.segments(), WALK_PARTS.min(ix.segments()));
                let tasks: Vec<(usize, Range<usize>)> = (0..heads)
                    .flat_map(|h| (0..parts).map(move |p| (h, p * segs / parts..(p + 1) * segs / parts)))
                    .collect();
                let done = tasks
                    .into_par_iter()
                    .map(|(h, range)| {
                        let started = Instant::now();
                        let (found, walked) = ix.retrieve_segments(h / groups, &codes[h], range);
                        let norms = &ix.heads[h / groups].norms;
                        let (mut pick, mut picked_norms) = (Vec::with_capacity(found.len()), Vec::new());
                        for i in found.into_iter().filter(|&i| ix.first + i >= lo) {
                            pick.push((ix.first + i) as u32);
                            picked_norms.push(norms[i]);
                        }
                        let walk = started.elapsed();
                        let attended = pick
                            .par_chunks(ATTEND_ROWS_PER_TASK)
                            .enumerate()
                            .map(|(c, rows)| {
                                let started = Instant::now();
                                let norms = &picked_norms[c * ATTEND_ROWS_PER_TASK..];
                                let query = (q_of(h), weights[h]);
                                let part = attend_picked(ix, query, (&kh, &vh), h / groups, (rows, norms), scale)?;
                                Ok((part, started.elapsed()))
                            })
                            .collect::<Result<Vec<_>>>()?;
                        Ok((h, pick, attended, walked, walk))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut s = Sampled {
                    picks: vec![Vec::new(); heads],
                    threads: rayon::current_num_threads(),
                    ..Default::default()
                };
                let mut partials = Vec::new();
                for (h, pick, attended, walked, walk) in done {
                    s.picks[h].extend(pick);
                    s.walked += walked;
                    s.walking += walk;
                    for (part, took) in attended {
                        partials.push((h, part));
                        s.attending += took;
                    }
                }
                (s.out, s.lse) = select::merge_partials(heads, d, partials);
                Ok(s)
            })
        })?;
        // The span's split between the walk and the attention, as the pool's threads spent it.
        let threads = sampled.threads.max(1) as u32;
        profile::charge("attention: sample: walk (CPU time / threads)", sampled.walking / threads);
        profile::charge("attention: sample: attend (CPU time / threads)", sampled.attending / threads);
        let Sampled { picks, out, lse, walked, .. } = sampled;
        let (out, lse) = partial_to(dev, out, lse)?;
        let part = AttnOutput { out: out.unsqueeze(1)?, lse: lse.unsqueeze(1)? };
        Ok((part, Drawn::Host(picks), walked))
    }

    /// The sample walked on the GPU ([`lsh`]): the queries' codes from the projection on the
    /// device; one launch walks the CPU's heads' tables where they lie and one more writes what
    /// the host needs (the codes, for the walked count, and those heads' picks, a few hundred
    /// KB a layer) into host memory, so that the host starts while a third launch walks the
    /// GPU's heads' tables; then the first `on_gpu` query heads are attended by the
    /// GPU, reading their rows over the host link, while the CPU attends the others' in host
    /// memory — both sides at once, each at its own memory's rate: the walk is the GPU's
    /// strength (~9 ms a step at 1M against the CPU pool's 23); scattered rows both read at
    /// ~20–30 GB/s, the host in its own memory, the GPU over the link. The host waits for the
    /// CPU's heads' walk and their report alone: the GPU's walk of its own heads and its
    /// attention are queued behind them before the host waits (walking every head first made
    /// the host wait ~4 ms a step longer: 54.1 against 44.8 ms a token, docs/performance.md).
    /// With `vote`, also whether the GPU's part was done when the CPU's was (for the balance;
    /// `None` without both parts). The same keys as [`Self::sample_on_host`], the same weights.
    fn sample_on_device(
        ix: &LayerIndex,
        on: &OnDevice,
        (q_dev, q_flat, d): (&Tensor, &[f32], usize),
        (keys, values): (&HostRows, &HostRows),
        lo: usize,
        scale: f32,
        (on_gpu, vote): (usize, bool),
    ) -> Result<(AttnOutput, Drawn, usize, Option<bool>)> {
        let heads = q_flat.len() / d;
        let groups = heads / ix.heads.len();
        let dev = on.weights.device();
        let q_of = |h: usize| &q_flat[h * d..(h + 1) * d];
        let weights: Vec<(f32, f32)> = (0..heads).map(|h| ix.query_weights(h / groups, q_of(h))).collect();
        // The GPU's heads' queries uploaded before the walk, not between the report and the
        // attention, where a copy from pageable memory could wait on the walk.
        let gpu_query = match on_gpu {
            0 => None,
            _ => {
                let query: Vec<f32> =
                    (0..on_gpu).flat_map(|h| q_of(h).iter().copied().chain([weights[h].0, weights[h].1])).collect();
                Some(Tensor::from_vec(query, (on_gpu, d + 2), dev)?)
            }
        };
        let keys_walked = (ix.first, lo.saturating_sub(ix.first));
        let (gpu_sample, report) = span(dev, "attention: sample: walk (GPU)", || {
            let codes = sparse::simhash_codes(q_dev, &on.projection, ix.bits, ix.tables)?;
            // The CPU's heads walked and reported first, so that the host starts on them while
            // the GPU walks its own; the report carries the codes (for the walked count).
            let host_report = match on_gpu < heads {
                true => Some(
                    on.tables
                        .walk(&codes, groups, on_gpu..heads, keys_walked)?
                        .report(0..heads - on_gpu, Some(&codes))?,
                ),
                false => None,
            };
            let gpu_sample = match on_gpu {
                0 => None,
                _ => Some(on.tables.walk(&codes, groups, 0..on_gpu, keys_walked)?),
            };
            let report = match (host_report, &gpu_sample) {
                (Some(report), _) => report,
                // Every head on the GPU: a report of none of its heads, for the codes.
                (None, Some(sample)) => sample.report(0..0, Some(&codes))?,
                (None, None) => return Err(Error::Invalid("magicpig: a layer of no query heads".into())),
            };
            Ok((gpu_sample, report))
        })?;
        let device_part = match (&gpu_query, &gpu_sample) {
            (Some(query), Some(sample)) => Some(span(dev, "attention: sample: attend (GPU)", || {
                let n = ix.end - ix.first;
                let w = lsh::Weights { table_and_norms: &on.weights, steps: BIAS_TABLE_STEPS, first: ix.first, n };
                let part = lsh::attend(query, sample, (keys, values), &w, scale)?;
                let done = vote.then(|| folio_kernels::device::Queued::now(dev)).transpose()?;
                Ok((part, done))
            })?),
            _ => None,
        };
        let (picks, codes) = span(dev, "attention: sample: picks to the host", || Ok(report.wait()?))?;
        let walked = codes.chunks(ix.tables).enumerate().map(|(h, c)| ix.walked(h / groups, c)).sum();
        let (host_part, gpu_first) = if on_gpu == heads {
            (None, None)
        } else {
            let (kh, vh) = (keys.host()?, values.host()?);
            let (out, lse) = span(dev, "attention: sample: attend (CPU)", || {
                on_cpu_pool(|| {
                    let rows: usize = picks.iter().map(Vec::len).sum();
                    let chunk =
                        rows.div_ceil(ATTEND_ROUNDS * rayon::current_num_threads()).clamp(1, ATTEND_ROWS_PER_TASK);
                    let tasks: Vec<(usize, &[u32])> = picks
                        .iter()
                        .enumerate()
                        .flat_map(|(i, p)| p.chunks(chunk).map(move |rows| (on_gpu + i, rows)))
                        .collect();
                    let parts = tasks
                        .into_par_iter()
                        .map(|(h, rows)| {
                            let kvh = h / groups;
                            // Gathered first, as the CPU's walk gathers them: independent
                            // loads in flight together, none in a row's chain of waits.
                            let norms: Vec<f32> =
                                rows.iter().map(|&p| ix.heads[kvh].norms[p as usize - ix.first]).collect();
                            let query = (q_of(h), weights[h]);
                            Ok((h - on_gpu, attend_picked(ix, query, (&kh, &vh), kvh, (rows, &norms), scale)?))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ok(select::merge_partials(heads - on_gpu, d, parts))
                })
            })?;
            // Whether the GPU's part was done when the CPU's was: the side that finished first.
            let gpu_first = device_part.as_ref().and_then(|(_, done)| done.as_ref()).map(|d| d.done()).transpose()?;
            (Some(partial_to(dev, out, lse)?), gpu_first)
        };
        // The GPU's heads first, then the CPU's: the heads' order.
        let (outs, lses): (Vec<Tensor>, Vec<Tensor>) =
            device_part.map(|(part, _)| part).into_iter().chain(host_part).unzip();
        let part = AttnOutput { out: Tensor::cat(&outs, 0)?.unsqueeze(1)?, lse: Tensor::cat(&lses, 0)?.unsqueeze(1)? };
        Ok((part, Drawn::Device { first: gpu_sample, rest: picks }, walked, gpu_first))
    }
}

/// The CPU's attention over picked `rows` of KV head `kvh` for `query` (`q`, then `|q|` and
/// `q·mean` of the head's keys, [`LayerIndex::query_weights`]), each row weighted by the bias
/// of its cosine from its centred norm in `norms` (one per row).
fn attend_picked(
    ix: &LayerIndex,
    (q, (q_norm, q_mean)): (&[f32], (f32, f32)),
    rows_kv: (&select::HostView<'_>, &select::HostView<'_>),
    kvh: usize,
    (rows, norms): (&[u32], &[f32]),
    scale: f32,
) -> Result<select::Partial> {
    let bias = |j: usize, qk: f32| ix.logit_bias_from_dot((qk, q_mean), q_norm, norms[j]);
    Ok(select::attend_partial(q, rows_kv, kvh, rows, scale, &bias)?)
}

/// The CPU's partial (`out [heads·d]`, `lse [heads]`) on `dev` as `[heads, d]` and `[heads]`,
/// in one copy (each copy from pageable memory waits for itself).
fn partial_to(dev: &candle_core::Device, out: Vec<f32>, lse: Vec<f32>) -> Result<(Tensor, Tensor)> {
    let heads = lse.len();
    let d = out.len() / heads.max(1);
    let both = Tensor::from_vec([out, lse].concat(), heads * (d + 1), dev)?;
    Ok((both.narrow(0, 0, heads * d)?.reshape((heads, d))?, both.narrow(0, heads * d, heads)?))
}

/// Parts (ranges of key segments) each query head's table walk is split into on the CPU pool.
const WALK_PARTS: usize = 4;

/// Picked rows attended per task: a walk part's picks are split into tasks of this many, so
/// that the cores finish together however the sample falls across the parts (~500 picks a part
/// at a 2048-token budget; ~2,500 at 1% of a million keys).
const ATTEND_ROWS_PER_TASK: usize = 512;

/// Rounds of the CPU pool a sample walked on the GPU is attended in: its rows split into
/// `ATTEND_ROUNDS × threads` tasks (at most [`ATTEND_ROWS_PER_TASK`] each), so that the cores
/// end within a task of one another.
const ATTEND_ROUNDS: usize = 4;

/// What the CPU's side of a step found and computed: each query head's sample (ascending), its
/// attention over it (`out [heads·d]`, `lse [heads]`), the index entries walked, and the time
/// the pool's `threads` spent walking and attending (summed over tasks).
#[derive(Default)]
struct Sampled {
    picks: Vec<Vec<u32>>,
    out: Vec<f32>,
    lse: Vec<f32>,
    walked: usize,
    walking: Duration,
    attending: Duration,
    threads: usize,
}

/// Threads of MagicPIG's CPU pool: [`HOST_THREADS_VAR`] when set to a positive number, else one
/// per physical core within the CPUs this process may use (a container's quota) — the paper's
/// CPU side is bound by memory bandwidth and FP units, which hyperthreads share. The variable
/// is there to measure the other choice: the walk and the sample's scattered rows wait on DRAM
/// more than they compute, which a second thread per core may hide.
pub fn cpu_pool_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var(HOST_THREADS_VAR)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| num_cpus::get_physical().min(num_cpus::get()).max(1))
    })
}

/// The environment variable that sets [`cpu_pool_threads`].
const HOST_THREADS_VAR: &str = "FOLIO_HOST_THREADS";

/// Runs `f` on MagicPIG's CPU pool ([`cpu_pool_threads`] threads), apart from the global pool
/// the rest of the engine uses. Should the pool fail to start, the global one runs it.
fn on_cpu_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cpu_pool_threads())
            .thread_name(|i| format!("folio-magicpig-{i}"))
            .build()
            .ok()
    });
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

impl Attention for MagicPig {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    /// Where the balance has moved the split (`gpu_heads`, the query heads the GPU attends),
    /// once a step has split the sample with `balance=1`.
    fn learned(&self) -> Option<serde_json::Value> {
        let on_gpu = self.balance.lock().unwrap_or_else(|e| e.into_inner()).on_gpu?;
        Some(serde_json::json!({ "gpu_heads": on_gpu }))
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
        let ix = LayerIndex::build(&rows, &plan)?;
        Ok(Some((plan.name(), ix.encode())))
    }

    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        self.index.sources()
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        if self.dense_layer(call.layer, call.layers) {
            return Dense.attend(call);
        }
        // The paper's split needs the saved rows in host memory, where the CPU attends the
        // sample: the offloaded tier. Elsewhere the reference runs.
        if let (Some(kv), 1) = (call.kv.tier(), call.q.dim(1)?) {
            if let Some(host) = kv.host_rows(call.kv_layer) {
                return self.attend_fast(call, &*kv, host);
            }
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
            let searched = walked_total as f64 * ENTRY_BYTES / (2 * rows.head_dim) as f64 / queries.len() as f64;
            Ok((picks, searched))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::index::{bias_of_cos, build_bytes, check_host_memory, projection, BiasTable, BIAS_TABLE_ERROR};
    use super::*;
    use crate::attention::workload::normal;
    use candle_core::Device;
    use folio_kernels::sparse;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut StdRng, d: usize) -> Vec<f32> {
        (0..d).map(|_| normal(rng)).collect()
    }

    /// The split starts where it is given, moves a head only on a net BALANCE_VOTES layers'
    /// votes for one side (mixed votes cancel), and keeps a head on each side.
    #[test]
    fn the_balance_moves_toward_the_side_that_finishes_first() {
        let mut b = Balance::default();
        assert_eq!(b.on_gpu(28, 12), 12);
        assert_eq!(b.on_gpu(28, 20), 12, "the start is taken once");
        for i in 0..3 * BALANCE_VOTES {
            b.vote(28, i % 2 == 0);
        }
        assert_eq!(b.on_gpu(28, 12), 12, "mixed votes cancel");
        for _ in 0..BALANCE_VOTES - 1 {
            b.vote(28, true);
        }
        assert_eq!(b.on_gpu(28, 12), 12, "short of a net BALANCE_VOTES");
        b.vote(28, true);
        assert_eq!(b.on_gpu(28, 12), 13);
        for _ in 0..40 * BALANCE_VOTES {
            b.vote(28, true);
        }
        assert_eq!(b.on_gpu(28, 12), 27, "the CPU keeps a head");
        for _ in 0..40 * BALANCE_VOTES {
            b.vote(28, false);
        }
        assert_eq!(b.on_gpu(28, 12), 1, "the GPU keeps a head");
        assert_eq!(b.on_gpu(1, 12), 1, "never more heads than the layer has");
    }

    /// What the balance learns is reported apart from the settings, which stay the method's
    /// identity: a session keeps a method (and its tables) while a fresh one's settings equal it.
    #[test]
    fn the_balanced_split_is_learned_not_a_setting() {
        let given = vec![("balance".to_string(), "1".to_string())];
        let method = || MagicPig::new(Budget::Tokens(64), Params::parse("magicpig", &PARAMS, &given).unwrap()).unwrap();
        let (used, fresh) = (method(), method());
        assert!(used.learned().is_none());
        used.balance.lock().unwrap().on_gpu = Some(13);
        assert_eq!(used.settings(), fresh.settings());
        assert_eq!(used.learned(), Some(serde_json::json!({ "gpu_heads": 13 })));
    }

    /// The GPU's share of the sample goes by query heads, the same in the cost as in a step:
    /// the host bytes are the CPU's heads' rows, the link carries the GPU's.
    #[test]
    fn the_split_goes_by_query_heads() {
        use crate::attention::cost::Shape;
        for (share, heads, want) in
            [(0.0, 28, 0), (0.3, 28, 8), (0.4, 28, 11), (0.5, 28, 14), (1.0, 28, 28), (0.5, 1, 1), (0.4, 1, 0)]
        {
            assert_eq!(gpu_heads(share, heads), want, "{share} of {heads}");
        }
        let shape = Shape { layers: 4, heads: 8, kv_heads: 4, head_dim: 16 };
        let (context, elem, budget) = (1 << 16, 2, 256);
        let cost = |given: &[&str]| {
            let given: Vec<(String, String)> = given
                .iter()
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap();
                    (k.to_string(), v.to_string())
                })
                .collect();
            let params = Params::parse("magicpig", &PARAMS, &given).unwrap();
            cost(&CostInput { shape, context, elem, budget, params: &params })
        };
        // A query head's sample over every layer (all sparse with dense_layers=0): budget rows
        // of K and V.
        let sample_head = (shape.layers * budget * 2 * shape.head_dim * elem) as f64;
        // The CPU split reads every head's sample and walk in host memory, the walk the bytes
        // the GPU's walk brings over the link.
        let cpu = cost(&["gpu=0", "dense_layers=0"]);
        let walk_only = cost(&["dense_layers=0", "gpu_attend=0"]);
        let walk = walk_only.link_bytes - cpu.link_bytes;
        assert!(walk > 0.0 && cpu.host_bytes == 8.0 * sample_head + walk, "{} {walk}", cpu.host_bytes);
        for (share, on_gpu) in [("0.3", 2.0), ("0.4", 3.0), ("0.5", 4.0), ("1", 8.0)] {
            let split = cost(&["dense_layers=0", &format!("gpu_attend={share}")]);
            assert_eq!(split.host_bytes, (8.0 - on_gpu) * sample_head, "gpu_attend={share}");
            assert_eq!(split.link_bytes - walk_only.link_bytes, on_gpu * sample_head, "gpu_attend={share}");
        }
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

    /// The fast path's interpolated bias is within its stated error of the exact one, for the
    /// (K, L) of the budgets from 0.2% to 10% and the paper's, at random cosines and at the
    /// ends (where `acos` is steep); a (K, L) too steep for it has none.
    #[test]
    fn bias_table_is_within_its_error() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut settings: Vec<(usize, usize)> =
            [0.002, 0.01, 0.0156, 0.05, 0.1].iter().map(|&f| tables_for(f, 10)).collect();
        settings.extend([(10, 150), (4, 20), (1, 3), (12, 1024)]);
        for (bits, tables) in settings {
            let Some(table) = BiasTable::new(bits, tables) else {
                // Too steep to interpolate: only a small K may be, never the budgets' K = 10.
                assert!(bits < 10, "K {bits}, L {tables} has no table");
                continue;
            };
            let ends = [-1.0, -0.999_999, 1.0, 0.999_999, 0.0];
            let cosines = ends.into_iter().chain((0..100_000).map(|_| rng.random_range(-1f32..=1.0)));
            let worst =
                cosines.map(|c| (table.get(c) - bias_of_cos(c as f64, bits, tables)).abs()).fold(0f32, f32::max);
            assert!(worst < BIAS_TABLE_ERROR, "seed {seed}: K {bits}, L {tables}: off by {worst}");
        }
        assert!(BiasTable::new(10, 150).unwrap().get(f32::NAN).is_nan());
    }

    /// Codes of one row, as the index computes them.
    fn codes(x: &[f32], w: &[f32], bits: usize, tables: usize) -> Vec<u32> {
        sparse::reference::simhash_codes(x, w, x.len(), bits, tables)
    }

    /// Hashed in chunks of any size (as an offloaded layer is read; boundaries inside and
    /// outside the indexed range), the index is the one built from the whole layer; a chunk of
    /// the wrong shape is an error, not a wrong index.
    #[test]
    fn chunked_build_equals_whole() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let (kv_heads, len, d) = (2, 500, 16);
        let plan = Plan { first: 7, end: 431, bits: 4, tables: 6, seed };
        let k: Vec<f32> = (0..kv_heads * len * d).map(|_| normal(&mut rng)).collect();
        let rows = LayerRows { k: k.clone(), v: vec![0.0; k.len()], kv_heads, len, head_dim: d };
        let whole = LayerIndex::build(&rows, &plan).unwrap();
        let key = |h: usize, p: usize, out: &mut [f32]| out.copy_from_slice(rows.key(h, p));
        let chunk = |a: usize, b: usize| -> Result<Tensor> {
            let part: Vec<f32> = (0..kv_heads).flat_map(|h| k[(h * len + a) * d..(h * len + b) * d].to_vec()).collect();
            Ok(Tensor::from_vec(part, (kv_heads, b - a, d), &Device::Cpu)?)
        };
        for chunk_rows in [1, 37, 100, 424, 1000] {
            let parts = LayerIndex::build_with((kv_heads, d), &plan, &key, &chunk, (chunk_rows, &Device::Cpu)).unwrap();
            assert_eq!((parts.first, parts.end, &parts.w), (whole.first, whole.end, &whole.w));
            for (a, b) in parts.heads.iter().zip(&whole.heads) {
                assert!(a.mean == b.mean && a.norms == b.norms, "seed {seed}");
                assert!(
                    a.members[..] == b.members[..] && a.starts[..] == b.starts[..],
                    "seed {seed}: chunks of {chunk_rows}"
                );
            }
        }
        let short = |a: usize, b: usize| -> Result<Tensor> { chunk(a, b - 1) };
        assert!(LayerIndex::build_with((kv_heads, d), &plan, &key, &short, (100, &Device::Cpu)).is_err());
    }

    /// A build that would not fit in the host memory available is refused with what to change;
    /// one that fits, or where the available memory is unknown, goes ahead.
    #[test]
    fn builds_beyond_host_memory_are_refused() {
        let plan = Plan { first: 4, end: 1 << 20, bits: 10, tables: 150, seed: 0 };
        let needed = build_bytes(4, plan.end - plan.first, plan.bits, plan.tables);
        // 150 tables × 6 bytes per key (4-byte codes, 2-byte bucket lists) × 4 KV heads ≈ 3.6 GiB.
        assert!(needed > 3_800_000_000 && needed < 3_900_000_000, "{needed}");
        let err = check_host_memory(needed, Some(needed - 1), &plan).unwrap_err().to_string();
        assert!(err.contains("150 tables of 10 bits") && err.contains("tables="), "{err}");
        assert!(check_host_memory(needed, Some(needed), &plan).is_ok());
        assert!(check_host_memory(needed, None, &plan).is_ok());
    }

    /// Retrieval returns exactly the keys whose codes match the query's in ≥ 2 tables, each
    /// once and ascending, and the bucket lists are permutations with every member in its bucket — within
    /// one segment of keys and across three (members stored as offsets within 64 Ki keys).
    #[test]
    fn retrieval_equals_brute_force_collision_counting() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        for (d, n, heads) in [(16, 700, 2), (8, 2 * 65_536 + 300, 1)] {
            let k: Vec<f32> = (0..heads * n * d).map(|_| normal(&mut rng) + 0.8).collect();
            let rows = LayerRows { k: k.clone(), v: k, kv_heads: heads, len: n, head_dim: d };
            let (first, end, bits, tables) = (3, n - 20, 4, 12);
            let ix = LayerIndex::build(&rows, &Plan { first, end, bits, tables, seed }).unwrap();
            for h in 0..heads {
                let t = &ix.heads[h];
                let key_codes: Vec<Vec<u32>> = (0..end - first)
                    .map(|i| {
                        let c: Vec<f32> = rows.key(h, first + i).iter().zip(&t.mean).map(|(a, m)| a - m).collect();
                        codes(&c, &ix.w, bits, tables)
                    })
                    .collect();
                (0..tables).for_each(|l| {
                    let mut seen: Vec<usize> = (0..1 << bits).flat_map(|b| t.bucket(l, b)).collect();
                    seen.sort_unstable();
                    assert!(seen.iter().enumerate().all(|(i, &x)| i == x), "table {l} is not a permutation");
                    for b in 0..1u32 << bits {
                        assert!(t.bucket(l, b).all(|i| key_codes[i][l] == b), "seed {seed}: n {n}, table {l}");
                    }
                });
                for _ in 0..5 {
                    let q = rand_vec(&mut rng, d);
                    // Ascending, as the fast path reads them.
                    let (got, _) = ix.retrieve(h, &q);
                    // The same keys, walked one segment at a time (the fast path's parts).
                    let parts: Vec<usize> = (0..ix.segments())
                        .flat_map(|s| ix.retrieve_segments(h, &ix.query_codes(&q), s..s + 1).0)
                        .collect();
                    assert_eq!(parts, got, "seed {seed}: n {n}, walked in parts");
                    let qc = codes(&q, &ix.w, bits, tables);
                    let want: Vec<usize> = (0..end - first)
                        .filter(|&i| key_codes[i].iter().zip(&qc).filter(|(a, b)| a == b).count() >= 2)
                        .collect();
                    assert_eq!(got, want, "seed {seed}: n {n}");
                }
            }
        }
    }

    /// A section holding several segments of keys decodes to the index it was encoded from,
    /// and a member past its segment's keys (in the last, partial segment) is refused.
    #[test]
    fn sections_round_trip_and_refuse_members_past_their_segment() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let (d, n, heads) = (4, 2 * 65_536 + 300, 1);
        let k: Vec<f32> = (0..heads * n * d).map(|_| normal(&mut rng)).collect();
        let rows = LayerRows { k: k.clone(), v: k, kv_heads: heads, len: n, head_dim: d };
        let plan = Plan { first: 0, end: n, bits: 3, tables: 2, seed };
        let ix = LayerIndex::build(&rows, &plan).unwrap();
        let mut bytes = ix.encode();
        let back = LayerIndex::decode(&bytes, "test", &plan, heads, d).unwrap();
        let (a, b) = (&ix.heads[0], &back.heads[0]);
        assert!(a.members[..] == b.members[..] && a.starts[..] == b.starts[..] && a.norms == b.norms && back.w == ix.w);
        // Table 0's first member of a non-empty run in the last segment, where 300 keys lie.
        let segs = super::index::segments(n);
        let run = (0..1 << plan.bits).map(|c| c * segs + segs - 1).find(|&r| a.starts(0)[r] < a.starts(0)[r + 1]);
        let at = 4 * (d * plan.bits * plan.tables + d + n + a.starts(0).len()) + 2 * a.starts(0)[run.unwrap()] as usize;
        bytes[at..at + 2].copy_from_slice(&300u16.to_le_bytes());
        let err = LayerIndex::decode(&bytes, "test", &plan, heads, d).err().expect("a member past its segment");
        assert!(err.to_string().contains("out of range"), "{err}");
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
