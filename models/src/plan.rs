//! The memory planner: for a saved context, a method, a tier and the memory budgets, where the
//! K/V lives (device memory, host memory, the file), what the method keeps beside it, what a
//! decode step moves, and the step's floor from bandwidths measured on this machine — what
//! the window shows before a setting is used, and what refuses a budget that cannot hold the
//! step's hot set, saying what would.
//!
//! The step model is `folio bench --shape`'s (docs/performance.md): the weights a step reads
//! and the method's device-side index at the device's copy bandwidth; the rows it moves over
//! the host link at the link's rate (the offloaded tier), or reads in device memory (the
//! resident tier); what the CPU reads in host memory (MagicPIG's sample) at the host's read
//! bandwidth. The paths overlap, so the floor is the slowest of them, not their sum. On the
//! resident tier, layers past the device budget are decoded from the file again on use: their
//! file bytes are read by the host and their decoded rows moved to the device, every step.
//! A floor is a lower bound; the window shows it beside the measured time of the answers.
//!
//! Rejected: predicting from a table of measured ms/token per method and length — it would
//! hold for the machine and model it was measured on only, where bandwidths and byte counts
//! carry over to any of them.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::attention::{CostInput, Shape, StepCost};
use crate::attention::{MethodChoice, Tier};
use crate::config::ModelConfig;
use crate::error::{human_bytes, Error, Result};
use crate::session::RESIDENT_BUDGET;
use folio_context_file::format::Header;

/// Parameters of a decoder of this shape (what the weights take), and those a decode step reads
/// (all but the embedding table, of which it reads one row, unless the LM head shares it).
pub fn parameters(cfg: &ModelConfig) -> (usize, usize) {
    let (h, hd, inter, v) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size);
    let (nq, nkv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let bias = if cfg.qkv_bias { nq + 2 * nkv } else { 0 };
    let norms = if cfg.qk_norm { 2 * hd } else { 0 };
    let layer = 2 * h + h * nq + 2 * h * nkv + bias + nq * h + 3 * h * inter + norms;
    let head = if cfg.tie_word_embeddings { 0 } else { v * h };
    let total = v * h + cfg.num_layers * layer + h + head;
    let read = total - if cfg.tie_word_embeddings { 0 } else { v * h };
    (total, read)
}

/// Bytes of a decoder of this shape's weights in `device`'s memory with `dtype` values, the
/// projections (and an LM head) in `quantize`'s blocks when given, as
/// [`crate::model::Model::random`] makes them: on a GPU the embedding table is in host memory
/// unless the head multiplies by it ([`crate::model::embedding_on_host`]).
pub fn weight_bytes(cfg: &ModelConfig, dtype: DType, quantize: Option<crate::model::Quantize>, device: &Device) -> u64 {
    let (total, _) = parameters(cfg);
    let elem = dtype.size_in_bytes();
    let (h, hd, inter, v) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size);
    let quantized =
        |inp: usize, values: usize| quantize.and_then(|q| inp.is_multiple_of(q.dtype().block_size()).then_some(values));
    let head_is_table = cfg.tie_word_embeddings && quantized(h, v * h).is_none();
    let table =
        if crate::model::embedding_on_host(device, dtype, h, head_is_table) { (v * h * elem) as u64 } else { 0 };
    let Some(q) = quantize else { return (total * elem) as u64 - table };
    let (nq, nkv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let blocks = q.dtype();
    let mut projections = cfg.num_layers
        * [quantized(h, h * nq + 2 * h * nkv + 2 * h * inter), quantized(nq, nq * h), quantized(inter, inter * h)]
            .into_iter()
            .flatten()
            .sum::<usize>();
    // A tied head is quantized apart from the embedding table it shares (an extra copy).
    let extra_head = if cfg.tie_word_embeddings { quantized(h, v * h).unwrap_or(0) } else { 0 };
    if !cfg.tie_word_embeddings {
        projections += quantized(h, v * h).unwrap_or(0);
    }
    let q_bytes = (projections + extra_head) / blocks.block_size() * blocks.type_size();
    let plain = total - projections;
    (plain * elem + q_bytes) as u64 - table
}

