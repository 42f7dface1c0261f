//! The CPU's side of MagicPIG: each query head attends its own picked rows straight from host
//! memory, so that the sample (1–2% of a million rows per query head) never crosses the host
//! link — the paper's split, bound by the host's memory bandwidth.
//!
//! Why explicit lanes and a dispatch at run time: a step reads ~10⁵ scattered rows a layer, and
//! each row is decoded (bf16 is the top half of an f32: a shift), dotted with the query and,
//! for V, added into the output. Rust does not reassociate a float sum, so `iter().sum()` adds
//! one product at a time, and the baseline x86-64 target has 4-wide SSE2 only. The bodies below
//! keep [`LANES`] independent partial sums (which the compiler vectorises without reordering
//! anything) and are compiled three times — AVX-512, AVX2 and the baseline — the widest
//! the CPU has chosen when called (`is_x86_feature_detected!`, a cached flag). Rejected:
//! `-C target-cpu=native` (a binary that faults on an older CPU), a SIMD crate (a dependency
//! for three loops), `mul_add` (a libm call where the CPU has no FMA; Rust never fuses a
//! multiply and an add itself, so FMA is not asked for).
//!
//! The importance weight: MagicPIG's logit bias depends on the key only through its cosine
//! with the query, so the caller gets `q·k` (already computed for the logit) rather than the
//! row, and a second pass over the row is saved.

use candle_core::Result;

use folio_kernels::select::{reference, HostView, Stored};

/// Rows ahead of the one being read whose loads are started ([`prefetch`]): the picks are
/// scattered over GBs, so each row is a DRAM miss (and a TLB miss) that the hardware prefetcher
/// cannot predict, and a core waiting on one row at a time reaches a few percent of the host's
/// bandwidth. The index list says where the next rows are; 16 rows of 256 bytes keep ~64
/// lines in flight per core, about what its fill buffers hold.
const PREFETCH_ROWS: usize = 16;
const CACHE_LINE: usize = 64;

/// Partial sums kept apart in a dot product or a row's decode: one AVX-512 register of f32, two
/// AVX2 ones.
const LANES: usize = 16;

/// Query head `q`'s softmax partial over `pick`, rows of KV head `kv_head` (the logit of pick
/// `j` is `scale·q·k + bias(j, q·k)`), computed by the CPU straight from host memory in the
/// widest instruction set it has. A head's pick may be split into parts attended anywhere (on
/// the cores, beside other work: MagicPIG attends each part of its sample as its table walk
/// finds it); [`merge_partials`] joins them. A position past the stored rows is an error.
pub fn attend_partial(
    q: &[f32],
    (k, v): (&HostView<'_>, &HostView<'_>),
    kv_head: usize,
    pick: &[u32],
    scale: f32,
    bias: &dyn Fn(usize, f32) -> f32,
) -> Result<Partial> {
    if q.len() != k.dim() || kv_head >= k.heads() || (v.heads(), v.len(), v.dim()) != (k.heads(), k.len(), k.dim()) {
        candle_core::bail!(
            "host attention: a query of {} values for KV head {kv_head} of {} heads of dim {}",
            q.len(),
            k.heads(),
            k.dim()
        );
    }
    if let Some(p) = pick.iter().find(|&&p| p as usize >= k.len()) {
        candle_core::bail!("host attention: position {p} is past the {} stored rows", k.len());
    }
    Ok(attend(q, Rows { k, v, head: kv_head }, pick, scale, bias))
}

/// Joins each query head's [`attend_partial`]s (`(head, partial)`, in any order) into
/// `out [heads·d]` and `lse [heads]`; a head with no partial, or only empty ones, gets zeros and
/// −∞ ("no keys").
pub fn merge_partials(heads: usize, d: usize, parts: Vec<(usize, Partial)>) -> (Vec<f32>, Vec<f32>) {
    let mut joined: Vec<Option<Partial>> = (0..heads).map(|_| None).collect();
    for (h, p) in parts {
        debug_assert!(h < heads && p.acc.len() == d, "a partial of head {h} with {} values", p.acc.len());
        if p.max == f32::NEG_INFINITY {
            continue;
        }
        joined[h] = Some(match joined[h].take() {
            None => p,
            Some(mut a) => {
                // Both rescaled to the larger max: Σ exp(z − m) over both parts.
                let m = a.max.max(p.max);
                let (wa, wp) = ((a.max - m).exp(), (p.max - m).exp());
                a.acc.iter_mut().zip(&p.acc).for_each(|(x, y)| *x = *x * wa + y * wp);
                Partial { max: m, sum: a.sum * wa + p.sum * wp, acc: a.acc }
            }
        });
    }
    let (mut out, mut lse) = (vec![0f32; heads * d], vec![f32::NEG_INFINITY; heads]);
    for (h, p) in joined.into_iter().enumerate() {
        if let Some(p) = p {
            out[h * d..(h + 1) * d].iter_mut().zip(&p.acc).for_each(|(o, a)| *o = a / p.sum);
            lse[h] = p.max + p.sum.ln();
        }
    }
    (out, lse)
}

