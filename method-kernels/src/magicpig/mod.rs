//! MagicPIG's sample where the GPU can run it: the walk of a layer's LSH tables (keys whose code
//! equals the query's in at least two tables) and the importance-weighted attention over what
//! it found, both reading the tables' bucket lists and the K/V rows where they lie in host
//! memory, mapped into the device's address space (the lists' run starts from a copy on the
//! device, [`Tables`]).
//!
//! Why it exists beside the paper's split, which keeps the sampled rows off the host link: the
//! CPU's side (a walk that waits on DRAM for each bucket run, then scattered row reads) is most
//! of a step at a million tokens on the 16-core host of the H100 machine. The GPU walks the
//! tables in two fifths of the pool's time (9 ms a step against 23); the host and the link read
//! scattered rows at ~20–30 GB/s each (the GPU's with its warps sweeping a head's picks
//! together; ~15 when each warp read a contiguous share). So MagicPIG's default splits the
//! sample: the GPU walks the CPU's heads' tables ([`Tables::walk`] of a head range) and reports
//! their picks and the codes into host memory ([`Sample::report`]), then walks the first heads'
//! tables and attends their samples over the link ([`attend`]) while the CPU attends the
//! others' in host memory: 44.8–53.2 ms a token at 1M across three H100 hosts (18 heads of 28
//! on the GPU), against the CPU's 97.7 alone (docs/performance.md). The CPU's heads go first
//! because the host waits for their report: walked after the GPU's heads, it came ~4 ms a
//! step later (54.1 against 44.8 ms a token on one host). The tables' layout is the
//! CPU walk's (bucket lists of 16-bit offsets within 64 Ki-key segments, a start per (code,
//! segment) run), so one index serves both: the members are registered in place, and only the
//! starts (3% of the bytes) are copied to the device, where each table's dependent read of its
//! start no longer waits on the link ([`Tables`]).
//!
//! The walk runs a block per (segment, query head): the segment's two bitsets (seen once,
//! seen twice) in shared memory, every table's run for the segment read and its members'
//! bits set by atomics; the keys of the second set are written ascending into a per-segment
//! slot of a `[heads, segments · SEGMENT_KEYS]` buffer, their number beside it — the slots are
//! as long as a segment, so no sample is ever cut short, and no count crosses back to the host
//! (which would stop the device's queue every layer). The attention gives each query head's
//! sample to `ATTEND_BLOCKS × 8` warps, strided (warp c takes picks c, c + 64, …: the warps read
//! neighbouring positions together, which doubled the rate over contiguous shares — what binds
//! scattered reads of 56 GB of host memory is how far apart the reads in flight fall, not how
//! many there are), a pick at a time (its K and V rows loaded together), with an online
//! softmax; the partials merge by LSE as the row kernel's do.
//!
//! The reference is the definition: collisions counted per key over every table's bucket
//! list, and the softmax of `scale · q·k + bias(cos)` over the sample in f64.
//!
//! Costs: the walk reads `Σ` over tables of a bucket run (2 bytes a member) per query head;
//! the attention `2 · d · b` bytes a pick (K and V rows) over the host link, bound by where the
//! reads fall (~23–27 GB/s of the link's 55 at 1M), not by the link.

#[cfg(feature = "cuda")]
mod cuda;

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use folio_kernels::select::{HostRows, SharedHost, Stored};

mod host;
pub use host::{attend_partial, merge_partials, prefetch_lines, Partial};

/// Keys per segment of a bucket list, whose members are stored as 16-bit offsets within it
/// (SEG_KEYS in method-kernels/cuda/magicpig.cu).
pub const SEGMENT_KEYS: usize = 1 << 16;

/// The most tables and segments the kernels hold in shared memory (MAX_TABLES, MAX_SEGS).
pub const MAX_TABLES: usize = 1024;
pub const MAX_SEGMENTS: usize = 2048;

