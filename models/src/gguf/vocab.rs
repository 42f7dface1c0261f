//! A GGUF's `tokenizer.*` metadata → a `tokenizers` tokenizer and the chat template, so a lone
//! `.gguf` needs no other file.
//!
//! llama.cpp's converter stores a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`,
//! what Llama 3, Qwen2/2.5/3 and most current models use) as the token strings in id order, their
//! types (control tokens are the special ones), the merges, and the name of the
//! pre-tokenizer's split pattern (`tokenizer.ggml.pre`). That is everything a `tokenizer.json`
//! holds, so the tokenizer is built as one: the same crate then tokenizes GGUF and safetensors
//! models alike. The pattern is chosen by name from the ones written below (the names and
//! patterns llama.cpp uses); an unknown name is refused rather than guessed, since a wrong split
//! changes every token id. SentencePiece vocabularies (`llama`: Llama 2, Mistral 7B v0.1–0.3)
//! become a BPE tokenizer too ([`super::spm`]).

use serde_json::{json, Value as Json};

use super::GgufFile;
use crate::error::Result;

/// GPT-2's split (what a byte-level pre-tokenizer with `use_regex` applies).
const GPT2_PRE: &[&str] = &["gpt-2"];
/// Qwen2's split: Llama 3's with single digits.
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split: digits in runs of up to three.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral Nemo's and Mistral Small 3's split (`tekken`): words by case (capitals then lower
/// case, or a run of capitals), single digits, a `/` kept after punctuation — the pattern of
/// their tokenizer.json (llama.cpp approximates its letter classes with ASCII ranges; the two
/// agree on ASCII text).
const TEKKEN_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// `tokenizer.ggml.pre` names whose split is one of the patterns above.
const PATTERNS: &[(&str, &str)] = &[
    ("qwen2", QWEN2_PATTERN),
    ("llama-bpe", LLAMA3_PATTERN),
    ("llama3", LLAMA3_PATTERN),
    ("smaug-bpe", LLAMA3_PATTERN),
    ("tekken", TEKKEN_PATTERN),
];
/// Pre-tokenizers of Llama 3's and Mistral's tekken vocabularies: llama.cpp (as Hugging Face's
/// tokenizer.json) takes a word that is itself a token whole before merging, and puts BOS
/// before text unless the file says otherwise.
const WHOLE_WORD_PRE: &[&str] = &["llama-bpe", "llama3", "smaug-bpe", "tekken"];

/// llama.cpp's token types (`llama_token_type`): control tokens are special, user-defined ones
/// are matched whole but are text.
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Control tokens that end a turn, as llama.cpp also ends generation on them by their text.
const END_OF_TURN: [&str; 8] =
    ["<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>"];

/// Top-level parts of a `tokenizer.json` document, by name.
pub(super) type Parts = serde_json::Map<String, Json>;

/// The tokenizer and what goes with it.
pub struct Vocab {
    /// A `tokenizer.json` document for the `tokenizers` crate.
    pub tokenizer_json: String,
    /// The same for text that continues a piece of a longer text, where it differs (a
    /// SentencePiece vocabulary puts a `▁` in front of a text, not of a continuation).
    pub continuation_json: Option<String>,
    /// A checksum of the `tokenizer.*` metadata it was built from (what a context file's
    /// fingerprint records: it changes with the file, not with how Folio builds the tokenizer).
    pub checksum: String,
    /// BOS to put in front of raw text (`tokenizer.ggml.add_bos_token`).
    pub bos_for_text: Option<u32>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl GgufFile {
    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.metadata(key) else { return Ok(None) };
        let list = v.to_vec().map_err(|_| self.error(format!("metadata {key} is not a list")))?;
        list.iter()
            .map(|s| {
                s.to_string().map(String::as_str).map_err(|_| self.error(format!("metadata {key} holds a non-string")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn tokens(&self) -> Result<Vec<&str>> {
        self.strings("tokenizer.ggml.tokens")?.ok_or_else(|| {
            self.error(
                "it has no tokenizer (no tokenizer.ggml.tokens in its metadata); Folio needs a GGUF that carries \
                 its vocabulary, as llama.cpp's converter writes it"
                    .into(),
            )
        })
    }

    /// `(bos, eos ids)`: the file's BOS, and its EOS with the end-of-turn control tokens.
    pub fn special_ids(&self) -> Result<(Option<u32>, Vec<u32>)> {
        let id = |key: &str| -> Result<Option<u32>> { Ok(self.uint(key)?.map(|n| n as u32)) };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let mut eos: Vec<u32> =
            ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
                .iter()
                .map(|k| id(k))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .flatten()
                .collect();
        if let (Ok(tokens), Some(types)) = (self.tokens(), self.token_types()?) {
            for (i, t) in tokens.iter().enumerate() {
                if types.get(i) == Some(&TYPE_CONTROL) && END_OF_TURN.contains(t) && !eos.contains(&(i as u32)) {
                    eos.push(i as u32);
                }
            }
        }
        Ok((bos, eos))
    }

    fn token_types(&self) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.metadata("tokenizer.ggml.token_type") else { return Ok(None) };
        let list = v.to_vec().map_err(|_| self.error("metadata tokenizer.ggml.token_type is not a list".into()))?;
        list.iter()
            .map(|x| {
                x.to_i32()
                    .map(i64::from)
                    .map_err(|_| self.error("tokenizer.ggml.token_type holds a non-integer".into()))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// The chat template (`tokenizer.chat_template`), if the file has one.
    pub fn chat_template(&self) -> Result<Option<String>> {
        Ok(self.string("tokenizer.chat_template")?.map(str::to_owned))
    }

    /// The tokenizer, built from the vocabulary (and for byte-level BPE its merges and
    /// pre-tokenizer name, for SentencePiece its scores).
    pub fn vocab(&self) -> Result<Vocab> {
        let tokens = self.tokens()?;
        let types = self.token_types()?.unwrap_or_default();
        let model = self.string("tokenizer.ggml.model")?.unwrap_or("gpt2");
        // The checksum's order for byte-level BPE files (tokens, merges, types, the
        // pre-tokenizer's name, the BOS rule) is what their saved contexts recorded: kept. A
        // SentencePiece file's is tokens, types, scores, the space-prefix rule, the BOS rule.
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        tokens.iter().for_each(|t| h.update(t.as_bytes()));
        h.update(b"\0");
        let hash_types = |h: &mut xxhash_rust::xxh3::Xxh3| types.iter().for_each(|t| h.update(&t.to_le_bytes()));
        // Piece → id, the `model.vocab` of either kind of tokenizer.
        let vocab: Parts = tokens.iter().enumerate().map(|(i, t)| ((*t).to_owned(), json!(i))).collect();
        let (parts, continuation, adds_bos_default) = match model {
            "gpt2" => {
                let (parts, pre, merges) = self.bpe(vocab)?;
                merges.iter().for_each(|m| h.update(m.as_bytes()));
                h.update(b"\0");
                hash_types(&mut h);
                h.update(pre.as_bytes());
                (parts, None, WHOLE_WORD_PRE.contains(&pre))
            }
            "llama" => {
                let unknown = types.iter().position(|t| *t == TYPE_UNKNOWN).and_then(|i| tokens.get(i).copied());
                let spm = self.spm(&tokens, vocab, &types, unknown)?;
                hash_types(&mut h);
                h.update(&spm.hashed);
                (spm.parts, spm.continuation_normalizer, true)
            }
            other => {
                return Err(self.error(format!(
                    "its tokenizer is \"{other}\"; Folio reads GGUF vocabularies of byte-level BPE (gpt2: Llama 3, \
                     Qwen2/2.5/3) and SentencePiece (llama: Llama 2, Mistral 7B) — use that model's safetensors \
                     folder instead"
                )))
            }
        };
        let added: Vec<Json> = types
            .iter()
            .enumerate()
            // A SentencePiece file's unknown piece is special too (as Llama 2's tokenizer.json has it).
            .filter(|(_, t)| [TYPE_CONTROL, TYPE_USER_DEFINED].contains(t) || (model == "llama" && **t == TYPE_UNKNOWN))
            .filter_map(|(i, t)| {
                tokens.get(i).map(|s| {
                    json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                           "normalized": false, "special": *t != TYPE_USER_DEFINED})
                })
            })
            .collect();
        let mut doc = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
                             "post_processor": null});
        doc.as_object_mut().expect("an object").extend(parts);
        let continuation_json = continuation.map(|normalizer| {
            let mut c = doc.clone();
            c["normalizer"] = normalizer;
            c.to_string()
        });
        let bos = self.uint("tokenizer.ggml.bos_token_id")?.map(|n| n as u32);
        let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).map(|s| (*s).to_owned());
        let eos = self.uint("tokenizer.ggml.eos_token_id")?.map(|n| n as u32);
        let adds_bos = match self.metadata("tokenizer.ggml.add_bos_token") {
            Some(v) => v.to_bool().map_err(|_| self.error("tokenizer.ggml.add_bos_token is not a bool".into()))?,
            None => adds_bos_default,
        };
        h.update(&[u8::from(adds_bos)]);
        Ok(Vocab {
            tokenizer_json: doc.to_string(),
            continuation_json,
            checksum: folio_context_file::format::checksum_hex(h.digest()),
            bos_for_text: bos.filter(|_| adds_bos),
            bos_token: name(bos),
            eos_token: name(eos),
        })
    }

    /// A byte-level BPE vocabulary's `model`, `normalizer`, `pre_tokenizer` and `decoder`, its
    /// pre-tokenizer's name and its merges (both go into the checksum).
    fn bpe(&self, vocab: Parts) -> Result<(Parts, &str, Vec<&str>)> {
        let merges = self
            .strings("tokenizer.ggml.merges")?
            .ok_or_else(|| self.error("its BPE tokenizer has no merges (tokenizer.ggml.merges)".into()))?;
        let pre = self.string("tokenizer.ggml.pre")?.unwrap_or("(none: a file from before llama.cpp named them)");
        let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
            self.error(format!(
                "its pre-tokenizer \"{pre}\" is not one Folio knows ({}); a guessed split would change every \
                 token id",
                GPT2_PRE.iter().chain(PATTERNS.iter().map(|(n, _)| n)).copied().collect::<Vec<_>>().join(", ")
            ))
        })?;
        let parts = json!({
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": WHOLE_WORD_PRE.contains(&pre),
                      "vocab": vocab, "merges": merges},
        });
        match parts {
            Json::Object(map) => Ok((map, pre, merges)),
            _ => unreachable!("a JSON object literal"),
        }
    }
}

/// The `tokenizers` pre-tokenizer for llama.cpp's pre-tokenizer name.
fn pre_tokenizer(name: &str) -> Option<Json> {
    if GPT2_PRE.contains(&name) {
        return Some(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}));
    }
    let (_, pattern) = PATTERNS.iter().find(|(n, _)| *n == name)?;
    Some(json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]}))
}
