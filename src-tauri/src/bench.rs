//! `folio bench`: commands that measure and print figures, each with its ratio to a limit
//! (never timed tests).
//!
//! `bench prefill` prefills synthetic prompts (random token ids) of each requested length into
//! a context file with the real builder, then reopens the file as a user would and produces the
//! first token after a short question. It prints prefill tokens/s, the FLOP rate against a
//! large matmul's on the same device (the compute limit in practice), peak RSS, file bytes, and
//! reopen-to-first-token time with its ratio to the prefill time.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use clap::{Args, Subcommand};
use folio_kernels::device::MemorySampler;
use folio_models::attention::{Dense, Tier};
use folio_models::config::ModelConfig;
use folio_models::context::{
    self, BuildOptions, ContextKv, HiddenPlace, KvDtype, ModelStamp, PrefixPlan, StageSeconds,
};
use folio_models::error::human_bytes;
use folio_models::kv::KvStore;
use folio_models::model::Logits;
use folio_models::offload::OffloadKv;
use folio_models::{device_name, Engine};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use crate::bench_shape::{bench_shape, ShapeBenchArgs};
use crate::cli::Common;
use crate::context_cmd::parse_bytes;
use folio_models::host_memory::peak_rss;

/// Bytes read to measure the disk's read rate (or the whole file, if smaller), in pieces of
/// [`DISK_PROBE_PIECE`].
const DISK_PROBE_BYTES: usize = 2 << 30;
const DISK_PROBE_PIECE: usize = 16 << 20;

/// Tokens of the question asked after reopening.
const QUESTION_TOKENS: usize = 16;
/// Side of the square matmul whose FLOP rate stands for the CPU's compute limit (a GPU's is
/// [`GEMM_SIDE`]).
const MATMUL_SIDE: usize = 1024;
/// Device memory a prefill under `--vram-budget` leaves outside its chunk plan: cuBLAS
/// workspaces, the allocator's rounding, the LM head's logits.
const VRAM_MARGIN: u64 = 1 << 30;

/// `folio bench --shape ...` (decode over an offloaded context with a model of a real shape), or
/// one of the subcommands.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    #[command(flatten)]
    shape: ShapeBenchArgs,
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prefill speed, memory, file size and reopen-to-first-token time.
    Prefill(PrefillBenchArgs),
    /// The sparse-decode kernels (selected-row attention, label and block scores, top-k, the
    /// host gather, SimHash codes) against the device's copy bandwidth, host link and f32 GEMM
    /// rate measured in the same run.
    Kernels(KernelBenchArgs),
    /// Staging speed: documents read and tokens counted per second, per format.
    Ingest(crate::bench_ingest::IngestBenchArgs),
}

