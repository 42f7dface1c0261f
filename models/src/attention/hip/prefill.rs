//! HiP's sparse prefill (the paper's §3.2 and §5.1; docs/engine.md): each block of `block_q`
//! consecutive queries attends to the sinks, the `keys` keys of its best key blocks and a
//! local window, instead of to every earlier key.
//!
//! Why: a dense prefill's attention grows with the square of the context — at 1M tokens of the
//! 7B shape it is most of the prefill's time (docs/performance.md) — while a query block's
//! sparse attention reads about `sinks + keys + window + block_q` keys whatever the context (the
//! budget rounded up to whole key blocks, the window up to `block_k − 1` longer). The
//! mask of a query block is the decode search's ([`search_blocks`]) with one change the paper
//! makes for blocks of queries: a key block's score is the best dot product of any of the
//! block's representative queries (every `stride_q`-th row) with any of its keys. Every key of
//! the searched region lies at or before the block's first query, so the chosen blocks are visible to
//! all of its rows; only the window is causal row by row.
//!
//! Two implementations, held together by the tests on fresh random inputs: [`Self::reference`]
//! writes each row's softmax over its visible set from the definition; [`Self::attend`] gathers
//! a query block's sinks and chosen rows once and attends them and the window with
//! folio-kernels' attention primitives, merged by LSE (the same primitives run on a GPU).

use candle_core::{Device, Tensor};
use folio_kernels::attention::{attention_block, merge, AttnOutput, Mask};

use super::search_blocks;
use crate::attention::select::{attend_row_lse, dot, LayerRows};
use crate::error::{Error, Result};

/// One layer's sparse prefill: the shape of its masks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparsePrefill {
    /// Queries that share a mask (b_q; 64 in the paper's healing runs).
    pub block_q: usize,
    /// Every `stride_q`-th query of a block scores the key blocks (b_sq; 2 there).
    pub stride_q: usize,
    /// Keys per key block (b_k, the decode's `block`).
    pub block_k: usize,
    /// Keys each query block keeps of the searched region (k).
    pub keys: usize,
    /// Leading keys every query attends (the attention sinks).
    pub sinks: usize,
    /// Keys up to each query block's first query, it included, that every row attends (at
    /// least: the window starts where the searched region's last whole key block ends).
    pub window: usize,
}

impl SparsePrefill {
    /// Checked: every size at least one, the stride within the block.
    pub fn new(
        block_q: usize,
        stride_q: usize,
        block_k: usize,
        keys: usize,
        (sinks, window): (usize, usize),
    ) -> Result<Self> {
        if block_q == 0 || stride_q == 0 || block_k == 0 || keys == 0 || stride_q > block_q {
            return Err(Error::Invalid(format!(
                "sparse prefill: block_q {block_q}, stride_q {stride_q}, block_k {block_k} and keys {keys} must be at \
                 least 1, the stride at most the block"
            )));
        }
        Ok(Self { block_q, stride_q, block_k, keys, sinks, window })
    }

    /// The searched region `first..window_start` for a query block whose first query sits at
    /// `p0`: after the sinks, ending a whole number of key blocks on, at least `window` keys
    /// before `p0 + 1`.
    pub fn region(&self, p0: usize) -> (usize, usize) {
        let first = self.sinks.min(p0 + 1);
        let wanted = (p0 + 1).saturating_sub(self.window).max(first);
        (first, first + (wanted - first) / self.block_k * self.block_k)
    }

    /// The key positions a query block keeps of its region, ascending: its queries `rows`
    /// (the block's, in order; the first at `p0`) against KV head `kvh` of `kv`. The whole
    /// region when it holds no more key blocks than the budget.
    pub fn mask(&self, rows: &[&[f32]], kv: &LayerRows, kvh: usize, p0: usize) -> Vec<usize> {
        let (first, window_start) = self.region(p0);
        let b = self.block_k;
        let blocks = (window_start - first) / b;
        let block_keys = |blk: usize| first + blk * b..first + (blk + 1) * b;
        let scorers: Vec<&[f32]> = rows.iter().step_by(self.stride_q).copied().collect();
        let (chosen, _) = search_blocks(blocks, self.keys.div_ceil(b).max(1), |blk| {
            let best = |q: &[f32]| block_keys(blk).map(|p| dot(q, kv.key(kvh, p))).fold(f32::NEG_INFINITY, f32::max);
            scorers.iter().map(|q| best(q)).fold(f32::NEG_INFINITY, f32::max)
        });
        chosen.into_iter().flat_map(block_keys).collect()
    }

