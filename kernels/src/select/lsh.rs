//! MagicPIG's sample where the GPU can run it: the walk of a layer's LSH tables (keys whose code
//! equals the query's in at least two tables) and the importance-weighted attention over what
//! it found, both reading the tables and the K/V rows where they lie in host memory, mapped
//! into the device's address space.
//!
//! Why it exists beside the paper's split, which keeps the sampled rows off the host link: the
//! CPU's side (a walk that waits on DRAM for each bucket run, then scattered row reads) is most
//! of a step at a million tokens on the 16-core host of the H100 machine. The GPU walks the
//! tables in two fifths of the pool's time (9 ms a step against 23); the host reads scattered rows
//! faster than the link brings them (~30 GB/s against ~10). So MagicPIG's default splits the
//! sample: the GPU walks every head's tables, then attends half the heads' samples over the
//! link while the CPU attends the other half's in host memory ([`Sample::positions_with`],
//! [`Sample::first_heads`]): 57.9 ms a token at 1M on one H100 against the CPU's 97.7 on the
//! same host (docs/performance.md). The tables' layout is the
//! CPU walk's (bucket lists of 16-bit offsets within 64 Ki-key segments, a start per (code,
//! segment) run), so one index serves both and neither needs a copy: the lists are registered
//! in place.
//!
//! The walk runs a block per (segment, query head): the segment's two bitsets (seen once,
//! seen twice) in shared memory, every table's run for the segment read and its members'
//! bits set by atomics; the keys of the second set are written ascending into a per-segment
//! slot of a `[heads, segments · SEGMENT_KEYS]` buffer, their number beside it — the slots are
//! as long as a segment, so no sample is ever cut short, and no count crosses back to the host
//! (which would stop the device's queue every layer). The attention gives each query head's
//! sample to `ATTEND_BLOCKS × 8` warps, a warp a contiguous share, a pick at a time (its K and
//! V rows loaded together), with an online softmax; the partials merge by LSE as the row
//! kernel's do.
//!
//! The reference is the definition: collisions counted per key over every table's bucket
//! list, and the softmax of `scale · q·k + bias(cos)` over the sample in f64.
//!
//! Costs: the walk reads `Σ` over tables of a bucket run (2 bytes a member) per query head;
//! the attention `2 · d · b` bytes a pick (K and V rows) over the host link — link-bound.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use super::{HostRows, SharedHost, Stored};

/// Keys per segment of a bucket list, whose members are stored as 16-bit offsets within it
/// (SEG_KEYS in kernels/cuda/lsh.cu).
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
/// `c · segments + s`) — in host memory shared with the device (registered in place on a GPU).
pub struct Tables {
    lists: Vec<(Arc<SharedHost>, Arc<SharedHost>)>,
    n: usize,
    bits: usize,
    tables: usize,
    /// The lists' device addresses: every KV head's members, then every KV head's starts
    /// (`[2 · kv_heads]` i64).
    #[cfg(feature = "cuda")]
    addresses: Option<Tensor>,
}

