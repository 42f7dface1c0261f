//! The kernels of kernels/cuda/select.cu, and the mapped host allocation.

use candle_core::backend::BackendStorage;
use std::sync::Arc;

use candle_core::cuda::cudarc::driver::{
    sys, CudaStream, DevicePtr, HostSlice, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use candle_core::cuda::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::Stored;
use crate::cuda_op::{CudaOnly, CudaOp1, CudaOp2};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/select.ptx"));
const MODULE: &str = "folio_select";
/// BINS and SELECT_THREADS in the kernel; RADIX levels as (shift, digit bits), top digit first.
const BINS: usize = 1 << 11;
const THREADS: u32 = 256;
const LEVELS: [(i32, i32); 3] = [(21, 11), (10, 11), (0, 10)];
/// Blocks per row of the histogram and collect passes: enough to fill a large GPU when a
/// layer has a few dozen rows, each block taking at least this many scores.
const TARGET_BLOCKS: usize = 1024;
const MIN_SCORES_PER_BLOCK: usize = 4096;

pub struct Mapped {
    pub buf: PinnedHostSlice<u8>,
    pub ptr: u64,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // Every queued read of the rows finishes before the pages are freed: a search queued
        // ahead on the side stream may still be reading them when the tier goes (the buffer's
        // own event is recorded only while cudarc tracks uses across streams, which the engine
        // turns off).
        let _ = self.buf.context().synchronize();
    }
}

impl Mapped {
    pub fn new(dev: &CudaDevice, bytes: usize) -> Result<Self> {
        let ctx = dev.cuda_stream().context().clone();
        // SAFETY: the memory is zeroed below before anything reads it.
        let mut buf = unsafe {
            ctx.alloc_pinned_with_flags::<u8>(
                bytes.max(1),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| candle_core::Error::Msg(format!("page-locking {bytes} bytes of host memory: {e}")))?;
        buf.as_mut_slice().w()?.fill(0);
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: buf is a live DEVICEMAP allocation of this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ptr, buf.as_mut_ptr().w()? as *mut _, 0) }.result().w()?;
        Ok(Self { buf, ptr })
    }

    /// The first `n` u32 words (native order) — what a kernel wrote here, once its event is
    /// waited on.
    pub fn words(&self, n: usize) -> Result<Vec<u32>> {
        let bytes = self.buf.as_slice().w()?;
        if 4 * n > bytes.len() {
            candle_core::bail!("mapped buffer: {n} words asked of {} bytes", bytes.len());
        }
        Ok(bytes[..4 * n].chunks_exact(4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// Copies `rows [heads, t, d]` (contiguous, on the device) to rows `pos..pos + t` of
    /// each head of an `[heads, n, d]` layout with `row_bytes` per row.
    pub fn write_rows(
        &mut self,
        rows: &Tensor,
        (heads, t, n, pos): (usize, usize, usize, usize),
        row_bytes: usize,
    ) -> Result<()> {
        let (storage, layout) = rows.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*storage else { candle_core::bail!("rows must be on the GPU") };
        let stream = cs.device().cuda_stream();
        let host = self.buf.as_mut_slice().w()?;
        let run = t * row_bytes;
        macro_rules! copy {
            ($t:ty) => {{
                let size = std::mem::size_of::<$t>();
                let src = cs.as_cuda_slice::<$t>()?.slice(layout.start_offset()..);
                for head in 0..heads {
                    let at = (head * n + pos) * row_bytes;
                    let dst = &mut host[at..at + run];
                    // SAFETY: the pinned buffer is page-aligned and `at` a multiple of the
                    // element size, so the bytes are a valid, aligned [$t] of run / size.
                    let dst: &mut [$t] =
                        unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut $t, run / size) };
                    stream.memcpy_dtoh(&src.slice(head * run / size..(head + 1) * run / size), dst).w()?;
                }
            }};
        }
        match rows.dtype() {
            DType::F32 => copy!(f32),
            DType::BF16 => copy!(half::bf16),
            other => candle_core::bail!("host rows hold f32 or bf16, not {other:?}"),
        }
        // Copies into page-locked memory are asynchronous: the rows are not written until
        // the stream gets there, and the CPU reads them directly (`HostRows::host`).
        stream.synchronize().w()?;
        Ok(())
    }

    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.buf.as_mut_slice().w()
    }

    pub fn as_slice(&self) -> Result<&[u8]> {
        self.buf.as_slice().w()
    }
}

fn blocks_per_row(rows: usize, n: usize) -> u32 {
    n.div_ceil(MIN_SCORES_PER_BLOCK).min(TARGET_BLOCKS.div_ceil(rows)).max(1) as u32
}

