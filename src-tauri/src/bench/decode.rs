//! `folio bench --shape`: the arguments and the report of `folio_eval::bench::decode` (decode
//! over a long offloaded context with a model of a real shape; its module docs say what each
//! figure is and what it is held to).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use folio_eval::bench::decode::{self, DecodeBench, DecodeReport, FileSteps, PCIE4_X16};
use folio_models::attention::MethodChoice;
use folio_models::context::KvDtype;
use folio_models::error::human_bytes;
use folio_models::model::Quantize;

use crate::cli::Common;
use crate::context_cmd::parse_bytes;

#[derive(Args)]
pub struct ShapeBenchArgs {
    /// A model shape: a real model's config.json facts (assets/shapes/*.json); weights are random.
    #[arg(long)]
    pub(crate) shape: Option<PathBuf>,
    /// Tokens of context in the offloaded K/V before decoding.
    #[arg(long, default_value_t = 32_768)]
    context: usize,
    /// Methods, comma-separated, each as --method writes it (hip, hip:2048:refresh=16; without
    /// a budget, the method's default): each decodes over the same model and context in turn.
    #[arg(long = "method", value_delimiter = ',', value_parser = crate::cli::parse_method, default_values_t = [MethodChoice::default()])]
    methods: Vec<MethodChoice>,
    /// Device memory this run may use, e.g. 24GiB (a consumer card); default: the whole device.
    #[arg(long)]
    vram_budget: Option<String>,
    /// The weights, comma-separated, each decoding every method in turn over the same K/V:
    /// the compute dtype (bf16 on a GPU; `bf16` or `plain`), or random weights quantized as a
    /// GGUF file holds them (q8_0, q4k: the projections in ggml blocks).
    #[arg(long, value_delimiter = ',', default_values_t = [String::from("plain")])]
    weights: Vec<String>,
    /// Decode steps timed (their mean leads the report), after the warm-up steps.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// Store the context's K/V as a context file of this dtype stores it (bf16, bf16-fp8, fp8),
    /// read in place and widened by the gathers, as a reopened file is; without it the rows are
    /// page-locked in the compute dtype.
    #[arg(long, value_parser = |s: &str| KvDtype::parse(s).map_err(|e| e.to_string()))]
    kv_dtype: Option<KvDtype>,
    /// Leave the rows in a file in this folder (an NVMe disk's, as a laptop's context would
    /// be) stored as --kv-dtype (bf16 without it), and read them on the file tier through a
    /// cache of what the host budget leaves (--host-budget): a context larger than host memory.
    /// The file is removed when the run ends.
    #[arg(long, value_name = "DIR")]
    kv_on_disk: Option<PathBuf>,
    /// After the timed steps, decode a few more three times: timing the host's share of
    /// a step, then op by op on the host's clock, then with the device synchronised around each
    /// op (`folio_models::profile`).
    #[arg(long)]
    profile: bool,
    #[arg(long)]
    json: bool,
}

pub fn bench_shape(common: &Common, a: ShapeBenchArgs) -> Result<()> {
    let shape =
        a.shape.context("--shape is required: a model shape such as assets/shapes/qwen2.5-7b-instruct-1m.json")?;
    let bench = DecodeBench {
        shape,
        context: a.context,
        methods: a.methods,
        vram_budget: a.vram_budget.as_deref().map(parse_bytes).transpose()?,
        weights: a.weights.iter().map(|w| parse_weights(w)).collect::<Result<_>>()?,
        steps: a.steps,
        warmup: a.warmup,
        kv_dtype: a.kv_dtype,
        kv_on_disk: a.kv_on_disk,
        profile: a.profile,
    };
    let device = folio_models::parse_device(&common.device)?;
    decode::run(&device, &bench, |r| print_report(r, a.json, a.steps))
}

/// `plain`/`bf16`: the compute dtype; otherwise a quantisation.
pub(crate) fn parse_weights(s: &str) -> Result<Option<Quantize>> {
    match s {
        "plain" | "bf16" => Ok(None),
        other => Ok(Some(Quantize::parse(other)?)),
    }
}

