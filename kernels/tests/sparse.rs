//! The sparse-decode primitives' fast paths (the CUDA kernels of kernels/cuda/sparse.cu) against
//! their references, on fresh random inputs, with one test body for every device.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::sparse::{self, reference};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::{max_abs_diff, random};

/// Attention over a KV head's first rows, shared by its group, as the selected-row reference
/// with every head selecting those rows: groups of 1 to 20 heads, f32 and bf16, head dims that
/// are and are not multiples of eight, fewer rows than stored, none, and a bias with −∞ pads.
/// bf16 queries over bf16 rows without a bias (the model's decode on a GPU) take the tensor-core
/// kernel there, which rounds the softmax weights to bf16: held to [`MMA_TOLERANCE`].
fn decode_attention_rows_matches_reference(device: &Device) -> Result<()> {
    /// |out − reference| allowed where the weights are rounded to bf16 (relative error 2⁻⁹ of
    /// each, values within ±1): twice that bound.
    const MMA_TOLERANCE: f32 = 4e-3;
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, kv_heads, n, d, rows, dtype, biased, q_bf16) in [
        (4, 2, 300, 32, 300, DType::F32, false, false),
        (28, 4, 6000, 128, 5003, DType::BF16, false, false),
        (28, 4, 6000, 128, 5003, DType::BF16, false, true),
        (28, 28, 700, 128, 650, DType::BF16, true, true),
        (6, 3, 50, 98, 41, DType::F32, true, false),
        (16, 1, 200, 64, 130, DType::BF16, false, true),
        (40, 2, 3000, 32, 2999, DType::BF16, false, true),
        (4, 4, 100, 128, 64, DType::BF16, false, true),
        (8, 2, 20, 128, 0, DType::BF16, false, true),
        (2, 2, 9, 256, 0, DType::F32, false, false),
        (8, 2, 33, 80, 1, DType::F32, true, false),
    ] {
        let mut q = random(&mut rng, heads * d, 1.0);
        if q_bf16 {
            q.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
        }
        let kt =
            Tensor::from_vec(random(&mut rng, kv_heads * n * d, 0.5), (kv_heads, n, d), device)?.to_dtype(dtype)?;
        let vt =
            Tensor::from_vec(random(&mut rng, kv_heads * n * d, 1.0), (kv_heads, n, d), device)?.to_dtype(dtype)?;
        let as_f32 = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let (k_ref, v_ref) = (as_f32(&kt)?, as_f32(&vt)?);
        // Pads at −∞ in the last few rows of every other head (never its only row), as a padded
        // pick has them.
        let mut bias = random(&mut rng, heads * rows, 5.0);
        for h in (0..heads).step_by(2) {
            for j in rows.saturating_sub(3).max(1)..rows {
                bias[h * rows + j] = f32::NEG_INFINITY;
            }
        }
        let scale = 1.0 / (d as f32).sqrt();
        let idx: Vec<u32> = (0..heads).flat_map(|_| 0..rows as u32).collect();
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
        let qt = if q_bf16 { qt.to_dtype(DType::BF16)? } else { qt };
        let bt = Tensor::from_vec(bias, (heads, rows), device)?;
        let (o, l) = sparse::decode_attention_rows(&qt, &kt, &vt, rows, biased.then_some(&bt), scale)?;
        let (o, l): (Vec<f32>, Vec<f32>) = (o.flatten_all()?.to_vec1()?, l.to_vec1()?);
        let diff = max_abs_diff(&o, &want_o);
        println!(
            "{device:?} heads {heads}/{kv_heads} d {d} rows {rows} {dtype:?}{}: max |out - ref| = {diff:.2e}",
            if q_bf16 { ", bf16 queries" } else { "" }
        );
        let tensor_cores = device.is_cuda() && q_bf16 && dtype == DType::BF16 && !biased && [32, 64, 128].contains(&d);
        assert!(diff < if tensor_cores { MMA_TOLERANCE } else { 1e-4 }, "seed {seed}: {diff}");
        for (a, b) in l.iter().zip(&want_l) {
            assert!(a == b || (a - b).abs() < 1e-4 * b.abs().max(1.0), "seed {seed}: lse {a} vs {b}");
        }
    }
    // More rows than stored, or a bias of another shape, are refused.
    let q = Tensor::zeros((2, 8), DType::F32, device)?;
    let k = Tensor::zeros((1, 10, 8), DType::F32, device)?;
    assert!(sparse::decode_attention_rows(&q, &k, &k, 11, None, 1.0).is_err());
    let bias = Tensor::zeros((2, 4), DType::F32, device)?;
    assert!(sparse::decode_attention_rows(&q, &k, &k, 5, Some(&bias), 1.0).is_err());
    Ok(())
}