pub fn topk(scores: &Tensor, rows: usize, n: usize, k: usize) -> Result<Tensor> {
    if n <= SMALL_MAX {
        return scores.apply_op1_no_bwd(&CudaOnly(TopKSmall { rows, n, k }));
    }
    scores.apply_op1_no_bwd(&CudaOnly(TopK { rows, n, k }))
}

/// Rows this long or shorter are sorted in one block (SMALL_MAX in the kernel, topk_small).
const SMALL_MAX: usize = 2048;

struct TopKSmall {
    rows: usize,
    n: usize,
    k: usize,
}

impl CudaOp1 for TopKSmall {
    const NAME: &'static str = "folio-topk-small";

    fn cuda_fwd(&self, scores: &CudaStorage, sl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, n, k) = (self.rows, self.n, self.k);
        let dev = scores.device().clone();
        let scores_s = scores.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
        // SAFETY: the kernel writes all k positions of every row.
        let out = unsafe { dev.alloc::<u32>(rows * k)? };
        let Ok(grid) = u32::try_from(rows) else {
            candle_core::bail!("topk: {rows} rows are more than one launch holds");
        };
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let ints = [n, k, n.next_power_of_two(), k.next_power_of_two()].map(|x| x as i32);
        let f = dev.get_or_load_custom_func("topk_small", MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&scores_s).arg(&out);
        for x in &ints {
            b.arg(x);
        }
        // SAFETY: scores hold rows × n f32 with n ≤ SMALL_MAX (the shared arrays), 1 ≤ k < n.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((rows, k))))
    }
}

struct TopK {
    rows: usize,
    n: usize,
    k: usize,
}

impl CudaOp1 for TopK {
    const NAME: &'static str = "folio-topk";

    fn cuda_fwd(&self, scores: &CudaStorage, sl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, n, k) = (self.rows, self.n, self.k);
        let dev = scores.device().clone();
        let scores_s = scores.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
        // SAFETY: topk_init writes state and clears hist before any read.
        let state = unsafe { dev.alloc::<u32>(rows * 4)? };
        let hist = unsafe { dev.alloc::<u32>(rows * BINS)? };
        let counters = dev.alloc_zeros::<u32>(rows * 2)?;
        // SAFETY: the collect pass writes all k positions of every row (1 <= k < n).
        let out = unsafe { dev.alloc::<u32>(rows * k)? };
        let (n_i, k_i, rows_i) = (n as i32, k as i32, rows as i32);
        let one_per_row =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let per_row = LaunchConfig {
            grid_dim: (blocks_per_row(rows, n), rows as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = dev.get_or_load_custom_func("topk_init", MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&state).arg(&hist).arg(&rows_i).arg(&k_i);
        // SAFETY: state and hist are sized for `rows`.
        unsafe { b.launch(one_per_row) }.w()?;
        for (shift, bits) in LEVELS {
            let f = dev.get_or_load_custom_func("topk_hist", MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&scores_s).arg(&state).arg(&hist).arg(&n_i).arg(&shift).arg(&bits);
            // SAFETY: scores hold rows × n f32.
            unsafe { b.launch(per_row) }.w()?;
            let f = dev.get_or_load_custom_func("topk_pick", MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&state).arg(&hist).arg(&shift).arg(&bits);
            // SAFETY: as above.
            unsafe { b.launch(one_per_row) }.w()?;
        }
        let f = dev.get_or_load_custom_func("topk_collect", MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&scores_s).arg(&state).arg(&counters).arg(&out).arg(&n_i).arg(&k_i);
        // SAFETY: out holds rows × k; the kernel writes exactly k per row.
        unsafe { b.launch(per_row) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((rows, k))))
    }
}

/// Gathers rows from host memory mapped at device address `src`, positions past its rows
/// from the tail tensor (the op's second input, when there is one); rows stored in another
/// dtype than `dtype` (`stored`, with fp8 scales at device address `scales`) are widened.
struct Gather {
    src: u64,
    scales: u64,
    stored: Stored,
    dims: (usize, usize, usize, usize, usize, usize),
    dtype: DType,
    /// Launch here after everything queued so far on candle's stream, instead of on it.
    side: Option<Arc<CudaStream>>,
}

