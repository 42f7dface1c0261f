//! Writing without losing anything: a file is replaced by a complete, fsynced new one renamed
//! over it (a crash leaves the old or the new content, never a mix), and only a regular file is
//! ever replaced — renaming over a device, a named pipe, a folder or a symbolic link would put
//! a regular file in its place silently.

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};
use crate::platform::{special, Special};

/// Fsyncs the folder holding `path`, so that a rename into it survives a crash.
pub fn sync_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))
}

/// Replaces `path` with `bytes` so that a crash leaves the old or the new content, never a mix:
/// temp file beside it, fsync, rename, fsync the folder.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| Error::io(&tmp, e))?;
    check_replaceable(path)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    sync_dir(path)
}

/// Moves `from` to `to` only if nothing is at `to`, with no window between the check and the
/// move in which a file that appears there would be replaced: a hard link is made at `to` (which
/// fails when anything is there) and `from` unlinked. On a file system without hard links (FAT,
/// exFAT) the check and the rename are two steps. `AlreadyExists` when `to` is taken.
pub fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    match std::fs::hard_link(from, to) {
        // Where `from` cannot be unlinked, the move is undone: one name, as before — unless
        // `from` is gone already (moved meanwhile): `to` is then the only name left.
        Ok(()) => match std::fs::remove_file(from) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => {
                let _ = std::fs::remove_file(to);
                Err(e)
            }
            Ok(()) => Ok(()),
        },
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(e),
        Err(_) if std::fs::symlink_metadata(to).is_ok() => Err(std::io::ErrorKind::AlreadyExists.into()),
        Err(_) => std::fs::rename(from, to),
    }
}

/// Refuses to replace anything at `path` but a regular file: an atomic write renames a new
/// file over the path, which would silently put a regular file in place of a device
/// (`/dev/full`), a named pipe, a folder or a symbolic link (the link, not its target).
pub fn check_replaceable(path: &Path) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(path, e)),
    };
    let t = meta.file_type();
    let what = match special(&t) {
        None => return Ok(()),
        Some(Special::Link) => {
            let target = std::fs::read_link(path).map(|t| t.display().to_string()).unwrap_or_default();
            return Err(Error::Invalid(format!(
                "{} is a symbolic link (to {target}): Folio would replace the link with a new file and leave its \
                 target as it is; name the target itself, or remove the link first",
                path.display()
            )));
        }
        Some(kind) => kind.words(),
    };
    Err(Error::Invalid(format!(
        "{} is {what}, not a file: Folio writes a context only to a new file or over a regular one",
        path.display()
    )))
}

/// Reads the regular file at `path` whole, refusing what would never end or never fit: a
/// device (`/dev/zero` reads forever), a named pipe (blocks until a writer comes), a folder,
/// and a file over `limit` bytes (`what` names the input in the messages).
pub fn read_input(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if let Some(kind) = special(&meta.file_type()) {
        let kind = kind.words();
        return Err(Error::Invalid(format!("{} is {kind}, not a file: {what} must be a regular file", path.display())));
    }
    let too_big = || {
        Error::Invalid(format!("{} is larger than {} MiB, the most Folio reads as {what}", path.display(), limit >> 20))
    };
    if meta.len() > limit {
        return Err(too_big());
    }
    // The size can change between the check and the read (a file still being written).
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(too_big());
    }
    Ok(bytes)
}
