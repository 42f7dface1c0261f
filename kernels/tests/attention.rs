//! The fast attention path against the reference, on fresh random inputs, for every device.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::attention::{self, reference, Mask};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::{max_abs_diff, random};

fn tolerance(device: &Device) -> f32 {
    if device.is_cpu() {
        1e-5
    } else {
        1e-4
    }
}

/// Random shapes: prefill chunks (q_len > 1), decode (q_len = 1), GQA/MQA/MHA, windows.
fn fast_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    for case in 0..40 {
        let kv_heads = [1, 2, 4][rng.random_range(0..3)];
        let q_heads = kv_heads * [1, 2, 4][rng.random_range(0..3)];
        let head_dim = [8, 16, 64][rng.random_range(0..3)];
        let kv_len = rng.random_range(1..200);
        let q_len = rng.random_range(1..=kv_len.min(64));
        let q_offset = kv_len - q_len; // queries are the last q_len tokens, as in prefill/decode
        let window = if case % 3 == 0 { Some(rng.random_range(1..=kv_len)) } else { None };
        let mask = Mask { q_offset, window };
        let scale = 1.0 / (head_dim as f32).sqrt();
        // A large spread makes peaked softmaxes, a small one diffuse ones: test both.
        let spread = if case % 2 == 0 { 3.0 } else { 0.5 };
        let q = random(&mut rng, q_heads * q_len * head_dim, spread);
        let k = random(&mut rng, kv_heads * kv_len * head_dim, spread);
        let v = random(&mut rng, kv_heads * kv_len * head_dim, 1.0);
        let (ref_out, ref_lse) = reference::attention_block(&q, &k, &v, 0, q_heads, kv_heads, head_dim, mask, scale);

        let qt = Tensor::from_vec(q, (q_heads, q_len, head_dim), device)?;
        let kt = Tensor::from_vec(k, (kv_heads, kv_len, head_dim), device)?;
        let vt = Tensor::from_vec(v, (kv_heads, kv_len, head_dim), device)?;
        let got = attention::attention(&qt, &kt, &vt, mask, scale)?;
        let out = got.out.flatten_all()?.to_vec1::<f32>()?;
        let lse = got.lse.flatten_all()?.to_vec1::<f32>()?;
        let (d_out, d_lse) = (max_abs_diff(&out, &ref_out), max_abs_diff(&lse, &ref_lse));
        let tol = tolerance(device);
        assert!(
            d_out < tol && d_lse < tol * 10.0,
            "seed {seed}, case {case}: q_heads {q_heads} kv_heads {kv_heads} d {head_dim} q_len {q_len} \
             kv_len {kv_len} window {window:?}: max |out diff| {d_out}, max |lse diff| {d_lse}"
        );
    }
    Ok(())
}
test_device!(fast_matches_reference, fast_matches_reference_cpu, fast_matches_reference_cuda);

/// Queries chunked by the score-memory bound give the reference answer across chunk edges.
fn chunking_is_exact(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (q_heads, kv_heads, head_dim, kv_len, q_len) = (8, 2, 8, 700, 300);
    // 2^14 scores at once: 2 queries of 8 heads x 700 keys per chunk, so 150 chunks.
    let limit = 1 << 14;
    for window in [None, Some(97)] {
        let mask = Mask { q_offset: kv_len - q_len, window };
        let q = random(&mut rng, q_heads * q_len * head_dim, 1.0);
        let k = random(&mut rng, kv_heads * kv_len * head_dim, 1.0);
        let v = random(&mut rng, kv_heads * kv_len * head_dim, 1.0);
        let qt = Tensor::from_slice(&q, (q_heads, q_len, head_dim), device)?;
        let kt = Tensor::from_slice(&k, (kv_heads, kv_len, head_dim), device)?;
        let vt = Tensor::from_slice(&v, (kv_heads, kv_len, head_dim), device)?;
        let got = attention::attention_block_with_limit(&qt, &kt, &vt, 0, mask, 0.35, limit)?;
        let (ref_out, ref_lse) = reference::attention_block(&q, &k, &v, 0, q_heads, kv_heads, head_dim, mask, 0.35);
        let out = got.out.flatten_all()?.to_vec1::<f32>()?;
        let lse = got.lse.flatten_all()?.to_vec1::<f32>()?;
        assert!(max_abs_diff(&out, &ref_out) < tolerance(device), "seed {seed}, window {window:?}");
        assert!(max_abs_diff(&lse, &ref_lse) < tolerance(device) * 10.0, "seed {seed}, window {window:?}");
    }
    Ok(())
}
test_device!(chunking_is_exact, chunking_is_exact_cpu, chunking_is_exact_cuda);

