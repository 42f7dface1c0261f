//! HiP (the paper is named in [`SPEC`]): hierarchically pruned attention. Keys close in position
//! score alike ("attention locality"), so a branch's representative block stands for it and a
//! greedy tree search finds each query's top blocks in O(k log T) instead of scoring every key.
//!
//! Decode, per *query* head (the paper is MHA; per query head like top-k, since heads of a
//! group attend differently), over the context between the sinks and the recent window, cut
//! into blocks of `block` keys: start from `n = k / block` equal branches; each round splits
//! every branch in two, scores each half by the max of q·k over its middle block (the
//! representative the paper found best, Table 16), and keeps the `n` best halves (ties to the
//! earlier block); after ⌈log₂(N/n)⌉ rounds every branch is one block. Exact attention then
//! runs over sinks ∪ chosen blocks ∪ window. Masks are refreshed every `refresh` decode steps
//! and reused in between, the window growing from the refresh point (§2.4), each layer at its
//! own turn so that no step searches them all (`Hip::stale`). A mask searched at a turn takes
//! over at the next step, the old one serving the turn's own step: each mask serves the
//! `refresh` steps after the query that searched it, and on a GPU the search runs beside the
//! rest of its step instead of before its layer (one step of lag where the paper's refresh
//! already reuses a mask for eight). Where no mask can serve a step (the first, new sinks) the
//! search is used at once. The first
//! `dense_layers` layers stay dense (the paper's l_d = 3 for 7B models). With k covering the
//! whole region nothing is pruned: dense.
//!
//! Sinks and window sizes are not stated in the paper; 4 and 64 are StreamingLLM's sinks and
//! the window the other methods here use. The window starts where the searched region's last
//! whole block ends (up to `block − 1` keys more than `window`), so every block is whole and
//! every head picks the same number of keys: one `[heads, s]` pick, no padding.
//!
//! The fast path keeps the picked rows on the device, and the search there too unless the host
//! link is slow ([`on_host`]: then the CPU searches a step ahead, the keys in host memory, and
//! only the positions cross): each refresh searches every
//! head at once and expands the chosen blocks to positions there (`search_on`: where the tier
//! keeps the saved keys in host memory, [`DecodeTier::host_keys`], one launch that reads each
//! round's representative keys where they lie, up to 2048 candidates and 256 dimensions a head;
//! otherwise round by round with a gather, past 2048 candidates with a top-k whose ties are
//! arbitrary), gathers the picked rows and the
//! window's into per-head buffers once (on the side stream right after the search where it can:
//! [`ahead`]), and each step in between gathers only its own new row into them (`Kept`): the picks cross the host link once per refresh, not once per step, and
//! no step waits for a copy to the host. The device search differs from the host's
//! [`search_blocks`] in two ways: ties at the n-th score go to the lower candidate (left halves
//! before right ones), not to the earlier block, and every round scores every half instead of
//! reusing a parent's score.

use candle_core::Tensor;
use folio_kernels::{heads, sparse};
use folio_method_kernels::hip::{self as blocks, Found};

use super::cost::{CostInput, StepCost};
use super::host_pool;
use super::method::Tiers;
use super::method::{budgeted, Budgeted};
use super::select::{dot, query_rows, sparse_decode, visible, HeadPick, LayerRows, PerLayer};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Dense, Knobs, MethodSpec, Needs, ParamSpec, Params, Read,
};
use crate::error::Result;
use crate::kv_cache::DecodeTier;
use crate::profile::span;

mod ahead;
mod on_host;
use ahead::Ahead;
use on_host::{HostSearch, Searched};

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "hip",
    summary: "hierarchical top-k block search: keys near in position score alike, a tree finds the top blocks",
    paper: "Lee et al., A Training-free Sub-quadratic Cost Transformer Model Serving Framework with \
            Hierarchically Pruned Attention (ICLR 2025)",
    default_budget: Some(DefaultBudget {
        budget: "512",
        source: "the paper's k = 512 (its default experiment settings: b_k = 2, k = 512, l_d = 3, r_m = 8)",
    }),
    params: &PARAMS,
    needs: Needs::NONE,
    tiers: Tiers::FAST,
    cost,
    build: budgeted::<Hip>,
};

