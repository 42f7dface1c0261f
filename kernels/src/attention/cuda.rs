//! Launching the tensor-core prefill kernels: kernels/cuda/flash.cu (`mma.sync`, any GPU from
//! sm_80) and kernels/cuda/flash_sm90a.cu (`wgmma`, Hopper only, head dim 128). One
//! `CustomOp3` whose output buffer holds the output rows and then the LSEs, split by the caller.
//!
//! Keys and values are read in place when each head's rows are contiguous and 16-byte aligned
//! (a prefill's keys so far are a narrowed view of the layer's larger cache: the heads are
//! `capacity` rows apart, not `kv_len`); anything else is copied first.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::sys::{self, CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda::cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Device, Layout, Result, Shape, Tensor};

use crate::cuda_op::{CudaOnly, CudaOp3};

use super::{AttnOutput, FlashKernel, Mask};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
const MODULE: &str = "folio_flash";
const PTX_SM90A: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_sm90a.ptx"));
const MODULE_SM90A: &str = "folio_flash_sm90a";
/// flash.cu: query rows per block (ROWS), threads per block (32 × WARPS), keys per tile (KEYS)
/// and shared-memory row padding in bf16 (PAD): two stages of a K and a V tile.
const ROWS: usize = 128;
const THREADS: u32 = 256;
const KEYS: usize = 64;
const PAD: usize = 8;
/// flash_sm90a.cu: two consumer warpgroups of 64 query rows and one producer warpgroup,
/// 128-key tiles, STAGES stages of a K and a V tile; its dynamic shared memory is Q, the tiles
/// and one swizzle atom (1 KiB) of room to align them. Q and each tile are one TMA box of
/// WGMMA_KEYS rows (two halves of 64 columns: 128 bytes, the swizzle's span).
const WGMMA_CONSUMERS: usize = 2;
const WGMMA_ROWS: usize = 64 * WGMMA_CONSUMERS;
const WGMMA_THREADS: u32 = 128 * (WGMMA_CONSUMERS as u32 + 1);
const WGMMA_HEAD_DIM: usize = 128;
const WGMMA_KEYS: usize = 128;
const WGMMA_STAGES: usize = 3;
const SWIZZLE_ATOM: usize = 1024;
const WGMMA_SHARED: usize =
    (WGMMA_ROWS + 2 * WGMMA_STAGES * WGMMA_KEYS) * WGMMA_HEAD_DIM * std::mem::size_of::<half::bf16>() + SWIZZLE_ATOM;
/// The largest grid y CUDA launches: the query tiles of one call.
const MAX_GRID_Y: usize = 65_535;
/// Dynamic shared memory a launch gets without opting in.
const DEFAULT_SHARED: usize = 48 * 1024;
/// Head dims flash.cu is instantiated for (FLASH(D)).
const HEAD_DIMS: [usize; 3] = [32, 64, 128];
/// Elements in 16 bytes: flash.cu's `cp.async` copies and the TMA maps of flash_sm90a.cu need row
/// starts and head strides to be multiples.
const BF16_PER_COPY: usize = 8;

/// Whether a tensor-core kernel takes inputs of this dtype and head dim on `device`.
pub fn takes(device: &Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda() && dtype == DType::BF16 && HEAD_DIMS.contains(&head_dim)
}

/// The kernels that take bf16 inputs of this head dim on `device`, fastest first.
pub fn kernels(device: &Device, head_dim: usize) -> Vec<FlashKernel> {
    let Device::Cuda(dev) = device else { return Vec::new() };
    let mut found = Vec::new();
    if head_dim == WGMMA_HEAD_DIM && is_hopper(dev) {
        found.push(FlashKernel::Wgmma);
    }
    if HEAD_DIMS.contains(&head_dim) {
        found.push(FlashKernel::MmaSync);
    }
    found
}

/// Compute capability 9.0 (H100, H200): the only one `wgmma` PTX for sm_90a loads on.
fn is_hopper(dev: &CudaDevice) -> bool {
    let ctx = dev.cuda_stream().context().clone();
    let major = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    let minor = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    matches!((major, minor), (Ok(9), Ok(0)))
}

struct Flash {
    kernel: FlashKernel,
    dims: (usize, usize, usize, usize, usize), // q_heads, q_len, kv_len, groups, head_dim
    q_offset: i64,
    k_start: i64,
    window: i64,
    scale: f32,
}

