//! MagicPIG's step over the file tier: the context's rows left in its file, the bucket lists in
//! a spill file beside it (the index's lists, `index/lists.rs`), the run starts and the keys' norms in memory.
//!
//! Why its own step: the host tier's split has the CPU attend the sample where the rows lie,
//! in host memory; here they lie on disk and reach the device through the tier's cache of
//! blocks, as every other method's picks do. So the CPU takes each query head's codes, reads
//! its runs (one read per table, every head's at once on the tier's read threads) and walks
//! them; the sample and the static part (sinks, window, the tokens after the saved prefix) are
//! gathered in one `[heads, s]` gather, each head's row padded with the first static position
//! and a weight of nothing (the `gpu`, `gpu_attend` and `balance` knobs split the host tier's
//! sample: here the device attends every head); the device takes each row's `q·k`, the CPU the sampled keys' biases from
//! it (their norms are in memory, the bias a function of the cosine), and one kernel attends
//! every row with its bias — the one softmax over both parts that Algorithm 1's LSE merge is.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device};

use super::*;

/// The bias of a padding position: its weight `exp(−1e30)` is nothing, and finite, so a row
/// of a head with fewer picks than another's sums no NaN.
const PAD_BIAS: f32 = -1e30;

impl MagicPig {
    /// A decode step over the file tier (rows in the file at `dir`): see the module docs.
    pub(super) fn attend_on_file(&self, call: &AttnCall<'_>, kv: &dyn DecodeTier, dir: &Path) -> Result<Attended> {
        let (lo, hi) = visible(call);
        let shape = (kv.kv_heads(), kv.head_dim());
        let ix = self.layer_index_with(call, hi, shape, Some(dir), |plan| build_on_file(call, kv, plan))?;
        let Some(ix) = ix else {
            // Every token static: exact attention over the visible keys.
            return Dense.attend(call);
        };
        let queries = query_rows(call)?;
        let heads = queries.len();
        let groups = heads / ix.heads.len();
        let dev = call.q.device();
        let found = span(dev, "attention: sample: walk (disk)", || {
            host_pool::install(|| {
                let codes: Vec<Vec<u32>> = (0..heads).into_par_iter().map(|h| ix.query_codes(&queries[h][0])).collect();
                let wants: Vec<(usize, &[u32])> = codes.iter().enumerate().map(|(h, c)| (h / groups, &c[..])).collect();
                ix.retrieve_many(&wants)
            })
        })?;
        let walked: usize = found.iter().map(|f| f.1).sum();
        let picks: Vec<Vec<u32>> = found
            .into_iter()
            .map(|(f, _)| f.into_iter().map(|i| ix.first + i).filter(|&p| p >= lo).map(|p| p as u32).collect())
            .collect();
        let mut statics: Vec<u32> = (lo..ix.first.max(lo)).chain(ix.end.max(lo)..hi).map(|p| p as u32).collect();
        let out = span(dev, "attention: sample: attend (device)", || {
            attend_rows(call, kv, &ix, (&statics, &picks), (&queries, groups))
        })?;
        // What each head read (the harness's report): the sample lies between the sinks and
        // the window.
        let at = statics.partition_point(|&p| (p as usize) < ix.first);
        let after = statics.split_off(at);
        let read = Read::Sampled { before: statics, picks: Drawn::Host(picks), after };
        let searched = walked as f64 * ENTRY_BYTES / (2 * shape.1) as f64 / heads as f64;
        Ok(Attended { out, read, searched })
    }
}

