//! MagicPIG's index: per layer and KV head, the context's keys centred and hashed by SimHash into
//! `L` tables of `K` bits, each a counting-sorted bucket list; built from a store's rows (CPU or
//! device codes), checked against the host memory it will take, and stored as a context-file
//! section.

use rand::rngs::StdRng;
use rand::SeedableRng;
use rayon::prelude::*;

use candle_core::{DType, Device, Tensor};
use folio_kernels::sparse;

use super::{collision_probability, sampling_probability, U_FLOOR};
use crate::attention::select::{dot, LayerRows, SectionReader, SectionWriter};
use crate::attention::workload::normal;
use crate::error::{human_bytes, Error, Result};

/// Keys hashed per chunk of an index build: 64 Ki rows per KV head (what the offloaded tier
/// reads at a time).
pub(super) const INDEX_CHUNK: usize = 1 << 16;

/// The `K·L` hyperplanes, `[d][K·L]` row-major, i.i.d. N(0, 1) from `seed`.
pub(super) fn projection(d: usize, planes: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..d * planes).map(|_| normal(&mut rng)).collect()
}

/// One KV head's tables over keys `first..first + n`.
pub(super) struct HeadTables {
    pub(super) mean: Vec<f32>,
    /// |k_i - mean| for each indexed key.
    pub(super) norms: Vec<f32>,
    /// Per table: the indexed keys (offsets from `first`) sorted by code, and bucket starts
    /// (`2^K + 1` offsets into it).
    pub(super) order: Vec<Vec<u32>>,
    pub(super) start: Vec<Vec<u32>>,
}

/// One layer's index.
pub(super) struct LayerIndex {
    /// Indexed keys: `first..end`; the rest of the context is static.
    pub(super) first: usize,
    pub(super) end: usize,
    pub(super) bits: usize,
    pub(super) tables: usize,
    pub(super) w: Vec<f32>,
    pub(super) heads: Vec<HeadTables>,
}

impl LayerIndex {
    pub(super) fn build(rows: &LayerRows, plan: &Plan) -> Result<Self> {
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
    pub(super) fn build_with(
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
    pub(super) fn logit_bias(&self, t: &HeadTables, q: &[f32], q_norm: f32, i: usize, key: &[f32]) -> f32 {
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
    pub(super) fn retrieve(&self, head: usize, q: &[f32]) -> (Vec<usize>, usize) {
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
pub(super) fn build_bytes(kv_heads: usize, n: usize, bits: usize, tables: usize) -> u64 {
    let per_head = tables as u64 * (8 * n as u64 + 4 * ((1u64 << bits) + 1)) + 4 * n as u64;
    kv_heads as u64 * per_head
}

/// `MemAvailable` of /proc/meminfo in bytes, where there is one.
pub(super) fn available_host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Refuses a build that needs more host memory than is available now, saying what to change:
/// at a million tokens a layer's tables are GiBs (4·L bytes per key and KV head, L growing with
/// the budget) and, layer after layer, would run the machine out of memory, where the OS kills
/// the process instead of failing an allocation.
pub(super) fn check_host_memory(needed: u64, available: Option<u64>, plan: &Plan) -> Result<()> {
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
pub(super) struct Plan {
    pub(super) first: usize,
    pub(super) end: usize,
    pub(super) bits: usize,
    pub(super) tables: usize,
    pub(super) seed: u64,
}

impl Plan {
    pub(super) fn name(&self) -> String {
        format!(
            "magicpig v1 bits={} tables={} keys={}..{} seed={}",
            self.bits, self.tables, self.first, self.end, self.seed
        )
    }
}

impl LayerIndex {
    /// The hyperplanes first (stored, not regenerated: the file must not depend on a random
    /// generator's version), then per KV head the mean, norms and bucket lists.
    pub(super) fn encode(&self) -> Vec<u8> {
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

    pub(super) fn decode(bytes: &[u8], name: &str, plan: &Plan, kv_heads: usize, d: usize) -> Result<Self> {
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
