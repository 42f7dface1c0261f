//! The hostile-input fuzz harness for what a crafted file can hand the engine (issue #50),
//! beside folio-ingest's for documents: context files mutated the way an attacker would — a
//! header or section value changed and every checksum recomputed, so only the engine's own
//! checks stand between the file and the decoder — and chat templates made of random pieces of
//! real templates' syntax. Each case runs as the app runs it: open, verify, check against the
//! model, open a session and answer one token; a template is compiled and rendered.
//! Nothing may panic, and each case ends within its time; a refusal is an error with words.
//!
//! `FOLIO_FUZZ_CASES` sets the cases (default 300 context files, 2000 templates); the seed is
//! printed and taken from `FOLIO_FUZZ_SEED` to replay a run.

mod support;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use folio_models::attention::{MethodChoice, Tier};
use folio_models::chat::{ChatTemplate, Message};
use folio_models::context::{self, ContextFile};
use folio_models::session::{GenerationSettings, Session};
use folio_models::Engine;
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::Value;
use support::{build, engine, sample_documents};

const CONTEXT_CASES: usize = 300;
const TEMPLATE_CASES: usize = 2000;
/// Longest one case may take: an honest open and one-token answer on the demo model takes
/// milliseconds.
const CASE_TIME: Duration = Duration::from_secs(10);
/// Where the header's JSON starts and where its length and checksum are (format.rs).
const HEADER_AT: usize = 32;
const HEADER_LEN_AT: usize = 16;
const HEADER_SUM_AT: usize = 24;

fn cases(default: usize) -> usize {
    std::env::var("FOLIO_FUZZ_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(default)
}

fn seed() -> u64 {
    let seed = std::env::var("FOLIO_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    println!("fuzz: seed {seed} (replay with FOLIO_FUZZ_SEED={seed})");
    seed
}

/// A value a crafted file would put in a number's place.
fn hostile_number(rng: &mut StdRng, was: &Value) -> Value {
    let n = was.as_i64().unwrap_or(0);
    match rng.random_range(0..8) {
        0 => Value::from(0),
        1 => Value::from(n + 1),
        2 => Value::from(n - 1),
        3 => Value::from(-1),
        4 => Value::from(u64::MAX),
        5 => Value::from(i64::MIN),
        6 => Value::from(n.saturating_mul(1 << 20)),
        _ => Value::from(rng.random_range(0..=n.max(1) * 2)),
    }
}

/// One leaf (or one array) of `v`, picked at random, changed.
fn mutate_json(v: &mut Value, rng: &mut StdRng) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            let key = map.keys().nth(rng.random_range(0..map.len())).cloned().expect("a key");
            if rng.random_ratio(1, 12) {
                map.remove(&key);
            } else {
                mutate_json(map.get_mut(&key).expect("the key"), rng);
            }
        }
        Value::Array(list) if !list.is_empty() => match rng.random_range(0..6) {
            0 => {
                list.remove(rng.random_range(0..list.len()));
            }
            1 => {
                let copy = list[rng.random_range(0..list.len())].clone();
                list.push(copy);
            }
            2 => list.reverse(),
            _ => {
                let i = rng.random_range(0..list.len());
                mutate_json(&mut list[i], rng);
            }
        },
        Value::Number(_) => *v = hostile_number(rng, v),
        Value::String(s) => {
            *v = match rng.random_range(0..4) {
                0 => Value::from(""),
                1 => Value::from(format!("{s}{s}")),
                2 => Value::from("../../etc/passwd"),
                _ => Value::from(s.chars().rev().collect::<String>()),
            }
        }
        Value::Bool(b) => *b = !*b,
        _ => *v = Value::from(rng.random_range(0..4)),
    }
}

