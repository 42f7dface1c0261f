//! Helpers shared by the kernel tests: one test body for every device, random inputs (and a
//! seed a failure can replay), and a NaN-aware difference.

use rand::{rngs::StdRng, Rng};

/// One test body for every device (candle's `test_device!` habit).
#[macro_export]
macro_rules! test_device {
    ($body:ident, $cpu:ident, $cuda:ident) => {
        #[test]
        fn $cpu() -> Result<()> {
            $body(&Device::Cpu)
        }
        #[cfg(feature = "cuda")]
        #[test]
        fn $cuda() -> Result<()> {
            $body(&Device::new_cuda(0)?)
        }
    };
}

/// A fresh random seed for a test's inputs, or `FOLIO_SEED` to replay the one a failure printed.
#[allow(dead_code)] // not every test file draws a seed
pub fn seed() -> u64 {
    match std::env::var("FOLIO_SEED") {
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("FOLIO_SEED={s:?} is not a u64")),
        Err(_) => rand::random(),
    }
}

#[allow(dead_code)] // not every test file draws its inputs here
pub fn random(rng: &mut StdRng, n: usize, spread: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-spread..spread)).collect()
}

#[allow(dead_code)] // not every test file compares floats
/// Largest |a - b|, and infinity when either side has a NaN (f32::max would skip it).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| if x.is_nan() || y.is_nan() { f32::INFINITY } else { (x - y).abs() })
        .fold(0.0, f32::max)
}
