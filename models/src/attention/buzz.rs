//! BUZZ (the paper is named in [`SPEC`]): a KV cache that keeps attention sinks, a recent window,
//! and a "beehive" body in between: history cut into segments of `stride` tokens, each
//! keeping its local heavy hitter (the highest accumulated attention), so every region of the
//! past stays represented. Eviction is batched: nothing goes until the body exceeds the
//! threshold `T`; then tokens that left the window since the last eviction keep one per
//! segment of `s`, older survivors are interval-sampled with stride ŝ = ⌊(s+1)/2⌋ (no scores),
//! and distant history thins geometrically.
//!
//! Sizes: the budget is the cache's peak `B = sinks + w + T` (a share is of the conversation
//! so far, so 100% never evicts); `T/w` follows Theorem 3.1
//! (`(s²+1)/(s+1)` for odd s, `s-1` for even), `w = (B - sinks)/(1 + T/w)` (the spec's sizing
//! recipe). Scores are the softmax probabilities each kept key received, summed over every
//! query row this method attended and over the query heads of its KV group (selection is
//! per KV head: one cache per KV head, as the authors' per-head cache; summing is the mean up to
//! a constant, so the argmax is the group's).
//!
//! Differences from the paper's setting, forced by a saved context: the context's own query
//! rows are not in the file, so scores start at the first query this method sees (the
//! question's rows, attended densely over the whole context, then evicted down to the bound
//! at once — the spec's "Remark 2" mode); keys keep their absolute positions (the file holds
//! post-RoPE keys), not the authors' slot-index re-rotation. Evicted tokens are gone for the
//! rest of the turn; the context file keeps them (a session starts each turn's cache afresh
//! from it, as a rebuilt conversation does). Eviction runs until the bound holds
//! (Remark 2), not once per forward as the authors' code; a long question is evicted at once.

use candle_core::{DType, Device, Tensor};
use folio_kernels::{heads, sparse};

use std::collections::HashMap;

use super::cost::{CostInput, StepCost};
use super::fast;
use super::method::{budgeted, Budgeted};
use super::select::{dot, query_rows, LayerRows, PerLayer};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Knobs, MethodSpec, Needs, ParamSpec, Params, Read, Tiers,
};
use crate::error::{Error, Result};
use crate::kv_cache::DecodeTier;

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "buzz",
    summary: "an evicting cache: sinks, a recent window, and one heavy hitter per segment of older history",
    paper: "Zhao et al., BUZZ: Beehive-structured Sparse KV Cache with Segmented Heavy Hitters (2024)",
    default_budget: Some(DefaultBudget {
        budget: "10%",
        source: "the smallest cache the paper studies (10–60% of the full cache, Table 2); the paper's share is \
                 of the mean cache size, Folio's of the peak (sinks + window + threshold)",
    }),
    params: &PARAMS,
    needs: Needs::NONE,
    tiers: Tiers::FAST,
    cost,
    build: budgeted::<Buzz>,
};

/// The live cache (at most the budget) per KV head, on the device ([`DeviceRows`]): a step
/// reads its K and V once for the attention and K again for the scores, and moves nothing over
/// the link (the new token's row is already on the device). The cache, its positions and
/// scores stay on the device, with room for the largest transient beside them: an eviction's
/// compacted copy of one layer's rows, or the attention's logits. (For a model with a sliding
/// window the rows stay off the device and each step gathers the live set, as every call
/// before the first decode step does: a cost the shape does not tell this function.)
fn cost(input: &CostInput<'_>) -> StepCost {
    let (b, kv_heads, heads) = (input.budget, input.shape.kv_heads, input.shape.heads);
    let capacity = b + 1 + ROW_SLACK;
    let state = input.rows(capacity, kv_heads) + ((capacity * 2 * kv_heads * 4) as f64);
    let transient = input.rows(capacity, kv_heads).max((capacity * heads * 4) as f64);
    StepCost {
        device_bytes: input.layers() * (input.rows(b, kv_heads) + input.keys(b, kv_heads)),
        resident_bytes: (input.layers() * state + transient) as u64,
        ..StepCost::default()
    }
}