/// `original` with one crafted change and every checksum recomputed; `None` when the change
/// did not fit. A JSON text may grow into the padding before the next page-aligned section
/// (the header up to the first section): its recorded length is changed with it, as a tool
/// that rewrites the file would.
fn crafted(original: &[u8], rng: &mut StdRng) -> Option<Vec<u8>> {
    let mut bytes = original.to_vec();
    let header_len = u64::from_le_bytes(bytes[HEADER_LEN_AT..HEADER_SUM_AT].try_into().ok()?) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[HEADER_AT..HEADER_AT + header_len]).ok()?;
    let sections = header["sections"].as_array()?.clone();
    let offsets: Vec<usize> = sections.iter().filter_map(|s| s["offset"].as_u64()).map(|o| o as usize).collect();
    let header_room = offsets.iter().min()? - HEADER_AT;
    let i = rng.random_range(0..sections.len());
    let (at, n) = (offsets[i], sections[i]["bytes"].as_u64()? as usize);
    match rng.random_range(0..3) {
        // The header's own values (counts, shapes, offsets, the model's name, the dtype).
        0 => mutate_json(&mut header, rng),
        // A JSON section's values (documents, parts, conversation), or a binary section's bytes.
        _ => match serde_json::from_slice::<Value>(&bytes[at..at + n]) {
            Ok(mut json) => {
                mutate_json(&mut json, rng);
                let text = serde_json::to_vec(&json).expect("JSON");
                let room = offsets.iter().copied().filter(|&o| o > at).min().unwrap_or(bytes.len()) - at;
                if text.len() > room {
                    return None;
                }
                bytes[at..at + text.len()].copy_from_slice(&text);
                header["sections"][i]["bytes"] = text.len().into();
            }
            Err(_) if n > 0 => {
                for _ in 0..rng.random_range(1..8) {
                    let i = at + rng.random_range(0..n);
                    bytes[i] = rng.random();
                }
            }
            Err(_) => return None,
        },
    }
    if let Some(list) = header["sections"].as_array_mut() {
        for s in list {
            let (Some(at), Some(n)) = (s["offset"].as_u64(), s["bytes"].as_u64()) else { continue };
            let (at, n) = (at as usize, n as usize);
            if at.checked_add(n).is_some_and(|end| end <= bytes.len()) {
                s["xxh3"] = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes[at..at + n])).into();
            }
        }
    }
    let text = serde_json::to_vec(&header).expect("JSON");
    if text.len() > header_room {
        return None;
    }
    bytes[HEADER_AT..HEADER_AT + text.len()].copy_from_slice(&text);
    bytes[HEADER_LEN_AT..HEADER_SUM_AT].copy_from_slice(&(text.len() as u64).to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&text);
    bytes[HEADER_SUM_AT..HEADER_AT].copy_from_slice(&sum.to_le_bytes());
    Some(bytes)
}