/// The dense leading layers are kept on the device and read whole. The others search once per
/// refresh period (the representative blocks' keys of both halves of every branch, per query
/// head: over the link, or read by the CPU in host memory where it searches, [`on_host`]) and
/// gather their picks and window into device buffers then; each step reads those buffers on
/// the device and adds its own row, already there.
fn cost(input: &CostInput<'_>) -> StepCost {
    let (layers, heads, kv) = (input.shape.layers, input.shape.heads, input.shape.kv_heads);
    let dense = input.params.usize("dense_layers").min(layers);
    let sparse = (layers - dense) as f64;
    let block = input.params.usize("block").max(1);
    let refresh = input.params.usize("refresh").max(1);
    let picked = input.budget + input.params.usize("sinks") + input.params.usize("window");
    let n = input.budget.div_ceil(block).max(1);
    let blocks = input.context.div_ceil(block).max(1);
    let rounds = (blocks as f64 / n as f64).log2().ceil().max(0.0);
    let search = rounds * input.keys(2 * n * block, heads);
    // Searched on the CPU in host memory, or by the GPU over the link — on the file tier, which
    // reads ahead, by the GPU unless asked otherwise (`file_link_bytes`).
    let setting = input.params.usize("cpu_search");
    let (search_link, search_host) = match on_host::search_on_cpu(setting, None, false) {
        false => (search, 0.0),
        true => (0.0, search),
    };
    let gpu_search_link = sparse * (input.rows(picked, heads) + search) / refresh as f64;
    // The file tier reads ahead: there the automatic setting leaves the search to the GPU.
    let gpu_on_file = search_host > 0.0 && setting != 1;
    // The kept buffers: the picks, the window (each up to a block longer: whole blocks), and
    // room for the rows of a refresh period.
    let kept = input.rows(picked + 2 * (block - 1) + refresh, heads);
    StepCost {
        device_bytes: dense as f64 * input.rows(input.context, kv) + sparse * input.rows(picked, heads),
        link_bytes: sparse * (input.rows(picked, heads) + search_link) / refresh as f64,
        host_bytes: sparse * search_host / refresh as f64,
        resident_bytes: (dense as f64 * input.rows(input.context, kv) + sparse * kept) as u64,
        file_link_bytes: gpu_on_file.then_some(gpu_search_link),
        file_host_bytes: gpu_on_file.then_some(0.0),
        ..StepCost::default()
    }
}

const PARAMS: [ParamSpec; 6] = [
    ParamSpec { name: "block", default: 2.0, min: 1.0, max: 256.0, integer: true, doc: "b_k, keys per block" },
    ParamSpec {
        name: "sinks",
        default: 4.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "first tokens always attended",
    },
    super::params::RECENT_WINDOW,
    ParamSpec {
        name: "dense_layers",
        default: 3.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "l_d, leading layers kept dense",
    },
    ParamSpec {
        name: "refresh",
        default: 8.0,
        min: 1.0,
        max: 4096.0,
        integer: true,
        doc: "r_m, decode steps per mask",
    },
    ParamSpec {
        name: "cpu_search",
        default: 2.0,
        min: 0.0,
        max: 2.0,
        integer: true,
        doc: "where a search a step ahead runs, the keys in host memory: 0 the device, 1 the CPU, 2 the CPU where the host link is under 40 GB/s",
    },
];

/// One query head's cached mask: chosen key positions, the window start, the first visible
/// position and the step (visible end) it was built at.
#[derive(Clone)]
struct Mask {
    keys: Vec<usize>,
    window_start: usize,
    lo: usize,
    built_hi: usize,
}

