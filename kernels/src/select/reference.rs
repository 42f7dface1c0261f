//! The obviously-right versions of picking and gathering rows: a sort for top-k, a copy per
//! picked row, a decoded row for stored (fp8/bf16) sections. The CPU and CUDA gathers are
//! compared against these on fresh random inputs.

use super::HostView;

/// Positions of the `min(k, n)` largest scores of each row of `scores [rows, n]`, ascending
/// by position; among equal scores the lower position wins.
pub fn topk(scores: &[f32], n: usize, k: usize) -> Vec<u32> {
    let k = k.min(n);
    let mut out = Vec::with_capacity(scores.len().checked_div(n).unwrap_or(0) * k);
    for row in scores.chunks(n.max(1)).filter(|_| n > 0) {
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let mut picked = order[..k].to_vec();
        picked.sort_unstable();
        out.extend(picked);
    }
    out
}

/// `out[h, j] = src[h / group][idx[h, j]]`, rows of `row_bytes` bytes, `src` holding `n`
/// rows per source head, positions from `n` on reading `tail` (`tail_n` rows per head);
/// `idx [heads, sel]`.
#[allow(clippy::too_many_arguments)]
pub fn gather_rows(
    src: &[u8],
    n: usize,
    tail: &[u8],
    tail_n: usize,
    idx: &[u32],
    sel: usize,
    group: usize,
    row_bytes: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(idx.len() * row_bytes);
    for (i, &p) in idx.iter().enumerate() {
        let (g, p) = (i / sel / group, p as usize);
        let (from, at) = if p < n { (src, g * n + p) } else { (tail, g * tail_n + p - n) };
        out.extend_from_slice(&from[at * row_bytes..(at + 1) * row_bytes]);
    }
    out
}

/// Row `row` of a section stored as `stored`, as f32 into `out`: the context file's definition
/// of a stored row, which every gather here is held to.
pub use folio_context_file::rows::stored_row;

/// [`gather_rows`] of rows held in another dtype than the one they are read in, as f32
/// (the caller casts): stored rows decoded by [`stored_row`], positions from the view's `n`
/// on reading `tail` (`tail_n` f32 rows per head).
pub fn gather_rows_wide(
    src: &HostView<'_>,
    tail: &[f32],
    tail_n: usize,
    idx: &[u32],
    sel: usize,
    group: usize,
) -> Vec<f32> {
    let (n, d) = (src.len(), src.d);
    let mut out = vec![0f32; idx.len() * d];
    for ((i, &p), o) in idx.iter().enumerate().zip(out.chunks_exact_mut(d)) {
        let (g, p) = (i / sel / group, p as usize);
        if p < n {
            src.row(g, p, o);
        } else {
            let at = (g * tail_n + p - n) * d;
            o.copy_from_slice(&tail[at..at + d]);
        }
    }
    out
}
