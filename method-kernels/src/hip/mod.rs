//! The steps of a hierarchical top-k search over blocks of keys (HiP's mask search), for every
//! query head at once: [`halve`] splits each kept node (a range of blocks) in two and gives the
//! key positions of each half's representative block; [`block_max`] scores each half by its
//! best key. A caller gathers the keys at those positions (from wherever they live) and keeps
//! the best halves with the top-k kernel, round after round; [`expand`] turns the last round's
//! kept blocks into the key positions a head reads, on the device, so that a search never waits
//! for the host.
//!
//! Why kernels: written with candle's elementwise ops, a round took about thirty launches
//! (floors, halvings, concatenations, clamps, a matmul, a mask) and the search about 10 ms of
//! host time per layer at a million tokens on an H100, most of a HiP decode step; these are two
//! launches a round. Nodes and positions are u32 (block indices and positions are integers; the
//! candle version carried them in f32).
//!
//! References: [`reference::halve`], [`reference::block_max`] and [`reference::expand`] over
//! plain slices, which the CPU runs and the tests hold the CUDA kernels (method-kernels/cuda/hip.cu)
//! to.
//!
//! A whole search ([`Search`]) runs round by round ([`search_by_rounds`]: these steps, with
//! the caller's gather of each round's keys), or in one launch where the keys are rows the
//! select kernels read where they lie ([`search_host`]: the
//! `hip_search` kernel of method-kernels/cuda/hip.cu, the same rounds inside one block per head,
//! which the tests hold to [`search_by_rounds`] position for position), or a head at a time on
//! the CPU over the rows where they lie ([`host::search_head`], held to [`search_by_rounds`] on
//! integer keys), the step's query brought to the host by a [`HostCopy`].

use candle_core::{DType, Result, Tensor};
use folio_kernels::select::HostRows;
#[cfg(feature = "cuda")]
use folio_kernels::select::{Side, SideWork};
use folio_kernels::Positions;

/// The plain-slice definitions.
pub mod reference {
    /// `nodes [heads, m, 2]` (ranges `[f, l)` of blocks) and `keep [heads, n]` (which nodes
    /// this round halves; all `m` in order without it) to `(cand [heads, 2n, 2], pos [heads,
    /// 2n, b])`: node `j`'s halves `[f, mid)`, `[mid, l)` (`mid = f + (l − f) / 2`) are
    /// candidates `j` and `n + j`, each represented by its middle block `rep` whose `b` keys
    /// sit at `first + min(rep·b + o, min(rep·b + b, keys) − 1)`.
    #[allow(clippy::too_many_arguments)]
    pub fn halve(
        nodes: &[u32],
        keep: Option<&[u32]>,
        (heads, m, n): (usize, usize, usize),
        b: usize,
        first: usize,
        keys: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        let (mut cand, mut pos) = (vec![0u32; heads * 2 * n * 2], vec![0u32; heads * 2 * n * b]);
        for h in 0..heads {
            for j in 0..n {
                let src = keep.map_or(j, |k| k[h * n + j] as usize);
                let (f, l) = (nodes[(h * m + src) * 2], nodes[(h * m + src) * 2 + 1]);
                let mid = f + (l - f) / 2;
                for (side, (lo, hi, rep)) in
                    [(f, mid, f + (mid - f) / 2), (mid, l, mid + (l - mid) / 2)].into_iter().enumerate()
                {
                    let c = h * 2 * n + side * n + j;
                    cand[c * 2] = lo;
                    cand[c * 2 + 1] = hi;
                    let start = rep as usize * b;
                    let last = (start + b).min(keys) - 1;
                    for o in 0..b {
                        pos[c * b + o] = ((start + o).min(last) + first) as u32;
                    }
                }
            }
        }
        (cand, pos)
    }

