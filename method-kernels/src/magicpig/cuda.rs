//! Launching MagicPIG's kernels (method-kernels/cuda/magicpig.cu): the walk of a layer's LSH tables, the
//! report of the CPU's heads' picks into mapped host memory, and the importance-weighted
//! attention over the GPU's heads' picks. Beside the sampler that calls them (`super`), apart
//! from the generic select kernels.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{sys, CudaEvent, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

use folio_kernels::cuda_op::{CudaOnly, CudaOp2, CudaOp3};
use folio_kernels::select::cuda::{Mapped, Source};
use folio_kernels::select::Stored;

const LSH_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/magicpig.ptx"));
const LSH_MODULE: &str = "folio_lsh";
/// Threads of a walk block (WALK_THREADS in magicpig.cu) and warps of an attention block
/// (ATTEND_WARPS).
const WALK_THREADS: u32 = 512;
const ATTEND_WARPS: usize = 8;
/// Attention blocks per query head: with 8 warps each, 64 picks in flight a head (each two rows
/// over the host link), ~1,150 for the 18 GPU heads of a 28-head layer — and 64 partials a head
/// for the merge. More in flight did not help (four picks at a time a warp read at the same
/// rate, measured when each warp read a contiguous share). What binds scattered 256-byte reads
/// of host memory is where they fall: the warps take a head's picks strided, so that they read
/// neighbouring positions together (magicpig.cu).
const ATTEND_BLOCKS: usize = 8;

/// Where `t` (u32, on a GPU) begins in device memory.
pub(super) fn device_address(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*storage else { candle_core::bail!("lsh tables: not on the GPU") };
    let stream = cs.device().cuda_stream();
    let slice = cs.as_cuda_slice::<u32>()?.slice(layout.start_offset()..);
    let (at, _sync) = slice.device_ptr(&stream);
    Ok(at)
}

/// MagicPIG's table walk (`lsh_walk`): `codes [heads, tables]` u32 of query heads `h0..h0 +
/// heads`, `addresses [2 · kv_heads]` the lists' device addresses; `(n, bits, group, h0, first,
/// skip)`. The sample's buffer (see
/// `lsh::Sample`).
pub(super) fn lsh_walk(
    codes: &Tensor,
    addresses: &Tensor,
    dims: (usize, usize, usize, usize, usize, usize),
) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = codes.device() else { candle_core::bail!("lsh walk: codes not on the GPU") };
    // The walk counts the bytes of the runs it reads (only the device knows them).
    folio_kernels::link::paced(dev, &dev.cuda_stream(), 0, |link_bytes| {
        codes.apply_op2_no_bwd(addresses, &CudaOnly(LshWalk { dims, link_bytes }))
    })
}

struct LshWalk {
    dims: (usize, usize, usize, usize, usize, usize),
    /// Where the walk adds the bytes it read over the link (0: not counted).
    link_bytes: u64,
}

impl CudaOp2 for LshWalk {
    const NAME: &'static str = "folio-lsh-walk";

