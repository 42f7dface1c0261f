//! Answering in the window: a question asked of the open chat's session, its tokens streamed
//! over a channel, Stop honoured between tokens, and the turn saved in the library chat it was
//! asked in — even when the window has moved on to another chat meanwhile.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tauri::ipc::Channel;
use tauri::State;

use super::details::AnswerDetails;
use super::{chats, current_chat, until_stopped, AppState};

#[derive(Clone, Serialize, ts_rs::TS)]
#[serde(tag = "event", content = "data", rename_all = "snake_case")]
pub(super) enum ChatEvent {
    Token { text: String },
    Done { stop_reason: String, tokens: usize, tokens_per_second: f64 },
}

#[derive(Serialize, ts_rs::TS)]
pub(super) struct ChatDone {
    stop_reason: String,
    tokens: usize,
    /// The library chat the turn was saved in.
    chat: Option<folio_library::ChatInfo>,
    /// How the answer was made, as saved with it.
    details: AnswerDetails,
    /// Why the turn was not saved (the library cannot be written): the answer stands.
    unsaved: Option<String>,
}

#[tauri::command]
pub(super) async fn chat(
    state: State<'_, AppState>,
    prompt: String,
    on_event: Channel<ChatEvent>,
) -> Result<ChatDone, String> {
    let chat = current_chat(&state)?;
    // Where this turn belongs, as it was asked (the window may move on while it answers).
    let turn_of = chats::TurnOf {
        chat: *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()),
        context: *state.open_context.lock().unwrap_or_else(|e| e.into_inner()),
    };
    let asked_in = chat.clone();
    let cancel = state.cancel.clone();
    let delay = Duration::from_millis(state.token_delay_ms.load(Ordering::SeqCst));
    let question = prompt.clone();
    let method = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut settings = state.generation.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // A context answers with the system prompt it was prefilled with (Settings says so).
    if state.open_context.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
        settings.system = None;
    }
    let generation = settings.clone();
    let (answer, prefill) = tauri::async_runtime::spawn_blocking(move || {
        // One answer at a time: a question sent while one runs waits here, and clears a Stop
        // only once the answer it was meant for is over. A panic in an earlier answer leaves
        // the session usable (every ask cuts the store back to what it holds).
        let mut guard = chat.lock().unwrap_or_else(|e| e.into_inner());
        cancel.store(false, Ordering::SeqCst);
        let (session, conversation) = &mut *guard;
        // A bare chat's system prompt is the settings' (cleared when they have none).
        if session.context().is_none() {
            conversation.system = settings.system.clone().filter(|s| !s.trim().is_empty());
        }
        let answer = session
            .ask(conversation, &question, &method, &settings, |piece| {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                let _ = on_event.send(ChatEvent::Token { text: piece.to_owned() });
                until_stopped(&cancel)
            })
            .map_err(|e| e.to_string())?;
        let _ = on_event.send(ChatEvent::Done {
            stop_reason: stop_reason(&answer),
            tokens: answer.tokens.len(),
            tokens_per_second: answer.timings.decode_tokens_per_s.unwrap_or(0.0),
        });
        let prefill = session.context().map(|f| f.header().prefill_runs()).unwrap_or_default();
        Ok::<_, String>((answer, prefill))
    })
    .await
    .map_err(|e| e.to_string())??;
    let details = AnswerDetails::of(&answer, &generation, &prefill);
    // Still the conversation on screen (not deleted, no other chat, context or model opened)?
    let on_screen =
        state.chat.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|c| Arc::ptr_eq(c, &asked_in))
            && *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) == turn_of.chat;
    let asked_over = turn_of.context;
    let (saved, unsaved) = match chats::save_turn(&state, turn_of, on_screen, &prompt, &answer.text, &details).await {
        Ok(chat) => (on_screen.then_some(chat), None),
        Err(e) => (None, Some(format!("this turn is not saved in the library: {e}"))),
    };
    // What Settings → Attention shows as this method's speed over this context.
    if let (Some(context), Some(rate)) = (asked_over, answer.timings.decode_tokens_per_s) {
        super::choices::record_speed(&state, context, &answer.method, rate).await;
    }
    Ok(ChatDone { stop_reason: stop_reason(&answer), tokens: answer.tokens.len(), chat: saved, details, unsaved })
}

pub(super) fn stop_reason(answer: &folio_models::session::Answer) -> String {
    serde_json::to_value(answer.stop_reason).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

#[tauri::command]
pub(super) fn cancel_chat(state: State<'_, AppState>) {
    state.cancel.store(true, Ordering::SeqCst);
}

/// Forgets the conversation: the next question starts a new chat (over the same context; with
/// the bare model after a chat that could not continue), with the context's default method or
/// dense, not the last chat's. Returns the context the new chat is over (none after a chat that
/// could not continue: the window then shows the model alone).
#[tauri::command]
pub(super) async fn new_chat(state: State<'_, AppState>) -> Result<Option<i64>, String> {
    state.new_conversation()?;
    let context = *state.open_context.lock().unwrap_or_else(|e| e.into_inner());
    let method = match context {
        Some(id) => super::settings::context_method(&state, id).await,
        None => None,
    };
    *state.method.lock().unwrap_or_else(|e| e.into_inner()) = method.unwrap_or_default();
    Ok(context)
}

/// The test hook (see the module docs): each answer token waits `ms` before it is sent, so a
/// test can press Esc mid-answer. Refused unless FOLIO_TEST_HOOKS=1.
#[tauri::command]
pub(super) fn simulate_slow_tokens(state: State<'_, AppState>, ms: u64) -> Result<(), String> {
    super::test_hooks()?;
    state.token_delay_ms.store(ms, Ordering::SeqCst);
    Ok(())
}
