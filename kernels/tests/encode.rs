//! fp8 rows: the device encoder against the CPU reference, byte for byte; the reference against
//! the definition (each value within half an e4m3 step of the row's scale times its code).

use folio_kernels::encode::{fp8_row, FP8_E4M3_MAX};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

/// Rows of every kind the codec meets: ordinary spreads, outlier channels, all zeros, tiny rows
/// (e4m3 subnormals after scaling), huge rows, and one row with a NaN (and one with an inf).
fn rows(rng: &mut StdRng, n: usize, d: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n * d);
    for r in 0..n {
        let spread = [1.0, 1e-3, 3e4, 1e-30, 0.0][r % 5];
        for i in 0..d {
            let v: f32 = rng.random_range(-1.0..1.0) * spread;
            x.push(if i == r % d && r % 7 == 3 { v * 300.0 } else { v });
        }
    }
    x
}

/// Each value decodes to within half a step of e4m3 at its magnitude (3 mantissa bits: 1/16
/// relative) or half the smallest subnormal step, scaled.
#[test]
fn the_reference_is_within_half_a_step() {
    let mut rng = StdRng::seed_from_u64(common::seed());
    let d = 64;
    let x = rows(&mut rng, 40, d);
    for row in x.chunks(d) {
        let mut codes = vec![0u8; d];
        let scale = fp8_row(row, &mut codes).expect("finite row");
        for (v, c) in row.iter().zip(&codes) {
            let back = float8::F8E4M3::from_bits(*c).to_f32() * scale;
            let step = (v.abs() / 16.0).max(scale * 2f32.powi(-10));
            assert!((back - v).abs() <= step, "{v} came back as {back} (scale {scale})");
            assert!((v / scale).abs() <= FP8_E4M3_MAX * (1.0 + 1e-6));
        }
    }
    let mut bad = vec![1.0f32; d];
    bad[5] = f32::NAN;
    assert!(fp8_row(&bad, &mut vec![0u8; d]).is_none(), "a NaN row is refused");
}

#[cfg(feature = "cuda")]
#[test]
fn device_rows_match_the_reference() -> candle_core::Result<()> {
    use candle_core::{DType, Device, Tensor};
    use folio_kernels::encode::fp8_rows;
    let device = Device::new_cuda(0)?;
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (n, d, dtype) in [(1000, 128, DType::BF16), (333, 64, DType::F32), (17, 32, DType::BF16)] {
        let mut x = rows(&mut rng, n, d);
        x[7 * d + 3] = f32::NAN;
        x[11 * d] = f32::INFINITY;
        let t = Tensor::from_vec(x, (n, d), &device)?.to_dtype(dtype)?;
        // The reference sees what the device holds (bf16-rounded).
        let held = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        let got = fp8_rows(&t)?.to_vec1::<u8>()?;
        let (codes, scales) = got.split_at(n * d);
        for (r, row) in held.chunks(d).enumerate() {
            let mut want = vec![0u8; d];
            let scale = f32::from_le_bytes(scales[r * 4..r * 4 + 4].try_into().unwrap());
            match fp8_row(row, &mut want) {
                None => assert!(scale.is_nan(), "seed {seed}: row {r} is not finite, scale {scale}"),
                Some(s) => {
                    assert_eq!(s.to_bits(), scale.to_bits(), "seed {seed}: row {r} of {n}x{d} {dtype:?}: scale");
                    assert_eq!(&codes[r * d..(r + 1) * d], &want[..], "seed {seed}: row {r} of {n}x{d} {dtype:?}");
                }
            }
        }
    }
    Ok(())
}
