//! The greedy step's argmax against the definition (the first index of the maximum, a NaN
//! first of all) on fresh random rows: a 7B vocabulary's 152,064 logits, the maximum planted
//! twice (the first must win), at the ends, a single value, a NaN, zeros of both signs; an empty
//! row is an error.

use candle_core::{Device, Result, Tensor};
use folio_kernels::argmax::{argmax, reference};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

fn fast_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for n in [1usize, 7, 1000, 152_064] {
        let base = common::random(&mut rng, n, 30.0);
        let (i, j) = (rng.random_range(0..n), rng.random_range(0..n));
        let mut planted = base.clone();
        planted[i] = 100.0;
        planted[j] = 100.0;
        let mut ends = base.clone();
        ends[n - 1] = 1e30;
        let mut nan = base.clone();
        nan[j] = f32::NAN;
        for (what, v) in [("random", &base), ("tie", &planted), ("last", &ends), ("NaN", &nan)] {
            let want = reference(v);
            let x = Tensor::from_vec(v.clone(), (1, n), device)?;
            let got = argmax(&x)?;
            assert_eq!(got, want, "{what}, {n} values on {device:?} (seed {seed})");
            if what == "tie" {
                assert_eq!(want as usize, i.min(j), "the first of equals (seed {seed})");
            }
        }
    }
    assert_eq!(reference(&[1.0, 3.0, 3.0, f32::NEG_INFINITY]), 1);
    // The zeros are equal: the first of them, whichever its sign.
    for zeros in [[-0.0f32, 0.0, -1.0], [0.0, -0.0, -1.0]] {
        assert_eq!(argmax(&Tensor::new(&zeros, device)?)?, 0, "{zeros:?} on {device:?}");
    }
    assert!(argmax(&Tensor::zeros(0, candle_core::DType::F32, device)?).is_err());
    assert!(argmax(&Tensor::zeros((2, 3), candle_core::DType::F32, device)?).is_err());
    Ok(())
}

test_device!(fast_matches_reference, fast_matches_reference_cpu, fast_matches_reference_cuda);