/// Host memory read by every core at once (threads summing their share of a `bytes` buffer,
/// `rounds` times after a warm-up), bytes/s: the limit of work the CPU does over host rows.
pub fn host_read_bandwidth(bytes: usize, rounds: usize) -> f64 {
    let words = vec![1u64; bytes / 8];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let sum = || -> u64 {
        std::thread::scope(|s| {
            let parts: Vec<_> = words
                .chunks(words.len().div_ceil(threads).max(1))
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            parts.into_iter().map(|p| p.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        })
    };
    std::hint::black_box(sum());
    let start = Instant::now();
    for _ in 0..rounds {
        std::hint::black_box(sum());
    }
    (bytes * rounds) as f64 / start.elapsed().as_secs_f64()
}

/// Device-to-device copies of `bytes` (after a warm-up, `rounds` back to back), as bytes/s read
/// + written.
pub fn copy_bandwidth(device: &Device, bytes: usize, rounds: usize) -> Result<f64> {
    let block = Tensor::zeros(bytes / 2, DType::BF16, device)?;
    block.copy()?;
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..rounds {
        block.copy()?;
    }
    device.synchronize()?;
    Ok(2.0 * (bytes * rounds) as f64 / start.elapsed().as_secs_f64())
}

/// Bandwidths of this machine, measured: bytes/s.
#[derive(Debug, Clone, Copy, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Bandwidths {
    /// Device memory (read + written by a copy).
    pub device: f64,
    /// Host to device over the link (page-locked); `None` on the CPU, where there is no link.
    pub link: Option<f64>,
    /// Host memory read by every core.
    pub host: f64,
    /// The context file's disk, read as the file tier reads a step's misses (4 KiB blocks at
    /// random, in parallel); `None` until measured for a context on the file tier
    /// ([`Self::with_disk`]).
    pub disk: Option<f64>,
}

impl Bandwidths {
    /// Measures each with a buffer of `bytes` (a planner's quick look: a few rounds).
    pub fn measure(device: &Device, bytes: usize) -> Result<Self> {
        const ROUNDS: usize = 4;
        let link = match device.is_cpu() {
            true => None,
            // An emulated slower link (`--link-gbps`) is the link the step gets.
            false => {
                let measured = folio_runtime::device::host_to_device_rate(device, bytes)?;
                Some(folio_kernels::link::rate().map_or(measured, |r| r.min(measured)))
            }
        };
        let (device, host) = (copy_bandwidth(device, bytes, ROUNDS)?, host_read_bandwidth(bytes, ROUNDS));
        Ok(Self { device, link, host, disk: None })
    }

    /// These with the disk under the context file at `path` measured
    /// ([`crate::kv_cache::block_read_rate`]).
    pub fn with_disk(self, path: &std::path::Path) -> Result<Self> {
        let rate = crate::kv_cache::block_read_rate(path).map_err(|e| crate::error::Error::io(path, e))?;
        Ok(Self { disk: Some(rate), ..self })
    }
}

/// The memory a step may use: device memory (VRAM on a GPU) and host memory; `None` is no cap.
#[derive(Debug, Clone, Copy, Default, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Budgets {
    pub device: Option<u64>,
    pub host: Option<u64>,
}

/// One path of a decode step: bytes over a bandwidth.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Term {
    pub path: &'static str,
    pub bytes: f64,
    pub bandwidth: f64,
    pub ms: f64,
}

impl Term {
    /// `bytes` over `path` at `bandwidth` bytes/s.
    fn new(path: &'static str, bytes: f64, bandwidth: f64) -> Self {
        Self { path, bytes, bandwidth, ms: bytes / bandwidth * 1e3 }
    }
}

