//! `folio bench`: commands that measure and print figures, each with its ratio to a limit
//! (never timed tests).
//!
//! `bench prefill` prefills synthetic prompts (random token ids) of each requested length into
//! a context file with the real builder, then reopens the file as a user would and produces the
//! first token after a short question. It prints prefill tokens/s, the FLOP rate against a
//! large matmul's on the same device (the compute limit in practice), peak RSS, file bytes, and
//! reopen-to-first-token time with its ratio to the prefill time.

mod ingest;
mod kernels;
mod prefill;
mod shape;

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Tensor};
use clap::{Args, Subcommand};

use crate::cli::Common;
use shape::{bench_shape, ShapeBenchArgs};

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
    Prefill(prefill::PrefillBenchArgs),
    /// The sparse-decode kernels (selected-row attention, label and block scores, top-k, the
    /// host gather, SimHash codes) against the device's copy bandwidth, host link and f32 GEMM
    /// rate measured in the same run.
    Kernels(kernels::KernelBenchArgs),
    /// Staging speed: documents read and tokens counted per second, per format.
    Ingest(ingest::IngestBenchArgs),
}

pub fn bench(common: &Common, args: BenchArgs) -> Result<()> {
    match args.command {
        Some(BenchCommand::Prefill(a)) => prefill::bench_prefill(common, a),
        Some(BenchCommand::Kernels(a)) => kernels::bench_kernels(common, a),
        Some(BenchCommand::Ingest(a)) => ingest::bench_ingest(common, a),
        None => bench_shape(common, args.shape),
    }
}

/// FLOP/s of a large square matmul in `dtype` on `dev`: what the hardware delivers in practice
/// for the dominant operation.
fn matmul_flops(dev: &candle_core::Device, dtype: DType) -> Result<f64> {
    let side = if dev.is_cpu() { MATMUL_SIDE } else { GEMM_SIDE };
    let a = Tensor::randn(0f32, 1.0, (side, side), dev)?.to_dtype(dtype)?;
    Ok(2.0 * (side as f64).powi(3) / time_calls(dev, || a.matmul(&a))?)
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

/// Tokens of the question asked after reopening.
const QUESTION_TOKENS: usize = 16;
/// Side of the square matmul whose FLOP rate stands for the CPU's compute limit (a GPU's is
/// [`GEMM_SIDE`]).
const MATMUL_SIDE: usize = 1024;
