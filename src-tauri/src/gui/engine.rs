//! The window's engine settings — the device the model runs on, the device (VRAM) and host
//! memory budgets, the K/V dtype new contexts are stored in, and whether contexts open on the
//! offloaded tier — and the memory planner's view of the open context (`memory_plan`).
//!
//! Settings are stored in the library and applied at once: a device change loads the model
//! again on that device (the chat starts over, as after a model change); a tier or budget
//! change reopens the open context on the new tier, keeping its conversation (no prefill). A
//! change the planner says cannot hold the open context's step with the chat's method is
//! refused with what would fit, and the old settings stay. New prefills read the K/V dtype and
//! the device budget (as their memory budget) when they start.

use std::path::Path;
use std::sync::Arc;

use folio_library::Library;
use folio_models::attention::{MethodChoice, Tier};
use folio_models::context::{ContextFile, KvDtype};
use folio_models::plan::{self, Bandwidths, Budgets, ModelFacts, Plan};
use folio_models::session::{Session, RESIDENT_BUDGET};
use folio_models::{device_name, parse_device, Engine};
use folio_runtime::host_budget;
use serde::{Deserialize, Serialize};
use tauri::State;

use super::{AppInfo, AppState};
use crate::context_cmd::parse_bytes;

/// The library setting holding [`EngineSettings`].
const ENGINE_KEY: &str = "engine";
/// Buffer the planner's bandwidths are measured with (once per device and run).
const BANDWIDTH_BYTES: usize = 64 << 20;
/// Bytes in the GiB a GPU's memory is shown in.
const GIB: f64 = (1u64 << 30) as f64;

/// What the window runs with; see the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
#[serde(default)]
pub(crate) struct EngineSettings {
    /// auto, cpu, cuda or cuda:N (what `--device` takes).
    pub device: String,
    /// Device memory the window's work may use: decoded layers kept, prefill chunks. `None`:
    /// no cap beyond the device's.
    pub device_budget: Option<String>,
    /// Host memory the whole process may take (the K/V tier, method state, pinned buffers,
    /// the app); `None`: the default, what the machine has less a margin.
    pub host_budget: Option<String>,
    /// How new contexts store K/V (`folio prefill --kv-dtype`).
    pub kv_dtype: String,
    /// Open contexts on the offloaded tier (rows in host memory, picks moved to the device).
    pub offload: bool,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            device: "auto".into(),
            device_budget: None,
            host_budget: None,
            kv_dtype: folio_models::context::DEFAULT_KV_DTYPE.name().into(),
            offload: false,
        }
    }
}

impl EngineSettings {
    /// The budgets, read as the CLI reads sizes (4GiB, 512MiB).
    pub(crate) fn budgets(&self) -> Result<Budgets, String> {
        let read = |what: &str, s: &Option<String>| {
            s.as_deref().map(|s| parse_bytes(s).map_err(|e| format!("{what}: {e:#}"))).transpose()
        };
        Ok(Budgets {
            device: read("device memory budget", &self.device_budget)?,
            host: read("host memory budget", &self.host_budget)?,
        })
    }

    pub(crate) fn kv_dtype(&self) -> Result<KvDtype, String> {
        KvDtype::parse(&self.kv_dtype).map_err(|e| e.to_string())
    }

    pub(crate) fn tier(&self) -> Tier {
        match self.offload {
            true => Tier::Offloaded,
            false => Tier::Resident,
        }
    }

    /// Trimmed, empty budgets as none, and every value checked.
    fn normalized(mut self) -> Result<Self, String> {
        self.device = self.device.trim().to_owned();
        let clean = |s: Option<String>| s.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
        self.device_budget = clean(self.device_budget);
        self.host_budget = clean(self.host_budget);
        self.budgets()?;
        self.kv_dtype()?;
        Ok(self)
    }
}

/// Makes `settings`' host budget the process's; where they name none, `--host-budget`'s
/// (`cli`), else the default.
pub(super) fn apply_host_budget(settings: &EngineSettings, cli: Option<u64>) {
    let set = settings.budgets().ok().and_then(|b| b.host);
    host_budget::set_budget(set.or(cli));
}

/// The settings stored in `library` (the defaults when none or unreadable).
pub(crate) async fn stored(library: &Library) -> EngineSettings {
    let value = library.setting(ENGINE_KEY).await.ok().flatten();
    value.and_then(|v| serde_json::from_value(v).ok()).unwrap_or_default()
}

/// A device the window can run on.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct DeviceChoice {
    spec: String,
    label: String,
    /// Why it cannot be used here, when it cannot.
    unavailable: Option<String>,
}