#[derive(Args)]
pub struct KernelBenchArgs {
    /// Rows per KV head of the synthetic K/V (the context length).
    #[arg(long, default_value_t = 1 << 20)]
    context: usize,
    /// Rows attended per KV head (shared by its group), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,16384,65536")]
    select: Vec<usize>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct PrefillBenchArgs {
    /// Prompt lengths, comma-separated (e.g. 8192,32768).
    #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
    tokens: Vec<usize>,
    /// K/V storage: bf16, bf16-fp8, fp8 or f32 (as `folio prefill --kv-dtype`).
    #[arg(long, default_value = "bf16")]
    kv_dtype: String,
    /// Bytes the prefill's working set may use beyond the weights (the chunk plan's budget).
    #[arg(long)]
    memory_budget: Option<String>,
    /// Device memory the whole run may use (e.g. 24GiB): what is left after the weights becomes
    /// the chunk plan's budget, the peak is sampled from the driver, and a peak over it fails.
    #[arg(long)]
    vram_budget: Option<String>,
    /// A model shape (assets/shapes/*.json) with random weights instead of `--model` (speed and
    /// memory depend on the shape only; the reopen's first token is timed, not read).
    #[arg(long)]
    shape: Option<PathBuf>,
    /// Folder for the context files (default: the system temp folder); each is deleted after use.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the file of an interrupted run in `--dir` and resume it (from its checkpoint): a
    /// prefill longer than one sitting finishes over several runs, each reporting its own layers.
    #[arg(long, requires = "dir")]
    resume: bool,
    /// Also grow each context by this many new tokens (`folio prefill --context --add`) and
    /// time it against a prefill of everything in one go.
    #[arg(long, conflicts_with = "resume")]
    append: Option<usize>,
    /// After the timed rows, prefill the first length once more with the device synchronised
    /// around each operation, and print where that run's time went, op by op.
    #[arg(long)]
    profile: bool,
    /// Reopen on the offloaded tier (the file's K/V read in place from host memory, as `folio
    /// chat --offload` does) even where the decoded layers would fit the device; without it the
    /// reopen goes there only when they would not fit what `--vram-budget` leaves.
    #[arg(long)]
    offload: bool,
    #[arg(long)]
    json: bool,
}

/// Where one reopen's time went.
#[derive(Serialize, Clone, Copy)]
struct Reopen {
    /// Open to the first token's logits.
    seconds: f64,
    /// The file opened: header, token ids and document table verified, the model's fingerprint
    /// checked.
    open: f64,
    /// The K/V store made: on the offloaded tier every K/V section's checksum verified and the
    /// mapping registered with the device; on the resident tier nothing yet (layers are decoded
    /// when the question first reads them).
    store: f64,
    /// The question through the model, attending every saved row densely, to the first
    /// token's logits.
    question: f64,
    /// On the offloaded tier: whether the rows were read in place from the file's mapping (a
    /// GPU that cannot register it gets them copied into page-locked memory instead).
    in_place: bool,
}

#[derive(Serialize)]
struct Row {
    tokens: usize,
    /// Layers this run computed (fewer than the model's when it resumed an interrupted one).
    layers_computed: usize,
    prefill_seconds: f64,
    tokens_per_s: f64,
    flops_per_s: f64,
    /// Prefill FLOP rate ÷ the device's large-matmul FLOP rate.
    flops_ratio_to_matmul: f64,
    peak_rss_bytes: Option<u64>,
    /// Device memory in use at the peak (driver's total − free), off the CPU.
    peak_vram_bytes: Option<u64>,
    chunk: usize,
    /// Where the prefill's time went.
    stages: StageSeconds,
    /// Where the hidden states between layers lived, and the checkpoints written.
    hidden_in: HiddenPlace,
    checkpoints: usize,
    working_set_bytes: u64,
    file_bytes: u64,
    /// Reopen-to-first-token time with the file evicted from the page cache (as after a
    /// reboot), and again with it cached (as the second time a user opens it).
    reopen_first_token_seconds: f64,
    reopen_warm_seconds: f64,
    /// Reopen-to-first-token time ÷ prefill time.
    reopen_ratio: f64,
    /// "resident" or "offloaded": where the reopen's K/V lived.
    reopen_tier: &'static str,
    reopen_cold: Reopen,
    reopen_warm: Reopen,
    /// The disk's sequential read rate, bytes/s, measured on the file after the reopens (its
    /// first [`DISK_PROBE_BYTES`] evicted from the page cache and read back): the cold reopen's
    /// limit is the file's bytes over it.
    disk_read_bytes_per_s: f64,
    /// Growing the context by `--append` tokens.
    append: Option<AppendRow>,
}

#[derive(Serialize)]
struct AppendRow {
    new_tokens: usize,
    /// Growing the saved context: only the new tokens computed.
    append_seconds: f64,
    /// Prefilling old and new tokens in one go.
    full_seconds: f64,
    /// append ÷ full.
    ratio: f64,
    /// The share of the full prefill's attention and matmul work that is the new tokens'
    /// (the ratio an append would have with no fixed costs).
    work_share: f64,
}

pub fn bench(common: &Common, args: BenchArgs) -> Result<()> {
    match args.command {
        Some(BenchCommand::Prefill(a)) => bench_prefill(common, a),
        Some(BenchCommand::Kernels(a)) => bench_kernels(common, a),
        Some(BenchCommand::Ingest(a)) => crate::bench_ingest::bench_ingest(common, a),
        None => bench_shape(common, args.shape),
    }
}

/// Qwen2.5-7B's attention shape: query heads, KV heads, head dim.
const KERNEL_SHAPE: (usize, usize, usize) = (28, 4, 128);
/// Qwen2.5-7B's MLP: hidden and intermediate sizes.
const MLP_SHAPE: (usize, usize) = (3584, 18_944);
/// Tokens per MLP call timed: the chunk `bench prefill` runs that shape in under a 24 GiB cap
/// (the CPU: fewer).
const MLP_TOKENS: usize = 8192;
const MLP_TOKENS_CPU: usize = 64;
/// SimHash benchmark: rows hashed and the paper's (K, L) = (10, 150).
const HASH_ROWS: usize = 65_536;
const HASH_BITS_TABLES: (usize, usize) = (10, 150);
const LABEL_BITS: usize = 4;
/// Top-k benchmark: rows kept per query head (the decode benchmarks' budget).
const TOPK_K: usize = 2048;
/// Calls timed per figure after one warm-up (on the CPU the reference is slow: fewer), and
/// bytes copied for the bandwidth figure.
const KERNEL_REPS: usize = 50;
const CPU_REPS: usize = 2;
const COPY_BYTES: usize = 1 << 30;
/// Side of the square GEMMs (f32, and bf16 on a GPU) that measure the arithmetic limits (large
/// enough to saturate a GPU).
const GEMM_SIDE: usize = 4096;
/// Tokens of the causal prefill attention timed (one layer's query chunk over its keys); the
/// CPU runs the f32 path, far slower.
const PREFILL_TOKENS: usize = 32_768;
const PREFILL_TOKENS_CPU: usize = 512;
/// Tokens of `bench prefill`'s untimed warm-up (one chunk of the largest size, or a few under a
/// tight budget).
const WARMUP_TOKENS: usize = 8192;

/// Seconds per call of `f`, averaged over [`KERNEL_REPS`] calls after a warm-up, synchronised.
fn time_calls<T>(device: &candle_core::Device, mut f: impl FnMut() -> candle_core::Result<T>) -> Result<f64> {
    let reps = if device.is_cpu() { CPU_REPS } else { KERNEL_REPS };
    f()?;
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / reps as f64)
}

#[derive(Serialize)]
struct KernelRow {
    kernel: String,
    seconds: f64,
    bytes: f64,
    flops: f64,
    /// Achieved bytes/s or FLOP/s over the limit measured in the same run.
    of_limit: f64,
    limit: &'static str,
}

impl KernelRow {
    /// A row that only moves bytes: its share of the bandwidth `rate` (bytes/s) named `limit`.
    fn moving(kernel: String, seconds: f64, bytes: f64, rate: f64, limit: &'static str) -> Self {
        Self { kernel, seconds, bytes, flops: 0.0, of_limit: bytes / seconds / rate, limit }
    }
}

