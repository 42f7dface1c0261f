//! Chats saved in the library: every answered turn is stored (question, answer, and how the
//! answer was made), and a chat opened again — after a restart too — continues on its saved
//! context: the engine's session rebuilds the turns' K/V from the messages, with no prefill of
//! the documents. A chat whose context is gone, damaged, or made by another model than the one
//! running stays readable, and asking in it is refused with the reason.

use std::sync::atomic::Ordering;

use folio_library::{ChatInfo, ContextInfo, NewMessage, Status};
use folio_models::attention::MethodChoice;
use folio_models::chat::Message;
use folio_models::session::{Comparison, Session};
use serde::Serialize;
use tauri::State;

use super::details::{AnswerDetails, ChatMessage};
use super::AppState;

/// Where a turn belongs, as it was when asked: its saved chat (`None` before the first
/// answer) and the context the conversation is over.
#[derive(Clone, Copy)]
pub(super) struct TurnOf {
    pub chat: Option<i64>,
    pub context: Option<i64>,
}

/// Saves a turn in the chat it was asked in, making that chat (titled by the question) on its
/// first answer; the new chat becomes the one on screen only if the conversation still is
/// (`on_screen`). A chat deleted meanwhile is an error: the turn is not saved.
pub(super) async fn save_turn(
    state: &AppState,
    turn: TurnOf,
    on_screen: bool,
    question: &str,
    answer: &str,
    details: &AnswerDetails,
) -> Result<ChatInfo, String> {
    let details = serde_json::to_value(details).map_err(|e| e.to_string())?;
    let lib = state.library()?;
    let id = match turn.chat {
        Some(id) => id,
        None => {
            let made = lib.create_chat(turn.context, question).await.map_err(|e| in_words(e, GONE_CONTEXT))?;
            if on_screen {
                *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) = Some(made.id);
                super::settings::save(state).await?;
                remember_last(&lib, made.id).await;
            }
            made.id
        }
    };
    let turn = [
        NewMessage { role: "user", content: question, details: None },
        NewMessage { role: "assistant", content: answer, details: Some(&details) },
    ];
    lib.append_messages(id, &turn).await.map_err(|e| in_words(e, GONE_CHAT))
}

/// The library setting naming the chat the window showed last: a restart opens it again.
const LAST_CHAT_KEY: &str = "window.last_chat";

/// Remembers `id` as the chat on screen. Not remembering only costs the next start its chat,
/// so a failure is not the person's concern here.
async fn remember_last(lib: &folio_library::Library, id: i64) {
    let _ = lib.set_setting(LAST_CHAT_KEY, &serde_json::json!(id)).await;
}

/// The chat the window showed last, when the library still has it: what a restart opens.
#[tauri::command]
pub(super) async fn last_chat(state: State<'_, AppState>) -> Result<Option<i64>, String> {
    let lib = state.library()?;
    let id = lib.setting(LAST_CHAT_KEY).await.map_err(|e| e.to_string())?.and_then(|v| v.as_i64());
    match id {
        Some(id) if lib.chat(id).await.is_ok() => Ok(Some(id)),
        _ => Ok(None),
    }
}

/// What the window says of a chat, or of a chat's context, the library no longer has (the
/// library's own message names it by id, which is for the terminal).
const GONE_CHAT: &str = "this chat is no longer in the library (it was deleted, or its context was removed)";
const GONE_CONTEXT: &str = "its context is no longer in the library (it was removed)";

/// A library error as the window shows it: `gone` for what is no longer there.
fn in_words(e: folio_library::Error, gone: &str) -> String {
    match e {
        folio_library::Error::NotFound(_) => gone.to_owned(),
        other => other.to_string(),
    }
}

#[tauri::command]
pub(super) async fn list_chats(state: State<'_, AppState>, search: Option<String>) -> Result<Vec<ChatInfo>, String> {
    state.library()?.chats(search.as_deref()).await.map_err(|e| e.to_string())
}

/// A chat opened in the window.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct OpenedChat {
    chat: ChatInfo,
    messages: Vec<ChatMessage>,
    /// The context it is over.
    context: Option<ContextInfo>,
    /// Why it cannot be continued here (it stays readable).
    refused: Option<String>,
}

