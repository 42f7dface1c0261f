//! MagicPIG's index: per layer and KV head, the context's keys centred and hashed by SimHash into
//! `L` tables of `K` bits, each a counting-sorted bucket list; built from a store's rows (CPU or
//! device codes), checked against the host memory it will take, and stored as a context-file
//! section.

mod lists;

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use rand::rngs::StdRng;
use rand::SeedableRng;
use rayon::prelude::*;

use candle_core::{DType, Device, Tensor};
use folio_kernels::select::SharedHost;
use folio_kernels::sparse;
use folio_method_kernels::magicpig as lsh;

use super::centre::{self, Centre};
use super::{collision_probability, sampling_probability, U_FLOOR};
use crate::attention::select::{dot, LayerRows, SectionReader, SectionWriter};
use crate::error::{human_bytes, Error, Result};
use crate::random::normal;
use folio_runtime::host_budget::{self, Hold};
use folio_runtime::host_memory;
use lists::Lists;

/// Keys hashed per chunk of an index build: 64 Ki rows per KV head (what the offloaded tier
/// reads at a time).
pub(super) const INDEX_CHUNK: usize = 1 << 16;

/// The `K·L` hyperplanes, `[d][K·L]` row-major, i.i.d. N(0, 1) from `seed`.
pub(super) fn projection(d: usize, planes: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..d * planes).map(|_| normal(&mut rng)).collect()
}

/// Keys per segment of a bucket list, whose members are stored as 16-bit offsets within their
/// segment: the device walk's layout too ([`lsh`]).
const SEGMENT_KEYS: usize = lsh::SEGMENT_KEYS;

pub(super) use lsh::segments;

/// One KV head's tables over keys `first..first + n`.
///
/// Compact bucket lists: a table's keys sorted by (code, key) are stored as 2-byte offsets
/// within their 64 Ki-key segment, with the start of every (code, segment) run — half the
/// bytes of 4-byte key numbers, plus `2^K · segments` starts (3% at a million keys and
/// K = 10). At a million tokens of a 7B shape and the paper's L ≈ 150 the tables are ~35 GiB
/// instead of ~67, which is what lets them sit beside 56 GiB of K/V in a 128 GiB host.
/// Rejected: per-key codes (1–2 bytes, but every query would scan all of them), delta- or
/// bit-packed lists (a decode in the walk's inner loop).
pub(super) struct HeadTables {
    pub(super) mean: Vec<f32>,
    /// |k_i - mean| for each indexed key.
    pub(super) norms: Vec<f32>,
    /// `[tables][n]`: per table, the keys' offsets within their segment, sorted by (code, key):
    /// in host memory, where a GPU walks them in place ([`LayerIndex::on_device`]), or on disk.
    pub(super) lists: Lists,
    /// `[tables][2^K · segments + 1]`: per table, where the run of code `c`, segment `s` starts
    /// in its members, at `c · segments + s` (the last entry `n`).
    pub(super) starts: Arc<HugePages<u32>>,
    /// Tables, segments of keys, and run starts per table (`2^K · segments + 1`): the strides
    /// of the two maps, kept rather than divided out at every run the walk reads.
    tables: usize,
    segments: usize,
    per_table: usize,
}

/// `len` values of `T`, zeroed, in a map that asks for 2 MiB pages
/// ([`folio_runtime::host_memory::anon_huge`]): the walk reads ~1,000 scattered runs of one head's
/// tables a step, and the tables of a million keys are ~15 GB; on 4 KiB pages each run is a
/// TLB miss (30 MB of page tables), on 2 MiB pages the entries (60 KB) stay cached.
pub(super) struct HugePages<T> {
    map: memmap2::MmapMut,
    _hold: Hold,
    len: usize,
    of: std::marker::PhantomData<T>,
}

impl<T: bytemuck::Pod> HugePages<T> {
    pub(super) fn zeroed(len: usize) -> Result<Self> {
        let bytes = len * std::mem::size_of::<T>();
        let hold = host_budget::hold(bytes as u64, "magicpig's hash tables").map_err(tables_refused)?;
        let map = host_memory::anon_huge(bytes)
            .map_err(|e| Error::Invalid(format!("magicpig: {bytes} bytes of host memory for the tables: {e}")))?;
        Ok(Self { map, _hold: hold, len, of: std::marker::PhantomData })
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for HugePages<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // A map starts on a page: aligned for any `T`.
        bytemuck::cast_slice(&self.map[..self.len * std::mem::size_of::<T>()])
    }
}

