//! Quantized weight matrices (the GGUF block formats) multiplied on the GPU as stored.
//!
//! Why here: a decode step's projections read every weight once, so they run at the card's
//! memory rate over the weights' bytes, and a Q4_K matrix is 0.56 of a byte per weight against
//! bf16's 2. candle's quantized CUDA products returned NaN on an H200 (docs/gguf.md), or read f32
//! activations at a fifth of the memory rate. [`QuantMatrix::matvec`] quantizes the activations
//! to 8 bits per 32 values (as llama.cpp's CUDA backend does; kernels/cuda/quant.cu says why) and
//! multiplies them with the blocks as a GGUF file stores them; [`QuantMatrix::dequantize`] gives
//! the plain matrix for a prefill chunk's GEMM. Both have the formats' definitions in
//! [`reference`] beside them, and the tests hold the kernels to it on fresh random blocks.
//!
//! The blocks are a plain `u8` tensor, `rows × row_bytes`: this crate knows the formats' bytes and
//! nothing of candle's quantized types or of files (folio-models maps its tensors here).

pub mod reference;

use candle_core::{DType, Device, Result, Tensor, D};

/// The block formats with a kernel: what Q4_0, Q4_K_M, Q5_K_M, Q6_K and Q8_0 files are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    Q4_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

/// Weights in a K-quant super-block.
const SUPER_BLOCK: usize = 256;
/// Weights in a Q4_0 or Q8_0 block.
const SMALL_BLOCK: usize = 32;
/// Activation rows up to which a product reads the blocks once per row (a decode step, a few
/// speculative tokens); more rows dequantize the matrix once for a GEMM.
pub const MATVEC_MAX_ROWS: usize = 4;

impl BlockFormat {
    pub const ALL: [Self; 5] = [Self::Q4_0, Self::Q8_0, Self::Q4K, Self::Q5K, Self::Q6K];

    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }

    /// Weights per block.
    pub fn block_weights(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q8_0 => SMALL_BLOCK,
            Self::Q4K | Self::Q5K | Self::Q6K => SUPER_BLOCK,
        }
    }

    /// Bytes per block: the f16 scales and the packed quants.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 2 + SMALL_BLOCK / 2,
            Self::Q8_0 => 2 + SMALL_BLOCK,
            Self::Q4K => 4 + 12 + SUPER_BLOCK / 2,
            Self::Q5K => 4 + 12 + SUPER_BLOCK / 8 + SUPER_BLOCK / 2,
            Self::Q6K => SUPER_BLOCK / 2 + SUPER_BLOCK / 4 + SUPER_BLOCK / 16 + 2,
        }
    }

    /// The kernels' suffix (kernels/cuda/quant.cu).
    #[cfg(feature = "cuda")]
    fn kernel(self) -> &'static str {
        match self {
            Self::Q4_0 => "q4_0",
            Self::Q8_0 => "q8_0",
            Self::Q4K => "q4_k",
            Self::Q5K => "q5_k",
            Self::Q6K => "q6_k",
        }
    }
}

/// `rows` rows of `cols` weights in `format`'s blocks, on a device.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    blocks: Tensor,
    format: BlockFormat,
    rows: usize,
    cols: usize,
}

impl QuantMatrix {
    /// The matrix from its blocks as a GGUF file stores them (row after row), copied to `device`.
    pub fn new(bytes: &[u8], format: BlockFormat, (rows, cols): (usize, usize), device: &Device) -> Result<Self> {
        if cols == 0 || !cols.is_multiple_of(format.block_weights()) {
            candle_core::bail!(
                "{} rows of {cols} weights are not whole {}-weight blocks",
                format.name(),
                format.block_weights()
            );
        }
        let row_bytes = cols / format.block_weights() * format.block_bytes();
        if bytes.len() != rows * row_bytes {
            candle_core::bail!(
                "{rows} x {cols} {} weights take {} bytes, not {}",
                format.name(),
                rows * row_bytes,
                bytes.len()
            );
        }
        let blocks = Tensor::from_slice(bytes, (rows, row_bytes), device)?;
        Ok(Self { blocks, format, rows, cols })
    }

