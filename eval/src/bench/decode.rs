//! Decode over a long offloaded context with a model of a real shape (`folio bench --shape`).
//!
//! Speed and memory depend on shapes, not weight values, so the model is built from the shape
//! facts of a real config (assets/shapes/*.json) with random weights on the device, and the
//! context's K/V rows are random rows written straight into the offloaded host tier (no
//! prefill: at a million tokens of a 7B shape that alone is many minutes; prefill has its own
//! bench); with `--kv-on-disk` they are written to a file and read on the file tier instead
//! (`file`: a context larger than the host budget). Every figure comes with its limit,
//! measured in the same run:
//!
//! * decode ms/token over the timed steps after the warm-up: the mean first (what a user waits for on
//!   average, HiP's refresh steps included), then the median, p10 and p90 and p90 ÷ mean (a
//!   spike shows there), beside the *floor*: the bytes a step must move (the weights read and
//!   the method's index on the device; the picked rows, or all rows for dense and the exact
//!   top-k scan, over the host link; MagicPIG's sample, read by the CPU in host memory) ÷ the
//!   device's copy bandwidth, the link's page-locked copy rate and the host's read bandwidth
//!   (every core summing a buffer), all measured in the same run; the floor is the largest of
//!   the three times, as the paths can overlap, and the report names the one that binds;
//! * the same step on a consumer card's link: the link's bytes at PCIe 4.0 x16's ~25 GB/s
//!   (an RTX 4090's) instead of the measured rate, everything else as measured. The link time
//!   is taken as not overlapped with anything (a step waits for its rows), so the projected
//!   mean is the measured mean plus the extra link time;
//! * peak device memory as the driver reports it (total − free, sampled every 0.5 ms), checked
//!   against the VRAM budget; host RSS; host bytes of the offloaded K/V;
//! * on the file tier, the disk's sequential read rate (its limit) and each step's disk bytes,
//!   reads, cache hits and overlap with the step before.
//!
//! The memory a run will need is planned before anything is allocated and refused, with the
//! breakdown, when it exceeds the budget; the measured peak is then checked too.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device};
use folio_models::attention::cost::{CostInput, Shape, StepCost};
use folio_models::attention::{Attention, Channels, MethodChoice, Resources, Tier};
use folio_models::config::ModelConfig;
use folio_models::context::KvDtype;
use folio_models::device_name;
use folio_models::error::{human_bytes, Error, Result};
use folio_models::kv_cache::KvStore;
use folio_models::kv_cache::{FileStats, OffloadKv};
use folio_models::model::{Logits, Model, Quantize};
use folio_models::plan::{copy_bandwidth, host_read_bandwidth, parameters, weight_bytes};
use folio_runtime::device::{host_to_device_rate, keep_pool, MemorySampler};
use folio_runtime::host_budget;
use folio_runtime::host_memory::{huge_page_bytes, peak_rss, reset_peak_rss};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

mod file;
mod fill;
mod plan;
pub use file::FileSteps;
use fill::fill_tier;
use plan::{plan_host, plan_memory};

/// Standard deviation of the random weights (transformers' `initializer_range` default).
pub const INIT_STD: f64 = 0.02;
/// Bytes copied to measure the device's and the host link's bandwidth, and device copies timed.
const BANDWIDTH_BYTES: usize = 1 << 30;
const COPIES: usize = 20;
/// What a consumer card's host link moves, bytes/s: PCIe 4.0 x16 (an RTX 4090's) delivers
/// about 25 GB/s of its 31.5 GB/s raw rate to page-locked copies.
pub const PCIE4_X16: f64 = 25e9;
/// Device memory for a step's transients beyond what the plan counts per token (cuBLAS
/// workspace, logits, activations, the scan chunks of dense and exact top-k).
const WORKSPACE_BYTES: u64 = 1 << 30;

