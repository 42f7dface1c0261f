//! The pacing kernels of kernels/cuda/link.cu and the device words they keep.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDevice, WrapErr};
use candle_core::Result;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/link.ptx"));
const MODULE: &str = "folio_link";
/// Picoseconds in a second: the pace kernel takes the rate as picoseconds a byte.
const PS_PER_S: f64 = 1e12;

/// The link word of each context: when the emulated link is next free (see link.cu), shared
/// by every stream and thread. Kept for the process's life: 8 bytes a GPU.
static LINKS: Mutex<Vec<(usize, CudaSlice<u64>)>> = Mutex::new(Vec::new());

thread_local! {
    /// This thread's counter and reader's start per (context, stream): a thread's own, since
    /// candle's per-thread default stream has one handle in every thread and context. Freed
    /// with the thread (the window decodes on pool threads that come and go).
    static PAIRS: RefCell<HashMap<(usize, usize), CudaSlice<u64>>> = RefCell::new(HashMap::new());
}

/// The device addresses of `stream`'s pair on this thread and its context's link word, made
/// zeroed at first use (and the zeroing waited for, outside the lock: another stream may read
/// the link word next).
fn words(stream: &Arc<CudaStream>) -> Result<(u64, u64)> {
    let ctx = stream.context().cu_ctx() as usize;
    let (pair, made_pair) = PAIRS.with(|pairs| -> Result<(u64, bool)> {
        let mut pairs = pairs.borrow_mut();
        let key = (ctx, stream.cu_stream() as usize);
        let made = !pairs.contains_key(&key);
        if made {
            pairs.insert(key, stream.alloc_zeros::<u64>(2).w()?);
        }
        let at = pairs[&key].device_ptr(stream).0;
        Ok((at, made))
    })?;
    let (link, made_link) = {
        let mut links = LINKS.lock().unwrap_or_else(|e| e.into_inner());
        match links.iter().find(|(c, _)| *c == ctx) {
            Some((_, w)) => (w.device_ptr(stream).0, false),
            None => {
                let w = stream.alloc_zeros::<u64>(1).w()?;
                let at = w.device_ptr(stream).0;
                links.push((ctx, w));
                (at, true)
            }
        }
    };
    if made_pair || made_link {
        stream.synchronize().w()?;
    }
    Ok((pair, link))
}

/// `launch`, a kernel reading `known` bytes of host memory over the link on `stream` (plus what
/// it counts itself at the address it is given: 0 when no rate is set), paced to the emulated
/// rate when one is set ([`super::set_rate`]; a stream other than candle's then first waits
/// for what candle's has queued); see the module docs.
pub fn paced<T>(
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    known: u64,
    launch: impl FnOnce(u64) -> Result<T>,
) -> Result<T> {
    let Some(rate) = super::rate() else { return launch(0) };
    let main = dev.cuda_stream();
    if !Arc::ptr_eq(stream, &main) {
        // A second stream's emulated read starts after what candle's stream queued, as the
        // launches there do (they read what candle's stream wrote).
        stream.join(&main).w()?;
    }
    let (pair, link) = words(stream)?;
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    let stamp = dev.get_or_load_custom_func("link_stamp", MODULE, PTX)?;
    let mut b = stream.launch_builder(&stamp);
    b.arg(&pair);
    // SAFETY: one thread writes the stream's start word, which `words` made.
    unsafe { b.launch(one) }.w()?;
    let out = launch(pair)?;
    let pace = dev.get_or_load_custom_func("link_pace", MODULE, PTX)?;
    let ps_per_byte = PS_PER_S / rate;
    let mut b = stream.launch_builder(&pace);
    b.arg(&pair).arg(&link).arg(&known).arg(&ps_per_byte);
    // SAFETY: one thread reads and writes the words `words` made.
    unsafe { b.launch(one) }.w()?;
    Ok(out)
}
