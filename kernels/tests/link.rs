//! An emulated host link (`folio_kernels::link`, `--link-gbps`) on a GPU: a gather paced to a
//! rate takes at least its bytes over that rate (and not much more: the pacing spins on the
//! GPU's clock), and gathers the same rows, bit for bit, as the link as it is. A binary of its
//! own: the rate is the process's, and no other test's gathers may share the emulated link.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::select::HostRows;
use folio_kernels::Positions;
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::random;

/// Gathers timed back to back at the emulated rate.
const CALLS: usize = 20;
/// The emulated rate: this share of the rate the gather reaches as the link is (so the
/// pacing, not the reads, sets the time on any GPU).
const SHARE: f64 = 0.25;

#[test]
fn paced_gathers_take_the_emulated_time_and_move_the_same_rows() -> Result<()> {
    let device = Device::new_cuda(0)?;
    let (heads, kv_heads, n, d, sel) = (28, 4, 200_000, 128, 4096);
    let mut rng = StdRng::seed_from_u64(common::seed());
    let mut host = HostRows::new(&device, DType::BF16, kv_heads, n, d)?;
    let rows = Tensor::from_vec(random(&mut rng, kv_heads * n * d, 1.0), (kv_heads, n, d), &device)?;
    host.write(0, &rows.to_dtype(DType::BF16)?)?;
    let idx: Vec<u32> = (0..heads * sel).map(|_| rng.random_range(0..n as u32)).collect();
    let idx = Tensor::from_vec(idx, (heads, sel), &device)?;
    let gather = || host.gather(&idx, heads / kv_heads, None, Positions::Trusted);
    let bytes = (CALLS * heads * sel * d * 2) as f64;
    let timed = || -> Result<(f64, Tensor)> {
        let out = gather()?;
        device.synchronize()?;
        let start = std::time::Instant::now();
        for _ in 0..CALLS {
            gather()?;
        }
        device.synchronize()?;
        Ok((start.elapsed().as_secs_f64(), out))
    };
    let (as_is_secs, as_is) = timed()?;
    let rate = SHARE * bytes / as_is_secs;
    folio_kernels::link::set_rate(Some(rate));
    let paced = timed();
    folio_kernels::link::set_rate(None);
    let (secs, paced) = paced?;
    let flat = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    assert_eq!(flat(&as_is)?, flat(&paced)?);
    let want = bytes / rate;
    assert!(secs >= 0.97 * want && secs <= 1.3 * want, "{secs} s for {want} s at {rate} B/s");
    Ok(())
}