fn bench_kernels(common: &Common, a: KernelBenchArgs) -> Result<()> {
    use folio_kernels::sparse;
    if a.context == 0 || a.context > u32::MAX as usize || a.select.contains(&0) {
        anyhow::bail!("--context must be 1..=4294967295 rows and every --select at least 1");
    }
    let device = folio_models::parse_device(&common.device)?;
    let (heads, kv_heads, d) = KERNEL_SHAPE;
    let dtype = if device.is_cpu() { DType::F32 } else { DType::BF16 };
    // The limits, measured here and now.
    let block = Tensor::zeros(COPY_BYTES / 2, DType::BF16, &device)?;
    let copy = time_calls(&device, || block.copy())?;
    let bandwidth = 2.0 * COPY_BYTES as f64 / copy;
    drop(block);
    let gemm = matmul_flops(&device, DType::F32)?;
    // The tensor-core limit: a bf16 GEMM (the f32 path's limit on the CPU).
    let gemm16 = matmul_flops(&device, dtype)?;
    let mut rows = prefill_rows(&device, dtype, gemm16)?;
    rows.extend(mlp_rows(&device, dtype, gemm16, bandwidth)?);
    let mut rng = StdRng::seed_from_u64(0);
    let k = Tensor::randn(0f32, 1.0, (kv_heads, a.context, d), &device)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1.0, (kv_heads, a.context, d), &device)?.to_dtype(dtype)?;
    // Queries in the model's dtype (bf16 on a GPU: the tensor-core kernel), and on a GPU f32
    // queries too, which take the CUDA-core kernels.
    let q = Tensor::randn(0f32, 1.0, (heads, d), &device)?.to_dtype(dtype)?;
    let q32 = q.to_dtype(DType::F32)?;
    let queries: &[(&Tensor, &str)] =
        if device.is_cpu() { &[(&q, "")] } else { &[(&q, "tensor cores"), (&q32, "f32 queries, CUDA cores")] };
    let elem = dtype.size_in_bytes() as f64;
    for &sel in &a.select {
        // A decode step's attention over `sel` rows of each KV head, shared by its group (a
        // gathered pick, BUZZ's live rows): each row is read once per group.
        let sel = sel.min(a.context);
        for &(q, path) in queries {
            let secs = time_calls(&device, || sparse::decode_attention_rows(q, &k, &v, sel, None, 0.088))?;
            let bytes = (kv_heads * sel) as f64 * 2.0 * d as f64 * elem + (heads * d * 8) as f64;
            let path = if path.is_empty() { String::new() } else { format!(", {path}") };
            rows.push(KernelRow {
                kernel: format!(
                    "decode_attention_rows {heads} heads over {sel} rows of {kv_heads} KV heads (d {d}, {dtype:?}{path})"
                ),
                seconds: secs,
                bytes,
                flops: 4.0 * (heads * sel * d) as f64,
                of_limit: bytes / secs / bandwidth,
                limit: "copy bandwidth",
            });
        }
    }
    drop((k, v));
    // Double Sparsity's label scan over the whole context: r = d/4 one-byte codes per token.
    let r = d / 4;
    let codes = Tensor::zeros((kv_heads, a.context, r), DType::U8, &device)?;
    let scale = Tensor::ones((kv_heads, a.context, 2), DType::F32, &device)?;
    let ql = Tensor::randn(0f32, 1.0, (heads, r), &device)?;
    let secs = time_calls(&device, || sparse::label_scores(&ql, &codes, &scale, LABEL_BITS))?;
    let bytes = (kv_heads * a.context * (r + 8) + heads * a.context * 4) as f64;
    rows.push(KernelRow {
        kernel: format!("label_scores {heads}x{} tokens, r {r}", a.context),
        seconds: secs,
        bytes,
        flops: 2.0 * (heads * a.context * r) as f64,
        of_limit: bytes / secs / bandwidth,
        limit: "copy bandwidth (labels once per KV head)",
    });
    drop((codes, scale));
    // Top-k over one layer's scores (a query head's row of the whole context), k = the
    // budget the decode benchmarks use: four reads of the scores.
    let scores = Tensor::randn(0f32, 1.0, (heads, a.context), &device)?;
    let secs = time_calls(&device, || folio_kernels::select::topk(&scores, TOPK_K))?;
    let bytes = 4.0 * (heads * a.context * 4) as f64;
    rows.push(KernelRow::moving(
        format!("topk {heads}x{} scores, k {TOPK_K}", a.context),
        secs,
        bytes,
        bandwidth,
        "copy bandwidth",
    ));
    drop(scores);
    // The gather of picked rows from the host tier (K of one layer) into device memory.
    let link = folio_kernels::device::host_to_device_rate(&device, COPY_BYTES)?;
    let mut host = folio_kernels::select::HostRows::new(&device, dtype, kv_heads, a.context, d)?;
    for start in (0..a.context).step_by(1 << 16) {
        let t = (1usize << 16).min(a.context - start);
        host.write(start, &Tensor::randn(0f32, 1.0, (kv_heads, t, d), &device)?.to_dtype(dtype)?)?;
    }
    for &sel in &a.select {
        let idx: Vec<u32> = (0..heads * sel).map(|_| rng.random_range(0..a.context as u32)).collect();
        let idx = Tensor::from_vec(idx, (heads, sel), &device)?;
        let secs =
            time_calls(&device, || host.gather(&idx, heads / kv_heads, None, folio_kernels::Positions::Trusted))?;
        let bytes = (heads * sel * d) as f64 * elem;
        let kernel = format!("gather {heads}x{sel} rows from host memory (d {d}, {dtype:?})");
        rows.push(KernelRow::moving(kernel, secs, bytes, link, "host link (page-locked copy)"));
    }
    drop(host);
    let (bits, tables) = HASH_BITS_TABLES;
    let hash_rows = if device.is_cpu() { HASH_ROWS / 64 } else { HASH_ROWS };
    let x = Tensor::randn(0f32, 1.0, (hash_rows, d), &device)?;
    let w = Tensor::randn(0f32, 1.0, (d, bits * tables), &device)?;
    let secs = time_calls(&device, || sparse::simhash_codes(&x, &w, bits, tables))?;
    let flops = 2.0 * (hash_rows * d * bits * tables) as f64;
    rows.push(KernelRow {
        kernel: format!("simhash_codes {hash_rows} rows, d {d}, (K,L) = ({bits},{tables})"),
        seconds: secs,
        bytes: ((hash_rows * d + d * bits * tables + hash_rows * tables) * 4) as f64,
        flops,
        of_limit: flops / secs / gemm,
        limit: "f32 GEMM rate",
    });
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "device": device_name(&device), "copy_bandwidth": bandwidth, "host_link": link,
                                "f32_gemm_flops": gemm, "gemm_flops": gemm16, "gemm_dtype": format!("{dtype:?}"),
                                "kernels": rows })
        );
        return Ok(());
    }
    println!(
        "device {}: copy bandwidth {:.0} GB/s, host link {:.1} GB/s, f32 GEMM {:.2} TFLOP/s, {dtype:?} GEMM {:.2} \
         TFLOP/s (measured now)",
        device_name(&device),
        bandwidth / 1e9,
        link / 1e9,
        gemm / 1e12,
        gemm16 / 1e12
    );
    println!("{:<62} {:>10} {:>10} {:>10} {:>9}", "kernel", "µs/call", "GB/s", "GFLOP/s", "÷ limit");
    for r in &rows {
        println!(
            "{:<62} {:>10.1} {:>10.1} {:>10.1} {:>8.1}%",
            r.kernel,
            r.seconds * 1e6,
            r.bytes / r.seconds / 1e9,
            r.flops / r.seconds / 1e9,
            100.0 * r.of_limit
        );
    }
    Ok(())
}

