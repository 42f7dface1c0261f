//! The desktop window: a Tauri 2 shell around the Svelte UI in ui/.
//!
//! The UI talks to the engine only through the commands below, which call the engine's session
//! API (`folio_models::session`) and the library (`folio_library`) as the CLI does. Streams go
//! over `ipc::Channel`s (ordered, and they need no event permission): a chat answer's tokens,
//! a staging count's progress, and the window's own feed ([`UiEvent`]: files dropped on the
//! window, drag hover, prefill job snapshots), which the UI opens once with `watch`.
//! Generation, counting and prefill run off the UI thread, so the window stays responsive;
//! Stop and Cancel flip atomic flags the work checks.
//!
//! Files reach the app through Tauri's drag-drop window event (`on_drop`); with
//! `FOLIO_TEST_HOOKS=1` in the environment the `simulate_drop` command calls the same
//! `on_drop`, so the WebDriver test drops a folder through the path a real drop takes from the
//! event on (WebDriver cannot drag files from outside the page), and `simulate_export` exports
//! without the save dialog. Dialogs (pick documents, import, export) open from the Rust side,
//! so the webview holds no dialog permission.

mod chats;
mod engine;
mod jobs;
mod models;
mod settings;
mod sources;

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use candle_core::{DType, Device};
use folio_library::{ContextInfo, DocumentInfo, Library};
use folio_models::attention::MethodChoice;
use folio_models::context::format::SectionKind;
use folio_models::context::staging::{self, Estimate, StagedDocument};
use folio_models::context::{self, Builder, Change};
use folio_models::conversation::Conversation;
use folio_models::session::{GenerationSettings, Session};
use folio_models::{device_name, parse_device, parse_dtype, Engine};
use serde::{Deserialize, Serialize};
use tauri::ipc::Channel;
use tauri::{Manager, State};

use crate::ingest;
use crate::listing::rate_key;
use jobs::{JobKind, JobView, Jobs, Worker};

/// Longest answer the window asks for unless its settings say otherwise; the user can Stop
/// earlier.
const MAX_ANSWER_TOKENS: usize = 1024;
/// The environment variable that enables `simulate_drop` (the WebDriver test).
const TEST_HOOKS_ENV: &str = "FOLIO_TEST_HOOKS";
/// The file in Folio's home that keeps the prefills queued and not started.
const QUEUE_FILE: &str = "queue.json";
/// The extension of context files (what the import and export dialogs filter on).
const CONTEXT_EXTENSION: &str = "folio";
/// The library setting: resume interrupted prefills when the window starts (bool).
const AUTO_RESUME: &str = "prefill.auto_resume";

type Chat = Arc<Mutex<(Session, Conversation)>>;

struct AppState {
    /// The model the window runs; `load_model` replaces it.
    model: RwLock<Loaded>,
    /// The compute dtype asked for (`--dtype`: auto is f32 on the CPU, bf16 on a GPU).
    dtype_spec: String,
    /// The engine settings (device, memory budgets, K/V dtype, offload; `engine.rs`).
    engine_settings: Mutex<engine::EngineSettings>,
    /// The memory planner's bandwidths of a device, once measured.
    bandwidths: Mutex<Option<(String, folio_models::plan::Bandwidths)>>,
    /// The session answering now (the bare model, or an opened context) and its conversation.
    chat: Mutex<Option<Chat>>,
    /// The library id of the context the chat is over.
    open_context: Mutex<Option<i64>>,
    /// The library chat the conversation is saved in (`None` until its first answer).
    chat_id: Mutex<Option<i64>>,
    /// Why the open chat cannot be continued (its context is gone or needs another model);
    /// it stays readable.
    refusal: Mutex<Option<String>>,
    /// The attention method and generation settings the next answer uses (the chat's; see
    /// `settings.rs`).
    method: Mutex<MethodChoice>,
    generation: Mutex<GenerationSettings>,
    cancel: Arc<AtomicBool>,
    /// Shared with the prefill worker: a rebuild replaces it for both.
    library: jobs::SharedLibrary,
    library_error: Mutex<Option<String>>,
    jobs: Jobs,
    feed: Arc<Mutex<Option<Channel<UiEvent>>>>,
    /// What the window should tell at start (a last-used model that no longer loads).
    startup_notice: Option<String>,
}

