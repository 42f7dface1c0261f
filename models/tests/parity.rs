//! Hugging Face parity on the committed fixtures (tools/make_fixtures.py): tiny random models
//! of each family, with transformers' own outputs in reference.json.
//!
//! Per family: full-vocabulary logits within 1e-4 (f32), the tokenizer and BOS rule, the
//! perplexity within 1e-3 relative, the rendered chat prompt token for token, and identical
//! greedy tokens. A second test runs candle-transformers' implementation of the same family on
//! the same weights, as an independent cross-check of the decoder.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use folio_models::attention::Dense;
use folio_models::chat::Message;
use folio_models::generate::{GenerateParams, SamplingParams, StopReason};
use folio_models::model::Logits;
use folio_models::Engine;
use serde::Deserialize;

const LOGIT_TOL: f32 = 1e-4;
const PPL_REL_TOL: f64 = 1e-3;
/// bf16 logits against f32, as a fraction of the logits' range (max - min).
#[cfg(feature = "cuda")]
const BF16_REL_TOL: f32 = 0.025;

/// The fixtures folder; `FOLIO_FIXTURES` points elsewhere when the test binary runs away from
/// this checkout (the GPU machine).
fn fixture(name: &str) -> PathBuf {
    std::env::var_os("FOLIO_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models"))
        .join(name)
}

#[derive(Deserialize)]
struct Reference {
    logits: LogitsRef,
    perplexity: PplRef,
    perplexity_max_tokens: PplCut,
    chat: ChatCase,
    chat_cases: Vec<ChatCase>,
    greedy: Greedy,
    tokenizer_cases: Vec<TokCase>,
    chat_error: Option<ChatError>,
}

#[derive(Deserialize)]
struct LogitsRef {
    input_ids: Vec<u32>,
    values: Vec<Vec<f32>>,
}

#[derive(Deserialize)]
struct PplRef {
    file: String,
    input_ids: Vec<u32>,
    mean_nll: f64,
    perplexity: f64,
}

