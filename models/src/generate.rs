//! Token generation: sampling settings (with the model's generation_config.json as defaults),
//! the decode loop, stop conditions, and streaming of text pieces to a callback.
//!
//! Sampling is candle-transformers' `LogitsProcessor` (temperature, top-k, top-p,
//! seeded) after its Hugging Face-style repetition penalty, and greedy decoding
//! `folio_kernels::argmax` (the first of equal logits, as torch's); this module owns the loop,
//! the stop rules and the streaming, which are Folio's.

use std::ops::ControlFlow;
use std::path::Path;

use candle_transformers::generation::{LogitsProcessor, Sampling};
use serde::{Deserialize, Serialize};

use crate::attention::Attention;
use crate::config::TokenIds;
use crate::error::{Error, Result};
use crate::kv_cache::KvStore;
use crate::model::{Logits, Model};
use crate::tokenizer::Tokenizer;

/// Prompt tokens per forward pass during prefill (bounds `[chunk, intermediate]` activations).
pub const PREFILL_CHUNK: usize = 8192;

/// Answer tokens the KV store is sized for up front.
const INITIAL_ANSWER_ROOM: usize = 4096;

/// How the next token is chosen.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f64,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    /// 1.0 means off; > 1 discourages tokens already in the prompt or answer (HF semantics).
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_p: None, top_k: None, repetition_penalty: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!("temperature must be >= 0 (0 = greedy), got {}", self.temperature));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad(format!("top_p must be in (0, 1], got {p}"));
        }
        if self.top_k == Some(0) {
            return bad("top_k must be >= 1".into());
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        Ok(())
    }

    fn sampling(&self) -> Sampling {
        let temperature = self.temperature;
        match (self.temperature > 0.0, self.top_k, self.top_p.filter(|p| *p < 1.0)) {
            (false, _, _) => Sampling::ArgMax,
            (true, None, None) => Sampling::All { temperature },
            (true, Some(k), None) => Sampling::TopK { k, temperature },
            (true, None, Some(p)) => Sampling::TopP { p, temperature },
            (true, Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        }
    }
}

/// The parts of `generation_config.json` Folio uses.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerationConfig {
    eos_token_id: Option<TokenIds>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| Error::InvalidConfig { path: path.to_owned(), msg: e.to_string() })
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default()
    }

    /// The model author's sampling defaults (greedy unless `do_sample` is set).
    pub fn sampling_defaults(&self) -> SamplingParams {
        let sample = self.do_sample == Some(true);
        SamplingParams {
            temperature: if sample { self.temperature.unwrap_or(1.0) } else { 0.0 },
            top_p: self.top_p.filter(|_| sample),
            top_k: self.top_k.filter(|_| sample),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            seed: 0,
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_strings: Vec<String>,
    pub eos_token_ids: Vec<u32>,
    pub prompt_pass: PromptPass,
}

/// How a prompt's tokens are attended before the answer's first token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PromptPass {
    /// In chunks of many tokens, which every method but BUZZ attends densely, as the papers
    /// prefill their prompts: a question over a saved context reads every row once.
    #[default]
    Dense,
    /// The tokens from this index on one at a time, each a decode step of the method, so the
    /// question is read with the method's own selection (a "sparse question": at 1M tokens its
    /// first answer token no longer waits for a dense pass over every row). The tokens before
    /// the index (a whole prompt's documents) go in chunks as with `Dense`.
    SparseFrom(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string appeared in the text (it is not part of the answer).
    StopString,
    /// `max_new_tokens` reached.
    MaxTokens,
    /// The model's context length is full.
    ContextFull,
    /// The callback asked to stop (the user pressed Stop).
    Cancelled,
}

#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// Generated token ids, the EOS token included when generation ended on one.
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
    /// Seconds from the call to the first sampled token (the prompt's pass included); `None`
    /// when none was sampled.
    pub first_token_s: Option<f64>,
    pub seconds: f64,
}

