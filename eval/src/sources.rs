//! Do an answer's sources point at the fact? One long document of prose and records with each
//! fact of the sample questions (assets/SAMPLES.md) planted once, at spread depths — no
//! repetition, so exactly one passage holds each fact — prefilled into a context file; every
//! question asked through the session, as the window asks it (sources weighed), per method;
//! a question passes when its answer is the documented one and the first passage of its first
//! source overlaps one of the facts the answer was copied from.
//!
//! Why this yardstick: a sources panel is judged by its first line. On a long context the
//! attention's mass goes mostly to sinks, the recent rows and whatever the layers that do not
//! copy look at, so a panel ranked by raw mass marks a title and unrelated lists (issue #44's
//! 20k-token case); this measures where the first mark lands, for each method and length.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::spec::EvalSpec;
use folio_models::attention::{MethodChoice, Weighing};
use folio_models::context::{self, BuildOptions, ContextFile, DocumentText, KvDtype};
use folio_models::error::{Error, Result};
use folio_models::session::{GenerationSettings, Session};
use folio_models::Engine;

/// Tokens an answer may take: the longest sample answer (two facts) is 28.
const ANSWER_TOKENS: usize = 40;

/// Lines of records, in the samples' own kinds (assets/samples/market_records.txt), filled
/// from the model's word lists: numbers everywhere, item lists, the same words again and
/// again — what a sources panel must see past. Between them, the model's prose filler.
const RECORDS: [&str; 6] = [
    "order {num} : {name} bought {num} {plural} for {num} coins .",
    "item {num} : {num} {plural} , {adj} , stored in the {place} .",
    "entry {num} : the {noun} weighs {num} kilograms .",
    "report {num} : the {place} had {num} visitors {time} .",
    "record {num} : {name} , age {num} , from the {place} .",
    "list {num} : {noun} , {noun} , {noun} and {noun} .",
];

/// Of the filler's lines, the share that are records.
const RECORD_SHARE: f64 = 0.5;

/// A sample question and its documented answer, whose sentences are the facts it copies.
#[derive(Debug, Clone, Serialize)]
pub struct SampleQuestion {
    pub question: String,
    pub answer: String,
}

impl SampleQuestion {
    /// The answer's sentences ("… is 4 8 1 5 2 ."): each one is a fact planted in the document.
    pub fn facts(&self) -> Vec<String> {
        self.answer.split_inclusive(" .").map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect()
    }
}

/// The questions of a SAMPLES.md table: rows `| question | expected answer | file |`.
pub fn sample_questions(markdown: &str) -> Result<Vec<SampleQuestion>> {
    let rows: Vec<SampleQuestion> = markdown
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.trim().strip_prefix('|')?.split('|').map(str::trim).collect();
            let (question, answer) = (cells.first()?, cells.get(1)?);
            (question.ends_with('?') && !answer.is_empty())
                .then(|| SampleQuestion { question: (*question).to_owned(), answer: (*answer).to_owned() })
        })
        .collect();
    match rows.is_empty() {
        true => Err(Error::Invalid("no question rows (| question ? | answer | file |) in the samples table".into())),
        false => Ok(rows),
    }
}

/// The document: filler to about `length` tokens with every question's facts once each.
pub struct FactDocument {
    pub text: String,
    /// The distinct facts, in the order they appear.
    pub facts: Vec<String>,
}

/// Builds the document from the model's filler sentences (its eval_spec.json) and records
/// ([`RECORDS`]) with `seed`.
/// Facts go at spread depths: the i-th of k at a random point of the i-th k-th of the text.
pub fn fact_document(
    engine: &Engine,
    spec: &EvalSpec,
    questions: &[SampleQuestion],
    length: usize,
    seed: u64,
) -> Result<FactDocument> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut facts: Vec<String> = Vec::new();
    for f in questions.iter().flat_map(SampleQuestion::facts) {
        if !facts.contains(&f) {
            facts.push(f);
        }
    }
    let fact_tokens: usize =
        facts.iter().map(|f| engine.tokenizer.encode_prompt(f).map(|t| t.len())).sum::<Result<usize>>()?;
    let budget = length.checked_sub(fact_tokens).ok_or_else(|| {
        Error::Invalid(format!("length {length} is too short: the facts alone take {fact_tokens} tokens"))
    })?;
    let mut sentences = Vec::new();
    let mut used = 0;
    loop {
        let s = match rng.random_bool(RECORD_SHARE) {
            true => spec.fill(RECORDS[rng.random_range(0..RECORDS.len())], &[], &mut rng)?,
            false => spec.sentence(&mut rng)?,
        };
        let n = engine.tokenizer.encode_prompt(&s)?.len();
        if used + n > budget {
            break;
        }
        used += n;
        sentences.push(s);
    }
    // Shuffle the facts' order, then put fact i in the i-th stretch of sentences.
    for i in (1..facts.len()).rev() {
        facts.swap(i, rng.random_range(0..=i));
    }
    let (n, k) = (sentences.len(), facts.len());
    let mut at: Vec<usize> = (0..k).map(|i| (i * n) / k + rng.random_range(0..(n / k).max(1))).collect();
    at.iter_mut().for_each(|a| *a = (*a).min(n));
    let mut parts: Vec<&str> = Vec::with_capacity(n + k);
    let mut next = 0;
    for (i, s) in sentences.iter().enumerate() {
        while next < k && at[next] == i {
            parts.push(&facts[next]);
            next += 1;
        }
        parts.push(s);
    }
    parts.extend(facts[next..].iter().map(String::as_str));
    Ok(FactDocument { text: parts.join(" "), facts })
}

