//! What the driver says about the device: peak memory in use, sampled while work runs, and the
//! host link's copy rate. Benchmarks report these beside their timings, so a memory figure is
//! measured rather than estimated and a transfer time has its limit next to it.

use candle_core::{DType, Device, Result, Tensor};

/// Polls the device's used memory (total − free, as the driver reports it) on a thread until
/// dropped, keeping the largest value seen. On the CPU it measures nothing.
pub struct MemorySampler {
    #[cfg(feature = "cuda")]
    inner: Option<cuda::Sampler>,
}

impl MemorySampler {
    pub fn start(device: &Device) -> Result<Self> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Ok(Self { inner: Some(cuda::Sampler::start(d)?) }),
            _ => Ok(Self {
                #[cfg(feature = "cuda")]
                inner: None,
            }),
        }
    }

    /// Largest device memory in use seen so far, in bytes (`None` off the GPU).
    pub fn peak(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.inner {
            return Some(s.peak());
        }
        None
    }

    /// Starts a new peak from the memory in use now (one benchmark row after another).
    pub fn reset(&self) {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.inner {
            s.reset();
        }
    }

    /// Device memory in use now, and the device's total (`None` off the GPU).
    pub fn now(&self) -> Result<Option<(u64, u64)>> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.inner {
            return s.now().map(Some);
        }
        Ok(None)
    }
}

/// Lets the device's memory pool keep up to `bytes` reserved between synchronisations instead
/// of returning freed memory to the driver at each one (its default): a decode step frees and
/// re-allocates the same transients every token, and re-mapping them each time costs more than
/// the step's kernels. The kept memory is counted by the driver's used figure, so
/// [`MemorySampler`] still sees it. No effect on the CPU.
pub fn keep_pool(device: &Device, bytes: u64) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda::keep_pool(d, bytes),
        _ => {
            let _ = bytes;
            Ok(())
        }
    }
}

/// Hands the memory the device's pool keeps reserved (freed, not returned: [`keep_pool`]) back
/// to the driver, so that the next peak measured by [`MemorySampler`] is the next work's own.
/// No effect on the CPU.
pub fn trim_pool(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda::trim_pool(d),
        _ => Ok(()),
    }
}

/// Bytes per second of a copy of `bytes` from page-locked host memory to the device (the host
/// link's limit for the offloaded tier), best of a few; a host memcpy's rate on the CPU.
pub fn host_to_device_rate(device: &Device, bytes: usize) -> Result<f64> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda::host_to_device_rate(d, bytes),
        _ => {
            let src = vec![1u8; bytes];
            let mut dst = vec![0u8; bytes];
            let start = std::time::Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            Ok(bytes as f64 / start.elapsed().as_secs_f64())
        }
    }
}

/// The raw bytes of `t`'s values (row-major, its own dtype, little-endian) in host memory.
///
/// Why not `Tensor::to_vec1`: on the GPU machine a copy from the device into pageable memory
/// ran at ~0.4 GB/s (a 7B layer's hidden states at 128k tokens, 0.9 GiB, took 2 s); through
/// page-locked staging buffers, two pieces in flight, it runs at the host link's rate less a
/// host memcpy. On the CPU the bytes are copied out directly.
pub fn to_host_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let mut out = vec![0u8; t.elem_count() * t.dtype().size_in_bytes()];
    copy_to_host(t, &mut out)?;
    Ok(out)
}

/// [`to_host_bytes`] into `dst`, which holds exactly the tensor's bytes: a caller that copies
/// a tensor of the same size again and again reuses one buffer (a fresh one of tens of MB costs
/// a page fault per 4 KiB on first touch, which took longer than the copy on the GPU machine).
pub fn copy_to_host(t: &Tensor, dst: &mut [u8]) -> Result<()> {
    let n = t.elem_count() * t.dtype().size_in_bytes();
    if dst.len() != n {
        candle_core::bail!("{} bytes of room for a {:?} {:?} tensor of {n} bytes", dst.len(), t.dims(), t.dtype());
    }
    let t = t.contiguous()?;
    match t.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::copy_to_host(&t, dst),
        _ => {
            let t = t.flatten_all()?;
            match t.dtype() {
                DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(&t.to_vec1::<f32>()?)),
                DType::BF16 => dst.copy_from_slice(bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?)),
                DType::F16 => dst.copy_from_slice(bytemuck::cast_slice(&t.to_vec1::<half::f16>()?)),
                DType::U8 => dst.copy_from_slice(&t.to_vec1::<u8>()?),
                other => candle_core::bail!("raw bytes of {other:?} tensors are not supported"),
            }
            Ok(())
        }
    }
}