#[test]
fn window_semantics() {
    let m = Mask { q_offset: 0, window: Some(3) };
    // Query at position 5 sees keys 3, 4, 5 (three tokens, its own included).
    let seen: Vec<usize> = (0..8).filter(|&j| m.visible(5, j)).collect();
    assert_eq!(seen, vec![3, 4, 5]);
    assert!(!Mask::causal(0).visible(2, 3), "future keys are never visible");
}

#[test]
fn bad_shapes_are_errors() -> Result<()> {
    let d = Device::Cpu;
    let q = Tensor::zeros((3, 1, 8), candle_core::DType::F32, &d)?;
    let k = Tensor::zeros((2, 4, 8), candle_core::DType::F32, &d)?;
    let err = attention::attention(&q, &k, &k, Mask::causal(3), 1.0).unwrap_err();
    assert!(err.to_string().contains("not a multiple"), "{err}");
    // A query past the stored keys would see nothing (its row would be NaN): refused.
    let q = Tensor::zeros((2, 2, 8), candle_core::DType::F32, &d)?;
    let err = attention::attention(&q, &k, &k, Mask { q_offset: 3, window: Some(2) }, 1.0).unwrap_err();
    assert!(err.to_string().contains("kv_len is 4"), "{err}");
    Ok(())
}

/// Keys split into blocks at random positions: each block's partial attention matches the
/// reference for that block (empty rows included), and the LSE merge of the partials equals
/// attention over all keys.
fn blocks_merge_exactly(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for case in 0..20 {
        let (kv_heads, groups, head_dim) = ([1, 2][case % 2], [1, 3][rng.random_range(0..2)], 16);
        let q_heads = kv_heads * groups;
        let kv_len = rng.random_range(2..300);
        let q_len = rng.random_range(1..=kv_len.min(40));
        let window = if case % 3 == 0 { Some(rng.random_range(1..=kv_len)) } else { None };
        let mask = Mask { q_offset: kv_len - q_len, window };
        let split = rng.random_range(1..kv_len);
        let q = random(&mut rng, q_heads * q_len * head_dim, 2.0);
        let k = random(&mut rng, kv_heads * kv_len * head_dim, 2.0);
        let v = random(&mut rng, kv_heads * kv_len * head_dim, 1.0);
        let qt = Tensor::from_slice(&q, (q_heads, q_len, head_dim), device)?;
        let kt = Tensor::from_slice(&k, (kv_heads, kv_len, head_dim), device)?;
        let vt = Tensor::from_slice(&v, (kv_heads, kv_len, head_dim), device)?;
        let mut parts = Vec::new();
        for (start, len) in [(0, split), (split, kv_len - split)] {
            let (kb, vb) = (kt.narrow(1, start, len)?, vt.narrow(1, start, len)?);
            // A tiny score limit forces several key blocks inside the partial too.
            let got = attention::attention_block_with_limit(&qt, &kb, &vb, start, mask, 0.3, 1 << 8)?;
            let rows = |x: &[f32], s: usize| -> Vec<f32> {
                (0..kv_heads).flat_map(|h| x[(h * kv_len + s) * head_dim..][..len * head_dim].to_vec()).collect()
            };
            let (ro, rl) = reference::attention_block(
                &q,
                &rows(&k, start),
                &rows(&v, start),
                start,
                q_heads,
                kv_heads,
                head_dim,
                mask,
                0.3,
            );
            let lse = got.lse.flatten_all()?.to_vec1::<f32>()?;
            for (a, b) in lse.iter().zip(&rl) {
                assert!(a == b || (a - b).abs() < tolerance(device) * 10.0, "seed {seed} case {case}: lse {a} vs {b}");
            }
            assert!(max_abs_diff(&got.out.flatten_all()?.to_vec1::<f32>()?, &ro) < tolerance(device), "seed {seed}");
            parts.push(got);
        }
        let merged = attention::merge(&parts[0], &parts[1])?;
        let (ro, rl) = reference::attention_block(&q, &k, &v, 0, q_heads, kv_heads, head_dim, mask, 0.3);
        assert!(max_abs_diff(&merged.out.flatten_all()?.to_vec1::<f32>()?, &ro) < tolerance(device), "seed {seed}");
        assert!(
            max_abs_diff(&merged.lse.flatten_all()?.to_vec1::<f32>()?, &rl) < tolerance(device) * 10.0,
            "seed {seed}"
        );
    }
    Ok(())
}
test_device!(blocks_merge_exactly, blocks_merge_exactly_cpu, blocks_merge_exactly_cuda);