fn print_report(r: &DecodeReport, json: bool, steps: usize) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
        return Ok(());
    }
    let opt = |b: Option<u64>| b.map_or("n/a".into(), human_bytes);
    println!(
        "{} on {}: {} parameters, {} weights ({} a step), context {} tokens, {} ({})",
        r.shape,
        r.device,
        r.parameters,
        r.weights,
        human_bytes(r.weight_bytes_per_step as u64),
        r.context,
        r.method,
        r.settings
    );
    println!(
        "  copy bandwidth {:.0} GB/s, host link {:.1} GB/s, host read {:.1} GB/s (measured now); K/V fill {:.1} s; first step {:.2} s",
        r.copy_bandwidth / 1e9,
        r.link_bandwidth / 1e9,
        r.host_read_bandwidth / 1e9,
        r.fill_s,
        r.first_step_s
    );
    println!(
        "  decode {:.2} ms/token mean (median {:.2}, p10 {:.2}, p90 {:.2} = {:.2}x the mean, {steps} steps): {:.1}x the floor",
        r.decode_ms_mean,
        r.decode_ms_median,
        r.decode_ms_p10,
        r.decode_ms_p90,
        r.p90_over_mean,
        r.measured_over_floor
    );
    println!(
        "  floor {:.2} ms, bound by the {}: device {:.2} (weights {:.2} + index {:.2}), link {:.2}, host {:.2}",
        r.floor_ms,
        r.floor_binds,
        r.floor_device_ms,
        r.floor_weights_ms,
        r.floor_index_ms,
        r.floor_link_ms,
        r.floor_host_ms
    );
    println!(
        "  on a PCIe 4.0 x16 link ({:.0} GB/s): link {:.2} ms, floor {:.2} ms, mean about {:.2} ms",
        PCIE4_X16 / 1e9,
        r.pcie4_link_ms,
        r.pcie4_floor_ms,
        r.pcie4_mean_ms
    );
    println!(
        "  peak device memory {} (budget {}, planned {}); host K/V {}; peak RSS {} ({} in huge pages); {} CPU-pool threads",
        opt(r.peak_device_bytes),
        opt(r.vram_budget),
        human_bytes(r.planned_device_bytes),
        human_bytes(r.host_kv_bytes),
        opt(r.peak_rss_bytes),
        opt(r.huge_page_bytes),
        r.host_threads
    );
    if let Some(f) = &r.file {
        print_file_tier(f);
    }
    if let Some(p) = &r.profile {
        println!(
            "  profile over {} steps: the host queued a step in {:.2} ms of its {:.2} ms; each op's host time to queue it, and its device time synchronised ({:.2} ms a step):",
            p.steps, p.host_ms, p.step_ms, p.synced_step_ms
        );
        println!("    {:<30} {:>9} {:>9} {:>7}", "op", "host ms", "device ms", "calls");
        // Parts of a span (`attention: gather`) after the spans, indented: their time is in
        // their span's too.
        let (parts, spans): (Vec<_>, Vec<_>) = p.spans.iter().partition(|s| folio_models::profile::is_part(s.name));
        for s in &spans {
            println!("    {:<30} {:>9.3} {:>9.3} {:>7.1}", s.name, s.host_ms, s.device_ms, s.calls);
        }
        for s in &parts {
            println!("      {:<28} {:>9.3} {:>9.3} {:>7.1}", s.name, s.host_ms, s.device_ms, s.calls);
        }
        let inside: f64 = spans.iter().map(|s| s.device_ms).sum();
        println!("    {:<30} {:>9} {:>9.3}", "outside the spans", "", p.synced_step_ms - inside);
    }
    if let Some(f) = &r.first_step_profile {
        println!("  a fresh conversation's first step, device synchronised around each op: {:.3} s", f.seconds);
        let (parts, spans): (Vec<_>, Vec<_>) = f.spans.iter().partition(|s| folio_models::profile::is_part(s.name));
        for s in &spans {
            println!("    {:<30} {:>9.1} ms {:>7}", s.name, s.ms, s.calls);
        }
        for s in &parts {
            println!("      {:<28} {:>9.1} ms {:>7}", s.name, s.ms, s.calls);
        }
    }
    Ok(())
}

/// The file tier's line of the report.
fn print_file_tier(f: &FileSteps) {
    println!(
        "  file tier: keys in memory {}, cache {} ({} blocks, {} of scales){}, disk {:.2} GB/s sequential (measured now{}); a step read {} in {:.1} reads ({:.2} ms reading in its gathers and {:.2} ms ahead of them, {:.0} blocks placed ahead, a read-ahead {:.2} ms to its positions and {:.2} ms to done; {:.2} GB/s; {:.2} ms at the sequential rate), {:.0} blocks, {}% from the cache, {}% picked by the previous picks",
        human_bytes(f.keys_in_memory),
        human_bytes(f.cache_bytes),
        f.slots,
        human_bytes(f.scales_in_memory),
        match (f.direct, f.emulated_disk) {
            (_, Some(_)) => "",
            (true, None) => "",
            (false, None) => " (the page cache was not bypassed)",
        },
        f.disk_bandwidth / 1e9,
        f.emulated_disk.map_or(String::new(), |(rate, iops)| format!(
            ", emulating {:.2} GB/s and {:.0}k reads/s, {} reads slower than it",
            rate / 1e9,
            iops / 1e3,
            f.late_reads
        )),
        human_bytes(f.disk_bytes_per_step as u64),
        f.disk_reads_per_step,
        f.disk_read_ms_per_step,
        f.ahead_read_ms_per_step,
        f.ahead_blocks_per_step,
        f.ahead_start_ms,
        f.ahead_wall_ms,
        f.disk_rate / 1e9,
        f.disk_floor_ms,
        f.blocks_per_step,
        f.hit_rate.map_or("-".into(), |r| format!("{:.1}", 100.0 * r)),
        f.step_overlap.map_or("-".into(), |r| format!("{:.1}", 100.0 * r))
    );
    if f.state_reads_per_step > 0.0 {
        println!(
            "  and the method's state on disk beside it (magicpig's bucket lists): {} a step in {:.0} reads",
            human_bytes(f.state_bytes_per_step as u64),
            f.state_reads_per_step
        );
    }
}