    /// Each candidate's largest `q·k` over its `b` keys (`keys [heads, c·b, d]`), `−∞` for an
    /// empty one (`cand[.., 1] ≤ cand[.., 0]`): `[heads, c]`.
    pub fn block_max(
        q: &[f32],
        keys: &[f32],
        cand: &[u32],
        (heads, c, b, d): (usize, usize, usize, usize),
    ) -> Vec<f32> {
        (0..heads * c)
            .map(|w| {
                if cand[w * 2 + 1] <= cand[w * 2] {
                    return f32::NEG_INFINITY;
                }
                let h = w / c;
                (0..b)
                    .map(|o| {
                        let row = &keys[(w * b + o) * d..][..d];
                        row.iter().zip(&q[h * d..][..d]).map(|(k, q)| *k as f64 * *q as f64).sum::<f64>() as f32
                    })
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect()
    }

    /// The key positions each head reads after a search: `nodes [heads, m, 2]` (the last
    /// round's halves) and `keep [heads, n]` (the kept ones) to `[heads, (first − lo) + n·b]`:
    /// the sinks `lo..first`, then the `b` keys `first + f·b + o` of each kept node's first
    /// block `f`, in `keep`'s order. Every block is whole: the caller's region is a multiple of
    /// `b` keys long.
    pub fn expand(
        nodes: &[u32],
        keep: &[u32],
        (heads, m, n): (usize, usize, usize),
        b: usize,
        sinks: (usize, usize),
    ) -> Vec<u32> {
        let (lo, first) = sinks;
        let mut pos = Vec::with_capacity(heads * (first - lo + n * b));
        for h in 0..heads {
            pos.extend((lo..first).map(|p| p as u32));
            for &src in &keep[h * n..(h + 1) * n] {
                let f = nodes[(h * m + src as usize) * 2] as usize;
                pos.extend((0..b).map(|o| (first + f * b + o) as u32));
            }
        }
        pos
    }
}

/// A whole search's sizes: keep the best `n` of `blocks` blocks of `b` keys, the searched
/// region starting at key `first`; the sinks `lo..first` come before it in every head's
/// positions. A search needs more blocks than survivors (`blocks > n ≥ 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Search {
    pub n: usize,
    pub blocks: usize,
    pub b: usize,
    pub first: usize,
    pub lo: usize,
}

impl Search {
    /// Refuses a search with nothing to prune or no keys.
    pub fn check(&self) -> Result<()> {
        if self.n == 0 || self.blocks <= self.n || self.b == 0 || self.lo > self.first {
            candle_core::bail!("block search: {self:?} (needs blocks > n ≥ 1, b ≥ 1, lo ≤ first)");
        }
        Ok(())
    }

    /// The first nodes' edges: node `j` is blocks `edge(j)..edge(j + 1)`, `n` near-equal ranges.
    pub fn edge(&self, j: usize) -> u32 {
        ((j * self.blocks) as f64 / self.n as f64).round() as u32
    }

    /// Rounds until every node is one block: ⌈log₂⌉ of the widest first node, at least one.
    pub fn rounds(&self) -> usize {
        let widest = (0..self.n).map(|j| self.edge(j + 1) - self.edge(j)).max().unwrap_or(1).max(1) as usize;
        (usize::BITS as usize - (widest - 1).leading_zeros() as usize).max(1)
    }

    /// Positions each head reads after the search: the sinks, then `n` blocks of `b` keys.
    pub fn picks(&self) -> usize {
        self.first - self.lo + self.n * self.b
    }

