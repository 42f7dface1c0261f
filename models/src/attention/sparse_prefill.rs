//! Sparse prefill (issue #48; docs/engine.md, "Sparse prefill"): MInference's block-sparse
//! pattern, each block of `block` queries attending to the sinks, the `keys` keys of the key
//! blocks its estimate ranks highest and a local window, instead of to every earlier key.
//!
//! Why: a dense prefill's attention grows with the square of the context — at a million tokens
//! of the 7B shape it is most of the prefill's time (docs/performance.md) — while a sparse query
//! block reads `sinks + keys + window + block` keys whatever the context.
//!
//! The pattern (MInference, §3.2 "Block-Sparse"): queries and keys are cut into blocks of
//! `block` at absolute positions (multiples of `block`); a query block's estimate of a key
//! block is the dot product of their mean rows, the best over the query heads of one KV head
//! (the heads of a group share their keys, so they share the pick: one gather serves them all).
//! Query block `j` keeps the `keys / block` best key blocks of its region — after the sink
//! blocks, before the window's `window / block` blocks — and attends to the sinks, those, the
//! window and itself (causally). A query block whose region holds no more blocks than the
//! budget keeps all of it: it is dense. A block cut by the chunk's edge (a prefill resumed at a
//! position that is not a multiple of `block`, or the last chunk) is estimated from the rows it
//! has here.
//!
//! Why this estimate rather than HiP's hierarchical search: it is two small products and a
//! top-k on the device per chunk (the pooled scores are `block²` times fewer than the
//! attention's), where HiP's search for every query block of a chunk is `log2(blocks)` rounds
//! each waiting on the host.
//!
//! Two implementations, held together by the tests on fresh random inputs: [`SparsePrefill::reference`]
//! writes each row's softmax over its visible set from the definition; the [`Attention`] path
//! ([`SparsePrefill::attend_chunk`]) estimates with tensors, gathers every kept row of a batch
//! of query blocks once (a KV head at a time) and attends them with folio-kernels' attention
//! (the tensor-core kernel on a GPU), the dense rows with the same kernel over every key.

use std::sync::Mutex;

use candle_core::{DType, Tensor};
use folio_kernels::attention::{attention_block, AttnOutput, Mask};

use super::cost::{CostInput, StepCost};
use super::select::{attend_row_lse, dot, LayerRows};
use super::{Attended, Attention, AttnCall, Knobs, MethodSpec, Needs, Tiers};
use crate::error::{Error, Result};
use crate::profile::span;

/// Bytes one batch of query blocks stages on the device (pooled scores, gathered rows and
/// their positions): batches stay well under a consumer card's headroom at a million tokens.
pub const STAGED_BYTES: u64 = 256 << 20;
/// Added to the estimate of a key block outside a query block's region (a sink block, the
/// window, later blocks): finite, so that sums stay numbers, and far below any real score.
const OUTSIDE_REGION: f64 = -1e30;

const SPEC: MethodSpec = MethodSpec {
    name: "sparse-prefill",
    summary: "a prefill's block-sparse attention (MInference's pattern): sinks, the best key blocks, a window",
    paper: "Jiang et al., MInference 1.0 (2024)",
    default_budget: None,
    params: &[],
    needs: Needs::NONE,
    tiers: Tiers::FAST,
    cost: |_: &CostInput<'_>| StepCost::default(),
    build: |_, _, _| {
        Err(Error::Invalid("sparse-prefill is a prefill mode (`--prefill sparse`), not a decode method".into()))
    },
};

/// The shape of a sparse prefill's masks; every size in tokens, the last three rounded up to
/// whole blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparsePrefill {
    /// Query and key block size (64 in MInference).
    pub block: usize,
    /// Keys each sparse query block keeps of its region (the budget).
    pub keys: usize,
    /// Leading keys every query attends (the attention sinks).
    pub sinks: usize,
    /// Keys before each query block that all of its rows attend.
    pub window: usize,
}

impl SparsePrefill {
    /// What `--prefill sparse` means without knobs: MInference's block of 64, 2,048 kept keys
    /// (32 blocks), one sink block and a 1,024-key window — 3,200 keys a row at most.
    pub const DEFAULT: Self = Self { block: 64, keys: 2048, sinks: 64, window: 1024 };

    /// Checked: a block and a budget of at least one.
    pub fn new(block: usize, keys: usize, sinks: usize, window: usize) -> Result<Self> {
        if block == 0 || keys == 0 {
            return Err(Error::Invalid(format!("sparse prefill: block {block} and keys {keys} must be at least 1")));
        }
        Ok(Self { block, keys, sinks, window })
    }

