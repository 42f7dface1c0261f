//! The block search's steps (kernels/cuda/blocks.cu) against their references, on fresh random
//! inputs, with one test body for every device.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::blocks::{self, reference};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::random;

/// Halving: random nodes (empty and one-block ones included), with and without a pick of them,
/// block sizes 1 to 5, the last block cut short by the end of the keys; the halves and the
/// positions are the reference's exactly.
fn halve_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, m, n, b, first, picked) in
        [(28, 512, 256, 2, 4, true), (3, 7, 7, 1, 0, false), (5, 40, 9, 5, 100, true)]
    {
        let blocks = 10_000u32;
        let keys = blocks as usize * b - b / 2;
        let nodes: Vec<u32> = (0..heads * m)
            .flat_map(|_| {
                let f = rng.random_range(0..blocks);
                [f, rng.random_range(f..=blocks)]
            })
            .collect();
        let keep: Vec<u32> = (0..heads * n).map(|_| rng.random_range(0..m as u32)).collect();
        let keep_ref = picked.then_some(&keep[..]);
        let n = if picked { n } else { m };
        let (want_c, want_p) = reference::halve(&nodes, keep_ref, (heads, m, n), b, first, keys);
        let nt = Tensor::from_vec(nodes, (heads, m, 2), device)?;
        let kt = Tensor::from_vec(keep, (heads, n), device)?;
        let (c, p) = blocks::halve(&nt, picked.then_some(&kt), b, first, keys)?;
        assert_eq!(c.dims(), [heads, 2 * n, 2]);
        assert_eq!(c.flatten_all()?.to_vec1::<u32>()?, want_c, "seed {seed}: halves");
        assert_eq!(p.flatten_all()?.to_vec1::<u32>()?, want_p, "seed {seed}: positions");
        assert!(want_p.iter().all(|&x| (x as usize) < first + keys), "seed {seed}: a position past the keys");
    }
    Ok(())
}

test_device!(halve_matches_reference, halve_cpu, halve_cuda);

/// Block maxima over f32 and bf16 keys, head dims that are and are not multiples of the warp,
/// empty candidates scoring −∞.
fn block_max_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, c, b, d, dtype) in
        [(28, 1024, 2, 128, DType::BF16), (4, 9, 3, 70, DType::F32), (2, 5, 1, 256, DType::F32)]
    {
        let q = random(&mut rng, heads * d, 1.0);
        let keys =
            Tensor::from_vec(random(&mut rng, heads * c * b * d, 1.0), (heads, c * b, d), device)?.to_dtype(dtype)?;
        let keys_ref: Vec<f32> = keys.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut cand: Vec<u32> = (0..heads * c)
            .flat_map(|_| {
                let f = rng.random_range(0..100u32);
                [f, f + rng.random_range(0..3u32)]
            })
            .collect();
        cand[1] = cand[0]; // one empty candidate at least
        let want = reference::block_max(&q, &keys_ref, &cand, (heads, c, b, d));
        let qt = Tensor::from_vec(q, (heads, d), device)?;
        let ct = Tensor::from_vec(cand, (heads, c, 2), device)?;
        let got: Vec<f32> = blocks::block_max(&qt, &keys, &ct, b)?.flatten_all()?.to_vec1()?;
        for (g, w) in got.iter().zip(&want) {
            assert!(g == w || (g - w).abs() < 1e-4 * w.abs().max(1.0), "seed {seed}: {g} vs {w}");
        }
        assert_eq!(want[0], f32::NEG_INFINITY);
    }
    Ok(())
}

test_device!(block_max_matches_reference, block_max_cpu, block_max_cuda);

/// Expansion of the kept blocks into positions: with and without sinks, block sizes 1 to 4,
/// picks in any order; the reference's positions exactly.
fn expand_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, m, n, b, sinks) in [(28, 514, 257, 2, (0, 4)), (3, 8, 4, 1, (0, 0)), (5, 40, 20, 4, (7, 10))] {
        let nodes: Vec<u32> = (0..heads * m)
            .flat_map(|_| {
                let f = rng.random_range(0..100_000u32);
                [f, f + 1]
            })
            .collect();
        let keep: Vec<u32> = (0..heads * n).map(|_| rng.random_range(0..m as u32)).collect();
        let want = reference::expand(&nodes, &keep, (heads, m, n), b, sinks);
        assert_eq!(want.len(), heads * (sinks.1 - sinks.0 + n * b));
        let nt = Tensor::from_vec(nodes, (heads, m, 2), device)?;
        let kt = Tensor::from_vec(keep, (heads, n), device)?;
        let got = blocks::expand(&nt, &kt, b, sinks)?;
        assert_eq!(got.dims(), [heads, sinks.1 - sinks.0 + n * b]);
        assert_eq!(got.flatten_all()?.to_vec1::<u32>()?, want, "seed {seed}: positions");
    }
    Ok(())
}

test_device!(expand_matches_reference, expand_cpu, expand_cuda);
