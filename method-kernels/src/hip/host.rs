//! HiP's block search for one query head on the CPU, over the saved keys where they lie in host
//! memory ([`HostView`]) and the rows written since, while the GPU runs the step.
//!
//! Why a CPU search beside a GPU: the search reads a few hundred scattered key rows a head each
//! round, eleven rounds at a million tokens — on a GPU those reads cross the host link from
//! the one-launch kernel ([`super::search_host`]), and beside the step they slowed it by a
//! third (an H200 at 1M tokens: 11.21 ms a token with the searches, 8.07 with none;
//! docs/performance.md). The CPU reads the same rows in its own memory, on cores that are
//! otherwise idle through a HiP step, and only the chosen positions go to the device.
//!
//! The rounds are [`super::search_by_rounds`]'s: the same halves, representative blocks and
//! positions, the `n` best kept with ties to the lower candidate, the same expansion. A score
//! is `q·k` summed in f32 over eight lanes (`LANES`) where the reference sums in f64 and the
//! GPU's kernels in their own order: the positions are the same wherever the sums are exact
//! (the tests' integer keys) and may differ on a tie within rounding elsewhere, as the GPU's
//! do.

use candle_core::DType;
use folio_kernels::select::{HostView, Stored};

use super::Search;

/// Lanes a dot product sums in: the loop over them vectorises (a 256-bit register of f32).
const LANES: usize = 8;

/// Rows a round asks the CPU for ahead of the one it scores: a round's rows are scattered over
/// the context, each a wait on DRAM (and on a page walk), so these many are in flight at once.
const PREFETCH_ROWS: usize = 32;

/// One KV head's keys as a search reads them: the saved rows, then the rows written since
/// (`tail`, row-major f32, positions from the saved count on), each saved row rounded to bf16
/// when `bf16` (the dtype the tier's gather gives, where the rows are stored as fp8).
pub struct HeadKeys<'a> {
    pub rows: &'a HostView<'a>,
    pub kvh: usize,
    pub tail: &'a [f32],
    pub bf16: bool,
}

/// Whether a search rounds rows stored as `stored` to bf16, for rows read as `dtype`: where the
/// tier's gather gives bf16 from rows stored otherwise (fp8, f32), as [`HeadKeys::bf16`] asks.
pub fn rounds_to_bf16(dtype: DType, stored: Stored) -> bool {
    dtype == DType::BF16 && !matches!(stored, Stored::Bf16)
}