/// The loaded model, or why there is none.
#[derive(Default)]
struct Loaded {
    engine: Option<Arc<Engine>>,
    error: Option<String>,
}

impl AppState {
    fn library(&self) -> Result<Library, String> {
        self.library
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| self.library_error.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default())
    }

    /// Where the next model loads and in which dtype: the running model's device (else the
    /// settings' device).
    fn compute(&self) -> Result<(Device, DType), String> {
        let device = match self.engine() {
            Ok(engine) => engine.model.device().clone(),
            Err(_) => {
                let spec = self.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).device.clone();
                parse_device(&spec).map_err(|e| e.to_string())?
            }
        };
        let dtype = parse_dtype(&self.dtype_spec, &device).map_err(|e| e.to_string())?;
        Ok((device, dtype))
    }

    /// The library id of the context the chat is over; `none` says why that is needed.
    fn open_context_id(&self, none: &str) -> Result<i64, String> {
        self.open_context.lock().unwrap_or_else(|e| e.into_inner()).ok_or_else(|| none.to_owned())
    }

    /// The library's row of the context the chat is over; `none` says why that is needed.
    async fn open_context_info(&self, none: &str) -> Result<ContextInfo, String> {
        let id = self.open_context_id(none)?;
        self.library()?.context(id).await.map_err(|e| e.to_string())
    }

    /// The device as the library's prefill rates name it.
    fn device_label(&self) -> String {
        self.engine().map_or_else(|_| "none".into(), |e| device_name(e.model.device()))
    }

    fn engine(&self) -> Result<Arc<Engine>, String> {
        let loaded = self.model.read().unwrap_or_else(|e| e.into_inner());
        loaded.engine.clone().ok_or_else(|| {
            loaded.error.clone().unwrap_or_else(|| "No model loaded: pick one in Settings (Ctrl+,)".into())
        })
    }
}

/// What the window's feed carries.
#[derive(Clone, Serialize)]
#[serde(tag = "event", content = "data", rename_all = "snake_case")]
enum UiEvent {
    /// Files or folders dropped on the window.
    Dropped { paths: Vec<PathBuf> },
    /// Files are dragged over the window (true) or left it (false).
    Hover { over: bool },
    /// Every prefill job of this run.
    Jobs { jobs: Vec<JobView> },
}

/// Whether long work goes on: `Break` once Stop (or Cancel) set `flag`.
fn until_stopped(flag: &AtomicBool) -> ControlFlow<()> {
    match flag.load(Ordering::SeqCst) {
        true => ControlFlow::Break(()),
        false => ControlFlow::Continue(()),
    }
}

fn send(feed: &Mutex<Option<Channel<UiEvent>>>, event: UiEvent) {
    if let Some(ch) = feed.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        let _ = ch.send(event);
    }
}

#[derive(Serialize)]
struct AppInfo {
    version: &'static str,
    model: Option<String>,
    device: String,
    model_error: Option<String>,
    library: Option<PathBuf>,
    library_error: Option<String>,
    /// What the window shows of the loaded model.
    model_facts: Option<ModelFacts>,
    startup_notice: Option<String>,
}

/// The loaded model, as `folio info` describes it.
#[derive(Serialize)]
struct ModelFacts {
    /// How it was loaded (a folder or repo id): what `--model` takes.
    source: String,
    architecture: String,
    parameters: usize,
    layers: usize,
    /// Context length in tokens.
    max_context: usize,
    /// K/V bytes one token of context takes, stored as the window stores it.
    kv_bytes_per_token: u64,
    /// Its fingerprint as the library stores it: a context whose model has another one was
    /// made by another model (and cannot be opened with this one).
    fingerprint: Option<String>,
}

#[tauri::command]
fn app_info(state: State<'_, AppState>) -> AppInfo {
    let library = state.library.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|l| l.database().to_owned());
    let loaded = state.model.read().unwrap_or_else(|e| e.into_inner());
    AppInfo {
        version: env!("CARGO_PKG_VERSION"),
        model: loaded.engine.as_ref().map(|e| e.name.clone()),
        device: state.device_label(),
        model_error: loaded.error.clone(),
        library,
        library_error: state.library_error.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        startup_notice: state.startup_notice.clone(),
        model_facts: loaded.engine.as_ref().map(|e| {
            let cfg = e.config();
            ModelFacts {
                source: e.source.clone(),
                architecture: cfg.arch.name().to_owned(),
                parameters: e.model.parameters(),
                layers: cfg.num_layers,
                max_context: cfg.max_position_embeddings,
                kv_bytes_per_token: [SectionKind::Keys, SectionKind::Values]
                    .iter()
                    .map(|&kind| context::DEFAULT_KV_DTYPE.section_bytes(kind, cfg.num_kv_heads, cfg.head_dim))
                    .sum::<u64>()
                    * cfg.num_layers as u64,
                fingerprint: e.stamp().ok().and_then(|st| serde_json::to_string(&st.fingerprint).ok()),
            }
        }),
    }
}

