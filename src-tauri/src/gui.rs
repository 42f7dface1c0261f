//! The desktop window: a Tauri 2 shell around the Svelte UI in ui/.
//!
//! The UI talks to the engine only through the commands below, which call the engine's session
//! API (`folio_models::session`) as the CLI does; answers stream token by token over an
//! `ipc::Channel` (ordered and fast, unlike global events). Generation runs on a blocking
//! thread so the window stays responsive, and Stop flips an atomic flag that the token callback
//! checks.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use folio_models::attention::MethodChoice;
use folio_models::conversation::Conversation;
use folio_models::session::{GenerationSettings, Session};
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
    /// The bare model's session and the conversation so far (user and assistant turns).
    chat: Option<Arc<Mutex<(Session, Conversation)>>>,
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
    let chat = state.chat.clone().ok_or_else(|| {
        state.model_error.clone().unwrap_or_else(|| "No model loaded: start Folio with --model <folder|repo>".into())
    })?;
    let cancel = state.cancel.clone();
    tauri::async_runtime::spawn_blocking(move || {
        // One answer at a time: a question sent while one runs waits here, and clears a Stop
        // only once the answer it was meant for is over. A panic in an earlier answer leaves
        // the session usable (every ask cuts the store back to what it holds).
        let mut guard = chat.lock().unwrap_or_else(|e| e.into_inner());
        cancel.store(false, Ordering::SeqCst);
        let (session, conversation) = &mut *guard;
        let settings = GenerationSettings { max_tokens: MAX_ANSWER_TOKENS, ..GenerationSettings::default() };
        let answer = session
            .ask(conversation, &prompt, &MethodChoice::default(), &settings, |piece| {
                let _ = on_event.send(ChatEvent::Token { text: piece.to_owned() });
                if cancel.load(Ordering::SeqCst) {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .map_err(|e| e.to_string())?;
        let stop_reason = serde_json::to_value(answer.stop_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let tokens = answer.tokens.len();
        let _ = on_event.send(ChatEvent::Done {
            stop_reason: stop_reason.clone(),
            tokens,
            tokens_per_second: answer.timings.decode_tokens_per_s.unwrap_or(0.0),
        });
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
    if let Some(chat) = &state.chat {
        chat.lock().unwrap_or_else(|e| e.into_inner()).1 = Conversation::bare(None);
    }
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
    let bare = engine.clone().map(|e| Arc::new(Mutex::new((Session::bare(e), Conversation::bare(None)))));
    let state = AppState { engine, model_error, device: device_name(&device), chat: bare, cancel: Arc::default() };
    tauri::Builder::default()
        .manage(state)
        .invoke_handler(tauri::generate_handler![app_info, chat, cancel_chat, new_chat])
        .run(tauri::generate_context!())?;
    Ok(())
}
