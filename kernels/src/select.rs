//! Picking rows: top-k of score rows, and the host tier of K/V rows with the gather that copies
//! the selected ones to the device.
//!
//! Why a gather kernel over mapped host memory rather than a CPU gather into a staging buffer
//! and a copy: at a million tokens the selected rows are scattered 256-byte pieces of tens of
//! GB. A CPU gather would read each one on one core and write it again before the DMA engine
//! reads it a third time; the GPU reading the rows itself over the host link (the host tier is
//! page-locked and mapped into the device's address space) moves each byte once, with
//! thousands of requests in flight, and needs no CPU thread. On the CPU device the same API
//! runs the reference over a plain buffer, so one test body covers both.
//!
//! Costs, for the benchmarks' ratio to the limit:
//! * top-k over `rows × n` f32 scores: 4 reads of the scores (three radix levels and the
//!   collect), ≈ 16·rows·n bytes, no FLOPs to speak of — bandwidth-bound;
//! * gather: `rows·sel·row_bytes` read over the host link (or device memory) and written to
//!   device memory — bound by the host link's bandwidth when the source is host memory.
//! * host attention ([`host_attention`]): the CPU's side of MagicPIG, attending a sample straight
//!   from host memory so that the sample never crosses the link: 4·h·s·d FLOPs and
//!   h·s·2·d·b bytes of host memory per call — bound by the host's memory bandwidth.

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

use crate::Positions;

/// Picked rows per task of [`host_attention`]: a head's pick is split so that every core has
/// work when there are fewer heads than cores (the parts merge by LSE).
const HOST_ROWS_PER_TASK: usize = 2048;

/// The plain-slice definitions the fast paths are held to.
pub mod reference {
    /// Positions of the `min(k, n)` largest scores of each row of `scores [rows, n]`, ascending
    /// by position; among equal scores the lower position wins.
    pub fn topk(scores: &[f32], n: usize, k: usize) -> Vec<u32> {
        let k = k.min(n);
        let mut out = Vec::with_capacity(scores.len().checked_div(n).unwrap_or(0) * k);
        for row in scores.chunks(n.max(1)).filter(|_| n > 0) {
            let mut order: Vec<u32> = (0..n as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            let mut picked = order[..k].to_vec();
            picked.sort_unstable();
            out.extend(picked);
        }
        out
    }

    /// `out[h, j] = src[h / group][idx[h, j]]`, rows of `row_bytes` bytes, `src` holding `n`
    /// rows per source head, positions from `n` on reading `tail` (`tail_n` rows per head);
    /// `idx [heads, sel]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        src: &[u8],
        n: usize,
        tail: &[u8],
        tail_n: usize,
        idx: &[u32],
        sel: usize,
        group: usize,
        row_bytes: usize,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(idx.len() * row_bytes);
        for (i, &p) in idx.iter().enumerate() {
            let (g, p) = (i / sel / group, p as usize);
            let (from, at) = if p < n { (src, g * n + p) } else { (tail, g * tail_n + p - n) };
            out.extend_from_slice(&from[at * row_bytes..(at + 1) * row_bytes]);
        }
        out
    }
}

/// Positions `[rows, min(k, n)]` u32 of the `k` largest scores of each row of `scores [rows, n]`
/// (f32). On the CPU they come sorted by position (the reference); on CUDA in no set order,
/// with ties at the k-th score broken arbitrarily.
pub fn topk(scores: &Tensor, k: usize) -> Result<Tensor> {
    let (rows, n) = scores.dims2()?;
    let k = k.min(n);
    let device = scores.device();
    if k == n {
        return Tensor::arange(0u32, n as u32, device)?.unsqueeze(0)?.repeat((rows, 1));
    }
    if k == 0 || rows == 0 {
        return Tensor::zeros((rows, k), DType::U32, device);
    }
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::topk(&scores.to_dtype(DType::F32)?.contiguous()?, rows, n, k),
        _ => {
            let v: Vec<f32> = scores.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            Tensor::from_vec(reference::topk(&v, n, k), (rows, k), device)
        }
    }
}

