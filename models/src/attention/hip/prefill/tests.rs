//! The sparse prefill's two implementations against each other, against dense attention where
//! the budget covers the region, and its mask against a planted key; fresh random inputs each
//! run (the seed printed on failure).

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::SparsePrefill;
use crate::attention::select::LayerRows;

/// Random K/V of `kv_heads` heads and `n` rows, and `heads` query heads of `t` rows.
fn case(rng: &mut StdRng, (heads, kv_heads, d): (usize, usize, usize), n: usize, t: usize) -> (LayerRows, Vec<f32>) {
    let mut draw = |len: usize| (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<f32>>();
    let (k, v) = (draw(kv_heads * n * d), draw(kv_heads * n * d));
    (LayerRows { k, v, kv_heads, len: n, head_dim: d }, draw(heads * t * d))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// `attend` (gathered rows through folio-kernels' attention, merged by LSE) gives the
/// reference's rows: prefills from the start and from a saved prefix, blocks cut by the
/// chunk's end, a window of none, GQA groups of 1 and 2.
#[test]
fn attend_matches_the_reference() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let shapes = [
        // (heads, kv_heads, d), q_start, t, (block_q, stride_q, block_k, keys, sinks, window)
        ((4, 2, 16), 0, 150, (16, 2, 4, 24, 4, 16)),
        ((4, 2, 16), 300, 97, (16, 2, 4, 24, 4, 16)),
        ((2, 2, 32), 500, 64, (64, 2, 2, 32, 4, 64)),
        ((4, 4, 8), 40, 33, (8, 3, 5, 10, 0, 0)),
        // No sinks and no window: a block of the window alone, then one of the gathered keys alone.
        ((2, 1, 8), 0, 8, (7, 1, 4, 8, 0, 0)),
    ];
    for ((heads, kv_heads, d), q_start, t, (bq, sq, bk, keys, sinks, window)) in shapes {
        let (kv, q) = case(&mut rng, (heads, kv_heads, d), q_start + t, t);
        let plan = SparsePrefill::new(bq, sq, bk, keys, (sinks, window)).unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let (want_out, want_lse) = plan.reference(&q, &kv, (heads, t), q_start, scale);
        let qt = Tensor::from_vec(q, (heads, t, d), &Device::Cpu).unwrap();
        let got = plan.attend(&qt, &kv, q_start, scale).unwrap();
        let out = got.out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let lse = got.lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (e_out, e_lse) = (max_diff(&out, &want_out), max_diff(&lse, &want_lse));
        println!("{plan:?} from {q_start}, {t} rows: max |attend - reference| out {e_out:.2e}, lse {e_lse:.2e}");
        assert!(e_out < 1e-5 && e_lse < 1e-4, "seed {seed}: {plan:?} from {q_start}: out {e_out}, lse {e_lse}");
    }
}

/// With a budget over the whole region every query block keeps every key: the sparse prefill
/// is dense causal attention (folio-kernels' attention over the same K/V).
#[test]
fn a_budget_over_the_region_is_dense() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (heads, kv_heads, d, q_start, t) = (4, 2, 16, 120, 80);
    let (kv, q) = case(&mut rng, (heads, kv_heads, d), q_start + t, t);
    let plan = SparsePrefill::new(16, 2, 4, q_start + t, (4, 16)).unwrap();
    let scale = 0.25;
    let qt = Tensor::from_vec(q, (heads, t, d), &Device::Cpu).unwrap();
    let got = plan.attend(&qt, &kv, q_start, scale).unwrap();
    let k = Tensor::from_vec(kv.k.clone(), (kv_heads, q_start + t, d), &Device::Cpu).unwrap();
    let v = Tensor::from_vec(kv.v.clone(), (kv_heads, q_start + t, d), &Device::Cpu).unwrap();
    let dense =
        folio_kernels::attention::attention(&qt, &k, &v, folio_kernels::attention::Mask::causal(q_start), scale)
            .unwrap();
    let diff = (got.out - dense.out).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff < 1e-5, "seed {seed}: max |sparse - dense| {diff}");
}

/// The search's premise (the paper's): scores change smoothly along the keys. Keys whose match
/// with the block's queries falls off with their distance from one far-back key (plus noise):
/// that key's block is kept, by a budget of 4 blocks of 480.
#[test]
fn the_mask_keeps_the_best_key() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (d, n, p0) = (16, 2000, 1990);
    let query: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let best = rng.random_range(8..1900);
    let k: Vec<f32> = (0..n)
        .flat_map(|p| {
            let near = 1.0 - (p as f32 - best as f32).abs() / n as f32;
            query.iter().map(|q| near * q + rng.random_range(-1e-3f32..1e-3)).collect::<Vec<_>>()
        })
        .collect();
    let kv = LayerRows { v: k.clone(), k, kv_heads: 1, len: n, head_dim: d };
    let plan = SparsePrefill::new(8, 2, 4, 16, (4, 64)).unwrap();
    let rows: Vec<&[f32]> = (0..8).map(|_| query.as_slice()).collect();
    let kept = plan.mask(&rows, &kv, 0, p0);
    let (first, window_start) = plan.region(p0);
    assert_eq!(kept.len(), 16, "seed {seed}");
    assert!(
        kept.iter().all(|&p| p >= first && p < window_start),
        "seed {seed}: {kept:?} outside {first}..{window_start}"
    );
    assert!(kept.contains(&best), "seed {seed}: key {best} not in {kept:?}");
}

#[test]
fn sizes_of_zero_are_refused() {
    assert!(SparsePrefill::new(0, 1, 2, 8, (4, 16)).is_err());
    assert!(SparsePrefill::new(64, 128, 2, 8, (4, 16)).is_err());
    assert!(SparsePrefill::new(64, 2, 2, 0, (4, 16)).is_err());
    assert!(SparsePrefill::new(64, 2, 2, 512, (0, 0)).is_ok());
}
