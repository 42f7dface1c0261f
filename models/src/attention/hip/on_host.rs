//! HiP's search a step ahead on the CPU, for a GPU's step over keys in host memory.
//!
//! Why: the search reads scattered key rows, a few hundred a head each round; from a GPU
//! those reads cross the host link beside the step and slowed it by a third at a million
//! tokens (folio_method_kernels::hip::host says by how much). Here the step's query (and the
//! rows written since the context was saved) come to the host once the device has computed
//! them — an event marks the point, a thread of the search's own waits for it, the host
//! thread that queues the step does not — and the methods' CPU pool searches every query head
//! over the saved keys where they lie. The positions cross to the device when the next step takes the mask
//! up, as a queued GPU search's are waited for then.
//!
//! Which side searches depends on the host link ([`search_on_cpu`]): on an H200 at a million
//! tokens the GPU's search made a step 11.27 ms against the CPU's 11.79 over its 55 GB/s link,
//! where the CPU's work slowed the thread that queues the step; over a PCIe 4.0 link (25 GB/s,
//! emulated) the CPU's made it 12.07 against 13.95 (docs/performance.md).
//!
//! A search on the CPU holds a clone of the tier's host rows (their memory is reference
//! counted), so a tier dropped mid-search does not free the rows under it.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use candle_core::{DType, Device, Tensor};
use folio_kernels::select::HostRows;
use folio_method_kernels::hip::{host, Found, HostCopy, Search};
use rayon::prelude::*;

use super::host_pool;
use crate::error::{Error, Result};
use crate::kv_cache::PositionsLater;

/// The host link's rate below which the automatic setting searches on the CPU: between the
/// two measured ends, 25 GB/s (the CPU's search ahead by 13%) and 55 GB/s (the GPU's by 4%).
const CPU_SEARCH_BELOW: f64 = 40e9;

/// Bytes of the one copy that measures the host link (a few milliseconds at PCIe 4.0 rates).
const LINK_PROBE_BYTES: usize = 64 << 20;

/// The most rows written since the context was saved that a search on the CPU takes: it copies
/// every one to the host (in f32, 2 MiB for a 7B layer's 4 KV heads at this count) where the
/// GPU's search reads only the few it scores; past this the GPU searches.
pub(super) const MAX_TAIL_ROWS: usize = 1024;

/// Whether a search a step ahead runs on the CPU, for the `cpu_search` setting: 0 never, 1
/// always, otherwise (automatic) where the host link is slower than [`CPU_SEARCH_BELOW`] — the
/// emulated link (`--link-gbps`) or the one measured on `device` once a process, the slower
/// of the two; on the CPU, where there is no link, always — but never where the tier
/// `reads_ahead` (the file tier: its read of a mask's rows from disk starts when the search
/// ends, and the GPU's ends sooner; at 1M tokens within 28 GiB a step took 48.1 and 51.5 ms
/// with the CPU's search against 33.6 with the GPU's). Without a device (the cost model) the
/// rate is what has been measured or emulated so far, none meaning the GPU's search.
pub(super) fn search_on_cpu(setting: usize, device: Option<&Device>, reads_ahead: bool) -> bool {
    static MEASURED: OnceLock<Option<f64>> = OnceLock::new();
    match (setting, device) {
        (0, _) => false,
        (1, _) => true,
        _ if reads_ahead => false,
        (_, Some(Device::Cpu)) => true,
        _ => {
            let measured = match device {
                Some(device) => *MEASURED.get_or_init(|| {
                    let rate = folio_runtime::device::host_to_device_rate(device, LINK_PROBE_BYTES)
                        .inspect_err(|e| tracing::warn!(error = %e, "hip: the host link could not be measured"))
                        .ok();
                    let emulated = folio_kernels::link::rate();
                    tracing::info!(
                        measured_gbps = rate.map(|r| r / 1e9),
                        emulated_gbps = emulated.map(|r| r / 1e9),
                        below_gbps = CPU_SEARCH_BELOW / 1e9,
                        "hip: the host link, for where the search runs"
                    );
                    rate
                }),
                None => MEASURED.get().copied().flatten(),
            };
            let rate = match (measured, folio_kernels::link::rate()) {
                (Some(m), Some(emulated)) => Some(m.min(emulated)),
                (m, emulated) => m.or(emulated),
            };
            rate.is_some_and(|r| r < CPU_SEARCH_BELOW)
        }
    }
}

/// A layer's next mask's positions, searched on the device or on the host.
pub(super) enum Searched {
    Device(Found),
    Host(HostSearch),
}

