//! The sparse-decode and prefill kernels timed on the device, each against the limit that
//! binds it (copy bandwidth, host link, GEMM rate) measured in the same run.

use candle_core::{DType, Device, Tensor};
use folio_models::device_name;
use folio_models::error::{Error, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use super::{matmul_flops, time_calls};

/// Qwen2.5-7B's attention shape: query heads, KV heads, head dim.
const KERNEL_SHAPE: (usize, usize, usize) = (28, 4, 128);
/// Qwen2.5-7B's MLP: hidden and intermediate sizes.
const MLP_SHAPE: (usize, usize) = (3584, 18_944);
/// Tokens per MLP call timed: the chunk a prefill runs that shape in under a 24 GiB cap (the
/// CPU: fewer).
const MLP_TOKENS: usize = 8192;
const MLP_TOKENS_CPU: usize = 64;
/// SimHash benchmark: rows hashed and the paper's (K, L) = (10, 150).
const HASH_ROWS: usize = 65_536;
const HASH_BITS_TABLES: (usize, usize) = (10, 150);
const LABEL_BITS: usize = 4;
/// Top-k benchmark: rows kept per query head (the decode benchmarks' budget).
const TOPK_K: usize = 2048;
/// A decode step's quantized projections timed: Qwen2.5-7B's gate (rows × columns) and down
/// projections; the CPU times a slice of the gate's rows.
const QUANT_SHAPES: [(usize, usize); 2] = [(18_944, 3584), (3584, 18_944)];
const QUANT_ROWS_CPU: usize = 512;
/// The random blocks' seed (any: the speed does not depend on the values).
const QUANT_SEED: u64 = 7;
/// The ggml types timed: what Q4_0, Q4_K_M, Q5_K_M, Q6_K and Q8_0 files hold.
const QUANT_TYPES: [candle_core::quantized::GgmlDType; 5] = {
    use candle_core::quantized::GgmlDType as G;
    [G::Q4_0, G::Q8_0, G::Q4K, G::Q5K, G::Q6K]
};
/// Bytes copied for the bandwidth figure.
const COPY_BYTES: usize = 1 << 30;
/// Tokens of the causal prefill attention timed (one layer's query chunk over its keys); the
/// CPU runs the f32 path, far slower.
const PREFILL_TOKENS: usize = 32_768;
const PREFILL_TOKENS_CPU: usize = 512;
/// Rows of the host tier written at once while filling it.
const HOST_FILL_ROWS: usize = 1 << 16;
/// The attention scale of the decode rows (any value: the cost does not depend on it).
const DECODE_SCALE: f32 = 0.088;

/// What `folio bench kernels` measured: the limits, then a row per kernel.
#[derive(Serialize)]
pub struct KernelReport {
    pub device: String,
    /// The device's copy bandwidth, bytes/s.
    pub copy_bandwidth: f64,
    /// The host link's page-locked copy rate, bytes/s.
    pub host_link: f64,
    pub f32_gemm_flops: f64,
    /// The tensor-core limit: a GEMM in `gemm_dtype` (bf16 on a GPU, f32 on the CPU).
    pub gemm_flops: f64,
    pub gemm_dtype: String,
    pub kernels: Vec<KernelRow>,
}

#[derive(Serialize)]
pub struct KernelRow {
    pub kernel: String,
    pub seconds: f64,
    pub bytes: f64,
    pub flops: f64,
    /// Achieved bytes/s or FLOP/s over the limit measured in the same run.
    pub of_limit: f64,
    pub limit: &'static str,
}

impl KernelRow {
    /// A row that only moves bytes: its share of the bandwidth `rate` (bytes/s) named `limit`.
    fn moving(kernel: String, seconds: f64, bytes: f64, rate: f64, limit: &'static str) -> Self {
        Self { kernel, seconds, bytes, flops: 0.0, of_limit: bytes / seconds / rate, limit }
    }
}

/// Every kernel over a synthetic K/V of `context` rows per KV head (Qwen2.5-7B's heads), the
/// row kernels at each of `select` rows attended.
pub fn run(device: &Device, context: usize, select: &[usize]) -> Result<KernelReport> {
    if context == 0 || context > u32::MAX as usize || select.contains(&0) {
        return Err(Error::Invalid("--context must be 1..=4294967295 rows and every --select at least 1".into()));
    }
    let dtype = if device.is_cpu() { DType::F32 } else { DType::BF16 };
    // The limits, measured here and now.
    let block = Tensor::zeros(COPY_BYTES / 2, DType::BF16, device)?;
    let copy = time_calls(device, || block.copy())?;
    let bandwidth = 2.0 * COPY_BYTES as f64 / copy;
    drop(block);
    let gemm = matmul_flops(device, DType::F32)?;
    // The tensor-core limit: a bf16 GEMM (the f32 path's limit on the CPU).
    let gemm16 = matmul_flops(device, dtype)?;
    let mut rows = prefill_rows(device, dtype, gemm16)?;
    rows.extend(mlp_rows(device, dtype, gemm16, bandwidth)?);
    rows.extend(quant_rows(device, dtype, bandwidth)?);
    rows.extend(decode_rows(device, dtype, context, select, bandwidth)?);
    let link = folio_runtime::device::host_to_device_rate(device, COPY_BYTES)?;
    rows.extend(gather_rows(device, dtype, context, select, link)?);
    rows.push(simhash_row(device, gemm)?);
    Ok(KernelReport {
        device: device_name(device),
        copy_bandwidth: bandwidth,
        host_link: link,
        f32_gemm_flops: gemm,
        gemm_flops: gemm16,
        gemm_dtype: format!("{dtype:?}"),
        kernels: rows,
    })
}

/// A decode step's kernels over the whole context: the selected-row attention at each
/// `select`, Double Sparsity's label scan, the top-k of a layer's scores; each against the
/// copy `bandwidth`.
fn decode_rows(
    device: &Device,
    dtype: DType,
    context: usize,
    select: &[usize],
    bandwidth: f64,
) -> Result<Vec<KernelRow>> {
    use folio_kernels::sparse;
    let (heads, kv_heads, d) = KERNEL_SHAPE;
    let mut rows = Vec::new();
    let k = Tensor::randn(0f32, 1.0, (kv_heads, context, d), device)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1.0, (kv_heads, context, d), device)?.to_dtype(dtype)?;
    // Queries in the model's dtype (bf16 on a GPU: the tensor-core kernel), and on a GPU f32
    // queries too, which take the CUDA-core kernels.
    let q = Tensor::randn(0f32, 1.0, (heads, d), device)?.to_dtype(dtype)?;
    let q32 = q.to_dtype(DType::F32)?;
    let queries: &[(&Tensor, &str)] =
        if device.is_cpu() { &[(&q, "")] } else { &[(&q, "tensor cores"), (&q32, "f32 queries, CUDA cores")] };
    let elem = dtype.size_in_bytes() as f64;
    for &sel in select {
        // A decode step's attention over `sel` rows of each KV head, shared by its group (a
        // gathered pick, BUZZ's live rows): each row is read once per group.
        let sel = sel.min(context);
        for &(q, path) in queries {
            let secs = time_calls(device, || sparse::decode_attention_rows(q, &k, &v, sel, None, DECODE_SCALE))?;
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
    let codes = Tensor::zeros((kv_heads, context, r), DType::U8, device)?;
    let scale = Tensor::ones((kv_heads, context, 2), DType::F32, device)?;
    let ql = Tensor::randn(0f32, 1.0, (heads, r), device)?;
    let secs = time_calls(device, || sparse::label_scores(&ql, &codes, &scale, LABEL_BITS))?;
    let bytes = (kv_heads * context * (r + 8) + heads * context * 4) as f64;
    rows.push(KernelRow {
        kernel: format!("label_scores {heads}x{} tokens, r {r}", context),
        seconds: secs,
        bytes,
        flops: 2.0 * (heads * context * r) as f64,
        of_limit: bytes / secs / bandwidth,
        limit: "copy bandwidth (labels once per KV head)",
    });
    drop((codes, scale));
    // Top-k over one layer's scores (a query head's row of the whole context), k = the
    // budget the decode benchmarks use: four reads of the scores.
    let scores = Tensor::randn(0f32, 1.0, (heads, context), device)?;
    let secs = time_calls(device, || folio_kernels::select::topk(&scores, TOPK_K))?;
    let bytes = 4.0 * (heads * context * 4) as f64;
    rows.push(KernelRow::moving(
        format!("topk {heads}x{} scores, k {TOPK_K}", context),
        secs,
        bytes,
        bandwidth,
        "copy bandwidth",
    ));
    Ok(rows)
}

/// The gather of picked rows from the host tier (K of one layer) into device memory, at each
/// `select`, against the host `link`'s rate.
fn gather_rows(device: &Device, dtype: DType, context: usize, select: &[usize], link: f64) -> Result<Vec<KernelRow>> {
    let (heads, kv_heads, d) = KERNEL_SHAPE;
    let elem = dtype.size_in_bytes() as f64;
    let mut rng = StdRng::seed_from_u64(0);
    let mut rows = Vec::new();
    let mut host = folio_kernels::select::HostRows::new(device, dtype, kv_heads, context, d)?;
    for start in (0..context).step_by(HOST_FILL_ROWS) {
        let t = HOST_FILL_ROWS.min(context - start);
        host.write(start, &Tensor::randn(0f32, 1.0, (kv_heads, t, d), device)?.to_dtype(dtype)?)?;
    }
    for &sel in select {
        let idx: Vec<u32> = (0..heads * sel).map(|_| rng.random_range(0..context as u32)).collect();
        let idx = Tensor::from_vec(idx, (heads, sel), device)?;
        let secs = time_calls(device, || host.gather(&idx, heads / kv_heads, None, folio_kernels::Positions::Trusted))?;
        let bytes = (heads * sel * d) as f64 * elem;
        let kernel = format!("gather {heads}x{sel} rows from host memory (d {d}, {dtype:?})");
        rows.push(KernelRow::moving(kernel, secs, bytes, link, "host link (page-locked copy)"));
    }
    Ok(rows)
}

/// MagicPIG's SimHash codes of a batch of rows, against the f32 `gemm` rate.
fn simhash_row(device: &Device, gemm: f64) -> Result<KernelRow> {
    let d = KERNEL_SHAPE.2;
    let (bits, tables) = HASH_BITS_TABLES;
    let hash_rows = if device.is_cpu() { HASH_ROWS / 64 } else { HASH_ROWS };
    let x = Tensor::randn(0f32, 1.0, (hash_rows, d), device)?;
    let w = Tensor::randn(0f32, 1.0, (d, bits * tables), device)?;
    let secs = time_calls(device, || folio_kernels::sparse::simhash_codes(&x, &w, bits, tables))?;
    let flops = 2.0 * (hash_rows * d * bits * tables) as f64;
    Ok(KernelRow {
        kernel: format!("simhash_codes {hash_rows} rows, d {d}, (K,L) = ({bits},{tables})"),
        seconds: secs,
        bytes: ((hash_rows * d + d * bits * tables + hash_rows * tables) * 4) as f64,
        flops,
        of_limit: flops / secs / gemm,
        limit: "f32 GEMM rate",
    })
}

/// The causal attention of a prefill (Qwen2.5-7B's heads, every query over its keys so far),
/// timed through the default path and, on a GPU, through each tensor-core kernel it has
/// (`flash_kernels`): one row each, held to the GEMM rate `gemm` of the same dtype (both are
/// tensor-core bound at this size).
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

/// A decode step's projection with quantized weights: Folio's kernel (CUDA), candle's `QMatMul`
/// with f32 activations (the CPU's path; on CUDA its dequantize-multiply kernel, what ran
/// before), and the plain matrix in the run's dtype, each against the copy bandwidth over the
/// bytes it must read (the weights'; the activations are a rounding error). Random blocks: the
/// speed does not depend on the values.
fn quant_rows(device: &Device, dtype: DType, bandwidth: f64) -> Result<Vec<KernelRow>> {
    use candle_core::quantized::{QMatMul, QStorage, QTensor};
    use candle_core::Module;
    let mut rng = StdRng::seed_from_u64(QUANT_SEED);
    let mut out = Vec::new();
    // candle's kernel as Folio runs it on CUDA for the formats with no kernel of its own (its
    // default q8_1 kernels give NaN: docs/gguf.md).
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        candle_core::quantized::cuda::set_force_dmmv(true);
    }
    for (rows, cols) in QUANT_SHAPES {
        let rows = if device.is_cpu() { rows.min(QUANT_ROWS_CPU) } else { rows };
        let x = Tensor::randn(0f32, 1.0, (1, cols), device)?.to_dtype(dtype)?;
        let plain = Tensor::randn(0f32, 1.0, (rows, cols), device)?.to_dtype(dtype)?;
        let secs = time_calls(device, || x.matmul(&plain.t()?))?;
        let bytes = (rows * cols * dtype.size_in_bytes()) as f64;
        out.push(KernelRow::moving(
            format!("matvec {rows}x{cols}, plain {dtype:?}, candle's matmul"),
            secs,
            bytes,
            bandwidth,
            "copy bandwidth",
        ));
        if device.is_cuda() && dtype == DType::BF16 {
            // The decode step's own kernel (a warp a row, small blocks), beside cuBLAS's above.
            let secs = time_calls(device, || folio_kernels::gemv::product(&x, &plain))?;
            let kernel = format!("matvec {rows}x{cols}, plain {dtype:?}, kernels/cuda/gemv.cu");
            out.push(KernelRow::moving(kernel, secs, bytes, bandwidth, "copy bandwidth"));
        }
        drop(plain);
        for ggml in QUANT_TYPES {
            let format = folio_models::gguf::kernel_format(ggml).expect("every timed type has a kernel");
            let name = format.name();
            let blocks: Vec<u8> =
                (0..rows * cols / format.block_weights() * format.block_bytes()).map(|_| rng.random::<u8>()).collect();
            let bytes = blocks.len() as f64;
            if device.is_cuda() {
                let q = folio_kernels::quant::QuantMatrix::new(&blocks, format, (rows, cols), device)?;
                let xb = x.to_dtype(DType::BF16)?;
                let secs = time_calls(device, || q.matvec(&xb))?;
                let kernel =
                    format!("quantized matvec {name} {rows}x{cols}, kernels/cuda/quant.cu (8-bit activations)");
                out.push(KernelRow::moving(kernel, secs, bytes, bandwidth, "copy bandwidth"));
            }
            let storage = QStorage::from_data(std::borrow::Cow::Owned(blocks), device, ggml)?;
            let q = QMatMul::QTensor(std::sync::Arc::new(QTensor::new(storage, (rows, cols))?));
            let xf = x.to_dtype(DType::F32)?;
            let secs = time_calls(device, || q.forward(&xf))?;
            let kernel = format!("quantized matvec {name} {rows}x{cols}, candle QMatMul (f32 activations)");
            out.push(KernelRow::moving(kernel, secs, bytes, bandwidth, "copy bandwidth"));
        }
    }
    Ok(out)
}
