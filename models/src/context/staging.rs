//! Staging: what a set of documents would make as a context — each document with its type,
//! size and tokens, each skip with its reason, the total against the model's context length,
//! and the file, memory and time a prefill needs — before anything is prefilled. The window's
//! staging sheet shows it; `folio prefill --dry-run` prints it. The product reads the files
//! (folio-ingest) and hands the texts here: counting and estimating are the engine's, so the
//! sheet's figures are the ones the prefill will meet.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use folio_context_file::format::{DocumentSpan, Header, PromptStamp, SpanPart};
use folio_context_file::KvDtype;

use super::answers::{self, AnswerCost};
use super::builder::Planned;
use super::cost::PrefillCost;
use super::prompt::{DocumentText, TokenCount, ANSWER_ROOM};
use crate::error::Result;
use crate::prefill::PrefillMode;
use crate::Engine;

/// One document as the sheet lists it (and as `start_prefill` gets it back).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct StagedDocument {
    pub path: String,
    pub title: String,
    /// Its type, from its content ("PDF", "DOCX", "text").
    pub kind: String,
    /// Bytes of its text (what the context's span records).
    pub bytes: u64,
    /// Bytes of the file on disk.
    #[serde(default)]
    pub file_bytes: u64,
    pub xxh3: String,
    pub tokens: usize,
    /// Labels of the pages, chapters or sections found in it.
    #[serde(default)]
    pub parts: Vec<String>,
    /// What the reader and the count noticed (an encoding guessed, bytes replaced, words the
    /// model does not know).
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// Share of a document's tokens that are the tokenizer's unknown token past which staging
/// warns: a quarter of the text unreadable to the model (digits and punctuation, which every
/// vocabulary has, dilute the share of unknown words).
const UNKNOWN_SHARE_WARNING: f64 = 0.25;
/// Bytes of text per token past which staging warns (prose is 3–6): a file of one repeated
/// character, or of text the tokenizer swallows whole.
const BYTES_PER_TOKEN_WARNING: usize = 200;
/// Texts shorter than this are not warned about for shrinking (a short code or list).
const SHRINK_FLOOR_BYTES: usize = 4096;

/// Warnings about a document's token count: mostly unknown words, or a text that shrank by
/// orders of magnitude.
fn count_warnings(text_bytes: usize, count: TokenCount) -> Vec<String> {
    let mut warnings = Vec::new();
    let unknown = count.unknown as f64 / count.tokens.max(1) as f64;
    if unknown > UNKNOWN_SHARE_WARNING {
        warnings.push(format!(
            "{:.0}% of its tokens are unknown to this model's tokenizer: the model will read them as <unk>",
            unknown * 100.0
        ));
    }
    warnings.extend(shrink_warning(text_bytes, count.tokens));
    warnings
}

/// The warning for a text that became orders of magnitude fewer tokens than prose would: the
/// same words in the staging sheet, `--dry-run` and the prefill itself.
pub fn shrink_warning(text_bytes: usize, tokens: usize) -> Option<String> {
    (text_bytes >= SHRINK_FLOOR_BYTES && text_bytes > BYTES_PER_TOKEN_WARNING * tokens).then(|| {
        format!(
            "{} of text became only {tokens} tokens: is it one repeated character or word?",
            crate::error::human_bytes(text_bytes as u64)
        )
    })
}

#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Skip {
    pub path: String,
    pub reason: String,
}

/// What staging found.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Staged {
    pub documents: Vec<StagedDocument>,
    pub skipped: Vec<Skip>,
    /// Tokens before the documents (chat template head or BOS).
    pub head_tokens: usize,
    /// Seconds the count took.
    pub seconds: f64,
}

/// What a prefill of staged documents needs, for the sheet's summary.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Estimate {
    /// Tokens in the context file.
    pub tokens: usize,
    /// Tokens the prefill computes (fewer than `tokens` when a change keeps saved ones).
    pub computed_tokens: usize,
    /// Most tokens the context may hold (its head and documents): the model's context length
    /// less [`ANSWER_ROOM`], kept for the question and the answer.
    pub limit: usize,
    /// The model's context length.
    pub context_length: usize,
    pub fits: bool,
    pub file_bytes: u64,
    /// Memory the prefill uses beyond the model weights.
    pub working_set_bytes: u64,
    /// Scratch space on disk while it runs (hidden states between layers).
    pub scratch_bytes: u64,
    /// Free space where the context will be written.
    pub disk_free_bytes: Option<u64>,
    /// Seconds the prefill ([`Estimate::prefill`]) is predicted to take, by the cost fitted to
    /// the last prefill of its kind with this model on this device (none before one).
    pub predicted_seconds: Option<f64>,
    /// The tokens computed over the predicted seconds: the prediction's average speed.
    pub rate_tokens_per_s: Option<f64>,
    /// The prefill the memory and time above are for (`dense`, or `sparse:` and its knobs).
    pub prefill: String,
    /// Each prefill this model can run, the one above first: its memory, its time and what it
    /// was measured to cost in answers (the sheet's choice).
    pub choices: Vec<PrefillChoice>,
}

