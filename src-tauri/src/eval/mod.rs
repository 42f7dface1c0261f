//! `folio eval`: answer-quality measurements with a table on stdout, one JSON document with
//! `--json`, and (with `--out DIR`) the JSON plus a heatmap image for docs and reports.

mod answers;
mod attention;
mod fidelity;
mod sources;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

use folio_eval::needle::{self, NeedleSample, PromptTier};
use folio_eval::spec::EvalSpec;
use serde_json::json;

use crate::cli::{Common, MethodArgs};
use folio_models::attention::{Attention, MethodChoice};
use folio_models::error::human_bytes;

#[derive(Args)]
pub struct EvalArgs {
    #[command(subcommand)]
    kind: EvalKind,
}

#[derive(Subcommand)]
enum EvalKind {
    /// Needle-in-a-haystack accuracy of a retrieval-trained model (one with eval_spec.json,
    /// such as the bundled demo model) per context length and fact depth.
    Needle(NeedleArgs),
    /// Every attention method at every budget against dense attention: relative error per
    /// layer, recall of the true top keys, KV rows read, KL of the next-token distribution;
    /// on synthetic workloads and on a saved context.
    Attention(attention::AttentionArgs),
    /// Each method's answers against dense attention's on tasks whose answers read the
    /// documents while they are generated (chain, pair; needle as the baseline): accuracy, KL
    /// and top-1 agreement on dense's answer, rows read, time per token; a budget curve per
    /// method. `--question sparse` attends the question with the method too.
    Fidelity(fidelity::FidelityArgs),
    /// What a sparse prefill cost in answers, from `fidelity --prefill sparse` reports: right
    /// answers over it and over a dense prefill, KL and top-1 per context length; `--record`
    /// keeps them beside the model, where the window's staging sheet shows them.
    PrefillCost(answers::PrefillCostArgs),
    /// Whether each answer's first source passage holds the fact it was copied from: the
    /// sample questions' facts planted once each in one long document, asked per method with
    /// sources weighed as the window weighs them (exit status 1 when one does not).
    Sources(sources::SourcesArgs),
}