test_device!(decode_attention_rows_matches_reference, decode_attention_rows_cpu, decode_attention_rows_cuda);

/// Attention mass for GQA groups of 1 to 32 heads (more than the kernel's 8 at once), f32 and
/// bf16 keys, head dims that are and are not multiples of eight, fewer rows than stored, with
/// and without earlier sums, the lse of a real attention over those rows (each head's masses
/// then sum to 1) and a head that attended nothing (−∞).
fn attention_mass_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, kv_heads, n, d, rows, prev, dtype) in [
        (4, 2, 300, 32, 300, None, DType::F32),
        (28, 4, 5000, 128, 4099, Some(4098), DType::BF16),
        (6, 3, 50, 98, 41, Some(12), DType::F32),
        (16, 1, 200, 64, 130, Some(130), DType::BF16),
        (2, 2, 9, 256, 1, None, DType::F32),
        (32, 1, 100, 64, 90, None, DType::BF16),
    ] {
        let q = random(&mut rng, heads * d, 1.0);
        let k = Tensor::from_vec(random(&mut rng, kv_heads * n * d, 0.5), (kv_heads, n, d), device)?.to_dtype(dtype)?;
        let k_ref: Vec<f32> = k.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let scale = 1.0 / (d as f32).sqrt();
        // Each head's lse over the first `rows` keys, as a decode step over them returns it.
        let idx: Vec<u32> = (0..heads).flat_map(|_| 0..rows as u32).collect();
        let (_, mut lse) = reference::decode_attention(&q, &k_ref, &k_ref, &idx, None, (heads, kv_heads, n, d), scale);
        lse[heads - 1] = f32::NEG_INFINITY;
        let prev_v = prev.map(|w| random(&mut rng, kv_heads * w, 3.0));
        let want = reference::attention_mass(
            &q,
            &k_ref,
            &lse,
            prev_v.as_deref().zip(prev),
            (heads, kv_heads, n, d),
            rows,
            scale,
        );
        // Without earlier sums a KV head's masses add up to its query heads that attended
        // (each head's probabilities over the rows sum to 1; the last head attended nothing).
        if prev.is_none() {
            let group = heads / kv_heads;
            for g in 0..kv_heads {
                let total: f64 = want[g * rows..(g + 1) * rows].iter().map(|&x| x as f64).sum();
                let expected = (group - usize::from(g == kv_heads - 1)) as f64;
                assert!((total - expected).abs() < 1e-3, "seed {seed}: group {g}'s mass {total}, want {expected}");
            }
        }
        let qt = Tensor::from_vec(q, (heads, d), device)?;
        let lt = Tensor::from_vec(lse, heads, device)?;
        let pt = prev_v.zip(prev).map(|(v, w)| Tensor::from_vec(v, (kv_heads, w), device)).transpose()?;
        let got: Vec<f32> = sparse::attention_mass(&qt, &k, &lt, pt.as_ref(), rows, scale)?.flatten_all()?.to_vec1()?;
        assert_eq!(got.len(), kv_heads * rows);
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0f32, f32::max);
        println!("{device:?} heads {heads}/{kv_heads} d {d} rows {rows} {dtype:?}: max rel |mass - ref| = {worst:.2e}");
        assert!(worst < 1e-4, "seed {seed}: {worst}");
    }
    // More rows than stored, or earlier sums wider than the rows, are refused.
    let q = Tensor::zeros((2, 8), DType::F32, device)?;
    let k = Tensor::zeros((1, 10, 8), DType::F32, device)?;
    let lse = Tensor::zeros(2, DType::F32, device)?;
    assert!(sparse::attention_mass(&q, &k, &lse, None, 11, 1.0).is_err());
    let wide = Tensor::zeros((1, 6), DType::F32, device)?;
    assert!(sparse::attention_mass(&q, &k, &lse, Some(&wide), 5, 1.0).is_err());
    Ok(())
}

test_device!(attention_mass_matches_reference, attention_mass_cpu, attention_mass_cuda);

/// SimHash codes equal the reference's bit for bit (an index built on one device samples the
/// keys the other's would), and are the sign pattern of the projections (within rounding of 0):
/// launches of a few rows (a decode step's query heads, each code's bits in blocks apart) and of
/// many (an index build's keys, a code a thread).
fn simhash_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (rows, d, bits, tables) in
        [(500, 32, 10, 150), (64, 128, 8, 75), (3, 16, 1, 2), (70, 256, 12, 9), (33, 80, 16, 3), (28, 128, 10, 83)]
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