/// One prefill the staged documents can be made with.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct PrefillChoice {
    /// `dense`, or `sparse:` and its knobs, as `--prefill` reads it.
    pub prefill: String,
    /// Earlier keys a token reads at most (a sparse prefill's; `None`: every one).
    pub keys_per_row: Option<usize>,
    /// Memory it uses beyond the model weights.
    pub working_set_bytes: u64,
    /// Seconds it is predicted to take, by the cost fitted to the last prefill of this kind
    /// with this model on this device (none before one: a sparse prefill's time is not a
    /// dense one's, so each kind is measured once).
    pub predicted_seconds: Option<f64>,
    pub rate_tokens_per_s: Option<f64>,
    /// What it was measured to cost in answers on this model, by context length (empty for
    /// dense — the reference — and where it was not measured).
    pub answers: Vec<AnswerCost>,
}

/// The prefills a sheet offers for `engine`'s model, `first` first: dense and the default
/// sparse one (none sparse for a sliding-window model, which refuses it).
pub fn prefill_modes(engine: &Engine, first: PrefillMode) -> Vec<PrefillMode> {
    let mut modes = vec![first, PrefillMode::Dense, PrefillMode::SPARSE];
    modes.retain(|m| m.check(engine.config(), &engine.name).is_ok());
    let mut seen = Vec::new();
    modes.retain(|m| {
        let new = !seen.contains(m);
        seen.push(*m);
        new
    });
    modes
}

/// What a reader noticed about a document beside its text.
#[derive(Debug, Clone)]
pub struct ReadNotes {
    /// Its type, from its content ("PDF", "DOCX", "text").
    pub kind: String,
    /// Bytes of the file on disk.
    pub file_bytes: u64,
    pub warnings: Vec<String>,
}

/// Counts the tokens of documents the caller has read (`notes` beside each, in order; the
/// reader's skips in `skipped`), as a context of `engine` will lay them out, in parallel;
/// `on_counted(documents_done)` follows the count. A count that fails skips every document
/// with its reason. `started` is when the caller began reading, for [`Staged::seconds`].
pub fn count(
    engine: &Engine,
    documents: &[DocumentText],
    notes: &[ReadNotes],
    mut skipped: Vec<Skip>,
    started: Instant,
    on_counted: &(dyn Fn(usize) + Sync),
) -> Staged {
    let head = engine.prompt_stamp(None, None).and_then(|p| engine.head_ids(&p)).map(|ids| ids.len());
    let (documents, head_tokens) = match (engine.document_tokens(documents, on_counted), head) {
        (Ok(counts), Ok(head)) => {
            let docs = documents
                .iter()
                .zip(notes)
                .zip(counts)
                .map(|((d, notes), count)| StagedDocument {
                    kind: notes.kind.clone(),
                    path: d.path.clone(),
                    title: d.title.clone(),
                    bytes: d.bytes,
                    file_bytes: notes.file_bytes,
                    xxh3: d.xxh3.clone(),
                    tokens: count.tokens,
                    parts: d.parts.iter().map(|p| p.label.clone()).collect(),
                    warnings: notes.warnings.iter().cloned().chain(count_warnings(d.text.len(), count)).collect(),
                })
                .collect();
            (docs, head)
        }
        (Err(e), _) | (_, Err(e)) => {
            skipped.extend(documents.iter().map(|d| Skip { path: d.path.clone(), reason: e.to_string() }));
            (Vec::new(), 0)
        }
    };
    Staged { documents, skipped, head_tokens, seconds: started.elapsed().as_secs_f64() }
}

/// Each prefill to estimate, the one the estimate's own figures are for first, with the cost
/// fitted to the last prefill of its kind here (none before one).
pub type Choices<'a> = &'a [(PrefillMode, Option<PrefillCost>)];

/// What a prefill of `documents` (as staged) with `engine`, stored as `kv_dtype`, into
/// `folder` needs, for each of `choices`: the layout is the one `plan_context` will make (head, spans), so the file
/// size is exact (but for a page more or less when the parts' token positions, which only the
/// prefill knows, change the document table's length across a page boundary).
pub fn estimate(
    engine: &Engine,
    documents: &[StagedDocument],
    kv_dtype: KvDtype,
    folder: &Path,
    choices: Choices<'_>,
) -> Result<Estimate> {
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
            kind: d.kind.clone(),
            // Where each part starts is known once the prefill tokenizes the document: the
            // span's start stands in (as many digits, give or take one per part).
            parts: d.parts.iter().map(|label| SpanPart { label: label.clone(), start: tokens }).collect(),
        });
        tokens += d.tokens;
    }
    let layout = Layout { tokens, computed: tokens, spans: &spans, prompt };
    estimate_layout(engine, &layout, kv_dtype, folder, choices)
}

