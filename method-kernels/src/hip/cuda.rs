//! The launches of method-kernels/cuda/hip.cu: a round's steps (`halve`, `block_max`,
//! `expand`) and the one-launch search over rows read where they lie (`hip_search`).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{sys, CudaEvent, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDType, CudaDevice, DeviceId, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};
use folio_kernels::select::cuda::{tail_ptr, Source};
use folio_kernels::select::Stored;

use folio_kernels::cuda_op::{cuda_storage, CudaOnly, CudaOp1, CudaOp2};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/hip.ptx"));
const MODULE: &str = "folio_blocks";
/// Threads a block of `halve` (a node each) and of `expand` (a position each), and warps a
/// block of `block_max` (WARPS in the kernel, a candidate each).
const HALVE_THREADS: usize = 256;
const WARPS: usize = 4;

fn launch_grid(items: usize, per_block: usize, threads: usize, what: &str) -> Result<LaunchConfig> {
    let Ok(blocks) = u32::try_from(items.div_ceil(per_block).max(1)) else {
        candle_core::bail!("{what}: {items} items are more than one launch holds");
    };
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 })
}

struct Halve {
    keep: Option<Tensor>,
    dims: (usize, usize, usize),
    b: usize,
    first: usize,
    keys: usize,
}

impl CudaOp1 for Halve {
    const NAME: &'static str = "folio-halve";

    fn cuda_fwd(&self, nodes: &CudaStorage, nl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (heads, m, n) = self.dims;
        let dev = nodes.device().clone();
        let ns = nodes.as_cuda_slice::<u32>()?.slice(nl.start_offset()..);
        let keep_guard = self.keep.as_ref().map(|k| k.storage_and_layout());
        let keep = match &keep_guard {
            Some((s, l)) => Some(cuda_storage(s, "halve: keep")?.as_cuda_slice::<u32>()?.slice(l.start_offset()..)),
            None => None,
        };
        let total = heads * 2 * n * (2 + self.b);
        // SAFETY: a thread writes both halves and their positions for each node.
        let out = unsafe { dev.alloc::<u32>(total.max(1))? };
        let cfg = launch_grid(heads * n, HALVE_THREADS, HALVE_THREADS, "halve")?;
        let null: u64 = 0;
        let ints = [heads, m, n, self.b, self.first, self.keys].map(|x| x as i32);
        let func = dev.get_or_load_custom_func("halve", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&ns);
        match &keep {
            Some(k) => b.arg(k),
            None => b.arg(&null),
        };
        b.arg(&out);
        for x in &ints {
            b.arg(x);
        }
        // SAFETY: shapes checked by the caller; keep's indices are < m (the top-k kernel's
        // over 2·(last round's n) = m candidates).
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(total)))
    }
}

pub fn halve(
    nodes: &Tensor,
    keep: Option<&Tensor>,
    dims: (usize, usize, usize),
    b: usize,
    first: usize,
    keys: usize,
) -> Result<(Tensor, Tensor)> {
    let (heads, _, n) = dims;
    if [dims.0, dims.1, dims.2, b, first, keys, heads * 2 * n * b].iter().any(|&x| x > i32::MAX as usize) {
        candle_core::bail!("halve: sizes past the kernel's i32 indices");
    }
    let keep = keep.map(Tensor::contiguous).transpose()?;
    let op = Halve { keep, dims, b, first, keys };
    let both = nodes.contiguous()?.apply_op1_no_bwd(&CudaOnly(op))?;
    let split = heads * 2 * n * 2;
    Ok((
        both.narrow(0, 0, split)?.reshape((heads, 2 * n, 2))?,
        both.narrow(0, split, heads * 2 * n * b)?.reshape((heads, 2 * n * b))?,
    ))
}

struct Expand {
    keep: Tensor,
    dims: (usize, usize, usize),
    b: usize,
    sinks: (usize, usize),
}

impl CudaOp1 for Expand {
    const NAME: &'static str = "folio-expand";

    fn cuda_fwd(&self, nodes: &CudaStorage, nl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (heads, m, n) = self.dims;
        let dev = nodes.device().clone();
        let ns = nodes.as_cuda_slice::<u32>()?.slice(nl.start_offset()..);
        let (ks, kl) = self.keep.storage_and_layout();
        let keep = cuda_storage(&ks, "expand: keep")?.as_cuda_slice::<u32>()?.slice(kl.start_offset()..);
        let s = self.sinks.1 - self.sinks.0 + n * self.b;
        // SAFETY: a thread writes each position.
        let out = unsafe { dev.alloc::<u32>((heads * s).max(1))? };
        let cfg = launch_grid(heads * s, HALVE_THREADS, HALVE_THREADS, "expand")?;
        let ints = [heads, m, n, self.b, self.sinks.0, self.sinks.1].map(|x| x as i32);
        let func = dev.get_or_load_custom_func("expand", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&ns).arg(&keep).arg(&out);
        for x in &ints {
            b.arg(x);
        }
        // SAFETY: shapes checked by the caller; keep's indices are < m (the top-k kernel's
        // over the m halves).
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((heads, s))))
    }
}