    fn cuda_fwd(
        &self,
        codes: &CudaStorage,
        cl: &Layout,
        at: &CudaStorage,
        al: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, bits, group, h0, first, skip) = self.dims;
        let (heads, tables) = cl.shape().dims2()?;
        let segs = super::segments(n);
        let dev = codes.device();
        let codes_s = codes.as_cuda_slice::<u32>()?.slice(cl.start_offset()..);
        let at_s = at.as_cuda_slice::<i64>()?.slice(al.start_offset()..);
        let cap = heads * segs * super::SEGMENT_KEYS;
        // SAFETY: the kernel writes every count, and each slot's picks up to its count (only
        // those are read).
        let out = unsafe { dev.alloc::<u32>(cap + heads * segs)? };
        {
            let (picks, counts) = (out.slice(..cap), out.slice(cap..));
            let kvh = al.shape().elem_count() / 2;
            let (members, starts) = (at_s.slice(..kvh), at_s.slice(kvh..));
            let ints = [n, segs, tables, bits, group, h0, first, skip.min(n)];
            if ints.iter().any(|&x| x > i32::MAX as usize) {
                candle_core::bail!("lsh walk: sizes past the kernel's i32 arguments");
            }
            let ints = ints.map(|x| x as i32);
            let f = dev.get_or_load_custom_func("lsh_walk", LSH_MODULE, LSH_PTX)?;
            let mut b = f.builder();
            b.arg(&members).arg(&starts).arg(&codes_s).arg(&picks).arg(&counts);
            for x in &ints {
                b.arg(x);
            }
            b.arg(&self.link_bytes);
            let cfg = LaunchConfig {
                grid_dim: (segs as u32, heads as u32, 1),
                block_dim: (WALK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: codes hold heads × tables u32 (tables ≤ MAX_TABLES, segs ≤ MAX_SEGS:
            // `lsh::Tables::new`), and heads h0.. walk KV heads below kv_heads (`lsh::Tables::walk`);
            // the members are registered, the starts copied to the device, and both hold what
            // the tables say.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(cap + heads * segs)))
    }
}

/// Words of the first page-locked buffer a device reports walks into (16 KB); a report that
/// needs more — the first of a million-key layer's, a few hundred KB at a 2048-token budget —
/// reports again into one of twice its need, which is kept: one report grows it for good.
const REPORT_WORDS: usize = 1 << 12;

/// Threads of a report block (REPORT_THREADS in method-kernels/cuda/magicpig.cu).
const REPORT_THREADS: u32 = 256;

/// The page-locked buffer each GPU reports walks into, kept between reports (page-locking
/// megabytes afresh would take milliseconds a layer). A report takes it out for its life and
/// puts it back once read, so that two reports at once never share one. Kept by the GPU's
/// ordinal, not candle's device id: every device made on a GPU shares its primary context,
/// where the buffer is mapped, so a device made again (the engine reloaded) reuses it rather
/// than leaving one behind.
static REPORTS: Mutex<Vec<(usize, Mapped)>> = Mutex::new(Vec::new());

/// A report buffer of at least `words` u32 for `dev`: the one kept, else a new one.
fn report_buffer(dev: &CudaDevice, words: usize) -> Result<Mapped> {
    let gpu = dev.cuda_stream().context().ordinal();
    let kept = {
        let mut all = REPORTS.lock().unwrap_or_else(|e| e.into_inner());
        all.iter().position(|(at, _)| *at == gpu).map(|i| all.swap_remove(i).1)
    };
    match kept {
        Some(m) if m.buf.len() >= 4 * words => Ok(m),
        _ => Mapped::new(dev, 4 * words.max(REPORT_WORDS)),
    }
}

/// What the host needs of a walk (`lsh_report`), queued on candle's stream into a page-locked
/// buffer mapped into the device: query heads `h0..h0 + heads`'s counts, `also`'s words, their
/// picks (see `lsh::Report`). The host reads it once the event recorded after the kernel is
/// done ([`LshReport::wait`]); what candle's stream queues after it runs on meanwhile.
pub(super) struct LshReport {
    dev: CudaDevice,
    sample: Tensor,
    also: Option<Tensor>,
    /// `(all, segs, h0, heads)`: the sample's heads and segments, the range.
    dims: (usize, usize, usize, usize),
    /// The buffer and the event after the kernel that writes it, until read.
    queued: Option<(Mapped, CudaEvent)>,
}

/// See [`LshReport`]: `sample` a walk's buffer of `all` heads over `segs` segments, `also` u32
/// (contiguous) on the same device.
pub(super) fn lsh_report(
    sample: &Tensor,
    also: Option<&Tensor>,
    dims: (usize, usize, usize, usize),
) -> Result<LshReport> {
    let candle_core::Device::Cuda(dev) = sample.device() else { candle_core::bail!("lsh report: not on the GPU") };
    let mut report = LshReport { dev: dev.clone(), sample: sample.clone(), also: also.cloned(), dims, queued: None };
    report.queue(REPORT_WORDS)?;
    Ok(report)
}

impl LshReport {
    /// Words before the picks: the range's counts and `also`'s.
    fn lead(&self) -> usize {
        self.dims.1 * self.dims.3 + self.also.as_ref().map_or(0, |a| a.elem_count())
    }

    /// Queues the kernel into a buffer of at least `words` u32, and the event after it.
    fn queue(&mut self, words: usize) -> Result<()> {
        let (all, segs, h0, heads) = self.dims;
        let cap = all * segs * super::SEGMENT_KEYS;
        let (storage, layout) = self.sample.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*storage else { candle_core::bail!("lsh report: not on the GPU") };
        let n_also = self.also.as_ref().map_or(0, |a| a.elem_count());
        if layout.shape().elem_count() != cap + all * segs
            || !layout.is_contiguous()
            || h0 + heads > all
            || heads * segs > i32::MAX as usize
            || n_also > i32::MAX as usize
        {
            candle_core::bail!("lsh report: heads {h0}..{} of {all} over {segs} segments", h0 + heads);
        }
        let buf = cs.as_cuda_slice::<u32>()?.slice(layout.start_offset()..);
        let (picks, counts) = (buf.slice(..cap), buf.slice(cap..));
        let also = self.also.as_ref().map(|t| t.storage_and_layout());
        let also_s = match &also {
            Some((st, l)) => {
                let candle_core::Storage::Cuda(a) = &**st else {
                    candle_core::bail!("lsh report: also not on the GPU")
                };
                if !l.is_contiguous() {
                    candle_core::bail!("lsh report: also must be contiguous");
                }
                Some(a.as_cuda_slice::<u32>()?.slice(l.start_offset()..))
            }
            None => None,
        };
        let staging = report_buffer(&self.dev, words.max(self.lead()))?;
        let words = (staging.buf.len() / 4) as u64;
        let ints = [segs, h0, heads, n_also].map(|x| x as i32);
        let f = self.dev.get_or_load_custom_func("lsh_report", LSH_MODULE, LSH_PTX)?;
        let mut b = f.builder();
        b.arg(&picks).arg(&counts);
        match &also_s {
            Some(a) => b.arg(a),
            None => b.arg(&counts),
        };
        b.arg(&staging.ptr);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&words);
        let cfg = LaunchConfig {
            grid_dim: (segs as u32, heads.max(1) as u32, 1),
            block_dim: (REPORT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the sample holds `all` heads' slots and counts (checked above), `also` n_also
        // u32; the kernel writes the staging buffer below `words` only, which no one else
        // touches until the event below is waited on (`wait`, or the drop).
        unsafe { b.launch(cfg) }.w()?;
        let done = match self.dev.cuda_stream().record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)) {
            Ok(done) => done,
            Err(e) => {
                // No event to wait on: the buffer is released (its drop waits for the context).
                drop(staging);
                return Err(e).w();
            }
        };
        self.queued = Some((staging, done));
        Ok(())
    }

    /// The report's words once the device has written them — the range's counts, `also`, the
    /// picks — waiting for the report alone; reported again into a larger buffer when the picks
    /// did not fit, which waits for the whole queue (the report goes after what was queued
    /// since, and the small buffer's drop synchronises): a process's first reports, and any
    /// that needs more than twice the largest before it.
    pub(super) fn wait(mut self) -> Result<Vec<u32>> {
        let (lead, slots) = (self.lead(), self.dims.1 * self.dims.3);
        // Twice at most: the second buffer holds twice what the first report found.
        for _ in 0..2 {
            let Some((staging, done)) = self.queued.take() else { candle_core::bail!("lsh report: nothing queued") };
            // A failed wait leaves the device maybe writing: the buffer's drop waits for the
            // context, and it is not kept.
            done.synchronize().w()?;
            let read = Self::read(&staging, lead, slots);
            keep_report_buffer(&self.dev, staging);
            match read? {
                Ok(words) => return Ok(words),
                Err(need) => self.queue(2 * need)?,
            }
        }
        candle_core::bail!("lsh report: the picks did not fit a buffer of twice their size")
    }

    /// The `lead` words and the picks after them, or the words the report needs when the
    /// picks (the sum of the first `slots` words) did not fit `staging`.
    fn read(staging: &Mapped, lead: usize, slots: usize) -> Result<std::result::Result<Vec<u32>, usize>> {
        let counts = staging.words(slots)?;
        let need = lead + counts.iter().map(|&c| c as usize).sum::<usize>();
        Ok(if need <= staging.buf.len() / 4 { Ok(staging.words(need)?) } else { Err(need) })
    }
}

/// Puts a report buffer back for `dev`'s GPU, once nothing writes it.
fn keep_report_buffer(dev: &CudaDevice, staging: Mapped) {
    let gpu = dev.cuda_stream().context().ordinal();
    REPORTS.lock().unwrap_or_else(|e| e.into_inner()).push((gpu, staging));
}

impl Drop for LshReport {
    fn drop(&mut self) {
        // Dropped unread (an error on the way): the buffer is kept only once the device is done
        // writing it; failing that its own drop waits for the context.
        if let Some((staging, done)) = self.queued.take() {
            if done.synchronize().is_ok() {
                keep_report_buffer(&self.dev, staging);
            }
        }
    }
}

/// The attention over a walk's sample (`lsh_attend_*`): `query [heads, d + 2]` f32, the
/// sample's buffer, K and V where they lie (each read as stored: f32, bf16, or fp8 codes with
/// a scale a row), the weights
/// (bias table, then norms); `dims = (heads, sampled, segments, d, rows, group, first, n,
/// steps)`: the query heads are the first `heads` of the `sampled` the buffer holds.
/// `(out [heads, d], lse [heads])` f32.
pub(super) fn lsh_attend(
    query: &Tensor,
    sample: &Tensor,
    (k, v): (Source<'_>, Source<'_>),
    (k_dtype, v_dtype): (DType, DType),
    weights: &Tensor,
    dims: (usize, usize, usize, usize, usize, usize, usize, usize, usize),
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let candle_core::Device::Cuda(dev) = query.device() else { candle_core::bail!("lsh attend: query not on the GPU") };
    let stream = dev.cuda_stream();
    let ((k_src, k_scales, k_stored), (v_src, v_scales, v_stored)) = (k.address(k_dtype)?, v.address(v_dtype)?);
    let stored = match (k_stored, v_stored) {
        (Stored::Bf16, Stored::Bf16) => Stored::Bf16,
        (Stored::F32, Stored::F32) => Stored::F32,
        (Stored::Fp8 { scales }, Stored::Fp8 { .. }) => Stored::Fp8 { scales },
        other => {
            candle_core::bail!("lsh attend: K and V stored as {other:?} (f32, bf16 or fp8, both alike, on the GPU)")
        }
    };
    let (heads, d) = (dims.0, dims.3);
    let weights = weights.contiguous()?;
    // The attention counts the bytes of the sample's rows it reads (only the device knows them).
    let both = folio_kernels::link::paced(dev, &stream, 0, |link_bytes| {
        let op =
            CudaOnly(LshAttend { src: (k_src, v_src), scales: (k_scales, v_scales), stored, dims, scale, link_bytes });
        k.ordered(&stream, || v.ordered(&stream, || query.apply_op3_no_bwd(sample, &weights, &op)))
    })?;
    Ok((both.narrow(0, 0, heads * d)?.reshape((heads, d))?, both.narrow(0, heads * d, heads)?))
}

struct LshAttend {
    src: (u64, u64),
    /// K's and V's per-row scales (fp8 rows; 0 otherwise).
    scales: (u64, u64),
    stored: Stored,
    dims: (usize, usize, usize, usize, usize, usize, usize, usize, usize),
    scale: f32,
    /// Where the attention adds the bytes it read over the link (0: not counted).
    link_bytes: u64,
}

impl CudaOp3 for LshAttend {
    const NAME: &'static str = "folio-lsh-attend";

    fn cuda_fwd(&self, [(q, ql), (s, sl), (w, wl)]: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)> {
        let (heads, sampled, segs, d, rows, group, first, n, steps) = self.dims;
        let dev = q.device();
        let q_s = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        let s_s = s.as_cuda_slice::<u32>()?.slice(sl.start_offset()..);
        let w_s = w.as_cuda_slice::<f32>()?.slice(wl.start_offset()..);
        let chunks = ATTEND_BLOCKS * ATTEND_WARPS;
        // SAFETY: every warp writes its partial, empty or not.
        let part = unsafe { dev.alloc::<f32>(heads * chunks * (d + 2))? };
        let kernel = match self.stored {
            Stored::Bf16 => "lsh_attend_bf16",
            Stored::Fp8 { .. } => "lsh_attend_fp8",
            Stored::F32 => "lsh_attend_f32",
        };
        let ints = [sampled, segs, d, rows, group, first, n, steps];
        if ints.iter().any(|&x| x > i32::MAX as usize) || heads > sampled {
            candle_core::bail!("lsh attend: sizes past the kernel's i32 arguments, or more heads than sampled");
        }
        let ints = ints.map(|x| x as i32);
        let f = dev.get_or_load_custom_func(kernel, LSH_MODULE, LSH_PTX)?;
        let mut b = f.builder();
        b.arg(&self.src.0).arg(&self.src.1).arg(&self.scales.0).arg(&self.scales.1);
        b.arg(&q_s).arg(&s_s).arg(&w_s).arg(&part);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&self.scale).arg(&self.link_bytes);
        let cfg = LaunchConfig {
            grid_dim: (ATTEND_BLOCKS as u32, heads as u32, 1),
            block_dim: (32 * ATTEND_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the sample's positions are first..first + n ≤ rows (checked by `lsh::attend`)
        // of heads / group KV heads of d values; query holds heads × (d + 2) f32, the weights
        // steps + 1 + kv_heads × n.
        unsafe { b.launch(cfg) }.w()?;
        folio_kernels::sparse::merge_partials(dev, part, heads, chunks, d)
    }
}
