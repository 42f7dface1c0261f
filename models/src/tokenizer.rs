//! Tokenizer wrapper: `tokenizer.json` through the `tokenizers` crate, plus the BOS rule for
//! raw text.
//!
//! BOS rule (llama.cpp's): raw text gets the model's `bos_token_id` in front when the config
//! names one and the tokenizer's post-processor did not already add it. Chat prompts never get
//! it this way: the template writes `bos_token` itself when the model wants it, and the
//! rendered prompt is encoded without special tokens, as transformers' `apply_chat_template`.

use std::path::Path;

use crate::error::{Error, Result};

/// How tokenizers name their unknown token.
const UNKNOWN_TOKENS: [&str; 3] = ["<|unk|>", "<unk>", "[UNK]"];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens matched as plain text (for document text).
    plain: tokenizers::Tokenizer,
    bos: Option<u32>,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    pub fn from_file(path: &Path, bos: Option<u32>) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        Ok(Self { inner, plain, bos })
    }

    /// Raw text, with the BOS rule applied.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.inner.encode(text, true).map_err(tok_err)?.get_ids().to_vec();
        if let Some(bos) = self.bos {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// A rendered chat prompt: no special tokens added (the template wrote them).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
    }

    /// Document text: no special tokens added, and special-token strings in the text (a file
    /// that contains `<|im_end|>`) encoded as the text they are, never as control tokens.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.plain.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The unknown token's id, for tokenizers that have one (word-level and WordPiece
    /// vocabularies; byte-level BPE reads every byte and has none).
    pub fn unknown_id(&self) -> Option<u32> {
        UNKNOWN_TOKENS.iter().find_map(|t| self.inner.token_to_id(t))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
