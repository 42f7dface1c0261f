//! The block formats' definitions, weight by weight: what the CUDA kernels (kernels/cuda/quant.cu)
//! are held to. Each block starts with its f16 scale(s); a weight is `d * q` or `d * q - m`,
//! computed in f32 with the two roundings apart (no fused multiply-add), as ggml defines them.
//! Written for clarity, not speed: the engine runs these only in tests and on the rare device
//! with no kernel.

use super::BlockFormat;

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// A K-quant's 6-bit scale and min of sub-block `j` (0..8) from their 12 packed bytes: the
/// first four sub-blocks keep theirs in the low 6 bits of bytes 0..4 and 4..8; the last four
/// take their low 4 bits from bytes 8..12 and their top 2 from the spare bits of the first eight.
fn scale_min(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    };
    (sc as f32, m as f32)
}

/// One block's weights as two parts, `w = scaled - min`: the scaled quant (`d * q`, rounded to
/// f32) and the min (Q4_K and Q5_K; 0 for the others). A product that sums each part on its own
/// (as the kernel does) is exact to within f32 rounding of `|scaled| + |min|`, not of `|w|`.
pub fn block_parts(format: BlockFormat, block: &[u8], out: &mut [f32], mins: &mut [f32]) {
    assert_eq!(block.len(), format.block_bytes());
    assert_eq!(out.len(), format.block_weights());
    assert_eq!(mins.len(), format.block_weights());
    match format {
        BlockFormat::Q8_0 => {
            let d = f16_at(block, 0);
            for (o, &q) in out.iter_mut().zip(&block[2..]) {
                *o = d * (q as i8) as f32;
            }
        }
        BlockFormat::Q4_0 => {
            // Byte l holds weight l in its low nibble and weight l + 16 in its high one.
            let d = f16_at(block, 0);
            for (l, &q) in block[2..].iter().enumerate() {
                out[l] = d * ((q & 0xF) as i32 - 8) as f32;
                out[l + 16] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        BlockFormat::Q4K | BlockFormat::Q5K => {
            // d, dmin, 12 bytes of scales, [Q5_K: 32 bytes of fifth bits,] 128 bytes of nibbles.
            // Each 64 weights j: 32 bytes whose low nibbles are sub-block 2j, high ones 2j + 1.
            let (d, dmin, scales) = (f16_at(block, 0), f16_at(block, 2), &block[4..16]);
            let (qh, qs) = match format {
                BlockFormat::Q5K => (Some(&block[16..48]), &block[48..176]),
                _ => (None, &block[16..144]),
            };
            for j in 0..4 {
                let ((sc1, m1), (sc2, m2)) = (scale_min(2 * j, scales), scale_min(2 * j + 1, scales));
                let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
                for l in 0..32 {
                    let q = qs[32 * j + l];
                    let (mut lo, mut hi) = ((q & 0xF) as u32, (q >> 4) as u32);
                    if let Some(qh) = qh {
                        lo += ((qh[l] as u32 >> (2 * j)) & 1) << 4;
                        hi += ((qh[l] as u32 >> (2 * j + 1)) & 1) << 4;
                    }
                    (out[64 * j + l], mins[64 * j + l]) = (d1 * lo as f32, m1);
                    (out[64 * j + 32 + l], mins[64 * j + 32 + l]) = (d2 * hi as f32, m2);
                }
            }
        }
        BlockFormat::Q6K => {
            // 128 bytes of low nibbles, 64 of 2-bit highs, 16 signed scales (one per 16
            // weights), d. Each half of 128 weights n: quarters 0 and 2 take the low and high
            // nibbles of ql[0..32], quarters 1 and 3 those of ql[32..64]; qh byte l holds the
            // four quarters' top bits in its 2-bit pairs.
            let d = f16_at(block, 208);
            for n in 0..2 {
                let (ql, qh) = (&block[64 * n..64 * n + 64], &block[128 + 32 * n..128 + 32 * n + 32]);
                let sc = |i: usize| (block[192 + 8 * n + i] as i8) as f32;
                for l in 0..32 {
                    let is = l / 16;
                    let high = |shift: u32| ((qh[l] >> shift) & 3) << 4;
                    let q = [
                        (ql[l] & 0xF) | high(0),
                        (ql[l + 32] & 0xF) | high(2),
                        (ql[l] >> 4) | high(4),
                        (ql[l + 32] >> 4) | high(6),
                    ];
                    for (quarter, q) in q.into_iter().enumerate() {
                        out[128 * n + 32 * quarter + l] = d * sc(is + 2 * quarter) * (q as i32 - 32) as f32;
                    }
                }
            }
        }
    }
}

/// `rows` rows of `cols` weights from their blocks, row-major.
pub fn dequantize(format: BlockFormat, bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let (scaled, mins) = dequantize_parts(format, bytes, rows, cols);
    scaled.into_iter().zip(mins).map(|(w, m)| w - m).collect()
}

/// [`dequantize`] as the two parts of [`block_parts`].
pub fn dequantize_parts(format: BlockFormat, bytes: &[u8], rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let (bw, bb) = (format.block_weights(), format.block_bytes());
    assert_eq!(bytes.len(), rows * cols / bw * bb, "{rows} x {cols} {} weights", format.name());
    let (mut scaled, mut mins) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
    for ((block, s), m) in bytes.chunks_exact(bb).zip(scaled.chunks_exact_mut(bw)).zip(mins.chunks_exact_mut(bw)) {
        block_parts(format, block, s, m);
    }
    (scaled, mins)
}

/// `x @ W^T` in f64 over the dequantized weights: `x` is `m` rows of `cols`, the result `m` rows
/// of `rows`.
pub fn matvec(format: BlockFormat, bytes: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f64> {
    let w = dequantize(format, bytes, rows, cols);
    x.chunks_exact(cols)
        .flat_map(|xr| {
            w.chunks_exact(cols).map(move |wr| wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>())
        })
        .collect()
}

/// Activations per 8-bit scale.
pub const Q8_BLOCK: usize = 32;
/// Activations per sum of quants (the K-quants' runs of 16 take their mins' share from it).
pub const Q8_SUM: usize = 16;

/// Activations quantized to 8 bits per block of [`Q8_BLOCK`], as the CUDA product reads them:
/// `d = max|x| / 127`, `q = round(x / d)` (half away from zero), all 0 when the block is 0.
/// Returns the quants and each block's `d`; `x̂ = d * q`.
pub fn quantize_q8(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    assert!(x.len().is_multiple_of(Q8_BLOCK), "{} activations are not whole blocks of {Q8_BLOCK}", x.len());
    let mut q = Vec::with_capacity(x.len());
    let mut d = Vec::with_capacity(x.len() / Q8_BLOCK);
    for block in x.chunks_exact(Q8_BLOCK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        q.extend(block.iter().map(|v| if amax == 0.0 { 0 } else { (v / scale).round() as i8 }));
        d.push(scale);
    }
    (q, d)
}

/// [`matvec`] over the activations as [`quantize_q8`] gives them: what the CUDA product computes.
pub fn matvec_q8(format: BlockFormat, bytes: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f64> {
    let (q, d) = quantize_q8(x);
    let dequantized: Vec<f32> = q.iter().enumerate().map(|(i, q)| d[i / Q8_BLOCK] * *q as f32).collect();
    matvec(format, bytes, rows, cols, &dequantized)
}