/// The bytes, for registering with a GPU ([`SharedHost`]).
impl<T: bytemuck::Pod> AsRef<[u8]> for HugePages<T> {
    fn as_ref(&self) -> &[u8] {
        &self.map[..self.len * std::mem::size_of::<T>()]
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for HugePages<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(&mut self.map[..self.len * std::mem::size_of::<T>()])
    }
}

impl HeadTables {
    /// Table `l`'s members with code `c`, as key offsets from `first`, ascending (the tests'
    /// view of a table).
    #[cfg(test)]
    pub(super) fn bucket(&self, l: usize, c: u32) -> impl Iterator<Item = usize> + '_ {
        let members = self.members(l).expect("the tests' tables are in memory");
        (0..segments(self.norms.len()))
            .flat_map(move |s| members[self.run_at(l, c, s..s + 1)].iter().map(move |&m| s * SEGMENT_KEYS + m as usize))
    }

    /// Tables `mean`/`norms` (`n` keys) and the maps of `tables` tables of `bits`-bit codes.
    fn new(
        mean: Vec<f32>,
        norms: Vec<f32>,
        (members, starts): (HugePages<u16>, HugePages<u32>),
        bits: usize,
        tables: usize,
    ) -> Self {
        let segments = segments(norms.len());
        let per_table = (1 << bits) * segments + 1;
        debug_assert!(members.len() == tables * norms.len() && starts.len() == tables * per_table);
        let (lists, starts) = (Lists::Memory(Arc::new(members)), Arc::new(starts));
        Self { mean, norms, lists, starts, tables, segments, per_table }
    }

    /// Table `l`'s keys' offsets within their segments, sorted by (code, key), where they are in
    /// host memory.
    pub(super) fn members(&self, l: usize) -> Option<&[u16]> {
        let n = self.norms.len();
        match &self.lists {
            Lists::Memory(members) => Some(&members[l * n..(l + 1) * n]),
            Lists::Disk { .. } => None,
        }
    }

    /// Keys indexed.
    fn len(&self) -> usize {
        self.norms.len()
    }

    /// Table `l`'s run starts.
    pub(super) fn starts(&self, l: usize) -> &[u32] {
        &self.starts[l * self.per_table..(l + 1) * self.per_table]
    }

    /// Where table `l`'s members with code `c` in segments `segs` lie in its members: a code's
    /// runs in consecutive segments lie together.
    fn run_at(&self, l: usize, c: u32, segs: Range<usize>) -> Range<usize> {
        let (starts, at) = (self.starts(l), c as usize * self.segments);
        starts[at + segs.start] as usize..starts[at + segs.end] as usize
    }

    /// Starts the loads of table `l`'s run starts for code `c` (every segment's).
    fn prefetch_starts(&self, l: usize, c: u32) {
        lsh::prefetch_lines(&self.starts(l)[c as usize * self.segments..][..self.segments + 1]);
    }
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
    /// The logit bias as a function of the cosine, made on the fast path's first use (the
    /// reference never reads it; `None`: see [`BiasTable::new`]).
    bias: OnceLock<Option<BiasTable>>,
    /// The index as a GPU walks it, made at its first device step ([`Self::on_device`]).
    device: Mutex<Option<Arc<OnDevice>>>,
}

/// A layer's index where a GPU reads it: the bucket lists registered in place, the bias
/// table and the keys' norms on the device (`[table | norms of every KV head]`, f32: 16 MB a
/// layer at a million keys and 4 KV heads), and the SimHash projection (`[d, K·L]` f32), so
/// that the queries' codes are taken where the queries are.
pub(super) struct OnDevice {
    pub(super) tables: lsh::Tables,
    pub(super) weights: Tensor,
    pub(super) projection: Tensor,
}

