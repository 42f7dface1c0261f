//! The TypeScript declarations of what the window and the Rust side send each other, generated
//! from the Rust types (ts-rs) into ui/src/lib/bindings/, one file per type.
//!
//! Why generated: the UI's types were copied by hand from these structs and drifted (a field
//! renamed on one side only shows up as `undefined` at run time, in a screen nobody opened).
//! The test below writes every type into a temporary folder and fails when ui/src/lib/bindings
//! differs from it, naming the file; `FOLIO_WRITE_BINDINGS=1 cargo test -p folio bindings`
//! rewrites the folder (the test command then passes). Large integers (u64, usize, i64) are
//! `number`: every value the window sees (token counts, bytes, ids) is far below 2^53.

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    use ts_rs::{Config, TS};

    use super::super as gui;

    /// Where the UI imports the declarations from.
    fn bindings_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../ui/src/lib/bindings")
    }

    /// Every type of every command and event (their fields' types follow through `export_all`).
    fn export(dir: &Path) -> Result<(), ts_rs::ExportError> {
        let cfg = Config::new().with_large_int("number").with_out_dir(dir);
        gui::AppInfo::export_all(&cfg)?;
        gui::UiEvent::export_all(&cfg)?;
        gui::ask::ChatEvent::export_all(&cfg)?;
        gui::ask::ChatDone::export_all(&cfg)?;
        gui::chats::OpenedChat::export_all(&cfg)?;
        gui::details::AnswerDetails::export_all(&cfg)?;
        gui::chats::CompareProgress::export_all(&cfg)?;
        gui::contexts::Imported::export_all(&cfg)?;
        gui::engine::EngineView::export_all(&cfg)?;
        gui::engine::Applied::export_all(&cfg)?;
        gui::engine::PlanView::export_all(&cfg)?;
        gui::models::ModelChoices::export_all(&cfg)?;
        gui::prefill::CountProgress::export_all(&cfg)?;
        gui::prefill::ChangeRequest::export_all(&cfg)?;
        gui::settings::ContextDefault::export_all(&cfg)?;
        gui::choices::Choices::export_all(&cfg)?;
        gui::choices::MeasureProgress::export_all(&cfg)?;
        gui::settings::MethodApplied::export_all(&cfg)?;
        gui::settings::IndexProgress::export_all(&cfg)?;
        gui::settings::CalibrationStatus::export_all(&cfg)?;
        gui::settings::CalibrationProgress::export_all(&cfg)?;
        gui::server::ServerStatus::export_all(&cfg)?;
        gui::download::Lookup::export_all(&cfg)?;
        folio_models::download::DownloadProgress::export_all(&cfg)?;
        folio_library::ContextInfo::export_all(&cfg)?;
        folio_library::DocumentInfo::export_all(&cfg)?;
        folio_library::ChatInfo::export_all(&cfg)?;
        folio_models::attention::MethodSpec::export_all(&cfg)?;
        folio_models::attention::MethodChoice::export_all(&cfg)?;
        folio_models::context::staging::Staged::export_all(&cfg)?;
        folio_models::context::staging::Estimate::export_all(&cfg)?;
        folio_models::engine::StoredIndex::export_all(&cfg)?;
        folio_models::session::GenerationSettings::export_all(&cfg)?;
        folio_models::excerpt::DocumentExcerpts::export_all(&cfg)?;
        Ok(())
    }

    /// Every .ts file under `dir` (ts-rs puts library types in subfolders), by relative path.
    fn files(dir: &Path) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else { continue };
            for path in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
                if path.is_dir() {
                    todo.push(path);
                } else if path.extension().is_some_and(|x| x == "ts") {
                    let name = path.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                    out.insert(name, std::fs::read_to_string(&path).unwrap());
                }
            }
        }
        out
    }

    #[test]
    fn bindings_are_the_generated_ones() {
        if std::env::var("FOLIO_WRITE_BINDINGS").as_deref() == Ok("1") {
            let dir = bindings_dir();
            for name in files(&dir).keys() {
                std::fs::remove_file(dir.join(name)).unwrap();
            }
            export(&dir).unwrap();
            return;
        }
        let fresh = tempfile::tempdir().unwrap();
        export(fresh.path()).unwrap();
        let (want, have) = (files(fresh.path()), files(&bindings_dir()));
        for (name, text) in &want {
            assert!(
                have.get(name) == Some(text),
                "ui/src/lib/bindings/{name} differs from the Rust types: run FOLIO_WRITE_BINDINGS=1 cargo test -p folio bindings"
            );
        }
        for name in have.keys() {
            assert!(want.contains_key(name), "ui/src/lib/bindings/{name} is no longer generated: delete it");
        }
    }
}
