//! The sparse prefill's fast path against its reference on fresh random inputs (the seed printed
//! on failure), chunk by chunk as a prefill calls it; its dense rows against dense attention; its
//! estimate against a planted key block; its knobs.

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{SparseAttention, SparsePrefill};
use crate::attention::select::LayerRows;

/// Random K/V of `kv_heads` heads and `n` rows, and `heads` query heads of `n` rows (every
/// position's query: a chunk takes its rows).
fn case(rng: &mut StdRng, (heads, kv_heads, d): (usize, usize, usize), n: usize) -> (LayerRows, Vec<f32>) {
    let mut draw = |len: usize| (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<f32>>();
    let (k, v) = (draw(kv_heads * n * d), draw(kv_heads * n * d));
    (LayerRows { k, v, kv_heads, len: n, head_dim: d }, draw(heads * n * d))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Rows `from..to` of every head of `q` (`[heads, n, d]` flat).
fn rows(q: &[f32], (heads, n, d): (usize, usize, usize), from: usize, to: usize) -> Vec<f32> {
    (0..heads).flat_map(|h| q[(h * n + from) * d..(h * n + to) * d].iter().copied()).collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// A prefill of `n` positions in chunks cut at `cuts` through one [`SparseAttention`] (its key
/// means kept across chunks, as a layer's are) gives each chunk the reference's rows.
fn check_chunks(
    seed: u64,
    (heads, kv_heads, d): (usize, usize, usize),
    n: usize,
    cuts: &[usize],
    pattern: SparsePrefill,
    staged: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (kv, q) = case(&mut rng, (heads, kv_heads, d), n);
    let attn = SparseAttention { staged, ..SparseAttention::new(pattern) };
    let scale = 1.0 / (d as f32).sqrt();
    let k = Tensor::from_vec(kv.k.clone(), (kv_heads, n, d), &Device::Cpu).unwrap();
    let v = Tensor::from_vec(kv.v.clone(), (kv_heads, n, d), &Device::Cpu).unwrap();
    let bounds: Vec<usize> = std::iter::once(0).chain(cuts.iter().copied()).chain(std::iter::once(n)).collect();
    for w in bounds.windows(2) {
        let (from, to) = (w[0], w[1]);
        let qc = rows(&q, (heads, n, d), from, to);
        let prefix = LayerRows {
            k: (0..kv_heads).flat_map(|h| kv.k[h * n * d..(h * n + to) * d].iter().copied()).collect(),
            v: (0..kv_heads).flat_map(|h| kv.v[h * n * d..(h * n + to) * d].iter().copied()).collect(),
            kv_heads,
            len: to,
            head_dim: d,
        };
        let (want_out, want_lse) = pattern.reference(&qc, &prefix, (heads, to - from), from, scale);
        let qt = Tensor::from_vec(qc, (heads, to - from, d), &Device::Cpu).unwrap();
        let got =
            attn.attend_chunk(&qt, &k.narrow(1, 0, to).unwrap(), &v.narrow(1, 0, to).unwrap(), from, scale).unwrap();
        let (e_out, e_lse) = (max_diff(&flat(&got.out), &want_out), max_diff(&flat(&got.lse), &want_lse));
        println!("{pattern:?}, rows {from}..{to}: max |fast - reference| out {e_out:.2e}, lse {e_lse:.2e}");
        assert!(e_out < 1e-5 && e_lse < 1e-4, "seed {seed}: {pattern:?} rows {from}..{to}: out {e_out}, lse {e_lse}");
    }
}

/// Dense rows then sparse ones; chunks from positions that are not whole blocks (a block cut at
/// both ends of a chunk, two cut blocks alone in one); GQA groups of 1, 2 and 4; no sinks and
/// no window; batches of one block (the staged bytes' limit) and of all.
#[test]
fn the_fast_path_matches_the_reference_chunk_by_chunk() {
    let seed = rand::random();
    let p = |block, keys, sinks, window| SparsePrefill::new(block, keys, sinks, window).unwrap();
    check_chunks(seed, (4, 2, 16), 200, &[64, 128], p(4, 8, 4, 8), u64::MAX);
    check_chunks(seed, (4, 2, 16), 230, &[37, 101, 133, 160], p(4, 8, 4, 8), u64::MAX);
    check_chunks(seed, (4, 1, 8), 300, &[150], p(8, 20, 0, 0), 1);
    check_chunks(seed, (2, 2, 32), 260, &[97, 131], p(8, 16, 8, 16), u64::MAX);
}

/// Before the first sparse block the fast path is dense causal attention (folio-kernels' over
/// the same K/V).
#[test]
fn rows_before_the_first_sparse_block_are_dense() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (heads, kv_heads, d) = (4, 2, 16);
    let pattern = SparsePrefill::new(4, 8, 4, 8).unwrap();
    let n = pattern.first_sparse_block() * pattern.block;
    let (kv, q) = case(&mut rng, (heads, kv_heads, d), n);
    let (k, v) = (
        Tensor::from_vec(kv.k, (kv_heads, n, d), &Device::Cpu).unwrap(),
        Tensor::from_vec(kv.v, (kv_heads, n, d), &Device::Cpu).unwrap(),
    );
    let (from, qt) = (5, Tensor::from_vec(rows(&q, (heads, n, d), 5, n), (heads, n - 5, d), &Device::Cpu).unwrap());
    let got = SparseAttention::new(pattern).attend_chunk(&qt, &k, &v, from, 0.25).unwrap();
    let mask = folio_kernels::attention::Mask::causal(from);
    let dense = folio_kernels::attention::attention(&qt, &k, &v, mask, 0.25).unwrap();
    let diff = max_diff(&flat(&got.out), &flat(&dense.out));
    assert!(diff < 1e-5, "seed {seed}: max |sparse - dense| {diff}");
}

/// The estimate's premise: a key block whose keys point where a query block's rows do is among
/// its kept blocks, wherever it lies in the region.
#[test]
fn the_estimate_keeps_a_planted_key_block() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (d, n, b) = (16, 4096, 16);
    let pattern = SparsePrefill::new(b, 4 * b, b, 4 * b).unwrap();
    let query: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let j = n / b - 1;
    let planted = rng.random_range(pattern.region(j));
    let k: Vec<f32> = (0..n)
        .flat_map(|p| {
            let near = if p / b == planted { 1.0 } else { 0.0 };
            query.iter().map(|x| near * x + rng.random_range(-0.3f32..0.3)).collect::<Vec<_>>()
        })
        .collect();
    let kv = LayerRows { v: k.clone(), k, kv_heads: 1, len: n, head_dim: d };
    let chosen = pattern.choose(j, &[query], &kv, 0);
    assert_eq!(chosen.len(), 4, "seed {seed}");
    assert!(chosen.iter().all(|c| pattern.region(j).contains(c)), "seed {seed}: {chosen:?}");
    assert!(chosen.contains(&planted), "seed {seed}: block {planted} not in {chosen:?}");
}

#[test]
fn knobs_parse_print_and_refuse() {
    let p = SparsePrefill::parse("keys=1024, window=512").unwrap();
    assert_eq!(p, SparsePrefill { keys: 1024, window: 512, ..SparsePrefill::DEFAULT });
    assert_eq!(SparsePrefill::parse(&p.knobs()).unwrap(), p);
    assert_eq!(SparsePrefill::parse("").unwrap(), SparsePrefill::DEFAULT);
    for bad in ["keys", "keys=many", "depth=3", "block=0", "keys=0"] {
        let err = SparsePrefill::parse(bad).unwrap_err().to_string();
        assert!(err.contains("sparse prefill"), "{bad}: {err}");
    }
    assert_eq!(SparsePrefill::DEFAULT.keys_per_row(), 3200);
}
