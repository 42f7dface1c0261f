//! A decode step's projection against the definition: y[n] = Σ_k x[k]·w[n][k] in f64 over the
//! bf16 values, within f32 summation and one bf16 rounding, on fresh random rows — a 7B model's
//! q/k/v product, its hidden and MLP widths (3584, 18944), a width not a multiple of the
//! unrolled loads, tiny ones —
//! and against candle's matmul (the reference) within the same; shapes the kernel does not take
//! (two rows, a width not a multiple of 8, f32) run the reference itself.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::gemv::{product, reference};
use rand::{rngs::StdRng, SeedableRng};

mod common;

fn fast_matches_definition(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let shapes = [(1, 3584, 4608), (1, 3584, 700), (1, 18944, 300), (1, 1032, 7), (1, 8, 1), (2, 64, 5), (1, 12, 3)];
    for (rows, k, n) in shapes {
        for dtype in [DType::BF16, DType::F32] {
            let x = Tensor::from_vec(common::random(&mut rng, rows * k, 2.0), (rows, k), device)?.to_dtype(dtype)?;
            let w = Tensor::from_vec(common::random(&mut rng, n * k, 0.5), (n, k), device)?.to_dtype(dtype)?;
            let (fast, slow) = (product(&x, &w)?, reference(&x, &w)?);
            assert_eq!(fast.dims(), [rows, n]);
            assert_eq!(fast.dtype(), dtype);
            let f64s = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>() };
            let (xv, wv, got, other) = (f64s(&x)?, f64s(&w)?, f64s(&fast)?, f64s(&slow)?);
            for r in 0..rows {
                for j in 0..n {
                    let terms = (0..k).map(|i| xv[r * k + i] * wv[j * k + i]);
                    let (exact, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                    // One rounding of the output (bf16: 2^-8 relative) and f32 sums of k terms.
                    let round = if dtype == DType::BF16 { exact.abs() / 256.0 } else { exact.abs() * 1e-6 };
                    let tol = round + size * k as f64 * 6e-8 + 1e-6;
                    let at = r * n + j;
                    assert!(
                        (got[at] - exact).abs() <= tol,
                        "{rows}x{k} @ {n}x{k} {dtype:?}: [{r}][{j}] = {}, exact {exact} (seed {seed})",
                        got[at]
                    );
                    assert!((other[at] - exact).abs() <= tol, "the reference itself, [{r}][{j}] (seed {seed})");
                }
            }
        }
    }
    Ok(())
}

test_device!(fast_matches_definition, fast_matches_definition_cpu, fast_matches_definition_cuda);