const PARAMS: [ParamSpec; 2] = [
    ParamSpec {
        name: "sinks",
        default: 4.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "k, first tokens never evicted",
    },
    ParamSpec {
        name: "stride",
        default: 5.0,
        min: 3.0,
        max: 64.0,
        integer: true,
        doc: "s, segment length for new heavy hitters (ŝ = (s+1)/2 for old ones; s < 3 never converges)",
    },
];

/// `T/w` for stride `s` (Theorem 3.1).
pub fn threshold_ratio(s: usize) -> f64 {
    let s = s as f64;
    if s as usize % 2 == 1 {
        (s * s + 1.0) / (s + 1.0)
    } else {
        s - 1.0
    }
}

/// One KV head's cache: live positions (ascending) and their accumulated scores.
#[derive(Clone)]
struct HeadCache {
    live: Vec<usize>,
    score: Vec<f32>,
}

/// One layer's cache.
struct LayerCache {
    /// Positions `0..end` have entered the cache.
    end: usize,
    n_old: usize,
    window: usize,
    threshold: usize,
    heads: Vec<HeadCache>,
    /// The live rows on the compute device, from the first decode step on
    /// (see [`DeviceRows`]); while they exist, the scores are theirs and `heads[..].score` is
    /// stale.
    rows: Option<DeviceRows>,
}

impl LayerCache {
    /// Whether the body is over the threshold: [`Buzz::evict`] has work to do.
    fn over(&self, sinks: usize) -> bool {
        let len = self.heads[0].live.len();
        len > sinks + self.window && len - sinks - self.window > self.threshold
    }
}

/// Free slots a layer's device rows get when they are built or grow past their capacity: a
/// decode step adds one row, so a copy of the cache happens once in this many steps at most.
/// The growth is by this many slots, not by a share of the cache: the live set exceeds its
/// bound by one row at most and the bound grows with the context (a tenth of a token a step at
/// 10%), so a geometric growth would only hold device memory the cache never uses (an eighth of
/// it: 0.7 GiB of a 7B model's at a million tokens).
const ROW_SLACK: usize = 1024;

/// A layer's live rows on the compute device: slot `j` of KV head `g` holds the K and V row of
/// position `pos[g, j]`, which is `heads[g].live[j]`, for `j < len`. BUZZ is a KV cache: the
/// paper keeps it on the GPU and a decode step adds one row and reads only these, so a step here
/// appends the new token's row (from the tier's device tail), attends the slots (each read once
/// for its KV group, [`sparse::decode_attention_rows`]) and adds each slot's attention mass to
/// its score on the device ([`sparse::attention_mass`]); only an eviction brings the scores to
/// the host, where the choice is made, and compacts the slots on the device. Without them
/// every step gathered the whole live set from the tier: over the host link at a million
/// tokens, 10% of the context.
struct DeviceRows {
    /// `[kv_heads, capacity, head_dim]` each.
    k: Tensor,
    v: Tensor,
    /// `[kv_heads, capacity]` u32.
    pos: Tensor,
    /// `[kv_heads, len]` f32: each slot's accumulated attention.
    score: Tensor,
    len: usize,
}

impl DeviceRows {
    /// The live rows of `heads` gathered from `kv` (positions below `end`), their scores from
    /// the host.
    fn gather(kv: &dyn DecodeTier, layer: usize, heads: &[HeadCache], end: usize) -> Result<Self> {
        let (kv_heads, len) = (heads.len(), heads[0].live.len());
        let dev = kv.device();
        let pos: Vec<u32> = heads.iter().flat_map(|h| h.live.iter().map(|&p| p as u32)).collect();
        let pos = Tensor::from_vec(pos, (kv_heads, len), dev)?;
        let (k, v) = kv.gather(layer, &pos, end)?;
        let score: Vec<f32> = heads.iter().flat_map(|h| h.score.iter().copied()).collect();
        let mut rows = Self {
            k: Tensor::zeros((kv_heads, 0, kv.head_dim()), k.dtype(), dev)?,
            v: Tensor::zeros((kv_heads, 0, kv.head_dim()), v.dtype(), dev)?,
            pos: Tensor::zeros((kv_heads, 0), DType::U32, dev)?,
            score: Tensor::from_vec(score, (kv_heads, len), dev)?,
            len: 0,
        };
        rows.reserve(len + ROW_SLACK)?;
        rows.k.slice_set(&k, 1, 0)?;
        rows.v.slice_set(&v, 1, 0)?;
        rows.pos.slice_set(&pos, 1, 0)?;
        rows.len = len;
        Ok(rows)
    }