impl LayerIndex {
    pub(super) fn build(rows: &LayerRows, plan: &Plan) -> Result<Self> {
        let (kv_heads, d) = (rows.kv_heads, rows.head_dim);
        let key = |h: usize, p: usize, out: &mut [f32]| out.copy_from_slice(rows.key(h, p));
        let all = Tensor::from_slice(&rows.k, (kv_heads, rows.len, d), &Device::Cpu)?;
        let chunk = |a: usize, b: usize| Ok(all.narrow(1, a, b - a)?);
        let centre = centre::of_rows((kv_heads, d), plan.first..plan.end, &key);
        Self::build_with((kv_heads, d), plan, centre, &chunk, (INDEX_CHUNK, &Device::Cpu))
    }

    /// The index over `plan`'s keys from their `centre` (each head's mean and the keys' centred
    /// norms, or no norms: then taken here from the centred keys: [`centre`]) and `chunk(a, b)`, keys `a..b` as `[kv_heads, b - a, d]` on the device
    /// that hashes them (`device`: the GPU for an offloaded layer), `chunk_rows` at a time. SimHash codes are the
    /// same bits on every device, so the resident reference and the offloaded tier build the
    /// same tables from the same keys, whatever the chunking.
    pub(super) fn build_with(
        (kv_heads, d): (usize, usize),
        plan: &Plan,
        centre: Centre,
        chunk: &dyn Fn(usize, usize) -> Result<Tensor>,
        (chunk_rows, device): (usize, &Device),
    ) -> Result<Self> {
        let Plan { first, end, bits, tables, seed } = *plan;
        let n = end - first;
        check_host_memory(build_bytes(kv_heads, n, bits, tables), host_memory::available(), plan)?;
        // The codes, held while the tables are sorted from them (the tables hold their own).
        let codes_bytes = (kv_heads * tables * n * std::mem::size_of::<u32>()) as u64;
        let _codes_hold = host_budget::hold(codes_bytes, "magicpig's hash codes while its tables are built")
            .map_err(tables_refused)?;
        let w = projection(d, bits * tables, seed);
        // Codes, table-major per head (`[tables][n]`), hashed a chunk at a time on the device.
        let w_dev = Tensor::from_slice(&w, (d, bits * tables), device)?;
        let means: Vec<f32> = centre.iter().flat_map(|c| c.0.iter().copied()).collect();
        let means = Tensor::from_vec(means, (kv_heads, 1, d), device)?;
        // Norms not given: taken from the centred keys as they are hashed (`centre::of_chunks`).
        let mut centre = centre;
        let fill_norms = centre.iter().all(|c| c.1.is_empty()) && n > 0;
        if centre.len() != kv_heads || centre.iter().any(|c| c.0.len() != d || (!fill_norms && c.1.len() != n)) {
            return Err(Error::Invalid(format!(
                "magicpig: a centre of {} heads for {kv_heads} of {n} keys",
                centre.len()
            )));
        }
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
            if fill_norms {
                // f32 differences, rounded alike on every device: the reference's norms. One
                // copy for every head (a head's own would copy the whole chunk from a GPU).
                let rows: Vec<f32> = centred.flatten_all()?.to_vec1()?;
                for (h, (_, norms)) in centre.iter_mut().enumerate() {
                    norms.extend(centre::norms_of_centred(&rows[h * (b - a) * d..(h + 1) * (b - a) * d], d));
                }
            }
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
                // A counting sort per table by (code, segment), the tables over the cores; keys
                // go in ascending, so each run is sorted too.
                let (runs, segs) = ((1usize << bits) * segments(n), segments(n));
                let mut members = HugePages::<u16>::zeroed(tables * n)?;
                let mut starts = HugePages::<u32>::zeroed(tables * (runs + 1))?;
                codes
                    .par_chunks(n.max(1))
                    .zip(members.par_chunks_mut(n.max(1)))
                    .zip(starts.par_chunks_mut(runs + 1))
                    .for_each(|((table, members), count)| {
                        let run = |i: usize, c: u32| c as usize * segs + i / SEGMENT_KEYS;
                        for (i, &c) in table.iter().enumerate() {
                            count[run(i, c) + 1] += 1;
                        }
                        for r in 0..runs {
                            count[r + 1] += count[r];
                        }
                        let mut next = count[..runs].to_vec();
                        for (i, &c) in table.iter().enumerate() {
                            let slot = &mut next[run(i, c)];
                            members[*slot as usize] = (i % SEGMENT_KEYS) as u16;
                            *slot += 1;
                        }
                    });
                Ok(HeadTables::new(mean, norms, (members, starts), bits, tables))
            })
            .collect::<Result<_>>()?;
        Ok(Self { first, end, bits, tables, w, heads, bias: OnceLock::new(), device: Mutex::new(None) })
    }

    /// The logit bias `−log(u + 1e-4)` of indexed key `i` (row `key`) sampled for query `q`
    /// (norm `q_norm`): `u` from the cosine with the centred key, the vector the hash saw.
    pub(super) fn logit_bias(&self, t: &HeadTables, q: &[f32], q_norm: f32, i: usize, key: &[f32]) -> f32 {
        // q · (key − mean), the products summed in channel order as `dot` sums them.
        let q_centred: f32 = q.iter().zip(key.iter().zip(&t.mean)).map(|(x, (a, b))| x * (a - b)).sum();
        let cos = q_centred as f64 / (q_norm as f64 * t.norms[i].max(f32::MIN_POSITIVE) as f64);
        bias_of_cos(cos, self.bits, self.tables)
    }

    /// [`Self::logit_bias`] for the fast path: from `q·key` (the logit's dot) and `q·mean` of
    /// the key's head, whose difference is the centred dot (the row is not read a second
    /// time), and the key's stored norm `k_norm` (`norms[i]`, gathered by the caller in one
    /// pass: loaded here, each would be a cache miss inside the row loop), through
    /// [`BiasTable`]. Within [`BIAS_TABLE_ERROR`] of it, plus the rounding of the two sums.
    pub(super) fn logit_bias_from_dot(&self, (qk, q_mean): (f32, f32), q_norm: f32, k_norm: f32) -> f32 {
        let cos = (qk - q_mean) / (q_norm * k_norm.max(f32::MIN_POSITIVE));
        match self.bias_table() {
            Some(table) => table.get(cos),
            None => bias_of_cos(cos as f64, self.bits, self.tables),
        }
    }

    /// The bias table, made at its first use; `None` where it would be off by more than its
    /// error ([`BiasTable::new`]).
    fn bias_table(&self) -> Option<&BiasTable> {
        self.bias.get_or_init(|| BiasTable::new(self.bits, self.tables)).as_ref()
    }

    /// The index as `device` (a GPU) walks it: registered, weights uploaded, at the first call;
    /// `None` without a bias table (a (K, L) whose bias the fast paths compute exactly, on the
    /// CPU) or with the bucket lists on disk.
    pub(super) fn on_device(&self, device: &Device) -> Result<Option<Arc<OnDevice>>> {
        let Some(bias) = self.bias_table() else { return Ok(None) };
        let mut slot = self.device.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(on) = slot.as_ref().filter(|on| on.weights.device().same_device(device)) {
            return Ok(Some(on.clone()));
        }
        // Another device's registration ends first: the same pages cannot be registered twice.
        *slot = None;
        let share = |owner: Arc<dyn AsRef<[u8]> + Send + Sync>| SharedHost::new(device, owner);
        let mut lists = Vec::with_capacity(self.heads.len());
        for h in &self.heads {
            // Lists on disk: the CPU walks them as it reads them.
            let Lists::Memory(members) = &h.lists else { return Ok(None) };
            // The starts are copied to the device (lsh::Tables): not registered.
            lists.push((share(members.clone())?, SharedHost::new(&Device::Cpu, h.starts.clone())?));
        }
        let n = self.end - self.first;
        let tables = lsh::Tables::new(device, lists, (n, self.bits, self.tables))?;
        let weights: Vec<f32> = bias.0.iter().chain(self.heads.iter().flat_map(|h| h.norms.iter())).copied().collect();
        let weights = Tensor::from_vec(weights, bias.0.len() + self.heads.len() * n, device)?;
        let planes = self.bits * self.tables;
        let projection = Tensor::from_slice(&self.w, (self.w.len() / planes, planes), device)?;
        let on = Arc::new(OnDevice { tables, weights, projection });
        *slot = Some(on.clone());
        Ok(Some(on))
    }

    /// Bucket-list entries a walk for codes `qc` reads in KV head `head`'s tables (every
    /// segment's run of each table's code: two run starts a table).
    pub(super) fn walked(&self, head: usize, qc: &[u32]) -> usize {
        let t = &self.heads[head];
        qc.iter()
            .enumerate()
            .map(|(l, &c)| {
                let starts = t.starts(l);
                let at = c as usize * t.segments;
                (starts[at + t.segments] - starts[at]) as usize
            })
            .sum()
    }

    /// What weighs query `q`'s samples in KV head `head`: `|q|` (at least the smallest
    /// positive f32) and `q·mean` of the head's keys ([`Self::logit_bias_from_dot`]).
    pub(super) fn query_weights(&self, head: usize, q: &[f32]) -> (f32, f32) {
        (dot(q, q).sqrt().max(f32::MIN_POSITIVE), dot(q, &self.heads[head].mean))
    }

    /// The query's code in every table.
    pub(super) fn query_codes(&self, q: &[f32]) -> Vec<u32> {
        sparse::reference::simhash_codes(q, &self.w, q.len(), self.bits, self.tables)
    }

    /// Segments of the indexed keys (of [`SEGMENT_KEYS`] each, the last partial).
    pub(super) fn segments(&self) -> usize {
        segments(self.end - self.first)
    }
}