/// Opens the window's feed; the jobs so far are sent at once.
#[tauri::command]
fn watch(state: State<'_, AppState>, on_event: Channel<UiEvent>) {
    let _ = on_event.send(UiEvent::Jobs { jobs: state.jobs.views() });
    *state.feed.lock().unwrap_or_else(|e| e.into_inner()) = Some(on_event);
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
    /// The library chat the turn was saved in.
    chat: Option<folio_library::ChatInfo>,
    /// How the answer was made, as saved with it (see [`answer_details`]).
    details: serde_json::Value,
    /// Why the turn was not saved (the library cannot be written): the answer stands.
    unsaved: Option<String>,
}

/// What the library keeps with an answer: the method and its full settings, the generation
/// settings and the answer's tokens (what a comparison with dense replays), timings, sources.
fn answer_details(answer: &folio_models::session::Answer, generation: &GenerationSettings) -> serde_json::Value {
    serde_json::json!({
        "method": answer.method,
        "settings": answer.settings,
        "generation": generation,
        "answer_tokens": answer.tokens,
        "stop_reason": answer.stop_reason,
        "tokens": answer.tokens.len(),
        "timings": answer.timings,
        "sources": answer.sources,
        "index": answer.index,
        "context": answer.context,
        "reused_tokens": answer.reused_tokens,
    })
}

/// A chat of `session` with a new conversation (and `conversation`'s turns, when given). The
/// window's sessions weigh their answers' sources by attention mass (the sources line).
fn chat_of(mut session: Session, turns: Option<Vec<folio_models::chat::Message>>) -> Chat {
    session.weigh_sources(true);
    let mut conversation = session.new_conversation();
    if let Some(turns) = turns {
        conversation.messages = turns;
    }
    Arc::new(Mutex::new((session, conversation)))
}

fn current_chat(state: &AppState) -> Result<Chat, String> {
    if let Some(why) = state.refusal.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        return Err(why);
    }
    match state.chat.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        Some(chat) => Ok(chat),
        None => Err(state.engine().err().unwrap_or_default()),
    }
}

#[tauri::command]
async fn chat(state: State<'_, AppState>, prompt: String, on_event: Channel<ChatEvent>) -> Result<ChatDone, String> {
    let chat = current_chat(&state)?;
    // Where this turn belongs, as it was asked (the window may move on while it answers).
    let turn_of = chats::TurnOf {
        chat: *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()),
        context: *state.open_context.lock().unwrap_or_else(|e| e.into_inner()),
    };
    let asked_in = chat.clone();
    let cancel = state.cancel.clone();
    let question = prompt.clone();
    let method = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut settings = state.generation.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // A context answers with the system prompt it was prefilled with (Settings says so).
    if state.open_context.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
        settings.system = None;
    }
    let generation = settings.clone();
    let answer = tauri::async_runtime::spawn_blocking(move || {
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
                let _ = on_event.send(ChatEvent::Token { text: piece.to_owned() });
                until_stopped(&cancel)
            })
            .map_err(|e| e.to_string())?;
        let _ = on_event.send(ChatEvent::Done {
            stop_reason: stop_reason(&answer),
            tokens: answer.tokens.len(),
            tokens_per_second: answer.timings.decode_tokens_per_s.unwrap_or(0.0),
        });
        Ok::<_, String>(answer)
    })
    .await
    .map_err(|e| e.to_string())??;
    let details = answer_details(&answer, &generation);
    // Still the conversation on screen (not deleted, no other chat, context or model opened)?
    let on_screen =
        state.chat.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|c| Arc::ptr_eq(c, &asked_in))
            && *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) == turn_of.chat;
    let (saved, unsaved) = match chats::save_turn(&state, turn_of, on_screen, &prompt, &answer.text, &details).await {
        Ok(chat) => (on_screen.then_some(chat), None),
        Err(e) => (None, Some(format!("this turn is not saved in the library: {e}"))),
    };
    Ok(ChatDone { stop_reason: stop_reason(&answer), tokens: answer.tokens.len(), chat: saved, details, unsaved })
}