/// Where a context's K/V and a method's state live, and what a step costs; see the module docs.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Plan {
    pub tier: &'static str,
    pub method: String,
    pub budget_tokens: Option<usize>,
    /// The context file's bytes (its K/V in the file's dtype, on disk).
    pub file_bytes: u64,
    /// The model's weights in device memory.
    pub weights_bytes: u64,
    /// K/V decoded into device memory: whole layers (resident tier).
    pub kv_device_bytes: u64,
    pub resident_layers: usize,
    pub layers: usize,
    /// K/V in host memory (offloaded tier): the context file's mapping, page-locked in place;
    /// or, on the file tier ([`Plan::kv_on_disk`]), the host memory its keys and its cache take.
    pub kv_host_bytes: u64,
    /// The context's rows stay in the file (the file tier): the host budget cannot hold the
    /// mapping beside the rest; a step reads what its cache does not hold from disk.
    pub kv_on_disk: bool,
    /// What the method keeps in device memory beside the K/V (labels, resident layers,
    /// gathers).
    pub method_device_bytes: u64,
    pub device_bytes: u64,
    /// What the method keeps in host memory (MagicPIG's hash tables).
    pub method_host_bytes: u64,
    /// The weights in host memory (the embedding table on a GPU).
    pub weights_host_bytes: u64,
    /// The rest of this process in host memory now: the app, the model's tokenizer, buffers
    /// (its resident set less the engine's held allocations).
    pub process_host_bytes: u64,
    /// Host memory in all: the K/V, the method's state, the weights' and the process's.
    pub host_bytes: u64,
    /// The host budget the step is held to (the budgets', else the process's: `--host-budget`
    /// or the default, what the machine has less a margin); `None`: the platform says nothing.
    pub host_budget: Option<u64>,
    /// The step's paths and their times; the floor is the slowest.
    pub terms: Vec<Term>,
    pub floor_ms: f64,
    pub binding: &'static str,
    /// Budgets that cannot hold what the step needs, each with what would.
    pub problems: Vec<String>,
}

/// What the planner reads of the model running the context.
pub struct ModelFacts<'a> {
    pub config: &'a ModelConfig,
    /// Bytes of one element of the compute dtype (K/V are decoded to it).
    pub elem: usize,
    /// The loaded weights' bytes in device memory and those a decode step reads, when known
    /// (quantized weights take less than parameters × `elem`, a table in host memory is not
    /// counted); `None`: parameters × `elem`.
    pub weights: Option<(u64, u64)>,
    /// The weights' bytes in host memory (the embedding table on a GPU).
    pub weights_host: u64,
}

