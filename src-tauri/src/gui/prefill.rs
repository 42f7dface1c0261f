//! Making and changing contexts from the window: staging dropped or picked files (read, counted
//! and estimated off the UI thread, with progress), queueing the prefill or the change as a job
//! (the engine's `context::Builder` runs it, in `jobs.rs`), resuming paused ones — by hand or at
//! start — and cancelling.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use folio_library::{ContextInfo, Library};
use folio_models::context::staging::{self, Estimate, StagedDocument};
use folio_models::context::{self, Builder, Change, PrefillCost};
use folio_models::prefill::PrefillMode;
use folio_models::Engine;
use serde::{Deserialize, Serialize};
use tauri::ipc::Channel;
use tauri::State;

use super::jobs::{self, JobKind, Jobs};
use super::{send, test_hooks, AppState, UiEvent, AUTO_RESUME};
use crate::ingest;
use crate::listing::PrefillKeys;

#[derive(Clone, Serialize, ts_rs::TS)]
pub(super) struct CountProgress {
    phase: ingest::Phase,
    done: usize,
    total: usize,
}

/// Reads and counts dropped files and folders for the staging sheet.
#[tauri::command]
pub(super) async fn stage(
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

/// Each prefill the sheet offers for the loaded model (`first` first) with its last cost here.
async fn choices(
    state: &AppState,
    engine: &Engine,
    first: PrefillMode,
) -> Result<Vec<(PrefillMode, Option<PrefillCost>)>, String> {
    let keys = PrefillKeys::new(engine, &state.device_label());
    let modes = staging::prefill_modes(engine, first);
    keys.read_all(&state.library()?, modes).await.map_err(|e| e.to_string())
}

/// How the last tokens of the saved context at `path` were prefilled: what a change to it
/// offers first (a context made sparse for its speed is changed sparsely unless the person
/// picks dense). Dense when the file does not say (an earlier Folio's) or does not open (the
/// change's plan then says why).
fn last_prefill(path: &std::path::Path) -> PrefillMode {
    let last = context::ContextFile::open(path).ok().and_then(|f| f.header().prefill_runs().pop());
    last.and_then(|run| PrefillMode::parse(&run.mode).ok()).unwrap_or_default()
}

/// A prefill as the sheet names it (`dense`, `sparse:KNOBS`); `None` is dense.
fn mode(prefill: Option<&str>) -> Result<PrefillMode, String> {
    prefill.map(PrefillMode::parse).transpose().map(Option::unwrap_or_default).map_err(|e| e.to_string())
}

/// What a prefill of the staged documents needs (tokens, file, disk; memory, time and measured
/// cost in answers of each prefill the model can run).
#[tauri::command]
pub(super) async fn estimate(state: State<'_, AppState>, documents: Vec<StagedDocument>) -> Result<Estimate, String> {
    let engine = state.engine()?;
    let folder = state.library()?.contexts_folder();
    let choices = choices(&state, &engine, PrefillMode::Dense).await?;
    let kv_dtype = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).kv_dtype()?;
    tauri::async_runtime::spawn_blocking(move || staging::estimate(&engine, &documents, kv_dtype, &folder, &choices))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// Queues a prefill (`dense` when `None`, or `sparse:KNOBS`) of the staged documents into a
/// new context named `name`.
#[tauri::command]
pub(super) fn start_prefill(
    state: State<'_, AppState>,
    documents: Vec<StagedDocument>,
    name: String,
    prefill: Option<String>,
) -> Result<u64, String> {
    let engine = state.engine()?;
    let lib = state.library()?;
    let name = folio_library::context_name(&name).map_err(|e| e.to_string())?;
    if documents.is_empty() {
        return Err("there are no documents to prefill: drop files or folders on the window".into());
    }
    let prefill = mode(prefill.as_deref())?.name();
    let out = lib.free_context_path(name).map_err(|e| e.to_string())?;
    state.jobs.submit(out, JobKind::New { documents, prefill: Some(prefill) }, engine)
}

/// Queues the resume of a paused context, or of an interrupted change to a ready one.
#[tauri::command]
pub(super) async fn resume_context(state: State<'_, AppState>, id: i64) -> Result<u64, String> {
    let engine = state.engine()?;
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    if info.status != folio_library::Status::Paused && !info.change_pending {
        return Err(format!("{} is {}: it has no interrupted prefill to resume", info.name, info.status.as_str()));
    }
    state.jobs.submit(info.path, JobKind::Resume, engine)
}

/// A change to a saved context, as the window asks for it.
#[derive(Deserialize, ts_rs::TS)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(super) enum ChangeRequest {
    /// Staged documents to add after its tokens.
    Add { documents: Vec<StagedDocument> },
    /// The path of a document to take out.
    Remove { document: String },
}

