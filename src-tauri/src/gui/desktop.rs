//! What the window asks of the desktop: a folder opened in the file manager (a context's, the
//! log's). One place, so that another platform's way (Finder, Explorer) is added once.

use std::path::Path;

/// The desktop's command that opens a folder in its file manager.
#[cfg(target_os = "windows")]
const OPENER: &str = "explorer";
#[cfg(target_os = "macos")]
const OPENER: &str = "open";
#[cfg(not(any(target_os = "windows", target_os = "macos")))]
const OPENER: &str = "xdg-open";

/// Opens `folder` in the desktop's file manager.
pub(super) fn open_folder(folder: &Path) -> Result<(), String> {
    std::process::Command::new(OPENER)
        .arg(folder)
        .spawn()
        .map(|_| ())
        .map_err(|e| format!("could not open {} in the file manager ({OPENER}: {e})", folder.display()))
}
