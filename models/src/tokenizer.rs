//! Tokenizer wrapper: `tokenizer.json` through the `tokenizers` crate, plus the BOS rule for
//! raw text.
//!
//! BOS rule (llama.cpp's): raw text gets the model's `bos_token_id` in front when the config
//! names one and the tokenizer's post-processor did not already add it. Chat prompts never get
//! it this way: the template writes `bos_token` itself when the model wants it, and the
//! rendered prompt is encoded without special tokens, as transformers' `apply_chat_template`.

use std::path::Path;

use crate::error::{Error, Result};

/// A document text whose longest line is longer than this is tokenized in pieces (a 1M-token
/// export, a minified file or a log of one line): the `tokenizers` crate holds a whole
/// pre-tokenized text and its offsets at once, so one 50 MiB line would take gigabytes. Texts
/// within it — every prose document — are tokenized whole, exactly as before.
const LONG_LINE_BYTES: usize = 1 << 20;
/// About how long each piece of such a text is.
const PIECE_BYTES: usize = 64 << 10;

/// How tokenizers name their unknown token.
const UNKNOWN_TOKENS: [&str; 3] = ["<|unk|>", "<unk>", "[UNK]"];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens matched as plain text (for document text).
    plain: tokenizers::Tokenizer,
    /// `inner` and `plain` for text that continues a longer text, where they differ: a
    /// SentencePiece vocabulary's tokenizer puts `▁` in front of a text (as llama.cpp in front of
    /// a prompt), which a continuation — a piece of a long line, a document after the prompt's
    /// head, the question after the documents — must not get.
    continued: Option<(tokenizers::Tokenizer, tokenizers::Tokenizer)>,
    bos: Option<u32>,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    pub fn from_file(path: &Path, bos: Option<u32>) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self::from_inner(inner, bos))
    }

    fn from_inner(inner: tokenizers::Tokenizer, bos: Option<u32>) -> Self {
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        Self { inner, plain, continued: None, bos }
    }

    /// A tokenizer from a `tokenizer.json` document made in memory (a GGUF's vocabulary), with
    /// the document for continuations where it differs; `origin` names where it came from in
    /// errors.
    pub fn from_json(json: &str, continuation: Option<&str>, origin: &Path, bos: Option<u32>) -> Result<Self> {
        let parse = |json: &str| -> Result<tokenizers::Tokenizer> {
            json.parse().map_err(|e| Error::Tokenizer(format!("{}: {e}", origin.display())))
        };
        let mut tokenizer = Self::from_inner(parse(json)?, bos);
        if let Some(json) = continuation {
            let inner = parse(json)?;
            let mut plain = inner.clone();
            plain.set_encode_special_tokens(true);
            tokenizer.continued = Some((inner, plain));
        }
        Ok(tokenizer)
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

    /// [`Tokenizer::encode_prompt`] for text that continues a prompt (what follows its head).
    pub fn encode_prompt_continued(&self, text: &str) -> Result<Vec<u32>> {
        let t = self.continued.as_ref().map_or(&self.inner, |c| &c.0);
        Ok(t.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
    }

    /// [`Tokenizer::encode_text`] for text that continues a prompt (a document's title, path and
    /// text after the head and the template's own text).
    pub fn encode_text_continued(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_document_text(text, true)
    }

    /// `plain` for text that continues a longer text.
    fn plain_continued(&self) -> &tokenizers::Tokenizer {
        self.continued.as_ref().map_or(&self.plain, |c| &c.1)
    }

    /// Whether `text` is tokenized in pieces: a line over [`LONG_LINE_BYTES`]; with a
    /// SentencePiece vocabulary, the whole text over it (it has no pre-tokenizer, so all text
    /// between special tokens is one word to its BPE, of 48 bytes of state a byte).
    fn in_pieces(&self, text: &str) -> bool {
        if self.continued.is_some() {
            return text.len() > LONG_LINE_BYTES;
        }
        text.split('\n').map(str::len).max().unwrap_or(0) > LONG_LINE_BYTES
    }

    /// Document text: no special tokens added, and special-token strings in the text (a file
    /// that contains `<|im_end|>`) encoded as the text they are, never as control tokens.
    /// A text with a line longer than [`LONG_LINE_BYTES`] is encoded in pieces
    /// ([`text_pieces`]).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_document_text(text, false)
    }

    /// Document text, whole or in pieces, continuing a longer text or not.
    fn encode_document_text(&self, text: &str, continued: bool) -> Result<Vec<u32>> {
        if !self.in_pieces(text) {
            return self.encode_whole(text, continued);
        }
        self.encode_in_pieces(text, PIECE_BYTES, continued)
    }

    /// `text` a piece at a time; the pieces after the first (all of them when `continued`)
    /// continue it.
    fn encode_in_pieces(&self, text: &str, size: usize, continued: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for (i, piece) in text_pieces(text, size).enumerate() {
            ids.extend(self.encode_whole(piece, i > 0 || continued)?);
        }
        Ok(ids)
    }

    /// Document text in one piece.
    fn encode_whole(&self, text: &str, continued: bool) -> Result<Vec<u32>> {
        let tokenizer = if continued { self.plain_continued() } else { &self.plain };
        Ok(tokenizer.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
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

/// `text` cut into consecutive pieces of about `size` bytes (each at least one character),
/// each cut where a run of whitespace other than a line break starts — where byte-level BPE
/// pre-tokenizers (GPT-2's, Llama 3's, Qwen's patterns) split anyway: a word keeps its leading
/// space in the next piece, a space run stays whole, and punctuation keeps the line breaks
/// that follow it (`?[^\s\p{L}\p{N}]+[\r\n]*`), so the pieces' tokens are the whole text's.
/// In a stretch of `size` bytes with no such place the cut is at a character boundary.
pub fn text_pieces(text: &str, size: usize) -> impl Iterator<Item = &str> {
    let size = size.max(1);
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len();
        if rest.len() > size {
            let mut limit = size;
            while !rest.is_char_boundary(limit) {
                limit += 1;
            }
            end = whitespace_run_start(&rest[..limit]).unwrap_or(limit);
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

/// The last byte offset (after the first character) where a whitespace run starts with a
/// character other than a line break, after a non-whitespace one.
fn whitespace_run_start(s: &str) -> Option<usize> {
    let mut best = None;
    let mut previous_white = true;
    for (i, c) in s.char_indices() {
        if is_cut_point(previous_white, c) && i > 0 {
            best = Some(i);
        }
        previous_white = c.is_whitespace();
    }
    best
}

/// A cut may go before `c` when it starts a whitespace run with something other than a line
/// break.
fn is_cut_point(previous_white: bool, c: char) -> bool {
    !previous_white && c.is_whitespace() && c != '\n' && c != '\r'
}

#[cfg(test)]
mod tests {
    use super::{is_cut_point, text_pieces, Tokenizer};
    use rand::{Rng, SeedableRng};

    /// Whether `piece` has a cut point after its first character.
    fn has_cut_point(piece: &str) -> bool {
        let chars: Vec<char> = piece.chars().collect();
        chars.windows(2).any(|w| is_cut_point(w[0].is_whitespace(), w[1]))
    }

    /// Random text of words, punctuation, digits, spaces, tabs and line breaks.
    fn random_text(rng: &mut impl Rng, words: usize) -> String {
        let parts =
            ["harbor", "Ferry", " ", "  ", "\n", "\n\n", ".", "!\n", ", ", "42", "é", "日本", "\t", "'s", " -- "];
        (0..words).map(|_| parts[rng.random_range(0..parts.len())]).collect()
    }

    /// Each byte-level BPE fixture (GPT-2's pattern: llama, mistral; Llama 3's and Qwen's:
    /// qwen2, qwen3) gives a text's tokens in pieces exactly as whole, on fresh random texts
    /// cut into pieces of 40 to 400 bytes wherever every cut is at a cut point (a forced cut,
    /// inside a stretch with no whitespace, may split a word's tokens: not compared).
    #[test]
    fn pieces_tokenize_as_the_whole_text() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        let mut compared = 0;
        for name in ["llama", "mistral", "qwen2", "qwen3"] {
            let tokenizer = Tokenizer::from_file(&fixtures.join(name).join("tokenizer.json"), None).unwrap();
            for _ in 0..50 {
                let text = random_text(&mut rng, 600);
                let size = rng.random_range(40..400);
                let pieces: Vec<&str> = text_pieces(&text, size).collect();
                let forced = pieces
                    .windows(2)
                    .any(|w| !is_cut_point(w[0].ends_with(char::is_whitespace), w[1].chars().next().expect("a piece")));
                if forced {
                    continue;
                }
                compared += 1;
                let whole = tokenizer.encode_whole(&text, false).unwrap();
                assert_eq!(
                    tokenizer.encode_in_pieces(&text, size, false).unwrap(),
                    whole,
                    "{name}, pieces of {size}: {text:?}"
                );
            }
        }
        assert!(compared >= 100, "only {compared} of 200 texts were cut at cut points alone");
    }

    /// On fresh random texts of words, runs of spaces, newlines, long unbroken stretches and
    /// multi-byte characters: the pieces join to the text, none is empty, none is much past the
    /// size, and a cut not at the start of a whitespace run is one the piece left no choice for.
    #[test]
    fn pieces_cover_the_text_and_cut_where_whitespace_starts() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let long = "x".repeat(300);
        for _ in 0..200 {
            let (before, after) = (rng.random_range(0..200), rng.random_range(0..200));
            let text = random_text(&mut rng, before) + &long + &random_text(&mut rng, after);
            let size = rng.random_range(1..200);
            let pieces: Vec<&str> = text_pieces(&text, size).collect();
            assert_eq!(pieces.concat(), text);
            for (i, piece) in pieces.iter().enumerate() {
                assert!(!piece.is_empty());
                assert!(piece.len() < size + 4, "{} bytes for size {size}", piece.len());
                let Some(next) = pieces.get(i + 1).and_then(|p| p.chars().next()) else { continue };
                let at_cut_point = is_cut_point(piece.ends_with(char::is_whitespace), next);
                assert!(at_cut_point || !has_cut_point(piece), "cut after {piece:?} before {next:?}");
            }
        }
    }
}
