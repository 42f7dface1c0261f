//! Synthetic attention workloads: Q/K/V with the structure real decoder attention has, for
//! tests and `folio eval attention --synthetic`. Tiny random models attend diffusely and would
//! hide every difference between methods; these put the mass where real heads put it:
//!
//! - an **attention sink**: key 0 scores high against every query (StreamingLLM, MagicPIG §3.1);
//! - **locality**: keys drift slowly along positions, so neighbours score alike (HiP's
//!   premise) and recent keys share the current query's direction;
//! - **needles**: a few planted keys aligned with the query, anywhere in the context;
//! - a **long tail**: every key carries a heavy-tailed (Pareto) share of the query direction,
//!   so no small set holds all the mass (MagicPIG's case against top-k);
//! - a common **key offset** away from the queries (keys in a cone far from q, which is why
//!   MagicPIG centres keys before hashing);
//! - **outlier channels**: a fixed few channels (the same for every seed, as real models'
//!   are the same for every input) carry most of q·k, Double Sparsity's premise.
//!
//! A case is a sequence of decode steps: step `s` queries at position `context + s` over keys
//! `0..=context + s`, so stateful methods (mask refresh, eviction) see a real progression.

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use folio_models::attention::AttnCall;
use folio_models::error::Result;
use folio_models::kv_cache::{DenseKv, KvStore};
pub use folio_models::random::normal;

/// Shape and structure of a synthetic workload.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Spec {
    pub name: &'static str,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Keys before the first decode step.
    pub context: usize,
    /// Decode steps (one query each, one key appended each).
    pub steps: usize,
    /// Sink key's alignment with the queries (0 = no sink).
    pub sink: f32,
    /// Correlation of consecutive keys' drift component, 0..1 (0 = none).
    pub locality: f32,
    /// Planted keys aligned with the query, and their strength.
    pub needles: usize,
    pub needle: f32,
    /// Scale of the heavy-tailed alignment every key carries (0 = none).
    pub tail: f32,
    /// Length of the common key offset, orthogonal-ish to the queries.
    pub key_offset: f32,
    /// How many channels are outliers, and how much larger they are in q and k.
    pub outliers: usize,
    pub outlier_scale: f32,
}

impl Spec {
    fn base(name: &'static str, context: usize) -> Self {
        Self {
            name,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 32,
            context,
            steps: 8,
            sink: 0.0,
            locality: 0.0,
            needles: 0,
            needle: 0.0,
            tail: 0.0,
            key_offset: 3.0,
            outliers: 4,
            outlier_scale: 3.0,
        }
    }

    /// A strong sink and noise: most mass on key 0.
    pub fn sink(context: usize) -> Self {
        Self { sink: 1.2, ..Self::base("sink", context) }
    }

    /// Slowly drifting keys, recent ones aligned with the query.
    pub fn locality(context: usize) -> Self {
        Self { sink: 0.6, locality: 0.98, ..Self::base("locality", context) }
    }

    /// A handful of strong needles in noise.
    pub fn needles(context: usize) -> Self {
        Self { sink: 0.6, needles: 8, needle: 0.7, ..Self::base("needles", context) }
    }

    /// Mass spread thinly over many keys.
    pub fn long_tail(context: usize) -> Self {
        Self { sink: 0.6, tail: 0.06, ..Self::base("long-tail", context) }
    }

    /// Everything at once: the harness's default synthetic case.
    pub fn mixed(context: usize) -> Self {
        Self { sink: 0.8, locality: 0.95, needles: 6, needle: 0.6, tail: 0.08, ..Self::base("mixed", context) }
    }

    /// The presets, in the order reports list them.
    pub fn presets(context: usize) -> Vec<Self> {
        vec![
            Self::sink(context),
            Self::locality(context),
            Self::needles(context),
            Self::long_tail(context),
            Self::mixed(context),
        ]
    }

