//! `folio bench kernels`: the arguments and the table of `folio_eval::bench::kernels`.

use anyhow::Result;
use clap::Args;
use folio_eval::bench::kernels::{self, KernelReport};

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

pub(super) fn bench_kernels(common: &Common, a: KernelBenchArgs) -> Result<()> {
    let device = folio_models::parse_device(&common.device)?;
    let report = kernels::run(&device, a.context, &a.select)?;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// The kernels' rows as a table with the limits above it.
fn print_table(r: &KernelReport) {
    println!(
        "device {}: copy bandwidth {:.0} GB/s, host link {:.1} GB/s, f32 GEMM {:.2} TFLOP/s, {} GEMM {:.2} \
         TFLOP/s (measured now)",
        r.device,
        r.copy_bandwidth / 1e9,
        r.host_link / 1e9,
        r.f32_gemm_flops / 1e12,
        r.gemm_dtype,
        r.gemm_flops / 1e12
    );
    println!("{:<62} {:>10} {:>10} {:>10} {:>9}", "kernel", "µs/call", "GB/s", "GFLOP/s", "÷ limit");
    for k in &r.kernels {
        println!(
            "{:<62} {:>10.1} {:>10.1} {:>10.1} {:>8.1}%",
            k.kernel,
            k.seconds * 1e6,
            k.bytes / k.seconds / 1e9,
            k.flops / k.seconds / 1e9,
            100.0 * k.of_limit
        );
    }
}
