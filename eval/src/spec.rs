//! `eval_spec.json`: the prompt distribution a demo model was trained on, shipped beside its
//! weights so that Folio can generate test prompts without the training code. The format and
//! the generation algorithm are documented in docs/demo-model.md; tools/demo_prompts.py is the
//! Python reference of the same algorithm.

use std::collections::BTreeMap;
use std::path::Path;

use rand::Rng;
use serde::Deserialize;

use folio_models::error::{Error, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct EvalSpec {
    pub format: String,
    pub version: u32,
    pub chat: ChatSpec,
    pub document: DocumentSpec,
    pub filler: FillerSpec,
    pub keys: KeySpec,
    pub value: ValueSpec,
    pub tasks: TaskSpecs,
    /// The RULER-style suite (version 2; the yardstick model's spec): absent from specs of
    /// models not trained on it.
    #[serde(default)]
    pub ruler: Option<RulerSpec>,
    #[serde(default)]
    pub eval_defaults: Option<EvalDefaults>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatSpec {
    /// Role of the message that holds the documents ("system" or "user").
    pub documents_role: String,
    /// Role of the message that holds the question.
    pub question_role: String,
    /// Whether the prompt ends with the answer prefix after the generation prompt, so the model
    /// only has to copy the value ("prefilled" evaluation).
    #[serde(default)]
    pub prefill_answer_prefix: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DocumentSpec {
    pub header: String,
    pub title_templates: Vec<String>,
    pub sentence_separator: String,
    pub header_separator: String,
    pub document_separator: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct FillerSpec {
    pub templates: Vec<String>,
    pub slots: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub number_slots: BTreeMap<String, NumberSlot>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
pub struct NumberSlot {
    pub digits_min: u32,
    pub digits_max: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct KeySpec {
    pub format: String,
    pub adjectives: Vec<String>,
    pub nouns: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ValueSpec {
    pub digits: usize,
    pub alphabet: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TaskSpecs {
    pub needle: NeedleSpec,
    /// Chains of references ("the value of q is the value of x ."): absent from specs of
    /// models not trained on them.
    #[serde(default)]
    pub variable_tracking: Option<ChainSpec>,
    /// Two facts asked in one question, in different documents.
    #[serde(default)]
    pub multi_doc: Option<PairSpec>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChainSpec {
    /// The fact at the chain's end, "the value of {var} is {value} .".
    pub fact: String,
    /// One hop, "the value of {var} is the value of {source} .".
    pub link: String,
    pub variables: Vec<String>,
    pub question: String,
    /// The answer's opening words, with `{var0}` the asked variable.
    pub answer_prefix: String,
    pub hops: usize,
    pub distractors: usize,
    pub documents: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PairSpec {
    pub fact: String,
    pub relations: Vec<String>,
    /// "what is the {relation} of {key} and the {relation2} of {key2} ?"
    pub question: String,
    pub distractors: usize,
    pub documents: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct NeedleSpec {
    pub fact: String,
    pub relations: Vec<String>,
    pub question: String,
    pub answer: String,
    pub answer_prefix: String,
    pub distractors: usize,
    pub documents: usize,
}

/// The suite's sentence forms and eval settings (tools/yardstick_tasks.py writes them; docs/yardstick.md
/// says what each task asks).
#[derive(Debug, Clone, Deserialize)]
pub struct RulerSpec {
    /// "the {relation} of {key} is {value} ." and its question and answer.
    pub fact: String,
    pub relations: Vec<String>,
    pub question: String,
    pub answer: String,
    pub answer_prefix: String,
    /// The words `frequent` counts, and the names that see and feed.
    pub animals: Vec<String>,
    pub names: Vec<String>,
    pub multi_key: MultiKeySpec,
    pub multi_value: MultiValueSpec,
    pub near_dup: NearDupSpec,
    pub deep_chain: DeepChainSpec,
    pub count: CountSpec,
    pub frequent: FrequentSpec,
    pub two_hop: TwoHopSpec,
    pub recite: ReciteSpec,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MultiKeySpec {
    /// Other facts, each key sharing a word with the asked one.
    pub distractors: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MultiValueSpec {
    /// "what are all the {relation} values of {key} ?"
    pub question: String,
    pub values: usize,
    pub distractors: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct NearDupSpec {
    /// The asked key under other relations.
    pub same_key: usize,
    /// The asked relation of keys sharing a word with the asked one.
    pub same_relation: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DeepChainSpec {
    pub hops: usize,
    pub distractors: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CountSpec {
    /// "{name} saw the {key} ."
    pub sighting: String,
    pub question: String,
    /// "the {key} was seen {count} times ."
    pub answer: String,
    pub answer_prefix: String,
    /// The asked key's sightings, uniform in min..=max.
    pub min: usize,
    pub max: usize,
    /// Other keys (sharing a word with it), each seen 1..=other_max times.
    pub other_keys: usize,
    pub other_max: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct FrequentSpec {
    /// "{name} fed a {animal} ."
    pub feeding: String,
    pub question: String,
    pub answer: String,
    pub answer_prefix: String,
    pub winner_min: usize,
    pub winner_max: usize,
    /// Other animals, each fed at least `gap` times fewer than the winner (and at least once).
    pub others: usize,
    pub gap: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TwoHopSpec {
    /// "the friend of {key} is {key2} ."
    pub link: String,
    pub question: String,
    pub answer_prefix: String,
    /// Other friendships, each with its friend's fact.
    pub distractors: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ReciteSpec {
    /// "the {key} passage :" and "end of the {key} passage .": the passage between them.
    pub open: String,
    pub close: String,
    pub question: String,
    pub answer_prefix: String,
    /// The passage's filler sentences take at least `min_tokens` and are cut before `max_tokens`.
    pub min_tokens: usize,
    pub max_tokens: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct EvalDefaults {
    pub lengths: Vec<usize>,
    pub depths: Vec<f64>,
    pub samples: usize,
}

/// The format name this reader understands, and the newest version.
const FORMAT: &str = "folio-demo-eval-spec";
/// Version 2 added the `ruler` section (the RULER-style suite); version 1 files read unchanged.
const VERSION: u32 = 2;

impl EvalSpec {
    /// Reads `eval_spec.json` from a model folder; a model without one cannot be evaluated
    /// this way, and the error says so.
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("eval_spec.json");
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::Invalid(format!(
                "{}: {e}: `folio eval needle` needs a model trained on Folio's synthetic retrieval task \
                 (such as assets/models/demo), which ships an eval_spec.json",
                path.display()
            ))
        })?;
        let spec: Self =
            serde_json::from_str(&text).map_err(|e| Error::InvalidConfig { path: path.clone(), msg: e.to_string() })?;
        if spec.format != FORMAT || spec.version > VERSION {
            return Err(Error::InvalidConfig {
                path,
                msg: format!("format {} v{} is not {FORMAT} v{VERSION} or older", spec.format, spec.version),
            });
        }
        Ok(spec)
    }

    /// Fills every `{slot}` of `template` left to right: a fixed value, else a uniform choice
    /// from the filler word lists, else a random number of the slot's digit range.
    pub fn fill(&self, template: &str, fixed: &[(&str, &str)], rng: &mut impl Rng) -> Result<String> {
        let mut out = String::with_capacity(template.len() + 16);
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            let close = rest[open..]
                .find('}')
                .map(|c| open + c)
                .ok_or_else(|| Error::Invalid(format!("unclosed slot in template {template:?}")))?;
            out.push_str(&rest[..open]);
            let name = &rest[open + 1..close];
            if let Some((_, v)) = fixed.iter().find(|(k, _)| *k == name) {
                out.push_str(v);
            } else if let Some(words) = self.filler.slots.get(name) {
                out.push_str(&words[rng.random_range(0..words.len())]);
            } else if let Some(n) = self.filler.number_slots.get(name) {
                let d = rng.random_range(n.digits_min..=n.digits_max);
                let lo = if d == 1 { 1 } else { 10u64.pow(d - 1) };
                out.push_str(&rng.random_range(lo..10u64.pow(d)).to_string());
            } else {
                return Err(Error::Invalid(format!("no value for slot {{{name}}} in template {template:?}")));
            }
            rest = &rest[close + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    pub fn sentence(&self, rng: &mut impl Rng) -> Result<String> {
        let t = &self.filler.templates[rng.random_range(0..self.filler.templates.len())];
        self.fill(t, &[], rng)
    }

    pub fn title(&self, rng: &mut impl Rng) -> Result<String> {
        let t = &self.document.title_templates[rng.random_range(0..self.document.title_templates.len())];
        self.fill(t, &[], rng)
    }

    /// `n` distinct keys such as "amber falcon".
    pub fn keys(&self, n: usize, rng: &mut impl Rng) -> Result<Vec<String>> {
        let possible = self.keys.adjectives.len() * self.keys.nouns.len();
        if n > possible {
            return Err(Error::Invalid(format!("{n} distinct keys asked of a spec that has {possible}")));
        }
        let mut keys: Vec<String> = Vec::with_capacity(n);
        while keys.len() < n {
            let adj = &self.keys.adjectives[rng.random_range(0..self.keys.adjectives.len())];
            let noun = &self.keys.nouns[rng.random_range(0..self.keys.nouns.len())];
            let key = self.fill(&self.keys.format, &[("adj", adj), ("noun", noun)], rng)?;
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        Ok(keys)
    }

    pub fn value(&self, rng: &mut impl Rng) -> String {
        let alphabet: Vec<char> = self.value.alphabet.chars().collect();
        (0..self.value.digits).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect()
    }
}
