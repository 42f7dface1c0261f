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
//!   collect), ≈ 16·rows·n bytes, no FLOPs to speak of — bandwidth-bound (a row of at most
//!   2048 scores is sorted in one block instead: one launch, not eight);
//! * gather: `rows·sel·row_bytes` read over the host link (or device memory) and written to
//!   device memory — bound by the host link's bandwidth when the source is host memory.
//! * host attention ([`attend_partial`]): the CPU's side of MagicPIG, attending a sample straight
//!   from host memory so that the sample never crosses the link: 4·s·d FLOPs and s·2·d·b
//!   bytes of host memory per call over `s` rows — bound by the host's memory bandwidth;
//! * MagicPIG's sample on the GPU instead ([`lsh`]): the table walk and the attention reading
//!   tables and rows over the host link — bound by the link (see there).

use std::sync::Arc;

use crate::Positions;
use candle_core::{DType, Device, Result, Tensor};

/// The plain-slice definitions the fast paths are held to.
pub mod reference;

/// Positions `[rows, min(k, n)]` u32 of the `k` largest scores of each row of `scores [rows, n]`
/// (f32). On the CPU they come sorted by position (the reference); on CUDA a row of at most
/// 2048 scores is sorted in one block and gives the reference's positions in its order, a
/// longer one goes through a radix select and gives them in no set order, with ties at the
/// k-th score broken arbitrarily.
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

/// How [`HostRows`] hold their rows when that is not the dtype they are read in: a context
/// file's sections, read where they lie ([`HostRows::view`]); the row format is the context
/// file's (`folio_context_file::rows`).
///
/// Why rows stay in the file's dtype: at a million tokens a 7B model's fp8 file is 31 GB, the
/// same rows widened to bf16 57 GB, and page-locking fresh host memory ran at 2.4 GB/s on the
/// GPU machine (23 s for 57 GB) where registering the file's mapping in place ran at 45 GB/s
/// (docs/performance.md, "Reopen to the first token"). The gather widens what it moves, so the
/// link carries the file's bytes too.
pub use folio_context_file::rows::Stored;

/// How a `dtype` is stored as itself (f32 and bf16 only).
fn stored_as(dtype: DType) -> Result<Stored> {
    match dtype {
        DType::F32 => Ok(Stored::F32),
        DType::BF16 => Ok(Stored::Bf16),
        other => candle_core::bail!("host rows hold f32 or bf16, not {other:?}"),
    }
}

/// Whether rows stored so are `dtype`'s own bytes (a gather copies them as they are).
fn holds(stored: Stored, dtype: DType) -> bool {
    matches!((stored, dtype), (Stored::F32, DType::F32) | (Stored::Bf16, DType::BF16))
}

/// Read-only host memory owned elsewhere (a memory-mapped context file), shared by the
/// [`HostRows`] that view parts of it. On a GPU it is registered once, in place: page-locked
/// and mapped into the device's address space without a copy; the registration ends (after
/// the device has finished every read queued on this context) when the last view is dropped.
pub struct SharedHost {
    /// Declared first: dropped (the device done, the pages unlocked) before the owner.
    #[cfg(feature = "cuda")]
    registered: Option<cuda::Registered>,
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
}

