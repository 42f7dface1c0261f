//! The local API from the window (Settings → Local API): the server `folio serve` runs
//! (folio-server), over the model the window runs and its library, started and stopped with a
//! switch, remembered for the next start, and restarted on the new model when the window's
//! model changes (a server answering with a model the window no longer shows would surprise).
//! Beside it, the log's folder, which Settings shows and opens (crate::logging).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use folio_models::attention::Tier;
use folio_models::Engine;
use folio_server::{ServerConfig, DEFAULT_PORT, DEFAULT_QUEUE};
use serde::{Deserialize, Serialize};
use tauri::State;
use tokio::sync::oneshot;

use super::AppState;

/// The library setting that remembers the switch: `{"on": bool, "port": u16}`.
const SERVER_SETTING: &str = "server";

/// The server the window runs, if any, and why the last start failed.
#[derive(Default)]
pub(super) struct WindowServer {
    running: Mutex<Option<Running>>,
    error: Mutex<Option<String>>,
}

struct Running {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    /// The server's task: done once its listener is closed and its answers ended.
    task: tauri::async_runtime::JoinHandle<()>,
}

#[derive(Serialize, Deserialize, Clone, Copy)]
struct Remembered {
    on: bool,
    port: u16,
}

/// What Settings shows of the server and the log.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct ServerStatus {
    /// The API's base URL while it runs (`http://127.0.0.1:PORT/v1`).
    url: Option<String>,
    /// The port it runs on, or will.
    port: u16,
    /// Why it is not running although it was asked to (a port in use, no model).
    error: Option<String>,
    /// The folder of the log files.
    log_folder: Option<String>,
}

async fn remembered(state: &AppState) -> Remembered {
    let saved = match state.library() {
        Ok(lib) => lib.setting(SERVER_SETTING).await.ok().flatten(),
        Err(_) => None,
    };
    saved.and_then(|v| serde_json::from_value(v).ok()).unwrap_or(Remembered { on: false, port: DEFAULT_PORT })
}

async fn remember(state: &AppState, r: Remembered) -> Result<(), String> {
    let value = serde_json::to_value(r).map_err(|e| e.to_string())?;
    state.library()?.set_setting(SERVER_SETTING, &value).await.map_err(|e| e.to_string())
}

async fn status(state: &AppState) -> ServerStatus {
    let addr = state.server.running.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|r| r.addr);
    ServerStatus {
        url: addr.map(|a| format!("http://{a}/v1")),
        port: match addr {
            Some(a) => a.port(),
            None => remembered(state).await.port,
        },
        error: state.server.error.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        log_folder: crate::logging::folder().map(|f| f.display().to_string()),
    }
}

/// Stops the running server, if any, and waits for it: its answers end at their next token
/// and its port is free once this returns (a restart on the same port binds at once).
async fn stop(state: &AppState) {
    let running = state.server.running.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(r) = running {
        let _ = r.stop.send(());
        let _ = r.task.await;
    }
}

/// Starts the server on 127.0.0.1:`port` over `engine`; the error says why it could not.
async fn start(state: &AppState, engine: Arc<Engine>, port: u16) -> Result<(), String> {
    stop(state).await;
    let offload = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).offload;
    let config = ServerConfig {
        addr: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port),
        api_key: None,
        cors_origins: Vec::new(),
        queue: DEFAULT_QUEUE,
        tier: if offload { Tier::Offloaded } else { Tier::Resident },
        token_delay: Duration::ZERO,
    };
    let library = state.library().ok();
    let (ready, listening) = oneshot::channel::<Result<SocketAddr, String>>();
    let ready = Arc::new(Mutex::new(Some(ready)));
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let told = ready.clone();
    let on_listening = move |addr| {
        if let Some(tx) = told.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Ok(addr));
        }
    };
    let task = tauri::async_runtime::spawn(async move {
        let shutdown = async {
            let _ = stop_rx.await;
        };
        let served = folio_server::serve(config, engine, library, on_listening, shutdown).await;
        let taken = ready.lock().unwrap_or_else(|e| e.into_inner()).take();
        match (served, taken) {
            (Err(e), Some(tx)) => {
                let _ = tx.send(Err(format!("the local API could not listen on 127.0.0.1:{port}: {e}")));
            }
            (Err(e), None) => tracing::warn!(%e, "the window's local API stopped"),
            (Ok(()), _) => {}
        }
    });
    let addr = listening.await.map_err(|_| "the local API stopped before it listened".to_string())??;
    *state.server.running.lock().unwrap_or_else(|e| e.into_inner()) = Some(Running { addr, stop: stop_tx, task });
    tracing::info!(%addr, model = %engine_name(state), "the window's local API listens");
    Ok(())
}

fn engine_name(state: &AppState) -> String {
    state.engine().map(|e| e.name.clone()).unwrap_or_default()
}

#[tauri::command]
pub(super) async fn server_status(state: State<'_, AppState>) -> Result<ServerStatus, String> {
    Ok(status(&state).await)
}

/// Turns the local API on (on `port`) or off, and remembers it for the next start.
#[tauri::command]
pub(super) async fn set_server(state: State<'_, AppState>, on: bool, port: u16) -> Result<ServerStatus, String> {
    *state.server.error.lock().unwrap_or_else(|e| e.into_inner()) = None;
    if on {
        let engine = state.engine()?;
        if let Err(e) = start(&state, engine, port).await {
            *state.server.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    } else {
        stop(&state).await;
    }
    remember(&state, Remembered { on, port }).await?;
    Ok(status(&state).await)
}

/// At the window's start: the local API again, if it was on.
pub(super) async fn resume(state: &AppState) {
    let r = remembered(state).await;
    if let (true, Ok(engine)) = (r.on, state.engine()) {
        if let Err(e) = start(state, engine, r.port).await {
            *state.server.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    }
}

/// The window runs another model: a running server is started again over it.
pub(super) async fn follow_model(state: &AppState, engine: Arc<Engine>) {
    let port = state.server.running.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|r| r.addr.port());
    if let Some(port) = port {
        stop(state).await;
        if let Err(e) = start(state, engine, port).await {
            *state.server.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    }
}

/// Opens the log's folder in the file manager.
#[tauri::command]
pub(super) fn reveal_logs() -> Result<(), String> {
    let folder = crate::logging::folder().ok_or("Folio's home folder is unknown")?;
    std::fs::create_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
    super::desktop::open_folder(&folder)
}
