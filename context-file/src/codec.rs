//! Storage dtypes of the KV rows in a context file: f32 (exact, for tests), bf16 (the default:
//! what the model computes in on a GPU, so storing it loses nothing there), fp8 e4m3 with one
//! f32 scale per row (one token of one head), which halves RAM and disk again, and bf16 keys
//! with fp8 values. A [`KvDtype`] names a [`Codec`] for each half.
//!
//! Why the mixed one: fp8's error enters through the keys (they set the logits; values are
//! averaged). On the demo model, keys and values swapped between a bf16 and an fp8 file (a
//! one-off measurement, docs/context-file.md) gave 6.0% of the logit range for fp8 keys and
//! 0.83% for fp8 values; `models/tests/context.rs` (`lossy_kv_dtypes_stay_within_tolerance`)
//! holds bf16-fp8 to that. A row takes `3·d + 4` bytes against bf16's `4·d`: about 3/4.
//!
//! Why a per-row scale: K rows of different tokens differ in magnitude by orders (outlier
//! channels, attention sinks), and e4m3 has only 4 exponent bits; scaling each row so its
//! largest element maps to e4m3's largest finite value (448) keeps every row's relative error
//! at the format's 2^-4 step instead of flushing small rows to zero. A row's scale sits in a
//! separate array after the section's data, so the data stays one contiguous `[rows, head_dim]`
//! block a GPU gather can read as bytes.

use half::bf16;

use crate::error::{Error, Result};
use crate::rows::{fp8_row, stored_row, Stored};

/// Alignment of the scale array after fp8 data, so it can be read as `f32`s in place.
const SCALE_ALIGN: u64 = 8;

/// Fewest rows an encode task takes (smaller sections are not worth a thread).
pub const MIN_ROWS_PER_TASK: usize = 4096;

/// How one K or V section's values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    F32,
    Bf16,
    Fp8,
}

impl Codec {
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
        }
    }

    pub fn elem_bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
            Self::Fp8 => 1,
        }
    }

    /// Bytes of the row data of `rows` rows (the scales, if any, follow at this offset rounded up).
    pub fn data_bytes(self, rows: usize, head_dim: usize) -> u64 {
        rows as u64 * head_dim as u64 * self.elem_bytes()
    }

    /// Where an fp8 section's scales start: after the row data, aligned.
    pub fn scales_offset(self, rows: usize, head_dim: usize) -> u64 {
        self.data_bytes(rows, head_dim).next_multiple_of(SCALE_ALIGN)
    }

    /// Bytes of a section holding `rows` rows of `head_dim` values.
    pub fn section_bytes(self, rows: usize, head_dim: usize) -> u64 {
        match self {
            Self::Fp8 => self.scales_offset(rows, head_dim) + rows as u64 * 4,
            _ => self.data_bytes(rows, head_dim),
        }
    }

    /// How a section of `rows` rows lies, for the host tier to read it in place.
    pub fn stored(self, rows: usize, head_dim: usize) -> Stored {
        match self {
            Self::F32 => Stored::F32,
            Self::Bf16 => Stored::Bf16,
            Self::Fp8 => Stored::Fp8 { scales: self.scales_offset(rows, head_dim) as usize },
        }
    }

    /// Encodes row-major `values` (`rows × head_dim`) into a section's bytes. Rows are split
    /// over the machine's cores: a prefill encodes a layer's K and V (134M values for a 7B
    /// model at 1M tokens) between two layers, and one core took seconds a layer.
    pub fn encode(self, values: &[f32], head_dim: usize) -> Result<Vec<u8>> {
        let rows = values.len() / head_dim;
        let mut out = vec![0u8; self.section_bytes(rows, head_dim) as usize];
        let (data, scales) = self.section_parts(&mut out, rows, head_dim);
        // Without fp8 there are no scales: an empty slice splits into nothing per task.
        let scales = scales.unwrap_or_default();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per_task = rows.div_ceil(threads).max(MIN_ROWS_PER_TASK);
        let elem = self.elem_bytes() as usize;
        let scale_step = if self == Self::Fp8 { per_task * 4 } else { usize::MAX };
        std::thread::scope(|scope| {
            let tasks: Vec<_> = values
                .chunks(per_task * head_dim)
                .zip(data.chunks_mut(per_task * head_dim * elem))
                .zip(scales.chunks_mut(scale_step).map(Some).chain(std::iter::repeat_with(|| None)))
                .map(|((v, d), sc)| scope.spawn(move || self.encode_rows(v, head_dim, d, sc)))
                .collect();
            tasks.into_iter().try_for_each(|t| t.join().expect("an encode task panicked"))
        })?;
        Ok(out)
    }

    /// A section's bytes split into its row data and (fp8) its scales, past the padding.
    pub fn section_parts(self, section: &mut [u8], rows: usize, head_dim: usize) -> (&mut [u8], Option<&mut [u8]>) {
        let data_end = self.data_bytes(rows, head_dim) as usize;
        let (data, rest) = section.split_at_mut(data_end);
        let scales_at = self.scales_offset(rows, head_dim) as usize - data_end;
        (data, (self == Self::Fp8).then(|| &mut rest[scales_at..]))
    }

    /// [`Self::encode`] of whole rows into their data bytes and (fp8) their scales' bytes.
    fn encode_rows(self, values: &[f32], head_dim: usize, data: &mut [u8], scales: Option<&mut [u8]>) -> Result<()> {
        match self {
            Self::F32 => data.chunks_exact_mut(4).zip(values).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
            Self::Bf16 => data
                .chunks_exact_mut(2)
                .zip(values)
                .for_each(|(o, x)| o.copy_from_slice(&bf16::from_f32(*x).to_le_bytes())),
            Self::Fp8 => {
                let scales = scales.expect("fp8 rows come with their scales");
                let rows = values.chunks_exact(head_dim).zip(data.chunks_exact_mut(head_dim));
                for ((row, codes), scale_bytes) in rows.zip(scales.chunks_exact_mut(4)) {
                    let scale = fp8_row(row, codes).ok_or_else(non_finite)?;
                    scale_bytes.copy_from_slice(&scale.to_le_bytes());
                }
            }
        }
        Ok(())
    }

    /// Decodes a section of `rows × head_dim` values.
    pub fn decode(self, bytes: &[u8], rows: usize, head_dim: usize) -> Result<Vec<f32>> {
        if bytes.len() as u64 != self.section_bytes(rows, head_dim) {
            return Err(Error::Invalid(format!(
                "KV section of {} bytes, expected {} for {rows} rows of {head_dim} {} values",
                bytes.len(),
                self.section_bytes(rows, head_dim),
                self.name()
            )));
        }
        // Rows are decoded over the machine's cores (a reopen decodes every layer of the file),
        // each as the host tier reads it in place (`stored_row`: one definition of a row).
        use rayon::prelude::*;
        let mut out = vec![0f32; rows * head_dim];
        let stored = self.stored(rows, head_dim);
        out.par_chunks_mut(MIN_ROWS_PER_TASK * head_dim).enumerate().for_each(|(t, o)| {
            for (r, orow) in o.chunks_exact_mut(head_dim).enumerate() {
                stored_row(bytes, stored, t * MIN_ROWS_PER_TASK + r, head_dim, orow);
            }
        });
        Ok(out)
    }
}

