//! Prompts whose answer must read the documents while it is generated (issue #21).
//!
//! A needle answer is mostly decided before the method is asked: the question is prefilled
//! densely over every row, so the fact can reach the question's own K/V, and with the answer's
//! opening words prefilled only the value is left to copy. These tasks put document reads
//! *inside* the generated span, so a method that cannot see the documents fails there:
//!
//! * **chain** — "what is the value of q ?" over "the value of q is the value of x . … the
//!   value of x is 52981 .": the answer walks the chain one hop per generated sentence, and
//!   each hop's variable (then the value) is copied from a document row the method must pick
//!   at that step (the spec's `variable_tracking`, which the demo model was trained on).
//! * **pair** — two facts in two different documents asked in one question: the second fact's
//!   key is in the question, but its value is copied after the first answer is written (the
//!   spec's `multi_doc`).
//! * **needle** — the single fact, kept as the baseline the others are compared with; its
//!   prompts are exactly `folio eval needle`'s (same cell seeds).
//! * the RULER-style suite of [`crate::ruler`] (multi_key, multi_value, near_dup, deep_chain,
//!   count, frequent, two_hop, recite), for models whose spec has its `ruler` section.
//!
//! Every prompt is reproducible from its cell (task, length, depth, sample) and seed, and is
//! scored exactly: the generated tokens must begin with the expected answer's tokens.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::needle::{self, assemble, Assembled, Parts, Place};
use crate::ruler::{self, Draw, RulerTask};
use crate::spec::{ChainSpec, EvalSpec};
use folio_models::error::{Error, Result};
use folio_models::Engine;

/// What a prompt asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    Needle,
    Chain,
    Pair,
    MultiKey,
    MultiValue,
    NearDup,
    DeepChain,
    Count,
    Frequent,
    TwoHop,
    Recite,
}

impl Task {
    pub const ALL: [Task; 11] = [
        Task::Needle,
        Task::Chain,
        Task::Pair,
        Task::MultiKey,
        Task::MultiValue,
        Task::NearDup,
        Task::DeepChain,
        Task::Count,
        Task::Frequent,
        Task::TwoHop,
        Task::Recite,
    ];
    /// The tasks the demo model was trained on: the first of ALL.
    pub const DEMO: &[Task] = Self::ALL.as_slice().split_at(3).0;
    /// The RULER-style suite (the yardstick model's tasks): the rest of ALL.
    pub const SUITE: &[Task] = Self::ALL.as_slice().split_at(3).1;

    pub fn name(self) -> &'static str {
        match self {
            Task::Needle => "needle",
            Task::Chain => "chain",
            Task::Pair => "pair",
            Task::MultiKey => "multi_key",
            Task::MultiValue => "multi_value",
            Task::NearDup => "near_dup",
            Task::DeepChain => "deep_chain",
            Task::Count => "count",
            Task::Frequent => "frequent",
            Task::TwoHop => "two_hop",
            Task::Recite => "recite",
        }
    }

    /// The suite's draw for this task, if it is one of the suite's (deep_chain is a chain).
    fn ruler(self) -> Option<RulerTask> {
        Some(match self {
            Task::MultiKey => RulerTask::MultiKey,
            Task::MultiValue => RulerTask::MultiValue,
            Task::NearDup => RulerTask::NearDup,
            Task::Count => RulerTask::Count,
            Task::Frequent => RulerTask::Frequent,
            Task::TwoHop => RulerTask::TwoHop,
            Task::Recite => RulerTask::Recite,
            Task::Needle | Task::Chain | Task::Pair | Task::DeepChain => return None,
        })
    }

    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|t| t.name() == s).ok_or_else(|| {
            Error::Invalid(format!("unknown task \"{s}\": the tasks are {}", Self::ALL.map(Task::name).join(", ")))
        })
    }

    /// Mixed into a cell's seed; the needle's is 0, so its prompts are `folio eval needle`'s.
    fn salt(self) -> u64 {
        match self {
            Task::Needle => 0,
            Task::Chain => 0xC4A1_0000_0000_0001,
            Task::Pair => 0x9A12_0000_0000_0002,
            // the suite's: its place in ALL, above the demo tasks' salts
            other => 0x5017_0000_0000_0000 + Task::ALL.iter().position(|t| *t == other).unwrap_or(0) as u64,
        }
    }
}

/// One test prompt and the answer a right one writes.
#[derive(Debug, Clone)]
pub struct TaskPrompt {
    pub task: Task,
    pub ids: Vec<u32>,
    /// `ids[..documents_end]` is the chat up to the end of the documents (what a context file
    /// holds); the rest is the question and, when prefilled, the answer's opening words.
    pub documents_end: usize,
    /// What a right answer writes after `ids`, up to its stop token.
    pub expected: String,
    pub expected_ids: Vec<u32>,
    /// The values the answer copies from the documents, in the answer's order.
    pub values: Vec<String>,
}