fn devices() -> Vec<DeviceChoice> {
    let auto = parse_device("auto").map(|d| device_name(&d)).unwrap_or_else(|_| "cpu".into());
    let mut list = vec![
        DeviceChoice { spec: "auto".into(), label: format!("Automatic ({auto})"), unavailable: None },
        DeviceChoice { spec: "cpu".into(), label: "CPU".into(), unavailable: None },
    ];
    match folio_runtime::gpu::cuda_devices() {
        Ok(gpus) => list.extend(gpus.iter().map(|g| DeviceChoice {
            spec: format!("cuda:{}", g.ordinal),
            label: format!("{} ({:.0} GiB)", g.name, g.memory_bytes as f64 / GIB),
            unavailable: None,
        })),
        Err(why) => {
            list.push(DeviceChoice { spec: "cuda".into(), label: "NVIDIA GPU".into(), unavailable: Some(why.clone()) })
        }
    }
    list
}

/// The settings, the device the model runs on now, and the choices.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct EngineView {
    settings: EngineSettings,
    running_on: Option<String>,
    devices: Vec<DeviceChoice>,
    kv_dtypes: &'static [&'static str],
    /// The host budget without a setting: `--host-budget`'s, else what the machine has less a
    /// margin.
    default_host_budget: Option<u64>,
}

fn view(state: &AppState) -> EngineView {
    EngineView {
        settings: state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        running_on: state.engine().ok().map(|e| device_name(e.model.device())),
        devices: devices(),
        kv_dtypes: &KvDtype::NAMES,
        default_host_budget: state.cli_host_budget.or_else(host_budget::default_budget),
    }
}

#[tauri::command]
pub(super) fn engine_settings(state: State<'_, AppState>) -> EngineView {
    view(&state)
}

/// What applying settings did, for the window to follow.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct Applied {
    engine: EngineView,
    /// The model was loaded again on another device (the chat started over).
    info: Option<AppInfo>,
}

/// Checks and applies `settings` (see the module docs); refused, nothing changes.
#[tauri::command]
pub(super) async fn set_engine_settings(
    state: State<'_, AppState>,
    settings: EngineSettings,
) -> Result<Applied, String> {
    let settings = settings.normalized()?;
    let old = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // The new host budget holds what opens from here on; refused, the old one is back.
    let cli = state.cli_host_budget;
    apply_host_budget(&settings, cli);
    let applied = apply(state, settings).await;
    if applied.is_err() {
        apply_host_budget(&old, cli);
    }
    applied
}

/// [`set_engine_settings`] with the new host budget in force.
async fn apply(state: State<'_, AppState>, settings: EngineSettings) -> Result<Applied, String> {
    let old = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut info = None;
    let open = *state.open_context.lock().unwrap_or_else(|e| e.into_inner());
    if settings.device != old.device {
        let busy = super::current_chat(&state).ok().is_some_and(|c| c.try_lock().is_err());
        if busy {
            return Err("wait for the answer to finish, then change the device".into());
        }
        let engine = state.engine()?;
        let (spec, source) = (settings.device.clone(), engine.source.clone());
        let dtype_spec = state.dtype_spec.clone();
        let loaded = tauri::async_runtime::spawn_blocking(move || {
            let device = parse_device(&spec)?;
            let dtype = folio_models::parse_dtype(&dtype_spec, &device)?;
            Engine::load(&source, &device, dtype)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("device {}: {e}", settings.device))?;
        store(&state, &settings).await?;
        super::models::install(&state, Arc::new(loaded), None).await;
        info = Some(super::app_info(state.clone()));
    } else if let Some(id) = open {
        // The open context reopened on the new tier and budget, its conversation kept.
        let engine = state.engine()?;
        let path = state.library()?.context(id).await.map_err(|e| e.to_string())?.path;
        let method = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let chat = super::current_chat(&state)?;
        let session = open_session(&state, &settings, engine, &path, &method).await?;
        let turns =
            chat.try_lock().map_err(|_| "wait for the answer to finish, then apply".to_owned())?.1.messages.clone();
        let mut current = state.chat.lock().unwrap_or_else(|e| e.into_inner());
        if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &chat)) {
            return Err("the chat changed while the settings were applied: apply them again".into());
        }
        *current = Some(super::chat_of(session, Some(turns)));
    }
    store(&state, &settings).await?;
    *state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()) = settings;
    Ok(Applied { engine: view(&state), info })
}

