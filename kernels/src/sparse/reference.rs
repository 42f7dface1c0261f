//! The obviously-right sparse-decode primitives: attention over the picked rows of each query
//! head with its LSE, the mass each row received, label scores (Double Sparsity's channels)
//! and SimHash codes, as plain loops that the CUDA kernels and the CPU fast paths are held to.

/// Attention of each query head `h` over the rows `idx[h]` of its KV head `h / (heads /
/// kv_heads)`, logits `q·k·scale + bias`. Returns `out [heads, d]` and `lse [heads]`
/// (`-inf` and zeros for an empty selection).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    idx: &[u32],
    bias: Option<&[f32]>,
    (heads, kv_heads, n, d): (usize, usize, usize, usize),
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let sel = idx.len().checked_div(heads).unwrap_or(0);
    let group = heads / kv_heads;
    let (mut out, mut lse) = (vec![0f32; heads * d], vec![f32::NEG_INFINITY; heads]);
    for h in 0..heads {
        let base = (h / group) * n * d;
        let logits: Vec<f64> = (0..sel)
            .map(|j| {
                let row = base + idx[h * sel + j] as usize * d;
                let dot: f64 = (0..d).map(|i| q[h * d + i] as f64 * k[row + i] as f64).sum();
                dot * scale as f64 + bias.map_or(0.0, |b| b[h * sel + j] as f64)
            })
            .collect();
        if logits.is_empty() {
            continue;
        }
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = logits.iter().map(|z| (z - max).exp()).sum();
        for (j, z) in logits.iter().enumerate() {
            let p = (z - max).exp() / total;
            let row = base + idx[h * sel + j] as usize * d;
            for i in 0..d {
                out[h * d + i] += (p * v[row + i] as f64) as f32;
            }
        }
        lse[h] = (max + total.ln()) as f32;
    }
    (out, lse)
}

/// The attention each of the first `rows` keys of every KV head received from its group's
/// query heads in one decode step, summed over the group, plus `prev` (`[kv_heads, p]` with its
/// width `p`, zero past it): `out [kv_heads, rows]`, where a query head with
/// log-sum-exp `lse[h]` gives key `j` the probability `exp(q[h]·k[g, j]·scale − lse[h])`
/// (none for `lse = −∞`, a head that attended nothing).
#[allow(clippy::too_many_arguments)]
pub fn attention_mass(
    q: &[f32],
    k: &[f32],
    lse: &[f32],
    prev: Option<(&[f32], usize)>,
    (heads, kv_heads, n, d): (usize, usize, usize, usize),
    rows: usize,
    scale: f32,
) -> Vec<f32> {
    let group = heads / kv_heads;
    let mut out = Vec::with_capacity(kv_heads * rows);
    for g in 0..kv_heads {
        for j in 0..rows {
            let key = &k[(g * n + j) * d..][..d];
            let mass: f64 = (g * group..(g + 1) * group)
                .filter(|&h| lse[h] != f32::NEG_INFINITY)
                .map(|h| {
                    let dot: f64 = q[h * d..][..d].iter().zip(key).map(|(a, b)| *a as f64 * *b as f64).sum();
                    (dot * scale as f64 - lse[h] as f64).exp()
                })
                .sum();
            let before = prev.map_or(0.0, |(p, width)| if j < width { p[g * width + j] as f64 } else { 0.0 });
            out.push((before + mass) as f32);
        }
    }
    out
}

/// Label score of every token for each query head: `ql [heads, r]` against the dequantized
/// labels `code · range / (2^bits − 1) + offset` of its KV head, `codes [kv_heads, n, r]`,
/// `scale [kv_heads, n, 2]` (offset, range). Returns `[heads, n]`.
pub fn label_scores(
    ql: &[f32],
    codes: &[u8],
    scale: &[f32],
    (heads, kv_heads, n, r): (usize, usize, usize, usize),
    bits: usize,
) -> Vec<f32> {
    let max_q = ((1u32 << bits) - 1) as f64;
    let group = heads / kv_heads;
    let mut out = Vec::with_capacity(heads * n);
    for h in 0..heads {
        let g = h / group;
        for p in 0..n {
            let (lo, range) = (scale[(g * n + p) * 2] as f64, scale[(g * n + p) * 2 + 1] as f64);
            let score: f64 =
                (0..r).map(|i| ql[h * r + i] as f64 * (codes[(g * n + p) * r + i] as f64 * range / max_q + lo)).sum();
            out.push(score as f32);
        }
    }
    out
}

/// Code of each row of `x [rows, d]` in each of `tables` tables: bit `b` of table `l` is
/// `x · w[:, l·bits + b] > 0`, `w [d, bits·tables]`. Each projection is an f32 sum over the
/// channels in order, one rounded multiply and one rounded add per channel: the definition
/// every device computes bit for bit (no f64 here, unlike the other references), so a key
/// hashed on the GPU lands in the bucket the CPU would give it and an index built on either
/// samples the same keys. The loop runs over all planes per channel, which vectorizes
/// without changing any plane's order of additions.
pub fn simhash_codes(x: &[f32], w: &[f32], d: usize, bits: usize, tables: usize) -> Vec<u32> {
    let planes = bits * tables;
    let rows = x.len() / d.max(1);
    let mut codes = Vec::with_capacity(rows * tables);
    let mut proj = vec![0f32; planes];
    for r in 0..rows {
        proj.fill(0.0);
        for (i, &xi) in x[r * d..(r + 1) * d].iter().enumerate() {
            for (p, &wv) in proj.iter_mut().zip(&w[i * planes..(i + 1) * planes]) {
                *p += xi * wv;
            }
        }
        codes.extend(
            proj.chunks(bits).map(|t| t.iter().enumerate().fold(0u32, |c, (b, &p)| c | (u32::from(p > 0.0) << b))),
        );
    }
    codes
}
