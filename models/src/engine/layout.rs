//! Documents laid out into a context's tokens for this model, and a question into the tokens
//! appended to a saved context: the model's chat template rendered around the documents, each
//! document wrapped by the model's document template ([`Engine::document_template`]), spans and
//! parts recorded so an answer's sources point back into the files. The types it returns
//! (`PrefixPlan`, `DocumentText`, the templates' defaults) are the context module's.

use serde_json::{Map, Value};

use super::Engine;
use crate::chat::Message;
use crate::context::{DocumentText, PrefixPlan, TokenCount, ANSWER_ROOM, DEFAULT_DOCUMENT_TEMPLATE};
use crate::error::{Error, Result};
use folio_context_file::format::{DocumentSpan, PromptKind, PromptStamp, SpanPart};
use folio_context_file::ContextFile;

/// The `format` of an eval_spec.json whose `document` section says how the model was trained
/// to read documents (folio-eval reads the rest of it).
const TRAINED_SPEC_FORMAT: &str = "folio-demo-eval-spec";
/// The newest version of that format this reader knows (a newer spec may wrap otherwise).
const TRAINED_SPEC_VERSION: u32 = 1;

/// Stands for the documents while the chat template is rendered (private-use characters, which
/// no template or question produces).
const DOCUMENTS_MARKER: &str = "\u{F8FF}folio-documents\u{F8FF}";

/// A part's label and the offset of its first token in the document's tokens.
type PartStart = (String, usize);

impl Engine {
    /// The template documents are wrapped with for this model: the `document` section of an
    /// `eval_spec.json` beside its weights (a model trained on Folio's retrieval task, such as
    /// the demo model, saw its documents wrapped that way), else [`DEFAULT_DOCUMENT_TEMPLATE`].
    pub fn document_template(&self) -> String {
        #[derive(serde::Deserialize)]
        struct Spec {
            format: String,
            version: u32,
            document: Wrapping,
        }
        #[derive(serde::Deserialize)]
        struct Wrapping {
            header: String,
            header_separator: String,
            document_separator: String,
        }
        let path = self.model_dir().join("eval_spec.json");
        let spec = std::fs::read_to_string(path).ok().and_then(|text| serde_json::from_str::<Spec>(&text).ok());
        match spec {
            Some(Spec { format, version, document: d })
                if format == TRAINED_SPEC_FORMAT && version <= TRAINED_SPEC_VERSION =>
            {
                format!("{}{}{{text}}{}", d.header, d.header_separator, d.document_separator)
            }
            _ => DEFAULT_DOCUMENT_TEMPLATE.to_owned(),
        }
    }

    /// Tokens of `docs` laid out for this model (inside its chat template when it has one),
    /// refused when they do not fit its context length with [`ANSWER_ROOM`] to spare.
    pub fn plan_context(
        &self,
        docs: &[DocumentText],
        system: Option<&str>,
        date: Option<String>,
    ) -> Result<PrefixPlan> {
        if docs.is_empty() {
            return Err(Error::Invalid("no documents to prefill".into()));
        }
        let prompt = self.prompt_stamp(system, date)?;
        let head = self.head_ids(&prompt)?;
        self.laid_out(prompt, head, Vec::new(), docs)
    }

    /// `docs` wrapped and tokenized after `tokens` (whose spans are `documents`), each its
    /// span; refused when a document is already there (same path and text) or when the whole
    /// does not fit the context length with [`ANSWER_ROOM`] to spare.
    fn laid_out(
        &self,
        prompt: PromptStamp,
        mut tokens: Vec<u32>,
        mut documents: Vec<DocumentSpan>,
        docs: &[DocumentText],
    ) -> Result<PrefixPlan> {
        for d in docs {
            if documents.iter().any(|s| s.path == d.path && s.xxh3 == d.xxh3) {
                return Err(Error::Invalid(format!("{} is already in this context", d.path)));
            }
            let start = tokens.len();
            let (ids, parts) = self.encode_document(&prompt.document_template, d)?;
            tokens.extend(ids);
            documents.push(DocumentSpan {
                title: d.title.clone(),
                path: d.path.clone(),
                start,
                end: tokens.len(),
                bytes: d.bytes,
                xxh3: d.xxh3.clone(),
                kind: d.kind.clone(),
                parts: parts.into_iter().map(|(label, at)| SpanPart { label, start: start + at }).collect(),
            });
        }
        let limit = self.config().max_position_embeddings;
        if tokens.len() + ANSWER_ROOM > limit {
            return Err(Error::CollectionTooLong {
                tokens: tokens.len(),
                limit,
                room: ANSWER_ROOM,
                documents: documents.iter().map(|d| (d.path.clone(), d.end - d.start)).collect(),
            });
        }
        Ok(PrefixPlan { tokens, documents, prompt })
    }