/// One layer's K (or V) rows of every KV head, `[heads, n, d]`, in host memory: page-locked and
/// mapped into the device's address space when the device is a GPU, a plain buffer otherwise.
/// Rows are written as they are produced and read by [`HostRows::gather`].
pub struct HostRows {
    heads: usize,
    n: usize,
    d: usize,
    dtype: DType,
    device: Device,
    mem: HostMem,
}

enum HostMem {
    Plain(Vec<u8>),
    #[cfg(feature = "cuda")]
    Mapped(cuda::Mapped),
}

impl HostRows {
    /// Room for `n` rows of `d` elements of `dtype` per head, for `device` to gather from.
    pub fn new(device: &Device, dtype: DType, heads: usize, n: usize, d: usize) -> Result<Self> {
        let bytes = heads * n * d * dtype.size_in_bytes();
        let mem = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => HostMem::Mapped(cuda::Mapped::new(dev, bytes)?),
            _ => HostMem::Plain(vec![0; bytes]),
        };
        Ok(Self { heads, n, d, dtype, device: device.clone(), mem })
    }

    /// Bytes of host memory held.
    pub fn bytes(&self) -> usize {
        self.heads * self.n * self.row_bytes()
    }

    fn row_bytes(&self) -> usize {
        self.d * self.dtype.size_in_bytes()
    }

    fn host_mut(&mut self) -> Result<&mut [u8]> {
        match &mut self.mem {
            HostMem::Plain(v) => Ok(v),
            #[cfg(feature = "cuda")]
            HostMem::Mapped(m) => m.as_mut_slice(),
        }
    }

    /// Writes `rows [heads, t, d]` (this store's dtype, any device) at positions `pos..pos + t`.
    pub fn write(&mut self, pos: usize, rows: &Tensor) -> Result<()> {
        let (h, t, d) = rows.dims3()?;
        if h != self.heads || d != self.d || rows.dtype() != self.dtype || pos + t > self.n {
            candle_core::bail!(
                "host rows: writing {:?} {:?} at {pos} into [{}, {}, {}] {:?}",
                rows.dims(),
                rows.dtype(),
                self.heads,
                self.n,
                self.d,
                self.dtype
            );
        }
        if t == 0 {
            return Ok(());
        }
        let (n, rb) = (self.n, self.row_bytes());
        #[cfg(feature = "cuda")]
        if let (HostMem::Mapped(m), Device::Cuda(_)) = (&mut self.mem, rows.device()) {
            // Straight from device memory into the page-locked rows, one copy per head.
            return m.write_rows(&rows.contiguous()?, (h, t, n, pos), rb);
        }
        let bytes = tensor_bytes(&rows.to_device(&Device::Cpu)?.contiguous()?)?;
        let host = self.host_mut()?;
        for (head, src) in bytes.chunks(t * rb).enumerate() {
            let at = (head * n + pos) * rb;
            host[at..at + src.len()].copy_from_slice(src);
        }
        Ok(())
    }

    /// `out [heads', sel, d]` on this store's device: `out[h, j] = rows[h / group][idx[h, j]]`,
    /// for `idx [heads', sel]` u32 positions (`heads' = heads · group`). Positions from the
    /// stored `n` on continue in `tail [heads, tail_n, d]` (same dtype, this device): the rows
    /// written after the host tier was filled. A position past both is refused when `positions`
    /// asks for the check (always on the CPU), clamped by the kernel otherwise.
    pub fn gather(&self, idx: &Tensor, group: usize, tail: Option<&Tensor>, positions: Positions) -> Result<Tensor> {
        let (ih, sel) = idx.dims2()?;
        if group == 0 || ih != self.heads * group {
            candle_core::bail!("host rows: gathering {:?} with group {group} from {} heads", idx.dims(), self.heads);
        }
        let tail_n = match tail {
            Some(t) => {
                let (th, tn, td) = t.dims3()?;
                if th != self.heads || td != self.d || t.dtype() != self.dtype || !t.device().same_device(&self.device)
                {
                    candle_core::bail!(
                        "host rows: tail {:?} {:?} does not continue [{}, n, {}] {:?}",
                        t.dims(),
                        t.dtype(),
                        self.heads,
                        self.d,
                        self.dtype
                    );
                }
                tn
            }
            None => 0,
        };
        if sel == 0 {
            return empty_rows(ih, self.d, self.dtype, &self.device);
        }
        let end = self.n + tail_n;
        if end == 0 {
            candle_core::bail!("host rows: gathering {sel} rows from none");
        }
        let check = positions == Positions::Check || self.device.is_cpu();
        if check && idx.max_all()?.to_scalar::<u32>()? as usize >= end {
            candle_core::bail!("host rows: a position is past the {end} stored rows");
        }
        match &self.mem {
            HostMem::Plain(v) => {
                let idx_v: Vec<u32> = idx.flatten_all()?.to_vec1()?;
                let tail_v = tail.map(|t| tensor_bytes(&t.contiguous()?)).transpose()?.unwrap_or_default();
                let out = reference::gather_rows(v, self.n, &tail_v, tail_n, &idx_v, sel, group, self.row_bytes());
                from_bytes(&out, self.dtype, (ih, sel, self.d), &self.device)
            }
            #[cfg(feature = "cuda")]
            HostMem::Mapped(m) => {
                let tail = tail.map(|t| t.contiguous()).transpose()?;
                cuda::gather(m, tail.as_ref(), idx, (ih, sel, group, self.n, tail_n, self.d), self.dtype)
            }
        }
    }
}

