//! The RULER-style suite's prompts (issue #49) on the yardstick's language
//! (tests/fixtures/models/yardstick-tiny: the yardstick's tokenizer and spec, random weights):
//! every prompt fits its length, reads only known words, and says what its answer claims —
//! the counted sightings are there that many times, the winner is fed most, the values are in
//! the documents in the answer's order, the recited passage is in the documents word for word
//! — and the expected answer scores right while an altered one does not.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use folio_eval::spec::EvalSpec;
use folio_eval::tasks::{self, Task, TaskPrompt};
use folio_models::Engine;
use rand::rngs::StdRng;
use rand::SeedableRng;

#[path = "../../kernels/tests/common/mod.rs"]
mod common;
mod prompt_checks;

fn yardstick_tiny() -> (Engine, EvalSpec) {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/yardstick-tiny");
    (Engine::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32).unwrap(), EvalSpec::load(&dir).unwrap())
}

/// Text as the tokenizer writes it back (digits spaced, punctuation apart).
fn canon(engine: &Engine, text: &str) -> String {
    engine.tokenizer.decode(&engine.tokenizer.encode_prompt(text).unwrap(), false).unwrap()
}

fn occurrences(hay: &str, needle: &str) -> usize {
    hay.matches(needle).count()
}

/// What a wrong model might write for `value`: another number, the word twice, or the
/// sentence without its last word.
fn altered(value: &str) -> String {
    if value.chars().all(|c| c.is_ascii_digit()) {
        value.chars().map(|c| if c == '9' { '0' } else { (c as u8 + 1) as char }).collect()
    } else if let Some(body) = value.strip_suffix(" .") {
        format!("{} .", body.rsplit_once(' ').map_or("", |(head, _)| head))
    } else {
        format!("{value} {value}")
    }
}

/// The words between `before` and `after` in `text` (the asked key of a question).
fn between<'a>(text: &'a str, before: &str, after: &str) -> &'a str {
    let start = text.rfind(before).unwrap() + before.len();
    text[start..][..text[start..].find(after).unwrap()].trim()
}

fn check_scoring(engine: &Engine, p: &TaskPrompt, at: &str) {
    let expected = engine.tokenizer.decode(&p.expected_ids, true).unwrap();
    assert!(p.correct(&p.expected_ids), "{at}");
    assert_eq!(p.values_right(&expected), p.values.len(), "{at}: {expected:?}");
    // the last value altered (its last copy: a recited sentence may come twice)
    let (last, n) = (canon(engine, p.values.last().unwrap()), p.values.len());
    let at_last = expected.rfind(&last).unwrap();
    let wrong = format!(
        "{}{}{}",
        &expected[..at_last],
        canon(engine, &altered(p.values.last().unwrap())),
        &expected[at_last + last.len()..]
    );
    assert!(!p.correct(&engine.tokenizer.encode_prompt(&wrong).unwrap()), "{at}: {wrong:?}");
    assert_eq!(p.values_right(&wrong), n - 1, "{at}: {wrong:?}");
    if n > 1 {
        // the first value cut short (a digit or a word missing) costs it alone
        let first = canon(engine, &p.values[0]);
        let short = match first.rsplit_once(' ') {
            Some((head, _)) if first.ends_with(" .") => format!("{} .", head.rsplit_once(' ').map_or("", |(h, _)| h)),
            Some((head, _)) => head.to_owned(),
            None => String::new(),
        };
        let cut = expected.replacen(&first, &short, 1);
        assert_eq!(p.values_right(&cut), n - 1, "{at}: {cut:?}");
    }
}