impl Tables {
    /// Tables of `tables` codes of `bits` bits over `n` keys; the lists must be registered with
    /// `device` when it is a GPU ([`SharedHost::new`] on it).
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
            if members.registered() != device.is_cuda() || starts.registered() != device.is_cuda() {
                candle_core::bail!("lsh tables: the lists are not registered with {device:?}");
            }
        }
        if tables > MAX_TABLES || segments(n) > MAX_SEGMENTS || n > u32::MAX as usize || bits > 16 {
            candle_core::bail!("lsh tables: {tables} tables of {bits} bits over {n} keys are past the kernels' limits");
        }
        #[cfg(feature = "cuda")]
        let addresses = match device {
            Device::Cuda(_) => {
                let mut at = Vec::with_capacity(2 * lists.len());
                for (members, _) in &lists {
                    at.push(members.device_address()? as i64);
                }
                for (_, starts) in &lists {
                    at.push(starts.device_address()? as i64);
                }
                Some(Tensor::from_vec(at, 2 * lists.len(), device)?)
            }
            _ => None,
        };
        Ok(Self {
            lists,
            n,
            bits,
            tables,
            #[cfg(feature = "cuda")]
            addresses,
        })
    }

    pub fn segments(&self) -> usize {
        segments(self.n)
    }

    /// Per query head of `codes [heads, tables]` (u32, on the tables' device; KV head
    /// `h / group`), the keys whose code equals the head's in at least two tables, from key
    /// `skip` on, as positions `first + key` (a code is taken modulo `2^bits`, so that no code
    /// reads past the lists).
    pub fn walk(&self, codes: &Tensor, group: usize, (first, skip): (usize, usize)) -> Result<Sample> {
        let (heads, tables) = codes.dims2()?;
        if tables != self.tables || group == 0 || heads != group * self.lists.len() || codes.dtype() != DType::U32 {
            candle_core::bail!(
                "lsh walk: codes {:?} {:?} with group {group} over {} KV heads of {} tables",
                codes.dims(),
                codes.dtype(),
                self.lists.len(),
                self.tables
            );
        }
        let segs = self.segments();
        // Positions, and the slots' offsets the report gathers by, are u32.
        if first + self.n > u32::MAX as usize || buf_len(heads, segs) > u32::MAX as usize {
            candle_core::bail!("lsh walk: {heads} heads over keys {first}..{} are past u32 positions", first + self.n);
        }
        #[cfg(feature = "cuda")]
        if let Some(addresses) = &self.addresses {
            let dims = (self.n, self.bits, group, first, skip);
            let buf = super::cuda::lsh_walk(&codes.contiguous()?, addresses, dims)?;
            return Ok(Sample { buf, heads, group, segments: segs, first, n: self.n });
        }
        let host: Vec<u32> = codes.flatten_all()?.to_vec1()?;
        let buf = self.walk_reference(&host, heads, group, (first, skip));
        let buf = Tensor::from_vec(buf, buf_len(heads, segs), codes.device())?;
        Ok(Sample { buf, heads, group, segments: segs, first, n: self.n })
    }

    /// The definition: per query head and key, the tables whose bucket of the head's code holds
    /// the key, counted; the keys counted twice or more, ascending, in the sample's layout.
    fn walk_reference(&self, codes: &[u32], heads: usize, group: usize, (first, skip): (usize, usize)) -> Vec<u32> {
        let (n, segs, tables) = (self.n, self.segments(), self.tables);
        let per_table = (1usize << self.bits) * segs + 1;
        let cap = segs * SEGMENT_KEYS;
        let mut buf = vec![0u32; buf_len(heads, segs)];
        for h in 0..heads {
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
                    buf[h * cap + s * SEGMENT_KEYS + j] = (first + i) as u32;
                    count = j + 1;
                }
                buf[heads * cap + h * segs + s] = count as u32;
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
        Ok(self.positions_with(0..self.heads, None)?.0)
    }

    /// The positions of query heads `heads`, ascending, each head's, and `also` (u32 on the
    /// sample's device, flattened) copied back in the same transfer as the range's counts;
    /// then the range's picks gathered on the device into one run and copied. Two copies to
    /// the host whatever the range, each a round trip that waits on the device: the first
    /// version (counts, an index uploaded, a gather, the codes apart) took 1.0 ms a layer in
    /// this span on the H100 machine, this one 0.4. Gathered, not narrowed: a view's copy
    /// copies its whole buffer (candle's `to_vec1` takes the storage: 117 MB a layer at a
    /// million keys, 107 ms).
    pub fn positions_with(&self, heads: Range<usize>, also: Option<&Tensor>) -> Result<(Vec<Vec<u32>>, Vec<u32>)> {
        if heads.start > heads.end || heads.end > self.heads {
            candle_core::bail!("lsh sample: heads {heads:?} of {}", self.heads);
        }
        let (segs, cap) = (self.segments, self.segments * SEGMENT_KEYS);
        let counts = self.buf.narrow(0, self.heads * cap + heads.start * segs, heads.len() * segs)?;
        let copied: Vec<u32> = match (also, heads.is_empty()) {
            (Some(also), false) => Tensor::cat(&[&counts, &also.flatten_all()?], 0)?.to_vec1()?,
            (Some(also), true) => also.flatten_all()?.to_vec1()?,
            (None, false) => counts.force_contiguous()?.to_vec1()?,
            (None, true) => Vec::new(),
        };
        let (counts, also) = copied.split_at(heads.len() * segs);
        let all = self.gather(heads.start, counts)?;
        let mut rest = all.as_slice();
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

    /// The picks of the heads from `h0` on whose slots' `counts` these are, each slot's filled
    /// part in turn: on a GPU gathered there into one run (`lsh_gather`), one copy back;
    /// elsewhere slot by slot.
    fn gather(&self, h0: usize, counts: &[u32]) -> Result<Vec<u32>> {
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        if total == 0 {
            // Nothing to copy (an empty range, or no key collided twice): no launch, no
            // zero-byte allocation, no round trip.
            return Ok(Vec::new());
        }
        #[cfg(feature = "cuda")]
        if self.buf.device().is_cuda() {
            let dims = (self.heads, self.segments, h0, counts.len() / self.segments, total);
            return super::cuda::lsh_gather(&self.buf, dims)?.to_vec1();
        }
        let mut all = Vec::new();
        for (i, &c) in counts.iter().enumerate() {
            let slot = (h0 * self.segments + i) * SEGMENT_KEYS;
            all.extend(self.buf.narrow(0, slot, c as usize)?.to_vec1::<u32>()?);
        }
        Ok(all)
    }

    /// The sample of the first `heads` query heads, whole KV heads' worth (`heads` a multiple of
    /// the group), in a buffer of its own: the counts lie after every head's slots, so a view
    /// cannot hold them; the copy stays on the device (a GPU attends part of a layer's heads
    /// while the CPU attends the rest, `MagicPIG`'s `gpu_attend`).
    pub fn first_heads(&self, heads: usize) -> Result<Sample> {
        if heads > self.heads || !heads.is_multiple_of(self.group) {
            candle_core::bail!("lsh sample: the first {heads} of {} heads in groups of {}", self.heads, self.group);
        }
        let cap = self.segments * SEGMENT_KEYS;
        let slots = self.buf.narrow(0, 0, heads * cap)?;
        let counts = self.buf.narrow(0, self.heads * cap, heads * self.segments)?;
        Ok(Sample { buf: Tensor::cat(&[slots, counts], 0)?, heads, ..*self })
    }
}