impl HostRows {
    /// The rows as the CPU reads them, from host memory (no device work: writes have landed
    /// when [`HostRows::write`] returns, and the saved rows are not written again).
    pub fn host(&self) -> Result<HostView<'_>> {
        let bytes: Result<&[u8]> = match &self.mem {
            HostMem::Plain(v) => Ok(v.as_slice()),
            #[cfg(feature = "cuda")]
            HostMem::Mapped(m) => m.as_slice(),
        };
        Ok(HostView { bytes: bytes?, n: self.n, d: self.d, dtype: self.dtype })
    }
}

/// Host rows `[heads, n, d]` borrowed for the CPU.
pub struct HostView<'a> {
    bytes: &'a [u8],
    n: usize,
    d: usize,
    dtype: DType,
}

impl HostView<'_> {
    /// Rows per head.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Row `pos` of `head` widened to f32 into `out` (`d` elements). Positions are checked by
    /// the callers ([`host_attention`] refuses any past `n`).
    pub fn row(&self, head: usize, pos: usize, out: &mut [f32]) {
        let at = (head * self.n + pos) * self.d;
        match self.dtype {
            DType::BF16 => {
                let raw = &self.bytes[at * 2..(at + self.d) * 2];
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                    *o = half::bf16::from_ne_bytes([c[0], c[1]]).to_f32();
                }
            }
            _ => {
                let raw = &self.bytes[at * 4..(at + self.d) * 4];
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                    *o = f32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
    }
}

