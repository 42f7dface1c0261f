//! The obviously-right attention every fast path is held to: plain loops over f32 slices, one
//! query row at a time, scores and softmax accumulated in f64 with the max subtracted, the LSE
//! returned so partial attentions merge exactly. Slow on purpose; the tests compare the fast
//! paths against it on fresh random inputs.

use super::Mask;

/// Keys at positions `k_start..`; returns `(out [q_heads * q_len * head_dim], lse [q_heads * q_len])`,
/// with output 0 and LSE `-inf` for a query that sees none of the keys.
#[allow(clippy::too_many_arguments)]
pub fn attention_block(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    k_start: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    mask: Mask,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let q_len = q.len() / (q_heads * head_dim);
    let kv_len = k.len() / (kv_heads * head_dim);
    let groups = q_heads / kv_heads;
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![f32::NEG_INFINITY; q_heads * q_len];
    for h in 0..q_heads {
        let kvh = h / groups;
        for i in 0..q_len {
            let pos = mask.q_offset + i;
            let qrow = &q[(h * q_len + i) * head_dim..][..head_dim];
            let keys: Vec<usize> = (0..kv_len).filter(|&j| mask.visible(pos, k_start + j)).collect();
            if keys.is_empty() {
                continue;
            }
            let scores: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    let krow = &k[(kvh * kv_len + j) * head_dim..][..head_dim];
                    let dot: f64 = qrow.iter().zip(krow).map(|(a, b)| *a as f64 * *b as f64).sum();
                    dot * scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            lse[h * q_len + i] = (max + total.ln()) as f32;
            let orow = &mut out[(h * q_len + i) * head_dim..][..head_dim];
            for (w, &j) in weights.iter().zip(&keys) {
                let vrow = &v[(kvh * kv_len + j) * head_dim..][..head_dim];
                for (o, x) in orow.iter_mut().zip(vrow) {
                    *o += (w / total * *x as f64) as f32;
                }
            }
        }
    }
    (out, lse)
}
