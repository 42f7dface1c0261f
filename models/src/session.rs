//! Sessions: the one API the CLI's `chat` and the desktop window call to ask questions.
//!
//! A [`Session`] is a model plus what it has read: a saved context opened on a tier
//! ([`Tier::Resident`]: whole layers decoded into device memory on use; [`Tier::Offloaded`]: the
//! rows in host memory, each step moving only what the method picks), or nothing (the bare
//! model). [`Session::ask`] takes a [`Conversation`] (data: the turns so far), a question, a
//! [`MethodChoice`] and [`GenerationSettings`], streams the answer's text, appends both turns to
//! the conversation, and returns an [`Answer`]: text, tokens, the method's full settings, time
//! to first token and tokens/s, and what the attention read in each document.
//!
//! Why a session holds K/V between questions: a follow-up's tokens start with what the last
//! turn left in the store, so only the new turn is computed — the common prefix of what is held
//! and what the conversation renders to is kept, the rest recomputed. That makes forks and
//! reopened conversations work the same way: they render to another prefix and the store is cut
//! back to where they agree. What is held is what the turn's prompt pass computed (densely for
//! every method but BUZZ, whose cache starts afresh each turn), plus, for dense attention, the
//! answer's rows; a sparse
//! method's answer rows came from its sparse steps, and a rebuilt conversation (a reopened file,
//! the CLI's `--continue`) would compute them densely, so they are recomputed with the next turn
//! instead. Another method recomputes the conversation's turns (never the documents). So an
//! answer depends only on the context, the conversation and its own method: the window and the
//! CLI give the same follow-up.
//!
//! Rejected: rebuilding every turn from the messages (what the CLI did): each follow-up would
//! re-run the whole conversation through the model, which grows with the chat.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::attention::{Attention, Dense, IndexSource, MethodChoice, Resources, Tier};
use crate::attention::{Passage, ReadSummary, ReadTally, Weighing};
use crate::chat::Message;
use crate::context::ContextFile;
use crate::conversation::Conversation;
use crate::error::{Error, Result};
use crate::generate::{generate, GenerateParams, PromptPass, SamplingParams, StopReason};
use crate::kv_cache::ContextKv;
use crate::kv_cache::KvStore;
use crate::kv_cache::OffloadKv;
use crate::Engine;

/// Decoded context layers the resident tier keeps in device memory (the rest are decoded
/// again on use).
pub const RESIDENT_BUDGET: u64 = 8 << 30;

/// Tokens of a turn that are always run again, however much of it the store holds (see
/// [`Session::ask`]).
const MIN_RERUN: usize = 2;

/// Answer tokens when the settings do not say.
pub const DEFAULT_MAX_TOKENS: usize = 512;

/// How an answer is sampled: what the user sets; unset values come from the model's
/// generation_config.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct GenerationSettings {
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub seed: u64,
    /// Strings that end the answer (not part of it).
    pub stop: Vec<String>,
    /// The system message of a chat with the bare model. A saved context keeps the one it
    /// was prefilled with (it is part of its K/V): asking over one with another is refused.
    #[serde(default)]
    pub system: Option<String>,
}

impl Default for GenerationSettings {
    fn default() -> Self {
        Self {
            max_tokens: DEFAULT_MAX_TOKENS,
            temperature: None,
            top_p: None,
            top_k: None,
            repetition_penalty: None,
            seed: 0,
            stop: Vec::new(),
            system: None,
        }
    }
}

impl GenerationSettings {
    /// Refuses settings the decode loop would refuse (a negative temperature, a top-p outside
    /// (0, 1], no answer tokens), with the same messages, before any work.
    pub fn check(&self, engine: &Engine) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(Error::Invalid("max_tokens must be >= 1".into()));
        }
        self.params(engine).sampling.validate()
    }

    /// The decode loop's parameters for `engine`'s model.
    pub fn params(&self, engine: &Engine) -> GenerateParams {
        let defaults = engine.generation_config.sampling_defaults();
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.or(defaults.top_p),
            top_k: self.top_k.or(defaults.top_k),
            repetition_penalty: self.repetition_penalty.unwrap_or(defaults.repetition_penalty),
            seed: self.seed,
        };
        GenerateParams {
            max_new_tokens: self.max_tokens,
            sampling,
            stop_strings: self.stop.clone(),
            eos_token_ids: engine.eos_token_ids(),
            prompt_pass: PromptPass::Dense,
        }
    }
}