    /// The plan of `base` grown by `docs`: its tokens and spans as saved, then each new
    /// document wrapped and tokenized as [`Engine::plan_context`] would (so the result is the
    /// plan of all the documents in one go), refused past the context length like it.
    pub fn plan_append(&self, base: &ContextFile, docs: &[DocumentText]) -> Result<PrefixPlan> {
        if docs.is_empty() {
            return Err(Error::Invalid("no documents to add".into()));
        }
        self.plan_keeping(base, base.documents().len(), docs)
    }

    /// The plan of `base`'s first `kept` documents as saved (its tokens up to where document
    /// `kept` starts), then `docs` laid out as [`Engine::plan_context`] would: what removing a
    /// document re-prefills (the documents after it), and what [`Engine::plan_append`] adds.
    /// `context::extend` keeping `base.tokens_before(kept)` tokens computes only the rest.
    pub fn plan_keeping(&self, base: &ContextFile, kept: usize, docs: &[DocumentText]) -> Result<PrefixPlan> {
        let spans = base.documents();
        if kept > spans.len() {
            return Err(Error::Invalid(format!("the context has {} documents, not {kept}", spans.len())));
        }
        if kept == 0 && docs.is_empty() {
            return Err(Error::Invalid("a context needs at least one document: delete the context instead".into()));
        }
        let keep = base.tokens_before(kept);
        let prompt = base.header().prompt.clone();
        let template = self.document_template();
        if prompt.document_template != template {
            return Err(Error::Context {
                path: base.path().to_owned(),
                msg: "its documents were wrapped with another document template than this model's; prefill all \
                      the documents again"
                    .into(),
            });
        }
        self.laid_out(prompt, base.tokens()[..keep].to_vec(), spans[..kept].to_vec(), docs)
    }

    /// Tokens each document takes in a context of this model (wrapped by its document
    /// template, as [`Engine::plan_context`] lays it out), and how many of them are the
    /// tokenizer's unknown token, counted in parallel; `on_counted(documents_done)` follows the
    /// count, for progress over big sets.
    pub fn document_tokens(
        &self,
        docs: &[DocumentText],
        on_counted: &(dyn Fn(usize) + Sync),
    ) -> Result<Vec<TokenCount>> {
        use rayon::prelude::*;
        let template = self.document_template();
        let unknown = self.tokenizer.unknown_id();
        let done = std::sync::atomic::AtomicUsize::new(0);
        docs.par_iter()
            .map(|d| {
                let ids = self.encode_document(&template, d)?.0;
                on_counted(done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1);
                let unknown = unknown.map_or(0, |u| ids.iter().filter(|&&id| id == u).count());
                Ok(TokenCount { tokens: ids.len(), unknown })
            })
            .collect()
    }

    /// How this model lays a context's documents out (chat template head, or raw with BOS),
    /// as [`Engine::plan_context`] records it; `date` defaults to today.
    pub fn prompt_stamp(&self, system: Option<&str>, date: Option<String>) -> Result<PromptStamp> {
        let date = date.unwrap_or_else(|| chrono::Local::now().format("%d %b %Y").to_string());
        let (kind, head) = match &self.chat_template {
            Some(_) => (PromptKind::Chat, self.render_split(system, &date, &[Message::new("user", "")])?.0),
            None => (PromptKind::Raw, String::new()),
        };
        let document_template = self.document_template();
        Ok(PromptStamp { kind, head, system: system.map(str::to_owned), date, document_template })
    }

    /// The tokens before the documents of a context laid out as `prompt`.
    pub fn head_ids(&self, prompt: &PromptStamp) -> Result<Vec<u32>> {
        match prompt.kind {
            PromptKind::Chat => self.tokenizer.encode_prompt(&prompt.head),
            PromptKind::Raw => Ok(self.config().bos_token_id.into_iter().collect()),
        }
    }

