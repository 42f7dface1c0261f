//! Needle-in-a-haystack accuracy: synthetic documents of a target length with a planted fact
//! at a chosen depth (plus distractor facts), a question about it, greedy decoding, and an
//! exact check of the copied value. Prompts follow the model's eval_spec.json (algorithm in
//! docs/demo-model.md), so they come from the distribution the demo model was trained on.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::spec::EvalSpec;
use folio_models::attention::{Attention, Tier};
use folio_models::chat::Message;
use folio_models::context::{self, BuildOptions, ContextFile, PrefixPlan};
use folio_models::error::{Error, Result};
use folio_models::generate::{self, GenerateParams, PromptPass, SamplingParams, PREFILL_CHUNK};
use folio_models::kv_cache::KvStore;
use folio_models::kv_cache::OffloadKv;
use folio_models::prefill::PrefillMode;
use folio_models::Engine;

/// The context file a prompt's documents are prefilled into in `--kv-on-disk`'s folder.
const PROMPT_FILE: &str = "folio-eval-prompt.folio";

/// Tokens generated beyond the expected answer before giving up on it.
pub(crate) const EXTRA_ANSWER_TOKENS: usize = 4;

/// One test prompt and what a correct answer contains.
#[derive(Debug, Clone)]
pub struct NeedlePrompt {
    pub ids: Vec<u32>,
    pub value: String,
    pub answer: String,
    pub answer_prefix: String,
    /// Whether `ids` already end with the answer prefix (the model only copies the value).
    pub prefilled: bool,
    /// `ids[..documents_end]` is the chat up to the end of the documents: what a context file
    /// would hold; the rest (the question, the answer prefix) is what a conversation appends.
    pub documents_end: usize,
    /// Index of the filler sentence the target fact precedes, of `sentences`.
    pub target_index: usize,
    pub sentences: usize,
}

/// A fact placed before filler sentence `index` (or after the last one when `index == n`).
struct Placed {
    index: usize,
    text: String,
}

/// Where [`assemble`] puts a fact among the filler sentences.
pub(crate) enum Place {
    /// At this depth of the documents, 0 (start) to 1 (end).
    Depth(f64),
    /// At a uniformly random sentence.
    Anywhere,
    /// At a random sentence of another document than the first fact's.
    OtherDocument,
    /// At a uniformly random sentence, the `Ordered` facts kept in the order they are listed
    /// (an answer that lists them in document order knows that order).
    Ordered,
}

/// A prompt's tokens and where its parts are.
pub(crate) struct Assembled {
    pub ids: Vec<u32>,
    pub documents_end: usize,
    /// The sentence index of the first fact, of `sentences`.
    pub target_index: usize,
    pub sentences: usize,
}

/// What a prompt says, before the filler: see [`assemble`].
pub(crate) struct Parts<'p> {
    pub titles: &'p [String],
    /// Each fact's sentence and where it goes; the first is the one asked about.
    pub facts: &'p [(String, Place)],
    pub question: &'p str,
    /// The answer's opening words when prefilled, else empty.
    pub prefix_ids: Vec<u32>,
}