pub fn expand(
    nodes: &Tensor,
    keep: &Tensor,
    dims: (usize, usize, usize),
    b: usize,
    sinks: (usize, usize),
) -> Result<Tensor> {
    let (heads, _, n) = dims;
    let s = sinks.1 - sinks.0 + n * b;
    if [dims.0, dims.1, dims.2, b, sinks.1, heads * s].iter().any(|&x| x > i32::MAX as usize) {
        candle_core::bail!("expand: sizes past the kernel's i32 indices");
    }
    let op = Expand { keep: keep.contiguous()?, dims, b, sinks };
    nodes.contiguous()?.apply_op1_no_bwd(&CudaOnly(op))
}

struct BlockMax {
    cand: Tensor,
    dims: (usize, usize, usize, usize),
}

impl CudaOp2 for BlockMax {
    const NAME: &'static str = "folio-block-max";

    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout, k: &CudaStorage, kl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (heads, c, b, d) = self.dims;
        let dev = q.device().clone();
        let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        let (cs, cl) = self.cand.storage_and_layout();
        let cand = cuda_storage(&cs, "block_max: cand")?.as_cuda_slice::<u32>()?.slice(cl.start_offset()..);
        // SAFETY: a warp writes each candidate's score.
        let z = unsafe { dev.alloc::<f32>((heads * c).max(1))? };
        let cfg = launch_grid(heads * c, WARPS, WARPS * 32, "block_max")?;
        let ints = [heads, c, b, d].map(|x| x as i32);
        macro_rules! launch {
            ($t:ty, $name:literal) => {{
                let ks = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
                let func = dev.get_or_load_custom_func($name, MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&qs).arg(&ks).arg(&cand).arg(&z);
                for x in &ints {
                    b.arg(x);
                }
                // SAFETY: shapes checked by the caller.
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        match k.dtype() {
            DType::F32 => launch!(f32, "block_max_f32"),
            DType::BF16 => launch!(half::bf16, "block_max_bf16"),
            other => candle_core::bail!("block_max: keys must be f32 or bf16, not {other:?}"),
        }
        Ok((CudaStorage::wrap_cuda_slice(z, dev), Shape::from((heads, c))))
    }
}

pub fn block_max(q: &Tensor, keys: &Tensor, cand: &Tensor, dims: (usize, usize, usize, usize)) -> Result<Tensor> {
    let op = BlockMax { cand: cand.contiguous()?, dims };
    q.to_dtype(DType::F32)?.contiguous()?.apply_op2_no_bwd(&keys.contiguous()?, &CudaOnly(op))
}

/// Threads a block of `hip_search` (one block a query head; SEARCH_THREADS, its launch bound, in
/// the kernel): a warp scores a candidate, so 16
/// candidates' keys are in flight over the host link at a time, a block's worth of requests
/// enough to keep the link busy with a few dozen heads. Not fewer multiprocessors: two heads a
/// block (14 blocks for 28 heads, the same warps a head) took a 1M-token HiP step on an H200
/// from 10.5 to 16.2 ms — a multiprocessor's reads in flight over the link are what bound the
/// search, not its warps.
const SEARCH_THREADS: u32 = 512;

/// `hip_search`'s shared memory for `n` survivors of heads of `d`: the keys it sorts (2n up to
/// a power of two, 8 bytes each), the candidates' ranges (4n), the nodes' (2n), the
/// survivors' order (n up to a power of two) and the query (d), 4 bytes each — at most 46 KB
/// (2n = 2048, d = 256), under the 48 KB a launch gets without asking.
fn search_shared_bytes(n: usize, d: usize) -> u32 {
    let (p, pn) = ((2 * n).max(1).next_power_of_two(), n.max(1).next_power_of_two());
    (8 * p + 4 * (4 * n + 2 * n + pn + d)) as u32
}

/// HiP's whole block search over rows read where they lie (`hip_search` in select.cu): `q`'s
/// heads (f32, contiguous) each search `rows = (group, n, tail_n, d)`'s keys of head
/// `h / group` as `plan` says; positions past `n` read `tail` (the rows' dtype `dtype`).
struct BlockSearch {
    src: u64,
    scales: u64,
    stored: Stored,
    dtype: DType,
    rows: (usize, usize, usize, usize),
    plan: super::Search,
    /// Launch here after everything queued so far on candle's stream, instead of on it.
    side: Option<Arc<CudaStream>>,
}

impl BlockSearch {
    fn launch(&self, q: &CudaStorage, ql: &Layout, tail: u64) -> Result<(CudaStorage, Shape)> {
        let (group, n, tail_n, d) = self.rows;
        let plan = &self.plan;
        let heads = ql.shape().dims2()?.0;
        let dev = q.device();
        let q_s = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        let kernel = match (self.stored, self.dtype) {
            (Stored::F32, DType::F32) => "hip_search_f32_f32",
            (Stored::F32, DType::BF16) => "hip_search_f32_bf16",
            (Stored::Bf16, DType::F32) => "hip_search_bf16_f32",
            (Stored::Bf16, DType::BF16) => "hip_search_bf16_bf16",
            (Stored::Fp8 { .. }, DType::F32) => "hip_search_fp8_f32",
            (Stored::Fp8 { .. }, DType::BF16) => "hip_search_fp8_bf16",
            (stored, dtype) => {
                candle_core::bail!("block search: rows stored as {stored:?} cannot be read as {dtype:?}")
            }
        };
        let sizes = [group, n, tail_n, d, plan.n, plan.blocks, plan.b, plan.first, plan.lo, plan.rounds()];
        let per_head = plan.picks();
        if sizes.iter().chain([&heads, &(heads * per_head), &(n + tail_n)]).any(|&x| x > i32::MAX as usize) {
            candle_core::bail!("block search: sizes past the kernel's i32 indices");
        }
        // SAFETY: the kernel writes every head's positions.
        let out = unsafe { dev.alloc::<u32>((heads * per_head).max(1))? };
        let Ok(grid) = u32::try_from(heads) else {
            candle_core::bail!("block search: {heads} heads are more than one launch holds");
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (SEARCH_THREADS, 1, 1),
            shared_mem_bytes: search_shared_bytes(plan.n, d),
        };
        let ints = sizes.map(|x| x as i32);
        let f = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
        let mut b = match &self.side {
            Some(side) => {
                // After q, the tail and `out` exist: everything candle's stream queued so far.
                side.join(&dev.cuda_stream()).w()?;
                side.launch_builder(&f)
            }
            None => f.builder(),
        };
        b.arg(&q_s).arg(&self.src).arg(&self.scales).arg(&tail).arg(&out);
        for x in &ints {
            b.arg(x);
        }
        // SAFETY: q holds heads × d f32; src holds heads / group × n rows (and their scales),
        // tail heads / group × tail_n; positions are clamped into those; 2·plan.n and d fit the
        // kernel's shared arrays (checked by HostRows::search_blocks). On the side stream, q,
        // the tail and out outlive the launch in its `Pending`, and nothing reads out before
        // candle's stream has waited for it (`Pending::wait`).
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((heads, per_head))))
    }
}

