//! Rotary position embeddings: inverse frequencies from the config's rule, and cos/sin tables
//! for just the positions of a forward pass (a 1M-token table would not fit in memory).
//!
//! Everything is computed in f32 in the same order as transformers, so positions embed
//! bit-for-bit alike and logits match the reference to float rounding.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::RopeScaling;

/// Inverse frequencies `theta^(-2i/d)` for `i in 0..d/2`, after the config's scaling rule.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let base = theta as f32;
    let plain = (0..head_dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32));
    match *scaling {
        RopeScaling::Default => plain.collect(),
        RopeScaling::Factors { ref factors } => plain.zip(factors).map(|(f, d)| f / *d as f32).collect(),
        RopeScaling::Linear { factor } => plain.map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let (factor, low, high) = (factor as f32, low_freq_factor as f32, high_freq_factor as f32);
            let old_len = original_max_position_embeddings as f32;
            let low_freq_wavelen = old_len / low;
            let high_freq_wavelen = old_len / high;
            plain
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (old_len / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// `(cos, sin)`, each `[t, head_dim / 2]` in `dtype`, for positions `start..start + t`.
pub fn cos_sin(inv_freq: &[f32], start: usize, t: usize, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in start..start + t {
        for &f in inv_freq {
            let angle = p as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (t, half), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (t, half), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_rule_keeps_high_and_divides_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = inv_freq(128, 500_000.0, &RopeScaling::Default);
        let scaled = inv_freq(128, 500_000.0, &scaling);
        assert_eq!(scaled[0], plain[0], "short wavelengths are kept");
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12, "long wavelengths are divided by factor");
        assert!(scaled.iter().zip(&plain).all(|(s, p)| s <= p && *s >= p / 8.0));
    }
}