    /// Key rows each head scores: every round scores both halves of every node.
    pub fn scored(&self) -> usize {
        self.rounds() * 2 * self.n * self.b
    }
}

/// A search's positions `[heads, picks]` u32. One queued ahead on a GPU's side stream
/// ([`search_host`] with `ahead`) is read only through
/// [`Found::positions`], which first makes the device's own stream wait for it (the host does
/// not wait); dropped unread, it orders the frees of its inputs after the search the same way.
pub struct Found {
    #[cfg(feature = "cuda")]
    pending: Option<cuda::Pending>,
    idx: Tensor,
}

impl Found {
    /// Positions already in the device's stream order (a search that ran on it, or on the CPU).
    pub fn ready(idx: Tensor) -> Self {
        Self {
            #[cfg(feature = "cuda")]
            pending: None,
            idx,
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn queued(idx: Tensor, pending: Option<cuda::Pending>) -> Self {
        Self { pending, idx }
    }

    /// The positions, for work queued on the device's own stream from now on.
    pub fn positions(self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pending {
            p.wait()?;
        }
        Ok(self.idx)
    }

    /// `[heads, picks]`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        self.idx.dims2()
    }

    /// A copy of the positions to the host that any thread can make ([`HostCopy::get`]).
    pub fn host_copy(&self) -> Result<HostCopy> {
        #[cfg(feature = "cuda")]
        let producer = self.pending.as_ref().map(cuda::Pending::stream);
        #[cfg(not(feature = "cuda"))]
        let producer = None;
        HostCopy::marked(&self.idx, producer)
    }

    /// Where the search was queued on the side stream: `gather(positions, side)`'s launches
    /// queued there after it (the rows the positions name, read over the host link beside the
    /// step as the search's keys were), with what they write and what they read, kept until
    /// candle's stream has waited for them ([`Gathered::take`]). `None` where the positions
    /// are in candle's stream order already, or where `gather` queues nothing.
    #[cfg(feature = "cuda")]
    pub fn gather_after(
        &self,
        gather: impl FnOnce(&Tensor, &Side) -> Result<Option<SideWork>>,
    ) -> Result<Option<Gathered>> {
        let Some(pending) = &self.pending else { return Ok(None) };
        let side = pending.stream();
        let work = match gather(&self.idx, &side) {
            Ok(Some(work)) => work,
            Ok(None) => return Ok(None),
            Err(e) => {
                // What `gather` queued before it failed may still write or read what it
                // dropped (freed on candle's stream): nothing is allocated again before this.
                let _ = side.synchronize();
                return Err(e);
            }
        };
        let keep = work.read.into_iter().chain([self.idx.clone()]).chain(work.written.iter().cloned()).collect();
        Ok(Some(Gathered { out: work.written, pending: cuda::Pending::after(&self.idx, side, keep)? }))
    }
}

/// Tensors written on the side stream after a search ([`Found::gather_after`]).
#[cfg(feature = "cuda")]
pub struct Gathered {
    out: Vec<Tensor>,
    pending: cuda::Pending,
}

#[cfg(feature = "cuda")]
impl Gathered {
    /// The tensors, for work queued on candle's stream from now on.
    pub fn take(self) -> Result<Vec<Tensor>> {
        self.pending.wait()?;
        Ok(self.out)
    }
}

/// The stream whose work writes what a [`HostCopy`] copies (candle's when none is named).
#[cfg(feature = "cuda")]
type Producer = std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>;
#[cfg(not(feature = "cuda"))]
type Producer = std::convert::Infallible;

/// A tensor to bring to the host, on a thread of the caller's choosing: a search's positions
/// (the file tier's read-ahead, which reads the rows they name while the step goes on), a
/// step's query (HiP's search on the CPU, [`host::search_head`]). On a GPU an event marks where
/// the stream that writes it stands when the copy is asked for; the thread waits for that event
/// — the work that wrote it, not the work queued after — and only then copies, on a stream of
/// its own: a copy to pageable memory issued before the data is ready would hold the driver
/// while it waits, and the step's launches on the other thread with it. The copy holds the
/// tensor, so its memory is not reused before it is read.
pub struct HostCopy {
    #[cfg(feature = "cuda")]
    ready: Option<cuda::Ready>,
    t: Tensor,
}

impl HostCopy {
    /// A copy of `t` (contiguous) as the work queued so far on candle's stream leaves it.
    pub fn of(t: &Tensor) -> Result<Self> {
        Self::marked(t, None)
    }

    fn marked(t: &Tensor, producer: Option<Producer>) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let ready = match t.device() {
            candle_core::Device::Cuda(dev) => Some(cuda::mark_ready(dev, producer)?),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = producer;
        Ok(Self {
            #[cfg(feature = "cuda")]
            ready,
            t: t.clone(),
        })
    }

    /// The positions, row-major (waits for the work that writes them).
    pub fn get(self) -> Result<Vec<u32>> {
        #[cfg(feature = "cuda")]
        if let Some(ready) = &self.ready {
            return ready.copy(&self.t);
        }
        self.t.flatten_all()?.to_vec1()
    }

