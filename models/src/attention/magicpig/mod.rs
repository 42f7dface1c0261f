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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use folio_kernels::attention::{merge, AttnOutput};
use folio_kernels::select::{self, HostRows};
use folio_kernels::sparse;
use folio_method_kernels::magicpig as lsh;
use rayon::prelude::*;

use super::cost::{CostInput, StepCost};
use super::fast;
use super::host_pool;
use super::method::Tiers;
use super::method::{budgeted, Budgeted};
use super::select::{dot, index_base, query_rows, sparse_decode, visible, HeadPick, IndexSource, Indexes, LayerRows};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Dense, Drawn, Knobs, MethodSpec, Needs, ParamSpec, Params,
    Path, Read,
};
use crate::error::{Error, Result};
use crate::kv_cache::DecodeTier;
use crate::kv_cache::KvStore;
use crate::profile::{self, span};
use index::{LayerIndex, OnDevice, Plan, BIAS_TABLE_STEPS, INDEX_CHUNK};

mod centre;
mod index;
mod offload;
mod on_file;

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
/// CPU, with `gpu=1` the walk over the link (the keys' norms and the runs' starts kept on the
/// device) and the sampled rows of the `gpu_attend` share of heads (`gpu_attend_fp8` over fp8
/// rows) over the link too, the rest's in host memory by the CPU — counted so even where a
/// step falls back to the CPU: a CPU device, a bf16-fp8 file's mixed rows.
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
    // The tables kept, and one layer's codes while its tables are built.
    let host_state_bytes = (layers - dense) as u64 * index::kept_bytes(kv_heads, indexed, bits, tables)
        + (4 * kv_heads * tables * indexed) as u64;
    // On the file tier the bucket lists but the one being built lie on disk, and a step reads
    // one code's runs per query head and table: ~2 KiB at a million keys, at any offset, so a
    // read of its bytes and a page more on average; the whole sample crosses the link.
    let lists = (2 * kv_heads * tables * indexed) as u64;
    let host_state_on_disk = (layers - dense).saturating_sub(1) as u64 * lists;
    let run = ((indexed >> bits) as f64 * ENTRY_BYTES).max(1.0) + DISK_READ as f64;
    let state_disk_bytes = sparse * (heads * tables) as f64 * run;
    let file_link_bytes = Some(link + sample(heads));
    if input.params.usize("gpu") == 0 {
        let host_bytes = sample(heads) + walked;
        return StepCost {
            device_bytes: 0.0,
            link_bytes: link,
            host_bytes,
            resident_bytes: resident,
            host_state_bytes,
            host_state_on_disk,
            state_disk_bytes,
            file_link_bytes,
            file_host_bytes: None,
        };
    }
    let on_gpu = gpu_heads(gpu_share(input.params, input.fp8_rows), heads);
    // On the device beside the weights: the keys' norms and the lists' run starts.
    let norms = 4 * indexed as u64 * kv_heads as u64 * (layers - dense) as u64;
    let per_table = (1u64 << bits) * indexed.div_ceil(lsh::SEGMENT_KEYS) as u64 + 1;
    let starts = 4 * (tables * kv_heads * (layers - dense)) as u64 * per_table;
    StepCost {
        device_bytes: 0.0,
        link_bytes: link + sample(on_gpu) + walked,
        host_bytes: sample(heads - on_gpu),
        resident_bytes: resident + norms + starts,
        host_state_bytes,
        host_state_on_disk,
        state_disk_bytes,
        file_link_bytes,
        file_host_bytes: None,
    }
}

/// The least a disk reads at once: a 4 KiB page.
const DISK_READ: usize = 4096;

/// Query heads whose sample the GPU attends (a layer's first), of `heads`, for a `gpu_attend`
/// share: the nearest whole number. By query head, not KV head: the 7B shape's 4 KV heads
/// would split a step only in quarters, too coarse to balance the two sides.
fn gpu_heads(share: f64, heads: usize) -> usize {
    ((share.clamp(0.0, 1.0) * heads as f64).round() as usize).min(heads)
}