    /// `block=64,keys=2048,sinks=64,window=1024`, any of them (the rest [`Self::DEFAULT`]'s).
    pub fn parse(knobs: &str) -> Result<Self> {
        let mut s = Self::DEFAULT;
        for part in knobs.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| Error::Invalid(format!("sparse prefill: `{part}` is not name=value")))?;
            let value: usize = value.trim().parse().map_err(|_| {
                Error::Invalid(format!("sparse prefill: {name} = `{value}` is not a whole number of tokens"))
            })?;
            match name.trim() {
                "block" => s.block = value,
                "keys" => s.keys = value,
                "sinks" => s.sinks = value,
                "window" => s.window = value,
                other => {
                    return Err(Error::Invalid(format!(
                        "sparse prefill has no knob `{other}` (block, keys, sinks, window)"
                    )))
                }
            }
        }
        Self::new(s.block, s.keys, s.sinks, s.window)
    }

    /// The knobs as [`Self::parse`] reads them.
    pub fn knobs(&self) -> String {
        format!("block={},keys={},sinks={},window={}", self.block, self.keys, self.sinks, self.window)
    }

    /// Kept key blocks, sink blocks and window blocks of a sparse query block.
    fn blocks(&self) -> (usize, usize, usize) {
        (self.keys.div_ceil(self.block), self.sinks.div_ceil(self.block), self.window.div_ceil(self.block))
    }

    /// The key blocks query block `j` chooses among (its region).
    pub fn region(&self, j: usize) -> std::ops::Range<usize> {
        let (_, sinks, window) = self.blocks();
        sinks..j.saturating_sub(window).max(sinks)
    }

    /// The first query block whose region holds more blocks than the budget (the blocks
    /// before it attend densely).
    pub fn first_sparse_block(&self) -> usize {
        let (n, sinks, window) = self.blocks();
        sinks + n + window + 1
    }

    /// Keys a sparse query row reads at most (the rest of the prefill is dense).
    pub fn keys_per_row(&self) -> usize {
        let (n, sinks, window) = self.blocks();
        (n + sinks + window + 1) * self.block
    }

    /// The positions query block `j` attends before its own block: the sinks, the blocks of
    /// `chosen` (ascending) and the window.
    fn before<'a>(&self, j: usize, chosen: &'a [usize]) -> impl Iterator<Item = usize> + Clone + 'a {
        let b = self.block;
        let (_, sinks, _) = self.blocks();
        let window = self.region(j).end * b..j * b;
        (0..sinks * b).chain(chosen.iter().flat_map(move |&c| c * b..(c + 1) * b)).chain(window)
    }

    /// The best `keys / block` key blocks of query block `j`'s region by the estimate of
    /// `means`, the mean rows of the block's queries of each head of a group, ascending; ties to
    /// the earlier block.
    fn choose(&self, j: usize, means: &[Vec<f32>], kv: &LayerRows, kvh: usize) -> Vec<usize> {
        let (n, _, _) = self.blocks();
        let b = self.block;
        let mut scored: Vec<(f32, usize)> = self
            .region(j)
            .map(|c| {
                let mut mean = vec![0f32; kv.head_dim];
                for p in c * b..(c + 1) * b {
                    mean.iter_mut().zip(kv.key(kvh, p)).for_each(|(m, x)| *m += x / b as f32);
                }
                (means.iter().map(|q| dot(q, &mean)).fold(f32::NEG_INFINITY, f32::max), c)
            })
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut chosen: Vec<usize> = scored.into_iter().take(n).map(|(_, c)| c).collect();
        chosen.sort_unstable();
        chosen
    }

    /// Device bytes one query block of a batch stages: its pooled scores over `key_blocks`
    /// (before and after the best of the group), its queries in f32, its positions, and its
    /// gathered K and V rows of one KV head.
    fn staged_per_block(&self, (heads, kv_heads, d): (usize, usize, usize), key_blocks: usize, dtype: DType) -> u64 {
        let (b, rows) = (self.block as u64, self.keys_per_row() as u64);
        let scores = ((heads + kv_heads) * key_blocks * 4) as u64;
        scores + b * (heads * d * 4) as u64 + rows * (kv_heads * 4 + 2 * d * dtype.size_in_bytes()) as u64
    }

    /// Device bytes a chunk of `rows` queries at most stages at once over a context of
    /// `tokens` (batches of query blocks up to [`STAGED_BYTES`]), and the key blocks' means: what
    /// the chunk plan counts beside a dense prefill's working set.
    pub fn staged_bytes(&self, shape: (usize, usize, usize), tokens: usize, rows: usize, dtype: DType) -> u64 {
        let key_blocks = tokens / self.block;
        let batch = self.staged_per_block(shape, key_blocks, dtype) * rows.div_ceil(self.block) as u64;
        batch.min(STAGED_BYTES) + (key_blocks * shape.1 * shape.2 * 4) as u64
    }

    /// The sparse prefill's attention of `q` (`[heads, t, d]` f32 rows, flat; query `i` at
    /// position `q_start + i`) over the keys of `kv` (every key up to the last query's), from the
    /// definition: per row the methods' reference softmax ([`attend_row_lse`], in f64) of
    /// `scale · q·k` over what the row sees. `(out [heads·t·d], lse [heads·t])`.
    pub fn reference(
        &self,
        q: &[f32],
        kv: &LayerRows,
        (heads, t): (usize, usize),
        q_start: usize,
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let (d, b) = (kv.head_dim, self.block);
        let group = heads / kv.kv_heads;
        let row = |h: usize, i: usize| &q[(h * t + i) * d..(h * t + i + 1) * d];
        // Per query block: its rows here and, when sparse, each KV head's chosen blocks.
        let blocks: Vec<usize> = (q_start / b..(q_start + t).div_ceil(b)).collect();
        let chosen: Vec<Vec<Vec<usize>>> = blocks
            .iter()
            .map(|&j| {
                if j < self.first_sparse_block() {
                    return Vec::new();
                }
                let rows = (j * b).max(q_start) - q_start..((j + 1) * b).min(q_start + t) - q_start;
                (0..kv.kv_heads)
                    .map(|kvh| {
                        let means: Vec<Vec<f32>> = (kvh * group..(kvh + 1) * group)
                            .map(|h| {
                                let mut m = vec![0f32; d];
                                for i in rows.clone() {
                                    m.iter_mut().zip(row(h, i)).for_each(|(m, x)| *m += x / rows.len() as f32);
                                }
                                m
                            })
                            .collect();
                        self.choose(j, &means, kv, kvh)
                    })
                    .collect()
            })
            .collect();
        let (mut out, mut lse) = (Vec::with_capacity(heads * t * d), Vec::with_capacity(heads * t));
        for h in 0..heads {
            let kvh = h / group;
            for i in 0..t {
                let p = q_start + i;
                let j = p / b;
                let picks = &chosen[j - blocks[0]];
                let (o, l) = if picks.is_empty() {
                    attend_row_lse(row(h, i), kv, kvh, (0..=p).map(|k| (k, 0.0)), scale)
                } else {
                    let visible = self.before(j, &picks[kvh]).chain(j * b..=p);
                    attend_row_lse(row(h, i), kv, kvh, visible.map(|k| (k, 0.0)), scale)
                };
                out.extend(o);
                lse.push(l);
            }
        }
        (out, lse)
    }
}