/// A softmax partial over some picked rows: the largest logit, Σ exp(logit − max) and
/// Σ exp(logit − max)·v (max −∞ when there were none).
pub struct Partial {
    max: f32,
    sum: f32,
    acc: Vec<f32>,
}

/// The K and V rows of one KV head.
#[derive(Clone, Copy)]
struct Rows<'a> {
    k: &'a HostView<'a>,
    v: &'a HostView<'a>,
    head: usize,
}

/// [`attend_rows`] in the widest instruction set the CPU has.
fn attend(q: &[f32], rows: Rows<'_>, pick: &[u32], scale: f32, bias: &dyn Fn(usize, f32) -> f32) -> Partial {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { attend_avx512(q, rows, pick, scale, bias) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { attend_avx2(q, rows, pick, scale, bias) };
        }
    }
    attend_rows(q, rows, pick, scale, bias)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn attend_avx512(q: &[f32], rows: Rows<'_>, pick: &[u32], scale: f32, bias: &dyn Fn(usize, f32) -> f32) -> Partial {
    attend_rows(q, rows, pick, scale, bias)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn attend_avx2(q: &[f32], rows: Rows<'_>, pick: &[u32], scale: f32, bias: &dyn Fn(usize, f32) -> f32) -> Partial {
    attend_rows(q, rows, pick, scale, bias)
}

/// One task: the logits of `pick`'s K rows, then the softmax-weighted sum of its V rows (each
/// row read once per pass, widened as it is read). Inlined into each instruction set's copy,
/// with plain `for` loops only: an iterator chain ending in `collect` or `for_each` runs
/// through `Iterator::fold`, a generic
/// function of `core` that LLVM may keep out of line — compiled for the baseline target,
/// outside the caller's instruction set (it did, and the K pass ran 4-wide).
#[inline(always)]
fn attend_rows(q: &[f32], rows: Rows<'_>, pick: &[u32], scale: f32, bias: &dyn Fn(usize, f32) -> f32) -> Partial {
    let d = q.len();
    let mut row = vec![0f32; d];
    let mut logits = Vec::with_capacity(pick.len());
    for &p in &pick[..PREFETCH_ROWS.min(pick.len())] {
        prefetch(rows.k, rows.head, p as usize);
    }
    for (j, &p) in pick.iter().enumerate() {
        if let Some(&ahead) = pick.get(j + PREFETCH_ROWS) {
            prefetch(rows.k, rows.head, ahead as usize);
        }
        let qk = row_dot(rows.k, rows.head, p as usize, q, &mut row);
        logits.push(scale * qk + bias(j, qk));
    }
    let mut max = f32::NEG_INFINITY;
    for &z in &logits {
        max = max.max(z);
    }
    let (mut sum, mut acc) = (0f32, vec![0f32; d]);
    if max > f32::NEG_INFINITY {
        for &p in &pick[..PREFETCH_ROWS.min(pick.len())] {
            prefetch(rows.v, rows.head, p as usize);
        }
        for (j, (&p, &z)) in pick.iter().zip(&logits).enumerate() {
            if let Some(&ahead) = pick.get(j + PREFETCH_ROWS) {
                prefetch(rows.v, rows.head, ahead as usize);
            }
            let e = (z - max).exp();
            sum += e;
            row_axpy(rows.v, rows.head, p as usize, e, &mut acc, &mut row);
        }
    }
    Partial { max, sum, acc }
}

/// Asks the CPU to start loading row `pos` of `head` (its values; an fp8 row's scale lies
/// apart and is left to the load).
#[inline(always)]
fn prefetch(view: &HostView<'_>, head: usize, pos: usize) {
    prefetch_lines(raw_row(view, head * view.len() + pos));
}

/// Asks the CPU to start loading every cache line of `data` (for loads it will make soon that no
/// hardware prefetcher can predict: scattered rows, hash buckets). A hint: it neither faults
/// nor changes a result; a no-op off x86-64.
#[inline(always)]
pub fn prefetch_lines<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // Every line `data` touches: from the one holding its first byte (a 128-byte run that
        // starts mid-line spans three lines, not two).
        let start = data.as_ptr() as *const i8;
        let skew = start as usize % CACHE_LINE;
        let mut at = 0;
        while at < skew + std::mem::size_of_val(data) {
            // SAFETY: SSE is part of the x86-64 baseline; a prefetch reads nothing back and
            // never faults, and the address is within the line of a byte of `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_sub(skew).wrapping_add(at)) };
            at += CACHE_LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// `q · row` for row `pos` of `head`, widened as it is read: bf16 by a shift (what
/// `bf16::to_f32` computes), f32 as stored — no decoded copy, whose stores a wide load right
/// after would wait on; fp8 decoded into `scratch` by [`reference::stored_row`] (a table
/// lookup per value, no wider form), then dotted.
#[inline(always)]
fn row_dot(view: &HostView<'_>, head: usize, pos: usize, q: &[f32], scratch: &mut [f32]) -> f32 {
    let row = head * view.len() + pos;
    match view.stored() {
        Stored::Bf16 => dot_stored::<2>(q, raw_row(view, row), widen_bf16),
        Stored::F32 => dot_stored::<4>(q, raw_row(view, row), f32::from_le_bytes),
        Stored::Fp8 { .. } => {
            reference::stored_row(view.bytes(), view.stored(), row, view.dim(), scratch);
            dot(q, scratch)
        }
    }
}

/// `acc += e · row` for row `pos` of `head`, widened as [`row_dot`] widens it.
#[inline(always)]
fn row_axpy(view: &HostView<'_>, head: usize, pos: usize, e: f32, acc: &mut [f32], scratch: &mut [f32]) {
    let row = head * view.len() + pos;
    match view.stored() {
        Stored::Bf16 => axpy_stored::<2>(acc, e, raw_row(view, row), widen_bf16),
        Stored::F32 => axpy_stored::<4>(acc, e, raw_row(view, row), f32::from_le_bytes),
        Stored::Fp8 { .. } => {
            reference::stored_row(view.bytes(), view.stored(), row, view.dim(), scratch);
            for (a, &x) in acc.iter_mut().zip(scratch.iter()) {
                *a += e * x;
            }
        }
    }
}

/// The stored bytes of row `row` (an fp8 row's scale lies apart).
#[inline(always)]
fn raw_row<'a>(view: &HostView<'a>, row: usize) -> &'a [u8] {
    let bytes = view.stored().row_bytes(view.dim());
    &view.bytes()[row * bytes..(row + 1) * bytes]
}

