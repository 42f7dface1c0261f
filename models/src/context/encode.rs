//! A layer's K/V rows encoded into a context file's section where they are: on a GPU, bf16
//! and f32 rows are copied off as their own bytes and fp8 rows are encoded there
//! (`folio_kernels::encode`), so a layer leaves the device at the file's size; elsewhere the
//! byte codec of `folio_context_file` encodes them on the host. The bytes are the byte codec's
//! in every case (held by `encode_tensor_is_encode`).

use candle_core::{DType, Device, Tensor};
use folio_context_file::codec::{non_finite, Codec};
use folio_runtime::device::copy_to_host;

use crate::error::Result;

/// Encoding tensors with a [`Codec`] (a trait: the codec is the context-file crate's, the
/// tensors the engine's).
pub trait EncodeTensor {
    /// Encodes the rows of `x` (`[.., head_dim]`, on any device, in its row-major order) into
    /// a section's bytes, where they are (see the module docs).
    fn encode_tensor(self, x: &Tensor, head_dim: usize) -> Result<Vec<u8>>;

    /// The device's half of [`Self::encode_tensor`]: fp8 rows on a GPU are encoded there
    /// and bf16 or f32 rows kept as they are, to be copied to the host by
    /// [`PendingSection::finish_into`], which may run on another thread while this one queues
    /// more work (a prefill's next layer); anything else is encoded on the host now.
    fn start_encode(self, x: &Tensor, head_dim: usize) -> Result<PendingSection>;
}

impl EncodeTensor for Codec {
    fn encode_tensor(self, x: &Tensor, head_dim: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.start_encode(x, head_dim)?.finish_into(&mut out)?;
        Ok(out)
    }

    fn start_encode(self, x: &Tensor, head_dim: usize) -> Result<PendingSection> {
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
            Some(t) => Pending::Device { queued: folio_runtime::device::Queued::now(t.device())?, t },
            None => {
                let values = x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
                Pending::Host(self.encode(&values, head_dim)?)
            }
        };
        Ok(PendingSection { codec: self, rows, head_dim, from })
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
    Device { t: Tensor, queued: folio_runtime::device::Queued },
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
            return Err(non_finite().into());
        }
        // The padding between the rows and the scales: zero, whatever the buffer held.
        let scales_at = codec.scales_offset(rows, head_dim) as usize;
        out[data_end..scales_at].fill(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// `encode_tensor` (its own bytes for bf16 and f32, the codec otherwise) is `encode`.
    #[test]
    fn encode_tensor_is_encode() -> Result<()> {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let (n, d) = (300, 16);
        let x: Vec<f32> =
            (0..n * d).map(|i| rng.random_range(-1.0..1.0) * 10f32.powi((i / d) as i32 % 5 - 2)).collect();
        for dtype in [DType::F32, DType::BF16] {
            let t = Tensor::from_vec(x.clone(), (2, n / 2, d), &Device::Cpu)?.to_dtype(dtype)?;
            let held = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            for codec in [Codec::F32, Codec::Bf16, Codec::Fp8] {
                assert!(codec.encode_tensor(&t, d)? == codec.encode(&held, d)?, "seed {seed}: {dtype:?} {codec:?}");
            }
        }
        Ok(())
    }
}