/// Stores `settings` in the library (when it is open).
async fn store(state: &AppState, settings: &EngineSettings) -> Result<(), String> {
    if let Ok(lib) = state.library() {
        let value = serde_json::to_value(settings).map_err(|e| e.to_string())?;
        lib.set_setting(ENGINE_KEY, &value).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// This machine's bandwidths for `engine`'s device (measured once per device and run).
async fn bandwidths(state: &AppState, engine: &Engine) -> Result<Bandwidths, String> {
    let label = device_name(engine.model.device());
    if let Some((l, bw)) = &*state.bandwidths.lock().unwrap_or_else(|e| e.into_inner()) {
        if *l == label {
            return Ok(*bw);
        }
    }
    let device = engine.model.device().clone();
    let bw = tauri::async_runtime::spawn_blocking(move || Bandwidths::measure(&device, BANDWIDTH_BYTES))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    *state.bandwidths.lock().unwrap_or_else(|e| e.into_inner()) = Some((label, bw));
    Ok(bw)
}

/// The planner's view of `file` with `method` under `settings`, and the bandwidths it used.
async fn plan_of(
    state: &AppState,
    settings: &EngineSettings,
    engine: &Engine,
    file: &ContextFile,
    method: &MethodChoice,
) -> Result<(Plan, Bandwidths), String> {
    let bw = bandwidths(state, engine).await?;
    let facts = ModelFacts {
        config: engine.config(),
        elem: engine.model.dtype().size_in_bytes(),
        weights: Some((engine.model.weights().device_bytes(), engine.model.weight_bytes_per_step())),
        weights_host: engine.model.weights().host_bytes,
    };
    let (tier, budgets) = (settings.tier(), settings.budgets()?);
    let planned = plan::plan(&facts, file.header(), method, tier, budgets, &bw).map_err(|e| e.to_string())?;
    if !planned.kv_on_disk {
        return Ok((planned, bw));
    }
    // On the file tier a step reads from disk too: the disk under this file, measured once.
    let path = file.path().to_owned();
    let known = state.disk_rate.lock().unwrap_or_else(|e| e.into_inner()).clone().filter(|(p, _)| *p == path);
    let measured = match known {
        Some((_, rate)) => Ok(Bandwidths { disk: Some(rate), ..bw }),
        None => {
            let at = path.clone();
            tauri::async_runtime::spawn_blocking(move || bw.with_disk(&at)).await.map_err(|e| e.to_string())?
        }
    };
    match measured {
        Ok(bw) => {
            *state.disk_rate.lock().unwrap_or_else(|e| e.into_inner()) = bw.disk.map(|rate| (path, rate));
            let replanned = plan::plan(&facts, file.header(), method, tier, budgets, &bw).map_err(|e| e.to_string())?;
            Ok((replanned, bw))
        }
        // (The plan without its disk term: a probe's failure does not stop the context opening.)
        Err(e) => {
            tracing::warn!(error = %e, "the disk under the context file was not measured");
            Ok((planned, bw))
        }
    }
}

/// A session over the context at `path` on `settings`' tier, keeping as many decoded layers
/// as the device budget holds; refused when the planner says the step does not fit.
pub(super) async fn open_session(
    state: &AppState,
    settings: &EngineSettings,
    engine: Arc<Engine>,
    path: &Path,
    method: &MethodChoice,
) -> Result<Session, String> {
    method.spec().and_then(|s| s.check_tier(settings.tier())).map_err(|e| e.to_string())?;
    let file = ContextFile::open(path).map_err(|e| e.to_string())?;
    engine.check_context(&file).map_err(|e| e.to_string())?;
    let (planned, _) = plan_of(state, settings, &engine, &file, method).await?;
    plan::check(&planned).map_err(|e| e.to_string())?;
    let resident = match settings.budgets()?.device {
        Some(_) => planned.kv_device_bytes,
        None => RESIDENT_BUDGET,
    };
    let (tier, file) = (settings.tier(), Arc::new(file));
    tauri::async_runtime::spawn_blocking(move || Session::over_within(engine, file, tier, resident))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// The planner's view of the open context with the chat's method, and the bandwidths it used.
#[derive(Serialize, ts_rs::TS)]
pub(super) struct PlanView {
    plan: Plan,
    bandwidths: Bandwidths,
    device: String,
}

#[tauri::command]
pub(super) async fn memory_plan(state: State<'_, AppState>, method: Option<MethodChoice>) -> Result<PlanView, String> {
    let engine = state.engine()?;
    let path = state.open_context_info("open a context to see where its K/V lives").await?.path;
    let settings = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let method = method.unwrap_or_else(|| state.method.lock().unwrap_or_else(|e| e.into_inner()).clone());
    method.check().map_err(|e| e.to_string())?;
    let file = ContextFile::open(&path).map_err(|e| e.to_string())?;
    let (plan, bandwidths) = plan_of(&state, &settings, &engine, &file, &method).await?;
    Ok(PlanView { plan, bandwidths, device: device_name(engine.model.device()) })
}