/// Runs the prompt through `model` (appending to `kv`) and generates up to `max_new_tokens`,
/// calling `on_text` with each new piece of text as soon as it is final (text that could be
/// the start of a stop string, or half a UTF-8 character, is held back).
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    attn: &dyn Attention,
    kv: &mut dyn KvStore,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<Generation> {
    let started = std::time::Instant::now();
    params.sampling.validate()?;
    if prompt.is_empty() {
        return Err(Error::Invalid("the prompt is empty".into()));
    }
    let limit = model.config().max_position_embeddings;
    model.config().check_fits(kv.len() + prompt.len())?;
    // A new generation: indexes and conversation state of an earlier one do not apply.
    attn.reset();
    // Room for the prompt and the start of the answer; a long answer grows the store by doubling
    // rather than reserving the model's whole context for a large --max-tokens.
    let answer_room = params.max_new_tokens.min(INITIAL_ANSWER_ROOM);
    kv.reserve(kv.len().saturating_add(prompt.len()).saturating_add(answer_room).min(limit))?;
    let sampling = params.sampling.sampling();
    // Greedy: the first index of the largest logit where the logits are (one kernel on a GPU).
    let greedy = matches!(sampling, Sampling::ArgMax);
    let mut processor = LogitsProcessor::from_sampling(params.sampling.seed, sampling);
    let mut context: Vec<u32> = prompt.to_vec();
    let mut tokens = Vec::new();
    let mut emitted = 0;
    let mut text = String::new();
    let mut first_token_s = None;
    let mut input = prompt_head(model, attn, kv, prompt, params.prompt_pass)?;
    let stop_reason = loop {
        if tokens.len() >= params.max_new_tokens {
            break StopReason::MaxTokens;
        }
        if kv.len() + input.len() > limit {
            break StopReason::ContextFull;
        }
        let logits = model.forward(&input, kv, attn, Logits::Last)?.squeeze(0)?;
        let logits = if params.sampling.repetition_penalty != 1.0 {
            candle_transformers::utils::apply_repeat_penalty(&logits, params.sampling.repetition_penalty, &context)?
        } else {
            logits
        };
        let next = if greedy { folio_kernels::argmax::argmax(&logits)? } else { processor.sample(&logits)? };
        first_token_s.get_or_insert_with(|| started.elapsed().as_secs_f64());
        tokens.push(next);
        context.push(next);
        input = vec![next];
        if params.eos_token_ids.contains(&next) {
            break StopReason::Eos;
        }
        text = tokenizer.decode(&tokens, true)?;
        if let Some(at) = params.stop_strings.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(at);
            break StopReason::StopString;
        }
        let safe = safe_prefix_len(&text, &params.stop_strings);
        // Decoders only append for the tokenizers Folio supports; if one ever rewrote earlier
        // text, the rewritten part is not re-sent (`get` instead of a panicking slice).
        if let Some(piece) = text.get(emitted..safe).filter(|p| !p.is_empty()) {
            emitted = safe;
            if on_text(piece).is_break() {
                break StopReason::Cancelled;
            }
        }
    };
    if stop_reason != StopReason::Cancelled {
        // The held-back tail is final now (the loop ended without a stop string there).
        if let Some(rest) = text.get(emitted..).filter(|r| !r.is_empty()) {
            let _ = on_text(rest);
        }
    }
    Ok(Generation { tokens, text, stop_reason, first_token_s, seconds: started.elapsed().as_secs_f64() })
}