/// Whether [`attend`] reads these rows on a GPU: K and V both bf16 or both f32 (fp8 rows stay
/// on the CPU), a head dim that is a multiple of 4 up to [`MAX_HEAD_DIM`].
pub fn reads(k: &HostRows, v: &HostRows) -> bool {
    let alike = matches!((k.stored, v.stored), (Stored::Bf16, Stored::Bf16) | (Stored::F32, Stored::F32));
    alike && k.d.is_multiple_of(4) && k.d <= MAX_HEAD_DIM
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
/// head's keys (head `h` the walk's: KV head `h / group`, also of a [`Sample::first_heads`]).
/// Returns `(out [heads, d], lse [heads])` f32 (zeros and −∞ for an empty sample).
pub fn attend(
    query: &Tensor,
    sample: &Sample,
    (k, v): (&HostRows, &HostRows),
    weights: &Weights<'_>,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let (heads, d2) = query.dims2()?;
    let d = k.d;
    let kv_heads = k.heads;
    let group = sample.group;
    let ok = heads == sample.heads
        && d2 == d + 2
        && query.dtype() == DType::F32
        && (v.heads, v.n, v.d) == (k.heads, k.n, k.d)
        && heads > 0
        && heads.div_ceil(group) <= kv_heads
        && weights.first + weights.n <= k.n
        && (sample.first, sample.n) == (weights.first, weights.n)
        && weights.table_and_norms.elem_count() == weights.steps + 1 + kv_heads * weights.n
        && weights.steps >= 1;
    if !ok {
        candle_core::bail!(
            "lsh attend: query {:?} {:?}, {} heads sampled from keys {}..{}, rows [{}, {}, {d}], keys {}..{} weighed",
            query.dims(),
            query.dtype(),
            sample.heads,
            sample.first,
            sample.first + sample.n,
            k.heads,
            k.n,
            weights.first,
            weights.first + weights.n
        );
    }
    #[cfg(feature = "cuda")]
    if query.device().is_cuda() {
        if !reads(k, v) || sample.segments > MAX_SEGMENTS {
            candle_core::bail!(
                "lsh attend: rows stored as {:?} and {:?} of head dim {d} (bf16 or f32 alike, a multiple of 4 up to \
                 {MAX_HEAD_DIM}), or a sample of {} segments (at most {MAX_SEGMENTS})",
                k.stored,
                v.stored,
                sample.segments
            );
        }
        let dims = (heads, sample.segments, d, k.n, group, weights.first, weights.n, weights.steps);
        return super::cuda::lsh_attend(
            &query.contiguous()?,
            &sample.buf,
            (k.source()?, v.source()?),
            (k.dtype, v.dtype),
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
    let picks = sample.positions()?;
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
