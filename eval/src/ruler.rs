//! The RULER-style suite (issue #49): the tasks that tell sparse methods apart where a single
//! needle cannot, in the fact grammar of the yardstick model's `eval_spec.json` (`ruler`).
//!
//! RULER (Hsieh et al. 2024) showed that models and methods that pass a single needle fail
//! once the context holds many similar keys, several values of one key, chains of references
//! or facts to aggregate. Each task here draws the facts and the answer; [`crate::tasks`]
//! assembles the prompt around them and scores it exactly, as for the demo's tasks:
//!
//! * **multi_key** — the asked fact among facts whose keys share a word with it.
//! * **multi_value** — every value of one key, listed in document order.
//! * **near_dup** — the asked fact among near-duplicates: its key under other relations, its
//!   relation of keys that share a word with it, values sharing digits with its value.
//! * **deep_chain** — a chain of references of the spec's hops (4+), walked in the answer.
//! * **count** — how many times one key was seen; every sighting must be read.
//! * **frequent** — the animal fed most often: the most frequent word of a scattered list.
//! * **two_hop** — a key's friend (at the cell's depth), then the friend's fact (half the
//!   documents away), the second found while the answer is written.
//! * **recite** — a marked passage of filler sentences written out in full (≥ 64 tokens): the
//!   decode must find the next rows at every step.
//!
//! The spread tasks (multi_value, count, frequent) put their facts anywhere; the others put
//! the asked fact at the cell's depth.

use rand::Rng;

use crate::needle::Place;
use crate::spec::{EvalSpec, RulerSpec};
use folio_models::error::{Error, Result};
use folio_models::Engine;

/// What a suite prompt says before [`crate::needle::assemble`] adds the filler.
pub(crate) struct Draw {
    pub titles: Vec<String>,
    pub facts: Vec<(String, Place)>,
    pub question: String,
    /// The whole answer, and its opening words (prefilled when the spec says so).
    pub answer: String,
    pub prefix: String,
    /// What a partial score counts, in the answer's order.
    pub values: Vec<String>,
}

/// The suite's tasks, by the name the spec and the CLI use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RulerTask {
    MultiKey,
    MultiValue,
    NearDup,
    Count,
    Frequent,
    TwoHop,
    Recite,
}

/// Documents a suite prompt spreads its filler over.
const DOCUMENTS: usize = 3;
/// Near-duplicate values share a run of two digits with the answer's, so values have at least 2.
const MIN_VALUE_DIGITS: usize = 2;
/// Sentences drawn for a recited passage before its token window is called impossible.
const RECITE_DRAWS: usize = 10_000;

fn pick<'a>(items: &'a [String], rng: &mut impl Rng) -> &'a str {
    &items[rng.random_range(0..items.len())]
}

/// How many different words a list holds (an edited spec may repeat one).
fn distinct(words: &[String]) -> usize {
    words.iter().collect::<std::collections::BTreeSet<_>>().len()
}

/// "the {relation} of {key} is {value} .", the suite's fact.
fn kv_fact(
    spec: &EvalSpec,
    r: &RulerSpec,
    (rel, key, value): (&str, &str, &str),
    rng: &mut impl Rng,
) -> Result<String> {
    spec.fill(&r.fact, &[("relation", rel), ("key", key), ("value", value)], rng)
}

/// `n` distinct keys other than `key`, each sharing its adjective or its noun.
fn confusable(spec: &EvalSpec, key: &str, n: usize, rng: &mut impl Rng) -> Result<Vec<String>> {
    let (adj, noun) = key.split_once(' ').ok_or_else(|| Error::Invalid(format!("key {key:?} is not two words")))?;
    let possible = (distinct(&spec.keys.adjectives) + distinct(&spec.keys.nouns)).saturating_sub(2);
    if n > possible {
        return Err(Error::Invalid(format!(
            "{n} keys sharing a word with {key:?} asked of a spec that has {possible}"
        )));
    }
    let mut out: Vec<String> = Vec::with_capacity(n);
    while out.len() < n {
        let k = if rng.random_bool(0.5) {
            format!("{adj} {}", pick(&spec.keys.nouns, rng))
        } else {
            format!("{} {noun}", pick(&spec.keys.adjectives, rng))
        };
        if k != key && !out.contains(&k) {
            out.push(k);
        }
    }
    Ok(out)
}

