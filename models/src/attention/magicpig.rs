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
use std::sync::{Arc, OnceLock};

use rand::rngs::StdRng;
use rand::SeedableRng;
use rayon::prelude::*;

use candle_core::{DType, Device, Tensor};
use folio_kernels::attention::{merge, AttnOutput};
use folio_kernels::{select, sparse};

use super::select::{
    budgeted_settings, dot, index_base, query_rows, sparse_decode, visible, HeadPick, IndexSource, Indexes, LayerRows,
    SectionReader, SectionWriter,
};
use super::workload::normal;
use super::{Attended, Attention, AttnCall, Budget, Dense, ParamSpec, Params};
use crate::error::{human_bytes, Error, Result};
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
/// Keys hashed per chunk of an index build: 64 Ki rows per KV head (what the offloaded tier
/// reads at a time).
const INDEX_CHUNK: usize = 1 << 16;

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
    fn build(rows: &LayerRows, plan: &Plan) -> Result<Self> {
        let (kv_heads, d) = (rows.kv_heads, rows.head_dim);
        let key = |h: usize, p: usize, out: &mut [f32]| out.copy_from_slice(rows.key(h, p));
        let all = Tensor::from_slice(&rows.k, (kv_heads, rows.len, d), &Device::Cpu)?;
        let chunk = |a: usize, b: usize| Ok(all.narrow(1, a, b - a)?);
        Self::build_with((kv_heads, d), plan, &key, &chunk, (INDEX_CHUNK, &Device::Cpu))
    }

    /// The index over `plan`'s keys from two views of them: `key(h, p, out)` writes key `p` of KV
    /// head `h` as f32 (host memory: the means and norms, summed in position order), and
    /// `chunk(a, b)` gives keys `a..b` as `[kv_heads, b - a, d]` on the device that hashes them
    /// (`device`: the GPU for an offloaded layer), `chunk_rows` at a time. SimHash codes are the
    /// same bits on every device, so the resident reference and the offloaded tier build the
    /// same tables from the same keys, whatever the chunking.
    fn build_with(
        (kv_heads, d): (usize, usize),
        plan: &Plan,
        key: &(dyn Fn(usize, usize, &mut [f32]) + Sync),
        chunk: &dyn Fn(usize, usize) -> Result<Tensor>,
        (chunk_rows, device): (usize, &Device),
    ) -> Result<Self> {
        let Plan { first, end, bits, tables, seed } = *plan;
        let n = end - first;
        check_host_memory(build_bytes(kv_heads, n, bits, tables), available_host_memory(), plan)?;
        let w = projection(d, bits * tables, seed);
        // Per head: the mean (f64 sums in position order), then each key's centred norm.
        let centre: Vec<(Vec<f32>, Vec<f32>)> = (0..kv_heads)
            .into_par_iter()
            .map(|h| {
                let (mut sum, mut row) = (vec![0f64; d], vec![0f32; d]);
                for p in first..end {
                    key(h, p, &mut row);
                    sum.iter_mut().zip(&row).for_each(|(m, x)| *m += *x as f64);
                }
                let mean: Vec<f32> = sum.iter().map(|m| (m / n as f64) as f32).collect();
                let norms = (first..end)
                    .into_par_iter()
                    .map_init(
                        || vec![0f32; d],
                        |row, p| {
                            key(h, p, row);
                            row.iter_mut().zip(&mean).for_each(|(x, m)| *x -= m);
                            dot(row, row).sqrt()
                        },
                    )
                    .collect();
                (mean, norms)
            })
            .collect();
        // Codes, table-major per head (`[tables][n]`), hashed a chunk at a time on the device.
        let w_dev = Tensor::from_slice(&w, (d, bits * tables), device)?;
        let means: Vec<f32> = centre.iter().flat_map(|c| c.0.iter().copied()).collect();
        let means = Tensor::from_vec(means, (kv_heads, 1, d), device)?;
        let mut codes = vec![vec![0u32; tables * n]; kv_heads];
        for a in (first..end).step_by(chunk_rows.max(1)) {
            let b = (a + chunk_rows.max(1)).min(end);
            let keys = chunk(a, b)?.to_dtype(DType::F32)?;
            if keys.dims() != [kv_heads, b - a, d] || !keys.device().same_device(device) {
                return Err(Error::Invalid(format!(
                    "magicpig: keys {a}..{b} came as {:?} on {:?}, not [{kv_heads}, {}, {d}] on {device:?}",
                    keys.dims(),
                    keys.device(),
                    b - a
                )));
            }
            let centred = keys.broadcast_sub(&means)?;
            for (h, head_codes) in codes.iter_mut().enumerate() {
                // Transposed where they were made: a table's codes land as one run.
                let c: Vec<u32> = sparse::simhash_codes(&centred.get(h)?, &w_dev, bits, tables)?
                    .t()?
                    .contiguous()?
                    .flatten_all()?
                    .to_vec1()?;
                for (l, run) in c.chunks_exact(b - a).enumerate() {
                    head_codes[l * n + a - first..][..b - a].copy_from_slice(run);
                }
            }
        }
        let heads = centre
            .into_iter()
            .zip(codes)
            .map(|((mean, norms), codes)| {
                // A counting sort per table, the tables over the cores.
                let buckets = 1usize << bits;
                let (order, start): (Vec<Vec<u32>>, Vec<Vec<u32>>) = codes
                    .par_chunks(n.max(1))
                    .take(tables)
                    .map(|table| {
                        let mut count = vec![0u32; buckets + 1];
                        for &c in table {
                            count[c as usize + 1] += 1;
                        }
                        for b in 0..buckets {
                            count[b + 1] += count[b];
                        }
                        let mut next = count.clone();
                        let mut ord = vec![0u32; n];
                        for (i, &c) in table.iter().enumerate() {
                            let slot = &mut next[c as usize];
                            ord[*slot as usize] = i as u32;
                            *slot += 1;
                        }
                        (ord, count)
                    })
                    .unzip();
                HeadTables { mean, norms, order, start }
            })
            .collect();
        Ok(Self { first, end, bits, tables, w, heads })
    }

    /// The logit bias `−log(u + 1e-4)` of indexed key `i` (row `key`) sampled for query `q`
    /// (norm `q_norm`): `u` from the cosine with the centred key, the vector the hash saw.
    fn logit_bias(&self, t: &HeadTables, q: &[f32], q_norm: f32, i: usize, key: &[f32]) -> f32 {
        // q · (key − mean), the products summed in channel order as `dot` sums them.
        let q_centred: f32 = q.iter().zip(key.iter().zip(&t.mean)).map(|(x, (a, b))| x * (a - b)).sum();
        let cos = q_centred as f64 / (q_norm as f64 * t.norms[i].max(f32::MIN_POSITIVE) as f64);
        let u = sampling_probability(collision_probability(cos), self.bits, self.tables);
        -((u + U_FLOOR).ln()) as f32
    }

    /// The query's code in every table.
    fn query_codes(&self, q: &[f32]) -> Vec<u32> {
        sparse::reference::simhash_codes(q, &self.w, q.len(), self.bits, self.tables)
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
        let qc = self.query_codes(q);
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

/// Host bytes a layer's build holds at its peak: per KV head and table, the codes and the bucket
/// list (4 bytes a key each) and the bucket starts; per key its norm.
fn build_bytes(kv_heads: usize, n: usize, bits: usize, tables: usize) -> u64 {
    let per_head = tables as u64 * (8 * n as u64 + 4 * ((1u64 << bits) + 1)) + 4 * n as u64;
    kv_heads as u64 * per_head
}

/// `MemAvailable` of /proc/meminfo in bytes, where there is one.
fn available_host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Refuses a build that needs more host memory than is available now, saying what to change:
/// at a million tokens a layer's tables are GiBs (4·L bytes per key and KV head, L growing with
/// the budget) and, layer after layer, would run the machine out of memory, where the OS kills
/// the process instead of failing an allocation.
fn check_host_memory(needed: u64, available: Option<u64>, plan: &Plan) -> Result<()> {
    match available {
        Some(free) if needed > free => Err(Error::Invalid(format!(
            "magicpig: the hash tables of keys {}..{} ({} tables of {} bits) need {} of host memory, {} is \
             available; lower the budget, or set tables= or bits= (each table costs 4 bytes per key and KV head)",
            plan.first,
            plan.end,
            plan.tables,
            plan.bits,
            human_bytes(needed),
            human_bytes(free)
        ))),
        _ => Ok(()),
    }
}

/// What a layer's index covers and how it hashes: a function of the store's saved prefix and
/// the settings alone, so it names a context-file section.
#[derive(Clone, Copy)]
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
    /// A decode step over the offloaded tier, split as the paper splits it: the CPU walks the
    /// tables and attends the sampled keys straight from host memory, on a pool of one thread
    /// per physical core (so the sample, ~2% of a million rows per query head, never crosses
    /// the host link), while the GPU attends the static part (sinks, window, the tokens after
    /// the saved prefix); the two partials merge by LSE.
    fn attend_offloaded(&self, call: &AttnCall<'_>, kv: &OffloadKv) -> Result<Attended> {
        let (lo, hi) = visible(call);
        let (keys, values) = kv.host_rows(call.kv_layer)?;
        // Stored tables, else built once from the layer's saved keys: means and norms from host
        // memory, codes on the device a chunk at a time.
        let ix = self.layer_index_with(call, hi, (kv.kv_heads(), kv.head_dim()), |plan| {
            let view = keys.host()?;
            let key = |h: usize, p: usize, out: &mut [f32]| view.row(h, p, out);
            let chunk = |a: usize, b: usize| kv.saved_keys(call.kv_layer, a, b);
            LayerIndex::build_with((kv.kv_heads(), kv.head_dim()), plan, &key, &chunk, (INDEX_CHUNK, kv.device()))
        })?;
        let Some(ix) = ix else {
            // Every token static: exact attention over the visible keys.
            return Dense.attend(call);
        };
        let queries = query_rows(call)?;
        let (heads, d) = (queries.len(), kv.head_dim());
        let groups = heads / kv.kv_heads();
        let q_flat: Vec<f32> = queries.iter().flat_map(|q| q[0].iter().copied()).collect();
        let scale = call.scale;
        // The static part on the device, every head the same positions: queued first, so the
        // GPU attends it while the CPU works on the sample.
        let statics: Vec<u32> = (lo..ix.first.max(lo)).chain(ix.end.max(lo)..hi).map(|p| p as u32).collect();
        let idx = Tensor::from_vec(statics.repeat(heads), (heads, statics.len()), call.q.device())?;
        let (out_g, lse_g) = offload::selected_partial(call, kv, &idx, None)?;
        let (read, out_s, lse_s, walked) = on_cpu_pool(|| -> Result<_> {
            // Per query head: index offsets of the sampled keys, visible ones only.
            let (picks, walked): (Vec<Vec<u32>>, Vec<usize>) = (0..heads)
                .into_par_iter()
                .map(|h| {
                    let (found, walked) = ix.retrieve(h / groups, &q_flat[h * d..(h + 1) * d]);
                    let visible = found.into_iter().map(|i| ix.first + i).filter(|&p| p >= lo);
                    (visible.map(|p| p as u32).collect(), walked)
                })
                .unzip();
            let walked: usize = walked.iter().sum();
            let q_norms: Vec<f32> = (0..heads)
                .map(|h| dot(&q_flat[h * d..(h + 1) * d], &q_flat[h * d..(h + 1) * d]).sqrt().max(f32::MIN_POSITIVE))
                .collect();
            let bias = |h: usize, j: usize, key: &[f32]| {
                let i = picks[h][j] as usize - ix.first;
                ix.logit_bias(&ix.heads[h / groups], &q_flat[h * d..(h + 1) * d], q_norms[h], i, key)
            };
            let (out, lse) = select::host_attention(&q_flat, (keys, values), &picks, scale, &bias)?;
            // What each head read, as a sorted set (the harness's report).
            let read: Vec<Vec<usize>> = picks
                .par_iter()
                .map(|pick| {
                    let mut sorted: Vec<usize> = pick.iter().chain(&statics).map(|&p| p as usize).collect();
                    sorted.sort_unstable();
                    sorted
                })
                .collect();
            Ok((read, out, lse, walked))
        })?;
        let dev = call.q.device();
        let sampled_part = AttnOutput {
            out: Tensor::from_vec(out_s, (heads, 1, d), dev)?,
            lse: Tensor::from_vec(lse_s, (heads, 1), dev)?,
        };
        let static_part = AttnOutput { out: out_g.unsqueeze(1)?, lse: lse_g.unsqueeze(1)? };
        let out = merge(&static_part, &sampled_part)?.out.to_dtype(call.q.dtype())?;
        // Index entries are 4 bytes; a bf16 key row is 2·d.
        let searched = walked as f64 * 4.0 / (2 * d) as f64 / heads as f64;
        Ok(Attended { out, read: Some(read), searched })
    }
}

/// Runs `f` on MagicPIG's CPU pool: one thread per physical core (the paper's CPU side: its
/// work is bound by memory bandwidth and FP units, which hyperthreads share), apart from the
/// global pool the rest of the engine uses. Should the pool fail to start, the global one runs it.
fn on_cpu_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        // Physical cores, within the CPUs this process may use (a container's quota).
        rayon::ThreadPoolBuilder::new()
            .num_threads(num_cpus::get_physical().min(num_cpus::get()).max(1))
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
                assert!(a.order == b.order && a.start == b.start, "seed {seed}: chunks of {chunk_rows}");
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
        // 150 tables × 8 bytes per key (codes and bucket list) × 4 KV heads ≈ 4.7 GiB.
        assert!(needed > 4_800_000_000 && needed < 5_100_000_000, "{needed}");
        let err = check_host_memory(needed, Some(needed - 1), &plan).unwrap_err().to_string();
        assert!(err.contains("150 tables of 10 bits") && err.contains("tables="), "{err}");
        assert!(check_host_memory(needed, Some(needed), &plan).is_ok());
        assert!(check_host_memory(needed, None, &plan).is_ok());
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
        let ix = LayerIndex::build(&rows, &Plan { first, end, bits, tables, seed }).unwrap();
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