fn stop_reason(answer: &folio_models::session::Answer) -> String {
    serde_json::to_value(answer.stop_reason).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

#[tauri::command]
fn cancel_chat(state: State<'_, AppState>) {
    state.cancel.store(true, Ordering::SeqCst);
}

/// Forgets the conversation: the next question starts a new chat (over the same context; with
/// the bare model after a chat that could not continue).
#[tauri::command]
fn new_chat(state: State<'_, AppState>) -> Result<(), String> {
    let refused = state.refusal.lock().unwrap_or_else(|e| e.into_inner()).take().is_some();
    *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) = None;
    if refused {
        return close_context(state);
    }
    let chat = current_chat(&state)?;
    let mut guard = chat.lock().unwrap_or_else(|e| e.into_inner());
    guard.1 = guard.0.new_conversation();
    Ok(())
}

/// Chats over a context from now on (a new conversation).
#[tauri::command]
async fn open_context(state: State<'_, AppState>, id: i64) -> Result<ContextInfo, String> {
    let engine = state.engine()?;
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    if info.status != folio_library::Status::Ready {
        return Err(format!("{} is {}: only a ready context opens", info.name, info.status.as_str()));
    }
    let settings = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // A new chat over a context starts with its default method, when it has one (and it opens).
    let method = match settings::context_method(&state, id).await {
        Some(default) => default,
        None => state.method.lock().unwrap_or_else(|e| e.into_inner()).clone(),
    };
    let session = engine::open_session(&state, &settings, engine, &info.path, &method).await?;
    *state.method.lock().unwrap_or_else(|e| e.into_inner()) = method;
    *state.chat.lock().unwrap_or_else(|e| e.into_inner()) = Some(chat_of(session, None));
    *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
    chats::forget_chat(&state);
    Ok(info)
}

/// Back to chatting with the bare model.
#[tauri::command]
fn close_context(state: State<'_, AppState>) -> Result<(), String> {
    *state.chat.lock().unwrap_or_else(|e| e.into_inner()) = Some(chat_of(Session::bare(state.engine()?), None));
    *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) = None;
    chats::forget_chat(&state);
    Ok(())
}

#[tauri::command]
async fn library_list(state: State<'_, AppState>) -> Result<Vec<ContextInfo>, String> {
    state.library()?.contexts().await.map_err(|e| e.to_string())
}

#[tauri::command]
async fn context_documents(state: State<'_, AppState>, id: i64) -> Result<Vec<DocumentInfo>, String> {
    state.library()?.documents(id).await.map_err(|e| e.to_string())
}

/// Refuses to rename or remove a context while a prefill job of this run writes its file.
async fn not_being_written(state: &AppState, id: i64) -> Result<(), String> {
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    if state.jobs.busy(&info.path) {
        return Err(format!("{} is being prefilled or changed: wait for it, or cancel it first", info.name));
    }
    Ok(())
}

#[tauri::command]
async fn rename_context(state: State<'_, AppState>, id: i64, name: String) -> Result<ContextInfo, String> {
    not_being_written(&state, id).await?;
    state.library()?.rename_context(id, &name).await.map_err(|e| e.to_string())
}

#[tauri::command]
async fn remove_context(state: State<'_, AppState>, id: i64, delete_file: bool) -> Result<(), String> {
    not_being_written(&state, id).await?;
    if *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) == Some(id) {
        close_context(state.clone())?;
    }
    state.library()?.remove_context(id, delete_file).await.map(|_| ()).map_err(|e| e.to_string())
}

/// Opens the context's folder in the file manager.
#[tauri::command]
async fn reveal_context(state: State<'_, AppState>, id: i64) -> Result<(), String> {
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    let folder = info.path.parent().map(PathBuf::from).unwrap_or_default();
    std::process::Command::new("xdg-open")
        .arg(&folder)
        .spawn()
        .map(|_| ())
        .map_err(|e| format!("could not open {} in the file manager (xdg-open: {e})", folder.display()))
}