impl SharedHost {
    /// Shares `owner`'s bytes with `device`'s gathers.
    pub fn new(device: &Device, owner: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Result<Arc<Self>> {
        #[cfg(feature = "cuda")]
        let registered = match device {
            Device::Cuda(dev) => Some(cuda::Registered::new(dev, (*owner).as_ref())?),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Ok(Arc::new(Self {
            #[cfg(feature = "cuda")]
            registered,
            owner,
        }))
    }

    /// The shared bytes, as the CPU reads them.
    pub fn bytes(&self) -> &[u8] {
        (*self.owner).as_ref()
    }

    /// The memory's address in the device's address space (registered memory only).
    #[cfg(feature = "cuda")]
    pub fn device_address(&self) -> Result<u64> {
        match &self.registered {
            Some(r) => Ok(r.ptr),
            None => candle_core::bail!("shared host memory is not registered with a GPU"),
        }
    }

    /// Whether the memory is registered with a GPU (else it serves the CPU).
    pub fn registered(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.registered.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }
}

/// One layer's K (or V) rows of every KV head, `[heads, n, d]`, in host memory: page-locked and
/// mapped into the device's address space when the device is a GPU, a plain buffer otherwise;
/// or a view of a [`SharedHost`] (a context file's section) in its stored dtype. Rows are
/// written as they are produced (not into a view) and read by [`HostRows::gather`] in the
/// dtype they were made for.
///
/// A clone shares the memory (it is reference-counted): a thread that reads the rows after the
/// caller's borrow ends (HiP's search on the CPU, a step ahead) holds one, and the memory lives
/// until the last is gone. Rows are written only through the one handle there is.
#[derive(Clone)]
pub struct HostRows {
    heads: usize,
    n: usize,
    d: usize,
    /// The dtype gathers return.
    dtype: DType,
    stored: Stored,
    device: Device,
    mem: HostMem,
}

#[derive(Clone)]
enum HostMem {
    Plain(Arc<Vec<u8>>),
    #[cfg(feature = "cuda")]
    Mapped(Arc<cuda::Mapped>),
    /// A section of shared memory, from byte `at`.
    Shared {
        host: Arc<SharedHost>,
        at: usize,
    },
}

impl HostRows {
    /// Bytes [`Self::new`] takes for `n` rows of `d` elements of `dtype` per head.
    pub fn bytes_for(dtype: DType, heads: usize, n: usize, d: usize) -> Result<usize> {
        Ok(stored_as(dtype)?.section_bytes(heads * n, d))
    }

    /// Room for `n` rows of `d` elements of `dtype` per head, for `device` to gather from.
    pub fn new(device: &Device, dtype: DType, heads: usize, n: usize, d: usize) -> Result<Self> {
        let stored = stored_as(dtype)?;
        let bytes = stored.section_bytes(heads * n, d);
        let mem = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => HostMem::Mapped(Arc::new(cuda::Mapped::new(dev, bytes)?)),
            _ => HostMem::Plain(Arc::new(vec![0; bytes])),
        };
        Ok(Self { heads, n, d, dtype, stored, device: device.clone(), mem })
    }

    /// `[heads, n, d]` rows stored as `stored` in `host` from byte `at` on (a section of
    /// `stored.section_bytes(heads · n, d)` bytes), gathered as `dtype` on the device `host`
    /// was shared with. Read-only.
    pub fn view(
        device: &Device,
        host: &Arc<SharedHost>,
        at: usize,
        stored: Stored,
        (heads, n, d): (usize, usize, usize),
        dtype: DType,
    ) -> Result<Self> {
        stored_as(dtype)?;
        let bytes = stored.section_bytes(heads * n, d);
        let fits = at.checked_add(bytes).is_some_and(|end| end <= host.bytes().len());
        let scales_ok = match stored {
            Stored::Fp8 { scales } => scales >= heads * n * d && scales % 4 == 0,
            _ => true,
        };
        // The GPU's widening kernel reads 8 values at a time, in 16-byte (8-byte for fp8) loads.
        let aligned = device.is_cpu() || (d % 8 == 0 && (host.bytes().as_ptr() as usize + at).is_multiple_of(16));
        if !fits || !scales_ok || !aligned {
            candle_core::bail!(
                "host rows: a view of {bytes} bytes ({stored:?}, [{heads}, {n}, {d}]) at byte {at} of {} does not fit, \
                 or is not aligned for the gather",
                host.bytes().len()
            );
        }
        if device.is_cuda() != host.registered() {
            candle_core::bail!("host rows: the shared memory was registered for another device");
        }
        let mem = HostMem::Shared { host: host.clone(), at };
        Ok(Self { heads, n, d, dtype, stored, device: device.clone(), mem })
    }

    /// KV heads.
    #[inline]
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Rows per head.
    #[inline]
    pub fn len(&self) -> usize {
        self.n
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Elements per row.
    #[inline]
    pub fn dim(&self) -> usize {
        self.d
    }

    /// The dtype gathers return.
    #[inline]
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How the rows are stored.
    #[inline]
    pub fn stored(&self) -> Stored {
        self.stored
    }

    /// The device the rows are gathered to.
    #[inline]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of host memory the rows take (a view's: the section's).
    pub fn bytes(&self) -> usize {
        self.stored.section_bytes(self.heads * self.n, self.d)
    }

    fn row_bytes(&self) -> usize {
        self.stored.row_bytes(self.d)
    }

    fn host_mut(&mut self) -> Result<&mut [u8]> {
        match &mut self.mem {
            HostMem::Plain(v) => Arc::get_mut(v).map(Vec::as_mut_slice).ok_or_else(shared_while_written),
            #[cfg(feature = "cuda")]
            HostMem::Mapped(m) => Arc::get_mut(m).ok_or_else(shared_while_written)?.as_mut_slice(),
            HostMem::Shared { .. } => candle_core::bail!("host rows: a view of shared memory is read-only"),
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
            let m = Arc::get_mut(m).ok_or_else(shared_while_written)?;
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

    /// Where the GPU's kernels read these rows: the page-locked copy, or the registered
    /// memory they are a view of.
    #[cfg(feature = "cuda")]
    pub fn source(&self) -> Result<cuda::Source<'_>> {
        match &self.mem {
            HostMem::Mapped(m) => Ok(cuda::Source::Mapped(m.as_ref())),
            HostMem::Shared { host, at } => {
                let registered = host.registered.as_ref().ok_or_else(|| {
                    candle_core::Error::Msg("host rows: shared memory not registered with the GPU".into())
                })?;
                Ok(cuda::Source::Registered { registered, at: *at, stored: self.stored })
            }
            HostMem::Plain(_) => candle_core::bail!("host rows: plain memory on a GPU"),
        }
    }

    /// Refuses a tail that does not continue these rows; its rows per head.
    pub fn check_tail(&self, t: &Tensor) -> Result<usize> {
        let (th, tn, td) = t.dims3()?;
        if th != self.heads || td != self.d || t.dtype() != self.dtype || !t.device().same_device(&self.device) {
            candle_core::bail!(
                "host rows: tail {:?} {:?} does not continue [{}, n, {}] {:?}",
                t.dims(),
                t.dtype(),
                self.heads,
                self.d,
                self.dtype
            );
        }
        Ok(tn)
    }

    /// `out [heads', sel, d]` on this store's device: `out[h, j] = rows[h / group][idx[h, j]]`,
    /// for `idx [heads', sel]` u32 positions (`heads' = heads · group`). Positions from the
    /// stored `n` on continue in `tail [heads, tail_n, d]` (same dtype, this device): the rows
    /// written after the host tier was filled. A position past both is refused when `positions`
    /// asks for the check (always on the CPU), clamped by the kernel otherwise.
    pub fn gather(&self, idx: &Tensor, group: usize, tail: Option<&Tensor>, positions: Positions) -> Result<Tensor> {
        let (ih, sel, tail_n) = self.gather_shape(idx, group, tail)?;
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
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            let tail = tail.map(|t| t.contiguous()).transpose()?;
            let dims = (ih, sel, group, self.n, tail_n, self.d);
            return cuda::gather(self.source()?, tail.as_ref(), idx, dims, (self.dtype, None));
        }
        let idx_v: Vec<u32> = idx.flatten_all()?.to_vec1()?;
        let view = self.host()?;
        if holds(self.stored, self.dtype) {
            let tail_v = tail.map(|t| tensor_bytes(&t.contiguous()?)).transpose()?.unwrap_or_default();
            let out = reference::gather_rows(view.bytes, self.n, &tail_v, tail_n, &idx_v, sel, group, self.row_bytes());
            return from_bytes(&out, self.dtype, (ih, sel, self.d), &self.device);
        }
        // Widened (or narrowed) through f32, as the file's decode and a cast would.
        let tail_v: Vec<f32> = match tail {
            Some(t) => t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            None => Vec::new(),
        };
        let out = reference::gather_rows_wide(&view, &tail_v, tail_n, &idx_v, sel, group);
        Tensor::from_vec(out, (ih, sel, self.d), &self.device)?.to_dtype(self.dtype)
    }
}

/// A GPU's second stream, where work overlaps what candle's stream runs meanwhile (HiP's
/// search a step ahead, and the gather of the rows it picks: [`HostRows::gather_after`]).
#[cfg(feature = "cuda")]
pub type Side = std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>;

/// What launches queued on a [`Side`] stream write, and the tensors they read: both to be kept
/// until candle's stream has waited for the launches (a tensor freed on candle's stream before
/// could be handed to a new allocation while the side stream still uses it).
#[cfg(feature = "cuda")]
pub struct SideWork {
    pub written: Vec<Tensor>,
    pub read: Vec<Tensor>,
}

impl HostRows {
    /// [`HostRows::gather`] of trusted positions on the GPU stream `side`, once candle's stream
    /// has queued everything so far: the caller orders candle's stream after `side` before it
    /// reads the rows, and keeps `idx` and `tail` (contiguous) alive until then.
    #[cfg(feature = "cuda")]
    pub fn gather_after(&self, idx: &Tensor, group: usize, tail: Option<&Tensor>, side: &Side) -> Result<Tensor> {
        let (ih, sel, tail_n) = self.gather_shape(idx, group, tail)?;
        // A copy made here would be freed on candle's stream while the side stream reads it.
        if !self.device.is_cuda() || !idx.is_contiguous() || sel == 0 {
            candle_core::bail!("host rows: a gather of {:?} on a side stream (contiguous, on the GPU)", idx.dims());
        }
        if tail.is_some_and(|t| !t.is_contiguous()) {
            candle_core::bail!("host rows: a side stream's tail must be contiguous");
        }
        let dims = (ih, sel, group, self.n, tail_n, self.d);
        cuda::gather(self.source()?, tail, idx, dims, (self.dtype, Some(side)))
    }

    /// `idx`'s rows and positions a row, and `tail`'s rows, checked against this store: `idx`
    /// `[heads · group, sel]`, the tail as [`HostRows::check_tail`] wants it.
    fn gather_shape(&self, idx: &Tensor, group: usize, tail: Option<&Tensor>) -> Result<(usize, usize, usize)> {
        let (ih, sel) = idx.dims2()?;
        if group == 0 || ih != self.heads * group {
            candle_core::bail!("host rows: gathering {:?} with group {group} from {} heads", idx.dims(), self.heads);
        }
        let tail_n = match tail {
            Some(t) => self.check_tail(t)?,
            None => 0,
        };
        Ok((ih, sel, tail_n))
    }

    /// The rows as the CPU reads them, from host memory (no device work: writes have landed
    /// when [`HostRows::write`] returns, and the saved rows are not written again).
    pub fn host(&self) -> Result<HostView<'_>> {
        let bytes: &[u8] = match &self.mem {
            HostMem::Plain(v) => v.as_slice(),
            #[cfg(feature = "cuda")]
            HostMem::Mapped(m) => m.as_ref().as_slice()?,
            HostMem::Shared { host, at } => &host.bytes()[*at..*at + self.bytes()],
        };
        Ok(HostView { bytes, heads: self.heads, n: self.n, d: self.d, stored: self.stored })
    }
}

/// Host rows `[heads, n, d]` borrowed for the CPU, in their stored dtype.
pub struct HostView<'a> {
    bytes: &'a [u8],
    heads: usize,
    n: usize,
    d: usize,
    stored: Stored,
}

