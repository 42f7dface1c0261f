//! `folio bench prefill`: the arguments and the table of `folio_eval::bench::prefill`
//! (synthetic prompts prefilled into context files with the real builder, then reopened as a
//! person would, to the first token after a short question).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use folio_eval::bench::prefill::{self, PrefillBench, PrefillEvent, Profile, Reopen, Row, Subject};
use folio_models::context::KvDtype;
use folio_models::error::human_bytes;

use crate::cli::Common;
use crate::context_cmd::parse_bytes;

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
    /// With --shape: the weights, `plain` (the compute dtype) or `q8_0`, `q4k` (the projections
    /// quantized as a GGUF holds them).
    #[arg(long, default_value = "plain")]
    weights: String,
    /// How the prefills attend: dense or sparse[:KNOBS] (as `folio prefill --prefill`).
    #[arg(long, default_value = "dense")]
    prefill: String,
    #[arg(long)]
    json: bool,
}

pub(super) fn bench_prefill(common: &Common, a: PrefillBenchArgs) -> Result<()> {
    let bench = PrefillBench {
        tokens: a.tokens,
        kv_dtype: KvDtype::parse(&a.kv_dtype)?,
        memory_budget: a.memory_budget.as_deref().map(parse_bytes).transpose()?,
        vram_budget: a.vram_budget.as_deref().map(parse_bytes).transpose()?,
        dir: a.dir,
        resume: a.resume,
        append: a.append,
        profile: a.profile,
        offload: a.offload,
        prefill: folio_models::prefill::PrefillMode::parse(&a.prefill)?,
    };
    let subject = match &a.shape {
        None => Subject::loaded(common.engine()?)?,
        Some(_) if common.model.is_some() => anyhow::bail!("--shape and --model are two different models: give one"),
        Some(shape) => {
            let device = folio_models::parse_device(&common.device)?;
            let dtype = folio_models::parse_dtype(&common.dtype, &device)?;
            let longest = bench.tokens.iter().map(|&n| bench.positions_used(n)).max().unwrap_or(0);
            Subject::random(shape, &device, dtype, longest, super::decode::parse_weights(&a.weights)?)?
        }
    };
    // Ctrl-C stops a long prefill between chunks with its last finished layer kept, so that
    // `--dir D --resume` picks it up again.
    let stop = crate::context_cmd::ctrl_c_flag();
    let (json, mut matmul, mut first) = (a.json, 0.0, true);
    let report = prefill::run(&subject, &bench, &stop, |event| -> Result<()> {
        match event {
            PrefillEvent::WarmedUp { tokens, seconds, matmul_flops_per_s } => {
                matmul = matmul_flops_per_s;
                if !json {
                    println!(
                        "warm-up: a {tokens}-token prefill in {seconds:.2} s (kernel compilation, first allocations)"
                    );
                }
            }
            // On stderr at once: at a million tokens the reopen after it takes a minute more,
            // and a run cut short there still says what the prefill did.
            PrefillEvent::Prefilled { report: r, peak_vram, peak_rss } => eprintln!(
                "prefilled {} tokens in {:.2} s ({:.0} tokens/s; {} of {} layers computed here), peak VRAM {}, peak \
                 RSS {}; reopening",
                r.tokens,
                r.seconds,
                r.tokens_per_s,
                r.layers - r.resumed_layers,
                r.layers,
                peak_vram.map_or("n/a".into(), human_bytes),
                peak_rss.map_or("n/a".into(), human_bytes)
            ),
            PrefillEvent::Row(row) if !json => {
                print_row(row, first, &subject, matmul);
                first = false;
            }
            PrefillEvent::Row(_) => {}
        }
        Ok(())
    })?;
    if let (Some(p), false) = (&report.profile, json) {
        print_profile(p);
    }
    if json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(report.check_budget()?)
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
    // Parts of a span (`attention: sparse estimate`) after the spans, indented: their time is
    // in their span's too.
    let (parts, spans): (Vec<_>, Vec<_>) = p.spans.iter().partition(|s| folio_models::profile::is_part(s.name));
    let spans = spans.into_iter().map(|s| (s.name, s.seconds, Some(s.calls)));
    for (name, secs, calls) in spans.chain(outside.into_iter().map(|(n, s)| (n, s, None))) {
        let calls = calls.map_or(String::new(), |c| c.to_string());
        println!("  {:<28} {:>9.3} {:>6.1}% {:>7}", name, secs, 100.0 * secs / p.seconds, calls);
    }
    for s in parts {
        println!("    {:<26} {:>9.3} {:>6.1}% {:>7}", s.name, s.seconds, 100.0 * s.seconds / p.seconds, s.calls);
    }
}

fn print_row(r: &Row, first: bool, subject: &Subject, matmul: f64) {
    if first {
        println!(
            "model {} on {} ({:?}, {} threads); large-matmul rate {:.1} GFLOP/s",
            subject.name(),
            folio_models::device_name(subject.model().device()),
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
    if let Some(g) = &r.append {
        println!(
            "{:>8} grown by {} tokens in {:.2} s; all {} in one go {:.2} s: {:.1}% of it (the new tokens' share of \
             the work {:.1}%)",
            "",
            g.new_tokens,
            g.append_seconds,
            r.tokens + g.new_tokens,
            g.full_seconds,
            100.0 * g.ratio,
            100.0 * g.work_share
        );
    }
}
