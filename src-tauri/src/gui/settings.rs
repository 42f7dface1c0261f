//! The attention method the window answers with: every method of the engine's registry, with
//! its budget and knobs, checked by the same validation as the CLI's `--method`. The choice
//! belongs to the chat on screen (stored with it in the library) and applies to its next
//! answer over the same saved context, with no prefill: the engine's session builds the method
//! (and its index, when it has one) from the saved K/V.

use folio_models::attention::{MethodChoice, MethodSpec, REGISTRY};
use tauri::State;

use super::AppState;

/// The key of a chat's settings (JSON) that holds its method.
const METHOD_KEY: &str = "method";

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
    if let Some(chat) = state.chat.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        chat.lock().unwrap_or_else(|e| e.into_inner()).0.check_method(&choice).map_err(|e| e.to_string())?;
    }
    *state.method.lock().unwrap_or_else(|e| e.into_inner()) = choice.clone();
    save(&state).await?;
    Ok(choice)
}

/// Stores the method with the chat on screen, if it is saved.
pub(super) async fn save(state: &AppState) -> Result<(), String> {
    let Some(id) = *state.chat_id.lock().unwrap_or_else(|e| e.into_inner()) else { return Ok(()) };
    let choice = state.method.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let settings = serde_json::json!({ METHOD_KEY: choice });
    state.library()?.set_chat_settings(id, &settings).await.map_err(|e| e.to_string())
}

/// The method a chat's stored settings name (`None`: none stored, or one this Folio does not
/// know any more).
pub(super) fn of_chat(settings: Option<&serde_json::Value>) -> Option<MethodChoice> {
    let choice: MethodChoice = serde_json::from_value(settings?.get(METHOD_KEY)?.clone()).ok()?;
    choice.check().ok().map(|_| choice)
}