#[derive(Args)]
pub struct NeedleArgs {
    /// Context lengths in tokens: 4k = 4096, 1M = 1048576 (default: the model's eval_spec.json).
    #[arg(long, value_delimiter = ',', value_parser = parse_length)]
    lengths: Option<Vec<usize>>,
    /// Depths of the planted fact, 0 (start) to 1 (end) (default: eval_spec.json's).
    #[arg(long, value_delimiter = ',')]
    depths: Option<Vec<f64>>,
    /// Prompts per (length, depth) cell (default: eval_spec.json's).
    #[arg(long)]
    samples: Option<usize>,
    #[command(flatten)]
    attention: MethodArgs,
    /// Several methods on the same prompts instead of --method, comma-separated, each as
    /// --method writes it (dense,topk:1%,hip:2048:refresh=4); a table per method and, with
    /// --out, a folder per method (OUT/topk-1pct). With --offload each prompt's documents are
    /// prefilled once for all of them.
    #[arg(long, value_delimiter = ',', value_parser = crate::cli::parse_method, conflicts_with = "method")]
    methods: Vec<MethodChoice>,
    /// Decode over the offloaded tier, as `folio chat --context --offload` does: each prompt's
    /// documents are prefilled into host memory and the method's fast path picks rows from
    /// there (`folio methods` says which tier runs what). Without it every row stays in device
    /// memory (the resident tier).
    #[arg(long)]
    offload: bool,
    /// Prefill each prompt's documents into a context file in this folder (removed after the
    /// prompt) and open it as the app opens one: on the file tier when --host-budget cannot
    /// hold its rows (each sample then reports the bytes it read from the file). Implies
    /// --offload.
    #[arg(long, value_name = "DIR")]
    kv_on_disk: Option<PathBuf>,
    /// With --kv-on-disk: keep the rows in the file and read them through a cache of this size
    /// (e.g. 64MiB: most rows then come from the file), whatever the host budget.
    #[arg(long, value_name = "SIZE", requires = "kv_on_disk")]
    kv_cache: Option<String>,
    /// How each prompt's documents are prefilled, as `folio prefill --prefill` (dense, sparse,
    /// sparse:KNOBS); a sparse prefill needs --offload or --kv-on-disk. Run it beside a dense
    /// run of the same seed: the prompts are the same, and the two reports give its cost.
    #[arg(long, default_value = "dense")]
    prefill: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write needle.json and needle-heatmap.svg into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// "4k" → 4096, "1M" → 1048576, "2000" → 2000.
pub(crate) fn parse_length(s: &str) -> std::result::Result<usize, String> {
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().map(|n| n * mult).map_err(|_| format!("bad length \"{s}\": use e.g. 4096, 32k or 1M"))
}

pub fn eval(common: &Common, args: EvalArgs) -> Result<()> {
    match args.kind {
        EvalKind::Needle(a) => needle_eval(common, a),
        EvalKind::Attention(a) => attention::eval_attention(common, a),
        EvalKind::Fidelity(a) => fidelity::eval_fidelity(common, a),
        EvalKind::PrefillCost(a) => answers::eval_prefill_cost(common, a),
        EvalKind::Sources(a) => sources::eval_sources(common, a),
    }
}

/// One method's measurement in a needle run: its samples and where its report goes.
struct MethodRun {
    method: MethodChoice,
    /// The budget in effect (the method's default when the choice names none).
    budget: Option<String>,
    attn: Box<dyn Attention>,
    out: Option<PathBuf>,
    results: Vec<NeedleSample>,
}

/// A run's accuracy so far: per (length, depth) cell and per length (`None`: not measured
/// yet), and over every prompt.
struct Accuracy {
    grid: Vec<Vec<Option<f64>>>,
    by_length: Vec<Option<f64>>,
    overall: f64,
}

impl MethodRun {
    fn accuracy(&self, lengths: &[usize], depths: &[f64]) -> Accuracy {
        let accuracy = |len: usize, depth: Option<f64>| {
            let cell: Vec<&NeedleSample> =
                self.results.iter().filter(|s| s.length == len && depth.is_none_or(|d| s.depth == d)).collect();
            (!cell.is_empty()).then(|| cell.iter().filter(|s| s.correct).count() as f64 / cell.len() as f64)
        };
        let grid = lengths.iter().map(|&l| depths.iter().map(|&d| accuracy(l, Some(d))).collect()).collect();
        let by_length = lengths.iter().map(|&l| accuracy(l, None)).collect();
        let overall = self.results.iter().filter(|s| s.correct).count() as f64 / self.results.len().max(1) as f64;
        Accuracy { grid, by_length, overall }
    }