/// Sets a damaged library aside and makes a new one from the context files in its folder.
#[tauri::command]
async fn rebuild_library(state: State<'_, AppState>) -> Result<Vec<ContextInfo>, String> {
    let home = folio_library::home().map_err(|e| e.to_string())?;
    let (lib, _, _) = Library::rebuild_home(&home, &[]).await.map_err(|e| e.to_string())?;
    let list = lib.contexts().await.map_err(|e| e.to_string())?;
    *state.library.lock().unwrap_or_else(|e| e.into_inner()) = Some(lib);
    *state.library_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
    Ok(list)
}

#[derive(Clone, Serialize)]
struct CountProgress {
    phase: ingest::Phase,
    done: usize,
    total: usize,
}

/// Reads and counts dropped files and folders for the staging sheet.
#[tauri::command]
async fn stage(
    state: State<'_, AppState>,
    paths: Vec<PathBuf>,
    on_progress: Channel<CountProgress>,
) -> Result<staging::Staged, String> {
    let engine = state.engine()?;
    tauri::async_runtime::spawn_blocking(move || {
        ingest::stage(&engine, &paths, &|phase, done, total| {
            let _ = on_progress.send(CountProgress { phase, done, total });
        })
    })
    .await
    .map_err(|e| e.to_string())
}

/// What a prefill of the staged documents needs (tokens, file, memory, disk, time).
#[tauri::command]
async fn estimate(state: State<'_, AppState>, documents: Vec<StagedDocument>) -> Result<Estimate, String> {
    let engine = state.engine()?;
    let lib = state.library()?;
    let rate = lib
        .setting(&rate_key(&engine, &state.device_label()))
        .await
        .map_err(|e| e.to_string())?
        .and_then(|v| v.as_f64());
    let folder = lib.contexts_folder();
    let kv_dtype = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).kv_dtype()?;
    tauri::async_runtime::spawn_blocking(move || staging::estimate(&engine, &documents, kv_dtype, &folder, rate))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// Queues a prefill of the staged documents into a new context named `name`.
#[tauri::command]
fn start_prefill(state: State<'_, AppState>, documents: Vec<StagedDocument>, name: String) -> Result<u64, String> {
    let engine = state.engine()?;
    let lib = state.library()?;
    let name = folio_library::context_name(&name).map_err(|e| e.to_string())?;
    if documents.is_empty() {
        return Err("there are no documents to prefill: drop files or folders on the window".into());
    }
    let out = lib.free_context_path(name).map_err(|e| e.to_string())?;
    state.jobs.submit(out, JobKind::New { documents }, engine)
}

/// Queues the resume of a paused context, or of an interrupted change to a ready one.
#[tauri::command]
async fn resume_context(state: State<'_, AppState>, id: i64) -> Result<u64, String> {
    let engine = state.engine()?;
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    if info.status != folio_library::Status::Paused && !info.change_pending {
        return Err(format!("{} is {}: it has no interrupted prefill to resume", info.name, info.status.as_str()));
    }
    state.jobs.submit(info.path, JobKind::Resume, engine)
}

/// A change to a saved context, as the window asks for it.
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum ChangeRequest {
    /// Staged documents to add after its tokens.
    Add { documents: Vec<StagedDocument> },
    /// The path of a document to take out.
    Remove { document: String },
}

/// The ready context `id`, which a change may start on.
async fn changeable(state: &AppState, id: i64) -> Result<ContextInfo, String> {
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    if info.status != folio_library::Status::Ready {
        return Err(format!("{} is {}: only a ready context can be changed", info.name, info.status.as_str()));
    }
    if info.change_pending {
        return Err(format!("a change to {} was interrupted: resume it first", info.name));
    }
    Ok(info)
}