    /// One document wrapped by `template`, and where its parts start (offsets in the ids):
    /// the template's own text is tokenized with special tokens (a model's `<|doc|>` marker
    /// stays one token), the title, path and text without. A text with parts is tokenized a
    /// part at a time, so each part starts on a token (parts start at line starts, where the
    /// tokenizers' pre-tokenizers split anyway).
    /// Every piece continues the prompt (the head comes first): a SentencePiece vocabulary puts
    /// no `▁` in front of each ([`crate::tokenizer::Tokenizer::encode_text_continued`]).
    fn encode_document(&self, template: &str, d: &DocumentText) -> Result<(Vec<u32>, Vec<PartStart>)> {
        let mut ids = Vec::new();
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            let next = ["{title}", "{path}", "{text}"].iter().filter_map(|p| rest.find(p).map(|at| (at, *p))).min();
            let (literal, field, after) = match next {
                Some((at, p)) => (&rest[..at], Some(p), &rest[at + p.len()..]),
                None => (rest, None, ""),
            };
            if !literal.is_empty() {
                ids.extend(self.tokenizer.encode_prompt_continued(literal)?);
            }
            match field {
                Some("{title}") => ids.extend(self.tokenizer.encode_text_continued(&d.title)?),
                Some("{path}") => ids.extend(self.tokenizer.encode_text_continued(&d.path)?),
                Some(_) => {
                    for (label, piece) in pieces(d)? {
                        if let Some(label) = label {
                            parts.push((label.to_owned(), ids.len()));
                        }
                        if !piece.is_empty() {
                            ids.extend(self.tokenizer.encode_text_continued(piece)?);
                        }
                    }
                }
                None => {}
            }
            rest = after;
        }
        Ok((ids, parts))
    }

    /// Tokens to append to a context laid out as `prompt` for the conversation `turns` (user
    /// and assistant messages, the first user message being the first question), ending with
    /// the generation prompt.
    pub fn context_tail(&self, prompt: &PromptStamp, turns: &[Message]) -> Result<Vec<u32>> {
        match prompt.kind {
            PromptKind::Raw => {
                let text: Vec<&str> = turns.iter().map(|m| m.content.as_str()).collect();
                self.tokenizer.encode_text_continued(&text.join("\n"))
            }
            PromptKind::Chat => {
                let (head, tail) = self.render_split(prompt.system.as_deref(), &prompt.date, turns)?;
                if head != prompt.head {
                    return Err(Error::Invalid(
                        "the model's chat template renders the start of the conversation differently from when \
                         this context was prefilled; prefill the documents again with this model"
                            .into(),
                    ));
                }
                self.tokenizer.encode_prompt_continued(&tail)
            }
        }
    }

    /// Renders `turns` (with the documents marker in front of the first user message and the
    /// generation prompt) and splits the text at the marker.
    fn render_split(&self, system: Option<&str>, date: &str, turns: &[Message]) -> Result<(String, String)> {
        let template = self.chat_template.as_ref().ok_or(Error::NoChatTemplate)?;
        let mut messages: Vec<Message> = system.map(|s| Message::new("system", s)).into_iter().collect();
        let mut first = true;
        for m in turns {
            let mut m = m.clone();
            if first && m.role == "user" {
                m.content = format!("{DOCUMENTS_MARKER}{}", m.content);
                first = false;
            }
            messages.push(m);
        }
        let mut extra = Map::new();
        extra.insert("date_string".into(), Value::String(date.to_owned()));
        let text = template.render_with(&messages, true, &extra)?;
        let mut parts = text.splitn(2, DOCUMENTS_MARKER);
        match (parts.next(), parts.next()) {
            (Some(head), Some(tail)) => Ok((head.to_owned(), tail.to_owned())),
            _ => Err(Error::Template(
                "the chat template dropped the first user message's text; it cannot hold documents".into(),
            )),
        }
    }
}

/// A document's text cut where its parts start: the text before the first part (unlabelled),
/// then each part with its label. Refused when a part is out of order or not on a character.
fn pieces(d: &DocumentText) -> Result<Vec<(Option<&str>, &str)>> {
    let text = d.text.as_str();
    let first = d.parts.first().map_or(text.len(), |p| p.at);
    let mut out = vec![(None, text.get(..first).unwrap_or(""))];
    for (i, part) in d.parts.iter().enumerate() {
        let end = d.parts.get(i + 1).map_or(text.len(), |p| p.at);
        let piece = text.get(part.at..end).ok_or_else(|| {
            Error::Invalid(format!("{}: part \"{}\" is out of order or not on a character", d.path, part.label))
        })?;
        out.push((Some(part.label.as_str()), piece));
    }
    Ok(out)
}