#[inline(always)]
fn widen_bf16(b: [u8; 2]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)
}

/// Σ q·x over a row of `W`-byte values read by `load`, in [`LANES`] partial sums.
#[inline(always)]
fn dot_stored<const W: usize>(q: &[f32], raw: &[u8], load: impl Fn([u8; W]) -> f32) -> f32 {
    let value = |r: &[u8], i: usize| load(r[i * W..(i + 1) * W].try_into().expect("W bytes"));
    let (cq, cr) = (q.chunks_exact(LANES), raw.chunks_exact(LANES * W));
    let (rest_q, rest_r) = (cq.remainder(), cr.remainder());
    let mut lanes = [0f32; LANES];
    for (x, r) in cq.zip(cr) {
        for i in 0..LANES {
            lanes[i] += x[i] * value(r, i);
        }
    }
    let mut total = 0f32;
    for l in lanes {
        total += l;
    }
    for (i, x) in rest_q.iter().enumerate() {
        total += x * value(rest_r, i);
    }
    total
}

/// `acc += e · x` over a row of `W`-byte values read by `load`.
#[inline(always)]
fn axpy_stored<const W: usize>(acc: &mut [f32], e: f32, raw: &[u8], load: impl Fn([u8; W]) -> f32) {
    for (a, x) in acc.iter_mut().zip(raw.chunks_exact(W)) {
        *a += e * load(x.try_into().expect("W bytes"));
    }
}