/// How far the calling thread's device work has been queued, for another thread to wait on
/// before it reads what that work makes.
///
/// Why: candle's CUDA device queues each host thread's work on that thread's own stream
/// (`CU_STREAM_PER_THREAD`), so a copy off the device started from another thread runs beside
/// the kernels this thread queues next, as a second stream would (a prefill copies a layer's
/// K/V to the host while the next layer computes). That copy must not start before the work
/// that made its source: [`Queued::wait_here`] puts the wait on the other thread's stream,
/// without holding up either host thread. On the CPU, work is done when it returns.
pub struct Queued {
    #[cfg(feature = "cuda")]
    event: Option<candle_core::cuda::cudarc::driver::CudaEvent>,
}

impl Queued {
    /// The work queued on `device` by this thread so far.
    pub fn now(device: &Device) -> Result<Self> {
        Self::record(device, false)
    }

    /// [`Queued::now`], and able to time the work between two of them
    /// ([`Queued::seconds_since`]).
    pub fn timed(device: &Device) -> Result<Self> {
        Self::record(device, true)
    }

    fn record(device: &Device, timing: bool) -> Result<Self> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
                use candle_core::cuda::WrapErr;
                let stream = d.cuda_stream();
                let flags =
                    if timing { CUevent_flags::CU_EVENT_DEFAULT } else { CUevent_flags::CU_EVENT_DISABLE_TIMING };
                let event = stream.context().new_event(Some(flags)).w()?;
                event.record(&stream).w()?;
                Ok(Self { event: Some(event) })
            }
            _ => {
                let _ = timing;
                Ok(Self {
                    #[cfg(feature = "cuda")]
                    event: None,
                })
            }
        }
    }

    /// Makes the calling thread's stream wait for that work: what it queues from here on (a
    /// copy of the results) runs after it.
    pub fn wait_here(&self, device: &Device) -> Result<()> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                use candle_core::cuda::WrapErr;
                match &self.event {
                    Some(e) => d.cuda_stream().wait(e).w(),
                    None => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// Blocks the calling thread until that work is done.
    pub fn wait(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(e) = &self.event {
            use candle_core::cuda::WrapErr;
            return e.synchronize().w();
        }
        Ok(())
    }

    /// Whether that work is done, without waiting (on the CPU it always is).
    pub fn done(&self) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if let Some(e) = &self.event {
            use candle_core::cuda::WrapErr;
            return e.try_is_complete().w();
        }
        Ok(true)
    }

    /// Seconds the device spent between `earlier` and this point, once both are done (both
    /// [`Queued::timed`]); `None` on the CPU, where there is no queue to time.
    pub fn seconds_since(&self, earlier: &Queued) -> Result<Option<f64>> {
        #[cfg(feature = "cuda")]
        if let (Some(start), Some(end)) = (&earlier.event, &self.event) {
            use candle_core::cuda::WrapErr;
            return Ok(Some(f64::from(start.elapsed_ms(end).w()?) / 1e3));
        }
        let _ = earlier;
        Ok(None)
    }
}