    /// Matrices of one format and width as one whose rows are theirs in order: projections that
    /// read the same input (q, k and v) become one product, one launch and one read of it.
    pub fn stack(parts: &[&Self]) -> Result<Self> {
        let Some(first) = parts.first() else { candle_core::bail!("stacking no quantized matrices") };
        if let Some(odd) = parts.iter().find(|p| p.format != first.format || p.cols != first.cols) {
            candle_core::bail!(
                "stacking {} x {} {} with {} x {} {}",
                first.rows,
                first.cols,
                first.format.name(),
                odd.rows,
                odd.cols,
                odd.format.name()
            );
        }
        let blocks = Tensor::cat(&parts.iter().map(|p| &p.blocks).collect::<Vec<_>>(), 0)?;
        Ok(Self { blocks, format: first.format, rows: parts.iter().map(|p| p.rows).sum(), cols: first.cols })
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// (rows, cols): the output and input sizes.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The blocks' bytes: what a product reads.
    pub fn bytes(&self) -> usize {
        self.blocks.elem_count()
    }

    /// `x @ W^T` for `x` of `[.., cols]`, in `x`'s dtype. On CUDA, up to [`MATVEC_MAX_ROWS`]
    /// rows read the blocks directly with `x` quantized to 8 bits ([`reference::matvec_q8`]
    /// defines the result) and write bf16: f32 and f16 activations are rounded to bf16 on the
    /// way in (finer than the 8-bit quantization after it) and their outputs come back as bf16
    /// values. More rows, and the CPU, multiply the dequantized matrix.
    pub fn matvec(&self, x: &Tensor) -> Result<Tensor> {
        if x.dim(D::Minus1)? != self.cols {
            candle_core::bail!("quantized product: input of {:?} for {} columns", x.dims(), self.cols);
        }
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && x.elem_count() / self.cols <= MATVEC_MAX_ROWS {
            let m = x.elem_count() / self.cols;
            let mut out_dims = x.dims().to_vec();
            *out_dims.last_mut().expect("x has a last dimension") = self.rows;
            let flat = x.to_dtype(DType::BF16)?.contiguous()?.reshape((m, self.cols))?;
            let op = crate::cuda_op::CudaOnly(cuda::Matvec { format: self.format, rows: self.rows, cols: self.cols });
            return flat.apply_op2_no_bwd(&self.blocks, &op)?.reshape(out_dims)?.to_dtype(x.dtype());
        }
        let w = self.dequantize(if x.dtype() == DType::BF16 { DType::BF16 } else { DType::F32 })?;
        x.broadcast_matmul(&w.to_dtype(x.dtype())?.t()?)
    }

    /// The plain `rows × cols` matrix in `dtype` (each weight computed in f32, then rounded).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.blocks.device().is_cuda() && matches!(dtype, DType::BF16 | DType::F32) {
            let op = crate::cuda_op::CudaOnly(cuda::Dequantize { format: self.format, cols: self.cols, dtype });
            return self.blocks.apply_op1_no_bwd(&op);
        }
        let bytes = self.blocks.flatten_all()?.to_vec1::<u8>()?;
        let w = reference::dequantize(self.format, &bytes, self.rows, self.cols);
        Tensor::from_vec(w, (self.rows, self.cols), self.blocks.device())?.to_dtype(dtype)
    }
}

/// The activations as the CUDA product quantizes them: each 32 values' quants and scale, and
/// each 16 values' sum of quants — what [`reference::quantize_q8`] defines, for the tests that
/// hold the kernel to it (on the CPU, the reference itself). `x` is whole blocks of 32.
pub fn quantize_activations(x: &Tensor) -> Result<(Vec<i8>, Vec<f32>, Vec<i32>)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda::quantize_activations(x);
    }
    // Rounded to bf16 first, as the CUDA kernel reads them.
    let values = x.flatten_all()?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if !values.len().is_multiple_of(reference::Q8_BLOCK) {
        candle_core::bail!("{} activations are not whole blocks of {}", values.len(), reference::Q8_BLOCK);
    }
    let (q, d) = reference::quantize_q8(&values);
    let sums = q.chunks(reference::Q8_SUM).map(|c| c.iter().map(|&v| v as i32).sum()).collect();
    Ok((q, d, sums))
}

#[cfg(feature = "cuda")]
mod cuda;
