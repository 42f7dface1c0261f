//! `folio eval attention`: every method at every budget against dense attention, on synthetic
//! workloads and on real decode steps of a saved context: a table on stdout, one JSON document
//! with `--json`, and with `--out DIR` the JSON plus an SVG chart of error against budget.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use plotters::prelude::*;
use serde_json::json;

use folio_eval::attention::{on_context, synthetic, Candidate, Row};
use folio_eval::workload::{Case, Spec};
use folio_models::attention::{Channels, MethodChoice, Resources, REGISTRY};
use folio_models::chat::Message;
use folio_models::context::ContextFile;

use crate::cli::Common;

/// The synthetic workloads' channel calibration is measured on a case of this seed offset,
/// never on the case it is then used on.
const CALIBRATION_SEED_OFFSET: u64 = 1_000_003;

#[derive(Args)]
pub struct AttentionArgs {
    /// A context file (from `folio prefill`): measure on real decode steps after --question.
    #[arg(long)]
    context: Option<PathBuf>,
    /// Measure on the synthetic workloads (sink, locality, needles, long tail, mixed); the
    /// default when no --context is given.
    #[arg(long)]
    synthetic: bool,
    /// Methods to compare, comma-separated, as --method writes them (magicpig:bits=8); default:
    /// every sparse method in the registry. One that names a budget runs at it alone.
    #[arg(long, value_delimiter = ',', value_parser = crate::cli::parse_method)]
    methods: Vec<MethodChoice>,
    /// Budgets each method without one runs at, comma-separated: tokens (256) or shares (2%, 0.02).
    #[arg(long, value_delimiter = ',', default_value = "1%,2%,5%,10%,25%,50%,100%")]
    budgets: Vec<String>,
    /// The question asked over --context before decoding.
    #[arg(long, default_value = "Summarise the documents.")]
    question: String,
    /// Decode steps measured per run.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Synthetic context length in tokens.
    #[arg(long, default_value_t = 4096)]
    length: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write attention.json and attention-error.svg into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// The methods asked for, else every sparse one in the registry.
fn methods(a: &AttentionArgs) -> Vec<MethodChoice> {
    if !a.methods.is_empty() {
        return a.methods.clone();
    }
    let sparse = REGISTRY.iter().filter(|m| m.default_budget.is_some());
    sparse.map(|m| MethodChoice { method: m.name.to_owned(), ..MethodChoice::default() }).collect()
}

/// Every method at every budget (or at its own), each labelled by its knobs.
fn candidates(a: &AttentionArgs, resources: &Resources) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for choice in methods(a) {
        let label = MethodChoice { budget: None, ..choice.clone() }.to_string();
        let budgets = match &choice.budget {
            Some(b) => vec![b.clone()],
            None => a.budgets.clone(),
        };
        for budget in budgets {
            let run = MethodChoice { budget: Some(budget.clone()), ..choice.clone() };
            out.push(Candidate { method: label.clone(), budget, attention: run.build(resources)? });
        }
    }
    Ok(out)
}

pub fn eval_attention(common: &Common, a: AttentionArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let mut rows: Vec<Row> = Vec::new();
    let mut answer = None;
    if a.synthetic || a.context.is_none() {
        for mut spec in Spec::presets(a.length) {
            spec.steps = a.steps;
            let case = Case::generate(&spec, a.seed)?;
            let mut resources = Resources::default();
            if methods(&a).iter().map(|m| m.spec()).collect::<Result<Vec<_>, _>>()?.iter().any(|m| m.needs.calibration)
            {
                // Channels calibrated on another case of the same workload (held-out data).
                let held_out = Case::generate(&spec, a.seed.wrapping_add(CALIBRATION_SEED_OFFSET))?;
                let stat = held_out.qk_statistic()?;
                let layers = vec![stat; folio_eval::attention::SYNTHETIC_LAYERS];
                resources.channels = Some(Arc::new(Channels::from_statistic(&layers)));
            }
            eprintln!("synthetic workload {}: {} keys, {} decode steps", spec.name, spec.context, spec.steps);
            rows.extend(synthetic(&case, &candidates(&a, &resources)?)?);
        }
    }
    if let Some(path) = &a.context {
        let file = Arc::new(ContextFile::open(path)?);
        let engine = common.engine_or(&file.header().model.source)?;
        engine.check_context(&file)?;
        let resources = engine.resources(&methods(&a))?;
        let tail = engine.context_tail(&file.header().prompt, &[Message::new("user", &a.question)])?;
        let run = on_context(
            &engine,
            &file,
            &tail,
            a.steps,
            folio_models::session::RESIDENT_BUDGET,
            &candidates(&a, &resources)?,
            |c| eprintln!("context: {} at {}", c.method, c.budget),
        )?;
        answer = Some(engine.tokenizer.decode(&run.answer, false)?);
        rows.extend(run.rows);
    }
    let doc = json!({
        "steps": a.steps,
        "seed": a.seed,
        "synthetic_length": a.length,
        "context": a.context,
        "question": a.context.as_ref().map(|_| &a.question),
        "dense_answer": answer,
        "rows": rows,
    });
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        super::write_file(&dir.join("attention.json"), serde_json::to_string_pretty(&doc)?)?;
        chart(&dir.join("attention-error.svg"), &rows)?;
    }
    if a.json {
        println!("{doc}");
    } else {
        print!("{}", table(&rows));
    }
    Ok(())
}

fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    let mut workload = "";
    for r in rows {
        if r.workload != workload {
            workload = &r.workload;
            let _ = writeln!(s, "\n{workload}");
            let _ = writeln!(
                s,
                "{:<16} {:>7} | {:>9} {:>7} {:>7} | {:>7} {:>7} {:>8} | {:>9} | per-layer error",
                "method", "budget", "rel.err", "recall", "mass", "read", "kv read", "searched", "KL nats"
            );
        }
        // Error, recall and mass where the method acts; cost over every layer.
        let e = r.sparse_layers.as_ref().unwrap_or(&r.overall);
        let o = &r.overall;
        let kl = r.kl.map_or("-".to_owned(), |k| format!("{k:.2e}"));
        let layers: Vec<String> = r.layers.iter().map(|(l, x)| format!("{l}:{:.3}", x.rel_error)).collect();
        let _ = writeln!(
            s,
            "{:<16} {:>7} | {:>9.4} {:>6.1}% {:>6.1}% | {:>6.1}% {:>6.1}% {:>7.1}% | {:>9} | {}",
            r.method,
            r.budget,
            e.rel_error,
            100.0 * e.recall,
            100.0 * e.mass,
            100.0 * o.read,
            100.0 * o.kv_read,
            100.0 * o.searched,
            kl,
            layers.join(" ")
        );
    }
    s
}

/// Smallest error the log axis shows (dense-equal runs sit on it).
const ERROR_FLOOR: f64 = 1e-4;

/// Relative error in the layers a method runs sparse against the fraction of KV rows it read
/// over all layers, one line per method, one panel per workload.
fn chart(path: &Path, rows: &[Row]) -> Result<()> {
    let mut workloads: Vec<&str> = Vec::new();
    for r in rows {
        if !workloads.contains(&r.workload.as_str()) {
            workloads.push(&r.workload);
        }
    }
    let mut methods: Vec<&str> = Vec::new();
    for r in rows {
        if !methods.contains(&r.method.as_str()) {
            methods.push(&r.method);
        }
    }
    let cols = workloads.len().min(3);
    let panels = workloads.len().div_ceil(cols.max(1)).max(1);
    let root = SVGBackend::new(path, (420 * cols.max(1) as u32, 340 * panels as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("chart: {e}"))?;
    let areas = root.split_evenly((panels, cols.max(1)));
    for (area, w) in areas.iter().zip(&workloads) {
        let mine: Vec<&Row> = rows.iter().filter(|r| r.workload == *w).collect();
        let x_min = mine.iter().map(|r| r.overall.read).fold(1.0f64, f64::min).clamp(1e-4, 0.5) * 0.8;
        let mut c = ChartBuilder::on(area)
            .caption(*w, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d((x_min..1.05f64).log_scale(), (ERROR_FLOOR..3.0f64).log_scale())
            .map_err(|e| anyhow::anyhow!("chart: {e}"))?;
        c.configure_mesh()
            .x_desc("fraction of KV rows read")
            .y_desc("relative error (sparse layers)")
            .draw()
            .map_err(|e| anyhow::anyhow!("chart: {e}"))?;
        for (i, m) in methods.iter().enumerate() {
            let colour = Palette99::pick(i).to_rgba();
            let mut pts: Vec<(f64, f64)> = mine
                .iter()
                .filter(|r| r.method == *m)
                .map(|r| {
                    let err = r.sparse_layers.as_ref().unwrap_or(&r.overall).rel_error;
                    (r.overall.read.max(x_min), err.max(ERROR_FLOOR))
                })
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            c.draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
                .map_err(|e| anyhow::anyhow!("chart: {e}"))?
                .label(*m)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2)));
            c.draw_series(pts.iter().map(|p| Circle::new(*p, 3, colour.filled())))
                .map_err(|e| anyhow::anyhow!("chart: {e}"))?;
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow::anyhow!("chart: {e}"))?;
    }
    root.present().map_err(|e| anyhow::anyhow!("chart: {e}"))?;
    Ok(())
}
