//! The desktop window: a Tauri 2 shell around the Svelte UI in ui/.
//!
//! The UI talks to the engine only through the commands here and in the children — `ask`
//! (questions), `contexts` and `chats` (the library), `prefill` (staging and jobs), `settings`,
//! `engine`, `models`, `sources` — which call the engine's session API (`folio_models::session`) and the library (`folio_library`) as the CLI does. Streams go
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

mod ask;
mod bindings;
mod chats;
mod choices;
mod contexts;
mod desktop;
mod details;
mod download;
mod engine;
mod jobs;
mod models;
mod prefill;
mod server;
mod settings;
mod sources;

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use candle_core::{DType, Device};
use folio_library::{ContextInfo, Library};
use folio_models::attention::MethodChoice;
use folio_models::context;
use folio_models::context::format::SectionKind;
use folio_models::conversation::Conversation;
use folio_models::session::{GenerationSettings, Session};
use folio_models::{device_name, parse_device, parse_dtype, Engine};
use serde::Serialize;
use tauri::ipc::Channel;
use tauri::{Manager, State};

use jobs::{JobView, Jobs, Worker};

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
    /// The disk under a context file on the file tier, once measured (bytes/s).
    disk_rate: Mutex<Option<(std::path::PathBuf, f64)>>,
    /// `--host-budget` as given at start: the host budget while the settings name none.
    cli_host_budget: Option<u64>,
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
    /// Milliseconds each answer token waits before it is sent (the `simulate_slow_tokens` test
    /// hook: the demo model answers faster than a WebDriver round trip, so a Stop would race).
    token_delay_ms: AtomicU64,
    /// Shared with the prefill worker: a rebuild replaces it for both.
    library: jobs::SharedLibrary,
    library_error: Mutex<Option<String>>,
    jobs: Jobs,
    feed: Arc<Mutex<Option<Channel<UiEvent>>>>,
    /// What the window should tell at start (a last-used model that no longer loads).
    startup_notice: Option<String>,
    /// The local API the window runs (Settings → Local API).
    server: server::WindowServer,
    /// Set by Cancel: the model download stops (`download.rs`).
    download_stop: Arc<AtomicBool>,
    /// Context files the window was opened with (a .folio file opened on the desktop): sent
    /// to the page as a drop once it watches, which imports them.
    opened: Mutex<Vec<PathBuf>>,
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

    /// Back to chatting with the bare model.
    fn close_context(&self) -> Result<(), String> {
        *self.chat.lock().unwrap_or_else(|e| e.into_inner()) = Some(chat_of(Session::bare(self.engine()?), None));
        *self.method.lock().unwrap_or_else(|e| e.into_inner()) = MethodChoice::default();
        *self.open_context.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.forget_chat();
        Ok(())
    }

    /// Forgets the conversation: the next question starts a new chat (over the same context;
    /// with the bare model after a chat that could not continue).
    fn new_conversation(&self) -> Result<(), String> {
        let refused = self.refusal.lock().unwrap_or_else(|e| e.into_inner()).take().is_some();
        *self.chat_id.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if refused {
            return self.close_context();
        }
        let chat = current_chat(self)?;
        let mut guard = chat.lock().unwrap_or_else(|e| e.into_inner());
        guard.1 = guard.0.new_conversation();
        Ok(())
    }

    /// The conversation on screen is no saved chat (yet): a new chat, another context or model.
    fn forget_chat(&self) {
        *self.chat_id.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.refusal.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn engine(&self) -> Result<Arc<Engine>, String> {
        let loaded = self.model.read().unwrap_or_else(|e| e.into_inner());
        loaded.engine.clone().ok_or_else(|| {
            loaded.error.clone().unwrap_or_else(|| "No model loaded: pick one in Settings (Ctrl+,)".into())
        })
    }
}

/// What the window's feed carries.
#[derive(Clone, Serialize, ts_rs::TS)]
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

#[derive(Serialize, ts_rs::TS)]
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
#[derive(Serialize, ts_rs::TS)]
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
    /// A GGUF's (or `--quantize`'s) quantisation, bits per weight and bytes; `None` for weights
    /// in the model's dtype.
    quantization: Option<folio_models::gguf::Quantization>,
}

/// K/V bytes one token of context takes in `cfg`'s model, stored as the window stores it.
fn kv_bytes_per_token(cfg: &folio_models::config::ModelConfig) -> u64 {
    [SectionKind::Keys, SectionKind::Values]
        .iter()
        .map(|&kind| context::DEFAULT_KV_DTYPE.section_bytes(kind, cfg.num_kv_heads, cfg.head_dim))
        .sum::<u64>()
        * cfg.num_layers as u64
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
                kv_bytes_per_token: kv_bytes_per_token(cfg),
                fingerprint: e.stamp().ok().and_then(|st| serde_json::to_string(&st.fingerprint).ok()),
                quantization: e.quantization().cloned(),
            }
        }),
    }
}

