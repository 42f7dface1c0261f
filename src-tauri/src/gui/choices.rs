//! Settings → Attention's choices for the open context: each method with its speed measured
//! on this machine over this context, its measured answer quality, and the one recommended.
//!
//! Why measured here and not predicted: a method's speed depends on the machine, the tier and
//! the context's length together, and the window answers over one context at a time. Every
//! answer over a context at its method's default settings records its decode rate under that
//! method (a running mean in the library's settings, per context; dropped when the context's
//! file is written again or the device or tier changes), and "Measure" times the methods that
//! have none yet with a short answer each. Quality is
//! not measured per machine: it is docs/quality.md's fidelity table at 1M tokens (demo model,
//! each method at its default budget), shown with where it comes from. The recommendation is
//! issue #44's rule: dense where it answers at [`DENSE_ENOUGH`] tokens/s or more, else the
//! fastest method that answered as many fidelity prompts as dense.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use tauri::ipc::Channel;
use tauri::State;

use folio_library::ContextInfo;
use folio_models::attention::{MethodChoice, Tier, REGISTRY};
use folio_models::session::GenerationSettings;

use super::AppState;

/// Decode tokens per second at which dense is fast enough to read along: dense keeps every
/// answer, so it is the choice wherever it is this fast.
const DENSE_ENOUGH: f64 = 15.0;

/// Tokens a measuring answer may take: enough steps for a steady rate, few enough for seconds.
const MEASURE_TOKENS: usize = 24;

/// The question a measuring answer asks (its text is never shown or saved).
const MEASURE_QUESTION: &str = "what is in these documents ?";

/// docs/quality.md, "every method at its default budget, 1M tokens" (demo model, 9 prompts:
/// chain, pair, needle): the method, the budget measured, and the prompts it answered.
const FIDELITY_1M: [(&str, &str, u32); 7] = [
    ("dense", "", 7),
    ("streaming", "5%", 0),
    ("hip", "512", 8),
    ("topk", "1%", 7),
    ("magicpig", "1%", 7),
    ("double-sparsity", "6.25%", 4),
    ("buzz", "10%", 0),
];
const FIDELITY_PROMPTS: u32 = 9;

/// A method's measured answer quality.
#[derive(Debug, Clone, Serialize, ts_rs::TS)]
pub(super) struct Quality {
    /// Prompts answered right, of `of`, and dense's on the same prompts.
    answered: u32,
    of: u32,
    dense: u32,
    budget: String,
    /// Where the figure comes from.
    source: String,
}

/// A method's decode rate over one context, from its answers and measurements.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ts_rs::TS)]
pub(super) struct Speed {
    tokens_per_s: f64,
    /// Answers averaged.
    answers: u32,
}

/// The speeds kept for a context: valid for the file as it was saved at `saved_at` (a change
/// of its documents writes it again; a removed context's id used again is another file) and
/// for the device and tier in `setup`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Speeds {
    tokens: u64,
    #[serde(default)]
    saved_at: String,
    #[serde(default)]
    setup: String,
    methods: BTreeMap<String, Speed>,
}

#[derive(Debug, Serialize, ts_rs::TS)]
pub(super) struct Choice {
    method: String,
    summary: String,
    speed: Option<Speed>,
    quality: Option<Quality>,
    /// Answered as many of the fidelity prompts as dense did.
    keeps_answers: Option<bool>,
    /// It runs on the tier the context is open on (topk-ivf has no offloaded path).
    runs_here: bool,
}

#[derive(Debug, Serialize, ts_rs::TS)]
pub(super) struct Choices {
    /// The open context's tokens (`None`: no context open, nothing to choose for).
    tokens: Option<u64>,
    choices: Vec<Choice>,
    recommended: Option<String>,
    /// Why, in a sentence.
    why: String,
}

#[derive(Clone, Serialize, ts_rs::TS)]
pub(super) struct MeasureProgress {
    method: String,
    done: usize,
    total: usize,
}

fn speeds_key(context: i64) -> String {
    format!("context.{context}.speeds")
}

fn quality(method: &str) -> Option<Quality> {
    let dense = FIDELITY_1M[0].2;
    FIDELITY_1M.iter().find(|q| q.0 == method).map(|&(_, budget, answered)| Quality {
        answered,
        of: FIDELITY_PROMPTS,
        dense,
        budget: budget.to_owned(),
        source: "docs/quality.md: chain, pair and needle prompts at 1M tokens, demo model".to_owned(),
    })
}