/// Causal attention of a prefill (Qwen2.5-7B's heads, every query over its keys so far): on a
/// GPU in bf16 the tensor-core kernel, held to the bf16 GEMM rate `gemm` (same FLOPs per byte
/// class: both are tensor-core bound at this size).
/// The causal prefill attention, timed through the default path and, on a GPU, through each
/// tensor-core kernel it has (`flash_kernels`): one row each.
fn prefill_rows(device: &candle_core::Device, dtype: DType, gemm: f64) -> Result<Vec<KernelRow>> {
    let (heads, kv_heads, d) = KERNEL_SHAPE;
    let n = if device.is_cpu() { PREFILL_TOKENS_CPU } else { PREFILL_TOKENS };
    let q = Tensor::randn(0f32, 1.0, (heads, n, d), device)?.to_dtype(dtype)?;
    let k = Tensor::randn(0f32, 1.0, (kv_heads, n, d), device)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1.0, (kv_heads, n, d), device)?.to_dtype(dtype)?;
    let scale = 1.0 / (d as f32).sqrt();
    let mask = folio_kernels::Mask::causal(0);
    // QKᵀ and PV over the n(n+1)/2 visible pairs; Q, K, V read once, f32 output and LSE written.
    let flops = 4.0 * (d * heads) as f64 * (n * (n + 1) / 2) as f64;
    let elem = dtype.size_in_bytes();
    let bytes = ((heads + 2 * kv_heads) * n * d * elem + heads * n * (d + 1) * 4) as f64;
    let row = |name: String, secs: f64| KernelRow {
        kernel: format!("prefill attention {heads}/{kv_heads} heads x {n} tokens causal (d {d}, {dtype:?}){name}"),
        seconds: secs,
        bytes,
        flops,
        of_limit: flops / secs / gemm,
        limit: "GEMM rate, same dtype",
    };
    let mut rows = vec![row(String::new(), time_calls(device, || folio_kernels::attention(&q, &k, &v, mask, scale))?)];
    if dtype == DType::BF16 {
        for kernel in folio_kernels::attention::flash_kernels(device, d) {
            let secs = time_calls(device, || {
                folio_kernels::attention::flash_attention_block(kernel, &q, &k, &v, 0, mask, scale)
            })?;
            rows.push(row(format!(", {kernel:?} kernel"), secs));
        }
    }
    Ok(rows)
}

/// Qwen2.5's RMSNorm epsilon (the norm rows' cost does not depend on it).
const NORM_EPS: f32 = 1e-6;

/// The prefill's MLP as model.rs runs it (`x Wᵀ` per projection, the fused SiLU(gate) · up, the
/// down projection and the residual), each part timed alone (the activation also as candle's
/// two passes), the RMSNorm before it (also as candle's kernel), and then the whole: which of
/// them keeps the MLP from the GEMM rate the run measured.
fn mlp_rows(device: &candle_core::Device, dtype: DType, gemm: f64, bandwidth: f64) -> Result<Vec<KernelRow>> {
    let (hidden, inter) = MLP_SHAPE;
    let n = if device.is_cpu() { MLP_TOKENS_CPU } else { MLP_TOKENS };
    let elem = dtype.size_in_bytes() as f64;
    let randn = |rows: usize, cols: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, (rows, cols), device)?.to_dtype(dtype)?)
    };
    let (x, gate, up, down) = (randn(n, hidden)?, randn(inter, hidden)?, randn(inter, hidden)?, randn(hidden, inter)?);
    let gemm_row = |name: &str, k: usize, m: usize, secs: f64| {
        let flops = 2.0 * (n * k * m) as f64;
        KernelRow {
            kernel: format!("MLP {name}: {n}x{k} by {k}x{m} ({dtype:?})"),
            seconds: secs,
            bytes: ((n * k + k * m + n * m) as f64) * elem,
            flops,
            of_limit: flops / secs / gemm,
            limit: "GEMM rate, same dtype",
        }
    };
    let mut rows =
        vec![gemm_row("gate (or up) projection", hidden, inter, time_calls(device, || x.matmul(&gate.t()?))?)];
    let (g, u) = (randn(n, inter)?, randn(n, inter)?);
    rows.push(gemm_row("down projection", inter, hidden, time_calls(device, || g.matmul(&down.t()?))?));
    // The activation reads the gate and up once and writes once (3 values an element); candle's
    // two passes also write and read back the gate's SiLU (5), but are charged 3 here too: the
    // row says how far each is from what the activation must move.
    let bytes = 3.0 * (n * inter) as f64 * elem;
    for (name, secs) in [
        ("fused (kernels/cuda/swiglu.cu)", time_calls(device, || folio_kernels::mlp::swiglu(&g, &u))?),
        ("as candle's SiLU, then product", time_calls(device, || folio_kernels::mlp::reference(&g, &u))?),
    ] {
        let kernel = format!("MLP SiLU(gate) * up, {name}: {n}x{inter} ({dtype:?})");
        rows.push(KernelRow::moving(kernel, secs, bytes, bandwidth, "copy bandwidth"));
    }
    drop((g, u));
    // The norm before the MLP reads a row and writes it (2 values an element, the weight aside).
    let w = Tensor::randn(0f32, 1.0, hidden, device)?.to_dtype(dtype)?;
    let bytes = 2.0 * (n * hidden) as f64 * elem;
    for (name, secs) in [
        (
            "one warp a row (kernels/cuda/rmsnorm.cu)",
            time_calls(device, || folio_kernels::norm::rms_norm(&x, &w, NORM_EPS))?,
        ),
        ("candle's kernel", time_calls(device, || folio_kernels::norm::reference(&x, &w, NORM_EPS))?),
    ] {
        let kernel = format!("RMSNorm, {name}: {n}x{hidden} ({dtype:?})");
        rows.push(KernelRow::moving(kernel, secs, bytes, bandwidth, "copy bandwidth"));
    }
    let secs = time_calls(device, || {
        let gated = folio_kernels::mlp::swiglu(&x.matmul(&gate.t()?)?, &x.matmul(&up.t()?)?)?;
        &x + gated.matmul(&down.t()?)?
    })?;
    let flops = 6.0 * (n * hidden * inter) as f64;
    rows.push(KernelRow {
        kernel: format!("MLP whole, residual included: {n} tokens, {hidden} -> {inter} -> {hidden} ({dtype:?})"),
        seconds: secs,
        bytes: ((3 * hidden * inter + 2 * n * hidden) as f64) * elem,
        flops,
        of_limit: flops / secs / gemm,
        limit: "GEMM rate, same dtype",
    });
    Ok(rows)
}

