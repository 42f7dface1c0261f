//! `folio bench kernels`: the sparse-decode and prefill kernels timed on the device, each
//! against the limit that binds it (copy bandwidth, host link, GEMM rate) measured in the same
//! run.

use anyhow::Result;
use candle_core::{DType, Tensor};
use clap::Args;
use folio_models::device_name;
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use super::{
    matmul_flops, time_calls, COPY_BYTES, HASH_BITS_TABLES, HASH_ROWS, KERNEL_SHAPE, LABEL_BITS, MLP_SHAPE, MLP_TOKENS,
    MLP_TOKENS_CPU, PREFILL_TOKENS, PREFILL_TOKENS_CPU, TOPK_K,
};
use crate::cli::Common;

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

#[derive(Serialize)]
pub(super) struct KernelRow {
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

pub(super) fn bench_kernels(common: &Common, a: KernelBenchArgs) -> Result<()> {
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
    let link = folio_runtime::device::host_to_device_rate(&device, COPY_BYTES)?;
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
    let limits = Limits { bandwidth, link, gemm, gemm16, dtype };
    report(&device, &limits, &rows, a.json);
    Ok(())
}

/// The limits `bench kernels` measured in its run.
struct Limits {
    bandwidth: f64,
    link: f64,
    gemm: f64,
    gemm16: f64,
    /// The dtype of `gemm16`: bf16 on a GPU, f32 on the CPU.
    dtype: DType,
}

/// The kernels' rows as a table with the limits above it, or as one JSON document.
fn report(device: &candle_core::Device, l: &Limits, rows: &[KernelRow], json: bool) {
    let Limits { bandwidth, link, gemm, gemm16, dtype } = *l;
    if json {
        println!(
            "{}",
            serde_json::json!({ "device": device_name(device), "copy_bandwidth": bandwidth, "host_link": link,
                                "f32_gemm_flops": gemm, "gemm_flops": gemm16, "gemm_dtype": format!("{dtype:?}"),
                                "kernels": rows })
        );
        return;
    }
    println!(
        "device {}: copy bandwidth {:.0} GB/s, host link {:.1} GB/s, f32 GEMM {:.2} TFLOP/s, {dtype:?} GEMM {:.2} \
         TFLOP/s (measured now)",
        device_name(device),
        bandwidth / 1e9,
        link / 1e9,
        gemm / 1e12,
        gemm16 / 1e12
    );
    println!("{:<62} {:>10} {:>10} {:>10} {:>9}", "kernel", "µs/call", "GB/s", "GFLOP/s", "÷ limit");
    for r in rows {
        println!(
            "{:<62} {:>10.1} {:>10.1} {:>10.1} {:>8.1}%",
            r.kernel,
            r.seconds * 1e6,
            r.bytes / r.seconds / 1e9,
            r.flops / r.seconds / 1e9,
            100.0 * r.of_limit
        );
    }
}

/// Causal attention of a prefill (Qwen2.5-7B's heads, every query over its keys so far): on a
/// GPU in bf16 the tensor-core kernel, held to the bf16 GEMM rate `gemm` (same FLOPs per byte
/// class: both are tensor-core bound at this size).
/// The causal prefill attention, timed through the default path and, on a GPU, through each
/// tensor-core kernel it has (`flash_kernels`): one row each.
pub(super) fn prefill_rows(device: &candle_core::Device, dtype: DType, gemm: f64) -> Result<Vec<KernelRow>> {
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
pub(super) const NORM_EPS: f32 = 1e-6;

/// The prefill's MLP as model.rs runs it (`x Wᵀ` per projection, the fused SiLU(gate) · up, the
/// down projection and the residual), each part timed alone (the activation also as candle's
/// two passes), the RMSNorm before it (also as candle's kernel), and then the whole: which of
/// them keeps the MLP from the GEMM rate the run measured.
pub(super) fn mlp_rows(
    device: &candle_core::Device,
    dtype: DType,
    gemm: f64,
    bandwidth: f64,
) -> Result<Vec<KernelRow>> {
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