    fn capacity(&self) -> usize {
        self.pos.dim(1).unwrap_or(0)
    }

    /// Room for `capacity` slots: the live ones copied into fresh buffers.
    fn reserve(&mut self, capacity: usize) -> Result<()> {
        let (kv_heads, d) = (self.k.dim(0)?, self.k.dim(2)?);
        let dev = self.k.device().clone();
        let fresh = |old: &Tensor, shape: &[usize]| -> Result<Tensor> {
            let t = Tensor::zeros(shape, old.dtype(), &dev)?;
            if self.len > 0 {
                t.slice_set(&old.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
            }
            Ok(t)
        };
        self.k = fresh(&self.k, &[kv_heads, capacity, d])?;
        self.v = fresh(&self.v, &[kv_heads, capacity, d])?;
        self.pos = fresh(&self.pos, &[kv_heads, capacity])?;
        Ok(())
    }

    /// Appends one row per KV head (`k`, `v` `[kv_heads, 1, d]`, positions `pos [kv_heads, 1]`).
    fn push(&mut self, k: &Tensor, v: &Tensor, pos: &Tensor) -> Result<()> {
        if self.len == self.capacity() {
            self.reserve(self.len + ROW_SLACK)?;
        }
        heads::place_row(&self.k, k, 0, self.len, 1)?;
        heads::place_row(&self.v, v, 0, self.len, 1)?;
        self.pos.slice_set(pos, 1, self.len)?;
        self.len += 1;
        Ok(())
    }

    /// Keeps `kept[g]` (ascending slots of KV head `g`, as many for every head) with their
    /// scores `score [kv_heads · kept]`, in order, at the front.
    fn keep(&mut self, kept: &[Vec<usize>], score: Vec<f32>) -> Result<()> {
        let (kv_heads, cap, d) = self.k.dims3()?;
        let n = kept.first().map_or(0, Vec::len);
        let dev = self.k.device().clone();
        let flat: Vec<u32> =
            kept.iter().enumerate().flat_map(|(g, slots)| slots.iter().map(move |&j| (g * cap + j) as u32)).collect();
        let flat = Tensor::from_vec(flat, kv_heads * n, &dev)?;
        let k = self.k.reshape((kv_heads * cap, d))?.index_select(&flat, 0)?.reshape((kv_heads, n, d))?;
        let v = self.v.reshape((kv_heads * cap, d))?.index_select(&flat, 0)?.reshape((kv_heads, n, d))?;
        let pos = self.pos.flatten_all()?.index_select(&flat, 0)?.reshape((kv_heads, n))?;
        self.k.slice_set(&k, 1, 0)?;
        self.v.slice_set(&v, 1, 0)?;
        self.pos.slice_set(&pos, 1, 0)?;
        self.score = Tensor::from_vec(score, (kv_heads, n), &dev)?;
        self.len = n;
        Ok(())
    }

    /// The scores back into the host cache (for an eviction or a call the rows do not serve).
    fn scores_to_host(&self, heads: &mut [HeadCache]) -> Result<()> {
        let score = self.score.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        for (h, s) in heads.iter_mut().zip(score) {
            h.score[..s.len()].copy_from_slice(&s);
        }
        Ok(())
    }
}

/// The slots of `kept` in `live` (both ascending, `kept` a subsequence of `live`).
fn slots_of(kept: &[usize], live: &[usize]) -> Vec<usize> {
    let mut slots = Vec::with_capacity(kept.len());
    let mut j = 0;
    for &p in kept {
        while live[j] != p {
            j += 1;
        }
        slots.push(j);
    }
    slots
}

pub struct Buzz {
    budget: Budget,
    params: Params,
    caches: PerLayer<LayerCache>,
}

impl Budgeted for Buzz {
    fn new(budget: Budget, params: Params) -> Result<Self> {
        Ok(Self { budget, params, caches: PerLayer::new() })
    }
}

impl Buzz {
    /// (window, threshold) for a peak of `peak` tokens.
    pub fn sizes(&self, peak: usize) -> (usize, usize) {
        let sinks = self.params.usize("sinks");
        let ratio = threshold_ratio(self.params.usize("stride"));
        let w = ((peak.saturating_sub(sinks)) as f64 / (1.0 + ratio)).floor().max(1.0) as usize;
        let t = peak.saturating_sub(sinks + w).max(1);
        (w, t)
    }