/// Builds a prompt of at most `length` tokens: documents under `titles` of filler sentences
/// with `facts` placed among them (the first fact first, by its [`Place`]), the question, and
/// `prefix_ids` after the generation prompt. The random draws come in a fixed order
/// (sentences, then each fact's place), so a cell's seed gives the same prompt on every run.
pub(crate) fn assemble(
    engine: &Engine,
    spec: &EvalSpec,
    length: usize,
    Parts { titles, facts, question, prefix_ids }: Parts<'_>,
    rng: &mut impl Rng,
) -> Result<Assembled> {
    // Fixed cost: the chat around documents that hold only their headers and the facts.
    let bare: Vec<Placed> = facts.iter().map(|(f, _)| Placed { index: 0, text: f.clone() }).collect();
    let (fixed_ids, _) = render(engine, spec, &documents(spec, titles, &[], &bare), question)?;
    let budget = length.checked_sub(fixed_ids.len() + prefix_ids.len()).ok_or_else(|| {
        Error::Invalid(format!(
            "length {length} is too short: the question and facts alone take {} tokens",
            fixed_ids.len() + prefix_ids.len()
        ))
    })?;

    let mut sentences = Vec::new();
    let mut used = 0;
    loop {
        let s = spec.sentence(rng)?;
        let n = engine.tokenizer.encode_prompt(&s)?.len();
        if used + n > budget {
            break;
        }
        used += n;
        sentences.push(s);
    }
    let n = sentences.len();
    let document_of = |i: usize| document_of(i, n, titles.len());
    let mut placed: Vec<Placed> = Vec::with_capacity(facts.len());
    for (text, place) in facts {
        let index = match place {
            Place::Depth(depth) => {
                if !(0.0..=1.0).contains(depth) {
                    return Err(Error::Invalid(format!("depth {depth} is outside 0..=1")));
                }
                (depth * n as f64).round() as usize
            }
            Place::Anywhere | Place::Ordered => rng.random_range(0..=n),
            Place::OtherDocument => {
                let first = placed.first().map(|p| document_of(p.index));
                // Some place must lie in another document, or the draw below would not end.
                if first.is_none() || (0..=n).all(|i| Some(document_of(i)) == first) {
                    return Err(Error::Invalid(format!(
                        "length {length} is too short to put two facts in different documents: \
                         its {n} filler sentences fill fewer than two of {} documents",
                        titles.len()
                    )));
                }
                loop {
                    let i = rng.random_range(0..=n);
                    if Some(document_of(i)) != first {
                        break i;
                    }
                }
            }
        };
        placed.push(Placed { index, text: text.clone() });
    }
    // The ordered facts take their drawn places sorted, in list order.
    let ordered: Vec<usize> = (0..facts.len()).filter(|&i| matches!(facts[i].1, Place::Ordered)).collect();
    let mut places: Vec<usize> = ordered.iter().map(|&i| placed[i].index).collect();
    places.sort_unstable();
    for (&i, index) in ordered.iter().zip(places) {
        placed[i].index = index;
    }
    let docs = documents(spec, titles, &sentences, &placed);
    let (mut ids, documents_end) = render(engine, spec, &docs, question)?;
    ids.extend(prefix_ids);
    Ok(Assembled { ids, documents_end, target_index: placed.first().map_or(0, |p| p.index), sentences: n })
}

/// Builds a prompt of at most `length` tokens with the target fact at `depth` (0 = start of
/// the documents, 1 = end), following docs/demo-model.md, "A needle prompt of length L".
pub fn build_prompt(
    engine: &Engine,
    spec: &EvalSpec,
    length: usize,
    depth: f64,
    rng: &mut impl Rng,
) -> Result<NeedlePrompt> {
    if !(0.0..=1.0).contains(&depth) {
        return Err(Error::Invalid(format!("depth {depth} is outside 0..=1")));
    }
    let task = &spec.tasks.needle;
    let n_docs = task.documents.max(1);
    let titles = (0..n_docs).map(|_| spec.title(rng)).collect::<Result<Vec<_>>>()?;
    let keys = spec.keys(1 + task.distractors, rng)?;
    let mut facts = Vec::with_capacity(keys.len());
    let mut target = None;
    for (i, key) in keys.iter().enumerate() {
        let relation = &task.relations[rng.random_range(0..task.relations.len())];
        let value = spec.value(rng);
        let fixed = [("relation", relation.as_str()), ("key", key.as_str()), ("value", value.as_str())];
        let place = if i == 0 { Place::Depth(depth) } else { Place::Anywhere };
        facts.push((spec.fill(&task.fact, &fixed, rng)?, place));
        if i == 0 {
            target = Some((
                spec.fill(&task.question, &fixed, rng)?,
                spec.fill(&task.answer, &fixed, rng)?,
                spec.fill(&task.answer_prefix, &fixed, rng)?,
                value,
            ));
        }
    }
    let (question, answer, answer_prefix, value) = target.expect("at least the target key");
    let prefilled = spec.chat.prefill_answer_prefix;
    let prefix_ids = if prefilled { engine.tokenizer.encode_prompt(&answer_prefix)? } else { Vec::new() };
    let parts = Parts { titles: &titles, facts: &facts, question: &question, prefix_ids };
    let Assembled { ids, documents_end, target_index, sentences } = assemble(engine, spec, length, parts, rng)?;
    Ok(NeedlePrompt { ids, value, answer, answer_prefix, prefilled, documents_end, target_index, sentences })
}

