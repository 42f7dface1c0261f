//! Quantized weights: the formats' reference (kernels/src/quant/reference.rs) against candle's own
//! dequantization of the same random blocks, then the fast paths against the reference on every
//! device — the dequantized matrix bit for bit (bf16 and f32); the activations' 8-bit
//! quantization bit for bit, ties and zero blocks included; the product within f32 summation order
//! and the output's bf16 rounding of the reference over the quantized activations (the CUDA
//! kernel), or over the weights rounded to bf16 (where a GEMM runs it) — over steps whole and
//! partial, one to several rows of bf16 and f32 activations, and stacked matrices against their
//! parts.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Result, Tensor};
use folio_kernels::quant::{reference, BlockFormat, QuantMatrix, MATVEC_MAX_ROWS};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

/// Where each format keeps its f16 scales, so random blocks get finite ones.
fn f16_fields(format: BlockFormat) -> &'static [usize] {
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q8_0 => &[0],
        BlockFormat::Q4K | BlockFormat::Q5K => &[0, 2],
        BlockFormat::Q6K => &[208],
    }
}

fn ggml(format: BlockFormat) -> GgmlDType {
    match format {
        BlockFormat::Q4_0 => GgmlDType::Q4_0,
        BlockFormat::Q8_0 => GgmlDType::Q8_0,
        BlockFormat::Q4K => GgmlDType::Q4K,
        BlockFormat::Q5K => GgmlDType::Q5K,
        BlockFormat::Q6K => GgmlDType::Q6K,
    }
}

/// Random blocks for `rows × cols` weights: random quants and scale bytes, finite f16 scales.
fn random_blocks(rng: &mut StdRng, format: BlockFormat, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / format.block_weights();
    let mut bytes: Vec<u8> = (0..blocks * format.block_bytes()).map(|_| rng.random()).collect();
    for block in bytes.chunks_exact_mut(format.block_bytes()) {
        for &at in f16_fields(format) {
            let v = rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-4..0));
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}

/// Shapes: (rows, cols); 3584 columns end in a partial step of the kernels (1024 columns), and
/// the small formats also get rows that end in a partial step of 32 blocks.
fn shapes(format: BlockFormat) -> Vec<(usize, usize)> {
    let mut s = vec![(1, 256), (5, 512), (13, 3584), (3, 2048)];
    if format.block_weights() == 32 {
        s.extend([(7, 224), (2, 96), (9, 32)]);
    }
    s
}

#[test]
fn reference_matches_candles_dequantization() -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for format in BlockFormat::ALL {
        for (rows, cols) in shapes(format) {
            let bytes = random_blocks(&mut rng, format, rows, cols);
            let ours = reference::dequantize(format, &bytes, rows, cols);
            let storage = QStorage::from_data(Cow::Borrowed(&bytes), &Device::Cpu, ggml(format))?;
            let theirs =
                QTensor::new(storage, (rows, cols))?.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
            let differ = ours.iter().zip(&theirs).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(
                differ,
                0,
                "{}: {differ} of {} weights differ from candle's ({rows}x{cols}; seed {seed})",
                format.name(),
                rows * cols
            );
        }
    }
    Ok(())
}

fn fast_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for format in BlockFormat::ALL {
        for (rows, cols) in shapes(format) {
            let bytes = random_blocks(&mut rng, format, rows, cols);
            let q = QuantMatrix::new(&bytes, format, (rows, cols), device)?;
            let want = reference::dequantize(format, &bytes, rows, cols);
            for dtype in [DType::BF16, DType::F32] {
                let got = q.dequantize(dtype)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let rounded = Tensor::new(want.as_slice(), &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?;
                let differ = got.iter().zip(&rounded).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(
                    differ,
                    0,
                    "{} dequantized to {dtype:?} on {device:?}: {differ} differ ({rows}x{cols}; seed {seed})",
                    format.name()
                );
            }
            for m in [1, 3, MATVEC_MAX_ROWS + 2] {
                // Activations from offset 1 of their buffer (a view, copied before the kernel
                // reads it), in bf16 and in f32 (rounded to bf16 on the way in).
                let all = common::random(&mut rng, m * cols + 1, 2.0);
                let x = Tensor::from_vec(all, m * cols + 1, device)?
                    .to_dtype(DType::BF16)?
                    .narrow(0, 1, m * cols)?
                    .reshape((m, cols))?;
                let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                check_product(&q, &x, &xs, &bytes, seed)?;
                check_product(&q, &x.to_dtype(DType::F32)?, &xs, &bytes, seed)?;
            }
        }
        check_stack(&mut rng, format, device, seed)?;
    }
    Ok(())
}