    /// The cache bound: the live length never exceeds it between calls.
    pub fn bound(&self, peak: usize) -> usize {
        let (w, t) = self.sizes(peak);
        self.params.usize("sinks") + w + t
    }

    /// Evict until the body fits under the threshold.
    fn evict(&self, c: &mut LayerCache) {
        let k = self.params.usize("sinks");
        let s = self.params.usize("stride");
        let small = s.div_ceil(2);
        while c.over(k) {
            let len = c.heads[0].live.len();
            let mid = len - k - c.window;
            let n_new = mid - c.n_old;
            let old_keep: Vec<usize> = (0..c.n_old.div_ceil(small)).map(|i| k + i * small).collect();
            let mut kept_new = 0;
            for h in c.heads.iter_mut() {
                let new_start = k + c.n_old;
                let new_end = new_start + n_new;
                let mut keep_slots: Vec<usize> = (0..k).chain(old_keep.iter().copied()).collect();
                let mut keep_score: Vec<f32> = vec![0.0; keep_slots.len()];
                let mut seg = new_start;
                while seg < new_end {
                    let end = (seg + s).min(new_end);
                    // Ties go to the earliest slot.
                    let best = (seg..end).fold(seg, |b, j| if h.score[j] > h.score[b] { j } else { b });
                    keep_slots.push(best);
                    keep_score.push(h.score[best]);
                    seg = end;
                }
                kept_new = keep_slots.len() - k - old_keep.len();
                keep_slots.extend(len - c.window..len);
                keep_score.extend_from_slice(&h.score[len - c.window..]);
                h.live = keep_slots.iter().map(|&j| h.live[j]).collect();
                h.score = keep_score;
            }
            c.n_old = old_keep.len() + kept_new;
        }
    }
}

impl Buzz {
    /// The layer's cache with this call's positions entered (a fresh one when the call does
    /// not continue the last: a new conversation or a reopened context, whose whole stored
    /// context is then live, unscored), sized for the conversation so far.
    fn enter<'a>(
        &self,
        caches: &'a mut HashMap<usize, LayerCache>,
        call: &AttnCall<'_>,
        kv_heads: usize,
    ) -> Result<&'a mut LayerCache> {
        let end = call.q_start + call.q.dim(1)?;
        if caches.get(&call.layer).is_none_or(|c| c.end != call.q_start) {
            let head = HeadCache { live: (0..call.q_start).collect(), score: vec![0.0; call.q_start] };
            caches.insert(
                call.layer,
                LayerCache {
                    end: call.q_start,
                    n_old: 0,
                    window: 0,
                    threshold: 0,
                    heads: vec![head; kv_heads],
                    rows: None,
                },
            );
        }
        let cache = caches.get_mut(&call.layer).ok_or_else(|| Error::Invalid("buzz cache missing".into()))?;
        for h in cache.heads.iter_mut() {
            h.live.extend(call.q_start..end);
            h.score.resize(h.live.len(), 0.0);
        }
        cache.end = end;
        // A share of the context grows with the conversation (100% never evicts).
        (cache.window, cache.threshold) = self.sizes(self.budget.tokens(end));
        Ok(cache)
    }

    /// The fast path over a decode tier. A decode step over a cache whose rows are on the device
    /// ([`DeviceRows`]) runs there; any other call (the first, a question, a model window)
    /// gathers the live rows once per KV head (every head of a layer holds as many), attends
    /// them exactly with each row's accumulated probability back on the host and evicts there;
    /// a decode step (one token, no model window) then moves the live rows to the device for
    /// the steps that follow.
    fn attend_fast(&self, call: &AttnCall<'_>, kv: &dyn DecodeTier) -> Result<Attended> {
        let (q_heads, t, _) = call.q.dims3()?;
        let kv_heads = kv.kv_heads();
        let mut caches = self.caches.lock();
        let cache = self.enter(&mut caches, call, kv_heads)?;
        let s = cache.heads[0].live.len();
        if cache.heads.iter().any(|h| h.live.len() != s) {
            return Err(Error::Invalid("buzz: KV heads of a layer hold different cache sizes".into()));
        }
        let steady = t == 1 && call.window.is_none();
        if steady && cache.rows.is_some() {
            return self.attend_rows(call, kv, cache);
        }
        if let Some(rows) = cache.rows.take() {
            rows.scores_to_host(&mut cache.heads)?;
        }
        // A fresh cache holds every position (a reopened million-token context): one row of
        // positions repeated on the device, 4 MB uploaded a layer rather than 16.
        let every = cache.heads.iter().all(|h| h.live.len() == cache.end && h.live.last() == Some(&(cache.end - 1)));
        let idx = if every {
            Tensor::arange(0u32, s as u32, call.q.device())?.unsqueeze(0)?.repeat((kv_heads, 1))?
        } else {
            let pos: Vec<u32> = cache.heads.iter().flat_map(|h| h.live.iter().map(|&p| p as u32)).collect();
            Tensor::from_vec(pos, (kv_heads, s), call.q.device())?
        };
        // Every row sees the positions before the call's own (enter() appended those last), and
        // a single row its own too: the row kernels take them where they run on tensor cores
        // (elsewhere their CUDA-core or CPU forms cost more than the masked path).
        let open = match sparse::rows_on_tensor_cores(call.q.device(), call.q.dtype(), kv.head_dim()) {
            true if t == 1 => s,
            true => s - t,
            false => 0,
        };
        let (out, probs) = fast::attend_scored(call, kv, &idx, open)?;
        for (h, p) in cache.heads.iter_mut().zip(probs.chunks(s)) {
            h.score.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
        // What each query head read: its KV head's live set visible to the call's last row —
        // all of it without a model window, kept on the device (a million positions per query
        // head copied into lists took seconds a step over a reopened context).
        let (last, groups) = (cache.end - 1, q_heads / kv_heads);
        let read = match call.window {
            None => Read::Grouped { idx: idx.clone(), group: groups },
            Some(w) => {
                let lo = (last + 1).saturating_sub(w);
                Read::Rows(
                    (0..q_heads)
                        .map(|h| {
                            cache.heads[h / groups].live.iter().copied().filter(|&p| p <= last && p >= lo).collect()
                        })
                        .collect(),
                )
            }
        };
        let dev = call.q.device();
        crate::profile::span(dev, "attention: evict", || {
            self.evict(cache);
            Ok(())
        })?;
        // The first decode step moves the rows to the device (a multi-token call may be one
        // chunk of several: the next would only drop them).
        if steady {
            let rows = crate::profile::span(dev, "attention: rows to the device", || {
                DeviceRows::gather(kv, call.kv_layer, &cache.heads, cache.end)
            })?;
            cache.rows = Some(rows);
        }
        Ok(Attended { out, read, searched: 0.0 })
    }

    /// One decode step over the layer's device rows: the new token's row appended, the slots
    /// attended, each slot's attention mass added to its score, and an eviction (on the host's
    /// choice, compacted on the device) when the body is over the threshold.
    fn attend_rows(&self, call: &AttnCall<'_>, kv: &dyn DecodeTier, cache: &mut LayerCache) -> Result<Attended> {
        let Some(mut rows) = cache.rows.take() else {
            return Err(Error::Invalid("buzz: no device rows to decode over".into()));
        };
        let dev = call.q.device();
        let (kv_heads, q_heads) = (kv.kv_heads(), call.q.dim(0)?);
        let new = Tensor::from_vec(vec![call.q_start as u32; kv_heads], (kv_heads, 1), dev)?;
        let (k, v) = crate::profile::span(dev, "attention: gather", || kv.row(call.kv_layer, call.q_start))?;
        rows.push(&k, &v, &new)?;
        let n = rows.len;
        if n != cache.heads[0].live.len() {
            return Err(Error::Invalid(format!(
                "buzz: {n} device rows for {} live positions in layer {}",
                cache.heads[0].live.len(),
                call.layer
            )));
        }
        let q = call.q.squeeze(1)?;
        let out = crate::profile::span(dev, "attention: kernel", || {
            let (out, lse) = sparse::decode_attention_rows(&q, &rows.k, &rows.v, n, None, call.scale)?;
            rows.score = sparse::attention_mass(&q, &rows.k, &lse, Some(&rows.score), n, call.scale)?;
            Ok(out)
        })?;
        // A copy: the slots are rewritten in place by later steps.
        let read = Read::Grouped { idx: rows.pos.narrow(1, 0, n)?.copy()?, group: q_heads / kv_heads };
        let sinks = self.params.usize("sinks");
        if cache.over(sinks) {
            rows.scores_to_host(&mut cache.heads)?;
            let before: Vec<Vec<usize>> = cache.heads.iter().map(|h| h.live.clone()).collect();
            self.evict(cache);
            let kept: Vec<Vec<usize>> =
                cache.heads.iter().zip(&before).map(|(h, old)| slots_of(&h.live, old)).collect();
            let score = cache.heads.iter().flat_map(|h| h.score.iter().copied()).collect();
            rows.keep(&kept, score)?;
        }
        cache.rows = Some(rows);
        Ok(Attended { out: out.unsqueeze(1)?.to_dtype(call.q.dtype())?, read, searched: 0.0 })
    }
}