/// What a decode bench runs: the shape, the context, the methods in turn, and the budget.
pub struct DecodeBench {
    /// A model shape: a real model's config.json facts (assets/shapes/*.json); weights are random.
    pub shape: PathBuf,
    /// Tokens of context in the offloaded K/V before decoding.
    pub context: usize,
    /// Each decodes over the same model and context in turn.
    pub methods: Vec<MethodChoice>,
    /// Device memory the run may use; `None`: the whole device.
    pub vram_budget: Option<u64>,
    /// The weights each round of methods decodes with: `None` in the compute dtype, else the
    /// projections quantized (`--weights bf16,q8_0,q4k`); one model at a time over the same K/V.
    pub weights: Vec<Option<Quantize>>,
    /// Decode steps timed (their mean leads the report), after `warmup` steps.
    pub steps: usize,
    pub warmup: usize,
    /// The context's K/V stored as a context file of this dtype stores it, read in place and
    /// widened by the gathers, as a reopened file is; `None`: page-locked in the compute dtype.
    pub kv_dtype: Option<KvDtype>,
    /// Leave the rows in a file in this folder (stored as `kv_dtype`, bf16 without one) and read
    /// them on the file tier, through a cache of what the host budget leaves: a context larger
    /// than the host budget. The file is removed when the run ends.
    pub kv_on_disk: Option<PathBuf>,
    /// After the timed steps, [`PROFILE_STEPS`] more three times: the host's share of a step,
    /// op by op on the host's clock, then with the device synchronised around each op.
    pub profile: bool,
}

/// Steps a profiled method decodes in each of its three passes.
pub const PROFILE_STEPS: usize = 8;

/// Where a decode step's time goes.
#[derive(Serialize)]
pub struct DecodeProfile {
    pub steps: usize,
    /// ms from a step's start until the host has queued its work (the forward pass returned),
    /// and until its token is on the host: when they are close, the host's launches (and the
    /// waits the method makes) bound the step, not the device.
    pub host_ms: f64,
    pub step_ms: f64,
    /// Each span's ms per step: the host's time queueing it (nothing synchronised), and its own
    /// device time (synchronised around it); its calls per step.
    pub spans: Vec<DecodeSpan>,
    /// The step's ms in the synchronised pass, for the share outside the spans.
    pub synced_step_ms: f64,
}

#[derive(Serialize)]
pub struct DecodeSpan {
    pub name: &'static str,
    pub host_ms: f64,
    pub device_ms: f64,
    pub calls: f64,
}

/// One greedy decode step after `token`: the next token, the seconds until the forward pass
/// returned (its work queued) and until the token was on the host.
fn decode_step(model: &Model, kv: &mut OffloadKv, method: &dyn Attention, token: u32) -> Result<(u32, f64, f64)> {
    let start = Instant::now();
    let logits = model.forward(&[token], kv, method, Logits::Last)?;
    let queued = start.elapsed().as_secs_f64();
    let next = folio_kernels::argmax::argmax(&logits)?;
    Ok((next, queued, start.elapsed().as_secs_f64()))
}

/// [`DecodeProfile`] of `method` from `token` on: [`PROFILE_STEPS`] steps timed as the bench
/// times them, again with the spans on the host's clock, and again on the device's.
fn profile_decode(model: &Model, kv: &mut OffloadKv, method: &dyn Attention, mut token: u32) -> Result<DecodeProfile> {
    use folio_models::profile::{finish, start, Clock, Spans};
    let steps = |token: &mut u32, kv: &mut OffloadKv| -> Result<(f64, f64)> {
        let (mut host, mut total) = (0.0, 0.0);
        for _ in 0..PROFILE_STEPS {
            let (next, queued, took) = decode_step(model, kv, method, *token)?;
            (*token, host, total) = (next, host + queued, total + took);
        }
        Ok((host, total))
    };
    let (host, total) = steps(&mut token, kv)?;
    let mut clocked = |clock: Clock, token: &mut u32| -> Result<(Spans, f64)> {
        start(clock);
        let pass = steps(token, kv);
        let spans = finish();
        Ok((spans, pass?.1))
    };
    let (on_host, _) = clocked(Clock::Host, &mut token)?;
    let (on_device, synced) = clocked(Clock::Device, &mut token)?;
    let per_step = |x: f64| x * 1e3 / PROFILE_STEPS as f64;
    let spans = on_device
        .into_iter()
        .map(|(name, secs, calls)| DecodeSpan {
            name,
            host_ms: per_step(on_host.iter().find(|s| s.0 == name).map_or(0.0, |s| s.1)),
            device_ms: per_step(secs),
            calls: calls as f64 / PROFILE_STEPS as f64,
        })
        .collect();
    Ok(DecodeProfile {
        steps: PROFILE_STEPS,
        host_ms: per_step(host),
        step_ms: per_step(total),
        spans,
        synced_step_ms: per_step(synced),
    })
}