/// Why a chat over `context` cannot continue with the running model, if it cannot.
fn refusal(state: &AppState, context: &ContextInfo) -> Option<String> {
    if context.status != Status::Ready {
        return Some(format!(
            "{} is {}: this chat stays readable, and continues once its context is ready again",
            context.name,
            context.status.as_str()
        ));
    }
    let running = state.engine().ok()?.stamp().ok().and_then(|st| serde_json::to_string(&st.fingerprint).ok());
    (running.as_deref() != Some(context.model.fingerprint.as_str())).then(|| {
        format!(
            "{} was made with {}: load it (Settings, or the context's panel) to continue this chat",
            context.name, context.model.name
        )
    })
}

/// Opens chat `id`: its messages, and the conversation continued on its context.
#[tauri::command]
pub(super) async fn open_chat(state: State<'_, AppState>, id: i64) -> Result<OpenedChat, String> {
    let lib = state.library()?;
    let chat = lib.chat(id).await.map_err(|e| in_words(e, GONE_CHAT))?;
    let rows = lib.messages(id).await.map_err(|e| in_words(e, GONE_CHAT))?;
    let messages: Vec<ChatMessage> = rows.into_iter().map(ChatMessage::from).collect();
    let context = match chat.context_id {
        Some(c) => Some(lib.context(c).await.map_err(|e| e.to_string())?),
        None => None,
    };
    let engine = match state.engine() {
        Ok(engine) => engine,
        // Readable without a model; asking needs one.
        Err(why) => {
            *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
            *state.refusal.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
            return Ok(OpenedChat { chat, messages, context, refused: Some(why) });
        }
    };
    let mut refused = context.as_ref().and_then(|c| refusal(&state, c));
    // A chat that stored no method (an older one) takes its context's default, or dense.
    let default_method = match &context {
        Some(c) => super::settings::context_method(&state, c.id).await.unwrap_or_default(),
        None => MethodChoice::default(),
    };
    let session = match (&context, refused.is_some()) {
        (_, true) => None,
        (Some(c), false) => {
            let settings = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let method = chat
                .settings
                .as_ref()
                .and_then(super::settings::stored_method)
                .unwrap_or_else(|| default_method.clone());
            // Its method on this tier, or the planner, may refuse: the chat stays readable.
            match super::engine::open_session(&state, &settings, engine.clone(), &c.path, &method).await {
                Ok(session) => Some(session),
                Err(why) => {
                    refused = Some(format!(
                        "{why}: this chat stays readable; change its method or the engine settings to continue it"
                    ));
                    None
                }
            }
        }
        (None, false) => Some(Session::bare(engine)),
    };
    if let Some(session) = session {
        let turns = messages.iter().map(|m| Message::new(&m.role, &m.content)).collect();
        *state.chat.lock().unwrap_or_else(|e| e.into_inner()) = Some(super::chat_of(session, Some(turns)));
    }
    *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) = chat.context_id;
    *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
    // Its stored method, else the default: the previous chat's never carries over.
    *state.method.lock().unwrap_or_else(|e| e.into_inner()) = default_method;
    super::settings::restore(&state, chat.settings.as_ref());
    *state.refusal.lock().unwrap_or_else(|e| e.into_inner()) = refused.clone();
    remember_last(&lib, id).await;
    Ok(OpenedChat { chat, messages, context, refused })
}

#[tauri::command]
pub(super) async fn rename_chat(state: State<'_, AppState>, id: i64, title: String) -> Result<ChatInfo, String> {
    state.library()?.rename_chat(id, &title).await.map_err(|e| e.to_string())
}

/// Deletes chat `id`; when it is the one on screen, the next question starts a new chat over
/// the same context.
#[tauri::command]
pub(super) async fn delete_chat(state: State<'_, AppState>, id: i64) -> Result<(), String> {
    state.library()?.delete_chat(id).await.map_err(|e| e.to_string())?;
    if *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) == Some(id) {
        // A new chat, as the window's "new chat" makes one (with the bare model after a chat
        // that could not continue).
        state.new_conversation()?;
    }
    Ok(())
}

/// A new chat with the first `keep` messages of chat `id` (whole turns), opened.
#[tauri::command]
pub(super) async fn fork_chat(state: State<'_, AppState>, id: i64, keep: u64) -> Result<OpenedChat, String> {
    let fork = state.library()?.fork_chat(id, keep).await.map_err(|e| e.to_string())?;
    open_chat(state, fork.id).await
}