/// A value sharing a run of 2+ digits with `v` and differing from it.
fn similar_value(spec: &EvalSpec, v: &str, rng: &mut impl Rng) -> String {
    let digits: Vec<char> = v.chars().collect();
    let mut w: Vec<char> = spec.value(rng).chars().collect();
    let start = rng.random_range(0..digits.len() - 1);
    let run = rng.random_range(2..=(digits.len() - start).min(w.len()));
    w[..run].copy_from_slice(&digits[start..start + run]);
    if w == digits {
        let last = w.len() - 1;
        w[last] = char::from_digit((w[last].to_digit(10).unwrap_or(0) + 1) % 10, 10).unwrap_or('0');
    }
    w.into_iter().collect()
}

/// The spec's suite, or an error saying the model was not trained on `task`.
pub(crate) fn suite_of<'s>(spec: &'s EvalSpec, task: &str) -> Result<&'s RulerSpec> {
    spec.ruler.as_ref().ok_or_else(|| {
        Error::Invalid(format!(
            "this model's eval_spec.json has no `ruler` section: it was not trained on the suite's {task} task \
             (the yardstick model is, docs/yardstick.md)"
        ))
    })
}

/// Draws the facts and answer of `task` with its first fact at `depth`.
pub(crate) fn draw(engine: &Engine, spec: &EvalSpec, task: RulerTask, depth: f64, rng: &mut impl Rng) -> Result<Draw> {
    let r = suite_of(spec, &format!("{task:?}"))?;
    let titles = (0..DOCUMENTS).map(|_| spec.title(rng)).collect::<Result<Vec<_>>>()?;
    let kv = |rel: &str, key: &str, value: &str, rng: &mut _| kv_fact(spec, r, (rel, key, value), rng);
    let asked = |rel: &str, key: &str, rng: &mut _| -> Result<(String, String)> {
        let fixed = [("relation", rel), ("key", key)];
        Ok((spec.fill(&r.question, &fixed, rng)?, spec.fill(&r.answer_prefix, &fixed, rng)?))
    };
    if spec.value.digits < MIN_VALUE_DIGITS {
        return Err(Error::Invalid(format!(
            "the suite's values need at least {MIN_VALUE_DIGITS} digits (near-duplicates share a run of two); \
             this spec's have {}",
            spec.value.digits
        )));
    }
    let rel = pick(&r.relations, rng).to_owned();
    let key = spec.keys(1, rng)?.remove(0);
    let d = match task {
        RulerTask::MultiKey | RulerTask::NearDup => {
            let value = spec.value(rng);
            let mut facts = vec![(kv(&rel, &key, &value, rng)?, Place::Depth(depth))];
            if task == RulerTask::MultiKey {
                for k in confusable(spec, &key, r.multi_key.distractors, rng)? {
                    let (rel2, v) = (pick(&r.relations, rng).to_owned(), spec.value(rng));
                    facts.push((kv(&rel2, &k, &v, rng)?, Place::Anywhere));
                }
            } else {
                let others: Vec<&String> = r.relations.iter().filter(|x| **x != rel).collect();
                for other in others.iter().cycle().take(r.near_dup.same_key) {
                    let v = similar_value(spec, &value, rng);
                    facts.push((kv(other, &key, &v, rng)?, Place::Anywhere));
                }
                for k in confusable(spec, &key, r.near_dup.same_relation, rng)? {
                    let v = similar_value(spec, &value, rng);
                    facts.push((kv(&rel, &k, &v, rng)?, Place::Anywhere));
                }
            }
            let (question, prefix) = asked(&rel, &key, rng)?;
            Draw { answer: kv(&rel, &key, &value, rng)?, facts, question, prefix, values: vec![value], titles }
        }
        RulerTask::MultiValue => multi_value(spec, r, (&rel, &key), titles, rng)?,
        RulerTask::Count => count(spec, r, &key, titles, rng)?,
        RulerTask::Frequent => frequent(spec, r, titles, rng)?,
        RulerTask::TwoHop => {
            let keys = spec.keys(2 + 2 * r.two_hop.distractors, rng)?;
            let value = spec.value(rng);
            let link = |a: &str, b: &str, rng: &mut _| spec.fill(&r.two_hop.link, &[("key", a), ("key2", b)], rng);
            let far = if depth < 0.5 { depth + 0.5 } else { depth - 0.5 };
            let mut facts = vec![
                (link(&keys[0], &keys[1], rng)?, Place::Depth(depth)),
                (kv(&rel, &keys[1], &value, rng)?, Place::Depth(far)),
            ];
            for pair in keys[2..].chunks(2) {
                facts.push((link(&pair[0], &pair[1], rng)?, Place::Anywhere));
                let (rel2, v) = (pick(&r.relations, rng).to_owned(), spec.value(rng));
                facts.push((kv(&rel2, &pair[1], &v, rng)?, Place::Anywhere));
            }
            let answer = format!("{} {}", link(&keys[0], &keys[1], rng)?, kv(&rel, &keys[1], &value, rng)?);
            let fixed = [("relation", rel.as_str()), ("key", keys[0].as_str())];
            let question = spec.fill(&r.two_hop.question, &fixed, rng)?;
            let prefix = spec.fill(&r.two_hop.answer_prefix, &fixed, rng)?;
            Draw { facts, question, answer, prefix, values: vec![keys[1].clone(), value], titles }
        }
        RulerTask::Recite => recite(engine, spec, r, &key, depth, titles, rng)?,
    };
    Ok(d)
}