    /// The sparse attention of `q` (`[heads, t, d]` f32 rows, flat; query `i` at position
    /// `q_start + i`) over the keys of `kv` (every key up to the last query's position), from
    /// the definition: per row the methods' reference softmax ([`attend_row_lse`], in f64) of
    /// `scale · q·k` over the sinks, its block's chosen keys and the window up to itself.
    /// `(out [heads·t·d], lse [heads·t])`.
    pub fn reference(
        &self,
        q: &[f32],
        kv: &LayerRows,
        (heads, t): (usize, usize),
        q_start: usize,
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let d = kv.head_dim;
        let group = heads / kv.kv_heads;
        let (mut out, mut lse) = (Vec::with_capacity(heads * t * d), Vec::with_capacity(heads * t));
        for h in 0..heads {
            let row = |i: usize| &q[(h * t + i) * d..(h * t + i + 1) * d];
            for b0 in (0..t).step_by(self.block_q) {
                let b1 = (b0 + self.block_q).min(t);
                let p0 = q_start + b0;
                let rows: Vec<&[f32]> = (b0..b1).map(row).collect();
                let chosen = self.mask(&rows, kv, h / group, p0);
                let (first, window_start) = self.region(p0);
                for i in b0..b1 {
                    let visible = (0..first).chain(chosen.iter().copied()).chain(window_start..=q_start + i);
                    let (o, l) = attend_row_lse(row(i), kv, h / group, visible.map(|p| (p, 0.0)), scale);
                    out.extend(o);
                    lse.push(l);
                }
            }
        }
        (out, lse)
    }

    /// [`Self::reference`]'s attention through folio-kernels' primitives: per query head and
    /// block, the sinks' and chosen keys' rows gathered once and attended by every row (all
    /// visible: they lie before the block), the window attended causally where it lies, the
    /// two merged by LSE. `q [heads, t, d]` on the CPU; returns `[heads, t, d]` and
    /// `[heads, t]` f32.
    pub fn attend(&self, q: &Tensor, kv: &LayerRows, q_start: usize, scale: f32) -> Result<AttnOutput> {
        let (heads, t, d) = q.dims3()?;
        if t == 0 || d != kv.head_dim || kv.kv_heads == 0 || heads % kv.kv_heads != 0 {
            return Err(Error::Invalid(format!(
                "sparse prefill: {heads} query heads of {t} rows and {d} dims over {} KV heads of {} dims",
                kv.kv_heads, kv.head_dim
            )));
        }
        let group = heads / kv.kv_heads;
        let q = q.to_dtype(candle_core::DType::F32)?;
        let flat = q.flatten_all()?.to_vec1::<f32>()?;
        let rows_of = |kvh: usize, positions: &mut dyn Iterator<Item = usize>, values: bool| -> Result<Tensor> {
            let data: Vec<f32> = positions
                .flat_map(|p| if values { kv.value(kvh, p) } else { kv.key(kvh, p) }.iter().copied())
                .collect();
            let n = data.len() / d;
            Ok(Tensor::from_vec(data, (1, n, d), &Device::Cpu)?)
        };
        let (mut outs, mut lses) = (Vec::with_capacity(heads), Vec::with_capacity(heads));
        for h in 0..heads {
            let kvh = h / group;
            let (mut head_out, mut head_lse) = (Vec::new(), Vec::new());
            for b0 in (0..t).step_by(self.block_q) {
                let b1 = (b0 + self.block_q).min(t);
                let p0 = q_start + b0;
                let rows: Vec<&[f32]> = (b0..b1).map(|i| &flat[(h * t + i) * d..(h * t + i + 1) * d]).collect();
                let chosen = self.mask(&rows, kv, kvh, p0);
                let (first, window_start) = self.region(p0);
                let qb = q.narrow(0, h, 1)?.narrow(1, b0, b1 - b0)?;
                let mut parts = Vec::with_capacity(2);
                // The window and the block itself, causal row by row, where they lie (empty
                // only where the region reaches the block's first query, which it then holds).
                let end = q_start + b1;
                if window_start < end {
                    let (wk, wv) =
                        (rows_of(kvh, &mut (window_start..end), false)?, rows_of(kvh, &mut (window_start..end), true)?);
                    parts.push(attention_block(&qb, &wk, &wv, window_start, Mask::causal(p0), scale)?);
                }
                let picked = first + chosen.len();
                if picked > 0 {
                    let gathered = || (0..first).chain(chosen.iter().copied());
                    let (pk, pv) = (rows_of(kvh, &mut gathered(), false)?, rows_of(kvh, &mut gathered(), true)?);
                    // Every gathered key lies before the block: visible to all of its rows (at
                    // gathered positions 0..picked, below the queries').
                    parts.push(attention_block(&qb, &pk, &pv, 0, Mask::causal(picked), scale)?);
                }
                let part = match parts.as_slice() {
                    [one] => one.clone(),
                    [a, b] => merge(a, b)?,
                    _ => return Err(Error::Invalid(format!("sparse prefill: a query at {p0} sees no key"))),
                };
                head_out.push(part.out);
                head_lse.push(part.lse);
            }
            outs.push(Tensor::cat(&head_out, 1)?);
            lses.push(Tensor::cat(&head_lse, 1)?);
        }
        Ok(AttnOutput { out: Tensor::cat(&outs, 0)?, lse: Tensor::cat(&lses, 0)? })
    }
}

#[cfg(test)]
mod tests;