    fn title(&self) -> String {
        match &self.budget {
            Some(b) => format!("{} attention, budget {b}", self.method.method),
            None => format!("{} attention", self.method.method),
        }
    }
}

/// A cell's time per prompt for the progress line: the mean seconds, the documents' prefill's
/// share on the offloaded tiers, and the bytes read from the file tier.
fn cell_timing(samples: &[NeedleSample], tier: &PromptTier) -> String {
    let n = samples.len().max(1);
    let mean = |f: fn(&NeedleSample) -> f64| samples.iter().map(f).sum::<f64>() / n as f64;
    let (secs, prefill) = (mean(|s| s.prefill_seconds + s.seconds), mean(|s| s.prefill_seconds));
    let disk: u64 = samples.iter().filter_map(|s| s.disk_bytes).sum();
    let from_disk = match samples.iter().any(|s| s.disk_bytes.is_some()) {
        true => format!(", {} read from the file tier", human_bytes(disk / n as u64)),
        false => String::new(),
    };
    match tier {
        PromptTier::Resident => format!("{secs:.2} s/prompt"),
        _ => format!("{secs:.2} s/prompt, {prefill:.2} s of it the documents' prefill{from_disk}"),
    }
}

/// Where the prompts' documents are held: `--kv-on-disk`, `--offload`, or the device.
fn prompt_tier(a: &NeedleArgs) -> Result<PromptTier> {
    let cache = a.kv_cache.as_deref().map(crate::context_cmd::parse_bytes).transpose()?;
    Ok(match (&a.kv_on_disk, a.offload) {
        (Some(dir), _) => PromptTier::OnDisk(dir.clone(), cache),
        (None, true) => PromptTier::Offloaded,
        (None, false) => PromptTier::Resident,
    })
}

/// The runs `--method` or `--methods` asks for, each with its report folder.
fn method_runs(a: &NeedleArgs, engine: &folio_models::Engine) -> Result<Vec<MethodRun>> {
    let tier = prompt_tier(a)?.tier();
    let several = !a.methods.is_empty();
    let choices = if several { a.methods.clone() } else { vec![a.attention.method.clone()] };
    let resources = engine.resources(&choices)?;
    let mut folders: Vec<String> = Vec::new();
    choices
        .into_iter()
        .map(|choice| {
            choice.spec()?.check_tier(tier)?;
            let attn = choice.build(&resources)?;
            let folder = choice.slug();
            if folders.contains(&folder) {
                bail!("--methods names {choice} twice");
            }
            folders.push(folder.clone());
            let out = if several { a.out.as_ref().map(|o| o.join(&folder)) } else { a.out.clone() };
            let budget = choice.budget()?.map(|b| b.text());
            Ok(MethodRun { method: choice, budget, attn, out, results: Vec::new() })
        })
        .collect()
}

fn needle_eval(common: &Common, a: NeedleArgs) -> Result<()> {
    let engine = common.engine()?;
    let mut runs = method_runs(&a, &engine)?;
    let tier = prompt_tier(&a)?;
    let prefill = folio_models::prefill::PrefillMode::parse(&a.prefill)?;
    let model_dir = engine.model_dir().to_owned();
    let spec = EvalSpec::load(&model_dir)?;
    let defaults = spec.eval_defaults.clone();
    let lengths = a.lengths.or_else(|| defaults.as_ref().map(|d| d.lengths.clone())).context("give --lengths")?;
    let depths = a.depths.or_else(|| defaults.as_ref().map(|d| d.depths.clone())).context("give --depths")?;
    let samples = a.samples.or(defaults.as_ref().map(|d| d.samples)).unwrap_or(1);
    if let Some(d) = depths.iter().find(|d| !(0.0..=1.0).contains(*d)) {
        bail!("depth {d} is outside 0..=1");
    }
    // Refuse lengths the model cannot hold before spending minutes on the shorter ones.
    for &len in &lengths {
        engine.config().check_fits(len)?;
    }

    let report = |run: &MethodRun, complete: bool| {
        let Accuracy { grid, by_length, overall } = run.accuracy(&lengths, &depths);
        json!({
            "task": "needle",
            "model": engine.name,
            "method": run.method.method,
            "budget": run.budget,
            "attention": run.attn.settings(),
            "offload": a.offload || a.kv_on_disk.is_some(),
            "kv_on_disk": a.kv_on_disk.is_some(),
            "kv_cache": a.kv_cache,
            "prefill": prefill.name(),
            "host_budget": folio_runtime::host_budget::budget(),
            "prefilled_answer_prefix": spec.chat.prefill_answer_prefix,
            "seed": a.seed,
            "samples_per_cell": samples,
            "lengths": lengths,
            "depths": depths,
            "complete": complete,
            "accuracy": grid,
            "by_length": by_length,
            "overall": overall,
            "results": run.results,
        })
    };
    let save = |run: &MethodRun, complete: bool| -> Result<()> {
        let Some(dir) = &run.out else { return Ok(()) };
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write_file(&dir.join("needle.json"), serde_json::to_string_pretty(&report(run, complete))?)?;
        let title = format!("needle accuracy: {}, {}", engine.name, run.title());
        write_file(
            &dir.join("needle-heatmap.svg"),
            heatmap_svg(&title, &lengths, &depths, &run.accuracy(&lengths, &depths).grid),
        )
    };
    for misses in runs.iter().filter_map(|r| r.out.as_ref()).map(|dir| dir.join(MISSES_DIR)).filter(|m| m.is_dir()) {
        // Misses of an earlier run into the same folder would be checked again as this run's.
        std::fs::remove_dir_all(&misses).with_context(|| format!("clearing {}", misses.display()))?;
    }
    let several = runs.len() > 1;
    let title_width = runs.iter().map(|r| r.title().len() + 2).max().unwrap_or(0);
    for &length in &lengths {
        for &depth in &depths {
            let attns: Vec<&dyn Attention> = runs.iter().map(|r| r.attn.as_ref()).collect();
            // Kept for the misses' token ids (built once: 1M-token prompts take seconds).
            let prompts: Vec<needle::NeedlePrompt> = (0..samples)
                .map(|s| needle::cell_prompt(&engine, &spec, (length, depth, s), a.seed))
                .collect::<std::result::Result<_, _>>()?;
            // cell[s][m]: sample s of method m
            let cell: Vec<Vec<NeedleSample>> = prompts
                .iter()
                .enumerate()
                .map(|(s, prompt)| needle::run_sample(&engine, prompt, &attns, (&tier, prefill), (length, depth, s)))
                .collect::<std::result::Result<_, _>>()?;
            for (m, run) in runs.iter_mut().enumerate() {
                let mine: Vec<NeedleSample> = cell.iter().map(|per_method| per_method[m].clone()).collect();
                let correct = mine.iter().filter(|s| s.correct).count();
                let who =
                    if several { format!("{:<title_width$}", format!("{}:", run.title())) } else { String::new() };
                let timing = cell_timing(&mine, &tier);
                eprintln!("{who}{length:>8} tokens, depth {depth:.2}: {correct}/{samples} correct ({timing})");
                run.results.extend(mine.iter().cloned());
                // A long run (minutes per 1M-token prompt) keeps what it measured if it is cut short.
                save(run, false)?;
                for miss in mine.iter().filter(|s| !s.correct) {
                    eprintln!("    sample {}: expected {:?}, got {:?}", miss.sample, miss.expected, miss.output);
                    if let Some(dir) = &run.out {
                        // The measurement is saved; a prompt that cannot be kept is worth a warning only.
                        if let Err(e) = save_miss(&dir.join(MISSES_DIR), &prompts[miss.sample].ids, miss) {
                            eprintln!("    warning: the missed prompt was not saved: {e:#}");
                        }
                    }
                }
            }
        }
    }

    let mut docs = Vec::new();
    for run in &runs {
        save(run, true)?;
        let Accuracy { grid, by_length, overall } = run.accuracy(&lengths, &depths);
        if !a.json {
            if several {
                println!("{}:", run.title());
            }
            print!("{}", table(&lengths, &depths, &grid, &by_length));
            println!("overall {:.1}% over {} prompts", 100.0 * overall, run.results.len());
        }
        docs.push(report(run, true));
    }
    if a.json {
        // One document for one method, as before --methods; an array for several.
        let doc = if several { serde_json::Value::Array(docs) } else { docs.remove(0) };
        println!("{doc}");
    }
    Ok(())
}

/// Where `--out` keeps the prompts a run got wrong, for tools/demo_check_ids.py.
const MISSES_DIR: &str = "misses";

/// A missed prompt's token ids (little-endian u32) and what was expected and generated, so that
/// another engine (transformers) can be run on exactly these tokens.
fn save_miss(dir: &Path, prompt_ids: &[u32], miss: &NeedleSample) -> Result<()> {
    save_prompt(dir, &format!("{}-{}-{}", miss.length, miss.depth, miss.sample), prompt_ids, miss)
}

/// `DIR/NAME.json` (the report) and then `DIR/NAME.u32` (the prompt's token ids, little-endian):
/// a reader takes the .u32 files, each with its .json beside it.
pub(crate) fn save_prompt(dir: &Path, name: &str, ids: &[u32], report: &impl serde::Serialize) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    write_file(&dir.join(format!("{name}.json")), serde_json::to_string_pretty(report)?)?;
    write_file(&dir.join(format!("{name}.u32")), bytes)
}

