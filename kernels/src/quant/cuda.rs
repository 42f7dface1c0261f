//! The launches of kernels/cuda/quant.cu.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::reference::{Q8_BLOCK, Q8_SUM};
use super::BlockFormat;
use crate::cuda_op::{cuda_storage, CudaOp1, CudaOp2};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/quant.ptx"));
const MODULE: &str = "folio_quant";
const WARP: usize = 32;
/// Threads per block of the product: 8 warps, 8 output rows.
const MATVEC_THREADS: usize = 256;
/// Threads per block of the dequantization: a thread per lane-unit of 32 weights.
const DEQUANT_THREADS: usize = 256;
/// Weights a warp covers per step (the kernels' STEP): 32 per lane.
const STEP: usize = 1024;
/// Threads per block of the activations' quantization: a warp per 32 values.
const QUANTIZE_THREADS: usize = 256;
/// The blocks' alignment the kernels' 16-byte loads of Q4_K and Q5_K need.
const BLOCKS_ALIGN: usize = 16;

fn i32_arg(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("quantized kernel: {what} {v} exceeds i32")))
}

/// The blocks as the kernels read them: a contiguous `rows × row_bytes` view starting on a
/// 16-byte boundary (a fresh tensor, or a stack of them, always is).
fn blocks_view<'a>(w: &'a CudaStorage, wl: &Layout) -> Result<(CudaView<'a, u8>, usize, usize)> {
    let (rows, row_bytes) = wl.shape().dims2()?;
    if !wl.is_contiguous() || !wl.start_offset().is_multiple_of(BLOCKS_ALIGN) {
        candle_core::bail!("quantized blocks must be contiguous from a {BLOCKS_ALIGN}-byte boundary");
    }
    Ok((w.as_cuda_slice::<u8>()?.slice(wl.start_offset()..), rows, row_bytes))
}

/// The activations quantized to 8 bits per [`Q8_BLOCK`] values: the quants, scales and
/// per-[`Q8_SUM`] sums in one buffer of 4-byte words (quants first, then scales, then sums):
/// one allocation a product, where a decode step makes hundreds and each costs the host more
/// than the kernel takes.
struct Quantized {
    scratch: CudaSlice<u32>,
    values: usize,
}

impl Quantized {
    fn new(dev: &CudaDevice, x: CudaView<'_, half::bf16>, values: usize) -> Result<Self> {
        let (quant_words, scales) = (values / 4, values / Q8_BLOCK);
        // SAFETY: quantize_q8_bf16 writes every quant, scale and sum (values is whole blocks).
        let scratch = unsafe { dev.alloc::<u32>(quant_words + scales + values / Q8_SUM)? };
        let q = Self { scratch, values };
        let func = dev.get_or_load_custom_func("quantize_q8_bf16", MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: ((values / Q8_BLOCK).div_ceil(QUANTIZE_THREADS / WARP) as u32, 1, 1),
            block_dim: (QUANTIZE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let count = values as i64;
        let (qx, dx, s16) = q.parts();
        let mut b = func.builder();
        b.arg(&x).arg(&qx).arg(&dx).arg(&s16).arg(&count);
        // SAFETY: x holds `values` bf16; the parts hold values, values / 32 and values / 16.
        unsafe { b.launch(cfg) }.w()?;
        Ok(q)
    }

    /// The quants (4 to a word), the scales and the sums.
    fn parts(&self) -> (CudaView<'_, u32>, CudaView<'_, u32>, CudaView<'_, u32>) {
        let (quant_words, scales) = (self.values / 4, self.values / Q8_BLOCK);
        (
            self.scratch.slice(..quant_words),
            self.scratch.slice(quant_words..quant_words + scales),
            self.scratch.slice(quant_words + scales..),
        )
    }
}

/// `x̂ @ W^T`, x̂ the activations (m × cols bf16, contiguous) quantized to 8 bits per 32.
pub struct Matvec {
    pub format: BlockFormat,
    pub rows: usize,
    pub cols: usize,
}

impl CudaOp2 for Matvec {
    const NAME: &'static str = "folio-qmatvec";

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
        let m = xl.shape().elem_count() / self.cols;
        let dev = x.device().clone();
        // SAFETY: every output value is written by the lane 0 of its row's warp.
        let out = unsafe { dev.alloc::<half::bf16>((m * self.rows).max(1))? };
        if m == 0 || self.rows == 0 {
            return Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((m, self.rows))));
        }
        let (ws, rows, row_bytes) = blocks_view(w, wl)?;
        if rows != self.rows {
            candle_core::bail!("quantized product: {rows} rows of blocks for {} outputs", self.rows);
        }
        let xs = x.as_cuda_slice::<half::bf16>()?.slice(xl.start_offset()..);
        let quantized = Quantized::new(&dev, xs, m * self.cols)?;
        let (qx, dx, s16) = quantized.parts();
        let func = dev.get_or_load_custom_func(&format!("qmatvec_{}", self.format.kernel()), MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (self.rows.div_ceil(MATVEC_THREADS / WARP) as u32, m as u32, 1),
            block_dim: (MATVEC_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, k, rb) =
            (i32_arg(self.rows, "rows")?, i32_arg(self.cols, "columns")?, i32_arg(row_bytes, "row bytes")?);
        let mut b = func.builder();
        b.arg(&ws).arg(&qx).arg(&dx).arg(&s16).arg(&out).arg(&n).arg(&k).arg(&rb);
        // SAFETY: the blocks are rows × row_bytes from a 16-byte boundary (QuantMatrix::new
        // checked the bytes, blocks_view the view), the quantized activations m rows of cols
        // (whole blocks) with their scales and sums; out holds m × rows.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((m, self.rows))))
    }
}

