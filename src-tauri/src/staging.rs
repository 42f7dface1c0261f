//! Staging: what a set of files and folders would make as a context — each document with its
//! type, size and tokens, each skip with its reason, the total against the model's context
//! length, and the file, memory and time a prefill needs — before anything is prefilled. The
//! window's staging sheet shows it (counting off the UI thread, in parallel, with progress);
//! `folio prefill --dry-run` prints it.

use std::path::{Path, PathBuf};

use folio_models::context::format::{DocumentSpan, Header};
use folio_models::context::prompt::ANSWER_ROOM;
use folio_models::context::KvDtype;
use folio_models::Engine;
use serde::{Deserialize, Serialize};

use crate::ingest;

/// How contexts store K/V unless told otherwise (the window's, and `folio prefill`'s default).
pub(crate) const DEFAULT_KV_DTYPE: KvDtype = KvDtype::Bf16;

/// One document as the sheet lists it (and as `start_prefill` gets it back).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StagedDocument {
    pub path: String,
    pub title: String,
    /// Its type, from the extension.
    pub kind: String,
    pub bytes: u64,
    pub xxh3: String,
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Skip {
    pub path: String,
    pub reason: String,
}

/// What staging found.
#[derive(Debug, Serialize)]
pub(crate) struct Staged {
    pub documents: Vec<StagedDocument>,
    pub skipped: Vec<Skip>,
    /// Tokens before the documents (chat template head or BOS).
    pub head_tokens: usize,
    /// Seconds the count took.
    pub seconds: f64,
}

/// What a prefill of staged documents needs, for the sheet's summary.
#[derive(Debug, Serialize)]
pub(crate) struct Estimate {
    /// Tokens in the context file.
    pub tokens: usize,
    /// Tokens the prefill computes (fewer than `tokens` when a change keeps saved ones).
    pub computed_tokens: usize,
    /// Most tokens the documents may take: the model's context length less room to answer.
    pub limit: usize,
    pub fits: bool,
    pub file_bytes: u64,
    /// Memory the prefill uses beyond the model weights.
    pub working_set_bytes: u64,
    /// Scratch space on disk while it runs (hidden states between layers).
    pub scratch_bytes: u64,
    /// Free space where the context will be written.
    pub disk_free_bytes: Option<u64>,
    /// Seconds at `rate`, when a prefill with this model on this device was measured.
    pub predicted_seconds: Option<f64>,
    pub rate_tokens_per_s: Option<f64>,
}

/// Reads and counts `paths`; `on_counted(done, total)` follows the count.
pub(crate) fn stage(engine: &Engine, paths: &[PathBuf], on_counted: &(dyn Fn(usize, usize) + Sync)) -> Staged {
    let started = std::time::Instant::now();
    let found = ingest::collect_lenient(paths);
    let total = found.documents.len();
    let mut skipped: Vec<Skip> =
        found.skipped.iter().map(|(p, r)| Skip { path: p.display().to_string(), reason: r.clone() }).collect();
    let head = engine.prompt_stamp(None, None).and_then(|p| engine.head_ids(&p)).map(|ids| ids.len());
    let (documents, head_tokens) =
        match (engine.document_tokens(&found.documents, &|done| on_counted(done, total)), head) {
            (Ok(counts), Ok(head)) => {
                let docs = found
                    .documents
                    .iter()
                    .zip(counts)
                    .map(|(d, tokens)| StagedDocument {
                        kind: Path::new(&d.path)
                            .extension()
                            .map_or_else(|| "txt".to_owned(), |e| e.to_string_lossy().to_lowercase()),
                        path: d.path.clone(),
                        title: d.title.clone(),
                        bytes: d.bytes,
                        xxh3: d.xxh3.clone(),
                        tokens,
                    })
                    .collect();
                (docs, head)
            }
            (Err(e), _) | (_, Err(e)) => {
                skipped.extend(found.documents.iter().map(|d| Skip { path: d.path.clone(), reason: e.to_string() }));
                (Vec::new(), 0)
            }
        };
    Staged { documents, skipped, head_tokens, seconds: started.elapsed().as_secs_f64() }
}

