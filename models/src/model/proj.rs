//! A projection whose weight is a plain matrix or a quantized one.
//!
//! Safetensors checkpoints and the F16/BF16 tensors of a GGUF give plain matrices in the
//! model's dtype, multiplied by candle's matmul as before. Quantized GGUF tensors (Q4_K, Q8_0,
//! …) stay in their blocks:
//!
//! * on CUDA, the formats GGUF files are made of (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) are Folio's own
//!   [`QuantMatrix`]: a decode step reads the blocks with the activations quantized to 8 bits
//!   (as llama.cpp's CUDA backend does), a prefill chunk multiplies the matrix dequantized to bf16
//!   (folio-kernels' quant module says why candle's quantized CUDA kernels are not used);
//! * on the CPU, and for the other formats on CUDA, candle's `QMatMul`, which reads f32
//!   activations (on the CPU it matches llama.cpp's arithmetic: docs/gguf.md), so such a
//!   projection converts its input to f32 and its output back.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::Linear;
use folio_kernels::quant::QuantMatrix;

use crate::error::{Error, Result};

pub enum Proj {
    Dense(Linear),
    Quant { weight: QWeight, bias: Option<Tensor> },
}

/// A quantized matrix, held where its product runs.
pub enum QWeight {
    /// Folio's kernels (CUDA).
    Blocks(QuantMatrix),
    /// candle's quantized tensor (the CPU, and formats with no Folio kernel).
    Candle(Arc<QTensor>),
}

impl QWeight {
    /// The matrix's (rows, cols), bytes and ggml type name.
    pub fn facts(&self) -> ((usize, usize), usize, &'static str) {
        match self {
            Self::Blocks(q) => (q.dims(), q.bytes(), q.format().name()),
            Self::Candle(q) => (matrix_dims(q), q.storage_size_in_bytes(), crate::gguf::dtype_name(q.dtype())),
        }
    }
}

/// A quantized tensor as a matrix: its rows (every dimension but the last) and columns.
fn matrix_dims(q: &QTensor) -> (usize, usize) {
    let cols = q.shape().dims().last().copied().unwrap_or(1);
    (q.shape().elem_count() / cols.max(1), cols)
}

impl Proj {
    /// A quantized projection on `device` from its blocks as a GGUF file stores them (`rows`
    /// rows of `cols` weights of `dtype`).
    pub fn from_blocks(
        bytes: Vec<u8>,
        dtype: GgmlDType,
        (rows, cols): (usize, usize),
        bias: Option<Tensor>,
        device: &Device,
    ) -> Result<Self> {
        if device.is_cuda() {
            if let Some(format) = crate::gguf::kernel_format(dtype) {
                let q = QuantMatrix::new(&bytes, format, (rows, cols), device)?;
                return Ok(Self::Quant { weight: QWeight::Blocks(q), bias });
            }
            // candle's kernels for the rest: its dequantize-multiply one for a decode step (its
            // q8_1 kernels, the default, gave NaN on every quantized fixture on an H200).
            #[cfg(feature = "cuda")]
            candle_core::quantized::cuda::set_force_dmmv(true);
        }
        let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), device, dtype)?;
        let q = QTensor::new(storage, (rows, cols))?;
        Ok(Self::Quant { weight: QWeight::Candle(Arc::new(q)), bias })
    }

    /// A quantized projection on `device` from candle's tensor of it (on any device).
    pub fn quantized(q: QTensor, bias: Option<Tensor>, device: &Device) -> Result<Self> {
        if device.is_cpu() && q.device().is_cpu() {
            return Ok(Self::Quant { weight: QWeight::Candle(Arc::new(q)), bias });
        }
        Self::from_blocks(q.data()?.into_owned(), q.dtype(), matrix_dims(&q), bias, device)
    }

    /// `x @ W^T` without the bias, in `x`'s dtype.
    pub fn product(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let weight = match self {
            Self::Dense(l) => return folio_kernels::gemv::product(x, l.weight()),
            Self::Quant { weight: QWeight::Blocks(q), .. } => return q.matvec(x),
            Self::Quant { weight: QWeight::Candle(q), .. } => q,
        };
        let rows = x.elem_count() / x.dim(D::Minus1)?.max(1);
        if x.device().is_cpu() || rows == 1 {
            // candle's kernels read f32 activations (on CUDA: its dequantize-multiply kernel).
            let y = QMatMul::QTensor(weight.clone()).forward(&x.to_dtype(DType::F32)?.contiguous()?)?;
            return y.to_dtype(x.dtype());
        }
        // A prefill chunk on CUDA: the matrix dequantized (to f16: every quantized value is one)
        // and multiplied by cuBLAS; candle's batched quantized kernel gave NaN here.
        x.matmul(&weight.dequantize_f16(x.device())?.to_dtype(x.dtype())?.t()?)
    }

    pub fn bias(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(l) => l.bias(),
            Self::Quant { bias, .. } => bias.as_ref(),
        }
    }

    /// `x @ W^T + b` (`x` `[rows, cols]`, as candle's `Linear` takes it).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.product(x)?;
        match self.bias() {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// The plain matrix, when this is one.
    pub fn dense(&self) -> Option<&Linear> {
        match self {
            Self::Dense(l) => Some(l),
            Self::Quant { .. } => None,
        }
    }
}

