//! A model from the Hugging Face hub, in the window (Settings → Change model): a repo id typed
//! that the cache does not hold is looked up first — the model's facts from its config (a few
//! KiB) and what the download takes beside the free space — then downloaded with progress
//! (bytes, rate, time left) that Cancel stops, keeping what arrived for the next Download; the
//! load that follows reads the cache. The engine's downloader (`folio_models::download`) does
//! the work; this module words it for the window.

use std::sync::atomic::Ordering;

use folio_models::config::ModelConfig;
use folio_models::download::DownloadProgress;
use folio_models::loader::{self, ModelSource, DEFAULT_REVISION};
use serde::Serialize;
use tauri::ipc::Channel;
use tauri::State;

use super::{kv_bytes_per_token, until_stopped, AppState};

/// Context lengths whose K/V the lookup states: a long document set, and a million tokens.
const SHOWN_CONTEXTS: [u64; 2] = [131_072, 1_048_576];

/// What a typed model is before it loads.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct Lookup {
    /// It loads with no download: a folder, or a repo the cache holds whole.
    ready: bool,
    /// A repo to download: its facts and what the download takes.
    download: Option<DownloadView>,
}

#[derive(Serialize, ts_rs::TS)]
pub(super) struct DownloadView {
    repo: String,
    architecture: String,
    parameters: usize,
    layers: usize,
    max_context: usize,
    kv_bytes_per_token: u64,
    /// K/V bytes of a 128k-token and a 1M-token context (the window's default K/V dtype).
    kv_bytes_at: Vec<(u64, u64)>,
    files: usize,
    total_bytes: u64,
    /// Bytes still to fetch (what an earlier, stopped download kept is left out).
    to_fetch: u64,
    free_bytes: Option<u64>,
    /// Where the files go (the Hugging Face cache).
    cache: String,
    /// Why it cannot start (not enough free space), if so.
    refusal: Option<String>,
}

/// Looks up `spec`: a folder or a cached repo is ready; another repo id is asked of the hub.
#[tauri::command]
pub(super) async fn model_lookup(spec: String) -> Result<Lookup, String> {
    let spec = spec.trim().to_owned();
    tauri::async_runtime::spawn_blocking(move || {
        let (repo, revision) = match ModelSource::parse(&spec).map_err(|e| e.to_string())? {
            ModelSource::Dir(_) | ModelSource::Gguf(_) => return Ok(Lookup { ready: true, download: None }),
            ModelSource::Hub { repo, revision } => (repo, revision),
        };
        if loader::cached_whole(&repo, revision.as_deref()) {
            return Ok(Lookup { ready: true, download: None });
        }
        let plan =
            loader::download_plan(&repo, revision.as_deref().unwrap_or(DEFAULT_REVISION)).map_err(|e| e.to_string())?;
        let cfg = ModelConfig::from_file(&plan.config).map_err(|e| e.to_string())?;
        let per_token = kv_bytes_per_token(&cfg);
        Ok(Lookup {
            ready: false,
            download: Some(DownloadView {
                repo,
                architecture: cfg.arch.name().to_owned(),
                parameters: folio_models::plan::parameters(&cfg).0,
                layers: cfg.num_layers,
                max_context: cfg.max_position_embeddings,
                kv_bytes_per_token: per_token,
                kv_bytes_at: SHOWN_CONTEXTS.iter().map(|&n| (n, n * per_token)).collect(),
                files: plan.files.len(),
                total_bytes: plan.files.iter().map(|f| f.bytes).sum(),
                to_fetch: plan.to_fetch,
                free_bytes: plan.free,
                cache: plan.cache.display().to_string(),
                refusal: plan.check_space().err().map(|e| e.to_string()),
            }),
        })
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Downloads `spec` into the Hugging Face cache, its progress on `on_progress`; Cancel stops it
/// (an error that says what is kept).
#[tauri::command]
pub(super) async fn download_model(
    state: State<'_, AppState>,
    spec: String,
    on_progress: Channel<DownloadProgress>,
) -> Result<(), String> {
    let stop = state.download_stop.clone();
    stop.store(false, Ordering::SeqCst);
    tauri::async_runtime::spawn_blocking(move || {
        let ModelSource::Hub { repo, revision } = ModelSource::parse(spec.trim()).map_err(|e| e.to_string())? else {
            return Err(format!("{spec} is a folder: nothing to download"));
        };
        let plan =
            loader::download_plan(&repo, revision.as_deref().unwrap_or(DEFAULT_REVISION)).map_err(|e| e.to_string())?;
        plan.download(&mut |p| {
            let _ = on_progress.send(p.clone());
            until_stopped(&stop)
        })
        .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Stops the running download (what arrived is kept).
#[tauri::command]
pub(super) fn cancel_download(state: State<'_, AppState>) {
    state.download_stop.store(true, Ordering::SeqCst);
}