/// What a change to context `id` needs: the new file's tokens, the tokens it computes (only
/// those after what it keeps), file size, memory, disk and time.
#[tauri::command]
async fn estimate_change(state: State<'_, AppState>, id: i64, change: ChangeRequest) -> Result<Estimate, String> {
    let engine = state.engine()?;
    let info = changeable(&state, id).await?;
    let rate = state
        .library()?
        .setting(&rate_key(&engine, &state.device_label()))
        .await
        .map_err(|e| e.to_string())?
        .and_then(|v| v.as_f64());
    tauri::async_runtime::spawn_blocking(move || {
        let what = match change {
            ChangeRequest::Add { documents } => Change::Add(jobs::reread(&documents).0),
            ChangeRequest::Remove { document } => Change::Remove(document),
        };
        let planned = Builder::new(&engine, &info.path).plan(what, &ingest::Files)?;
        let folder = info.path.parent().map(PathBuf::from).unwrap_or_default();
        let kv_dtype = planned.kv_dtype(None, context::DEFAULT_KV_DTYPE);
        staging::estimate_planned(&engine, &planned, kv_dtype, &folder, rate)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())
}

/// Queues a change to context `id`; its file is replaced when the change is done.
#[tauri::command]
async fn start_change(state: State<'_, AppState>, id: i64, change: ChangeRequest) -> Result<u64, String> {
    let engine = state.engine()?;
    let info = changeable(&state, id).await?;
    let kind = match change {
        ChangeRequest::Add { documents } if documents.is_empty() => {
            return Err("there are no documents to add: drop files or folders on the window".into())
        }
        ChangeRequest::Add { documents } => JobKind::Add { documents },
        ChangeRequest::Remove { document } => JobKind::Remove { document },
    };
    state.jobs.submit(info.path, kind, engine)
}

/// Whether interrupted prefills resume by themselves when the window starts.
#[tauri::command]
async fn auto_resume(state: State<'_, AppState>) -> Result<bool, String> {
    let value = state.library()?.setting(AUTO_RESUME).await.map_err(|e| e.to_string())?;
    Ok(value.and_then(|v| v.as_bool()).unwrap_or(false))
}

#[tauri::command]
async fn set_auto_resume(state: State<'_, AppState>, on: bool) -> Result<(), String> {
    state.library()?.set_setting(AUTO_RESUME, &serde_json::json!(on)).await.map_err(|e| e.to_string())
}

/// At start, with the setting on: every paused context queued for its resume.
fn resume_paused(library: &Library, jobs: &Jobs, engine: &Arc<Engine>) {
    let paused = tauri::async_runtime::block_on(async {
        let on = library.setting(AUTO_RESUME).await.ok().flatten().and_then(|v| v.as_bool()).unwrap_or(false);
        if !on {
            return Vec::new();
        }
        library.contexts().await.unwrap_or_else(|e| {
            eprintln!("folio: interrupted prefills not resumed: {e}");
            Vec::new()
        })
    });
    for c in paused.into_iter().filter(|c| c.status == folio_library::Status::Paused) {
        if let Err(e) = jobs.submit(c.path, JobKind::Resume, engine.clone()) {
            eprintln!("folio: {e}");
        }
    }
}

#[tauri::command]
fn cancel_job(state: State<'_, AppState>, id: u64) -> bool {
    state.jobs.cancel(id)
}

/// What an import of context files did: each file listed, or why not (one bad file never
/// stops the others).
#[derive(Serialize)]
struct Imported {
    imported: Vec<ContextInfo>,
    failed: Vec<staging::Skip>,
}

/// Imports context files (dropped `.folio` files, or picked): each is verified against every
/// checksum, copied into the library's folder under a free name, and listed.
#[tauri::command]
async fn import_contexts(state: State<'_, AppState>, paths: Vec<PathBuf>) -> Result<Imported, String> {
    let lib = state.library()?;
    let mut report = Imported { imported: Vec::new(), failed: Vec::new() };
    for path in paths {
        match lib.import(&path, true).await {
            Ok(info) => report.imported.push(info),
            Err(e) => report.failed.push(staging::Skip { path: path.display().to_string(), reason: e.to_string() }),
        }
    }
    Ok(report)
}

/// The native picker for context files to import (see [`import_contexts`]); nothing picked
/// imports nothing.
#[tauri::command]
async fn pick_import(app: tauri::AppHandle, state: State<'_, AppState>) -> Result<Imported, String> {
    use tauri_plugin_dialog::DialogExt;
    let picked = tauri::async_runtime::spawn_blocking(move || {
        app.dialog()
            .file()
            .set_title("Import context files")
            .add_filter("Folio context", &[CONTEXT_EXTENSION])
            .blocking_pick_files()
    })
    .await
    .map_err(|e| e.to_string())?;
    let paths = picked.unwrap_or_default().into_iter().filter_map(|p| p.into_path().ok()).collect();
    import_contexts(state, paths).await
}

/// Exports context `id`: the native save dialog picks where, and the file is copied there
/// atomically (never over an existing file). `None` when the dialog was cancelled.
#[tauri::command]
async fn export_context(app: tauri::AppHandle, state: State<'_, AppState>, id: i64) -> Result<Option<PathBuf>, String> {
    use tauri_plugin_dialog::DialogExt;
    let lib = state.library()?;
    let info = lib.context(id).await.map_err(|e| e.to_string())?;
    let file_name = info.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let picked = tauri::async_runtime::spawn_blocking(move || {
        app.dialog()
            .file()
            .set_title("Export context")
            .set_file_name(file_name)
            .add_filter("Folio context", &[CONTEXT_EXTENSION])
            .blocking_save_file()
    })
    .await
    .map_err(|e| e.to_string())?;
    let Some(dest) = picked.and_then(|p| p.into_path().ok()) else { return Ok(None) };
    lib.export(id, &dest).await.map(Some).map_err(|e| e.to_string())
}

/// The test hook for [`export_context`] without its dialog: refused unless FOLIO_TEST_HOOKS=1.
#[tauri::command]
async fn simulate_export(state: State<'_, AppState>, id: i64, dest: PathBuf) -> Result<PathBuf, String> {
    test_hooks()?;
    state.library()?.export(id, &dest).await.map_err(|e| e.to_string())
}

/// Files dropped on the window, from the drag-drop event (or `simulate_drop`).
fn on_drop(feed: &Mutex<Option<Channel<UiEvent>>>, paths: Vec<PathBuf>) {
    send(feed, UiEvent::Dropped { paths });
}

/// The native file picker (files, or folders), opened from the Rust side so the webview needs
/// no dialog permission; what is picked goes the way of a drop.
#[tauri::command]
async fn pick_documents(app: tauri::AppHandle, state: State<'_, AppState>, folders: bool) -> Result<(), String> {
    use tauri_plugin_dialog::DialogExt;
    let feed = state.feed.clone();
    let picked = tauri::async_runtime::spawn_blocking(move || {
        let dialog = app.dialog().file().set_title(if folders { "Add folders" } else { "Add documents" });
        if folders {
            dialog.blocking_pick_folders()
        } else {
            dialog.blocking_pick_files()
        }
    })
    .await
    .map_err(|e| e.to_string())?;
    let paths: Vec<PathBuf> = picked.unwrap_or_default().into_iter().filter_map(|p| p.into_path().ok()).collect();
    if !paths.is_empty() {
        on_drop(&feed, paths);
    }
    Ok(())
}

/// The test hook (see the module docs): refused unless FOLIO_TEST_HOOKS=1.
#[tauri::command]
fn simulate_drop(state: State<'_, AppState>, paths: Vec<PathBuf>) -> Result<(), String> {
    test_hooks()?;
    on_drop(&state.feed, paths);
    Ok(())
}

/// Whether the test hooks are on (see the module docs).
fn test_hooks() -> Result<(), String> {
    match std::env::var(TEST_HOOKS_ENV).as_deref() {
        Ok("1") => Ok(()),
        _ => Err(format!("this is a test hook: start Folio with {TEST_HOOKS_ENV}=1 to use it")),
    }
}

/// Opens the window on `model` (`--model` or `FOLIO_MODEL`); without one, on the model last
/// loaded in the window, else on `fallback` (the bundled demo model). A model that fails to
/// load still opens the window, which says why and offers another.
pub fn run(model: Option<String>, fallback: Option<String>, device: &str, dtype: &str) -> anyhow::Result<()> {
    // A library that cannot be opened still opens the window, which says why and offers the
    // rebuild.
    let (library, library_error) =
        match tauri::async_runtime::block_on(async { Library::open(&folio_library::home()?).await }) {
            Ok(lib) => (Some(lib), None),
            Err(e) => (None, Some(e.to_string())),
        };
    let mut settings = match &library {
        Some(lib) => tauri::async_runtime::block_on(engine::stored(lib)),
        None => engine::EngineSettings::default(),
    };
    // `--device` other than auto is what the user asked for now; else the settings' device.
    if device != "auto" {
        settings.device = device.to_owned();
    }
    let (device, mut device_notice) = match parse_device(&settings.device) {
        Ok(d) => (d, None),
        Err(e) if device == "auto" => {
            let notice =
                format!("The device in Settings, {}, is not usable ({e}); Folio runs on auto", settings.device);
            settings.device = "auto".into();
            (parse_device("auto")?, Some(notice))
        }
        Err(e) => return Err(e.into()),
    };
    let dtype_spec = dtype.to_owned();
    let dtype = parse_dtype(dtype, &device)?;
    let last = library.as_ref().and_then(models::last_model);
    let (loaded, mut startup_notice) = models::load_at_start(model, last, fallback, &device, dtype);
    if let Some(engine) = &loaded.engine {
        models::prepare(engine);
    }
    if let Some(n) = device_notice.take() {
        startup_notice = Some(startup_notice.map_or(n.clone(), |s| format!("{n} · {s}")));
    }
    let feed: Arc<Mutex<Option<Channel<UiEvent>>>> = Arc::default();
    let shared_library: jobs::SharedLibrary = Arc::new(Mutex::new(library.clone()));
    let jobs = {
        let feed = feed.clone();
        let worker = Worker { library: shared_library.clone() };
        let queue_file = library.as_ref().and_then(|_| folio_library::home().ok()).map(|h| h.join(QUEUE_FILE));
        Jobs::start(worker, queue_file, move |jobs| send(&feed, UiEvent::Jobs { jobs }))
    };
    if let (Some(lib), Some(engine)) = (&library, &loaded.engine) {
        resume_paused(lib, &jobs, engine);
        let left = jobs.restore(engine);
        if !left.is_empty() {
            let told = startup_notice.take().into_iter().chain(left);
            startup_notice = Some(told.collect::<Vec<_>>().join(" · "));
        }
    }
    let bare = loaded.engine.clone().map(|e| chat_of(Session::bare(e), None));
    let state = AppState {
        model: RwLock::new(loaded),
        dtype_spec,
        engine_settings: Mutex::new(settings),
        bandwidths: Mutex::new(None),
        chat: Mutex::new(bare),
        open_context: Mutex::new(None),
        chat_id: Mutex::new(None),
        refusal: Mutex::new(None),
        method: Mutex::new(MethodChoice::default()),
        generation: Mutex::new(GenerationSettings { max_tokens: MAX_ANSWER_TOKENS, ..GenerationSettings::default() }),
        cancel: Arc::default(),
        library: shared_library,
        library_error: Mutex::new(library_error),
        jobs,
        feed,
        startup_notice,
    };
    tauri::Builder::default()
        .plugin(tauri_plugin_dialog::init())
        .manage(state)
        .on_window_event(|window, event| {
            if let tauri::WindowEvent::DragDrop(drag) = event {
                let state = window.state::<AppState>();
                match drag {
                    tauri::DragDropEvent::Enter { .. } | tauri::DragDropEvent::Over { .. } => {
                        send(&state.feed, UiEvent::Hover { over: true })
                    }
                    tauri::DragDropEvent::Leave => send(&state.feed, UiEvent::Hover { over: false }),
                    tauri::DragDropEvent::Drop { paths, .. } => {
                        send(&state.feed, UiEvent::Hover { over: false });
                        on_drop(&state.feed, paths.clone());
                    }
                    _ => {}
                }
            }
        })
        .invoke_handler(tauri::generate_handler![
            app_info,
            watch,
            chat,
            cancel_chat,
            new_chat,
            open_context,
            close_context,
            library_list,
            context_documents,
            rename_context,
            remove_context,
            reveal_context,
            rebuild_library,
            stage,
            estimate,
            start_prefill,
            resume_context,
            estimate_change,
            start_change,
            cancel_job,
            auto_resume,
            set_auto_resume,
            pick_documents,
            import_contexts,
            pick_import,
            export_context,
            simulate_export,
            simulate_drop,
            chats::list_chats,
            chats::open_chat,
            chats::rename_chat,
            chats::delete_chat,
            chats::fork_chat,
            chats::regenerate,
            chats::compare_dense,
            settings::methods,
            settings::method,
            settings::set_method,
            sources::source_excerpts,
            settings::open_context_method,
            settings::set_context_method,
            settings::build_index,
            settings::calibration,
            settings::calibrate,
            engine::engine_settings,
            engine::set_engine_settings,
            engine::memory_plan,
            settings::generation,
            settings::set_generation,
            models::models,
            models::load_model,
            models::pick_model_folder,
        ])
        .run(tauri::generate_context!())?;
    Ok(())
}
