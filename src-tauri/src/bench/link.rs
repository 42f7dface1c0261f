//! `folio bench link`: the arguments and the table of `folio_eval::bench::link`.

use anyhow::Result;
use clap::Args;
use folio_eval::bench::link::{self, LinkReport};

use crate::cli::Common;

/// Bytes/s in a GB/s.
const GB: f64 = 1e9;

#[derive(Args)]
pub struct LinkBenchArgs {
    /// Rows per KV head of the host tier the rows are gathered from.
    #[arg(long, default_value_t = 1 << 20)]
    context: usize,
    /// Rows gathered per query head at a time, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,2048,16384")]
    picks: Vec<usize>,
    /// Emulated link rates in GB/s, comma-separated; 0: the link as it is.
    #[arg(long, value_delimiter = ',', default_value = "0,25,16,8")]
    rates: Vec<f64>,
    #[arg(long)]
    json: bool,
}

pub(super) fn bench_link(common: &Common, a: LinkBenchArgs) -> Result<()> {
    let device = folio_models::parse_device(&common.device)?;
    if a.rates.iter().any(|r| !r.is_finite() || *r < 0.0) || a.picks.contains(&0) || a.context == 0 {
        anyhow::bail!("--rates must be GB/s ≥ 0 (0: the link as it is), --picks and --context at least 1");
    }
    let rates: Vec<Option<f64>> = a.rates.iter().map(|&r| (r > 0.0).then_some(r * GB)).collect();
    let report = link::run(&device, a.context, &a.picks, &rates)?;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(r: &LinkReport) {
    println!(
        "{}: page-locked copy {:.1} GB/s; gathers of random rows from a host tier of {} rows per KV head",
        r.device,
        r.copy_rate / GB,
        r.context
    );
    println!("{:>10} {:>8} {:>10} {:>10} {:>10} {:>8}", "asked GB/s", "picks", "MB", "µs", "GB/s", "÷ asked");
    for row in &r.rows {
        let asked = row.asked.map_or("as is".to_owned(), |a| format!("{:.1}", a / GB));
        let of = row.of_asked.map_or("—".to_owned(), |x| format!("{x:.3}"));
        println!(
            "{asked:>10} {:>8} {:>10.2} {:>10.1} {:>10.2} {of:>8}",
            row.picks,
            row.bytes / 1e6,
            row.seconds * 1e6,
            row.rate / GB
        );
    }
}