/// Attention of each query head `h` over its own picked rows `picks[h]` of KV head `h / group`
/// (`group` = query heads per KV head), computed by the CPU straight from host memory: the
/// logit of pick `j` is `scale·q·k + bias(h, j, k)` (MagicPIG's importance weight depends on
/// the key, so the bias is computed from the row as it is read). `q [heads·d]` f32. Runs on the calling rayon pool (a head's pick split into tasks
/// of [`HOST_ROWS_PER_TASK`] rows, merged by LSE). Returns `out [heads·d]` and `lse [heads]`,
/// zeros and −∞ for an empty pick: [`crate::attention::merge`] takes it as "no keys".
pub fn host_attention(
    q: &[f32],
    (k, v): (&HostRows, &HostRows),
    picks: &[Vec<u32>],
    scale: f32,
    bias: &(dyn Fn(usize, usize, &[f32]) -> f32 + Sync),
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (heads, d) = (picks.len(), k.d);
    let group = heads / k.heads.max(1);
    if q.len() != heads * d || group == 0 || heads != k.heads * group || (v.heads, v.n, v.d) != (k.heads, k.n, k.d) {
        candle_core::bail!(
            "host attention: {} query values for {heads} picks over {} KV heads of dim {d}",
            q.len(),
            k.heads
        );
    }
    if let Some(p) = picks.iter().flatten().find(|&&p| p as usize >= k.n) {
        candle_core::bail!("host attention: position {p} is past the {} stored rows", k.n);
    }
    let (kh, vh) = (k.host()?, v.host()?);
    let tasks: Vec<(usize, usize)> = picks
        .iter()
        .enumerate()
        .flat_map(|(h, p)| (0..p.len()).step_by(HOST_ROWS_PER_TASK).map(move |s| (h, s)))
        .collect();
    // Each task: (head, max logit, sum of exp(logit − max), Σ exp(logit − max)·v).
    let parts: Vec<(usize, f32, f32, Vec<f32>)> = tasks
        .into_par_iter()
        .map(|(h, start)| {
            let pick = &picks[h][start..(start + HOST_ROWS_PER_TASK).min(picks[h].len())];
            let (qh, kvh) = (&q[h * d..(h + 1) * d], h / group);
            let mut row = vec![0f32; d];
            let logits: Vec<f32> = pick
                .iter()
                .enumerate()
                .map(|(j, &p)| {
                    kh.row(kvh, p as usize, &mut row);
                    let qk: f32 = qh.iter().zip(&row).map(|(a, b)| a * b).sum();
                    scale * qk + bias(h, start + j, &row)
                })
                .collect();
            let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (mut l, mut acc) = (0f32, vec![0f32; d]);
            if m > f32::NEG_INFINITY {
                for (&p, &z) in pick.iter().zip(&logits) {
                    let e = (z - m).exp();
                    l += e;
                    vh.row(kvh, p as usize, &mut row);
                    acc.iter_mut().zip(&row).for_each(|(a, x)| *a += e * x);
                }
            }
            (h, m, l, acc)
        })
        .collect();
    let (mut out, mut lse) = (vec![0f32; heads * d], vec![f32::NEG_INFINITY; heads]);
    for h in 0..heads {
        let mine: Vec<&(usize, f32, f32, Vec<f32>)> = parts.iter().filter(|p| p.0 == h).collect();
        let m = mine.iter().map(|p| p.1).fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            continue;
        }
        let l: f32 = mine.iter().map(|p| p.2 * (p.1 - m).exp()).sum();
        for p in &mine {
            let w = (p.1 - m).exp() / l;
            out[h * d..(h + 1) * d].iter_mut().zip(&p.3).for_each(|(o, a)| *o += w * a);
        }
        lse[h] = m + l.ln();
    }
    Ok((out, lse))
}

/// `[heads, 0, d]`: built from an empty host vector, as a zero-byte device allocation is refused.
fn empty_rows(heads: usize, d: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    from_bytes(&[], dtype, (heads, 0, d), device)
}

/// A tensor's elements as the bytes host memory holds them (native byte order: the device
/// reads the rows as they lie).
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    fn raw<T>(v: &[T]) -> Vec<u8> {
        // SAFETY: f32 and bf16 are plain data without padding; the bytes are copied out.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }.to_vec()
    }
    Ok(match t.dtype() {
        DType::F32 => raw(&t.flatten_all()?.to_vec1::<f32>()?),
        DType::BF16 => raw(&t.flatten_all()?.to_vec1::<half::bf16>()?),
        other => candle_core::bail!("host rows hold f32 or bf16, not {other:?}"),
    })
}

