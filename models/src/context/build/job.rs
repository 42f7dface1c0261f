//! One prefill job from its checkpoint to the finished file: resuming or starting fresh, the
//! layer loop with its writers and checkpoints, and the final header and rename (the parent's
//! docs say why each step is so). The partial folder's bookkeeping — stores, persists,
//! preallocation, errors — is in `persist.rs`.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Tensor;
use folio_context_file::atomic::{check_replaceable, sync_dir};
use folio_context_file::format::{checksum, file_checksum};
use folio_context_file::partial::{open_if_present, read_checkpoint, write_checkpoint, Checkpoint};
use folio_runtime::device::Queued;

use super::persist::{sync, Persist, StoreWriter};
use super::{
    Base, BuildOptions, BuildReport, HiddenPlace, Job, Ledger, Paths, Progress, StageSeconds, CHECKPOINT_COST_FACTOR,
    INITIAL_PERSIST_RATE,
};
use crate::context::cost::{PrefillCost, Timed};
use crate::error::{human_bytes, Error, Result};
use crate::prefill::{layer_output, run_layer, FileHidden, Hidden, HiddenStore, RopeTables};

impl Job<'_> {
    pub(super) fn compute(&self) -> String {
        format!("{} {:?}", crate::device_name(self.model.device()), self.model.dtype()).to_lowercase()
    }

    /// Whether the checkpoint is this job's: same header, compute, base, and the same token
    /// ids and document spans by checksum (the header records only their sizes, and a resume
    /// must not mix layers of other tokens of the same length).
    pub(super) fn same_job(&self, cp: &Checkpoint) -> bool {
        let tokens: Vec<u8> = self.plan.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        cp.job == self.job
            && cp.compute == self.compute()
            && cp.base_tokens == self.base_tokens()
            && cp.checksums.first() == Some(&checksum(&tokens))
            && cp.checksums.get(1) == Some(&checksum(&self.docs_json))
    }

    /// Tokens taken from the base context.
    pub(super) fn base_tokens(&self) -> usize {
        self.base.map_or(0, |b| b.keep)
    }

    /// The tokens this job computes.
    pub(super) fn computed(&self) -> &[u32] {
        &self.plan.tokens[self.base_tokens()..]
    }

    pub(super) fn hidden_bytes(&self) -> u64 {
        (self.computed().len() * self.model.config().hidden_size * self.model.dtype().size_in_bytes()) as u64
    }

    /// The base context's K and V of `layer` for its kept tokens, `[kv_heads, keep, head_dim]`
    /// on the device.
    pub(super) fn prefix(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>> {
        let Some(Base { file, keep }) = self.base else { return Ok(None) };
        let cfg = self.model.config();
        let shape = (cfg.num_kv_heads, file.tokens().len(), cfg.head_dim);
        let (k, v) = file.layer_kv(layer)?;
        let dev = self.model.device();
        let kept = |x: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(x, shape, dev)?.narrow(1, 0, keep)?.contiguous()?.to_dtype(self.model.dtype())?)
        };
        Ok(Some((kept(k)?, kept(v)?)))
    }

    /// Whether the bytes a checkpoint vouches for are on disk as it says: every section written
    /// so far and the hidden states the next layer reads, by checksum.
    pub(super) fn intact(&self, cp: &Checkpoint, tmp: &Path, hidden_paths: &[PathBuf; 2]) -> Result<bool> {
        let Some(file) = open_if_present(tmp)? else { return Ok(false) };
        for (s, want) in self.job.sections.iter().zip(&cp.checksums) {
            if file_checksum(&file, s.offset, s.bytes).ok().as_ref() != Some(want) {
                return Ok(false);
            }
        }
        if cp.layers_done == 0 {
            return Ok(true);
        }
        let p = &hidden_paths[cp.hidden_file.unwrap_or((cp.layers_done - 1) % 2)];
        let Some(f) = open_if_present(p)? else { return Ok(false) };
        let cfg = self.model.config();
        let stored = FileHidden::new(f, p, cfg.hidden_size, self.model.dtype(), self.model.device());
        Ok(stored.stored_checksum(self.computed().len()).ok().as_ref() == Some(&cp.hidden))
    }

    /// Runs the job to the finished file: resumes its checkpoint or starts fresh, computes the
    /// layers left (each layer's K/V written beside the next layer's compute, checkpoints as
    /// the module docs say), then writes the header and renames the file into place.
    pub(super) fn run(&mut self, opts: &BuildOptions) -> Result<BuildReport> {
        let started = Instant::now();
        let paths = Paths::in_dir(self.dir);
        let cfg = self.model.config();
        // `t` tokens in the file, `n` of them computed here (all, unless growing a context).
        let (t, n) = (self.plan.tokens.len(), self.computed().len());
        let section = self.job.kv_dtype.max_section_bytes(cfg.num_kv_heads * t, cfg.head_dim);
        let checkpoint = self.open_checkpoint(opts, &paths, t, section)?;
        self.chunk = checkpoint.chunk;
        let working_set = crate::prefill::chunk_working_set(self.model, t, (section, self.prefill), self.chunk);
        let file = OpenOptions::new().read(true).write(true).open(&paths.tmp).map_err(|e| Error::io(&paths.tmp, e))?;
        let place = opts.hidden_in.unwrap_or_else(|| self.hidden_place(working_set, opts.memory_budget));
        // Hidden states on the device are part of its working set.
        let working_set = working_set + if place == HiddenPlace::Device { 2 * self.hidden_bytes() } else { 0 };
        let mut ledger = Ledger {
            sections: checkpoint.checksums.clone(),
            resumed_layers: checkpoint.layers_done,
            persisted_layer: checkpoint.layers_done.checked_sub(1),
            checkpoint,
            stages: StageSeconds::default(),
            checkpoints: 0,
            marks: Vec::new(),
            spare: Default::default(),
            timed: Vec::new(),
        };
        let (mut hidden, files) = self.hidden_stores(place, &paths, &mut ledger)?;
        let rope = RopeTables::new(self.model, t - n, n, self.chunk)?;
        let run_start = Instant::now();
        ledger.marks.push(Queued::timed(self.model.device())?);
        std::thread::scope(|scope| {
            let mut run = LayerRun {
                place,
                files,
                hidden: &mut hidden,
                file: &file,
                paths: &paths,
                scope,
                prior: opts.prior_cost,
            };
            self.layers(&mut run, &mut ledger, &rope, run_start)
        })?;
        let finished = Finished { place, working_set, started, run_start };
        self.finish(file, &hidden, &paths, ledger, finished)
    }

    /// The checkpoint this run continues: a matching one resumed (when its bytes are intact and
    /// its chunk fits today's budget), else a fresh start; another job's is refused unless
    /// `--restart` discards it.
    fn open_checkpoint(&mut self, opts: &BuildOptions, paths: &Paths, t: usize, section: u64) -> Result<Checkpoint> {
        let layers = self.model.config().num_layers;
        match read_checkpoint(&paths.checkpoint)? {
            Some(cp) if self.same_job(&cp) => {
                // A resume computes with the chunk it started with (the bytes depend on it):
                // that chunk's working set is what runs, and it must fit today's budget;
                // `--restart` plans anew, otherwise the interrupted prefill is left as it is.
                let need = crate::prefill::chunk_working_set(self.model, t, (section, self.prefill), cp.chunk);
                match opts.memory_budget.filter(|&b| need > b && cp.layers_done < layers) {
                    Some(b) if !opts.restart => Err(Error::Invalid(format!(
                        "this prefill resumes in chunks of {} tokens, as it started, which need {} of \
                         working memory; the budget is {}: give a budget of at least that, or --restart \
                         to plan it anew",
                        cp.chunk,
                        human_bytes(need),
                        human_bytes(b)
                    ))),
                    Some(_) => {
                        self.owns_dir = true;
                        self.start_fresh(paths)
                    }
                    None => {
                        self.owns_dir = true;
                        if self.intact(&cp, &paths.tmp, &paths.hidden)? {
                            Ok(cp)
                        } else {
                            // What the checkpoint names did not all reach the disk (an OS crash
                            // or a power cut): start over rather than resume from wrong bytes.
                            self.start_fresh(paths)
                        }
                    }
                }
            }
            Some(cp) if !opts.restart => Err(self.mismatch(&cp)),
            _ => {
                self.owns_dir = true;
                self.start_fresh(paths)
            }
        }
    }

    /// The two hidden stores of `place`, and which hidden file backs each: store `i` is backed
    /// by `files[i]`, and the checkpoint's file must be the store the next layer reads
    /// (`layer_output` of the last finished layer). A resume not in files loads it.
    fn hidden_stores(
        &self,
        place: HiddenPlace,
        paths: &Paths,
        ledger: &mut Ledger,
    ) -> Result<([HiddenStore; 2], [usize; 2])> {
        let done = ledger.checkpoint.layers_done;
        let cp_file = ledger.cp_file();
        let files = if done == 0 || cp_file == (done - 1) % 2 { [0, 1] } else { [1, 0] };
        let mut hidden = [self.store(place, &paths.hidden[files[0]])?, self.store(place, &paths.hidden[files[1]])?];
        if done > 0 && place != HiddenPlace::Files {
            let at = Instant::now();
            let p = &paths.hidden[cp_file];
            let f = File::open(p).map_err(|e| Error::io(p, e))?;
            hidden[(done - 1) % 2].load(&f, p, self.computed().len(), self.chunk)?;
            ledger.stages.hidden_io += at.elapsed().as_secs_f64();
        }
        Ok((hidden, files))
    }

    /// The layers left, from the checkpoint's on. The host does not wait for a layer before
    /// queueing the next, so the device never idles between layers; a layer's K/V reach the
    /// file on writer threads beside the next layer. A failed or cancelled layer checkpoints
    /// the last finished one first (a cancel is resumed from it).
    fn layers<'scope>(
        &mut self,
        run: &mut LayerRun<'_, 'scope, '_>,
        ledger: &mut Ledger,
        rope: &RopeTables,
        run_start: Instant,
    ) -> Result<()> {
        let (layers, n, t) = (self.model.config().num_layers, self.computed().len(), self.plan.tokens.len());
        let mut in_flight: Option<Persist<'scope>> = None;
        let mut store_in_flight: Option<StoreWriter<'scope>> = None;
        // The last checkpoint's time, and what the next one is expected to cost.
        let (mut since, mut persist_cost) = (Instant::now(), self.hidden_bytes() as f64 / INITIAL_PERSIST_RATE);
        for layer in ledger.checkpoint.layers_done..layers {
            let prefix = self.prefix(layer)?;
            let done_before = (layer - ledger.resumed_layers) * n;
            let on_progress = &mut self.on_progress;
            let (timed, prior, base) = (&mut ledger.timed, run.prior, t - n);
            let mut last = (0, Instant::now());
            let mut report = |tokens: usize| {
                // Each chunk's time, and the cost fitted to every chunk timed so far.
                let now = Instant::now();
                timed.push(Timed { from: base + last.0, to: base + tokens, seconds: (now - last.1).as_secs_f64() });
                last = (tokens, now);
                // The last run's cost until this one has timed two whole layers: the first
                // layer runs alone, later ones beside the previous one's store, and on a small
                // machine the two differ by a quarter (docs/engine.md, *Prefill time*). With no
                // last run, the rate until a whole layer is timed (a few chunks fit badly).
                let done = timed.iter().map(|t| t.to - t.from).sum::<usize>();
                let cost = match prior {
                    // A prior without an attention term takes it from this run's chunks; one
                    // with it keeps its shape at this run's level (cost.rs says why).
                    Some(p) if done < TRUSTED_LAYERS * n && p.per_pair == 0.0 => Some(p.with_pairs_fitted(timed)),
                    Some(p) if done < TRUSTED_LAYERS * n => Some(p.scaled_to(timed)),
                    Some(_) => PrefillCost::fit(timed).or(prior),
                    None if done >= n => PrefillCost::fit(timed),
                    None => None,
                };
                let at = At { layer, layers, n, tokens, base };
                on_progress(&progress(at, done_before, run_start, cost.as_ref()))
            };
            let at = Instant::now();
            let computed = &self.plan.tokens[t - n..];
            let result =
                run_layer(self.model, layer, computed, prefix.as_ref(), run.hidden, (rope, self.prefill), &mut report);
            let (k, v) = match result {
                Ok(kv) => kv,
                Err(e) => {
                    // Best effort: the error reported is the layer's, and a failure here leaves
                    // the previous checkpoint as it was.
                    let _ = self.keep_last(run, ledger, layer, store_in_flight.take(), in_flight.take());
                    return Err(e);
                }
            };
            // On a GPU the layer is queued, not done: the time here is the host's, and the
            // device's replaces it at the end (`marks`).
            ledger.stages.compute += at.elapsed().as_secs_f64();
            // The layer before's K and V reach the file (their copies run beside this layer,
            // once the device has finished that one): their buffers are free for this layer's.
            if let Some(w) = store_in_flight.take() {
                self.finish_store(w, ledger, &run.paths.tmp)?;
            }
            ledger.marks.push(Queued::timed(self.model.device())?);
            store_in_flight = Some(self.start_store(run.scope, run.file, layer, (k, v), ledger)?);
            if layer + 1 == layers {
                break;
            }
            if run.place == HiddenPlace::Files {
                if let Some(w) = store_in_flight.take() {
                    self.finish_store(w, ledger, &run.paths.tmp)?;
                }
                self.checkpoint_files(run, ledger, layer)?;
                continue;
            }
            if let Some(p) = in_flight.take_if(|p| p.writer.is_finished()) {
                // (Its layer is an earlier one: its sections were collected when the next
                // layer's writer started.)
                persist_cost = self.finish_persist(p, ledger, &run.paths.checkpoint)?;
                since = Instant::now();
            }
            // A checkpoint when the work since the last one is worth its cost many times over
            // (CHECKPOINT_COST_FACTOR).
            if in_flight.is_none() && since.elapsed().as_secs_f64() >= CHECKPOINT_COST_FACTOR * persist_cost {
                let free = 1 - ledger.cp_file();
                in_flight =
                    Some(self.start_persist(run.hidden, layer, free, run.paths, run.scope, &mut ledger.stages)?);
                ledger.persisted_layer = Some(layer);
            }
        }
        if let Some(w) = store_in_flight.take() {
            self.finish_store(w, ledger, &run.paths.tmp)?;
        }
        // The finished file does not need the last checkpoint's hidden states.
        if let Some(p) = in_flight.take() {
            let _ = p.writer.join();
        }
        Ok(())
    }

    /// A failed or cancelled `layer`: the writes in flight finished and the last finished
    /// layer checkpointed, unless a checkpoint already holds it.
    fn keep_last<'scope>(
        &self,
        run: &mut LayerRun<'_, 'scope, '_>,
        ledger: &mut Ledger,
        layer: usize,
        store: Option<StoreWriter<'scope>>,
        persist: Option<Persist<'scope>>,
    ) -> Result<()> {
        if let Some(w) = store {
            self.finish_store(w, ledger, &run.paths.tmp)?;
        }
        if let Some(p) = persist {
            self.finish_persist(p, ledger, &run.paths.checkpoint)?;
        }
        let last = layer.checked_sub(1).filter(|&l| ledger.persisted_layer != Some(l));
        if let (Some(l), true) = (last, run.place != HiddenPlace::Files) {
            let free = 1 - ledger.cp_file();
            let p = self.start_persist(run.hidden, l, free, run.paths, run.scope, &mut ledger.stages)?;
            self.finish_persist(p, ledger, &run.paths.checkpoint)?;
        }
        Ok(())
    }

    /// With the hidden states in files, every layer is a checkpoint: its output is on disk as
    /// it is written. No fsync here: the checkpoint names the checksums of what the resume will
    /// read, and a resume checks them (see `intact`).
    fn checkpoint_files(&self, run: &LayerRun<'_, '_, '_>, ledger: &mut Ledger, layer: usize) -> Result<()> {
        let at = Instant::now();
        let n = self.computed().len();
        let cp = &mut ledger.checkpoint;
        cp.hidden = run.hidden[layer % 2]
            .written_checksum(n)
            .ok_or_else(|| Error::Invalid(format!("layer {layer} wrote its hidden states out of order")))?;
        cp.hidden_file = Some(run.files[layer % 2]);
        cp.layers_done = layer + 1;
        cp.checksums = ledger.sections.clone();
        write_checkpoint(&run.paths.checkpoint, cp)?;
        ledger.checkpoints += 1;
        ledger.persisted_layer = Some(layer);
        ledger.stages.store += at.elapsed().as_secs_f64();
        Ok(())
    }

    /// The finished run: the device's time for the layers, the next token, the header with
    /// every checksum, the fsync, and the rename over `out`.
    fn finish(
        &self,
        file: File,
        hidden: &[HiddenStore; 2],
        paths: &Paths,
        mut ledger: Ledger,
        run: Finished,
    ) -> Result<BuildReport> {
        let (layers, t, n) = (self.model.config().num_layers, self.plan.tokens.len(), self.computed().len());
        let stages = &mut ledger.stages;
        // The device's time for the layers, where it has a queue (the host's time on the CPU).
        let marks = &ledger.marks;
        let device_secs = marks.windows(2).map(|m| Ok(m[1].seconds_since(&m[0])?)).sum::<Result<Option<f64>>>()?;
        if let Some(secs) = device_secs {
            stages.compute = secs;
        }
        ledger.checkpoint.checksums = std::mem::take(&mut ledger.sections);
        let at = Instant::now();
        let last = layer_output(hidden, layers - 1).read(n - 1, 1)?;
        let next_token = self.model.head(&last)?.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        let header = self.finished_header(&ledger.checkpoint)?;
        self.write_at(&file, &paths.tmp, 0, &header.encode())?;
        sync(&file, &paths.tmp)?;
        drop(file);
        // The checkpoint goes first: a crash between the two leaves a folder that starts over,
        // never a checkpoint whose context.tmp has already been renamed away.
        std::fs::remove_file(&paths.checkpoint).map_err(|e| Error::io(&paths.checkpoint, e))?;
        sync_dir(&paths.checkpoint)?;
        check_replaceable(self.out)?;
        std::fs::rename(&paths.tmp, self.out).map_err(|e| Error::io(self.out, e))?;
        sync_dir(self.out)?;
        let computed = (layers - ledger.resumed_layers) * n;
        let run_secs = run.run_start.elapsed().as_secs_f64();
        stages.store += at.elapsed().as_secs_f64();
        // File stores do their I/O inside the forward passes: counted there, moved here. (The
        // final row read for the LM head counts in both; clamp the rounding.)
        let file_io: f64 = hidden.iter().map(|h| h.io_time().as_secs_f64()).sum();
        stages.hidden_io += file_io;
        stages.compute = (stages.compute - file_io).max(0.0);
        Ok(BuildReport {
            path: self.out.to_owned(),
            tokens: t,
            computed_tokens: n,
            layers,
            documents: self.plan.documents.len(),
            kv_dtype: header.kv_dtype,
            prefill: self.prefill.name(),
            file_bytes: header.file_bytes,
            seconds: run.started.elapsed().as_secs_f64(),
            tokens_per_s: if run_secs > 0.0 { computed as f64 / layers as f64 / run_secs } else { 0.0 },
            resumed_layers: ledger.resumed_layers,
            chunk: self.chunk,
            working_set_bytes: run.working_set,
            next_token,
            stages: ledger.stages,
            hidden_in: run.place,
            checkpoints: ledger.checkpoints,
            cost: PrefillCost::fit_kept(&ledger.timed).filter(|_| self.prefill.keeps_fit(n)),
        })
    }
}