impl HeadKeys<'_> {
    /// `q·k` of key `pos`, `row` a buffer of `d` values: bf16 and f32 rows read as they lie
    /// where nothing rounds them, others widened (and rounded) into `row` first — the same
    /// values and sum either way.
    fn dot(&self, pos: usize, q: &[f32], row: &mut [f32]) -> f32 {
        let (n, d) = (self.rows.len(), q.len());
        let stored = self.rows.stored();
        if pos < n && !self.bf16 && matches!(stored, Stored::Bf16 | Stored::F32) {
            let rb = stored.row_bytes(d);
            let raw = &self.rows.bytes()[(self.kvh * n + pos) * rb..][..rb];
            return match stored {
                Stored::Bf16 => dot_with(q, raw, |b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)),
                _ => dot_with(q, raw, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            };
        }
        self.row(pos, row);
        dot_with(q, bytemuck_f32(row), |b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Key `pos` into `out` (`d` values).
    fn row(&self, pos: usize, out: &mut [f32]) {
        let n = self.rows.len();
        if pos < n {
            self.rows.row(self.kvh, pos, out);
            if self.bf16 {
                out.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
            }
        } else {
            out.copy_from_slice(&self.tail[(pos - n) * out.len()..][..out.len()]);
        }
    }

    /// Asks for key `pos` ahead of its read (saved rows; the tail's are few and in cache).
    fn prefetch(&self, pos: usize) {
        self.rows.prefetch(self.kvh, pos);
    }

    /// Keys the head holds: the saved rows and the tail's.
    fn len(&self, d: usize) -> usize {
        self.rows.len() + self.tail.len() / d.max(1)
    }
}

/// The positions one query head `q` reads after the search `plan` over `keys`: the sinks
/// `lo..first`, then the `n` chosen blocks' `b` keys each, ascending by block. `plan` must
/// pass [`Search::check`] and every position it scores must be one `keys` holds.
pub fn search_head(keys: &HeadKeys<'_>, q: &[f32], plan: &Search) -> Vec<u32> {
    let (n, b, d) = (plan.n, plan.b, q.len());
    let region_keys = plan.blocks * b;
    let last_row = keys.len(d).saturating_sub(1);
    let mut nodes: Vec<(u32, u32)> = (0..n).map(|j| (plan.edge(j), plan.edge(j + 1))).collect();
    let mut cand = vec![(0u32, 0u32); 2 * n];
    let mut scores: Vec<(f32, u32)> = Vec::with_capacity(2 * n);
    // A round's reads: (candidate, key position), a candidate's `b` together.
    let mut reads: Vec<(u32, usize)> = Vec::with_capacity(2 * n * b);
    let mut row = vec![0f32; d];
    for _ in 0..plan.rounds() {
        // Node j's halves are candidates j and n + j; a one-block node's left half is empty.
        for (j, &(f, l)) in nodes.iter().enumerate() {
            let mid = f + (l - f) / 2;
            cand[j] = (f, mid);
            cand[n + j] = (mid, l);
        }
        // A half's middle block stands for it; its keys past the region repeat the last.
        reads.clear();
        for (c, &(f, l)) in cand.iter().enumerate().filter(|(_, &(f, l))| l > f) {
            let start = (f + (l - f) / 2) as usize * b;
            let last = (start + b).min(region_keys) - 1;
            reads.extend((0..b).map(|o| (c as u32, ((start + o).min(last) + plan.first).min(last_row))));
        }
        scores.clear();
        scores.extend((0..2 * n as u32).map(|c| (f32::NEG_INFINITY, c)));
        reads.iter().take(PREFETCH_ROWS).for_each(|&(_, pos)| keys.prefetch(pos));
        for (i, &(c, pos)) in reads.iter().enumerate() {
            if let Some(&(_, ahead)) = reads.get(i + PREFETCH_ROWS) {
                keys.prefetch(ahead);
            }
            let best = &mut scores[c as usize].0;
            *best = best.max(keys.dot(pos, q, &mut row));
        }
        // The n best, the lower candidate among equals, then in candidate order.
        scores.select_nth_unstable_by(n - 1, |x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        let mut keep: Vec<u32> = scores[..n].iter().map(|s| s.1).collect();
        keep.sort_unstable();
        nodes = keep.iter().map(|&c| cand[c as usize]).collect();
    }
    let mut out = Vec::with_capacity(plan.picks());
    out.extend((plan.lo..plan.first).map(|p| p as u32));
    for &(f, _) in &nodes {
        out.extend((0..b).map(|o| (plan.first + f as usize * b + o) as u32));
    }
    out
}

/// `q·k` in f32 over a row's raw values (`value` reads one from its bytes: each `raw.len() /
/// q.len()` wide), lane `i % LANES` summing element `i`, the lanes then summed in order.
#[inline(always)]
fn dot_with(q: &[f32], raw: &[u8], value: impl Fn(&[u8]) -> f32) -> f32 {
    let w = raw.len() / q.len().max(1);
    let mut acc = [0f32; LANES];
    let (qc, kc) = (q.chunks_exact(LANES), raw.chunks_exact(LANES * w));
    let (qr, kr) = (qc.remainder(), kc.remainder());
    for (qs, ks) in qc.zip(kc) {
        for i in 0..LANES {
            acc[i] += qs[i] * value(&ks[i * w..(i + 1) * w]);
        }
    }
    for (i, (a, k)) in qr.iter().zip(kr.chunks_exact(w)).enumerate() {
        acc[i] += a * value(k);
    }
    acc.iter().sum()
}

/// An f32 buffer's bytes, in the machine's order.
fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte is a valid u8; the length is the buffer's.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