/// The device and tier answers run on now, as the speeds record them.
fn setup(state: &AppState) -> (String, Tier) {
    let e = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner());
    let tier = if e.offload { Tier::Offloaded } else { Tier::Resident };
    (format!("{} {}", e.device, tier.name()), tier)
}

/// The open context's library id and its entry.
async fn open_context(state: &AppState) -> Result<Option<(i64, ContextInfo)>, String> {
    let Some(id) = *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) else { return Ok(None) };
    match state.library()?.context(id).await {
        Ok(info) => Ok(Some((id, info))),
        Err(_) => Err("the open context is no longer in the library".into()),
    }
}

async fn read_speeds(state: &AppState, context: i64, info: &ContextInfo) -> Speeds {
    let stored = match state.library() {
        Ok(lib) => lib.setting(&speeds_key(context)).await.ok().flatten(),
        Err(_) => None,
    };
    let (setup, _) = setup(state);
    stored
        .and_then(|v| serde_json::from_value::<Speeds>(v).ok())
        .filter(|s| s.tokens == info.tokens && s.saved_at == info.saved_at && s.setup == setup)
        .unwrap_or(Speeds { tokens: info.tokens, saved_at: info.saved_at.clone(), setup, methods: BTreeMap::new() })
}

/// Adds an answer's decode rate to its method's mean over `context` (an answer at the
/// method's default settings: what a choice clicked in the list applies).
pub(super) async fn record_speed(state: &AppState, context: i64, method: &MethodChoice, tokens_per_s: f64) {
    if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) || method.budget.is_some() || !method.params.is_empty() {
        return;
    }
    let Ok(lib) = state.library() else { return };
    let Ok(info) = lib.context(context).await else { return };
    let mut speeds = read_speeds(state, context, &info).await;
    let method = method.method.as_str();
    let s = speeds.methods.entry(method.to_owned()).or_default();
    s.tokens_per_s = (s.tokens_per_s * s.answers as f64 + tokens_per_s) / (s.answers + 1) as f64;
    s.answers += 1;
    if let Ok(value) = serde_json::to_value(&speeds) {
        if let Err(e) = lib.set_setting(&speeds_key(context), &value).await {
            tracing::warn!("the method speeds are not saved: {e}");
        }
    }
}

/// The choices for the open context (see the module docs).
async fn choices(state: &AppState) -> Result<Choices, String> {
    let Some((context, info)) = open_context(state).await? else {
        return Ok(Choices {
            tokens: None,
            choices: Vec::new(),
            recommended: None,
            why: "Open a context to compare the methods over it.".into(),
        });
    };
    let speeds = read_speeds(state, context, &info).await;
    let (_, tier) = setup(state);
    let choices: Vec<Choice> = REGISTRY
        .iter()
        .map(|spec| {
            let quality = quality(spec.name);
            Choice {
                method: spec.name.to_owned(),
                summary: spec.summary.to_owned(),
                speed: speeds.methods.get(spec.name).cloned(),
                keeps_answers: quality.as_ref().map(|q| q.answered >= q.dense),
                runs_here: spec.check_tier(tier).is_ok(),
                quality,
            }
        })
        .collect();
    let (recommended, why) = recommend(&choices);
    Ok(Choices { tokens: Some(info.tokens), choices, recommended, why })
}

/// Issue #44's rule (see the module docs), with the reason in words.
fn recommend(choices: &[Choice]) -> (Option<String>, String) {
    let rate = |c: &Choice| c.speed.as_ref().map(|s| s.tokens_per_s);
    let dense = choices.iter().find(|c| c.method == "dense").and_then(rate);
    match dense {
        None => (None, "Measure to see which method to use: dense has not answered over this context yet.".into()),
        Some(r) if r >= DENSE_ENOUGH => (
            Some("dense".into()),
            format!("it answers at {r:.0} tokens/s here ({DENSE_ENOUGH:.0} or more) and reads every row, so it keeps every answer."),
        ),
        Some(r) => {
            let fastest = choices
                .iter()
                .filter(|c| c.method != "dense" && c.keeps_answers == Some(true) && c.runs_here)
                .filter_map(|c| rate(c).map(|s| (c, s)))
                .max_by(|a, b| a.1.total_cmp(&b.1));
            match fastest {
                Some((c, s)) if s > r => (
                    Some(c.method.clone()),
                    format!(
                        "dense answers at {r:.1} tokens/s here, under {DENSE_ENOUGH:.0}; {} at {s:.1}, and it got as many test prompts right as dense.",
                        c.method
                    ),
                ),
                _ => (
                    Some("dense".into()),
                    format!("it answers at {r:.1} tokens/s here; no method that keeps its answers was measured faster."),
                ),
            }
        }
    }
}