const PARAMS: [ParamSpec; 10] = [
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
              everything, as the paper splits it; a CPU device always does). On the file tier the CPU walks \
              the lists it reads from disk and the device attends every head",
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
        name: "gpu_attend_fp8",
        default: GPU_ATTEND_FP8,
        min: 0.0,
        max: 1.0,
        integer: false,
        doc: "gpu_attend where the rows are a context file's fp8 codes, which the CPU widens value by value \
              (on the GPU they cross the link at half the bytes); at 1 no CPU part is left for balance=1 \
              to move toward",
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
/// the GPU's warps read a head's picks strided (magicpig.cu), its share reads ~1.9x faster, and the
/// best split moved from 14 heads to 18–20: 55.4 (14), 53.0 (16), 48.9 (18) on one host,
/// 48.0 (20) and 56.6 (22) on another (docs/performance.md). With the CPU's heads walked
/// first, 18 measured 44.8, 53.2 and 50.6 on three hosts; on the second, 20 heads 48.3 and
/// 16 heads 53.3. 18, not 20: one host favours 20, and 22 fell off where the GPU's side
/// became the longer; the next sweep decides.
const GPU_ATTEND: f64 = 0.64;

/// `gpu_attend` over fp8 rows (a context file's compact K/V): all heads on the GPU. The CPU
/// widens fp8 codes value by value: at 1M of the 7B shape on the H200 its 10 heads took 45.4 ms
/// a step against 17.2 ms in bf16, while the GPU reads fp8 at half the link bytes; with
/// `--host-budget 60GiB --link-gbps 25`, 18 heads on the GPU gave 81.47 ms a token, 24 gave
/// 57.91, all 28 gave 49.97 (docs/results/2026-11-30-consumer-envelope/).
const GPU_ATTEND_FP8: f64 = 1.0;

/// The share of query heads whose sample the GPU attends, for rows stored as fp8 or not.
fn gpu_share(params: &Params, fp8_rows: bool) -> f64 {
    params.get(if fp8_rows { "gpu_attend_fp8" } else { "gpu_attend" })
}

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
/// From 18 heads with the GPU's reads strided (2026-12-02, A-B-A on one H200 host): settled at
/// 15, 38.07 ms against 39.33 and 38.57, within a host's run-to-run spread; p90 1.4 ms worse.
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
        self.layer_index_with(call, hi, (rows.kv_heads, rows.head_dim), None, |plan| LayerIndex::build(rows, plan))
    }

    /// [`Self::layer_index`] with the build left to the caller (`shape`: KV heads, head dim),
    /// its bucket lists moved to a spill file in `spill` where one is given (the file tier's
    /// directory; the disk asked for room for this layer's lists and the later layers' too).
    fn layer_index_with(
        &self,
        call: &AttnCall<'_>,
        hi: usize,
        (kv_heads, d): (usize, usize),
        spill: Option<&std::path::Path>,
        build: impl FnOnce(&Plan) -> Result<LayerIndex>,
    ) -> Result<Option<Arc<LayerIndex>>> {
        if let Some(ix) = self.index.cached(call.layer, |ix| ix.end <= hi) {
            return Ok(Some(ix));
        }
        let Some(plan) = self.plan(call.kv, hi) else { return Ok(None) };
        let name = plan.name();
        let to_come = (call.layer..call.layers).filter(|&l| !self.dense_layer(l, call.layers)).count();
        let place = |ix: LayerIndex| match spill {
            Some(dir) => ix.spill(dir, to_come),
            None => Ok(ix),
        };
        let decode = |b: &[u8]| LayerIndex::decode(b, &name, &plan, kv_heads, d);
        Ok(Some(self.index.load_placed(call, &name, (decode, || build(&plan)), place)?))
    }
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
        Ok(Some((plan.name(), ix.encode()?)))
    }

    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        self.index.sources()
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        if self.dense_layer(call.layer, call.layers) {
            return Dense.attend(call);
        }
        // The paper's split needs the saved rows in host memory, where the CPU attends the
        // sample: the offloaded tier; the file tier has a step of its own ([`on_file`]).
        // Elsewhere (the resident tier, a prefill) the reference runs.
        if let (Some(kv), 1) = (call.kv.tier(), call.q.dim(1)?) {
            if let Some(host) = kv.host_rows(call.kv_layer) {
                return self.attend_fast(call, &*kv, host);
            }
            // The file tier: the rows in the file, the bucket lists beside it.
            if let Some(dir) = kv.file_dir() {
                return self.attend_on_file(call, &*kv, dir);
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
                    let (sampled, walked) = ix.retrieve(kvh, q)?;
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
                    Ok(pick)
                })
                .collect::<Result<_>>()?;
            let searched = walked_total as f64 * ENTRY_BYTES / (2 * rows.head_dim) as f64 / queries.len() as f64;
            Ok((picks, searched))
        })
    }
}

#[cfg(test)]
mod tests;
