//! `folio eval fidelity`: each method's answers against dense attention's on prompts whose
//! answers read the documents while they are generated (chain, pair; needle as the baseline):
//! accuracy, next-token KL and top-1 agreement teacher-forced on dense's answer, rows read,
//! time per token and to the first token. A table per length on stdout, one JSON document with
//! `--json`, and with `--out DIR` the JSON, an SVG chart of each method's budget curve, and
//! every missed prompt's token ids.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use plotters::prelude::*;
use serde_json::json;

use folio_eval::fidelity::{self, Cell, Outcome, QuestionMode};
use folio_eval::needle::PromptTier;
use folio_eval::spec::EvalSpec;
use folio_eval::tasks::{self, Task};
use folio_models::attention::{Attention, MethodChoice};
use folio_models::prefill::PrefillMode;

use super::{human_length, parse_length, save_prompt, write_file};
use crate::cli::Common;

#[derive(Args)]
pub struct FidelityArgs {
    /// Tasks, comma-separated: chain (follow references hop by hop while answering), pair (two
    /// facts in two documents), needle (one fact; the baseline); for a model trained on the
    /// RULER-style suite (its eval_spec.json has `ruler`, docs/yardstick.md): multi_key,
    /// multi_value, near_dup, deep_chain, count, frequent, two_hop, recite.
    #[arg(long, value_delimiter = ',', default_value = "chain,pair,needle", value_parser = parse_task)]
    tasks: Vec<Task>,
    /// Context lengths in tokens: 4k = 4096, 1M = 1048576.
    #[arg(long, value_delimiter = ',', default_value = "4k", value_parser = parse_length)]
    lengths: Vec<usize>,
    /// Depths of the first fact, 0 (start) to 1 (end); the other facts go to random places.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75")]
    depths: Vec<f64>,
    /// Prompts per (task, length, depth).
    #[arg(long, default_value_t = 2)]
    samples: usize,
    /// Methods measured against dense (always run, as the reference and as a row of its own),
    /// comma-separated, as --method writes them. One without a budget runs at each of
    /// --budgets, or at its paper default.
    #[arg(long, value_delimiter = ',', value_parser = crate::cli::parse_method)]
    methods: Vec<MethodChoice>,
    /// Budgets each method without one runs at: a budget curve per method.
    #[arg(long, value_delimiter = ',')]
    budgets: Vec<String>,
    /// How the question after the documents is attended: dense (one pass, as the papers
    /// prefill), sparse (one token at a time with the method), or both.
    #[arg(long, value_enum, default_value_t = Questions::Dense)]
    question: Questions,
    /// Decode over the offloaded tier (each prompt's documents prefilled into host memory once).
    #[arg(long)]
    offload: bool,
    /// How the documents the methods decode over are prefilled: dense, or sparse[:KNOBS] (as
    /// `folio prefill --prefill`; needs --offload). The reference is always dense prefill and
    /// dense decode: the figures are then the cost of the sparse prefill and the method together.
    #[arg(long, default_value = "dense")]
    prefill: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write fidelity.json, fidelity.svg and the missed prompts (misses/) into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run nothing: draw one chart (OUT/fidelity.svg) of these reports' outcomes (fidelity.json
    /// files of earlier runs, comma-separated), e.g. 32k-128k and 1M runs made by separate
    /// commands; where two reports answered the same prompt with the same method, the first's
    /// answer counts.
    #[arg(long, value_delimiter = ',', requires = "out")]
    replot: Vec<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Questions {
    Dense,
    Sparse,
    Both,
}

impl Questions {
    fn modes(self) -> Vec<QuestionMode> {
        match self {
            Questions::Dense => vec![QuestionMode::Dense],
            Questions::Sparse => vec![QuestionMode::Sparse],
            Questions::Both => vec![QuestionMode::Dense, QuestionMode::Sparse],
        }
    }
}

fn parse_task(s: &str) -> std::result::Result<Task, String> {
    Task::parse(s).map_err(|e| e.to_string())
}

/// One method at one budget: its label and where its misses go.
struct Run {
    choice: MethodChoice,
    /// "topk:1%", or "dense".
    label: String,
    /// The method's name, which joins its budgets into one curve.
    family: String,
    attn: Box<dyn Attention>,
}

/// The runs asked for: dense first, then each method at its budget, at each of `budgets`, or
/// at its default.
fn runs(a: &FidelityArgs, engine: &folio_models::Engine) -> Result<Vec<Run>> {
    let tier = if a.offload { PromptTier::Offloaded } else { PromptTier::Resident };
    let mut choices = vec![MethodChoice::default()];
    for m in &a.methods {
        if m.budget.is_some() || a.budgets.is_empty() || m.spec()?.default_budget.is_none() {
            choices.push(m.clone());
        } else {
            choices.extend(a.budgets.iter().map(|b| MethodChoice { budget: Some(b.clone()), ..m.clone() }));
        }
    }
    let resources = engine.resources(&choices)?;
    let mut out: Vec<Run> = Vec::with_capacity(choices.len());
    for choice in choices {
        choice.spec()?.check_tier(tier.tier())?;
        let label = choice.to_string();
        if out.iter().any(|r| r.label == label) {
            bail!("{label} is measured twice (dense always runs, as the reference)");
        }
        let family = choice.method.clone();
        let attn = choice.build(&resources)?;
        out.push(Run { choice, label, family, attn });
    }
    Ok(out)
}

/// One run's figures at one length and question mode, over its prompts.
#[derive(serde::Serialize, serde::Deserialize)]
struct Summary {
    method: String,
    family: String,
    budget: Option<String>,
    question: QuestionMode,
    length: usize,
    prompts: usize,
    /// Per task: the share of prompts answered exactly.
    accuracy: Vec<(Task, f64)>,
    overall: f64,
    values_right: f64,
    mean_kl: f64,
    top1_agreement: f64,
    rows_read_fraction: f64,
    ms_per_token_mean: Option<f64>,
    ms_per_token_p90: Option<f64>,
    first_token_s_mean: Option<f64>,
}

/// What a summary is of: a method at a budget, and the curve it belongs to.
#[derive(Clone)]
struct Label {
    /// "topk:1%", or "dense".
    method: String,
    family: String,
    /// The budget in effect, its default when the method was named without one.
    budget: Option<String>,
}

impl Run {
    fn label(&self) -> Label {
        let budget = self.choice.budget().ok().flatten().map(|b| b.text());
        Label { method: self.label.clone(), family: self.family.clone(), budget }
    }
}

fn summarise(label: &Label, outcomes: &[&Outcome], tasks: &[Task], question: QuestionMode, length: usize) -> Summary {
    let n = outcomes.len().max(1) as f64;
    let share = |f: &dyn Fn(&Outcome) -> bool, of: &[&Outcome]| {
        of.iter().filter(|o| f(o)).count() as f64 / of.len().max(1) as f64
    };
    let accuracy = tasks
        .iter()
        .map(|&t| {
            let mine: Vec<&Outcome> = outcomes.iter().copied().filter(|o| o.task == t).collect();
            (t, share(&|o| o.correct, &mine))
        })
        .collect();
    let mean = |f: &dyn Fn(&Outcome) -> f64| outcomes.iter().map(|o| f(o)).sum::<f64>() / n;
    let mut per_token: Vec<f64> = outcomes.iter().filter_map(|o| o.ms_per_token).collect();
    per_token.sort_by(f64::total_cmp);
    let first: Vec<f64> = outcomes.iter().filter_map(|o| o.first_token_s).collect();
    Summary {
        method: label.method.clone(),
        family: label.family.clone(),
        budget: label.budget.clone(),
        question,
        length,
        prompts: outcomes.len(),
        accuracy,
        overall: share(&|o| o.correct, outcomes),
        values_right: outcomes.iter().map(|o| o.values_right).sum::<usize>() as f64
            / outcomes.iter().map(|o| o.values).sum::<usize>().max(1) as f64,
        mean_kl: mean(&|o| o.mean_kl),
        top1_agreement: mean(&|o| o.top1_agreement),
        rows_read_fraction: mean(&|o| o.rows_read_fraction),
        ms_per_token_mean: (!per_token.is_empty()).then(|| per_token.iter().sum::<f64>() / per_token.len() as f64),
        ms_per_token_p90: percentile(&per_token, 0.9),
        first_token_s_mean: (!first.is_empty()).then(|| first.iter().sum::<f64>() / first.len() as f64),
    }
}

/// The `q` quantile of sorted `xs` (nearest rank).
fn percentile(xs: &[f64], q: f64) -> Option<f64> {
    (!xs.is_empty()).then(|| xs[((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len()) - 1])
}

pub fn eval_fidelity(common: &Common, a: FidelityArgs) -> Result<()> {
    if !a.replot.is_empty() {
        return replot(&a.replot, a.out.as_deref().context("--replot writes into --out")?);
    }
    if a.samples == 0 || a.tasks.is_empty() || a.lengths.is_empty() || a.depths.is_empty() {
        bail!("--samples, --tasks, --lengths and --depths must each ask for at least one");
    }
    if let Some(d) = a.depths.iter().find(|d| !(0.0..=1.0).contains(*d)) {
        bail!("depth {d} is outside 0..=1");
    }
    let engine = common.engine()?;
    let model_dir = engine.model_dir().to_owned();
    let spec = EvalSpec::load(&model_dir)?;
    for &len in &a.lengths {
        engine.config().check_fits(len)?;
    }
    let runs = runs(&a, &engine)?;
    let labels: Vec<Label> = runs.iter().map(Run::label).collect();
    let tier = if a.offload { PromptTier::Offloaded } else { PromptTier::Resident };
    let prefill = PrefillMode::parse(&a.prefill)?;
    if prefill != PrefillMode::Dense && !a.offload {
        bail!("--prefill {} prefills the documents once, into the offloaded tier: add --offload", a.prefill);
    }
    let modes = a.question.modes();
    // outcomes[r]: run r's, over every prompt and question mode
    let mut outcomes: Vec<Vec<Outcome>> = runs.iter().map(|_| Vec::new()).collect();
    if let Some(dir) = &a.out {
        let misses = dir.join(MISSES_DIR);
        if misses.is_dir() {
            // An earlier run's misses in the same folder would read as this run's.
            std::fs::remove_dir_all(&misses).with_context(|| format!("clearing {}", misses.display()))?;
        }
    }
    // The weights measured (what `folio eval prefill-cost --record` ties its rows to).
    let model_id = engine.fingerprint_id()?;
    let report = |outcomes: &[Vec<Outcome>], complete: bool| {
        let figures: Vec<Summary> = summaries(&labels, outcomes, &a.tasks, &a.lengths, &modes);
        json!({
            "model": engine.name,
            "model_id": model_id,
            "tasks": a.tasks,
            "lengths": a.lengths,
            "depths": a.depths,
            "samples": a.samples,
            "seed": a.seed,
            "offload": a.offload,
            "prefill": prefill.name(),
            "prefilled_answer_prefix": spec.chat.prefill_answer_prefix,
            "complete": complete,
            "summaries": figures,
            "runs": runs.iter().zip(outcomes).map(|(r, o)| json!({
                "method": r.label,
                "attention": r.attn.settings(),
                "outcomes": o,
            })).collect::<Vec<_>>(),
        })
    };
    let attns: Vec<&dyn Attention> = runs.iter().map(|r| r.attn.as_ref()).collect();
    // One short prompt through every run and question mode first, its outcomes dropped: the
    // process's one-off costs (the device context, kernels loaded on first use, the allocator's
    // first pools) would otherwise be charged to the first method's first prompt.
    let warm_length = a.lengths.iter().copied().min().unwrap_or(WARMUP_TOKENS).min(WARMUP_TOKENS);
    let warm = tasks::cell_prompt(&engine, &spec, a.tasks[0], (warm_length, a.depths[0], 0), a.seed)?;
    eprintln!("warming up on a {}-token {} prompt", warm.ids.len(), a.tasks[0].name());
    let warm_cell = Cell { task: a.tasks[0], length: warm_length, depth: a.depths[0], sample: 0 };
    fidelity::run_prompt(&engine, &warm, warm_cell, &attns, &tier, &modes, prefill)?;
    for &length in &a.lengths {
        for &task in &a.tasks {
            for &depth in &a.depths {
                for sample in 0..a.samples {
                    let prompt = tasks::cell_prompt(&engine, &spec, task, (length, depth, sample), a.seed)?;
                    let cell = Cell { task, length, depth, sample };
                    let got = fidelity::run_prompt(&engine, &prompt, cell, &attns, &tier, &modes, prefill)?;
                    for (mode, got) in modes.iter().zip(got) {
                        record(&runs, *mode, got, &prompt.ids, a.out.as_deref(), &mut outcomes);
                    }
                    if let Some(dir) = &a.out {
                        // A long run (minutes per 1M-token prompt) keeps what it measured if cut short.
                        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                        write_file(
                            &dir.join("fidelity.json"),
                            serde_json::to_string_pretty(&report(&outcomes, false))?,
                        )?;
                    }
                }
            }
        }
    }
    let last = summaries(&labels, &outcomes, &a.tasks, &a.lengths, &modes);
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write_file(&dir.join("fidelity.json"), serde_json::to_string_pretty(&report(&outcomes, true))?)?;
        chart(&dir.join("fidelity.svg"), &engine.name, &last, &a.lengths)?;
    }
    if a.json {
        println!("{}", report(&outcomes, true));
    } else {
        if prefill != PrefillMode::Dense {
            println!("documents prefilled {}; every figure against a dense prefill's dense decode", prefill.name());
        }
        print!("{}", table(&last, &a.tasks));
    }
    Ok(())
}

/// One prompt's outcomes in one question mode (`got`, a run's each): told on stderr, a miss's
/// prompt saved under `out`, and each kept with its run's outcomes.
fn record(
    runs: &[Run],
    mode: QuestionMode,
    got: Vec<Outcome>,
    ids: &[u32],
    out: Option<&Path>,
    outcomes: &mut [Vec<Outcome>],
) {
    let first = &got[0];
    let word = |right: bool| if right { "right" } else { "wrong" };
    let methods: Vec<String> = runs
        .iter()
        .zip(&got)
        .skip(1)
        .map(|(r, o)| format!("{} {} (KL {:.3})", r.label, word(o.correct), o.mean_kl))
        .collect();
    eprintln!(
        "{} {} tokens, depth {}, sample {}, {} question: dense {}; {}",
        first.task.name(),
        ids.len(),
        first.depth,
        first.sample,
        mode.name(),
        word(first.dense_correct),
        methods.join(", ")
    );
    for ((run, o), mine) in runs.iter().zip(got).zip(outcomes.iter_mut()) {
        if let (false, Some(dir)) = (o.correct, out) {
            let dir = dir.join(MISSES_DIR).join(run.choice.slug());
            let name = format!("{}-{}-{}-{}-{}", o.task.name(), o.length, o.depth, o.sample, o.question.name());
            // The measurement is kept; a prompt that cannot be saved is worth a warning.
            if let Err(e) = save_prompt(&dir, &name, ids, &o) {
                eprintln!("    warning: the missed prompt was not saved: {e:#}");
            }
        }
        mine.push(o);
    }
}

/// One chart of earlier reports' outcomes, summarised together: a method's prompts from
/// several reports (say, a 1M run split over two commands by depth) make one point.
fn replot(reports: &[PathBuf], out: &Path) -> Result<()> {
    #[derive(serde::Deserialize)]
    struct RunReport {
        method: String,
        outcomes: Vec<Outcome>,
    }
    #[derive(serde::Deserialize)]
    struct Report {
        model: String,
        summaries: Vec<Summary>,
        runs: Vec<RunReport>,
    }
    let mut model = String::new();
    let (mut labels, mut outcomes): (Vec<Label>, Vec<Vec<Outcome>>) = (Vec::new(), Vec::new());
    for path in reports {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let report: Report = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a `folio eval fidelity` report", path.display()))?;
        if !model.is_empty() && model != report.model {
            bail!(
                "{} measures {}, the reports before it {model}: one chart is one model",
                path.display(),
                report.model
            );
        }
        model = report.model;
        for run in report.runs {
            let at = match labels.iter().position(|l| l.method == run.method) {
                Some(at) => at,
                None => {
                    let summary = report.summaries.iter().find(|x| x.method == run.method);
                    labels.push(Label {
                        family: summary.map_or_else(|| run.method.clone(), |x| x.family.clone()),
                        budget: summary.and_then(|x| x.budget.clone()),
                        method: run.method.clone(),
                    });
                    outcomes.push(Vec::new());
                    labels.len() - 1
                }
            };
            let cell = |o: &Outcome| (o.task, o.length, o.depth.to_bits(), o.sample, o.question);
            for o in run.outcomes {
                // The first report's answer where two measured the same prompt (dense, in each).
                if !outcomes[at].iter().any(|p| cell(p) == cell(&o)) {
                    outcomes[at].push(o);
                }
            }
        }
    }
    let every = outcomes.iter().flatten();
    let tasks: Vec<Task> = Task::ALL.into_iter().filter(|t| every.clone().any(|o| o.task == *t)).collect();
    let modes: Vec<QuestionMode> = [QuestionMode::Dense, QuestionMode::Sparse]
        .into_iter()
        .filter(|m| every.clone().any(|o| o.question == *m))
        .collect();
    let mut lengths: Vec<usize> = every.map(|o| o.length).collect();
    lengths.sort_unstable();
    lengths.dedup();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    chart(&out.join("fidelity.svg"), &model, &summaries(&labels, &outcomes, &tasks, &lengths, &modes), &lengths)
}

/// Every run's summary per length and question mode, in run order.
fn summaries(
    labels: &[Label],
    outcomes: &[Vec<Outcome>],
    tasks: &[Task],
    lengths: &[usize],
    modes: &[QuestionMode],
) -> Vec<Summary> {
    let mut out = Vec::new();
    for &length in lengths {
        for &mode in modes {
            for (label, o) in labels.iter().zip(outcomes) {
                let mine: Vec<&Outcome> = o.iter().filter(|o| o.length == length && o.question == mode).collect();
                if !mine.is_empty() {
                    out.push(summarise(label, &mine, tasks, mode, length));
                }
            }
        }
    }
    out
}

/// Where `--out` keeps the prompts a method got wrong.
const MISSES_DIR: &str = "misses";

/// The warm-up prompt's length (or the shortest asked for, if shorter): long enough to take
/// every kernel's code path once, short enough to cost little beside a real cell.
const WARMUP_TOKENS: usize = 4096;

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".to_owned(), |v| format!("{v:.digits$}"))
}