/// [`DecodeReport::first_step_profile`]: the step's seconds and each span's device-synchronised
/// milliseconds and calls.
#[derive(Serialize)]
pub struct FirstStepProfile {
    pub seconds: f64,
    pub spans: Vec<FirstStepSpan>,
}

#[derive(Serialize)]
pub struct FirstStepSpan {
    pub name: &'static str,
    pub ms: f64,
    pub calls: usize,
}

/// One decode step of a fresh conversation with the device synchronised around each span.
fn profile_first_step(
    model: &Model,
    kv: &mut OffloadKv,
    method: &dyn Attention,
    token: u32,
) -> Result<FirstStepProfile> {
    use folio_models::profile::{finish, start, Clock};
    start(Clock::Device);
    let step = decode_step(model, kv, method, token);
    let spans = finish();
    let seconds = step?.2;
    let spans = spans.into_iter().map(|(name, secs, calls)| FirstStepSpan { name, ms: secs * 1e3, calls }).collect();
    Ok(FirstStepProfile { seconds, spans })
}

#[derive(Serialize)]
pub struct DecodeReport {
    pub shape: String,
    pub device: String,
    pub context: usize,
    pub method: String,
    pub settings: serde_json::Value,
    /// What the method set for itself while running (MagicPIG's balanced split), if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub learned: Option<serde_json::Value>,
    pub parameters: usize,
    /// The weights' format (`bf16`, or the projections' quantisation `Q4_K`, `Q8_0`) and the
    /// bytes of them a step reads (the floor's weights term).
    pub weights: String,
    pub weight_bytes_per_step: f64,
    /// The mean counts steps that rebuild a method's state (HiP's refresh every few steps).
    pub decode_ms_mean: f64,
    pub decode_ms_median: f64,
    pub decode_ms_p10: f64,
    pub decode_ms_p90: f64,
    pub p90_over_mean: f64,
    /// The first decode step, which builds the method's index over the context.
    pub first_step_s: f64,
    pub fill_s: f64,
    pub floor_ms: f64,
    /// The mean ÷ the floor.
    pub measured_over_floor: f64,
    pub median_over_floor: f64,
    /// The floor's terms: device bytes (weights read, then the method's index) ÷ copy
    /// bandwidth, host-link bytes ÷ link rate, bytes the CPU reads in host memory ÷ its read
    /// bandwidth; `floor_binds` names the largest ("device", "link" or "host").
    pub floor_device_ms: f64,
    pub floor_weights_ms: f64,
    pub floor_index_ms: f64,
    pub floor_link_ms: f64,
    pub floor_host_ms: f64,
    pub floor_binds: &'static str,
    /// The link's bytes at [`PCIE4_X16`]: their time, the floor and the mean with it.
    pub pcie4_link_ms: f64,
    pub pcie4_floor_ms: f64,
    pub pcie4_mean_ms: f64,
    pub device_bytes_per_step: f64,
    pub link_bytes_per_step: f64,
    pub host_bytes_per_step: f64,
    pub copy_bandwidth: f64,
    pub link_bandwidth: f64,
    pub host_read_bandwidth: f64,
    pub planned_device_bytes: u64,
    pub peak_device_bytes: Option<u64>,
    pub vram_budget: Option<u64>,
    pub host_kv_bytes: u64,
    /// How the context's K/V is stored (`--kv-dtype`), or none: page-locked in the compute dtype.
    pub kv_dtype: Option<&'static str>,
    /// Where the saved rows are read from: host memory, or the file tier (`--kv-on-disk`), and
    /// what the file tier did per timed step.
    pub kv_tier: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<FileSteps>,
    pub peak_rss_bytes: Option<u64>,
    /// Host memory planned before the run, and the host budget the peak is held to
    /// (`--host-budget`, else the default: what the machine has, less a margin).
    pub planned_host_bytes: u64,
    pub host_budget: Option<u64>,
    /// The host link's emulated rate, bytes/s (`--link-gbps`): every read over the link paced
    /// to it, and the floor's link term at it.
    pub emulated_link: Option<f64>,
    /// Of the process's memory at the end of the run, how much is in 2 MiB pages.
    pub huge_page_bytes: Option<u64>,
    /// Threads of the CPU pool that walks MagicPIG's tables and attends its sample
    /// (`FOLIO_HOST_THREADS`, else one per physical core).
    pub host_threads: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<DecodeProfile>,
    /// A fresh conversation's first step (what builds the method's state over the context:
    /// the wait before an answer's first token), with the device synchronised around each span.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_step_profile: Option<FirstStepProfile>,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Double Sparsity's channels for a model of random weights: a random order per layer and KV
/// head (no calibration text means anything here; the cost is the same).
fn random_channels(cfg: &ModelConfig, rng: &mut StdRng) -> Resources {
    let stat: Vec<Vec<Vec<f64>>> = (0..cfg.num_layers)
        .map(|_| (0..cfg.num_kv_heads).map(|_| (0..cfg.head_dim).map(|_| rng.random()).collect()).collect())
        .collect();
    Resources { channels: Some(std::sync::Arc::new(Channels::from_statistic(&stat))) }
}

/// Decodes over the same random model and context with each of `a.methods` in turn on
/// `device`, handing each method's report to `on_report` as soon as it is measured; a run that
/// would not fit its budget is refused before anything is allocated, and one whose measured
/// peak exceeded it fails after its report.
pub fn run<E: From<Error>>(
    device: &Device,
    a: &DecodeBench,
    mut on_report: impl FnMut(&DecodeReport) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let shape = &a.shape;
    check_args(a)?;
    let mut cfg = ModelConfig::from_file(shape)?;
    // Shapes are facts about cost: a context past the model's trained length is still measured.
    let profiled = if a.profile { 3 * PROFILE_STEPS } else { 0 };
    let longest = a.context + a.warmup + a.steps + profiled;
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(longest);
    let dtype = if device.is_cpu() { DType::F32 } else { DType::BF16 };
    let elem = dtype.size_in_bytes();
    // On disk, the rows are a file's: stored as asked, bf16 by default.
    let kv_dtype = match &a.kv_on_disk {
        Some(_) => Some(a.kv_dtype.unwrap_or(KvDtype::Bf16)),
        None => a.kv_dtype,
    };
    // Bytes a stored K/V row takes over the compute dtype's (K and V averaged: bf16-fp8 differs).
    let rows = cfg.num_kv_heads * a.context;
    let link_scale =
        kv_dtype.map_or(1.0, |k| k.kv_bytes(rows, cfg.head_dim) as f64 / (2 * rows * cfg.head_dim * elem) as f64);
    let mut rng = StdRng::seed_from_u64(0);
    let fp8_rows = kv_dtype == Some(KvDtype::Fp8);
    let methods = build_methods(&a.methods, &cfg, (a.context, elem, fp8_rows), &mut rng)?;

    // The plan, before any allocation.
    let sampler = MemorySampler::start(device).map_err(Error::from)?;
    let (param_count, _) = parameters(&cfg);
    let index = methods.iter().map(|m| m.2.resident_bytes).max().unwrap_or(0);
    let tail = cfg.kv_bytes_per_token(elem) as u64 * (a.warmup + a.steps + profiled) as u64;
    let weights = a.weights.iter().map(|w| weight_bytes(&cfg, dtype, *w, device)).max().unwrap_or(0);
    let (planned, budget) = plan_memory(&sampler, &cfg, weights, index, tail, a.context, a.vram_budget)?;
    let host_state = methods.iter().map(|m| m.2.host_state(a.kv_on_disk.is_some())).max().unwrap_or(0);
    let table = weight_bytes(&cfg, dtype, None, &Device::Cpu).saturating_sub(weight_bytes(&cfg, dtype, None, device));
    let kv_host = kv_dtype.map_or(2 * (rows * cfg.head_dim * elem) as u64, |k| k.kv_bytes(rows, cfg.head_dim))
        * cfg.num_layers as u64;
    let kv_planned = match a.kv_on_disk {
        Some(_) => file::cache_bytes(kv_host, table, host_state),
        None => kv_host,
    };
    let planned_host = plan_host(kv_planned, host_state, table)?;

    if let Some(b) = budget {
        keep_pool(device, b).map_err(Error::from)?;
    }
    let bandwidths = bandwidths(device)?;
    // Peak RSS from here on: the bandwidth buffers above are not the run's memory.
    reset_peak_rss();
    let (mut kv, fill_s, _rows_file, disk_bandwidth) = fill_tier(a, &cfg, (kv_dtype, dtype), device, kv_planned)?;
    kv.reserve(longest)?;
    let mut facts = RunFacts {
        shape: shape.display().to_string(),
        device: device_name(device),
        context: a.context,
        parameters: param_count,
        weights: String::new(),
        weight_bytes: 0.0,
        link_scale,
        bandwidths,
        planned,
        budget,
        fill_s,
        kv_dtype,
        host_kv_bytes: kv.host_bytes(),
        planned_host,
        disk_bandwidth,
    };
    for w in &a.weights {
        let model = Model::random(&cfg, device, dtype, INIT_STD, *w)?;
        facts.weights = w.map_or_else(|| format!("{dtype:?}").to_lowercase(), |q| q.name().to_owned());
        facts.weight_bytes = model.weight_bytes_per_step() as f64;
        for measured @ (_, method, _) in &methods {
            kv.set_len(a.context)?;
            method.reset();
            // Peaks per method, from what is in use now (which includes what the memory pool kept
            // from an earlier method: an upper bound, never less than the method's own).
            sampler.reset();
            reset_peak_rss();
            let token = rng.random_range(0..cfg.vocab_size as u32);
            let (mut times, first_step_s, token, before) =
                time_steps(&model, &mut kv, method.as_ref(), token, a.warmup, a.steps)?;
            times.sort_by(f64::total_cmp);
            let file = match (before, kv.file_stats(), disk_bandwidth) {
                (Some(b), Some(after), Some(bw)) => Some(file::per_step(&b, &after, a.steps, bw)),
                _ => None,
            };
            // The profile's steps (if any) run before the peak is read: they are held to the budget too.
            let (profile, first_step_profile) = match a.profile {
                true => {
                    profiles(&model, &mut kv, method.as_ref(), token, a.context).map(|(p, f)| (Some(p), Some(f)))?
                }
                false => (None, None),
            };
            let timed = Timed { times, first_step_s, peak: sampler.peak(), profile, first_step_profile, file };
            let peak = timed.peak;
            on_report(&facts.report(measured, timed))?;
            if let (Some(p), Some(b)) = (peak_rss(), host_budget::budget()) {
                if p > b {
                    let (p, b) = (human_bytes(p), human_bytes(b));
                    return Err(
                        Error::Invalid(format!("peak host memory (RSS) {p} exceeded the {b} host budget")).into()
                    );
                }
            }
            // The next method starts from the weights and the host tier alone: this one's index
            // and resident layers would otherwise count against its memory.
            method.end_conversation();
            kv.drop_resident();
            if let (Some(p), Some(b)) = (peak, budget) {
                if p > b {
                    let (p, b) = (human_bytes(p), human_bytes(b));
                    return Err(Error::Invalid(format!("peak device memory {p} exceeded the {b} budget")).into());
                }
            }
        }
    }
    Ok(())
}

/// What a run knows before its methods decode: the shape, the limits measured, the plan.
struct RunFacts {
    shape: String,
    device: String,
    context: usize,
    parameters: usize,
    /// The weights' format (`bf16`, `Q4_K`, `Q8_0`) and the bytes of them a step reads.
    weights: String,
    weight_bytes: f64,
    /// Bytes a stored K/V row takes over the compute dtype's.
    link_scale: f64,
    /// Copy bandwidth, link rate, host read bandwidth (bytes/s).
    bandwidths: [f64; 3],
    planned: u64,
    budget: Option<u64>,
    fill_s: f64,
    kv_dtype: Option<KvDtype>,
    host_kv_bytes: u64,
    /// Host memory the run plans to use (the K/V or the file tier's cache, the largest method
    /// state, the embedding table, the process before the run).
    planned_host: u64,
    /// The disk's sequential read rate when the rows are on the file tier.
    disk_bandwidth: Option<f64>,
}

/// A method's timed steps (ms, sorted), its first step, its peak device memory and profiles.
struct Timed {
    times: Vec<f64>,
    first_step_s: f64,
    peak: Option<u64>,
    profile: Option<DecodeProfile>,
    first_step_profile: Option<FirstStepProfile>,
    file: Option<FileSteps>,
}

impl RunFacts {
    /// The report of one method: its steps against the floor its cost gives at this run's
    /// bandwidths, and on a consumer card's link.
    fn report(&self, (name, method, cost): &Measured, t: Timed) -> DecodeReport {
        let [copy_bw, link_bw, host_bw] = self.bandwidths;
        let times = &t.times;
        let median = percentile(times, 0.5);
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        // Rows cross the link as they are stored (the method's cost counts them in the compute
        // dtype); on the file tier, what the method moves there.
        let (link, host_bytes) = cost.link_and_host(self.disk_bandwidth.is_some());
        let link_bytes = link * self.link_scale;
        let device_bytes = self.weight_bytes + cost.device_bytes;
        let (floor, pcie4) = Floor::of([device_bytes, link_bytes, host_bytes], self.bandwidths);
        DecodeReport {
            shape: self.shape.clone(),
            device: self.device.clone(),
            context: self.context,
            method: name.to_string(),
            settings: method.settings(),
            learned: method.learned(),
            parameters: self.parameters,
            weights: self.weights.clone(),
            weight_bytes_per_step: self.weight_bytes,
            decode_ms_mean: mean,
            decode_ms_median: median,
            decode_ms_p10: percentile(times, 0.1),
            decode_ms_p90: percentile(times, 0.9),
            p90_over_mean: percentile(times, 0.9) / mean,
            first_step_s: t.first_step_s,
            fill_s: self.fill_s,
            floor_ms: floor.ms(),
            measured_over_floor: mean / floor.ms(),
            median_over_floor: median / floor.ms(),
            floor_device_ms: floor.device,
            floor_weights_ms: self.weight_bytes / copy_bw * 1e3,
            floor_index_ms: cost.device_bytes / copy_bw * 1e3,
            floor_link_ms: floor.link,
            floor_host_ms: floor.host,
            floor_binds: floor.binds(),
            pcie4_link_ms: pcie4.link,
            pcie4_floor_ms: pcie4.ms(),
            pcie4_mean_ms: mean + pcie4.link - floor.link,
            device_bytes_per_step: device_bytes,
            link_bytes_per_step: link_bytes,
            host_bytes_per_step: host_bytes,
            copy_bandwidth: copy_bw,
            link_bandwidth: link_bw,
            host_read_bandwidth: host_bw,
            planned_device_bytes: self.planned,
            peak_device_bytes: t.peak,
            vram_budget: self.budget,
            host_kv_bytes: self.host_kv_bytes,
            kv_dtype: self.kv_dtype.map(KvDtype::name),
            kv_tier: if self.disk_bandwidth.is_some() { "file" } else { "host" },
            file: t.file,
            peak_rss_bytes: peak_rss(),
            planned_host_bytes: self.planned_host,
            emulated_link: folio_kernels::link::rate().filter(|_| self.device != "cpu"),
            host_budget: host_budget::budget(),
            huge_page_bytes: huge_page_bytes(),
            host_threads: folio_models::attention::host_pool::threads(),
            profile: t.profile,
            first_step_profile: t.first_step_profile,
        }
    }
}

/// The profile of a few steps from `token`, then of a fresh conversation's first step over
/// the same context (spans synchronised).
fn profiles(
    model: &Model,
    kv: &mut OffloadKv,
    method: &dyn Attention,
    token: u32,
    context: usize,
) -> Result<(DecodeProfile, FirstStepProfile)> {
    let profile = profile_decode(model, kv, method, token)?;
    method.end_conversation();
    kv.drop_resident();
    kv.set_len(context)?;
    Ok((profile, profile_first_step(model, kv, method, token)?))
}

/// Refuses a run that cannot be made: a method the offloaded tier cannot run, an empty or
/// oversized context, no timed step.
fn check_args(a: &DecodeBench) -> Result<()> {
    for m in &a.methods {
        m.spec()?.check_tier(Tier::Offloaded)?;
    }
    if a.context == 0 || a.context > u32::MAX as usize || a.steps == 0 {
        return Err(Error::Invalid("--context must be 1..=4294967295 tokens and --steps at least 1".into()));
    }
    Ok(())
}

/// A method to measure: as asked for, built, and the cost of its step.
type Measured = (MethodChoice, Box<dyn Attention>, StepCost);

/// Each method asked for, built (over random Double Sparsity channels), with the cost of its
/// step at this shape and context.
fn build_methods(
    choices: &[MethodChoice],
    cfg: &ModelConfig,
    (context, elem, fp8_rows): (usize, usize, bool),
    rng: &mut StdRng,
) -> Result<Vec<Measured>> {
    let resources = random_channels(cfg, rng);
    choices
        .iter()
        .map(|m| {
            let method = m.build(&resources)?;
            let params = m.params()?;
            let budget = m.budget()?.map_or(0, |b| b.tokens(context));
            let input = CostInput { shape: Shape::of(cfg), context, elem, budget, params: &params, fp8_rows };
            Ok((m.clone(), method, (m.spec()?.cost)(&input)))
        })
        .collect()
}

/// `warmup + steps` decode steps from `token`: the timed steps' ms (after the warm-up), the
/// first step's seconds, the last token, and the file tier's counts when the timed steps began.
fn time_steps(
    model: &Model,
    kv: &mut OffloadKv,
    method: &dyn Attention,
    mut token: u32,
    warmup: usize,
    steps: usize,
) -> Result<(Vec<f64>, f64, u32, Option<FileStats>)> {
    let mut times = Vec::with_capacity(steps);
    let (mut first_step_s, mut before) = (0.0, None);
    for step in 0..warmup + steps {
        if step == warmup {
            before = kv.file_stats();
        }
        let (next, _, secs) = decode_step(model, kv, method, token)?;
        token = next;
        if step == 0 {
            first_step_s = secs;
        }
        if step >= warmup {
            times.push(secs * 1e3);
        }
    }
    Ok((times, first_step_s, token, before))
}

/// The device's copy bandwidth, the host link's page-locked copy rate (the emulated rate
/// where it is lower: `--link-gbps`) and the host's read bandwidth, measured now (smaller
/// buffers on the CPU).
fn bandwidths(device: &Device) -> Result<[f64; 3]> {
    let bytes = if device.is_cpu() { BANDWIDTH_BYTES / 16 } else { BANDWIDTH_BYTES };
    let copy = copy_bandwidth(device, bytes, COPIES)?;
    let link = host_to_device_rate(device, bytes)?;
    let link = folio_kernels::link::rate().filter(|_| device.is_cuda()).map_or(link, |r| r.min(link));
    Ok([copy, link, host_read_bandwidth(bytes, COPIES)])
}

/// A step's floor: the time of each path's bytes at its bandwidth, ms.
struct Floor {
    device: f64,
    link: f64,
    host: f64,
}

impl Floor {
    /// The floor of a step moving `[device, link, host]` bytes at `[copy, link, host]`
    /// bandwidths, and the same step on a consumer card's link (PCIe 4.0 x16).
    fn of([device, link, host]: [f64; 3], [copy_bw, link_bw, host_bw]: [f64; 3]) -> (Self, Self) {
        let floor = Floor { device: device / copy_bw * 1e3, link: link / link_bw * 1e3, host: host / host_bw * 1e3 };
        let pcie4 = Floor { link: link / PCIE4_X16 * 1e3, ..floor };
        (floor, pcie4)
    }

    /// The paths can overlap: the slowest one is the floor.
    fn ms(&self) -> f64 {
        self.device.max(self.link).max(self.host)
    }

    fn binds(&self) -> &'static str {
        if self.link >= self.device && self.link >= self.host {
            "link"
        } else if self.host >= self.device {
            "host"
        } else {
            "device"
        }
    }
}
