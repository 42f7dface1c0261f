//! A context read with other weights of its model (`--accept-other-weights`): how far the answer's
//! next-token distributions move when the saved K/V were computed by other weights. The demo model
//! with f32 weights and with its projections quantized on load to Q8_0 and Q4_K: each makes a
//! context of the samples; each answers every SAMPLES.md question greedily over its own context,
//! and its answer is then teacher-forced over each other weights' context. Printed per pair: mean
//! and largest KL(own ‖ other) over the answer tokens, and top-1 agreement (required at every
//! step) — the figures docs/gguf.md cites (`cargo test -p folio-models --test weights --
//! --nocapture`).

use std::ops::ControlFlow;
use std::sync::Arc;

use candle_core::{DType, Device};
use folio_models::attention::{Dense, MethodChoice, Tier};
use folio_models::context::{self, ContextFile};
use folio_models::engine::ContextModel;
use folio_models::generate::{teacher_forced, PromptPass};
use folio_models::kv_cache::ContextKv;
use folio_models::model::Quantize;
use folio_models::session::{GenerationSettings, Session};
use folio_models::{Engine, Result};

mod support;
use support::{build, model_dir, sample_documents};

/// The questions of assets/SAMPLES.md, as the samples' README asks them.
const QUESTIONS: [&str; 9] = [
    "what is the secret code of amber falcon ?",
    "what is the room number of silver otter ?",
    "what is the access code of cobalt heron ?",
    "what is the lucky number of jade tiger ?",
    "what is the secret code of crimson owl ?",
    "what is the pass key ?",
    "what is the value of y ?",
    "what is the secret code of violet lynx ?",
    "what is the secret code of amber falcon and the lucky number of jade tiger ?",
];
/// Largest mean KL (nats) allowed between a weight format's answer over its own context and over
/// another's: the measured figures are far below (docs/gguf.md); this catches a context read
/// with the wrong K/V layout, not rounding.
const MEAN_KL_BOUND: f64 = 0.05;

/// log-softmax of a logits row, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let sum: f64 = logits.iter().map(|v| (*v as f64 - max).exp()).sum();
    logits.iter().map(|v| *v as f64 - max - sum.ln()).collect()
}

/// KL(p ‖ q) of two logits rows.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

/// The logits along `answer` after `tail`, `engine`'s weights reading `file`'s saved K/V.
fn forced(engine: &Engine, file: &Arc<ContextFile>, tail: &[u32], answer: &[u32]) -> Result<Vec<Vec<f32>>> {
    let mut kv = ContextKv::new(file.clone(), DType::F32, &Device::Cpu, u64::MAX);
    teacher_forced(&engine.model, &Dense, &mut kv, tail, answer, PromptPass::Dense, |_, _| ControlFlow::Continue(()))
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
}

#[test]
fn answers_over_other_weights_contexts_move_little() -> Result<()> {
    let formats: [(&str, Option<Quantize>); 3] =
        [("f32", None), ("q8_0", Some(Quantize::Q8_0)), ("q4k", Some(Quantize::Q4K))];
    let demo = model_dir("demo");
    let dir = tempfile::tempdir().unwrap();
    let docs = sample_documents();
    let mut engines = Vec::new();
    for (name, q) in formats {
        let e = Engine::load_quantized(demo.to_str().unwrap(), &Device::Cpu, DType::F32, q, &mut |_| {
            ControlFlow::Continue(())
        })?;
        e.accept_other_weights(true);
        let out = dir.path().join(format!("{name}.folio"));
        // One prompt stamp (the date) for every context: the same tokens, other K/V.
        build(&e, &e.plan_context(&docs, None, Some("2026-11-30".into()))?, &out, context::KvDtype::F32, None);
        engines.push((name, Arc::new(e), Arc::new(ContextFile::open(&out)?)));
    }
    let settings = GenerationSettings { temperature: Some(0.0), ..GenerationSettings::default() };
    for (own_name, engine, own_file) in &engines {
        // The answers and their turn's tokens over this engine's own context.
        let mut session = Session::over(engine.clone(), own_file.clone(), Tier::Resident)?;
        let mut turns = Vec::new();
        for q in QUESTIONS {
            let mut conv = session.new_conversation();
            let answer =
                session.ask(&mut conv, q, &MethodChoice::default(), &settings, |_| ControlFlow::Continue(()))?;
            turns.push((answer.tail_tokens, answer.tokens));
        }
        let own_logits =
            turns.iter().map(|(tail, answer)| forced(engine, own_file, tail, answer)).collect::<Result<Vec<_>>>()?;
        for (ctx_name, _, ctx_file) in &engines {
            let verdict = engine.check_context(ctx_file)?;
            assert_eq!(verdict == ContextModel::Same, ctx_name == own_name, "{own_name} over {ctx_name}: {verdict:?}");
            let (mut sum, mut worst, mut agree, mut steps) = (0.0, 0.0f64, 0, 0);
            for ((tail, answer), own) in turns.iter().zip(&own_logits) {
                let other = forced(engine, ctx_file, tail, answer)?;
                for (p, q) in own.iter().zip(&other) {
                    let d = kl(p, q);
                    (sum, worst, steps) = (sum + d, worst.max(d), steps + 1);
                    agree += usize::from(argmax(p) == argmax(q));
                }
            }
            let mean = sum / steps as f64;
            println!(
                "weights {own_name:>5} over the {ctx_name:>5} context: mean KL {mean:.2e}, max {worst:.2e} nats, \
                 top-1 {agree}/{steps}"
            );
            assert!(mean <= MEAN_KL_BOUND, "{own_name} over {ctx_name}: mean KL {mean}");
            assert_eq!(agree, steps, "{own_name} over {ctx_name}: the most likely token changed");
        }
    }
    Ok(())
}