#[derive(Deserialize)]
struct PplCut {
    max_tokens: usize,
    perplexity: f64,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<Message>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
    #[serde(flatten)]
    extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct Greedy {
    prompt_ids: Vec<u32>,
    max_new_tokens: usize,
    new_tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct TokCase {
    text: String,
    ids: Vec<u32>,
    decoded_skip_special: String,
}

#[derive(Deserialize)]
struct ChatError {
    messages: Vec<Message>,
    message: String,
}

fn load(name: &str) -> (Engine, Reference) {
    load_on(name, &Device::Cpu, DType::F32)
}

fn load_on(name: &str, device: &Device, dtype: DType) -> (Engine, Reference) {
    let dir = fixture(name);
    let engine = Engine::load(dir.to_str().unwrap(), device, dtype).expect("load fixture");
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    (engine, serde_json::from_str(&text).unwrap())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn parity(name: &str) {
    let (engine, r) = load(name);

    // Logits at every position, one forward pass.
    let mut kv = engine.model.new_kv();
    let logits = engine.model.forward(&r.logits.input_ids, &mut kv, &Dense, Logits::All).unwrap();
    let got: Vec<Vec<f32>> = logits.to_vec2().unwrap();
    let diff = got.iter().zip(&r.logits.values).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
    println!("{name}: max |logit - transformers| = {diff:.3e} over {} positions", got.len());
    assert!(diff < LOGIT_TOL, "{name}: logits differ from transformers by {diff}");

    // The same logits when the prompt is fed in pieces through the KV store (prefill + decode).
    let mut kv = engine.model.new_kv();
    let ids = &r.logits.input_ids;
    let split = ids.len() / 2;
    engine.model.forward(&ids[..split], &mut kv, &Dense, Logits::Last).unwrap();
    for (i, id) in ids[split..].iter().enumerate() {
        let l: Vec<f32> =
            engine.model.forward(&[*id], &mut kv, &Dense, Logits::Last).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
        let d = max_abs_diff(&l, &r.logits.values[split + i]);
        assert!(d < LOGIT_TOL, "{name}: incremental logits at position {} differ by {d}", split + i);
    }

    // Tokenizer and the BOS rule.
    for case in &r.tokenizer_cases {
        assert_eq!(
            engine.tokenizer.encode_raw(&case.text).unwrap(),
            with_bos(&engine, &case.ids),
            "{name}: {:?}",
            case.text
        );
        assert_eq!(engine.tokenizer.decode(&case.ids, true).unwrap(), case.decoded_skip_special, "{name}: decode");
    }
    let text = std::fs::read_to_string(fixture(name).join(&r.perplexity.file)).unwrap();
    let ppl_ids = engine.tokenizer.encode_raw(&text).unwrap();
    assert_eq!(ppl_ids, r.perplexity.input_ids, "{name}: perplexity text tokenizes differently");

    // Perplexity, whole and cut.
    let p = engine.perplexity(&ppl_ids).unwrap();
    let rel = (p.perplexity - r.perplexity.perplexity).abs() / r.perplexity.perplexity;
    println!(
        "{name}: perplexity {:.6} vs transformers {:.6} (rel {rel:.2e}); mean NLL {:.7} vs {:.7}",
        p.perplexity, r.perplexity.perplexity, p.mean_nll, r.perplexity.mean_nll
    );
    assert!(rel < PPL_REL_TOL, "{name}: perplexity off by {rel} relative");
    // Scoring in chunks through the KV store equals one pass (the fixture text is one chunk).
    let one_pass = engine.model.token_log_probs(&ppl_ids, ppl_ids.len(), &Dense).unwrap();
    let chunked = engine.model.token_log_probs(&ppl_ids, 16, &Dense).unwrap();
    assert!(max_abs_diff(&one_pass, &chunked) < 1e-4, "{name}: chunked scoring differs");
    let cut = engine.perplexity(&ppl_ids[..r.perplexity_max_tokens.max_tokens]).unwrap();
    let rel = (cut.perplexity - r.perplexity_max_tokens.perplexity).abs() / r.perplexity_max_tokens.perplexity;
    assert!(rel < PPL_REL_TOL, "{name}: cut perplexity off by {rel} relative");

    // Chat templates.
    let template = engine.chat_template.as_ref().expect("fixture has a chat template");
    for case in std::iter::once(&r.chat).chain(&r.chat_cases) {
        let text = template.render_with(&case.messages, case.add_generation_prompt, &case.extra).unwrap();
        assert_eq!(text, case.text, "{name}: rendered chat prompt differs");
        assert_eq!(engine.tokenizer.encode_prompt(&text).unwrap(), case.ids, "{name}: chat prompt ids differ");
    }
    assert_eq!(engine.chat_prompt(&r.chat.messages).unwrap(), r.greedy.prompt_ids);
    if let Some(err) = &r.chat_error {
        let e = engine.chat_prompt(&err.messages).unwrap_err().to_string();
        assert!(e.contains(&err.message), "{name}: template error {e:?} lacks {:?}", err.message);
    }

    // Greedy generation.
    let params = GenerateParams {
        max_new_tokens: r.greedy.max_new_tokens,
        sampling: SamplingParams::default(),
        stop_strings: vec![],
        eos_token_ids: engine.eos_token_ids(),
        prompt_pass: Default::default(),
    };
    let g = engine.generate(&r.greedy.prompt_ids, &params, |_| std::ops::ControlFlow::Continue(())).unwrap();
    assert_eq!(g.tokens, r.greedy.new_tokens, "{name}: greedy tokens differ from transformers");
    assert_eq!(g.stop_reason, StopReason::MaxTokens);
}

/// Reference ids are `tokenizer(text)`; Folio's raw encoding also applies the BOS rule.
fn with_bos(engine: &Engine, ids: &[u32]) -> Vec<u32> {
    match engine.config().bos_token_id {
        Some(bos) if ids.first() != Some(&bos) => std::iter::once(bos).chain(ids.iter().copied()).collect(),
        _ => ids.to_vec(),
    }
}

#[test]
fn llama_matches_transformers() {
    parity("llama");
}

#[test]
fn qwen2_matches_transformers() {
    parity("qwen2");
}

#[test]
fn qwen3_matches_transformers() {
    parity("qwen3");
}

#[test]
fn mistral_matches_transformers() {
    parity("mistral");
}

/// Last-position logits from candle-transformers' own model of the family, on the same weights.
fn candle_transformers_logits(name: &str, ids: &[u32]) -> Vec<f32> {
    use candle_nn::VarBuilder;
    use candle_transformers::models::{llama, mistral, qwen2, qwen3};
    let dir = fixture(name);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    // candle-transformers reads the classic keys; transformers 5 folds rope_theta into rope_parameters.
    if let Some(theta) = cfg.pointer("/rope_parameters/rope_theta").cloned() {
        cfg["rope_theta"] = theta;
    }
    // Its Qwen configs want a number even when sliding windows are off.
    if name.starts_with("qwen") && cfg["sliding_window"].is_null() {
        cfg["sliding_window"] = cfg["max_position_embeddings"].clone();
    }
    let mut weights: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    weights.sort();
    let dev = Device::Cpu;
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&weights, DType::F32, &dev).unwrap() };
    let input = Tensor::new(ids, &dev).unwrap().unsqueeze(0).unwrap();
    let logits = match name {
        "llama" => {
            let c: llama::LlamaConfig = serde_json::from_value(cfg).unwrap();
            let c = c.into_config(false);
            let mut cache = llama::Cache::new(false, DType::F32, &c, &dev).unwrap();
            llama::Llama::load(vb, &c).unwrap().forward(&input, 0, &mut cache).unwrap()
        }
        "qwen2" => {
            let c: qwen2::Config = serde_json::from_value(cfg).unwrap();
            qwen2::ModelForCausalLM::new(&c, vb).unwrap().forward(&input, 0).unwrap()
        }
        "qwen3" => {
            let c: qwen3::Config = serde_json::from_value(cfg).unwrap();
            qwen3::ModelForCausalLM::new(&c, vb).unwrap().forward(&input, 0).unwrap()
        }
        "mistral" => {
            let c: mistral::Config = serde_json::from_value(cfg).unwrap();
            mistral::Model::new(&c, vb).unwrap().forward(&input, 0).unwrap()
        }
        _ => unreachable!(),
    };
    logits.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap()
}

#[test]
fn decoder_agrees_with_candle_transformers() {
    for name in ["llama", "qwen2", "qwen3", "mistral"] {
        let (engine, r) = load(name);
        let mut ids = &r.logits.input_ids[..];
        if let Some(window) = engine.config().sliding_window {
            // candle-transformers' Mistral lets a query see `window + 1` keys, transformers
            // (and Folio) `window`: compare where the two agree, inside the first window.
            ids = &ids[..window.min(ids.len())];
        }
        let theirs = candle_transformers_logits(name, ids);
        let mut kv = engine.model.new_kv();
        let ours: Vec<f32> =
            engine.model.forward(ids, &mut kv, &Dense, Logits::Last).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
        let diff = max_abs_diff(&ours, &theirs);
        let hf = max_abs_diff(&theirs, &r.logits.values[ids.len() - 1]);
        println!(
            "{name}: max |folio - candle-transformers| = {diff:.3e}; candle-transformers vs transformers {hf:.3e}"
        );
        assert!(diff < LOGIT_TOL, "{name}: folio and candle-transformers differ by {diff}");
    }
}

/// The GPU smoke run: every fixture's logits on CUDA (f32 and bf16) against the CPU path and
/// transformers, with the differences printed; greedy tokens identical in f32.
#[cfg(feature = "cuda")]
#[test]
fn cuda_logits_match_cpu() {
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    for name in ["llama", "qwen2", "qwen3", "mistral"] {
        let (cpu, r) = load(name);
        let ids = &r.logits.input_ids;
        let mut kv = cpu.model.new_kv();
        let want: Vec<Vec<f32>> = cpu.model.forward(ids, &mut kv, &Dense, Logits::All).unwrap().to_vec2().unwrap();
        // bf16 rounds every weight and activation (8 bits of mantissa): judge it against the
        // spread of the logits rather than absolutely.
        let range = want
            .iter()
            .map(|row| row.iter().fold(f32::MIN, |a, &b| a.max(b)) - row.iter().fold(f32::MAX, |a, &b| a.min(b)))
            .fold(0.0, f32::max);
        for (dtype, tol) in [(DType::F32, 1e-3f32), (DType::BF16, BF16_REL_TOL * range)] {
            let (engine, _) = load_on(name, &gpu, dtype);
            let mut kv = engine.model.new_kv();
            let got: Vec<Vec<f32>> =
                engine.model.forward(ids, &mut kv, &Dense, Logits::All).unwrap().to_vec2().unwrap();
            let vs_cpu = got.iter().zip(&want).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
            let vs_hf = got.iter().zip(&r.logits.values).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
            println!(
                "{name} cuda {dtype:?}: max |logit diff| vs CPU f32 {vs_cpu:.3e} ({:.2}% of the logit range {range:.1}), vs transformers {vs_hf:.3e}",
                100.0 * vs_cpu / range
            );
            assert!(vs_cpu < tol, "{name} {dtype:?}: CUDA logits differ from CPU by {vs_cpu}");
            if dtype == DType::F32 {
                let params = GenerateParams {
                    max_new_tokens: r.greedy.max_new_tokens,
                    sampling: SamplingParams::default(),
                    stop_strings: vec![],
                    eos_token_ids: engine.eos_token_ids(),
                    prompt_pass: Default::default(),
                };
                let g =
                    engine.generate(&r.greedy.prompt_ids, &params, |_| std::ops::ControlFlow::Continue(())).unwrap();
                assert_eq!(g.tokens, r.greedy.new_tokens, "{name}: CUDA greedy tokens differ");
            }
        }
    }
}