/// Writes `contents` through a temporary file and a rename, so a reader (or a run killed mid-write)
/// never sees half a report.
pub(crate) fn write_file(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, contents).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// "97%", or "–" for a cell not measured (a run cut short).
fn percent(v: Option<f64>) -> String {
    v.map_or("–".to_owned(), |v| format!("{:.0}%", 100.0 * v))
}

pub(crate) fn human_length(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}k", n >> 10),
        n => n.to_string(),
    }
}

fn table(lengths: &[usize], depths: &[f64], grid: &[Vec<Option<f64>>], by_length: &[Option<f64>]) -> String {
    let mut s = format!("{:>8} |", "length");
    for d in depths {
        let _ = write!(s, " {:>6}", format!("d={d}"));
    }
    let _ = writeln!(s, " | {:>6}", "all");
    for ((l, row), all) in lengths.iter().zip(grid).zip(by_length) {
        let _ = write!(s, "{:>8} |", human_length(*l));
        for v in row {
            let _ = write!(s, " {:>6}", percent(*v));
        }
        let _ = writeln!(s, " | {:>6}", percent(*all));
    }
    s
}

/// Accuracy 0 → red, 0.5 → yellow, 1 → green; grey where not measured.
fn colour(v: Option<f64>) -> String {
    let Some(v) = v else { return UNMEASURED.to_owned() };
    let lerp = |a: (f64, f64, f64), b: (f64, f64, f64), t: f64| {
        (a.0 + (b.0 - a.0) * t, a.1 + (b.1 - a.1) * t, a.2 + (b.2 - a.2) * t)
    };
    let (red, yellow, green) = ((215.0, 48.0, 39.0), (254.0, 224.0, 139.0), (26.0, 152.0, 80.0));
    let c = if v < 0.5 { lerp(red, yellow, v * 2.0) } else { lerp(yellow, green, (v - 0.5) * 2.0) };
    format!("#{:02x}{:02x}{:02x}", c.0 as u8, c.1 as u8, c.2 as u8)
}