fn from_bytes(bytes: &[u8], dtype: DType, shape: (usize, usize, usize), device: &Device) -> Result<Tensor> {
    match dtype {
        DType::F32 => {
            let v: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
            Tensor::from_vec(v, shape, device)
        }
        DType::BF16 => {
            let v: Vec<half::bf16> = bytes.chunks_exact(2).map(|c| half::bf16::from_ne_bytes([c[0], c[1]])).collect();
            Tensor::from_vec(v, shape, device)
        }
        other => candle_core::bail!("host rows hold f32 or bf16, not {other:?}"),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The kernels of kernels/cuda/select.cu, and the mapped host allocation.

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{sys, DevicePtr, HostSlice, LaunchConfig, PinnedHostSlice, PushKernelArg};
    use candle_core::cuda::{CudaDevice, WrapErr};
    use candle_core::{CpuStorage, CudaStorage, DType, Layout, Result, Shape, Tensor};

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
        buf: PinnedHostSlice<u8>,
        ptr: u64,
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
        scores.apply_op1_no_bwd(&TopK { rows, n, k })
    }

    struct TopK {
        rows: usize,
        n: usize,
        k: usize,
    }

    impl candle_core::CustomOp1 for TopK {
        fn name(&self) -> &'static str {
            "folio-topk"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("topk runs the reference on the CPU, not this op")
        }

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
    /// from the tail tensor (the op's second input, when there is one).
    struct Gather {
        src: u64,
        dims: (usize, usize, usize, usize, usize, usize),
        dtype: DType,
    }

    impl Gather {
        fn launch(&self, idx: &CudaStorage, il: &Layout, tail: u64) -> Result<(CudaStorage, Shape)> {
            let (heads, sel, group, n, tail_n, d) = self.dims;
            let dev = idx.device();
            let idx_s = idx.as_cuda_slice::<u32>()?.slice(il.start_offset()..);
            let row_bytes = d * self.dtype.size_in_bytes();
            if row_bytes % 16 != 0 || self.src % 16 != 0 || tail % 16 != 0 {
                candle_core::bail!("gather: rows of {row_bytes} bytes cannot be copied 16 bytes at a time");
            }
            let vecs = row_bytes / 16;
            let total = heads * sel * vecs;
            macro_rules! run {
                ($t:ty) => {{
                    // SAFETY: one thread per 16-byte vector writes every byte of the output.
                    let out = unsafe { dev.alloc::<$t>(heads * sel * d)? };
                    let f = dev.get_or_load_custom_func("gather_rows", MODULE, PTX)?;
                    let mut b = f.builder();
                    let (total_i, sel_i, group_i, n_i, tail_i, vecs_i) =
                        (total as i64, sel as i32, group as i32, n as i32, tail_n as i32, vecs as i32);
                    b.arg(&self.src).arg(&tail).arg(&idx_s).arg(&out);
                    b.arg(&total_i).arg(&sel_i).arg(&group_i).arg(&n_i).arg(&tail_i).arg(&vecs_i);
                    let cfg = LaunchConfig {
                        grid_dim: (total.div_ceil(THREADS as usize) as u32, 1, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: positions are < n + tail_n (checked by the caller); src holds
                    // heads/group × n rows, tail heads/group × tail_n.
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

    impl candle_core::CustomOp1 for Gather {
        fn name(&self) -> &'static str {
            "folio-gather"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("gather runs the reference on the CPU, not this op")
        }

        fn cuda_fwd(&self, idx: &CudaStorage, il: &Layout) -> Result<(CudaStorage, Shape)> {
            self.launch(idx, il, 0)
        }
    }

    impl candle_core::CustomOp2 for Gather {
        fn name(&self) -> &'static str {
            "folio-gather-tail"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("gather runs the reference on the CPU, not this op")
        }

        fn cuda_fwd(
            &self,
            idx: &CudaStorage,
            il: &Layout,
            tail: &CudaStorage,
            tl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let stream = idx.device().cuda_stream();
            let offset = tl.start_offset();
            let ptr = match tail.dtype() {
                DType::F32 => tail.as_cuda_slice::<f32>()?.slice(offset..).device_ptr(&stream).0,
                DType::BF16 => tail.as_cuda_slice::<half::bf16>()?.slice(offset..).device_ptr(&stream).0,
                other => candle_core::bail!("gather: rows must be f32 or bf16, not {other:?}"),
            };
            self.launch(idx, il, ptr)
        }
    }

    pub fn gather(
        src: &Mapped,
        tail: Option<&Tensor>,
        idx: &Tensor,
        dims: (usize, usize, usize, usize, usize, usize),
        dtype: DType,
    ) -> Result<Tensor> {
        let candle_core::Device::Cuda(dev) = idx.device() else { candle_core::bail!("gather: idx must be on the GPU") };
        let stream = dev.cuda_stream();
        let op = Gather { src: src.ptr, dims, dtype };
        let idx = idx.contiguous()?;
        // The kernel reads the rows through their device address, which cudarc does not see.
        // This guard makes the stream wait for the rows' last recorded use and records their
        // event after the launch, so a later host write (`as_mut_slice`) or free of the rows
        // waits for this read to finish.
        // SAFETY: the host view it returns is not touched; only the ordering is used, on
        // `stream`, candle's stream, where the launch below goes.
        let (_, ordered) = unsafe { src.buf.stream_synced_slice(&stream) };
        let out = match tail {
            Some(t) => idx.apply_op2_no_bwd(t, &op),
            None => idx.apply_op1_no_bwd(&op),
        };
        drop(ordered);
        out
    }
}