/// The document that holds sentence `i` of `n` split evenly over `k` documents (`i == n`, after
/// the last sentence, is the last document's), as [`documents`] splits them.
fn document_of(i: usize, n: usize, k: usize) -> usize {
    (0..k).rev().find(|&d| bound(d, n, k) <= i && (i < bound(d + 1, n, k) || d + 1 == k)).unwrap_or(0)
}

/// The first of `n` sentences in document `d` of `k` (the split of [`documents`]).
fn bound(d: usize, n: usize, k: usize) -> usize {
    ((d * n) as f64 / k as f64).round() as usize
}

/// The documents string: filler split evenly across documents, facts before the sentence they
/// were placed at (the target first among facts at one index).
fn documents(spec: &EvalSpec, titles: &[String], sentences: &[String], facts: &[Placed]) -> String {
    let d = &spec.document;
    let n = sentences.len();
    let k = titles.len();
    let bound = |d: usize| bound(d, n, k);
    let mut out = Vec::with_capacity(k);
    for (doc, title) in titles.iter().enumerate() {
        let (lo, hi) = (bound(doc), bound(doc + 1));
        let last = doc + 1 == k;
        // Facts at index i belong to the document that holds sentence i; index n to the last.
        let facts_at = |i: usize| facts.iter().filter(move |f| f.index == i).map(|f| f.text.as_str());
        let mut items: Vec<&str> = Vec::new();
        for (i, sentence) in sentences.iter().enumerate().take(hi).skip(lo) {
            items.extend(facts_at(i));
            items.push(sentence);
        }
        if last {
            items.extend(facts_at(n));
        }
        let header = d.header.replace("{title}", title);
        out.push(format!("{header}{}{}", d.header_separator, items.join(&d.sentence_separator)));
    }
    out.join(&d.document_separator)
}

fn messages(spec: &EvalSpec, docs: &str, question: &str) -> Vec<Message> {
    if spec.chat.documents_role == spec.chat.question_role {
        vec![Message::new(&spec.chat.question_role, &format!("{docs}\n{question}"))]
    } else {
        vec![Message::new(&spec.chat.documents_role, docs), Message::new(&spec.chat.question_role, question)]
    }
}

/// The chat prompt's tokens and how many of them come up to the end of `docs`: the template's
/// text after the documents, tokenized alone, counts the rest. The tokens stay as the whole
/// text gives them; only the split point could be a token off with a tokenizer that merges
/// across the boundary (BPE), which moves one token between documents and question.
fn render(engine: &Engine, spec: &EvalSpec, docs: &str, question: &str) -> Result<(Vec<u32>, usize)> {
    let template = engine.chat_template.as_ref().ok_or(Error::NoChatTemplate)?;
    let text = template.render(&messages(spec, docs, question), true)?;
    let ids = engine.tokenizer.encode_prompt(&text)?;
    let after = text
        .rfind(docs)
        .map(|at| &text[at + docs.len()..])
        .ok_or_else(|| Error::Invalid("the chat template does not copy the documents verbatim".into()))?;
    let tail = engine.tokenizer.encode_prompt(after)?.len();
    match ids.len().checked_sub(tail) {
        Some(end) if end > 0 => Ok((ids, end)),
        _ => Err(Error::Invalid(format!(
            "the chat's text after the documents takes {tail} tokens of a {}-token prompt",
            ids.len()
        ))),
    }
}

