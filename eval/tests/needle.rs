//! The needle evaluation on the bundled demo model: prompts follow eval_spec.json (length,
//! vocabulary, depth), the checker is exact, and dense attention retrieves the planted facts.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use folio_eval::needle::{self, build_prompt, value_match, PromptTier};
use folio_eval::spec::EvalSpec;
use folio_models::attention::{self, Attention, Dense, Resources};
use folio_models::prefill::PrefillMode;
use folio_models::Engine;
use rand::rngs::StdRng;
use rand::SeedableRng;

// The kernels' shared test helpers (a replayable seed).
#[path = "../../kernels/tests/common/mod.rs"]
mod common;

fn demo_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo")
}

fn demo() -> (Engine, EvalSpec) {
    let dir = demo_dir();
    (Engine::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32).unwrap(), EvalSpec::load(&dir).unwrap())
}

#[test]
fn prompts_follow_the_spec() {
    let (engine, spec) = demo();
    let unk = engine.tokenizer.token_id("<|unk|>").unwrap();
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (length, depth) in [(512, 0.0), (1000, 0.25), (2048, 0.5), (3000, 0.75), (4096, 1.0)] {
        let p = build_prompt(&engine, &spec, length, depth, &mut rng).unwrap();
        // Filler stops at the first sentence that would overflow: at most one sentence short.
        assert!(p.ids.len() <= length && p.ids.len() + 40 >= length, "seed {seed}, {length}: {} tokens", p.ids.len());
        assert!(!p.ids.contains(&unk), "seed {seed}: prompt has out-of-vocabulary words");
        assert_eq!(p.target_index, (depth * p.sentences as f64).round() as usize);
        assert_eq!(p.value.len(), spec.value.digits);
        let text = engine.tokenizer.decode(&p.ids, false).unwrap();
        let fact_at = text.find(&p.value.chars().map(|c| c.to_string()).collect::<Vec<_>>().join(" ")).unwrap();
        let rel = fact_at as f64 / text.len() as f64;
        assert!(
            (rel - depth).abs() < 0.15,
            "seed {seed}, {length} tokens, depth {depth}: the fact sits at {rel:.2} of the text"
        );
        // The checker accepts the answer as the model writes it and rejects another value.
        let spaced = |s: &str| s.chars().map(|c| c.to_string()).collect::<Vec<_>>().join(" ");
        let good = if p.prefilled {
            format!(" {} .", spaced(&p.value))
        } else {
            format!("{} {} .", p.answer_prefix, spaced(&p.value))
        };
        assert!(value_match(&p, &good), "{good:?}");
        let wrong: String = p.value.chars().rev().collect::<String>() + "1";
        let bad = if p.prefilled { spaced(&wrong) } else { format!("{} {} .", p.answer_prefix, spaced(&wrong)) };
        assert!(!value_match(&p, &bad));
        // The split a context file would make: the documents before it, the question after.
        let (head, tail) = p.ids.split_at(p.documents_end);
        let (head, tail) =
            (engine.tokenizer.decode(head, false).unwrap(), engine.tokenizer.decode(tail, false).unwrap());
        assert!(
            head.trim_end().ends_with('.') && head.contains(&spaced(&p.value)),
            "seed {seed}: {:?}",
            &head[head.len() - 80..]
        );
        assert!(tail.len() < 400 && !tail.contains(&spaced(&p.value)), "seed {seed}: {tail:?}");
        if p.prefilled {
            assert!(tail.trim_end().ends_with(&p.answer_prefix), "seed {seed}: {tail:?}");
        }
    }
}

#[test]
fn cells_are_reproducible_and_distinct() {
    assert_eq!(needle::cell_seed(1, 4096, 0.5, 3), needle::cell_seed(1, 4096, 0.5, 3));
    assert_ne!(needle::cell_seed(1, 4096, 0.5, 3), needle::cell_seed(1, 4096, 0.5, 4));
    assert_ne!(needle::cell_seed(1, 4096, 0.5, 3), needle::cell_seed(1, 4096, 0.25, 3));
    assert_ne!(needle::cell_seed(1, 4096, 0.5, 3), needle::cell_seed(2, 4096, 0.5, 3));
}

/// The demo model retrieves planted facts with dense attention on the CPU at short lengths
/// (its long-context figures come from the GPU machine; docs/quality.md).
#[test]
fn demo_model_finds_needles_with_dense_attention() {
    let (engine, spec) = demo();
    let mut correct = 0;
    let mut total = 0;
    for length in [1024, 2048] {
        for depth in [0.0, 0.5, 1.0] {
            for sample in 0..2 {
                let cell = (length, depth, sample);
                let prompt = needle::cell_prompt(&engine, &spec, cell, 7).unwrap();
                let s =
                    needle::run_sample(&engine, &prompt, &[&Dense], (&PromptTier::Resident, PrefillMode::Dense), cell)
                        .unwrap()
                        .remove(0);
                correct += s.correct as usize;
                total += 1;
                if !s.correct {
                    println!("missed at {length}/{depth}: expected {:?}, got {:?}", s.expected, s.output);
                }
            }
        }
    }
    println!("dense needle accuracy on CPU: {correct}/{total}");
    assert!(correct * 10 >= total * 9, "dense accuracy {correct}/{total} is below 90%");
}

/// `folio eval needle --offload`: the documents go to host memory once per prompt and each
/// method's fast path decodes over them in turn (on the CPU, over the kernels' references). The
/// exact methods must answer as on the resident tier token for token, whatever ran before them
/// on the same store; the approximate ones are run through the same plumbing.
#[test]
fn offloaded_tier_answers_as_the_resident_one() {
    let (engine, spec) = demo();
    let none = Resources::default();
    let methods = [
        ("dense", None, true),
        ("hip", Some("256"), false),
        ("topk", Some("128"), true),
        ("buzz", Some("50%"), false),
        ("streaming", Some("256"), true),
        ("magicpig", Some("10%"), false),
        ("dense", None, true),
    ];
    let attns: Vec<_> = methods.iter().map(|(m, b, _)| attention::by_name(m, *b, &[], &none).unwrap()).collect();
    let attns: Vec<&dyn Attention> = attns.iter().map(|a| a.as_ref()).collect();
    for (length, depth, sample) in [(1024, 0.25, 0), (2048, 0.75, 1)] {
        let cell = (length, depth, sample);
        let prompt = needle::cell_prompt(&engine, &spec, cell, 3).unwrap();
        let resident =
            needle::run_sample(&engine, &prompt, &attns, (&PromptTier::Resident, PrefillMode::Dense), cell).unwrap();
        let offloaded =
            needle::run_sample(&engine, &prompt, &attns, (&PromptTier::Offloaded, PrefillMode::Dense), cell).unwrap();
        for (((method, _, exact), r), o) in methods.iter().zip(&resident).zip(&offloaded) {
            println!("{method} {cell:?}: resident {:?}, offloaded {:?}", r.output, o.output);
            if *exact {
                assert_eq!(r.output, o.output, "{method} at {cell:?}");
            }
        }
    }
}