/// The error of rows that fp8 cannot hold (a NaN or an infinity).
pub fn non_finite() -> Error {
    Error::Invalid("the model produced non-finite keys or values; they cannot be stored as fp8".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::FP8_E4M3_MAX;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn rows(seed: u64, n: usize, d: usize) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        // Rows of very different magnitudes, as real keys have.
        (0..n)
            .flat_map(|r| (0..d).map(move |_| r))
            .map(|r| rng.random_range(-1.0..1.0) * 10f32.powi(r as i32 % 5 - 2))
            .collect()
    }

    #[test]
    fn f32_is_exact_and_bf16_rounds() -> Result<()> {
        let seed = rand::random();
        let x = rows(seed, 37, 16);
        assert_eq!(Codec::F32.decode(&Codec::F32.encode(&x, 16)?, 37, 16)?, x);
        let y = Codec::Bf16.decode(&Codec::Bf16.encode(&x, 16)?, 37, 16)?;
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "seed {seed}: {a} -> {b}");
        }
        Ok(())
    }

    /// fp8 against the definition: each value is within half an e4m3 step (2^-4 relative, plus
    /// the subnormal floor) of the original, relative to its row's scale.
    #[test]
    fn fp8_per_row_scale_bounds_error() -> Result<()> {
        let seed = rand::random();
        let (n, d) = (41, 32);
        let x = rows(seed, n, d);
        let bytes = Codec::Fp8.encode(&x, d)?;
        assert_eq!(bytes.len() as u64, Codec::Fp8.section_bytes(n, d));
        let y = Codec::Fp8.decode(&bytes, n, d)?;
        for (xr, yr) in x.chunks(d).zip(y.chunks(d)) {
            let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
            // The row's largest value maps to 448 exactly.
            assert!(xr.iter().zip(yr).any(|(a, b)| a.abs() == amax && (a - b).abs() <= amax * 1e-6), "seed {seed}");
            for (a, b) in xr.iter().zip(yr) {
                let step = a.abs() * 2f32.powi(-4) + amax / FP8_E4M3_MAX * 2f32.powi(-9);
                assert!((a - b).abs() <= step, "seed {seed}: {a} -> {b} (row max {amax})");
            }
        }
        // Zero rows survive (scale 1, all zeros).
        let z = vec![0f32; 8];
        assert_eq!(Codec::Fp8.decode(&Codec::Fp8.encode(&z, 8)?, 1, 8)?, z);
        Ok(())
    }

    /// The encode split over threads writes the bytes one task over all rows writes (rows
    /// enough for several tasks, a ragged last one), and a non-finite value in a late task is
    /// still an error.
    #[test]
    fn split_encode_equals_one_task() -> Result<()> {
        let seed = rand::random();
        let (n, d) = (3 * MIN_ROWS_PER_TASK + 77, 8);
        let mut x = rows(seed, n, d);
        for dtype in [Codec::F32, Codec::Bf16, Codec::Fp8] {
            let mut whole = vec![0u8; dtype.section_bytes(n, d) as usize];
            let (data, scales) = dtype.section_parts(&mut whole, n, d);
            dtype.encode_rows(&x, d, data, scales)?;
            assert!(dtype.encode(&x, d)? == whole, "seed {seed}: {dtype:?}");
            // Decoded over several tasks too: each row with its own scale, every value in place.
            let back = dtype.decode(&whole, n, d)?;
            for (i, (a, b)) in x.iter().zip(&back).enumerate() {
                let amax = x[i / d * d..(i / d + 1) * d].iter().fold(0f32, |m, v| m.max(v.abs()));
                let step = a.abs() * 2f32.powi(-4) + amax / FP8_E4M3_MAX * 2f32.powi(-9) + amax * 2f32.powi(-8);
                assert!((a - b).abs() <= step, "seed {seed}: {dtype:?} value {i}: {a} decoded as {b}");
            }
        }
        x[(n - 3) * d] = f32::INFINITY;
        assert!(Codec::Fp8.encode(&x, d).is_err());
        Ok(())
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(Codec::Bf16.decode(&[0u8; 6], 2, 2).is_err());
        assert!(Codec::Fp8.encode(&[f32::NAN, 1.0], 2).is_err());
    }
}