impl TaskPrompt {
    /// Exact scoring: the generated tokens begin with the expected answer's (what follows, the
    /// stop token or extra words, is not judged).
    pub fn correct(&self, generated: &[u32]) -> bool {
        generated.starts_with(&self.expected_ids)
    }

    /// How many of the answer's values the generated text holds at their place: each value
    /// must follow the words that come before it in the expected answer (since the previous
    /// value) and be followed by the words that follow it there up to the end of its sentence
    /// (or by nothing: a generation cut there), spaces ignored — so a wrong first value does
    /// not hide a right second one, "123456" is not "12345", "whale whale was fed" is not
    /// "whale was fed", and a recited sentence is found after a wrong one.
    pub fn values_right(&self, generated_text: &str) -> usize {
        let squeeze = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
        let (got, want) = (squeeze(generated_text), squeeze(&self.expected));
        let (mut right, mut from, mut got_from) = (0, 0, 0);
        for value in &self.values {
            let value = squeeze(value);
            let Some(at) = want.get(from..).and_then(|w| w.find(value.as_str())).map(|i| from + i) else { break };
            let words = &want[from..at];
            let end = at + value.len();
            // the value and the rest of its sentence, unless the value is a sentence itself
            let tail = if value.ends_with('.') { "" } else { want[end..].split_inclusive('.').next().unwrap_or("") };
            let whole = format!("{value}{tail}");
            let after = got.get(got_from..).unwrap_or("");
            // a value right after the previous one (recited sentences) is looked for whole, so a
            // wrong sentence does not make the ones after it wrong too
            let start = if words.is_empty() && from > 0 {
                Some(after.find(whole.as_str()).map_or(got_from, |i| got_from + i))
            } else {
                after.find(words).map(|i| got_from + i + words.len())
            };
            let Some(start) = start else { break };
            let rest = got.get(start..).unwrap_or("");
            if rest.starts_with(whole.as_str()) || (rest.len() >= value.len() && whole.starts_with(rest)) {
                right += 1;
            }
            // on past what the output has of the value, so a value cut short or too long does
            // not carry the next value's lead-in away with it
            let kept: usize =
                rest.chars().zip(value.chars()).take_while(|(a, b)| a == b).map(|(a, _)| a.len_utf8()).sum();
            (from, got_from) = (end, start + kept);
        }
        right
    }
}

/// The prompt of one (task, length, depth, sample) cell: the same tokens on every run.
pub fn cell_prompt(
    engine: &Engine,
    spec: &EvalSpec,
    task: Task,
    (length, depth, sample): (usize, f64, usize),
    seed: u64,
) -> Result<TaskPrompt> {
    let mut rng = StdRng::seed_from_u64(needle::cell_seed(seed ^ task.salt(), length, depth, sample));
    build(engine, spec, task, length, depth, &mut rng)
}

