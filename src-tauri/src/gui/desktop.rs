//! What the window asks of the desktop: a folder opened in the file manager (a context's, the
//! log's). One place, so that another platform's way (Finder, Explorer) is added once.

use std::path::Path;

/// Opens `folder` in the desktop's file manager.
pub(super) fn open_folder(folder: &Path) -> Result<(), String> {
    std::process::Command::new("xdg-open")
        .arg(folder)
        .spawn()
        .map(|_| ())
        .map_err(|e| format!("could not open {} in the file manager (xdg-open: {e})", folder.display()))
}
