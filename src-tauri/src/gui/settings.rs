//! How the window answers: the attention method — every method of the engine's registry, with
//! its budget and knobs, checked by the same validation as the CLI's `--method` — and the
//! generation settings (temperature, top-p, top-k, answer length, seed), checked as the decode
//! loop checks them. Both belong to the chat on screen (stored with it in the library) and
//! apply to its next answer over the same saved context, with no prefill: the engine's session
//! builds the method (and its index, when it has one) from the saved K/V.

use folio_models::attention::{MethodChoice, MethodSpec, REGISTRY};
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

/// Sets the method of the chat on screen after checking it against the registry (and the
/// session's tier); refused, the method stays what it was. Saved with the chat when it is one.
#[tauri::command]
pub(super) async fn set_method(state: State<'_, AppState>, choice: MethodChoice) -> Result<MethodChoice, String> {
    let choice = MethodChoice {
        method: choice.method.trim().to_owned(),
        budget: choice.budget.map(|b| b.trim().to_owned()).filter(|b| !b.is_empty()),
        params: choice.params.into_iter().filter(|(_, v)| !v.trim().is_empty()).collect(),
    };
    choice.check().map_err(|e| e.to_string())?;
    let chat = state.chat.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(chat) = chat {
        // The session's tier decides which methods run; while it answers, it is busy.
        let session = chat.try_lock().map_err(|_| "wait for the answer to finish, then apply".to_owned())?;
        session.0.check_method(&choice).map_err(|e| e.to_string())?;
    }
    *state.method.lock().unwrap_or_else(|e| e.into_inner()) = choice.clone();
    save(&state).await?;
    Ok(choice)
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