/// Two matrices of one format stacked give their products' rows in order: bit for bit where the
/// kernel runs (each row's arithmetic is its own), within the bf16 rounding elsewhere.
fn check_stack(rng: &mut StdRng, format: BlockFormat, device: &Device, seed: u64) -> Result<()> {
    let cols = 2 * format.block_weights().max(512);
    let (a, b) = (random_blocks(rng, format, 3, cols), random_blocks(rng, format, 5, cols));
    let (qa, qb) = (QuantMatrix::new(&a, format, (3, cols), device)?, QuantMatrix::new(&b, format, (5, cols), device)?);
    let stacked = QuantMatrix::stack(&[&qa, &qb])?;
    assert_eq!(stacked.dims(), (8, cols));
    let x = Tensor::new(common::random(rng, cols, 2.0), device)?.to_dtype(DType::BF16)?.reshape((1, cols))?;
    let f32s = |t: Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let whole = f32s(stacked.matvec(&x)?)?;
    let parts = f32s(Tensor::cat(&[qa.matvec(&x)?, qb.matvec(&x)?], 1)?)?;
    for (i, (w, p)) in whole.iter().zip(&parts).enumerate() {
        let ok = if device.is_cuda() { w.to_bits() == p.to_bits() } else { (w - p).abs() <= p.abs() / 128.0 + 1e-6 };
        assert!(ok, "{} stacked row {i} on {device:?}: {w} vs {p} (seed {seed})", format.name());
    }
    Ok(())
}

/// The activations' 8-bit quantization on `device` against the reference, bit for bit: random
/// blocks, a zero block, and a block of exact halves (127 makes the scale 1: 2.5 is 3, not 2).
fn activations_quantize_as_the_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let block = reference::Q8_BLOCK;
    let mut x = common::random(&mut rng, 6 * block, 3.0);
    x[block..2 * block].fill(0.0);
    let ties = [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5];
    x[2 * block..2 * block + ties.len()].copy_from_slice(&ties);
    let x = Tensor::new(x, device)?.to_dtype(DType::BF16)?;
    let values = x.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let (q, d, sums) = folio_kernels::quant::quantize_activations(&x)?;
    let (want_q, want_d) = reference::quantize_q8(&values);
    assert_eq!(q, want_q, "quants on {device:?} (seed {seed})");
    assert_eq!(
        d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want_d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let want_sums: Vec<i32> = want_q.chunks(reference::Q8_SUM).map(|c| c.iter().map(|&v| v as i32).sum()).collect();
    assert_eq!(sums, want_sums, "sums on {device:?} (seed {seed})");
    assert_eq!(&q[2 * block..2 * block + 4], &[127, 3, -3, 1], "halves round away from zero");
    Ok(())
}

test_device!(
    activations_quantize_as_the_reference,
    activations_quantize_as_the_reference_cpu,
    activations_quantize_as_the_reference_cuda
);

test_device!(fast_matches_reference, fast_matches_reference_cpu, fast_matches_reference_cuda);