/// Opens the window's feed; the jobs so far are sent at once.
#[tauri::command]
fn watch(state: State<'_, AppState>, on_event: Channel<UiEvent>) {
    let _ = on_event.send(UiEvent::Jobs { jobs: state.jobs.views() });
    let opened = std::mem::take(&mut *state.opened.lock().unwrap_or_else(|e| e.into_inner()));
    if !opened.is_empty() {
        let _ = on_event.send(UiEvent::Dropped { paths: opened });
    }
    *state.feed.lock().unwrap_or_else(|e| e.into_inner()) = Some(on_event);
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

/// Refuses to rename or remove a context while a prefill job of this run writes its file.
async fn not_being_written(state: &AppState, id: i64) -> Result<(), String> {
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    if state.jobs.busy(&info.path) {
        return Err(format!("{} is being prefilled or changed: wait for it, or cancel it first", info.name));
    }
    Ok(())
}

/// Whether the test hooks are on (see the module docs).
fn test_hooks() -> Result<(), String> {
    match std::env::var(TEST_HOOKS_ENV).as_deref() {
        Ok("1") => Ok(()),
        _ => Err(format!("this is a test hook: start Folio with {TEST_HOOKS_ENV}=1 to use it")),
    }
}

/// The window's state at start: the library (or why it cannot be opened), the engine settings,
/// the model to load, the prefill worker with the jobs an earlier run left, and the bare chat.
fn start(model: Option<String>, fallback: Option<String>, device: &str, dtype: &str) -> anyhow::Result<AppState> {
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
    // The settings' host budget, when there is one, holds; else `--host-budget`'s, else the default.
    let cli_host_budget = folio_runtime::host_budget::is_set().then(folio_runtime::host_budget::budget).flatten();
    engine::apply_host_budget(&settings, cli_host_budget);
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
        prefill::resume_paused(lib, &jobs, engine);
        let left = jobs.restore(engine);
        if !left.is_empty() {
            let told = startup_notice.take().into_iter().chain(left);
            startup_notice = Some(told.collect::<Vec<_>>().join(" · "));
        }
    }
    let bare = loaded.engine.clone().map(|e| chat_of(Session::bare(e), None));
    Ok(AppState {
        model: RwLock::new(loaded),
        dtype_spec,
        engine_settings: Mutex::new(settings),
        bandwidths: Mutex::new(None),
        disk_rate: Mutex::new(None),
        cli_host_budget,
        chat: Mutex::new(bare),
        open_context: Mutex::new(None),
        chat_id: Mutex::new(None),
        refusal: Mutex::new(None),
        method: Mutex::new(MethodChoice::default()),
        generation: Mutex::new(GenerationSettings { max_tokens: MAX_ANSWER_TOKENS, ..GenerationSettings::default() }),
        cancel: Arc::default(),
        token_delay_ms: AtomicU64::new(0),
        library: shared_library,
        library_error: Mutex::new(library_error),
        jobs,
        feed,
        startup_notice,
        server: server::WindowServer::default(),
        download_stop: Arc::default(),
        opened: Mutex::default(),
    })
}

/// Opens the window on `model` (`--model` or `FOLIO_MODEL`); without one, on the model last
/// loaded in the window, else on `fallback` (the bundled demo model). A model that fails to
/// load still opens the window, which says why and offers another.
pub fn run(
    model: Option<String>,
    fallback: Option<String>,
    device: &str,
    dtype: &str,
    files: Vec<PathBuf>,
) -> anyhow::Result<()> {
    let mut state = start(model, fallback, device, dtype)?;
    state.opened = Mutex::new(files);
    tauri::Builder::default()
        .plugin(tauri_plugin_dialog::init())
        .manage(state)
        .setup(|app| {
            // The local API, if it was on when the window last closed.
            let handle = app.handle().clone();
            tauri::async_runtime::spawn(async move { server::resume(&handle.state::<AppState>()).await });
            Ok(())
        })
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
                        prefill::on_drop(&state.feed, paths.clone());
                    }
                    _ => {}
                }
            }
        })
        .invoke_handler(tauri::generate_handler![
            app_info,
            watch,
            ask::chat,
            ask::cancel_chat,
            ask::new_chat,
            contexts::open_context,
            contexts::close_context,
            contexts::library_list,
            contexts::context_documents,
            contexts::rename_context,
            contexts::remove_context,
            contexts::reveal_context,
            contexts::rebuild_library,
            prefill::stage,
            prefill::estimate,
            prefill::start_prefill,
            prefill::resume_context,
            prefill::estimate_change,
            prefill::start_change,
            prefill::cancel_job,
            prefill::auto_resume,
            prefill::set_auto_resume,
            prefill::pick_documents,
            contexts::import_contexts,
            contexts::pick_import,
            contexts::export_context,
            contexts::simulate_export,
            prefill::simulate_drop,
            ask::simulate_slow_tokens,
            chats::list_chats,
            chats::open_chat,
            chats::last_chat,
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
            choices::method_choices,
            choices::measure_methods,
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
            models::pick_model_file,
            server::server_status,
            server::set_server,
            server::reveal_logs,
            download::model_lookup,
            download::download_model,
            download::cancel_download,
        ])
        .run(tauri::generate_context!())?;
    Ok(())
}