/// What `bench prefill` prefills with: a loaded model, or random weights of a real shape.
struct Subject {
    name: String,
    stamp: ModelStamp,
    made: Made,
}

enum Made {
    Loaded(Box<Engine>),
    Random(Box<folio_models::model::Model>),
}

impl Subject {
    fn new(common: &Common, a: &PrefillBenchArgs) -> Result<Self> {
        let Some(shape) = &a.shape else {
            let engine = common.engine()?;
            let stamp = engine.stamp()?.clone();
            return Ok(Self { name: engine.name.clone(), stamp, made: Made::Loaded(Box::new(engine)) });
        };
        if common.model.is_some() {
            anyhow::bail!("--shape and --model are two different models: give one");
        }
        let mut cfg = ModelConfig::from_file(shape)?;
        // A shape is a fact about cost: prompts past its trained length are still measured,
        // with the question after the reopen and any growth.
        let longest = a.tokens.iter().map(|&n| positions_used(n, a)).max().unwrap_or(0);
        cfg.max_position_embeddings = cfg.max_position_embeddings.max(longest);
        let device = folio_models::parse_device(&common.device)?;
        let dtype = folio_models::parse_dtype(&common.dtype, &device)?;
        let model = folio_models::model::Model::random(&cfg, &device, dtype, crate::bench_shape::INIT_STD)?;
        let name = shape.file_stem().map_or("shape".into(), |s| s.to_string_lossy().into_owned());
        let fingerprint = cfg.fingerprint("none".into(), "random".into())?;
        let stamp = ModelStamp { name: name.clone(), source: shape.display().to_string(), fingerprint };
        Ok(Self { name: format!("{name} (random weights)"), stamp, made: Made::Random(Box::new(model)) })
    }

    fn model(&self) -> &folio_models::model::Model {
        match &self.made {
            Made::Loaded(e) => &e.model,
            Made::Random(m) => m,
        }
    }
}

/// Positions a row of `n` tokens takes: its prompt, any growth, and the question asked after
/// the reopen.
fn positions_used(n: usize, a: &PrefillBenchArgs) -> usize {
    n + a.append.unwrap_or(0) + QUESTION_TOKENS
}