/// Opens `path` as the app does and answers one token: `Ok` when the file was taken, the
/// refusal's words when not.
fn open_and_answer(engine: &Arc<Engine>, path: &Path) -> Result<(), String> {
    let file = ContextFile::open(path).map_err(|e| e.to_string())?;
    file.verify().map_err(|e| e.to_string())?;
    engine.check_context(&file).map_err(|e| e.to_string())?;
    let mut session = Session::over(engine.clone(), Arc::new(file), Tier::Resident).map_err(|e| e.to_string())?;
    let mut conv = session.new_conversation();
    let settings = GenerationSettings { max_tokens: 1, temperature: Some(0.0), ..GenerationSettings::default() };
    session
        .ask(&mut conv, "what is the pass key ?", &MethodChoice::default(), &settings, |_| ControlFlow::Continue(()))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn crafted_context_files_are_refused_or_answered_never_a_panic() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let engine = Arc::new(engine("demo"));
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.folio");
    let plan = engine.plan_context(&sample_documents(), None, None).unwrap();
    build(&engine, &plan, &good, context::DEFAULT_KV_DTYPE, None);
    let original = std::fs::read(&good).unwrap();
    open_and_answer(&engine, &good).expect("the unmutated file answers");
    let case_path = dir.path().join("case.folio");
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut made, mut skipped) = (0, 0);
    while made < cases(CONTEXT_CASES) {
        let Some(bytes) = crafted(&original, &mut rng) else {
            skipped += 1;
            continue;
        };
        made += 1;
        std::fs::write(&case_path, &bytes).unwrap();
        let started = Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| open_and_answer(&engine, &case_path)));
        let took = started.elapsed();
        assert!(took < CASE_TIME, "case {made} took {took:?} (seed {seed})");
        match result {
            Ok(Ok(())) => *outcomes.entry("answered").or_default() += 1,
            Ok(Err(why)) => {
                assert!(!why.trim().is_empty(), "case {made}: a refusal with no words (seed {seed})");
                *outcomes.entry("refused").or_default() += 1;
            }
            Err(_) => {
                let kept = dir.path().join(format!("panic-{seed}-{made}.folio"));
                std::fs::copy(&case_path, &kept).unwrap();
                panic!("case {made} panicked (seed {seed}); the file: {}", kept.display());
            }
        }
    }
    println!("fuzz: context files {outcomes:?}, {skipped} changes that did not fit");
    // Both ends are reached: files the checks refuse, and harmless changes that still answer.
    assert!(outcomes.contains_key("refused") && outcomes.contains_key("answered"), "{outcomes:?}");
    assert!(skipped < made, "most changes must fit: {skipped} did not, {made} did");
}

/// Pieces of real chat templates' syntax, to be strung together at random.
/// (No piece doubles a string in a variable: that is bounded by the `folio` binary's
/// allocator, which stops the process — tests/hostile.rs runs it.)
const TEMPLATE_PIECES: [&str; 23] = [
    "{% for m in messages %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}",
    "{% endif %}",
    "{% else %}",
    "{{ m.role }}",
    "{{ m['content'] }}",
    "{{ bos_token }}",
    "{{ raise_exception('no') }}",
    "{% set ns = namespace(s='ab') %}{% set ns.s = ns.s ~ m %}",
    "{% for i in range(300) %}",
    "{{ 'x' * 1000 }}",
    "{{ messages|length }}",
    "{{ m.content|trim|tojson }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ strftime_now('%Y') }}",
    "{% if m.role == 'user' %}",
    "<|im_start|>",
    "\n",
    "{{ m.content.split(' ')[0] }}",
    "{{ undefined_thing.x }}",
    "{%",
    "}}",
];

#[test]
fn random_templates_render_or_fail_with_words_never_a_panic() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let messages = vec![Message::new("system", "be brief"), Message::new("user", "what is the pass key ?")];
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for case in 0..cases(TEMPLATE_CASES) {
        let source: String =
            (0..rng.random_range(1..16)).map(|_| TEMPLATE_PIECES[rng.random_range(0..TEMPLATE_PIECES.len())]).collect();
        let started = Instant::now();
        let result = std::panic::catch_unwind(|| {
            ChatTemplate::new(source.clone(), Some("<s>".into()), Some("</s>".into()))
                .and_then(|t| t.render(&messages, true))
                .map_err(|e| e.to_string())
        });
        let took = started.elapsed();
        assert!(took < CASE_TIME, "case {case} took {took:?}: {source:?} (seed {seed})");
        match result {
            Ok(Ok(_)) => *outcomes.entry("rendered").or_default() += 1,
            Ok(Err(why)) => {
                assert!(!why.trim().is_empty(), "case {case}: no words: {source:?}");
                *outcomes.entry("refused").or_default() += 1;
            }
            Err(_) => panic!("case {case} panicked: {source:?} (seed {seed})"),
        }
    }
    println!("fuzz: templates {outcomes:?}");
    assert!(outcomes.contains_key("rendered") && outcomes.contains_key("refused"), "{outcomes:?}");
}