/// Largest head dim the attention holds in a warp's registers (32 lanes × LANE_VALUES).
pub const MAX_HEAD_DIM: usize = 256;

/// Segments of `n` indexed keys (at least one).
pub fn segments(n: usize) -> usize {
    n.div_ceil(SEGMENT_KEYS).max(1)
}

/// `table` (a function sampled at `table.len()` evenly spaced cosines over [−1, 1]) at `cos`,
/// by linear interpolation: the fast paths' bias (MagicPIG's `BiasTable`). A NaN cosine stays
/// NaN here; the kernel's clamp (`fmaxf`) reads it as −1.
pub fn interpolate(table: &[f32], cos: f32) -> f32 {
    let steps = table.len() - 1;
    let x = (cos.clamp(-1.0, 1.0) + 1.0) * 0.5 * steps as f32;
    let i = (x as usize).min(steps - 1);
    let frac = x - i as f32;
    table[i] + frac * (table[i + 1] - table[i])
}

/// One layer's tables: for each KV head, its bucket lists — `members` (`[tables][n]` u16, each
/// table's keys sorted by (code, key) as offsets within their segment) and `starts`
/// (`[tables][2^bits · segments + 1]` u32, where the run of code `c` in segment `s` starts, at
/// `c · segments + s`) — in host memory; on a GPU the members are read where they lie
/// (registered in place) and the starts from a copy in device memory.
///
/// Why the starts are copied: a walk reads each table's start before its run, so over the
/// link every table cost two dependent reads of host memory, each at a page of its own, and a
/// read of host memory waits on its page's translation. Read from device memory, the walk's
/// reads of 28 query heads' runs at a million keys took 4.08 ms a step against 6.52 (an H200,
/// 83 tables: results/2026-12-01b-magicpig/zc-probe6.cu), for 3% of the lists' bytes on the
/// device (17.3 MB a layer at 2048 of 1M keys, (K, L) = (10, 66)).
pub struct Tables {
    lists: Vec<(Arc<SharedHost>, Arc<SharedHost>)>,
    n: usize,
    bits: usize,
    tables: usize,
    /// The lists' device addresses: every KV head's members, then every KV head's starts
    /// (`[2 · kv_heads]` i64).
    #[cfg(feature = "cuda")]
    addresses: Option<Tensor>,
    /// Every KV head's starts in device memory, one after another (what `addresses` points at).
    #[cfg(feature = "cuda")]
    _starts: Option<Tensor>,
}

impl Tables {
    /// Tables of `tables` codes of `bits` bits over `n` keys; the members must be registered with
    /// `device` when it is a GPU ([`SharedHost::new`] on it), the starts need not be (a GPU reads
    /// a copy).
    pub fn new(
        device: &Device,
        lists: Vec<(Arc<SharedHost>, Arc<SharedHost>)>,
        (n, bits, tables): (usize, usize, usize),
    ) -> Result<Self> {
        let per_table = (1usize << bits) * segments(n) + 1;
        for (members, starts) in &lists {
            if members.bytes().len() < 2 * tables * n || starts.bytes().len() < 4 * tables * per_table {
                candle_core::bail!(
                    "lsh tables: lists of {} and {} bytes for {tables} tables of {bits} bits over {n} keys",
                    members.bytes().len(),
                    starts.bytes().len()
                );
            }
            if members.registered() != device.is_cuda() {
                candle_core::bail!("lsh tables: the lists are not registered with {device:?}");
            }
        }
        if tables > MAX_TABLES || segments(n) > MAX_SEGMENTS || n > u32::MAX as usize || bits > 16 {
            candle_core::bail!("lsh tables: {tables} tables of {bits} bits over {n} keys are past the kernels' limits");
        }
        #[cfg(feature = "cuda")]
        let (addresses, _starts) = match device {
            Device::Cuda(_) => {
                let words = tables * per_table;
                let starts: Vec<u32> = lists
                    .iter()
                    .flat_map(|(_, s)| s.bytes()[..4 * words].chunks_exact(4))
                    .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")))
                    .collect();
                let starts = Tensor::from_vec(starts, lists.len() * words, device)?;
                let base = cuda::device_address(&starts)?;
                let mut at = Vec::with_capacity(2 * lists.len());
                for (members, _) in &lists {
                    at.push(members.device_address()? as i64);
                }
                at.extend((0..lists.len()).map(|h| (base + (4 * h * words) as u64) as i64));
                (Some(Tensor::from_vec(at, 2 * lists.len(), device)?), Some(starts))
            }
            _ => (None, None),
        };
        Ok(Self {
            lists,
            n,
            bits,
            tables,
            #[cfg(feature = "cuda")]
            addresses,
            #[cfg(feature = "cuda")]
            _starts,
        })
    }

