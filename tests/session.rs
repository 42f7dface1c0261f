//! The session API under the CLI: the same questions asked through `folio chat --context` (a
//! real process) and through `folio_models::session` in this process give identical tokens and
//! settings for every method of the registry, on every tier that runs it, each named without a
//! budget (its paper default); follow-ups reuse the turns the session holds; the method syntax
//! refuses a misspelt knob with the valid names.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use candle_core::{DType, Device};
use folio_models::attention::{MethodChoice, Path as MethodPath, Tier, REGISTRY};
use folio_models::session::{GenerationSettings, Session};
use folio_models::Engine;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn folio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_folio"))
        .args(args)
        .args(["--device", "cpu"])
        .env("FOLIO_HOME", Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("home-{}", std::process::id())))
        .output()
        .expect("run folio")
}

fn ok_json(out: Output) -> Value {
    assert!(out.status.success(), "folio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

const MAX_TOKENS: usize = 12;

fn go_on(_: &str) -> ControlFlow<()> {
    ControlFlow::Continue(())
}

/// assets/samples prefilled with the demo model into `dir`, by the CLI.
fn samples_context(dir: &Path) -> PathBuf {
    let (demo, samples, ctx) =
        (root().join("assets/models/demo"), root().join("assets/samples"), dir.join("samples.folio"));
    let (m, s, c) = (demo.to_str().unwrap(), samples.to_str().unwrap(), ctx.to_str().unwrap());
    ok_json(folio(&["prefill", "--model", m, "--docs", s, "--out", c, "--json"]));
    ctx
}

fn settings() -> GenerationSettings {
    GenerationSettings { max_tokens: MAX_TOKENS, temperature: Some(0.0), ..GenerationSettings::default() }
}

#[test]
fn cli_and_session_api_answer_alike_for_every_method() {
    let work = tempfile::tempdir().unwrap();
    // A copy of the demo model, calibrated for Double Sparsity.
    let model = work.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for entry in std::fs::read_dir(root().join("assets/models/demo")).unwrap() {
        let e = entry.unwrap();
        std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
    }
    let (m, samples) = (model.to_str().unwrap(), root().join("assets/samples"));
    let s = samples.to_str().unwrap();
    ok_json(folio(&["calibrate", "--model", m, "--docs", s, "--json"]));
    let ctx = work.path().join("samples.folio");
    let c = ctx.to_str().unwrap();
    ok_json(folio(&["prefill", "--model", m, "--docs", s, "--out", c, "--json"]));

    let engine = Arc::new(Engine::load(m, &Device::Cpu, DType::F32).unwrap());
    let question = "what is the secret code of amber falcon ?";
    let max = MAX_TOKENS.to_string();
    for spec in REGISTRY {
        for tier in [Tier::Resident, Tier::Offloaded] {
            if matches!(spec.path(tier), MethodPath::None(_)) {
                continue;
            }
            let mut args = vec!["chat", "--model", m, "--context", c, question, "--method", spec.name, "--json"];
            args.extend(["--temperature", "0", "--max-tokens", &max]);
            if tier == Tier::Offloaded {
                args.push("--offload");
            }
            let cli = ok_json(folio(&args));
            let mut session = Session::open(engine.clone(), &ctx, tier).unwrap();
            let mut conv = session.new_conversation();
            let choice = MethodChoice::parse(spec.name).unwrap();
            let answer = session.ask(&mut conv, question, &choice, &settings(), go_on).unwrap();
            let what = format!("{} on the {} tier", spec.name, tier.name());
            assert_eq!(cli["tokens"], serde_json::json!(answer.tokens), "{what}");
            assert_eq!(cli["attention"], answer.settings, "{what}");
            let default = spec.default_budget.as_ref().map(|d| d.budget);
            assert_eq!(choice.budget().unwrap().map(|b| b.text()).as_deref(), default, "{what}");
            assert_eq!(conv.messages.len(), 2, "{what}");
            assert!(answer.timings.first_token_s.is_some(), "{what}");
            // Every decode step read something, and only the sample documents or the question.
            assert_eq!(answer.reads.steps, answer.tokens.len() - 1, "{what}");
            assert!(answer.sources.iter().all(|d| d.path.ends_with(".txt")), "{what}");
        }
    }
}

/// A follow-up in one session reuses the turns it holds and answers as a new process given
/// the conversation file does (which rebuilds them), for dense and a sparse method; another
/// method recomputes them; a fork reuses the turns it shares.
#[test]
fn follow_ups_reuse_the_held_turns() {
    let work = tempfile::tempdir().unwrap();
    let demo = root().join("assets/models/demo");
    let (m, samples) = (demo.to_str().unwrap(), root().join("assets/samples"));
    let ctx = work.path().join("samples.folio");
    let c = ctx.to_str().unwrap();
    ok_json(folio(&["prefill", "--model", m, "--docs", samples.to_str().unwrap(), "--out", c, "--json"]));
    let questions = ["what is the secret code of amber falcon ?", "and the access code of cobalt heron ?"];
    let max = MAX_TOKENS.to_string();
    let engine = Arc::new(Engine::load(m, &Device::Cpu, DType::F32).unwrap());
    let mut session = Session::open(engine, &ctx, Tier::Resident).unwrap();
    // Dense keeps the answers' rows, a sparse method recomputes them with the next turn: either
    // way one session answers as the CLI does, a process and a rebuilt conversation per question.
    let mut conv = session.new_conversation();
    let mut answers = Vec::new();
    for (method, file) in [("dense", "dense.json"), ("hip:64", "hip.json")] {
        let conv_file = work.path().join(file);
        let cv = conv_file.to_str().unwrap();
        let cli: Vec<Value> = questions
            .iter()
            .map(|q| {
                let args = ["chat", "--context", c, "--continue", cv, q, "--json", "--method", method];
                ok_json(folio(&[&args[..], &["--temperature", "0", "--max-tokens", max.as_str()]].concat()))
            })
            .collect();
        let choice = MethodChoice::parse(method).unwrap();
        let mut this = session.new_conversation();
        let mine: Vec<_> =
            questions.iter().map(|q| session.ask(&mut this, q, &choice, &settings(), go_on).unwrap()).collect();
        for (a, c) in mine.iter().zip(&cli) {
            assert_eq!(c["tokens"], serde_json::json!(a.tokens), "{method}: {} vs {}", c["text"], a.text);
        }
        let saved: Value = serde_json::from_str(&std::fs::read_to_string(&conv_file).unwrap()).unwrap();
        assert_eq!(saved["messages"], serde_json::to_value(&this.messages).unwrap());
        if method == "dense" {
            (conv, answers) = (this, mine);
        }
    }
    assert_eq!(answers[0].reused_tokens, 0);
    let first_turn = answers[0].tail_tokens.len() + answers[0].tokens.len() - 1;
    assert!(answers[1].reused_tokens >= first_turn - 4, "{} of {first_turn}", answers[1].reused_tokens);

    // Another method (the session last ran hip) recomputes the turns; a fork renders to a prefix
    // of what is held.
    let streaming = MethodChoice::parse("streaming:64").unwrap();
    let other = session.ask(&mut conv.clone(), "and of amber falcon ?", &streaming, &settings(), go_on);
    assert_eq!(other.unwrap().reused_tokens, 0);
    let mut fork = conv.fork(2).unwrap();
    let again = session.ask(&mut fork, questions[1], &streaming, &settings(), go_on).unwrap();
    assert!(again.reused_tokens > answers[0].tail_tokens.len(), "{}", again.reused_tokens);
}

/// One syntax names a method everywhere: a misspelt knob is refused with the valid names,
/// and `folio methods` lists the registry.
#[test]
fn method_syntax_refuses_typos_and_methods_lists_the_registry() {
    let demo = root().join("assets/models/demo");
    let out = folio(&["chat", "--model", demo.to_str().unwrap(), "hi", "--method", "hip:refesh=4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("unknown parameter \"refesh\" for hip: hip takes ") && err.contains("refresh"), "{err}");
    let listed = ok_json(folio(&["methods", "--json"]));
    let names: Vec<&str> = listed.as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, REGISTRY.iter().map(|m| m.name).collect::<Vec<_>>());
    assert!(listed.as_array().unwrap().iter().skip(1).all(|m| m["default_budget"]["budget"].is_string()));
}

/// Settings the decode loop would refuse are refused before any work, with its message: what
/// the window's Settings shows inline.
#[test]
fn generation_settings_are_checked_up_front() {
    let demo = root().join("assets/models/demo");
    let engine = Engine::load(demo.to_str().unwrap(), &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    assert!(settings().check(&engine).is_ok());
    let bad = [
        (GenerationSettings { temperature: Some(-1.0), ..settings() }, "temperature must be >= 0"),
        (GenerationSettings { top_p: Some(1.5), ..settings() }, "top_p must be in (0, 1]"),
        (GenerationSettings { top_k: Some(0), ..settings() }, "top_k must be >= 1"),
        (GenerationSettings { max_tokens: 0, ..settings() }, "max_tokens must be >= 1"),
    ];
    for (s, why) in bad {
        let err = s.check(&engine).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    }
}

/// `folio chat --sources` weighs the answer's sources by attention mass, as the window does:
/// the fact's document first; without it the sources carry rows only.
#[test]
fn chat_sources_weigh_what_was_read() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = dir.path().join("samples.folio");
    let (demo, samples) = (root().join("assets/models/demo"), root().join("assets/samples"));
    let (c, d, s) = (ctx.to_str().unwrap(), demo.to_str().unwrap(), samples.to_str().unwrap());
    ok_json(folio(&["prefill", "--model", d, "--docs", s, "--out", c, "--json", "--no-library"]));
    let ask = |extra: &[&str]| {
        let mut args = vec!["chat", "--context", c, "what is the lucky number of jade tiger ?", "--json"];
        args.extend_from_slice(extra);
        ok_json(folio(&args))
    };
    let weighed = ask(&["--sources"]);
    let sources = weighed["sources"].as_array().unwrap();
    assert_eq!(sources[0]["title"], "market_records.txt", "{weighed}");
    let shares: f64 = sources.iter().map(|s| s["mass_share"].as_f64().unwrap()).sum();
    assert!(shares > 0.0 && shares <= 1.0 + 1e-9, "{shares}");
    let counted = ask(&[]);
    assert!(counted["sources"].as_array().unwrap().iter().all(|s| s["mass_share"].is_null()), "{counted}");
}

/// "Compare with dense" on the samples context: dense against itself agrees at every step
/// with no KL; a sparse answer teacher-forced reproduces its own greedy tokens (the decode
/// loop's logits, step for step); its comparison says the answer changed exactly when some
/// step's top token differs; Stop stops it, and the session answers as before afterwards.
#[test]
fn answers_compare_with_dense_on_the_same_turn() {
    use folio_models::context::ContextFile;
    use folio_models::generate::teacher_forced;
    use folio_models::kv_cache::ContextKv;
    let work = tempfile::tempdir().unwrap();
    let (demo, ctx) = (root().join("assets/models/demo"), samples_context(work.path()));
    let m = demo.to_str().unwrap();
    let engine = Arc::new(Engine::load(m, &Device::Cpu, DType::F32).unwrap());
    let mut session = Session::open(engine.clone(), &ctx, Tier::Resident).unwrap();
    let question = "what is the secret code of amber falcon ?";
    let none = |_: usize, _: usize| ControlFlow::Continue(());

    let dense = MethodChoice::parse("dense").unwrap();
    let before = session.new_conversation();
    let answer = session.ask(&mut before.clone(), question, &dense, &settings(), go_on).unwrap();
    let same = session.compare_with_dense(&before, question, &answer.tokens, &dense, &settings(), none).unwrap();
    assert_eq!((same.steps, same.top1_agreement, same.first_disagreement), (answer.tokens.len(), 1.0, None));
    assert!(same.mean_kl < 1e-6 && same.same_answer, "{same:?}");

    // Streaming with a tiny window never sees the fact's rows while answering.
    let streaming = MethodChoice::parse("streaming:16").unwrap();
    let sparse = session.ask(&mut before.clone(), question, &streaming, &settings(), go_on).unwrap();
    let file = Arc::new(ContextFile::open(&ctx).unwrap());
    let mut kv = ContextKv::new(file, engine.model.dtype(), engine.model.device(), 1 << 30);
    let attn = streaming.build(&Default::default()).unwrap();
    let rows = teacher_forced(
        &engine.model,
        attn.as_ref(),
        &mut kv,
        &sparse.tail_tokens,
        &sparse.tokens,
        Default::default(),
        none,
    )
    .unwrap();
    let top: Vec<u32> =
        rows.iter().map(|r| r.iter().enumerate().fold(0, |b, (i, v)| if *v > r[b] { i } else { b }) as u32).collect();
    assert_eq!(top, sparse.tokens, "teacher forcing gives the decode loop's tokens");
    let c = session.compare_with_dense(&before, question, &sparse.tokens, &streaming, &settings(), none).unwrap();
    println!("streaming:16 vs dense: {c:?}");
    assert_eq!(c.steps, sparse.tokens.len());
    assert_eq!(c.first_disagreement.is_none(), c.same_answer, "{c:?}");
    assert!(c.mean_kl > same.mean_kl && c.max_kl >= c.mean_kl, "{c:?}");
    assert_eq!(c.dense_answer, answer.text);

    let mut calls = 0;
    let err = session
        .compare_with_dense(&before, question, &sparse.tokens, &streaming, &settings(), |_, _| {
            calls += 1;
            if calls == 3 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap_err();
    assert!(err.to_string().contains("stopped"), "{err}");
    let again = session.ask(&mut before.clone(), question, &dense, &settings(), go_on).unwrap();
    assert_eq!(again.tokens, answer.tokens);
}

/// A system prompt: a bare chat renders it before the turns (the CLI's `--system` does the
/// same); over a context, whose system prompt is part of its K/V, another one is refused.
#[test]
fn a_system_prompt_is_the_bare_chats_and_a_contexts_is_its_own() {
    let work = tempfile::tempdir().unwrap();
    let (demo, ctx) = (root().join("assets/models/demo"), samples_context(work.path()));
    let m = demo.to_str().unwrap();
    let engine = Arc::new(Engine::load(m, &Device::Cpu, DType::F32).unwrap());
    let dense = MethodChoice::parse("dense").unwrap();
    let mut bare = Session::bare(engine.clone());
    let q = "what is the pass key ?";
    let plain = bare.ask(&mut bare.new_conversation(), q, &dense, &settings(), go_on).unwrap();
    let system = GenerationSettings { system: Some("you answer in one line .".into()), ..settings() };
    let mut conv = bare.new_conversation();
    let told = bare.ask(&mut conv, q, &dense, &system, go_on).unwrap();
    let marker = engine.tokenizer.encode_text("you answer in one line .").unwrap();
    let has = |t: &[u32]| t.windows(marker.len()).any(|w| w == marker.as_slice());
    assert!(has(&told.tail_tokens) && !has(&plain.tail_tokens));
    assert_eq!(conv.system.as_deref(), Some("you answer in one line ."));
    let cli = ok_json(folio(&[
        "chat",
        "--model",
        m,
        "--system",
        "you answer in one line .",
        q,
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        &MAX_TOKENS.to_string(),
    ]));
    assert_eq!(cli["tokens"], serde_json::json!(told.tokens));

    let mut over = Session::open(engine, &ctx, Tier::Resident).unwrap();
    let err = over.ask(&mut over.new_conversation(), q, &dense, &system, go_on).unwrap_err();
    assert!(err.to_string().contains("prefilled with no system prompt"), "{err}");
}

/// `folio eval sources` (issue #44): the samples' facts planted once each in one 6k-token
/// document of prose and records, every SAMPLES.md question asked with dense, HiP and MagicPIG
/// through the session, sources weighed as the window weighs them: each answer is the
/// documented one and its first source passage holds the fact (the command exits 1 when one
/// does not). Longer documents (20k here, 100k and 1M on a GPU) are in docs/quality.md.
#[test]
fn sources_eval_marks_each_fact_first() {
    let demo = root().join("assets/models/demo");
    let out = tempfile::tempdir().unwrap();
    let doc = ok_json(folio(&[
        "eval",
        "sources",
        "--model",
        demo.to_str().unwrap(),
        "--length",
        "6k",
        "--json",
        "--out",
        out.path().to_str().unwrap(),
    ]));
    let summary = doc["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 3, "{summary:?}");
    for m in summary {
        assert_eq!((m["answered"].as_u64(), m["first_holds_fact"].as_u64()), (Some(9), Some(9)), "{m}");
    }
    assert_eq!(doc["weighing"], "copied");
    // Found by copies, not by the mass fallback (which also marks these facts at 6k).
    let rows = doc["rows"].as_array().unwrap();
    assert!(rows.iter().all(|r| r["by_copies"] == true), "{rows:?}");
    assert!(out.path().join("sources.json").is_file());
    let err = folio(&["eval", "sources", "--model", demo.to_str().unwrap(), "--length", "20"]);
    assert!(String::from_utf8_lossy(&err.stderr).contains("too short"), "{}", String::from_utf8_lossy(&err.stderr));
}