/// The attention [`crate::prefill::run_layer`] runs for one layer of a sparse prefill: the
/// pattern, and the mean rows of the layer's key blocks so far (kept across its chunks: a
/// key block's mean never changes once its keys are written).
pub struct SparseAttention {
    pattern: SparsePrefill,
    means: Mutex<Option<Tensor>>,
    /// [`STAGED_BYTES`] (the tests make batches of one block).
    staged: u64,
}

impl SparseAttention {
    /// For one layer's prefill (the means are that layer's).
    pub fn new(pattern: SparsePrefill) -> Self {
        Self { pattern, means: Mutex::new(None), staged: STAGED_BYTES }
    }

    /// Mean rows `[kv_heads, blocks, d]` f32 of key blocks `0..blocks` of `k`, the ones not yet
    /// kept computed now.
    fn key_means(&self, k: &Tensor, blocks: usize) -> Result<Tensor> {
        let mut kept = self.means.lock().map_err(|_| Error::Invalid("sparse prefill: a poisoned lock".into()))?;
        let have = kept.as_ref().map_or(Ok(0), |m| m.dim(1))?;
        if have < blocks {
            let (kv_heads, _, d) = k.dims3()?;
            let b = self.pattern.block;
            let fresh = k
                .narrow(1, have * b, (blocks - have) * b)?
                .to_dtype(DType::F32)?
                .reshape((kv_heads, blocks - have, b, d))?
                .mean(2)?;
            *kept = Some(match kept.take() {
                Some(old) => Tensor::cat(&[&old, &fresh], 1)?,
                None => fresh,
            });
        }
        Ok(kept.as_ref().expect("set above").narrow(1, 0, blocks)?)
    }