/// What a prefill of `documents` (as staged) with `engine`, stored as `kv_dtype`, into
/// `folder` needs: the layout is the one `plan_context` will make (head, spans), so the file
/// size is exact.
pub(crate) fn estimate(
    engine: &Engine,
    documents: &[StagedDocument],
    kv_dtype: KvDtype,
    folder: &Path,
    rate: Option<f64>,
) -> folio_models::Result<Estimate> {
    let prompt = engine.prompt_stamp(None, None)?;
    let mut tokens = engine.head_ids(&prompt)?.len();
    let mut spans = Vec::with_capacity(documents.len());
    for d in documents {
        spans.push(DocumentSpan {
            title: d.title.clone(),
            path: d.path.clone(),
            start: tokens,
            end: tokens + d.tokens,
            bytes: d.bytes,
            xxh3: d.xxh3.clone(),
        });
        tokens += d.tokens;
    }
    let layout = Layout { tokens, computed: tokens, spans: &spans, prompt };
    estimate_layout(engine, &layout, kv_dtype, folder, rate)
}

/// A context file's layout as a prefill will write it.
pub(crate) struct Layout<'a> {
    /// Tokens in the file.
    pub tokens: usize,
    /// Tokens the prefill computes: all of them, or those after what a change keeps.
    pub computed: usize,
    pub spans: &'a [DocumentSpan],
    pub prompt: folio_models::context::format::PromptStamp,
}

/// What a prefill writing `layout` needs (the file's exact size, memory, disk, time).
pub(crate) fn estimate_layout(
    engine: &Engine,
    layout: &Layout<'_>,
    kv_dtype: KvDtype,
    folder: &Path,
    rate: Option<f64>,
) -> folio_models::Result<Estimate> {
    let cfg = engine.config();
    let limit = cfg.max_position_embeddings.saturating_sub(ANSWER_ROOM);
    let shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
    let tokens = layout.tokens;
    let spans_bytes = serde_json::to_vec(layout.spans).map_or(0, |j| j.len() as u64);
    let file_bytes =
        Header::new(engine.stamp()?.clone(), kv_dtype, tokens.max(1), spans_bytes, shape, layout.prompt.clone())
            .file_bytes;
    let section = kv_dtype.max_section_bytes(cfg.num_kv_heads * tokens.max(1), cfg.head_dim);
    let working_set_bytes = folio_models::prefill::plan_chunk(&engine.model, tokens.max(1), section, None)
        .map(|p| p.working_set)
        .unwrap_or(0);
    let scratch_bytes = 2 * (layout.computed * cfg.hidden_size * engine.model.dtype().size_in_bytes()) as u64;
    let _ = std::fs::create_dir_all(folder);
    Ok(Estimate {
        tokens,
        computed_tokens: layout.computed,
        limit,
        fits: tokens <= limit,
        file_bytes,
        working_set_bytes,
        scratch_bytes,
        disk_free_bytes: fs4::available_space(folder).ok(),
        predicted_seconds: rate.filter(|r| *r > 0.0).map(|r| layout.computed as f64 / r),
        rate_tokens_per_s: rate,
    })
}

/// The settings key of the last measured prefill rate of a model on a device (written by
/// every prefill, the window's and the CLI's, read by the next estimate).
pub(crate) fn rate_key(engine: &Engine, device: &str) -> String {
    format!("prefill_rate/{}/{device}", engine.source)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo() -> Engine {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");
        Engine::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap()
    }

    /// The sheet's counts are the prefill's: head plus per-document tokens equal the planned
    /// context's length, and each document's count its span; a total past the model's context
    /// length is flagged (the sheet refuses it).
    #[test]
    fn staged_counts_are_the_planned_tokens_and_the_limit_is_flagged() {
        let e = demo();
        let samples = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/samples"));
        let staged = stage(&e, std::slice::from_ref(&samples), &|_, _| {});
        assert_eq!(staged.documents.len(), 3);
        let docs = ingest::collect(&[samples]).unwrap().documents;
        let plan = e.plan_context(&docs, None, None).unwrap();
        let total: usize = staged.head_tokens + staged.documents.iter().map(|d| d.tokens).sum::<usize>();
        assert_eq!(total, plan.tokens.len());
        for (d, span) in staged.documents.iter().zip(&plan.documents) {
            assert_eq!(d.tokens, span.end - span.start, "{}", d.title);
        }
        let dir = tempfile::tempdir().unwrap();
        let fits = estimate(&e, &staged.documents, DEFAULT_KV_DTYPE, dir.path(), None).unwrap();
        assert!(fits.fits && fits.tokens == total && fits.predicted_seconds.is_none());
        let mut huge = staged.documents[0].clone();
        huge.tokens = fits.limit;
        let over = estimate(&e, &[huge], DEFAULT_KV_DTYPE, dir.path(), Some(1000.0)).unwrap();
        assert!(!over.fits);
        assert!((over.predicted_seconds.unwrap() - over.tokens as f64 / 1000.0).abs() < 1e-9);
    }
}