/// A context file's layout as a prefill will write it.
pub struct Layout<'a> {
    /// Tokens in the file.
    pub tokens: usize,
    /// Tokens the prefill computes: all of them, or those after what a change keeps.
    pub computed: usize,
    pub spans: &'a [DocumentSpan],
    pub prompt: PromptStamp,
}

/// What a prefill writing `layout` needs (the file's exact size, disk; memory and time for each
/// of `choices`, with each sparse one's measured cost in answers).
pub fn estimate_layout(
    engine: &Engine,
    layout: &Layout<'_>,
    kv_dtype: KvDtype,
    folder: &Path,
    choices: Choices<'_>,
) -> Result<Estimate> {
    let cfg = engine.config();
    let limit = cfg.max_position_embeddings.saturating_sub(ANSWER_ROOM);
    let shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
    let tokens = layout.tokens;
    let spans_bytes = serde_json::to_vec(layout.spans).map_or(0, |j| j.len() as u64);
    let file_bytes =
        Header::new(engine.stamp()?.clone(), kv_dtype, tokens.max(1), spans_bytes, shape, layout.prompt.clone())
            .file_bytes;
    let section = kv_dtype.max_section_bytes(cfg.num_kv_heads * tokens.max(1), cfg.head_dim);
    let scratch_bytes = 2 * (layout.computed * cfg.hidden_size * engine.model.dtype().size_in_bytes()) as u64;
    let choices = choices
        .iter()
        .map(|(mode, cost)| {
            let working_set_bytes = crate::prefill::plan_chunk(&engine.model, tokens.max(1), (section, *mode), None)
                .map(|p| p.working_set)
                .unwrap_or(0);
            let predicted = cost.map(|c| c.seconds(cfg.num_layers, tokens - layout.computed, tokens));
            let prefill = mode.name();
            PrefillChoice {
                answers: match mode {
                    PrefillMode::Dense => Vec::new(),
                    // A measurement file that does not read costs its rows, not the estimate.
                    PrefillMode::Sparse(_) => answers::measured(engine, &prefill).unwrap_or_else(|e| {
                        eprintln!("folio: {e}; the sparse prefill's cost in answers is not shown");
                        Vec::new()
                    }),
                },
                prefill,
                keys_per_row: match mode {
                    PrefillMode::Dense => None,
                    PrefillMode::Sparse(p) => Some(p.keys_per_row()),
                },
                working_set_bytes,
                predicted_seconds: predicted,
                rate_tokens_per_s: predicted.filter(|s| *s > 0.0).map(|s| layout.computed as f64 / s),
            }
        })
        .collect::<Vec<_>>();
    let first = choices.first().cloned().unwrap_or(PrefillChoice {
        prefill: PrefillMode::Dense.name(),
        keys_per_row: None,
        working_set_bytes: 0,
        predicted_seconds: None,
        rate_tokens_per_s: None,
        answers: Vec::new(),
    });
    let _ = std::fs::create_dir_all(folder);
    Ok(Estimate {
        tokens,
        computed_tokens: layout.computed,
        limit,
        context_length: cfg.max_position_embeddings,
        fits: tokens <= limit,
        file_bytes,
        working_set_bytes: first.working_set_bytes,
        scratch_bytes,
        disk_free_bytes: fs4::available_space(folder).ok(),
        predicted_seconds: first.predicted_seconds,
        rate_tokens_per_s: first.rate_tokens_per_s,
        prefill: first.prefill,
        choices,
    })
}

