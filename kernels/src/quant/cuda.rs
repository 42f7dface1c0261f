//! The launches of kernels/cuda/quant.cu.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

use super::BlockFormat;
use crate::cuda_op::{CudaOp1, CudaOp2};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/quant.ptx"));
const MODULE: &str = "folio_quant";
/// Threads per block of the product: 8 warps, 8 output rows.
const MATVEC_THREADS: usize = 256;
const WARP: usize = 32;
/// Weights a warp covers per step (the kernels' STEP): 32 per lane.
const STEP: usize = 1024;
const DEQUANT_THREADS: usize = 256;
/// Threads per block of the activations' quantization: a warp per 32 values.
const QUANTIZE_THREADS: usize = 256;
/// Activations per 8-bit scale, and per sum (the formats with mins take runs of 16).
const Q8_BLOCK: usize = 32;
const Q8_SUM: usize = 16;

fn i32_arg(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("quantized kernel: {what} {v} exceeds i32")))
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
        // The activations quantized to 8 bits per 32 values, then the product over them. The
        // quants, scales and sums share one buffer of 4-byte words: one allocation a product
        // (a decode step makes hundreds, and each costs the host more than the kernel takes).
        let values = m * self.cols;
        let (quant_words, scales) = (values / 4, values / Q8_BLOCK);
        // SAFETY: quantize_q8_bf16 writes every quant, scale and sum (values is whole blocks of 32).
        let scratch = unsafe { dev.alloc::<u32>(quant_words + scales + values / Q8_SUM)? };
        let qx = scratch.slice(..quant_words);
        let dx = scratch.slice(quant_words..quant_words + scales);
        let s16 = scratch.slice(quant_words + scales..);
        let xs = x.as_cuda_slice::<half::bf16>()?.slice(xl.start_offset()..);
        let func = dev.get_or_load_custom_func("quantize_q8_bf16", MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: ((values / Q8_BLOCK).div_ceil(QUANTIZE_THREADS / WARP) as u32, 1, 1),
            block_dim: (QUANTIZE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let count = values as i64;
        let mut b = func.builder();
        b.arg(&xs).arg(&qx).arg(&dx).arg(&s16).arg(&count);
        // SAFETY: x holds `values` bf16; the outputs hold values, values / 32 and values / 16.
        unsafe { b.launch(cfg) }.w()?;
        let ws = w.as_cuda_slice::<u8>()?.slice(wl.start_offset()..);
        let func = dev.get_or_load_custom_func(&format!("qmatvec_{}", self.format.kernel()), MODULE, PTX)?;
        let rows_per_block = MATVEC_THREADS / WARP;
        let cfg = LaunchConfig {
            grid_dim: (self.rows.div_ceil(rows_per_block) as u32, m as u32, 1),
            block_dim: (MATVEC_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, k) = (i32_arg(self.rows, "rows")?, i32_arg(self.cols, "columns")?);
        let row_bytes = i32_arg(wl.shape().dims()[1], "row bytes")?;
        let mut b = func.builder();
        b.arg(&ws).arg(&qx).arg(&dx).arg(&s16).arg(&out).arg(&n).arg(&k).arg(&row_bytes);
        // SAFETY: the blocks are rows × row_bytes (QuantMatrix::new checked), the quantized
        // activations m rows of cols (whole blocks) with their scales and sums; out holds m × rows.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((m, self.rows))))
    }
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
        let (rows, row_bytes) = wl.shape().dims2()?;
        let dev = w.device().clone();
        let ws = w.as_cuda_slice::<u8>()?.slice(wl.start_offset()..);
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
        // thread of its lane-unit; the blocks are rows × row_bytes.
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
