//! Raw bytes to and from the device through the staged copies: every byte comes back, for
//! several dtypes, views that start mid-buffer, and sizes that end mid-piece.

use candle_core::{DType, Device, Result, Tensor};
use folio_runtime::device::{from_host_bytes, to_host_bytes};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn round_trip(device: &Device) -> Result<()> {
    // A fresh seed, or FOLIO_SEED to replay the one a failure printed.
    let seed = std::env::var("FOLIO_SEED").map_or_else(|_| rand::random(), |s| s.parse().expect("FOLIO_SEED is a u64"));
    let mut rng = StdRng::seed_from_u64(seed);
    // 40 MB crosses two 16 MiB staging pieces and ends inside a third.
    for (elems, dtype) in [(10_000_003usize, DType::F32), (777, DType::BF16), (20_000_001, DType::BF16), (5, DType::U8)]
    {
        let bytes: Vec<u8> = (0..elems * dtype.size_in_bytes()).map(|_| rng.random()).collect();
        let t = from_host_bytes(&bytes, dtype, &[elems], device)?;
        assert_eq!((t.dims(), t.dtype()), (&[elems][..], dtype));
        assert!(to_host_bytes(&t)? == bytes, "seed {seed}: {elems} {dtype:?} round trip");
        // A view that starts mid-buffer: the bytes of that view only.
        let at = elems / 3;
        let view = t.narrow(0, at, elems - at)?;
        let size = dtype.size_in_bytes();
        assert!(to_host_bytes(&view)? == bytes[at * size..], "seed {seed}: {elems} {dtype:?} view");
    }
    // The bytes are the values: a tensor made the ordinary way reads back as its values' bytes.
    let x = Tensor::new(&[1.5f32, -2.0, 3.25], device)?;
    let want: Vec<u8> = [1.5f32, -2.0, 3.25].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(to_host_bytes(&x)?, want);
    assert!(from_host_bytes(&want[..5], DType::F32, &[3], device).is_err(), "too few bytes are refused");
    Ok(())
}
#[test]
fn round_trip_cpu() -> Result<()> {
    round_trip(&Device::Cpu)
}

#[cfg(feature = "cuda")]
#[test]
fn round_trip_cuda() -> Result<()> {
    round_trip(&Device::new_cuda(0)?)
}