/// What the layers of one run share: where the hidden states live and which file backs each
/// store, the context file being written, and the scope its writer threads run in.
pub(super) struct LayerRun<'a, 'scope, 'env> {
    place: HiddenPlace,
    files: [usize; 2],
    hidden: &'a mut [HiddenStore; 2],
    file: &'scope File,
    paths: &'scope Paths,
    scope: &'scope std::thread::Scope<'scope, 'env>,
    /// The last run's cost (the ETA's until this run has timed its own chunks).
    prior: Option<PrefillCost>,
}

/// Whole layers a run times before its ETA follows its own cost rather than the last run's.
const TRUSTED_LAYERS: usize = 2;

/// What the finished report needs from the run's start.
struct Finished {
    place: HiddenPlace,
    working_set: u64,
    started: Instant,
    run_start: Instant,
}

/// Where a run stands: `tokens` of the `n` it computes done in `layer` of `layers`, the first
/// of them at context position `base`.
struct At {
    layer: usize,
    layers: usize,
    n: usize,
    tokens: usize,
    base: usize,
}

/// The progress at `at`: the fraction of the run, its rate from the tokens computed since
/// `run_start` (`done_before` in the earlier layers), and the ETA from `cost` — the rest of
/// this layer, whose later tokens attend to more, then the layers left — or, with no cost yet,
/// from the rate.
fn progress(at: At, done_before: usize, run_start: Instant, cost: Option<&PrefillCost>) -> Progress {
    let At { layer, layers, n, tokens, base } = at;
    let secs = run_start.elapsed().as_secs_f64().max(1e-9);
    let rate = (done_before + tokens) as f64 / secs;
    let left = ((layers - layer) * n - tokens) as f64;
    let eta_s = match cost {
        Some(c) => Some(
            c.layer_seconds(base + tokens, base + n) + (layers - layer - 1) as f64 * c.layer_seconds(base, base + n),
        ),
        None => (rate > 0.0).then(|| left / rate),
    };
    Progress {
        layer,
        layers,
        layer_tokens: tokens,
        tokens: n,
        fraction: (layer * n + tokens) as f64 / (layers * n) as f64,
        tokens_per_s: rate / layers as f64,
        eta_s,
    }
}