/// One layer's state on the fast path between refreshes: what each query head picked (the sinks
/// and its chosen blocks, or the whole region when it holds no more blocks than the budget:
/// `idx [heads, s]` u32 on the device; `None` when the window covers every visible key) and
/// per-head buffers `k`, `v` `[heads, capacity, d]` on the device holding those `s` rows, then
/// the window's from `window_start`, `filled` rows in all. The capacity leaves room for the
/// rows of the `refresh` steps a mask may still serve after it is kept ([`Hip::usable`]: the
/// turn's own step included, while the search queued then runs). A store cut back must be followed by [`Attention::reset`], as every
/// caller does before a generation: the kept rows are not checked against the store.
struct Kept {
    idx: Option<Tensor>,
    k: Tensor,
    v: Tensor,
    s: usize,
    filled: usize,
    lo: usize,
    window_start: usize,
    built_hi: usize,
}

impl Kept {
    /// The position the next row of the buffers holds.
    fn next(&self) -> usize {
        self.window_start + self.filled - self.s
    }
}

pub struct Hip {
    budget: Budget,
    params: Params,
    masks: PerLayer<Vec<Mask>>,
    /// The reference's next masks, as [`Ahead`] is the fast path's.
    masks_ahead: PerLayer<Vec<Mask>>,
    kept: PerLayer<Kept>,
    ahead: PerLayer<Ahead>,
}

/// The hierarchical search over blocks `0..blocks` for `n` survivors; `score(b)` scores block
/// `b` (by its keys). Returns the chosen blocks ascending and how many blocks were scored.
pub fn search_blocks(blocks: usize, n: usize, mut score: impl FnMut(usize) -> f32) -> (Vec<usize>, usize) {
    let found = search_blocks_batched(1, blocks, n, |wanted| Ok(vec![wanted[0].iter().map(|&b| score(b)).collect()]));
    let mut found = found.expect("scoring here cannot fail");
    found.pop().expect("one head")
}