fn bench_prefill(common: &Common, a: PrefillBenchArgs) -> Result<()> {
    let kv_dtype = KvDtype::parse(&a.kv_dtype)?;
    if let Some(d) = a.dir.as_ref().filter(|d| !d.is_dir()) {
        anyhow::bail!("--dir {}: no such folder (the context files are written there: create it first)", d.display());
    }
    let device = folio_models::parse_device(&common.device)?;
    let sampler = MemorySampler::start(&device)?;
    let subject = Subject::new(common, &a)?;
    let model = subject.model();
    // Before any prefill: a row that cannot take its question fails after minutes otherwise.
    let window = model.config().max_position_embeddings;
    if let Some(&n) = a.tokens.iter().find(|&&n| positions_used(n, &a) > window) {
        anyhow::bail!(
            "--tokens {n} leaves no room for the {QUESTION_TOKENS}-token question asked after the reopen{}: {} has \
             {window} positions, so a row can be at most {} tokens",
            a.append.map_or(String::new(), |m| format!(" and the {m} tokens --append adds")),
            subject.name,
            window.saturating_sub(positions_used(0, &a))
        );
    }
    let vram_budget = a.vram_budget.as_deref().map(parse_bytes).transpose()?;
    // The chunk plan gets what the VRAM budget leaves after what is in use now (the weights,
    // the runtime) and a margin for cuBLAS and the allocator.
    let mut memory_budget = a.memory_budget.as_deref().map(parse_bytes).transpose()?;
    if let (Some(b), Some((used, _))) = (vram_budget, sampler.now()?) {
        let left = b.checked_sub(used + VRAM_MARGIN).with_context(|| {
            format!(
                "--vram-budget {} is below what is already in use ({}: weights and runtime) plus a {} margin",
                human_bytes(b),
                human_bytes(used),
                human_bytes(VRAM_MARGIN)
            )
        })?;
        memory_budget = Some(memory_budget.map_or(left, |m| m.min(left)));
    }
    let dir = match &a.dir {
        Some(d) if a.resume => Scratch::Kept(d.clone()),
        d => Scratch::Temp(
            tempfile::Builder::new().prefix("folio-bench").tempdir_in(d.clone().unwrap_or_else(std::env::temp_dir))?,
        ),
    };
    let matmul = matmul_flops(model.device(), model.dtype())?;
    // One short prefill first, untimed: the driver compiles each kernel's PTX at its first
    // launch and cuBLAS loads its kernels lazily (seconds, once per process; the driver's cache
    // keeps them across runs on a user's machine), and the peer script warms up the same way.
    let warm_tokens = a.tokens.iter().copied().min().unwrap_or(0).min(WARMUP_TOKENS);
    let warmup = {
        let started = Instant::now();
        let opts = BuildOptions { kv_dtype, memory_budget, restart: true, hidden_in: None };
        let n = warm_tokens;
        let out = dir.path().join("warm-up.folio");
        let plan = PrefixPlan::raw_tokens((0..n as u32).map(|i| i % model.config().vocab_size as u32).collect());
        context::build(model, &subject.stamp, &plan, &out, &opts, &mut |_| ControlFlow::Continue(()))?;
        std::fs::remove_file(&out).with_context(|| format!("removing {}", out.display()))?;
        started.elapsed().as_secs_f64()
    };
    if !a.json {
        println!("warm-up: a {warm_tokens}-token prefill in {warmup:.2} s (kernel compilation, first allocations)");
    }
    // Ctrl-C stops a long prefill between chunks with its last finished layer kept, so that
    // `--dir D --resume` picks it up again.
    let stop = crate::context_cmd::ctrl_c_flag();
    let mut rows = Vec::new();
    for &n in &a.tokens {
        let opts = BuildOptions { kv_dtype, memory_budget, restart: !a.resume, hidden_in: None };
        let measure = Measure { matmul, sampler: &sampler, stop: &stop };
        rows.push(one(&subject, n, &opts, dir.path(), (a.append, a.offload), &measure)?);
        if !a.json {
            let row = rows.last().expect("just pushed");
            print_row(row, rows.len() == 1, &subject, matmul);
            if let Some(g) = &row.append {
                println!(
                    "{:>8} grown by {} tokens in {:.2} s; all {} in one go {:.2} s: {:.1}% of it (the new tokens' \
                     share of the work {:.1}%)",
                    "",
                    g.new_tokens,
                    g.append_seconds,
                    row.tokens + g.new_tokens,
                    g.full_seconds,
                    100.0 * g.ratio,
                    100.0 * g.work_share
                );
            }
        }
    }
    let profile = match (a.profile, a.tokens.first()) {
        (true, Some(&n)) => Some(profile_prefill(&subject, n, kv_dtype, memory_budget, dir.path())?),
        _ => None,
    };
    if let (Some(p), false) = (&profile, a.json) {
        print_profile(p);
    }
    if a.json {
        let doc = serde_json::json!({
            "model": subject.name,
            "device": device_name(model.device()),
            "dtype": format!("{:?}", model.dtype()).to_lowercase(),
            "kv_dtype": kv_dtype,
            "threads": candle_core::utils::get_num_threads(),
            "matmul_flops_per_s": matmul,
            "vram_budget_bytes": vram_budget,
            "warmup_seconds": warmup,
            "rows": rows,
            "profile": profile,
        });
        println!("{doc}");
    }
    if let Some(b) = vram_budget {
        if let Some(r) = rows.iter().find(|r| r.peak_vram_bytes.is_some_and(|p| p > b)) {
            anyhow::bail!(
                "the prefill of {} tokens peaked at {} of device memory, over the {} budget",
                r.tokens,
                human_bytes(r.peak_vram_bytes.unwrap_or(0)),
                human_bytes(b)
            );
        }
    }
    Ok(())
}

/// Where one prefill's time went: each span of the forward pass with the device synchronised
/// around it (`folio_models::profile`), and the stages outside the forward passes.
#[derive(Serialize)]
struct Profile {
    tokens: usize,
    seconds: f64,
    spans: Vec<ProfileSpan>,
    stages: StageSeconds,
}

#[derive(Serialize)]
struct ProfileSpan {
    name: &'static str,
    seconds: f64,
    calls: usize,
}

fn profile_prefill(
    subject: &Subject,
    n: usize,
    kv_dtype: KvDtype,
    memory_budget: Option<u64>,
    dir: &std::path::Path,
) -> Result<Profile> {
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(n as u64);
    let plan = PrefixPlan::raw_tokens((0..n).map(|_| rng.random_range(0..vocab)).collect());
    let out = dir.join(format!("profile-{n}.folio"));
    let opts = BuildOptions { kv_dtype, memory_budget, restart: true, hidden_in: None };
    folio_models::profile::start(folio_models::profile::Clock::Device);
    let report = context::build(model, &subject.stamp, &plan, &out, &opts, &mut |_| ControlFlow::Continue(()));
    let spans = folio_models::profile::finish();
    let report = report?;
    std::fs::remove_file(&out).with_context(|| format!("removing {}", out.display()))?;
    Ok(Profile {
        tokens: n,
        seconds: report.seconds,
        spans: spans.into_iter().map(|(name, seconds, calls)| ProfileSpan { name, seconds, calls }).collect(),
        stages: report.stages,
    })
}

fn print_profile(p: &Profile) {
    println!("\nprofile of a {}-token prefill (device synchronised around each op): {:.2} s", p.tokens, p.seconds);
    println!("  {:<28} {:>9} {:>7} {:>7}", "op", "seconds", "share", "calls");
    let st = &p.stages;
    let outside = [
        ("K/V encode", st.encode),
        ("K/V store (writer waits)", st.store),
        ("hidden states (checkpoints)", st.hidden_io),
    ];
    let spans = p.spans.iter().map(|s| (s.name, s.seconds, Some(s.calls)));
    for (name, secs, calls) in spans.chain(outside.into_iter().map(|(n, s)| (n, s, None))) {
        let calls = calls.map_or(String::new(), |c| c.to_string());
        println!("  {:<28} {:>9.3} {:>6.1}% {:>7}", name, secs, 100.0 * secs / p.seconds, calls);
    }
}