impl CudaOp1 for BlockSearch {
    const NAME: &'static str = "folio-block-search";

    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> Result<(CudaStorage, Shape)> {
        self.launch(q, ql, 0)
    }
}

impl CudaOp2 for BlockSearch {
    const NAME: &'static str = "folio-block-search-tail";

    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout, tail: &CudaStorage, tl: &Layout) -> Result<(CudaStorage, Shape)> {
        let ptr = tail_ptr(tail, tl, &q.device().cuda_stream(), "block search")?;
        self.launch(q, ql, ptr)
    }
}

/// See [`BlockSearch`]: `q [heads, d]` f32 contiguous on the GPU. With `ahead`, the search
/// goes on the device's side stream and comes back with the [`Pending`] that candle's stream
/// must wait on before it reads the positions.
pub fn search(
    source: Source<'_>,
    tail: Option<&Tensor>,
    q: &Tensor,
    rows: (usize, usize, usize, usize),
    dtype: DType,
    plan: &super::Search,
    ahead: bool,
) -> Result<(Tensor, Option<Pending>)> {
    let candle_core::Device::Cuda(dev) = q.device() else { candle_core::bail!("block search: q must be on the GPU") };
    let side = ahead.then(|| side_stream(dev)).transpose()?;
    let stream = side.clone().unwrap_or_else(|| dev.cuda_stream());
    let (src, scales, stored) = source.address(dtype)?;
    let op = CudaOnly(BlockSearch { src, scales, stored, dtype, rows, plan: *plan, side: side.clone() });
    // Each round reads the keys of 2·n blocks of b per head (the keys past n are the tail's).
    let heads = q.dims2()?.0;
    let keys = heads * plan.rounds() * 2 * plan.n * plan.b;
    let bytes = (keys * folio_kernels::select::cuda::link_row_bytes(stored, rows.3)) as u64;
    let out = folio_kernels::link::paced(dev, &stream, bytes, |_| {
        source.ordered(&stream, || match tail {
            Some(t) => q.apply_op2_no_bwd(t, &op),
            None => q.apply_op1_no_bwd(&op),
        })
    })?;
    let pending = match side {
        Some(side) => Some(Pending::after(q, side, std::iter::once(q.clone()).chain(tail.cloned()).collect())?),
        None => None,
    };
    Ok((out, pending))
}