/// Σ a·b over [`LANES`] partial sums (then the remainder), so that it vectorises; plain loops
/// (see [`attend_rows`]).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let mut rest = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        rest += x * y;
    }
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    let mut total = 0f32;
    for l in lanes {
        total += l;
    }
    total + rest
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Each instruction set's copy of a task equals the plain definition (each stored row
    /// decoded by the reference, the sums in order) on rows of every stored dtype, including a
    /// head dim that is not a multiple of the lanes.
    #[test]
    fn every_instruction_set_matches_the_definition() {
        let seed: u64 = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let table = folio_kernels::encode::fp8_values();
        for (d, n) in [(128, 300), (80, 50), (7, 20)] {
            let scales_at = 2 * n * d;
            for stored in [Stored::F32, Stored::Bf16, Stored::Fp8 { scales: scales_at }] {
                let mut bytes = vec![0u8; stored.section_bytes(2 * n, d)];
                match stored {
                    Stored::Fp8 { scales } => {
                        rng.fill(&mut bytes[..scales]);
                        // NaN codes (0x7f, 0xff) would make every sum NaN: clear the low bit.
                        bytes[..scales].iter_mut().filter(|c| table[**c as usize].is_nan()).for_each(|c| *c &= 0xfe);
                        for s in bytes[scales..].chunks_exact_mut(4) {
                            s.copy_from_slice(&rng.random_range(0.001f32..0.01).to_le_bytes());
                        }
                    }
                    _ => {
                        let width = stored.row_bytes(1);
                        for x in bytes.chunks_exact_mut(width) {
                            let f = rng.random_range(-1f32..1.0);
                            x.copy_from_slice(&f.to_le_bytes()[4 - width..]);
                        }
                    }
                }
                // Two heads of `n` rows; the task reads head 1's, as both K and V.
                let view = HostView::new(&bytes, (2, n, d), stored).expect("a section of two heads");
                let q: Vec<f32> = (0..d).map(|_| rng.random_range(-1f32..1.0)).collect();
                let pick: Vec<u32> = (0..n as u32).filter(|_| rng.random_bool(0.5)).collect();
                let bias = |j: usize, qk: f32| 0.3 * qk.sin() - 0.01 * (j % 5) as f32;
                let scale = 0.2;
                // The definition.
                let row = |p: u32| {
                    let mut out = vec![0f32; d];
                    reference::stored_row(&bytes, stored, n + p as usize, d, &mut out);
                    out
                };
                let logits: Vec<f32> = pick
                    .iter()
                    .enumerate()
                    .map(|(j, &p)| {
                        let qk: f32 = q.iter().zip(row(p)).map(|(a, b)| a * b).sum();
                        scale * qk + bias(j, qk)
                    })
                    .collect();
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut want = vec![0f32; d];
                let mut sum = 0.0;
                for (&p, z) in pick.iter().zip(&logits) {
                    let e = (z - max).exp();
                    sum += e;
                    want.iter_mut().zip(row(p)).for_each(|(a, x)| *a += e * x);
                }
                let rows = Rows { k: &view, v: &view, head: 1 };
                let mut copies = vec![
                    ("dispatched", attend(&q, rows, &pick, scale, &bias)),
                    ("baseline", attend_rows(&q, rows, &pick, scale, &bias)),
                ];
                // Each wider copy the CPU can run, not only the one the dispatch picks.
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx512f") {
                        // SAFETY: the CPU has AVX-512F.
                        copies.push(("avx512", unsafe { attend_avx512(&q, rows, &pick, scale, &bias) }));
                    }
                    if std::arch::is_x86_feature_detected!("avx2") {
                        // SAFETY: the CPU has AVX2.
                        copies.push(("avx2", unsafe { attend_avx2(&q, rows, &pick, scale, &bias) }));
                    }
                }
                for (name, got) in copies {
                    let diff = got.acc.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(diff < 1e-4 * sum.max(1.0), "seed {seed}: {name} {stored:?} d {d}: acc differs by {diff}");
                    assert!((got.max - max).abs() < 1e-5, "seed {seed}: {name} {stored:?} d {d}: max");
                    assert!((got.sum - sum).abs() < 1e-4 * sum.max(1.0), "seed {seed}: {name} {stored:?} d {d}: sum");
                }
            }
        }
    }
}
