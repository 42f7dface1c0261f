//! Projections to heads and heads back to rows against candle's ops (bias add, reshape,
//! transpose, copy), bit for bit, on fresh random bf16 inputs, with and without a bias,
//! Qwen-like and odd shapes, a view that starts off a 16-byte boundary; and shapes that do not
//! split are errors. The split with RoPE on its first heads against the split and candle-nn's
//! rope, bit for bit, and against the rotation's definition.

use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::heads::{merge, merge_reference, reference, split};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

fn fast_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (t, n, hd) in [(1, 1, 8), (3, 2, 16), (37, 4, 128), (100, 28, 128), (5, 3, 12)] {
        let mut values = |len: usize, spread: f32| -> Result<Tensor> {
            let v: Vec<f32> =
                (0..len).map(|_| rng.random_range(-spread..spread) * 10f32.powi(rng.random_range(-4..3))).collect();
            Tensor::from_vec(v, len, device)?.to_dtype(DType::BF16)
        };
        let all = values(t * n * hd + 1, 4.0)?;
        let bias = values(n * hd, 1.0)?;
        for start in [0, 1] {
            let y = all.narrow(0, start, t * n * hd)?.reshape((t, n * hd))?;
            for b in [None, Some(&bias)] {
                let (fast, slow) = (split(&y, b, n, hd)?, reference(&y, b, n, hd)?);
                assert_eq!(fast.dims(), [n, t, hd]);
                let bits = |x: &Tensor| -> Result<Vec<u16>> {
                    Ok(x.flatten_all()?.to_vec1::<half::bf16>()?.into_iter().map(|v| v.to_bits()).collect())
                };
                assert!(
                    bits(&fast)? == bits(&slow)?,
                    "{t}x{n}x{hd} (start {start}, bias {}) differs on {device:?} (seed {seed})",
                    b.is_some()
                );
                // Both against the definition, value by value: out[h][i][d] = y[i][h·hd + d]
                // (+ bias[h·hd + d], within one bf16 rounding of the f32 sum).
                let (yv, out) = (bits(&y)?, fast.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
                let bv = b.map(|b| b.to_dtype(DType::F32)?.to_vec1::<f32>()).transpose()?;
                for (at, got) in out.iter().enumerate() {
                    let (h, i, d) = (at / (t * hd), at / hd % t, at % hd);
                    let col = h * hd + d;
                    let want =
                        half::bf16::from_bits(yv[i * n * hd + col]).to_f32() + bv.as_ref().map_or(0.0, |b| b[col]);
                    assert!(
                        (got - want).abs() <= want.abs() / 128.0,
                        "[{h}][{i}][{d}] = {got}, not {want} (seed {seed})"
                    );
                }
            }
        }
    }
    let y = Tensor::zeros((4, 30), DType::BF16, device)?;
    assert!(split(&y, None, 4, 8).unwrap_err().to_string().contains("are not 4 heads of 8"));
    let empty = Tensor::zeros((4, 0), DType::BF16, device)?;
    assert!(split(&empty, None, 0, 8).unwrap_err().to_string().contains("are not 0 heads of 8"));
    Ok(())
}

test_device!(fast_matches_reference, fast_matches_reference_cpu, fast_matches_reference_cuda);

fn merge_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (n, t, hd) in [(1, 1, 8), (2, 3, 16), (4, 37, 128), (28, 100, 128), (3, 5, 12), (28, 1, 128)] {
        let v: Vec<f32> = (0..n * t * hd + 1).map(|_| rng.random_range(-4.0f32..4.0)).collect();
        let all = Tensor::from_vec(v, n * t * hd + 1, device)?.to_dtype(DType::BF16)?;
        for start in [0, 1] {
            let a = all.narrow(0, start, n * t * hd)?.reshape((n, t, hd))?;
            let (fast, slow) = (merge(&a)?, merge_reference(&a)?);
            assert_eq!(fast.dims(), [t, n * hd]);
            let bits = |x: &Tensor| -> Result<Vec<u16>> {
                Ok(x.flatten_all()?.to_vec1::<half::bf16>()?.into_iter().map(|v| v.to_bits()).collect())
            };
            let (got, av) = (bits(&fast)?, bits(&a)?);
            assert!(got == bits(&slow)?, "{n}x{t}x{hd} (start {start}) differs on {device:?} (seed {seed})");
            // Against the definition: out[i][h·hd + d] = a[h][i][d].
            for (at, g) in got.iter().enumerate() {
                let (i, h, d) = (at / (n * hd), at / hd % n, at % hd);
                assert_eq!(*g, av[(h * t + i) * hd + d], "[{i}][{h}·{hd} + {d}] (seed {seed})");
            }
        }
    }
    Ok(())
}

test_device!(merge_matches_reference, merge_matches_reference_cpu, merge_matches_reference_cuda);