/// `−log(u + 1e-4)` for a key at cosine `cos` to the query, `K = bits`, `L = tables`.
pub(super) fn bias_of_cos(cos: f64, bits: usize, tables: usize) -> f32 {
    let u = sampling_probability(collision_probability(cos), bits, tables);
    -((u + U_FLOOR).ln()) as f32
}

/// Intervals of [`BiasTable`] over cos ∈ [−1, 1].
pub(super) const BIAS_TABLE_STEPS: usize = 1 << 13;
/// The most the table's linear interpolation is off the exact bias (a logit), checked by the
/// tests over the (K, L) the budgets give: ~1e-5 of a weight.
pub(super) const BIAS_TABLE_ERROR: f32 = 2e-5;

/// The logit bias sampled at [`BIAS_TABLE_STEPS`]` + 1` cosines, read by linear
/// interpolation. Why: the exact bias takes an `acos`, two logs and an `exp` in f64 per
/// sampled key — ~150 ns, more than reading the key's row — and the fast path weighs ~10⁵ keys
/// per layer. The function is smooth where it moves (flat at both ends: u → 1 as cos → 1,
/// u → 0 as cos → −1, which tames `acos`'s slope there), so 8 Ki intervals hold it within
/// [`BIAS_TABLE_ERROR`] for the K the budgets give. The reference keeps the exact form.
pub(super) struct BiasTable(Vec<f32>);