/// Runs all of `prompt` but its last chunk through the model, and returns that chunk: the
/// input of the pass that gives the first answer token's logits. Long prompts go through in
/// chunks, so activations stay bounded whatever the length. The last chunk has two tokens at
/// least (one more than a chunk at most): a one-token call is a decode step to a sparse
/// method, and a prompt's tokens are attended densely whatever its length — unless `pass`
/// asks for the tokens from an index on one at a time (then the last chunk is the last token).
fn prompt_head(
    model: &Model,
    attn: &dyn Attention,
    kv: &mut dyn KvStore,
    prompt: &[u32],
    pass: PromptPass,
) -> Result<Vec<u32>> {
    let chunked = match pass {
        PromptPass::Dense => prompt.len(),
        PromptPass::SparseFrom(from) => from.min(prompt.len()),
    };
    let (head, one_by_one) = prompt.split_at(chunked);
    let (dense, rest) = head.split_at(head.len().saturating_sub(2) / PREFILL_CHUNK * PREFILL_CHUNK);
    for chunk in dense.chunks(PREFILL_CHUNK) {
        model.forward(chunk, kv, attn, Logits::Last)?;
    }
    let Some((last, steps)) = one_by_one.split_last() else { return Ok(rest.to_vec()) };
    if !rest.is_empty() {
        model.forward(rest, kv, attn, Logits::Last)?;
    }
    for &token in steps {
        model.forward(&[token], kv, attn, Logits::Last)?;
    }
    Ok(vec![*last])
}

/// The model's next-token logits at every step of `answer` after `prompt` with `attn`, as
/// [`generate`] computed them when it produced `answer` (the same prompt pass, `pass`, then one
/// decode step per answer token but the last): what a comparison of two methods on one answer reads.
/// `on_step(done, total)` follows the steps; `Break` stops, and the logits so far come back.
pub fn teacher_forced(
    model: &Model,
    attn: &dyn Attention,
    kv: &mut dyn KvStore,
    prompt: &[u32],
    answer: &[u32],
    pass: PromptPass,
    mut on_step: impl FnMut(usize, usize) -> ControlFlow<()>,
) -> Result<Vec<Vec<f32>>> {
    if prompt.is_empty() {
        return Err(Error::Invalid("the prompt is empty".into()));
    }
    model.config().check_fits(kv.len() + prompt.len() + answer.len())?;
    attn.reset();
    kv.reserve(kv.len() + prompt.len() + answer.len())?;
    let mut input = prompt_head(model, attn, kv, prompt, pass)?;
    let mut logits = Vec::with_capacity(answer.len());
    for (i, &token) in answer.iter().enumerate() {
        let row = model.forward(&input, kv, attn, Logits::Last)?;
        logits.push(row.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?);
        input = vec![token];
        if on_step(i + 1, answer.len()).is_break() {
            break;
        }
    }
    Ok(logits)
}

/// Length of the prefix of `text` that can be shown: without a trailing partial character
/// (U+FFFD from an incomplete UTF-8 sequence) and without a tail that may begin a stop string.
fn safe_prefix_len(text: &str, stops: &[String]) -> usize {
    let visible = text.trim_end_matches('\u{FFFD}');
    let hold = stops
        .iter()
        .map(|stop| {
            // The longest proper prefix of the stop string that the text ends with.
            stop.char_indices()
                .map(|(i, _)| i)
                .filter(|&i| i > 0)
                .rev()
                .find(|&i| visible.ends_with(&stop[..i]))
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    visible.len() - hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</answer>".to_owned()];
        assert_eq!(safe_prefix_len("hello </ans", &stops), "hello ".len());
        assert_eq!(safe_prefix_len("hello world", &stops), "hello world".len());
        assert_eq!(safe_prefix_len("caf\u{FFFD}", &[]), 3);
        assert_eq!(safe_prefix_len("xaa", &["aab".to_owned()]), 1, "the longest partial match is held");
    }

    #[test]
    fn sampling_validation() {
        let mut p = SamplingParams { temperature: -1.0, ..Default::default() };
        assert!(p.validate().unwrap_err().to_string().contains("temperature"));
        p.temperature = 0.7;
        p.top_p = Some(1.5);
        assert!(p.validate().unwrap_err().to_string().contains("top_p"));
        p.top_p = Some(0.9);
        assert!(p.validate().is_ok());
        assert!(matches!(p.sampling(), Sampling::TopP { .. }));
    }
}
