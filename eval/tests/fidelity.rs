//! The fidelity tasks on the bundled demo model (CPU, short prompts): prompts follow the spec
//! and are scored exactly; the report's comparison with dense is nil for dense itself and not
//! for a method that cannot see the facts; a sparse question is read one token at a time with
//! the method; the offloaded tier gives the resident tier's answers.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use folio_eval::fidelity::{self, Cell, QuestionMode};
use folio_eval::needle::PromptTier;
use folio_eval::spec::EvalSpec;
use folio_eval::tasks::{self, Task};
use folio_models::attention::reads::ReadTally;
use folio_models::attention::{self, Attention, Dense, Resources};
use folio_models::generate::{self, GenerateParams, PromptPass, SamplingParams};
use folio_models::prefill::PrefillMode;
use folio_models::Engine;
use rand::rngs::StdRng;
use rand::SeedableRng;

// The kernels' shared test helpers (a replayable seed).
#[path = "../../kernels/tests/common/mod.rs"]
mod common;
mod prompt_checks;

fn demo() -> (Engine, EvalSpec) {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    (Engine::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32).unwrap(), EvalSpec::load(&dir).unwrap())
}

/// The digits of a value as the tokenizer writes them: "4 8 1 5 2".
fn spaced(value: &str) -> String {
    value.chars().map(String::from).collect::<Vec<_>>().join(" ")
}

#[test]
fn task_prompts_follow_the_spec() {
    let (engine, spec) = demo();
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &task in Task::DEMO {
        for (length, depth) in [(768, 0.0), (1024, 0.5), (2048, 1.0)] {
            let p = tasks::build(&engine, &spec, task, length, depth, &mut rng).unwrap();
            let at = format!("seed {seed}, {task:?} at {length}/{depth}");
            let (docs, tail) = prompt_checks::documents_and_question(&engine, &p, length, &at);
            // Every value is in the documents and none in the question: the answer must read them.
            for v in &p.values {
                assert!(docs.contains(&spaced(v)), "{at}: value {v} is not in the documents");
                assert!(!tail.contains(&spaced(v)), "{at}: value {v} is in the question {tail:?}");
            }
            let values = match task {
                Task::Pair => 2,
                _ => 1,
            };
            assert_eq!(p.values.len(), values, "{at}");
            // The expected answer scores right, token for token, and a changed value does not.
            let expected = engine.tokenizer.decode(&p.expected_ids, true).unwrap();
            assert!(p.correct(&p.expected_ids), "{at}");
            assert_eq!(p.values_right(&expected), values, "{at}: {expected:?}");
            let last = p.values.last().unwrap();
            let wrong: String = last.chars().map(|c| if c == '9' { '0' } else { (c as u8 + 1) as char }).collect();
            let altered = expected.replace(&spaced(last), &spaced(&wrong));
            let altered_ids = engine.tokenizer.encode_prompt(&altered).unwrap();
            assert!(!p.correct(&altered_ids), "{at}: {altered:?}");
            assert_eq!(p.values_right(&altered), values - 1, "{at}: {altered:?}");
            if values > 1 {
                // A wrong first value does not hide a right second one.
                let first = &p.values[0];
                let wrong: String = first.chars().map(|c| if c == '9' { '0' } else { (c as u8 + 1) as char }).collect();
                let altered = expected.replacen(&spaced(first), &spaced(&wrong), 1);
                assert_eq!(p.values_right(&altered), values - 1, "{at}: {altered:?}");
                // nor does a first value cut short
                let altered = expected.replacen(&spaced(first), &spaced(&first[..first.len() - 1]), 1);
                assert_eq!(p.values_right(&altered), values - 1, "{at}: {altered:?}");
            }
            match task {
                // Each hop the answer takes is a sentence of the documents.
                Task::Chain => {
                    let hops: Vec<&str> = expected.split(" . ").filter(|s| s.contains("is the value of")).collect();
                    assert_eq!(
                        hops.len(),
                        spec.tasks.variable_tracking.as_ref().unwrap().hops - 1,
                        "{at}: {expected:?}"
                    );
                    for hop in hops {
                        assert!(docs.contains(hop), "{at}: {hop:?} is not in the documents");
                    }
                }
                // The two facts sit in different documents.
                Task::Pair => {
                    let doc_of = |v: &str| docs[..docs.find(&spaced(v)).unwrap()].matches("<|doc|>").count();
                    assert_ne!(doc_of(&p.values[0]), doc_of(&p.values[1]), "{at}");
                }
                _ => {}
            }
        }
    }
}

