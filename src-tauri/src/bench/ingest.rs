//! `folio bench ingest --docs PATH...`: how fast documents are staged — read (extracted by
//! `folio_ingest`, files in parallel) and counted (tokenized by the model's tokenizer, in
//! parallel) — per format and for the whole set, in documents/s, MB/s (of files on disk) and
//! tokens/s. The whole set's rate is projected to the yardstick: a mixed collection of
//! a million tokens.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use folio_models::Engine;
use serde::Serialize;

use crate::cli::Common;
use crate::ingest;

/// Tokens of the collection the projection is for.
const PROJECTED_TOKENS: f64 = 1e6;

#[derive(Args)]
pub struct IngestBenchArgs {
    /// Files and folders to stage (as `folio prefill --docs`).
    #[arg(long, num_args = 1.., required = true)]
    docs: Vec<PathBuf>,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
}

/// One row of the table: a format, or the whole set.
#[derive(Serialize)]
struct Row {
    format: String,
    documents: usize,
    file_bytes: u64,
    tokens: usize,
    read_s: f64,
    count_s: f64,
}

impl Row {
    fn seconds(&self) -> f64 {
        (self.read_s + self.count_s).max(1e-9)
    }
}

/// Reads and counts `paths`, timing each phase.
fn stage(engine: &Engine, paths: &[PathBuf], format: String) -> Result<(Row, ingest::Ingested)> {
    let at = Instant::now();
    let found = ingest::collect_lenient(paths, &|_, _| {});
    let read_s = at.elapsed().as_secs_f64();
    let at = Instant::now();
    let counts = engine.document_tokens(&found.documents, &|_| {})?;
    let count_s = at.elapsed().as_secs_f64();
    let row = Row {
        format,
        documents: found.documents.len(),
        file_bytes: found.notes.iter().map(|n| n.file_bytes).sum(),
        tokens: counts.iter().map(|c| c.tokens).sum(),
        read_s,
        count_s,
    };
    Ok((row, found))
}

pub fn bench_ingest(common: &Common, a: IngestBenchArgs) -> Result<()> {
    let engine = common.engine()?;
    let (all, found) = stage(&engine, &a.docs, "all".into())?;
    if all.documents == 0 {
        bail!("no readable documents in {} ({} skipped)", a.docs.len(), found.skipped.len());
    }
    let mut by_format: BTreeMap<&str, Vec<PathBuf>> = BTreeMap::new();
    for (d, notes) in found.documents.iter().zip(&found.notes) {
        by_format.entry(notes.format.name()).or_default().push(folio_context_file::os_path::from_stored(&d.path));
    }
    let mut rows = Vec::new();
    for (format, paths) in by_format {
        rows.push(stage(&engine, &paths, format.to_owned())?.0);
    }
    let projected_s = PROJECTED_TOKENS / all.tokens as f64 * all.seconds();
    if a.json {
        let json = serde_json::json!({
            "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "formats": rows, "all": all, "skipped": found.skipped.len(),
            "projected_1m_tokens_s": projected_s,
        });
        println!("{json}");
        return Ok(());
    }
    println!(
        "{:<10} {:>6} {:>10} {:>10} {:>8} {:>8} {:>9} {:>8} {:>11}",
        "format", "docs", "MB", "tokens", "read s", "count s", "docs/s", "MB/s", "tokens/s"
    );
    for r in rows.iter().chain(std::iter::once(&all)) {
        let mb = r.file_bytes as f64 / 1e6;
        println!(
            "{:<10} {:>6} {:>10.2} {:>10} {:>8.3} {:>8.3} {:>9.1} {:>8.2} {:>11.0}",
            r.format,
            r.documents,
            mb,
            r.tokens,
            r.read_s,
            r.count_s,
            r.documents as f64 / r.seconds(),
            mb / r.seconds(),
            r.tokens as f64 / r.seconds()
        );
    }
    println!(
        "{} skipped; {} threads; a mixed collection of 1M tokens at this rate: {projected_s:.1} s to stage",
        found.skipped.len(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    Ok(())
}