impl Attention for Buzz {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    /// Keeps a conversation's cache for a caller that generates again on the same store: the
    /// next turn continues its positions and sees only the compressed history (the paper's
    /// setting); a call that does not continue them starts afresh in [`Attention::attend`].
    /// A session ends the conversation at each turn instead, so a turn answers as a rebuilt
    /// conversation does.
    fn reset(&self) {}

    fn end_conversation(&self) {
        self.caches.clear();
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let (q_heads, t, d) = call.q.dims3()?;
        let end = call.q_start + t;
        if let Some(kv) = call.kv.tier() {
            return self.attend_fast(call, &*kv);
        }
        let rows = LayerRows::read(call, end)?;
        let groups = q_heads / rows.kv_heads;
        let mut caches = self.caches.lock();
        let cache = self.enter(&mut caches, call, rows.kv_heads)?;
        // Rows a fast-path call left on the device give their scores back first.
        if let Some(device_rows) = cache.rows.take() {
            device_rows.scores_to_host(&mut cache.heads)?;
        }
        let queries = query_rows(call)?;
        let mut out = Vec::with_capacity(q_heads * t * d);
        let mut read = vec![Vec::new(); q_heads];
        for (h, q) in queries.iter().enumerate() {
            let kvh = h / groups;
            let head = &mut cache.heads[kvh];
            for (r, qr) in q.iter().enumerate() {
                let pos = call.q_start + r;
                let lo = call.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                // Live slots this row may see: causal, inside the model's sliding window.
                let slots: Vec<usize> =
                    (0..head.live.len()).filter(|&j| head.live[j] <= pos && head.live[j] >= lo).collect();
                let logits: Vec<f64> =
                    slots.iter().map(|&j| (dot(qr, rows.key(kvh, head.live[j])) * call.scale) as f64).collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|z| (z - max).exp()).collect();
                let total: f64 = w.iter().sum();
                let mut acc = vec![0f64; d];
                for (&j, wj) in slots.iter().zip(&w) {
                    let p = wj / total;
                    head.score[j] += p as f32;
                    for (a, v) in acc.iter_mut().zip(rows.value(kvh, head.live[j])) {
                        *a += p * *v as f64;
                    }
                }
                out.extend(acc.iter().map(|a| *a as f32));
                // What the head read: the positions its last row attended (for a decode step,
                // the live set inside the model's window, before this call's eviction).
                read[h] = slots.iter().map(|&j| head.live[j]).collect();
            }
        }
        self.evict(cache);
        let out = Tensor::from_vec(out, (q_heads, t, d), &Device::Cpu)?
            .to_dtype(call.q.dtype())?
            .to_device(call.q.device())?;
        Ok(Attended { out, read: Read::Rows(read), searched: 0.0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{DenseKv, KvStore};
    use candle_core::{DType, Device};

    /// Random decode steps over one layer's keys: `context` keys, then `steps` one-token
    /// queries (4 query heads over 2 KV heads of 32 channels); the store holds every position.
    /// BUZZ's bounds hold whatever the scores are, so plain random rows test them (the
    /// structured workloads that tell methods apart are folio-eval's).
    struct Case {
        context: usize,
        k: Tensor,
        v: Tensor,
        queries: Vec<Tensor>,
    }

    impl Case {
        fn random(context: usize, steps: usize, seed: u64) -> Self {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let (kv_heads, q_heads, d, n) = (2, 4, 32, context + steps);
            let mut draw = |shape: (usize, usize, usize), spread: f32| {
                let x: Vec<f32> = (0..shape.0 * shape.1 * shape.2).map(|_| rng.random_range(-spread..spread)).collect();
                Tensor::from_vec(x, shape, &Device::Cpu).unwrap()
            };
            let (k, v) = (draw((kv_heads, n, d), 1.0), draw((kv_heads, n, d), 1.0));
            let queries = (0..steps).map(|_| draw((q_heads, 1, d), 3.0)).collect();
            Self { context, k, v, queries }
        }

        fn store(&self) -> DenseKv {
            let (kv_heads, n, d) = self.k.dims3().unwrap();
            let mut kv = DenseKv::new(1, kv_heads, d, DType::F32, &Device::Cpu);
            kv.write(0, 0, &self.k, &self.v).unwrap();
            kv.set_len(n).unwrap();
            kv
        }

        fn call<'a>(&'a self, step: usize, kv: &'a dyn KvStore, (layer, layers): (usize, usize)) -> AttnCall<'a> {
            let d = self.k.dim(2).unwrap();
            AttnCall {
                layer,
                layers,
                kv_layer: 0,
                q: &self.queries[step],
                q_start: self.context + step,
                kv,
                scale: 1.0 / (d as f32).sqrt(),
                window: None,
            }
        }
    }

    /// Over a long conversation the cache never exceeds its bound between calls, always holds
    /// the sinks and the window, and reads only what it holds.
    #[test]
    fn cache_stays_bounded_and_keeps_sinks_and_window() {
        let seed = rand::random();
        let case = Case::random(700, 300, seed);
        let kv = case.store();
        let buzz = Buzz::new(Budget::Tokens(120), Params::parse("buzz", &PARAMS, &[]).unwrap()).unwrap();
        let (w, t) = buzz.sizes(120);
        assert_eq!(4 + w + t, 120);
        for s in 0..case.queries.len() {
            let call = case.call(s, &kv, (5, 8));
            let q_start = call.q_start;
            let got = buzz.attend(&call).unwrap();
            let read = got.read.rows().unwrap().unwrap();
            let caches = buzz.caches.lock();
            for (h, head) in caches[&5].heads.iter().enumerate() {
                assert!(head.live.len() <= 120, "seed {seed}, step {s}: {} live", head.live.len());
                assert!(head.live.windows(2).all(|x| x[0] < x[1]));
                assert!((0..4).all(|p| head.live.contains(&p)), "sinks evicted");
                assert!((q_start + 1 - w..=q_start).all(|p| head.live.contains(&p)), "window evicted");
                // Query heads read their KV head's cache as it was before this call evicted:
                // everything on the first call (nothing scored, nothing evicted yet).
                let cap = if s == 0 { q_start + 1 } else { 121 };
                assert!(read[h * 2].len() <= cap && read[h * 2].len() >= head.live.len());
            }
        }
    }

    /// The fast path — live rows moved to the device after the first call, each step appended
    /// there, evictions chosen on the host and compacted on the device — decodes a conversation
    /// long enough for several evictions as the host reference does: the same outputs and reads.
    #[test]
    fn device_rows_follow_the_reference() {
        let seed = rand::random();
        let case = Case::random(700, 300, seed);
        let (kv, reference_kv) = (case.store(), crate::kv_cache::Reference(case.store()));
        let make = || Buzz::new(Budget::Tokens(120), Params::parse("buzz", &PARAMS, &[]).unwrap()).unwrap();
        let (fast, slow) = (make(), make());
        let (mut evictions, mut last_len) = (0, 0);
        for s in 0..case.queries.len() {
            let got = fast.attend(&case.call(s, &kv, (5, 8))).unwrap();
            let want = slow.attend(&case.call(s, &reference_kv, (5, 8))).unwrap();
            let diff = (got.out - &want.out).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-5, "seed {seed}, step {s}: outputs differ by {diff}");
            assert_eq!(got.read.rows().unwrap(), want.read.rows().unwrap(), "seed {seed}, step {s}: reads");
            let caches = fast.caches.lock();
            let rows = caches[&5].rows.as_ref().expect("the first call moves the live rows to the device");
            let live: Vec<u32> = caches[&5].heads.iter().flat_map(|h| h.live.iter().map(|&p| p as u32)).collect();
            assert_eq!(rows.pos.narrow(1, 0, rows.len).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap(), live);
            // A step adds a row; fewer than last time plus one is an eviction on the device.
            evictions += usize::from(s > 0 && rows.len <= last_len);
            last_len = rows.len;
        }
        assert!(evictions >= 2, "seed {seed}: {evictions} evictions on the device in {} steps", case.queries.len());
    }

    /// A call that continues the last one's positions continues its conversation, even one that
    /// is really a new prompt; `end_conversation` is what tells them apart (`reset` keeps it).
    #[test]
    fn a_conversation_ends_only_when_told() {
        let case = Case::random(300, 8, rand::random());
        let kv = case.store();
        let buzz = Buzz::new(Budget::Tokens(64), Params::parse("buzz", &PARAMS, &[]).unwrap()).unwrap();
        let (first, second) = (case.call(0, &kv, (5, 8)), case.call(1, &kv, (5, 8)));
        assert_eq!(second.q_start, first.q_start + 1, "consecutive decode steps");
        buzz.attend(&first).unwrap();
        buzz.reset();
        let read = buzz.attend(&second).unwrap().read.rows().unwrap().unwrap().into_owned();
        assert!(read[0].len() <= 65, "continued: {} keys read, the evicted stay evicted", read[0].len());
        buzz.end_conversation();
        assert!(buzz.caches.lock().is_empty());
        let read = buzz.attend(&second).unwrap().read.rows().unwrap().unwrap().into_owned();
        assert_eq!(read[0].len(), second.q_start + 1, "a new conversation reads every key first");
    }

    #[test]
    fn theorem_ratios_and_sizes() {
        let r: Vec<f64> = (3..=9).map(threshold_ratio).collect();
        let want = [2.5, 3.0, 13.0 / 3.0, 5.0, 6.25, 7.0, 8.2];
        assert!(r.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-9), "{r:?}");
        // The spec's example: B = 512, k = 4, s = 5 → w = 95 (rounding down), and T fills the
        // peak: 413 (the spec's 412 is r·w rounded, one token under the peak).
        let b = Buzz::new(Budget::Tokens(512), Params::parse("buzz", &PARAMS, &[]).unwrap()).unwrap();
        assert_eq!(b.sizes(512), (95, 413));
        assert_eq!(b.bound(512), 512);
    }
}
