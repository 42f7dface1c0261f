//! `folio bench`: commands that measure and print figures, each with its ratio to a limit
//! (never timed tests). The measuring is folio-eval's (`folio_eval::bench`: decode, prefill,
//! kernels); this module holds the arguments and the tables. `bench ingest` stays here: it
//! times the product's own staging path (crate::ingest over folio-ingest and the tokenizer).

mod decode;
mod ingest;
mod kernels;
mod link;
mod prefill;

use anyhow::Result;
use clap::{Args, Subcommand};

use crate::cli::Common;
use decode::{bench_shape, ShapeBenchArgs};

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
    /// The host link as decode reads it (gathers of random rows), as it is and at each
    /// emulated rate (`--link-gbps`), with the rate achieved ÷ the rate asked for (a GPU).
    Link(link::LinkBenchArgs),
}

pub fn bench(common: &Common, args: BenchArgs) -> Result<()> {
    match args.command {
        Some(BenchCommand::Prefill(a)) => prefill::bench_prefill(common, a),
        Some(BenchCommand::Kernels(a)) => kernels::bench_kernels(common, a),
        Some(BenchCommand::Ingest(a)) => ingest::bench_ingest(common, a),
        Some(BenchCommand::Link(a)) => link::bench_link(common, a),
        None => bench_shape(common, args.shape),
    }
}
