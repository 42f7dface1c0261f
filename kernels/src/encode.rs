//! K/V rows to fp8 e4m3 with one f32 scale per row: the context file's fp8 codec.
//!
//! Why on the device: a prefill hands each layer's K and V to the file between layers. Copying
//! them off the GPU as f32 and encoding on the CPU moved 4 bytes a value over the link and took
//! a 7B model's 128k-token prefill 31 s (docs/performance.md); encoding where they are moves
//! 1 byte a value plus a scale per row. The CPU path ([`fp8_row`]) is the reference the kernel
//! is held to, byte for byte, and what the codec runs on the CPU.

use candle_core::{Result, Tensor};

pub use folio_context_file::rows::{fp8_row, fp8_values, FP8_E4M3_MAX};

/// On CUDA: the rows of `x` (`[rows, d]`, bf16 or f32, `d` a multiple of 4) as a u8 tensor of
/// `rows * d` codes followed by `rows` f32 scales in little-endian bytes (NaN for a row with a
/// non-finite value). Elsewhere an error: the CPU encodes with [`fp8_row`] directly.
pub fn fp8_rows(x: &Tensor) -> Result<Tensor> {
    let (rows, d) = x.dims2()?;
    if d % 4 != 0 || rows > i32::MAX as usize || d > i32::MAX as usize {
        candle_core::bail!("fp8 rows: {rows} rows of {d} values (d must be a multiple of 4)");
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op1_no_bwd(&crate::cuda_op::CudaOnly(cuda::Fp8Rows { rows, d }));
    }
    candle_core::bail!("fp8 rows are encoded on CUDA only; the CPU calls encode::fp8_row")
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};

    use crate::cuda_op::CudaOp1;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/encode.ptx"));
    const MODULE: &str = "folio_encode";
    /// ROWS_PER_BLOCK in the kernel (one warp a row).
    const ROWS_PER_BLOCK: usize = 8;

    pub struct Fp8Rows {
        pub rows: usize,
        pub d: usize,
    }

    impl CudaOp1 for Fp8Rows {
        const NAME: &'static str = "folio-fp8-rows";

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (rows, d) = (self.rows, self.d);
            let dev = x.device().clone();
            let bytes = rows * d + rows * 4;
            // SAFETY: every row's codes and scale are written by its warp.
            let out = unsafe { dev.alloc::<u8>(bytes.max(1))? };
            if rows > 0 {
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
                    block_dim: (32 * ROWS_PER_BLOCK as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ints = [rows as i32, d as i32];
                macro_rules! launch {
                    ($t:ty, $name:literal) => {{
                        let func = dev.get_or_load_custom_func($name, MODULE, PTX)?;
                        let xs = x.as_cuda_slice::<$t>()?.slice(xl.start_offset()..);
                        let mut b = func.builder();
                        b.arg(&xs).arg(&out).arg(&ints[0]).arg(&ints[1]);
                        // SAFETY: x is rows × d contiguous of this dtype; out holds rows × (d + 4).
                        unsafe { b.launch(cfg) }.w()?;
                    }};
                }
                match x.dtype() {
                    DType::BF16 => launch!(half::bf16, "fp8_rows_bf16"),
                    DType::F32 => launch!(f32, "fp8_rows_f32"),
                    other => candle_core::bail!("fp8 rows from {other:?} values"),
                }
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(bytes)))
        }
    }
}