/// Plans `choice` over the context `header` on `tier` within `budgets`.
pub fn plan(
    model: &ModelFacts<'_>,
    header: &Header,
    choice: &MethodChoice,
    tier: Tier,
    budgets: Budgets,
    bw: &Bandwidths,
) -> Result<Plan> {
    let spec = choice.spec()?;
    let (cfg, elem) = (model.config, model.elem);
    let (total_params, read_params) = parameters(cfg);
    let (weights, weights_read) = model.weights.unwrap_or(((total_params * elem) as u64, (read_params * elem) as u64));
    let tokens = header.tokens;
    let layer_bytes = (2 * header.kv_heads * tokens * header.head_dim * elem) as u64;
    let layers = header.layers;
    let budget_tokens = choice.budget()?.map(|b| b.tokens(tokens));
    let params = choice.params()?;
    let input = CostInput {
        shape: Shape::of(cfg),
        context: tokens,
        elem,
        budget: budget_tokens.unwrap_or(0),
        params: &params,
        fp8_rows: header.kv_dtype == folio_context_file::KvDtype::Fp8,
    };
    let cost = (spec.cost)(&input);
    let method_device = cost.resident_bytes;
    let mut problems = Vec::new();
    let link = bw.link.unwrap_or(bw.device);
    let term = Term::new;
    let weights_read = weights_read as f64;
    let host_budget = budgets.host.or_else(folio_runtime::host_budget::budget);
    let process = folio_runtime::host_memory::rss().unwrap_or(0).saturating_sub(folio_runtime::host_budget::held());
    let (kv_device, resident_layers, kv_host, terms, kv_on_disk) = match tier {
        Tier::Resident => {
            // Whole layers are decoded into device memory up to the budget; one at least.
            let room = budgets.device.map(|b| b.saturating_sub(weights + method_device));
            // With no budget a session keeps the resident tier's default
            // (`session::RESIDENT_BUDGET`).
            let kept = match room {
                Some(room) => ((room / layer_bytes.max(1)) as usize).min(layers),
                None => ((RESIDENT_BUDGET / layer_bytes.max(1)) as usize).clamp(1, layers),
            };
            if kept == 0 {
                problems.push(format!(
                    "a device budget of {} does not hold the weights ({}), {}'s state ({}) and one layer of this \
                     context's K/V ({}): it needs {} at least, or {} with offload on (only the rows {} picks move \
                     to the device)",
                    human_bytes(budgets.device.unwrap_or(0)),
                    human_bytes(weights),
                    spec.name,
                    human_bytes(method_device),
                    human_bytes(layer_bytes),
                    human_bytes(weights + method_device + layer_bytes),
                    human_bytes(weights + method_device),
                    spec.name
                ));
            }
            let kept = kept.max(1);
            let again = (layers - kept) as f64;
            let file_layer = header.kv_dtype.max_section_bytes(header.kv_heads * tokens, header.head_dim) as f64;
            let mut terms = vec![term("device", weights_read + cost.device_bytes + cost.link_bytes, bw.device)];
            if again > 0.0 {
                terms.push(term("host", again * 2.0 * file_layer, bw.host));
                terms.push(term("link", again * layer_bytes as f64, link));
            }
            (layer_bytes * kept as u64, kept, 0, terms, false)
        }
        Tier::Offloaded => {
            let besides = [cost.host_state_bytes, model.weights_host, process];
            let (host, terms, on_disk) =
                offloaded(header, &cost, (weights_read, layer_bytes * layers as u64), (host_budget, besides), bw);
            (0, 0, host, terms, on_disk)
        }
    };
    // A method's state lies on disk beside the rows (MagicPIG's bucket lists) when the session
    // opens the file tier — when the file alone does not fit beside the rest of Folio, as
    // `OffloadKv::from_context` decides, not when only the file and the state do not.
    let method_host = cost.host_state(kv_on_disk && file_alone_over(header, host_budget, model.weights_host + process));
    let host_parts = [kv_host, method_host, model.weights_host, process];
    let host_total: u64 = host_parts.iter().sum();
    if let Some(b) = host_budget.filter(|&b| host_total > b && problems.is_empty()) {
        problems.push(over_host_budget(b, spec.name, host_parts, budgets.host.is_none(), (tier, kv_on_disk)));
    }
    let device_total = weights + method_device + kv_device;
    if let Some(b) = budgets.device.filter(|&b| device_total > b && problems.is_empty()) {
        let needs = [weights, method_device, kv_device];
        problems.push(over_device_budget(b, spec.name, needs, tier));
    }
    let binding = terms.iter().max_by(|a, b| a.ms.total_cmp(&b.ms)).map_or("device", |t| t.path);
    let floor_ms = terms.iter().map(|t| t.ms).fold(0.0, f64::max);
    Ok(Plan {
        tier: tier.name(),
        method: spec.name.to_owned(),
        budget_tokens,
        file_bytes: header.file_bytes,
        weights_bytes: weights,
        kv_device_bytes: kv_device,
        resident_layers,
        layers,
        kv_host_bytes: kv_host,
        kv_on_disk,
        method_device_bytes: method_device,
        device_bytes: device_total,
        method_host_bytes: method_host,
        weights_host_bytes: model.weights_host,
        process_host_bytes: process,
        host_bytes: host_total,
        host_budget,
        terms: terms.into_iter().filter(|t| t.bytes > 0.0).collect(),
        floor_ms,
        binding,
        problems,
    })
}

/// The offloaded tier's K/V in host memory, a step's terms and whether the rows stay on disk:
/// the file's K/V sections read in place (`OffloadKv::from_context`), page-locked in the page
/// cache with the rest of its mapping and crossing the link in the file's dtype; or, when the
/// budget cannot hold the mapping beside the rest (`besides`: the method's host state, the
/// weights', the process's), left on disk with the file tier's share of the budget, a step
/// then reading from disk what that share misses.
fn offloaded(
    header: &Header,
    cost: &StepCost,
    (weights_read, compute_kv): (f64, u64),
    (budget, besides): (Option<u64>, [u64; 3]),
    bw: &Bandwidths,
) -> (u64, Vec<Term>, bool) {
    let kv = kv_bytes(header);
    let host = offloaded_host(header, kv, budget, besides);
    let file_per_compute = kv as f64 / compute_kv.max(1) as f64;
    let on_disk = host != header.file_bytes.max(kv);
    // On the file tier a method may read otherwise (MagicPIG attends its whole sample on the
    // device, read through the tier's cache; HiP searches on the GPU).
    let (link, host_read) = cost.link_and_host(on_disk);
    let link = link * file_per_compute;
    let mut terms = vec![
        Term::new("device", weights_read + cost.device_bytes, bw.device),
        Term::new("link", link, bw.link.unwrap_or(bw.device)),
        Term::new("host", host_read, bw.host),
    ];
    if let (true, Some(disk)) = (on_disk, bw.disk.filter(|&d| d > 0.0)) {
        // What the step reads that the tier's memory misses, at the share of the K/V it holds:
        // picks spread as on random weights (a real model's re-picks hit more); a floor, as
        // the other terms: picked rows that cluster (HiP's leaves) read about their bytes, a
        // scattered row reads a whole 4 KiB block (up to 32 rows' bytes).
        let miss = 1.0 - (host as f64 / kv.max(1) as f64).min(1.0);
        // And what the method's state on disk reads (MagicPIG's runs of its bucket lists),
        // where it lies there.
        let lists_on_disk = file_alone_over(header, budget, besides[1] + besides[2]);
        let state = if lists_on_disk { cost.state_disk_bytes } else { 0.0 };
        terms.push(Term::new("disk", link * miss + state, disk));
    }
    (host, terms, on_disk)
}

