//! The fused MLP activation against candle's two passes (SiLU, then the product), bit for bit,
//! on fresh random bf16 inputs: sizes with and without a partial last vector, views that start
//! off a 16-byte boundary, values from tiny to past SiLU's saturation, and ±inf and NaN.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::mlp::{reference, swiglu};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

fn bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.flatten_all()?.to_vec1::<half::bf16>()?.into_iter().map(|x| x.to_bits()).collect())
}

fn fused_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (rows, cols) in [(1, 1), (3, 7), (5, 8), (17, 1000), (64, 18_944 / 16)] {
        let n = rows * cols;
        let mut values = |spread: f32| -> Vec<f32> {
            (0..n + 3).map(|_| rng.random_range(-spread..spread) * 10f32.powi(rng.random_range(-3..2))).collect()
        };
        let (mut g, u) = (values(8.0), values(4.0));
        for (i, special) in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 88.0, -88.0, 0.0].into_iter().enumerate() {
            if i < n {
                g[(i * 7919) % n] = special;
            }
        }
        let all = |v: Vec<f32>| Tensor::from_vec(v, n + 3, device)?.to_dtype(DType::BF16);
        let (g, u) = (all(g)?, all(u)?);
        // At offset 0, and at offset 3 (not on a 16-byte boundary: copied first).
        for start in [0, 3] {
            let gate = g.narrow(0, start, n)?.reshape((rows, cols))?;
            let up = u.narrow(0, 3 - start, n)?.reshape((rows, cols))?;
            let (fast, slow) = (swiglu(&gate, &up)?, reference(&gate, &up)?);
            assert_eq!(fast.dims(), [rows, cols]);
            let (f, s) = (bits(&fast)?, bits(&slow)?);
            let differ = f.iter().zip(&s).filter(|(a, b)| a != b && !(is_nan(**a) && is_nan(**b))).count();
            assert_eq!(
                differ, 0,
                "{differ} of {n} values differ on {device:?} ({rows}x{cols}, start {start}; seed {seed})"
            );
            // Both against the definition in f64, value by value: two bf16 roundings (SiLU's
            // and the product's) away at most, for finite values.
            let f32s = |x: &Tensor| x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
            let (gv, uv, out) = (f32s(&gate)?, f32s(&up)?, f32s(&fast)?);
            for ((g, u), got) in gv.iter().zip(&uv).zip(&out) {
                let want = (*g as f64 / (1.0 + (-*g as f64).exp()) * *u as f64) as f32;
                if want.is_finite() && g.is_finite() {
                    assert!(
                        (got - want).abs() <= want.abs() / 64.0 + 1e-30,
                        "SiLU({g}) * {u} = {got}, not {want} (seed {seed})"
                    );
                }
            }
        }
    }
    let (a, b) = (Tensor::zeros((2, 3), DType::BF16, device)?, Tensor::zeros((3, 2), DType::BF16, device)?);
    assert!(swiglu(&a, &b).unwrap_err().to_string().contains("differ"));
    Ok(())
}

fn is_nan(bits: u16) -> bool {
    half::bf16::from_bits(bits).is_nan()
}

test_device!(fused_matches_reference, fused_matches_reference_cpu, fused_matches_reference_cuda);
