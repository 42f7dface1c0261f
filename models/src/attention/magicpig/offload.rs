//! MagicPIG's step over the offloaded tier: the GPU attends the static part while the sample
//! is drawn and attended — by the CPU straight from host memory (the paper's split), or walked
//! by the GPU and attended by both. Apart from the method's declaration and its resident-tier
//! path (the parent module) because it knows where the host tier's rows and tables lie (the
//! file tier's step is `on_file`).

use super::*;
use crate::attention::DeviceDraw;
use lsh::Sample;

impl MagicPig {
    /// A decode step over the offloaded tier: the GPU attends the static part (sinks, window,
    /// the tokens after the saved prefix) while the sample is drawn and attended — as the paper
    /// splits it, by the CPU straight from host memory ([`Self::sample_on_host`], `gpu=0`), or
    /// by default walked by the GPU and attended by both ([`Self::sample_on_device`]; rows the
    /// the kernels do not read, a bf16-fp8 file's mixed K and V, stay on the CPU); the partials
    /// merge by LSE.
    pub(super) fn attend_fast(
        &self,
        call: &AttnCall<'_>,
        kv: &dyn DecodeTier,
        (keys, values): (&HostRows, &HostRows),
    ) -> Result<Attended> {
        let (lo, hi) = visible(call);
        // Stored tables, else built once from the layer's saved keys: means and norms from host
        // memory, codes on the device a chunk at a time.
        let ix = self.layer_index_with(call, hi, (kv.kv_heads(), kv.head_dim()), None, |plan| {
            let view = keys.host()?;
            let key = |h: usize, p: usize, out: &mut [f32]| view.row(h, p, out);
            let chunk = |a: usize, b: usize| kv.keys(call.kv_layer, a, b);
            let shape = (kv.kv_heads(), kv.head_dim());
            let centre = centre::of_rows(shape, plan.first..plan.end, &key);
            LayerIndex::build_with(shape, plan, centre, &chunk, (INDEX_CHUNK, kv.device()))
        })?;
        let Some(ix) = ix else {
            // Every token static: exact attention over the visible keys.
            return Dense.attend(call);
        };
        let queries = query_rows(call)?;
        let (heads, d) = (queries.len(), kv.head_dim());
        let q_flat: Vec<f32> = queries.iter().flat_map(|q| q[0].iter().copied()).collect();
        // The static part on the device, every head the same positions: queued first, so the
        // GPU attends it while the sample is drawn.
        let mut statics: Vec<u32> = (lo..ix.first.max(lo)).chain(ix.end.max(lo)..hi).map(|p| p as u32).collect();
        let idx = Tensor::from_vec(statics.repeat(heads), (heads, statics.len()), call.q.device())?;
        let (out_g, lse_g) = fast::selected_partial(call, kv, &idx, None)?;
        let dev = call.q.device();
        let on_device = if dev.is_cuda() && self.params.usize("gpu") == 1 && lsh::reads(keys, values) {
            ix.on_device(dev)?
        } else {
            None
        };
        let (sampled_part, drawn, walked) = match on_device {
            Some(on) => {
                let q_dev = call.q.to_dtype(candle_core::DType::F32)?.reshape((heads, d))?;
                let fp8_rows = matches!(keys.stored(), folio_kernels::select::Stored::Fp8 { .. });
                let start = gpu_heads(gpu_share(&self.params, fp8_rows), heads);
                let balancing = self.params.usize("balance") == 1;
                let lock = || self.balance.lock().unwrap_or_else(|e| e.into_inner());
                let on_gpu = if balancing { lock().on_gpu(heads, start) } else { start };
                // Spans that synchronise run the two sides in turn: no vote then.
                let vote = balancing && !profile::synchronising();
                let (part, drawn, walked, gpu_first) = Self::sample_on_device(
                    &ix,
                    &on,
                    (&q_dev, &q_flat, d),
                    (keys, values),
                    lo,
                    call.scale,
                    (on_gpu, vote),
                )?;
                if let Some(first) = gpu_first {
                    lock().vote(heads, first);
                }
                (part, drawn, walked)
            }
            None => Self::sample_on_host(&ix, (&q_flat, d), (keys, values), lo, call.scale, dev)?,
        };
        // What each head read (the harness's report), joined only if asked: the sample lies
        // between the sinks and the window.
        let at = statics.partition_point(|&p| (p as usize) < ix.first);
        let after = statics.split_off(at);
        let read = Read::Sampled { before: statics, picks: drawn, after };
        let static_part = AttnOutput { out: out_g.unsqueeze(1)?, lse: lse_g.unsqueeze(1)? };
        let out = merge(&static_part, &sampled_part)?.out.to_dtype(call.q.dtype())?;
        let searched = walked as f64 * ENTRY_BYTES / (2 * d) as f64 / heads as f64;
        Ok(Attended { out, read, searched })
    }

