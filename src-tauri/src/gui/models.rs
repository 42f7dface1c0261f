//! Picking the model the window runs: a folder (typed, or chosen in the native dialog), a
//! Hugging Face repo id, one of the models the HF cache holds whole, or one that made a
//! context in the library. Loading runs off the UI thread; the new model answers the next
//! question (a chat starts over on the bare model) and is remembered in the library, so the
//! next start opens on it. A prefill already queued keeps the model it was queued with.

use std::sync::Arc;

use candle_core::{DType, Device};
use folio_library::Library;
use folio_models::gguf::scan::{self, GgufListing};
use folio_models::loader::{self, CachedModel};
use folio_models::session::Session;
use folio_models::Engine;
use serde::Serialize;
use tauri::State;

use super::{app_info, chat_of, AppInfo, AppState, Loaded};

/// The library setting: the model last loaded in the window (what `--model` takes).
const LAST_MODEL: &str = "model.last";

/// A model that made contexts in the library.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct LibraryModel {
    name: String,
    /// What loads it: a folder or a repo id.
    source: String,
    architecture: String,
    fingerprint: String,
    /// Contexts it made.
    contexts: u64,
}

/// What the window offers to load.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct ModelChoices {
    /// Whole models in the Hugging Face cache (they load offline).
    cached: Vec<CachedModel>,
    /// The models of the library's contexts.
    library: Vec<LibraryModel>,
    /// GGUF files in LM Studio's and Jan's model folders, each with its facts or why Folio
    /// cannot run it.
    gguf: Vec<GgufListing>,
}

#[tauri::command]
pub(super) async fn models(state: State<'_, AppState>) -> Result<ModelChoices, String> {
    let library = match state.library() {
        Ok(lib) => lib.models().await.map_err(|e| e.to_string())?,
        Err(_) => Vec::new(),
    };
    let cached = tauri::async_runtime::spawn_blocking(loader::cached_models).await.map_err(|e| e.to_string())?;
    let gguf = tauri::async_runtime::spawn_blocking(|| match std::env::var_os("HOME") {
        Some(home) => scan::scan(&scan::app_folders(std::path::Path::new(&home))),
        None => Vec::new(),
    })
    .await
    .map_err(|e| e.to_string())?;
    Ok(ModelChoices {
        cached,
        gguf,
        library: library
            .into_iter()
            .map(|(m, contexts)| LibraryModel {
                name: m.name,
                source: m.source,
                architecture: m.architecture,
                fingerprint: m.fingerprint,
                contexts,
            })
            .collect(),
    })
}

/// Loads `spec` (a model folder or a Hugging Face repo id) and runs it from now on.
#[tauri::command]
pub(super) async fn load_model(state: State<'_, AppState>, spec: String) -> Result<AppInfo, String> {
    let spec = spec.trim().to_owned();
    if spec.is_empty() {
        return Err("name a model: a folder with config.json, tokenizer.json and safetensors weights, a GGUF \
                    file, or a Hugging Face repo id (owner/name)"
            .into());
    }
    let (device, dtype) = state.compute()?;
    let loading = spec.clone();
    let engine = tauri::async_runtime::spawn_blocking(move || Engine::load(&loading, &device, dtype))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let waiting = install(&state, Arc::new(engine), Some(&spec)).await;
    let mut info = app_info(state);
    info.startup_notice = (!waiting.is_empty()).then(|| waiting.join(" · "));
    Ok(info)
}

/// Runs `engine` from now on: the chat starts over on the bare model; prefills an earlier run
/// queued with it start (what still waits for another model is returned); `spec`, when given,
/// is remembered as the model the next start opens on.
pub(super) async fn install(state: &AppState, engine: Arc<Engine>, spec: Option<&str>) -> Vec<String> {
    prepare(&engine);
    *state.model.write().unwrap_or_else(|e| e.into_inner()) = Loaded { engine: Some(engine.clone()), error: None };
    *state.chat.lock().unwrap_or_else(|e| e.into_inner()) = Some(chat_of(Session::bare(engine.clone()), None));
    *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) = None;
    state.forget_chat();
    let waiting = state.jobs.restore(&engine);
    super::server::follow_model(state, engine.clone()).await;
    if let (Some(spec), Ok(lib)) = (spec, state.library()) {
        if let Err(e) = lib.set_setting(LAST_MODEL, &serde_json::json!(spec)).await {
            eprintln!("folio: {spec} is not remembered for the next start: {e}");
        }
    }
    waiting
}

/// What the window sets on every model it runs: calibrations are kept in Folio's home.
pub(super) fn prepare(engine: &Engine) {
    if let Ok(home) = folio_library::home() {
        engine.keep_calibrations_in(home.join(CALIBRATIONS));
    }
}