/// The product of `q` (whose blocks are `bytes`) and `x` (`xs` its values) against the reference.
/// The CUDA kernel (up to MATVEC_MAX_ROWS rows) multiplies the activations quantized to 8 bits,
/// exactly as `reference::matvec_q8` defines them, and sums the scaled quants and the mins each on
/// its own: within f32 rounding of their magnitudes, then rounded to bf16 (2^-8 of the value).
/// More rows (and the CPU) multiply the matrix rounded to bf16, each weight within 2^-8 of its
/// value.
fn check_product(q: &QuantMatrix, x: &Tensor, xs: &[f32], bytes: &[u8], seed: u64) -> Result<()> {
    let (format, (rows, cols), device) = (q.format(), q.dims(), x.device());
    let m = xs.len() / cols;
    let kernel = device.is_cuda() && m <= MATVEC_MAX_ROWS;
    let (want, per_magnitude, xs) = if kernel {
        let (qx, d) = reference::quantize_q8(xs);
        let xhat: Vec<f32> = qx.iter().enumerate().map(|(i, q)| d[i / reference::Q8_BLOCK] * *q as f32).collect();
        (reference::matvec_q8(format, bytes, rows, cols, xs), 1e-5, xhat)
    } else {
        (reference::matvec(format, bytes, rows, cols, xs), 1.0 / 128.0, xs.to_vec())
    };
    let (scaled, mins) = reference::dequantize_parts(format, bytes, rows, cols);
    let w: Vec<f32> = scaled.iter().zip(&mins).map(|(s, m)| s.abs() + m.abs()).collect();
    {
        let got = q.matvec(x)?;
        assert_eq!(got.dims(), [m, rows]);
        let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for (i, (g, r)) in got.iter().zip(&want).enumerate() {
            let (xr, wr) = (&xs[i / rows * cols..][..cols], &w[i % rows * cols..][..cols]);
            let magnitude: f64 = xr.iter().zip(wr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            let tol = magnitude * per_magnitude + r.abs() / 256.0 + 1e-30;
            assert!(
                (*g as f64 - r).abs() <= tol,
                "{} product on {device:?} ({:?}): output {i} is {g}, not {r} (tolerance {tol:e}; {m} x {rows}x{cols}; \
                 seed {seed})",
                format.name(),
                x.dtype()
            );
        }
    }
    Ok(())
}

/// The activations' 8-bit quantization as the reference defines it: each block's largest value
/// is ±127, every value within half a step of its original, a zero block all zeros.
#[test]
fn activations_quantize_to_8_bits_per_block() {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut x = common::random(&mut rng, 4 * reference::Q8_BLOCK, 3.0);
    x[reference::Q8_BLOCK..2 * reference::Q8_BLOCK].fill(0.0);
    let (q, d) = reference::quantize_q8(&x);
    for (b, block) in x.chunks_exact(reference::Q8_BLOCK).enumerate() {
        let qs = &q[b * reference::Q8_BLOCK..][..reference::Q8_BLOCK];
        if b == 1 {
            assert!(qs.iter().all(|q| *q == 0) && d[b] == 0.0);
            continue;
        }
        assert_eq!(qs.iter().map(|q| q.unsigned_abs()).max(), Some(127), "seed {seed}");
        for (v, q) in block.iter().zip(qs) {
            assert!((v - d[b] * *q as f32).abs() <= d[b] * 0.5 + 1e-6, "{v} as {q} x {} (seed {seed})", d[b]);
        }
    }
}

#[test]
fn bad_shapes_are_refused() {
    let dev = Device::Cpu;
    let e = QuantMatrix::new(&[0; 144], BlockFormat::Q4K, (1, 128), &dev).unwrap_err().to_string();
    assert!(e.contains("not whole 256-weight blocks"), "{e}");
    let e = QuantMatrix::new(&[0; 100], BlockFormat::Q4K, (1, 256), &dev).unwrap_err().to_string();
    assert!(e.contains("take 144 bytes, not 100"), "{e}");
    let q = QuantMatrix::new(&[0; 34], BlockFormat::Q8_0, (1, 32), &dev).unwrap();
    let e = q.matvec(&Tensor::zeros((1, 64), DType::F32, &dev).unwrap()).unwrap_err().to_string();
    assert!(e.contains("for 32 columns"), "{e}");
    let wide = QuantMatrix::new(&[0; 68], BlockFormat::Q8_0, (1, 64), &dev).unwrap();
    let e = QuantMatrix::stack(&[&q, &wide]).unwrap_err().to_string();
    assert!(e.contains("stacking 1 x 32 Q8_0 with 1 x 64 Q8_0"), "{e}");
}
