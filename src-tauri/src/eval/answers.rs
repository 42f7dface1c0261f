//! `folio eval prefill-cost`: what a sparse prefill cost in answers, read from the reports of
//! `folio eval fidelity --prefill sparse` — a table per context length, and with `--record`
//! the model's answer-cost file, which the staging sheet shows beside the sparse prefill's time.
//!
//! Why a second command rather than a flag of the fidelity eval: the cost is measured on a
//! GPU machine in runs of minutes to hours (1M tokens), often split by length, and recorded
//! for a model where the app runs; reading the reports joins those runs without redoing them.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;

use crate::cli::Common;
use folio_eval::fidelity::{answer_costs, Outcome};
use folio_models::context::answers::{self, ANSWERS_FILE};

#[derive(Args)]
pub struct PrefillCostArgs {
    /// Reports of `folio eval fidelity --prefill sparse --out DIR` (DIR/fidelity.json), one or
    /// more (a 32k–128k run and a 1M run, say).
    #[arg(required = true)]
    reports: Vec<PathBuf>,
    /// Where and when the runs were made, as the staging sheet names the measurement
    /// ("H200, 2026-12-02").
    #[arg(long)]
    measured: String,
    /// Write the rows into the model's folder (`--model`), where the window reads them
    /// (rows of the same prefill and length are replaced).
    #[arg(long)]
    record: bool,
    #[arg(long)]
    json: bool,
}

/// What `folio eval fidelity` wrote, as far as this command reads it.
#[derive(Deserialize)]
struct Report {
    model: String,
    /// The measured weights' fingerprint id (absent in reports before it: the name is checked).
    #[serde(default)]
    model_id: Option<String>,
    /// False in a report of a run cut short (it holds the prompts reached).
    #[serde(default = "yes")]
    complete: bool,
    /// The prompts' seed: with the cell, what makes a prompt.
    seed: u64,
    runs: Vec<RunReport>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct RunReport {
    method: String,
    outcomes: Vec<Outcome>,
}

pub fn eval_prefill_cost(common: &Common, a: PrefillCostArgs) -> Result<()> {
    let (mut outcomes, mut models) = (Vec::<(u64, Outcome)>::new(), Vec::new());
    for path in &a.reports {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let report: Report = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a report of `folio eval fidelity`", path.display()))?;
        if !report.complete {
            eprintln!("warning: {} is of a run cut short: its prompts so far are counted", path.display());
        }
        models.push((report.model, report.model_id, path));
        let seed = report.seed;
        for o in report.runs.into_iter().filter(|r| r.method == "dense").flat_map(|r| r.outcomes) {
            // The same prompt in two reports (one given twice, a rerun beside a cut-short one)
            // counts once.
            let same = |(s, k): &(u64, Outcome)| {
                (*s, k.task, k.length, k.depth.to_bits(), k.sample, k.question, &k.prefill)
                    == (seed, o.task, o.length, o.depth.to_bits(), o.sample, o.question, &o.prefill)
            };
            if !outcomes.iter().any(same) {
                outcomes.push((seed, o));
            }
        }
    }
    let outcomes: Vec<Outcome> = outcomes.into_iter().map(|(_, o)| o).collect();
    let rows = answer_costs(&outcomes, &a.measured);
    if rows.is_empty() {
        bail!(
            "no dense decoding over a sparse prefill in {}: measure it with `folio eval fidelity --offload \
             --prefill sparse --out DIR` and pass DIR/fidelity.json",
            a.reports.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<48} {:>9} {:>8} {:>10} {:>5} {:>9} {:>7}",
            "prefill", "length", "prompts", "right", "lost", "mean KL", "top-1"
        );
        for r in &rows {
            let right = format!("{} ({})", r.answered, r.dense_answered);
            println!(
                "{:<48} {:>9} {:>8} {:>10} {:>5} {:>9.4} {:>6.1}%",
                r.prefill,
                r.length,
                r.prompts,
                right,
                r.lost,
                r.mean_kl,
                r.top1_agreement * 100.0
            );
        }
        println!(
            "right: answers right over the sparse prefill (over a dense prefill), both decoded densely; lost: \
             prompts a dense prefill answers right and the sparse one does not"
        );
    }
    if a.record {
        let engine = common.engine()?;
        let id = engine.fingerprint_id()?;
        for (name, model_id, path) in &models {
            // The weights when the report names them, else (an earlier report) the model's name.
            let same = model_id.as_ref().map_or(*name == engine.name, |m| *m == id);
            if !same {
                bail!(
                    "{} measured {name} ({}), not the model at --model ({}, {id}): pass the model it measured",
                    path.display(),
                    model_id.as_deref().unwrap_or("no fingerprint recorded"),
                    engine.name
                );
            }
        }
        answers::record(engine.model_dir(), &id, &rows)?;
        eprintln!("recorded in {}", engine.model_dir().join(ANSWERS_FILE).display());
    }
    Ok(())
}