/// `value_match` from eval_spec.json: the characters after the (last) answer prefix up to the
/// next '.', spaces removed, must equal the value.
pub fn value_match(prompt: &NeedlePrompt, generated_text: &str) -> bool {
    let after = if prompt.prefilled {
        Some(generated_text)
    } else {
        generated_text.rfind(&prompt.answer_prefix).map(|at| &generated_text[at + prompt.answer_prefix.len()..])
    };
    after.is_some_and(|rest| {
        let digits: String = rest.split('.').next().unwrap_or("").chars().filter(|c| !c.is_whitespace()).collect();
        digits == prompt.value
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct NeedleSample {
    pub length: usize,
    pub depth: f64,
    pub sample: usize,
    pub prompt_tokens: usize,
    pub expected: String,
    pub output: String,
    pub correct: bool,
    /// This method's generation: the whole prompt on the resident tier, the question and the
    /// answer on the offloaded one.
    pub seconds: f64,
    /// The documents' prefill before it on the offloaded tier, shared by the methods run on the
    /// prompt (0 on the resident tier).
    pub prefill_seconds: f64,
    /// Bytes this method's run read from the context file, when the documents' rows are on the
    /// file tier (`--kv-on-disk` with a host budget smaller than them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

/// Where a prompt's documents are held while the methods decode after them: on the device (the
/// whole prompt each run: the resident tier), prefilled once into the offloaded tier in host
/// memory (`--offload`), or prefilled once into a context file in a folder and opened as the
/// app opens one — on the file tier when the host budget cannot hold it (`--kv-on-disk DIR`), or
/// on the file tier with a cache of the given bytes whatever the budget (`--kv-cache SIZE`).
#[derive(Debug, Clone)]
pub enum PromptTier {
    Resident,
    Offloaded,
    OnDisk(PathBuf, Option<u64>),
}

impl PromptTier {
    /// The decode tier the methods run on.
    pub fn tier(&self) -> Tier {
        match self {
            Self::Resident => Tier::Resident,
            Self::Offloaded | Self::OnDisk(..) => Tier::Offloaded,
        }
    }
}

/// The seed of one (length, depth, sample) cell: every cell reproducible on its own.
pub fn cell_seed(seed: u64, length: usize, depth: f64, sample: usize) -> u64 {
    // splitmix64 over the cell's coordinates: stable across platforms and Rust versions.
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15;
    for v in [length as u64, depth.to_bits(), sample as u64] {
        x = (x ^ v).wrapping_add(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
    }
    x
}

/// The prompt of one (length, depth, sample) cell: the same tokens on every run and machine.
pub fn cell_prompt(
    engine: &Engine,
    spec: &EvalSpec,
    (length, depth, sample): (usize, f64, usize),
    seed: u64,
) -> Result<NeedlePrompt> {
    build_prompt(engine, spec, length, depth, &mut StdRng::seed_from_u64(cell_seed(seed, length, depth, sample)))
}

/// Runs `prompt` (cell `(length, depth, sample)`, from [`cell_prompt`]) greedily with each of
/// `attns` and checks the answers (a sample per method, in order). On the offloaded tier its
/// documents are prefilled once, as `prefill` says (a sparse prefill only there), and each
/// method's question and answer overwrite the previous method's.
pub fn run_sample(
    engine: &Engine,
    prompt: &NeedlePrompt,
    attns: &[&dyn Attention],
    (tier, prefill): (&PromptTier, PrefillMode),
    (length, depth, sample): (usize, f64, usize),
) -> Result<Vec<NeedleSample>> {
    let expected = if prompt.prefilled { &prompt.value } else { &prompt.answer };
    let params = GenerateParams {
        max_new_tokens: engine.tokenizer.encode_prompt(expected)?.len() + EXTRA_ANSWER_TOKENS,
        sampling: SamplingParams::default(),
        stop_strings: Vec::new(),
        eos_token_ids: engine.eos_token_ids(),
        prompt_pass: Default::default(),
    };
    let scored = |text: String, prefill_seconds: f64, start: Instant, disk_bytes| NeedleSample {
        length,
        depth,
        sample,
        prompt_tokens: prompt.ids.len(),
        expected: expected.clone(),
        correct: value_match(prompt, &text),
        output: text,
        seconds: start.elapsed().as_secs_f64(),
        prefill_seconds,
        disk_bytes,
    };
    let quiet = |_: &str| ControlFlow::Continue(());
    let (mut store, prefill_seconds) = PromptStore::new(engine, &prompt.ids, prompt.documents_end, (tier, prefill))?;
    attns
        .iter()
        .map(|&attn| {
            let (start, read_before) = (Instant::now(), store.disk_bytes());
            let g = store.run(false, |kv, input, pass| {
                let params = GenerateParams { prompt_pass: pass, ..params.clone() };
                generate::generate(&engine.model, &engine.tokenizer, attn, kv, input, &params, quiet)
            });
            // The next prompt is another conversation; the method's device memory goes now.
            attn.end_conversation();
            let disk_bytes = store.disk_bytes().zip(read_before).map(|(after, before)| after - before);
            Ok(scored(g?.text, prefill_seconds, start, disk_bytes))
        })
        .collect()
}

/// Where each run of a prompt (each method's, each question mode's) starts: a fresh store
/// holding nothing on the resident tier, which gets the whole prompt; on the offloaded tier
/// the documents' rows, prefilled once, and the question after them.
pub(crate) struct PromptStore<'a> {
    engine: &'a Engine,
    ids: &'a [u32],
    /// `ids[..documents_end]` are the documents.
    documents_end: usize,
    /// The documents' rows on the offloaded tier; `None` on the resident one.
    offloaded: Option<Box<OffloadKv>>,
    /// The context file they were prefilled into (`--kv-on-disk`), removed with the store.
    file: Option<PathBuf>,
}

impl Drop for PromptStore<'_> {
    fn drop(&mut self) {
        // The store first: its mapping of the file goes before the file (Windows refuses to
        // delete a mapped file).
        self.offloaded = None;
        if let Some(path) = &self.file {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl<'a> PromptStore<'a> {
    /// The store and the seconds its documents' prefill (of `prefill`'s kind) took (0 on the
    /// resident tier, which prefills densely with each run and refuses a sparse prefill).
    pub(crate) fn new(
        engine: &'a Engine,
        ids: &'a [u32],
        documents_end: usize,
        (tier, prefill): (&PromptTier, PrefillMode),
    ) -> Result<(Self, f64)> {
        let started = Instant::now();
        let documents = &ids[..documents_end];
        let (offloaded, file) = match tier {
            PromptTier::Resident if prefill != PrefillMode::Dense => {
                return Err(Error::Invalid(
                    "a sparse prefill is of documents held offloaded: give --offload (the resident tier prefills \
                     each run's whole prompt densely)"
                        .into(),
                ))
            }
            PromptTier::Resident => (None, None),
            PromptTier::Offloaded => (
                Some(folio_models::prefill::prefill_offloaded(&engine.model, documents, PREFILL_CHUNK, prefill)?),
                None,
            ),
            PromptTier::OnDisk(dir, cache) => {
                let path = dir.join(PROMPT_FILE);
                let plan = PrefixPlan::raw_tokens(documents.to_vec());
                let opts = BuildOptions { prefill, ..BuildOptions::new(context::DEFAULT_KV_DTYPE) };
                let stamp = engine.stamp()?;
                context::build(&engine.model, stamp, &plan, &path, &opts, &mut |_| ControlFlow::Continue(()))?;
                let file = Arc::new(ContextFile::open(&path)?);
                let (dtype, device) = (engine.model.dtype(), engine.model.device());
                let kv = match cache {
                    Some(bytes) => OffloadKv::on_file(file, *bytes, dtype, device)?,
                    None => OffloadKv::from_context(file, dtype, device)?,
                };
                (Some(kv), Some(path))
            }
        };
        let prefill_seconds = if offloaded.is_some() { started.elapsed().as_secs_f64() } else { 0.0 };
        Ok((Self { engine, ids, documents_end, offloaded: offloaded.map(Box::new), file }, prefill_seconds))
    }

    /// Bytes read from the context file so far, when the rows are on the file tier.
    pub(crate) fn disk_bytes(&self) -> Option<u64> {
        self.offloaded.as_ref()?.file_stats().map(|s| s.bytes_read)
    }

    /// Calls `f` with a store that holds what precedes its input, the input (the whole prompt,
    /// or the question after the prefilled documents) and the prompt pass: the question one
    /// token at a time when `sparse`.
    pub(crate) fn run<R>(
        &mut self,
        sparse: bool,
        f: impl FnOnce(&mut dyn KvStore, &[u32], PromptPass) -> Result<R>,
    ) -> Result<R> {
        let pass = |from| if sparse { PromptPass::SparseFrom(from) } else { PromptPass::Dense };
        match &mut self.offloaded {
            None => f(&mut self.engine.model.new_kv(), self.ids, pass(self.documents_end)),
            Some(kv) => {
                // The documents only: the previous run's question, answer and resident layers go.
                kv.set_len(self.documents_end)?;
                kv.drop_resident();
                f(kv.as_mut(), &self.ids[self.documents_end..], pass(0))
            }
        }
    }
}
