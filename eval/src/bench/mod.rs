//! Speed and memory of the engine, each figure beside the limit that binds it, measured in
//! the same run (never timed tests): what `folio bench` runs and prints.
//!
//! * [`decode`]: decode over a long offloaded context with a model of a real shape (random
//!   weights, random rows: speed and memory depend on shapes, not values), every method asked
//!   for in turn, each step against its floor (device, link and host bytes over the bandwidths
//!   measured now);
//! * [`prefill`]: synthetic prompts prefilled into context files with the real builder, then
//!   reopened as a person would, to the first token after a short question;
//! * [`kernels`]: the sparse-decode and prefill kernels against the copy bandwidth, host link
//!   and GEMM rates measured in the same run;
//! * [`link`]: the host link as decode reads it, as it is and at each emulated rate
//!   (`--link-gbps`), against the rate asked for.
//!
//! Why here and not in the CLI: these are measurements of the engine, made through its public
//! API like every other yardstick of this crate; the CLI keeps its arguments and its tables.
//! The reports are values (serialised as the JSON lines docs/results/ keeps), and a run that
//! reports as it goes (a row per length, a report per method) hands each to a callback.

pub mod decode;
pub mod kernels;
pub mod link;
pub mod prefill;

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use folio_models::error::Result;

/// Calls timed per figure after one warm-up (on the CPU the reference paths are slow: fewer).
const REPS: usize = 50;
const CPU_REPS: usize = 2;
/// Side of the square GEMMs that measure the arithmetic limits (large enough to saturate a
/// GPU), and of the CPU's (whose rate a smaller one already shows).
const GEMM_SIDE: usize = 4096;
const CPU_GEMM_SIDE: usize = 1024;

/// Seconds per call of `f`, averaged over [`REPS`] calls after a warm-up, synchronised.
pub(crate) fn time_calls<T>(device: &Device, mut f: impl FnMut() -> candle_core::Result<T>) -> Result<f64> {
    let reps = if device.is_cpu() { CPU_REPS } else { REPS };
    f()?;
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / reps as f64)
}

/// FLOP/s of a large square matmul in `dtype` on `device`: what the hardware delivers in
/// practice for the dominant operation.
pub fn matmul_flops(device: &Device, dtype: DType) -> Result<f64> {
    let side = if device.is_cpu() { CPU_GEMM_SIDE } else { GEMM_SIDE };
    let a = Tensor::randn(0f32, 1.0, (side, side), device)?.to_dtype(dtype)?;
    Ok(2.0 * (side as f64).powi(3) / time_calls(device, || a.matmul(&a))?)
}
