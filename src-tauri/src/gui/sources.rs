//! A source clicked under an answer: the document's text at the passages the attention read
//! while answering (`folio_models::excerpt`, from the context file's tokens), checked against
//! the version of the context the answer was made over — a context grown or cut since moves
//! the positions, and a passage shown at the wrong place would be a false citation.

use folio_models::attention::reads::Passage;
use folio_models::context::ContextFile;
use folio_models::excerpt::{excerpts, DocumentExcerpts, AROUND};
use tauri::State;

use super::AppState;

/// The text of document `document` of the context the chat on screen is over, at `passages`
/// (an answer's sources); `context` is the id of the version the answer read (its details'
/// `context`), refused when the file is another version now.
#[tauri::command]
pub(super) async fn source_excerpts(
    state: State<'_, AppState>,
    document: usize,
    passages: Vec<Passage>,
    context: Option<String>,
) -> Result<DocumentExcerpts, String> {
    let engine = state.engine()?;
    let info = state.open_context_info("this chat is over no context: it has no sources to show").await?;
    tauri::async_runtime::spawn_blocking(move || {
        let file = ContextFile::open(&info.path).map_err(|e| e.to_string())?;
        engine.check_context(&file).map_err(|e| e.to_string())?;
        if context.as_deref().is_some_and(|c| c != file.context_id()) {
            return Err(format!(
                "{} has changed since this answer (documents were added or taken out): the positions it read \
                 are no longer where they were; ask again to see the sources of the current version",
                info.name
            ));
        }
        excerpts(&engine.tokenizer, &file, document, &passages, AROUND).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}