    /// The outlier channels: fixed by the spec's shape, not by the case's seed.
    pub fn outlier_channels(&self) -> Vec<usize> {
        let mut rng = StdRng::seed_from_u64(OUTLIER_SEED);
        let mut c: Vec<usize> =
            rand::seq::index::sample(&mut rng, self.head_dim, self.outliers.min(self.head_dim)).into_vec();
        c.sort_unstable();
        c
    }

    pub fn len(&self) -> usize {
        self.context + self.steps
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A generated workload: keys/values for every position and one query per decode step.
pub struct Case {
    pub spec: Spec,
    /// `[kv_heads, context + steps, d]`, f32 on the CPU.
    pub k: Tensor,
    pub v: Tensor,
    /// Step `s`: `[q_heads, 1, d]`, the query at position `context + s`.
    pub queries: Vec<Tensor>,
}

fn unit(rng: &mut impl Rng, d: usize) -> Vec<f32> {
    let x: Vec<f32> = (0..d).map(|_| normal(rng)).collect();
    let n = x.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
    x.into_iter().map(|a| a / n).collect()
}

/// Noise scale of every key and value component; query rows have norm `QUERY_NORM`.
const KEY_NOISE: f32 = 0.5;
const QUERY_NORM: f32 = 8.0;
/// How far each query head of a group strays from the group's direction, and each step's
/// query from the previous step's.
const HEAD_SPREAD: f32 = 0.35;
const STEP_DRIFT: f32 = 0.1;
/// Seed of the outlier channel choice (shared by every case).
const OUTLIER_SEED: u64 = 0x0071_1e25;

impl Case {
    pub fn generate(spec: &Spec, seed: u64) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let (d, n, groups) = (spec.head_dim, spec.len(), spec.q_heads / spec.kv_heads);
        let mut k = vec![0f32; spec.kv_heads * n * d];
        let v: Vec<f32> = (0..spec.kv_heads * n * d).map(|_| normal(&mut rng)).collect();
        // Each KV group has a direction its queries share; keys align with it.
        let dirs: Vec<Vec<f32>> = (0..spec.kv_heads).map(|_| unit(&mut rng, d)).collect();
        let scale = 1.0 / (d as f32).sqrt();
        for (g, dir) in dirs.iter().enumerate() {
            let offset: Vec<f32> = unit(&mut rng, d).iter().map(|x| x * spec.key_offset).collect();
            let needles: Vec<usize> = (0..spec.needles).map(|_| rng.random_range(1..spec.context.max(2))).collect();
            let mut drift = vec![0f32; d];
            for p in 0..n {
                let row = &mut k[(g * n + p) * d..][..d];
                // Drift: an AR(1) walk, so keys `p` apart correlate like locality^p.
                let keep = spec.locality;
                let fresh = (1.0 - keep * keep).sqrt();
                for x in drift.iter_mut() {
                    *x = keep * *x + fresh * normal(&mut rng);
                }
                // Heavy tail: Pareto(α = 1.5) weights on the shared direction, capped at a
                // needle's strength (about 1 key in 25 reaches the cap at tail = 0.06).
                let tail =
                    if spec.tail > 0.0 { spec.tail * rng.random_range(1e-3f32..1.0).powf(-1.0 / 1.5) } else { 0.0 };
                let align = if p == 0 {
                    spec.sink
                } else if needles.contains(&p) {
                    spec.needle
                } else {
                    tail.min(0.5)
                };
                let drift_scale = if spec.locality > 0.0 { KEY_NOISE } else { 0.0 };
                for i in 0..d {
                    let noise = if spec.locality > 0.0 {
                        0.3 * KEY_NOISE * normal(&mut rng)
                    } else {
                        KEY_NOISE * normal(&mut rng)
                    };
                    row[i] = noise + drift_scale * drift[i] + offset[i] + align * dir[i] * QUERY_NORM * scale * 4.0;
                }
            }
        }
        let mut queries = Vec::with_capacity(spec.steps);
        let mut q: Vec<Vec<f32>> = (0..spec.q_heads)
            .map(|h| {
                let own = unit(&mut rng, d);
                let dir = &dirs[h / groups];
                let mixed: Vec<f32> = dir.iter().zip(&own).map(|(a, b)| a + HEAD_SPREAD * b).collect();
                let norm = mixed.iter().map(|x| x * x).sum::<f32>().sqrt();
                mixed.iter().map(|x| x / norm * QUERY_NORM).collect()
            })
            .collect();
        for s in 0..spec.steps {
            if spec.locality > 0.0 {
                // Recent keys look like the current query: the last key drifts towards it.
                let pos = spec.context + s;
                for g in 0..spec.kv_heads {
                    let row = &mut k[(g * n + pos) * d..][..d];
                    for (x, qv) in row.iter_mut().zip(&q[g * groups]) {
                        *x += 0.5 * qv * scale;
                    }
                }
            }
            queries.push(Tensor::from_vec(q.concat(), (spec.q_heads, 1, d), &Device::Cpu)?);
            for row in q.iter_mut() {
                let jitter = unit(&mut rng, d);
                let moved: Vec<f32> = row.iter().zip(&jitter).map(|(a, b)| a + STEP_DRIFT * QUERY_NORM * b).collect();
                let norm = moved.iter().map(|x| x * x).sum::<f32>().sqrt();
                *row = moved.iter().map(|x| x / norm * QUERY_NORM).collect();
            }
        }
        // Outlier channels: larger in both q and k, so they dominate q·k.
        let outliers = spec.outlier_channels();
        for row in k.chunks_mut(d) {
            for &c in &outliers {
                row[c] *= spec.outlier_scale;
            }
        }
        let queries = queries
            .into_iter()
            .map(|q| {
                let mut q = q.flatten_all()?.to_vec1::<f32>()?;
                for row in q.chunks_mut(d) {
                    for &c in &outliers {
                        row[c] *= spec.outlier_scale;
                    }
                }
                Ok(Tensor::from_vec(q, (spec.q_heads, 1, d), &Device::Cpu)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            spec: spec.clone(),
            k: Tensor::from_vec(k, (spec.kv_heads, n, d), &Device::Cpu)?,
            v: Tensor::from_vec(v, (spec.kv_heads, n, d), &Device::Cpu)?,
            queries,
        })
    }
}

impl Case {
    /// The case's keys and values as a one-layer store holding every position.
    pub fn store(&self) -> Result<DenseKv> {
        let spec = &self.spec;
        let mut kv = DenseKv::new(1, spec.kv_heads, spec.head_dim, DType::F32, &Device::Cpu);
        kv.write(0, 0, &self.k, &self.v)?;
        kv.set_len(spec.len())?;
        Ok(kv)
    }

    /// Decode step `step` over `kv` (this case's [`Case::store`]) as layer `layer` of `layers`.
    pub fn call<'a>(&'a self, step: usize, kv: &'a dyn KvStore, (layer, layers): (usize, usize)) -> AttnCall<'a> {
        AttnCall {
            layer,
            layers,
            kv_layer: 0,
            q: &self.queries[step],
            q_start: self.spec.context + step,
            kv,
            scale: 1.0 / (self.spec.head_dim as f32).sqrt(),
            window: None,
        }
    }

    /// Double Sparsity's qk statistic over this case's decode steps, `[kv_head][channel]`:
    /// mean |q_i k_i| of each step's query and the key at its position, summed over the query
    /// heads of each KV group (what `folio calibrate` measures on a model).
    pub fn qk_statistic(&self) -> Result<Vec<Vec<f64>>> {
        let spec = &self.spec;
        let groups = spec.q_heads / spec.kv_heads;
        let k = self.k.to_vec3::<f32>()?;
        let mut stat = vec![vec![0f64; spec.head_dim]; spec.kv_heads];
        for (s, q) in self.queries.iter().enumerate() {
            let q = q.squeeze(1)?.to_vec2::<f32>()?;
            for (h, qh) in q.iter().enumerate() {
                let key = &k[h / groups][spec.context + s];
                for (i, acc) in stat[h / groups].iter_mut().enumerate() {
                    *acc += (qh[i] * key[i]).abs() as f64 / self.queries.len() as f64;
                }
            }
        }
        Ok(stat)
    }
}