    /// The sample on the CPU, as the paper draws it: per query head, in up to WALK_PARTS ranges
    /// of segments, walk the tables, keep the visible keys, and attend them at once from host
    /// memory while they are this core's (each pick's stored norm for its weight, gathered in
    /// the walk). One task a (head, range), so that the heads end together on the cores (28
    /// whole heads were two rounds on 16 cores, the second a quarter idle) and the walk and the
    /// attention share a round of the pool; a range's picks are attended ATTEND_ROWS_PER_TASK
    /// at a time as tasks of their own, which idle cores take, so that a range holding most of
    /// its head's sample (attention clusters) does not end the round alone. The parts join by
    /// LSE. Returns the partial on `dev`, each head's picks, and the entries walked.
    pub(super) fn sample_on_host(
        ix: &LayerIndex,
        (q_flat, d): (&[f32], usize),
        (keys, values): (&HostRows, &HostRows),
        lo: usize,
        scale: f32,
        dev: &candle_core::Device,
    ) -> Result<(AttnOutput, Drawn, usize)> {
        let heads = q_flat.len() / d;
        let groups = heads / ix.heads.len();
        let (kh, vh) = (keys.host()?, values.host()?);
        let sampled = span(dev, "attention: sample", || {
            host_pool::install(|| {
                let codes: Vec<Vec<u32>> =
                    (0..heads).into_par_iter().map(|h| ix.query_codes(&q_flat[h * d..(h + 1) * d])).collect();
                let q_of = |h: usize| &q_flat[h * d..(h + 1) * d];
                let weights: Vec<(f32, f32)> = (0..heads).map(|h| ix.query_weights(h / groups, q_of(h))).collect();
                let (segs, parts) = (ix.segments(), WALK_PARTS.min(ix.segments()));
                let tasks: Vec<(usize, Range<usize>)> = (0..heads)
                    .flat_map(|h| (0..parts).map(move |p| (h, p * segs / parts..(p + 1) * segs / parts)))
                    .collect();
                let done = tasks
                    .into_par_iter()
                    .map(|(h, range)| {
                        let started = Instant::now();
                        let (found, walked) = ix.retrieve_segments(h / groups, &codes[h], range)?;
                        let norms = &ix.heads[h / groups].norms;
                        let (mut pick, mut picked_norms) = (Vec::with_capacity(found.len()), Vec::new());
                        for i in found.into_iter().filter(|&i| ix.first + i >= lo) {
                            pick.push((ix.first + i) as u32);
                            picked_norms.push(norms[i]);
                        }
                        let walk = started.elapsed();
                        let attended = pick
                            .par_chunks(ATTEND_ROWS_PER_TASK)
                            .enumerate()
                            .map(|(c, rows)| {
                                let started = Instant::now();
                                let norms = &picked_norms[c * ATTEND_ROWS_PER_TASK..];
                                let query = (q_of(h), weights[h]);
                                let part = attend_picked(ix, query, (&kh, &vh), h / groups, (rows, norms), scale)?;
                                Ok((part, started.elapsed()))
                            })
                            .collect::<Result<Vec<_>>>()?;
                        Ok((h, pick, attended, walked, walk))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut s = Sampled {
                    picks: vec![Vec::new(); heads],
                    threads: rayon::current_num_threads(),
                    ..Default::default()
                };
                let mut partials = Vec::new();
                for (h, pick, attended, walked, walk) in done {
                    s.picks[h].extend(pick);
                    s.walked += walked;
                    s.walking += walk;
                    for (part, took) in attended {
                        partials.push((h, part));
                        s.attending += took;
                    }
                }
                (s.out, s.lse) = lsh::merge_partials(heads, d, partials);
                Ok(s)
            })
        })?;
        // The span's split between the walk and the attention, as the pool's threads spent it.
        let threads = sampled.threads.max(1) as u32;
        profile::charge("attention: sample: walk (CPU time / threads)", sampled.walking / threads);
        profile::charge("attention: sample: attend (CPU time / threads)", sampled.attending / threads);
        let Sampled { picks, out, lse, walked, .. } = sampled;
        let (out, lse) = partial_to(dev, out, lse)?;
        let part = AttnOutput { out: out.unsqueeze(1)?, lse: lse.unsqueeze(1)? };
        Ok((part, Drawn::Host(picks), walked))
    }

    /// The sample walked on the GPU ([`lsh`]): the queries' codes from the projection on the
    /// device; one launch walks the CPU's heads' tables where they lie and one more writes what
    /// the host needs (the codes, for the walked count, and those heads' picks, a few hundred
    /// KB a layer) into host memory, so that the host starts while a third launch walks the
    /// GPU's heads' tables; then the first `on_gpu` query heads are attended by the
    /// GPU, reading their rows over the host link, while the CPU attends the others' in host
    /// memory — both sides at once, each at its own memory's rate: the walk is the GPU's
    /// strength (~9 ms a step at 1M against the CPU pool's 23); scattered rows both read at
    /// ~20–30 GB/s, the host in its own memory, the GPU over the link. The host waits for the
    /// CPU's heads' walk and their report alone: the GPU's walk of its own heads and its
    /// attention are queued behind them before the host waits (walking every head first made
    /// the host wait ~4 ms a step longer: 54.1 against 44.8 ms a token, docs/performance.md).
    /// With `vote`, also whether the GPU's part was done when the CPU's was (for the balance;
    /// `None` without both parts). The same keys as [`Self::sample_on_host`], the same weights.
    pub(super) fn sample_on_device(
        ix: &LayerIndex,
        on: &OnDevice,
        (q_dev, q_flat, d): (&Tensor, &[f32], usize),
        (keys, values): (&HostRows, &HostRows),
        lo: usize,
        scale: f32,
        (on_gpu, vote): (usize, bool),
    ) -> Result<(AttnOutput, Drawn, usize, Option<bool>)> {
        let heads = q_flat.len() / d;
        let groups = heads / ix.heads.len();
        let dev = on.weights.device();
        let q_of = |h: usize| &q_flat[h * d..(h + 1) * d];
        let weights: Vec<(f32, f32)> = (0..heads).map(|h| ix.query_weights(h / groups, q_of(h))).collect();
        // The GPU's heads' queries uploaded before the walk, not between the report and the
        // attention, where a copy from pageable memory could wait on the walk.
        let gpu_query = match on_gpu {
            0 => None,
            _ => {
                let query: Vec<f32> =
                    (0..on_gpu).flat_map(|h| q_of(h).iter().copied().chain([weights[h].0, weights[h].1])).collect();
                Some(Tensor::from_vec(query, (on_gpu, d + 2), dev)?)
            }
        };
        let keys_walked = (ix.first, lo.saturating_sub(ix.first));
        let (gpu_sample, report) = span(dev, "attention: sample: walk (GPU)", || {
            let codes = sparse::simhash_codes(q_dev, &on.projection, ix.bits, ix.tables)?;
            // The CPU's heads walked and reported first, so that the host starts on them while
            // the GPU walks its own; the report carries the codes (for the walked count).
            let host_report = match on_gpu < heads {
                true => Some(
                    on.tables
                        .walk(&codes, groups, on_gpu..heads, keys_walked)?
                        .report(0..heads - on_gpu, Some(&codes))?,
                ),
                false => None,
            };
            let gpu_sample = match on_gpu {
                0 => None,
                _ => Some(on.tables.walk(&codes, groups, 0..on_gpu, keys_walked)?),
            };
            let report = match (host_report, &gpu_sample) {
                (Some(report), _) => report,
                // Every head on the GPU: a report of none of its heads, for the codes.
                (None, Some(sample)) => sample.report(0..0, Some(&codes))?,
                (None, None) => return Err(Error::Invalid("magicpig: a layer of no query heads".into())),
            };
            Ok((gpu_sample, report))
        })?;
        let device_part = match (&gpu_query, &gpu_sample) {
            (Some(query), Some(sample)) => Some(span(dev, "attention: sample: attend (GPU)", || {
                let n = ix.end - ix.first;
                let w = lsh::Weights { table_and_norms: &on.weights, steps: BIAS_TABLE_STEPS, first: ix.first, n };
                let part = lsh::attend(query, sample, (keys, values), &w, scale)?;
                let done = vote.then(|| folio_runtime::device::Queued::now(dev)).transpose()?;
                Ok((part, done))
            })?),
            _ => None,
        };
        let (picks, codes) = span(dev, "attention: sample: picks to the host", || Ok(report.wait()?))?;
        let walked = codes.chunks(ix.tables).enumerate().map(|(h, c)| ix.walked(h / groups, c)).sum();
        let (host_part, gpu_first) = if on_gpu == heads {
            (None, None)
        } else {
            let (kh, vh) = (keys.host()?, values.host()?);
            let (out, lse) = span(dev, "attention: sample: attend (CPU)", || {
                host_pool::install(|| {
                    let rows: usize = picks.iter().map(Vec::len).sum();
                    let chunk =
                        rows.div_ceil(ATTEND_ROUNDS * rayon::current_num_threads()).clamp(1, ATTEND_ROWS_PER_TASK);
                    let tasks: Vec<(usize, &[u32])> = picks
                        .iter()
                        .enumerate()
                        .flat_map(|(i, p)| p.chunks(chunk).map(move |rows| (on_gpu + i, rows)))
                        .collect();
                    let parts = tasks
                        .into_par_iter()
                        .map(|(h, rows)| {
                            let kvh = h / groups;
                            // Gathered first, as the CPU's walk gathers them: independent
                            // loads in flight together, none in a row's chain of waits.
                            let norms: Vec<f32> =
                                rows.iter().map(|&p| ix.heads[kvh].norms[p as usize - ix.first]).collect();
                            let query = (q_of(h), weights[h]);
                            Ok((h - on_gpu, attend_picked(ix, query, (&kh, &vh), kvh, (rows, &norms), scale)?))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ok(lsh::merge_partials(heads - on_gpu, d, parts))
                })
            })?;
            // Whether the GPU's part was done when the CPU's was: the side that finished first.
            let gpu_first = device_part.as_ref().and_then(|(_, done)| done.as_ref()).map(|d| d.done()).transpose()?;
            (Some(partial_to(dev, out, lse)?), gpu_first)
        };
        // The GPU's heads first, then the CPU's: the heads' order.
        let (outs, lses): (Vec<Tensor>, Vec<Tensor>) =
            device_part.map(|(part, _)| part).into_iter().chain(host_part).unzip();
        let part = AttnOutput { out: Tensor::cat(&outs, 0)?.unsqueeze(1)?, lse: Tensor::cat(&lses, 0)?.unsqueeze(1)? };
        let first = gpu_sample.map(|sample| Box::new(sample) as Box<dyn DeviceDraw>);
        Ok((part, Drawn::Device { first, rest: picks }, walked, gpu_first))
    }
}

/// The CPU's attention over picked `rows` of KV head `kvh` for `query` (`q`, then `|q|` and
/// `q·mean` of the head's keys, [`LayerIndex::query_weights`]), each row weighted by the bias
/// of its cosine from its centred norm in `norms` (one per row).
fn attend_picked(
    ix: &LayerIndex,
    (q, (q_norm, q_mean)): (&[f32], (f32, f32)),
    rows_kv: (&select::HostView<'_>, &select::HostView<'_>),
    kvh: usize,
    (rows, norms): (&[u32], &[f32]),
    scale: f32,
) -> Result<lsh::Partial> {
    let bias = |j: usize, qk: f32| ix.logit_bias_from_dot((qk, q_mean), q_norm, norms[j]);
    Ok(lsh::attend_partial(q, rows_kv, kvh, rows, scale, &bias)?)
}

/// The CPU's partial (`out [heads·d]`, `lse [heads]`) on `dev` as `[heads, d]` and `[heads]`,
/// in one copy (each copy from pageable memory waits for itself).
fn partial_to(dev: &candle_core::Device, out: Vec<f32>, lse: Vec<f32>) -> Result<(Tensor, Tensor)> {
    let heads = lse.len();
    let d = out.len() / heads.max(1);
    let both = Tensor::from_vec([out, lse].concat(), heads * (d + 1), dev)?;
    Ok((both.narrow(0, 0, heads * d)?.reshape((heads, d))?, both.narrow(0, heads * d, heads)?))
}

/// The GPU's sample stays on the device until a report asks for the positions it read.
impl DeviceDraw for Sample {
    fn positions(&self) -> Result<Vec<Vec<u32>>> {
        Ok(Sample::positions(self)?)
    }
}