    /// The fast path: queries `q [heads, t, d]` at positions `q_start..` over `k`, `v`
    /// (`[kv_heads, q_start + t, d]`, every key so far). Output `[heads, t, d]` f32 and LSE.
    pub fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor, q_start: usize, scale: f32) -> Result<AttnOutput> {
        let (heads, t, d) = q.dims3()?;
        let (kv_heads, len, _) = k.dims3()?;
        if t == 0 || len != q_start + t || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::Invalid(format!(
                "sparse prefill: {heads} heads of {t} rows from {q_start} over {kv_heads} KV heads of {len} keys"
            )));
        }
        let b = self.pattern.block;
        let dense_rows = (self.pattern.first_sparse_block() * b).saturating_sub(q_start).min(t);
        let mut parts = Vec::new();
        if dense_rows > 0 {
            let end = q_start + dense_rows;
            let (dk, dv) = (k.narrow(1, 0, end)?, v.narrow(1, 0, end)?);
            parts.push(span(q.device(), "attention: sparse, dense rows", || {
                Ok(attention_block(&q.narrow(1, 0, dense_rows)?, &dk, &dv, 0, Mask::causal(q_start), scale)?)
            })?);
        }
        // The sparse rows in batches of query blocks of one shape (rows here, and keys of their
        // own block up to the last): whole blocks together, a block cut by the chunk's edge alone.
        let mut batch: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        let shape = |(j, rows): &(usize, std::ops::Range<usize>)| (rows.len(), q_start + rows.end - j * b);
        let per_block = self.pattern.staged_per_block((heads, kv_heads, d), (q_start + t).div_ceil(b), q.dtype());
        let most = (self.staged / per_block.max(1)).max(1) as usize;
        let mut i = dense_rows;
        while i < t {
            let j = (q_start + i) / b;
            let block = (j, i..((j + 1) * b - q_start).min(t));
            if batch.first().is_some_and(|first| shape(first) != shape(&block)) || batch.len() == most {
                parts.push(self.attend_blocks(q, (k, v), &batch, q_start, scale)?);
                batch.clear();
            }
            i = block.1.end;
            batch.push(block);
        }
        if !batch.is_empty() {
            parts.push(self.attend_blocks(q, (k, v), &batch, q_start, scale)?);
        }
        let out = Tensor::cat(&parts.iter().map(|p| &p.out).collect::<Vec<_>>(), 1)?;
        let lse = Tensor::cat(&parts.iter().map(|p| &p.lse).collect::<Vec<_>>(), 1)?;
        Ok(AttnOutput { out, lse })
    }

    /// Query blocks `batch` (`(j, rows of q)`, consecutive, every one sparse, all of one shape:
    /// rows here and keys of their own block up to the last) estimated, their kept rows gathered
    /// and attended. Everything stays on the device: the region as a penalty added to the
    /// scores, the top-k's picks turned into positions by tensor arithmetic.
    fn attend_blocks(
        &self,
        q: &Tensor,
        (k, v): (&Tensor, &Tensor),
        batch: &[(usize, std::ops::Range<usize>)],
        q_start: usize,
        scale: f32,
    ) -> Result<AttnOutput> {
        let (heads, _, d) = q.dims3()?;
        let (kv_heads, dev) = (k.dim(0)?, q.device());
        let group = heads / kv_heads;
        let (nb, rows) = (batch.len(), batch[0].1.len());
        let (first_row, first_j) = (batch[0].1.start, batch[0].0);
        let (n, sinks, _) = self.pattern.blocks();
        let b = self.pattern.block;
        // Consecutive sparse blocks: their regions end at consecutive key blocks.
        let first_end = self.pattern.region(first_j).end;
        let key_blocks = first_end + nb - 1;
        // The estimate: each block's mean query rows against the key blocks' mean rows, the
        // best of a group's heads, a penalty outside the region; the best `n` of each block.
        // Timed apart in a profiled prefill (`folio bench prefill --profile`), as is each step.
        let picked = span(dev, "attention: sparse estimate", || {
            let qb = q.narrow(1, first_row, nb * rows)?.to_dtype(DType::F32)?.reshape((heads, nb, rows, d))?.mean(2)?;
            let means = self.key_means(k, key_blocks)?;
            let scores = qb.reshape((kv_heads, group * nb, d))?.matmul(&means.t()?)?;
            let scores = scores.reshape((kv_heads, group, nb, key_blocks))?.max(1)?;
            let c = Tensor::arange(0f32, key_blocks as f32, dev)?.unsqueeze(0)?;
            let ends = Tensor::arange(first_end as f32, (first_end + nb) as f32, dev)?.unsqueeze(1)?;
            // 1 on and after a block's region end, 1 on the sink blocks (whole numbers in f32).
            let after = c.broadcast_sub(&ends)?.affine(1.0, 1.0)?.clamp(0f32, 1f32)?;
            let sink = c.affine(-1.0, sinks as f64)?.clamp(0f32, 1f32)?;
            let outside = after.broadcast_add(&sink)?.affine(OUTSIDE_REGION, 0.0)?;
            let scores = scores.broadcast_add(&outside)?.reshape((kv_heads * nb, key_blocks))?;
            Ok(folio_kernels::select::topk(&scores, n)?)
        })?;
        // Positions `[kv_heads, nb, width]`: the sinks, the picked blocks' keys, and the window
        // with the block's own keys up to its last row (the same length for every block here).
        let seen = q_start + batch[0].1.end - first_j * b;
        let near = (first_j - first_end) * b + seen;
        let range = |len: usize| -> Result<Tensor> { Ok(Tensor::arange(0u32, len as u32, dev)?) };
        let chosen = picked
            .affine(b as f64, 0.0)?
            .unsqueeze(2)?
            .broadcast_add(&range(b)?.reshape((1, 1, b))?)?
            .reshape((kv_heads, nb, n * b))?;
        let sink_rows = range(sinks * b)?.reshape((1, 1, sinks * b))?.broadcast_as((kv_heads, nb, sinks * b))?;
        let starts = Tensor::arange(first_end as u32, (first_end + nb) as u32, dev)?.affine(b as f64, 0.0)?;
        let near_rows = starts
            .reshape((1, nb, 1))?
            .broadcast_add(&range(near)?.reshape((1, 1, near))?)?
            .broadcast_as((kv_heads, nb, near))?;
        let idx = Tensor::cat(&[&sink_rows.contiguous()?, &chosen, &near_rows.contiguous()?], 2)?;
        let width = idx.dim(2)?;
        let mut outs = Vec::with_capacity(kv_heads);
        for kvh in 0..kv_heads {
            let ids = idx.get(kvh)?.flatten_all()?;
            let gather = |x: &Tensor| -> Result<Tensor> {
                span(dev, "attention: sparse gather", || {
                    Ok(x.get(kvh)?.index_select(&ids, 0)?.reshape((nb, width, d))?)
                })
            };
            // The group's heads of each block side by side: query head `bi·group + g` reads
            // gathered block `bi` (grouped-query attention's mapping).
            let qh = q
                .narrow(0, kvh * group, group)?
                .narrow(1, first_row, nb * rows)?
                .reshape((group, nb, rows, d))?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((nb * group, rows, d))?;
            // Every gathered key before the block's own sits before its first row; the own
            // block's last `rows` keys are the queries' own positions: causal at `width - rows`.
            let (gk, gv) = (gather(k)?, gather(v)?);
            let a = span(dev, "attention: sparse kernel", || {
                Ok(attention_block(&qh, &gk, &gv, 0, Mask::causal(width - rows), scale)?)
            })?;
            let out = a.out.reshape((nb, group, rows, d))?.transpose(0, 1)?.reshape((group, nb * rows, d))?;
            let lse = a.lse.reshape((nb, group, rows))?.transpose(0, 1)?.reshape((group, nb * rows))?;
            outs.push(AttnOutput { out, lse });
        }
        let out = Tensor::cat(&outs.iter().map(|p| &p.out).collect::<Vec<_>>(), 0)?;
        let lse = Tensor::cat(&outs.iter().map(|p| &p.lse).collect::<Vec<_>>(), 0)?;
        Ok(AttnOutput { out, lse })
    }
}

impl Attention for SparseAttention {
    fn knobs(&self) -> Knobs<'_> {
        Knobs { spec: &SPEC, budget: None, params: None }
    }

    /// A chunk of the prefill over the store's keys so far. A model with a sliding window of
    /// its own is refused (its window already bounds the keys; a file of it labelled sparse
    /// would not be). What was read is not reported: a prefill keeps no reads.
    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let t = call.q.dim(1)?;
        if let Some(w) = call.window {
            return Err(Error::Invalid(format!(
                "this model attends within a sliding window of {w} tokens: prefill it densely (--prefill dense)"
            )));
        }
        let mut segs = call.kv.segments(call.kv_layer, call.q_start + t)?;
        if segs.len() != 1 || segs[0].start != 0 {
            return Err(Error::Invalid("sparse prefill: the layer's keys are not in one piece".into()));
        }
        let seg = segs.remove(0);
        let a = self.attend_chunk(call.q, &seg.k, &seg.v, call.q_start, call.scale)?;
        Ok(Attended::dense(a.out.to_dtype(call.q.dtype())?))
    }
}

#[cfg(test)]
mod tests;
