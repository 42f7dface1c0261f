//! What the engine's context tests share: the fixture models, plans of raw tokens, a build
//! with no progress, the budget that buys the smallest chunk, and the samples as documents.
#![allow(dead_code)] // each test file uses its own share of these

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use folio_models::context::{self, BuildOptions, KvDtype, PrefixPlan};
use folio_models::prefill::{plan_chunk, PrefillMode};
use folio_models::{Engine, Error};

pub fn model_dir(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    match name {
        "demo" => root.join("assets/models/demo"),
        _ => root.join("tests/fixtures/models").join(name),
    }
}

pub fn engine(name: &str) -> Engine {
    Engine::load(model_dir(name).to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

pub fn plan(tokens: Vec<u32>) -> PrefixPlan {
    PrefixPlan::raw_tokens(tokens)
}

/// The budget that buys the smallest chunk: prefill goes through many chunks even on tiny prompts.
pub fn smallest_budget(e: &Engine, tokens: usize, kv_dtype: KvDtype) -> u64 {
    smallest_budget_for(e, tokens, kv_dtype, PrefillMode::Dense)
}

/// [`smallest_budget`] of a prefill of `mode`.
pub fn smallest_budget_for(e: &Engine, tokens: usize, kv_dtype: KvDtype, mode: PrefillMode) -> u64 {
    let section = kv_dtype.max_section_bytes(e.config().num_kv_heads * tokens, e.config().head_dim);
    match plan_chunk(&e.model, tokens, (section, mode), Some(1)) {
        Err(Error::MemoryBudget { needed, .. }) => needed,
        other => panic!("a 1-byte budget must be refused, got {other:?}"),
    }
}

pub fn build(e: &Engine, p: &PrefixPlan, out: &Path, kv_dtype: KvDtype, budget: Option<u64>) -> context::BuildReport {
    let opts = BuildOptions { memory_budget: budget, ..BuildOptions::new(kv_dtype) };
    context::build(&e.model, e.stamp().unwrap(), p, out, &opts, &mut |_| ControlFlow::Continue(())).unwrap()
}

pub fn sample_documents() -> Vec<context::DocumentText> {
    let samples = model_dir("demo").join("../../samples");
    ["field_notes.txt", "market_records.txt", "the_diary_of_greta.txt"]
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(samples.join(name)).unwrap();
            context::DocumentText {
                title: (*name).into(),
                path: format!("samples/{name}"),
                bytes: text.len() as u64,
                xxh3: context::format::checksum(text.as_bytes()),
                kind: "text".into(),
                text,
                parts: Vec::new(),
            }
        })
        .collect()
}
