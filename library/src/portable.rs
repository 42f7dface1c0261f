//! Export and import of context files: the portable file (prefill on a big GPU, chat on a
//! laptop). A copy is verified against every section checksum before it is listed, and is
//! written to a temporary name, fsynced and renamed, so a failed or interrupted copy never
//! leaves a file that looks finished.

use std::path::{Path, PathBuf};

use folio_context_file::ContextFile;

use crate::contexts::{absolute, ContextInfo, Status};
use crate::{Error, Library, Result};

/// Suffix of a copy in progress.
const COPYING_SUFFIX: &str = ".copying";
/// Free names an import tries when other imports keep taking them first.
const NAME_TRIES: usize = 8;

impl Library {
    /// Lists the context file `file` after checking every checksum in it (a broken copy or
    /// download is refused with the damaged section named). With `copy`, it is first copied
    /// into the library's contexts folder (under a free name); otherwise it is listed where it
    /// is.
    pub async fn import(&self, file: &Path, copy: bool) -> Result<ContextInfo> {
        let verified = file.to_owned();
        tokio::task::spawn_blocking(move || ContextFile::open(&verified)?.verify().map(|_| ()))
            .await
            .map_err(|e| Error::Refused(format!("verifying {}: {e}", file.display())))??;
        if !copy {
            return self.add_context(&absolute(file)?).await;
        }
        let stem = file.file_stem().map_or_else(|| "context".into(), |s| s.to_string_lossy().into_owned());
        // Another import may take the free name first: the copy never replaces it, and the next
        // free name is tried.
        let mut tries = 0;
        let to = loop {
            let to = self.free_context_path(&stem)?;
            let (from, dest) = (file.to_owned(), to.clone());
            let copied = tokio::task::spawn_blocking(move || copy_atomic(&from, &dest))
                .await
                .map_err(|e| Error::Refused(format!("copying {}: {e}", file.display())))?;
            match copied {
                Err(e) if is_taken(&e) && tries < NAME_TRIES => tries += 1,
                other => break other.map(|()| to)?,
            }
        };
        // The copy and its row land together: a file the library refuses to list is not left
        // behind in its folder with no row.
        let listed = self.add_context(&to).await;
        if listed.is_err() {
            let _ = std::fs::remove_file(&to);
        }
        listed
    }

    /// Copies a ready context's file to `dest` (a folder, or the new file's path), atomically;
    /// an existing file is never overwritten. Returns the copy's path.
    pub async fn export(&self, id: i64, dest: &Path) -> Result<PathBuf> {
        let info = self.context(id).await?;
        if info.status != Status::Ready {
            return Err(Error::Refused(format!(
                "{} is {}: only a ready context can be exported",
                info.path.display(),
                info.status.as_str()
            )));
        }
        let to = if dest.is_dir() { dest.join(info.path.file_name().unwrap_or_default()) } else { dest.to_owned() };
        if to.exists() {
            return Err(Error::Refused(format!(
                "{} already exists: export elsewhere or remove it first",
                to.display()
            )));
        }
        let (from, dest) = (info.path.clone(), to.clone());
        let copied = tokio::task::spawn_blocking(move || copy_atomic(&from, &dest))
            .await
            .map_err(|e| Error::Refused(format!("copying {}: {e}", info.path.display())))?;
        match copied {
            Err(e) if is_taken(&e) => {
                Err(Error::Refused(format!("{} already exists: export elsewhere or remove it first", to.display())))
            }
            other => other.map(|()| to),
        }
    }
}

impl Library {
    /// A path for a new context named `stem` in the library's contexts folder (created if
    /// missing): `stem.folio`, or `stem (2).folio`, … whichever no file or prefill uses.
    pub fn free_context_path(&self, stem: &str) -> Result<PathBuf> {
        let folder = self.contexts_folder();
        std::fs::create_dir_all(&folder).map_err(|e| Error::io(&folder, e))?;
        Ok((1..)
            .map(
                |n| {
                    if n == 1 {
                        folder.join(format!("{stem}.folio"))
                    } else {
                        folder.join(format!("{stem} ({n}).folio"))
                    }
                },
            )
            .find(|p| !p.exists() && !folio_context_file::partial_dir(p).exists())
            .expect("an unbounded search finds a free name"))
    }
}

/// Whether a copy failed because its destination appeared meanwhile.
fn is_taken(e: &Error) -> bool {
    matches!(e, Error::Io { error, .. } if error.kind() == std::io::ErrorKind::AlreadyExists)
}

/// Copies `from` to `to` through `to.copying-PID-N` (its own per copy, so that two copies to
/// one name never write one file): copied, fsynced, moved to `to` unless something
/// is there by then (never replaced: an `AlreadyExists` error), the folder fsynced.
fn copy_atomic(from: &Path, to: &Path) -> Result<()> {
    let mut tmp = to.as_os_str().to_owned();
    static COPIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tmp.push(format!("{COPYING_SUFFIX}-{}-{n}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        std::fs::copy(from, &tmp).map_err(|e| Error::io(from, e))?;
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| Error::io(&tmp, e))?;
        folio_context_file::atomic::rename_no_replace(&tmp, to).map_err(|e| Error::io(to, e))?;
        let folder = to.parent().unwrap_or(Path::new("."));
        std::fs::File::open(folder).and_then(|f| f.sync_all()).map_err(|e| Error::io(folder, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
