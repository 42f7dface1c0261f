//! How the window answers: the attention method — every method of the engine's registry, with
//! its budget and knobs, checked by the same validation as the CLI's `--method` — and the
//! generation settings (temperature, top-p, top-k, answer length, seed), checked as the decode
//! loop checks them. Both belong to the chat on screen (stored with it in the library) and
//! apply to its next answer over the same saved context, with no prefill: the engine's session
//! builds the method (and its index, when it has one) from the saved K/V.

use folio_library::context_method_key;
use folio_models::attention::{Budget, MethodChoice, MethodSpec, REGISTRY};
use folio_models::session::GenerationSettings;
use tauri::State;

use super::AppState;

/// The keys of a chat's settings (JSON) that hold its method and generation settings.
const METHOD_KEY: &str = "method";
const GENERATION_KEY: &str = "generation";

/// The registry: each method's summary, paper, default budget, knobs, needs and tiers.
#[tauri::command]
pub(super) fn methods() -> Vec<&'static MethodSpec> {
    REGISTRY.to_vec()
}

/// The method the next answer uses.
#[tauri::command]
pub(super) fn method(state: State<'_, AppState>) -> MethodChoice {
    state.method.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// A method applied, and what the person should know about it.
#[derive(serde::Serialize, ts_rs::TS)]
pub(super) struct MethodApplied {
    choice: MethodChoice,
    /// Said beside Apply: a budget the open context cannot fill reads all of it (as dense).
    note: Option<String>,
}

/// Sets the method of the chat on screen after checking it against the registry (and the
/// session's tier); refused, the method stays what it was. Saved with the chat when it is one.
#[tauri::command]
pub(super) async fn set_method(state: State<'_, AppState>, choice: MethodChoice) -> Result<MethodApplied, String> {
    let choice = MethodChoice {
        method: choice.method.trim().to_owned(),
        budget: choice.budget.map(|b| b.trim().to_owned()).filter(|b| !b.is_empty()),
        params: choice.params.into_iter().filter(|(_, v)| !v.trim().is_empty()).collect(),
    };
    choice.check().map_err(|e| e.to_string())?;
    let chat = state.chat.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut note = None;
    if let Some(chat) = chat {
        // The session's tier decides which methods run; while it answers, it is busy.
        let session = chat.try_lock().map_err(|_| "wait for the answer to finish, then apply".to_owned())?;
        session.0.check_method(&choice).map_err(|e| e.to_string())?;
        note = session.0.context().and_then(|file| whole_context(&choice, file.tokens().len()));
    }
    *state.method.lock().unwrap_or_else(|e| e.into_inner()) = choice.clone();
    save(&state).await?;
    Ok(MethodApplied { choice, note })
}

/// What to say of a budget that covers a whole context of `tokens`: the engine reads at most
/// every row (the budget is clamped), so the method reads what dense reads, at its own cost.
fn whole_context(choice: &MethodChoice, tokens: usize) -> Option<String> {
    let budget = choice.budget().ok()??;
    let whole = match budget {
        Budget::Tokens(n) => n >= tokens,
        Budget::Fraction(f) => f >= 1.0,
    };
    whole.then(|| {
        format!(
            "A budget of {} covers this whole context ({} tokens): {} reads every row of the documents, as dense does",
            human_budget(&budget),
            thousands(tokens),
            choice.method
        )
    })
}

fn human_budget(budget: &Budget) -> String {
    match budget {
        Budget::Tokens(n) => format!("{} tokens", thousands(*n)),
        Budget::Fraction(_) => budget.text(),
    }
}

/// 1234567 → "1,234,567", as the window writes counts.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The generation settings the next answer uses.
#[tauri::command]
pub(super) fn generation(state: State<'_, AppState>) -> GenerationSettings {
    state.generation.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Sets the generation settings of the chat on screen after checking them; refused, they stay
/// what they were. Saved with the chat when it is one.
#[tauri::command]
pub(super) async fn set_generation(
    state: State<'_, AppState>,
    settings: GenerationSettings,
) -> Result<GenerationSettings, String> {
    settings.check(&*state.engine()?).map_err(|e| e.to_string())?;
    *state.generation.lock().unwrap_or_else(|e| e.into_inner()) = settings.clone();
    save(&state).await?;
    Ok(settings)
}

/// Stores the method and generation settings with the chat on screen, if it is saved.
pub(super) async fn save(state: &AppState) -> Result<(), String> {
    let Some(id) = *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) else { return Ok(()) };
    let choice = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let generation = state.generation.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let settings = serde_json::json!({ METHOD_KEY: choice, GENERATION_KEY: generation });
    state.library()?.set_chat_settings(id, &settings).await.map_err(|e| e.to_string())
}

/// The method a chat's stored settings hold, when this Folio still reads it.
pub(super) fn stored_method(settings: &serde_json::Value) -> Option<MethodChoice> {
    let method = settings.get(METHOD_KEY).and_then(|v| serde_json::from_value::<MethodChoice>(v.clone()).ok());
    method.filter(|c| c.check().is_ok())
}

/// Restores a chat's stored settings (those this Folio still reads; the others keep their
/// values).
pub(super) fn restore(state: &AppState, settings: Option<&serde_json::Value>) {
    let Some(settings) = settings else { return };
    if let Some(choice) = stored_method(settings) {
        *state.method.lock().unwrap_or_else(|e| e.into_inner()) = choice;
    }
    let generation = settings.get(GENERATION_KEY).and_then(|v| serde_json::from_value(v.clone()).ok());
    if let Some(generation) = generation {
        *state.generation.lock().unwrap_or_else(|e| e.into_inner()) = generation;
    }
}

/// The default method of context `id`: what a new chat over it starts with.
pub(super) async fn context_method(state: &AppState, id: i64) -> Option<MethodChoice> {
    let value = state.library().ok()?.setting(&context_method_key(id)).await.ok().flatten()?;
    serde_json::from_value::<MethodChoice>(value).ok().filter(|c| c.check().is_ok())
}

/// The context the chat is over (its library id), and its default method.
#[derive(serde::Serialize, ts_rs::TS)]
pub(super) struct ContextDefault {
    context: Option<i64>,
    method: Option<MethodChoice>,
}

#[tauri::command]
pub(super) async fn open_context_method(state: State<'_, AppState>) -> Result<ContextDefault, String> {
    let context = *state.open_context.lock().unwrap_or_else(|e| e.into_inner());
    let method = match context {
        Some(id) => context_method(&state, id).await,
        None => None,
    };
    Ok(ContextDefault { context, method })
}

/// Makes the method in use the open context's default (new chats over it start with it).
#[tauri::command]
pub(super) async fn set_context_method(state: State<'_, AppState>) -> Result<MethodChoice, String> {
    let id = state.open_context_id("open a context first")?;
    let choice = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let value = serde_json::to_value(&choice).map_err(|e| e.to_string())?;
    state.library()?.set_setting(&context_method_key(id), &value).await.map_err(|e| e.to_string())?;
    Ok(choice)
}

/// How far an index build has got.
#[derive(Clone, serde::Serialize, ts_rs::TS)]
pub(super) struct IndexProgress {
    layer: usize,
    layers: usize,
}

/// Builds the index of the method in use over the open context and stores it in the file
/// (`Engine::store_index`, as `folio context index`); Stop stops it with the file unchanged.
/// The context's library row is refreshed and the chat reopened on the new file, its
/// conversation kept.
#[tauri::command]
pub(super) async fn build_index(
    state: State<'_, AppState>,
    on_event: tauri::ipc::Channel<IndexProgress>,
) -> Result<folio_models::engine::StoredIndex, String> {
    let info = state.open_context_info("open a context first").await?;
    let (id, path) = (info.id, info.path);
    super::not_being_written(&state, id).await?;
    let engine = state.engine()?;
    let lib = state.library()?;
    let choice = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let chat = super::current_chat(&state)?;
    let asked = chat.clone();
    let cancel = state.cancel.clone();
    let (building, at) = (engine.clone(), path.clone());
    let stored = tauri::async_runtime::spawn_blocking(move || {
        // Not while an answer reads the file; a question asked meanwhile waits.
        let guard = chat.lock().unwrap_or_else(|e| e.into_inner());
        cancel.store(false, std::sync::atomic::Ordering::SeqCst);
        let stored = building.store_index(&at, &choice, |layer, layers| {
            let _ = on_event.send(IndexProgress { layer, layers });
            super::until_stopped(&cancel)
        });
        let turns = guard.1.messages.clone();
        drop(guard);
        stored.map(|s| (s, turns)).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())??;
    let (stored, turns) = stored;
    lib.add_context(&path).await.map_err(|e| e.to_string())?;
    let settings = state.engine_settings.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let method = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let session = super::engine::open_session(&state, &settings, engine, &path, &method).await?;
    // Still the chat on screen? (Another one opened meanwhile opens the new file itself.)
    let mut current = state.chat.lock().unwrap_or_else(|e| e.into_inner());
    let same = current.as_ref().is_some_and(|c| std::sync::Arc::ptr_eq(c, &asked))
        && *state.open_context.lock().unwrap_or_else(|e| e.into_inner()) == Some(id);
    if same {
        *current = Some(super::chat_of(session, Some(turns)));
    }
    Ok(stored)
}

/// Whether the running model has Double Sparsity's channel calibration, and where.
#[derive(serde::Serialize, ts_rs::TS)]
pub(super) struct CalibrationStatus {
    /// The calibration file read, when there is one.
    found: Option<std::path::PathBuf>,
    /// Why there is none (or why it is refused).
    missing: Option<String>,
}

fn calibration_status(engine: &folio_models::Engine) -> CalibrationStatus {
    use folio_models::calibrate::Calibration;
    let found = engine
        .calibration_source()
        .and_then(|dir| engine.stamp().and_then(|stamp| Calibration::load(&dir, stamp)).map(|_| dir));
    match found {
        Ok(dir) => CalibrationStatus { found: Some(Calibration::path(&dir)), missing: None },
        Err(e) => CalibrationStatus { found: None, missing: Some(e.to_string()) },
    }
}

#[tauri::command]
pub(super) async fn calibration(state: State<'_, AppState>) -> Result<CalibrationStatus, String> {
    let engine = state.engine()?;
    tauri::async_runtime::spawn_blocking(move || calibration_status(&engine)).await.map_err(|e| e.to_string())
}

/// How far a calibration has got, in blocks.
#[derive(Clone, serde::Serialize, ts_rs::TS)]
pub(super) struct CalibrationProgress {
    done: usize,
    total: usize,
}

/// Double Sparsity's calibration for the running model, measured on the open context's
/// documents (their tokens from the file, as the prefill read them) and kept in Folio's home
/// (`Engine::calibration_dir`), so model folders are never written.
#[tauri::command]
pub(super) async fn calibrate(
    state: State<'_, AppState>,
    on_event: tauri::ipc::Channel<CalibrationProgress>,
) -> Result<CalibrationStatus, String> {
    use folio_models::calibrate::{calibrate, DEFAULT_BLOCKS};
    let engine = state.engine()?;
    let path =
        state.open_context_info("open a context first: the calibration is measured on its documents").await?.path;
    tauri::async_runtime::spawn_blocking(move || {
        let file = folio_models::context::ContextFile::open(&path).map_err(|e| e.to_string())?;
        engine.check_context(&file).map_err(|e| e.to_string())?;
        let docs: Vec<(String, Vec<u32>)> =
            file.documents().iter().map(|d| (d.path.clone(), file.tokens()[d.start..d.end].to_vec())).collect();
        let made = calibrate(&engine, &docs, DEFAULT_BLOCKS, |done, total| {
            let _ = on_event.send(CalibrationProgress { done, total });
        })
        .map_err(|e| e.to_string())?;
        made.save(&engine.calibration_dir().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        Ok(calibration_status(&engine))
    })
    .await
    .map_err(|e| e.to_string())?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(method: &str, budget: Option<&str>) -> MethodChoice {
        MethodChoice { method: method.into(), budget: budget.map(Into::into), params: Vec::new() }
    }

    /// A budget the context cannot fill is said, in the window's numbers; one it can is not.
    #[test]
    fn a_budget_over_the_whole_context_is_said() {
        let note = whole_context(&choice("hip", Some("99999999")), 723).unwrap();
        assert!(
            note.contains("99,999,999 tokens covers this whole context (723 tokens): hip reads every row"),
            "{note}"
        );
        assert!(whole_context(&choice("hip", Some("100%")), 723).is_some());
        assert!(whole_context(&choice("hip", Some("700")), 723).is_none());
        assert!(whole_context(&choice("dense", None), 723).is_none(), "dense has no budget");
        assert_eq!(thousands(1_179_648), "1,179,648");
    }
}