/// A new row placed into per-query-head buffers equals candle's three copies and the definition
/// (`dst[h][slot] = src[h / group][row]`, every other value untouched), bit for bit: rows of a
/// strided view (a segment's row, as the offloaded tail holds it), groups of 1 and 7, bf16 and
/// f32; a slot or row out of range is an error.
fn place_row_matches_reference(device: &Device) -> Result<()> {
    use folio_kernels::heads::{place_row, place_row_reference};
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (kv_heads, group, len, cap, d, dtype) in
        [(4, 7, 9, 20, 128, DType::BF16), (2, 1, 5, 6, 64, DType::F32), (3, 2, 1, 3, 12, DType::BF16)]
    {
        let heads = kv_heads * group;
        let draw = |rng: &mut StdRng, n: usize| -> Result<Tensor> {
            Tensor::from_vec((0..n).map(|_| rng.random_range(-3f32..3.0)).collect::<Vec<_>>(), n, device)?
                .to_dtype(dtype)
        };
        // The source: rows 2.. of a wider segment, so its head stride is not len · d.
        let segment = draw(&mut rng, kv_heads * (len + 2) * d)?.reshape((kv_heads, len + 2, d))?;
        let src = segment.narrow(1, 2, len)?;
        // The buffers: a view from the second head on (a start offset the kernel must honour).
        let start = draw(&mut rng, (heads + 1) * cap * d)?.reshape((heads + 1, cap, d))?.narrow(0, 1, heads)?;
        let (row, slot) = (len - 1, cap / 2);
        let (fast, slow) = (start.copy()?, start.copy()?);
        place_row(&fast, &src, row, slot, group)?;
        place_row_reference(&slow, &src, row, slot, group)?;
        let values = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let (got, want, before, s) = (values(&fast)?, values(&slow)?, values(&start)?, values(&src.contiguous()?)?);
        assert!(got == want, "seed {seed}: {dtype:?} group {group}: differs from candle's copies");
        for h in 0..heads {
            for j in 0..cap {
                for c in 0..d {
                    let at = (h * cap + j) * d + c;
                    let expect = if j == slot { s[((h / group) * len + row) * d + c] } else { before[at] };
                    assert!(got[at] == expect, "seed {seed}: {dtype:?} head {h} slot {j} channel {c}");
                }
            }
        }
        assert!(place_row(&fast, &src, len, 0, group).is_err() && place_row(&fast, &src, 0, cap, group).is_err());
    }
    Ok(())
}

test_device!(place_row_matches_reference, place_row_cpu, place_row_cuda);

/// [`split_rope`] against [`split_rope_reference`] (split, then candle-nn's rope) bit for bit,
/// and against the definition: out[h][i][p] = a·cos − b·sin and out[h][i][p + hd/2] = a·sin +
/// b·cos of a = y[i][h·hd + p] (+ bias), b its pair, for h < roped, the values as they are
/// past it: a decode step's Q, K and V of a 7B model in one call, a prefill chunk's heads, no
/// head rotated, odd sizes; mismatched tables are an error.
fn split_rope_matches_reference(device: &Device) -> Result<()> {
    use folio_kernels::heads::{split_rope, split_rope_reference};
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (t, n, roped, hd) in [(1, 36, 32, 128), (37, 4, 4, 128), (5, 3, 0, 16), (3, 5, 2, 12)] {
        let mut values = |len: usize, spread: f32| -> Result<Tensor> {
            let v: Vec<f32> = (0..len).map(|_| rng.random_range(-spread..spread)).collect();
            Tensor::from_vec(v, len, device)?.to_dtype(DType::BF16)
        };
        let y = values(t * n * hd, 4.0)?.reshape((t, n * hd))?;
        let bias = values(n * hd, 1.0)?;
        let (cos, sin) =
            (values(t * hd / 2, 1.0)?.reshape((t, hd / 2))?, values(t * hd / 2, 1.0)?.reshape((t, hd / 2))?);
        for b in [None, Some(&bias)] {
            let fast = split_rope(&y, b, (n, roped, hd), &cos, &sin)?;
            let slow = split_rope_reference(&y, b, (n, roped, hd), &cos, &sin)?;
            assert_eq!(fast.dims(), [n, t, hd]);
            let f32s = |x: &Tensor| -> Result<Vec<f32>> { x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>() };
            let got = f32s(&fast)?;
            assert!(
                got.iter().map(|v| v.to_bits()).eq(f32s(&slow)?.iter().map(|v| v.to_bits())),
                "{t}x{n}x{hd}, {roped} roped (bias {}) differs on {device:?} (seed {seed})",
                b.is_some()
            );
            let (yv, cv, sv) = (f32s(&y)?, f32s(&cos)?, f32s(&sin)?);
            let bv = b.map(f32s).transpose()?;
            let half = hd / 2;
            let input = |i: usize, col: usize| {
                let v = yv[i * n * hd + col] + bv.as_ref().map_or(0.0, |b| b[col]);
                half::bf16::from_f32(v).to_f32()
            };
            for (at, got) in got.iter().enumerate() {
                let (h, i, d) = (at / (t * hd), at / hd % t, at % hd);
                let p = d % half;
                let (a, bb) = (input(i, h * hd + p), input(i, h * hd + p + half));
                let want = match (h < roped, d < half) {
                    (false, true) => a,
                    (false, false) => bb,
                    (true, true) => a * cv[i * half + p] - bb * sv[i * half + p],
                    (true, false) => a * sv[i * half + p] + bb * cv[i * half + p],
                };
                // Three bf16 roundings of terms up to 4 in size.
                assert!((got - want).abs() <= 4.0 * 3.0 / 128.0, "[{h}][{i}][{d}] = {got}, not {want} (seed {seed})");
            }
        }
    }
    let (y, cos) = (Tensor::zeros((2, 32), DType::BF16, device)?, Tensor::zeros((2, 4), DType::BF16, device)?);
    let err = split_rope(&y, None, (2, 2, 16), &cos, &cos).unwrap_err().to_string();
    assert!(err.contains("2 of 2 heads of 16 over 2 rows"), "{err}");
    Ok(())
}

test_device!(split_rope_matches_reference, split_rope_cpu, split_rope_cuda);
