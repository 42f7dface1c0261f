//! RMSNorm against candle-nn's `rms_norm`, bit for bit, and against the definition within two
//! roundings, on fresh random f32 and bf16 rows: widths under 1024 (candle's one-warp case), at
//! and past 1024 in whole 16-byte vectors or not, not a multiple of 32, a 7B model's 3584 (one row:
//! a decode step's block a row; past 256 rows: a warp a row), views
//! off a 16-byte boundary, values over six orders of magnitude; and the residual add fused with
//! the norm against candle's add, then the norm.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::norm::{reference, rms_norm};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

const EPS: f32 = 1e-6;

fn fast_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for dtype in [DType::F32, DType::BF16] {
        let shapes = [
            (1, 8),
            (5, 100),
            (7, 128),
            (3, 1000),
            (9, 1024),
            (4, 3584),
            (2, 5000),
            (3, 1030),
            (17, 64),
            (1, 3584),
            (300, 1024),
            (257, 1030),
        ];
        for ((rows, cols), start) in shapes.into_iter().flat_map(|s| [(s, 0), (s, 1)]) {
            let mut values = |len: usize| -> Result<Tensor> {
                let v: Vec<f32> =
                    (0..len).map(|_| rng.random_range(-4.0f32..4.0) * 10f32.powi(rng.random_range(-3..3))).collect();
                Tensor::from_vec(v, len, device)?.to_dtype(dtype)
            };
            // A view that starts one value in (off a 16-byte boundary) as well as a whole buffer.
            let x = values(rows * cols + start)?.narrow(0, start, rows * cols)?.reshape((rows, cols))?;
            let w = values(cols)?;
            let (fast, slow) = (rms_norm(&x, &w, EPS)?, reference(&x, &w, EPS)?);
            assert_eq!(fast.dims(), [rows, cols]);
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>().map(|v| v.iter().map(|f| f.to_bits()).collect())
            };
            assert!(
                bits(&fast)? == bits(&slow)?,
                "{rows}x{cols} {dtype:?} (start {start}) differs on {device:?} (seed {seed})"
            );
            // Both against the definition, in f64: x · w / sqrt(mean(x²) + eps), within two
            // roundings of the output dtype (candle's CPU path rounds bf16 products on the way).
            let (xv, wv) = (x.to_dtype(DType::F64)?.to_vec2::<f64>()?, w.to_dtype(DType::F64)?.to_vec1::<f64>()?);
            let out = fast.to_dtype(DType::F64)?.to_vec2::<f64>()?;
            let step = if dtype == DType::BF16 { 1.0 / 64.0 } else { 1e-5 };
            for (r, (xr, or)) in xv.iter().zip(&out).enumerate() {
                let scale = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / cols as f64 + EPS as f64).sqrt();
                for (c, (xi, got)) in xr.iter().zip(or).enumerate() {
                    let want = xi * scale * wv[c];
                    assert!(
                        (got - want).abs() <= want.abs() * step + 1e-30,
                        "[{r}][{c}] = {got}, not {want} ({dtype:?}, seed {seed})"
                    );
                }
            }
        }
    }
    Ok(())
}

test_device!(fast_matches_reference, fast_matches_reference_cpu, fast_matches_reference_cuda);

/// The residual add fused with the norm against candle's add and the norm, bit for bit, both
/// outputs: one row of a 7B model (the fused launch), a few odd rows, rows past the fused
/// kernel's reach and narrower than 1024 (the reference's own path), a view off a boundary.
fn add_norm_matches_reference(device: &Device) -> Result<()> {
    use folio_kernels::norm::{add_rms_norm, add_rms_norm_reference};
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols) in [(1, 3584), (3, 1030), (2, 5000), (300, 1024), (2, 100)] {
            let mut values = |len: usize| -> Result<Tensor> {
                let v: Vec<f32> =
                    (0..len).map(|_| rng.random_range(-4.0f32..4.0) * 10f32.powi(rng.random_range(-2..2))).collect();
                Tensor::from_vec(v, len, device)?.to_dtype(dtype)
            };
            let x = values(rows * cols + 1)?.narrow(0, 1, rows * cols)?.reshape((rows, cols))?;
            let (r, w) = (values(rows * cols)?.reshape((rows, cols))?, values(cols)?);
            let (sum, normed) = add_rms_norm(&x, &r, &w, EPS)?;
            let (want_sum, want) = add_rms_norm_reference(&x, &r, &w, EPS)?;
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>().map(|v| v.iter().map(|f| f.to_bits()).collect())
            };
            assert_eq!(sum.dims(), [rows, cols]);
            assert!(bits(&sum)? == bits(&want_sum)?, "{rows}x{cols} {dtype:?}: the sum differs (seed {seed})");
            assert!(bits(&normed)? == bits(&want)?, "{rows}x{cols} {dtype:?}: the norm differs (seed {seed})");
            assert!(bits(&want_sum)? == bits(&(&x + &r)?)?, "the reference's sum is candle's add");
        }
    }
    Ok(())
}

test_device!(add_norm_matches_reference, add_norm_matches_reference_cpu, add_norm_matches_reference_cuda);