/// What each timed row is measured against: the large-matmul rate, the device memory sampler,
/// and the Ctrl-C flag that stops a row between chunks.
#[derive(Clone, Copy)]
struct Measure<'a> {
    matmul: f64,
    sampler: &'a MemorySampler,
    stop: &'a std::sync::atomic::AtomicBool,
}

/// Where the bench's context files go: a temporary folder, or `--dir` kept for `--resume`.
enum Scratch {
    Temp(tempfile::TempDir),
    Kept(PathBuf),
}

impl Scratch {
    fn path(&self) -> &std::path::Path {
        match self {
            Self::Temp(t) => t.path(),
            Self::Kept(p) => p,
        }
    }
}

fn one(
    subject: &Subject,
    n: usize,
    opts: &BuildOptions,
    dir: &std::path::Path,
    (append, offload): (Option<usize>, bool),
    m: &Measure<'_>,
) -> Result<Row> {
    let Measure { matmul, sampler, stop } = *m;
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(n as u64);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let plan = PrefixPlan::raw_tokens(tokens);
    let out = dir.join(format!("bench-{n}.folio"));
    // Peak RSS per length: Linux resets VmHWM when "5" is written to clear_refs.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    sampler.reset();
    let report = context::build(model, &subject.stamp, &plan, &out, opts, &mut |_| {
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    let (peak, peak_vram) = (peak_rss(), sampler.peak());
    // On stderr at once: at a million tokens the reopen after it takes a minute more, and a run
    // cut short there still says what the prefill did.
    eprintln!(
        "prefilled {n} tokens in {:.2} s ({:.0} tokens/s; {} of {} layers computed here), peak VRAM {}, peak RSS {}; \
         reopening",
        report.seconds,
        report.tokens_per_s,
        report.layers - report.resumed_layers,
        report.layers,
        peak_vram.map_or("n/a".into(), human_bytes),
        peak.map_or("n/a".into(), human_bytes)
    );
    // Open as `folio chat --context` does (the model's fingerprint checked), then a question
    // through the model until the first token's logits exist, on the tier a user's settings
    // would put it: the offloaded one when the decoded layers do not fit the device.
    let cfg = model.config();
    let decoded = (cfg.kv_bytes_per_token(model.dtype().size_in_bytes()) * n) as u64;
    let tier =
        if offload || opts.memory_budget.is_some_and(|b| decoded > b) { Tier::Offloaded } else { Tier::Resident };
    let mut reopen = || -> Result<Reopen> {
        let start = Instant::now();
        let file = match &subject.made {
            Made::Loaded(engine) => engine.open_context(&out)?,
            Made::Random(_) => {
                let file = folio_models::context::ContextFile::open(&out)?;
                if file.header().model.fingerprint != subject.stamp.fingerprint {
                    anyhow::bail!("{} was not made by this shape", out.display());
                }
                file
            }
        };
        let open = start.elapsed().as_secs_f64();
        let file = Arc::new(file);
        let (mut kv, in_place): (Box<dyn KvStore>, bool) = match tier {
            Tier::Resident => (Box::new(ContextKv::new(file, model.dtype(), model.device(), u64::MAX)), false),
            Tier::Offloaded => {
                let kv = OffloadKv::from_context(file, model.dtype(), model.device())?;
                let in_place = kv.in_place();
                (Box::new(kv), in_place)
            }
        };
        let store = start.elapsed().as_secs_f64() - open;
        let question: Vec<u32> = (0..QUESTION_TOKENS).map(|_| rng.random_range(0..vocab)).collect();
        let logits = model.forward(&question, kv.as_mut(), &Dense, Logits::Last)?;
        logits.argmax(1)?.to_vec1::<u32>()?;
        let seconds = start.elapsed().as_secs_f64();
        Ok(Reopen { seconds, open, store, question: seconds - open - store, in_place })
    };
    drop_page_cache(&out);
    let reopen_cold = reopen()?;
    let reopen_warm = reopen()?;
    // The reopen keeps every layer on the device; what the pool keeps of it afterwards is not
    // the next row's.
    folio_kernels::device::trim_pool(model.device())?;
    let disk_read_bytes_per_s = disk_read_rate(&out)?;
    let append = append.map(|m| grow(subject, &out, m, opts, dir, &mut rng)).transpose()?;
    std::fs::remove_file(&out).with_context(|| format!("removing {}", out.display()))?;
    let computed = report.layers - report.resumed_layers;
    let flops = prefill_flops(model.config(), n) * computed as f64 / report.layers as f64 / report.seconds;
    Ok(Row {
        tokens: n,
        layers_computed: computed,
        prefill_seconds: report.seconds,
        tokens_per_s: report.tokens_per_s,
        flops_per_s: flops,
        flops_ratio_to_matmul: flops / matmul,
        peak_rss_bytes: peak,
        peak_vram_bytes: peak_vram,
        chunk: report.chunk,
        stages: report.stages.clone(),
        hidden_in: report.hidden_in,
        checkpoints: report.checkpoints,
        working_set_bytes: report.working_set_bytes,
        file_bytes: report.file_bytes,
        reopen_first_token_seconds: reopen_cold.seconds,
        reopen_warm_seconds: reopen_warm.seconds,
        reopen_ratio: reopen_cold.seconds / report.seconds,
        reopen_tier: tier.name(),
        reopen_cold,
        reopen_warm,
        disk_read_bytes_per_s,
        append,
    })
}

/// Grows the context at `base` by `m` random tokens, and prefills the same tokens in one go.
fn grow(
    subject: &Subject,
    base: &std::path::Path,
    m: usize,
    opts: &BuildOptions,
    dir: &std::path::Path,
    rng: &mut StdRng,
) -> Result<AppendRow> {
    let model = subject.model();
    let vocab = model.config().vocab_size as u32;
    let file = folio_models::context::ContextFile::open(base)?;
    let n = file.tokens().len();
    let mut plan = PrefixPlan::raw_tokens(file.tokens().to_vec());
    plan.tokens.extend((0..m).map(|_| rng.random_range(0..vocab)));
    plan.documents = file.documents().to_vec();
    let mut added = plan.documents[0].clone();
    (added.title, added.start, added.end) = ("added".into(), n, n + m);
    plan.documents.push(added);
    let (grown, whole) = (dir.join(format!("bench-{n}+{m}.folio")), dir.join(format!("bench-{}.folio", n + m)));
    let started = Instant::now();
    context::append(model, &subject.stamp, &file, &plan, &grown, opts, &mut |_| ControlFlow::Continue(()))?;
    let append_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    context::build(model, &subject.stamp, &plan, &whole, opts, &mut |_| ControlFlow::Continue(()))?;
    let full_seconds = started.elapsed().as_secs_f64();
    for p in [&grown, &whole] {
        std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))?;
    }
    let cfg = model.config();
    let work_share = 1.0 - prefill_flops(cfg, n) / prefill_flops(cfg, n + m);
    Ok(AppendRow { new_tokens: m, append_seconds, full_seconds, ratio: append_seconds / full_seconds, work_share })
}