/// Builds a `task` prompt of at most `length` tokens, its first fact (the needle, the chain's
/// value, the pair's first fact) at `depth` of the documents and the others at random places.
pub fn build(
    engine: &Engine,
    spec: &EvalSpec,
    task: Task,
    length: usize,
    depth: f64,
    rng: &mut impl Rng,
) -> Result<TaskPrompt> {
    let prefilled = spec.chat.prefill_answer_prefix;
    let missing = |what: &str| {
        Error::Invalid(format!(
            "this model's eval_spec.json has no tasks.{what}: it was not trained on the {task:?} task"
        ))
    };
    let (titles, facts, question, answer, prefix, values) = match task {
        Task::Needle => {
            let p = needle::build_prompt(engine, spec, length, depth, rng)?;
            let expected = if p.prefilled { expected_after(&p.answer, &p.answer_prefix)? } else { p.answer.clone() };
            return finish(engine, task, p.ids, p.documents_end, expected, vec![p.value]);
        }
        Task::Chain | Task::DeepChain => {
            let t = spec.tasks.variable_tracking.as_ref().ok_or_else(|| missing("variable_tracking"))?;
            let deep;
            let t = if task == Task::DeepChain {
                let r = ruler::suite_of(spec, task.name())?;
                deep = ChainSpec { hops: r.deep_chain.hops, distractors: r.deep_chain.distractors, ..t.clone() };
                &deep
            } else {
                t
            };
            let titles = (0..t.documents.max(1)).map(|_| spec.title(rng)).collect::<Result<Vec<_>>>()?;
            let wanted = t.hops + 1 + t.distractors;
            if wanted > t.variables.len() {
                return Err(Error::Invalid(format!(
                    "{wanted} variables asked of a spec that has {}",
                    t.variables.len()
                )));
            }
            let mut names: Vec<&str> = Vec::with_capacity(wanted);
            while names.len() < wanted {
                let v = t.variables[rng.random_range(0..t.variables.len())].as_str();
                if !names.contains(&v) {
                    names.push(v);
                }
            }
            let (chain, others) = names.split_at(t.hops + 1);
            let value = spec.value(rng);
            let fact = |var: &str, value: &str, rng: &mut _| spec.fill(&t.fact, &[("var", var), ("value", value)], rng);
            let link = |j: usize, rng: &mut _| spec.fill(&t.link, &[("var", chain[j]), ("source", chain[j - 1])], rng);
            let mut facts = vec![(fact(chain[0], &value, rng)?, Place::Depth(depth))];
            for j in 1..chain.len() {
                facts.push((link(j, rng)?, Place::Anywhere));
            }
            for other in others {
                let v = spec.value(rng);
                facts.push((fact(other, &v, rng)?, Place::Anywhere));
            }
            // The answer walks the chain from the asked variable down, then states the value.
            let mut parts = (1..chain.len()).rev().map(|j| link(j, rng)).collect::<Result<Vec<_>>>()?;
            parts.push(fact(chain[0], &value, rng)?);
            let asked = chain[chain.len() - 1];
            let question = spec.fill(&t.question, &[("var", asked)], rng)?;
            let prefix = spec.fill(&t.answer_prefix, &[("var0", asked)], rng)?;
            (titles, facts, question, parts.join(" "), prefix, vec![value])
        }
        Task::Pair => {
            let t = spec.tasks.multi_doc.as_ref().ok_or_else(|| missing("multi_doc"))?;
            let n = &spec.tasks.needle;
            let titles = (0..t.documents.max(2)).map(|_| spec.title(rng)).collect::<Result<Vec<_>>>()?;
            let keys = spec.keys(2 + t.distractors, rng)?;
            let mut facts = Vec::with_capacity(keys.len());
            let mut asked = Vec::with_capacity(2);
            for (i, key) in keys.iter().enumerate() {
                let relation = t.relations[rng.random_range(0..t.relations.len())].clone();
                let value = spec.value(rng);
                let fixed = [("relation", relation.as_str()), ("key", key.as_str()), ("value", value.as_str())];
                let place = match i {
                    0 => Place::Depth(depth),
                    1 => Place::OtherDocument,
                    _ => Place::Anywhere,
                };
                facts.push((spec.fill(&t.fact, &fixed, rng)?, place));
                if i < 2 {
                    asked.push((relation, key.clone(), value));
                }
            }
            let answer_of = |(relation, key, value): &(String, String, String), rng: &mut _| {
                spec.fill(&n.answer, &[("relation", relation), ("key", key), ("value", value)], rng)
            };
            let answer = format!("{} {}", answer_of(&asked[0], rng)?, answer_of(&asked[1], rng)?);
            let ((r1, k1, _), (r2, k2, _)) = (&asked[0], &asked[1]);
            let fixed =
                [("relation", r1.as_str()), ("key", k1.as_str()), ("relation2", r2.as_str()), ("key2", k2.as_str())];
            let question = spec.fill(&t.question, &fixed, rng)?;
            let prefix = spec.fill(&n.answer_prefix, &fixed, rng)?;
            let values = asked.into_iter().map(|(_, _, v)| v).collect();
            (titles, facts, question, answer, prefix, values)
        }
        suite => {
            let t = suite.ruler().ok_or_else(|| Error::Invalid(format!("{suite:?} is not a suite task")))?;
            let Draw { titles, facts, question, answer, prefix, values } = ruler::draw(engine, spec, t, depth, rng)?;
            (titles, facts, question, answer, prefix, values)
        }
    };
    let prefix_ids = if prefilled { engine.tokenizer.encode_prompt(&prefix)? } else { Vec::new() };
    let parts = Parts { titles: &titles, facts: &facts, question: &question, prefix_ids };
    let Assembled { ids, documents_end, .. } = assemble(engine, spec, length, parts, rng)?;
    let expected = if prefilled { expected_after(&answer, &prefix)? } else { answer };
    finish(engine, task, ids, documents_end, expected, values)
}

/// The answer's words after its prefilled opening words.
fn expected_after(answer: &str, prefix: &str) -> Result<String> {
    answer
        .strip_prefix(prefix)
        .map(|rest| rest.trim_start().to_owned())
        .ok_or_else(|| Error::Invalid(format!("the answer {answer:?} does not begin with its prefix {prefix:?}")))
}

fn finish(
    engine: &Engine,
    task: Task,
    ids: Vec<u32>,
    documents_end: usize,
    expected: String,
    values: Vec<String>,
) -> Result<TaskPrompt> {
    let expected_ids = engine.tokenizer.encode_prompt(&expected)?;
    Ok(TaskPrompt { task, ids, documents_end, expected, expected_ids, values })
}