/// bf16 inputs (the engine's GPU dtype): on CUDA with head dims 32/64/128 every tensor-core
/// prefill kernel the GPU has (`flash_kernels`: `mma.sync` everywhere, `wgmma` on Hopper for
/// d 128) and the default path, elsewhere the f32 path. Shapes span several query tiles and key
/// tiles, ragged edges, GQA, windows, and key blocks that start late (queries that see none of
/// them) or end early; K/V are sometimes a narrowed view of a longer cache whose unused rows
/// are NaN (as a prefill's keys so far are: read in place, never past the view). The last two
/// cases are Qwen2.5-7B's heads over a few thousand keys (many tiles per block). The
/// reference gets the same bf16-rounded inputs.
fn bf16_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    // The kernel rounds the softmax probabilities to bf16 (8 bits of mantissa) for P·V.
    let (tol_out, tol_lse) = if device.is_cuda() { (1e-2, 1e-3) } else { (1e-5, 1e-4) };
    let mut worst: std::collections::BTreeMap<String, (f32, f32)> = Default::default();
    const SMALL_CASES: usize = 24;
    for case in 0..SMALL_CASES + 2 {
        let large = case >= SMALL_CASES;
        let kv_heads = if large { 4 } else { [1, 2, 4][rng.random_range(0..3)] };
        let q_heads = kv_heads * if large { 7 } else { [1, 2, 7][rng.random_range(0..3)] };
        let head_dim = if large { 128 } else { [32, 64, 128][case % 3] };
        let q_len = if large { rng.random_range(600..900) } else { rng.random_range(1..260) };
        let kv_len = q_len + if large { rng.random_range(1000..2500) } else { rng.random_range(0..400) };
        // Keys of this block sit at k_start..k_start + len: a later block, or an earlier one.
        let (k_start, len) = match case % 4 {
            0 => (0, kv_len),
            1 => (rng.random_range(0..kv_len), kv_len - rng.random_range(0..kv_len / 2)),
            2 => (0, rng.random_range(1..=kv_len)),
            _ => (kv_len + 5, 70), // past every query: nothing visible
        };
        let window = if case % 5 == 1 { Some(rng.random_range(1..=kv_len)) } else { None };
        let mask = Mask { q_offset: kv_len - q_len, window };
        let scale = 1.0 / (head_dim as f32).sqrt();
        let spread = if case % 2 == 0 { 3.0 } else { 0.7 };
        let round = |x: Vec<f32>| -> Vec<f32> { x.into_iter().map(|v| half::bf16::from_f32(v).to_f32()).collect() };
        let q = round(random(&mut rng, q_heads * q_len * head_dim, spread));
        let k = round(random(&mut rng, kv_heads * len * head_dim, spread));
        let v = round(random(&mut rng, kv_heads * len * head_dim, 1.0));
        let (ro, rl) = reference::attention_block(&q, &k, &v, k_start, q_heads, kv_heads, head_dim, mask, scale);
        let t = |x: &[f32], shape: (usize, usize, usize)| Tensor::from_slice(x, shape, device)?.to_dtype(DType::BF16);
        // A view of the first `len` rows of a cache with room for more (NaN past the view).
        let view = |x: &[f32]| -> Result<Tensor> {
            let room = len + 1 + case;
            let mut buf = vec![f32::NAN; kv_heads * room * head_dim];
            for (h, rows) in x.chunks(len * head_dim).enumerate() {
                buf[h * room * head_dim..][..rows.len()].copy_from_slice(rows);
            }
            t(&buf, (kv_heads, room, head_dim))?.narrow(1, 0, len)
        };
        let (kt, vt) = if case % 2 == 1 {
            (view(&k)?, view(&v)?)
        } else {
            (t(&k, (kv_heads, len, head_dim))?, t(&v, (kv_heads, len, head_dim))?)
        };
        let qt = t(&q, (q_heads, q_len, head_dim))?;
        let mut runs = vec![("default".to_owned(), attention::attention_block(&qt, &kt, &vt, k_start, mask, scale)?)];
        for kernel in attention::flash_kernels(device, head_dim) {
            let got = attention::flash_attention_block(kernel, &qt, &kt, &vt, k_start, mask, scale)?;
            runs.push((format!("{kernel:?}"), got));
        }
        for (name, got) in runs {
            let out = got.out.flatten_all()?.to_vec1::<f32>()?;
            let lse = got.lse.flatten_all()?.to_vec1::<f32>()?;
            let d_out = max_abs_diff(&out, &ro);
            // -inf (no visible key) must be exactly -inf on both sides.
            let d_lse = lse.iter().zip(&rl).map(|(a, b)| if a == b { 0.0 } else { (a - b).abs() }).fold(0f32, f32::max);
            let w = worst.entry(name.clone()).or_default();
            *w = (w.0.max(d_out), w.1.max(d_lse));
            assert!(
                d_out < tol_out && d_lse < tol_lse,
                "seed {seed}, case {case}, {name}: q_heads {q_heads} kv_heads {kv_heads} d {head_dim} q_len {q_len} \
                 keys {k_start}+{len} of {kv_len} window {window:?}: max |out diff| {d_out}, max |lse diff| {d_lse}"
            );
        }
    }
    for (name, (o, l)) in worst {
        println!("bf16 on {device:?}, {name}: max |out diff| {o:.2e}, max |lse diff| {l:.2e}");
    }
    Ok(())
}
test_device!(bf16_matches_reference, bf16_matches_reference_cpu, bf16_matches_reference_cuda);

/// Keys all past the queries (or outside their window): output 0 and LSE -inf, never NaN; and
/// merging an empty partial changes nothing.
#[test]
fn empty_blocks_are_neutral() -> Result<()> {
    let d = Device::Cpu;
    let q = Tensor::ones((2, 3, 4), candle_core::DType::F32, &d)?;
    let k = Tensor::ones((1, 5, 4), candle_core::DType::F32, &d)?;
    let empty = attention::attention_block(&q, &k, &k, 10, Mask::causal(0), 1.0)?;
    assert!(empty.lse.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| *x == f32::NEG_INFINITY));
    assert!(empty.out.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| *x == 0.0));
    let full = attention::attention_block(&q, &k, &k, 0, Mask::causal(5), 1.0)?;
    let merged = attention::merge(&full, &empty)?;
    assert_eq!(merged.out.flatten_all()?.to_vec1::<f32>()?, full.out.flatten_all()?.to_vec1::<f32>()?);
    let both = attention::merge(&empty, &empty)?;
    assert!(both.out.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| *x == 0.0));
    Ok(())
}