fn print_row(r: &Row, first: bool, subject: &Subject, matmul: f64) {
    if first {
        println!(
            "model {} on {} ({:?}, {} threads); large-matmul rate {:.1} GFLOP/s",
            subject.name,
            device_name(subject.model().device()),
            subject.model().dtype(),
            candle_core::utils::get_num_threads(),
            matmul / 1e9
        );
        println!(
            "{:>8} {:>7} {:>10} {:>9} {:>8} {:>7} {:>6} {:>10} {:>10} {:>11} {:>10} {:>12} {:>8}",
            "tokens",
            "layers",
            "prefill s",
            "tok/s",
            "GFLOP/s",
            "÷peak",
            "chunk",
            "peak RSS",
            "peak VRAM",
            "working set",
            "file",
            "reopen→1st s",
            "÷prefill"
        );
    }
    let opt = |x: Option<u64>| x.map_or("-".into(), human_bytes);
    println!(
        "{:>8} {:>7} {:>10.2} {:>9.0} {:>8.2} {:>6.1}% {:>6} {:>10} {:>10} {:>11} {:>10} {:>12} {:>8}",
        r.tokens,
        r.layers_computed,
        r.prefill_seconds,
        r.tokens_per_s,
        r.flops_per_s / 1e9,
        100.0 * r.flops_ratio_to_matmul,
        r.chunk,
        opt(r.peak_rss_bytes),
        opt(r.peak_vram_bytes),
        human_bytes(r.working_set_bytes),
        human_bytes(r.file_bytes),
        format!("{:.4}", r.reopen_first_token_seconds),
        format!("{:.3}%", 100.0 * r.reopen_ratio),
    );
    let st = &r.stages;
    println!(
        "{:>8} seconds in: compute {:.2}, hidden states {:.2} (kept in {:?}, checkpoints: {}), K/V encode {:.2}, \
         store {:.2}",
        "", st.compute, st.hidden_io, r.hidden_in, r.checkpoints, st.encode, st.store
    );
    let parts = |x: &Reopen| {
        let how = match (r.reopen_tier, x.in_place) {
            ("offloaded", true) => ", rows read in place",
            ("offloaded", false) => ", rows copied: the GPU would not register the file's mapping",
            _ => "",
        };
        format!("open {:.3}, K/V store {:.3}, question {:.3}{how}", x.open, x.store, x.question)
    };
    println!(
        "{:>8} reopen on the {} tier: from disk {:.3} s ({}; the file over the disk's {}/s read rate: {:.2} s), \
         cached {:.3} s ({})",
        "",
        r.reopen_tier,
        r.reopen_cold.seconds,
        parts(&r.reopen_cold),
        human_bytes(r.disk_read_bytes_per_s as u64),
        r.file_bytes as f64 / r.disk_read_bytes_per_s,
        r.reopen_warm.seconds,
        parts(&r.reopen_warm)
    );
}

/// Multiply-adds ×2 of a layer-major prefill of `n` tokens: projections and MLP per token and
/// layer, causal attention (QKᵀ and PV over n²/2 pairs), one LM-head row.
fn prefill_flops(c: &ModelConfig, n: usize) -> f64 {
    let (h, q, kv, i) = (
        c.hidden_size as f64,
        (c.num_heads * c.head_dim) as f64,
        (c.num_kv_heads * c.head_dim) as f64,
        c.intermediate_size as f64,
    );
    let per_token_layer = 2.0 * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i);
    let n = n as f64;
    let attention = 2.0 * 2.0 * q * n * n / 2.0;
    c.num_layers as f64 * (per_token_layer * n + attention) + 2.0 * h * c.vocab_size as f64
}

/// FLOP/s of a large square matmul in `dtype` on `dev`: what the hardware delivers in practice
/// for the dominant operation.
fn matmul_flops(dev: &candle_core::Device, dtype: DType) -> Result<f64> {
    let side = if dev.is_cpu() { MATMUL_SIDE } else { GEMM_SIDE };
    let a = Tensor::randn(0f32, 1.0, (side, side), dev)?.to_dtype(dtype)?;
    Ok(2.0 * (side as f64).powi(3) / time_calls(dev, || a.matmul(&a))?)
}

/// The disk's sequential read rate, bytes/s: the first [`DISK_PROBE_BYTES`] of `path` evicted
/// from the page cache and read back in large pieces.
fn disk_read_rate(path: &std::path::Path) -> Result<f64> {
    use std::io::Read;
    drop_page_cache(path);
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut buf = vec![0u8; DISK_PROBE_PIECE];
    let (start, mut read) = (Instant::now(), 0usize);
    while read < DISK_PROBE_BYTES {
        match f.read(&mut buf).with_context(|| format!("reading {}", path.display()))? {
            0 => break,
            got => read += got,
        }
    }
    Ok(read as f64 / start.elapsed().as_secs_f64())
}

/// Evicts a fully written file from the page cache, so the reopen reads from disk as after a reboot.
fn drop_page_cache(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::File::open(path) {
        // SAFETY: advisory call on a valid, open file descriptor.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}