/// The CUDA quantization of `x`'s values (any shape, whole blocks of 32), copied back: see
/// [`super::quantize_activations`].
pub fn quantize_activations(x: &Tensor) -> Result<(Vec<i8>, Vec<f32>, Vec<i32>)> {
    let x = x.to_dtype(DType::BF16)?.flatten_all()?.contiguous()?;
    let values = x.elem_count();
    if !values.is_multiple_of(Q8_BLOCK) {
        candle_core::bail!("{values} activations are not whole blocks of {Q8_BLOCK}");
    }
    let (storage, layout) = x.storage_and_layout();
    let cuda = cuda_storage(&storage, "the activations")?;
    let dev = cuda.device().clone();
    let xs = cuda.as_cuda_slice::<half::bf16>()?.slice(layout.start_offset()..);
    let quantized = Quantized::new(&dev, xs, values)?;
    let (qx, dx, s16) = quantized.parts();
    let words = |v: CudaView<'_, u32>| -> Result<Vec<u32>> { dev.clone_dtoh(&v) };
    let quants = words(qx)?.into_iter().flat_map(u32::to_le_bytes).map(|b| b as i8).collect();
    let scales = words(dx)?.into_iter().map(f32::from_bits).collect();
    let sums = words(s16)?.into_iter().map(|w| w as i32).collect();
    Ok((quants, scales, sums))
}

/// The blocks dequantized to bf16 or f32.
pub struct Dequantize {
    pub format: BlockFormat,
    pub cols: usize,
    pub dtype: DType,
}

impl CudaOp1 for Dequantize {
    const NAME: &'static str = "folio-qdequant";

    fn cuda_fwd(&self, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = w.device().clone();
        let (ws, rows, row_bytes) = blocks_view(w, wl)?;
        let units = rows * self.cols.div_ceil(STEP) * WARP;
        let cfg = LaunchConfig {
            grid_dim: (units.div_ceil(DEQUANT_THREADS).max(1) as u32, 1, 1),
            block_dim: (DEQUANT_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, k, rb) = (i32_arg(rows, "rows")?, i32_arg(self.cols, "columns")?, i32_arg(row_bytes, "row bytes")?);
        let count = (rows * self.cols).max(1);
        let name = |ty: &str| format!("qdequant_{ty}_{}", self.format.kernel());
        // SAFETY (both launches): every weight of the rows × cols output is written by the
        // thread of its lane-unit; the blocks are rows × row_bytes from a 16-byte boundary.
        let storage = match self.dtype {
            DType::BF16 => {
                let out = unsafe { dev.alloc::<half::bf16>(count)? };
                let func = dev.get_or_load_custom_func(&name("bf16"), MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&ws).arg(&out).arg(&n).arg(&k).arg(&rb);
                unsafe { b.launch(cfg) }.w()?;
                CudaStorage::wrap_cuda_slice(out, dev)
            }
            DType::F32 => {
                let out = unsafe { dev.alloc::<f32>(count)? };
                let func = dev.get_or_load_custom_func(&name("f32"), MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&ws).arg(&out).arg(&n).arg(&k).arg(&rb);
                unsafe { b.launch(cfg) }.w()?;
                CudaStorage::wrap_cuda_slice(out, dev)
            }
            other => candle_core::bail!("quantized weights dequantize to bf16 or f32 on CUDA, not {other:?}"),
        };
        Ok((storage, Shape::from((rows, self.cols))))
    }
}
