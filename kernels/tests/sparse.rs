//! The sparse-decode primitives' fast paths (the CUDA kernels of kernels/cuda/sparse.cu) against
//! their references, on fresh random inputs, with one test body for every device.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::sparse::{self, reference};
use folio_kernels::Positions;
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::{max_abs_diff, random};

/// Selected-row attention for GQA groups, head dims that are and are not multiples of the
/// warp, f32 and bf16 K/V, with and without logit bias, repeated and empty selections.
fn decode_attention_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, kv_heads, n, d, sel, dtype, biased) in [
        (4, 2, 300, 32, 17, DType::F32, false),
        (8, 2, 1000, 128, 257, DType::BF16, true),
        (6, 3, 50, 80, 50, DType::F32, true),
        (2, 1, 10, 64, 0, DType::F32, false),
        (4, 4, 77, 98, 33, DType::BF16, true),
        (2, 2, 64, 256, 40, DType::F32, false),
        (28, 4, 4096, 128, 1024, DType::BF16, false),
    ] {
        let q = random(&mut rng, heads * d, 1.0);
        // Logits up to ~±30: the online softmax must not overflow.
        let k = random(&mut rng, kv_heads * n * d, 0.5);
        let v = random(&mut rng, kv_heads * n * d, 1.0);
        let idx: Vec<u32> = (0..heads * sel).map(|_| rng.random_range(0..n as u32)).collect();
        let bias: Vec<f32> = random(&mut rng, heads * sel, 5.0);
        let kt = Tensor::from_vec(k, (kv_heads, n, d), device)?.to_dtype(dtype)?;
        let vt = Tensor::from_vec(v, (kv_heads, n, d), device)?.to_dtype(dtype)?;
        // The reference sees the stored (rounded) values.
        let as_f32 = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let (k_ref, v_ref) = (as_f32(&kt)?, as_f32(&vt)?);
        let scale = 1.0 / (d as f32).sqrt();
        let (want_o, want_l) = reference::decode_attention(
            &q,
            &k_ref,
            &v_ref,
            &idx,
            biased.then_some(&bias[..]),
            (heads, kv_heads, n, d),
            scale,
        );
        let qt = Tensor::from_vec(q, (heads, d), device)?;
        let it = Tensor::from_vec(idx, (heads, sel), device)?;
        let bt = Tensor::from_vec(bias, (heads, sel), device)?;
        let (o, l) = sparse::decode_attention(&qt, &kt, &vt, &it, biased.then_some(&bt), scale, Positions::Check)?;
        let (o, l): (Vec<f32>, Vec<f32>) = (o.flatten_all()?.to_vec1()?, l.to_vec1()?);
        let tol = if device.is_cpu() { 1e-6 } else { 1e-4 };
        let diff = max_abs_diff(&o, &want_o);
        println!("{device:?} heads {heads} d {d} sel {sel} {dtype:?}: max |out - ref| = {diff:.2e}");
        assert!(diff < tol, "seed {seed}: {diff}");
        for (a, b) in l.iter().zip(&want_l) {
            assert!(a == b || (a - b).abs() < tol * b.abs().max(1.0), "seed {seed}: lse {a} vs {b}");
        }
    }
    // A position past the stored rows is refused, never read.
    let q = Tensor::zeros((2, 32), DType::F32, device)?;
    let k = Tensor::zeros((1, 10, 32), DType::F32, device)?;
    let idx = Tensor::from_vec(vec![3u32, 10], (2, 1), device)?;
    assert!(sparse::decode_attention(&q, &k, &k, &idx, None, 1.0, Positions::Check).is_err());
    Ok(())
}

test_device!(decode_attention_matches_reference, decode_attention_cpu, decode_attention_cuda);

/// SimHash codes equal the reference's bit for bit (an index built on one device samples the
/// keys the other's would), and are the sign pattern of the projections (within rounding of 0).
fn simhash_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (rows, d, bits, tables) in
        [(500, 32, 10, 150), (64, 128, 8, 75), (3, 16, 1, 2), (70, 256, 12, 9), (33, 80, 16, 3)]
    {
        let x = random(&mut rng, rows * d, 1.0);
        let w = random(&mut rng, d * bits * tables, 1.0);
        let want = reference::simhash_codes(&x, &w, d, bits, tables);
        let got: Vec<u32> = sparse::simhash_codes(
            &Tensor::from_vec(x.clone(), (rows, d), device)?,
            &Tensor::from_vec(w.clone(), (d, bits * tables), device)?,
            bits,
            tables,
        )?
        .flatten_all()?
        .to_vec1()?;
        assert_eq!(got, want, "seed {seed}: {rows}x{d}, ({bits},{tables})");
        let mut near_zero = 0;
        for (t, code) in want.iter().enumerate() {
            assert!(*code < 1 << bits, "code {code} has more than {bits} bits");
            let (r, l) = (t / tables, t % tables);
            for bit in 0..bits {
                let col = l * bits + bit;
                let p: f64 = (0..d).map(|i| x[r * d + i] as f64 * w[i * bits * tables + col] as f64).sum();
                if ((code >> bit) & 1 == 1) != (p > 0.0) {
                    assert!(p.abs() < 1e-4, "seed {seed}: bit {bit} of code {t} is wrong for projection {p}");
                    near_zero += 1;
                }
            }
        }
        println!("{device:?} {rows}x{d}, ({bits},{tables}): identical codes; {near_zero} bits off the f64 sign near 0");
    }
    Ok(())
}

test_device!(simhash_matches_reference, simhash_cpu, simhash_cuda);

/// Label scores (one byte per code, offset and range per token) equal the dequantized dot
/// product, for GQA groups and every code width.
fn label_scores_match_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, kv_heads, n, r, bits) in
        [(4, 2, 500, 8, 4), (28, 4, 3000, 32, 4), (2, 2, 7, 5, 8), (3, 1, 64, 16, 1), (2, 1, 33, 48, 3)]
    {
        let ql = random(&mut rng, heads * r, 2.0);
        let codes: Vec<u8> = (0..kv_heads * n * r).map(|_| rng.random_range(0..(1u32 << bits)) as u8).collect();
        let scale: Vec<f32> =
            (0..kv_heads * n).flat_map(|_| [rng.random_range(-1.0..0.0), rng.random_range(0.1..2.0)]).collect();
        let want = reference::label_scores(&ql, &codes, &scale, (heads, kv_heads, n, r), bits);
        let got: Vec<f32> = sparse::label_scores(
            &Tensor::from_vec(ql, (heads, r), device)?,
            &Tensor::from_vec(codes, (kv_heads, n, r), device)?,
            &Tensor::from_vec(scale, (kv_heads, n, 2), device)?,
            bits,
        )?
        .flatten_all()?
        .to_vec1()?;
        let diff = max_abs_diff(&got, &want);
        println!("{device:?} label scores {heads}x{n}, r {r}, {bits} bits: max diff {diff:.2e}");
        assert!(diff < 1e-4, "seed {seed}: {diff}");
    }
    Ok(())
}

test_device!(label_scores_match_reference, label_scores_cpu, label_scores_cuda);