/// The q, k and v projections: one stacked matrix when all three are plain, or quantized in one
/// format with Folio's kernel (one product and one read of the input a decode step instead of
/// three), else each on its own (a quantized file may hold them in different types: Q4_K_M keeps
/// v in Q6_K).
pub enum Qkv {
    Stacked(Proj),
    Parts(Box<[Proj; 3]>),
}

impl Qkv {
    pub fn new(parts: [Proj; 3]) -> Result<Self> {
        if let Some(plain) = parts.iter().map(Proj::dense).collect::<Option<Vec<_>>>() {
            return Ok(Self::Stacked(Proj::Dense(stacked(&plain)?)));
        }
        let blocks: Option<Vec<&QuantMatrix>> = parts
            .iter()
            .map(|p| match p {
                Proj::Quant { weight: QWeight::Blocks(q), .. } => Some(q),
                _ => None,
            })
            .collect();
        // One format and width, and a bias on all three or none: else three products.
        let biases = parts.iter().map(Proj::bias).collect::<Vec<_>>();
        let biased = biases.iter().filter(|b| b.is_some()).count();
        match blocks {
            Some(b)
                if b.iter().all(|q| q.format() == b[0].format() && q.dims().1 == b[0].dims().1)
                    && (biased == 0 || biased == biases.len()) =>
            {
                let bias = stacked_bias(&biases)?;
                Ok(Self::Stacked(Proj::Quant { weight: QWeight::Blocks(QuantMatrix::stack(&b)?), bias }))
            }
            _ => Ok(Self::Parts(Box::new(parts))),
        }
    }
}

/// The biases of stacked projections, in order: all of them or none.
fn stacked_bias(biases: &[Option<&Tensor>]) -> Result<Option<Tensor>> {
    match biases.iter().copied().collect::<Option<Vec<_>>>() {
        Some(b) => Ok(Some(Tensor::cat(&b, 0)?)),
        None if biases.iter().any(Option::is_some) => {
            Err(Error::Invalid("stacked projections: some have a bias and some do not".into()))
        }
        None => Ok(None),
    }
}

/// Linear layers that read the same input, as one whose output rows are theirs in order (all
/// with a bias, or none).
fn stacked(parts: &[&Linear]) -> Result<Linear> {
    let weight = Tensor::cat(&parts.iter().map(|l| l.weight()).collect::<Vec<_>>(), 0)?;
    let bias = stacked_bias(&parts.iter().map(|l| l.bias()).collect::<Vec<_>>())?;
    Ok(Linear::new(weight, bias))
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

    use super::*;

    /// The quantized product against the plain product of the same weights dequantized, on
    /// fresh random inputs: the fast path and its reference.
    #[test]
    fn quantized_product_matches_its_dequantized_matrix() {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
            let w = Tensor::randn(0f32, 1.0, (64, 256), &dev).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let plain = q.dequantize(&dev).unwrap();
            let bias = Tensor::randn(0f32, 1.0, 64, &dev).unwrap();
            let x = Tensor::randn(0f32, 1.0, (5, 256), &dev).unwrap();
            let fast = Proj::quantized(q, Some(bias.clone()), &dev).unwrap().forward(&x).unwrap();
            let reference = Proj::Dense(Linear::new(plain, Some(bias))).forward(&x).unwrap();
            let diff = (fast - &reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let scale = reference.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            // The activations are quantized to 8 bits for the product (as ggml does): ~1% of the range.
            assert!(diff < 0.02 * scale, "{dtype:?}: {diff} of {scale}");
        }
    }
}