/// The ready context `id`, which a change may start on.
pub(super) async fn changeable(state: &AppState, id: i64) -> Result<ContextInfo, String> {
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
/// those after what it keeps), file size, disk, and each prefill's memory and time — the one
/// its last tokens were made with first.
#[tauri::command]
pub(super) async fn estimate_change(
    state: State<'_, AppState>,
    id: i64,
    change: ChangeRequest,
) -> Result<Estimate, String> {
    let engine = state.engine()?;
    let info = changeable(&state, id).await?;
    let first = {
        let path = info.path.clone();
        tauri::async_runtime::spawn_blocking(move || last_prefill(&path)).await.map_err(|e| e.to_string())?
    };
    let choices = choices(&state, &engine, first).await?;
    tauri::async_runtime::spawn_blocking(move || {
        let what = match change {
            ChangeRequest::Add { documents } => Change::Add(jobs::reread(&documents).0),
            ChangeRequest::Remove { document } => Change::Remove(document),
        };
        let planned = Builder::new(&engine, &info.path).plan(what, &ingest::Files)?;
        let folder = info.path.parent().map(PathBuf::from).unwrap_or_default();
        let kv_dtype = planned.kv_dtype(None, context::DEFAULT_KV_DTYPE);
        staging::estimate_planned(&engine, &planned, kv_dtype, &folder, &choices)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())
}

/// Queues a change to context `id` (its tokens computed with `prefill`: `dense` when `None`,
/// or `sparse:KNOBS`); its file is replaced when the change is done.
#[tauri::command]
pub(super) async fn start_change(
    state: State<'_, AppState>,
    id: i64,
    change: ChangeRequest,
    prefill: Option<String>,
) -> Result<u64, String> {
    let engine = state.engine()?;
    let info = changeable(&state, id).await?;
    let prefill = Some(mode(prefill.as_deref())?.name());
    let kind = match change {
        ChangeRequest::Add { documents } if documents.is_empty() => {
            return Err("there are no documents to add: drop files or folders on the window".into())
        }
        ChangeRequest::Add { documents } => JobKind::Add { documents, prefill },
        ChangeRequest::Remove { document } => JobKind::Remove { document, prefill },
    };
    state.jobs.submit(info.path, kind, engine)
}

/// Whether interrupted prefills resume by themselves when the window starts.
#[tauri::command]
pub(super) async fn auto_resume(state: State<'_, AppState>) -> Result<bool, String> {
    let value = state.library()?.setting(AUTO_RESUME).await.map_err(|e| e.to_string())?;
    Ok(value.and_then(|v| v.as_bool()).unwrap_or(false))
}

#[tauri::command]
pub(super) async fn set_auto_resume(state: State<'_, AppState>, on: bool) -> Result<(), String> {
    state.library()?.set_setting(AUTO_RESUME, &serde_json::json!(on)).await.map_err(|e| e.to_string())
}

/// At start, with the setting on: every paused context queued for its resume.
pub(super) fn resume_paused(library: &Library, jobs: &Jobs, engine: &Arc<Engine>) {
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
pub(super) fn cancel_job(state: State<'_, AppState>, id: u64) -> bool {
    state.jobs.cancel(id)
}

/// Files dropped on the window, from the drag-drop event (or `simulate_drop`).
pub(super) fn on_drop(feed: &Mutex<Option<Channel<UiEvent>>>, paths: Vec<PathBuf>) {
    send(feed, UiEvent::Dropped { paths });
}

/// The native file picker (files, or folders), opened from the Rust side so the webview needs
/// no dialog permission; what is picked goes the way of a drop.
#[tauri::command]
pub(super) async fn pick_documents(
    app: tauri::AppHandle,
    state: State<'_, AppState>,
    folders: bool,
) -> Result<(), String> {
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
pub(super) fn simulate_drop(state: State<'_, AppState>, paths: Vec<PathBuf>) -> Result<(), String> {
    test_hooks()?;
    on_drop(&state.feed, paths);
    Ok(())
}