    pub fn segments(&self) -> usize {
        segments(self.n)
    }

    /// Per query head `h` of `range` (all of them: `0..heads`) of `codes [heads, tables]` (u32,
    /// on the tables' device; KV head `h / group`), the keys whose code equals the head's in at
    /// least two tables, from key `skip` on, as positions `first + key` (a code is taken modulo
    /// `2^bits`, so that no code reads past the lists). A range's walk is the sample of those
    /// heads alone (head `range.start` its first): MagicPIG walks the CPU's heads first, so that
    /// the host can start on them while the GPU walks its own.
    pub fn walk(
        &self,
        codes: &Tensor,
        group: usize,
        range: Range<usize>,
        (first, skip): (usize, usize),
    ) -> Result<Sample> {
        let (all, tables) = codes.dims2()?;
        let fits = range.start < range.end && range.end <= all;
        if tables != self.tables
            || group == 0
            || all != group * self.lists.len()
            || codes.dtype() != DType::U32
            || !fits
        {
            candle_core::bail!(
                "lsh walk: heads {range:?} of codes {:?} {:?} with group {group} over {} KV heads of {} tables",
                codes.dims(),
                codes.dtype(),
                self.lists.len(),
                self.tables
            );
        }
        let heads = range.len();
        let segs = self.segments();
        // Positions, and the slots' offsets the report gathers by, are u32.
        if first + self.n > u32::MAX as usize || buf_len(heads, segs) > u32::MAX as usize {
            candle_core::bail!("lsh walk: {heads} heads over keys {first}..{} are past u32 positions", first + self.n);
        }
        #[cfg(feature = "cuda")]
        if let Some(addresses) = &self.addresses {
            let dims = (self.n, self.bits, group, range.start, first, skip);
            let buf = cuda::lsh_walk(&codes.narrow(0, range.start, heads)?.contiguous()?, addresses, dims)?;
            return Ok(Sample { buf, heads, head0: range.start, group, segments: segs, first, n: self.n });
        }
        let host: Vec<u32> = codes.flatten_all()?.to_vec1()?;
        let buf = self.walk_reference(&host, range.clone(), group, (first, skip));
        let buf = Tensor::from_vec(buf, buf_len(heads, segs), codes.device())?;
        Ok(Sample { buf, heads, head0: range.start, group, segments: segs, first, n: self.n })
    }