fn multi_value(
    spec: &EvalSpec,
    r: &RulerSpec,
    (rel, key): (&str, &str),
    titles: Vec<String>,
    rng: &mut impl Rng,
) -> Result<Draw> {
    let kv = |rel: &str, key: &str, value: &str, rng: &mut _| kv_fact(spec, r, (rel, key, value), rng);
    let values: Vec<String> = (0..r.multi_value.values).map(|_| spec.value(rng)).collect();
    let mut facts = Vec::new();
    for v in &values {
        facts.push((kv(rel, key, v, rng)?, Place::Ordered));
    }
    for k in confusable(spec, key, r.multi_value.distractors, rng)? {
        let v = spec.value(rng);
        facts.push((kv(rel, &k, &v, rng)?, Place::Anywhere));
    }
    let answer = values.iter().map(|v| kv(rel, key, v, rng)).collect::<Result<Vec<_>>>()?.join(" ");
    let fixed = [("relation", rel), ("key", key)];
    let question = spec.fill(&r.multi_value.question, &fixed, rng)?;
    let prefix = spec.fill(&r.answer_prefix, &fixed, rng)?;
    Ok(Draw { titles, facts, question, answer, prefix, values })
}

fn count(spec: &EvalSpec, r: &RulerSpec, key: &str, titles: Vec<String>, rng: &mut impl Rng) -> Result<Draw> {
    let c = &r.count;
    if c.min == 0 || c.min > c.max || c.max > 9 || c.other_max == 0 {
        return Err(Error::Invalid(format!(
            "the count task's counts must be single digits with 1 <= min <= max (min {}, max {}, other_max {})",
            c.min, c.max, c.other_max
        )));
    }
    let sighting = |k: &str, rng: &mut _| spec.fill(&c.sighting, &[("key", k), ("name", pick(&r.names, rng))], rng);
    let n = rng.random_range(c.min..=c.max);
    let mut facts = Vec::new();
    for _ in 0..n {
        facts.push((sighting(key, rng)?, Place::Anywhere));
    }
    for k in confusable(spec, key, c.other_keys, rng)? {
        for _ in 0..rng.random_range(1..=c.other_max) {
            facts.push((sighting(&k, rng)?, Place::Anywhere));
        }
    }
    let n = n.to_string();
    let fixed = [("key", key), ("count", n.as_str())];
    Ok(Draw {
        titles,
        facts,
        question: spec.fill(&c.question, &fixed, rng)?,
        answer: spec.fill(&c.answer, &fixed, rng)?,
        prefix: spec.fill(&c.answer_prefix, &fixed, rng)?,
        values: vec![n],
    })
}