/// What the prefill of a planned change needs (see [`estimate_layout`]): the new file's
/// tokens, and only those after what it keeps computed.
pub fn estimate_planned(
    engine: &Engine,
    planned: &Planned,
    kv_dtype: KvDtype,
    folder: &Path,
    choices: Choices<'_>,
) -> Result<Estimate> {
    let layout = Layout {
        tokens: planned.plan.tokens.len(),
        computed: planned.computed(),
        spans: &planned.plan.documents,
        prompt: planned.plan.prompt.clone(),
    };
    estimate_layout(engine, &layout, kv_dtype, folder, choices)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo() -> Engine {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");
        Engine::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap()
    }

    fn text(path: &str, text: String) -> DocumentText {
        DocumentText {
            title: path.rsplit('/').next().unwrap_or(path).into(),
            path: path.into(),
            bytes: text.len() as u64,
            xxh3: folio_context_file::format::checksum(text.as_bytes()),
            kind: "text".into(),
            text,
            parts: Vec::new(),
        }
    }

    /// The sheet's counts are the prefill's: head plus per-document tokens equal the planned
    /// context's length, and each document's count its span; a total past the model's context
    /// length is flagged (the sheet refuses it).
    #[test]
    fn staged_counts_are_the_planned_tokens_and_the_limit_is_flagged() {
        let e = demo();
        let samples = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/samples");
        let docs: Vec<DocumentText> = ["field_notes.txt", "market_records.txt", "the_diary_of_greta.txt"]
            .iter()
            .map(|name| {
                let path = format!("{samples}/{name}");
                text(&path, std::fs::read_to_string(&path).unwrap())
            })
            .collect();
        let notes: Vec<ReadNotes> =
            docs.iter().map(|d| ReadNotes { kind: "text".into(), file_bytes: d.bytes, warnings: Vec::new() }).collect();
        let staged = count(&e, &docs, &notes, Vec::new(), Instant::now(), &|_| {});
        assert_eq!(staged.documents.len(), 3);
        let plan = e.plan_context(&docs, None, None).unwrap();
        let total: usize = staged.head_tokens + staged.documents.iter().map(|d| d.tokens).sum::<usize>();
        assert_eq!(total, plan.tokens.len());
        for (d, span) in staged.documents.iter().zip(&plan.documents) {
            assert_eq!(d.tokens, span.end - span.start, "{}", d.title);
        }
        let dir = tempfile::tempdir().unwrap();
        let fits = estimate(&e, &staged.documents, KvDtype::Bf16, dir.path(), &[(PrefillMode::Dense, None)]).unwrap();
        assert!(fits.fits && fits.tokens == total && fits.predicted_seconds.is_none());
        let mut huge = staged.documents[0].clone();
        huge.tokens = fits.limit;
        // The time is the cost's: every layer over every token, attention's pairs included.
        let cost = PrefillCost { per_token: 1e-4, per_pair: 1e-9 };
        let sparse_cost = PrefillCost { per_token: 3e-4, per_pair: 1e-10 };
        let modes = prefill_modes(&e, PrefillMode::Dense);
        let choices: Vec<_> = modes.iter().zip([cost, sparse_cost]).map(|(m, c)| (*m, Some(c))).collect();
        let over = estimate(&e, &[huge], KvDtype::Bf16, dir.path(), &choices).unwrap();
        assert!(!over.fits);
        let layers = e.config().num_layers;
        assert!((over.predicted_seconds.unwrap() - cost.seconds(layers, 0, over.tokens)).abs() < 1e-9);
        // Each choice is timed by its own cost, and the first one's figures are the estimate's.
        assert_eq!(over.choices.len(), 2);
        assert_eq!((over.prefill.as_str(), over.choices[0].prefill.as_str()), ("dense", "dense"));
        let sparse = &over.choices[1];
        assert_eq!(sparse.prefill, PrefillMode::SPARSE.name());
        assert!((sparse.predicted_seconds.unwrap() - sparse_cost.seconds(layers, 0, over.tokens)).abs() < 1e-9);
        assert!(over.choices[0].answers.is_empty(), "dense is the reference: it has no cost in answers");
        // The demo model ships what its sparse prefill was measured to cost (for its weights).
        assert!(
            sparse.answers.iter().any(|a| a.length == 131072),
            "assets/models/demo/prefill_answers.json for these weights (`folio eval prefill-cost --record`)"
        );
    }

    /// A 20 MB file of one repeated letter (the demo model's tokenizer makes a handful of
    /// tokens of it) and a text of words the model lacks are warned about; prose is not.
    #[test]
    fn shrunk_or_unknown_text_is_warned_about() {
        let e = demo();
        let doc = |t: String| text("t.txt", t);
        let docs = [
            doc("a".repeat(20 << 20)),
            doc("zebra quokka axolotl narwhal ".repeat(50)),
            doc(std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/samples/field_notes.txt"))
                .unwrap()),
        ];
        let counts = e.document_tokens(&docs, &|_| {}).unwrap();
        let warnings: Vec<Vec<String>> =
            docs.iter().zip(counts).map(|(d, c)| count_warnings(d.text.len(), c)).collect();
        assert!(warnings[0].iter().any(|w| w.starts_with("20.0 MiB of text became only")), "{warnings:?}");
        assert!(warnings[1].iter().any(|w| w.contains("unknown to this model's tokenizer")), "{warnings:?}");
        assert!(warnings[2].is_empty(), "{warnings:?}");
    }
}
