//! How documents become the tokens of a context, and how a question is appended to them: the
//! plan's types here, the layout itself in [`crate::engine`] (it needs the model's tokenizer
//! and chat template).
//!
//! Chat models see the documents at the start of the first user message: the chat template is
//! rendered with a marker for the documents, the text before the marker (system prompt, role
//! header) is the context's *head*, each document is wrapped by the document template and
//! tokenized on its own (so its token range is exact for the span table), and at chat time the
//! conversation is rendered again with the marker in front of the first question: the text
//! after the marker is the tail appended to the saved tokens. The head is stored in the file
//! and must render identically at chat time, so a changed template is an error, not a silent
//! mismatch. `date_string` is pinned to the prefill's date for templates that print the date.
//!
//! Document text (and its title and path) is tokenized with special tokens *disabled*: a
//! document containing `<|im_end|>` or `<|eot_id|>` is text, not a control token (no prompt
//! injection through files). The document template's own text is trusted and keeps them.
//!
//! Document template (docs/context-file.md): [`DEFAULT_DOCUMENT_TEMPLATE`], or the model's own
//! when its folder ships an `eval_spec.json` describing how it was trained to read documents
//! (the bundled demo model).

use folio_context_file::format::{DocumentSpan, PromptKind, PromptStamp};

/// Each document, wrapped with its title and path.
pub const DEFAULT_DOCUMENT_TEMPLATE: &str = "<document title=\"{title}\" path=\"{path}\">\n{text}\n</document>\n\n";

/// Tokens left free after the documents for the question and the answer: a collection that
/// does not leave them is refused before prefill.
pub const ANSWER_ROOM: usize = 512;

/// One document's text with where it came from.
#[derive(Debug, Clone)]
pub struct DocumentText {
    pub title: String,
    pub path: String,
    pub text: String,
    pub bytes: u64,
    pub xxh3: String,
    /// What the reader took it for ("PDF", "Markdown", "text"…), kept in the context's span.
    pub kind: String,
    /// Where its pages, chapters or sections start in `text`, in order.
    pub parts: Vec<TextPart>,
}

/// A document's tokens in a context, and how many are the tokenizer's unknown token (words
/// the model cannot read: a word-level vocabulary's misses).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenCount {
    pub tokens: usize,
    pub unknown: usize,
}

/// A part of a document's text: its label and the byte offset where it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct TextPart {
    pub label: String,
    pub at: usize,
}

/// What a prefill computes: the tokens, where each document is in them, and how they were laid out.
#[derive(Debug, Clone)]
pub struct PrefixPlan {
    pub tokens: Vec<u32>,
    pub documents: Vec<DocumentSpan>,
    pub prompt: PromptStamp,
}

impl PrefixPlan {
    /// Token ids as they are, one untitled span over all of them, no template (benchmarks and
    /// tests that prefill synthetic tokens).
    pub fn raw_tokens(tokens: Vec<u32>) -> Self {
        let span = DocumentSpan {
            title: "tokens".into(),
            path: String::new(),
            start: 0,
            end: tokens.len(),
            bytes: 0,
            xxh3: String::new(),
            kind: String::new(),
            parts: Vec::new(),
        };
        let prompt = PromptStamp {
            kind: PromptKind::Raw,
            head: String::new(),
            system: None,
            date: String::new(),
            document_template: String::new(),
        };
        Self { tokens, documents: vec![span], prompt }
    }
}