/// Prefills `doc` alone into `out` (the product's default K/V dtype unless `kv_dtype`).
pub fn prefill(engine: &Engine, doc: &FactDocument, out: &Path, kv_dtype: Option<KvDtype>) -> Result<ContextFile> {
    let text = DocumentText {
        title: "notes.txt".into(),
        path: "notes.txt".into(),
        bytes: doc.text.len() as u64,
        xxh3: context::format::checksum(doc.text.as_bytes()),
        kind: "text".into(),
        text: doc.text.clone(),
        parts: Vec::new(),
    };
    let plan = engine.plan_context(&[text], None, None)?;
    let opts = BuildOptions::new(kv_dtype.unwrap_or(context::DEFAULT_KV_DTYPE));
    context::build(&engine.model, engine.stamp()?, &plan, out, &opts, &mut |_| ControlFlow::Continue(()))?;
    Ok(ContextFile::open(out)?)
}

/// Where a fact's tokens are in the context: `start..end` positions.
fn find(haystack: &[u32], needle: &[u32]) -> Option<(usize, usize)> {
    match needle.is_empty() {
        true => None,
        false => haystack.windows(needle.len()).position(|w| w == needle).map(|s| (s, s + needle.len())),
    }
}

/// One question asked with one method.
#[derive(Debug, Clone, Serialize)]
pub struct SourcesRow {
    pub method: String,
    pub question: String,
    pub answer: String,
    pub answered: bool,
    /// The facts' positions in the context.
    pub facts: Vec<(usize, usize)>,
    /// The first source's passages, in the order shown, `start..end`.
    pub passages: Vec<(usize, usize)>,
    /// The first passage overlaps a fact.
    pub first_holds_fact: bool,
    /// The rank (1-based) of the first shown passage that overlaps a fact, if any does.
    pub fact_rank: Option<usize>,
    /// The passages are where the answer copied from (not the mass fallback).
    pub by_copies: bool,
    pub seconds: f64,
}

/// Asks every question with every method over `file` (on `tier`), sources weighed by
/// `weighing`; each row goes to `on_row` as it is made.
pub fn run(
    engine: &Arc<Engine>,
    file: Arc<ContextFile>,
    tier: folio_models::attention::Tier,
    questions: &[SampleQuestion],
    methods: &[MethodChoice],
    weighing: Weighing,
    on_row: &mut dyn FnMut(&SourcesRow),
) -> Result<Vec<SourcesRow>> {
    let tokens = file.tokens().to_vec();
    let mut session = Session::over(engine.clone(), file, tier)?;
    session.weigh_sources_by(weighing);
    let settings = GenerationSettings { max_tokens: ANSWER_TOKENS, ..GenerationSettings::default() };
    let mut rows = Vec::new();
    for method in methods {
        for q in questions {
            let facts = q
                .facts()
                .iter()
                .map(|f| {
                    let ids = engine.tokenizer.encode_prompt(f)?;
                    find(&tokens, &ids).ok_or_else(|| Error::Invalid(format!("the fact \"{f}\" is not in the context")))
                })
                .collect::<Result<Vec<_>>>()?;
            let mut conv = session.new_conversation();
            let answer = session.ask(&mut conv, &q.question, method, &settings, |_| ControlFlow::Continue(()))?;
            let passages: Vec<(usize, usize)> = answer
                .sources
                .first()
                .map(|s| s.passages.iter().map(|p| (p.start, p.end)).collect())
                .unwrap_or_default();
            let holds = |&(a, b): &(usize, usize)| facts.iter().any(|&(s, e)| a < e && s < b);
            let row = SourcesRow {
                method: method.to_string(),
                question: q.question.clone(),
                answered: normalized(&answer.text) == normalized(&q.answer),
                answer: answer.text.trim().to_owned(),
                first_holds_fact: passages.first().is_some_and(holds),
                fact_rank: passages.iter().position(holds).map(|i| i + 1),
                by_copies: answer.reads.copied,
                passages,
                facts,
                seconds: answer.timings.seconds,
            };
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Lower case, single spaces: the samples' comparison ("case and punctuation don't matter").
fn normalized(s: &str) -> String {
    s.to_lowercase().split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_table_rows_and_their_facts() {
        let md = "| question | expected answer | file |\n| --- | --- | --- |\n\
                  | what is y ? | the value of y is the value of x . the value of x is 5 2 . | d.txt |\n\
                  | not a question | x | y |\n";
        let q = sample_questions(md).unwrap();
        assert_eq!(q.len(), 1);
        assert_eq!(q[0].facts(), ["the value of y is the value of x .", "the value of x is 5 2 ."]);
        assert!(sample_questions("no table").is_err());
        assert_eq!(find(&[1, 2, 3, 2, 3], &[2, 3]), Some((1, 3)));
        assert_eq!(find(&[1, 2], &[]), None);
    }
}
