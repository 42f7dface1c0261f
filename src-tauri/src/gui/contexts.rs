//! The library's contexts as the window handles them: opening one to chat over it (or going
//! back to the bare model), listing, renaming, removing, revealing, rebuilding a damaged
//! library, and importing or exporting context files. A context a prefill job writes is never
//! renamed or removed meanwhile.

use std::path::PathBuf;

use folio_library::{ContextInfo, DocumentInfo, Library};
use folio_models::context::staging;
use serde::Serialize;
use tauri::State;

use super::{chat_of, engine, not_being_written, settings, test_hooks, AppState, CONTEXT_EXTENSION};

/// Chats over a context from now on (a new conversation).
#[tauri::command]
pub(super) async fn open_context(state: State<'_, AppState>, id: i64) -> Result<ContextInfo, String> {
    let engine = state.engine()?;
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    if info.status != folio_library::Status::Ready {
        return Err(format!("{} is {}: only a ready context opens", info.name, info.status.as_str()));
    }
    let settings = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // A new chat over a context starts with its default method, or dense: never with the method
    // another chat last applied.
    let method = settings::context_method(&state, id).await.unwrap_or_default();
    let session = engine::open_session(&state, &settings, engine, &info.path, &method).await?;
    *state.method.lock().unwrap_or_else(|e| e.into_inner()) = method;
    *state.chat.lock().unwrap_or_else(|e| e.into_inner()) = Some(chat_of(session, None));
    *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
    state.forget_chat();
    Ok(info)
}

/// Back to chatting with the bare model.
#[tauri::command]
pub(super) fn close_context(state: State<'_, AppState>) -> Result<(), String> {
    state.close_context()
}

#[tauri::command]
pub(super) async fn library_list(state: State<'_, AppState>) -> Result<Vec<ContextInfo>, String> {
    state.library()?.contexts().await.map_err(|e| e.to_string())
}

#[tauri::command]
pub(super) async fn context_documents(state: State<'_, AppState>, id: i64) -> Result<Vec<DocumentInfo>, String> {
    state.library()?.documents(id).await.map_err(|e| e.to_string())
}

#[tauri::command]
pub(super) async fn rename_context(state: State<'_, AppState>, id: i64, name: String) -> Result<ContextInfo, String> {
    not_being_written(&state, id).await?;
    state.library()?.rename_context(id, &name).await.map_err(|e| e.to_string())
}

#[tauri::command]
pub(super) async fn remove_context(state: State<'_, AppState>, id: i64, delete_file: bool) -> Result<(), String> {
    not_being_written(&state, id).await?;
    if *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) == Some(id) {
        state.close_context()?;
    }
    state.library()?.remove_context(id, delete_file).await.map(|_| ()).map_err(|e| e.to_string())
}

/// Opens the context's folder in the file manager.
#[tauri::command]
pub(super) async fn reveal_context(state: State<'_, AppState>, id: i64) -> Result<(), String> {
    let info = state.library()?.context(id).await.map_err(|e| e.to_string())?;
    let folder = info.path.parent().map(PathBuf::from).unwrap_or_default();
    super::desktop::open_folder(&folder)
}

/// Sets a damaged library aside and makes a new one from the context files in its folder.
#[tauri::command]
pub(super) async fn rebuild_library(state: State<'_, AppState>) -> Result<Vec<ContextInfo>, String> {
    let home = folio_library::home().map_err(|e| e.to_string())?;
    let (lib, _, _) = Library::rebuild_home(&home, &[]).await.map_err(|e| e.to_string())?;
    let list = lib.contexts().await.map_err(|e| e.to_string())?;
    *state.library.lock().unwrap_or_else(|e| e.into_inner()) = Some(lib);
    *state.library_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
    Ok(list)
}

/// What an import of context files did: each file listed, or why not (one bad file never
/// stops the others).
#[derive(Serialize, ts_rs::TS)]
pub(super) struct Imported {
    imported: Vec<ContextInfo>,
    failed: Vec<staging::Skip>,
}

/// Imports context files (dropped `.folio` files, or picked): each is verified against every
/// checksum, copied into the library's folder under a free name, and listed.
#[tauri::command]
pub(super) async fn import_contexts(state: State<'_, AppState>, paths: Vec<PathBuf>) -> Result<Imported, String> {
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
pub(super) async fn pick_import(app: tauri::AppHandle, state: State<'_, AppState>) -> Result<Imported, String> {
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
pub(super) async fn export_context(
    app: tauri::AppHandle,
    state: State<'_, AppState>,
    id: i64,
) -> Result<Option<PathBuf>, String> {
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
pub(super) async fn simulate_export(state: State<'_, AppState>, id: i64, dest: PathBuf) -> Result<PathBuf, String> {
    test_hooks()?;
    state.library()?.export(id, &dest).await.map_err(|e| e.to_string())
}