    /// The definition: per query head of `range` and key, the tables whose bucket of the head's
    /// code holds the key, counted; the keys counted twice or more, ascending, in the layout of
    /// the range's sample.
    fn walk_reference(
        &self,
        codes: &[u32],
        range: Range<usize>,
        group: usize,
        (first, skip): (usize, usize),
    ) -> Vec<u32> {
        let (n, segs, tables) = (self.n, self.segments(), self.tables);
        let per_table = (1usize << self.bits) * segs + 1;
        let cap = segs * SEGMENT_KEYS;
        let heads = range.len();
        let mut buf = vec![0u32; buf_len(heads, segs)];
        for (row, h) in range.enumerate() {
            let (members, starts) = &self.lists[h / group];
            let (members, starts) = (members.bytes(), starts.bytes());
            let member = |i: usize| u16::from_ne_bytes([members[2 * i], members[2 * i + 1]]) as usize;
            let start = |i: usize| u32::from_ne_bytes(starts[4 * i..4 * i + 4].try_into().expect("4 bytes")) as usize;
            let mut hits = vec![0u32; n];
            for l in 0..tables {
                let c = codes[h * tables + l] as usize & ((1 << self.bits) - 1);
                for s in 0..segs {
                    let at = l * per_table + c * segs + s;
                    for i in start(at)..start(at + 1) {
                        hits[s * SEGMENT_KEYS + member(l * n + i)] += 1;
                    }
                }
            }
            for s in 0..segs {
                let keys = (s * SEGMENT_KEYS..((s + 1) * SEGMENT_KEYS).min(n)).filter(|&i| i >= skip && hits[i] >= 2);
                let mut count = 0;
                for (j, i) in keys.enumerate() {
                    buf[row * cap + s * SEGMENT_KEYS + j] = (first + i) as u32;
                    count = j + 1;
                }
                buf[heads * cap + row * segs + s] = count as u32;
            }
        }
        buf
    }
}

/// u32s of a sample's buffer: every segment's slot of picks per head, then the counts.
fn buf_len(heads: usize, segs: usize) -> usize {
    heads * segs * SEGMENT_KEYS + heads * segs
}

/// A walk's result on its device: per query head and segment, the picked positions ascending
/// from the segment's slot on, and their number (`[heads · segments · SEGMENT_KEYS]` then
/// `[heads · segments]`, u32).
pub struct Sample {
    buf: Tensor,
    heads: usize,
    /// The query head the sample's first is (a walk of a range of heads).
    head0: usize,
    /// Query heads per KV head (head `h` walked KV head `h / group`'s tables).
    group: usize,
    segments: usize,
    /// The walk's keys: positions `first..first + n`.
    first: usize,
    n: usize,
}

impl Sample {
    /// Each query head's positions, ascending (for reports).
    pub fn positions(&self) -> Result<Vec<Vec<u32>>> {
        Ok(self.report(0..self.heads, None)?.wait()?.0)
    }

    /// The positions of query heads `heads`, and `also` (u32 on the sample's device), on their
    /// way to the host: on a GPU one kernel (`lsh_report`) writes the range's counts, `also`
    /// and the picks packed head after head into page-locked host memory mapped into the
    /// device, and the host waits for that kernel alone ([`Report::wait`]) — what is queued
    /// after it, the GPU's own share of the attention, runs while the host reads. Elsewhere
    /// copied at once. Neither narrowed views nor a copy per step: a view's copy copies its
    /// whole buffer (candle's `to_vec1` takes the storage: 117 MB a layer at a million keys,
    /// 107 ms), and the two copies of the first versions (counts with the codes, then the
    /// picks gathered on the device) each waited on the whole queue, 0.4 ms a layer on the H100
    /// machine.
    pub fn report(&self, heads: Range<usize>, also: Option<&Tensor>) -> Result<Report> {
        if heads.start > heads.end || heads.end > self.heads {
            candle_core::bail!("lsh sample: heads {heads:?} of {}", self.heads);
        }
        let also = also.map(|a| a.flatten_all()?.contiguous()).transpose()?;
        let n_also = also.as_ref().map_or(0, Tensor::elem_count);
        let (segs, cap) = (self.segments, self.segments * SEGMENT_KEYS);
        let shape = (heads.len(), segs, n_also);
        #[cfg(feature = "cuda")]
        if self.buf.device().is_cuda() {
            let dims = (self.heads, segs, heads.start, heads.len());
            let queued = cuda::lsh_report(&self.buf, also.as_ref(), dims)?;
            return Ok(Report { shape, words: Words::Queued(queued) });
        }
        let counts: Vec<u32> =
            self.buf.narrow(0, self.heads * cap + heads.start * segs, heads.len() * segs)?.to_vec1()?;
        let mut words = counts.clone();
        if let Some(also) = &also {
            words.extend(also.to_vec1::<u32>()?);
        }
        for (i, c) in counts.into_iter().enumerate() {
            let slot = (heads.start * segs + i) * SEGMENT_KEYS;
            words.extend(self.buf.narrow(0, slot, c as usize)?.to_vec1::<u32>()?);
        }
        Ok(Report { shape, words: Words::Ready(words) })
    }
}