#[test]
fn cells_are_reproducible_and_needle_cells_are_the_needle_evals() {
    let (engine, spec) = demo();
    let a = tasks::cell_prompt(&engine, &spec, Task::Chain, (1024, 0.5, 1), 3).unwrap();
    let b = tasks::cell_prompt(&engine, &spec, Task::Chain, (1024, 0.5, 1), 3).unwrap();
    assert_eq!(a.ids, b.ids);
    let c = tasks::cell_prompt(&engine, &spec, Task::Pair, (1024, 0.5, 1), 3).unwrap();
    assert_ne!(a.ids, c.ids);
    let needle = folio_eval::needle::cell_prompt(&engine, &spec, (1024, 0.5, 1), 3).unwrap();
    let task = tasks::cell_prompt(&engine, &spec, Task::Needle, (1024, 0.5, 1), 3).unwrap();
    assert_eq!(needle.ids, task.ids, "the needle task's prompts are `folio eval needle`'s");
    assert_eq!(task.values, vec![needle.value]);
}

/// Dense against itself is nil; streaming over a window that misses the facts is not.
#[test]
fn the_report_measures_against_dense() {
    let (engine, spec) = demo();
    let none = Resources::default();
    let streaming = attention::by_name("streaming", Some("64"), &[], &none).unwrap();
    let attns: [&dyn Attention; 2] = [&Dense, streaming.as_ref()];
    let cell = Cell { task: Task::Chain, length: 1024, depth: 0.25, sample: 0 };
    let prompt = tasks::cell_prompt(&engine, &spec, cell.task, (cell.length, cell.depth, cell.sample), 0).unwrap();
    let got = fidelity::run_prompt(
        &engine,
        &prompt,
        cell,
        &attns,
        &PromptTier::Resident,
        &[QuestionMode::Dense],
        PrefillMode::Dense,
    )
    .unwrap();
    let (dense, sparse) = (&got[0][0], &got[0][1]);
    println!("dense {:?}\nstreaming {:?}", dense.output, sparse.output);
    assert!(dense.correct && dense.dense_correct, "the demo model answers this chain: {:?}", dense.output);
    assert_eq!(dense.mean_kl, 0.0, "dense teacher-forced on its own answer");
    assert_eq!(dense.top1_agreement, 1.0);
    assert!(dense.forced_steps >= prompt.expected_ids.len());
    assert!((dense.rows_read_fraction - 1.0).abs() < 1e-9, "dense reads every row: {}", dense.rows_read_fraction);
    assert!(!sparse.correct, "64 rows of sinks and window cannot hold the chain: {:?}", sparse.output);
    assert!(sparse.mean_kl > 0.1 && sparse.top1_agreement < 1.0, "{} {}", sparse.mean_kl, sparse.top1_agreement);
    assert!(sparse.rows_read < 64.5 && sparse.rows_read_fraction < 0.1, "{}", sparse.rows_read);
    assert_eq!(sparse.forced_steps, dense.forced_steps, "both are forced on dense's answer");
}

/// `PromptPass::SparseFrom` feeds the question one token at a time: dense attention answers as
/// in one pass, and a method's tally counts a decode step per question token.
#[test]
fn a_sparse_question_is_read_token_by_token() {
    let (engine, spec) = demo();
    let prompt = tasks::cell_prompt(&engine, &spec, Task::Needle, (1024, 0.5, 0), 1).unwrap();
    let question = prompt.ids.len() - prompt.documents_end;
    let params = |pass| GenerateParams {
        max_new_tokens: prompt.expected_ids.len(),
        sampling: SamplingParams::default(),
        stop_strings: Vec::new(),
        eos_token_ids: engine.eos_token_ids(),
        prompt_pass: pass,
    };
    let quiet = |_: &str| ControlFlow::Continue(());
    let run = |attn: &dyn Attention, pass| {
        let mut kv = engine.model.new_kv();
        generate::generate(&engine.model, &engine.tokenizer, attn, &mut kv, &prompt.ids, &params(pass), quiet).unwrap()
    };
    let whole = run(&Dense, PromptPass::Dense);
    let stepped = run(&Dense, PromptPass::SparseFrom(prompt.documents_end));
    assert_eq!(whole.tokens, stepped.tokens, "dense answers alike however the question is fed");
    let none = Resources::default();
    let topk = attention::by_name("topk", Some("32"), &[], &none).unwrap();
    // Every question token is a one-token call when the question is sparse, its last the one
    // that gives the first answer token; then a step per answer token after the first.
    for (pass, question_steps) in [(PromptPass::Dense, 0), (PromptPass::SparseFrom(prompt.documents_end), question)] {
        let tally = ReadTally::new(topk.as_ref(), vec![(0, prompt.documents_end)]);
        let answer = run(&tally, pass).tokens.len();
        assert_eq!(
            tally.summary().steps,
            question_steps + answer - 1,
            "{pass:?}: decode steps over a {question}-token question and a {answer}-token answer"
        );
    }
}

