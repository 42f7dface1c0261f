//! Two next-token distributions compared, as logits rows: how far a sparse method's answer
//! strays from dense attention's. The window's "compare with dense" reports these per answer
//! token, and the evaluations (folio-eval) average them over prompts — one definition for both,
//! so a figure in the window and one in a results table mean the same thing.

/// log-softmax of one logits row, in f64 (the sums over a vocabulary lose digits in f32).
pub fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + x.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln();
    x.iter().map(|v| *v as f64 - lse).collect()
}

/// KL(p ‖ q) of two logits rows, nats.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum::<f64>().max(0.0)
}

/// The index of the largest logit (the first of equals).
pub fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().fold(0, |b, (i, v)| if *v > x[b] { i } else { b }) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_rows_and_positive_otherwise() {
        let p: Vec<f32> = (0..50).map(|_| rand::random::<f32>() * 8.0 - 4.0).collect();
        let shifted: Vec<f32> = p.iter().map(|v| v + 3.0).collect();
        assert!(kl_divergence(&p, &shifted) < 1e-9, "a shift of every logit is the same distribution");
        let mut other = p.clone();
        other[argmax(&p) as usize] -= 10.0;
        assert!(kl_divergence(&p, &other) > 1e-3);
        assert_ne!(argmax(&p), argmax(&other));
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1, "the first of equals");
    }
}