impl<'a> HostView<'a> {
    /// `[heads, n, d]` rows stored as `stored` in `bytes` (a section of exactly
    /// `stored.section_bytes(heads · n, d)` bytes): rows the CPU reads where they lie.
    pub fn new(bytes: &'a [u8], (heads, n, d): (usize, usize, usize), stored: Stored) -> Result<Self> {
        let want = stored.section_bytes(heads * n, d);
        if bytes.len() != want {
            candle_core::bail!("host view: {} bytes for [{heads}, {n}, {d}] rows ({stored:?}) of {want}", bytes.len());
        }
        Ok(Self { bytes, heads, n, d, stored })
    }

    /// KV heads.
    #[inline]
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Elements per row.
    #[inline]
    pub fn dim(&self) -> usize {
        self.d
    }

    /// How the rows are stored.
    #[inline]
    pub fn stored(&self) -> Stored {
        self.stored
    }

    /// The rows' bytes, `heads · n` rows in the stored format.
    #[inline]
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Rows per head.
    #[inline]
    pub fn len(&self) -> usize {
        self.n
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Row `pos` of `head` widened to f32 into `out` (`d` elements). Positions are checked by
    /// the callers ([`attend_partial`] refuses any past `n`).
    pub fn row(&self, head: usize, pos: usize, out: &mut [f32]) {
        reference::stored_row(self.bytes, self.stored, head * self.n + pos, self.d, out);
    }

    /// Asks the CPU to bring row `pos` of `head` (and an fp8 row's scale) toward its caches: a
    /// hint that neither waits nor faults, so that a loop over scattered rows keeps many of
    /// them in flight from DRAM instead of one after another (a no-op off x86-64, and for a
    /// position past the rows).
    #[inline]
    pub fn prefetch(&self, head: usize, pos: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            const LINE: usize = 64;
            if head >= self.heads || pos >= self.n {
                return;
            }
            let row = head * self.n + pos;
            let rb = self.stored.row_bytes(self.d);
            // A section holds its rows, then (fp8) a scale for each.
            let scale = match self.stored {
                Stored::Fp8 { scales } => Some(scales + std::mem::size_of::<f32>() * row),
                _ => None,
            };
            let offsets = (row * rb..(row + 1) * rb).step_by(LINE).chain(scale);
            for offset in offsets.filter(|&o| o < self.bytes.len()) {
                // SAFETY: `offset` lies within `bytes` (filtered), and a prefetch reads nothing.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(self.bytes.as_ptr().add(offset).cast::<i8>()) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (head, pos);
    }
}

/// A write to rows another handle still reads (a clone held by a search in flight).
fn shared_while_written() -> candle_core::Error {
    candle_core::Error::Msg("host rows: written while another handle reads them".into())
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
pub mod cuda;