/// The offloaded tier prefills the documents once and answers as the resident tier does.
#[test]
fn the_offloaded_tier_gives_the_resident_answers() {
    let (engine, spec) = demo();
    let none = Resources::default();
    let topk = attention::by_name("topk", Some("128"), &[], &none).unwrap();
    let attns: [&dyn Attention; 2] = [&Dense, topk.as_ref()];
    let cell = Cell { task: Task::Pair, length: 1024, depth: 0.75, sample: 0 };
    let prompt = tasks::cell_prompt(&engine, &spec, cell.task, (cell.length, cell.depth, cell.sample), 0).unwrap();
    let modes = [QuestionMode::Dense, QuestionMode::Sparse];
    let resident =
        fidelity::run_prompt(&engine, &prompt, cell, &attns, &PromptTier::Resident, &modes, PrefillMode::Dense)
            .unwrap();
    let offloaded =
        fidelity::run_prompt(&engine, &prompt, cell, &attns, &PromptTier::Offloaded, &modes, PrefillMode::Dense)
            .unwrap();
    for ((mode, resident), offloaded) in modes.iter().zip(&resident).zip(&offloaded) {
        for (r, o) in resident.iter().zip(offloaded) {
            assert_eq!((r.question, o.question), (*mode, *mode));
            assert_eq!(r.output, o.output, "{mode:?}");
            assert!((r.mean_kl - o.mean_kl).abs() < 1e-3, "{mode:?}: {} {}", r.mean_kl, o.mean_kl);
        }
    }
}

/// Over a sparse prefill (knobs small enough to be sparse at 1,024 tokens) the methods are
/// measured against the dense prefill's dense decode: the reference's answer is the dense
/// prefill's, the outcomes name the prefill, and the resident tier (which prefills each run's
/// whole prompt densely) refuses it.
#[test]
fn a_sparse_prefill_is_measured_against_the_dense_prefill() {
    let (engine, spec) = demo();
    let attns: [&dyn Attention; 1] = [&Dense];
    let cell = Cell { task: Task::Needle, length: 1024, depth: 0.5, sample: 0 };
    let prompt = tasks::cell_prompt(&engine, &spec, cell.task, (cell.length, cell.depth, cell.sample), 0).unwrap();
    let modes = [QuestionMode::Dense];
    let sparse = PrefillMode::parse("sparse:block=16,keys=64,sinks=16,window=64").unwrap();
    let dense =
        fidelity::run_prompt(&engine, &prompt, cell, &attns, &PromptTier::Offloaded, &modes, PrefillMode::Dense)
            .unwrap();
    let over = fidelity::run_prompt(&engine, &prompt, cell, &attns, &PromptTier::Offloaded, &modes, sparse).unwrap();
    let (d, s) = (&dense[0][0], &over[0][0]);
    assert_eq!((d.prefill.as_str(), s.prefill.as_str()), ("dense", "sparse:block=16,keys=64,sinks=16,window=64"));
    assert_eq!(d.mean_kl, 0.0, "dense over a dense prefill is the reference");
    assert_eq!(s.dense_output, d.dense_output, "the reference is the dense prefill's");
    assert!(s.mean_kl > 0.0, "a sparse prefill of 1,024 tokens in blocks of 16 changed no distribution");
    let err = fidelity::run_prompt(&engine, &prompt, cell, &attns, &PromptTier::Resident, &modes, sparse).unwrap_err();
    assert!(err.to_string().contains("--offload"), "{err}");
}
