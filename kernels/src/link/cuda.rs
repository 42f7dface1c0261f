//! The pacing kernels of kernels/cuda/link.cu and the device words they keep.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDevice, WrapErr};
use candle_core::Result;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/link.ptx"));
const MODULE: &str = "folio_link";
/// Picoseconds in a second: the pace kernel takes the rate as picoseconds a byte.
const PS_PER_S: f64 = 1e12;

/// Device words: per (context, stream, thread) its counter and reader's start, per context when
/// the link is next free (see link.cu). Kept for the process's life: a few bytes each. The
/// thread is in the key because candle's per-thread default stream has one handle in every
/// thread and context.
struct Words {
    streams: HashMap<(usize, usize, std::thread::ThreadId), CudaSlice<u64>>,
    links: HashMap<usize, CudaSlice<u64>>,
}

static WORDS: Mutex<Option<Words>> = Mutex::new(None);

/// The device addresses of `stream`'s pair and its context's link word, made zeroed at first
/// use (and the zeroing waited for: another stream may read the link word next).
fn words(stream: &Arc<CudaStream>) -> Result<(u64, u64)> {
    let mut all = WORDS.lock().unwrap_or_else(|e| e.into_inner());
    let all = all.get_or_insert_with(|| Words { streams: HashMap::new(), links: HashMap::new() });
    let ctx = stream.context().cu_ctx() as usize;
    let key = (ctx, stream.cu_stream() as usize, std::thread::current().id());
    use std::collections::hash_map::Entry;
    let mut made = false;
    let mut zeroed = |words: usize| -> Result<CudaSlice<u64>> {
        made = true;
        stream.alloc_zeros::<u64>(words).w()
    };
    let pair = match all.streams.entry(key) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(zeroed(2)?),
    }
    .device_ptr(stream)
    .0;
    let link = match all.links.entry(ctx) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(zeroed(1)?),
    }
    .device_ptr(stream)
    .0;
    if made {
        stream.synchronize().w()?;
    }
    Ok((pair, link))
}

/// `launch`, a kernel reading `known` bytes of host memory over the link on `stream` (plus what
/// it counts itself at the address it is given: 0 when no rate is set), paced to the emulated
/// rate when one is set ([`super::set_rate`]); see the module docs.
pub fn paced<T>(
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    known: u64,
    launch: impl FnOnce(u64) -> Result<T>,
) -> Result<T> {
    let Some(rate) = super::rate() else { return launch(0) };
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