/// The home's folder of channel calibrations (one folder per model fingerprint).
const CALIBRATIONS: &str = "calibrations";

/// The native folder dialog, then [`load_model`] on the folder picked; `None` when cancelled.
#[tauri::command]
pub(super) async fn pick_model_folder(
    app: tauri::AppHandle,
    state: State<'_, AppState>,
) -> Result<Option<AppInfo>, String> {
    use tauri_plugin_dialog::DialogExt;
    pick_then_load(state, move || app.dialog().file().set_title("Choose a model folder").blocking_pick_folder()).await
}

/// The native file dialog for a GGUF file, then [`load_model`] on it; `None` when cancelled.
#[tauri::command]
pub(super) async fn pick_model_file(
    app: tauri::AppHandle,
    state: State<'_, AppState>,
) -> Result<Option<AppInfo>, String> {
    use tauri_plugin_dialog::DialogExt;
    pick_then_load(state, move || {
        app.dialog()
            .file()
            .set_title("Choose a GGUF model file")
            .add_filter("GGUF model", &[folio_models::gguf::EXTENSION])
            .blocking_pick_file()
    })
    .await
}

/// Runs a blocking native dialog off the UI thread, then [`load_model`] on what was picked.
async fn pick_then_load(
    state: State<'_, AppState>,
    dialog: impl FnOnce() -> Option<tauri_plugin_dialog::FilePath> + Send + 'static,
) -> Result<Option<AppInfo>, String> {
    let picked = tauri::async_runtime::spawn_blocking(dialog).await.map_err(|e| e.to_string())?;
    match picked.and_then(|p| p.into_path().ok()) {
        Some(path) => load_model(state, path.display().to_string()).await.map(Some),
        None => Ok(None),
    }
}

/// The model last loaded in the window, if the library remembers one.
pub(super) fn last_model(library: &Library) -> Option<String> {
    let value = tauri::async_runtime::block_on(library.setting(LAST_MODEL)).ok().flatten()?;
    value.as_str().map(str::to_owned)
}

/// The model the window starts on: `asked` (its error shown if it fails: the user named it),
/// else `last` (falling back, with a notice, when it no longer loads), else `fallback`.
pub(super) fn load_at_start(
    asked: Option<String>,
    last: Option<String>,
    fallback: Option<String>,
    device: &Device,
    dtype: DType,
) -> (Loaded, Option<String>) {
    let loaded = |engine: folio_models::error::Result<Engine>| match engine {
        Ok(e) => Loaded { engine: Some(Arc::new(e)), error: None },
        Err(e) => Loaded { engine: None, error: Some(e.to_string()) },
    };
    if let Some(spec) = asked {
        return (loaded(Engine::load(&spec, device, dtype)), None);
    }
    // The models Folio opens on by itself come from the cache or a folder: a start never
    // downloads (Change model does, with its progress).
    let load = |spec: &str| loaded(Engine::load_cached(spec, device, dtype, None));
    let mut notice = None;
    if let Some(spec) = last {
        let loaded = load(&spec);
        if loaded.engine.is_some() {
            return (loaded, None);
        }
        notice = Some(format!(
            "The model Folio ran last, {spec}, did not load ({}); pick another in Settings",
            loaded.error.unwrap_or_default()
        ));
    }
    match fallback {
        Some(spec) => (load(&spec), notice),
        None => (Loaded { engine: None, error: Some("No model loaded: pick one in Settings (Ctrl+,)".into()) }, notice),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEMO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");

    /// A model asked for is loaded or its error shown (never another in its place); the last
    /// one that no longer loads falls back to the demo model with a notice naming it.
    #[test]
    fn the_start_model_is_the_asked_then_the_last_then_the_fallback() {
        let (cpu, f32) = (Device::Cpu, DType::F32);
        let (loaded, notice) = load_at_start(None, Some(DEMO.into()), None, &cpu, f32);
        assert!(loaded.engine.is_some() && notice.is_none());
        let (loaded, notice) = load_at_start(None, Some("/gone/model".into()), Some(DEMO.into()), &cpu, f32);
        assert_eq!(loaded.engine.map(|e| e.name.clone()).as_deref(), Some("demo"));
        let notice = notice.unwrap();
        assert!(notice.contains("/gone/model") && notice.contains("pick another in Settings"), "{notice}");
        let (loaded, notice) =
            load_at_start(Some("/gone/model".into()), Some(DEMO.into()), Some(DEMO.into()), &cpu, f32);
        assert!(loaded.engine.is_none() && notice.is_none());
        assert!(loaded.error.unwrap().contains("/gone/model"));
    }
}