/// Bytes of a context's K/V as the file stores them.
fn kv_bytes(header: &Header) -> u64 {
    header.layers as u64 * header.kv_dtype.kv_bytes(header.kv_heads * header.tokens, header.head_dim)
}

/// Whether `budget` cannot hold the context file's rows beside `rest` (the weights in host
/// memory and the rest of Folio): the file tier then, whatever the method.
fn file_alone_over(header: &Header, budget: Option<u64>, rest: u64) -> bool {
    budget.is_some_and(|b| rest + header.file_bytes.max(kv_bytes(header)) > b)
}

/// The host memory the offloaded tier takes for a context of `kv` bytes of rows: the file's
/// mapping, read in place; or, when `budget` cannot hold it beside `[method state, weights,
/// the rest of the process]`, the file tier's share of the room those leave (its keys and a
/// cache of row blocks), as `OffloadKv::from_context` opens it — when that share is no less
/// than the least the file tier opens with (`least_bytes`).
fn offloaded_host(header: &Header, kv: u64, budget: Option<u64>, [state, weights, process]: [u64; 3]) -> u64 {
    let in_place = header.file_bytes.max(kv);
    let file_tier = budget.filter(|&b| state + weights + process + in_place > b).map(|b| {
        let room = b.saturating_sub(weights + process);
        crate::kv_cache::file_tier_bytes(room, kv)
    });
    let least =
        crate::kv_cache::least_bytes(header.kv_dtype, (header.layers, header.kv_heads, header.tokens, header.head_dim));
    file_tier.filter(|&c| c >= least).unwrap_or(in_place)
}

/// Why a device budget `b` does not hold a step of `method` that needs `[weights, method
/// state, K/V]` on the device.
fn over_device_budget(b: u64, method: &str, [weights, state, kv]: [u64; 3], tier: Tier) -> String {
    format!(
        "a device budget of {} does not hold {method}'s step: weights {}, {method} method state {}, K/V {} — {} in all{}",
        human_bytes(b),
        human_bytes(weights),
        human_bytes(state),
        human_bytes(kv),
        human_bytes(weights + state + kv),
        match tier {
            Tier::Offloaded => String::new(),
            Tier::Resident => format!("; with offload on it needs {}", human_bytes(weights + state)),
        }
    )
}

/// Why a host budget `b` does not hold a step of `method` that keeps `[K/V, method state,
/// weights, the rest of the process]` in host memory.
fn over_host_budget(
    b: u64,
    method: &str,
    [kv, state, weights, process]: [u64; 4],
    default: bool,
    (tier, on_disk): (Tier, bool),
) -> String {
    format!(
        "the {}host budget of {} does not hold {method}'s step: K/V {}{}, {method} method state {}, weights {}, the \
         rest of Folio {} — {} in all; raise it (--host-budget, or Settings → Engine){}, or store the context's K/V \
         in fp8",
        if default { "default " } else { "" },
        human_bytes(b),
        human_bytes(kv),
        match (tier, on_disk) {
            (Tier::Offloaded, true) => " (the file tier's keys and cache: its rows stay on disk)",
            (Tier::Offloaded, false) => " (the context file, read in place)",
            _ => "",
        },
        human_bytes(state),
        human_bytes(weights),
        human_bytes(process),
        human_bytes(kv + state + weights + process),
        if tier == Tier::Offloaded && !on_disk {
            ", turn offload off (layers are then read from the file as used)"
        } else {
            ""
        },
    )
}

/// The plan's first problem as an error (what refuses a setting).
pub fn check(plan: &Plan) -> Result<()> {
    match plan.problems.first() {
        Some(p) => Err(Error::Invalid(p.clone())),
        None => Ok(()),
    }
}
