//! Re-creating the library's context rows from the context files in folders: the files are
//! self-describing (model, tokens, documents), so a lost or damaged database costs no prefill.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use folio_context_file::format::MAGIC;
use serde::Serialize;

use crate::contexts::{absolute, OnDisk, Status};
use crate::{Error, Library, Result, DATABASE_FILE};

/// What [`Library::rebuild`] found and did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RebuildReport {
    /// Contexts the library did not list before.
    pub added: Vec<PathBuf>,
    /// Contexts it listed, brought up to date with their files.
    pub refreshed: Vec<PathBuf>,
    /// Context files (or partial folders) that do not read, each with the reason.
    pub skipped: Vec<(PathBuf, String)>,
    /// Contexts the library lists whose files are gone.
    pub missing: Vec<PathBuf>,
}

/// The suffix of an interrupted prefill's folder (`context::partial_dir`).
const PARTIAL_SUFFIX: &str = ".partial";

impl Library {
    /// Makes the library agree with the context files in `folders` (not their subfolders): every
    /// context file and interrupted prefill there is added or refreshed, and every context the
    /// library lists is checked against its file. Chats and settings are kept.
    pub async fn rebuild(&self, folders: &[PathBuf]) -> Result<RebuildReport> {
        let mut found = BTreeSet::new();
        for folder in folders {
            found.extend(scan(folder)?);
        }
        let mut report = RebuildReport::default();
        for path in found {
            let known = self.find(&path.to_string_lossy()).await.is_ok();
            match OnDisk::read(&path) {
                OnDisk::Damaged(why) if !known => report.skipped.push((path, why)),
                disk => {
                    self.store(&path, disk, true).await?;
                    if known {
                        report.refreshed.push(path)
                    } else {
                        report.added.push(path)
                    }
                }
            }
        }
        for c in self.contexts().await? {
            match c.status {
                Status::Missing => report.missing.push(c.path),
                Status::Damaged if !report.skipped.iter().any(|(p, _)| *p == c.path) => {
                    report.skipped.push((c.path, c.problem.unwrap_or_default()))
                }
                _ => {}
            }
        }
        Ok(report)
    }

    /// `folio library rebuild` and the window's "Rebuild the library": opens the library in
    /// `home` — setting a damaged database aside first ([`Library::rebuild_damaged`]) — and
    /// rebuilds it from `folders` (default: its contexts folder, created if missing). Returns
    /// the library, where a damaged database went, and the report.
    pub async fn rebuild_home(home: &Path, folders: &[PathBuf]) -> Result<(Self, Option<PathBuf>, RebuildReport)> {
        let (lib, set_aside) = match Self::open(home).await {
            Ok(lib) => (lib, None),
            Err(Error::Corrupt { .. }) => {
                let (lib, aside) = Self::rebuild_damaged(home).await?;
                (lib, Some(aside))
            }
            Err(e) => return Err(e),
        };
        let own = lib.contexts_folder();
        let folders = if folders.is_empty() { vec![own.clone()] } else { folders.to_vec() };
        if folders.contains(&own) {
            std::fs::create_dir_all(&own).map_err(|e| Error::io(&own, e))?;
        }
        let report = lib.rebuild(&folders).await?;
        Ok((lib, set_aside, report))
    }

    /// Sets the database in `home` aside — renamed `library.sqlite3.damaged-<time>`, with its
    /// journal files — and opens a new, empty one; for a database [`Library::open`] reports
    /// as [`Error::Corrupt`]. Returns the new library and where the old file went.
    pub async fn rebuild_damaged(home: &Path) -> Result<(Self, PathBuf)> {
        let db = home.join(DATABASE_FILE);
        let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%SZ");
        let aside = home.join(format!("{DATABASE_FILE}.damaged-{stamp}"));
        for suffix in ["", "-wal", "-shm"] {
            let (from, to) = (with_suffix(&db, suffix), with_suffix(&aside, suffix));
            match std::fs::rename(&from, &to) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&from, e)),
                _ => {}
            }
        }
        Ok((Self::open(home).await?, aside))
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The context paths in `folder`: files that start with the context magic, and the outputs of
/// interrupted prefills (their `.partial` folders with a checkpoint).
fn scan(folder: &Path) -> Result<Vec<PathBuf>> {
    let folder = absolute(folder)?;
    let entries = std::fs::read_dir(&folder).map_err(|e| Error::io(&folder, e))?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(&folder, e))?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            if let Some(out) = name.strip_suffix(PARTIAL_SUFFIX) {
                if path.join("checkpoint.json").is_file() {
                    found.push(folder.join(out));
                }
            }
        } else if kind.is_file() && starts_with_magic(&path) {
            found.push(path);
        }
    }
    Ok(found)
}

fn starts_with_magic(path: &Path) -> bool {
    let mut head = [0u8; MAGIC.len()];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok() && head == MAGIC
}