fn frequent(spec: &EvalSpec, r: &RulerSpec, titles: Vec<String>, rng: &mut impl Rng) -> Result<Draw> {
    let f = &r.frequent;
    let distinct_animals = distinct(&r.animals);
    if f.gap == 0 || f.winner_min < f.gap + 1 || f.winner_min > f.winner_max || f.others + 1 > distinct_animals {
        return Err(Error::Invalid(format!(
            "the frequent task needs 1 <= gap < winner_min <= winner_max and fewer other animals than the \
             spec's {distinct_animals} distinct ones (winner_min {}, gap {}, others {})",
            f.winner_min, f.gap, f.others
        )));
    }
    let mut animals: Vec<&str> = Vec::with_capacity(f.others + 1);
    while animals.len() < f.others + 1 {
        let a = pick(&r.animals, rng);
        if !animals.contains(&a) {
            animals.push(a);
        }
    }
    let m = rng.random_range(f.winner_min..=f.winner_max);
    let mut facts = Vec::new();
    for (i, a) in animals.iter().enumerate() {
        let times = if i == 0 { m } else { rng.random_range(1..=m - f.gap) };
        for _ in 0..times {
            facts.push((spec.fill(&f.feeding, &[("animal", a), ("name", pick(&r.names, rng))], rng)?, Place::Anywhere));
        }
    }
    let fixed = [("animal", animals[0])];
    Ok(Draw {
        titles,
        facts,
        question: spec.fill(&f.question, &fixed, rng)?,
        answer: spec.fill(&f.answer, &fixed, rng)?,
        prefix: spec.fill(&f.answer_prefix, &fixed, rng)?,
        values: vec![animals[0].to_owned()],
    })
}

fn recite(
    engine: &Engine,
    spec: &EvalSpec,
    r: &RulerSpec,
    key: &str,
    depth: f64,
    titles: Vec<String>,
    rng: &mut impl Rng,
) -> Result<Draw> {
    let t = &r.recite;
    let mut sentences: Vec<String> = Vec::new();
    let mut tokens = 0;
    for draws in 0.. {
        if tokens >= t.min_tokens {
            break;
        }
        if draws == RECITE_DRAWS {
            return Err(Error::Invalid(format!(
                "no passage of {}..{} tokens came of {RECITE_DRAWS} filler sentences: widen recite's window",
                t.min_tokens, t.max_tokens
            )));
        }
        let s = spec.sentence(rng)?;
        let n = engine.tokenizer.encode_prompt(&s)?.len();
        if tokens + n >= t.max_tokens {
            continue; // a sentence that would overshoot: draw another
        }
        tokens += n;
        sentences.push(s);
    }
    let fixed = [("key", key)];
    let open = spec.fill(&t.open, &fixed, rng)?;
    let close = spec.fill(&t.close, &fixed, rng)?;
    let passage = format!("{open} {} {close}", sentences.join(" "));
    Ok(Draw {
        titles,
        facts: vec![(passage.clone(), Place::Depth(depth))],
        question: spec.fill(&t.question, &fixed, rng)?,
        answer: passage,
        prefix: spec.fill(&t.answer_prefix, &fixed, rng)?,
        values: sentences,
    })
}
