//! What the driver says about the device: peak memory in use, sampled while work runs, and the
//! host link's copy rate. Benchmarks report these beside their timings, so a memory figure is
//! measured rather than estimated and a transfer time has its limit next to it.

use candle_core::{Device, Result};

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

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use candle_core::cuda::cudarc::driver::{sys, CudaContext};
    use candle_core::cuda::{CudaDevice, WrapErr};
    use candle_core::Result;

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
}
