//! The desktop window: a Tauri 2 shell around the Svelte UI in ui/.
//!
//! The UI talks to the engine only through the commands below; answers stream token by token
//! over an `ipc::Channel` (ordered and fast, unlike global events). Generation runs on a
//! blocking thread so the window stays responsive, and Stop flips an atomic flag that the
//! token callback checks.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use folio_models::chat::Message;
use folio_models::generate::GenerateParams;
use folio_models::{device_name, parse_device, parse_dtype, Engine};
use serde::Serialize;
use tauri::ipc::Channel;
use tauri::State;

/// Longest answer the window asks for; the user can Stop earlier.
const MAX_ANSWER_TOKENS: usize = 1024;

struct AppState {
    engine: Option<Arc<Engine>>,
    model_error: Option<String>,
    device: String,
    /// The conversation so far (user and assistant turns).
    history: Arc<Mutex<Vec<Message>>>,
    cancel: Arc<AtomicBool>,
}

#[derive(Serialize)]
struct AppInfo {
    version: &'static str,
    model: Option<String>,
    device: String,
    model_error: Option<String>,
}

#[tauri::command]
fn app_info(state: State<'_, AppState>) -> AppInfo {
    AppInfo {
        version: env!("CARGO_PKG_VERSION"),
        model: state.engine.as_ref().map(|e| e.name.clone()),
        device: state.device.clone(),
        model_error: state.model_error.clone(),
    }
}

#[derive(Clone, Serialize)]
#[serde(tag = "event", content = "data", rename_all = "snake_case")]
enum ChatEvent {
    Token { text: String },
    Done { stop_reason: String, tokens: usize, tokens_per_second: f64 },
}

#[derive(Serialize)]
struct ChatDone {
    stop_reason: String,
    tokens: usize,
}

#[tauri::command]
async fn chat(state: State<'_, AppState>, prompt: String, on_event: Channel<ChatEvent>) -> Result<ChatDone, String> {
    let engine = state.engine.clone().ok_or_else(|| {
        state.model_error.clone().unwrap_or_else(|| "No model loaded: start Folio with --model <folder|repo>".into())
    })?;
    let history = state.history.clone();
    let cancel = state.cancel.clone();
    cancel.store(false, Ordering::SeqCst);
    tauri::async_runtime::spawn_blocking(move || {
        let mut messages = history.lock().map_err(|e| e.to_string())?.clone();
        messages.push(Message::new("user", &prompt));
        let ids = engine.chat_prompt(&messages).map_err(|e| e.to_string())?;
        let params = GenerateParams {
            max_new_tokens: MAX_ANSWER_TOKENS,
            sampling: engine.generation_config.sampling_defaults(),
            stop_strings: Vec::new(),
            eos_token_ids: engine.eos_token_ids(),
        };
        let start = Instant::now();
        let generation = engine
            .generate(&ids, &params, |piece| {
                let _ = on_event.send(ChatEvent::Token { text: piece.to_owned() });
                if cancel.load(Ordering::SeqCst) {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .map_err(|e| e.to_string())?;
        let stop_reason = serde_json::to_value(generation.stop_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let tokens = generation.tokens.len();
        let _ = on_event.send(ChatEvent::Done {
            stop_reason: stop_reason.clone(),
            tokens,
            tokens_per_second: tokens as f64 / start.elapsed().as_secs_f64().max(1e-9),
        });
        messages.push(Message::new("assistant", &generation.text));
        *history.lock().map_err(|e| e.to_string())? = messages;
        Ok(ChatDone { stop_reason, tokens })
    })
    .await
    .map_err(|e| e.to_string())?
}

#[tauri::command]
fn cancel_chat(state: State<'_, AppState>) {
    state.cancel.store(true, Ordering::SeqCst);
}

/// Forgets the conversation: the next question starts a new chat.
#[tauri::command]
fn new_chat(state: State<'_, AppState>) -> Result<(), String> {
    state.history.lock().map_err(|e| e.to_string())?.clear();
    Ok(())
}

pub fn run(model: Option<String>, device: &str, dtype: &str) -> anyhow::Result<()> {
    let device = parse_device(device)?;
    let dtype = parse_dtype(dtype, &device)?;
    // A model that fails to load still opens the window, which says why.
    let (engine, model_error) = match model {
        None => (None, Some("No model configured: start Folio with --model <folder|repo>".to_owned())),
        Some(spec) => match Engine::load(&spec, &device, dtype) {
            Ok(e) => (Some(Arc::new(e)), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    let state =
        AppState { engine, model_error, device: device_name(&device), history: Arc::default(), cancel: Arc::default() };
    tauri::Builder::default()
        .manage(state)
        .invoke_handler(tauri::generate_handler![app_info, chat, cancel_chat, new_chat])
        .run(tauri::generate_context!())?;
    Ok(())
}
