//! A projection whose weight is a plain matrix or a quantized one.
//!
//! Safetensors checkpoints and the F16/BF16 tensors of a GGUF give plain matrices in the
//! model's dtype, multiplied by candle's matmul as before. Quantized GGUF tensors (Q4_K, Q8_0,
//! …) stay in their blocks and multiply through `QMatMul`, which reads f32 activations: a
//! quantized projection converts its input to f32 and its output back, so the rest of the
//! decoder runs in one dtype whatever the weights are.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::Linear;

use crate::error::{Error, Result};

pub enum Proj {
    Dense(Linear),
    Quant { weight: Arc<QTensor>, bias: Option<Tensor> },
}

impl Proj {
    pub fn quantized(weight: QTensor, bias: Option<Tensor>) -> Self {
        Self::Quant { weight: Arc::new(weight), bias }
    }

    /// `x @ W^T` without the bias, in `x`'s dtype.
    pub fn product(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let weight = match self {
            Self::Dense(l) => return x.matmul(&l.weight().t()?),
            Self::Quant { weight, .. } => weight,
        };
        let rows = x.elem_count() / x.dim(D::Minus1)?.max(1);
        if x.device().is_cpu() {
            // candle's CPU kernels read f32 activations.
            let y = QMatMul::QTensor(weight.clone()).forward(&x.to_dtype(DType::F32)?.contiguous()?)?;
            return y.to_dtype(x.dtype());
        }
        if rows == 1 {
            // A decode step: candle's dequantize-multiply kernel reads the blocks as stored, with
            // f32 activations. Its newer q8_1 kernels (the default) gave NaN on every quantized
            // fixture on an H200 (docs/gguf.md), so they are switched off.
            #[cfg(feature = "cuda")]
            candle_core::quantized::cuda::set_force_dmmv(true);
            let y = QMatMul::QTensor(weight.clone()).forward(&x.to_dtype(DType::F32)?.contiguous()?)?;
            return y.to_dtype(x.dtype());
        }
        // A prefill chunk: the matrix dequantized (to f16: half of f32's transient bytes, and
        // every quantized value is an f16) and multiplied by cuBLAS, as llama.cpp does for large
        // batches; candle's batched quantized kernel gave NaN here.
        x.matmul(&weight.dequantize_f16(x.device())?.to_dtype(x.dtype())?.t()?)
    }

    pub fn bias(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(l) => l.bias(),
            Self::Quant { bias, .. } => bias.as_ref(),
        }
    }

    /// `x @ W^T + b`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(l) => l.forward(x),
            Self::Quant { bias, .. } => {
                let y = self.product(x)?;
                match bias {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
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

/// The q, k and v projections: one stacked matrix when all three are plain (one product and
/// one read of the input a decode step instead of three), else each on its own (a quantized
/// file may hold them in different types: Q4_K_M keeps v in Q6_K).
pub enum Qkv {
    Stacked(Linear),
    Parts(Box<[Proj; 3]>),
}

impl Qkv {
    pub fn new(parts: [Proj; 3]) -> Result<Self> {
        match parts.iter().map(Proj::dense).collect::<Option<Vec<_>>>() {
            Some(plain) => Ok(Self::Stacked(stacked(&plain)?)),
            None => Ok(Self::Parts(Box::new(parts))),
        }
    }
}

/// Linear layers that read the same input, as one whose output rows are theirs in order (all
/// with a bias, or none).
fn stacked(parts: &[&Linear]) -> Result<Linear> {
    let weight = Tensor::cat(&parts.iter().map(|l| l.weight()).collect::<Vec<_>>(), 0)?;
    let bias = match parts.iter().map(|l| l.bias()).collect::<Option<Vec<_>>>() {
        Some(biases) => Some(Tensor::cat(&biases, 0)?),
        None if parts.iter().any(|p| p.bias().is_some()) => {
            return Err(Error::Invalid("stacked projections: some have a bias and some do not".into()))
        }
        None => None,
    };
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
            let fast = Proj::quantized(q, Some(bias.clone())).forward(&x).unwrap();
            let reference = Proj::Dense(Linear::new(plain, Some(bias))).forward(&x).unwrap();
            let diff = (fast - &reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let scale = reference.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            // The activations are quantized to 8 bits for the product (as ggml does): ~1% of the range.
            assert!(diff < 0.02 * scale, "{dtype:?}: {diff} of {scale}");
        }
    }
}
