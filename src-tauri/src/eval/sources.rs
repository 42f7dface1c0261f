//! `folio eval sources`: whether each answer's first source passage holds the fact it was
//! copied from (folio_eval::sources), per method, with a table and a JSON report.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;

use crate::cli::Common;
use folio_eval::sources::{self, SourcesRow};
use folio_eval::spec::EvalSpec;
use folio_models::attention::{MethodChoice, Tier, Weighing};
use folio_models::context::ContextFile;

/// The methods a sources run compares by default: dense and the two the window offers first.
const DEFAULT_METHODS: &str = "dense,hip,magicpig";

#[derive(Args)]
pub struct SourcesArgs {
    /// Tokens of the one document (4k = 4096, 1M = 1048576).
    #[arg(long, value_parser = super::parse_length, default_value = "20k")]
    length: usize,
    /// Comma-separated methods, each as --method writes it.
    #[arg(long, value_delimiter = ',', value_parser = crate::cli::parse_method, default_value = DEFAULT_METHODS)]
    methods: Vec<MethodChoice>,
    /// The questions: a SAMPLES.md table (default: the one two folders above the model's, as
    /// the bundled demo model has assets/SAMPLES.md).
    #[arg(long)]
    samples: Option<PathBuf>,
    /// Where the prefilled context is kept: reused when it holds this run's document (same
    /// length and seed), else prefilled there. Default: a temporary file.
    #[arg(long)]
    context: Option<PathBuf>,
    /// Ask over the offloaded tier (`folio chat --offload`), as methods that need it do.
    #[arg(long)]
    offload: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How passages are found: `copied` (where the answer copied from; what the window
    /// shows) or `mass` (by attention mass alone), to compare them.
    #[arg(long, default_value = "copied", value_parser = parse_weighing)]
    weighing: Weighing,
    /// Also write sources.json into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

fn parse_weighing(s: &str) -> std::result::Result<Weighing, String> {
    match s {
        "copied" => Ok(Weighing::Copied),
        "mass" => Ok(Weighing::Mass),
        _ => Err(format!("bad weighing \"{s}\": copied or mass")),
    }
}

pub fn eval_sources(common: &Common, a: SourcesArgs) -> Result<()> {
    let engine = Arc::new(common.engine()?);
    let model_dir = engine.model_dir().to_owned();
    let spec = EvalSpec::load(&model_dir)?;
    let samples = a.samples.clone().unwrap_or_else(|| model_dir.join("../../SAMPLES.md"));
    let table = std::fs::read_to_string(&samples)
        .with_context(|| format!("reading the questions from {} (give --samples)", samples.display()))?;
    let questions = sources::sample_questions(&table)?;
    engine.config().check_fits(a.length)?;
    let tier = if a.offload { Tier::Offloaded } else { Tier::Resident };
    for m in &a.methods {
        m.spec()?.check_tier(tier)?;
    }
    let doc = sources::fact_document(&engine, &spec, &questions, a.length, a.seed)?;
    let temp = tempfile::tempdir()?;
    let path = a.context.clone().unwrap_or_else(|| temp.path().join("sources.folio"));
    let checksum = folio_models::context::format::checksum(doc.text.as_bytes());
    // Reused only when it is this run's document, prefilled by this model and these weights.
    let ours = |f: &ContextFile| matches!(engine.check_context(f), Ok(folio_models::engine::ContextModel::Same));
    let reused = ContextFile::open(&path)
        .ok()
        .filter(|f| f.documents().len() == 1 && f.documents()[0].xxh3 == checksum && ours(f));
    let was_reused = reused.is_some();
    if !was_reused && path.exists() {
        eprintln!("{} holds another document's or model's context: prefilling it again", path.display());
    }
    let started = Instant::now();
    let file = match reused {
        Some(f) => f,
        None => {
            if !a.json {
                eprintln!("prefilling {} tokens into {} …", a.length, path.display());
            }
            sources::prefill(&engine, &doc, &path, None)?
        }
    };
    let prefill_seconds = started.elapsed().as_secs_f64();
    let tokens = file.tokens().len();
    if !a.json {
        let how =
            if was_reused { "the saved context reused".to_owned() } else { format!("prefill {prefill_seconds:.1} s") };
        println!("{} tokens, {} facts, {} questions; {how}", tokens, doc.facts.len(), questions.len());
        println!("{:<10} {:<6} {:<6} {:>5}  question", "method", "answer", "first", "rank");
    }
    let json = a.json;
    let rows =
        sources::run(&engine, Arc::new(file), tier, &questions, &a.methods, a.weighing, &mut |r: &SourcesRow| {
            if !json {
                let rank = r.fact_rank.map_or("-".to_owned(), |n| n.to_string());
                let mark = |ok: bool| if ok { "ok" } else { "MISS" };
                println!(
                    "{:<10} {:<6} {:<6} {rank:>5}  {}",
                    r.method,
                    mark(r.answered),
                    mark(r.first_holds_fact),
                    r.question
                );
            }
        })?;
    let per_method: Vec<serde_json::Value> = a
        .methods
        .iter()
        .map(|m| {
            let mine: Vec<&SourcesRow> = rows.iter().filter(|r| r.method == m.to_string()).collect();
            json!({
                "method": m.to_string(),
                "answered": mine.iter().filter(|r| r.answered).count(),
                "first_holds_fact": mine.iter().filter(|r| r.first_holds_fact).count(),
                "questions": mine.len(),
            })
        })
        .collect();
    let report = json!({
        "eval": "sources",
        "model": engine.name,
        "device": common.device_label()?,
        "length": a.length,
        "context_tokens": tokens,
        "seed": a.seed,
        "tier": tier,
        "weighing": a.weighing,
        "prefill_seconds": prefill_seconds,
        "reused_context": was_reused,
        "summary": per_method,
        "rows": rows,
    });
    if !a.json {
        for m in &per_method {
            println!(
                "{}: answered {}/{}, first passage holds the fact {}/{}",
                m["method"].as_str().unwrap_or_default(),
                m["answered"],
                m["questions"],
                m["first_holds_fact"],
                m["questions"]
            );
        }
    }
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        super::write_file(&dir.join("sources.json"), serde_json::to_string_pretty(&report)?)?;
    }
    if a.json {
        println!("{report}");
    }
    if rows.iter().any(|r| !r.first_holds_fact) {
        bail!(
            "{} of {} answers' first source passage does not hold the fact",
            rows.iter().filter(|r| !r.first_holds_fact).count(),
            rows.len()
        );
    }
    Ok(())
}