/// [`search_blocks`] for `heads` searches at once: each round, `score(wanted)` gets the blocks
/// every head needs scored (`wanted[h]`, distinct) and returns their scores in that order, so
/// a GPU scores a whole round of every head in one gather. Per head: the chosen blocks
/// ascending and how many blocks were scored. A half whose representative block is its
/// parent's reuses the parent's score; a block that comes back as a representative further
/// down is scored again (the same score: it is a function of the block).
pub fn search_blocks_batched(
    heads: usize,
    blocks: usize,
    n: usize,
    mut score: impl FnMut(&[Vec<usize>]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<(Vec<usize>, usize)>> {
    if blocks <= n {
        return Ok(vec![((0..blocks).collect(), 0); heads]);
    }
    let round = |j: usize| ((j * blocks) as f64 / n as f64).round() as usize;
    // A node: its range of blocks and, once scored, its representative block and score (a
    // half whose representative is its parent's reuses the parent's score).
    #[derive(Clone, Copy)]
    struct Node {
        range: (usize, usize),
        rep: usize,
        score: f32,
    }
    let unscored = |range| Node { range, rep: usize::MAX, score: f32::NAN };
    let start: Vec<Node> = (0..n).map(|j| (round(j), round(j + 1))).filter(|(f, l)| l > f).map(unscored).collect();
    let mut nodes = vec![start; heads];
    let mut scored = vec![0; heads];
    // A node's candidates: itself when one block wide, else its two halves, each with the
    // block that stands for it and the score when already known.
    let split = |node: &Node| -> [Option<Node>; 2] {
        let (f, l) = node.range;
        let half = |range: (usize, usize), rep: usize| {
            let known = rep == node.rep;
            Node { range, rep, score: if known { node.score } else { f32::NAN } }
        };
        if l - f == 1 {
            [Some(half((f, l), f)), None]
        } else {
            let m = f + (l - f) / 2;
            [Some(half((f, m), f + (m - f) / 2)), Some(half((m, l), m + (l - m) / 2))]
        }
    };
    let order = |a: &Node, b: &Node| b.score.total_cmp(&a.score).then(a.range.0.cmp(&b.range.0));
    while nodes.iter().any(|ns| ns.iter().any(|x| x.range.1 - x.range.0 > 1)) {
        let mut cands: Vec<Vec<Node>> = nodes.iter().map(|ns| ns.iter().flat_map(split).flatten().collect()).collect();
        let wanted: Vec<Vec<usize>> =
            cands.iter().map(|cs| cs.iter().filter(|c| c.score.is_nan()).map(|c| c.rep).collect()).collect();
        for ((cs, count), sc) in cands.iter_mut().zip(scored.iter_mut()).zip(score(&wanted)?) {
            *count += sc.len();
            let mut fresh = sc.into_iter();
            for c in cs.iter_mut().filter(|c| c.score.is_nan()) {
                c.score =
                    fresh.next().ok_or_else(|| crate::error::Error::Invalid("hip: a block was not scored".into()))?;
            }
        }
        for (ns, mut cs) in nodes.iter_mut().zip(cands) {
            // The n best (ties to the earlier block); their order does not matter until the end.
            if cs.len() > n {
                cs.select_nth_unstable_by(n - 1, order);
                cs.truncate(n);
            }
            *ns = cs;
        }
    }
    Ok(nodes
        .into_iter()
        .zip(scored)
        .map(|(ns, count)| {
            let mut chosen: Vec<usize> = ns.into_iter().map(|x| x.range.0).collect();
            chosen.sort_unstable();
            (chosen, count)
        })
        .collect())
}

impl Budgeted for Hip {
    fn new(budget: Budget, params: Params) -> Result<Self> {
        Ok(Self {
            budget,
            params,
            masks: PerLayer::new(),
            masks_ahead: PerLayer::new(),
            kept: PerLayer::new(),
            ahead: PerLayer::new(),
        })
    }
}

impl Hip {
    /// Whether layer `layer`'s masks, built at `built` (none yet), must be searched again before
    /// a step whose visible keys end at `hi`: none yet, built for a later position
    /// (a new conversation), `refresh` steps old, or at the layer's turn. Layer `l` takes its
    /// turn where `hi + l` is a multiple of `refresh`, so the layers refresh at staggered steps:
    /// a step searches about 1/`refresh` of them instead of every `refresh`-th step searching
    /// all (the same work; at 1M tokens one step in eight took ~8× the others, p90 4× the
    /// mean). No mask gets older than `refresh` steps, the paper's r_m.
    fn stale(&self, built: Option<usize>, hi: usize, layer: usize) -> bool {
        let refresh = self.params.usize("refresh");
        let Some(built) = built else { return true };
        built > hi || hi - built >= refresh || (hi > built && (hi + layer).is_multiple_of(refresh))
    }

    /// The searched region `first..window_start` of the visible `lo..hi`: after the sinks, and
    /// ending where the window (`window` keys at least) begins, at a whole block.
    fn region(&self, lo: usize, hi: usize) -> (usize, usize) {
        let b = self.params.usize("block");
        let first = self.params.usize("sinks").clamp(lo, hi);
        let wanted = hi.saturating_sub(self.params.usize("window")).max(first);
        (first, first + (wanted - first) / b * b)
    }

    /// A fresh mask for one query head keeping `k` keys of `first..window_start`, and how
    /// many keys the search scored.
    fn build(
        &self,
        q: &[f32],
        rows: &LayerRows,
        kvh: usize,
        region: (usize, usize),
        k: usize,
        (lo, hi): (usize, usize),
    ) -> (Mask, usize) {
        let (first, window_start) = region;
        let b = self.params.usize("block");
        let blocks = (window_start - first) / b;
        let block_keys = |blk: usize| first + blk * b..first + (blk + 1) * b;
        let mut scored = 0;
        let (chosen, _) = search_blocks(blocks, k.div_ceil(b).max(1), |blk| {
            scored += block_keys(blk).len();
            block_keys(blk).map(|p| dot(q, rows.key(kvh, p))).fold(f32::NEG_INFINITY, f32::max)
        });
        let keys = chosen.into_iter().flat_map(block_keys).collect();
        (Mask { keys, window_start, lo, built_hi: hi }, scored)
    }
}

/// The block search (`plan`) of every query head of `q [q_heads, d]` over the keys of `layer`
/// below `end`: the positions each head reads, `[q_heads, plan.picks()]` u32 on the device.
/// Where the tier keeps the saved keys in host memory: with `ahead`, where `cpu_search` puts
/// it there ([`on_host::search_on_cpu`]) and the rows written since the save are few enough to
/// copy ([`on_host::MAX_TAIL_ROWS`]), on the methods' CPU pool once the device has computed `q`
/// ([`HostSearch`]: the host reads the keys where they lie and no step's link carries them);
/// else in one launch that reads each
/// round's representatives where they lie (a round's representatives are a few hundred
/// scattered rows a head: the search is its launches and its link reads, not its arithmetic),
/// queued with `ahead` where it overlaps the device's other work until the positions are
/// asked for. Otherwise round by round through the tier's key gather, in the device's stream
/// order. Each gives the same positions where the scores' sums are exact.
fn search_on(
    kv: &dyn DecodeTier,
    layer: usize,
    q: &Tensor,
    plan: &blocks::Search,
    end: usize,
    (ahead, cpu_search): (bool, usize),
) -> Result<Searched> {
    if let Some(keys) = kv.host_keys(layer) {
        let group = q.dim(0)? / kv.kv_heads();
        let saved = kv.saved();
        let tail = if end > saved { Some(kv.keys(layer, saved, end)?.contiguous()?) } else { None };
        if ahead
            && end.saturating_sub(saved) <= on_host::MAX_TAIL_ROWS
            && on_host::search_on_cpu(cpu_search, Some(q.device()), kv.reads_ahead())
        {
            return Ok(Searched::Host(HostSearch::start(keys, q, tail.as_ref(), group, *plan)?));
        }
        return Ok(Searched::Device(blocks::search_host(keys, q, group, tail.as_ref(), plan, ahead)?));
    }
    let idx =
        blocks::search_by_rounds(q, plan, |pos| kv.gather_keys(layer, pos, end).map_err(candle_core::Error::wrap))?;
    Ok(Searched::Device(Found::ready(idx)))
}

impl Hip {
    /// Whether rows kept (or masks built) at `built` can serve a step whose visible keys end at
    /// `hi` under the same sinks: not from a later position, and no more than `refresh` steps
    /// old — a mask is searched again at its layer's turn, at most `refresh` steps after it was
    /// searched, and the rows searched then replace it a step later.
    fn usable(&self, built: usize, hi: usize) -> bool {
        built <= hi && hi - built <= self.params.usize("refresh")
    }

    /// A fresh mask's pick for the fast path at a step whose visible keys are `lo..hi`: the
    /// search's positions (queued ahead when `ahead`), the whole region as one pick for every
    /// head when it holds no more blocks than the budget, or none when the window covers every
    /// visible key; then where the window starts and the key rows scored per head.
    fn pick(
        &self,
        call: &AttnCall<'_>,
        kv: &dyn DecodeTier,
        q: &Tensor,
        (lo, hi): (usize, usize),
        ahead: bool,
    ) -> Result<(Option<Searched>, usize, usize)> {
        let (first, window_start) = self.region(lo, hi);
        let b = self.params.usize("block");
        let blocks = (window_start - first) / b;
        let n = self.budget.tokens(hi - lo).div_ceil(b).max(1);
        let dev = q.device();
        if blocks > n {
            let plan = blocks::Search { n, blocks, b, first, lo };
            let cpu_search = self.params.usize("cpu_search");
            let found = span(dev, "attention: search", || {
                search_on(kv, call.kv_layer, q, &plan, call.q_start + 1, (ahead, cpu_search))
            })?;
            return Ok((Some(found), window_start, plan.scored()));
        }
        if window_start > lo {
            let all: Vec<u32> = (lo as u32..window_start as u32).collect();
            let idx = Tensor::from_vec(all, (1, window_start - lo), dev)?.repeat((q.dim(0)?, 1))?;
            return Ok((Some(Searched::Device(Found::ready(idx))), window_start, 0));
        }
        Ok((None, window_start, 0))
    }

    /// The layer's kept rows for a mask: the picked rows (`picked [heads, s]`), then the
    /// window's from `window_start` up to the step's `hi`, then room for the rows of the
    /// `refresh` steps the mask may still serve (the current row repeated, overwritten as the
    /// steps come), gathered once into per-head buffers. With the picks on the host too (a
    /// read-ahead's), the tier is handed them.
    #[allow(clippy::too_many_arguments)]
    fn keep(
        &self,
        call: &AttnCall<'_>,
        kv: &dyn DecodeTier,
        picked: Option<(Tensor, Option<Vec<u32>>)>,
        window_start: usize,
        (lo, hi): (usize, usize),
        heads: usize,
        built_hi: usize,
    ) -> Result<Kept> {
        let dev = kv.device();
        let s = picked.as_ref().map_or(Ok(0), |p| p.0.dim(1))?;
        let room = self.params.usize("refresh");
        let tail: Vec<u32> =
            (window_start as u32..hi as u32).chain(std::iter::repeat_n((hi - 1) as u32, room)).collect();
        let listed: Option<Vec<u32>> = match &picked {
            Some((_, Some(list))) if s > 0 && list.len() == heads * s => {
                Some(list.chunks(s).flat_map(|row| row.iter().chain(&tail)).copied().collect())
            }
            _ => None,
        };
        let tail = Tensor::from_vec(tail, (1, hi - window_start + room), dev)?.repeat((heads, 1))?;
        let (idx, picked) = match picked {
            Some((p, _)) => (Tensor::cat(&[&p, &tail], 1)?, Some(p)),
            None => (tail, None),
        };
        let (k, v) = span(dev, "attention: gather", || match &listed {
            Some(list) => kv.gather_listed(call.kv_layer, &idx, list, hi),
            None => kv.gather(call.kv_layer, &idx, hi),
        })?;
        Ok(Kept { idx: picked, k, v, s, filled: s + hi - window_start, lo, window_start, built_hi })
    }

    /// The fast path over a decode tier (offloaded or resident). At a layer's turn (see
    /// [`Hip::stale`]) it searches every query head's blocks at once (`search_on`); while the
    /// rows kept at its last turn can still serve the step, the search is queued ahead (on a
    /// GPU's side stream, where it overlaps the rest of the step: it reads the host link, the
    /// step reads the device's memory; or on the CPU, [`on_host`]) and its rows
    /// replace the kept ones at the next step — each mask serves the `refresh` steps after the
    /// one whose query searched it. Otherwise (the first step, new sinks) it searches in
    /// order and uses the result at once. Between turns it gathers the rows written since the
    /// last step into the kept buffers. The row kernel then reads the buffers, the same keys
    /// the reference reads (sinks, chosen blocks, window).
    fn attend_fast(&self, call: &AttnCall<'_>, kv: &dyn DecodeTier) -> Result<Attended> {
        let (lo, hi) = visible(call);
        let q = call.q.squeeze(1)?;
        let heads = q.dim(0)?;
        let dev = q.device().clone();
        let mut all = self.kept.lock();
        // The search queued at this layer's last turn takes over from this step.
        if let Some(next) = self.ahead.lock().remove(&call.layer) {
            if next.lo == lo && next.heads == heads && next.built_hi < hi && self.usable(next.built_hi, hi) {
                // A read-ahead that failed leaves the gather to read (and report) what it lacks.
                let listed = next.read.and_then(|r| {
                    let waited = span(&dev, "attention: read-ahead wait", || r.positions());
                    waited.inspect_err(|e| tracing::warn!(error = %e)).ok()
                });
                let picked = next.picked.map(|p| span(&dev, "attention: search wait", || p.positions(&dev)));
                let picked = picked.transpose()?.map(|t| (t, listed));
                let kept = match (next.gathered, picked) {
                    // The rows gathered beside the last step, up to the step that searched them.
                    (Some(rows), Some((idx, _))) => {
                        let room = self.params.usize("refresh") + 1;
                        let (k, v) = span(&dev, "attention: gather wait", || ahead::stacked(rows, room, &dev))?;
                        let (s, built_hi, window_start) = (idx.dim(1)?, next.built_hi, next.window_start);
                        let filled = s + built_hi - window_start;
                        Kept { idx: Some(idx), k, v, s, filled, lo, window_start, built_hi }
                    }
                    (_, picked) => self.keep(call, kv, picked, next.window_start, (lo, hi), heads, next.built_hi)?,
                };
                all.insert(call.layer, kept);
            }
        }
        let usable = all.get(&call.layer).is_some_and(|k| {
            let rows = hi.saturating_sub(k.next());
            k.lo == lo
                && k.k.dim(0).ok() == Some(heads)
                && k.next() <= hi
                && k.k.dim(1).is_ok_and(|capacity| k.filled + rows <= capacity)
                && self.usable(k.built_hi, hi)
        });
        let mut searched = 0;
        if !usable || self.stale(all.get(&call.layer).map(|k| k.built_hi), hi, call.layer) {
            let (picked, window_start, scored) = self.pick(call, kv, &q, (lo, hi), usable)?;
            searched = scored;
            if usable {
                // Where the tier reads ahead (without it, the step's gather reads the rows).
                let read = match (&picked, kv.reads_ahead()) {
                    (Some(found), true) => match found.host_copy() {
                        Ok(copy) => kv.read_ahead(call.kv_layer, found.dims()?, copy),
                        Err(e) => {
                            tracing::warn!(error = %e, "no read-ahead: the positions cannot reach the host");
                            None
                        }
                    },
                    _ => None,
                };
                // Where the tier keeps the rows in host memory, their gather after the search.
                let gathered = match (&picked, read.is_none()) {
                    (Some(found), true) => ahead::gather_ahead(kv, call.kv_layer, found, (window_start, hi), heads)?,
                    _ => None,
                };
                let next = Ahead { picked, read, gathered, window_start, lo, heads, built_hi: hi };
                self.ahead.lock().insert(call.layer, next);
            } else {
                let picked = picked.map(|p| p.positions(&dev).map(|t| (t, None))).transpose()?;
                all.insert(call.layer, self.keep(call, kv, picked, window_start, (lo, hi), heads, hi)?);
            }
        }
        let kept = all.get_mut(&call.layer).ok_or_else(|| crate::error::Error::Invalid("hip: no kept rows".into()))?;
        let next = kept.next();
        // The rows written since the last step of this layer (usually its own one), each KV
        // head's row copied to its query heads' buffers.
        let group = heads / kv.kv_heads();
        for p in next..hi {
            span(&dev, "attention: gather", || {
                let (k, v) = kv.row(call.kv_layer, p)?;
                heads::place_row(&kept.k, &k, 0, kept.filled, group)?;
                Ok(heads::place_row(&kept.v, &v, 0, kept.filled, group)?)
            })?;
            kept.filled += 1;
        }
        let (out, _lse) = span(&dev, "attention: kernel", || {
            Ok(sparse::decode_attention_rows(&q, &kept.k, &kept.v, kept.filled, None, call.scale)?)
        })?;
        let read = match &kept.idx {
            Some(idx) => Read::PickedAndRange { idx: idx.clone(), range: (kept.window_start, hi) },
            None => Read::All,
        };
        Ok(Attended {
            out: out.unsqueeze(1)?.to_dtype(call.q.dtype())?,
            read,
            // Key rows scored per head already.
            searched: searched as f64,
        })
    }
}

impl Attention for Hip {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    fn reset(&self) {
        self.masks.clear();
        self.masks_ahead.clear();
        self.kept.clear();
        self.ahead.clear();
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let tier = call.kv.tier();
        if call.layer < self.params.usize("dense_layers") {
            if let Some(kv) = &tier {
                // Read every step: keep the layer on the device rather than cross the link.
                kv.keep_resident(call.kv_layer)?;
            }
            return Dense.attend(call);
        }
        if let (Some(kv), 1) = (&tier, call.q.dim(1)?) {
            return self.attend_fast(call, &**kv);
        }
        sparse_decode(call, |rows, lo, hi| {
            let queries = query_rows(call)?;
            let groups = queries.len() / rows.kv_heads;
            // Sinks are the sequence's first tokens (those still visible).
            let (first, window_start) = self.region(lo, hi);
            let mut cache = self.masks.lock();
            let mut searched = 0;
            // Masks built under other sinks (a model window moved them), or for other heads, are
            // searched again, as the fast path's kept rows are.
            let fits = |m: &Vec<Mask>| m.len() == queries.len() && m.first().is_some_and(|m| m.lo == lo);
            // The masks searched at this layer's last turn take over from this step.
            if let Some(next) = self.masks_ahead.lock().remove(&call.layer) {
                if fits(&next) && next[0].built_hi < hi && self.usable(next[0].built_hi, hi) {
                    cache.insert(call.layer, next);
                }
            }
            let built = cache.get(&call.layer).filter(|m| fits(m)).map(|m| m[0].built_hi);
            let usable = built.is_some_and(|b| self.usable(b, hi));
            if !usable || self.stale(built, hi, call.layer) {
                let masks = queries
                    .iter()
                    .enumerate()
                    .map(|(h, q)| {
                        let k = self.budget.tokens(hi - lo);
                        let (m, s) = self.build(&q[0], rows, h / groups, (first, window_start), k, (lo, hi));
                        searched += s;
                        m
                    })
                    .collect();
                // As the fast path: while the current masks serve this step, the new ones take
                // over at the next.
                if usable {
                    self.masks_ahead.lock().insert(call.layer, masks);
                } else {
                    cache.insert(call.layer, masks);
                }
            }
            let masks = &cache[&call.layer];
            let picks = masks
                .iter()
                .map(|m| {
                    let pos = (lo..first).chain(m.keys.iter().copied()).chain(m.window_start.max(first)..hi).collect();
                    HeadPick::plain(pos)
                })
                .collect();
            Ok((picks, searched as f64 / queries.len() as f64))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With one survivor per block the search keeps everything; a single planted peak is found
    /// among thousands of blocks while scoring O(n log N) of them.
    #[test]
    fn search_finds_planted_peaks_cheaply() {
        let (all, scored) = search_blocks(10, 10, |_| 0.0);
        assert_eq!((all, scored), ((0..10).collect(), 0));
        // A smooth score with its peak at block 3001: locality makes the greedy search exact.
        let peak = 3001usize;
        let (chosen, scored) = search_blocks(4096, 4, |b| -((b as f32 - peak as f32).abs()));
        assert!(chosen.contains(&peak), "{chosen:?}");
        assert!(scored < 4 * 2 * 12 + 8, "scored {scored} blocks");
    }
}