const UNMEASURED: &str = "#dddddd";

/// A self-contained SVG heatmap: lengths down, depths across, accuracy in each cell.
fn heatmap_svg(title: &str, lengths: &[usize], depths: &[f64], grid: &[Vec<Option<f64>>]) -> String {
    const CELL_W: usize = 84;
    const CELL_H: usize = 40;
    const LEFT: usize = 90;
    const TOP: usize = 76;
    // Bold 15px sans-serif averages under 9px a character.
    let width = (LEFT + CELL_W * depths.len() + 20).max(LEFT + 9 * title.chars().count());
    let height = TOP + CELL_H * lengths.len() + 20;
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"24\" font-size=\"15\" font-weight=\"bold\">{}</text>\n\
         <text x=\"{}\" y=\"50\" font-size=\"12\" text-anchor=\"middle\">depth of the fact in the documents</text>\n\
         <text x=\"12\" y=\"{}\" font-size=\"12\">length</text>\n",
        esc(title),
        LEFT + CELL_W * depths.len() / 2,
        TOP - 8
    );
    for (j, d) in depths.iter().enumerate() {
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">{d}</text>",
            LEFT + j * CELL_W + CELL_W / 2,
            TOP - 8
        );
    }
    for (i, (len, row)) in lengths.iter().zip(grid).enumerate() {
        let y = TOP + i * CELL_H;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"end\">{}</text>",
            LEFT - 10,
            y + CELL_H / 2 + 4,
            human_length(*len)
        );
        for (j, v) in row.iter().enumerate() {
            let x = LEFT + j * CELL_W;
            let _ = writeln!(
                s,
                "<rect x=\"{x}\" y=\"{y}\" width=\"{CELL_W}\" height=\"{CELL_H}\" fill=\"{}\" stroke=\"white\"/>\
                 <text x=\"{}\" y=\"{}\" font-size=\"13\" text-anchor=\"middle\">{}</text>",
                colour(*v),
                x + CELL_W / 2,
                y + CELL_H / 2 + 5,
                percent(*v)
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_parse_with_binary_suffixes() {
        assert_eq!(parse_length("4k"), Ok(4096));
        assert_eq!(parse_length("1M"), Ok(1 << 20));
        assert_eq!(parse_length("2000"), Ok(2000));
        assert!(parse_length("lots").unwrap_err().contains("bad length"));
        assert_eq!(human_length(32768), "32k");
        assert_eq!(human_length(3000), "3000");
    }

    #[test]
    fn heatmap_has_a_cell_per_result() {
        let grid = [vec![Some(1.0), Some(0.5), Some(0.0)], vec![Some(1.0), None, None]];
        let svg = heatmap_svg("t <x>", &[1024, 2048], &[0.0, 0.5, 1.0], &grid);
        assert_eq!(svg.matches("<rect x=").count(), 6);
        assert!(svg.contains("t &lt;x&gt;") && svg.contains("50%") && svg.contains("2k"));
        assert_eq!(svg.matches(UNMEASURED).count(), 2, "cells a cut-short run did not reach are grey");
        assert_eq!(colour(Some(1.0)), "#1a9850");
        assert_eq!(colour(Some(0.0)), "#d73027");
        let t = table(&[1024, 2048], &[0.0, 0.5, 1.0], &grid, &[Some(0.5), Some(1.0)]);
        assert!(t.contains("    50%") && t.contains("     –"), "{t}");
    }
}