/// Seconds and rates of one answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Timings {
    /// From the question to the first answer token (the new turn's tokens computed first).
    pub first_token_s: Option<f64>,
    pub seconds: f64,
    /// Answer tokens after the first, per second of decoding.
    pub decode_tokens_per_s: Option<f64>,
}

/// What the attention read in one document while answering.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct DocumentRead {
    pub document: usize,
    pub title: String,
    pub path: String,
    pub rows: f64,
    /// Of every row read (documents, question and answer).
    pub share: f64,
    /// Of the attention mass of every row read, when the session weighs sources
    /// ([`Session::weigh_sources`]) and the calls could be weighed.
    #[serde(default)]
    pub mass_share: Option<f64>,
    /// Where in the document, heaviest first (a weighing session only; see
    /// [`crate::excerpt`] for their text).
    #[serde(default)]
    pub passages: Vec<Passage>,
}

/// One answer and how it was made.
#[derive(Debug, Clone, Serialize)]
pub struct Answer {
    pub text: String,
    pub tokens: Vec<u32>,
    pub stop_reason: StopReason,
    /// The method as asked for, and its full settings (budget resolved, every knob).
    pub method: MethodChoice,
    pub settings: serde_json::Value,
    /// Where each layer's index came from (methods with one).
    pub index: std::collections::BTreeMap<usize, IndexSource>,
    /// The conversation's tokens after the saved context, up to the answer.
    pub tail_tokens: Vec<u32>,
    /// Of those, how many the session already held (computed for an earlier answer).
    pub reused_tokens: usize,
    pub timings: Timings,
    /// The saved context's id ([`ContextFile::context_id`]): what the sources' positions refer
    /// to (`None` for the bare model).
    pub context: Option<String>,
    /// Documents read, most first (empty for the bare model).
    pub sources: Vec<DocumentRead>,
    pub reads: ReadSummary,
}

/// An answer next to dense attention's on the same context and turn (see
/// [`Session::compare_with_dense`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Comparison {
    /// The answer's method, with its full settings.
    #[cfg_attr(feature = "ts", ts(type = "Record<string, unknown>"))]
    pub settings: serde_json::Value,
    /// Answer tokens compared (fewer than the answer's when stopped).
    pub steps: usize,
    /// KL(dense ‖ method) of the next-token distributions along the answer, nats.
    pub mean_kl: f64,
    pub max_kl: f64,
    /// The step (0-based answer token) of the largest KL.
    pub max_kl_step: usize,
    /// Of the steps, those where dense's most likely token is the method's.
    pub top1_agreement: f64,
    /// The first step where they differ.
    pub first_disagreement: Option<usize>,
    /// Dense attention's own answer to the turn, with the same generation settings.
    pub dense_answer: String,
    /// Whether it is the answer's text.
    pub same_answer: bool,
    pub seconds: f64,
}

/// The saved context a session reads, and where its rows live.
struct Saved {
    file: Arc<ContextFile>,
    tier: Tier,
}

/// A model and what it has read; see the module docs.
pub struct Session {
    engine: Arc<Engine>,
    saved: Option<Saved>,
    kv: Box<dyn KvStore>,
    /// Tokens after the saved context whose K/V the store holds, computed by `method`.
    held: Vec<u32>,
    method: Option<Box<dyn Attention>>,
    resources: Resources,
    /// How answers weigh what they read (`attention::reads`).
    weigh: Weighing,
}

impl Session {
    /// Weighs each answer's sources by the attention mass of the rows read, not only their
    /// count: what a sources panel shows. It costs a pass over the visible keys per decode
    /// call (resident tier, up to `reads::MASS_MAX_ROWS` rows), so it is off by default.
    pub fn weigh_sources(&mut self, on: bool) {
        self.weigh = if on { Weighing::Copied } else { Weighing::Off };
    }

    /// [`Session::weigh_sources`] with the way chosen: the eval compares them.
    pub fn weigh_sources_by(&mut self, weighing: Weighing) {
        self.weigh = weighing;
    }

    /// A session over the context file at `path` with its rows on `tier`; refused when
    /// another model made it ([`Engine::check_context`]).
    pub fn open(engine: Arc<Engine>, path: &Path, tier: Tier) -> Result<Self> {
        let file = Arc::new(ContextFile::open(path)?);
        engine.check_context(&file)?;
        Self::over(engine, file, tier)
    }

    /// A session over an opened context file (already checked against `engine`).
    pub fn over(engine: Arc<Engine>, file: Arc<ContextFile>, tier: Tier) -> Result<Self> {
        Self::over_within(engine, file, tier, RESIDENT_BUDGET)
    }