/// A tensor of `shape` and `dtype` on `device` from its raw bytes ([`to_host_bytes`]'s layout),
/// through the same page-locked staging on CUDA.
pub fn from_host_bytes(bytes: &[u8], dtype: DType, shape: &[usize], device: &Device) -> Result<Tensor> {
    let want = shape.iter().product::<usize>() * dtype.size_in_bytes();
    if bytes.len() != want {
        candle_core::bail!("{} bytes for a {shape:?} {dtype:?} tensor of {want} bytes", bytes.len());
    }
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda::from_host_bytes(bytes, dtype, shape, d),
        _ => Tensor::from_raw_buffer(bytes, dtype, shape, device),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{
        result, sys, CudaContext, CudaEvent, CudaStream, CudaView, DevicePtr, DevicePtrMut, PinnedHostSlice,
    };
    use candle_core::cuda::{CudaDevice, WrapErr};
    use candle_core::{DType, Result, Tensor};

    /// How often the sampler asks the driver (a transient allocation shorter than this can be
    /// missed; the benchmarks' allocations live for a layer or longer).
    const SAMPLE_EVERY: Duration = Duration::from_micros(500);
    /// Copies timed for the link rate (the best one counts: the first pays for page mapping).
    const COPIES: usize = 4;

    pub struct Sampler {
        ctx: Arc<CudaContext>,
        peak: Arc<Peak>,
        stop: Arc<AtomicBool>,
        thread: Option<JoinHandle<()>>,
    }

    /// The largest sample since the last reset. A sample records only into the generation it
    /// was taken in, so one read before a reset never lands after it (the lock makes the
    /// check and the update one step).
    #[derive(Default)]
    struct Peak(Mutex<(u64, u64)>); // (generation, bytes)

    impl Peak {
        fn generation(&self) -> u64 {
            self.0.lock().map_or(0, |g| g.0)
        }

        fn record(&self, generation: u64, bytes: u64) {
            if let Ok(mut g) = self.0.lock() {
                if g.0 == generation {
                    g.1 = g.1.max(bytes);
                }
            }
        }

        fn get(&self) -> u64 {
            self.0.lock().map_or(0, |g| g.1)
        }

        fn restart(&self, bytes: u64) {
            if let Ok(mut g) = self.0.lock() {
                *g = (g.0 + 1, bytes);
            }
        }
    }

    fn used(ctx: &CudaContext) -> Result<(u64, u64)> {
        let (free, total) = ctx.mem_get_info().w()?;
        Ok(((total - free) as u64, total as u64))
    }

    impl Sampler {
        pub fn start(dev: &CudaDevice) -> Result<Self> {
            let ctx = dev.cuda_stream().context().clone();
            let peak = Arc::new(Peak::default());
            peak.restart(used(&ctx)?.0);
            let stop = Arc::new(AtomicBool::new(false));
            let thread = {
                let (ctx, peak, stop) = (ctx.clone(), peak.clone(), stop.clone());
                std::thread::spawn(move || {
                    if ctx.bind_to_thread().is_err() {
                        return;
                    }
                    while !stop.load(Ordering::Relaxed) {
                        let generation = peak.generation();
                        if let Ok((u, _)) = used(&ctx) {
                            peak.record(generation, u);
                        }
                        std::thread::sleep(SAMPLE_EVERY);
                    }
                })
            };
            Ok(Self { ctx, peak, stop, thread: Some(thread) })
        }

        pub fn peak(&self) -> u64 {
            let generation = self.peak.generation();
            if let Ok((u, _)) = used(&self.ctx) {
                self.peak.record(generation, u);
            }
            self.peak.get()
        }

        pub fn now(&self) -> Result<(u64, u64)> {
            used(&self.ctx)
        }

        pub fn reset(&self) {
            self.peak.restart(used(&self.ctx).map_or(0, |u| u.0));
        }
    }

    impl Drop for Sampler {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    pub fn keep_pool(dev: &CudaDevice, bytes: u64) -> Result<()> {
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().w()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut threshold = bytes;
        // SAFETY: the device handle is this context's; the attribute takes a u64.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().w()?;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .w()?;
        }
        Ok(())
    }

    pub fn trim_pool(dev: &CudaDevice) -> Result<()> {
        let stream = dev.cuda_stream();
        stream.synchronize().w()?;
        let ctx = stream.context().clone();
        ctx.bind_to_thread().w()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the device handle is this context's; trimming frees only unused reserved memory.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().w()?;
            sys::cuMemPoolTrimTo(pool, 0).result().w()?;
        }
        Ok(())
    }

    pub fn host_to_device_rate(dev: &CudaDevice, bytes: usize) -> Result<f64> {
        let stream = dev.cuda_stream();
        let ctx = stream.context().clone();
        // SAFETY: filled below before it is read.
        let mut host = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }.w()?;
        host.as_mut_slice().w()?.fill(1);
        // SAFETY: the copy writes every byte.
        let mut dst = unsafe { stream.alloc::<u8>(bytes) }.w()?;
        let mut best = f64::INFINITY;
        for _ in 0..COPIES {
            let start = Instant::now();
            stream.memcpy_htod(&host, &mut dst).w()?;
            stream.synchronize().w()?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best)
    }

    /// Bytes per piece of a staged copy, and pieces in flight (one copying, one being read or
    /// filled by the host).
    const PIECE: usize = 16 << 20;
    const BUFFERS: usize = 2;
    /// Bytes of a piece one core copies between staging and the caller's memory.
    const COPY_SHARE: usize = 1 << 20;

    /// Pairs of page-locked staging buffers not in use, with the context they were made in. A
    /// transfer takes a pair and puts it back, so transfers on several threads at once (a
    /// prefill's K and V copied off the device beside the next layer's hidden states) each have
    /// their own, and a pair is made only when every existing one is in use. Pairs of another
    /// context (a device made again with new settings) are let go when this one needs a pair,
    /// and at most [`SPARE_PAIRS`] wait in the pool.
    static STAGING: Mutex<Vec<Vec<PinnedHostSlice<u8>>>> = Mutex::new(Vec::new());
    const SPARE_PAIRS: usize = 4;

    /// A pair taken from [`STAGING`]: back into it when dropped, once no copy can be writing
    /// into it. A use that finished (`clean`) waited for its copies; one that failed or
    /// panicked part-way may have left some in flight, all on this thread's stream, so the
    /// stream is synchronised first; where even that fails the pair is leaked rather than
    /// freed under a copy.
    struct Lease<'a> {
        stream: &'a CudaStream,
        bufs: Vec<PinnedHostSlice<u8>>,
        clean: bool,
    }

    impl Drop for Lease<'_> {
        fn drop(&mut self) {
            let bufs = std::mem::take(&mut self.bufs);
            if !self.clean && self.stream.synchronize().is_err() {
                std::mem::forget(bufs);
                return;
            }
            let mut free = STAGING.lock().unwrap_or_else(|e| e.into_inner());
            if free.len() < SPARE_PAIRS {
                free.push(bufs);
            }
        }
    }

    fn with_staging<T>(stream: &Arc<CudaStream>, f: impl FnOnce(&mut [PinnedHostSlice<u8>]) -> Result<T>) -> Result<T> {
        let ctx = stream.context();
        // Raw copies run in the context bound to this thread (a new thread has none).
        ctx.bind_to_thread().w()?;
        let taken = {
            let mut free = STAGING.lock().unwrap_or_else(|e| e.into_inner());
            match free.iter().position(|p| Arc::ptr_eq(p[0].context(), ctx)) {
                Some(i) => Some(free.swap_remove(i)),
                None => {
                    // Nothing of this context is free, so every pair here is another context's:
                    // those are not coming back.
                    free.clear();
                    None
                }
            }
        };
        let bufs = match taken {
            Some(bufs) => bufs,
            None => (0..BUFFERS)
                // SAFETY: every byte a copy reads from a staging buffer was written first.
                .map(|_| unsafe { ctx.alloc_pinned_with_flags::<u8>(PIECE, 0) }.w())
                .collect::<Result<_>>()?,
        };
        let mut lease = Lease { stream, bufs, clean: false };
        let result = f(&mut lease.bufs);
        lease.clean = result.is_ok();
        result
    }

    /// The device buffer behind `cs` as bytes.
    fn bytes_of(cs: &candle_core::CudaStorage) -> Result<CudaView<'_, u8>> {
        macro_rules! view {
            ($t:ty) => {{
                let s = cs.as_cuda_slice::<$t>()?;
                // SAFETY: a byte view of the same allocation, no longer than it.
                unsafe { s.transmute::<u8>(s.len() * std::mem::size_of::<$t>()) }
            }};
        }
        let view = match cs.dtype() {
            DType::BF16 => view!(half::bf16),
            DType::F16 => view!(half::f16),
            DType::F32 => view!(f32),
            DType::U8 => view!(u8),
            other => candle_core::bail!("raw bytes of {other:?} tensors are not supported"),
        };
        view.ok_or_else(|| candle_core::Error::Msg("internal: a byte view longer than its buffer".into()))
    }

    /// `dst` = `src` on several cores: the copies between staging and the caller's memory are
    /// the host's share of a transfer, and one core's memcpy (~5 GB/s on the GPU machine: 3.9 GB
    /// of K/V took 0.77 s at 128k tokens) is a tenth of the link's rate.
    fn parallel_copy(dst: &mut [u8], src: &[u8]) {
        use rayon::prelude::*;
        dst.par_chunks_mut(COPY_SHARE).zip(src.par_chunks(COPY_SHARE)).for_each(|(d, s)| d.copy_from_slice(s));
    }

    pub fn copy_to_host(t: &Tensor, out: &mut [u8]) -> Result<()> {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*storage else { candle_core::bail!("not a CUDA tensor") };
        let stream = cs.device().cuda_stream();
        let elem = t.dtype().size_in_bytes();
        let (start, n) = (layout.start_offset() * elem, t.elem_count() * elem);
        let src = bytes_of(cs)?;
        let (src_ptr, _reading) = src.device_ptr(&stream);
        with_staging(&stream, |bufs| {
            let pieces = n.div_ceil(PIECE);
            let mut copied: Vec<Option<CudaEvent>> = (0..BUFFERS).map(|_| None).collect();
            // Piece i is copied into buffer i % 2 while the host reads piece i - 1 out of the
            // other; an event recorded after each copy says when its buffer holds the piece.
            for i in 0..=pieces {
                if i < pieces {
                    let r = i * PIECE..n.min((i + 1) * PIECE);
                    let host = &mut bufs[i % BUFFERS].as_mut_slice().w()?[..r.len()];
                    // SAFETY: the source range lies inside the tensor's buffer (start + n bytes),
                    // the destination is page-locked and not touched until the event completes.
                    unsafe { result::memcpy_dtoh_async(host, src_ptr + (start + r.start) as u64, stream.cu_stream()) }
                        .w()?;
                    copied[i % BUFFERS] = Some(stream.record_event(None).w()?);
                }
                if i > 0 {
                    let r = (i - 1) * PIECE..n.min(i * PIECE);
                    let b = (i - 1) % BUFFERS;
                    if let Some(done) = copied[b].take() {
                        done.synchronize().w()?;
                    }
                    let len = r.len();
                    parallel_copy(&mut out[r], &bufs[b].as_slice().w()?[..len]);
                }
            }
            Ok(())
        })
    }

    pub fn from_host_bytes(bytes: &[u8], dtype: DType, shape: &[usize], dev: &CudaDevice) -> Result<Tensor> {
        let stream = dev.cuda_stream();
        let elems = shape.iter().product::<usize>();
        macro_rules! upload {
            ($t:ty) => {{
                // SAFETY: every byte is written by the copies below before anything reads it.
                let mut slice = unsafe { dev.alloc::<$t>(elems) }?;
                {
                    let (dst_ptr, _writing) = slice.device_ptr_mut(&stream);
                    with_staging(&stream, |bufs| {
                        let mut copied: Vec<Option<CudaEvent>> = (0..BUFFERS).map(|_| None).collect();
                        for (i, piece) in bytes.chunks(PIECE).enumerate() {
                            let b = i % BUFFERS;
                            // The buffer's previous copy must have left it before it is refilled.
                            if let Some(done) = copied[b].take() {
                                done.synchronize().w()?;
                            }
                            let host = &mut bufs[b].as_mut_slice().w()?[..piece.len()];
                            parallel_copy(host, piece);
                            // SAFETY: the destination range lies inside the new buffer (bytes.len()
                            // bytes, checked by the caller); the source is page-locked and left
                            // alone until the event completes.
                            unsafe {
                                result::memcpy_htod_async(dst_ptr + (i * PIECE) as u64, host, stream.cu_stream())
                            }
                            .w()?;
                            copied[b] = Some(stream.record_event(None).w()?);
                        }
                        // The buffers are this thread's again only once their copies are done.
                        copied.into_iter().flatten().try_for_each(|e| e.synchronize().w())
                    })?;
                }
                candle_core::CudaStorage::wrap_cuda_slice(slice, dev.clone())
            }};
        }
        let storage = match dtype {
            DType::BF16 => upload!(half::bf16),
            DType::F16 => upload!(half::f16),
            DType::F32 => upload!(f32),
            DType::U8 => upload!(u8),
            other => candle_core::bail!("tensors of {other:?} from raw bytes are not supported"),
        };
        Ok(Tensor::from_storage(candle_core::Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false))
    }
}
