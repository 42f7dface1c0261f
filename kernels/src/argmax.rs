//! The first index of a row's largest value: a greedy decode step's next token from its logits.
//!
//! Why a kernel: candle's argmax gives a row one block of 1024 threads, 131 µs for a 7B
//! model's 152,064 logits on an H200 — 2% of the decode step it ends. Here a grid reads them
//! (kernels/cuda/argmax.cu): each block reduces a share to one key and the blocks meet in one
//! atomic maximum. Ties go to the first index and a NaN counts as the largest value, as in
//! torch's argmax (candle's block keeps whichever thread's share holds a tie).

use candle_core::{Result, Tensor};

/// The first index of the largest of `x`'s values (every dimension but one of size 1), a NaN
/// counting as the largest.
pub fn argmax(x: &Tensor) -> Result<u32> {
    let n = x.elem_count();
    if n == 0 || x.dims().iter().filter(|&&d| d > 1).count() > 1 {
        candle_core::bail!("argmax of {:?}: one row of values expected", x.dims());
    }
    if n > u32::MAX as usize {
        candle_core::bail!("argmax of {n} values: past a u32 index");
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && n <= i32::MAX as usize {
        return cuda::argmax(&x.flatten_all()?.to_dtype(candle_core::DType::F32)?.contiguous()?);
    }
    Ok(reference(&x.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?))
}

/// The definition: the first NaN's index if there is one, else the first index of the maximum.
pub fn reference(x: &[f32]) -> u32 {
    if let Some(nan) = x.iter().position(|v| v.is_nan()) {
        return nan as u32;
    }
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{Result, Storage, Tensor};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/argmax.ptx"));
    const MODULE: &str = "folio_argmax";
    /// ARGMAX_THREADS in the kernel.
    const THREADS: usize = 256;
    /// Blocks at most: a few a multiprocessor, each thread reading a strided share.
    const MAX_BLOCKS: usize = 512;

    /// `x`: contiguous f32 on a CUDA device.
    pub fn argmax(x: &Tensor) -> Result<u32> {
        let n = x.elem_count();
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cuda(s) = &*storage else { candle_core::bail!("argmax: the values are not on the CUDA device") };
        let dev = s.device().clone();
        let values = s.as_cuda_slice::<f32>()?.slice(layout.start_offset()..);
        let best = dev.alloc_zeros::<u64>(1)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(THREADS).min(MAX_BLOCKS) as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let count = n as i32;
        let func = dev.get_or_load_custom_func("argmax_f32", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&values).arg(&best).arg(&count);
        // SAFETY: `values` holds n contiguous f32 (the caller's contiguous tensor), `best` one
        // zeroed u64.
        unsafe { b.launch(cfg) }.w()?;
        let key = dev.clone_dtoh(&best)?;
        Ok(!(key[0] as u32))
    }
}
