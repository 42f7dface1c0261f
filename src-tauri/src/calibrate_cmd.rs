//! `folio calibrate`: Double Sparsity's offline channel calibration for a model, written next
//! to the model (see folio_models::calibrate for the statistic and why it is per KV head).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;

use folio_models::calibrate::{self, BLOCK, DEFAULT_BLOCKS};

use crate::cli::Common;
use crate::ingest;

/// Channels shown per (layer, KV head) in the summary.
const SHOWN: usize = 8;

#[derive(Args)]
pub struct CalibrateArgs {
    /// Text documents (files or folders) to measure on; any ordinary prose works.
    #[arg(long, num_args = 1.., required = true)]
    docs: Vec<PathBuf>,
    /// At most this many 512-token blocks.
    #[arg(long, default_value_t = DEFAULT_BLOCKS)]
    max_blocks: usize,
    #[arg(long)]
    json: bool,
}

pub fn calibrate(common: &Common, a: CalibrateArgs) -> Result<()> {
    if a.max_blocks == 0 {
        bail!("--max-blocks must be at least 1");
    }
    let engine = common.engine()?;
    let ingested = ingest::collect(&a.docs)?;
    for (path, why) in &ingested.skipped {
        eprintln!("skipped {}: {why}", path.display());
    }
    let docs = ingested
        .documents
        .iter()
        .map(|d| Ok((d.path.clone(), engine.tokenizer.encode_text(&d.text)?)))
        .collect::<Result<Vec<_>>>()?;
    let cal = calibrate::calibrate(&engine, &docs, a.max_blocks, |i, n| {
        if !a.json {
            eprint!("\rcalibrating: block {i}/{n} ({BLOCK} tokens each)");
        }
    })?;
    if !a.json {
        eprintln!();
    }
    let path = cal.save(engine.model_dir())?;
    let top: Vec<Vec<Vec<u16>>> = cal
        .channels
        .order
        .iter()
        .map(|l| l.iter().map(|h| h.iter().take(SHOWN).copied().collect()).collect())
        .collect();
    if a.json {
        println!(
            "{}",
            json!({ "file": path, "tokens": cal.tokens, "documents": cal.documents.len(), "top_channels": top })
        );
    } else {
        println!("wrote {} ({} tokens from {} documents)", path.display(), cal.tokens, cal.documents.len());
        for (l, heads) in top.iter().enumerate() {
            let s: Vec<String> = heads.iter().enumerate().map(|(h, c)| format!("kv{h} {c:?}")).collect();
            println!("layer {l}: top channels {}", s.join(", "));
        }
    }
    Ok(())
}