/// Drops the last answer of the chat on screen (`id`) and its question, returning the
/// question: the window asks it again.
#[tauri::command]
pub(super) async fn regenerate(state: State<'_, AppState>, id: i64) -> Result<String, String> {
    if *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) != Some(id) {
        return Err("only the chat on screen can answer again: open it first".into());
    }
    let chat = super::current_chat(&state)?;
    let lib = state.library()?;
    let messages = lib.messages(id).await.map_err(|e| e.to_string())?;
    let keep = messages.len().checked_sub(2).ok_or("this chat has no answer to give again")?;
    let held = chat.try_lock().map_err(|_| "wait for the answer to finish".to_owned())?.1.messages.len();
    if held != messages.len() {
        return Err(format!(
            "this chat has {} turns on screen and {} saved (a turn was not saved): fork it or start a new chat",
            held / 2,
            messages.len() / 2
        ));
    }
    let question = messages[keep].content.clone();
    lib.truncate_chat(id, keep as u64).await.map_err(|e| e.to_string())?;
    chat.lock().unwrap_or_else(|e| e.into_inner()).1.messages.truncate(keep);
    Ok(question)
}

/// How far a comparison with dense has got (answer steps of its three passes).
#[derive(Clone, Serialize, ts_rs::TS)]
pub(super) struct CompareProgress {
    done: usize,
    total: usize,
}

/// Compares answer `position` of the chat on screen with dense attention on the same context
/// and turn (`Session::compare_with_dense`): its method and tokens replayed, dense's own answer
/// with the same generation settings. Stop (`cancel_chat`) stops it. The comparison is saved
/// with the answer's details and returned.
#[tauri::command]
pub(super) async fn compare_dense(
    state: State<'_, AppState>,
    position: u64,
    on_event: tauri::ipc::Channel<CompareProgress>,
) -> Result<Comparison, String> {
    let id = state.chat_id.lock().unwrap_or_else(|e| e.into_inner()).ok_or("this answer is not saved in a chat")?;
    let chat = super::current_chat(&state)?;
    let lib = state.library()?;
    let messages = lib.messages(id).await.map_err(|e| e.to_string())?;
    let at = usize::try_from(position).map_err(|e| e.to_string())?;
    let (row, asked) = match (messages.get(at), at.checked_sub(1).and_then(|q| messages.get(q))) {
        (Some(row), Some(asked)) if row.role == "assistant" => (row, asked),
        _ => return Err("there is no answer at that place".into()),
    };
    let question = &asked.content;
    let stored = row.details.clone().ok_or("this answer has no record of how it was made")?;
    let details = AnswerDetails::read(&stored).ok_or("this answer's record of how it was made cannot be read")?;
    let method = details.method;
    let tokens = details.answer_tokens.ok_or(
        "this answer was saved by an earlier Folio, without its tokens: answer again, then compare the new answer",
    )?;
    let generation =
        details.generation.unwrap_or_else(|| state.generation.lock().unwrap_or_else(|e| e.into_inner()).clone());
    let version = details.context;
    let turns: Vec<Message> = messages[..at - 1].iter().map(|m| Message::new(&m.role, &m.content)).collect();
    let (cancel, question) = (state.cancel.clone(), question.clone());
    let comparison = tauri::async_runtime::spawn_blocking(move || {
        // Like an answer: one at a time on the session, and Stop stops it.
        let mut guard = chat.lock().unwrap_or_else(|e| e.into_inner());
        cancel.store(false, Ordering::SeqCst);
        let session = &mut guard.0;
        // Over the version of the context the answer read: a context changed since has its
        // documents elsewhere, and the replay would not be the answer's turn.
        if let Some(version) = &version {
            if session.context().map(|f| f.context_id()) != Some(version.as_str()) {
                return Err("the context has changed since this answer (documents were added or taken out): \
                            ask again to compare a new answer"
                    .to_owned());
            }
        }
        let mut conversation = session.new_conversation();
        conversation.messages = turns;
        session
            .compare_with_dense(&conversation, &question, &tokens, &method, &generation, |done, total| {
                let _ = on_event.send(CompareProgress { done, total });
                super::until_stopped(&cancel)
            })
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())??;
    // Written into the record as stored: fields an earlier or later Folio kept stay.
    let mut saved = stored;
    saved["comparison"] = serde_json::to_value(&comparison).map_err(|e| e.to_string())?;
    lib.set_message_details(id, position, &saved).await.map_err(|e| e.to_string())?;
    Ok(comparison)
}