/// Work queued on the side stream: the event it records when done, candle's stream, and the
/// inputs it reads, kept alive until candle's stream has waited for it (a tensor freed on
/// candle's stream before that could be handed to a new allocation while the side stream
/// still reads it: stream order alone does not cover the side stream).
pub struct Pending {
    done: CudaEvent,
    main: Arc<CudaStream>,
    side: Arc<CudaStream>,
    keep: Vec<Tensor>,
}

impl Pending {
    /// Work queued so far on `side` (candle's stream `t`'s device's being the main one), with
    /// the tensors it reads and writes, kept until candle's stream has waited for it.
    pub fn after(t: &Tensor, side: Arc<CudaStream>, keep: Vec<Tensor>) -> Result<Self> {
        let candle_core::Device::Cuda(dev) = t.device() else { candle_core::bail!("side work: not on the GPU") };
        let done = match side.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)) {
            Ok(done) => done,
            Err(e) => {
                // Nothing will order the frees of `keep` after the work: wait for it here.
                let _ = side.synchronize();
                return Err(e).w();
            }
        };
        Ok(Self { done, main: dev.cuda_stream(), side, keep })
    }

    /// Makes candle's stream wait for the work (the host does not wait).
    pub fn wait(&self) -> Result<()> {
        self.main.wait(&self.done).w()
    }

    /// The stream the work runs on.
    pub fn stream(&self) -> Arc<CudaStream> {
        self.side.clone()
    }
}

/// Where the stream writing a tensor (a search's positions, a step's query) stood when a copy
/// of it was asked for, and the stream the copy runs on ([`super::HostCopy`]).
pub struct Ready {
    done: CudaEvent,
    copy: Arc<CudaStream>,
}

/// Marks the positions written by work queued so far on `producer` (candle's stream if none).
pub fn mark_ready(dev: &CudaDevice, producer: Option<Arc<CudaStream>>) -> Result<Ready> {
    let producer = producer.unwrap_or_else(|| dev.cuda_stream());
    let done = producer.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).w()?;
    Ok(Ready { done, copy: stream_of(dev, &COPY)? })
}

impl Ready {
    /// `t` (contiguous, of `T`'s dtype) copied to the host once the marked work is done.
    pub fn copy<T: CudaDType + DeviceRepr>(&self, t: &Tensor) -> Result<Vec<T>> {
        if !t.is_contiguous() {
            candle_core::bail!("a copy to the host of {:?}: not contiguous", t.dims());
        }
        self.done.synchronize().w()?;
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*storage else {
            candle_core::bail!("a copy to the host of {:?}: not on the GPU", t.dims())
        };
        let from = layout.start_offset();
        let slice = s.as_cuda_slice::<T>()?.slice(from..from + t.elem_count());
        self.copy.clone_dtoh(&slice).w()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Whatever the owner did with the result, what follows on candle's stream — the frees
        // of `keep` and of the output among them — comes after the work.
        let _ = self.main.wait(&self.done);
        self.keep.clear();
    }
}

/// The device's second stream (one per context, made on first use): work on it overlaps what
/// candle's stream runs meanwhile. Its only user is HiP's search a step ahead (a copy of the
/// search's positions for another thread runs on a third, [`COPY`]); the engine
/// turns cudarc's per-allocation events off (`folio_models::cuda_device`), so every use across
/// the two streams is ordered by hand: the side stream joins candle's before a launch, candle's
/// waits on [`Pending`] before it reads what the launch wrote.
fn side_stream(dev: &CudaDevice) -> Result<Arc<CudaStream>> {
    stream_of(dev, &SIDE)
}

/// Streams made on first use, one per device.
type Streams = Mutex<Vec<(DeviceId, Arc<CudaStream>)>>;

static SIDE: Streams = Mutex::new(Vec::new());

/// The stream that copies positions to the host for another thread ([`Ready`]): apart from
/// the side stream, where a later search may be queued by then.
static COPY: Streams = Mutex::new(Vec::new());

/// `dev`'s stream of `streams`, made on first use.
fn stream_of(dev: &CudaDevice, streams: &Streams) -> Result<Arc<CudaStream>> {
    let mut all = streams.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, s)) = all.iter().find(|(id, _)| *id == dev.id()) {
        return Ok(s.clone());
    }
    let made = dev.cuda_stream().context().new_stream().w()?;
    all.push((dev.id(), made.clone()));
    Ok(made)
}
