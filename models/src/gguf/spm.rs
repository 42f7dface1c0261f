//! A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral 7B
//! v0.1–v0.3, and their fine-tunes) as a `tokenizers` BPE tokenizer.
//!
//! The file holds the pieces, one score each and their types, but no merges: llama.cpp
//! tokenizes by starting from the text's characters (spaces written as `▁`, one `▁` in front of
//! the text and after every special token) and repeatedly joining the adjacent pair whose
//! concatenation is a piece with the highest score, leftmost first; a character no piece covers
//! becomes its UTF-8 bytes' `<0xXX>` pieces. A BPE model whose merges are every pair of pieces
//! that concatenate to a piece, ranked by that piece's score, joins the same pairs in the same
//! order (the same pair twice in a word: leftmost first in both), and the `tokenizers` crate's
//! byte fallback is the same fallback — so one tokenizer path serves BPE and SentencePiece files
//! alike, and the fixture's tokens are held to llama.cpp's own (tests:
//! `the_tokenizer_from_metadata_tokenizes_as_llama_cpp`). Where the two could part: two
//! different pieces of equal score within one word (llama.cpp joins the leftmost, the ranks the
//! lower id) — SentencePiece's own trainer gives every piece its own score; a piece made of
//! characters that are not pieces themselves (`日本` without `日`: llama.cpp joins the
//! characters, the BPE has turned them into bytes first) — a trained vocabulary holds its
//! pieces' characters; and a byte piece made by joining others (`<0x4` + `1>`), which no
//! vocabulary has.

use serde_json::{json, Value as Json};

use super::vocab::Parts;
use super::GgufFile;
use crate::error::Result;

/// SentencePiece's word-boundary mark, which stands for a space in the pieces.
const SPACE_MARK: &str = "\u{2581}";
/// Pieces longer than this (in characters) are not split into merge pairs: no real vocabulary
/// has them, and the pairs grow with the square of a piece's length.
const MAX_PIECE_CHARS: usize = 256;

/// The `tokenizer.json` parts a SentencePiece vocabulary makes.
pub(super) struct Spm {
    /// `model`, `normalizer`, `pre_tokenizer` and `decoder` of the document.
    pub parts: Parts,
    /// The normalizer for text that continues a longer text (no `▁` in front), where it
    /// differs from the text's.
    pub continuation_normalizer: Option<Json>,
    /// The scores and the space-prefix rule, for the vocabulary's checksum.
    pub hashed: Vec<u8>,
}

impl GgufFile {
    /// The SentencePiece tokenizer of `tokens` (their ids in `vocab`, llama.cpp's token `types`).
    pub(super) fn spm(&self, tokens: &[&str], vocab: Parts, types: &[i64], unknown: Option<&str>) -> Result<Spm> {
        let scores = self.scores()?.ok_or_else(|| {
            self.error(
                "its SentencePiece vocabulary has no scores (tokenizer.ggml.scores), which order its merges".into(),
            )
        })?;
        if scores.len() != tokens.len() {
            return Err(self.error(format!(
                "its SentencePiece vocabulary has {} scores for {} pieces (tokenizer.ggml.scores)",
                scores.len(),
                tokens.len()
            )));
        }
        let space_prefix = match self.metadata("tokenizer.ggml.add_space_prefix") {
            Some(v) => v.to_bool().map_err(|_| self.error("tokenizer.ggml.add_space_prefix is not a bool".into()))?,
            None => true,
        };
        let merges = merges(tokens, &vocab, types, &scores);
        let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK});
        let normalizer = if space_prefix {
            json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE_MARK}, replace.clone()]})
        } else {
            replace.clone()
        };
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if space_prefix {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        let mut parts = Parts::new();
        parts.insert("normalizer".into(), normalizer);
        parts.insert("pre_tokenizer".into(), Json::Null);
        parts.insert("decoder".into(), json!({"type": "Sequence", "decoders": decoders}));
        parts.insert(
            "model".into(),
            json!({"type": "BPE", "dropout": null, "unk_token": unknown, "continuing_subword_prefix": null,
                   "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                   "vocab": vocab, "merges": merges}),
        );
        let mut hashed: Vec<u8> = scores.iter().flat_map(|s| s.to_le_bytes()).collect();
        hashed.push(u8::from(space_prefix));
        Ok(Spm { parts, continuation_normalizer: space_prefix.then_some(replace), hashed })
    }

    fn scores(&self) -> Result<Option<Vec<f32>>> {
        let Some(v) = self.metadata("tokenizer.ggml.scores") else { return Ok(None) };
        let list = v.to_vec().map_err(|_| self.error("metadata tokenizer.ggml.scores is not a list".into()))?;
        list.iter()
            .map(|x| x.to_f32().map_err(|_| self.error("tokenizer.ggml.scores holds a non-f32 value".into())))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

/// Every pair of pieces whose concatenation is a piece, ranked by that piece's score (highest
/// first; equal scores by the piece's id, then by where the pair splits it). Byte pieces
/// (`<0xXX>`, type 6) are only a fallback and are never joined into.
fn merges(tokens: &[&str], vocab: &Parts, types: &[i64], scores: &[f32]) -> Vec<[String; 2]> {
    const TYPE_BYTE: i64 = 6;
    let mut pairs: Vec<(usize, usize, [String; 2])> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types.get(id) == Some(&TYPE_BYTE) || piece.chars().count() > MAX_PIECE_CHARS {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                pairs.push((id, at, [left.to_owned(), right.to_owned()]));
            }
        }
    }
    pairs.sort_by(|a, b| scores[b.0].total_cmp(&scores[a.0]).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    pairs.into_iter().map(|(_, _, pair)| pair).collect()
}