    /// An f32 tensor's values, row-major (waits for the work that writes them).
    pub fn get_f32(self) -> Result<Vec<f32>> {
        #[cfg(feature = "cuda")]
        if let Some(ready) = &self.ready {
            return ready.copy(&self.t);
        }
        self.t.flatten_all()?.to_vec1()
    }
}

/// The search round by round for every head of `q [heads, d]` at once: nodes are `[heads, n, 2]`
/// ranges of blocks; each round [`halve`]s every node (a one-block node is its own right half,
/// its empty left half scores −∞), gets the representative blocks' keys of every half from
/// `gather(pos [heads, 2n·b] u32) → [heads, 2n·b, d]`, scores each half by its best key
/// ([`block_max`]), and keeps the `n` best per head with [`folio_kernels::select::topk`] (ties to the
/// lower candidate; on a GPU past 2048 candidates a radix select, in no set order); [`expand`]
/// turns the kept blocks into positions after the sinks. Nothing comes back to the host.
/// Returns `[heads, picks]` u32 on `q`'s device.
pub fn search_by_rounds(
    q: &Tensor,
    plan: &Search,
    mut gather: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    plan.check()?;
    let heads = q.dim(0)?;
    let (n, b) = (plan.n, plan.b);
    let start: Vec<u32> = (0..heads).flat_map(|_| (0..n).flat_map(move |j| [plan.edge(j), plan.edge(j + 1)])).collect();
    // Scored in f32 every round: cast once.
    let q = q.to_dtype(DType::F32)?;
    let mut nodes = Tensor::from_vec(start, (heads, n, 2), q.device())?;
    let mut keep = None;
    for _ in 0..plan.rounds() {
        let (halves, pos) = halve(&nodes, keep.as_ref(), b, plan.first, plan.blocks * b)?;
        let keys = gather(&pos)?;
        let z = block_max(&q, &keys, &halves, b)?;
        keep = Some(folio_kernels::select::topk(&z, n)?);
        nodes = halves;
    }
    let keep = keep.ok_or_else(|| candle_core::Error::Msg("block search: no rounds".into()))?;
    expand(&nodes, &keep, b, (plan.lo, plan.first))
}

/// See [`reference::halve`]: `nodes [heads, m, 2]` u32, `keep [heads, n]` u32 or none (then
/// `n = m`). Returns `(cand [heads, 2n, 2], pos [heads, 2n·b])` u32 on `nodes`' device.
pub fn halve(nodes: &Tensor, keep: Option<&Tensor>, b: usize, first: usize, keys: usize) -> Result<(Tensor, Tensor)> {
    let (heads, m, two) = nodes.dims3()?;
    let n = keep.map_or(Ok(m), |k| k.dim(1))?;
    if two != 2 || b == 0 || keys == 0 || keep.is_some_and(|k| k.dims() != [heads, n]) {
        candle_core::bail!("halve: nodes {:?}, keep {:?}, {b} keys a block", nodes.dims(), keep.map(Tensor::dims));
    }
    let dims = (heads, m, n);
    match nodes.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => cuda::halve(nodes, keep, dims, b, first, keys),
        device => {
            let nodes_v: Vec<u32> = nodes.flatten_all()?.to_vec1()?;
            let keep_v = keep.map(|k| k.flatten_all()?.to_vec1::<u32>()).transpose()?;
            let (cand, pos) = reference::halve(&nodes_v, keep_v.as_deref(), dims, b, first, keys);
            Ok((Tensor::from_vec(cand, (heads, 2 * n, 2), device)?, Tensor::from_vec(pos, (heads, 2 * n * b), device)?))
        }
    }
}

/// See [`reference::expand`]: `nodes [heads, m, 2]` u32, `keep [heads, n]` u32, the sinks
/// `lo..first`. Returns `[heads, (first − lo) + n·b]` u32 on `nodes`' device.
pub fn expand(nodes: &Tensor, keep: &Tensor, b: usize, sinks: (usize, usize)) -> Result<Tensor> {
    let (heads, m, two) = nodes.dims3()?;
    let (kh, n) = keep.dims2()?;
    if two != 2 || kh != heads || b == 0 || sinks.0 > sinks.1 {
        candle_core::bail!(
            "expand: nodes {:?}, keep {:?}, {b} keys a block, sinks {sinks:?}",
            nodes.dims(),
            keep.dims()
        );
    }
    let dims = (heads, m, n);
    let s = sinks.1 - sinks.0 + n * b;
    match nodes.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => cuda::expand(nodes, keep, dims, b, sinks),
        device => {
            let nodes_v: Vec<u32> = nodes.flatten_all()?.to_vec1()?;
            let keep_v: Vec<u32> = keep.flatten_all()?.to_vec1()?;
            Tensor::from_vec(reference::expand(&nodes_v, &keep_v, dims, b, sinks), (heads, s), device)
        }
    }
}

