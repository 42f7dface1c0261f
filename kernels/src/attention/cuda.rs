//! Launching kernels/cuda/flash.cu: one `CustomOp3` whose output buffer holds the output
//! rows and then the LSEs, split by the caller.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

use crate::cuda_op::{CudaOnly, CudaOp3};

use super::{AttnOutput, Mask};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
const MODULE: &str = "folio_flash";
/// Query rows per block and threads per block (ROWS and 32 × WARPS in the kernel).
const ROWS: usize = 128;
const THREADS: u32 = 256;
/// Keys per tile (KEYS) and shared-memory row padding in bf16 (PAD): two stages of a K and
/// a V tile.
const KEYS: usize = 64;
const PAD: usize = 8;
/// Dynamic shared memory a launch gets without opting in.
const DEFAULT_SHARED: usize = 48 * 1024;
/// Head dims the kernel is instantiated for (FLASH(D)).
const HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Whether the tensor-core kernel takes inputs of this dtype and head dim on `device`.
pub fn takes(device: &candle_core::Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda() && dtype == DType::BF16 && HEAD_DIMS.contains(&head_dim)
}

struct Flash {
    dims: (usize, usize, usize, usize, usize), // q_heads, q_len, kv_len, groups, head_dim
    q_offset: i64,
    k_start: i64,
    window: i64,
    scale: f32,
}

impl CudaOp3 for Flash {
    const NAME: &'static str = "folio-flash-prefill";

    fn cuda_fwd(&self, [(q, ql), (k, kl), (v, vl)]: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)> {
        let (q_heads, q_len, kv_len, groups, d) = self.dims;
        let dev = q.device().clone();
        let qs = q.as_cuda_slice::<half::bf16>()?.slice(ql.start_offset()..);
        let ks = k.as_cuda_slice::<half::bf16>()?.slice(kl.start_offset()..);
        let vs = v.as_cuda_slice::<half::bf16>()?.slice(vl.start_offset()..);
        let rows = q_heads * q_len;
        // SAFETY: every query row's output and LSE is written by the block owning it.
        let out = unsafe { dev.alloc::<f32>(rows * d + rows)? };
        {
            let (out_o, out_l) = (out.slice(..rows * d), out.slice(rows * d..));
            let func = dev.get_or_load_custom_func(&format!("flash_prefill_{d}"), MODULE, PTX)?;
            let shared = 2 * 2 * KEYS * (d + PAD) * 2;
            if shared > DEFAULT_SHARED {
                use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
                let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                func.set_attribute(attr, shared as i32).w()?;
            }
            let mut b = func.builder();
            let ints = [q_len as i32, kv_len as i32, groups as i32];
            b.arg(&qs).arg(&ks).arg(&vs).arg(&out_o).arg(&out_l);
            for x in &ints {
                b.arg(x);
            }
            b.arg(&self.q_offset).arg(&self.k_start).arg(&self.window).arg(&self.scale);
            let cfg = LaunchConfig {
                grid_dim: (q_len.div_ceil(ROWS) as u32, q_heads as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            // SAFETY: q is [q_heads, q_len, d], k and v [kv_heads, kv_len, d] contiguous
            // bf16 (the caller checked shapes and made them so); the kernel reads keys
            // 0..kv_len only.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows * d + rows)))
    }
}

/// Attention of `q [q_heads, q_len, d]` over `k`, `v` `[kv_heads, kv_len, d]` (bf16) at
/// key positions `k_start..`, shapes already checked; f32 output and LSE.
pub fn flash_prefill(q: &Tensor, k: &Tensor, v: &Tensor, k_start: usize, mask: Mask, scale: f32) -> Result<AttnOutput> {
    let (q_heads, q_len, d) = q.dims3()?;
    let (kv_heads, kv_len, _) = k.dims3()?;
    if q_len.max(kv_len) > i32::MAX as usize {
        candle_core::bail!("attention: {q_len} queries over {kv_len} keys is past the kernel's i32 positions");
    }
    if q_heads == 0 || q_len == 0 || kv_len == 0 {
        return Ok(AttnOutput {
            out: Tensor::zeros((q_heads, q_len, d), DType::F32, q.device())?,
            lse: Tensor::full(f32::NEG_INFINITY, (q_heads, q_len), q.device())?,
        });
    }
    let op = Flash {
        dims: (q_heads, q_len, kv_len, q_heads / kv_heads, d),
        q_offset: mask.q_offset as i64,
        k_start: k_start as i64,
        window: mask.window.map_or(0, |w| w as i64),
        scale,
    };
    // A prefill's keys so far are a narrowed view of the layer's cache: copied here (the
    // chunk plan counts the copy); reading them in place with a head stride is next.
    let both = crate::vector_aligned(q)?.apply_op3_no_bwd(
        &crate::vector_aligned(k)?,
        &crate::vector_aligned(v)?,
        &CudaOnly(op),
    )?;
    let rows = q_heads * q_len;
    Ok(AttnOutput {
        out: both.narrow(0, 0, rows * d)?.reshape((q_heads, q_len, d))?,
        lse: both.narrow(0, rows * d, rows)?.reshape((q_heads, q_len))?,
    })
}
