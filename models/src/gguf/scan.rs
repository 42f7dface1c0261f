//! The GGUF files already on this computer: LM Studio's and Jan's model folders, listed with
//! what a person chooses by (size, architecture, quantisation) and, for a file Folio cannot
//! run, why — the same reasons `--model` would give, read from the header alone.

use std::path::{Path, PathBuf};

use super::{is_gguf, GgufFile};

/// Folders below a model folder that are searched (LM Studio keeps `publisher/repo/file.gguf`).
const MAX_DEPTH: usize = 4;
/// Files listed at most, so a huge folder cannot stall the window.
const MAX_FILES: usize = 500;

/// The model folders of the apps people keep GGUF files with, under `home`: LM Studio's
/// (current and older layout) and Jan's (current and older layout).
pub fn app_folders(home: &Path) -> Vec<PathBuf> {
    [".lmstudio/models", ".cache/lm-studio/models", ".local/share/Jan/data/llamacpp/models", "jan/models"]
        .iter()
        .map(|p| home.join(p))
        .filter(|p| p.is_dir())
        .collect()
}

/// A GGUF file found on disk.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct GgufListing {
    /// What `--model` takes.
    pub path: PathBuf,
    /// The file name.
    pub name: String,
    #[cfg_attr(feature = "ts", ts(type = "number"))]
    pub bytes: u64,
    pub architecture: Option<String>,
    /// `Q4_K_M`, `F16`, …
    pub quantization: Option<String>,
    /// Why Folio cannot run it, when it cannot.
    pub problem: Option<String>,
}

/// The `.gguf` files under `folders` (sorted by path), each with its facts or its problem.
pub fn scan(folders: &[PathBuf]) -> Vec<GgufListing> {
    let mut files = Vec::new();
    for folder in folders {
        collect(folder, 0, &mut files);
    }
    files.sort();
    files.dedup();
    files.truncate(MAX_FILES);
    files.iter().map(|p| listing(p)).collect()
}

fn collect(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() && depth < MAX_DEPTH {
            collect(&path, depth + 1, out);
        } else if (kind.is_file() || kind.is_symlink()) && is_gguf(&path) && out.len() < MAX_FILES {
            out.push(path);
        }
    }
}

/// One file's facts, or its problem (the message `--model` would give, less the path).
pub fn listing(path: &Path) -> GgufListing {
    let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let bytes = std::fs::metadata(path).map_or(0, |m| m.len());
    let mut out =
        GgufListing { path: path.to_owned(), name, bytes, architecture: None, quantization: None, problem: None };
    let prefix = format!("{}: ", path.display());
    let without_path = |e: crate::error::Error| e.to_string().trim_start_matches(&prefix).to_owned();
    match GgufFile::open(path) {
        Ok(file) => {
            out.architecture = file.string("general.architecture").ok().flatten().map(str::to_owned);
            out.quantization = Some(file.quantization().name);
            let parts = file.uint("split.count").ok().flatten().unwrap_or(1);
            out.problem = if parts > 1 {
                Some(format!("one part of a model split in {parts} files; Folio reads single-file GGUFs"))
            } else {
                file.config().err().or_else(|| file.vocab().err()).map(without_path)
            };
        }
        Err(e) => out.problem = Some(without_path(e)),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LM Studio's layout is found, each file with its facts; a file that is not a model says why.
    #[test]
    fn the_apps_folders_are_listed_with_facts_and_problems() {
        let home = tempfile::tempdir().unwrap();
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf");
        let lm = home.path().join(".lmstudio/models/folio/llama256");
        std::fs::create_dir_all(&lm).unwrap();
        std::fs::copy(fixtures.join("llama256-Q4_K_M.gguf"), lm.join("llama256-Q4_K_M.gguf")).unwrap();
        let jan = home.path().join("jan/models");
        std::fs::create_dir_all(&jan).unwrap();
        std::fs::write(jan.join("broken.gguf"), b"GGUF").unwrap();
        std::fs::write(jan.join("notes.txt"), b"not a model").unwrap();
        let folders = app_folders(home.path());
        assert_eq!(folders.len(), 2);
        let found = scan(&folders);
        assert_eq!(found.len(), 2, "{found:?}");
        let broken = found.iter().find(|f| f.name == "broken.gguf").unwrap();
        assert!(broken.problem.as_deref().unwrap().contains("truncated"), "{broken:?}");
        let q4 = found.iter().find(|f| f.name == "llama256-Q4_K_M.gguf").unwrap();
        assert_eq!((q4.architecture.as_deref(), q4.quantization.as_deref()), (Some("llama"), Some("Q4_K_M")));
        assert_eq!((q4.problem.as_ref(), q4.bytes), (None, 937_984));
    }
}