/// A [`Sample::report`] on its way to the host: `(heads, segments, also)` words' worth of
/// counts and `also`, then the picks.
pub struct Report {
    shape: (usize, usize, usize),
    words: Words,
}

enum Words {
    Ready(Vec<u32>),
    #[cfg(feature = "cuda")]
    Queued(cuda::LshReport),
}

impl Report {
    /// Each of the range's heads' positions, ascending, and `also`'s words.
    pub fn wait(self) -> Result<(Vec<Vec<u32>>, Vec<u32>)> {
        let (heads, segs, n_also) = self.shape;
        // Without CUDA, `Words` has one variant.
        #[allow(clippy::infallible_destructuring_match)]
        let words = match self.words {
            Words::Ready(words) => words,
            #[cfg(feature = "cuda")]
            Words::Queued(queued) => queued.wait()?,
        };
        let (counts, rest) = words.split_at(heads * segs);
        let (also, mut rest) = rest.split_at(n_also);
        let picks = counts
            .chunks(segs)
            .map(|head| {
                let (mine, after) = rest.split_at(head.iter().map(|&c| c as usize).sum());
                rest = after;
                mine.to_vec()
            })
            .collect();
        Ok((picks, also.to_vec()))
    }
}

/// Whether [`attend`] reads these rows on a GPU: K and V both bf16, both f32 or both fp8 (rows
/// of mixed dtypes, a bf16-fp8 file's, stay on the CPU), a head dim that is a multiple of 4 up
/// to [`MAX_HEAD_DIM`].
pub fn reads(k: &HostRows, v: &HostRows) -> bool {
    let alike = matches!(
        (k.stored(), v.stored()),
        (Stored::Bf16, Stored::Bf16) | (Stored::F32, Stored::F32) | (Stored::Fp8 { .. }, Stored::Fp8 { .. })
    );
    alike && k.dim().is_multiple_of(4) && k.dim() <= MAX_HEAD_DIM
}

/// What weighs a sampled key, per layer: the bias sampled over the cosine (`steps + 1` values
/// over [−1, 1], read by [`interpolate`]) and each indexed key's centred norm
/// (`[kv_heads][n]`, keys `first..first + n`), as one f32 tensor on the rows' device.
pub struct Weights<'a> {
    pub table_and_norms: &'a Tensor,
    pub steps: usize,
    pub first: usize,
    pub n: usize,
}