    /// [`Session::over`], keeping at most `resident_budget` bytes of decoded layers in device
    /// memory on the resident tier (one layer at least; `crate::plan` says how many fit).
    pub fn over_within(engine: Arc<Engine>, file: Arc<ContextFile>, tier: Tier, resident_budget: u64) -> Result<Self> {
        let started = Instant::now();
        let (dtype, device) = (engine.model.dtype(), engine.model.device().clone());
        let kv: Box<dyn KvStore> = match tier {
            Tier::Resident => Box::new(ContextKv::new(file.clone(), dtype, &device, resident_budget)),
            Tier::Offloaded => Box::new(OffloadKv::from_context(file.clone(), dtype, &device)?),
        };
        tracing::info!(
            path = %file.path().display(), tokens = file.tokens().len(), tier = tier.name(),
            seconds = started.elapsed().as_secs_f64(), "context opened"
        );
        Ok(Self {
            engine,
            saved: Some(Saved { file, tier }),
            kv,
            held: Vec::new(),
            method: None,
            resources: Resources::default(),
            weigh: Weighing::Off,
        })
    }

    /// A session with the bare model (no documents).
    pub fn bare(engine: Arc<Engine>) -> Self {
        let kv = Box::new(engine.model.new_kv());
        Self {
            engine,
            saved: None,
            kv,
            held: Vec::new(),
            method: None,
            resources: Resources::default(),
            weigh: Weighing::Off,
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The context file, when the session has one.
    pub fn context(&self) -> Option<&ContextFile> {
        self.saved.as_ref().map(|s| s.file.as_ref())
    }

    pub fn tier(&self) -> Option<Tier> {
        self.saved.as_ref().map(|s| s.tier)
    }

    /// A new, empty conversation for this session.
    pub fn new_conversation(&self) -> Conversation {
        match self.context() {
            Some(file) => Conversation::over(file),
            None => Conversation::bare(None),
        }
    }

    /// Refuses `choice` when this session's tier cannot run it, with the registry's reason.
    pub fn check_method(&self, choice: &MethodChoice) -> Result<()> {
        choice.check()?;
        match self.tier() {
            Some(tier) => choice.spec()?.check_tier(tier),
            None => Ok(()),
        }
    }

    /// Asks `question` as the next turn of `conv` with `method`, streaming the answer's text
    /// to `on_text` (return `Break` to stop). On success both turns are appended to `conv`
    /// (a stopped answer with the text it had).
    pub fn ask(
        &mut self,
        conv: &mut Conversation,
        question: &str,
        method: &MethodChoice,
        settings: &GenerationSettings,
        on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Answer> {
        let started = Instant::now();
        conv.check_context(self.context())?;
        if question.trim().is_empty() {
            return Err(Error::Invalid("the question is empty".into()));
        }
        self.check_method(method)?;
        self.apply_system(conv, settings)?;
        let mut turns = conv.messages.clone();
        turns.push(Message::new("user", question));
        let tail = self.render(conv, &turns)?;
        let params = settings.params(&self.engine);
        self.use_method(method)?;
        let saved = self.kv.saved_len();
        // Keep what the store holds up to where it and this conversation part. Two tokens at
        // least run again: the logits of the answer's first token, from a multi-token (prompt)
        // pass as in a rebuilt conversation, not a decode step.
        let reused = common_prefix(&self.held, &tail).min(tail.len().saturating_sub(MIN_RERUN));
        self.kv.set_len(saved + reused)?;
        self.held.truncate(reused);
        let spans: Vec<(usize, usize)> =
            self.context().map(|f| f.documents().iter().map(|d| (d.start, d.end)).collect()).unwrap_or_default();
        let attn = self.method.as_deref().ok_or_else(|| Error::Invalid("no attention method".into()))?;
        // A turn starts the method's conversation state afresh (BUZZ's cache), as a rebuilt
        // conversation does: the turns it kept are recomputed by the prompt pass.
        attn.end_conversation();
        // The copy weighing reads the context's tokens: a handle, so the store can be borrowed.
        let file = self.saved.as_ref().map(|s| s.file.clone());
        let tally = match (self.weigh, &file) {
            (Weighing::Copied, Some(f)) => ReadTally::new(attn, spans).with_mass().with_copies(f.tokens()),
            (Weighing::Copied | Weighing::Mass, _) => ReadTally::new(attn, spans).with_mass(),
            (Weighing::Off, _) => ReadTally::new(attn, spans),
        };
        let engine = &self.engine;
        let before = started.elapsed().as_secs_f64();
        let result =
            generate(&engine.model, &engine.tokenizer, &tally, self.kv.as_mut(), &tail[reused..], &params, on_text);
        let generation = match result {
            Ok(g) => g,
            Err(e) => {
                // Layers may hold rows past the stored length: forget the turn (the error to
                // report is the generation's; a store that cannot be cut back fails the next ask).
                self.held.clear();
                let _ = self.kv.set_len(saved);
                return Err(e);
            }
        };
        // The store now holds the tail and every answer token but the last (never run); a
        // sparse method's answer rows are not kept (see the module docs).
        let stored = self.kv.len() - saved;
        let keep = if tally.name() == Dense::KNOBS.spec.name { stored } else { tail.len().min(stored) };
        self.held = tail.iter().chain(&generation.tokens).copied().take(keep).collect();
        let reads = tally.summary_of(&generation.tokens);
        let sources = match self.context() {
            Some(file) => reads
                .documents
                .iter()
                .map(|r| {
                    let d = &file.documents()[r.document];
                    DocumentRead {
                        document: r.document,
                        title: d.title.clone(),
                        path: d.path.clone(),
                        rows: r.rows,
                        share: r.share,
                        mass_share: r.mass_share,
                        passages: r
                            .passages
                            .iter()
                            .map(|p| Passage { part: d.part_at(p.start).map(str::to_owned), ..p.clone() })
                            .collect(),
                    }
                })
                .collect(),
            None => Vec::new(),
        };
        let seconds = started.elapsed().as_secs_f64();
        let first_token_s = generation.first_token_s.map(|t| before + t);
        let decode_tokens_per_s = match (generation.first_token_s, generation.tokens.len()) {
            (Some(first), n) if n > 1 && generation.seconds > first => {
                Some((n - 1) as f64 / (generation.seconds - first))
            }
            _ => None,
        };
        tracing::info!(
            context = self.context().map(|f| f.context_id()), method = tally.name(), prompt_tokens = tail.len(),
            reused_tokens = reused, answer_tokens = generation.tokens.len(), stop = ?generation.stop_reason,
            first_token_s, seconds, "answered"
        );
        turns.push(Message::new("assistant", &generation.text));
        conv.messages = turns;
        Ok(Answer {
            text: generation.text,
            tokens: generation.tokens,
            stop_reason: generation.stop_reason,
            method: method.clone(),
            settings: tally.settings(),
            index: tally.index_sources(),
            tail_tokens: tail,
            reused_tokens: reused,
            timings: Timings { first_token_s, seconds, decode_tokens_per_s },
            context: self.context().map(|f| f.context_id().to_owned()),
            sources,
            reads,
        })
    }

    /// A bare chat takes `settings`' system prompt (when it has one); a context keeps its own,
    /// and another is refused.
    fn apply_system(&self, conv: &mut Conversation, settings: &GenerationSettings) -> Result<()> {
        if let Some(system) = &settings.system {
            match self.context() {
                None => conv.system = Some(system.clone()).filter(|s| !s.trim().is_empty()),
                Some(file) if file.header().prompt.system.as_deref() != Some(system.as_str()) => {
                    return Err(Error::Invalid(format!(
                        "this context was prefilled with {}: its system prompt is part of its K/V; ask without one, \
                     or prefill the documents again with it",
                        match &file.header().prompt.system {
                            Some(s) => format!("the system prompt \"{s}\""),
                            None => "no system prompt".into(),
                        }
                    )));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Reruns a turn of `conv` (its messages before the question) with dense attention beside
    /// `method` on the same context: the next-token distributions along `answer` (the method's
    /// answer tokens, teacher-forced for both), their KL and top-1 agreement, and dense's own
    /// answer with `settings` — the eval-attention measure on the user's own question.
    /// `on_step(done, total)` follows the work (both passes, then dense's answer); `Break`
    /// stops it with an error. The store is cut back to the saved context after: the next
    /// question recomputes its conversation's turns.
    pub fn compare_with_dense(
        &mut self,
        conv: &Conversation,
        question: &str,
        answer: &[u32],
        method: &MethodChoice,
        settings: &GenerationSettings,
        mut on_step: impl FnMut(usize, usize) -> ControlFlow<()>,
    ) -> Result<Comparison> {
        let started = Instant::now();
        conv.check_context(self.context())?;
        self.check_method(method)?;
        if answer.is_empty() {
            return Err(Error::Invalid("the answer has no tokens to compare".into()));
        }
        let mut conv = conv.clone();
        self.apply_system(&mut conv, settings)?;
        let mut turns = conv.messages.clone();
        turns.push(Message::new("user", question));
        let tail = self.render(&conv, &turns)?;
        if choice_needs_resources(method) && self.resources.channels.is_none() {
            self.resources = self.engine.resources(std::slice::from_ref(method))?;
        }
        let sparse = method.build(&self.resources)?;
        let saved = self.kv.saved_len();
        // The store is reused below: what it held for the conversation is recomputed next turn.
        self.held.clear();
        let total = 3 * answer.len();
        let stopped = || Error::Invalid("the comparison was stopped".into());
        let model = &self.engine.model;
        let kv = self.kv.as_mut();
        // Each pass counts its steps into the whole; a Break from on_step stops the work.
        let broke = std::cell::Cell::new(false);
        let mut step = |done: usize| {
            let flow = on_step(done.min(total), total);
            broke.set(broke.get() || flow.is_break());
            flow
        };
        let outcome = (|| {
            kv.set_len(saved)?;
            let reference =
                crate::generate::teacher_forced(model, &Dense, kv, &tail, answer, PromptPass::Dense, |done, _| {
                    step(done)
                })?;
            if broke.get() {
                return Err(stopped());
            }
            kv.set_len(saved)?;
            let got = crate::generate::teacher_forced(
                model,
                sparse.as_ref(),
                kv,
                &tail,
                answer,
                Default::default(),
                |done, _| step(answer.len() + done),
            )?;
            if broke.get() {
                return Err(stopped());
            }
            kv.set_len(saved)?;
            let mut params = settings.params(&self.engine);
            params.max_new_tokens = params.max_new_tokens.max(answer.len());
            let mut done = 2 * answer.len();
            let dense = generate(model, &self.engine.tokenizer, &Dense, kv, &tail, &params, |_| {
                done += 1;
                step(done)
            })?;
            Ok::<_, Error>((reference, got, dense))
        })();
        kv.set_len(saved)?;
        if broke.get() {
            return Err(stopped());
        }
        let (reference, got, dense) = outcome?;
        let kls: Vec<f64> = reference.iter().zip(&got).map(|(p, q)| crate::distribution::kl_divergence(p, q)).collect();
        let agree: Vec<bool> = reference
            .iter()
            .zip(&got)
            .map(|(p, q)| crate::distribution::argmax(p) == crate::distribution::argmax(q))
            .collect();
        let steps = kls.len();
        let (max_kl_step, max_kl) =
            kls.iter().copied().enumerate().fold((0, 0.0), |best, (i, k)| if k > best.1 { (i, k) } else { best });
        let answer_text = self.engine.tokenizer.decode(answer, true)?;
        Ok(Comparison {
            settings: sparse.settings(),
            steps,
            mean_kl: kls.iter().sum::<f64>() / steps.max(1) as f64,
            max_kl,
            max_kl_step,
            top1_agreement: agree.iter().filter(|&&a| a).count() as f64 / steps.max(1) as f64,
            first_disagreement: agree.iter().position(|&a| !a),
            same_answer: dense.tokens == answer || dense.text.trim() == answer_text.trim(),
            dense_answer: dense.text,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// The conversation's tokens after the saved context (all of them for the bare model),
    /// ending with the generation prompt.
    fn render(&self, conv: &Conversation, turns: &[Message]) -> Result<Vec<u32>> {
        let tokens = match self.context() {
            Some(file) => self.engine.context_tail(&file.header().prompt, turns)?,
            None => {
                let system = conv.system.iter().map(|s| Message::new("system", s));
                let messages: Vec<Message> = system.chain(turns.iter().cloned()).collect();
                self.engine.chat_prompt(&messages)?
            }
        };
        if tokens.is_empty() {
            return Err(Error::Invalid("the conversation renders to no tokens".into()));
        }
        Ok(tokens)
    }

    /// Makes `choice` the session's method: the one it has when the settings are the same
    /// (its conversation state kept), else a new one, and then the held turns are dropped
    /// (another method computed them).
    fn use_method(&mut self, choice: &MethodChoice) -> Result<()> {
        if choice_needs_resources(choice) && self.resources.channels.is_none() {
            self.resources = self.engine.resources(std::slice::from_ref(choice))?;
        }
        let fresh = choice.build(&self.resources)?;
        let same = self.method.as_ref().is_some_and(|m| m.settings() == fresh.settings());
        if !same {
            if let Some(old) = self.method.take() {
                old.end_conversation();
            }
            self.method = Some(fresh);
            self.held.clear();
        }
        Ok(())
    }
}

fn choice_needs_resources(choice: &MethodChoice) -> bool {
    choice.spec().is_ok_and(|s| s.needs.calibration)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