/// Every head's static rows and its picks, gathered through the tier and attended at once on
/// the device, each pick weighed by its bias: `[heads, 1, d]` in the query's dtype.
fn attend_rows(
    call: &AttnCall<'_>,
    kv: &dyn DecodeTier,
    ix: &LayerIndex,
    (statics, picks): (&[u32], &[Vec<u32>]),
    (queries, groups): (&[Vec<Vec<f32>>], usize),
) -> Result<Tensor> {
    let heads = picks.len();
    let s = statics.len() + picks.iter().map(Vec::len).max().unwrap_or(0);
    let pad = statics.first().or_else(|| picks.iter().find_map(|p| p.first())).copied().unwrap_or(0);
    let mut idx = Vec::with_capacity(heads * s);
    for p in picks {
        idx.extend_from_slice(statics);
        idx.extend_from_slice(p);
        idx.resize(idx.len() + s - statics.len() - p.len(), pad);
    }
    let dev = call.q.device();
    let idx_dev = Tensor::from_slice(&idx, (heads, s), dev)?;
    let (k, v) = span(dev, "attention: gather", || kv.gather_listed(call.kv_layer, &idx_dev, &idx, call.q_start + 1))?;
    if k.dim(0)? != heads {
        return Err(Error::Invalid(format!(
            "magicpig: the file tier gave {} rows of keys for {heads} heads",
            k.dim(0)?
        )));
    }
    // Each row's q·k, on the device where the rows are; the biases from them on the CPU.
    let q = call.q.squeeze(1)?;
    let qk = k.to_dtype(DType::F32)?.matmul(&q.to_dtype(DType::F32)?.unsqueeze(2)?)?;
    let qk: Vec<f32> = qk.flatten_all()?.to_device(&Device::Cpu)?.to_vec1()?;
    let mut bias = vec![0f32; heads * s];
    for (h, p) in picks.iter().enumerate() {
        let t = &ix.heads[h / groups];
        let weights = ix.query_weights(h / groups, &queries[h][0]);
        let row = &mut bias[h * s..(h + 1) * s];
        let dots = &qk[h * s..(h + 1) * s];
        for (j, &pos) in p.iter().enumerate() {
            let at = statics.len() + j;
            let norm = t.norms[pos as usize - ix.first];
            row[at] = ix.logit_bias_from_dot((dots[at], weights.1), weights.0, norm);
        }
        row[statics.len() + p.len()..].fill(PAD_BIAS);
    }
    let bias = Tensor::from_vec(bias, (heads, s), dev)?;
    let (out, _) =
        span(dev, "attention: kernel", || Ok(sparse::decode_attention_rows(&q, &k, &v, s, Some(&bias), call.scale)?))?;
    Ok(out.unsqueeze(1)?.to_dtype(call.q.dtype())?)
}

/// A layer's index over the file tier's keys: their means and norms from host memory where
/// the tier read them there, else from two passes over them a chunk at a time; hashed on the
/// tier's device a chunk at a time.
fn build_on_file(call: &AttnCall<'_>, kv: &dyn DecodeTier, plan: &Plan) -> Result<LayerIndex> {
    let started = Instant::now();
    let (shape, dev) = ((kv.kv_heads(), kv.head_dim()), kv.device());
    let chunk = |a: usize, b: usize| kv.keys(call.kv_layer, a, b);
    let keys = plan.first..plan.end;
    let centre = span(dev, "magicpig index: means and norms", || match kv.host_keys(call.kv_layer) {
        Some(rows) => {
            let view = rows.host()?;
            Ok(centre::of_rows(shape, keys, &|h, p, out| view.row(h, p, out)))
        }
        None => centre::of_chunks(shape, keys, &chunk, INDEX_CHUNK),
    })?;
    let centred = started.elapsed();
    let ix = span(dev, "magicpig index: codes and lists", || {
        LayerIndex::build_with(shape, plan, centre, &chunk, (INDEX_CHUNK, dev))
    })?;
    tracing::info!(
        layer = call.layer,
        keys = plan.end - plan.first,
        tables = plan.tables,
        keys_in_memory = kv.host_keys(call.kv_layer).is_some(),
        centre_s = centred.as_secs_f64(),
        seconds = started.elapsed().as_secs_f64(),
        "magicpig's tables built over the file tier"
    );
    Ok(ix)
}