#[tauri::command]
pub(super) async fn method_choices(state: State<'_, AppState>) -> Result<Choices, String> {
    choices(&state).await
}

/// Times a short answer of each method that has no speed yet over the open context (dense
/// and the methods that keep its answers and run on this tier), on the open chat's session.
/// The chat's conversation is not touched, but the session's method and held turns are, as
/// `compare_with_dense` leaves them: the chat's next answer builds its turns again. Stop stops
/// between methods and answer tokens.
#[tauri::command]
pub(super) async fn measure_methods(
    state: State<'_, AppState>,
    on_event: Channel<MeasureProgress>,
) -> Result<Choices, String> {
    let (context, _) = open_context(&state).await?.ok_or("open a context to measure the methods over it")?;
    let before = choices(&state).await?;
    let todo: Vec<String> = before
        .choices
        .iter()
        .filter(|c| c.speed.is_none() && c.runs_here && (c.method == "dense" || c.keeps_answers == Some(true)))
        .map(|c| c.method.clone())
        .collect();
    if todo.is_empty() {
        return Ok(before);
    }
    let chat = super::current_chat(&state)?;
    let cancel = state.cancel.clone();
    let total = todo.len();
    let measured = tauri::async_runtime::spawn_blocking(move || {
        let mut guard = chat.lock().unwrap_or_else(|e| e.into_inner());
        cancel.store(false, Ordering::SeqCst);
        let session = &mut guard.0;
        let settings = GenerationSettings { max_tokens: MEASURE_TOKENS, ..GenerationSettings::default() };
        // What was measured before a method failed is kept; the failure is said after.
        let (mut measured, mut failed) = (Vec::new(), None);
        for (done, method) in todo.iter().enumerate() {
            if cancel.load(Ordering::SeqCst) {
                break;
            }
            let _ = on_event.send(MeasureProgress { method: method.clone(), done, total });
            let choice = MethodChoice { method: method.clone(), ..MethodChoice::default() };
            let mut scratch = session.new_conversation();
            match session.ask(&mut scratch, MEASURE_QUESTION, &choice, &settings, |_| super::until_stopped(&cancel)) {
                Ok(answer) => match answer.timings.decode_tokens_per_s {
                    Some(rate) => measured.push((choice, rate)),
                    None => {
                        failed = Some(format!("{method} answered too briefly to time (one token)"));
                        break;
                    }
                },
                Err(e) => {
                    failed = Some(format!("measuring {method}: {e}"));
                    break;
                }
            }
        }
        (measured, failed)
    })
    .await
    .map_err(|e| e.to_string())?;
    let (measured, failed) = measured;
    for (choice, rate) in measured {
        record_speed(&state, context, &choice, rate).await;
    }
    match failed {
        Some(why) => Err(why),
        None => choices(&state).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(method: &str, rate: Option<f64>) -> Choice {
        let quality = quality(method);
        Choice {
            method: method.into(),
            summary: String::new(),
            speed: rate.map(|tokens_per_s| Speed { tokens_per_s, answers: 1 }),
            keeps_answers: quality.as_ref().map(|q| q.answered >= q.dense),
            runs_here: method != "topk-ivf",
            quality,
        }
    }

    /// Dense when fast enough; else the fastest that keeps dense's answers (never one that
    /// does not, however fast); dense when nothing that keeps them is faster; none unmeasured.
    #[test]
    fn the_recommendation_follows_the_rule() {
        let r = |c: &[Choice]| recommend(c).0;
        assert_eq!(r(&[choice("dense", Some(40.0)), choice("hip", Some(90.0))]).as_deref(), Some("dense"));
        let slow = [choice("dense", Some(4.0)), choice("hip", Some(30.0)), choice("streaming", Some(99.0))];
        assert_eq!(r(&slow).as_deref(), Some("hip"));
        let none_faster = [choice("dense", Some(4.0)), choice("hip", Some(3.0)), choice("buzz", Some(50.0))];
        assert_eq!(r(&none_faster).as_deref(), Some("dense"));
        assert_eq!(r(&[choice("hip", Some(30.0))]), None);
        assert_eq!(quality("double-sparsity").map(|q| q.answered < q.dense), Some(true));
        assert!(quality("topk-ivf").is_none());
        assert!(FIDELITY_1M.iter().all(|q| REGISTRY.iter().any(|s| s.name == q.0)), "every figure names a method");
    }
}
