//! What the library keeps with an answer, and what the window reads back: the method and its
//! full settings, the generation settings and the answer's tokens (what a comparison with
//! dense replays), timings, the documents read, where each layer's index came from, the
//! context version, and the comparison with dense once made.
//!
//! Why a struct and not JSON built in place: the window reads these fields (sources, timings,
//! the comparison), and its TypeScript type is generated from this one (gui::bindings), so a
//! field renamed here fails the bindings test instead of showing `undefined` in a screen. The
//! library stores it as JSON text; answers saved by an earlier Folio lack the later fields
//! (`answer_tokens`, `context`, `index`, `generation`), which read as absent — and a record
//! that does not parse at all leaves its message readable without details.

use std::collections::BTreeMap;

use folio_library::MessageRow;
use folio_models::attention::{IndexSource, MethodChoice};
use folio_models::context::{PrefillRun, DENSE_PREFILL};
use folio_models::generate::StopReason;
use folio_models::session::{Answer, Comparison, DocumentRead, GenerationSettings, Timings};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, ts_rs::TS)]
pub(super) struct AnswerDetails {
    /// The method as asked for.
    pub method: MethodChoice,
    /// Its full settings: budget resolved, every knob.
    #[ts(type = "{ method: string; budget?: unknown; params?: Record<string, unknown> }")]
    pub settings: serde_json::Value,
    #[serde(default)]
    pub generation: Option<GenerationSettings>,
    /// The answer's token ids (what a comparison with dense replays).
    #[serde(default)]
    pub answer_tokens: Option<Vec<u32>>,
    pub stop_reason: StopReason,
    pub tokens: usize,
    pub timings: Timings,
    /// Documents read, most first.
    #[serde(default)]
    pub sources: Vec<DocumentRead>,
    /// Where each layer's index came from (methods with one).
    #[serde(default)]
    pub index: BTreeMap<usize, IndexSource>,
    /// The id of the context version the answer read (its sources' positions refer to it).
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub reused_tokens: usize,
    /// How the context's tokens were prefilled where not densely (`sparse:KNOBS over tokens
    /// 0–7210`, each such run); `None` for a dense prefill, a bare chat, or an earlier record.
    #[serde(default)]
    pub prefill: Option<String>,
    /// Its comparison with dense attention, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[ts(optional)]
    pub comparison: Option<Comparison>,
}

impl AnswerDetails {
    /// The details of `answer`, made with `generation` over a context prefilled as `prefill`
    /// says (its file's runs; none for a bare chat).
    pub fn of(answer: &Answer, generation: &GenerationSettings, prefill: &[PrefillRun]) -> Self {
        let sparse: Vec<String> = prefill
            .iter()
            .filter(|r| r.mode != DENSE_PREFILL)
            .map(|r| format!("{} over tokens {}–{}", r.mode, r.from, r.to))
            .collect();
        Self {
            method: answer.method.clone(),
            settings: answer.settings.clone(),
            generation: Some(generation.clone()),
            answer_tokens: Some(answer.tokens.clone()),
            stop_reason: answer.stop_reason,
            tokens: answer.tokens.len(),
            timings: answer.timings.clone(),
            sources: answer.sources.clone(),
            index: answer.index.clone(),
            context: answer.context.clone(),
            reused_tokens: answer.reused_tokens,
            prefill: (!sparse.is_empty()).then(|| sparse.join("; ")),
            comparison: None,
        }
    }

    /// A stored record, or `None` when it does not parse (the message stays readable).
    pub fn read(stored: &serde_json::Value) -> Option<Self> {
        serde_json::from_value(stored.clone()).ok()
    }
}

/// A saved message as the window shows it.
#[derive(Debug, Clone, Serialize, ts_rs::TS)]
pub(super) struct ChatMessage {
    pub position: u64,
    #[ts(type = "'user' | 'assistant'")]
    pub role: String,
    pub content: String,
    /// How an answer was made; `None` for a question, or a record this Folio cannot read.
    pub details: Option<AnswerDetails>,
    pub created_at: String,
}

impl From<MessageRow> for ChatMessage {
    fn from(row: MessageRow) -> Self {
        let details = row.details.as_ref().and_then(AnswerDetails::read);
        Self { position: row.position, role: row.role, content: row.content, details, created_at: row.created_at }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer saved before `answer_tokens`, `context`, `index` and `generation` were kept
    /// (the shape of an earlier Folio's record) reads, with those absent; a record missing what
    /// every Folio wrote reads as no details rather than failing the chat.
    #[test]
    fn earlier_records_read() {
        let old = serde_json::json!({
            "method": {"method": "hip", "budget": "2048", "params": []},
            "settings": {"method": "hip", "budget": 2048},
            "stop_reason": "eos",
            "tokens": 3,
            "timings": {"first_token_s": 0.5, "seconds": 1.0, "decode_tokens_per_s": 4.0},
            "sources": [{"document": 0, "title": "a", "path": "/a.txt", "rows": 10.0, "share": 1.0}],
        });
        let d = AnswerDetails::read(&old).expect("an earlier record reads");
        assert_eq!((d.answer_tokens, d.context, d.index.len()), (None, None, 0));
        assert_eq!((d.sources[0].mass_share, d.sources[0].passages.len()), (None, 0));
        assert!(AnswerDetails::read(&serde_json::json!({"method": "hip"})).is_none());
    }
}