fn table(summaries: &[Summary], tasks: &[Task]) -> String {
    let mut s = String::new();
    let mut last = None;
    for x in summaries {
        if last != Some((x.length, x.question)) {
            last = Some((x.length, x.question));
            let _ = writeln!(s, "\n{} tokens, {} question:", x.length, x.question.name());
            let _ = write!(s, "{:<28}", "method");
            for t in tasks {
                let _ = write!(s, " {:>7}", t.name());
            }
            let _ = writeln!(
                s,
                " {:>7} {:>8} {:>6} {:>7} {:>9} {:>9} {:>8}",
                "all", "KL", "top1", "read", "ms/tok", "p90", "ttft s"
            );
        }
        let _ = write!(s, "{:<28}", x.method);
        for (_, acc) in &x.accuracy {
            let _ = write!(s, " {:>6.0}%", 100.0 * acc);
        }
        let _ = writeln!(
            s,
            " {:>6.0}% {:>8.4} {:>5.0}% {:>6.2}% {:>9} {:>9} {:>8}",
            100.0 * x.overall,
            x.mean_kl,
            100.0 * x.top1_agreement,
            100.0 * x.rows_read_fraction,
            opt(x.ms_per_token_mean, 2),
            opt(x.ms_per_token_p90, 2),
            opt(x.first_token_s_mean, 3)
        );
    }
    s
}