impl BiasTable {
    /// The table for `K = bits`, `L = tables`; `None` where interpolating it would be off by
    /// more than [`BIAS_TABLE_ERROR`] at some interval's midpoint (a (K, L) whose bias is steep
    /// near cos = ±1: a small K, or L = 2): those keys get the exact form.
    pub(super) fn new(bits: usize, tables: usize) -> Option<Self> {
        let at = |x: f64| -1.0 + 2.0 * x / BIAS_TABLE_STEPS as f64;
        let table = Self((0..=BIAS_TABLE_STEPS).map(|i| bias_of_cos(at(i as f64), bits, tables)).collect());
        let off = |i: usize| {
            let mid = at(i as f64 + 0.5);
            (table.get(mid as f32) - bias_of_cos(mid, bits, tables)).abs()
        };
        (0..BIAS_TABLE_STEPS).all(|i| off(i) < BIAS_TABLE_ERROR / 2.0).then_some(table)
    }

    pub(super) fn get(&self, cos: f32) -> f32 {
        lsh::interpolate(&self.0, cos)
    }
}

/// Host bytes a layer's build holds at its peak: per KV head and table, the codes (4 bytes a
/// key), the bucket list (2) and the run starts; per key its norm.
pub(super) fn build_bytes(kv_heads: usize, n: usize, bits: usize, tables: usize) -> u64 {
    let starts = 4 * ((1u64 << bits) * segments(n) as u64 + 1);
    let per_head = tables as u64 * (6 * n as u64 + starts) + 4 * n as u64;
    kv_heads as u64 * per_head
}