/// Elements between two heads' rows of a `[heads, len, d]` layout whose rows are contiguous.
fn head_stride(l: &Layout) -> i64 {
    l.stride()[0] as i64
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
            let ints = [q_len as i32, kv_len as i32, groups as i32];
            let strides = [head_stride(kl), head_stride(vl)];
            let (func, shared, block_rows, threads, maps) = match self.kernel {
                FlashKernel::MmaSync => (
                    dev.get_or_load_custom_func(&format!("flash_prefill_{d}"), MODULE, PTX)?,
                    2 * 2 * KEYS * (d + PAD) * 2,
                    ROWS,
                    THREADS,
                    None,
                ),
                FlashKernel::Wgmma => {
                    let stream = dev.cuda_stream();
                    let kv_heads = q_heads / groups;
                    let maps = [
                        tensor_map(qs.device_ptr(&stream).0, q_len, q_heads, q_len * d)?,
                        tensor_map(ks.device_ptr(&stream).0, kv_len, kv_heads, strides[0] as usize)?,
                        tensor_map(vs.device_ptr(&stream).0, kv_len, kv_heads, strides[1] as usize)?,
                    ];
                    let func = dev.get_or_load_custom_func("flash_prefill_wgmma_128", MODULE_SM90A, PTX_SM90A)?;
                    (func, WGMMA_SHARED, WGMMA_ROWS, WGMMA_THREADS, Some(maps))
                }
            };
            if shared > DEFAULT_SHARED {
                let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                func.set_attribute(attr, shared as i32).w()?;
            }
            let mut b = func.builder();
            b.arg(&qs).arg(&ks).arg(&vs).arg(&out_o).arg(&out_l);
            for x in &ints {
                b.arg(x);
            }
            b.arg(&self.q_offset).arg(&self.k_start).arg(&self.window).arg(&self.scale);
            match &maps {
                // flash.cu reads k and v through their head strides, flash_sm90a.cu through
                // the tensor maps (which carry them).
                None => b.arg(&strides[0]).arg(&strides[1]),
                Some([tq, tk, tv]) => b.arg(tq).arg(tk).arg(tv),
            };
            let tiles = q_len.div_ceil(block_rows);
            if tiles > MAX_GRID_Y {
                candle_core::bail!(
                    "attention: {q_len} queries in one call are past the kernel's {MAX_GRID_Y} tiles of \
                     {block_rows} (the caller's chunks are smaller)"
                );
            }
            let cfg = LaunchConfig {
                // Heads in x, so that every head's heaviest tiles start first (the kernels' header).
                grid_dim: (q_heads as u32, tiles as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            // SAFETY: q is [q_heads, q_len, d] contiguous bf16; k and v are [kv_heads,
            // kv_len, d] bf16 with contiguous 16-byte-aligned rows, heads `strides` apart (the
            // caller checked shapes and layouts; the tensor maps describe the same); the
            // kernels read keys 0..kv_len only.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows * d + rows)))
    }
}

/// A TMA descriptor (flash_sm90a.cu's `TensorMap`) of a `[heads, rows, 128]` bf16 tensor (rows
/// contiguous, heads `head_stride` elements apart) at `base`, read in boxes of 128 rows x 64
/// columns with the 128-byte swizzle of the kernel's shared-memory layout; rows past `rows`
/// read as zeros, so a view of a larger cache is never read past its end.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct TensorMap(sys::CUtensorMap);
// SAFETY: a CUtensorMap is plain bytes the driver copies into the kernel's parameters.
unsafe impl DeviceRepr for TensorMap {}

fn tensor_map(base: sys::CUdeviceptr, rows: usize, heads: usize, head_stride: usize) -> Result<TensorMap> {
    const BF16: usize = std::mem::size_of::<half::bf16>();
    let dims = [WGMMA_HEAD_DIM as u64, rows as u64, heads as u64];
    let strides = [(WGMMA_HEAD_DIM * BF16) as u64, (head_stride * BF16) as u64];
    let boxes = [(WGMMA_HEAD_DIM / 2) as u32, WGMMA_KEYS as u32, 1];
    let steps = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: the arrays have the rank's lengths; base is a live device allocation covering
    // heads * head_stride elements (or the last head's rows).
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            3,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .w()?;
        Ok(TensorMap(map.assume_init()))
    }
}

/// `t` itself when its rows are contiguous and every row starts 16 bytes aligned (what the
/// kernels' copies need), else a contiguous copy.
fn rows_in_place(t: &Tensor) -> Result<Tensor> {
    let l = t.layout();
    let d = t.dim(2)?;
    let rows_contiguous = l.stride()[2] == 1 && (l.stride()[1] == d || t.dim(1)? <= 1);
    let aligned = l.start_offset().is_multiple_of(BF16_PER_COPY) && l.stride()[0].is_multiple_of(BF16_PER_COPY);
    if rows_contiguous && aligned {
        Ok(t.clone())
    } else {
        crate::layout::vector_aligned(t)
    }
}

/// Attention of `q [q_heads, q_len, d]` over `k`, `v` `[kv_heads, kv_len, d]` (bf16) at
/// key positions `k_start..`, shapes already checked, with `kernel` (one of [`kernels`]);
/// f32 output and LSE.
pub fn flash_prefill(
    kernel: FlashKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_start: usize,
    mask: Mask,
    scale: f32,
) -> Result<AttnOutput> {
    let (q_heads, q_len, d) = q.dims3()?;
    let (kv_heads, kv_len, _) = k.dims3()?;
    if q_len.max(kv_len) > i32::MAX as usize {
        candle_core::bail!("attention: {q_len} queries over {kv_len} keys is past the kernel's i32 positions");
    }
    if !kernels(q.device(), d).contains(&kernel) {
        candle_core::bail!("attention: the {kernel:?} kernel does not take head dim {d} on {:?}", q.device());
    }
    if q_heads == 0 || q_len == 0 || kv_len == 0 {
        return Ok(AttnOutput {
            out: Tensor::zeros((q_heads, q_len, d), DType::F32, q.device())?,
            lse: Tensor::full(f32::NEG_INFINITY, (q_heads, q_len), q.device())?,
        });
    }
    let op = Flash {
        kernel,
        dims: (q_heads, q_len, kv_len, q_heads / kv_heads, d),
        q_offset: mask.q_offset as i64,
        k_start: k_start as i64,
        window: mask.window.map_or(0, |w| w as i64),
        scale,
    };
    let both =
        crate::layout::vector_aligned(q)?.apply_op3_no_bwd(&rows_in_place(k)?, &rows_in_place(v)?, &CudaOnly(op))?;
    let rows = q_heads * q_len;
    Ok(AttnOutput {
        out: both.narrow(0, 0, rows * d)?.reshape((q_heads, q_len, d))?,
        lse: both.narrow(0, rows * d, rows)?.reshape((q_heads, q_len))?,
    })
}