/// Each query head's attention over its `sample`, rows read from `k`/`v` where they lie:
/// logits `scale · q·k + bias(cos)` with `cos = (q·k − q·mean) / (|q| · max(|k − mean|, MIN))`,
/// softmax over the sample. `query [heads, d + 2]` f32: `q`, then `|q|` and `q·mean` of its KV
/// head's keys, the first `heads` of the sample's (head `h` walked KV head `h / group`'s
/// tables): the GPU attends a layer's first heads while the CPU attends the rest, `MagicPIG`'s
/// `gpu_attend`. Returns `(out [heads, d], lse [heads])` f32 (zeros and −∞ for an empty sample).
pub fn attend(
    query: &Tensor,
    sample: &Sample,
    (k, v): (&HostRows, &HostRows),
    weights: &Weights<'_>,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let (heads, d2) = query.dims2()?;
    let d = k.dim();
    let kv_heads = k.heads();
    let group = sample.group;
    // A sample of a range of heads from 0 on: the kernel reads KV head h / group for its head h.
    let ok = heads <= sample.heads
        && sample.head0 == 0
        && d2 == d + 2
        && query.dtype() == DType::F32
        && (v.heads(), v.len(), v.dim()) == (k.heads(), k.len(), k.dim())
        && heads > 0
        && heads.div_ceil(group) <= kv_heads
        && weights.first + weights.n <= k.len()
        && (sample.first, sample.n) == (weights.first, weights.n)
        && weights.table_and_norms.elem_count() == weights.steps + 1 + kv_heads * weights.n
        && weights.steps >= 1;
    if !ok {
        candle_core::bail!(
            "lsh attend: query {:?} {:?} (no more heads than sampled), {} heads sampled from keys {}..{} from head {} on \
             (a sample of the first heads: 0), rows [{}, {}, {d}], keys {}..{} weighed",
            query.dims(),
            query.dtype(),
            sample.heads,
            sample.first,
            sample.first + sample.n,
            sample.head0,
            k.heads(),
            k.len(),
            weights.first,
            weights.first + weights.n
        );
    }
    #[cfg(feature = "cuda")]
    if query.device().is_cuda() {
        if !reads(k, v) || sample.segments > MAX_SEGMENTS {
            candle_core::bail!(
                "lsh attend: rows stored as {:?} and {:?} of head dim {d} (bf16, f32 or fp8 alike, a multiple of 4 up \
                 to {MAX_HEAD_DIM}), or a sample of {} segments (at most {MAX_SEGMENTS})",
                k.stored(),
                v.stored(),
                sample.segments
            );
        }
        let dims = (heads, sample.heads, sample.segments, d, k.len(), group, weights.first, weights.n, weights.steps);
        return cuda::lsh_attend(
            &query.contiguous()?,
            &sample.buf,
            (k.source()?, v.source()?),
            (k.dtype(), v.dtype()),
            weights.table_and_norms,
            dims,
            scale,
        );
    }
    let (kh, vh) = (k.host()?, v.host()?);
    let dev = query.device().clone();
    let query: Vec<f32> = query.flatten_all()?.to_vec1()?;
    let w: Vec<f32> = weights.table_and_norms.flatten_all()?.to_vec1()?;
    let (table, norms) = w.split_at(weights.steps + 1);
    let picks = sample.report(0..heads, None)?.wait()?.0;
    let (mut out, mut lse) = (vec![0f32; heads * d], vec![f32::NEG_INFINITY; heads]);
    let (mut krow, mut vrow) = (vec![0f32; d], vec![0f32; d]);
    for (h, pick) in picks.iter().enumerate() {
        let kvh = h / group;
        let q = &query[h * (d + 2)..(h + 1) * (d + 2)];
        let (q_norm, q_mean) = (q[d] as f64, q[d + 1] as f64);
        let logits: Vec<f64> = pick
            .iter()
            .map(|&p| {
                kh.row(kvh, p as usize, &mut krow);
                let qk: f64 = q[..d].iter().zip(&krow).map(|(a, b)| *a as f64 * *b as f64).sum();
                let kn = norms[kvh * weights.n + p as usize - weights.first].max(f32::MIN_POSITIVE) as f64;
                scale as f64 * qk + interpolate(table, ((qk - q_mean) / (q_norm * kn)) as f32) as f64
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            continue;
        }
        let mut acc = vec![0f64; d];
        let mut sum = 0f64;
        for (&p, z) in pick.iter().zip(&logits) {
            let e = (z - max).exp();
            sum += e;
            vh.row(kvh, p as usize, &mut vrow);
            acc.iter_mut().zip(&vrow).for_each(|(a, x)| *a += e * *x as f64);
        }
        out[h * d..(h + 1) * d].iter_mut().zip(&acc).for_each(|(o, a)| *o = (a / sum) as f32);
        lse[h] = (max + sum.ln()) as f32;
    }
    Ok((Tensor::from_vec(out, (heads, d), &dev)?, Tensor::from_vec(lse, heads, &dev)?))
}