impl Searched {
    /// `[heads, picks]`, known before the search ends.
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Self::Device(found) => found.dims()?,
            Self::Host(search) => search.dims,
        })
    }

    /// The positions on `device`, for work queued on its stream from now on (waits for a
    /// search on the host).
    pub fn positions(self, device: &Device) -> Result<Tensor> {
        match self {
            Self::Device(found) => Ok(found.positions()?),
            Self::Host(search) => {
                let positions = search.wait()?;
                Ok(Tensor::from_slice(positions.as_slice(), search.dims, device)?)
            }
        }
    }

    /// The positions for another thread (a read-ahead of the rows they name), row-major.
    pub fn host_copy(&self) -> Result<PositionsLater> {
        Ok(match self {
            Self::Device(found) => {
                let copy = found.host_copy()?;
                Box::new(move || copy.get())
            }
            Self::Host(search) => {
                let search = search.clone();
                Box::new(move || search.wait().map(|p| p.to_vec()).map_err(candle_core::Error::wrap))
            }
        })
    }
}

/// A search running on the host: `[heads, picks]` and where its positions land (a clone waits
/// for the same search).
#[derive(Clone)]
pub(super) struct HostSearch {
    dims: (usize, usize),
    slot: Arc<Slot>,
}

/// The positions once searched, or why not (an error is told to every waiter).
#[derive(Default)]
struct Slot {
    done: Mutex<Option<std::result::Result<Arc<Vec<u32>>, String>>>,
    ready: Condvar,
}

impl HostSearch {
    /// Starts a search of `plan` for every query head of `q [heads, d]` (KV head `h / group`
    /// each) over `keys` and `tail [kv heads, t, d]` (the rows past the saved ones, on the
    /// device): a thread of its own waits for the device to have computed `q` and `tail` and
    /// copies them, then the methods' CPU pool searches a head a task. The wait is not on a
    /// pool thread: one waiting inside its own search's tasks could pick up the next search's
    /// job from the pool's queue and block there on a later layer's query.
    pub fn start(keys: &HostRows, q: &Tensor, tail: Option<&Tensor>, group: usize, plan: Search) -> Result<Self> {
        plan.check()?;
        let heads = q.dim(0)?;
        if group == 0 || heads != keys.heads() * group || q.dim(1)? != keys.dim() {
            return Err(Error::Invalid(format!(
                "hip: searching on the host for q {:?} with group {group} over {} KV heads of {}",
                q.dims(),
                keys.heads(),
                keys.dim()
            )));
        }
        let q_copy = HostCopy::of(&q.to_dtype(DType::F32)?.contiguous()?)?;
        let tail_copy = tail.map(|t| HostCopy::of(&t.to_dtype(DType::F32)?.contiguous()?)).transpose()?;
        let slot = Arc::new(Slot::default());
        let (keys, out) = (keys.clone(), slot.clone());
        let job = move || {
            let searched =
                std::panic::catch_unwind(AssertUnwindSafe(|| search(&keys, q_copy, tail_copy, group, &plan)))
                    .unwrap_or_else(|_| Err(Error::Invalid("hip: the search on the host panicked".into())));
            *out.done.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(searched.map(Arc::new).map_err(|e| e.to_string()));
            out.ready.notify_all();
        };
        std::thread::Builder::new()
            .name("folio-hip-search".into())
            .spawn(job)
            .map_err(|e| Error::Invalid(format!("hip: no thread for the search on the host: {e}")))?;
        Ok(Self { dims: (heads, plan.picks()), slot })
    }

    /// The positions, row-major, once searched.
    fn wait(&self) -> Result<Arc<Vec<u32>>> {
        let mut done = self.slot.done.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*done {
                Some(Ok(positions)) => return Ok(positions.clone()),
                Some(Err(e)) => return Err(Error::Invalid(e.clone())),
                None => done = self.slot.ready.wait(done).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }
}

/// Every query head's search, a head a task on the methods' CPU pool, once the query and the
/// tail have reached the host (this thread waits for them).
fn search(keys: &HostRows, q: HostCopy, tail: Option<HostCopy>, group: usize, plan: &Search) -> Result<Vec<u32>> {
    let q = q.get_f32()?;
    let tail = tail.map(HostCopy::get_f32).transpose()?.unwrap_or_default();
    let view = keys.host()?;
    let d = view.dim();
    let per_head = tail.len() / view.heads();
    let bf16 = host::rounds_to_bf16(keys.dtype(), keys.stored());
    let picks: Vec<Vec<u32>> = host_pool::install(|| {
        q.par_chunks(d)
            .enumerate()
            .map(|(h, q)| {
                let kvh = h / group;
                let tail = &tail[kvh * per_head..(kvh + 1) * per_head];
                host::search_head(&host::HeadKeys { rows: &view, kvh, tail, bf16 }, q, plan)
            })
            .collect()
    });
    Ok(picks.concat())
}