/// See [`reference::block_max`]: `q [heads, d]`, `keys [heads, c·b, d]` (f32 or bf16),
/// `cand [heads, c, 2]` u32. Returns `[heads, c]` f32.
pub fn block_max(q: &Tensor, keys: &Tensor, cand: &Tensor, b: usize) -> Result<Tensor> {
    let (heads, d) = q.dims2()?;
    let (kh, cb, kd) = keys.dims3()?;
    let (ch, c, two) = cand.dims3()?;
    if kh != heads || ch != heads || kd != d || two != 2 || b == 0 || cb != c * b {
        candle_core::bail!(
            "block_max: q {:?}, keys {:?}, cand {:?}, {b} keys a block",
            q.dims(),
            keys.dims(),
            cand.dims()
        );
    }
    match q.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => cuda::block_max(q, keys, cand, (heads, c, b, d)),
        device => {
            let f32s = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
            let cand_v: Vec<u32> = cand.flatten_all()?.to_vec1()?;
            let z = reference::block_max(&f32s(q)?, &f32s(keys)?, &cand_v, (heads, c, b, d));
            Tensor::from_vec(z, (heads, c), device)
        }
    }
}

/// Candidates a head sorts in the one-launch search (`2n` of them) and the widest head it holds
/// in shared memory: together under the 48 KB of shared memory a launch gets without asking
/// (`cuda::search_shared_bytes`).
#[cfg(feature = "cuda")]
const SEARCH_MAX: usize = 2048;
#[cfg(feature = "cuda")]
const SEARCH_MAX_D: usize = 256;

/// The block search ([`Search`]) over host rows `rows` as keys, for every head
/// of `q [heads · group, d]` at once, positions from the stored `n` on reading `tail` as in
/// [`HostRows::gather`]. On CUDA, where a head's `2n` candidates and its query fit the
/// kernel's shared memory, in one launch (`hip_search`), reading each representative key
/// where it lies — with `ahead`, on the device's side stream, overlapping whatever candle's
/// stream runs until the positions are asked for; otherwise round by round
/// ([`search_by_rounds`]) with the rows' gather. Where the kernel runs,
/// both give the same positions; past 2048 candidates a GPU's rounds keep each round's
/// best in no set order (ties arbitrary). `[heads · group, picks]` u32.
pub fn search_host(
    rows: &HostRows,
    q: &Tensor,
    group: usize,
    tail: Option<&Tensor>,
    plan: &Search,
    ahead: bool,
) -> Result<Found> {
    plan.check()?;
    let (qh, d) = q.dims2()?;
    if group == 0 || qh != rows.heads() * group || d != rows.dim() {
        candle_core::bail!(
            "host rows: searching for q {:?} with group {group} over [{}, n, {}]",
            q.dims(),
            rows.heads(),
            rows.dim()
        );
    }
    #[cfg(feature = "cuda")]
    if rows.device().is_cuda() && 2 * plan.n <= SEARCH_MAX && d <= SEARCH_MAX_D {
        let tail_n = tail.map(|t| rows.check_tail(t)).transpose()?.unwrap_or(0);
        let tail = tail.map(|t| t.contiguous()).transpose()?;
        let q = q.to_dtype(DType::F32)?.contiguous()?;
        let dims = (group, rows.len(), tail_n, d);
        let (idx, pending) = cuda::search(rows.source()?, tail.as_ref(), &q, dims, rows.dtype(), plan, ahead)?;
        return Ok(Found::queued(idx, pending));
    }
    // Round by round (or on the CPU) the search runs in the device's order: nothing to queue.
    let _ = ahead;
    let idx = search_by_rounds(q, plan, |pos| rows.gather(pos, group, tail, Positions::Trusted))?;
    Ok(Found::ready(idx))
}

#[cfg(feature = "cuda")]
mod cuda;
pub mod host;
