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

use candle_core::{DType, Device, Tensor};
use folio_kernels::device::copy_to_host;
use folio_kernels::select::reference::stored_row;
use half::bf16;
use serde::{Deserialize, Serialize};

use super::format::SectionKind;
use crate::error::{Error, Result};

/// Alignment of the scale array after fp8 data, so it can be read as `f32`s in place.
const SCALE_ALIGN: u64 = 8;

/// Fewest rows an encode task takes (smaller sections are not worth a thread).
const MIN_ROWS_PER_TASK: usize = 4096;

/// A context file's K/V storage (its header's `kv_dtype`): a codec for the keys and one for the
/// values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvDtype {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "fp8")]
    Fp8,
    /// Keys in bf16, values in fp8.
    #[serde(rename = "bf16-fp8")]
    Bf16Fp8,
}

impl KvDtype {
    pub const NAMES: [&'static str; 4] = ["bf16", "bf16-fp8", "fp8", "f32"];

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "fp8" | "fp8-e4m3" => Ok(Self::Fp8),
            "bf16-fp8" => Ok(Self::Bf16Fp8),
            _ => Err(Error::Invalid(format!(
                "bad KV dtype \"{s}\": use bf16 (default), bf16-fp8 (bf16 keys, fp8 values: about 3/4 the \
                 size, nearly bf16's accuracy), fp8 (e4m3 with a scale per row: half the size) or f32"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
            Self::Bf16Fp8 => "bf16-fp8",
        }
    }

    /// The codec of a `Keys` or a `Values` section (the only kinds that hold K/V rows).
    pub fn codec(self, kind: SectionKind) -> Codec {
        debug_assert!(matches!(kind, SectionKind::Keys | SectionKind::Values), "{kind:?} holds no K/V rows");
        match (self, kind) {
            (Self::F32, _) => Codec::F32,
            (Self::Bf16, _) | (Self::Bf16Fp8, SectionKind::Keys) => Codec::Bf16,
            (Self::Fp8, _) | (Self::Bf16Fp8, _) => Codec::Fp8,
        }
    }

    /// Bytes of a `kind` section holding `rows` rows of `head_dim` values.
    pub fn section_bytes(self, kind: SectionKind, rows: usize, head_dim: usize) -> u64 {
        self.codec(kind).section_bytes(rows, head_dim)
    }

    /// Bytes of a layer's K and V sections together, `rows` rows each.
    pub fn kv_bytes(self, rows: usize, head_dim: usize) -> u64 {
        self.section_bytes(SectionKind::Keys, rows, head_dim) + self.section_bytes(SectionKind::Values, rows, head_dim)
    }

    /// The larger of a layer's K and V sections (what one section's buffer must hold).
    pub fn max_section_bytes(self, rows: usize, head_dim: usize) -> u64 {
        [SectionKind::Keys, SectionKind::Values]
            .map(|k| self.section_bytes(k, rows, head_dim))
            .into_iter()
            .max()
            .unwrap_or(0)
    }
}

/// How one K or V section's values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    F32,
    Bf16,
    Fp8,
}

impl Codec {
    fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
        }
    }

    fn elem_bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
            Self::Fp8 => 1,
        }
    }

    /// Bytes of the row data of `rows` rows (the scales, if any, follow at this offset rounded up).
    fn data_bytes(self, rows: usize, head_dim: usize) -> u64 {
        rows as u64 * head_dim as u64 * self.elem_bytes()
    }

    /// Where an fp8 section's scales start: after the row data, aligned.
    fn scales_offset(self, rows: usize, head_dim: usize) -> u64 {
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
    pub fn stored(self, rows: usize, head_dim: usize) -> folio_kernels::select::Stored {
        use folio_kernels::select::Stored;
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

    /// Encodes the rows of `x` (`[.., head_dim]`, on any device, in its row-major order) into
    /// a section's bytes, where they are: bf16 values into a bf16 section and f32 into an f32
    /// one are their own bytes, and fp8 rows on a GPU are encoded there
    /// (`folio_kernels::encode`), so a layer leaves the device at the file's size; anything
    /// else goes through [`Self::encode`]. The bytes are [`Self::encode`]'s in every case.
    pub fn encode_tensor(self, x: &Tensor, head_dim: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.start_encode(x, head_dim)?.finish_into(&mut out)?;
        Ok(out)
    }

    /// The device's half of [`Self::encode_tensor`]: fp8 rows on a GPU are encoded there
    /// and bf16 or f32 rows kept as they are, to be copied to the host by
    /// [`PendingSection::finish_into`], which may run on another thread while this one queues
    /// more work (a prefill's next layer); anything else is encoded on the host now.
    pub fn start_encode(self, x: &Tensor, head_dim: usize) -> Result<PendingSection> {
        let rows = x.elem_count() / head_dim.max(1);
        let raw = matches!((self, x.dtype()), (Self::Bf16, DType::BF16) | (Self::F32, DType::F32));
        let kernel_takes = matches!(x.dtype(), DType::BF16 | DType::F32);
        let on_device = if raw {
            Some(x.clone())
        } else if self == Self::Fp8 && x.device().is_cuda() && kernel_takes && head_dim.is_multiple_of(4) {
            Some(folio_kernels::encode::fp8_rows(&x.reshape((rows, head_dim))?)?)
        } else {
            None
        };
        let from = match on_device {
            Some(t) => Pending::Device { queued: folio_kernels::device::Queued::now(t.device())?, t },
            None => {
                let values = x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
                Pending::Host(self.encode(&values, head_dim)?)
            }
        };
        Ok(PendingSection { codec: self, rows, head_dim, from })
    }

    /// A section's bytes split into its row data and (fp8) its scales, past the padding.
    fn section_parts(self, section: &mut [u8], rows: usize, head_dim: usize) -> (&mut [u8], Option<&mut [u8]>) {
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
                    let scale = folio_kernels::encode::fp8_row(row, codes).ok_or_else(non_finite)?;
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

/// A section encoded where its rows are, not yet in host memory ([`Codec::start_encode`]).
pub struct PendingSection {
    codec: Codec,
    rows: usize,
    head_dim: usize,
    from: Pending,
}

enum Pending {
    /// The section's bytes in one tensor (fp8 rows encoded on the device: the data, then one f32
    /// scale a row), ready once the work queued before `queued` is done.
    Device { t: Tensor, queued: folio_kernels::device::Queued },
    /// Encoded already.
    Host(Vec<u8>),
}

impl PendingSection {
    /// The section's bytes into `out`, resized to it, from any thread: a copy off the device
    /// waits on this thread's stream for the work that made the rows, then runs beside what
    /// the thread that queued it does next. A prefill hands each layer the previous layer's
    /// buffers, whose pages are already mapped (a fresh buffer of tens of MB costs a page fault
    /// per 4 KiB, which took longer than the copy off the GPU).
    pub fn finish_into(self, out: &mut Vec<u8>) -> Result<()> {
        let Self { codec, rows, head_dim, from } = self;
        let (t, queued) = match from {
            Pending::Host(bytes) => {
                *out = bytes;
                return Ok(());
            }
            Pending::Device { t, queued } => (t, queued),
        };
        queued.wait_here(t.device())?;
        out.resize(codec.section_bytes(rows, head_dim) as usize, 0);
        if codec != Codec::Fp8 {
            // bf16 and f32 sections are their rows' bytes, nothing after them.
            return Ok(copy_to_host(&t, out)?);
        }
        let data_end = codec.data_bytes(rows, head_dim) as usize;
        let (data, scales) = codec.section_parts(out, rows, head_dim);
        let scales = scales.expect("fp8 sections have scales");
        copy_to_host(&t.narrow(0, 0, data_end)?, data)?;
        copy_to_host(&t.narrow(0, data_end, rows * 4)?, scales)?;
        if scales.chunks_exact(4).any(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_nan()) {
            return Err(non_finite());
        }
        // The padding between the rows and the scales: zero, whatever the buffer held.
        let scales_at = codec.scales_offset(rows, head_dim) as usize;
        out[data_end..scales_at].fill(0);
        Ok(())
    }
}

fn non_finite() -> Error {
    Error::Invalid("the model produced non-finite keys or values; they cannot be stored as fp8".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use folio_kernels::encode::FP8_E4M3_MAX;
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

    /// `encode_tensor` (its own bytes for bf16 and f32, the codec otherwise) is `encode`.
    #[test]
    fn encode_tensor_is_encode() -> Result<()> {
        let seed = rand::random();
        let (n, d) = (300, 16);
        let x = rows(seed, n, d);
        for dtype in [DType::F32, DType::BF16] {
            let t = Tensor::from_vec(x.clone(), (2, n / 2, d), &Device::Cpu)?.to_dtype(dtype)?;
            let held = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            for codec in [Codec::F32, Codec::Bf16, Codec::Fp8] {
                assert!(codec.encode_tensor(&t, d)? == codec.encode(&held, d)?, "seed {seed}: {dtype:?} {codec:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn wrong_sizes_and_names_are_errors() {
        assert!(Codec::Bf16.decode(&[0u8; 6], 2, 2).is_err());
        assert!(KvDtype::parse("int4").unwrap_err().to_string().contains("bf16-fp8"));
        // The mixed dtype: bf16 keys, fp8 values; every name parses back to itself.
        assert_eq!(KvDtype::Bf16Fp8.codec(SectionKind::Keys), Codec::Bf16);
        assert_eq!(KvDtype::Bf16Fp8.codec(SectionKind::Values), Codec::Fp8);
        assert!(KvDtype::NAMES.iter().all(|n| KvDtype::parse(n).unwrap().name() == *n));
        assert!(Codec::Fp8.encode(&[f32::NAN, 1.0], 2).is_err());
    }
}