/// Host bytes a layer's index keeps once built: per KV head and table, the bucket list (2 bytes
/// a key) and the run starts; per key its norm.
pub(super) fn kept_bytes(kv_heads: usize, n: usize, bits: usize, tables: usize) -> u64 {
    let starts = 4 * ((1u64 << bits) * segments(n) as u64 + 1);
    kv_heads as u64 * (tables as u64 * (2 * n as u64 + starts) + 4 * n as u64)
}

/// A refused hold of the tables' host memory, with their own remedy beside the budget's.
fn tables_refused(r: host_budget::Refused) -> Error {
    crate::error::refused(r, ", or lower magicpig's budget, tables= or bits=")
}

/// Refuses a build that needs more host memory than is available now, saying what to change:
/// at a million tokens a layer's tables are GiBs (2·L bytes per key and KV head kept, 6·L while
/// building, L growing with the budget) and, layer after layer, would run the machine out of memory, where the OS kills
/// the process instead of failing an allocation.
pub(super) fn check_host_memory(needed: u64, available: Option<u64>, plan: &Plan) -> Result<()> {
    match available {
        Some(free) if needed > free => Err(Error::Invalid(format!(
            "magicpig: the hash tables of keys {}..{} ({} tables of {} bits) need {} of host memory, {} is \
             available; lower the budget, or set tables= or bits= (each table costs 6 bytes per key and KV head while built, 2 kept)",
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
            "magicpig v2 bits={} tables={} keys={}..{} seed={}",
            self.bits, self.tables, self.first, self.end, self.seed
        )
    }
}

impl LayerIndex {
    /// The hyperplanes first (stored, not regenerated: the file must not depend on a random
    /// generator's version), then per KV head the mean, norms and bucket lists.
    pub(super) fn encode(&self) -> Result<Vec<u8>> {
        let mut w = SectionWriter::default();
        w.f32s(&self.w);
        for h in &self.heads {
            w.f32s(&h.mean);
            w.f32s(&h.norms);
            for l in 0..h.tables {
                w.u32s(h.starts(l).iter().copied());
                w.u16s(&h.table(l)?);
            }
        }
        Ok(w.0)
    }

    pub(super) fn decode(bytes: &[u8], name: &str, plan: &Plan, kv_heads: usize, d: usize) -> Result<Self> {
        let mut r = SectionReader::new(bytes, name);
        let n = plan.end - plan.first;
        let planes = r.f32s(d * plan.bits * plan.tables)?;
        let mut heads = Vec::with_capacity(kv_heads);
        for _ in 0..kv_heads {
            let (mean, norms) = (r.f32s(d)?, r.f32s(n)?);
            let segs = segments(n);
            let per_table = (1 << plan.bits) * segs + 1;
            let mut members = HugePages::<u16>::zeroed(plan.tables * n)?;
            let mut starts = HugePages::<u32>::zeroed(plan.tables * per_table)?;
            for l in 0..plan.tables {
                let s = r.u32s(per_table)?;
                let m = r.u16s(n)?;
                // Runs in order, ending at `n`, each within its segment's keys.
                let in_segment = |run: usize| {
                    let keys = SEGMENT_KEYS.min(n - (run % segs) * SEGMENT_KEYS);
                    m[s[run] as usize..s[run + 1] as usize].iter().all(|&x| (x as usize) < keys)
                };
                if s.first() != Some(&0)
                    || s.windows(2).any(|w| w[0] > w[1])
                    || s.last() != Some(&(n as u32))
                    || !(0..s.len() - 1).all(in_segment)
                {
                    return Err(Error::Invalid(format!("index section \"{name}\" has bucket lists out of range")));
                }
                starts[l * per_table..(l + 1) * per_table].copy_from_slice(&s);
                members[l * n..(l + 1) * n].copy_from_slice(&m);
            }
            heads.push(HeadTables::new(mean, norms, (members, starts), plan.bits, plan.tables));
        }
        r.finish()?;
        let (first, end, bits, tables) = (plan.first, plan.end, plan.bits, plan.tables);
        Ok(Self { first, end, bits, tables, w: planes, heads, bias: OnceLock::new(), device: Mutex::new(None) })
    }
}