#[test]
fn suite_prompts_say_what_their_answers_claim() {
    let (engine, spec) = yardstick_tiny();
    let r = spec.ruler.clone().expect("the yardstick's spec has the suite");
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &task in Task::SUITE {
        for (length, depth) in [(1024, 0.0), (2048, 0.5), (3072, 1.0)] {
            let p = tasks::build(&engine, &spec, task, length, depth, &mut rng).unwrap();
            let at = format!("seed {seed}, {task:?} at {length}/{depth}");
            let (docs, tail) = prompt_checks::documents_and_question(&engine, &p, length, &at);
            let facts = ["secret code of", "access code of", "room number of", "lucky number of"]
                .map(|rel| occurrences(&docs, rel))
                .iter()
                .sum::<usize>();
            match task {
                Task::MultiKey => assert_eq!(facts, 1 + r.multi_key.distractors, "{at}"),
                Task::NearDup => assert_eq!(facts, 1 + r.near_dup.same_key + r.near_dup.same_relation, "{at}"),
                Task::MultiValue => {
                    assert_eq!(p.values.len(), r.multi_value.values, "{at}");
                    let places: Vec<usize> = p.values.iter().map(|v| docs.find(&canon(&engine, v)).unwrap()).collect();
                    assert!(places.windows(2).all(|w| w[0] < w[1]), "{at}: values out of document order {places:?}");
                }
                Task::DeepChain => {
                    // after the prefilled "the value of q is": the first hop's source, the other
                    // hops (two mentions each) and the fact
                    let mentions = occurrences(&p.expected, "the value of");
                    assert_eq!(mentions, 2 * r.deep_chain.hops, "{at}: {:?}", p.expected);
                    assert!(occurrences(&docs, "the value of") >= 2 * r.deep_chain.hops + 1 + r.deep_chain.distractors);
                }
                Task::Count => {
                    let key = between(&tail, "how many times was the", "seen");
                    let seen = occurrences(&docs, &format!("saw the {key} ."));
                    assert_eq!(seen.to_string(), p.values[0], "{at}: {key:?}");
                    assert!((r.count.min..=r.count.max).contains(&seen), "{at}");
                }
                Task::Frequent => {
                    let fed = |animal: &str| occurrences(&docs, &format!("fed a {animal} ."));
                    let winner = fed(&p.values[0]);
                    let others: Vec<usize> = r.animals.iter().filter(|a| **a != p.values[0]).map(|a| fed(a)).collect();
                    assert_eq!(others.iter().filter(|n| **n > 0).count(), r.frequent.others, "{at}");
                    assert!(others.iter().all(|n| n + r.frequent.gap <= winner), "{at}: {winner} vs {others:?}");
                }
                Task::TwoHop => {
                    let key = between(&tail, "of the friend of", "?");
                    let link = docs.find(&format!("the friend of {key} is {} .", p.values[0])).expect("the link");
                    let fact = docs.find(&canon(&engine, &p.values[1])).expect("the friend's value");
                    let apart = link.abs_diff(fact) as f64 / docs.len() as f64;
                    assert!(apart > 0.3, "{at}: the two passages are {apart:.2} of the documents apart");
                }
                Task::Recite => {
                    let key = between(&tail, "recite the", "passage");
                    let passage = canon(&engine, &format!("the {key} passage : {}", p.expected));
                    assert!(docs.contains(&passage), "{at}: the recited passage is not in the documents");
                    assert!(p.expected_ids.len() >= r.recite.min_tokens, "{at}: {} tokens", p.expected_ids.len());
                }
                _ => unreachable!("not a suite task"),
            }
            check_scoring(&engine, &p, &at);
        }
    }
}

#[test]
fn the_demo_model_has_no_suite_and_says_so() {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    let engine = Engine::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32).unwrap();
    let spec = EvalSpec::load(&dir).unwrap();
    let mut rng = StdRng::seed_from_u64(1);
    for &task in Task::SUITE {
        let e = tasks::build(&engine, &spec, task, 2048, 0.5, &mut rng).unwrap_err().to_string();
        assert!(e.contains("has no `ruler` section: it was not trained on"), "{task:?}: {e}");
    }
}

#[test]
fn a_task_cell_is_the_same_prompt_on_every_run() {
    let (engine, spec) = yardstick_tiny();
    for &task in Task::SUITE {
        let a = tasks::cell_prompt(&engine, &spec, task, (2048, 0.25, 3), 11).unwrap();
        let b = tasks::cell_prompt(&engine, &spec, task, (2048, 0.25, 3), 11).unwrap();
        let c = tasks::cell_prompt(&engine, &spec, task, (2048, 0.25, 4), 11).unwrap();
        assert_eq!((a.ids.clone(), a.expected_ids.clone()), (b.ids, b.expected_ids), "{task:?}");
        assert_ne!(a.ids, c.ids, "{task:?}: another sample is another prompt");
    }
}