impl Gather {
    fn launch(&self, idx: &CudaStorage, il: &Layout, tail: u64) -> Result<(CudaStorage, Shape)> {
        let (heads, sel, group, n, tail_n, d) = self.dims;
        let dev = idx.device();
        let idx_s = idx.as_cuda_slice::<u32>()?.slice(il.start_offset()..);
        let same = super::holds(self.stored, self.dtype);
        // The copy moves 16-byte vectors of a row; the widening kernel 8 values of it.
        let (kernel, per_row) = match (self.stored, self.dtype) {
            _ if same => ("gather_rows", d * self.dtype.size_in_bytes() / 16),
            (Stored::Fp8 { .. }, DType::BF16) => ("gather_rows_fp8_bf16", d / 8),
            (Stored::Fp8 { .. }, DType::F32) => ("gather_rows_fp8_f32", d / 8),
            (Stored::Bf16, DType::F32) => ("gather_rows_bf16_f32", d / 8),
            (Stored::F32, DType::BF16) => ("gather_rows_f32_bf16", d / 8),
            (stored, dtype) => candle_core::bail!("gather: rows stored as {stored:?} cannot be read as {dtype:?}"),
        };
        let aligned = if same { (d * self.dtype.size_in_bytes()).is_multiple_of(16) } else { d % 8 == 0 };
        let src_align = if matches!(self.stored, Stored::Fp8 { .. }) { 8 } else { 16 };
        if !aligned || !self.src.is_multiple_of(src_align) || !self.scales.is_multiple_of(4) || !tail.is_multiple_of(16)
        {
            candle_core::bail!("gather: rows of {d} {:?} values cannot be read 16 bytes at a time", self.stored);
        }
        let total = heads * sel * per_row;
        macro_rules! run {
            ($t:ty) => {{
                // SAFETY: one thread per vector (or 8 values) writes every byte of the output.
                let out = unsafe { dev.alloc::<$t>(heads * sel * d)? };
                let f = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
                let mut b = match &self.side {
                    Some(side) => {
                        // After idx, the tail and `out` exist: everything candle's stream queued.
                        side.join(&dev.cuda_stream()).w()?;
                        side.launch_builder(&f)
                    }
                    None => f.builder(),
                };
                let (total_i, sel_i, group_i, n_i, tail_i) =
                    (total as i64, sel as i32, group as i32, n as i32, tail_n as i32);
                let last_i = per_row as i32;
                let d_i = d as i32;
                b.arg(&self.src);
                if !same {
                    b.arg(&self.scales);
                }
                b.arg(&tail).arg(&idx_s).arg(&out);
                b.arg(&total_i).arg(&sel_i).arg(&group_i).arg(&n_i).arg(&tail_i);
                // The copy takes vectors per row, the widening kernel values per row.
                b.arg(if same { &last_i } else { &d_i });
                let cfg = LaunchConfig {
                    grid_dim: (total.div_ceil(THREADS as usize) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: positions are < n + tail_n (checked by the caller, clamped by the
                // kernel); src holds heads/group × n rows (and their scales), tail
                // heads/group × tail_n.
                unsafe { b.launch(cfg) }.w()?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let storage = match self.dtype {
            DType::F32 => run!(f32),
            DType::BF16 => run!(half::bf16),
            other => candle_core::bail!("gather: rows must be f32 or bf16, not {other:?}"),
        };
        Ok((storage, Shape::from((heads, sel, d))))
    }
}

impl CudaOp1 for Gather {
    const NAME: &'static str = "folio-gather";

    fn cuda_fwd(&self, idx: &CudaStorage, il: &Layout) -> Result<(CudaStorage, Shape)> {
        self.launch(idx, il, 0)
    }
}

impl CudaOp2 for Gather {
    const NAME: &'static str = "folio-gather-tail";

    fn cuda_fwd(
        &self,
        idx: &CudaStorage,
        il: &Layout,
        tail: &CudaStorage,
        tl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let ptr = tail_ptr(tail, tl, &idx.device().cuda_stream(), "gather")?;
        self.launch(idx, il, ptr)
    }
}

/// Where [`gather`] and [`search`] read the stored rows.
pub enum Source<'a> {
    /// A page-locked allocation of the rows' own dtype.
    Mapped(&'a Mapped),
    /// A section from byte `at` of registered shared memory, as `stored`.
    Registered { registered: &'a Registered, at: usize, stored: Stored },
}

impl Source<'_> {
    /// The rows' device address, their fp8 scales' (0 without), and how they are stored (a
    /// mapped allocation holds the dtype it is read in).
    pub fn address(&self, dtype: DType) -> Result<(u64, u64, Stored)> {
        match self {
            Source::Mapped(m) => Ok((m.ptr, 0, super::stored_as(dtype)?)),
            Source::Registered { registered, at, stored } => {
                let src = registered.ptr + *at as u64;
                let scales = match stored {
                    Stored::Fp8 { scales } => src + *scales as u64,
                    _ => 0,
                };
                Ok((src, scales, *stored))
            }
        }
    }

    /// `launch`, a kernel reading the rows on `stream` through their device address, which
    /// cudarc does not see. For a mapped allocation, a guard makes `stream` wait for the
    /// buffer's last recorded use and records its event after the launch — where cudarc
    /// tracks uses across streams (a device made with tracking on, as the tests' are, once a
    /// second stream exists). The engine turns tracking off: then the buffer is written only
    /// while the tier is filled (each write synchronises) and freed only after the context is
    /// synchronised (`Mapped`'s drop). Registered memory is read-only and unregistered only
    /// after the context is synchronised (`Registered`'s drop).
    pub fn ordered<T>(&self, stream: &Arc<CudaStream>, launch: impl FnOnce() -> Result<T>) -> Result<T> {
        match self {
            Source::Mapped(m) => {
                // SAFETY: the host view it returns is not touched; only the ordering is used, on
                // `stream`, where `launch` goes.
                let (_, ordered) = unsafe { m.buf.stream_synced_slice(stream) };
                let out = launch();
                drop(ordered);
                out
            }
            Source::Registered { .. } => launch(),
        }
    }
}

/// A tail tensor's device address from its layout's start (f32 or bf16 rows), for `what`.
pub fn tail_ptr(tail: &CudaStorage, tl: &Layout, stream: &Arc<CudaStream>, what: &str) -> Result<u64> {
    let offset = tl.start_offset();
    Ok(match tail.dtype() {
        DType::F32 => tail.as_cuda_slice::<f32>()?.slice(offset..).device_ptr(stream).0,
        DType::BF16 => tail.as_cuda_slice::<half::bf16>()?.slice(offset..).device_ptr(stream).0,
        other => candle_core::bail!("{what}: rows must be f32 or bf16, not {other:?}"),
    })
}

/// The gather kernel over `source`'s rows (and `tail`'s past them) at `idx`: on candle's
/// stream, or with `side` on that stream once candle's has queued everything so far — the
/// caller then orders candle's stream after it before the rows are read, and keeps `idx` and
/// the tail alive until then (HiP's rows gathered beside the step, as its search is).
pub fn gather(
    source: Source<'_>,
    tail: Option<&Tensor>,
    idx: &Tensor,
    dims: (usize, usize, usize, usize, usize, usize),
    (dtype, side): (DType, Option<&Arc<CudaStream>>),
) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = idx.device() else { candle_core::bail!("gather: idx must be on the GPU") };
    let stream = side.cloned().unwrap_or_else(|| dev.cuda_stream());
    let idx = idx.contiguous()?;
    let (src, scales, stored) = source.address(dtype)?;
    let op = CudaOnly(Gather { src, scales, stored, dims, dtype, side: side.cloned() });
    let (heads, sel, d) = (dims.0, dims.1, dims.5);
    // Every picked row counted as a host row (the tail's few are on the device).
    let bytes = (heads * sel * link_row_bytes(stored, d)) as u64;
    crate::link::paced(dev, &stream, bytes, |_| {
        source.ordered(&stream, || match tail {
            Some(t) => idx.apply_op2_no_bwd(t, &op),
            None => idx.apply_op1_no_bwd(&op),
        })
    })
}

/// Bytes a row of `d` values stored so moves over the link: its values, and an fp8 row's scale.
pub fn link_row_bytes(stored: Stored, d: usize) -> usize {
    stored.row_bytes(d) + if matches!(stored, Stored::Fp8 { .. }) { 4 } else { 0 }
}

/// Host memory owned elsewhere, page-locked in place and mapped into the device's address
/// space (`cuMemHostRegister`, read-only): a context file's mapping, read by the gather
/// without a copy.
pub struct Registered {
    pub ptr: u64,
    host: usize,
    ctx: std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext>,
}

impl Registered {
    pub fn new(dev: &CudaDevice, bytes: &[u8]) -> Result<Self> {
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().w()?;
        let host = bytes.as_ptr() as *mut std::ffi::c_void;
        let flags =
            sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY;
        // SAFETY: `bytes` stays alive and unmoved while this registration exists (the owner is
        // held beside it in `SharedHost`, which drops this first).
        unsafe { sys::cuMemHostRegister_v2(host, bytes.len().max(1), flags) }.result().map_err(|e| {
            candle_core::Error::Msg(format!("page-locking {} bytes of host memory in place: {e}", bytes.len()))
        })?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was registered with DEVICEMAP above.
        if let Err(e) = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ptr, host, 0) }.result() {
            // SAFETY: registered above, nothing has read it.
            unsafe { sys::cuMemHostUnregister(host) };
            return Err(e).w();
        }
        Ok(Self { ptr, host: host as usize, ctx })
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Every queued read of the memory finishes before the pages are unlocked (and then
        // unmapped by the owner's drop).
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        // SAFETY: registered in `new`, unregistered once.
        unsafe { sys::cuMemHostUnregister(self.host as *mut std::ffi::c_void) };
    }
}