/// Smallest KL drawn on the chart's log axis (dense's own is 0).
const KL_FLOOR: f64 = 1e-4;

/// Labels on a rows-read axis (a log axis labels every decade's steps otherwise).
const X_LABELS: usize = 6;

/// Height of the legend strip under the panels, and of one of its rows.
const LEGEND_HEIGHT: u32 = 96;
const LEGEND_ROW: i32 = 20;

/// One column per length: accuracy (top) and mean KL (bottom) against the fraction of rows
/// read, a line per method through its budgets, dashed where the question was sparse too.
fn chart(path: &Path, model: &str, summaries: &[Summary], lengths: &[usize]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("chart: {e}");
    let mut families: Vec<&str> = Vec::new();
    let mut modes: Vec<QuestionMode> = Vec::new();
    for x in summaries {
        if !families.contains(&x.family.as_str()) {
            families.push(&x.family);
        }
        if !modes.contains(&x.question) {
            modes.push(x.question);
        }
    }
    let cols = lengths.len().max(1);
    let (width, height) = (440 * cols as u32, 700 + LEGEND_HEIGHT);
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root =
        root.titled(&format!("answers against dense attention: {model}"), ("sans-serif", 18)).map_err(|e| err(&e))?;
    let (panels, legend) = root.split_vertically(root.dim_in_pixel().1 - LEGEND_HEIGHT);
    let areas = panels.split_evenly((2, cols));
    let x_min = summaries.iter().map(|x| x.rows_read_fraction).fold(1.0f64, f64::min).clamp(1e-4, 0.5) * 0.7;
    let share = |x: &f64| match *x {
        x if x >= 0.1 => format!("{:.0}%", 100.0 * x),
        x if x >= 0.01 => format!("{:.1}%", 100.0 * x),
        x => format!("{:.2}%", 100.0 * x),
    };
    for (col, &length) in lengths.iter().enumerate() {
        let caption = |what: &str| format!("{} tokens: {what}", human_length(length));
        let mut c = ChartBuilder::on(&areas[col])
            .caption(caption("exact answers"), ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d((x_min..1.15f64).log_scale(), 0.0..1.05f64)
            .map_err(|e| err(&e))?;
        c.configure_mesh()
            .x_desc("rows read, of those visible")
            .x_labels(X_LABELS)
            .x_label_formatter(&share)
            .y_label_formatter(&|y| format!("{:.0}%", 100.0 * y))
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| err(&e))?;
        plot(&mut c, summaries, &families, length, |x| x.overall)?;
        let mut c = ChartBuilder::on(&areas[cols + col])
            .caption(caption("mean next-token KL from dense"), ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d((x_min..1.15f64).log_scale(), (KL_FLOOR..20.0f64).log_scale())
            .map_err(|e| err(&e))?;
        c.configure_mesh()
            .x_desc("rows read, of those visible")
            .y_desc("nats")
            .x_labels(X_LABELS)
            .x_label_formatter(&share)
            .y_label_formatter(&|y| format!("{y:e}"))
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| err(&e))?;
        plot(&mut c, summaries, &families, length, |x| x.mean_kl.max(KL_FLOOR))?;
    }
    // The legend: a swatch per method, in rows as wide as the chart, then what the dashes mean
    // when both question modes ran.
    let text = ("sans-serif", 14).into_font();
    let (mut x, mut y) = (20, 10);
    for (i, family) in families.iter().enumerate() {
        let w = 40 + 9 * family.len() as i32;
        if x + w > width as i32 && x > 20 {
            (x, y) = (20, y + LEGEND_ROW);
        }
        let colour = Palette99::pick(i).to_rgba();
        legend
            .draw(&PathElement::new(vec![(x, y + 7), (x + 24, y + 7)], colour.stroke_width(3)))
            .map_err(|e| err(&e))?;
        legend.draw(&Text::new(family.to_string(), (x + 30, y), text.clone())).map_err(|e| err(&e))?;
        x += w;
    }
    if modes.contains(&QuestionMode::Sparse) {
        let note = "solid, circles: dense question; dashed, triangles: question read with the method";
        legend.draw(&Text::new(note, (20, y + LEGEND_ROW), text.clone())).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// A line and markers per method and question mode at `length`: (rows read, `y`) over its
/// budgets; a method's colour is its place in `families`.
fn plot<'a, X, Y>(
    c: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    summaries: &[Summary],
    families: &[&str],
    length: usize,
    y: impl Fn(&Summary) -> f64,
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("chart: {e}");
    for (i, family) in families.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        for mode in [QuestionMode::Dense, QuestionMode::Sparse] {
            let mut pts: Vec<(f64, f64)> = summaries
                .iter()
                .filter(|x| x.length == length && x.family == *family && x.question == mode)
                .map(|x| (x.rows_read_fraction, y(x)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            match mode {
                QuestionMode::Dense => {
                    c.draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2))).map_err(|e| err(&e))?;
                    c.draw_series(pts.iter().map(|p| Circle::new(*p, 4, colour.filled()))).map_err(|e| err(&e))?;
                }
                QuestionMode::Sparse => {
                    c.draw_series(DashedLineSeries::new(pts.clone(), 6, 4, colour.stroke_width(2)))
                        .map_err(|e| err(&e))?;
                    c.draw_series(pts.iter().map(|p| TriangleMarker::new(*p, 5, colour.filled())))
                        .map_err(|e| err(&e))?;
                }
            }
        }
    }
    Ok(())
}
